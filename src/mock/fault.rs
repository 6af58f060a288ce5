use std::time::Duration;

/// What the mock does for one attempt. Parsed from one step of `x-mock-fault`, whose
/// tokens are `;`-separated:
///
/// | token | effect |
/// |---|---|
/// | `ok` | a normal answer (the default) |
/// | `status=503` | an error with that status, body in the API's error shape |
/// | `code=insufficient_quota` | the error code/type in that body |
/// | `retry_after=1` / `retry_after_ms=500` | `Retry-After` / `retry-after-ms` headers |
/// | `delay=200ms` | wait before answering |
/// | `hang` | never answer |
/// | `hold=NAME` | wait until `POST /mock/release?hold=NAME` (at once if it came already), then play the rest: a call kept in flight exactly as long as a test needs |
/// | `reset` | drop the connection before any response |
/// | `invalid_json` | 200 with a body that is not JSON |
/// | `content=TEXT` | the answer's text instead of the echo (no `,` or `;` inside) |
/// | `content_b64=B64` | the answer's text, base64 (for JSON answers) |
/// | `tool=NAME` / `tool_args_b64=B64` | answer with a call to tool NAME with these arguments |
/// | `cut=N` | a stream that breaks after N chunks |
/// | `exception=NAME` | Bedrock: a stream that ends with exception frame NAME (`throttlingException`) after `cut` events (default 1) |
/// | `usage=IN/OUT` | the token usage reported |
/// | `usage_b64=B64` | the answer's `usage` value, exactly this JSON (base64): cache and reasoning counts, odd shapes some servers send; a stream reports it where the API does (Anthropic's split between `message_start` and `message_delta`) |
/// | `chunks=N` / `chunk_delay=50ms` | how a stream is cut up and paced |
/// | `status=307;location=URL` | a redirect (Backstop must not follow it) |
/// | `header=NAME:VALUE` | an extra response header (repeatable; forging tests) |
/// | `pad=N` | N more bytes of answer text (oversized bodies) |
/// | `stop=REASON` | the answer's `stop_reason` / `finish_reason`, whole and streamed (`pause_turn`; `stop` beside a tool call, as vLLM and Ollama send) |
/// | `plain` | answer a streaming request with plain JSON |
/// | `endless` | a stream that never ends (an event every `chunk_delay`, default 10ms) |
/// | `drip=1s` | after the first event, one byte per interval, never a whole event |
/// | `huge_event=N` | after the first event, an event of N bytes that never ends |
/// | `events_b64=B64` | a streaming request gets exactly these raw SSE bytes (base64), one event per write, paced by `chunk_delay` |
///
/// With `tool=NAME`, a streaming request gets the call in the API's own framing, its
/// arguments cut into `chunks` argument deltas; with `content=`/`content_b64=` as well,
/// the answer is that text first, then the call. The tokens below add to an answer:
///
/// | token | effect |
/// |---|---|
/// | `thinking=TEXT` / `thinking_b64=B64` | Anthropic: a `thinking` block first, signed with [`thinking_signature`]; streamed as `thinking_delta`s and one `signature_delta` |
/// | `redacted_thinking=DATA` | Anthropic: a `redacted_thinking` block (after the thinking block), streamed whole |
/// | `reasoning=TEXT` / `reasoning_b64=B64` | chat: `reasoning_content` (streamed before any content or tool delta); Responses: a `reasoning` item first, with a summary and `encrypted_content` |
/// | `future` | fields and events from a future API version: every streamed event/chunk and non-streamed body gains `"x_future":{"n":1}`; Anthropic and Responses streams get an event of an unknown type after the first event; chat chunks also gain `service_tier`, `system_fingerprint`, `obfuscation` and `choices[].logprobs` |
///
/// Anthropic requests whose assistant messages carry a `thinking` block are checked: a
/// signature other than [`thinking_signature`] of its text is answered 400
/// `invalid_request_error`, as a real Claude rejects an altered thinking block (scripted
/// errors come first).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct FaultStep {
    pub status: Option<u16>,
    pub code: Option<String>,
    /// The request field an error names (`param=`): OpenAI's `param`, the start of
    /// Anthropic's message.
    pub param: Option<String>,
    pub retry_after: Option<String>,
    pub retry_after_ms: Option<u64>,
    pub delay: Option<Duration>,
    pub hang: bool,
    /// `hold`: the name of the hold this attempt waits on.
    pub hold: Option<String>,
    pub reset: bool,
    pub invalid_json: bool,
    pub content: Option<String>,
    pub tool: Option<String>,
    pub tool_args: Option<String>,
    pub cut: Option<usize>,
    pub usage: Option<(u64, u64)>,
    /// `usage_b64`: the `usage` of a whole (not streamed) answer, as given.
    pub usage_json: Option<serde_json::Value>,
    pub chunks: Option<usize>,
    pub chunk_delay: Option<Duration>,
    pub location: Option<String>,
    pub headers: Vec<(String, String)>,
    pub pad: Option<usize>,
    pub plain: bool,
    /// `stop`: the stop reason or finish reason, instead of the one the answer implies.
    pub stop: Option<String>,
    pub endless: bool,
    pub drip: Option<Duration>,
    pub huge_event: Option<usize>,
    pub thinking: Option<String>,
    pub redacted_thinking: Option<String>,
    pub reasoning: Option<String>,
    pub future: bool,
    /// Raw SSE bytes to stream verbatim (`events_b64`).
    pub events: Option<Vec<u8>>,
    /// Bedrock: the exception frame a stream ends with after `cut` events.
    pub exception: Option<String>,
}

