//! Issue 16, as an attacker and a hostile upstream would try it: each test fails on the
//! gateway before the fix. Real sockets, the real gateway, the real mock.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// A route whose two targets are the same mock, so a failover is visible.
const TWO_TARGETS: &str = r#"[[routes]]
model = "two-targets"
targets = [{ upstream = "mock-openai" }, { upstream = "mock-openai" }]"#;

/// The trail of `x-backstop-recovery`.
fn trail(resp: &reqwest::Response) -> String {
    resp.headers()["x-backstop-recovery"]
        .to_str()
        .unwrap()
        .to_string()
}

async fn error_code(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    assert_eq!(
        resp.headers()
            .get("x-should-retry")
            .map(|v| v.to_str().unwrap()),
        Some("false")
    );
    (status, json(resp).await)
}

/// Reads a whole streamed body, failing the test (not hanging it) after `within`.
async fn read_stream(resp: reqwest::Response, within: Duration) -> String {
    let bytes = tokio::time::timeout(within, resp.bytes())
        .await
        .expect("the stream must end")
        .expect("the stream ends cleanly, with an error event, not a cut connection");
    String::from_utf8_lossy(&bytes).into_owned()
}

// --- 3. Redirects ---------------------------------------------------------------------

#[tokio::test]
async fn an_upstream_redirect_is_never_followed_and_no_key_reaches_the_other_origin() {
    let elsewhere =
        backstop::mock::spawn(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let gw = start().await;
    for (path, model, key, status) in [
        ("/v1/chat/completions", "gpt-4o", KEY_A, "307"),
        ("/v1/chat/completions", "gpt-4o", KEY_A, "308"),
        ("/v1/messages", "claude-3", KEY_B, "307"),
    ] {
        let scenario = format!("redirect-{path}-{status}");
        let fault = format!(
            "status={status};location=http://{}/v1/chat/completions",
            elsewhere.addr
        );
        let body = json!({"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "secret prompt"}]});
        let resp = gw
            .post(
                path,
                Some(key),
                &[("x-mock-scenario", &scenario), ("x-mock-fault", &fault)],
                body.to_string(),
            )
            .await;
        assert!(resp.headers().get("location").is_none());
        assert_eq!(resp.headers()["x-backstop-attempts"], "1");
        let (status_code, body) = error_code(resp).await;
        assert_eq!(status_code, 502, "{body}");
        let text = body.to_string();
        assert!(text.contains("upstream_redirect"), "{text}");
        assert_eq!(gw.mock.attempts(&scenario), 1, "a redirect is not retried");
    }
    assert_eq!(
        elsewhere.state_total(),
        0,
        "nothing (no prompt, no provider key) reached the redirect target"
    );
}

#[tokio::test]
async fn a_redirecting_target_fails_over_to_the_next() {
    let gw = start_with(append(TWO_TARGETS)).await;
    let resp = gw
        .chat(
            "redirect-failover",
            "status=302;location=http://127.0.0.1:1/,ok",
            chat("two-targets"),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-backstop-attempts"], "2");
    let trail = trail(&resp);
    assert!(trail.starts_with("giveup:redirect,failover:"), "{trail}");
}

// --- 13. Absurd Retry-After -------------------------------------------------------------

#[tokio::test]
async fn an_absurd_retry_after_fails_over_instead_of_panicking() {
    let gw = start_with(append(TWO_TARGETS)).await;
    for fault in [
        "status=503;retry_after=1e20,ok",
        "status=429;retry_after_ms=1000000000000000000,ok",
    ] {
        let scenario = format!("ra-{fault}");
        let resp = gw.chat(&scenario, fault, chat("two-targets")).await;
        assert_eq!(resp.status(), 200, "{fault}");
        assert_eq!(resp.headers()["x-backstop-attempts"], "2");
        let trail = trail(&resp);
        assert!(trail.contains("failover:mock-openai,ok"), "{trail}");
    }
    // One target only: the upstream's answer and its Retry-After go to the client.
    let resp = gw
        .chat("ra-one", "status=503;retry_after=1e20", chat("gpt-4o"))
        .await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["x-backstop-attempts"], "1");
}

// --- 5. Upstream bodies and streams -------------------------------------------------------

#[tokio::test]
async fn an_oversized_upstream_body_is_refused_not_buffered() {
    let gw = start_with(server_keys("max_response_bytes = 8192")).await;
    let resp = gw.chat("big", "pad=100000", chat("gpt-4o")).await;
    assert_eq!(resp.headers()["x-backstop-attempts"], "1");
    let (status, body) = error_code(resp).await;
    assert_eq!(status, 502);
    assert_eq!(
        body["error"]["code"], "upstream_response_too_large",
        "{body}"
    );
    assert_eq!(
        gw.mock.attempts("big"),
        1,
        "not retried: it would be as large again"
    );
    // Under the limit it is served.
    let resp = gw.chat("small", "pad=1000", chat("gpt-4o")).await;
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn an_sse_event_that_never_ends_is_cut_at_the_event_limit() {
    let gw = start_with(server_keys("max_sse_event_bytes = 65536")).await;
    let resp = gw
        .chat("huge-event", "huge_event=10000000", chat("gpt-4o").stream())
        .await;
    assert_eq!(resp.status(), 200);
    let text = read_stream(resp, Duration::from_secs(10)).await;
    assert!(text.starts_with("data: {"), "the first event was relayed");
    assert!(
        text.len() < 65536,
        "the oversized event was never relayed: {} bytes",
        text.len()
    );
    assert!(
        text.trim_end().ends_with('}'),
        "{}",
        &text[text.len().saturating_sub(300)..]
    );
    assert!(text.contains("max_sse_event_bytes"), "{text}");
    assert!(text.contains("upstream_stream_error"));
}

#[tokio::test]
async fn a_dripping_stream_is_as_silent_as_a_stopped_one() {
    // The `slow` upstream's attempt_timeout is 200 ms: a byte every 50 ms never makes an
    // event, so the stream ends after ~200 ms of no complete event.
    let gw = start().await;
    let resp = gw
        .chat("drip", "drip=50ms", chat("slow-model").stream())
        .await;
    assert_eq!(resp.status(), 200);
    let text = read_stream(resp, Duration::from_secs(10)).await;
    assert!(text.contains("\"code\":\"upstream_timeout\""), "{text}");
}

#[tokio::test]
async fn a_never_ending_stream_stops_at_max_stream_duration_in_both_apis() {
    let gw = start_with(server_keys("max_stream_duration = \"300ms\"")).await;
    let resp = gw
        .chat(
            "endless",
            "endless;chunk_delay=5ms",
            chat("gpt-4o").stream(),
        )
        .await;
    let text = read_stream(resp, Duration::from_secs(10)).await;
    assert!(text.matches("data: ").count() > 3, "events flowed first");
    assert!(text.contains("\"code\":\"stream_timeout\""), "{text}");

    let body = json!({"model": "claude-3", "max_tokens": 8, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "endless-a"),
                ("x-mock-fault", "endless;chunk_delay=5ms"),
            ],
            body.to_string(),
        )
        .await;
    let text = read_stream(resp, Duration::from_secs(10)).await;
    assert!(
        text.contains("event: error\ndata: {\"error\":{\"message\":")
            || text.contains("event: error\ndata: {\"type\":\"error\""),
        "{text}"
    );
    assert!(text.contains("stream_timeout"));
}

#[tokio::test]
async fn a_stream_request_answered_with_plain_json_is_an_error_not_json() {
    let gw = start().await;
    let resp = gw.chat("plain", "plain", chat("gpt-4o").stream()).await;
    assert_eq!(resp.headers()["x-backstop-attempts"], "1");
    let (status, body) = error_code(resp).await;
    assert_eq!(status, 502);
    assert_eq!(body["error"]["code"], "upstream_not_streaming", "{body}");
}

// --- 6. Client-controlled identifiers ----------------------------------------------------

#[tokio::test]
async fn session_ids_and_idempotency_keys_are_bounded_and_never_silently_ignored() {
    let gw = start_with(|c| c.set("tenants.team-b.session.max_calls", 2)).await;
    let long = "s".repeat(257);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("x-session-id", long.clone().into_bytes()),
        ("x-session-id", "rün-1".as_bytes().to_vec()),
        ("x-session-id", b"has space".to_vec()),
        ("idempotency-key", long.into_bytes()),
        ("idempotency-key", "ключ".as_bytes().to_vec()),
    ];
    for (name, value) in cases {
        let resp = gw
            .http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(KEY_B)
            .header("x-mock-scenario", "ids")
            .header(
                name,
                reqwest::header::HeaderValue::from_bytes(&value).unwrap(),
            )
            .body(chat("gpt-4o").to_string())
            .send()
            .await
            .unwrap();
        let (status, body) = error_code(resp).await;
        assert_eq!(status, 400, "{name}: {body}");
        assert_eq!(body["error"]["code"], "invalid_header");
        assert_eq!(body["error"]["param"], name);
    }
    assert_eq!(
        gw.mock.attempts("ids"),
        0,
        "refused before any upstream call"
    );
    // The longest allowed id works, and its cap applies.
    let max = "m".repeat(256);
    for expect in [200, 200, 402] {
        let resp = gw
            .in_session(KEY_B, &max, "ids-ok", "", &chat("gpt-4o"))
            .await;
        assert_eq!(resp.status(), expect);
    }
}

#[tokio::test]
async fn an_idempotency_key_is_scoped_by_endpoint() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o", "input": "hello", "messages": [{"role": "user", "content": "hello"}]}).to_string();
    let first = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("idempotency-key", "k-1")],
            body.clone(),
        )
        .await;
    assert_eq!(first.status(), 200);
    let again = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("idempotency-key", "k-1")],
            body.clone(),
        )
        .await;
    assert_eq!(again.headers()["x-backstop-replayed"], "true");
    let other = gw
        .post(
            "/v1/embeddings",
            Some(KEY_A),
            &[("idempotency-key", "k-1")],
            body,
        )
        .await;
    assert_eq!(other.status(), 200);
    assert!(other.headers().get("x-backstop-replayed").is_none());
    assert_eq!(
        json(other).await["object"],
        "list",
        "an embeddings answer, not the chat one"
    );
}

