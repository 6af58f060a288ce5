//! Meter layer (attempt level, between recovery and the upstream leaf): every upstream
//! call, retries and failovers included, reserves its worst case against the session's
//! and the tenant's budgets before it is made, and settles to the upstream's reported
//! usage after. Refuses with 402 `budget_exceeded` (naming the budget) or
//! `unpriced_model`, or 503 `store_unavailable` when a budgeted call's reservation
//! cannot be made durable, before any network; recovery never retries a refusal.
//! Reported usage is read here and judged where the reservation settles
//! ([`Outcome`]): a count that is not a count, or an implausible one, is charged the
//! reservation instead.
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
use serde_json::Value;
use tower::{Layer, Service, ServiceExt};

use crate::{
    api::Endpoint,
    config::ApiKind,
    policy::{budget::estimate_prompt_tokens, classify::TransportFailure},
    state::{budgets::Budgets, reservation::Outcome},
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

/// The usage a successful non-streaming body reports, in either API's format: absent
/// fields count 0; a field that is not a non-negative integer makes the report invalid.
pub fn reported_usage(api: ApiKind, body: &[u8]) -> Outcome {
    /// Only `usage` is built; the rest of the answer is skipped, not parsed into values.
    #[derive(serde::Deserialize)]
    struct WithUsage {
        #[serde(default)]
        usage: Option<Value>,
    }
    let Ok(WithUsage { usage: Some(usage) }) = serde_json::from_slice::<WithUsage>(body) else {
        return Outcome::Unreported;
    };
    if !usage.is_object() {
        return Outcome::Unreported;
    }
    let (input, output) = match api {
        ApiKind::OpenAi => ("prompt_tokens", "completion_tokens"),
        ApiKind::Anthropic => ("input_tokens", "output_tokens"),
    };
    let count = |field: &str| match usage.get(field) {
        None | Some(Value::Null) => Some(0),
        Some(v) => v.as_u64(),
    };
    match (count(input), count(output)) {
        (Some(input), Some(output)) => Outcome::Reported { input, output },
        _ => Outcome::Invalid,
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
                .await
                .map_err(|refusal| AttemptError::Refused(refusal.into()))?;
            attempt.stream_usage = ctx.stream
                && ctx.endpoint == Endpoint::ChatCompletions
                && !ctx.client_wants_stream_usage;
            let result = inner.oneshot(attempt).await;
            match &result {
                Err(_) => reservation.settle(Outcome::Failed).await,
                Ok(reply) => match &reply.stream_usage {
                    Some(usage) => usage.on_end(move |reported| {
                        reservation.settle_later(match reported {
                            Some((input, output)) => Outcome::Reported { input, output },
                            None => Outcome::Unreported,
                        })
                    }),
                    None if reply.status.is_success() => {
                        let outcome = reported_usage(ctx.endpoint.api(), reply.bytes());
                        reservation.settle(outcome).await;
                    }
                    None => reservation.settle(Outcome::Failed).await,
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
        let reported = |input, output| Outcome::Reported { input, output };
        assert_eq!(
            reported_usage(
                ApiKind::OpenAi,
                br#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#
            ),
            reported(5, 7)
        );
        assert_eq!(
            reported_usage(
                ApiKind::OpenAi,
                br#"{"usage":{"prompt_tokens":9,"total_tokens":9}}"#
            ),
            reported(9, 0)
        );
        assert_eq!(
            reported_usage(
                ApiKind::Anthropic,
                br#"{"usage":{"input_tokens":3,"output_tokens":4}}"#
            ),
            reported(3, 4)
        );
        assert_eq!(
            reported_usage(ApiKind::OpenAi, br#"{"id":"x"}"#),
            Outcome::Unreported
        );
        assert_eq!(
            reported_usage(ApiKind::OpenAi, b"not json"),
            Outcome::Unreported
        );
    }

    #[test]
    fn usage_that_is_not_a_count_is_invalid_not_zero() {
        for usage in [
            r#"{"prompt_tokens":-1,"completion_tokens":5}"#,
            r#"{"prompt_tokens":1.5,"completion_tokens":5}"#,
            r#"{"prompt_tokens":1,"completion_tokens":1e30}"#,
            r#"{"prompt_tokens":"12","completion_tokens":5}"#,
        ] {
            let body = format!(r#"{{"usage":{usage}}}"#);
            assert_eq!(
                reported_usage(ApiKind::OpenAi, body.as_bytes()),
                Outcome::Invalid,
                "{usage}"
            );
        }
    }
}
