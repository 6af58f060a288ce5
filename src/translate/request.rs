//! Requests, chat completions ⇄ messages, and the judgement of each target: a request
//! is converted field by field, each field the caller sent either carried exactly or
//! reported to the [`Judge`] by its JSON path. An unknown field is a loss too: exact
//! or refused, never silently dropped.

use serde_json::{json, Map, Value};

use super::{ids, Direction, Judge, Untranslatable};
use crate::api::ParsedRequest;

/// What a target's translation may use beyond the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    /// The route's `translate.drop`: top-level fields it allows to be lost.
    pub drop: &'a [String],
    /// The target's `max_tokens`, for an Anthropic target when the caller set none.
    pub max_tokens: Option<u64>,
}

/// A request translated for its target.
#[derive(Debug, Clone)]
pub struct Converted {
    pub json: Map<String, Value>,
    /// Fields lost because the route allowed it (for the response header).
    pub dropped: Vec<String>,
}

/// The caller's request for the target, or the paths it cannot carry.
pub fn convert(
    direction: Direction,
    caller: &ParsedRequest,
    options: Options<'_>,
) -> Result<Converted, Untranslatable> {
    let mut judge = Judge::new(options.drop);
    let json = match direction {
        Direction::ResponsesToMessages => {
            super::responses::request(&caller.json, &mut judge, options.max_tokens)
        }
        Direction::ChatToMessages => chat_to_messages(&caller.json, &mut judge, options.max_tokens),
        Direction::MessagesToChat => {
            let (plain, cache_marked) = anthropic_plain(&caller.json);
            if cache_marked {
                judge.dropped.push("cache_control".into());
            }
            messages_to_chat(&plain, &mut judge)
        }
    };
    if judge.losses.is_empty() {
        Ok(Converted {
            json,
            dropped: judge.dropped,
        })
    } else {
        Err(Untranslatable {
            paths: judge.losses,
        })
    }
}

/// An Anthropic request without what carries nothing across: `null` fields (the SDK's
/// `model_dump()` round trip writes `"citations": null` on text blocks and `"caller":
/// null` on `tool_use` blocks), fields at their documented default (`"is_error": false`
/// on a `tool_result`, as langchain-anthropic and pydantic-ai send it), and
/// `cache_control` marks (top level, system blocks, tools, message blocks), which change
/// the price and never the answer. Read from the blocks of `system`, `tools` and
/// `messages` (tool results' own blocks too), never from inside a tool's input or
/// schema. Also whether a cache mark was dropped (named in
/// `x-backstop-translation-dropped`).
fn anthropic_plain(json: &Map<String, Value>) -> (Map<String, Value>, bool) {
    fn clean(block: &mut Value, marked: &mut bool) {
        let Some(object) = block.as_object_mut() else {
            return;
        };
        object.retain(|_, v| !v.is_null());
        *marked |= object.remove("cache_control").is_some();
        if object.get("type").and_then(Value::as_str) == Some("tool_result")
            && object.get("is_error") == Some(&Value::Bool(false))
        {
            object.remove("is_error");
        }
        if let Some(Value::Array(inner)) = object.get_mut("content") {
            for block in inner {
                clean(block, marked);
            }
        }
    }
    let mut out = json.clone();
    let mut marked = out.remove("cache_control").is_some();
    for key in ["system", "tools"] {
        if let Some(Value::Array(blocks)) = out.get_mut(key) {
            for block in blocks {
                clean(block, &mut marked);
            }
        }
    }
    if let Some(Value::Array(messages)) = out.get_mut("messages") {
        for message in messages {
            if let Some(Value::Array(blocks)) = message.get_mut("content") {
                for block in blocks {
                    clean(block, &mut marked);
                }
            }
        }
    }
    (out, marked)
}

/// Anthropic's sampling temperature range is 0–1 (OpenAI's is 0–2).
const ANTHROPIC_MAX_TEMPERATURE: f64 = 1.0;
/// OpenAI takes at most four stop sequences.
const OPENAI_MAX_STOP: usize = 4;

fn is_blank_text(value: &Value) -> bool {
    value.as_str().is_some_and(|t| t.trim().is_empty())
}

/// An image as Anthropic's source: a `data:` URL becomes a base64 source, an http(s)
/// URL a URL source; `None` for anything else.
fn image_source(url: &str) -> Option<Value> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (media_type, data) = rest.split_once(";base64,")?;
        if media_type.is_empty() || data.is_empty() {
            return None;
        }
        return Some(json!({"type": "base64", "media_type": media_type, "data": data}));
    }
    (url.starts_with("https://") || url.starts_with("http://"))
        .then(|| json!({"type": "url", "url": url}))
}

/// Anthropic's image source as an OpenAI `image_url` URL.
fn image_url(source: &Value) -> Option<String> {
    match source.get("type")?.as_str()? {
        "base64" => Some(format!(
            "data:{};base64,{}",
            source.get("media_type")?.as_str()?,
            source.get("data")?.as_str()?
        )),
        "url" => Some(source.get("url")?.as_str()?.to_string()),
        _ => None,
    }
}

/// Tool arguments (a JSON string) as Anthropic's `input` object: `""` is `{}`.
fn arguments_object(arguments: &str) -> Option<Value> {
    if arguments.trim().is_empty() {
        return Some(json!({}));
    }
    serde_json::from_str::<Value>(arguments)
        .ok()
        .filter(Value::is_object)
}

// ---------------------------------------------------------------------------------
// OpenAI chat completions → Anthropic messages
// ---------------------------------------------------------------------------------

/// Anthropic messages being built: consecutive messages of one role merge (Anthropic
/// takes alternating turns; tool results must lead their user turn).
#[derive(Default)]
struct Turns {
    messages: Vec<(&'static str, Vec<Value>)>,
}

impl Turns {
    fn push(&mut self, role: &'static str, blocks: Vec<Value>) {
        if blocks.is_empty() {
            return;
        }
        match self.messages.last_mut() {
            Some((last, content)) if *last == role => content.extend(blocks),
            _ => self.messages.push((role, blocks)),
        }
    }

