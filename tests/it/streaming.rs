//! Streams that carry tools or a schema, end to end through the real gateway and mock:
//! text flows at once, tool calls are held only until checked, corrections mid-stream,
//! and the passthrough and annotate verdicts.

use std::time::{Duration, Instant};

use crate::common::*;
use base64::Engine;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn weather_tool_openai() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}}])
}

fn weather_tool_responses() -> Value {
    json!([{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}])
}

fn weather_tool_anthropic() -> Value {
    json!([{"name": "get_weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}])
}

/// (path, body) of a streaming request with tools attached, per API.
fn with_tools(api: &str) -> (&'static str, Value) {
    match api {
        "chat" => (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "stream": true, "tools": weather_tool_openai(),
                   "messages": [{"role": "user", "content": "hello there"}]}),
        ),
        "responses" => (
            "/v1/responses",
            json!({"model": "gpt-4o", "stream": true, "tools": weather_tool_responses(), "input": "hello there"}),
        ),
        _ => (
            "/v1/messages",
            json!({"model": "claude-mock-1", "max_tokens": 64, "stream": true, "tools": weather_tool_anthropic(),
                   "messages": [{"role": "user", "content": "hello there"}]}),
        ),
    }
}

/// Time from sending to the first text delta and to the end, and the body.
async fn timed(req: reqwest::RequestBuilder) -> (Duration, Duration, String) {
    let sent = Instant::now();
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.bytes_stream();
    let mut first = None;
    let mut text = Vec::new();
    while let Some(chunk) = body.next().await {
        text.extend_from_slice(&chunk.unwrap());
        if first.is_none() && !streamed_text(&String::from_utf8_lossy(&text)).is_empty() {
            first = Some(sent.elapsed());
        }
    }
    (
        first.unwrap(),
        sent.elapsed(),
        String::from_utf8(text).unwrap(),
    )
}

/// With tools attached and a text answer in 5 chunks 200 ms apart, the client's first
/// text comes within 100 ms of when a direct call to the mock sees it (it used to wait
/// for the whole answer: 800 ms and more).
#[tokio::test]
async fn text_flows_at_once_when_tools_are_attached() {
    let gw = start().await;
    for api in ["chat", "responses", "anthropic"] {
        let (path, body) = with_tools(api);
        let fault = "chunks=5;chunk_delay=200ms";
        let direct = gw
            .http
            .post(format!("http://{}{path}", gw.mock.addr))
            .header("x-mock-fault", fault)
            .header("content-type", "application/json")
            .body(body.to_string());
        let (direct_first, direct_total, _) = timed(direct).await;
        let mut through = gw
            .http
            .post(format!("{}{path}", gw.url))
            .header("x-mock-fault", fault)
            .header("content-type", "application/json")
            .body(body.to_string());
        through = if api == "anthropic" {
            through.header("x-api-key", KEY_A)
        } else {
            through.bearer_auth(KEY_A)
        };
        let (first, total, text) = timed(through).await;
        assert!(
            first < direct_first + Duration::from_millis(100),
            "{api}: first text after {first:?}, direct {direct_first:?}"
        );
        assert!(
            total >= Duration::from_millis(800) && direct_total >= Duration::from_millis(800),
            "{api}: paced stream ended after {total:?}"
        );
        assert_eq!(streamed_text(&text), "mock: hello there", "{api}: {text}");
    }
}

/// The text deltas of a stream in any of the three APIs, joined.
fn streamed_text(text: &str) -> String {
    events(text)
        .iter()
        .filter_map(|e| {
            e["choices"][0]["delta"]["content"]
                .as_str()
                .or(e["delta"]["text"].as_str())
                .or((e["type"] == "response.output_text.delta")
                    .then(|| e["delta"].as_str())
                    .flatten())
        })
        .collect()
}

fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// A streamed Responses function call with invalid arguments is never shown: the client
/// gets the corrective attempt's call, from its first event, and the upstream saw two
/// streamed attempts.
#[tokio::test]
async fn an_invalid_streamed_function_call_is_corrected_before_the_client_sees_it() {
    let gw = start().await;
    let (path, body) = with_tools("responses");
    let fault = format!(
        "tool=get_weather;tool_args_b64={},tool=get_weather;tool_args_b64={}",
        b64(r#"{"town":"Paris"}"#),
        b64(r#"{"city":"Paris"}"#)
    );
    let resp = gw
        .post(
            path,
            Some(KEY_A),
            &[("x-mock-scenario", "stream-fc"), ("x-mock-fault", &fault)],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let trail = resp.headers()["x-backstop-recovery"].clone();
    let text = resp.text().await.unwrap();
    assert_eq!(trail, "ok,correct:tool_args,ok", "{text}");
    assert!(
        !text.contains("town"),
        "invalid arguments reached the client: {text}"
    );
    let evs = events(&text);
    assert_eq!(evs[0]["type"], "response.created", "{text}");
    let args: String = evs
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(args, r#"{"city":"Paris"}"#);
    assert_eq!(evs.last().unwrap()["type"], "response.completed");
    assert_eq!(gw.mock.attempts("stream-fc"), 2);
    let second = gw.mock.last_request("stream-fc").unwrap();
    assert_eq!(second["body"]["stream"], true);
    let fed_back = second["body"]["input"].to_string();
    assert!(
        fed_back.contains("town") && fed_back.contains("/city"),
        "{fed_back}"
    );
}

fn structured_chat() -> Value {
    json!({
        "model": "gpt-4o", "stream": true,
        "messages": [{"role": "user", "content": "weather as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": {"temp_c": {"type": "number"}}, "required": ["temp_c"]}}},
    })
}

/// `validation.stream = "passthrough"`: the invalid answer streams as it comes and the
/// stream ends with an `output_invalid` error event instead of `[DONE]`; one attempt.
#[tokio::test]
async fn passthrough_ends_an_invalid_stream_with_an_error_event() {
    let gw = start_with(|t| t.set("validation.stream", "passthrough")).await;
    let fault = format!("content_b64={};chunks=3", b64(r#"{"temp": 1}"#));
    let resp = gw.chat("pass", &fault, structured_chat()).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-backstop-validation"], "deferred");
    let text = resp.text().await.unwrap();
    let evs = events(&text);
    let content: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, r#"{"temp": 1}"#);
    let last = evs.last().unwrap();
    assert_eq!(last["error"]["code"], "output_invalid", "{text}");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("/temp_c"));
    assert!(!text.contains("[DONE]"), "{text}");
    assert_eq!(gw.mock.attempts("pass"), 1);

    // A valid answer passes through whole, [DONE] included.
    let fault = format!("content_b64={}", b64(r#"{"temp_c": 1}"#));
    let text = gw
        .chat("pass-ok", &fault, structured_chat())
        .await
        .text()
        .await
        .unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("error"), "{text}");
}

/// Annotate mode streams an invalid answer whole and flags it in one final
/// `backstop_validation` chunk before `[DONE]`.
#[tokio::test]
async fn annotate_flags_an_invalid_stream_in_a_final_event() {
    let gw = start_with(|t| t.set("validation.mode", "annotate")).await;
    let fault = format!("content_b64={}", b64(r#"{"temp": 1}"#));
    let resp = gw.chat("annot", &fault, structured_chat()).await;
    assert_eq!(resp.headers()["x-backstop-validation"], "deferred");
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let evs = events(&text);
    let flag = evs.last().unwrap();
    assert_eq!(flag["backstop_validation"]["outcome"], "invalid", "{text}");
    assert_eq!(flag["choices"], json!([]));
    assert_eq!(gw.mock.attempts("annot"), 1);
}
