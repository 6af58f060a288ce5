//! The Redis state backend's cost, in the same run: added latency at a paced 1,000 RPS
//! (budgets + rate limits + guard on, one session) for direct, embedded and redis;
//! reservations per second across 3 redis replicas; the admission decision time with
//! Redis stopped (SIGSTOP), and how many Redis round trips a request makes. Needs
//! `redis-server` on PATH and a release build. `--cluster`: the same on a Redis Cluster
//! of three masters (`redis-cli --cluster create`).
//!
//!     cargo build --release && cargo run --release --example replicas -- [SECONDS] [--cluster]

#[path = "common/mod.rs"]
mod common;

use std::{
    process::Command,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use common::*;

const KEY: &str = "bk-bench-budgeted-0001";

fn config(port: u16, mock: u16, dir: &std::path::Path, name: &str, state: &str) -> String {
    let path = dir.join(format!("{name}.toml"));
    let store = dir.join(format!("{name}.db"));
    std::fs::write(
        &path,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
[log]
level = "warn"
[store]
path = "{store}"
{state}
[[upstreams]]
name = "mock"
api = "openai"
base_url = "http://127.0.0.1:{mock}"
api_key = "sk-bench"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[prices]]
model = "gpt-*"
input_per_mtok = 2.5
output_per_mtok = 10.0
[[tenants]]
name = "budgeted"
api_keys = ["{KEY}"]
requests_per_minute = 100000000
[tenants.session]
requests_per_minute = 100000000
max_calls = 100000000
max_tokens = 100000000000
max_usd = 100000000.0
[tenants.budget]
usd_per_day = 100000000.0
[tenants.guard]
identical_request_limit = 1000000
"#,
            store = store.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

fn body(n: usize) -> String {
    format!(
        r#"{{"model":"gpt-4o-mini","max_tokens":16,"messages":[{{"role":"user","content":"step {n}"}}]}}"#
    )
}

/// Request `n`, in session `n % sessions` (one session when `sessions` is 1).
async fn call(
    http: &reqwest::Client,
    url: &str,
    auth: bool,
    n: usize,
    sessions: usize,
) -> (Duration, u16) {
    let mut req = http
        .post(url)
        .header("content-type", "application/json")
        .body(body(n));
    if auth {
        req = req
            .bearer_auth(KEY)
            .header("x-session-id", format!("bench-{}", n % sessions.max(1)));
    }
    let t = Instant::now();
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.bytes().await.unwrap();
    if status != 200 && status != 503 {
        eprintln!("{status}: {}", String::from_utf8_lossy(&body));
    }
    (t.elapsed(), status)
}

/// Redis round trips so far, by `op`, summed over `ports` (from each gateway's
/// `backstop_state_seconds` count: one per Redis call).
async fn round_trips(
    http: &reqwest::Client,
    ports: &[u16],
) -> std::collections::BTreeMap<String, f64> {
    let mut by_op = std::collections::BTreeMap::new();
    for port in ports {
        let text = http
            .get(format!("http://127.0.0.1:{port}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("backstop_state_seconds_count{op=\"") else {
                continue;
            };
            let Some((op, value)) = rest.split_once("\"}") else {
                continue;
            };
            let n: f64 = value.trim().parse().unwrap_or(0.0);
            *by_op.entry(op.to_string()).or_insert(0.0) += n;
        }
    }
    by_op
}

/// A request every millisecond for `seconds`, whatever the answers take.
async fn paced(http: &reqwest::Client, url: &str, auth: bool, seconds: u64) -> Vec<Duration> {
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut tasks = Vec::new();
    for n in 0..(seconds * 1000) as usize {
        tick.tick().await;
        let (http, url) = (http.clone(), url.to_string());
        tasks.push(tokio::spawn(
            async move { call(&http, &url, auth, n, 1).await },
        ));
    }
    let mut lat = Vec::new();
    for t in tasks {
        let (d, status) = t.await.unwrap();
        assert_eq!(status, 200);
        lat.push(d);
    }
    lat.sort();
    lat
}

/// Closed loop over several gateways in turn: calls (each one reservation) per second.
async fn closed_loop(
    http: &reqwest::Client,
    urls: &[String],
    sessions: usize,
    total: usize,
    c: usize,
) -> f64 {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (http, urls, next) = (http.clone(), urls.to_vec(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= total {
                    break;
                }
                let (_, status) = call(&http, &urls[n % urls.len()], true, n, sessions).await;
                assert_eq!(status, 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// Three `redis-server --cluster-enabled yes` joined into one cluster; the first node's
/// port names it.
fn start_cluster(dir: &std::path::Path) -> (Vec<Proc>, u16) {
    // A node's cluster bus listens 10000 above its port.
    let ports: Vec<u16> = (0..3u16)
        .map(|i| 21_000 + (std::process::id() % 4000) as u16 + i)
        .collect();
    let nodes: Vec<Proc> = ports
        .iter()
        .map(|port| {
            let conf = dir.join(format!("nodes-{port}.conf"));
            Proc::spawn(
                "redis-server",
                &[
                    "--port",
                    &port.to_string(),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    conf.to_str().unwrap(),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli");
    assert!(
        created.status.success(),
        "redis-cli --cluster create failed"
    );
    for port in &ports {
        for _ in 0..200 {
            let info = Command::new("redis-cli")
                .args(["-p", &port.to_string(), "cluster", "info"])
                .output()
                .unwrap();
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (nodes, ports[0])
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let bin = backstop_bin();
    let dir = std::env::temp_dir().join(format!("backstop-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let on_cluster = std::env::args().any(|a| a == "--cluster");
    let mock = free_port();
    let (redis, redis_port) = if on_cluster {
        start_cluster(&dir)
    } else {
        let port = free_port();
        let redis = Proc::spawn(
            "redis-server",
            &[
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
        );
        (vec![redis], port)
    };
    let _mock = Proc::spawn(
        &bin,
        &["mock-upstream", "--listen", &format!("127.0.0.1:{mock}")],
    );
    let state = format!(
        "[state]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:{redis_port}/0\"\ncluster = {on_cluster}\nreplicas = 3\nreservation_ttl = \"30s\""
    );
    let embedded_port = free_port();
    let redis_ports = [free_port(), free_port(), free_port()];
    let mut gateways = vec![Proc::spawn(
        &bin,
        &[
            "serve",
            "--config",
            &config(embedded_port, mock, &dir, "embedded", ""),
        ],
    )];
    for (i, port) in redis_ports.iter().enumerate() {
        let name = format!("redis-{i}");
        gateways.push(Proc::spawn(
            &bin,
            &[
                "serve",
                "--config",
                &config(*port, mock, &dir, &name, &state),
            ],
        ));
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock}/mock/stats")).await;
    for port in std::iter::once(embedded_port).chain(redis_ports) {
        wait_up(&http, &format!("http://127.0.0.1:{port}/readyz")).await;
    }
    let path = "/v1/chat/completions";
    let direct = format!("http://127.0.0.1:{mock}{path}");
    let embedded = format!("http://127.0.0.1:{embedded_port}{path}");
    let shared: Vec<String> = redis_ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}{path}"))
        .collect();
    // Warm every path.
    for url in [&direct, &embedded, &shared[0]] {
        closed_loop(&http, std::slice::from_ref(url), 1, 500, 16).await;
    }

    let on = if on_cluster {
        "a 3-master Redis Cluster"
    } else {
        "one redis-server"
    };
    println!("Paced 1,000 RPS for {seconds} s per row; budgets + rate limits + guard on, one session; release build, same run; redis rows on {on}\n");
    println!("| path | p50 ms | p99 ms | added p50 / p99 ms |\n|---|---|---|---|");
    let d = paced(&http, &direct, false, seconds).await;
    let (dp50, dp99) = (pct(&d, 0.5), pct(&d, 0.99));
    println!("| direct | {dp50:.3} | {dp99:.3} | |");
    let before = round_trips(&http, &redis_ports).await;
    for (name, url) in [("embedded", &embedded), ("redis", &shared[0])] {
        let b = paced(&http, url, true, seconds).await;
        println!(
            "| {name} | {:.3} | {:.3} | {:+.3} / {:+.3} |",
            pct(&b, 0.5),
            pct(&b, 0.99),
            pct(&b, 0.5) - dp50,
            pct(&b, 0.99) - dp99
        );
    }

    let after = round_trips(&http, &redis_ports).await;
    let requests = (seconds * 1000) as f64;
    let per_op: Vec<String> = after
        .iter()
        .map(|(op, n)| (op, (n - before.get(op).copied().unwrap_or(0.0)) / requests))
        .filter(|(_, n)| *n > 0.0)
        .map(|(op, n)| format!("{op} {n:.2}"))
        .collect();
    let total_trips: f64 = after
        .iter()
        .map(|(op, n)| n - before.get(op).copied().unwrap_or(0.0))
        .sum::<f64>()
        / requests;
    println!(
        "\nRedis round trips per request in the redis row: {total_trips:.2} ({})",
        per_op.join(", ")
    );

    let total = 6000;
    println!("\nReserved calls per second, closed loop at concurrency 32, {total} calls:");
    println!("| setup | sessions | calls/s |\n|---|---|---|");
    for sessions in [1, 64] {
        let one = closed_loop(&http, std::slice::from_ref(&embedded), sessions, total, 32).await;
        let three = closed_loop(&http, &shared, sessions, total, 32).await;
        println!("| embedded, 1 replica | {sessions} | {one:.0} |");
        println!("| redis, 3 replicas round-robin | {sessions} | {three:.0} |");
    }

    for node in &redis {
        Command::new("kill")
            .args(["-STOP", &node.pid().to_string()])
            .status()
            .unwrap();
    }
    let mut decided = Vec::new();
    for n in 0..20 {
        let (d, status) = call(&http, &shared[n % 3], true, n, 1).await;
        assert_eq!(status, 503);
        decided.push(d);
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    decided.sort();
    for node in &redis {
        Command::new("kill")
            .args(["-CONT", &node.pid().to_string()])
            .status()
            .unwrap();
    }
    println!(
        "\nRedis stopped (SIGSTOP), command_timeout 100ms, 20 calls 1.1 s apart (each one probes): decided in p50 {:.1} ms, max {:.1} ms (503 state_unavailable)",
        pct(&decided, 0.5),
        pct(&decided, 1.0)
    );
    drop(gateways);
    let _ = std::fs::remove_dir_all(&dir);
}
