//! Following on from what the client was sent: the pure renumbering state machine of a
//! validated stream's corrective attempt. [`Sent`] notes what went out; [`Follow`]
//! drops what the client must not see twice and renumbers the rest, so the corrective
//! attempt's calls continue the answer the client already has. No I/O: events in,
//! events out.

use std::collections::{HashMap, HashSet};

use serde_json::{json, Value};

use crate::wire::{sse::SseEvent, Wire};

/// What the client has been sent, for a corrective attempt to follow on from.
#[derive(Default)]
pub(in crate::layers) struct Sent {
    pub(super) any: bool,
    /// OpenAI chat tool-call indices.
    chat_calls: HashSet<u64>,
    /// Anthropic content blocks started.
    blocks: u64,
    /// Responses API: the next free `output_index`, the last `sequence_number`, and the
    /// items completed (for the final `response.completed`).
    outputs: u64,
    sequence: Option<u64>,
    items: Vec<Value>,
    /// The response id the client was told (`response.created`).
    response_id: Option<Value>,
    /// The tool calls released (name, arguments): a corrective attempt that repeats one
    /// does not send it again.
    pub(super) calls: Vec<(String, Value)>,
}

impl Sent {
    pub(in crate::layers) fn note(&mut self, format: Wire, event: &SseEvent) {
        self.any = true;
        let Some(json) = &event.json else { return };
        match format {
            Wire::Chat => {
                for tc in json
                    .pointer("/choices/0/delta/tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    self.chat_calls
                        .insert(tc.get("index").and_then(Value::as_u64).unwrap_or(0));
                }
            }
            Wire::Messages => {
                if event.kind() == Some("content_block_start") {
                    let index = json.get("index").and_then(Value::as_u64).unwrap_or(0);
                    self.blocks = self.blocks.max(index + 1);
                }
            }
            Wire::Responses => {
                if let Some(i) = json.get("output_index").and_then(Value::as_u64) {
                    self.outputs = self.outputs.max(i + 1);
                }
                if let Some(s) = json.get("sequence_number").and_then(Value::as_u64) {
                    self.sequence = Some(s);
                }
                if self.response_id.is_none() {
                    self.response_id = json.pointer("/response/id").cloned();
                }
                if event.kind() == Some("response.output_item.done") {
                    if let Some(item) = json.get("item") {
                        self.items.push(item.clone());
                    }
                }
            }
            Wire::Converse => {}
        }
    }
}

/// Rewrites a corrective attempt's events to continue an answer the client already has.
/// [`Follow::map`] drops what the client must not see twice (opening events, text) as
/// events arrive; [`Follow::renumber`] gives what is released the next indices as it is
/// sent, so a call dropped in between (a repeat of one already sent) leaves no gap.
pub(in crate::layers) struct Follow {
    format: Wire,
    next_index: u64,
    remap: HashMap<u64, u64>,
    dropped: HashSet<u64>,
    next_sequence: u64,
    prior_items: Vec<Value>,
    items: Vec<Value>,
    response_id: Option<Value>,
}

impl Follow {
    pub(in crate::layers) fn after(format: Wire, sent: &Sent) -> Follow {
        Follow {
            format,
            next_index: match format {
                Wire::Chat => sent.chat_calls.len() as u64,
                Wire::Messages => sent.blocks,
                Wire::Responses => sent.outputs,
                Wire::Converse => 0,
            },
            remap: HashMap::new(),
            dropped: HashSet::new(),
            next_sequence: sent.sequence.map_or(0, |s| s + 1),
            prior_items: sent.items.clone(),
            items: Vec::new(),
            response_id: sent.response_id.clone(),
        }
    }

    /// The index `from` (the corrective attempt's own) takes in the client's answer: the
    /// next free one when first sent.
    fn index(&mut self, from: u64) -> u64 {
        *self.remap.entry(from).or_insert_with(|| {
            self.next_index += 1;
            self.next_index - 1
        })
    }

