//! Strict mode: the mock refuses what the real APIs refuse, in their words.
//!
//! The lenient mock answers anything, so a translation bug (an OpenAI request turned
//! into an Anthropic one with an empty text block, a `system` message left inside
//! `messages`, an orphan tool result) would pass every test and fail against the real
//! provider. In strict mode each request is first put through the checks below; the
//! first one that fails is answered 400 in the API's own error shape, with the message
//! the real API gives (Anthropic: `{"type":"error","error":{"type":
//! "invalid_request_error","message":...}}`; OpenAI: `{"error":{"message","type":
//! "invalid_request_error","param","code"}}`).
//!
//! The checks are plain functions over the parsed body, so each rule is tested here
//! with a request the real API refuses and a close one it accepts. They refuse only
//! what the real API is known to refuse: a field or shape not checked here is accepted.
//! Nulls are accepted wherever a field is optional, as the real APIs do.

use std::collections::HashSet;

use axum::body::Body;
use http::{header, Response, StatusCode};
use serde_json::{json, Value};

use super::responses::Api;

/// Why a strict mock refuses a request: what the real API would answer with a 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub message: String,
    /// OpenAI's `param` (Anthropic's messages carry the path in the message itself).
    pub param: Option<String>,
    /// OpenAI's `code`.
    pub code: Option<&'static str>,
}

