//! Answers in each API's wire format.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use axum::body::Body;
use base64::Engine;
use bytes::Bytes;
use futures_util::{stream, StreamExt};
use http::{header, Response, StatusCode};
use serde_json::{json, Value};

use super::FaultStep;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
    OpenAi,
    Anthropic,
    /// The OpenAI Responses API: OpenAI's error shape.
    Responses,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The text of a message's `content`: a string, or the text parts of a content array.
pub(super) fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn messages(request: &Value) -> &[Value] {
    request
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// `"mock: "` + the last user message, capped at 1,000 characters.
fn reply_text(request: &Value, step: &FaultStep) -> String {
    let mut text = base_text(request, step);
    if let Some(pad) = step.pad {
        text.push_str(&"x".repeat(pad));
    }
    text
}

fn base_text(request: &Value, step: &FaultStep) -> String {
    if let Some(content) = &step.content {
        return content.clone();
    }
    let last_user = messages(request)
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .map(|m| content_text(m.get("content").unwrap_or(&Value::Null)))
        .unwrap_or_default();
    let truncated: String = last_user.chars().take(1000).collect();
    format!("mock: {truncated}")
}

fn usage(request: &Value, text: &str, step: &FaultStep) -> (u64, u64) {
    step.usage.unwrap_or_else(|| {
        let prompt_chars: usize = messages(request)
            .iter()
            .map(|m| content_text(m.get("content").unwrap_or(&Value::Null)).len())
            .sum();
        let prompt = (prompt_chars as u64).div_ceil(4).max(1);
        let completion = text.split_whitespace().count().max(1) as u64;
        (prompt, completion)
    })
}

/// Splits `text` into `n` pieces that concatenate back to it.
pub(super) fn pieces(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let n = n.clamp(1, chars.len().max(1));
    let size = chars.len().div_ceil(n).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

/// A chat completion or an Anthropic message (Responses requests are answered by
/// `responses_api`, never here: they are served the chat shape if they arrive).
pub fn completion(api: Api, request: &Value, step: &FaultStep) -> Response<Body> {
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_string();
    let text = reply_text(request, step);
    let (input, output) = usage(request, &text, step);
    let streaming = !step.plain
        && request
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let id = next_id();
    if !streaming {
        let tool_args = step.tool_args.clone().unwrap_or_else(|| "{}".into());
        let body = match (api, &step.tool) {
            (Api::OpenAi | Api::Responses, None) => json!({
                "id": format!("chatcmpl-mock-{id}"),
                "object": "chat.completion",
                "created": now_secs(),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input.saturating_add(output)},
            }),
            (Api::OpenAi | Api::Responses, Some(tool)) => json!({
                "id": format!("chatcmpl-mock-{id}"),
                "object": "chat.completion",
                "created": now_secs(),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
                    {"id": format!("call_mock_{id}"), "type": "function", "function": {"name": tool, "arguments": tool_args}}
                ]}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input.saturating_add(output)},
            }),
            (Api::Anthropic, None) => json!({
                "id": format!("msg_mock_{id}"),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn",
                "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": output},
            }),
            (Api::Anthropic, Some(tool)) => json!({
                "id": format!("msg_mock_{id}"),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{"type": "tool_use", "id": format!("toolu_mock_{id}"), "name": tool,
                             "input": serde_json::from_str::<Value>(&tool_args).unwrap_or(Value::String(tool_args.clone()))}],
                "stop_reason": "tool_use",
                "stop_sequence": null,
                "usage": {"input_tokens": input, "output_tokens": output},
            }),
        };
        return json_ok(body);
    }
    let parts = pieces(&text, step.chunks.unwrap_or(4));
    let events = match api {
        Api::OpenAi | Api::Responses => openai_events(id, &model, &parts, request, (input, output)),
        Api::Anthropic => anthropic_events(id, &model, &parts, (input, output)),
    };
    sse(events, step)
}

fn openai_events(
    id: u64,
    model: &str,
    parts: &[String],
    request: &Value,
    usage: (u64, u64),
) -> Vec<Bytes> {
    let created = now_secs();
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk",
            "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    events.extend(
        parts
            .iter()
            .map(|p| chunk(json!({"content": p}), Value::Null)),
    );
    events.push(chunk(json!({}), json!("stop")));
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if include_usage {
        events.push(json!({
            "id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk",
            "created": created, "model": model, "choices": [],
            "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0.saturating_add(usage.1)},
        }));
    }
    let mut out: Vec<Bytes> = events
        .iter()
        .map(|e| Bytes::from(format!("data: {e}\n\n")))
        .collect();
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

fn anthropic_events(id: u64, model: &str, parts: &[String], usage: (u64, u64)) -> Vec<Bytes> {
    let event = |name: &str, data: Value| Bytes::from(format!("event: {name}\ndata: {data}\n\n"));
    let mut out = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
            "id": format!("msg_mock_{id}"), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": usage.0, "output_tokens": 1}}}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    out.extend(parts.iter().map(|p| {
        event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}}))
    }));
    out.push(event(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": 0}),
    ));
    out.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": usage.1}})));
    out.push(event("message_stop", json!({"type": "message_stop"})));
    out
}

