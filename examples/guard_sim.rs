//! The session guard and the fleet view at scale: the compaction incident's shape. One
//! tenant; 1,279 stuck agent sessions arrive over an hour, each retrying the same failing
//! context-compaction call (the same template, its own numbers and ids) once a second, up
//! to 50 times; 1,000 healthy sessions arrive over the same hour, each running 12 steps of
//! its own task 5 s apart, 5% of them hitting a transient 503 (recovered by Backstop) and
//! 5% failing for good with a status and code of their own (diverse signatures).
//!
//! Each scenario runs with the guard alone (the "before": each session on its own), and
//! with `[tenants.guard.fleet]` (3 sessions failing twice within 10m, cool-down 60s), with
//! and without `preempt`; then again with the upstream bug fixed halfway through, to
//! measure how soon new sessions get through. Real gateway, real mock, loopback; time is
//! the gateway's clock moved a second per tick (an hour runs in a minute or two). The
//! requests of one tick run concurrently, so a count can differ by a few calls between
//! runs (which request of a tick is a signature's probe, say).
//!
//!     cargo run --release --example guard_sim
//!
//! (A debug build prints the same counts, more slowly.)

mod common;

use std::time::{Duration, Instant};

use backstop::{clock::Clock, config::Config, mock, server};
use futures_util::{stream, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const KEY: &str = "bk-guard-simulation";
const STUCK: usize = 1279;
const HEALTHY: usize = 1000;
/// Arrivals spread over an hour (virtual seconds).
const ARRIVALS: u64 = 3600;
const RETRIES: usize = 50;
const RETRY_EVERY: u64 = 1;
const STEPS: usize = 12;
const STEP_EVERY: u64 = 5;
/// When the upstream bug is fixed, in the runs that fix it.
const FIX_AT: u64 = ARRIVALS / 2;
const COOL_DOWN: u64 = 60;
const OVERFLOW: &str = "status=400;code=context_length_exceeded";

#[derive(Clone, Copy, PartialEq)]
enum Fleet {
    Off,
    On { preempt: bool },
}

struct Agent {
    id: String,
    stuck: bool,
    arrive: u64,
    next: u64,
    sent: usize,
    done: bool,
    /// Upstream attempts its requests made (`x-backstop-attempts`).
    calls: u64,
    /// Of those, the attempts of requests that failed.
    failed_calls: u64,
    /// Requests Backstop refused (429).
    refused: u64,
    tripped: bool,
    first_ok: Option<u64>,
    /// The last time Backstop refused it.
    last_refused: Option<u64>,
    /// Healthy: the words of its task.
    task: String,
}

const VERBS: [&str; 10] = [
    "refactor", "test", "document", "profile", "port", "review", "fix", "extend", "simplify",
    "harden",
];
const NOUNS: [&str; 12] = [
    "parser",
    "scheduler",
    "cache",
    "router",
    "billing",
    "search",
    "uploader",
    "indexer",
    "renderer",
    "auth",
    "exporter",
    "mailer",
];
const PLACES: [&str; 8] = [
    "backend", "cli", "web app", "worker", "gateway", "sdk", "plugin", "daemon",
];
/// Healthy sessions' failures that stay failures: their own status and code.
const FAILURES: [&str; 5] = [
    "status=400;code=invalid_value",
    "status=404;code=model_not_found",
    "status=422;code=unprocessable_entity",
    "status=400;code=unsupported_parameter",
    "status=413;code=request_too_large",
];
const SYSTEM: &str = "You are a coding agent working in a large repository. Follow the repository's conventions and explain every change.";

fn config(mock: std::net::SocketAddr, fleet: Fleet) -> Config {
    let fleet = match fleet {
        Fleet::Off => String::new(),
        Fleet::On { preempt } => format!(
            "[tenants.guard.fleet]\nmin_sessions = 3\nmin_failures = 2\nwindow = \"10m\"\ncool_down = \"{COOL_DOWN}s\"\npreempt = {preempt}\n"
        ),
    };
    common::in_process_config(
        mock,
        &format!(
            r#"
[retry]
base_delay = "1ms"
max_delay = "10ms"
budget_ratio = 1.0
[[routes]]
model = "gpt-4o"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "agents"
api_keys = ["{KEY}"]
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 3
identical_request_window = "10m"
tool_loop_limit = 3
cool_down = "{COOL_DOWN}s"
{fleet}
"#
        ),
    )
}

fn agents() -> Vec<Agent> {
    let mut rng = fastrand::Rng::with_seed(7);
    let agent = |id: String, stuck: bool, arrive: u64, task: String| Agent {
        id,
        stuck,
        arrive,
        next: arrive,
        sent: 0,
        done: false,
        calls: 0,
        failed_calls: 0,
        refused: 0,
        tripped: false,
        first_ok: None,
        last_refused: None,
        task,
    };
    let mut all = Vec::with_capacity(STUCK + HEALTHY);
    for i in 0..STUCK {
        let id = format!("run-{:08x}", rng.u32(..));
        all.push(agent(
            id,
            true,
            i as u64 * ARRIVALS / STUCK as u64,
            String::new(),
        ));
    }
    for i in 0..HEALTHY {
        let id = format!("run-{:08x}", rng.u32(..));
        let task = format!(
            "{} the {} of the {}",
            VERBS[rng.usize(..VERBS.len())],
            NOUNS[rng.usize(..NOUNS.len())],
            PLACES[rng.usize(..PLACES.len())]
        );
        all.push(agent(
            id,
            false,
            2 + i as u64 * ARRIVALS / HEALTHY as u64,
            task,
        ));
    }
    all
}

/// What an agent sends now: the body, its mock scenario and fault script.
fn request(a: &Agent, now: u64, fixed: bool) -> (Value, String, String) {
    if a.stuck {
        let body = json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": format!("Migrate the {} service to the new API", a.id)},
            {"role": "assistant", "content": format!("Done with {} of the files.", 40 + a.sent)},
            {"role": "user", "content": format!("Your context is full ({} tokens). Summarize the conversation so far in under 2000 tokens, keeping file paths and decisions. Session {}.", 180_000 + 17 * a.sent, a.id)},
        ]});
        let fault = if fixed && now >= FIX_AT { "" } else { OVERFLOW };
        return (body, "stuck".into(), fault.into());
    }
    let step = a.sent;
    let mut rng = fastrand::Rng::with_seed(
        u64::from_str_radix(&a.id[4..], 16).unwrap_or(0) * 31 + step as u64,
    );
    let roll = rng.f64();
    let fault = if roll < 0.05 {
        FAILURES[rng.usize(..FAILURES.len())].to_string()
    } else if roll < 0.10 {
        "status=503,ok".to_string()
    } else {
        String::new()
    };
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": format!("Step {} of {}: {}.", step + 1, STEPS, a.task)},
    ]});
    (body, format!("healthy-{}-{step}", a.id), fault)
}

