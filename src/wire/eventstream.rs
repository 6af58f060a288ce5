//! Bedrock's streamed answers: AWS's binary event-stream (length-prefixed frames with
//! typed headers and two CRCs, decoded by `aws-smithy-eventstream`), unframed into the
//! SSE the relay and every client of Anthropic's Messages read.
//!
//! A `chunk` event's payload is `{"bytes": "<base64 of one Anthropic event's JSON>"}`;
//! it becomes `event: <its type>\ndata: <that JSON, byte for byte>\n\n`. An exception
//! frame (`:message-type: exception`, e.g. `throttlingException` in mid-stream) ends
//! the body with an error, exactly as a connection cut in mid-stream does; a frame
//! whose CRC fails, or longer than the upstream's `max_sse_event_bytes` allows, too.

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::{HeaderValue, Message};
use base64::Engine;
use bytes::{Buf, Bytes, BytesMut};
use futures_util::StreamExt;
use serde::Deserialize;

/// Why a body stopped short (the leaf's `ChunkError`).
pub type ChunkError = Box<dyn std::error::Error + Send + Sync>;

/// A body, chunk by chunk (the leaf's `Chunks`).
pub type Chunks = futures_util::stream::BoxStream<'static, Result<Bytes, ChunkError>>;

/// Why a Bedrock stream ended short.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("Bedrock sent {exception} in mid-stream: {message}")]
    Exception { exception: String, message: String },
    #[error("a Bedrock event-stream frame of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("a Bedrock event-stream frame is malformed: {0}")]
    Malformed(String),
}

/// Bytes of a frame besides its payload's: prelude (12), message CRC (4) and headers.
const FRAME_OVERHEAD: usize = 1024;

/// The SSE of a Bedrock event-stream, chunk by chunk: each upstream chunk becomes the
/// events of the frames it completes (none: the chunk is not passed on).
pub fn unframe(upstream: Chunks, max_event_bytes: usize) -> Chunks {
    let max_frame = max_event_bytes
        .saturating_mul(2)
        .saturating_add(FRAME_OVERHEAD);
    let state = Unframer {
        upstream,
        buffer: BytesMut::new(),
        decoder: MessageFrameDecoder::new(),
        max_frame,
        done: false,
    };
    futures_util::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        loop {
            match state.drain() {
                Err(err) => {
                    state.done = true;
                    return Some((Err(Box::new(err) as ChunkError), state));
                }
                Ok(sse) if !sse.is_empty() => return Some((Ok(sse), state)),
                Ok(_) => {}
            }
            match state.upstream.next().await {
                Some(Ok(chunk)) => state.buffer.extend_from_slice(&chunk),
                Some(Err(err)) => {
                    state.done = true;
                    return Some((Err(err), state));
                }
                None if state.buffer.is_empty() => return None,
                None => {
                    state.done = true;
                    let err = StreamError::Malformed(format!(
                        "the stream ended inside a frame ({} bytes left)",
                        state.buffer.len()
                    ));
                    return Some((Err(Box::new(err) as ChunkError), state));
                }
            }
        }
    })
    .boxed()
}

struct Unframer {
    upstream: Chunks,
    buffer: BytesMut,
    decoder: MessageFrameDecoder,
    max_frame: usize,
    done: bool,
}

impl Unframer {
    /// The SSE of every whole frame in the buffer.
    fn drain(&mut self) -> Result<Bytes, StreamError> {
        let mut sse = BytesMut::new();
        // A frame is decoded only once it is whole, so its declared length can be
        // checked first (the decoder itself would buffer any length).
        while self.buffer.len() >= 4 {
            let total = (&self.buffer[..4]).get_u32() as usize;
            if total > self.max_frame {
                return Err(StreamError::TooLarge(total));
            }
            if self.buffer.len() < total {
                break;
            }
            let message = match self.decoder.decode_frame(&mut self.buffer) {
                Ok(DecodedFrame::Complete(message)) => message,
                Ok(DecodedFrame::Incomplete) => {
                    return Err(StreamError::Malformed(format!(
                        "a frame declared {total} bytes and was not whole"
                    )))
                }
                Err(err) => return Err(StreamError::Malformed(err.to_string())),
            };
            event_of(&message, &mut sse)?;
        }
        Ok(sse.freeze())
    }
}

#[derive(Deserialize)]
struct ChunkPayload {
    bytes: String,
}

#[derive(Deserialize)]
struct EventType<'a> {
    #[serde(rename = "type", borrow)]
    kind: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize, Default)]
struct ExceptionPayload {
    #[serde(default, alias = "Message")]
    message: String,
}

fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    message
        .headers()
        .iter()
        .find(|h| h.name().as_str() == name)
        .and_then(|h| match h.value() {
            HeaderValue::String(s) => Some(s.as_str()),
            _ => None,
        })
}

