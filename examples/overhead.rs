//! Backstop's added latency, measured against a direct call to the same upstream in the
//! same run. Starts the mock upstream and a gateway as separate processes from a
//! (release) `backstop` binary, then drives both with the same closed-loop client.
//!
//!     cargo build --release && cargo run --release --example overhead -- [REQUESTS]
//!
//! Prints p50/p99 for concurrency 1 and 32, direct and through Backstop, and the time to
//! first chunk of a stream.

#[path = "common/mod.rs"]
mod common;

use std::{
    process::{Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use common::*;

use futures_util::StreamExt;

const KEY: &str = "bk-bench-key-0001";
const BUDGETED: &str = "bk-bench-budgeted-0001";

/// `total` requests spread over `concurrency` closed-loop workers; latencies sorted.
async fn run(
    http: &reqwest::Client,
    url: &str,
    auth: bool,
    total: usize,
    concurrency: usize,
) -> (Vec<Duration>, f64) {
    run_as(http, url, auth.then_some((KEY, None)), total, concurrency).await
}

const CHAT: &str = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}]}"#;
const RESPONSES: &str =
    r#"{"model":"gpt-4o-mini","input":"What is the capital of France? Answer in one word."}"#;

/// Like `run_as`, as a given tenant key and optional session.
async fn run_as(
    http: &reqwest::Client,
    url: &str,
    auth: Option<(&'static str, Option<&'static str>)>,
    total: usize,
    concurrency: usize,
) -> (Vec<Duration>, f64) {
    run_body(http, url, CHAT, auth, total, concurrency).await
}

/// `total` requests of `body` over `concurrency` closed-loop workers; latencies sorted.
async fn run_body(
    http: &reqwest::Client,
    url: &str,
    body: &'static str,
    auth: Option<(&'static str, Option<&'static str>)>,
    total: usize,
    concurrency: usize,
) -> (Vec<Duration>, f64) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let http = http.clone();
        let url = url.to_string();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < total {
                let t = Instant::now();
                let mut req = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body);
                if let Some((key, session)) = auth {
                    req = req.bearer_auth(key);
                    if let Some(session) = session {
                        req = req.header("x-session-id", session);
                    }
                }
                let resp = req.send().await.unwrap();
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

async fn first_chunk(http: &reqwest::Client, url: &str, auth: bool, n: usize) -> Vec<Duration> {
    let body = r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"stream please"}]}"#;
    let mut out = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let mut req = http
            .post(url)
            .header("content-type", "application/json")
            .body(body);
        if auth {
            req = req.bearer_auth(KEY);
        }
        let resp = req.send().await.unwrap();
        let mut stream = resp.bytes_stream();
        stream.next().await.unwrap().unwrap();
        out.push(t.elapsed());
        while stream.next().await.is_some() {}
    }
    out.sort();
    out
}

