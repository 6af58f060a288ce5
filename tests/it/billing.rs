//! Money as the provider bills it, end to end: usage payloads as Anthropic and OpenAI send
//! them (whole and streamed, prompt-cache writes and reads, cached input), priced at the
//! built-in catalog's published prices on their own lines, to the micro-dollar; a
//! translated answer priced on the target's own usage; an unpriced model refused under
//! a USD cap before any attempt; an image reserved by its token cost, not its base64
//! size; and a caching agent that never spends past its cap in provider dollars.
//!
//! Every expected dollar figure is worked out by hand in the test from the price sheet
//! (USD per million tokens): Claude Sonnet 4.5 input 3, 5-minute cache write 3.75,
//! 1-hour write 6, cache read 0.30, output 15; gpt-4o input 2.50, cached input 1.25,
//! output 10.

use base64::Engine;
use serde_json::{json, Value};

use crate::common::*;

pub(crate) const CAPPED: &str = "bk-billing-key-01";
pub(crate) const UNCAPPED: &str = "bk-billing-key-02";

/// The issue's turn: input 100, cache write 20,000, cache read 80,000, output 500.
fn caching_turn() -> Value {
    json!({"input_tokens": 100, "cache_creation_input_tokens": 20_000,
           "cache_read_input_tokens": 80_000, "output_tokens": 500,
           "cache_creation": {"ephemeral_5m_input_tokens": 20_000, "ephemeral_1h_input_tokens": 0},
           "service_tier": "standard"})
}

/// 100 × 3 + 20,000 × 3.75 + 80,000 × 0.30 + 500 × 15 = 106,800 per million.
const CACHING_TURN_MICRO_USD: i64 = 106_800;
/// 100 + 20,000 + 80,000 + 500: every token the provider processed.
const CACHING_TURN_TOKENS: u64 = 100_600;

/// The mock's script for an answer reporting exactly `usage`.
pub(crate) fn reporting(usage: &Value) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(usage.to_string());
    format!("usage_b64={b64}")
}

/// A gateway pricing from the catalog alone: a `capped` tenant with `session` limits
/// (and the admin API), an `uncapped` one, and `extra` config merged in.
pub(crate) async fn gateway(session: &str, extra: &str) -> Gateway {
    let (session, extra) = (session.to_string(), extra.to_string());
    start_with(move |config| {
        config
            .merge(&format!(
                r#"
[admin]
token = "{ADMIN}"

[server]
max_body_bytes = 8388608

[[routes]]
model = "to-claude"
targets = [{{ upstream = "mock-anthropic", model = "claude-sonnet-4-5", max_tokens = 1024 }}]

[[routes]]
model = "mystery-model"
targets = [{{ upstream = "mock-openai" }}]

[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
{session}

[[tenants]]
name = "uncapped"
api_keys = ["{UNCAPPED}"]
"#
            ))
            .merge(&extra)
    })
    .await
}

/// POSTs `body` to `path` as the capped tenant in `session`, the mock playing `fault`.
pub(crate) async fn call(
    gw: &Gateway,
    path: &str,
    session: &str,
    fault: &str,
    body: &Value,
) -> reqwest::Response {
    gw.post(
        path,
        Some(CAPPED),
        &[
            ("x-session-id", session),
            ("x-mock-scenario", session),
            ("x-mock-fault", fault),
        ],
        body.to_string(),
    )
    .await
}

/// The session's spend once `calls` calls have settled: (micro-dollars, tokens).
pub(crate) async fn spent(gw: &Gateway, session: &str, calls: u64) -> (i64, u64) {
    let path = format!("/admin/tenants/capped/sessions/{session}");
    let report = until_some(&format!("{calls} settled calls in {session}"), || async {
        let report = gw.get_json(&path, Some(ADMIN)).await;
        (report["used"]["calls"] == json!(calls)).then_some(report)
    })
    .await;
    let usd = report["used"]["usd"].as_f64().unwrap();
    (
        (usd * 1e6).round() as i64,
        report["used"]["tokens"].as_u64().unwrap(),
    )
}

pub(crate) fn messages(model: &str, stream: bool) -> Value {
    json!({"model": model, "max_tokens": 1024, "stream": stream,
           "messages": [{"role": "user", "content": "hello"}]})
}

#[tokio::test]
async fn anthropic_cache_writes_and_reads_are_priced_on_their_own_lines_whole_and_streamed() {
    let gw = gateway("max_usd = 5.0", "").await;
    let fault = reporting(&caching_turn());
    for (session, stream) in [("whole", false), ("streamed", true)] {
        let resp = call(
            &gw,
            "/v1/messages",
            session,
            &fault,
            &messages("claude-sonnet-4-5", stream),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let body = resp.text().await.unwrap();
        assert!(body.contains("cache_read_input_tokens"), "{body}");
        assert_eq!(
            spent(&gw, session, 1).await,
            (CACHING_TURN_MICRO_USD, CACHING_TURN_TOKENS),
            "{session}: before, $0.0078 and 600 tokens"
        );
    }
    // One hour's writes at $6: 100 × 3 + 20,000 × 6 + 80,000 × 0.3 + 500 × 15.
    let hour = json!({"input_tokens": 100, "cache_creation_input_tokens": 20_000,
        "cache_read_input_tokens": 80_000, "output_tokens": 500,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 20_000}});
    for (session, stream) in [("hour", false), ("hour-streamed", true)] {
        let resp = call(
            &gw,
            "/v1/messages",
            session,
            &reporting(&hour),
            &messages("claude-sonnet-4-5", stream),
        )
        .await;
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        assert_eq!(
            spent(&gw, session, 1).await,
            (151_800, CACHING_TURN_TOKENS),
            "{session}"
        );
    }
    // Each kind reaches the metrics on its own label.
    let metrics = gw.metrics().await;
    for kind in [
        "input",
        "cache_write_5m",
        "cache_write_1h",
        "cache_read",
        "output",
    ] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("backstop_tokens_total{")
                    && l.contains(&format!("kind=\"{kind}\""))
                    && l.contains("tenant=\"capped\"")),
            "{kind}: {metrics}"
        );
    }
}

