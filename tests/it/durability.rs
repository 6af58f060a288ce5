//! Budgets when things go wrong: the process killed with calls in flight, the store
//! locked by another writer, upstreams reporting absurd usage, sessions idling out of
//! memory while a call still runs.

use std::time::Duration;

use crate::common::*;
use backstop::mock;
use serde_json::json;
use tokio::net::TcpListener;

const CAPPED: &str = "bk-capped-key-01";
const OTHER: &str = "bk-other-key-001";

/// A gateway whose `[store]` section is `store` and whose `capped` and `other` tenants
/// have the session limits given.
async fn gateway(store: &str, capped: &str, other: &str) -> Gateway {
    let (store, capped, other) = (store.to_string(), capped.to_string(), other.to_string());
    start_with(move |config| {
        with_store(config, &store)
            .merge(&admin_and_prices())
            .merge(&format!(
                r#"
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
{capped}

[[tenants]]
name = "other"
api_keys = ["{OTHER}"]
[tenants.session]
{other}
"#
            ))
    })
    .await
}

async fn session_report(url: &str, tenant: &str, session: &str) -> serde_json::Value {
    let resp = reqwest::Client::new()
        .get(format!("{url}/admin/tenants/{tenant}/sessions/{session}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    json(resp).await
}

/// Finding 9: ten calls of a 10-call session are in flight (the upstream holds them)
/// when the process is SIGKILLed. After a restart on the same store they count as spent
/// at their reservation, so no further call is made: 10 upstream calls in all, not 20.
#[tokio::test]
async fn in_flight_reservations_count_across_sigkill() {
    // The upstream lives in the test, so it outlives the gateway and counts every call.
    let upstream = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let dir = TempDir::new("backstop-inflight-kill");
    let port = free_port();
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
request_timeout = "60s"
[log]
level = "warn"
[store]
path = "{store}"
[admin]
token = "{ADMIN}"
[[prices]]
model = "gpt-*"
input_per_mtok = 1.0
output_per_mtok = 2.0
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}"
attempt_timeout = "60s"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
max_calls = 10
"#,
            store = dir.0.join("ledger.db").display(),
            mock = upstream.addr,
        ),
    )
    .unwrap();
    let http = reqwest::Client::new();
    let gw = Binary::start(&config, port).await;
    let mut hanging = Vec::new();
    for _ in 0..10 {
        let request = http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(CAPPED)
            .header("x-session-id", "k")
            .header("x-mock-scenario", "crash")
            .header("x-mock-fault", "hang")
            .body(chat("gpt-4o").max_tokens(16).to_string());
        hanging.push(tokio::spawn(request.send()));
    }
    until("the calls to reach the upstream", || async {
        upstream.attempts("crash") == 10
    })
    .await;
    gw.kill();
    for call in hanging {
        assert!(call.await.unwrap().is_err(), "killed mid-call");
    }

    let gw = Binary::start(&config, port).await;
    let report = session_report(&gw.url, "capped", "k").await;
    assert_eq!(report["used"]["calls"], 10, "{report}");
    for _ in 0..10 {
        let resp = http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(CAPPED)
            .header("x-session-id", "k")
            .header("x-mock-scenario", "crash")
            .body(chat("gpt-4o").max_tokens(16).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 402, "the cap holds across kill -9");
    }
    assert_eq!(upstream.attempts("crash"), 10, "10 upstream calls in all");
}

