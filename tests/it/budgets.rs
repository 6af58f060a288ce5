//! Budgets end to end: caps exact to the call, the concurrency race, retries charged,
//! streaming usage, tenant isolation, and the ledger surviving SIGKILL.

use std::time::Duration;

use crate::common::*;
use serde_json::json;

const CAPPED: &str = "bk-capped-key-01";
const OTHER: &str = "bk-other-key-001";

/// A gateway with a `capped` tenant whose session limits are `session`.
async fn capped(session: &str, budget: &str) -> Gateway {
    let session = session.to_string();
    let budget = budget.to_string();
    start_with(move |config| {
        config.merge(&admin_and_prices()).merge(&format!(
            r#"
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
{session}
[tenants.budget]
{budget}

[[tenants]]
name = "other"
api_keys = ["{OTHER}"]
"#
        ))
    })
    .await
}

async fn refusal(resp: reqwest::Response) -> serde_json::Value {
    assert_eq!(resp.status(), 402);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "budget_exceeded");
    body
}

#[tokio::test]
async fn max_calls_is_exact_and_says_what_is_left() {
    let gw = capped("max_calls = 3", "").await;
    for left in [2, 1, 0] {
        let resp = gw
            .in_session(CAPPED, "s", "calls", "", &chat("gpt-4o").max_tokens(16))
            .await;
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()["x-backstop-budget-remaining"],
            format!("calls={left}")
        );
    }
    let body = refusal(
        gw.in_session(CAPPED, "s", "calls", "", &chat("gpt-4o").max_tokens(16))
            .await,
    )
    .await;
    assert_eq!(body["error"]["param"], "session.max_calls");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit 3, used 3"),
        "{body}"
    );
    assert_eq!(
        gw.mock.attempts("calls"),
        3,
        "the refused call never reached the upstream"
    );
    // Another session of the same tenant is untouched.
    assert_eq!(
        gw.in_session(CAPPED, "s2", "calls", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200
    );
}

#[tokio::test]
async fn retries_are_charged_like_any_call() {
    let gw = capped("max_calls = 3", "").await;
    let resp = gw
        .in_session(
            CAPPED,
            "s",
            "retried",
            "status=503,status=503,ok",
            &chat("gpt-4o").max_tokens(16),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-backstop-budget-remaining"], "calls=0");
    refusal(
        gw.in_session(CAPPED, "s", "retried-2", "", &chat("gpt-4o").max_tokens(16))
            .await,
    )
    .await;
    // A retry that would exceed the cap is refused too: 2 calls left, 3 attempts wanted.
    let gw = capped("max_calls = 2", "").await;
    let resp = gw
        .in_session(
            CAPPED,
            "s",
            "cut-short",
            "status=503",
            &chat("gpt-4o").max_tokens(16),
        )
        .await;
    assert_eq!(resp.status(), 402);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "retry:503,retry:503,refused:budget_exceeded"
    );
    assert_eq!(gw.mock.attempts("cut-short"), 2);
}

