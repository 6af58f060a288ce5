//! What a fleet failure signature ([`crate::policy::fleet`]) reads of a request, from the
//! wire shapes of the three APIs: its normalised [`Shape`] (the system prompt's hash and
//! the last user message's template, numbers and ids masked), the hash of the output
//! contract it asked for, and the last tool result in its history. Read on the failure
//! path, and on the success path only while the tenant has a hot signature or a
//! prediction pending: a healthy tenant's successes hash nothing here.
//!
//! The normalisation (docs/fleet-prediction.md gives it in full):
//! - the system prompt is the chat `system`/`developer` messages' text, Anthropic's
//!   `system`, the Responses API's `instructions` and its `system`/`developer` input
//!   items, joined by newlines;
//! - the last user message is the last `user` message (or input item) with text; a
//!   Responses `input` string is one;
//! - each is [`mask`]ed: its first [`NORMALISED_BYTES`] bytes, ASCII lower-cased,
//!   whitespace runs made one space, and every word (letters, digits, `_`, `-`) that holds
//!   a digit replaced by `#`, and `#` runs joined by `.`, `,`, `:` or `/` made one `#`:
//!   numbers, dates, times, UUIDs, request and call ids all read `#`.

use serde_json::{Map, Value};

use super::{fingerprint::HashWriter, tool_calls::text_of, Endpoint};
use crate::policy::fleet::{xxh3, Shape};

/// How much of the system prompt and of the last user message is normalised: enough to
/// tell templates apart, and a bound on the work for a long one.
pub const NORMALISED_BYTES: usize = 4096;

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == '-'
}

