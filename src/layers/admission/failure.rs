//! A failed request as the fleet's signature names it ([`FailureKind`]): the
//! upstream's error answered as it came, a caller fault or malformed answer of
//! Backstop's own, or a loop the guard tripped the session on.

use axum::body::Body;
use http::Response;

use crate::{
    api::{signature, ParsedRequest},
    error::{Category, GatewayError},
    policy::{
        classify::ProviderError,
        fleet::FailureKind,
        guard::{Trip, TripCode, TripRule},
        restart::Outcome,
    },
    telemetry::Trail,
};

/// How a request ended, for its session's guard ([`Outcome`]): every target's breaker
/// open is an outage to wait out; the provider refusing the request itself (a 4xx but
/// 408, 409 and 429, answered as it came) or the upstream's credentials is a refusal
/// with its diagnosis; anything else failed or succeeded.
pub(super) fn guard_outcome(
    result: &Result<Response<Body>, GatewayError>,
    trail: &Trail,
    failed: bool,
    request: u64,
) -> Outcome {
    let upstream = trail.upstream.as_deref().unwrap_or("the upstream");
    match result {
        Err(GatewayError::CircuitOpen { retry_after }) => Outcome::Unavailable {
            retry_after: *retry_after,
            request,
        },
        Err(GatewayError::UpstreamAuth { upstream, status }) => credentials(upstream, *status),
        Ok(response) => {
            let status = response.status().as_u16();
            match status {
                401 | 403 => credentials(upstream, status),
                400..=499 if !matches!(status, 408 | 409 | 429) => {
                    refused(upstream, status, trail.upstream_error.as_deref())
                }
                _ if failed => Outcome::Failed,
                _ => Outcome::Succeeded,
            }
        }
        Err(_) if failed => Outcome::Failed,
        Err(_) => Outcome::Succeeded,
    }
}

fn key(parts: &[&str]) -> u64 {
    parts.iter().fold(0u64, |h, p| {
        xxhash_rust::xxh3::xxh3_64_with_seed(p.as_bytes(), h)
    })
}

/// A credential failure: nothing the agent sends can fix it, so it trips at once.
fn credentials(upstream: &str, status: u16) -> Outcome {
    Outcome::Refused {
        key: key(&["credentials", upstream]),
        diagnosis: format!(
            "`{upstream}` refused Backstop's credentials (HTTP {status}); suggested fix: an operator must fix the upstream's api_key in Backstop's config, the agent cannot"
        ),
        at_once: true,
    }
}

/// How much of a provider's message a diagnosis quotes.
const MESSAGE_CHARS: usize = 300;

/// The provider refused the request itself: its error, the field it points at, and
/// what would fix it.
fn refused(upstream: &str, status: u16, error: Option<&ProviderError>) -> Outcome {
    let none = ProviderError::default();
    let e = error.unwrap_or(&none);
    let code = if e.code.is_empty() {
        format!("http_{status}")
    } else {
        e.code.clone()
    };
    let message: String = e.message.chars().take(MESSAGE_CHARS).collect();
    let lower = message.to_ascii_lowercase();
    let fix = if code.contains("context_length")
        || lower.contains("context length")
        || lower.contains("prompt is too long")
    {
        "the conversation is longer than the model's context: shorten it (drop or summarise old turns) or route to a model with a longer context".to_string()
    } else if status == 404 || code.contains("not_found") {
        "the upstream does not have what the request names (its model?): check the model the route sends to this upstream".to_string()
    } else if status == 413 {
        "the request is too large for the upstream: send less (fewer or smaller attachments, a shorter history)".to_string()
    } else if let Some(field) = &e.field {
        format!("fix the request's `{field}` as the message says; sent again unchanged it gets the same answer")
    } else {
        "fix the request as the message says; sent again unchanged it gets the same answer"
            .to_string()
    };
    let field = e
        .field
        .as_ref()
        .map_or_else(String::new, |f| format!(" (field `{f}`)"));
    Outcome::Refused {
        key: key(&[
            upstream,
            &status.to_string(),
            &code,
            e.field.as_deref().unwrap_or(""),
        ]),
        diagnosis: format!(
            "`{upstream}` answered HTTP {status} `{code}`: {message}{field}; suggested fix: {fix}"
        ),
        at_once: false,
    }
}

/// How a request failed, as the fleet's signature names it: the upstream's error
/// answered as it came (its code, else `http_<status>`), or a caller fault or malformed
/// answer of Backstop's own (an `output_invalid` with its contract's hash and first error
/// path). `None` for failures that say nothing of the request itself: an upstream
/// outage, a rate limit or timeout (transient, the breakers' and retries' business), a
/// refusal.
pub(super) fn failure_kind(
    result: &Result<Response<Body>, GatewayError>,
    trail: &Trail,
    request: &ParsedRequest,
) -> Option<FailureKind> {
    match result {
        Ok(response) => {
            let status = response.status().as_u16();
            if !(400..500).contains(&status) || matches!(status, 408 | 429) {
                return None;
            }
            Some(FailureKind {
                class: if matches!(status, 401..=403) {
                    "credential_or_quota"
                } else {
                    "caller_fault"
                },
                code: trail
                    .upstream_error
                    .as_ref()
                    .filter(|e| !e.code.is_empty())
                    .map_or_else(|| format!("http_{status}"), |e| e.code.clone()),
                detail: format!("HTTP {status}"),
            })
        }
        Err(err) => {
            let code = err.code();
            let (class, detail) = match (code.category(), err) {
                (Category::Malformed, GatewayError::OutputInvalid { errors, .. }) => {
                    let path = errors
                        .first()
                        .and_then(|e| e.split_once(": "))
                        .map_or("", |(path, _)| path);
                    let contract = signature::contract_hash(&request.json).unwrap_or(0);
                    (
                        "malformed",
                        format!(
                            "contract {contract:016x}, first error at {}",
                            signature::mask(if path.is_empty() { "/" } else { path })
                        ),
                    )
                }
                (Category::Malformed, _) => ("malformed", "HTTP 502".to_string()),
                (Category::CallerFault, _) => ("caller_fault", format!("HTTP {}", code.status())),
                _ => return None,
            };
            Some(FailureKind {
                class,
                code: code.as_str().to_string(),
                detail,
            })
        }
    }
}

