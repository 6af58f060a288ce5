//! Budget scale: how many reserve+settle round trips per second the store sustains, and
//! Backstop's memory after 100,000 distinct sessions.
//!
//!     cargo build --release && cargo run --release --example sessions -- [SESSIONS]

#[path = "common/mod.rs"]
mod common;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use backstop::{
    billing::Tokens,
    clock::Clock,
    config::Config,
    state::budgets::{
        reservation::{Ask, Outcome},
        Budgets,
    },
    store::SqliteStore,
};
use common::*;

const KEY: &str = "bk-bench-sessions-01";

#[tokio::main]
async fn main() {
    let sessions: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100_000);
    let dir = std::env::temp_dir().join(format!("backstop-sessions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (port, mock_port) = (free_port(), free_port());
    let config_text = format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
[log]
level = "warn"
[store]
path = "{store}"
[mock]
listen = "127.0.0.1:{mock_port}"
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
[tenants.session]
max_calls = 1000
max_usd = 10.0
max_concurrent = 8
[tenants.budget]
usd_per_day = 100000.0
"#,
        store = dir.join("sessions.db").display()
    );

    // 1. The store alone: reserve + settle (settle waits for the commit), 32 at a time.
    let config = Config::from_toml_with_env(&config_text, |_| None).unwrap();
    let store = Arc::new(SqliteStore::open(dir.join("reserve.db").to_str().unwrap()).unwrap());
    let budgets = Arc::new(Budgets::new(
        &config,
        store,
        Duration::from_secs(600),
        Clock::system(),
    ));
    let ops = 100_000;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (budgets, next) = (budgets.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ops {
                    break;
                }
                // 500 calls per session, well under its 1,000-call cap.
                let session = format!("s{}", i / 500);
                let Ok(r) = budgets
                    .reserve("t", Some(&session), &Ask::plain("gpt-4o", 100, 100))
                    .await
                else {
                    panic!("refused")
                };
                r.settle(Outcome::Reported(Tokens::plain(50, 50))).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    println!("| reservations (reserve + settle + ledger commit), 32 concurrent | {:.0} per second ({ops} in {secs:.2} s) |", ops as f64 / secs);

    // 2. The real binary: RSS after `sessions` distinct sessions went through it.
    let config_path = dir.join("sessions.toml");
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
    for _ in 0..100 {
        if http
            .get(format!("{url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.pid();
    println!("| RSS at start | {} MB |", proc_kb(pid, "VmRSS:") / 1024);
    let started = Instant::now();
    one_call_per_session(&http, &url, KEY, sessions, 64).await;
    println!(
        "| RSS after {sessions} distinct sessions ({:.1} s) | {} MB (peak {} MB) |",
        started.elapsed().as_secs_f64(),
        proc_kb(pid, "VmRSS:") / 1024,
        proc_kb(pid, "VmHWM:") / 1024
    );
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}
