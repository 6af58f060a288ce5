//! Validated streams are lossless: for random, well-formed event sequences in each API's
//! own framing (text, thinking, reasoning, tool calls with valid arguments, events and
//! fields Backstop does not know), what the client receives through the validating gate
//! (requests with `tools`) is what the upstream sent, event for event and byte for byte,
//! minus only the documented change: the chat usage-only chunk when the client did not
//! ask for `stream_options.include_usage`. The mock plays each sequence verbatim
//! (`events_b64`).

use std::sync::OnceLock;

use crate::common::*;
use base64::Engine;
use proptest::prelude::*;
use serde_json::{json, Value};

/// One runtime and one gateway for every case: the proptest bodies block on it.
fn harness() -> &'static (tokio::runtime::Runtime, Gateway) {
    static HARNESS: OnceLock<(tokio::runtime::Runtime, Gateway)> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let gw = rt.block_on(start());
        (rt, gw)
    })
}

fn weather_schema() -> Value {
    json!({"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": false})
}

/// One upstream event, as the mock writes it.
#[derive(Debug, Clone)]
enum Ev {
    /// `event: NAME` then `data: JSON`.
    Named(String, Value),
    /// `data: JSON` alone (chat).
    Data(Value),
    /// Already framed: `data: [DONE]`, a comment, an event whose data is not JSON.
    Raw(String),
}

impl Ev {
    fn frame(&self) -> String {
        match self {
            Ev::Named(name, data) => format!("event: {name}\ndata: {data}\n\n"),
            Ev::Data(data) => format!("data: {data}\n\n"),
            Ev::Raw(text) => text.clone(),
        }
    }
}

/// An SSE event as the client reads it: its name, its data (parsed when JSON) and its
/// comment lines.
type Seen = (Option<String>, Option<Value>, Vec<String>);

fn parse(body: &str) -> Vec<Seen> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = None;
            let mut data: Vec<&str> = Vec::new();
            let mut comments = Vec::new();
            for line in e.lines() {
                if let Some(c) = line.strip_prefix(':') {
                    comments.push(c.to_string());
                } else if let Some(n) = line.strip_prefix("event:") {
                    name = Some(n.trim_start().to_string());
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push(d.strip_prefix(' ').unwrap_or(d));
                }
            }
            let data = (!data.is_empty()).then(|| {
                let joined = data.join("\n");
                serde_json::from_str(&joined).unwrap_or(Value::String(joined))
            });
            (name, data, comments)
        })
        .collect()
}

/// `s` cut at the (char-aligned) positions `cuts` pick: at least one piece.
fn split(s: &str, cuts: &[usize]) -> Vec<String> {
    let bounds: Vec<usize> = s.char_indices().map(|(i, _)| i).chain([s.len()]).collect();
    let mut at: Vec<usize> = cuts.iter().map(|c| bounds[c % bounds.len()]).collect();
    at.extend([0, s.len()]);
    at.sort_unstable();
    at.dedup();
    let pieces: Vec<String> = at.windows(2).map(|w| s[w[0]..w[1]].to_string()).collect();
    if pieces.is_empty() {
        vec![String::new()]
    } else {
        pieces
    }
}

/// Valid arguments for `get_weather`, whatever the city (quotes, backslashes and
/// non-ASCII included: the pieces split escapes and characters' neighbours).
fn args(city: &str) -> String {
    json!({"city": city}).to_string()
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 .,!?é中\"\\\\\n]{0,10}"
}

fn cuts() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(any::<usize>(), 0..4)
}

/// Events of a kind Backstop does not know, between known ones. `None`: nothing.
fn noise(kind: u8, api: &str) -> Option<Ev> {
    match (kind % 8, api) {
        (0, "messages") => Some(Ev::Named("ping".into(), json!({"type": "ping"}))),
        (0 | 1, "chat") => Some(Ev::Data(
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
            "created": 1, "model": "gpt-4o", "x_future": {"n": 1}, "choices": [{"index": 0, "delta": {}, "finish_reason": null}]}),
        )),
        (1, "messages") => Some(Ev::Named(
            "x_future".into(),
            json!({"type": "x_future", "n": 1}),
        )),
        (1, _) => Some(Ev::Named(
            "response.x_future".into(),
            json!({"type": "response.x_future", "n": 1}),
        )),
        (2, "chat") => Some(Ev::Raw(": keep-alive\n\n".into())),
        (2, _) => Some(Ev::Raw("event: x_note\ndata: plain words\n\n".into())),
        _ => None,
    }
}

