//! [`SqliteStore`](super::SqliteStore)'s writer thread (group commit, one transaction
//! per batch, each write acknowledged with its result), the WAL bound, and the thread
//! that checkpoints passively. (Purges are scheduled on tokio time by
//! [`crate::store::spawn_purger`] and queued here like any write.)
//!
//! The WAL is kept small by the writer itself: once the frames appended since the WAL
//! last restarted pass a quarter of `store.max_wal_bytes`, it runs a passive checkpoint
//! between two batches, when no commit can race it, so the whole WAL is backfilled and
//! SQLite restarts it from its beginning on the next write. (A checkpoint on another
//! connection under steady writes always finds newer frames, so the WAL never restarts:
//! 1.1 GB after 60 s at 1,000 RPS.) That pass syncs the WAL and the database file, and
//! no commit lands while it runs, so it runs by size, not by the clock, and the
//! background checkpointer does most of its copying beforehand, every
//! [`CHECKPOINT_EVERY`], off the commit path. A light load never pays the pass (the
//! background checkpoint catches up and the WAL restarts by itself); a `bench` run
//! pays it about 55 times, 4 ms each (median), where a pass every 100 ms paid 3 to 4 ms
//! about 260 times. That took the added p99 at 1,000 RPS with every policy from +3.4 to
//! +3.7 ms to +0.6 to +1.0 ms (`docs/performance.md`). Truncating past
//! `store.max_wal_bytes` is the fallback when a reader pins the WAL.

use std::{
    cell::Cell,
    ffi::c_int,
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc, Weak,
    },
    thread,
    time::{Duration, Instant},
};

use rusqlite::{hooks::Wal, params, Connection, OptionalExtension, TransactionBehavior};

use super::{to_sql, Op, Write};

/// Writes committed in one transaction at most.
const MAX_BATCH: usize = 4096;
/// Prepared statements the writer keeps: `commit`'s, with room to spare.
const STATEMENTS: usize = 32;
/// How often the background connection checkpoints (passively: it never blocks the
/// writer, so under sustained load it cannot always finish; the writer's pass and its
/// WAL bound cover that). Often enough that the writer's pass finds little left to copy:
/// at 500 ms that pass took 12 to 16 ms at 1,000 budgeted calls a second, at 100 ms 4.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);
/// Ledger rows deleted per purge transaction, and transactions per purge: old rows go
/// in bounded steps instead of one transaction that stalls every ledger write.
const PURGE_STEP: i64 = 10_000;
const PURGE_STEPS: usize = 10;
/// How long the writer waits for a concurrent checkpoint to finish before its own
/// truncation gives up for now.
const TRUNCATE_PATIENCE: Duration = Duration::from_millis(500);
/// After a WAL truncation failed (a reader held it), wait this long before trying again
/// rather than stalling every commit.
const TRUNCATE_RETRY: Duration = Duration::from_millis(100);

pub(super) struct Settings {
    /// The WAL file (`None` for an in-memory store).
    pub wal: Option<PathBuf>,
    pub max_wal_bytes: u64,
    pub retention: Duration,
    /// The writer's backfill passes so far (each one pauses commits).
    pub backfills: Arc<AtomicU64>,
}

thread_local! {
    /// The frames in the WAL after the writer's last commit (its connection's WAL hook;
    /// the writer is the only thread that commits on it).
    static WAL_FRAMES: Cell<u64> = const { Cell::new(0) };
}

fn count_frames(_: &Wal, frames: c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.set(u64::try_from(frames).unwrap_or(0));
    Ok(())
}

