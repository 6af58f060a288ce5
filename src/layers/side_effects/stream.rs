//! A streamed answer watched for repeats: its events flow as they come, except that a
//! listed tool's call is held from its first event until its arguments are complete,
//! then released, or, when it repeats a committed call, never sent:
//!
//! - while nothing but the answer's opening events has come (a call as the answer's
//!   first content, as a replanned agent's first move is), the response has not begun:
//!   `correct` makes the corrective attempt and streams its answer instead, `refuse` is a
//!   plain 409;
//! - once the answer has begun (text went out first), `correct` makes the corrective
//!   attempt and its answer follows on from what was sent (its text and opening dropped,
//!   its calls renumbered after those sent, as a validated stream's correction does);
//!   `refuse` (or a repeat a correction cannot take) ends the stream with a
//!   `duplicate_side_effect` error event in place of the call;
//! - `annotate` releases the call.
//!
//! Text and unlisted tools are not held: the opening events wait only for the first
//! content event after them.

use std::collections::{HashMap, HashSet, VecDeque};

use axum::body::Body;
use bytes::Bytes;
use futures_util::{stream::BoxStream, StreamExt};

use tower::{Service, ServiceExt};

use super::{count, judge, Corrections, Judged, Watch};
use crate::{
    api::{
        tool_calls::{self, ToolCall},
        Endpoint,
    },
    layers::{
        context::Call,
        recovery::{Answered, Unanswered},
        validate_stream::follow::{Follow, Sent},
    },
    policy::side_effects::OnRepeat,
    state::journal::Entry,
    upstream::ReplyBody,
    validation::stream::Assembler,
    wire::{
        sse::{Splitter, SseEvent},
        stream_error_event,
    },
};

type Source = BoxStream<'static, Result<Bytes, axum::Error>>;

/// A repeat found in the stream: the call, and the entry it repeats.
pub(super) struct Repeat {
    pub(super) call: ToolCall,
    pub(super) entry: Entry,
}

/// One attempt's stream, read event by event.
pub(super) struct Reader {
    source: Option<Source>,
    splitter: Splitter,
    assembler: Assembler,
    endpoint: Endpoint,
    /// Events read and not yet sent, in order.
    queue: VecDeque<SseEvent>,
    /// What the client was sent, for a corrective attempt to follow on from.
    sent: Sent,
    /// A corrective attempt following on from what was sent: its events mapped and
    /// renumbered so they continue the answer the client has.
    follow: Option<Follow>,
    /// Where each held call's first event is in `queue`.
    first: HashMap<u64, usize>,
    /// Listed calls whose arguments are not complete yet.
    held: HashSet<u64>,
    /// Calls seen (listed or not).
    known: HashSet<u64>,
    /// Something past the opening events was released: the answer has begun.
    pub(super) begun: bool,
    /// Ready to send.
    out: VecDeque<Bytes>,
    ended: bool,
}

/// What reading on found.
pub(super) enum Found {
    /// The answer began (or ended): what is in `out` may go to the client.
    Begun,
    /// A repeat, before or after the answer began.
    Repeat(Box<Repeat>),
}

impl Reader {
    pub(super) fn new(endpoint: Endpoint, body: Body) -> Reader {
        Reader {
            source: Some(body.into_data_stream().boxed()),
            splitter: Splitter::default(),
            assembler: Assembler::new(endpoint.wire()),
            endpoint,
            queue: VecDeque::new(),
            sent: Sent::default(),
            follow: None,
            first: HashMap::new(),
            held: HashSet::new(),
            known: HashSet::new(),
            begun: false,
            out: VecDeque::new(),
            ended: false,
        }
    }

    /// The call `key` as a whole answer would carry it.
    fn call(&self, key: u64) -> Option<ToolCall> {
        tool_calls::proposed(self.endpoint, &self.assembler.call_answer(key))
            .into_iter()
            .next()
    }

    /// Reads until the answer has begun, a repeat is found, or the stream ends.
    pub(super) async fn until_found(&mut self, watch: &mut Watch) -> Found {
        loop {
            if self.ended || (self.begun && !self.out.is_empty()) {
                return Found::Begun;
            }
            let events = match self.source.as_mut() {
                Some(source) => match source.next().await {
                    Some(Ok(chunk)) => self.splitter.push(&chunk),
                    // The upstream's stream broke: what was read goes out, then the end
                    // (the meter and the client see the cut as they would without us).
                    Some(Err(_)) | None => {
                        self.source = None;
                        self.splitter.finish().into_iter().collect()
                    }
                },
                None => {
                    // Ended: calls still open are complete as they are.
                    for key in self.assembler.finish() {
                        if let Some(repeat) = self.completed(key, watch).await {
                            return Found::Repeat(Box::new(repeat));
                        }
                    }
                    self.release(true);
                    self.ended = true;
                    return Found::Begun;
                }
            };
            for event in events {
                if let Some(repeat) = self.take(event, watch).await {
                    return Found::Repeat(Box::new(repeat));
                }
            }
        }
    }

