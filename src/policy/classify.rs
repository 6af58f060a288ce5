//! The error taxonomy of PRODUCT.md as one pure function: what an upstream attempt's
//! outcome *is*. The class alone decides what recovery does with it.

use std::time::{Duration, SystemTime};

use serde::Deserialize;

/// How an attempt failed before any response head arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportFailure {
    /// Could not connect (refused, DNS, TLS).
    Connect,
    /// The connection dropped before a complete response (reset, EOF, broken stream
    /// before its first byte).
    Reset,
    /// The attempt exceeded its timeout.
    Timeout,
    /// The upstream's body was larger than `server.max_response_bytes`.
    TooLarge,
    /// A stream was asked for and the upstream answered 2xx with something other than
    /// `text/event-stream` (SDK stream parsers would reject it).
    NotAStream,
}

impl TransportFailure {
    pub fn label(self) -> &'static str {
        match self {
            TransportFailure::Connect => "connect",
            TransportFailure::Reset => "reset",
            TransportFailure::Timeout => "timeout",
            TransportFailure::TooLarge => "too_large",
            TransportFailure::NotAStream => "not_a_stream",
        }
    }
}

/// A provider's retry hints as it sent them: `retry-after-ms` (OpenAI) and `Retry-After`
/// (seconds or an HTTP date). The caller reads them out of the answer's headers (see
/// [`crate::api::retry_hints`]), so the policy judges text and knows no HTTP types.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryHints<'a> {
    pub retry_after_ms: Option<&'a str>,
    pub retry_after: Option<&'a str>,
}

/// What the classifier looks at.
#[derive(Debug, Clone, Copy)]
pub enum Observed<'a> {
    Response {
        status: u16,
        hints: RetryHints<'a>,
        /// The whole body for non-streaming answers and for error statuses; empty for a
        /// successful stream (its head is all there is to judge).
        body: &'a [u8],
        /// For a 2xx: the leaf read it as an answer (a stream, or a body that is JSON;
        /// see [`crate::api::AnswerView`]). Otherwise it is malformed.
        readable: bool,
    },
    Transport(TransportFailure),
}

/// The classes of PRODUCT.md's error taxonomy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Class {
    Success,
    /// Worth a backoff retry (429, 5xx, 529, connect/reset/timeout).
    Transient {
        retry_after: Option<Duration>,
        /// 429: counts only lightly against the upstream's breaker.
        rate_limited: bool,
    },
    /// A 2xx whose body is not what was asked for (not JSON, or not the schema).
    Malformed,
    /// The caller's own mistake: never retried on the same target.
    CallerFault {
        context_length: bool,
    },
    /// The provider refused Backstop's credentials or quota: that upstream is out.
    CredentialOrQuota,
    /// A 3xx: redirects are never followed (the provider key must not travel to another
    /// origin), so that upstream cannot answer this request.
    Redirect,
}

impl Class {
    pub fn label(&self) -> &'static str {
        match self {
            Class::Success => "success",
            Class::Transient { .. } => "transient",
            Class::Malformed => "malformed",
            Class::CallerFault { .. } => "caller_fault",
            Class::CredentialOrQuota => "credential_or_quota",
            Class::Redirect => "redirect",
        }
    }
}

#[derive(Deserialize, Default)]
struct ErrorEnvelope {
    #[serde(default)]
    error: Option<ErrorFields>,
}

#[derive(Deserialize, Default)]
struct ErrorFields {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    /// Google's canonical status (`RESOURCE_EXHAUSTED`), where Gemini has no `type`.
    #[serde(default)]
    status: Option<String>,
    #[serde(default)]
    message: Option<String>,
    /// OpenAI's: the request field the error is about.
    #[serde(default)]
    param: Option<serde_json::Value>,
}

/// The error code, type and message of an OpenAI or Anthropic error body, lower-cased.
/// Gemini's OpenAI-compatible endpoint wraps its error object in an array
/// (`[{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", ...}}]`): the first
/// element is read, and its `status` stands for the type.
fn error_fields(body: &[u8]) -> (String, String, String) {
    let fields = fields(body).unwrap_or_default();
    let code = match fields.code {
        Some(serde_json::Value::String(s)) => s.to_ascii_lowercase(),
        _ => String::new(),
    };
    (
        code,
        fields
            .kind
            .or(fields.status)
            .unwrap_or_default()
            .to_ascii_lowercase(),
        fields.message.unwrap_or_default().to_ascii_lowercase(),
    )
}

