use serde::Deserialize;

use super::{
    budget::{positive_int, SessionLimitsConfig, TenantBudgetConfig},
    ConfigError, Secret,
};

/// `[[tenants]]`: who may call Backstop, with which keys, and within which limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub api_keys: Vec<Secret>,
    /// Client requests per minute for the whole tenant (GCRA).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Limits on each of the tenant's sessions (`x-session-id`).
    #[serde(default)]
    pub session: SessionLimitsConfig,
    /// The tenant's spend per UTC day.
    #[serde(default)]
    pub budget: TenantBudgetConfig,
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
        positive_int(&format!("{key}.requests_per_minute"), self.requests_per_minute.map(u64::from))?;
        self.session.validate(&format!("{key}.session"))?;
        self.budget.validate(&format!("{key}.budget"))?;
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
