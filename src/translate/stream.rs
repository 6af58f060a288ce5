//! Streamed answers, as typed state machines: the target's events are read into typed
//! events, the caller's are written from typed events, and what the stream has said so
//! far is an enum, never a string being patched.
//!
//! Both machines end the caller's stream exactly once: with the caller's successful end
//! (`data: [DONE]`, `message_stop`) only after the target's own, and otherwise with one
//! error event and nothing after it (an upstream `error` event in the caller's error
//! shape; a stream that breaks its protocol as `upstream_malformed`; a stream that stops
//! early as `upstream_stream_error`).

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::answer::{
    self, BlockOut, ChatUsage, ContentBlock, ErrorFields, MessageOut, MessagesUsage, UpstreamError,
    UsageOut,
};
use super::{ids, AnswerContext, AnswerError, Direction, StreamTranslator};
use crate::wire::{sse::SseEvent, stream_error_event, Wire};

/// The state machine for a context's direction.
pub fn translator(cx: &AnswerContext) -> Box<dyn StreamTranslator> {
    match cx.direction {
        Direction::ChatToMessages => Box::new(MessagesToChunks::new(cx.wants_usage_chunk())),
        Direction::MessagesToChat => Box::new(ChunksToMessages::new()),
        Direction::ResponsesToMessages => super::responses::translator(cx),
    }
}

/// The code of the error event that ends a target stream which broke its protocol.
const MALFORMED: &str = "upstream_malformed";
/// The code of the error event that ends a target stream which stopped early.
const INCOMPLETE: &str = "upstream_stream_error";

// =======================================================================================
// Anthropic events → chat completion chunks (an OpenAI chat caller, an Anthropic target).

/// An Anthropic stream event as read.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum MessagesEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: u32,
        content_block: ContentBlock,
    },
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: StopDelta,
        #[serde(default)]
        usage: MessagesUsage,
    },
    MessageStop,
    Ping,
    Error {
        error: ErrorFields,
    },
    /// Anthropic may add event types; one not known is passed over.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct StartMessage {
    id: String,
    model: String,
    #[serde(default)]
    usage: MessagesUsage,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct StopDelta {
    stop_reason: Option<String>,
}

/// What the chat caller has been told so far.
#[derive(Debug)]
enum ChatSide {
    /// Nothing: waiting for `message_start`.
    Waiting,
    /// The role chunk is out; content is flowing.
    Open(OpenChat),
    /// The finish chunk is out (`message_delta`); waiting for `message_stop`.
    Finished,
    /// `[DONE]` or an error event is out: nothing more is written.
    Ended,
}

/// What every chunk of one answer carries.
#[derive(Debug, Clone)]
struct ChunkHead {
    id: String,
    created: u64,
    model: String,
}

#[derive(Debug)]
struct OpenChat {
    head: ChunkHead,
    usage: MessagesUsage,
    /// The Anthropic block being streamed, if one is.
    block: Option<(u32, ChatBlock)>,
    /// Tool calls started so far (the next call's `index`).
    calls: u32,
}

#[derive(Debug, Clone, Copy)]
enum ChatBlock {
    Text,
    /// A tool call; `arguments` is whether a non-empty fragment has gone out.
    Tool {
        call: u32,
        arguments: bool,
    },
}

struct MessagesToChunks {
    wants_usage: bool,
    side: ChatSide,
}

impl MessagesToChunks {
    fn new(wants_usage: bool) -> Self {
        MessagesToChunks {
            wants_usage,
            side: ChatSide::Waiting,
        }
    }

    fn step(&mut self, event: MessagesEvent, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        let side = std::mem::replace(&mut self.side, ChatSide::Ended);
        self.side = match (side, event) {
            (ChatSide::Ended, _) => ChatSide::Ended,
            (side, MessagesEvent::Ping | MessagesEvent::Other) => side,
            (_, MessagesEvent::Error { error }) => {
                let error = UpstreamError::from_fields(None, error);
                out.push(chat_error(&error));
                ChatSide::Ended
            }
            (ChatSide::Waiting, MessagesEvent::MessageStart { message }) => {
                let head = ChunkHead {
                    id: answer::completion_id(&message.id),
                    created: answer::now_unix(),
                    model: message.model,
                };
                out.push(chunk(
                    &head,
                    ChunkDelta {
                        role: Some("assistant"),
                        content: Some(""),
                        ..ChunkDelta::default()
                    },
                    None,
                ));
                ChatSide::Open(OpenChat {
                    head,
                    usage: message.usage,
                    block: None,
                    calls: 0,
                })
            }
            (ChatSide::Open(open), event) => self.content(open, event, out)?,
            (ChatSide::Finished, MessagesEvent::MessageStop) => {
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                ChatSide::Ended
            }
            (_, event) => return Err(unexpected(&event)),
        };
        Ok(())
    }

