//! Which tenant created each stored response of the Responses API. Every tenant's calls
//! reach the same provider account, so without this any tenant key could read, cancel or
//! delete another tenant's stored responses by id. An owner is recorded when the
//! upstream names the response (the answer's `id`, or a stream's first event), in memory
//! at once (so a read right after the create finds it) and in the store (so it outlives a
//! restart), for as long as the provider keeps responses.
//!
//! Store writes are batched: owners recorded within [`FLUSH_EVERY`] go to the store as
//! one write (one commit), into a table of their own (one B-tree row per create). One
//! commit per create measured 46,000 instructions a call (a fifth of a proxied call); a
//! crash can lose the owners of the last quarter second, whose responses then answer 404
//! after the restart.

use std::{
    collections::HashMap,
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
}

/// Owners not yet in the store: answered from here until their write lands. (Reads of
/// stored responses are rare and creates are hot, so a create costs one map insert and
/// a read of an older response one store read; no cache of written owners is kept.)
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

impl ResponseOwners {
    pub fn new(store: Arc<dyn Store>, clock: Clock) -> Self {
        ResponseOwners {
            store,
            clock,
            unwritten: Mutex::new(Unwritten::default()),
        }
    }

    fn unwritten(&self) -> std::sync::MutexGuard<'_, Unwritten> {
        self.unwritten.lock().unwrap_or_else(|e| e.into_inner())
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
        if let Err(err) = result {
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

    /// Whether `tenant` created response `id` (an id nobody recorded is nobody's).
    pub async fn owns(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        {
            let unwritten = self.unwritten();
            if let Some(owner) = unwritten
                .pending
                .get(id)
                .or_else(|| unwritten.writing.get(id))
            {
                return Ok(&**owner == tenant);
            }
        }
        let owner = self.store.owner_of(id, self.clock.now_ms()).await?;
        Ok(owner.as_deref() == Some(tenant))
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
    }
}
