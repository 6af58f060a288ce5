//! Typed errors raised by the layers. They travel as `Err` through the tower stack and
//! become HTTP responses in exactly one place, [`respond`]. Each answers with an
//! [`ErrorCode`], from which its status, both APIs' types and whether it is a refusal
//! follow. The admin API's own errors are `crate::admin::AdminError`, answered alike.

pub mod budget;
pub mod code;
pub mod respond;

use std::time::Duration;

pub use code::{Category, ErrorCode};

use crate::policy::guard::TripCode;

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
    /// The route's only targets are Bedrock models that are not Anthropic's: they are
    /// served over Bedrock's Converse API, which Backstop does not speak yet.
    #[error("model `{model}` is served by the Bedrock model `{target_model}` of upstream `{upstream}`, which needs Bedrock's Converse API: Backstop does not speak it yet (Anthropic's models on Bedrock are served)")]
    ConverseUnsupported {
        model: String,
        upstream: String,
        target_model: String,
    },
    /// No target of the route can carry the request exactly in its API: the JSON paths
    /// with no equivalent, per target.
    #[error("no target of model `{model}` can take this request without losing {}: \
             the other provider has no exact equivalent (a route may allow named losses \
             with `translate.drop`)", paths.join(", "))]
    UnsupportedConversion { model: String, paths: Vec<String> },
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
    /// A valid answer of the target's API that the caller's API cannot say.
    #[error("the upstream `{upstream}` gave an answer that cannot be translated back: {reason}")]
    UpstreamUntranslatable { upstream: String, reason: String },
    #[error("the upstream `{upstream}` {problem}")]
    UpstreamProtocol { upstream: String, problem: Protocol },
    #[error("every upstream for this model is failing and its circuit breaker is open; retry after {retry_after:?}")]
    CircuitOpen { retry_after: Duration },
    /// No target answered, and some were never tried because the request cannot be
    /// translated for them: the error says which, and the JSON paths that kept it away.
    #[error("{error}; not tried, the request cannot be translated for them: {skipped}")]
    Skipped {
        error: Box<GatewayError>,
        skipped: String,
    },
    #[error("the request did not complete within {0:?}")]
    RequestTimeout(Duration),
    #[error("no such endpoint: {method} {path}")]
    NotFound { method: String, path: String },
    #[error("{method} is not allowed on {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("the request's JSON schema is invalid: {0}")]
    InvalidSchema(String),
    #[error("the model's output did not validate after {attempts} attempts: {}", errors.join("; "))]
    OutputInvalid { errors: Vec<String>, attempts: u32 },
    #[error("this Idempotency-Key was already used with a different request body")]
    IdempotencyKeyReused,
    /// An answer proposed a side effect the session already committed
    /// (`[tenants.side_effects]`): not passed on.
    #[error("the model proposed `{tool}` again with the same arguments, but this session already made that call ({call_id}, which {}); the repeat was not passed on. Send `x-backstop-allow-repeat: {tool}` to repeat it on purpose", match result { Some(r) => format!("returned: {r}"), None => "succeeded".to_string() })]
    DuplicateSideEffect {
        tool: String,
        call_id: String,
        result: Option<String>,
    },
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
        code: TripCode,
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
    /// The store could not record a budgeted call (or an operator's action, for the
    /// admin API): refused rather than served unaccounted.
    #[error("{detail}")]
    StoreUnavailable { detail: String },
    /// The shared state (Redis) cannot decide this call's budget or idempotency, or has
    /// lost its data: refused rather than decided blind (`[state] on_unavailable`).
    #[error("{detail}")]
    StateUnavailable {
        detail: String,
        retry_after: Duration,
    },
    /// A stored object (a response) the tenant does not have.
    #[error("no such {what}")]
    NoSuchObject { what: &'static str },
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
    pub fn code(self) -> ErrorCode {
        match self {
            Protocol::Redirect(_) => ErrorCode::UpstreamRedirect,
            Protocol::TooLarge => ErrorCode::UpstreamResponseTooLarge,
            Protocol::NotAStream => ErrorCode::UpstreamNotStreaming,
        }
    }
}

impl From<TripCode> for ErrorCode {
    fn from(trip: TripCode) -> ErrorCode {
        match trip {
            TripCode::SessionTripped => ErrorCode::SessionTripped,
            TripCode::LoopDetected => ErrorCode::LoopDetected,
        }
    }
}

impl GatewayError {
    /// The code this error is answered with; status, types and whether it is a refusal
    /// follow from it.
    pub fn code(&self) -> ErrorCode {
        use GatewayError::*;
        match self {
            Unauthorized => ErrorCode::InvalidApiKey,
            InvalidJson(_) | NotAnObject => ErrorCode::InvalidJson,
            InvalidHeader { .. } => ErrorCode::InvalidHeader,
            InvalidParameter { .. } => ErrorCode::InvalidParameter,
            MissingModel => ErrorCode::MissingModel,
            PreviousResponseNotFound(_) => ErrorCode::PreviousResponseNotFound,
            ItemNotFound { .. } => ErrorCode::ItemNotFound,
            ConversationNotFound(_) => ErrorCode::ConversationNotFound,
            ModelNotFound(_) => ErrorCode::ModelNotFound,
            ApiMismatch { .. } | ConverseUnsupported { .. } => ErrorCode::ApiMismatch,
            UnsupportedConversion { .. } => ErrorCode::UnsupportedConversion,
            BodyTooLarge { .. } => ErrorCode::RequestTooLarge,
            TooManyItems { .. } => ErrorCode::TooManyItems,
            Overloaded { .. } => ErrorCode::Overloaded,
            BodyRead(_) => ErrorCode::BodyReadError,
            BodyTimeout => ErrorCode::RequestBodyTimeout,
            UpstreamUnavailable { .. } => ErrorCode::UpstreamUnavailable,
            UpstreamTimeout { .. } => ErrorCode::UpstreamTimeout,
            UpstreamAuth { .. } => ErrorCode::UpstreamAuthFailed,
            UpstreamMalformed { .. } | UpstreamUntranslatable { .. } => {
                ErrorCode::UpstreamMalformed
            }
            UpstreamProtocol { problem, .. } => problem.code(),
            CircuitOpen { .. } => ErrorCode::CircuitOpen,
            Skipped { error, .. } => error.code(),
            RequestTimeout(_) => ErrorCode::RequestTimeout,
            NotFound { .. } => ErrorCode::UnknownEndpoint,
            MethodNotAllowed { .. } => ErrorCode::MethodNotAllowed,
            InvalidSchema(_) => ErrorCode::InvalidSchema,
            OutputInvalid { .. } => ErrorCode::OutputInvalid,
            IdempotencyKeyReused => ErrorCode::IdempotencyKeyReused,
            DuplicateSideEffect { .. } => ErrorCode::DuplicateSideEffect,
            SessionRefused { code, .. } => (*code).into(),
            RateLimited { .. } => ErrorCode::RateLimited,
            BudgetExceeded { .. } => ErrorCode::BudgetExceeded,
            TooManyConcurrent { .. } => ErrorCode::TooManyConcurrent,
            Unpriced { .. } => ErrorCode::UnpricedModel,
            StoreUnavailable { .. } => ErrorCode::StoreUnavailable,
            StateUnavailable { .. } => ErrorCode::StateUnavailable,
            NoSuchObject { .. } => ErrorCode::NotFound,
            Internal => ErrorCode::Internal,
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
            GatewayError::Skipped { error, .. } => error.retry_after(),
            _ => None,
        }
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
            GatewayError::Skipped { error, .. } => error.param(),
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
