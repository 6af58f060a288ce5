use serde::Deserialize;

use super::ConfigError;

/// `[store]`: where the spend ledger, budget windows, idempotency records and guard
/// states are kept: an embedded SQLite file per replica, or one PostgreSQL database for
/// the fleet.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// SQLite file (WAL mode). `":memory:"` keeps nothing across restarts.
    pub path: String,
    /// `postgres://user:password@host:port/db` (`sslmode=require` for TLS); required
    /// with `backend = "postgres"`.
    pub url: Option<String>,
    /// PostgreSQL connections this replica holds at most (the writer's one included).
    pub pool_size: usize,
    /// Every PostgreSQL statement, and every wait for a connection, is bounded by this.
    #[serde(with = "super::duration")]
    pub statement_timeout: std::time::Duration,
    /// A replica not heard from in PostgreSQL for this long is taken for dead: its
    /// unsettled reservations are charged at their reserved amount by another replica.
    #[serde(with = "super::duration")]
    pub replica_lease: std::time::Duration,
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
    /// PostgreSQL: the local SQLite file that keeps, fsynced, the charges Postgres could
    /// not take while it was away, until it does. One per replica; `None`: beside
    /// `path` ([`StoreConfig::spool_path`]).
    pub spool: Option<String>,
    /// PostgreSQL: how long a replica waits for another's migrations (their advisory
    /// lock) at start before it gives up and exits.
    #[serde(with = "super::duration")]
    pub migration_timeout: std::time::Duration,
}

/// Which database `[store]` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreBackend {
    /// One SQLite file per replica (the default).
    #[default]
    Sqlite,
    /// One PostgreSQL database shared by every replica.
    Postgres,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: StoreBackend::Sqlite,
            path: "backstop.db".into(),
            url: None,
            pool_size: 16,
            statement_timeout: std::time::Duration::from_secs(5),
            replica_lease: std::time::Duration::from_secs(30),
            session_idle: std::time::Duration::from_secs(900),
            idempotency_ttl: std::time::Duration::from_secs(24 * 3600),
            busy_timeout: std::time::Duration::from_secs(2),
            max_wal_bytes: 64 * 1024 * 1024,
            retention: std::time::Duration::from_secs(90 * 86_400),
            spool: None,
            migration_timeout: std::time::Duration::from_secs(60),
        }
    }
}

impl StoreConfig {
    /// The spool's file: `spool`, or beside `path` with `-spool` added to its stem
    /// (`backstop.db` → `backstop-spool.db`; `":memory:"` → `backstop-spool.db`).
    pub fn spool_path(&self) -> String {
        if let Some(spool) = &self.spool {
            return spool.clone();
        }
        let path = match self.path.as_str() {
            ":memory:" => std::path::Path::new("backstop.db"),
            path => std::path::Path::new(path),
        };
        let stem = path
            .file_stem()
            .map_or("backstop".into(), |s| s.to_string_lossy());
        let name = match path.extension() {
            Some(ext) => format!("{stem}-spool.{}", ext.to_string_lossy()),
            None => format!("{stem}-spool"),
        };
        path.with_file_name(name).to_string_lossy().into_owned()
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.backend == StoreBackend::Postgres {
            match self.url.as_deref() {
                None | Some("") => {
                    return Err(ConfigError::invalid(
                        "store.url",
                        "required with backend = \"postgres\"",
                    ))
                }
                Some(url)
                    if !url.starts_with("postgres://") && !url.starts_with("postgresql://") =>
                {
                    return Err(ConfigError::invalid(
                        "store.url",
                        "must be a postgres:// or postgresql:// URL",
                    ))
                }
                Some(url) => {
                    if let Err(err) = url.parse::<tokio_postgres::Config>() {
                        return Err(ConfigError::invalid("store.url", err));
                    }
                }
            }
        } else if self.url.is_some() {
            return Err(ConfigError::invalid(
                "store.url",
                "only read with backend = \"postgres\"",
            ));
        } else if self.spool.is_some() {
            return Err(ConfigError::invalid(
                "store.spool",
                "only read with backend = \"postgres\" (a sqlite store keeps its writes itself)",
            ));
        }
        if let Some(spool) = &self.spool {
            if spool.trim().is_empty() || spool.ends_with('/') {
                return Err(ConfigError::invalid(
                    "store.spool",
                    "must name a file (one per replica)",
                ));
            }
        }
        if self.migration_timeout < std::time::Duration::from_secs(1)
            || self.migration_timeout > std::time::Duration::from_secs(86_400)
        {
            return Err(ConfigError::invalid(
                "store.migration_timeout",
                "must be between 1s and 24h",
            ));
        }
        if !(2..=1000).contains(&self.pool_size) {
            return Err(ConfigError::invalid(
                "store.pool_size",
                "must be between 2 and 1000 (one connection writes, the others read)",
            ));
        }
        if self.statement_timeout < std::time::Duration::from_millis(10)
            || self.statement_timeout > std::time::Duration::from_secs(600)
        {
            return Err(ConfigError::invalid(
                "store.statement_timeout",
                "must be between 10ms and 10m",
            ));
        }
        if self.replica_lease < std::time::Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "store.replica_lease",
                "must be at least 1s",
            ));
        }
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
