//! Reading a streamed answer as it arrives, in each API's event format: which events
//! belong to which tool call, when a call's arguments are complete, and the answer
//! assembled so far in its non-streaming shape (so [`super::Expectations::check`] judges
//! a stream exactly as it judges a whole answer).
//!
//! Tool calls are keyed by the index the API gives them: OpenAI chat `tool_calls[].index`,
//! Anthropic's content block `index`, the Responses API's `output_index`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::wire::sse::SseEvent;
use crate::wire::Wire;

/// One tool call being streamed.
#[derive(Debug, Clone, Default)]
struct Call {
    name: String,
    id: Option<String>,
    args: String,
    complete: bool,
}

/// What one event is, for holding and releasing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Read {
    /// The tool call this event belongs to.
    pub call: Option<u64>,
    /// Calls whose arguments this event completed.
    pub completed: Vec<u64>,
    /// The stream's closing event (`[DONE]`, `message_stop`, `response.completed`):
    /// what a verdict on the whole answer must come before.
    pub terminal: bool,
    /// An opening event that says nothing yet (`response.created`, `message_start`, a
    /// chat chunk with only the role): held back with what follows it, so an answer
    /// whose first content is refused was never begun for the client.
    pub opening: bool,
}

/// A streamed answer, assembled event by event.
#[derive(Debug, Clone)]
pub struct Assembler {
    format: Wire,
    text: String,
    calls: BTreeMap<u64, Call>,
}

impl Assembler {
    pub fn new(format: Wire) -> Assembler {
        Assembler {
            format,
            text: String::new(),
            calls: BTreeMap::new(),
        }
    }

    fn open(&mut self, key: u64) -> &mut Call {
        self.calls.entry(key).or_default()
    }

    fn complete_open(&mut self, except: Option<u64>) -> Vec<u64> {
        let mut done = Vec::new();
        for (k, c) in &mut self.calls {
            if !c.complete && Some(*k) != except {
                c.complete = true;
                done.push(*k);
            }
        }
        done
    }

    /// Reads one event.
    pub fn read(&mut self, event: &SseEvent) -> Read {
        let mut read = Read::default();
        if event.done {
            read.terminal = true;
            read.completed = self.complete_open(None);
            return read;
        }
        let Some(json) = &event.json else {
            // An SSE comment or keep-alive: nothing for the client to read as content.
            read.opening = true;
            return read;
        };
        match self.format {
            Wire::Chat => self.read_chat(json, &mut read),
            Wire::Messages => self.read_messages(json, &mut read),
            Wire::Responses => self.read_responses(json, &mut read),
            Wire::Converse => {}
        }
        read
    }

