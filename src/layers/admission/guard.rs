//! The session guard: a guarded tenant's session is fingerprinted and admitted or
//! refused ([`SessionGuard::admit`]) with its limits, in replica mode in the limits'
//! round trip ([`super::gate`]), the guard's write-back going only if the limits let the
//! request through. A refusal is 429 `session_tripped` or `loop_detected`, its message
//! naming the rule and its evidence, Retry-After until the probe. A trip is written to
//! the store when it happens (and forgotten when the session is active again).

use std::sync::{
    atomic::{AtomicBool, Ordering},
    Arc,
};

use super::{
    gate::{Admitted, GateRequest, Guidance},
    trip::{evidence, persist, refusal, refused_entry, restarted, to_keep, transition, tripped},
    unreadable, AdmissionLayer,
};
use crate::{
    api::{fingerprint::fingerprint, signature, ParsedRequest},
    error::GatewayError,
    layers::context::Call,
    policy::{
        fleet::{FleetPolicy, Hot, Shape},
        guard::{GuardState, Phase, RequestFingerprint, SessionGuard, Transition, Trip, TripRule},
    },
    routing::Route,
    state::{
        budgets::{reservation::Ask, Refusal},
        guard_view::Write,
        live::{Change, GuardedSession, TraceId},
        restarts::Event,
        sessions::{lock, GuardRef, Saving},
    },
};

/// One guarded request's facts: its session's guard, and what the guard, the fleet and
/// the trace entries read of it.
pub(super) struct Guarded {
    pub(super) tenant: Arc<str>,
    pub(super) session: Arc<str>,
    pub(super) entry: GuardRef,
    pub(super) request_id: String,
    pub(super) fp: RequestFingerprint,
    pub(super) request: Arc<ParsedRequest>,
    /// Its `model` (a pattern) goes in the request's fleet shape.
    pub(super) route: Arc<Route>,
    /// The tenant's fleet rule, when it has one.
    pub(super) fleet: Option<Arc<FleetPolicy>>,
    /// The session's spend so far, for the guard's spend samples.
    pub(super) usd_before: f64,
}

impl Guarded {
    pub(super) fn shape(&self) -> Shape {
        signature::shape(
            &self.route.pattern,
            self.request.endpoint,
            &self.request.json,
        )
    }

    /// A request refused, or its session tripped (`what`), by a hot signature.
    pub(super) fn hot(&self, hot: &Hot, what: &'static str) {
        tracing::warn!(
            tenant = &*self.tenant,
            session = &*self.session,
            signature = %hot.id,
            sessions = hot.sessions,
            request_id = self.request_id,
            what,
            "a hot failure signature (fleet_pattern)"
        );
    }

    /// The `tool_loop` count its trace entries show.
    pub(super) fn tool_loop(&self) -> u32 {
        self.fp.tool_loop.as_ref().map_or(0, |(_, n)| *n)
    }

    /// A refusal's trace entry.
    pub(super) fn refused(&self, e: &mut GuardedSession, trip: &Trip) {
        let state = e.guard.state().phase();
        e.trace(refused_entry(
            &self.request_id,
            self.tool_loop(),
            trip,
            state,
        ));
    }
}

impl AdmissionLayer {
    /// What a request (`g`) did to its session's state: the change logged and counted
    /// (trips by rule), the restart record's events, and the change kept for the
    /// session's report with its evidence.
    pub(super) fn changed(&self, g: &Guarded, e: &mut GuardedSession, change: Option<Transition>) {
        transition(&g.tenant, &g.session, change, &g.request_id);
        tripped(&self.fleet, &g.tenant, &e.guard, change);
        let restarts = self.guards.restarts();
        let recovered = e.guard.take_recovery();
        restarted(restarts, &g.tenant, change, &e.guard, recovered);
        if let (Some((_, Phase::Tripped)), GuardState::Tripped { trip, .. }) =
            (change, e.guard.state())
        {
            restarts.count(&g.tenant, Event::Tripped(trip.rule.as_str()));
        }
        if let Some((from, to)) = change {
            let evidence = evidence(e.guard.state(), recovered, self.guards.now());
            e.changed(Change {
                at_ms: self.guards.now_ms(),
                from,
                to,
                request_id: TraceId::new(&g.request_id),
                evidence,
            });
        }
    }

    /// A request refused by a trip: what it would have cost (its session's mean call
    /// cost) is counted as saved.
    pub(super) fn saved(&self, g: &Guarded, e: &GuardedSession, trip: &Trip) {
        if trip.rule != TripRule::Closed {
            let usd = e.mean_call_usd();
            self.guards
                .restarts()
                .count(&g.tenant, Event::Refused { usd });
        }
    }
}

