//! A rolling window of two counters, in ten buckets, with the clock passed in. Shared by
//! the retry budget (first attempts, retries) and the breaker (attempts, failures).

use std::time::Duration;

use tokio::time::Instant;

const BUCKETS: usize = 10;

#[derive(Debug, Clone)]
pub struct RollingPair {
    bucket: Duration,
    origin: Instant,
    /// (epoch, a, b) per bucket; a bucket from an older epoch counts as empty.
    slots: [(u64, f64, f64); BUCKETS],
}

impl RollingPair {
    pub fn new(window: Duration, now: Instant) -> Self {
        RollingPair {
            bucket: (window / BUCKETS as u32).max(Duration::from_millis(1)),
            origin: now,
            slots: [(u64::MAX, 0.0, 0.0); BUCKETS],
        }
    }

    fn epoch(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.origin).as_nanos() / self.bucket.as_nanos()) as u64
    }

    /// Adds to the current bucket.
    /// The window's length (as bucketed).
    pub fn window(&self) -> Duration {
        self.bucket * BUCKETS as u32
    }

    pub fn add(&mut self, now: Instant, a: f64, b: f64) {
        let epoch = self.epoch(now);
        let slot = &mut self.slots[(epoch % BUCKETS as u64) as usize];
        if slot.0 != epoch {
            *slot = (epoch, 0.0, 0.0);
        }
        slot.1 += a;
        slot.2 += b;
    }

    /// Both sums over the window ending now.
    pub fn totals(&self, now: Instant) -> (f64, f64) {
        let epoch = self.epoch(now);
        self.slots
            .iter()
            .filter(|(e, _, _)| *e <= epoch && epoch - *e < BUCKETS as u64)
            .fold((0.0, 0.0), |(a, b), (_, sa, sb)| (a + sa, b + sb))
    }

    pub fn clear(&mut self) {
        self.slots = [(u64::MAX, 0.0, 0.0); BUCKETS];
    }
}
