//! The wire side of the two APIs Backstop speaks: which endpoint a request is for, and
//! how errors are shaped for each API.

pub mod answer;
pub mod fingerprint;
pub mod headers;
pub mod json;
pub mod prompt;
pub mod refs;
pub mod request;
pub mod scan;
pub mod signature;
pub mod tool_calls;
pub mod usage;

pub use answer::{AnswerView, ReportedUsage};
pub use refs::StoredRefs;
pub use request::{ParsedRequest, RequestError, MAX_OUTPUT_TOKENS};

use crate::wire::Wire;

/// The authenticated caller (the auth layer puts it in a request's extensions; the
/// layers and the stored-response forwarder read it there).
#[derive(Debug)]
pub struct Tenant {
    pub name: std::sync::Arc<str>,
}

/// A proxied endpoint. The path decides the API (and so the error shape) the caller speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    ChatCompletions,
    Messages,
    /// Anthropic's `POST /v1/messages/count_tokens`: forwarded, never charged.
    CountTokens,
    Embeddings,
    /// The OpenAI Responses API (`POST /v1/responses`).
    Responses,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            "/v1/responses" => Some(Endpoint::Responses),
            _ => None,
        }
    }

    /// The wire format the caller speaks on this endpoint: what its answers and errors
    /// are shaped as (embeddings answer errors as chat does, `count_tokens` as messages).
    pub fn wire(self) -> Wire {
        match self {
            Endpoint::Messages | Endpoint::CountTokens => Wire::Messages,
            Endpoint::ChatCompletions | Endpoint::Embeddings => Wire::Chat,
            Endpoint::Responses => Wire::Responses,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
        }
    }

    /// A low-cardinality label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
        }
    }

    /// Every proxied endpoint (an upstream pre-parses a URL for each).
    pub const ALL: [Endpoint; 5] = [
        Endpoint::ChatCompletions,
        Endpoint::Messages,
        Endpoint::CountTokens,
        Endpoint::Embeddings,
        Endpoint::Responses,
    ];

    /// The request fields that cap the answer's length, in precedence order.
    pub fn output_cap_fields(self) -> &'static [&'static str] {
        match self {
            Endpoint::ChatCompletions
            | Endpoint::Messages
            | Endpoint::CountTokens
            | Endpoint::Embeddings => &["max_completion_tokens", "max_tokens"],
            Endpoint::Responses => &["max_output_tokens"],
        }
    }

    /// The error shape for a request path, before the endpoint is known to be valid.
    pub fn wire_for_path(path: &str) -> Wire {
        Endpoint::from_path(path).map_or(Wire::Chat, Endpoint::wire)
    }

    /// The error shape a caller speaks, for any path (an unknown one included): Anthropic
    /// on `/v1/messages` paths or when the caller sent `anthropic-version` (the Anthropic
    /// SDK always does), else OpenAI.
    pub fn wire_for(path: &str, headers: &http::HeaderMap) -> Wire {
        match Endpoint::from_path(path) {
            Some(endpoint) => endpoint.wire(),
            None if path == "/v1/messages" || path.starts_with("/v1/messages/") => Wire::Messages,
            None if headers.contains_key("anthropic-version") => Wire::Messages,
            None => Wire::Chat,
        }
    }

    /// The stored-response routes of the Responses API (`/v1/responses/{id}...`): no
    /// model, so not proxied by this stack (see `crate::upstream::objects`).
    pub fn is_response_object_path(path: &str) -> bool {
        path.strip_prefix("/v1/responses/")
            .is_some_and(|rest| !rest.is_empty())
    }
}

/// An answer's retry hints (`retry-after-ms`, `Retry-After`) as text, for the classifier
/// ([`crate::policy::classify`]), which takes no HTTP types. A value that is not visible
/// ASCII is no hint.
pub fn retry_hints(headers: &http::HeaderMap) -> crate::policy::classify::RetryHints<'_> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    crate::policy::classify::RetryHints {
        retry_after_ms: text("retry-after-ms"),
        retry_after: text("retry-after"),
    }
}
