//! The typed view of a whole upstream answer, read in one pass by the leaf: whether it
//! is JSON at all (classification), the usage it reports (the meter), and, when the
//! request's output is validated, the parsed answer itself (validation). No layer parses
//! an answer body again.

use serde::Deserialize;
use serde_json::Value;

use super::{usage::RawUsage, Endpoint};
use crate::billing::Tokens;

/// The usage an answer reports, before any judgement of whether to believe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportedUsage {
    /// No `usage` object.
    Absent,
    /// Every count the endpoint defines, as reported, by the kind it is billed as.
    Counts(Tokens),
    /// A field that is not a non-negative integer.
    Invalid,
    /// A `usage` object without a count the endpoint defines, by that endpoint's names
    /// (`usage: {}`, `total_tokens` alone, chat's names on `/v1/responses`): not a count
    /// of zero tokens. Charged the reservation, as [`ReportedUsage::Invalid`] is.
    Missing,
    /// The output counts without the input's (a server that reports completion tokens
    /// alone): the output as reported, the input at its reservation.
    OutputOnly(Tokens),
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
                    usage: json.get("usage").map_or(ReportedUsage::Absent, |u| {
                        RawUsage::of(u).reported(endpoint)
                    }),
                    id: response_id(endpoint, json.get("id")),
                    json: Some(json),
                },
                Err(_) => AnswerView::not_json(),
            };
        }
        /// Only the usage counts (and a Responses answer's `id`) are built; the rest is
        /// checked for syntax and skipped.
        #[derive(Deserialize)]
        struct Head<'a> {
            #[serde(default)]
            usage: RawUsage,
            #[serde(default, borrow)]
            id: TextOrOther<'a>,
        }
        match serde_json::from_slice::<Head<'_>>(body) {
            Ok(head) => AnswerView {
                is_json: true,
                usage: head.usage.reported(endpoint),
                json: None,
                id: match head.id {
                    TextOrOther::Text(id) if endpoint == Endpoint::Responses => {
                        Some(id.into_owned())
                    }
                    _ => None,
                },
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

/// A string field kept borrowed, or any other value skipped.
#[derive(Default)]
enum TextOrOther<'a> {
    Text(std::borrow::Cow<'a, str>),
    #[default]
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for TextOrOther<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = TextOrOther<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any value")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Text(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Text(v.to_owned().into()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<TextOrOther<'a>, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(TextOrOther::Other)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<TextOrOther<'a>, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(TextOrOther::Other)
            }
            fn visit_unit<E>(self) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<TextOrOther<'a>, E> {
                Ok(TextOrOther::Other)
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
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
        let counts = |input, output| ReportedUsage::Counts(Tokens::plain(input, output));
        assert_eq!(
            usage(
                Endpoint::ChatCompletions,
                br#"{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#
            ),
            counts(5, 7)
        );
        // Embeddings report only the input; anywhere else a count left out is missing.
        assert_eq!(
            usage(
                Endpoint::Embeddings,
                br#"{"usage":{"prompt_tokens":9,"total_tokens":9}}"#
            ),
            counts(9, 0)
        );
        for (endpoint, odd) in [
            (
                Endpoint::ChatCompletions,
                r#"{"prompt_tokens":9,"total_tokens":9}"#,
            ),
            (Endpoint::ChatCompletions, r#"{}"#),
            (Endpoint::ChatCompletions, r#"{"total_tokens":5000}"#),
            (Endpoint::Embeddings, r#"{"total_tokens":5000}"#),
            (Endpoint::Responses, r#"{}"#),
            (Endpoint::Responses, r#"{"total_tokens":5000}"#),
            (
                Endpoint::Responses,
                r#"{"prompt_tokens":5,"completion_tokens":7}"#,
            ),
        ] {
            let body = format!(r#"{{"usage":{odd}}}"#);
            assert_eq!(
                usage(endpoint, body.as_bytes()),
                ReportedUsage::Missing,
                "{endpoint:?} {odd}"
            );
        }
        // The output without the input: the output as reported, the input reserved.
        for (endpoint, odd) in [
            (Endpoint::Messages, r#"{"output_tokens":3}"#),
            (Endpoint::ChatCompletions, r#"{"completion_tokens":3}"#),
            (Endpoint::Responses, r#"{"output_tokens":3}"#),
        ] {
            let body = format!(r#"{{"usage":{odd}}}"#);
            assert_eq!(
                usage(endpoint, body.as_bytes()),
                ReportedUsage::OutputOnly(Tokens::plain(0, 3)),
                "{endpoint:?} {odd}"
            );
        }
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
        // Details objects beside the counts, a usage that is not an object, nulls.
        assert_eq!(
            usage(
                Endpoint::Responses,
                br#"{"id":{"x":[1]},"usage":{"input_tokens_details":{"cached_tokens":1},"input_tokens":8,"output_tokens":0}}"#
            ),
            ReportedUsage::Counts(Tokens {
                input: 7,
                cache_read: 1,
                ..Tokens::default()
            })
        );
        assert_eq!(
            usage(
                Endpoint::Responses,
                br#"{"usage":{"input_tokens":8,"output_tokens":null}}"#
            ),
            ReportedUsage::Missing
        );
        for odd in [
            r#""usage":5"#,
            r#""usage":"x""#,
            r#""usage":[1,{}]"#,
            r#""usage":null"#,
        ] {
            let body = format!(r#"{{"id":"resp_1",{odd}}}"#);
            assert_eq!(
                usage(Endpoint::Responses, body.as_bytes()),
                ReportedUsage::Absent,
                "{odd}"
            );
            let view = AnswerView::read(Endpoint::Responses, body.as_bytes(), false);
            assert_eq!(view.id.as_deref(), Some("resp_1"), "{odd}");
        }
        // Only a Responses answer's id is kept, and only a string one, either way of reading.
        for keep in [false, true] {
            let read = |e, b: &[u8]| AnswerView::read(e, b, keep).id;
            assert_eq!(
                read(Endpoint::Responses, br#"{"id":"resp_\u0041"}"#).as_deref(),
                Some("resp_A")
            );
            assert_eq!(read(Endpoint::Responses, br#"{"id":7}"#), None);
            assert_eq!(
                read(Endpoint::ChatCompletions, br#"{"id":"chatcmpl-1"}"#),
                None
            );
        }
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
