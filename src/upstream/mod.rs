//! The leaf of the stack: one HTTP attempt against one upstream, over a pooled client,
//! with the provider's credential injected and the client's own credentials removed.
//! It judges nothing: the recovery layer above classifies what it returns.
//!
//! Redirects are never followed: the provider key must reach no origin but the
//! configured `base_url` (a 3xx is classified and answered as 502 `upstream_redirect`).
//!
//! Non-streaming bodies (and error bodies) are read whole within the attempt timeout and
//! the upstream's `max_response_bytes`, so they can be classified and replayed. A successful
//! stream is held back only until its first chunk arrives (so a stream that dies before
//! its first byte is still retryable), then relayed as it comes, within the
//! [`ResponseLimits`].
//!
//! Two clients share the work ([`Clients`]): plain-HTTP upstreams (a model server on
//! the LAN, a sidecar, the mock) are called through hyper's pooled client directly when
//! no proxy is set in the environment; HTTPS upstreams, and every upstream when a proxy
//! is set, go through reqwest (TLS, HTTP/2, `HTTP(S)_PROXY` and `NO_PROXY`). reqwest
//! parses each request's URL twice more and wraps it in a redirect follower even with
//! redirects off: about 27,000 instructions a call (9% of the every-policy path) that a
//! plain-HTTP exchange does not need.

pub mod bedrock;
mod headers;
pub mod objects;
mod refresh;
pub mod stream;
mod url_style;

use std::{
    collections::HashMap,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::{future::BoxFuture, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::{
    api::{AnswerView, Endpoint, ParsedRequest},
    config::{Config, UpstreamApi},
    policy::{backoff::Backoff, classify::TransportFailure},
    wire::Wire,
};

pub use url_style::{Unserved, UrlStyle};

/// A configured upstream, ready to call.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    /// The kind of provider: what decides the wire format a model is sent in
    /// ([`Upstream::wire`]), the credential and the URLs.
    pub provider: UpstreamApi,
    /// Where its calls go (URLs parsed once: parsing, IDNA included, showed up in
    /// profiles when done per request).
    url_style: UrlStyle,
    /// `base_url` without a trailing `/`: the stored-response routes append their path.
    origin: String,
    /// The provider key, in the header this kind of upstream reads it from.
    credential: Option<(HeaderName, HeaderValue)>,
    pub attempt_timeout: Duration,
    /// How transient failures are retried on this upstream.
    pub retry: RetryRules,
    pub limits: ResponseLimits,
    anthropic_version: HeaderValue,
    /// Extra client headers forwarded (names or `prefix-*` globs).
    forward_headers: Vec<String>,
    /// Bedrock's signing state (Bedrock upstreams only).
    bedrock: Option<Arc<bedrock::Bedrock>>,
}

impl Upstream {
    /// The wire format `model` is sent to this upstream in, for a caller speaking
    /// `caller` (see [`UpstreamApi::wire`]).
    pub fn wire(&self, model: &str, caller: Wire) -> Wire {
        self.provider.wire(model, caller)
    }

    pub fn new(config: &crate::config::UpstreamConfig) -> Self {
        Upstream {
            name: config.name.as_str().into(),
            provider: config.api,
            url_style: UrlStyle::new(config),
            origin: config.base().origin(),
            credential: config.api_key.header(config.api),
            attempt_timeout: config.attempt_timeout,
            retry: RetryRules::from_config(&config.retry),
            limits: ResponseLimits {
                max_response_bytes: config.max_response_bytes,
                max_event_bytes: config.max_sse_event_bytes,
                max_duration: config.max_stream_duration,
            },
            anthropic_version: HeaderValue::from_str(&config.anthropic_version)
                .unwrap_or(HeaderValue::from_static("2023-06-01")),
            forward_headers: config.forward_headers.clone(),
            bedrock: bedrock::Bedrock::new(config),
        }
    }
}

/// How transient failures are retried on one upstream (the recovery layer applies
/// them; the retry budget is the upstream's health).
#[derive(Debug, Clone, Copy)]
pub struct RetryRules {
    /// Attempts per target, the first included.
    pub max_attempts: u32,
    pub backoff: Backoff,
    /// A longer `Retry-After` (or one past the deadline) is not waited: fail fast.
    pub max_retry_after: Duration,
}

impl RetryRules {
    pub fn from_config(config: &crate::config::RetryConfig) -> Self {
        RetryRules {
            max_attempts: config.max_attempts,
            backoff: Backoff {
                base: config.base_delay,
                max: config.max_delay,
            },
            max_retry_after: config.max_retry_after,
        }
    }
}

/// One `Upstream` per `[[upstreams]]`, by name.
pub fn build_all(config: &Config) -> HashMap<String, Arc<Upstream>> {
    config
        .upstreams
        .iter()
        .map(|u| (u.name.clone(), Arc::new(Upstream::new(u))))
        .collect()
}

/// The pooled reqwest client (HTTPS, proxies, the stored-response routes, trace
/// export). It follows no redirects.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .expect("TLS backend initialises")
}

