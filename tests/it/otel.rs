//! OpenTelemetry traces end to end: the real gateway and mock on real sockets, and a
//! small OTLP/HTTP receiver (protobuf) standing in for the collector.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::common::*;
use axum::{body::Bytes, extract::State, routing::post, Router};
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{any_value::Value as Any, KeyValue},
    trace::v1::{span::SpanKind, status::StatusCode, Span},
};
use prost::Message;
use serde_json::json;
use tokio::net::TcpListener;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_PARENT: &str = "00f067aa0ba902b7";

/// Spans received by the test collector.
type Received = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP receiver on 127.0.0.1:0: `POST /v1/traces`, protobuf.
async fn collector() -> (SocketAddr, Received) {
    let received = Received::default();
    let app = Router::new()
        .route(
            "/v1/traces",
            post(|State(received): State<Received>, body: Bytes| async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut spans = received.lock().unwrap();
                for resource in request.resource_spans {
                    for scope in resource.scope_spans {
                        spans.extend(scope.spans);
                    }
                }
                ([("content-type", "application/x-protobuf")], Vec::new())
            }),
        )
        .with_state(received.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, received)
}

fn traced(endpoint: &str) -> impl FnOnce(TestConfig) -> TestConfig + '_ {
    move |config| {
        config
            .set("telemetry.otlp_endpoint", endpoint)
            .set("telemetry.export_timeout", "500ms")
    }
}

fn attr(span: &Span, key: &str) -> Option<String> {
    let kv: &KeyValue = span.attributes.iter().find(|kv| kv.key == key)?;
    Some(match kv.value.as_ref()?.value.as_ref()? {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::BoolValue(b) => b.to_string(),
        Any::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_error(span: &Span) -> bool {
    span.status
        .as_ref()
        .is_some_and(|s| s.code == StatusCode::Error as i32)
}

/// Shuts the gateway down (which flushes its spans) and returns those of `trace_id`.
async fn flushed(
    gw: Gateway,
    received: &Received,
    trace_id: &str,
) -> (mock::MockHandle, Vec<Span>) {
    let Gateway { mock, server, .. } = gw;
    server.shutdown().await;
    let spans = received
        .lock()
        .unwrap()
        .iter()
        .filter(|s| hex(&s.trace_id) == trace_id)
        .cloned()
        .collect();
    (mock, spans)
}

use backstop::mock;

#[tokio::test]
async fn a_recovered_request_is_one_span_with_a_child_per_attempt() {
    let (addr, received) = collector().await;
    let endpoint = format!("http://{addr}");
    let gw = start_with(traced(&endpoint)).await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01");
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "otel-retry"),
                ("x-mock-fault", "status=503,status=503,ok"),
                ("x-session-id", "run-7"),
                ("traceparent", &traceparent),
                ("tracestate", "vendor=1"),
            ],
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "retry:503,retry:503,ok"
    );
    let body = json(resp).await;
    let (mock, spans) = flushed(gw, &received, CLIENT_TRACE).await;

    let requests: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Server as i32)
        .collect();
    assert_eq!(requests.len(), 1, "{spans:#?}");
    let request = requests[0];
    assert_eq!(hex(&request.parent_span_id), CLIENT_PARENT);
    assert_eq!(request.name, "chat gpt-4o-mini");
    let expect = [
        ("gen_ai.operation.name", "chat".to_string()),
        ("gen_ai.provider.name", "openai".into()),
        ("gen_ai.system", "openai".into()),
        ("gen_ai.request.model", "gpt-4o-mini".into()),
        ("gen_ai.response.model", "gpt-4o-mini".into()),
        (
            "gen_ai.usage.input_tokens",
            body["usage"]["prompt_tokens"].to_string(),
        ),
        (
            "gen_ai.usage.output_tokens",
            body["usage"]["completion_tokens"].to_string(),
        ),
        ("backstop.tenant", "team-a".into()),
        ("backstop.session", "run-7".into()),
        ("backstop.recovery", "retry:503,retry:503,ok".into()),
        ("backstop.attempts", "3".into()),
        ("backstop.upstream", "mock-openai".into()),
        ("http.response.status_code", "200".into()),
    ];
    for (key, value) in expect {
        assert_eq!(attr(request, key).as_deref(), Some(value.as_str()), "{key}");
    }
    assert_eq!(attr(request, "backstop.refusal"), None);
    assert!(!is_error(request));

    let mut attempts: Vec<&Span> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    attempts.sort_by_key(|s| attr(s, "backstop.attempt"));
    assert_eq!(attempts.len(), 3, "{spans:#?}");
    assert_eq!(spans.len(), 4);
    let sent = mock.traceparents("otel-retry");
    assert_eq!(sent.len(), 3);
    for (i, (attempt, status, class)) in [
        ("1", "503", "transient"),
        ("2", "503", "transient"),
        ("3", "200", "success"),
    ]
    .into_iter()
    .enumerate()
    {
        let span = attempts[i];
        assert_eq!(span.parent_span_id, request.span_id, "attempt {attempt}");
        assert_eq!(attr(span, "backstop.attempt").as_deref(), Some(attempt));
        assert_eq!(attr(span, "backstop.class").as_deref(), Some(class));
        assert_eq!(
            attr(span, "http.response.status_code").as_deref(),
            Some(status)
        );
        assert_eq!(
            attr(span, "gen_ai.request.model").as_deref(),
            Some("gpt-4o-mini")
        );
        assert_eq!(
            attr(span, "gen_ai.provider.name").as_deref(),
            Some("openai")
        );
        assert_eq!(is_error(span), class != "success");
        // The upstream got this attempt's context, not the client's.
        assert_eq!(
            sent[i],
            format!("00-{CLIENT_TRACE}-{}-01", hex(&span.span_id))
        );
    }
    let last = mock.last_request("otel-retry").unwrap();
    assert_eq!(last["headers"]["tracestate"], "vendor=1");
}

