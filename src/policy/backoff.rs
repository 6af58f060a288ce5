//! Capped exponential backoff with full jitter, and the decision of whether (and how
//! long) to wait before the next attempt given `Retry-After` and the request deadline.

use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The wait before retry number `retry` (0 = the first retry): uniform in
    /// `[0, min(max, base · 2^retry))`, drawn from `unit` ∈ [0, 1).
    pub fn delay(&self, retry: u32, unit: f64) -> Duration {
        let ceiling = self
            .base
            .checked_mul(1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX))
            .unwrap_or(self.max)
            .min(self.max);
        ceiling.mul_f64(unit.clamp(0.0, 1.0))
    }
}

/// What to do after a transient failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Sleep this long, then retry.
    Retry(Duration),
    /// The upstream asked for longer than `max_retry_after`: do not wait it out.
    RetryAfterTooLong(Duration),
    /// The wait would end at or past the request deadline.
    PastDeadline,
}

/// The wait before the next attempt: the upstream's `Retry-After` when it fits within
/// `max_retry_after` and the deadline, else our own backoff when that fits the deadline.
pub fn next_wait(
    retry_after: Option<Duration>,
    backoff: Duration,
    max_retry_after: Duration,
    remaining: Duration,
) -> Wait {
    match retry_after {
        Some(asked) if asked > max_retry_after => Wait::RetryAfterTooLong(asked),
        Some(asked) if asked >= remaining => Wait::PastDeadline,
        Some(asked) => Wait::Retry(asked),
        None if backoff >= remaining => Wait::PastDeadline,
        None => Wait::Retry(backoff),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B: Backoff = Backoff {
        base: Duration::from_millis(200),
        max: Duration::from_secs(5),
    };

    #[test]
    fn the_ceiling_doubles_then_caps() {
        let almost_one = 0.999_999;
        let ceilings: Vec<u128> = (0..8).map(|r| B.delay(r, almost_one).as_millis()).collect();
        assert_eq!(ceilings, [199, 399, 799, 1599, 3199, 4999, 4999, 4999]);
        assert_eq!(B.delay(3, 0.0), Duration::ZERO);
        assert_eq!(B.delay(u32::MAX, almost_one).as_millis(), 4999);
    }

    #[test]
    fn retry_after_wins_when_it_fits() {
        let s = Duration::from_secs;
        assert_eq!(next_wait(Some(s(1)), s(0), s(10), s(60)), Wait::Retry(s(1)));
        assert_eq!(
            next_wait(Some(s(30)), s(0), s(10), s(60)),
            Wait::RetryAfterTooLong(s(30))
        );
        assert_eq!(next_wait(Some(s(5)), s(0), s(10), s(4)), Wait::PastDeadline);
        assert_eq!(next_wait(None, s(2), s(10), s(3)), Wait::Retry(s(2)));
        assert_eq!(next_wait(None, s(3), s(10), s(3)), Wait::PastDeadline);
    }

    proptest! {
        #[test]
        fn every_backoff_lies_within_zero_and_max(
            base_ms in 0u64..10_000, max_ms in 0u64..60_000, retry in 0u32..200, unit in 0.0f64..1.0
        ) {
            let b = Backoff { base: Duration::from_millis(base_ms), max: Duration::from_millis(max_ms) };
            let d = b.delay(retry, unit);
            prop_assert!(d <= b.max);
            prop_assert!(d <= b.base.saturating_mul(1u32.checked_shl(retry.min(31)).unwrap_or(u32::MAX)));
        }
    }
}
