//! The store when replicas share Redis: idempotency records (claimed atomically, replayed
//! from any replica), the guard's closes and trips, and Responses API owners live in
//! Redis; the spend ledger stays in the inner (embedded) store, which the budgets no
//! longer consult for limits (those are counters in Redis, see `state::shared`).
//! Every Redis error or timeout is [`StoreError::Unavailable`]. The records' formats,
//! versioned, are [`super::format`]'s.

use std::sync::Arc;

use super::connection::Redis;
use super::format::{self, UnknownFormat, WindowWrite};
use super::{
    Charge, Claim, GuardRecord, GuardStates, JournalRecord, Journals, Ledger, OwnerRecord, Owners,
    QueuedSettle, Replays, ReportQuery, ReportRow, ReservationRecord, SettleQueue, Store,
    StoreError, StoreFuture, StoredOwner, StoredResponse, Tier, WindowSave,
};
use crate::policy::budget::Usage;

/// `save_window.lua`: compare-and-set of a guard's shared state. The store's scripts are
/// files in `src/state/redis/` with the others, listed in [`crate::state::redis::SCRIPTS`].
pub const SAVE_WINDOW: &str = concat!(
    include_str!("../state/redis/prelude_brief.lua"),
    include_str!("../state/redis/prelude_window.lua"),
    include_str!("../state/redis/save_window.lua"),
);

/// `read_window.lua`: a guard's shared state as it is.
pub const READ_WINDOW: &str = concat!(
    include_str!("../state/redis/prelude_brief.lua"),
    include_str!("../state/redis/prelude_window.lua"),
    include_str!("../state/redis/read_window.lua"),
);

/// `release_claim.lua`: an idempotency key's pending claim given back.
pub const RELEASE_CLAIM: &str = include_str!("../state/redis/release_claim.lua");

/// A key's value while its first request runs: a bare marker, the same in every format
/// version (see [`format::encode_response`]).
const PENDING: &str = "pending";

pub struct RedisStore {
    inner: Arc<dyn Store>,
    redis: Arc<Redis>,
    /// [`SAVE_WINDOW`]: compare-and-set of a guard's shared state.
    save_window: redis::Script,
    /// [`READ_WINDOW`]: a guard's shared state as it is.
    read_window: redis::Script,
}

impl RedisStore {
    pub fn new(inner: Arc<dyn Store>, redis: Arc<Redis>) -> RedisStore {
        RedisStore {
            inner,
            redis,
            save_window: redis::Script::new(SAVE_WINDOW),
            read_window: redis::Script::new(READ_WINDOW),
        }
    }

    fn idem_key(&self, tenant: &str, key: &str) -> String {
        self.redis.key(tenant, &format!("idempotency:{key}"))
    }

    fn guard_key(&self, tenant: &str, session: &str) -> String {
        self.redis.key(tenant, &format!("guard:{session}"))
    }

    fn journal_key(&self, tenant: &str, session: &str) -> String {
        self.redis.key(tenant, &format!("journal:{session}"))
    }

    fn owner_key(&self, id: &str) -> String {
        self.redis.global(&format!("owner:{id}"))
    }

    /// A kept response, or `None` (refused, logged and counted) for one this build cannot
    /// read: its caller takes the key for claimed, never for free.
    fn decode(&self, tenant: &str, key: &str, text: &str) -> Option<StoredResponse> {
        format::decode_response(tenant, key, text)
            .map_err(|unknown| unknown.report(&self.idem_key(tenant, key)))
            .ok()
    }
}

fn unavailable(err: super::connection::Unavailable) -> StoreError {
    StoreError::Unavailable(err.to_string().into())
}

fn refused(at: &str, unknown: UnknownFormat) -> StoreError {
    unknown.report(at);
    StoreError::UnknownFormat(unknown)
}

impl Ledger for RedisStore {
    fn recovered_reservations(&self) -> u64 {
        self.inner.recovered_reservations()
    }

    fn next_reservation_id(&self) -> i64 {
        self.inner.next_reservation_id()
    }

