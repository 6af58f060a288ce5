//! Whole answers and error bodies, chat completions ⇄ messages.
//!
//! The wire types here are the ones both answer shapes need (the stream state machines in
//! [`super::stream`] write the same blocks, usage and errors). What each mapping keeps,
//! normalises or refuses is written beside it and in `docs/translation.md`:
//!
//! - an Anthropic message becomes a `chat.completion` whose `id` is `chatcmpl-` and the
//!   message id, whose text is every text block joined with no separator (`null` when
//!   that is empty), and whose usage counts cache writes and reads as prompt tokens
//!   (OpenAI has no cache-write field: `prompt_tokens` includes them, `cached_tokens`
//!   names only the reads);
//! - a `chat.completion` becomes a message whose `id` is `msg_` and the chat id (made
//!   valid for Anthropic by [`ids::for_anthropic`]), with one text block for the content
//!   and the refusal (never an empty one) and one `tool_use` block per call;
//! - thinking blocks cannot be carried by chat completions. The request side refuses
//!   `thinking` for this direction, so an answer that has them is malformed here, not
//!   dropped.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{finish, ids, AnswerContext, AnswerError, Direction};

/// A target's whole 2xx answer, in the caller's API.
pub fn whole(cx: &AnswerContext, body: &[u8]) -> Result<Bytes, AnswerError> {
    match cx.direction {
        Direction::ChatToMessages => {
            let message: Message = read(body, "an Anthropic message")?;
            write(&chat_completion(message, now_unix())?)
        }
        Direction::MessagesToChat => {
            let completion: ChatCompletion = read(body, "a chat completion")?;
            write(&anthropic_message(completion)?)
        }
        Direction::ResponsesToMessages => super::responses::whole(cx, body),
    }
}

/// A target's error answer (any non-2xx), in the caller's error shape.
pub fn error(cx: &AnswerContext, status: StatusCode, body: &[u8]) -> Bytes {
    let error = UpstreamError::read(Some(status), body);
    // The Responses API uses OpenAI's error body.
    let bytes = if cx.direction.caller_endpoint().wire().openai_errors() {
        serde_json::to_vec(&OpenAiErrorBody {
            error: error.openai(),
        })
    } else {
        serde_json::to_vec(&error.anthropic())
    };
    Bytes::from(bytes.expect("an error body serialises"))
}

fn read<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T, AnswerError> {
    serde_json::from_slice(body).map_err(|e| AnswerError(format!("not {what}: {e}")))
}

fn write<T: Serialize>(value: &T) -> Result<Bytes, AnswerError> {
    serde_json::to_vec(value)
        .map(Bytes::from)
        .map_err(|e| AnswerError(e.to_string()))
}

/// Seconds since the epoch, for OpenAI's `created` (Anthropic answers carry no time).
pub(super) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

// ---------------------------------------------------------------------------------------
// Anthropic's side: what is read from a message and written into one.

/// An Anthropic message as the target answered it.
#[derive(Debug, Deserialize)]
pub(super) struct Message {
    pub id: String,
    pub model: String,
    #[serde(default)]
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<String>,
    /// `null` or absent: no count reported (then none is written to the caller).
    #[serde(default, deserialize_with = "null_as_default")]
    pub usage: MessagesUsage,
}

/// `null` read as the type's default, as an absent field is.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Option::unwrap_or_default)
}

/// A content block of an answer. Thinking and anything else (server tool blocks) are
/// named so they can be refused by name.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum ContentBlock {
    Text {
        text: String,
        /// Only when the request enabled citations on its documents; chat completions
        /// have nowhere to put them.
        #[serde(default)]
        citations: Option<Vec<Value>>,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    Thinking {},
    RedactedThinking {},
    #[serde(other)]
    Other,
}

impl ContentBlock {
    /// Why chat completions cannot carry this block, if they cannot.
    pub(super) fn refusal(&self) -> Option<&'static str> {
        match self {
            ContentBlock::Text {
                citations: Some(c), ..
            } if !c.is_empty() => Some("citations, which chat completions cannot carry"),
            ContentBlock::Text { .. } | ContentBlock::ToolUse { .. } => None,
            ContentBlock::Thinking {} | ContentBlock::RedactedThinking {} => Some(
                "a thinking block, which chat completions cannot carry (thinking is refused for this direction)",
            ),
            ContentBlock::Other => Some("a content block chat completions cannot carry"),
        }
    }
}

