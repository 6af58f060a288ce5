//! Server-sent events as the layers read them: a byte stream cut into whole events, each
//! kept as the upstream's own bytes beside its parsed `data:` JSON, so what is relayed is
//! what came, and what is read is read once.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

/// One whole event: its bytes (terminator included) and what they say.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub raw: Bytes,
    /// The `data:` payload parsed as JSON (`None` for comments, `[DONE]`, non-JSON).
    pub json: Option<Value>,
    /// OpenAI's `data: [DONE]`.
    pub done: bool,
    /// It has a `data:` payload that is neither JSON nor `[DONE]`: a corrupted event,
    /// not a comment or a keep-alive.
    pub unreadable: bool,
}

impl SseEvent {
    pub fn parse(raw: Bytes) -> SseEvent {
        let data = std::str::from_utf8(&raw).ok().map(|text| {
            text.lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect::<Vec<_>>()
                .join("\n")
        });
        let done = data.as_deref().is_some_and(|d| d.trim() == "[DONE]");
        let data = data.filter(|d| !done && !d.trim().is_empty());
        let json: Option<Value> = data.as_deref().and_then(|d| serde_json::from_str(d).ok());
        let unreadable = data.is_some() && json.is_none();
        SseEvent {
            raw,
            json,
            done,
            unreadable,
        }
    }

    /// An event Backstop writes: `event: NAME` (when the API names its events) and one
    /// `data:` line.
    pub fn write(name: Option<&str>, data: &Value) -> SseEvent {
        let raw = match name {
            Some(name) => format!("event: {name}\ndata: {data}\n\n"),
            None => format!("data: {data}\n\n"),
        };
        SseEvent {
            raw: Bytes::from(raw),
            json: Some(data.clone()),
            done: false,
            unreadable: false,
        }
    }

    /// The same event with its data replaced (the event name, if any, kept).
    pub fn rewritten(&self, data: Value) -> SseEvent {
        let name = std::str::from_utf8(&self.raw).ok().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("event:"))
                .map(str::trim)
        });
        SseEvent::write(name, &data)
    }

    /// The `type` of the event's JSON (Anthropic and Responses events are typed).
    pub fn kind(&self) -> Option<&str> {
        self.json.as_ref()?.get("type")?.as_str()
    }
}

/// Cuts chunks into whole events, whatever the chunk boundaries.
#[derive(Default)]
pub struct Splitter {
    pending: BytesMut,
}

impl Splitter {
    /// The events completed by `chunk`.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<SseEvent> {
        let from = self.pending.len().saturating_sub(3);
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut scan = from;
        while let Some(len) = first_boundary(&self.pending[scan..]) {
            let end = scan + len;
            events.push(SseEvent::parse(self.pending.split_to(end).freeze()));
            scan = 0;
        }
        events
    }

    /// Whatever is left when the stream ends (an unterminated last event), as an event.
    pub fn finish(&mut self) -> Option<SseEvent> {
        (!self.pending.is_empty()).then(|| SseEvent::parse(self.pending.split().freeze()))
    }
}

/// The end of the first complete event in `buf` (`\n\n` or `\r\n\r\n`).
pub fn first_boundary(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_whole_however_the_bytes_are_cut() {
        let input =
            b"data: {\"a\":1}\n\nevent: x\r\ndata: {\"type\":\"t\"}\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..input.len() {
            let mut s = Splitter::default();
            let mut events = s.push(&input[..cut]);
            events.extend(s.push(&input[cut..]));
            assert!(s.finish().is_none());
            let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.to_vec()).collect();
            assert_eq!(raw, input.to_vec(), "cut at {cut}");
            assert_eq!(events.len(), 3);
            assert_eq!(events[0].json.as_ref().unwrap()["a"], 1);
            assert_eq!(events[1].kind(), Some("t"));
            assert!(events[2].done && events[2].json.is_none());
        }
    }

    #[test]
    fn a_rewritten_event_keeps_its_name() {
        let e = SseEvent::parse(Bytes::from_static(
            b"event: message_delta\ndata: {\"n\":1}\n\n",
        ));
        let r = e.rewritten(serde_json::json!({"n": 2}));
        assert_eq!(&r.raw[..], b"event: message_delta\ndata: {\"n\":2}\n\n");
    }
}
