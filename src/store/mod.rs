//! The embedded store: SQLite in WAL mode. It holds the spend ledger (one row per
//! charged upstream call) and session resets; budget windows are sums over the ledger,
//! so nothing is kept twice and a restart rebuilds every window from what was settled.
//!
//! Writes go through one writer thread that commits whatever has queued up in one
//! transaction (group commit) and acknowledges each write once it is committed; in WAL
//! mode with `synchronous = NORMAL` a committed write survives the process being killed.
//! Reads use their own connection, which WAL lets run beside the writer.

use std::{
    sync::{mpsc, Arc, Mutex},
    thread,
};

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};
use tokio::sync::oneshot;

use crate::policy::budget::Usage;

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

enum Op {
    Charge(Charge),
    ResetSession {
        tenant: String,
        session: String,
        at_ms: i64,
    },
    Remember(StoredResponse),
}

struct Write {
    op: Op,
    ack: Option<oneshot::Sender<()>>,
}

pub struct Store {
    writer: mpsc::Sender<Write>,
    reader: Mutex<Connection>,
    /// The checkpointer thread runs while this lives.
    _alive: Arc<()>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sqlite(#[from] rusqlite::Error),
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
CREATE TABLE IF NOT EXISTS session_resets (
    tenant TEXT NOT NULL,
    session TEXT NOT NULL,
    at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, session)
);
";

fn open(path: &str) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    // The ledger is append-mostly and read by index: a small page cache is enough, and
    // three connections of the default 2 MB each showed in Backstop's RSS.
    conn.pragma_update(None, "cache_size", -256)?;
    Ok(conn)
}

impl Store {
    /// Opens (creating if needed) the store at `path`; `":memory:"` is a private
    /// in-memory database that lives as long as this `Store`.
    pub fn open(path: &str) -> Result<Store, StoreError> {
        let path = if path == ":memory:" {
            format!(
                "file:backstop-{}?mode=memory&cache=shared",
                uuid::Uuid::new_v4().simple()
            )
        } else {
            path.to_string()
        };
        let writer_conn = open(&path)?;
        writer_conn.execute_batch(SCHEMA)?;
        // Checkpoints copy the WAL into the database and sync it: slow, and on the commit
        // path they would stall every request waiting for its ledger write. They run on
        // their own connection and thread instead, without blocking the writer.
        let alive = Arc::new(());
        if !path.starts_with("file:backstop-") {
            writer_conn.pragma_update(None, "wal_autocheckpoint", 0)?;
            let checkpointer = open(&path)?;
            let alive = Arc::downgrade(&alive);
            thread::Builder::new()
                .name("backstop-checkpoint".into())
                .spawn(move || {
                    while alive.upgrade().is_some() {
                        thread::sleep(std::time::Duration::from_millis(500));
                        if let Err(err) =
                            checkpointer.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                        {
                            tracing::warn!(error = %err, "store checkpoint failed");
                        }
                    }
                })
                .expect("spawn store checkpointer");
        }
        let reader = open(&path)?;
        let (tx, rx) = mpsc::channel::<Write>();
        thread::Builder::new()
            .name("backstop-store".into())
            .spawn(move || write_loop(writer_conn, rx))
            .expect("spawn store writer");
        Ok(Store {
            writer: tx,
            reader: Mutex::new(reader),
            _alive: alive,
        })
    }

    /// Appends a charge and waits until it is committed.
    pub async fn charge(&self, charge: Charge) {
        let (ack, done) = oneshot::channel();
        if self
            .writer
            .send(Write {
                op: Op::Charge(charge),
                ack: Some(ack),
            })
            .is_ok()
        {
            let _ = done.await;
        }
    }

    /// Appends a charge without waiting (for settlements that happen after the response,
    /// at the end of a stream).
    pub fn charge_later(&self, charge: Charge) {
        let _ = self.writer.send(Write {
            op: Op::Charge(charge),
            ack: None,
        });
    }