/// An SSE body, paced by `chunk_delay` and broken after `cut` events when asked; or one
/// of the hostile streams (`endless`, `drip`, `huge_event`) after the first event.
pub(super) fn sse(events: Vec<Bytes>, step: &FaultStep) -> Response<Body> {
    let delay = step.chunk_delay;
    let cut = step.cut;
    let body = if step.endless || step.drip.is_some() || step.huge_event.is_some() {
        hostile(events, step)
    } else {
        let items = events.into_iter().enumerate();
        stream::iter(items)
            .then(move |(i, event)| async move {
                if cut.is_some_and(|n| i >= n) {
                    // Let the connection flush what was sent, so the cut lands mid-stream
                    // rather than before the response head.
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "mock cut",
                    ));
                }
                if let Some(d) = delay.filter(|_| i > 0) {
                    tokio::time::sleep(d).await;
                }
                Ok(event)
            })
            .boxed()
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response parts")
}

type Chunks = futures_util::stream::BoxStream<'static, Result<Bytes, std::io::Error>>;

/// Streams that never end well: the first event, then forever more events (`endless`),
/// one byte at a time (`drip`), or one event that never ends (`huge_event`).
fn hostile(events: Vec<Bytes>, step: &FaultStep) -> Chunks {
    let first = events.into_iter().next().unwrap_or_default();
    let head = stream::once(async move { Ok(first) });
    if let Some(every) = step.drip {
        let tail = stream::unfold((), move |()| async move {
            tokio::time::sleep(every).await;
            Some((Ok(Bytes::from_static(b"x")), ()))
        });
        return head
            .chain(stream::once(async { Ok(Bytes::from_static(b"data: ")) }))
            .chain(tail)
            .boxed();
    }
    if let Some(size) = step.huge_event {
        const PIECE: usize = 64 * 1024;
        let pieces = size.div_ceil(PIECE);
        let tail = stream::iter(0..pieces)
            .map(|_| Ok(Bytes::from(vec![b'x'; PIECE])))
            .chain(stream::once(std::future::pending()));
        return head
            .chain(stream::once(async { Ok(Bytes::from_static(b"data: ")) }))
            .chain(tail)
            .boxed();
    }
    let every = step
        .chunk_delay
        .unwrap_or(std::time::Duration::from_millis(10));
    let tail = stream::unfold(0u64, move |n| async move {
        tokio::time::sleep(every).await;
        let event = format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{n} \"}}}}]}}\n\n"
        );
        Some((Ok(Bytes::from(event)), n + 1))
    });
    head.chain(tail).boxed()
}

/// Anthropic's `count_tokens`: the scripted input count (`usage=IN/OUT`), else about a
/// token per four bytes of the messages and system prompt.
pub fn count_tokens(request: &Value, step: &FaultStep) -> Response<Body> {
    let estimated = || {
        let bytes = ["messages", "system", "tools"]
            .iter()
            .filter_map(|k| request.get(*k))
            .map(|v| v.to_string().len())
            .sum::<usize>();
        (bytes as u64).div_ceil(4).max(1)
    };
    let input = step.usage.map_or_else(estimated, |(input, _)| input);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({"input_tokens": input}).to_string()))
        .expect("valid response parts")
}

pub fn embeddings(request: &Value, step: &FaultStep) -> Response<Body> {
    let inputs = match request.get("input") {
        Some(Value::Array(items)) => items.len(),
        Some(_) => 1,
        None => 0,
    };
    let base64 = request.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let data: Vec<Value> = (0..inputs)
        .map(|i| {
            let vector: Vec<f32> = (0..8).map(|d| ((i * 8 + d) as f32 * 0.125).sin()).collect();
            let embedding = if base64 {
                let bytes: Vec<u8> = vector.iter().flat_map(|f| f.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens = step.usage.map_or(inputs as u64 * 4, |u| u.0);
    json_ok(json!({
        "object": "list",
        "data": data,
        "model": request.get("model").cloned().unwrap_or(Value::Null),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

/// An error in the API's shape, with the status's usual type unless `code` names one.
pub fn error(api: Api, status: u16, step: &FaultStep) -> Response<Body> {
    let default_type = match (api, status) {
        (Api::Anthropic, 429) => "rate_limit_error",
        (Api::Anthropic, 529) => "overloaded_error",
        (Api::Anthropic, 401) => "authentication_error",
        (Api::Anthropic, 403) => "permission_error",
        (Api::Anthropic, 404) => "not_found_error",
        (Api::Anthropic, 400..=499) => "invalid_request_error",
        (Api::Anthropic, _) => "api_error",
        (Api::OpenAi | Api::Responses, 429) => "rate_limit_exceeded",
        (Api::OpenAi | Api::Responses, 401) => "invalid_api_key",
        (Api::OpenAi | Api::Responses, 400..=499) => "invalid_request_error",
        (Api::OpenAi | Api::Responses, _) => "server_error",
    };
    let code = step.code.as_deref().unwrap_or(default_type);
    let message = format!("mock upstream fault: status {status} ({code})");
    let body = match api {
        Api::OpenAi | Api::Responses => {
            json!({"error": {"message": message, "type": code, "code": code, "param": null}})
        }
        Api::Anthropic => json!({"type": "error", "error": {"type": code, "message": message}}),
    };
    let mut builder = Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(ra) = &step.retry_after {
        builder = builder.header(header::RETRY_AFTER, ra.as_str());
    }
    if let Some(ms) = step.retry_after_ms {
        builder = builder.header("retry-after-ms", ms.to_string());
    }
    builder
        .body(Body::from(body.to_string()))
        .expect("valid response parts")
}

pub(super) fn json_ok(value: Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(value.to_string()))
        .expect("valid response parts")
}
