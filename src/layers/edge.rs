//! The edge: what every request passes, on every route.
//!
//! Around the whole router (ordered in [`crate::app`]) sit tower-http's layers, fed by
//! the pieces here: credentials marked sensitive, one request-id rule
//! ([`drop_invalid_request_id`] then [`MakeId`]: the client's `x-request-id` when it is
//! 1–128 visible ASCII bytes, else a new one; echoed on every response) and the request
//! body read timeout. Inside each stack's authentication, one tracing span per request
//! ([`EdgeSpan`], [`span_layer`]: `request_id`, `tenant`, `session`).
//!
//! [`EdgeLayer`] (outermost on the tenant, model-list and admin routes; the
//! [`TraceLayer`](super::trace::TraceLayer) is just inside it) puts [`RequestId`] and the
//! request's record ([`RequestLog`]) in the extensions and counts the request in flight.
//! When the response head is ready it sets the `x-backstop-*` headers from the record
//! and writes the request metrics and the dashboard's count; when the response body
//! ends (or is dropped) it writes the one access-log line and ends the request's span,
//! with the stream's usage, how the body ended ([`BodyEnd`]) and the full duration.
//! Never refuses.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{header, HeaderName, HeaderValue, Request, Response};
use http_body::Frame;
use tower::{Layer, Service};
use tower_http::{request_id::MakeRequestId, trace::MakeSpan};

use crate::{
    api::Endpoint,
    state::activity::Activity,
    telemetry::{AccessLine, BodyEnd, Facts, RequestLog},
};

pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The request id, for layers that tag their own logs or upstream calls with it.
#[derive(Clone, Debug)]
pub struct RequestId(pub HeaderValue);

/// Headers that carry credentials, in either direction: marked sensitive so that no
/// `Debug` output (logs, panics) ever shows them.
pub fn sensitive_headers() -> [HeaderName; 5] {
    [
        header::AUTHORIZATION,
        header::PROXY_AUTHORIZATION,
        HeaderName::from_static("x-api-key"),
        header::COOKIE,
        header::SET_COOKIE,
    ]
}

/// The one rule for a client's request id: 1–128 visible ASCII bytes, so no header of
/// any length or content is ever reflected.
pub fn is_valid_request_id(value: &HeaderValue) -> bool {
    let b = value.as_bytes();
    !b.is_empty() && b.len() <= 128 && b.iter().all(|c| c.is_ascii_graphic())
}

/// The step before tower-http's `SetRequestId`, which keeps any id it finds: a client id
/// that breaks [`is_valid_request_id`] is dropped, so a new one is made.
pub fn drop_invalid_request_id<B>(mut req: Request<B>) -> Request<B> {
    if req
        .headers()
        .get(&X_REQUEST_ID)
        .is_some_and(|v| !is_valid_request_id(v))
    {
        req.headers_mut().remove(&X_REQUEST_ID);
    }
    req
}

/// A new request id: a v4 UUID as 32 hex digits.
pub fn new_request_id() -> HeaderValue {
    let id = uuid::Uuid::new_v4().simple().to_string();
    HeaderValue::from_str(&id).expect("hex is a valid header value")
}

/// Makes the id for a request that came without a (valid) one.
#[derive(Clone, Copy, Debug, Default)]
pub struct MakeId;

impl MakeRequestId for MakeId {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<tower_http::request_id::RequestId> {
        Some(tower_http::request_id::RequestId::new(new_request_id()))
    }
}

/// The span every log line inside the stack is emitted in, made just inside the auth
/// layer with all its fields at once (`request_id`, `tenant`, `session`): recording a
/// field later makes the log formatter re-parse and re-write the span's fields, and a
/// span around the edge would put the access-log line (which has these fields already)
/// inside it too; measured, the two cost 10% of a request's instructions.
#[derive(Clone, Copy, Debug)]
pub struct EdgeSpan {
    /// `server.max_session_id_bytes`: a session id the context layer would refuse is not
    /// recorded.
    pub max_session_id_bytes: usize,
}

