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
        guard::{restore_trip, Counts, GuardPolicy, GuardState, Guide, Phase, SessionGuard, Trip},
        restart::Restart,
    },
    store::format::{GuardSnapshot, GuideSnapshot, RestartSnapshot, WindowWrite},
};

pub use crate::store::format::{ADMITTING_PREFIXES, QUIET_PREFIX};

/// What a guard's update asks of the state replicas share.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// The whole state, taken only if the shared state is still at `version`
    /// (compare-and-set): anything else another replica wrote meanwhile is handed back.
    Whole {
        version: u64,
        state: String,
        /// What it did to the window of requests (for Redis, which keeps it beside the
        /// state).
        window: WindowWrite,
    },
    /// One admitted request, added to whatever the shared state holds now ([`Joined`]).
    Join(Joined),
    /// The whole state if the shared state is still at `version`, else the request
    /// joined to it: for a replica that wrote the shared state last. (It spared Redis
    /// splicing a kilobyte window into the state while the window was inside it; with
    /// the window kept beside the state, either write costs about the same: measured in
    /// `docs/performance.md`.)
    WholeOrJoin {
        version: u64,
        state: String,
        join: Joined,
    },
}

/// The versions a write took the shared state from and to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub from: u64,
    pub to: u64,
}

/// A request a guard admitted with nothing else changed ([`joins`]): the shared state,
/// at whatever version another replica left it, takes it without this replica's
/// snapshot if its guard would admit it too: its phase admits (active or recovering)
/// and the request is in its window fewer than `limit` times once entries from before
/// `since_ms` are dropped. The request is then appended (the window kept to
/// [`RECENT_CAP`] entries, as the guard keeps it); otherwise nothing is written and the
/// shared state is handed back, for the request to be decided again on it. Either way
/// the answer is the one the guard itself gives on the shared state: replicas need not
/// be at the shared state's version to add a request to it, only to change anything else.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Joined {
    /// When, on the wall clock ([`snapshot`]'s times).
    pub at_ms: i64,
    /// The request's fingerprint ([`RequestFingerprint::request`](crate::policy::guard::RequestFingerprint::request)).
    pub request: u64,
    /// The guard's `identical_request_limit`.
    pub limit: u32,
    /// `at_ms` less the guard's `identical_request_window`.
    pub since_ms: i64,
}

/// The identical-request window's length in a snapshot: the guard keeps its last 256
/// requests.
pub use crate::policy::guard::RECENT_CAP;

/// Whether `after` is `before` with `request` admitted at `now` and nothing else changed
/// (its windows trimmed and a spend sample taken, as every admission does): a request a
/// guard in a phase that admits let through, which can be joined to the shared state
/// ([`Joined`]) instead of replacing it.
pub fn joins(before: &SessionGuard, after: &SessionGuard, now: Instant, request: u64) -> bool {
    let (b, a) = (before.counts(), after.counts());
    matches!(b.state, GuardState::Active | GuardState::Recovering)
        && a.state.phase() == b.state.phase()
        && a.consecutive_failures == b.consecutive_failures
        && a.transitions == b.transitions
        && a.restart == b.restart
        && a.recent.back() == Some(&(now, request))
}

/// Everything the guard's rules count, on the wall clock (`now` is `now_ms`), for the
/// replicas that share its session.
pub fn snapshot(guard: &SessionGuard, now: Instant, now_ms: i64) -> GuardSnapshot {
    let at = |t: Instant| {
        now_ms.saturating_sub(
            i64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(i64::MAX),
        )
    };
    let wall = |until: Instant| {
        now_ms.saturating_add(
            i64::try_from(until.saturating_duration_since(now).as_millis()).unwrap_or(i64::MAX),
        )
    };
    let counts = guard.counts();
    let counted = |phase, until_ms, trip: Option<&Trip>| GuardSnapshot {
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
        restart: counts
            .restart
            .map(|r| restart(Some(r), &at))
            .filter(|r| *r != RestartSnapshot::default()),
    };
    let (phase, until_ms, trip) = match counts.state {
        GuardState::Active => (Phase::Active, 0, None),
        GuardState::Recovering => (Phase::Recovering, 0, None),
        GuardState::Tripped { until, trip } => (Phase::Tripped, wall(*until), Some(&**trip)),
        GuardState::Probing { trip } => (Phase::Probing, 0, Some(&**trip)),
        GuardState::Closed => (Phase::Closed, 0, None),
        GuardState::Waiting { until } => (Phase::Waiting, wall(*until), None),
        GuardState::Recovered => (Phase::Recovered, 0, None),
        GuardState::Guided { guide } => {
            return GuardSnapshot {
                code: Some(guide.rule.code().as_str().to_string()),
                rule: Some(guide.rule.as_str().to_string()),
                evidence: Some(guide.evidence.clone()),
                restart: Some(RestartSnapshot {
                    guide: Some(GuideSnapshot {
                        request: guide.request,
                        tool: guide.tool,
                        result: guide.result.clone(),
                    }),
                    ..restart(counts.restart, &at)
                }),
                ..counted(Phase::Guided, 0, None)
            };
        }
    };
    counted(phase, until_ms, trip)
}

