//! Helpers shared by the benchmark examples: child processes, ports, percentiles, RSS.
#![allow(dead_code)]

use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

#[path = "../../tests/common/ports.rs"]
mod ports;
#[allow(unused_imports)]
pub use ports::free_port;

/// A child process killed on drop.
pub struct Proc(pub Child);

impl Proc {
    pub fn spawn(bin: &str, args: &[&str]) -> Proc {
        Proc(
            Command::new(bin)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("{bin}: {e} (build it first: cargo build --release --bin backstop --example forwarder)")),
        )
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn backstop_bin() -> String {
    std::env::var("BACKSTOP_BIN").unwrap_or_else(|_| "target/release/backstop".into())
}

pub async fn wait_up(http: &reqwest::Client, url: &str) {
    for _ in 0..200 {
        if http
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} did not come up");
}

/// The `p` quantile of sorted latencies, in milliseconds.
pub fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

/// A `/proc/PID/status` figure in kB (`VmRSS:`, `VmHWM:`).
pub fn proc_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Sends `count` chat calls to the gateway at `url`, each in its own session
/// (`session-00000000`, ...), `concurrency` at a time; each must answer 200.
pub async fn one_call_per_session(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    count: usize,
    concurrency: usize,
) {
    use std::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    };
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, key, next) = (http.clone(), url.to_string(), key.to_string(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let resp = http
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth(&key)
                    .header("x-session-id", format!("session-{i:08}"))
                    .body(r#"{"model":"gpt-4o","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}"#)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let _ = resp.bytes().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// The config of a gateway in this process: any port, errors-only logs, an in-memory
/// store, one upstream `mock` at `mock` (forwarding the `x-mock-*` headers), and `rest`
/// (routes, tenants, other sections) after it.
pub fn in_process_config(mock: std::net::SocketAddr, rest: &str) -> backstop::config::Config {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[log]
level = "error"
[store]
path = ":memory:"
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}"
{rest}
"#
    );
    backstop::config::Config::from_toml_with_env(&text, |_| None).unwrap()
}
