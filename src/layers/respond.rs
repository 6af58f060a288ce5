//! Respond layer (just inside the edge): the boundary where typed errors stop. Every
//! `Err(GatewayError)` from the layers below, and any panic, becomes a response in the
//! caller's API shape, so the services above are `Infallible`.
//! (Not tower-http's `CatchPanicLayer`: it answers a plain-text 500, not the caller's shape.)

use std::{
    convert::Infallible,
    panic::AssertUnwindSafe,
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::{future::BoxFuture, FutureExt};
use http::{Request, Response};
use tower::{Layer, Service};

use crate::{
    api::Endpoint,
    error::{
        respond::{error_response, mark_no_retry},
        GatewayError,
    },
    telemetry::RequestLog,
};

#[derive(Clone, Default)]
pub struct RespondLayer;

impl<S> Layer<S> for RespondLayer {
    type Service = Respond<S>;
    fn layer(&self, inner: S) -> Respond<S> {
        Respond { inner }
    }
}

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
}

impl<S> Service<Request<Body>> for Respond<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The layers below are always ready; an error here would be a bug, reported on call.
        let _ = self.inner.poll_ready(cx);
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let api = Endpoint::api_for_path(req.uri().path());
        let log = req.extensions().get::<Arc<RequestLog>>().cloned();
        // A panic while *creating* the future is caught too.
        let future = std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.call(req)));
        Box::pin(async move {
            let result = match future {
                Ok(future) => AssertUnwindSafe(future)
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| {
                        tracing::error!("a request handler panicked");
                        Err(GatewayError::Internal)
                    }),
                Err(_) => Err(GatewayError::Internal),
            };
            let mut response = result.unwrap_or_else(|err| {
                if let Some(log) = &log {
                    log.update(|f| f.error = Some(err.kind().code));
                }
                error_response(&err, api)
            });
            mark_no_retry(&mut response);
            Ok(response)
        })
    }
}