struct Outcome {
    status: u16,
    attempts: u64,
    tripped: bool,
}

async fn send(
    http: &reqwest::Client,
    url: &str,
    id: &str,
    req: (Value, String, String),
) -> Outcome {
    let (body, scenario, fault) = req;
    let mut r = http
        .post(url)
        .bearer_auth(KEY)
        .header("x-session-id", id)
        .header("x-mock-scenario", scenario)
        .body(body.to_string());
    if !fault.is_empty() {
        r = r.header("x-mock-fault", fault);
    }
    let resp = r.send().await.unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let out = Outcome {
        status: resp.status().as_u16(),
        attempts: header("x-backstop-attempts")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        tripped: header("x-backstop-session-state").as_deref() == Some("tripped"),
    };
    let _ = resp.bytes().await;
    out
}

struct Report {
    name: String,
    fixed: bool,
    stuck_calls: u64,
    stuck_failed_calls: u64,
    stuck_refused: u64,
    false_trips: usize,
    healthy_refused: u64,
    healthy_requests: u64,
    /// Sessions arriving after the fix: the longest wait for a first success, and how
    /// many never got one.
    new_wait: Option<u64>,
    new_never: usize,
    /// The last refusal of a session that arrived after the fix, after the fix.
    last_refusal: Option<u64>,
    /// Sessions still retrying at the fix: the longest wait from the fix, and how many
    /// ran out of retries first.
    straddling_wait: Option<u64>,
    straddling_never: usize,
    wall: f64,
}

