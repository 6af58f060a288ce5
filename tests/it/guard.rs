//! The session guard end to end: loops stopped within a handful of calls, healthy agents
//! never interrupted. (The state machine's timing is tested on a paused clock in
//! `policy::guard`.)

use std::time::Duration;

use crate::common::*;
use backstop::clock::Clock;
use serde_json::{json, Value};

const GUARDED: &str = "bk-guarded-key-01";
const ALSO: &str = "bk-guarded-key-02";

async fn guarded(cool_down: &str, extra: &str) -> Gateway {
    guarded_on("path = \":memory:\"", cool_down, extra).await
}

/// As [`guarded`], with `store` as the `[store]` section.
async fn guarded_on(store: &str, cool_down: &str, extra: &str) -> Gateway {
    guarded_with(store, cool_down, extra, Clock::system()).await
}

/// As [`guarded_on`], with the gateway's live state on `clock`.
async fn guarded_with(store: &str, cool_down: &str, extra: &str, clock: Clock) -> Gateway {
    let (store, cool_down, extra) = (store.to_string(), cool_down.to_string(), extra.to_string());
    start_with_clock(
        move |config| {
            // The restarts shut down at once: draining is not what these tests are about.
            with_store(config, &store)
                .set("server.drain_delay", "0s")
                .merge(&admin_and_prices())
                .merge(&format!(
                    r#"
[[tenants]]
name = "guarded"
api_keys = ["{GUARDED}"]
[tenants.guard]
max_consecutive_failures = 5
identical_request_limit = 3
identical_request_window = "10m"
tool_loop_limit = 3
cool_down = "{cool_down}"
{extra}

[[tenants]]
name = "also-guarded"
api_keys = ["{ALSO}"]
[tenants.guard]
"#
                ))
        },
        clock,
    )
    .await
}

/// For the tests of the consecutive-failures rule: the same provider refusal five times
/// in a row would otherwise be the `unrecoverable` rule's, at its third.
const CONSECUTIVE: &str = "same_error_limit = 100";

fn step(n: usize) -> Value {
    chat("gpt-4o").saying(format!("step {n}")).json()
}

/// The compaction loop in miniature: an agent retrying a compaction the provider refuses
/// every time, the same way (`context_length_exceeded`; each attempt slightly
/// different). Under the consecutive-failures rule alone (`CONSECUTIVE`) it is tripped
/// at the fifth failure; by default the provider's third identical refusal trips it as
/// `unrecoverable`, with a diagnosis naming the error and the fix.
#[tokio::test]
async fn the_compaction_loop_in_miniature_is_tripped_at_the_configured_count() {
    for (extra, trips_at, names) in [
        (CONSECUTIVE, 5, "5 requests in a row failed"),
        (
            "",
            3,
            "unrecoverable): the provider refused the request the same way 3 times in a row",
        ),
    ] {
        let gw = guarded("60s", extra).await;
        let compact = |i| {
            let body = step(i);
            let gw = &gw;
            async move {
                gw.in_session(
                    GUARDED,
                    "compaction",
                    "compaction",
                    "status=400;code=context_length_exceeded",
                    &body,
                )
                .await
            }
        };
        for i in 0..trips_at {
            let resp = compact(i).await;
            assert_eq!(resp.status(), 400);
            let state = if i + 1 < trips_at {
                "recovering"
            } else {
                "tripped"
            };
            assert_eq!(
                resp.headers()["x-backstop-session-state"],
                state,
                "after failure {}",
                i + 1
            );
        }
        for i in trips_at..50 {
            let resp = compact(i).await;
            assert_eq!(resp.status(), 429);
            if i == trips_at {
                assert_eq!(resp.headers()["x-should-retry"], "false");
                let retry_after: u64 = resp.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((59..=60).contains(&retry_after));
                let body = json(resp).await;
                assert_eq!(body["error"]["code"], "session_tripped");
                let message = body["error"]["message"].as_str().unwrap();
                assert!(message.contains(names), "{body}");
                if trips_at == 3 {
                    // The diagnosis: the upstream, the provider's error, the fix.
                    assert!(
                        message.contains("HTTP 400 `context_length_exceeded`")
                            && message.contains("suggested fix: the conversation is longer than the model's context"),
                        "{message}"
                    );
                }
            }
        }
        assert_eq!(
            gw.mock.attempts("compaction"),
            trips_at as u64,
            "the rest of the 50 loop calls never reached the upstream"
        );
    }
}

