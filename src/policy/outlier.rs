//! Outlier demotion, for brownouts the breaker does not see: a target failing far more
//! than its peers (say 30% while they fail 1%) is below any sane breaker threshold, yet
//! every request that tries it first pays for it in retries and latency. Among a route's
//! targets, one whose recent failure rate is at least [`MIN_RATE`] and [`FACTOR`] times
//! the healthiest peer's (over at least [`MIN_SAMPLES`] attempts) is *demoted*: tried
//! after its peers instead of before them, still there when they fail. A peer with too
//! few attempts to judge counts as healthy: a backup that only ever gets the primary's
//! failures has no record, and trying it is how it gets one. It has no
//! ejection timer: a demoted target gets little traffic, so within one breaker window
//! too few of its attempts are left to judge it and it is back in its place, its window
//! started over ([`crate::state::health::UpstreamHealth::judged_outlier`]); if it still
//! fails, it is demoted again after [`MIN_SAMPLES`] more attempts.

/// Fewest recent attempts that say anything about a target.
pub const MIN_SAMPLES: f64 = 20.0;
/// A failure rate below this is never an outlier.
pub const MIN_RATE: f64 = 0.2;
/// How many times the healthiest peer's failure rate (plus a little) makes an outlier.
pub const FACTOR: f64 = 3.0;

/// Which targets to demote, from each one's recent (attempts, weighted failures), in
/// route order. A lone target, or one with too few samples, is never demoted; at least
/// one target always stays in front.
pub fn demoted(recent: &[(f64, f64)]) -> Vec<bool> {
    let rate = |(attempts, failures): (f64, f64)| {
        (attempts >= MIN_SAMPLES).then(|| (failures / attempts).clamp(0.0, 1.0))
    };
    let rates: Vec<Option<f64>> = recent.iter().copied().map(rate).collect();
    let best = rates
        .iter()
        .map(|r| r.unwrap_or(0.0))
        .fold(f64::INFINITY, f64::min);
    let out: Vec<bool> = rates
        .iter()
        .map(|r| r.is_some_and(|r| r >= MIN_RATE && r >= FACTOR * (best + 0.02)))
        .collect();
    if out.iter().all(|d| *d) {
        return vec![false; out.len()];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_failing_far_more_than_its_peers_is_demoted() {
        assert_eq!(demoted(&[(100.0, 30.0), (100.0, 1.0)]), [true, false]);
        // Both browned out alike: neither is an outlier.
        assert_eq!(demoted(&[(100.0, 30.0), (100.0, 25.0)]), [false, false]);
        // Too few samples to say.
        assert_eq!(demoted(&[(10.0, 9.0), (100.0, 0.0)]), [false, false]);
        // A low rate is never an outlier, however healthy the peer.
        assert_eq!(demoted(&[(100.0, 10.0), (100.0, 0.0)]), [false, false]);
        // A peer with no record counts as healthy: it is tried first.
        assert_eq!(demoted(&[(100.0, 30.0), (0.0, 0.0)]), [true, false]);
        assert_eq!(demoted(&[(10.0, 9.0), (5.0, 5.0)]), [false, false]);
        assert_eq!(demoted(&[(100.0, 90.0)]), [false]);
    }

    proptest::proptest! {
        /// Whatever the rates, one target at least stays in front; when every target
        /// has a record, the healthiest is never demoted; an unrecorded one never is.
        #[test]
        fn the_healthiest_target_always_stays_in_front(
            recent in proptest::collection::vec((0.0f64..500.0, 0.0f64..1.0), 1..6),
        ) {
            let recent: Vec<(f64, f64)> = recent.into_iter().map(|(a, share)| (a, a * share)).collect();
            let out = demoted(&recent);
            proptest::prop_assert!(out.iter().any(|d| !d));
            for (i, (attempts, _)) in recent.iter().enumerate() {
                if *attempts < MIN_SAMPLES {
                    proptest::prop_assert!(!out[i]);
                }
            }
            if recent.iter().all(|(a, _)| *a >= MIN_SAMPLES) {
                let healthiest = recent
                    .iter()
                    .enumerate()
                    .min_by(|x, y| (x.1 .1 / x.1 .0).total_cmp(&(y.1 .1 / y.1 .0)))
                    .map(|(i, _)| i)
                    .unwrap();
                proptest::prop_assert!(!out[healthiest]);
            }
        }
    }
}
