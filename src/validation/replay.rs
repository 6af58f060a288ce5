//! A validated answer replayed to a streaming client as SSE in its API's format. The
//! client sees the same event sequence a live stream would give, only all at once.

use bytes::Bytes;
use serde_json::{json, Value};

use super::Format;

fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

fn event(name: &str, value: &Value) -> String {
    format!("event: {name}\ndata: {value}\n\n")
}

/// The SSE body for a complete (non-streaming) answer.
pub fn as_sse(format: impl Into<Format>, answer: &Value, include_usage: bool) -> Bytes {
    match format.into() {
        Format::Chat => openai(answer, include_usage),
        Format::Messages => anthropic(answer),
        Format::Responses => responses(answer),
    }
    .into()
}

/// The Responses API's event sequence for a whole `response` object: created, each
/// output item added with its content or arguments, done, then `response.completed`
/// carrying the whole response (and its usage).
fn responses(answer: &Value) -> String {
    let mut seq = 0u64;
    let mut out = String::new();
    let mut emit = |name: &str, mut value: Value| {
        value["type"] = json!(name);
        value["sequence_number"] = json!(seq);
        seq += 1;
        out += &event(name, &value);
    };
    let mut started = answer.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    emit("response.created", json!({"response": started}));
    emit("response.in_progress", json!({"response": started}));
    let items = answer.get("output").and_then(Value::as_array);
    for (i, item) in items.into_iter().flatten().enumerate() {
        let id = item.get("id").cloned().unwrap_or(Value::Null);
        let mut added = item.clone();
        match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                added["content"] = json!([]);
                added["status"] = json!("in_progress");
                emit(
                    "response.output_item.added",
                    json!({"output_index": i, "item": added}),
                );
                let parts = item.get("content").and_then(Value::as_array);
                for (c, part) in parts.into_iter().flatten().enumerate() {
                    let at = |extra: Value| {
                        let mut v = json!({"item_id": id, "output_index": i, "content_index": c});
                        if let (Value::Object(v), Value::Object(extra)) = (&mut v, extra) {
                            v.extend(extra);
                        }
                        v
                    };
                    let mut empty = part.clone();
                    if empty.get("text").is_some() {
                        empty["text"] = json!("");
                    }
                    emit("response.content_part.added", at(json!({"part": empty})));
                    if let Some(text) = part.get("text").and_then(Value::as_str) {
                        emit(
                            "response.output_text.delta",
                            at(json!({"delta": text, "logprobs": []})),
                        );
                        emit(
                            "response.output_text.done",
                            at(json!({"text": text, "logprobs": []})),
                        );
                    }
                    emit("response.content_part.done", at(json!({"part": part})));
                }
            }
            Some("function_call") => {
                added["arguments"] = json!("");
                added["status"] = json!("in_progress");
                emit(
                    "response.output_item.added",
                    json!({"output_index": i, "item": added}),
                );
                let args = item.get("arguments").cloned().unwrap_or(json!(""));
                emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": i, "delta": args}),
                );
                emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": i, "arguments": args}),
                );
            }
            _ => emit(
                "response.output_item.added",
                json!({"output_index": i, "item": added}),
            ),
        }
        emit(
            "response.output_item.done",
            json!({"output_index": i, "item": item}),
        );
    }
    emit("response.completed", json!({"response": answer}));
    out
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