// --- 11. Untrusted numbers, 15. parser differentials --------------------------------------

#[tokio::test]
async fn invalid_max_tokens_and_duplicate_keys_are_refused_before_the_upstream() {
    let gw = start().await;
    let bodies = [
        (
            r#"{"model":"gpt-4o","max_tokens":18446744073709551615,"messages":[]}"#,
            "invalid_parameter",
            Some("max_tokens"),
        ),
        (
            r#"{"model":"gpt-4o","max_tokens":-1,"messages":[]}"#,
            "invalid_parameter",
            Some("max_tokens"),
        ),
        (
            r#"{"model":"gpt-4o","max_tokens":1.5,"messages":[]}"#,
            "invalid_parameter",
            Some("max_tokens"),
        ),
        (
            r#"{"model":"gpt-4o","max_completion_tokens":"9","messages":[]}"#,
            "invalid_parameter",
            Some("max_completion_tokens"),
        ),
        (
            r#"{"model":"gpt-4o-mini","messages":[],"model":"gpt-4o"}"#,
            "invalid_json",
            None,
        ),
        (
            r#"{"model":"gpt-4o","messages":[],"stream":false,"stream":true}"#,
            "invalid_json",
            None,
        ),
    ];
    for (body, code, param) in bodies {
        let resp = gw
            .post(
                "/v1/chat/completions",
                Some(KEY_A),
                &[("x-mock-scenario", "numbers")],
                body,
            )
            .await;
        let (status, err) = error_code(resp).await;
        assert_eq!(status, 400, "{body}: {err}");
        assert_eq!(err["error"]["code"], code, "{body}");
        assert_eq!(err["error"]["param"].as_str(), param, "{body}");
    }
    let dup = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            r#"{"model":"a","model":"b"}"#,
        )
        .await;
    assert!(json(dup).await["error"]["message"]
        .as_str()
        .unwrap()
        .contains("duplicate key `model`"));
    assert_eq!(gw.mock.attempts("numbers"), 0);
    let ok = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            r#"{"model":"gpt-4o","max_tokens":null,"messages":[]}"#,
        )
        .await;
    assert_eq!(ok.status(), 200, "null is the same as absent");
}

