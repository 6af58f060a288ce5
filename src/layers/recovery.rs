//! Recovery layer (pipeline steps 7–9): target selection, retry and the upstream
//! breakers, around the [`Forward`](crate::upstream::Forward) leaf.
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
//! written to the request log, from which the edge layer sets `x-backstop-attempts` and
//! `x-backstop-recovery` (e.g. `retry:503,retry:503,ok`).

use std::{
    collections::VecDeque,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{HeaderMap, Request, Response};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use crate::{
    config::ApiKind,
    error::{GatewayError, Protocol},
    layers::{context::RequestContext, deadline::Deadline},
    policy::{
        backoff::{next_wait, Backoff, Wait},
        breaker::{Admission, Transition, Verdict},
        classify::{classify, Class, Observed, TransportFailure},
    },
    routing::Target,
    state::health::{HealthRegistry, UpstreamHealth},
    telemetry::RequestLog,
    upstream::{Attempt, AttemptError, Reply},
};

/// Asks recovery to start at this target index (a strategy switch by an outer layer).
#[derive(Clone, Copy, Debug)]
pub struct StartAt(pub usize);

/// Put on a successful response: the index of the target that answered
/// (`usize::MAX` for the context fallback).
#[derive(Clone, Copy, Debug)]
pub struct AnsweredBy(pub usize);

/// How transient failures are retried.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub backoff: Backoff,
    pub max_retry_after: Duration,
    /// Draws the jitter unit in [0, 1): random in production, fixed in tests.
    pub jitter: fn() -> f64,
}

