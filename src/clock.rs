//! The one injected clock (of the live state and the store). Durations (cool-downs, rate limits, idle times) are
//! tokio [`Instant`]s; calendar things (the UTC day of a tenant's budget, ledger
//! timestamps, when a kept trip ends) are wall-clock milliseconds derived from a
//! [`SystemTime`] read once, at start, plus tokio's elapsed time. So a paused tokio clock
//! (`#[tokio::test(start_paused = true)]` + `tokio::time::advance`) moves the calendar
//! too, and a test can cross midnight without waiting for it.
//!
//! The wall clock does not follow later changes to the system clock (an NTP step): the
//! process keeps the calendar it started with, advanced at the monotonic rate.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tokio::time::Instant;

const DAY_MS: i64 = 86_400_000;

#[derive(Clone, Debug)]
pub struct Clock {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    origin: Instant,
    /// Wall clock at `origin`, in ms since the Unix epoch.
    wall_at_origin_ms: i64,
    /// How far [`Clock::skip`] has moved this clock ahead of tokio's, in ns.
    skipped_ns: AtomicU64,
}

impl Clock {
    /// The system's calendar as of now, advancing with tokio time.
    pub fn system() -> Clock {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Clock::starting_at(wall)
    }

    /// A clock whose calendar reads `wall_ms` (ms since the Unix epoch) now.
    pub fn starting_at(wall_ms: i64) -> Clock {
        Clock {
            inner: Arc::new(Inner {
                origin: Instant::now(),
                wall_at_origin_ms: wall_ms,
                skipped_ns: AtomicU64::new(0),
            }),
        }
    }

    /// Now, for durations.
    pub fn now(&self) -> Instant {
        Instant::now() + self.skipped()
    }

    /// Time since this clock started (governor's instant).
    pub fn elapsed(&self) -> Duration {
        self.now().saturating_duration_since(self.inner.origin)
    }

    /// Now on the calendar: ms since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        let elapsed = i64::try_from(self.elapsed().as_millis()).unwrap_or(i64::MAX);
        self.inner.wall_at_origin_ms.saturating_add(elapsed)
    }

    /// Today as days since the Unix epoch (UTC): the tenant budget window.
    pub fn today(&self) -> i64 {
        self.now_ms().div_euclid(DAY_MS)
    }

    /// Moves this clock (and every clone of it) `by` ahead of tokio's. For tests that
    /// cannot pause tokio's clock, because real sockets and the store's threads run
    /// beside it: the state under test sees the time pass, tokio's timers do not.
    pub fn skip(&self, by: Duration) {
        let ns = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.inner.skipped_ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn skipped(&self) -> Duration {
        Duration::from_nanos(self.inner.skipped_ns.load(Ordering::Relaxed))
    }
}

/// Governor's clock, so the rate limits run on the same time as everything else.
impl governor::clock::Clock for Clock {
    type Instant = Duration;
    fn now(&self) -> Duration {
        self.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_calendar_advances_with_tokio_time() {
        let clock = Clock::starting_at(3 * DAY_MS - 1);
        assert_eq!(clock.today(), 2);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!((clock.now_ms(), clock.today()), (3 * DAY_MS, 3));
        let before = clock.now();
        clock.clone().skip(Duration::from_secs(5));
        assert_eq!(clock.now() - before, Duration::from_secs(5));
        assert_eq!(clock.now_ms(), 3 * DAY_MS + 5000);
    }
}