/// A guard's restart memory on the wall clock (`at` converts a time).
fn restart(r: Option<&Restart>, at: &impl Fn(Instant) -> i64) -> RestartSnapshot {
    let Some(r) = r else {
        return RestartSnapshot::default();
    };
    RestartSnapshot {
        guided_ms: r.guided_at.map(|t| t.map(at)),
        tool_floor: r.tool_floor,
        troubled_ms: r.troubled_since.map(at),
        same_error: r.same_error,
        guide: None,
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
            trip: Box::new(trip()),
        },
        Phase::Probing => GuardState::Probing {
            trip: Box::new(trip()),
        },
        Phase::Closed => GuardState::Closed,
        Phase::Waiting => GuardState::Waiting {
            until: now
                + Duration::from_millis(
                    u64::try_from(snap.until_ms.saturating_sub(now_ms)).unwrap_or(0),
                ),
        },
        Phase::Recovered => GuardState::Recovered,
        Phase::Guided => {
            let guide = snap.restart.as_ref().and_then(|r| r.guide.clone());
            let trip = trip();
            GuardState::Guided {
                guide: Box::new(Guide {
                    rule: trip.rule,
                    evidence: trip.evidence,
                    request: guide.as_ref().map_or(0, |g| g.request),
                    tool: guide.as_ref().and_then(|g| g.tool),
                    result: guide.and_then(|g| g.result),
                }),
            }
        }
    };
    let restart = snap.restart.as_ref().map(|r| Restart {
        guided_at: r.guided_ms.map(|t| t.map(at)),
        tool_floor: r.tool_floor,
        troubled_since: r.troubled_ms.map(at),
        same_error: r.same_error,
        recovered_after: None,
    });
    SessionGuard::from_counts(
        config,
        Counts {
            state: &state,
            consecutive_failures: snap.consecutive_failures,
            recent: &snap.recent.iter().map(|(ms, h)| (at(*ms), *h)).collect(),
            spend: &snap
                .spend
                .iter()
                .map(|(ms, usd)| (at(*ms), *usd))
                .collect::<Vec<_>>(),
            transitions: snap.transitions,
            restart: restart.as_ref().filter(|r| **r != Restart::default()),
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
        GuardPolicy, TripRule,
    };

    /// The prefixes the scripts read a snapshot's phase by are how the format writes it.
    #[test]
    fn the_scripts_prefixes_are_how_snapshots_begin() {
        use crate::store::format::encode_snapshot;
        let t0 = Instant::now();
        let (now_ms, mut g) = (1_000_000, SessionGuard::new(config()));
        let fresh = encode_snapshot(&snapshot(&g, t0, now_ms));
        assert!(fresh.starts_with(QUIET_PREFIX), "{fresh}");
        assert!(fresh.starts_with(ADMITTING_PREFIXES[0]));
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        let active = encode_snapshot(&snapshot(&g, t0, now_ms));
        assert!(active.starts_with(QUIET_PREFIX), "{active}");
        assert!(active.contains(r#""recent":[[1000000,1]],"spend":["#));
        g.record(t0, true);
        let recovering = encode_snapshot(&snapshot(&g, t0, now_ms));
        assert!(
            recovering.starts_with(ADMITTING_PREFIXES[1]),
            "{recovering}"
        );
        assert!(!recovering.starts_with(QUIET_PREFIX));
        for text in ADMITTING_PREFIXES.iter().chain([&QUIET_PREFIX]) {
            // Written into the scripts inside single quotes.
            assert!(!text.contains(['\'', '\\']));
        }
    }

    /// The window a script keeps when it joins a request is the guard's own.
    #[test]
    fn the_window_cap_is_the_guards() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(GuardPolicy {
            identical_request_limit: 1000,
            ..config()
        });
        for i in 0..(RECENT_CAP as u64 + 10) {
            assert!(g.admit(t0, &fp(i), 0.0).0.is_ok());
        }
        assert_eq!(g.counts().recent.len(), RECENT_CAP);
    }

    #[test]
    fn only_a_plain_admission_joins() {
        let t0 = Instant::now();
        let g = SessionGuard::new(config());
        let mut admitted = g.clone();
        assert!(admitted.admit(t0, &fp(1), 0.0).0.is_ok());
        assert!(joins(&g, &admitted, t0, 1));
        assert!(!joins(&g, &admitted, t0, 2), "another request");
        let mut failed = admitted.clone();
        failed.record(t0, true);
        let mut again = failed.clone();
        assert!(again.admit(t0, &fp(2), 0.0).0.is_ok());
        assert!(joins(&failed, &again, t0, 2), "recovering admits");
        // A trip, a close or a probe changes more than the window.
        let mut looping = admitted.clone();
        for _ in 0..2 {
            assert!(looping.admit(t0, &fp(1), 0.0).0.is_ok());
        }
        let mut tripped = looping.clone();
        assert!(tripped.admit(t0, &fp(1), 0.0).0.is_err());
        assert!(!joins(&looping, &tripped, t0, 1));
        let mut closed = g.clone();
        closed.close();
        let mut refused = closed.clone();
        assert!(refused.admit(t0, &fp(3), 0.0).0.is_err());
        assert!(!joins(&closed, &refused, t0, 3));
    }

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

    /// A guided session carried to another replica is judged there: the loop again trips
    /// it, and what the restart strategies remember comes through.
    #[test]
    fn a_guided_state_crosses_to_another_replica() {
        use crate::policy::guard::RequestFingerprint;
        let policy = GuardPolicy {
            guide: true,
            ..config()
        };
        let looping = |n, request| RequestFingerprint {
            request,
            tool_loop: Some(("ls({}) returned the same error".into(), n)),
            tool_result: Some("Error: denied".into()),
        };
        let t0 = Instant::now();
        let mut a = SessionGuard::new(policy.clone());
        assert!(a.admit(t0, &looping(3, 1), 0.0).0.is_ok());
        assert_eq!(a.state().phase(), Phase::Guided);
        let snap = snapshot(&a, t0, 1_000_000);
        let text = crate::store::format::encode_snapshot(&snap);
        assert!(text.starts_with(r#"{"v":1,"phase":"guided","#), "{text}");
        let back = crate::store::format::decode_snapshot(&text).unwrap();
        assert_eq!(back, snap);
        let elsewhere = Instant::now() + Duration::from_secs(50);
        let b = from_snapshot(policy.clone(), back, elsewhere, 1_000_000);
        assert_eq!(snapshot(&b, elsewhere, 1_000_000), snap);
        let GuardState::Guided { guide } = b.state() else {
            panic!("{:?}", b.state())
        };
        assert!(guide.note().contains("Error: denied"));
        let refused = b
            .clone()
            .admit(elsewhere, &looping(4, 2), 0.0)
            .0
            .unwrap_err();
        assert_eq!(refused.trip.rule, TripRule::ToolLoopLimit);
        // A change of course there recovers, and the floor keeps the old loop quiet.
        let mut c = b.clone();
        assert!(c.admit(elsewhere, &looping(3, 3), 0.0).0.is_ok());
        assert_eq!(c.state().phase(), Phase::Recovered);
        let moved = from_snapshot(policy, snapshot(&c, elsewhere, 1_000_000), t0, 1_000_000);
        let mut d = moved.clone();
        assert!(d.admit(t0, &looping(3, 4), 0.0).0.is_ok());
        assert_eq!(d.state().phase(), Phase::Active);
        assert_eq!(
            d.restart().unwrap().tool_floor,
            c.restart().unwrap().tool_floor
        );
    }
}