impl<B> MakeSpan<B> for EdgeSpan {
    fn make_span(&mut self, req: &Request<B>) -> tracing::Span {
        let id = req
            .headers()
            .get(&X_REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        let tenant = req
            .extensions()
            .get::<Arc<super::auth::Tenant>>()
            .map(|t| &*t.name);
        let session = crate::api::headers::identifier(
            req.headers(),
            "x-session-id",
            self.max_session_id_bytes,
        )
        .ok()
        .flatten();
        tracing::info_span!(
            "request",
            request_id = id,
            tenant,
            session = session.as_deref(),
        )
    }
}

/// The tracing layer of every authenticated stack: the span only, no log lines of its
/// own (the edge layer writes the one access-log line per request).
pub type SpanLayer = tower_http::trace::TraceLayer<
    tower_http::classify::SharedClassifier<tower_http::classify::ServerErrorsAsFailures>,
    EdgeSpan,
    (),
    (),
    (),
    (),
    (),
>;

pub fn span_layer(max_session_id_bytes: usize) -> SpanLayer {
    tower_http::trace::TraceLayer::new_for_http()
        .make_span_with(EdgeSpan {
            max_session_id_bytes,
        })
        .on_request(())
        .on_response(())
        .on_body_chunk(())
        .on_eos(())
        .on_failure(())
}

/// Trace wraps the response body (to enter the span while it streams); the layers
/// outside it take `Body`.
pub fn unwrap_body<B>(response: Response<B>) -> Response<Body>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    response.map(Body::new)
}

#[derive(Clone, Default)]
pub struct EdgeLayer {
    /// The `endpoint` label for every request of this stack, instead of one from the path.
    label: Option<&'static str>,
    /// Where each finished request is counted for the dashboard (the proxy stacks only:
    /// the dashboard's own polls are not traffic).
    activity: Option<Arc<Activity>>,
}

impl EdgeLayer {
    /// An edge whose requests are all labelled `label` (the unknown-path fallback).
    pub fn labelled(label: &'static str) -> Self {
        EdgeLayer {
            label: Some(label),
            activity: None,
        }
    }

    /// An edge that also counts every request's outcome and recovery in `activity`.
    pub fn counted(activity: Arc<Activity>) -> Self {
        EdgeLayer {
            label: None,
            activity: Some(activity),
        }
    }
}

