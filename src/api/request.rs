//! A client's request as both APIs send it, parsed once by the context layer: what the
//! upstream leaf is given to send, and what the policy layers read. It knows nothing of
//! tenants, sessions or routes.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::Endpoint;

/// The largest `max_tokens` accepted: every provider's field is a 32-bit integer.
pub const MAX_OUTPUT_TOKENS: u64 = i32::MAX as u64;

/// Why a body is not a request Backstop can route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// Not JSON, or JSON with a repeated key.
    InvalidJson(String),
    NotAnObject,
    /// No `model`, or an empty one.
    MissingModel,
    InvalidParameter {
        param: &'static str,
        detail: String,
    },
}

/// The Responses API's `input`: a string, or a list of items that each say what they
/// are (`type`, or a message's `role`). Anything else, `null` included, is refused
/// before any upstream call, as chat refuses a malformed body; a request without
/// `input` (a prompt template, a continuation) is the upstream's to judge.
fn check_responses_input(input: Option<&Value>) -> Result<(), RequestError> {
    let invalid = |detail: String| RequestError::InvalidParameter {
        param: "input",
        detail,
    };
    match input {
        None | Some(Value::String(_)) => Ok(()),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let says = |key: &str| item.get(key).is_some_and(Value::is_string);
                if !item.is_object() || !(says("type") || says("role")) {
                    return Err(invalid(format!(
                        "input[{i}] must be an object with a string `type` or `role`"
                    )));
                }
                if let Some(content) = item.get("content").filter(|c| !is_content(c)) {
                    return Err(invalid(format!(
                        "input[{i}].content must be a string or a list of content parts, got {}",
                        kind_of(content)
                    )));
                }
            }
            Ok(())
        }
        Some(other) => Err(invalid(format!(
            "must be a string or a list of input items, got {}",
            kind_of(other)
        ))),
    }
}

/// A message's `content` as every API takes it: text, or a list of parts.
fn is_content(content: &Value) -> bool {
    matches!(content, Value::String(_) | Value::Array(_))
}

/// What a JSON value is, for an error that names it.
fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Chat and Messages `messages`: each message's `content`, when it has one, is text or
/// a list of parts (`null` too in chat, for an assistant turn that only calls tools).
/// Anything else is refused here: an upstream would refuse it too, after the call was
/// reserved and counted.
fn check_messages(endpoint: Endpoint, messages: Option<&Value>) -> Result<(), RequestError> {
    let Some(Value::Array(messages)) = messages else {
        return Ok(());
    };
    for (i, message) in messages.iter().enumerate() {
        let Some(content) = message.get("content") else {
            continue;
        };
        let null_ok = endpoint == Endpoint::ChatCompletions;
        if !(is_content(content) || (null_ok && content.is_null())) {
            return Err(RequestError::InvalidParameter {
                param: "messages",
                detail: format!(
                    "messages[{i}].content must be a string or a list of content parts, got {}",
                    kind_of(content)
                ),
            });
        }
    }
    Ok(())
}

/// A boolean field, absent or `null` meaning false; `"true"` is refused, not read as
/// false (a stream the caller asked for and would not get).
fn flag(json: &Map<String, Value>, param: &'static str) -> Result<bool, RequestError> {
    match json.get(param) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(RequestError::InvalidParameter {
            param,
            detail: format!("must be a boolean, got {}", kind_of(other)),
        }),
    }
}

/// The largest `n` OpenAI accepts.
pub const MAX_CHOICES: u64 = 128;

/// How many answers one call generates (chat's `n`): each may be as long as the
/// completion cap, so the worst case is that many times it.
fn choices(endpoint: Endpoint, json: &Map<String, Value>) -> Result<u64, RequestError> {
    if endpoint != Endpoint::ChatCompletions {
        return Ok(1);
    }
    match json.get("n") {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=MAX_CHOICES).contains(n))
            .ok_or_else(|| RequestError::InvalidParameter {
                param: "n",
                detail: format!("must be an integer from 1 to {MAX_CHOICES}, got {v}"),
            }),
    }
}

/// One request body, parsed.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    /// The completion cap the caller set (`max_tokens` / `max_completion_tokens`, or
    /// the Responses API's `max_output_tokens`).
    pub max_output_tokens: Option<u64>,
    /// How many answers the call generates (chat's `n`; 1 elsewhere).
    pub choices: u64,
    /// An OpenAI stream for which the caller itself asked usage to be reported.
    pub client_wants_stream_usage: bool,
    /// The body exactly as the client sent it.
    pub body: Bytes,
    /// The same body, parsed once.
    pub json: Map<String, Value>,
    /// The stored objects a Responses create names (empty for other endpoints).
    pub refs: super::StoredRefs,
    /// What the prompt may cost beyond its text (media, caching, searches).
    pub prompt: super::prompt::PromptShape,
}

