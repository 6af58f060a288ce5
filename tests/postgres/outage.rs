//! A gateway whose ledger is PostgreSQL, with Postgres stopped as a crash would
//! (`pg_ctl stop -m immediate`) and started again while budgeted calls keep coming:
//! no charge is lost (ledger rows = upstream calls made, each once), and while it is
//! down budgeted calls follow `[state] on_unavailable`: refused with 503
//! `store_unavailable` before the upstream (closed), or admitted and counted (open).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use crate::common::*;
use crate::postgres_support::Postgres;

const CAPPED: &str = "bk-capped-key-pg1";

async fn gateway(pg: &Postgres, db: &str, on_unavailable: &str, spool: &TempDir) -> Gateway {
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}\"\nstatement_timeout = \"1s\"\npool_size = 8\nspool = \"{}\"",
        pg.url(db),
        spool.0.join("spool.db").display()
    );
    let on_unavailable = on_unavailable.to_string();
    start_with(move |config| {
        with_store(config, &store)
            .merge(&admin_and_prices())
            .merge(&format!(
                r#"
[state]
on_unavailable = "{on_unavailable}"

[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.budget]
usd_per_day = 1000.0
"#
            ))
    })
    .await
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    refused: AtomicU64,
    /// Answers other than 200 and 503 `store_unavailable`.
    other: AtomicU64,
    /// Calls answered while Postgres was down (sent after the stop, answered before
    /// the start).
    during: AtomicU64,
    ok_during: AtomicU64,
}

/// Four clients calling in a loop; Postgres stopped after 40 answers, started again
/// once 20 calls have been answered while it was down, the clients stopped 40 answers
/// later. Then waits for the ledger to hold every call made.
async fn restart_mid_traffic(on_unavailable: &str) -> (Arc<Tally>, u64, String) {
    let pg = Arc::new(Postgres::start());
    let db = pg.create_database();
    let spool = TempDir::new("backstop-pg-outage");
    let gw = Arc::new(gateway(&pg, &db, on_unavailable, &spool).await);
    let tally = Arc::new(Tally::default());
    let down = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (gw, tally, down, stop, answered) = (
            gw.clone(),
            tally.clone(),
            down.clone(),
            stop.clone(),
            answered.clone(),
        );
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let sent_down = down.load(Ordering::Relaxed);
                let resp = gw
                    .post(
                        "/v1/chat/completions",
                        Some(CAPPED),
                        &[],
                        chat("gpt-4o").max_tokens(16),
                    )
                    .await;
                let status = resp.status().as_u16();
                let body = json(resp).await;
                let during = sent_down && down.load(Ordering::Relaxed);
                if during {
                    tally.during.fetch_add(1, Ordering::Relaxed);
                }
                match status {
                    200 => {
                        tally.ok.fetch_add(1, Ordering::Relaxed);
                        if during {
                            tally.ok_during.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    503 if body["error"]["code"] == "store_unavailable" => {
                        tally.refused.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        eprintln!("unexpected answer {status}: {body}");
                        tally.other.fetch_add(1, Ordering::Relaxed);
                    }
                }
                answered.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let wait_for = |target: u64, what: &'static str| {
        let answered = answered.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while answered.load(Ordering::Relaxed) < target {
                assert!(Instant::now() < deadline, "{what}: stuck");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(40, "before the stop").await;
    let stopping = pg.clone();
    tokio::task::spawn_blocking(move || stopping.stop_now())
        .await
        .unwrap();
    down.store(true, Ordering::Relaxed);
    let at_stop = answered.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(60);
    while tally.during.load(Ordering::Relaxed) < 20 {
        assert!(Instant::now() < deadline, "no calls answered while down");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let starting = pg.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .unwrap();
    down.store(false, Ordering::Relaxed);
    let at_start = answered.load(Ordering::Relaxed);
    assert!(at_start > at_stop);
    wait_for(at_start + 40, "after the start").await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let made = gw.mock.state_total();
    assert_eq!(
        made,
        tally.ok.load(Ordering::Relaxed),
        "one upstream call per admitted call, none for a refused one"
    );
    // The charges kept while it was down are written with the writer's backoff.
    let deadline = Instant::now() + Duration::from_secs(30);
    let rows = loop {
        let rows: u64 = pg.psql(&db, "SELECT COUNT(*) FROM ledger").parse().unwrap();
        if rows >= made || Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(rows, made, "every call made is in the ledger, once");
    let calls: u64 = pg
        .psql(&db, "SELECT COALESCE(SUM(calls), 0) FROM ledger")
        .parse()
        .unwrap();
    assert_eq!(calls, made);
    // None left behind: settled, or withdrawn for a call refused after its write failed
    // (it may have landed with its acknowledgement lost).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let open: u64 = pg
            .psql(&db, "SELECT COUNT(*) FROM reservations")
            .parse()
            .unwrap();
        if open == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{open} reservations left open");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "{on_unavailable}: {made} calls made, {} refused, {} answered while postgres was down",
        tally.refused.load(Ordering::Relaxed),
        tally.during.load(Ordering::Relaxed)
    );
    (tally, made, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_refuses_budgeted_calls_while_postgres_is_down_and_loses_no_charge() {
    let (tally, made, _) = restart_mid_traffic("closed").await;
    assert_eq!(tally.other.load(Ordering::Relaxed), 0);
    assert!(
        tally.refused.load(Ordering::Relaxed) >= 15,
        "refused while down: {} of {} (made {made})",
        tally.refused.load(Ordering::Relaxed),
        tally.during.load(Ordering::Relaxed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_admits_and_counts_budgeted_calls_while_postgres_is_down() {
    let (tally, made, _) = restart_mid_traffic("open").await;
    assert_eq!(tally.other.load(Ordering::Relaxed), 0);
    assert_eq!(
        tally.refused.load(Ordering::Relaxed),
        0,
        "open refuses nothing"
    );
    assert!(
        tally.ok_during.load(Ordering::Relaxed) >= 20,
        "admitted while down: {} (made {made})",
        tally.ok_during.load(Ordering::Relaxed)
    );
}
