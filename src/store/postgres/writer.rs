//! The PostgreSQL writer: one task that commits whatever has queued up in one
//! transaction (group commit, as the SQLite writer does), its statements pipelined on
//! one connection, and acknowledges each write once it is committed.
//!
//! When Postgres cannot be reached (or does not answer within `store.statement_timeout`)
//! every write of the batch fails with [`StoreError::Unavailable`]. The writes among them
//! that must land however long Postgres is away ([`Kept`]: charges for calls already
//! made, reservations and their withdrawals, settles kept for Redis) go to the spool
//! ([`Spool`], fsynced) before they are answered, and are replayed oldest first when
//! Postgres answers again, before any newer write (so a reservation is in before its
//! settle), with a backoff between attempts; their ids make a replay exactly once
//! (`ON CONFLICT (id) DO NOTHING`), even when the failed commit did in fact land. If the
//! spool itself cannot take them (a full disk), they are kept in memory instead
//! (`backstop_store_kept_writes`), lost if the process dies.
//!
//! A batch refused by Postgres itself (an SQL error) is retried one write at a time, so
//! one bad write fails alone.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use deadpool_postgres::Pool;
use futures_util::future::{try_join_all, BoxFuture};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::ToSql;

use super::{
    epoch_of,
    spool::{Kept, Spool},
    Failure,
};
use crate::store::{sqlite::to_sql, write::Op, StoreError};

/// Writes committed in one transaction at most.
const MAX_BATCH: usize = 4096;
/// How soon kept writes are retried first, and at most.
pub(super) const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

pub(super) struct PgWrite {
    pub(super) op: Op,
    pub(super) ack: Option<oneshot::Sender<Result<(), StoreError>>>,
}

/// The writes waiting for Postgres: the spool's, then (only when the spool could not
/// take them) those kept in memory.
pub(super) struct Backlog {
    pub(super) spool: Spool,
    memory: VecDeque<Kept>,
    /// What the settles found of their rows.
    pub(super) tally: Arc<Tally>,
}

/// Settles that found their ledger row already written: by the recovery of a replica
/// taken for dead (`corrected` to the settle's true charge, once), or by an earlier
/// write of the same settle (`discarded`: a replay after a lost acknowledgement).
#[derive(Debug, Default)]
pub struct Tally {
    pub corrected: AtomicU64,
    pub discarded: AtomicU64,
}

impl Backlog {
    pub(super) fn new(spool: Spool) -> Backlog {
        Backlog {
            tally: Arc::default(),
            spool,
            memory: VecDeque::new(),
        }
    }

    fn is_empty(&self) -> bool {
        self.spool.len() == 0 && self.memory.is_empty()
    }

    /// Keeps `writes` behind the others: in the spool, or in memory if it cannot take
    /// them. Where they went, said for their callers.
    async fn keep(&mut self, writes: Vec<Kept>) -> String {
        if writes.is_empty() {
            return String::new();
        }
        match self.spool.keep(&writes).await {
            Ok(()) => {
                tracing::warn!(
                    writes = writes.len(),
                    spooled = self.spool.len(),
                    spool = self.spool.path(),
                    "postgres is unavailable: writes kept in the spool until it answers"
                );
                format!("kept in the spool ({})", self.spool.path())
            }
            Err(err) => {
                tracing::error!(
                    error = %err,
                    writes = writes.len(),
                    "the spool cannot take writes postgres could not: kept in memory only, lost if this process dies"
                );
                self.memory.extend(writes);
                metrics::gauge!("backstop_store_kept_writes").set(self.memory.len() as f64);
                "kept in memory (the spool could not take it)".into()
            }
        }
    }
}

/// What woke the writer.
enum Wake {
    Write(PgWrite),
    /// Every sender is gone.
    Closed,
    /// Time to try the backlog again.
    Retry,
}