/// `events` with noise slipped between them (never before the first or after the last).
fn with_noise(events: Vec<Ev>, noise_kinds: &[u8], api: &str) -> Vec<Ev> {
    let last = events.len().saturating_sub(1);
    let mut out = Vec::new();
    for (i, ev) in events.into_iter().enumerate() {
        out.push(ev);
        if i < last {
            if let Some(n) = noise_kinds.get(i).and_then(|k| noise(*k, api)) {
                out.push(n);
            }
        }
    }
    out
}

// ---- chat completions ----------------------------------------------------------------

#[derive(Debug, Clone)]
enum ChatPart {
    Text(String),
    Reasoning(String),
}

#[derive(Debug, Clone)]
struct ChatCase {
    parts: Vec<ChatPart>,
    /// (city, cuts of its arguments)
    calls: Vec<(String, Vec<usize>)>,
    /// Unknown fields per chunk, a bit each.
    decor: Vec<u8>,
    noise: Vec<u8>,
    /// `stream_options.include_usage` as the client sent it (`None`: no `stream_options`).
    include_usage: Option<bool>,
}

fn chat_case() -> impl Strategy<Value = ChatCase> {
    let part = prop_oneof![
        text().prop_map(ChatPart::Text),
        text().prop_map(ChatPart::Reasoning)
    ];
    (
        prop::collection::vec(part, 0..5),
        prop::collection::vec((text(), cuts()), 0..3),
        prop::collection::vec(any::<u8>(), 40),
        prop::collection::vec(any::<u8>(), 40),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(parts, calls, decor, noise, include_usage)| ChatCase {
            parts,
            calls,
            decor,
            noise,
            include_usage,
        })
}

fn decorate(chunk: &mut Value, bits: u8) {
    if bits & 1 != 0 {
        chunk["x_future"] = json!({"n": 1});
    }
    if bits & 2 != 0 {
        chunk["service_tier"] = json!("default");
    }
    if bits & 4 != 0 {
        chunk["system_fingerprint"] = json!("fp_mock");
    }
    if bits & 8 != 0 {
        chunk["obfuscation"] = json!("Zx9q");
    }
    if let Some(choice) = chunk.pointer_mut("/choices/0") {
        if bits & 16 != 0 {
            choice["logprobs"] = json!({"content": [], "refusal": null});
        }
        if bits & 32 != 0 {
            choice["delta"]["x_future"] = json!({"n": 2});
        }
    }
    if bits & 64 != 0 {
        // Usage on a chunk with choices (some providers): not the usage-only chunk.
        chunk["usage"] = json!({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6});
    }
}

