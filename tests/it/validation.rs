//! Structured output end to end: real gateway, real mock scripted invalid-then-valid.

use crate::common::*;
use base64::Engine;
use serde_json::{json, Value};

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn weather_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}}, "required": ["city", "temp_c"], "additionalProperties": false})
}

fn structured(model: &str) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": "weather in Paris as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": weather_schema(), "strict": true}},
    })
}

const INVALID: &str = r#"{"city": "Paris"}"#;
const VALID: &str = r#"{"city": "Paris", "temp_c": 21.5}"#;

fn script(steps: &[&str]) -> String {
    steps
        .iter()
        .map(|s| format!("content_b64={}", b64(s)))
        .collect::<Vec<_>>()
        .join(",")
}

#[tokio::test]
async fn an_invalid_answer_is_corrected_with_the_errors_fed_back() {
    let gw = start().await;
    let resp = gw
        .chat("correct", &script(&[INVALID, VALID]), structured("gpt-4o"))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:schema,ok"
    );
    assert_eq!(resp.headers()["x-backstop-attempts"], "2");
    assert_eq!(resp.headers()["x-backstop-validation"], "corrected");
    let body = json(resp).await;
    assert_eq!(body["choices"][0]["message"]["content"], VALID);
    assert_eq!(gw.mock.attempts("correct"), 2);

    let corrective = gw.mock.last_request("correct").unwrap()["body"].clone();
    let messages = corrective["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(
        messages[1],
        json!({"role": "assistant", "content": INVALID})
    );
    let feedback = messages[2]["content"].as_str().unwrap();
    assert_eq!(messages[2]["role"], "user");
    assert!(
        feedback.contains(r#"/temp_c: "temp_c" is a required property"#),
        "{feedback}"
    );
    assert_eq!(
        corrective["response_format"]["type"], "json_schema",
        "the format is still asked for"
    );
}

#[tokio::test]
async fn exhausted_corrections_switch_targets_then_fail_with_the_errors() {
    let backup = backstop::mock::spawn(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let backup_addr = backup.addr;
    let gw = start_with(move |t| {
        t.merge(&format!("[[upstreams]]\nname = \"backup\"\napi = \"openai\"\nforward_headers = [\"x-mock-*\"]\nbase_url = \"http://{backup_addr}\"\n[[routes]]\nmodel = \"pair\"\ntargets = [{{ upstream = \"mock-openai\" }}, {{ upstream = \"backup\", model = \"bigger\" }}]\n"))
    })
    .await;
    // Never valid: 1 + 2 corrective attempts on each target.
    let resp = gw
        .chat("exhaust", &script(&["not json at all"]), structured("pair"))
        .await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:json,ok,correct:json,ok,switch:backup,ok,correct:json,ok,correct:json,ok"
    );
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "output_invalid");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("exhaust"), 3);
    assert_eq!(backup.attempts("exhaust"), 3);
    // The strategy switch starts the backup from the original conversation, with its model.
    let first_on_backup = backup.last_request("exhaust").unwrap()["body"].clone();
    assert_eq!(first_on_backup["model"], "bigger");
}

#[tokio::test]
async fn a_strategy_switch_to_a_better_target_succeeds() {
    // The primary echoes prose (never valid JSON); the backup answers valid JSON.
    let mix = backstop::mock::FaultMix::parse(&format!("content_b64={}@1", b64(VALID))).unwrap();
    let backup = backstop::mock::spawn_with(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        mix,
    );
    let backup_addr = backup.addr;
    let gw = start_with(move |t| {
        t.merge(&format!(
            r#"
[[upstreams]]
name = "backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{backup_addr}"
[[routes]]
model = "pair"
targets = [{{ upstream = "mock-openai" }}, {{ upstream = "backup" }}]
"#
        ))
    })
    .await;
    let resp = gw.chat("switch-ok", "", structured("pair")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:json,ok,correct:json,ok,switch:backup,ok"
    );
    assert_eq!(resp.headers()["x-backstop-validation"], "corrected");
    assert_eq!(json(resp).await["choices"][0]["message"]["content"], VALID);
    assert_eq!(
        (gw.mock.attempts("switch-ok"), backup.attempts("switch-ok")),
        (3, 1)
    );
}

