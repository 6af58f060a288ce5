//! The `usage` object of every endpoint, whole and streamed, read in full: each count a
//! provider bills by, under the names that endpoint's API gives it, turned into one
//! [`Tokens`] record. OpenAI's counts include their cached and reasoning parts
//! (`prompt_tokens_details.cached_tokens`, `completion_tokens_details.reasoning_tokens`,
//! and the Responses API's `input_tokens_details` / `output_tokens_details`); Anthropic's
//! `input_tokens` excludes its cache writes (`cache_creation_input_tokens`, split by
//! lifetime in `cache_creation`) and reads (`cache_read_input_tokens`), and
//! `server_tool_use.web_search_requests` counts its searches.
//!
//! Reading is lenient in shape and strict in numbers: a field that is absent or `null`
//! is not reported; one that is not a non-negative integer makes the whole usage
//! invalid (charged the reservation); details that are not objects are ignored.

use serde::{de, Deserialize, Deserializer};

use super::{Endpoint, ReportedUsage};
use crate::billing::Tokens;

/// One count as reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Count {
    /// Absent or `null`.
    #[default]
    Absent,
    Is(u64),
    /// Not a non-negative integer.
    Invalid,
}

impl Count {
    fn later(self, later: Count) -> Count {
        match later {
            Count::Absent => self,
            other => other,
        }
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Count, D::Error> {
        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = Count;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a token count")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Count, E> {
                Ok(Count::Is(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Count, E> {
                Ok(u64::try_from(v).map_or(Count::Invalid, Count::Is))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Count, E> {
                Ok(Count::Invalid)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Count, E> {
                Ok(Count::Invalid)
            }
            fn visit_str<E>(self, _: &str) -> Result<Count, E> {
                Ok(Count::Invalid)
            }
            fn visit_unit<E>(self) -> Result<Count, E> {
                Ok(Count::Absent)
            }
            fn visit_none<E>(self) -> Result<Count, E> {
                Ok(Count::Absent)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Count, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Count, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Count::Invalid)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Count, A::Error> {
                while map
                    .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(Count::Invalid)
            }
        }
        d.deserialize_any(Visit)
    }
}

/// Every count a `usage` object (or one stream event's) may carry, as reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawUsage {
    /// The value was an object (else nothing was reported at all).
    pub present: bool,
    pub prompt_tokens: Count,
    pub completion_tokens: Count,
    pub input_tokens: Count,
    pub output_tokens: Count,
    /// OpenAI's cached part of the prompt (chat's `prompt_tokens_details`, Responses'
    /// `input_tokens_details`).
    pub cached_tokens: Count,
    /// OpenAI's reasoning part of the output.
    pub reasoning_tokens: Count,
    pub cache_creation_input_tokens: Count,
    pub cache_read_input_tokens: Count,
    pub ephemeral_5m_input_tokens: Count,
    pub ephemeral_1h_input_tokens: Count,
    pub web_search_requests: Count,
}

/// The keys of a `usage` object that are read; any other is skipped.
#[derive(Clone, Copy)]
enum Key {
    PromptTokens,
    CompletionTokens,
    InputTokens,
    OutputTokens,
    CacheCreationInputTokens,
    CacheReadInputTokens,
    /// `prompt_tokens_details` / `input_tokens_details`: `cached_tokens`.
    InputDetails,
    /// `completion_tokens_details` / `output_tokens_details`: `reasoning_tokens`.
    OutputDetails,
    /// Anthropic's `cache_creation`: the writes by lifetime.
    CacheCreation,
    /// Anthropic's `server_tool_use`.
    ServerToolUse,
    Other,
}

fn key(name: &str) -> Key {
    match name {
        "prompt_tokens" => Key::PromptTokens,
        "completion_tokens" => Key::CompletionTokens,
        "input_tokens" => Key::InputTokens,
        "output_tokens" => Key::OutputTokens,
        "cache_creation_input_tokens" => Key::CacheCreationInputTokens,
        "cache_read_input_tokens" => Key::CacheReadInputTokens,
        "prompt_tokens_details" | "input_tokens_details" => Key::InputDetails,
        "completion_tokens_details" | "output_tokens_details" => Key::OutputDetails,
        "cache_creation" => Key::CacheCreation,
        "server_tool_use" => Key::ServerToolUse,
        _ => Key::Other,
    }
}

/// A nested details object: the named counts read, anything else (or a value that is
/// not an object) skipped.
struct Details<const N: usize> {
    names: [&'static str; N],
    counts: [Count; N],
}

impl<'de, const N: usize> de::DeserializeSeed<'de> for Details<N> {
    type Value = [Count; N];
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<[Count; N], D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de, const N: usize> de::Visitor<'de> for Details<N> {
    type Value = [Count; N];
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("usage details")
    }
    fn visit_map<A: de::MapAccess<'de>>(mut self, mut map: A) -> Result<[Count; N], A::Error> {
        while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match self.names.iter().position(|n| *n == name) {
                Some(at) => self.counts[at] = map.next_value()?,
                None => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        Ok(self.counts)
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<[Count; N], A::Error> {
        while seq.next_element::<de::IgnoredAny>()?.is_some() {}
        Ok(self.counts)
    }
    fn visit_unit<E>(self) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_none<E>(self) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<[Count; N], D::Error> {
        d.deserialize_any(self)
    }
    fn visit_bool<E>(self, _: bool) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_i64<E>(self, _: i64) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_u64<E>(self, _: u64) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_f64<E>(self, _: f64) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
    fn visit_str<E>(self, _: &str) -> Result<[Count; N], E> {
        Ok(self.counts)
    }
}

fn details<'de, A: de::MapAccess<'de>, const N: usize>(
    map: &mut A,
    names: [&'static str; N],
) -> Result<[Count; N], A::Error> {
    map.next_value_seed(Details {
        names,
        counts: [Count::Absent; N],
    })
}

impl<'de> Deserialize<'de> for RawUsage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RawUsage, D::Error> {
        struct Visit;
        impl<'de> de::Visitor<'de> for Visit {
            type Value = RawUsage;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a usage value")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<RawUsage, A::Error> {
                let mut u = RawUsage {
                    present: true,
                    ..RawUsage::default()
                };
                while let Some(name) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match key(&name) {
                        Key::PromptTokens => u.prompt_tokens = map.next_value()?,
                        Key::CompletionTokens => u.completion_tokens = map.next_value()?,
                        Key::InputTokens => u.input_tokens = map.next_value()?,
                        Key::OutputTokens => u.output_tokens = map.next_value()?,
                        Key::CacheCreationInputTokens => {
                            u.cache_creation_input_tokens = map.next_value()?
                        }
                        Key::CacheReadInputTokens => {
                            u.cache_read_input_tokens = map.next_value()?
                        }
                        Key::InputDetails => {
                            [u.cached_tokens] = details(&mut map, ["cached_tokens"])?
                        }
                        Key::OutputDetails => {
                            [u.reasoning_tokens] = details(&mut map, ["reasoning_tokens"])?
                        }
                        Key::CacheCreation => {
                            [u.ephemeral_5m_input_tokens, u.ephemeral_1h_input_tokens] = details(
                                &mut map,
                                ["ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens"],
                            )?
                        }
                        Key::ServerToolUse => {
                            [u.web_search_requests] = details(&mut map, ["web_search_requests"])?
                        }
                        Key::Other => {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(u)
            }
            fn visit_unit<E>(self) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_none<E>(self) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<RawUsage, D::Error> {
                d.deserialize_any(self)
            }
            // Any other JSON value is not a usage object: nothing reported.
            fn visit_bool<E>(self, _: bool) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_str<E>(self, _: &str) -> Result<RawUsage, E> {
                Ok(RawUsage::default())
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<RawUsage, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(RawUsage::default())
            }
        }
        d.deserialize_any(Visit)
    }
}

impl RawUsage {
    /// Reads a parsed `usage` value (a kept answer, a stream event).
    pub fn of(value: &serde_json::Value) -> RawUsage {
        RawUsage::deserialize(value).unwrap_or_default()
    }

    /// `later` over `self`, count by count: a stream's events each report part of its
    /// usage (Anthropic's `message_start` the input and cache counts, `message_delta`
    /// the output), and a later report of a count replaces an earlier one.
    pub fn merge(&mut self, later: &RawUsage) {
        if !later.present {
            return;
        }
        self.present = true;
        let pairs = [
            (&mut self.prompt_tokens, later.prompt_tokens),
            (&mut self.completion_tokens, later.completion_tokens),
            (&mut self.input_tokens, later.input_tokens),
            (&mut self.output_tokens, later.output_tokens),
            (&mut self.cached_tokens, later.cached_tokens),
            (&mut self.reasoning_tokens, later.reasoning_tokens),
            (
                &mut self.cache_creation_input_tokens,
                later.cache_creation_input_tokens,
            ),
            (
                &mut self.cache_read_input_tokens,
                later.cache_read_input_tokens,
            ),
            (
                &mut self.ephemeral_5m_input_tokens,
                later.ephemeral_5m_input_tokens,
            ),
            (
                &mut self.ephemeral_1h_input_tokens,
                later.ephemeral_1h_input_tokens,
            ),
            (&mut self.web_search_requests, later.web_search_requests),
        ];
        for (mine, theirs) in pairs {
            *mine = mine.later(theirs);
        }
    }

    /// What the usage reports for `endpoint`: every count its API defines, or why not.
    pub fn reported(&self, endpoint: Endpoint) -> ReportedUsage {
        if !self.present {
            return ReportedUsage::Absent;
        }
        let detail = |c: Count| match c {
            Count::Absent => Ok(0),
            Count::Is(n) => Ok(n),
            Count::Invalid => Err(()),
        };
        let main = |c: Count| match c {
            Count::Absent => Ok(None),
            Count::Is(n) => Ok(Some(n)),
            Count::Invalid => Err(()),
        };
        // The counts, and whether the input was among them.
        let read = || -> Result<Option<(Tokens, bool)>, ()> {
            match endpoint {
                Endpoint::ChatCompletions | Endpoint::Embeddings | Endpoint::Responses => {
                    let (prompt, completion) = match endpoint {
                        Endpoint::Responses => (self.input_tokens, self.output_tokens),
                        _ => (self.prompt_tokens, self.completion_tokens),
                    };
                    let (prompt, completion) = (main(prompt)?, main(completion)?);
                    let cached = detail(self.cached_tokens)?;
                    let reasoning = detail(self.reasoning_tokens)?;
                    let (prompt, output) = match (prompt, completion, endpoint) {
                        (Some(p), Some(c), _) => (p, c),
                        (Some(p), None, Endpoint::Embeddings) => (p, 0),
                        (None, Some(c), Endpoint::ChatCompletions | Endpoint::Responses) => {
                            return Ok(Some((
                                Tokens {
                                    output: c,
                                    reasoning: reasoning.min(c),
                                    ..Tokens::default()
                                },
                                false,
                            )))
                        }
                        _ => return Ok(None),
                    };
                    // The cached part is inside the prompt: more cached than the prompt
                    // is not a count.
                    let input = prompt.checked_sub(cached).ok_or(())?;
                    Ok(Some((
                        Tokens {
                            input,
                            cache_read: cached,
                            output,
                            reasoning: reasoning.min(output),
                            ..Tokens::default()
                        },
                        true,
                    )))
                }
                Endpoint::Messages | Endpoint::CountTokens => {
                    let (input, output) =
                        match (main(self.input_tokens)?, main(self.output_tokens)?) {
                            (Some(input), Some(output)) => (input, output),
                            (None, Some(output)) => {
                                return Ok(Some((
                                    Tokens {
                                        output,
                                        ..Tokens::default()
                                    },
                                    false,
                                )))
                            }
                            _ => return Ok(None),
                        };
                    let hour = detail(self.ephemeral_1h_input_tokens)?;
                    let five = detail(self.ephemeral_5m_input_tokens)?;
                    // The total, else the split's sum; the split says how much of it
                    // was written for an hour.
                    let written = match main(self.cache_creation_input_tokens)? {
                        Some(total) => total,
                        None => five.saturating_add(hour),
                    };
                    let hour = hour.min(written);
                    Ok(Some((
                        Tokens {
                            input,
                            cache_write_5m: written - hour,
                            cache_write_1h: hour,
                            cache_read: detail(self.cache_read_input_tokens)?,
                            output,
                            web_searches: detail(self.web_search_requests)?,
                            ..Tokens::default()
                        },
                        true,
                    )))
                }
            }
        };
        match read() {
            Ok(Some((tokens, true))) => ReportedUsage::Counts(tokens),
            Ok(Some((tokens, false))) => ReportedUsage::OutputOnly(tokens),
            Ok(None) => ReportedUsage::Missing,
            Err(()) => ReportedUsage::Invalid,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(endpoint: Endpoint, usage: serde_json::Value) -> ReportedUsage {
        let typed: RawUsage = serde_json::from_value(usage.clone()).unwrap();
        assert_eq!(typed, RawUsage::of(&usage));
        typed.reported(endpoint)
    }

    fn counts(t: Tokens) -> ReportedUsage {
        ReportedUsage::Counts(t)
    }

    #[test]
    fn anthropic_cache_writes_and_reads_are_their_own_kinds() {
        // As Anthropic answers: input excludes the cache; the split by lifetime beside.
        let usage = json!({
            "input_tokens": 100, "cache_creation_input_tokens": 20_000,
            "cache_read_input_tokens": 80_000, "output_tokens": 500,
            "cache_creation": {"ephemeral_5m_input_tokens": 15_000, "ephemeral_1h_input_tokens": 5_000},
            "server_tool_use": {"web_search_requests": 2}, "service_tier": "standard"
        });
        assert_eq!(
            read(Endpoint::Messages, usage),
            counts(Tokens {
                input: 100,
                cache_write_5m: 15_000,
                cache_write_1h: 5_000,
                cache_read: 80_000,
                output: 500,
                web_searches: 2,
                ..Tokens::default()
            })
        );
        // Without the split every write is a five-minute one.
        let plain = json!({"input_tokens": 3, "cache_creation_input_tokens": 7,
            "cache_read_input_tokens": 0, "output_tokens": 4});
        assert_eq!(
            read(Endpoint::Messages, plain),
            counts(Tokens {
                input: 3,
                cache_write_5m: 7,
                output: 4,
                ..Tokens::default()
            })
        );
    }

    #[test]
    fn openai_cached_and_reasoning_parts_are_inside_their_counts() {
        let chat = json!({"prompt_tokens": 10_000, "completion_tokens": 100, "total_tokens": 10_100,
            "prompt_tokens_details": {"cached_tokens": 8_000, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 60, "accepted_prediction_tokens": 0}});
        assert_eq!(
            read(Endpoint::ChatCompletions, chat),
            counts(Tokens {
                input: 2_000,
                cache_read: 8_000,
                output: 100,
                reasoning: 60,
                ..Tokens::default()
            })
        );
        let responses = json!({"input_tokens": 500, "input_tokens_details": {"cached_tokens": 128},
            "output_tokens": 90, "output_tokens_details": {"reasoning_tokens": 64}, "total_tokens": 590});
        assert_eq!(
            read(Endpoint::Responses, responses),
            counts(Tokens {
                input: 372,
                cache_read: 128,
                output: 90,
                reasoning: 64,
                ..Tokens::default()
            })
        );
        // Embeddings have no output.
        assert_eq!(
            read(
                Endpoint::Embeddings,
                json!({"prompt_tokens": 8, "total_tokens": 8})
            ),
            counts(Tokens::plain(8, 0))
        );
    }

    #[test]
    fn odd_numbers_are_invalid_and_odd_shapes_are_skipped() {
        for bad in [
            json!({"prompt_tokens": -1, "completion_tokens": 1}),
            json!({"prompt_tokens": 1.5, "completion_tokens": 1}),
            json!({"prompt_tokens": "3", "completion_tokens": 1}),
            json!({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 6}}),
            json!({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": -2}}),
        ] {
            assert_eq!(
                read(Endpoint::ChatCompletions, bad.clone()),
                ReportedUsage::Invalid,
                "{bad}"
            );
        }
        assert_eq!(
            read(
                Endpoint::Messages,
                json!({"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": [1]})
            ),
            ReportedUsage::Invalid
        );
        // Details that are not objects, nulls, unknown keys: ignored.
        assert_eq!(
            read(
                Endpoint::ChatCompletions,
                json!({"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": null,
                       "completion_tokens_details": "x", "future": {"a": [1]}})
            ),
            counts(Tokens::plain(5, 1))
        );
        // Another API's names, or none: missing, not zero.
        assert_eq!(
            read(
                Endpoint::Responses,
                json!({"prompt_tokens": 5, "completion_tokens": 1})
            ),
            ReportedUsage::Missing
        );
        assert_eq!(read(Endpoint::Messages, json!({})), ReportedUsage::Missing);
        assert_eq!(
            RawUsage::of(&json!(7)).reported(Endpoint::Messages),
            ReportedUsage::Absent
        );
    }

    #[test]
    fn a_stream_merges_its_events_count_by_count() {
        // Anthropic: message_start has input and the cache, output 1; message_delta the output.
        let mut u = RawUsage::of(
            &json!({"input_tokens": 100, "cache_creation_input_tokens": 20_000,
            "cache_read_input_tokens": 80_000, "output_tokens": 1}),
        );
        u.merge(&RawUsage::of(
            &json!({"output_tokens": 500, "server_tool_use": {"web_search_requests": 1}}),
        ));
        u.merge(&RawUsage::of(&serde_json::Value::Null));
        assert_eq!(
            u.reported(Endpoint::Messages),
            counts(Tokens {
                input: 100,
                cache_write_5m: 20_000,
                cache_read: 80_000,
                output: 500,
                web_searches: 1,
                ..Tokens::default()
            })
        );
    }
}
