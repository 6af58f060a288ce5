//! Structured output: what a request expects of its answer, whether an answer meets it,
//! and the corrective follow-up that tells the model exactly what was wrong.
//!
//! Checked: OpenAI `response_format` (`json_schema`, `json_object`), Anthropic's
//! `output_config.format` / `output_format` (`json_schema`), each tool call's
//! arguments against that tool's `parameters` (OpenAI) or each `tool_use.input` against
//! `input_schema` (Anthropic), and a route's `response_schema`. A request that asks for
//! none of these is never parsed for output.

mod schemas;
pub mod shape;
pub mod stream;

use std::{collections::HashMap, sync::Arc};

use jsonschema::{error::ValidationErrorKind, Validator};
use serde_json::{json, Map, Value};

pub use schemas::{fingerprint, RequestLimits, SchemaFingerprint, SchemaSettings, Schemas};

use crate::wire::Wire;

/// What was wrong, by kind (the `x-backstop-recovery` token and metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// The answer is not JSON (or not a JSON object) where JSON was required.
    Json,
    /// The answer is JSON but breaks the schema.
    Schema,
    /// A tool call's arguments are not JSON or break the tool's schema.
    ToolArgs,
}

impl Problem {
    pub fn label(self) -> &'static str {
        match self {
            Problem::Json => "json",
            Problem::Schema => "schema",
            Problem::ToolArgs => "tool_args",
        }
    }
}

/// An answer that failed its checks.
#[derive(Debug, Clone)]
pub struct Invalid {
    pub problem: Problem,
    /// `path: message` lines, e.g. `/temp_c: "temp_c" is a required property`.
    pub errors: Vec<String>,
    /// The model's output as it should be shown back to it.
    pub output: String,
    /// The tool whose call was wrong, for tool-argument problems.
    pub tool: Option<String>,
}

enum ContentRule {
    Schema(Arc<Validator>),
    JsonObject,
}

/// What one request's answers must satisfy.
pub struct Expectations {
    format: Wire,
    content: Option<ContentRule>,
    tools: HashMap<String, Arc<Validator>>,
}

/// A schema in the request that does not compile or breaks a limit: the caller's mistake.
#[derive(Debug)]
pub struct BadSchema(pub String);

/// One schema a request carries: compiled already, or a copy still to compile.
struct Wanted {
    /// Where it sits, for errors (`tool get_weather`).
    what: String,
    print: SchemaFingerprint,
    /// The operator's (a route's `response_schema`): checked at start-up, no limits.
    trusted: bool,
    validator: Option<Arc<Validator>>,
    schema: Option<Value>,
}

enum PendingContent {
    Schema(Wanted),
    JsonObject,
}

/// A request's schemas, found and fingerprinted on the async worker (cheap, bounded by
/// the limits); those not cached are compiled by [`Pending::compile`], blocking work.
pub struct Pending {
    format: Wire,
    tenant: Arc<str>,
    content: Option<PendingContent>,
    tools: Vec<(String, Wanted)>,
}

impl Pending {
    /// Whether [`Pending::compile`] has anything to compile (else it returns at once).
    pub fn needs_compile(&self) -> bool {
        let content = match &self.content {
            Some(PendingContent::Schema(w)) => Some(w),
            _ => None,
        };
        content
            .into_iter()
            .chain(self.tools.iter().map(|(_, w)| w))
            .any(|w| w.validator.is_none())
    }

