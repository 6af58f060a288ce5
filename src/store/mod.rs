//! Persistence, one trait per role, gathered in [`Store`]: the spend ledger (one row per
//! charged upstream call) and the reservations of budgeted calls still in flight
//! ([`Ledger`]), settles the shared state could not take ([`SettleQueue`]), responses
//! kept for idempotent replays ([`Replays`]), which tenant created each stored response
//! of the Responses API ([`Owners`]), and the session guard's closes and trips
//! ([`GuardStates`]). Budget windows are sums over the ledger, so nothing is kept twice
//! and a restart rebuilds every window from what was settled; so are spend reports
//! ([`Ledger::spend_report`], read by `backstop report` through [`open_ledger_reader`]
//! and by the admin tenant view). The live state
//! ([`crate::state`]) and the layers hold an `Arc<dyn Store>`; [`SqliteStore`] is the
//! embedded implementation, [`PgStore`] one PostgreSQL database for every replica, and
//! `RedisStore` shares the replays, owners and guard state between replicas over either.
//!
//! The contract every implementation keeps:
//! - a write that returns `Ok` is durable (survives the process being killed); a write
//!   that fails is a typed [`StoreError`] for its caller and a
//!   `backstop_store_errors_total{op}` count, never acknowledged as a success;
//! - a budgeted call's reservation is committed before its upstream call, and settling
//!   it deletes the reservation and appends the ledger row atomically; reservations left
//!   over by a crash are charged at their reserved amount when the store opens, so caps
//!   hold across `kill -9`;
//! - no call blocks the async worker threads;
//! - a spend report is one `GROUP BY tenant, day, model` over settled ledger rows, in
//!   that order, served by an index on `(tenant, day, model)`;
//! - expired idempotency rows and owners, and rows older than `store.retention` go when
//!   [`Store::purge`] runs, which [`spawn_purger`] does every [`PURGE_EVERY`].

pub(crate) mod connection;
pub mod format;
mod postgres;
mod redis;
mod sqlite;
mod write;

use std::{sync::Arc, time::Duration};

use futures_util::future::BoxFuture;

pub use postgres::{read_report as read_postgres_report, PgStore, MIGRATION_LOCK, SCHEMA_VERSION};
pub use redis::RedisStore;
/// The store's Redis scripts, for the list of every script ([`crate::state::redis`]).
pub mod redis_scripts {
    pub use super::redis::{READ_WINDOW, RELEASE_CLAIM, SAVE_WINDOW};
}
pub use sqlite::SqliteStore;

use crate::{billing::Tokens, clock::Clock, config::StoreConfig, policy::budget::Usage};

/// One charged upstream call.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(from = "ChargeRecord", into = "ChargeRecord")]
pub struct Charge {
    pub ts_ms: i64,
    /// Days since the Unix epoch (UTC), the tenant budget window.
    pub day: i64,
    pub tenant: String,
    pub session: Option<String>,
    pub model: String,
    pub calls: u64,
    /// Every billed kind, as the target reported it (a reservation charged whole: its
    /// tokens as input).
    pub tokens: Tokens,
    pub usd: f64,
}

