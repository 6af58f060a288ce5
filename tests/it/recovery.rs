//! Recovery end to end: the real gateway, two real mock upstreams, real sockets.
//! (Timing-sensitive policy is covered on a paused clock in `recovery_policy.rs`.)

use crate::common::*;
use backstop::mock;
use futures_util::StreamExt;
use serde_json::json;
use tokio::net::TcpListener;

const ADMIN: &str = "admin-token-0123456789";

struct Pair {
    gw: Gateway,
    backup: mock::MockHandle,
}

/// A gateway whose `pair-*` route fails over from the primary mock to a second mock.
/// The upstreams' names are this file's own: breaker gauges are process-wide, and
/// other tests in the binary have a `primary`.
async fn pair(threshold: u32) -> Pair {
    let backup = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let backup_addr = backup.addr;
    let gw = start_with(move |config| {
        let primary = config.str_at("upstreams.mock-openai.base_url");
        config.merge(&format!(
            r#"
[breaker]
failure_threshold = {threshold}
open_for = "30s"
# A fixed opening: these tests look at an open breaker, not its growth.
open_min = "30s"

[admin]
token = "{ADMIN}"

[[upstreams]]
name = "pair-primary"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{primary}"
attempt_timeout = "300ms"

[[upstreams]]
name = "pair-backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{backup_addr}"

[[routes]]
model = "pair-*"
targets = [{{ upstream = "pair-primary" }}, {{ upstream = "pair-backup", model = "backup-model" }}]
"#
        ))
    })
    .await;
    Pair { gw, backup }
}

#[tokio::test]
async fn transient_failures_are_retried_and_reported() {
    let gw = start().await;
    let resp = gw
        .chat("retry", "status=503,status=503,ok", chat("gpt-4o"))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-backstop-attempts"], "3");
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "retry:503,retry:503,ok"
    );
    assert_eq!(gw.mock.attempts("retry"), 3);
    assert_eq!(
        json(resp).await["choices"][0]["message"]["content"],
        "mock: hello"
    );
}

#[tokio::test]
async fn an_exhausted_target_fails_over_with_the_targets_model() {
    let p = pair(100).await;
    // Both mocks reset every connection: max_attempts on each, in order.
    let resp = p.gw.chat("failover-reset", "reset", chat("pair-x")).await;
    assert_eq!(
        p.gw.mock.attempts("failover-reset"),
        3,
        "all attempts on the primary"
    );
    assert_eq!(
        p.backup.attempts("failover-reset"),
        3,
        "then all on the backup"
    );
    assert_eq!(resp.status(), 502);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "retry:reset,retry:reset,giveup:reset,failover:pair-backup,retry:reset,retry:reset,giveup:reset"
    );
    assert_eq!(
        p.backup.last_request("failover-reset").unwrap()["body"]["model"],
        "backup-model"
    );
}

#[tokio::test]
async fn failover_reaches_a_healthy_backup() {
    let p = pair(100).await;
    // Each mock plays the script from its own attempt count, so the fault here is one
    // only the primary fails on: a 1 s delay against its 300 ms attempt_timeout. A hang
    // is not waited out again on the same target while a healthy backup can answer now.
    let resp = p.gw.chat("failover-slow", "delay=1s", chat("pair-x")).await;
    assert_eq!(resp.status(), 200, "{:?}", resp.headers());
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "defer:timeout,failover:pair-backup,ok"
    );
    assert_eq!(resp.headers()["x-backstop-attempts"], "2");
    assert_eq!(p.gw.mock.attempts("failover-slow"), 1);
    assert_eq!(p.backup.attempts("failover-slow"), 1);
}

