//! Meter layer (attempt level, between recovery and the upstream leaf): every upstream
//! call, retries and failovers included, reserves its worst case against the session's
//! and the tenant's budgets before it is made, and settles to the upstream's reported
//! usage after. Refuses with 402 `budget_exceeded` (naming the budget) or
//! `unpriced_model`, before any network; recovery never retries a refusal.
//!
//! The worst case is the prompt estimated from the body size plus the request's
//! `max_tokens` (or `billing.default_max_tokens`). OpenAI streams are asked for
//! `stream_options.include_usage` when the client did not ask, and that extra chunk is
//! removed from what the client receives; a stream settles when it ends.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures_util::future::BoxFuture;
use serde::Deserialize;
use tower::{Layer, Service, ServiceExt};

use crate::{
    api::Endpoint,
    budgets::Budgets,
    config::ApiKind,
    policy::{budget::estimate_prompt_tokens, classify::TransportFailure},
    upstream::{Attempt, AttemptError, Reply},
};

#[derive(Clone)]
pub struct MeterLayer {
    budgets: Arc<Budgets>,
}

impl MeterLayer {
    pub fn new(budgets: Arc<Budgets>) -> Self {
        MeterLayer { budgets }
    }
}

impl<S> Layer<S> for MeterLayer {
    type Service = Meter<S>;
    fn layer(&self, inner: S) -> Meter<S> {
        Meter {
            inner,
            budgets: self.budgets.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Meter<S> {
    inner: S,
    budgets: Arc<Budgets>,
}

#[derive(Deserialize)]
struct WithUsage {
    usage: Option<UsageFields>,
}

#[derive(Deserialize)]
struct UsageFields {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

/// (input, output) tokens from a non-streaming body, in either API's format.
pub fn reported_usage(api: ApiKind, body: &[u8]) -> Option<(u64, u64)> {
    let usage = serde_json::from_slice::<WithUsage>(body).ok()?.usage?;
    match api {
        ApiKind::OpenAi => Some((
            usage.prompt_tokens.unwrap_or(0),
            usage.completion_tokens.unwrap_or(0),
        )),
        ApiKind::Anthropic => Some((
            usage.input_tokens.unwrap_or(0),
            usage.output_tokens.unwrap_or(0),
        )),
    }
}

impl<S> Service<Attempt> for Meter<S>
where
    S: Service<Attempt, Response = Reply, Error = TransportFailure> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Reply;
    type Error = AttemptError;
    type Future = BoxFuture<'static, Result<Reply, AttemptError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), AttemptError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut attempt: Attempt) -> Self::Future {
        let inner = self.inner.clone();
        let budgets = self.budgets.clone();
        Box::pin(async move {
            let ctx = attempt.ctx.clone();
            let model = attempt.model.as_deref().unwrap_or(&ctx.model).to_string();
            let max_output = match ctx.endpoint {
                Endpoint::Embeddings => 0,
                _ => ctx.max_output_tokens.unwrap_or(budgets.default_max_tokens),
            };
            let reservation = budgets
                .reserve(
                    &ctx.tenant,
                    ctx.session_id.as_deref(),
                    &model,
                    estimate_prompt_tokens(ctx.body.len()),
                    max_output,
                )
                .map_err(|refusal| AttemptError::Refused(refusal.into()))?;
            attempt.stream_usage = ctx.stream
                && ctx.endpoint == Endpoint::ChatCompletions
                && !ctx.client_wants_stream_usage;
            let result = inner.oneshot(attempt).await;
            match &result {
                Err(_) => reservation.settle(None).await,
                Ok(reply) => match &reply.stream_usage {
                    Some(usage) => usage.on_end(move |reported| reservation.settle_later(reported)),
                    None => {
                        let reported = reply
                            .status
                            .is_success()
                            .then(|| reported_usage(ctx.endpoint.api(), reply.bytes()))
                            .flatten();
                        reservation.settle(reported).await;
                    }
                },
            }
            result.map_err(AttemptError::from)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_both_apis() {
        assert_eq!(
            reported_usage(
                ApiKind::OpenAi,
                br#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#
            ),
            Some((5, 7))
        );
        assert_eq!(
            reported_usage(
                ApiKind::OpenAi,
                br#"{"usage":{"prompt_tokens":9,"total_tokens":9}}"#
            ),
            Some((9, 0))
        );
        assert_eq!(
            reported_usage(
                ApiKind::Anthropic,
                br#"{"usage":{"input_tokens":3,"output_tokens":4}}"#
            ),
            Some((3, 4))
        );
        assert_eq!(reported_usage(ApiKind::OpenAi, br#"{"id":"x"}"#), None);
        assert_eq!(reported_usage(ApiKind::OpenAi, b"not json"), None);
    }
}
