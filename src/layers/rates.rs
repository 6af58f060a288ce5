//! Rate-limit layer (call level, for stacks that are never charged or guarded:
//! Anthropic's `count_tokens`): the tenant's and the session's `requests_per_minute`
//! apply to every request that reaches a provider, so a key whose budget is spent cannot
//! exhaust the organisation's provider rate limit by counting tokens. Refuses with 429
//! `rate_limited` and `Retry-After`, before any network; nothing is reserved or charged.

use std::sync::Arc;

use axum::body::Body;
use http::Response;
use tower::{Layer, Service, ServiceExt};

use super::{context::Call, Middleware, Stack};
use crate::{error::GatewayError, state::budgets::Budgets};

#[derive(Clone)]
pub struct RatesLayer {
    budgets: Arc<Budgets>,
}

impl RatesLayer {
    pub fn new(budgets: Arc<Budgets>) -> Self {
        RatesLayer { budgets }
    }
}

impl<S> Layer<S> for RatesLayer {
    type Service = Stack<RatesLayer, S>;
    fn layer(&self, inner: S) -> Self::Service {
        Stack::new(self.clone(), inner)
    }
}

impl<S> Middleware<S, Call> for RatesLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, inner: S, call: Call) -> Result<Response<Body>, GatewayError> {
        self.budgets
            .check_rate(&call.tenant, call.session.as_deref())
            .await?;
        inner.oneshot(call).await
    }
}
