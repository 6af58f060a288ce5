//! What the session learns after its call: how it ended, for the fleet (a failure
//! counted under its signature, a success cooling its shape down) and the guard (its
//! record, imposing the fleet's trip), the trace entry, the trip written to the store,
//! and `x-backstop-session-state` and `x-backstop-budget-remaining`.
//!
//! In replica mode a failure the fleet counts is counted in the guard's write-back, one
//! round trip that also imposes the trip it decides ([`SessionGuards::record_failure`]);
//! the settle of the request's last call (the meter's round trip) has already seen what
//! the session holds and its guard's version, so a success needs no other read or write.
//!
//! [`SessionGuards::record_failure`]: crate::state::sessions::SessionGuards::record_failure

use std::time::{Duration, Instant};

use axum::body::Body;
use http::Response;

use super::{
    failure::{failure_kind, guard_outcome},
    fleet::{fleet_imposed, fleet_verdict},
    guard::Guarded,
    trip::{guidance_answered, persist, to_keep, trip_detail},
    AdmissionLayer, Asking,
};
use crate::{
    error::GatewayError,
    policy::{
        budget::SessionSeen,
        fleet::{Failed, FailureKind, FleetPolicy, Hot, Shape, Signature, EVIDENCE_MARKS},
        guard::{Transition, Trip, TripRule},
        restart::Outcome,
        trail,
    },
    state::{
        live::{TraceEntry, TraceId},
        sessions::lock,
    },
    telemetry::{Facts, RequestLog},
};

/// How a failure counted in the guard's write-back went (replica mode).
enum WriteBack {
    /// Counted in the fleet, with the guard's transition (if any).
    Counted(Option<Transition>),
    /// It cannot be (the tripped state would not hold the evidence's marks once each):
    /// nothing done, so it is counted the usual way.
    NotFolded,
}

/// How a request ended, as its session learns it: read at once (a response is not
/// `Sync`, so none is held while the session learns).
pub(super) struct Ended {
    pub(super) status: u16,
    /// An error answer, or an error that is not a refusal.
    pub(super) failed: bool,
    /// The failure as the fleet's signature names it (a guarded session of a tenant with
    /// a fleet view only).
    pub(super) failure: Option<FailureKind>,
    /// How it ended for the session's guard (a guarded session only).
    pub(super) outcome: Outcome,
    pub(super) facts: Facts,
}

/// The status a request ended with, and whether it failed for its session: an error
/// answer, or an error that is not a refusal.
pub(super) fn status(result: &Result<Response<Body>, GatewayError>) -> (u16, bool) {
    match result {
        Ok(r) => (r.status().as_u16(), r.status().as_u16() >= 400),
        Err(e) => (e.code().status(), !e.code().is_refusal()),
    }
}

impl Asking {
    /// How the request ended, and what its record holds after the call.
    pub(super) fn ended(&self, result: &Result<Response<Body>, GatewayError>) -> Ended {
        let facts = self.log.facts();
        let (status, failed) = status(result);
        let failure = match &self.guarded {
            Some(g) if failed && g.fleet.is_some() => {
                failure_kind(result, &facts.recovery, &g.request)
            }
            _ => None,
        };
        let outcome = match &self.guarded {
            Some(g) => guard_outcome(result, &facts.recovery, failed, g.fp.request),
            None if failed => Outcome::Failed,
            None => Outcome::Succeeded,
        };
        Ended {
            status,
            failed,
            failure,
            outcome,
            facts,
        }
    }
}

impl AdmissionLayer {
    /// After the call: a guarded session learns how it went; a session is told what it
    /// has left.
    pub(super) async fn after(
        &self,
        a: &Asking,
        shape: Option<Shape>,
        ended: Ended,
        started: Instant,
    ) {
        let seen = ended.facts.session_seen;
        if let Some(g) = &a.guarded {
            self.learn(g, &a.log, ended, shape, started).await;
        }
        if let Some(session) = &a.session {
            self.remaining(&a.log, &a.tenant, session, seen).await;
        }
    }

    /// How the request ended, for the fleet and the guard, then its trace entry and the
    /// session's state (kept in the store if it must outlive memory).
    async fn learn(
        &self,
        g: &Guarded,
        log: &RequestLog,
        ended: Ended,
        shape: Option<Shape>,
        started: Instant,
    ) {
        let Ended {
            status,
            failed,
            failure,
            outcome,
            facts,
        } = ended;
        let seen = facts.session_seen;
        let change = self
            .outcome(g, shape, failure, &outcome, &facts, seen)
            .await;
        let keep = {
            let mut e = lock(&g.entry);
            if let Some(seen) = seen {
                e.seen_usd = e.seen_usd.max(seen.settled.usd);
            }
            let now = self.guards.now();
            self.changed(g, &mut e, change);
            guidance_answered(
                self.guards.restarts(),
                &g.tenant,
                &e.guard,
                &facts.recovery.steps,
            );
            let keep = to_keep(change, &e.guard, now);
            let state = e.guard.state().phase();
            let detail = trip_detail(change, e.guard.state());
            e.trace(TraceEntry {
                request_id: TraceId::new(&g.request_id),
                status,
                failed,
                action: trail::render(&facts.recovery.steps).into(),
                detail,
                attempts: facts.recovery.attempts,
                upstream: facts.recovery.upstream,
                latency_ms: (started.elapsed().as_secs_f64() * 1e3) as f32,
                cost_usd: facts.spent_usd,
                tool_loop: g.tool_loop(),
                state,
            });
            log.set_session_state(e.guard.state().phase());
            keep
        };
        persist(&self.guards, &g.tenant, &g.session, keep).await;
    }