/// A loop the guard tripped a session on, as the fleet's signature names it: the tool
/// and the hash of the result it kept returning, or the identical request.
pub(super) fn loop_kind(trip: &Trip, request: &ParsedRequest) -> Option<FailureKind> {
    let detail = match trip.rule {
        TripRule::ToolLoopLimit => {
            let (name, result) = signature::last_tool_result(&request.json)?;
            format!(
                "tool {}, result {result:016x}",
                name.as_deref().unwrap_or("(unnamed)")
            )
        }
        TripRule::IdenticalRequestLimit => "identical request".to_string(),
        _ => return None,
    };
    Some(FailureKind {
        class: "loop",
        code: TripCode::LoopDetected.as_str().to_string(),
        detail,
    })
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::{
        super::tests::{call, layer_on, CHAT},
        *,
    };

    fn request() -> Arc<ParsedRequest> {
        let (_, routes) = layer_on("", "");
        call(&routes, None, CHAT).request
    }

    fn answered(status: u16) -> Result<Response<Body>, GatewayError> {
        Ok(Response::builder()
            .status(status)
            .body(Body::empty())
            .unwrap())
    }

    fn kind(
        result: Result<Response<Body>, GatewayError>,
        code: Option<&str>,
    ) -> Option<FailureKind> {
        let trail = Trail {
            upstream_error: code.map(|code| {
                Arc::new(ProviderError {
                    code: code.into(),
                    ..ProviderError::default()
                })
            }),
            ..Trail::default()
        };
        failure_kind(&result, &trail, &request())
    }

    #[test]
    fn an_upstream_error_answered_as_it_came_is_named_by_its_code_else_its_status() {
        let named = kind(answered(400), Some("context_length_exceeded")).unwrap();
        assert_eq!(
            (named.class, &*named.code, &*named.detail),
            ("caller_fault", "context_length_exceeded", "HTTP 400")
        );
        let unnamed = kind(answered(404), None).unwrap();
        assert_eq!(
            (unnamed.class, &*unnamed.code),
            ("caller_fault", "http_404")
        );
        for status in [401, 403] {
            assert_eq!(
                kind(answered(status), None).unwrap().class,
                "credential_or_quota"
            );
        }
    }

    #[test]
    fn transient_answers_and_refusals_say_nothing_of_the_request() {
        for status in [200, 408, 429, 500, 503] {
            assert_eq!(kind(answered(status), Some("x")), None, "{status}");
        }
        let refused = GatewayError::RateLimited {
            detail: String::new(),
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(kind(Err(refused), None), None);
        let outage = GatewayError::UpstreamUnavailable {
            upstream: "u".into(),
        };
        assert_eq!(kind(Err(outage), None), None);
    }

    #[test]
    fn an_invalid_output_is_named_by_its_contract_and_first_error_path_masked() {
        let invalid = |errors: Vec<String>| GatewayError::OutputInvalid {
            errors,
            attempts: 2,
        };
        let named = kind(
            Err(invalid(vec!["/items/3/price: not a number".into()])),
            None,
        )
        .unwrap();
        assert_eq!((named.class, &*named.code), ("malformed", "output_invalid"));
        assert_eq!(
            named.detail, "contract 0000000000000000, first error at /items/#/price",
            "no contract asked for: 0; numbers in the path masked"
        );
        let pathless = kind(Err(invalid(vec!["not json".into()])), None).unwrap();
        assert_eq!(
            pathless.detail,
            "contract 0000000000000000, first error at /"
        );
        let caller = GatewayError::InvalidParameter {
            param: "temperature",
            detail: "too hot".into(),
        };
        let named = kind(Err(caller), None).unwrap();
        assert_eq!(
            (named.class, &*named.code, &*named.detail),
            ("caller_fault", "invalid_parameter", "HTTP 400")
        );
    }

    #[test]
    fn only_loops_the_guard_tripped_on_have_a_loop_signature() {
        let request = request();
        let identical = Trip::new(TripRule::IdenticalRequestLimit, String::new());
        let named = loop_kind(&identical, &request).unwrap();
        assert_eq!(
            (named.class, &*named.code, &*named.detail),
            ("loop", "loop_detected", "identical request")
        );
        let no_tool_result = Trip::new(TripRule::ToolLoopLimit, String::new());
        assert_eq!(loop_kind(&no_tool_result, &request), None);
        let failures = Trip::new(TripRule::MaxConsecutiveFailures, String::new());
        assert_eq!(loop_kind(&failures, &request), None);
    }
}
