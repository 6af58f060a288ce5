//! The last hour of activity, for the operator dashboard (`GET /admin/ui/data`): what
//! recovery did per minute, and per upstream the attempts by class and the breaker's
//! transitions. Kept in memory only, in fixed rings: none of it survives a restart, and
//! the dashboard says so.
//!
//! Fed on the hot path (once per request from the edge, once per attempt from the
//! upstream's health), so a count is one relaxed atomic add into the current minute's
//! slot: no allocation, no lock. A slot is reused an hour later; the first writer of a
//! new minute zeroes it. A count made by another thread in the instant a slot turns
//! over may be lost; the figures are for a person looking, not for billing.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
    time::Duration,
};

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::{
    error::ErrorCode,
    policy::{classify::Class, trail::Step},
    telemetry::Facts,
};

/// Minutes kept: one hour.
pub const MINUTES: usize = 60;

const MINUTE: Duration = Duration::from_secs(60);

/// One minute's counters.
struct Slot<const K: usize> {
    /// Which minute (since the ring's origin, from 1) the counts are for; 0: none yet.
    minute: AtomicU64,
    counts: [AtomicU64; K],
}

/// `K` counters per minute over the last [`MINUTES`] minutes.
pub struct MinuteRing<const K: usize> {
    origin: Instant,
    slots: [Slot<K>; MINUTES],
}

impl<const K: usize> MinuteRing<K> {
    pub fn new(origin: Instant) -> Self {
        MinuteRing {
            origin,
            slots: std::array::from_fn(|_| Slot {
                minute: AtomicU64::new(0),
                counts: std::array::from_fn(|_| AtomicU64::new(0)),
            }),
        }
    }

    fn minute(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_secs() / MINUTE.as_secs() + 1
    }

    /// Adds `n` to counter `index` in the minute of `now`.
    pub fn add(&self, now: Instant, index: usize, n: u64) {
        let minute = self.minute(now);
        let slot = &self.slots[(minute % MINUTES as u64) as usize];
        let seen = slot.minute.load(Ordering::Acquire);
        if seen != minute {
            if seen > minute {
                // An hour newer than us: a count that raced the turnover; dropped.
                return;
            }
            if slot
                .minute
                .compare_exchange(seen, minute, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                for count in &slot.counts {
                    count.store(0, Ordering::Relaxed);
                }
            }
        }
        slot.counts[index].fetch_add(n, Ordering::Relaxed);
    }

    /// The last [`MINUTES`] minutes' counts, oldest first, the current minute last.
    pub fn minutes(&self, now: Instant) -> Vec<[u64; K]> {
        let current = self.minute(now);
        (0..MINUTES as u64)
            .rev()
            .map(|ago| {
                let Some(minute) = current.checked_sub(ago).filter(|m| *m > 0) else {
                    return [0; K];
                };
                let slot = &self.slots[(minute % MINUTES as u64) as usize];
                if slot.minute.load(Ordering::Acquire) != minute {
                    return [0; K];
                }
                std::array::from_fn(|i| slot.counts[i].load(Ordering::Relaxed))
            })
            .collect()
    }
}

/// The refusals by Backstop the dashboard counts by reason (their codes), in order.
const REFUSALS: &[ErrorCode] = &ErrorCode::REFUSALS;

/// The per-request counters (by these indices), then one per [`REFUSALS`] reason.
const REQUEST_FIELDS: [&str; 5] = ["requests", "failed", "retries", "corrections", "failovers"];
const REQUESTS: usize = 0;
const FAILED: usize = 1;
const RETRIES: usize = 2;
const CORRECTIONS: usize = 3;
const FAILOVERS: usize = 4;
const REQUEST_COUNTERS: usize = REQUEST_FIELDS.len() + REFUSALS.len();

/// Recovery per minute, fed once per proxied request by the edge layer.
pub struct Activity {
    requests: MinuteRing<REQUEST_COUNTERS>,
}

impl Activity {
    pub fn new(now: Instant) -> Self {
        Activity {
            requests: MinuteRing::new(now),
        }
    }

    /// One finished request, from its log record. A refusal is counted under its reason,
    /// not as failed.
    pub fn record_request(&self, now: Instant, status: u16, fields: &Facts) {
        let ring = &self.requests;
        ring.add(now, REQUESTS, 1);
        let (mut retries, mut corrections, mut failovers) = (0, 0, 0);
        for step in &fields.recovery.steps {
            match step {
                Step::Retry(_) => retries += 1,
                Step::Correct(_) | Step::Repeat { .. } => corrections += 1,
                Step::Failover(_) | Step::Switch(_) => failovers += 1,
                _ => {}
            }
        }
        for (index, n) in [
            (RETRIES, retries),
            (CORRECTIONS, corrections),
            (FAILOVERS, failovers),
        ] {
            if n > 0 {
                ring.add(now, index, n);
            }
        }
        let refusal = fields
            .error
            .and_then(|code| REFUSALS.iter().position(|r| *r == code));
        match refusal {
            Some(reason) => ring.add(now, REQUEST_FIELDS.len() + reason, 1),
            None if status >= 400 => ring.add(now, FAILED, 1),
            None => {}
        }
    }