pub(super) fn write_loop(mut conn: Connection, rx: mpsc::Receiver<Write>, settings: Settings) {
    // Every statement of `commit` stays prepared (rusqlite keeps 16 by default).
    conn.set_prepared_statement_cache_capacity(STATEMENTS);
    let mut truncate_not_before: Option<Instant> = None;
    let mut backfill_not_before: Option<Instant> = None;
    // The WAL's frames, by the hook (it replaces the auto-checkpoint's, already off).
    conn.wal_hook(Some(count_frames));
    WAL_FRAMES.set(0);
    let frame_bytes = conn
        .pragma_query_value(None, "page_size", |r| r.get::<_, u64>(0))
        .unwrap_or(4096)
        + WAL_FRAME_HEADER;
    let backfill_frames = (settings.max_wal_bytes / 4 / frame_bytes).max(1);
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let (purges, writes): (Vec<Write>, Vec<Write>) = batch
            .into_iter()
            .partition(|w| matches!(w.op, Op::Purge { .. }));
        if !writes.is_empty() {
            let result = commit(&mut conn, &writes);
            metrics::counter!("backstop_store_commits_total").increment(1);
            let failure: Option<Arc<str>> = result.err().map(|err| {
                tracing::error!(error = %err, writes = writes.len(), "store write failed");
                err.to_string().into()
            });
            for w in writes {
                if failure.is_some() {
                    metrics::counter!("backstop_store_errors_total", "op" => w.op.label())
                        .increment(1);
                }
                if let Some(ack) = w.ack {
                    let _ = ack.send(failure.clone().map_or(Ok(()), Err));
                }
            }
        }
        for w in purges {
            let Op::Purge { now_ms } = w.op else {
                continue;
            };
            let result = purge(&mut conn, now_ms, settings.retention).map_err(|err| {
                tracing::error!(error = %err, "store purge failed");
                metrics::counter!("backstop_store_errors_total", "op" => "purge").increment(1);
                Arc::<str>::from(err.to_string())
            });
            if let Some(ack) = w.ack {
                let _ = ack.send(result);
            }
        }
        if settings.wal.is_some()
            && WAL_FRAMES.get() >= backfill_frames
            && backfill_not_before.is_none_or(|t| Instant::now() >= t)
        {
            // Between batches no commit can race it, so this pass backfills the whole
            // WAL and the next write restarts it from the beginning: under steady
            // writes the WAL stays small without a blocking truncation.
            backfill_not_before = Some(Instant::now() + BACKFILL_RETRY);
            settings.backfills.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("backstop_store_backfills_total").increment(1);
            match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
                Ok((r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
            }) {
                // All of it backfilled: the next commit restarts the WAL and reports
                // its own frames.
                Ok((frames, done)) if frames == done => {
                    WAL_FRAMES.set(0);
                    backfill_not_before = None;
                }
                // A reader still needs frames: not after every batch until it is done.
                Ok(_) => {}
                Err(err) => tracing::debug!(error = %err, "writer-side checkpoint skipped"),
            }
        }
        bound_wal(&conn, &settings, &mut truncate_not_before);
    }
}

/// After a backfill pass a reader kept from finishing, wait this long before the next:
/// the writer does not pause commits after every batch while the WAL is pinned.
const BACKFILL_RETRY: Duration = Duration::from_millis(100);
/// A WAL frame's header, before its page.
const WAL_FRAME_HEADER: u64 = 24;

/// A write transaction begun `IMMEDIATE` (the write lock taken up front, so a database
/// locked by another process fails here, after `busy_timeout`, before anything is
/// half-written), rolled back when dropped uncommitted. Its `BEGIN` and `COMMIT` are
/// cached statements: rusqlite's `Transaction` runs them through `execute_batch`, which
/// parses both again on every commit (about 8,700 instructions a budgeted call, which
/// commits twice: `scripts/instructions-per-request`).
struct Immediate<'c> {
    conn: &'c Connection,
}

impl<'c> Immediate<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        conn.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
        Ok(Immediate { conn })
    }

    /// Commits; a failed commit is rolled back (as the drop does).
    fn commit(self) -> rusqlite::Result<()> {
        self.conn.prepare_cached("COMMIT")?.execute([]).map(drop)
    }
}

impl std::ops::Deref for Immediate<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for Immediate<'_> {
    fn drop(&mut self) {
        // Still in the transaction: not committed, or the commit failed.
        if !self.conn.is_autocommit() {
            let rolled_back = self
                .conn
                .prepare_cached("ROLLBACK")
                .and_then(|mut s| s.execute([]));
            if let Err(err) = rolled_back {
                tracing::error!(error = %err, "cannot roll back a failed store write");
            }
        }
    }
}

