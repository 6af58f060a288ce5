//! A validated answer replayed to a streaming client as SSE in its API's format. The
//! client sees the same event sequence a live stream would give, only all at once.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::api::ApiKind;

fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

fn event(name: &str, value: &Value) -> String {
    format!("event: {name}\ndata: {value}\n\n")
}

/// The SSE body for a complete (non-streaming) answer.
pub fn as_sse(api: ApiKind, answer: &Value, include_usage: bool) -> Bytes {
    match api {
        ApiKind::OpenAi => openai(answer, include_usage),
        ApiKind::Anthropic => anthropic(answer),
    }
    .into()
}

fn openai(answer: &Value, include_usage: bool) -> String {
    let base = |choices: Value| {
        json!({
            "id": answer.get("id"), "object": "chat.completion.chunk",
            "created": answer.get("created"), "model": answer.get("model"), "choices": choices,
        })
    };
    let message = answer
        .pointer("/choices/0/message")
        .cloned()
        .unwrap_or(Value::Null);
    let finish = answer
        .pointer("/choices/0/finish_reason")
        .cloned()
        .unwrap_or(json!("stop"));
    let mut out = data(&base(
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
    ));
    if let Some(content) = message.get("content").and_then(Value::as_str) {
        out += &data(&base(
            json!([{"index": 0, "delta": {"content": content}, "finish_reason": null}]),
        ));
    }
    if let Some(calls) = message.get("tool_calls").and_then(Value::as_array) {
        let deltas: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"index": i, "id": c.get("id"), "type": "function", "function": c.get("function")}))
            .collect();
        out += &data(&base(
            json!([{"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": null}]),
        ));
    }
    out += &data(&base(
        json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
    ));
    if include_usage {
        let mut usage = base(json!([]));
        usage["usage"] = answer.get("usage").cloned().unwrap_or(Value::Null);
        out += &data(&usage);
    }
    out + "data: [DONE]\n\n"
}

fn anthropic(answer: &Value) -> String {
    let mut start = answer.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    let usage = answer.get("usage").cloned().unwrap_or(json!({}));
    let mut out = event(
        "message_start",
        &json!({"type": "message_start", "message": start}),
    );
    for (i, block) in answer
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        match block.get("type").and_then(Value::as_str) {
            Some("tool_use") => {
                let mut empty = block.clone();
                empty["input"] = json!({});
                out += &event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": i, "content_block": empty}),
                );
                let partial = block.get("input").map(Value::to_string).unwrap_or_default();
                out += &event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": partial}}),
                );
            }
            _ => {
                out += &event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
                );
                let text = block.get("text").and_then(Value::as_str).unwrap_or("");
                out += &event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": text}}),
                );
            }
        }
        out += &event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": i}),
        );
    }
    out += &event(
        "message_delta",
        &json!({"type": "message_delta", "delta": {"stop_reason": answer.get("stop_reason"), "stop_sequence": answer.get("stop_sequence")}, "usage": {"output_tokens": usage.get("output_tokens")}}),
    );
    out + &event("message_stop", &json!({"type": "message_stop"}))
}