// --- 14. Header allow-lists ---------------------------------------------------------------

#[tokio::test]
async fn a_hostile_upstream_cannot_forge_backstops_headers_nor_read_client_credentials() {
    let gw = start().await;
    let fault = "header=x-backstop-attempts:99;header=x-backstop-recovery:forged;header=server:evil;header=openai-organization:org-secret;header=set-cookie:a=b;header=x-ratelimit-remaining-requests:7";
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "forge"),
                ("x-mock-fault", fault),
                ("cookie", "session=abc"),
                ("api-key", "azure-style-key"),
                ("openai-organization", "org-client"),
                ("idempotency-key", "forge-1"),
            ],
            chat("gpt-4o").to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let h = resp.headers();
    assert_eq!(h["x-backstop-attempts"], "1");
    assert_eq!(h["x-backstop-recovery"], "ok");
    for gone in ["server", "openai-organization", "set-cookie"] {
        assert!(h.get(gone).is_none(), "{gone} reached the client");
    }
    assert_eq!(h["x-ratelimit-remaining-requests"], "7");
    let seen = gw.mock.last_request("forge").unwrap();
    for gone in [
        "cookie",
        "api-key",
        "openai-organization",
        "idempotency-key",
    ] {
        assert!(
            seen["headers"].get(gone).is_none(),
            "{gone} reached the upstream: {seen}"
        );
    }
}

