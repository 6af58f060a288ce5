//! Early failure prediction across sessions, end to end (one gateway, its embedded fleet
//! view; replicas sharing it in Redis are `tests/redis/fleet.rs`): once three sessions
//! have failed the same way twice each, the next session is tripped at its first such
//! failure; with `preempt` a request of that shape is refused before its first attempt,
//! one probe per cool-down is let through, and a probe that succeeds lets the shape
//! through again. Healthy sessions whose failures differ are never tripped. The rule's
//! arithmetic is tested on a paused clock in `policy::fleet`.

use std::time::Duration;

use crate::common::*;
use backstop::clock::Clock;
use serde_json::{json, Value};

const KEY: &str = "bk-fleet-tenant-key";
const OVERFLOW: &str = "status=400;code=context_length_exceeded";

/// A gateway whose tenant `fleet` has the guard and `[tenants.guard.fleet]` (three
/// sessions failing twice within 10m, a 30s cool-down) with `extra` lines, or no fleet
/// table at all when `extra` is `None`.
async fn fleet_gateway(extra: Option<&str>, clock: Clock) -> Gateway {
    let fleet = extra.map_or(String::new(), |extra| {
        format!(
            "[tenants.guard.fleet]\nmin_sessions = 3\nmin_failures = 2\nwindow = \"10m\"\ncool_down = \"30s\"\n{extra}\n"
        )
    });
    start_with_clock(
        move |config| {
            config.merge(&admin_and_prices()).merge(&format!(
                r#"
[[tenants]]
name = "fleet"
api_keys = ["{KEY}"]
[tenants.guard]
max_consecutive_failures = 5
cool_down = "60s"
{fleet}
"#
            ))
        },
        clock,
    )
    .await
}

/// An agent's context compaction: the same template in every session, with its own
/// run id and numbers.
fn compaction(run: &str, attempt: usize) -> Value {
    json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "You are a coding agent. Today is 2025-01-03."},
        {"role": "user", "content": format!("Fix the failing test in module {run}")},
        {"role": "assistant", "content": format!("Working on it (step {attempt})")},
        {"role": "user", "content": format!("Summarize the conversation so far in under {} tokens for run {run}.", 1000 + attempt)},
    ]})
}

async fn send(
    gw: &Gateway,
    run: &str,
    scenario: &str,
    fault: &str,
    body: &Value,
) -> reqwest::Response {
    gw.in_session(KEY, run, scenario, fault, body).await
}

fn state(resp: &reqwest::Response) -> String {
    resp.headers()["x-backstop-session-state"]
        .to_str()
        .unwrap()
        .to_string()
}

fn retry_after(resp: &reqwest::Response) -> u64 {
    resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Three sessions each fail the compaction twice: the signature is hot from the third
/// session's second failure, which trips that session.
async fn make_hot(gw: &Gateway) {
    for run in ["r-1", "r-2", "r-3"] {
        for attempt in 0..2 {
            let resp = send(gw, run, "compaction", OVERFLOW, &compaction(run, attempt)).await;
            assert_eq!(resp.status(), 400, "{run} attempt {attempt}");
            let expected = if run == "r-3" && attempt == 1 {
                "tripped"
            } else {
                "recovering"
            };
            assert_eq!(state(&resp), expected, "{run} attempt {attempt}");
        }
    }
}

#[tokio::test]
async fn once_three_sessions_failed_twice_the_next_is_tripped_at_its_first_failure() {
    let gw = fleet_gateway(Some(""), Clock::system()).await;
    make_hot(&gw).await;
    // A fourth session: its first failure trips it, its retry never reaches the upstream.
    let resp = send(&gw, "r-4", "compaction", OVERFLOW, &compaction("r-4", 0)).await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (400, "tripped")
    );
    let resp = send(&gw, "r-4", "compaction", OVERFLOW, &compaction("r-4", 1)).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert!(
        (29..=30).contains(&retry_after(&resp)),
        "the fleet's cool-down"
    );
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "session_tripped");
    let message = body["error"]["message"].as_str().unwrap();
    for part in [
        "session_tripped (fleet_pattern): 4 sessions of this tenant failed the same way within 10m (3 of them at least 2 times): signature ",
        "context_length_exceeded (caller_fault, HTTP 400) from model gpt-4o (route gpt-*) on /v1/chat/completions",
        "last user message \"summarize the conversation so far in under # tokens for run #.\"",
    ] {
        assert!(message.contains(part), "{part} in {message}");
    }
    assert_eq!(gw.mock.attempts("compaction"), 3 * 2 + 1);

    // The same shape failing another way is another signature: counted apart.
    let resp = send(&gw, "r-5", "other", "status=422", &compaction("r-5", 0)).await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (422, "recovering")
    );
    // Another session's other work is untouched.
    let resp = send(
        &gw,
        "r-6",
        "healthy",
        "",
        &chat("gpt-4o").saying("What is 2+2?"),
    )
    .await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (200, "active")
    );

    // The session's recovery trace names the rule, on the failure and on the refusal.
    let report = gw
        .get_json("/admin/tenants/fleet/sessions/r-4", Some(ADMIN))
        .await;
    let trace = report["guard"]["trace"].as_array().unwrap();
    assert_eq!(trace.len(), 2, "{report}");
    let detail = |i: usize| trace[i]["detail"].as_str().unwrap_or_default().to_string();
    assert!(
        detail(0).starts_with("tripped: fleet_pattern: 4 sessions"),
        "{}",
        detail(0)
    );
    assert_eq!(trace[1]["action"], "refused:session_tripped");
    assert!(
        detail(1).starts_with("fleet_pattern: 4 sessions"),
        "{}",
        detail(1)
    );
    assert_eq!(report["guard"]["signals"]["trip"]["rule"], "fleet_pattern");

    // The admin view: the hot signature and its record so far.
    let view = gw.get_json("/admin/tenants/fleet/fleet", Some(ADMIN)).await;
    assert_eq!(
        (view["backend"].as_str(), view["hot"].as_u64()),
        (Some("embedded"), Some(1))
    );
    let sig = &view["signatures"][0];
    assert_eq!(sig["state"], "hot");
    assert_eq!(
        (
            sig["sessions"].as_u64(),
            sig["sessions_at_min_failures"].as_u64()
        ),
        (Some(4), Some(3))
    );
    assert_eq!(sig["failures"], 7);
    assert_eq!(sig["record"]["tripped"], 2, "r-3 and r-4");
    assert_eq!(
        sig["record"]["avoided_calls"], 1.0,
        "r-4's retry, one call like each failure"
    );
    assert_eq!(sig["pending"], 2);
    assert_eq!(view["trips_by_reason"]["fleet_pattern"], 2);
    assert!(sig["next_probe"].is_string() && sig["first_seen"].is_string());
    let metrics = gw.metrics().await;
    for line in [
        "backstop_session_trips_total{reason=\"fleet_pattern\"}",
        "backstop_fleet_refusals_total{kind=\"tripped_session\"}",
    ] {
        assert!(metrics.contains(line), "{line}");
    }
}

