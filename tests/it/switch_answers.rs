//! Hardening v3, the strategy switch's answers, through the real server: an answer that
//! cannot be translated back names why, is charged the target's own usage and goes to
//! the next target; an OpenAI-compatible target that answers tool calls with
//! `finish_reason: "stop"` (vLLM, Ollama) is `tool_use` for an Anthropic caller; a
//! Responses answer cut by its output cap marks its message incomplete.

use serde_json::json;

use crate::billing::{call, gateway, spent};
use crate::common::*;

const ROUTES: &str = r#"
[[routes]]
model = "claude-then-openai"
targets = [{ upstream = "mock-anthropic", model = "claude-sonnet-4-5", max_tokens = 1024 }, { upstream = "mock-openai", model = "gpt-4o" }]

[[routes]]
model = "to-openai"
targets = [{ upstream = "mock-openai", model = "gpt-4o" }]
"#;

#[tokio::test]
async fn an_untranslatable_answer_names_its_reason_is_charged_its_usage_and_fails_over() {
    let gw = gateway("max_usd = 5.0", ROUTES).await;
    // A chat caller answered by Claude with `pause_turn`, which chat cannot say. Before:
    // "not valid JSON", charged the reservation (25× the usage reported).
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "pause",
        "stop=pause_turn;usage=100/50",
        &chat("to-claude").json(),
    )
    .await;
    assert_eq!(resp.status(), 502);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "upstream_malformed", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("cannot be translated back")
            && message.contains("stop_reason `pause_turn` has no finish_reason"),
        "{message}"
    );
    // Each attempt at its reported usage: 100 × 3 + 50 × 15.
    let attempts = gw.mock.attempts("pause");
    assert!(attempts >= 1);
    assert_eq!(
        spent(&gw, "pause", attempts).await,
        (attempts as i64 * 1_050, attempts * 150)
    );

    // With another target on the route, the caller gets its answer.
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "pause-then-openai",
        "stop=pause_turn;usage=100/50,usage=10/10,usage=10/10,usage=10/10",
        &chat("claude-then-openai").json(),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(body["model"], "gpt-4o", "{body}");
}

#[tokio::test]
async fn tool_calls_an_openai_compatible_target_finishes_with_stop_are_tool_use() {
    let gw = gateway("max_usd = 5.0", ROUTES).await;
    let body = json!({"model": "to-openai", "max_tokens": 100,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "weather?"}]});
    for stream in [false, true] {
        let mut body = body.clone();
        body["stream"] = json!(stream);
        // Before: `end_turn` beside the tool_use block, so the agent loop stopped.
        let resp = call(
            &gw,
            "/v1/messages",
            &format!("vllm-{stream}"),
            "tool=get_weather;stop=stop",
            &body,
        )
        .await;
        assert_eq!(resp.status(), 200);
        let text = resp.text().await.unwrap();
        if stream {
            assert!(text.contains(r#""stop_reason":"tool_use""#), "{text}");
        } else {
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(answer["stop_reason"], "tool_use", "{answer}");
            assert_eq!(answer["content"][0]["type"], "tool_use", "{answer}");
        }
    }
    // `function_call` without a call is the end of a turn, not a tool use.
    let resp = call(&gw, "/v1/messages", "no-call", "stop=function_call", &body).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(json(resp).await["stop_reason"], "end_turn");
}

#[tokio::test]
async fn cached_input_an_openai_target_reports_to_an_anthropic_caller_is_priced_as_billed() {
    let gw = gateway("max_usd = 5.0", ROUTES).await;
    // Prompt 1,000 of which 800 cached, completion 10, on gpt-4o: 200 × 2.50 + 800 × 1.25
    // + 10 × 10 = 1,600 per million (the issue's item 7: before, the 800 cached were lost).
    let usage = json!({"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010,
        "prompt_tokens_details": {"cached_tokens": 800}});
    let body = json!({"model": "to-openai", "max_tokens": 100,
        "messages": [{"role": "user", "content": "hello"}]});
    let resp = call(
        &gw,
        "/v1/messages",
        "cached",
        &crate::billing::reporting(&usage),
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let answer = json(resp).await;
    assert_eq!(answer["usage"]["cache_read_input_tokens"], 800, "{answer}");
    assert_eq!(answer["usage"]["input_tokens"], 200, "{answer}");
    assert_eq!(spent(&gw, "cached", 1).await, (1_600, 1_010));
}
