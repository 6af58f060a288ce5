use bytes::Bytes;
use serde_json::json;

use super::{ApiKind, Endpoint};

/// What an error says, independent of the API shape it will be written in.
pub struct ErrorParts<'a> {
    /// OpenAI `type`: a broad category (`invalid_request_error`, `upstream_error`, ...).
    pub category: &'a str,
    /// The exact thing that happened (`model_not_found`, `upstream_timeout`, ...).
    pub code: &'a str,
    /// Anthropic `type`: Anthropic's own name where one exists, else `code`.
    pub anthropic_type: &'a str,
    pub message: &'a str,
    pub param: Option<&'a str>,
}

/// The JSON error body in the caller's API shape.
pub fn error_body(api: ApiKind, parts: &ErrorParts<'_>) -> Bytes {
    let value = match api {
        ApiKind::OpenAi => json!({
            "error": {
                "message": parts.message,
                "type": parts.category,
                "code": parts.code,
                "param": parts.param,
            }
        }),
        ApiKind::Anthropic => json!({
            "type": "error",
            "error": { "type": parts.anthropic_type, "message": parts.message }
        }),
    };
    Bytes::from(value.to_string())
}

/// A well-formed SSE event that ends a stream which failed after its first byte, in the
/// endpoint's own event format.
pub fn stream_error_event(endpoint: Endpoint, code: &str, message: &str) -> Bytes {
    match endpoint {
        // The Responses API's error event is typed and flat, like its other events.
        Endpoint::Responses => {
            let body = json!({"type": "error", "code": code, "message": message, "param": null});
            Bytes::from(format!("event: error\ndata: {body}\n\n"))
        }
        Endpoint::ChatCompletions | Endpoint::Embeddings => {
            let body = json!({"error": {"message": message, "type": "upstream_error", "code": code, "param": null}});
            Bytes::from(format!("data: {body}\n\n"))
        }
        Endpoint::Messages | Endpoint::CountTokens => {
            let body = json!({"type": "error", "error": {"type": code, "message": message}});
            Bytes::from(format!("event: error\ndata: {body}\n\n"))
        }
    }
}
