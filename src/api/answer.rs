//! The typed view of a whole upstream answer, read in one pass by the leaf: whether it
//! is JSON at all (classification), the usage it reports (the meter), and, when the
//! request's output is validated, the parsed answer itself (validation). No layer parses
//! an answer body again.

use serde::Deserialize;
use serde_json::Value;

use super::Endpoint;

/// The usage an answer reports, before any judgement of whether to believe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportedUsage {
    /// No `usage` object.
    Absent,
    /// Absent fields count 0.
    Counts { input: u64, output: u64 },
    /// A field that is not a non-negative integer.
    Invalid,
}

/// What the layers need from a whole 2xx body.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerView {
    /// The body is JSON (a 2xx that is not is malformed).
    pub is_json: bool,
    pub usage: ReportedUsage,
    /// The parsed answer, kept only when it is to be validated.
    pub json: Option<Value>,
    /// A Responses answer's `id` (whose stored response its tenant may read later).
    pub id: Option<String>,
}

impl AnswerView {
    /// Reads a 2xx body of `endpoint` once (its usage field names are the endpoint's, not
    /// only its API's); `keep` keeps the whole parsed answer for validation.
    pub fn read(endpoint: Endpoint, body: &[u8], keep: bool) -> AnswerView {
        if keep {
            return match serde_json::from_slice::<Value>(body) {
                Ok(json) => AnswerView {
                    is_json: true,
                    usage: usage_of(endpoint, json.get("usage")),
                    id: response_id(endpoint, json.get("id")),
                    json: Some(json),
                },
                Err(_) => AnswerView::not_json(),
            };
        }
        /// Only `usage` (and a Responses answer's `id`) is built; the rest is checked
        /// for syntax and skipped.
        #[derive(Deserialize)]
        struct WithUsage<Id> {
            #[serde(default)]
            usage: Option<Value>,
            #[serde(default)]
            id: Option<Id>,
        }
        let read = if endpoint == Endpoint::Responses {
            serde_json::from_slice::<WithUsage<Value>>(body)
                .map(|w| (w.usage, response_id(endpoint, w.id.as_ref())))
        } else {
            serde_json::from_slice::<WithUsage<serde::de::IgnoredAny>>(body)
                .map(|w| (w.usage, None))
        };
        match read {
            Ok((usage, id)) => AnswerView {
                is_json: true,
                usage: usage_of(endpoint, usage.as_ref()),
                json: None,
                id,
            },
            // Not an object: JSON still (`[]`), or not JSON at all.
            Err(_) => AnswerView {
                is_json: serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok(),
                usage: ReportedUsage::Absent,
                json: None,
                id: None,
            },
        }
    }

    fn not_json() -> AnswerView {
        AnswerView {
            is_json: false,
            usage: ReportedUsage::Absent,
            json: None,
            id: None,
        }
    }
}

fn response_id(endpoint: Endpoint, id: Option<&Value>) -> Option<String> {
    (endpoint == Endpoint::Responses)
        .then(|| id.and_then(Value::as_str).map(str::to_owned))
        .flatten()
}

fn usage_of(endpoint: Endpoint, usage: Option<&Value>) -> ReportedUsage {
    let Some(usage) = usage.filter(|u| u.is_object()) else {
        return ReportedUsage::Absent;
    };
    let (input, output) = endpoint.usage_fields();
    let count = |field: &str| match usage.get(field) {
        None | Some(Value::Null) => Some(0),
        Some(v) => v.as_u64(),
    };
    match (count(input), count(output)) {
        (Some(input), Some(output)) => ReportedUsage::Counts { input, output },
        _ => ReportedUsage::Invalid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(api: Endpoint, body: &[u8]) -> ReportedUsage {
        let fast = AnswerView::read(api, body, false);
        let kept = AnswerView::read(api, body, true);
        // Either way of reading says the same about the answer.
        assert_eq!(fast.usage, kept.usage, "{}", String::from_utf8_lossy(body));
        assert_eq!(fast.is_json, kept.is_json);
        fast.usage
    }

    #[test]
    fn usage_is_read_from_both_apis() {
        let counts = |input, output| ReportedUsage::Counts { input, output };
        assert_eq!(
            usage(
                Endpoint::ChatCompletions,
                br#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#
            ),
            counts(5, 7)
        );
        assert_eq!(
            usage(
                Endpoint::ChatCompletions,
                br#"{"usage":{"prompt_tokens":9,"total_tokens":9}}"#
            ),
            counts(9, 0)
        );
        assert_eq!(
            usage(
                Endpoint::Messages,
                br#"{"usage":{"input_tokens":3,"output_tokens":4}}"#
            ),
            counts(3, 4)
        );
        assert_eq!(
            usage(
                Endpoint::Responses,
                br#"{"object":"response","usage":{"input_tokens":8,"output_tokens":2,"total_tokens":10}}"#
            ),
            counts(8, 2)
        );
        assert_eq!(
            usage(Endpoint::ChatCompletions, br#"{"id":"x"}"#),
            ReportedUsage::Absent
        );
        assert_eq!(
            usage(Endpoint::ChatCompletions, b"not json"),
            ReportedUsage::Absent
        );
        assert!(!AnswerView::read(Endpoint::ChatCompletions, b"not json", false).is_json);
        assert!(AnswerView::read(Endpoint::ChatCompletions, b"[]", false).is_json);
    }

    #[test]
    fn usage_that_is_not_a_count_is_invalid_not_zero() {
        for u in [
            r#"{"prompt_tokens":-1,"completion_tokens":5}"#,
            r#"{"prompt_tokens":1.5,"completion_tokens":5}"#,
            r#"{"prompt_tokens":1,"completion_tokens":1e30}"#,
            r#"{"prompt_tokens":"12","completion_tokens":5}"#,
        ] {
            let body = format!(r#"{{"usage":{u}}}"#);
            assert_eq!(
                usage(Endpoint::ChatCompletions, body.as_bytes()),
                ReportedUsage::Invalid,
                "{u}"
            );
        }
    }
}