// --- 4. Connections -----------------------------------------------------------------------

const CONN_LIMITS: &str =
    "header_read_timeout = \"300ms\"\nidle_timeout = \"300ms\"\nmax_connections = 6";

/// Whether the server closes `stream` within `within` (read returns EOF or an error).
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.is_ok()
}

#[tokio::test]
async fn silent_slowloris_and_idle_connections_are_closed() {
    let gw = start_with(server_keys(CONN_LIMITS)).await;
    let addr = gw.server.addr;
    // A socket that never sends a byte.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    // A request head trickled a byte at a time.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\n")
        .await
        .unwrap();
    let trickle = tokio::spawn(async move {
        for b in b"x-header-that-never-ends: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter() {
            if slow.write_all(&[*b]).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        closed_within(&mut slow, Duration::from_secs(1)).await
    });
    assert!(
        closed_within(&mut silent, Duration::from_secs(5)).await,
        "silent socket kept open"
    );
    assert!(trickle.await.unwrap(), "slowloris socket kept open");

    // A keep-alive connection: one request, then idle.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = kept.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert!(
        closed_within(&mut kept, Duration::from_secs(5)).await,
        "idle keep-alive kept open"
    );

    // A connection that keeps working is not closed by either timeout.
    let client = reqwest::Client::new();
    for _ in 0..4 {
        let r = client
            .get(format!("{}/healthz", gw.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn connections_over_the_cap_get_a_503_and_others_recover() {
    let gw = start_with(server_keys(CONN_LIMITS)).await;
    let addr = gw.server.addr;
    let mut held = Vec::new();
    for _ in 0..6 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut over = TcpStream::connect(addr).await.unwrap();
    let mut text = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), over.read_to_string(&mut text)).await;
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("too_many_connections"), "{text}");
    // The held sockets time out (header_read_timeout) and free their slots.
    for mut s in held {
        assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    }
    let resp = gw.chat("after-cap", "", chat("gpt-4o")).await;
    assert_eq!(resp.status(), 200);
}