/// Anthropic's usage; the cache fields are absent or `null` when nothing was cached.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
pub(super) struct MessagesUsage {
    #[serde(default)]
    pub input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: Option<u64>,
    #[serde(default)]
    pub cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    pub cache_creation_input_tokens: Option<u64>,
}

impl MessagesUsage {
    /// `later`'s fields where it has them (a `message_delta`'s usage is cumulative).
    pub(super) fn updated(self, later: MessagesUsage) -> MessagesUsage {
        MessagesUsage {
            input_tokens: later.input_tokens.or(self.input_tokens),
            output_tokens: later.output_tokens.or(self.output_tokens),
            cache_read_input_tokens: later
                .cache_read_input_tokens
                .or(self.cache_read_input_tokens),
            cache_creation_input_tokens: later
                .cache_creation_input_tokens
                .or(self.cache_creation_input_tokens),
        }
    }

    /// As OpenAI counts it: every input token is a prompt token, cache writes included
    /// (OpenAI has no field for them); `cached_tokens` are the cache reads. A count the
    /// target did not give stays absent: never a zero it did not say.
    pub(super) fn to_openai(self) -> ChatUsage {
        let read = self.cache_read_input_tokens.unwrap_or(0);
        // Saturating: the counts are the upstream's, and an absurd one must not panic.
        let prompt = self.input_tokens.map(|input| {
            input
                .saturating_add(read)
                .saturating_add(self.cache_creation_input_tokens.unwrap_or(0))
        });
        let completion = self.output_tokens;
        ChatUsage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.zip(completion).map(|(p, c)| p.saturating_add(c)),
            prompt_tokens_details: prompt.map(|_| PromptTokensDetails {
                cached_tokens: Some(read),
            }),
        }
    }

    /// Whether the target reported any count at all.
    pub(super) fn is_reported(self) -> bool {
        self.input_tokens.is_some() || self.output_tokens.is_some()
    }
}

/// An Anthropic message as Backstop writes it (whole, or empty in `message_start`).
#[derive(Debug, Serialize)]
pub(super) struct MessageOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<BlockOut>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: UsageOut,
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum BlockOut {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

/// Anthropic's usage as Backstop writes it: the cache fields always present.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(super) struct UsageOut {
    pub input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub output_tokens: u64,
}

/// `msg_` and the chat id, made of the characters Anthropic ids are made of.
pub(super) fn message_id(chat_id: &str) -> String {
    format!("msg_{}", ids::for_anthropic(chat_id))
}

// ---------------------------------------------------------------------------------------
// OpenAI's side: what is read from a chat completion and written into one.

