use serde::Deserialize;

use super::ConfigError;

/// `[validation]`: structured-output checks and corrective retries.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ValidationConfig {
    /// Corrective re-asks per target before the next target is tried.
    pub corrective_retries: u32,
    pub mode: ValidationMode,
    /// Compiled schemas kept (by content hash).
    pub schema_cache_size: u64,
}

impl Default for ValidationConfig {
    fn default() -> Self {
        ValidationConfig {
            corrective_retries: 2,
            mode: ValidationMode::Enforce,
            schema_cache_size: 1024,
        }
    }
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
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.corrective_retries > 10 {
            return Err(ConfigError::invalid(
                "validation.corrective_retries",
                "at most 10: each is a paid upstream call",
            ));
        }
        if self.schema_cache_size == 0 {
            return Err(ConfigError::invalid(
                "validation.schema_cache_size",
                "must be greater than 0",
            ));
        }
        Ok(())
    }
}
