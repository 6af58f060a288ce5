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
//! `max_tokens` (`max_output_tokens` for `/v1/responses`; else
//! `billing.default_max_tokens`) for each answer it asks for (chat's `n`), plus the input the provider adds from what it holds
//! for the call ([`HeldContext`], set by the owners layer): a chained Responses call
//! reserves its previous response's recorded context on top of its body, and one that
//! names context Backstop cannot size reserves at least the tenant's
//! `min_input_tokens`. Settling is still to the reported usage. OpenAI chat streams are asked for
//! `stream_options.include_usage` when the client did not ask, and that extra chunk is
//! removed from what the client receives (a Responses stream always reports usage in
//! `response.completed`, so it is asked for nothing); a stream settles when it ends. A
//! stream that ends before its final usage event (a client that left, a cut upstream)
//! settles at the larger of the counts it reported so far, with the reserved output,
//! and the reservation ([`Outcome::Partial`]): the provider bills the output it
//! generated whether or not anyone read it.

use std::sync::Arc;

use tower::{Layer, Service};

use super::{Middleware, Stack};
use crate::{
    api::{prompt::MediaRules, Endpoint, ParsedRequest, ReportedUsage},
    billing::Tokens,
    error::GatewayError,
    policy::classify::TransportFailure,
    state::budgets::{
        reservation::{Ask, Outcome, Prepaid},
        Budgets,
    },
    telemetry::RequestLog,
    upstream::{stream::StreamEnd, Attempt, AttemptError, Reply},
    wire::Wire,
};

/// An attempt and who pays for it: what recovery hands the meter, which hands the leaf
/// the [`Attempt`] alone.
#[derive(Clone)]
pub struct Billed {
    pub attempt: Attempt,
    pub tenant: Arc<str>,
    pub session: Option<Arc<str>>,
    /// The request's log: the usage settled here is added to it.
    pub log: Arc<RequestLog>,
    /// Input the provider adds to the body from what it holds for this call.
    pub held: HeldContext,
    /// The first attempt's reservation, made with the request's gate (replica mode):
    /// taken by the attempt that asks what it was made for.
    pub prepaid: Option<Arc<Prepaid>>,
}

/// What an attempt of `request` asking `model` of an upstream speaking `api` reserves:
/// the body's input estimate (its media at that provider's token rules) plus what the
/// provider holds for it, the output it may produce, whether the prompt may be written
/// to the cache, and the web searches it may make.
pub fn ask(
    budgets: &Budgets,
    tenant: &str,
    model: &str,
    api: Wire,
    request: &ParsedRequest,
    held: HeldContext,
) -> Ask {
    let rules = match api {
        Wire::Messages => MediaRules::Anthropic { model },
        Wire::Chat | Wire::Responses | Wire::Converse => MediaRules::OpenAi { model },
    };
    let prompt = &request.prompt;
    Ask {
        model: model.to_string(),
        input_tokens: held.input_tokens(
            prompt.input_tokens(request.body.len(), rules),
            budgets.min_input_tokens(tenant),
        ),
        max_output: match request.endpoint {
            Endpoint::Embeddings => 0,
            _ => request
                .max_output_tokens
                // A background response runs unwatched: it may write all the model can.
                .or_else(|| {
                    is_background(request)
                        .then(|| budgets.max_output_of(model))
                        .flatten()
                })
                .unwrap_or(budgets.default_max_tokens)
                .saturating_mul(request.choices),
        },
        cache: prompt.cache,
        web_searches: prompt.web_searches,
    }
}

/// A Responses create that runs in the background (`background: true`): answered at
/// once, its usage known only later (see [`crate::state::budgets::background`]).
pub fn is_background(request: &ParsedRequest) -> bool {
    request.endpoint == Endpoint::Responses
        && request.json.get("background") == Some(&serde_json::Value::Bool(true))
}

/// The input tokens a call costs beyond its body, from objects the provider holds
/// (set by the owners layer for a Responses create; nothing for other calls).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldContext {
    /// Known: the recorded context of the previous response it chains onto.
    pub tokens: u64,
    /// It also names context of a size Backstop does not know (a conversation, an item
    /// reference, a stored prompt, a file, a previous response whose size is unknown).
    pub unsized_context: bool,
}

impl HeldContext {
    /// The input to reserve for a body estimated at `body_tokens`, with `floor` for
    /// context of unknown size.
    pub fn input_tokens(self, body_tokens: u64, floor: u64) -> u64 {
        let known = body_tokens.saturating_add(self.tokens);
        if self.unsized_context {
            known.max(floor)
        } else {
            known
        }
    }
}

#[derive(Clone)]
pub struct MeterLayer {
    budgets: Arc<Budgets>,
}

impl MeterLayer {
    pub fn new(budgets: Arc<Budgets>) -> Self {
        MeterLayer { budgets }
    }
}

pub type Meter<S> = Stack<MeterLayer, S>;

impl<S> Layer<S> for MeterLayer {
    type Service = Meter<S>;
    fn layer(&self, inner: S) -> Meter<S> {
        Stack::new(self.clone(), inner)
    }
}

