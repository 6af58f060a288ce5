//! Response-owners layer (attempt level, between recovery and the meter; the Responses
//! API only): when an upstream answers a create that it stores (`store` is not `false`),
//! the response's id is recorded as the calling tenant's ([`ResponseOwners`]), so the
//! stored-response routes serve a tenant its own responses and no one else's. Never
//! refuses; every other attempt passes straight through.

use std::sync::Arc;

use serde_json::Value;
use tower::{Layer, Service};

use super::{meter::Billed, Middleware, Stack};
use crate::{
    api::Endpoint,
    state::owners::ResponseOwners,
    upstream::{AttemptError, Reply},
};

#[derive(Clone)]
pub struct ResponseOwnersLayer {
    owners: Arc<ResponseOwners>,
}

impl ResponseOwnersLayer {
    pub fn new(owners: Arc<ResponseOwners>) -> Self {
        ResponseOwnersLayer { owners }
    }
}

pub type RecordOwners<S> = Stack<ResponseOwnersLayer, S>;

impl<S> Layer<S> for ResponseOwnersLayer {
    type Service = RecordOwners<S>;
    fn layer(&self, inner: S) -> RecordOwners<S> {
        Stack::new(self.clone(), inner)
    }
}

impl<S> Middleware<S, Billed> for ResponseOwnersLayer
where
    S: Service<Billed, Response = Reply, Error = AttemptError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Billed;
    type Response = Reply;
    type Error = AttemptError;

    async fn call(&self, mut inner: S, billed: Billed) -> Result<Reply, AttemptError> {
        let request = &billed.attempt.request;
        let stored = request.endpoint == Endpoint::Responses
            && request.json.get("store") != Some(&Value::Bool(false));
        if !stored {
            return inner.call(billed).await;
        }
        let tenant = billed.tenant.clone();
        let reply = inner.call(billed).await?;
        if reply.status.is_success() {
            if let Some(id) = reply.view.as_ref().and_then(|v| v.id.clone()) {
                self.owners.record(&tenant, id);
            } else if let Some(usage) = &reply.stream_usage {
                let owners = self.owners.clone();
                usage.on_response_id(move |id| owners.record(&tenant, id));
            }
        }
        Ok(reply)
    }
}
