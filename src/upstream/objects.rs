//! The Responses API's stored-response routes, forwarded to one `openai` upstream
//! (`[responses] upstream`, see [`crate::config::ResponsesConfig`]):
//! `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and
//! `GET /v1/responses/{id}/input_items`. They name no model and generate nothing, so
//! they pass no budget, guard, validation or recovery: one attempt, the provider's key,
//! the same header allow-lists as the proxy, the answer relayed as the upstream gave it.
//!
//! The path is rebuilt from the id, which must be 1–128 letters, digits, `_` or `-`:
//! nothing the client sends can steer the request to another upstream path.
//! A 401/403 from the upstream is Backstop's key failing, answered 502 `upstream_auth`
//! (never passed on: the tenant's own key was fine). A 3xx is answered 502
//! `upstream_redirect`, as on the proxy routes: Backstop follows no upstream redirect,
//! and one relayed without its `Location` (not on the header allow-list) would mean
//! nothing to the client.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited};

use super::{
    first_chunk, headers, is_event_stream, read_capped, stream, transport, Endpoint, Fetched,
    FirstChunk, StreamCut, Upstream,
};
use crate::{
    error::{GatewayError, Protocol},
    policy::classify::TransportFailure,
    state::{budgets::background::BackgroundHolds, owners::ResponseOwners},
    telemetry::RequestLog,
};

/// What may follow `/v1/responses/{id}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tail {
    None,
    Cancel,
    InputItems,
}

/// The upstream path for a client path and method, or `None` for anything else.
fn object_path(method: &Method, path: &str) -> Option<String> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, tail) = match rest.split_once('/') {
        None => (rest, Tail::None),
        Some((id, "cancel")) => (id, Tail::Cancel),
        Some((id, "input_items")) => (id, Tail::InputItems),
        Some(_) => return None,
    };
    let valid_id = (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    let allowed = match tail {
        Tail::None => *method == Method::GET || *method == Method::DELETE,
        Tail::Cancel => *method == Method::POST,
        Tail::InputItems => *method == Method::GET,
    };
    (valid_id && allowed).then(|| match tail {
        Tail::None => format!("/v1/responses/{id}"),
        Tail::Cancel => format!("/v1/responses/{id}/cancel"),
        Tail::InputItems => format!("/v1/responses/{id}/input_items"),
    })
}

/// The leaf of the stored-response stack.
#[derive(Clone)]
pub struct ForwardObject {
    client: reqwest::Client,
    /// `None` when no route reaches an `openai` upstream: every call is 404.
    upstream: Option<Arc<Upstream>>,
    /// Who created which response: a tenant is answered for its own only.
    owners: Arc<ResponseOwners>,
    max_body_bytes: usize,
    /// Ends a relayed event stream at the shutdown grace.
    cut: StreamCut,
    /// Background responses' reservations, settled when their usage first appears here.
    background: Arc<BackgroundHolds>,
}

impl ForwardObject {
    pub fn new(
        client: reqwest::Client,
        upstream: Option<Arc<Upstream>>,
        owners: Arc<ResponseOwners>,
        max_body_bytes: usize,
        cut: StreamCut,
        background: Arc<BackgroundHolds>,
    ) -> Self {
        ForwardObject {
            client,
            upstream,
            owners,
            max_body_bytes,
            cut,
            background,
        }
    }
}

/// A response status after which its usage is final.
fn finished(status: Option<&str>) -> bool {
    matches!(
        status,
        Some("completed" | "incomplete" | "failed" | "cancelled")
    )
}

/// Settles background response `id`'s held reservation, if one is held, from a whole
/// answer that shows it finished: at its reported usage (the reservation when it
/// reports none).
fn settle_whole(holds: &BackgroundHolds, id: &str, body: &[u8]) {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return;
    };
    if !finished(json.get("status").and_then(serde_json::Value::as_str)) {
        return;
    }
    let Some(reservation) = holds.take(id) else {
        return;
    };
    let usage = crate::api::AnswerView::read(Endpoint::Responses, body, false).usage;
    tracing::info!(
        response = id,
        "a background response finished: its held reservation settles to its usage"
    );
    reservation.settle_later(usage.into());
}

impl tower::Service<Request<Body>> for ForwardObject {
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.forward(req).await })
    }
}

