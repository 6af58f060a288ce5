//! The retry budget: over a rolling window, retries may add at most `ratio` × first
//! attempts, plus a small floor so a quiet upstream can still be retried. During an
//! outage this caps the load Backstop's own retries add to `1 + ratio` times the traffic.

use std::time::Duration;

use tokio::time::Instant;

use super::window::RollingPair;

#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    floor: u32,
    /// (first attempts, retries).
    window: RollingPair,
}

impl RetryBudget {
    pub fn new(ratio: f64, floor: u32, window: Duration, now: Instant) -> Self {
        RetryBudget {
            ratio,
            floor,
            window: RollingPair::new(window, now),
        }
    }

    /// A first attempt was made: it deposits `ratio` of a retry.
    pub fn deposit(&mut self, now: Instant) {
        self.window.add(now, 1.0, 0.0);
    }

    /// Takes one retry from the budget if there is one left.
    pub fn withdraw(&mut self, now: Instant) -> bool {
        let (firsts, retries) = self.window.totals(now);
        if retries + 1.0 > f64::from(self.floor) + self.ratio * firsts {
            return false;
        }
        self.window.add(now, 0.0, 1.0);
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