/// Commits the writes of `rx` until every sender is gone and nothing is kept; kept
/// writes are retried `first_retry` after they were kept, then backing off (doubling,
/// up to [`RETRY_MAX`]) while Postgres stays away.
pub(super) async fn write_loop(
    pool: Pool,
    mut backlog: Backlog,
    mut rx: mpsc::UnboundedReceiver<PgWrite>,
    first_retry: Duration,
) {
    let mut retry = first_retry;
    let mut open = true;
    loop {
        let waiting = !backlog.is_empty();
        if !open && !waiting {
            return;
        }
        let wake = if waiting {
            tokio::select! {
                w = rx.recv(), if open => w.map_or(Wake::Closed, Wake::Write),
                () = tokio::time::sleep(retry) => Wake::Retry,
            }
        } else {
            rx.recv().await.map_or(Wake::Closed, Wake::Write)
        };
        let mut batch = match wake {
            Wake::Closed => {
                open = false;
                continue;
            }
            Wake::Write(w) => vec![w],
            Wake::Retry => Vec::new(),
        };
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        // Nothing newer goes in ahead of what is kept.
        let outage = match waiting {
            true => replay(&pool, &mut backlog).await.err(),
            false => None,
        };
        match &outage {
            None if batch.is_empty() => {}
            None => {
                let ops: Vec<&Op> = batch.iter().map(|w| &w.op).collect();
                let results = commit_each(&pool, &ops, &backlog.tally).await;
                answer(batch, results, &mut backlog).await;
            }
            Some(failure) => {
                let results = vec![Err(failure.clone()); batch.len()];
                answer(batch, results, &mut backlog).await;
            }
        }
        retry = match (outage, backlog.is_empty()) {
            (_, true) => first_retry,
            (Some(_), false) => (retry * 2).min(RETRY_MAX),
            (None, false) => retry,
        };
    }
}

/// Commits what the backlog holds, oldest first and in batches, forgetting each batch
/// once Postgres has it. A write Postgres refuses (an SQL error) is logged and dropped:
/// it would be refused again. Stops at the first outage; how many writes it replayed.
pub(super) async fn replay(pool: &Pool, backlog: &mut Backlog) -> Result<u64, Failure> {
    let mut replayed = 0;
    loop {
        let rows = backlog
            .spool
            .oldest(MAX_BATCH)
            .await
            .map_err(spool_failure)?;
        // Those kept in memory are newer than the whole spool.
        let with_memory = rows.len() < MAX_BATCH;
        let mut kept: Vec<&Kept> = rows.iter().map(|(_, k)| k).collect();
        if with_memory {
            kept.extend(backlog.memory.iter());
        }
        if kept.is_empty() {
            return Ok(replayed);
        }
        let ops: Vec<Op> = kept.iter().map(|k| k.to_op()).collect();
        let refs: Vec<&Op> = ops.iter().collect();
        let tally = backlog.tally.clone();
        for (op, result) in ops.iter().zip(commit_each(pool, &refs, &tally).await) {
            match result {
                Ok(()) => {}
                Err(failure) if failure.transient => return Err(failure),
                Err(failure) => {
                    metrics::counter!("backstop_store_errors_total", "op" => op.label())
                        .increment(1);
                    tracing::error!(error = %failure.message, op = ?DebugOp(op), "a kept write was refused by postgres and is dropped");
                }
            }
        }
        replayed += ops.len() as u64;
        if let Some((last, _)) = rows.last() {
            backlog.spool.forget(*last).await.map_err(spool_failure)?;
        }
        if with_memory {
            backlog.memory.clear();
            metrics::gauge!("backstop_store_kept_writes").set(0.0);
            tracing::info!(
                writes = replayed,
                "postgres answers: the writes kept while it was away are in"
            );
            return Ok(replayed);
        }
    }
}

/// A spool that cannot be read or written holds up the writes behind it, as an outage
/// of Postgres would.
fn spool_failure(err: StoreError) -> Failure {
    tracing::error!(error = %err, "the spool failed");
    Failure {
        transient: true,
        message: err.to_string().into(),
    }
}

