//! The mock's strict mode through the real gateway: a request opts in with
//! `x-mock-strict: on` (forwarded like the other `x-mock-*` headers), and the real
//! API's refusal reaches the client unchanged, in one attempt.

use serde_json::{json, Value};

use crate::common::{json, start, KEY_A};

/// The case: an assistant turn with an empty text block beside its tool call.
fn tool_turn(text: &str) -> Value {
    json!({"model": "claude-3-5-haiku", "max_tokens": 64,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": text},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"}]}]})
}

#[tokio::test]
async fn a_strict_refusal_reaches_the_client_unchanged() {
    let gw = start().await;
    let headers = [("x-mock-scenario", "strict-empty"), ("x-mock-strict", "on")];
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &headers,
            tool_turn("").to_string(),
        )
        .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(
        json(resp).await,
        json!({"type": "error", "error": {"type": "invalid_request_error",
               "message": "messages: text content blocks must be non-empty"}})
    );
    assert_eq!(
        gw.mock.attempts("strict-empty"),
        1,
        "a caller fault is not retried"
    );

    // Without the header the lenient mock answers the same request.
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[("x-mock-scenario", "lenient")],
            tool_turn("").to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn a_strict_mock_answers_what_the_real_api_accepts() {
    let gw = start().await;
    let headers = [
        ("x-mock-scenario", "strict-ok"),
        ("x-mock-strict", "on"),
        ("x-mock-fault", "tool=get_weather"),
    ];
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &headers,
            tool_turn("Checking.").to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(body["stop_reason"], "tool_use");
    assert_eq!(body["content"][0]["name"], "get_weather");
    assert_eq!(body["usage"]["cache_read_input_tokens"], 0);
    assert_eq!(body["usage"]["cache_creation_input_tokens"], 0);
}

#[tokio::test]
async fn a_strict_chat_refusal_is_in_openai_shape() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]});
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("x-mock-scenario", "strict-chat"), ("x-mock-strict", "on")],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let error = &json(resp).await["error"];
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(
        error["message"],
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding \
         message with 'tool_calls'."
    );
}
