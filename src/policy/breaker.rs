//! The per-upstream circuit breaker: closed → open → half-open → closed (or back to
//! open). Fed only by failures that are the upstream's fault; the caller's own faults and
//! malformed answers are neutral, so one tenant's bad requests cannot cut everyone off.
//!
//! It opens on `failure_threshold` consecutive failures *while* the failure rate over
//! the recent window is at least `failure_rate`. The second condition is there because
//! consecutive counting alone, shared by concurrent requests, trips on a flaky upstream:
//! at a 40% failure rate five failures in a row come up within a few hundred attempts,
//! and an open breaker then refuses the 60% that would have succeeded for `open_for`.
//! A hard-down upstream still opens after exactly `failure_threshold` failures when
//! nothing succeeded recently.
//!
//! How long it stays open grows with the evidence: the first opening lasts `open_min`
//! (1 s), each failed half-open probe doubles it up to `open_for` (30 s), and a
//! successful probe starts it over. An unlucky run of failures on a healthy upstream (a
//! false alarm) then costs about a second; a hard-down upstream is probed at 1, 3, 7,
//! 15, 31 s and every `open_for` after that: five probes in its first minute.

use std::time::Duration;

use tokio::time::Instant;

use super::window::RollingPair;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerPolicy {
    /// Consecutive upstream-fault failures (429s count half) that open it.
    pub failure_threshold: u32,
    /// The first opening's length; each failed probe doubles it...
    pub open_min: Duration,
    /// ...up to this.
    pub open_for: Duration,
    /// Requests admitted at once while half-open.
    pub half_open_probes: u32,
    /// Share of weighted failures among attempts in `window` needed to open (0 = off).
    pub failure_rate: f64,
    pub window: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BreakerState {
    Closed { failures: f64 },
    Open { until: Instant },
    HalfOpen { probes: u32 },
}

/// How a request got in: normally, or as one of the half-open probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Normal,
    Probe,
}

/// What an attempt says about the upstream's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Healthy,
    /// An upstream fault, weighted (1.0, or less for rate limits).
    Failed(f64),
    /// Credentials or quota refused: open at once.
    Fatal,
    /// Says nothing about the upstream (caller fault, malformed output).
    Neutral,
    /// A probe whose request was dropped before it finished.
    Abandoned,
}

/// A state change, for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Opened,
    HalfOpened,
    Closed,
}

#[derive(Debug)]
pub struct Breaker {
    config: BreakerPolicy,
    state: BreakerState,
    /// (attempts, weighted failures) over `config.window`, while closed.
    recent: RollingPair,
    /// The same attempts over the same window, for outlier demotion, which starts it
    /// over when it readmits the upstream. Its own: started over, the breaker's would
    /// judge the failure rate on the handful of attempts since, and open on a run of
    /// five (it did, in a storm whose rate was 35%).
    judged: RollingPair,
    /// Half-open probes failed in a row since it last closed: the next opening lasts
    /// `open_min` doubled this many times, at most `open_for`.
    failed_probes: u32,
}

impl Breaker {
    pub fn new(config: BreakerPolicy, now: Instant) -> Self {
        Breaker {
            config,
            state: BreakerState::Closed { failures: 0.0 },
            recent: RollingPair::new(config.window, now),
            judged: RollingPair::new(config.window, now),
            failed_probes: 0,
        }
    }

    /// How long the next opening lasts.
    fn open_period(&self) -> Duration {
        let doubled = self
            .config
            .open_min
            .saturating_mul(1 << self.failed_probes.min(31));
        doubled.min(self.config.open_for)
    }

    /// A reloaded policy: the state carries on; the failure-rate window starts over
    /// only if its length changed.
    pub fn reconfigure(&mut self, config: BreakerPolicy, now: Instant) {
        if config.window != self.config.window {
            self.recent = RollingPair::new(config.window, now);
            self.judged = RollingPair::new(config.window, now);
        }
        self.config = config;
    }

