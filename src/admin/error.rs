//! The admin API's errors: its own refusals (token, disabled, not found, reload), apart
//! from the proxy's [`GatewayError`], which they carry only where an admin call fails
//! as a proxied one would (the store, the shared state, the tenant's request rate).
//! Answered by the same [`error_response`] as the proxy's, with codes from the same
//! [`ErrorCode`].

use std::time::Duration;

use axum::{body::Body, response::Response};

use crate::{
    error::{
        respond::{error_response, ClientError},
        ErrorCode, GatewayError,
    },
    store::StoreError,
    telemetry::RequestLog,
    wire::Wire,
};

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("missing or invalid admin token: pass `[admin] token` as `Authorization: Bearer`")]
    Unauthorized,
    #[error("the admin API is disabled: set [admin] token in the config")]
    Disabled,
    #[error("no such {what}")]
    NotFound { what: &'static str },
    /// A reload found the config file invalid: the running config is kept.
    #[error("the config file is invalid; the running config is kept: {0}")]
    ConfigInvalid(String),
    /// A reload was asked of a gateway whose config did not come from a file.
    #[error("cannot reload: {0}")]
    ReloadUnavailable(&'static str),
    /// What a proxied call would have been refused with.
    #[error(transparent)]
    Gateway(#[from] GatewayError),
}

impl ClientError for AdminError {
    fn code(&self) -> ErrorCode {
        match self {
            AdminError::Unauthorized => ErrorCode::InvalidAdminToken,
            AdminError::Disabled => ErrorCode::AdminDisabled,
            AdminError::NotFound { .. } => ErrorCode::NotFound,
            AdminError::ConfigInvalid(_) => ErrorCode::ConfigInvalid,
            AdminError::ReloadUnavailable(_) => ErrorCode::ReloadUnavailable,
            AdminError::Gateway(err) => err.code(),
        }
    }
    fn param(&self) -> Option<&str> {
        match self {
            AdminError::Gateway(err) => err.param(),
            _ => None,
        }
    }
    fn retry_after(&self) -> Option<Duration> {
        match self {
            AdminError::Gateway(err) => err.retry_after(),
            _ => None,
        }
    }
}

impl From<StoreError> for AdminError {
    /// The shared state down is `state_unavailable` (retry shortly); any other store
    /// failure is `store_unavailable`.
    fn from(err: StoreError) -> Self {
        AdminError::Gateway(match err {
            StoreError::Unavailable(detail) => GatewayError::StateUnavailable {
                detail: detail.to_string(),
                retry_after: Duration::from_secs(1),
            },
            err => GatewayError::StoreUnavailable {
                detail: err.to_string(),
            },
        })
    }
}

/// The refusal in `api`'s shape, with its code in the request's log line, as the
/// respond layer does for the proxy's errors.
pub fn refuse(log: Option<&RequestLog>, err: &AdminError, api: Wire) -> Response<Body> {
    if let Some(log) = log {
        log.set_error(err.code());
    }
    error_response(err, api)
}
