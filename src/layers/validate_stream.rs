//! Validated streams (the validate layer's streaming half): the upstream streams, and
//! its events are relayed as they arrive except what must be checked first.
//!
//! - **Tool calls** are held from their first event until their arguments are complete,
//!   checked against the tool's schema, then released in the upstream's own framing.
//!   Text, thinking, reasoning and every other event flow at once; an event that comes
//!   after a held call waits behind it, so the client sees the upstream's order.
//! - **A content schema** (`response_format`, `text.format`, an Anthropic output format,
//!   a route's `response_schema`) is checked on the whole answer. `validation.stream =
//!   "buffer"` holds every event until that verdict, then relays the accepted attempt's
//!   events verbatim; `"passthrough"` relays as it comes and, when the answer is invalid,
//!   ends the stream with an `output_invalid` error event in place of its closing event.
//! - **Annotate mode** holds nothing; an invalid answer gets one `backstop_validation`
//!   event before the closing event (the response head said `x-backstop-validation:
//!   deferred`).
//!
//! An invalid call (or buffered answer) is corrected like a whole answer: a corrective
//! attempt, then the route's next target, then `output_invalid`. When nothing was sent
//! yet, the client gets the accepted attempt's stream from its first event, and a final
//! failure is a plain 502. When the first attempt's text was already sent, the
//! corrective attempt continues the same answer: its opening events and its text (and
//! thinking/reasoning) are dropped, since the client already has an answer's text, and
//! only its tool calls are released, their indices (and the Responses API's
//! `sequence_number`s, final `output` and response id) renumbered to follow what was
//! sent: the SDKs' stream helpers refuse a stream whose response changes identity.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::Arc,
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::{stream::BoxStream, StreamExt};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use serde_json::{json, Map, Value};
use tower::{Service, ServiceExt};

use super::{
    context::{Call, TargetIndex},
    recovery::Answered,
};
use crate::{
    api::{
        sse::{Splitter, SseEvent},
        stream_error_event,
    },
    error::GatewayError,
    policy::trail::Step,
    upstream::ReplyBody,
    validation::{
        corrective_request,
        stream::{Assembler, Read},
        Expectations, Format, Invalid,
    },
};

/// How the whole-answer verdict is applied to a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// Hold every event until the verdict (a content schema, `validation.stream =
    /// "buffer"`).
    Buffer,
    /// Hold tool calls only; a content verdict comes at the end.
    Incremental,
    /// Hold nothing; flag an invalid answer at the end.
    Annotate,
}

pub(super) struct Settings {
    pub plan: Plan,
    pub corrective_retries: u32,
}

/// An event waiting to be released.
struct Queued {
    event: SseEvent,
    call: Option<u64>,
    terminal: bool,
    opening: bool,
}

/// Holds events until what they wait for is checked, and releases them in order.
struct Gate {
    queue: VecDeque<Queued>,
    unchecked: HashSet<u64>,
    hold_all: bool,
    hold_terminal: bool,
    /// Something past the opening events was released.
    opened: bool,
}

impl Gate {
    fn new(plan: Plan, checks_content: bool) -> Gate {
        Gate {
            queue: VecDeque::new(),
            unchecked: HashSet::new(),
            hold_all: plan == Plan::Buffer && checks_content,
            hold_terminal: checks_content,
            opened: false,
        }
    }

    fn push(&mut self, event: SseEvent, read: &Read, hold_calls: bool) {
        let call = read.call.filter(|_| hold_calls);
        if let Some(call) = call {
            self.unchecked.insert(call);
        }
        self.queue.push_back(Queued {
            event,
            call,
            terminal: read.terminal,
            opening: read.opening,
        });
    }

    /// Whether `q` must wait (for its call's check, or the whole-answer verdict).
    fn waits(&self, q: &Queued) -> bool {
        self.hold_all
            || q.call.is_some_and(|c| self.unchecked.contains(&c))
            || (q.terminal && self.hold_terminal)
    }

    fn release(&mut self) -> Vec<Queued> {
        let mut out = Vec::new();
        if !self.opened {
            // Opening events go with the first event after them, once it can.
            match self.queue.iter().find(|q| !q.opening) {
                Some(first) if !self.waits(first) => self.opened = true,
                _ => return out,
            }
        }
        while let Some(front) = self.queue.front() {
            if self.waits(front) {
                break;
            }
            out.extend(self.queue.pop_front());
        }
        out
    }
}

