//! What the strategy switch across providers costs per call: the same Anthropic upstream
//! (the mock's `/v1/messages`) called by an Anthropic client (no translation) and by an
//! OpenAI chat client (translated both ways), and the reverse on the mock's
//! `/v1/chat/completions`; then the translation functions alone, in process.
//!
//!     cargo build --release && cargo run --release --example translation -- [REQUESTS]
//!
//! Prints p50/p99 and req/s per row, interleaved in rounds so the machine's drift falls
//! on both alike, and the added time of the translated row over the untranslated one.

#[path = "common/mod.rs"]
mod common;

use std::{
    hint::black_box,
    sync::Arc,
    time::{Duration, Instant},
};

use backstop::{
    api::{Endpoint, ParsedRequest},
    translate::{answer, request, AnswerContext, Direction},
};
use common::*;

const KEY: &str = "bk-bench-key-0001";

const CHAT: &str = r#"{"model":"MODEL","max_tokens":64,"messages":[{"role":"system","content":"Answer in one word."},{"role":"user","content":"What is the capital of France?"}]}"#;
const MESSAGES: &str = r#"{"model":"MODEL","max_tokens":64,"system":"Answer in one word.","messages":[{"role":"user","content":"What is the capital of France?"}]}"#;

async fn run(
    http: &reqwest::Client,
    url: &str,
    body: String,
    total: usize,
    concurrency: usize,
) -> (Vec<Duration>, f64) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let body = Arc::new(body);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, next, body) = (http.clone(), url.to_string(), next.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                let t = Instant::now();
                let resp = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("x-api-key", KEY)
                    .bearer_auth(KEY)
                    .header("anthropic-version", "2023-06-01")
                    .body(body.as_str().to_string())
                    .send()
                    .await
                    .unwrap();
                assert!(resp.status().is_success(), "{}", resp.status());
                resp.bytes().await.unwrap();
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let rps = all.len() as f64 / started.elapsed().as_secs_f64();
    all.sort();
    (all, rps)
}

/// Nanoseconds per call of `f`, best of three runs of `n`.
fn per_call(n: u32, mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..n {
                f();
            }
            t.elapsed().as_nanos() as f64 / f64::from(n)
        })
        .fold(f64::INFINITY, f64::min)
}

fn in_process() {
    let chat = ParsedRequest::parse(
        Endpoint::ChatCompletions,
        CHAT.replace("MODEL", "gpt-x").into(),
    )
    .unwrap();
    let messages = ParsedRequest::parse(
        Endpoint::Messages,
        MESSAGES.replace("MODEL", "claude-x").into(),
    )
    .unwrap();
    let claude_answer = br#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-x","content":[{"type":"text","text":"Paris."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":2,"cache_read_input_tokens":0,"cache_creation_input_tokens":0}}"#;
    let chat_answer = br#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-x","choices":[{"index":0,"message":{"role":"assistant","content":"Paris.","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":2,"total_tokens":22}}"#;
    let n = 20_000;
    let parse = per_call(n, || {
        black_box(ParsedRequest::parse(Endpoint::ChatCompletions, CHAT.into()).unwrap());
    });
    println!("\nIn process, per call (best of 3 × {n}):\n");
    println!("| step | ns |\n|---|---|");
    println!("| parse a chat request (every call does this) | {parse:.0} |");
    for (name, direction, caller, answer_body) in [
        (
            "chat->messages",
            Direction::ChatToMessages,
            &chat,
            &claude_answer[..],
        ),
        (
            "messages->chat",
            Direction::MessagesToChat,
            &messages,
            &chat_answer[..],
        ),
    ] {
        let options = request::Options {
            drop: &[],
            max_tokens: Some(256),
        };
        let req = per_call(n, || {
            let converted = request::convert(direction, caller, options).unwrap();
            black_box(caller.translated(direction.target_endpoint(), converted.json));
        });
        let cx = AnswerContext {
            direction,
            caller: Arc::new(caller.clone()),
        };
        let ans = per_call(n, || {
            black_box(answer::whole(&cx, answer_body).unwrap());
        });
        println!("| {name}: the request | {req:.0} |");
        println!("| {name}: the whole answer | {ans:.0} |");
    }
}

#[tokio::main]
async fn main() {
    let total: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let bin = backstop_bin();
    let (mock_port, gw_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("backstop-translation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("translation.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{gw_port}"
[log]
level = "warn"
[store]
path = ":memory:"
[[upstreams]]
name = "openai"
api = "openai"
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[upstreams]]
name = "anthropic"
api = "anthropic"
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[routes]]
model = "to-claude"
targets = [{{ upstream = "anthropic", model = "claude-x" }}]
[[routes]]
model = "to-gpt"
targets = [{{ upstream = "openai", model = "gpt-x" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
"#
        ),
    )
    .unwrap();
    let _mock = Proc::spawn(
        &bin,
        &[
            "mock-upstream",
            "--listen",
            &format!("127.0.0.1:{mock_port}"),
        ],
    );
    let _gw = Proc::spawn(&bin, &["serve", "--config", config.to_str().unwrap()]);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{gw_port}/readyz")).await;
    let gw = format!("http://127.0.0.1:{gw_port}");
    // (row, url, body): each pair is the same upstream endpoint, untranslated first.
    let pairs = [
        (
            (
                "messages -> anthropic",
                format!("{gw}/v1/messages"),
                MESSAGES.replace("MODEL", "to-claude"),
            ),
            (
                "chat -> anthropic (translated)",
                format!("{gw}/v1/chat/completions"),
                CHAT.replace("MODEL", "to-claude"),
            ),
        ),
        (
            (
                "chat -> openai",
                format!("{gw}/v1/chat/completions"),
                CHAT.replace("MODEL", "to-gpt"),
            ),
            (
                "messages -> openai (translated)",
                format!("{gw}/v1/messages"),
                MESSAGES.replace("MODEL", "to-gpt"),
            ),
        ),
    ];
    for ((_, url, body), (_, turl, tbody)) in &pairs {
        run(&http, url, body.clone(), 300, 8).await;
        run(&http, turl, tbody.clone(), 300, 8).await;
    }
    const ROUNDS: usize = 5;
    println!("{total} requests per row in {ROUNDS} interleaved rounds, release build, same run\n");
    println!(
        "| caller -> upstream | concurrency | p50 ms | p99 ms | req/s |\n|---|---|---|---|---|"
    );
    for concurrency in [1, 32] {
        for ((name, url, body), (tname, turl, tbody)) in &pairs {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let (mut arps, mut brps) = (0.0, 0.0);
            for _ in 0..ROUNDS {
                let (l, r) = run(&http, url, body.clone(), total / ROUNDS, concurrency).await;
                a.extend(l);
                arps += r / ROUNDS as f64;
                let (l, r) = run(&http, turl, tbody.clone(), total / ROUNDS, concurrency).await;
                b.extend(l);
                brps += r / ROUNDS as f64;
            }
            a.sort();
            b.sort();
            println!(
                "| {name} | {concurrency} | {:.3} | {:.3} | {arps:.0} |",
                pct(&a, 0.5),
                pct(&a, 0.99)
            );
            println!(
                "| {tname} | {concurrency} | {:.3} | {:.3} | {brps:.0} |",
                pct(&b, 0.5),
                pct(&b, 0.99)
            );
            println!(
                "| added by translation | {concurrency} | {:+.3} | {:+.3} | {:.0}% |",
                pct(&b, 0.5) - pct(&a, 0.5),
                pct(&b, 0.99) - pct(&a, 0.99),
                brps / arps * 100.0
            );
        }
    }
    in_process();
}