#[tokio::test]
async fn openai_cached_input_is_charged_at_the_cached_price_on_every_endpoint() {
    let gw = gateway("max_usd = 5.0", "").await;
    // Prompt 10,000 of which 8,000 cached, completion 100 (60 of it reasoning):
    // 2,000 × 2.50 + 8,000 × 1.25 + 100 × 10 = 16,000 per million (before: $0.026).
    let chat_usage = json!({"prompt_tokens": 10_000, "completion_tokens": 100, "total_tokens": 10_100,
        "prompt_tokens_details": {"cached_tokens": 8_000, "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 60, "audio_tokens": 0}});
    let fault = reporting(&chat_usage);
    for (session, body) in [
        ("chat", chat("gpt-4o").max_tokens(100).json()),
        (
            "chat-streamed",
            json!({"model": "gpt-4o", "max_tokens": 100, "stream": true,
                   "stream_options": {"include_usage": true},
                   "messages": [{"role": "user", "content": "hello"}]}),
        ),
    ] {
        let resp = call(&gw, "/v1/chat/completions", session, &fault, &body).await;
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        assert_eq!(spent(&gw, session, 1).await, (16_000, 10_100), "{session}");
    }
    // The Responses API names the same counts its own way.
    let responses_usage = json!({"input_tokens": 10_000, "input_tokens_details": {"cached_tokens": 8_000},
        "output_tokens": 100, "output_tokens_details": {"reasoning_tokens": 60}, "total_tokens": 10_100});
    for (session, stream) in [("responses", false), ("responses-streamed", true)] {
        let body = json!({"model": "gpt-4o", "input": "hello", "max_output_tokens": 100, "stream": stream});
        let resp = call(
            &gw,
            "/v1/responses",
            session,
            &reporting(&responses_usage),
            &body,
        )
        .await;
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        assert_eq!(spent(&gw, session, 1).await, (16_000, 10_100), "{session}");
    }
    let metrics = gw.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("backstop_tokens_total{")
                && l.contains("kind=\"reasoning\"")
                && l.ends_with(" 240")),
        "four calls of 60 reasoning tokens: {metrics}"
    );
}

#[tokio::test]
async fn a_translated_call_is_priced_on_the_targets_own_usage() {
    let gw = gateway("max_usd = 5.0", "").await;
    let fault = reporting(&caching_turn());
    // An OpenAI caller answered by Claude: the target's cache kinds, priced as Claude
    // bills them (before: $0.3078, the cache folded into prompt_tokens at full price).
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "switched",
        &fault,
        &chat("to-claude").json(),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    // The caller is told the whole prompt, its cached part in OpenAI's own field.
    assert_eq!(body["usage"]["prompt_tokens"], 100_100, "{body}");
    assert_eq!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"], 80_000,
        "{body}"
    );
    assert_eq!(
        spent(&gw, "switched", 1).await,
        (CACHING_TURN_MICRO_USD, CACHING_TURN_TOKENS)
    );
    let streamed = json!({"model": "to-claude", "stream": true,
        "messages": [{"role": "user", "content": "hello"}]});
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "switched-streamed",
        &fault,
        &streamed,
    )
    .await;
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    assert_eq!(
        spent(&gw, "switched-streamed", 1).await,
        (CACHING_TURN_MICRO_USD, CACHING_TURN_TOKENS)
    );
}