impl Refusal {
    fn new(message: impl Into<String>) -> Refusal {
        Refusal {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    fn param(mut self, param: impl Into<String>) -> Refusal {
        self.param = Some(param.into());
        self
    }

    fn code(mut self, code: &'static str) -> Refusal {
        self.code = Some(code);
        self
    }

    /// The 400 in `api`'s error shape.
    pub fn response(&self, api: Api) -> Response<Body> {
        let body = match api {
            Api::Anthropic => json!({"type": "error", "error": {
                "type": "invalid_request_error", "message": self.message}}),
            Api::OpenAi | Api::Responses => json!({"error": {
                "message": self.message, "type": "invalid_request_error",
                "param": self.param, "code": self.code}}),
        };
        Response::builder()
            .status(StatusCode::BAD_REQUEST)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .expect("valid response parts")
    }
}

type Checked = Result<(), Refusal>;

/// The strict checks for a `POST` to `path`; paths without checks pass.
pub fn check(path: &str, request: &Value) -> Checked {
    match path {
        "/v1/messages" => anthropic_messages(request),
        "/v1/chat/completions" => chat_completions(request),
        "/v1/responses" => responses(request),
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// Anthropic `POST /v1/messages`
// ---------------------------------------------------------------------------------------

/// The top-level fields of a Messages request; anything else is an extra input.
const ANTHROPIC_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "thinking",
    "service_tier",
    "container",
    "mcp_servers",
    "output_config",
    "output_format",
    "context_management",
    "inference_geo",
];

const TOOL_CHOICES: &[&str] = &["auto", "any", "tool", "none"];
const IMAGE_MEDIA_TYPES: &[&str] = &["image/jpeg", "image/png", "image/gif", "image/webp"];

/// Tool-use ids as Anthropic accepts them: `^[a-zA-Z0-9_-]+$`.
fn anthropic_id_ok(id: &str) -> bool {
    !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn role(message: &Value) -> Option<&str> {
    message.get("role").and_then(Value::as_str)
}

fn blocks(message: &Value) -> &[Value] {
    message
        .get("content")
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn block_type(block: &Value) -> Option<&str> {
    block.get("type").and_then(Value::as_str)
}

/// The field's value unless absent or null.
fn present<'a>(request: &'a Value, key: &str) -> Option<&'a Value> {
    request.get(key).filter(|v| !v.is_null())
}

/// Anthropic's Messages API: schema first (extra, missing and mistyped fields, ranges,
/// id patterns), then the conversation rules (non-empty content, tool pairing).
pub fn anthropic_messages(request: &Value) -> Checked {
    let Some(fields) = request.as_object() else {
        return Err(Refusal::new(
            "Input should be a valid dictionary or object to extract fields from",
        ));
    };
    if let Some(extra) = fields
        .keys()
        .find(|k| !ANTHROPIC_FIELDS.contains(&k.as_str()))
    {
        return Err(Refusal::new(format!(
            "{extra}: Extra inputs are not permitted"
        )));
    }
    for required in ["model", "messages", "max_tokens"] {
        if !fields.contains_key(required) {
            return Err(Refusal::new(format!("{required}: Field required")));
        }
    }
    // Validation is lax as pydantic's: `64.0` is an integer, `64.5` is not.
    match request["max_tokens"].as_f64() {
        Some(n) if n.fract() != 0.0 => {
            return Err(Refusal::new(
                "max_tokens: Input should be a valid integer, got a number with a fractional part",
            ))
        }
        Some(n) if n < 1.0 => {
            return Err(Refusal::new(
                "max_tokens: Input should be greater than or equal to 1",
            ))
        }
        Some(_) => {}
        None => return Err(Refusal::new("max_tokens: Input should be a valid integer")),
    }
    for (key, max) in [("temperature", 1.0), ("top_p", 1.0)] {
        if let Some(value) = present(request, key) {
            let Some(v) = value.as_f64() else {
                return Err(Refusal::new(format!(
                    "{key}: Input should be a valid number"
                )));
            };
            if v > max {
                return Err(Refusal::new(format!(
                    "{key}: Input should be less than or equal to {max}"
                )));
            }
            if v < 0.0 {
                return Err(Refusal::new(format!(
                    "{key}: Input should be greater than or equal to 0"
                )));
            }
        }
    }
    if let Some(stops) = present(request, "stop_sequences") {
        let Some(stops) = stops.as_array() else {
            return Err(Refusal::new("stop_sequences: Input should be a valid list"));
        };
        if let Some(i) = stops.iter().position(|s| !s.is_string()) {
            return Err(Refusal::new(format!(
                "stop_sequences.{i}: Input should be a valid string"
            )));
        }
    }
    anthropic_system(request)?;
    anthropic_tools(request)?;
    let Some(messages) = request["messages"].as_array() else {
        return Err(Refusal::new("messages: Input should be a valid list"));
    };
    for (n, message) in messages.iter().enumerate() {
        anthropic_message_schema(n, message)?;
    }
    if messages.is_empty() {
        return Err(Refusal::new("messages: at least one message is required"));
    }
    anthropic_content_rules(messages)?;
    anthropic_tool_pairing(messages)
}

fn anthropic_system(request: &Value) -> Checked {
    match present(request, "system") {
        None | Some(Value::String(_)) => Ok(()),
        Some(Value::Array(parts)) => {
            for (i, part) in parts.iter().enumerate() {
                if block_type(part) != Some("text") {
                    return Err(Refusal::new(format!(
                        "system.{i}.type: Input should be 'text'"
                    )));
                }
                match part.get("text").and_then(Value::as_str) {
                    None => return Err(Refusal::new(format!("system.{i}.text: Field required"))),
                    Some("") => {
                        return Err(Refusal::new(
                            "system: text content blocks must be non-empty",
                        ))
                    }
                    Some(t) if t.trim().is_empty() => {
                        return Err(Refusal::new(
                            "system: text content blocks must contain non-whitespace text",
                        ))
                    }
                    Some(_) => {}
                }
            }
            Ok(())
        }
        Some(_) => Err(Refusal::new("system: Input should be a valid list")),
    }
}

fn anthropic_tools(request: &Value) -> Checked {
    if let Some(tools) = present(request, "tools") {
        let Some(tools) = tools.as_array() else {
            return Err(Refusal::new("tools: Input should be a valid list"));
        };
        for (i, tool) in tools.iter().enumerate() {
            // Server tools (`web_search_20250305`, `bash_20250124`, ...) carry no schema.
            if !matches!(block_type(tool), None | Some("custom")) {
                continue;
            }
            for required in ["name", "input_schema"] {
                if present(tool, required).is_none() {
                    return Err(Refusal::new(format!(
                        "tools.{i}.custom.{required}: Field required"
                    )));
                }
            }
            if !tool["input_schema"].is_object() {
                return Err(Refusal::new(format!(
                    "tools.{i}.custom.input_schema: Input should be a valid dictionary"
                )));
            }
        }
    }
    if let Some(choice) = present(request, "tool_choice") {
        let kind = block_type(choice);
        match kind {
            Some(k) if TOOL_CHOICES.contains(&k) => {}
            Some(k) => {
                return Err(Refusal::new(format!(
                    "tool_choice: Input tag '{k}' found using 'type' does not match any of the \
                     expected tags: 'auto', 'any', 'tool', 'none'"
                )))
            }
            None => {
                return Err(Refusal::new(
                    "tool_choice: Unable to extract tag using discriminator 'type'",
                ))
            }
        }
        if kind == Some("tool") && present(choice, "name").is_none() {
            return Err(Refusal::new("tool_choice.tool.name: Field required"));
        }
    }
    Ok(())
}

/// One message's shape: its role, and its blocks' required fields and patterns.
fn anthropic_message_schema(n: usize, message: &Value) -> Checked {
    if !matches!(role(message), Some("user" | "assistant")) {
        return Err(Refusal::new(format!(
            "messages.{n}.role: Input should be 'user' or 'assistant'"
        )));
    }
    let parts = match message.get("content") {
        None => {
            return Err(Refusal::new(format!(
                "messages.{n}.content: Field required"
            )))
        }
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(Refusal::new(format!(
                "messages.{n}.content: Input should be a valid list"
            )))
        }
    };
    for (m, block) in parts.iter().enumerate() {
        let at = format!("messages.{n}.content.{m}");
        match block_type(block) {
            Some("text") => {
                if !block.get("text").is_some_and(Value::is_string) {
                    return Err(Refusal::new(format!("{at}.text.text: Field required")));
                }
            }
            Some("image") => anthropic_image(&at, block)?,
            Some("tool_use") => {
                for required in ["id", "name", "input"] {
                    if block.get(required).is_none() {
                        return Err(Refusal::new(format!(
                            "{at}.tool_use.{required}: Field required"
                        )));
                    }
                }
                let id = block["id"].as_str().unwrap_or_default();
                if !anthropic_id_ok(id) {
                    return Err(Refusal::new(format!(
                        "{at}.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"
                    )));
                }
                if !block["input"].is_object() {
                    return Err(Refusal::new(format!(
                        "{at}.tool_use.input: Input should be a valid dictionary"
                    )));
                }
            }
            Some("tool_result") => {
                let Some(id) = block.get("tool_use_id") else {
                    return Err(Refusal::new(format!(
                        "{at}.tool_result.tool_use_id: Field required"
                    )));
                };
                if !anthropic_id_ok(id.as_str().unwrap_or_default()) {
                    return Err(Refusal::new(format!(
                        "{at}.tool_result.tool_use_id: String should match pattern \
                         '^[a-zA-Z0-9_-]+$'"
                    )));
                }
            }
            Some(_) => {}
            None => {
                return Err(Refusal::new(format!(
                    "{at}: Unable to extract tag using discriminator 'type'"
                )))
            }
        }
    }
    Ok(())
}

fn anthropic_image(at: &str, block: &Value) -> Checked {
    let Some(source) = block.get("source") else {
        return Err(Refusal::new(format!("{at}.image.source: Field required")));
    };
    match block_type(source) {
        Some("base64") => {
            let Some(media_type) = source.get("media_type") else {
                return Err(Refusal::new(format!(
                    "{at}.image.source.base64.media_type: Field required"
                )));
            };
            if !IMAGE_MEDIA_TYPES.contains(&media_type.as_str().unwrap_or_default()) {
                return Err(Refusal::new(format!(
                    "{at}.image.source.base64.media_type: Input should be 'image/jpeg', \
                     'image/png', 'image/gif' or 'image/webp'"
                )));
            }
            if !source.get("data").is_some_and(Value::is_string) {
                return Err(Refusal::new(format!(
                    "{at}.image.source.base64.data: Field required"
                )));
            }
        }
        Some("url") => {
            if !source.get("url").is_some_and(Value::is_string) {
                return Err(Refusal::new(format!(
                    "{at}.image.source.url.url: Field required"
                )));
            }
        }
        Some(other) => {
            return Err(Refusal::new(format!(
                "{at}.image.source: Input tag '{other}' found using 'type' does not match \
                 any of the expected tags: 'base64', 'url'"
            )))
        }
        None => {
            return Err(Refusal::new(format!(
                "{at}.image.source: Unable to extract tag using discriminator 'type'"
            )))
        }
    }
    Ok(())
}

/// Non-empty text everywhere; non-empty content except in a final assistant message,
/// which may not end with whitespace either (it is a prefill the model continues).
fn anthropic_content_rules(messages: &[Value]) -> Checked {
    for message in messages {
        for block in blocks(message) {
            if block_type(block) != Some("text") {
                continue;
            }
            let text = block["text"].as_str().unwrap_or_default();
            if text.is_empty() {
                return Err(Refusal::new(
                    "messages: text content blocks must be non-empty",
                ));
            }
            if text.trim().is_empty() {
                return Err(Refusal::new(
                    "messages: text content blocks must contain non-whitespace text",
                ));
            }
        }
    }
    let last = messages.len() - 1;
    for (n, message) in messages.iter().enumerate() {
        let empty = match &message["content"] {
            Value::String(s) => s.is_empty(),
            Value::Array(parts) => parts.is_empty(),
            _ => false,
        };
        let final_assistant = n == last && role(message) == Some("assistant");
        if empty && !final_assistant {
            return Err(Refusal::new(format!(
                "messages.{n}: all messages must have non-empty content except for the \
                 optional final assistant message"
            )));
        }
        if final_assistant {
            let tail = match &message["content"] {
                Value::String(s) => Some(s.as_str()),
                Value::Array(parts) => parts
                    .last()
                    .filter(|b| block_type(b) == Some("text"))
                    .and_then(|b| b["text"].as_str()),
                _ => None,
            };
            if tail.is_some_and(|t| t.ends_with(char::is_whitespace)) {
                return Err(Refusal::new(
                    "final assistant content cannot end with trailing whitespace",
                ));
            }
        }
    }
    Ok(())
}

/// Every `tool_result` answers a `tool_use` of the message just before; every
/// `tool_use` is answered by `tool_result` blocks at the start of the next message.
fn anthropic_tool_pairing(messages: &[Value]) -> Checked {
    let tool_use_ids = |message: &Value| -> Vec<String> {
        if role(message) != Some("assistant") {
            return Vec::new();
        }
        blocks(message)
            .iter()
            .filter(|b| block_type(b) == Some("tool_use"))
            .filter_map(|b| b["id"].as_str().map(str::to_string))
            .collect()
    };
    for (n, message) in messages.iter().enumerate() {
        if role(message) == Some("user") {
            let previous: Vec<String> = n
                .checked_sub(1)
                .map(|p| tool_use_ids(&messages[p]))
                .unwrap_or_default();
            for (m, block) in blocks(message).iter().enumerate() {
                if block_type(block) != Some("tool_result") {
                    continue;
                }
                let id = block["tool_use_id"].as_str().unwrap_or_default();
                if !previous.iter().any(|p| p == id) {
                    return Err(Refusal::new(format!(
                        "messages.{n}.content.{m}: unexpected `tool_use_id` found in \
                         `tool_result` blocks: {id}. Each `tool_result` block must have a \
                         corresponding `tool_use` block in the previous message."
                    )));
                }
            }
        }
        let ids = tool_use_ids(message);
        let Some(next) = messages.get(n + 1).filter(|_| !ids.is_empty()) else {
            continue;
        };
        // Only results leading the next user message count: text must come after them.
        let answered: HashSet<&str> = if role(next) == Some("user") {
            blocks(next)
                .iter()
                .take_while(|b| block_type(b) == Some("tool_result"))
                .filter_map(|b| b["tool_use_id"].as_str())
                .collect()
        } else {
            HashSet::new()
        };
        let missing: Vec<&str> = ids
            .iter()
            .map(String::as_str)
            .filter(|id| !answered.contains(id))
            .collect();
        if !missing.is_empty() {
            return Err(Refusal::new(format!(
                "messages.{n}: `tool_use` ids were found without `tool_result` blocks \
                 immediately after: {}. Each `tool_use` block must have a corresponding \
                 `tool_result` block in the next message.",
                missing.join(", ")
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// OpenAI `POST /v1/chat/completions`
// ---------------------------------------------------------------------------------------

/// The top-level fields of a chat completion request (the OpenAI API reference).
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
];

/// The longest tool-call id OpenAI accepts in a request.
const MAX_TOOL_CALL_ID: usize = 40;

/// How OpenAI names a JSON value's type in its errors.
fn openai_type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// OpenAI's "not JSON" refusal.
fn openai_unparsable() -> Refusal {
    Refusal::new(
        "We could not parse the JSON body of your request. (HINT: This likely means you \
         aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, \
         but what was sent was not valid JSON. If you have trouble figuring out how to fix \
         this, please contact us through our help center at help.openai.com.)",
    )
}

fn openai_missing(key: &str) -> Refusal {
    Refusal::new(format!("Missing required parameter: '{key}'."))
        .param(key)
        .code("missing_required_parameter")
}

/// OpenAI's chat completions: schema (unknown fields, ranges, types, id lengths), then
/// the tool-call turn rules.
pub fn chat_completions(request: &Value) -> Checked {
    let Some(fields) = request.as_object() else {
        return Err(openai_unparsable());
    };
    if let Some(extra) = fields.keys().find(|k| !CHAT_FIELDS.contains(&k.as_str())) {
        return Err(Refusal::new(format!(
            "Unrecognized request argument supplied: {extra}"
        )));
    }
    for required in ["model", "messages"] {
        if !fields.contains_key(required) {
            return Err(openai_missing(required));
        }
    }
    if let Some(value) = present(request, "temperature") {
        let Some(t) = value.as_f64() else {
            return Err(Refusal::new(format!(
                "Invalid type for 'temperature': expected a decimal, but got {} instead.",
                openai_type_name(value)
            ))
            .param("temperature")
            .code("invalid_type"));
        };
        if t > 2.0 {
            return Err(Refusal::new(format!(
                "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, \
                 but got {t} instead."
            ))
            .param("temperature")
            .code("decimal_above_max_value"));
        }
        if t < 0.0 {
            return Err(Refusal::new(format!(
                "Invalid 'temperature': decimal below minimum value. Expected a value >= 0, \
                 but got {t} instead."
            ))
            .param("temperature")
            .code("decimal_below_min_value"));
        }
    }
    match present(request, "stop") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(stops)) if stops.len() > 4 => {
            return Err(Refusal::new(format!(
                "Invalid 'stop': array too long. Expected an array with maximum length 4, but \
                 got an array with length {} instead.",
                stops.len()
            ))
            .param("stop")
            .code("array_above_max_length"))
        }
        Some(Value::Array(_)) => {}
        Some(other) => {
            return Err(Refusal::new(format!(
                "Invalid type for 'stop': expected one of a string or array of strings, but \
                 got {} instead.",
                openai_type_name(other)
            ))
            .param("stop")
            .code("invalid_type"))
        }
    }
    if present(request, "stream_options").is_some()
        && request.get("stream").and_then(Value::as_bool) != Some(true)
    {
        return Err(Refusal::new(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        )
        .param("stream_options"));
    }
    let Some(messages) = request["messages"].as_array() else {
        return Err(Refusal::new(format!(
            "Invalid type for 'messages': expected an array, but got {} instead.",
            openai_type_name(&request["messages"])
        ))
        .param("messages")
        .code("invalid_type"));
    };
    for (n, message) in messages.iter().enumerate() {
        chat_tool_calls_schema(n, message)?;
    }
    chat_tool_pairing(messages)
}

fn chat_tool_calls_schema(n: usize, message: &Value) -> Checked {
    let Some(calls) = present(message, "tool_calls").and_then(Value::as_array) else {
        return Ok(());
    };
    if calls.is_empty() {
        return Err(Refusal::new(format!(
            "Invalid 'messages[{n}].tool_calls': empty array. Expected an array with minimum \
             length 1, but got an empty array instead."
        ))
        .param(format!("messages[{n}].tool_calls"))
        .code("empty_array"));
    }
    for (m, call) in calls.iter().enumerate() {
        let at = format!("messages[{n}].tool_calls[{m}]");
        let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
        let length = id.chars().count();
        if length > MAX_TOOL_CALL_ID {
            return Err(Refusal::new(format!(
                "Invalid '{at}.id': string too long. Expected a string with maximum length \
                 {MAX_TOOL_CALL_ID}, but got a string with length {length} instead."
            ))
            .param(format!("{at}.id"))
            .code("string_above_max_length"));
        }
        if let Some(arguments) = call.pointer("/function/arguments") {
            if !arguments.is_string() {
                return Err(Refusal::new(format!(
                    "Invalid type for '{at}.function.arguments': expected a string, but got \
                     {} instead.",
                    openai_type_name(arguments)
                ))
                .param(format!("{at}.function.arguments"))
                .code("invalid_type"));
            }
        }
    }
    Ok(())
}

/// Tool messages answer the tool calls of the assistant message just before them (only
/// tool messages in between), and every call is answered before the next other message.
fn chat_tool_pairing(messages: &[Value]) -> Checked {
    // The open turn: the assistant message's index and its call ids not yet answered.
    let mut open: Option<(usize, Vec<String>)> = None;
    let mut calls_of_turn: Vec<String> = Vec::new();
    let unanswered = |n: usize, ids: &[String]| {
        Refusal::new(format!(
            "An assistant message with 'tool_calls' must be followed by tool messages \
             responding to each 'tool_call_id'. The following tool_call_ids did not have \
             response messages: {}",
            ids.join(", ")
        ))
        .param(format!("messages.[{n}].role"))
    };
    for (n, message) in messages.iter().enumerate() {
        if role(message) == Some("tool") {
            let id = message
                .get("tool_call_id")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let Some((_, pending)) = open
                .as_mut()
                .filter(|_| calls_of_turn.iter().any(|c| c == id))
            else {
                return Err(Refusal::new(
                    "Invalid parameter: messages with role 'tool' must be a response to a \
                     preceeding message with 'tool_calls'.",
                )
                .param(format!("messages.[{n}].role")));
            };
            pending.retain(|p| p != id);
            continue;
        }
        if let Some((at, pending)) = open.take() {
            if !pending.is_empty() {
                return Err(unanswered(at, &pending));
            }
        }
        calls_of_turn.clear();
        let ids: Vec<String> = present(message, "tool_calls")
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
            .iter()
            .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_string))
            .collect();
        if role(message) == Some("assistant") && !ids.is_empty() {
            calls_of_turn = ids.clone();
            open = Some((n, ids));
        }
    }
    match open {
        Some((at, pending)) if !pending.is_empty() => Err(unanswered(at, &pending)),
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// OpenAI `POST /v1/responses`
// ---------------------------------------------------------------------------------------

/// The top-level fields of a Responses create request.
const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "stream",
    "store",
    "metadata",
    "previous_response_id",
    "reasoning",
    "include",
    "truncation",
    "user",
    "background",
    "conversation",
    "prompt",
    "service_tier",
    "max_tool_calls",
    "top_logprobs",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "stream_options",
];

/// The Responses API: unknown fields, and function call outputs answering no call of
/// the input (when no earlier response or conversation holds the calls).
pub fn responses(request: &Value) -> Checked {
    let Some(fields) = request.as_object() else {
        return Err(openai_unparsable());
    };
    if let Some(extra) = fields
        .keys()
        .find(|k| !RESPONSES_FIELDS.contains(&k.as_str()))
    {
        return Err(Refusal::new(format!("Unknown parameter: '{extra}'."))
            .param(extra.as_str())
            .code("unknown_parameter"));
    }
    if present(request, "previous_response_id").is_some()
        || present(request, "conversation").is_some()
    {
        return Ok(());
    }
    let Some(items) = request.get("input").and_then(Value::as_array) else {
        return Ok(());
    };
    let calls: HashSet<&str> = items
        .iter()
        .filter(|i| block_type(i) == Some("function_call"))
        .filter_map(|i| i.get("call_id").and_then(Value::as_str))
        .collect();
    for item in items {
        if block_type(item) != Some("function_call_output") {
            continue;
        }
        let id = item
            .get("call_id")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !calls.contains(id) {
            return Err(Refusal::new(format!(
                "No tool call found for function call output with call_id {id}."
            ))
            .param("input"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::responses::tests::body_of;

    /// A Messages request the real API accepts: `edit` changes it into the case.
    fn messages(edit: impl FnOnce(&mut Value)) -> Value {
        let mut request = json!({"model": "claude-sonnet-4-5", "max_tokens": 64,
            "messages": [{"role": "user", "content": "hello"}]});
        edit(&mut request);
        request
    }

    /// A tool loop: user, assistant text + call `id`, user result for `answer`.
    fn tool_loop(id: &str, answer: &str) -> Value {
        json!([
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": id, "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": answer, "content": "sunny"},
                {"type": "text", "text": "and tomorrow?"}]},
        ])
    }

    #[track_caller]
    fn refused(checked: Checked, message: &str) {
        assert_eq!(checked.expect_err("refused").message, message);
    }

    #[track_caller]
    fn anthropic_refuses(request: Value, message: &str) {
        refused(anthropic_messages(&request), message);
    }

    #[track_caller]
    fn anthropic_accepts(request: Value) {
        assert_eq!(anthropic_messages(&request), Ok(()), "{request}");
    }

    #[tokio::test]
    async fn refusals_have_the_real_error_shapes() {
        let refusal = anthropic_messages(&messages(|r| r["temprature"] = json!(0.5))).unwrap_err();
        let (status, body) = body_of(refusal.response(Api::Anthropic)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body,
            json!({"type": "error", "error": {"type": "invalid_request_error",
                   "message": "temprature: Extra inputs are not permitted"}})
        );

        let refusal =
            chat_completions(&json!({"model": "m", "messages": [], "temprature": 1})).unwrap_err();
        let (status, body) = body_of(refusal.response(Api::OpenAi)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            body,
            json!({"error": {"message": "Unrecognized request argument supplied: temprature",
                   "type": "invalid_request_error", "param": null, "code": null}})
        );
    }

    #[test]
    fn anthropic_unknown_top_level_fields() {
        anthropic_refuses(
            messages(|r| r["response_format"] = json!({"type": "json_object"})),
            "response_format: Extra inputs are not permitted",
        );
        anthropic_refuses(
            messages(|r| r["n"] = json!(1)),
            "n: Extra inputs are not permitted",
        );
        anthropic_accepts(messages(|r| {
            r["system"] = json!("be brief");
            r["metadata"] = json!({"user_id": "u1"});
            r["stop_sequences"] = json!(["END"]);
            r["stream"] = json!(false);
            r["top_k"] = json!(5);
            r["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
            r["output_config"] =
                json!({"format": {"type": "json_schema", "schema": {"type": "object"}}});
            r["service_tier"] = json!("auto");
        }));
    }

    #[test]
    fn anthropic_required_fields() {
        anthropic_refuses(
            messages(|r| {
                r.as_object_mut().unwrap().remove("max_tokens");
            }),
            "max_tokens: Field required",
        );
        anthropic_refuses(
            messages(|r| {
                r.as_object_mut().unwrap().remove("messages");
            }),
            "messages: Field required",
        );
        anthropic_refuses(
            messages(|r| r["messages"] = json!([])),
            "messages: at least one message is required",
        );
        anthropic_refuses(
            messages(|r| r["max_tokens"] = json!(0)),
            "max_tokens: Input should be greater than or equal to 1",
        );
        anthropic_refuses(
            messages(|r| r["max_tokens"] = json!(-5)),
            "max_tokens: Input should be greater than or equal to 1",
        );

        anthropic_accepts(messages(|r| r["max_tokens"] = json!(1)));
        anthropic_accepts(messages(|r| r["max_tokens"] = json!(64.0)));
    }

    #[test]
    fn anthropic_roles_are_user_or_assistant() {
        anthropic_refuses(
            messages(|r| {
                r["messages"] = json!([
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello"}])
            }),
            "messages.0.role: Input should be 'user' or 'assistant'",
        );
        anthropic_refuses(
            messages(|r| {
                r["messages"] = json!([
                    {"role": "user", "content": "hello"},
                    {"role": "tool", "content": "42"}])
            }),
            "messages.1.role: Input should be 'user' or 'assistant'",
        );
        // The system prompt's place, and an assistant prefill, are accepted.
        anthropic_accepts(messages(|r| {
            r["system"] = json!([{"type": "text", "text": "be brief"}]);
            r["messages"] = json!([
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hi"}]);
        }));
    }

    #[test]
    fn anthropic_text_must_be_non_empty() {
        anthropic_refuses(
            messages(|r| {
                r["messages"] = json!([
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": [
                        {"type": "text", "text": ""},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}])
            }),
            "messages: text content blocks must be non-empty",
        );
        anthropic_refuses(
            messages(|r| r["messages"][0]["content"] = json!([{"type": "text", "text": " \n"}])),
            "messages: text content blocks must contain non-whitespace text",
        );
        anthropic_refuses(
            messages(|r| r["system"] = json!([{"type": "text", "text": ""}])),
            "system: text content blocks must be non-empty",
        );
        anthropic_refuses(
            messages(|r| {
                r["messages"] = json!([
                    {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": ""},
                    {"role": "user", "content": "again"}])
            }),
            "messages.1: all messages must have non-empty content except for the optional \
             final assistant message",
        );
        anthropic_refuses(
            messages(|r| r["messages"][0]["content"] = json!([])),
            "messages.0: all messages must have non-empty content except for the optional \
             final assistant message",
        );
        anthropic_refuses(
            messages(|r| {
                r["messages"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"role": "assistant", "content": "Sure, "}))
            }),
            "final assistant content cannot end with trailing whitespace",
        );
        // The final assistant message may be empty; the tool call alone is fine.
        anthropic_accepts(messages(|r| {
            r["messages"]
                .as_array_mut()
                .unwrap()
                .push(json!({"role": "assistant", "content": ""}))
        }));
        anthropic_accepts(messages(|r| {
            r["messages"] = json!([
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}])
        }));
    }

    #[test]
    fn anthropic_tool_results_answer_the_previous_turn() {
        anthropic_accepts(messages(|r| {
            r["messages"] = tool_loop("toolu_01", "toolu_01")
        }));
        anthropic_refuses(
            messages(|r| r["messages"] = tool_loop("toolu_01", "toolu_02")),
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately \
             after: toolu_01. Each `tool_use` block must have a corresponding `tool_result` \
             block in the next message.",
        );
        // A result for a call two turns back.
        let mut history = tool_loop("toolu_01", "toolu_01");
        history.as_array_mut().unwrap().extend([
            json!({"role": "assistant", "content": "Tomorrow too."}),
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"}]}),
        ]);
        anthropic_refuses(
            messages(|r| r["messages"] = history),
            "messages.4.content.0: unexpected `tool_use_id` found in `tool_result` blocks: \
             toolu_01. Each `tool_result` block must have a corresponding `tool_use` block in \
             the previous message.",
        );
        // A call not answered by the next message; a trailing call is fine.
        let unanswered = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                {"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a"}]},
        ]);
        anthropic_refuses(
            messages(|r| r["messages"] = unanswered.clone()),
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately \
             after: toolu_b. Each `tool_use` block must have a corresponding `tool_result` \
             block in the next message.",
        );
        anthropic_accepts(messages(|r| {
            r["messages"] = json!(unanswered.as_array().unwrap()[..2])
        }));
    }

    #[test]
    fn anthropic_tool_results_come_first() {
        let mut history = tool_loop("toolu_01", "toolu_01");
        history[2]["content"] = json!([
            {"type": "text", "text": "here it is"},
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "sunny"}]);
        anthropic_refuses(
            messages(|r| r["messages"] = history),
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately \
             after: toolu_01. Each `tool_use` block must have a corresponding `tool_result` \
             block in the next message.",
        );
    }

    #[test]
    fn anthropic_tool_ids_match_the_pattern() {
        anthropic_refuses(
            messages(|r| r["messages"] = tool_loop("functions.Bash:0", "functions.Bash:0")),
            "messages.1.content.1.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'",
        );
        let mut history = tool_loop("call_abc-1", "call_abc-1");
        history[2]["content"][0]["tool_use_id"] = json!("call abc");
        anthropic_refuses(
            messages(|r| r["messages"] = history),
            "messages.2.content.0.tool_result.tool_use_id: String should match pattern \
             '^[a-zA-Z0-9_-]+$'",
        );
        // OpenAI's own ids are valid for Anthropic.
        anthropic_accepts(messages(|r| {
            r["messages"] = tool_loop("call_Ab9-x_", "call_Ab9-x_")
        }));
    }

    #[test]
    fn anthropic_temperature_and_top_p_are_within_0_and_1() {
        anthropic_refuses(
            messages(|r| r["temperature"] = json!(1.5)),
            "temperature: Input should be less than or equal to 1",
        );
        anthropic_refuses(
            messages(|r| r["temperature"] = json!(-0.1)),
            "temperature: Input should be greater than or equal to 0",
        );
        anthropic_refuses(
            messages(|r| r["top_p"] = json!(2)),
            "top_p: Input should be less than or equal to 1",
        );
        anthropic_accepts(messages(|r| r["temperature"] = json!(1)));
        anthropic_accepts(messages(|r| r["temperature"] = json!(0)));
        anthropic_accepts(messages(|r| r["temperature"] = Value::Null));
    }

    #[test]
    fn anthropic_tools_and_tool_choice() {
        let tool = json!({"name": "get_weather", "input_schema": {"type": "object"}});
        anthropic_refuses(
            messages(|r| r["tool_choice"] = json!({"type": "required"})),
            "tool_choice: Input tag 'required' found using 'type' does not match any of the \
             expected tags: 'auto', 'any', 'tool', 'none'",
        );
        anthropic_refuses(
            messages(|r| r["tool_choice"] = json!("auto")),
            "tool_choice: Unable to extract tag using discriminator 'type'",
        );
        anthropic_refuses(
            messages(|r| r["tool_choice"] = json!({"type": "tool"})),
            "tool_choice.tool.name: Field required",
        );
        anthropic_refuses(
            messages(|r| r["tools"] = json!([{"input_schema": {"type": "object"}}])),
            "tools.0.custom.name: Field required",
        );
        anthropic_refuses(
            messages(|r| {
                r["tools"] = json!([tool, {"name": "f", "parameters": {"type": "object"}}])
            }),
            "tools.1.custom.input_schema: Field required",
        );
        for choice in ["auto", "any", "none"] {
            anthropic_accepts(messages(|r| {
                r["tools"] = json!([tool]);
                r["tool_choice"] = json!({"type": choice, "disable_parallel_tool_use": true});
            }));
        }
        anthropic_accepts(messages(|r| {
            r["tools"] = json!([tool, {"type": "web_search_20250305", "name": "web_search"}]);
            r["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
        }));
    }

    #[test]
    fn anthropic_tool_use_input_is_an_object() {
        let mut history = tool_loop("toolu_01", "toolu_01");
        history[1]["content"][1]["input"] = json!(r#"{"city":"Paris"}"#);
        anthropic_refuses(
            messages(|r| r["messages"] = history),
            "messages.1.content.1.tool_use.input: Input should be a valid dictionary",
        );
    }

    #[test]
    fn anthropic_stop_sequences_are_strings() {
        anthropic_refuses(
            messages(|r| r["stop_sequences"] = json!("END")),
            "stop_sequences: Input should be a valid list",
        );
        anthropic_refuses(
            messages(|r| r["stop_sequences"] = json!(["END", 7])),
            "stop_sequences.1: Input should be a valid string",
        );
        anthropic_accepts(messages(|r| r["stop_sequences"] = json!(["END", "STOP"])));
    }

    #[test]
    fn anthropic_image_sources() {
        let image = |source: Value| {
            messages(|r| {
                r["messages"][0]["content"] = json!([
                    {"type": "image", "source": source},
                    {"type": "text", "text": "what is this?"}])
            })
        };
        anthropic_refuses(
            image(json!({"type": "image_url", "url": "https://x/a.png"})),
            "messages.0.content.0.image.source: Input tag 'image_url' found using 'type' does \
             not match any of the expected tags: 'base64', 'url'",
        );
        anthropic_refuses(
            image(json!({"type": "base64", "data": "iVBORw0KGgo="})),
            "messages.0.content.0.image.source.base64.media_type: Field required",
        );
        anthropic_refuses(
            image(json!({"type": "base64", "media_type": "image/bmp", "data": "Qk0="})),
            "messages.0.content.0.image.source.base64.media_type: Input should be \
             'image/jpeg', 'image/png', 'image/gif' or 'image/webp'",
        );
        anthropic_accepts(image(
            json!({"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}),
        ));
        anthropic_accepts(image(json!({"type": "url", "url": "https://x/a.png"})));
    }

    /// A chat request the real API accepts: `edit` changes it into the case.
    fn chat(edit: impl FnOnce(&mut Value)) -> Value {
        let mut request = json!({"model": "gpt-4o",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]});
        edit(&mut request);
        request
    }

    fn chat_loop(id: &str, answer: &str) -> Value {
        json!([
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": answer, "content": "sunny"},
        ])
    }

    #[track_caller]
    fn chat_refuses(request: Value, message: &str) -> Refusal {
        let refusal = chat_completions(&request).expect_err("refused");
        assert_eq!(refusal.message, message);
        refusal
    }

    #[track_caller]
    fn chat_accepts(request: Value) {
        assert_eq!(chat_completions(&request), Ok(()), "{request}");
    }

    #[test]
    fn chat_unknown_top_level_fields() {
        chat_refuses(
            chat(|r| r["max_output_tokens"] = json!(10)),
            "Unrecognized request argument supplied: max_output_tokens",
        );
        chat_refuses(
            chat(|r| r["stop_sequences"] = json!(["END"])),
            "Unrecognized request argument supplied: stop_sequences",
        );
        chat_accepts(chat(|r| {
            r["max_completion_tokens"] = json!(10);
            r["stop"] = json!(["END"]);
            r["response_format"] = json!({"type": "json_object"});
            r["seed"] = json!(1);
            r["stream"] = json!(true);
            r["stream_options"] = json!({"include_usage": true});
            r["reasoning_effort"] = json!("low");
        }));
    }

    #[test]
    fn chat_tool_messages_answer_a_preceding_call() {
        chat_accepts(chat(|r| r["messages"] = chat_loop("call_1", "call_1")));
        let refusal = chat_refuses(
            chat(|r| r["messages"] = chat_loop("call_1", "call_2")),
            "Invalid parameter: messages with role 'tool' must be a response to a preceeding \
             message with 'tool_calls'.",
        );
        assert_eq!(refusal.param.as_deref(), Some("messages.[2].role"));
        chat_refuses(
            chat(|r| {
                r["messages"] = json!([{"role": "tool", "tool_call_id": "call_1", "content": "x"}])
            }),
            "Invalid parameter: messages with role 'tool' must be a response to a preceeding \
             message with 'tool_calls'.",
        );
    }

    #[test]
    fn chat_every_tool_call_is_answered() {
        let mut history = chat_loop("call_1", "call_1");
        history[1]["tool_calls"]
            .as_array_mut()
            .unwrap()
            .push(json!({"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{}"}}));
        let answered = {
            let mut h = history.clone();
            h.as_array_mut()
                .unwrap()
                .push(json!({"role": "tool", "tool_call_id": "call_2", "content": "ok"}));
            h
        };
        history
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "user", "content": "well?"}));
        chat_refuses(
            chat(|r| r["messages"] = history),
            "An assistant message with 'tool_calls' must be followed by tool messages \
             responding to each 'tool_call_id'. The following tool_call_ids did not have \
             response messages: call_2",
        );
        chat_accepts(chat(|r| r["messages"] = answered));
        // A trailing call with no answer is refused too.
        let trailing = json!(chat_loop("call_1", "call_1").as_array().unwrap()[..2]);
        chat_refuses(
            chat(|r| r["messages"] = trailing),
            "An assistant message with 'tool_calls' must be followed by tool messages \
             responding to each 'tool_call_id'. The following tool_call_ids did not have \
             response messages: call_1",
        );
    }

    #[test]
    fn chat_tool_call_ids_are_at_most_40_characters() {
        let long = format!("toolu_{}", "x".repeat(35));
        let refusal = chat_refuses(
            chat(|r| r["messages"] = chat_loop(&long, &long)),
            "Invalid 'messages[1].tool_calls[0].id': string too long. Expected a string with \
             maximum length 40, but got a string with length 41 instead.",
        );
        assert_eq!(refusal.code, Some("string_above_max_length"));
        assert_eq!(
            refusal.param.as_deref(),
            Some("messages[1].tool_calls[0].id")
        );
        let forty = "x".repeat(40);
        chat_accepts(chat(|r| r["messages"] = chat_loop(&forty, &forty)));
    }

    #[test]
    fn chat_tool_call_arguments_are_a_string() {
        let mut history = chat_loop("call_1", "call_1");
        history[1]["tool_calls"][0]["function"]["arguments"] = json!({"city": "Paris"});
        chat_refuses(
            chat(|r| r["messages"] = history),
            "Invalid type for 'messages[1].tool_calls[0].function.arguments': expected a \
             string, but got an object instead.",
        );
        let mut history = chat_loop("call_1", "call_1");
        history[1]["tool_calls"] = json!([]);
        history.as_array_mut().unwrap().pop();
        chat_refuses(
            chat(|r| r["messages"] = history),
            "Invalid 'messages[1].tool_calls': empty array. Expected an array with minimum \
             length 1, but got an empty array instead.",
        );
    }

    #[test]
    fn chat_temperature_stop_and_stream_options() {
        let refusal = chat_refuses(
            chat(|r| r["temperature"] = json!(2.5)),
            "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but \
             got 2.5 instead.",
        );
        assert_eq!(refusal.code, Some("decimal_above_max_value"));
        chat_refuses(
            chat(|r| r["temperature"] = json!(-1)),
            "Invalid 'temperature': decimal below minimum value. Expected a value >= 0, but \
             got -1 instead.",
        );
        chat_accepts(chat(|r| r["temperature"] = json!(2)));
        chat_refuses(
            chat(|r| r["stop"] = json!(["a", "b", "c", "d", "e"])),
            "Invalid 'stop': array too long. Expected an array with maximum length 4, but got \
             an array with length 5 instead.",
        );
        chat_accepts(chat(|r| r["stop"] = json!(["a", "b", "c", "d"])));
        chat_accepts(chat(|r| r["stop"] = json!("a")));
        chat_refuses(
            chat(|r| r["stream_options"] = json!({"include_usage": true})),
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        );
        chat_accepts(chat(|r| {
            r["stream"] = json!(false);
            r["stream_options"] = Value::Null;
        }));
    }

    fn create(edit: impl FnOnce(&mut Value)) -> Value {
        let mut request = json!({"model": "gpt-4o", "input": "hello"});
        edit(&mut request);
        request
    }

    #[test]
    fn responses_unknown_top_level_fields() {
        let refusal = responses(&create(|r| r["messages"] = json!([]))).unwrap_err();
        assert_eq!(refusal.message, "Unknown parameter: 'messages'.");
        assert_eq!(refusal.param.as_deref(), Some("messages"));
        assert_eq!(refusal.code, Some("unknown_parameter"));
        assert_eq!(
            responses(&create(|r| {
                r["instructions"] = json!("be brief");
                r["max_output_tokens"] = json!(100);
                r["text"] = json!({"format": {"type": "text"}});
                r["reasoning"] = json!({"effort": "low"});
                r["store"] = json!(false);
            })),
            Ok(())
        );
    }

    #[test]
    fn responses_function_call_outputs_answer_a_call() {
        let input = |call: &str, answer: &str| {
            json!([
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": call, "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": answer, "output": "sunny"},
            ])
        };
        refused(
            responses(&create(|r| r["input"] = input("call_1", "call_2"))),
            "No tool call found for function call output with call_id call_2.",
        );
        assert_eq!(
            responses(&create(|r| r["input"] = input("call_1", "call_1"))),
            Ok(())
        );
        // The call may live in the previous response.
        assert_eq!(
            responses(&create(|r| {
                r["input"] = json!([input("call_1", "call_2")[2]]);
                r["previous_response_id"] = json!("resp_1");
            })),
            Ok(())
        );
    }

    #[test]
    fn other_paths_are_not_checked() {
        assert_eq!(check("/v1/embeddings", &json!({"x": 1})), Ok(()));
        assert_eq!(check("/v1/messages/count_tokens", &json!({"x": 1})), Ok(()));
        assert!(check("/v1/messages", &json!({"x": 1})).is_err());
        assert!(check("/v1/messages", &Value::Null).is_err());
    }
}
