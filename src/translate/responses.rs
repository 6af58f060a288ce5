//! The Responses API → Anthropic messages: requests (without `previous_response_id`), and
//! answers whole and streamed. (Stub: filled in by the Responses work.)

use bytes::Bytes;
use serde_json::{Map, Value};

use super::{answer::AnswerError, AnswerContext, Judge, StreamTranslator};

/// A Responses create as an Anthropic messages request; what it cannot carry goes to
/// `judge`. `max_tokens` is the target's configured default when the caller set no
/// `max_output_tokens`.
pub fn request(
    caller: &Map<String, Value>,
    judge: &mut Judge<'_>,
    max_tokens: Option<u64>,
) -> Map<String, Value> {
    let _ = (caller, max_tokens);
    judge.lose("", "");
    Map::new()
}

/// A whole messages answer as a Responses `response` object.
pub fn whole(cx: &AnswerContext, body: &[u8]) -> Result<Bytes, AnswerError> {
    let _ = (cx, body);
    Err(AnswerError("not yet translated".into()))
}

/// Messages events as Responses events.
pub fn translator(cx: &AnswerContext) -> Box<dyn StreamTranslator> {
    let _ = cx;
    unimplemented!("Responses stream translation")
}
