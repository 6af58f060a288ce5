//! Streamed answers, as typed state machines. (Stub: filled in by the answer-side work.)

use bytes::Bytes;

use super::{AnswerContext, StreamTranslator};
use crate::api::sse::SseEvent;

/// The state machine for a context's direction.
pub fn translator(cx: &AnswerContext) -> Box<dyn StreamTranslator> {
    Box::new(Unfinished(cx.clone()))
}

struct Unfinished(AnswerContext);

impl StreamTranslator for Unfinished {
    fn event(&mut self, _: &SseEvent, _: &mut Vec<Bytes>) {}
    fn finish(&mut self, _: &mut Vec<Bytes>) {}
}