    /// One event: queued, its call held if it is listed, and judged once complete.
    async fn take(&mut self, event: SseEvent, watch: &mut Watch) -> Option<Repeat> {
        let event = match self.follow.as_mut() {
            Some(follow) => follow.map(event)?,
            None => event,
        };
        let read = self.assembler.read(&event);
        // Every call this event opened (a chunk may carry several whole calls): held
        // when its tool is listed, or not named yet (decided once it is complete).
        let opened: Vec<u64> = self
            .assembler
            .call_keys()
            .filter(|key| !self.known.contains(key))
            .collect();
        for key in opened {
            self.known.insert(key);
            if self.call(key).is_none_or(|c| watch.policy.lists(&c.tool)) {
                self.held.insert(key);
                self.first.insert(key, self.queue.len());
            }
        }
        self.queue.push_back(event);
        for key in read.completed {
            if let Some(repeat) = self.completed(key, watch).await {
                return Some(repeat);
            }
        }
        self.release(!read.opening);
        None
    }

    /// A held call complete: judged when its tool is listed; a repeat is cut from the
    /// queue with what came after it (and after any other call still held, which the
    /// correction or refusal supersedes).
    async fn completed(&mut self, key: u64, watch: &mut Watch) -> Option<Repeat> {
        if !self.held.remove(&key) {
            return None;
        }
        let call = self.call(key).filter(|c| watch.policy.lists(&c.tool))?;
        match judge(watch, &call).await {
            Judged::Repeat(_) if watch.policy.on_repeat == OnRepeat::Annotate => {
                count("annotated");
                None
            }
            Judged::Repeat(entry) => {
                let at = self
                    .held
                    .iter()
                    .chain([&key])
                    .filter_map(|k| self.first.get(k))
                    .min()
                    .copied()
                    .unwrap_or(0);
                self.queue.truncate(at);
                self.held.clear();
                Some(Repeat { call, entry })
            }
            Judged::New | Judged::Deliberate => None,
        }
    }

    /// Sends what is queued when no listed call is held, and the answer has begun or
    /// `content` (this event is more than an opening) begins it.
    fn release(&mut self, content: bool) {
        if self.held.is_empty() && (self.begun || content) {
            self.begun = true;
            self.flush();
        }
    }

    /// Sends every queued event (renumbered when following on), noting what went out.
    fn flush(&mut self) {
        self.first.clear();
        let format = self.endpoint.wire();
        while let Some(event) = self.queue.pop_front() {
            let event = match self.follow.as_mut() {
                Some(follow) => follow.renumber(event),
                None => event,
            };
            self.sent.note(format, &event);
            self.out.push_back(event.raw);
        }
    }

    /// After a repeat once the answer began: what came before the call goes out, and the
    /// corrective attempt's `body` follows on from it (its text and opening dropped, its
    /// calls renumbered after those sent).
    fn follow_on(&mut self, body: Body) {
        self.flush();
        self.follow = Some(Follow::after(self.endpoint.wire(), &self.sent));
        self.source = Some(body.into_data_stream().boxed());
        self.splitter = Splitter::default();
        self.assembler = Assembler::new(self.endpoint.wire());
        self.held.clear();
        self.known.clear();
        self.ended = false;
    }

    /// After a repeat once the answer began: what came before the call, then the error
    /// event, then the end.
    fn refuse_in_stream(&mut self, repeat: &Repeat) {
        let err = super::duplicate(&repeat.call, &repeat.entry);
        self.flush();
        self.out.push_back(stream_error_event(
            self.endpoint.wire(),
            "duplicate_side_effect",
            &err.to_string(),
        ));
        self.source = None;
        self.ended = true;
    }
}

/// What correcting a repeat after the answer began needs: the service and the call,
/// and the request's corrections so far.
pub(super) struct Corrector<S> {
    pub(super) inner: S,
    pub(super) call: Call,
    pub(super) corrections: Corrections,
}

impl<S> Corrector<S>
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    /// The corrective attempt's stream, if `repeat` may still be corrected and the
    /// attempt streams.
    async fn correct(&mut self, repeat: &Repeat, watch: &Watch) -> Option<Body> {
        let again =
            self.corrections
                .next(&self.call, &repeat.call, &repeat.entry, &watch.policy)?;
        let answered = self.inner.clone().oneshot(again).await.ok()?;
        match answered.reply.body {
            ReplyBody::Stream(body) if answered.reply.status.is_success() => Some(body),
            _ => None,
        }
    }
}

/// The body of an answer that has begun: `reader`'s events, read on as the client
/// takes them. A later repeat is corrected, following on from what was sent, or ends
/// the stream with an error event.
pub(super) fn body<S>(reader: Reader, watch: Watch, corrector: Corrector<S>) -> Body
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let state = (reader, watch, corrector);
    let stream =
        futures_util::stream::unfold(state, |(mut reader, mut watch, mut corrector)| async move {
            loop {
                if let Some(chunk) = reader.out.pop_front() {
                    return Some((Ok::<_, std::io::Error>(chunk), (reader, watch, corrector)));
                }
                if reader.ended {
                    return None;
                }
                if let Found::Repeat(repeat) = reader.until_found(&mut watch).await {
                    tracing::warn!(
                        tenant = &*watch.tenant,
                        session = &*watch.session_id,
                        tool = repeat.call.tool,
                        earlier = repeat.entry.call_id,
                        "a streamed answer proposed a committed side effect again, after it began"
                    );
                    match corrector.correct(&repeat, &watch).await {
                        Some(body) => {
                            watch.fresh = false;
                            reader.follow_on(body);
                        }
                        None => {
                            count("refused");
                            reader.refuse_in_stream(&repeat);
                        }
                    }
                }
            }
        });
    Body::from_stream(stream)
}
