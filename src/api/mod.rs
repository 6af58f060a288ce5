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
    Embeddings,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<Self> {
        match path {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/messages" => Some(Endpoint::Messages),
            "/v1/embeddings" => Some(Endpoint::Embeddings),
            _ => None,
        }
    }

    pub fn api(self) -> ApiKind {
        match self {
            Endpoint::Messages => ApiKind::Anthropic,
            Endpoint::ChatCompletions | Endpoint::Embeddings => ApiKind::OpenAi,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// A low-cardinality label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Messages => "messages",
            Endpoint::Embeddings => "embeddings",
        }
    }

    /// The error shape for a request path, before the endpoint is known to be valid.
    pub fn api_for_path(path: &str) -> ApiKind {
        Endpoint::from_path(path).map_or(ApiKind::OpenAi, Endpoint::api)
    }
}
