//! SSE relay: upstream events are handed to the client as they arrive. Chunks are cut at
//! event boundaries (an upstream chunk normally ends on one, so this adds no delay) so
//! that the events can be read for token usage, and the usage-only chunk Backstop asked
//! for on a client's behalf can be removed.
//!
//! Bounded, each ending the stream with one error event in the caller's API format:
//! - an event larger than the upstream's `max_sse_event_bytes` (`upstream_stream_error`);
//! - no complete event for the upstream's `attempt_timeout` (`upstream_timeout`): a
//!   stream that drips a byte at a time is as silent as one that sends nothing;
//! - the whole stream past the upstream's `max_stream_duration` (`stream_timeout`);
//! - the server's shutdown grace elapsing (`server_shutting_down`).
//!
//! Each byte is scanned for a boundary once, however the upstream cuts its chunks.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::{stream, StreamExt};
use serde_json::Value;

use crate::{
    api::{usage::RawUsage, Endpoint, ReportedUsage},
    billing::Tokens,
    wire::{sse::first_boundary, stream_error_event},
};

type OnEnd = Box<dyn FnOnce(StreamEnd) + Send>;

/// How a stream ended, as the meter settles it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamEnd {
    /// Every count the endpoint defines, as reported so far; `None` if the stream
    /// reported none (or only part of them, or not a count).
    pub usage: Option<Tokens>,
    /// Its final usage event came (Anthropic `message_delta`, OpenAI's usage chunk,
    /// Responses `response.completed` / `incomplete` / `failed`): the counts are the
    /// call's. Without it they are what the stream had said when it ended (Anthropic
    /// reports input and one output token in `message_start`).
    pub complete: bool,
    /// Content deltas relayed: at least one output token each, a floor for what the
    /// call produced.
    pub deltas: u64,
}

#[derive(Default)]
struct UsageState {
    /// Every count the stream's events reported so far, the later over the earlier,
    /// and the endpoint whose names they are under.
    raw: RawUsage,
    endpoint: Option<Endpoint>,
    ended: bool,
    /// Called in order when the stream ends (the meter's settle, the owners' size).
    on_end: Vec<OnEnd>,
    /// The Responses API's response id, from its first event that names one.
    response_id: Option<String>,
    /// The ids of a Responses stream's output items, from its final event.
    output_ids: Vec<String>,
    on_response_id: Option<Box<dyn FnOnce(String) + Send>>,
    /// Why Backstop cut the stream short, if it did (the metric reason).
    cut: Option<&'static str>,
    /// The final usage event was seen.
    complete: bool,
    /// Events that carried a content delta.
    deltas: u64,
}

/// The token usage a stream reported, delivered once when it ends (or is dropped).
#[derive(Default)]
pub struct StreamUsage {
    state: Mutex<UsageState>,
}

impl StreamUsage {
    fn lock(&self) -> std::sync::MutexGuard<'_, UsageState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every count the endpoint defines, or none: a stream that reported only part of
    /// them, or one that is not a count, did not report its usage (`None`, charged the
    /// reservation), and is logged and counted as such.
    fn reported(state: &UsageState) -> Option<Tokens> {
        let endpoint = state.endpoint?;
        let reason = match state.raw.reported(endpoint) {
            ReportedUsage::Counts(tokens) => return Some(tokens),
            ReportedUsage::Absent => return None,
            ReportedUsage::Missing | ReportedUsage::OutputOnly(_) => "missing_count",
            ReportedUsage::Invalid => "not_a_count",
        };
        tracing::warn!(
            endpoint = endpoint.label(),
            reason,
            "a stream reported only part of its usage, or not a count; charging the reservation instead"
        );
        metrics::counter!("backstop_usage_rejected_total", "reason" => reason).increment(1);
        None
    }

    /// Calls `f` with a Responses stream's response id as soon as an event names it (at
    /// once if one already has).
    pub fn on_response_id(&self, f: impl FnOnce(String) + Send + 'static) {
        let mut state = self.lock();
        match state.response_id.clone() {
            Some(id) => {
                drop(state);
                f(id);
            }
            None => state.on_response_id = Some(Box::new(f)),
        }
    }

    /// Calls `f` with how the stream ended, when it ends.
    pub fn on_end(&self, f: impl FnOnce(StreamEnd) + Send + 'static) {
        let mut state = self.lock();
        if state.ended {
            let end = Self::end(&state);
            drop(state);
            f(end);
        } else {
            state.on_end.push(Box::new(f));
        }
    }