/// A chat completion as the target answered it.
#[derive(Debug, Deserialize)]
pub(super) struct ChatCompletion {
    pub id: String,
    pub model: String,
    pub choices: Vec<Choice>,
    #[serde(default)]
    pub usage: Option<ChatUsage>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Choice {
    pub message: ChatMessage,
    pub finish_reason: Option<String>,
    /// vLLM's extension: the stop string that ended the answer (a token id, or `null`,
    /// when none did).
    #[serde(default)]
    pub stop_reason: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChatMessage {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub refusal: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ToolCall {
    pub id: String,
    pub function: FunctionCall,
}

#[derive(Debug, Deserialize)]
pub(super) struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

/// OpenAI's usage, read and written.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ChatUsage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct PromptTokensDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

impl ChatUsage {
    /// As Anthropic counts it: cached prompt tokens are cache reads, the rest plain input;
    /// OpenAI reports no cache writes, so `cache_creation_input_tokens` is 0. A count the
    /// target did not give is written as 0 (Anthropic's usage has no absent counts);
    /// the meter charges from the target's own usage, never from this.
    pub(super) fn to_anthropic(self) -> UsageOut {
        let read = self
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0);
        let prompt = self.prompt_tokens.unwrap_or(0);
        UsageOut {
            input_tokens: prompt.saturating_sub(read),
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: read.min(prompt),
            output_tokens: self.completion_tokens.unwrap_or(0),
        }
    }
}

/// A `chat.completion` as Backstop writes it.
#[derive(Debug, Serialize)]
struct ChatCompletionOut {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: [ChoiceOut; 1],
    /// Absent when the target reported none.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<ChatUsage>,
}

#[derive(Debug, Serialize)]
struct ChoiceOut {
    index: u32,
    message: ChatMessageOut,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
struct ChatMessageOut {
    role: &'static str,
    content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCallOut>,
    refusal: Option<String>,
}

#[derive(Debug, Serialize)]
struct ToolCallOut {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionOut,
}

#[derive(Debug, Serialize)]
struct FunctionOut {
    name: String,
    arguments: String,
}

/// `chatcmpl-` and the message id.
pub(super) fn completion_id(message_id: &str) -> String {
    format!("chatcmpl-{message_id}")
}

/// A tool-use id as OpenAI accepts it, or why there is none.
pub(super) fn openai_tool_id(id: &str) -> Result<String, AnswerError> {
    ids::for_openai(id).ok_or_else(|| {
        AnswerError(format!(
            "tool-use id `{id}` is longer than OpenAI's {} characters",
            ids::OPENAI_MAX_ID
        ))
    })
}

/// OpenAI's `finish_reason` for a `stop_reason`, never a raw value.
pub(super) fn finish_reason(stop_reason: Option<&str>) -> Result<&'static str, AnswerError> {
    let stop_reason =
        stop_reason.ok_or_else(|| AnswerError::new("the answer has no stop_reason"))?;
    finish::to_finish_reason(stop_reason)
        .ok_or_else(|| AnswerError(format!("stop_reason `{stop_reason}` has no finish_reason")))
}

/// Anthropic's `stop_reason` for a `finish_reason`, from what the answer holds: an
/// answer with tool calls stopped to use them, whatever its `finish_reason` says (vLLM
/// and Ollama answer calls with `stop`, and an Anthropic agent loop runs tools only on
/// `tool_use`); `tool_calls` or `function_call` without a call is not `tool_use`; a
/// refusal that ended normally is Anthropic's `refusal`.
pub(super) fn stop_reason(
    finish_reason: Option<&str>,
    refused: bool,
    called: bool,
) -> Result<&'static str, AnswerError> {
    let finish_reason =
        finish_reason.ok_or_else(|| AnswerError::new("the answer has no finish_reason"))?;
    match finish::to_stop_reason(finish_reason) {
        Some("end_turn") if called => Ok("tool_use"),
        Some("tool_use") if !called => Ok(if refused { "refusal" } else { "end_turn" }),
        Some("end_turn") if refused => Ok("refusal"),
        Some(stop) => Ok(stop),
        None => Err(AnswerError(format!(
            "finish_reason `{finish_reason}` has no stop_reason"
        ))),
    }
}

/// A call's arguments as Anthropic's `input`: `""` is `{}`, anything but an object is not
/// an input.
pub(super) fn tool_input(arguments: &str) -> Result<Value, AnswerError> {
    if arguments.trim().is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    match serde_json::from_str(arguments) {
        Ok(Value::Object(input)) => Ok(Value::Object(input)),
        _ => Err(AnswerError(format!(
            "tool-call arguments are not a JSON object: {}",
            truncated(arguments)
        ))),
    }
}

fn chat_completion(message: Message, created: u64) -> Result<ChatCompletionOut, AnswerError> {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in message.content {
        if let Some(why) = block.refusal() {
            return Err(AnswerError(format!("the answer has {why}")));
        }
        match block {
            // Chat has one text beside its calls: text after a call would be moved
            // before it, a change of meaning no one could see.
            ContentBlock::Text { .. } if !tool_calls.is_empty() => {
                return Err(AnswerError::new(
                    "text after a tool_use block, which chat completions cannot order",
                ));
            }
            ContentBlock::Text { text: t, .. } => text.push_str(&t),
            ContentBlock::ToolUse { input, .. } if !input.is_object() => {
                return Err(AnswerError("a tool_use input that is not an object".into()));
            }
            ContentBlock::ToolUse { id, name, input } => tool_calls.push(ToolCallOut {
                id: openai_tool_id(&id)?,
                kind: "function",
                function: FunctionOut {
                    name,
                    arguments: input.to_string(),
                },
            }),
            _ => unreachable!("refused above"),
        }
    }
    Ok(ChatCompletionOut {
        id: completion_id(&message.id),
        object: "chat.completion",
        created,
        model: message.model,
        choices: [ChoiceOut {
            index: 0,
            message: ChatMessageOut {
                role: "assistant",
                content: (!text.is_empty()).then_some(text),
                tool_calls,
                refusal: None,
            },
            logprobs: None,
            finish_reason: finish_reason(message.stop_reason.as_deref())?,
        }],
        usage: message
            .usage
            .is_reported()
            .then(|| message.usage.to_openai()),
    })
}

fn anthropic_message(completion: ChatCompletion) -> Result<MessageOut, AnswerError> {
    let [choice]: [Choice; 1] = completion.choices.try_into().map_err(|c: Vec<Choice>| {
        AnswerError(format!("the answer has {} choices, not one", c.len()))
    })?;
    let message = choice.message;
    let called = message.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
    let stop = stop_reason(
        choice.finish_reason.as_deref(),
        message.refusal.as_deref().is_some_and(|r| !r.is_empty()),
        called,
    )?;
    // Which stop sequence fired, where the target says (vLLM); OpenAI does not, and
    // its `stop` stays `end_turn` with `stop_sequence: null`.
    let (stop, stop_sequence) = match (stop, choice.stop_reason) {
        ("end_turn", Some(Value::String(sequence))) => ("stop_sequence", Some(sequence)),
        (stop, _) => (stop, None),
    };
    let refusal = message.refusal.unwrap_or_default();
    let text = message.content.unwrap_or_default() + &refusal;
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(BlockOut::Text { text });
    }
    for call in message.tool_calls.unwrap_or_default() {
        content.push(BlockOut::ToolUse {
            id: ids::for_anthropic(&call.id),
            input: tool_input(&call.function.arguments)?,
            name: call.function.name,
        });
    }
    Ok(MessageOut {
        id: message_id(&completion.id),
        kind: "message",
        role: "assistant",
        model: completion.model,
        content,
        stop_reason: Some(stop),
        stop_sequence,
        usage: completion.usage.unwrap_or_default().to_anthropic(),
    })
}

