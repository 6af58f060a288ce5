//! What a guard's decision means outside it: the client's refusal, the trace entries,
//! the logs and metrics of a state change, and what the store keeps of it (a trip is
//! written when it happens and forgotten when the session is active again, so it
//! outlives a restart or the session idling out of memory).

use std::time::Duration;

use crate::{
    error::GatewayError,
    policy::{
        guard::{GuardState, Kept, Phase, Refused, SessionGuard, Transition, Trip},
        trail::Step,
    },
    state::{
        fleet::Fleet,
        live::{TraceEntry, TraceId},
        restarts::{Event, Restarts, Strategy},
        sessions::SessionGuards,
    },
};

/// The restart record's events of a change (and of a recovery that took `recovered`,
/// which a guided session changing course and guided again by another rule makes with
/// no change of phase). Guidance begins when its request is answered
/// ([`guidance_answered`]): a guided request that fails or meets an outage is no
/// guidance, and what trips after it is not counted against guiding.
pub(super) fn restarted(
    restarts: &Restarts,
    tenant: &str,
    change: Option<Transition>,
    guard: &SessionGuard,
    recovered: Option<Duration>,
) {
    let strategy = |phase| match phase {
        Phase::Guided => Some(Strategy::Guide),
        Phase::Waiting => Some(Strategy::Wait),
        _ => None,
    };
    if let Some(after) = recovered {
        let from = change.map_or(Phase::Guided, |(from, _)| from);
        restarts.count(
            tenant,
            Event::Recovered(strategy(from).unwrap_or(Strategy::Guide), after),
        );
    }
    let Some((from, to)) = change.filter(|(from, to)| from != to) else {
        return;
    };
    if to == Phase::Waiting {
        restarts.count(tenant, Event::Began(Strategy::Wait));
    }
    let delivered = guard
        .restart()
        .is_some_and(|r| r.guided_at.iter().any(Option::is_some));
    match (strategy(from), to) {
        (Some(Strategy::Guide), Phase::Tripped) if recovered.is_none() && delivered => {
            restarts.count(tenant, Event::TrippedAfter(Strategy::Guide));
        }
        (Some(Strategy::Wait), Phase::Tripped) if recovered.is_none() => {
            restarts.count(tenant, Event::TrippedAfter(Strategy::Wait));
        }
        _ => {}
    }
}

/// A guided request answered (it ended with its session still guided): the guidance
/// begins, counted in the restart record.
pub(super) fn guidance_answered(
    restarts: &Restarts,
    tenant: &str,
    guard: &SessionGuard,
    steps: &[Step],
) {
    if matches!(steps.first(), Some(Step::Guided(_)))
        && matches!(guard.state(), GuardState::Guided { .. })
    {
        restarts.count(tenant, Event::Began(Strategy::Guide));
    }
}

/// What led to the state a change went to, for the session's report.
pub(super) fn evidence(
    state: &GuardState,
    recovered: Option<Duration>,
    now: tokio::time::Instant,
) -> Option<Box<str>> {
    let text = match state {
        GuardState::Guided { guide } => format!("{}: {}", guide.rule.as_str(), guide.evidence),
        GuardState::Tripped { trip, .. } | GuardState::Probing { trip } => {
            format!("{}: {}", trip.rule.as_str(), trip.evidence)
        }
        GuardState::Waiting { until } => format!(
            "every target's circuit breaker is open; the first probe is due in {}s",
            until.saturating_duration_since(now).as_secs_f64().ceil()
        ),
        GuardState::Recovered => match recovered {
            Some(after) => format!(
                "recovered {:.1}s after the session's first failure",
                after.as_secs_f64()
            ),
            None => return None,
        },
        GuardState::Active | GuardState::Recovering | GuardState::Closed => return None,
    };
    Some(text.into())
}

