use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// `[state]`: where the policy state shared by replicas lives.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StateConfig {
    pub backend: StateBackend,
    /// `redis://host:port/db`, or `rediss://` for TLS (the system's trusted roots);
    /// required with `backend = "redis"`.
    pub url: Option<String>,
    /// A Redis Cluster: `url` is one of its nodes (the others are discovered from it).
    pub cluster: bool,
    /// Every key starts with this; a tenant's keys also share one hash tag (`{tenant}`).
    pub key_prefix: String,
    /// Every Redis call is bounded by this; nothing waits longer.
    #[serde(with = "super::duration")]
    pub command_timeout: Duration,
    /// A reservation (or concurrency slot) not settled or renewed by then is freed.
    #[serde(with = "super::duration")]
    pub reservation_ttl: Duration,
    /// Budgets and idempotency when Redis is down or slow.
    pub on_unavailable: OnUnavailable,
    /// How many replicas share the state: while Redis is unavailable each replica's
    /// rate limits fall back to `limit / replicas` locally.
    pub replicas: u32,
    /// After a failed Redis call, calls fail fast for this long before one probes again.
    #[serde(with = "super::duration")]
    pub retry_interval: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StateBackend {
    /// In process, plus `[store]` (the default).
    #[default]
    Embedded,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnUnavailable {
    /// Refuse budgeted calls and idempotent requests (503 `state_unavailable`).
    #[default]
    Closed,
    /// Admit them against this replica's own state, logged and counted as blind.
    Open,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            backend: StateBackend::Embedded,
            url: None,
            cluster: false,
            key_prefix: "backstop".into(),
            command_timeout: Duration::from_millis(100),
            reservation_ttl: Duration::from_secs(300),
            on_unavailable: OnUnavailable::Closed,
            replicas: 1,
            retry_interval: Duration::from_secs(1),
        }
    }
}

impl StateConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.backend == StateBackend::Redis {
            match self.url.as_deref() {
                None | Some("") => {
                    return Err(ConfigError::invalid(
                        "state.url",
                        "required with backend = \"redis\"",
                    ))
                }
                Some(url) if !url.starts_with("redis://") && !url.starts_with("rediss://") => {
                    return Err(ConfigError::invalid(
                        "state.url",
                        "must be a redis:// or rediss:// URL",
                    ))
                }
                _ => {}
            }
        }
        if self.key_prefix.is_empty() || self.key_prefix.contains(['{', '}']) {
            return Err(ConfigError::invalid(
                "state.key_prefix",
                "must be non-empty and contain no braces",
            ));
        }
        if self.command_timeout.is_zero() || self.command_timeout > Duration::from_secs(10) {
            return Err(ConfigError::invalid(
                "state.command_timeout",
                "must be between 1ms and 10s",
            ));
        }
        if self.reservation_ttl < Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "state.reservation_ttl",
                "must be at least 1s",
            ));
        }
        if self.replicas == 0 {
            return Err(ConfigError::invalid("state.replicas", "must be at least 1"));
        }
        Ok(())
    }
}