impl FaultStep {
    /// The step for the `attempt`-th (0-based) call of a scenario; the last step repeats.
    pub fn for_attempt(script: &str, attempt: u64) -> FaultStep {
        let steps: Vec<&str> = script.split(',').collect();
        let index = (attempt as usize).min(steps.len().saturating_sub(1));
        FaultStep::parse(steps.get(index).copied().unwrap_or(""))
    }

    /// Unknown tokens are ignored, so a typo degrades to a normal answer rather than
    /// a mock that cannot answer.
    pub fn parse(step: &str) -> FaultStep {
        let mut out = FaultStep::default();
        for token in step.split(';').map(str::trim).filter(|t| !t.is_empty()) {
            let (key, value) = token.split_once('=').unwrap_or((token, ""));
            match key {
                "status" => out.status = value.parse().ok(),
                "code" => out.code = Some(value.to_string()),
                "param" => out.param = Some(value.to_string()),
                "retry_after" => out.retry_after = Some(value.to_string()),
                "retry_after_ms" => out.retry_after_ms = value.parse().ok(),
                "delay" => out.delay = humantime::parse_duration(value).ok(),
                "hang" => out.hang = true,
                "hold" => out.hold = Some(value.to_string()),
                "reset" => out.reset = true,
                "invalid_json" => out.invalid_json = true,
                "content" => out.content = Some(value.to_string()),
                "content_b64" => out.content = decode_b64(value),
                "tool" => out.tool = Some(value.to_string()),
                "tool_args_b64" => out.tool_args = decode_b64(value),
                "cut" => out.cut = value.parse().ok(),
                "exception" => out.exception = Some(value.to_string()),
                "usage" => {
                    out.usage = value
                        .split_once('/')
                        .and_then(|(i, o)| Some((i.parse().ok()?, o.parse().ok()?)))
                }
                "usage_b64" => {
                    out.usage_json = decode_b64(value).and_then(|v| serde_json::from_str(&v).ok())
                }
                "chunks" => out.chunks = value.parse().ok().filter(|n| *n > 0),
                "chunk_delay" => out.chunk_delay = humantime::parse_duration(value).ok(),
                "location" => out.location = Some(value.to_string()),
                "header" => {
                    if let Some((name, value)) = value.split_once(':') {
                        out.headers.push((name.trim().into(), value.trim().into()));
                    }
                }
                "pad" => out.pad = value.parse().ok(),
                "plain" => out.plain = true,
                "stop" => out.stop = Some(value.to_string()),
                "endless" => out.endless = true,
                "drip" => out.drip = humantime::parse_duration(value).ok(),
                "huge_event" => out.huge_event = value.parse().ok(),
                "thinking" => out.thinking = Some(value.to_string()),
                "thinking_b64" => out.thinking = decode_b64(value),
                "redacted_thinking" => out.redacted_thinking = Some(value.to_string()),
                "reasoning" => out.reasoning = Some(value.to_string()),
                "reasoning_b64" => out.reasoning = decode_b64(value),
                "future" => out.future = true,
                "events_b64" => out.events = decode_b64_bytes(value),
                _ => {}
            }
        }
        out
    }
}

