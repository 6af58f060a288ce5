//! The spool (`[store] spool`): the writes for calls already made that Postgres could
//! not take, kept in a small SQLite file of the replica's own until it can.
//!
//! What goes there ([`Kept`]): ledger settles, the reservations of budgeted calls and
//! their withdrawals (a call admitted while Postgres is away, `on_unavailable = "open"`,
//! is then charged at its reserved amount if the replica dies before it settles), and
//! settles kept for Redis. Each batch is committed with `synchronous = FULL` (fsynced)
//! before its writes are answered, so a replica killed with `kill -9` leaves them on
//! disk; the writer replays them, oldest first and before any newer write, as soon as
//! Postgres answers, and the next process on the same spool replays what its
//! predecessor left at start.
//!
//! Replays are exactly once: every kept write is keyed (ledger rows and reservations by
//! reservation id, `ON CONFLICT (id) DO NOTHING`; a settle kept for Redis by its
//! reservation), so a write Postgres took before the spool forgot it (the process killed
//! between the commit and the delete, or the commit's acknowledgement lost) is the same
//! row when it comes again.
//!
//! The file is the process's alone while it runs (`locking_mode = EXCLUSIVE`): a second
//! replica pointed at it refuses to start instead of replaying the other's writes. A
//! spool written by a newer release is refused too (its format is `user_version`);
//! a row this build cannot read is moved to `unreadable` (kept, logged), never replayed
//! as something else.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, Mutex,
};

use rusqlite::{Connection, OpenFlags};

use crate::store::{write::Op, Charge, QueuedSettle, ReservationRecord, StoreError};

/// The spool's format (`PRAGMA user_version`): the rows' JSON as [`Kept`] writes it.
const FORMAT: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS spool (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    -- When it was kept, for whoever reads the file (ms since the epoch).
    kept_ms INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS unreadable (
    seq INTEGER PRIMARY KEY,
    kept_ms INTEGER NOT NULL,
    record TEXT NOT NULL
);";

/// A write that must reach Postgres however long it is away.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum Kept {
    Reserve(ReservationRecord),
    Settle { reservation: i64, charge: Charge },
    Unreserve { reservation: i64 },
    QueueSettle(QueuedSettle),
}

impl Kept {
    /// The write as one to keep, if it is one.
    pub(super) fn of(op: Op) -> Option<Kept> {
        match op {
            Op::Reserve(r) => Some(Kept::Reserve(r)),
            Op::Settle {
                reservation: Some(reservation),
                charge,
            } => Some(Kept::Settle {
                reservation,
                charge,
            }),
            Op::Unreserve(reservation) => Some(Kept::Unreserve { reservation }),
            Op::QueueSettle(q) => Some(Kept::QueueSettle(q)),
            _ => None,
        }
    }

    pub(super) fn to_op(&self) -> Op {
        match self.clone() {
            Kept::Reserve(r) => Op::Reserve(r),
            Kept::Settle {
                reservation,
                charge,
            } => Op::Settle {
                reservation: Some(reservation),
                charge,
            },
            Kept::Unreserve { reservation } => Op::Unreserve(reservation),
            Kept::QueueSettle(q) => Op::QueueSettle(q),
        }
    }
}

/// The open spool file: one connection, used from tokio's blocking pool.
#[derive(Clone)]
pub(super) struct Spool {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Mutex<Connection>,
    path: String,
    /// Rows in `spool`.
    len: AtomicU64,
}

fn open_conn(path: &str) -> rusqlite::Result<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    // Taken by the first write below, held while the connection lives; set before WAL
    // so that no shared-memory index is made for other processes to join.
    conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    // Every commit fsynced: a kept write is answered only once it is on disk.
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.pragma_update(None, "cache_size", -64)?;
    Ok(conn)
}

fn failed(path: &str, err: impl std::fmt::Display) -> StoreError {
    StoreError::Write(format!("store.spool {path}: {err}").into())
}

