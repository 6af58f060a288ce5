//! The edge every route shares: one request-id rule, the admin API through the edge
//! (request id, metrics, its auth as a layer), the tenant's session report rate limited,
//! the request body read timeout answered in the caller's API shape, and the access-log
//! line written when the response body ends (a stream's usage, how it ended, its full
//! duration).

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

const LIMITED: &str = "bk-test-limited-key";

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

#[tokio::test]
async fn admin_calls_pass_the_edge_with_a_request_id_and_metrics() {
    let gw = start_with(|c| c.merge(&admin_and_prices())).await;
    let resp = gw
        .http
        .get(format!("{}/admin/upstreams", gw.url))
        .bearer_auth(ADMIN)
        .header("x-request-id", "admin-call-1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "admin-call-1");
    assert!(json(resp).await["upstreams"].is_array());
    let unknown = gw
        .http
        .get(format!("{}/admin/tenants/nobody", gw.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    assert!(unknown.headers().contains_key("x-request-id"));
    assert_eq!(json(unknown).await["error"]["code"], "not_found");

    let page = gw.metrics().await;
    let admin_lines: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("backstop_requests_total{") && l.contains("endpoint=\"admin\""))
        .collect();
    assert!(
        admin_lines.iter().any(|l| l.contains("status=\"2xx\""))
            && admin_lines.iter().any(|l| l.contains("status=\"4xx\"")),
        "{admin_lines:?}"
    );
    assert!(!page.contains("nobody"), "a path segment became a label");
}

#[tokio::test]
async fn admin_auth_refuses_with_exact_codes() {
    let gw = start_with(|c| c.merge(&admin_and_prices())).await;
    for (token, why) in [
        (Some(KEY_A), "a tenant key"),
        (Some("x"), "wrong"),
        (None, "none"),
    ] {
        let mut req = gw
            .http
            .post(format!("{}/admin/tenants/team-a/sessions/s/reset", gw.url));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{why}");
        assert_eq!(resp.headers()["x-should-retry"], "false");
        assert!(resp.headers().contains_key("x-request-id"));
        let body = json(resp).await;
        assert_eq!(body["error"]["code"], "invalid_admin_token", "{why}");
        assert_eq!(body["error"]["type"], "authentication_error", "{why}");
    }
    // A known admin path with the wrong method: 405 as on any route, token or not.
    let resp = gw
        .http
        .get(format!("{}/admin/tenants/team-a/sessions/s/reset", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);

    // Without `[admin] token` the admin API is off: 403, whatever is presented.
    let off = start().await;
    let resp = off
        .http
        .get(format!("{}/admin/upstreams", off.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(json(resp).await["error"]["code"], "admin_disabled");
}

#[tokio::test]
async fn the_session_report_is_rate_limited_like_any_tenant_call() {
    let gw = start_with(|c| {
        c.merge(&format!("[[tenants]]\nname = \"limited\"\napi_keys = [\"{LIMITED}\"]\nrequests_per_minute = 2\n"))
    })
    .await;
    let report = || {
        gw.http
            .get(format!("{}/v1/sessions/s", gw.url))
            .bearer_auth(LIMITED)
            .send()
    };
    for _ in 0..2 {
        let resp = report().await.unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(json(resp).await["tenant"], "limited");
    }
    let resp = report().await.unwrap();
    assert_eq!(resp.status(), 429);
    let retry_after: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=30).contains(&retry_after), "{retry_after}");
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    // The same limiter as the proxy: the tenant's next call is refused too.
    let chat = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(LIMITED),
            &[("x-mock-scenario", "rl-report")],
            chat.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(gw.mock.attempts("rl-report"), 0);
    // An unknown key is refused by the tenant auth layer, as on the proxy.
    let resp = gw
        .http
        .get(format!("{}/v1/sessions/s", gw.url))
        .bearer_auth("bk-nobody")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(json(resp).await["error"]["code"], "invalid_api_key");
}

/// Sends a request head that promises 100 bytes of body, then half of it, then nothing;
/// returns the status and the JSON body of the answer.
async fn stalled_body(addr: std::net::SocketAddr, path: &str, auth: &str) -> (u16, Value) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\n{auth}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&[b' '; 50]).await.unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = tcp.read(&mut buf).await.unwrap();
            raw.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&raw);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length: ")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .expect("a content-length");
                if body.len() >= length || n == 0 {
                    return (head.to_string(), body.to_string());
                }
            }
            assert!(n > 0, "closed without an answer: {text}");
        }
    })
    .await
    .expect("answered within 5s");
    let status = answer.0[9..12].parse().unwrap();
    (status, serde_json::from_str(&answer.1).unwrap())
}