#[tokio::test]
async fn tool_arguments_are_validated_for_openai() {
    let gw = start().await;
    let body = json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}}],
    });
    let fault = format!(
        "tool=get_weather;tool_args_b64={},tool=get_weather;tool_args_b64={}",
        b64(INVALID),
        b64(VALID)
    );
    let resp = gw.chat("tools-openai", &fault, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:tool_args,ok"
    );
    let body = json(resp).await;
    assert_eq!(
        body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        VALID
    );
    let corrective = gw.mock.last_request("tools-openai").unwrap()["body"]["messages"].clone();
    assert!(
        corrective[2]["content"]
            .as_str()
            .unwrap()
            .contains("get_weather"),
        "{corrective}"
    );
}

#[tokio::test]
async fn tool_use_input_is_validated_for_anthropic() {
    let gw = start().await;
    let body = json!({
        "model": "claude-x", "max_tokens": 100,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": weather_schema()}],
    });
    let fault = format!(
        "tool=get_weather;tool_args_b64={},tool=get_weather;tool_args_b64={}",
        b64(r#"{"city": "Paris", "temp_c": "warm"}"#),
        b64(VALID)
    );
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[("x-mock-scenario", "tools-anth"), ("x-mock-fault", &fault)],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:tool_args,ok"
    );
    let body = json(resp).await;
    assert_eq!(body["content"][0]["input"]["temp_c"], 21.5);
    let corrective = gw.mock.last_request("tools-anth").unwrap()["body"]["messages"].clone();
    assert!(
        corrective[2]["content"]
            .as_str()
            .unwrap()
            .contains("/temp_c: "),
        "{corrective}"
    );
}

#[tokio::test]
async fn a_buffered_stream_relays_the_accepted_attempts_own_events() {
    let gw = start().await;
    let mut body = structured("gpt-4o");
    body["stream"] = json!(true);
    let resp = gw
        .chat("stream-validate", &script(&[INVALID, VALID]), body)
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-backstop-validation"], "corrected");
    let text = resp.text().await.unwrap();
    let content: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(content, VALID);
    assert!(text.trim_end().ends_with("data: [DONE]"));
    // The corrective attempt streamed too, and its own chunks are what the client got:
    // one chat.completion.chunk id throughout, the second attempt's.
    assert_eq!(gw.mock.attempts("stream-validate"), 2);
    assert_eq!(
        gw.mock.last_request("stream-validate").unwrap()["body"]["stream"],
        true,
        "streamed, not fetched whole"
    );
    let ids: std::collections::HashSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["id"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(ids.len(), 1, "{text}");
}

#[tokio::test]
async fn a_request_with_no_format_is_never_validated() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw.chat("no-format", &script(&["{ not json"]), body).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-backstop-validation").is_none());
    assert_eq!(resp.headers()["x-backstop-recovery"], "ok");
    assert_eq!(gw.mock.attempts("no-format"), 1);
}

#[tokio::test]
async fn a_routes_response_schema_applies_without_a_client_format() {
    let schema = format!(
        "{}/tests/fixtures/envelope.schema.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let gw = start_with(move |t| t.merge(&format!("[[routes]]\nmodel = \"enveloped\"\ntargets = [{{ upstream = \"mock-openai\" }}]\nresponse_schema = \"{schema}\"\n"))).await;
    let body = json!({"model": "enveloped", "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .chat(
            "envelope",
            &script(&[
                r#"{"status": "fine", "answer": "x"}"#,
                r#"{"status": "ok", "answer": "x"}"#,
            ]),
            body,
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:schema,ok"
    );
    let feedback = gw.mock.last_request("envelope").unwrap()["body"]["messages"][2]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(feedback.contains("/status: "), "{feedback}");
}

#[tokio::test]
async fn annotate_mode_passes_invalid_output_through_flagged() {
    let gw = start_with(|t| t.set("validation.mode", "annotate")).await;
    let resp = gw
        .chat("annotate", &script(&[INVALID]), structured("gpt-4o"))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-backstop-validation"], "invalid");
    assert!(resp.headers()["x-backstop-validation-error"]
        .to_str()
        .unwrap()
        .contains("temp_c"));
    assert_eq!(gw.mock.attempts("annotate"), 1);
}

#[tokio::test]
async fn a_broken_request_schema_is_the_callers_fault() {
    let gw = start().await;
    let mut body = structured("gpt-4o");
    body["response_format"]["json_schema"]["schema"] = json!({"type": 12});
    let resp = gw.chat("bad-schema", "", body).await;
    assert_eq!(resp.status(), 400);
    assert_eq!(json(resp).await["error"]["code"], "invalid_schema");
    assert_eq!(gw.mock.attempts("bad-schema"), 0);
}