    /// Checks and compiles what the cache did not have. Blocking: run it off the async
    /// workers.
    pub fn compile(self, schemas: &Schemas) -> Result<Expectations, BadSchema> {
        let tenant = self.tenant;
        let resolve = |w: Wanted| -> Result<Arc<Validator>, BadSchema> {
            if let Some(v) = w.validator {
                return Ok(v);
            }
            let schema = w.schema.unwrap_or(Value::Null);
            schemas
                .compile(&tenant, w.print, &schema, w.trusted)
                .map_err(|e| BadSchema(format!("{}: {e}", w.what)))
        };
        let content = match self.content {
            Some(PendingContent::Schema(w)) => Some(ContentRule::Schema(resolve(w)?)),
            Some(PendingContent::JsonObject) => Some(ContentRule::JsonObject),
            None => None,
        };
        let mut tools = HashMap::new();
        for (name, w) in self.tools {
            tools.insert(name, resolve(w)?);
        }
        Ok(Expectations {
            format: self.format,
            content,
            tools,
        })
    }
}

impl Expectations {
    /// The request's schemas, or `None` when nothing is to be validated. Refuses, before
    /// any compilation, more tools than `validation.max_tools` and schemas larger than
    /// `validation.max_schema_bytes` or, together, `validation.max_request_schema_bytes`.
    pub fn collect(
        format: impl Into<Wire>,
        request: &Map<String, Value>,
        route_schema: Option<&Arc<Value>>,
        schemas: &Schemas,
        tenant: &Arc<str>,
    ) -> Result<Option<Pending>, BadSchema> {
        let format = format.into();
        let limits = schemas.request_limits();
        let listed = request.get("tools").and_then(Value::as_array);
        let count = listed.map_or(0, Vec::len);
        if count > limits.max_tools {
            return Err(BadSchema(format!(
                "the request has {count} tools; the limit (validation.max_tools) is {}",
                limits.max_tools
            )));
        }
        let mut total = 0usize;
        let mut want = |what: String, schema: &Value, trusted: bool| -> Result<Wanted, BadSchema> {
            let print = if trusted {
                fingerprint(schema, usize::MAX)
            } else {
                fingerprint(schema, limits.max_schema_bytes)
            }
            .ok_or_else(|| {
                BadSchema(format!(
                    "{what}: the schema is larger than {} bytes (validation.max_schema_bytes)",
                    limits.max_schema_bytes
                ))
            })?;
            if !trusted {
                total += print.bytes;
                if total > limits.max_request_schema_bytes {
                    return Err(BadSchema(format!(
                        "the request's schemas together are larger than {} bytes (validation.max_request_schema_bytes)",
                        limits.max_request_schema_bytes
                    )));
                }
            }
            let validator = schemas.cached(tenant, print.key);
            Ok(Wanted {
                schema: validator.is_none().then(|| schema.clone()),
                what,
                print,
                trusted,
                validator,
            })
        };
        let mut content = None;
        // Chat: `response_format.json_schema.schema`; Responses: `text.format.schema`.
        let (asked, at) = match format {
            Wire::Responses => (
                request.get("text").and_then(|t| t.get("format")),
                "text.format.schema",
            ),
            _ => (
                request.get("response_format"),
                "response_format.json_schema.schema",
            ),
        };
        if let Some(asked) = asked {
            match asked.get("type").and_then(Value::as_str) {
                Some("json_schema") => {
                    let pointer = match format {
                        Wire::Responses => "/schema",
                        _ => "/json_schema/schema",
                    };
                    let schema = asked
                        .pointer(pointer)
                        .ok_or_else(|| BadSchema(format!("{at} is missing")))?;
                    content = Some(PendingContent::Schema(want(at.into(), schema, false)?));
                }
                Some("json_object") => content = Some(PendingContent::JsonObject),
                Some("text") => {}
                // Chat leaves an unknown `response_format` to the upstream; the Responses
                // API's `text.format` is refused here, so it never costs a call.
                _ if format == Wire::Responses => {
                    return Err(BadSchema(format!(
                        "text.format.type must be one of text, json_schema, json_object; got {}",
                        asked
                            .get("type")
                            .map_or_else(|| "none".to_string(), Value::to_string)
                    )))
                }
                _ => {}
            }
        }
        // Anthropic's structured output: `output_config.format` (the SDK's `parse` and
        // `output_config`), or the beta's `output_format`.
        if content.is_none() && format == Wire::Messages {
            let formats = [
                (
                    request.get("output_config").and_then(|c| c.get("format")),
                    "output_config.format",
                ),
                (request.get("output_format"), "output_format"),
            ];
            for (format, name) in formats {
                let Some(format) = format.filter(|f| !f.is_null()) else {
                    continue;
                };
                if format.get("type").and_then(Value::as_str) == Some("json_schema") {
                    let schema = format
                        .get("schema")
                        .ok_or_else(|| BadSchema(format!("{name}.schema is missing")))?;
                    content = Some(PendingContent::Schema(want(
                        format!("{name}.schema"),
                        schema,
                        false,
                    )?));
                    break;
                }
            }
        }
        if content.is_none() {
            if let Some(schema) = route_schema {
                content = Some(PendingContent::Schema(want(
                    "the route's response_schema".into(),
                    schema,
                    true,
                )?));
            }
        }
        let mut tools = Vec::new();
        for tool in listed.into_iter().flatten() {
            let (name, schema) = match format {
                Wire::Chat => (
                    tool.pointer("/function/name"),
                    tool.pointer("/function/parameters"),
                ),
                Wire::Messages => (tool.get("name"), tool.get("input_schema")),
                // Built-in tools (web_search, file_search, ...) carry no parameters.
                Wire::Responses => (tool.get("name"), tool.get("parameters")),
                Wire::Converse => continue,
            };
            if let (Some(Value::String(name)), Some(schema)) = (name, schema) {
                tools.push((name.clone(), want(format!("tool {name}"), schema, false)?));
            }
        }
        if content.is_none() && tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(Pending {
            format,
            tenant: tenant.clone(),
            content,
            tools,
        }))
    }

    /// [`Expectations::collect`] and [`Pending::compile`] on this thread, for tenant `-`.
    pub fn from_request(
        format: impl Into<Wire>,
        request: &Map<String, Value>,
        route_schema: Option<&Arc<Value>>,
        schemas: &Schemas,
    ) -> Result<Option<Self>, BadSchema> {
        Expectations::collect(format, request, route_schema, schemas, &Arc::from("-"))?
            .map(|pending| pending.compile(schemas))
            .transpose()
    }

    /// Whether the answer's content has a rule (a schema or JSON object mode), beyond
    /// its tool calls.
    pub fn checks_content(&self) -> bool {
        self.content.is_some()
    }

    /// Checks one (non-streaming) answer body.
    pub fn check(&self, answer: &Value) -> Result<(), Invalid> {
        let calls = tool_calls(self.format, answer);
        for (name, args) in &calls {
            let Some(validator) = self.tools.get(name) else {
                if self.tools.is_empty() {
                    continue;
                }
                return Err(Invalid {
                    problem: Problem::ToolArgs,
                    errors: vec![format!("there is no tool named `{name}`")],
                    output: args.to_string(),
                    tool: Some(name.clone()),
                });
            };
            let parsed = match args {
                ToolArgs::Raw(text) => match serde_json::from_str::<Value>(text) {
                    Ok(v) => v,
                    Err(e) => {
                        return Err(Invalid {
                            problem: Problem::ToolArgs,
                            errors: vec![format!("arguments are not valid JSON: {e}")],
                            output: text.clone(),
                            tool: Some(name.clone()),
                        })
                    }
                },
                ToolArgs::Parsed(v) => v.clone(),
            };
            let errors = schema_errors(validator, &parsed);
            if !errors.is_empty() {
                return Err(Invalid {
                    problem: Problem::ToolArgs,
                    errors,
                    output: parsed.to_string(),
                    tool: Some(name.clone()),
                });
            }
        }
        // A tool-calling answer carries no content to check.
        let Some(rule) = self.content.as_ref().filter(|_| calls.is_empty()) else {
            return Ok(());
        };
        let text = content_text(self.format, answer);
        let parsed = match serde_json::from_str::<Value>(strip_fences(&text)) {
            Ok(v) => v,
            Err(e) => {
                return Err(Invalid {
                    problem: Problem::Json,
                    errors: vec![format!("the answer is not valid JSON: {e}")],
                    output: text,
                    tool: None,
                })
            }
        };
        match rule {
            ContentRule::JsonObject if !parsed.is_object() => Err(Invalid {
                problem: Problem::Json,
                errors: vec!["the answer must be a JSON object".into()],
                output: text,
                tool: None,
            }),
            ContentRule::JsonObject => Ok(()),
            ContentRule::Schema(validator) => {
                let errors = schema_errors(validator, &parsed);
                if errors.is_empty() {
                    Ok(())
                } else {
                    Err(Invalid {
                        problem: Problem::Schema,
                        errors,
                        output: text,
                        tool: None,
                    })
                }
            }
        }
    }
}