    /// The last hour, a minute per element, oldest first (the last is the current one).
    pub fn report(&self, now: Instant) -> Value {
        let minutes: Vec<Value> = self
            .requests
            .minutes(now)
            .iter()
            .map(|counts| {
                let mut minute = serde_json::Map::new();
                for (name, n) in REQUEST_FIELDS.iter().zip(counts) {
                    minute.insert((*name).into(), (*n).into());
                }
                let refused: serde_json::Map<String, Value> = REFUSALS
                    .iter()
                    .zip(&counts[REQUEST_FIELDS.len()..])
                    .filter(|(_, n)| **n > 0)
                    .map(|(reason, n)| (reason.as_str().to_string(), (*n).into()))
                    .collect();
                minute.insert("refused".into(), refused.into());
                minute.into()
            })
            .collect();
        json!(minutes)
    }
}

/// An upstream attempt's class, as recovery classified it (by these indices), or
/// abandoned (the request was dropped before its answer).
const ATTEMPT_CLASSES: [&str; 8] = [
    "ok",
    "transient",
    "rate_limited",
    "malformed",
    "caller_fault",
    "credential",
    "redirect",
    "abandoned",
];
const OK: usize = 0;
const TRANSIENT: usize = 1;
const RATE_LIMITED: usize = 2;
const MALFORMED: usize = 3;
const CALLER_FAULT: usize = 4;
const CREDENTIAL: usize = 5;
const REDIRECT: usize = 6;
const ABANDONED: usize = 7;

/// Transitions kept per upstream (an upstream that flaps faster than this an hour shows
/// the latest).
const TRANSITIONS: usize = 120;

/// One upstream's last hour: attempts by class per minute, and breaker transitions.
pub struct UpstreamActivity {
    attempts: MinuteRing<{ ATTEMPT_CLASSES.len() }>,
    transitions: Mutex<VecDeque<(Instant, &'static str)>>,
}

impl UpstreamActivity {
    pub fn new(now: Instant) -> Self {
        UpstreamActivity {
            attempts: MinuteRing::new(now),
            transitions: Mutex::default(),
        }
    }

    /// One attempt, as recovery classified it.
    pub fn attempt(&self, now: Instant, class: &Class) {
        let index = match class {
            Class::Success => OK,
            Class::Transient {
                rate_limited: true, ..
            } => RATE_LIMITED,
            Class::Transient { .. } => TRANSIENT,
            Class::Malformed => MALFORMED,
            Class::CallerFault { .. } => CALLER_FAULT,
            Class::CredentialOrQuota => CREDENTIAL,
            Class::Redirect => REDIRECT,
        };
        self.attempts.add(now, index, 1);
    }

    /// An attempt whose request was dropped before its answer.
    pub fn abandoned(&self, now: Instant) {
        self.attempts.add(now, ABANDONED, 1);
    }

    /// The breaker moved to `to` (rare: behind a small lock).
    pub fn transition(&self, now: Instant, to: &'static str) {
        let mut transitions = self.transitions.lock().unwrap_or_else(|e| e.into_inner());
        if transitions.len() == TRANSITIONS {
            transitions.pop_front();
        }
        transitions.push_back((now, to));
    }

    /// Attempts by class over the hour (totals, and per minute oldest first) and the
    /// hour's transitions, newest last.
    pub fn report(&self, now: Instant) -> Value {
        let minutes = self.attempts.minutes(now);
        let totals: serde_json::Map<String, Value> = ATTEMPT_CLASSES
            .iter()
            .enumerate()
            .map(|(i, class)| {
                let n: u64 = minutes.iter().map(|m| m[i]).sum();
                ((*class).to_string(), n.into())
            })
            .collect();
        let per_minute: Vec<Value> = minutes
            .iter()
            .map(|m| json!({"attempts": m.iter().sum::<u64>(), "failures": m[TRANSIENT] + m[RATE_LIMITED] + m[MALFORMED] + m[CREDENTIAL] + m[REDIRECT]}))
            .collect();
        let hour_ago = now.checked_sub(MINUTE * MINUTES as u32);
        let transitions: Vec<Value> = self
            .transitions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(at, _)| hour_ago.is_none_or(|h| *at >= h))
            .map(|(at, to)| json!({"to": to, "ago_ms": now.saturating_duration_since(*at).as_millis() as u64}))
            .collect();
        json!({"by_class": totals, "per_minute": per_minute, "transitions": transitions})
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::policy::trail::Reason;

