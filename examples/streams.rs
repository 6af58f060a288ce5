//! Streams with tools attached, direct vs through Backstop, in the same run: time to the
//! first body chunk, to the first content (a text delta, or the first piece of a tool
//! call) and to the last chunk. Starts the mock upstream and a gateway as separate
//! processes from a (release) `backstop` binary.
//!
//!     cargo build --release && cargo run --release --example streams -- [STREAMS] [CONCURRENCY]
//!
//! Every stream is 5 chunks 50 ms apart. Three answers per API (OpenAI chat and
//! Anthropic messages): text, a valid tool call, and an invalid first tool call that
//! Backstop corrects (its direct row is the invalid call the client would get without
//! Backstop: one attempt).

#[path = "common/mod.rs"]
mod common;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use base64::Engine;
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

const KEY: &str = "bk-bench-key-0001";
const PACE: &str = "chunks=5;chunk_delay=50ms";

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// One stream's timings.
#[derive(Clone, Copy)]
struct Timing {
    first_byte: Duration,
    first_content: Duration,
    last: Duration,
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    Chat,
    Anthropic,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Anthropic => "/v1/messages",
        }
    }

    fn body(self) -> String {
        match self {
            // Usage asked for, as Backstop asks for it: the mock paces that chunk too.
            Api::Chat => json!({"model": "gpt-4o-mini", "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "what is the weather in paris"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": false}}}]}),
            Api::Anthropic => json!({"model": "claude-mock-1", "max_tokens": 256, "stream": true,
                "messages": [{"role": "user", "content": "what is the weather in paris"}],
                "tools": [{"name": "get_weather", "input_schema": {
                    "type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": false}}]}),
        }
        .to_string()
    }

    /// Whether a chunk of the body carries content: a text delta or a tool call's start.
    fn has_content(self, text: &str) -> bool {
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .any(|v| match self {
                Api::Chat => {
                    let delta = &v["choices"][0]["delta"];
                    delta["content"].as_str().is_some_and(|s| !s.is_empty())
                        || delta["tool_calls"].is_array()
                }
                Api::Anthropic => {
                    v["type"] == "content_block_delta"
                        || (v["type"] == "content_block_start"
                            && v["content_block"]["type"] == "tool_use")
                }
            })
    }
}

/// `total` streams over `concurrency` closed-loop workers. `fault` gets `{n}` replaced
/// by the stream's number (its scenario, so each counts its own attempts).
async fn run(
    http: &reqwest::Client,
    api: Api,
    url: String,
    auth: bool,
    fault: &str,
    total: usize,
    concurrency: usize,
) -> Vec<Timing> {
    let next = Arc::new(AtomicUsize::new(0));
    let body = api.body();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, next, body, fault) = (
            http.clone(),
            url.clone(),
            next.clone(),
            body.clone(),
            fault.to_string(),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let mut req = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("anthropic-version", "2023-06-01")
                    .header(
                        "x-mock-scenario",
                        format!("bench-{}-{n}", fastrand::u64(..)),
                    )
                    .header("x-mock-fault", fault.clone())
                    .body(body.clone());
                if auth {
                    req = match api {
                        Api::Chat => req.bearer_auth(KEY),
                        Api::Anthropic => req.header("x-api-key", KEY),
                    };
                }
                let sent = Instant::now();
                let resp = req.send().await.unwrap();
                assert!(resp.status().is_success(), "{}", resp.status());
                let mut stream = resp.bytes_stream();
                let (mut first_byte, mut first_content) = (None, None);
                let mut seen = String::new();
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.unwrap();
                    first_byte.get_or_insert_with(|| sent.elapsed());
                    seen.push_str(&String::from_utf8_lossy(&chunk));
                    if first_content.is_none() && api.has_content(&seen) {
                        first_content = Some(sent.elapsed());
                    }
                }
                let last = sent.elapsed();
                out.push(Timing {
                    first_byte: first_byte.unwrap(),
                    first_content: first_content.unwrap_or(last),
                    last,
                });
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

