//! Per-session live values that idle out of memory but are never rebuilt while held.
//! One map holds each session's budget book ([`SessionBook`], kept by [`super::budgets`])
//! and guard ([`GuardedSession`], kept by [`super::sessions`]) together, in one
//! [`Session`]: the records are here, below the logic that keeps them.

mod book;
mod guard;

use std::{
    collections::HashMap,
    future::Future,
    hash::{BuildHasher, RandomState},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, MutexGuard, OnceLock,
    },
    time::Duration,
};

use tokio::time::Instant;

use crate::clock::Clock;

pub use book::SessionBook;
pub use guard::{Change, GuardedSession, TraceEntry, TraceId};

/// (tenant, session).
pub type SessionKey = (Arc<str>, String);

/// Everything this process keeps live about one session, under one map entry: its budget
/// book and, for a guarded tenant, its guard, each loaded on first use (a load that fails
/// leaves its part empty, to be read again next time). Whatever holds either part holds
/// the whole session in memory.
#[derive(Default)]
pub struct Session {
    pub(super) book: OnceLock<SessionBook>,
    pub(super) guard: OnceLock<Mutex<GuardedSession>>,
}

/// Shards of the map: a lookup locks one, so concurrent sessions rarely wait for each
/// other, and a sweep holds one at a time.
const SHARDS: usize = 16;

/// Per-session live state that idles out of memory, except while something still holds
/// it: a session unused for the idle time and held by nobody else (no call, reservation
/// or in-flight slot) is dropped by the next sweep; one still held stays, so it is never
/// rebuilt and its reservations and concurrency count are not lost.
///
/// One map entry a session (the key, the value and when it was last used), not a cache
/// beside a registry: with 100,000 live sessions that difference is tens of megabytes.
/// Sweeps run when [`LiveSessions::sweep`] is called and, between those, on a miss once
/// a quarter of the idle time (at most a minute) has passed since the last.
pub struct LiveSessions<V> {
    inner: Arc<Inner<V>>,
}

/// A handle on the same sessions (a reloaded config's books share them).
impl<V> Clone for LiveSessions<V> {
    fn clone(&self) -> Self {
        LiveSessions {
            inner: self.inner.clone(),
        }
    }
}

/// One shard of the map.
type Shard<V> = Mutex<HashMap<SessionKey, Slot<V>>>;

struct Inner<V> {
    shards: Box<[Shard<V>]>,
    hasher: RandomState,
    idle: Duration,
    /// The process's clock (tokio time: a paused test clock moves the idle time too).
    clock: Clock,
    /// What `used` and `swept` count from.
    epoch: Instant,
    /// Milliseconds since `epoch` at the last sweep.
    swept: AtomicU64,
}

struct Slot<V> {
    value: Arc<V>,
    /// Milliseconds since `epoch` at the last lookup.
    used: u64,
}

