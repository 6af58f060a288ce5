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

use super::{fault::thinking_signature, FaultStep};

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

/// The `x_future` field a `future` step adds to every JSON it sends.
pub(super) fn future_field() -> Value {
    json!({"n": 1})
}

/// The first thinking block of the request's assistant messages whose signature is not
/// the mock's own: the message a real Claude answers such a request with.
fn bad_thinking_signature(request: &Value) -> Option<String> {
    for (n, message) in messages(request).iter().enumerate() {
        if message.get("role").and_then(Value::as_str) != Some("assistant") {
            continue;
        }
        let Some(parts) = message.get("content").and_then(Value::as_array) else {
            continue;
        };
        for (m, part) in parts.iter().enumerate() {
            if part.get("type").and_then(Value::as_str) != Some("thinking") {
                continue;
            }
            let thinking = part.get("thinking").and_then(Value::as_str).unwrap_or("");
            let signature = part.get("signature").and_then(Value::as_str);
            if signature != Some(thinking_signature(thinking).as_str()) {
                return Some(format!(
                    "messages.{n}.content.{m}: Invalid `signature` in `thinking` block"
                ));
            }
        }
    }
    None
}

/// What one chat or Anthropic answer holds, whether streamed or not.
struct Answer<'a> {
    id: u64,
    model: &'a str,
    /// The text, when the answer has one: always without a tool, with one only when
    /// the step scripts `content`.
    text: Option<&'a str>,
    /// The tool call: name and arguments.
    tool: Option<(&'a str, &'a str)>,
    usage: (u64, u64),
    step: &'a FaultStep,
}

/// A chat completion or an Anthropic message (Responses requests are answered by
/// `responses_api`, never here: they are served the chat shape if they arrive).
pub fn completion(api: Api, request: &Value, step: &FaultStep) -> Response<Body> {
    if api == Api::Anthropic {
        if let Some(message) = bad_thinking_signature(request) {
            return Response::builder()
                .status(StatusCode::BAD_REQUEST)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(
                    json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}})
                        .to_string(),
                ))
                .expect("valid response parts");
        }
    }
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_string();
    let text = reply_text(request, step);
    let usage = usage(request, &text, step);
    let streaming = !step.plain
        && request
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let tool_args = step.tool_args.clone().unwrap_or_else(|| "{}".into());
    let answer = Answer {
        id: next_id(),
        model: &model,
        text: (step.tool.is_none() || step.content.is_some()).then_some(text.as_str()),
        tool: step.tool.as_deref().map(|name| (name, tool_args.as_str())),
        usage,
        step,
    };
    if !streaming {
        let mut body = match api {
            Api::OpenAi | Api::Responses => chat_body(&answer),
            Api::Anthropic => anthropic_body(&answer),
        };
        if step.future {
            body["x_future"] = future_field();
        }
        return json_ok(body);
    }
    let events = match api {
        Api::OpenAi | Api::Responses => openai_events(&answer, request),
        Api::Anthropic => anthropic_events(&answer),
    };
    sse(events, step)
}

fn chat_body(a: &Answer<'_>) -> Value {
    let (input, output) = a.usage;
    // As OpenAI's own answers: `refusal` and `annotations` are always there.
    let mut message =
        json!({"role": "assistant", "content": a.text, "refusal": null, "annotations": []});
    if let Some((name, args)) = a.tool {
        message["tool_calls"] = json!([
            {"id": format!("call_mock_{}", a.id), "type": "function", "function": {"name": name, "arguments": args}}
        ]);
    }
    if let Some(reasoning) = &a.step.reasoning {
        message["reasoning_content"] = json!(reasoning);
    }
    json!({
        "id": format!("chatcmpl-mock-{}", a.id),
        "object": "chat.completion",
        "created": now_secs(),
        "model": a.model,
        "choices": [{"index": 0, "message": message, "finish_reason": a.step.stop.as_deref().unwrap_or(if a.tool.is_some() { "tool_calls" } else { "stop" })}],
        "usage": a.step.usage_json.clone().unwrap_or_else(|| json!({"prompt_tokens": input, "completion_tokens": output, "total_tokens": input.saturating_add(output)})),
    })
}

