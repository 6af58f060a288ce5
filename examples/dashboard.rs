//! The dashboard poll's cost: `GET /admin/ui/data` on a real Backstop holding N live
//! guarded sessions (default 10,000), each made by a real request through the gateway;
//! prints the time per refresh (p50, p95, max over 30 polls) and the bytes, for the
//! default `limit` (200), the largest one (1,000), and a filtered poll.
//!
//!     cargo build --release && cargo run --release --example dashboard -- [SESSIONS]
//!     (BACKSTOP_BIN=target/debug/backstop with a debug build)

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;

const KEY: &str = "bk-bench-dashboard-01";
const ADMIN: &str = "admin-bench-token-0123456789";
const POLLS: usize = 30;

#[tokio::main]
async fn main() {
    let sessions: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let dir = std::env::temp_dir().join(format!("backstop-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, mock_port) = (free_port(), free_port());
    let config_text = format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[log]
level = "warn"
[store]
path = ":memory:"
session_idle = "1h"
[mock]
listen = "127.0.0.1:{mock_port}"
[admin]
token = "{ADMIN}"
[[prices]]
model = "gpt-*"
input_per_mtok = 2.5
output_per_mtok = 10.0
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "t"
api_keys = ["{KEY}"]
[tenants.guard]
[tenants.budget]
usd_per_day = 100000.0
"#
    );
    let config_path = dir.join("dashboard.toml");
    std::fs::write(&config_path, &config_text).unwrap();
    let child = Proc::spawn(
        &backstop_bin(),
        &["serve", "--config", config_path.to_str().unwrap()],
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    wait_up(&http, &format!("{url}/readyz")).await;

    let started = Instant::now();
    one_call_per_session(&http, &url, KEY, sessions, 32).await;
    println!(
        "{sessions} live guarded sessions made through the gateway in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    println!("| poll | total sessions | p50 ms | p95 ms | max ms | bytes |");
    println!("|---|---|---|---|---|---|");
    for query in ["", "?limit=1000", "?state=tripped"] {
        let mut times = Vec::with_capacity(POLLS);
        let (mut bytes, mut total) = (0, 0);
        for _ in 0..POLLS {
            let t = Instant::now();
            let resp = http
                .get(format!("{url}/admin/ui/data{query}"))
                .bearer_auth(ADMIN)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let body = resp.bytes().await.unwrap();
            times.push(t.elapsed());
            bytes = body.len();
            let data: serde_json::Value = serde_json::from_slice(&body).unwrap();
            total = data["sessions"]["total"].as_u64().unwrap();
        }
        times.sort();
        println!(
            "| /admin/ui/data{query} | {total} | {:.1} | {:.1} | {:.1} | {bytes} |",
            pct(&times, 0.5),
            pct(&times, 0.95),
            times.last().map_or(f64::NAN, Duration::as_secs_f64) * 1e3,
        );
    }
    println!("RSS {} MB", proc_kb(child.pid(), "VmRSS:") / 1024);
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}
