//! Which tenant created each stored response of the Responses API. Every tenant's calls
//! reach the same provider account, so without this any tenant key could read, cancel or
//! delete another tenant's stored responses by id. An owner is recorded when the
//! upstream names the response (the answer's `id`, or a stream's first event), in memory
//! at once (so a read right after the create finds it) and in the store (so it outlives a
//! restart), for as long as the provider keeps responses.
//!
//! The owner of a `previous_response_id` is checked on every chained create (an
//! agent's every turn), so owners are also kept in memory after their write, the most
//! recent [`RECENT`] of them, and an owner read from the store joins them.
//!
//! Store writes are batched: owners recorded within [`FLUSH_EVERY`] go to the store as
//! one write (one commit), into a table of their own (one B-tree row per create). One
//! commit per create measured 46,000 instructions a call (a fifth of a proxied call); a
//! crash can lose the owners of the last quarter second, whose responses then answer 404
//! after the restart.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::{
    clock::Clock,
    store::{OwnerRecord, Store, StoreError},
};

/// How long an owner is kept: OpenAI keeps a stored response for 30 days.
pub const OWNER_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// How long recorded owners wait to be written to the store together.
pub const FLUSH_EVERY: Duration = Duration::from_millis(250);

pub struct ResponseOwners {
    store: Arc<dyn Store>,
    clock: Clock,
    unwritten: Mutex<Unwritten>,
    recent: Mutex<Recent>,
}

/// Owners not yet in the store: answered from here until their write lands, then from
/// [`Recent`]. (A create costs one map insert; the move to `Recent` is the flush's.)
#[derive(Default)]
struct Unwritten {
    /// Recorded since the last flush began.
    pending: HashMap<String, Arc<str>>,
    /// Being written by the flush in progress.
    writing: HashMap<String, Arc<str>>,
    /// A flush is scheduled or running.
    flushing: bool,
}

/// Owners kept in memory while the store refuses their writes, at most.
const MAX_UNWRITTEN: usize = 100_000;

/// Written owners kept in memory, at most (162 bytes each with OpenAI's 53-character
/// ids, measured as resident memory: 10.6 MB full): at 100 creates a second, the last
/// 11 minutes of conversations chain without a store read.
pub const RECENT: usize = 65_536;

/// Owners already in the store, the most recently recorded or read; the oldest is
/// forgotten first (and read from the store again if it is asked for).
///
/// Not a moka cache, as the other caches are: with 53-character ids moka measured 441
/// bytes an entry (28.9 MB full) and 659 ns a lookup, against 162 bytes here, and its
/// default admission (TinyLFU) can refuse a new id room over older ones, when a new id
/// is the one the next turn chains onto. Nothing here expires by time, and nothing need:
/// past its 30 days a response is gone at the provider too, so a stale owner only lets
/// its own tenant reach the provider's 404, or refuses another tenant what the provider
/// would refuse.
#[derive(Default)]
struct Recent {
    owners: HashMap<Arc<str>, Arc<str>>,
    order: VecDeque<Arc<str>>,
}

impl Recent {
    fn insert(&mut self, id: Arc<str>, tenant: Arc<str>) {
        if self.owners.insert(id.clone(), tenant).is_none() {
            self.order.push_back(id);
            if self.order.len() > RECENT {
                if let Some(oldest) = self.order.pop_front() {
                    self.owners.remove(&oldest);
                }
            }
        }
    }
}

impl ResponseOwners {
    pub fn new(store: Arc<dyn Store>, clock: Clock) -> Self {
        ResponseOwners {
            store,
            clock,
            unwritten: Mutex::new(Unwritten::default()),
            recent: Mutex::new(Recent::default()),
        }
    }

    fn unwritten(&self) -> std::sync::MutexGuard<'_, Unwritten> {
        self.unwritten.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `tenant` created response `id`: known at once, written to the store with the
    /// others recorded within [`FLUSH_EVERY`]. A failed write is logged and counted by
    /// the store (those owners are then known until the restart only).
    pub fn record(self: &Arc<Self>, tenant: &Arc<str>, id: String) {
        let mut unwritten = self.unwritten();
        unwritten.pending.insert(id, tenant.clone());
        if !std::mem::replace(&mut unwritten.flushing, true) {
            drop(unwritten);
            let this = self.clone();
            tokio::spawn(async move { this.flush_after(FLUSH_EVERY).await });
        }
    }