#[tokio::test]
async fn forty_concurrent_calls_against_ten_let_exactly_ten_through() {
    let gw = capped("max_calls = 10", "").await;
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let http = gw.http.clone();
        let url = format!("{}/v1/chat/completions", gw.url);
        tasks.push(tokio::spawn(async move {
            http.post(url)
                .bearer_auth(CAPPED)
                .header("x-session-id", "race")
                .header("x-mock-scenario", "race")
                .header("x-mock-fault", "delay=100ms")
                .body(chat("gpt-4o").max_tokens(16).to_string())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 10);
    assert_eq!(statuses.iter().filter(|s| **s == 402).count(), 30);
    assert_eq!(gw.mock.attempts("race"), 10);
}

#[tokio::test]
async fn max_tokens_is_exact_with_reservations() {
    // Each call reserves ~its prompt estimate + max_tokens 100 and settles to 100 tokens.
    let gw = capped("max_tokens = 1000", "").await;
    let body = chat("gpt-4o").max_tokens(100);
    let prompt_estimate = (body.to_string().len() as u64).div_ceil(4);
    let mut passed = 0;
    loop {
        let resp = gw
            .in_session(CAPPED, "s", "tokens", "usage=50/50", &body.clone())
            .await;
        if resp.status() != 200 {
            let body = refusal(resp).await;
            assert_eq!(body["error"]["param"], "session.max_tokens");
            break;
        }
        passed += 1;
    }
    // Refused once 100·n + estimate + 100 > 1000.
    let expected = (0..)
        .find(|n| 100 * n + prompt_estimate + 100 > 1000)
        .unwrap();
    assert_eq!(passed, expected);
    assert_eq!(gw.mock.attempts("tokens"), expected);
}

#[tokio::test]
async fn max_usd_is_exact_with_prices() {
    // 1000 in + 1000 out at $2.50/$10 per Mtok = $0.0125 a call; the reservation is the
    // prompt estimate + 1000 output tokens, about $0.0100.
    let gw = capped("max_usd = 0.05", "").await;
    let mut passed = 0;
    while gw
        .in_session(
            CAPPED,
            "s",
            "usd",
            "usage=1000/1000",
            &chat("gpt-4o").max_tokens(1000),
        )
        .await
        .status()
        == 200
    {
        passed += 1;
    }
    assert_eq!(passed, 4, "0.0375 + 0.0100 fits, 0.0500 + 0.0100 does not");
    let report = gw
        .http
        .get(format!("{}/admin/tenants/capped/sessions/s", gw.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let report = json(report).await;
    assert_eq!(report["used"]["calls"], 4);
    assert!(
        (report["used"]["usd"].as_f64().unwrap() - 0.05).abs() < 1e-9,
        "{report}"
    );
}

#[tokio::test]
async fn tenant_day_budgets_cover_calls_without_a_session() {
    let gw = capped("", "tokens_per_day = 300").await;
    const HEADERS: &[(&str, &str)] = &[("x-mock-scenario", "day"), ("x-mock-fault", "usage=50/50")];
    let no_session = || {
        gw.post(
            "/v1/chat/completions",
            Some(CAPPED),
            HEADERS,
            chat("gpt-4o").max_tokens(50).to_string(),
        )
    };
    // Each call settles 100 tokens; one more fits while 100·n + its reservation ≤ 300.
    let reservation = (chat("gpt-4o").max_tokens(50).to_string().len() as u64).div_ceil(4) + 50;
    let expected = (0..).find(|n| 100 * n + reservation > 300).unwrap();
    for _ in 0..expected {
        assert_eq!(no_session().await.status(), 200);
    }
    let body = refusal(no_session().await).await;
    assert_eq!(body["error"]["param"], "tenant.tokens_per_day");
    assert_eq!(gw.mock.attempts("day"), expected);
}

#[tokio::test]
async fn max_concurrent_refuses_the_extra_request_while_others_run() {
    let gw = capped("max_concurrent = 2", "").await;
    let slow = |scenario: &'static str| {
        let http = gw.http.clone();
        let url = format!("{}/v1/chat/completions", gw.url);
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(CAPPED)
                .header("x-session-id", "c")
                .header("x-mock-scenario", scenario)
                .header("x-mock-fault", "hold=conc")
                .body(chat("gpt-4o").max_tokens(16).to_string())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let (a, b) = (slow("conc"), slow("conc"));
    // Both are in flight (each holds its slot once it reaches the upstream) until the
    // mock releases them: wait for that, not for a guessed time.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while gw.mock.attempts("conc") < 2 {
        assert!(std::time::Instant::now() < deadline, "never in flight");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let resp = gw
        .in_session(CAPPED, "c", "conc", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(json(resp).await["error"]["code"], "too_many_concurrent");
    gw.mock.release("conc");
    assert_eq!((a.await.unwrap(), b.await.unwrap()), (200, 200));
    assert_eq!(
        gw.in_session(CAPPED, "c", "conc", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200,
        "slots are freed"
    );
}

#[tokio::test]
async fn rate_limits_refuse_with_retry_after_and_no_upstream_call() {
    let gw = start_with(|config| {
        config.merge(&format!(
            "[[tenants]]\nname = \"limited\"\napi_keys = [\"{CAPPED}\"]\nrequests_per_minute = 2\n"
        ))
    })
    .await;
    for _ in 0..2 {
        assert_eq!(
            gw.in_session(CAPPED, "s", "rpm", "", &chat("gpt-4o").max_tokens(16))
                .await
                .status(),
            200
        );
    }
    let resp = gw
        .in_session(CAPPED, "s", "rpm", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(resp.status(), 429);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((29..=30).contains(&retry_after), "{retry_after}");
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert_eq!(json(resp).await["error"]["code"], "rate_limited");
    assert_eq!(gw.mock.attempts("rpm"), 2);
}

#[tokio::test]
async fn stream_usage_is_counted_and_the_injected_chunk_hidden() {
    let gw = capped("max_tokens = 100000", "").await;
    let stream = json!({"model": "gpt-4o", "stream": true, "max_tokens": 10, "messages": [{"role": "user", "content": "hello"}]});
    let resp = gw
        .in_session(CAPPED, "st", "stream-usage", "usage=120/30", &stream)
        .await;
    let text = resp.text().await.unwrap();
    assert!(
        !text.contains("\"usage\""),
        "the client did not ask for usage: {text}"
    );
    assert!(text.trim_end().ends_with("data: [DONE]"));
    let seen = gw.mock.last_request("stream-usage").unwrap();
    assert_eq!(
        seen["body"]["stream_options"]["include_usage"], true,
        "Backstop asked for usage"
    );
    // Settled once the stream has ended: 120 + 30 reported, not the reservation.
    gw.session_report_when(CAPPED, "st", |r| r["used"]["tokens"] == 150)
        .await;

    // A client that asked for usage still gets it.
    let mut asked = stream.clone();
    asked["stream_options"] = json!({"include_usage": true});
    let text = gw
        .in_session(CAPPED, "st", "stream-usage-2", "usage=1/2", &asked)
        .await
        .text()
        .await
        .unwrap();
    assert!(text.contains("\"usage\""), "{text}");

    // Anthropic streams report usage in message_start and message_delta.
    let body = json!({"model": "claude-x", "stream": true, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .post(
            "/v1/messages",
            Some(CAPPED),
            &[("x-session-id", "st"), ("x-mock-fault", "usage=7/3")],
            body.to_string(),
        )
        .await;
    resp.text().await.unwrap();
    gw.session_report_when(CAPPED, "st", |r| r["used"]["tokens"] == 150 + 3 + 10)
        .await;
}

#[tokio::test]
async fn tenants_see_only_their_own_sessions() {
    let gw = capped("max_calls = 5", "").await;
    gw.in_session(
        CAPPED,
        "shared-name",
        "iso",
        "",
        &chat("gpt-4o").max_tokens(16),
    )
    .await;
    let mine = json(
        gw.http
            .get(format!("{}/v1/sessions/shared-name", gw.url))
            .bearer_auth(CAPPED)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (mine["tenant"].as_str(), mine["used"]["calls"].as_u64()),
        (Some("capped"), Some(1))
    );
    let theirs = json(
        gw.http
            .get(format!("{}/v1/sessions/shared-name", gw.url))
            .bearer_auth(OTHER)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (theirs["tenant"].as_str(), theirs["used"]["calls"].as_u64()),
        (Some("other"), Some(0)),
        "{theirs}"
    );
    let denied = gw
        .http
        .get(format!("{}/admin/tenants/capped", gw.url))
        .bearer_auth(CAPPED)
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 401, "a tenant key is not the admin token");
    let admin = json(
        gw.http
            .get(format!("{}/admin/tenants/capped", gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(admin["used_today"]["calls"], 1);
    assert_eq!(admin["by_model"][0]["model"], "gpt-4o");
}

#[tokio::test]
async fn an_operator_reset_starts_a_session_over() {
    let gw = capped("max_calls = 1", "").await;
    assert_eq!(
        gw.in_session(CAPPED, "r", "reset", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200
    );
    refusal(
        gw.in_session(CAPPED, "r", "reset", "", &chat("gpt-4o").max_tokens(16))
            .await,
    )
    .await;
    let reset = gw
        .http
        .post(format!("{}/admin/tenants/capped/sessions/r/reset", gw.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    assert_eq!(
        gw.in_session(CAPPED, "r", "reset", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200
    );
}

/// The real binary, killed with SIGKILL and restarted on the same store.
#[tokio::test]
async fn settled_spend_survives_sigkill() {
    let dir = TempDir::new("backstop-kill");
    let port = free_port();
    let mock_port = free_port();
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
[log]
level = "warn"
[store]
path = "{store}"
[admin]
token = "{ADMIN}"
[mock]
listen = "127.0.0.1:{mock_port}"
[[prices]]
model = "gpt-*"
input_per_mtok = 1.0
output_per_mtok = 2.0
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{mock_port}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
max_calls = 5
"#,
            store = dir.0.join("ledger.db").display()
        ),
    )
    .unwrap();
    let http = reqwest::Client::new();
    let gw = Binary::start(&config, port).await;
    for _ in 0..3 {
        let resp = http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(CAPPED)
            .header("x-session-id", "k")
            .header("x-mock-fault", "usage=1000/500")
            .body(chat("gpt-4o").max_tokens(500).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
    }
    gw.kill();

    let gw = Binary::start(&config, port).await;
    let url = &gw.url;
    let report = json(
        http.get(format!("{url}/admin/tenants/capped/sessions/k"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(report["used"]["calls"], 3, "{report}");
    assert_eq!(report["used"]["tokens"], 4500);
    assert!(
        (report["used"]["usd"].as_f64().unwrap() - 0.006).abs() < 1e-9,
        "{report}"
    );
    let day = json(
        http.get(format!("{url}/admin/tenants/capped"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(day["used_today"]["calls"], 3);
    // The cap still counts what was spent before the crash: two calls left.
    let resp = http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(CAPPED)
        .header("x-session-id", "k")
        .body(chat("gpt-4o").max_tokens(16).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-backstop-budget-remaining"], "calls=1");
}

/// Spend reads in micro-dollars: $0.1 and then $0.2 (40,000 and 80,000 input tokens at
/// $2.50/Mtok) show as 0.3 in every JSON view, not 0.30000000000000004.
#[tokio::test]
async fn spend_figures_are_rounded_to_micro_dollars() {
    let gw = capped("max_usd = 10.0", "usd_per_day = 100.0").await;
    for usage in ["usage=40000/0", "usage=80000/0"] {
        let resp = gw
            .in_session(CAPPED, "s", "round", usage, &chat("gpt-4o").max_tokens(16))
            .await;
        assert_eq!(resp.status(), 200);
    }
    let session = gw
        .get("/admin/tenants/capped/sessions/s", Some(ADMIN))
        .await
        .text()
        .await
        .unwrap();
    let own = gw
        .get("/v1/sessions/s", Some(CAPPED))
        .await
        .text()
        .await
        .unwrap();
    let tenant = gw
        .get("/admin/tenants/capped", Some(ADMIN))
        .await
        .text()
        .await
        .unwrap();
    let data = gw
        .get("/admin/ui/data", Some(ADMIN))
        .await
        .text()
        .await
        .unwrap();
    for text in [&session, &own, &tenant, &data] {
        assert!(!text.contains("0.30000000000000004"), "{text}");
    }
    let value = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
    assert_eq!(value(&session)["used"]["usd"], json!(0.3), "{session}");
    assert_eq!(value(&session)["remaining"]["usd"], json!(9.7), "{session}");
    assert_eq!(value(&own)["used"]["usd"], json!(0.3), "{own}");
    let tenant = value(&tenant);
    assert_eq!(tenant["used_today"]["usd"], json!(0.3), "{tenant}");
    assert_eq!(tenant["remaining_today"]["usd"], json!(99.7), "{tenant}");
    assert_eq!(tenant["by_model"][0]["usd"], json!(0.3), "{tenant}");
    let data = value(&data);
    let row = data["sessions"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["session"] == "s")
        .unwrap_or_else(|| panic!("{data}"));
    assert_eq!(row["usd"], json!(0.3), "{data}");
}

/// Every admin and session answer, refusals included, is `Cache-Control: no-store`.
#[tokio::test]
async fn admin_and_session_answers_are_never_cached() {
    let gw = capped("max_calls = 5", "").await;
    assert_eq!(
        gw.in_session(CAPPED, "s", "cache", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200
    );
    let http = &gw.http;
    let url = |path: &str| format!("{}{path}", gw.url);
    let cases = [
        (http.get(url("/admin/upstreams")).bearer_auth(ADMIN), 200),
        (
            http.get(url("/admin/tenants/capped")).bearer_auth(ADMIN),
            200,
        ),
        (
            http.get(url("/admin/tenants/capped/sessions/s"))
                .bearer_auth(ADMIN),
            200,
        ),
        (
            http.post(url("/admin/tenants/capped/sessions/s/reset"))
                .bearer_auth(ADMIN),
            200,
        ),
        (http.get(url("/admin/state")).bearer_auth(ADMIN), 200),
        (http.get(url("/admin/config")).bearer_auth(ADMIN), 200),
        (http.get(url("/admin/ui/data")).bearer_auth(ADMIN), 200),
        (http.get(url("/v1/sessions/s")).bearer_auth(CAPPED), 200),
        (
            http.get(url("/admin/tenants/nobody")).bearer_auth(ADMIN),
            404,
        ),
        (http.get(url("/admin/upstreams")), 401),
        (http.get(url("/v1/sessions/s")), 401),
    ];
    for (req, status) in cases {
        let resp = req.send().await.unwrap();
        let what = resp.url().path().to_string();
        assert_eq!(resp.status(), status, "{what}");
        assert_eq!(resp.headers()["cache-control"], "no-store", "{what}");
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json"));
    }
}