    fn reserve(&self, reservation: ReservationRecord) -> StoreFuture<'_, ()> {
        self.inner.reserve(reservation)
    }

    fn settle(&self, reservation: Option<i64>, charge: Charge) -> StoreFuture<'_, ()> {
        self.inner.settle(reservation, charge)
    }

    fn settle_later(&self, reservation: Option<i64>, charge: Charge) {
        self.inner.settle_later(reservation, charge)
    }

    fn unreserve(&self, reservation: i64) {
        self.inner.unreserve(reservation)
    }

    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        at_ms: i64,
    ) -> StoreFuture<'a, ()> {
        self.inner.reset_session(tenant, session, at_ms)
    }

    fn session_usage<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, Usage> {
        self.inner.session_usage(tenant, session)
    }

    fn tenant_day_usage<'a>(&'a self, tenant: &'a str, day: i64) -> StoreFuture<'a, Usage> {
        self.inner.tenant_day_usage(tenant, day)
    }

    fn spend_report<'a>(&'a self, query: &'a ReportQuery) -> StoreFuture<'a, Vec<ReportRow>> {
        self.inner.spend_report(query)
    }

    fn open_reservations(&self) -> StoreFuture<'_, u64> {
        self.inner.open_reservations()
    }
}

impl SettleQueue for RedisStore {
    // Settles Redis could not take are kept in the replica's own store, not in Redis.
    fn queue_settle(&self, settle: QueuedSettle) -> StoreFuture<'_, ()> {
        self.inner.queue_settle(settle)
    }

    fn queued_settles(&self, limit: usize) -> StoreFuture<'_, Vec<QueuedSettle>> {
        self.inner.queued_settles(limit)
    }

    fn unqueue_settle(&self, reservation: String) -> StoreFuture<'_, ()> {
        self.inner.unqueue_settle(reservation)
    }
}

impl Replays for RedisStore {
    fn remember(&self, response: StoredResponse) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let key = self.idem_key(&response.tenant, &response.key);
            let (value, expires) = (format::encode_response(&response), response.expires_ms);
            self.redis
                .run("remember", |mut c| async move {
                    redis::cmd("SET")
                        .arg(&key)
                        .arg(value)
                        .arg("PXAT")
                        .arg(expires)
                        .query_async::<()>(&mut c)
                        .await
                })
                .await
                .map_err(unavailable)
        })
    }

    fn claim<'a>(&'a self, tenant: &'a str, key: &'a str, lease_ms: i64) -> StoreFuture<'a, Claim> {
        Box::pin(async move {
            let k = self.idem_key(tenant, key);
            let (claimed, value): (Option<String>, Option<String>) = self
                .redis
                .run("claim", |mut c| async move {
                    redis::pipe()
                        .cmd("SET")
                        .arg(&k)
                        .arg(PENDING)
                        .arg("NX")
                        .arg("PX")
                        .arg(lease_ms.max(1000))
                        .cmd("GET")
                        .arg(&k)
                        .query_async(&mut c)
                        .await
                })
                .await
                .map_err(unavailable)?;
            Ok(match (claimed, value) {
                (Some(_), _) => Claim::Claimed,
                (None, Some(v)) if v == PENDING => Claim::Pending,
                // Kept by a newer release (or unreadable): someone else's, never free.
                (None, Some(v)) => match self.decode(tenant, key, &v) {
                    Some(stored) => Claim::Done(stored),
                    None => Claim::Pending,
                },
                // Expired between the two commands: try again.
                (None, None) => Claim::Pending,
            })
        })
    }

    fn release_claim(&self, tenant: &str, key: &str) {
        let k = self.idem_key(tenant, key);
        let redis = self.redis.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                // Only our own pending claim; a kept response stays. A failure leaves
                // the claim to expire with its lease.
                let script = redis::Script::new(RELEASE_CLAIM);
                let mut inv = script.prepare_invoke();
                inv.key(&k).arg(PENDING);
                let _ = redis
                    .run("release", |mut c| async move {
                        inv.invoke_async::<i64>(&mut c).await
                    })
                    .await;
            });
        }
    }

    fn recall<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        _now_ms: i64,
    ) -> StoreFuture<'a, Option<StoredResponse>> {
        Box::pin(async move {
            let k = self.idem_key(tenant, key);
            let value: Option<String> = self
                .redis
                .run("recall", |mut c| async move {
                    redis::cmd("GET").arg(&k).query_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            // A response this build cannot read is no answer to replay; the claim that
            // follows finds the key taken.
            Ok(value
                .filter(|v| v != PENDING)
                .and_then(|v| self.decode(tenant, key, &v)))
        })
    }
}