    /// Writes what is pending after `wait` as one store write (one commit, however the
    /// writer thread is scheduled); then the next record starts the next wait.
    async fn flush_after(self: Arc<Self>, wait: Duration) {
        tokio::time::sleep(wait).await;
        let ttl = i64::try_from(OWNER_TTL.as_millis()).unwrap_or(i64::MAX);
        let expires_ms = self.clock.now_ms().saturating_add(ttl);
        let batch: Vec<OwnerRecord> = {
            let mut unwritten = self.unwritten();
            unwritten.flushing = false;
            let pending = std::mem::take(&mut unwritten.pending);
            let batch = pending
                .iter()
                .map(|(id, tenant)| OwnerRecord {
                    id: id.clone(),
                    tenant: tenant.to_string(),
                    expires_ms,
                })
                .collect();
            unwritten.writing.extend(pending);
            batch
        };
        if batch.is_empty() {
            return;
        }
        let ids: Vec<String> = batch.iter().map(|o| o.id.clone()).collect();
        let result = self.store.record_owners(batch).await;
        let mut unwritten = self.unwritten();
        let flushed: Vec<_> = ids
            .iter()
            .filter_map(|id| unwritten.writing.remove_entry(id))
            .collect();
        match result {
            // Kept in memory while still in `unwritten` (locked here): never unknown.
            Ok(()) => {
                let mut recent = self.recent();
                for (id, tenant) in flushed {
                    recent.insert(id.into(), tenant);
                }
            }
            Err(err) => {
                tracing::error!(error = %err, owners = ids.len(), "cannot keep stored responses' owners");
                // Still known in memory, and written with the next batch: a failed write
                // must not disown a live response (bounded by MAX_UNWRITTEN).
                for (id, tenant) in flushed {
                    if unwritten.pending.len() < MAX_UNWRITTEN {
                        unwritten.pending.entry(id).or_insert(tenant);
                    }
                }
            }
        }
    }

    /// Who created response `id`, if anyone recorded it.
    async fn owner(&self, id: &str) -> Result<Option<Arc<str>>, StoreError> {
        {
            let unwritten = self.unwritten();
            if let Some(owner) = unwritten
                .pending
                .get(id)
                .or_else(|| unwritten.writing.get(id))
            {
                return Ok(Some(owner.clone()));
            }
        }
        if let Some(owner) = self.recent().owners.get(id) {
            return Ok(Some(owner.clone()));
        }
        let Some(owner) = self.store.owner_of(id, self.clock.now_ms()).await? else {
            return Ok(None);
        };
        let owner: Arc<str> = owner.into();
        self.recent().insert(id.into(), owner.clone());
        Ok(Some(owner))
    }

    /// Whether `tenant` created response `id` (an id nobody recorded is nobody's).
    pub async fn owns(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        Ok(self.owner(id).await?.as_deref() == Some(tenant))
    }

    /// Whether response `id` was recorded as another tenant's. An id nobody recorded is
    /// not: one just created through another replica (its owner not written yet), one
    /// created before Backstop or around it, or one expired. A `previous_response_id` is
    /// refused on this evidence only, so that no chain breaks on what Backstop does not
    /// know, while no tenant can continue another's conversation.
    pub async fn is_anothers(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        Ok(self.owner(id).await?.is_some_and(|owner| &*owner != tenant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    #[tokio::test]
    async fn an_owner_is_known_at_once_and_after_a_restart_and_to_no_one_else() {
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(":memory:").unwrap());
        let owners = Arc::new(ResponseOwners::new(store.clone(), Clock::system()));
        let a: Arc<str> = "tenant-a".into();
        owners.record(&a, "resp_1".into());
        // In memory at once: a read right after the create finds it.
        assert!(owners.owns("tenant-a", "resp_1").await.unwrap());
        assert!(!owners.owns("tenant-b", "resp_1").await.unwrap());
        assert!(!owners.owns("tenant-a", "resp_2").await.unwrap());
        // A new process (nothing in memory) reads it from the store once it is written.
        let restarted = ResponseOwners::new(store, Clock::system());
        let mut known = false;
        for _ in 0..100 {
            if restarted.owns("tenant-a", "resp_1").await.unwrap() {
                known = true;
                break;
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(known, "the owner was never written to the store");
        assert!(!restarted.owns("tenant-b", "resp_1").await.unwrap());
        // Chaining: refused only on a recorded owner that is someone else.
        assert!(restarted.is_anothers("tenant-b", "resp_1").await.unwrap());
        assert!(!restarted.is_anothers("tenant-a", "resp_1").await.unwrap());
        assert!(!restarted
            .is_anothers("tenant-b", "resp_unknown")
            .await
            .unwrap());
    }

    #[test]
    fn recent_owners_are_bounded_oldest_first() {
        let mut recent = Recent::default();
        let tenant: Arc<str> = "t".into();
        for n in 0..=RECENT {
            recent.insert(format!("resp_{n}").into(), tenant.clone());
        }
        // The same id again is not a second entry.
        recent.insert("resp_1".into(), tenant.clone());
        assert_eq!(recent.owners.len(), RECENT);
        assert_eq!(recent.order.len(), RECENT);
        assert!(!recent.owners.contains_key("resp_0"));
        assert!(recent.owners.contains_key("resp_1"));
        assert!(recent
            .owners
            .contains_key(format!("resp_{RECENT}").as_str()));
    }
}