impl RetryPolicy {
    pub fn from_config(config: &crate::config::RetryConfig) -> Self {
        RetryPolicy {
            max_attempts: config.max_attempts,
            backoff: Backoff {
                base: config.base_delay,
                max: config.max_delay,
            },
            max_retry_after: config.max_retry_after,
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

impl<S> Layer<S> for RecoveryLayer {
    type Service = Recovery<S>;
    fn layer(&self, inner: S) -> Recovery<S> {
        Recovery {
            inner,
            policy: self.policy.clone(),
            health: self.health.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Recovery<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
    health: Arc<HealthRegistry>,
}

impl<S> Service<Request<Body>> for Recovery<S>
where
    S: Service<Attempt, Response = Reply> + Clone + Send + 'static,
    S::Error: Into<AttemptError>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let run = Run {
            inner: self.inner.clone(),
            policy: self.policy.clone(),
            health: self.health.clone(),
            trail: Trail::default(),
        };
        Box::pin(async move {
            let (parts, _) = req.into_parts();
            let ctx = parts
                .extensions
                .get::<Arc<RequestContext>>()
                .cloned()
                .ok_or(GatewayError::Internal)?;
            let deadline = parts
                .extensions
                .get::<Deadline>()
                .copied()
                .unwrap_or(Deadline {
                    at: Instant::now() + Duration::from_secs(3600),
                    timeout: Duration::from_secs(3600),
                });
            let log = parts.extensions.get::<Arc<RequestLog>>().cloned();
            let start = parts.extensions.get::<StartAt>().map_or(0, |s| s.0);
            run.recover(ctx, Arc::new(parts.headers), deadline, log, start)
                .await
        })
    }
}

/// What recovery did, in order: written to the log and the response headers.
#[derive(Default)]
struct Trail {
    steps: Vec<String>,
    upstream: Option<Arc<str>>,
    attempts: u32,
    upstream_time: Duration,
}

/// The last failure seen, answered when nothing succeeds.
enum Failure {
    Reply {
        reply: Reply,
        class: Class,
        upstream: Arc<str>,
    },
    Transport {
        failure: TransportFailure,
        upstream: Arc<str>,
        timeout: Duration,
        /// The attempt's timeout was cut short by the request deadline.
        cut_by_deadline: bool,
    },
}

/// Where the target loop goes next.
enum Next {
    Answer(Result<Response<Body>, GatewayError>),
    Failover,
    ContextFallback,
}

struct Run<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
    health: Arc<HealthRegistry>,
    trail: Trail,
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

impl<S> Run<S>
where
    S: Service<Attempt, Response = Reply> + Clone + Send + 'static,
    S::Error: Into<AttemptError>,
    S::Future: Send + 'static,
{
    async fn recover(
        mut self,
        ctx: Arc<RequestContext>,
        headers: Arc<HeaderMap>,
        deadline: Deadline,
        log: Option<Arc<RequestLog>>,
        start: usize,
    ) -> Result<Response<Body>, GatewayError> {
        let request_timeout = deadline.timeout;
        let deadline = deadline.at;
        let api = ctx.endpoint.api();
        let route = ctx.route.clone();
        let mut queue: VecDeque<(usize, &Target)> = route
            .targets
            .iter()
            .enumerate()
            .skip(start)
            .filter(|(_, t)| t.upstream.api == api)
            .collect();
        if queue.is_empty() {
            // Nothing past `start` speaks the caller's API: a route/endpoint mismatch.
            let other = route.targets[0].upstream.api;
            return Err(GatewayError::ApiMismatch {
                model: ctx.model.clone(),
                upstream_api: other.as_str(),
                path: match other {
                    ApiKind::OpenAi => "/v1/chat/completions",
                    ApiKind::Anthropic => "/v1/messages",
                },
            });
        }
        let mut last: Option<Failure> = None;
        let mut open_for: Option<Duration> = None;
        let mut first = true;
        while let Some((index, target)) = queue.pop_front() {
            if !first {
                self.trail
                    .steps
                    .push(format!("failover:{}", target.upstream.name));
                metrics::counter!("backstop_failovers_total", "to" => target.upstream.name.to_string()).increment(1);
            }
            first = false;
            match self
                .try_target(&ctx, target, &headers, deadline, &mut last, &mut open_for)
                .await
            {
                Next::Answer(mut result) => {
                    if let Ok(response) = &mut result {
                        response.extensions_mut().insert(AnsweredBy(index));
                    }
                    return self.finish(result, log);
                }
                Next::Failover => {}
                Next::ContextFallback => match route
                    .context_fallback
                    .as_ref()
                    .filter(|f| f.upstream.api == api)
                {
                    Some(fallback) => {
                        queue.clear();
                        queue.push_back((usize::MAX, fallback));
                    }
                    None => break,
                },
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        let result = match last {
            Some(failure) => self.answer_failure(failure, request_timeout),
            None => match open_for {
                Some(wait) => Err(GatewayError::CircuitOpen { retry_after: wait }),
                None => Err(GatewayError::RequestTimeout(request_timeout)),
            },
        };
        self.finish(result, log)
    }

    /// Attempts on one target until it answers, or is to be left.
    async fn try_target(
        &mut self,
        ctx: &Arc<RequestContext>,
        target: &Target,
        headers: &Arc<HeaderMap>,
        deadline: Instant,
        last: &mut Option<Failure>,
        open_for: &mut Option<Duration>,
    ) -> Next {
        let upstream = &target.upstream;
        let Some(health) = self.health.get(&upstream.name) else {
            return Next::Answer(Err(GatewayError::Internal));
        };
        let model: Option<Arc<str>> = target.model.as_deref().map(Arc::from);
        for attempt_no in 0..self.policy.max_attempts {
            let now = Instant::now();
            let admission = match health.admit(now) {
                Ok(a) => a,
                Err(wait) => {
                    self.trail.steps.push(format!("open:{}", upstream.name));
                    *open_for = Some(open_for.map_or(wait, |w| w.min(wait)));
                    return Next::Failover;
                }
            };
            let admitted = Admitted {
                health,
                admission,
                settled: false,
            };
            if attempt_no == 0 {
                health.deposit(now);
            }
            let remaining = deadline.saturating_duration_since(now);
            if remaining.is_zero() {
                return Next::Failover;
            }
            let timeout = upstream.attempt_timeout.min(remaining);
            let attempt = Attempt {
                ctx: ctx.clone(),
                upstream: upstream.clone(),
                model: model.clone(),
                headers: headers.clone(),
                timeout,
                stream_usage: false,
            };
            let started = std::time::Instant::now();
            let outcome = match self
                .inner
                .clone()
                .oneshot(attempt)
                .await
                .map_err(Into::into)
            {
                Ok(reply) => Ok(reply),
                Err(AttemptError::Transport(failure)) => Err(failure),
                Err(AttemptError::Refused(refusal)) => {
                    // Refused before any network: no verdict on the upstream.
                    drop(admitted);
                    self.trail
                        .steps
                        .push(format!("refused:{}", refusal.kind().code));
                    return Next::Answer(Err(refusal));
                }
            };
            self.trail.attempts += 1;
            self.trail.upstream = Some(upstream.name.clone());
            self.trail.upstream_time += started.elapsed();
            let class = match &outcome {
                Ok(reply) => classify(
                    Observed::Response {
                        status: reply.status.as_u16(),
                        headers: &reply.headers,
                        body: reply.bytes(),
                        streaming: reply.is_stream(),
                    },
                    SystemTime::now(),
                ),
                Err(failure) => classify(Observed::Transport(*failure), SystemTime::now()),
            };
            let reason = match &outcome {
                Ok(_) if class == Class::Malformed => "malformed".to_string(),
                Ok(_) if class == Class::Redirect => "redirect".to_string(),
                Ok(reply) => reply.status.as_str().to_string(),
                Err(failure) => failure.label().to_string(),
            };
            metrics::counter!("backstop_upstream_attempts_total", "upstream" => upstream.name.to_string(), "class" => class.label()).increment(1);
            let opened = admitted.settle(verdict(&class)) == Some(Transition::Opened);
            tracing::debug!(upstream = %upstream.name, attempt = attempt_no + 1, class = class.label(), %reason, "upstream attempt");
            let failure = match outcome {
                Ok(reply) => match class {
                    Class::Success => {
                        self.trail.steps.push("ok".into());
                        return Next::Answer(Ok(reply.into_response()));
                    }
                    Class::CallerFault {
                        context_length: true,
                    } if ctx.route.context_fallback.is_some()
                        && !self.trail.steps.iter().any(|s| s.starts_with("fallback:")) =>
                    {
                        let to = ctx
                            .route
                            .context_fallback
                            .as_ref()
                            .map_or("", |f| &f.upstream.name);
                        self.trail.steps.push(format!("fallback:{to}"));
                        return Next::ContextFallback;
                    }
                    Class::CallerFault { .. } => {
                        self.trail.steps.push(format!("pass:{reason}"));
                        return Next::Answer(Ok(reply.into_response()));
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
            let retry_after = match class {
                Class::Transient { retry_after, .. } => Some(retry_after),
                _ => None,
            };
            *last = Some(failure);
            // Only transient failures are retried on the same target, and not once
            // this failure has opened its breaker.
            let Some(retry_after) =
                retry_after.filter(|_| !opened && attempt_no + 1 < self.policy.max_attempts)
            else {
                self.trail.steps.push(format!("giveup:{reason}"));
                return Next::Failover;
            };
            let backoff = self
                .policy
                .backoff
                .delay(attempt_no, (self.policy.jitter)());
            let remaining = deadline.saturating_duration_since(Instant::now());
            match next_wait(retry_after, backoff, self.policy.max_retry_after, remaining) {
                Wait::Retry(_) if !health.withdraw(Instant::now()) => {
                    self.trail.steps.push(format!("budget:{reason}"));
                    return Next::Failover;
                }
                Wait::Retry(wait) => {
                    self.trail.steps.push(format!("retry:{reason}"));
                    metrics::counter!("backstop_retries_total", "upstream" => upstream.name.to_string()).increment(1);
                    tokio::time::sleep(wait).await;
                }
                Wait::RetryAfterTooLong(_) | Wait::PastDeadline => {
                    self.trail.steps.push(format!("giveup:{reason}"));
                    return Next::Failover;
                }
            }
        }
        Next::Failover
    }

    /// The answer when no target succeeded: the upstream's own response where it tells
    /// the client something true (429/503 with Retry-After, quota), a typed error where
    /// it would mislead (the provider refusing *Backstop's* key is not the client's 401).
    fn answer_failure(
        &self,
        failure: Failure,
        request_timeout: Duration,
    ) -> Result<Response<Body>, GatewayError> {
        match failure {
            Failure::Reply {
                reply,
                class: Class::CredentialOrQuota,
                upstream,
            } if matches!(reply.status.as_u16(), 401 | 403) => Err(GatewayError::UpstreamAuth {
                upstream: upstream.to_string(),
                status: reply.status.as_u16(),
            }),
            Failure::Reply {
                class: Class::Malformed,
                upstream,
                ..
            } => Err(GatewayError::UpstreamMalformed {
                upstream: upstream.to_string(),
            }),
            Failure::Reply {
                reply,
                class: Class::Redirect,
                upstream,
            } => Err(GatewayError::UpstreamProtocol {
                upstream: upstream.to_string(),
                problem: Protocol::Redirect(reply.status.as_u16()),
            }),
            Failure::Transport {
                failure: failure @ (TransportFailure::TooLarge | TransportFailure::NotAStream),
                upstream,
                ..
            } => Err(GatewayError::UpstreamProtocol {
                upstream: upstream.to_string(),
                problem: if failure == TransportFailure::TooLarge {
                    Protocol::TooLarge
                } else {
                    Protocol::NotAStream
                },
            }),
            Failure::Reply { reply, .. } => Ok(reply.into_response()),
            // Out of time because the client's deadline came, not because the upstream
            // was slower than its own attempt timeout.
            Failure::Transport {
                failure: TransportFailure::Timeout,
                cut_by_deadline: true,
                ..
            } => Err(GatewayError::RequestTimeout(request_timeout)),
            Failure::Transport {
                failure: TransportFailure::Timeout,
                upstream,
                timeout,
                ..
            } => Err(GatewayError::UpstreamTimeout {
                upstream: upstream.to_string(),
                timeout,
            }),
            Failure::Transport { upstream, .. } => Err(GatewayError::UpstreamUnavailable {
                upstream: upstream.to_string(),
            }),
        }
    }

    fn finish(
        self,
        result: Result<Response<Body>, GatewayError>,
        log: Option<Arc<RequestLog>>,
    ) -> Result<Response<Body>, GatewayError> {
        if let Some(log) = log {
            let trail = self.trail;
            // Appended: an outer layer (validation) may run recovery more than once.
            log.update(|f| {
                f.attempts += trail.attempts;
                f.upstream_time += trail.upstream_time;
                if !trail.steps.is_empty() {
                    if !f.recovery.is_empty() {
                        f.recovery.push(',');
                    }
                    f.recovery.push_str(&trail.steps.join(","));
                }
                if trail.upstream.is_some() {
                    f.upstream = trail.upstream;
                }
            });
        }
        result
    }
}
