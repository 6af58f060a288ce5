//! [`SqliteStore`]: the embedded store, SQLite in WAL mode.
//!
//! Writes go through one writer thread ([`super::writer`]) that commits whatever has
//! queued up in one transaction (group commit) and acknowledges each write with its
//! result once it is committed; in WAL mode with `synchronous = NORMAL` a committed write
//! survives the process being killed. A write that fails (the database locked past
//! `store.busy_timeout`, a full disk, the writer gone) is a typed [`StoreError`] for its
//! caller and a `backstop_store_errors_total{op}` count, never silently dropped.
//!
//! Reads run on tokio's blocking pool over a small pool of read connections, which WAL
//! lets run beside the writer (see [`Readers`]).
//!
//! Disk: the writer backfills the WAL between batches so that it restarts from its
//! beginning, and truncates it if it still passes `store.max_wal_bytes`.

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicI64, Ordering},
        mpsc, Arc, Mutex, TryLockError,
    },
    thread,
    time::Duration,
};

mod scratch;
mod writer;

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::{oneshot, Semaphore};

use self::scratch::Scratch;
use super::write::{Op, Write};
use super::{
    count_error, Charge, GuardRecord, GuardStates, JournalRecord, Journals, Ledger, OwnerRecord,
    Owners, QueuedSettle, Replays, ReportQuery, ReportRow, ReservationRecord, SettleQueue, Store,
    StoreError, StoreFuture, StoredOwner, StoredResponse, Tier,
};
use crate::{billing::Tokens, config::StoreConfig, policy::budget::Usage};

/// Read connections, used from tokio's blocking pool.
///
/// Why `spawn_blocking` over a pool rather than one reader thread fed by a channel: reads
/// are short indexed lookups (a session's sum when it is first seen, a kept response, a
/// guard state), and a slow one (an admin report grouping a day by model) should not
/// hold up the next session's first request behind it. The semaphore has one permit per
/// connection and is acquired on the async side, so a burst of new sessions waits
/// there, never parks blocking threads on a lock, and cannot grow tokio's blocking pool
/// past the number of connections.
struct Readers {
    connections: Vec<Mutex<Connection>>,
    permits: Arc<Semaphore>,
}

/// Read connections per store: each is a SQLite page cache (see `open_conn`).
const READERS: usize = 2;

impl Readers {
    /// A free connection: with a permit held there always is one.
    fn with<T>(&self, f: impl FnOnce(&Connection) -> T) -> T {
        for conn in &self.connections {
            match conn.try_lock() {
                Ok(conn) => return f(&conn),
                // A read that panicked left nothing half-done in a read connection.
                Err(TryLockError::Poisoned(poisoned)) => return f(&poisoned.into_inner()),
                Err(TryLockError::WouldBlock) => {}
            }
        }
        let conn = self.connections[0]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        f(&conn)
    }
}

pub struct SqliteStore {
    writer: mpsc::Sender<Write>,
    readers: Arc<Readers>,
    next_reservation: AtomicI64,
    recovered: u64,
    /// The checkpointer thread runs while this lives.
    _alive: Arc<()>,
    /// For `":memory:"`: the private file behind it ([`scratch`]), removed with the store.
    _scratch: Option<Scratch>,
    /// The database file (for tests that open it beside the store).
    #[cfg(test)]
    pub(super) path: String,
}

/// A store made before owners had a context size gains the column (NULL: unknown).
fn add_owner_context_column(conn: &Connection) -> rusqlite::Result<()> {
    add_column(conn, "response_owners", "context_tokens INTEGER")
}

/// The ledger's columns for the token kinds beyond input and output (a charge's cache
/// writes, every lifetime, and the one-hour part of them; cache reads; reasoning, a
/// part of output; web searches). A ledger made before them gains them, its rows at 0:
/// those rows were charged on input and output alone.
const KIND_COLUMNS: [&str; 5] = [
    "cache_write_tokens",
    "cache_write_1h_tokens",
    "cache_read_tokens",
    "reasoning_tokens",
    "web_searches",
];

fn add_kind_columns(conn: &Connection) -> rusqlite::Result<()> {
    for column in KIND_COLUMNS {
        add_column(
            conn,
            "ledger",
            &format!("{column} INTEGER NOT NULL DEFAULT 0"),
        )?;
    }
    Ok(())
}

fn add_column(conn: &Connection, table: &str, column: &str) -> rusqlite::Result<()> {
    match conn.execute(&format!("ALTER TABLE {table} ADD COLUMN {column}"), []) {
        Ok(_) => Ok(()),
        Err(err) if err.to_string().contains("duplicate column") => Ok(()),
        Err(err) => Err(err),
    }
}