#[tokio::test]
async fn a_streamed_request_span_ends_with_the_streams_usage() {
    let (addr, received) = collector().await;
    let endpoint = format!("http://{addr}/v1/traces");
    let gw = start_with(traced(&endpoint)).await;
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "otel-stream"),
                ("x-mock-fault", "usage=11/22"),
                ("traceparent", &format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01")),
            ],
            json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("[DONE]"));
    let (_mock, spans) = flushed(gw, &received, CLIENT_TRACE).await;
    let request = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("request span");
    assert_eq!(
        attr(request, "gen_ai.usage.input_tokens").as_deref(),
        Some("11")
    );
    assert_eq!(
        attr(request, "gen_ai.usage.output_tokens").as_deref(),
        Some("22")
    );
    assert_eq!(spans.len(), 2);
}

#[tokio::test]
async fn failures_and_refusals_are_error_spans_naming_them() {
    let (addr, received) = collector().await;
    let endpoint = format!("http://{addr}");
    let gw = start_with(traced(&endpoint)).await;
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01");
    let body = |model: &str| {
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}).to_string()
    };
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("traceparent", &traceparent)],
            body("dead-model"),
        )
        .await;
    assert_eq!(resp.status(), 502);
    let other_trace = "0af7651916cd43dd8448eb211c80319c";
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some("bk-not-a-key"),
            &[(
                "traceparent",
                &format!("00-{other_trace}-{CLIENT_PARENT}-01"),
            )],
            body("gpt-4o-mini"),
        )
        .await;
    assert_eq!(resp.status(), 401);
    let Gateway { server, .. } = gw;
    server.shutdown().await;
    let spans = received.lock().unwrap().clone();
    let of = |trace: &str| -> Vec<Span> {
        spans
            .iter()
            .filter(|s| hex(&s.trace_id) == trace)
            .cloned()
            .collect()
    };

    let failed = of(CLIENT_TRACE);
    let request = failed
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("request span");
    assert!(is_error(request));
    assert_eq!(
        attr(request, "error.type").as_deref(),
        Some("upstream_unavailable")
    );
    assert_eq!(attr(request, "backstop.refusal"), None);
    let attempts: Vec<&Span> = failed
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    assert!(!attempts.is_empty());
    for span in attempts {
        assert_eq!(attr(span, "backstop.class").as_deref(), Some("transient"));
        assert_eq!(attr(span, "error.type").as_deref(), Some("connect"));
        assert!(is_error(span));
    }

    let refused = of(other_trace);
    assert_eq!(refused.len(), 1, "no attempt was made");
    assert!(is_error(&refused[0]));
    assert_eq!(
        attr(&refused[0], "backstop.refusal").as_deref(),
        Some("invalid_api_key")
    );
    assert_eq!(
        attr(&refused[0], "http.response.status_code").as_deref(),
        Some("401")
    );
}