    fn read_chat(&mut self, json: &Value, read: &mut Read) {
        let Some(choice) = json.pointer("/choices/0") else {
            return;
        };
        let says_nothing =
            |v: Option<&Value>| v.is_none_or(|v| v.is_null() || v.as_str() == Some(""));
        let delta = choice.get("delta");
        // The role and empty values only (`content: ""`, `refusal: null`, as OpenAI's
        // first chunk has them).
        read.opening = delta
            .and_then(Value::as_object)
            .is_some_and(|d| d.iter().all(|(k, v)| k == "role" || says_nothing(Some(v))))
            && choice.get("finish_reason").is_none_or(Value::is_null);
        if let Some(text) = choice.pointer("/delta/content").and_then(Value::as_str) {
            self.text.push_str(text);
        }
        for tc in choice
            .pointer("/delta/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
            // OpenAI streams one call after another: a new index completes the others.
            if !self.calls.contains_key(&index) {
                read.completed.extend(self.complete_open(Some(index)));
            }
            let call = self.open(index);
            if let Some(id) = tc.get("id").and_then(Value::as_str) {
                call.id = Some(id.to_owned());
            }
            if let Some(name) = tc.pointer("/function/name").and_then(Value::as_str) {
                call.name.push_str(name);
            }
            if let Some(args) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                call.args.push_str(args);
            }
            read.call.get_or_insert(index);
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            read.completed.extend(self.complete_open(None));
        }
    }

    fn read_messages(&mut self, json: &Value, read: &mut Read) {
        let index = json.get("index").and_then(Value::as_u64);
        match json.get("type").and_then(Value::as_str) {
            Some("message_start" | "ping") => read.opening = true,
            Some("content_block_start") => {
                let block = json.get("content_block");
                if block.and_then(|b| b.get("type")).and_then(Value::as_str) == Some("tool_use") {
                    let index = index.unwrap_or(0);
                    let call = self.open(index);
                    let block = block.unwrap_or(&Value::Null);
                    call.name = block
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .into();
                    call.id = block.get("id").and_then(Value::as_str).map(str::to_owned);
                    read.call = Some(index);
                }
            }
            Some("content_block_delta") => {
                let delta = json.get("delta").unwrap_or(&Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        if let Some(t) = delta.get("text").and_then(Value::as_str) {
                            self.text.push_str(t);
                        }
                    }
                    Some("input_json_delta") => {
                        if let Some(call) = index.and_then(|i| self.calls.get_mut(&i)) {
                            if let Some(p) = delta.get("partial_json").and_then(Value::as_str) {
                                call.args.push_str(p);
                            }
                            read.call = index;
                        }
                    }
                    _ => {}
                }
            }
            Some("content_block_stop") => {
                if let Some(i) = index.filter(|i| self.calls.contains_key(i)) {
                    read.call = Some(i);
                    if let Some(call) = self.calls.get_mut(&i).filter(|c| !c.complete) {
                        call.complete = true;
                        read.completed.push(i);
                    }
                }
            }
            Some("message_stop") => {
                read.terminal = true;
                read.completed = self.complete_open(None);
            }
            _ => {}
        }
    }

    fn read_responses(&mut self, json: &Value, read: &mut Read) {
        let index = json.get("output_index").and_then(Value::as_u64);
        let ours = |s: &Self| index.filter(|i| s.calls.contains_key(i));
        match json.get("type").and_then(Value::as_str) {
            Some("response.created" | "response.in_progress" | "response.queued") => {
                read.opening = true;
            }
            Some("response.output_item.added") => {
                let item = json.get("item").unwrap_or(&Value::Null);
                if item.get("type").and_then(Value::as_str) == Some("function_call") {
                    let index = index.unwrap_or(0);
                    let call = self.open(index);
                    call.name = item
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .into();
                    call.id = item
                        .get("call_id")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    read.call = Some(index);
                }
            }
            Some("response.output_text.delta") => {
                if let Some(t) = json.get("delta").and_then(Value::as_str) {
                    self.text.push_str(t);
                }
            }
            Some("response.function_call_arguments.delta") => {
                if let Some(i) = ours(self) {
                    if let Some(d) = json.get("delta").and_then(Value::as_str) {
                        self.open(i).args.push_str(d);
                    }
                    read.call = Some(i);
                }
            }
            Some("response.function_call_arguments.done") => {
                if let Some(i) = ours(self) {
                    if let Some(a) = json.get("arguments").and_then(Value::as_str) {
                        self.open(i).args = a.to_owned();
                    }
                    read.call = Some(i);
                }
            }
            Some("response.output_item.done") => {
                if let Some(i) = ours(self) {
                    read.call = Some(i);
                    let final_args = json
                        .pointer("/item/arguments")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    let call = self.open(i);
                    if let Some(a) = final_args {
                        call.args = a;
                    }
                    if !call.complete {
                        call.complete = true;
                        read.completed.push(i);
                    }
                }
            }
            Some("response.completed" | "response.incomplete" | "response.failed") => {
                read.terminal = true;
                read.completed = self.complete_open(None);
            }
            _ => {}
        }
    }

    /// Completes every call still open (the stream ended without saying so).
    pub fn finish(&mut self) -> Vec<u64> {
        self.complete_open(None)
    }

    /// The whole answer so far in its non-streaming shape: its text and every call.
    pub fn answer(&self) -> Value {
        self.shaped(self.calls.values(), true)
    }

    /// An answer holding only call `key` (to check one call as it completes).
    /// A call's name and arguments (parsed, so spacing and key order do not matter),
    /// to tell a repeat of a call already sent.
    pub fn call_identity(&self, key: u64) -> Option<(String, Value)> {
        let call = self.calls.get(&key)?;
        let args = match call.args.trim() {
            "" => Value::Object(Default::default()),
            args => serde_json::from_str(args).unwrap_or_else(|_| Value::String(args.into())),
        };
        Some((call.name.clone(), args))
    }

    pub fn call_answer(&self, key: u64) -> Value {
        self.shaped(self.calls.get(&key).into_iter(), false)
    }

    fn shaped<'a>(&self, calls: impl Iterator<Item = &'a Call>, with_text: bool) -> Value {
        let text = if with_text { self.text.as_str() } else { "" };
        match self.format {
            Wire::Chat | Wire::Converse => {
                let calls: Vec<Value> = calls
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}}))
                    .collect();
                let mut message = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                json!({"choices": [{"index": 0, "message": message}]})
            }
            Wire::Messages => {
                let mut content = Vec::new();
                if !text.is_empty() || with_text {
                    content.push(json!({"type": "text", "text": text}));
                }
                for c in calls {
                    // Arguments that are not JSON are shown as the string they are, which
                    // no object schema accepts.
                    let args = if c.args.trim().is_empty() {
                        "{}"
                    } else {
                        c.args.as_str()
                    };
                    let input = serde_json::from_str::<Value>(args)
                        .unwrap_or_else(|_| Value::String(c.args.clone()));
                    content.push(
                        json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}),
                    );
                }
                json!({"content": content})
            }
            Wire::Responses => {
                let mut output = Vec::new();
                if with_text {
                    output.push(json!({"type": "message", "role": "assistant",
                        "content": [{"type": "output_text", "text": text}]}));
                }
                for c in calls {
                    output.push(json!({"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.args}));
                }
                json!({"output": output})
            }
        }
    }

    /// The keys of every tool call seen so far (an event may open more than one).
    pub fn call_keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.calls.keys().copied()
    }

    /// Whether any tool call was seen.
    pub fn has_calls(&self) -> bool {
        !self.calls.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn events(raw: &str) -> Vec<SseEvent> {
        let mut s = crate::wire::sse::Splitter::default();
        s.push(raw.as_bytes())
    }

    #[test]
    fn chat_tool_calls_complete_at_the_next_index_and_at_finish() {
        let mut a = Assembler::new(Wire::Chat);
        let raw = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi \"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c0\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\":1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"c1\",\"function\":{\"name\":\"g\",\"arguments\":\"{}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let reads: Vec<Read> = events(raw).iter().map(|e| a.read(e)).collect();
        assert_eq!(reads[0], Read::default());
        assert_eq!(reads[1].call, Some(0));
        assert_eq!(reads[2].call, Some(0));
        assert_eq!(
            (reads[3].call, reads[3].completed.clone()),
            (Some(1), vec![0])
        );
        assert_eq!(reads[4].completed, vec![1]);
        assert!(reads[5].terminal);
        let answer = a.answer();
        assert_eq!(answer["choices"][0]["message"]["content"], "hi ");
        assert_eq!(
            answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(
            a.call_answer(1)["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "g"
        );
    }

    #[test]
    fn anthropic_and_responses_calls_complete_at_their_own_stop_events() {
        let mut a = Assembler::new(Wire::Messages);
        let raw = concat!(
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{}}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"a\\\":1}\"}}\n\n",
            "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let reads: Vec<Read> = events(raw).iter().map(|e| a.read(e)).collect();
        assert_eq!(reads[2].completed, vec![1]);
        assert!(reads[3].terminal && reads[3].completed.is_empty());
        assert_eq!(a.call_answer(1)["content"][0]["input"]["a"], 1);

        let mut r = Assembler::new(Wire::Responses);
        let raw = concat!(
            "event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"output_index\":0,\"item\":{\"type\":\"function_call\",\"name\":\"f\",\"call_id\":\"c\",\"arguments\":\"\"}}\n\n",
            "event: response.function_call_arguments.delta\ndata: {\"type\":\"response.function_call_arguments.delta\",\"output_index\":0,\"delta\":\"{}\"}\n\n",
            "event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"output_index\":0,\"item\":{\"type\":\"function_call\",\"arguments\":\"{\\\"b\\\":2}\"}}\n\n",
        );
        let reads: Vec<Read> = events(raw).iter().map(|e| r.read(e)).collect();
        assert_eq!(reads[0].call, Some(0));
        assert_eq!(reads[2].completed, vec![0]);
        assert_eq!(r.call_answer(0)["output"][0]["arguments"], "{\"b\":2}");
        let _ = Bytes::new();
    }
}
