//! A credential that expires (AWS session credentials, an OAuth access token), fetched
//! once and shared by every call, refreshed *before* it expires.
//!
//! - Fresh: every call reads the cached value, no lock held across an await.
//! - Due (inside the refresh margin, still valid): the first call to see it refreshes
//!   while every concurrent call goes on with the still-valid value: nobody stalls. A
//!   failed refresh keeps the old value until it expires, and the next call tries again.
//! - Missing or expired: calls wait for one fetch (single flight); an expired value is
//!   never handed out.
//!
//! Times are tokio [`Instant`]s, so a paused clock drives the tests.

use std::{future::Future, sync::RwLock, time::Duration};

use tokio::time::Instant;

/// Refresh this long before the value expires (at most half its lifetime).
const REFRESH_MARGIN: Duration = Duration::from_secs(300);
/// Stop handing out a value this long before it expires (at most a tenth of its
/// lifetime), so one that is sent is still valid when it arrives.
const EXPIRY_SKEW: Duration = Duration::from_secs(10);

struct Cached<T> {
    value: T,
    refresh_at: Option<Instant>,
    expires_at: Option<Instant>,
}

/// The cache of one credential.
pub(crate) struct Refreshing<T> {
    current: RwLock<Option<Cached<T>>>,
    /// Held by the one call fetching.
    fetching: tokio::sync::Mutex<()>,
}

impl<T> Default for Refreshing<T> {
    fn default() -> Self {
        Refreshing {
            current: RwLock::new(None),
            fetching: tokio::sync::Mutex::new(()),
        }
    }
}

/// Whether a cached value may be used now, and whether it is time to refresh it.
enum State<T> {
    Fresh(T),
    Due(T),
    Missing,
}

impl<T: Clone> Refreshing<T> {
    fn state(&self, now: Instant) -> State<T> {
        let current = self.current.read().unwrap_or_else(|e| e.into_inner());
        match &*current {
            Some(c) if c.expires_at.is_some_and(|at| now >= at) => State::Missing,
            Some(c) if c.refresh_at.is_some_and(|at| now >= at) => State::Due(c.value.clone()),
            Some(c) => State::Fresh(c.value.clone()),
            None => State::Missing,
        }
    }

    /// The credential, fetched with `fetch` when there is none or it is due. `fetch`
    /// answers the value and how long it lives (`None`: until the process ends).
    pub(crate) async fn get<F, Fut, E>(&self, fetch: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(T, Option<Duration>), E>>,
    {
        match self.state(Instant::now()) {
            State::Fresh(value) => Ok(value),
            State::Due(value) => {
                // Someone else is refreshing: the old value is still good.
                let Ok(_guard) = self.fetching.try_lock() else {
                    return Ok(value);
                };
                match fetch().await {
                    Ok((fresh, lifetime)) => Ok(self.store(fresh, lifetime)),
                    Err(_) => Ok(value),
                }
            }
            State::Missing => {
                let _guard = self.fetching.lock().await;
                // Fetched while this call waited.
                if let State::Fresh(value) | State::Due(value) = self.state(Instant::now()) {
                    return Ok(value);
                }
                let (fresh, lifetime) = fetch().await?;
                Ok(self.store(fresh, lifetime))
            }
        }
    }

    fn store(&self, value: T, lifetime: Option<Duration>) -> T {
        let now = Instant::now();
        let (refresh_at, expires_at) = match lifetime {
            Some(life) => (
                Some(now + life - REFRESH_MARGIN.min(life / 2)),
                Some(now + life - EXPIRY_SKEW.min(life / 10)),
            ),
            None => (None, None),
        };
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(Cached {
            value: value.clone(),
            refresh_at,
            expires_at,
        });
        value
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicU32, Ordering},
        Arc,
    };

    use super::*;

    /// A fetcher that counts its calls, takes `delay`, and answers the call's number
    /// living an hour (or fails, when `fail` is set).
    struct Issuer {
        calls: AtomicU32,
        delay: Duration,
        fail: std::sync::atomic::AtomicBool,
    }

    impl Issuer {
        fn new(delay: Duration) -> Arc<Issuer> {
            Arc::new(Issuer {
                calls: AtomicU32::new(0),
                delay,
                fail: false.into(),
            })
        }

        async fn fetch(self: Arc<Self>) -> Result<(u32, Option<Duration>), &'static str> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(self.delay).await;
            if self.fail.load(Ordering::SeqCst) {
                return Err("refused");
            }
            Ok((n, Some(Duration::from_secs(3600))))
        }

        fn calls(&self) -> u32 {
            self.calls.load(Ordering::SeqCst)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ten_calls_one_fetch_and_a_refresh_before_expiry_that_stalls_nobody() {
        let cache = Arc::new(Refreshing::<u32>::default());
        let issuer = Issuer::new(Duration::from_secs(2));
        for _ in 0..10 {
            assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(1));
        }
        assert_eq!(issuer.calls(), 1);

        // Five minutes before expiry the value is due: the first call refreshes (it takes
        // two seconds) while a concurrent call gets the old, still valid, value at once.
        tokio::time::advance(Duration::from_secs(3300)).await;
        let refresher = tokio::spawn({
            let (cache, issuer) = (cache.clone(), issuer.clone());
            async move { cache.get(|| issuer.fetch()).await }
        });
        while issuer.calls() < 2 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(1));
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "a concurrent call stalled"
        );
        assert_eq!(refresher.await.unwrap(), Ok(2));
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(2));
        assert_eq!(issuer.calls(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_value_is_never_handed_out() {
        let cache = Refreshing::<u32>::default();
        let issuer = Issuer::new(Duration::ZERO);
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(1));
        // Due, and the refresh fails: the old value is kept while it is valid...
        issuer.fail.store(true, Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(3400)).await;
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(1));
        // ...and not once it is within the skew of its expiry: the caller gets the error.
        tokio::time::advance(Duration::from_secs(191)).await;
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Err("refused"));
        issuer.fail.store(false, Ordering::SeqCst);
        assert_eq!(cache.get(|| issuer.clone().fetch()).await, Ok(4));
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_first_calls_share_one_fetch() {
        let cache = Arc::new(Refreshing::<u32>::default());
        let issuer = Issuer::new(Duration::from_secs(1));
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (cache, issuer) = (cache.clone(), issuer.clone());
                tokio::spawn(async move { cache.get(|| issuer.fetch()).await })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap(), Ok(1));
        }
        assert_eq!(issuer.calls(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_value_without_a_lifetime_is_fetched_once() {
        let cache = Refreshing::<&str>::default();
        let fetches = AtomicU32::new(0);
        for _ in 0..3 {
            let got = cache
                .get(|| async {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, ()>(("static", None))
                })
                .await;
            assert_eq!(got, Ok("static"));
            tokio::time::advance(Duration::from_secs(86_400 * 365)).await;
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
    }
}