/// Whether a ledger has the kind columns (a read-only reader of a file no new gateway
/// has opened yet reads zeros in their place).
fn has_kind_columns(conn: &Connection) -> rusqlite::Result<bool> {
    let mut columns = conn.prepare("SELECT name FROM pragma_table_info('ledger')")?;
    let names: Vec<String> = columns
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(KIND_COLUMNS.iter().all(|c| names.iter().any(|n| n == c)))
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
    usd REAL NOT NULL,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    web_searches INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS ledger_by_session ON ledger (tenant, session, ts_ms);
-- A tenant's day (budget windows) and spend reports by tenant, day and model: with the
-- model in the index, the report's GROUP BY walks it in order with no sort. It replaces
-- the index on (tenant, day) that stores made before reports had.
CREATE INDEX IF NOT EXISTS ledger_by_day_model ON ledger (tenant, day, model);
DROP INDEX IF EXISTS ledger_by_day;
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
-- One B-tree and no expiry index: a create writes one row into it, and the purge that
-- scans it runs once a minute.
-- context_tokens: a response's input + output tokens, once settled (NULL until then,
-- and for items and conversations). Added by ALTER TABLE to a store made before it.
CREATE TABLE IF NOT EXISTS response_owners (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    context_tokens INTEGER
) WITHOUT ROWID;
-- Settles the shared state (Redis) could not take yet, replayed until it does.
CREATE TABLE IF NOT EXISTS shared_settles (
    reservation TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    queued_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS session_resets (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session)
);
CREATE TABLE IF NOT EXISTS side_effects (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    call_id TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    proposed INTEGER NOT NULL,
    entry TEXT NOT NULL,
    PRIMARY KEY (tenant, session, call_id)
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
pub(super) fn to_sql(n: u64) -> i64 {
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
    // A new file only (a page size is fixed once the file is in WAL mode): each commit
    // writes every page it touched (the ledger's last leaf and one of each index) whole
    // into the WAL and checksums it, and an append-mostly ledger touches a few bytes of
    // each. 1 KB pages made each commit's WAL write a quarter of 4 KB pages'.
    conn.pragma_update(None, "page_size", 1024)?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // The ledger is append-mostly and read by index: a small page cache is enough, and
    // three connections of the default 2 MB each showed in Backstop's RSS.
    conn.pragma_update(None, "cache_size", -256)?;
    Ok(conn)
}

/// A connection that reads and can write nothing (`query_only` on top of the read-only
/// open, so that not even a pragma changes the file). It still maps the WAL index (the
/// `-shm` file), as every WAL reader does, creating it if no gateway has it open.
fn open_read_only_conn(path: &str, busy_timeout: Duration) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(busy_timeout)?;
    conn.pragma_update(None, "query_only", true)?;
    conn.pragma_update(None, "cache_size", -256)?;
    // SQLite opens lazily: a missing file, or one that is not a ledger, fails here and
    // not at the first report.
    conn.prepare("SELECT 1 FROM ledger LIMIT 0")?;
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

impl SqliteStore {
    /// Opens (creating if needed) the store at `path` with the default `[store]`
    /// settings; `":memory:"` is a private scratch database that lives as long as this
    /// store.
    pub fn open(path: &str) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with(&StoreConfig {
            path: path.to_string(),
            ..StoreConfig::default()
        })
    }

    /// Opens the store that `[store]` describes. Blocking: call it at start-up.
    pub fn open_with(config: &StoreConfig) -> Result<SqliteStore, StoreError> {
        let scratch = (config.path == ":memory:").then(Scratch::create);
        let path = match &scratch {
            Some(scratch) => scratch.path().display().to_string(),
            None => config.path.clone(),
        };
        let busy = config.busy_timeout;
        let mut writer_conn = open_conn(&path, busy)?;
        writer_conn.execute_batch(SCHEMA)?;
        add_owner_context_column(&writer_conn)?;
        add_kind_columns(&writer_conn)?;
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
        // The writer backfills between batches once the WAL has grown (see `writer`),
        // and truncates it only if it has grown past the bound anyway.
        writer_conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        writer_conn.pragma_update(None, "journal_size_limit", to_sql(config.max_wal_bytes))?;
        let checkpointer = open_conn(&path, busy)?;
        writer::spawn_checkpointer(checkpointer, Arc::downgrade(&alive));
        let connections = (0..READERS)
            .map(|_| open_conn(&path, busy).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?;
        let settings = writer::Settings {
            wal,
            max_wal_bytes: config.max_wal_bytes,
            retention: config.retention,
            backfills: Arc::default(),
        };
        thread::Builder::new()
            .name("backstop-store".into())
            .spawn(move || writer::write_loop(writer_conn, rx, settings))
            .expect("spawn store writer");
        Ok(SqliteStore {
            writer: tx,
            readers: Arc::new(Readers {
                connections,
                permits: Arc::new(Semaphore::new(READERS)),
            }),
            next_reservation: AtomicI64::new(1),
            recovered,
            _alive: alive,
            _scratch: scratch,
            #[cfg(test)]
            path,
        })
    }

    /// Opens the store at `config.path` to read its ledger beside a running gateway
    /// (`backstop report`): read-only connections, WAL readers like the gateway's own,
    /// so it never takes the write lock, creates the file, recovers reservations (those
    /// of a running gateway are in flight, not crashed) nor checkpoints. Every write
    /// fails with [`StoreError::Closed`]. Blocking.
    pub fn open_read_only(config: &StoreConfig) -> Result<SqliteStore, StoreError> {
        let connections = (0..READERS)
            .map(|_| open_read_only_conn(&config.path, config.busy_timeout).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?;
        // No writer: its receiver is gone, so a write is refused, never acknowledged.
        let (writer, _) = mpsc::channel::<Write>();
        Ok(SqliteStore {
            writer,
            readers: Arc::new(Readers {
                connections,
                permits: Arc::new(Semaphore::new(READERS)),
            }),
            next_reservation: AtomicI64::new(1),
            recovered: 0,
            _alive: Arc::new(()),
            _scratch: None,
            #[cfg(test)]
            path: config.path.clone(),
        })
    }

    /// Queues `op` and waits for its commit. Every failure is counted here or, for a
    /// failed transaction, by the writer (which knows each write's op).
    async fn write(&self, op: Op) -> Result<(), StoreError> {
        let label = op.label();
        let (ack, done) = oneshot::channel();
        if self.writer.send(Write { op, ack: Some(ack) }).is_err() {
            count_error(label);
            return Err(StoreError::Closed);
        }
        match done.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(msg)) => Err(StoreError::Write(msg)),
            // The writer dropped the write without an answer: it has stopped.
            Err(_) => {
                count_error(label);
                Err(StoreError::Closed)
            }
        }
    }

    /// Runs `f` on a read connection, on tokio's blocking pool.
    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let permit = self.readers.permits.clone().acquire_owned().await;
        let Ok(permit) = permit else {
            count_error("read");
            return Err(StoreError::Closed);
        };
        let readers = self.readers.clone();
        let ran = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            readers.with(f)
        })
        .await;
        let result = match ran {
            Ok(result) => result.map_err(StoreError::from),
            Err(err) => Err(StoreError::Read(err.to_string().into())),
        };
        if let Err(err) = &result {
            tracing::debug!(error = %err, "store read failed");
            count_error("read");
        }
        result
    }
}

