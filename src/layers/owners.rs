//! Response-owners layer (attempt level, between recovery and the meter; the Responses
//! API only). Before the meter, each stored object a create names is checked against
//! the tenant that created it ([`ResponseOwners`]): another tenant's
//! `previous_response_id`, `conversation` or input item id is refused, before anything
//! is charged, with OpenAI's answer for an id it does not have (400
//! `previous_response_not_found`, `conversation_not_found` or `item_not_found`, naming
//! the parameter): chained onto it, the model would repeat another tenant's
//! conversation. What the provider holds for the call is handed to the meter
//! ([`HeldContext`]): the previous response's recorded context size, and whether it
//! names context Backstop cannot size.
//!
//! When the upstream answers a create that it stores (`store` is not `false`), the
//! response's id, its output items' ids and the conversation it names are recorded as
//! the tenant's, durably (the store, or Redis in replica mode), before the answer, or a
//! stream's first event, is released: any replica knows them at once, and a crash
//! right after cannot lose them. If that write fails the answer is withheld (503
//! `store_unavailable`): released, it would be a response no replica could serve or
//! guard. A response's context size (input + output tokens) joins its owner when its
//! usage is known: with a whole answer, in the same write; a stream's, when it ends.
//! Every other attempt passes straight through.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;
use tower::{Layer, Service};

use super::{
    meter::{Billed, HeldContext},
    Middleware, Stack,
};
use crate::{
    api::{Endpoint, ReportedUsage, StoredRefs},
    error::GatewayError,
    state::owners::{Known, ResponseOwners},
    store::StoreError,
    upstream::{AttemptError, Reply, ReplyBody},
};

/// Chunks of a stream held back at most while waiting for the event that names the
/// response (OpenAI's first event does).
const MAX_HELD_CHUNKS: usize = 16;

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

