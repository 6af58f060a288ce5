//! Replicas sharing PostgreSQL: alone, each budgeted call reads what the fleet has
//! committed, so a cap holds across replicas, not per replica; with Redis counting,
//! every call is in the one ledger all the same, once.

use crate::common::*;
use crate::postgres_support::Postgres;
use crate::redis_support::Redis;

const CAPPED: &str = "bk-capped-key-pg2";

async fn replica(pg: &Postgres, db: &str, spools: &TempDir) -> Gateway {
    replica_with(pg, db, spools, "").await
}

/// A replica on `db`, with a spool of its own in `spools` and `extra` (a `[state]`
/// section) merged in.
async fn replica_with(pg: &Postgres, db: &str, spools: &TempDir, extra: &str) -> Gateway {
    let spool = spools
        .0
        .join(format!("spool-{}.db", uuid::Uuid::new_v4().simple()));
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}\"\nstatement_timeout = \"2s\"\nspool = \"{}\"",
        pg.url(db),
        spool.display()
    );
    let extra = extra.to_string();
    start_with(move |config| {
        with_store(config, &store)
            .merge(&admin_and_prices())
            .merge(&extra)
            .merge(&format!(
                r#"
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
max_calls = 5
"#
            ))
    })
    .await
}

/// Calls of one session alternate between two replicas: five are made in all, not
/// five per replica.
#[tokio::test]
async fn a_session_cap_holds_across_replicas_sharing_only_postgres() {
    let pg = Postgres::start();
    let db = pg.create_database();
    let spools = TempDir::new("backstop-pg-replicas");
    let replicas = [
        replica(&pg, &db, &spools).await,
        replica(&pg, &db, &spools).await,
    ];
    let mut ok = 0;
    let mut refused = Vec::new();
    for i in 0..12 {
        let resp = replicas[i % 2]
            .post(
                "/v1/chat/completions",
                Some(CAPPED),
                &[("x-session-id", "shared-session")],
                chat("gpt-4o").max_tokens(16),
            )
            .await;
        match resp.status().as_u16() {
            200 => ok += 1,
            status => refused.push((status, json(resp).await["error"]["code"].clone())),
        }
    }
    let made: u64 = replicas.iter().map(|r| r.mock.state_total()).sum();
    assert_eq!((ok, made), (5, 5), "refused: {refused:?}");
    assert!(
        refused.iter().all(|(_, code)| code
            .as_str()
            .is_some_and(|c| c.contains("budget") || c.contains("exceeded"))),
        "{refused:?}"
    );
    let rows: u64 = pg.psql(&db, "SELECT COUNT(*) FROM ledger").parse().unwrap();
    assert_eq!(rows, 5);
}

/// Redis counts (the cap), PostgreSQL keeps the ledger: each call made, budgeted (held
/// in Redis) or not, is one ledger row, and no reservation is left open.
#[tokio::test]
async fn with_redis_counting_every_call_made_is_one_ledger_row() {
    let pg = Postgres::start();
    let db = pg.create_database();
    let redis = Redis::start();
    let state = format!("[state]\nbackend = \"redis\"\nurl = \"{}\"\n", redis.url());
    let spools = TempDir::new("backstop-pg-replicas");
    let replicas = [
        replica_with(&pg, &db, &spools, &state).await,
        replica_with(&pg, &db, &spools, &state).await,
    ];
    let mut ok = 0;
    for i in 0..12 {
        // Budgeted (a session with caps), then not (no session: the tenant has no day cap).
        let headers: &[(&str, &str)] = if i % 3 == 2 {
            &[]
        } else {
            &[("x-session-id", "shared-session")]
        };
        let resp = replicas[i % 2]
            .post(
                "/v1/chat/completions",
                Some(CAPPED),
                headers,
                chat("gpt-4o").max_tokens(16),
            )
            .await;
        if resp.status() == 200 {
            ok += 1;
        }
    }
    let made: u64 = replicas.iter().map(|r| r.mock.state_total()).sum();
    assert_eq!(made, ok);
    assert_eq!(made, 5 + 4, "five in the capped session, four without one");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let rows: u64 = pg.psql(&db, "SELECT COUNT(*) FROM ledger").parse().unwrap();
        let open: u64 = pg
            .psql(&db, "SELECT COUNT(*) FROM reservations")
            .parse()
            .unwrap();
        if (rows, open) == (made, 0) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ledger rows {rows}, open reservations {open}, calls made {made}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
