//! One tower layer per concern. Their order is set in one place: [`crate::app`].
//!
//! Two kinds of seam, both types:
//! - outside the context layer, services take `Request<Body>` (edge, respond, deadline,
//!   auth);
//! - the [`ContextLayer`](context::ContextLayer) turns it into a [`Call`](context::Call),
//!   and every layer inside takes a `Call`, so mounting one of them before the context
//!   layer does not compile. Recovery answers [`Answered`](recovery::Answered) (the
//!   reply and which target gave it), which only the validate layer takes.
//!
//! The seam holds at compile time. A layer inside the context layer serves calls:
//!
//! ```
//! # use backstop::{layers::{context::Call, admission::Admission}, error::GatewayError};
//! # use tower::util::BoxCloneService;
//! # type Inner = BoxCloneService<Call, http::Response<axum::body::Body>, GatewayError>;
//! fn serves<Req, S: tower::Service<Req>>() {}
//! serves::<Call, Admission<Inner>>();
//! ```
//!
//! and so it cannot be mounted where HTTP requests arrive, before the context layer:
//!
//! ```compile_fail,E0277
//! # use backstop::{layers::{context::Call, admission::Admission}, error::GatewayError};
//! # use tower::util::BoxCloneService;
//! # type Inner = BoxCloneService<Call, http::Response<axum::body::Body>, GatewayError>;
//! fn serves<Req, S: tower::Service<Req>>() {}
//! serves::<http::Request<axum::body::Body>, Admission<Inner>>();
//! ```
//!
//! Those inner layers are written as a [`Middleware`]: one async function from the ready
//! inner service and the request to the response. [`Stack`] is the one tower adapter
//! around all of them (readiness, the clone-and-swap, boxing the future).

pub mod admission;
pub mod auth;
pub mod context;
pub mod deadline;
pub mod edge;
pub mod idempotency;
pub mod meter;
pub mod owners;
pub mod rates;
pub mod recovery;
pub mod respond;
pub mod side_effects;
pub mod trace;
pub mod translate;
pub mod validate;
mod validate_stream;

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http_body::Frame;
use tower::Service;

/// A layer's per-request logic. `inner` has been made ready for this one request.
pub trait Middleware<S, Req>: Clone + Send + Sync + 'static {
    /// What the inner service takes (the context layer takes HTTP and hands on a
    /// [`Call`](context::Call); recovery takes a call and hands on attempts).
    type Inner;
    type Response: Send + 'static;
    type Error: Send + 'static;

    fn call(
        &self,
        inner: S,
        req: Req,
    ) -> impl Future<Output = Result<Self::Response, Self::Error>> + Send;
}

/// The tower service of every [`Middleware`]: readiness comes from the inner service,
/// and the ready inner service goes with the request into the boxed future (tower's
/// clone-and-swap idiom), leaving a fresh clone behind for the next call.
#[derive(Clone)]
pub struct Stack<M, S> {
    middleware: M,
    inner: S,
}

impl<M, S> Stack<M, S> {
    pub fn new(middleware: M, inner: S) -> Self {
        Stack { middleware, inner }
    }
}

impl<M, S, Req> Service<Req> for Stack<M, S>
where
    M: Middleware<S, Req>,
    S: Service<M::Inner> + Clone + Send + 'static,
    S::Error: Into<M::Error>,
    Req: Send + 'static,
{
    type Response = M::Response;
    type Error = M::Error;
    type Future = BoxFuture<'static, Result<M::Response, M::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), M::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let middleware = self.middleware.clone();
        Box::pin(async move { middleware.call(inner, req).await })
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