#[tokio::test]
async fn an_unpriced_model_is_refused_under_a_usd_cap_before_any_attempt() {
    let gw = gateway("max_usd = 0.5", "").await;
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "unpriced",
        "",
        &chat("mystery-model").json(),
    )
    .await;
    assert_eq!(resp.status(), 402);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "unpriced_model", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("mystery-model"),
        "{body}"
    );
    assert_eq!(
        gw.mock.attempts("unpriced"),
        0,
        "refused before any attempt"
    );
    // Without a USD cap it is served (and costs nothing anyone can price).
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(UNCAPPED),
            &[("x-session-id", "free"), ("x-mock-scenario", "uncapped")],
            chat("mystery-model").json().to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.mock.attempts("uncapped"), 1);
    // Models nobody configured are priced by the catalog: not free.
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "mini",
        "usage=1000000/1000000",
        &chat("gpt-4o-mini").json(),
    )
    .await;
    assert_eq!(resp.status(), 200);
    // 1M × 0.15 + 1M × 0.60: before, $0.
    assert_eq!(spent(&gw, "mini", 1).await, (750_000, 2_000_000));

    // "free" is an explicit choice.
    let gw = gateway("max_usd = 0.5", "[billing]\nunpriced = \"free\"").await;
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "chosen",
        "usage=10/10",
        &chat("mystery-model").json(),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(spent(&gw, "chosen", 1).await, (0, 20));
}

/// A PNG of `width`×`height`: its signature and IHDR, then `filler` bytes of data, as
/// base64 (the pixels are never read).
fn png(width: u32, height: u32, filler: usize) -> String {
    let mut bytes = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR".to_vec();
    bytes.extend_from_slice(&width.to_be_bytes());
    bytes.extend_from_slice(&height.to_be_bytes());
    bytes.extend_from_slice(&[8, 6, 0, 0, 0, 0, 0, 0, 0]);
    bytes.resize(bytes.len() + filler, 0x5a);
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[tokio::test]
async fn an_image_is_reserved_by_its_token_cost_not_its_base64_size() {
    let gw = gateway("max_usd = 0.5", "").await;
    // 4.2 MB of base64 for a 1024×1024 image: 1,399 tokens on Claude.
    let data = png(1024, 1024, 3_150_000);
    assert!(data.len() >= 4_200_000, "{}", data.len());
    let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "What is in this image?"}]}]});
    let resp = call(&gw, "/v1/messages", "vision", "usage=1420/50", &body).await;
    assert_eq!(
        resp.status(),
        200,
        "before: refused, \"this call needs 3.1518\""
    );
    resp.bytes().await.unwrap();
    // What it reserved, read from a cap it does not fit: the image's 1,399 tokens and
    // the text around it at four bytes a token, at $3, plus 100 output tokens at $15.
    let tight = gateway("max_usd = 0.001", "").await;
    let resp = call(&tight, "/v1/messages", "vision-refused", "", &body).await;
    assert_eq!(resp.status(), 402);
    let refusal = json(resp).await;
    let message = refusal["error"]["message"].as_str().unwrap().to_string();
    let needs: f64 = message
        .split("needs ")
        .nth(1)
        .and_then(|rest| {
            rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                .next()
        })
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no amount in {message}"));
    let image_only = (1_399.0 * 3.0 + 100.0 * 15.0) / 1e6;
    assert!(
        (image_only..image_only + 0.0003).contains(&needs),
        "reserved {needs}, the image alone {image_only}: {message}"
    );
    assert_eq!(tight.mock.attempts("vision-refused"), 0);
    // The same image as OpenAI chat takes it, at OpenAI's rule: 765 tokens at high detail.
    let url = format!("data:image/png;base64,{}", png(1024, 1024, 3_150_000));
    let body = json!({"model": "gpt-4o", "max_tokens": 100, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
        {"type": "text", "text": "What is in this image?"}]}]});
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "vision-openai",
        "usage=800/50",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
}