/// An error body's error object, as the provider wrote it.
fn fields(body: &[u8]) -> Option<ErrorFields> {
    let envelope = if body.trim_ascii_start().starts_with(b"[") {
        serde_json::from_slice::<Vec<ErrorEnvelope>>(body)
            .ok()
            .and_then(|all| all.into_iter().next())
    } else {
        serde_json::from_slice::<ErrorEnvelope>(body).ok()
    };
    envelope.and_then(|e| e.error)
}

/// A provider's error answer as a diagnosis reads it: its code (else its type, lower
/// case), its message as written, and the request field it points at: OpenAI's
/// `param`, else the path an Anthropic message begins with (`messages.1.content: ...`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProviderError {
    pub code: String,
    pub message: String,
    pub field: Option<String>,
}

/// The provider's error in an error body; `None` when it is none of theirs.
pub fn provider_error(body: &[u8]) -> Option<ProviderError> {
    let f = fields(body)?;
    let code = match &f.code {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.to_ascii_lowercase(),
        _ => f
            .kind
            .clone()
            .or(f.status.clone())
            .unwrap_or_default()
            .to_ascii_lowercase(),
    };
    let message = f.message.unwrap_or_default();
    let field = match f.param {
        Some(serde_json::Value::String(p)) if !p.is_empty() => Some(p),
        _ => message
            .split_once(": ")
            .map(|(head, _)| head)
            .filter(|head| {
                !head.is_empty() && !head.contains(char::is_whitespace) && head.contains(['.', '['])
            })
            .map(str::to_string),
    };
    (!code.is_empty() || !message.is_empty()).then_some(ProviderError {
        code,
        message,
        field,
    })
}

/// The error code an OpenAI or Anthropic error body names (else its type), lower-cased:
/// `context_length_exceeded`, `invalid_request_error`. `None` when it names neither.
pub fn error_code(body: &[u8]) -> Option<String> {
    let (code, kind, _) = error_fields(body);
    [code, kind].into_iter().find(|s| !s.is_empty())
}

/// Classifies one attempt. `now` resolves an HTTP-date `Retry-After`.
pub fn classify(observed: Observed<'_>, now: SystemTime) -> Class {
    let (status, hints, body, readable) = match observed {
        Observed::Transport(TransportFailure::TooLarge | TransportFailure::NotAStream) => {
            return Class::Malformed
        }
        Observed::Transport(_) => {
            return Class::Transient {
                retry_after: None,
                rate_limited: false,
            }
        }
        Observed::Response {
            status,
            hints,
            body,
            readable,
        } => (status, hints, body, readable),
    };
    if (300..400).contains(&status) {
        return Class::Redirect;
    }
    if (200..300).contains(&status) {
        return if readable {
            Class::Success
        } else {
            Class::Malformed
        };
    }
    let (code, kind, message) = error_fields(body);
    let says = |needle: &str| code == needle || kind == needle;
    let transient = |rate_limited| Class::Transient {
        retry_after: retry_after(hints, now),
        rate_limited,
    };
    // Anthropic names a quota problem `billing_error` (and so does a translated
    // OpenAI `insufficient_quota` reaching an Anthropic caller).
    if says("insufficient_quota") || says("billing_hard_limit_reached") || says("billing_error") {
        return Class::CredentialOrQuota;
    }
    if says("context_length_exceeded")
        || message.contains("maximum context length")
        || message.contains("prompt is too long")
        // Gemini: "The input token count (1200000) exceeds the maximum number of tokens
        // allowed (1048576)."
        || message.contains("exceeds the maximum number of tokens")
    {
        return Class::CallerFault {
            context_length: true,
        };
    }
    match status {
        429 => transient(true),
        401..=403 => Class::CredentialOrQuota,
        408 | 500..=599 => transient(false),
        _ => Class::CallerFault {
            context_length: false,
        },
    }
}