#[tokio::test]
async fn a_stalled_request_body_gets_408_in_the_callers_shape() {
    let gw = start_with(|c| c.set("server.body_read_timeout", "200ms")).await;
    let (status, body) = stalled_body(
        gw.server.addr,
        "/v1/chat/completions",
        &format!("authorization: Bearer {KEY_A}"),
    )
    .await;
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "request_body_timeout", "{body}");
    assert_eq!(body["error"]["type"], "timeout_error", "{body}");

    let (status, body) = stalled_body(
        gw.server.addr,
        "/v1/messages",
        &format!("x-api-key: {KEY_A}"),
    )
    .await;
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "request_body_timeout", "{body}");

    // A body that arrives in time is served as usual.
    let chat = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw.chat("in-time", "", chat).await;
    assert_eq!(resp.status(), 200);
}

/// The real binary on its built-in mock, logging JSON to a pipe: its log lines are
/// read once it is stopped ([`json_lines`]).
async fn json_logged(dir: &TempDir) -> Binary {
    let port = free_port();
    let mock_port = free_port();
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ndrain_delay = \"0s\"\n[log]\nformat = \"json\"\nlevel = \"info\"\n[store]\npath = \":memory:\"\n[mock]\nlisten = \"127.0.0.1:{mock_port}\"\n[[upstreams]]\nname = \"m\"\napi = \"openai\"\nforward_headers = [\"x-mock-*\"]\nbase_url = \"http://127.0.0.1:{mock_port}\"\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"m\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-span-test\"]\n"
        ),
    )
    .unwrap();
    Binary::start_with(&config, port, std::process::Stdio::piped()).await
}

/// Stops the binary and returns its JSON log lines.
fn json_lines(binary: Binary) -> (Vec<Value>, String) {
    let output = binary.terminate();
    let lines = output
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    (lines, output)
}

/// The access-log line of one request.
fn access_line<'a>(lines: &'a [Value], id: &str, output: &str) -> &'a Value {
    let access: Vec<_> = lines
        .iter()
        .filter(|l| l["message"] == "request" && l["request_id"] == id)
        .collect();
    assert_eq!(access.len(), 1, "{output}");
    access[0]
}

/// A streamed chat call through the binary, with `fault` for the mock.
async fn streamed(binary: &Binary, id: &str, fault: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", binary.url))
        .bearer_auth("bk-span-test")
        .header("x-request-id", id)
        .header("x-mock-fault", fault)
        .body(
            json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
                .to_string(),
        )
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_streams_access_log_line_is_written_when_its_body_ends() {
    let dir = TempDir::new("backstop-stream-log");
    let binary = json_logged(&dir).await;
    // Four chunks 100 ms apart: the body takes at least 300 ms after the head.
    let resp = streamed(
        &binary,
        "stream-log-1",
        "usage=7/11;chunks=4;chunk_delay=100ms",
    )
    .await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    // An upstream that breaks mid-stream: Backstop ends the stream with an error event.
    let resp = streamed(&binary, "stream-cut-1", "cut=2").await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    assert!(body.contains("upstream_stream_error"), "{body}");
    let (lines, output) = json_lines(binary);
    let cut = access_line(&lines, "stream-cut-1", &output);
    assert_eq!(cut["end"], "cut", "{cut}");
    assert_eq!(cut["cut"], "broken", "{cut}");
    let line = access_line(&lines, "stream-log-1", &output);
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["end"], "complete", "{line}");
    assert_eq!(line["input_tokens"], 7, "{line}");
    assert_eq!(line["output_tokens"], 11, "{line}");
    let (head, total) = (
        line["head_ms"].as_f64().unwrap(),
        line["latency_ms"].as_f64().unwrap(),
    );
    assert!(total >= 300.0 && total > head, "{line}");
}

