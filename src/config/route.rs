use std::collections::HashSet;

use serde::Deserialize;

use super::{upstream::known, ConfigError};

/// `[[routes]]`: a model name (exact, or a glob with `*` and `?`) and its ordered targets.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub model: String,
    pub targets: Vec<TargetConfig>,
    /// Where a request goes when a target answers `context_length_exceeded`
    /// (typically a model with a larger context window).
    #[serde(default)]
    pub context_fallback: Option<TargetConfig>,
}

/// One target of a route: an upstream, and optionally the model to ask it for.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    pub upstream: String,
    #[serde(default)]
    pub model: Option<String>,
}

impl RouteConfig {
    pub(super) fn validate(&self, key: &str, upstreams: &HashSet<&str>) -> Result<(), ConfigError> {
        if self.model.trim().is_empty() {
            return Err(ConfigError::invalid(format!("{key}.model"), "must not be empty"));
        }
        if self.targets.is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.targets"),
                "at least one target is required",
            ));
        }
        for (i, target) in self.targets.iter().enumerate() {
            target.validate(&format!("{key}.targets[{i}]"), upstreams)?;
        }
        if let Some(fallback) = &self.context_fallback {
            fallback.validate(&format!("{key}.context_fallback"), upstreams)?;
        }
        Ok(())
    }

    pub fn is_glob(&self) -> bool {
        self.model.contains(['*', '?'])
    }
}

impl TargetConfig {
    fn validate(&self, key: &str, upstreams: &HashSet<&str>) -> Result<(), ConfigError> {
        if !known(upstreams, &self.upstream) {
            return Err(ConfigError::invalid(
                format!("{key}.upstream"),
                format_args!("no upstream named {:?}", self.upstream),
            ));
        }
        if self.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(ConfigError::invalid(format!("{key}.model"), "must not be empty when given"));
        }
        Ok(())
    }
}
