//! The Responses API → Anthropic messages: requests (without `previous_response_id`), and
//! answers whole and streamed.
//!
//! The answer's `id` is Backstop's own (`resp_…`): nothing is stored on either side, so it
//! cannot be retrieved, continued (`previous_response_id`) or cancelled later; `store` is
//! accepted and not sent. The table this module implements is in `docs/translation.md`.
//!
//! Normalisations (what comes back differs from what went in, with the same meaning):
//! - consecutive items of one role are merged into one message (Anthropic alternates);
//! - in a user turn, tool results come first, the turn's text after them;
//! - `text.format: json_object` becomes the schema `{"type": "object"}`;
//! - each non-empty text block of the answer is one `message` item; empty ones are omitted;
//! - streamed arguments are passed as they come; a call that streamed none is `"{}"`.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::{finish, ids, AnswerContext, AnswerError, Judge, StreamTranslator};
use crate::wire::sse::SseEvent;

// ---------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------

/// Anthropic's roles in `messages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    User,
    Assistant,
}

/// An Anthropic content block as Backstop writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Image {
        source: ImageSource,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        content: ToolResultContent,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ImageSource {
    Base64 { media_type: String, data: String },
    Url { url: String },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
enum ToolResultContent {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Clone, Serialize)]
struct Message {
    role: Role,
    content: Vec<Block>,
}

/// The conversation being built: roles alternate, tool results lead their user turn.
#[derive(Debug, Default)]
struct Conversation {
    messages: Vec<Message>,
}

impl Conversation {
    fn push(&mut self, role: Role, blocks: Vec<Block>) {
        if blocks.is_empty() {
            return;
        }
        match self.messages.last_mut() {
            Some(last) if last.role == role => last.content.extend(blocks),
            _ => self.messages.push(Message {
                role,
                content: blocks,
            }),
        }
    }

    /// A tool result: after the turn's other results, before its text.
    fn push_result(&mut self, block: Block) {
        match self.messages.last_mut() {
            Some(last) if last.role == Role::User => {
                let at = last
                    .content
                    .iter()
                    .position(|b| !matches!(b, Block::ToolResult { .. }))
                    .unwrap_or(last.content.len());
                last.content.insert(at, block);
            }
            _ => self.messages.push(Message {
                role: Role::User,
                content: vec![block],
            }),
        }
    }
}

/// Top-level fields accepted and not sent when they have these values (the defaults, or
/// what cannot matter to a single stateless call).
fn accepted_unsent(field: &str, value: &Value) -> bool {
    match field {
        "store" => value.is_boolean(),
        "truncation" => value == "disabled",
        "background" => value == false,
        "include" => value.as_array().is_some_and(Vec::is_empty),
        // Only obfuscation padding, which the translated stream never carries.
        "stream_options" => value
            .as_object()
            .is_some_and(|o| o.keys().all(|k| k == "include_obfuscation")),
        "reasoning" => value
            .as_object()
            .is_some_and(|o| o.values().all(Value::is_null)),
        "metadata" => value.as_object().is_some_and(Map::is_empty),
        "parallel_tool_calls" => value.is_boolean(),
        _ => false,
    }
}

/// A Responses create as an Anthropic messages request; what it cannot carry goes to
/// `judge`. `max_tokens` is the target's configured default when the caller set no
/// `max_output_tokens`.
pub fn request(
    caller: &Map<String, Value>,
    judge: &mut Judge<'_>,
    max_tokens: Option<u64>,
) -> Map<String, Value> {
    let mut out = Map::new();
    let mut system: Vec<String> = Vec::new();
    let mut conversation = Conversation::default();

    for (field, value) in caller {
        if value.is_null() {
            continue;
        }
        let path = format!("/{}", escape(field));
        match field.as_str() {
            "model" => {
                out.insert("model".into(), value.clone());
            }
            "instructions" => match value {
                Value::String(s) if s.is_empty() => {}
                Value::String(s) => system.insert(0, s.clone()),
                _ => judge.lose(path, field),
            },
            "input" => {}
            "tools" | "tool_choice" | "max_output_tokens" | "text" | "user"
            | "safety_identifier" => {}
            "temperature" => match value.as_f64() {
                Some(t) if (0.0..=1.0).contains(&t) => {
                    out.insert("temperature".into(), value.clone());
                }
                _ => judge.lose(path, field),
            },
            // Claude's current models refuse both sampling knobs at once.
            "top_p" if caller.get("temperature").is_some_and(|t| !t.is_null()) => {
                judge.lose(path, field)
            }
            "top_p" => {
                out.insert("top_p".into(), value.clone());
            }
            "stream" => {
                out.insert("stream".into(), value.clone());
            }
            f if accepted_unsent(f, value) => {}
            _ => judge.lose(path, field),
        }
    }

    match caller.get("input") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => {
            conversation.push(Role::User, text_block(text).into_iter().collect());
        }
        Some(Value::Array(items)) => {
            input_items(items, judge, &mut system, &mut conversation);
        }
        Some(_) => judge.lose("/input", "input"),
    }
    if let Some(last) = conversation.messages.last() {
        // Anthropic would continue a trailing assistant turn (prefill); the Responses API
        // answers after it. The meaning differs, so it is not sent.
        if last.role == Role::Assistant {
            let at = caller
                .get("input")
                .and_then(Value::as_array)
                .map_or(0, |a| a.len().saturating_sub(1));
            judge.lose(format!("/input/{at}"), "input");
        }
    }

    match system.len() {
        0 => {}
        1 => {
            out.insert("system".into(), Value::String(system.remove(0)));
        }
        _ => {
            let blocks: Vec<Block> = system
                .into_iter()
                .map(|text| Block::Text { text })
                .collect();
            out.insert("system".into(), to_value(&blocks));
        }
    }
    out.insert("messages".into(), to_value(&conversation.messages));

    match caller.get("max_output_tokens").and_then(Value::as_u64) {
        Some(n) => {
            out.insert("max_tokens".into(), n.into());
        }
        None => match max_tokens {
            Some(n) => {
                out.insert("max_tokens".into(), n.into());
            }
            None => judge.lose("/max_output_tokens", "max_output_tokens"),
        },
    }

    tools(caller, judge, &mut out);
    text_format(caller, judge, &mut out);
    user_id(caller, judge, &mut out);
    out
}