    /// An event inside the message.
    fn content(
        &self,
        mut open: OpenChat,
        event: MessagesEvent,
        out: &mut Vec<Bytes>,
    ) -> Result<ChatSide, AnswerError> {
        match (open.block, event) {
            (
                None,
                MessagesEvent::ContentBlockStart {
                    index,
                    content_block,
                },
            ) => {
                if let Some(why) = content_block.refusal() {
                    return Err(AnswerError(format!("the stream has {why}")));
                }
                let block = match content_block {
                    ContentBlock::Text { .. } if open.calls > 0 => {
                        return Err(AnswerError::new(
                            "text after a tool_use block, which chat completions cannot order",
                        ));
                    }
                    ContentBlock::Text { text, .. } => {
                        if !text.is_empty() {
                            out.push(text_chunk(&open.head, &text));
                        }
                        ChatBlock::Text
                    }
                    ContentBlock::ToolUse { id, name, input } => {
                        let call = open.calls;
                        open.calls += 1;
                        let call_delta = ToolCallDelta {
                            index: call,
                            id: Some(answer::openai_tool_id(&id)?),
                            kind: Some("function"),
                            function: FunctionDelta {
                                name: Some(&name),
                                arguments: Some(""),
                            },
                        };
                        out.push(tool_chunk(&open.head, call_delta));
                        // The input is `{}` and comes in fragments; one that came whole
                        // is its own first fragment.
                        let whole = input.as_object().is_some_and(|o| !o.is_empty());
                        if whole {
                            out.push(arguments_chunk(&open.head, call, &input.to_string()));
                        }
                        ChatBlock::Tool {
                            call,
                            arguments: whole,
                        }
                    }
                    _ => unreachable!("refused above"),
                };
                open.block = Some((index, block));
            }
            (Some((open_index, block)), MessagesEvent::ContentBlockDelta { index, delta })
                if index == open_index =>
            {
                match (block, delta) {
                    (ChatBlock::Text, BlockDelta::TextDelta { text }) => {
                        if !text.is_empty() {
                            out.push(text_chunk(&open.head, &text));
                        }
                    }
                    (ChatBlock::Tool { call, .. }, BlockDelta::InputJsonDelta { partial_json }) => {
                        if !partial_json.is_empty() {
                            out.push(arguments_chunk(&open.head, call, &partial_json));
                            open.block = Some((
                                index,
                                ChatBlock::Tool {
                                    call,
                                    arguments: true,
                                },
                            ));
                        }
                    }
                    (_, BlockDelta::Other) => {
                        return Err(AnswerError::new(
                            "the stream has a delta chat completions cannot carry",
                        ))
                    }
                    (_, _) => {
                        return Err(AnswerError::new(
                            "a content block's delta does not match its block",
                        ))
                    }
                }
            }
            (Some((open_index, block)), MessagesEvent::ContentBlockStop { index })
                if index == open_index =>
            {
                // A call with no argument fragments still has arguments that parse.
                if let ChatBlock::Tool {
                    call,
                    arguments: false,
                } = block
                {
                    out.push(arguments_chunk(&open.head, call, "{}"));
                }
                open.block = None;
            }
            (None, MessagesEvent::MessageDelta { delta, usage }) => {
                let finish = answer::finish_reason(delta.stop_reason.as_deref())?;
                out.push(chunk(&open.head, ChunkDelta::default(), Some(finish)));
                if self.wants_usage {
                    let usage = open.usage.updated(usage).to_openai();
                    out.push(usage_chunk(&open.head, usage));
                }
                return Ok(ChatSide::Finished);
            }
            (_, event) => return Err(unexpected(&event)),
        }
        Ok(ChatSide::Open(open))
    }
}

impl StreamTranslator for MessagesToChunks {
    fn event(&mut self, event: &SseEvent, out: &mut Vec<Bytes>) {
        if matches!(self.side, ChatSide::Ended) {
            return;
        }
        // Comments and keep-alives carry no JSON; a corrupted event ends the stream.
        let step = match &event.json {
            None if !event.unreadable => return,
            None => Err(AnswerError(
                "an Anthropic event whose data is not JSON".into(),
            )),
            Some(json) => Ok(json),
        };
        let step = step.and_then(|json| {
            MessagesEvent::deserialize(json)
                .map_err(|e| AnswerError(format!("an Anthropic event that does not read: {e}")))
        });
        let step = step.and_then(|event| self.step(event, out));
        if let Err(AnswerError(why)) = step {
            out.push(stream_error_event(Wire::Chat, MALFORMED, &why));
            self.side = ChatSide::Ended;
        }
    }

    fn ended(&self) -> bool {
        matches!(self.side, ChatSide::Ended)
    }

    fn finish(&mut self, out: &mut Vec<Bytes>) {
        if !matches!(self.side, ChatSide::Ended) {
            out.push(stream_error_event(
                Wire::Chat,
                INCOMPLETE,
                "the upstream stream ended before message_stop",
            ));
            self.side = ChatSide::Ended;
        }
    }
}

fn unexpected(event: &MessagesEvent) -> AnswerError {
    let event = answer::truncated(&format!("{event:?}"));
    AnswerError(format!("an Anthropic event out of order: {event}"))
}

/// A chat completion chunk as Backstop writes it.
#[derive(Debug, Serialize)]
struct ChunkOut<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<ChatUsage>,
}

#[derive(Debug, Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: ChunkDelta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
struct ChunkDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[ToolCallDelta<'a>; 1]>,
}

#[derive(Debug, Serialize)]
struct ToolCallDelta<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: FunctionDelta<'a>,
}

#[derive(Debug, Serialize)]
struct FunctionDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a str>,
}

fn data(chunk: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(chunk).expect("a chunk serialises");
    Bytes::from(format!("data: {json}\n\n"))
}

fn chunk(head: &ChunkHead, delta: ChunkDelta<'_>, finish: Option<&'static str>) -> Bytes {
    data(&ChunkOut {
        id: &head.id,
        object: "chat.completion.chunk",
        created: head.created,
        model: &head.model,
        choices: vec![ChunkChoice {
            index: 0,
            delta,
            logprobs: None,
            finish_reason: finish,
        }],
        usage: None,
    })
}

fn text_chunk(head: &ChunkHead, text: &str) -> Bytes {
    let delta = ChunkDelta {
        content: Some(text),
        ..ChunkDelta::default()
    };
    chunk(head, delta, None)
}

fn tool_chunk(head: &ChunkHead, call: ToolCallDelta<'_>) -> Bytes {
    let delta = ChunkDelta {
        tool_calls: Some([call]),
        ..ChunkDelta::default()
    };
    chunk(head, delta, None)
}

fn arguments_chunk(head: &ChunkHead, call: u32, fragment: &str) -> Bytes {
    tool_chunk(
        head,
        ToolCallDelta {
            index: call,
            id: None,
            kind: None,
            function: FunctionDelta {
                name: None,
                arguments: Some(fragment),
            },
        },
    )
}

fn usage_chunk(head: &ChunkHead, usage: ChatUsage) -> Bytes {
    data(&ChunkOut {
        id: &head.id,
        object: "chat.completion.chunk",
        created: head.created,
        model: &head.model,
        choices: Vec::new(),
        usage: Some(usage),
    })
}

fn chat_error(error: &UpstreamError) -> Bytes {
    data(&answer::OpenAiErrorBody {
        error: error.openai(),
    })
}

// =======================================================================================
// Chat completion chunks → Anthropic events (an Anthropic caller, an OpenAI target).

/// An OpenAI stream event as read: a chunk, or an error in its place.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum ChatEvent {
    Error { error: ErrorFields },
    Chunk(ChunkIn),
}

#[derive(Debug, Deserialize)]
struct ChunkIn {
    #[serde(default)]
    id: String,
    #[serde(default)]
    model: String,
    #[serde(default)]
    choices: Vec<ChoiceIn>,
    #[serde(default)]
    usage: Option<ChatUsage>,
}