/// hyper's pooled client for plain-HTTP upstreams: the same pool and connect settings
/// as [`client`], nothing on top.
type PlainClient = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Full<Bytes>,
>;

/// The clients attempts go out on (see the module docs).
#[derive(Clone)]
pub struct Clients {
    pub reqwest: reqwest::Client,
    /// `None` when a proxy is set in the environment: reqwest applies it.
    plain: Option<PlainClient>,
}

impl Clients {
    pub fn new() -> Self {
        let proxied = ["http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"]
            .iter()
            .any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()));
        let plain = (!proxied).then(|| {
            let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
            connector.set_nodelay(true);
            connector.set_connect_timeout(Some(Duration::from_secs(10)));
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_max_idle_per_host(1024)
                .pool_idle_timeout(Duration::from_secs(90))
                .pool_timer(hyper_util::rt::TokioTimer::new())
                .build(connector)
        });
        Clients {
            reqwest: client(),
            plain,
        }
    }

    /// POSTs `body` to `url`; the answer's head, its body still to read.
    async fn post(
        &self,
        url: reqwest::Url,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Fetched, TransportFailure> {
        if let (Some(plain), "http") = (&self.plain, url.scheme()) {
            let uri = http::Uri::try_from(url.as_str()).map_err(|_| TransportFailure::Connect)?;
            let mut request = http::Request::new(http_body_util::Full::new(body));
            *request.method_mut() = http::Method::POST;
            *request.uri_mut() = uri;
            *request.headers_mut() = headers;
            let response = plain.request(request).await.map_err(|err| {
                tracing::debug!(error = %err, "upstream transport error");
                plain_failure(&err)
            })?;
            let (head, body) = response.into_parts();
            let content_length = http_body::Body::size_hint(&body).exact();
            let chunks = http_body_util::BodyDataStream::new(body)
                .map(|chunk| chunk.map_err(|err| Box::new(err) as ChunkError));
            return Ok(Fetched {
                status: head.status,
                headers: head.headers,
                content_length,
                chunks: chunks.boxed(),
            });
        }
        let response = self
            .reqwest
            .post(url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|err| {
                tracing::debug!(error = %err, "upstream transport error");
                transport(&err)
            })?;
        Ok(Fetched::from_reqwest(response))
    }
}

/// What a failed plain-HTTP call was, as reqwest would have said it: a connect that
/// timed out is a timeout (it is also a connect error), any other connect error is
/// `Connect`, the rest `Reset`.
fn plain_failure(err: &hyper_util::client::legacy::Error) -> TransportFailure {
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        if cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return TransportFailure::Timeout;
        }
        source = cause.source();
    }
    if err.is_connect() {
        TransportFailure::Connect
    } else {
        TransportFailure::Reset
    }
}

impl Default for Clients {
    fn default() -> Self {
        Self::new()
    }
}

/// Why an upstream body stopped short after its head.
pub type ChunkError = Box<dyn std::error::Error + Send + Sync>;

/// An upstream body, chunk by chunk.
pub type Chunks = futures_util::stream::BoxStream<'static, Result<Bytes, ChunkError>>;

/// An upstream's answer head, its body still to read, whichever client fetched it.
pub(crate) struct Fetched {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The declared length, if any.
    pub content_length: Option<u64>,
    pub chunks: Chunks,
}

impl Fetched {
    pub(crate) fn from_reqwest(mut response: reqwest::Response) -> Fetched {
        Fetched {
            status: response.status(),
            headers: std::mem::take(response.headers_mut()),
            content_length: response.content_length(),
            chunks: response
                .bytes_stream()
                .map(|chunk| chunk.map_err(|err| Box::new(err) as ChunkError))
                .boxed(),
        }
    }
}

