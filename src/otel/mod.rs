//! OpenTelemetry traces (`[telemetry]`): one server span per proxied request and one
//! client span per upstream attempt, with the GenAI semantic-convention attributes and
//! Backstop's own, exported over OTLP/HTTP in batches ([`export`]).
//!
//! Each [`AppState`](crate::app::AppState) owns its tracer provider (none is installed
//! globally), so gateways in one process never share or replace each other's. When
//! `otlp_endpoint` is unset there is no provider at all: the trace layer is not mounted
//! and attempts carry no context, so tracing off makes no span objects and allocates
//! nothing.
//!
//! A client's W3C `traceparent`/`tracestate` is continued (the request span is its
//! child) and each attempt sends the attempt span's context upstream instead of the
//! client's. With tracing off, the upstream sees a `traceparent` only if the upstream's
//! `forward_headers` names it, as before: nothing is invented.

mod export;

use std::sync::{
    atomic::{AtomicU32, Ordering},
    Arc, Mutex,
};

use http::{HeaderMap, HeaderValue};
use opentelemetry::{
    propagation::TextMapPropagator,
    trace::{
        SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, Tracer as _,
        TracerProvider as _,
    },
    Context, KeyValue,
};
use opentelemetry_http::HeaderExtractor;
use opentelemetry_sdk::{
    propagation::TraceContextPropagator,
    trace::{Sampler, SdkTracer, SdkTracerProvider},
    Resource,
};

use crate::{
    api::Endpoint,
    config::TelemetryConfig,
    policy::classify::{Class, TransportFailure},
};

/// The tracer of one gateway, when tracing is on.
pub struct Traces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    queue: export::QueueHandle,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Traces")
    }
}

impl Traces {
    /// The tracer for `config`; `None` when tracing is off, or when there is no tokio
    /// runtime to export on (logged).
    pub fn from_config(config: &TelemetryConfig, client: reqwest::Client) -> Option<Arc<Traces>> {
        let url = config.traces_url()?;
        if tokio::runtime::Handle::try_current().is_err() {
            tracing::warn!("telemetry.otlp_endpoint set but no runtime to export on: traces off");
            return None;
        }
        let resource = Resource::builder()
            .with_service_name(config.service_name.clone())
            .build();
        let (processor, queue) = match export::start(config, &url, client, &resource) {
            Ok(started) => started,
            Err(err) => {
                tracing::warn!(error = %err, "cannot build the OTLP exporter: traces off");
                return None;
            }
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("backstop");
        Some(Arc::new(Traces {
            provider,
            tracer,
            queue,
        }))
    }

    /// Opens the request's span, a child of the client's `traceparent` if it sent one.
    pub fn start_request(&self, headers: &HeaderMap) -> RequestTrace {
        let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let span = self
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, &parent);
        RequestTrace {
            tracer: self.tracer.clone(),
            cx: parent.with_span(span),
            attempts: AtomicU32::new(0),
            answered_model: Mutex::new(None),
        }
    }

    /// Exports what is queued (bounded by `export_timeout`), then stops the provider.
    pub async fn shutdown(&self) {
        self.queue.flush().await;
        let provider = self.provider.clone();
        // The provider's shutdown blocks; not on a runtime worker.
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
}

/// The request's span, shared (through the request log) with the attempts it makes.
pub struct RequestTrace {
    tracer: SdkTracer,
    /// The client's context with the request span in it.
    cx: Context,
    attempts: AtomicU32,
    /// The model the successful attempt asked the upstream for.
    answered_model: Mutex<Option<Arc<str>>>,
}

impl std::fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTrace")
            .field("span", self.cx.span().span_context())
            .finish()
    }
}

/// `gen_ai.operation.name` per endpoint (the semantic conventions' values; Anthropic's
/// `count_tokens` has none, so it is named as it is).
pub fn operation(endpoint: Option<Endpoint>) -> &'static str {
    match endpoint {
        Some(Endpoint::Embeddings) => "embeddings",
        Some(Endpoint::CountTokens) => "count_tokens",
        Some(Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses) | None => "chat",
    }
}

/// `gen_ai.provider.name` and its older name `gen_ai.system`.
pub fn provider(name: &'static str) -> [KeyValue; 2] {
    [
        KeyValue::new("gen_ai.provider.name", name),
        KeyValue::new("gen_ai.system", name),
    ]
}