impl Spool {
    /// Opens (creating it if needed) the spool at `path` and takes it for this process.
    /// Blocking: call it at start-up.
    pub(super) fn open(path: &str) -> Result<Spool, StoreError> {
        let locked = |e: rusqlite::Error| {
            let busy = matches!(
                e.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
            );
            let why = if busy {
                "in use by another process (each replica needs a spool of its own)".to_string()
            } else {
                e.to_string()
            };
            StoreError::Unavailable(format!("store.spool: cannot open {path}: {why}").into())
        };
        let mut conn = open_conn(path).map_err(locked)?;
        let tx = conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Exclusive)
            .map_err(locked)?;
        let format: i64 = tx
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(locked)?;
        if format > FORMAT {
            return Err(StoreError::Unavailable(
                format!(
                    "store.spool: {path} was written by a newer release (format {format}, this build reads {FORMAT}): \
                     let that release replay it, or move it aside"
                )
                .into(),
            ));
        }
        tx.execute_batch(SCHEMA).map_err(locked)?;
        tx.pragma_update(None, "user_version", FORMAT)
            .map_err(locked)?;
        let unreadable = set_aside_unreadable(&tx).map_err(locked)?;
        let len: i64 = tx
            .query_row("SELECT COUNT(*) FROM spool", [], |r| r.get(0))
            .map_err(locked)?;
        tx.commit().map_err(locked)?;
        if unreadable > 0 {
            tracing::error!(
                spool = path,
                writes = unreadable,
                "spooled writes this build cannot read are set aside (table unreadable), not replayed"
            );
        }
        let spool = Spool {
            inner: Arc::new(Inner {
                conn: Mutex::new(conn),
                path: path.to_string(),
                len: AtomicU64::new(u64::try_from(len).unwrap_or(0)),
            }),
        };
        spool.report();
        Ok(spool)
    }

    pub(super) fn path(&self) -> &str {
        &self.inner.path
    }

    /// Writes waiting in the spool.
    pub(super) fn len(&self) -> u64 {
        self.inner.len.load(Ordering::Relaxed)
    }

    fn report(&self) {
        metrics::gauge!("backstop_store_spooled_writes").set(self.len() as f64);
    }

    /// Runs `f` on the connection off the async workers.
    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let inner = self.inner.clone();
        let ran = tokio::task::spawn_blocking(move || {
            let mut conn = inner.conn.lock().unwrap_or_else(|e| e.into_inner());
            f(&mut conn)
        })
        .await;
        match ran {
            Ok(result) => result.map_err(|e| failed(self.path(), e)),
            Err(err) => Err(failed(self.path(), err)),
        }
    }

    /// Appends `writes` in one fsynced transaction; resolves once they are on disk.
    pub(super) async fn keep(&self, writes: &[Kept]) -> Result<(), StoreError> {
        let records = writes
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| failed(self.path(), e))?;
        let n = records.len() as u64;
        self.with(move |conn| {
            let tx = conn.transaction()?;
            {
                let mut insert = tx.prepare_cached("INSERT INTO spool (record) VALUES (?1)")?;
                for record in &records {
                    insert.execute([record])?;
                }
            }
            tx.commit()
        })
        .await?;
        self.inner.len.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("backstop_store_spooled_writes_total").increment(n);
        self.report();
        Ok(())
    }

    /// The oldest `limit` writes, with their sequence numbers.
    pub(super) async fn oldest(&self, limit: usize) -> Result<Vec<(i64, Kept)>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .with(move |conn| {
                let mut select =
                    conn.prepare_cached("SELECT seq, record FROM spool ORDER BY seq LIMIT ?1")?;
                let rows = select
                    .query_map([limit], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(rows)
            })
            .await?;
        // Unreadable rows were set aside at open; this build wrote every row since.
        rows.into_iter()
            .map(|(seq, record)| {
                serde_json::from_str(&record)
                    .map(|kept| (seq, kept))
                    .map_err(|e| failed(self.path(), e))
            })
            .collect()
    }

    /// Forgets every write up to sequence `last`, Postgres having taken them.
    pub(super) async fn forget(&self, last: i64) -> Result<(), StoreError> {
        let n = self
            .with(move |conn| conn.execute("DELETE FROM spool WHERE seq <= ?1", [last]))
            .await?;
        let n = n as u64;
        let _ = self
            .inner
            .len
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |len| {
                Some(len.saturating_sub(n))
            });
        metrics::counter!("backstop_store_replayed_writes_total").increment(n);
        self.report();
        Ok(())
    }
}