    fn into_value(self) -> Value {
        Value::Array(
            self.messages
                .into_iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect(),
        )
    }
}

fn chat_to_messages(
    chat: &Map<String, Value>,
    judge: &mut Judge<'_>,
    max_tokens: Option<u64>,
) -> Map<String, Value> {
    let mut out = Map::new();
    let mut system: Vec<Value> = Vec::new();
    let mut turns = Turns::default();
    let has_tools = chat
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    for (key, value) in chat {
        let path = format!("/{key}");
        match key.as_str() {
            "model" | "stream" => {
                out.insert(key.clone(), value.clone());
            }
            "messages" => {
                let Some(messages) = value.as_array() else {
                    judge.lose(path, key);
                    continue;
                };
                for (i, message) in messages.iter().enumerate() {
                    chat_message(message, i, judge, &mut system, &mut turns);
                }
            }
            "max_tokens" | "max_completion_tokens" => {}
            "temperature" => match value.as_f64() {
                Some(t) if (0.0..=ANTHROPIC_MAX_TEMPERATURE).contains(&t) => {
                    out.insert(key.clone(), value.clone());
                }
                _ if value.is_null() => {}
                _ => judge.lose(path, key),
            },
            "top_p" => {
                if !value.is_null() {
                    out.insert(key.clone(), value.clone());
                }
            }
            "stop" => match value {
                Value::Null => {}
                Value::String(s) => {
                    out.insert("stop_sequences".into(), json!([s]));
                }
                Value::Array(items) if items.iter().all(Value::is_string) => {
                    out.insert("stop_sequences".into(), value.clone());
                }
                _ => judge.lose(path, key),
            },
            "tools" => match chat_tools(value) {
                Some(tools) => {
                    if !tools.is_empty() {
                        out.insert("tools".into(), Value::Array(tools));
                    }
                }
                None => judge.lose(path, key),
            },
            "tool_choice" | "parallel_tool_calls" => {}
            "response_format" => match response_format(value) {
                OutputFormat::Schema(format) => {
                    out.insert("output_config".into(), json!({ "format": format }));
                }
                OutputFormat::Text => {}
                OutputFormat::Untranslatable => judge.lose(path, key),
            },
            "user" | "safety_identifier" => match value.as_str() {
                Some(user) => {
                    out.insert("metadata".into(), json!({ "user_id": user }));
                }
                None if value.is_null() => {}
                None => judge.lose(path, key),
            },
            "n" if value.as_u64() == Some(1) || value.is_null() => {}
            "logprobs" if value.as_bool() != Some(true) => {}
            "store" if value.as_bool() != Some(true) => {}
            "stream_options" if value.is_null() || value.is_object() => {
                // Asked of the answer side: the usage chunk (`include_usage`).
            }
            "metadata" if value.as_object().is_some_and(Map::is_empty) || value.is_null() => {}
            // `n` > 1, logprobs, logit_bias, seed, penalties, audio, modalities,
            // prediction, reasoning_effort, web_search_options, service_tier, a stored
            // completion, metadata, and anything unknown: no exact equivalent.
            _ => judge.lose(path, key),
        }
    }
    let asked = ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .find_map(|f| chat.get(f).filter(|v| !v.is_null()).map(|v| (f, v)));
    match asked
        .map(|(f, v)| (f, v.as_u64()))
        .or(max_tokens.map(|n| ("", Some(n))))
    {
        // Anthropic takes no answer of zero tokens.
        Some((_, Some(n))) if n > 0 => {
            out.insert("max_tokens".into(), json!(n));
        }
        Some((field, _)) if !field.is_empty() => judge.lose(format!("/{field}"), field),
        _ => judge.lose("/max_tokens", "max_tokens"),
    }
    // Claude's current models refuse both sampling knobs at once.
    if [chat.get("temperature"), chat.get("top_p")]
        .iter()
        .all(|v| v.is_some_and(|v| !v.is_null()))
    {
        judge.lose("/top_p", "top_p");
    }
    match (chat.get("user"), chat.get("safety_identifier")) {
        (Some(Value::String(a)), Some(Value::String(b))) if a != b => {
            judge.lose("/safety_identifier", "safety_identifier")
        }
        _ => {}
    }
    if let Some(messages) = chat.get("messages").and_then(Value::as_array) {
        match turns.messages.last() {
            None => judge.lose("/messages", "messages"),
            // A last assistant turn is a prefill to Anthropic (continued), context to
            // OpenAI (answered after): not the same request.
            Some(("assistant", _)) => {
                judge.lose(format!("/messages/{}", messages.len() - 1), "messages")
            }
            Some(_) => {}
        }
    }
    // Without tools a choice has nothing to choose from (and Anthropic refuses one).
    if let Some(choice) = tool_choice_to_anthropic(chat, has_tools, judge).filter(|_| has_tools) {
        out.insert("tool_choice".into(), choice);
    }
    match system.len() {
        0 => {}
        1 => {
            let text = system[0]["text"].clone();
            out.insert("system".into(), text);
        }
        _ => {
            out.insert("system".into(), Value::Array(system));
        }
    }
    out.insert("messages".into(), turns.into_value());
    out
}

/// One chat message into the system blocks or the turns.
fn chat_message(
    message: &Value,
    i: usize,
    judge: &mut Judge<'_>,
    system: &mut Vec<Value>,
    turns: &mut Turns,
) {
    let path = format!("/messages/{i}");
    let Some(fields) = message.as_object() else {
        judge.lose(path, "messages");
        return;
    };
    let role = fields.get("role").and_then(Value::as_str).unwrap_or("");
    let allowed: &[&str] = match role {
        "system" | "developer" | "user" => &["role", "content"],
        "assistant" => &["role", "content", "tool_calls", "refusal"],
        "tool" => &["role", "content", "tool_call_id"],
        _ => &[],
    };
    for key in fields.keys() {
        // `name` has no Anthropic equivalent; a null `refusal`, `audio` or `tool_calls`,
        // or no `annotations` (as OpenAI's own answers carry them), is nothing.
        let nothing = fields[key].is_null()
            || (key == "annotations" && fields[key].as_array().is_some_and(Vec::is_empty));
        if !allowed.contains(&key.as_str()) && !nothing {
            judge.lose(format!("{path}/{key}"), "messages");
        }
    }
    let content = fields.get("content").unwrap_or(&Value::Null);
    match role {
        "system" | "developer" => {
            if !turns.messages.is_empty() {
                // Anthropic takes system text only before the conversation.
                judge.lose(path, "messages");
                return;
            }
            for block in text_blocks(content, &format!("{path}/content"), judge) {
                system.push(block);
            }
        }
        "user" => {
            let blocks = user_blocks(content, &format!("{path}/content"), judge);
            turns.push("user", blocks);
        }
        "assistant" => {
            let mut blocks = text_blocks(content, &format!("{path}/content"), judge);
            if fields.get("refusal").is_some_and(|r| !r.is_null()) {
                judge.lose(format!("{path}/refusal"), "messages");
            }
            if let Some(calls) = fields.get("tool_calls").and_then(Value::as_array) {
                for (j, call) in calls.iter().enumerate() {
                    let at = format!("{path}/tool_calls/{j}");
                    let id = call.get("id").and_then(Value::as_str);
                    let function = call.get("function");
                    let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
                    let input = function
                        .and_then(|f| f.get("arguments"))
                        .and_then(Value::as_str)
                        .and_then(arguments_object);
                    let kind = call
                        .get("type")
                        .and_then(Value::as_str)
                        .unwrap_or("function");
                    match (id, name, input) {
                        (Some(id), Some(name), Some(input)) if kind == "function" => {
                            blocks.push(json!({
                                "type": "tool_use",
                                "id": ids::for_anthropic(id),
                                "name": name,
                                "input": input,
                            }));
                        }
                        _ => judge.lose(at, "messages"),
                    }
                }
            }
            if blocks.is_empty() {
                // An assistant turn with nothing in it: Anthropic refuses empty content,
                // and there is nothing to carry.
                return;
            }
            turns.push("assistant", blocks);
        }
        "tool" => {
            let Some(id) = fields.get("tool_call_id").and_then(Value::as_str) else {
                judge.lose(format!("{path}/tool_call_id"), "messages");
                return;
            };
            let mut result = json!({"type": "tool_result", "tool_use_id": ids::for_anthropic(id)});
            match content {
                Value::String(text) if !text.is_empty() => {
                    result["content"] = json!(text);
                }
                Value::String(_) | Value::Null => {}
                _ => {
                    let blocks = text_blocks(content, &format!("{path}/content"), judge);
                    if !blocks.is_empty() {
                        result["content"] = Value::Array(blocks);
                    }
                }
            }
            // Tool results lead their user turn: a result after user text would be
            // refused, so it goes before it.
            match turns.messages.last_mut() {
                Some(("user", blocks)) => {
                    let at = blocks
                        .iter()
                        .position(|b| b.get("type").and_then(Value::as_str) != Some("tool_result"))
                        .unwrap_or(blocks.len());
                    blocks.insert(at, result);
                }
                _ => turns.push("user", vec![result]),
            }
        }
        _ => judge.lose(format!("{path}/role"), "messages"),
    }
}

/// Text content (a string, or text parts) as text blocks, empty ones omitted.
fn text_blocks(content: &Value, path: &str, judge: &mut Judge<'_>) -> Vec<Value> {
    match content {
        Value::Null => Vec::new(),
        // Anthropic refuses text blocks with no visible text; such text says nothing.
        Value::String(text) if text.trim().is_empty() => Vec::new(),
        Value::String(text) => vec![json!({"type": "text", "text": text})],
        Value::Array(parts) => {
            let mut blocks = Vec::new();
            for (k, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") if part.as_object().is_some_and(|p| p.len() == 2) => {
                        match part.get("text") {
                            Some(text) if is_blank_text(text) => {}
                            Some(Value::String(text)) => {
                                blocks.push(json!({"type": "text", "text": text}))
                            }
                            _ => judge.lose(format!("{path}/{k}"), "messages"),
                        }
                    }
                    _ => judge.lose(format!("{path}/{k}"), "messages"),
                }
            }
            blocks
        }
        _ => {
            judge.lose(path.to_string(), "messages");
            Vec::new()
        }
    }
}

