//! No call settles for less than the provider bills (hardening v3, money): a stream that
//! ends before its final usage, a translated answer without usage (or with its output
//! alone), `n` choices, and a failover attempt that never connected, each through the
//! real server with the dollars worked out by hand from the catalog's prices (USD per
//! million tokens): Claude Sonnet 4.5 input 3, output 15; gpt-4o input 2.50, output 10.

use serde_json::{json, Value};

use crate::billing::{call, gateway, reporting, spent, CAPPED};
use crate::common::*;

/// Input 2,000, output 5,000 at Claude's prices: 6,000 + 75,000 per million.
const FULL_STREAM_MICRO_USD: i64 = 81_000;

fn long_messages(stream: bool) -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 5000, "stream": stream,
           "messages": [{"role": "user", "content": "write at length"}]})
}

#[tokio::test]
async fn a_claude_stream_cut_before_message_delta_is_charged_its_worst_case() {
    let gw = gateway("max_usd = 5.0", "").await;
    // The upstream breaks after message_start, content_block_start and 19 of 20 text
    // deltas: message_delta (the output count) never comes. Before: charged the input
    // and message_start's one output token, $0.006015.
    let resp = call(
        &gw,
        "/v1/messages",
        "upstream-cut",
        "content=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN;usage=2000/5000;chunks=20;cut=22",
        &long_messages(true),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert_eq!(body.matches("text_delta").count(), 19, "{body}");
    assert!(!body.contains("message_delta"), "{body}");
    // The reported input with the reserved output (5,000), which is also what the
    // provider bills for a call that ran to its cap.
    assert_eq!(
        spent(&gw, "upstream-cut", 1).await,
        (FULL_STREAM_MICRO_USD, 7_000)
    );

    // The client reads 19 deltas and leaves: the same.
    let resp = call(
        &gw,
        "/v1/messages",
        "client-left",
        "content=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN;usage=2000/5000;chunks=20;chunk_delay=30ms",
        &long_messages(true),
    )
    .await;
    assert_eq!(resp.status(), 200);
    read_deltas_then_leave(resp, "text_delta", 19).await;
    assert_eq!(
        spent(&gw, "client-left", 1).await,
        (FULL_STREAM_MICRO_USD, 7_000)
    );

    // A stream that finished is charged what it reported, not its worst case.
    let resp = call(
        &gw,
        "/v1/messages",
        "finished",
        "content=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN;usage=2000/300;chunks=20",
        &long_messages(true),
    )
    .await;
    resp.bytes().await.unwrap();
    assert_eq!(spent(&gw, "finished", 1).await, (6_000 + 4_500, 2_300));

    // The output counts against the cap: with $0.05 left a second such stream, which
    // may cost $0.081, is refused before any attempt.
    let tight = gateway("max_usd = 0.1", "").await;
    let resp = call(
        &tight,
        "/v1/messages",
        "tight",
        "content=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN;usage=2000/5000;chunks=20;cut=22",
        &long_messages(true),
    )
    .await;
    resp.bytes().await.unwrap();
    spent(&tight, "tight", 1).await;
    let resp = call(&tight, "/v1/messages", "tight", "", &long_messages(true)).await;
    assert_eq!(resp.status(), 402);
    assert_eq!(json(resp).await["error"]["type"], "budget_exceeded");
    assert_eq!(tight.mock.attempts("tight"), 1);
}

#[tokio::test]
async fn a_claude_stream_cut_through_the_strategy_switch_is_charged_its_worst_case() {
    let gw = gateway("max_usd = 5.0", "").await;
    // A chat caller answered by a Claude stream (the `to-claude` route), cut before its
    // message_delta: the target's message_start said input 2,000.
    let body = json!({"model": "to-claude", "max_tokens": 5000, "stream": true,
        "messages": [{"role": "user", "content": "write at length"}]});
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "switched-cut",
        "content=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN;usage=2000/5000;chunks=20;cut=22",
        &body,
    )
    .await;
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
    assert_eq!(
        spent(&gw, "switched-cut", 1).await,
        (FULL_STREAM_MICRO_USD, 7_000)
    );
}