/// `retry-after-ms` (OpenAI), else `Retry-After` as seconds or an HTTP date. A value too
/// large for a `Duration` (`1e20`) is "forever": longer than any `max_retry_after`, so
/// recovery moves on instead of waiting (or panicking on the conversion).
pub fn retry_after(hints: RetryHints<'_>, now: SystemTime) -> Option<Duration> {
    let secs = |s: f64| Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX);
    if let Some(ms) = hints
        .retry_after_ms
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        if ms.is_finite() && ms >= 0.0 {
            return Some(secs(ms / 1000.0));
        }
    }
    let text = hints.retry_after?.trim();
    if let Ok(value) = text.parse::<f64>() {
        return (value.is_finite() && value >= 0.0).then(|| secs(value));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers<'a>(pairs: &[(&'static str, &'a str)]) -> RetryHints<'a> {
        let mut h = RetryHints::default();
        for (k, v) in pairs {
            match *k {
                "retry-after" => h.retry_after = Some(v),
                "retry-after-ms" => h.retry_after_ms = Some(v),
                other => panic!("not a retry hint: {other}"),
            }
        }
        h
    }

    fn response(status: u16, body: &str) -> Class {
        let h = RetryHints::default();
        classify(
            Observed::Response {
                status,
                hints: h,
                body: body.as_bytes(),
                readable: serde_json::from_str::<serde::de::IgnoredAny>(body).is_ok(),
            },
            SystemTime::UNIX_EPOCH,
        )
    }

    const TRANSIENT: Class = Class::Transient {
        retry_after: None,
        rate_limited: false,
    };
    const RATE: Class = Class::Transient {
        retry_after: None,
        rate_limited: true,
    };
    const CALLER: Class = Class::CallerFault {
        context_length: false,
    };
    const CONTEXT: Class = Class::CallerFault {
        context_length: true,
    };

    /// Every row of PRODUCT.md's taxonomy, with the body cases the issue names.
    #[test]
    fn the_taxonomy_table() {
        let openai_quota = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        let openai_rate = r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        let openai_context = r#"{"error":{"message":"This model's maximum context length is 128000 tokens","type":"invalid_request_error","code":"context_length_exceeded"}}"#;
        let anthropic_overloaded =
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        let anthropic_context = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#;
        let policy = r#"{"error":{"message":"flagged","type":"invalid_request_error","code":"content_policy_violation"}}"#;
        let rows: &[(u16, &str, Class)] = &[
            (200, r#"{"choices":[]}"#, Class::Success),
            (200, "{\"choices\": [", Class::Malformed),
            (200, "", Class::Malformed),
            (429, openai_rate, RATE),
            (429, "", RATE),
            (429, openai_quota, Class::CredentialOrQuota),
            (
                429,
                r#"{"type":"error","error":{"type":"billing_error","message":"You exceeded your current quota"}}"#,
                Class::CredentialOrQuota,
            ),
            (500, "", TRANSIENT),
            (502, "<html>bad gateway</html>", TRANSIENT),
            (503, "", TRANSIENT),
            (504, "", TRANSIENT),
            (529, anthropic_overloaded, TRANSIENT),
            (408, "", TRANSIENT),
            (
                400,
                r#"{"error":{"message":"bad","type":"invalid_request_error"}}"#,
                CALLER,
            ),
            (400, openai_context, CONTEXT),
            (400, anthropic_context, CONTEXT),
            (400, policy, CALLER),
            (404, "", CALLER),
            (409, "", CALLER),
            (413, "", CALLER),
            (422, "", CALLER),
            (401, "", Class::CredentialOrQuota),
            (
                403,
                r#"{"type":"error","error":{"type":"permission_error","message":"no"}}"#,
                Class::CredentialOrQuota,
            ),
            (402, "", Class::CredentialOrQuota),
            (301, "", Class::Redirect),
            (307, "", Class::Redirect),
            (308, "", Class::Redirect),
        ];
        for (status, body, class) in rows {
            assert_eq!(
                response(*status, body),
                *class,
                "status {status} body {body}"
            );
        }
        for failure in [TransportFailure::TooLarge, TransportFailure::NotAStream] {
            assert_eq!(
                classify(Observed::Transport(failure), SystemTime::UNIX_EPOCH),
                Class::Malformed
            );
        }
        for failure in [
            TransportFailure::Connect,
            TransportFailure::Reset,
            TransportFailure::Timeout,
        ] {
            assert_eq!(
                classify(Observed::Transport(failure), SystemTime::UNIX_EPOCH),
                TRANSIENT
            );
        }
    }

    /// Gemini's OpenAI-compatible endpoint: the error object inside an array.
    #[test]
    fn gemini_errors_come_in_an_array() {
        let gemini = |code: u16, status: &str, message: &str| {
            json!([{"error": {"code": code, "message": message, "status": status}}]).to_string()
        };
        let rate = gemini(
            429,
            "RESOURCE_EXHAUSTED",
            "Resource has been exhausted (e.g. check quota).",
        );
        assert_eq!(response(429, &rate), RATE);
        assert_eq!(
            error_fields(rate.as_bytes()).1,
            "resource_exhausted",
            "the status stands for the type"
        );
        let context = gemini(
            400,
            "INVALID_ARGUMENT",
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
        );
        assert_eq!(response(400, &context), CONTEXT);
        let bad = gemini(400, "INVALID_ARGUMENT", "Invalid JSON payload received.");
        assert_eq!(response(400, &bad), CALLER);
        let key = gemini(403, "PERMISSION_DENIED", "API key not valid.");
        assert_eq!(response(403, &key), Class::CredentialOrQuota);
        assert_eq!(
            response(503, &gemini(503, "UNAVAILABLE", "overloaded")),
            TRANSIENT
        );
        // Whitespace before the array, an empty array, an array of something else.
        assert_eq!(response(400, &format!("\n {context}")), CONTEXT);
        assert_eq!(response(429, "[]"), RATE);
        assert_eq!(response(400, "[1, 2]"), CALLER);
    }

    #[test]
    fn a_successful_stream_is_not_parsed() {
        let h = RetryHints::default();
        let class = classify(
            Observed::Response {
                status: 200,
                hints: h,
                body: b"",
                readable: true,
            },
            SystemTime::UNIX_EPOCH,
        );
        assert_eq!(class, Class::Success);
    }

    #[test]
    fn retry_after_in_all_its_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(
            retry_after(headers(&[("retry-after", "7")]), now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            retry_after(headers(&[("retry-after", "1.5")]), now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            retry_after(
                headers(&[("retry-after-ms", "250"), ("retry-after", "9")]),
                now
            ),
            Some(Duration::from_millis(250))
        );
        let date = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            retry_after(headers(&[("retry-after", &date)]), now),
            Some(Duration::from_secs(30))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(
            retry_after(headers(&[("retry-after", &past)]), now),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(headers(&[("retry-after", "soon")]), now), None);
        assert_eq!(retry_after(headers(&[("retry-after", "-3")]), now), None);
        assert_eq!(retry_after(RetryHints::default(), now), None);
        // Absurd values are "forever", never a panic.
        for (name, value) in [
            ("retry-after", "1e20"),
            ("retry-after-ms", "1e30"),
            ("retry-after", "1e308"),
        ] {
            assert_eq!(
                retry_after(headers(&[(name, value)]), now),
                Some(Duration::MAX),
                "{name}: {value}"
            );
        }

        let h = headers(&[("retry-after", "2")]);
        let class = classify(
            Observed::Response {
                status: 503,
                hints: h,
                body: b"",
                readable: false,
            },
            now,
        );
        assert_eq!(
            class,
            Class::Transient {
                retry_after: Some(Duration::from_secs(2)),
                rate_limited: false
            }
        );
    }

    proptest::proptest! {
        /// Fuzz: any header text and any body never panic the classifier, and any
        /// Retry-After it returns is a real duration.
        #[test]
        fn fuzz_classifier(
            ra in "[0-9eE.+-]{0,24}|.{0,40}",
            ms in "[0-9eE.+-]{0,24}",
            status in 100u16..1000,
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let h = RetryHints {
                retry_after: Some(&ra),
                retry_after_ms: Some(&ms),
            };
            let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
            let _ = retry_after(h, now);
            let _ = classify(
                Observed::Response { status, hints: h, body: &body, readable: false },
                now,
            );
        }
    }

    #[test]
    fn a_provider_error_names_its_code_message_and_field() {
        let openai = br#"{"error":{"message":"Invalid type for 'messages[1].content'.","type":"invalid_request_error","param":"messages[1].content","code":"invalid_type"}}"#;
        assert_eq!(
            provider_error(openai),
            Some(ProviderError {
                code: "invalid_type".into(),
                message: "Invalid type for 'messages[1].content'.".into(),
                field: Some("messages[1].content".into()),
            })
        );
        let anthropic = br#"{"type":"error","error":{"type":"invalid_request_error","message":"messages.1.content.0.tool_result: unexpected tool_use_id"}}"#;
        let e = provider_error(anthropic).unwrap();
        assert_eq!(
            (&*e.code, e.field.as_deref()),
            (
                "invalid_request_error",
                Some("messages.1.content.0.tool_result")
            )
        );
        let plain =
            br#"{"error":{"type":"invalid_request_error","message":"max_tokens: Field required"}}"#;
        assert_eq!(provider_error(plain).unwrap().field, None, "not a path");
        assert_eq!(provider_error(b"upstream exploded"), None);
    }
}