/// A tenant's valid structured-output requests whose schemas each nest six applicators
/// in an order of their own (every one within the default shape limits) must not grow
/// the gateway for good. Under jsonschema 0.33 each new keyword sequence grew its
/// process-wide meta-schema validator by about 5 MB, kept for the process's life: 300
/// such requests took a release gateway from 15 MB to 1.5 GB.
#[tokio::test]
async fn schemas_of_new_shapes_do_not_grow_the_gateway_for_good() {
    const KEYWORDS: [&str; 6] = [
        "not",
        "items",
        "contains",
        "additionalProperties",
        "propertyNames",
        "if",
    ];
    let dir = TempDir::new("backstop-schema-memory");
    let port = free_port();
    let mock_port = free_port();
    let config = on_its_mock(&dir, port, mock_port, "", "bk-schema-memory");
    let binary = Binary::start(&config, port).await;
    let client = reqwest::Client::new();
    let ask = |i: usize| {
        let mut schema = json!({"type": "string"});
        let mut digits = i + 6usize.pow(6);
        for _ in 0..6 {
            schema = json!({KEYWORDS[digits % 6]: schema});
            digits /= 6;
        }
        let body = json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "answer as JSON"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": format!("s{i}"),
                "schema": {"type": "object", "properties": {"a": schema}},
            }},
        });
        client
            .post(format!("{}/v1/chat/completions", binary.url))
            .bearer_auth("bk-schema-memory")
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    // The first schema builds what every compilation shares.
    ask(0).await.unwrap();
    let before = binary.rss_anon_kib();
    for i in 1..=60 {
        let resp = ask(i).await.unwrap();
        // Compiled and checked: the mock's answer is not that JSON.
        assert_eq!(resp.status(), 502, "schema {i}");
        assert_eq!(json(resp).await["error"]["code"], "output_invalid");
    }
    let grown = binary.rss_anon_kib().saturating_sub(before);
    assert!(
        grown < 48 * 1024,
        "60 schemas of new shapes grew the gateway by {grown} KiB"
    );
    binary.kill();
}

/// Writes the config of a real binary serving tenant `t` (key `key`) on its built-in
/// mock: `server` is added after `[server]`'s listen and drain lines (more of its keys,
/// then any tables); returns the file.
fn on_its_mock(
    dir: &TempDir,
    port: u16,
    mock_port: u16,
    server: &str,
    key: &str,
) -> std::path::PathBuf {
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ndrain_delay = \"0s\"\n{server}[store]\npath = \":memory:\"\n[mock]\nlisten = \"127.0.0.1:{mock_port}\"\n[[upstreams]]\nname = \"m\"\napi = \"openai\"\nbase_url = \"http://127.0.0.1:{mock_port}\"\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"m\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"{key}\"]\n"
        ),
    )
    .unwrap();
    config
}

/// Issue 23, item 7: the gateway under `prlimit --nofile=128:256`, with more idle
/// connections than it can hold descriptors. It raises its soft limit to the hard 256,
/// caps connections at (256 - 64 reserved) / 3 with the built-in mock = 64, and answers
/// a new client at once (503 at accept) instead of leaving it in the listen backlog.
#[tokio::test]
async fn more_idle_connections_than_descriptors_still_leave_new_clients_a_prompt_answer() {
    let dir = TempDir::new("backstop-fd");
    let port = free_port();
    let mock_port = free_port();
    let config = on_its_mock(
        &dir,
        port,
        mock_port,
        "header_read_timeout = \"30s\"\n[log]\nlevel = \"info\"\n",
        "bk-fd-test",
    );
    let binary = Binary::start_under(
        &["prlimit", "--nofile=128:256"],
        &config,
        port,
        std::process::Stdio::piped(),
    )
    .await;
    let addr = format!("127.0.0.1:{port}");
    let mut idle = Vec::new();
    for _ in 0..300 {
        let connect = TcpStream::connect(&addr);
        idle.push(
            tokio::time::timeout(Duration::from_secs(5), connect)
                .await
                .expect("connect in time")
                .unwrap(),
        );
    }
    // A fresh client each time: no pooled connection from an earlier request.
    let chat_now = |within: Duration| {
        let client = reqwest::Client::builder().timeout(within).build().unwrap();
        client
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth("bk-fd-test")
            .body(chat("gpt-4o").to_string())
            .send()
    };
    // Answered, never left waiting: before, this client waited until it gave up. The 1 s
    // target is measured by scripts/fd-limit-probe; the bound here leaves room for a
    // loaded machine (CI's two cores run other tests beside this one).
    let started = std::time::Instant::now();
    let resp = chat_now(Duration::from_secs(3))
        .await
        .expect("answered within 3 s");
    // The first 64 idle connections hold every slot: this one is refused, and the 503
    // reaches even hyper, which drops a response that comes before its request.
    let (status, body) = error_code(resp).await;
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "too_many_connections");
    println!("refused at the cap in {:?}", started.elapsed());

    drop(idle);
    let recovered = async {
        loop {
            if chat_now(Duration::from_secs(1))
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), recovered)
        .await
        .expect("a request succeeds once the idle connections are closed");

    let logs = binary.terminate();
    let cap = logs
        .lines()
        .find(|l| l.contains("connection cap"))
        .unwrap_or_else(|| panic!("no connection cap logged: {logs}"));
    for field in ["configured=4096", "effective=64", "open_files_limit=256"] {
        assert!(cap.contains(field), "{cap}");
    }
    assert!(
        !logs.contains("accept failed"),
        "ran out of descriptors: {logs}"
    );
}

