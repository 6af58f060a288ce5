//! The retry budget, adaptive: over a rolling window, retries may add up to
//! `floor + allowance × first attempts`, where the allowance moves between `ratio` and
//! `max_ratio` with how often recent retries *worked*. Retries that succeed (a fault
//! storm of independent failures: a retry wins most of the time) get the generous
//! allowance; retries that fail (an outage: every retry is wasted load) shrink it to
//! `ratio`, so a sustained outage is amplified at most `1 + ratio` times (plus the
//! floor), as with a fixed budget. The floor lets a quiet upstream always retry a
//! lone failure.
//!
//! The success rate is smoothed (one imagined success and one imagined failure), so
//! with no evidence the allowance starts halfway, and one outcome moves it only a
//! little.

use std::time::Duration;

use tokio::time::Instant;

use super::window::RollingPair;

#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    max_ratio: f64,
    floor: u32,
    /// (first attempts, retries granted).
    spent: RollingPair,
    /// (retries that worked, retries that failed).
    outcomes: RollingPair,
}

impl RetryBudget {
    /// `ratio` when retries fail, up to `max_ratio` when they succeed (a `max_ratio`
    /// below `ratio` is taken as `ratio`: a fixed budget).
    pub fn new(ratio: f64, max_ratio: f64, floor: u32, window: Duration, now: Instant) -> Self {
        RetryBudget {
            ratio,
            max_ratio: max_ratio.max(ratio),
            floor,
            spent: RollingPair::new(window, now),
            outcomes: RollingPair::new(window, now),
        }
    }

    /// A reloaded budget's ratios and floor; what was spent carries on, unless the
    /// window's length changed (then `fresh`'s empty windows are taken).
    pub fn reconfigure(&mut self, fresh: RetryBudget) {
        let same_window = self.spent.window() == fresh.spent.window();
        let (spent, outcomes) = (self.spent.clone(), self.outcomes.clone());
        *self = fresh;
        if same_window {
            (self.spent, self.outcomes) = (spent, outcomes);
        }
    }

    /// A first attempt was made: it earns the budget a fraction of a retry.
    pub fn deposit(&mut self, now: Instant) {
        self.spent.add(now, 1.0, 0.0);
    }

    /// The fraction of first attempts retries may add now.
    pub fn allowance(&self, now: Instant) -> f64 {
        let (worked, failed) = self.outcomes.totals(now);
        let success = (worked + 1.0) / (worked + failed + 2.0);
        self.ratio + (self.max_ratio - self.ratio) * success
    }

    /// Takes one retry from the budget if there is one left.
    pub fn withdraw(&mut self, now: Instant) -> bool {
        let (firsts, retries) = self.spent.totals(now);
        if retries + 1.0 > f64::from(self.floor) + self.allowance(now) * firsts {
            return false;
        }
        self.spent.add(now, 0.0, 1.0);
        true
    }