impl<S> Layer<S> for EdgeLayer {
    type Service = Edge<S>;
    fn layer(&self, inner: S) -> Edge<S> {
        Edge {
            inner,
            label: self.label,
            activity: self.activity.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Edge<S> {
    inner: S,
    label: Option<&'static str>,
    activity: Option<Arc<Activity>>,
}

/// The `endpoint` metric label: low-cardinality, never a path with ids in it.
fn endpoint_label(path: &str) -> &'static str {
    match Endpoint::from_path(path) {
        Some(endpoint) => endpoint.label(),
        None if Endpoint::is_response_object_path(path) => "response_objects",
        None if path.starts_with("/admin/") => "admin",
        None if path.starts_with("/v1/sessions/") => "sessions",
        None if path == "/v1/models" || path.starts_with("/v1/models/") => "models",
        None => "other",
    }
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
        // Set around the whole router; made here only if this layer is used without it.
        let id = match req.headers().get(&X_REQUEST_ID) {
            Some(id) => id.clone(),
            None => {
                let id = new_request_id();
                req.headers_mut().insert(X_REQUEST_ID.clone(), id.clone());
                id
            }
        };
        let log = Arc::new(RequestLog::default());
        let label = self
            .label
            .unwrap_or_else(|| endpoint_label(req.uri().path()));
        req.extensions_mut().insert(RequestId(id.clone()));
        req.extensions_mut().insert(log.clone());
        // Finishes the record however the request ends, a dropped future included.
        let mut ending = Ending {
            log,
            id,
            label,
            endpoint: Endpoint::from_path(req.uri().path()),
            started,
            head: None,
        };
        let future = self.inner.call(req);
        let activity = self.activity.clone();
        Box::pin(async move {
            let mut response = future.await?;
            drop(guard);
            let elapsed = started.elapsed();
            let facts = ending.log.facts();
            set_headers(response.headers_mut(), &facts);
            let status = response.status().as_u16();
            if let Some(activity) = &activity {
                activity.record_request(tokio::time::Instant::now(), status, &facts);
            }
            let tenant = facts.tenant.as_deref().unwrap_or("-");
            metrics::counter!(
                "backstop_requests_total",
                "endpoint" => label,
                "tenant" => tenant.to_owned(),
                "status" => status_class(status),
            )
            .increment(1);
            metrics::histogram!("backstop_request_duration_seconds", "endpoint" => label)
                .record(elapsed.as_secs_f64());
            if facts.recovery.attempts > 0 {
                let overhead = elapsed.saturating_sub(facts.recovery.upstream_time);
                metrics::histogram!("backstop_overhead_seconds").record(overhead.as_secs_f64());
            }
            ending.head = Some((status, elapsed));
            Ok(response.map(|body| {
                Body::new(Finishing {
                    body,
                    ending,
                    ended: None,
                })
            }))
        })
    }
}

/// The `x-backstop-*` headers, from the record's typed facts.
fn set_headers(headers: &mut http::HeaderMap, facts: &Facts) {
    headers.insert(
        "x-backstop-attempts",
        HeaderValue::from(facts.recovery.attempts),
    );
    if let Some(value) = facts
        .recovery_header()
        .and_then(|r| HeaderValue::from_str(&r).ok())
    {
        headers.insert("x-backstop-recovery", value);
    }
    let recovery = &facts.recovery;
    // The model asked: a target's rewrite, else the request's own, once an attempt was made.
    let model = recovery
        .upstream
        .as_ref()
        .and(recovery.model.as_deref().or(facts.model.as_deref()));
    for (name, value) in [
        ("x-backstop-upstream", recovery.upstream.as_deref()),
        ("x-backstop-model", model),
        (
            "x-backstop-translation-dropped",
            recovery.dropped.as_deref(),
        ),
    ] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(name, value);
        }
    }
    if let Some(state) = facts.session_state {
        headers.insert(
            "x-backstop-session-state",
            HeaderValue::from_static(state.label()),
        );
    }
    if let Some(remaining) = facts
        .budget_remaining
        .as_deref()
        .and_then(|r| HeaderValue::from_str(r).ok())
    {
        headers.insert("x-backstop-budget-remaining", remaining);
    }
}

/// The end of a request: writes its access-log line and ends its span, once, when the
/// response body ends or is dropped (or the request is dropped before its head).
struct Ending {
    log: Arc<RequestLog>,
    id: HeaderValue,
    label: &'static str,
    endpoint: Option<Endpoint>,
    started: Instant,
    /// The status and the time to the response head, once the head is out.
    head: Option<(u16, std::time::Duration)>,
}