/// One turn of a caching agent: a ~115k-token system prompt marked for caching (460 KB
/// in the body), and the turn's question.
fn agent_turn(system: &str, turn: usize) -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 1024,
           "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
           "messages": [{"role": "user", "content": format!("step {turn}")}]})
}

#[tokio::test]
async fn a_caching_agent_never_spends_past_its_cap_in_provider_dollars() {
    let system = "You are a careful coding agent. ".repeat(14_400);
    let fault = reporting(&caching_turn());
    // Each turn bills $0.1068. Each reserves its worst case: the ~115k prompt written to
    // the cache at $3.75 plus 1,024 output tokens at $15, about $0.446.
    for (cap, served) in [(0.5, 1), (1.0, 6), (2.0, 12)] {
        let gw = gateway(&format!("max_usd = {cap}"), "").await;
        let session = format!("agent-{cap}");
        let mut admitted = 0;
        for turn in 0..12 {
            let resp = call(
                &gw,
                "/v1/messages",
                &session,
                &fault,
                &agent_turn(&system, turn),
            )
            .await;
            match resp.status().as_u16() {
                200 => {
                    admitted += 1;
                    resp.bytes().await.unwrap();
                }
                402 => {
                    let body = json(resp).await;
                    assert_eq!(body["error"]["type"], "budget_exceeded", "{body}");
                }
                other => panic!("turn {turn}: {other}"),
            }
        }
        assert_eq!(
            admitted, served,
            "cap {cap}: before, all 12 were served ($1.28)"
        );
        assert_eq!(
            gw.mock.attempts(&session),
            served as u64,
            "refusals never reach the upstream"
        );
        let (micro, tokens) = spent(&gw, &session, served as u64).await;
        assert_eq!(micro, CACHING_TURN_MICRO_USD * served as i64, "cap {cap}");
        assert_eq!(tokens, CACHING_TURN_TOKENS * served as u64);
        assert!(
            micro as f64 / 1e6 <= cap,
            "never past the cap in provider dollars"
        );
    }
}

#[tokio::test]
async fn the_admin_views_carry_every_kind() {
    let gw = gateway("max_usd = 5.0", "").await;
    let resp = call(
        &gw,
        "/v1/messages",
        "views",
        &reporting(&caching_turn()),
        &messages("claude-sonnet-4-5", false),
    )
    .await;
    assert_eq!(resp.status(), 200);
    spent(&gw, "views", 1).await;
    let days = gw
        .get_json("/admin/tenants/capped?days=1", Some(ADMIN))
        .await;
    let row = days["by_day"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["model"] == "claude-sonnet-4-5"))
        .unwrap_or_else(|| panic!("{days}"));
    assert_eq!(row["input_tokens"], 100, "{row}");
    assert_eq!(row["cache_write_tokens"], 20_000, "{row}");
    assert_eq!(row["cache_read_tokens"], 80_000, "{row}");
    assert_eq!(row["output_tokens"], 500, "{row}");
    assert_eq!(row["tokens"], CACHING_TURN_TOKENS, "{row}");
}
