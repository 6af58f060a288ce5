//! What recovery answers: the reply and which target gave it ([`Answered`]), or the
//! error ([`Unanswered`]), each with what recovery did (its [`Trail`]); and the two
//! ways its caller takes that apart ([`follow_trail`], [`unvalidated`]).

use axum::body::Body;
use http::Response;
use tower::{Layer, Service, ServiceExt};

use super::super::{
    context::{Call, TargetIndex},
    Middleware, Stack,
};
use crate::{
    error::GatewayError,
    telemetry::Trail,
    upstream::{AttemptError, Reply},
};

/// Which target of the route gave an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnsweredBy {
    /// The route's target at this index.
    Target(TargetIndex),
    /// The route's `context_fallback`: nothing comes after it.
    ContextFallback,
}

impl AnsweredBy {
    /// Where a strategy switch goes next, if anywhere.
    pub fn next(self) -> Option<TargetIndex> {
        match self {
            AnsweredBy::Target(TargetIndex(i)) => Some(TargetIndex(i + 1)),
            AnsweredBy::ContextFallback => None,
        }
    }
}

/// What recovery answers: the upstream's reply, for a success (or a caller fault passed
/// through) which target gave it, and what recovery did. Only the validate layer (or
/// [`UnvalidatedLayer`] where nothing is validated) takes this: it turns the reply into the
/// client's response and writes the trail into the request's record.
pub struct Answered {
    pub reply: Reply,
    /// `None` when the reply is the last failure, answered as it came.
    pub by: Option<AnsweredBy>,
    pub trail: Trail,
}

/// What recovery answers when nothing answered: the error, and what recovery did.
pub struct Unanswered {
    pub error: GatewayError,
    pub trail: Trail,
}

/// An inner service's readiness error: nothing was tried.
impl From<AttemptError> for Unanswered {
    fn from(err: AttemptError) -> Self {
        Unanswered {
            error: err.into(),
            trail: Trail::default(),
        }
    }
}

/// Only for readiness, which recovery fails only as its inner service does: a call's
/// outcome is taken apart by its caller ([`follow_trail`]), trail and all.
impl From<Unanswered> for GatewayError {
    fn from(unanswered: Unanswered) -> Self {
        unanswered.error
    }
}

/// Takes recovery's outcome apart: its trail is added to `trail`, the rest handed on.
pub fn follow_trail(
    result: Result<Answered, Unanswered>,
    trail: &mut Trail,
) -> Result<(Reply, Option<AnsweredBy>), GatewayError> {
    match result {
        Ok(Answered {
            reply,
            by,
            trail: done,
        }) => {
            trail.then(done);
            Ok((reply, by))
        }
        Err(Unanswered { error, trail: done }) => {
            trail.then(done);
            Err(error)
        }
    }
}

/// Recovery's outcome as the client's response, where nothing validates it: its trail
/// written into the request's record.
pub async fn unvalidated<S>(inner: S, call: Call) -> Result<Response<Body>, GatewayError>
where
    S: Service<Call, Response = Answered, Error = Unanswered>,
{
    let log = call.log.clone();
    let mut trail = Trail::default();
    let result = follow_trail(inner.oneshot(call).await, &mut trail);
    log.set_recovery(trail);
    Ok(result?.0.into_response())
}

/// The outer end of recovery on a stack without validation (`count_tokens`): see
/// [`unvalidated`].
#[derive(Clone, Copy, Debug, Default)]
pub struct UnvalidatedLayer;

impl<S> Layer<S> for UnvalidatedLayer {
    type Service = Stack<UnvalidatedLayer, S>;
    fn layer(&self, inner: S) -> Self::Service {
        Stack::new(*self, inner)
    }
}

impl<S> Middleware<S, Call> for UnvalidatedLayer
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, inner: S, call: Call) -> Result<Response<Body>, GatewayError> {
        unvalidated(inner, call).await
    }
}

/// A reply as recovery answers it, before its target and trail are known.
pub(super) fn answered(reply: Reply) -> Answered {
    Answered {
        reply,
        by: None,
        trail: Trail::default(),
    }
}