impl ParsedRequest {
    /// Parses a body. Pure: no I/O, so it is unit-tested and fuzzed directly.
    pub fn parse(endpoint: Endpoint, body: Bytes) -> Result<ParsedRequest, RequestError> {
        let value = super::json::parse_strict(&body)
            .map_err(|e| RequestError::InvalidJson(e.to_string()))?;
        let Value::Object(json) = value else {
            return Err(RequestError::NotAnObject);
        };
        let model = match json.get("model") {
            Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
            _ => return Err(RequestError::MissingModel),
        };
        if model.chars().any(char::is_control) {
            return Err(RequestError::InvalidParameter {
                param: "model",
                detail: "must not contain control characters".into(),
            });
        }
        let stream = flag(&json, "stream")?;
        let choices = choices(endpoint, &json)?;
        if matches!(endpoint, Endpoint::ChatCompletions | Endpoint::Messages) {
            check_messages(endpoint, json.get("messages"))?;
        }
        let mut max_output_tokens = None;
        for &param in endpoint.output_cap_fields() {
            match json.get(param) {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_u64().filter(|n| *n <= MAX_OUTPUT_TOKENS) {
                    Some(n) => {
                        max_output_tokens.get_or_insert(n);
                    }
                    None => {
                        return Err(RequestError::InvalidParameter {
                            param,
                            detail: format!(
                                "must be an integer from 0 to {MAX_OUTPUT_TOKENS}, got {v}"
                            ),
                        })
                    }
                },
            }
        }
        let mut refs = super::StoredRefs::default();
        if endpoint == Endpoint::Responses {
            check_responses_input(json.get("input"))?;
            refs = super::StoredRefs::read(&json)?;
        }
        let client_wants_stream_usage = json
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        let prompt = super::prompt::PromptShape::read(endpoint, &body, &json);
        Ok(ParsedRequest {
            endpoint,
            model,
            stream,
            max_output_tokens,
            choices,
            client_wants_stream_usage,
            body,
            json,
            refs,
            prompt,
        })
    }

    /// The same request with a different body (a corrective retry, a non-streaming
    /// fetch for validation); `stream` follows the new body.
    pub fn with_json(&self, json: Map<String, Value>) -> ParsedRequest {
        let body = Bytes::from(serde_json::to_vec(&json).expect("a JSON map serialises"));
        ParsedRequest {
            stream: matches!(json.get("stream"), Some(Value::Bool(true))),
            prompt: super::prompt::PromptShape::read(self.endpoint, &body, &json),
            body,
            json,
            endpoint: self.endpoint,
            model: self.model.clone(),
            max_output_tokens: self.max_output_tokens,
            choices: self.choices,
            client_wants_stream_usage: self.client_wants_stream_usage,
            refs: self.refs.clone(),
        }
    }

    /// The request as translated for a target of the other API: `json` is the target's
    /// body (built by `crate::translate`, so it needs no checking), read as `parse` would.
    pub fn translated(&self, endpoint: Endpoint, json: Map<String, Value>) -> ParsedRequest {
        let max_output_tokens = endpoint
            .output_cap_fields()
            .iter()
            .find_map(|f| json.get(*f).and_then(Value::as_u64));
        let client_wants_stream_usage = json
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        let body = Bytes::from(serde_json::to_vec(&json).expect("a JSON map serialises"));
        ParsedRequest {
            endpoint,
            model: self.model.clone(),
            stream: matches!(json.get("stream"), Some(Value::Bool(true))),
            max_output_tokens,
            choices: choices(endpoint, &json).unwrap_or(1),
            client_wants_stream_usage,
            prompt: super::prompt::PromptShape::read(endpoint, &body, &json),
            body,
            json,
            refs: super::StoredRefs::default(),
        }
    }

    /// The body to send upstream: as received, unless the model is rewritten or stream
    /// usage must be asked for (then re-serialised from the parsed body, with the two
    /// fields changed as it is written: the parsed body is never copied).
    pub fn upstream_body(&self, model: Option<&str>, ask_stream_usage: bool) -> Bytes {
        if model.is_none() && !ask_stream_usage {
            return self.body.clone();
        }
        let patched = Patched {
            json: &self.json,
            model,
            ask_stream_usage,
        };
        Bytes::from(serde_json::to_vec(&patched).expect("a JSON map serialises"))
    }
}

/// A request body written with `model` replaced and `stream_options.include_usage` set,
/// in the order the parsed map keeps its keys (a field it lacks goes where the map
/// would have sorted it).
struct Patched<'a> {
    json: &'a Map<String, Value>,
    model: Option<&'a str>,
    ask_stream_usage: bool,
}

