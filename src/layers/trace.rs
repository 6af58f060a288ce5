//! Trace layer (just inside the edge, on every proxied endpoint): opens the request's
//! OpenTelemetry span, a child of the client's `traceparent` when it sent one, and puts
//! it in the request log, where the recovery layer opens a child span per upstream
//! attempt. The span ends with what the log then says (tenant, session, models, usage,
//! recovery trail, refusal): at the response head for a whole answer, and when the body
//! is finished or dropped for an event stream, whose usage is known only at its end
//! (`request_attributes`: the log turned into span attributes).
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
use opentelemetry::KeyValue;
use tower::{Layer, Service};

use crate::{
    api::Endpoint,
    otel::{operation, provider, Traces},
    policy::trail::{self, Step},
    telemetry::{LogFields, RequestLog},
    upstream::is_event_stream,
};

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
        let Some(trace) = self.log.trace() else {
            return;
        };
        let (endpoint, status, answered) = (self.endpoint, self.status, trace.answered_model());
        let mut ended = None;
        // Read in place, not from a snapshot: each field is copied once, into its attribute.
        self.log.update(|fields| {
            let op = operation(endpoint);
            let name = match &fields.model {
                Some(model) => format!("{op} {model}"),
                None => op.to_string(),
            };
            let error = match status {
                None => Some("cancelled".to_string()),
                Some(status) if status >= 500 || fields.error.is_some() => Some(
                    fields
                        .error
                        .map_or_else(|| status.to_string(), |code| code.as_str().to_string()),
                ),
                Some(_) => None,
            };
            let attributes = request_attributes(fields, endpoint, status, answered);
            ended = Some((name, attributes, error));
        });
        if let Some((name, attributes, error)) = ended {
            trace.end(name, attributes, error);
        }
    }
}

/// The request span's attributes, from the request log.
fn request_attributes(
    fields: &LogFields,
    endpoint: Option<Endpoint>,
    status: Option<u16>,
    answered_model: Option<Arc<str>>,
) -> Vec<KeyValue> {
    let mut out = vec![
        KeyValue::new("gen_ai.operation.name", operation(endpoint)),
        KeyValue::new("backstop.attempts", i64::from(fields.attempts)),
    ];
    if let Some(status) = status {
        out.push(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
    }
    if let Some(endpoint) = endpoint {
        out.extend(provider(endpoint.api()));
    }
    let text = |key: &'static str, value: Option<String>| value.map(|v| KeyValue::new(key, v));
    out.extend(
        [
            text("gen_ai.request.model", fields.model.clone()),
            text(
                "gen_ai.response.model",
                answered_model.map(|m| m.to_string()),
            ),
            text(
                "backstop.tenant",
                fields.tenant.as_deref().map(str::to_string),
            ),
            text("backstop.session", fields.session.clone()),
            text(
                "backstop.upstream",
                fields.upstream.as_deref().map(str::to_string),
            ),
            text("backstop.recovery", fields.recovery_header()),
            text(
                "error.type",
                fields.error.map(|code| code.as_str().to_string()),
            ),
            text("backstop.refusal", refusal(fields).map(str::to_string)),
            text("backstop.validation", validation_steps(&fields.recovery)),
        ]
        .into_iter()
        .flatten(),
    );
    if let Some((input, output)) = fields.usage {
        out.push(KeyValue::new("gen_ai.usage.input_tokens", input as i64));
        out.push(KeyValue::new("gen_ai.usage.output_tokens", output as i64));
    }
    out
}

/// The error code when Backstop refused the request itself (auth, limits, budgets, the
/// guard, an open breaker): before any upstream attempt, or as the trail's `refused:`
/// step; an upstream's failure passed on is an `error.type` only.
fn refusal(fields: &LogFields) -> Option<&'static str> {
    let refused = fields.attempts == 0
        || fields
            .recovery
            .iter()
            .any(|s| matches!(s, Step::Refused(_)));
    fields.error.filter(|_| refused).map(|code| code.as_str())
}

/// What output validation did (its corrective retries and strategy switches), if it did.
fn validation_steps(steps: &[Step]) -> Option<String> {
    let done: Vec<Step> = steps
        .iter()
        .filter(|s| matches!(s, Step::Correct(_) | Step::Switch(_)))
        .cloned()
        .collect();
    (!done.is_empty()).then(|| trail::render(&done))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_attributes_come_from_the_log() {
        let fields = LogFields {
            tenant: Some("acme".into()),
            session: Some("run-1".into()),
            model: Some("gpt-4o".into()),
            attempts: 3,
            recovery: vec![
                Step::Retry(trail::Reason::Status(503)),
                Step::Correct("schema"),
                Step::Ok,
            ],
            usage: Some((12, 34)),
            ..LogFields::default()
        };
        let attributes = request_attributes(
            &fields,
            Some(Endpoint::ChatCompletions),
            Some(200),
            Some("gpt-4o-2024".into()),
        );
        let get = |key: &str| {
            attributes
                .iter()
                .find(|kv| kv.key.as_str() == key)
                .map(|kv| kv.value.to_string())
        };
        assert_eq!(get("gen_ai.operation.name").as_deref(), Some("chat"));
        assert_eq!(get("gen_ai.provider.name").as_deref(), Some("openai"));
        assert_eq!(get("gen_ai.response.model").as_deref(), Some("gpt-4o-2024"));
        assert_eq!(get("gen_ai.usage.output_tokens").as_deref(), Some("34"));
        assert_eq!(
            get("backstop.recovery").as_deref(),
            Some("retry:503,correct:schema,ok")
        );
        assert_eq!(
            get("backstop.validation").as_deref(),
            Some("correct:schema")
        );
        assert_eq!(get("backstop.refusal"), None);
        let failed = LogFields {
            error: Some(crate::error::ErrorCode::UpstreamUnavailable),
            ..fields.clone()
        };
        assert_eq!(refusal(&failed), None);
        let refused = LogFields {
            error: Some(crate::error::ErrorCode::BudgetExceeded),
            attempts: 0,
            ..LogFields::default()
        };
        assert_eq!(refusal(&refused), Some("budget_exceeded"));
        assert_eq!(operation(Some(Endpoint::Embeddings)), "embeddings");
    }
}
