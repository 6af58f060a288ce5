//! OpenAI chat completions: the request's messages and tools, the answer and its chunks,
//! usage and the error shape (also spoken by Azure OpenAI and Vertex AI's
//! OpenAI-compatible endpoint).

use bytes::Bytes;
use serde_json::{json, Value};

use super::errors::ErrorParts;

/// `{"error":{"message","type","code","param"}}` (the Responses API's too).
pub(super) fn error_value(parts: &ErrorParts<'_>) -> Value {
    json!({
        "error": {
            "message": parts.message,
            "type": parts.category,
            "code": parts.code,
            "param": parts.param,
        }
    })
}

/// A chunk stream's error: an unnamed event carrying the error body.
pub(super) fn stream_error_event(code: &str, message: &str) -> Bytes {
    let body = json!({"error": {"message": message, "type": "upstream_error", "code": code, "param": null}});
    Bytes::from(format!("data: {body}\n\n"))
}