    fn failing_enough(&self, now: Instant) -> bool {
        let (attempts, failures) = self.recent.totals(now);
        attempts > 0.0 && failures / attempts >= self.config.failure_rate
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// 0 closed, 1 open, 2 half-open (the metrics gauge).
    pub fn gauge(&self) -> f64 {
        match self.state {
            BreakerState::Closed { .. } => 0.0,
            BreakerState::Open { .. } => 1.0,
            BreakerState::HalfOpen { .. } => 2.0,
        }
    }

    /// Recent (attempts, weighted failures) over the window, for outlier demotion.
    pub fn recent(&self, now: Instant) -> (f64, f64) {
        self.judged.totals(now)
    }

    /// Starts outlier demotion's window over (an outlier readmitted on new evidence
    /// only); the breaker's own window is untouched.
    pub fn forget_recent(&mut self) {
        self.judged.clear();
    }

    /// Admits a request, or says how long until it could be.
    pub fn admit(&mut self, now: Instant) -> (Result<Admission, Duration>, Option<Transition>) {
        match self.state {
            BreakerState::Closed { .. } => (Ok(Admission::Normal), None),
            BreakerState::Open { until } if now < until => (Err(until - now), None),
            BreakerState::Open { .. } => {
                self.state = BreakerState::HalfOpen { probes: 1 };
                (Ok(Admission::Probe), Some(Transition::HalfOpened))
            }
            BreakerState::HalfOpen { probes } if probes < self.config.half_open_probes => {
                self.state = BreakerState::HalfOpen { probes: probes + 1 };
                (Ok(Admission::Probe), None)
            }
            // Probes are out; the next verdict comes soon, so ask for a short wait.
            BreakerState::HalfOpen { .. } => (Err(Duration::from_secs(1)), None),
        }
    }

    /// Records an attempt's verdict.
    pub fn record(
        &mut self,
        admission: Admission,
        verdict: Verdict,
        now: Instant,
    ) -> Option<Transition> {
        let open = BreakerState::Open {
            until: now + self.open_period(),
        };
        match (self.state, admission, verdict) {
            (BreakerState::Closed { .. }, _, Verdict::Healthy) => {
                self.recent.add(now, 1.0, 0.0);
                self.judged.add(now, 1.0, 0.0);
                self.state = BreakerState::Closed { failures: 0.0 };
                None
            }
            (BreakerState::Closed { failures }, _, Verdict::Failed(weight)) => {
                self.recent.add(now, 1.0, weight);
                self.judged.add(now, 1.0, weight);
                let failures = failures + weight;
                if failures >= f64::from(self.config.failure_threshold) && self.failing_enough(now)
                {
                    self.recent.clear();
                    self.judged.clear();
                    self.state = open;
                    Some(Transition::Opened)
                } else {
                    self.state = BreakerState::Closed { failures };
                    None
                }
            }
            (BreakerState::Closed { .. }, _, Verdict::Fatal) => {
                self.recent.clear();
                self.judged.clear();
                self.state = open;
                Some(Transition::Opened)
            }
            (
                BreakerState::HalfOpen { .. },
                Admission::Probe,
                Verdict::Healthy | Verdict::Neutral,
            ) => {
                self.failed_probes = 0;
                self.state = BreakerState::Closed { failures: 0.0 };
                Some(Transition::Closed)
            }
            (
                BreakerState::HalfOpen { .. },
                Admission::Probe,
                Verdict::Failed(_) | Verdict::Fatal,
            ) => {
                self.failed_probes = self.failed_probes.saturating_add(1);
                self.state = BreakerState::Open {
                    until: now + self.open_period(),
                };
                Some(Transition::Opened)
            }
            (BreakerState::HalfOpen { probes }, Admission::Probe, Verdict::Abandoned) => {
                self.state = BreakerState::HalfOpen {
                    probes: probes.saturating_sub(1),
                };
                None
            }
            // Late verdicts from requests admitted before the state changed, and neutral
            // verdicts while closed, leave the state as it is.
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> BreakerPolicy {
        BreakerPolicy {
            failure_threshold: 3,
            open_min: Duration::from_secs(30),
            open_for: Duration::from_secs(30),
            half_open_probes: 1,
            failure_rate: 0.5,
            window: Duration::from_secs(10),
        }
    }

    fn breaker() -> Breaker {
        Breaker::new(config(), Instant::now())
    }

    #[test]
    fn a_flaky_upstream_stays_closed_but_a_failing_one_opens() {
        let t0 = Instant::now();
        let mut b = breaker();
        // 60% success: seven successes, then three failures in a row.
        for _ in 0..7 {
            b.record(Admission::Normal, Verdict::Healthy, t0);
        }
        for _ in 0..3 {
            assert_eq!(b.record(Admission::Normal, Verdict::Failed(1.0), t0), None);
        }
        // Two more failures: 5 of 12 recent attempts failed, still under half.
        assert_eq!(b.record(Admission::Normal, Verdict::Failed(1.0), t0), None);
        assert_eq!(b.record(Admission::Normal, Verdict::Failed(1.0), t0), None);
        // Once failures are the majority of the window, it opens.
        assert_eq!(b.record(Admission::Normal, Verdict::Failed(1.0), t0), None);
        assert_eq!(
            b.record(Admission::Normal, Verdict::Failed(1.0), t0),
            Some(Transition::Opened)
        );
        // And once the old successes have left the window, three in a row are enough.
        let mut b = breaker();
        for _ in 0..7 {
            b.record(Admission::Normal, Verdict::Healthy, t0);
        }
        let later = t0 + Duration::from_secs(11);
        for _ in 0..2 {
            assert_eq!(
                b.record(Admission::Normal, Verdict::Failed(1.0), later),
                None
            );
        }
        assert_eq!(
            b.record(Admission::Normal, Verdict::Failed(1.0), later),
            Some(Transition::Opened)
        );
    }

    #[test]
    fn a_zero_failure_rate_means_consecutive_failures_alone() {
        let t0 = Instant::now();
        let mut b = Breaker::new(
            BreakerPolicy {
                failure_rate: 0.0,
                ..config()
            },
            t0,
        );
        for _ in 0..50 {
            b.record(Admission::Normal, Verdict::Healthy, t0);
        }
        b.record(Admission::Normal, Verdict::Failed(1.0), t0);
        b.record(Admission::Normal, Verdict::Failed(1.0), t0);
        assert_eq!(
            b.record(Admission::Normal, Verdict::Failed(1.0), t0),
            Some(Transition::Opened)
        );
    }

    #[test]
    fn lifecycle_closed_open_half_open_closed() {
        let t0 = Instant::now();
        let mut b = breaker();
        for _ in 0..2 {
            assert_eq!(b.record(Admission::Normal, Verdict::Failed(1.0), t0), None);
        }
        assert_eq!(
            b.record(Admission::Normal, Verdict::Failed(1.0), t0),
            Some(Transition::Opened)
        );
        assert_eq!(
            b.admit(t0 + Duration::from_secs(10)).0,
            Err(Duration::from_secs(20))
        );
        let (admitted, transition) = b.admit(t0 + Duration::from_secs(30));
        assert_eq!(
            (admitted, transition),
            (Ok(Admission::Probe), Some(Transition::HalfOpened))
        );
        // One probe at a time.
        assert!(b.admit(t0 + Duration::from_secs(30)).0.is_err());
        assert_eq!(
            b.record(Admission::Probe, Verdict::Healthy, t0),
            Some(Transition::Closed)
        );
        assert_eq!(b.admit(t0).0, Ok(Admission::Normal));
    }

    #[test]
    fn a_failed_probe_reopens_for_a_full_period() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record(Admission::Normal, Verdict::Fatal, t0);
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(b.admit(t1).0, Ok(Admission::Probe));
        assert_eq!(
            b.record(Admission::Probe, Verdict::Failed(1.0), t1),
            Some(Transition::Opened)
        );
        assert_eq!(
            b.admit(t1 + Duration::from_secs(29)).0,
            Err(Duration::from_secs(1))
        );
    }

    #[test]
    fn caller_faults_neither_count_nor_reset_and_successes_reset() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record(Admission::Normal, Verdict::Failed(1.0), t0);
        b.record(Admission::Normal, Verdict::Failed(1.0), t0);
        for _ in 0..100 {
            assert_eq!(b.record(Admission::Normal, Verdict::Neutral, t0), None);
        }
        assert_eq!(b.state(), BreakerState::Closed { failures: 2.0 });
        b.record(Admission::Normal, Verdict::Healthy, t0);
        assert_eq!(b.state(), BreakerState::Closed { failures: 0.0 });
    }

    #[test]
    fn rate_limits_count_lightly() {
        let t0 = Instant::now();
        let mut b = breaker();
        for _ in 0..5 {
            assert_eq!(b.record(Admission::Normal, Verdict::Failed(0.5), t0), None);
        }
        assert_eq!(
            b.record(Admission::Normal, Verdict::Failed(0.5), t0),
            Some(Transition::Opened)
        );
    }

    #[test]
    fn an_abandoned_probe_frees_its_slot() {
        let t0 = Instant::now();
        let mut b = breaker();
        b.record(Admission::Normal, Verdict::Fatal, t0);
        let t1 = t0 + Duration::from_secs(31);
        assert_eq!(b.admit(t1).0, Ok(Admission::Probe));
        b.record(Admission::Probe, Verdict::Abandoned, t1);
        assert_eq!(b.admit(t1).0, Ok(Admission::Probe));
    }

    /// The default growth: 1 s first, doubled by each failed probe, at most 30 s.
    fn growing() -> Breaker {
        Breaker::new(
            BreakerPolicy {
                open_min: Duration::from_secs(1),
                ..config()
            },
            Instant::now(),
        )
    }

    /// Opens it (credentials refused) at `t0` and returns how long each opening lasted
    /// while every probe fails, for `openings` openings.
    fn open_periods(b: &mut Breaker, t0: Instant, openings: usize) -> Vec<u64> {
        b.record(Admission::Normal, Verdict::Fatal, t0);
        let mut periods = Vec::new();
        let mut opened = t0;
        while periods.len() < openings {
            let BreakerState::Open { until } = b.state() else {
                panic!("not open: {:?}", b.state());
            };
            assert!(b.admit(until - Duration::from_millis(1)).0.is_err());
            assert_eq!(b.admit(until).0, Ok(Admission::Probe));
            periods.push((until - opened).as_secs());
            assert_eq!(
                b.record(Admission::Probe, Verdict::Failed(1.0), until),
                Some(Transition::Opened)
            );
            opened = until;
        }
        periods
    }

    #[test]
    fn each_failed_probe_doubles_the_open_time_up_to_open_for() {
        let t0 = Instant::now();
        let mut b = growing();
        assert_eq!(open_periods(&mut b, t0, 8), [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn a_successful_probe_starts_the_growth_over() {
        let t0 = Instant::now();
        let mut b = growing();
        assert_eq!(open_periods(&mut b, t0, 4), [1, 2, 4, 8]);
        let BreakerState::Open { until } = b.state() else {
            panic!("open")
        };
        assert_eq!(b.admit(until).0, Ok(Admission::Probe));
        assert_eq!(
            b.record(Admission::Probe, Verdict::Healthy, until),
            Some(Transition::Closed)
        );
        // A false alarm later: out for a second again, not 16.
        assert_eq!(open_periods(&mut b, until, 2), [1, 2]);
    }

    /// A false alarm (failures past the threshold while the upstream is fine) costs a
    /// second: the first probe succeeds and the breaker is closed again.
    #[test]
    fn a_false_alarm_is_over_in_a_second() {
        let t0 = Instant::now();
        let mut b = growing();
        for _ in 0..3 {
            b.record(Admission::Normal, Verdict::Failed(1.0), t0);
        }
        assert_eq!(b.admit(t0).0, Err(Duration::from_secs(1)));
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.admit(t1).0, Ok(Admission::Probe));
        b.record(Admission::Probe, Verdict::Healthy, t1);
        assert_eq!(b.admit(t1).0, Ok(Admission::Normal));
    }

    /// Hard down for a minute, asked every 100 ms: probes at 1, 3, 7, 15 and 31 s (the
    /// next would be at 61 s), five in all. A fixed 30 s opening probed twice.
    #[test]
    fn a_hard_down_upstream_costs_five_probes_in_its_first_minute() {
        let t0 = Instant::now();
        let mut b = growing();
        b.record(Admission::Normal, Verdict::Fatal, t0);
        let mut probes = Vec::new();
        for tick in 1..=600 {
            let now = t0 + Duration::from_millis(100 * tick);
            if b.admit(now).0 == Ok(Admission::Probe) {
                probes.push(now - t0);
                b.record(Admission::Probe, Verdict::Failed(1.0), now);
            }
        }
        let secs: Vec<u64> = probes.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [1, 3, 7, 15, 31]);
    }

    #[test]
    fn open_min_equal_to_open_for_is_a_fixed_opening() {
        let t0 = Instant::now();
        let mut b = breaker();
        assert_eq!(open_periods(&mut b, t0, 3), [30, 30, 30]);
    }
}