    /// Why Backstop cut the stream short (`broken`, `idle`, `too_long`, ...), if it did:
    /// known when it has ended.
    pub fn cut(&self) -> Option<&'static str> {
        self.lock().cut
    }

    /// A Responses stream's response id, once an event has named it.
    pub fn response_id(&self) -> Option<String> {
        self.lock().response_id.clone()
    }

    /// The ids of a Responses stream's output items (known when it has ended).
    pub fn output_ids(&self) -> Vec<String> {
        self.lock().output_ids.clone()
    }

    fn finish(&self) {
        let mut state = self.lock();
        if state.ended {
            return;
        }
        state.ended = true;
        let end = Self::end(&state);
        let callbacks = std::mem::take(&mut state.on_end);
        drop(state);
        for f in callbacks {
            f(end);
        }
    }

    fn end(state: &UsageState) -> StreamEnd {
        StreamEnd {
            usage: Self::reported(state),
            complete: state.complete,
            deltas: state.deltas,
        }
    }

    fn delta(&self) {
        self.lock().deltas += 1;
    }

    /// Reads usage from one event's JSON, in the endpoint's event format.
    fn observe(&self, endpoint: Endpoint, event: &Value) {
        let mut state = self.lock();
        state.endpoint = Some(endpoint);
        let usage = match endpoint {
            // The usage chunk OpenAI sends last has no choices; a server that reports
            // running usage on every chunk (vLLM's continuous usage) is final on the
            // chunk that finishes.
            Endpoint::ChatCompletions | Endpoint::Embeddings => {
                let usage = event.get("usage").filter(|u| u.is_object());
                if usage.is_some() {
                    let finished = match event.get("choices").and_then(Value::as_array) {
                        None => true,
                        Some(choices) => {
                            choices.is_empty()
                                || choices
                                    .iter()
                                    .any(|c| c.get("finish_reason").is_some_and(|r| !r.is_null()))
                        }
                    };
                    state.complete |= finished;
                }
                usage
            }
            // Only the final event carries usage: `response.completed` (or
            // `response.incomplete` / `response.failed`), under `response.usage`. The
            // first event names the response.
            Endpoint::Responses => {
                if state.response_id.is_none() {
                    if let Some(id) = event.pointer("/response/id").and_then(Value::as_str) {
                        state.response_id = Some(id.to_owned());
                        if let Some(f) = state.on_response_id.take() {
                            let id = id.to_owned();
                            drop(state);
                            f(id);
                            state = self.lock();
                        }
                    }
                }
                if let Some(Value::Array(items)) = event.pointer("/response/output") {
                    if !items.is_empty() {
                        state.output_ids = output_ids(items);
                    }
                }
                let usage = event.pointer("/response/usage").filter(|u| u.is_object());
                let last = matches!(
                    event.get("type").and_then(Value::as_str),
                    Some("response.completed" | "response.incomplete" | "response.failed")
                );
                state.complete |= last && usage.is_some();
                usage
            }
            // `message_start` reports the input (and one output token); the final
            // `message_delta` the output.
            Endpoint::Messages | Endpoint::CountTokens => match event.get("usage") {
                Some(usage) => {
                    state.complete |=
                        event.get("type").and_then(Value::as_str) == Some("message_delta");
                    Some(usage)
                }
                None => event.pointer("/message/usage"),
            },
        };
        if let Some(usage) = usage {
            state.raw.merge(&RawUsage::of(usage));
        }
    }
}