/// One attempt to make: the client's parsed request, which upstream, which model, how
/// long it may take. Built for the leaf by the recovery layer.
#[derive(Clone)]
pub struct Attempt {
    pub request: Arc<ParsedRequest>,
    pub upstream: Arc<Upstream>,
    /// The model to ask for instead of the client's.
    pub model: Option<Arc<str>>,
    /// The client's request headers (credentials are dropped on the way out).
    pub headers: Arc<HeaderMap>,
    pub timeout: Duration,
    /// Ask an OpenAI stream to report usage, and hide that report from the client
    /// (set by the meter when the client did not ask for it).
    pub stream_usage: bool,
    /// Keep the parsed answer in the reply's [`AnswerView`]: it is to be validated.
    pub keep_answer: bool,
    /// The attempt's trace context, sent as `traceparent` (tracing on only).
    pub trace: Option<opentelemetry::Context>,
    /// The target speaks the other API: `request` is already translated, and the answer
    /// is brought back into the caller's (see [`crate::layers::translate`]).
    pub translation: Option<crate::translate::AnswerContext>,
}

/// Why an attempt produced no upstream answer.
#[derive(Debug)]
pub enum AttemptError {
    /// The network failed (classified transient).
    Transport(TransportFailure),
    /// A layer refused to make the call (a budget): not retried.
    Refused(crate::error::GatewayError),
}

/// Only for readiness, which the leaf never fails: an attempt's real errors are
/// classified by the recovery layer, never converted.
impl From<AttemptError> for crate::error::GatewayError {
    fn from(err: AttemptError) -> Self {
        match err {
            AttemptError::Refused(refusal) => refusal,
            AttemptError::Transport(_) => crate::error::GatewayError::Internal,
        }
    }
}

impl From<TransportFailure> for AttemptError {
    fn from(failure: TransportFailure) -> Self {
        AttemptError::Transport(failure)
    }
}

/// An upstream's answer.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ReplyBody,
    /// For streams: the usage the stream reports, delivered when it ends.
    pub stream_usage: Option<Arc<stream::StreamUsage>>,
    /// A whole 2xx body, read once: what classification, the meter and validation need.
    pub view: Option<AnswerView>,
}

pub enum ReplyBody {
    /// Read whole: non-streaming answers and every error.
    Full(Bytes),
    /// A stream whose first chunk has arrived.
    Stream(Body),
}

impl Reply {
    /// A reply read whole, its view read once (for a 2xx; `keep_answer` keeps the
    /// parsed answer too).
    pub fn whole(
        endpoint: Endpoint,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        keep_answer: bool,
    ) -> Reply {
        let view = status
            .is_success()
            .then(|| AnswerView::read(endpoint, &body, keep_answer));
        Reply {
            status,
            headers,
            body: ReplyBody::Full(body),
            stream_usage: None,
            view,
        }
    }

    /// The whole body, or empty for a stream.
    pub fn bytes(&self) -> &[u8] {
        match &self.body {
            ReplyBody::Full(b) => b,
            ReplyBody::Stream(_) => &[],
        }
    }

    pub fn is_stream(&self) -> bool {
        matches!(self.body, ReplyBody::Stream(_))
    }

    pub fn into_response(self) -> Response<Body> {
        let body = match self.body {
            ReplyBody::Full(b) => Body::from(b),
            ReplyBody::Stream(s) => s,
        };
        let mut out = Response::new(body);
        *out.status_mut() = self.status;
        *out.headers_mut() = self.headers;
        out
    }
}

/// What an upstream answer may cost Backstop: bounds on what is read and relayed (the
/// upstream's `max_response_bytes`, `max_sse_event_bytes`, `max_stream_duration`).
#[derive(Clone, Copy, Debug)]
pub struct ResponseLimits {
    /// Largest body read whole.
    pub max_response_bytes: usize,
    /// Largest SSE event.
    pub max_event_bytes: usize,
    /// Longest a relayed stream may run.
    pub max_duration: Duration,
}

/// Turns true when the shutdown grace has elapsed: open streams end with an error event
/// instead of being cut silently.
#[derive(Clone, Debug)]
pub struct StreamCut(pub tokio::sync::watch::Receiver<bool>);

impl StreamCut {
    /// The receiver, and the sender that cuts every stream relayed under it.
    pub fn channel() -> (Self, tokio::sync::watch::Sender<bool>) {
        let (tx, rx) = tokio::sync::watch::channel(false);
        (StreamCut(rx), tx)
    }
}

/// The leaf service: makes one [`Attempt`].
#[derive(Clone)]
pub struct Forward {
    /// Shared, not copied: layers keep clones of the service below them in their
    /// futures, and hyper's client is some hundreds of bytes (reqwest's is one `Arc`).
    client: Arc<Clients>,
    cut: StreamCut,
}

impl Forward {
    pub fn new(client: Clients, cut: StreamCut) -> Self {
        Forward {
            client: Arc::new(client),
            cut,
        }
    }
}