#[tokio::test]
async fn a_request_the_client_abandons_still_ends_its_span() {
    let (addr, received) = collector().await;
    let endpoint = format!("http://{addr}");
    let gw = start_with(traced(&endpoint)).await;
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    let sent = gw
        .http
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY_A)
        .header("x-mock-scenario", "otel-gone")
        .header("x-mock-fault", "delay=3s")
        .header(
            "traceparent",
            format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"),
        )
        .timeout(Duration::from_millis(200))
        .body(body.to_string())
        .send()
        .await;
    assert!(sent.is_err());
    // The gateway notices the closed connection and drops the request, which ends its
    // span: wait for that span to be exported, not for a fixed time.
    let ended = || {
        received
            .lock()
            .unwrap()
            .iter()
            .any(|s| hex(&s.trace_id) == CLIENT_TRACE && s.kind == SpanKind::Server as i32)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ended() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_mock, spans) = flushed(gw, &received, CLIENT_TRACE).await;
    let request = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("request span");
    assert!(is_error(request));
    assert_eq!(request.status.as_ref().unwrap().message, "cancelled");
    assert_eq!(attr(request, "http.response.status_code"), None);
    assert_eq!(attr(request, "backstop.tenant").as_deref(), Some("team-a"));
}

/// A traced gateway whose request deadline (400 ms) is shorter than the export timeout
/// (500 ms): a request that waited on the collector would be answered 504, not 200.
fn traced_with_a_short_deadline(endpoint: &str) -> impl FnOnce(TestConfig) -> TestConfig + '_ {
    move |config| traced(endpoint)(config).set("server.request_timeout", "400ms")
}

/// `n` chat calls, each answered 200 within the request deadline.
async fn all_answered_at_once(gw: &Gateway, scenario: &str, n: usize) {
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    for i in 0..n {
        let resp = gw.chat(&format!("{scenario}-{i}"), "", body.clone()).await;
        assert_eq!(resp.status(), 200);
    }
}

fn dropped_spans() -> u64 {
    let text = backstop::telemetry::metrics_handle().render();
    text.lines()
        .filter(|l| l.starts_with("backstop_trace_spans_dropped_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test]
async fn with_the_collector_down_requests_are_unaffected_and_drops_counted() {
    let dead = dead_port().await;
    let endpoint = format!("http://127.0.0.1:{dead}");
    let gw = start_with(traced_with_a_short_deadline(&endpoint)).await;
    let before = dropped_spans();
    all_answered_at_once(&gw, "otel-dead", 20).await;
    gw.server.shutdown().await;
    // 20 request spans and 20 attempt spans, none delivered.
    assert!(
        dropped_spans() - before >= 40,
        "{} dropped",
        dropped_spans() - before
    );
}

#[tokio::test]
async fn a_collector_that_hangs_holds_up_no_request() {
    // Accepts connections and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            held.push(tcp);
        }
    });
    let endpoint = format!("http://{addr}");
    let gw = start_with(traced_with_a_short_deadline(&endpoint)).await;
    all_answered_at_once(&gw, "otel-hang", 10).await;
    // The drain may take its 5s grace (the test client's idle connections); the flush
    // after it gives up within twice the export timeout, not never.
    tokio::time::timeout(Duration::from_secs(8), gw.server.shutdown())
        .await
        .expect("the shutdown's flush gives up on a hanging collector");
}

#[tokio::test]
async fn with_tracing_off_no_traceparent_is_invented_or_passed_on() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw.chat("otel-off", "", body.clone()).await;
    assert_eq!(resp.status(), 200);
    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_PARENT}-01");
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "otel-off"),
                ("traceparent", &traceparent),
            ],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    // Off: the upstream allow-list decides, and it does not name traceparent.
    assert_eq!(gw.mock.traceparents("otel-off"), ["", ""]);
}
