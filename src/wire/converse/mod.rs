//! Amazon Bedrock's Converse API: messages of content blocks (`text`, `image`, `toolUse`,
//! `toolResult`), `system`, `toolConfig`, `inferenceConfig`, the answer's `output`,
//! `stopReason` and `usage`, the stream's events, and Bedrock's error shape.

use serde_json::{json, Value};

use super::errors::ErrorParts;

/// Bedrock's error body: `{"message"}`, its type in the `x-amzn-errortype` header.
pub(super) fn error_value(parts: &ErrorParts<'_>) -> Value {
    json!({ "message": parts.message })
}
