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
    /// The session guard; off unless this table is present.
    #[serde(default)]
    pub guard: Option<GuardConfig>,
    /// Tools whose calls are side effects, journaled per session and not repeated; off
    /// unless this table is present.
    #[serde(default)]
    pub side_effects: Option<SideEffectsConfig>,
}

/// `[tenants.side_effects]`: see `docs/side-effects.md`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SideEffectsConfig {
    /// Tool names or globs (`*`, `?`).
    pub tools: Vec<String>,
    #[serde(default)]
    pub on_repeat: OnRepeatConfig,
    #[serde(default)]
    pub restore: RestoreConfig,
    #[serde(default)]
    pub record: RecordConfig,
    /// Entries kept per session, oldest dropped first.
    #[serde(default = "default_max_entries")]
    pub max_entries: u32,
    /// When the store cannot read or write the journal before a request goes on: `open`
    /// (the default) lets it go on unjournaled, `closed` refuses it (503
    /// `store_unavailable`) so that no side effect goes unrecorded.
    #[serde(default = "journal_fails_open")]
    pub on_unavailable: super::state::OnUnavailable,
}

fn journal_fails_open() -> super::state::OnUnavailable {
    super::state::OnUnavailable::Open
}

fn default_max_entries() -> u32 {
    1_000
}

/// The most `max_entries` accepted.
pub const MAX_JOURNAL_ENTRIES: u32 = 100_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnRepeatConfig {
    #[default]
    Correct,
    Refuse,
    Annotate,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RestoreConfig {
    #[default]
    Off,
    Note,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordConfig {
    #[default]
    Full,
    Hash,
}

impl SideEffectsConfig {
    fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.tools.is_empty() || self.tools.iter().any(|t| t.trim().is_empty()) {
            return Err(ConfigError::invalid(
                format!("{key}.tools"),
                "list at least one tool name or glob, none empty",
            ));
        }
        if self.max_entries == 0 || self.max_entries > MAX_JOURNAL_ENTRIES {
            return Err(ConfigError::invalid(
                format!("{key}.max_entries"),
                format_args!(
                    "must be from 1 to {MAX_JOURNAL_ENTRIES}, got {}",
                    self.max_entries
                ),
            ));
        }
        Ok(())
    }

    pub fn policy(&self) -> crate::policy::side_effects::SideEffectPolicy {
        use crate::policy::side_effects::{OnRepeat, Record};
        crate::policy::side_effects::SideEffectPolicy {
            tools: self.tools.clone(),
            only: None,
            on_repeat: match self.on_repeat {
                OnRepeatConfig::Correct => OnRepeat::Correct,
                OnRepeatConfig::Refuse => OnRepeat::Refuse,
                OnRepeatConfig::Annotate => OnRepeat::Annotate,
            },
            record: match self.record {
                RecordConfig::Full => Record::Full,
                RecordConfig::Hash => Record::Hash,
            },
            restore: self.restore == RestoreConfig::Note,
            fail_closed: self.on_unavailable == super::state::OnUnavailable::Closed,
            max_entries: self.max_entries as usize,
        }
    }
}

/// `[tenants.guard]`: what trips one of the tenant's sessions.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    /// Client requests in a row that failed after Backstop's own recovery.
    pub max_consecutive_failures: u32,
    /// The same request (model + messages + tools) at most this many times per window.
    pub identical_request_limit: u32,
    #[serde(with = "super::duration")]
    pub identical_request_window: std::time::Duration,
    /// The same tool call answered by the same result this many times in the history.
    pub tool_loop_limit: u32,
    /// Spend velocity; unset means no velocity rule.
    pub max_usd_per_minute: Option<f64>,
    #[serde(with = "super::duration")]
    pub cool_down: std::time::Duration,
    /// Before a loop rule (identical request, tool loop) trips a session, send the
    /// request at the limit to the model once with a note naming the evidence.
    pub guide: bool,
    /// The provider refusing the request the same way this many times in a row trips the
    /// session as `unrecoverable`, with a diagnosis (a credential failure trips at once).
    pub same_error_limit: u32,
    /// Early failure prediction across the tenant's sessions; off unless this table is
    /// present.
    pub fleet: Option<FleetConfig>,
}

/// `[tenants.guard.fleet]`: when enough of the tenant's sessions fail the same way, the
/// next one is tripped on its first such failure (see `docs/fleet-prediction.md`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Distinct sessions that must have failed with one signature before it is hot.
    pub min_sessions: u32,
    /// Failures with the signature a session needs before it counts towards
    /// `min_sessions`.
    pub min_failures: u32,
    /// The sliding window both counts are taken over.
    #[serde(with = "super::duration")]
    pub window: std::time::Duration,
    /// Refuse a request whose shape matches a hot signature before its first attempt.
    pub preempt: bool,
    /// How long a hot signature refuses before one request is let through as a probe;
    /// also how long a session it trips stays tripped.
    #[serde(with = "super::duration")]
    pub cool_down: std::time::Duration,
}

