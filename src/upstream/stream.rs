//! SSE relay: each upstream chunk is handed to the client as soon as it arrives.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use futures_util::{stream, StreamExt};

use crate::{api::stream_error_event, config::ApiKind};

enum State<S> {
    Streaming(S),
    Done,
}

/// Wraps the upstream body. A transport error or a silence longer than `idle` ends the
/// stream with one error event in the caller's API, instead of a silently cut connection.
pub(super) fn relay(response: reqwest::Response, api: ApiKind, idle: Duration) -> Body {
    let upstream = response.bytes_stream().boxed();
    let chunks = stream::unfold(State::Streaming(upstream), move |state| async move {
        let State::Streaming(mut upstream) = state else {
            return None;
        };
        let event = match tokio::time::timeout(idle, upstream.next()).await {
            Ok(Some(Ok(chunk))) => return Some((Ok::<Bytes, std::io::Error>(chunk), State::Streaming(upstream))),
            Ok(None) => return None,
            Ok(Some(Err(err))) => {
                tracing::warn!(error = %err, "upstream stream broke after the first byte");
                stream_error_event(api, "upstream_stream_error", "the upstream stream ended unexpectedly")
            }
            Err(_) => {
                tracing::warn!(idle_ms = idle.as_millis() as u64, "upstream stream went silent");
                stream_error_event(api, "upstream_timeout", "the upstream stream went silent")
            }
        };
        Some((Ok(event), State::Done))
    });
    Body::from_stream(chunks)
}