#[tokio::main]
async fn main() {
    let total: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let bin = std::env::var("BACKSTOP_BIN").unwrap_or_else(|_| "target/release/backstop".into());
    let (mock_port, gw_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("backstop-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("bench.toml");
    let store = dir.join("bench.db");
    let store = store.display();
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{gw_port}"
[log]
format = "json"
level = "info"
[store]
path = "{store}"
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[prices]]
model = "gpt-*"
input_per_mtok = 2.5
output_per_mtok = 10.0
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
[[tenants]]
name = "budgeted"
api_keys = ["{BUDGETED}"]
requests_per_minute = 100000000
[tenants.session]
requests_per_minute = 100000000
max_calls = 100000000
max_tokens = 100000000000
max_usd = 100000000.0
max_concurrent = 1000
[tenants.budget]
usd_per_day = 100000000.0
tokens_per_day = 100000000000
"#
        ),
    )
    .unwrap();
    let _mock = Proc(
        Command::new(&bin)
            .args([
                "mock-upstream",
                "--listen",
                &format!("127.0.0.1:{mock_port}"),
            ])
            .stderr(Stdio::null())
            .spawn()
            .expect("run the backstop binary (cargo build --release)"),
    );
    // The gateway logs one JSON line per request, as in production, to /dev/null.
    let _gw = Proc(
        Command::new(&bin)
            .args(["serve", "--config", config.to_str().unwrap()])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock_port}/mock/stats")).await;
    wait_up(&http, &format!("http://127.0.0.1:{gw_port}/readyz")).await;
    let direct = format!("http://127.0.0.1:{mock_port}/v1/chat/completions");
    let through = format!("http://127.0.0.1:{gw_port}/v1/chat/completions");

    // Warm both paths (connection pools, allocator) before measuring.
    run(&http, &direct, false, 500, 32).await;
    run(&http, &through, true, 500, 32).await;

    println!("{total} non-streaming requests per row, closed loop, release build, same run\n");
    println!("| path | concurrency | p50 ms | p99 ms | req/s |");
    println!("|---|---|---|---|---|");
    for concurrency in [1, 32] {
        let (d, drps) = run(&http, &direct, false, total, concurrency).await;
        let (b, brps) = run(&http, &through, true, total, concurrency).await;
        println!(
            "| direct | {concurrency} | {:.3} | {:.3} | {drps:.0} |",
            pct(&d, 0.5),
            pct(&d, 0.99)
        );
        println!(
            "| backstop | {concurrency} | {:.3} | {:.3} | {brps:.0} |",
            pct(&b, 0.5),
            pct(&b, 0.99)
        );
        println!(
            "| added | {concurrency} | {:+.3} | {:+.3} | {:.0}% of direct |",
            pct(&b, 0.5) - pct(&d, 0.5),
            pct(&b, 0.99) - pct(&d, 0.99),
            brps / drps * 100.0
        );
    }
    // The budget layers: a tenant with rate limits, session caps and a day budget (and a
    // session header) against one with none; both are metered into the ledger.
    println!("\nBudgets: same gateway, {total} requests per row, concurrency 32\n");
    println!("| tenant | p50 ms | p99 ms | req/s |\n|---|---|---|---|");
    for _ in 0..2 {
        let (p, prps) = run_as(&http, &through, Some((KEY, None)), total, 32).await;
        let (b, brps) = run_as(
            &http,
            &through,
            Some((BUDGETED, Some("bench-session"))),
            total,
            32,
        )
        .await;
        println!(
            "| no limits | {:.3} | {:.3} | {prps:.0} |",
            pct(&p, 0.5),
            pct(&p, 0.99)
        );
        println!(
            "| all limits + session | {:.3} | {:.3} | {brps:.0} |",
            pct(&b, 0.5),
            pct(&b, 0.99)
        );
    }

    // The Responses API against chat completions, each against its own direct call.
    // Interleaved rounds (direct chat, through chat, direct responses, through
    // responses, then the next round) so that the machine's drift over the run falls
    // on both endpoints alike; percentiles are of all rounds' latencies pooled.
    let endpoints = [
        ("chat completions", "/v1/chat/completions", CHAT),
        ("responses", "/v1/responses", RESPONSES),
    ];
    const ROUNDS: usize = 5;
    println!(
        "\nResponses API vs chat completions: {total} requests per row in {ROUNDS} interleaved rounds, added = through - direct\n"
    );
    println!(
        "| endpoint | concurrency | direct p50 / p99 ms | added p50 / p99 ms |\n|---|---|---|---|"
    );
    for (_, path, body) in endpoints {
        let through = format!("http://127.0.0.1:{gw_port}{path}");
        run_body(&http, &through, body, Some((KEY, None)), 200, 8).await;
    }
    for concurrency in [1, 32] {
        let mut pooled = vec![(Vec::new(), Vec::new()); endpoints.len()];
        let mut round_added = vec![Vec::new(); endpoints.len()];
        for _ in 0..ROUNDS {
            for (i, (_, path, body)) in endpoints.iter().enumerate() {
                let direct = format!("http://127.0.0.1:{mock_port}{path}");
                let through = format!("http://127.0.0.1:{gw_port}{path}");
                let n = total / ROUNDS;
                let (d, _) = run_body(&http, &direct, body, None, n, concurrency).await;
                let (b, _) =
                    run_body(&http, &through, body, Some((KEY, None)), n, concurrency).await;
                round_added[i].push(pct(&b, 0.5) - pct(&d, 0.5));
                pooled[i].0.extend(d);
                pooled[i].1.extend(b);
            }
        }
        for (i, (name, _, _)) in endpoints.iter().enumerate() {
            let (d, b) = &mut pooled[i];
            d.sort();
            b.sort();
            println!(
                "| {name} | {concurrency} | {:.3} / {:.3} | {:+.3} / {:+.3} |",
                pct(d, 0.5),
                pct(d, 0.99),
                pct(b, 0.5) - pct(d, 0.5),
                pct(b, 0.99) - pct(d, 0.99)
            );
        }
        // Responses minus chat, round by round: the spread says how far apart the two
        // endpoints' added p50 are, against how far apart rounds of the same one are.
        let mut gap: Vec<f64> = round_added[1]
            .iter()
            .zip(&round_added[0])
            .map(|(r, c)| r - c)
            .collect();
        gap.sort_by(f64::total_cmp);
        println!(
            "| responses - chat, per round | {concurrency} | | median {:+.3}, range {:+.3} .. {:+.3} |",
            gap[gap.len() / 2],
            gap[0],
            gap[gap.len() - 1]
        );
    }

    let n = 200;
    let d = first_chunk(&http, &direct, false, n).await;
    let b = first_chunk(&http, &through, true, n).await;
    println!("\nTime to first stream chunk, {n} sequential streams:");
    println!("| path | p50 ms | p99 ms |\n|---|---|---|");
    println!("| direct | {:.3} | {:.3} |", pct(&d, 0.5), pct(&d, 0.99));
    println!("| backstop | {:.3} | {:.3} |", pct(&b, 0.5), pct(&b, 0.99));
    let _ = std::fs::remove_dir_all(&dir);
}