/// The ids of a Responses answer's output items.
pub fn output_ids(items: &[Value]) -> Vec<String> {
    items
        .iter()
        .filter_map(|item| item.get("id").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// Ends the usage report however the stream ends, dropped bodies included.
struct Finish(Arc<StreamUsage>);

impl Drop for Finish {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// The end of the last complete event in `buf`, if any.
fn last_boundary(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    lf.max(crlf)
}

/// The JSON payload of an event's `data:` lines, when it may carry usage.
fn event_json(event: &[u8]) -> Option<Value> {
    if !event.windows(7).any(|w| w == b"\"usage\"") {
        return None;
    }
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    serde_json::from_str(&data).ok()
}

/// Whether every complete event fit `max_event_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Passed {
    Whole,
    /// An event over the limit: it and everything after it were dropped.
    Oversized,
}

/// What the relay does with the events it passes.
pub(super) struct Relay {
    /// The endpoint streamed: its events' format (usage, the closing error event).
    pub endpoint: Endpoint,
    /// Longest wait for the next complete event.
    pub idle: Duration,
    pub max_event_bytes: usize,
    pub max_duration: Duration,
    /// Turns true when the server stops serving streams.
    pub cut: tokio::sync::watch::Receiver<bool>,
    /// Read usage into this.
    pub usage: Arc<StreamUsage>,
    /// Remove OpenAI's usage-only chunk (Backstop asked for it, the client did not).
    pub strip_usage_chunk: bool,
}

impl Relay {
    /// Complete events, read for usage and filtered; copies only when an event is removed.
    fn pass(&self, complete: Bytes) -> (Bytes, Passed) {
        // Some(..) once an event has been removed: what is kept so far.
        let mut kept: Option<BytesMut> = None;
        let mut offset = 0;
        while let Some(len) = first_boundary(&complete[offset..]) {
            if len > self.max_event_bytes {
                // Whole events up to this one, then nothing more.
                let out = match kept {
                    Some(kept) => kept.freeze(),
                    None => complete.slice(..offset),
                };
                return (out, Passed::Oversized);
            }
            let event = &complete[offset..offset + len];
            let mut remove = false;
            if memchr::memmem::find(event, b"\"delta\":").is_some() {
                self.usage.delta();
            }
            if let Some(json) = event_json(event) {
                self.usage.observe(self.endpoint, &json);
                let usage_only = json
                    .get("choices")
                    .and_then(Value::as_array)
                    .is_some_and(Vec::is_empty);
                remove = self.strip_usage_chunk
                    && self.endpoint == Endpoint::ChatCompletions
                    && usage_only;
            }
            if remove {
                kept.get_or_insert_with(|| BytesMut::from(&complete[..offset]));
            } else if let Some(kept) = kept.as_mut() {
                kept.extend_from_slice(event);
            }
            offset += len;
        }
        let out = match kept {
            Some(mut kept) => {
                kept.extend_from_slice(&complete[offset..]);
                kept.freeze()
            }
            None => complete,
        };
        (out, Passed::Whole)
    }

    /// The client-side body of a stream whose `first` chunk has already arrived. A
    /// transport error or any of the module's bounds afterwards ends the stream with one
    /// error event in the caller's API, instead of a silently cut connection.
    pub(super) fn body(self, first: Bytes, rest: super::Chunks) -> Body {
        let now = Instant::now();
        let finish = Finish(self.usage.clone());
        let state = RelayState {
            ends_at: now + self.max_duration,
            event_due: now + self.idle,
            relay: self,
            upstream: Some(rest),
            pending: BytesMut::new(),
            scanned: 0,
            first: Some(first),
            _finish: finish,
        };
        let chunks = stream::unfold(state, |mut st| async move {
            loop {
                let chunk = match st.first.take() {
                    Some(first) => Some(Ok(first)),
                    None => {
                        st.upstream.as_ref()?;
                        match st.next_chunk().await {
                            Ok(next) => next,
                            Err(end) => return Some((st.end_with(end), st)),
                        }
                    }
                };
                match chunk {
                    Some(Ok(chunk)) => {
                        // Only the new bytes (and the three before them, for a `\r\n\r\n`
                        // split across chunks) can hold a new boundary.
                        st.pending.extend_from_slice(&chunk);
                        let from = st.scanned.saturating_sub(3);
                        st.scanned = st.pending.len();
                        let Some(end) = last_boundary(&st.pending[from..]).map(|e| e + from) else {
                            if st.pending.len() > st.relay.max_event_bytes {
                                return Some((st.end_with(End::EventTooLarge), st));
                            }
                            continue;
                        };
                        let complete = st.pending.split_to(end).freeze();
                        st.scanned = st.pending.len();
                        st.event_due = Instant::now() + st.relay.idle;
                        let (out, passed) = st.relay.pass(complete);
                        if passed == Passed::Oversized
                            || st.pending.len() > st.relay.max_event_bytes
                        {
                            let mut out = BytesMut::from(&out[..]);
                            out.extend_from_slice(&st.end_with(End::EventTooLarge));
                            return Some((out.freeze(), st));
                        }
                        if out.is_empty() {
                            continue;
                        }
                        return Some((out, st));
                    }
                    None => {
                        st.upstream = None;
                        if st.pending.is_empty() {
                            return None;
                        }
                        let tail = st.pending.split().freeze();
                        return Some((tail, st));
                    }
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, "upstream stream broke after the first byte");
                        return Some((st.end_with(End::Broken), st));
                    }
                }
            }
        });
        Body::from_stream(chunks.map(Ok::<Bytes, std::io::Error>))
    }
}