/// A JSON pointer segment.
fn escape(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

fn to_value<T: Serialize>(value: &T) -> Value {
    serde_json::to_value(value).expect("Backstop's own types serialize")
}

/// A text block, unless it has no visible text (Anthropic refuses those).
fn text_block(text: &str) -> Option<Block> {
    (!text.trim().is_empty()).then(|| Block::Text { text: text.into() })
}

/// The `input` items, in order.
fn input_items(
    items: &[Value],
    judge: &mut Judge<'_>,
    system: &mut Vec<String>,
    conversation: &mut Conversation,
) {
    for (i, item) in items.iter().enumerate() {
        let path = format!("/input/{i}");
        let Some(obj) = item.as_object() else {
            judge.lose(path, "input");
            continue;
        };
        let kind = obj.get("type").and_then(Value::as_str);
        match kind {
            Some("message") | None if obj.contains_key("role") => {
                let role = obj.get("role").and_then(Value::as_str).unwrap_or("");
                let content = obj.get("content").unwrap_or(&Value::Null);
                match role {
                    "system" | "developer" => {
                        if !conversation.messages.is_empty() {
                            judge.lose(path, "input");
                            continue;
                        }
                        let Some(blocks) = parts(content, &path, judge, Role::User) else {
                            continue;
                        };
                        for block in blocks {
                            match block {
                                Block::Text { text } => system.push(text),
                                _ => judge.lose(format!("{path}/content"), "input"),
                            }
                        }
                    }
                    "user" | "assistant" => {
                        let role = if role == "user" {
                            Role::User
                        } else {
                            Role::Assistant
                        };
                        if let Some(blocks) = parts(content, &path, judge, role) {
                            conversation.push(role, blocks);
                        }
                    }
                    _ => judge.lose(format!("{path}/role"), "input"),
                }
            }
            Some("function_call") => {
                let (Some(call_id), Some(name)) = (
                    obj.get("call_id").and_then(Value::as_str),
                    obj.get("name").and_then(Value::as_str),
                ) else {
                    judge.lose(path, "input");
                    continue;
                };
                let input = match obj.get("arguments") {
                    None | Some(Value::Null) => json!({}),
                    Some(Value::String(s)) if s.trim().is_empty() => json!({}),
                    Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                        Ok(v @ Value::Object(_)) => v,
                        _ => {
                            judge.lose(format!("{path}/arguments"), "input");
                            continue;
                        }
                    },
                    Some(_) => {
                        judge.lose(format!("{path}/arguments"), "input");
                        continue;
                    }
                };
                conversation.push(
                    Role::Assistant,
                    vec![Block::ToolUse {
                        id: ids::for_anthropic(call_id),
                        name: name.into(),
                        input,
                    }],
                );
            }
            Some("function_call_output") => {
                let Some(call_id) = obj.get("call_id").and_then(Value::as_str) else {
                    judge.lose(path, "input");
                    continue;
                };
                let content = match obj.get("output") {
                    Some(Value::String(s)) => ToolResultContent::Text(s.clone()),
                    Some(parts_value @ Value::Array(_)) => {
                        match parts(parts_value, &format!("{path}/output"), judge, Role::User) {
                            Some(blocks) => ToolResultContent::Blocks(blocks),
                            None => continue,
                        }
                    }
                    _ => {
                        judge.lose(format!("{path}/output"), "input");
                        continue;
                    }
                };
                conversation.push_result(Block::ToolResult {
                    tool_use_id: ids::for_anthropic(call_id),
                    content,
                });
            }
            // reasoning, item_reference, built-in tool calls and their outputs, ...
            _ => judge.lose(path, "input"),
        }
    }
}

/// A message's content (a string or parts) as blocks; `None` when it is not content.
/// `at` is the path of the item (or of the output holding the parts).
fn parts(content: &Value, at: &str, judge: &mut Judge<'_>, role: Role) -> Option<Vec<Block>> {
    let content_path = if at.ends_with("/output") {
        at.to_string()
    } else {
        format!("{at}/content")
    };
    let parts = match content {
        Value::String(s) => return Some(text_block(s).into_iter().collect()),
        Value::Array(parts) => parts,
        _ => {
            judge.lose(content_path, "input");
            return None;
        }
    };
    let mut blocks = Vec::new();
    for (j, part) in parts.iter().enumerate() {
        let path = format!("{content_path}/{j}");
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "input_text" | "output_text" | "text" => {
                let Some(text) = part.get("text").and_then(Value::as_str) else {
                    judge.lose(path, "input");
                    continue;
                };
                let annotated = part
                    .get("annotations")
                    .and_then(Value::as_array)
                    .is_some_and(|a| !a.is_empty());
                if annotated {
                    judge.lose(format!("{path}/annotations"), "input");
                }
                blocks.extend(text_block(text));
            }
            "input_image" if role == Role::User => {
                let detail = part.get("detail").and_then(Value::as_str).unwrap_or("auto");
                if detail != "auto" {
                    judge.lose(format!("{path}/detail"), "input");
                }
                match part
                    .get("image_url")
                    .and_then(Value::as_str)
                    .and_then(image)
                {
                    Some(source) => blocks.push(Block::Image { source }),
                    None => judge.lose(path, "input"),
                }
            }
            // input_file, input_audio, refusal, ...
            _ => judge.lose(path, "input"),
        }
    }
    Some(blocks)
}

/// An image URL as Anthropic's source: a base64 data URL, or an http(s) URL.
fn image(url: &str) -> Option<ImageSource> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest.split_once(',')?;
        let media_type = meta.strip_suffix(";base64")?;
        return (!media_type.is_empty() && !data.is_empty()).then(|| ImageSource::Base64 {
            media_type: media_type.into(),
            data: data.into(),
        });
    }
    (url.starts_with("https://") || url.starts_with("http://"))
        .then(|| ImageSource::Url { url: url.into() })
}

/// `tools`, `tool_choice` and `parallel_tool_calls`.
fn tools(caller: &Map<String, Value>, judge: &mut Judge<'_>, out: &mut Map<String, Value>) {
    let mut translated = Vec::new();
    match caller.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, tool) in list.iter().enumerate() {
                let path = format!("/tools/{i}");
                let Some(obj) = tool.as_object() else {
                    judge.lose(path, "tools");
                    continue;
                };
                if obj.get("type").and_then(Value::as_str) != Some("function") {
                    judge.lose(path, "tools");
                    continue;
                }
                let Some(name) = obj.get("name").and_then(Value::as_str) else {
                    judge.lose(path, "tools");
                    continue;
                };
                let mut t = Map::new();
                t.insert("name".into(), name.into());
                for (key, value) in obj {
                    match (key.as_str(), value) {
                        ("type" | "name", _) | (_, Value::Null) => {}
                        ("description", Value::String(_)) => {
                            t.insert("description".into(), value.clone());
                        }
                        ("parameters", Value::Object(_)) => {
                            t.insert("input_schema".into(), value.clone());
                        }
                        ("strict", Value::Bool(strict)) => {
                            if *strict {
                                t.insert("strict".into(), true.into());
                            }
                        }
                        _ => judge.lose(format!("{path}/{}", escape(key)), "tools"),
                    }
                }
                t.entry("input_schema")
                    .or_insert_with(|| json!({"type": "object"}));
                translated.push(Value::Object(t));
            }
        }
        Some(_) => judge.lose("/tools", "tools"),
    }
    let has_tools = !translated.is_empty();

    let mut choice = match caller.get("tool_choice") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Some(json!({"type": "auto"})),
            "none" => Some(json!({"type": "none"})),
            "required" => Some(json!({"type": "any"})),
            _ => {
                judge.lose("/tool_choice", "tool_choice");
                None
            }
        },
        Some(Value::Object(o)) => {
            match (
                o.get("type").and_then(Value::as_str),
                o.get("name").and_then(Value::as_str),
            ) {
                (Some("function"), Some(name)) if o.len() == 2 => {
                    Some(json!({"type": "tool", "name": name}))
                }
                _ => {
                    judge.lose("/tool_choice", "tool_choice");
                    None
                }
            }
        }
        Some(_) => {
            judge.lose("/tool_choice", "tool_choice");
            None
        }
    };
    if !has_tools {
        // Without tools, `auto` and `none` both mean "answer in text", Anthropic's default.
        if choice
            .as_ref()
            .is_some_and(|c| c["type"] == "auto" || c["type"] == "none")
        {
            choice = None;
        }
    } else if caller.get("parallel_tool_calls") == Some(&Value::Bool(false)) {
        let c = choice.get_or_insert_with(|| json!({"type": "auto"}));
        if c["type"] != "none" {
            c["disable_parallel_tool_use"] = true.into();
        }
    }
    if has_tools {
        out.insert("tools".into(), Value::Array(translated));
    }
    if let Some(choice) = choice {
        out.insert("tool_choice".into(), choice);
    }
}

