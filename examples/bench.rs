//! The benchmark runner: the mock upstream alone, then direct vs through a release
//! Backstop with its whole policy stack on, at a fixed 1,000 RPS (open loop) and at
//! saturation (closed loop, 32 connections), with validation off and on; Backstop's peak
//! RSS under that load and after 100,000 distinct sessions. Writes docs/benchmarks.md.
//!
//!     cargo build --release --bin backstop --example forwarder && cargo run --release --example bench
//!     cargo run --release --example bench -- --seconds 5 --out /tmp/bench.md

#[path = "common/mod.rs"]
mod common;

use std::{
    fmt::Write as _,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use base64::Engine;
use common::*;
use serde_json::json;

const KEY: &str = "bk-bench-full-stack";
/// A tenant with the core configuration only: auth and routing, no policy.
const CORE_KEY: &str = "bk-bench-core-only";
/// The full stack's tenant again, with `[tenants.side_effects]` declared.
const EFFECTS_KEY: &str = "bk-bench-side-effects";

#[derive(Clone)]
struct Call {
    url: String,
    key: Option<&'static str>,
    body: String,
    headers: Vec<(&'static str, String)>,
}

impl Call {
    fn request(&self, http: &reqwest::Client, session: Option<String>) -> reqwest::RequestBuilder {
        let mut req = http
            .post(&self.url)
            .header("content-type", "application/json")
            .body(self.body.clone());
        if let Some(key) = self.key {
            req = req.bearer_auth(key);
        }
        for (k, v) in &self.headers {
            req = req.header(*k, v);
        }
        if let Some(s) = session {
            req = req.header("x-session-id", s);
        }
        req
    }
}

struct Figures {
    p50: f64,
    p90: f64,
    p99: f64,
    rps: f64,
    errors: usize,
}

fn figures(mut lat: Vec<Duration>, elapsed: Duration, errors: usize) -> Figures {
    lat.sort();
    Figures {
        p50: pct(&lat, 0.5),
        p90: pct(&lat, 0.9),
        p99: pct(&lat, 0.99),
        rps: lat.len() as f64 / elapsed.as_secs_f64(),
        errors,
    }
}

async fn send(http: &reqwest::Client, call: &Call, session: Option<String>) -> bool {
    match call.request(http, session).send().await {
        Ok(r) => {
            let ok = r.status().is_success();
            let _ = r.bytes().await;
            ok
        }
        Err(_) => false,
    }
}

/// Closed loop: `conns` workers, each sending back to back, for `secs`.
async fn closed(http: &reqwest::Client, call: &Call, conns: usize, secs: u64) -> Figures {
    let stop = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..conns {
        let (http, call) = (http.clone(), call.clone());
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut errors) = (Vec::new(), 0);
            while Instant::now() < stop {
                let t = Instant::now();
                if send(&http, &call, Some(format!("bench-{w}"))).await {
                    lat.push(t.elapsed());
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        }));
    }
    let (mut lat, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await.unwrap();
        lat.extend(l);
        errors += e;
    }
    figures(lat, started.elapsed(), errors)
}

/// Open loop at a fixed rate: every request is its own task, released on schedule
/// whatever the earlier ones are doing (no coordinated omission), and timed from when it
/// was actually sent (tokio's timer releases on millisecond ticks, so timing from the due
/// time would add up to 1 ms of the generator's own slop to every figure).
async fn open(http: &reqwest::Client, call: &Call, rate: u64, secs: u64) -> Figures {
    let lat = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(AtomicUsize::new(0));
    let interval = Duration::from_nanos(1_000_000_000 / rate);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..rate * secs {
        let due = started + interval * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let (http, call, lat, errors) = (http.clone(), call.clone(), lat.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            if send(&http, &call, Some(format!("bench-{}", i % 64))).await {
                lat.lock().unwrap().push(sent.elapsed());
            } else {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    let lat = std::mem::take(&mut *lat.lock().unwrap());
    figures(lat, started.elapsed(), errors.load(Ordering::Relaxed))
}

fn config(port: u16, mock_port: u16, store: &str) -> String {
    // BENCH_LOG_LEVEL=warn measures without the per-request log line.
    let level = std::env::var("BENCH_LOG_LEVEL").unwrap_or_else(|_| "info".into());
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[log]
format = "json"
level = "{level}"
[store]
path = "{store}"
[retry]
max_attempts = 3
[breaker]
failure_threshold = 5
[[prices]]
model = "gpt-*"
input_per_mtok = 2.5
output_per_mtok = 10.0
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
[[upstreams]]
name = "mock-backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}, {{ upstream = "mock-backup" }}]
[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
requests_per_minute = 100000000
[tenants.session]
requests_per_minute = 100000000
max_calls = 1000000000
max_tokens = 1000000000000
max_usd = 1000000000.0
max_concurrent = 100000
[tenants.budget]
usd_per_day = 1000000000.0
tokens_per_day = 1000000000000
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 1000000000
[[tenants]]
name = "effects"
api_keys = ["{EFFECTS_KEY}"]
requests_per_minute = 100000000
[tenants.session]
requests_per_minute = 100000000
max_calls = 1000000000
max_tokens = 1000000000000
max_usd = 1000000000.0
max_concurrent = 100000
[tenants.budget]
usd_per_day = 1000000000.0
tokens_per_day = 1000000000000
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 1000000000
[tenants.side_effects]
tools = ["send_email", "transfer_*"]
[[tenants]]
name = "core"
api_keys = ["{CORE_KEY}"]
"#
    )
}

/// Waits until `url` answers a chat completion (the forwarder takes POSTs only).
async fn wait_up_post(http: &reqwest::Client, url: &str) {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"up?"}]}"#;
    for _ in 0..200 {
        let sent = http.post(url).body(body).send().await;
        if sent.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} did not come up");
}