    /// How a granted retry went: an answer (`true`), or another failure.
    pub fn record(&mut self, now: Instant, worked: bool) {
        if worked {
            self.outcomes.add(now, 1.0, 0.0);
        } else {
            self.outcomes.add(now, 0.0, 1.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(ratio: f64, max_ratio: f64, floor: u32, t0: Instant) -> RetryBudget {
        RetryBudget::new(ratio, max_ratio, floor, Duration::from_secs(10), t0)
    }

    #[test]
    fn a_fixed_budget_caps_retries_at_the_ratio_plus_floor_and_the_window_rolls() {
        let t0 = Instant::now();
        let mut b = budget(0.2, 0.2, 2, t0);
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
        let mut b = budget(0.2, 1.0, 3, t0);
        assert_eq!((0..10).filter(|_| b.withdraw(t0)).count(), 3);
    }

    #[test]
    fn retries_that_work_open_the_budget_and_retries_that_fail_close_it() {
        let t0 = Instant::now();
        let mut b = budget(0.2, 1.0, 0, t0);
        assert!((b.allowance(t0) - 0.6).abs() < 1e-9, "no evidence: halfway");
        for _ in 0..98 {
            b.record(t0, true);
        }
        assert!(b.allowance(t0) > 0.98);
        for _ in 0..100 {
            b.deposit(t0);
        }
        assert_eq!((0..1000).filter(|_| b.withdraw(t0)).count(), 99);

        let t1 = t0 + Duration::from_secs(10);
        let mut b = budget(0.2, 1.0, 0, t1);
        for _ in 0..398 {
            b.record(t1, false);
        }
        assert!(b.allowance(t1) < 0.21);
        for _ in 0..100 {
            b.deposit(t1);
        }
        assert_eq!((0..1000).filter(|_| b.withdraw(t1)).count(), 20);
    }

    proptest::proptest! {
        /// Over any sequence, whenever a retry is granted, the retries in the budget's
        /// window do not exceed the floor plus `max_ratio` of its first attempts; and while every retry fails, the
        /// long run stays within `ratio` (plus the floor and what the smoothing leaves).
        #[test]
        fn the_budget_stays_within_its_bounds(
            steps in proptest::collection::vec((0u8..4, 0u64..300), 1..400),
        ) {
            let t0 = Instant::now();
            let window = Duration::from_secs(10);
            let (ratio, max_ratio, floor) = (0.2, 1.0, 5);
            let mut b = RetryBudget::new(ratio, max_ratio, floor, window, t0);
            let mut now = t0;
            // Every event, to check any window's totals from the outside.
            let mut firsts: Vec<Instant> = Vec::new();
            let mut granted: Vec<Instant> = Vec::new();
            for (op, dt) in steps {
                now += Duration::from_millis(dt);
                let granted_now = match op {
                    0 => { b.deposit(now); firsts.push(now); false }
                    1 => b.withdraw(now),
                    2 => { b.record(now, true); false }
                    _ => { b.record(now, false); false }
                };
                if !granted_now {
                    continue;
                }
                granted.push(now);
                // When a retry is granted, the budget's window (the ten buckets ending
                // with the current one) holds no more than it allows.
                let bucket = window / 10;
                let epoch = |t: &Instant| (t.duration_since(t0).as_nanos() / bucket.as_nanos()) as u64;
                let now_epoch = epoch(&now);
                let inside = |t: &&Instant| epoch(t) + 10 > now_epoch;
                let f = firsts.iter().filter(inside).count() as f64;
                let r = granted.iter().filter(inside).count() as f64;
                proptest::prop_assert!(r <= f64::from(floor) + max_ratio * f + 1e-9,
                    "{r} retries for {f} first attempts");
            }
        }

        #[test]
        fn an_outage_is_amplified_at_most_by_the_ratio(
            per_second in 10u32..200,
            seconds in 20u64..120,
        ) {
            let t0 = Instant::now();
            let (ratio, floor) = (0.2, 10);
            let mut b = RetryBudget::new(ratio, 1.0, floor, Duration::from_secs(10), t0);
            let (mut firsts, mut retries) = (0u64, 0u64);
            for s in 0..seconds {
                for i in 0..per_second {
                    let now = t0 + Duration::from_secs(s) + Duration::from_millis(u64::from(i) * 1000 / u64::from(per_second));
                    b.deposit(now);
                    firsts += 1;
                    // Each request wants two retries; every retry fails.
                    for _ in 0..2 {
                        if b.withdraw(now) {
                            retries += 1;
                            b.record(now, false);
                        }
                    }
                }
            }
            // Windows of 10 s: the floor once per window, the ratio of the traffic, and
            // a smoothing term that shrinks as failures accumulate.
            let windows = seconds.div_ceil(10) + 1;
            let ceiling = (ratio + 0.05) * firsts as f64 + (u64::from(floor) * windows) as f64;
            proptest::prop_assert!(retries as f64 <= ceiling,
                "{retries} retries for {firsts} first attempts over {seconds} s");
        }
    }
}
