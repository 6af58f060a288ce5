//! Restart smart, measured: what guiding a looping session once (`[tenants.guard]
//! guide = true`) saves against tripping it at the limit. One tenant, 200 looping agents
//! and 200 healthy ones arriving over ten minutes, chat completions with tools.
//!
//! - Each looping agent calls `lookup({"id": N})`, which keeps returning the same error,
//!   so its history piles up the same (call, result) pair. At `tool_loop_limit` (3)
//!   Backstop refuses the request (`429 loop_detected`), or, with `guide`, forwards it
//!   once with a note and answers `x-backstop-session-state: guided`.
//! - Half of them change course when told: the answer to their guided request is taken
//!   as a model that read the note would give it (the mock does not read it): another
//!   call, `lookup({"id": N, "include_archived": true})`, which works; then they finish
//!   their task in three more successful steps. The other half call the same lookup
//!   again, and their next request is refused: a correct trip, with or without guidance.
//! - Each healthy agent runs 8 steps of its own task (other tools, a test run repeated
//!   with a changing result, 5% of calls a transient 503 that Backstop retries), with no
//!   loop: any trip of one is a false trip.
//!
//! An agent stops at its first refusal (the guard's `429` carries `x-should-retry:
//! false`, which the official SDKs obey): its task is not done. The same population
//! (same seed) runs twice, guidance off and on. Figures: the agents' own counts
//! (upstream calls from `x-backstop-attempts`), the gateway's restart report (`GET
//! /admin/tenants/agents/guard`: success rate, MTTR, trips) and its spend per session
//! (`GET /admin/tenants/agents/sessions/{id}`, `used.usd`: the mock's reported usage at
//! the catalog's gpt-4o prices), cross-checked against the usage the responses carried
//! × $2.50 / $10 per million tokens, and the mock's own count of calls. Real gateway,
//! real (strict) mock, loopback; time is the gateway's clock moved a second per tick (the
//! real time a tick takes adds to it, so the MTTR can differ by some milliseconds between
//! runs; the counts do not).
//!
//!     cargo run --release --example restart_sim
//!
//! (A debug build prints the same figures, more slowly.)

mod common;

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use backstop::{clock::Clock, config::Config, mock, server};
use base64::Engine;
use futures_util::{stream, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const KEY: &str = "bk-restart-simulation";
const ADMIN: &str = "admin-restart-simulation-token";
const TENANT: &str = "agents";
const LOOPING: usize = 200;
const HEALTHY: usize = 200;
/// Arrivals spread over ten minutes (virtual seconds).
const ARRIVALS: u64 = 600;
const TOOL_LOOP_LIMIT: u32 = 3;
const COOL_DOWN: u64 = 60;
const STEPS: usize = 8;
/// Requests an agent sends at most (a safety net: none should get near it).
const MAX_REQUESTS: usize = 20;
/// Seconds between an agent's requests (the tool's run and the agent's own work).
const GAP: std::ops::RangeInclusive<u64> = 2..=12;
/// The catalog's gpt-4o prices, per million tokens (input, output).
const PRICE: (f64, f64) = (2.5, 10.0);
const SEED: u64 = 11;

const SYSTEM: &str = "You are an operations agent with tools. Work step by step: call one tool at a time, \
read its result before deciding the next step, and never invent a tool's output. When a tool fails, say \
what failed and decide whether another call can get the information. Keep a short running summary of what \
you learned, with the ids of the records you touched. Prefer read-only tools until you are sure of a \
change; every write must name the record it changes and why. When the task is done, answer the user with \
what you did, what you found and anything left open. Do not repeat a call that already failed the same \
way: change the arguments, use another tool, or report the failure. Respect the user's time: no \
speculation, no filler, and cite the tool results your answer rests on.";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Loops, then changes course when guided.
    Changer,
    /// Loops and keeps repeating the same call.
    Repeater,
    Healthy,
}

