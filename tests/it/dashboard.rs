//! The operator dashboard's poll (`GET /admin/ui/data`) against a real gateway and mock:
//! behind the admin token, and counting what requests did, exactly. (The page itself is
//! driven in a real browser by tests/python/test_dashboard.py; the rings' timing is
//! tested on a paused clock in `state::activity`.)

use crate::common::*;
use serde_json::{json, Value};

const GUARDED: &str = "bk-dash-guarded-01";

async fn gateway() -> Gateway {
    start_with(|config| {
        config.merge(&admin_and_prices()).merge(&format!(
            r#"
[[tenants]]
name = "guarded"
api_keys = ["{GUARDED}"]
[tenants.guard]
identical_request_limit = 3
identical_request_window = "10m"
"#
        ))
    })
    .await
}

async fn data(gw: &Gateway, query: &str) -> Value {
    let resp = gw.get(&format!("/admin/ui/data{query}"), Some(ADMIN)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["cache-control"], "no-store");
    json(resp).await
}

fn hello() -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]})
}

/// The hour's total of one recovery counter, or of one refusal reason.
fn total(data: &Value, field: &str) -> u64 {
    hour(data, |m| m[field].as_u64().unwrap())
}

fn refused(data: &Value, reason: &str) -> u64 {
    hour(data, |m| m["refused"][reason].as_u64().unwrap_or(0))
}

fn hour(data: &Value, count: impl Fn(&Value) -> u64) -> u64 {
    data["recovery"]["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(count)
        .sum()
}

/// The element of `data[list]` whose `key` is `name`.
fn named<'a>(data: &'a Value, list: &str, key: &str, name: &str) -> &'a Value {
    data[list]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item[key] == name)
        .unwrap_or_else(|| panic!("no {list} {name}: {data}"))
}

#[tokio::test]
async fn the_poll_needs_the_admin_token_but_the_page_does_not() {
    let gw = gateway().await;
    let resp = gw.get("/admin/ui/data", None).await;
    assert_eq!(resp.status(), 401);
    assert_eq!(json(resp).await["error"]["code"], "invalid_admin_token");
    let resp = gw.get("/admin/ui/data", Some("wrong")).await;
    assert_eq!(resp.status(), 401);
    let body = json(resp).await;
    assert!(
        body["error"]["message"].as_str().unwrap().len() > 10,
        "{body}"
    );

    // The page, its script and style: no token, no data, and locked down.
    for (path, kind) in [
        ("/admin/ui", "text/html"),
        ("/admin/ui/app.js", "text/javascript"),
        ("/admin/ui/style.css", "text/css"),
    ] {
        let resp = gw.get(path, None).await;
        assert_eq!(resp.status(), 200, "{path}");
        let headers = resp.headers();
        assert!(headers["content-type"].to_str().unwrap().starts_with(kind));
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
        assert!(csp.contains("frame-ancestors 'none'"));
        assert_eq!(headers["x-frame-options"], "DENY");
        assert_eq!(headers["cache-control"], "no-store");
    }
    let page = gw.get("/admin/ui", None).await.text().await.unwrap();
    assert!(!page.contains("http://") && !page.contains("https://"));
    assert!(!page.contains(ADMIN));
}