fn unavailable(what: &str, err: StoreError) -> GatewayError {
    GatewayError::StoreUnavailable {
        detail: format!("cannot {what}: {err}"),
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

    async fn call(&self, mut inner: S, mut billed: Billed) -> Result<Reply, AttemptError> {
        let request = billed.attempt.request.clone();
        if request.endpoint != Endpoint::Responses {
            return inner.call(billed).await;
        }
        let tenant = billed.tenant.clone();
        billed.held = self
            .check(&tenant, &request.refs)
            .await
            .map_err(AttemptError::Refused)?;
        let stored = request.json.get("store") != Some(&Value::Bool(false));
        if !stored {
            return inner.call(billed).await;
        }
        let reply = inner.call(billed).await?;
        if !reply.status.is_success() {
            return Ok(reply);
        }
        self.record_before_release(tenant, &request.refs, reply)
            .await
            .map_err(AttemptError::Refused)
    }
}

impl ResponseOwnersLayer {
    /// Refuses a reference to another tenant's object; else what the provider holds.
    async fn check(&self, tenant: &str, refs: &StoredRefs) -> Result<HeldContext, GatewayError> {
        let owners = &self.owners;
        let mut held = HeldContext {
            tokens: 0,
            unsized_context: refs.unsized_context,
        };
        if let Some(id) = &refs.previous_response {
            let owner = owners
                .owner(id, true)
                .await
                .map_err(|e| unavailable("check the owner of previous_response_id", e))?;
            match owner {
                Some(o) if &*o.tenant != tenant => {
                    return Err(GatewayError::PreviousResponseNotFound(id.clone()))
                }
                Some(Known {
                    context_tokens: Some(tokens),
                    ..
                }) => held.tokens = tokens,
                // Nobody's (made around Backstop), or its size not settled yet.
                _ => held.unsized_context = true,
            }
        }
        if let Some(id) = &refs.conversation {
            if owners
                .is_anothers(tenant, id)
                .await
                .map_err(|e| unavailable("check the owner of conversation", e))?
            {
                return Err(GatewayError::ConversationNotFound(id.clone()));
            }
        }
        let lookups = refs
            .items
            .iter()
            .map(|(i, id)| async move { (*i, id, owners.is_anothers(tenant, id).await) });
        for (i, id, anothers) in futures_util::future::join_all(lookups).await {
            if anothers.map_err(|e| unavailable("check the owner of an input item", e))? {
                return Err(GatewayError::ItemNotFound {
                    id: id.clone(),
                    param: format!("input[{i}].id"),
                });
            }
        }
        Ok(held)
    }

    /// Makes the owners of what a successful create stored durable, then releases it.
    async fn record_before_release(
        &self,
        tenant: Arc<str>,
        refs: &StoredRefs,
        mut reply: Reply,
    ) -> Result<Reply, GatewayError> {
        let conversation = refs.conversation.clone().map(|id| (id, None));
        match std::mem::replace(&mut reply.body, ReplyBody::Full(Bytes::new())) {
            ReplyBody::Full(bytes) => {
                let objects = whole_answer_objects(&reply, &bytes);
                reply.body = ReplyBody::Full(bytes);
                let Some(objects) = objects else {
                    return Ok(reply);
                };
                self.record_now(&tenant, objects.into_iter().chain(conversation).collect())
                    .await?;
                Ok(reply)
            }
            ReplyBody::Stream(body) => {
                let Some(usage) = reply.stream_usage.clone() else {
                    reply.body = ReplyBody::Stream(body);
                    return Ok(reply);
                };
                // Hold the stream until the event naming the response has passed the
                // relay (it is the first), and release it once the owner is durable.
                let mut chunks = body.into_data_stream();
                let mut held = Vec::new();
                while usage.response_id().is_none() && held.len() < MAX_HELD_CHUNKS {
                    match chunks.next().await {
                        Some(chunk) => held.push(chunk),
                        None => break,
                    }
                }
                let id = usage.response_id();
                if let Some(id) = &id {
                    let objects = std::iter::once((id.clone(), None)).chain(conversation);
                    self.record_now(&tenant, objects.collect()).await?;
                }
                // The size and the output items, when the stream ends.
                let owners = self.owners.clone();
                let ended = usage.clone();
                usage.on_end(move |end| {
                    let Some(id) = id.or_else(|| ended.response_id()) else {
                        return;
                    };
                    let context = end.usage.filter(|_| end.complete).map(|tokens| tokens.total());
                    let objects: Vec<_> = std::iter::once((id, context))
                        .chain(ended.output_ids().into_iter().map(|item| (item, None)))
                        .collect();
                    tokio::spawn(async move {
                        if let Err(err) = owners.record(&tenant, objects).await {
                            tracing::error!(error = %err, "cannot keep a streamed response's size and items");
                        }
                    });
                });
                let body = futures_util::stream::iter(held).chain(chunks);
                reply.body = ReplyBody::Stream(axum::body::Body::from_stream(body));
                Ok(reply)
            }
        }
    }

    /// Records `objects` as `tenant`'s and waits until they are durable; the time it
    /// takes is what a create pays for it (`backstop_owner_write_seconds`).
    async fn record_now(
        &self,
        tenant: &Arc<str>,
        objects: Vec<(String, Option<u64>)>,
    ) -> Result<(), GatewayError> {
        let started = Instant::now();
        let result = self.owners.record(tenant, objects).await;
        metrics::histogram!("backstop_owner_write_seconds").record(started.elapsed().as_secs_f64());
        result.map_err(|err| {
            tracing::error!(error = %err, "cannot keep a stored response's owner: its answer is withheld");
            unavailable("keep the stored response's owner", err)
        })
    }
}

/// What a whole answer stored: the response (with its context size, from the usage it
/// reported) and its output items; `None` when it names no response.
fn whole_answer_objects(reply: &Reply, bytes: &[u8]) -> Option<Vec<(String, Option<u64>)>> {
    let view = reply.view.as_ref()?;
    let id = view.id.clone()?;
    let context = match view.usage {
        ReportedUsage::Counts(tokens) => Some(tokens.total()),
        _ => None,
    };
    #[derive(Deserialize)]
    struct Output {
        #[serde(default)]
        output: Vec<Value>,
    }
    let items = serde_json::from_slice::<Output>(bytes)
        .map(|o| crate::upstream::stream::output_ids(&o.output))
        .unwrap_or_default();
    Some(
        std::iter::once((id, context))
            .chain(items.into_iter().map(|item| (item, None)))
            .collect(),
    )
}
