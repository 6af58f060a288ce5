//! Idempotency layer (right after the request context, before limits, budgets and the
//! guard): a request with an `Idempotency-Key` has its completed 2xx response kept in the
//! store for `store.idempotency_ttl`; a later request with the same key and tenant gets
//! it replayed (`x-backstop-replayed: true`) without an upstream call or a charge, across
//! restarts too. Concurrent duplicates wait for the first instead of calling twice. The
//! same key with a different body is 422 `idempotency_key_reused`. Failed responses are
//! not kept, so the key can be retried.
//!
//! A key is scoped by tenant, endpoint and the key itself (a chat answer is never
//! replayed for `/v1/embeddings`), and a body is recognised by its SHA-256 digest. A key
//! longer than `server.max_idempotency_key_bytes` or not visible ASCII is 400
//! `invalid_header`: it is never silently ignored (which would make a second call).

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, Response, StatusCode};
use http_body::Frame;
use tokio::sync::watch;
use tower::{Layer, Service};

use crate::{
    clock::Clock,
    error::GatewayError,
    layers::{
        context::{identifier, Call},
        Middleware, Stack,
    },
    store::{Claim, Replays, StoreError, StoredResponse},
};

/// How often a duplicate polls while another replica makes the call.
const POLL: Duration = Duration::from_millis(25);

/// Largest response kept for replay.
const MAX_KEPT: usize = 8 * 1024 * 1024;

type Key = (Arc<str>, String);

/// The keys whose first request is still running here, each with what its duplicates
/// wait on. Kept in the app state, so a duplicate that arrives after a reload still
/// waits for the original started under the old config.
pub type InFlight = Arc<Mutex<HashMap<Key, watch::Receiver<()>>>>;

#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Arc<dyn Replays>,
    ttl: Duration,
    max_key_bytes: usize,
    clock: Clock,
    in_flight: InFlight,
    /// How long a claim on a shared store holds (the request timeout): a replica that
    /// dies mid-call frees the key by then.
    lease: Duration,
    /// Refuse (503 `state_unavailable`) rather than serve without replay when the store
    /// cannot be read (`[state] on_unavailable = "closed"` with a shared store).
    fail_closed: bool,
}

impl IdempotencyLayer {
    pub fn new(store: Arc<dyn Replays>, ttl: Duration, max_key_bytes: usize, clock: Clock) -> Self {
        IdempotencyLayer {
            store,
            ttl,
            max_key_bytes,
            clock,
            in_flight: Arc::default(),
            lease: Duration::from_secs(120),
            fail_closed: false,
        }
    }

    /// Shares the in-flight keys with the layers of other configs (see [`InFlight`]).
    pub fn in_flight(mut self, in_flight: InFlight) -> Self {
        self.in_flight = in_flight;
        self
    }

    /// Claims on a shared store last `lease`; `fail_closed` refuses when it is down.
    pub fn shared(mut self, lease: Duration, fail_closed: bool) -> Self {
        self.lease = lease;
        self.fail_closed = fail_closed;
        self
    }

    /// A store error: refused when failing closed, else `None` (serve without replay).
    fn unavailable(&self, err: StoreError) -> Option<GatewayError> {
        tracing::error!(error = %err, "idempotency lookup failed");
        match err {
            StoreError::Unavailable(detail) if self.fail_closed => {
                Some(GatewayError::StateUnavailable {
                    detail: format!("idempotency cannot be checked: {detail}"),
                    retry_after: Duration::from_secs(1),
                })
            }
            _ => None,
        }
    }
}

pub type Idempotency<S> = Stack<IdempotencyLayer, S>;

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Idempotency<S> {
        Stack::new(self.clone(), inner)
    }
}