// ---------------------------------------------------------------------------------------
// Errors: a closed table from what the target said to what the caller reads.

/// What an upstream error is, whatever shape it came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ErrorKind {
    InvalidRequest,
    /// An invalid request whose prompt does not fit the model's context window.
    ContextLength,
    Authentication,
    Billing,
    Permission,
    NotFound,
    RequestTooLarge,
    RateLimit,
    Api,
    Timeout,
    Overloaded,
}

impl ErrorKind {
    fn from_status(status: StatusCode) -> ErrorKind {
        match status.as_u16() {
            401 => ErrorKind::Authentication,
            402 => ErrorKind::Billing,
            403 => ErrorKind::Permission,
            404 => ErrorKind::NotFound,
            408 | 504 => ErrorKind::Timeout,
            413 => ErrorKind::RequestTooLarge,
            429 => ErrorKind::RateLimit,
            503 | 529 => ErrorKind::Overloaded,
            400..=499 => ErrorKind::InvalidRequest,
            _ => ErrorKind::Api,
        }
    }

    /// The kind a specific type or code names; generic ones (`invalid_request_error`,
    /// `api_error`, `server_error`, OpenAI's `requests` / `tokens`) leave it to the status.
    fn from_name(name: &str) -> Option<ErrorKind> {
        Some(match name {
            "context_length_exceeded" => ErrorKind::ContextLength,
            "authentication_error" | "invalid_api_key" => ErrorKind::Authentication,
            "billing_error" | "insufficient_quota" | "billing_hard_limit_reached" => {
                ErrorKind::Billing
            }
            "permission_error" => ErrorKind::Permission,
            "not_found_error" | "model_not_found" => ErrorKind::NotFound,
            "request_too_large" => ErrorKind::RequestTooLarge,
            "rate_limit_error" | "rate_limit_exceeded" => ErrorKind::RateLimit,
            "timeout_error" => ErrorKind::Timeout,
            "overloaded_error" => ErrorKind::Overloaded,
            _ => return None,
        })
    }

    /// OpenAI's `type` and `code`. A rate limit is what OpenAI itself sends (`requests`,
    /// `rate_limit_exceeded`); a context overflow carries `context_length_exceeded`, which
    /// OpenAI clients and Backstop's classifier look for.
    fn openai(self) -> (&'static str, Option<&'static str>) {
        match self {
            ErrorKind::InvalidRequest => ("invalid_request_error", None),
            ErrorKind::ContextLength => ("invalid_request_error", Some("context_length_exceeded")),
            ErrorKind::Authentication => ("authentication_error", Some("invalid_api_key")),
            ErrorKind::Billing => ("insufficient_quota", Some("insufficient_quota")),
            ErrorKind::Permission => ("permission_error", None),
            ErrorKind::NotFound => ("invalid_request_error", Some("not_found")),
            ErrorKind::RequestTooLarge => ("invalid_request_error", Some("request_too_large")),
            ErrorKind::RateLimit => ("requests", Some("rate_limit_exceeded")),
            ErrorKind::Api => ("server_error", None),
            ErrorKind::Timeout => ("server_error", Some("timeout")),
            ErrorKind::Overloaded => ("server_error", Some("overloaded")),
        }
    }