    /// The event, or `None` when it must not reach the client (indices unchanged).
    pub(in crate::layers) fn map(&mut self, event: SseEvent) -> Option<SseEvent> {
        let Some(mut json) = event.json.clone() else {
            return Some(event);
        };
        match self.format {
            Wire::Chat | Wire::Converse => {
                let Some(choice) = json.pointer_mut("/choices/0") else {
                    return Some(event);
                };
                let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
                let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) else {
                    return finished.then_some(event);
                };
                for text in [
                    "content",
                    "reasoning_content",
                    "reasoning",
                    "refusal",
                    "role",
                ] {
                    delta.remove(text);
                }
                if !delta.contains_key("tool_calls") && !finished {
                    return None;
                }
                Some(event.rewritten(json))
            }
            Wire::Messages => {
                let index = json.get("index").and_then(Value::as_u64);
                match event.kind() {
                    Some("message_start" | "ping") => None,
                    Some("content_block_start") => {
                        let is_tool = json.pointer("/content_block/type").and_then(Value::as_str)
                            == Some("tool_use");
                        if !is_tool {
                            self.dropped.insert(index.unwrap_or(0));
                            return None;
                        }
                        Some(event)
                    }
                    Some("content_block_delta" | "content_block_stop") => {
                        (!self.dropped.contains(&index?)).then_some(event)
                    }
                    _ => Some(event),
                }
            }
            Wire::Responses => {
                let kind = event.kind().unwrap_or("");
                if matches!(
                    kind,
                    "response.created" | "response.in_progress" | "response.queued"
                ) {
                    return None;
                }
                if let Some(index) = json.get("output_index").and_then(Value::as_u64) {
                    if kind == "response.output_item.added"
                        && json.pointer("/item/type").and_then(Value::as_str)
                            != Some("function_call")
                    {
                        self.dropped.insert(index);
                    }
                    if self.dropped.contains(&index) {
                        return None;
                    }
                }
                Some(event)
            }
        }
    }

    /// The event as the client gets it: indices (and the Responses API's sequence
    /// numbers, final output and id) following what it was sent before.
    pub(in crate::layers) fn renumber(&mut self, event: SseEvent) -> SseEvent {
        let Some(mut json) = event.json.clone() else {
            return event;
        };
        match self.format {
            Wire::Chat | Wire::Converse => {
                let Some(calls) = json
                    .pointer_mut("/choices/0/delta/tool_calls")
                    .and_then(Value::as_array_mut)
                else {
                    return event;
                };
                for tc in calls {
                    let from = tc.get("index").and_then(Value::as_u64).unwrap_or(0);
                    tc["index"] = json!(self.index(from));
                }
            }
            Wire::Messages => {
                let Some(from) = json.get("index").and_then(Value::as_u64) else {
                    return event;
                };
                json["index"] = json!(self.index(from));
            }
            Wire::Responses => {
                let kind = event.kind().unwrap_or("").to_owned();
                if let Some(from) = json.get("output_index").and_then(Value::as_u64) {
                    json["output_index"] = json!(self.index(from));
                    if kind == "response.output_item.done" {
                        self.items.extend(json.get("item").cloned());
                    }
                }
                if matches!(
                    kind.as_str(),
                    "response.completed" | "response.incomplete" | "response.failed"
                ) {
                    if let Some(response) = json.get_mut("response").and_then(Value::as_object_mut)
                    {
                        let mut output = self.prior_items.clone();
                        output.extend(self.items.iter().cloned());
                        response.insert("output".into(), Value::Array(output));
                        // One response, as far as the client knows: the id it was told.
                        if let Some(id) = &self.response_id {
                            response.insert("id".into(), id.clone());
                        }
                    }
                }
                if json.get("sequence_number").is_some() {
                    json["sequence_number"] = json!(self.next_sequence);
                    self.next_sequence += 1;
                }
            }
        }
        event.rewritten(json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the client was sent: these events, in this format.
    fn sent(format: Wire, events: &[SseEvent]) -> Sent {
        let mut sent = Sent::default();
        for event in events {
            sent.note(format, event);
        }
        sent
    }

    /// A corrective attempt's events as the client gets them: mapped, then renumbered.
    fn follow(follow: &mut Follow, events: Vec<SseEvent>) -> Vec<Value> {
        let mut out = Vec::new();
        for event in events {
            if let Some(event) = follow.map(event) {
                out.push(follow.renumber(event).json.unwrap_or(Value::Null));
            }
        }
        out
    }

    fn chat_call(index: u64, name: &str) -> SseEvent {
        SseEvent::write(
            None,
            &json!({"choices": [{"delta": {"tool_calls": [{"index": index, "function": {"name": name}}]}}]}),
        )
    }

    #[test]
    fn a_chat_correction_drops_its_text_and_numbers_its_calls_after_those_sent() {
        let before = sent(Wire::Chat, &[chat_call(0, "a"), chat_call(1, "b")]);
        let mut f = Follow::after(Wire::Chat, &before);
        let text = SseEvent::write(
            None,
            &json!({"choices": [{"delta": {"role": "assistant", "content": "again"}}]}),
        );
        let out = follow(&mut f, vec![text, chat_call(0, "c"), chat_call(0, "c")]);
        assert_eq!(out.len(), 2, "{out:?}");
        for event in &out {
            assert_eq!(event["choices"][0]["delta"]["tool_calls"][0]["index"], 2);
        }
    }

    #[test]
    fn a_messages_correction_keeps_only_its_tool_blocks_after_the_blocks_sent() {
        let start = |index: u64, kind: &str| {
            SseEvent::write(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": index, "content_block": {"type": kind}}),
            )
        };
        let delta = |index: u64| {
            SseEvent::write(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": index}),
            )
        };
        let before = sent(Wire::Messages, &[start(0, "text"), delta(0)]);
        let mut f = Follow::after(Wire::Messages, &before);
        let opening = SseEvent::write(Some("message_start"), &json!({"type": "message_start"}));
        let out = follow(
            &mut f,
            vec![
                opening,
                start(0, "text"),
                delta(0),
                start(1, "tool_use"),
                delta(1),
            ],
        );
        let indices: Vec<_> = out.iter().map(|e| e["index"].clone()).collect();
        assert_eq!(indices, [json!(1), json!(1)], "{out:?}");
        assert_eq!(out[0]["content_block"]["type"], "tool_use");
    }

    #[test]
    fn a_responses_correction_continues_the_sequence_the_output_and_the_id() {
        let item = |index: u64, id: &str, kind: &str, seq: u64| {
            SseEvent::write(
                Some("response.output_item.done"),
                &json!({"type": "response.output_item.done", "output_index": index,
                    "sequence_number": seq, "item": {"id": id, "type": kind}}),
            )
        };
        let created = |id: &str, seq: u64| {
            SseEvent::write(
                Some("response.created"),
                &json!({"type": "response.created", "sequence_number": seq, "response": {"id": id}}),
            )
        };
        let before = sent(
            Wire::Responses,
            &[created("resp_1", 0), item(0, "msg_1", "message", 1)],
        );
        let mut f = Follow::after(Wire::Responses, &before);
        let added = SseEvent::write(
            Some("response.output_item.added"),
            &json!({"type": "response.output_item.added", "output_index": 0,
                "sequence_number": 1, "item": {"type": "message"}}),
        );
        let completed = SseEvent::write(
            Some("response.completed"),
            &json!({"type": "response.completed", "sequence_number": 4,
                "response": {"id": "resp_2", "output": []}}),
        );
        let out = follow(
            &mut f,
            vec![
                created("resp_2", 0),
                added,
                item(0, "msg_2", "message", 2),
                item(1, "fc_1", "function_call", 3),
                completed,
            ],
        );
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[0]["output_index"], 1);
        assert_eq!(out[0]["sequence_number"], 2);
        let response = &out[1]["response"];
        assert_eq!(out[1]["sequence_number"], 3);
        assert_eq!(response["id"], "resp_1");
        let ids: Vec<_> = response["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].clone())
            .collect();
        assert_eq!(ids, [json!("msg_1"), json!("fc_1")]);
    }
}