/// Finding 10: with the database locked by another writer, a budgeted call is refused
/// with 503 `store_unavailable` within the busy timeout, before any upstream call, in
/// the caller's API shape; once the lock is gone, calls go through again.
#[tokio::test]
async fn a_locked_store_refuses_budgeted_calls_before_the_upstream() {
    let dir = TempDir::new("backstop-locked");
    let db = dir.0.join("ledger.db");
    let gw = gateway(
        &format!("path = \"{}\"\nbusy_timeout = \"100ms\"", db.display()),
        "max_calls = 10",
        "",
    )
    .await;
    let lock = rusqlite::Connection::open(&db).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();

    // Refused once the store's busy timeout has passed, not held until the request
    // deadline (which would answer 504 `request_timeout`).
    let resp = gw
        .in_session(CAPPED, "s", "locked", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    assert_eq!(body["error"]["type"], "server_error");

    let resp = gw
        .post(
            "/v1/messages",
            Some(CAPPED),
            &[("x-session-id", "s"), ("x-mock-scenario", "locked")],
            json!({"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
        )
        .await;
    assert_eq!(resp.status(), 503);
    let body = json(resp).await;
    assert_eq!(
        (body["type"].as_str(), body["error"]["type"].as_str()),
        (Some("error"), Some("api_error")),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("locked"), 0, "no upstream call was made");

    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("backstop_store_errors_total{op=\"reserve\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("backstop_refusals_total{reason=\"store_unavailable\"}"));

    lock.execute_batch("COMMIT").unwrap();
    let resp = gw
        .in_session(CAPPED, "s", "locked", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.mock.attempts("locked"), 1);
    assert_eq!(
        session_report(&gw.url, "capped", "s").await["used"]["calls"],
        1
    );
}

/// Finding 11: an upstream reporting u64::MAX tokens, in a body or in a stream, is
/// charged the call's reservation (not 2^64 - 1 tokens, not -1 in the ledger, not
/// trillions of dollars), and the session's cap is not blown by it.
#[tokio::test]
async fn absurd_upstream_usage_is_charged_the_reservation() {
    let gw = gateway("path = \":memory:\"", "max_tokens = 100000", "").await;
    let body = chat("gpt-4o").max_tokens(16);
    let reservation = (body.to_string().len() as u64).div_ceil(4) + 16;
    let absurd = format!("usage={}/0", u64::MAX);
    let resp = gw.in_session(CAPPED, "s", "absurd", &absurd, &body).await;
    assert_eq!(resp.status(), 200);
    let report = session_report(&gw.url, "capped", "s").await;
    assert_eq!(report["used"]["tokens"], reservation, "{report}");
    assert!(report["used"]["usd"].as_f64().unwrap() < 0.01, "{report}");

    let stream = body.clone().stream();
    let text = gw
        .in_session(CAPPED, "s", "absurd-stream", &absurd, &stream)
        .await
        .text()
        .await
        .unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"));
    // Settled once the stream has ended.
    let stream_reservation = (stream.to_string().len() as u64).div_ceil(4) + 16;
    until("the stream's settle at its reservation", || async {
        session_report(&gw.url, "capped", "s").await["used"]["tokens"]
            == reservation + stream_reservation
    })
    .await;
    assert_eq!(
        gw.in_session(CAPPED, "s", "after", "", &body)
            .await
            .status(),
        200,
        "the cap was not blown"
    );
}

/// Issue 24: a usage object without the counts the endpoint defines (`usage: {}`,
/// `total_tokens` alone, chat's names on `/v1/responses`) is not zero tokens: each such
/// call is charged its reservation, on both endpoints, and counted.
#[tokio::test]
async fn usage_without_the_endpoints_counts_is_charged_the_reservation() {
    use base64::Engine;
    let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
    let gw = gateway("path = \":memory:\"", "max_tokens = 100000", "").await;
    let body = chat("gpt-4o").max_tokens(16);
    let reservation = (body.to_string().len() as u64).div_ceil(4) + 16;
    let mut expected = 0;
    for odd in [
        r#"{}"#,
        r#"{"total_tokens":5000}"#,
        r#"{"prompt_tokens":9}"#,
    ] {
        let fault = format!("usage_b64={}", b64(odd));
        let resp = gw.in_session(CAPPED, "s", "odd", &fault, &body).await;
        assert_eq!(resp.status(), 200, "{odd}");
        expected += reservation;
        let report = session_report(&gw.url, "capped", "s").await;
        assert_eq!(report["used"]["tokens"], expected, "{odd}: {report}");
    }
    let responses = json!({"model": "gpt-4o", "input": "hello", "max_output_tokens": 16});
    let reservation = (responses.to_string().len() as u64).div_ceil(4) + 16;
    for odd in [r#"{"prompt_tokens":5,"completion_tokens":7}"#, r#"{}"#] {
        let fault = format!("usage_b64={}", b64(odd));
        let resp = gw
            .post(
                "/v1/responses",
                Some(CAPPED),
                &[
                    ("x-session-id", "s"),
                    ("x-mock-scenario", "odd-responses"),
                    ("x-mock-fault", &fault),
                ],
                responses.to_string(),
            )
            .await;
        assert_eq!(resp.status(), 200, "{odd}");
        expected += reservation;
        let report = session_report(&gw.url, "capped", "s").await;
        assert_eq!(report["used"]["tokens"], expected, "{odd}: {report}");
    }
    assert_eq!(
        gw.mock.attempts("odd") + gw.mock.attempts("odd-responses"),
        5
    );
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("backstop_usage_rejected_total{reason=\"missing_count\"} 5"),
        "{metrics}"
    );
}

/// Finding 12: a session that idles out of memory (`session_idle`) while a call is in
/// flight keeps that call's concurrency slot and reservation: `max_concurrent = 1`
/// refuses the overlapping call, `max_calls = 2` refuses the third.
#[tokio::test]
async fn a_session_is_not_forgotten_while_a_call_is_in_flight() {
    let gw = gateway(
        "path = \":memory:\"\nsession_idle = \"50ms\"",
        "max_concurrent = 1",
        "max_calls = 2",
    )
    .await;
    let slow = |key: &'static str, session: &'static str| {
        let http = gw.http.clone();
        let url = format!("{}/v1/chat/completions", gw.url);
        tokio::spawn(async move {
            http.post(url)
                .bearer_auth(key)
                .header("x-session-id", session)
                .header("x-mock-scenario", "idle")
                .header("x-mock-fault", "hold=idle")
                .body(chat("gpt-4o").max_tokens(16).to_string())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let first = slow(CAPPED, "c");
    let (a, b) = (slow(OTHER, "m"), slow(OTHER, "m"));
    // Far longer than session_idle, the calls held at the upstream meanwhile.
    until("the three calls at the upstream", || async {
        gw.mock.attempts("idle") == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let resp = gw
        .in_session(CAPPED, "c", "idle", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(
        resp.status(),
        429,
        "max_concurrent = 1 with a call in flight"
    );
    assert_eq!(json(resp).await["error"]["code"], "too_many_concurrent");
    let resp = gw
        .in_session(OTHER, "m", "idle", "", &chat("gpt-4o").max_tokens(16))
        .await;
    assert_eq!(resp.status(), 402, "max_calls = 2 with two calls in flight");
    gw.mock.release("idle");
    assert_eq!(
        (first.await.unwrap(), a.await.unwrap(), b.await.unwrap()),
        (200, 200, 200)
    );
    assert_eq!(gw.mock.attempts("idle"), 3);
    // Idle and unheld now: rebuilt from the ledger, which has every call.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let report = session_report(&gw.url, "other", "m").await;
    assert_eq!(
        (
            report["used"]["calls"].as_u64(),
            report["in_flight"].as_u64()
        ),
        (Some(2), Some(0))
    );
    assert_eq!(
        gw.in_session(CAPPED, "c", "idle", "", &chat("gpt-4o").max_tokens(16))
            .await
            .status(),
        200
    );
}

/// A `":memory:"` store is a private file in the temp dir; `kill -9` leaves it there, and
/// the next gateway to make one removes it (its lock is free), never a live gateway's.
#[tokio::test]
async fn a_killed_gateways_scratch_store_is_removed_by_the_next_never_a_live_ones() {
    let dir = TempDir::new("backstop-scratch-sweep");
    let tmp = TempDir::new("backstop-scratch-tmp");
    let tmpdir = format!("TMPDIR={}", tmp.0.display());
    let files = || {
        let mut names: Vec<String> = std::fs::read_dir(&tmp.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("backstop-memory-"))
            .collect();
        names.sort();
        names
    };
    let stores = |names: &[String]| {
        let mut stems: Vec<String> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".lock"))
            .map(str::to_string)
            .collect();
        stems.sort();
        stems
    };
    let start = || async {
        let (port, mock_port) = (free_port(), free_port());
        let config = dir.0.join(format!("backstop-{port}.toml"));
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\ndrain_delay = \"0s\"\n[store]\npath = \":memory:\"\n[mock]\nlisten = \"127.0.0.1:{mock_port}\"\n[[upstreams]]\nname = \"m\"\napi = \"openai\"\nbase_url = \"http://127.0.0.1:{mock_port}\"\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"m\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-scratch-sweep\"]\n"
            ),
        )
        .unwrap();
        Binary::start_under(
            &["env", &tmpdir],
            &config,
            port,
            std::process::Stdio::null(),
        )
        .await
    };

    let killed = start().await;
    let [killed_store] = &stores(&files())[..] else {
        panic!("one store: {:?}", files());
    };
    let killed_store = killed_store.clone();
    let alive = start().await;
    let two = files();
    let alive_store = stores(&two)
        .into_iter()
        .find(|s| *s != killed_store)
        .expect("a second store");
    for stem in [&killed_store, &alive_store] {
        assert!(two.contains(&format!("{stem}.db")), "{two:?}");
    }
    killed.kill();
    assert_eq!(files(), two, "kill -9 removes nothing");

    let third = start().await;
    let after = files();
    assert!(
        after.iter().all(|n| !n.starts_with(&killed_store)),
        "the killed gateway's files are gone: {after:?}"
    );
    assert!(
        ["db", "lock"]
            .iter()
            .all(|ext| after.contains(&format!("{alive_store}.{ext}"))),
        "the live gateway's are kept: {after:?}"
    );
    assert_eq!(stores(&after).len(), 2, "{after:?}");

    // The live one still serves from its store, and both leave nothing at a graceful stop.
    let http = reqwest::Client::new();
    let resp = http
        .post(format!("{}/v1/chat/completions", alive.url))
        .bearer_auth("bk-scratch-sweep")
        .header("content-type", "application/json")
        .body(
            json!({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    alive.terminate();
    third.terminate();
    assert_eq!(files(), Vec::<String>::new());
}

/// A side effect committed before a kill -9 is still committed after the restart (the
/// journal is in the SQLite file, written before the request that carried the result
/// went on): the replanned agent's repeat is refused by the new process, before the
/// agent can act on it, and the store's journal contract holds on the same kind of file.
#[tokio::test]
async fn a_committed_side_effect_outlives_sigkill() {
    const EFFECTS: &str = "bk-effects-kill";
    let upstream = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let dir = TempDir::new("backstop-journal-kill");
    let port = free_port();
    let config = effects_config(
        &dir,
        port,
        upstream.addr,
        "",
        &format!(
            "[[tenants]]\nname = \"effects\"\napi_keys = [\"{EFFECTS}\"]\n[tenants.side_effects]\ntools = [\"send_email\"]\non_repeat = \"refuse\"\n"
        ),
    );
    let http = reqwest::Client::new();
    let send = |url: &str, scenario: &str, fault: &str, messages: serde_json::Value| {
        http.post(format!("{url}/v1/chat/completions"))
            .bearer_auth(EFFECTS)
            .header("x-session-id", "replan")
            .header("x-mock-scenario", scenario)
            .header("x-mock-fault", fault)
            .body(json!({"model": "gpt-4o", "messages": messages}).to_string())
            .send()
    };
    let args = r#"{"to":"bob"}"#;
    let gw = Binary::start(&config, port).await;
    let committed = send(&gw.url, "commit", "ok", email_sent(args))
        .await
        .unwrap();
    assert_eq!(committed.status(), 200);
    gw.kill();

    let gw = Binary::start(&config, port).await;
    let fault = format!("tool=send_email;tool_args_b64={}", b64(args));
    let repeat = send(
        &gw.url,
        "repeat",
        &fault,
        json!([{"role": "user", "content": "mail bob"}]),
    )
    .await
    .unwrap();
    assert_eq!(repeat.status(), 409);
    let body: serde_json::Value = serde_json::from_str(&repeat.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "duplicate_side_effect", "{body}");
    assert_eq!(upstream.attempts("repeat"), 1);
    let journal = http
        .get(format!("{}/v1/sessions/replan/journal", gw.url))
        .bearer_auth(EFFECTS)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let journal: serde_json::Value = serde_json::from_str(&journal).unwrap();
    assert_eq!(journal["entries"][0]["repeats"], 1, "{journal}");
    drop(gw);

    let store =
        backstop::store::SqliteStore::open(dir.0.join("contract.db").to_str().unwrap()).unwrap();
    crate::common::journal::journal_contract(&store, "t").await;
}

fn b64(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// `on_unavailable`: a journal the store cannot write (its SQLite file locked by another
/// connection) lets a result-carrying request go on unjournaled by default, counted; a
/// tenant with `on_unavailable = "closed"` is refused 503 `store_unavailable` before any
/// upstream call. Once the lock is gone, the result is journaled.
#[tokio::test]
async fn a_journal_the_store_cannot_write_fails_open_or_closed_as_configured() {
    const OPEN: &str = "bk-effects-open";
    const CLOSED: &str = "bk-effects-closed";
    let upstream = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let dir = TempDir::new("backstop-journal-locked");
    let db = dir.0.join("ledger.db");
    let port = free_port();
    let config = effects_config(
        &dir,
        port,
        upstream.addr,
        "busy_timeout = \"100ms\"",
        &format!(
            r#"
[[tenants]]
name = "open"
api_keys = ["{OPEN}"]
[tenants.side_effects]
tools = ["send_email"]
[[tenants]]
name = "closed"
api_keys = ["{CLOSED}"]
[tenants.side_effects]
tools = ["send_email"]
on_unavailable = "closed"
"#
        ),
    );
    let gw = Binary::start(&config, port).await;
    let http = reqwest::Client::new();
    let sent = json!({"model": "gpt-4o", "messages": email_sent("{}")});
    let send = |key: &'static str, scenario: &'static str| {
        http.post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(key)
            .header("x-session-id", "locked")
            .header("x-mock-scenario", scenario)
            .body(sent.to_string())
            .send()
    };
    let lock = rusqlite::Connection::open(&db).unwrap();
    lock.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let open = send(OPEN, "open").await.unwrap();
    assert_eq!(open.status(), 200, "fails open by default");
    let closed = send(CLOSED, "closed").await.unwrap();
    assert_eq!(closed.status(), 503);
    let body: serde_json::Value = serde_json::from_str(&closed.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    assert_eq!(
        (upstream.attempts("open"), upstream.attempts("closed")),
        (1, 0),
        "the closed tenant's request made no upstream call"
    );
    let metrics = http
        .get(format!("{}/metrics", gw.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("backstop_side_effects_total{outcome=\"unjournaled\"}"),
        "{metrics}"
    );
    lock.execute_batch("COMMIT").unwrap();
    let closed = send(CLOSED, "closed").await.unwrap();
    assert_eq!(closed.status(), 200);
    let journal = http
        .get(format!("{}/v1/sessions/locked/journal", gw.url))
        .bearer_auth(CLOSED)
        .send()
        .await
        .unwrap();
    assert_eq!(journal.status(), 200, "journaled once the store answers");
}

/// The config file of a side-effects test's gateway, in `dir`: its store `ledger.db`
/// (with `store` lines), one route to the mock at `mock`, and `tenants`.
fn effects_config(
    dir: &TempDir,
    port: u16,
    mock: std::net::SocketAddr,
    store: &str,
    tenants: &str,
) -> std::path::PathBuf {
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
path = "{path}"
{store}
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
{tenants}
"#,
            path = dir.0.join("ledger.db").display(),
        ),
    )
    .unwrap();
    config
}

/// A chat conversation whose agent ran `send_email(args)` as `call_1` and fed back
/// "sent".
fn email_sent(args: &str) -> serde_json::Value {
    json!([
        {"role": "user", "content": "mail bob"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "send_email", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sent"}
    ])
}
