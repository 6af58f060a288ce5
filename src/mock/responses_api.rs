//! The OpenAI Responses API (`/v1/responses`): a `response` object, its SSE event
//! sequence, function calls, and canned answers for the stored-response routes.

use axum::body::Body;
use bytes::Bytes;
use http::{Method, Response, StatusCode};
use serde_json::{json, Value};

use super::{
    responses::{content_text, json_ok, next_id, now_secs, pieces, sse},
    FaultStep,
};

/// The texts of the request's `input`: a string, or its items' text (messages' content,
/// `function_call_output` items' output), in order, with each one's role.
fn input_texts(request: &Value) -> Vec<(String, String)> {
    match request.get("input") {
        Some(Value::String(s)) => vec![("user".into(), s.clone())],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let role = item
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or(item.get("type").and_then(Value::as_str).unwrap_or(""))
                    .to_string();
                let text = match item.get("output") {
                    Some(Value::String(out)) => out.clone(),
                    _ => content_text(item.get("content").unwrap_or(&Value::Null)),
                };
                (role, text)
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn reply_text(request: &Value, step: &FaultStep) -> String {
    let mut text = match &step.content {
        Some(content) => content.clone(),
        None => {
            let texts = input_texts(request);
            let last_user = texts
                .iter()
                .rev()
                .find(|(role, _)| role == "user")
                .map(|(_, t)| t.as_str())
                .unwrap_or_default();
            format!("mock: {}", last_user.chars().take(1000).collect::<String>())
        }
    };
    if let Some(pad) = step.pad {
        text.push_str(&"x".repeat(pad));
    }
    text
}

fn usage(request: &Value, text: &str, step: &FaultStep) -> Value {
    let (input, output) = step.usage.unwrap_or_else(|| {
        let chars: usize = input_texts(request).iter().map(|(_, t)| t.len()).sum();
        let prompt = (chars as u64).div_ceil(4).max(1);
        (prompt, text.split_whitespace().count().max(1) as u64)
    });
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input.saturating_add(output),
    })
}

/// A `response` object around `output`.
fn response(id: &str, request: &Value, status: &str, output: Value, usage: Value) -> Value {
    let field = |name: &str| request.get(name).cloned().unwrap_or(Value::Null);
    json!({
        "id": id,
        "object": "response",
        "created_at": now_secs(),
        "status": status,
        "model": request.get("model").and_then(Value::as_str).unwrap_or("mock-model"),
        "output": output,
        "usage": usage,
        "error": null,
        "incomplete_details": null,
        "instructions": field("instructions"),
        "metadata": request.get("metadata").cloned().unwrap_or_else(|| json!({})),
        "parallel_tool_calls": true,
        "previous_response_id": field("previous_response_id"),
        "store": request.get("store").cloned().unwrap_or(Value::Bool(true)),
        "temperature": 1.0,
        "text": request.get("text").cloned().unwrap_or_else(|| json!({"format": {"type": "text"}})),
        "tool_choice": "auto",
        "tools": request.get("tools").cloned().unwrap_or_else(|| json!([])),
        "top_p": 1.0,
    })
}

fn message_item(id: u64, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    } else {
        json!([])
    };
    json!({"type": "message", "id": format!("msg_mock_{id}"), "status": status, "role": "assistant", "content": content})
}

fn function_call_item(id: u64, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_mock_{id}"), "call_id": format!("call_mock_{id}"),
           "name": name, "arguments": arguments, "status": status})
}

/// `POST /v1/responses`.
pub fn create(request: &Value, step: &FaultStep) -> Response<Body> {
    let id = next_id();
    let response_id = format!("resp_mock_{id}");
    let text = reply_text(request, step);
    let usage = usage(request, &text, step);
    let streaming = !step.plain && request.get("stream").and_then(Value::as_bool) == Some(true);
    let args = step.tool_args.clone().unwrap_or_else(|| "{}".into());
    let item = match &step.tool {
        Some(tool) => function_call_item(id, tool, &args, "completed"),
        None => message_item(id, &text, "completed"),
    };
    let done = response(&response_id, request, "completed", json!([item]), usage);
    if !streaming {
        return json_ok(done);
    }
    let mut seq = 0u64;
    let mut event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(seq);
        seq += 1;
        Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
    };
    let mut started = done.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    let mut events = vec![
        event("response.created", json!({"response": started})),
        event("response.in_progress", json!({"response": started})),
    ];
    let parts = pieces(
        if step.tool.is_some() { &args } else { &text },
        step.chunks.unwrap_or(4),
    );
    match &step.tool {
        Some(tool) => {
            let item_id = format!("fc_mock_{id}");
            events.push(event(
                "response.output_item.added",
                json!({"output_index": 0, "item": function_call_item(id, tool, "", "in_progress")}),
            ));
            for p in &parts {
                events.push(event(
                    "response.function_call_arguments.delta",
                    json!({"item_id": item_id, "output_index": 0, "delta": p}),
                ));
            }
            events.push(event(
                "response.function_call_arguments.done",
                json!({"item_id": item_id, "output_index": 0, "arguments": args}),
            ));
        }
        None => {
            let item_id = format!("msg_mock_{id}");
            let at = |extra: Value| {
                let mut v = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
                if let (Value::Object(v), Value::Object(extra)) = (&mut v, extra) {
                    v.extend(extra);
                }
                v
            };
            events.push(event(
                "response.output_item.added",
                json!({"output_index": 0, "item": message_item(id, "", "in_progress")}),
            ));
            events.push(event(
                "response.content_part.added",
                at(json!({"part": {"type": "output_text", "text": "", "annotations": []}})),
            ));
            for p in &parts {
                events.push(event(
                    "response.output_text.delta",
                    at(json!({"delta": p, "logprobs": []})),
                ));
            }
            events.push(event(
                "response.output_text.done",
                at(json!({"text": text, "logprobs": []})),
            ));
            events.push(event(
                "response.content_part.done",
                at(json!({"part": {"type": "output_text", "text": text, "annotations": []}})),
            ));
        }
    }
    events.push(event(
        "response.output_item.done",
        json!({"output_index": 0, "item": done["output"][0]}),
    ));
    events.push(event("response.completed", json!({"response": done})));
    sse(events, step)
}

/// The stored-response routes (`/v1/responses/{id}...`): canned answers.
pub fn stored(method: &Method, path: &str) -> Response<Body> {
    let rest = path.trim_start_matches("/v1/responses/");
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let stored = |status: &str| {
        let request = json!({"model": "mock-model"});
        let output = json!([message_item(0, "mock: stored response", "completed")]);
        let usage = json!({"input_tokens": 1, "output_tokens": 3, "total_tokens": 4});
        response(id, &request, status, output, usage)
    };
    match (method, tail) {
        (&Method::GET, "") => json_ok(stored("completed")),
        (&Method::DELETE, "") => {
            json_ok(json!({"id": id, "object": "response.deleted", "deleted": true}))
        }
        (&Method::POST, "cancel") => json_ok(stored("cancelled")),
        (&Method::GET, "input_items") => json_ok(json!({
            "object": "list",
            "data": [{"type": "message", "id": "msg_in_mock", "role": "user", "status": "completed",
                      "content": [{"type": "input_text", "text": "stored input"}]}],
            "first_id": "msg_in_mock",
            "last_id": "msg_in_mock",
            "has_more": false,
        })),
        _ => Response::builder()
            .status(StatusCode::NOT_FOUND)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Body::from(
                json!({"error": {"message": "no such stored-response route", "type": "invalid_request_error", "code": null, "param": null}}).to_string(),
            ))
            .expect("valid response parts"),
    }
}