fn row(out: &mut String, name: &str, f: &Figures) {
    let _ = writeln!(
        out,
        "| {name} | {:.3} | {:.3} | {:.3} | {:.0} | {} |",
        f.p50, f.p90, f.p99, f.rps, f.errors
    );
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

#[tokio::main]
async fn main() {
    let secs: u64 = arg("--seconds").and_then(|s| s.parse().ok()).unwrap_or(10);
    let out_path = arg("--out").unwrap_or_else(|| "docs/benchmarks.md".into());
    let sessions: usize = arg("--sessions")
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let bin = backstop_bin();
    let dir = std::env::temp_dir().join(format!("backstop-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, mock_port) = (free_port(), free_port());
    let _mock = Proc::spawn(
        &bin,
        &[
            "mock-upstream",
            "--listen",
            &format!("127.0.0.1:{mock_port}"),
        ],
    );
    let config_path = dir.join("bench.toml");
    std::fs::write(
        &config_path,
        config(port, mock_port, &dir.join("bench.db").display().to_string()),
    )
    .unwrap();
    let gw = Proc::spawn(&bin, &["serve", "--config", config_path.to_str().unwrap()]);
    // The floor: a bare hyper + reqwest forwarder (examples/forwarder.rs), built beside
    // this example.
    let floor_port = free_port();
    let floor_bin = std::env::current_exe()
        .expect("the bench's own path")
        .with_file_name("forwarder");
    let _floor = Proc::spawn(
        floor_bin.to_str().unwrap(),
        &[
            &floor_port.to_string(),
            &format!("http://127.0.0.1:{mock_port}"),
        ],
    );
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(512)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    wait_up(&http, &format!("http://127.0.0.1:{mock_port}/mock/stats")).await;
    wait_up(&http, &format!("http://127.0.0.1:{port}/readyz")).await;
    wait_up_post(
        &http,
        &format!("http://127.0.0.1:{floor_port}/v1/chat/completions"),
    )
    .await;

    let prompt = "What is the capital of France? Answer in one word.";
    let plain = json!({"model": "gpt-4o-mini", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]}).to_string();
    let schema = json!({"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"], "additionalProperties": false});
    let structured = json!({"model": "gpt-4o-mini", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}}}).to_string();
    let valid = base64::engine::general_purpose::STANDARD.encode(r#"{"capital": "Paris"}"#);
    let direct = Call {
        url: format!("http://127.0.0.1:{mock_port}/v1/chat/completions"),
        key: None,
        body: plain.clone(),
        headers: vec![],
    };
    let through = Call {
        url: format!("http://127.0.0.1:{port}/v1/chat/completions"),
        key: Some(KEY),
        body: plain,
        headers: vec![],
    };
    let validated = Call {
        body: structured,
        headers: vec![("x-mock-fault", format!("content_b64={valid}"))],
        ..through.clone()
    };
    let core = Call {
        key: Some(CORE_KEY),
        ..through.clone()
    };
    // The same stack in one session, without and with side effects declared: the
    // journal is read for every request of a session (and the answer parsed).
    let in_session = Call {
        headers: vec![("x-session-id", "bench-session".to_string())],
        ..through.clone()
    };
    let journaled = Call {
        key: Some(EFFECTS_KEY),
        headers: vec![("x-session-id", "bench-effects".to_string())],
        ..through.clone()
    };
    let floor = Call {
        url: format!("http://127.0.0.1:{floor_port}/v1/chat/completions"),
        ..direct.clone()
    };
    let direct_json = Call {
        headers: vec![("x-mock-fault", format!("content_b64={valid}"))],
        ..direct.clone()
    };

    eprintln!("warming up");
    closed(&http, &direct, 32, 2).await;
    closed(&http, &through, 32, 2).await;
    // `--only saturation|core|floor`: that one closed loop, for a profiler to attach to
    // the process whose pid is printed first.
    if let Some(only) = arg("--only") {
        let (call, pid) = match only.as_str() {
            "core" => (&core, gw.pid()),
            "floor" => (&floor, _floor.pid()),
            _ => (&through, gw.pid()),
        };
        eprintln!("pid {pid}");
        let f = closed(&http, call, 32, secs).await;
        let peak = proc_kb(pid, "VmHWM:") as f64 / 1024.0;
        eprintln!(
            "{only}: {:.0} req/s, p50 {:.3} ms, p99 {:.3} ms, errors {}, peak RSS {peak:.1} MB",
            f.rps, f.p50, f.p99, f.errors
        );
        return;
    }

    let mut out = String::new();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ = writeln!(out, "# Benchmarks\n");
    let _ = writeln!(out, "Measured by `cargo build --release --bin backstop --example forwarder && cargo run --release --example bench` (this file is its output), on {cores} cores ({cpu}), with the load generator, the mock upstream and Backstop on the same machine over loopback. Each row ran for {secs} s. Latencies in milliseconds.\n");
    let _ = writeln!(out, "Backstop ran with its whole policy stack on: tenant auth, tenant and session rate limits, session caps and a tenant day budget with reservations settled into the SQLite ledger (a file, WAL), the session guard, two-target routes with breakers and retry, metrics, and one JSON log line per request (to /dev/null). \"validation on\" adds a `response_format` JSON schema that every answer is checked against. \"core config\" is a second tenant of the same gateway with auth and routing only (no limits, budget, prices or guard; its calls still reach the ledger and the log). The bare forwarder (`examples/forwarder.rs`) is the floor: a hyper server and one shared reqwest client, the body collected and re-sent, nothing else.\n");

    eprintln!("mock alone");
    let mock_alone = closed(&http, &direct, 32, secs).await;
    let _ = writeln!(out, "## The mock upstream alone (closed loop, 32 connections)\n\n| path | p50 | p90 | p99 | req/s | errors |\n|---|---|---|---|---|---|");
    row(&mut out, "mock", &mock_alone);

    eprintln!("fixed rate");
    let d = open(&http, &direct, 1000, secs).await;
    let f = open(&http, &floor, 1000, secs).await;
    let c = open(&http, &core, 1000, secs).await;
    let b = open(&http, &through, 1000, secs).await;
    let dv = open(&http, &direct_json, 1000, secs).await;
    let bv = open(&http, &validated, 1000, secs).await;
    let bsn = open(&http, &in_session, 1000, secs).await;
    let bse = open(&http, &journaled, 1000, secs).await;
    let _ = writeln!(out, "\n## Fixed 1,000 RPS (open loop)\n\n| path | p50 | p90 | p99 | req/s | errors |\n|---|---|---|---|---|---|");
    row(&mut out, "direct", &d);
    row(&mut out, "bare forwarder (the floor)", &f);
    row(&mut out, "Backstop, core config", &c);
    row(&mut out, "Backstop, validation off", &b);
    row(&mut out, "direct (JSON answer)", &dv);
    row(&mut out, "Backstop, validation on", &bv);
    row(&mut out, "Backstop, every policy, in a session", &bsn);
    row(
        &mut out,
        "Backstop, every policy, in a session, side effects declared",
        &bse,
    );
    let _ = writeln!(
        out,
        "\nAdded by the floor at p50 / p99: {:+.3} / {:+.3} ms.",
        f.p50 - d.p50,
        f.p99 - d.p99
    );
    let _ = writeln!(
        out,
        "\nAdded by Backstop with the core config at p50 / p99: {:+.3} / {:+.3} ms.",
        c.p50 - d.p50,
        c.p99 - d.p99
    );
    let _ = writeln!(out, "\nAdded by Backstop with every policy at p50 / p99: validation off {:+.3} / {:+.3} ms; validation on {:+.3} / {:+.3} ms.", b.p50 - d.p50, b.p99 - d.p99, bv.p50 - dv.p50, bv.p99 - dv.p99);
    let _ = writeln!(out, "\nAdded by declaring side effects (`[tenants.side_effects]`, a request of a session with no tool results) at p50 / p99: {:+.3} / {:+.3} ms.", bse.p50 - bsn.p50, bse.p99 - bsn.p99);

    eprintln!("saturation");
    let ds = closed(&http, &direct, 32, secs).await;
    let fs = closed(&http, &floor, 32, secs).await;
    let cs = closed(&http, &core, 32, secs).await;
    let bs = closed(&http, &through, 32, secs).await;
    let bvs = closed(&http, &validated, 32, secs).await;
    let peak = proc_kb(gw.pid(), "VmHWM:");
    let _ = writeln!(out, "\n## Saturation (closed loop, 32 connections)\n\n| path | p50 | p90 | p99 | req/s | errors |\n|---|---|---|---|---|---|");
    row(&mut out, "direct", &ds);
    row(&mut out, "bare forwarder (the floor)", &fs);
    row(&mut out, "Backstop, core config", &cs);
    row(&mut out, "Backstop, validation off", &bs);
    row(&mut out, "Backstop, validation on", &bvs);
    let _ = writeln!(out, "\nBackstop's saturation throughput: {:.0}% of direct (validation off), {:.0}% (validation on); the floor's: {:.0}% of direct, so Backstop does {:.2}× the floor with every policy (validation off) and {:.2}× with the core config.", bs.rps / ds.rps * 100.0, bvs.rps / ds.rps * 100.0, fs.rps / ds.rps * 100.0, bs.rps / fs.rps, cs.rps / fs.rps);

    eprintln!("sessions");
    let before = proc_kb(gw.pid(), "VmRSS:");
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (http, call, next) = (http.clone(), through.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sessions {
                    break;
                }
                send(&http, &call, Some(format!("distinct-{i:08}"))).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let after = proc_kb(gw.pid(), "VmRSS:");
    let _ = writeln!(out, "\n## Memory\n\n| figure | MB |\n|---|---|");
    let _ = writeln!(
        out,
        "| Backstop peak RSS through the load above | {:.1} |",
        peak as f64 / 1024.0
    );
    let _ = writeln!(
        out,
        "| RSS before the sessions run | {:.1} |",
        before as f64 / 1024.0
    );
    let _ = writeln!(
        out,
        "| RSS after {sessions} distinct sessions | {:.1} |",
        after as f64 / 1024.0
    );
    let _ = writeln!(
        out,
        "| peak RSS overall | {:.1} |",
        proc_kb(gw.pid(), "VmHWM:") as f64 / 1024.0
    );
    let peak_all = proc_kb(gw.pid(), "VmHWM:") as f64 / 1024.0;
    let verdict = |ok: bool| if ok { "met" } else { "**missed**" };
    let (floor_p50, added_p50, added_p99) = (f.p50 - d.p50, b.p50 - d.p50, b.p99 - d.p99);
    let (every, core_share) = (bs.rps / fs.rps, cs.rps / fs.rps);
    let peak_mb = peak as f64 / 1024.0;
    let after_mb = after as f64 / 1024.0;
    let _ = writeln!(
        out,
        "\n## Against the targets (issue 29: ratios to the floor, same run)\n\n| target | measured | |\n|---|---|---|"
    );
    let _ = writeln!(
        out,
        "| saturation, every policy and a session id ≥ 0.9× the floor | {every:.2}× | {} |",
        verdict(every >= 0.9)
    );
    let _ = writeln!(
        out,
        "| saturation, core config ≥ 0.95× the floor | {core_share:.2}× | {} |",
        verdict(core_share >= 0.95)
    );
    let _ = writeln!(
        out,
        "| added p50 at 1,000 RPS ≤ the floor's + 0.15 ms ({:+.3} ms) | {added_p50:+.3} ms | {} |",
        floor_p50 + 0.15,
        verdict(added_p50 <= floor_p50 + 0.15)
    );
    let _ = writeln!(
        out,
        "| added p99 at 1,000 RPS ≤ 1 ms | {added_p99:+.3} ms | {} |",
        verdict(added_p99 <= 1.0)
    );
    let _ = writeln!(
        out,
        "| peak RSS under that load ≤ 40 MB | {peak_mb:.1} MB | {} |",
        verdict(peak_mb <= 40.0)
    );
    let _ = writeln!(out, "| RSS after 100,000 distinct sessions ≤ 100 MB | {after_mb:.1} MB ({sessions} sessions; peak {peak_all:.1} MB) | {} |", verdict(after_mb <= 100.0 && sessions >= 100_000));
    let _ = writeln!(
        out,
        "\nWhat limits these figures, and what was changed to reach them: `docs/performance.md`."
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
    print!("{out}");
    if let Some(parent) = std::path::Path::new(&out_path).parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    std::fs::write(&out_path, &out).unwrap();
    eprintln!("wrote {out_path}");
}
