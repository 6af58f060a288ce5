//! What the fleet view costs (issue 28's targets): its memory for 100,000 distinct
//! failure signatures in one tenant (target: 20 MB), embedded and in Redis, and the
//! latency the failure path adds (target: 0.1 ms at p50).
//!
//! - Memory, embedded: the heap a tenant's view holds, counted by this program's
//!   allocator, after 100,000 distinct signatures failing once each (one session each);
//!   after 100,000 failing twice each (in two sessions); and its worst case, the full
//!   table holding its most session records.
//! - Memory, Redis (when `redis-server` is on PATH): `used_memory` of a fresh server
//!   before and after the same 100,000 failures, through the replicas' scripts.
//! - The failure path in process: reading a realistic request's shape (a 2 KB system
//!   prompt, 30 messages), naming the failure, and counting it in the view, per failure;
//!   and the check a success pays when no signature is hot.
//! - The failure path end to end: failing requests (a 400 passed through) of distinct
//!   sessions through a real gateway, with the fleet view off and on, request by request
//!   in turn; and
//!   the same in replica mode (`[state] backend = "redis"`, on the server above), where
//!   the fleet's count rides on the guard's write-back.
//!
//!     cargo run --release --example fleet_cost
//!
//! The machine is shared and has two cores: latencies vary between runs.

mod common;

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::{
        atomic::{AtomicIsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use backstop::{
    api::{signature, Endpoint},
    clock::Clock,
    config::{Config, StateConfig},
    mock,
    policy::fleet::{session_key, FailureKind, FleetPolicy, Signature, TenantView},
    server,
    state::{fleet::SharedFleet, shared::Redis},
};
use common::pct;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};
use tokio::net::TcpListener;

/// Counts the bytes this program holds on the heap.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only sizes are counted.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

fn mb(bytes: isize) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

fn policy() -> Arc<FleetPolicy> {
    Arc::new(FleetPolicy {
        min_sessions: 3,
        min_failures: 2,
        window: Duration::from_secs(600),
        preempt: true,
        cool_down: Duration::from_secs(60),
    })
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!(),
    }
}

/// A request of task `i`: a 2 KB system prompt, 30 messages, a last user message of its
/// own words (so each `i` is a shape of its own).
fn request(i: u64) -> Map<String, Value> {
    let words = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    ];
    let task: Vec<&str> = (0..6)
        .map(|k| words[((i >> (3 * k)) & 7) as usize])
        .collect();
    let mut messages =
        vec![json!({"role": "system", "content": "You are a coding agent. ".repeat(90)})];
    for k in 0..28 {
        let role = if k % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": format!("message {k} of the conversation, with some detail about file src/module_{k}.rs")}));
    }
    messages.push(json!({"role": "user", "content": format!(
        "Please {} {} in the repository, step {i}, then run the tests and report which ones fail and why, with the file paths involved and the exact errors.",
        task.join(" "), i % 1000
    )}));
    object(json!({"model": "gpt-4o", "messages": messages}))
}

fn failure(code: &str) -> FailureKind {
    FailureKind {
        class: "caller_fault",
        code: code.to_string(),
        detail: "HTTP 400".to_string(),
    }
}

/// Distinct signatures of distinct shapes (the description is what the real one is).
fn signature_of(i: u64) -> Signature {
    let shape = signature::shape("gpt-*", Endpoint::ChatCompletions, &request(i));
    Signature::new(&shape, &failure("invalid_value"))
}

fn memory_embedded() {
    let t = 1_700_000_000_000;
    for (label, sessions_each) in [
        ("failing once each", 1),
        ("failing twice each, in two sessions", 2),
    ] {
        let before = live();
        let mut view = TenantView::new(policy());
        // Each signature made as a failure makes it: what the view keeps of it is its own.
        for i in 0..100_000u64 {
            let sig = signature_of(i);
            for s in 0..sessions_each {
                view.failed(t + i as i64, &sig, i << 8 | s, 1, 0.01);
            }
        }
        let held = live() - before;
        println!(
            "| embedded | 100,000 distinct signatures {label} | {} | {} |",
            view.len(),
            mb(held)
        );
        drop(view);
    }
    // The worst case: the full table, its signatures holding session records up to the
    // tenant's bound (and past it: the largest give theirs up).
    let before = live();
    let mut view = TenantView::new(policy());
    for i in 0..8192u64 {
        let sig = signature_of(i);
        for s in 0..17u64 {
            view.failed(t + i as i64, &sig, i << 8 | s, 1, 0.01);
        }
    }
    println!(
        "| embedded | worst case: 8,192 signatures x 17 sessions (past the tenant's 131,072 session records) | {} | {} |",
        view.len(),
        mb(live() - before)
    );
}

