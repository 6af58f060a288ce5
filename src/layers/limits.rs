//! Limits layer (pipeline step 4, after the request context): the tenant's and the
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
use futures_util::future::BoxFuture;
use http::{Request, Response};
use http_body::Frame;
use tower::{Layer, Service};

use crate::{
    error::GatewayError, layers::context::RequestContext, state::budgets::Budgets,
    telemetry::RequestLog,
};

#[derive(Clone)]
pub struct LimitsLayer {
    budgets: Arc<Budgets>,
}

impl LimitsLayer {
    pub fn new(budgets: Arc<Budgets>) -> Self {
        LimitsLayer { budgets }
    }
}

impl<S> Layer<S> for LimitsLayer {
    type Service = Limits<S>;
    fn layer(&self, inner: S) -> Limits<S> {
        Limits {
            inner,
            budgets: self.budgets.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Limits<S> {
    inner: S,
    budgets: Arc<Budgets>,
}

/// A body that holds something (a concurrency slot) until it is finished or dropped.
struct Holding<G> {
    body: Body,
    _guard: G,
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

impl<S> Service<Request<Body>> for Limits<S>
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
        let budgets = self.budgets.clone();
        Box::pin(async move {
            let ctx = RequestContext::of(&req)?;
            let log = req.extensions().get::<Arc<RequestLog>>().cloned();
            let session = ctx.session_id.as_deref();
            budgets
                .check_rate(&ctx.tenant, session)
                .map_err(GatewayError::from)?;
            let slot = match session {
                Some(s) => budgets
                    .enter(&ctx.tenant, s)
                    .await
                    .map_err(GatewayError::from)?,
                None => None,
            };
            let result = inner.call(req).await;
            if let (Some(log), Some(session)) = (log, session) {
                if let Some(remaining) = budgets.remaining_header(&ctx.tenant, session).await {
                    log.update(|f| f.budget_remaining = Some(remaining));
                }
            }
            let response = result?;
            Ok(match slot {
                Some(slot) => response.map(|body| Body::new(Holding { body, _guard: slot })),
                None => response,
            })
        })
    }
}