/// A random mix of steps for fault storms: `STEP@P|STEP@P|...`, e.g.
/// `status=503@0.2|status=429;retry_after=1@0.1|reset@0.05|hang@0.05`. Whatever
/// probability is left over plays a normal answer.
#[derive(Debug, Default, Clone)]
pub struct FaultMix {
    /// (cumulative probability, step), ascending.
    steps: Vec<(f64, FaultStep)>,
}

impl FaultMix {
    pub fn parse(spec: &str) -> Result<FaultMix, String> {
        let mut steps = Vec::new();
        let mut total = 0.0;
        for entry in spec.split('|').map(str::trim).filter(|e| !e.is_empty()) {
            let (step, p) = entry
                .rsplit_once('@')
                .ok_or_else(|| format!("{entry:?}: expected STEP@PROBABILITY"))?;
            let p: f64 = p
                .parse()
                .map_err(|_| format!("{entry:?}: bad probability"))?;
            if !(0.0..=1.0).contains(&p) {
                return Err(format!("{entry:?}: probability must be within 0..=1"));
            }
            total += p;
            steps.push((total, FaultStep::parse(step)));
        }
        if total > 1.0 + 1e-9 {
            return Err(format!("probabilities add up to {total}, more than 1"));
        }
        Ok(FaultMix { steps })
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The step for a draw `unit` ∈ [0, 1).
    pub fn pick(&self, unit: f64) -> FaultStep {
        self.steps
            .iter()
            .find(|(cumulative, _)| unit < *cumulative)
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    }
}

/// The signature of a mock thinking block: base64 of SHA-256 of
/// `"mock-signature:" + TEXT`. Deterministic, so the mock can check it on the next turn.
pub fn thinking_signature(text: &str) -> String {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("mock-signature:{text}").as_bytes());
    base64::engine::general_purpose::STANDARD.encode(digest)
}

fn decode_b64(value: &str) -> Option<String> {
    String::from_utf8(decode_b64_bytes(value)?).ok()
}

fn decode_b64_bytes(value: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(value)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(value))
        .ok()
}

