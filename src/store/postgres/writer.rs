//! The PostgreSQL writer: one task that commits whatever has queued up in one
//! transaction (group commit, as the SQLite writer does), its statements pipelined on
//! one connection, and acknowledges each write once it is committed.
//!
//! When Postgres cannot be reached (or does not answer within `store.statement_timeout`)
//! every write of the batch fails with [`StoreError::Unavailable`]; the charges among them
//! (ledger settles, and settles kept for Redis) are for calls already made, so they are
//! also kept here, in memory, and retried with a backoff until Postgres takes them: their
//! ids make the retry exactly once (`ON CONFLICT (id) DO NOTHING`), even when the failed
//! commit did in fact land. They are in memory only: a replica killed while Postgres is
//! down loses them, and its durable reservations are then charged at their reserved
//! amount by the replica that finds it dead. `backstop_store_kept_writes` counts them.
//!
//! A batch refused by Postgres itself (an SQL error) is retried one write at a time, so
//! one bad write fails alone.

use std::{collections::VecDeque, sync::Arc, time::Duration};

use deadpool_postgres::Pool;
use futures_util::future::{try_join_all, BoxFuture};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::ToSql;

use super::{epoch_of, Failure};
use crate::store::{sqlite::to_sql, write::Op, StoreError};

/// Writes committed in one transaction at most.
const MAX_BATCH: usize = 4096;
/// How soon kept charges are retried first, and at most.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

pub(super) struct PgWrite {
    pub(super) op: Op,
    pub(super) ack: Option<oneshot::Sender<Result<(), StoreError>>>,
}

/// Whether a write must land however long Postgres is away: a charge for a call
/// already made, or the withdrawal of a refused call's reservation. Kept and retried.
fn is_charge(op: &Op) -> bool {
    matches!(
        op,
        Op::Settle { .. } | Op::QueueSettle(_) | Op::Unreserve(_)
    )
}

pub(super) async fn write_loop(pool: Pool, mut rx: mpsc::UnboundedReceiver<PgWrite>) {
    let mut kept: VecDeque<Op> = VecDeque::new();
    let mut retry = RETRY_FIRST;
    let mut open = true;
    while open || !kept.is_empty() {
        let first = if kept.is_empty() {
            rx.recv().await
        } else {
            tokio::select! {
                w = rx.recv(), if open => w,
                () = tokio::time::sleep(retry) => None,
            }
        };
        if first.is_none() && kept.is_empty() {
            open = false;
            continue;
        }
        // Kept charges go first: they are the oldest.
        let mut batch: Vec<PgWrite> = kept.drain(..).map(|op| PgWrite { op, ack: None }).collect();
        let retrying = !batch.is_empty();
        batch.extend(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(w) => batch.push(w),
                Err(_) => break,
            }
        }
        let done = commit_batch(&pool, batch, &mut kept).await;
        metrics::gauge!("backstop_store_kept_writes").set(kept.len() as f64);
        if done && retrying {
            tracing::info!("postgres is back: the charges kept in memory are in the ledger");
        }
        retry = if kept.is_empty() {
            RETRY_FIRST
        } else {
            (retry * 2).min(RETRY_MAX)
        };
    }
}

/// Commits `batch`, acknowledging each write; a charge that could not be written for
/// want of Postgres goes to `kept`. Whether the batch's first commit went through.
async fn commit_batch(pool: &Pool, batch: Vec<PgWrite>, kept: &mut VecDeque<Op>) -> bool {
    let ops: Vec<&Op> = batch.iter().map(|w| &w.op).collect();
    let result = commit(pool, &ops).await;
    metrics::counter!("backstop_store_commits_total").increment(1);
    match result {
        Ok(()) => {
            for w in batch {
                if let Some(ack) = w.ack {
                    let _ = ack.send(Ok(()));
                }
            }
            true
        }
        Err(failure) if failure.transient || batch.len() == 1 => {
            fail(batch, &failure, kept);
            false
        }
        Err(failure) => {
            tracing::warn!(error = %failure.message, writes = batch.len(), "store batch refused; writing it one by one");
            for w in batch {
                let result = commit(pool, &[&w.op]).await;
                match result {
                    Ok(()) => {
                        if let Some(ack) = w.ack {
                            let _ = ack.send(Ok(()));
                        }
                    }
                    Err(failure) => fail(vec![w], &failure, kept),
                }
            }
            false
        }
    }
}

fn fail(batch: Vec<PgWrite>, failure: &Failure, kept: &mut VecDeque<Op>) {
    tracing::error!(error = %failure.message, writes = batch.len(), transient = failure.transient, "store write failed");
    for w in batch {
        metrics::counter!("backstop_store_errors_total", "op" => w.op.label()).increment(1);
        let error = if failure.transient && is_charge(&w.op) {
            StoreError::Unavailable(
                format!(
                    "{}; the charge is kept in memory and written when postgres answers",
                    failure.message
                )
                .into(),
            )
        } else if failure.transient {
            StoreError::Unavailable(failure.message.clone())
        } else {
            StoreError::Write(failure.message.clone())
        };
        if let Some(ack) = w.ack {
            let _ = ack.send(Err(error));
        }
        if failure.transient && is_charge(&w.op) {
            kept.push_back(w.op);
        } else if matches!(w.op, Op::Settle { .. }) {
            // Refused by Postgres itself: retrying would be refused again.
            tracing::error!(op = ?DebugOp(&w.op), "a charge was refused by postgres and is not in the ledger");
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
/// Deletes the reservation and appends its charge in one statement: once per id.
const SETTLE: &str = "WITH gone AS (DELETE FROM reservations WHERE id = $1)
     INSERT INTO ledger (id, ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (id) DO NOTHING";
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
            vec![(
                SETTLE,
                vec![
                    Box::new(*id),
                    Box::new(c.ts_ms),
                    Box::new(c.day),
                    Box::new(c.tenant.clone()),
                    Box::new(c.session.clone()),
                    Box::new(c.model.clone()),
                    Box::new(to_sql(c.calls)),
                    Box::new(to_sql(c.input_tokens)),
                    Box::new(to_sql(c.output_tokens)),
                    Box::new(c.usd),
                ],
            )]
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
        // Purges run beside the writer (`PgStore::purge`).
        Op::Purge { .. } => Vec::new(),
    }
}

/// One transaction for `ops`, every statement sent at once (pipelined) and in order.
async fn commit(pool: &Pool, ops: &[&Op]) -> Result<(), Failure> {
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
    try_join_all(runs).await.map_err(Failure::from)?;
    tx.commit().await.map_err(Failure::from)
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