/// Commits `ops` in one transaction; if Postgres refuses it (an SQL error, not an
/// outage), one at a time, so that one bad write fails alone. Each write's result.
async fn commit_each(pool: &Pool, ops: &[&Op], tally: &Tally) -> Vec<Result<(), Failure>> {
    let result = commit(pool, ops, tally).await;
    metrics::counter!("backstop_store_commits_total").increment(1);
    match result {
        Ok(()) => vec![Ok(()); ops.len()],
        Err(failure) if failure.transient || ops.len() == 1 => vec![Err(failure); ops.len()],
        Err(failure) => {
            tracing::warn!(error = %failure.message, writes = ops.len(), "store batch refused; writing it one by one");
            let mut results = Vec::with_capacity(ops.len());
            for op in ops {
                results.push(commit(pool, &[op], tally).await);
            }
            results
        }
    }
}

/// Acknowledges each write of `batch` with its result. A write that must land and
/// failed for want of Postgres is kept ([`Backlog::keep`]) first, then answered
/// `Unavailable` saying where it is kept.
async fn answer(batch: Vec<PgWrite>, results: Vec<Result<(), Failure>>, backlog: &mut Backlog) {
    let mut kept = Vec::new();
    let mut to_answer = Vec::new();
    let mut failed = 0;
    let mut first_failure = None;
    for (w, result) in batch.into_iter().zip(results) {
        let failure = match result {
            Ok(()) => {
                if let Some(ack) = w.ack {
                    let _ = ack.send(Ok(()));
                }
                continue;
            }
            Err(failure) => failure,
        };
        failed += 1;
        metrics::counter!("backstop_store_errors_total", "op" => w.op.label()).increment(1);
        if !failure.transient && matches!(w.op, Op::Settle { .. }) {
            // Refused by Postgres itself: retrying would be refused again.
            tracing::error!(op = ?DebugOp(&w.op), "a charge was refused by postgres and is not in the ledger");
        }
        let keep = match failure.transient {
            true => Kept::of(w.op),
            false => None,
        };
        match keep {
            Some(k) => {
                kept.push(k);
                to_answer.push((w.ack, failure.message.clone()));
            }
            None => {
                let error = match failure.transient {
                    true => StoreError::Unavailable(failure.message.clone()),
                    false => StoreError::Write(failure.message.clone()),
                };
                if let Some(ack) = w.ack {
                    let _ = ack.send(Err(error));
                }
            }
        }
        first_failure.get_or_insert(failure);
    }
    if let Some(failure) = first_failure {
        tracing::error!(error = %failure.message, writes = failed, transient = failure.transient, "store write failed");
    }
    let place = backlog.keep(kept).await;
    for (ack, message) in to_answer {
        if let Some(ack) = ack {
            let _ = ack.send(Err(StoreError::Unavailable(
                format!("{message}; {place} and written when postgres answers").into(),
            )));
        }
    }
}

struct DebugOp<'a>(&'a Op);

impl std::fmt::Debug for DebugOp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Op::Settle {
                reservation,
                charge,
            } => write!(f, "settle {reservation:?} {charge:?}"),
            other => f.write_str(other.label()),
        }
    }
}

type Param = Box<dyn ToSql + Sync + Send>;

const RESERVE: &str =
    "INSERT INTO reservations (id, epoch, ts_ms, day, tenant, session, model, calls, tokens, usd)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (id) DO NOTHING";
/// A settle whose row the recovery of its replica wrote first (at the reservation, the
/// replica taken for dead): the true charge replaces it, once (the mark goes with it).
const CORRECT: &str =
    "UPDATE ledger SET ts_ms = $2, day = $3, tenant = $4, session = $5, model = $6,
         calls = $7, input_tokens = $8, output_tokens = $9, usd = $10, cache_write_tokens = $11,
         cache_write_1h_tokens = $12, cache_read_tokens = $13, reasoning_tokens = $14,
         web_searches = $15, recovered = false
     WHERE id = $1 AND recovered";
