//! The embedded store: SQLite in WAL mode. It holds the spend ledger (one row per
//! charged upstream call), the reservations of budgeted calls still in flight, session
//! resets, the session guard's closes and trips, and responses kept for idempotent
//! replays. Budget windows are sums over the ledger, so nothing is kept twice and a
//! restart rebuilds every window from what was settled.
//!
//! Writes go through one writer thread ([`writer`]) that commits whatever has queued up
//! in one transaction (group commit) and acknowledges each write with its result once it
//! is committed; in WAL mode with `synchronous = NORMAL` a committed write survives the
//! process being killed. A write that fails (the database locked past
//! `store.busy_timeout`, a full disk) is a typed [`StoreError`] for its caller and a
//! `backstop_store_errors_total{op}` count, never silently dropped.
//!
//! Crash safety of budgets: a budgeted call's reservation is committed before its
//! upstream call, and settling it deletes the reservation and appends the ledger row in
//! the same transaction. [`Store::open`] turns every reservation left over by a crash
//! into a ledger charge at its reserved amount, so caps hold across `kill -9`.
//!
//! Disk: the writer backfills the WAL between batches so that it restarts from its
//! beginning, and truncates it if it still passes `store.max_wal_bytes`; expired idempotency
//! rows and ledger rows older than `store.retention` are purged once a minute.
//! Reads use their own connection, which WAL lets run beside the writer.

mod writer;

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicI64, Ordering},
        mpsc, Arc, Mutex,
    },
    thread,
    time::Duration,
};

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use crate::{config::StoreConfig, policy::budget::Usage};

/// One charged upstream call.
#[derive(Debug, Clone)]
pub struct Charge {
    pub ts_ms: i64,
    /// Days since the Unix epoch (UTC), the tenant budget window.
    pub day: i64,
    pub tenant: String,
    pub session: Option<String>,
    pub model: String,
    pub calls: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub usd: f64,
}

/// A budgeted call's reservation, durable while the call is in flight. The id is
/// assigned by [`Store::next_reservation_id`] before the write is queued, so a settle
/// can name it even while the reservation's own write is still queued (the writer
/// applies writes in order).
#[derive(Debug, Clone)]
pub struct ReservationRecord {
    pub id: i64,
    pub ts_ms: i64,
    pub day: i64,
    pub tenant: String,
    pub session: Option<String>,
    pub model: String,
    pub calls: u64,
    pub tokens: u64,
    pub usd: f64,
}

/// A completed response kept for `Idempotency-Key` replays.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    pub tenant: String,
    pub key: String,
    /// Hash of the request body: the same key with another body is refused.
    pub body_hash: String,
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
    pub expires_ms: i64,
}

/// What the session guard keeps of a session across restarts and idle eviction: an
/// operator's close, or an active trip with the wall-clock time its cool-down ends.
#[derive(Debug, Clone, PartialEq)]
pub struct GuardRecord {
    pub tenant: String,
    pub session: String,
    pub closed: bool,
    /// Wall clock (ms since the epoch) when a trip's cool-down ends; 0 for a close.
    pub until_ms: i64,
    pub code: String,
    pub rule: String,
    pub evidence: String,
    pub updated_ms: i64,
}

enum Op {
    Reserve(ReservationRecord),
    /// Appends a ledger row and, for a durable reservation, deletes it, atomically.
    Settle {
        reservation: Option<i64>,
        charge: Charge,
    },
    ResetSession {
        tenant: String,
        session: String,
        at_ms: i64,
    },
    Remember(StoredResponse),
    SaveGuard(GuardRecord),
    ClearGuard {
        tenant: String,
        session: String,
    },
    Purge {
        now_ms: i64,
    },
}

impl Op {
    /// The `op` label of `backstop_store_errors_total`.
    fn label(&self) -> &'static str {
        match self {
            Op::Reserve(_) => "reserve",
            Op::Settle { .. } => "settle",
            Op::ResetSession { .. } => "reset_session",
            Op::Remember(_) => "remember",
            Op::SaveGuard(_) | Op::ClearGuard { .. } => "guard",
            Op::Purge { .. } => "purge",
        }
    }
}

type Ack = oneshot::Sender<Result<(), Arc<str>>>;

struct Write {
    op: Op,
    ack: Option<Ack>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sqlite(Arc<rusqlite::Error>),
    /// A queued write whose transaction failed (locked database, full disk, ...).
    #[error("store write failed: {0}")]
    Write(Arc<str>),
    #[error("store writer has stopped")]
    Closed,
}

impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> Self {
        StoreError::Sqlite(Arc::new(err))
    }
}

pub struct Store {
    writer: mpsc::Sender<Write>,
    reader: Mutex<Connection>,
    next_reservation: AtomicI64,
    recovered: u64,
    /// The checkpointer thread runs while this lives.
    _alive: Arc<()>,
    /// For `":memory:"`: the private file behind it, removed with the store.
    _scratch: Option<Scratch>,
    /// The database file (for tests that open it beside the store).
    #[cfg(test)]
    path: String,
}

/// A `":memory:"` store's database: a private file in the temp dir, in WAL mode like any
/// other. SQLite's shared-cache in-memory databases lock whole tables between their
/// connections, and `busy_timeout` does not cover those locks: under concurrent calls a
/// session read failed with "database table is locked" while the writer committed
/// (found by the k6 steady smoke). Removed when the store is dropped; a crashed process
/// leaves it in the temp dir.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY,
    ts_ms INTEGER NOT NULL,
    day INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    session TEXT,
    model TEXT NOT NULL,
    calls INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    usd REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_by_session ON ledger (tenant, session, ts_ms);
CREATE INDEX IF NOT EXISTS ledger_by_day ON ledger (tenant, day);
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY,
    ts_ms INTEGER NOT NULL,
    day INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    session TEXT,
    model TEXT NOT NULL,
    calls INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    usd REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    status INTEGER NOT NULL,
    content_type TEXT NOT NULL,
    body BLOB NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, key)
);
CREATE INDEX IF NOT EXISTS idempotency_by_expiry ON idempotency (expires_ms);
CREATE TABLE IF NOT EXISTS session_resets (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session)
);
CREATE TABLE IF NOT EXISTS guard_states (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    closed INTEGER NOT NULL,
    until_ms INTEGER NOT NULL,
    code TEXT NOT NULL,
    rule TEXT NOT NULL,
    evidence TEXT NOT NULL,
    updated_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session)
);
";

/// Token and call counts enter SQLite as i64: anything above saturates rather than
/// wrapping negative.
pub(crate) fn to_sql(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Counts read back: a negative value (written by an older build) reads as 0.
fn from_sql(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn open_conn(path: &str, busy_timeout: Duration) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(busy_timeout)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // The ledger is append-mostly and read by index: a small page cache is enough, and
    // three connections of the default 2 MB each showed in Backstop's RSS.
    conn.pragma_update(None, "cache_size", -256)?;
    Ok(conn)
}

/// Every reservation left by a process that did not settle it (a crash) becomes a ledger
/// charge at its reserved amount: the call may have been made and billed, and nothing
/// proves otherwise. Returns how many.
fn recover_reservations(conn: &mut Connection) -> rusqlite::Result<u64> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let n = tx.execute(
        "INSERT INTO ledger (ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd)
         SELECT ts_ms, day, tenant, session, model, calls, tokens, 0, usd FROM reservations ORDER BY id",
        [],
    )?;
    tx.execute("DELETE FROM reservations", [])?;
    tx.commit()?;
    Ok(n as u64)
}

impl Store {
    /// Opens (creating if needed) the store at `path` with the default `[store]`
    /// settings; `":memory:"` is a private scratch database that lives as long as this
    /// `Store`.
    pub fn open(path: &str) -> Result<Store, StoreError> {
        Store::open_with(&StoreConfig {
            path: path.to_string(),
            ..StoreConfig::default()
        })
    }