    pub async fn reset_session(&self, tenant: &str, session: &str, at_ms: i64) {
        let (ack, done) = oneshot::channel();
        let op = Op::ResetSession {
            tenant: tenant.into(),
            session: session.into(),
            at_ms,
        };
        if self.writer.send(Write { op, ack: Some(ack) }).is_ok() {
            let _ = done.await;
        }
    }

    /// Keeps a response for replay and waits until it is committed.
    pub async fn remember(&self, response: StoredResponse) {
        let (ack, done) = oneshot::channel();
        if self
            .writer
            .send(Write {
                op: Op::Remember(response),
                ack: Some(ack),
            })
            .is_ok()
        {
            let _ = done.await;
        }
    }

    /// A kept response that has not expired.
    pub fn recall(
        &self,
        tenant: &str,
        key: &str,
        now_ms: i64,
    ) -> Result<Option<StoredResponse>, StoreError> {
        Ok(self.read(|c| {
            c.query_row(
                "SELECT body_hash, status, content_type, body, expires_ms FROM idempotency WHERE tenant = ?1 AND key = ?2 AND expires_ms > ?3",
                params![tenant, key, now_ms],
                |r| {
                    Ok(StoredResponse {
                        tenant: tenant.to_string(),
                        key: key.to_string(),
                        body_hash: r.get(0)?,
                        status: r.get::<_, i64>(1)? as u16,
                        content_type: r.get(2)?,
                        body: r.get(3)?,
                        expires_ms: r.get(4)?,
                    })
                },
            )
            .optional()
        })?)
    }

    fn read<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> rusqlite::Result<T> {
        let conn = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        f(&conn)
    }

    /// A session's usage since its last reset.
    pub fn session_usage(&self, tenant: &str, session: &str) -> Result<Usage, StoreError> {
        Ok(self.read(|c| {
            let since: i64 = c
                .query_row("SELECT at_ms FROM session_resets WHERE tenant = ?1 AND session = ?2", params![tenant, session], |r| r.get(0))
                .optional()?
                .unwrap_or(i64::MIN);
            c.query_row(
                "SELECT COALESCE(SUM(calls),0), COALESCE(SUM(input_tokens + output_tokens),0), COALESCE(SUM(usd),0.0)
                 FROM ledger WHERE tenant = ?1 AND session = ?2 AND ts_ms >= ?3",
                params![tenant, session, since],
                usage_row,
            )
        })?)
    }

    /// A tenant's usage on one UTC day.
    pub fn tenant_day_usage(&self, tenant: &str, day: i64) -> Result<Usage, StoreError> {
        Ok(self.read(|c| {
            c.query_row(
                "SELECT COALESCE(SUM(calls),0), COALESCE(SUM(input_tokens + output_tokens),0), COALESCE(SUM(usd),0.0)
                 FROM ledger WHERE tenant = ?1 AND day = ?2",
                params![tenant, day],
                usage_row,
            )
        })?)
    }

    /// A tenant's spend on one day, by model: (model, calls, tokens, usd).
    pub fn tenant_day_by_model(
        &self,
        tenant: &str,
        day: i64,
    ) -> Result<Vec<(String, Usage)>, StoreError> {
        Ok(self.read(|c| {
            let mut stmt = c.prepare(
                "SELECT model, SUM(calls), SUM(input_tokens + output_tokens), SUM(usd)
                 FROM ledger WHERE tenant = ?1 AND day = ?2 GROUP BY model ORDER BY model",
            )?;
            let rows = stmt.query_map(params![tenant, day], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    Usage {
                        calls: r.get::<_, i64>(1)? as u64,
                        tokens: r.get::<_, i64>(2)? as u64,
                        usd: r.get(3)?,
                    },
                ))
            })?;
            rows.collect()
        })?)
    }
}

fn usage_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Usage> {
    Ok(Usage {
        calls: r.get::<_, i64>(0)? as u64,
        tokens: r.get::<_, i64>(1)? as u64,
        usd: r.get(2)?,
    })
}

