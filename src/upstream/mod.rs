//! The leaf of the stack: one HTTP attempt against one upstream, over a pooled client,
//! with the provider's credential injected and the client's own credentials removed.
//!
//! Non-streaming bodies are read whole within `attempt_timeout` (later layers classify
//! and validate them); streams are passed on chunk by chunk as they arrive, with
//! `attempt_timeout` as the longest silence allowed between chunks. A stream that breaks
//! after its first byte is ended with a well-formed error event in the caller's API.

mod headers;
mod stream;

use std::{
    collections::HashMap,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderValue, Request, Response};

use crate::{
    config::{ApiKind, Config},
    error::GatewayError,
    layers::context::RequestContext,
    telemetry::RequestLog,
};

/// A configured upstream, ready to call.
#[derive(Debug)]
pub struct Upstream {
    pub name: Arc<str>,
    pub api: ApiKind,
    origin: String,
    credential: Option<HeaderValue>,
    pub attempt_timeout: Duration,
    anthropic_version: HeaderValue,
}

impl Upstream {
    pub fn new(config: &crate::config::UpstreamConfig) -> Self {
        let key = config.api_key.expose();
        let credential = (!key.is_empty()).then(|| {
            let raw = match config.api {
                ApiKind::OpenAi => format!("Bearer {key}"),
                ApiKind::Anthropic => key.to_string(),
            };
            // Validated as a header value by `UpstreamConfig::validate`.
            let mut value = HeaderValue::from_str(&raw).expect("validated api_key");
            value.set_sensitive(true);
            value
        });
        Upstream {
            name: config.name.as_str().into(),
            api: config.api,
            origin: config.origin().to_string(),
            credential,
            attempt_timeout: config.attempt_timeout,
            anthropic_version: HeaderValue::from_str(&config.anthropic_version)
                .unwrap_or(HeaderValue::from_static("2023-06-01")),
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

/// The pooled client shared by every upstream.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .expect("TLS backend initialises")
}

/// The leaf service: forwards the parsed request to its route's first target.
#[derive(Clone)]
pub struct Forward {
    client: reqwest::Client,
}

impl Forward {
    pub fn new(client: reqwest::Client) -> Self {
        Forward { client }
    }
}

impl tower::Service<Request<Body>> for Forward {
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let client = self.client.clone();
        Box::pin(async move {
            let (parts, _) = req.into_parts();
            let ctx = parts
                .extensions
                .get::<Arc<RequestContext>>()
                .cloned()
                .ok_or(GatewayError::Internal)?;
            let log = parts.extensions.get::<Arc<RequestLog>>().cloned();
            let target = &ctx.route.targets[0];
            let upstream = &target.upstream;
            if upstream.api != ctx.endpoint.api() {
                return Err(GatewayError::ApiMismatch {
                    model: ctx.model.clone(),
                    upstream_api: upstream.api.as_str(),
                    path: match upstream.api {
                        ApiKind::OpenAi => "/v1/chat/completions",
                        ApiKind::Anthropic => "/v1/messages",
                    },
                });
            }
            let body = match &target.model {
                Some(model) => ctx.body_with_model(model),
                None => ctx.body.clone(),
            };
            let started = Instant::now();
            let result = attempt(&client, upstream, &ctx, &parts.headers, body).await;
            let elapsed = started.elapsed();
            let outcome = match &result {
                Ok(r) => r.status().as_str().to_owned(),
                Err(e) => e.kind().code.to_owned(),
            };
            metrics::histogram!("backstop_upstream_duration_seconds", "upstream" => upstream.name.to_string())
                .record(elapsed.as_secs_f64());
            metrics::counter!("backstop_upstream_attempts_total", "upstream" => upstream.name.to_string(), "outcome" => outcome)
                .increment(1);
            if let Some(log) = log {
                log.update(|f| {
                    f.upstream = Some(upstream.name.clone());
                    f.attempts += 1;
                    f.upstream_time += elapsed;
                });
            }
            result
        })
    }
}

/// One attempt: send, then read the body whole or wrap the stream.
async fn attempt(
    client: &reqwest::Client,
    upstream: &Upstream,
    ctx: &RequestContext,
    client_headers: &HeaderMap,
    body: Bytes,
) -> Result<Response<Body>, GatewayError> {
    let url = format!("{}{}", upstream.origin, ctx.endpoint.path());
    let headers = headers::upstream_request_headers(client_headers, upstream);
    let deadline = tokio::time::Instant::now() + upstream.attempt_timeout;
    let timed_out = || GatewayError::UpstreamTimeout {
        upstream: upstream.name.to_string(),
        timeout: upstream.attempt_timeout,
    };
    let unavailable = |err: reqwest::Error| {
        tracing::debug!(upstream = %upstream.name, error = %err, "upstream transport error");
        if err.is_timeout() {
            timed_out()
        } else {
            GatewayError::UpstreamUnavailable {
                upstream: upstream.name.to_string(),
            }
        }
    };
    let send = client.post(url).headers(headers).body(body).send();
    let response = tokio::time::timeout_at(deadline, send)
        .await
        .map_err(|_| timed_out())?
        .map_err(unavailable)?;

    let status = response.status();
    let headers = headers::client_response_headers(response.headers());
    let is_sse = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("text/event-stream"));

    let body = if ctx.stream && is_sse && status.is_success() {
        stream::relay(response, ctx.endpoint.api(), upstream.attempt_timeout)
    } else {
        let bytes = tokio::time::timeout_at(deadline, response.bytes())
            .await
            .map_err(|_| timed_out())?
            .map_err(unavailable)?;
        Body::from(bytes)
    };
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}