    /// Opens the store that `[store]` describes.
    pub fn open_with(config: &StoreConfig) -> Result<Store, StoreError> {
        let scratch = (config.path == ":memory:").then(|| {
            Scratch(std::env::temp_dir().join(format!(
                "backstop-memory-{}.db",
                uuid::Uuid::new_v4().simple()
            )))
        });
        let path = match &scratch {
            Some(Scratch(file)) => file.display().to_string(),
            None => config.path.clone(),
        };
        let busy = config.busy_timeout;
        let mut writer_conn = open_conn(&path, busy)?;
        writer_conn.execute_batch(SCHEMA)?;
        let recovered = recover_reservations(&mut writer_conn)?;
        if recovered > 0 {
            tracing::warn!(
                reservations = recovered,
                "unsettled reservations from before a crash charged at their reserved amount"
            );
            metrics::counter!("backstop_reservations_recovered_total").increment(recovered);
        }
        let (tx, rx) = mpsc::channel::<Write>();
        let alive = Arc::new(());
        let wal = Some(PathBuf::from(format!("{path}-wal")));
        // Checkpoints copy the WAL into the database and sync it: slow, and on the
        // commit path they would stall every request waiting for its ledger write.
        // The writer backfills between batches instead (see `writer`), and truncates
        // the WAL only if it has grown past the bound anyway.
        writer_conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        writer_conn.pragma_update(None, "journal_size_limit", to_sql(config.max_wal_bytes))?;
        let checkpointer = Some(open_conn(&path, busy)?);
        writer::spawn_housekeeping(checkpointer, Arc::downgrade(&alive), tx.clone());
        let reader = open_conn(&path, busy)?;
        let settings = writer::Settings {
            wal,
            max_wal_bytes: config.max_wal_bytes,
            retention: config.retention,
        };
        thread::Builder::new()
            .name("backstop-store".into())
            .spawn(move || writer::write_loop(writer_conn, rx, settings))
            .expect("spawn store writer");
        Ok(Store {
            writer: tx,
            reader: Mutex::new(reader),
            next_reservation: AtomicI64::new(1),
            recovered,
            _alive: alive,
            _scratch: scratch,
            #[cfg(test)]
            path,
        })
    }

    /// How many crashed reservations [`Store::open`] charged.
    pub fn recovered_reservations(&self) -> u64 {
        self.recovered
    }

