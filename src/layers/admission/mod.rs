//! Admission layer (after idempotency, before validation): what a client request must
//! pass before it runs, and what its session learns after.
//!
//! Before: the tenant's and the session's request rate (governor GCRA), the session's
//! concurrent requests ([`limits`]), and, for a guarded tenant's session, the session
//! guard ([`guard`]), which stops one agent's own loops that upstream breakers cannot
//! see: it fingerprints the request and admits or refuses it ([`SessionGuard::admit`]).
//! Refuses with 429 `rate_limited` (Retry-After from the limiter's own wait),
//! `too_many_concurrent`, `session_tripped` or `loop_detected` (Retry-After until the
//! probe, and a message naming the rule and its evidence), before any upstream call.
//!
//! In replica mode all of that is one round trip to Redis ([`Budgets::gate`], typed in
//! [`gate`]: each concern puts its part in one request and reads its part of one
//! reply): the limits and the guard's compare-and-set write-back in one script, which
//! also makes the first upstream attempt's budget reservation ([`prepay`]: what the
//! meter would reserve for the route's first target; handed to the attempt through
//! [`Call::prepaid`], given back uncharged if no attempt asks for it), so a request
//! reaches the upstream after one round trip instead of two. After the call ([`after`])
//! the settle of its last upstream call (the meter's one round trip) hands back what
//! the session holds and its guard's version, so the remaining-budget header and the
//! guard's record of a success need no other read or write; only a failure (which
//! changes the guard) writes the guard again.
//!
//! For a tenant with `[tenants.guard.fleet]`, the session's failures are also counted in
//! the tenant's fleet view ([`fleet`], [`Fleet`]): a failure whose signature is hot trips
//! the session at once (rule `fleet_pattern`, the signature and how many sessions shared
//! it as evidence; in replica mode counted and imposed in the guard's one write after
//! the call), and with `preempt` a request whose shape is a hot signature's is refused
//! (429 `session_tripped`, `fleet_pattern`) before the limits or any attempt, unless it
//! is the signature's probe. Nothing of this is hashed or asked on the success path
//! unless the tenant has a hot signature or a prediction pending.
//!
//! The concurrency slot is held until the response body ends, so a stream counts while
//! it streams. Every response of a guarded session carries `x-backstop-session-state`,
//! and of a budgeted one `x-backstop-budget-remaining`. A trip is written to the store
//! when it happens (and forgotten when the session is active again), so it outlives a
//! restart or the session idling out of memory. A session whose kept or shared state
//! this replica cannot read (a newer release's format) is refused with 503
//! `state_unavailable`. Spend caps are per upstream call: see the meter layer.
//!
//! [`SessionGuard::admit`]: crate::policy::guard::SessionGuard::admit

mod after;
mod failure;
mod fleet;
mod gate;
mod guard;
mod limits;
mod prepay;
#[cfg(test)]
mod tests;
mod trip;

use std::{sync::Arc, time::Instant};

use axum::body::Body;
use http::Response;
use tower::{Layer, Service};

use super::{context::Call, Holding, Middleware, Stack};
use crate::{
    error::GatewayError,
    policy::{fleet::Shape, trail::Step},
    state::{
        budgets::{reservation::Ask, Budgets, ConcurrencySlot},
        fleet::Fleet,
        sessions::{lock, SessionGuards},
    },
    store::format::UnknownFormat,
    telemetry::RequestLog,
};
use gate::Admitted;
use guard::Guarded;

#[derive(Clone)]
pub struct AdmissionLayer {
    budgets: Arc<Budgets>,
    guards: Arc<SessionGuards>,
    fleet: Arc<Fleet>,
}

impl AdmissionLayer {
    pub fn new(budgets: Arc<Budgets>, guards: Arc<SessionGuards>, fleet: Arc<Fleet>) -> Self {
        AdmissionLayer {
            budgets,
            guards,
            fleet,
        }
    }
}

pub type Admission<S> = Stack<AdmissionLayer, S>;

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;
    fn layer(&self, inner: S) -> Admission<S> {
        Stack::new(self.clone(), inner)
    }
}

/// One request, as admission sees it from before its call until after.
struct Asking {
    tenant: Arc<str>,
    session: Option<Arc<str>>,
    log: Arc<RequestLog>,
    /// The session's guard: `None` without a session, or for a tenant without a guard.
    guarded: Option<Guarded>,
    /// What the gate is to reserve for the first attempt (replica mode, budgeted).
    prepay: Option<Ask>,
}

/// What the request was let through with (or refused by), and its fleet shape.
struct Before {
    admitted: Result<Admitted, GatewayError>,
    /// The request's shape, only while the tenant's fleet view watches one.
    shape: Option<Shape>,
}

/// A session whose guard state cannot be read here is refused, not started over: a
/// retry may reach a replica that reads it.
fn unreadable(unknown: UnknownFormat) -> GatewayError {
    GatewayError::StateUnavailable {
        detail: format!("this session's guard state cannot be read by this replica: {unknown}"),
        retry_after: std::time::Duration::from_secs(1),
    }
}

/// Holds `slot` (if any) until the response body ends.
fn holding(response: Response<Body>, slot: Option<ConcurrencySlot>) -> Response<Body> {
    match slot {
        Some(slot) => response.map(|body| Body::new(Holding { body, _guard: slot })),
        None => response,
    }
}

impl AdmissionLayer {
    /// Who is asking: the tenant, the session and its guard (read first: a state this
    /// replica cannot read refuses the request), and the first attempt's reservation.
    async fn asking(&self, call: &Call) -> Result<Asking, GatewayError> {
        Ok(Asking {
            guarded: self.guarded(call).await?,
            prepay: self.first_ask(call),
            tenant: call.tenant.clone(),
            session: call.session.clone(),
            log: call.log.clone(),
        })
    }

    /// Before the call: the limits alone, or for a guarded session the fleet's
    /// preemption, then the limits and the guard (one round trip in replica mode); the
    /// session's state is recorded for its header either way.
    async fn before(&self, a: &Asking) -> Before {
        let Some(g) = &a.guarded else {
            let session = a.session.as_deref();
            let admitted = self.limits(&a.tenant, session, a.prepay.as_ref()).await;
            return Before {
                admitted,
                shape: None,
            };
        };
        let shape = self.watched_shape(g).await;
        let admitted = match self.preempt(g, shape.as_ref()).await {
            Ok(()) => self.admit(g, a.prepay.as_ref()).await,
            Err(refused) => Err(refused),
        };
        a.log
            .set_session_state(lock(&g.entry).guard.state().phase());
        Before { admitted, shape }
    }
}

impl<S> Middleware<S, Call> for AdmissionLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, mut call: Call) -> Result<Response<Body>, GatewayError> {
        // Who is asking, and what it must pass before it runs.
        let asking = self.asking(&call).await?;
        let before = self.before(&asking).await;
        // The first attempt's reservation (and a guided request's note) go with the call;
        // the slot stays here.
        let (slot, guided) = before.admitted?.hand_over(&mut call);
        let started = Instant::now();
        let result = inner.call(call).await;
        if let Some(rule) = guided {
            asking.log.precede_recovery(Step::Guided(rule));
        }
        // What the session learns of how it went.
        let ended = asking.ended(&result);
        self.after(&asking, before.shape, ended, started).await;
        Ok(holding(result?, slot))
    }
}