/// `text`'s template: see the module doc.
pub fn mask(text: &str) -> String {
    let mut end = text.len().min(NORMALISED_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut rest = &text[..end];
    let mut out = String::with_capacity(rest.len());
    let mut space = false;
    while let Some(c) = rest.chars().next() {
        if c.is_whitespace() {
            space = !out.is_empty();
            rest = &rest[c.len_utf8()..];
            continue;
        }
        if space {
            out.push(' ');
            space = false;
        }
        if !is_word(c) {
            out.push(c);
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let len = rest.find(|c: char| !is_word(c)).unwrap_or(rest.len());
        let (word, after) = rest.split_at(len);
        rest = after;
        if !word.bytes().any(|b| b.is_ascii_digit()) {
            out.push_str(word);
            continue;
        }
        // `#` after `#.` (or `,` `:` `/`) is the same number or id going on.
        let joined = out.ends_with(['.', ',', ':', '/']) && out[..out.len() - 1].ends_with('#');
        if joined {
            out.pop();
        } else {
            out.push('#');
        }
    }
    out.make_ascii_lowercase();
    out
}

fn role(item: &Value) -> Option<&str> {
    item.get("role").and_then(Value::as_str)
}

/// The request's messages (chat, Anthropic) or input items (Responses).
fn items(json: &Map<String, Value>) -> &[Value] {
    json.get("messages")
        .or_else(|| json.get("input"))
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
}

/// The system prompt's text, as the module doc says.
pub fn system_text(json: &Map<String, Value>) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(system) = json.get("system") {
        parts.push(text_of(Some(system)));
    }
    if let Some(Value::String(instructions)) = json.get("instructions") {
        parts.push(instructions.clone());
    }
    for item in items(json) {
        if matches!(role(item), Some("system" | "developer")) {
            parts.push(text_of(item.get("content")));
        }
    }
    parts.join("\n")
}

/// The last user message's text, as the module doc says.
pub fn last_user_text(json: &Map<String, Value>) -> String {
    if let Some(Value::String(input)) = json.get("input") {
        return input.clone();
    }
    items(json)
        .iter()
        .rev()
        .filter(|item| role(item) == Some("user"))
        .map(|item| text_of(item.get("content")))
        .find(|text| !text.trim().is_empty())
        .unwrap_or_default()
}

/// The request's shape on `route` (its `model` pattern) at `endpoint`.
pub fn shape(route: &str, endpoint: Endpoint, json: &Map<String, Value>) -> Shape {
    let model = json
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let system = xxh3(mask(&system_text(json)).as_bytes());
    let template = mask(&last_user_text(json));
    let endpoint = endpoint.path();
    Shape {
        key: Shape::key_of(route, &model, endpoint, system, &template),
        route: route.to_string(),
        model,
        endpoint,
        system,
        template,
    }
}

/// XXH3-64 of the output contract the request asked for: each of `response_format`
/// (chat), `text` (Responses) and `tools` present, its key then the JSON serde_json
/// writes for it. `None` when it asked for none.
pub fn contract_hash(json: &Map<String, Value>) -> Option<u64> {
    let mut hasher = HashWriter(xxhash_rust::xxh3::Xxh3::with_seed(0));
    let mut any = false;
    for key in ["response_format", "text", "tools"] {
        if let Some(value) = json.get(key) {
            any = true;
            hasher.0.update(key.as_bytes());
            let _ = serde_json::to_writer(&mut hasher, value);
        }
    }
    any.then(|| hasher.0.digest())
}

/// The last tool result in the request's history: the tool's name (when its call is
/// found) and XXH3-64 of the result's text. Chat `tool` messages, Anthropic
/// `tool_result` blocks, Responses `function_call_output` items.
pub fn last_tool_result(json: &Map<String, Value>) -> Option<(Option<String>, u64)> {
    let items = items(json);
    let (call_id, result) = items.iter().rev().find_map(|item| {
        if role(item) == Some("tool") {
            let id = item.get("tool_call_id").and_then(Value::as_str);
            return Some((id, text_of(item.get("content"))));
        }
        if item.get("type").and_then(Value::as_str) == Some("function_call_output") {
            let id = item.get("call_id").and_then(Value::as_str);
            return Some((id, text_of(item.get("output"))));
        }
        item.get("content")
            .and_then(Value::as_array)?
            .iter()
            .rev()
            .find(|block| block.get("type").and_then(Value::as_str) == Some("tool_result"))
            .map(|block| {
                let id = block.get("tool_use_id").and_then(Value::as_str);
                (id, text_of(block.get("content")))
            })
    })?;
    let name = call_id.and_then(|id| tool_name(items, id));
    Some((name, xxh3(result.as_bytes())))
}

/// The name of the tool call `id`, in any of the three APIs' shapes.
fn tool_name(items: &[Value], id: &str) -> Option<String> {
    let name = |v: &Value, key: &str| v.pointer(key).and_then(Value::as_str).map(str::to_string);
    items.iter().find_map(|item| {
        if item.get("call_id").and_then(Value::as_str) == Some(id) {
            return name(item, "/name");
        }
        let calls = item.get("tool_calls").and_then(Value::as_array);
        if let Some(call) = calls
            .into_iter()
            .flatten()
            .find(|c| c.get("id").and_then(Value::as_str) == Some(id))
        {
            return name(call, "/function/name");
        }
        let blocks = item.get("content").and_then(Value::as_array);
        blocks
            .into_iter()
            .flatten()
            .find(|b| {
                b.get("type").and_then(Value::as_str) == Some("tool_use")
                    && b.get("id").and_then(Value::as_str) == Some(id)
            })
            .and_then(|b| name(b, "/name"))
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn masking_keeps_the_words_and_hides_numbers_and_ids() {
        assert_eq!(
            mask("  Summarize   session 8f3a2c1e-77b0-4c2e-9a71-0d5b6f1e2a3b\n(182,344 tokens) at 12:30:05 on 2025-01-03, v3.14.1 -> call_Ab12Cd!  "),
            "summarize session # (# tokens) at # on #, # -> #!"
        );
        // Words without a digit are kept, case folded; punctuation stays.
        assert_eq!(
            mask("Please RETRY: the build/test step."),
            "please retry: the build/test step."
        );
        // The same template with other numbers and ids is the same text.
        assert_eq!(
            mask("Compact the 54 messages of run r-1029 into 2000 words"),
            mask("Compact the 131 messages of run r-77 into 500 words")
        );
        assert_ne!(mask("compact the history"), mask("compact the summary"));
        // Only the first NORMALISED_BYTES count, cut at a character boundary.
        let long = format!("{}é and more", "a".repeat(NORMALISED_BYTES - 1));
        assert_eq!(mask(&long), "a".repeat(NORMALISED_BYTES - 1));
        assert_eq!(mask(""), "");
        assert_eq!(mask("Ünïcode wörds 42"), "Ünïcode wörds #");
    }

    #[test]
    fn the_system_prompt_and_last_user_message_are_found_in_each_api() {
        let chat = object(json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": "You are agent 7."},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "Summarize run 42"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
        ]}));
        assert_eq!(system_text(&chat), "You are agent 7.");
        assert_eq!(last_user_text(&chat), "Summarize run 42");
        let anthropic = object(
            json!({"model": "claude", "system": [{"type": "text", "text": "Be brief"}], "messages": [
                {"role": "user", "content": "Summarize run 43"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "none"}]},
            ]}),
        );
        assert_eq!(system_text(&anthropic), "Be brief");
        // A user turn holding only tool results has no text: the one before is taken.
        assert_eq!(last_user_text(&anthropic), "Summarize run 43");
        let responses = object(
            json!({"model": "gpt-4o", "instructions": "Be kind", "input": [
                {"role": "developer", "content": "Rules"},
                {"role": "user", "content": [{"type": "input_text", "text": "Summarize run 44"}]},
            ]}),
        );
        assert_eq!(system_text(&responses), "Be kind\nRules");
        assert_eq!(last_user_text(&responses), "Summarize run 44");
        let plain = object(json!({"model": "gpt-4o", "input": "just this"}));
        assert_eq!(last_user_text(&plain), "just this");
        // Same template, same system prompt: one shape across the three sessions' runs.
        let a = shape("gpt-*", Endpoint::ChatCompletions, &chat);
        let mut other = chat.clone();
        other["messages"][3]["content"][0]["text"] = json!("Summarize run 9001");
        other["messages"][0]["content"] = json!("You are agent 12.");
        assert_eq!(shape("gpt-*", Endpoint::ChatCompletions, &other).key, a.key);
        assert_eq!(a.template, "summarize run #");
        assert_ne!(shape("gpt-*", Endpoint::Responses, &chat).key, a.key);
        assert_ne!(shape("other", Endpoint::ChatCompletions, &chat).key, a.key);
    }

    /// The shape key is pinned: replicas and releases must agree on it. The values are
    /// the reference XXH3-64's: `printf '%s' 'you are agent #.' | xxhsum -H3`, then
    /// `printf 'shape/1\ngpt-*\ngpt-4o\n/v1/chat/completions\ne65b93a830ecd92c\nsummarize run #' | xxhsum -H3`.
    #[test]
    fn the_shape_of_a_fixed_request_is_pinned() {
        let chat = object(json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": "You are agent 7."},
            {"role": "user", "content": "Summarize run 42"},
        ]}));
        let s = shape("gpt-*", Endpoint::ChatCompletions, &chat);
        assert_eq!(s.system, xxh3(b"you are agent #."));
        assert_eq!(format!("{:016x}", s.system), "e65b93a830ecd92c");
        assert_eq!(format!("{}", s.key), "2b9716878336f298");
    }

    #[test]
    fn the_output_contract_and_the_last_tool_result_are_hashed() {
        let with = object(json!({"model": "m", "response_format": {"type": "json_object"}}));
        let without = object(json!({"model": "m"}));
        assert!(contract_hash(&with).is_some());
        assert_eq!(contract_hash(&without), None);
        let chat = object(json!({"model": "m", "messages": [
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Error: city not found"},
        ]}));
        assert_eq!(
            last_tool_result(&chat),
            Some((Some("get_weather".into()), xxh3(b"Error: city not found")))
        );
        let anthropic = object(json!({"model": "m", "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "nothing"}]},
        ]}));
        assert_eq!(
            last_tool_result(&anthropic),
            Some((Some("search".into()), xxh3(b"nothing")))
        );
        let responses = object(json!({"model": "m", "input": [
            {"type": "function_call", "call_id": "f1", "name": "lookup", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "f1", "output": "denied"},
        ]}));
        assert_eq!(
            last_tool_result(&responses),
            Some((Some("lookup".into()), xxh3(b"denied")))
        );
        assert_eq!(last_tool_result(&without), None);
    }
}