#[tokio::test]
async fn the_same_request_a_fourth_time_is_a_loop() {
    let gw = guarded("60s", "").await;
    for _ in 0..3 {
        assert_eq!(
            gw.in_session(GUARDED, "same", "same", "", &step(1))
                .await
                .status(),
            200
        );
    }
    let resp = gw.in_session(GUARDED, "same", "same", "", &step(1)).await;
    assert_eq!(resp.status(), 429);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "loop_detected");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the same request was sent 4 times"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("same"), 3);
}

#[tokio::test]
async fn a_tool_loop_is_named_with_its_evidence() {
    let gw = guarded("60s", "").await;
    let mut messages = vec![json!({"role": "user", "content": "weather in Atlantis?"})];
    for i in 0..3 {
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{i}"), "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Atlantis\"}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("call_{i}"), "content": "Error: city not found"}));
    }
    let body = json!({"model": "gpt-4o", "messages": messages});
    let resp = gw.in_session(GUARDED, "tools", "tools", "", &body).await;
    assert_eq!(resp.status(), 429);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "loop_detected");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(r#"get_weather({"city":"Atlantis"}) returned the same error 3 times"#),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("tools"), 0);
}

#[tokio::test]
async fn spend_velocity_trips_the_session() {
    let gw = guarded("60s", "max_usd_per_minute = 0.02").await;
    // Each call costs $0.0125 (1000 in, 1000 out): the third sees $0.025 in the minute.
    for i in 0..2 {
        assert_eq!(
            gw.in_session(GUARDED, "velocity", "velocity", "usage=1000/1000", &step(i))
                .await
                .status(),
            200
        );
    }
    let resp = gw
        .in_session(GUARDED, "velocity", "velocity", "usage=1000/1000", &step(2))
        .await;
    assert_eq!(resp.status(), 429);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "session_tripped");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_usd_per_minute"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("velocity"), 2);
}

#[tokio::test]
async fn after_the_cool_down_one_probe_decides() {
    // The guard's time is the gateway's clock, moved past the cool-down instead of slept
    // through (tokio's own clock cannot be paused under real sockets and store threads).
    let clock = Clock::system();
    let gw = guarded_with("path = \":memory:\"", "1s", CONSECUTIVE, clock.clone()).await;
    for i in 0..5 {
        gw.in_session(GUARDED, "probe", "probe", "status=400", &step(i))
            .await;
    }
    assert_eq!(
        gw.in_session(GUARDED, "probe", "probe", "", &step(10))
            .await
            .status(),
        429
    );
    clock.skip(Duration::from_millis(1100));
    // The probe fails: tripped again.
    let resp = gw
        .in_session(GUARDED, "probe", "probe", "status=400", &step(11))
        .await;
    assert_eq!(
        (
            resp.status().as_u16(),
            resp.headers()["x-backstop-session-state"].to_str().unwrap()
        ),
        (400, "tripped")
    );
    assert_eq!(
        gw.in_session(GUARDED, "probe", "probe", "", &step(12))
            .await
            .status(),
        429
    );
    clock.skip(Duration::from_millis(1100));
    // The next probe succeeds: active again.
    let resp = gw
        .in_session(GUARDED, "probe", "probe", "", &step(13))
        .await;
    assert_eq!(
        (
            resp.status().as_u16(),
            resp.headers()["x-backstop-session-state"].to_str().unwrap()
        ),
        (200, "active")
    );
    assert_eq!(
        gw.in_session(GUARDED, "probe", "probe", "", &step(14))
            .await
            .status(),
        200
    );
    assert_eq!(gw.mock.attempts("probe"), 5 + 1 + 2);
}