/// Models sometimes wrap JSON in a Markdown fence; that alone is not worth a retry.
fn strip_fences(text: &str) -> &str {
    let t = text.trim();
    t.strip_prefix("```json")
        .or_else(|| t.strip_prefix("```"))
        .and_then(|rest| rest.strip_suffix("```"))
        .map_or(t, str::trim)
}

/// `path: message` for each schema violation; a missing property is shown at its own path.
fn schema_errors(validator: &Validator, instance: &Value) -> Vec<String> {
    validator
        .iter_errors(instance)
        .take(20)
        .map(|e| {
            let mut path = e.instance_path().to_string();
            if let ValidationErrorKind::Required { property } = e.kind() {
                if let Some(p) = property.as_str() {
                    path = format!("{path}/{p}");
                }
            }
            if path.is_empty() {
                path = "/".into();
            }
            format!("{path}: {e}")
        })
        .collect()
}

enum ToolArgs {
    /// OpenAI: a string that should hold JSON.
    Raw(String),
    /// Anthropic: already a JSON value.
    Parsed(Value),
}

impl std::fmt::Display for ToolArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolArgs::Raw(s) => f.write_str(s),
            ToolArgs::Parsed(v) => write!(f, "{v}"),
        }
    }
}

/// A Responses answer's `output` items of one type.
fn output_items<'a>(answer: &'a Value, kind: &'a str) -> impl Iterator<Item = &'a Value> {
    answer
        .get("output")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(move |item| item.get("type").and_then(Value::as_str) == Some(kind))
}