/// Appends the SSE event of one frame (nothing for events other than `chunk`).
fn event_of(message: &Message, sse: &mut BytesMut) -> Result<(), StreamError> {
    match header(message, ":message-type") {
        Some("event") => {}
        Some("exception" | "error") => {
            let payload: ExceptionPayload =
                serde_json::from_slice(message.payload()).unwrap_or_default();
            let exception = header(message, ":exception-type")
                .or(header(message, ":error-code"))
                .unwrap_or("an exception")
                .to_string();
            return Err(StreamError::Exception {
                exception,
                message: payload.message,
            });
        }
        other => {
            return Err(StreamError::Malformed(format!(
                "a frame of message type {other:?}"
            )))
        }
    }
    if header(message, ":event-type") != Some("chunk") {
        return Ok(());
    }
    let payload: ChunkPayload = serde_json::from_slice(message.payload())
        .map_err(|err| StreamError::Malformed(format!("a chunk payload: {err}")))?;
    let json = base64::engine::general_purpose::STANDARD
        .decode(payload.bytes.as_bytes())
        .map_err(|err| StreamError::Malformed(format!("a chunk's bytes: {err}")))?;
    let event: EventType<'_> = serde_json::from_slice(&json)
        .map_err(|err| StreamError::Malformed(format!("a chunk's event: {err}")))?;
    sse.extend_from_slice(b"event: ");
    sse.extend_from_slice(event.kind.as_bytes());
    sse.extend_from_slice(b"\ndata: ");
    sse.extend_from_slice(&json);
    sse.extend_from_slice(b"\n\n");
    Ok(())
}

/// One `chunk` frame carrying `event` (an Anthropic event's JSON), as Bedrock frames
/// it: what the mock's Bedrock sends, and the tests' fixtures.
pub fn chunk_frame(event: &[u8]) -> Bytes {
    let payload = serde_json::json!({
        "bytes": base64::engine::general_purpose::STANDARD.encode(event),
        "p": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0",
    });
    frame(
        &[
            (":event-type", "chunk"),
            (":content-type", "application/json"),
            (":message-type", "event"),
        ],
        payload.to_string().into_bytes(),
    )
}

/// An exception frame (`throttlingException`, `modelStreamErrorException`, ...).
pub fn exception_frame(exception: &str, message: &str) -> Bytes {
    frame(
        &[
            (":exception-type", exception),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        serde_json::json!({"message": message})
            .to_string()
            .into_bytes(),
    )
}

fn frame(headers: &[(&'static str, &str)], payload: Vec<u8>) -> Bytes {
    let mut message = Message::new(payload);
    for (name, value) in headers {
        message = message.add_header(aws_smithy_types::event_stream::Header::new(
            *name,
            HeaderValue::String(value.to_string().into()),
        ));
    }
    let mut out = BytesMut::new();
    aws_smithy_eventstream::frame::write_message_to(&message, &mut out)
        .expect("a small frame encodes");
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: Vec<Bytes>) -> Chunks {
        futures_util::stream::iter(parts.into_iter().map(Ok)).boxed()
    }

    async fn collect(stream: Chunks) -> (String, Option<String>) {
        let mut out = String::new();
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            match item {
                Ok(bytes) => out.push_str(std::str::from_utf8(&bytes).unwrap()),
                Err(err) => return (out, Some(err.to_string())),
            }
        }
        (out, None)
    }

    const START: &str = r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude","stop_reason":null,"usage":{"input_tokens":3,"output_tokens":1}}}"#;
    const DELTA: &str =
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hé"}}"#;

    /// Frames written with the crate's encoder come back as the SSE events they carry,
    /// byte for byte, however the bytes are cut (one at a time here).
    #[tokio::test]
    async fn frames_round_trip_into_sse_whatever_the_cuts() {
        let mut wire = BytesMut::new();
        wire.extend_from_slice(&chunk_frame(START.as_bytes()));
        wire.extend_from_slice(&chunk_frame(DELTA.as_bytes()));
        let expected = format!(
            "event: message_start\ndata: {START}\n\nevent: content_block_delta\ndata: {DELTA}\n\n"
        );
        let whole = collect(unframe(chunks(vec![wire.clone().freeze()]), 1 << 20)).await;
        assert_eq!(whole, (expected.clone(), None));
        let bytewise: Vec<Bytes> = wire.iter().map(|b| Bytes::copy_from_slice(&[*b])).collect();
        assert_eq!(
            collect(unframe(chunks(bytewise), 1 << 20)).await,
            (expected, None)
        );
    }

    #[tokio::test]
    async fn an_exception_frame_ends_the_stream_with_an_error_after_what_came_before() {
        let parts = vec![
            chunk_frame(START.as_bytes()),
            exception_frame("throttlingException", "Too many tokens, please wait"),
            chunk_frame(DELTA.as_bytes()),
        ];
        let (sse, err) = collect(unframe(chunks(parts), 1 << 20)).await;
        assert_eq!(sse, format!("event: message_start\ndata: {START}\n\n"));
        assert_eq!(
            err.as_deref(),
            Some("Bedrock sent throttlingException in mid-stream: Too many tokens, please wait")
        );
    }

    #[tokio::test]
    async fn a_corrupt_an_oversized_or_a_truncated_frame_is_an_error() {
        let mut corrupt = BytesMut::from(&chunk_frame(START.as_bytes())[..]);
        let last = corrupt.len() - 5;
        corrupt[last] ^= 0xff;
        let (sse, err) = collect(unframe(chunks(vec![corrupt.freeze()]), 1 << 20)).await;
        assert_eq!(sse, "");
        assert!(
            err.as_deref().unwrap_or("").contains("malformed"),
            "{sse:?} {err:?}"
        );

        let long = format!(r#"{{"type":"ping","pad":"{}"}}"#, "x".repeat(2000));
        let (_, err) = collect(unframe(chunks(vec![chunk_frame(long.as_bytes())]), 16)).await;
        assert!(
            err.unwrap().contains("over the limit"),
            "a frame longer than the cap"
        );

        let whole = chunk_frame(START.as_bytes());
        let (_, err) = collect(unframe(
            chunks(vec![whole.slice(..whole.len() - 3)]),
            1 << 20,
        ))
        .await;
        assert!(err.unwrap().contains("ended inside a frame"));
    }
}