#[tokio::test]
async fn a_healthy_twelve_step_agent_is_never_tripped() {
    let gw = guarded("60s", "").await;
    let mut states = Vec::new();
    for i in 0..12 {
        // A transient failure in step 6 is recovered by Backstop's retries.
        let fault = if i == 6 { "status=503,ok" } else { "" };
        let resp = gw
            .in_session(
                GUARDED,
                "healthy",
                &format!("healthy-run-{i}"),
                fault,
                &step(i),
            )
            .await;
        assert_eq!(resp.status(), 200, "step {i}");
        states.push(
            resp.headers()["x-backstop-session-state"]
                .to_str()
                .unwrap()
                .to_string(),
        );
    }
    assert!(states.iter().all(|s| s == "active"), "{states:?}");
}

#[tokio::test]
async fn sessions_are_per_tenant_and_operators_see_the_trace() {
    let gw = guarded("60s", CONSECUTIVE).await;
    for i in 0..5 {
        gw.in_session(GUARDED, "shared", "per-tenant", "status=400", &step(i))
            .await;
    }
    assert_eq!(
        gw.in_session(GUARDED, "shared", "per-tenant", "", &step(9))
            .await
            .status(),
        429
    );
    let other = gw
        .in_session(ALSO, "shared", "per-tenant", "", &step(9))
        .await;
    assert_eq!(
        other.status(),
        200,
        "the same session id under another tenant is another session"
    );

    let report = json(
        gw.http
            .get(format!("{}/admin/tenants/guarded/sessions/shared", gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(report["guard"]["signals"]["state"], "tripped");
    assert_eq!(report["guard"]["signals"]["consecutive_failures"], 5);
    assert_eq!(report["guard"]["signals"]["risk"], 1.0);
    assert_eq!(
        report["guard"]["signals"]["trip"]["rule"],
        "max_consecutive_failures"
    );
    let trace = report["guard"]["trace"].as_array().unwrap();
    assert_eq!(trace.len(), 6);
    assert_eq!(trace[0]["status"], 400);
    assert_eq!(trace[0]["attempts"], 1);
    assert_eq!(trace[0]["action"], "pass:400");
    assert_eq!(trace[0]["upstream"], "mock-openai");
    assert_eq!(trace[5]["action"], "refused:session_tripped");

    let close = gw
        .http
        .post(format!(
            "{}/admin/tenants/also-guarded/sessions/shared/close",
            gw.url
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(close.status(), 200);
    let resp = gw
        .in_session(ALSO, "shared", "per-tenant", "", &step(10))
        .await;
    assert_eq!(resp.status(), 429);
    assert!(json(resp).await["error"]["message"]
        .as_str()
        .unwrap()
        .contains("closed"));

    // An operator reset brings a tripped session back.
    let reset = gw
        .http
        .post(format!(
            "{}/admin/tenants/guarded/sessions/shared/reset",
            gw.url
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    assert_eq!(
        gw.in_session(GUARDED, "shared", "per-tenant", "", &step(11))
            .await
            .status(),
        200
    );
}

async fn trip(gw: &Gateway, session: &str) {
    for i in 0..5 {
        gw.in_session(GUARDED, session, "trip", "status=400", &step(i))
            .await;
    }
    let resp = gw.in_session(GUARDED, session, "trip", "", &step(9)).await;
    assert_eq!(resp.status(), 429);
}

async fn close(gw: &Gateway, tenant: &str, session: &str) {
    let close = gw
        .http
        .post(format!(
            "{}/admin/tenants/{tenant}/sessions/{session}/close",
            gw.url
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(close.status(), 200);
}

/// Finding 12: an operator's close and an active trip are kept in the store: a new
/// gateway on the same database still refuses both sessions.
#[tokio::test]
async fn closes_and_trips_survive_a_restart() {
    let dir = TempDir::new("backstop-guard-restart");
    let store = format!("path = \"{}\"", dir.0.join("ledger.db").display());
    let gw = guarded_on(&store, "60s", CONSECUTIVE).await;
    trip(&gw, "tripped").await;
    close(&gw, "guarded", "closed").await;
    let Gateway { server, .. } = gw;
    server.shutdown().await;

    let gw = guarded_on(&store, "60s", CONSECUTIVE).await;
    let resp = gw
        .in_session(GUARDED, "closed", "after", "", &step(1))
        .await;
    assert_eq!(resp.status(), 429);
    assert!(json(resp).await["error"]["message"]
        .as_str()
        .unwrap()
        .contains("closed"));
    let resp = gw
        .in_session(GUARDED, "tripped", "after", "", &step(2))
        .await;
    assert_eq!(resp.status(), 429);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (50..=60).contains(&retry_after),
        "the cool-down goes on: {retry_after}"
    );
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "session_tripped");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("5 requests in a row failed"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("after"), 0);
    // An operator reset still brings a session back, for good.
    let reset = gw
        .http
        .post(format!(
            "{}/admin/tenants/guarded/sessions/closed/reset",
            gw.url
        ))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    let Gateway { server, .. } = gw;
    server.shutdown().await;
    let gw = guarded_on(&store, "60s", "").await;
    assert_eq!(
        gw.in_session(GUARDED, "closed", "after", "", &step(3))
            .await
            .status(),
        200
    );
}

/// Finding 12: a tripped or closed session that idles out of memory (`session_idle`)
/// comes back tripped or closed, not fresh.
#[tokio::test]
async fn a_trip_and_a_close_outlive_idle_eviction() {
    let clock = Clock::system();
    let gw = guarded_with(
        "path = \":memory:\"\nsession_idle = \"50ms\"",
        "60s",
        "",
        clock.clone(),
    )
    .await;
    trip(&gw, "tripped").await;
    close(&gw, "guarded", "closed").await;
    // Past the idle time on the gateway's clock, then a new session's miss sweeps the
    // idle ones out of memory.
    clock.skip(Duration::from_millis(300));
    let resp = gw
        .in_session(GUARDED, "newcomer", "idle", "", &step(1))
        .await;
    assert_eq!(resp.status(), 200);
    for session in ["tripped", "closed"] {
        let resp = gw.in_session(GUARDED, session, "idle", "", &step(1)).await;
        assert_eq!(resp.status(), 429, "{session}");
        assert_eq!(json(resp).await["error"]["code"], "session_tripped");
    }
    assert_eq!(gw.mock.attempts("idle"), 1, "only the newcomer's");
}

/// A slow request in flight when its session is tripped (by a loop) or closed (by an
/// operator) answers 200 afterwards: that success does not reopen the session.
#[tokio::test]
async fn a_request_in_flight_does_not_reopen_a_tripped_or_closed_session() {
    let gw = guarded("60s", "").await;
    for (session, by_operator) in [("slow-tripped", false), ("slow-closed", true)] {
        let first = step(0);
        let hold = format!("hold={session}");
        let slow = gw.in_session(GUARDED, session, "slow", &hold, &first);
        // The slow request is admitted (it reached the upstream) before the session is
        // tripped or closed.
        let admitted_before = gw.mock.attempts("slow");
        let meanwhile = async {
            while gw.mock.attempts("slow") == admitted_before {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if by_operator {
                close(&gw, "guarded", session).await;
            } else {
                for _ in 0..3 {
                    let resp = gw.in_session(GUARDED, session, "loop", "", &step(1)).await;
                    assert_eq!(resp.status(), 200);
                }
                let resp = gw.in_session(GUARDED, session, "loop", "", &step(1)).await;
                assert_eq!(json(resp).await["error"]["code"], "loop_detected");
            }
            gw.mock.release(session);
        };
        let (slow, ()) = tokio::join!(slow, meanwhile);
        assert_eq!(slow.status(), 200, "{session}");
        let after = gw.in_session(GUARDED, session, "after", "", &step(2)).await;
        assert_eq!(after.status(), 429, "{session}");
        assert_eq!(gw.mock.attempts("after"), 0);
    }
}
