//! The OpenAI Responses API (`/v1/responses`): a `response` object, its SSE event
//! sequence, function calls, and canned answers for the stored-response routes.

use axum::body::Body;
use bytes::Bytes;
use http::{Method, Response, StatusCode};
use serde_json::{json, Value};

use super::{
    responses::{content_text, future_field, json_ok, next_id, now_secs, pieces, sse},
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

fn reasoning_item(id: u64, text: &str, done: bool) -> Value {
    use base64::Engine;
    let summary = if done {
        json!([{"type": "summary_text", "text": text}])
    } else {
        json!([])
    };
    let encrypted = base64::engine::general_purpose::STANDARD.encode(text);
    json!({"type": "reasoning", "id": format!("rs_mock_{id}"), "summary": summary,
           "encrypted_content": format!("enc_mock_{encrypted}")})
}

/// One output item of an answer, in the order they come: reasoning, message, call.
enum Item<'a> {
    Reasoning(&'a str),
    Message(&'a str),
    Call(&'a str, &'a str),
}

impl Item<'_> {
    fn done(&self, id: u64) -> Value {
        match self {
            Item::Reasoning(text) => reasoning_item(id, text, true),
            Item::Message(text) => message_item(id, text, "completed"),
            Item::Call(name, args) => function_call_item(id, name, args, "completed"),
        }
    }

    /// The streamed events of the item at `index`, `response.output_item.done` last.
    fn events(&self, id: u64, index: usize, chunks: usize) -> Vec<(&'static str, Value)> {
        let mut events = Vec::new();
        match self {
            Item::Reasoning(text) => {
                let item_id = format!("rs_mock_{id}");
                let at = |extra: Value| {
                    with_fields(
                        json!({"item_id": item_id, "output_index": index, "summary_index": 0}),
                        extra,
                    )
                };
                events.push((
                    "response.output_item.added",
                    json!({"output_index": index, "item": reasoning_item(id, text, false)}),
                ));
                events.push((
                    "response.reasoning_summary_part.added",
                    at(json!({"part": {"type": "summary_text", "text": ""}})),
                ));
                for p in pieces(text, chunks) {
                    events.push((
                        "response.reasoning_summary_text.delta",
                        at(json!({"delta": p})),
                    ));
                }
                events.push((
                    "response.reasoning_summary_text.done",
                    at(json!({"text": text})),
                ));
                events.push((
                    "response.reasoning_summary_part.done",
                    at(json!({"part": {"type": "summary_text", "text": text}})),
                ));
            }
            Item::Message(text) => {
                let item_id = format!("msg_mock_{id}");
                let at = |extra: Value| {
                    with_fields(
                        json!({"item_id": item_id, "output_index": index, "content_index": 0}),
                        extra,
                    )
                };
                events.push((
                    "response.output_item.added",
                    json!({"output_index": index, "item": message_item(id, "", "in_progress")}),
                ));
                events.push((
                    "response.content_part.added",
                    at(json!({"part": {"type": "output_text", "text": "", "annotations": []}})),
                ));
                for p in pieces(text, chunks) {
                    events.push((
                        "response.output_text.delta",
                        at(json!({"delta": p, "logprobs": []})),
                    ));
                }
                events.push((
                    "response.output_text.done",
                    at(json!({"text": text, "logprobs": []})),
                ));
                events.push((
                    "response.content_part.done",
                    at(json!({"part": {"type": "output_text", "text": text, "annotations": []}})),
                ));
            }
            Item::Call(name, args) => {
                let item_id = format!("fc_mock_{id}");
                events.push((
                    "response.output_item.added",
                    json!({"output_index": index, "item": function_call_item(id, name, "", "in_progress")}),
                ));
                for p in pieces(args, chunks) {
                    events.push((
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": p}),
                    ));
                }
                events.push((
                    "response.function_call_arguments.done",
                    json!({"item_id": item_id, "output_index": index, "arguments": args}),
                ));
            }
        }
        events.push((
            "response.output_item.done",
            json!({"output_index": index, "item": self.done(id)}),
        ));
        events
    }
}

/// `POST /v1/responses`.
pub fn create(request: &Value, step: &FaultStep) -> Response<Body> {
    let id = next_id();
    answer(&format!("resp_mock_{id}"), id, request, step)
}

/// A response `response_id` to `request`, whole or streamed as the request asks.
fn answer(response_id: &str, id: u64, request: &Value, step: &FaultStep) -> Response<Body> {
    let text = reply_text(request, step);
    // `usage_b64`: exactly this usage, whole or streamed (in `response.completed`).
    let usage = step
        .usage_json
        .clone()
        .unwrap_or_else(|| usage(request, &text, step));
    let streaming = !step.plain && request.get("stream").and_then(Value::as_bool) == Some(true);
    let args = step.tool_args.clone().unwrap_or_else(|| "{}".into());
    let mut items = Vec::new();
    if let Some(reasoning) = &step.reasoning {
        items.push(Item::Reasoning(reasoning));
    }
    if step.tool.is_none() || step.content.is_some() {
        items.push(Item::Message(&text));
    }
    if let Some(tool) = &step.tool {
        items.push(Item::Call(tool, &args));
    }
    let output: Vec<Value> = items.iter().map(|item| item.done(id)).collect();
    // `background: true` answers at once, queued, with no output or usage yet: they
    // come with a later `GET /v1/responses/{id}`.
    if !streaming && request.get("background") == Some(&Value::Bool(true)) {
        return json_ok(response(
            response_id,
            request,
            "queued",
            json!([]),
            Value::Null,
        ));
    }
    let done = response(response_id, request, "completed", json!(output), usage);
    if !streaming {
        let mut done = done;
        if step.future {
            done["x_future"] = future_field();
        }
        return json_ok(done);
    }
    let mut started = done.clone();
    started["status"] = json!("in_progress");
    started["output"] = json!([]);
    started["usage"] = Value::Null;
    let mut events: Vec<(&str, Value)> = vec![
        ("response.created", json!({"response": started})),
        ("response.in_progress", json!({"response": started})),
    ];
    let chunks = step.chunks.unwrap_or(4);
    for (index, item) in items.iter().enumerate() {
        events.extend(item.events(id, index, chunks));
    }
    events.push(("response.completed", json!({"response": done})));
    if step.future {
        events.insert(1, ("response.x_future_event", json!({"n": 1})));
    }
    let events = events
        .into_iter()
        .enumerate()
        .map(|(seq, (name, mut data))| {
            data["type"] = json!(name);
            data["sequence_number"] = json!(seq);
            if step.future {
                data["x_future"] = future_field();
            }
            Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
        })
        .collect();
    sse(events, step)
}

/// `base` with the fields of `extra` added.
fn with_fields(mut base: Value, extra: Value) -> Value {
    if let (Value::Object(base), Value::Object(extra)) = (&mut base, extra) {
        base.extend(extra);
    }
    base
}

/// The stored-response routes (`/v1/responses/{id}...`): canned answers. `GET` with
/// `?stream=true` replays the stored response as its event stream (paced by the step).
pub fn stored(
    method: &Method,
    path: &str,
    query: Option<&str>,
    step: &FaultStep,
) -> Response<Body> {
    let rest = path.trim_start_matches("/v1/responses/");
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let streamed = query.is_some_and(|q| q.split('&').any(|kv| kv == "stream=true"));
    if method == Method::GET && tail.is_empty() && streamed {
        let request = json!({"model": "mock-model", "stream": true, "input": "stored response"});
        return answer(id, next_id(), &request, step);
    }
    let stored = |status: &str| {
        let request = json!({"model": "mock-model"});
        let output = json!([message_item(0, "mock: stored response", "completed")]);
        // The step's usage where it names one (`usage=IN/OUT`, `usage_b64`).
        let usage = step.usage_json.clone().unwrap_or_else(|| {
            let (input, output) = step.usage.unwrap_or((1, 3));
            json!({"input_tokens": input, "output_tokens": output, "total_tokens": input + output})
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::responses::tests::{body_of, events, ARGS, ARGS_B64};

    fn request(stream: bool) -> Value {
        json!({"model": "gpt", "stream": stream, "input": "hello"})
    }

    async fn run(request: &Value, script: &str) -> Vec<(String, Value)> {
        let (status, body) = body_of(create(request, &FaultStep::parse(script))).await;
        assert_eq!(status, StatusCode::OK);
        events(&body)
    }

    fn names(ev: &[(String, Value)]) -> Vec<&str> {
        ev.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn sequence_is_increasing(ev: &[(String, Value)]) {
        for (i, (name, data)) in ev.iter().enumerate() {
            assert_eq!(data["sequence_number"], i, "{name}");
            assert_eq!(data["type"], name.as_str());
        }
    }

    fn joined(ev: &[(String, Value)], name: &str) -> String {
        ev.iter()
            .filter(|(n, _)| n == name)
            .map(|(_, d)| d["delta"].as_str().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn reasoning_then_text_then_call() {
        let script = format!(
            "reasoning=think;content=Checking;tool=get_weather;tool_args_b64={ARGS_B64};chunks=2"
        );
        let ev = run(&request(true), &script).await;
        sequence_is_increasing(&ev);
        assert_eq!(
            names(&ev),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(ev[2].1["item"]["type"], "reasoning");
        assert_eq!(ev[2].1["item"]["summary"], json!([]));
        assert_eq!(
            joined(&ev, "response.reasoning_summary_text.delta"),
            "think"
        );
        assert_eq!(joined(&ev, "response.output_text.delta"), "Checking");
        assert_eq!(joined(&ev, "response.function_call_arguments.delta"), ARGS);
        let done: Vec<&Value> = ev
            .iter()
            .filter(|(n, _)| n == "response.output_item.done")
            .map(|(_, d)| d)
            .collect();
        for (index, kind) in ["reasoning", "message", "function_call"].iter().enumerate() {
            assert_eq!(done[index]["output_index"], index);
            assert_eq!(done[index]["item"]["type"], *kind);
        }
        assert_eq!(
            done[0]["item"]["summary"],
            json!([{"type": "summary_text", "text": "think"}])
        );
        assert!(done[0]["item"]["encrypted_content"]
            .as_str()
            .unwrap()
            .starts_with("enc_mock_"));
        assert_eq!(done[1]["item"]["content"][0]["text"], "Checking");
        assert_eq!(done[2]["item"]["arguments"], ARGS);
        for (name, data) in &ev[3..8] {
            assert_eq!(data["output_index"], 0, "{name}");
        }
        for (name, data) in &ev[10..15] {
            assert_eq!(data["output_index"], 1, "{name}");
        }
        for (name, data) in &ev[17..20] {
            assert_eq!(data["output_index"], 2, "{name}");
        }
        let completed = &ev.last().unwrap().1["response"]["output"];
        let items: Vec<&Value> = done.iter().map(|d| &d["item"]).collect();
        assert_eq!(completed, &json!(items));
    }

    #[tokio::test]
    async fn text_then_call_take_output_index_0_and_1() {
        let script = format!("content=Checking;tool=get_weather;tool_args_b64={ARGS_B64}");
        let ev = run(&request(true), &script).await;
        sequence_is_increasing(&ev);
        let added: Vec<(&Value, &Value)> = ev
            .iter()
            .filter(|(n, _)| n == "response.output_item.added")
            .map(|(_, d)| (&d["output_index"], &d["item"]["type"]))
            .collect();
        assert_eq!(
            added,
            [
                (&json!(0), &json!("message")),
                (&json!(1), &json!("function_call"))
            ]
        );
        let (_, body) = body_of(create(&request(false), &FaultStep::parse(&script))).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["output"][0]["type"], "message");
        assert_eq!(body["output"][0]["content"][0]["text"], "Checking");
        assert_eq!(body["output"][1]["type"], "function_call");
        assert_eq!(body["output"][1]["arguments"], ARGS);
    }

    #[tokio::test]
    async fn a_reasoning_item_comes_first() {
        let (_, body) = body_of(create(&request(false), &FaultStep::parse("reasoning=why"))).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        let item = &body["output"][0];
        assert_eq!(item["type"], "reasoning");
        assert!(item["id"].as_str().unwrap().starts_with("rs_mock_"));
        assert_eq!(
            item["summary"],
            json!([{"type": "summary_text", "text": "why"}])
        );
        assert_eq!(item["encrypted_content"], "enc_mock_d2h5");
        assert_eq!(body["output"][1]["type"], "message");
        assert_eq!(body["output"].as_array().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn future_events_and_fields() {
        let ev = run(&request(true), "future").await;
        sequence_is_increasing(&ev);
        assert_eq!(ev[1].0, "response.x_future_event");
        assert_eq!(ev[1].1["sequence_number"], 1);
        for (name, data) in &ev {
            assert_eq!(data["x_future"], json!({"n": 1}), "{name}");
        }
        let (_, body) = body_of(create(&request(false), &FaultStep::parse("future"))).await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["x_future"], json!({"n": 1}));
    }

    #[tokio::test]
    async fn plain_answers_are_unchanged() {
        let (_, body) = body_of(create(&request(true), &FaultStep::parse("chunks=2"))).await;
        assert!(body.contains("event: response.output_text.delta\ndata: {\"content_index\":0,\"delta\":\"mock: \",\"item_id\":\"msg_mock_"));
        assert!(body.contains("\",\"logprobs\":[],\"output_index\":0,\"sequence_number\":5,\"type\":\"response.output_text.delta\"}\n\n"));
        let ev = events(&body);
        sequence_is_increasing(&ev);
        assert_eq!(ev.len(), 10);
        assert!(!body.contains("x_future") && !body.contains("reasoning\""));
        let ev = run(
            &request(true),
            &format!("tool=f;tool_args_b64={ARGS_B64};chunks=2"),
        )
        .await;
        assert_eq!(
            names(&ev),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
    }
}
