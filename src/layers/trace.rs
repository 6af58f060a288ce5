//! Trace layer (just inside the edge, on every proxied endpoint): opens the request's
//! OpenTelemetry span, a child of the client's `traceparent` when it sent one, and puts
//! it in the request log, where the recovery layer opens a child span per upstream
//! attempt. The span ends with what the log then says (tenant, session, models, usage,
//! recovery trail, refusal): at the response head for a whole answer, and when the body
//! is finished or dropped for an event stream, whose usage is known only at its end.
//!
//! With tracing off (no `[telemetry] otlp_endpoint`) it passes requests straight
//! through. Never refuses.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::future::{BoxFuture, Either};
use http::{Request, Response};
use http_body::Frame;
use tower::{Layer, Service};

use crate::{api::Endpoint, otel::Traces, telemetry::RequestLog, upstream::is_event_stream};

#[derive(Clone)]
pub struct TraceLayer {
    traces: Option<Arc<Traces>>,
}

impl TraceLayer {
    /// `None`: tracing off, a pass-through.
    pub fn new(traces: Option<Arc<Traces>>) -> Self {
        TraceLayer { traces }
    }
}

impl<S> Layer<S> for TraceLayer {
    type Service = Trace<S>;
    fn layer(&self, inner: S) -> Trace<S> {
        Trace {
            inner,
            traces: self.traces.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Trace<S> {
    inner: S,
    traces: Option<Arc<Traces>>,
}

impl<S> Service<Request<Body>> for Trace<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Either<S::Future, BoxFuture<'static, Result<Response<Body>, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let Some(traces) = &self.traces else {
            return Either::Left(self.inner.call(req));
        };
        let Some(log) = req.extensions().get::<Arc<RequestLog>>().cloned() else {
            return Either::Left(self.inner.call(req));
        };
        log.set_trace(traces.start_request(req.headers()));
        // Ends the span even if the request is dropped before its answer.
        let mut end = SpanEnd {
            log,
            endpoint: Endpoint::from_path(req.uri().path()),
            status: None,
        };
        let future = self.inner.call(req);
        Either::Right(Box::pin(async move {
            let response = future.await?;
            end.status = Some(response.status().as_u16());
            if !is_event_stream(response.headers()) {
                drop(end);
                return Ok(response);
            }
            Ok(response.map(|body| Body::new(Traced { body, _end: end })))
        }))
    }
}

/// Ends the request span when dropped, from the request log as it is then.
struct SpanEnd {
    log: Arc<RequestLog>,
    endpoint: Option<Endpoint>,
    /// `None` until the answer's head is out: a request dropped before it.
    status: Option<u16>,
}

impl Drop for SpanEnd {
    fn drop(&mut self) {
        if let Some(trace) = self.log.trace() {
            trace.end(&self.log.snapshot(), self.endpoint, self.status);
        }
    }
}

/// An event stream whose request span ends with it. `body` is declared first so it is
/// dropped first: the stream's usage reaches the log before the span reads it.
struct Traced {
    body: Body,
    _end: SpanEnd,
}

impl http_body::Body for Traced {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