fn commit(conn: &mut Connection, batch: &[Write]) -> rusqlite::Result<()> {
    let tx = Immediate::begin(conn)?;
    for w in batch {
        match &w.op {
            Op::Reserve(r) => {
                tx.prepare_cached(
                    "INSERT INTO reservations (id, ts_ms, day, tenant, session, model, calls, tokens, usd)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                )?
                .execute(params![
                    r.id,
                    r.ts_ms,
                    r.day,
                    r.tenant,
                    r.session,
                    r.model,
                    to_sql(r.calls),
                    to_sql(r.tokens),
                    r.usd
                ])?;
            }
            Op::Settle {
                reservation,
                charge: c,
            } => {
                if let Some(id) = reservation {
                    tx.prepare_cached("DELETE FROM reservations WHERE id = ?1")?
                        .execute(params![id])?;
                }
                tx.prepare_cached(
                    "INSERT INTO ledger (ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens,
                         cache_write_tokens, cache_write_1h_tokens, cache_read_tokens, reasoning_tokens, web_searches, usd)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
                )?
                .execute(params![
                    c.ts_ms,
                    c.day,
                    c.tenant,
                    c.session,
                    c.model,
                    to_sql(c.calls),
                    to_sql(c.tokens.input),
                    to_sql(c.tokens.output),
                    to_sql(c.tokens.cache_write()),
                    to_sql(c.tokens.cache_write_1h),
                    to_sql(c.tokens.cache_read),
                    to_sql(c.tokens.reasoning),
                    to_sql(c.tokens.web_searches),
                    c.usd
                ])?;
            }
            Op::ResetSession {
                tenant,
                session,
                at_ms,
            } => {
                tx.prepare_cached(
                    "INSERT INTO session_resets (tenant, session, at_ms) VALUES (?1, ?2, ?3)
                     ON CONFLICT (tenant, session) DO UPDATE SET at_ms = excluded.at_ms",
                )?
                .execute(params![tenant, session, at_ms])?;
            }
            Op::Remember(r) => {
                tx.prepare_cached(
                    "INSERT INTO idempotency (tenant, key, body_hash, status, content_type, body, expires_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                     ON CONFLICT (tenant, key) DO UPDATE SET body_hash = excluded.body_hash, status = excluded.status,
                         content_type = excluded.content_type, body = excluded.body, expires_ms = excluded.expires_ms",
                )?
                .execute(params![
                    r.tenant,
                    r.key,
                    r.body_hash,
                    i64::from(r.status),
                    r.content_type,
                    r.body,
                    r.expires_ms
                ])?;
            }
            Op::QueueSettle(q) => {
                tx.prepare_cached(
                    "INSERT OR REPLACE INTO shared_settles (reservation, body, queued_ms) VALUES (?1, ?2, ?3)",
                )?
                .execute(params![q.reservation, q.body, q.queued_ms])?;
            }
            Op::UnqueueSettle(reservation) => {
                tx.prepare_cached("DELETE FROM shared_settles WHERE reservation = ?1")?
                    .execute(params![reservation])?;
            }
            Op::RecordOwners(owners) => {
                let mut insert = tx.prepare_cached(
                    "INSERT INTO response_owners (id, tenant, expires_ms, context_tokens) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, expires_ms = excluded.expires_ms,
                         context_tokens = coalesce(excluded.context_tokens, response_owners.context_tokens)",
                )?;
                for o in owners {
                    let context = o
                        .context_tokens
                        .map(|n| i64::try_from(n).unwrap_or(i64::MAX));
                    insert.execute(params![o.id, o.tenant, o.expires_ms, context])?;
                }
            }
            Op::SaveGuard(g) => {
                tx.prepare_cached(
                    "INSERT INTO guard_states (tenant, session, closed, until_ms, code, rule, evidence, updated_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                     ON CONFLICT (tenant, session) DO UPDATE SET closed = excluded.closed, until_ms = excluded.until_ms,
                         code = excluded.code, rule = excluded.rule, evidence = excluded.evidence, updated_ms = excluded.updated_ms",
                )?
                .execute(params![
                    g.tenant,
                    g.session,
                    i64::from(g.closed),
                    g.until_ms,
                    g.code,
                    g.rule,
                    g.evidence,
                    g.updated_ms
                ])?;
            }
            Op::ClearGuard { tenant, session } => {
                tx.prepare_cached("DELETE FROM guard_states WHERE tenant = ?1 AND session = ?2")?
                    .execute(params![tenant, session])?;
            }
            Op::Unreserve(id) => {
                tx.prepare_cached("DELETE FROM reservations WHERE id = ?1")?
                    .execute(params![id])?;
            }
            Op::Journal {
                tenant,
                session,
                records,
                max_entries,
            } => {
                let mut insert = tx.prepare_cached(
                    "INSERT INTO side_effects (tenant, session, call_id, at_ms, proposed, entry) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (tenant, session, call_id) DO UPDATE SET at_ms = excluded.at_ms,
                         proposed = excluded.proposed, entry = excluded.entry",
                )?;
                for r in records {
                    insert.execute(params![
                        tenant,
                        session,
                        r.call_id,
                        r.at_ms,
                        i64::from(r.proposed),
                        r.entry
                    ])?;
                }
                tx.prepare_cached(
                    "DELETE FROM side_effects WHERE tenant = ?1 AND session = ?2 AND call_id NOT IN
                     (SELECT call_id FROM side_effects WHERE tenant = ?1 AND session = ?2
                      ORDER BY proposed, at_ms DESC, call_id DESC LIMIT ?3)",
                )?
                .execute(params![tenant, session, to_sql(*max_entries as u64)])?;
            }
            Op::Purge { .. } => {}
        }
    }
    tx.commit()
}