#[tokio::test]
async fn a_client_gone_mid_stream_is_logged_as_such() {
    let dir = TempDir::new("backstop-stream-gone");
    let binary = json_logged(&dir).await;
    // A raw connection, so that going away closes it for certain.
    let addr = binary.url.trim_start_matches("http://").to_owned();
    let mut conn = TcpStream::connect(&addr).await.unwrap();
    let body =
        json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
            .to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer bk-span-test\r\nx-request-id: stream-gone-1\r\nx-mock-fault: endless;chunk_delay=20ms\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut first = [0u8; 256];
    let n = conn.read(&mut first).await.unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    // The client goes, the stream still open.
    drop(conn);
    let (lines, output) = json_lines(binary);
    let line = access_line(&lines, "stream-gone-1", &output);
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["end"], "client_gone", "{line}");
}

#[tokio::test]
async fn log_lines_inside_the_stack_carry_the_requests_span() {
    let dir = TempDir::new("backstop-span");
    let binary = json_logged(&dir).await;
    // The provider refusing Backstop's key opens the upstream's breaker at once: a
    // warning logged deep in the stack, by the recovery layer's health registry.
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", binary.url))
        .bearer_auth("bk-span-test")
        .header("x-request-id", "span-test-1")
        .header("x-session-id", "run-7")
        .header("x-mock-fault", "status=401")
        .body(
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 502);
    let (lines, output) = json_lines(binary);
    let inner = lines
        .iter()
        .find(|l| l["message"] == "circuit breaker transition")
        .unwrap_or_else(|| panic!("no breaker line in: {output}"));
    assert_eq!(inner["span"]["request_id"], "span-test-1", "{inner}");
    assert_eq!(inner["span"]["tenant"], "t", "{inner}");
    assert_eq!(inner["span"]["session"], "run-7", "{inner}");
    // Still one access-log line for the request, with its own fields.
    let access: Vec<_> = lines.iter().filter(|l| l["message"] == "request").collect();
    assert_eq!(access.len(), 1, "{output}");
    let line = access_line(&lines, "span-test-1", &output);
    assert_eq!(line["status"], 502);
    assert_eq!(line["error"], "upstream_auth_failed", "{line}");
    assert_eq!(line["end"], "complete", "{line}");
}

/// Hardening v3, 13: HTTP/2 with prior knowledge on the plain port is served (before:
/// the connection was dropped with no response), streams included, and HTTP/1.1 still is.
#[tokio::test]
async fn http2_with_prior_knowledge_is_served_on_the_plain_port() {
    let gw = start().await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello"}]});
    let resp = h2
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY_A)
        .header("x-mock-scenario", "h2")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-request-id"));
    let answer = json(resp).await;
    assert_eq!(answer["choices"][0]["message"]["content"], "mock: hello");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = h2
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY_A)
        .header("x-mock-scenario", "h2")
        .body(streamed.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // A caller's mistake is the same 4xx over HTTP/2.
    let resp = h2
        .post(format!("{}/v1/chat/completions", gw.url))
        .bearer_auth(KEY_A)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(gw.mock.attempts("h2"), 2);
    let resp = gw.chat("h1", "", body).await;
    assert_eq!(resp.version(), reqwest::Version::HTTP_11);
    assert_eq!(resp.status(), 200);
}
