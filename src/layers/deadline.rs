//! Deadline layer (inside respond, outside auth):
//! the whole client request, retries included, must produce a response
//! head within `server.request_timeout`, or it is answered 504 `request_timeout`. The
//! deadline is put in the request extensions so inner layers never wait past it.
//! (Not tower-http's `TimeoutLayer`: it answers an empty 408, not 504 in the caller's shape.)

use std::{
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::error::GatewayError;

/// When the client request must be answered by, and the timeout that set it.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    pub at: Instant,
    pub timeout: Duration,
}

#[derive(Clone)]
pub struct DeadlineLayer {
    timeout: Duration,
}

impl DeadlineLayer {
    pub fn new(timeout: Duration) -> Self {
        DeadlineLayer { timeout }
    }
}

impl<S> Layer<S> for DeadlineLayer {
    type Service = DeadlineService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        DeadlineService {
            inner,
            timeout: self.timeout,
        }
    }
}

#[derive(Clone)]
pub struct DeadlineService<S> {
    inner: S,
    timeout: Duration,
}

impl<S> Service<Request<Body>> for DeadlineService<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let deadline = Instant::now() + self.timeout;
        req.extensions_mut().insert(Deadline {
            at: deadline,
            timeout: self.timeout,
        });
        let future = self.inner.call(req);
        let timeout = self.timeout;
        Box::pin(async move {
            tokio::time::timeout_at(deadline, future)
                .await
                .unwrap_or(Err(GatewayError::RequestTimeout(timeout)))
        })
    }
}
