//! Response-owners layer (attempt level, between recovery and the meter; the Responses
//! API only): when an upstream answers a create that it stores (`store` is not `false`),
//! the response's id is recorded as the calling tenant's ([`ResponseOwners`]), so the
//! stored-response routes serve a tenant its own responses and no one else's. For the
//! same reason a create whose `previous_response_id` is another tenant's is refused
//! before the meter (nothing charged) with OpenAI's answer for an id it does not have:
//! chained onto it, the model would repeat another tenant's conversation. Every other
//! attempt passes straight through.

use std::sync::Arc;

use serde_json::Value;
use tower::{Layer, Service};

use super::{meter::Billed, Middleware, Stack};
use crate::{
    api::Endpoint,
    error::GatewayError,
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
        if request.endpoint != Endpoint::Responses {
            return inner.call(billed).await;
        }
        if let Some(Value::String(previous)) = request.json.get("previous_response_id") {
            let refusal = match self.owners.is_anothers(&billed.tenant, previous).await {
                Ok(false) => None,
                Ok(true) => Some(GatewayError::PreviousResponseNotFound(previous.clone())),
                Err(err) => Some(GatewayError::StoreUnavailable {
                    detail: format!("cannot check the owner of previous_response_id: {err}"),
                }),
            };
            if let Some(refusal) = refusal {
                return Err(AttemptError::Refused(refusal));
            }
        }
        let stored = request.json.get("store") != Some(&Value::Bool(false));
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