/// Reads a streamed answer until `n` events of `kind` have arrived, then drops it.
async fn read_deltas_then_leave(mut resp: reqwest::Response, kind: &str, n: usize) {
    let mut seen = String::new();
    while seen.matches(kind).count() < n {
        let chunk = resp
            .chunk()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("the stream ended early: {seen}"));
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(!seen.contains("message_delta"), "{seen}");
}

/// The reservation's input part is the translated body at four bytes a token: a few
/// hundred tokens at most for these bodies.
const BODY_INPUT_MICRO_USD: std::ops::Range<i64> = 30..3_000;

#[tokio::test]
async fn a_translated_answer_without_usage_is_charged_the_reservation_and_invents_no_counts() {
    let gw = gateway("max_usd = 5.0", "").await;
    // A chat caller answered by Claude (max_tokens 1,024 on the target): the answer
    // carries no usage, a `usage: null`, or counts without the input's.
    for (session, usage) in [
        ("no-counts", json!({})),
        ("null", Value::Null),
        ("output-only", json!({"output_tokens": 50})),
    ] {
        let resp = call(
            &gw,
            "/v1/chat/completions",
            session,
            &reporting(&usage),
            &chat("to-claude").json(),
        )
        .await;
        assert_eq!(resp.status(), 200, "{session}");
        let body = json(resp).await;
        assert!(
            body["choices"][0]["message"]["content"].is_string(),
            "{body}"
        );
        let (usd, _) = spent(&gw, session, 1).await;
        // Before: $0, and the caller was told prompt_tokens 0.
        let output = match session {
            // The output it reported, the input at the reservation's estimate.
            "output-only" => {
                assert!(body["usage"].get("prompt_tokens").is_none(), "{body}");
                assert_eq!(body["usage"]["completion_tokens"], 50, "{body}");
                50 * 15
            }
            // The reservation: its input estimate and 1,024 output tokens at $15.
            _ => {
                assert!(body.get("usage").is_none(), "{session}: {body}");
                1_024 * 15
            }
        };
        assert!(
            BODY_INPUT_MICRO_USD.contains(&(usd - output)),
            "{session}: charged {usd} µ$, output {output} µ$"
        );
    }
}

