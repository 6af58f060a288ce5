use std::collections::HashSet;

use serde::Deserialize;

use super::{upstream::known, ConfigError};

/// `[[routes]]`: a model name (exact, or a glob with `*` and `?`) and its ordered targets.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub model: String,
    pub targets: Vec<TargetConfig>,
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
            if !known(upstreams, &target.upstream) {
                return Err(ConfigError::invalid(
                    format!("{key}.targets[{i}].upstream"),
                    format_args!("no upstream named {:?}", target.upstream),
                ));
            }
            if target.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
                return Err(ConfigError::invalid(
                    format!("{key}.targets[{i}].model"),
                    "must not be empty when given",
                ));
            }
        }
        Ok(())
    }

    pub fn is_glob(&self) -> bool {
        self.model.contains(['*', '?'])
    }
}
