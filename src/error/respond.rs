//! The one place where a [`GatewayError`] becomes an HTTP response, in the caller's API
//! shape (OpenAI or Anthropic).

use axum::body::Body;
use http::{header, HeaderValue, Response, StatusCode};

use super::GatewayError;
use crate::{
    api::ApiKind,
    api::{error_body, ErrorParts},
};

pub fn error_response(err: &GatewayError, api: ApiKind) -> Response<Body> {
    let kind = err.kind();
    let message = err.to_string();
    let body = error_body(
        api,
        &ErrorParts {
            category: kind.category,
            code: kind.code,
            anthropic_type: kind.anthropic_type,
            message: &message,
            param: err.param(),
        },
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() =
        StatusCode::from_u16(kind.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(wait) = err.retry_after() {
        // Whole seconds, rounded up: a client must not come back before the breaker
        // half-opens.
        let secs = wait.as_millis().div_ceil(1000).max(1);
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
    }
    response
}

/// Marks a response the client should not retry on its own: Backstop already applied
/// its retry policy to it, or refused on purpose. The official SDKs obey this header,
/// so their retries do not multiply Backstop's.
pub fn mark_no_retry(response: &mut Response<Body>) {
    if response.status().as_u16() >= 400 {
        response
            .headers_mut()
            .insert("x-should-retry", HeaderValue::from_static("false"));
    }
}