/// A user message's content: text and images.
fn user_blocks(content: &Value, path: &str, judge: &mut Judge<'_>) -> Vec<Value> {
    let Value::Array(parts) = content else {
        return text_blocks(content, path, judge);
    };
    let mut blocks = Vec::new();
    for (k, part) in parts.iter().enumerate() {
        if part.get("type").and_then(Value::as_str) != Some("image_url") {
            let mut lost = Judge::new(&[]);
            blocks.extend(text_blocks(
                &Value::Array(vec![part.clone()]),
                path,
                &mut lost,
            ));
            if !lost.losses.is_empty() {
                judge.lose(format!("{path}/{k}"), "messages");
            }
            continue;
        }
        let image = part.get("image_url");
        let url = image.and_then(|i| i.get("url")).and_then(Value::as_str);
        // `detail` has no Anthropic equivalent beyond the default.
        let detail = image
            .and_then(|i| i.get("detail"))
            .and_then(Value::as_str)
            .unwrap_or("auto");
        match url.and_then(image_source) {
            Some(source) if detail == "auto" => {
                blocks.push(json!({"type": "image", "source": source}))
            }
            _ => judge.lose(format!("{path}/{k}"), "messages"),
        }
    }
    blocks
}

/// OpenAI function tools as Anthropic tools; `None` when one is not a function tool.
fn chat_tools(tools: &Value) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    for tool in tools.as_array()? {
        let object = tool.as_object()?;
        if object.get("type").and_then(Value::as_str) != Some("function")
            || object.keys().any(|k| k != "type" && k != "function")
        {
            return None;
        }
        let function = object.get("function")?.as_object()?;
        let mut converted = Map::new();
        for (key, value) in function {
            match key.as_str() {
                "name" => {
                    converted.insert("name".into(), value.clone());
                }
                "description" => {
                    converted.insert("description".into(), value.clone());
                }
                "parameters" => {
                    converted.insert("input_schema".into(), value.clone());
                }
                "strict" => {
                    if value.as_bool() == Some(true) {
                        converted.insert("strict".into(), json!(true));
                    }
                }
                _ => return None,
            }
        }
        converted
            .entry("input_schema")
            .or_insert(json!({"type": "object"}));
        if !converted.contains_key("name") {
            return None;
        }
        out.push(Value::Object(converted));
    }
    Some(out)
}

