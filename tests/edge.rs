//! The edge every route shares: one request-id rule.

mod common;

use common::*;
use serde_json::json;

#[tokio::test]
async fn one_request_id_rule_on_every_route() {
    let gw = start().await;
    let chat = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    // Too long, a space, a control byte, empty: each is replaced, never echoed.
    for invalid in [
        "r".repeat(129),
        "has space".into(),
        "tab\there".into(),
        String::new(),
    ] {
        let health = gw
            .http
            .get(format!("{}/healthz", gw.url))
            .header("x-request-id", &invalid)
            .send()
            .await
            .unwrap();
        let proxied = gw
            .post(
                "/v1/chat/completions",
                Some(KEY_A),
                &[
                    ("x-mock-scenario", "rid"),
                    ("x-request-id", invalid.as_str()),
                ],
                chat.to_string(),
            )
            .await;
        assert_eq!(
            (health.status().as_u16(), proxied.status().as_u16()),
            (200, 200)
        );
        let ids: Vec<&str> = [&health, &proxied]
            .iter()
            .map(|r| r.headers()["x-request-id"].to_str().unwrap())
            .collect();
        for id in &ids {
            assert_ne!(*id, invalid);
            assert_eq!(id.len(), 32, "a fresh id: {id}");
        }
        assert_ne!(ids[0], ids[1], "each request its own id");
    }
    // The longest valid id is kept, on both.
    let longest = "v".repeat(128);
    for path in ["/healthz", "/nope"] {
        let resp = gw
            .http
            .get(format!("{}{path}", gw.url))
            .header("x-request-id", &longest)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-request-id"], longest.as_str(), "{path}");
    }
}