async fn run(name: &str, fleet: Fleet, fixed: bool) -> Report {
    let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let clock = Clock::system();
    let gw = server::spawn_with_clock(config(mock.addr, fleet), clock.clone())
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .build()
        .unwrap();
    let mut agents = agents();
    let started = Instant::now();
    let mut now = 0u64;
    while agents.iter().any(|a| !a.done) {
        let due: Vec<usize> = (0..agents.len())
            .filter(|&i| !agents[i].done && agents[i].next == now)
            .collect();
        let requests: Vec<_> = due
            .iter()
            .map(|&i| (i, agents[i].id.clone(), request(&agents[i], now, fixed)))
            .collect();
        let outcomes: Vec<(usize, Outcome)> = stream::iter(requests)
            .map(|(i, id, req)| {
                let (http, url) = (&http, &url);
                async move { (i, send(http, url, &id, req).await) }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        for (i, out) in outcomes {
            let a = &mut agents[i];
            a.sent += 1;
            a.calls += out.attempts;
            if out.status != 200 {
                a.failed_calls += out.attempts;
            }
            if out.status == 429 {
                a.refused += 1;
                a.last_refused = Some(now);
            }
            a.tripped |= out.tripped || out.status == 429;
            if out.status == 200 && a.first_ok.is_none() {
                a.first_ok = Some(now);
            }
            let (limit, every) = if a.stuck {
                (RETRIES, RETRY_EVERY)
            } else {
                (STEPS, STEP_EVERY)
            };
            a.done = a.sent >= limit || (a.stuck && out.status == 200);
            a.next = now + every;
        }
        now += 1;
        clock.skip(Duration::from_secs(1));
    }
    let wall = started.elapsed().as_secs_f64();
    gw.shutdown().await;
    let stuck = || agents.iter().filter(|a| a.stuck);
    let healthy = || agents.iter().filter(|a| !a.stuck);
    let new = || stuck().filter(|a| a.arrive >= FIX_AT);
    Report {
        name: name.to_string(),
        fixed,
        stuck_calls: stuck().map(|a| a.calls).sum(),
        stuck_failed_calls: stuck().map(|a| a.failed_calls).sum(),
        stuck_refused: stuck().map(|a| a.refused).sum(),
        false_trips: healthy().filter(|a| a.tripped).count(),
        healthy_refused: healthy().map(|a| a.refused).sum(),
        healthy_requests: healthy().map(|a| a.sent as u64).sum(),
        new_wait: new()
            .filter_map(|a| a.first_ok.map(|ok| ok - a.arrive))
            .max(),
        new_never: new().filter(|a| a.first_ok.is_none()).count(),
        last_refusal: new()
            .filter_map(|a| a.last_refused)
            .max()
            .map(|t| t.saturating_sub(FIX_AT)),
        straddling_wait: stuck()
            .filter(|a| a.arrive < FIX_AT && a.first_ok.is_some_and(|ok| ok >= FIX_AT))
            .filter_map(|a| a.first_ok.map(|ok| ok - FIX_AT))
            .max(),
        straddling_never: stuck()
            .filter(|a| a.arrive < FIX_AT && a.next > FIX_AT && a.first_ok.is_none())
            .count(),
        wall,
    }
}

fn secs(v: Option<u64>) -> String {
    v.map_or("–".into(), |s| format!("{s} s"))
}

#[tokio::main]
async fn main() {
    let runs = [
        ("guard alone (before)", Fleet::Off, false),
        ("guard + fleet", Fleet::On { preempt: false }, false),
        ("guard + fleet, preempt", Fleet::On { preempt: true }, false),
        ("guard alone (before), fixed halfway", Fleet::Off, true),
        (
            "guard + fleet, fixed halfway",
            Fleet::On { preempt: false },
            true,
        ),
        (
            "guard + fleet, preempt, fixed halfway",
            Fleet::On { preempt: true },
            true,
        ),
    ];
    let mut reports = Vec::new();
    for (name, fleet, fixed) in runs {
        reports.push(run(name, fleet, fixed).await);
    }
    println!(
        "{STUCK} stuck sessions (up to {RETRIES} compaction calls each, 1 s apart) and {HEALTHY} healthy 12-step sessions, arriving over {} min; fleet: 3 sessions x 2 failures in 10m, cool-down {COOL_DOWN} s\n",
        ARRIVALS / 60
    );
    println!("| run | upstream calls per stuck session | stuck calls refused | false trips (healthy sessions) | healthy requests refused | wall |");
    println!("|---|---|---|---|---|---|");
    for r in reports.iter().filter(|r| !r.fixed) {
        println!(
            "| {} | {:.2} ({} calls) | {} | {} of {HEALTHY} | {} of {} | {:.0} s |",
            r.name,
            r.stuck_calls as f64 / STUCK as f64,
            r.stuck_calls,
            r.stuck_refused,
            r.false_trips,
            r.healthy_refused,
            r.healthy_requests,
            r.wall
        );
    }
    println!("\nThe upstream bug fixed at {} min:\n", FIX_AT / 60);
    println!("| run | upstream calls per stuck session (failing) | false trips | new sessions after the fix: longest wait for a first success | never succeeded | last refusal of a new session, after the fix | sessions retrying at the fix: longest wait / ran out of retries first | wall |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in reports.iter().filter(|r| r.fixed) {
        println!(
            "| {} | {:.2} ({:.2}) | {} of {HEALTHY} | {} | {} | {} | {} / {} | {:.0} s |",
            r.name,
            r.stuck_calls as f64 / STUCK as f64,
            r.stuck_failed_calls as f64 / STUCK as f64,
            r.false_trips,
            secs(r.new_wait),
            r.new_never,
            r.last_refusal.map_or("none".into(), |s| format!("+{s} s")),
            secs(r.straddling_wait),
            r.straddling_never,
            r.wall
        );
    }
}