#[tokio::test]
async fn the_breaker_opens_and_then_skips_the_network() {
    let p = pair(3).await;
    let resp = p.gw.chat("hard-down", "status=500", chat("pair-x")).await;
    // Three 500s open the primary (threshold 3), three more open the backup.
    assert_eq!(resp.status(), 500);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert_eq!(
        p.gw.mock.attempts("hard-down") + p.backup.attempts("hard-down"),
        6
    );

    let resp = p.gw.chat("hard-down", "status=500", chat("pair-x")).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "open:pair-primary,failover:pair-backup,open:pair-backup"
    );
    assert_eq!(resp.headers()["x-backstop-attempts"], "0");
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((29..=30).contains(&retry_after), "{retry_after}");
    assert_eq!(json(resp).await["error"]["code"], "circuit_open");
    assert_eq!(
        p.gw.mock.attempts("hard-down") + p.backup.attempts("hard-down"),
        6,
        "no network while open"
    );

    let admin =
        p.gw.http
            .get(format!("{}/admin/upstreams", p.gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
    assert_eq!(admin.status(), 200);
    let admin = json(admin).await;
    let state = |name: &str| {
        admin["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["name"] == name)
            .unwrap()["breaker"]["state"]
            .clone()
    };
    assert_eq!(state("pair-primary"), "open");
    assert_eq!(state("pair-backup"), "open");
    assert_eq!(state("mock-openai"), "closed");
    let denied =
        p.gw.http
            .get(format!("{}/admin/upstreams", p.gw.url))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap();
    assert_eq!(denied.status(), 401, "a tenant key is not the admin token");

    let metrics = p.gw.metrics().await;
    assert!(
        metrics.contains("backstop_breaker_state{upstream=\"pair-primary\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("backstop_breaker_transitions_total{upstream=\"pair-primary\",to=\"open\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn caller_faults_pass_through_once_and_never_open_the_breaker() {
    let p = pair(2).await;
    for _ in 0..10 {
        let resp = p.gw.chat("caller", "status=400", chat("pair-x")).await;
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.headers()["x-backstop-recovery"], "pass:400");
    }
    assert_eq!(p.gw.mock.attempts("caller"), 10);
    assert_eq!(p.backup.attempts("caller"), 0);
    let resp = p.gw.chat("after-caller", "", chat("pair-x")).await;
    assert_eq!(resp.headers()["x-backstop-recovery"], "ok");
}

#[tokio::test]
async fn a_long_retry_after_is_passed_on_at_once() {
    let gw = start().await;
    // Not waited: a 30 s wait would have met the 10 s request deadline (504), and one
    // attempt means no retry. The wait itself is measured on a paused clock in
    // recovery_policy::retry_after_beyond_the_cap_fails_fast_with_the_upstreams_answer.
    let resp = gw
        .chat("long-ra", "status=429;retry_after=30", chat("gpt-4o"))
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "30");
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert_eq!(gw.mock.attempts("long-ra"), 1);
}

#[tokio::test]
async fn streams_are_retried_only_before_their_first_byte() {
    let gw = start().await;
    let stream = json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hello"}]});
    // A 503, then a stream that breaks before its first chunk: both retried.
    let resp = gw
        .chat("stream-retry", "status=503,cut=0,ok", stream.clone())
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "retry:503,retry:reset,ok"
    );
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(gw.mock.attempts("stream-retry"), 3);

    // A break after the first byte: not retried, ended with an error event.
    let resp = gw.chat("stream-late", "cut=2", stream).await;
    assert_eq!(resp.headers()["x-backstop-attempts"], "1");
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    while let Some(Ok(chunk)) = body.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.contains("upstream_stream_error"), "{text}");
    assert_eq!(gw.mock.attempts("stream-late"), 1);
}

#[tokio::test]
async fn the_admin_api_is_off_without_a_token() {
    let gw = start().await;
    let resp = gw
        .http
        .get(format!("{}/admin/upstreams", gw.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
}

/// `[upstreams.breaker]` and `[upstreams.retry]` override the global defaults for one
/// upstream: the primary opens at its first failure, the backup (the global threshold
/// of 3) tries twice per request, as its own `max_attempts` says.
#[tokio::test]
async fn each_upstream_has_its_own_breaker_threshold_and_attempts() {
    let backup = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let backup_addr = backup.addr;
    let gw = start_with(move |config| {
        let primary = config.str_at("upstreams.mock-openai.base_url");
        config.merge(&format!(
            r#"
[breaker]
failure_threshold = 3
open_for = "30s"
open_min = "30s"

[[upstreams]]
name = "own-primary"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{primary}"

[upstreams.breaker]
failure_threshold = 1

[[upstreams]]
name = "own-backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{backup_addr}"

[upstreams.retry]
max_attempts = 2

[[routes]]
model = "own-*"
targets = [{{ upstream = "own-primary" }}, {{ upstream = "own-backup" }}]
"#
        ))
    })
    .await;
    let resp = gw.chat("own-hard-down", "status=500", chat("own-x")).await;
    assert_eq!(resp.status(), 500);
    assert_eq!(
        gw.mock.attempts("own-hard-down"),
        1,
        "primary opens at once"
    );
    assert_eq!(
        backup.attempts("own-hard-down"),
        2,
        "backup: two attempts, still closed"
    );

    let resp = gw.chat("own-hard-down", "status=500", chat("own-x")).await;
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "open:own-primary,failover:own-backup,giveup:500"
    );
    assert_eq!(
        gw.mock.attempts("own-hard-down"),
        1,
        "no network while open"
    );
    assert_eq!(
        backup.attempts("own-hard-down"),
        3,
        "its third failure opens it"
    );

    let resp = gw.chat("own-hard-down", "status=500", chat("own-x")).await;
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "open:own-primary,failover:own-backup,open:own-backup"
    );
    assert_eq!(
        gw.mock.attempts("own-hard-down") + backup.attempts("own-hard-down"),
        4
    );
}
