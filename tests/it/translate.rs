//! The strategy switch across providers end to end: the real gateway in front of the
//! real mock (in its strict mode, which refuses what the real APIs refuse), a route whose
//! first target speaks the caller's API and fails, and whose next target speaks the other
//! API. What the caller gets back and what each upstream received are both asserted.

use crate::common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// A gateway whose `xo-*` routes go OpenAI → Anthropic and `xa-*` routes Anthropic →
/// OpenAI, and whose `only-claude` route has a single Anthropic target.
async fn switching(extra: &str) -> Gateway {
    let extra = extra.to_string();
    start_with(move |config| {
        config.merge(&format!(
            r#"
[[routes]]
model = "xo-*"
targets = [{{ upstream = "mock-openai" }}, {{ upstream = "mock-anthropic", model = "claude-x", max_tokens = 512 }}]
context_fallback = {{ upstream = "mock-anthropic", model = "claude-long", max_tokens = 256 }}

[[routes]]
model = "xa-*"
targets = [{{ upstream = "mock-anthropic" }}, {{ upstream = "mock-openai", model = "gpt-x" }}]

[[routes]]
model = "only-claude"
targets = [{{ upstream = "mock-anthropic", model = "claude-x" }}]

[[routes]]
model = "drops-seed"
targets = [{{ upstream = "mock-anthropic", model = "claude-x", max_tokens = 100 }}]
translate = {{ drop = ["seed"] }}
{extra}
"#
        ))
    })
    .await
}

/// The OpenAI target fails all three of its attempts; the fourth goes to Anthropic.
const OPENAI_DOWN: &str = "status=503,status=503,status=503,ok";
const STRICT: (&str, &str) = ("x-mock-strict", "on");

async fn chat_call(gw: &Gateway, scenario: &str, fault: &str, body: Value) -> reqwest::Response {
    gw.post(
        "/v1/chat/completions",
        Some(KEY_A),
        &[
            ("x-mock-scenario", scenario),
            ("x-mock-fault", fault),
            STRICT,
        ],
        body.to_string(),
    )
    .await
}

async fn messages_call(
    gw: &Gateway,
    scenario: &str,
    fault: &str,
    body: Value,
) -> reqwest::Response {
    gw.post(
        "/v1/messages",
        Some(KEY_A),
        &[
            ("x-mock-scenario", scenario),
            ("x-mock-fault", fault),
            ("anthropic-version", "2023-06-01"),
            STRICT,
        ],
        body.to_string(),
    )
    .await
}

fn header<'a>(resp: &'a reqwest::Response, name: &str) -> &'a str {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap())
        .unwrap_or_else(|| panic!("no {name} header"))
}

/// A stream's `data:` payloads, `[DONE]` included as a string.
async fn data_events(resp: reqwest::Response) -> Vec<Value> {
    let mut text = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|data| serde_json::from_str(data).unwrap_or_else(|_| Value::String(data.into())))
        .collect()
}

#[tokio::test]
async fn a_chat_call_fails_over_to_anthropic_and_is_answered_in_chat() {
    let gw = switching("").await;
    let body = json!({
        "model": "xo-4o",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "stop": "END",
    });
    let resp = chat_call(&gw, "xo-plain", OPENAI_DOWN, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-upstream"), "mock-anthropic");
    assert_eq!(header(&resp, "x-backstop-model"), "claude-x");
    assert_eq!(header(&resp, "x-backstop-attempts"), "4");
    assert_eq!(
        header(&resp, "x-backstop-recovery"),
        "retry:503,retry:503,giveup:503,failover:mock-anthropic,translate:chat->messages,ok"
    );
    let answer = json(resp).await;
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["content"], "mock: hello");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert!(
        answer["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
        "{answer}"
    );
    assert_eq!(gw.mock.attempts("xo-plain"), 4);
    // What Anthropic received: its own shape, with the target's model and max_tokens.
    let sent = gw.mock.last_request("xo-plain").unwrap();
    assert_eq!(sent["path"], "/v1/messages");
    assert_eq!(
        sent["body"],
        json!({
            "model": "claude-x",
            "max_tokens": 512,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "stop_sequences": ["END"],
        })
    );
}

#[tokio::test]
async fn a_chat_tool_loop_goes_to_anthropic_with_its_ids_and_results() {
    let gw = switching("").await;
    let body = json!({
        "model": "xo-4o",
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.weather:0", "type": "function", "function": {"name": "weather", "arguments": ""}}
            ]},
            {"role": "tool", "tool_call_id": "functions.weather:0", "content": "sunny"}
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
    });
    let resp = chat_call(
        &gw,
        "xo-tools",
        &format!("{OPENAI_DOWN};tool=weather"),
        body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let answer = json(resp).await;
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{answer}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args.is_object(), "{args}");
    let sent = gw.mock.last_request("xo-tools").unwrap()["body"].clone();
    let id = sent["messages"][1]["content"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        id.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'),
        "{id}"
    );
    assert_eq!(
        sent["messages"][1]["content"][0]["input"],
        json!({}),
        "\"\" is {{}}"
    );
    assert_eq!(
        sent["messages"][2]["content"][0]["tool_use_id"],
        id.as_str()
    );
    assert_eq!(sent["tool_choice"], json!({"type": "any"}));
}

