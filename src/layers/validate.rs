//! Validate layer (pipeline step 6, outside target selection and retry): when a request
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
//! A streamed request that needs validation is fetched whole (the upstream is asked not
//! to stream), validated, corrected if needed, and replayed to the client as SSE in its
//! API's format: the client's first byte waits for the valid answer. That is the price
//! of never showing an agent output that breaks its schema.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{header, HeaderValue, Request, Response};
use serde_json::{Map, Value};
use tower::{Layer, Service, ServiceExt};

use crate::{
    config::{ValidationConfig, ValidationMode},
    error::GatewayError,
    layers::{
        context::RequestContext,
        recovery::{AnsweredBy, StartAt},
    },
    telemetry::RequestLog,
    validation::{corrective_request, replay, Expectations, Invalid, Schemas},
};

/// Largest upstream answer read for validation.
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

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

impl<S> Layer<S> for ValidateLayer {
    type Service = Validate<S>;
    fn layer(&self, inner: S) -> Validate<S> {
        Validate {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Validate<S> {
    inner: S,
    layer: ValidateLayer,
}

/// The request without streaming: validation needs the whole answer.
fn unstreamed(json: &Map<String, Value>) -> Map<String, Value> {
    let mut json = json.clone();
    if json.get("stream") == Some(&Value::Bool(true)) {
        json.insert("stream".into(), Value::Bool(false));
        json.remove("stream_options");
    }
    json
}

fn outcome_header(response: &mut Response<Body>, value: &'static str) {
    response
        .headers_mut()
        .insert("x-backstop-validation", HeaderValue::from_static(value));
}

impl<S> Service<Request<Body>> for Validate<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = super::take_ready(&mut self.inner);
        let layer = self.layer.clone();
        Box::pin(async move {
            let ctx = RequestContext::of(&req)?;
            let api = ctx.endpoint.api();
            let pending = Expectations::collect(
                api,
                &ctx.json,
                ctx.route.response_schema.as_ref(),
                &layer.schemas,
                &ctx.tenant,
            )
            .map_err(|bad| GatewayError::InvalidSchema(bad.0))?;
            let Some(pending) = pending else {
                return inner.oneshot(req).await;
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
            run(inner, layer.config, Arc::new(expectations), ctx, req).await
        })
    }
}

async fn run<S>(
    inner: S,
    config: ValidationConfig,
    expectations: Arc<Expectations>,
    ctx: Arc<RequestContext>,
    req: Request<Body>,
) -> Result<Response<Body>, GatewayError>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let (parts, _) = req.into_parts();
    let log = parts.extensions.get::<Arc<RequestLog>>().cloned();
    let step = |s: &str| {
        if let Some(log) = &log {
            log.push_step(s);
        }
    };
    let original = unstreamed(&ctx.json);
    let targets = ctx.route.targets.len();
    let mut start = 0;
    let mut attempts = 0;
    let mut last: Option<Invalid> = None;
    while start < targets {
        let mut json = original.clone();
        let mut answered = start;
        for round in 0..=config.corrective_retries {
            let mut attempt = Request::new(Body::empty());
            *attempt.method_mut() = parts.method.clone();
            *attempt.uri_mut() = parts.uri.clone();
            *attempt.headers_mut() = parts.headers.clone();
            *attempt.extensions_mut() = parts.extensions.clone();
            attempt
                .extensions_mut()
                .insert(Arc::new(ctx.with_json(json.clone())));
            attempt.extensions_mut().insert(StartAt(start));
            let response = inner.clone().oneshot(attempt).await?;
            attempts += 1;
            if !response.status().is_success() {
                return Ok(response);
            }
            answered = response
                .extensions()
                .get::<AnsweredBy>()
                .map_or(start, |a| a.0);
            let (mut rparts, body) = response.into_parts();
            let bytes = axum::body::to_bytes(body, MAX_ANSWER_BYTES)
                .await
                .map_err(|_| GatewayError::UpstreamMalformed {
                    upstream: "-".into(),
                })?;
            let answer: Value =
                serde_json::from_slice(&bytes).map_err(|_| GatewayError::UpstreamMalformed {
                    upstream: "-".into(),
                })?;
            // Validation is CPU work that grows with the answer and the schema: off the
            // async workers too.
            let (answer, verdict) = {
                let expectations = expectations.clone();
                tokio::task::spawn_blocking(move || {
                    let verdict = expectations.check(&answer);
                    (answer, verdict)
                })
                .await
                .map_err(|_| GatewayError::Internal)?
            };
            let invalid = match verdict {
                Ok(()) => {
                    if round > 0 || start > 0 {
                        metrics::counter!("backstop_validation_fixed_total").increment(1);
                    }
                    let mut response = if ctx.stream {
                        let sse = replay::as_sse(
                            ctx.endpoint.api(),
                            &answer,
                            ctx.client_wants_stream_usage,
                        );
                        rparts.headers.insert(
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("text/event-stream"),
                        );
                        rparts.headers.remove(header::CONTENT_LENGTH);
                        Response::from_parts(rparts, Body::from(sse))
                    } else {
                        Response::from_parts(rparts, Body::from(bytes))
                    };
                    outcome_header(
                        &mut response,
                        if round > 0 || start > 0 {
                            "corrected"
                        } else {
                            "valid"
                        },
                    );
                    return Ok(response);
                }
                Err(invalid) => invalid,
            };
            metrics::counter!("backstop_validation_failures_total", "kind" => invalid.problem.label()).increment(1);
            tracing::debug!(kind = invalid.problem.label(), errors = ?invalid.errors, round, "answer failed validation");
            if config.mode == ValidationMode::Annotate {
                let mut response = Response::from_parts(rparts, Body::from(bytes));
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
                step(&format!("correct:{}", invalid.problem.label()));
                metrics::counter!("backstop_corrective_retries_total", "kind" => invalid.problem.label()).increment(1);
                json = corrective_request(&json, &invalid);
            }
            last = Some(invalid);
        }
        // Corrections exhausted on this target: switch strategy to the next one.
        start = answered.saturating_add(1);
        if start < targets {
            step(&format!(
                "switch:{}",
                ctx.route.targets[start].upstream.name
            ));
        }
    }
    let errors = last.map_or_else(Vec::new, |i| i.errors);
    Err(GatewayError::OutputInvalid { errors, attempts })
}