/// The trace entry of a request refused before any attempt (status 0).
pub(super) fn refused_entry(
    request_id: &str,
    tool_loop: u32,
    trip: &Trip,
    state: Phase,
) -> TraceEntry {
    TraceEntry {
        request_id: TraceId::new(request_id),
        status: 0,
        failed: false,
        action: format!("refused:{}", trip.code().as_str()).into(),
        detail: Some(format!("{}: {}", trip.rule.as_str(), trip.evidence).into()),
        attempts: 0,
        upstream: None,
        latency_ms: 0.0,
        cost_usd: 0.0,
        tool_loop,
        state,
    }
}

/// The guard's refusal, as the client reads it: 429 with the trip's code, the rule and
/// its evidence, and Retry-After until the probe.
pub(super) fn refusal(refused: Refused) -> GatewayError {
    let code = refused.trip.code();
    GatewayError::SessionRefused {
        code,
        detail: format!(
            "{} ({}): {}",
            code.as_str(),
            refused.trip.rule.as_str(),
            refused.trip.evidence
        ),
        retry_after: refused.retry_after,
    }
}

/// A state change, logged and counted.
pub(super) fn transition(
    tenant: &str,
    session: &str,
    change: Option<Transition>,
    request_id: &str,
) {
    if let Some((from, to)) = change {
        let (from, to) = (from.label(), to.label());
        tracing::warn!(
            tenant,
            session,
            from,
            to,
            request_id,
            "session state transition"
        );
        metrics::counter!("backstop_guard_state_transitions_total", "from" => from, "to" => to)
            .increment(1);
        // The name before the restart states came; kept for existing dashboards.
        metrics::counter!("backstop_session_transitions_total", "from" => from, "to" => to)
            .increment(1);
    }
}

/// A trip, counted by its reason (`backstop_session_trips_total{reason}`, and the
/// tenant's fleet record).
pub(super) fn tripped(
    fleet: &Fleet,
    tenant: &str,
    guard: &SessionGuard,
    change: Option<Transition>,
) {
    if let (Some((_, Phase::Tripped)), GuardState::Tripped { trip, .. }) = (change, guard.state()) {
        let reason = trip.rule.as_str();
        metrics::counter!("backstop_session_trips_total", "reason" => reason).increment(1);
        fleet.tripped(tenant, reason);
    }
}

/// What a state change means for the store.
#[derive(Debug, PartialEq)]
pub(super) enum Keep {
    /// Nothing to do.
    Nothing,
    /// Write it: a trip, a probe, a close.
    Write(Kept),
    /// Forget what is kept: active again.
    Forget,
}

pub(super) fn to_keep(
    change: Option<Transition>,
    guard: &SessionGuard,
    now: tokio::time::Instant,
) -> Keep {
    let Some((from, to)) = change else {
        return Keep::Nothing;
    };
    if to.is_kept() {
        // A kept phase with nothing to keep is forgotten, as before it was written empty.
        guard.kept(now).map_or(Keep::Forget, Keep::Write)
    } else if from.is_kept() {
        Keep::Forget
    } else {
        Keep::Nothing
    }
}

pub(super) async fn persist(guards: &SessionGuards, tenant: &str, session: &str, keep: Keep) {
    let kept = match keep {
        Keep::Nothing => return,
        Keep::Write(kept) => Some(kept),
        Keep::Forget => None,
    };
    if let Err(err) = guards.persist(tenant, session, kept).await {
        // The state in memory still holds; only its survival of a restart is lost.
        tracing::error!(tenant, session, error = %err, "cannot keep the session's guard state");
    }
}

