//! Respond layer (inside the edge and trace layers, outside the deadline): the boundary where typed errors stop. Every
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
        Respond {
            inner,
            not_ready: None,
        }
    }
}

pub struct Respond<S> {
    inner: S,
    /// The inner service failed to become ready: answered on the call it delayed.
    not_ready: Option<GatewayError>,
}

impl<S: Clone> Clone for Respond<S> {
    fn clone(&self) -> Self {
        Respond {
            inner: self.inner.clone(),
            not_ready: None,
        }
    }
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
        // Back-pressure from below passes up; a readiness error cannot (this service is
        // infallible), so it is answered, in the caller's shape, on the call it delays.
        match std::task::ready!(self.inner.poll_ready(cx)) {
            Ok(()) => self.not_ready = None,
            Err(err) => self.not_ready = Some(err),
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let api = Endpoint::wire_for(req.uri().path(), req.headers());
        let log = req.extensions().get::<Arc<RequestLog>>().cloned();
        // A panic while *creating* the future is caught too.
        let future = match self.not_ready.take() {
            Some(err) => Ok(Err(err)),
            None => std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.call(req))).map(Ok),
        };
        Box::pin(async move {
            let result = match future {
                Ok(Err(not_ready)) => Err(not_ready),
                Ok(Ok(future)) => AssertUnwindSafe(future)
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
                    log.set_error(err.code());
                }
                error_response(&err, api)
            });
            mark_no_retry(&mut response);
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Waker;

    /// Not ready on the first poll, then failing to become ready.
    #[derive(Clone, Default)]
    struct Reluctant {
        polls: u32,
    }

    impl Service<Request<Body>> for Reluctant {
        type Response = Response<Body>;
        type Error = GatewayError;
        type Future = futures_util::future::Ready<Result<Response<Body>, GatewayError>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
            self.polls += 1;
            match self.polls {
                1 => Poll::Pending,
                _ => Poll::Ready(Err(GatewayError::Unauthorized)),
            }
        }

        fn call(&mut self, _: Request<Body>) -> Self::Future {
            panic!("called without being ready");
        }
    }

    #[tokio::test]
    async fn readiness_passes_up_and_a_readiness_error_is_answered() {
        let mut respond = RespondLayer.layer(Reluctant::default());
        let mut cx = Context::from_waker(Waker::noop());
        assert!(respond.poll_ready(&mut cx).is_pending());
        assert!(matches!(respond.poll_ready(&mut cx), Poll::Ready(Ok(()))));
        let response = respond.call(Request::new(Body::empty())).await.unwrap();
        assert_eq!(response.status(), 401);
    }
}