/// A fresh `redis-server` of this program's own: its URL and process.
async fn start_redis() -> Option<(String, common::Proc)> {
    let port = common::free_port();
    let server = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn();
    let server = common::Proc(server.ok()?);
    tokio::time::sleep(Duration::from_millis(300)).await;
    Some((format!("redis://127.0.0.1:{port}/0"), server))
}

async fn memory_redis() -> Option<(SharedFleet, String, common::Proc)> {
    let Some((url, server)) = start_redis().await else {
        println!("| redis | (redis-server not on PATH: not measured) | | |");
        return None;
    };
    let redis = Redis::new(&StateConfig {
        url: Some(url.clone()),
        command_timeout: Duration::from_secs(5),
        ..StateConfig::default()
    })
    .unwrap();
    let used = |redis: Arc<Redis>| async move {
        let info: String = redis
            .run("info", |mut c| async move {
                redis::cmd("INFO").arg("memory").query_async(&mut c).await
            })
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse::<isize>().ok())
            .unwrap_or(0)
    };
    let clock = Clock::system();
    let fleet = SharedFleet::new(redis.clone(), clock);
    let policy = policy();
    let sigs: Vec<Signature> = (0..100_000).map(signature_of).collect();
    for (label, tenant, sessions_each) in [
        ("failing once each", "tenant-a", 1u64),
        ("failing twice each, in two sessions", "tenant-b", 2),
    ] {
        let before = used(redis.clone()).await;
        let work = sigs
            .iter()
            .enumerate()
            .flat_map(|(i, sig)| (0..sessions_each).map(move |s| (sig, (i as u64) << 8 | s)));
        futures_util::stream::iter(work)
            .for_each_concurrent(32, |(sig, session)| {
                let (fleet, policy) = (&fleet, &policy);
                async move {
                    fleet
                        .failed(tenant, policy, sig, session, 1, 0.01)
                        .await
                        .unwrap();
                }
            })
            .await;
        let after = used(redis.clone()).await;
        println!(
            "| redis | 100,000 distinct signatures {label} | | {} |",
            mb(after - before)
        );
    }
    Some((fleet, url, server))
}

fn latency_in_process() {
    let policy = policy();
    let mut view = TenantView::new(policy.clone());
    let requests: Vec<Map<String, Value>> = (0..2_000).map(request).collect();
    let t = 1_700_000_000_000;
    let mut times = Vec::with_capacity(20_000);
    let mut hot = 0;
    for n in 0..20_000u64 {
        let json = &requests[(n % 2_000) as usize];
        let session = format!("session-{n}");
        let started = Instant::now();
        let shape = signature::shape("gpt-*", Endpoint::ChatCompletions, json);
        let sig = Signature::new(&shape, &failure("context_length_exceeded"));
        let failed = view.failed(t + n as i64, &sig, session_key(&session), 1, 0.01);
        times.push(started.elapsed());
        hot += usize::from(failed.trip.is_some());
    }
    times.sort();
    println!(
        "| in process: shape + signature + count, per failure (20,000; {hot} tripped) | {:.4} | {:.4} |",
        pct(&times, 0.5),
        pct(&times, 0.99)
    );
    // A success while nothing is hot: the one question asked.
    let calm = TenantView::new(policy);
    let started = Instant::now();
    let mut watching = 0;
    for _ in 0..1_000_000 {
        watching += usize::from(std::hint::black_box(&calm).watching());
    }
    println!(
        "| in process: a success while no signature is hot (`watching`, nothing hashed) | {:.6} | (mean; {watching} of 1,000,000 watched) |",
        started.elapsed().as_secs_f64() * 1e3 / 1e6
    );
}