/// Deletes the reservation and appends its charge in one statement: once per id.
const SETTLE: &str = "WITH gone AS (DELETE FROM reservations WHERE id = $1)
     INSERT INTO ledger (id, ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd,
         cache_write_tokens, cache_write_1h_tokens, cache_read_tokens, reasoning_tokens, web_searches)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) ON CONFLICT (id) DO NOTHING";
const UNRESERVE: &str = "DELETE FROM reservations WHERE id = $1";
const RESET_SESSION: &str =
    "INSERT INTO session_resets (tenant, session, at_ms) VALUES ($1, $2, $3)
     ON CONFLICT (tenant, session) DO UPDATE SET at_ms = EXCLUDED.at_ms";
const REMEMBER: &str = "INSERT INTO idempotency (tenant, key, body_hash, status, content_type, body, expires_ms)
     VALUES ($1, $2, $3, $4, $5, $6, $7)
     ON CONFLICT (tenant, key) DO UPDATE SET body_hash = EXCLUDED.body_hash, status = EXCLUDED.status,
         content_type = EXCLUDED.content_type, body = EXCLUDED.body, expires_ms = EXCLUDED.expires_ms";
const QUEUE_SETTLE: &str =
    "INSERT INTO shared_settles (reservation, body, queued_ms) VALUES ($1, $2, $3)
     ON CONFLICT (reservation) DO UPDATE SET body = EXCLUDED.body, queued_ms = EXCLUDED.queued_ms";
const UNQUEUE_SETTLE: &str = "DELETE FROM shared_settles WHERE reservation = $1";
const RECORD_OWNER: &str =
    "INSERT INTO response_owners (id, tenant, expires_ms, context_tokens) VALUES ($1, $2, $3, $4)
     ON CONFLICT (id) DO UPDATE SET tenant = EXCLUDED.tenant, expires_ms = EXCLUDED.expires_ms,
         context_tokens = COALESCE(EXCLUDED.context_tokens, response_owners.context_tokens)";
const SAVE_GUARD: &str = "INSERT INTO guard_states (tenant, session, closed, until_ms, code, rule, evidence, updated_ms)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
     ON CONFLICT (tenant, session) DO UPDATE SET closed = EXCLUDED.closed, until_ms = EXCLUDED.until_ms,
         code = EXCLUDED.code, rule = EXCLUDED.rule, evidence = EXCLUDED.evidence, updated_ms = EXCLUDED.updated_ms";
const CLEAR_GUARD: &str = "DELETE FROM guard_states WHERE tenant = $1 AND session = $2";
const JOURNAL: &str = "INSERT INTO side_effects (tenant, session, call_id, at_ms, proposed, entry)
     VALUES ($1, $2, $3, $4, $5, $6)
     ON CONFLICT (tenant, session, call_id) DO UPDATE SET at_ms = EXCLUDED.at_ms,
         proposed = EXCLUDED.proposed, entry = EXCLUDED.entry";
const TRIM_JOURNAL: &str =
    "DELETE FROM side_effects WHERE tenant = $1 AND session = $2 AND call_id NOT IN
     (SELECT call_id FROM side_effects WHERE tenant = $1 AND session = $2
      ORDER BY proposed, at_ms DESC, call_id DESC LIMIT $3)";

