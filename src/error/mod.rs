//! Typed errors raised by the layers. They travel as `Err` through the tower stack and
//! become HTTP responses in exactly one place, [`respond`].

pub mod budget;
pub mod respond;

use std::time::Duration;

/// Everything Backstop itself can answer with instead of an upstream response.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("missing or invalid API key: pass a Backstop tenant key as `Authorization: Bearer` or `x-api-key`")]
    Unauthorized,
    #[error("request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("invalid `{header}` header: {detail}")]
    InvalidHeader {
        header: &'static str,
        detail: String,
    },
    #[error("invalid `{param}`: {detail}")]
    InvalidParameter { param: &'static str, detail: String },
    #[error("`model` is required and must be a non-empty string")]
    MissingModel,
    #[error("the model `{0}` does not exist or you do not have access to it")]
    ModelNotFound(String),
    #[error("model `{model}` is served by an {upstream_api} upstream; call it through {path}")]
    ApiMismatch {
        model: String,
        upstream_api: &'static str,
        path: &'static str,
    },
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// A list in the body (or the body as a whole) holds more items than a
    /// `server.max_*` limit allows: refused before it is parsed.
    #[error("{what}: {count}, over the limit of {limit} (`{key}`)")]
    TooManyItems {
        /// The request parameter at fault (`messages`, `input[].content`), if one is.
        param: Option<&'static str>,
        what: &'static str,
        count: u64,
        limit: u64,
        /// The config key that sets the limit.
        key: &'static str,
    },
    /// Large bodies already in flight hold the memory budget
    /// (`server.max_body_bytes_in_flight` / `max_parsed_bytes_in_flight`), and no room
    /// came free within `server.in_flight_wait`.
    #[error("Backstop is busy with other large requests; retry after {retry_after:?}")]
    Overloaded { retry_after: Duration },
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    /// The client stopped sending its body for longer than `server.body_read_timeout`.
    #[error("the request body stopped arriving: no data within server.body_read_timeout")]
    BodyTimeout,
    #[error("the upstream `{upstream}` could not be reached")]
    UpstreamUnavailable { upstream: String },
    #[error("the upstream `{upstream}` did not answer within {timeout:?}")]
    UpstreamTimeout { upstream: String, timeout: Duration },
    #[error("the upstream `{upstream}` refused Backstop's credentials (HTTP {status}); an operator must fix its api_key")]
    UpstreamAuth { upstream: String, status: u16 },
    #[error("the upstream `{upstream}` answered with a body that is not valid JSON")]
    UpstreamMalformed { upstream: String },
    #[error("the upstream `{upstream}` {problem}")]
    UpstreamProtocol { upstream: String, problem: Protocol },
    #[error("every upstream for this model is failing and its circuit breaker is open; retry after {retry_after:?}")]
    CircuitOpen { retry_after: Duration },
    #[error("the request did not complete within {0:?}")]
    RequestTimeout(Duration),
    #[error("no such endpoint: {method} {path}")]
    NotFound { method: String, path: String },
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("missing or invalid admin token: pass `[admin] token` as `Authorization: Bearer`")]
    AdminUnauthorized,
    #[error("the request's JSON schema is invalid: {0}")]
    InvalidSchema(String),
    #[error("the model's output did not validate after {attempts} attempts: {}", errors.join("; "))]
    OutputInvalid { errors: Vec<String>, attempts: u32 },
    #[error("this Idempotency-Key was already used with a different request body")]
    IdempotencyKeyReused,
    /// A Responses request chains onto another tenant's stored response: answered as
    /// OpenAI answers an id it does not have, so it says nothing of whose it is.
    #[error("Previous response with id '{0}' not found.")]
    PreviousResponseNotFound(String),
    /// An input item names another tenant's stored item (`param` is its place, e.g.
    /// `input[3].id`): answered as for an id the provider does not have.
    #[error("Item with id '{id}' not found.")]
    ItemNotFound { id: String, param: String },
    /// `conversation` names another tenant's conversation.
    #[error("Conversation with id '{0}' not found.")]
    ConversationNotFound(String),
    #[error("{detail}")]
    SessionRefused {
        code: crate::policy::guard::TripCode,
        detail: String,
        retry_after: Duration,
    },
    #[error("rate limited: {detail}")]
    RateLimited {
        detail: String,
        retry_after: Duration,
    },
    #[error("budget exceeded: {detail}")]
    BudgetExceeded {
        budget: &'static str,
        detail: String,
    },
    #[error("{detail}")]
    TooManyConcurrent { detail: String },
    #[error("{detail}")]
    Unpriced { detail: String },
    /// The store could not record a budgeted call or an operator's action: refused
    /// rather than served unaccounted.
    #[error("{detail}")]
    StoreUnavailable { detail: String },
    /// The shared state (Redis) cannot decide this call's budget or idempotency, or has
    /// lost its data: refused rather than decided blind (`[state] on_unavailable`).
    #[error("{detail}")]
    StateUnavailable {
        detail: String,
        retry_after: Duration,
    },
    #[error("no such {what}")]
    NotFoundAdmin { what: &'static str },
    #[error("the admin API is disabled: set [admin] token in the config")]
    AdminDisabled,
    /// A reload found the config file invalid: the running config is kept.
    #[error("the config file is invalid; the running config is kept: {0}")]
    ConfigInvalid(String),
    /// A reload was asked of a gateway whose config did not come from a file.
    #[error("cannot reload: {0}")]
    ReloadUnavailable(&'static str),
    #[error("internal error")]
    Internal,
}

/// How an upstream broke the protocol Backstop holds it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Protocol {
    #[error("answered with a redirect (HTTP {0}); Backstop never follows upstream redirects")]
    Redirect(u16),
    #[error("answered with a body over server.max_response_bytes")]
    TooLarge,
    #[error("answered a streaming request with a body that is not an event stream")]
    NotAStream,
}

