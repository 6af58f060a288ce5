//! `backstop demo`: a fault storm through a real Backstop against real mock upstreams,
//! printed as a table a person can read. Everything runs in this process on loopback.
//!
//! Phase 1, the storm: two targets whose mocks both fail 20% with 503, 10% with 429 and
//! `Retry-After: 1`, 5% with a connection reset and 5% by hanging past `attempt_timeout`.
//! Phase 2, hard down: one upstream that always answers 503, until its breaker opens,
//! then the latency of requests refused while it is open.
//! Phase 3, a brownout: the primary fails 30%, below its breaker, the backup none.
//! Phase 4, a false alarm: five failures open a breaker on an upstream that is healthy
//! from then on; how long until it serves again.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::net::TcpListener;

use crate::{
    config::Config,
    mock::{self, FaultMix},
    server, telemetry,
};

const KEY: &str = "bk-demo-storm-key";
pub const STORM: &str = "status=503@0.2|status=429;retry_after=1@0.1|reset@0.05|hang@0.05";

fn config(
    primary: std::net::SocketAddr,
    backup: std::net::SocketAddr,
    down: std::net::SocketAddr,
    max_ratio: f64,
    hedge: Option<&str>,
) -> Config {
    let hedge = hedge.map_or(String::new(), |after| format!("hedge_after = \"{after}\""));
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_timeout = "30s"
[log]
level = "error"
[store]
path = ":memory:"
[retry]
max_attempts = 3
base_delay = "200ms"
max_delay = "5s"
max_retry_after = "10s"
budget_ratio = 0.2
budget_max_ratio = {max_ratio}
[breaker]
failure_threshold = 5
open_for = "30s"
[[upstreams]]
name = "primary"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{primary}"
attempt_timeout = "1s"
[[upstreams]]
name = "backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{backup}"
attempt_timeout = "1s"
[[upstreams]]
name = "down"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{down}"
attempt_timeout = "1s"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "primary" }}, {{ upstream = "backup" }}]
{hedge}
[[routes]]
model = "down-model"
targets = [{{ upstream = "down" }}]
[[tenants]]
name = "demo"
api_keys = ["{KEY}"]
"#
    );
    Config::from_toml_with_env(&text, |_| None).expect("demo config is valid")
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

/// Sums a Prometheus counter's samples per value of `label`, from the rendered page.
fn sum_by(page: &str, metric: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in page
        .lines()
        .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with('{'))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let needle = format!("{label}=\"");
        let Some(start) = labels.find(&needle) else {
            continue;
        };
        let rest = &labels[start + needle.len()..];
        let key = rest.split('"').next().unwrap_or("").to_string();
        *out.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    out
}

async fn call(http: &reqwest::Client, url: &str, model: &str) -> (u16, Duration, String) {
    let started = Instant::now();
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello"}}]}}"#);
    match http
        .post(url)
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
    {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let recovery = resp
                .headers()
                .get("x-backstop-recovery")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let _ = resp.bytes().await;
            (status, started.elapsed(), recovery)
        }
        Err(_) => (0, started.elapsed(), String::new()),
    }
}

/// One storm's figures, through one gateway.
struct Storm {
    results: Vec<(u16, Duration, String)>,
    attempts: u64,
    wall: Duration,
    trips: f64,
    refused: f64,
}

/// The storm against two fresh mocks through a fresh gateway whose retry budget goes up
/// to `max_ratio` (0.2: the fixed budget). Metrics are process-wide: what this storm
/// added is read as the difference.
async fn storm(
    requests: usize,
    concurrency: usize,
    max_ratio: f64,
    hedge: Option<&str>,
) -> (Storm, mock::MockHandle) {
    let mix = FaultMix::parse(STORM).expect("storm mix parses");
    let bind = || TcpListener::bind("127.0.0.1:0");
    let primary = mock::spawn_with(bind().await.expect("bind"), mix.clone());
    let backup = mock::spawn_with(bind().await.expect("bind"), mix);
    let gateway = server::spawn(config(
        primary.addr,
        backup.addr,
        backup.addr,
        max_ratio,
        hedge,
    ))
    .await
    .expect("gateway starts");
    let url = format!("http://{}/v1/chat/completions", gateway.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("client");
    let counted = || {
        let page = telemetry::metrics_handle().render();
        let trips = sum_by(&page, "backstop_breaker_transitions_total", "to")
            .get("open")
            .copied()
            .unwrap_or(0.0);
        let refused = sum_by(&page, "backstop_retry_budget_exhausted_total", "upstream")
            .values()
            .fold(0.0, |a, b| a + b);
        (trips, refused)
    };
    let before = counted();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, next) = (http.clone(), url.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                out.push(call(&http, &url, "gpt-4o").await);
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.unwrap_or_default());
    }
    let wall = started.elapsed();
    let after = counted();
    gateway.shutdown().await;
    let attempts = primary.state_total() + backup.state_total();
    (
        Storm {
            results,
            attempts,
            wall,
            trips: after.0 - before.0,
            refused: after.1 - before.1,
        },
        primary,
    )
}

