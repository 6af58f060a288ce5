use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// `[retry]`: how transient failures are retried on one target. Every upstream's
/// default: `[upstreams.retry]` overrides it key by key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per target, the first included.
    pub max_attempts: u32,
    #[serde(with = "super::duration")]
    pub base_delay: Duration,
    #[serde(with = "super::duration")]
    pub max_delay: Duration,
    /// A longer `Retry-After` (or one past the deadline) is not waited: fail fast.
    #[serde(with = "super::duration")]
    pub max_retry_after: Duration,
    /// Retries may add this fraction over first attempts (rolling window) when recent
    /// retries fail: the most an outage is amplified.
    pub budget_ratio: f64,
    /// ... and up to this fraction when recent retries succeed (a storm of independent
    /// faults). Equal to `budget_ratio`: a fixed budget.
    pub budget_max_ratio: f64,
    /// Retries always allowed per window per upstream, however quiet it is.
    pub budget_floor: u32,
    #[serde(with = "super::duration")]
    pub budget_window: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 3,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(10),
            budget_ratio: 0.2,
            budget_max_ratio: 1.0,
            budget_floor: 10,
            budget_window: Duration::from_secs(10),
        }
    }
}

impl RetryConfig {
    /// `key`: where these settings were read (`retry`, `upstreams[0].retry`).
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.max_attempts == 0 {
            return Err(ConfigError::invalid(
                format!("{key}.max_attempts"),
                "must be at least 1 (the first attempt)",
            ));
        }
        if self.max_delay < self.base_delay {
            return Err(ConfigError::invalid(
                format!("{key}.max_delay"),
                format!("must not be less than {key}.base_delay"),
            ));
        }
        if !(0.0..=10.0).contains(&self.budget_ratio) || self.budget_ratio.is_nan() {
            return Err(ConfigError::invalid(
                format!("{key}.budget_ratio"),
                "must be between 0 and 10",
            ));
        }
        if !(0.0..=10.0).contains(&self.budget_max_ratio) || self.budget_max_ratio.is_nan() {
            return Err(ConfigError::invalid(
                format!("{key}.budget_max_ratio"),
                "must be between 0 and 10",
            ));
        }
        if self.budget_window.is_zero() {
            return Err(ConfigError::invalid(
                format!("{key}.budget_window"),
                "must be greater than 0",
            ));
        }
        Ok(())
    }
}

/// `[breaker]`: one circuit breaker per upstream. Every upstream's default:
/// `[upstreams.breaker]` overrides it key by key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive upstream-fault failures that open it (a 429 counts half).
    pub failure_threshold: u32,
    /// The first opening's length: each failed half-open probe doubles it, up to
    /// `open_for`; a successful one starts it over. Default 1 s (or `open_for`, if
    /// shorter): see [`BreakerConfig::open_min`].
    #[serde(with = "super::duration")]
    pub open_min: Option<Duration>,
    /// The longest it stays open.
    #[serde(with = "super::duration")]
    pub open_for: Duration,
    pub half_open_probes: u32,
    /// And at least this share of recent attempts failed (0 = consecutive count alone).
    pub failure_rate: f64,
    /// "Recent", for `failure_rate`.
    #[serde(with = "super::duration")]
    pub window: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 5,
            open_min: None,
            open_for: Duration::from_secs(30),
            half_open_probes: 1,
            failure_rate: 0.5,
            window: Duration::from_secs(10),
        }
    }
}

/// `open_min` when it is not set (and `open_for` is longer).
const DEFAULT_OPEN_MIN: Duration = Duration::from_secs(1);

impl BreakerConfig {
    /// The first opening's length: `open_min`, else 1 s or `open_for` if shorter (so a
    /// config that set only a short `open_for` keeps a fixed opening).
    pub fn open_min(&self) -> Duration {
        self.open_min.unwrap_or(DEFAULT_OPEN_MIN.min(self.open_for))
    }

    /// `key`: where these settings were read (`breaker`, `upstreams[0].breaker`).
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.failure_threshold == 0 {
            return Err(ConfigError::invalid(
                format!("{key}.failure_threshold"),
                "must be at least 1",
            ));
        }
        if self.open_for.is_zero() {
            return Err(ConfigError::invalid(
                format!("{key}.open_for"),
                "must be greater than 0",
            ));
        }
        match self.open_min {
            Some(min) if min.is_zero() => {
                return Err(ConfigError::invalid(
                    format!("{key}.open_min"),
                    "must be greater than 0",
                ))
            }
            Some(min) if min > self.open_for => {
                return Err(ConfigError::invalid(
                    format!("{key}.open_min"),
                    format!("must not be greater than {key}.open_for"),
                ))
            }
            _ => {}
        }
        if !(0.0..=1.0).contains(&self.failure_rate) {
            return Err(ConfigError::invalid(
                format!("{key}.failure_rate"),
                "must be between 0 and 1",
            ));
        }
        if self.window.is_zero() {
            return Err(ConfigError::invalid(
                format!("{key}.window"),
                "must be greater than 0",
            ));
        }
        if self.half_open_probes == 0 {
            return Err(ConfigError::invalid(
                format!("{key}.half_open_probes"),
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
