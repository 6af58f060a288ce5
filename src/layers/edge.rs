//! Edge layer (outermost, step 1 of the pipeline): gives every request an id (the
//! client's `x-request-id` when it sent a sane one), counts it in flight, and when the
//! response head is ready writes the one log line and the request metrics. Never refuses.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{HeaderName, HeaderValue, Request, Response};
use tower::{Layer, Service};

use crate::{api::Endpoint, telemetry::RequestLog};

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request id, for layers that tag their own logs or upstream calls with it.
#[derive(Clone, Debug)]
pub struct RequestId(pub HeaderValue);

#[derive(Clone, Default)]
pub struct EdgeLayer;

impl<S> Layer<S> for EdgeLayer {
    type Service = Edge<S>;
    fn layer(&self, inner: S) -> Edge<S> {
        Edge { inner }
    }
}

#[derive(Clone)]
pub struct Edge<S> {
    inner: S,
}

/// The client's `x-request-id` when it is 1–128 visible ASCII bytes, else a new one: the
/// one rule for every route, so no header of any length is ever reflected.
pub fn request_id<B>(req: &Request<B>) -> HeaderValue {
    req.headers()
        .get(&X_REQUEST_ID)
        .filter(|v| {
            let b = v.as_bytes();
            !b.is_empty() && b.len() <= 128 && b.iter().all(|c| c.is_ascii_graphic())
        })
        .cloned()
        .unwrap_or_else(|| {
            let id = uuid::Uuid::new_v4().simple().to_string();
            HeaderValue::from_str(&id).expect("hex is a valid header value")
        })
}

/// Decrements the in-flight gauge however the request ends, dropped futures included.
struct InFlight;

impl InFlight {
    fn enter() -> Self {
        metrics::gauge!("backstop_in_flight_requests").increment(1.0);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!("backstop_in_flight_requests").decrement(1.0);
    }
}

impl<S> Service<Request<Body>> for Edge<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let started = Instant::now();
        let guard = InFlight::enter();
        let id = request_id(&req);
        let log = Arc::new(RequestLog::default());
        let endpoint = Endpoint::from_path(req.uri().path()).map_or("other", Endpoint::label);
        req.headers_mut().insert(X_REQUEST_ID.clone(), id.clone());
        req.extensions_mut().insert(RequestId(id.clone()));
        req.extensions_mut().insert(log.clone());
        let future = self.inner.call(req);
        Box::pin(async move {
            let mut response = future.await?;
            drop(guard);
            let elapsed = started.elapsed();
            let fields = log.snapshot();
            let headers = response.headers_mut();
            headers.insert(X_REQUEST_ID.clone(), id.clone());
            headers.insert("x-backstop-attempts", HeaderValue::from(fields.attempts));
            let recovery = fields.recovery_header();
            if let Some(value) = recovery
                .as_deref()
                .and_then(|r| HeaderValue::from_str(r).ok())
            {
                headers.insert("x-backstop-recovery", value);
            }
            if let Some(state) = fields.session_state {
                headers.insert(
                    "x-backstop-session-state",
                    HeaderValue::from_static(state.label()),
                );
            }
            if let Some(remaining) = fields
                .budget_remaining
                .as_deref()
                .and_then(|r| HeaderValue::from_str(r).ok())
            {
                headers.insert("x-backstop-budget-remaining", remaining);
            }
            let status = response.status().as_u16();
            let tenant = fields.tenant.as_deref().unwrap_or("-");
            metrics::counter!(
                "backstop_requests_total",
                "endpoint" => endpoint,
                "tenant" => tenant.to_owned(),
                "status" => status_class(status),
            )
            .increment(1);
            metrics::histogram!("backstop_request_duration_seconds", "endpoint" => endpoint)
                .record(elapsed.as_secs_f64());
            if fields.attempts > 0 {
                let overhead = elapsed.saturating_sub(fields.upstream_time);
                metrics::histogram!("backstop_overhead_seconds").record(overhead.as_secs_f64());
            }
            tracing::info!(
                request_id = id.to_str().unwrap_or("-"),
                endpoint,
                tenant,
                session = fields.session.as_deref().unwrap_or("-"),
                model = fields.model.as_deref().unwrap_or("-"),
                upstream = fields.upstream.as_deref().unwrap_or("-"),
                status,
                error = fields.error.unwrap_or("-"),
                attempts = fields.attempts,
                recovery = recovery.as_deref().unwrap_or(""),
                latency_ms = elapsed.as_secs_f64() * 1e3,
                upstream_ms = fields.upstream_time.as_secs_f64() * 1e3,
                "request"
            );
            Ok(response)
        })
    }
}

fn status_class(status: u16) -> &'static str {
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
