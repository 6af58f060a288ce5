//! Trace layer (just inside the [`EdgeLayer`](super::edge::EdgeLayer), outside the
//! [`RespondLayer`](super::respond::RespondLayer), on every proxied endpoint): opens the
//! request's OpenTelemetry span, a child of the client's `traceparent` when it sent one,
//! and puts it in the request's record, where the recovery layer opens a child span per
//! upstream attempt. The edge ends the span ([`end_span`]) when the response body ends,
//! with what the record then says (tenant, session, models, usage, recovery trail,
//! refusal, how the body ended): `request_attributes` turns the record into attributes.
//!
//! With tracing off (no `[telemetry] otlp_endpoint`) it passes requests straight
//! through. Never refuses.

use std::{
    convert::Infallible,
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use http::{Request, Response};
use opentelemetry::KeyValue;
use tower::{Layer, Service};

use crate::{
    api::Endpoint,
    otel::{operation, provider, Traces},
    policy::trail::{self, Step},
    telemetry::{BodyEnd, Facts, RequestLog},
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
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        if let Some(traces) = &self.traces {
            if let Some(log) = req.extensions().get::<Arc<RequestLog>>() {
                log.set_trace(traces.start_request(req.headers()));
            }
        }
        self.inner.call(req)
    }
}

/// Ends the request's span, if it has one, from its record as it is at the end of the
/// body. `status` is `None` for a request dropped before its answer's head.
pub(super) fn end_span(
    log: &RequestLog,
    facts: &Facts,
    endpoint: Option<Endpoint>,
    status: Option<u16>,
    end: BodyEnd,
) {
    let Some(trace) = log.trace() else {
        return;
    };
    let op = operation(endpoint);
    let name = match &facts.model {
        Some(model) => format!("{op} {model}"),
        None => op.to_string(),
    };
    let error = match status {
        None => Some("cancelled".to_string()),
        Some(status) if status >= 500 || facts.error.is_some() => Some(
            facts
                .error
                .map_or_else(|| status.to_string(), |code| code.as_str().to_string()),
        ),
        Some(_) => None,
    };
    let mut attributes = request_attributes(facts, endpoint, status, trace.answered_model());
    attributes.push(KeyValue::new("backstop.body.end", end.label()));
    if let Some(reason) = facts.stream_cut {
        attributes.push(KeyValue::new("backstop.body.cut", reason));
    }
    trace.end(name, attributes, error);
}

/// The request span's attributes, from the request's record.
fn request_attributes(
    fields: &Facts,
    endpoint: Option<Endpoint>,
    status: Option<u16>,
    answered_model: Option<Arc<str>>,
) -> Vec<KeyValue> {
    let mut out = vec![
        KeyValue::new("gen_ai.operation.name", operation(endpoint)),
        KeyValue::new("backstop.attempts", i64::from(fields.recovery.attempts)),
    ];
    if let Some(status) = status {
        out.push(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
    }
    if let Some(endpoint) = endpoint {
        out.extend(provider(if endpoint.wire().openai_errors() {
            "openai"
        } else {
            "anthropic"
        }));
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
                fields.recovery.upstream.as_deref().map(str::to_string),
            ),
            text("backstop.recovery", fields.recovery_header()),
            text(
                "error.type",
                fields.error.map(|code| code.as_str().to_string()),
            ),
            text("backstop.refusal", refusal(fields).map(str::to_string)),
            text(
                "backstop.validation",
                validation_steps(&fields.recovery.steps),
            ),
        ]
        .into_iter()
        .flatten(),
    );
    if let Some(tokens) = fields.usage {
        // Every input kind, as the GenAI conventions count input; the cache apart too.
        out.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            tokens.prompt() as i64,
        ));
        out.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            tokens.output as i64,
        ));
        if tokens.cache_write() > 0 {
            out.push(KeyValue::new(
                "gen_ai.usage.cache_creation.input_tokens",
                tokens.cache_write() as i64,
            ));
        }
        if tokens.cache_read > 0 {
            out.push(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                tokens.cache_read as i64,
            ));
        }
    }
    out
}

/// The error code when Backstop refused the request itself (auth, limits, budgets, the
/// guard, an open breaker): before any upstream attempt, or as the trail's `refused:`
/// step; an upstream's failure passed on is an `error.type` only.
fn refusal(fields: &Facts) -> Option<&'static str> {
    let refused = fields.recovery.attempts == 0
        || fields
            .recovery
            .steps
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{error::GatewayError, telemetry::Trail};

    #[test]
    fn request_attributes_come_from_the_log() {
        let fields = Facts {
            tenant: Some("acme".into()),
            session: Some("run-1".into()),
            model: Some("gpt-4o".into()),
            recovery: Trail {
                attempts: 3,
                steps: vec![
                    Step::Retry(trail::Reason::Status(503)),
                    Step::Correct("schema"),
                    Step::Ok,
                ],
                ..Trail::default()
            },
            usage: Some(crate::billing::Tokens {
                input: 2,
                cache_read: 10,
                output: 34,
                ..Default::default()
            }),
            ..Facts::default()
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
        assert_eq!(get("gen_ai.usage.input_tokens").as_deref(), Some("12"));
        assert_eq!(
            get("gen_ai.usage.cache_read.input_tokens").as_deref(),
            Some("10")
        );
        assert_eq!(
            get("backstop.recovery").as_deref(),
            Some("retry:503,correct:schema,ok")
        );
        assert_eq!(
            get("backstop.validation").as_deref(),
            Some("correct:schema")
        );
        assert_eq!(get("backstop.refusal"), None);
        let failed = Facts {
            error: Some(
                GatewayError::UpstreamUnavailable {
                    upstream: "u".into(),
                }
                .code(),
            ),
            ..fields.clone()
        };
        assert_eq!(refusal(&failed), None);
        let refused = Facts {
            error: Some(GatewayError::Unauthorized.code()),
            ..Facts::default()
        };
        assert_eq!(refusal(&refused), Some("invalid_api_key"));
        assert_eq!(operation(Some(Endpoint::Embeddings)), "embeddings");
    }
}
