//! What the session guard sees of a request, read from the wire shapes of the three
//! APIs: a hash of its normalised conversation, and the tool call most often answered
//! the same way in its history. The guard's rules ([`crate::policy::guard`]) take the
//! result and never parse a body themselves.

use serde_json::Value;

use super::{tool_calls, Endpoint};
use crate::policy::guard::RequestFingerprint;

/// Canonical JSON of a value's parse (so key order and spacing do not matter).
fn canonical(text: &str) -> String {
    serde_json::from_str::<Value>(text).map_or_else(|_| text.trim().to_string(), |v| v.to_string())
}

/// Feeds serialised JSON straight into an XXH3 hasher, without building a string.
pub(crate) struct HashWriter(pub xxhash_rust::xxh3::Xxh3);

impl std::io::Write for HashWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.update(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The seed of [`fingerprint`]'s hash.
pub const FINGERPRINT_SEED: u64 = 0;

/// The request's fingerprint: a hash of its normalised model + messages + tools (+ a
/// Responses request's instructions, input and previous response), and the
/// most repeated (tool call, tool result) pair in its history (chat `tool_calls` / `tool`
/// messages, Anthropic `tool_use` / `tool_result` blocks, Responses `function_call` /
/// `function_call_output` input items).
///
/// The hash is compared across replicas and releases (it is kept in the shared
/// [`GuardSnapshot::recent`](crate::store::format::GuardSnapshot::recent)), so it is a specified one: XXH3-64 with seed
/// [`FINGERPRINT_SEED`] (0, the reference `XXH3_64bits`, which `xxhsum -H3` computes), of
/// each key present followed by the JSON serde_json writes for its value (keys sorted,
/// no spaces). Not std's `DefaultHasher`, whose algorithm Rust may change in any
/// release; not SHA-256, which runs every request's whole conversation through a
/// cryptographic hash when no adversary is in play (a tenant who forged a collision
/// would only trip its own session). A test pins the value of a fixed request, so a
/// change of algorithm, or of how serde_json writes, cannot go unnoticed.
pub fn fingerprint(json: &serde_json::Map<String, Value>) -> RequestFingerprint {
    let mut hasher = HashWriter(xxhash_rust::xxh3::Xxh3::with_seed(FINGERPRINT_SEED));
    for key in ["model", "system", "messages", "tools"] {
        hasher.0.update(key.as_bytes());
        if let Some(value) = json.get(key) {
            let _ = serde_json::to_writer(&mut hasher, value);
        }
    }
    // The Responses API's conversation (hashed only when present, so a chat request's
    // fingerprint is what it always was): without it every turn of a Responses session
    // would look like the same request repeated.
    for key in ["instructions", "input", "previous_response_id"] {
        if let Some(value) = json.get(key) {
            hasher.0.update(key.as_bytes());
            let _ = serde_json::to_writer(&mut hasher, value);
        }
    }
    let hasher = hasher.0;
    // Tool calls by id, as "name(args)", and their results, in every API's shape: a
    // chat or Anthropic conversation's `messages`, a Responses request's `input` items.
    let mut calls: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut results = Vec::new();
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Responses] {
        let (found, answered) = tool_calls::conversation(endpoint, json);
        for call in found {
            calls.insert(call.id, format!("{}({})", call.tool, canonical(&call.args)));
        }
        results.extend(answered);
    }
    let mut pairs: std::collections::HashMap<(String, String), (u32, bool)> =
        std::collections::HashMap::new();
    for result in results {
        if let Some(call) = calls.get(&result.call_id) {
            let error = result.is_error || result.content.to_ascii_lowercase().contains("error");
            let entry = pairs
                .entry((call.clone(), result.content))
                .or_insert((0, error));
            entry.0 += 1;
        }
    }
    let looping = pairs.into_iter().max_by_key(|(_, (n, _))| *n);
    let tool_result = looping
        .as_ref()
        .map(|((_, result), _)| cut(result, RESULT_CHARS));
    let tool_loop = looping.map(|((call, _), (n, error))| {
        (
            format!(
                "{call} returned the same {}",
                if error { "error" } else { "result" }
            ),
            n,
        )
    });
    RequestFingerprint {
        request: hasher.digest(),
        tool_loop,
        tool_result,
    }
}