impl Owners for RedisStore {
    fn record_owners(&self, owners: Vec<OwnerRecord>) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            // One command per owner, sent together: owners are keys of no tenant, so on
            // a Redis Cluster they live in different slots and cannot share a pipeline.
            let sets: Vec<redis::Cmd> = owners
                .iter()
                .map(|o| {
                    let mut set = redis::cmd("SET");
                    set.arg(self.owner_key(&o.id))
                        .arg(format::encode_owner(&o.tenant, o.context_tokens))
                        .arg("PXAT")
                        .arg(o.expires_ms);
                    set
                })
                .collect();
            self.redis
                .run("owners", |c| async move {
                    futures_util::future::try_join_all(sets.iter().map(|set| {
                        let mut c = c.clone();
                        async move { set.query_async::<()>(&mut c).await }
                    }))
                    .await
                    .map(drop)
                })
                .await
                .map_err(unavailable)
        })
    }

    fn owner_of<'a>(&'a self, id: &'a str, _now_ms: i64) -> StoreFuture<'a, Option<StoredOwner>> {
        Box::pin(async move {
            let key = self.owner_key(id);
            let value: Option<String> = self
                .redis
                .run("owner_of", |mut c| async move {
                    redis::cmd("GET").arg(&key).query_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            // An owner this build cannot read is not taken for anyone's: an error, so
            // the response is neither served nor chained onto.
            value
                .map(|v| {
                    format::decode_owner(&v)
                        .map_err(|unknown| refused(&self.owner_key(id), unknown))
                })
                .transpose()
        })
    }
}

impl GuardStates for RedisStore {
    fn save_guard_window<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        version: u64,
        state: String,
        window: WindowWrite,
        ttl_ms: u64,
    ) -> StoreFuture<'a, Option<WindowSave>> {
        Box::pin(async move {
            let (state, op, arg) = format::beside_write(&state, window, version);
            let mut inv = self.save_window.prepare_invoke();
            for key in self.redis.guard_window_keys(tenant, session) {
                inv.key(key);
            }
            inv.arg(version)
                .arg(state)
                .arg(ttl_ms.max(1000))
                .arg(op)
                .arg(arg);
            let reply: Vec<String> = self
                .redis
                .run("save_guard_window", |mut c| async move {
                    inv.invoke_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            let field = |i: usize| reply.get(i).map(String::as_str).unwrap_or_default();
            let version = field(1).parse().unwrap_or(0);
            Ok(Some(match field(0) {
                "saved" => WindowSave::Saved(version),
                _ => WindowSave::Moved(version, format::from_beside(field(2), field(3))),
            }))
        })
    }

    fn guard_window<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Option<(u64, String)>> {
        Box::pin(async move {
            let mut inv = self.read_window.prepare_invoke();
            for key in self.redis.guard_window_keys(tenant, session) {
                inv.key(key);
            }
            let reply: Vec<String> = self
                .redis
                .run("guard_window", |mut c| async move {
                    inv.invoke_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            Ok(match reply.as_slice() {
                [version, state, window] => Some((
                    version.parse().unwrap_or(0),
                    format::from_beside(state, window),
                )),
                _ => None,
            })
        })
    }

    fn save_guard(&self, record: GuardRecord) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let key = self.guard_key(&record.tenant, &record.session);
            let value = format::encode_guard_record(&record);
            self.redis
                .run("save_guard", |mut c| async move {
                    redis::cmd("SET")
                        .arg(&key)
                        .arg(value)
                        .query_async::<()>(&mut c)
                        .await
                })
                .await
                .map_err(unavailable)
        })
    }

    fn clear_guard<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let key = self.guard_key(tenant, session);
            self.redis
                .run("clear_guard", |mut c| async move {
                    redis::cmd("DEL").arg(&key).query_async::<()>(&mut c).await
                })
                .await
                .map_err(unavailable)
        })
    }

    fn guard_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Option<GuardRecord>> {
        Box::pin(async move {
            let key = self.guard_key(tenant, session);
            let value: Option<String> = self
                .redis
                .run("guard_state", |mut c| async move {
                    redis::cmd("GET").arg(&key).query_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            // A close or trip this build cannot read is an error, not the absence of one.
            value
                .map(|v| {
                    format::decode_guard_record(tenant, session, &v)
                        .map_err(|unknown| refused(&self.guard_key(tenant, session), unknown))
                })
                .transpose()
        })
    }
}

/// A session's journal is one hash (call id → `at_ms`, a tab, `1` for a proposed entry
/// and `0` for another, then the entry on the next line),
/// shared by the replicas and expiring with the session.
impl Journals for RedisStore {
    fn journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Vec<JournalRecord>> {
        Box::pin(async move {
            let key = self.journal_key(tenant, session);
            let fields: Vec<(String, String)> = self
                .redis
                .run("journal", |mut c| async move {
                    redis::cmd("HGETALL").arg(&key).query_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            Ok(journal_records(fields))
        })
    }

    fn write_journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        records: Vec<JournalRecord>,
        max_entries: usize,
        ttl_ms: u64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let key = self.journal_key(tenant, session);
            let mut write = redis::pipe();
            for r in &records {
                write
                    .cmd("HSET")
                    .arg(&key)
                    .arg(&r.call_id)
                    .arg(format!(
                        "{}\t{}\n{}",
                        r.at_ms,
                        u8::from(r.proposed),
                        r.entry
                    ))
                    .ignore();
            }
            write
                .cmd("PEXPIRE")
                .arg(&key)
                .arg(ttl_ms.max(1000))
                .ignore()
                .cmd("HLEN")
                .arg(&key);
            let (len,): (usize,) = self
                .redis
                .run("write_journal", |mut c| async move {
                    write.query_async(&mut c).await
                })
                .await
                .map_err(unavailable)?;
            if len <= max_entries {
                return Ok(());
            }
            // Over the bound: proposed entries go first, then the oldest (rare; every
            // replica trims alike).
            let mut journal = self.journal(tenant, session).await?;
            journal.sort_by(|a, b| {
                (!a.proposed, a.at_ms, &a.call_id).cmp(&(!b.proposed, b.at_ms, &b.call_id))
            });
            let old: Vec<String> = journal[..journal.len().saturating_sub(max_entries)]
                .iter()
                .map(|r| r.call_id.clone())
                .collect();
            if old.is_empty() {
                return Ok(());
            }
            self.redis
                .run("write_journal", |mut c| async move {
                    redis::cmd("HDEL")
                        .arg(&key)
                        .arg(&old)
                        .query_async::<()>(&mut c)
                        .await
                })
                .await
                .map_err(unavailable)
        })
    }
}

/// A journal hash's fields as records, oldest first (a field not in the format is left
/// out).
fn journal_records(fields: Vec<(String, String)>) -> Vec<JournalRecord> {
    let mut records: Vec<JournalRecord> = fields
        .into_iter()
        .filter_map(|(call_id, value)| {
            let (head, entry) = value.split_once('\n')?;
            let (at_ms, proposed) = head.split_once('\t')?;
            Some(JournalRecord {
                call_id,
                at_ms: at_ms.parse().ok()?,
                proposed: proposed == "1",
                entry: entry.to_string(),
            })
        })
        .collect();
    records.sort_by(|a, b| (a.at_ms, &a.call_id).cmp(&(b.at_ms, &b.call_id)));
    records
}

impl Tier for RedisStore {
    fn is_shared(&self) -> bool {
        true
    }
}

impl Store for RedisStore {
    fn purge(&self, now_ms: i64) -> StoreFuture<'_, ()> {
        self.inner.purge(now_ms)
    }
}
