use serde::Deserialize;

use super::ConfigError;
use crate::validation::{shape::ShapeLimits, RequestLimits, SchemaSettings};

/// `[validation]`: structured-output checks and corrective retries, and the limits on
/// the JSON schemas a request may carry (`response_format`, tool schemas).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValidationConfig {
    /// Corrective re-asks per target before the next target is tried.
    pub corrective_retries: u32,
    pub mode: ValidationMode,
    /// Compiled schemas kept per tenant (by content hash).
    pub schema_cache_size: u64,
    /// Estimated memory of the compiled schemas kept per tenant, in bytes; one tenant's
    /// schemas never evict another's.
    pub schema_cache_bytes: u64,
    /// Largest schema, serialized, in bytes.
    pub max_schema_bytes: usize,
    /// All schemas of one request together, serialized, in bytes.
    pub max_request_schema_bytes: usize,
    /// Deepest JSON nesting of a schema.
    pub max_schema_depth: usize,
    /// Distinct keyword sequences (`/properties/items/anyOf`) in a schema.
    pub max_schema_paths: usize,
    /// Subschemas one schema may apply to a single value (through `allOf`, `$ref`, ...).
    pub max_schema_fanout: u64,
    /// Entries of a request's `tools`.
    pub max_tools: usize,
    /// Schema compilations running at once, off the async workers.
    pub max_concurrent_compiles: usize,
    /// How a streamed answer with a structured-output format is validated (per route:
    /// `[[routes]] validation = { stream = "..." }`).
    pub stream: StreamValidation,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            corrective_retries: 2,
            mode: ValidationMode::Enforce,
            schema_cache_size: 1024,
            schema_cache_bytes: 32 * 1024 * 1024,
            max_schema_bytes: 64 * 1024,
            max_request_schema_bytes: 1024 * 1024,
            max_schema_depth: 32,
            max_schema_paths: 64,
            max_schema_fanout: 1024,
            max_tools: 256,
            max_concurrent_compiles: 2,
            stream: StreamValidation::Buffer,
        }
    }
}

/// `validation.stream`: how a stream whose content has a schema (`response_format`,
/// `text.format`, an Anthropic output format, a route's `response_schema`) is validated.
/// Tool calls are held and checked one by one either way.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StreamValidation {
    /// Validated (and corrected) before the client sees it; then the accepted attempt's
    /// own events are relayed verbatim.
    Buffer,
    /// Relayed as it arrives and validated at the end: an invalid answer ends the stream
    /// with an `output_invalid` error event instead of its closing event.
    Passthrough,
}

/// A route's own validation settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteValidation {
    pub stream: Option<StreamValidation>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ValidationMode {
    /// Invalid output is corrected, or refused with 502 `output_invalid`.
    Enforce,
    /// Invalid output passes through, flagged in `x-backstop-validation`.
    Annotate,
}

impl ValidationConfig {
    /// The limits and sizes the schema cache is built with.
    pub fn schema_settings(&self) -> SchemaSettings {
        SchemaSettings {
            request: RequestLimits {
                max_schema_bytes: self.max_schema_bytes,
                max_request_schema_bytes: self.max_request_schema_bytes,
                max_tools: self.max_tools,
            },
            shape: ShapeLimits {
                max_depth: self.max_schema_depth,
                max_paths: self.max_schema_paths,
                max_fanout: self.max_schema_fanout,
            },
            cache_bytes: self.schema_cache_bytes,
            cache_entries: self.schema_cache_size,
            max_concurrent_compiles: self.max_concurrent_compiles,
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.corrective_retries > 10 {
            return Err(ConfigError::invalid(
                "validation.corrective_retries",
                "at most 10: each is a paid upstream call",
            ));
        }
        let positive: [(&str, u64); 9] = [
            ("schema_cache_size", self.schema_cache_size),
            ("schema_cache_bytes", self.schema_cache_bytes),
            ("max_schema_bytes", self.max_schema_bytes as u64),
            (
                "max_request_schema_bytes",
                self.max_request_schema_bytes as u64,
            ),
            ("max_schema_depth", self.max_schema_depth as u64),
            ("max_schema_paths", self.max_schema_paths as u64),
            ("max_schema_fanout", self.max_schema_fanout),
            ("max_tools", self.max_tools as u64),
            (
                "max_concurrent_compiles",
                self.max_concurrent_compiles as u64,
            ),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::invalid(
                format!("validation.{key}"),
                "must be greater than 0",
            ));
        }
        if self.max_schema_bytes > self.max_request_schema_bytes {
            return Err(ConfigError::invalid(
                "validation.max_schema_bytes",
                format_args!(
                    "{} is more than validation.max_request_schema_bytes ({})",
                    self.max_schema_bytes, self.max_request_schema_bytes
                ),
            ));
        }
        if self.max_schema_depth > 128 {
            return Err(ConfigError::invalid(
                "validation.max_schema_depth",
                "at most 128: request bodies nest no deeper",
            ));
        }
        if self.max_concurrent_compiles > 64 {
            return Err(ConfigError::invalid(
                "validation.max_concurrent_compiles",
                "at most 64: each holds a blocking thread and the memory of a compilation",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str) -> Result<(), String> {
        let config: ValidationConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn limits_are_checked_by_key() {
        assert!(check("").is_ok());
        assert!(check("schema_cache_size = 10\nmax_tools = 8").is_ok());
        for key in [
            "schema_cache_bytes",
            "max_schema_bytes",
            "max_schema_depth",
            "max_schema_paths",
            "max_schema_fanout",
            "max_tools",
            "max_concurrent_compiles",
        ] {
            let err = check(&format!("{key} = 0")).unwrap_err();
            assert!(err.contains(&format!("validation.{key}")), "{err}");
        }
        let err = check("max_schema_bytes = 2000000").unwrap_err();
        assert!(err.contains("validation.max_schema_bytes"), "{err}");
        assert!(check("max_schema_depth = 129")
            .unwrap_err()
            .contains("validation.max_schema_depth"));
        assert!(
            check("max_schema_size = 1").is_err(),
            "unknown keys are refused"
        );
    }
}