impl Ending {
    fn finish(&mut self, end: BodyEnd) {
        let elapsed = self.started.elapsed();
        let facts = self.log.facts();
        let end = end.or_cut(facts.stream_cut.is_some());
        let status = self.head.map(|(status, _)| status);
        super::trace::end_span(&self.log, &facts, self.endpoint, status, end);
        if !tracing::enabled!(tracing::Level::INFO) {
            return;
        }
        let usage = facts.usage;
        let reported = |n: Option<u64>| n.filter(|n| *n > 0);
        let recovery = facts.recovery_header();
        let line = AccessLine {
            timestamp: (),
            level: "INFO",
            message: "request",
            request_id: self.id.to_str().unwrap_or("-"),
            endpoint: self.label,
            tenant: facts.tenant.as_deref().unwrap_or("-"),
            session: facts.session.as_deref().unwrap_or("-"),
            model: facts.model.as_deref().unwrap_or("-"),
            upstream: facts.recovery.upstream.as_deref().unwrap_or("-"),
            status,
            error: facts.error.map_or("-", |code| code.as_str()),
            attempts: facts.recovery.attempts,
            recovery: recovery.as_deref().unwrap_or(""),
            input_tokens: usage.map(|t| t.input),
            output_tokens: usage.map(|t| t.output),
            cache_write_tokens: reported(usage.map(|t| t.cache_write())),
            cache_read_tokens: reported(usage.map(|t| t.cache_read)),
            reasoning_tokens: reported(usage.map(|t| t.reasoning)),
            end: end.label(),
            cut: facts.stream_cut,
            head_ms: self.head.map(|(_, head)| head.as_secs_f64() * 1e3),
            latency_ms: elapsed.as_secs_f64() * 1e3,
            upstream_ms: facts.recovery.upstream_time.as_secs_f64() * 1e3,
            target: module_path!(),
        };
        if !line.write_json() {
            tracing::info!(
                request_id = line.request_id,
                endpoint = line.endpoint,
                tenant = line.tenant,
                session = line.session,
                model = line.model,
                upstream = line.upstream,
                status = line.status,
                error = line.error,
                attempts = line.attempts,
                recovery = line.recovery,
                input_tokens = line.input_tokens,
                output_tokens = line.output_tokens,
                cache_write_tokens = line.cache_write_tokens,
                cache_read_tokens = line.cache_read_tokens,
                reasoning_tokens = line.reasoning_tokens,
                end = line.end,
                cut = line.cut,
                head_ms = line.head_ms,
                latency_ms = line.latency_ms,
                upstream_ms = line.upstream_ms,
                "request"
            );
        }
    }
}

impl Drop for Ending {
    /// Only a request dropped before its head gets here unfinished.
    fn drop(&mut self) {
        if self.head.is_none() {
            self.finish(BodyEnd::ClientGone);
        }
    }
}

/// The response body, finishing the request's record when it ends.
struct Finishing {
    body: Body,
    ending: Ending,
    ended: Option<BodyEnd>,
}

impl http_body::Body for Finishing {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.ended = Some(BodyEnd::Complete),
            Poll::Ready(Some(Err(_))) => self.ended = Some(BodyEnd::Cut),
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Finishing {
    fn drop(&mut self) {
        // A body sent whole may be dropped without a last poll; one dropped before its
        // end is a client gone. The body goes first: a stream's usage reaches the record
        // when it is dropped.
        let body = std::mem::take(&mut self.body);
        let end = BodyEnd::at_drop(self.ended, http_body::Body::is_end_stream(&body));
        drop(body);
        self.ending.finish(end);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with_id(id: &[u8]) -> Request<()> {
        let mut req = Request::new(());
        req.headers_mut()
            .insert(X_REQUEST_ID.clone(), HeaderValue::from_bytes(id).unwrap());
        req
    }

    #[test]
    fn only_a_sane_client_id_survives() {
        for kept in [&b"a"[..], b"trace-7", &[b'x'; 128]] {
            let req = drop_invalid_request_id(with_id(kept));
            assert_eq!(req.headers()[&X_REQUEST_ID].as_bytes(), kept);
        }
        for dropped in [
            &b""[..],
            b"a b",
            b"tab\t",
            "caf\u{e9}".as_bytes(),
            &[b'x'; 129],
        ] {
            let req = drop_invalid_request_id(with_id(dropped));
            assert!(!req.headers().contains_key(&X_REQUEST_ID), "{dropped:?}");
        }
        assert_eq!(new_request_id().len(), 32);
    }

    #[test]
    fn endpoint_labels_stay_few() {
        assert_eq!(endpoint_label("/v1/chat/completions"), "chat_completions");
        assert_eq!(endpoint_label("/admin/tenants/t/sessions/s"), "admin");
        assert_eq!(endpoint_label("/v1/sessions/s-123"), "sessions");
        assert_eq!(endpoint_label("/v1/models"), "models");
        assert_eq!(endpoint_label("/v1/models/gpt-4o"), "models");
        assert_eq!(endpoint_label("/healthz"), "other");
    }
}