/// `text.format` → `output_config.format`.
fn text_format(caller: &Map<String, Value>, judge: &mut Judge<'_>, out: &mut Map<String, Value>) {
    let Some(text) = caller.get("text").filter(|v| !v.is_null()) else {
        return;
    };
    let Some(text) = text.as_object() else {
        judge.lose("/text", "text");
        return;
    };
    for (key, value) in text {
        match key.as_str() {
            "format" if value.is_null() => {}
            "format" => {
                let format = value.as_object();
                let kind = format.and_then(|f| f.get("type")).and_then(Value::as_str);
                match (kind, format) {
                    (Some("text"), _) => {}
                    (Some("json_object"), _) => {
                        out.insert(
                            "output_config".into(),
                            json!({"format": {"type": "json_schema", "schema": {"type": "object"}}}),
                        );
                    }
                    (Some("json_schema"), Some(f)) => {
                        let Some(schema) = f.get("schema").filter(|s| s.is_object()) else {
                            judge.lose("/text/format/schema", "text");
                            continue;
                        };
                        for k in f.keys() {
                            // The name labels the schema; strictness is Anthropic's only mode.
                            if !matches!(k.as_str(), "type" | "schema" | "name" | "strict") {
                                judge.lose(format!("/text/format/{}", escape(k)), "text");
                            }
                        }
                        out.insert(
                            "output_config".into(),
                            json!({"format": {"type": "json_schema", "schema": schema}}),
                        );
                    }
                    _ => judge.lose("/text/format", "text"),
                }
            }
            _ if value.is_null() => {}
            _ => judge.lose(format!("/text/{}", escape(key)), "text"),
        }
    }
}

/// `safety_identifier` (or the older `user`) → `metadata.user_id`.
fn user_id(caller: &Map<String, Value>, judge: &mut Judge<'_>, out: &mut Map<String, Value>) {
    let get = |k: &str| caller.get(k).filter(|v| !v.is_null());
    let (safety, user) = (get("safety_identifier"), get("user"));
    for (field, value) in [("safety_identifier", safety), ("user", user)] {
        if value.is_some_and(|v| !v.is_string()) {
            judge.lose(format!("/{field}"), field);
        }
    }
    let (safety, user) = (safety.and_then(Value::as_str), user.and_then(Value::as_str));
    if let (Some(s), Some(u)) = (safety, user) {
        if s != u {
            judge.lose("/user", "user");
        }
    }
    if let Some(id) = safety.or(user) {
        out.insert("metadata".into(), json!({"user_id": id}));
    }
}

// ---------------------------------------------------------------------------------------
// Answers: Anthropic's side, as read
// ---------------------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct AnthropicMessage {
    model: String,
    content: Vec<AnthropicBlock>,
    stop_reason: Option<String>,
    usage: AnthropicUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum AnthropicBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    Thinking {},
    RedactedThinking {},
    #[serde(other)]
    Other,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct AnthropicUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
}

impl AnthropicUsage {
    /// Later counts (a `message_delta`'s) over earlier ones.
    fn update(&mut self, later: AnthropicUsage) {
        self.input_tokens = later.input_tokens.or(self.input_tokens);
        self.output_tokens = later.output_tokens.or(self.output_tokens);
        self.cache_read_input_tokens = later
            .cache_read_input_tokens
            .or(self.cache_read_input_tokens);
        self.cache_creation_input_tokens = later
            .cache_creation_input_tokens
            .or(self.cache_creation_input_tokens);
    }