/// Why a relayed stream was ended by Backstop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Broken,
    Silent,
    EventTooLarge,
    TooLong,
    Shutdown,
}

impl End {
    /// (metric reason, error code, message)
    fn describe(self) -> (&'static str, &'static str, &'static str) {
        match self {
            End::Broken => (
                "broken",
                "upstream_stream_error",
                "the upstream stream ended unexpectedly",
            ),
            End::Silent => (
                "idle",
                "upstream_timeout",
                "the upstream stream sent no complete event within its attempt_timeout",
            ),
            End::EventTooLarge => (
                "event_too_large",
                "upstream_stream_error",
                "the upstream sent an event larger than its max_sse_event_bytes",
            ),
            End::TooLong => (
                "too_long",
                "stream_timeout",
                "the stream ran past its upstream's max_stream_duration",
            ),
            End::Shutdown => (
                "shutdown",
                "server_shutting_down",
                "Backstop is shutting down; the stream was cut after its grace period",
            ),
        }
    }
}

struct RelayState {
    relay: Relay,
    upstream: Option<super::Chunks>,
    /// Bytes of an event not yet complete.
    pending: BytesMut,
    /// How much of `pending` has been searched for a boundary.
    scanned: usize,
    first: Option<Bytes>,
    /// The next complete event must arrive by then.
    event_due: Instant,
    ends_at: Instant,
    _finish: Finish,
}

impl RelayState {
    /// The next upstream chunk, or why the stream must end now.
    async fn next_chunk(&mut self) -> Result<Option<Result<Bytes, super::ChunkError>>, End> {
        let upstream = self.upstream.as_mut().ok_or(End::Broken)?;
        let deadline = self.event_due.min(self.ends_at);
        let mut cut = self.relay.cut.clone();
        tokio::select! {
            biased;
            () = async {
                // A dropped sender means no shutdown will ever cut this stream.
                if cut.wait_for(|c| *c).await.is_err() {
                    std::future::pending::<()>().await;
                }
            } => Err(End::Shutdown),
            next = tokio::time::timeout_at(deadline, upstream.next()) => match next {
                Ok(next) => Ok(next),
                Err(_) if Instant::now() >= self.ends_at => Err(End::TooLong),
                Err(_) => Err(End::Silent),
            },
        }
    }