impl AdmissionLayer {
    /// The session's guard, if the call has a session and its tenant a guard; a state
    /// this replica cannot read refuses the request (503 `state_unavailable`).
    pub(super) async fn guarded(&self, call: &Call) -> Result<Option<Guarded>, GatewayError> {
        let Some(session) = call.session.clone() else {
            return Ok(None);
        };
        let tenant = call.tenant.clone();
        let Some(entry) = self
            .guards
            .entry(&tenant, &session)
            .await
            .map_err(unreadable)?
        else {
            return Ok(None);
        };
        // The session's spend so far, for the guard's spend samples: read when the
        // guard's backend says it is worth it, else what this replica last saw of it
        // (the settle of its last call here, or another replica's newer sample).
        let usd_before = if self.guards.reads_spend(&tenant) {
            self.budgets.session_usd(&tenant, &session).await
        } else {
            lock(&entry).seen_usd
        };
        Ok(Some(Guarded {
            request_id: call.request_id.to_str().unwrap_or("-").to_owned(),
            fp: fingerprint(&call.request.json),
            request: call.request.clone(),
            route: call.route.clone(),
            fleet: self.fleet.policy(&tenant).cloned(),
            tenant,
            session,
            entry,
            usd_before,
        }))
    }

    /// The limits and the guard's admission, the limits deciding first: the guard's
    /// write-back (replica mode) goes in the limits' round trip, written only if they let
    /// the request through.
    pub(super) async fn admit(
        &self,
        g: &Guarded,
        prepay: Option<&Ask>,
    ) -> Result<Admitted, GatewayError> {
        let admit = |guard: &mut SessionGuard, now| {
            let usd = g.usd_before.max(guard.last_spend().unwrap_or(0.0));
            guard.admit(now, &g.fp, usd)
        };
        let refuses = AtomicBool::new(false);
        let ((admitted, change), gated) = self
            .guards
            .update_with(
                &g.tenant,
                &g.session,
                &g.entry,
                |guard, now| {
                    let verdict = admit(guard, now);
                    refuses.store(verdict.0.is_err(), Ordering::Relaxed);
                    verdict
                },
                g.fp.request,
                |write| self.gate(g, write, refuses.load(Ordering::Relaxed), prepay),
            )
            .await
            .map_err(unreadable)?;
        let mut slot = match gated {
            Some(Ok(slot)) => slot,
            Some(Err(refusal)) => return Err(refusal.into()),
            // The gate was not asked (a reload removed the tenant's guard meanwhile): the
            // limits alone.
            None => self.limits(&g.tenant, Some(&g.session), prepay).await?,
        };
        let keep = {
            let mut e = lock(&g.entry);
            self.changed(g, &mut e, change);
            let keep = to_keep(change, &e.guard, self.guards.now());
            if let Err(refused) = &admitted {
                g.refused(&mut e, &refused.trip);
                self.saved(g, &e, &refused.trip);
            }
            // The request a loop rule guides goes on with the note naming its loop.
            if let (Some((_, Phase::Guided)), GuardState::Guided { guide }) =
                (change, e.guard.state())
            {
                slot.guided = Some(Guidance {
                    note: guide.note(),
                    rule: guide.rule.as_str(),
                });
            }
            keep
        };
        persist(&self.guards, &g.tenant, &g.session, keep).await;
        if let Err(refused) = &admitted {
            self.fleet_refused(g, &refused.trip, change).await;
        }
        admitted.map_err(refusal)?;
        Ok(slot)
    }

    /// The guard's write-back as the limits' round trip carries it.
    async fn gate(
        &self,
        g: &Guarded,
        write: Option<Write>,
        refuses: bool,
        prepay: Option<&Ask>,
    ) -> Saving<Result<Admitted, Refusal>> {
        GateRequest::limits(&g.tenant, Some(&g.session))
            .prepaying(prepay)
            .guarding(write, self.guards.shared_ttl_ms(), refuses)
            .send(&self.budgets)
            .await
            .saving()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{super::tests::*, *};
    use crate::{policy::guard::Phase, store::GuardStates};

    #[tokio::test(start_paused = true)]
    async fn the_guard_refuses_the_request_past_the_identical_limit_and_keeps_the_trip() {
        let s = setup("", GUARDED);
        let call = call(&s.routes, Some("s"), CHAT);
        let g = s
            .layer
            .guarded(&call)
            .await
            .unwrap()
            .expect("a guarded session");
        for _ in 0..3 {
            assert!(s.layer.admit(&g, None).await.is_ok());
        }
        let err = s.layer.admit(&g, None).await.err().expect("refused");
        assert_eq!(err.code().as_str(), "loop_detected");
        assert_eq!(err.retry_after(), Some(COOL_DOWN));
        assert_eq!(
            err.to_string(),
            "loop_detected (identical_request_limit): the same request was sent 4 times within 10m"
        );
        assert_eq!(lock(&g.entry).guard.state().phase(), Phase::Tripped);
        let kept = s.store.guard_state("t", "s").await.unwrap().expect("kept");
        assert_eq!(
            (&*kept.code, &*kept.rule),
            ("loop_detected", "identical_request_limit")
        );
        tokio::time::advance(Duration::from_secs(10)).await;
        let err = s
            .layer
            .admit(&g, None)
            .await
            .err()
            .expect("still cooling down");
        assert_eq!(err.retry_after(), Some(Duration::from_secs(50)));
    }

    #[tokio::test]
    async fn no_session_or_an_unguarded_tenant_has_no_guard() {
        let s = setup("", GUARDED);
        assert!(s
            .layer
            .guarded(&call(&s.routes, None, CHAT))
            .await
            .unwrap()
            .is_none());
        let s = setup("", "");
        assert!(s
            .layer
            .guarded(&call(&s.routes, Some("s"), CHAT))
            .await
            .unwrap()
            .is_none());
    }
}
