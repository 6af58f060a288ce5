//! Replicas sharing only PostgreSQL (no Redis): each budgeted call reads what the fleet
//! has committed, so a cap holds across replicas, not per replica.

use crate::common::*;
use crate::postgres_support::Postgres;

const CAPPED: &str = "bk-capped-key-pg2";

async fn replica(pg: &Postgres, db: &str) -> Gateway {
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}\"\nstatement_timeout = \"2s\"",
        pg.url(db)
    );
    start_with(move |config| {
        with_store(config, &store)
            .merge(&admin_and_prices())
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
    let replicas = [replica(&pg, &db).await, replica(&pg, &db).await];
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