    /// Anthropic's error `type`.
    fn anthropic(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest | ErrorKind::ContextLength => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::Billing => "billing_error",
            ErrorKind::Permission => "permission_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::RateLimit => "rate_limit_error",
            ErrorKind::Api => "api_error",
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Overloaded => "overloaded_error",
        }
    }
}

/// An error body in either API's shape, or Gemini's (its object wrapped in an array).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ErrorEnvelope {
    One(ErrorObject),
    Wrapped(Vec<ErrorObject>),
}

#[derive(Debug, Deserialize)]
struct ErrorObject {
    error: ErrorFields,
}

/// The fields of either API's error object (Anthropic's has only `type` and `message`).
#[derive(Debug, Default, Clone, Deserialize)]
pub(super) struct ErrorFields {
    #[serde(default)]
    message: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    code: Option<Value>,
}

/// An upstream error understood: its kind and its message, verbatim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct UpstreamError {
    pub kind: ErrorKind,
    pub message: String,
}

impl UpstreamError {
    /// An error body with its status (`None` for an error inside a stream).
    pub(super) fn read(status: Option<StatusCode>, body: &[u8]) -> UpstreamError {
        let fields = match serde_json::from_slice::<ErrorEnvelope>(body) {
            Ok(ErrorEnvelope::One(o)) => Some(o.error),
            Ok(ErrorEnvelope::Wrapped(list)) => list.into_iter().next().map(|o| o.error),
            Err(_) => None,
        };
        match fields {
            Some(fields) => UpstreamError::from_fields(status, fields),
            None => {
                let text = String::from_utf8_lossy(body);
                let message = match text.trim() {
                    "" => format!(
                        "the upstream answered {} with no readable error",
                        status.map_or_else(|| "an error".to_string(), |s| s.to_string())
                    ),
                    text => truncated(text),
                };
                UpstreamError {
                    kind: status.map_or(ErrorKind::Api, ErrorKind::from_status),
                    message,
                }
            }
        }
    }

    pub(super) fn from_fields(status: Option<StatusCode>, fields: ErrorFields) -> UpstreamError {
        let code = match &fields.code {
            Some(Value::String(code)) => Some(code.to_ascii_lowercase()),
            _ => None,
        };
        let kind_name = fields.kind.as_deref().map(str::to_ascii_lowercase);
        let message = fields.message.unwrap_or_default();
        let named = code
            .as_deref()
            .and_then(ErrorKind::from_name)
            .or_else(|| kind_name.as_deref().and_then(ErrorKind::from_name));
        let mut kind = named
            .or_else(|| status.map(ErrorKind::from_status))
            .unwrap_or(ErrorKind::Api);
        // The classifier's phrases: an overflow must stay recognisable in either shape.
        let lower = message.to_ascii_lowercase();
        if matches!(kind, ErrorKind::InvalidRequest | ErrorKind::RequestTooLarge)
            && (lower.contains("prompt is too long") || lower.contains("maximum context length"))
        {
            kind = ErrorKind::ContextLength;
        }
        UpstreamError { kind, message }
    }

    pub(super) fn openai(&self) -> OpenAiError {
        let (kind, code) = self.kind.openai();
        OpenAiError {
            message: self.message.clone(),
            kind,
            code,
            param: None,
        }
    }

    /// Anthropic callers (and agents built on them) recognise an overflow by "prompt is
    /// too long": an OpenAI overflow's message is kept and prefixed with it.
    pub(super) fn anthropic(&self) -> AnthropicErrorBody {
        let message = if self.kind == ErrorKind::ContextLength
            && !self
                .message
                .to_ascii_lowercase()
                .contains("prompt is too long")
        {
            format!("prompt is too long: {}", self.message)
        } else {
            self.message.clone()
        };
        AnthropicErrorBody {
            kind: "error",
            error: AnthropicError {
                kind: self.kind.anthropic(),
                message,
            },
        }
    }
}

#[derive(Debug, Serialize)]
pub(super) struct OpenAiErrorBody {
    pub error: OpenAiError,
}

#[derive(Debug, Serialize)]
pub(super) struct OpenAiError {
    message: String,
    #[serde(rename = "type")]
    kind: &'static str,
    code: Option<&'static str>,
    param: Option<String>,
}

#[derive(Debug, Serialize)]
pub(super) struct AnthropicErrorBody {
    #[serde(rename = "type")]
    kind: &'static str,
    error: AnthropicError,
}

#[derive(Debug, Serialize)]
struct AnthropicError {
    #[serde(rename = "type")]
    kind: &'static str,
    message: String,
}

