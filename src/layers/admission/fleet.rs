//! Fleet failure prediction (`[tenants.guard.fleet]`): a request's failures are named
//! by signature ([`super::failure`]) and counted in the tenant's fleet view
//! ([`Fleet`](crate::state::fleet::Fleet)); a hot signature trips the failing session at once (rule
//! `fleet_pattern`, [`fleet_trip`]), and with `preempt` refuses a request of its shape
//! before the limits or any attempt ([`preempted`]), unless it is the signature's probe.
//! Nothing is hashed or asked on the success path unless the tenant has a hot signature
//! or a prediction pending ([`AdmissionLayer::watched_shape`]).

use std::time::Duration;

use super::{failure::loop_kind, guard::Guarded, AdmissionLayer};
use crate::{
    error::GatewayError,
    policy::{
        fleet::{Check, Failed, FleetPolicy, Hot, Shape, Signature, SignatureId},
        guard::{GuardState, Phase, Transition, Trip, TripCode, TripRule},
    },
    state::sessions::lock,
};

/// A fleet trip's evidence, as the trip and its refusals carry it.
pub(super) fn fleet_trip(hot: &Hot, policy: &FleetPolicy) -> Trip {
    Trip {
        signature: Some(hot.id.0),
        ..Trip::new(TripRule::FleetPattern, hot.evidence(policy))
    }
}

/// The trip a counted failure imposes on its session, if its verdict trips it.
pub(super) fn fleet_imposed(verdict: &Failed, policy: &FleetPolicy) -> Option<(Trip, Duration)> {
    let hot = verdict.trip.as_ref()?;
    Some((fleet_trip(hot, policy), policy.cool_down))
}

/// A counted failure's verdict: a confirmed prediction counted, and the trip to impose
/// (logged) if it trips the session.
pub(super) fn fleet_verdict(
    g: &Guarded,
    policy: &FleetPolicy,
    verdict: &Failed,
) -> Option<(Trip, Duration)> {
    if verdict.confirmed {
        metrics::counter!("backstop_fleet_predictions_total", "outcome" => "confirmed")
            .increment(1);
    }
    if let Some(hot) = &verdict.trip {
        g.hot(hot, "tripped");
    }
    fleet_imposed(verdict, policy)
}

/// Whether the session's own guard refuses a request anyway, with its own reason (closed,
/// probing, cooling down at `now`): no preemptive check is made then.
pub(super) fn guard_refuses(state: &GuardState, now: tokio::time::Instant) -> bool {
    match state {
        GuardState::Closed | GuardState::Probing { .. } => true,
        GuardState::Tripped { until, .. } => now < *until,
        GuardState::Active
        | GuardState::Recovering
        | GuardState::Guided { .. }
        | GuardState::Waiting { .. }
        | GuardState::Recovered => false,
    }
}

/// A request refused before its first attempt by a hot signature (`trip`, made of
/// `hot`): 429 `session_tripped`, Retry-After until the signature's probe (at least 1s).
pub(super) fn preempted(trip: &Trip, hot: &Hot) -> GatewayError {
    GatewayError::SessionRefused {
        code: TripCode::SessionTripped,
        detail: format!(
            "{} ({}): {}; refused before its first attempt (probe in {}s)",
            TripCode::SessionTripped.as_str(),
            TripRule::FleetPattern.as_str(),
            trip.evidence,
            hot.retry_after.as_secs()
        ),
        retry_after: hot.retry_after.max(Duration::from_secs(1)),
    }
}

impl AdmissionLayer {
    /// The request's shape, only while the tenant's fleet view watches one.
    pub(super) async fn watched_shape(&self, g: &Guarded) -> Option<Shape> {
        match g.fleet {
            Some(_) if self.fleet.watching(&g.tenant).await => Some(g.shape()),
            _ => None,
        }
    }

    /// With `preempt`, a request whose shape is a hot signature's is refused before it
    /// runs, unless it is the signature's probe (or the session's own guard refuses it
    /// anyway, with its own reason).
    pub(super) async fn preempt(
        &self,
        g: &Guarded,
        shape: Option<&Shape>,
    ) -> Result<(), GatewayError> {
        let (Some(policy), Some(shape)) = (&g.fleet, shape) else {
            return Ok(());
        };
        if !policy.preempt || guard_refuses(lock(&g.entry).guard.state(), self.guards.now()) {
            return Ok(());
        }
        let Check::Refuse(hot) = self.fleet.check(&g.tenant, shape.key, &g.session).await else {
            return Ok(());
        };
        let trip = fleet_trip(&hot, policy);
        g.refused(&mut lock(&g.entry), &trip);
        metrics::counter!("backstop_fleet_refusals_total", "kind" => "preempted").increment(1);
        self.fleet.avoided(&g.tenant, hot.id, 1);
        g.hot(&hot, "preempted");
        Err(preempted(&trip, &hot))
    }

