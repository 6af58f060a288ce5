//! Limits layer (inside idempotency, outside the session guard): the tenant's and the
//! session's request rate (governor GCRA), and the session's concurrent requests.
//! Refuses with 429 `rate_limited` (Retry-After from the limiter's own wait time) or
//! `too_many_concurrent`, before any upstream call. The concurrency slot is held until
//! the response body ends, so a stream counts while it streams. Afterwards it records
//! what the session has left, which the edge layer sends as
//! `x-backstop-budget-remaining`. Spend caps are per upstream call: see the meter layer.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body::Frame;
use tower::{Layer, Service};

use super::{context::Call, Middleware, Stack};
use crate::{error::GatewayError, state::budgets::Budgets};

#[derive(Clone)]
pub struct LimitsLayer {
    budgets: Arc<Budgets>,
}

impl LimitsLayer {
    pub fn new(budgets: Arc<Budgets>) -> Self {
        LimitsLayer { budgets }
    }
}

pub type Limits<S> = Stack<LimitsLayer, S>;

impl<S> Layer<S> for LimitsLayer {
    type Service = Limits<S>;
    fn layer(&self, inner: S) -> Limits<S> {
        Stack::new(self.clone(), inner)
    }
}

/// A body that holds something (a concurrency slot, a memory charge) until it is
/// finished or dropped.
pub(crate) struct Holding<G> {
    pub(crate) body: Body,
    pub(crate) _guard: G,
}

impl<G: Send + Unpin + 'static> http_body::Body for Holding<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<S> Middleware<S, Call> for LimitsLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, call: Call) -> Result<Response<Body>, GatewayError> {
        let budgets = &self.budgets;
        let (tenant, session, log) = (call.tenant.clone(), call.session.clone(), call.log.clone());
        budgets
            .check_rate(&tenant, session.as_deref())
            .await
            .map_err(GatewayError::from)?;
        let slot = match session.as_deref() {
            Some(s) => budgets
                .enter(&tenant, s)
                .await
                .map_err(GatewayError::from)?,
            None => None,
        };
        let result = inner.call(call).await;
        if let Some(session) = session.as_deref() {
            if let Some(remaining) = budgets.remaining_header(&tenant, session).await {
                log.set_budget_remaining(remaining);
            }
        }
        let response = result?;
        Ok(match slot {
            Some(slot) => response.map(|body| Body::new(Holding { body, _guard: slot })),
            None => response,
        })
    }
}
