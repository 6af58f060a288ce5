//! The Redis state backend's cost, in the same run: added latency at a paced 1,000 RPS
//! (budgets + rate limits + guard on, one session) for direct, embedded and redis;
//! reservations per second across 3 redis replicas, beside one embedded replica and
//! beside 3 embedded replicas that share nothing (the ceiling three processes reach on
//! this machine with Redis's cost left out); the admission decision time with Redis
//! stopped (SIGSTOP), how many Redis round trips a request makes and how long each one
//! waited, as the replica saw it (`backstop_state_seconds`). Needs
//! `redis-server` on PATH and a release build. `--cluster`: the same on a Redis Cluster
//! of three masters (`redis-cli --cluster create`). `--load SESSIONS CALLS`: only the
//! closed loop over the three redis replicas (after a 3 s pause to attach a profiler to
//! the pids it prints), with its round trips and CPU time per call and, with
//! `--slowlog`, redis-server's time per command (logging every command costs time of its
//! own: compare those figures with each other, not with a run without it).
//! `--workers N`: every process of the run (the gateways, the mock, this load generator)
//! runs its async runtime on N threads (`server.workers`); unset, tokio's default, the
//! machine's cores, for each of them.
//!
//! CPU time per call (every thread's, from `/proc`) is the figure to compare on a shared,
//! noisy machine: calls per second move with whatever else runs.
//!
//!     cargo build --release && cargo run --release --example replicas -- [SECONDS] [--cluster] [--workers N] [--load SESSIONS CALLS [--slowlog]]

#[path = "common/mod.rs"]
mod common;

use std::{
    process::Command,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, OnceLock,
    },
    time::{Duration, Instant},
};

use common::*;

const KEY: &str = "bk-bench-budgeted-0001";

/// The tenant's and the session's rate limits: 10,000 requests a second (a GCRA interval
/// of 100 µs in Redis, with a burst of a minute's worth), above anything the bench sends,
/// so they never refuse, but low enough that the rate is counted. A limit so high that
/// its interval rounds to 0 µs (1e8 a minute) is no limit in Redis: the gate skipped the
/// rate work, and the figures flattered Redis mode.
const RPM: u32 = 600_000;

/// `--workers N`: the runtime threads of every process of the run.
static WORKERS: OnceLock<Option<usize>> = OnceLock::new();

fn workers() -> Option<usize> {
    WORKERS.get().copied().flatten()
}

