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
    collections::{HashMap, VecDeque},
    sync::Arc,
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::{stream::BoxStream, StreamExt};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use serde_json::{json, Map, Value};
use tower::{Service, ServiceExt};

pub(in crate::layers) mod follow;
mod gate;

use follow::{Follow, Sent};
use gate::{Gate, Queued};

use super::{
    context::{Call, TargetIndex},
    recovery::{follow_trail, Answered, Unanswered},
};
use crate::{
    error::GatewayError,
    policy::trail::Step,
    telemetry::Trail,
    upstream::ReplyBody,
    validation::{corrective_request, stream::Assembler, Expectations, Invalid},
    wire::{
        sse::{Splitter, SseEvent},
        stream_error_event, Wire,
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
    format: Wire,
    original: Map<String, Value>,
    json: Map<String, Value>,
    start: TargetIndex,
    next: Option<TargetIndex>,
    round: u32,
    attempts: u32,
    /// What recovery did in every attempt, and the corrections between.
    trail: Trail,
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
    stage: Stage,
    last: Option<Invalid>,
}

/// Where the current attempt's stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Events are read and released.
    Reading,
    /// The whole-answer verdict is made; the rest of the stream is read.
    Judged,
    /// Nothing more will be sent.
    Over,
}

impl<S> StreamRun<S>
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    pub(super) fn new(
        inner: S,
        call: Call,
        expectations: Arc<Expectations>,
        settings: Settings,
    ) -> Self {
        let format = call.endpoint().wire();
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
            trail: Trail::default(),
            head: None,
            source: None,
            splitter: Splitter::default(),
            assembler: Assembler::new(format),
            follow: None,
            sent: Sent::default(),
            checked: HashMap::new(),
            out: VecDeque::new(),
            stage: Stage::Reading,
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
            (Plan::Buffer, true) if self.corrected() => "corrected",
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
                run.stage = Stage::Over;
                return Some((
                    stream_error_event(
                        run.call.endpoint().wire(),
                        code,
                        "the stream could not continue",
                    ),
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
        let answered = follow_trail(answered, &mut self.trail);
        // The trail so far: a later correction (mid-stream) writes it again, longer.
        self.call.log.set_recovery(self.trail.clone());
        let (reply, by) = match answered {
            Ok(answered) => answered,
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
        self.end_with(stream_error_event(
            self.call.endpoint().wire(),
            code,
            &message,
        ));
        Ok(())
    }

    fn end_with(&mut self, event: Bytes) {
        self.source = None;
        self.out.push_back(event);
        self.stage = Stage::Over;
    }

    /// A corrective attempt was made (every attempt after the first is one).
    fn corrected(&self) -> bool {
        self.attempts > 1
    }

    /// Reads on until there is something to send, or the stream is over.
    async fn pull(&mut self) -> Result<(), Early> {
        while self.out.is_empty() && self.stage != Stage::Over {
            let Some(source) = self.source.as_mut() else {
                self.stage = Stage::Over;
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
            if ended && !restarted && self.stage != Stage::Over {
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
        if read.terminal && self.stage == Stage::Reading && self.verdict().await? {
            return Ok(true);
        }
        self.flush();
        Ok(false)
    }

    /// The whole-answer verdict (content schema); `true` when it restarted the run.
    async fn verdict(&mut self) -> Result<bool, Early> {
        self.stage = Stage::Judged;
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
                    self.call.endpoint().wire(),
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
        if self.stage == Stage::Reading && self.verdict().await? {
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
        if self.corrected() {
            metrics::counter!("backstop_validation_fixed_total").increment(1);
        }
        self.stage = Stage::Over;
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
            Wire::Chat | Wire::Converse => SseEvent::write(
                None,
                &json!({"object": "chat.completion.chunk", "choices": [],
                    "backstop_validation": {"outcome": "invalid", "kind": kind, "errors": errors}}),
            ),
            Wire::Messages => SseEvent::write(
                Some("backstop_validation"),
                &json!({"type": "backstop_validation", "outcome": "invalid", "kind": kind, "errors": errors}),
            ),
            Wire::Responses => SseEvent::write(
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
            self.trail
                .steps
                .push(Step::Correct(invalid.problem.label()));
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
                    self.trail.steps.push(Step::Switch(
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
                        self.call.endpoint().wire(),
                        "output_invalid",
                        &message,
                    ));
                    return Ok(());
                }
            }
        }
        self.splitter = Splitter::default();
        self.assembler = Assembler::new(self.format);
        self.checked.clear();
        self.gate = Gate::new(self.settings.plan, self.expectations.checks_content());
        self.stage = Stage::Reading;
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