#[tokio::test]
async fn a_streamed_tool_call_from_anthropic_arrives_as_chat_chunks() {
    let gw = switching("").await;
    let body = json!({
        "model": "xo-4o", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    });
    let fault = format!("{OPENAI_DOWN};tool=weather;chunks=4");
    let resp = chat_call(&gw, "xo-stream", &fault, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-upstream"), "mock-anthropic");
    let events = data_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]", "{events:?}");
    let mut arguments = String::new();
    let mut finish = None;
    let mut usage = None;
    for chunk in &events[..events.len() - 1] {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
        }
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        if let Some(calls) = choice["delta"]["tool_calls"].as_array() {
            assert_eq!(calls[0]["index"], 0);
            arguments.push_str(calls[0]["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert!(
        serde_json::from_str::<Value>(&arguments)
            .unwrap()
            .is_object(),
        "{arguments}"
    );
    assert!(usage.is_some(), "include_usage was asked: {events:?}");
}

#[tokio::test]
async fn an_anthropic_call_fails_over_to_openai_and_is_answered_as_a_message() {
    let gw = switching("").await;
    let body = json!({
        "model": "xa-sonnet", "max_tokens": 64,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hello"}],
    });
    let resp = messages_call(&gw, "xa-plain", OPENAI_DOWN, body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-upstream"), "mock-openai");
    assert_eq!(header(&resp, "x-backstop-model"), "gpt-x");
    assert!(header(&resp, "x-backstop-recovery")
        .ends_with("failover:mock-openai,translate:messages->chat,ok"));
    let answer = json(resp).await;
    assert_eq!(answer["type"], "message");
    assert_eq!(
        answer["content"][0],
        json!({"type": "text", "text": "mock: hello"})
    );
    assert_eq!(answer["stop_reason"], "end_turn");
    let sent = gw.mock.last_request("xa-plain").unwrap();
    assert_eq!(sent["path"], "/v1/chat/completions");
    assert_eq!(
        sent["body"],
        json!({
            "model": "gpt-x", "max_completion_tokens": 64,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        })
    );
    // Streamed, the same switch gives Anthropic's events.
    let body = json!({"model": "xa-sonnet", "max_tokens": 64, "stream": true,
        "messages": [{"role": "user", "content": "hello"}]});
    let resp = messages_call(&gw, "xa-stream", OPENAI_DOWN, body).await;
    assert_eq!(resp.status(), 200);
    let events = data_events(resp).await;
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{events:?}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{events:?}");
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| e["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "mock: hello");
}

#[tokio::test]
async fn a_target_that_cannot_carry_the_request_is_skipped_out_loud() {
    let gw = switching("").await;
    // `n` = 2 has no Anthropic equivalent: the Anthropic target is skipped, and the
    // OpenAI target's failure is what the caller sees.
    let body = json!({"model": "xo-4o", "n": 2, "messages": [{"role": "user", "content": "hi"}]});
    let resp = chat_call(&gw, "xo-n", "status=503", body).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(
        header(&resp, "x-backstop-recovery"),
        "skip:mock-anthropic(untranslatable: /n),retry:503,retry:503,giveup:503"
    );
    assert_eq!(gw.mock.attempts("xo-n"), 3);
    // With no target left: 400 naming the paths, and no upstream call.
    let body = json!({"model": "only-claude", "n": 2, "seed": 1,
        "messages": [{"role": "user", "content": "hi"}]});
    let resp = chat_call(&gw, "only-n", "", body).await;
    assert_eq!(resp.status(), 400);
    let error = json(resp).await["error"].clone();
    assert_eq!(error["code"], "unsupported_conversion");
    assert_eq!(error["type"], "invalid_request_error");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("max_tokens") && message.contains("/n") && message.contains("/seed"),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("only-n"), 0);
}

#[tokio::test]
async fn a_route_may_drop_named_fields_and_says_so() {
    let gw = switching("").await;
    let body =
        json!({"model": "drops-seed", "seed": 42, "messages": [{"role": "user", "content": "hi"}]});
    let resp = chat_call(&gw, "drop", "", body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-translation-dropped"), "seed");
    let sent = gw.mock.last_request("drop").unwrap()["body"].clone();
    assert!(sent.get("seed").is_none(), "{sent}");
    assert_eq!(sent["max_tokens"], 100);
}

#[tokio::test]
async fn upstream_errors_come_back_in_the_callers_shape_and_type() {
    let gw = switching("").await;
    // A caller fault from Anthropic, to an OpenAI caller: OpenAI's error shape.
    let body = json!({"model": "only-claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let resp = chat_call(&gw, "err-400", "status=400", body.clone()).await;
    assert_eq!(resp.status(), 400);
    let error = json(resp).await;
    assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
    assert!(error["error"]["message"].is_string());
    // A rate limit stays a rate limit.
    let resp = chat_call(&gw, "err-429", "status=429", body).await;
    assert_eq!(resp.status(), 429);
    let error = json(resp).await;
    assert_eq!(error["error"]["type"], "requests", "{error}");
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
}

#[tokio::test]
async fn context_length_falls_back_across_providers() {
    let gw = switching("").await;
    let body = json!({"model": "xo-4o", "messages": [{"role": "user", "content": "long"}]});
    let resp = chat_call(
        &gw,
        "xo-context",
        "status=400;code=context_length_exceeded,ok",
        body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-model"), "claude-long");
    assert_eq!(
        header(&resp, "x-backstop-recovery"),
        "fallback:mock-anthropic,failover:mock-anthropic,translate:chat->messages,ok"
    );
    assert_eq!(
        gw.mock.last_request("xo-context").unwrap()["body"]["max_tokens"],
        256
    );
}

#[tokio::test]
async fn a_context_fallback_that_cannot_carry_the_request_leaves_the_overflow_as_the_answer() {
    let gw = switching("").await;
    // `seed` has no Anthropic equivalent: the fallback is skipped, the 400 stands.
    let body =
        json!({"model": "xo-4o", "seed": 7, "messages": [{"role": "user", "content": "long"}]});
    let resp = chat_call(
        &gw,
        "xo-context-seed",
        "status=400;code=context_length_exceeded",
        body,
    )
    .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(
        header(&resp, "x-backstop-recovery"),
        "skip:mock-anthropic(untranslatable: /seed),fallback:mock-anthropic,skip:mock-anthropic(untranslatable: /seed)"
    );
    assert_eq!(json(resp).await["error"]["code"], "context_length_exceeded");
    assert_eq!(gw.mock.attempts("xo-context-seed"), 1);
}

#[tokio::test]
async fn an_in_stream_failure_ends_the_callers_stream_with_an_error_not_done() {
    let gw = switching("").await;
    let body = json!({"model": "only-claude", "max_tokens": 50, "stream": true,
        "messages": [{"role": "user", "content": "a long answer please"}]});
    let resp = chat_call(&gw, "cut", "chunks=8;cut=3", body).await;
    assert_eq!(resp.status(), 200);
    let events = data_events(resp).await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    assert!(events.last().unwrap().get("error").is_some(), "{events:?}");
    assert!(
        !events
            .iter()
            .any(|e| e["choices"][0]["finish_reason"].is_string()),
        "no successful end: {events:?}"
    );
}

#[tokio::test]
async fn translated_calls_are_charged_at_the_price_of_the_model_called() {
    let gw = switching(
        r#"
[admin]
token = "admin-token-0123456789"

[[prices]]
model = "xo-*"
input_per_mtok = 2.5
output_per_mtok = 10.0

[[prices]]
model = "claude-x"
input_per_mtok = 3.0
output_per_mtok = 15.0

[[tenants]]
name = "priced"
api_keys = ["bk-priced-key-0001"]
[tenants.session]
max_usd = 10.0
"#,
    )
    .await;
    let body = json!({"model": "xo-4o", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some("bk-priced-key-0001"),
            &[
                ("x-mock-scenario", "priced"),
                (
                    "x-mock-fault",
                    "status=503,status=503,status=503,usage=1000/1000",
                ),
                ("x-session-id", "s1"),
                STRICT,
            ],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-model"), "claude-x");
    let report = json(
        gw.get("/admin/tenants/priced/sessions/s1", Some(ADMIN))
            .await,
    )
    .await;
    // 1000 in at $3/Mtok + 1000 out at $15/Mtok: Claude's price, not the route's.
    assert!(
        (report["used"]["usd"].as_f64().unwrap() - 0.018).abs() < 1e-9,
        "{report}"
    );
}

#[tokio::test]
async fn every_answer_names_its_upstream_and_model() {
    let gw = start().await;
    let resp = gw.chat("names", "", chat("rewrite-me")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-upstream"), "mock-openai");
    assert_eq!(header(&resp, "x-backstop-model"), "gpt-4o-mini");
}