/// The largest `min_sessions` / `min_failures` accepted: a signature keeps at most this
/// many sessions' counts ([`crate::policy::fleet::SESSIONS_PER_SIGNATURE`] is larger).
pub const MAX_FLEET_COUNT: u32 = 1000;

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            min_sessions: 3,
            min_failures: 2,
            window: std::time::Duration::from_secs(600),
            preempt: false,
            cool_down: std::time::Duration::from_secs(60),
        }
    }
}

impl FleetConfig {
    fn validate(&self, key: &str) -> Result<(), ConfigError> {
        let count = |name: &str, value: u32, min: u32| {
            if value < min || value > MAX_FLEET_COUNT {
                Err(ConfigError::invalid(
                    format!("{key}.{name}"),
                    format_args!("must be from {min} to {MAX_FLEET_COUNT}, got {value}"),
                ))
            } else {
                Ok(())
            }
        };
        // One session failing is that session's own business (the guard's other rules);
        // a pattern takes at least two.
        count("min_sessions", self.min_sessions, 2)?;
        count("min_failures", self.min_failures, 1)?;
        for (name, value) in [("window", self.window), ("cool_down", self.cool_down)] {
            if value < std::time::Duration::from_secs(1) {
                return Err(ConfigError::invalid(
                    format!("{key}.{name}"),
                    "must be at least 1s",
                ));
            }
        }
        Ok(())
    }

    pub fn policy(&self) -> crate::policy::fleet::FleetPolicy {
        crate::policy::fleet::FleetPolicy {
            min_sessions: self.min_sessions,
            min_failures: self.min_failures,
            window: self.window,
            preempt: self.preempt,
            cool_down: self.cool_down,
        }
    }
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            max_consecutive_failures: 5,
            identical_request_limit: 3,
            identical_request_window: std::time::Duration::from_secs(600),
            tool_loop_limit: 3,
            max_usd_per_minute: None,
            cool_down: std::time::Duration::from_secs(60),
            guide: false,
            same_error_limit: 3,
            fleet: None,
        }
    }
}

impl GuardConfig {
    fn validate(&self, key: &str) -> Result<(), ConfigError> {
        positive_int(
            &format!("{key}.max_consecutive_failures"),
            Some(u64::from(self.max_consecutive_failures)),
        )?;
        positive_int(
            &format!("{key}.identical_request_limit"),
            Some(u64::from(self.identical_request_limit)),
        )?;
        positive_int(
            &format!("{key}.tool_loop_limit"),
            Some(u64::from(self.tool_loop_limit)),
        )?;
        positive_int(
            &format!("{key}.same_error_limit"),
            Some(u64::from(self.same_error_limit)),
        )?;
        super::budget::positive_f64(
            &format!("{key}.max_usd_per_minute"),
            self.max_usd_per_minute,
        )?;
        if self.identical_request_window.is_zero() {
            return Err(ConfigError::invalid(
                format!("{key}.identical_request_window"),
                "must be greater than 0",
            ));
        }
        if self.cool_down.is_zero() {
            return Err(ConfigError::invalid(
                format!("{key}.cool_down"),
                "must be greater than 0",
            ));
        }
        if let Some(fleet) = &self.fleet {
            fleet.validate(&format!("{key}.fleet"))?;
        }
        Ok(())
    }

    pub fn policy(&self) -> crate::policy::guard::GuardPolicy {
        crate::policy::guard::GuardPolicy {
            max_consecutive_failures: self.max_consecutive_failures,
            identical_request_limit: self.identical_request_limit,
            identical_request_window: self.identical_request_window,
            tool_loop_limit: self.tool_loop_limit,
            max_usd_per_minute: self.max_usd_per_minute,
            cool_down: self.cool_down,
            guide: self.guide,
            same_error_limit: self.same_error_limit,
        }
    }
}

impl TenantConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.name"),
                "must not be empty",
            ));
        }
        if self.api_keys.is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.api_keys"),
                "at least one key is required",
            ));
        }
        positive_int(
            &format!("{key}.requests_per_minute"),
            self.requests_per_minute.map(u64::from),
        )?;
        self.session.validate(&format!("{key}.session"))?;
        self.budget.validate(&format!("{key}.budget"))?;
        if let Some(guard) = &self.guard {
            guard.validate(&format!("{key}.guard"))?;
        }
        if let Some(side_effects) = &self.side_effects {
            side_effects.validate(&format!("{key}.side_effects"))?;
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
