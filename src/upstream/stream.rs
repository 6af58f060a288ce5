//! SSE relay: each upstream chunk is handed to the client as soon as it arrives.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::{stream::{self, BoxStream}, StreamExt};

use crate::{api::stream_error_event, config::ApiKind};

enum State {
    First(Bytes, BoxStream<'static, reqwest::Result<Bytes>>),
    Streaming(BoxStream<'static, reqwest::Result<Bytes>>),
    Done,
}

/// The client-side body of a stream whose `first` chunk has already arrived. A transport
/// error or a silence longer than `idle` afterwards ends the stream with one error event
/// in the caller's API, instead of a silently cut connection.
pub(super) fn relay(first: Bytes, rest: BoxStream<'static, reqwest::Result<Bytes>>, api: ApiKind, idle: Duration) -> Body {
    let chunks = stream::unfold(State::First(first, rest), move |state| async move {
        let mut upstream = match state {
            State::First(first, rest) => return Some((Ok::<Bytes, std::io::Error>(first), State::Streaming(rest))),
            State::Streaming(upstream) => upstream,
            State::Done => return None,
        };
        let event = match tokio::time::timeout(idle, upstream.next()).await {
            Ok(Some(Ok(chunk))) => return Some((Ok(chunk), State::Streaming(upstream))),
            Ok(None) => return None,
            Ok(Some(Err(err))) => {
                tracing::warn!(error = %err, "upstream stream broke after the first byte");
                metrics::counter!("backstop_stream_errors_total", "reason" => "broken").increment(1);
                stream_error_event(api, "upstream_stream_error", "the upstream stream ended unexpectedly")
            }
            Err(_) => {
                tracing::warn!(idle_ms = idle.as_millis() as u64, "upstream stream went silent");
                metrics::counter!("backstop_stream_errors_total", "reason" => "idle").increment(1);
                stream_error_event(api, "upstream_timeout", "the upstream stream went silent")
            }
        };
        Some((Ok(event), State::Done))
    });
    Body::from_stream(chunks)
}