/// What a chat `response_format` becomes in an Anthropic request.
enum OutputFormat {
    /// Plain text: Anthropic's default, nothing to send.
    Text,
    /// `output_config.format`.
    Schema(Value),
    /// No equivalent: the judge names it.
    Untranslatable,
}

/// `response_format` as Anthropic's `output_config.format`.
fn response_format(format: &Value) -> OutputFormat {
    let schema = |format: &Value| format.get("json_schema")?.get("schema").cloned();
    match format.get("type").and_then(Value::as_str) {
        Some("text") => OutputFormat::Text,
        // JSON mode is a schema that says "an object".
        Some("json_object") => {
            OutputFormat::Schema(json!({"type": "json_schema", "schema": {"type": "object"}}))
        }
        Some("json_schema") => match schema(format) {
            Some(schema) => OutputFormat::Schema(json!({"type": "json_schema", "schema": schema})),
            None => OutputFormat::Untranslatable,
        },
        _ => OutputFormat::Untranslatable,
    }
}

/// `tool_choice` and `parallel_tool_calls` as Anthropic's `tool_choice`.
fn tool_choice_to_anthropic(
    chat: &Map<String, Value>,
    has_tools: bool,
    judge: &mut Judge<'_>,
) -> Option<Value> {
    let mut choice = match chat.get("tool_choice") {
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
        Some(named) => {
            match named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| named.get("type").and_then(Value::as_str) == Some("function"))
            {
                Some(name) => Some(json!({"type": "tool", "name": name})),
                None => {
                    judge.lose("/tool_choice", "tool_choice");
                    None
                }
            }
        }
    };
    match chat.get("parallel_tool_calls") {
        Some(Value::Bool(false)) if has_tools => {
            let choice = choice.get_or_insert_with(|| json!({"type": "auto"}));
            if choice["type"] != "none" {
                choice["disable_parallel_tool_use"] = json!(true);
            }
        }
        // Parallel calls are the default on both sides; without tools there is none.
        Some(Value::Bool(_)) | None | Some(Value::Null) => {}
        Some(_) => judge.lose("/parallel_tool_calls", "parallel_tool_calls"),
    }
    choice
}

// ---------------------------------------------------------------------------------
// Anthropic messages → OpenAI chat completions
// ---------------------------------------------------------------------------------

fn messages_to_chat(anthropic: &Map<String, Value>, judge: &mut Judge<'_>) -> Map<String, Value> {
    let mut out = Map::new();
    let mut messages: Vec<Value> = Vec::new();
    let has_tools = anthropic
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());
    if let Some(system) = anthropic.get("system") {
        match system {
            Value::String(text) if text.is_empty() => {}
            Value::String(text) => messages.push(json!({"role": "system", "content": text})),
            Value::Array(blocks) => {
                let mut parts = Vec::new();
                for (k, block) in blocks.iter().enumerate() {
                    match plain_text(block) {
                        Some(text) => parts.push(json!({"type": "text", "text": text})),
                        None => judge.lose(format!("/system/{k}"), "system"),
                    }
                }
                if !parts.is_empty() {
                    messages.push(json!({"role": "system", "content": parts}));
                }
            }
            _ => judge.lose("/system", "system"),
        }
    }
    for (key, value) in anthropic {
        let path = format!("/{key}");
        match key.as_str() {
            "model" => {
                out.insert(key.clone(), value.clone());
            }
            "stream" => {
                out.insert(key.clone(), value.clone());
                if value.as_bool() == Some(true) {
                    // The answer side needs the usage for `message_delta`.
                    out.insert("stream_options".into(), json!({"include_usage": true}));
                }
            }
            "system" | "tool_choice" => {}
            "messages" => {
                let Some(list) = value.as_array() else {
                    judge.lose(path, key);
                    continue;
                };
                for (i, message) in list.iter().enumerate() {
                    anthropic_message(message, i, judge, &mut messages);
                }
            }
            // OpenAI's current field: its reasoning models refuse `max_tokens`.
            "max_tokens" => {
                out.insert("max_completion_tokens".into(), value.clone());
            }
            "temperature" | "top_p" => {
                out.insert(key.clone(), value.clone());
            }
            "stop_sequences" => match value.as_array() {
                Some(stops)
                    if stops.len() <= OPENAI_MAX_STOP && stops.iter().all(Value::is_string) =>
                {
                    if !stops.is_empty() {
                        out.insert("stop".into(), value.clone());
                    }
                }
                _ => judge.lose(path, key),
            },
            "tools" => match anthropic_tools(value) {
                Some(tools) => {
                    if !tools.is_empty() {
                        out.insert("tools".into(), Value::Array(tools));
                    }
                }
                None => judge.lose(path, key),
            },
            "output_config" => match value.get("format") {
                Some(format)
                    if value.as_object().is_some_and(|o| o.len() == 1)
                        && format.get("type").and_then(Value::as_str) == Some("json_schema") =>
                {
                    match format.get("schema") {
                        Some(schema) => {
                            out.insert(
                                "response_format".into(),
                                json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": strict_compatible(schema)}}),
                            );
                        }
                        None => judge.lose(path, key),
                    }
                }
                _ => judge.lose(path, key),
            },
            "metadata" => match value.as_object() {
                Some(meta) if meta.keys().all(|k| k == "user_id") => {
                    if let Some(user) = meta.get("user_id").and_then(Value::as_str) {
                        out.insert("user".into(), json!(user));
                    }
                }
                _ => judge.lose(path, key),
            },
            // top_k, thinking, service_tier, container, mcp_servers, context
            // management, and anything unknown: no exact equivalent.
            _ => judge.lose(path, key),
        }
    }
    if let Some(choice) = anthropic.get("tool_choice") {
        tool_choice_to_chat(choice, has_tools, judge, &mut out);
    }
    match anthropic
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
    {
        // A last assistant turn is a prefill Anthropic continues; OpenAI would answer
        // after it instead.
        Some(last) if last.get("role").and_then(Value::as_str) == Some("assistant") => {
            let at = anthropic["messages"].as_array().map_or(0, |m| m.len() - 1);
            judge.lose(format!("/messages/{at}"), "messages");
        }
        None => judge.lose("/messages", "messages"),
        Some(_) => {}
    }
    out.insert("messages".into(), Value::Array(messages));
    out
}