/// The chat chunks, the usage-only chunk's position among them, and `[DONE]`.
fn chat_events(case: &ChatCase) -> (Vec<Ev>, usize) {
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let mut chunks = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for part in &case.parts {
        chunks.push(match part {
            ChatPart::Text(t) => chunk(json!({"content": t}), Value::Null),
            ChatPart::Reasoning(t) => chunk(json!({"reasoning_content": t}), Value::Null),
        });
    }
    for (i, (city, cuts)) in case.calls.iter().enumerate() {
        chunks.push(chunk(
            json!({"tool_calls": [{"index": i, "id": format!("call_{i}"), "type": "function",
                   "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ));
        for piece in split(&args(city), cuts) {
            chunks.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                Value::Null,
            ));
        }
    }
    let finish = if case.calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    };
    chunks.push(chunk(json!({}), json!(finish)));
    for (c, bits) in chunks.iter_mut().zip(&case.decor) {
        decorate(c, *bits);
    }
    let mut events = with_noise(
        chunks.into_iter().map(Ev::Data).collect(),
        &case.noise,
        "chat",
    );
    let usage_at = events.len();
    events.push(Ev::Data(json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
        "model": "gpt-4o", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})));
    events.push(Ev::Raw("data: [DONE]\n\n".into()));
    (events, usage_at)
}

// ---- Anthropic messages --------------------------------------------------------------

#[derive(Debug, Clone)]
enum Block {
    Thinking(Vec<String>, String),
    Redacted(String),
    Text(Vec<String>),
    Tool(String, Vec<usize>),
}

#[derive(Debug, Clone)]
struct MessagesCase {
    blocks: Vec<Block>,
    noise: Vec<u8>,
}

fn messages_case() -> impl Strategy<Value = MessagesCase> {
    let thinking = prop::option::of(
        (prop::collection::vec(text(), 1..4), "[A-Za-z0-9+/]{8,20}")
            .prop_map(|(p, s)| Block::Thinking(p, s)),
    );
    let redacted = prop::option::of("[A-Za-z0-9+/=]{4,20}".prop_map(Block::Redacted));
    let body = prop_oneof![
        prop::collection::vec(text(), 1..4).prop_map(Block::Text),
        (text(), cuts()).prop_map(|(c, k)| Block::Tool(c, k)),
    ];
    (
        thinking,
        redacted,
        prop::collection::vec(body, 0..4),
        prop::collection::vec(any::<u8>(), 60),
    )
        .prop_map(|(thinking, redacted, body, noise)| MessagesCase {
            blocks: thinking.into_iter().chain(redacted).chain(body).collect(),
            noise,
        })
}

fn messages_events(case: &MessagesCase) -> Vec<Ev> {
    let ev = |v: Value| Ev::Named(v["type"].as_str().unwrap().to_string(), v);
    let mut events = vec![ev(json!({"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-mock-1", "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 5, "output_tokens": 1}}}))];
    let delta = |index: usize, d: Value| {
        ev(json!({"type": "content_block_delta", "index": index, "delta": d}))
    };
    for (index, block) in case.blocks.iter().enumerate() {
        let start = |b: Value| {
            ev(json!({"type": "content_block_start", "index": index, "content_block": b}))
        };
        match block {
            Block::Thinking(pieces, signature) => {
                events.push(start(
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                ));
                for p in pieces {
                    events.push(delta(
                        index,
                        json!({"type": "thinking_delta", "thinking": p}),
                    ));
                }
                events.push(delta(
                    index,
                    json!({"type": "signature_delta", "signature": signature}),
                ));
            }
            Block::Redacted(data) => {
                events.push(start(json!({"type": "redacted_thinking", "data": data})));
            }
            Block::Text(pieces) => {
                events.push(start(json!({"type": "text", "text": ""})));
                for p in pieces {
                    events.push(delta(index, json!({"type": "text_delta", "text": p})));
                }
            }
            Block::Tool(city, cuts) => {
                events.push(start(
                    json!({"type": "tool_use", "id": format!("toolu_{index}"),
                                          "name": "get_weather", "input": {}}),
                ));
                let mut pieces = split(&args(city), cuts);
                if cuts.len() % 2 == 1 {
                    // Claude often opens with an empty piece.
                    pieces.insert(0, String::new());
                }
                for p in pieces {
                    events.push(delta(
                        index,
                        json!({"type": "input_json_delta", "partial_json": p}),
                    ));
                }
            }
        }
        events.push(ev(json!({"type": "content_block_stop", "index": index})));
    }
    let tools = case.blocks.iter().any(|b| matches!(b, Block::Tool(..)));
    let stop = if tools { "tool_use" } else { "end_turn" };
    events.push(ev(json!({"type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 7}})));
    events.push(ev(json!({"type": "message_stop"})));
    with_noise(events, &case.noise, "messages")
}

// ---- Responses -----------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Item {
    Reasoning(Vec<String>),
    Message(Vec<String>),
    Call(String, Vec<usize>),
}

#[derive(Debug, Clone)]
struct ResponsesCase {
    items: Vec<Item>,
    in_progress: bool,
    noise: Vec<u8>,
}

fn responses_case() -> impl Strategy<Value = ResponsesCase> {
    let item = prop_oneof![
        prop::collection::vec(text(), 1..4).prop_map(Item::Reasoning),
        prop::collection::vec(text(), 1..4).prop_map(Item::Message),
        (text(), cuts()).prop_map(|(c, k)| Item::Call(c, k)),
    ];
    (
        prop::collection::vec(item, 0..4),
        any::<bool>(),
        prop::collection::vec(any::<u8>(), 60),
    )
        .prop_map(|(items, in_progress, noise)| ResponsesCase {
            items,
            in_progress,
            noise,
        })
}

fn responses_events(case: &ResponsesCase) -> Vec<Ev> {
    let response = |status: &str, output: Value, usage: Value| {
        json!({"id": "resp_1", "object": "response", "created_at": 1, "status": status,
               "model": "gpt-4o", "output": output, "usage": usage})
    };
    let mut events = vec![json!({"type": "response.created",
        "response": response("in_progress", json!([]), Value::Null)})];
    if case.in_progress {
        events.push(json!({"type": "response.in_progress",
            "response": response("in_progress", json!([]), Value::Null)}));
    }
    let mut output = Vec::new();
    for (k, item) in case.items.iter().enumerate() {
        match item {
            Item::Reasoning(pieces) => {
                let id = format!("rs_{k}");
                let text: String = pieces.concat();
                let part = |t: &str| json!({"type": "summary_text", "text": t});
                events.push(
                    json!({"type": "response.output_item.added", "output_index": k,
                    "item": {"id": id, "type": "reasoning", "summary": []}}),
                );
                events.push(
                    json!({"type": "response.reasoning_summary_part.added", "item_id": id,
                    "output_index": k, "summary_index": 0, "part": part("")}),
                );
                for p in pieces {
                    events.push(
                        json!({"type": "response.reasoning_summary_text.delta", "item_id": id,
                        "output_index": k, "summary_index": 0, "delta": p}),
                    );
                }
                events.push(
                    json!({"type": "response.reasoning_summary_text.done", "item_id": id,
                    "output_index": k, "summary_index": 0, "text": text}),
                );
                events.push(
                    json!({"type": "response.reasoning_summary_part.done", "item_id": id,
                    "output_index": k, "summary_index": 0, "part": part(&text)}),
                );
                let done = json!({"id": id, "type": "reasoning", "summary": [part(&text)],
                    "encrypted_content": "gAAAA-mock"});
                events.push(
                    json!({"type": "response.output_item.done", "output_index": k, "item": done}),
                );
                output.push(done);
            }
            Item::Message(pieces) => {
                let id = format!("msg_{k}");
                let text: String = pieces.concat();
                let part = |t: &str| json!({"type": "output_text", "text": t, "annotations": []});
                events.push(json!({"type": "response.output_item.added", "output_index": k,
                    "item": {"id": id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}}));
                events.push(json!({"type": "response.content_part.added", "item_id": id,
                    "output_index": k, "content_index": 0, "part": part("")}));
                for p in pieces {
                    events.push(json!({"type": "response.output_text.delta", "item_id": id,
                        "output_index": k, "content_index": 0, "delta": p}));
                }
                events.push(json!({"type": "response.output_text.done", "item_id": id,
                    "output_index": k, "content_index": 0, "text": text}));
                events.push(json!({"type": "response.content_part.done", "item_id": id,
                    "output_index": k, "content_index": 0, "part": part(&text)}));
                let done = json!({"id": id, "type": "message", "status": "completed",
                    "role": "assistant", "content": [part(&text)]});
                events.push(
                    json!({"type": "response.output_item.done", "output_index": k, "item": done}),
                );
                output.push(done);
            }
            Item::Call(city, cuts) => {
                let id = format!("fc_{k}");
                let arguments = args(city);
                let item = |status: &str, arguments: &str| {
                    json!({"id": id, "type": "function_call",
                    "status": status, "call_id": format!("call_{k}"), "name": "get_weather", "arguments": arguments})
                };
                events.push(
                    json!({"type": "response.output_item.added", "output_index": k,
                    "item": item("in_progress", "")}),
                );
                for p in split(&arguments, cuts) {
                    events.push(json!({"type": "response.function_call_arguments.delta",
                        "item_id": id, "output_index": k, "delta": p}));
                }
                events.push(json!({"type": "response.function_call_arguments.done",
                    "item_id": id, "output_index": k, "arguments": arguments}));
                let done = item("completed", &arguments);
                events.push(
                    json!({"type": "response.output_item.done", "output_index": k, "item": done}),
                );
                output.push(done);
            }
        }
    }
    events.push(
        json!({"type": "response.completed", "response": response("completed", json!(output),
        json!({"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}))}),
    );
    let events = events
        .into_iter()
        .map(|v| Ev::Named(v["type"].as_str().unwrap().to_string(), v))
        .collect();
    // Every JSON event, unknown ones included, numbered in order.
    let mut seq = 0;
    with_noise(events, &case.noise, "responses")
        .into_iter()
        .map(|ev| match ev {
            Ev::Named(name, mut v) => {
                v["sequence_number"] = json!(seq);
                seq += 1;
                Ev::Named(name, v)
            }
            other => other,
        })
        .collect()
}

// ---- the property --------------------------------------------------------------------

/// Sends `sent` through the gateway as the upstream's stream and checks what the client
/// gets: 200, `x-backstop-validation: deferred` (a stream with tools gets its verdict in
/// the stream itself), and exactly `expected`, event for event and byte for byte. A
/// dropped, added, altered or reordered event fails the first comparison.
fn check(
    path: &str,
    body: Value,
    sent: &[Ev],
    expected: &[Ev],
    paced: bool,
) -> Result<(), TestCaseError> {
    let (rt, gw) = harness();
    let raw: String = sent.iter().map(Ev::frame).collect();
    let mut fault = format!(
        "events_b64={}",
        base64::engine::general_purpose::STANDARD.encode(&raw)
    );
    if paced {
        // One event per read upstream, rather than whatever the socket coalesced.
        fault.push_str(";chunk_delay=1ms");
    }
    let (status, validation, received) = rt.block_on(async {
        let resp = gw
            .post(
                path,
                Some(KEY_A),
                &[("x-mock-fault", &fault)],
                body.to_string(),
            )
            .await;
        let status = resp.status().as_u16();
        let validation = resp
            .headers()
            .get("x-backstop-validation")
            .map(|v| v.to_str().unwrap().to_string());
        (status, validation, resp.text().await.unwrap())
    });
    prop_assert_eq!(status, 200, "{}\nsent:\n{}", received, raw);
    prop_assert_eq!(validation.as_deref(), Some("deferred"));
    let want: String = expected.iter().map(Ev::frame).collect();
    prop_assert_eq!(parse(&received), parse(&want), "sent:\n{}", raw);
    prop_assert_eq!(received, want, "events equal, bytes differ; sent:\n{}", raw);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn chat_streams_arrive_whole(case in chat_case(), paced in any::<bool>()) {
        let (sent, usage_at) = chat_events(&case);
        let mut expected = sent.clone();
        if case.include_usage != Some(true) {
            // Backstop asked for the usage chunk; the client did not.
            expected.remove(usage_at);
        }
        let mut body = json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}}]});
        if let Some(include) = case.include_usage {
            body["stream_options"] = json!({"include_usage": include});
        }
        check("/v1/chat/completions", body, &sent, &expected, paced)?;
    }

    #[test]
    fn anthropic_streams_arrive_whole(case in messages_case(), paced in any::<bool>()) {
        let sent = messages_events(&case);
        let body = json!({"model": "claude-mock-1", "max_tokens": 64, "stream": true,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "get_weather", "input_schema": weather_schema()}]});
        check("/v1/messages", body, &sent, &sent, paced)?;
    }

    #[test]
    fn responses_streams_arrive_whole(case in responses_case(), paced in any::<bool>()) {
        let sent = responses_events(&case);
        let body = json!({"model": "gpt-4o", "stream": true, "input": "hi",
            "tools": [{"type": "function", "name": "get_weather", "parameters": weather_schema()}]});
        check("/v1/responses", body, &sent, &sent, paced)?;
    }
}

/// The helpers the property relies on: pieces rejoin to the whole, and the parser sees
/// names, JSON, raw data and comments.
#[test]
fn pieces_rejoin_and_events_parse() {
    let s = r#"{"city":"é\"中"}"#;
    for cuts in [vec![], vec![1, 5, 9], vec![usize::MAX, 3, 3]] {
        assert_eq!(split(s, &cuts).concat(), s);
    }
    let seen = parse("event: a\ndata: {\"x\":1}\n\n: hi\n\ndata: [DONE]\n\n");
    assert_eq!(
        seen,
        vec![
            (Some("a".into()), Some(json!({"x": 1})), vec![]),
            (None, None, vec![" hi".into()]),
            (None, Some(json!("[DONE]")), vec![]),
        ]
    );
}
