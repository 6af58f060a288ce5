//! Session-guard layer (pipeline step 5): stops one agent's own loops, which upstream
//! breakers cannot see. For a guarded tenant's session it fingerprints the request,
//! admits or refuses it ([`SessionGuard::admit`]), records how it ended, and keeps the
//! session's recovery trace. Refuses with 429 `session_tripped` or `loop_detected`,
//! Retry-After until the probe, and a message naming the rule and its evidence — before
//! any upstream call. Every response of a guarded session carries
//! `x-backstop-session-state`. A trip is written to the store when it happens (and
//! forgotten when the session is active again), so it outlives a restart or the
//! session idling out of memory.
//!
//! [`SessionGuard::admit`]: crate::policy::guard::SessionGuard::admit

use std::{
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use tower::{Layer, Service};

use crate::{
    error::GatewayError,
    layers::{context::RequestContext, edge::RequestId},
    policy::guard::{fingerprint, Kept, SessionGuard},
    state::{
        budgets::Budgets,
        sessions::{lock, SessionGuards, TraceEntry},
    },
    telemetry::RequestLog,
};

#[derive(Clone)]
pub struct GuardLayer {
    guards: Arc<SessionGuards>,
    budgets: Arc<Budgets>,
}

impl GuardLayer {
    pub fn new(guards: Arc<SessionGuards>, budgets: Arc<Budgets>) -> Self {
        GuardLayer { guards, budgets }
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;
    fn layer(&self, inner: S) -> Guard<S> {
        Guard {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    layer: GuardLayer,
}

fn transition(
    tenant: &str,
    session: &str,
    change: Option<(&'static str, &'static str)>,
    request_id: &str,
) {
    if let Some((from, to)) = change {
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
    change: Option<(&'static str, &'static str)>,
    guard: &SessionGuard,
    now: tokio::time::Instant,
) -> Option<Option<Kept>> {
    let (from, to) = change?;
    match (from, to) {
        (_, "tripped" | "probing" | "closed") => Some(guard.kept(now)),
        ("tripped" | "probing" | "closed", _) => Some(None),
        _ => None,
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

impl<S> Service<Request<Body>> for Guard<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let mut inner = super::take_ready(&mut self.inner);
        let layer = self.layer.clone();
        Box::pin(async move {
            let ctx = RequestContext::of(&req)?;
            let entry = match ctx.session_id.as_deref() {
                Some(s) => layer.guards.entry(&ctx.tenant, s).await,
                None => None,
            };
            let (Some(entry), Some(session)) = (entry, ctx.session_id.clone()) else {
                return inner.call(req).await;
            };
            let log = req.extensions().get::<Arc<RequestLog>>().cloned();
            let request_id = req
                .extensions()
                .get::<RequestId>()
                .and_then(|r| r.0.to_str().ok().map(str::to_owned))
                .unwrap_or_default();
            let tenant = ctx.tenant.clone();
            let fp = fingerprint(&ctx.json);
            let usd_before = layer.budgets.session_usd(&tenant, &session).await;
            let (admitted, keep) = {
                let mut e = lock(&entry);
                let now = layer.guards.now();
                let (admitted, change) = e.guard.admit(now, &fp, usd_before);
                transition(&tenant, &session, change, &request_id);
                let keep = to_keep(change, &e.guard, now);
                if let Err(refused) = &admitted {
                    let state = e.guard.state().label();
                    e.trace(TraceEntry {
                        request_id: request_id.clone(),
                        status: 0,
                        failed: false,
                        action: format!("refused:{}", refused.trip.code),
                        detail: Some(format!("{}: {}", refused.trip.rule, refused.trip.evidence)),
                        attempts: 0,
                        upstream: None,
                        latency_ms: 0.0,
                        cost_usd: 0.0,
                        tool_loop: fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
                        state,
                    });
                }
                let state = e.guard.state().label();
                if let Some(log) = &log {
                    log.update(|f| f.session_state = Some(state));
                }
                (admitted, keep)
            };
            persist(&layer.guards, &tenant, &session, keep).await;
            if let Err(refused) = admitted {
                metrics::counter!("backstop_refusals_total", "reason" => refused.trip.code)
                    .increment(1);
                return Err(GatewayError::SessionRefused {
                    code: refused.trip.code,
                    detail: format!(
                        "{} ({}): {}",
                        refused.trip.code, refused.trip.rule, refused.trip.evidence
                    ),
                    retry_after: refused.retry_after,
                });
            }
            let started = Instant::now();
            let result = inner.call(req).await;
            let (status, failed) = match &result {
                Ok(r) => (r.status().as_u16(), r.status().as_u16() >= 400),
                Err(e) => (e.kind().status, !e.is_refusal()),
            };
            let usd_after = layer.budgets.session_usd(&tenant, &session).await;
            let fields = log.as_ref().map(|l| l.snapshot()).unwrap_or_default();
            let keep = {
                let mut e = lock(&entry);
                let now = layer.guards.now();
                let change = e.guard.record(now, failed);
                transition(&tenant, &session, change, &request_id);
                let keep = to_keep(change, &e.guard, now);
                let state = e.guard.state().label();
                e.trace(TraceEntry {
                    request_id,
                    status,
                    failed,
                    action: fields.recovery,
                    detail: None,
                    attempts: fields.attempts,
                    upstream: fields.upstream,
                    latency_ms: (started.elapsed().as_secs_f64() * 1e3) as f32,
                    cost_usd: (usd_after - usd_before).max(0.0),
                    tool_loop: fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
                    state,
                });
                if let Some(log) = &log {
                    log.update(|f| f.session_state = Some(state));
                }
                keep
            };
            persist(&layer.guards, &tenant, &session, keep).await;
            result
        })
    }
}