/// A charge as it is kept in a spool or a queue: flat, its token kinds under the ledger's
/// column names, the ones beyond input and output written only when set. A reader of an
/// older build reads such a record as input and output (its dollars intact).
#[derive(serde::Serialize, serde::Deserialize)]
struct ChargeRecord {
    ts_ms: i64,
    day: i64,
    tenant: String,
    session: Option<String>,
    model: String,
    calls: u64,
    input_tokens: u64,
    output_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    cache_write_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    cache_write_1h_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    cache_read_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    reasoning_tokens: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    web_searches: u64,
    usd: f64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl From<ChargeRecord> for Charge {
    fn from(r: ChargeRecord) -> Charge {
        let hour = r.cache_write_1h_tokens.min(r.cache_write_tokens);
        Charge {
            ts_ms: r.ts_ms,
            day: r.day,
            tenant: r.tenant,
            session: r.session,
            model: r.model,
            calls: r.calls,
            tokens: Tokens {
                input: r.input_tokens,
                cache_write_5m: r.cache_write_tokens - hour,
                cache_write_1h: hour,
                cache_read: r.cache_read_tokens,
                output: r.output_tokens,
                reasoning: r.reasoning_tokens,
                web_searches: r.web_searches,
            },
            usd: r.usd,
        }
    }
}

impl From<Charge> for ChargeRecord {
    fn from(c: Charge) -> ChargeRecord {
        ChargeRecord {
            ts_ms: c.ts_ms,
            day: c.day,
            tenant: c.tenant,
            session: c.session,
            model: c.model,
            calls: c.calls,
            input_tokens: c.tokens.input,
            output_tokens: c.tokens.output,
            cache_write_tokens: c.tokens.cache_write(),
            cache_write_1h_tokens: c.tokens.cache_write_1h,
            cache_read_tokens: c.tokens.cache_read,
            reasoning_tokens: c.tokens.reasoning,
            web_searches: c.tokens.web_searches,
            usd: c.usd,
        }
    }
}

/// Which ledger rows [`Ledger::spend_report`] sums: one tenant or all, and a range of
/// UTC days (days since the Unix epoch), both ends inclusive and either open.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReportQuery {
    pub tenant: Option<String>,
    pub from_day: Option<i64>,
    pub to_day: Option<i64>,
}

/// One tenant's spend on one UTC day with one model: the sums of its ledger rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportRow {
    pub tenant: String,
    /// Days since the Unix epoch (UTC).
    pub day: i64,
    pub model: String,
    pub calls: u64,
    /// Each kind summed.
    pub tokens: Tokens,
    pub usd: f64,
}

impl ReportRow {
    /// The row as the budgets count it (every kind of token together).
    pub fn usage(&self) -> Usage {
        Usage {
            calls: self.calls,
            tokens: self.tokens.total(),
            usd: self.usd,
        }
    }
}

/// A budgeted call's reservation, durable while the call is in flight. The id is
/// assigned by [`Store::next_reservation_id`] before the write is queued, so a settle
/// can name it even while the reservation's own write is still queued (the writer
/// applies writes in order).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// A settle the shared state (Redis) could not take when its call ended, kept in the
/// replica's own store until it can: `body` is the encoded settle
/// ([`crate::state::shared::SharedSettle`]), replayed idempotently per reservation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QueuedSettle {
    pub reservation: String,
    pub body: String,
    pub queued_ms: i64,
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

/// Who makes the call for an idempotency key.
#[derive(Debug, Clone)]
pub enum Claim {
    /// This request: no one else holds the key.
    Claimed,
    /// Another request (on any replica) is making it: wait and look again.
    Pending,
    /// It was made: replay this.
    Done(StoredResponse),
}

/// How a compare-and-set of a guard's shared state went.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowSave {
    Saved(u64),
    Moved(u64, String),
}

/// The tenant that created a stored response of the Responses API, until it expires.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnerRecord {
    pub id: String,
    pub tenant: String,
    pub expires_ms: i64,
    /// For a response: the context the provider holds for a request chained onto it
    /// (its input plus output tokens, as settled); `None` until known, and for the
    /// other objects (items, conversations).
    pub context_tokens: Option<u64>,
}

/// A stored object's owner as read back.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredOwner {
    pub tenant: String,
    pub context_tokens: Option<u64>,
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

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Sqlite(Arc<rusqlite::Error>),
    /// A queued write whose transaction failed (locked database, full disk, ...).
    #[error("store write failed: {0}")]
    Write(Arc<str>),
    #[error("store writer has stopped")]
    Closed,
    /// A read that did not run to completion (its blocking task panicked or the runtime
    /// is shutting down).
    #[error("store read failed: {0}")]
    Read(Arc<str>),
    /// The shared state (Redis) is down, slow or lost its data.
    #[error("{0}")]
    Unavailable(Arc<str>),
    /// A shared record in a format this build does not read (already logged and counted).
    #[error("{0}")]
    UnknownFormat(format::UnknownFormat),
}

impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> Self {
        StoreError::Sqlite(Arc::new(err))
    }
}

/// Counts a failed store operation in `backstop_store_errors_total{op}`.
pub(crate) fn count_error(op: &'static str) {
    metrics::counter!("backstop_store_errors_total", "op" => op).increment(1);
}

/// What every [`Store`] method answers with: boxed, so the trait is object-safe.
pub type StoreFuture<'a, T> = BoxFuture<'a, Result<T, StoreError>>;

/// The spend ledger: durable reservations of budgeted calls, their settles, and the
/// usage read back from it.
pub trait Ledger: Send + Sync {
    /// How many crashed reservations opening the store charged.
    fn recovered_reservations(&self) -> u64;

    /// An id for a new reservation, unique in this store.
    fn next_reservation_id(&self) -> i64;

    /// Makes a reservation durable; resolves once it is.
    fn reserve(&self, reservation: ReservationRecord) -> StoreFuture<'_, ()>;

    /// Appends a charge (deleting its durable reservation, if any, atomically with it);
    /// resolves once it is durable. On failure the reservation stays, so a restart still
    /// counts it.
    fn settle(&self, reservation: Option<i64>, charge: Charge) -> StoreFuture<'_, ()>;

    /// Forgets a reservation whose call was refused because its write failed, in case
    /// the write landed anyway (a store across a network can lose the acknowledgement
    /// of a commit); retried until it is done, never waited for. A local store's failed
    /// write never landed: nothing to do.
    fn unreserve(&self, _reservation: i64) {}

    /// As [`Store::settle`], without waiting (the end of a stream, a dropped call): a
    /// failure is logged and counted by the store, since no caller is left to tell.
    fn settle_later(&self, reservation: Option<i64>, charge: Charge);

    /// Appends a charge with no reservation; resolves once it is durable.
    fn charge(&self, charge: Charge) -> StoreFuture<'_, ()> {
        self.settle(None, charge)
    }

    /// Starts a session's usage over from `at_ms`.
    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        at_ms: i64,
    ) -> StoreFuture<'a, ()>;

    /// A session's usage since its last reset.
    fn session_usage<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, Usage>;

    /// A tenant's usage on one UTC day (days since the epoch).
    fn tenant_day_usage<'a>(&'a self, tenant: &'a str, day: i64) -> StoreFuture<'a, Usage>;

    /// Spend per tenant, UTC day and model: the sums of the ledger rows `query`
    /// selects (settled charges only, not reservations in flight), ordered by tenant,
    /// day and model. One `GROUP BY tenant, day, model` over the ledger in SQL; counts
    /// saturate rather than fail on overflow.
    fn spend_report<'a>(&'a self, query: &'a ReportQuery) -> StoreFuture<'a, Vec<ReportRow>>;

    /// A tenant's spend on one day, by model, in model order: [`Ledger::spend_report`]
    /// for that tenant and day.
    fn tenant_day_by_model<'a>(
        &'a self,
        tenant: &'a str,
        day: i64,
    ) -> StoreFuture<'a, Vec<(String, Usage)>> {
        Box::pin(async move {
            let query = ReportQuery {
                tenant: Some(tenant.to_string()),
                from_day: Some(day),
                to_day: Some(day),
            };
            let rows = self.spend_report(&query).await?;
            Ok(rows
                .into_iter()
                .map(|r| (r.model.clone(), r.usage()))
                .collect())
        })
    }

    /// Durable reservations not yet settled (for tests and the admin view).
    fn open_reservations(&self) -> StoreFuture<'_, u64>;

    /// What every replica has committed on a tenant's `day` and, with `session`, in that
    /// session since its reset: settled, plus what other processes hold reserved. Read
    /// for every budgeted call when other processes share this store and nothing else
    /// counts for them (no Redis). `None`: this process's own books are the whole
    /// story (a store no other process shares, or Redis counting).
    fn committed_usage<'a>(
        &'a self,
        _tenant: &'a str,
        _day: i64,
        _session: Option<&'a str>,
    ) -> StoreFuture<'a, Option<CommittedUsage>> {
        Box::pin(async { Ok(None) })
    }
}

