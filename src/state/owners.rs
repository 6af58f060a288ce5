//! Which tenant created each stored object of the Responses API (responses, their
//! output items, conversations). Every tenant's calls reach the same provider account,
//! so without this any tenant key could read, cancel or delete another tenant's stored
//! responses by id, or chain onto them. An owner is recorded when the upstream names the
//! response (the answer's `id`, or a stream's first event), in the store (Redis in
//! replica mode) before the answer or its first event is released to the client, so
//! every replica knows it at once and a crash right after cannot lose it; and in memory.
//!
//! With a response's owner goes its context size: the input plus output tokens it
//! settled, which a request chained onto it costs in input beyond its own body.
//!
//! The owner of a `previous_response_id` is checked on every chained create (an
//! agent's every turn), so owners are also kept in memory after their write, the most
//! recent [`RECENT`] of them, and an owner read from the store joins them.
//!
//! One awaited write per create: concurrent creates share a commit (the SQLite writer
//! commits whatever is queued as one transaction; Redis takes one `SET` per object).

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::{
    clock::Clock,
    store::{OwnerRecord, Owners, StoreError},
};

/// How long an owner is kept: OpenAI keeps a stored response for 30 days.
pub const OWNER_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// A stored object's owner as this process knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Known {
    pub tenant: Arc<str>,
    /// A response's context size (input + output tokens), once settled.
    pub context_tokens: Option<u64>,
}

pub struct ResponseOwners {
    store: Arc<dyn Owners>,
    clock: Clock,
    recent: Mutex<Recent>,
}

/// Written owners kept in memory, at most (162 bytes each with OpenAI's 53-character
/// ids, measured as resident memory: 10.6 MB full): at 100 creates a second, the last
/// 11 minutes of conversations chain without a store read.
pub const RECENT: usize = 65_536;

/// Owners recorded or read, the most recent; the oldest is forgotten first (and read
/// from the store again if it is asked for).
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
    owners: HashMap<Arc<str>, Known>,
    order: VecDeque<Arc<str>>,
}

impl Recent {
    /// Adds or updates `id`'s owner (a size once known is never forgotten).
    fn insert(&mut self, id: Arc<str>, known: Known) {
        match self.owners.get_mut(&id) {
            Some(old) => {
                let context_tokens = known.context_tokens.or(old.context_tokens);
                *old = Known {
                    context_tokens,
                    ..known
                };
            }
            None => {
                self.owners.insert(id.clone(), known);
                self.order.push_back(id);
                if self.order.len() > RECENT {
                    if let Some(oldest) = self.order.pop_front() {
                        self.owners.remove(&oldest);
                    }
                }
            }
        }
    }
}

impl ResponseOwners {
    pub fn new(store: Arc<dyn Owners>, clock: Clock) -> Self {
        ResponseOwners {
            store,
            clock,
            recent: Mutex::new(Recent::default()),
        }
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `tenant` created these objects (id, context size): known here at once, and
    /// durable in the store when this returns `Ok`. On `Err` they are known to this
    /// process only (the caller decides what the client is told).
    pub async fn record(
        &self,
        tenant: &Arc<str>,
        objects: Vec<(String, Option<u64>)>,
    ) -> Result<(), StoreError> {
        if objects.is_empty() {
            return Ok(());
        }
        let ttl = i64::try_from(OWNER_TTL.as_millis()).unwrap_or(i64::MAX);
        let expires_ms = self.clock.now_ms().saturating_add(ttl);
        {
            let mut recent = self.recent();
            for (id, context_tokens) in &objects {
                recent.insert(
                    id.as_str().into(),
                    Known {
                        tenant: tenant.clone(),
                        context_tokens: *context_tokens,
                    },
                );
            }
        }
        let batch = objects
            .into_iter()
            .map(|(id, context_tokens)| OwnerRecord {
                id,
                tenant: tenant.to_string(),
                expires_ms,
                context_tokens,
            })
            .collect();
        self.store.record_owners(batch).await
    }

    /// Who created object `id`, if anyone recorded it. With `sized`, an owner known
    /// here without a context size is read again from the store (another replica may
    /// have settled it since).
    pub async fn owner(&self, id: &str, sized: bool) -> Result<Option<Known>, StoreError> {
        let remembered = self.recent().owners.get(id).cloned();
        if let Some(known) = &remembered {
            if !sized || known.context_tokens.is_some() {
                return Ok(remembered);
            }
        }
        let Some(stored) = self.store.owner_of(id, self.clock.now_ms()).await? else {
            return Ok(remembered);
        };
        let known = Known {
            tenant: stored.tenant.into(),
            context_tokens: stored.context_tokens,
        };
        self.recent().insert(id.into(), known.clone());
        Ok(Some(known))
    }

    /// Whether `tenant` created response `id` (an id nobody recorded is nobody's).
    pub async fn owns(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .owner(id, false)
            .await?
            .is_some_and(|o| &*o.tenant == tenant))
    }

    /// Whether object `id` was recorded as another tenant's. An id nobody recorded is
    /// not: one created before Backstop or around it, or one expired. A reference is
    /// refused on this evidence only, so that no chain breaks on what Backstop does not
    /// know, while no tenant can continue another's conversation. (Owners are durable
    /// before a create is answered, so an id Backstop handed out is always known.)
    pub async fn is_anothers(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .owner(id, false)
            .await?
            .is_some_and(|owner| &*owner.tenant != tenant))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    #[tokio::test]
    async fn an_owner_is_known_at_once_and_after_a_restart_and_to_no_one_else() {
        let store: Arc<dyn Owners> = Arc::new(SqliteStore::open(":memory:").unwrap());
        let owners = Arc::new(ResponseOwners::new(store.clone(), Clock::system()));
        let a: Arc<str> = "tenant-a".into();
        owners
            .record(&a, vec![("resp_1".into(), None)])
            .await
            .unwrap();
        assert!(owners.owns("tenant-a", "resp_1").await.unwrap());
        assert!(!owners.owns("tenant-b", "resp_1").await.unwrap());
        assert!(!owners.owns("tenant-a", "resp_2").await.unwrap());
        // A new process (nothing in memory) reads it from the store at once: the
        // record was durable when `record` returned.
        let restarted = ResponseOwners::new(store.clone(), Clock::system());
        assert!(restarted.owns("tenant-a", "resp_1").await.unwrap());
        // The size, recorded when the response settles, reaches a process that knew
        // the owner without it.
        owners
            .record(&a, vec![("resp_1".into(), Some(1200))])
            .await
            .unwrap();
        let sized = restarted.owner("resp_1", true).await.unwrap().unwrap();
        assert_eq!(sized.context_tokens, Some(1200));
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
        let known = |context_tokens| Known {
            tenant: tenant.clone(),
            context_tokens,
        };
        for n in 0..=RECENT {
            recent.insert(format!("resp_{n}").into(), known(None));
        }
        // The same id again is not a second entry, and a size once known is kept.
        recent.insert("resp_1".into(), known(Some(5)));
        recent.insert("resp_1".into(), known(None));
        assert_eq!(recent.owners["resp_1"].context_tokens, Some(5));
        assert_eq!(recent.owners.len(), RECENT);
        assert_eq!(recent.order.len(), RECENT);
        assert!(!recent.owners.contains_key("resp_0"));
        assert!(recent.owners.contains_key("resp_1"));
        assert!(recent
            .owners
            .contains_key(format!("resp_{RECENT}").as_str()));
    }
}