async fn latency_redis(fleet: &SharedFleet) {
    let policy = policy();
    let mut times = Vec::new();
    for n in 0..5_000u64 {
        let json = request(n % 500);
        let started = Instant::now();
        let shape = signature::shape("gpt-*", Endpoint::ChatCompletions, &json);
        let sig = Signature::new(&shape, &failure("context_length_exceeded"));
        fleet
            .failed(
                "tenant-latency",
                &policy,
                &sig,
                session_key(&format!("s{n}")),
                1,
                0.01,
            )
            .await
            .unwrap();
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "| redis: shape + signature + the script's round trip, per failure (5,000, one at a time) | {:.4} | {:.4} |",
        pct(&times, 0.5),
        pct(&times, 0.99)
    );
}

/// A gateway with tenant `t` guarded, its fleet view on or off; in replica mode with
/// `state` (a `[state]` section).
fn gateway_config(mock: std::net::SocketAddr, fleet: bool, state: &str) -> Config {
    let fleet = if fleet {
        "[tenants.guard.fleet]\nmin_sessions = 3\nmin_failures = 2\n"
    } else {
        ""
    };
    common::in_process_config(
        mock,
        &format!(
            r#"
{state}
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "t"
api_keys = ["bk-fleet-cost-key"]
[tenants.guard]
{fleet}
"#
        ),
    )
}

/// Failing requests of distinct sessions through two gateways, the fleet view off and
/// on, interleaved; in replica mode when `redis` (a URL) is given, each gateway under a
/// key prefix of its own.
async fn latency_end_to_end(redis: Option<&str>) {
    let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let state = |name: &str| {
        redis.map_or(String::new(), |url| {
            format!("[state]\nbackend = \"redis\"\nurl = \"{url}\"\nkey_prefix = \"cost-{name}\"\nreplicas = 2\n")
        })
    };
    let off = server::spawn(gateway_config(mock.addr, false, &state("off")))
        .await
        .unwrap();
    let on = server::spawn(gateway_config(mock.addr, true, &state("on")))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let bodies: Vec<String> = (0..500)
        .map(|i| Value::Object(request(i)).to_string())
        .collect();
    let mut times = [Vec::new(), Vec::new()];
    let urls = [&off, &on].map(|gw| format!("http://{}/v1/chat/completions", gw.addr));
    // Off and on take turns request by request (which goes first alternating), so a burst
    // of the machine's other load falls on both alike.
    for round in 0..6u64 {
        for n in 0..500u64 {
            for k in [n % 2, 1 - n % 2] {
                let k = k as usize;
                let started = Instant::now();
                let resp = http
                    .post(&urls[k])
                    .bearer_auth("bk-fleet-cost-key")
                    .header("x-session-id", format!("r{round}-{n}"))
                    .header("x-mock-fault", "status=400;code=context_length_exceeded")
                    .body(bodies[n as usize].clone())
                    .send()
                    .await
                    .unwrap();
                let _ = resp.bytes().await;
                if round > 0 {
                    times[k].push(started.elapsed());
                }
            }
        }
    }
    for t in &mut times {
        t.sort();
    }
    let (p_off, p_on) = (pct(&times[0], 0.5), pct(&times[1], 0.5));
    let (q_off, q_on) = (pct(&times[0], 0.99), pct(&times[1], 0.99));
    let mode = if redis.is_some() {
        "replica mode (Redis)"
    } else {
        "embedded"
    };
    println!(
        "| end to end, {mode}: a failing request (400 passed through), fleet view off / on (2,500 each, distinct sessions) | {p_off:.3} / {p_on:.3} ({:+.3}) | {q_off:.3} / {q_on:.3} ({:+.3}) |",
        p_on - p_off,
        q_on - q_off,
    );
    on.shutdown().await;
    off.shutdown().await;
}

#[tokio::main]
async fn main() {
    // `-- end-to-end`: only the end-to-end rows (for comparing two builds, interleaved).
    if std::env::args().nth(1).as_deref() == Some("end-to-end") {
        println!("| failure path | p50 ms | p99 ms |\n|---|---|---|");
        latency_end_to_end(None).await;
        if let Some((url, _server)) = start_redis().await {
            latency_end_to_end(Some(&url)).await;
        }
        return;
    }
    println!("| where | what | signatures counted in full | memory |\n|---|---|---|---|");
    memory_embedded();
    let shared = memory_redis().await;
    println!("\n| failure path | p50 ms | p99 ms |\n|---|---|---|");
    latency_in_process();
    if let Some((fleet, _, _server)) = &shared {
        latency_redis(fleet).await;
    }
    latency_end_to_end(None).await;
    if let Some((_, url, _server)) = &shared {
        latency_end_to_end(Some(url)).await;
    }
}
