//! Tool calls and their results as the three APIs carry them, for the side-effect
//! journal ([`crate::policy::side_effects`]): the calls a request's conversation holds
//! and the results it feeds back, and the calls a whole answer proposes.
//!
//! - chat: an assistant message's `tool_calls[]` (`id`, `function.name`,
//!   `function.arguments`), answered by a `role: "tool"` message's `tool_call_id`;
//! - Anthropic messages: `tool_use` blocks (`id`, `name`, `input`), answered by
//!   `tool_result` blocks' `tool_use_id` (`is_error`);
//! - Responses: `function_call` items (`call_id`, `name`, `arguments`), answered by
//!   `function_call_output` items' `call_id`.

use serde_json::{Map, Value};

use super::Endpoint;

/// The text of a message's `content`: a string, or its parts' `text` joined.
pub(crate) fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// A tool call: its id, its tool, and its arguments as JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub tool: String,
    pub args: String,
}

/// A tool's result fed back: the call it answers, its text, and whether the API's own
/// flag says it failed (Anthropic's `is_error`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    pub call_id: String,
    pub content: String,
    pub is_error: bool,
}

fn text(value: Option<&Value>, key: &str) -> Option<String> {
    value?.get(key)?.as_str().map(str::to_owned)
}

/// An Anthropic `tool_use` block's call.
fn tool_use(block: &Value) -> Option<ToolCall> {
    Some(ToolCall {
        id: text(Some(block), "id")?,
        tool: text(Some(block), "name")?,
        args: block
            .get("input")
            .map_or_else(|| "{}".into(), Value::to_string),
    })
}

/// A Responses `function_call` item's call.
fn function_call(item: &Value) -> Option<ToolCall> {
    Some(ToolCall {
        id: text(Some(item), "call_id")?,
        tool: text(Some(item), "name")?,
        args: text(Some(item), "arguments").unwrap_or_default(),
    })
}

/// A chat `tool_calls[]` entry's call.
fn chat_call(call: &Value) -> Option<ToolCall> {
    Some(ToolCall {
        id: text(Some(call), "id")?,
        tool: text(call.get("function"), "name")?,
        args: text(call.get("function"), "arguments").unwrap_or_default(),
    })
}

/// The calls a request's conversation holds and the results it feeds back, in order.
pub fn conversation(
    endpoint: Endpoint,
    json: &Map<String, Value>,
) -> (Vec<ToolCall>, Vec<ToolResult>) {
    let (mut calls, mut results) = (Vec::new(), Vec::new());
    let items = |key: &str| {
        json.get(key)
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
    };
    match endpoint {
        Endpoint::Responses => {
            for item in items("input") {
                match item.get("type").and_then(Value::as_str) {
                    Some("function_call") => calls.extend(function_call(item)),
                    Some("function_call_output") => {
                        if let Some(call_id) = text(Some(item), "call_id") {
                            results.push(ToolResult {
                                call_id,
                                content: text_of(item.get("output")),
                                is_error: false,
                            });
                        }
                    }
                    _ => {}
                }
            }
        }
        _ => {
            for message in items("messages") {
                for call in message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    calls.extend(chat_call(call));
                }
                if message.get("role").and_then(Value::as_str) == Some("tool") {
                    if let Some(call_id) = text(Some(message), "tool_call_id") {
                        results.push(ToolResult {
                            call_id,
                            content: text_of(message.get("content")),
                            is_error: false,
                        });
                    }
                }
                for block in message
                    .get("content")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    match block.get("type").and_then(Value::as_str) {
                        Some("tool_use") => calls.extend(tool_use(block)),
                        Some("tool_result") => {
                            if let Some(call_id) = text(Some(block), "tool_use_id") {
                                results.push(ToolResult {
                                    call_id,
                                    content: text_of(block.get("content")),
                                    is_error: block
                                        .get("is_error")
                                        .and_then(Value::as_bool)
                                        .unwrap_or(false),
                                });
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    (calls, results)
}

/// The calls a whole answer of `endpoint` proposes.
pub fn proposed(endpoint: Endpoint, answer: &Value) -> Vec<ToolCall> {
    fn list(value: Option<&Value>) -> std::slice::Iter<'_, Value> {
        value
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice)
            .iter()
    }
    match endpoint {
        Endpoint::Responses => list(answer.get("output"))
            .filter(|i| i.get("type").and_then(Value::as_str) == Some("function_call"))
            .filter_map(function_call)
            .collect(),
        Endpoint::Messages => list(answer.get("content"))
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
            .filter_map(tool_use)
            .collect(),
        _ => list(answer.get("choices"))
            .flat_map(|c| list(c.pointer("/message/tool_calls")))
            .filter_map(chat_call)
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_chat_conversation_pairs_its_calls_and_tool_messages() {
        let request = object(json!({"messages": [
            {"role": "user", "content": "mail bob"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "send_email", "arguments": "{\"to\":\"bob\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sent"}]}
        ]}));
        let (calls, results) = conversation(Endpoint::ChatCompletions, &request);
        assert_eq!(
            calls,
            [ToolCall {
                id: "call_1".into(),
                tool: "send_email".into(),
                args: r#"{"to":"bob"}"#.into()
            }]
        );
        assert_eq!(
            results,
            [ToolResult {
                call_id: "call_1".into(),
                content: "sent".into(),
                is_error: false
            }]
        );
        let answer = json!({"choices": [{"message": {"tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "send_email", "arguments": "{}"}}]}}]});
        assert_eq!(proposed(Endpoint::ChatCompletions, &answer)[0].id, "call_2");
    }

    #[test]
    fn an_anthropic_conversation_pairs_tool_use_and_tool_result_blocks() {
        let request = object(json!({"messages": [
            {"role": "assistant", "content": [
                {"type": "text", "text": "sending"},
                {"type": "tool_use", "id": "toolu_1", "name": "send_email", "input": {"to": "bob"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "bounced", "is_error": true}]}
        ]}));
        let (calls, results) = conversation(Endpoint::Messages, &request);
        assert_eq!(calls[0].args, r#"{"to":"bob"}"#);
        assert_eq!(
            results,
            [ToolResult {
                call_id: "toolu_1".into(),
                content: "bounced".into(),
                is_error: true
            }]
        );
        let answer =
            json!({"content": [{"type": "tool_use", "id": "toolu_2", "name": "x", "input": {}}]});
        assert_eq!(proposed(Endpoint::Messages, &answer)[0].tool, "x");
    }

    #[test]
    fn a_responses_input_pairs_function_calls_and_their_outputs() {
        let request = object(json!({"input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c1", "name": "transfer_funds", "arguments": "{\"usd\":5}"},
            {"type": "function_call_output", "call_id": "c1", "output": "{\"ok\":true}"}
        ]}));
        let (calls, results) = conversation(Endpoint::Responses, &request);
        assert_eq!(
            (calls[0].id.as_str(), calls[0].tool.as_str()),
            ("c1", "transfer_funds")
        );
        assert_eq!(results[0].content, r#"{"ok":true}"#);
        let answer = json!({"output": [
            {"type": "message", "content": []},
            {"type": "function_call", "call_id": "c2", "name": "transfer_funds", "arguments": "{}"}]});
        assert_eq!(proposed(Endpoint::Responses, &answer)[0].id, "c2");
        assert!(proposed(Endpoint::Responses, &json!({"output": "?"})).is_empty());
    }
}