/// The events of a raw SSE body, each with its blank-line terminator (a trailing
/// unterminated piece is its own last event), for writing one event at a time.
pub fn split_events(raw: &[u8]) -> Vec<bytes::Bytes> {
    let mut events = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < raw.len() {
        if raw[i] == b'\n' && raw[i + 1] == b'\n' {
            events.push(bytes::Bytes::copy_from_slice(&raw[start..i + 2]));
            start = i + 2;
            i = start;
        } else {
            i += 1;
        }
    }
    if start < raw.len() {
        events.push(bytes::Bytes::copy_from_slice(&raw[start..]));
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_follow_attempts_and_the_last_repeats() {
        let script = "status=503;retry_after=1,reset,ok";
        assert_eq!(FaultStep::for_attempt(script, 0).status, Some(503));
        assert_eq!(
            FaultStep::for_attempt(script, 0).retry_after.as_deref(),
            Some("1")
        );
        assert!(FaultStep::for_attempt(script, 1).reset);
        assert_eq!(FaultStep::for_attempt(script, 2), FaultStep::default());
        assert_eq!(FaultStep::for_attempt(script, 9), FaultStep::default());
    }

    #[test]
    fn a_mix_picks_by_cumulative_probability() {
        let mix =
            FaultMix::parse("status=503@0.2|status=429;retry_after=1@0.1|reset@0.05").unwrap();
        assert_eq!(mix.pick(0.0).status, Some(503));
        assert_eq!(mix.pick(0.19).status, Some(503));
        assert_eq!(mix.pick(0.2).retry_after.as_deref(), Some("1"));
        assert!(mix.pick(0.31).reset);
        assert_eq!(mix.pick(0.36), FaultStep::default());
        assert!(FaultMix::parse("reset@0.7|hang@0.7").is_err());
        assert!(FaultMix::parse("reset").is_err());
    }

    #[test]
    fn scripted_json_content_and_tool_calls() {
        let s = FaultStep::parse("content_b64=eyJhIjogMSwgImIiOiAyfQ==;tool=get_weather;tool_args_b64=eyJjaXR5IjoiUGFyaXMifQ==");
        assert_eq!(s.content.as_deref(), Some(r#"{"a": 1, "b": 2}"#));
        assert_eq!(s.tool.as_deref(), Some("get_weather"));
        assert_eq!(s.tool_args.as_deref(), Some(r#"{"city":"Paris"}"#));
    }

    #[test]
    fn tokens_parse() {
        let s = FaultStep::parse(
            "delay=150ms; usage=10/20; cut=2; chunks=7; code=insufficient_quota; hang; hold=h",
        );
        assert_eq!(s.delay, Some(Duration::from_millis(150)));
        assert_eq!(s.hold.as_deref(), Some("h"));
        assert_eq!(s.usage, Some((10, 20)));
        assert_eq!(s.cut, Some(2));
        assert_eq!(s.chunks, Some(7));
        assert_eq!(s.code.as_deref(), Some("insufficient_quota"));
        assert!(s.hang);
    }

    #[test]
    fn thinking_reasoning_and_future_tokens_parse() {
        let s = FaultStep::parse(
            "thinking_b64=aG1tLCAyKzI=;redacted_thinking=EmwKAhgB==;reasoning=why;future",
        );
        assert_eq!(s.thinking.as_deref(), Some("hmm, 2+2"));
        assert_eq!(s.redacted_thinking.as_deref(), Some("EmwKAhgB=="));
        assert_eq!(s.reasoning.as_deref(), Some("why"));
        assert!(s.future);
        let s = FaultStep::parse("thinking=plan;reasoning_b64=d2h5");
        assert_eq!(s.thinking.as_deref(), Some("plan"));
        assert_eq!(s.reasoning.as_deref(), Some("why"));
        assert_eq!(thinking_signature("plan"), thinking_signature("plan"));
        assert_ne!(thinking_signature("plan"), thinking_signature("plan!"));
    }

    #[test]
    fn raw_events_parse_and_split_per_event() {
        // "data: {}\n\nevent: x\ndata: 1\n\n", standard base64 with padding.
        let s =
            FaultStep::parse("events_b64=ZGF0YToge30KCmV2ZW50OiB4CmRhdGE6IDEKCg==;chunk_delay=5ms");
        let raw = s.events.expect("decoded");
        assert_eq!(raw, b"data: {}\n\nevent: x\ndata: 1\n\n");
        assert_eq!(s.chunk_delay, Some(Duration::from_millis(5)));
        let events = split_events(&raw);
        assert_eq!(
            events,
            vec![&b"data: {}\n\n"[..], &b"event: x\ndata: 1\n\n"[..]]
        );
        assert_eq!(
            split_events(b"data: a\n\ndata: b"),
            vec![&b"data: a\n\n"[..], &b"data: b"[..]]
        );
        assert_eq!(FaultStep::parse("events_b64=%%%").events, None);
    }
}