impl Storm {
    /// (label, value) rows for the table.
    fn rows(&self) -> Vec<(&'static str, String)> {
        let n = self.results.len().max(1);
        let ok = self.results.iter().filter(|r| r.0 == 200).count();
        let mut latencies: Vec<Duration> = self.results.iter().map(|r| r.1).collect();
        latencies.sort();
        let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
        for r in &self.results {
            *statuses.entry(r.0).or_default() += 1;
        }
        vec![
            ("client requests", self.results.len().to_string()),
            (
                "client-visible success",
                format!("{ok} ({:.1}%)", ok as f64 * 100.0 / n as f64),
            ),
            (
                "client statuses",
                statuses
                    .iter()
                    .map(|(s, n)| format!("{s}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
            ("upstream attempts", self.attempts.to_string()),
            (
                "amplification (attempts / request)",
                format!("{:.2}", self.attempts as f64 / n as f64),
            ),
            (
                "latency p50 / p99",
                format!(
                    "{:.1} ms / {:.1} ms",
                    pct(&latencies, 0.5),
                    pct(&latencies, 0.99)
                ),
            ),
            ("breaker trips (to open)", format!("{}", self.trips)),
            (
                "retries refused by the retry budget",
                format!("{}", self.refused),
            ),
            ("wall time", format!("{:.1} s", self.wall.as_secs_f64())),
        ]
    }
}

pub async fn run(requests: usize, concurrency: usize) {
    println!(
        "Fault storm: {requests} requests, {concurrency} concurrent clients, route with 2 targets"
    );
    println!("each upstream: 20% 503, 10% 429 (Retry-After 1 s), 5% reset, 5% hang past attempt_timeout (1 s)\n");
    let (adaptive, primary) = storm(requests, concurrency, 1.0, None).await;
    let (hedged, _) = storm(requests, concurrency, 1.0, Some("300ms")).await;
    let (fixed, _) = storm(requests, concurrency, 0.2, None).await;
    println!("| figure | adaptive retry budget (default) | adaptive + `hedge_after = \"300ms\"` | fixed budget (ratio 0.2) |\n|---|---|---|---|");
    for (((label, a), (_, h)), (_, f)) in adaptive
        .rows()
        .into_iter()
        .zip(hedged.rows())
        .zip(fixed.rows())
    {
        println!("| {label} | {a} | {h} | {f} |");
    }

    // The same storm without Backstop: one attempt straight at one upstream.
    let direct_url = format!("http://{}/v1/chat/completions", primary.addr);
    let direct_http = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .expect("client");
    let mut direct_ok = 0;
    for _ in 0..200 {
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}"#;
        if let Ok(r) = direct_http.post(&direct_url).body(body).send().await {
            direct_ok += usize::from(r.status().is_success());
        }
    }
    println!(
        "| for comparison: 200 calls straight to one upstream, no Backstop | {:.1}% success |",
        direct_ok as f64 / 2.0
    );

    println!("\nHard down: one upstream answering 503 to everything (breaker threshold 5)\n");
    let down = mock::spawn_with(
        TcpListener::bind("127.0.0.1:0").await.expect("bind"),
        FaultMix::parse("status=503@1").expect("parses"),
    );
    let gateway = server::spawn(config(primary.addr, primary.addr, down.addr, 1.0, None))
        .await
        .expect("gateway starts");
    let url = format!("http://{}/v1/chat/completions", gateway.addr);
    let http = reqwest::Client::new();
    let mut before_open = 0;
    let mut opened_after = None;
    for i in 0..20 {
        let (_, _, recovery) = call(&http, &url, "down-model").await;
        if recovery.starts_with("open:") {
            opened_after = Some(i);
            break;
        }
        before_open = down.state_total();
    }
    let mut open_latency = Vec::new();
    for _ in 0..200 {
        let (status, took, _) = call(&http, &url, "down-model").await;
        debug_assert_eq!(status, 503);
        open_latency.push(took);
    }
    open_latency.sort();
    println!("| figure | value |\n|---|---|");
    println!("| upstream attempts until the breaker opened | {before_open} |");
    println!(
        "| client requests until the first refusal | {} |",
        opened_after.map_or("never".into(), |n| (n + 1).to_string())
    );
    println!(
        "| upstream attempts while open (200 requests) | {} |",
        down.state_total() - before_open
    );
    println!(
        "| latency while open p50 / p99 | {:.3} ms / {:.3} ms |",
        pct(&open_latency, 0.5),
        pct(&open_latency, 0.99)
    );
    gateway.shutdown().await;

    brownout(requests, concurrency).await;
    false_alarm().await;
}

/// Phase 4: the upstream fails its first five attempts (a run of bad luck, enough to
/// open its breaker) and answers every later one. Requests every 20 ms until one is
/// answered: how long the breaker kept a healthy upstream out.
async fn false_alarm() {
    println!(
        "\nFalse alarm: five failures in a row open the breaker, then the upstream is healthy\n"
    );
    let healthy = mock::spawn(TcpListener::bind("127.0.0.1:0").await.expect("bind"));
    let gateway = server::spawn(config(healthy.addr, healthy.addr, healthy.addr, 1.0, None))
        .await
        .expect("gateway starts");
    let url = format!("http://{}/v1/chat/completions", gateway.addr);
    let http = reqwest::Client::new();
    let body = r#"{"model":"down-model","messages":[{"role":"user","content":"hello"}]}"#;
    let mut opened: Option<Instant> = None;
    let mut refused = 0;
    let mut back_after = None;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(40) {
        let status = http
            .post(&url)
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .header("x-mock-scenario", "false-alarm")
            .header(
                "x-mock-fault",
                "status=503,status=503,status=503,status=503,status=503,ok",
            )
            .body(body)
            .send()
            .await
            .map_or(0, |r| r.status().as_u16());
        match status {
            200 => {
                back_after = opened.map(|at| at.elapsed());
                break;
            }
            503 if healthy.attempts("false-alarm") >= 5 => {
                opened.get_or_insert_with(Instant::now);
                refused += 1;
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.shutdown().await;
    println!("| figure | value |\n|---|---|");
    println!(
        "| healthy upstream kept out for | {} |",
        back_after.map_or("over 40 s".into(), |d| format!("{:.1} s", d.as_secs_f64()))
    );
    println!("| requests refused meanwhile (circuit_open) | {refused} |");
    println!(
        "| upstream attempts in all | {} (5 failures, then the probe) |",
        healthy.attempts("false-alarm")
    );
}

/// Phase 3: the primary fails 30% (below its breaker's failure rate), the backup none.
async fn brownout(requests: usize, concurrency: usize) {
    println!("\nBrownout: the primary fails 30% with 503, the backup is healthy\n");
    let bind = || TcpListener::bind("127.0.0.1:0");
    let primary = mock::spawn_with(
        bind().await.expect("bind"),
        FaultMix::parse("status=503@0.3").expect("parses"),
    );
    let backup = mock::spawn_with(bind().await.expect("bind"), FaultMix::default());
    let gateway = server::spawn(config(primary.addr, backup.addr, backup.addr, 1.0, None))
        .await
        .expect("gateway starts");
    let url = format!("http://{}/v1/chat/completions", gateway.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .expect("client");
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, next) = (http.clone(), url.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < requests {
                out.push(call(&http, &url, "gpt-4o").await);
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.unwrap_or_default());
    }
    gateway.shutdown().await;
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let mut latencies: Vec<Duration> = results.iter().map(|r| r.1).collect();
    latencies.sort();
    let attempts = primary.state_total() + backup.state_total();
    println!("| figure | value |\n|---|---|");
    println!(
        "| client-visible success | {ok} ({:.1}%) |",
        ok as f64 * 100.0 / results.len().max(1) as f64
    );
    println!(
        "| amplification (attempts / request) | {:.2} |",
        attempts as f64 / results.len().max(1) as f64
    );
    println!(
        "| attempts on the primary / the backup | {} / {} (the primary demoted once it is an outlier) |",
        primary.state_total(),
        backup.state_total()
    );
    println!(
        "| latency p50 / p99 | {:.1} ms / {:.1} ms |",
        pct(&latencies, 0.5),
        pct(&latencies, 0.99)
    );
    let direct = format!("http://{}/v1/chat/completions", primary.addr);
    let mut direct_ok = 0;
    for _ in 0..200 {
        let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}"#;
        if let Ok(r) = http.post(&direct).body(body).send().await {
            direct_ok += usize::from(r.status().is_success());
        }
    }
    println!(
        "| for comparison: 200 calls straight to the primary, no Backstop | {:.1}% success |",
        direct_ok as f64 / 2.0
    );
}
