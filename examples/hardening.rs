//! Issue 16's figures: what an attack costs the *other* clients. The release binary runs
//! as a child process (with its built-in mock); a steady background load of ordinary
//! chat calls measures everyone else's latency while each attack runs, and Backstop's
//! RSS is sampled from /proc throughout.
//!
//! Phases: a baseline; 2 requests with recursive schemas; 10 requests with 10,000 tools
//! each; 5,000 idle connections; 3 streams whose upstream sends an event that never
//! ends; then 1,000 budgeted requests per second for `--disk-seconds` (default 60) with
//! the store's files measured before and after (bytes of disk per request).
//!
//!     cargo build --release && ulimit -n 20000 && cargo run --release --example hardening
//!
//! `--only-disk` runs the disk phase alone; `--disk-seconds N` sets its length; `--store
//! "KEY = VALUE"` adds to the `[store]` section (e.g. `max_wal_bytes`).

mod common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use common::*;
use serde_json::{json, Value};

const KEY: &str = "bk-hardening-bench";

fn config(port: u16, mock_port: u16, store: &str) -> String {
    let store_extra = arg("--store").unwrap_or_default();
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
drain_delay = "0s"
[log]
level = "error"
[store]
path = "{store}"
{store_extra}
[mock]
listen = "127.0.0.1:{mock_port}"
[[prices]]
model = "gpt-*"
input_per_mtok = 1.0
output_per_mtok = 2.0
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
[tenants.session]
max_calls = 100000000
max_usd = 1000000.0
[tenants.budget]
usd_per_day = 1000000.0
"#
    )
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

struct Load {
    latencies: Mutex<Vec<Duration>>,
    errors: AtomicU64,
    stop: AtomicBool,
}

/// Eight ordinary clients, each a call every ~50 ms on its own keep-alive connection.
fn background_load(url: String) -> (Arc<Load>, Vec<tokio::task::JoinHandle<()>>) {
    let load = Arc::new(Load {
        latencies: Mutex::new(Vec::new()),
        errors: AtomicU64::new(0),
        stop: AtomicBool::new(false),
    });
    let workers = (0..8)
        .map(|_| {
            let load = load.clone();
            let url = url.clone();
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let body = json!({"model": "gpt-4o-mini", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}).to_string();
                while !load.stop.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    let ok = http
                        .post(format!("{url}/v1/chat/completions"))
                        .bearer_auth(KEY)
                        .body(body.clone())
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    let took = started.elapsed();
                    if ok {
                        load.latencies.lock().unwrap().push(took);
                    } else {
                        load.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        })
        .collect();
    (load, workers)
}

struct Row {
    phase: String,
    attack: String,
    p50: f64,
    p99: f64,
    max: f64,
    calls: usize,
    errors: u64,
    peak_rss_mb: f64,
}

/// Runs `attack` with the background load beside it for at least `hold`; samples RSS.
async fn phase<F>(name: &str, url: &str, pid: u32, hold: Duration, attack: F) -> Row
where
    F: std::future::Future<Output = String>,
{
    let (load, workers) = background_load(url.to_string());
    let peak = Arc::new(AtomicU64::new(0));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(proc_kb(pid, "VmRSS:"), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let started = Instant::now();
    let summary = attack.await;
    if let Some(rest) = hold.checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    load.stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    sampling.store(false, Ordering::Relaxed);
    let _ = sampler.await;
    let mut lat = load.latencies.lock().unwrap().clone();
    lat.sort_unstable();
    Row {
        phase: name.into(),
        attack: summary,
        p50: pct(&lat, 0.5),
        p99: pct(&lat, 0.99),
        max: lat.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        calls: lat.len(),
        errors: load.errors.load(Ordering::Relaxed),
        peak_rss_mb: peak.load(Ordering::Relaxed) as f64 / 1024.0,
    }
}

/// Sends `bodies` at once; "N× STATUS in T s" per distinct status.
async fn burst(url: &str, bodies: Vec<String>, headers: &[(&str, &str)]) -> String {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let started = Instant::now();
    let calls = bodies.into_iter().map(|body| {
        let mut req = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .body(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        async move {
            match req.send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let text = r.text().await.unwrap_or_default();
                    let code = serde_json::from_str::<Value>(&text)
                        .ok()
                        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
                        .or_else(|| {
                            text.rfind("\"code\":\"")
                                .map(|i| text[i + 8..].split('"').next().unwrap_or("").to_string())
                        })
                        .unwrap_or_default();
                    format!("{status} {code}")
                }
                Err(e) => format!("error {e}"),
            }
        }
    });
    let results = futures_util::future::join_all(calls).await;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for r in results {
        match counts.iter_mut().find(|(k, _)| *k == r) {
            Some((_, n)) => *n += 1,
            None => counts.push((r, 1)),
        }
    }
    let what: Vec<String> = counts.iter().map(|(k, n)| format!("{n}× {k}")).collect();
    format!(
        "{} in {:.2} s",
        what.join(", "),
        started.elapsed().as_secs_f64()
    )
}

fn recursive_bodies() -> Vec<String> {
    vec![
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"allOf": [{"$ref": "#"}]}}}}).to_string(),
        json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "t", "parameters": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}}}]}).to_string(),
    ]
}