/// Whether OpenAI's strict structured output takes `schema` as it is (every object
/// closed with `additionalProperties: false` and every property required). Anthropic
/// always holds its answer to the schema; OpenAI does so only in strict mode, which
/// refuses any other schema, so the others go non-strict (Backstop's validation still
/// checks the answer against the schema).
fn strict_compatible(schema: &Value) -> bool {
    match schema {
        Value::Object(object) => {
            let closed = object.get("type").and_then(Value::as_str) != Some("object")
                || (object.get("additionalProperties") == Some(&Value::Bool(false))
                    && object
                        .get("properties")
                        .and_then(Value::as_object)
                        .is_none_or(|props| {
                            let required: Vec<&str> = object
                                .get("required")
                                .and_then(Value::as_array)
                                .map(|r| r.iter().filter_map(Value::as_str).collect())
                                .unwrap_or_default();
                            props.keys().all(|k| required.contains(&k.as_str()))
                        }));
            closed && object.values().all(strict_compatible)
        }
        Value::Array(items) => items.iter().all(strict_compatible),
        _ => true,
    }
}

/// A text block's text, when the block is only that (no `cache_control`, no citations).
fn plain_text(block: &Value) -> Option<&str> {
    let object = block.as_object()?;
    if object.get("type")?.as_str()? != "text" || object.len() != 2 {
        return None;
    }
    object.get("text")?.as_str()
}

fn anthropic_message(message: &Value, i: usize, judge: &mut Judge<'_>, out: &mut Vec<Value>) {
    let path = format!("/messages/{i}");
    let Some(fields) = message.as_object() else {
        judge.lose(path, "messages");
        return;
    };
    if fields.keys().any(|k| k != "role" && k != "content") {
        judge.lose(path.clone(), "messages");
    }
    let role = fields.get("role").and_then(Value::as_str).unwrap_or("");
    let content = fields.get("content").unwrap_or(&Value::Null);
    let blocks: Vec<Value> = match content {
        Value::String(text) => vec![json!({"type": "text", "text": text})],
        Value::Array(blocks) => blocks.clone(),
        _ => {
            judge.lose(format!("{path}/content"), "messages");
            return;
        }
    };
    match role {
        "user" => {
            let mut parts = Vec::new();
            for (k, block) in blocks.iter().enumerate() {
                let at = format!("{path}/content/{k}");
                match block.get("type").and_then(Value::as_str) {
                    Some("tool_result") => match tool_message(block) {
                        Some(tool) => out.push(tool),
                        None => judge.lose(at, "messages"),
                    },
                    Some("text") => match plain_text(block) {
                        Some("") => {}
                        Some(text) => parts.push(json!({"type": "text", "text": text})),
                        None => judge.lose(at, "messages"),
                    },
                    Some("image") => {
                        match block
                            .get("source")
                            .and_then(image_url)
                            .filter(|_| block.as_object().is_some_and(|b| b.len() == 2))
                        {
                            Some(url) => {
                                parts.push(json!({"type": "image_url", "image_url": {"url": url}}))
                            }
                            None => judge.lose(at, "messages"),
                        }
                    }
                    // documents, search results, thinking, ...
                    _ => judge.lose(at, "messages"),
                }
            }
            match parts.as_slice() {
                [] => {}
                [only] if only["type"] == "text" => {
                    out.push(json!({"role": "user", "content": only["text"]}))
                }
                _ => out.push(json!({"role": "user", "content": parts})),
            }
        }
        "assistant" => {
            let mut texts: Vec<&str> = Vec::new();
            let mut calls = Vec::new();
            for (k, block) in blocks.iter().enumerate() {
                let at = format!("{path}/content/{k}");
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => match plain_text(block) {
                        // Text after a tool call would be reordered: not exact.
                        Some(t) if t.trim().is_empty() => {}
                        Some(t) if calls.is_empty() => texts.push(t),
                        _ => judge.lose(at, "messages"),
                    },
                    Some("tool_use") => {
                        let id = block
                            .get("id")
                            .and_then(Value::as_str)
                            .and_then(ids::for_openai);
                        let name = block.get("name").and_then(Value::as_str);
                        let input = block.get("input").filter(|i| i.is_object());
                        let only = block.as_object().is_some_and(|b| b.len() == 4);
                        match (id, name, input) {
                            (Some(id), Some(name), Some(input)) if only => calls.push(json!({
                                "id": id,
                                "type": "function",
                                "function": {"name": name, "arguments": input.to_string()},
                            })),
                            _ => judge.lose(at, "messages"),
                        }
                    }
                    // Thinking blocks carry a signature only Anthropic can check.
                    _ => judge.lose(at, "messages"),
                }
            }
            let mut message = json!({"role": "assistant"});
            // One block is a string; several keep their boundaries as text parts.
            message["content"] = match texts.as_slice() {
                [] => Value::Null,
                [one] => json!(one),
                many => many
                    .iter()
                    .map(|t| json!({"type": "text", "text": t}))
                    .collect(),
            };
            if !calls.is_empty() {
                message["tool_calls"] = Value::Array(calls);
            }
            if !texts.is_empty() || message.get("tool_calls").is_some() {
                out.push(message);
            }
        }
        _ => judge.lose(format!("{path}/role"), "messages"),
    }
}