    /// A refusal by the session's guard, for the fleet: one of a fleet trip's refusals
    /// is credited to its signature; a loop the guard just tripped the session on is a
    /// failure with a signature of its own.
    pub(super) async fn fleet_refused(&self, g: &Guarded, trip: &Trip, change: Option<Transition>) {
        if g.fleet.is_none() {
            return;
        }
        if let (TripRule::FleetPattern, Some(id)) = (trip.rule, trip.signature) {
            metrics::counter!("backstop_fleet_refusals_total", "kind" => "tripped_session")
                .increment(1);
            self.fleet.avoided(&g.tenant, SignatureId(id), 1);
            return;
        }
        let Some(kind) = matches!(change, Some((_, Phase::Tripped)))
            .then(|| loop_kind(trip, &g.request))
            .flatten()
        else {
            return;
        };
        let sig = Signature::new(&g.shape(), &kind);
        // The session is tripped already: a hot loop signature only adds its count.
        self.fleet.failed(&g.tenant, &sig, &g.session, 0, 0.0).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> FleetPolicy {
        FleetPolicy {
            min_sessions: 3,
            min_failures: 2,
            window: Duration::from_secs(600),
            preempt: true,
            cool_down: Duration::from_secs(30),
        }
    }

    fn hot(retry_after: Duration) -> Hot {
        Hot {
            id: SignatureId(0xabc),
            description: "bad_request (caller_fault, HTTP 400)".into(),
            sessions: 4,
            qualified: 3,
            retry_after,
        }
    }
    #[test]
    fn a_fleet_trip_carries_its_signature_and_how_many_sessions_shared_it() {
        let trip = fleet_trip(&hot(Duration::ZERO), &policy());
        assert_eq!(
            (trip.rule, trip.signature),
            (TripRule::FleetPattern, Some(0xabc))
        );
        assert_eq!(
            trip.evidence,
            "4 sessions of this tenant failed the same way within 10m (3 of them at least 2 \
             times): signature 0000000000000abc: bad_request (caller_fault, HTTP 400)"
        );
        assert_eq!(fleet_imposed(&Failed::default(), &policy()), None);
        let verdict = Failed {
            trip: Some(hot(Duration::ZERO)),
            ..Failed::default()
        };
        assert_eq!(
            fleet_imposed(&verdict, &policy()),
            Some((trip, Duration::from_secs(30))),
            "the session stays tripped for the fleet's cool-down"
        );
    }

    #[test]
    fn a_preempted_request_waits_for_the_probe_and_at_least_a_second() {
        let trip = fleet_trip(&hot(Duration::from_secs(30)), &policy());
        let err = preempted(&trip, &hot(Duration::from_secs(30)));
        assert_eq!(err.code().as_str(), "session_tripped");
        assert_eq!(err.retry_after(), Some(Duration::from_secs(30)));
        assert_eq!(
            err.to_string(),
            format!(
                "session_tripped (fleet_pattern): {}; refused before its first attempt (probe in 30s)",
                trip.evidence
            )
        );
        let due = preempted(&trip, &hot(Duration::from_millis(300)));
        assert_eq!(due.retry_after(), Some(Duration::from_secs(1)));
        assert!(due.to_string().ends_with("(probe in 0s)"));
    }

    #[tokio::test(start_paused = true)]
    async fn no_preemptive_check_while_the_guard_refuses_anyway() {
        let now = tokio::time::Instant::now();
        let trip = || Box::new(Trip::new(TripRule::Closed, String::new()));
        assert!(guard_refuses(&GuardState::Closed, now));
        assert!(guard_refuses(&GuardState::Probing { trip: trip() }, now));
        let until = now + Duration::from_secs(5);
        let cooling = GuardState::Tripped {
            until,
            trip: trip(),
        };
        assert!(guard_refuses(&cooling, now));
        assert!(
            !guard_refuses(&cooling, until),
            "cooled down: its probe is checked"
        );
        assert!(!guard_refuses(&GuardState::Active, now));
        assert!(!guard_refuses(&GuardState::Recovering, now));
    }
}
