use std::collections::HashSet;

use serde::Deserialize;

use super::{upstream::known, ConfigError};

/// `[[routes]]`: a model name (exact, or a glob with `*` and `?`) and its ordered targets.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub model: String,
    pub targets: Vec<TargetConfig>,
    /// The concrete model ids a glob route serves, for model discovery (`GET /v1/models`
    /// lists them; a glob is not a model id a client can pick).
    #[serde(default)]
    pub models: Vec<String>,
    /// Where a request goes when a target answers `context_length_exceeded`
    /// (typically a model with a larger context window).
    #[serde(default)]
    pub context_fallback: Option<TargetConfig>,
    /// A JSON Schema file every answer on this route must match, even when the client
    /// asked for no format (agents that must always answer in a fixed envelope).
    #[serde(default)]
    pub response_schema: Option<String>,
    /// Overrides of `[validation]` for this route (`stream`).
    #[serde(default)]
    pub validation: super::validation::RouteValidation,
    /// Hedging (off by default): a non-streaming request whose first target has not
    /// answered after this long (`"300ms"`, or a percentile of that target's recent
    /// answer times, `"p95"`) also goes to the next target; the first answer wins.
    #[serde(default)]
    pub hedge_after: Option<HedgeAfter>,
    /// Targets that speak the other API: what their translation may lose.
    #[serde(default)]
    pub translate: TranslateConfig,
    /// The schema, loaded from `response_schema` and checked to compile.
    #[serde(skip)]
    pub response_schema_value: Option<std::sync::Arc<serde_json::Value>>,
}

/// One target of a route: an upstream, and optionally the model to ask it for.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    pub upstream: String,
    #[serde(default)]
    pub model: Option<String>,
    /// The answer cap sent to an Anthropic target when a translated request sets none
    /// (Anthropic requires one; without it such a request skips this target).
    #[serde(default)]
    pub max_tokens: Option<u64>,
}

/// `[routes.translate]`: a route's opt-in to named losses when a request is translated
/// for a target of the other API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TranslateConfig {
    /// Top-level request fields that may be dropped when the target has no equivalent
    /// (`["seed", "logprobs"]`); the answer names them in
    /// `x-backstop-translation-dropped`.
    #[serde(default)]
    pub drop: Vec<String>,
}

impl RouteConfig {
    pub(super) fn validate(&self, key: &str, upstreams: &HashSet<&str>) -> Result<(), ConfigError> {
        if self.model.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.model"),
                "must not be empty",
            ));
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
        if let Some(after) = self.hedge_after {
            if after == HedgeAfter::After(std::time::Duration::ZERO) {
                return Err(ConfigError::invalid(
                    format!("{key}.hedge_after"),
                    "must be greater than 0",
                ));
            }
            if self.targets.len() < 2 {
                return Err(ConfigError::invalid(
                    format!("{key}.hedge_after"),
                    "hedging needs a second target to send the hedge to",
                ));
            }
        }
        let pattern = wildmatch::WildMatch::new(&self.model);
        for (i, id) in self.models.iter().enumerate() {
            if id.trim().is_empty() || id.contains(['*', '?']) {
                return Err(ConfigError::invalid(
                    format!("{key}.models[{i}]"),
                    "must be a concrete model id (no glob characters)",
                ));
            }
            if !pattern.matches(id) {
                return Err(ConfigError::invalid(
                    format!("{key}.models[{i}]"),
                    format_args!(
                        "{id:?} is not served by this route's model {:?}",
                        self.model
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn is_glob(&self) -> bool {
        self.model.contains(['*', '?'])
    }
}

impl RouteConfig {
    /// Reads and compiles `response_schema` (relative paths against `base`).
    pub(super) fn load_schema(
        &mut self,
        key: &str,
        base: &std::path::Path,
    ) -> Result<(), ConfigError> {
        let Some(path) = &self.response_schema else {
            return Ok(());
        };
        let full = base.join(path);
        let text = std::fs::read_to_string(&full).map_err(|e| {
            ConfigError::invalid(key, format_args!("cannot read {}: {e}", full.display()))
        })?;
        let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            ConfigError::invalid(key, format_args!("{} is not JSON: {e}", full.display()))
        })?;
        // Such a schema compiles, but validating against it could recurse without end.
        crate::validation::shape::check_operator_schema(&schema)
            .map_err(|e| ConfigError::invalid(key, format_args!("{}: {e}", full.display())))?;
        jsonschema::validator_for(&schema).map_err(|e| {
            ConfigError::invalid(
                key,
                format_args!("{} is not a valid JSON Schema: {e}", full.display()),
            )
        })?;
        self.response_schema_value = Some(std::sync::Arc::new(schema));
        Ok(())
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
            return Err(ConfigError::invalid(
                format!("{key}.model"),
                "must not be empty when given",
            ));
        }
        if self
            .max_tokens
            .is_some_and(|n| n == 0 || n > crate::api::MAX_OUTPUT_TOKENS)
        {
            return Err(ConfigError::invalid(
                format!("{key}.max_tokens"),
                format_args!("must be from 1 to {}", crate::api::MAX_OUTPUT_TOKENS),
            ));
        }
        Ok(())
    }
}

/// When a hedge goes out: after a fixed delay, or at a percentile of the first target's
/// recent answer times (no hedge until it has answered [`HedgeAfter::MIN_SAMPLES`] times).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HedgeAfter {
    After(std::time::Duration),
    /// The quantile, in (0, 1).
    Percentile(f64),
}

impl HedgeAfter {
    pub const MIN_SAMPLES: usize = 20;
}

impl<'de> serde::Deserialize<'de> for HedgeAfter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if let Some(p) = text.strip_prefix('p') {
            return match p.parse::<f64>() {
                Ok(p) if p > 0.0 && p < 100.0 => Ok(HedgeAfter::Percentile(p / 100.0)),
                _ => Err(serde::de::Error::custom(
                    "expected a percentile from p1 to p99.9",
                )),
            };
        }
        humantime::parse_duration(&text)
            .map(HedgeAfter::After)
            .map_err(|_| {
                serde::de::Error::custom(
                    "expected a duration such as \"250ms\", or a percentile such as \"p95\"",
                )
            })
    }
}