    fn responses(&self) -> Usage {
        let cached = self.cache_read_input_tokens.unwrap_or(0);
        let input = self
            .input_tokens
            .unwrap_or(0)
            .saturating_add(cached)
            .saturating_add(self.cache_creation_input_tokens.unwrap_or(0));
        let output = self.output_tokens.unwrap_or(0);
        Usage {
            input_tokens: input,
            input_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
            output_tokens: output,
            output_tokens_details: ReasoningTokens {
                reasoning_tokens: 0,
            },
            total_tokens: input.saturating_add(output),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Answers: the Responses side, as written
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Serialize)]
struct Usage {
    input_tokens: u64,
    input_tokens_details: CachedTokens,
    output_tokens: u64,
    output_tokens_details: ReasoningTokens,
    total_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct CachedTokens {
    cached_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct ReasoningTokens {
    reasoning_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    InProgress,
    Completed,
    Incomplete,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum OutputItem {
    Message {
        id: String,
        status: Status,
        role: AssistantRole,
        content: Vec<Part>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: Status,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
enum AssistantRole {
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    OutputText {
        text: String,
        annotations: Vec<Value>,
    },
}

impl Part {
    fn text(text: &str) -> Part {
        Part::OutputText {
            text: text.into(),
            annotations: Vec::new(),
        }
    }
}

fn message_item(id: &str, text: &str, status: Status) -> OutputItem {
    OutputItem::Message {
        id: id.into(),
        status,
        role: AssistantRole::Assistant,
        content: if status == Status::InProgress {
            Vec::new()
        } else {
            vec![Part::text(text)]
        },
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct IncompleteDetails {
    reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
struct ResponseError {
    code: String,
    message: String,
}

/// The `response` object, whole or as the stream's events carry it.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct ResponseObject {
    id: String,
    object: &'static str,
    created_at: u64,
    status: Status,
    model: String,
    output: Vec<OutputItem>,
    usage: Option<Usage>,
    error: Option<ResponseError>,
    incomplete_details: Option<IncompleteDetails>,
    #[serde(flatten)]
    echo: Echo,
}

/// What the response repeats from the caller's request.
#[derive(Debug, Clone, PartialEq, Serialize)]
struct Echo {
    instructions: Value,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: Value,
    temperature: Value,
    top_p: Value,
    max_output_tokens: Value,
    text: Value,
    metadata: Value,
    store: Value,
    previous_response_id: Value,
    reasoning: Value,
    truncation: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    user: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    safety_identifier: Option<Value>,
}

impl Echo {
    fn of(caller: &Map<String, Value>) -> Echo {
        let get = |k: &str, default: Value| {
            caller
                .get(k)
                .filter(|v| !v.is_null())
                .cloned()
                .unwrap_or(default)
        };
        Echo {
            instructions: get("instructions", Value::Null),
            tools: get("tools", json!([])),
            tool_choice: get("tool_choice", json!("auto")),
            parallel_tool_calls: get("parallel_tool_calls", json!(true)),
            temperature: get("temperature", json!(1.0)),
            top_p: get("top_p", json!(1.0)),
            max_output_tokens: get("max_output_tokens", Value::Null),
            text: get("text", json!({"format": {"type": "text"}})),
            metadata: get("metadata", json!({})),
            store: get("store", json!(true)),
            previous_response_id: Value::Null,
            reasoning: json!({"effort": null, "summary": null}),
            truncation: get("truncation", json!("disabled")),
            user: caller.get("user").filter(|v| !v.is_null()).cloned(),
            safety_identifier: caller
                .get("safety_identifier")
                .filter(|v| !v.is_null())
                .cloned(),
        }
    }
}

fn new_id(prefix: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + 48);
    id.push_str(prefix);
    for _ in 0..3 {
        id.push_str(&format!("{:016x}", fastrand::u64(..)));
    }
    id
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl ResponseObject {
    fn start(cx: &AnswerContext, model: String) -> ResponseObject {
        ResponseObject {
            id: new_id("resp_"),
            object: "response",
            created_at: now_secs(),
            status: Status::InProgress,
            model,
            output: Vec::new(),
            usage: None,
            error: None,
            incomplete_details: None,
            echo: Echo::of(&cx.caller.json),
        }
    }

    /// Ends the response for Anthropic's `stop_reason`.
    fn end(&mut self, stop_reason: Option<&str>, usage: AnthropicUsage) -> Result<(), String> {
        let reason = stop_reason.ok_or("the answer has no stop_reason")?;
        let (status, incomplete) = finish::to_responses_status(reason)
            .ok_or_else(|| format!("stop_reason {reason:?} has no Responses equivalent"))?;
        self.status = if status == "completed" {
            Status::Completed
        } else {
            Status::Incomplete
        };
        self.incomplete_details = incomplete.map(|reason| IncompleteDetails { reason });
        // A message cut short is itself incomplete, as OpenAI marks it.
        if self.status == Status::Incomplete {
            if let Some(OutputItem::Message { status, .. }) = self.output.last_mut() {
                *status = Status::Incomplete;
            }
        }
        self.usage = Some(usage.responses());
        Ok(())
    }
}

/// A whole messages answer as a Responses `response` object.
pub fn whole(cx: &AnswerContext, body: &[u8]) -> Result<Bytes, AnswerError> {
    let message: AnthropicMessage = serde_json::from_slice(body)
        .map_err(|e| AnswerError(format!("not an Anthropic message: {e}")))?;
    let mut response = ResponseObject::start(cx, message.model);
    for block in message.content {
        match block {
            AnthropicBlock::Text { text } if text.is_empty() => {}
            AnthropicBlock::Text { text } => {
                let item = message_item(&new_id("msg_"), &text, Status::Completed);
                response.output.push(item);
            }
            AnthropicBlock::ToolUse { id, name, input } => {
                let arguments = if input.is_null() {
                    "{}".to_string()
                } else {
                    input.to_string()
                };
                response.output.push(OutputItem::FunctionCall {
                    id: new_id("fc_"),
                    call_id: ids::from_anthropic(&id),
                    name,
                    arguments,
                    status: Status::Completed,
                });
            }
            other => return Err(unrepresentable(&other)),
        }
    }
    response
        .end(message.stop_reason.as_deref(), message.usage)
        .map_err(AnswerError)?;
    Ok(Bytes::from(
        serde_json::to_vec(&response).expect("serializes"),
    ))
}

fn unrepresentable(block: &AnthropicBlock) -> AnswerError {
    AnswerError(match block {
        AnthropicBlock::Thinking {} | AnthropicBlock::RedactedThinking {} => {
            "a thinking block has no Responses equivalent here".into()
        }
        _ => "a content block of a kind the Responses API cannot carry".into(),
    })
}

// ---------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------

/// Anthropic's stream events, as read.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum InEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: u64,
        content_block: AnthropicBlock,
    },
    ContentBlockDelta {
        index: u64,
        delta: InDelta,
    },
    ContentBlockStop {
        index: u64,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        #[serde(default)]
        usage: Option<AnthropicUsage>,
    },
    MessageStop {},
    Ping {},
    Error {
        error: InError,
    },
    /// Anthropic may add event types; they are skipped, as its docs ask.
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Deserialize)]
struct StartMessage {
    model: String,
    #[serde(default)]
    usage: AnthropicUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum InDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct MessageDeltaBody {
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct InError {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    message: String,
}

/// The Responses events Backstop writes.
#[derive(Debug, Serialize)]
#[serde(tag = "type")]
enum OutEvent<'a> {
    #[serde(rename = "response.created")]
    Created { response: &'a ResponseObject },
    #[serde(rename = "response.in_progress")]
    InProgress { response: &'a ResponseObject },
    #[serde(rename = "response.output_item.added")]
    ItemAdded {
        output_index: usize,
        item: &'a OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    PartAdded {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        part: Part,
    },
    #[serde(rename = "response.output_text.delta")]
    TextDelta {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        delta: &'a str,
        logprobs: [Value; 0],
    },
    #[serde(rename = "response.output_text.done")]
    TextDone {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        text: &'a str,
        logprobs: [Value; 0],
    },
    #[serde(rename = "response.content_part.done")]
    PartDone {
        item_id: &'a str,
        output_index: usize,
        content_index: usize,
        part: Part,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    ArgumentsDelta {
        item_id: &'a str,
        output_index: usize,
        delta: &'a str,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    ArgumentsDone {
        item_id: &'a str,
        output_index: usize,
        name: &'a str,
        arguments: &'a str,
    },
    #[serde(rename = "response.output_item.done")]
    ItemDone {
        output_index: usize,
        item: &'a OutputItem,
    },
    #[serde(rename = "response.completed")]
    Completed { response: &'a ResponseObject },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: &'a ResponseObject },
    #[serde(rename = "response.failed")]
    Failed { response: &'a ResponseObject },
    /// The stream's own failure, shaped as `crate::wire::stream_error_event` writes it.
    #[serde(rename = "error")]
    Error {
        code: &'a str,
        message: &'a str,
        param: Option<&'a str>,
    },
}

impl OutEvent<'_> {
    fn name(&self) -> &'static str {
        match self {
            OutEvent::Created { .. } => "response.created",
            OutEvent::InProgress { .. } => "response.in_progress",
            OutEvent::ItemAdded { .. } => "response.output_item.added",
            OutEvent::PartAdded { .. } => "response.content_part.added",
            OutEvent::TextDelta { .. } => "response.output_text.delta",
            OutEvent::TextDone { .. } => "response.output_text.done",
            OutEvent::PartDone { .. } => "response.content_part.done",
            OutEvent::ArgumentsDelta { .. } => "response.function_call_arguments.delta",
            OutEvent::ArgumentsDone { .. } => "response.function_call_arguments.done",
            OutEvent::ItemDone { .. } => "response.output_item.done",
            OutEvent::Completed { .. } => "response.completed",
            OutEvent::Incomplete { .. } => "response.incomplete",
            OutEvent::Failed { .. } => "response.failed",
            OutEvent::Error { .. } => "error",
        }
    }
}

#[derive(Serialize)]
struct Numbered<'a> {
    #[serde(flatten)]
    event: &'a OutEvent<'a>,
    sequence_number: u64,
}

/// The content block being streamed.
#[derive(Debug)]
enum Open {
    /// A text block; its message item is opened at the first non-empty text.
    Text {
        index: u64,
        item: Option<(String, usize)>,
        text: String,
    },
    ToolUse {
        index: u64,
        id: String,
        output_index: usize,
        call_id: String,
        name: String,
        arguments: String,
        /// What the block's start held, for a call whose arguments never stream.
        initial: Value,
    },
}

#[derive(Debug)]
enum Phase {
    /// Before `message_start`.
    Waiting,
    Streaming(Box<Live>),
    /// A terminal event was written; the rest is ignored.
    Ended,
}

/// A started response: what has been written of it, and what the stream said so far.
#[derive(Debug)]
struct Live {
    response: ResponseObject,
    block: Option<Open>,
    usage: AnthropicUsage,
    stop_reason: Option<String>,
}

struct Translator {
    cx: AnswerContext,
    phase: Phase,
    sequence: u64,
}

/// Messages events as Responses events.
pub fn translator(cx: &AnswerContext) -> Box<dyn StreamTranslator> {
    Box::new(Translator {
        cx: cx.clone(),
        phase: Phase::Waiting,
        sequence: 0,
    })
}

impl Translator {
    fn emit(&mut self, event: OutEvent<'_>, out: &mut Vec<Bytes>) {
        let numbered = Numbered {
            event: &event,
            sequence_number: self.sequence,
        };
        self.sequence += 1;
        let data = serde_json::to_string(&numbered).expect("serializes");
        out.push(Bytes::from(format!(
            "event: {}\ndata: {data}\n\n",
            event.name()
        )));
    }

    /// Ends the stream with an `error` event: nothing after it.
    fn fail_stream(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        self.phase = Phase::Ended;
        self.emit(
            OutEvent::Error {
                code,
                message,
                param: None,
            },
            out,
        );
    }

    /// Ends a started response as failed (`response.failed` with its error).
    fn fail_response(&mut self, code: &str, message: &str, out: &mut Vec<Bytes>) {
        match std::mem::replace(&mut self.phase, Phase::Ended) {
            Phase::Streaming(mut live) => {
                let response = &mut live.response;
                response.status = Status::Failed;
                response.error = Some(ResponseError {
                    code: code.into(),
                    message: message.into(),
                });
                self.emit(OutEvent::Failed { response }, out);
            }
            _ => self.fail_stream(code, message, out),
        }
    }

    fn handle(&mut self, event: InEvent, out: &mut Vec<Bytes>) -> Result<(), String> {
        match event {
            InEvent::Ping {} | InEvent::Unknown => Ok(()),
            InEvent::Error { error } => {
                let code = match error.kind.as_str() {
                    "rate_limit_error" => "rate_limit_exceeded",
                    "invalid_request_error" => "invalid_prompt",
                    _ => "server_error",
                };
                let message = if error.message.is_empty() {
                    error.kind
                } else {
                    error.message
                };
                self.fail_response(code, &message, out);
                Ok(())
            }
            InEvent::MessageStart { message } => {
                if !matches!(self.phase, Phase::Waiting) {
                    return Err("a second message_start".into());
                }
                let response = ResponseObject::start(&self.cx, message.model);
                self.emit(
                    OutEvent::Created {
                        response: &response,
                    },
                    out,
                );
                self.emit(
                    OutEvent::InProgress {
                        response: &response,
                    },
                    out,
                );
                self.phase = Phase::Streaming(Box::new(Live {
                    response,
                    block: None,
                    usage: message.usage,
                    stop_reason: None,
                }));
                Ok(())
            }
            other => self.streaming(other, out),
        }
    }

    /// The events that only make sense after `message_start`.
    fn streaming(&mut self, event: InEvent, out: &mut Vec<Bytes>) -> Result<(), String> {
        let mut phase = std::mem::replace(&mut self.phase, Phase::Ended);
        let Phase::Streaming(live) = &mut phase else {
            return Err("an event before message_start".into());
        };
        let Live {
            response,
            block,
            usage,
            stop_reason,
        } = &mut **live;
        let result = match event {
            InEvent::ContentBlockStart {
                index,
                content_block,
            } => {
                if block.is_some() {
                    Err("a block started before the last one stopped".into())
                } else {
                    match content_block {
                        AnthropicBlock::Text { text } => {
                            *block = Some(Open::Text {
                                index,
                                item: None,
                                text: String::new(),
                            });
                            self.text(response, block, &text, out);
                            Ok(())
                        }
                        AnthropicBlock::ToolUse { id, name, input } => {
                            let output_index = response.output.len();
                            let item = OutputItem::FunctionCall {
                                id: new_id("fc_"),
                                call_id: ids::from_anthropic(&id),
                                name: name.clone(),
                                arguments: String::new(),
                                status: Status::InProgress,
                            };
                            self.emit(
                                OutEvent::ItemAdded {
                                    output_index,
                                    item: &item,
                                },
                                out,
                            );
                            let OutputItem::FunctionCall { id, call_id, .. } = item else {
                                unreachable!("built above")
                            };
                            *block = Some(Open::ToolUse {
                                index,
                                id,
                                output_index,
                                call_id,
                                name,
                                arguments: String::new(),
                                initial: input,
                            });
                            Ok(())
                        }
                        other => Err(unrepresentable(&other).0),
                    }
                }
            }
            InEvent::ContentBlockDelta { index, delta } => match (block.as_mut(), delta) {
                (Some(Open::Text { index: at, .. }), InDelta::TextDelta { text })
                    if *at == index =>
                {
                    self.text(response, block, &text, out);
                    Ok(())
                }
                (
                    Some(Open::ToolUse {
                        index: at,
                        id,
                        output_index,
                        arguments,
                        ..
                    }),
                    InDelta::InputJsonDelta { partial_json },
                ) if *at == index => {
                    if !partial_json.is_empty() {
                        arguments.push_str(&partial_json);
                        let (id, output_index) = (id.clone(), *output_index);
                        self.emit(
                            OutEvent::ArgumentsDelta {
                                item_id: &id,
                                output_index,
                                delta: &partial_json,
                            },
                            out,
                        );
                    }
                    Ok(())
                }
                _ => Err("a delta that does not fit the open block".into()),
            },
            InEvent::ContentBlockStop { index } => match block.take() {
                Some(Open::Text {
                    index: at,
                    item,
                    text,
                }) if at == index => {
                    if let Some((id, output_index)) = item {
                        let content_index = 0;
                        self.emit(
                            OutEvent::TextDone {
                                item_id: &id,
                                output_index,
                                content_index,
                                text: &text,
                                logprobs: [],
                            },
                            out,
                        );
                        self.emit(
                            OutEvent::PartDone {
                                item_id: &id,
                                output_index,
                                content_index,
                                part: Part::text(&text),
                            },
                            out,
                        );
                        let item = message_item(&id, &text, Status::Completed);
                        self.emit(
                            OutEvent::ItemDone {
                                output_index,
                                item: &item,
                            },
                            out,
                        );
                        response.output.push(item);
                    }
                    Ok(())
                }
                Some(Open::ToolUse {
                    index: at,
                    id,
                    output_index,
                    call_id,
                    name,
                    mut arguments,
                    initial,
                }) if at == index => {
                    if arguments.is_empty() {
                        arguments = match initial {
                            Value::Object(o) if !o.is_empty() => Value::Object(o).to_string(),
                            _ => "{}".into(),
                        };
                    }
                    self.emit(
                        OutEvent::ArgumentsDone {
                            item_id: &id,
                            output_index,
                            name: &name,
                            arguments: &arguments,
                        },
                        out,
                    );
                    let item = OutputItem::FunctionCall {
                        id,
                        call_id,
                        name,
                        arguments,
                        status: Status::Completed,
                    };
                    self.emit(
                        OutEvent::ItemDone {
                            output_index,
                            item: &item,
                        },
                        out,
                    );
                    response.output.push(item);
                    Ok(())
                }
                _ => Err("a block stopped that was not open".into()),
            },
            InEvent::MessageDelta { delta, usage: u } => {
                if let Some(reason) = delta.stop_reason {
                    *stop_reason = Some(reason);
                }
                if let Some(u) = u {
                    usage.update(u);
                }
                Ok(())
            }
            InEvent::MessageStop {} => {
                if block.is_some() {
                    Err("the message stopped inside a block".into())
                } else {
                    match response.end(stop_reason.as_deref(), *usage) {
                        Ok(()) => {
                            let event = if response.status == Status::Completed {
                                OutEvent::Completed { response }
                            } else {
                                OutEvent::Incomplete { response }
                            };
                            self.emit(event, out);
                            // Ended: the phase stays `Ended`.
                            return Ok(());
                        }
                        Err(e) => Err(e),
                    }
                }
            }
            InEvent::MessageStart { .. }
            | InEvent::Ping {}
            | InEvent::Unknown
            | InEvent::Error { .. } => unreachable!("handled before"),
        };
        self.phase = phase;
        result
    }

    /// Text for the open text block: its item opened at the first non-empty piece.
    fn text(
        &mut self,
        response: &ResponseObject,
        block: &mut Option<Open>,
        piece: &str,
        out: &mut Vec<Bytes>,
    ) {
        let Some(Open::Text { item, text, .. }) = block else {
            return;
        };
        if piece.is_empty() {
            return;
        }
        let (id, output_index) = item
            .get_or_insert_with(|| (new_id("msg_"), response.output.len()))
            .clone();
        if text.is_empty() {
            let added = message_item(&id, "", Status::InProgress);
            self.emit(
                OutEvent::ItemAdded {
                    output_index,
                    item: &added,
                },
                out,
            );
            self.emit(
                OutEvent::PartAdded {
                    item_id: &id,
                    output_index,
                    content_index: 0,
                    part: Part::text(""),
                },
                out,
            );
        }
        text.push_str(piece);
        self.emit(
            OutEvent::TextDelta {
                item_id: &id,
                output_index,
                content_index: 0,
                delta: piece,
                logprobs: [],
            },
            out,
        );
    }
}

impl StreamTranslator for Translator {
    fn event(&mut self, event: &SseEvent, out: &mut Vec<Bytes>) {
        if matches!(self.phase, Phase::Ended) {
            return;
        }
        let Some(json) = &event.json else {
            if event.unreadable {
                let message = "an upstream event whose data is not JSON";
                self.fail_response("upstream_stream_error", message, out);
            }
            return;
        };
        let parsed = match InEvent::deserialize(json) {
            Ok(parsed) => parsed,
            Err(e) => {
                let message = format!("a malformed upstream event: {e}");
                return self.fail_response("upstream_stream_error", &message, out);
            }
        };
        if let Err(message) = self.handle(parsed, out) {
            self.fail_response("upstream_stream_error", &message, out);
        }
    }

    fn ended(&self) -> bool {
        matches!(self.phase, Phase::Ended)
    }

    fn finish(&mut self, out: &mut Vec<Bytes>) {
        if !matches!(self.phase, Phase::Ended) {
            self.fail_stream(
                "upstream_stream_error",
                "the upstream stream ended before the response was complete",
                out,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::api::{Endpoint, ParsedRequest};
    use crate::translate::Direction;
    use crate::wire::sse::Splitter;

    const FIXTURES: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/translate/responses/"
    );

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!("{FIXTURES}{name}")).expect(name)
    }

    /// The golden file `name` holds `actual` (written instead when `BLESS` is set).
    fn golden(name: &str, actual: &str) {
        if std::env::var_os("BLESS").is_some() {
            std::fs::write(format!("{FIXTURES}{name}"), actual).unwrap();
        }
        assert_eq!(actual, fixture(name), "{name}");
    }

    fn cx(caller: Value) -> AnswerContext {
        let body = Bytes::from(caller.to_string());
        AnswerContext {
            direction: Direction::ResponsesToMessages,
            caller: Arc::new(ParsedRequest::parse(Endpoint::Responses, body).unwrap()),
        }
    }

    fn translate(caller: Value, max_tokens: Option<u64>) -> (Value, Vec<String>) {
        let Value::Object(caller) = caller else {
            panic!("an object")
        };
        let mut judge = Judge::new(&[]);
        let out = request(&caller, &mut judge, max_tokens);
        (Value::Object(out), judge.losses)
    }

    fn exact(caller: Value) -> Value {
        let (out, losses) = translate(caller, Some(100));
        assert!(losses.is_empty(), "{losses:?}");
        out
    }

    /// Backstop's own ids in order of appearance (`resp_0`, `msg_1`, ...) and no clock,
    /// so two translations of one answer compare equal.
    #[derive(Default)]
    struct Normalise(HashMap<String, String>);

    impl Normalise {
        fn value(&mut self, v: &mut Value) {
            match v {
                Value::String(s) => {
                    for prefix in ["resp_", "msg_", "fc_"] {
                        let own = s.strip_prefix(prefix).is_some_and(|rest| {
                            rest.len() == 48 && rest.bytes().all(|b| b.is_ascii_hexdigit())
                        });
                        if own {
                            let n = self.0.len();
                            *s = self
                                .0
                                .entry(s.clone())
                                .or_insert_with(|| format!("{prefix}{n}"))
                                .clone();
                        }
                    }
                }
                Value::Array(a) => a.iter_mut().for_each(|v| self.value(v)),
                Value::Object(o) => {
                    for (k, v) in o.iter_mut() {
                        if k == "created_at" {
                            *v = json!(0);
                        } else {
                            self.value(v);
                        }
                    }
                }
                _ => {}
            }
        }
    }

    fn normalised(mut v: Value) -> Value {
        Normalise::default().value(&mut v);
        v
    }

    fn pretty(v: &Value) -> String {
        serde_json::to_string_pretty(v).unwrap() + "\n"
    }

    /// A translated stream, cut into `(name, data)` events.
    fn run_stream(cx: &AnswerContext, bytes: &[u8], cuts: &[usize]) -> Vec<(String, Value)> {
        let mut translator = translator(cx);
        let mut splitter = Splitter::default();
        let mut out = Vec::new();
        let mut from = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(bytes.len());
        for cut in cuts {
            for event in splitter.push(&bytes[from..cut]) {
                translator.event(&event, &mut out);
            }
            from = cut;
        }
        if let Some(event) = splitter.finish() {
            translator.event(&event, &mut out);
        }
        translator.finish(&mut out);
        let mut splitter = Splitter::default();
        let joined: Vec<u8> = out.iter().flat_map(|b| b.to_vec()).collect();
        let events = splitter.push(&joined);
        assert!(splitter.finish().is_none(), "whole events only");
        events
            .into_iter()
            .map(|e| {
                let text = std::str::from_utf8(&e.raw).unwrap();
                let name = text
                    .lines()
                    .next()
                    .unwrap()
                    .strip_prefix("event: ")
                    .unwrap();
                (name.to_string(), e.json.expect("JSON data"))
            })
            .collect()
    }

    fn caller() -> Value {
        json!({"model": "gpt-4o", "input": "hi", "max_output_tokens": 64})
    }

    // --- requests ------------------------------------------------------------------

    #[test]
    fn golden_request() {
        let caller: Value = serde_json::from_str(&fixture("request.json")).unwrap();
        let expected: Value = serde_json::from_str(&fixture("request.anthropic.json")).unwrap();
        assert_eq!(exact(caller), expected);
    }

    #[test]
    fn untranslatable_requests_name_their_paths() {
        let cases = [
            (
                json!({"previous_response_id": "resp_1"}),
                "/previous_response_id",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "id": "rs_1", "summary": []}]}),
                "/input/1",
            ),
            (json!({"tools": [{"type": "web_search"}]}), "/tools/0"),
            (json!({"temperature": 1.5}), "/temperature"),
            (json!({"x_unknown": 1}), "/x_unknown"),
            (json!({"conversation": "conv_1"}), "/conversation"),
            (json!({"reasoning": {"effort": "high"}}), "/reasoning"),
            (
                json!({"include": ["reasoning.encrypted_content"]}),
                "/include",
            ),
            (json!({"truncation": "auto"}), "/truncation"),
            (json!({"background": true}), "/background"),
            (json!({"metadata": {"k": "v"}}), "/metadata"),
            (json!({"top_logprobs": 2}), "/top_logprobs"),
            (json!({"service_tier": "flex"}), "/service_tier"),
            (json!({"prompt": {"id": "pmpt_1"}}), "/prompt"),
            (json!({"prompt_cache_key": "k"}), "/prompt_cache_key"),
            (json!({"max_tool_calls": 3}), "/max_tool_calls"),
            (
                json!({"tool_choice": {"type": "web_search_preview"}}),
                "/tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "name": "f", "defer_loading": true}]}),
                "/tools/0/defer_loading",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png,raw"}]}]}),
                "/input/0/content/0",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "b"}]}),
                "/input/1/content/0",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}, {"type": "function_call_output", "call_id": "c", "output": "x"}]}),
                "/input/1/arguments",
            ),
            (json!({"text": {"verbosity": "low"}}), "/text/verbosity"),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}, {"role": "user", "content": "b"}]}),
                "/input/1",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
                "/input/0/content/0",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png", "detail": "high"}]}]}),
                "/input/0/content/0/detail",
            ),
            (
                json!({"input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "prefill"}]}),
                "/input/1",
            ),
            (
                json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
                "/input/0",
            ),
        ];
        for (extra, path) in cases {
            let mut caller = caller();
            caller
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            if caller["input"].is_array() && !caller["input"].to_string().contains("\"user\"") {
                caller["input"]
                    .as_array_mut()
                    .unwrap()
                    .insert(0, json!("x"));
            }
            let (_, losses) = translate(caller, Some(100));
            assert!(losses.iter().any(|l| l == path), "{path}: {losses:?}");
        }
        let (_, losses) = translate(json!({"model": "m", "input": "hi"}), None);
        assert_eq!(losses, ["/max_output_tokens"]);
    }

    #[test]
    fn a_route_may_allow_named_losses() {
        let drop = ["previous_response_id".to_string()];
        let mut judge = Judge::new(&drop);
        let mut caller = caller();
        caller["previous_response_id"] = json!("resp_1");
        let out = request(caller.as_object().unwrap(), &mut judge, None);
        assert!(judge.losses.is_empty());
        assert_eq!(judge.dropped, ["previous_response_id"]);
        assert!(!out.contains_key("previous_response_id"));
    }

    #[test]
    fn tool_results_lead_their_turn_and_one_turn_holds_them_all() {
        let out = exact(json!({"model": "m", "max_output_tokens": 5, "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{\"x\":1}"},
            {"role": "user", "content": "note"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "2"}]},
        ]}));
        assert_eq!(
            out["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "go"}]},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "a", "name": "f", "input": {}},
                    {"type": "tool_use", "id": "b", "name": "f", "input": {"x": 1}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": "1"},
                    {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "2"}]},
                    {"type": "text", "text": "note"},
                ]},
            ])
        );
    }

    #[test]
    fn instructions_alone_are_a_string_and_tool_choice_maps() {
        let base = json!({"model": "m", "max_output_tokens": 5, "input": "q", "instructions": "be kind",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]});
        let out = exact(base.clone());
        assert_eq!(out["system"], "be kind");
        assert_eq!(
            out["messages"],
            json!([{"role": "user", "content": [{"type": "text", "text": "q"}]}])
        );
        assert!(out.get("tool_choice").is_none());
        for (choice, expected) in [
            (json!("auto"), json!({"type": "auto"})),
            (json!("none"), json!({"type": "none"})),
            (json!("required"), json!({"type": "any"})),
            (
                json!({"type": "function", "name": "f"}),
                json!({"type": "tool", "name": "f"}),
            ),
        ] {
            let mut caller = base.clone();
            caller["tool_choice"] = choice;
            assert_eq!(exact(caller)["tool_choice"], expected);
        }
        let mut caller = base.clone();
        caller["parallel_tool_calls"] = json!(false);
        assert_eq!(
            exact(caller)["tool_choice"],
            json!({"type": "auto", "disable_parallel_tool_use": true})
        );
        // Without tools, parallel_tool_calls and tool_choice auto change nothing.
        let out = exact(json!({"model": "m", "max_output_tokens": 5, "input": "q",
            "parallel_tool_calls": false, "tool_choice": "auto"}));
        assert!(out.get("tool_choice").is_none() && out.get("tools").is_none());
    }

    #[test]
    fn json_object_becomes_an_object_schema_and_user_becomes_user_id() {
        let out = exact(json!({"model": "m", "max_output_tokens": 5, "input": "q",
            "text": {"format": {"type": "json_object"}}, "user": "u1", "store": true}));
        assert_eq!(
            out["output_config"],
            json!({"format": {"type": "json_schema", "schema": {"type": "object"}}})
        );
        assert_eq!(out["metadata"], json!({"user_id": "u1"}));
        assert!(out.get("store").is_none());
        let out = exact(json!({"model": "m", "input": "q", "text": {"format": {"type": "text"}}}));
        assert!(out.get("output_config").is_none());
        assert_eq!(out["max_tokens"], 100, "the target's default");
    }

    // --- whole answers -------------------------------------------------------------

    fn whole_value(cx: &AnswerContext, answer: &Value) -> Result<Value, AnswerError> {
        whole(cx, answer.to_string().as_bytes()).map(|b| serde_json::from_slice(&b).unwrap())
    }

    fn golden_caller() -> Value {
        serde_json::from_str(&fixture("request.json")).unwrap()
    }

    #[test]
    fn golden_whole_answer() {
        let answer: Value = serde_json::from_str(&fixture("answer.anthropic.json")).unwrap();
        let got = whole_value(&cx(golden_caller()), &answer).unwrap();
        golden("answer.responses.json", &pretty(&normalised(got)));
    }

    #[test]
    fn golden_streamed_answer() {
        let bytes = fixture("answer.anthropic.sse");
        let events = run_stream(&cx(golden_caller()), bytes.as_bytes(), &[]);
        let mut norm = Normalise::default();
        let mut text = String::new();
        for (name, mut data) in events {
            norm.value(&mut data);
            text.push_str(&format!("event: {name}\ndata: {data}\n\n"));
        }
        golden("answer.responses.sse", &text);
    }

    #[test]
    fn thinking_and_unknown_endings_are_malformed_answers() {
        let cx = cx(caller());
        let answer = |content: Value, stop: Value| {
            json!({"id": "m", "type": "message", "role": "assistant", "model": "c", "content": content,
                   "stop_reason": stop, "usage": {"input_tokens": 1, "output_tokens": 1}})
        };
        let thinking = json!([{"type": "thinking", "thinking": "hm", "signature": "s"}]);
        assert!(whole_value(&cx, &answer(thinking, json!("end_turn"))).is_err());
        let text = json!([{"type": "text", "text": "hi"}]);
        assert!(whole_value(&cx, &answer(text.clone(), json!("pause_turn"))).is_err());
        assert!(whole_value(&cx, &answer(text.clone(), Value::Null)).is_err());
        let got = whole_value(&cx, &answer(text, json!("max_tokens"))).unwrap();
        assert_eq!(got["status"], "incomplete");
        assert_eq!(
            got["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        let empty = json!([{"type": "text", "text": ""}]);
        let got = whole_value(&cx, &answer(empty, json!("end_turn"))).unwrap();
        assert_eq!(got["output"], json!([]));
    }

    // --- streams -------------------------------------------------------------------

    fn start() -> String {
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"c\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n".into()
    }

    #[test]
    fn a_cut_stream_ends_with_an_error_never_a_completion() {
        let cx = cx(caller());
        let bytes = start()
            + "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n";
        let events = run_stream(&cx, bytes.as_bytes(), &[]);
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["response.created", "response.in_progress", "error"]);
        assert_eq!(events[2].1["code"], "upstream_stream_error");
        assert_eq!(events[2].1["sequence_number"], 2);
        assert!(events[2].1["param"].is_null());
    }

    #[test]
    fn an_upstream_error_fails_the_response() {
        let cx = cx(caller());
        let bytes = start()
            + "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"
            + "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let events = run_stream(&cx, bytes.as_bytes(), &[]);
        let (name, data) = events.last().unwrap();
        assert_eq!(name, "response.failed");
        assert_eq!(data["response"]["status"], "failed");
        assert_eq!(
            data["response"]["error"],
            json!({"code": "server_error", "message": "Overloaded"})
        );
        assert_eq!(events.len(), 3);
        // Before anything started, the stream's own error event.
        let bytes = "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"rate_limit_error\",\"message\":\"slow\"}}\n\n";
        let events = run_stream(&cx, bytes.as_bytes(), &[]);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].0, "error");
        assert_eq!(events[0].1["code"], "rate_limit_exceeded");
    }

    #[test]
    fn a_thinking_block_fails_the_stream() {
        let cx = cx(caller());
        let bytes = start()
            + "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n";
        let events = run_stream(&cx, bytes.as_bytes(), &[]);
        assert_eq!(events.last().unwrap().0, "response.failed");
    }

    // --- properties ----------------------------------------------------------------

    #[derive(Debug, Clone)]
    enum GenBlock {
        Text(String, Vec<usize>),
        Tool(String, String, Value, Vec<usize>),
    }

    #[derive(Debug, Clone)]
    struct GenAnswer {
        blocks: Vec<GenBlock>,
        stop_reason: &'static str,
        usage: [u64; 4],
    }

    fn gen_input() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            any::<i32>().prop_map(|n| json!(n)),
            "[a-z é\"\\\\{}]{0,8}".prop_map(Value::String),
            any::<bool>().prop_map(Value::Bool),
        ];
        prop::collection::btree_map("[a-z]{1,4}", leaf, 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect()))
    }

    fn gen_answer() -> impl Strategy<Value = GenAnswer> {
        let cuts = || prop::collection::vec(0usize..64, 0..4);
        let block = prop_oneof![
            ("[a-zé😀 \n\"]{0,16}", cuts()).prop_map(|(t, c)| GenBlock::Text(t, c)),
            (".{1,10}", "[a-z_]{1,8}", gen_input(), cuts()).prop_map(|(id, name, input, c)| {
                GenBlock::Tool(ids::for_anthropic(&id), name, input, c)
            }),
        ];
        (
            prop::collection::vec(block, 0..5),
            prop::sample::select(vec![
                "end_turn",
                "stop_sequence",
                "tool_use",
                "max_tokens",
                "refusal",
                "model_context_window_exceeded",
            ]),
            [0u64..5000, 0u64..5000, 0u64..5000, 0u64..5000],
        )
            .prop_map(|(blocks, stop_reason, usage)| GenAnswer {
                blocks,
                stop_reason,
                usage,
            })
    }

    fn whole_of(a: &GenAnswer) -> Value {
        let content: Vec<Value> = a
            .blocks
            .iter()
            .map(|b| match b {
                GenBlock::Text(t, _) => json!({"type": "text", "text": t}),
                GenBlock::Tool(id, name, input, _) => {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input})
                }
            })
            .collect();
        let [input, output, read, creation] = a.usage;
        json!({"id": "msg_x", "type": "message", "role": "assistant", "model": "claude-x",
               "content": content, "stop_reason": a.stop_reason, "stop_sequence": null,
               "usage": {"input_tokens": input, "output_tokens": output,
                         "cache_read_input_tokens": read, "cache_creation_input_tokens": creation}})
    }

    /// `text` in pieces cut at the char boundaries nearest `cuts`.
    fn pieces(text: &str, cuts: &[usize]) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let mut at: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
        at.sort_unstable();
        at.push(chars.len());
        let mut from = 0;
        at.into_iter()
            .map(|to| {
                let piece: String = chars[from..to].iter().collect();
                from = to;
                piece
            })
            .collect()
    }

    /// The answer as Anthropic streams it.
    fn stream_of(a: &GenAnswer) -> String {
        let mut out = String::new();
        let mut event = |v: Value| {
            let name = v["type"].as_str().unwrap().to_string();
            out.push_str(&format!("event: {name}\ndata: {v}\n\n"));
        };
        let [input, output, read, creation] = a.usage;
        event(
            json!({"type": "message_start", "message": {"id": "msg_x", "type": "message",
            "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null,
            "usage": {"input_tokens": input, "output_tokens": 1,
                      "cache_read_input_tokens": read, "cache_creation_input_tokens": creation}}}),
        );
        for (index, block) in a.blocks.iter().enumerate() {
            match block {
                GenBlock::Text(text, cuts) => {
                    event(json!({"type": "content_block_start", "index": index,
                                 "content_block": {"type": "text", "text": ""}}));
                    for p in pieces(text, cuts) {
                        event(json!({"type": "content_block_delta", "index": index,
                                     "delta": {"type": "text_delta", "text": p}}));
                    }
                }
                GenBlock::Tool(id, name, input, cuts) => {
                    event(json!({"type": "content_block_start", "index": index,
                                 "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}));
                    for p in pieces(&input.to_string(), cuts) {
                        event(json!({"type": "content_block_delta", "index": index,
                                     "delta": {"type": "input_json_delta", "partial_json": p}}));
                    }
                }
            }
            event(json!({"type": "content_block_stop", "index": index}));
            if index % 2 == 1 {
                event(json!({"type": "ping"}));
            }
        }
        event(
            json!({"type": "message_delta", "delta": {"stop_reason": a.stop_reason,
                     "stop_sequence": null}, "usage": {"output_tokens": output}}),
        );
        event(json!({"type": "message_stop"}));
        out
    }

    fn gen_event() -> impl Strategy<Value = Value> {
        let kinds = prop::sample::select(vec![
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
            "error",
            "ping",
            "other",
        ]);
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<u8>().prop_map(|n| json!(n)),
            "[a-z_]{0,10}".prop_map(Value::String),
            Just(json!({"type": "text", "text": "t"})),
            Just(json!({"type": "tool_use", "id": "i", "name": "n", "input": {}})),
            Just(json!({"type": "text_delta", "text": "x"})),
            Just(json!({"type": "input_json_delta", "partial_json": "{"})),
            Just(json!({"model": "m", "usage": {}})),
            Just(json!({"stop_reason": "end_turn"})),
        ];
        let fields = prop::collection::btree_map(
            prop::sample::select(vec![
                "index",
                "content_block",
                "delta",
                "message",
                "usage",
                "error",
            ]),
            leaf,
            0..4,
        );
        (kinds, fields).prop_map(|(kind, fields)| {
            let mut o: Map<String, Value> = fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            o.insert("type".into(), json!(kind));
            Value::Object(o)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn the_stream_folds_to_the_whole_answer(
            a in gen_answer(),
            cuts in prop::collection::vec(any::<usize>(), 0..12),
        ) {
            let cx = cx(caller());
            let whole = normalised(whole_value(&cx, &whole_of(&a)).unwrap());
            let events = run_stream(&cx, stream_of(&a).as_bytes(), &cuts);

            for (i, (name, data)) in events.iter().enumerate() {
                prop_assert_eq!(data["sequence_number"].as_u64(), Some(i as u64), "{}", name);
                prop_assert_eq!(data["type"].as_str(), Some(name.as_str()));
            }
            let (last, done) = events.last().unwrap();
            let expected = if whole["status"] == "completed" { "response.completed" } else { "response.incomplete" };
            prop_assert_eq!(last.as_str(), expected);
            prop_assert_eq!(&normalised(done["response"].clone()), &whole);

            let added: Vec<u64> = events.iter()
                .filter(|(n, _)| n == "response.output_item.added")
                .map(|(_, d)| d["output_index"].as_u64().unwrap())
                .collect();
            prop_assert_eq!(added, (0..whole["output"].as_array().unwrap().len() as u64).collect::<Vec<_>>());

            let output = done["response"]["output"].as_array().unwrap();
            for item in output {
                let id = item["id"].as_str().unwrap();
                let deltas = |kind: &str| -> String {
                    events.iter()
                        .filter(|(n, d)| n == kind && d["item_id"] == id)
                        .map(|(_, d)| d["delta"].as_str().unwrap())
                        .collect()
                };
                match item["type"].as_str().unwrap() {
                    "message" => {
                        let text = deltas("response.output_text.delta");
                        prop_assert_eq!(text.as_str(), item["content"][0]["text"].as_str().unwrap());
                    }
                    _ => {
                        let args = deltas("response.function_call_arguments.delta");
                        let args = if args.is_empty() { "{}".to_string() } else { args };
                        prop_assert_eq!(args.as_str(), item["arguments"].as_str().unwrap());
                    }
                }
            }
        }

        #[test]
        fn arbitrary_events_never_panic_and_end_once(
            events in prop::collection::vec(gen_event(), 0..12),
        ) {
            let cx = cx(caller());
            let mut translator = translator(&cx);
            let mut out = Vec::new();
            for e in &events {
                translator.event(&SseEvent::write(None, e), &mut out);
            }
            translator.finish(&mut out);
            let names: Vec<String> = out.iter().map(|b| {
                let text = std::str::from_utf8(b).unwrap();
                text.lines().next().unwrap().trim_start_matches("event: ").to_string()
            }).collect();
            let terminal = |n: &str| matches!(n, "error" | "response.completed" | "response.incomplete" | "response.failed");
            prop_assert_eq!(names.iter().filter(|n| terminal(n)).count(), 1);
            prop_assert!(terminal(names.last().unwrap()));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let cx = cx(caller());
            let mut translator = translator(&cx);
            let mut splitter = Splitter::default();
            let mut out = Vec::new();
            for e in splitter.push(&bytes).into_iter().chain(splitter.finish()) {
                translator.event(&e, &mut out);
            }
            translator.finish(&mut out);
            prop_assert!(!out.is_empty());
        }

        #[test]
        fn requests_never_panic(caller in gen_input(), items in prop::collection::vec(gen_input(), 0..4)) {
            let mut caller = caller;
            caller["input"] = Value::Array(items);
            let mut judge = Judge::new(&[]);
            let _ = request(caller.as_object().unwrap(), &mut judge, None);
        }
    }
}
