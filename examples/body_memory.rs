//! Issue 24 item 5's figures: what large request bodies cost Backstop's memory. The
//! binary runs as a child process with the mock upstream in another process (so only
//! the gateway's own memory is measured); its RSS is sampled from /proc every 5 ms.
//!
//! Phases, each `--parallel` (12) bodies of about 10.2 MB sent at once:
//! - `messages`: 300,000 one-word chat messages (over the item limit);
//! - `junk`: 150,000 small objects in a field no item limit names (under
//!   `max_json_values`: only the in-flight budget holds it);
//! - `allowed`: 10,000 messages of 1 KB each (under every limit: served).
//!
//! For each: the statuses, the peak RSS while in flight, and the RSS once they finished
//! (after `--settle` seconds, 3), against the baseline measured before the first phase.
//!
//!     cargo build --release && cargo run --release --example body_memory
//!
//! `BACKSTOP_BIN=target/debug/backstop` measures a debug build instead; `--server
//! "KEY = VALUE"` adds to the `[server]` section (e.g. `max_body_bytes_in_flight`).

mod common;

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::*;

const KEY: &str = "bk-body-memory";

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn config(port: u16, mock_port: u16, store: &str) -> String {
    let extra = arg("--server").unwrap_or_default();
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
drain_delay = "0s"
request_timeout = "300s"
{extra}
[log]
level = "error"
[store]
path = "{store}"
[[upstreams]]
name = "mock"
api = "openai"
base_url = "http://127.0.0.1:{mock_port}"
attempt_timeout = "300s"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
"#
    )
}

/// `{"model":…,"<field>":[item,item,…]}` with `count` copies of `item`.
fn body(field: &str, item: &str, count: usize) -> String {
    let mut text = String::with_capacity(count * (item.len() + 1) + 64);
    text.push_str(r#"{"model":"gpt-4o-mini","max_tokens":16,"#);
    if field != "messages" {
        text.push_str(r#""messages":[{"role":"user","content":"hi"}],"#);
    }
    text.push_str(&format!("\"{field}\":["));
    for i in 0..count {
        if i > 0 {
            text.push(',');
        }
        text.push_str(item);
    }
    text.push_str("]}");
    text
}

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

async fn phase(
    name: &str,
    http: &reqwest::Client,
    url: &str,
    pid: u32,
    body: String,
    parallel: usize,
    settle: Duration,
) {
    let size = body.len();
    let body = bytes::Bytes::from(body);
    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(proc_kb(pid, "VmRSS:"), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..parallel {
        let (http, url, body) = (http.clone(), url.to_string(), body.clone());
        tasks.push(tokio::spawn(async move {
            match http
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(KEY)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
            {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let text = resp.text().await.unwrap_or_default();
                    let code = serde_json::from_str::<serde_json::Value>(&text)
                        .ok()
                        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
                        .unwrap_or_default();
                    format!("{status} {code}").trim().to_string()
                }
                Err(e) => format!("error: {e}"),
            }
        }));
    }
    let mut statuses = BTreeMap::new();
    for t in tasks {
        *statuses.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    let elapsed = started.elapsed();
    tokio::time::sleep(settle).await;
    done.store(true, Ordering::Relaxed);
    sampler.await.unwrap();
    println!(
        "| {name} | {parallel} × {:.1} MB | {statuses:?} | {:.1} s | {:.1} | {:.1} |",
        size as f64 / 1e6,
        elapsed.as_secs_f64(),
        mb(peak.load(Ordering::Relaxed)),
        mb(proc_kb(pid, "VmRSS:")),
    );
}

#[tokio::main]
async fn main() {
    let parallel: usize = arg("--parallel").and_then(|s| s.parse().ok()).unwrap_or(12);
    let settle = Duration::from_secs(arg("--settle").and_then(|s| s.parse().ok()).unwrap_or(3));
    let items: usize = arg("--items")
        .and_then(|s| s.parse().ok())
        .unwrap_or(300_000);
    let dir = std::env::temp_dir().join(format!("backstop-body-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, mock_port) = (free_port(), free_port());
    let config_path = dir.join("backstop.toml");
    let store = dir.join("ledger.db");
    std::fs::write(
        &config_path,
        config(port, mock_port, store.to_str().unwrap()),
    )
    .unwrap();
    let mock_listen = format!("127.0.0.1:{mock_port}");
    let _mock = Proc::spawn(
        &backstop_bin(),
        &["mock-upstream", "--listen", &mock_listen],
    );
    let proc = Proc::spawn(
        &backstop_bin(),
        &["serve", "--config", config_path.to_str().unwrap()],
    );
    let url = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    wait_up(&http, &format!("{url}/readyz")).await;
    let pid = proc.pid();
    // Warm up: a few ordinary calls, so the baseline includes the runtime's own buffers.
    for _ in 0..20 {
        let resp = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(KEY)
            .body(r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .unwrap();
        let _ = resp.bytes().await;
    }
    let baseline = proc_kb(pid, "VmRSS:");
    println!(
        "Backstop {} baseline RSS {:.1} MB",
        backstop_bin(),
        mb(baseline)
    );
    println!();
    println!("| phase | bodies | statuses | time | peak RSS MB | RSS after MB |");
    println!("|---|---|---|---|---|---|");
    let content = "x".repeat(1000);
    let phases = [
        (
            "messages",
            body("messages", r#"{"role":"user","content":"abcd"}"#, items),
        ),
        (
            "junk",
            body("x", &format!(r#"{{"a":"{}"}}"#, "y".repeat(60)), items / 2),
        ),
        (
            "allowed",
            body(
                "messages",
                &format!(r#"{{"role":"user","content":"{content}"}}"#),
                items / 30,
            ),
        ),
    ];
    for (name, text) in phases {
        phase(name, &http, &url, pid, text, parallel, settle).await;
    }
    println!();
    println!(
        "baseline {:.1} MB, peak (VmHWM) {:.1} MB, at the end {:.1} MB (+{:.1} MB)",
        mb(baseline),
        mb(proc_kb(pid, "VmHWM:")),
        mb(proc_kb(pid, "VmRSS:")),
        mb(proc_kb(pid, "VmRSS:").saturating_sub(baseline)),
    );
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}