struct Agent {
    id: String,
    kind: Kind,
    /// The record its lookup is about (looping), or its task's seed (healthy).
    record: u32,
    next: u64,
    rng: fastrand::Rng,
    /// Seeds the draws of its transient upstream failures.
    seed: u64,
    messages: Vec<Value>,
    sent: usize,
    /// Requests answered 200 (the steps it has taken).
    steps: usize,
    /// Successful requests since it changed course (changers, once they have).
    changed: Option<usize>,
    done: bool,
    finished: bool,
    /// Refused by the guard (429): the code it was refused with.
    refused: Option<String>,
    guided_at: Option<u64>,
    /// The mock scenario of its guided request (to read what the mock was sent).
    guided_scenario: Option<String>,
    recovered_at: Option<u64>,
    /// Upstream attempts (`x-backstop-attempts`).
    calls: u64,
    /// Usage the responses reported (prompt, completion).
    tokens: (u64, u64),
    /// Answers that were neither 200 nor a guard refusal.
    unexpected: Vec<String>,
    usd: f64,
}

fn config(mock: std::net::SocketAddr, guide: bool) -> Config {
    common::in_process_config(
        mock,
        &format!(
            r#"
[admin]
token = "{ADMIN}"
[retry]
base_delay = "1ms"
max_delay = "10ms"
budget_ratio = 1.0
[[routes]]
model = "gpt-4o"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "{TENANT}"
api_keys = ["{KEY}"]
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 3
identical_request_window = "10m"
tool_loop_limit = {TOOL_LOOP_LIMIT}
cool_down = "{COOL_DOWN}s"
guide = {guide}
"#
        ),
    )
}

fn tool(name: &str, description: &str, properties: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "description": description,
        "parameters": {"type": "object", "properties": properties}}})
}

