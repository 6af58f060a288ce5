use serde::Deserialize;

use super::{ConfigError, Secret};

/// `[admin]`: the operator API (`/admin/...`), off unless a token is set.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    pub token: Option<Secret>,
}

impl AdminConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.token.as_ref().is_some_and(|t| t.expose().len() < 16) {
            return Err(ConfigError::invalid(
                "admin.token",
                "must be at least 16 characters",
            ));
        }
        Ok(())
    }
}
