//! Idempotent replay: alone, concurrent, with another body, and across a restart.

use crate::common::*;

const ADMIN: &str = "admin-token-0123456789";
const BUDGETED: &str = "bk-budgeted-key-1";

fn say(text: &str) -> String {
    chat("gpt-4o").saying(text).to_string()
}

async fn gateway() -> Gateway {
    start_with(|c| c.merge(&format!("[admin]\ntoken = \"{ADMIN}\"\n[[tenants]]\nname = \"budgeted\"\napi_keys = [\"{BUDGETED}\"]\n[tenants.session]\nmax_calls = 100\n"))).await
}

async fn keyed(gw: &Gateway, key: &str, scenario: &str, body: String) -> reqwest::Response {
    gw.post(
        "/v1/chat/completions",
        Some(BUDGETED),
        &[
            ("idempotency-key", key),
            ("x-mock-scenario", scenario),
            ("x-session-id", "idem"),
        ],
        body,
    )
    .await
}

#[tokio::test]
async fn a_repeated_key_is_replayed_without_a_call_or_a_charge() {
    let gw = gateway().await;
    let first = keyed(&gw, "k-1", "replay", say("once")).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("x-backstop-replayed").is_none());
    // No wait for the response to be kept: until it is, the first request still leads
    // its key, and a duplicate waits for it, then replays.
    let first_body = first.text().await.unwrap();
    let second = keyed(&gw, "k-1", "replay", say("once")).await;
    assert_eq!(second.status(), 200);
    assert_eq!(second.headers()["x-backstop-replayed"], "true");
    assert_eq!(second.headers()["x-backstop-attempts"], "0");
    assert_eq!(second.text().await.unwrap(), first_body);
    assert_eq!(gw.mock.attempts("replay"), 1);
    let report = json(
        gw.http
            .get(format!("{}/admin/tenants/budgeted/sessions/idem", gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(report["used"]["calls"], 1, "the replay was not charged");
    // Another key is another request.
    assert!(keyed(&gw, "k-2", "replay", say("once"))
        .await
        .headers()
        .get("x-backstop-replayed")
        .is_none());
    assert_eq!(gw.mock.attempts("replay"), 2);
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422() {
    let gw = gateway().await;
    let first = keyed(&gw, "k", "mismatch", say("one")).await;
    assert_eq!(first.status(), 200);
    first.text().await.unwrap();
    let resp = keyed(&gw, "k", "mismatch", say("two")).await;
    assert_eq!(resp.status(), 422);
    assert_eq!(json(resp).await["error"]["code"], "idempotency_key_reused");
    assert_eq!(gw.mock.attempts("mismatch"), 1);
}

#[tokio::test]
async fn concurrent_duplicates_wait_for_the_first() {
    let gw = gateway().await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let http = gw.http.clone();
        let url = format!("{}/v1/chat/completions", gw.url);
        tasks.push(tokio::spawn(async move {
            let resp = http
                .post(url)
                .bearer_auth(BUDGETED)
                .header("idempotency-key", "together")
                .header("x-mock-scenario", "concurrent")
                .header("x-mock-fault", "delay=300ms")
                .body(say("together"))
                .send()
                .await
                .unwrap();
            (
                resp.status().as_u16(),
                resp.headers().contains_key("x-backstop-replayed"),
                resp.text().await.unwrap(),
            )
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    assert!(results.iter().all(|r| r.0 == 200));
    assert_eq!(
        results.iter().filter(|r| !r.1).count(),
        1,
        "exactly one made the call"
    );
    assert!(
        results.iter().all(|r| r.2 == results[0].2),
        "all got the same answer"
    );
    assert_eq!(gw.mock.attempts("concurrent"), 1);
}

#[tokio::test]
async fn failures_are_not_kept() {
    let gw = gateway().await;
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(BUDGETED),
            &[
                ("idempotency-key", "f"),
                ("x-mock-scenario", "fail"),
                ("x-mock-fault", "status=400,ok"),
            ],
            say("x"),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(BUDGETED),
            &[
                ("idempotency-key", "f"),
                ("x-mock-scenario", "fail"),
                ("x-mock-fault", "status=400,ok"),
            ],
            say("x"),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.mock.attempts("fail"), 2);
}

#[tokio::test]
async fn replays_survive_a_restart() {
    let dir = TempDir::new("backstop-idem");
    let (port, mock_port) = (free_port(), free_port());
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[log]\nlevel = \"warn\"\n[store]\npath = \"{}\"\n[mock]\nlisten = \"127.0.0.1:{mock_port}\"\n\
             [[upstreams]]\nname = \"mock\"\napi = \"openai\"\nforward_headers = [\"x-mock-*\"]\nbase_url = \"http://127.0.0.1:{mock_port}\"\n\
             [[routes]]\nmodel = \"gpt-*\"\ntargets = [{{ upstream = \"mock\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"{KEY_A}\"]\n",
            dir.0.join("store.db").display()
        ),
    )
    .unwrap();
    let http = reqwest::Client::new();
    let send = |url: String| {
        let http = http.clone();
        async move {
            http.post(format!("{url}/v1/chat/completions"))
                .bearer_auth(KEY_A)
                .header("idempotency-key", "survivor")
                .body(say("persist me"))
                .send()
                .await
                .unwrap()
        }
    };
    let gw = Binary::start(&config, port).await;
    let first = send(gw.url.clone()).await;
    let first_body = first.text().await.unwrap();
    // Kept before the kill: a duplicate waits while the first still leads its key, so
    // its replay means the response is in the store.
    let kept = send(gw.url.clone()).await;
    assert_eq!(kept.headers()["x-backstop-replayed"], "true");
    gw.kill();
    let gw = Binary::start(&config, port).await;
    let again = send(gw.url.clone()).await;
    assert_eq!(again.headers()["x-backstop-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first_body);
    let stats = json(
        http.get(format!("http://127.0.0.1:{mock_port}/mock/stats"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        stats["total"], 0,
        "the restarted gateway's mock never saw the replayed request"
    );
}
