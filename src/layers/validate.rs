//! Validate layer (inside the session guard, outside recovery and so outside target
//! selection and retry): when a request
//! expects structured output (a `response_format`, tools, or its route's
//! `response_schema`), every answer is checked; an invalid one is sent back to the model
//! with its own output and the validator's errors by JSON path, up to
//! `corrective_retries` times per target; then the route's next target is tried (a
//! strategy switch); finally 502 `output_invalid` with the errors. Requests that expect
//! nothing pass straight through, unparsed.
//!
//! The request's schemas are limited (`validation.max_tools`, `max_schema_bytes`,
//! `max_request_schema_bytes`, and the shape limits of [`crate::validation::shape`]) and
//! refused with 400 `invalid_schema` before any upstream call; those not cached for the
//! tenant are compiled on a blocking thread, at most `max_concurrent_compiles` at once,
//! so a slow compilation neither stalls other clients nor outlives the request deadline.
//!
//! A streamed request that needs validation streams: tool calls are held only until
//! their arguments are checked, a content schema is buffered or passed through by
//! `validation.stream` ([`super::validate_stream`]).
//!
//! `/v1/responses` is validated the same way in its own shape: `text.format`
//! (`json_schema`, `json_object`) against the `output_text` of its message items, each
//! `function_call` item's `arguments` against its function tool's `parameters`; the
//! correction is appended as new `input` items.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Response};
use tower::{Layer, Service, ServiceExt};

use super::{
    context::{Call, TargetIndex},
    recovery::{follow_trail, unvalidated, Answered, Unanswered},
    validate_stream::{Early, Plan, Settings, StreamRun},
    Middleware, Stack,
};
use crate::{
    config::{StreamValidation, ValidationConfig, ValidationMode},
    error::GatewayError,
    policy::trail::Step,
    telemetry::Trail,
    upstream::{Reply, ReplyBody},
    validation::{corrective_request, Expectations, Invalid, Schemas},
};

#[derive(Clone)]
pub struct ValidateLayer {
    schemas: Arc<Schemas>,
    config: ValidationConfig,
}

impl ValidateLayer {
    pub fn new(schemas: Arc<Schemas>, config: ValidationConfig) -> Self {
        ValidateLayer { schemas, config }
    }
}

pub type Validate<S> = Stack<ValidateLayer, S>;

impl<S> Layer<S> for ValidateLayer {
    type Service = Validate<S>;
    fn layer(&self, inner: S) -> Validate<S> {
        Stack::new(self.clone(), inner)
    }
}

fn outcome_header(response: &mut Response<Body>, value: &'static str) {
    response
        .headers_mut()
        .insert("x-backstop-validation", HeaderValue::from_static(value));
}

/// A whole reply as the client's response, with its body.
fn response(reply: Reply, body: Body) -> Response<Body> {
    let mut out = Response::new(body);
    *out.status_mut() = reply.status;
    *out.headers_mut() = reply.headers;
    out
}

impl<S> Middleware<S, Call> for ValidateLayer
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, inner: S, call: Call) -> Result<Response<Body>, GatewayError> {
        let layer = self;
        let pending = Expectations::collect(
            call.endpoint().wire(),
            &call.request.json,
            call.route.response_schema.as_ref(),
            &layer.schemas,
            &call.tenant,
        )
        .map_err(|bad| GatewayError::InvalidSchema(bad.0))?;
        let Some(pending) = pending else {
            return unvalidated(inner, call).await;
        };
        let expectations = if pending.needs_compile() {
            // Off the async workers, one of `max_concurrent_compiles` at a time. The
            // permit goes with the work, so a request that times out (the deadline
            // drops this future) still holds it until its compilation ends.
            let permit = layer.schemas.permit().await;
            let schemas = layer.schemas.clone();
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                pending.compile(&schemas)
            })
            .await
            .map_err(|_| GatewayError::Internal)?
        } else {
            pending.compile(&layer.schemas)
        }
        .map_err(|bad| GatewayError::InvalidSchema(bad.0))?;
        if call.request.stream {
            let stream = call.route.validation_stream.unwrap_or(layer.config.stream);
            let plan = match (layer.config.mode, stream) {
                (ValidationMode::Annotate, _) => Plan::Annotate,
                (ValidationMode::Enforce, StreamValidation::Buffer) => Plan::Buffer,
                (ValidationMode::Enforce, StreamValidation::Passthrough) => Plan::Incremental,
            };
            let settings = Settings {
                plan,
                corrective_retries: layer.config.corrective_retries,
            };
            let run = StreamRun::new(inner, call, Arc::new(expectations), settings);
            return match run.respond().await {
                Ok(response) => Ok(response),
                Err(Early::Reply(response)) => Ok(*response),
                Err(Early::Error(err)) => Err(err),
            };
        }
        // What recovery did in every run, and the corrections between: written into the
        // request's record once, however the validation ends.
        let mut trail = Trail::default();
        let result = run(
            inner,
            &layer.config,
            Arc::new(expectations),
            &call,
            &mut trail,
        )
        .await;
        call.log.set_recovery(trail);
        result
    }
}