/// A `tool_result` block as an OpenAI `tool` message (text only; `is_error` has no
/// equivalent).
fn tool_message(block: &Value) -> Option<Value> {
    let object = block.as_object()?;
    if object
        .keys()
        .any(|k| !matches!(k.as_str(), "type" | "tool_use_id" | "content"))
    {
        return None;
    }
    let id = ids::for_openai(object.get("tool_use_id")?.as_str()?)?;
    let content = match object.get("content") {
        None => json!(""),
        Some(Value::String(text)) => json!(text),
        Some(Value::Array(blocks)) => {
            let parts = blocks
                .iter()
                .map(|b| plain_text(b).map(|t| json!({"type": "text", "text": t})))
                .collect::<Option<Vec<_>>>()?;
            Value::Array(parts)
        }
        Some(_) => return None,
    };
    Some(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

/// Anthropic custom tools as OpenAI function tools; `None` for a server tool or an
/// option with no equivalent (`cache_control`).
fn anthropic_tools(tools: &Value) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    for tool in tools.as_array()? {
        let object = tool.as_object()?;
        let mut function = Map::new();
        for (key, value) in object {
            match key.as_str() {
                "type" if value.as_str() == Some("custom") => {}
                "name" | "description" => {
                    function.insert(key.clone(), value.clone());
                }
                "input_schema" => {
                    function.insert("parameters".into(), value.clone());
                }
                "strict" => {
                    function.insert("strict".into(), value.clone());
                }
                _ => return None,
            }
        }
        if !function.contains_key("name") || !function.contains_key("parameters") {
            return None;
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Some(out)
}

fn tool_choice_to_chat(
    choice: &Value,
    has_tools: bool,
    judge: &mut Judge<'_>,
    out: &mut Map<String, Value>,
) {
    let Some(object) = choice.as_object() else {
        judge.lose("/tool_choice", "tool_choice");
        return;
    };
    let converted = match object.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("none") => json!("none"),
        Some("any") => json!("required"),
        Some("tool") => match object.get("name").and_then(Value::as_str) {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => {
                judge.lose("/tool_choice/name", "tool_choice");
                return;
            }
        },
        _ => {
            judge.lose("/tool_choice/type", "tool_choice");
            return;
        }
    };
    if object
        .keys()
        .any(|k| !matches!(k.as_str(), "type" | "name" | "disable_parallel_tool_use"))
    {
        judge.lose("/tool_choice", "tool_choice");
    }
    if has_tools {
        out.insert("tool_choice".into(), converted);
        if object
            .get("disable_parallel_tool_use")
            .and_then(Value::as_bool)
            == Some(true)
        {
            out.insert("parallel_tool_calls".into(), json!(false));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Endpoint;
    use proptest::prelude::*;

    fn parsed(endpoint: Endpoint, body: Value) -> ParsedRequest {
        ParsedRequest::parse(endpoint, bytes::Bytes::from(body.to_string())).unwrap()
    }

    fn convert_json(
        direction: Direction,
        body: Value,
        options: Options<'_>,
    ) -> Result<Value, Vec<String>> {
        let caller = parsed(direction.caller_endpoint(), body);
        convert(direction, &caller, options)
            .map(|c| Value::Object(c.json))
            .map_err(|u| u.paths)
    }

    #[test]
    fn a_chat_tool_loop_becomes_anthropic_turns() {
        let chat = json!({
            "model": "gpt-4o",
            "max_completion_tokens": 300,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is in this image, and the weather?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
                ]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "functions.Bash:0", "type": "function", "function": {"name": "now", "arguments": ""}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "functions.Bash:0", "content": "noon"},
                {"role": "user", "content": "Thanks"}
            ],
            "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
                      {"type": "function", "function": {"name": "now", "description": "time", "strict": true}}],
            "tool_choice": "required",
            "parallel_tool_calls": false,
            "stop": "END",
            "temperature": 0.5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "user": "u-1",
            "n": 1
        });
        let got = convert_json(Direction::ChatToMessages, chat, Options::default()).unwrap();
        let encoded = ids::for_anthropic("functions.Bash:0");
        assert_eq!(
            got,
            json!({
                "model": "gpt-4o",
                "max_tokens": 300,
                "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
                "messages": [
                    {"role": "user", "content": [
                        {"type": "text", "text": "What is in this image, and the weather?"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
                        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
                    ]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": encoded, "name": "now", "input": {}}
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"},
                        {"type": "tool_result", "tool_use_id": encoded, "content": "noon"},
                        {"type": "text", "text": "Thanks"}
                    ]}
                ],
                "tools": [{"name": "weather", "input_schema": {"type": "object"}},
                          {"name": "now", "description": "time", "input_schema": {"type": "object"}, "strict": true}],
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                "stop_sequences": ["END"],
                "temperature": 0.5,
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                "metadata": {"user_id": "u-1"}
            })
        );
    }

    #[test]
    fn what_anthropic_cannot_carry_is_named_by_path_unless_the_route_drops_it() {
        let chat = json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "hi", "name": "bob"}],
            "n": 2, "logprobs": true, "top_logprobs": 2, "seed": 7, "logit_bias": {"1": 2},
            "presence_penalty": 0.1, "temperature": 1.5, "audio": {}, "brand_new": 1
        });
        let lost =
            convert_json(Direction::ChatToMessages, chat.clone(), Options::default()).unwrap_err();
        for path in [
            "/max_tokens",
            "/n",
            "/logprobs",
            "/top_logprobs",
            "/seed",
            "/logit_bias",
            "/presence_penalty",
            "/temperature",
            "/audio",
            "/brand_new",
            "/messages/0/name",
        ] {
            assert!(lost.contains(&path.to_string()), "{path} in {lost:?}");
        }
        let drop: Vec<String> = [
            "seed",
            "logprobs",
            "top_logprobs",
            "n",
            "logit_bias",
            "presence_penalty",
            "temperature",
            "audio",
            "brand_new",
            "messages",
        ]
        .map(String::from)
        .into();
        // A part of a message is never dropped (see the test below): only whole fields.
        let mut chat = chat;
        chat["messages"][0].as_object_mut().unwrap().remove("name");
        let caller = parsed(Endpoint::ChatCompletions, chat);
        let converted = convert(
            Direction::ChatToMessages,
            &caller,
            Options {
                drop: &drop,
                max_tokens: Some(64),
            },
        )
        .unwrap();
        assert_eq!(
            converted.json["max_tokens"], 64,
            "the target's max_tokens fills in"
        );
        assert!(converted.dropped.contains(&"seed".to_string()));
        assert!(!converted.json.contains_key("seed"));
    }

    #[test]
    fn an_anthropic_conversation_becomes_chat_messages() {
        let anthropic = json!({
            "model": "claude", "max_tokens": 100, "stream": true,
            "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "text", "text": "and?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}}
                ]}
            ],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}
        });
        let got = convert_json(Direction::MessagesToChat, anthropic, Options::default()).unwrap();
        assert_eq!(
            got,
            json!({
                "model": "claude", "max_completion_tokens": 100, "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Let me look.", "tool_calls": [
                        {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}
                    ]},
                    {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "cold"}]},
                    {"role": "user", "content": [
                        {"type": "text", "text": "and?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}
                    ]}
                ],
                "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
                "tool_choice": "required",
                "parallel_tool_calls": false,
                "stop": ["END"],
                "user": "u",
                "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}, "strict": false}}
            })
        );
    }

    #[test]
    fn what_openai_cannot_carry_is_named_by_path() {
        let anthropic = json!({
            "model": "claude", "max_tokens": 10, "top_k": 5, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "system": [{"type": "text", "text": "A", "x_future": {"n": 1}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "text", "text": "ok"}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": true}]}
            ],
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "stop_sequences": ["a", "b", "c", "d", "e"]
        });
        let lost =
            convert_json(Direction::MessagesToChat, anthropic, Options::default()).unwrap_err();
        for path in [
            "/top_k",
            "/thinking",
            "/system/0",
            "/messages/1/content/0",
            "/messages/2/content/0",
            "/tools",
            "/stop_sequences",
        ] {
            assert!(lost.contains(&path.to_string()), "{path} in {lost:?}");
        }
    }

    #[test]
    fn nulls_defaults_and_cache_marks_carry_nothing_across() {
        // As the Anthropic SDK's model_dump() round trip, langchain-anthropic and a
        // prompt-caching agent send them.
        let anthropic = json!({
            "model": "claude", "max_tokens": 10,
            "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"default": null}}},
                       "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "citations": null,
                    "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look.", "citations": null},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": null},
                     "caller": null}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": false,
                     "content": [{"type": "text", "text": "ok", "citations": null}]}]}
            ]
        });
        let body = parsed(Endpoint::Messages, anthropic);
        let converted = convert(Direction::MessagesToChat, &body, Options::default()).unwrap();
        assert_eq!(converted.dropped, ["cache_control"]);
        let messages = &converted.json["messages"];
        assert_eq!(
            messages[0],
            json!({"role": "system", "content": [{"type": "text", "text": "A"}]})
        );
        assert_eq!(messages[1], json!({"role": "user", "content": "hi"}));
        // A null inside a tool's input or schema is the caller's data: kept.
        assert_eq!(
            messages[2]["tool_calls"][0]["function"]["arguments"],
            "{\"x\":null}"
        );
        assert_eq!(
            converted.json["tools"][0]["function"]["parameters"]["properties"]["x"],
            json!({"default": null})
        );
        assert_eq!(
            messages[3],
            json!({"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "ok"}]})
        );
        // An error result has no OpenAI equivalent: a named loss.
        let failed = json!({"model": "claude", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": true, "content": "boom"}]}]});
        let lost = convert_json(Direction::MessagesToChat, failed, Options::default()).unwrap_err();
        assert_eq!(lost, ["/messages/2/content/0"]);
    }

    #[test]
    fn what_would_change_meaning_is_refused_even_where_it_looks_harmless() {
        let user = || json!({"role": "user", "content": "hi"});
        let chat = |extra: Value| {
            let mut body = json!({"model": "m", "max_tokens": 10, "messages": [user()]});
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            convert_json(Direction::ChatToMessages, body, Options::default())
        };
        // A last assistant turn, no turn at all, both sampling knobs, two different users.
        let trailing = json!({"messages": [user(), {"role": "assistant", "content": "Sure"}]});
        assert_eq!(chat(trailing).unwrap_err(), ["/messages/1"]);
        let none = json!({"messages": [{"role": "system", "content": "Say hi"}]});
        assert_eq!(chat(none).unwrap_err(), ["/messages"]);
        assert_eq!(
            chat(json!({"temperature": 0.5, "top_p": 0.9})).unwrap_err(),
            ["/top_p"]
        );
        let users = json!({"user": "a", "safety_identifier": "b"});
        assert_eq!(chat(users).unwrap_err(), ["/safety_identifier"]);
        assert_eq!(chat(json!({"max_tokens": 0})).unwrap_err(), ["/max_tokens"]);
        // A null cap is no cap: the other field counts.
        let null_cap = chat(json!({"max_completion_tokens": null, "max_tokens": 77})).unwrap();
        assert_eq!(null_cap["max_tokens"], 77);
        // What OpenAI's own answers carry, replayed, is nothing to lose; blank text is
        // no text block (Anthropic refuses those).
        let replayed = json!({"messages": [user(), {"role": "assistant", "content": "\n\n",
            "annotations": [], "audio": null, "refusal": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]});
        let got = chat(replayed).unwrap();
        assert_eq!(
            got["messages"][1]["content"],
            json!([{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}])
        );
    }

    #[test]
    fn a_route_drops_only_whole_top_level_fields_the_target_can_do_without() {
        let drop: Vec<String> = ["messages", "max_tokens", "seed"].map(String::from).into();
        let body = json!({"model": "m", "seed": 1, "messages": [
            {"role": "user", "content": "hi", "name": "bob"}]});
        let caller = parsed(Endpoint::ChatCompletions, body);
        let lost = convert(
            Direction::ChatToMessages,
            &caller,
            Options {
                drop: &drop,
                max_tokens: None,
            },
        )
        .unwrap_err();
        assert_eq!(lost.paths, ["/messages/0/name", "/max_tokens"]);
    }

    #[test]
    fn openai_gets_strict_output_only_for_a_schema_strict_mode_takes() {
        let closed = json!({"type": "object", "properties": {"a": {"type": "string"}},
            "required": ["a"], "additionalProperties": false});
        let open = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        for (schema, strict) in [(closed, true), (open, false)] {
            let body = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "json_schema", "schema": schema}}});
            let got = convert_json(Direction::MessagesToChat, body, Options::default()).unwrap();
            assert_eq!(got["response_format"]["json_schema"]["strict"], strict);
        }
        // An Anthropic prefill is not an OpenAI turn.
        let prefill = json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "{"}]});
        assert_eq!(
            convert_json(Direction::MessagesToChat, prefill, Options::default()).unwrap_err(),
            ["/messages/1"]
        );
    }

    /// A chat request in the form a round trip keeps (one leading system string, string
    /// user turns, compact arguments, stop as a list, no stream).
    fn chat_request() -> impl Strategy<Value = Value> {
        let text = "[a-zA-Z0-9.,!?][a-zA-Z0-9 .,!?]{0,11}";
        let args = proptest::collection::btree_map("[a-z]{1,4}", 0i64..100, 0..3)
            .prop_map(|m| serde_json::to_string(&m).unwrap());
        let call = ("[a-zA-Z0-9_.:]{1,12}", "[a-z]{1,6}", args);
        let exchange = (
            text,
            proptest::collection::vec(call, 0..3),
            proptest::option::of(text),
            text,
        )
            .prop_map(|(user, calls, reply, result)| {
                let mut turn = vec![json!({"role": "user", "content": user})];
                let mut assistant = json!({"role": "assistant"});
                assistant["content"] = reply.map_or(Value::Null, |r| json!(r));
                let ids: Vec<String> = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| format!("{}{i}", c.0))
                    .collect();
                if !calls.is_empty() {
                    assistant["tool_calls"] = calls.iter().zip(&ids).map(|(c, id)| json!({
                        "id": id, "type": "function", "function": {"name": c.1, "arguments": c.2}
                    })).collect();
                }
                if assistant["content"].is_null() && calls.is_empty() {
                    // Two user turns in a row are one Anthropic turn: not generated.
                    assistant["content"] = json!("ok");
                }
                turn.push(assistant);
                for id in &ids {
                    turn.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
                }
                turn
            });
        (
            proptest::option::of(text),
            proptest::collection::vec(exchange, 1..4),
            1u64..4096,
            proptest::option::of((0u32..=100).prop_map(|n| f64::from(n) / 100.0)),
            proptest::option::of(proptest::collection::vec("[A-Z]{1,3}", 1..4)),
            proptest::option::of(prop_oneof![Just("auto"), Just("none"), Just("required")]),
            any::<bool>(),
        )
            .prop_map(|(system, exchanges, max_tokens, temperature, stop, choice, serial)| {
                let mut messages = Vec::new();
                if let Some(system) = system {
                    messages.push(json!({"role": "system", "content": system}));
                }
                for turn in exchanges {
                    messages.extend(turn);
                }
                // A last assistant turn would be a prefill: the conversation ends with the user.
                messages.push(json!({"role": "user", "content": "go on"}));
                let mut body = json!({"model": "m", "messages": messages, "max_completion_tokens": max_tokens,
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
                if let Some(t) = temperature { body["temperature"] = json!(t); }
                if let Some(stop) = stop { body["stop"] = json!(stop); }
                if let Some(choice) = choice { body["tool_choice"] = json!(choice); }
                if serial { body["parallel_tool_calls"] = json!(false); }
                body
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn chat_to_messages_and_back_is_the_same_request(chat in chat_request()) {
            let messages = convert_json(Direction::ChatToMessages, chat.clone(), Options::default());
            let messages = messages.map_err(|p| TestCaseError::fail(format!("lost {p:?}")))?;
            let back = convert_json(Direction::MessagesToChat, messages, Options::default());
            let back = back.map_err(|p| TestCaseError::fail(format!("lost back {p:?}")))?;
            // The documented normalisation: serial calls with no choice are serial calls
            // with `auto` (the default), and with `none` there are no calls to serialise.
            let mut expected = chat;
            if expected.get("parallel_tool_calls").is_some() {
                match expected.get("tool_choice").and_then(Value::as_str) {
                    None => expected["tool_choice"] = json!("auto"),
                    Some("none") => { expected.as_object_mut().unwrap().remove("parallel_tool_calls"); }
                    Some(_) => {}
                }
            }
            prop_assert_eq!(back, expected);
        }

        #[test]
        fn any_json_is_judged_never_a_panic(body in arbitrary_json(3)) {
            let mut object = match body { Value::Object(o) => o, other => { let mut m = Map::new(); m.insert("messages".into(), other); m } };
            object.insert("model".into(), json!("m"));
            for direction in [Direction::ChatToMessages, Direction::MessagesToChat, Direction::ResponsesToMessages] {
                if let Ok(caller) = ParsedRequest::parse(direction.caller_endpoint(), bytes::Bytes::from(Value::Object(object.clone()).to_string())) {
                    let _ = convert(direction, &caller, Options::default());
                }
            }
        }
    }

    fn arbitrary_json(depth: u32) -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (-5i64..5000).prop_map(|n| json!(n)),
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("system"),
                Just("tool"),
                Just("text"),
                Just("tool_use"),
                Just("tool_result"),
                Just("image_url"),
                Just("function"),
                Just(""),
                Just("data:image/png;base64,AA")
            ]
            .prop_map(|s| json!(s)),
        ];
        leaf.prop_recursive(depth, 64, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("role"),
                        Just("content"),
                        Just("type"),
                        Just("text"),
                        Just("messages"),
                        Just("tool_calls"),
                        Just("id"),
                        Just("function"),
                        Just("arguments"),
                        Just("name"),
                        Just("input"),
                        Just("tool_use_id"),
                        Just("tools"),
                        Just("tool_choice"),
                        Just("system"),
                        Just("image_url"),
                        Just("url"),
                        Just("source"),
                        Just("stop"),
                        Just("max_tokens"),
                        Just("input_schema"),
                        Just("parameters")
                    ]
                    .prop_map(String::from),
                    inner,
                    0..4,
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