#[derive(Debug, Deserialize)]
struct ChoiceIn {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: DeltaIn,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct DeltaIn {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallIn>>,
}

#[derive(Debug, Deserialize)]
struct ToolCallIn {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionIn>,
}

#[derive(Debug, Default, Deserialize)]
struct FunctionIn {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

/// What the Anthropic caller has been told so far.
#[derive(Debug)]
enum MessagesSide {
    /// Nothing: waiting for the first chunk.
    Waiting,
    /// `message_start` is out.
    Open(OpenMessage),
    /// `message_stop` or an error event is out: nothing more is written.
    Ended,
}

#[derive(Debug)]
struct OpenMessage {
    /// The content block being streamed, if one is.
    block: Option<OpenBlock>,
    /// The next content block's index.
    next: u32,
    /// The last tool call's `index` (a call's fragments come before the next call's).
    last_call: Option<u32>,
    /// A refusal was streamed (as text): a normal stop is Anthropic's `refusal`.
    refused: bool,
    /// A tool call was relayed: the answer stopped to use it.
    called: bool,
    usage: Option<ChatUsage>,
    stage: Stage,
}

#[derive(Debug)]
enum OpenBlock {
    Text {
        index: u32,
    },
    Tool {
        index: u32,
        call: u32,
        /// The call's id as the target named it.
        id: String,
        /// The fragments so far, to check the call is an object when it closes.
        arguments: String,
    },
}

/// Where the message is past its content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Content may still come.
    Content,
    /// The finish chunk came (its `stop_reason`); waiting for usage or `[DONE]`.
    Stopped(&'static str),
    /// `message_delta` is out; waiting for `[DONE]`.
    Reported,
}

/// An Anthropic stream event as Backstop writes it.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum EventOut<'a> {
    MessageStart { message: MessageOut },
    ContentBlockStart { index: u32, content_block: BlockOut },
    ContentBlockDelta { index: u32, delta: DeltaOut<'a> },
    ContentBlockStop { index: u32 },
    MessageDelta { delta: StopOut, usage: UsageOut },
    MessageStop,
}

impl EventOut<'_> {
    fn name(&self) -> &'static str {
        match self {
            EventOut::MessageStart { .. } => "message_start",
            EventOut::ContentBlockStart { .. } => "content_block_start",
            EventOut::ContentBlockDelta { .. } => "content_block_delta",
            EventOut::ContentBlockStop { .. } => "content_block_stop",
            EventOut::MessageDelta { .. } => "message_delta",
            EventOut::MessageStop => "message_stop",
        }
    }

    fn bytes(&self) -> Bytes {
        named(self.name(), self)
    }
}

