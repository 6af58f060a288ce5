//! Recovery layer (inside validation, outside the response-owners and meter layers
//! around the [`Forward`](crate::upstream::Forward) leaf): target selection, retry and
//! the upstream breakers.
//!
//! Every attempt's outcome is classified once ([`classify`]) and the class alone decides:
//! - success → answered;
//! - transient → capped exponential backoff with full jitter, or the upstream's
//!   `Retry-After` when it fits `max_retry_after` and the deadline; a longer one is not
//!   waited (the next target is tried, else the upstream's 429/503 and its Retry-After go
//!   to the client at once); retries beyond the retry budget are not made;
//! - credential/quota → the breaker opens at once and the next target is tried;
//! - caller fault → passed through unchanged, never retried (a `context_length_exceeded`
//!   goes to the route's `context_fallback` when it has one);
//! - malformed → the next target is tried.
//!
//! An upstream whose breaker is open is skipped without touching the network; when every
//! target is skipped the answer is 503 `circuit_open` with Retry-After. What was done is
//! answered with the outcome ([`Answered`], [`Unanswered`]: its
//! [`Trail`](crate::telemetry::Trail)); the caller writes it into the request's record,
//! from which the edge sets `x-backstop-attempts` and `x-backstop-recovery` (e.g.
//! `retry:503,retry:503,ok`).
//!
//! Hedging ([`hedge`]) and outlier demotion ([`demotion`]) are this layer's own
//! submodules, and so is the mapping of the last failure to the client's answer
//! ([`failure`]).

use std::{
    collections::VecDeque,
    sync::Arc,
    time::{Duration, SystemTime},
};

use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

mod demotion;
mod failure;
mod hedge;
mod outcome;

pub use outcome::{follow_trail, unvalidated, Answered, AnsweredBy, Unanswered, UnvalidatedLayer};

use failure::Failure;
use outcome::answered;

use super::{
    context::{Call, TargetIndex},
    meter::{Billed, HeldContext},
    Middleware, Stack,
};
use crate::{
    api::ParsedRequest,
    error::GatewayError,
    policy::{
        backoff::{next_wait, Wait},
        breaker::{Admission, Transition, Verdict},
        classify::{classify, Class, Observed, TransportFailure},
        trail::{Reason, Step},
    },
    routing::Target,
    state::health::{HealthRegistry, UpstreamHealth},
    telemetry::Trail,
    translate::{self, AnswerContext, Direction},
    upstream::{Attempt, AttemptError, Reply, Upstream},
    wire::Wire,
};

/// How transient failures are retried: each upstream's [`RetryRules`], and the jitter.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Draws the jitter unit in [0, 1): random in production, fixed in tests.
    pub jitter: fn() -> f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            jitter: fastrand::f64,
        }
    }
}

#[derive(Clone)]
pub struct RecoveryLayer {
    policy: Arc<RetryPolicy>,
    health: Arc<HealthRegistry>,
}

impl RecoveryLayer {
    pub fn new(policy: RetryPolicy, health: Arc<HealthRegistry>) -> Self {
        RecoveryLayer {
            policy: Arc::new(policy),
            health,
        }
    }
}

pub type Recovery<S> = Stack<RecoveryLayer, S>;

impl<S> Layer<S> for RecoveryLayer {
    type Service = Recovery<S>;
    fn layer(&self, inner: S) -> Recovery<S> {
        Stack::new(self.clone(), inner)
    }
}

impl<S> Middleware<S, Call> for RecoveryLayer
where
    S: Service<Billed, Response = Reply, Error = AttemptError> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Inner = Billed;
    type Response = Answered;
    type Error = Unanswered;

    async fn call(&self, inner: S, call: Call) -> Result<Answered, Unanswered> {
        let run = |inner| Run {
            inner,
            policy: self.policy.clone(),
            health: self.health.clone(),
            trail: Trail::default(),
        };
        let hedge = call
            .route
            .hedge_after
            .filter(|_| !call.request.stream)
            .and_then(|after| Some((self.hedge_delay(&call, after)?, self.hedge_target(&call)?)));
        let Some((after, to)) = hedge else {
            return run(inner).recover(call).await;
        };
        self.hedged(run, inner, call, after, to).await
    }
}

