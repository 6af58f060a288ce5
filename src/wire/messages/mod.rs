//! Anthropic messages, declared once: the request's blocks, the answer, its stream events,
//! usage (cache writes and reads included) and the error shape. Bedrock's InvokeModel and
//! Vertex AI's rawPredict carry the same body.

use bytes::Bytes;
use serde_json::{json, Value};

use super::errors::ErrorParts;

/// `{"type":"error","error":{"type","message"}}`.
pub(super) fn error_value(parts: &ErrorParts<'_>) -> Value {
    json!({
        "type": "error",
        "error": { "type": parts.anthropic_type, "message": parts.message }
    })
}

/// The stream's `error` event.
pub(super) fn stream_error_event(code: &str, message: &str) -> Bytes {
    let body = json!({"type": "error", "error": {"type": code, "message": message}});
    Bytes::from(format!("event: error\ndata: {body}\n\n"))
}
