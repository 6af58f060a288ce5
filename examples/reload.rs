//! Reload time with 100 routes and 1,000 tenants (each with session caps, a day budget,
//! a rate limit and a guard), with live state for every tenant, and what requests
//! running through the reloads see.
//!
//!     cargo run --release --example reload -- [RELOADS]
//!
//! Prints the time per reload (read + validate + build + swap, as `POST /admin/reload`
//! does it) and the latency and status of requests sent while reloads happen, next to
//! the same load with no reloads.

#[path = "common/mod.rs"]
mod common;

use std::{
    fmt::Write as _,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use backstop::{config::Config, mock, server};
use common::pct;
use tokio::net::TcpListener;

const ROUTES: usize = 100;
const TENANTS: usize = 1000;
const WORKERS: usize = 8;

fn config_text(mock: std::net::SocketAddr, max_calls: u32) -> String {
    let mut text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[log]
level = "error"
[store]
path = ":memory:"
[admin]
token = "reload-bench-admin-token"
[[prices]]
model = "*"
input_per_mtok = 1.0
output_per_mtok = 2.0
[[upstreams]]
name = "a"
api = "openai"
base_url = "http://{mock}"
[[upstreams]]
name = "b"
api = "openai"
base_url = "http://{mock}"
"#
    );
    for r in 0..ROUTES {
        let _ = write!(
            text,
            "[[routes]]\nmodel = \"model-{r}\"\ntargets = [{{ upstream = \"a\" }}, {{ upstream = \"b\", model = \"gpt-4o-mini\" }}]\n"
        );
    }
    for t in 0..TENANTS {
        let _ = write!(
            text,
            r#"[[tenants]]
name = "tenant-{t}"
api_keys = ["bk-reload-bench-{t:04}"]
requests_per_minute = 100000
[tenants.budget]
usd_per_day = 1000.0
[tenants.session]
max_calls = {max_calls}
[tenants.guard]
"#
        );
    }
    text
}

async fn load(
    url: &str,
    stop: &AtomicBool,
    statuses: &AtomicUsize,
    failed: &AtomicUsize,
) -> Vec<Duration> {
    let http = reqwest::Client::new();
    let mut latencies = Vec::new();
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let (t, r) = (fastrand::usize(..TENANTS), fastrand::usize(..ROUTES));
        let started = Instant::now();
        let resp = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(format!("bk-reload-bench-{t:04}"))
            .header("x-session-id", format!("s-{}", n % 50))
            .body(format!(
                r#"{{"model":"model-{r}","messages":[{{"role":"user","content":"hi {n}"}}]}}"#
            ))
            .send()
            .await;
        latencies.push(started.elapsed());
        statuses.fetch_add(1, Ordering::Relaxed);
        if !resp.is_ok_and(|r| r.status() == 200) {
            failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    latencies
}

/// Runs the load for `during`, reloading every `every` if set; (latencies, requests,
/// failures, reload times).
async fn phase(
    gw: &Arc<server::ServerHandle>,
    path: &std::path::Path,
    mock: std::net::SocketAddr,
    during: Duration,
    every: Option<Duration>,
) -> (Vec<Duration>, usize, usize, Vec<Duration>) {
    let url = format!("http://{}", gw.addr);
    let stop = Arc::new(AtomicBool::new(false));
    let (count, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (url, stop, count, failed) =
                (url.clone(), stop.clone(), count.clone(), failed.clone());
            tokio::spawn(async move { load(&url, &stop, &count, &failed).await })
        })
        .collect();
    let started = Instant::now();
    let mut reloads = Vec::new();
    while started.elapsed() < during {
        match every {
            Some(every) => {
                tokio::time::sleep(every).await;
                // Alternate the caps so every reload changes every tenant.
                let max_calls = if reloads.len() % 2 == 0 {
                    1_000_001
                } else {
                    1_000_000
                };
                std::fs::write(path, config_text(mock, max_calls)).unwrap();
                let reloaded = gw.reload().await.expect("the bench config is valid");
                reloads.push(reloaded.took);
            }
            None => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    latencies.sort_unstable();
    (
        latencies,
        count.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        reloads,
    )
}

#[tokio::main]
async fn main() {
    let reloads: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let dir = std::env::temp_dir().join(format!("backstop-reload-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("backstop.toml");
    std::fs::write(&path, config_text(mock.addr, 1_000_000)).unwrap();
    let config = Config::load(&path).unwrap();
    let gw = Arc::new(server::spawn(config).await.unwrap());
    println!(
        "{ROUTES} routes, {TENANTS} tenants (session caps, day budget, rate limit, guard each), config {} KB",
        std::fs::metadata(&path).unwrap().len() / 1024
    );

    // Live state for every tenant: a session with spend and a guard entry.
    let http = reqwest::Client::new();
    let url = format!("http://{}", gw.addr);
    for t in 0..TENANTS {
        let resp = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(format!("bk-reload-bench-{t:04}"))
            .header("x-session-id", "warm")
            .body(r#"{"model":"model-0","messages":[{"role":"user","content":"warm"}]}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }

    let every = Duration::from_millis(250);
    let during = every * reloads;
    let (base, base_n, base_failed, _) = phase(&gw, &path, mock.addr, during, None).await;
    let (under, n, failed, mut took) = phase(&gw, &path, mock.addr, during, Some(every)).await;
    took.sort_unstable();
    println!(
        "reload (read + validate + build + swap): {} reloads, p50 {:.1} ms, p95 {:.1} ms, max {:.1} ms",
        took.len(),
        pct(&took, 0.50),
        pct(&took, 0.95),
        pct(&took, 1.0),
    );
    println!(
        "requests, {WORKERS} closed-loop workers, no reloads:        {base_n} sent, {base_failed} not 200, p50 {:.2} ms, p99 {:.2} ms",
        pct(&base, 0.50),
        pct(&base, 0.99)
    );
    println!(
        "requests, {WORKERS} closed-loop workers, a reload every {} ms: {n} sent, {failed} not 200, p50 {:.2} ms, p99 {:.2} ms",
        every.as_millis(),
        pct(&under, 0.50),
        pct(&under, 0.99)
    );
    let version = gw.current().stamp.version;
    println!("config version at the end: {version}");
    let _ = std::fs::remove_dir_all(&dir);
}
