//! The one place where a [`GatewayError`] becomes an HTTP response, in the caller's API
//! shape (OpenAI or Anthropic).

use axum::body::Body;
use http::{header, HeaderValue, Response, StatusCode};

use super::GatewayError;
use crate::{
    api::{error_body, ErrorParts},
    config::ApiKind,
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
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
