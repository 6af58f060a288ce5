//! The OpenAI Responses API: input items, `output` items, the typed stream events, usage
//! and its errors (OpenAI's error body; a flat typed `error` event in streams).

use bytes::Bytes;
use serde_json::json;

/// The Responses API's error event is typed and flat, like its other events.
pub(super) fn stream_error_event(code: &str, message: &str) -> Bytes {
    let body = json!({"type": "error", "code": code, "message": message, "param": null});
    Bytes::from(format!("event: error\ndata: {body}\n\n"))
}
