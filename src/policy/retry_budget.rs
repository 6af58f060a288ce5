//! The retry budget: over a rolling window, retries may add at most `ratio` × first
//! attempts, plus a small floor so a quiet upstream can still be retried. During an
//! outage this caps the load Backstop's own retries add to `1 + ratio` times the traffic.

use std::time::Duration;

use tokio::time::Instant;

const BUCKETS: usize = 10;

#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    floor: u32,
    bucket: Duration,
    origin: Instant,
    /// (epoch, first attempts, retries) per bucket; stale epochs count as empty.
    slots: [(u64, u32, u32); BUCKETS],
}

impl RetryBudget {
    /// A budget over `window`, split in ten buckets.
    pub fn new(ratio: f64, floor: u32, window: Duration, now: Instant) -> Self {
        RetryBudget {
            ratio,
            floor,
            bucket: (window / BUCKETS as u32).max(Duration::from_millis(1)),
            origin: now,
            slots: [(u64::MAX, 0, 0); BUCKETS],
        }
    }

    fn epoch(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.origin).as_nanos() / self.bucket.as_nanos()) as u64
    }

    fn slot(&mut self, now: Instant) -> &mut (u64, u32, u32) {
        let epoch = self.epoch(now);
        let slot = &mut self.slots[(epoch % BUCKETS as u64) as usize];
        if slot.0 != epoch {
            *slot = (epoch, 0, 0);
        }
        slot
    }

    fn totals(&self, now: Instant) -> (u32, u32) {
        let epoch = self.epoch(now);
        self.slots
            .iter()
            .filter(|(e, _, _)| *e <= epoch && epoch - *e < BUCKETS as u64)
            .fold((0, 0), |(f, r), (_, fs, rs)| (f + fs, r + rs))
    }

    /// A first attempt was made: it deposits `ratio` of a retry.
    pub fn deposit(&mut self, now: Instant) {
        self.slot(now).1 += 1;
    }

    /// Takes one retry from the budget if there is one left.
    pub fn withdraw(&mut self, now: Instant) -> bool {
        let (firsts, retries) = self.totals(now);
        let allowed = f64::from(self.floor) + self.ratio * f64::from(firsts);
        if f64::from(retries) + 1.0 > allowed {
            return false;
        }
        self.slot(now).2 += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_are_capped_at_the_ratio_plus_floor_and_the_window_rolls() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.2, 2, Duration::from_secs(10), t0);
        for _ in 0..100 {
            b.deposit(t0);
        }
        let granted = (0..1000).filter(|_| b.withdraw(t0)).count();
        assert_eq!(granted, 22, "floor 2 + 20% of 100");
        // Ten seconds later the window has rolled over: only the floor is left.
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!((0..1000).filter(|_| b.withdraw(t1)).count(), 2);
    }

    #[test]
    fn a_quiet_upstream_still_gets_the_floor() {
        let t0 = Instant::now();
        let mut b = RetryBudget::new(0.2, 3, Duration::from_secs(10), t0);
        assert_eq!((0..10).filter(|_| b.withdraw(t0)).count(), 3);
    }
}