    async fn write(&self, op: Op) -> Result<(), StoreError> {
        let (ack, done) = oneshot::channel();
        self.writer
            .send(Write { op, ack: Some(ack) })
            .map_err(|_| StoreError::Closed)?;
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(msg)) => Err(StoreError::Write(msg)),
            Err(_) => Err(StoreError::Closed),
        }
    }

    fn write_later(&self, op: Op) {
        let label = op.label();
        if self.writer.send(Write { op, ack: None }).is_err() {
            metrics::counter!("backstop_store_errors_total", "op" => label).increment(1);
        }
    }

    /// An id for a new reservation, unique in this store.
    pub fn next_reservation_id(&self) -> i64 {
        self.next_reservation.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes a reservation durable and waits until it is committed.
    pub async fn reserve(&self, reservation: ReservationRecord) -> Result<(), StoreError> {
        self.write(Op::Reserve(reservation)).await
    }

    /// Appends a charge (deleting its durable reservation, if any, in the same
    /// transaction) and waits until it is committed. On failure the reservation stays,
    /// so a restart still counts it.
    pub async fn settle(&self, reservation: Option<i64>, charge: Charge) -> Result<(), StoreError> {
        self.write(Op::Settle {
            reservation,
            charge,
        })
        .await
    }

    /// As [`Store::settle`], without waiting (settlements at the end of a stream, or of
    /// a dropped call); a failure is logged and counted by the writer.
    pub fn settle_later(&self, reservation: Option<i64>, charge: Charge) {
        self.write_later(Op::Settle {
            reservation,
            charge,
        });
    }

    /// Appends a charge with no reservation and waits until it is committed.
    pub async fn charge(&self, charge: Charge) -> Result<(), StoreError> {
        self.settle(None, charge).await
    }

    pub async fn reset_session(
        &self,
        tenant: &str,
        session: &str,
        at_ms: i64,
    ) -> Result<(), StoreError> {
        self.write(Op::ResetSession {
            tenant: tenant.into(),
            session: session.into(),
            at_ms,
        })
        .await
    }

    /// Keeps a response for replay and waits until it is committed.
    pub async fn remember(&self, response: StoredResponse) -> Result<(), StoreError> {
        self.write(Op::Remember(response)).await
    }

    /// Persists a session's close or trip (replacing what was kept).
    pub async fn save_guard(&self, record: GuardRecord) -> Result<(), StoreError> {
        self.write(Op::SaveGuard(record)).await
    }

    /// Forgets a session's close or trip.
    pub async fn clear_guard(&self, tenant: &str, session: &str) -> Result<(), StoreError> {
        self.write(Op::ClearGuard {
            tenant: tenant.into(),
            session: session.into(),
        })
        .await
    }

    /// Deletes expired idempotency rows and everything older than `store.retention`
    /// (run once a minute by the store itself; public for tests).
    pub async fn purge(&self, now_ms: i64) -> Result<(), StoreError> {
        self.write(Op::Purge { now_ms }).await
    }

    fn read<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> Result<T, StoreError> {
        let conn = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        f(&conn).map_err(|err| {
            metrics::counter!("backstop_store_errors_total", "op" => "read").increment(1);
            StoreError::from(err)
        })
    }

    /// A kept response that has not expired.
    pub fn recall(
        &self,
        tenant: &str,
        key: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        self.read(|c| {
            c.query_row(
                "SELECT body_hash, status, content_type, body, expires_ms FROM idempotency WHERE tenant = ?1 AND key = ?2 AND expires_ms > ?3",
                params![tenant, key, now_ms],
                |r| {
                    Ok(StoredResponse {
                        tenant: tenant.to_string(),
                        key: key.to_string(),
                        body_hash: r.get(0)?,
                        status: u16::try_from(r.get::<_, i64>(1)?).unwrap_or(500),
                        content_type: r.get(2)?,
                        body: r.get(3)?,
                        expires_ms: r.get(4)?,
                    })
                },
            )
            .optional()
        })
    }

    /// A session's kept close or trip.
    pub fn guard_state(
        &self,
        tenant: &str,
        session: &str,
    ) -> Result<Option<GuardRecord>, StoreError> {
        self.read(|c| {
            c.query_row(
                "SELECT closed, until_ms, code, rule, evidence, updated_ms FROM guard_states WHERE tenant = ?1 AND session = ?2",
                params![tenant, session],
                |r| {
                    Ok(GuardRecord {
                        tenant: tenant.to_string(),
                        session: session.to_string(),
                        closed: r.get::<_, i64>(0)? != 0,
                        until_ms: r.get(1)?,
                        code: r.get(2)?,
                        rule: r.get(3)?,
                        evidence: r.get(4)?,
                        updated_ms: r.get(5)?,
                    })
                },
            )
            .optional()
        })
    }

    /// A session's usage since its last reset.
    pub fn session_usage(&self, tenant: &str, session: &str) -> Result<Usage, StoreError> {
        self.read(|c| {
            let since: i64 = c
                .query_row(
                    "SELECT at_ms FROM session_resets WHERE tenant = ?1 AND session = ?2",
                    params![tenant, session],
                    |r| r.get(0),
                )
                .optional()?
                .unwrap_or(i64::MIN);
            c.query_row(
                "SELECT TOTAL(calls), TOTAL(input_tokens) + TOTAL(output_tokens), TOTAL(usd)
                 FROM ledger WHERE tenant = ?1 AND session = ?2 AND ts_ms >= ?3",
                params![tenant, session, since],
                usage_row,
            )
        })
    }

    /// A tenant's usage on one UTC day.
    pub fn tenant_day_usage(&self, tenant: &str, day: i64) -> Result<Usage, StoreError> {
        self.read(|c| {
            c.query_row(
                "SELECT TOTAL(calls), TOTAL(input_tokens) + TOTAL(output_tokens), TOTAL(usd)
                 FROM ledger WHERE tenant = ?1 AND day = ?2",
                params![tenant, day],
                usage_row,
            )
        })
    }

    /// A tenant's spend on one day, by model: (model, calls, tokens, usd).
    pub fn tenant_day_by_model(
        &self,
        tenant: &str,
        day: i64,
    ) -> Result<Vec<(String, Usage)>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare(
                "SELECT model, TOTAL(calls), TOTAL(input_tokens) + TOTAL(output_tokens), TOTAL(usd)
                 FROM ledger WHERE tenant = ?1 AND day = ?2 GROUP BY model ORDER BY model",
            )?;
            let rows = stmt.query_map(params![tenant, day], |r| {
                Ok((r.get::<_, String>(0)?, usage_at(r, 1)?))
            })?;
            rows.collect()
        })
    }

    /// Durable reservations not yet settled (for tests and the admin view).
    pub fn open_reservations(&self) -> Result<u64, StoreError> {
        self.read(|c| {
            c.query_row("SELECT COUNT(*) FROM reservations", [], |r| {
                r.get::<_, i64>(0).map(from_sql)
            })
        })
    }
}

/// Sums are read as SQLite `TOTAL` (a float that never overflows, unlike `SUM`, which
/// fails the whole query on an i64 overflow) and converted back saturating.
fn usage_at(r: &rusqlite::Row<'_>, first: usize) -> rusqlite::Result<Usage> {
    let calls: f64 = r.get(first)?;
    let tokens: f64 = r.get(first + 1)?;
    let usd: f64 = r.get(first + 2)?;
    Ok(Usage {
        calls: calls.max(0.0) as u64,
        tokens: tokens.max(0.0) as u64,
        usd: if usd.is_nan() {
            0.0
        } else {
            usd.clamp(0.0, f64::MAX)
        },
    })
}

fn usage_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Usage> {
    usage_at(r, 0)
}

#[cfg(test)]
mod tests;
