//! The spool through real processes: a replica (`on_unavailable = "open"`) keeps
//! serving budgeted calls while PostgreSQL is down, is killed with `kill -9` with calls
//! in flight, and a new process on the same spool, once Postgres is back, replays what
//! the dead one kept: every upstream call is in the ledger exactly once.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::common::{Binary, TempDir};
use crate::postgres_support::Postgres;
use crate::process::{call, ledger_settles, replica_toml};
use crate::redis_support::{free_port, MockUpstream};

/// The value of an unlabelled metric on a `/metrics` page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .find_map(|v| v.trim().parse().ok())
}

async fn metrics(http: &reqwest::Client, url: &str) -> String {
    let resp = http.get(format!("{url}/metrics")).send().await.unwrap();
    resp.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_spooled_by_a_replica_killed_while_postgres_was_down_are_replayed_by_the_next() {
    let pg = Arc::new(Postgres::start());
    let db = pg.create_database();
    let mock = MockUpstream::start().await;
    let dir = TempDir::new("backstop-spool-kill");
    let port = free_port();
    let spool = dir.0.join("spool.db");
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}\"\nspool = \"{}\"\nstatement_timeout = \"1s\"\nreplica_lease = \"2s\"",
        pg.url(&db),
        spool.display()
    );
    let config = dir.0.join("replica.toml");
    std::fs::write(
        &config,
        replica_toml(port, &store, "on_unavailable = \"open\"", &mock.base_url()),
    )
    .unwrap();
    let log = |name: &str| std::fs::File::create(dir.0.join(name)).unwrap().into();
    let first = Binary::start_with(&config, port, log("first.log")).await;
    let http = reqwest::Client::new();
    let url = first.url.clone();

    for _ in 0..4 {
        let resp = call(&http, &url, "before", "").await.unwrap();
        assert_eq!(resp.status(), 200);
    }
    // In flight at the upstream when Postgres stops: reserved in Postgres, settled
    // while it is down.
    let straddling: Vec<_> = (0..3)
        .map(|_| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move { call(&http, &url, "straddle", "hold=straddle").await })
        })
        .collect();
    mock.wait_for("straddle", 3).await;
    let stopping = pg.clone();
    tokio::task::spawn_blocking(move || stopping.stop_now())
        .await
        .unwrap();

    // Admitted while it is down (open), reserved and settled into the spool.
    for _ in 0..10 {
        let resp = call(&http, &url, "during", "").await.unwrap();
        assert_eq!(resp.status(), 200, "open admits while postgres is down");
    }
    mock.release("straddle").await;
    for s in straddling {
        assert_eq!(s.await.unwrap().unwrap().status(), 200);
    }
    // Admitted while it is down and still at the upstream when the replica dies: only
    // their reservations are in the spool.
    let held: Vec<_> = (0..3)
        .map(|_| {
            let (http, url) = (http.clone(), url.clone());
            tokio::spawn(async move { call(&http, &url, "held", "hang").await })
        })
        .collect();
    mock.wait_for("held", 3).await;
    // 10 reservations and 10 settles, 3 settles of the straddling calls, 3 reservations
    // of the held ones: each fsynced before it was answered.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let page = metrics(&http, &url).await;
        let spooled = metric(&page, "backstop_store_spooled_writes");
        if spooled == Some(26.0) {
            break;
        }
        assert!(Instant::now() < deadline, "spooled: {spooled:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill();
    for h in held {
        assert!(
            h.await.unwrap().is_err(),
            "a killed replica answers nothing"
        );
    }

    let starting = pg.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .unwrap();
    let next = Binary::start_with(&config, port, log("next.log")).await;
    let made = mock.attempts("before").await
        + mock.attempts("straddle").await
        + mock.attempts("during").await
        + mock.attempts("held").await;
    assert_eq!(made, 4 + 3 + 10 + 3);
    // The spool is replayed at start; the held calls' reservations (the dead process's)
    // are charged once its lease has passed.
    let (rows, open) = ledger_settles(&pg, &db, made).await;
    let logs = std::fs::read_to_string(dir.0.join("next.log")).unwrap_or_default();
    assert_eq!(
        (rows, open),
        (made, 0),
        "one ledger row per upstream call, none left open; the next process said:\n{logs}"
    );
    assert_eq!(
        pg.psql(&db, "SELECT SUM(calls) FROM ledger"),
        made.to_string()
    );
    // Settled calls at what they cost (the mock reports output tokens); the held ones,
    // never settled, at their reserved amount (no output).
    assert_eq!(
        pg.psql(&db, "SELECT COUNT(*) FROM ledger WHERE output_tokens = 0"),
        "3"
    );
    let page = metrics(&http, &next.url).await;
    assert_eq!(metric(&page, "backstop_store_spooled_writes"), Some(0.0));
    assert_eq!(
        metric(&page, "backstop_store_replayed_writes_total"),
        Some(26.0),
        "every write the dead process kept, replayed by the next at start"
    );
    assert!(
        logs.contains("writes left in the spool by an earlier process are in postgres"),
        "{logs}"
    );
}