fn tools() -> Value {
    json!([
        tool(
            "lookup",
            "Look up a customer record by id.",
            json!({"id": {"type": "integer"}, "include_archived": {"type": "boolean"}})
        ),
        tool(
            "read_report",
            "Read a record's latest report.",
            json!({"id": {"type": "integer"}})
        ),
        tool(
            "save_summary",
            "Save a summary on a record.",
            json!({"id": {"type": "integer"}, "text": {"type": "string"}})
        ),
        tool(
            "read_file",
            "Read a file of the repository.",
            json!({"path": {"type": "string"}})
        ),
        tool(
            "grep",
            "Search the repository.",
            json!({"pattern": {"type": "string"}})
        ),
        tool(
            "edit_file",
            "Replace a file's text.",
            json!({"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}})
        ),
        tool(
            "run_tests",
            "Run the test suite.",
            json!({"filter": {"type": "string"}})
        ),
    ])
}

const AREAS: [&str; 8] = [
    "billing", "search", "auth", "cache", "router", "mailer", "indexer", "exporter",
];

fn agents() -> Vec<Agent> {
    let mut rng = fastrand::Rng::with_seed(SEED);
    let mut all = Vec::with_capacity(LOOPING + HEALTHY);
    let agent = |id: String, kind: Kind, record: u32, arrive: u64, seed: u64| {
        let task = match kind {
            Kind::Healthy => format!(
                "Fix the failing tests of the {} module (ticket {record}).",
                AREAS[record as usize % AREAS.len()]
            ),
            _ => format!("Find customer record {record}, read its latest report and save a summary of it on the record."),
        };
        Agent {
            id,
            kind,
            record,
            next: arrive,
            rng: fastrand::Rng::with_seed(seed),
            seed,
            messages: vec![
                json!({"role": "system", "content": SYSTEM}),
                json!({"role": "user", "content": task}),
            ],
            sent: 0,
            steps: 0,
            changed: None,
            done: false,
            finished: false,
            refused: None,
            guided_at: None,
            guided_scenario: None,
            recovered_at: None,
            calls: 0,
            tokens: (0, 0),
            unexpected: Vec::new(),
            usd: 0.0,
        }
    };
    for i in 0..LOOPING {
        let kind = if i % 2 == 0 {
            Kind::Changer
        } else {
            Kind::Repeater
        };
        all.push(agent(
            format!("loop-{i:03}-{:08x}", rng.u32(..)),
            kind,
            rng.u32(10_000..100_000),
            i as u64 * ARRIVALS / LOOPING as u64,
            rng.u64(..),
        ));
    }
    for i in 0..HEALTHY {
        all.push(agent(
            format!("task-{i:03}-{:08x}", rng.u32(..)),
            Kind::Healthy,
            rng.u32(10_000..100_000),
            1 + i as u64 * ARRIVALS / HEALTHY as u64,
            rng.u64(..),
        ));
    }
    all
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// A mock step answering with a call to `name(args)`.
fn call_step(name: &str, args: &Value) -> String {
    format!("tool={name};tool_args_b64={}", b64(&args.to_string()))
}

fn final_step(text: &str) -> String {
    format!("content_b64={}", b64(text))
}

/// What the model does at the agent's next request (the mock's script for it), and the
/// result its tool will return.
fn plan(a: &Agent) -> (String, Option<String>) {
    let n = a.record;
    match (a.kind, a.changed) {
        (Kind::Changer | Kind::Repeater, None) => (
            call_step("lookup", &json!({"id": n})),
            Some(format!("Error: lookup of record {n} failed: the records service timed out (503).")),
        ),
        (_, Some(0)) => (
            call_step("read_report", &json!({"id": n})),
            Some(format!("Report for record {n}: plan renewed in March, two open invoices, contact moved to the Lisbon office.")),
        ),
        (_, Some(1)) => (
            call_step("save_summary", &json!({"id": n, "text": "renewed, two open invoices, contact in Lisbon"})),
            Some(format!("Saved the summary on record {n}.")),
        ),
        (_, Some(_)) => (
            final_step(&format!("Record {n} was only in the archive. Its latest report: plan renewed in March, two open invoices, contact moved to Lisbon. I saved that summary on the record.")),
            None,
        ),
        (Kind::Healthy, None) => healthy_step(a),
    }
}

/// A healthy agent's step: reads, searches, an edit, the tests run three times with a
/// result that changes each time (the same call, never the same pair three times).
fn healthy_step(a: &Agent) -> (String, Option<String>) {
    let area = AREAS[a.record as usize % AREAS.len()];
    let tests = json!({"filter": area});
    if a.steps + 1 >= STEPS {
        return (
            final_step(&format!("Fixed the {area} tests: rounding now rounds half away from zero, empty input is accepted and names are cut on character boundaries. All 41 tests pass.")),
            None,
        );
    }
    let (name, args, result) = match a.steps {
        0 => (
            "run_tests",
            tests.clone(),
            format!("3 of 41 tests failed in {area}: rounding, empty input, unicode names."),
        ),
        1 => (
            "grep",
            json!({"pattern": format!("fn round_{area}")}),
            format!("src/{area}/math.rs:88: fn round_{area}(x: f64) -> i64"),
        ),
        2 => (
            "read_file",
            json!({"path": format!("src/{area}/math.rs")}),
            format!("// {area} math: 212 lines; round_{area} truncates toward zero"),
        ),
        3 => (
            "edit_file",
            json!({"path": format!("src/{area}/math.rs"), "old": "x as i64", "new": "x.round() as i64"}),
            "Edited 1 place.".to_string(),
        ),
        4 => (
            "run_tests",
            tests.clone(),
            format!("2 of 41 tests failed in {area}: empty input, unicode names."),
        ),
        5 => (
            "read_file",
            json!({"path": format!("src/{area}/input.rs")}),
            format!("// {area} input: 97 lines; parse() indexes bytes, not chars"),
        ),
        _ => (
            "run_tests",
            tests,
            format!("All 41 tests passed in {area}."),
        ),
    };
    // 5% of its calls meet a transient 503 first (Backstop retries it).
    let flaky = fastrand::Rng::with_seed(a.seed ^ a.steps as u64).f64() < 0.05;
    let step = call_step(name, &args);
    let step = if flaky {
        format!("status=503,{step}")
    } else {
        step
    };
    (step, Some(result))
}

struct Answer {
    status: u16,
    attempts: u64,
    state: Option<String>,
    body: Value,
}

async fn send(
    http: &reqwest::Client,
    url: &str,
    (id, sent): (&str, usize),
    body: Value,
    fault: String,
) -> Answer {
    let resp = http
        .post(url)
        .bearer_auth(KEY)
        .header("x-session-id", id)
        .header("x-mock-scenario", format!("{id}-{sent}"))
        .header("x-mock-fault", fault)
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let status = resp.status().as_u16();
    let attempts = header("x-backstop-attempts")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let state = header("x-backstop-session-state");
    let body = resp
        .bytes()
        .await
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    Answer {
        status,
        attempts,
        state,
        body,
    }
}

/// The agent takes its answer: appends the turn (and its tool's result) to its history,
/// or stops.
fn take(a: &mut Agent, now: u64, answer: Answer, result: Option<String>) {
    a.sent += 1;
    a.calls += answer.attempts;
    let usage = &answer.body["usage"];
    a.tokens.0 += usage["prompt_tokens"].as_u64().unwrap_or(0);
    a.tokens.1 += usage["completion_tokens"].as_u64().unwrap_or(0);
    let state = answer.state.as_deref();
    match answer.status {
        200 => a.steps += 1,
        429 => {
            let code = answer.body["error"]["code"]
                .as_str()
                .unwrap_or("?")
                .to_string();
            a.refused = Some(code);
            a.done = true;
            return;
        }
        other => {
            // Sent again as it was, next time.
            a.unexpected.push(format!("{other} {}", answer.body));
            a.done = a.sent >= MAX_REQUESTS;
            return;
        }
    }
    if state == Some("recovered") && a.recovered_at.is_none() {
        a.recovered_at = Some(now);
    }
    let message = &answer.body["choices"][0]["message"];
    let Some(call) = message["tool_calls"].get(0) else {
        a.messages
            .push(json!({"role": "assistant", "content": message["content"]}));
        a.finished = true;
        a.done = true;
        return;
    };
    let id = call["id"].as_str().unwrap_or("call_0").to_string();
    let (mut function, mut result) = (
        call["function"].clone(),
        result.unwrap_or_else(|| "ok".into()),
    );
    if let Some(steps) = a.changed.as_mut() {
        *steps += 1;
    }
    if state == Some("guided") {
        a.guided_at.get_or_insert(now);
        a.guided_scenario
            .get_or_insert_with(|| format!("{}-{}", a.id, a.sent - 1));
        if a.kind == Kind::Changer && a.changed.is_none() {
            // Told it is in a loop, it changes course: the call a model that read the
            // note would answer with, instead of the one the mock (which did not) sent.
            let n = a.record;
            function = json!({"name": "lookup", "arguments": json!({"id": n, "include_archived": true}).to_string()});
            result = format!(
                "Record {n} (archived 2023-11-02): Ana Duarte, plan Business, account active."
            );
            a.changed = Some(0);
        }
    }
    a.messages.push(json!({"role": "assistant", "content": null,
        "tool_calls": [{"id": id, "type": "function", "function": function}]}));
    a.messages
        .push(json!({"role": "tool", "tool_call_id": id, "content": result}));
    a.done = a.sent >= MAX_REQUESTS;
    a.next = now + a.rng.u64(GAP);
}

struct Report {
    guide: bool,
    agents: Vec<Agent>,
    admin: Value,
    tenant_usd: f64,
    /// Attempts the mock saw.
    mock_calls: u64,
    /// Guided requests that reached the mock with the note as their last message.
    notes_seen: usize,
    /// The note of one of them.
    note: Option<String>,
    wall: f64,
}

async fn run(guide: bool) -> Report {
    let mock = mock::spawn_strict(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let clock = Clock::system();
    let gw = server::spawn_with_clock(config(mock.addr, guide), clock.clone())
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .build()
        .unwrap();
    let mut agents = agents();
    let tools = tools();
    let started = Instant::now();
    let mut now = 0u64;
    while agents.iter().any(|a| !a.done) {
        let requests: Vec<_> = agents
            .iter()
            .enumerate()
            .filter(|(_, a)| !a.done && a.next == now)
            .map(|(i, a)| {
                let (fault, result) = plan(a);
                let body = json!({"model": "gpt-4o", "messages": a.messages, "tools": tools});
                (i, (a.id.clone(), a.sent), body, fault, result)
            })
            .collect();
        let answers: Vec<_> = stream::iter(requests)
            .map(|(i, (id, sent), body, fault, result)| {
                let (http, url) = (&http, &url);
                async move { (i, send(http, url, (&id, sent), body, fault).await, result) }
            })
            .buffer_unordered(64)
            .collect()
            .await;
        for (i, answer, result) in answers {
            let a = &mut agents[i];
            take(a, now, answer, result);
            if !a.done && a.next <= now {
                a.next = now + 1;
            }
        }
        now += 1;
        clock.skip(Duration::from_secs(1));
    }
    let wall = started.elapsed().as_secs_f64();
    let admin = |path: String| {
        let http = &http;
        let url = format!("http://{}{path}", gw.addr);
        async move {
            let resp = http.get(url).bearer_auth(ADMIN).send().await.unwrap();
            assert_eq!(resp.status(), 200, "{path}");
            serde_json::from_slice::<Value>(&resp.bytes().await.unwrap()).unwrap()
        }
    };
    let report = admin(format!("/admin/tenants/{TENANT}/guard")).await;
    for a in agents.iter_mut() {
        let s = admin(format!("/admin/tenants/{TENANT}/sessions/{}", a.id)).await;
        a.usd = s["used"]["usd"].as_f64().unwrap_or(0.0);
    }
    let tenant = admin(format!("/admin/tenants/{TENANT}")).await;
    let tenant_usd = tenant["used_today"]["usd"].as_f64().unwrap_or(f64::NAN);
    let mock_get = |path: String| {
        let http = &http;
        let url = format!("http://{}{path}", mock.addr);
        async move {
            let resp = http.get(url).send().await.unwrap();
            serde_json::from_slice::<Value>(&resp.bytes().await.unwrap()).unwrap_or(Value::Null)
        }
    };
    let mock_calls = mock_get("/mock/stats".into()).await["total"]
        .as_u64()
        .unwrap_or(0);
    let (mut notes_seen, mut note) = (0, None);
    for scenario in agents.iter().filter_map(|a| a.guided_scenario.as_ref()) {
        let last = mock_get(format!("/mock/last?scenario={scenario}")).await;
        let message = last["body"]["messages"]
            .as_array()
            .and_then(|m| m.last())
            .cloned()
            .unwrap_or(Value::Null);
        let text = message["content"].as_str().unwrap_or_default();
        if message["role"] == "system" && text.contains("loop") {
            notes_seen += 1;
            note.get_or_insert_with(|| text.to_string());
        }
    }
    gw.shutdown().await;
    Report {
        guide,
        agents,
        admin: report,
        tenant_usd,
        mock_calls,
        notes_seen,
        note,
        wall,
    }
}

/// The agents of these kinds.
fn of<'a>(agents: &'a [Agent], kinds: &'static [Kind]) -> impl Iterator<Item = &'a Agent> + 'a {
    agents.iter().filter(move |a| kinds.contains(&a.kind))
}

fn usd_of(tokens: (u64, u64)) -> f64 {
    (tokens.0 as f64 * PRICE.0 + tokens.1 as f64 * PRICE.1) / 1e6
}

fn per(total: f64, n: usize) -> Option<f64> {
    (n > 0).then(|| total / n as f64)
}

#[tokio::main]
async fn main() {
    let runs = [run(false).await, run(true).await];
    println!(
        "{LOOPING} looping agents (lookup keeps failing the same way; half change course when guided, half repeat) and {HEALTHY} healthy 8-step agents, arriving over {} min; tool_loop_limit {TOOL_LOOP_LIMIT}, cool-down {COOL_DOWN} s; an agent stops at its first refusal\n",
        ARRIVALS / 60
    );
    println!("| run | sessions saved (of {LOOPING} looping) | restart success rate | MTTR mean / p90 | calls per saved session | $ per saved session | total calls (looping + healthy) | false trips (changers + healthy) | correct trips (repeaters) | saved by trips (calls, $) | wall |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut notes = Vec::new();
    for r in &runs {
        let of = |k: &'static [Kind]| of(&r.agents, k);
        let looping = || of(&[Kind::Changer, Kind::Repeater]);
        let saved = looping().filter(|a| a.finished).count();
        let looping_calls: u64 = looping().map(|a| a.calls).sum();
        let looping_usd: f64 = looping().map(|a| a.usd).sum();
        let healthy_calls: u64 = of(&[Kind::Healthy]).map(|a| a.calls).sum();
        let healthy_usd: f64 = of(&[Kind::Healthy]).map(|a| a.usd).sum();
        let tripped = |k: Kind| {
            r.agents
                .iter()
                .filter(|a| a.kind == k && a.refused.is_some())
                .count()
        };
        let g = &r.admin["strategies"]["guide"];
        let (rate, mttr) = if r.guide {
            (
                format!(
                    "{:.0}% ({} of {} guided)",
                    g["success_rate"].as_f64().unwrap_or(f64::NAN) * 100.0,
                    g["recovered"],
                    g["sessions"]
                ),
                format!(
                    "{:.1} s / {:.1} s",
                    g["mttr_seconds"]["mean"].as_f64().unwrap_or(f64::NAN),
                    g["mttr_seconds"]["p90"].as_f64().unwrap_or(f64::NAN)
                ),
            )
        } else {
            ("n/a (no guidance)".into(), "n/a".into())
        };
        let saved_by = &r.admin["saved_by_trips"];
        println!(
            "| guidance {} | {saved} | {rate} | {mttr} | {} | {} | {} ({looping_calls} + {healthy_calls}) | {} ({} + {}) | {} of {} | {}, ${:.4} | {:.0} s |",
            if r.guide { "on" } else { "off" },
            per(looping_calls as f64, saved).map_or("n/a (none saved)".into(), |c| format!("{c:.2}")),
            per(looping_usd, saved).map_or("n/a (none saved)".into(), |c| format!("${c:.4}")),
            looping_calls + healthy_calls,
            tripped(Kind::Changer) + tripped(Kind::Healthy),
            tripped(Kind::Changer),
            tripped(Kind::Healthy),
            tripped(Kind::Repeater),
            LOOPING / 2,
            saved_by["calls"],
            saved_by["usd"].as_f64().unwrap_or(f64::NAN),
            r.wall
        );
        // Cross-checks and details.
        let name = if r.guide { "on" } else { "off" };
        let sessions_usd = looping_usd + healthy_usd;
        let tokens = r
            .agents
            .iter()
            .fold((0, 0), |t, a| (t.0 + a.tokens.0, t.1 + a.tokens.1));
        notes.push(format!(
            "guidance {name}: spend (gateway, per session) looping ${looping_usd:.4} + healthy ${healthy_usd:.4} = ${sessions_usd:.4}; tenant total ${:.4}; usage in the responses x ${}/${} per Mtok ${:.4}",
            r.tenant_usd, PRICE.0, PRICE.1, usd_of(tokens)
        ));
        let mut codes: BTreeMap<(String, &str), usize> = BTreeMap::new();
        for a in r.agents.iter() {
            if let Some(code) = &a.refused {
                let kind = match a.kind {
                    Kind::Changer => "changer",
                    Kind::Repeater => "repeater",
                    Kind::Healthy => "healthy",
                };
                *codes.entry((code.clone(), kind)).or_default() += 1;
            }
        }
        notes.push(format!(
            "guidance {name}: refusals seen by agents {codes:?}; gateway trips_by_rule {}; guide tally {}",
            r.admin["trips_by_rule"], g
        ));
        notes.push(format!(
            "guidance {name}: upstream calls the mock saw {} (agents' `x-backstop-attempts` {}); guided requests that reached it with the note last {}",
            r.mock_calls,
            looping_calls + healthy_calls,
            r.notes_seen
        ));
        let guided = r.agents.iter().filter(|a| a.guided_at.is_some()).count();
        let recovered: Vec<u64> = r
            .agents
            .iter()
            .filter_map(|a| Some(a.recovered_at? - a.guided_at?))
            .collect();
        notes.push(format!(
            "guidance {name}: agents that saw `guided` {guided}, then `recovered` {} (mean {:.1} s from guidance to the change of course, agents' clock); unfinished changers {}; healthy finished {} of {HEALTHY}",
            recovered.len(),
            per(recovered.iter().sum::<u64>() as f64, recovered.len()).unwrap_or(f64::NAN),
            of(&[Kind::Changer]).filter(|a| !a.finished).count(),
            of(&[Kind::Healthy]).filter(|a| a.finished).count(),
        ));
        let unexpected: Vec<_> = r
            .agents
            .iter()
            .flat_map(|a| a.unexpected.iter().map(move |u| format!("{}: {u}", a.id)))
            .collect();
        if !unexpected.is_empty() {
            notes.push(format!(
                "guidance {name}: {} unexpected answers, first: {}",
                unexpected.len(),
                unexpected[0]
            ));
        }
    }
    println!("\nCalls are upstream attempts (`x-backstop-attempts`); calls and $ per saved session are the looping population's (all {LOOPING}, the repeaters' calls included) over the sessions saved. $ is the gateway's own spend per session (`used.usd` of the admin session view: the mock's usage priced at the catalog's gpt-4o prices). False trips: looping agents that would have changed course, tripped, plus healthy agents tripped.\n");
    for n in notes {
        println!("- {n}");
    }
    if let Some(note) = runs.iter().find_map(|r| r.note.as_ref()) {
        println!(
            "\nA guided request's note, as the mock received it (the last message):\n\n> {note}"
        );
    }
}