/// The trip this request's failure caused (`change` led to tripped), as the trace names
/// it.
pub(super) fn trip_detail(change: Option<Transition>, state: &GuardState) -> Option<Box<str>> {
    match (change, state) {
        (Some((_, Phase::Tripped)), GuardState::Tripped { trip, .. }) => {
            Some(format!("tripped: {}: {}", trip.rule.as_str(), trip.evidence).into())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{super::tests::COOL_DOWN, *};
    use crate::policy::guard::{GuardPolicy, TripCode, TripRule};

    fn guard_policy() -> GuardPolicy {
        GuardPolicy {
            max_consecutive_failures: 5,
            identical_request_limit: 3,
            identical_request_window: Duration::from_secs(600),
            tool_loop_limit: 3,
            max_usd_per_minute: None,
            cool_down: COOL_DOWN,
            guide: false,
            same_error_limit: 3,
        }
    }
    #[test]
    fn a_refusal_names_its_code_rule_and_evidence_and_waits_for_the_probe() {
        let refused = Refused {
            trip: Trip::new(
                TripRule::IdenticalRequestLimit,
                "4 identical requests in 10m".into(),
            ),
            retry_after: Duration::from_secs(42),
        };
        let err = refusal(refused);
        assert_eq!(err.code().as_str(), "loop_detected");
        assert_eq!(err.code().status(), 429);
        assert_eq!(err.retry_after(), Some(Duration::from_secs(42)));
        assert_eq!(
            err.to_string(),
            "loop_detected (identical_request_limit): 4 identical requests in 10m"
        );
        let failures = Refused {
            trip: Trip::new(TripRule::MaxConsecutiveFailures, "5 in a row".into()),
            retry_after: Duration::from_secs(1),
        };
        let err = refusal(failures);
        assert!(matches!(
            err,
            GatewayError::SessionRefused {
                code: TripCode::SessionTripped,
                ..
            }
        ));
        assert_eq!(
            err.to_string(),
            "session_tripped (max_consecutive_failures): 5 in a row"
        );
    }

    #[test]
    fn a_refusals_trace_entry_is_status_zero_with_its_code_and_rule() {
        let trip = Trip::new(TripRule::ToolLoopLimit, "tool `ls` 3 times".into());
        let entry = refused_entry("req-1", 3, &trip, Phase::Tripped);
        assert_eq!(entry.request_id, TraceId::new("req-1"));
        assert_eq!((entry.status, entry.failed, entry.attempts), (0, false, 0));
        assert_eq!(&*entry.action, "refused:loop_detected");
        assert_eq!(
            entry.detail.as_deref(),
            Some("tool_loop_limit: tool `ls` 3 times")
        );
        assert_eq!((entry.tool_loop, entry.state), (3, Phase::Tripped));
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_kept_follows_the_phase_a_change_leads_to() {
        let policy = guard_policy();
        let now = tokio::time::Instant::now();
        let mut guard = SessionGuard::new(policy);
        assert_eq!(
            to_keep(None, &guard, now),
            Keep::Nothing,
            "no change, nothing to write"
        );
        let trip = Trip::new(TripRule::FleetPattern, "hot".into());
        let change = guard.impose(now, trip.clone(), COOL_DOWN);
        assert_eq!(change, Some((Phase::Active, Phase::Tripped)));
        let later = now + Duration::from_secs(20);
        assert_eq!(
            to_keep(change, &guard, later),
            Keep::Write(Kept::Tripped {
                remaining: Duration::from_secs(40),
                trip
            }),
            "a trip is kept with what is left of its cool-down at `now`"
        );
        assert_eq!(
            to_keep(
                Some((Phase::Probing, Phase::Active)),
                &SessionGuard::new(guard_policy()),
                now
            ),
            Keep::Forget,
            "active again: forgotten"
        );
        assert_eq!(
            to_keep(Some((Phase::Active, Phase::Recovering)), &guard, now),
            Keep::Nothing
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_trace_names_the_trip_this_request_caused() {
        let trip = Box::new(Trip::new(
            TripRule::MaxConsecutiveFailures,
            "5 in a row".into(),
        ));
        let until = tokio::time::Instant::now();
        let tripped = GuardState::Tripped { until, trip };
        assert_eq!(
            trip_detail(Some((Phase::Recovering, Phase::Tripped)), &tripped).as_deref(),
            Some("tripped: max_consecutive_failures: 5 in a row")
        );
        assert_eq!(
            trip_detail(None, &tripped),
            None,
            "tripped before this request"
        );
        assert_eq!(
            trip_detail(
                Some((Phase::Active, Phase::Recovering)),
                &GuardState::Recovering
            ),
            None
        );
    }
}