/// Deletes expired idempotency rows, and ledger rows, session resets and guard states
/// older than the retention. Ledger rows go by id (ids grow with time), in bounded
/// steps, so no index on time is needed and no transaction is large.
fn purge(conn: &mut Connection, now_ms: i64, retention: Duration) -> rusqlite::Result<()> {
    let cutoff = now_ms.saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX));
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let idempotency = tx.execute(
        "DELETE FROM idempotency WHERE expires_ms <= ?1",
        params![now_ms],
    )?;
    let owners = tx.execute(
        "DELETE FROM response_owners WHERE expires_ms <= ?1",
        params![now_ms],
    )?;
    tx.execute(
        "DELETE FROM session_resets WHERE at_ms < ?1",
        params![cutoff],
    )?;
    tx.execute(
        "DELETE FROM guard_states WHERE updated_ms < ?1",
        params![cutoff],
    )?;
    tx.execute("DELETE FROM side_effects WHERE at_ms < ?1", params![cutoff])?;
    tx.commit()?;
    let boundary: Option<i64> = conn
        .query_row(
            "SELECT id FROM ledger WHERE ts_ms >= ?1 ORDER BY id LIMIT 1",
            params![cutoff],
            |r| r.get(0),
        )
        .optional()?;
    let boundary = match boundary {
        Some(id) => id,
        None => conn.query_row("SELECT COALESCE(MAX(id), 0) + 1 FROM ledger", [], |r| {
            r.get(0)
        })?,
    };
    let mut ledger = 0;
    for _ in 0..PURGE_STEPS {
        let n = conn.execute(
            "DELETE FROM ledger WHERE id < MIN(?1, (SELECT MIN(id) FROM ledger) + ?2)",
            params![boundary, PURGE_STEP],
        )?;
        ledger += n;
        if n == 0 {
            break;
        }
    }
    if idempotency + owners + ledger > 0 {
        tracing::info!(idempotency, owners, ledger, "store purged expired rows");
        metrics::counter!("backstop_store_purged_rows_total", "table" => "response_owners")
            .increment(owners as u64);
        metrics::counter!("backstop_store_purged_rows_total", "table" => "idempotency")
            .increment(idempotency as u64);
        metrics::counter!("backstop_store_purged_rows_total", "table" => "ledger")
            .increment(ledger as u64);
    }
    Ok(())
}

/// Truncates the WAL once it has grown past the bound anyway (the writer's own
/// backfills normally keep it far below). The file only shrinks on a truncating
/// checkpoint or a restart trimmed by `journal_size_limit`.
/// While the background connection is running its passive checkpoint, SQLite refuses a
/// second checkpoint at once (without the busy handler): the writer waits for it in
/// short steps, since this is the bound being enforced.
fn bound_wal(conn: &Connection, settings: &Settings, not_before: &mut Option<Instant>) {
    let Some(wal) = &settings.wal else {
        return;
    };
    let Ok(size) = std::fs::metadata(wal).map(|m| m.len()) else {
        return;
    };
    if size <= settings.max_wal_bytes || not_before.is_some_and(|t| Instant::now() < t) {
        return;
    }
    let started = Instant::now();
    loop {
        let outcome = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            r.get::<_, i64>(0)
        });
        let busy = match &outcome {
            Ok(0) => {
                *not_before = None;
                metrics::counter!("backstop_store_wal_truncations_total").increment(1);
                return;
            }
            Ok(_) => true,
            Err(rusqlite::Error::SqliteFailure(e, _)) => {
                matches!(
                    e.code,
                    rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
                )
            }
            Err(_) => false,
        };
        if !busy || started.elapsed() >= TRUNCATE_PATIENCE {
            match outcome {
                Err(err) => {
                    tracing::warn!(error = %err, wal_bytes = size, "WAL truncation failed");
                    metrics::counter!("backstop_store_errors_total", "op" => "checkpoint")
                        .increment(1);
                }
                Ok(_) => tracing::warn!(
                    wal_bytes = size,
                    "WAL truncation blocked by a reader; retrying"
                ),
            }
            *not_before = Some(Instant::now() + TRUNCATE_RETRY);
            return;
        }
        thread::sleep(Duration::from_millis(2));
    }
}