impl Ledger for SqliteStore {
    fn recovered_reservations(&self) -> u64 {
        self.recovered
    }

    fn next_reservation_id(&self) -> i64 {
        self.next_reservation.fetch_add(1, Ordering::Relaxed)
    }

    fn reserve(&self, reservation: ReservationRecord) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Reserve(reservation)))
    }

    fn settle(&self, reservation: Option<i64>, charge: Charge) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Settle {
            reservation,
            charge,
        }))
    }

    fn settle_later(&self, reservation: Option<i64>, charge: Charge) {
        let op = Op::Settle {
            reservation,
            charge,
        };
        if self.writer.send(Write { op, ack: None }).is_err() {
            tracing::error!(
                durable = reservation.is_some(),
                "store writer has stopped: a charge was not written to the ledger"
            );
            count_error("settle");
        }
    }

    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        at_ms: i64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::ResetSession {
            tenant: tenant.into(),
            session: session.into(),
            at_ms,
        }))
    }

    fn session_usage<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, Usage> {
        let (tenant, session) = (tenant.to_string(), session.to_string());
        Box::pin(self.read(move |c| {
            let since: i64 = c
                .prepare_cached(
                    "SELECT at_ms FROM session_resets WHERE tenant = ?1 AND session = ?2",
                )?
                .query_row(params![tenant, session], |r| r.get(0))
                .optional()?
                .unwrap_or(i64::MIN);
            c.prepare_cached(
                "SELECT TOTAL(calls),
                        TOTAL(input_tokens) + TOTAL(output_tokens) + TOTAL(cache_write_tokens) + TOTAL(cache_read_tokens),
                        TOTAL(usd)
                 FROM ledger WHERE tenant = ?1 AND session = ?2 AND ts_ms >= ?3",
            )?
            .query_row(params![tenant, session, since], usage_row)
        }))
    }

    fn tenant_day_usage<'a>(&'a self, tenant: &'a str, day: i64) -> StoreFuture<'a, Usage> {
        let tenant = tenant.to_string();
        Box::pin(self.read(move |c| {
            c.prepare_cached(
                "SELECT TOTAL(calls),
                        TOTAL(input_tokens) + TOTAL(output_tokens) + TOTAL(cache_write_tokens) + TOTAL(cache_read_tokens),
                        TOTAL(usd)
                 FROM ledger WHERE tenant = ?1 AND day = ?2",
            )?
            .query_row(params![tenant, day], usage_row)
        }))
    }

    fn spend_report<'a>(&'a self, query: &'a ReportQuery) -> StoreFuture<'a, Vec<ReportRow>> {
        let query = query.clone();
        Box::pin(self.read(move |c| spend_report(c, &query)))
    }

    fn open_reservations(&self) -> StoreFuture<'_, u64> {
        Box::pin(self.read(|c| {
            c.query_row("SELECT COUNT(*) FROM reservations", [], |r| {
                r.get::<_, i64>(0).map(from_sql)
            })
        }))
    }
}

