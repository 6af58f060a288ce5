//! The one place where an error becomes an HTTP response, in the caller's API shape
//! (OpenAI or Anthropic), and where a refusal is counted in `backstop_refusals_total`.

use std::time::Duration;

use axum::body::Body;
use http::{header, HeaderValue, Response, StatusCode};

use super::{ErrorCode, GatewayError};
use crate::wire::{error_body, ErrorParts, Wire};

/// An error a client is answered with: the proxy's [`GatewayError`] and the admin API's
/// own. Its `Display` is the message.
pub trait ClientError: std::fmt::Display {
    fn code(&self) -> ErrorCode;
    /// The request parameter at fault (the OpenAI body's `param`).
    fn param(&self) -> Option<&str> {
        None
    }
    /// How long the client should wait before trying again (`Retry-After`).
    fn retry_after(&self) -> Option<Duration> {
        None
    }
}

impl ClientError for GatewayError {
    fn code(&self) -> ErrorCode {
        GatewayError::code(self)
    }
    fn param(&self) -> Option<&str> {
        GatewayError::param(self)
    }
    fn retry_after(&self) -> Option<Duration> {
        GatewayError::retry_after(self)
    }
}

pub fn error_response(err: &(impl ClientError + ?Sized), api: Wire) -> Response<Body> {
    let code = err.code();
    if code.is_refusal() {
        metrics::counter!("backstop_refusals_total", "reason" => code.as_str()).increment(1);
    }
    let message = err.to_string();
    let body = error_body(
        api,
        &ErrorParts {
            category: code.openai_type(),
            code: code.as_str(),
            anthropic_type: code.anthropic_type(),
            message: &message,
            param: err.param(),
        },
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() =
        StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let retry_after = err.retry_after();
    debug_assert_eq!(
        retry_after.is_some(),
        code.has_retry_after(),
        "{code}: Retry-After disagrees with ErrorCode"
    );
    if let Some(wait) = retry_after {
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