/// While `alive` lives: a passive checkpoint every [`CHECKPOINT_EVERY`].
pub(super) fn spawn_checkpointer(conn: Connection, alive: Weak<()>) {
    thread::Builder::new()
        .name("backstop-checkpoint".into())
        .spawn(move || {
            while alive.upgrade().is_some() {
                thread::sleep(CHECKPOINT_EVERY);
                if let Err(err) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                    tracing::warn!(error = %err, "store checkpoint failed");
                }
            }
        })
        .expect("spawn store checkpointer");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ReservationRecord;

    fn reserve(id: i64) -> Write {
        Write {
            op: Op::Reserve(ReservationRecord {
                id,
                ts_ms: 1,
                day: 1,
                tenant: "t".into(),
                session: Some("s".into()),
                model: "m".into(),
                calls: 1,
                tokens: 10,
                usd: 0.5,
            }),
            ack: None,
        }
    }

    fn reserved(conn: &Connection) -> Vec<i64> {
        let mut ids = conn
            .prepare("SELECT id FROM reservations ORDER BY id")
            .unwrap();
        let ids = ids.query_map([], |r| r.get(0)).unwrap();
        ids.map(Result::unwrap).collect()
    }

    /// The writer's backfill pass pauses every commit for a sync of the WAL and the
    /// database file, so it runs by the WAL's size, not by the clock: commits spread
    /// over more than the 100 ms that used to trigger it pay none, and sustained
    /// commits pay one per quarter of `max_wal_bytes` of WAL, which keeps restarting.
    #[test]
    fn the_writer_backfills_by_wal_size_not_by_the_clock() {
        let dir = std::env::temp_dir().join(format!(
            "backstop-backfill-{}-{:?}",
            std::process::id(),
            thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.db");
        let wal = dir.join("w.db-wal");
        let conn = super::super::open_conn(path.to_str().unwrap(), Duration::from_secs(1)).unwrap();
        conn.execute_batch(super::super::SCHEMA).unwrap();
        let max_wal_bytes = 256 * 1024;
        let backfills = Arc::new(AtomicU64::new(0));
        let settings = Settings {
            wal: Some(wal.clone()),
            max_wal_bytes,
            retention: Duration::from_secs(86_400),
            backfills: backfills.clone(),
        };
        let (tx, rx) = mpsc::channel();
        let writer = thread::spawn(move || write_loop(conn, rx, settings));
        let write = |id: i64| {
            let (ack, done) = tokio::sync::oneshot::channel();
            tx.send(Write {
                ack: Some(ack),
                ..reserve(id)
            })
            .unwrap();
            done.blocking_recv().unwrap().unwrap();
        };

        for id in 0..6 {
            write(id);
            thread::sleep(Duration::from_millis(30));
        }
        assert_eq!(
            backfills.load(Ordering::Relaxed),
            0,
            "a light load paid a pass"
        );

        let mut largest = 0;
        for id in 6..3006 {
            write(id);
            largest = largest.max(std::fs::metadata(&wal).unwrap().len());
        }
        // 3,000 commits of a few 1 KB pages each, a pass per 64 KB of WAL.
        let passes = backfills.load(Ordering::Relaxed);
        assert!((20..=3000).contains(&passes), "{passes} passes");
        // The WAL restarted after each: never near the truncation bound.
        assert!(
            largest <= max_wal_bytes / 4 + 16 * 1024,
            "the WAL reached {largest} bytes"
        );
        drop(tx);
        writer.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A batch that fails part-way leaves nothing of itself (its cached `BEGIN` is
    /// rolled back, not left open), and the next batch commits.
    #[test]
    fn a_failed_batch_is_rolled_back_whole_and_the_next_commits() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(super::super::SCHEMA).unwrap();
        commit(&mut conn, &[reserve(1)]).unwrap();
        // The second write of this batch breaks the primary key.
        let err = commit(&mut conn, &[reserve(2), reserve(1)]).unwrap_err();
        assert!(err.to_string().contains("UNIQUE"), "{err}");
        assert!(
            conn.is_autocommit(),
            "the failed batch's transaction is still open"
        );
        assert_eq!(reserved(&conn), [1]);
        commit(&mut conn, &[reserve(3), reserve(4)]).unwrap();
        assert_eq!(reserved(&conn), [1, 3, 4]);
    }
}
