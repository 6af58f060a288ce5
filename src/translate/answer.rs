//! Whole answers and error bodies, chat completions ⇄ messages.
//! (Stub: filled in by the answer-side work.)

use bytes::Bytes;
use http::StatusCode;

use super::AnswerContext;

/// Why a target's 2xx answer cannot be brought back (it is then a malformed answer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerError(pub String);

/// A target's whole 2xx answer, in the caller's API.
pub fn whole(cx: &AnswerContext, body: &[u8]) -> Result<Bytes, AnswerError> {
    let _ = (cx, body);
    Err(AnswerError("not yet translated".into()))
}

/// A target's error answer (any non-2xx), in the caller's error shape.
pub fn error(cx: &AnswerContext, status: StatusCode, body: &[u8]) -> Bytes {
    let _ = (cx, status);
    Bytes::copy_from_slice(body)
}
