//! The session guard at scale: 1,000 sessions each stuck in a failing loop of 50 calls
//! (the compaction incident in miniature), and 1,000 healthy sessions running a 12-step
//! script with occasional transient upstream failures. Real gateway, real mock, loopback.
//!
//!     cargo run --release --example guard_sim

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Instant,
};

use backstop::{config::Config, mock, server};
use tokio::net::TcpListener;

const KEY: &str = "bk-guard-simulation";

struct Script {
    model: &'static str,
    steps: usize,
    fault: Option<&'static str>,
}

async fn session(
    http: reqwest::Client,
    url: String,
    id: String,
    script: &Script,
    tripped: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
) {
    let mut was_tripped = false;
    for step in 0..script.steps {
        // Each call differs (a growing history), so only the failure rule can stop a loop.
        let body = format!(
            r#"{{"model":"{}","messages":[{{"role":"user","content":"{id} step {step}"}}]}}"#,
            script.model
        );
        let mut req = http
            .post(&url)
            .bearer_auth(KEY)
            .header("x-session-id", &id)
            .body(body);
        if let Some(fault) = script.fault {
            req = req.header("x-mock-fault", fault);
        }
        let resp = req.send().await.unwrap();
        if resp.status() == 429 {
            refused.fetch_add(1, Ordering::Relaxed);
        }
        if resp
            .headers()
            .get("x-backstop-session-state")
            .is_some_and(|s| s == "tripped")
        {
            was_tripped = true;
        }
        let _ = resp.bytes().await;
    }
    if was_tripped {
        tripped.fetch_add(1, Ordering::Relaxed);
    }
}

async fn run(
    http: &reqwest::Client,
    url: &str,
    prefix: &str,
    sessions: usize,
    script: Script,
) -> (usize, usize, f64) {
    let script = Arc::new(script);
    let tripped = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..64 {
        let (http, url, next, tripped, refused) = (
            http.clone(),
            url.to_string(),
            next.clone(),
            tripped.clone(),
            refused.clone(),
        );
        let (prefix, script) = (prefix.to_string(), script.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sessions {
                    break;
                }
                session(
                    http.clone(),
                    url.clone(),
                    format!("{prefix}-{i}"),
                    &script,
                    tripped.clone(),
                    refused.clone(),
                )
                .await;
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    (
        tripped.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64(),
    )
}

#[tokio::main]
async fn main() {
    let failing = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    // Healthy upstream with a 5% transient 503 that Backstop's retries absorb.
    let flaky = mock::spawn_with(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        mock::FaultMix::parse("status=503@0.05").unwrap(),
    );
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[log]
level = "error"
[store]
path = ":memory:"
[retry]
base_delay = "1ms"
max_delay = "10ms"
budget_ratio = 1.0
[[upstreams]]
name = "failing"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{failing}"
[[upstreams]]
name = "flaky"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{flaky}"
[[routes]]
model = "gpt-4o"
targets = [{{ upstream = "failing" }}]
[[routes]]
model = "gpt-4o-healthy"
targets = [{{ upstream = "flaky" }}]
[[tenants]]
name = "agents"
api_keys = ["{KEY}"]
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 3
identical_request_window = "10m"
tool_loop_limit = 3
cool_down = "60s"
"#,
        failing = failing.addr,
        flaky = flaky.addr
    );
    let gw = server::spawn(Config::from_toml_with_env(&text, |_| None).unwrap())
        .await
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .build()
        .unwrap();

    let stuck = Script {
        model: "gpt-4o",
        steps: 50,
        fault: Some("status=400;code=context_length_exceeded"),
    };
    let (tripped, refused, secs) = run(&http, &url, "stuck", 1000, stuck).await;
    let calls = failing.state_total();
    println!("| stuck loops: 1,000 sessions x 50 failing calls | |\n|---|---|");
    println!("| client calls | 50000 |");
    println!(
        "| upstream calls with Backstop | {calls} ({:.2}% of 50,000; {:.1} per session) |",
        calls as f64 / 500.0,
        calls as f64 / 1000.0
    );
    println!("| calls refused before the upstream | {refused} |");
    println!("| sessions tripped | {tripped} of 1000 |");
    println!("| wall time | {secs:.1} s |");

    let healthy = Script {
        model: "gpt-4o-healthy",
        steps: 12,
        fault: None,
    };
    let (tripped, refused, secs) = run(&http, &url, "healthy", 1000, healthy).await;
    println!("\n| healthy: 1,000 sessions x 12 distinct steps, 5% transient 503s upstream | |\n|---|---|");
    println!("| false trips | {tripped} of 1000 sessions |");
    println!("| requests refused | {refused} of 12000 |");
    println!(
        "| upstream calls | {} (retries included) |",
        flaky.state_total()
    );
    println!("| wall time | {secs:.1} s |");
    gw.shutdown().await;
}