impl SettleQueue for SqliteStore {
    fn queue_settle(&self, settle: QueuedSettle) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::QueueSettle(settle)))
    }

    fn queued_settles(&self, limit: usize) -> StoreFuture<'_, Vec<QueuedSettle>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Box::pin(self.read(move |conn| {
            conn.prepare_cached(
                "SELECT reservation, body, queued_ms FROM shared_settles ORDER BY queued_ms LIMIT ?1",
            )?
            .query_map(params![limit], |r| {
                Ok(QueuedSettle {
                    reservation: r.get(0)?,
                    body: r.get(1)?,
                    queued_ms: r.get(2)?,
                })
            })?
            .collect()
        }))
    }

    fn unqueue_settle(&self, reservation: String) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::UnqueueSettle(reservation)))
    }
}

impl Replays for SqliteStore {
    fn remember(&self, response: StoredResponse) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Remember(response)))
    }

    fn recall<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        now_ms: i64,
    ) -> StoreFuture<'a, Option<StoredResponse>> {
        let (tenant, key) = (tenant.to_string(), key.to_string());
        Box::pin(self.read(move |c| {
            c.prepare_cached(
                "SELECT body_hash, status, content_type, body, expires_ms FROM idempotency WHERE tenant = ?1 AND key = ?2 AND expires_ms > ?3",
            )?
            .query_row(params![tenant, key, now_ms], |r| {
                Ok(StoredResponse {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    body_hash: r.get(0)?,
                    status: u16::try_from(r.get::<_, i64>(1)?).unwrap_or(500),
                    content_type: r.get(2)?,
                    body: r.get(3)?,
                    expires_ms: r.get(4)?,
                })
            })
            .optional()
        }))
    }
}

impl Owners for SqliteStore {
    fn record_owners(&self, owners: Vec<OwnerRecord>) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::RecordOwners(owners)))
    }

    fn owner_of<'a>(&'a self, id: &'a str, now_ms: i64) -> StoreFuture<'a, Option<StoredOwner>> {
        let id = id.to_string();
        Box::pin(self.read(move |c| {
            c.prepare_cached(
                "SELECT tenant, context_tokens FROM response_owners WHERE id = ?1 AND expires_ms > ?2",
            )?
            .query_row(params![id, now_ms], |r| {
                Ok(StoredOwner {
                    tenant: r.get(0)?,
                    context_tokens: r.get::<_, Option<i64>>(1)?.map(|n| n.max(0) as u64),
                })
            })
            .optional()
        }))
    }
}

impl GuardStates for SqliteStore {
    fn save_guard(&self, record: GuardRecord) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::SaveGuard(record)))
    }

    fn clear_guard<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::ClearGuard {
            tenant: tenant.into(),
            session: session.into(),
        }))
    }

    fn guard_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Option<GuardRecord>> {
        let (tenant, session) = (tenant.to_string(), session.to_string());
        Box::pin(self.read(move |c| {
            c.prepare_cached(
                "SELECT closed, until_ms, code, rule, evidence, updated_ms FROM guard_states WHERE tenant = ?1 AND session = ?2",
            )?
            .query_row(params![tenant, session], |r| {
                Ok(GuardRecord {
                    tenant: tenant.clone(),
                    session: session.clone(),
                    closed: r.get::<_, i64>(0)? != 0,
                    until_ms: r.get(1)?,
                    code: r.get(2)?,
                    rule: r.get(3)?,
                    evidence: r.get(4)?,
                    updated_ms: r.get(5)?,
                })
            })
            .optional()
        }))
    }
}

