//! The last failure seen, and how it is answered when no target succeeded.

use std::{sync::Arc, time::Duration};

use super::{answered, Answered};
use crate::{
    error::{GatewayError, Protocol},
    policy::classify::{Class, TransportFailure},
    upstream::{Reply, ReplyBody},
};

// The large variants hold a whole reply, moved a few times per attempt: boxing it would
// cost an allocation per attempt to save a memcpy.
/// The last failure seen, answered when nothing succeeds.
#[allow(clippy::large_enum_variant)]
pub(super) enum Failure {
    Reply {
        reply: Reply,
        class: Class,
        upstream: Arc<str>,
    },
    Transport {
        failure: TransportFailure,
        upstream: Arc<str>,
        timeout: Duration,
        /// The attempt's timeout was cut short by the request deadline.
        cut_by_deadline: bool,
    },
}

impl Failure {
    /// The answer when no target succeeded: the upstream's own response where it tells
    /// the client something true (429/503 with Retry-After, quota), a typed error where
    /// it would mislead (the provider refusing *Backstop's* key is not the client's 401).
    pub(super) fn answer(self, request_timeout: Duration) -> Result<Answered, GatewayError> {
        match self {
            Failure::Reply {
                reply,
                class: Class::CredentialOrQuota,
                upstream,
            } if matches!(reply.status.as_u16(), 401 | 403) => Err(GatewayError::UpstreamAuth {
                upstream: upstream.to_string(),
                status: reply.status.as_u16(),
            }),
            Failure::Reply {
                reply,
                class: Class::Malformed,
                upstream,
            } => Err(match &reply.body {
                ReplyBody::Full(body) => {
                    match crate::layers::translate::untranslatable_reason(body) {
                        Some(reason) => GatewayError::UpstreamUntranslatable {
                            upstream: upstream.to_string(),
                            reason,
                        },
                        None => GatewayError::UpstreamMalformed {
                            upstream: upstream.to_string(),
                        },
                    }
                }
                ReplyBody::Stream(_) => GatewayError::UpstreamMalformed {
                    upstream: upstream.to_string(),
                },
            }),
            Failure::Reply {
                reply,
                class: Class::Redirect,
                upstream,
            } => Err(GatewayError::UpstreamProtocol {
                upstream: upstream.to_string(),
                problem: Protocol::Redirect(reply.status.as_u16()),
            }),
            Failure::Transport {
                failure: failure @ (TransportFailure::TooLarge | TransportFailure::NotAStream),
                upstream,
                ..
            } => Err(GatewayError::UpstreamProtocol {
                upstream: upstream.to_string(),
                problem: if failure == TransportFailure::TooLarge {
                    Protocol::TooLarge
                } else {
                    Protocol::NotAStream
                },
            }),
            Failure::Reply { reply, .. } => Ok(answered(reply)),
            // Out of time because the client's deadline came, not because the upstream
            // was slower than its own attempt timeout.
            Failure::Transport {
                failure: TransportFailure::Timeout,
                cut_by_deadline: true,
                ..
            } => Err(GatewayError::RequestTimeout(request_timeout)),
            Failure::Transport {
                failure: TransportFailure::Timeout,
                upstream,
                timeout,
                ..
            } => Err(GatewayError::UpstreamTimeout {
                upstream: upstream.to_string(),
                timeout,
            }),
            Failure::Transport { upstream, .. } => Err(GatewayError::UpstreamUnavailable {
                upstream: upstream.to_string(),
            }),
        }
    }
}