fn config(port: u16, mock: u16, dir: &std::path::Path, name: &str, state: &str) -> String {
    let path = dir.join(format!("{name}.toml"));
    let store = dir.join(format!("{name}.db"));
    std::fs::write(
        &path,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
{workers}
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
requests_per_minute = {RPM}
[tenants.session]
requests_per_minute = {RPM}
max_calls = 100000000
max_tokens = 100000000000
max_usd = 100000000.0
[tenants.budget]
usd_per_day = 100000000.0
[tenants.guard]
identical_request_limit = 1000000
"#,
            store = store.display(),
            workers = workers().map_or(String::new(), |n| format!("workers = {n}")),
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
    if status != 200 && (status != 503 || std::env::var_os("BENCH_SHOW_503").is_some()) {
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
    state_seconds(http, ports, "count").await
}

/// `backstop_state_seconds_{part}` (`count` or `sum`) by `op`, summed over `ports`.
async fn state_seconds(
    http: &reqwest::Client,
    ports: &[u16],
    part: &str,
) -> std::collections::BTreeMap<String, f64> {
    let prefix = format!("backstop_state_seconds_{part}{{op=\"");
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
            let Some(rest) = line.strip_prefix(&prefix) else {
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

/// Round trips per call between two [`round_trips`] readings: the total and by op.
fn per_call(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
    calls: f64,
) -> String {
    let by_op: Vec<(String, f64)> = after
        .iter()
        .map(|(op, n)| {
            let moved = n - before.get(op).copied().unwrap_or(0.0);
            (op.clone(), moved / calls)
        })
        .filter(|(_, n)| *n > 0.0)
        .collect();
    let total: f64 = by_op.iter().map(|(_, n)| n).sum();
    let ops: Vec<String> = by_op.iter().map(|(op, n)| format!("{op} {n:.2}")).collect();
    format!("{total:.2} ({})", ops.join(", "))
}

/// CPU time the processes have used so far, in nanoseconds (every thread's, from
/// `/proc/PID/task/*/schedstat`): on a shared machine, what one call costs whatever else
/// runs beside it.
fn cpu_ns(procs: &[Proc]) -> u64 {
    procs
        .iter()
        .map(|p| task_cpu_ns(&p.pid().to_string()))
        .sum()
}

/// [`cpu_ns`] of one process (`self` for this one: the load generator).
fn task_cpu_ns(pid: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

/// The p50 of a bare `PING` sent every millisecond, in ms: what one round trip to Redis
/// costs on this machine before any script runs (mostly the wake-ups at both ends).
async fn bare_round_trip(port: u16) -> f64 {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/0")).unwrap();
    let mut conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let mut took = Vec::with_capacity(2000);
    for _ in 0..2000 {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let t = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
        took.push(t.elapsed());
    }
    took.sort();
    pct(&took, 0.5)
}

async fn redis_conn(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/0"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// What the SLOWLOG (set to log every command) holds, as microseconds per call by
/// command: a script named by its first key's last part and its key count (`rate/4` is
/// the gate, `generation/8` the admission, `reservations/8` the settle).
async fn command_time(conn: &mut redis::aio::MultiplexedConnection, calls: f64) -> String {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(conn)
        .await
        .unwrap();
    let text = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        _ => String::new(),
    };
    let mut by: std::collections::BTreeMap<String, (u64, i64)> = Default::default();
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let (Some(redis::Value::Int(us)), Some(redis::Value::Array(args))) =
            (fields.get(2), fields.get(3))
        else {
            continue;
        };
        let args: Vec<String> = args.iter().map(text).collect();
        let name = match args.first().map(|a| a.to_ascii_lowercase()).as_deref() {
            Some("evalsha") | Some("eval") => format!(
                "{}/{}",
                args.get(3)
                    .and_then(|k| k.rsplit(':').next())
                    .unwrap_or("?"),
                args.get(2).map_or("?", String::as_str)
            ),
            Some(cmd) => cmd.to_string(),
            None => continue,
        };
        let e = by.entry(name).or_default();
        e.0 += 1;
        e.1 += us;
    }
    let total: i64 = by.values().map(|(_, us)| us).sum();
    let parts: Vec<String> = by
        .iter()
        .filter(|(_, (n, _))| *n as f64 >= calls / 100.0)
        .map(|(name, (n, us))| format!("{name} {:.1} ({n} calls)", *us as f64 / calls))
        .collect();
    format!("{:.1} in all: {}", total as f64 / calls, parts.join(", "))
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

/// Gateways driven together, and the Redis they share (none for the embedded one).
struct Fleet<'a> {
    urls: &'a [String],
    /// The gateways' ports, to read their round trips.
    ports: &'a [u16],
    replicas: &'a [Proc],
    redis: &'a [Proc],
    /// The mock upstream (the load generator is this process).
    mock: &'a Proc,
}

/// What one closed loop over a [`Fleet`] measured.
struct Measured {
    calls_per_s: f64,
    /// CPU per call of the gateways, and of redis-server.
    cpu_us: f64,
    redis_cpu_us: f64,
    /// CPU per call of the mock upstream and of the load generator.
    rest_cpu_us: f64,
    /// How busy the machine's cores were, all four kinds of process together (0–1).
    busy: f64,
    /// Redis round trips per call ([`per_call`]).
    trips: String,
}

impl Fleet<'_> {
    /// [`closed_loop`] at concurrency 32 over the gateways in turn, with its cost.
    async fn closed_loop(&self, http: &reqwest::Client, sessions: usize, total: usize) -> Measured {
        let before = round_trips(http, self.ports).await;
        let rest_ns = || cpu_ns(std::slice::from_ref(self.mock)) + task_cpu_ns("self");
        let (cpu, redis_cpu, rest) = (cpu_ns(self.replicas), cpu_ns(self.redis), rest_ns());
        let calls_per_s = closed_loop(http, self.urls, sessions, total, 32).await;
        let us_per_call = |before: u64, after: u64| (after - before) as f64 / 1e3 / total as f64;
        let (cpu_us, redis_cpu_us, rest_cpu_us) = (
            us_per_call(cpu, cpu_ns(self.replicas)),
            us_per_call(redis_cpu, cpu_ns(self.redis)),
            us_per_call(rest, rest_ns()),
        );
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Measured {
            calls_per_s,
            cpu_us,
            redis_cpu_us,
            rest_cpu_us,
            busy: (cpu_us + redis_cpu_us + rest_cpu_us) * calls_per_s / 1e6 / cores,
            trips: per_call(&before, &round_trips(http, self.ports).await, total as f64),
        }
    }
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

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let workers = args.iter().position(|a| a == "--workers").map(|at| {
        match args.get(at + 1).and_then(|n| n.parse().ok()) {
            Some(n) if n > 0 => n,
            _ => panic!("--workers takes a number of threads, 1 or more"),
        }
    });
    WORKERS.set(workers).unwrap();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = workers {
        runtime.worker_threads(n);
    }
    runtime.enable_all().build().unwrap().block_on(run());
}

async fn run() {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let bin = backstop_bin();
    let dir = std::env::temp_dir().join(format!("backstop-replicas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let args: Vec<String> = std::env::args().collect();
    let on_cluster = args.iter().any(|a| a == "--cluster");
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
    let mut mock_args = vec![
        "mock-upstream".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{mock}"),
    ];
    if let Some(n) = workers() {
        mock_args.extend(["--workers".into(), n.to_string()]);
    }
    let mock_args: Vec<&str> = mock_args.iter().map(String::as_str).collect();
    let mock_proc = Proc::spawn(&bin, &mock_args);
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
    // Three replicas that share nothing (each its own books): not a fleet, the ceiling
    // any fleet of three reaches on this machine, Redis's cost left out. `gateways` is
    // then [embedded, redis 0..3, alone 0..3].
    let alone_ports = [free_port(), free_port(), free_port()];
    for (i, port) in alone_ports.iter().enumerate() {
        let name = format!("alone-{i}");
        gateways.push(Proc::spawn(
            &bin,
            &["serve", "--config", &config(*port, mock, &dir, &name, "")],
        ));
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock}/mock/stats")).await;
    for port in std::iter::once(embedded_port)
        .chain(redis_ports)
        .chain(alone_ports)
    {
        wait_up(&http, &format!("http://127.0.0.1:{port}/readyz")).await;
    }
    let path = "/v1/chat/completions";
    let direct = format!("http://127.0.0.1:{mock}{path}");
    let embedded = format!("http://127.0.0.1:{embedded_port}{path}");
    let urls = |ports: &[u16]| -> Vec<String> {
        ports
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}{path}"))
            .collect()
    };
    let shared = urls(&redis_ports);
    let alone = urls(&alone_ports);
    // Warm every path.
    for url in [&direct, &embedded, &shared[0]] {
        closed_loop(&http, std::slice::from_ref(url), 1, 500, 16).await;
    }

    if let Some(at) = args.iter().position(|a| a == "--load") {
        let arg = |i: usize| args.get(at + i).and_then(|s| s.parse::<usize>().ok());
        let (sessions, total) = (arg(1).unwrap_or(1), arg(2).unwrap_or(20_000));
        let pids: Vec<String> = gateways[1..4]
            .iter()
            .chain(&redis)
            .map(|p| p.pid().to_string())
            .collect();
        println!("pids (3 replicas, then redis): {}", pids.join(","));
        tokio::time::sleep(Duration::from_secs(3)).await;
        // Logging every command costs redis-server time of its own: asked for alone.
        let mut slowlog = redis_conn(redis_port).await;
        let logged = args.iter().any(|a| a == "--slowlog");
        if logged {
            let _: () = redis::cmd("CONFIG")
                .arg(&[
                    "SET",
                    "slowlog-log-slower-than",
                    "0",
                    "slowlog-max-len",
                    "1000000",
                ])
                .query_async(&mut slowlog)
                .await
                .unwrap();
            let _: () = redis::cmd("SLOWLOG")
                .arg("RESET")
                .query_async(&mut slowlog)
                .await
                .unwrap();
        }
        let fleet = Fleet {
            urls: &shared,
            ports: &redis_ports,
            replicas: &gateways[1..4],
            redis: &redis,
            mock: &mock_proc,
        };
        let m = fleet.closed_loop(&http, sessions, total).await;
        println!(
            "redis, 3 replicas round-robin, {sessions} sessions: {:.0} calls/s; round trips per call {}",
            m.calls_per_s, m.trips
        );
        println!(
            "CPU per call: replicas {:.0} µs, redis-server {:.0} µs, the mock and the load generator {:.0} µs; the machine's cores {:.0}% busy",
            m.cpu_us, m.redis_cpu_us, m.rest_cpu_us, m.busy * 100.0
        );
        if logged {
            println!(
                "time redis-server spent running each command, per call (SLOWLOG, µs): {}",
                command_time(&mut slowlog, total as f64).await
            );
        }
        drop(gateways);
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let on = if on_cluster {
        "a 3-master Redis Cluster"
    } else {
        "one redis-server"
    };
    let threads = workers().map_or("the machine's cores (tokio's default)".to_string(), |n| {
        format!("{n} (--workers)")
    });
    println!("Paced 1,000 RPS for {seconds} s per row; budgets + rate limits + guard on, one session; release build, same run; redis rows on {on}; runtime threads of every process: {threads}\n");
    println!("| path | p50 ms | p99 ms | added p50 / p99 ms |\n|---|---|---|---|");
    let d = paced(&http, &direct, false, seconds).await;
    let (dp50, dp99) = (pct(&d, 0.5), pct(&d, 0.99));
    println!("| direct | {dp50:.3} | {dp99:.3} | |");
    let before = round_trips(&http, &redis_ports).await;
    let before_waited = state_seconds(&http, &redis_ports, "sum").await;
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
    println!(
        "\nRedis round trips per request in the redis row: {}",
        per_call(&before, &after, (seconds * 1000) as f64)
    );
    let waited = state_seconds(&http, &redis_ports, "sum").await;
    let means: Vec<String> = after
        .iter()
        .filter_map(|(op, n)| {
            let calls = n - before.get(op).copied().unwrap_or(0.0);
            let secs = waited.get(op)? - before_waited.get(op).copied().unwrap_or(0.0);
            (calls > 0.0).then(|| format!("{op} {:.0}", secs / calls * 1e6))
        })
        .collect();
    println!(
        "Each round trip's wait as the replica saw it, mean µs: {}",
        means.join(", ")
    );
    println!(
        "A bare PING, 1 ms apart as the paced row's calls are, through the client the gateway uses (redis-rs's ConnectionManager): p50 {:.0} µs",
        bare_round_trip(redis_port).await * 1e3
    );

    let total = 6000;
    println!("\nReserved calls per second, closed loop at concurrency 32, {total} calls; CPU per call of the gateways (and redis-server), from /proc; Redis round trips per call, all replicas; how busy the machine's cores were (every process of the row, the mock's and the load generator's included: their CPU per call in brackets):");
    println!("| setup | sessions | calls/s | CPU µs per call | round trips per call | cores busy |\n|---|---|---|---|---|---|");
    let one_replica = Fleet {
        urls: std::slice::from_ref(&embedded),
        ports: &[],
        replicas: &gateways[..1],
        redis: &[],
        mock: &mock_proc,
    };
    let fleet = Fleet {
        urls: &shared,
        ports: &redis_ports,
        replicas: &gateways[1..4],
        redis: &redis,
        mock: &mock_proc,
    };
    let unshared = Fleet {
        urls: &alone,
        ports: &[],
        replicas: &gateways[4..],
        redis: &[],
        mock: &mock_proc,
    };
    for sessions in [1, 64] {
        let one = one_replica.closed_loop(&http, sessions, total).await;
        let ceiling = unshared.closed_loop(&http, sessions, total).await;
        let three = fleet.closed_loop(&http, sessions, total).await;
        let busy = |m: &Measured| format!("{:.0}% [{:.0}]", m.busy * 100.0, m.rest_cpu_us);
        println!(
            "| embedded, 1 replica | {sessions} | {:.0} | {:.0} | | {} |",
            one.calls_per_s,
            one.cpu_us,
            busy(&one)
        );
        println!(
            "| embedded, 3 replicas sharing nothing (a ceiling, not a fleet) | {sessions} | {:.0} ({:.2}x) | {:.0} | | {} |",
            ceiling.calls_per_s,
            ceiling.calls_per_s / one.calls_per_s,
            ceiling.cpu_us,
            busy(&ceiling)
        );
        println!(
            "| redis, 3 replicas round-robin | {sessions} | {:.0} ({:.2}x) | {:.0} (+ {:.0}) | {} | {} |",
            three.calls_per_s,
            three.calls_per_s / one.calls_per_s,
            three.cpu_us,
            three.redis_cpu_us,
            three.trips,
            busy(&three)
        );
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