/// Where the target loop goes next.
#[allow(clippy::large_enum_variant)]
enum Next {
    Answer(Result<Answered, GatewayError>),
    Failover,
    /// Try the other targets first, then come back to this one with the attempts it has
    /// left, not before `not_before` (its Retry-After).
    Defer {
        used: u32,
        not_before: Instant,
        reason: Reason,
    },
    /// `context_length_exceeded` with a fallback to try: the caller's answer if the
    /// fallback cannot take the request.
    ContextFallback(Box<Answered>),
}

/// A target in the queue: how many of its attempts are used, and how long to wait
/// before the next one (a deferred Retry-After).
struct Visit<'a> {
    by: AnsweredBy,
    target: &'a Target,
    /// The target speaks the other API: the request as translated for it.
    translation: Option<Arc<Translated>>,
    used: u32,
    /// A deferred target: its Retry-After, and the failure it resumes after.
    deferred: Option<(Instant, Reason)>,
}

/// A request translated for a target of the other API, judged exact before the first
/// attempt.
struct Translated {
    direction: Direction,
    request: Arc<ParsedRequest>,
    /// Fields lost because the route allowed it, for `x-backstop-translation-dropped`.
    dropped: Option<Arc<str>>,
}

/// What one classified attempt means.
#[allow(clippy::large_enum_variant)]
enum Judged {
    /// Where the target loop goes next: an answer, or the context fallback.
    Go(Next),
    /// A failure, and whether it may be retried on this target.
    Failed {
        failure: Failure,
        retry: Retry,
        reason: Reason,
    },
}

/// Whether a failure may be retried on the same target.
enum Retry {
    /// Not a transient failure: the target is left.
    Never,
    /// Transient: again after the backoff, or after what the upstream asked for.
    Allowed { after: Option<Duration> },
}

/// Whether a target can take this request.
enum Fit {
    /// It can: as it is (it speaks the caller's API), or translated exactly for it.
    Usable {
        translation: Option<Arc<Translated>>,
    },
    /// It cannot (the paths it would lose are in the trail and in `untranslatable`).
    Unfit,
}

/// One attempt's outcome, classified.
struct Tried {
    outcome: Result<Reply, TransportFailure>,
    class: Class,
    reason: Reason,
}

struct Run<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
    health: Arc<HealthRegistry>,
    trail: Trail,
}

/// No target answered: the failure, naming the targets skipped as untranslatable and
/// the paths that kept the request from them, so a caller whose live target was skipped
/// is not told only that the dead one failed. An upstream's own error passed through
/// keeps its status and headers; its message says the same.
fn skipped(
    result: Result<Answered, GatewayError>,
    untranslatable: Vec<String>,
) -> Result<Answered, GatewayError> {
    if untranslatable.is_empty() {
        return result;
    }
    let skipped = untranslatable.join("; ");
    match result {
        Ok(mut answered) if !answered.reply.status.is_success() => {
            let mut body: serde_json::Value = match serde_json::from_slice(answered.reply.bytes()) {
                Ok(body) => body,
                Err(_) => return Ok(answered),
            };
            if let Some(serde_json::Value::String(message)) = body.pointer_mut("/error/message") {
                message.push_str(&format!(
                    "; not tried, the request cannot be translated for them: {skipped}"
                ));
                let bytes = bytes::Bytes::from(body.to_string());
                answered.reply.headers.remove(http::header::CONTENT_LENGTH);
                answered.reply.body = crate::upstream::ReplyBody::Full(bytes);
            }
            Ok(answered)
        }
        Ok(answered) => Ok(answered),
        Err(error) => Err(GatewayError::Skipped {
            error: Box::new(error),
            skipped,
        }),
    }
}

/// Frees a half-open probe slot if the request is dropped before its verdict.
struct Admitted<'a> {
    health: &'a UpstreamHealth,
    admission: Admission,
    settled: bool,
}

impl Admitted<'_> {
    fn settle(mut self, verdict: Verdict) -> Option<Transition> {
        self.settled = true;
        self.health.record(self.admission, verdict, Instant::now())
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.health
                .record(self.admission, Verdict::Abandoned, Instant::now());
        }
    }
}

fn verdict(class: &Class) -> Verdict {
    match class {
        Class::Success => Verdict::Healthy,
        Class::Transient {
            rate_limited: true, ..
        } => Verdict::Failed(0.5),
        Class::Transient { .. } => Verdict::Failed(1.0),
        Class::CredentialOrQuota => Verdict::Fatal,
        Class::CallerFault { .. } | Class::Malformed | Class::Redirect => Verdict::Neutral,
    }
}

