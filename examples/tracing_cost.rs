//! What OpenTelemetry tracing costs a request: the same paced load (default 1,000 RPS,
//! open loop) direct to the mock, through a gateway with tracing off, and through one
//! exporting every span (sample_ratio 1) to an in-process OTLP sink that accepts and
//! discards. Mock and gateways are separate processes from a `backstop` binary.
//!
//!     cargo build --release && cargo run --release --example tracing_cost -- [RPS] [SECONDS] [ROUNDS]
//!
//! (`BACKSTOP_BIN=target/debug/backstop` for a debug binary.) Prints p50/p90/p99 per path
//! and round (the paths interleaved, default 3 rounds), the median round per path, and
//! the on/off ratio.

#[path = "common/mod.rs"]
mod common;

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use axum::{body::Bytes, extract::State, routing::post, Router};
use common::*;

const KEY: &str = "bk-bench-key-0001";
const CHAT: &str = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}]}"#;

/// `rps` requests a second for `seconds`, each sent on its tick whatever the others do
/// (open loop: a slow path queues, it does not slow the offered load); sorted latencies.
async fn paced(
    http: &reqwest::Client,
    url: &str,
    auth: bool,
    rps: u64,
    seconds: u64,
) -> Vec<Duration> {
    let mut tick = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rps));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::with_capacity((rps * seconds) as usize);
    for _ in 0..rps * seconds {
        tick.tick().await;
        let mut req = http
            .post(url)
            .header("content-type", "application/json")
            .body(CHAT);
        if auth {
            req = req.bearer_auth(KEY);
        }
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let resp = req.send().await.unwrap();
            assert!(resp.status().is_success(), "{}", resp.status());
            resp.bytes().await.unwrap();
            t.elapsed()
        }));
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out.sort();
    out
}

/// An OTLP/HTTP endpoint that counts request bodies and discards them.
async fn sink() -> (u16, Arc<AtomicU64>) {
    let bytes = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route(
            "/v1/traces",
            post(|State(n): State<Arc<AtomicU64>>, body: Bytes| async move {
                n.fetch_add(body.len() as u64, Ordering::Relaxed);
                [("content-type", "application/x-protobuf")]
            }),
        )
        .with_state(bytes.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (port, bytes)
}

fn gateway_config(port: u16, mock_port: u16, telemetry: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[log]
format = "json"
level = "info"
[store]
path = ":memory:"
[[upstreams]]
name = "mock"
api = "openai"
base_url = "http://127.0.0.1:{mock_port}"
api_key = "sk-bench"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
{telemetry}
"#
    )
}

fn spans_dropped(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("backstop_trace_spans_dropped_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let rps: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let rounds: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let bin = backstop_bin();
    let (sink_port, sunk) = sink().await;
    let (mock_port, off_port, on_port) = (free_port(), free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("backstop-tracing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let off = dir.join("off.toml");
    let on = dir.join("on.toml");
    std::fs::write(&off, gateway_config(off_port, mock_port, "")).unwrap();
    let telemetry = format!(
        "[telemetry]\notlp_endpoint = \"http://127.0.0.1:{sink_port}\"\nsample_ratio = 1.0\n"
    );
    std::fs::write(&on, gateway_config(on_port, mock_port, &telemetry)).unwrap();
    let mock_listen = format!("127.0.0.1:{mock_port}");
    let _mock = Proc::spawn(&bin, &["mock-upstream", "--listen", &mock_listen]);
    let _off = Proc::spawn(&bin, &["serve", "--config", off.to_str().unwrap()]);
    let _on = Proc::spawn(&bin, &["serve", "--config", on.to_str().unwrap()]);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock_port}/mock/stats")).await;
    wait_up(&http, &format!("http://127.0.0.1:{off_port}/readyz")).await;
    wait_up(&http, &format!("http://127.0.0.1:{on_port}/readyz")).await;
    let path = "/v1/chat/completions";
    let paths = [
        (
            "direct",
            format!("http://127.0.0.1:{mock_port}{path}"),
            false,
        ),
        (
            "tracing off",
            format!("http://127.0.0.1:{off_port}{path}"),
            true,
        ),
        (
            "tracing on",
            format!("http://127.0.0.1:{on_port}{path}"),
            true,
        ),
    ];
    for (_, url, auth) in &paths {
        paced(&http, url, *auth, rps, 1).await;
    }
    println!(
        "{rps} RPS paced (open loop), {seconds} s per row, {rounds} interleaved rounds, binary {bin}\n"
    );
    println!("| round | path | requests | p50 ms | p90 ms | p99 ms |\n|---|---|---|---|---|---|");
    // Per path, per round: (p50, p99).
    let mut figures = vec![Vec::new(); paths.len()];
    for round in 1..=rounds {
        for (i, (name, url, auth)) in paths.iter().enumerate() {
            let lat = paced(&http, url, *auth, rps, seconds).await;
            let (p50, p90, p99) = (pct(&lat, 0.5), pct(&lat, 0.9), pct(&lat, 0.99));
            println!(
                "| {round} | {name} | {} | {p50:.3} | {p90:.3} | {p99:.3} |",
                lat.len()
            );
            figures[i].push((p50, p99));
        }
    }
    // The median round: a stall of the shared machine in one round does not decide it.
    let median = |i: usize, f: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = figures[i].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("\n| median of rounds | p50 ms | p99 ms |\n|---|---|---|");
    for (i, (name, _, _)) in paths.iter().enumerate() {
        println!(
            "| {name} | {:.3} | {:.3} |",
            median(i, |f| f.0),
            median(i, |f| f.1)
        );
    }
    let (off, on) = (
        (median(1, |f| f.0), median(1, |f| f.1)),
        (median(2, |f| f.0), median(2, |f| f.1)),
    );
    println!(
        "| on / off | {:.2}x ({:+.3} ms) | {:.2}x ({:+.3} ms) |",
        on.0 / off.0,
        on.0 - off.0,
        on.1 / off.1,
        on.1 - off.1
    );
    // Spans are exported at least once a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let metrics = http
        .get(format!("http://127.0.0.1:{on_port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    println!(
        "collector received {} KiB of OTLP; spans dropped: {}",
        sunk.load(Ordering::Relaxed) / 1024,
        spans_dropped(&metrics)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