async fn run<S>(
    inner: S,
    config: &ValidationConfig,
    expectations: Arc<Expectations>,
    call: &Call,
    trail: &mut Trail,
) -> Result<Response<Body>, GatewayError>
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let targets = call.route.targets.len();
    let mut start = TargetIndex(0);
    let mut attempts = 0;
    let mut last: Option<Invalid> = None;
    while start.0 < targets {
        // The request as the client sent it, shared, until a correction changes it: a
        // large body is not copied (nor re-serialised) for a call that needs none.
        let mut json: Option<serde_json::Map<String, serde_json::Value>> = None;
        let mut next = Some(TargetIndex(start.0 + 1));
        for round in 0..=config.corrective_retries {
            let mut attempt = match &json {
                None => call.clone(),
                Some(json) => call.with_json(json.clone()),
            };
            attempt.start = start;
            attempt.keep_answer = true;
            let (mut reply, by) = follow_trail(inner.clone().oneshot(attempt).await, trail)?;
            attempts += 1;
            if !reply.status.is_success() {
                return Ok(reply.into_response());
            }
            next = by.map_or(next, |by| by.next());
            // The leaf parsed the answer once, for this.
            let answer = reply.view.as_mut().and_then(|v| v.json.take());
            let (Some(answer), ReplyBody::Full(bytes)) = (
                answer,
                std::mem::replace(&mut reply.body, ReplyBody::Full(Bytes::new())),
            ) else {
                return Err(GatewayError::UpstreamMalformed {
                    upstream: "-".into(),
                });
            };
            // Validation is CPU work that grows with the answer and the schema: off the
            // async workers.
            let verdict = {
                let expectations = expectations.clone();
                tokio::task::spawn_blocking(move || expectations.check(&answer))
                    .await
                    .map_err(|_| GatewayError::Internal)?
            };
            let fixed = round > 0 || start.0 > 0;
            let invalid = match verdict {
                Ok(()) => {
                    if fixed {
                        metrics::counter!("backstop_validation_fixed_total").increment(1);
                    }
                    let mut response = response(reply, Body::from(bytes));
                    outcome_header(&mut response, if fixed { "corrected" } else { "valid" });
                    return Ok(response);
                }
                Err(invalid) => invalid,
            };
            metrics::counter!("backstop_validation_failures_total", "kind" => invalid.problem.label()).increment(1);
            tracing::debug!(kind = invalid.problem.label(), errors = ?invalid.errors, round, "answer failed validation");
            if config.mode == ValidationMode::Annotate {
                let mut response = response(reply, Body::from(bytes));
                outcome_header(&mut response, "invalid");
                if let Ok(first) =
                    HeaderValue::from_str(&invalid.errors[0].chars().take(512).collect::<String>())
                {
                    response
                        .headers_mut()
                        .insert("x-backstop-validation-error", first);
                }
                return Ok(response);
            }
            if round < config.corrective_retries {
                trail.steps.push(Step::Correct(invalid.problem.label()));
                metrics::counter!("backstop_corrective_retries_total", "kind" => invalid.problem.label()).increment(1);
                let sent = json.as_ref().unwrap_or(&call.request.json);
                json = Some(corrective_request(call.endpoint().wire(), sent, &invalid));
            }
            last = Some(invalid);
        }
        // Corrections exhausted on this target: switch strategy to the next one.
        let Some(after) = next else { break };
        start = after;
        if start.0 < targets {
            trail.steps.push(Step::Switch(
                call.route.targets[start.0].upstream.name.clone(),
            ));
        }
    }
    let errors = last.map_or_else(Vec::new, |i| i.errors);
    Err(GatewayError::OutputInvalid { errors, attempts })
}