/// SHA-256 of the body, hex: a different body with the same key cannot collide into a
/// replay of someone else's answer.
fn body_hash(body: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(body);
    let mut hex = String::with_capacity(64);
    for b in digest {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

/// While alive, this request is the one making the call for its key; dropping it lets
/// the waiting duplicates look again.
struct Leader {
    key: Key,
    in_flight: InFlight,
    _done: watch::Sender<()>,
    /// The key claimed on a shared store, given back unless its response was kept.
    claim: Option<(Arc<dyn Replays>, String)>,
}

impl Drop for Leader {
    fn drop(&mut self) {
        if let Some((store, key)) = self.claim.take() {
            store.release_claim(&self.key.0, &key);
        }
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

fn replay(stored: StoredResponse) -> Response<Body> {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    if let Ok(ct) = HeaderValue::from_str(&stored.content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    response
        .headers_mut()
        .insert("x-backstop-replayed", HeaderValue::from_static("true"));
    metrics::counter!("backstop_idempotent_replays_total").increment(1);
    response
}

/// A response body that is kept as it passes, and remembered once it has ended whole.
struct Keeping {
    body: Body,
    kept: Option<BytesMut>,
    record: Option<StoredResponse>,
    store: Arc<dyn Replays>,
    leader: Option<Leader>,
}

impl Keeping {
    /// The body ended whole: remember it, then let waiting duplicates look again.
    fn finish(&mut self) {
        if let (Some(kept), Some(mut record)) = (self.kept.take(), self.record.take()) {
            record.body = kept.to_vec();
            let store = self.store.clone();
            let leader = self.leader.take();
            // In the request's span, so a failure to keep it is logged with its id.
            let write = async move {
                match store.remember(record).await {
                    // Kept: the claim became the response, nothing to give back.
                    Ok(()) => {
                        if let Some(mut leader) = leader {
                            leader.claim = None;
                        }
                    }
                    Err(err) => tracing::error!(error = %err, "cannot keep a response for replay"),
                }
            };
            tokio::spawn(tracing::Instrument::instrument(
                write,
                tracing::Span::current(),
            ));
        }
    }
}

impl http_body::Body for Keeping {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(kept), Some(data)) = (this.kept.as_mut(), frame.data_ref()) {
                    if kept.len() + data.len() > MAX_KEPT {
                        this.kept = None;
                    } else {
                        kept.extend_from_slice(data);
                    }
                }
                // A sized body may not be polled again once it reports its end.
                if this.body.is_end_stream() {
                    this.finish();
                }
            }
            Poll::Ready(None) => this.finish(),
            Poll::Ready(Some(Err(_))) => this.kept = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<S> Middleware<S, Call> for IdempotencyLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, req: Call) -> Result<Response<Body>, GatewayError> {
        let layer = self;
        {
            let Some(key) = identifier(&req.headers, "idempotency-key", layer.max_key_bytes)?
            else {
                return inner.call(req).await;
            };
            let tenant = req.tenant.clone();
            let key = format!("{}:{key}", req.endpoint().label());
            let hash = body_hash(&req.request.body);
            let id: Key = (tenant.clone(), key.clone());
            let waiting_since = tokio::time::Instant::now();
            let leader = 'claimed: loop {
                // This request's place as the key's leader here first, the store read
                // after: a request that has just finished leaves the in-flight map only
                // once its response is kept, so a read made after taking its place sees
                // that response. (Read first, it could miss a response kept between the
                // read and the look at the map, and call again.)
                let mut leader = loop {
                    let mut waiting = {
                        let mut map = layer.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                        match map.get(&id) {
                            Some(rx) => rx.clone(),
                            None => {
                                let (tx, rx) = watch::channel(());
                                map.insert(id.clone(), rx);
                                break Leader {
                                    key: id.clone(),
                                    in_flight: layer.in_flight.clone(),
                                    _done: tx,
                                    claim: None,
                                };
                            }
                        }
                    };
                    // Resolves when the leader is done (its sender dropped); then look again.
                    let _ = waiting.changed().await;
                };
                match layer
                    .store
                    .recall(&tenant, &key, layer.clock.now_ms())
                    .await
                {
                    Ok(Some(stored)) if stored.body_hash != hash => {
                        return Err(GatewayError::IdempotencyKeyReused)
                    }
                    Ok(Some(stored)) => return Ok(replay(stored)),
                    Ok(None) => {}
                    Err(err) => {
                        if let Some(refused) = layer.unavailable(err) {
                            return Err(refused);
                        }
                        // Served without replay: nothing to wait for.
                        drop(leader);
                        return inner.call(req).await;
                    }
                }
                // The leader here; with a shared store, also across replicas.
                match layer
                    .store
                    .claim(&tenant, &key, layer.lease.as_millis() as i64)
                    .await
                {
                    Ok(Claim::Claimed) => {
                        // Given back when the leader is done (a no-op for a store no
                        // other replica shares, whose claims are always granted).
                        leader.claim = Some((layer.store.clone(), key.clone()));
                        break 'claimed leader;
                    }
                    Ok(Claim::Done(stored)) if stored.body_hash != hash => {
                        return Err(GatewayError::IdempotencyKeyReused)
                    }
                    Ok(Claim::Done(stored)) => return Ok(replay(stored)),
                    Ok(Claim::Pending) => {
                        drop(leader);
                        if waiting_since.elapsed() > layer.lease {
                            return Err(GatewayError::StateUnavailable {
                                detail:
                                    "another request with this Idempotency-Key is still running"
                                        .into(),
                                retry_after: Duration::from_secs(1),
                            });
                        }
                        tokio::time::sleep(POLL).await;
                    }
                    Err(err) => {
                        if let Some(refused) = layer.unavailable(err) {
                            return Err(refused);
                        }
                        break 'claimed leader;
                    }
                }
            };
            let response = inner.call(req).await?;
            if !response.status().is_success() {
                return Ok(response);
            }
            let content_type = response
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("application/json")
                .to_string();
            let record = StoredResponse {
                tenant: tenant.to_string(),
                key,
                body_hash: hash,
                status: response.status().as_u16(),
                content_type,
                body: Vec::new(),
                expires_ms: layer.clock.now_ms() + layer.ttl.as_millis() as i64,
            };
            Ok(response.map(|body| {
                Body::new(Keeping {
                    body,
                    kept: Some(BytesMut::new()),
                    record: Some(record),
                    store: layer.store.clone(),
                    leader: Some(leader),
                })
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn body_hashes_are_stable() {
        assert_eq!(
            super::body_hash(b"hello"),
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
    }
}