/// At most 512 bytes of `text`, cut on a character boundary.
pub(super) fn truncated(text: &str) -> String {
    const MAX: usize = 512;
    if text.len() <= MAX {
        return text.to_string();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use crate::api::ParsedRequest;
    use crate::policy::classify::{classify, Class, Observed};

    fn context(direction: Direction) -> AnswerContext {
        let endpoint = direction.caller_endpoint();
        let body = json!({"model": "m", "messages": [], "input": "hi", "max_tokens": 8});
        AnswerContext {
            direction,
            caller: Arc::new(
                ParsedRequest::parse(endpoint, Bytes::from(body.to_string())).unwrap(),
            ),
        }
    }

    fn translated(direction: Direction, status: u16, body: &str) -> Value {
        let status = StatusCode::from_u16(status).unwrap();
        serde_json::from_slice(&error(&context(direction), status, body.as_bytes())).unwrap()
    }

    fn class(status: u16, body: &Value) -> Class {
        classify(
            Observed::Response {
                status,
                hints: Default::default(),
                body: body.to_string().as_bytes(),
                readable: true,
            },
            SystemTime::UNIX_EPOCH,
        )
    }

    #[test]
    fn anthropic_errors_read_as_openai_ones() {
        let anthropic = |kind: &str, message: &str| {
            json!({"type": "error", "error": {"type": kind, "message": message}}).to_string()
        };
        let rows = [
            (
                400,
                "invalid_request_error",
                "bad",
                "invalid_request_error",
                Value::Null,
            ),
            (
                401,
                "authentication_error",
                "invalid x-api-key",
                "authentication_error",
                json!("invalid_api_key"),
            ),
            (
                403,
                "permission_error",
                "no",
                "permission_error",
                Value::Null,
            ),
            (
                404,
                "not_found_error",
                "model: x",
                "invalid_request_error",
                json!("not_found"),
            ),
            (
                413,
                "request_too_large",
                "big",
                "invalid_request_error",
                json!("request_too_large"),
            ),
            (
                429,
                "rate_limit_error",
                "slow down",
                "requests",
                json!("rate_limit_exceeded"),
            ),
            (500, "api_error", "oops", "server_error", Value::Null),
            (
                529,
                "overloaded_error",
                "Overloaded",
                "server_error",
                json!("overloaded"),
            ),
        ];
        for direction in [Direction::ChatToMessages, Direction::ResponsesToMessages] {
            for (status, source, message, kind, code) in &rows {
                let out = translated(direction, *status, &anthropic(source, message));
                assert_eq!(
                    out,
                    json!({"error": {"message": message, "type": kind, "code": code, "param": null}}),
                    "{status} {source}"
                );
            }
        }
        // A rate limit stays one for the classifier too.
        let out = translated(
            Direction::ChatToMessages,
            429,
            &anthropic("rate_limit_error", "x"),
        );
        assert!(matches!(
            class(429, &out),
            Class::Transient {
                rate_limited: true,
                ..
            }
        ));
    }

    #[test]
    fn openai_and_gemini_errors_read_as_anthropic_ones() {
        let openai = |kind: &str, code: Value| {
            json!({"error": {"message": "m", "type": kind, "code": code, "param": null}})
                .to_string()
        };
        let rows = [
            (
                400,
                openai("invalid_request_error", Value::Null),
                "invalid_request_error",
            ),
            (
                401,
                openai("invalid_request_error", json!("invalid_api_key")),
                "authentication_error",
            ),
            (
                404,
                openai("invalid_request_error", json!("model_not_found")),
                "not_found_error",
            ),
            (
                429,
                openai("requests", json!("rate_limit_exceeded")),
                "rate_limit_error",
            ),
            (
                429,
                openai("insufficient_quota", json!("insufficient_quota")),
                "billing_error",
            ),
            (500, openai("server_error", Value::Null), "api_error"),
            (503, openai("server_error", Value::Null), "overloaded_error"),
            (504, "upstream request timeout".to_string(), "timeout_error"),
            (
                429,
                r#"[{"error":{"code":429,"message":"m","status":"RESOURCE_EXHAUSTED"}}]"#
                    .to_string(),
                "rate_limit_error",
            ),
        ];
        for (status, body, kind) in rows {
            let out = translated(Direction::MessagesToChat, status, &body);
            assert_eq!(out["type"], "error", "{body}");
            assert_eq!(out["error"]["type"], kind, "{status} {body}");
        }
        let out = translated(Direction::MessagesToChat, 502, "<html>bad gateway</html>");
        assert_eq!(
            out,
            json!({"type": "error", "error": {"type": "api_error", "message": "<html>bad gateway</html>"}})
        );
        let out = translated(Direction::MessagesToChat, 500, &"x".repeat(2000));
        assert!(out["error"]["message"].as_str().unwrap().len() < 600);
    }

    #[test]
    fn a_context_overflow_stays_recognisable_both_ways() {
        let anthropic = json!({"type": "error", "error": {"type": "invalid_request_error",
            "message": "prompt is too long: 210000 tokens > 200000 maximum"}});
        let out = translated(Direction::ChatToMessages, 400, &anthropic.to_string());
        assert_eq!(out["error"]["code"], "context_length_exceeded");
        assert_eq!(out["error"]["message"], anthropic["error"]["message"]);
        assert_eq!(
            class(400, &out),
            Class::CallerFault {
                context_length: true
            }
        );

        let openai = json!({"error": {"message": "This model's maximum context length is 128000 tokens.",
            "type": "invalid_request_error", "code": "context_length_exceeded", "param": "messages"}});
        let out = translated(Direction::MessagesToChat, 400, &openai.to_string());
        assert_eq!(out["error"]["type"], "invalid_request_error");
        assert_eq!(
            out["error"]["message"],
            "prompt is too long: This model's maximum context length is 128000 tokens."
        );
        assert_eq!(
            class(400, &out),
            Class::CallerFault {
                context_length: true
            }
        );
    }

    use proptest::prelude::*;

    proptest! {
        /// Any status and any bytes: never a panic, always the caller's error shape, and a
        /// 429 that names no quota is always a rate limit.
        #[test]
        fn any_error_body_comes_out_in_the_callers_shape(
            status in 400u16..600,
            body in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                "\\{\"(type|error)\":\\{\"(type|code|message)\":\"[a-z_ ]{0,12}\"\\}\\}"
                    .prop_map(String::into_bytes),
            ],
        ) {
            let status = StatusCode::from_u16(status).unwrap();
            for direction in [Direction::ChatToMessages, Direction::MessagesToChat] {
                let out: Value = serde_json::from_slice(&error(&context(direction), status, &body)).unwrap();
                let kind = match direction {
                    Direction::MessagesToChat => {
                        prop_assert_eq!(&out["type"], "error");
                        out["error"]["type"].clone()
                    }
                    _ => {
                        prop_assert!(out["error"].get("param").is_some());
                        out["error"]["code"].clone()
                    }
                };
                prop_assert!(out["error"]["message"].is_string());
                let text = String::from_utf8_lossy(&body).to_ascii_lowercase();
                if status == 429 && !text.contains("quota") && !text.contains("billing")
                    && !text.contains("overloaded") && !text.contains("context") && !text.contains("too")
                    && !text.contains("error") && !text.contains("not_found")
                {
                    prop_assert!(kind == "rate_limit_error" || kind == "rate_limit_exceeded", "{}", out);
                }
            }
        }
    }

    #[test]
    fn a_chat_answer_needs_one_choice_a_known_finish_and_object_arguments() {
        let cx = context(Direction::MessagesToChat);
        let answer = |choices: Value| {
            whole(
                &cx,
                json!({"id": "c", "model": "m", "choices": choices})
                    .to_string()
                    .as_bytes(),
            )
        };
        let choice = |finish: Value, arguments: &str| {
            json!({"message": {"content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "f", "arguments": arguments}}]}, "finish_reason": finish})
        };
        assert!(answer(json!([])).is_err());
        assert!(answer(json!([
            choice(json!("stop"), ""),
            choice(json!("stop"), "")
        ]))
        .is_err());
        assert!(answer(json!([choice(json!("weird"), "")])).is_err());
        assert!(answer(json!([choice(Value::Null, "")])).is_err());
        assert!(answer(json!([choice(json!("tool_calls"), "[1]")])).is_err());
        let ok: Value =
            serde_json::from_slice(&answer(json!([choice(json!("tool_calls"), "")])).unwrap())
                .unwrap();
        assert_eq!(
            ok["content"],
            json!([{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}])
        );
        assert_eq!(ok["stop_reason"], "tool_use");
        assert_eq!(ok["id"], "msg_c");
        assert_eq!(
            ok["usage"],
            json!({"input_tokens": 0, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0})
        );
    }

    #[test]
    fn the_stop_reason_follows_what_the_answer_holds() {
        let cx = context(Direction::MessagesToChat);
        let answer = |message: Value, extra: Value| -> Value {
            let mut choice = json!({"message": message});
            choice
                .as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let body = json!({"id": "c", "model": "m", "choices": [choice]});
            serde_json::from_slice(&whole(&cx, body.to_string().as_bytes()).unwrap()).unwrap()
        };
        let call = json!({"content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]});
        // vLLM and Ollama answer a call with `stop`: an Anthropic loop must run the tool.
        let vllm = answer(call.clone(), json!({"finish_reason": "stop"}));
        assert_eq!(vllm["stop_reason"], "tool_use");
        // `function_call` (or `tool_calls`) without a call is not `tool_use`.
        let text = json!({"content": "done"});
        for finish in ["function_call", "tool_calls"] {
            let out = answer(text.clone(), json!({"finish_reason": finish}));
            assert_eq!(out["stop_reason"], "end_turn", "{finish}");
        }
        // Which stop sequence fired, where the target says (vLLM's `stop_reason`).
        let fired = answer(
            text.clone(),
            json!({"finish_reason": "stop", "stop_reason": "###"}),
        );
        assert_eq!(fired["stop_reason"], "stop_sequence");
        assert_eq!(fired["stop_sequence"], "###");
        let eos = answer(text, json!({"finish_reason": "stop", "stop_reason": 2}));
        assert_eq!(eos["stop_reason"], "end_turn");
        assert_eq!(eos["stop_sequence"], Value::Null);
        // No usage reported: the caller is told none (Anthropic's zeros are written, the
        // meter charges the target's own, absent, usage).
        assert_eq!(vllm["usage"]["input_tokens"], 0);
    }

    #[test]
    fn text_after_a_tool_call_is_refused_not_moved_before_it() {
        let cx = context(Direction::ChatToMessages);
        let body = json!({"id": "msg_1", "model": "m", "stop_reason": "tool_use",
            "usage": {"input_tokens": 1, "output_tokens": 1}, "content": [
                {"type": "text", "text": "first"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
                {"type": "text", "text": "after"}]});
        let err = whole(&cx, body.to_string().as_bytes()).unwrap_err();
        assert!(err.0.contains("text after a tool_use block"), "{}", err.0);
        // Without the usage the chat answer carries none, rather than zeros.
        let body = json!({"id": "msg_1", "model": "m", "stop_reason": "end_turn",
            "content": [{"type": "text", "text": "hi"}]});
        let out: Value =
            serde_json::from_slice(&whole(&cx, body.to_string().as_bytes()).unwrap()).unwrap();
        assert!(out.get("usage").is_none(), "{out}");
    }

    #[test]
    fn a_refusal_is_text_and_a_refusal_stop() {
        let cx = context(Direction::MessagesToChat);
        let body = json!({"id": "c", "model": "m", "choices": [{"message": {"content": null,
            "refusal": "I can't help with that."}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}});
        let out: Value =
            serde_json::from_slice(&whole(&cx, body.to_string().as_bytes()).unwrap()).unwrap();
        assert_eq!(
            out["content"],
            json!([{"type": "text", "text": "I can't help with that."}])
        );
        assert_eq!(out["stop_reason"], "refusal");
    }

    #[test]
    fn an_anthropic_answer_refuses_raw_stops_long_ids_and_unknown_blocks() {
        let cx = context(Direction::ChatToMessages);
        let message = |content: Value, stop: &str| {
            whole(
                &cx,
                json!({"id": "msg_1", "model": "m", "content": content, "stop_reason": stop,
                "usage": {"input_tokens": 1, "output_tokens": 1}})
                .to_string()
                .as_bytes(),
            )
        };
        assert!(message(json!([]), "pause_turn").is_err());
        let long = json!([{"type": "tool_use", "id": "x".repeat(41), "name": "f", "input": {}}]);
        assert!(message(long, "tool_use").is_err());
        let server = json!([{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}]);
        assert!(message(server, "end_turn").is_err());
        let cited =
            json!([{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]);
        assert!(message(cited, "end_turn").is_err());
        let uncited = json!([{"type": "text", "text": "x", "citations": null}]);
        assert!(message(uncited, "end_turn").is_ok());
        let encoded = json!([{"type": "tool_use", "id": ids::for_anthropic("functions.Bash:0"), "name": "f", "input": {}}]);
        let out: Value = serde_json::from_slice(&message(encoded, "tool_use").unwrap()).unwrap();
        assert_eq!(
            out["choices"][0]["message"]["tool_calls"][0]["id"],
            "functions.Bash:0"
        );
        assert_eq!(out["choices"][0]["message"]["content"], Value::Null);
    }
}