    fn fields(steps: Vec<Step>, error: Option<ErrorCode>) -> Facts {
        Facts {
            recovery: crate::telemetry::Trail {
                steps,
                ..Default::default()
            },
            error,
            ..Facts::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn counts_land_in_their_minute_and_age_out_after_an_hour() {
        let ring: MinuteRing<2> = MinuteRing::new(Instant::now());
        ring.add(Instant::now(), 0, 3);
        tokio::time::advance(Duration::from_secs(59)).await;
        ring.add(Instant::now(), 1, 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        ring.add(Instant::now(), 0, 5);
        let minutes = ring.minutes(Instant::now());
        assert_eq!(minutes.len(), MINUTES);
        assert_eq!(minutes[MINUTES - 2], [3, 1]);
        assert_eq!(minutes[MINUTES - 1], [5, 0]);
        assert!(minutes[..MINUTES - 2].iter().all(|m| *m == [0, 0]));

        // 59 minutes on, the first minute is the oldest shown; one more and it is gone.
        tokio::time::advance(Duration::from_secs(59 * 60)).await;
        let minutes = ring.minutes(Instant::now());
        assert_eq!(minutes[0], [5, 0]);
        assert_eq!(minutes.iter().map(|m| m[0]).sum::<u64>(), 5);
        // The slot of minute 1 is reused for minute 61: zeroed first, not added to.
        ring.add(Instant::now(), 1, 2);
        let minutes = ring.minutes(Instant::now());
        assert_eq!(minutes[MINUTES - 1], [0, 2]);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(ring.minutes(Instant::now()).iter().all(|m| *m == [0, 0]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_counts_its_recovery_steps_and_its_refusal_reason() {
        let activity = Activity::new(Instant::now());
        let now = Instant::now();
        let retried = fields(
            vec![
                Step::Retry(Reason::Status(503)),
                Step::Retry(Reason::Status(503)),
                Step::Failover(Arc::from("b")),
                Step::Correct("schema"),
                Step::Ok,
            ],
            None,
        );
        activity.record_request(now, 200, &retried);
        // The refusals are ErrorCode's: a store that cannot account refuses; a reused
        // idempotency key is the caller's mistake, a failure.
        for (status, code) in [
            (429, ErrorCode::LoopDetected),
            (429, ErrorCode::LoopDetected),
            (402, ErrorCode::BudgetExceeded),
            (502, ErrorCode::UpstreamUnavailable),
            (503, ErrorCode::StoreUnavailable),
            (422, ErrorCode::IdempotencyKeyReused),
        ] {
            activity.record_request(now, status, &fields(vec![], Some(code)));
        }
        let report = activity.report(now);
        let minute = &report[MINUTES - 1];
        assert_eq!(
            *minute,
            json!({"requests": 7, "failed": 2, "retries": 2, "corrections": 1, "failovers": 1,
                   "refused": {"loop_detected": 2, "budget_exceeded": 1, "store_unavailable": 1}})
        );
        assert_eq!(report[0]["requests"], 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_keeps_attempts_by_class_and_the_last_hours_transitions() {
        let upstream = UpstreamActivity::new(Instant::now());
        let now = Instant::now();
        let transient = |rate_limited| Class::Transient {
            retry_after: None,
            rate_limited,
        };
        for class in [
            Class::Success,
            transient(false),
            transient(false),
            transient(true),
            Class::CredentialOrQuota,
            Class::CallerFault {
                context_length: false,
            },
            Class::Malformed,
        ] {
            upstream.attempt(now, &class);
        }
        upstream.abandoned(now);
        upstream.transition(now, "open");
        tokio::time::advance(Duration::from_secs(30 * 60)).await;
        upstream.transition(Instant::now(), "half_open");
        let report = upstream.report(Instant::now());
        assert_eq!(
            report["by_class"],
            json!({"ok": 1, "transient": 2, "rate_limited": 1, "malformed": 1, "caller_fault": 1,
                   "credential": 1, "redirect": 0, "abandoned": 1})
        );
        assert_eq!(
            report["per_minute"][MINUTES - 31],
            json!({"attempts": 8, "failures": 5})
        );
        assert_eq!(
            report["transitions"],
            json!([{"to": "open", "ago_ms": 1_800_000}, {"to": "half_open", "ago_ms": 0}])
        );
        tokio::time::advance(Duration::from_secs(31 * 60)).await;
        let report = upstream.report(Instant::now());
        assert_eq!(report["transitions"].as_array().unwrap().len(), 1);
        assert_eq!(report["by_class"]["transient"], 0);
    }
}