impl tower::Service<Attempt> for Forward {
    type Response = Reply;
    type Error = TransportFailure;
    type Future = BoxFuture<'static, Result<Reply, TransportFailure>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, attempt: Attempt) -> Self::Future {
        let client = self.client.clone();
        let cut = self.cut.clone();
        Box::pin(async move {
            let started = Instant::now();
            let result = send(&client, &cut, &attempt).await;
            metrics::histogram!("backstop_upstream_duration_seconds", "upstream" => attempt.upstream.name.to_string())
                .record(started.elapsed().as_secs_f64());
            result
        })
    }
}

/// The whole body, or `TooLarge` as soon as it passes `limit` (a declared length over it
/// is refused before reading).
async fn read_capped(fetched: Fetched, limit: usize) -> Result<Bytes, TransportFailure> {
    if fetched.content_length.is_some_and(|n| n > limit as u64) {
        return Err(TransportFailure::TooLarge);
    }
    let mut chunks = fetched.chunks;
    let mut body = bytes::BytesMut::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|err| {
            tracing::debug!(error = %err, "upstream body broke");
            TransportFailure::Reset
        })?;
        if body.len() + chunk.len() > limit {
            tracing::warn!(limit, "upstream body over its max_response_bytes");
            return Err(TransportFailure::TooLarge);
        }
        if body.is_empty() && fetched.content_length == Some(chunk.len() as u64) {
            // The whole body in one chunk: no copy.
            return Ok(chunk);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

fn transport(err: &reqwest::Error) -> TransportFailure {
    if err.is_timeout() {
        TransportFailure::Timeout
    } else if err.is_connect() {
        TransportFailure::Connect
    } else {
        TransportFailure::Reset
    }
}

async fn send(
    client: &Clients,
    cut: &StreamCut,
    attempt: &Attempt,
) -> Result<Reply, TransportFailure> {
    let (request, upstream) = (&attempt.request, &attempt.upstream);
    let limits = upstream.limits;
    let asked = attempt.model.as_deref().unwrap_or(&request.model);
    let url = match upstream
        .url_style
        .url(request.endpoint, asked, request.stream)
    {
        Ok(url) => url,
        Err(unserved) => return Ok(unserved_reply(upstream, request.endpoint, asked, unserved)),
    };
    let body = match &upstream.bedrock {
        Some(_) => bedrock::invoke_body(&request.json, attempt.headers.get("anthropic-beta")),
        None => request.upstream_body(
            attempt.model.as_deref(),
            attempt.stream_usage && request.endpoint == Endpoint::ChatCompletions,
        ),
    };
    let mut headers = headers::upstream_request_headers(&attempt.headers, upstream);
    if let Some(cx) = &attempt.trace {
        crate::otel::inject(cx, &mut headers);
    }
    let deadline = tokio::time::Instant::now() + attempt.timeout;
    if let Some(bedrock) = &upstream.bedrock {
        let signed = match tokio::time::timeout_at(deadline, bedrock.credentials()).await {
            Err(_) => return Err(TransportFailure::Timeout),
            Ok(Err(why)) => Err(why),
            Ok(Ok(credentials)) => bedrock.sign(
                &credentials,
                &url,
                &mut headers,
                &body,
                std::time::SystemTime::now(),
            ),
        };
        if let Err(why) = signed {
            tracing::warn!(upstream = %upstream.name, reason = %why, "no AWS signature for a Bedrock call");
            return Ok(unsigned_reply(request.endpoint, &why));
        }
    }
    let send = client.post(url, headers, body);
    let mut response = tokio::time::timeout_at(deadline, send)
        .await
        .map_err(|_| TransportFailure::Timeout)??;
    if upstream.bedrock.is_some() {
        let adapted = bedrock::answer(response, limits);
        response = tokio::time::timeout_at(deadline, adapted)
            .await
            .map_err(|_| TransportFailure::Timeout)??;
    }

    let status = response.status;
    let headers = headers::client_response_headers(&response.headers);
    let is_sse = is_event_stream(&response.headers);

    if request.stream && status.is_success() && !is_sse {
        return Err(TransportFailure::NotAStream);
    }
    let body = if request.stream && is_sse && status.is_success() {
        let mut chunks = response.chunks;
        let first = match tokio::time::timeout_at(deadline, first_chunk(&mut chunks)).await {
            Err(_) => return Err(TransportFailure::Timeout),
            Ok(Err(FirstChunk::Ended)) => return Err(TransportFailure::Reset),
            Ok(Err(FirstChunk::Failed(err))) => {
                tracing::debug!(upstream = %upstream.name, error = %err, "upstream stream broke before its first chunk");
                return Err(TransportFailure::Reset);
            }
            Ok(Ok(chunk)) => chunk,
        };
        let usage = Arc::new(stream::StreamUsage::default());
        let relay = stream::Relay {
            endpoint: request.endpoint,
            idle: upstream.attempt_timeout,
            max_event_bytes: limits.max_event_bytes,
            max_duration: limits.max_duration,
            cut: cut.0.clone(),
            usage: usage.clone(),
            strip_usage_chunk: attempt.stream_usage,
        };
        return Ok(Reply {
            status,
            headers,
            body: ReplyBody::Stream(relay.body(first, chunks)),
            stream_usage: Some(usage),
            view: None,
        });
    } else {
        let read = read_capped(response, limits.max_response_bytes);
        let bytes = tokio::time::timeout_at(deadline, read)
            .await
            .map_err(|_| TransportFailure::Timeout)??;
        bytes
    };
    Ok(Reply::whole(
        request.endpoint,
        status,
        headers,
        body,
        attempt.keep_answer,
    ))
}

/// The answer to a call this upstream cannot be sent (an Azure upstream reached for the
/// Responses API, a Bedrock model that needs Converse): a 400 in the target's error
/// shape (OpenAI's, Anthropic's for Bedrock), made here without touching the network,
/// so recovery treats it as the caller's fault (no retry, no breaker) and the caller
/// reads why.
fn unserved_reply(
    upstream: &Upstream,
    endpoint: Endpoint,
    model: &str,
    unserved: Unserved,
) -> Reply {
    let message = match unserved {
        Unserved::Endpoint if upstream.provider == UpstreamApi::Bedrock => format!(
            "Backstop does not send {} to upstream {:?}: a Bedrock upstream serves Anthropic's Messages (chat and Responses callers are translated to them)",
            endpoint.path(),
            &*upstream.name
        ),
        Unserved::Converse => format!(
            "the Bedrock model {model:?} is not one of Anthropic's: Backstop reaches Bedrock's other models over the Converse API, which it does not speak yet (upstream {:?})",
            &*upstream.name
        ),
        Unserved::Endpoint => format!(
            "Backstop does not send {} to upstream {:?}: an Azure OpenAI upstream serves /v1/chat/completions and /v1/embeddings only",
            endpoint.path(),
            &*upstream.name
        ),
        Unserved::Deployment => format!(
            "the model is not a deployment name upstream {:?} can be sent",
            &*upstream.name
        ),
    };
    let parts = crate::wire::ErrorParts {
        category: "invalid_request_error",
        code: "unsupported_endpoint",
        anthropic_type: "invalid_request_error",
        message: &message,
        param: None,
    };
    // In the target's format: the translate layer brings it into the caller's.
    let wire = match upstream.provider {
        UpstreamApi::Bedrock => Wire::Messages,
        _ => Wire::Chat,
    };
    let body = crate::wire::error_body(wire, &parts);
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Reply::whole(endpoint, StatusCode::BAD_REQUEST, headers, body, false)
}

/// The answer to a Bedrock call that could not be signed (no credentials from the
/// chain): a 401 in Anthropic's shape, so recovery classes it as the upstream's
/// credentials (the next target is tried; the client reads `upstream_auth_failed`).
fn unsigned_reply(endpoint: Endpoint, why: &str) -> Reply {
    let message = format!("Backstop could not sign the Bedrock call: {why}");
    let parts = crate::wire::ErrorParts {
        category: "authentication_error",
        code: "upstream_auth_failed",
        anthropic_type: "authentication_error",
        message: &message,
        param: None,
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Reply::whole(
        endpoint,
        StatusCode::UNAUTHORIZED,
        headers,
        crate::wire::error_body(Wire::Messages, &parts),
        false,
    )
}

/// Whether a response's headers say it is an event stream.
pub(crate) fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"))
}

/// A stream's first non-empty chunk: a relay starts once it is in.
pub(crate) async fn first_chunk(chunks: &mut Chunks) -> Result<Bytes, FirstChunk> {
    loop {
        match chunks.next().await {
            None => return Err(FirstChunk::Ended),
            Some(Err(err)) => return Err(FirstChunk::Failed(err)),
            Some(Ok(chunk)) if chunk.is_empty() => continue,
            Some(Ok(chunk)) => return Ok(chunk),
        }
    }
}

/// Why a stream gave no first chunk.
pub(crate) enum FirstChunk {
    Ended,
    Failed(ChunkError),
}