#[tokio::test]
async fn the_poll_counts_retries_refusals_and_the_tripped_session_exactly() {
    let gw = gateway().await;
    let before = data(&gw, "").await;
    assert_eq!(total(&before, "requests"), 0);
    assert_eq!(before["config"]["version"], 1);
    assert!(before["memory_only"]
        .as_str()
        .unwrap()
        .contains("survives a restart"));

    // 503, 503, ok: two retries, one request.
    let resp = gw
        .chat("dash-retry", "status=503,status=503,ok", hello())
        .await;
    assert_eq!(resp.status(), 200);
    // The same request a fourth time in a guarded session: loop_detected, refused.
    for _ in 0..3 {
        let resp = gw
            .in_session(GUARDED, "looping", "dash-loop", "", &hello())
            .await;
        assert_eq!(resp.status(), 200);
    }
    let resp = gw
        .in_session(GUARDED, "looping", "dash-loop", "", &hello())
        .await;
    assert_eq!(resp.status(), 429);
    // A healthy session of the same tenant.
    let resp = gw
        .in_session(GUARDED, "healthy", "dash-ok", "", &hello())
        .await;
    assert_eq!(resp.status(), 200);

    let after = data(&gw, "").await;
    assert_eq!(total(&after, "requests"), 6);
    assert_eq!(total(&after, "retries"), 2);
    assert_eq!(total(&after, "failed"), 0);
    assert_eq!(total(&after, "failovers"), 0);
    assert_eq!(refused(&after, "loop_detected"), 1);
    assert_eq!(refused(&after, "session_tripped"), 0);

    // The upstream saw 7 attempts: 2 transient, 5 answered.
    let mock = named(&after, "upstreams", "name", "mock-openai");
    assert_eq!(mock["hour"]["by_class"]["transient"], 2);
    assert_eq!(mock["hour"]["by_class"]["ok"], 5);
    assert_eq!(mock["breaker"]["state"], "closed");
    assert!(mock["latency_ms"]["p50"].as_f64().unwrap() > 0.0);

    // The tripped session first, its state as text and the rule's evidence.
    let sessions = &after["sessions"];
    assert_eq!(sessions["total"], 2);
    assert_eq!(sessions["by_state"], json!({"tripped": 1, "active": 1}));
    let first = &sessions["items"][0];
    assert_eq!(first["tenant"], "guarded");
    assert_eq!(first["session"], "looping");
    assert_eq!(first["state"], "tripped");
    assert_eq!(first["calls"], 3);
    assert_eq!(first["trip"]["code"], "loop_detected");
    assert_eq!(first["trip"]["rule"], "identical_request_limit");
    assert!(first["usd"].as_f64().unwrap() > 0.0);

    // Filters and the bound.
    let tripped = data(&gw, "?state=tripped").await;
    assert_eq!(tripped["sessions"]["total"], 1);
    assert_eq!(tripped["sessions"]["items"][0]["session"], "looping");
    let other = data(&gw, "?tenant=team-a").await;
    assert_eq!(other["sessions"]["total"], 0);
    let one = data(&gw, "?limit=1").await;
    assert_eq!(one["sessions"]["total"], 2);
    assert_eq!(one["sessions"]["items"].as_array().unwrap().len(), 1);

    // The tenant's day, with its spend by model; the dashboard's own polls are no traffic.
    let guarded = named(&after, "tenants", "tenant", "guarded");
    assert_eq!(guarded["guarded"], true);
    assert_eq!(guarded["used_today"]["calls"], 4);
    assert_eq!(guarded["by_model"][0]["model"], "gpt-4o");
    assert_eq!(total(&data(&gw, "").await, "requests"), 6);

    // A reset from the dashboard's button: the session is active again.
    let resp = gw
        .http
        .post(format!(
            "{}/admin/tenants/guarded/sessions/looping/reset",
            gw.url
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let reset = data(&gw, "?state=tripped").await;
    assert_eq!(reset["sessions"]["total"], 0);
    assert_eq!(reset["sessions"]["by_state"], json!({"active": 2}));

    // A caller's mistake is counted as such, not as the upstream failing.
    let resp = gw.chat("dash-bad", "status=400", hello()).await;
    assert_eq!(resp.status(), 400);
    let later = data(&gw, "").await;
    let mock = named(&later, "upstreams", "name", "mock-openai");
    assert_eq!(mock["hour"]["by_class"]["caller_fault"], 1);
    assert_eq!(mock["hour"]["by_class"]["transient"], 2);
    assert_eq!(mock["hour"]["by_class"]["ok"], 5);
}