impl RequestTrace {
    /// Opens the span of the request's next upstream attempt.
    pub fn attempt(
        &self,
        upstream: &str,
        provider_name: &'static str,
        endpoint: Endpoint,
        model: &str,
    ) -> AttemptSpan {
        let number = self.attempts.fetch_add(1, Ordering::Relaxed) + 1;
        let op = operation(Some(endpoint));
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", op),
            KeyValue::new("gen_ai.request.model", model.to_string()),
            KeyValue::new("backstop.attempt", i64::from(number)),
            KeyValue::new("backstop.upstream", upstream.to_string()),
        ];
        attributes.extend(provider(provider_name));
        let span = self
            .tracer
            .span_builder(format!("{op} {model}"))
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &self.cx);
        AttemptSpan {
            cx: self.cx.with_span(span),
            model: model.into(),
        }
    }

    /// The model the successful attempt asked the upstream for, if one succeeded.
    pub fn answered_model(&self) -> Option<Arc<str>> {
        self.answered_model
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Ends the request's span as `name` with `attributes`, its status Error with
    /// `error` when that is set.
    pub fn end(&self, name: String, attributes: Vec<KeyValue>, error: Option<String>) {
        let span = self.cx.span();
        span.update_name(name);
        span.set_attributes(attributes);
        if let Some(error) = error {
            span.set_status(Status::error(error));
        }
        span.end();
    }
}

/// One upstream attempt's span.
pub struct AttemptSpan {
    cx: Context,
    model: Arc<str>,
}

impl AttemptSpan {
    /// The context sent upstream as `traceparent`/`tracestate`.
    pub fn context(&self) -> &Context {
        &self.cx
    }

    /// Ends the span with the attempt's outcome; a success is remembered as the
    /// request's answer (`gen_ai.response.model`).
    pub fn finish(
        self,
        request: &RequestTrace,
        status: Result<u16, TransportFailure>,
        class: &Class,
    ) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("backstop.class", class.label()));
        match status {
            Ok(status) => span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            )),
            Err(failure) => span.set_attribute(KeyValue::new("error.type", failure.label())),
        }
        if *class == Class::Success {
            *request
                .answered_model
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Some(self.model.clone());
        } else {
            span.set_status(Status::error(class.label()));
        }
        span.end();
    }

    /// Ends the span of an attempt refused before any network (a budget).
    pub fn refused(self, code: &'static str) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("backstop.refusal", code));
        span.set_status(Status::error(code));
        span.end();
    }
}

/// Writes `cx`'s `traceparent` (and a non-empty `tracestate`) into upstream request
/// headers, replacing any the client's headers brought. Written by hand: the SDK's
/// propagator formats through `format!` and re-parses the header name, 5,000
/// instructions an attempt where this takes a few hundred.
pub fn inject(cx: &Context, headers: &mut HeaderMap) {
    headers.remove("traceparent");
    headers.remove("tracestate");
    let span = cx.span();
    let context = span.span_context();
    if !context.is_valid() {
        return;
    }
    headers.insert("traceparent", traceparent(context));
    let state = context.trace_state().header();
    if let Ok(value) = HeaderValue::from_str(&state) {
        if !state.is_empty() {
            headers.insert("tracestate", value);
        }
    }
}

/// `00-{trace id}-{span id}-{flags}`, the W3C version 00 form.
fn traceparent(context: &SpanContext) -> HeaderValue {
    fn hex(out: &mut [u8], bytes: &[u8]) {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
            pair[0] = HEX[usize::from(b >> 4)];
            pair[1] = HEX[usize::from(b & 0xf)];
        }
    }
    let mut out = *b"00-00000000000000000000000000000000-0000000000000000-00";
    hex(&mut out[3..35], &context.trace_id().to_bytes());
    hex(&mut out[36..52], &context.span_id().to_bytes());
    hex(
        &mut out[53..],
        &[(context.trace_flags() & TraceFlags::SAMPLED).to_u8()],
    );
    HeaderValue::from_bytes(&out).expect("hex and dashes are a valid header value")
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::{SpanId, TraceId, TraceState};

    use std::collections::HashMap;

    use super::*;

    #[test]
    fn traceparent_is_what_the_sdk_propagator_writes() {
        for (flags, state) in [
            (TraceFlags::SAMPLED, "vendor=1,other=x"),
            (TraceFlags::default(), ""),
        ] {
            let context = SpanContext::new(
                TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
                SpanId::from_hex("00f067aa0ba902b7").unwrap(),
                flags,
                true,
                TraceState::from_key_value(state.split(',').filter_map(|kv| kv.split_once('=')))
                    .unwrap(),
            );
            let cx = Context::new().with_remote_span_context(context);
            let mut ours = HeaderMap::new();
            ours.insert("traceparent", HeaderValue::from_static("00-client"));
            inject(&cx, &mut ours);
            let mut sdk = HashMap::new();
            TraceContextPropagator::new().inject_context(&cx, &mut sdk);
            assert_eq!(ours["traceparent"], sdk["traceparent"]);
            assert_eq!(
                ours.get("tracestate")
                    .map(|v| v.to_str().unwrap())
                    .unwrap_or(""),
                sdk["tracestate"]
            );
        }
    }
}