impl serde::Serialize for Patched<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        // As an insert into the map would: a `stream_options` that is not an object is
        // left as it is.
        let options = || match self.json.get("stream_options") {
            Some(Value::Object(options)) => {
                let mut options = options.clone();
                options.insert("include_usage".into(), Value::Bool(true));
                Value::Object(options)
            }
            Some(other) => other.clone(),
            None => serde_json::json!({"include_usage": true}),
        };
        let adds_options = self.ask_stream_usage && !self.json.contains_key("stream_options");
        let adds_model = self.model.is_some() && !self.json.contains_key("model");
        let mut map = s.serialize_map(Some(
            self.json.len() + usize::from(adds_options) + usize::from(adds_model),
        ))?;
        let (mut model_due, mut options_due) = (adds_model, adds_options);
        for (key, value) in self.json {
            if model_due && key.as_str() > "model" {
                map.serialize_entry("model", &self.model)?;
                model_due = false;
            }
            if options_due && key.as_str() > "stream_options" {
                map.serialize_entry("stream_options", &options())?;
                options_due = false;
            }
            match key.as_str() {
                "model" if self.model.is_some() => map.serialize_entry(key, &self.model)?,
                "stream_options" if self.ask_stream_usage => {
                    map.serialize_entry(key, &options())?
                }
                _ => map.serialize_entry(key, value)?,
            }
        }
        if model_due {
            map.serialize_entry("model", &self.model)?;
        }
        if options_due {
            map.serialize_entry("stream_options", &options())?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `upstream_body` wrote before it patched while writing: a copy of the parsed
    /// body with the fields inserted.
    fn by_copy(json: &Map<String, Value>, model: Option<&str>, usage: bool) -> Vec<u8> {
        let mut json = json.clone();
        if let Some(model) = model {
            json.insert("model".into(), Value::String(model.into()));
        }
        if usage {
            let options = json
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(options) = options {
                options.insert("include_usage".into(), Value::Bool(true));
            }
        }
        serde_json::to_vec(&json).unwrap()
    }

    #[test]
    fn the_upstream_body_is_patched_as_it_is_written_byte_for_byte() {
        for body in [
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"a","stream":true,"stream_options":{"x":1},"tools":[]}"#,
            r#"{"model":"a","stream":true,"stream_options":null,"zzz":2}"#,
            r#"{"aaa":1,"model":"a","n":2,"stream":true,"top_p":1}"#,
        ] {
            let request =
                ParsedRequest::parse(Endpoint::ChatCompletions, Bytes::from(body)).unwrap();
            for (model, usage) in [(Some("b"), false), (None, true), (Some("c"), true)] {
                assert_eq!(
                    request.upstream_body(model, usage),
                    by_copy(&request.json, model, usage),
                    "{body} {model:?} {usage}"
                );
            }
        }
    }
}

/// Where [`noted`] puts a note in a chat conversation (the other APIs have one place for
/// instructions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// After the leading system and developer messages.
    Leading,
    /// After the last message: what the model reads last.
    Last,
}

/// A request with a note for the model in the request's own place for instructions: a
/// chat system message (at `place`), Anthropic's `system` (appended), the Responses
/// `instructions` (appended).
pub fn noted(
    endpoint: Endpoint,
    json: &Map<String, Value>,
    note: &str,
    place: Place,
) -> Map<String, Value> {
    let mut json = json.clone();
    match endpoint {
        Endpoint::Messages => {
            let system = json.remove("system");
            json.insert(
                "system".into(),
                match system {
                    Some(Value::String(text)) => Value::String(format!("{text}\n\n{note}")),
                    Some(Value::Array(mut blocks)) => {
                        blocks.push(serde_json::json!({"type": "text", "text": note}));
                        Value::Array(blocks)
                    }
                    _ => Value::String(note.to_string()),
                },
            );
        }
        Endpoint::Responses => {
            let instructions = match json.get("instructions").and_then(Value::as_str) {
                Some(text) => format!("{text}\n\n{note}"),
                None => note.to_string(),
            };
            json.insert("instructions".into(), Value::String(instructions));
        }
        _ => {
            if let Some(Value::Array(messages)) = json.get_mut("messages") {
                let at = match place {
                    Place::Last => messages.len(),
                    Place::Leading => messages
                        .iter()
                        .take_while(|m| {
                            matches!(
                                m.get("role").and_then(Value::as_str),
                                Some("system" | "developer")
                            )
                        })
                        .count(),
                };
                messages.insert(at, serde_json::json!({"role": "system", "content": note}));
            }
        }
    }
    json
}