/// A tenant's day and a session as every replica has committed them
/// ([`Ledger::committed_usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CommittedUsage {
    pub day: Usage,
    pub session: Option<Usage>,
}

/// Settles the shared state (Redis) could not take, kept until it can.
pub trait SettleQueue: Send + Sync {
    /// Keeps a settle the shared state could not take (replacing one kept for the same
    /// reservation); resolves once it is durable.
    fn queue_settle(&self, settle: QueuedSettle) -> StoreFuture<'_, ()>;

    /// The oldest kept settles, at most `limit`.
    fn queued_settles(&self, limit: usize) -> StoreFuture<'_, Vec<QueuedSettle>>;

    /// Forgets a kept settle the shared state has taken.
    fn unqueue_settle(&self, reservation: String) -> StoreFuture<'_, ()>;
}

/// Responses kept for idempotent replays, and the claims on their keys.
pub trait Replays: Tier {
    /// Keeps a response for replay; resolves once it is durable.
    fn remember(&self, response: StoredResponse) -> StoreFuture<'_, ()>;

    /// Claims an idempotency key for one request, across every process sharing this
    /// store, for `lease_ms` at most. A store private to one process has nothing to
    /// claim against (the layer's in-process map does it).
    fn claim<'a>(
        &'a self,
        _tenant: &'a str,
        _key: &'a str,
        _lease_ms: i64,
    ) -> StoreFuture<'a, Claim> {
        Box::pin(async { Ok(Claim::Claimed) })
    }

    /// Gives back a claim whose request did not end in a response to keep.
    fn release_claim(&self, _tenant: &str, _key: &str) {}

    /// A kept response that has not expired at `now_ms`.
    fn recall<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        now_ms: i64,
    ) -> StoreFuture<'a, Option<StoredResponse>>;
}

/// One entry of a session's side-effect journal as it is kept: its call's id, when it
/// was written, and the entry itself (versioned JSON, read and written by
/// `state::journal`).
#[derive(Debug, Clone, PartialEq)]
pub struct JournalRecord {
    pub call_id: String,
    pub at_ms: i64,
    /// Only proposed (no result seen): what a full journal drops first.
    pub proposed: bool,
    pub entry: String,
}

/// Sessions' side-effect journals (`[tenants.side_effects]`).
pub trait Journals: Send + Sync {
    /// A session's entries, oldest first.
    fn journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Vec<JournalRecord>>;

    /// Writes `records` (each replacing the entry of its call id, if any) and keeps the
    /// session's `max_entries`: proposed entries go before the others, the oldest first;
    /// committed when it answers. A store that expires
    /// what it keeps (Redis) keeps the journal `ttl_ms` after its last write.
    fn write_journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        records: Vec<JournalRecord>,
        max_entries: usize,
        ttl_ms: u64,
    ) -> StoreFuture<'a, ()>;
}

/// Which tenant created each stored response of the Responses API.
pub trait Owners: Send + Sync {
    /// Records who created these stored responses, in one write (one commit for the
    /// batch); resolves once they are durable.
    fn record_owners(&self, owners: Vec<OwnerRecord>) -> StoreFuture<'_, ()>;

    /// The tenant that created stored response `id`, if it has not expired at `now_ms`.
    fn owner_of<'a>(&'a self, id: &'a str, now_ms: i64) -> StoreFuture<'a, Option<StoredOwner>>;
}

/// The session guard's closes and trips, and its state shared by replicas.
pub trait GuardStates: Tier {
    /// Persists a session's close or trip (replacing what was kept).
    fn save_guard(&self, record: GuardRecord) -> StoreFuture<'_, ()>;

    /// Forgets a session's close or trip.
    fn clear_guard<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, ()>;