fn tool_calls(format: Wire, answer: &Value) -> Vec<(String, ToolArgs)> {
    match format {
        Wire::Responses => output_items(answer, "function_call")
            .filter_map(|item| {
                let name = item.get("name")?.as_str()?.to_string();
                let args = item.get("arguments").and_then(Value::as_str).unwrap_or("");
                Some((name, ToolArgs::Raw(args.to_string())))
            })
            .collect(),
        Wire::Chat => answer
            .pointer("/choices/0/message/tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let name = c.pointer("/function/name")?.as_str()?.to_string();
                let args = c
                    .pointer("/function/arguments")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                Some((name, ToolArgs::Raw(args)))
            })
            .collect(),
        Wire::Messages => answer
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
            .filter_map(|b| {
                Some((
                    b.get("name")?.as_str()?.to_string(),
                    ToolArgs::Parsed(b.get("input").cloned().unwrap_or(Value::Null)),
                ))
            })
            .collect(),
        Wire::Converse => Vec::new(),
    }
}

/// The answer's text: OpenAI `message.content`, Anthropic's text blocks joined, the
/// Responses API's `output_text` parts of its message items joined.
fn content_text(format: Wire, answer: &Value) -> String {
    match format {
        Wire::Responses => output_items(answer, "message")
            .filter_map(|item| item.get("content").and_then(Value::as_array))
            .flatten()
            .filter(|part| part.get("type").and_then(Value::as_str) == Some("output_text"))
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        Wire::Chat => answer
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        Wire::Messages => answer
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect(),
        Wire::Converse => String::new(),
    }
}