impl Protocol {
    pub fn code(self) -> &'static str {
        match self {
            Protocol::Redirect(_) => "upstream_redirect",
            Protocol::TooLarge => "upstream_response_too_large",
            Protocol::NotAStream => "upstream_not_streaming",
        }
    }
}

/// The HTTP-facing identity of an error: status, category and the exact code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorKind {
    pub status: u16,
    pub category: &'static str,
    pub code: &'static str,
    pub anthropic_type: &'static str,
}

impl GatewayError {
    pub fn kind(&self) -> ErrorKind {
        use GatewayError::*;
        let (status, category, code, anthropic_type) = match self {
            Unauthorized => (
                401,
                "authentication_error",
                "invalid_api_key",
                "authentication_error",
            ),
            InvalidJson(_) | NotAnObject => (
                400,
                "invalid_request_error",
                "invalid_json",
                "invalid_request_error",
            ),
            InvalidHeader { .. } => (
                400,
                "invalid_request_error",
                "invalid_header",
                "invalid_request_error",
            ),
            InvalidParameter { .. } => (
                400,
                "invalid_request_error",
                "invalid_parameter",
                "invalid_request_error",
            ),
            MissingModel => (
                400,
                "invalid_request_error",
                "missing_model",
                "invalid_request_error",
            ),
            PreviousResponseNotFound(_) => (
                400,
                "invalid_request_error",
                "previous_response_not_found",
                "invalid_request_error",
            ),
            ItemNotFound { .. } => (
                400,
                "invalid_request_error",
                "item_not_found",
                "invalid_request_error",
            ),
            ConversationNotFound(_) => (
                400,
                "invalid_request_error",
                "conversation_not_found",
                "invalid_request_error",
            ),
            ModelNotFound(_) => (
                404,
                "invalid_request_error",
                "model_not_found",
                "not_found_error",
            ),
            ApiMismatch { .. } => (
                400,
                "invalid_request_error",
                "api_mismatch",
                "invalid_request_error",
            ),
            BodyTooLarge { .. } => (
                413,
                "invalid_request_error",
                "request_too_large",
                "request_too_large",
            ),
            TooManyItems { .. } => (
                400,
                "invalid_request_error",
                "too_many_items",
                "invalid_request_error",
            ),
            Overloaded { .. } => (503, "server_error", "overloaded", "overloaded_error"),
            BodyRead(_) => (
                400,
                "invalid_request_error",
                "body_read_error",
                "invalid_request_error",
            ),
            BodyTimeout => (
                408,
                "timeout_error",
                "request_body_timeout",
                "request_body_timeout",
            ),
            UpstreamUnavailable { .. } => (
                502,
                "upstream_error",
                "upstream_unavailable",
                "upstream_unavailable",
            ),
            UpstreamTimeout { .. } => (
                504,
                "upstream_error",
                "upstream_timeout",
                "upstream_timeout",
            ),
            UpstreamAuth { .. } => (
                502,
                "upstream_error",
                "upstream_auth_failed",
                "upstream_auth_failed",
            ),
            UpstreamMalformed { .. } => (502, "upstream_error", "output_invalid", "output_invalid"),
            UpstreamProtocol { problem, .. } => {
                (502, "upstream_error", problem.code(), problem.code())
            }
            CircuitOpen { .. } => (503, "upstream_error", "circuit_open", "circuit_open"),
            RequestTimeout(_) => (504, "timeout_error", "request_timeout", "request_timeout"),
            NotFound { .. } => (
                404,
                "invalid_request_error",
                "unknown_endpoint",
                "not_found_error",
            ),
            MethodNotAllowed { .. } => (
                405,
                "invalid_request_error",
                "method_not_allowed",
                "invalid_request_error",
            ),
            AdminUnauthorized => (
                401,
                "authentication_error",
                "invalid_admin_token",
                "authentication_error",
            ),
            InvalidSchema(_) => (
                400,
                "invalid_request_error",
                "invalid_schema",
                "invalid_request_error",
            ),
            OutputInvalid { .. } => (502, "upstream_error", "output_invalid", "output_invalid"),
            IdempotencyKeyReused => (
                422,
                "invalid_request_error",
                "idempotency_key_reused",
                "invalid_request_error",
            ),
            SessionRefused { code, .. } => (429, "session_error", code.as_str(), code.as_str()),
            RateLimited { .. } => (429, "rate_limit_error", "rate_limited", "rate_limited"),
            BudgetExceeded { .. } => (402, "budget_error", "budget_exceeded", "budget_exceeded"),
            TooManyConcurrent { .. } => (
                429,
                "rate_limit_error",
                "too_many_concurrent",
                "too_many_concurrent",
            ),
            Unpriced { .. } => (402, "budget_error", "unpriced_model", "unpriced_model"),
            StoreUnavailable { .. } => (503, "server_error", "store_unavailable", "api_error"),
            StateUnavailable { .. } => (503, "server_error", "state_unavailable", "api_error"),
            NotFoundAdmin { .. } => (404, "invalid_request_error", "not_found", "not_found_error"),
            AdminDisabled => (
                403,
                "permission_error",
                "admin_disabled",
                "permission_error",
            ),
            ConfigInvalid(_) => (
                400,
                "invalid_request_error",
                "config_invalid",
                "invalid_request_error",
            ),
            ReloadUnavailable(_) => (
                409,
                "invalid_request_error",
                "reload_unavailable",
                "invalid_request_error",
            ),
            Internal => (500, "internal_error", "internal_error", "api_error"),
        };
        ErrorKind {
            status,
            category,
            code,
            anthropic_type,
        }
    }