/// How much of a looping tool's result a guided request's note quotes.
const RESULT_CHARS: usize = 300;

fn cut(text: &str, chars: usize) -> String {
    match text.char_indices().nth(chars) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_responses_tool_loop_is_seen_in_input_items() {
        let mut input = vec![json!({"role": "user", "content": "weather in Atlantis"})];
        for i in 0..3 {
            input.push(json!({"type": "function_call", "call_id": format!("c{i}"), "name": "get_weather",
                              "arguments": if i == 1 { r#"{ "city": "Atlantis" }"# } else { r#"{"city":"Atlantis"}"# }}));
            input.push(json!({"type": "function_call_output", "call_id": format!("c{i}"), "output": "Error: city not found"}));
        }
        let Value::Object(m) = json!({"model": "gpt-4o", "input": input}) else {
            unreachable!()
        };
        assert_eq!(
            fingerprint(&m).tool_loop,
            Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.to_string(),
                3
            ))
        );
    }

    /// Fingerprints are compared across replicas and releases (they are kept in the
    /// shared snapshot), so their value is pinned: XXH3-64, seed 0, of what serde_json
    /// writes. The same value, from the reference implementation:
    /// `printf '%s' 'model"gpt-4o"systemmessages[{"content":"hi","role":"user"}]tools' | xxhsum -H3`.
    #[test]
    fn the_fingerprint_of_a_fixed_request_is_pinned() {
        let Value::Object(m) = json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5,
        }) else {
            unreachable!()
        };
        assert_eq!(
            format!("{:016x}", fingerprint(&m).request),
            "594dc1997f111abb"
        );
    }

    #[test]
    fn responses_turns_have_distinct_fingerprints() {
        let turn = |input: &str| {
            let Value::Object(m) = json!({"model": "gpt-4o", "input": input}) else {
                unreachable!()
            };
            fingerprint(&m).request
        };
        assert_ne!(turn("first question"), turn("second question"));
        assert_eq!(turn("same"), turn("same"));
    }

    #[test]
    fn fingerprints_see_tool_loops_in_both_apis_and_ignore_key_order() {
        let openai = |n: usize| {
            let mut messages = vec![json!({"role": "user", "content": "weather in Atlantis"})];
            for i in 0..n {
                messages.push(json!({"role": "assistant", "tool_calls": [{"id": format!("c{i}"), "type": "function", "function": {"name": "get_weather", "arguments": if i % 2 == 0 { r#"{"city":"Atlantis"}"# } else { r#"{ "city" : "Atlantis" }"# }}}]}));
                messages.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "Error: city not found"}));
            }
            let Value::Object(m) = json!({"model": "gpt-4o", "messages": messages}) else {
                unreachable!()
            };
            m
        };
        let fp = fingerprint(&openai(3));
        assert_eq!(
            fp.tool_loop,
            Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.to_string(),
                3
            ))
        );
        assert_ne!(
            fingerprint(&openai(3)).request,
            fingerprint(&openai(2)).request
        );

        let Value::Object(anthropic) = json!({"model": "claude", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "nothing", "is_error": true}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "search", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "nothing", "is_error": true}]},
        ]}) else {
            unreachable!()
        };
        assert_eq!(
            fingerprint(&anthropic).tool_loop,
            Some((
                r#"search({"q":"x"}) returned the same error"#.to_string(),
                2
            ))
        );

        let a: serde_json::Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":1}"#,
        )
        .unwrap();
        let b: serde_json::Map<String, Value> = serde_json::from_str(
            r#"{"temperature":0.2,"messages":[{"content":"hi","role":"user"}],"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(
            fingerprint(&a).request,
            fingerprint(&b).request,
            "same model + messages + tools"
        );
    }
}