    /// A session's kept close or trip.
    fn guard_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Option<GuardRecord>>;
    /// Replaces a session guard's state shared by replicas if it is still at
    /// `version` (0: none yet): `Saved(new version)`, or `Moved` with the version and
    /// state another replica wrote first (load it and redo). `window` says what the
    /// write did to the state's window of requests, for a store that keeps the window
    /// beside the state (Redis). A store no other process shares has nothing to save:
    /// `None`.
    fn save_guard_window<'a>(
        &'a self,
        _tenant: &'a str,
        _session: &'a str,
        _version: u64,
        _state: String,
        _window: format::WindowWrite,
        _ttl_ms: u64,
    ) -> StoreFuture<'a, Option<WindowSave>> {
        Box::pin(async { Ok(None) })
    }

    /// A session guard's state shared by replicas as it is now: its version and state
    /// (`None`: none yet, or a store no other process shares).
    fn guard_window<'a>(
        &'a self,
        _tenant: &'a str,
        _session: &'a str,
    ) -> StoreFuture<'a, Option<(u64, String)>> {
        Box::pin(async { Ok(None) })
    }
}

/// The books: the ledger and the queue of settles waiting for Redis, which the budgets
/// keep together (one object, so a charge and its queued settle reach the same place).
pub trait Books: Ledger + SettleQueue {}

impl<T: Ledger + SettleQueue + ?Sized> Books for T {}

/// Whether what a role keeps is this process's own or shared by other replicas (then a
/// guard's state is read per request, and an idempotent claim is waited on).
pub trait Tier: Send + Sync {
    fn is_shared(&self) -> bool {
        false
    }
}

/// The persistence seam: every role, object-safe. Built once (`app.rs`) and held whole
/// only there and by the purger; every consumer takes the role it uses (`Arc<dyn Books>`,
/// `Arc<dyn Replays>`, `Arc<dyn Owners>`, `Arc<dyn GuardStates>`, `Arc<dyn Journals>`).
pub trait Store: Books + Replays + Owners + GuardStates + Journals {
    /// Deletes idempotency rows and owners expired at `now_ms` and everything older than
    /// `store.retention`.
    fn purge(&self, now_ms: i64) -> StoreFuture<'_, ()>;
}

/// The ledger `[store]` names, opened to be read beside running gateways (for
/// `backstop report`): it does not create, migrate or recover anything, and takes no
/// lock a gateway's writes would wait on. A store with nothing outside its process
/// (`path = ":memory:"`) has no ledger to read. Blocking: call it before the runtime
/// does anything else.
pub fn open_ledger_reader(config: &StoreConfig) -> Result<Arc<dyn Ledger>, OpenError> {
    if config.path == ":memory:" {
        return Err(OpenError::Config(
            "store.path is \":memory:\": that ledger lives and dies with its gateway; name the database file".into(),
        ));
    }
    SqliteStore::open_read_only(config)
        .map(|store| Arc::new(store) as Arc<dyn Ledger>)
        .map_err(|err| OpenError::Store(format!("{}: {err}", config.path)))
}

/// Why [`open_ledger_reader`] could not open the ledger.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OpenError {
    /// The config names no ledger that can be read (fix the config).
    #[error("{0}")]
    Config(String),
    /// The store is there in the config but could not be opened or read.
    #[error("{0}")]
    Store(String),
}

/// How often [`spawn_purger`] purges.
pub const PURGE_EVERY: Duration = Duration::from_secs(60);

/// Purges the store every `every` on tokio time (so a paused clock drives it in tests),
/// with `clock`'s calendar deciding what has expired. The first purge is one interval
/// after the start. Runs until the returned task is aborted.
pub fn spawn_purger(
    store: Arc<dyn Store>,
    clock: Clock,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    // Due from now, not from when the task first runs.
    let first = tokio::time::Instant::now() + every;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(first, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            // A failure is logged and counted where it happens; the next tick retries.
            let _ = store.purge(clock.now_ms()).await;
        }
    })
}

#[cfg(test)]
pub(crate) mod test_dir;
#[cfg(test)]
mod tests;