    /// How long the client should wait before trying again, when Backstop knows.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            GatewayError::CircuitOpen { retry_after }
            | GatewayError::RateLimited { retry_after, .. }
            | GatewayError::SessionRefused { retry_after, .. }
            | GatewayError::StateUnavailable { retry_after, .. }
            | GatewayError::Overloaded { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// Backstop refused on purpose (limits, budgets, the session guard): says nothing
    /// about whether the session's work is failing.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            GatewayError::RateLimited { .. }
                | GatewayError::BudgetExceeded { .. }
                | GatewayError::TooManyConcurrent { .. }
                | GatewayError::Unpriced { .. }
                | GatewayError::StoreUnavailable { .. }
                | GatewayError::StateUnavailable { .. }
                | GatewayError::SessionRefused { .. }
        )
    }

    /// Which budget refused (for `budget_exceeded`), as the OpenAI `param`.
    pub fn budget(&self) -> Option<&'static str> {
        match self {
            GatewayError::BudgetExceeded { budget, .. } => Some(budget),
            _ => None,
        }
    }

    /// The request parameter at fault, when there is one.
    pub fn param(&self) -> Option<&str> {
        match self {
            GatewayError::MissingModel | GatewayError::ModelNotFound(_) => Some("model"),
            GatewayError::PreviousResponseNotFound(_) => Some("previous_response_id"),
            GatewayError::ItemNotFound { param, .. } => Some(param),
            GatewayError::ConversationNotFound(_) => Some("conversation"),
            GatewayError::InvalidHeader { header, .. } => Some(header),
            GatewayError::InvalidParameter { param, .. } => Some(param),
            GatewayError::TooManyItems { param, .. } => *param,
            _ => self.budget(),
        }
    }
}

impl From<crate::api::RequestError> for GatewayError {
    fn from(err: crate::api::RequestError) -> Self {
        use crate::api::RequestError;
        match err {
            RequestError::InvalidJson(detail) => GatewayError::InvalidJson(detail),
            RequestError::NotAnObject => GatewayError::NotAnObject,
            RequestError::MissingModel => GatewayError::MissingModel,
            RequestError::InvalidParameter { param, detail } => {
                GatewayError::InvalidParameter { param, detail }
            }
        }
    }
}
