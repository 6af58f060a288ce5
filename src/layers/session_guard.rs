//! Session-guard layer (pipeline step 8): stops one agent's own loops, which upstream
//! breakers cannot see. For a guarded tenant's session it fingerprints the request,
//! admits or refuses it ([`SessionGuard::admit`]), records how it ended, and keeps the
//! session's recovery trace. Refuses with 429 `session_tripped` or `loop_detected`,
//! Retry-After until the probe, and a message naming the rule and its evidence — before
//! any upstream call. Every response of a guarded session carries
//! `x-backstop-session-state`. A trip is written to the store when it happens (and
//! forgotten when the session is active again), so it outlives a restart or the
//! session idling out of memory. A session whose kept or shared state this replica
//! cannot read (a newer release's format) is refused with 503 `state_unavailable`.
//!
//! [`SessionGuard::admit`]: crate::policy::guard::SessionGuard::admit

use std::{sync::Arc, time::Instant};

use axum::body::Body;
use http::Response;
use tower::{Layer, Service};

use super::{context::Call, Middleware, Stack};
use crate::{
    api::fingerprint::fingerprint,
    error::GatewayError,
    policy::{
        guard::{Kept, Phase, SessionGuard, Transition},
        trail,
    },
    state::{
        budgets::Budgets,
        sessions::{lock, SessionGuards, TraceEntry},
    },
    store::format::UnknownFormat,
};

#[derive(Clone)]
pub struct SessionGuardLayer {
    guards: Arc<SessionGuards>,
    budgets: Arc<Budgets>,
}

impl SessionGuardLayer {
    pub fn new(guards: Arc<SessionGuards>, budgets: Arc<Budgets>) -> Self {
        SessionGuardLayer { guards, budgets }
    }
}

pub type Guarded<S> = Stack<SessionGuardLayer, S>;

impl<S> Layer<S> for SessionGuardLayer {
    type Service = Guarded<S>;
    fn layer(&self, inner: S) -> Guarded<S> {
        Stack::new(self.clone(), inner)
    }
}

fn transition(tenant: &str, session: &str, change: Option<Transition>, request_id: &str) {
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
        metrics::counter!("backstop_session_transitions_total", "from" => from, "to" => to)
            .increment(1);
    }
}

/// What a state change means for the store: `Some(kept)` to write (a trip, a probe, a
/// close), `Some(None)` to forget (active again), `None` for nothing to do.
fn to_keep(
    change: Option<Transition>,
    guard: &SessionGuard,
    now: tokio::time::Instant,
) -> Option<Option<Kept>> {
    let (from, to): (Phase, Phase) = change?;
    if to.is_kept() {
        Some(guard.kept(now))
    } else if from.is_kept() {
        Some(None)
    } else {
        None
    }
}

/// A session whose guard state cannot be read here is refused, not started over: a
/// retry may reach a replica that reads it.
fn unreadable(unknown: UnknownFormat) -> GatewayError {
    GatewayError::StateUnavailable {
        detail: format!("this session's guard state cannot be read by this replica: {unknown}"),
        retry_after: std::time::Duration::from_secs(1),
    }
}

async fn persist(guards: &SessionGuards, tenant: &str, session: &str, keep: Option<Option<Kept>>) {
    if let Some(kept) = keep {
        if let Err(err) = guards.persist(tenant, session, kept).await {
            // The state in memory still holds; only its survival of a restart is lost.
            tracing::error!(tenant, session, error = %err, "cannot keep the session's guard state");
        }
    }
}

impl<S> Middleware<S, Call> for SessionGuardLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, call: Call) -> Result<Response<Body>, GatewayError> {
        let layer = self;
        let entry = match call.session.as_deref() {
            Some(s) => layer
                .guards
                .entry(&call.tenant, s)
                .await
                .map_err(unreadable)?,
            None => None,
        };
        let (Some(entry), Some(session)) = (entry, call.session.clone()) else {
            return inner.call(call).await;
        };
        let log = call.log.clone();
        let request_id = call.request_id.to_str().unwrap_or("-").to_owned();
        let tenant = call.tenant.clone();
        let fp = fingerprint(&call.request.json);
        let usd_before = layer.budgets.session_usd(&tenant, &session).await;
        let (admitted, change) = layer
            .guards
            .update(&tenant, &session, &entry, |guard, now| {
                guard.admit(now, &fp, usd_before)
            })
            .await
            .map_err(unreadable)?;
        let (admitted, keep) = {
            let mut e = lock(&entry);
            let now = layer.guards.now();
            transition(&tenant, &session, change, &request_id);
            let keep = to_keep(change, &e.guard, now);
            if let Err(refused) = &admitted {
                let state = e.guard.state().label();
                e.trace(TraceEntry {
                    request_id: request_id.clone(),
                    status: 0,
                    failed: false,
                    action: format!("refused:{}", refused.trip.code().as_str()),
                    detail: Some(format!(
                        "{}: {}",
                        refused.trip.rule.as_str(),
                        refused.trip.evidence
                    )),
                    attempts: 0,
                    upstream: None,
                    latency_ms: 0.0,
                    cost_usd: 0.0,
                    tool_loop: fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
                    state,
                });
            }
            let phase = e.guard.state().phase();
            log.update(|f| f.session_state = Some(phase));
            (admitted, keep)
        };
        persist(&layer.guards, &tenant, &session, keep).await;
        if let Err(refused) = admitted {
            let code = refused.trip.code();
            metrics::counter!("backstop_refusals_total", "reason" => code.as_str()).increment(1);
            return Err(GatewayError::SessionRefused {
                code,
                detail: format!(
                    "{} ({}): {}",
                    code.as_str(),
                    refused.trip.rule.as_str(),
                    refused.trip.evidence
                ),
                retry_after: refused.retry_after,
            });
        }
        let started = Instant::now();
        let result = inner.call(call).await;
        let (status, failed) = match &result {
            Ok(r) => (r.status().as_u16(), r.status().as_u16() >= 400),
            Err(e) => (e.kind().status, !e.is_refusal()),
        };
        let usd_after = layer.budgets.session_usd(&tenant, &session).await;
        let fields = log.snapshot();
        // Shared state that became unreadable meanwhile is left as it is (already logged):
        // this outcome goes uncounted.
        let change = layer
            .guards
            .update(&tenant, &session, &entry, |guard, now| {
                guard.record(now, failed)
            })
            .await
            .unwrap_or_default();
        let keep = {
            let mut e = lock(&entry);
            let now = layer.guards.now();
            transition(&tenant, &session, change, &request_id);
            let keep = to_keep(change, &e.guard, now);
            let state = e.guard.state().label();
            e.trace(TraceEntry {
                request_id,
                status,
                failed,
                action: trail::render(&fields.recovery),
                detail: None,
                attempts: fields.attempts,
                upstream: fields.upstream,
                latency_ms: (started.elapsed().as_secs_f64() * 1e3) as f32,
                cost_usd: (usd_after - usd_before).max(0.0),
                tool_loop: fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
                state,
            });
            let phase = e.guard.state().phase();
            log.update(|f| f.session_state = Some(phase));
            keep
        };
        persist(&layer.guards, &tenant, &session, keep).await;
        result
    }
}