/// The request for the next attempt: the invalid output appended as the assistant's turn,
/// then a user turn listing the errors by path and asking for the format only (chat and
/// Anthropic `messages`; the Responses API's `input` items, a string `input` becoming
/// the first user item, on top of the same `previous_response_id` if there is one).
pub fn corrective_request(
    format: Wire,
    request: &Map<String, Value>,
    invalid: &Invalid,
) -> Map<String, Value> {
    let mut next = request.clone();
    let what = match (&invalid.problem, &invalid.tool) {
        (Problem::ToolArgs, Some(tool)) => {
            format!("Your call to the tool `{tool}` had invalid arguments")
        }
        (Problem::Json, _) => "Your previous answer was not valid JSON".to_string(),
        _ => "Your previous answer did not match the required JSON schema".to_string(),
    };
    let ask = match invalid.problem {
        Problem::ToolArgs => "Call the tool again with arguments that match its schema exactly.",
        _ => "Answer again with only the corrected JSON, in the required format, and nothing else.",
    };
    let feedback = format!(
        "{what}. Errors:\n{}\n{ask}",
        invalid
            .errors
            .iter()
            .map(|e| format!("- {e}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    append_exchange(format, &mut next, invalid.output.clone(), feedback);
    next
}

/// Appends an exchange to a request's conversation, in `format`'s own place for it (the
/// messages, or a Responses request's `input`, made a list if it was text): the model's
/// turn (`said`), then the user's (`asked`). What a corrective attempt sends.
pub fn append_exchange(
    format: Wire,
    request: &mut Map<String, Value>,
    said: String,
    asked: String,
) {
    let turns = match format {
        Wire::Responses => {
            let input = request
                .entry("input")
                .or_insert_with(|| Value::Array(Vec::new()));
            if let Value::String(text) = input {
                *input = json!([{"role": "user", "content": text}]);
            }
            input
        }
        Wire::Chat | Wire::Converse | Wire::Messages => request
            .entry("messages")
            .or_insert_with(|| Value::Array(Vec::new())),
    };
    if let Value::Array(messages) = turns {
        messages.push(json!({"role": "assistant", "content": said}));
        messages.push(json!({"role": "user", "content": asked}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schemas() -> Schemas {
        Schemas::new(crate::config::ValidationConfig::default().schema_settings())
    }

    fn weather_schema() -> Value {
        json!({"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}}, "required": ["city", "temp_c"], "additionalProperties": false})
    }

    fn openai_answer(content: &str) -> Value {
        json!({"choices": [{"message": {"role": "assistant", "content": content}}]})
    }

    fn expectations(request: Value) -> Expectations {
        let Value::Object(request) = request else {
            panic!()
        };
        Expectations::from_request(Wire::Chat, &request, None, &schemas())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn schema_errors_are_listed_by_path() {
        let e = expectations(
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": weather_schema(), "strict": true}}}),
        );
        assert!(e
            .check(&openai_answer(r#"{"city": "Paris", "temp_c": 21.5}"#))
            .is_ok());
        let invalid = e.check(&openai_answer(r#"{"city": "Paris"}"#)).unwrap_err();
        assert_eq!(invalid.problem, Problem::Schema);
        assert_eq!(
            invalid.errors,
            [r#"/temp_c: "temp_c" is a required property"#]
        );
        let invalid = e
            .check(&openai_answer(r#"{"city": 3, "temp_c": "hot"}"#))
            .unwrap_err();
        assert_eq!(invalid.errors.len(), 2, "{:?}", invalid.errors);
        assert!(invalid.errors.iter().any(|e| e.starts_with("/city: ")));
        let invalid = e.check(&openai_answer("It is sunny.")).unwrap_err();
        assert_eq!(invalid.problem, Problem::Json);
        assert!(e
            .check(&openai_answer(
                "```json\n{\"city\": \"Oslo\", \"temp_c\": -3}\n```"
            ))
            .is_ok());
    }

    #[test]
    fn responses_text_format_and_function_calls_are_read_in_their_own_shape() {
        let Value::Object(request) = json!({
            "text": {"format": {"type": "json_schema", "name": "w", "schema": weather_schema()}},
            "tools": [{"type": "function", "name": "get_weather", "parameters": weather_schema()},
                      {"type": "web_search"}],
        }) else {
            unreachable!()
        };
        let e = Expectations::from_request(Wire::Responses, &request, None, &schemas())
            .unwrap()
            .unwrap();
        let text = |t: &str| json!({"output": [{"type": "reasoning", "summary": []}, {"type": "message", "content": [{"type": "output_text", "text": t}]}]});
        assert!(e.check(&text(r#"{"city": "Rome", "temp_c": 30}"#)).is_ok());
        assert_eq!(
            e.check(&text(r#"{"city": "Rome"}"#)).unwrap_err().problem,
            Problem::Schema
        );
        let call = |args: &str| json!({"output": [{"type": "function_call", "name": "get_weather", "call_id": "c1", "arguments": args}]});
        assert!(e.check(&call(r#"{"city": "Rome", "temp_c": 30}"#)).is_ok());
        let invalid = e.check(&call(r#"{"city": 1}"#)).unwrap_err();
        assert_eq!(invalid.problem, Problem::ToolArgs);

        // The correction is new input items; a string input becomes the first one.
        let Value::Object(request) = json!({"input": "hi", "previous_response_id": "r1"}) else {
            unreachable!()
        };
        let next = corrective_request(Wire::Responses, &request, &invalid);
        assert_eq!(next["previous_response_id"], "r1");
        let input = next["input"].as_array().unwrap();
        assert_eq!(input[0], json!({"role": "user", "content": "hi"}));
        assert_eq!(input[1]["role"], "assistant");
        assert!(next.get("messages").is_none());
    }

    #[test]
    fn json_object_mode_wants_an_object() {
        let e = expectations(json!({"response_format": {"type": "json_object"}}));
        assert!(e.check(&openai_answer(r#"{"a": 1}"#)).is_ok());
        assert_eq!(
            e.check(&openai_answer("[1, 2]")).unwrap_err().problem,
            Problem::Json
        );
    }

    #[test]
    fn tool_arguments_are_checked_per_tool_for_both_apis() {
        let e = expectations(
            json!({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": weather_schema()}}]}),
        );
        let call = |args: &str| json!({"choices": [{"message": {"tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]}}]});
        assert!(e.check(&call(r#"{"city": "Rome", "temp_c": 30}"#)).is_ok());
        let invalid = e.check(&call(r#"{"city": "Rome"}"#)).unwrap_err();
        assert_eq!(
            (invalid.problem, invalid.tool.as_deref()),
            (Problem::ToolArgs, Some("get_weather"))
        );
        assert_eq!(
            e.check(&call("{city: Rome")).unwrap_err().problem,
            Problem::ToolArgs
        );
        assert!(e
            .check(&openai_answer(
                "plain text is fine when no format is required"
            ))
            .is_ok());

        let Value::Object(request) =
            json!({"tools": [{"name": "get_weather", "input_schema": weather_schema()}]})
        else {
            panic!()
        };
        let e = Expectations::from_request(Wire::Messages, &request, None, &schemas())
            .unwrap()
            .unwrap();
        let answer = json!({"content": [{"type": "text", "text": "calling"}, {"type": "tool_use", "name": "get_weather", "input": {"city": "Rome", "temp_c": "warm"}}]});
        let invalid = e.check(&answer).unwrap_err();
        assert_eq!(invalid.errors.len(), 1);
        assert!(
            invalid.errors[0].starts_with("/temp_c: "),
            "{:?}",
            invalid.errors
        );
    }

    #[test]
    fn anthropic_structured_output_is_checked_in_both_spellings() {
        for format_field in ["output_config", "output_format"] {
            let format = json!({"type": "json_schema", "schema": weather_schema()});
            let request = if format_field == "output_config" {
                json!({"output_config": {"format": format}})
            } else {
                json!({"output_format": format})
            };
            let Value::Object(request) = request else {
                panic!()
            };
            let e = Expectations::from_request(Wire::Messages, &request, None, &schemas())
                .unwrap()
                .expect("a JSON-schema output format is validated");
            let text = |t: &str| json!({"content": [{"type": "text", "text": t}]});
            assert!(e
                .check(&text(r#"{"city": "Rome", "temp_c": 21.5}"#))
                .is_ok());
            let invalid = e.check(&text(r#"{"city": "Rome"}"#)).unwrap_err();
            assert_eq!(invalid.problem, Problem::Schema, "{format_field}");
            assert_eq!(e.check(&text("sunny")).unwrap_err().problem, Problem::Json);
        }
        // OpenAI's request never reads Anthropic's field, and a format without a schema
        // is refused before any call.
        let Value::Object(request) = json!({"output_config": {"format": {"type": "json_schema"}}})
        else {
            panic!()
        };
        assert!(
            Expectations::from_request(Wire::Chat, &request, None, &schemas())
                .unwrap()
                .is_none()
        );
        let err = Expectations::from_request(Wire::Messages, &request, None, &schemas())
            .err()
            .unwrap();
        assert!(err.0.contains("output_config.format.schema"), "{}", err.0);
    }

    #[test]
    fn compiled_schemas_are_found_again_per_tenant() {
        let Value::Object(request) = json!({"tools": [
            {"type": "function", "function": {"name": "a", "parameters": weather_schema()}},
            {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}},
        ]}) else {
            panic!()
        };
        let schemas = schemas();
        let (one, two): (Arc<str>, Arc<str>) = (Arc::from("one"), Arc::from("two"));
        let collect = |tenant: &Arc<str>| {
            Expectations::collect(Wire::Chat, &request, None, &schemas, tenant)
                .unwrap()
                .unwrap()
        };
        let first = collect(&one);
        assert!(first.needs_compile());
        first.compile(&schemas).unwrap();
        assert!(!collect(&one).needs_compile(), "cached for tenant one");
        assert!(collect(&two).needs_compile(), "not shared with tenant two");
    }

    #[test]
    fn no_format_means_no_validation() {
        let Value::Object(request) = json!({"model": "m", "messages": []}) else {
            panic!()
        };
        assert!(
            Expectations::from_request(Wire::Chat, &request, None, &schemas())
                .unwrap()
                .is_none()
        );
        let route = Arc::new(weather_schema());
        assert!(
            Expectations::from_request(Wire::Chat, &request, Some(&route), &schemas())
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn the_corrective_request_holds_the_output_and_the_errors() {
        let Value::Object(request) =
            json!({"model": "m", "messages": [{"role": "user", "content": "weather?"}]})
        else {
            panic!()
        };
        let invalid = Invalid {
            problem: Problem::Schema,
            errors: vec![r#"/temp_c: "temp_c" is a required property"#.into()],
            output: r#"{"city":"Paris"}"#.into(),
            tool: None,
        };
        let next = corrective_request(Wire::Chat, &request, &invalid);
        let messages = next["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3);
        assert_eq!(
            messages[1],
            json!({"role": "assistant", "content": r#"{"city":"Paris"}"#})
        );
        let feedback = messages[2]["content"].as_str().unwrap();
        assert!(
            feedback.contains(r#"- /temp_c: "temp_c" is a required property"#),
            "{feedback}"
        );
        assert_eq!(
            request["messages"].as_array().unwrap().len(),
            1,
            "the original is untouched"
        );
    }
}