impl Journals for SqliteStore {
    fn journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Vec<JournalRecord>> {
        let (tenant, session) = (tenant.to_string(), session.to_string());
        Box::pin(self.read(move |c| {
            c.prepare_cached(
                "SELECT call_id, at_ms, proposed, entry FROM side_effects WHERE tenant = ?1 AND session = ?2
                 ORDER BY at_ms, call_id",
            )?
            .query_map(params![tenant, session], |r| {
                Ok(JournalRecord {
                    call_id: r.get(0)?,
                    at_ms: r.get(1)?,
                    proposed: r.get::<_, i64>(2)? != 0,
                    entry: r.get(3)?,
                })
            })?
            .collect()
        }))
    }

    fn write_journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        records: Vec<JournalRecord>,
        max_entries: usize,
        _ttl_ms: u64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::Journal {
            tenant: tenant.into(),
            session: session.into(),
            records,
            max_entries,
        }))
    }
}

impl Tier for SqliteStore {}

impl Store for SqliteStore {
    fn purge(&self, now_ms: i64) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Purge { now_ms }))
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

/// [`Ledger::spend_report`]'s query, without a tenant and with one: two statements rather
/// than `(?1 IS NULL OR tenant = ?1)`, which would keep SQLite from searching the index
/// by tenant. Both walk `ledger_by_day_model` in the GROUP BY's order (no sort).
/// Its sums, in [`report_row`]'s order.
pub(super) const REPORT_SUMS: &str = "TOTAL(calls), TOTAL(input_tokens), TOTAL(output_tokens), \
    TOTAL(cache_write_tokens), TOTAL(cache_write_1h_tokens), TOTAL(cache_read_tokens), \
    TOTAL(reasoning_tokens), TOTAL(web_searches), TOTAL(usd)";
/// The same for a ledger without the kind columns: zeros in their place.
const REPORT_SUMS_OLD: &str = "TOTAL(calls), TOTAL(input_tokens), TOTAL(output_tokens), \
    0.0, 0.0, 0.0, 0.0, 0.0, TOTAL(usd)";

/// [`Ledger::spend_report`]'s query over the sums `sums`, with a tenant or without.
pub(super) fn report_query(sums: &str, by_tenant: bool) -> String {
    format!(
        "SELECT tenant, day, model, {sums} FROM ledger WHERE day BETWEEN ?1 AND ?2{} \
         GROUP BY tenant, day, model ORDER BY tenant, day, model",
        if by_tenant { " AND tenant = ?3" } else { "" }
    )
}

/// One row of the report's query.
fn report_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ReportRow> {
    // TOTAL, as in `usage_at`: a float sum that cannot fail the report on overflow.
    let count = |i| r.get::<_, f64>(i).map(|n| n.max(0.0) as u64);
    let usd: f64 = r.get(11)?;
    let cache_write = count(6)?;
    let hour = count(7)?.min(cache_write);
    Ok(ReportRow {
        tenant: r.get(0)?,
        day: r.get(1)?,
        model: r.get(2)?,
        calls: count(3)?,
        tokens: Tokens {
            input: count(4)?,
            output: count(5)?,
            cache_write_5m: cache_write - hour,
            cache_write_1h: hour,
            cache_read: count(8)?,
            reasoning: count(9)?,
            web_searches: count(10)?,
        },
        usd: if usd.is_nan() { 0.0 } else { usd.max(0.0) },
    })
}

fn spend_report(c: &Connection, query: &ReportQuery) -> rusqlite::Result<Vec<ReportRow>> {
    let from = query.from_day.unwrap_or(i64::MIN);
    let to = query.to_day.unwrap_or(i64::MAX);
    let sums = match has_kind_columns(c)? {
        true => REPORT_SUMS,
        false => REPORT_SUMS_OLD,
    };
    match &query.tenant {
        Some(tenant) => c
            .prepare_cached(&report_query(sums, true))?
            .query_map(params![from, to, tenant], report_row)?
            .collect(),
        None => c
            .prepare_cached(&report_query(sums, false))?
            .query_map(params![from, to], report_row)?
            .collect(),
    }
}