// --- 15. Shutdown ---------------------------------------------------------------------------

#[tokio::test]
async fn draining_shows_503_on_readyz_while_still_serving() {
    let gw = start_with(server_keys("drain_delay = \"2s\"")).await;
    let client = reqwest::Client::new();
    let ready = client
        .get(format!("{}/readyz", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    gw.server.begin_shutdown();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let ready = client
        .get(format!("{}/readyz", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(
        ready.status(),
        503,
        "draining is visible to a load balancer"
    );
    let resp = gw.chat("draining", "", chat("gpt-4o")).await;
    assert_eq!(
        resp.status(),
        200,
        "requests are still served while draining"
    );
}

#[tokio::test]
async fn a_stream_cut_at_the_shutdown_grace_ends_with_an_error_event() {
    let gw = start_with(|c| {
        c.set("server.drain_delay", "0s")
            .set("server.shutdown_grace", "300ms")
    })
    .await;
    let resp = gw
        .chat("cut", "endless;chunk_delay=20ms", chat("gpt-4o").stream())
        .await;
    assert_eq!(resp.status(), 200);
    let Gateway { server, .. } = gw;
    let shutdown = tokio::spawn(server.shutdown());
    let text = read_stream(resp, Duration::from_secs(10)).await;
    assert!(
        text.contains("\"code\":\"server_shutting_down\""),
        "{}",
        &text[text.len().saturating_sub(400)..]
    );
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .unwrap()
        .unwrap();
}

// --- 15. Small things -----------------------------------------------------------------------

#[tokio::test]
async fn method_not_allowed_has_a_body_and_request_ids_are_bounded_everywhere() {
    let gw = start().await;
    let client = reqwest::Client::new();
    let resp = client
        .get(format!("{}/v1/chat/completions", gw.url))
        .send()
        .await
        .unwrap();
    let (status, body) = error_code(resp).await;
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed");

    let huge = "r".repeat(4000);
    for path in ["/healthz", "/metrics", "/nope", "/v1/chat/completions"] {
        let resp = client
            .get(format!("{}{path}", gw.url))
            .header("x-request-id", &huge)
            .send()
            .await
            .unwrap();
        let id = resp.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(
            id.len() <= 128 && id != huge,
            "{path} reflected a {}-byte id",
            id.len()
        );
        let resp = client
            .get(format!("{}{path}", gw.url))
            .header("x-request-id", "trace-7")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["x-request-id"], "trace-7", "{path}");
    }
}

#[tokio::test]
async fn logs_carry_no_ansi_colour_when_stderr_is_not_a_terminal() {
    let dir = TempDir::new("backstop-ansi");
    let port = free_port();
    let mock_port = free_port();
    let config = on_its_mock(&dir, port, mock_port, "", "bk-ansi-test");
    let binary = Binary::start_with(&config, port, std::process::Stdio::piped()).await;
    // SIGTERM: a graceful stop flushes the log writer.
    let output = binary.terminate();
    assert!(output.contains("backstop listening"), "{output}");
    assert!(
        !output.contains('\u{1b}'),
        "ANSI escape in piped logs: {output:?}"
    );
}

// --- 7. Metrics cardinality, 15. admin token ---------------------------------------------

#[tokio::test]
async fn client_chosen_model_names_never_become_metric_labels() {
    let gw = start().await;
    for i in 0..20 {
        let body = json!({"model": format!("gpt-attacker-{i}\"x"), "messages": [{"role": "user", "content": "hi"}]});
        let resp = gw.chat("labels", "", body).await;
        assert_eq!(resp.status(), 200);
    }
    let page = gw.metrics().await;
    assert!(
        !page.contains("gpt-attacker"),
        "a client model name became a label"
    );
    assert!(
        page.contains("backstop_tokens_total{tenant=\"team-a\",model=\"gpt-*\",kind=\"input\"}"),
        "{}",
        page.lines()
            .filter(|l| l.contains("tokens_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test]
async fn a_wrong_admin_token_says_so() {
    let gw = start_with(append("[admin]\ntoken = \"admin-token-0123456789\"")).await;
    for token in [KEY_A, "admin-token-012345678", "x"] {
        let resp = gw
            .http
            .get(format!("{}/admin/upstreams", gw.url))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        let (status, body) = error_code(resp).await;
        assert_eq!(status, 401);
        assert_eq!(body["error"]["code"], "invalid_admin_token");
        assert!(body["error"]["message"].as_str().unwrap().contains("admin"));
    }
    let ok = gw
        .http
        .get(format!("{}/admin/upstreams", gw.url))
        .bearer_auth("admin-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

// --- hardening v3, 11. malformed fields are the caller's mistake -------------------------

#[tokio::test]
async fn malformed_fields_get_400_in_the_callers_shape_before_any_attempt() {
    let gw = start().await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        // Before: read as a non-streaming call, then 502 when the upstream streamed.
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "stream": "true", "messages": hi}),
            "stream",
            "must be a boolean, got a string",
        ),
        // Before: forwarded.
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": 5}]}),
            "messages",
            "messages[0].content must be a string or a list of content parts, got a number",
        ),
        (
            "/v1/responses",
            json!({"model": "gpt-4o", "input": [{"role": "user", "content": 5}]}),
            "input",
            "input[0].content must be a string or a list of content parts, got a number",
        ),
        (
            "/v1/messages",
            json!({"model": "claude-sonnet-4-5", "max_tokens": 10,
                   "messages": [{"role": "user", "content": {"text": "hi"}}]}),
            "messages",
            "messages[0].content must be a string or a list of content parts, got an object",
        ),
        // Before: 503 `store_unavailable` on the Postgres ledger, which refuses NUL.
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4o\u{0}", "messages": hi}),
            "model",
            "must not contain control characters",
        ),
    ];
    for (i, (path, body, param, says)) in cases.into_iter().enumerate() {
        let scenario = format!("malformed-{i}");
        let resp = gw
            .post(
                path,
                Some(KEY_A),
                &[("x-mock-scenario", &scenario)],
                body.to_string(),
            )
            .await;
        assert_eq!(resp.status(), 400, "{path} {body}");
        let error = json(resp).await;
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{path}: {error}");
        if path == "/v1/messages" {
            assert_eq!(error["type"], "error", "{error}");
            assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        } else {
            assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
            assert_eq!(error["error"]["param"], param, "{error}");
        }
        assert_eq!(gw.mock.attempts(&scenario), 0, "{path} {body}");
    }
    // An assistant turn that only calls tools has `content: null` in chat: still served.
    let body = json!({"model": "gpt-4o", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
    let resp = gw.chat("tool-turn", "", body).await;
    assert_eq!(resp.status(), 200);
}

/// Hardening v3, 14: a full server closes its longest-idle keep-alive connection to make
/// room, before it refuses a new client. Before: a fast 503 while idle sockets held
/// every slot.
#[tokio::test]
async fn a_full_server_sheds_its_oldest_idle_keep_alive_before_refusing() {
    let gw = start_with(server_keys(
        "idle_timeout = \"60s\"\nheader_read_timeout = \"60s\"\nmax_connections = 4",
    ))
    .await;
    let addr = gw.server.addr;
    let mut kept = Vec::new();
    for _ in 0..4 {
        let mut socket = TcpStream::connect(addr).await.unwrap();
        socket
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = socket.read(&mut buf).await.unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        kept.push(socket);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Every slot holds an idle keep-alive; a new client is served all the same.
    let resp = reqwest::Client::new()
        .get(format!("{}/healthz", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // The oldest idle one made the room; the others are still open.
    assert!(
        closed_within(&mut kept[0], Duration::from_secs(2)).await,
        "the oldest idle connection was not shed"
    );
    for socket in &mut kept[1..] {
        assert!(!closed_within(socket, Duration::from_millis(100)).await);
    }
    let metrics = gw.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("backstop_connections_closed_total{")
                && l.contains("reason=\"shed_idle\"")),
        "{metrics}"
    );
}