#[tokio::test]
async fn with_preempt_a_hot_shape_is_refused_before_its_first_attempt_until_a_probe_succeeds() {
    // The fleet's time is the gateway's clock, moved past the cool-down instead of slept.
    let clock = Clock::system();
    let gw = fleet_gateway(Some("preempt = true"), clock.clone()).await;
    make_hot(&gw).await;
    // A new session's request of that shape: refused before any attempt.
    let resp = send(&gw, "n-1", "compaction", OVERFLOW, &compaction("n-1", 0)).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert!((29..=30).contains(&retry_after(&resp)), "until the probe");
    let message = json(resp).await["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.starts_with("session_tripped (fleet_pattern): 3 sessions")
            && message.contains("refused before its first attempt (probe in "),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("compaction"), 6);
    // Only that shape is refused: the session's other work goes on.
    let resp = send(
        &gw,
        "n-1",
        "healthy",
        "",
        &chat("gpt-4o").saying("List the files"),
    )
    .await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (200, "active")
    );

    // A cool-down later, one request goes through as the probe; the bug is still there.
    clock.skip(Duration::from_secs(31));
    let resp = send(&gw, "n-2", "compaction", OVERFLOW, &compaction("n-2", 0)).await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (400, "tripped")
    );
    assert_eq!(gw.mock.attempts("compaction"), 7);
    // One probe per cool-down: the next is refused again.
    let resp = send(&gw, "n-3", "compaction", OVERFLOW, &compaction("n-3", 0)).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(gw.mock.attempts("compaction"), 7);

    // The upstream is fixed: the next probe succeeds, and the shape goes through again.
    clock.skip(Duration::from_secs(31));
    for run in ["n-4", "n-1", "n-5"] {
        let resp = send(&gw, run, "compaction", "", &compaction(run, 1)).await;
        assert_eq!(
            (resp.status().as_u16(), state(&resp).as_str()),
            (200, "active"),
            "{run}"
        );
    }
    assert_eq!(gw.mock.attempts("compaction"), 10);

    // How well it predicted: n-1 was refused but succeeded later (not confirmed); the
    // refusals of n-1 and n-3 avoided a call each.
    let view = gw.get_json("/admin/tenants/fleet/fleet", Some(ADMIN)).await;
    assert_eq!(view["hot"], 0);
    let sig = &view["signatures"][0];
    assert_eq!(sig["state"], "cooled");
    assert!(sig["cooled_at"].is_string());
    let record = &sig["record"];
    assert_eq!(
        [
            &record["tripped"],
            &record["preempted"],
            &record["confirmed"],
            &record["unconfirmed"]
        ],
        [&json!(2), &json!(2), &json!(0), &json!(1)],
        "{view}"
    );
    assert_eq!(record["avoided_calls"], 2.0);
    assert_eq!(sig["pending"], 3, "r-3, n-2 and n-3 have not come back");
    assert_eq!(view["predictions"]["unconfirmed"], 1);
    assert_eq!(view["predictions"]["precision"], 0.0);
    let metrics = gw.metrics().await;
    for line in [
        "backstop_fleet_refusals_total{kind=\"preempted\"}",
        "backstop_fleet_predictions_total{outcome=\"unconfirmed\"}",
    ] {
        assert!(metrics.contains(line), "{line}");
    }
    // The dashboard's poll carries the same view.
    let data = gw.get_json("/admin/ui/data", Some(ADMIN)).await;
    let fleet = data["fleet"].as_array().unwrap();
    assert_eq!(fleet.len(), 1);
    assert_eq!(fleet[0]["tenant"], "fleet");
    assert_eq!(fleet[0]["signatures"][0]["id"], sig["id"]);
}