fn write_loop(mut conn: Connection, rx: mpsc::Receiver<Write>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        if let Err(err) = commit(&mut conn, &batch) {
            tracing::error!(error = %err, writes = batch.len(), "store write failed");
            metrics::counter!("backstop_store_errors_total").increment(1);
        }
        metrics::counter!("backstop_store_commits_total").increment(1);
        for w in batch {
            if let Some(ack) = w.ack {
                let _ = ack.send(());
            }
        }
    }
}

fn commit(conn: &mut Connection, batch: &[Write]) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut insert = tx.prepare_cached(
            "INSERT INTO ledger (ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        )?;
        let mut reset = tx.prepare_cached(
            "INSERT INTO session_resets (tenant, session, at_ms) VALUES (?1, ?2, ?3)
             ON CONFLICT (tenant, session) DO UPDATE SET at_ms = excluded.at_ms",
        )?;
        let mut remember = tx.prepare_cached(
            "INSERT INTO idempotency (tenant, key, body_hash, status, content_type, body, expires_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT (tenant, key) DO UPDATE SET body_hash = excluded.body_hash, status = excluded.status,
                 content_type = excluded.content_type, body = excluded.body, expires_ms = excluded.expires_ms",
        )?;
        for w in batch {
            match &w.op {
                Op::Remember(r) => {
                    remember.execute(params![
                        r.tenant,
                        r.key,
                        r.body_hash,
                        i64::from(r.status),
                        r.content_type,
                        r.body,
                        r.expires_ms
                    ])?;
                }
                Op::Charge(c) => {
                    insert.execute(params![
                        c.ts_ms,
                        c.day,
                        c.tenant,
                        c.session,
                        c.model,
                        c.calls as i64,
                        c.input_tokens as i64,
                        c.output_tokens as i64,
                        c.usd
                    ])?;
                }
                Op::ResetSession {
                    tenant,
                    session,
                    at_ms,
                } => {
                    reset.execute(params![tenant, session, at_ms])?;
                }
            }
        }
    }
    tx.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(session: Option<&str>, day: i64, ts_ms: i64, usd: f64) -> Charge {
        Charge {
            ts_ms,
            day,
            tenant: "t".into(),
            session: session.map(str::to_owned),
            model: "gpt-4o".into(),
            calls: 1,
            input_tokens: 10,
            output_tokens: 5,
            usd,
        }
    }

    #[tokio::test]
    async fn charges_sum_per_session_and_per_day_and_resets_hide_the_past() {
        let store = Store::open(":memory:").unwrap();
        store.charge(charge(Some("s1"), 100, 1_000, 0.5)).await;
        store.charge(charge(Some("s1"), 100, 2_000, 0.25)).await;
        store.charge(charge(None, 100, 3_000, 1.0)).await;
        store.charge(charge(Some("s1"), 99, 500, 7.0)).await;
        assert_eq!(
            store.session_usage("t", "s1").unwrap(),
            Usage {
                calls: 3,
                tokens: 45,
                usd: 7.75
            }
        );
        assert_eq!(
            store.tenant_day_usage("t", 100).unwrap(),
            Usage {
                calls: 3,
                tokens: 45,
                usd: 1.75
            }
        );
        store.reset_session("t", "s1", 1_500).await;
        assert_eq!(
            store.session_usage("t", "s1").unwrap(),
            Usage {
                calls: 1,
                tokens: 15,
                usd: 0.25
            }
        );
        assert_eq!(
            store.tenant_day_usage("t", 100).unwrap().usd,
            1.75,
            "a session reset keeps the tenant's spend"
        );
        assert_eq!(store.tenant_day_by_model("t", 100).unwrap()[0].0, "gpt-4o");
    }

    #[tokio::test]
    async fn a_file_store_keeps_its_ledger_across_reopening() {
        let dir =
            std::env::temp_dir().join(format!("backstop-store-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.db");
        let path = path.to_str().unwrap();
        {
            let store = Store::open(path).unwrap();
            store.charge(charge(Some("s"), 1, 1, 0.125)).await;
        }
        let store = Store::open(path).unwrap();
        assert_eq!(store.session_usage("t", "s").unwrap().usd, 0.125);
        let _ = std::fs::remove_dir_all(dir);
    }
}
