//! The wire side of the two APIs Backstop speaks: which endpoint a request is for, and
//! how errors are shaped for each API.

pub mod answer;
pub mod json;
pub mod request;
mod shape;

pub use answer::{AnswerView, ReportedUsage};
pub use request::{ParsedRequest, RequestError, MAX_OUTPUT_TOKENS};
pub use shape::{error_body, stream_error_event, ErrorParts};

use serde::Deserialize;

/// The wire API an upstream speaks; it decides the credential header and error shape.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum ApiKind {
    #[serde(rename = "openai")]
    OpenAi,
    Anthropic,
}

impl ApiKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ApiKind::OpenAi => "openai",
            ApiKind::Anthropic => "anthropic",
        }
    }
}

/// A proxied endpoint. The path decides the API (and so the error shape) the caller speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    ChatCompletions,
    Messages,
    /// Anthropic's `POST /v1/messages/count_tokens`: forwarded, never charged.
    CountTokens,
    Embeddings,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/messages/count_tokens" => Some(Endpoint::CountTokens),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            _ => None,
        }
    }

    pub fn api(self) -> ApiKind {
        match self {
            Endpoint::Messages | Endpoint::CountTokens => ApiKind::Anthropic,
            Endpoint::ChatCompletions | Endpoint::Embeddings => ApiKind::OpenAi,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::CountTokens => "/v1/messages/count_tokens",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// A low-cardinality label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Messages => "messages",
            Endpoint::CountTokens => "count_tokens",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// Every endpoint, for tables built once per upstream.
    pub const ALL: [Endpoint; 4] = [
        Endpoint::ChatCompletions,
        Endpoint::Messages,
        Endpoint::CountTokens,
        Endpoint::Embeddings,
    ];

    /// The error shape for a request path, before the endpoint is known to be valid.
    pub fn api_for_path(path: &str) -> ApiKind {
        Endpoint::from_path(path).map_or(ApiKind::OpenAi, Endpoint::api)
    }

    /// The error shape a caller speaks, for any path (an unknown one included): Anthropic
    /// on `/v1/messages` paths or when the caller sent `anthropic-version` (the Anthropic
    /// SDK always does), else OpenAI.
    pub fn api_for(path: &str, headers: &http::HeaderMap) -> ApiKind {
        match Endpoint::from_path(path) {
            Some(endpoint) => endpoint.api(),
            None if path == "/v1/messages" || path.starts_with("/v1/messages/") => {
                ApiKind::Anthropic
            }
            None if headers.contains_key("anthropic-version") => ApiKind::Anthropic,
            None => ApiKind::OpenAi,
        }
    }
}