/// A structured answer that never validates: its signature names the output contract
/// and the first error path, and a fourth session is tripped after its first failure
/// (three attempts: the answer and two corrections).
#[tokio::test]
async fn an_output_that_never_validates_is_a_signature_too() {
    let gw = fleet_gateway(Some(""), Clock::system()).await;
    let invalid = {
        use base64::Engine;
        format!(
            "content_b64={}",
            base64::engine::general_purpose::STANDARD.encode(r#"{"city": "Paris"}"#)
        )
    };
    let structured = |run: &str| {
        json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": format!("Weather for run {run} as JSON")}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "strict": true, "schema":
                {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "number"}},
                 "required": ["city", "temp_c"], "additionalProperties": false}}},
        })
    };
    for run in ["v-1", "v-2", "v-3"] {
        for attempt in 0..2 {
            let resp = send(&gw, run, "invalid", &invalid, &structured(run)).await;
            assert_eq!(resp.status(), 502, "{run}");
            let expected = if run == "v-3" && attempt == 1 {
                "tripped"
            } else {
                "recovering"
            };
            assert_eq!(state(&resp), expected, "{run} attempt {attempt}");
        }
    }
    let resp = send(&gw, "v-4", "invalid", &invalid, &structured("v-4")).await;
    assert_eq!(
        (resp.status().as_u16(), state(&resp).as_str()),
        (502, "tripped")
    );
    let resp = send(&gw, "v-4", "invalid", &invalid, &structured("v-4")).await;
    assert_eq!(resp.status(), 429);
    let message = json(resp).await["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("output_invalid (malformed, contract ")
            && message.contains(", first error at "),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("invalid"), 7 * 3);
}

#[tokio::test]
async fn healthy_sessions_whose_failures_differ_are_never_tripped() {
    let gw = fleet_gateway(Some("preempt = true"), Clock::system()).await;
    // Twenty sessions share one shape and one failure, but each fails only once.
    for i in 0..20 {
        let run = format!("h-{i}");
        let resp = send(
            &gw,
            &run,
            "once",
            "status=400;code=invalid_value",
            &compaction(&run, 0),
        )
        .await;
        assert_eq!(
            (resp.status().as_u16(), state(&resp).as_str()),
            (400, "recovering"),
            "{run}"
        );
        let resp = send(&gw, &run, "once", "", &chat("gpt-4o").saying("next step")).await;
        assert_eq!(
            (resp.status().as_u16(), state(&resp).as_str()),
            (200, "active"),
            "{run}"
        );
    }
    // Twenty more fail twice each, each in a task of its own.
    let tasks = [
        "parser",
        "lexer",
        "router",
        "cache",
        "scheduler",
        "planner",
        "indexer",
        "crawler",
        "renderer",
        "compiler",
        "linker",
        "loader",
        "mailer",
        "billing",
        "search",
        "auth",
        "upload",
        "export",
        "import",
        "reports",
    ];
    for task in tasks {
        let run = format!("t-{task}");
        for _ in 0..2 {
            let body = chat("gpt-4o").saying(format!("Refactor the {task} module"));
            let resp = send(&gw, &run, "twice", "status=400", &body).await;
            assert_eq!(
                (resp.status().as_u16(), state(&resp).as_str()),
                (400, "recovering"),
                "{run}"
            );
        }
    }
    let view = gw.get_json("/admin/tenants/fleet/fleet", Some(ADMIN)).await;
    assert_eq!(view["hot"], 0, "{view}");
    assert_eq!(view["trips_by_reason"], json!({}));
    assert_eq!(
        gw.mock.attempts("once") + gw.mock.attempts("twice"),
        40 + 40
    );
}

#[tokio::test]
async fn without_its_table_the_fleet_view_is_off() {
    let gw = fleet_gateway(None, Clock::system()).await;
    for i in 0..6 {
        let run = format!("off-{i}");
        for attempt in 0..2 {
            let resp = send(&gw, &run, "off", OVERFLOW, &compaction(&run, attempt)).await;
            assert_eq!(
                (resp.status().as_u16(), state(&resp).as_str()),
                (400, "recovering")
            );
        }
    }
    let resp = gw.get("/admin/tenants/fleet/fleet", Some(ADMIN)).await;
    assert_eq!(resp.status(), 404);
    assert_eq!(gw.mock.attempts("off"), 12);
}