#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum DeltaOut<'a> {
    TextDelta { text: &'a str },
    InputJsonDelta { partial_json: &'a str },
}

#[derive(Debug, Serialize)]
struct StopOut {
    stop_reason: &'static str,
    stop_sequence: Option<String>,
}

fn named(name: &str, data: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(data).expect("an event serialises");
    Bytes::from(format!("event: {name}\ndata: {json}\n\n"))
}

struct ChunksToMessages {
    side: MessagesSide,
}

impl ChunksToMessages {
    fn new() -> Self {
        ChunksToMessages {
            side: MessagesSide::Waiting,
        }
    }

    fn step(&mut self, event: &SseEvent, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        let side = std::mem::replace(&mut self.side, MessagesSide::Ended);
        self.side = match side {
            MessagesSide::Ended => MessagesSide::Ended,
            _ if event.done => match side {
                MessagesSide::Open(open) => open.done(out)?,
                _ => return Err(AnswerError::new("[DONE] before any chunk")),
            },
            side => {
                // Comments and keep-alives carry no JSON; a corrupted chunk ends it.
                let Some(json) = &event.json else {
                    if event.unreadable {
                        return Err(AnswerError::new("a chunk whose data is not JSON"));
                    }
                    self.side = side;
                    return Ok(());
                };
                let event = ChatEvent::deserialize(json)
                    .map_err(|e| AnswerError(format!("a chunk that does not read: {e}")))?;
                match (side, event) {
                    (_, ChatEvent::Error { error }) => {
                        let error = UpstreamError::from_fields(None, error);
                        out.push(named("error", &error.anthropic()));
                        MessagesSide::Ended
                    }
                    // Azure OpenAI opens with a chunk of content-filter results only
                    // (no id, no model, no choices): the message starts with the first
                    // chunk that says something.
                    (MessagesSide::Waiting, ChatEvent::Chunk(chunk))
                        if chunk.choices.is_empty() && chunk.usage.is_none() =>
                    {
                        MessagesSide::Waiting
                    }
                    (MessagesSide::Waiting, ChatEvent::Chunk(chunk)) => {
                        let message = MessageOut {
                            id: answer::message_id(&chunk.id),
                            kind: "message",
                            role: "assistant",
                            model: chunk.model.clone(),
                            content: Vec::new(),
                            stop_reason: None,
                            stop_sequence: None,
                            usage: UsageOut::default(),
                        };
                        out.push(EventOut::MessageStart { message }.bytes());
                        let mut open = OpenMessage::new();
                        open.chunk(chunk, out)?;
                        MessagesSide::Open(open)
                    }
                    (MessagesSide::Open(mut open), ChatEvent::Chunk(chunk)) => {
                        open.chunk(chunk, out)?;
                        MessagesSide::Open(open)
                    }
                    (MessagesSide::Ended, _) => MessagesSide::Ended,
                }
            }
        };
        Ok(())
    }
}

impl OpenMessage {
    fn new() -> Self {
        OpenMessage {
            block: None,
            next: 0,
            last_call: None,
            refused: false,
            called: false,
            usage: None,
            stage: Stage::Content,
        }
    }

    fn chunk(&mut self, chunk: ChunkIn, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        for choice in chunk.choices {
            if choice.index != 0 {
                return Err(AnswerError::new("a chunk for a second choice"));
            }
            let delta = choice.delta;
            for text in [&delta.content, &delta.refusal] {
                if let Some(text) = text.as_deref().filter(|t| !t.is_empty()) {
                    self.text(text, out)?;
                }
            }
            if delta.refusal.as_deref().is_some_and(|r| !r.is_empty()) {
                self.refused = true;
            }
            for call in delta.tool_calls.unwrap_or_default() {
                self.tool_call(call, out)?;
            }
            if let Some(finish) = choice.finish_reason {
                if self.stage != Stage::Content {
                    return Err(AnswerError::new("a second finish_reason"));
                }
                let stop = answer::stop_reason(Some(&finish), self.refused, self.called)?;
                self.close(stop == "max_tokens", out)?;
                self.stage = Stage::Stopped(stop);
            }
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage);
            if let Stage::Stopped(stop) = self.stage {
                self.report(stop, out);
            }
        }
        Ok(())
    }

    fn content_allowed(&self) -> Result<(), AnswerError> {
        match self.stage {
            Stage::Content => Ok(()),
            _ => Err(AnswerError::new("content after the finish_reason")),
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        self.content_allowed()?;
        let index = match self.block {
            Some(OpenBlock::Text { index }) => index,
            _ => {
                self.close(false, out)?;
                let index = self.start(
                    BlockOut::Text {
                        text: String::new(),
                    },
                    out,
                );
                self.block = Some(OpenBlock::Text { index });
                index
            }
        };
        let delta = DeltaOut::TextDelta { text };
        out.push(EventOut::ContentBlockDelta { index, delta }.bytes());
        Ok(())
    }

    fn tool_call(&mut self, call: ToolCallIn, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        self.content_allowed()?;
        self.called = true;
        let function = call.function.unwrap_or_default();
        // A delta continues the open call unless it names another index or another id
        // (some OpenAI-compatible servers send each call whole, without an index).
        let continuing = match &self.block {
            Some(OpenBlock::Tool { call: c, id, .. }) => {
                call.index.is_none_or(|i| i == *c)
                    && call.id.as_ref().is_none_or(|other| other == id)
            }
            _ => false,
        };
        if !continuing {
            let index = call
                .index
                .unwrap_or_else(|| self.last_call.map_or(0, |last| last + 1));
            if self.last_call.is_some_and(|last| index <= last) {
                return Err(AnswerError(format!(
                    "tool call {index} continues after a later one began"
                )));
            }
            let (Some(id), Some(name)) = (call.id, function.name.filter(|n| !n.is_empty())) else {
                return Err(AnswerError(format!(
                    "tool call {index} begins without its id and name"
                )));
            };
            self.close(false, out)?;
            let block = self.start(
                BlockOut::ToolUse {
                    id: ids::for_anthropic(&id),
                    name,
                    input: Value::Object(Default::default()),
                },
                out,
            );
            self.block = Some(OpenBlock::Tool {
                index: block,
                call: index,
                id,
                arguments: String::new(),
            });
            self.last_call = Some(index);
        }
        let fragment = function.arguments.unwrap_or_default();
        if let (
            Some(OpenBlock::Tool {
                index, arguments, ..
            }),
            false,
        ) = (&mut self.block, fragment.is_empty())
        {
            arguments.push_str(&fragment);
            let delta = DeltaOut::InputJsonDelta {
                partial_json: &fragment,
            };
            out.push(
                EventOut::ContentBlockDelta {
                    index: *index,
                    delta,
                }
                .bytes(),
            );
        }
        Ok(())
    }

    /// Starts a content block; its index.
    fn start(&mut self, content_block: BlockOut, out: &mut Vec<Bytes>) -> u32 {
        let index = self.next;
        self.next += 1;
        out.push(
            EventOut::ContentBlockStart {
                index,
                content_block,
            }
            .bytes(),
        );
        index
    }

    /// Stops the open block, if any. A call's arguments must be an object unless the
    /// answer was cut short (`truncated`): then they are what came, as Anthropic's own.
    fn close(&mut self, truncated: bool, out: &mut Vec<Bytes>) -> Result<(), AnswerError> {
        let index = match self.block.take() {
            None => return Ok(()),
            Some(OpenBlock::Text { index }) => index,
            Some(OpenBlock::Tool {
                index, arguments, ..
            }) => {
                if !truncated {
                    answer::tool_input(&arguments)?;
                }
                if arguments.trim().is_empty() {
                    let delta = DeltaOut::InputJsonDelta { partial_json: "{}" };
                    out.push(EventOut::ContentBlockDelta { index, delta }.bytes());
                }
                index
            }
        };
        out.push(EventOut::ContentBlockStop { index }.bytes());
        Ok(())
    }

    fn report(&mut self, stop: &'static str, out: &mut Vec<Bytes>) {
        let delta = StopOut {
            stop_reason: stop,
            stop_sequence: None,
        };
        let usage = self.usage.unwrap_or_default().to_anthropic();
        out.push(EventOut::MessageDelta { delta, usage }.bytes());
        self.stage = Stage::Reported;
    }

    /// `[DONE]`: the message ends, if it finished.
    fn done(mut self, out: &mut Vec<Bytes>) -> Result<MessagesSide, AnswerError> {
        match self.stage {
            Stage::Content => return Err(AnswerError::new("[DONE] without a finish_reason")),
            Stage::Stopped(stop) => self.report(stop, out),
            Stage::Reported => {}
        }
        out.push(EventOut::MessageStop.bytes());
        Ok(MessagesSide::Ended)
    }
}

impl StreamTranslator for ChunksToMessages {
    fn event(&mut self, event: &SseEvent, out: &mut Vec<Bytes>) {
        if let Err(AnswerError(why)) = self.step(event, out) {
            out.push(stream_error_event(Wire::Messages, MALFORMED, &why));
            self.side = MessagesSide::Ended;
        }
    }

    fn ended(&self) -> bool {
        matches!(self.side, MessagesSide::Ended)
    }

    fn finish(&mut self, out: &mut Vec<Bytes>) {
        if !matches!(self.side, MessagesSide::Ended) {
            out.push(stream_error_event(
                Wire::Messages,
                INCOMPLETE,
                "the upstream stream ended before [DONE]",
            ));
            self.side = MessagesSide::Ended;
        }
    }
}

#[cfg(test)]
mod tests {
    //! Golden fixtures (`tests/fixtures/translate/`, rewritten with `BACKSTOP_BLESS=1`),
    //! and the stream equivalence: any answer, rendered as the target's stream and cut at
    //! any bytes, folds back into what [`answer::whole`] makes of it.

    use std::sync::Arc;

    use proptest::prelude::*;
    use serde_json::{json, Map};

    use super::*;
    use crate::api::{Endpoint, ParsedRequest};
    use crate::wire::sse::Splitter;

    pub(crate) fn context(direction: Direction, wants_usage: bool) -> AnswerContext {
        let (endpoint, body) = match direction {
            Direction::MessagesToChat => (
                Endpoint::Messages,
                json!({"model": "claude-x", "max_tokens": 64, "messages": [], "stream": true}),
            ),
            _ => (
                Endpoint::ChatCompletions,
                json!({"model": "gpt-x", "messages": [], "stream": true,
                       "stream_options": {"include_usage": wants_usage}}),
            ),
        };
        let caller = ParsedRequest::parse(endpoint, Bytes::from(body.to_string())).unwrap();
        AnswerContext {
            direction,
            caller: Arc::new(caller),
        }
    }

    /// The caller's bytes for the target's bytes, cut at `cuts`.
    fn translate(cx: &AnswerContext, input: &[u8], cuts: &[usize]) -> Vec<u8> {
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(input.len());
        let mut splitter = Splitter::default();
        let mut translator = translator(cx);
        let mut out = Vec::new();
        let mut from = 0;
        for cut in cuts {
            for event in splitter.push(&input[from..cut]) {
                translator.event(&event, &mut out);
            }
            from = cut;
        }
        if let Some(event) = splitter.finish() {
            translator.event(&event, &mut out);
        }
        translator.finish(&mut out);
        out.iter().flat_map(|b| b.to_vec()).collect()
    }

    fn events(bytes: &[u8]) -> Vec<SseEvent> {
        let mut splitter = Splitter::default();
        let events = splitter.push(bytes);
        assert!(splitter.finish().is_none(), "every event is whole");
        events
    }

    /// `"created":<digits>` as `"created":0`: the one field that depends on the clock.
    fn uncreated(text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find("\"created\":") {
            let (head, tail) = rest.split_at(at + "\"created\":".len());
            out.push_str(head);
            out.push('0');
            rest = tail.trim_start_matches(|c: char| c.is_ascii_digit());
        }
        out.push_str(rest);
        out
    }

    fn fixture(name: &str) -> String {
        let path = format!(
            "{}/tests/fixtures/translate/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// Compares with the expected fixture, or writes it when blessing.
    fn golden(name: &str, actual: &str) {
        let actual = uncreated(actual);
        if std::env::var_os("BACKSTOP_BLESS").is_some() {
            let path = format!(
                "{}/tests/fixtures/translate/{name}",
                env!("CARGO_MANIFEST_DIR")
            );
            std::fs::write(path, &actual).unwrap();
            return;
        }
        assert_eq!(actual, fixture(name), "golden {name}");
    }

    #[test]
    fn golden_chat_caller_anthropic_target() {
        let cx = context(Direction::ChatToMessages, true);
        let whole = answer::whole(&cx, fixture("c2m/target.json").as_bytes()).unwrap();
        golden(
            "c2m/caller.json",
            &(String::from_utf8(whole.to_vec()).unwrap() + "\n"),
        );
        for name in ["target", "truncated.target", "error.target"] {
            let input = fixture(&format!("c2m/{name}.sse"));
            let out = translate(&cx, input.as_bytes(), &[]);
            let expected = format!("c2m/{}.sse", name.replace("target", "caller"));
            golden(&expected, &String::from_utf8(out).unwrap());
        }
    }

    #[test]
    fn golden_messages_caller_chat_target() {
        let cx = context(Direction::MessagesToChat, false);
        let whole = answer::whole(&cx, fixture("m2c/target.json").as_bytes()).unwrap();
        golden(
            "m2c/caller.json",
            &(String::from_utf8(whole.to_vec()).unwrap() + "\n"),
        );
        for name in ["target", "truncated.target", "error.target"] {
            let input = fixture(&format!("m2c/{name}.sse"));
            let out = translate(&cx, input.as_bytes(), &[]);
            let expected = format!("m2c/{}.sse", name.replace("target", "caller"));
            golden(&expected, &String::from_utf8(out).unwrap());
        }
    }

    #[test]
    fn no_usage_chunk_unless_asked() {
        let cx = context(Direction::ChatToMessages, false);
        let out = translate(&cx, fixture("c2m/target.sse").as_bytes(), &[]);
        let out = String::from_utf8(out).unwrap();
        assert!(!out.contains("\"usage\""), "{out}");
        assert!(out.ends_with("data: [DONE]\n\n"));
    }

    #[test]
    fn a_stream_cut_short_ends_in_an_error_never_a_success() {
        for (direction, name, success) in [
            (Direction::ChatToMessages, "c2m/target.sse", "[DONE]"),
            (Direction::MessagesToChat, "m2c/target.sse", "message_stop"),
        ] {
            let cx = context(direction, true);
            let input = fixture(name);
            let whole = events(input.as_bytes());
            for keep in 0..whole.len() {
                let cut: Vec<u8> = whole[..keep].iter().flat_map(|e| e.raw.to_vec()).collect();
                let out = String::from_utf8(translate(&cx, &cut, &[])).unwrap();
                assert!(
                    !out.contains(success),
                    "{direction:?} after {keep} events: {out}"
                );
                let last = events(out.as_bytes()).pop().unwrap();
                assert!(
                    String::from_utf8_lossy(&last.raw).contains("upstream_stream_error"),
                    "{direction:?} after {keep} events: {out}"
                );
            }
        }
    }

    #[test]
    fn thinking_is_refused_in_a_stream_as_in_a_whole_answer() {
        let cx = context(Direction::ChatToMessages, false);
        let input = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"m\",\"usage\":{\"input_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\"}}\n\n",
        );
        let out = String::from_utf8(translate(&cx, input.as_bytes(), &[])).unwrap();
        let last = events(out.as_bytes()).pop().unwrap();
        assert!(
            String::from_utf8_lossy(&last.raw).contains("upstream_malformed"),
            "{out}"
        );
        assert_eq!(events(out.as_bytes()).len(), 2, "{out}");
        let whole = json!({"id": "msg_1", "model": "m", "stop_reason": "end_turn",
            "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}],
            "usage": {"input_tokens": 1, "output_tokens": 1}});
        assert!(answer::whole(&cx, whole.to_string().as_bytes()).is_err());
    }

    #[test]
    fn an_azure_opener_is_skipped_and_calls_sent_whole_are_separate_blocks() {
        let cx = context(Direction::MessagesToChat, false);
        let chunk = |delta: Value, finish: Value| {
            sse(
                None,
                &json!({"id": "c", "model": "gemini", "choices": [{"index": 0,
                "delta": delta, "finish_reason": finish}]}),
            )
        };
        let call = |id: &str, name: &str, arguments: &str| {
            json!({"tool_calls": [{"id": id, "type": "function",
                "function": {"name": name, "arguments": arguments}}]})
        };
        let azure = r#"{"choices":[],"created":0,"id":"","model":"","object":"","prompt_filter_results":[]}"#;
        let input = format!("data: {azure}\n\n")
            + &chunk(call("a", "f", "{\"x\":1}"), Value::Null)
            + &chunk(call("b", "g", ""), Value::Null)
            + &chunk(json!({}), json!("tool_calls"))
            + "data: [DONE]\n\n";
        let folded = fold_messages(&translate(&cx, input.as_bytes(), &[])).unwrap();
        assert_eq!(
            (&folded["id"], &folded["model"]),
            (&json!("msg_c"), &json!("gemini"))
        );
        assert_eq!(
            folded["content"],
            json!([{"type": "tool_use", "id": "a", "name": "f", "input": {"x": 1}},
                   {"type": "tool_use", "id": "b", "name": "g", "input": {}}])
        );
    }

    #[test]
    fn a_tool_use_started_with_its_input_keeps_it() {
        let cx = context(Direction::ChatToMessages, false);
        let input = concat!(
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"model\":\"m\"}}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"t\",\"name\":\"f\",\"input\":{\"a\":[1]}}}\n\n",
            "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":3}}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        let folded = fold_chunks(&translate(&cx, input.as_bytes(), &[])).unwrap();
        let call = &folded["choices"][0]["message"]["tool_calls"][0];
        assert_eq!(call["function"]["arguments"], "{\"a\":[1]}");
        assert_eq!(folded["choices"][0]["finish_reason"], "tool_calls");
    }

    // -----------------------------------------------------------------------------------
    // Rendering a whole answer as its stream, and folding a caller's stream back.

    fn sse(name: Option<&str>, data: &Value) -> String {
        String::from_utf8(SseEvent::write(name, data).raw.to_vec()).unwrap()
    }

    /// `text` in pieces of `size` characters.
    fn pieces(text: &str, size: usize) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        chars
            .chunks(size.max(1))
            .map(|c| c.iter().collect())
            .collect()
    }

    /// An Anthropic message as Anthropic streams it.
    fn render_messages(message: &Value, size: usize) -> String {
        let usage = &message["usage"];
        let mut start_usage = usage.clone();
        start_usage["output_tokens"] = json!(1);
        let mut out = sse(
            Some("message_start"),
            &json!({"type": "message_start", "message": {
            "id": message["id"], "type": "message", "role": "assistant", "model": message["model"],
            "content": [], "stop_reason": null, "stop_sequence": null, "usage": start_usage}}),
        );
        out += &sse(Some("ping"), &json!({"type": "ping"}));
        for (index, block) in message["content"].as_array().unwrap().iter().enumerate() {
            let (start, fragments, kind, field) = match block["type"].as_str().unwrap() {
                "text" => (
                    json!({"type": "text", "text": ""}),
                    pieces(block["text"].as_str().unwrap(), size),
                    "text_delta",
                    "text",
                ),
                _ => {
                    let input = block["input"].to_string();
                    let fragments = if input == "{}" {
                        vec![]
                    } else {
                        pieces(&input, size)
                    };
                    (
                        json!({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
                        fragments,
                        "input_json_delta",
                        "partial_json",
                    )
                }
            };
            out += &sse(
                Some("content_block_start"),
                &json!({"type": "content_block_start", "index": index, "content_block": start}),
            );
            for fragment in fragments {
                out += &sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": index, "delta": {"type": kind, field: fragment}}),
                );
            }
            out += &sse(
                Some("content_block_stop"),
                &json!({"type": "content_block_stop", "index": index}),
            );
        }
        out += &sse(
            Some("message_delta"),
            &json!({"type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": null},
            "usage": {"output_tokens": usage["output_tokens"]}}),
        );
        out + &sse(Some("message_stop"), &json!({"type": "message_stop"}))
    }

    /// A chat completion as OpenAI streams it (with `include_usage`).
    fn render_chat(completion: &Value, size: usize) -> String {
        let choice = &completion["choices"][0];
        let message = &choice["message"];
        let chunk = |delta: Value, finish: Value| {
            sse(
                None,
                &json!({"id": completion["id"], "object": "chat.completion.chunk",
                "created": 1, "model": completion["model"],
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]}),
            )
        };
        let mut out = chunk(json!({"role": "assistant", "content": ""}), Value::Null);
        for field in ["content", "refusal"] {
            for piece in pieces(message[field].as_str().unwrap_or(""), size) {
                out += &chunk(json!({ field: piece }), Value::Null);
            }
        }
        for (index, call) in message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            out += &chunk(
                json!({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]}),
                Value::Null,
            );
            for piece in pieces(call["function"]["arguments"].as_str().unwrap(), size) {
                out += &chunk(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                    Value::Null,
                );
            }
        }
        out += &chunk(json!({}), choice["finish_reason"].clone());
        out += &sse(
            None,
            &json!({"id": completion["id"], "object": "chat.completion.chunk",
            "created": 1, "model": completion["model"], "choices": [], "usage": completion["usage"]}),
        );
        out + "data: [DONE]\n\n"
    }

    /// A chat caller's stream folded into a whole answer, checking every chunk.
    fn fold_chunks(bytes: &[u8]) -> Result<Value, String> {
        let (mut id, mut model, mut created) = (None, None, None);
        let (mut content, mut finish, mut usage, mut done) = (String::new(), None, None, false);
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for event in events(bytes) {
            if done {
                return Err("an event after [DONE]".into());
            }
            if event.done {
                done = true;
                continue;
            }
            let chunk = event.json.ok_or("a chunk that is not JSON")?;
            if chunk.get("error").is_some() {
                return Err(format!("error: {chunk}"));
            }
            for (seen, field) in [
                (&mut id, "id"),
                (&mut model, "model"),
                (&mut created, "created"),
            ] {
                let value = chunk[field].clone();
                if seen.get_or_insert_with(|| value.clone()) != &value {
                    return Err(format!("{field} changed"));
                }
            }
            assert_eq!(chunk["object"], "chat.completion.chunk");
            if let Some(u) = chunk.get("usage") {
                usage = Some(u.clone());
            }
            for choice in chunk["choices"].as_array().unwrap() {
                let delta = &choice["delta"];
                content.push_str(delta["content"].as_str().unwrap_or(""));
                for call in delta["tool_calls"].as_array().into_iter().flatten() {
                    let index = call["index"].as_u64().unwrap() as usize;
                    if call.get("id").is_some() {
                        if index != calls.len() {
                            return Err("tool indices do not count from 0".into());
                        }
                        let name = call["function"]["name"].as_str().unwrap().to_string();
                        calls.push((
                            call["id"].as_str().unwrap().to_string(),
                            name,
                            String::new(),
                        ));
                    }
                    let arguments = call["function"]["arguments"].as_str().unwrap_or("");
                    calls
                        .get_mut(index)
                        .ok_or("arguments before id and name")?
                        .2 += arguments;
                }
                if !choice["finish_reason"].is_null() {
                    finish = Some(choice["finish_reason"].clone());
                }
            }
        }
        if !done {
            return Err("no [DONE]".into());
        }
        let mut message = json!({"role": "assistant",
            "content": if content.is_empty() { Value::Null } else { json!(content) }});
        if !calls.is_empty() {
            message["tool_calls"] = calls
                .into_iter()
                .map(|(id, name, arguments)| {
                    json!({
                "id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
                })
                .collect();
        }
        message["refusal"] = Value::Null;
        let mut whole = json!({"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish.ok_or("no finish")?}]});
        if let Some(usage) = usage {
            whole["usage"] = usage;
        }
        Ok(whole)
    }

    /// An Anthropic caller's stream folded into a whole message, checking that every
    /// block start has its stop and indices count from 0.
    fn fold_messages(bytes: &[u8]) -> Result<Value, String> {
        let mut message: Option<Value> = None;
        let mut open: Option<(usize, String)> = None;
        let mut stopped = false;
        for event in events(bytes) {
            if stopped {
                return Err("an event after message_stop".into());
            }
            let data = event.json.ok_or("an event that is not JSON")?;
            let name = String::from_utf8_lossy(&event.raw)
                .lines()
                .next()
                .unwrap_or("")
                .to_string();
            let kind = data["type"].as_str().unwrap_or("").to_string();
            if name != format!("event: {kind}") {
                return Err(format!("event name {name} for {kind}"));
            }
            if kind == "message_start" {
                message = Some(data["message"].clone());
                continue;
            }
            let m = message
                .as_mut()
                .ok_or(format!("{kind} before message_start"))?;
            let content = m["content"].as_array_mut().unwrap();
            match kind.as_str() {
                "content_block_start" => {
                    let index = data["index"].as_u64().unwrap() as usize;
                    if open.is_some() || index != content.len() {
                        return Err(format!("block {index} starts out of order"));
                    }
                    content.push(data["content_block"].clone());
                    open = Some((index, String::new()));
                }
                "content_block_delta" => {
                    let (index, json) = open.as_mut().ok_or("a delta outside a block")?;
                    if data["index"] != json!(*index) {
                        return Err("a delta for another block".into());
                    }
                    match data["delta"]["type"].as_str() {
                        Some("text_delta") => {
                            let text = content[*index]["text"].as_str().unwrap().to_string();
                            content[*index]["text"] =
                                json!(text + data["delta"]["text"].as_str().unwrap());
                        }
                        Some("input_json_delta") => {
                            json.push_str(data["delta"]["partial_json"].as_str().unwrap())
                        }
                        other => return Err(format!("delta {other:?}")),
                    }
                }
                "content_block_stop" => {
                    let (index, json) = open.take().ok_or("a stop outside a block")?;
                    if data["index"] != json!(index) {
                        return Err("a stop for another block".into());
                    }
                    if content[index]["type"] == "tool_use" {
                        content[index]["input"] =
                            serde_json::from_str(&json).map_err(|e| e.to_string())?;
                    } else if content[index]["text"] == "" {
                        return Err("an empty text block".into());
                    }
                }
                "message_delta" => {
                    m["stop_reason"] = data["delta"]["stop_reason"].clone();
                    m["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                    m["usage"] = data["usage"].clone();
                }
                "message_stop" => stopped = true,
                _ => return Err(format!("event {data}")),
            }
        }
        if open.is_some() || !stopped {
            return Err("no message_stop, or a block left open".into());
        }
        message.ok_or_else(|| "no message".into())
    }

    // -----------------------------------------------------------------------------------
    // Generators.

    fn leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            ".{0,8}".prop_map(Value::String),
        ]
    }

    fn object() -> impl Strategy<Value = Value> {
        let value = leaf().prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        });
        prop::collection::btree_map("[a-z_\"\\\\]{1,6}", value, 0..4)
            .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>()))
    }

    fn anthropic_message() -> impl Strategy<Value = Value> {
        let block = prop_oneof![
            ".{0,16}".prop_map(|text| json!({"type": "text", "text": text})),
            ("[a-zA-Z0-9_-]{1,40}", "[a-z_]{1,10}", object()).prop_map(|(id, name, input)| {
                json!({"type": "tool_use", "id": format!("toolu_{id}"), "name": name, "input": input})
            }),
        ];
        let stop = prop::sample::select(vec![
            "end_turn",
            "stop_sequence",
            "max_tokens",
            "tool_use",
            "refusal",
        ]);
        let cache = prop::option::of(0u64..5000);
        (
            "[a-zA-Z0-9]{1,20}",
            prop::collection::vec(block, 0..5),
            stop,
            (0u64..5000, 0u64..5000, cache.clone(), cache),
        )
            .prop_map(|(id, content, stop, (input, output, read, write))| {
                let mut usage = json!({"input_tokens": input, "output_tokens": output});
                if let Some(read) = read {
                    usage["cache_read_input_tokens"] = json!(read);
                }
                if let Some(write) = write {
                    usage["cache_creation_input_tokens"] = json!(write);
                }
                json!({"id": format!("msg_{id}"), "type": "message", "role": "assistant",
                    "model": "claude-sonnet-4-5", "content": content, "stop_reason": stop,
                    "stop_sequence": null, "usage": usage})
            })
    }

    fn chat_completion() -> impl Strategy<Value = Value> {
        let call = (
            prop_oneof!["call_[a-zA-Z0-9]{1,20}", "functions\\.[a-z]{1,6}:[0-9]", ".{1,12}"],
            "[a-z_]{1,10}",
            prop_oneof![Just(String::new()), object().prop_map(|o| o.to_string())],
        )
            .prop_map(|(id, name, arguments)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            });
        let finish = prop::sample::select(vec!["stop", "length", "tool_calls", "content_filter"]);
        (
            "[a-zA-Z0-9-]{1,20}",
            prop::option::of(".{0,16}"),
            prop::option::of(".{1,8}"),
            prop::collection::vec(call, 0..4),
            finish,
            (0u64..5000, 0u64..5000, 0u64..=100),
        )
            .prop_map(|(id, content, refusal, calls, finish, (prompt, completion, percent))| {
                let mut message = json!({"role": "assistant", "content": content, "refusal": refusal});
                if !calls.is_empty() {
                    message["tool_calls"] = json!(calls);
                }
                json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion", "created": 1,
                    "model": "gpt-4o", "choices": [{"index": 0, "message": message,
                    "logprobs": null, "finish_reason": finish}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                        "prompt_tokens_details": {"cached_tokens": prompt * percent / 100}}})
            })
    }

    /// An arbitrary event of either API: known types with arbitrary fields, and noise.
    fn any_event() -> impl Strategy<Value = String> {
        let kind = prop::sample::select(vec![
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
            "ping",
            "error",
            "text",
            "tool_use",
            "text_delta",
            "input_json_delta",
            "thinking",
            "other",
        ]);
        let field = prop::sample::select(vec![
            "message",
            "index",
            "content_block",
            "delta",
            "usage",
            "stop_reason",
            "id",
            "name",
            "model",
            "text",
            "partial_json",
            "choices",
            "tool_calls",
            "content",
            "finish_reason",
            "arguments",
            "function",
            "error",
            "refusal",
            "input",
        ]);
        let value = leaf().prop_recursive(3, 16, 4, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                (
                    prop::collection::vec((field.clone(), inner.clone()), 0..4),
                    kind.clone()
                )
                    .prop_map(|(fields, kind)| {
                        let mut m: Map<String, Value> = fields
                            .into_iter()
                            .map(|(k, v)| (k.to_string(), v))
                            .collect();
                        m.insert("type".into(), json!(kind));
                        Value::Object(m)
                    }),
                (0u32..3).prop_map(|n| json!(n)),
            ]
        });
        prop_oneof![
            8 => value.prop_map(|v| sse(None, &v)),
            1 => Just("data: [DONE]\n\n".to_string()),
            1 => Just(": keep-alive\n\n".to_string()),
            1 => ".{0,10}".prop_map(|s| format!("data: {s}\n\n")),
        ]
    }

    fn without_created(mut answer: Value) -> Value {
        answer["created"] = json!(0);
        answer
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

        /// Anthropic stream → chat chunks, folded, is the whole answer's translation.
        #[test]
        fn chat_stream_folds_into_the_whole_answer(
            message in anthropic_message(),
            size in 1usize..6,
            cuts in prop::collection::vec(any::<usize>(), 0..8),
        ) {
            let cx = context(Direction::ChatToMessages, true);
            let whole = answer::whole(&cx, message.to_string().as_bytes());
            let stream = translate(&cx, render_messages(&message, size).as_bytes(), &cuts);
            match whole {
                Ok(whole) => {
                    let whole: Value = serde_json::from_slice(&whole).unwrap();
                    let folded = fold_chunks(&stream).map_err(TestCaseError::fail)?;
                    prop_assert_eq!(without_created(folded), without_created(whole));
                }
                // The same answer refused whole is refused streamed.
                Err(_) => {
                    let last = events(&stream).pop().unwrap();
                    prop_assert!(String::from_utf8_lossy(&last.raw).contains("upstream_malformed"));
                }
            }
        }

        /// Chat chunks → Anthropic stream, folded, is the whole answer's translation.
        #[test]
        fn messages_stream_folds_into_the_whole_answer(
            completion in chat_completion(),
            size in 1usize..6,
            cuts in prop::collection::vec(any::<usize>(), 0..8),
        ) {
            let cx = context(Direction::MessagesToChat, false);
            let whole = answer::whole(&cx, completion.to_string().as_bytes());
            let stream = translate(&cx, render_chat(&completion, size).as_bytes(), &cuts);
            match whole {
                Ok(whole) => {
                    let whole: Value = serde_json::from_slice(&whole).unwrap();
                    let folded = fold_messages(&stream).map_err(TestCaseError::fail)?;
                    prop_assert_eq!(folded, whole);
                }
                Err(_) => {
                    let last = events(&stream).pop().unwrap();
                    prop_assert!(String::from_utf8_lossy(&last.raw).contains("upstream_malformed"));
                }
            }
        }

        /// Any events at all: never a panic, and the caller's stream ends exactly once,
        /// with its success or one error, and nothing after it.
        #[test]
        fn any_events_end_the_stream_exactly_once(
            input in prop::collection::vec(any_event(), 0..12),
            prefix in prop::sample::select(vec!["", "anthropic", "openai"]),
        ) {
            let mut input = input.concat();
            // Streams that start right, so the fuzz reaches past the first event.
            match prefix {
                "anthropic" => input.insert_str(0, "data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"model\":\"x\"}}\n\n"),
                "openai" => input.insert_str(0, "data: {\"id\":\"c\",\"model\":\"x\",\"choices\":[]}\n\n"),
                _ => {}
            }
            for direction in [Direction::ChatToMessages, Direction::MessagesToChat] {
                let cx = context(direction, true);
                let out = translate(&cx, input.as_bytes(), &[]);
                let out = events(&out);
                let ends = out.iter().filter(|e| {
                    let raw = String::from_utf8_lossy(&e.raw);
                    e.done || raw.starts_with("event: message_stop") || raw.starts_with("event: error")
                        || e.json.as_ref().is_some_and(|j| j.get("error").is_some())
                }).count();
                prop_assert_eq!(ends, 1, "{:?}", out);
                let last = out.last().unwrap();
                let raw = String::from_utf8_lossy(&last.raw);
                prop_assert!(last.done || raw.contains("message_stop") || raw.contains("error"));
            }
        }
    }
}
