use serde::Deserialize;

use super::ConfigError;

/// `[store]`: the embedded store for the spend ledger and budget windows.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// SQLite file (WAL mode). `":memory:"` keeps nothing across restarts.
    pub path: String,
    /// A session unused this long leaves memory (its ledger stays in the store).
    #[serde(with = "super::duration")]
    pub session_idle: std::time::Duration,
    /// How long a response is kept for `Idempotency-Key` replays.
    #[serde(with = "super::duration")]
    pub idempotency_ttl: std::time::Duration,
    /// How long a write waits for a lock held by another connection or process before
    /// it fails (and budgeted calls are refused with 503 `store_unavailable`).
    #[serde(with = "super::duration")]
    pub busy_timeout: std::time::Duration,
    /// The write-ahead log is checkpointed and truncated whenever it grows past this.
    pub max_wal_bytes: u64,
    /// Ledger rows, session resets and guard states older than this are deleted: a
    /// session idle longer starts over. Tenant day budgets only need today.
    #[serde(with = "super::duration")]
    pub retention: std::time::Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: "backstop.db".into(),
            session_idle: std::time::Duration::from_secs(900),
            idempotency_ttl: std::time::Duration::from_secs(24 * 3600),
            busy_timeout: std::time::Duration::from_secs(2),
            max_wal_bytes: 64 * 1024 * 1024,
            retention: std::time::Duration::from_secs(90 * 86_400),
        }
    }
}

impl StoreConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.path.trim().is_empty() {
            return Err(ConfigError::invalid("store.path", "must not be empty"));
        }
        if self.max_wal_bytes < 1024 * 1024 {
            return Err(ConfigError::invalid(
                "store.max_wal_bytes",
                "must be at least 1048576 (1 MiB)",
            ));
        }
        if self.retention < std::time::Duration::from_secs(86_400) {
            return Err(ConfigError::invalid(
                "store.retention",
                "must be at least 1d (tenant budgets are per UTC day)",
            ));
        }
        Ok(())
    }
}
