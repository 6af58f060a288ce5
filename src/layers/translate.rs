//! The translate layer, at the attempt level between the meter and the upstream leaf:
//! an attempt on a target of the other API carries its translated request (made by the
//! recovery layer when it judged the target) and an [`AnswerContext`]; its reply, whole,
//! streamed or an error, comes back in the caller's API, so every layer above (the meter,
//! validation, idempotency, the edge) sees only the caller's shape. An attempt without a
//! translation passes through untouched.
//!
//! A 2xx answer that cannot be brought back exactly (an unknown stop reason, arguments
//! that are not an object) is answered as a body no API reads, so the recovery layer
//! classifies it malformed and tries the next target, as for any malformed answer; the
//! body names the reason, which the caller is told if no target answers. It is charged
//! the target's own reported usage.

use std::task::{Context, Poll};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::{future::BoxFuture, StreamExt};
use tower::{Layer, Service};

use crate::translate::{answer, stream, AnswerContext, StreamTranslator};
use crate::{
    policy::classify::TransportFailure,
    upstream::{Attempt, Reply, ReplyBody},
    wire::sse::Splitter,
};

#[derive(Clone, Copy, Debug, Default)]
pub struct TranslateLayer;

impl<S> Layer<S> for TranslateLayer {
    type Service = Translate<S>;
    fn layer(&self, inner: S) -> Translate<S> {
        Translate { inner }
    }
}

#[derive(Clone, Debug)]
pub struct Translate<S> {
    inner: S,
}

impl<S> Service<Attempt> for Translate<S>
where
    S: Service<Attempt, Response = Reply, Error = TransportFailure>,
    S::Future: Send + 'static,
{
    type Response = Reply;
    type Error = TransportFailure;
    type Future = futures_util::future::Either<
        S::Future,
        BoxFuture<'static, Result<Reply, TransportFailure>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, attempt: Attempt) -> Self::Future {
        use futures_util::future::Either;
        let Some(cx) = attempt.translation.clone() else {
            return Either::Left(self.inner.call(attempt));
        };
        let keep_answer = attempt.keep_answer;
        let (from, to) = cx.direction.from_to();
        metrics::counter!("backstop_translations_total", "from" => from, "to" => to).increment(1);
        let future = self.inner.call(attempt);
        Either::Right(Box::pin(async move {
            let reply = future.await?;
            Ok(back(&cx, reply, keep_answer))
        }))
    }
}

/// The target's reply in the caller's API. Its usage stays the target's own, as the
/// target reported it: the meter prices what the target billed, every kind on its own
/// line, never the caller's translation of it (a stream's usage is read from the
/// target's events already, before they are translated).
fn back(cx: &AnswerContext, reply: Reply, keep_answer: bool) -> Reply {
    let endpoint = cx.direction.caller_endpoint();
    let Reply {
        status,
        headers,
        body,
        stream_usage,
        view,
    } = reply;
    let target_usage = view.map(|v| v.usage);
    match body {
        ReplyBody::Stream(body) => Reply {
            status,
            headers,
            body: ReplyBody::Stream(translated_stream(stream::translator(cx), body)),
            stream_usage,
            view: None,
        },
        ReplyBody::Full(bytes) => {
            let body = if status.is_success() {
                answer::whole(cx, &bytes).unwrap_or_else(|problem| {
                    tracing::warn!(direction = cx.direction.label(), problem = %problem.0, "an answer cannot be translated exactly");
                    untranslatable(&problem.0)
                })
            } else {
                answer::error(cx, status, &bytes)
            };
            // Anthropic's 529 (overloaded) is not a status OpenAI clients know: it is the
            // 503 an OpenAI server answers when it is overloaded.
            let status = match status.as_u16() {
                529 if endpoint.wire().openai_errors() => http::StatusCode::SERVICE_UNAVAILABLE,
                _ => status,
            };
            let mut reply = Reply::whole(endpoint, status, headers, body, keep_answer);
            if let (Some(view), Some(usage)) = (reply.view.as_mut(), target_usage) {
                view.usage = usage;
            }
            reply
        }
    }
}

/// What an untranslatable answer is replaced with: a body no API reads (so recovery
/// classifies it malformed and tries the next target) that names why, for the error
/// the caller gets if no target answers ([`untranslatable_reason`]).
const UNTRANSLATABLE: &[u8] = b"untranslatable answer: ";

fn untranslatable(reason: &str) -> Bytes {
    let mut body = BytesMut::from(UNTRANSLATABLE);
    body.extend_from_slice(reason.as_bytes());
    body.freeze()
}

/// Why a translated answer could not be brought back, if `body` is one that could not.
pub fn untranslatable_reason(body: &[u8]) -> Option<String> {
    body.strip_prefix(UNTRANSLATABLE)
        .map(|reason| String::from_utf8_lossy(reason).into_owned())
}

/// A relayed target stream, cut into events and translated as it comes.
fn translated_stream(translator: Box<dyn StreamTranslator>, body: Body) -> Body {
    struct State {
        data: axum::body::BodyDataStream,
        splitter: Splitter,
        translator: Box<dyn StreamTranslator>,
        ended: bool,
    }
    fn joined(out: Vec<Bytes>) -> Bytes {
        match out.len() {
            1 => out.into_iter().next().unwrap_or_default(),
            _ => {
                let mut all = BytesMut::with_capacity(out.iter().map(Bytes::len).sum());
                for piece in out {
                    all.extend_from_slice(&piece);
                }
                all.freeze()
            }
        }
    }
    let state = State {
        data: body.into_data_stream(),
        splitter: Splitter::default(),
        translator,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, |mut state| async move {
        if state.ended {
            return None;
        }
        let mut out = Vec::new();
        loop {
            match state.data.next().await {
                Some(Ok(chunk)) => {
                    for event in state.splitter.push(&chunk) {
                        state.translator.event(&event, &mut out);
                    }
                    // The caller's stream is over (an error event, or its end): the
                    // rest of the target's is not read, and dropping it closes it.
                    state.ended = state.translator.ended();
                    if !out.is_empty() || state.ended {
                        return (!out.is_empty() || !state.ended)
                            .then(|| (Ok::<_, std::io::Error>(joined(out)), state));
                    }
                }
                // The relay ends its own failures with an error event; a body error
                // after it (or instead of it) ends the translation the same way.
                Some(Err(_)) | None => {
                    if let Some(event) = state.splitter.finish() {
                        state.translator.event(&event, &mut out);
                    }
                    state.translator.finish(&mut out);
                    state.ended = true;
                    return (!out.is_empty()).then(|| (Ok(joined(out)), state));
                }
            }
        }
    });
    Body::from_stream(events)
}