/// Moves the rows that do not parse as a [`Kept`] to `unreadable`; how many.
fn set_aside_unreadable(tx: &rusqlite::Transaction<'_>) -> rusqlite::Result<usize> {
    let bad: Vec<i64> = {
        let mut select = tx.prepare("SELECT seq, record FROM spool")?;
        let rows = select
            .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        rows.into_iter()
            .filter(|(_, record)| serde_json::from_str::<Kept>(record).is_err())
            .map(|(seq, _)| seq)
            .collect()
    };
    for seq in &bad {
        tx.execute(
            "INSERT OR REPLACE INTO unreadable SELECT seq, kept_ms, record FROM spool WHERE seq = ?1",
            [seq],
        )?;
        tx.execute("DELETE FROM spool WHERE seq = ?1", [seq])?;
    }
    Ok(bad.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::store::test_dir::TestDir;

    fn spool_file(dir: &TestDir) -> String {
        dir.path().join("spool.db").to_str().unwrap().to_string()
    }

    fn settle(reservation: i64, usd: f64) -> Kept {
        Kept::Settle {
            reservation,
            charge: Charge {
                ts_ms: 5,
                day: 1,
                tenant: "t".into(),
                session: Some("s".into()),
                model: "gpt-4o".into(),
                calls: 1,
                tokens: crate::billing::Tokens::plain(10, 3),
                usd,
            },
        }
    }

    fn kinds() -> Vec<Kept> {
        vec![
            Kept::Reserve(ReservationRecord {
                id: 7,
                ts_ms: 1,
                day: 1,
                tenant: "t".into(),
                session: None,
                model: "gpt-4o".into(),
                calls: 1,
                tokens: 4096,
                usd: 0.25,
            }),
            settle(7, 0.125),
            Kept::Unreserve { reservation: 8 },
            Kept::QueueSettle(QueuedSettle {
                reservation: "r-9".into(),
                body: "{}".into(),
                queued_ms: 3,
            }),
        ]
    }

    #[tokio::test]
    async fn kept_writes_come_back_in_order_across_a_reopen_until_forgotten() {
        let dir = TestDir::new("spool");
        let spool = Spool::open(&spool_file(&dir)).unwrap();
        assert_eq!(spool.len(), 0);
        spool.keep(&kinds()).await.unwrap();
        spool.keep(&[settle(11, 1.0)]).await.unwrap();
        assert_eq!(spool.len(), 5);
        drop(spool);

        let spool = Spool::open(&spool_file(&dir)).unwrap();
        assert_eq!(spool.len(), 5, "counted again at open");
        let rows = spool.oldest(3).await.unwrap();
        let got: Vec<Kept> = rows.iter().map(|(_, k)| k.clone()).collect();
        assert_eq!(got, kinds()[..3]);
        spool.forget(rows[2].0).await.unwrap();
        assert_eq!(spool.len(), 2);
        let rest: Vec<Kept> = spool
            .oldest(10)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, k)| k)
            .collect();
        assert_eq!(rest, [kinds()[3].clone(), settle(11, 1.0)]);
    }

    #[test]
    fn every_kept_write_is_the_op_it_came_from() {
        for kept in kinds() {
            assert_eq!(Kept::of(kept.to_op()), Some(kept));
        }
        assert!(Kept::of(Op::UnqueueSettle("r".into())).is_none());
        let nameless = Op::Settle {
            reservation: None,
            charge: match settle(1, 0.0) {
                Kept::Settle { charge, .. } => charge,
                _ => unreachable!(),
            },
        };
        assert!(
            Kept::of(nameless).is_none(),
            "a charge without its key is not replayable"
        );
    }

    #[test]
    fn a_spool_in_use_by_another_process_is_refused() {
        let dir = TestDir::new("spool");
        let _held = Spool::open(&spool_file(&dir)).unwrap();
        let err = Spool::open(&spool_file(&dir)).err().expect("refused");
        assert_eq!(
            err.to_string(),
            format!(
                "store.spool: cannot open {}: in use by another process (each replica needs a spool of its own)",
                spool_file(&dir)
            )
        );
    }

    #[test]
    fn a_spool_of_a_newer_format_is_refused_and_unreadable_rows_set_aside() {
        let dir = TestDir::new("spool");
        drop(Spool::open(&spool_file(&dir)).unwrap());
        let conn = Connection::open(spool_file(&dir)).unwrap();
        conn.execute(
            "INSERT INTO spool (kept_ms, record) VALUES (1, '{\"op\":\"teleport\"}')",
            [],
        )
        .unwrap();
        drop(conn);
        let spool = Spool::open(&spool_file(&dir)).unwrap();
        assert_eq!(spool.len(), 0, "never replayed as something else");
        drop(spool);
        let conn = Connection::open(spool_file(&dir)).unwrap();
        let kept: String = conn
            .query_row("SELECT record FROM unreadable", [], |r| r.get(0))
            .unwrap();
        assert_eq!(kept, "{\"op\":\"teleport\"}");
        conn.pragma_update(None, "user_version", FORMAT + 1)
            .unwrap();
        drop(conn);
        let err = Spool::open(&spool_file(&dir)).err().expect("refused");
        assert!(
            err.to_string()
                .contains("written by a newer release (format 2"),
            "{err}"
        );
    }
}