    /// How the request ended, for the fleet and the session's guard: the guard's
    /// transition. A failure the fleet counts is offered to the guard's write-back, to be
    /// counted in the same round trip that imposes the trip it decides (replica mode);
    /// where the guard's backend folds nothing, the fleet's count comes first and the
    /// guard's record after, imposing its trip.
    async fn outcome(
        &self,
        g: &Guarded,
        shape: Option<Shape>,
        failure: Option<FailureKind>,
        outcome: &Outcome,
        facts: &Facts,
        seen: Option<SessionSeen>,
    ) -> Option<Transition> {
        let failed = outcome.failed();
        let imposed = match (&g.fleet, failure) {
            (Some(policy), Some(failure)) if failed => {
                let sig = Signature::new(&shape.unwrap_or_else(|| g.shape()), &failure);
                match self
                    .fleet_failed_in_write_back(g, policy, &sig, outcome, facts)
                    .await
                {
                    WriteBack::Counted(change) => return change,
                    WriteBack::NotFolded => self.fleet_failed(g, policy, &sig, facts).await,
                }
            }
            (_, failure) => self.fleet_outcome(g, shape, failure, failed, facts).await,
        };
        // Shared state that became unreadable meanwhile is left as it is (already logged):
        // this outcome goes uncounted.
        self.guards
            .record(&g.tenant, &g.session, &g.entry, outcome, seen, imposed)
            .await
            .unwrap_or_default()
    }

    /// How the request ended, for the fleet: a failure is counted under its signature
    /// (and, hot, trips the session: the trip to impose is returned); a success of a
    /// watched shape cools its hot signatures down and judges predictions.
    async fn fleet_outcome(
        &self,
        g: &Guarded,
        shape: Option<Shape>,
        failure: Option<FailureKind>,
        failed: bool,
        facts: &Facts,
    ) -> Option<(Trip, Duration)> {
        let policy = g.fleet.as_ref()?;
        if !failed {
            let shape = shape?;
            let done = self.fleet.succeeded(&g.tenant, shape.key, &g.session).await;
            if done.unconfirmed {
                metrics::counter!("backstop_fleet_predictions_total", "outcome" => "unconfirmed")
                    .increment(1);
            }
            if done.cooled > 0 {
                tracing::info!(
                    tenant = &*g.tenant,
                    session = &*g.session,
                    cooled = done.cooled,
                    "a hot failure signature cooled down: a request of its shape succeeded"
                );
            }
            return None;
        }
        // A failure that says nothing of the request is not read at all.
        let failure = failure?;
        let sig = Signature::new(&shape.unwrap_or_else(|| g.shape()), &failure);
        self.fleet_failed(g, policy, &sig, facts).await
    }

    /// A failure counted under its signature: the trip to impose, if it trips the session.
    async fn fleet_failed(
        &self,
        g: &Guarded,
        policy: &FleetPolicy,
        sig: &Signature,
        facts: &Facts,
    ) -> Option<(Trip, Duration)> {
        let (calls, usd) = (facts.recovery.attempts, facts.spent_usd);
        let verdict = self
            .fleet
            .failed(&g.tenant, sig, &g.session, calls, usd)
            .await;
        fleet_verdict(g, policy, &verdict)
    }

    /// A failure counted under its signature in the guard's write-back (replica mode).
    async fn fleet_failed_in_write_back(
        &self,
        g: &Guarded,
        policy: &FleetPolicy,
        sig: &Signature,
        failure: &Outcome,
        facts: &Facts,
    ) -> WriteBack {
        let marked = Trip {
            signature: Some(sig.id.0),
            ..Trip::new(
                TripRule::FleetPattern,
                Hot::evidence_marked(sig.id, &sig.description, policy),
            )
        };
        let (calls, usd) = (facts.recovery.attempts, facts.spent_usd);
        let write = |candidates| {
            self.fleet
                .failed_and_save(&g.tenant, sig, &g.session, calls, usd, candidates)
        };
        let imposed = |verdict: &Failed| fleet_imposed(verdict, policy);
        let recorded = self
            .guards
            .record_failure(
                &g.tenant,
                &g.session,
                &g.entry,
                failure,
                &(marked, policy.cool_down),
                &EVIDENCE_MARKS,
                write,
                imposed,
            )
            .await;
        match recorded {
            Ok(Some((verdict, change))) => {
                fleet_verdict(g, policy, &verdict);
                WriteBack::Counted(change)
            }
            Ok(None) => WriteBack::NotFolded,
            // Unreadable (already logged): counted in the fleet, not in the guard.
            Err(_) => WriteBack::Counted(None),
        }
    }

    /// What the session has left, for `x-backstop-budget-remaining`: what the settle of
    /// the request's last call saw of the shared state (`seen`), else read.
    async fn remaining(
        &self,
        log: &RequestLog,
        tenant: &str,
        session: &str,
        seen: Option<SessionSeen>,
    ) {
        if let Some(remaining) = self.budgets.remaining_header(tenant, session, seen).await {
            log.set_budget_remaining(remaining);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16) -> Result<Response<Body>, GatewayError> {
        Ok(Response::builder()
            .status(status)
            .body(Body::empty())
            .unwrap())
    }

    #[test]
    fn an_error_answer_fails_its_session_and_a_refusal_does_not() {
        assert_eq!(status(&answered(200)), (200, false));
        assert_eq!(status(&answered(404)), (404, true));
        assert_eq!(status(&answered(503)), (503, true));
        let refused = GatewayError::RateLimited {
            detail: String::new(),
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(status(&Err(refused)), (429, false));
        let invalid = GatewayError::OutputInvalid {
            errors: vec![],
            attempts: 1,
        };
        assert_eq!(status(&Err(invalid)), (502, true));
    }
}
