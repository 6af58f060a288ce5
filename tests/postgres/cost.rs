//! What the ledger adds to a budgeted call end to end, PostgreSQL against SQLite in the
//! same run: two replica binaries on one mock upstream, one on a SQLite file, one on a
//! PostgreSQL server with `fsync = on`, each call reserved (committed before the
//! upstream call) and settled into its ledger, against calls straight to the mock.
//! Not run by default; figures are a release build's:
//!
//! `cargo test --release --test postgres cost:: -- --ignored --nocapture`

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::common::{Binary, TempDir};
use crate::postgres_support::Postgres;
use crate::process::{replica_toml, KEY};
use crate::redis_support::{free_port, MockUpstream};

/// Calls per path and concurrency, spread over interleaved rounds so that the
/// machine's drift falls on every path alike.
const CALLS: usize = 3000;
const ROUNDS: usize = 3;

const BODY: &str = r#"{"model":"gpt-4o","max_tokens":16,"messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}]}"#;

/// `total` calls to `url` over `concurrency` closed-loop workers: latencies sorted, and
/// calls per second.
async fn run(
    http: &reqwest::Client,
    url: &str,
    key: Option<&'static str>,
    total: usize,
    concurrency: usize,
) -> (Vec<Duration>, f64) {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (http, url, next) = (http.clone(), url.to_string(), next.clone());
            tokio::spawn(async move {
                let mut took = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    let call = Instant::now();
                    let mut req = http
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(BODY);
                    if let Some(key) = key {
                        req = req.bearer_auth(key);
                    }
                    let resp = req.send().await.unwrap();
                    assert_eq!(resp.status(), 200);
                    resp.bytes().await.unwrap();
                    took.push(call.elapsed());
                }
                took
            })
        })
        .collect();
    let mut took = Vec::new();
    for w in workers {
        took.extend(w.await.unwrap());
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    took.sort();
    (took, rate)
}

fn ms(sorted: &[Duration], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn added_latency_per_budgeted_call_postgres_against_sqlite() {
    let pg = Postgres::start_durable();
    let db = pg.create_database();
    let mock = MockUpstream::start().await;
    let dir = TempDir::new("backstop-gateway-cost");
    let stores = [
        (
            "sqlite",
            format!(
                "backend = \"sqlite\"\npath = \"{}\"",
                dir.0.join("ledger.db").display()
            ),
        ),
        (
            "postgres",
            format!(
                "backend = \"postgres\"\nurl = \"{}\"\nspool = \"{}\"",
                pg.url(&db),
                dir.0.join("spool.db").display()
            ),
        ),
    ];
    let mut gateways = Vec::new();
    for (name, store) in &stores {
        let port = free_port();
        let config = dir.0.join(format!("{name}.toml"));
        std::fs::write(&config, replica_toml(port, store, "", &mock.base_url())).unwrap();
        let gateway = Binary::start(&config, port).await;
        gateways.push((
            *name,
            format!("{}/v1/chat/completions", gateway.url),
            gateway,
        ));
    }
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let direct = format!("{}/v1/chat/completions", mock.base_url());
    let paths: Vec<(&str, String, Option<&'static str>)> =
        std::iter::once(("direct", direct, None))
            .chain(gateways.iter().map(|(n, u, _)| (*n, u.clone(), Some(KEY))))
            .collect();
    for (_, url, key) in &paths {
        run(&http, url, *key, 300, 8).await;
    }
    println!(
        "\n{CALLS} budgeted chat calls per row ({ROUNDS} interleaved rounds), closed loop; \
         added = through the gateway - straight to the mock\n"
    );
    println!("| ledger | concurrency | p50 ms | p99 ms | calls/s | added p50 ms | added p99 ms |");
    println!("|---|---|---|---|---|---|---|");
    for concurrency in [1, 32] {
        let mut pooled = vec![(Vec::new(), 0.0); paths.len()];
        for _ in 0..ROUNDS {
            for (i, (_, url, key)) in paths.iter().enumerate() {
                let (took, rate) = run(&http, url, *key, CALLS / ROUNDS, concurrency).await;
                pooled[i].0.extend(took);
                pooled[i].1 += rate / ROUNDS as f64;
            }
        }
        for (took, _) in &mut pooled {
            took.sort();
        }
        let (direct50, direct99) = (ms(&pooled[0].0, 0.5), ms(&pooled[0].0, 0.99));
        for ((name, _, _), (took, rate)) in paths.iter().zip(&pooled) {
            let (p50, p99) = (ms(took, 0.5), ms(took, 0.99));
            let added = match *name {
                "direct" => "| - | - |".to_string(),
                _ => format!("| {:+.3} | {:+.3} |", p50 - direct50, p99 - direct99),
            };
            println!("| {name} | {concurrency} | {p50:.3} | {p99:.3} | {rate:.0} {added}");
        }
    }
    let rows: u64 = pg.psql(&db, "SELECT COUNT(*) FROM ledger").parse().unwrap();
    println!("\npostgres ledger rows: {rows}");
}