    /// Stops reading the upstream and returns the error event that ends the stream
    /// (after whatever complete events are still pending, never a partial one).
    fn end_with(&mut self, end: End) -> Bytes {
        let (reason, code, message) = end.describe();
        tracing::warn!(
            reason,
            idle_ms = self.relay.idle.as_millis() as u64,
            "relayed stream ended by Backstop"
        );
        metrics::counter!("backstop_stream_errors_total", "reason" => reason).increment(1);
        self.relay.usage.lock().cut = Some(reason);
        self.upstream = None;
        let mut out = match last_boundary(&self.pending) {
            Some(end) => {
                let complete = self.pending.split_to(end).freeze();
                BytesMut::from(&self.relay.pass(complete).0[..])
            }
            _ => BytesMut::new(),
        };
        self.pending.clear();
        out.extend_from_slice(&stream_error_event(
            self.relay.endpoint.wire(),
            code,
            message,
        ));
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Wire;

    fn relay(strip: bool, endpoint: Endpoint) -> Relay {
        Relay {
            endpoint,
            idle: Duration::from_secs(1),
            max_event_bytes: 1024,
            max_duration: Duration::from_secs(60),
            cut: tokio::sync::watch::channel(false).1,
            usage: Arc::default(),
            strip_usage_chunk: strip,
        }
    }

    #[test]
    fn the_injected_usage_chunk_is_removed_and_read() {
        let r = relay(true, Endpoint::ChatCompletions);
        let input = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\ndata: [DONE]\n\n");
        let (out, _) = r.pass(input);
        assert_eq!(
            &out[..],
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"
        );
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        r.usage.finish();
        assert_eq!(
            *seen.lock().unwrap(),
            Some(StreamEnd {
                usage: Some(Tokens::plain(7, 3)),
                complete: true,
                deltas: 1,
            })
        );
    }

    #[test]
    fn a_client_requested_usage_chunk_is_kept() {
        let r = relay(false, Endpoint::ChatCompletions);
        let input = Bytes::from_static(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\n",
        );
        assert_eq!(r.pass(input.clone()).0, input);
    }

    #[test]
    fn anthropic_usage_comes_from_start_and_delta() {
        let r = relay(false, Endpoint::Messages);
        // As Anthropic streams a cached prompt: the cache counts in message_start only.
        r.pass(Bytes::from_static(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":11,\"cache_creation_input_tokens\":20000,\"cache_read_input_tokens\":80000,\"cache_creation\":{\"ephemeral_5m_input_tokens\":0,\"ephemeral_1h_input_tokens\":20000},\"output_tokens\":1}}}\n\n"));
        r.pass(Bytes::from_static(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":42,\"server_tool_use\":{\"web_search_requests\":1}}}\n\n"));
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        r.usage.finish();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        let end = seen.lock().unwrap().unwrap();
        assert_eq!(
            end.usage,
            Some(Tokens {
                input: 11,
                cache_write_1h: 20_000,
                cache_read: 80_000,
                output: 42,
                web_searches: 1,
                ..Tokens::default()
            })
        );
        assert!(end.complete);
    }

    #[test]
    fn a_stream_cut_before_its_final_usage_is_not_complete() {
        // Anthropic: message_start's counts, then 3 text deltas, then the client left.
        let r = relay(false, Endpoint::Messages);
        r.pass(Bytes::from_static(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":2000,\"output_tokens\":1}}}\n\n"));
        for _ in 0..3 {
            r.pass(Bytes::from_static(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"word \"}}\n\n"));
        }
        r.usage.finish();
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        assert_eq!(
            *seen.lock().unwrap(),
            Some(StreamEnd {
                usage: Some(Tokens::plain(2000, 1)),
                complete: false,
                deltas: 3,
            })
        );
        // OpenAI with running usage on every chunk: final only on the finishing chunk.
        let r = relay(false, Endpoint::ChatCompletions);
        r.pass(Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"},\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1}}\n\n"));
        r.usage.finish();
        let s = seen.clone();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        assert!(!seen.lock().unwrap().unwrap().complete);
        // Responses: `response.created` names no usage; the stream ended before completing.
        let r = relay(false, Endpoint::Responses);
        r.pass(Bytes::from_static(b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n"));
        r.usage.finish();
        let s = seen.clone();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        assert_eq!(*seen.lock().unwrap(), Some(StreamEnd::default()));
    }

    #[test]
    fn responses_usage_comes_from_response_completed() {
        let r = relay(false, Endpoint::Responses);
        let input = Bytes::from_static(b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\nevent: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"usage\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":5,\"total_tokens\":17}}}\n\n");
        // Nothing is removed from a Responses stream: it always reports usage itself.
        assert_eq!(r.pass(input.clone()).0, input);
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        r.usage.finish();
        r.usage.on_end(move |u| *s.lock().unwrap() = Some(u));
        assert_eq!(
            *seen.lock().unwrap(),
            Some(StreamEnd {
                usage: Some(Tokens::plain(12, 5)),
                complete: true,
                deltas: 1,
            })
        );
    }

    #[test]
    fn a_responses_stream_ends_with_a_responses_error_event() {
        let event = stream_error_event(Wire::Responses, "upstream_stream_error", "cut");
        let text = std::str::from_utf8(&event).unwrap();
        let data: Value = serde_json::from_str(
            text.strip_prefix("event: error\ndata: ")
                .unwrap()
                .trim_end(),
        )
        .unwrap();
        assert_eq!(data["type"], "error");
        assert_eq!(data["code"], "upstream_stream_error");
        assert_eq!(data["message"], "cut");
    }

    #[test]
    fn boundaries() {
        assert_eq!(last_boundary(b"data: a\n\ndata: b\n\ndata: c"), Some(18));
        assert_eq!(last_boundary(b"data: a\r\n\r\nx"), Some(11));
        assert_eq!(last_boundary(b"data: a"), None);
    }

    /// One upstream event and whether a stripping relay removes it.
    fn event() -> impl proptest::strategy::Strategy<Value = (String, bool)> {
        use proptest::prelude::*;
        prop_oneof![
            "[a-z ]{0,12}".prop_map(|t| (format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{t}\"}}}}]}}\n\n"), false)),
            (0u64..1000, 0u64..1000).prop_map(|(i, o)| (format!("data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{i},\"completion_tokens\":{o}}}}}\n\n"), true)),
            "[a-z_]{1,10}".prop_map(|t| (format!("event: {t}\r\ndata: {{\"usage\":\"{t}\",\"future\":[1,2]}}\r\n\r\n"), false)),
            Just((": keep-alive comment\n\n".to_string(), false)),
        ]
    }

    fn run(relay: Relay, chunks: Vec<Bytes>) -> Bytes {
        use http_body_util::BodyExt;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut chunks = chunks.into_iter();
            let first = chunks.next().unwrap();
            let rest = futures_util::stream::iter(chunks.map(Ok)).boxed();
            relay.body(first, rest).collect().await.unwrap().to_bytes()
        })
    }

    /// Cuts `bytes` at the given fractions into non-empty chunks.
    fn cut(bytes: &[u8], cuts: &[f64]) -> Vec<Bytes> {
        let mut points: Vec<usize> = cuts
            .iter()
            .map(|f| (f * bytes.len() as f64) as usize)
            .collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        points.dedup();
        points
            .windows(2)
            .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
            .filter(|c| !c.is_empty())
            .collect()
    }

    proptest::proptest! {
        /// Fuzz the SSE framing: however the upstream cuts its bytes, the client gets
        /// exactly the upstream's events, minus only the usage chunk Backstop asked for,
        /// and the usage read is the last one reported.
        #[test]
        fn fuzz_sse_relay_is_lossless(
            events in proptest::collection::vec(event(), 1..12),
            cuts in proptest::collection::vec(0.0f64..1.0, 0..10),
            strip in proptest::prelude::any::<bool>(),
        ) {
            let input: String = events.iter().map(|(e, _)| e.as_str()).collect();
            let expected: String = events
                .iter()
                .filter(|(_, usage)| !(strip && *usage))
                .map(|(e, _)| e.as_str())
                .collect();
            let r = relay(strip, Endpoint::ChatCompletions);
            let usage = r.usage.clone();
            let out = run(r, cut(input.as_bytes(), &cuts));
            proptest::prop_assert_eq!(String::from_utf8_lossy(&out), expected);
            let last = events.iter().rev().find(|(_, u)| *u).map(|(e, _)| {
                let v: Value = serde_json::from_str(e.trim().strip_prefix("data: ").unwrap()).unwrap();
                Tokens::plain(v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["completion_tokens"].as_u64().unwrap())
            });
            let seen = Arc::new(Mutex::new(None));
            let s = seen.clone();
            usage.on_end(move |u| *s.lock().unwrap() = u.usage);
            proptest::prop_assert_eq!(*seen.lock().unwrap(), last);
        }

        /// Arbitrary bytes from an upstream never panic the relay, and an event over the
        /// limit is never relayed: the stream ends with one error event instead.
        #[test]
        fn fuzz_sse_relay_arbitrary_bytes(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 1..4096),
            cuts in proptest::collection::vec(0.0f64..1.0, 0..10),
        ) {
            let out = run(relay(true, Endpoint::Messages), cut(&bytes, &cuts));
            let text = String::from_utf8_lossy(&out);
            let longest_event = bytes
                .split(|b| *b == b'\n')
                .map(<[u8]>::len)
                .max()
                .unwrap_or(0);
            if longest_event <= 1024 && !text.contains("max_sse_event_bytes") {
                // Without an oversized event the relay passes every byte (events are only
                // removed for OpenAI usage chunks, and this relay speaks Anthropic).
                proptest::prop_assert_eq!(&out[..], &bytes[..]);
            } else {
                // What was relayed is a prefix of what came (whole events only), then
                // the one error event.
                let error = stream_error_event(Wire::Messages, "upstream_stream_error", End::EventTooLarge.describe().2);
                proptest::prop_assert!(out.ends_with(&error), "{text}");
                let relayed = &out[..out.len() - error.len()];
                proptest::prop_assert!(bytes.starts_with(relayed));
            }
        }
    }

    #[test]
    fn an_oversized_event_ends_the_stream_with_an_error_event() {
        let mut input = b"data: {\"a\":1}\n\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 5000));
        let out = run(
            relay(false, Endpoint::ChatCompletions),
            cut(&input, &[0.001, 0.3, 0.6]),
        );
        let text = String::from_utf8_lossy(&out);
        assert!(text.starts_with("data: {\"a\":1}\n\n"), "{text}");
        assert!(text.contains("max_sse_event_bytes"), "{text}");
        assert!(!text.contains("xxxx"), "{text}");
    }
}