/// What the client has been sent, for a corrective attempt to follow on from.
#[derive(Default)]
struct Sent {
    any: bool,
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
    calls: Vec<(String, Value)>,
}

impl Sent {
    fn note(&mut self, format: Format, event: &SseEvent) {
        self.any = true;
        let Some(json) = &event.json else { return };
        match format {
            Format::Chat => {
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
            Format::Messages => {
                if event.kind() == Some("content_block_start") {
                    let index = json.get("index").and_then(Value::as_u64).unwrap_or(0);
                    self.blocks = self.blocks.max(index + 1);
                }
            }
            Format::Responses => {
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
        }
    }
}

/// Rewrites a corrective attempt's events to continue an answer the client already has.
/// [`Follow::map`] drops what the client must not see twice (opening events, text) as
/// events arrive; [`Follow::renumber`] gives what is released the next indices as it is
/// sent, so a call dropped in between (a repeat of one already sent) leaves no gap.
struct Follow {
    format: Format,
    next_index: u64,
    remap: HashMap<u64, u64>,
    dropped: HashSet<u64>,
    next_sequence: u64,
    prior_items: Vec<Value>,
    items: Vec<Value>,
    response_id: Option<Value>,
}

impl Follow {
    fn after(format: Format, sent: &Sent) -> Follow {
        Follow {
            format,
            next_index: match format {
                Format::Chat => sent.chat_calls.len() as u64,
                Format::Messages => sent.blocks,
                Format::Responses => sent.outputs,
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
    fn map(&mut self, event: SseEvent) -> Option<SseEvent> {
        let Some(mut json) = event.json.clone() else {
            return Some(event);
        };
        match self.format {
            Format::Chat => {
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
            Format::Messages => {
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
            Format::Responses => {
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
    fn renumber(&mut self, event: SseEvent) -> SseEvent {
        let Some(mut json) = event.json.clone() else {
            return event;
        };
        match self.format {
            Format::Chat => {
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
            Format::Messages => {
                let Some(from) = json.get("index").and_then(Value::as_u64) else {
                    return event;
                };
                json["index"] = json!(self.index(from));
            }
            Format::Responses => {
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

/// Why the stream could not even start: answered before any event was sent.
pub(super) enum Early {
    /// The upstream's own non-2xx answer, as the client's response.
    Reply(Box<Response<Body>>),
    Error(GatewayError),
}

type Source = BoxStream<'static, Result<Bytes, axum::Error>>;

pub(super) struct StreamRun<S> {
    inner: S,
    call: Call,
    expectations: Arc<Expectations>,
    settings: Settings,
    format: Format,
    original: Map<String, Value>,
    json: Map<String, Value>,
    start: TargetIndex,
    next: Option<TargetIndex>,
    round: u32,
    attempts: u32,
    corrected: bool,
    head: Option<(StatusCode, HeaderMap)>,
    source: Option<Source>,
    splitter: Splitter,
    assembler: Assembler,
    gate: Gate,
    follow: Option<Follow>,
    sent: Sent,
    /// Calls checked valid and not yet released, by the assembler's key.
    checked: HashMap<u64, (String, Value)>,
    out: VecDeque<Bytes>,
    verdict_done: bool,
    done: bool,
    last: Option<Invalid>,
}

impl<S> StreamRun<S>
where
    S: Service<Call, Response = Answered, Error = GatewayError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    pub(super) fn new(
        inner: S,
        call: Call,
        expectations: Arc<Expectations>,
        settings: Settings,
    ) -> Self {
        let format = Format::of(call.endpoint());
        let original = call.request.json.clone();
        let checks_content = expectations.checks_content();
        StreamRun {
            inner,
            gate: Gate::new(settings.plan, checks_content),
            settings,
            expectations,
            format,
            json: original.clone(),
            original,
            start: TargetIndex(0),
            next: Some(TargetIndex(1)),
            round: 0,
            attempts: 0,
            corrected: false,
            head: None,
            source: None,
            splitter: Splitter::default(),
            assembler: Assembler::new(format),
            follow: None,
            sent: Sent::default(),
            checked: HashMap::new(),
            out: VecDeque::new(),
            verdict_done: false,
            done: false,
            last: None,
            call,
        }
    }

    /// Runs until the first event can be sent: the response to give the client, its
    /// body relaying the rest.
    pub(super) async fn respond(mut self) -> Result<Response<Body>, Early> {
        self.attempt().await?;
        self.pull().await?;
        let (status, mut headers) = self.head.take().unwrap_or_default();
        headers.remove(http::header::CONTENT_LENGTH);
        let outcome = match (self.settings.plan, self.expectations.checks_content()) {
            (Plan::Buffer, true) if self.corrected => "corrected",
            (Plan::Buffer, true) => "valid",
            _ => "deferred",
        };
        headers.insert("x-backstop-validation", HeaderValue::from_static(outcome));
        let first: Vec<Bytes> = self.out.drain(..).collect();
        let head = futures_util::stream::iter(first.into_iter().map(Ok::<_, std::io::Error>));
        let rest = futures_util::stream::unfold(self, |mut run| async move {
            if let Err(early) = run.pull().await {
                // Only before the first event; kept for completeness.
                let code = match early {
                    Early::Error(err) => err.code().as_str(),
                    Early::Reply(_) => "upstream_error",
                };
                run.done = true;
                return Some((
                    stream_error_event(run.call.endpoint(), code, "the stream could not continue"),
                    run,
                ));
            }
            let chunk = run.out.pop_front()?;
            Some((chunk, run))
        })
        .map(Ok::<_, std::io::Error>);
        let mut response = Response::new(Body::from_stream(head.chain(rest)));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        Ok(response)
    }

    /// Starts the next attempt with `self.json` from `self.start`.
    async fn attempt(&mut self) -> Result<(), Early> {
        let mut call = self.call.with_json(self.json.clone());
        call.start = self.start;
        self.attempts += 1;
        let answered = self.inner.clone().oneshot(call).await;
        let Answered { reply, by } = match answered {
            Ok(a) => a,
            Err(err) => return self.fail(Early::Error(err)),
        };
        if !reply.status.is_success() {
            tracing::debug!(
                status = reply.status.as_u16(),
                "validated stream's attempt refused"
            );
            return self.fail(Early::Reply(Box::new(reply.into_response())));
        }
        self.next = by.map_or(self.next, |by| by.next());
        let ReplyBody::Stream(body) = reply.body else {
            return self.fail(Early::Error(GatewayError::UpstreamMalformed {
                upstream: "-".into(),
            }));
        };
        if !self.sent.any {
            self.head = Some((reply.status, reply.headers));
        }
        self.source = Some(body.into_data_stream().boxed());
        Ok(())
    }

    /// A failure before anything was sent is the response; after, an error event.
    fn fail(&mut self, early: Early) -> Result<(), Early> {
        if !self.sent.any {
            return Err(early);
        }
        let (code, message) = match &early {
            Early::Error(err) => (err.code().as_str(), err.to_string()),
            Early::Reply(r) => (
                "upstream_error",
                format!(
                    "the corrective attempt was answered with HTTP {}",
                    r.status().as_u16()
                ),
            ),
        };
        self.end_with(stream_error_event(self.call.endpoint(), code, &message));
        Ok(())
    }

    fn end_with(&mut self, event: Bytes) {
        self.source = None;
        self.out.push_back(event);
        self.done = true;
    }

    /// Reads on until there is something to send, or the stream is over.
    async fn pull(&mut self) -> Result<(), Early> {
        while self.out.is_empty() && !self.done {
            let Some(source) = self.source.as_mut() else {
                self.done = true;
                break;
            };
            let (events, ended) = match source.next().await {
                Some(Ok(chunk)) => (self.splitter.push(&chunk), false),
                // The relay ends a broken stream with its own error event; a body error
                // here is the connection itself failing.
                Some(Err(_)) | None => (self.splitter.finish().into_iter().collect(), true),
            };
            let mut restarted = false;
            for event in events {
                if self.event(event).await? {
                    restarted = true;
                    break;
                }
            }
            if ended && !restarted && !self.done {
                self.end().await?;
            }
        }
        Ok(())
    }

    /// Takes one event; `true` when it made the run start another attempt.
    async fn event(&mut self, event: SseEvent) -> Result<bool, Early> {
        let event = match self.follow.as_mut() {
            Some(follow) => match follow.map(event) {
                Some(event) => event,
                None => return Ok(false),
            },
            None => event,
        };
        let read = self.assembler.read(&event);
        let hold_calls = self.settings.plan != Plan::Annotate;
        self.gate.push(event, &read, hold_calls);
        for key in &read.completed {
            let verdict = self.expectations.check(&self.assembler.call_answer(*key));
            match verdict {
                Ok(()) => self.accept_call(*key),
                Err(invalid) if self.settings.plan == Plan::Annotate => {
                    self.gate.unchecked.remove(key);
                    self.last.get_or_insert(invalid);
                }
                Err(invalid) => return self.invalid(invalid).await.map(|()| true),
            }
        }
        if read.terminal && !self.verdict_done && self.verdict().await? {
            return Ok(true);
        }
        self.flush();
        Ok(false)
    }

    /// The whole-answer verdict (content schema); `true` when it restarted the run.
    async fn verdict(&mut self) -> Result<bool, Early> {
        self.verdict_done = true;
        if !self.gate.hold_terminal {
            return Ok(false);
        }
        let answer = self.assembler.answer();
        let expectations = self.expectations.clone();
        let verdict = tokio::task::spawn_blocking(move || expectations.check(&answer))
            .await
            .map_err(|_| Early::Error(GatewayError::Internal))?;
        let invalid = match verdict {
            Ok(()) => {
                self.gate.hold_all = false;
                self.gate.hold_terminal = false;
                return Ok(false);
            }
            Err(invalid) => invalid,
        };
        match self.settings.plan {
            Plan::Buffer => self.invalid(invalid).await.map(|()| true),
            Plan::Incremental => {
                count_failure(&invalid);
                // Passthrough: what was relayed stays; the closing event does not come.
                self.flush_before_terminal();
                let message = format!(
                    "the answer failed validation: {}",
                    invalid.errors.join("; ")
                );
                self.end_with(stream_error_event(
                    self.call.endpoint(),
                    "output_invalid",
                    &message,
                ));
                metrics::counter!("backstop_stream_validation_total", "outcome" => "invalid_passthrough")
                    .increment(1);
                Ok(true)
            }
            Plan::Annotate => {
                self.last.get_or_insert(invalid);
                self.gate.hold_terminal = false;
                Ok(false)
            }
        }
    }

    /// The stream ended: complete what is open, judge, release the rest.
    async fn end(&mut self) -> Result<(), Early> {
        for key in self.assembler.finish() {
            match self.expectations.check(&self.assembler.call_answer(key)) {
                Ok(()) => self.accept_call(key),
                Err(invalid) if self.settings.plan != Plan::Annotate => {
                    self.invalid(invalid).await?;
                    return Ok(());
                }
                Err(invalid) => {
                    self.last.get_or_insert(invalid);
                    self.gate.unchecked.remove(&key);
                }
            }
        }
        if !self.verdict_done && self.verdict().await? {
            return Ok(());
        }
        self.gate.hold_all = false;
        self.gate.hold_terminal = false;
        self.gate.opened = true;
        self.flush();
        if let Some(invalid) = self.last.take() {
            // Annotate, and the stream never sent its closing event: flag at the end.
            count_failure(&invalid);
            self.out.push_back(self.flag(&invalid));
        }
        if self.corrected {
            metrics::counter!("backstop_validation_fixed_total").increment(1);
        }
        self.done = true;
        Ok(())
    }

    fn flush(&mut self) {
        if self.settings.plan == Plan::Annotate && !self.gate.hold_terminal {
            if let Some(invalid) = self.last.take() {
                // The flag goes just before the closing event.
                if self.gate.queue.iter().any(|q| q.terminal) {
                    self.flush_before_terminal();
                    count_failure(&invalid);
                    self.out.push_back(self.flag(&invalid));
                } else {
                    self.last = Some(invalid);
                }
            }
        }
        for q in self.gate.release() {
            self.send(q);
        }
    }

    /// Sends what is queued up to the closing event, checked or not.
    fn flush_before_terminal(&mut self) {
        while self.gate.queue.front().is_some_and(|q| !q.terminal) {
            let q = self.gate.queue.pop_front().expect("front exists");
            self.send(q);
        }
    }

    /// A call whose arguments checked valid: released in turn; or, in a corrective
    /// attempt that repeats a call the client already has (same name and arguments),
    /// dropped with its events, so the client does not run it twice.
    fn accept_call(&mut self, key: u64) {
        let identity = self.assembler.call_identity(key);
        let repeat = self.follow.is_some()
            && identity
                .as_ref()
                .is_some_and(|id| self.sent.calls.contains(id));
        if repeat {
            self.gate.queue.retain(|q| q.call != Some(key));
            metrics::counter!("backstop_stream_repeated_calls_dropped_total").increment(1);
        } else if let Some(identity) = identity {
            self.checked.insert(key, identity);
        }
        self.gate.unchecked.remove(&key);
    }

    fn send(&mut self, q: Queued) {
        let event = match self.follow.as_mut() {
            Some(follow) => follow.renumber(q.event),
            None => q.event,
        };
        if let Some(identity) = q.call.and_then(|key| self.checked.remove(&key)) {
            self.sent.calls.push(identity);
        }
        self.sent.note(self.format, &event);
        self.out.push_back(event.raw);
    }

    /// The annotate-mode event that flags an invalid answer, in the API's framing (an
    /// event type no SDK acts on).
    fn flag(&self, invalid: &Invalid) -> Bytes {
        let (kind, errors) = (invalid.problem.label(), &invalid.errors);
        let event = match self.format {
            Format::Chat => SseEvent::write(
                None,
                &json!({"object": "chat.completion.chunk", "choices": [],
                    "backstop_validation": {"outcome": "invalid", "kind": kind, "errors": errors}}),
            ),
            Format::Messages => SseEvent::write(
                Some("backstop_validation"),
                &json!({"type": "backstop_validation", "outcome": "invalid", "kind": kind, "errors": errors}),
            ),
            Format::Responses => SseEvent::write(
                Some("backstop.validation"),
                &json!({"type": "backstop.validation", "outcome": "invalid", "kind": kind, "errors": errors}),
            ),
        };
        event.raw
    }

    /// An invalid call or answer (not in annotate mode): correct, switch, or give up.
    async fn invalid(&mut self, invalid: Invalid) -> Result<(), Early> {
        count_failure(&invalid);
        tracing::debug!(kind = invalid.problem.label(), errors = ?invalid.errors, round = self.round, "streamed answer failed validation");
        self.source = None;
        let targets = self.call.route.targets.len();
        if self.round < self.settings.corrective_retries {
            self.call
                .log
                .push_step(Step::Correct(invalid.problem.label()));
            metrics::counter!("backstop_corrective_retries_total", "kind" => invalid.problem.label())
                .increment(1);
            self.json = corrective_request(self.format, &self.json, &invalid);
            self.round += 1;
        } else {
            match self.next.filter(|n| n.0 < targets) {
                Some(next) => {
                    self.start = next;
                    self.next = Some(TargetIndex(next.0 + 1));
                    self.round = 0;
                    self.json = self.original.clone();
                    self.call.log.push_step(Step::Switch(
                        self.call.route.targets[next.0].upstream.name.clone(),
                    ));
                }
                None => {
                    let attempts = self.attempts;
                    let errors = invalid.errors.clone();
                    if !self.sent.any {
                        return Err(Early::Error(GatewayError::OutputInvalid {
                            errors,
                            attempts,
                        }));
                    }
                    let message = format!(
                        "the answer failed validation after {attempts} attempts: {}",
                        errors.join("; ")
                    );
                    self.end_with(stream_error_event(
                        self.call.endpoint(),
                        "output_invalid",
                        &message,
                    ));
                    return Ok(());
                }
            }
        }
        self.corrected = true;
        self.splitter = Splitter::default();
        self.assembler = Assembler::new(self.format);
        self.checked.clear();
        self.gate = Gate::new(self.settings.plan, self.expectations.checks_content());
        self.verdict_done = false;
        self.follow = self
            .sent
            .any
            .then(|| Follow::after(self.format, &self.sent));
        self.attempt().await
    }
}

fn count_failure(invalid: &Invalid) {
    metrics::counter!("backstop_validation_failures_total", "kind" => invalid.problem.label())
        .increment(1);
}