/// The statements and parameters of one write (owners: one per owner).
fn statements(op: &Op) -> Vec<(&'static str, Vec<Param>)> {
    match op {
        Op::Reserve(r) => vec![(
            RESERVE,
            vec![
                Box::new(r.id),
                Box::new(epoch_of(r.id)),
                Box::new(r.ts_ms),
                Box::new(r.day),
                Box::new(r.tenant.clone()),
                Box::new(r.session.clone()),
                Box::new(r.model.clone()),
                Box::new(to_sql(r.calls)),
                Box::new(to_sql(r.tokens)),
                Box::new(r.usd),
            ],
        )],
        Op::Settle {
            reservation,
            charge: c,
        } => {
            // `PgStore::settle` names every charge (see there): a nameless one here
            // would be a bug, said loudly rather than written without its key.
            let Some(id) = reservation else {
                tracing::error!(charge = ?c, "a charge reached the postgres writer without an id; not written");
                metrics::counter!("backstop_store_errors_total", "op" => "settle").increment(1);
                return Vec::new();
            };
            let params = || -> Vec<Param> {
                vec![
                    Box::new(*id),
                    Box::new(c.ts_ms),
                    Box::new(c.day),
                    Box::new(c.tenant.clone()),
                    Box::new(c.session.clone()),
                    Box::new(c.model.clone()),
                    Box::new(to_sql(c.calls)),
                    Box::new(to_sql(c.tokens.input)),
                    Box::new(to_sql(c.tokens.output)),
                    Box::new(c.usd),
                    Box::new(to_sql(c.tokens.cache_write())),
                    Box::new(to_sql(c.tokens.cache_write_1h)),
                    Box::new(to_sql(c.tokens.cache_read)),
                    Box::new(to_sql(c.tokens.reasoning)),
                    Box::new(to_sql(c.tokens.web_searches)),
                ]
            };
            // The correction first: a row it corrects is then not inserted again.
            vec![(CORRECT, params()), (SETTLE, params())]
        }
        Op::ResetSession {
            tenant,
            session,
            at_ms,
        } => vec![(
            RESET_SESSION,
            vec![
                Box::new(tenant.clone()),
                Box::new(session.clone()),
                Box::new(*at_ms),
            ],
        )],
        Op::Remember(r) => vec![(
            REMEMBER,
            vec![
                Box::new(r.tenant.clone()),
                Box::new(r.key.clone()),
                Box::new(r.body_hash.clone()),
                Box::new(i32::from(r.status)),
                Box::new(r.content_type.clone()),
                Box::new(r.body.clone()),
                Box::new(r.expires_ms),
            ],
        )],
        Op::QueueSettle(q) => vec![(
            QUEUE_SETTLE,
            vec![
                Box::new(q.reservation.clone()),
                Box::new(q.body.clone()),
                Box::new(q.queued_ms),
            ],
        )],
        Op::UnqueueSettle(reservation) => {
            vec![(UNQUEUE_SETTLE, vec![Box::new(reservation.clone())])]
        }
        Op::RecordOwners(owners) => owners
            .iter()
            .map(|o| {
                let params: Vec<Param> = vec![
                    Box::new(o.id.clone()),
                    Box::new(o.tenant.clone()),
                    Box::new(o.expires_ms),
                    Box::new(o.context_tokens.map(to_sql)),
                ];
                (RECORD_OWNER, params)
            })
            .collect(),
        Op::SaveGuard(g) => vec![(
            SAVE_GUARD,
            vec![
                Box::new(g.tenant.clone()),
                Box::new(g.session.clone()),
                Box::new(g.closed),
                Box::new(g.until_ms),
                Box::new(g.code.clone()),
                Box::new(g.rule.clone()),
                Box::new(g.evidence.clone()),
                Box::new(g.updated_ms),
            ],
        )],
        Op::ClearGuard { tenant, session } => vec![(
            CLEAR_GUARD,
            vec![Box::new(tenant.clone()), Box::new(session.clone())],
        )],
        Op::Unreserve(id) => vec![(UNRESERVE, vec![Box::new(*id)])],
        Op::Journal {
            tenant,
            session,
            records,
            max_entries,
        } => {
            let mut work: Vec<(&'static str, Vec<Param>)> = records
                .iter()
                .map(|r| {
                    let params: Vec<Param> = vec![
                        Box::new(tenant.clone()),
                        Box::new(session.clone()),
                        Box::new(r.call_id.clone()),
                        Box::new(r.at_ms),
                        Box::new(r.proposed),
                        Box::new(r.entry.clone()),
                    ];
                    (JOURNAL, params)
                })
                .collect();
            work.push((
                TRIM_JOURNAL,
                vec![
                    Box::new(tenant.clone()),
                    Box::new(session.clone()),
                    Box::new(to_sql(*max_entries as u64)),
                ],
            ));
            work
        }
        // Purges run beside the writer (`PgStore::purge`).
        Op::Purge { .. } => Vec::new(),
    }
}

/// One transaction for `ops`, every statement sent at once (pipelined) and in order.
async fn commit(pool: &Pool, ops: &[&Op], tally: &Tally) -> Result<(), Failure> {
    let mut client = pool.get().await.map_err(Failure::pool)?;
    let tx = client.transaction().await.map_err(Failure::from)?;
    let work: Vec<(&'static str, Vec<Param>)> = ops.iter().flat_map(|op| statements(op)).collect();
    let mut prepared = std::collections::HashMap::new();
    for (sql, _) in &work {
        if !prepared.contains_key(sql) {
            prepared.insert(*sql, tx.prepare_cached(sql).await.map_err(Failure::from)?);
        }
    }
    let refs: Vec<Vec<&(dyn ToSql + Sync)>> = work
        .iter()
        .map(|(_, params)| {
            params
                .iter()
                .map(|p| p.as_ref() as &(dyn ToSql + Sync))
                .collect()
        })
        .collect();
    let runs: Vec<BoxFuture<'_, Result<u64, tokio_postgres::Error>>> = work
        .iter()
        .zip(&refs)
        .map(|((sql, _), params)| {
            let statement = &prepared[sql];
            Box::pin(tx.execute(statement, params)) as BoxFuture<'_, _>
        })
        .collect();
    let counts = try_join_all(runs).await.map_err(Failure::from)?;
    tx.commit().await.map_err(Failure::from)?;
    let settled = work.iter().zip(&counts).map(|((sql, _), n)| (*sql, *n));
    let mut corrected = false;
    let mut settles = ops.iter().filter(|op| matches!(op, Op::Settle { .. }));
    for (sql, n) in settled {
        match sql {
            CORRECT => corrected = n > 0,
            SETTLE => {
                let op = settles.next();
                let outcome = match (corrected, n) {
                    (true, _) => "corrected",
                    (false, 0) => "discarded",
                    (false, _) => continue,
                };
                reckon(tally, outcome, op.copied());
            }
            _ => {}
        }
    }
    Ok(())
}

/// Counts and logs a settle that found its row written.
fn reckon(tally: &Tally, outcome: &'static str, op: Option<&Op>) {
    let (id, charge) = match op {
        Some(Op::Settle {
            reservation,
            charge,
        }) => (*reservation, Some(charge)),
        _ => (None, None),
    };
    metrics::counter!("backstop_ledger_corrections_total", "outcome" => outcome, "books" => "postgres").increment(1);
    let (tenant, usd) = (charge.map(|c| c.tenant.as_str()), charge.map(|c| c.usd));
    if outcome == "corrected" {
        tally.corrected.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            reservation = id,
            tenant,
            usd,
            "this replica was declared dead by a peer (cut off from postgres for longer than store.replica_lease): its reservation had been charged at its reserved amount; corrected to the call's true charge"
        );
    } else {
        tally.discarded.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            reservation = id,
            tenant,
            usd,
            "a settle found its ledger row already written by itself (a replay after a lost acknowledgement); discarded"
        );
    }
}

impl Failure {
    fn pool(err: deadpool_postgres::PoolError) -> Failure {
        Failure {
            transient: true,
            message: Arc::from(format!(
                "postgres is unavailable: {}",
                super::describe(&err)
            )),
        }
    }
}