impl ForwardObject {
    async fn forward(self, req: Request<Body>) -> Result<Response<Body>, GatewayError> {
        let (parts, body) = req.into_parts();
        let not_found = || GatewayError::NotFound {
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
        };
        let path = object_path(&parts.method, parts.uri.path()).ok_or_else(not_found)?;
        let upstream = self.upstream.clone().ok_or_else(not_found)?;
        // Another tenant's response is answered as if it did not exist.
        let id = path
            .trim_start_matches("/v1/responses/")
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let tenant = parts
            .extensions
            .get::<Arc<crate::api::Tenant>>()
            .ok_or(GatewayError::Internal)?;
        let owned = self.owners.owns(&tenant.name, &id).await.map_err(|err| {
            GatewayError::StoreUnavailable {
                detail: err.to_string(),
            }
        })?;
        if !owned {
            return Err(GatewayError::NoSuchObject { what: "response" });
        }
        let limit = self.max_body_bytes;
        let body = Limited::new(body, limit)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    GatewayError::BodyTooLarge { limit }
                } else {
                    GatewayError::BodyRead(e.to_string())
                }
            })?
            .to_bytes();
        let mut url = format!("{}{path}", upstream.origin);
        if let Some(query) = parts.uri.query() {
            url.push('?');
            url.push_str(query);
        }
        let url = reqwest::Url::parse(&url).map_err(|_| not_found())?;
        let mut request = self
            .client
            .request(parts.method.clone(), url)
            .headers(headers::upstream_request_headers(&parts.headers, &upstream));
        if !body.is_empty() {
            request = request.body(body);
        }
        let failed = |failure: TransportFailure| match failure {
            TransportFailure::Timeout => GatewayError::UpstreamTimeout {
                upstream: upstream.name.to_string(),
                timeout: upstream.attempt_timeout,
            },
            _ => GatewayError::UpstreamUnavailable {
                upstream: upstream.name.to_string(),
            },
        };
        let exchange = async {
            let response = request.send().await.map_err(|e| transport(&e))?;
            let response = Fetched::from_reqwest(response);
            let (status, is_sse) = (response.status, is_event_stream(&response.headers));
            let headers = headers::client_response_headers(&response.headers);
            if !(status.is_success() && is_sse) {
                let bytes = read_capped(response, upstream.limits.max_response_bytes).await?;
                if status.is_success() && parts.method != Method::DELETE {
                    settle_whole(&self.background, &id, &bytes);
                }
                return Ok::<_, TransportFailure>((status, headers, Body::from(bytes)));
            }
            // `GET /v1/responses/{id}?stream=true`: relayed as it comes, with the bounds
            // of any relayed stream, once its first chunk is in.
            let mut chunks = response.chunks;
            let first = match first_chunk(&mut chunks).await {
                Ok(chunk) => chunk,
                Err(FirstChunk::Ended | FirstChunk::Failed(_)) => {
                    return Err(TransportFailure::Reset)
                }
            };
            let usage: Arc<stream::StreamUsage> = Arc::default();
            // A resumed stream's final event carries the usage: it settles a held
            // background reservation (the same once-only take as a GET).
            let (holds, resumed) = (self.background.clone(), id.clone());
            usage.on_end(move |end| {
                if let (Some(tokens), true) = (end.usage, end.complete) {
                    if let Some(reservation) = holds.take(&resumed) {
                        reservation.settle_later(
                            crate::state::budgets::reservation::Outcome::Reported(tokens),
                        );
                    }
                }
            });
            let relay = stream::Relay {
                endpoint: Endpoint::Responses,
                idle: upstream.attempt_timeout,
                max_event_bytes: upstream.limits.max_event_bytes,
                max_duration: upstream.limits.max_duration,
                cut: self.cut.0.clone(),
                usage,
                strip_usage_chunk: false,
            };
            Ok((status, headers, relay.body(first, chunks)))
        };
        let log = parts.extensions.get::<Arc<RequestLog>>().cloned();
        if let Some(log) = &log {
            log.set_recovery(crate::telemetry::Trail {
                upstream: Some(upstream.name.clone()),
                attempts: 1,
                ..Default::default()
            });
        }
        let (status, headers, body) = tokio::time::timeout(upstream.attempt_timeout, exchange)
            .await
            .map_err(|_| TransportFailure::Timeout)
            .and_then(|r| r)
            .map_err(failed)?;
        if status.is_redirection() {
            tracing::warn!(upstream = %upstream.name, status = status.as_u16(), "the upstream answered with a redirect; not followed");
            return Err(GatewayError::UpstreamProtocol {
                upstream: upstream.name.to_string(),
                problem: Protocol::Redirect(status.as_u16()),
            });
        }
        if status == http::StatusCode::UNAUTHORIZED || status == http::StatusCode::FORBIDDEN {
            tracing::error!(upstream = %upstream.name, status = status.as_u16(), "the upstream refused Backstop's key");
            return Err(GatewayError::UpstreamAuth {
                upstream: upstream.name.to_string(),
                status: status.as_u16(),
            });
        }
        let mut out = Response::new(body);
        *out.status_mut() = status;
        *out.headers_mut() = headers;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_four_routes_with_a_plain_id_are_forwarded() {
        let path = |m: Method, p: &str| object_path(&m, p);
        assert_eq!(
            path(Method::GET, "/v1/responses/resp_1").as_deref(),
            Some("/v1/responses/resp_1")
        );
        assert!(path(Method::DELETE, "/v1/responses/resp_1").is_some());
        assert!(path(Method::POST, "/v1/responses/resp_1/cancel").is_some());
        assert!(path(Method::GET, "/v1/responses/resp_1/input_items").is_some());
        assert!(path(Method::POST, "/v1/responses/resp_1").is_none());
        assert!(path(Method::GET, "/v1/responses/resp_1/cancel").is_none());
        assert!(path(Method::GET, "/v1/responses/..").is_none());
        assert!(path(Method::GET, "/v1/responses/a%2F..").is_none());
        assert!(path(Method::GET, "/v1/responses/").is_none());
        assert!(path(Method::GET, "/v1/responses/a/b/c").is_none());
        assert!(path(Method::GET, &format!("/v1/responses/{}", "a".repeat(129))).is_none());
    }
}