impl<V: Send + Sync + 'static> LiveSessions<V> {
    pub fn new(idle: Duration, clock: &Clock) -> Self {
        LiveSessions {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                idle,
                clock: clock.clone(),
                epoch: clock.now(),
                swept: AtomicU64::new(0),
            }),
        }
    }

    fn now_ms(&self) -> u64 {
        let since = self
            .inner
            .clock
            .now()
            .saturating_duration_since(self.inner.epoch);
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    }

    fn shard(&self, key: &SessionKey) -> MutexGuard<'_, HashMap<SessionKey, Slot<V>>> {
        let at = self.inner.hasher.hash_one(key) as usize % SHARDS;
        lock(&self.inner.shards[at])
    }

    /// The live value for `key`: in memory (held or not), or loaded by `load`. The load
    /// runs without any lock held; if another caller put a value under `key` meanwhile,
    /// that one is kept and ours dropped, so there is only ever one.
    pub async fn get_or_load<E, F>(
        &self,
        key: SessionKey,
        load: impl FnOnce() -> F,
    ) -> Result<Arc<V>, E>
    where
        F: Future<Output = Result<V, E>>,
    {
        let now = self.now_ms();
        if let Some(slot) = self.shard(&key).get_mut(&key) {
            slot.used = now;
            return Ok(slot.value.clone());
        }
        self.sweep_if_due(now);
        let loaded = load().await?;
        let now = self.now_ms();
        let mut shard = self.shard(&key);
        let slot = shard.entry(key).or_insert_with(|| Slot {
            value: Arc::new(loaded),
            used: now,
        });
        slot.used = now;
        Ok(slot.value.clone())
    }

    /// Every session in memory now, in no order. Each shard's lock is held only while
    /// its references are copied.
    pub fn list(&self) -> Vec<(SessionKey, Arc<V>)> {
        let mut all = Vec::new();
        for shard in self.inner.shards.iter() {
            all.extend(
                lock(shard)
                    .iter()
                    .map(|(key, slot)| (key.clone(), slot.value.clone())),
            );
        }
        all
    }

    /// Drops every session nobody holds, as `session_idle` would once it passed; held
    /// sessions stay.
    #[cfg(test)]
    pub(crate) fn evict_all(&self) {
        self.evict(|_| true);
    }

    /// Drops the sessions idle for `session_idle` that nobody holds.
    pub fn sweep(&self) {
        let now = self.now_ms();
        self.inner.swept.store(now, Ordering::Relaxed);
        let idle = u64::try_from(self.inner.idle.as_millis()).unwrap_or(u64::MAX);
        self.evict(|used| now.saturating_sub(used) >= idle);
    }

    /// A sweep on a miss, when a quarter of the idle time (at most a minute) has passed
    /// since the last: new sessions then make room for themselves even where nothing
    /// calls [`LiveSessions::sweep`].
    fn sweep_if_due(&self, now: u64) {
        let every = u64::try_from(
            (self.inner.idle / 4)
                .min(Duration::from_secs(60))
                .as_millis(),
        )
        .unwrap_or(u64::MAX);
        let last = self.inner.swept.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= every
            && self
                .inner
                .swept
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.sweep();
        }
    }

    fn evict(&self, idle: impl Fn(u64) -> bool) {
        for shard in self.inner.shards.iter() {
            let mut map = lock(shard);
            map.retain(|_, slot| Arc::strong_count(&slot.value) > 1 || !idle(slot.used));
            // Give back what a burst of sessions left behind.
            if map.capacity() > 64 && map.capacity() > map.len() * 4 {
                map.shrink_to_fit();
            }
        }
    }

    /// How many sessions are in memory now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.shards.iter().map(|s| lock(s).len()).sum()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(session: &str) -> SessionKey {
        ("t".into(), session.to_string())
    }

    async fn get(live: &LiveSessions<u32>, session: &str, loaded: u32) -> Arc<u32> {
        live.get_or_load(key(session), || async { Ok::<_, ()>(loaded) })
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_session_in_memory_is_not_loaded_again() {
        let live = LiveSessions::new(Duration::from_secs(3600), &Clock::system());
        assert_eq!(*get(&live, "s", 1).await, 1);
        assert_eq!(*get(&live, "s", 2).await, 1, "the first value is kept");
        live.sweep();
        assert_eq!(*get(&live, "s", 3).await, 1, "not idle yet");
        assert_eq!(live.list().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_time_runs_on_the_injected_clock() {
        let live = LiveSessions::new(Duration::from_secs(60), &Clock::system());
        drop(get(&live, "s", 1).await);
        tokio::time::advance(Duration::from_secs(59)).await;
        live.sweep();
        assert_eq!(
            *get(&live, "s", 2).await,
            1,
            "not idle yet (and used again now)"
        );
        tokio::time::advance(Duration::from_secs(59)).await;
        live.sweep();
        assert_eq!(
            *get(&live, "s", 3).await,
            1,
            "its use restarted the idle time"
        );
        tokio::time::advance(Duration::from_secs(60)).await;
        live.sweep();
        assert_eq!(*get(&live, "s", 4).await, 4, "idled out, so loaded again");
    }

    #[tokio::test]
    async fn an_idle_session_nobody_holds_is_dropped_and_a_held_one_kept() {
        // Idle at once: every session is past its idle time at the next sweep.
        let live = LiveSessions::new(Duration::ZERO, &Clock::system());
        let held = get(&live, "held", 1).await;
        drop(get(&live, "free", 1).await);
        live.sweep();
        assert_eq!(live.len(), 1);
        assert_eq!(*get(&live, "free", 2).await, 2, "loaded again");
        let again = get(&live, "held", 2).await;
        assert!(
            Arc::ptr_eq(&held, &again),
            "a held session is never rebuilt"
        );
    }

    #[tokio::test]
    async fn a_miss_sweeps_when_it_is_due_without_being_asked() {
        let live = LiveSessions::new(Duration::ZERO, &Clock::system());
        for i in 0..100 {
            drop(get(&live, &format!("s{i}"), 1).await);
        }
        // Each miss swept the sessions before it: only the last is left.
        assert_eq!(live.len(), 1);
        let live = LiveSessions::new(Duration::from_secs(3600), &Clock::system());
        for i in 0..100 {
            drop(get(&live, &format!("s{i}"), 1).await);
        }
        assert_eq!(live.len(), 100, "none idle");
    }

    #[tokio::test]
    async fn evict_all_keeps_what_is_held() {
        let live = LiveSessions::new(Duration::from_secs(3600), &Clock::system());
        let held = get(&live, "held", 1).await;
        drop(get(&live, "free", 1).await);
        live.evict_all();
        assert_eq!(live.list().len(), 1);
        assert!(Arc::ptr_eq(&held, &get(&live, "held", 2).await));
    }

    #[tokio::test]
    async fn a_failed_load_leaves_nothing_behind() {
        let live: LiveSessions<u32> =
            LiveSessions::new(Duration::from_secs(3600), &Clock::system());
        let failed = live
            .get_or_load(key("s"), || async { Err::<u32, _>("unreadable") })
            .await;
        assert_eq!(failed, Err("unreadable"));
        assert_eq!(live.len(), 0);
        assert_eq!(*get(&live, "s", 7).await, 7);
    }
}
