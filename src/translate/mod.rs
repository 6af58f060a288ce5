//! The strategy switch across providers: a request in the caller's API sent to a target
//! that speaks the other one, and its answer (whole, streamed, or an error) brought back
//! in the caller's API.
//!
//! Every conversion is typed and judged before the first attempt ([`request`]): a target
//! is either reached exactly, or skipped with the JSON paths it cannot carry (unless the
//! route opted in to losing them, `translate.drop`). The table these modules implement is
//! written down in `docs/translation.md`.
//!
//! - [`request`]: chat completions ⇄ messages requests, and the judgement;
//! - [`responses`]: Responses API → messages requests, and messages answers → Responses;
//! - [`answer`]: whole answers and error bodies, chat ⇄ messages;
//! - [`stream`]: the streamed answers, as typed state machines;
//! - [`ids`]: tool-call ids valid for each provider, mapped reversibly;
//! - [`finish`]: `finish_reason` ⇄ `stop_reason`, a closed table.

pub mod answer;
pub mod finish;
pub mod ids;
pub mod request;
pub mod responses;
pub mod stream;

use std::sync::Arc;

use bytes::Bytes;

use crate::api::{Endpoint, ParsedRequest};
use crate::wire::{sse::SseEvent, Wire};

/// Which way a request is translated: the caller's endpoint and the target's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// OpenAI chat completions sent to Anthropic messages.
    ChatToMessages,
    /// Anthropic messages sent to OpenAI chat completions.
    MessagesToChat,
    /// The OpenAI Responses API sent to Anthropic messages.
    ResponsesToMessages,
}

impl Direction {
    /// The translation a caller's endpoint needs to reach an upstream speaking `target`:
    /// `Ok(None)` when none is needed, `Err(())` when there is none.
    #[allow(clippy::result_unit_err)]
    pub fn between(caller: Endpoint, target: Wire) -> Result<Option<Direction>, ()> {
        match (caller, target) {
            (e, t) if e.wire() == t => Ok(None),
            (Endpoint::ChatCompletions, Wire::Messages) => Ok(Some(Direction::ChatToMessages)),
            (Endpoint::Messages, Wire::Chat) => Ok(Some(Direction::MessagesToChat)),
            (Endpoint::Responses, Wire::Messages) => Ok(Some(Direction::ResponsesToMessages)),
            _ => Err(()),
        }
    }

    /// The endpoint the target is called on.
    pub fn target_endpoint(self) -> Endpoint {
        match self {
            Direction::ChatToMessages | Direction::ResponsesToMessages => Endpoint::Messages,
            Direction::MessagesToChat => Endpoint::ChatCompletions,
        }
    }

    /// The caller's endpoint.
    pub fn caller_endpoint(self) -> Endpoint {
        match self {
            Direction::ChatToMessages => Endpoint::ChatCompletions,
            Direction::MessagesToChat => Endpoint::Messages,
            Direction::ResponsesToMessages => Endpoint::Responses,
        }
    }

    /// `chat->messages`, as the trail and the metric name it.
    pub fn label(self) -> &'static str {
        match self {
            Direction::ChatToMessages => "chat->messages",
            Direction::MessagesToChat => "messages->chat",
            Direction::ResponsesToMessages => "responses->messages",
        }
    }

    /// The metric's `from` and `to` labels.
    pub fn from_to(self) -> (&'static str, &'static str) {
        match self {
            Direction::ChatToMessages => ("chat", "messages"),
            Direction::MessagesToChat => ("messages", "chat"),
            Direction::ResponsesToMessages => ("responses", "messages"),
        }
    }
}

/// Why a target's 2xx answer cannot be brought back (it is then a malformed answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerError(pub String);

impl AnswerError {
    fn new(message: impl Into<String>) -> Self {
        AnswerError(message.into())
    }
}

/// What the answer side needs to bring a target's answer back: the direction and the
/// caller's own request (its model, `stream_options`, tools, ... as sent).
#[derive(Debug, Clone)]
pub struct AnswerContext {
    pub direction: Direction,
    pub caller: Arc<ParsedRequest>,
}

impl AnswerContext {
    /// An OpenAI chat caller that asked for the usage chunk (`stream_options.include_usage`).
    pub fn wants_usage_chunk(&self) -> bool {
        self.caller.client_wants_stream_usage
    }
}

/// A streamed answer's translation: target events in, caller events out, in order.
pub trait StreamTranslator: Send {
    /// One whole target event; the caller's events it completes are pushed to `out`.
    fn event(&mut self, event: &SseEvent, out: &mut Vec<Bytes>);
    /// The target stream ended (its bytes ran out, whatever the reason). A stream that
    /// did not finish properly ends with the caller's error event, never a successful end.
    fn finish(&mut self, out: &mut Vec<Bytes>);
    /// The caller's stream has ended (successfully or with an error event): nothing more
    /// will be written, so the rest of the target's stream need not be read.
    fn ended(&self) -> bool;
}

/// Where the request side records what a target cannot carry.
#[derive(Debug, Default)]
pub struct Judge<'a> {
    /// Top-level request fields the route allows to be lost (`translate.drop`).
    pub drop: &'a [String],
    /// JSON paths with no exact equivalent on the target.
    pub losses: Vec<String>,
    /// Fields dropped because the route allowed it.
    pub dropped: Vec<String>,
}

impl<'a> Judge<'a> {
    pub fn new(drop: &'a [String]) -> Self {
        Judge {
            drop,
            losses: Vec::new(),
            dropped: Vec::new(),
        }
    }

    /// `path` (a JSON pointer, `/n`, `/messages/3/name`) has no exact equivalent. It
    /// is dropped instead when it is a whole top-level field (`/seed`) that the route's
    /// `translate.drop` names and the target can do without; a part of a field (one
    /// message's part) or a field the target requires (`max_tokens`) never is: the
    /// rest of the request would not mean what the caller sent.
    pub fn lose(&mut self, path: impl Into<String>, field: &str) {
        let path = path.into();
        let whole_field = path.strip_prefix('/') == Some(field);
        if whole_field && !NEVER_DROPPED.contains(&field) && self.drop.iter().any(|d| d == field) {
            if !self.dropped.iter().any(|d| d == field) {
                self.dropped.push(field.to_string());
            }
        } else {
            self.losses.push(printable(&path));
        }
    }
}

/// Fields a translation cannot leave out: what the target requires, or the
/// conversation itself.
const NEVER_DROPPED: &[&str] = &[
    "model",
    "messages",
    "input",
    "system",
    "instructions",
    "max_tokens",
    "max_output_tokens",
    "max_completion_tokens",
    "tools",
];

/// A path as it can be written in a header and a log line: anything but visible ASCII
/// percent-encoded (a caller's unknown field may be named anything).
fn printable(path: &str) -> String {
    if path.bytes().all(|b| b.is_ascii_graphic()) {
        return path.to_string();
    }
    let mut out = String::with_capacity(path.len() + 8);
    for b in path.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A request the target cannot carry exactly: the JSON paths of what it would lose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untranslatable {
    pub paths: Vec<String>,
}