impl<S> Middleware<S, Billed> for MeterLayer
where
    S: Service<Attempt, Response = Reply, Error = TransportFailure> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Attempt;
    type Response = Reply;
    type Error = AttemptError;

    async fn call(&self, mut inner: S, billed: Billed) -> Result<Reply, AttemptError> {
        let Billed {
            mut attempt,
            tenant,
            session,
            log,
            held,
            prepaid,
        } = billed;
        let budgets = &self.budgets;
        let request = attempt.request.clone();
        let model = attempt.model.as_deref().unwrap_or(&request.model);
        let ask = ask(
            budgets,
            &tenant,
            model,
            attempt.upstream.wire(model, request.endpoint.wire()),
            &request,
            held,
        );
        let background = is_background(&request);
        if background && budgets.refuses_background(&tenant, session.is_some()) {
            return Err(AttemptError::Refused(GatewayError::InvalidParameter {
                param: "background",
                detail: "background responses are refused for a USD-capped tenant or session (billing.background = \"refuse\"): their cost is known only after the call".into(),
            }));
        }
        let reservation = match prepaid.and_then(|p| p.take(&ask)) {
            Some(reservation) => reservation,
            None => budgets
                .reserve(&tenant, session.as_deref(), &ask)
                .await
                .map_err(|refusal| AttemptError::Refused(refusal.into()))?,
        };
        attempt.stream_usage = request.stream
            && request.endpoint == Endpoint::ChatCompletions
            && !request.client_wants_stream_usage;
        let result = inner.call(attempt).await;
        let outcome = match &result {
            // Nothing was sent: not a call (a failover attempt that found its upstream
            // down is not one of the session's `max_calls`), and nothing to charge.
            Err(TransportFailure::Connect) => {
                reservation.give_back();
                return result.map_err(AttemptError::from);
            }
            Err(_) => Outcome::Failed,
            Ok(reply) => match (&reply.stream_usage, &reply.view) {
                (Some(usage), _) => {
                    usage.on_end({
                        // Weak: this callback is kept inside the stream's usage until it
                        // ends.
                        let stream = Arc::downgrade(usage);
                        let log = log.clone();
                        move |end: StreamEnd| {
                            if let Some(reason) = stream.upgrade().and_then(|s| s.cut()) {
                                log.set_stream_cut(reason);
                            }
                            reservation.settle_later(match end {
                                StreamEnd {
                                    usage: Some(tokens),
                                    complete: true,
                                    ..
                                } => {
                                    log.add_usage(&tokens);
                                    Outcome::Reported(tokens)
                                }
                                StreamEnd { complete: true, .. } => Outcome::Unreported,
                                StreamEnd { usage, deltas, .. } => {
                                    let so_far = usage.unwrap_or_default();
                                    Outcome::Partial(Tokens {
                                        output: so_far.output.max(deltas),
                                        ..so_far
                                    })
                                }
                            })
                        }
                    });
                    return result.map_err(AttemptError::from);
                }
                // Queued in the background: its usage comes later, on the response.
                (None, Some(view))
                    if background
                        && reply.status.is_success()
                        && view.usage == ReportedUsage::Absent
                        && view.id.is_some() =>
                {
                    let id = view.id.clone().unwrap_or_default();
                    tracing::debug!(response = %id, "a background response's reservation is held until its usage appears");
                    budgets.background.hold(id, reservation);
                    return result.map_err(AttemptError::from);
                }
                (None, Some(view)) => {
                    if let ReportedUsage::Counts(tokens) | ReportedUsage::OutputOnly(tokens) =
                        view.usage
                    {
                        log.add_usage(&tokens);
                    }
                    Outcome::from(view.usage)
                }
                (None, None) => Outcome::Failed,
            },
        };
        // What the session holds now comes back with the settle (replica mode): the
        // layers above read it instead of asking Redis again.
        let settled = reservation.settle(outcome).await;
        log.add_settled(settled.usd, settled.seen);
        result.map_err(AttemptError::from)
    }
}

/// The meter's pass-through, for endpoints that are never charged (Anthropic's
/// `count_tokens`): the attempt goes to the leaf as it is.
#[derive(Clone)]
pub struct Unmetered<S> {
    inner: S,
}

impl<S> Unmetered<S> {
    pub fn new(inner: S) -> Self {
        Unmetered { inner }
    }
}

impl<S> Service<Billed> for Unmetered<S>
where
    S: Service<Attempt, Response = Reply, Error = TransportFailure>,
    S::Future: Send + 'static,
{
    type Response = Reply;
    type Error = AttemptError;
    type Future = futures_util::future::BoxFuture<'static, Result<Reply, AttemptError>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), AttemptError>> {
        self.inner.poll_ready(cx).map_err(AttemptError::from)
    }

    fn call(&mut self, billed: Billed) -> Self::Future {
        let future = self.inner.call(billed.attempt);
        Box::pin(async move { future.await.map_err(AttemptError::from) })
    }
}

#[cfg(test)]
mod tests {
    use super::HeldContext;

    #[test]
    fn held_context_is_added_and_unsized_context_has_a_floor() {
        let none = HeldContext::default();
        assert_eq!(none.input_tokens(30, 50_000), 30);
        let chained = HeldContext {
            tokens: 200_000,
            unsized_context: false,
        };
        assert_eq!(chained.input_tokens(30, 50_000), 200_030);
        let unsized_context = HeldContext {
            tokens: 0,
            unsized_context: true,
        };
        assert_eq!(unsized_context.input_tokens(30, 50_000), 50_000);
        let both = HeldContext {
            tokens: 200_000,
            unsized_context: true,
        };
        assert_eq!(both.input_tokens(30, 50_000), 200_030);
    }
}
