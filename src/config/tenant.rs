use serde::Deserialize;

use super::{ConfigError, Secret};

/// `[[tenants]]`: who may call Backstop, and with which keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub api_keys: Vec<Secret>,
}

impl TenantConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(ConfigError::invalid(format!("{key}.name"), "must not be empty"));
        }
        if self.api_keys.is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.api_keys"),
                "at least one key is required",
            ));
        }
        for (i, api_key) in self.api_keys.iter().enumerate() {
            if api_key.expose().len() < 8 {
                return Err(ConfigError::invalid(
                    format!("{key}.api_keys[{i}]"),
                    "a tenant key must be at least 8 characters",
                ));
            }
        }
        Ok(())
    }
}