/// The content blocks of an Anthropic answer, in order: thinking, redacted thinking,
/// text, tool use.
fn anthropic_blocks(a: &Answer<'_>) -> Vec<Value> {
    let mut blocks = Vec::new();
    if let Some(thinking) = &a.step.thinking {
        blocks.push(json!({"type": "thinking", "thinking": thinking, "signature": thinking_signature(thinking)}));
    }
    if let Some(data) = &a.step.redacted_thinking {
        blocks.push(json!({"type": "redacted_thinking", "data": data}));
    }
    if let Some(text) = a.text {
        blocks.push(json!({"type": "text", "text": text}));
    }
    if let Some((name, args)) = a.tool {
        blocks.push(json!({"type": "tool_use", "id": format!("toolu_mock_{}", a.id), "name": name,
                           "input": serde_json::from_str::<Value>(args).unwrap_or(Value::String(args.to_string()))}));
    }
    blocks
}

/// Anthropic's usage as the real API reports it: the cache counts are always there,
/// zero when no prompt caching was used.
fn anthropic_usage(input: u64, output: u64) -> Value {
    json!({"input_tokens": input, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": 0, "output_tokens": output})
}

/// A stream's usage as Anthropic splits it: `message_start` carries the input and cache
/// counts with an output of 1, `message_delta` the output (and the server tools' use).
/// With `usage_b64`, that usage split so.
fn anthropic_start_usage(a: &Answer<'_>) -> Value {
    match &a.step.usage_json {
        Some(Value::Object(usage)) => {
            let mut start = usage.clone();
            start.remove("server_tool_use");
            if start.contains_key("output_tokens") {
                start.insert("output_tokens".into(), json!(1));
            }
            Value::Object(start)
        }
        _ => anthropic_usage(a.usage.0, 1),
    }
}

fn anthropic_delta_usage(a: &Answer<'_>) -> Value {
    match &a.step.usage_json {
        Some(Value::Object(usage)) => {
            let mut delta = serde_json::Map::new();
            for key in ["output_tokens", "server_tool_use"] {
                if let Some(v) = usage.get(key) {
                    delta.insert(key.into(), v.clone());
                }
            }
            Value::Object(delta)
        }
        _ => json!({"output_tokens": a.usage.1}),
    }
}

fn anthropic_body(a: &Answer<'_>) -> Value {
    json!({
        "id": format!("msg_mock_{}", a.id),
        "type": "message",
        "role": "assistant",
        "model": a.model,
        "content": anthropic_blocks(a),
        "stop_reason": a.step.stop.as_deref().unwrap_or(if a.tool.is_some() { "tool_use" } else { "end_turn" }),
        "stop_sequence": null,
        "usage": a.step.usage_json.clone().unwrap_or_else(|| anthropic_usage(a.usage.0, a.usage.1)),
    })
}

fn openai_events(a: &Answer<'_>, request: &Value) -> Vec<Bytes> {
    let created = now_secs();
    let id = a.id;
    let model = a.model;
    let n = a.step.chunks.unwrap_or(4);
    let chunk = |delta: Value, finish: Value| {
        json!({
            "id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk",
            "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    };
    let first = match a.text {
        Some(_) => json!({"role": "assistant", "content": ""}),
        None => json!({"role": "assistant", "content": null}),
    };
    let mut events = vec![chunk(first, Value::Null)];
    if let Some(reasoning) = &a.step.reasoning {
        events.extend(
            pieces(reasoning, n)
                .iter()
                .map(|p| chunk(json!({"reasoning_content": p}), Value::Null)),
        );
    }
    if let Some(text) = a.text {
        events.extend(
            pieces(text, n)
                .iter()
                .map(|p| chunk(json!({"content": p}), Value::Null)),
        );
    }
    if let Some((name, args)) = a.tool {
        events.push(chunk(
            json!({"tool_calls": [{"index": 0, "id": format!("call_mock_{id}"), "type": "function",
                                   "function": {"name": name, "arguments": ""}}]}),
            Value::Null,
        ));
        events.extend(pieces(args, n).iter().map(|p| {
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}),
                Value::Null,
            )
        }));
    }
    let finish = a.step.stop.as_deref().unwrap_or(if a.tool.is_some() {
        "tool_calls"
    } else {
        "stop"
    });
    events.push(chunk(json!({}), json!(finish)));
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if include_usage {
        let usage = a.usage;
        events.push(json!({
            "id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk",
            "created": created, "model": model, "choices": [],
            "usage": a.step.usage_json.clone().unwrap_or_else(|| json!({"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0.saturating_add(usage.1)})),
        }));
    }
    if a.step.future {
        for event in &mut events {
            event["x_future"] = future_field();
            event["service_tier"] = json!("default");
            event["system_fingerprint"] = json!("fp_mock_future");
            event["obfuscation"] = json!("mockobf");
            if let Some(choices) = event["choices"].as_array_mut() {
                for choice in choices {
                    choice["logprobs"] = Value::Null;
                }
            }
        }
    }
    let mut out: Vec<Bytes> = events
        .iter()
        .map(|e| Bytes::from(format!("data: {e}\n\n")))
        .collect();
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

fn anthropic_events(a: &Answer<'_>) -> Vec<Bytes> {
    let n = a.step.chunks.unwrap_or(4);
    let mut events: Vec<(&str, Value)> = vec![(
        "message_start",
        json!({"type": "message_start", "message": {
        "id": format!("msg_mock_{}", a.id), "type": "message", "role": "assistant", "model": a.model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": anthropic_start_usage(a)}}),
    )];
    for (index, block) in anthropic_blocks(a).into_iter().enumerate() {
        let delta = |delta: Value| {
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": delta}),
            )
        };
        let start = |block: Value| {
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            )
        };
        let kind = block["type"].as_str().unwrap_or_default();
        let field = |name: &str| block[name].as_str().unwrap_or_default().to_string();
        let mut deltas = Vec::new();
        let opening = match kind {
            "thinking" => {
                let thinking = field("thinking");
                deltas.extend(
                    pieces(&thinking, n)
                        .into_iter()
                        .map(|p| delta(json!({"type": "thinking_delta", "thinking": p}))),
                );
                deltas.push(delta(
                    json!({"type": "signature_delta", "signature": field("signature")}),
                ));
                start(json!({"type": "thinking", "thinking": ""}))
            }
            "text" => {
                deltas.extend(
                    pieces(&field("text"), n)
                        .into_iter()
                        .map(|p| delta(json!({"type": "text_delta", "text": p}))),
                );
                start(json!({"type": "text", "text": ""}))
            }
            "tool_use" => {
                let (_, args) = a.tool.unwrap_or_default();
                deltas.extend(
                    pieces(args, n)
                        .into_iter()
                        .map(|p| delta(json!({"type": "input_json_delta", "partial_json": p}))),
                );
                start(
                    json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
                )
            }
            _ => start(block.clone()),
        };
        events.push(opening);
        if index == 0 {
            events.push(("ping", json!({"type": "ping"})));
        }
        events.extend(deltas);
        events.push((
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    let stop_reason = a.step.stop.as_deref().unwrap_or(if a.tool.is_some() {
        "tool_use"
    } else {
        "end_turn"
    });
    events.push(("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": anthropic_delta_usage(a)})));
    events.push(("message_stop", json!({"type": "message_stop"})));
    if a.step.future {
        for (_, data) in &mut events {
            data["x_future"] = future_field();
        }
        events.insert(
            1,
            ("x_future_event", json!({"type": "x_future_event", "n": 1})),
        );
    }
    events
        .into_iter()
        .map(|(name, data)| Bytes::from(format!("event: {name}\ndata: {data}\n\n")))
        .collect()
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
    let param = step.param.as_deref();
    let body = match api {
        Api::OpenAi | Api::Responses => {
            json!({"error": {"message": message, "type": code, "code": code, "param": param}})
        }
        // Anthropic names the field at the start of its message.
        Api::Anthropic => {
            let message = match param {
                Some(field) => format!("{field}: {message}"),
                None => message,
            };
            json!({"type": "error", "error": {"type": code, "message": message}})
        }
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use http_body_util::BodyExt;

    pub(in crate::mock) const ARGS_B64: &str = "eyJjaXR5IjoiUGFyaXMifQ==";
    pub(in crate::mock) const ARGS: &str = r#"{"city":"Paris"}"#;

    pub(in crate::mock) async fn body_of(response: Response<Body>) -> (StatusCode, String) {
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// The SSE events of a body: (event name, or "" without one; data, parsed when JSON).
    pub(in crate::mock) fn events(body: &str) -> Vec<(String, Value)> {
        body.split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = Value::Null;
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_string();
                    }
                    if let Some(d) = line.strip_prefix("data: ") {
                        data = serde_json::from_str(d).unwrap_or(Value::String(d.into()));
                    }
                }
                (name, data)
            })
            .collect()
    }

    fn chat(stream: bool) -> Value {
        json!({"model": "m", "stream": stream, "stream_options": {"include_usage": true},
               "messages": [{"role": "user", "content": "hello"}]})
    }

    async fn run(api: Api, request: &Value, script: &str) -> (StatusCode, String) {
        body_of(completion(api, request, &FaultStep::parse(script))).await
    }

    fn deltas(events: &[(String, Value)], pointer: &str) -> Vec<(usize, String)> {
        events
            .iter()
            .enumerate()
            .filter_map(|(i, (_, d))| Some((i, d.pointer(pointer)?.as_str()?.to_string())))
            .collect()
    }

    fn joined(found: &[(usize, String)]) -> String {
        found.iter().map(|(_, s)| s.as_str()).collect()
    }

    #[tokio::test]
    async fn chat_streams_tool_call_arguments_in_pieces() {
        let script = format!("tool=get_weather;tool_args_b64={ARGS_B64};chunks=3;usage=5/7");
        let (status, body) = run(Api::OpenAi, &chat(true), &script).await;
        assert_eq!(status, StatusCode::OK);
        let ev = events(&body);
        let choice = |i: usize| ev[i].1["choices"][0].clone();
        assert_eq!(
            choice(0)["delta"],
            json!({"role": "assistant", "content": null})
        );
        let head = &choice(1)["delta"]["tool_calls"][0];
        assert_eq!(head["index"], 0);
        assert!(head["id"].as_str().unwrap().starts_with("call_mock_"));
        assert_eq!(head["type"], "function");
        assert_eq!(
            head["function"],
            json!({"name": "get_weather", "arguments": ""})
        );
        let args = deltas(&ev[2..], "/choices/0/delta/tool_calls/0/function/arguments");
        assert_eq!(args.len(), 3);
        assert_eq!(joined(&args), ARGS);
        assert!(deltas(&ev, "/choices/0/delta/content").is_empty());
        let n = ev.len();
        assert_eq!(choice(n - 3)["delta"], json!({}));
        assert_eq!(choice(n - 3)["finish_reason"], "tool_calls");
        assert_eq!(ev[n - 2].1["usage"]["completion_tokens"], 7);
        assert_eq!(ev[n - 1].1, json!("[DONE]"));
    }

    #[tokio::test]
    async fn chat_text_comes_before_the_tool_call() {
        let script = format!("content=Let me check;tool=get_weather;tool_args_b64={ARGS_B64}");
        let (_, body) = run(Api::OpenAi, &chat(true), &script).await;
        let ev = events(&body);
        assert_eq!(
            ev[0].1["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        let text = deltas(&ev, "/choices/0/delta/content");
        let calls = deltas(&ev, "/choices/0/delta/tool_calls/0/function/arguments");
        assert_eq!(joined(&text[1..]), "Let me check");
        assert_eq!(joined(&calls), ARGS);
        assert!(text.last().unwrap().0 < calls[0].0);

        let (_, body) = run(Api::OpenAi, &chat(false), &script).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], "Let me check");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(message["tool_calls"][0]["function"]["arguments"], ARGS);
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    }

    #[tokio::test]
    async fn chat_reasoning_content_comes_first() {
        let script = "reasoning=think it through;content=four;tool=calc";
        let (_, body) = run(Api::OpenAi, &chat(true), script).await;
        let ev = events(&body);
        let reasoning = deltas(&ev, "/choices/0/delta/reasoning_content");
        let text = deltas(&ev, "/choices/0/delta/content");
        assert_eq!(joined(&reasoning), "think it through");
        assert_eq!(joined(&text), "four");
        assert!(reasoning.last().unwrap().0 < text[1].0);
        let (_, body) = run(Api::OpenAi, &chat(false), script).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body["choices"][0]["message"]["reasoning_content"],
            "think it through"
        );
        assert_eq!(body["choices"][0]["message"]["content"], "four");
    }

    #[tokio::test]
    async fn chat_future_fields() {
        let (_, body) = run(Api::OpenAi, &chat(true), "future").await;
        let ev = events(&body);
        for (_, data) in &ev[..ev.len() - 1] {
            assert_eq!(data["x_future"], json!({"n": 1}));
            assert_eq!(data["service_tier"], "default");
            assert!(data["obfuscation"].is_string());
        }
        assert_eq!(ev[0].1["choices"][0]["logprobs"], Value::Null);
        assert!(ev[0].1["choices"][0]
            .as_object()
            .unwrap()
            .contains_key("logprobs"));
        let (_, body) = run(Api::OpenAi, &chat(false), "future").await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["x_future"], json!({"n": 1}));
    }

    #[tokio::test]
    async fn chat_plain_answers_are_unchanged() {
        let (_, body) = run(Api::OpenAi, &chat(true), "chunks=2;usage=3/4").await;
        assert!(body.contains(r#""choices":[{"delta":{"content":"","role":"assistant"},"finish_reason":null,"index":0}]"#));
        assert!(body.contains(
            r#""choices":[{"delta":{"content":"mock: "},"finish_reason":null,"index":0}]"#
        ));
        assert!(body.contains(
            r#""choices":[{"delta":{"content":"hello"},"finish_reason":null,"index":0}]"#
        ));
        assert!(body.contains(r#""choices":[{"delta":{},"finish_reason":"stop","index":0}]"#));
        assert!(
            body.contains(r#""usage":{"completion_tokens":4,"prompt_tokens":3,"total_tokens":7}"#)
        );
        assert!(body.ends_with("}\n\ndata: [DONE]\n\n"));
        assert_eq!(events(&body).len(), 6);
        assert!(
            !body.contains("x_future") && !body.contains("reasoning") && !body.contains("tool")
        );
        let (_, body) = run(Api::OpenAi, &chat(false), "").await;
        assert!(body.contains(r#""choices":[{"finish_reason":"stop","index":0,"message":{"annotations":[],"content":"mock: hello","refusal":null,"role":"assistant"}}]"#));
        let (_, body) = run(Api::OpenAi, &chat(false), "tool=t").await;
        assert!(body.contains(r#""message":{"annotations":[],"content":null,"refusal":null,"role":"assistant","tool_calls":[{"function":{"arguments":"{}","name":"t"},"id":"call_mock_"#));
    }

    fn anthropic(stream: bool) -> Value {
        json!({"model": "claude", "stream": stream, "max_tokens": 10,
               "messages": [{"role": "user", "content": "hello"}]})
    }

    fn names(ev: &[(String, Value)]) -> Vec<&str> {
        ev.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[tokio::test]
    async fn anthropic_streams_text_then_tool_use() {
        let script = format!("content=Checking;tool=get_weather;tool_args_b64={ARGS_B64};chunks=2");
        let (_, body) = run(Api::Anthropic, &anthropic(true), &script).await;
        let ev = events(&body);
        assert_eq!(
            names(&ev),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(
            ev[1].1["content_block"],
            json!({"type": "text", "text": ""})
        );
        assert_eq!(ev[3].1["delta"]["type"], "text_delta");
        assert_eq!(joined(&deltas(&ev, "/delta/text")), "Checking");
        assert_eq!(ev[5].1["index"], 0);
        let tool = &ev[6].1;
        assert_eq!(tool["index"], 1);
        assert_eq!(tool["content_block"]["type"], "tool_use");
        assert_eq!(tool["content_block"]["name"], "get_weather");
        assert_eq!(tool["content_block"]["input"], json!({}));
        assert!(tool["content_block"]["id"]
            .as_str()
            .unwrap()
            .starts_with("toolu_mock_"));
        assert_eq!(ev[7].1["delta"]["type"], "input_json_delta");
        assert_eq!(ev[7].1["index"], 1);
        assert_eq!(joined(&deltas(&ev, "/delta/partial_json")), ARGS);
        assert_eq!(ev[9].1["index"], 1);
        assert_eq!(ev[10].1["delta"]["stop_reason"], "tool_use");

        let (_, body) = run(Api::Anthropic, &anthropic(false), &script).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body["content"][0],
            json!({"type": "text", "text": "Checking"})
        );
        assert_eq!(body["content"][1]["type"], "tool_use");
        assert_eq!(body["content"][1]["input"], json!({"city": "Paris"}));
        assert_eq!(body["stop_reason"], "tool_use");
    }

    #[tokio::test]
    async fn anthropic_thinking_blocks_are_signed() {
        // base64 of SHA-256("mock-signature:Let me think") = ab5078da…e6f31b.
        const SIG: &str = "q1B42pknuGVPgzyQIrDnzUfX/vigc3v0YsAuY9fm8xs=";
        assert_eq!(thinking_signature("Let me think"), SIG);
        let digest = base64::engine::general_purpose::STANDARD
            .decode(SIG)
            .unwrap();
        assert_eq!(digest.len(), 32);
        assert_eq!((digest[0], digest[1], digest[31]), (0xab, 0x50, 0x1b));
        let script =
            "thinking=Let me think;redacted_thinking=EmwKAhgB;content=four;tool=calc;chunks=3";
        let (_, body) = run(Api::Anthropic, &anthropic(true), script).await;
        let ev = events(&body);
        assert_eq!(
            ev[1].1["content_block"],
            json!({"type": "thinking", "thinking": ""})
        );
        assert_eq!(ev[2].0, "ping");
        let thinking = deltas(&ev, "/delta/thinking");
        assert_eq!(thinking.len(), 3);
        assert_eq!(joined(&thinking), "Let me think");
        let sig = deltas(&ev, "/delta/signature");
        assert_eq!(sig.len(), 1);
        assert_eq!(sig[0].1, SIG);
        assert!(sig[0].0 > thinking.last().unwrap().0);
        assert_eq!(ev[sig[0].0].1["delta"]["type"], "signature_delta");
        assert_eq!(ev[sig[0].0 + 1].0, "content_block_stop");
        assert_eq!(ev[sig[0].0 + 1].1["index"], 0);
        let redacted = &ev[sig[0].0 + 2];
        assert_eq!(redacted.1["index"], 1);
        assert_eq!(
            redacted.1["content_block"],
            json!({"type": "redacted_thinking", "data": "EmwKAhgB"})
        );
        assert_eq!(ev[sig[0].0 + 3].0, "content_block_stop");
        assert_eq!(ev[sig[0].0 + 4].1["index"], 2);
        assert_eq!(ev[sig[0].0 + 4].1["content_block"]["type"], "text");
        let starts: Vec<&Value> = ev
            .iter()
            .filter(|(n, _)| n == "content_block_start")
            .map(|(_, d)| &d["content_block"]["type"])
            .collect();
        assert_eq!(
            starts,
            ["thinking", "redacted_thinking", "text", "tool_use"]
        );

        let (_, body) = run(Api::Anthropic, &anthropic(false), script).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body["content"][0],
            json!({"type": "thinking", "thinking": "Let me think", "signature": SIG})
        );
        assert_eq!(
            body["content"][1],
            json!({"type": "redacted_thinking", "data": "EmwKAhgB"})
        );
        assert_eq!(body["content"][2]["type"], "text");
        assert_eq!(body["content"][3]["type"], "tool_use");
    }

    #[tokio::test]
    async fn anthropic_rejects_an_altered_thinking_block() {
        let (_, first) = run(Api::Anthropic, &anthropic(false), "thinking=Let me think").await;
        let first: Value = serde_json::from_str(&first).unwrap();
        let next = |content: &Value| {
            json!({"model": "claude", "max_tokens": 10, "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": content},
                {"role": "user", "content": "go on"},
            ]})
        };
        let (status, _) = run(Api::Anthropic, &next(&first["content"]), "").await;
        assert_eq!(status, StatusCode::OK);

        let mut altered = first["content"].clone();
        altered[0]["thinking"] = json!("Let me think again");
        let (status, body) = run(Api::Anthropic, &next(&altered), "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(
            body["error"]["message"],
            "messages.1.content.0: Invalid `signature` in `thinking` block"
        );

        let mut unsigned = first["content"].clone();
        unsigned[0].as_object_mut().unwrap().remove("signature");
        let (status, _) = run(Api::Anthropic, &next(&unsigned), "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        // Streaming requests are checked too.
        let mut request = next(&altered);
        request["stream"] = json!(true);
        let (status, _) = run(Api::Anthropic, &request, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
    }

    #[tokio::test]
    async fn anthropic_future_events_and_fields() {
        let (_, body) = run(Api::Anthropic, &anthropic(true), "future").await;
        let ev = events(&body);
        assert_eq!(ev[0].0, "message_start");
        assert_eq!(ev[1].0, "x_future_event");
        assert_eq!(ev[1].1, json!({"type": "x_future_event", "n": 1}));
        for (name, data) in ev.iter().filter(|(n, _)| n != "x_future_event") {
            assert_eq!(data["x_future"], json!({"n": 1}), "{name}");
        }
        let (_, body) = run(Api::Anthropic, &anthropic(false), "future").await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["x_future"], json!({"n": 1}));
    }

    #[tokio::test]
    async fn anthropic_plain_answers_are_unchanged() {
        let (_, body) = run(Api::Anthropic, &anthropic(true), "chunks=2;usage=3/4").await;
        let ev = events(&body);
        assert_eq!(
            names(&ev),
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert!(body.contains("event: content_block_start\ndata: {\"content_block\":{\"text\":\"\",\"type\":\"text\"},\"index\":0,\"type\":\"content_block_start\"}\n\nevent: ping\ndata: {\"type\":\"ping\"}\n\n"));
        assert!(body.contains("event: content_block_delta\ndata: {\"delta\":{\"text\":\"hello\",\"type\":\"text_delta\"},\"index\":0,\"type\":\"content_block_delta\"}\n\n"));
        assert!(body.ends_with("event: message_delta\ndata: {\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"type\":\"message_delta\",\"usage\":{\"output_tokens\":4}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));
        let (_, body) = run(Api::Anthropic, &anthropic(false), "usage=3/4").await;
        assert!(
            body.contains(r#""content":[{"text":"mock: hello","type":"text"}],"id":"msg_mock_"#)
        );
        assert!(body.ends_with(r#""role":"assistant","stop_reason":"end_turn","stop_sequence":null,"type":"message","usage":{"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"input_tokens":3,"output_tokens":4}}"#));
    }

    #[tokio::test]
    async fn new_events_are_cut_and_paced_like_the_rest() {
        let script = "thinking=abcd;tool=t;cut=3";
        let response = completion(Api::Anthropic, &anthropic(true), &FaultStep::parse(script));
        let result = response.into_body().collect().await;
        assert!(result.is_err(), "the stream breaks after 3 events");
        tokio::time::pause();
        let script = "reasoning=abcd;chunk_delay=1s";
        let started = tokio::time::Instant::now();
        let (_, body) = run(Api::OpenAi, &chat(true), script).await;
        let n = events(&body).len() as u64;
        assert!(started.elapsed() >= std::time::Duration::from_secs(n - 2));
    }
}
