//! A session guard as others see it: the snapshot replicas share (on the wall clock,
//! stored by [`crate::store::format`]) and the signals the dashboard and the admin API
//! show. The guard itself ([`crate::policy::guard`]) counts on this replica's monotonic
//! clock and knows neither.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::{
    policy::{
        budget::Usd,
        guard::{restore_trip, Counts, GuardPolicy, GuardState, Phase, SessionGuard, Trip},
    },
    store::format::GuardSnapshot,
};

/// Everything the guard's rules count, on the wall clock (`now` is `now_ms`), for the
/// replicas that share its session.
pub fn snapshot(guard: &SessionGuard, now: Instant, now_ms: i64) -> GuardSnapshot {
    let at = |t: Instant| {
        now_ms.saturating_sub(
            i64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(i64::MAX),
        )
    };
    let counts = guard.counts();
    let (phase, until_ms, trip) = match counts.state {
        GuardState::Active => (Phase::Active, 0, None),
        GuardState::Recovering => (Phase::Recovering, 0, None),
        GuardState::Tripped { until, trip } => (
            Phase::Tripped,
            now_ms.saturating_add(
                i64::try_from(until.saturating_duration_since(now).as_millis()).unwrap_or(i64::MAX),
            ),
            Some(trip),
        ),
        GuardState::Probing { trip } => (Phase::Probing, 0, Some(trip)),
        GuardState::Closed => (Phase::Closed, 0, None),
    };
    GuardSnapshot {
        phase,
        until_ms,
        code: trip.map(|t| t.code().as_str().to_string()),
        rule: trip.map(|t| t.rule.as_str().to_string()),
        evidence: trip.map(|t| t.evidence.clone()),
        consecutive_failures: counts.consecutive_failures,
        recent: counts.recent.iter().map(|(t, h)| (at(*t), *h)).collect(),
        spend: counts.spend.iter().map(|(t, usd)| (at(*t), *usd)).collect(),
        transitions: counts.transitions,
        signature: trip.and_then(|t| t.signature),
    }
}

/// A guard counting on from a snapshot taken on another replica.
pub fn from_snapshot(
    config: impl Into<std::sync::Arc<GuardPolicy>>,
    snap: GuardSnapshot,
    now: Instant,
    now_ms: i64,
) -> SessionGuard {
    let at = |ms: i64| {
        let ago = u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0);
        now.checked_sub(Duration::from_millis(ago)).unwrap_or(now)
    };
    let trip = || Trip {
        signature: snap.signature,
        ..restore_trip(
            snap.code.as_deref().unwrap_or(""),
            snap.rule.as_deref().unwrap_or(""),
            snap.evidence.clone().unwrap_or_default(),
        )
    };
    let state = match snap.phase {
        Phase::Active => GuardState::Active,
        Phase::Recovering => GuardState::Recovering,
        Phase::Tripped => GuardState::Tripped {
            until: now
                + Duration::from_millis(
                    u64::try_from(snap.until_ms.saturating_sub(now_ms)).unwrap_or(0),
                ),
            trip: trip(),
        },
        Phase::Probing => GuardState::Probing { trip: trip() },
        Phase::Closed => GuardState::Closed,
    };
    SessionGuard::from_counts(
        config,
        Counts {
            state: &state,
            consecutive_failures: snap.consecutive_failures,
            recent: &snap.recent.iter().map(|(ms, h)| (at(*ms), *h)).collect(),
            spend: &snap.spend.iter().map(|(ms, usd)| (at(*ms), *usd)).collect(),
            transitions: snap.transitions,
        },
    )
}

/// The counters behind the guard's rules and its risk score in [0, 1] (how close the
/// nearest rule is to firing), with the trip and its evidence when there is one.
pub fn signals(guard: &SessionGuard, now: Instant, session_usd: f64, last_tool_loop: u32) -> Value {
    let pressure = guard.pressure(now, session_usd, last_tool_loop);
    let state = guard.state();
    let mut out = json!({
        "state": state.label(),
        "consecutive_failures": pressure.consecutive_failures,
        "max_identical_requests_in_window": pressure.max_repeat,
        "tool_loop_count": last_tool_loop,
        "usd_last_minute": Usd(pressure.usd_last_minute),
        "risk": (pressure.risk * 100.0).round() / 100.0,
        "transitions": pressure.transitions,
    });
    match state {
        GuardState::Tripped { until, trip } => {
            out["trip"] = json!({"code": trip.code().as_str(), "rule": trip.rule.as_str(), "evidence": trip.evidence, "probe_in_ms": until.saturating_duration_since(now).as_millis() as u64});
        }
        GuardState::Probing { trip } => {
            out["trip"] = json!({"code": trip.code().as_str(), "rule": trip.rule.as_str(), "evidence": trip.evidence})
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::guard::{
        tests::{config, fp},
        TripRule,
    };

    /// A guard carried to another replica as a snapshot goes on counting where it was:
    /// its windows, failures and trip (with the cool-down left) come through, with
    /// the times as far in the past on the other replica's clock.
    #[test]
    fn a_snapshot_carries_every_count_to_another_replica() {
        let t0 = Instant::now() + Duration::from_secs(3600);
        let mut g = SessionGuard::new(config());
        for _ in 0..2 {
            assert!(g.admit(t0, &fp(7), 0.1).0.is_ok());
            g.record(t0, true);
        }
        let later = t0 + Duration::from_secs(30);
        let snap = snapshot(&g, later, 1_000_000);
        let json = serde_json::to_string(&snap).unwrap();
        // Another replica, whose monotonic clock reads something else entirely.
        let elsewhere = Instant::now() + Duration::from_secs(7200);
        let mut h = from_snapshot(
            config(),
            serde_json::from_str(&json).unwrap(),
            elsewhere,
            1_000_000,
        );
        assert_eq!(snapshot(&h, elsewhere, 1_000_000), snap);
        // The third identical request is still allowed, the fourth trips: counted across.
        assert!(h.admit(elsewhere, &fp(7), 0.1).0.is_ok());
        let (refused, _) = h.admit(elsewhere, &fp(7), 0.1);
        assert_eq!(
            refused.unwrap_err().trip.rule,
            TripRule::IdenticalRequestLimit
        );
        // The trip and its cool-down come back the same way.
        let tripped = snapshot(&h, elsewhere, 1_000_000);
        assert_eq!(tripped.phase, Phase::Tripped);
        assert_eq!(tripped.until_ms, 1_060_000);
        let k = from_snapshot(config(), tripped, t0, 1_010_000);
        let refused = k.clone().admit(t0, &fp(8), 0.0).0.unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(50));
        // Requests older than the window drop out after the move as before it.
        let mut old = from_snapshot(config(), snap, t0, 1_000_000 + 601_000);
        for _ in 0..3 {
            assert!(old.admit(t0, &fp(7), 0.0).0.is_ok());
        }
    }
}