fn quantiles(timings: &[Timing], pick: fn(&Timing) -> Duration) -> (f64, f64) {
    let mut v: Vec<Duration> = timings.iter().map(pick).collect();
    v.sort();
    (pct(&v, 0.5), pct(&v, 0.99))
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let total: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(500);
    let concurrency: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(16);
    let bin = backstop_bin();
    let (mock_port, gw_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("backstop-streams-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("streams.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{gw_port}"
[log]
level = "warn"
[store]
path = "{store}"
[[upstreams]]
name = "mock-openai"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[upstreams]]
name = "mock-anthropic"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock-openai" }}]
[[routes]]
model = "claude-*"
targets = [{{ upstream = "mock-anthropic" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
"#,
            store = dir.join("streams.db").display()
        ),
    )
    .unwrap();
    let mock = Proc::spawn(
        &bin,
        &[
            "mock-upstream",
            "--listen",
            &format!("127.0.0.1:{mock_port}"),
        ],
    );
    let gw = Proc::spawn(&bin, &["serve", "--config", config.to_str().unwrap()]);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock_port}/mock/stats")).await;
    wait_up(&http, &format!("http://127.0.0.1:{gw_port}/readyz")).await;

    let valid = format!(
        "tool=get_weather;tool_args_b64={};{PACE}",
        b64(r#"{"city":"Paris"}"#)
    );
    let invalid = format!(
        "tool=get_weather;tool_args_b64={};{PACE}",
        b64(r#"{"town":"Paris"}"#)
    );
    let corrected = format!("{invalid},{valid}");
    let cases = [
        ("text", PACE.to_string(), PACE.to_string()),
        ("tool call", valid.clone(), valid),
        ("invalid call, corrected", invalid, corrected),
    ];
    println!(
        "{total} streams per row at concurrency {concurrency}, 5 chunks 50 ms apart, tools attached, release build, same run"
    );
    println!("ms, p50 / p99; through = via Backstop, direct = the mock itself\n");
    println!(
        "| API | answer | path | first chunk | first content | last chunk | upstream attempts |"
    );
    println!("|---|---|---|---|---|---|---|");
    for api in [Api::Chat, Api::Anthropic] {
        let direct = format!("http://127.0.0.1:{mock_port}{}", api.path());
        let through = format!("http://127.0.0.1:{gw_port}{}", api.path());
        // Warm both paths (pools, the gateway's schema cache).
        run(&http, api, direct.clone(), false, PACE, 32, 16).await;
        run(&http, api, through.clone(), true, PACE, 32, 16).await;
        for (answer, direct_fault, through_fault) in &cases {
            let name = match api {
                Api::Chat => "chat",
                Api::Anthropic => "anthropic",
            };
            for (path, url, auth, fault) in [
                ("direct", &direct, false, direct_fault),
                ("through", &through, true, through_fault),
            ] {
                let before = attempts(&http, mock_port).await;
                let t = run(&http, api, url.clone(), auth, fault, total, concurrency).await;
                let per = (attempts(&http, mock_port).await - before) as f64 / total as f64;
                let (fb, fc, l) = (
                    quantiles(&t, |t| t.first_byte),
                    quantiles(&t, |t| t.first_content),
                    quantiles(&t, |t| t.last),
                );
                println!(
                    "| {name} | {answer} | {path} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {per:.2} |",
                    fb.0, fb.1, fc.0, fc.1, l.0, l.1
                );
            }
        }
    }
    println!(
        "\ngateway RSS after the run: {} kB",
        proc_kb(gw.pid(), "VmRSS:")
    );
    drop((gw, mock));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every attempt the mock has answered so far.
async fn attempts(http: &reqwest::Client, port: u16) -> u64 {
    let stats = http
        .get(format!("http://127.0.0.1:{port}/mock/stats"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let stats: Value = serde_json::from_slice(&stats).unwrap();
    stats["total"].as_u64().unwrap_or(0)
}
