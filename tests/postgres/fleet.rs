//! The fleet of issue 27: three replica binaries on one Redis (the counters) and one
//! PostgreSQL (the ledger), budgeted calls spread over them, one replica killed with
//! `kill -9` mid-run with calls in flight at the upstream. The ledger then holds one
//! row per upstream call made, each once, and its totals equal Redis's counters.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::common::{chat, Binary, TempDir, ADMIN};
use crate::postgres_support::Postgres;
use crate::process::{ledger_settles, replica_toml, KEY as FLEET};
use crate::redis_support::{free_port, MockUpstream, Redis};

const CALLS: u64 = 1000;

/// A replica of the fleet: the ledger on Postgres (its own spool), the counters on Redis.
fn replica_config(
    port: u16,
    pg_url: &str,
    spool: &std::path::Path,
    redis: &Redis,
    prefix: &str,
    mock: &str,
) -> String {
    let store = format!(
        "backend = \"postgres\"\nurl = \"{pg_url}\"\nspool = \"{}\"\nstatement_timeout = \"2s\"\nreplica_lease = \"2s\"",
        spool.display()
    );
    let state = format!(
        "backend = \"redis\"\nurl = \"{}\"\nkey_prefix = \"{prefix}\"\nreplicas = 3\ncommand_timeout = \"1s\"\nreservation_ttl = \"2s\"\non_unavailable = \"closed\"",
        redis.url()
    );
    replica_toml(port, &store, &state, mock)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_mid_run_leaves_one_ledger_row_per_upstream_call_matching_redis() {
    let pg = Postgres::start();
    let db = pg.create_database();
    let redis = Redis::start();
    let mock = MockUpstream::start().await;
    let dir = TempDir::new("backstop-fleet");
    let prefix = format!("fleet-{}", uuid::Uuid::new_v4().simple());
    let mut replicas = Vec::new();
    for i in 0..3 {
        let port = free_port();
        let config = dir.0.join(format!("replica-{i}.toml"));
        let spool = dir.0.join(format!("replica-{i}-spool.db"));
        let text = replica_config(
            port,
            &pg.url(&db),
            &spool,
            &redis,
            &prefix,
            &mock.base_url(),
        );
        std::fs::write(&config, text).unwrap();
        replicas.push(Binary::start(&config, port).await);
    }
    let urls: Arc<Vec<String>> = Arc::new(replicas.iter().map(|r| r.url.clone()).collect());
    let http = reqwest::Client::new();
    let call = {
        let http = http.clone();
        move |url: String, headers: Vec<(&'static str, &'static str)>| {
            let mut req = http
                .post(format!("{url}/v1/chat/completions"))
                .bearer_auth(FLEET)
                .body(serde_json::Value::from(chat("gpt-4o").max_tokens(16)).to_string());
            for (k, v) in headers {
                req = req.header(k, v);
            }
            req.send()
        }
    };

    // Eight clients round-robin over the replicas still up; replica 0 is taken out of
    // the rotation (and drained of its calls) before its kill.
    let sent = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let draining = Arc::new(AtomicBool::new(false));
    let on_zero = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..8 {
        let (sent, answered, failed, draining, on_zero, next, urls, call) = (
            sent.clone(),
            answered.clone(),
            failed.clone(),
            draining.clone(),
            on_zero.clone(),
            next.clone(),
            urls.clone(),
            call.clone(),
        );
        clients.push(tokio::spawn(async move {
            while sent.fetch_add(1, Ordering::Relaxed) < CALLS {
                let mut i = next.fetch_add(1, Ordering::Relaxed) % 3;
                if i == 0 {
                    on_zero.fetch_add(1, Ordering::SeqCst);
                    if draining.load(Ordering::SeqCst) {
                        on_zero.fetch_sub(1, Ordering::SeqCst);
                        i = 1 + next.fetch_add(1, Ordering::Relaxed) % 2;
                    }
                }
                let resp = call(urls[i].clone(), vec![("x-mock-scenario", "fleet")]).await;
                if i == 0 {
                    on_zero.fetch_sub(1, Ordering::SeqCst);
                }
                match resp {
                    Ok(r) if r.status() == 200 => {}
                    other => {
                        eprintln!("replica {i}: {:?}", other.map(|r| r.status()));
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while answered.load(Ordering::Relaxed) < CALLS / 3 {
        assert!(Instant::now() < deadline, "stuck before the kill");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    draining.store(true, Ordering::SeqCst);
    while on_zero.load(Ordering::SeqCst) > 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Three calls in flight at the upstream on replica 0 when it dies: made, maybe
    // billed, never settled.
    let held: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(call(
                urls[0].clone(),
                vec![("x-mock-scenario", "held"), ("x-mock-fault", "hang")],
            ))
        })
        .collect();
    mock.wait_for("held", 3).await;
    replicas.remove(0).kill();
    for h in held {
        assert!(
            h.await.unwrap().is_err(),
            "a killed replica answers nothing"
        );
    }
    for c in clients {
        c.await.unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "every call to a live replica went through"
    );

    // Past the leases (Redis's reservation_ttl, the ledger's replica_lease), the dead
    // replica's calls are charged at their reserved amount on both sides; Redis does it
    // at the tenant's next admission, so that waits until its leases have run out on
    // Redis's clock (the ledger's recovery is waited for below).
    assert_eq!(
        redis.until_leases_run_out(&prefix, "fleet").await,
        3,
        "the dead replica's three reservations are held"
    );
    let last = call(replicas[0].url.clone(), vec![("x-mock-scenario", "fleet")])
        .await
        .unwrap();
    assert_eq!(last.status(), 200);
    let made = mock.attempts("fleet").await + mock.attempts("held").await;
    assert_eq!(made, CALLS + 1 + 3);

    let (rows, open) = ledger_settles(&pg, &db, made).await;
    assert_eq!(
        (rows, open),
        (made, 0),
        "one row per upstream call, none left open"
    );

    let ledger = pg.psql(
        &db,
        "SELECT SUM(calls) || ' ' || SUM(input_tokens + output_tokens) || ' ' || SUM(usd) FROM ledger WHERE tenant = 'fleet'",
    );
    let mut parts = ledger.split(' ');
    let (calls, tokens, usd): (u64, u64, f64) = (
        parts.next().unwrap().parse().unwrap(),
        parts.next().unwrap().parse().unwrap(),
        parts.next().unwrap().parse().unwrap(),
    );
    let view = http
        .get(format!("{}/admin/tenants/fleet", replicas[0].url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let view: serde_json::Value = serde_json::from_str(&view).unwrap();
    let redis_day = &view["used_today"];
    assert_eq!(redis_day["calls"], calls, "{view}");
    assert_eq!(redis_day["tokens"], tokens, "{view}");
    let redis_usd = redis_day["usd"].as_f64().unwrap();
    // Redis counts micro-dollars: one rounding per charge at most.
    assert!(
        (redis_usd - usd).abs() <= made as f64 * 1e-6,
        "ledger {usd} USD, redis {redis_usd} USD"
    );
}