/// The attempt's class from what came back.
fn classified(outcome: &Result<Reply, TransportFailure>) -> (Class, Reason) {
    match outcome {
        Ok(reply) => {
            let class = classify(
                Observed::Response {
                    status: reply.status.as_u16(),
                    hints: crate::api::retry_hints(&reply.headers),
                    body: reply.bytes(),
                    readable: reply.is_stream() || reply.view.as_ref().is_some_and(|v| v.is_json),
                },
                SystemTime::now(),
            );
            let reason = match class {
                Class::Malformed => Reason::Malformed,
                Class::Redirect => Reason::Redirect,
                _ => Reason::Status(reply.status.as_u16()),
            };
            (class, reason)
        }
        Err(failure) => (
            classify(Observed::Transport(*failure), SystemTime::now()),
            Reason::Transport(*failure),
        ),
    }
}

impl<S> Run<S>
where
    S: Service<Billed, Response = Reply, Error = AttemptError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    async fn recover(mut self, call: Call) -> Result<Answered, Unanswered> {
        let request_timeout = call.deadline.timeout;
        let deadline = call.deadline.at;
        let route = call.route.clone();
        let mut untranslatable: Vec<String> = Vec::new();
        let mut queue: VecDeque<Visit<'_>> = VecDeque::with_capacity(route.targets.len());
        for (i, target) in route.targets.iter().enumerate().skip(call.start.0) {
            if let Fit::Usable { translation } =
                self.judge_target(&call, target, &mut untranslatable)
            {
                queue.push_back(Visit {
                    by: AnsweredBy::Target(TargetIndex(i)),
                    target,
                    translation,
                    used: 0,
                    deferred: None,
                });
            }
        }
        if queue.len() > 1 {
            self.demote_outliers(&mut queue);
        }
        if queue.is_empty() {
            if !untranslatable.is_empty() {
                return self.finish(Err(GatewayError::UnsupportedConversion {
                    model: call.request.model.clone(),
                    paths: untranslatable,
                }));
            }
            // Nothing past `start` speaks the caller's API or translates to it: a
            // route/endpoint mismatch (embeddings, `count_tokens`).
            let other = &route.targets[0];
            if other.wire(&call.request.model, call.endpoint().wire()) == Wire::Converse {
                return self.finish(Err(GatewayError::ConverseUnsupported {
                    model: call.request.model.clone(),
                    upstream: other.upstream.name.to_string(),
                    target_model: other.model_for(&call.request.model).to_string(),
                }));
            }
            return self.finish(Err(GatewayError::ApiMismatch {
                model: call.request.model.clone(),
                upstream_api: other.upstream.provider.as_str(),
                path: match other.wire(&call.request.model, Wire::Chat) {
                    Wire::Messages => "/v1/messages",
                    Wire::Chat | Wire::Responses | Wire::Converse => "/v1/chat/completions",
                },
            }));
        }
        let mut last: Option<Failure> = None;
        let mut open_for: Option<Duration> = None;
        let mut first = true;
        while let Some(Visit {
            by,
            target,
            translation,
            used,
            deferred,
        }) = queue.pop_front()
        {
            if let Some((at, reason)) = deferred {
                // Resuming is a retry of that target: the budget has its say, and its
                // Retry-After is waited only now that the others failed.
                let health = self.health.get(&target.upstream.name);
                if !health.is_some_and(|h| h.withdraw(Instant::now())) {
                    self.trail.steps.push(Step::Budget(reason));
                    continue;
                }
                tokio::time::sleep_until(at.min(deadline)).await;
            }
            if !first {
                self.trail
                    .steps
                    .push(Step::Failover(target.upstream.name.clone()));
                metrics::counter!("backstop_failovers_total", "to" => target.upstream.name.to_string()).increment(1);
            }
            first = false;
            // A healthy target still to come: worth more than waiting on this one.
            let spare = queue.iter().any(|v| {
                self.health
                    .get(&v.target.upstream.name)
                    .is_some_and(|h| h.is_closed())
            });
            match self
                .try_target(
                    &call,
                    target,
                    translation.as_ref(),
                    used,
                    spare,
                    &mut last,
                    &mut open_for,
                )
                .await
            {
                Next::Answer(mut result) => {
                    if let Ok(answered) = &mut result {
                        answered.by = Some(by);
                    }
                    return self.finish(result);
                }
                Next::Failover => {}
                Next::Defer {
                    used,
                    not_before,
                    reason,
                } => queue.push_back(Visit {
                    by,
                    target,
                    translation,
                    used,
                    deferred: Some((not_before, reason)),
                }),
                Next::ContextFallback(overflow) => {
                    let judged = route.context_fallback.as_ref().and_then(|fallback| {
                        match self.judge_target(&call, fallback, &mut untranslatable) {
                            Fit::Usable { translation } => Some((fallback, translation)),
                            Fit::Unfit => None,
                        }
                    });
                    match judged {
                        Some((fallback, translation)) => {
                            queue.clear();
                            queue.push_back(Visit {
                                by: AnsweredBy::ContextFallback,
                                target: fallback,
                                translation,
                                used: 0,
                                deferred: None,
                            });
                        }
                        // The fallback cannot carry it: the overflow is the answer.
                        None => {
                            let mut answered = *overflow;
                            answered.by = Some(by);
                            return self.finish(Ok(answered));
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        let result = match last {
            Some(failure) => failure.answer(request_timeout),
            None => match open_for {
                Some(wait) => Err(GatewayError::CircuitOpen { retry_after: wait }),
                None => Err(GatewayError::RequestTimeout(request_timeout)),
            },
        };
        self.finish(skipped(result, untranslatable))
    }

    /// Whether a target can take this request, and translated how.
    fn judge_target(
        &mut self,
        call: &Call,
        target: &Target,
        untranslatable: &mut Vec<String>,
    ) -> Fit {
        let upstream = &target.upstream;
        let target_wire = target.wire(&call.request.model, call.endpoint().wire());
        let direction = match Direction::between(call.endpoint(), target_wire) {
            Ok(None) => return Fit::Usable { translation: None },
            Ok(Some(direction)) => direction,
            Err(()) => return Fit::Unfit,
        };
        let options = translate::request::Options {
            drop: &call.route.translate_drop,
            max_tokens: target.max_tokens,
        };
        match translate::request::convert(direction, &call.request, options) {
            Ok(converted) => Fit::Usable {
                translation: Some(Arc::new(Translated {
                    direction,
                    request: Arc::new(
                        call.request
                            .translated(direction.target_endpoint(), converted.json),
                    ),
                    dropped: (!converted.dropped.is_empty())
                        .then(|| Arc::from(converted.dropped.join(","))),
                })),
            },
            Err(lost) => {
                let paths = lost.paths.join(" ");
                untranslatable.push(format!("{}: {paths}", upstream.name));
                self.trail.steps.push(Step::Untranslatable {
                    upstream: upstream.name.clone(),
                    paths: paths.into(),
                });
                Fit::Unfit
            }
        }
    }

    /// Attempts on one target until it answers, or is to be left.
    #[allow(clippy::too_many_arguments)]
    async fn try_target(
        &mut self,
        call: &Call,
        target: &Target,
        translation: Option<&Arc<Translated>>,
        used: u32,
        spare: bool,
        last: &mut Option<Failure>,
        open_for: &mut Option<Duration>,
    ) -> Next {
        let upstream = &target.upstream;
        let registry = self.health.clone();
        let Some(health) = registry.get(&upstream.name) else {
            return Next::Answer(Err(GatewayError::Internal));
        };
        let deadline = call.deadline.at;
        let rules = upstream.retry;
        if let Some(translation) = translation.filter(|_| used == 0) {
            self.trail
                .steps
                .push(Step::Translate(translation.direction.label()));
        }
        for attempt_no in used..rules.max_attempts {
            let now = Instant::now();
            let admitted = match health.admit(now) {
                Ok(admission) => Admitted {
                    health,
                    admission,
                    settled: false,
                },
                Err(wait) => {
                    self.trail.steps.push(Step::Open(upstream.name.clone()));
                    *open_for = Some(open_for.map_or(wait, |w| w.min(wait)));
                    return Next::Failover;
                }
            };
            if attempt_no == 0 {
                health.deposit(now);
            }
            let remaining = deadline.saturating_duration_since(now);
            if remaining.is_zero() {
                return Next::Failover;
            }
            let timeout = upstream.attempt_timeout.min(remaining);
            let started = Instant::now();
            let tried = match self.attempt(call, target, translation, timeout).await {
                Ok(tried) => tried,
                Err(refusal) => {
                    // Refused before any network: no verdict on the upstream.
                    drop(admitted);
                    self.trail
                        .steps
                        .push(Step::Refused(refusal.code().as_str()));
                    return Next::Answer(Err(refusal));
                }
            };
            metrics::counter!("backstop_upstream_attempts_total", "upstream" => upstream.name.to_string(), "class" => tried.class.label()).increment(1);
            health.count_attempt(Instant::now(), &tried.class);
            let opened = admitted.settle(verdict(&tried.class)) == Some(Transition::Opened);
            tracing::debug!(upstream = %upstream.name, attempt = attempt_no + 1, class = tried.class.label(), reason = %tried.reason, "upstream attempt");
            if tried.class == Class::Success {
                health.record_latency(started.elapsed());
            }
            let judged = self.judge(call, tried, upstream, timeout);
            if attempt_no > 0 {
                // What the retry budget learns: did the retry it granted work?
                health.record_retry(Instant::now(), matches!(judged, Judged::Go(_)));
            }
            let (failure, retry, reason) = match judged {
                Judged::Go(next) => return next,
                Judged::Failed {
                    failure,
                    retry,
                    reason,
                } => (failure, retry, reason),
            };
            *last = Some(failure);
            // Only transient failures are retried on the same target, and not once
            // this failure has opened its breaker.
            let retry_after = match retry {
                Retry::Allowed { after } if !opened && attempt_no + 1 < rules.max_attempts => after,
                _ => {
                    self.trail.steps.push(Step::GiveUp(reason));
                    return Next::Failover;
                }
            };
            // Waiting here (the upstream's Retry-After, or after a hang) is slower than
            // an attempt on a healthy target now.
            // (A Retry-After past the cap or the deadline is not waited at all: below.)
            let waitable =
                |d: Duration| d <= rules.max_retry_after && Instant::now() + d < deadline;
            let waits = retry_after.is_some_and(|d| !d.is_zero() && waitable(d))
                || reason == Reason::Transport(TransportFailure::Timeout);
            if spare && waits {
                // Not given up: the other targets go first, then this one resumes.
                self.trail.steps.push(Step::Defer(reason));
                return Next::Defer {
                    used: attempt_no + 1,
                    not_before: Instant::now() + retry_after.unwrap_or_default(),
                    reason,
                };
            }
            if !self
                .wait_to_retry(health, upstream, attempt_no, retry_after, reason, deadline)
                .await
            {
                return Next::Failover;
            }
        }
        Next::Failover
    }

    /// One attempt on one target, timed and counted. `Err` is a refusal made before any
    /// network (a budget).
    async fn attempt(
        &mut self,
        call: &Call,
        target: &Target,
        translation: Option<&Arc<Translated>>,
        timeout: Duration,
    ) -> Result<Tried, GatewayError> {
        let model = target.model.clone();
        let request = translation.map_or(&call.request, |t| &t.request);
        let span = call.log.trace().map(|trace| {
            let asked = model.as_deref().unwrap_or(&call.request.model);
            let upstream = &target.upstream;
            trace.attempt(
                &upstream.name,
                upstream.provider.gen_ai_provider(),
                request.endpoint,
                asked,
            )
        });
        let billed = Billed {
            attempt: Attempt {
                request: request.clone(),
                upstream: target.upstream.clone(),
                model: model.clone(),
                headers: call.headers.clone(),
                timeout,
                stream_usage: false,
                keep_answer: call.keep_answer,
                trace: span.as_ref().map(|s| s.context().clone()),
                translation: translation.map(|t| AnswerContext {
                    direction: t.direction,
                    caller: call.request.clone(),
                }),
            },
            tenant: call.tenant.clone(),
            session: call.session.clone(),
            log: call.log.clone(),
            held: HeldContext::default(),
            prepaid: call.prepaid.clone(),
        };
        let started = std::time::Instant::now();
        let outcome = match self.inner.clone().oneshot(billed).await {
            Ok(reply) => Ok(reply),
            Err(AttemptError::Transport(failure)) => Err(failure),
            Err(AttemptError::Refused(refusal)) => {
                if let Some(span) = span {
                    span.refused(refusal.code().as_str());
                }
                return Err(refusal);
            }
        };
        self.trail.attempts += 1;
        self.trail.upstream = Some(target.upstream.name.clone());
        // The caller's model is in the request's record already: only a rewrite is kept.
        self.trail.model = model;
        self.trail.dropped = translation.and_then(|t| t.dropped.clone());
        self.trail.upstream_time += started.elapsed();
        let (class, reason) = classified(&outcome);
        if let (Some(span), Some(trace)) = (span, call.log.trace()) {
            let status = outcome.as_ref().map(|r| r.status.as_u16()).map_err(|f| *f);
            span.finish(trace, status, &class);
        }
        Ok(Tried {
            outcome,
            class,
            reason,
        })
    }

    /// What one classified attempt means, by its class alone.
    fn judge(
        &mut self,
        call: &Call,
        tried: Tried,
        upstream: &crate::upstream::Upstream,
        timeout: Duration,
    ) -> Judged {
        let Tried {
            outcome,
            class,
            reason,
        } = tried;
        let failure = match outcome {
            Ok(reply) => match class {
                Class::Success => {
                    self.trail.steps.push(Step::Ok);
                    return Judged::Go(Next::Answer(Ok(answered(reply))));
                }
                Class::CallerFault {
                    context_length: true,
                } if !self
                    .trail
                    .steps
                    .iter()
                    .any(|s| matches!(s, Step::Fallback(_))) =>
                {
                    if let Some(fallback) = &call.route.context_fallback {
                        self.trail
                            .steps
                            .push(Step::Fallback(fallback.upstream.name.clone()));
                        return Judged::Go(Next::ContextFallback(Box::new(answered(reply))));
                    }
                    self.trail.steps.push(Step::Pass(reason));
                    return Judged::Go(Next::Answer(Ok(answered(reply))));
                }
                Class::CallerFault { .. } => {
                    self.trail.steps.push(Step::Pass(reason));
                    return Judged::Go(Next::Answer(Ok(answered(reply))));
                }
                _ => Failure::Reply {
                    reply,
                    class,
                    upstream: upstream.name.clone(),
                },
            },
            Err(failure) => Failure::Transport {
                failure,
                upstream: upstream.name.clone(),
                timeout,
                cut_by_deadline: timeout < upstream.attempt_timeout,
            },
        };
        let retry = match class {
            Class::Transient { retry_after, .. } => Retry::Allowed { after: retry_after },
            _ => Retry::Never,
        };
        Judged::Failed {
            failure,
            retry,
            reason,
        }
    }

    /// Waits out the backoff (or the upstream's Retry-After) before the next attempt on
    /// the same target; `false` when this target is to be left instead.
    async fn wait_to_retry(
        &mut self,
        health: &UpstreamHealth,
        upstream: &Upstream,
        attempt_no: u32,
        retry_after: Option<Duration>,
        reason: Reason,
        deadline: Instant,
    ) -> bool {
        let rules = upstream.retry;
        let backoff = rules.backoff.delay(attempt_no, (self.policy.jitter)());
        let remaining = deadline.saturating_duration_since(Instant::now());
        match next_wait(retry_after, backoff, rules.max_retry_after, remaining) {
            Wait::Retry(_) if !health.withdraw(Instant::now()) => {
                self.trail.steps.push(Step::Budget(reason));
                false
            }
            Wait::Retry(wait) => {
                self.trail.steps.push(Step::Retry(reason));
                metrics::counter!("backstop_retries_total", "upstream" => upstream.name.to_string())
                    .increment(1);
                tokio::time::sleep(wait).await;
                true
            }
            Wait::RetryAfterTooLong(_) | Wait::PastDeadline => {
                self.trail.steps.push(Step::GiveUp(reason));
                false
            }
        }
    }

    /// The outcome with its trail. (A large `Err`: it is moved once per call, never per
    /// attempt, and boxing it would cost an allocation on every failure answered.)
    #[allow(clippy::result_large_err)]
    fn finish(mut self, result: Result<Answered, GatewayError>) -> Result<Answered, Unanswered> {
        match result {
            Ok(answered) => {
                if answered.reply.status.as_u16() >= 400 {
                    // An upstream error answered as it came: its own code, for the fleet's
                    // failure signatures (read on this failure path only).
                    self.trail.upstream_error =
                        crate::policy::classify::provider_error(answered.reply.bytes())
                            .map(Arc::new);
                }
                Ok(Answered {
                    trail: self.trail,
                    ..answered
                })
            }
            Err(error) => Err(Unanswered {
                error,
                trail: self.trail,
            }),
        }
    }
}
