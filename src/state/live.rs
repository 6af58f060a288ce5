//! Per-session live values that idle out of memory but are never rebuilt while held:
//! the one cache shape behind both the budget sessions ([`super::budgets`]) and the guard
//! sessions ([`super::sessions`]).

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use moka::sync::Cache;

/// (tenant, session).
pub type SessionKey = (Arc<str>, String);

/// Per-session live state that idles out of memory, except while something still holds
/// it: the cache (moka, time-to-idle) keeps idle sessions alive, and a registry of weak
/// references finds a session that the cache dropped while a call, a reservation or an
/// in-flight slot still held it. Such a session is put back, never rebuilt, so its
/// reservations and concurrency count are not lost. The registry entry goes when the
/// cache evicts a session nobody holds (and in [`LiveSessions::sweep`]).
pub struct LiveSessions<V> {
    cache: Cache<SessionKey, Arc<V>>,
    registry: Arc<Mutex<Registry<V>>>,
}

/// A handle on the same sessions (a reloaded config's books share them).
impl<V> Clone for LiveSessions<V> {
    fn clone(&self) -> Self {
        LiveSessions {
            cache: self.cache.clone(),
            registry: self.registry.clone(),
        }
    }
}

struct Registry<V> {
    live: HashMap<SessionKey, Weak<V>>,
    /// Evicted while held: their entries go once the holders are done.
    orphans: Vec<SessionKey>,
}

impl<V> Registry<V> {
    fn forget_released_orphans(&mut self) {
        let live = &mut self.live;
        self.orphans.retain(|key| {
            let held = live.get(key).is_some_and(|w| w.strong_count() > 0);
            if !held {
                live.remove(key);
            }
            held
        });
    }
}

impl<V: Send + Sync + 'static> LiveSessions<V> {
    pub fn new(idle: Duration) -> Self {
        let registry = Arc::new(Mutex::new(Registry {
            live: HashMap::new(),
            orphans: Vec::new(),
        }));
        let on_evict = Arc::downgrade(&registry);
        let cache = Cache::builder()
            .time_to_idle(idle)
            .max_capacity(1_000_000)
            .eviction_listener(move |key: Arc<SessionKey>, value: Arc<V>, _cause| {
                let Some(registry) = on_evict.upgrade() else {
                    return;
                };
                let mut registry = lock(&registry);
                // Another value under this key (revived or rebuilt) is not ours to touch.
                let ours = registry
                    .live
                    .get(&*key)
                    .is_some_and(|w| w.as_ptr() == Arc::as_ptr(&value));
                if !ours {
                    return;
                }
                if Arc::strong_count(&value) == 1 {
                    // Only the evicted value itself holds it: nobody can come back for it.
                    registry.live.remove(&*key);
                } else {
                    registry.orphans.push((*key).clone());
                }
            })
            .build();
        LiveSessions { cache, registry }
    }

    /// The live value for `key`: cached, still held elsewhere, or loaded by `load`. The
    /// load runs without any lock held; if another caller put a value under `key`
    /// meanwhile, that one is kept and ours dropped, so there is only ever one.
    pub async fn get_or_load<E, F>(
        &self,
        key: SessionKey,
        load: impl FnOnce() -> F,
    ) -> Result<Arc<V>, E>
    where
        F: Future<Output = Result<V, E>>,
    {
        if let Some(v) = self.cache.get(&key) {
            return Ok(v);
        }
        let held = {
            let mut registry = lock(&self.registry);
            registry.forget_released_orphans();
            registry.live.get(&key).and_then(Weak::upgrade)
        };
        let value = match held {
            Some(v) => v,
            None => {
                let loaded = load().await?;
                let mut registry = lock(&self.registry);
                match registry.live.get(&key).and_then(Weak::upgrade) {
                    Some(v) => v,
                    None => {
                        let v = Arc::new(loaded);
                        registry.live.insert(key.clone(), Arc::downgrade(&v));
                        v
                    }
                }
            }
        };
        // Outside the registry lock: an insert may run moka's maintenance, and with it
        // the eviction listener, which takes that lock.
        self.cache.insert(key, value.clone());
        Ok(value)
    }

    /// Every session in memory now (cached, or idle-evicted but still held), in no
    /// order. The registry's lock is held only while the references are copied.
    pub fn list(&self) -> Vec<(SessionKey, Arc<V>)> {
        let registry = lock(&self.registry);
        registry
            .live
            .iter()
            .filter_map(|(key, weak)| Some((key.clone(), weak.upgrade()?)))
            .collect()
    }

    /// Evicts every session from the cache, as `session_idle` would (moka's idle clock is
    /// its own, not tokio's); held sessions stay reachable through the registry.
    #[cfg(test)]
    pub(crate) fn evict_all(&self) {
        self.cache.invalidate_all();
    }

    /// Runs the cache's pending evictions and drops registry entries nobody holds.
    pub fn sweep(&self) {
        self.cache.run_pending_tasks();
        let mut registry = lock(&self.registry);
        registry.live.retain(|_, w| w.strong_count() > 0);
        registry.orphans.clear();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
