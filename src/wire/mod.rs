//! The wire formats Backstop reads and writes, one module each: its types, stream events,
//! usage, error shape and tools. This is the only code that knows a format's JSON; it
//! imports nothing of Backstop, so a format can be read beside any layer.
//!
//! - [`chat`]: OpenAI chat completions (also Vertex's OpenAI-compatible endpoint);
//! - [`messages`]: Anthropic messages (also Bedrock's InvokeModel and Vertex's rawPredict);
//! - [`responses`]: the OpenAI Responses API;
//! - [`converse`]: Amazon Bedrock's Converse API;
//! - [`sse`]: server-sent events, whatever format they carry;
//! - [`eventstream`]: AWS's binary event-stream framing (Bedrock's streams), unframed
//!   into the SSE of the format the frames carry.

pub mod chat;
pub mod converse;
mod errors;
pub mod eventstream;
pub mod messages;
pub mod responses;
pub mod sse;

use bytes::Bytes;

pub use errors::ErrorParts;

/// A wire format: the shape of a request body, its answer (whole and streamed) and its
/// errors. What a caller speaks and what a target is sent are each one of these; where
/// they differ, `translate` converts between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wire {
    /// OpenAI chat completions.
    Chat,
    /// Anthropic messages.
    Messages,
    /// The OpenAI Responses API: `text.format`, flat function tools, `output` items.
    Responses,
    /// Amazon Bedrock's Converse API. Only targets speak it: validation, side effects and
    /// everything else above the translate layer read the caller's format, never this.
    Converse,
}

impl Wire {
    /// A low-cardinality label for traces, metrics and the translation headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Wire::Chat => "chat",
            Wire::Messages => "messages",
            Wire::Responses => "responses",
            Wire::Converse => "converse",
        }
    }

    /// Whether errors in this format are OpenAI's `{"error":{"message","type","code",
    /// "param"}}` (chat and Responses share it).
    pub fn openai_errors(self) -> bool {
        matches!(self, Wire::Chat | Wire::Responses)
    }
}

/// The JSON error body in the format's shape.
pub fn error_body(wire: Wire, parts: &ErrorParts<'_>) -> Bytes {
    let value = match wire {
        Wire::Chat | Wire::Responses => chat::error_value(parts),
        Wire::Messages => messages::error_value(parts),
        Wire::Converse => converse::error_value(parts),
    };
    Bytes::from(value.to_string())
}

/// A well-formed SSE event that ends a stream which failed after its first byte, in the
/// format's own event shape.
pub fn stream_error_event(wire: Wire, code: &str, message: &str) -> Bytes {
    match wire {
        Wire::Responses => responses::stream_error_event(code, message),
        // Backstop writes Converse only to its own tests' emulator; a Converse stream it
        // ends is read by no client, so the chat shape serves.
        Wire::Chat | Wire::Converse => chat::stream_error_event(code, message),
        Wire::Messages => messages::stream_error_event(code, message),
    }
}