fn many_tools_bodies() -> Vec<String> {
    (0..10)
        .map(|r| {
            let tools: Vec<Value> = (0..10_000)
                .map(|i| json!({"type": "function", "function": {"name": format!("t{r}_{i}"), "parameters": {"type": "object", "properties": {format!("p{r}_{i}"): {"type": "string"}}, "required": [format!("p{r}_{i}")]}}}))
                .collect();
            json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "tools": tools}).to_string()
        })
        .collect()
}

async fn idle_connections(addr: &str, n: usize, hold: Duration) -> String {
    let mut sockets = Vec::with_capacity(n);
    let mut failed = 0;
    for _ in 0..n {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(s) => sockets.push(s),
            Err(_) => failed += 1,
        }
    }
    tokio::time::sleep(hold).await;
    // How many the server closed (EOF or reset) by now.
    let mut closed = 0;
    for s in &sockets {
        let mut buf = [0u8; 256];
        match s.try_read(&mut buf) {
            Ok(_) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => closed += 1,
        }
    }
    format!(
        "{n} opened ({failed} failed to connect); after {} s the server had closed {closed}",
        hold.as_secs()
    )
}

fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Open loop: `rps` budgeted session calls per second for `secs`.
async fn disk(url: &str, store_dir: &std::path::Path, rps: u64, secs: u64) -> String {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap();
    let before = dir_bytes(store_dir);
    let db_before = std::fs::metadata(store_dir.join("ledger.db")).map_or(0, |m| m.len());
    let sent = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let max_wal = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity((rps * secs) as usize)));
    let body = json!({"model": "gpt-4o-mini", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rps));
    let started = Instant::now();
    let mut n = 0u64;
    let wal = store_dir.join("ledger.db-wal");
    while started.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        n += 1;
        if n.is_multiple_of(500) {
            max_wal.fetch_max(
                std::fs::metadata(&wal).map_or(0, |m| m.len()),
                Ordering::Relaxed,
            );
        }
        let (http, body, ok, sent) = (http.clone(), body.clone(), ok.clone(), sent.clone());
        let latencies = latencies.clone();
        let url = url.to_string();
        tokio::spawn(async move {
            sent.fetch_add(1, Ordering::Relaxed);
            let session = format!("s-{}", n % 1000);
            let started = Instant::now();
            let served = http
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(KEY)
                .header("x-session-id", session)
                .body(body)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200);
            if served {
                latencies.lock().unwrap().push(started.elapsed());
                ok.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = dir_bytes(store_dir);
    let db_after = std::fs::metadata(store_dir.join("ledger.db")).map_or(0, |m| m.len());
    let ok = ok.load(Ordering::Relaxed);
    let mut lat = latencies.lock().unwrap().clone();
    lat.sort_unstable();
    format!(
        "latency p50 {:.2} / p99 {:.2} / p99.9 {:.2} / max {:.1} ms; {} sent, {ok} ok in {secs} s; store files {:.1} MB → {:.1} MB ({:.0} bytes per request, WAL included); database file {:.1} MB → {:.1} MB ({:.0} bytes per request); WAL peak {:.1} MB",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        pct(&lat, 0.999),
        lat.last().map_or(f64::NAN, |d| d.as_secs_f64() * 1e3),
        sent.load(Ordering::Relaxed),
        before as f64 / 1e6,
        after as f64 / 1e6,
        after.saturating_sub(before) as f64 / ok.max(1) as f64,
        db_before as f64 / 1e6,
        db_after as f64 / 1e6,
        db_after.saturating_sub(db_before) as f64 / ok.max(1) as f64,
        max_wal.load(Ordering::Relaxed) as f64 / 1e6,
    )
}

#[tokio::main]
async fn main() {
    let disk_secs: u64 = arg("--disk-seconds")
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let dir = std::env::temp_dir().join(format!("backstop-hardening-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, mock_port) = (free_port(), free_port());
    let store = dir.join("ledger.db");
    let config_path = dir.join("backstop.toml");
    std::fs::write(
        &config_path,
        config(port, mock_port, store.to_str().unwrap()),
    )
    .unwrap();
    let proc = Proc::spawn(
        &backstop_bin(),
        &["serve", "--config", config_path.to_str().unwrap()],
    );
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_up(&http, &format!("{url}/readyz")).await;
    let pid = proc.pid();
    let addr = format!("127.0.0.1:{port}");

    let mut rows = Vec::new();
    let only_disk = std::env::args().any(|a| a == "--only-disk");
    if !only_disk {
        rows.push(
            phase("baseline", &url, pid, Duration::from_secs(5), async {
                "none".to_string()
            })
            .await,
        );
        rows.push(
            phase(
                "2 recursive schemas",
                &url,
                pid,
                Duration::from_secs(5),
                burst(&url, recursive_bodies(), &[]),
            )
            .await,
        );
        let bodies = many_tools_bodies();
        rows.push(
            phase(
                "10 requests × 10,000 tools",
                &url,
                pid,
                Duration::from_secs(5),
                burst(&url, bodies, &[]),
            )
            .await,
        );
        rows.push(
            phase(
                "5,000 idle connections",
                &url,
                pid,
                Duration::from_secs(13),
                idle_connections(&addr, 5000, Duration::from_secs(12)),
            )
            .await,
        );
        let sse = vec![
        json!({"model": "gpt-4o-mini", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
        3
    ];
        rows.push(
            phase(
                "3 never-ending SSE events",
                &url,
                pid,
                Duration::from_secs(5),
                burst(&url, sse, &[("x-mock-fault", "huge_event=1000000000")]),
            )
            .await,
        );
    }
    let disk_summary = disk(&url, &dir, 1000, disk_secs).await;

    println!("| phase | what the attack got | others p50 ms | p99 ms | max ms | others' calls | errors | Backstop peak RSS MB |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.1} | {} | {} | {:.1} |",
            r.phase, r.attack, r.p50, r.p99, r.max, r.calls, r.errors, r.peak_rss_mb
        );
    }
    println!();
    println!("disk at 1,000 RPS: {disk_summary}");
    println!(
        "Backstop RSS at the end {:.1} MB, peak (VmHWM) {:.1} MB",
        proc_kb(pid, "VmRSS:") as f64 / 1024.0,
        proc_kb(pid, "VmHWM:") as f64 / 1024.0
    );
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}