#[tokio::test]
async fn n_choices_reserve_n_times_the_completion_cap() {
    let gw = gateway("max_usd = 0.05", "").await;
    // Each call: 8 answers of up to 100 tokens; it bills 10 input and 800 output tokens,
    // $0.008025. Before: 100 output tokens reserved, all 20 admitted, $0.16 spent.
    let body = json!({"model": "gpt-4o", "max_tokens": 100, "n": 8,
        "messages": [{"role": "user", "content": "eight ways to say hello"}]});
    let calls = (0..20).map(|_| {
        let body = body.clone();
        let gw = &gw;
        async move {
            let resp = call(gw, "/v1/chat/completions", "eight", "usage=10/800", &body).await;
            let status = resp.status().as_u16();
            let body = json(resp).await;
            (status, body)
        }
    });
    let answers = futures_util::future::join_all(calls).await;
    let served = answers.iter().filter(|(s, _)| *s == 200).count() as u64;
    for (status, body) in &answers {
        if *status != 200 {
            assert_eq!(*status, 402, "{body}");
            assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
        }
    }
    assert_eq!(gw.mock.attempts("eight"), served);
    let (usd, tokens) = spent(&gw, "eight", served).await;
    assert_eq!(usd, served as i64 * 8_025, "{served} served");
    assert_eq!(tokens, served * 810);
    // Each reserves about 8,030 µ$ (800 output tokens at $10 and its input): at most six
    // fit under $0.05, whatever the interleaving; at least five do.
    assert!((5..=6).contains(&served), "{served} served, {usd} µ$ spent");
    assert!(usd <= 50_000);

    // `n` out of range is the caller's mistake: 400 before any attempt.
    let resp = call(
        &gw,
        "/v1/chat/completions",
        "bad-n",
        "",
        &json!({"model": "gpt-4o", "n": 0, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(json(resp).await["error"]["param"], "n");
    assert_eq!(gw.mock.attempts("bad-n"), 0);
}

#[tokio::test]
async fn a_failover_attempt_that_never_connected_is_not_a_call() {
    let gw = gateway(
        "max_calls = 2\nmax_usd = 5.0",
        r#"
[[upstreams]]
name = "never-up"
api = "openai"
base_url = "http://127.0.0.1:1"

[[routes]]
model = "failover"
targets = [{ upstream = "never-up", model = "gpt-4o" }, { upstream = "mock-openai", model = "gpt-4o" }]
"#,
    )
    .await;
    // Two requests, each first tried on an upstream nobody listens on, then served.
    // Before: each refused connection was booked as a call ($0), so the second request
    // was refused by `max_calls = 2`.
    for _ in 0..2 {
        let resp = call(
            &gw,
            "/v1/chat/completions",
            "failover",
            "usage=10/10",
            &chat("failover").json(),
        )
        .await;
        assert_eq!(resp.status(), 200);
        json(resp).await;
    }
    assert_eq!(gw.mock.attempts("failover"), 2);
    // 2 × (10 × 2.50 + 10 × 10).
    assert_eq!(spent(&gw, "failover", 2).await, (250, 40));
    let calls = gw
        .get_json("/admin/tenants/capped/sessions/failover", Some(ADMIN))
        .await;
    assert_eq!(calls["used"]["calls"], 2, "{calls}");
}

#[tokio::test]
async fn a_background_response_settles_once_when_its_usage_appears() {
    let gw = gateway("max_usd = 5.0", "").await;
    let create = json!({"model": "gpt-4o", "input": "write a report", "background": true});
    let resp = call(&gw, "/v1/responses", "bg", "", &create).await;
    assert_eq!(resp.status(), 200);
    let queued = json(resp).await;
    assert_eq!(queued["status"], "queued", "{queued}");
    let id = queued["id"].as_str().unwrap().to_string();
    // Held, not settled: the session has no settled call yet, and holds the reservation
    // (before: charged its reservation at once, the real usage never).
    let path = "/admin/tenants/capped/sessions/bg";
    let held = gw.get_json(path, Some(ADMIN)).await;
    assert_eq!(held["used"]["calls"], 0, "{held}");
    // The GET that shows it finished settles it: 1,000 × 2.50 + 200 × 10.
    for _ in 0..2 {
        let resp = gw
            .http
            .get(format!("{}/v1/responses/{id}", gw.url))
            .bearer_auth(CAPPED)
            .header("x-mock-scenario", "bg")
            .header("x-mock-fault", "usage=1000/200")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(json(resp).await["status"], "completed");
    }
    // Once: a second settle would make it two calls (a settle applies to the books
    // before its GET is answered).
    assert_eq!(spent(&gw, "bg", 1).await, (4_500, 1_200));

    // Until then it holds the model's whole output (gpt-4o: 16,384 tokens at $10, about
    // $0.164) when `max_output_tokens` is unset: more than a $0.10 cap.
    let tight = gateway("max_usd = 0.1", "").await;
    let resp = call(&tight, "/v1/responses", "bg-tight", "", &create).await;
    assert_eq!(resp.status(), 402);
    assert_eq!(tight.mock.attempts("bg-tight"), 0);

    // `billing.background = "refuse"`: a USD-capped session cannot start one.
    let refusing = gateway("max_usd = 5.0", "[billing]\nbackground = \"refuse\"").await;
    let resp = call(&refusing, "/v1/responses", "bg-refused", "", &create).await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["param"], "background", "{body}");
    assert_eq!(refusing.mock.attempts("bg-refused"), 0);
}
