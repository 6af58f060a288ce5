//! The core gateway end to end: real sockets, the real mock upstream.

use std::time::Duration;

use crate::common::*;
use futures_util::StreamExt;
use serde_json::json;

#[tokio::test]
async fn chat_is_forwarded_with_the_provider_key_and_never_the_tenant_key() {
    let gw = start().await;
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[
                ("x-mock-scenario", "fwd"),
                ("x-request-id", "req-42"),
                ("x-session-id", "s-1"),
            ],
            chat("gpt-4o").to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    let body = json(resp).await;
    assert_eq!(body["choices"][0]["message"]["content"], "mock: hello");
    assert_eq!(gw.mock.attempts("fwd"), 1);

    let seen = gw.mock.last_request("fwd").unwrap();
    assert_eq!(seen["path"], "/v1/chat/completions");
    assert_eq!(
        seen["headers"]["authorization"],
        "Bearer sk-provider-openai"
    );
    // Backstop's own control headers stay in Backstop (the allow-list).
    assert!(seen["headers"].get("x-session-id").is_none(), "{seen}");
    assert!(seen["headers"].get("x-request-id").is_none(), "{seen}");
    assert!(
        !seen["headers"].to_string().contains(KEY_A),
        "tenant key leaked upstream: {seen}"
    );
    assert_eq!(seen["body"]["model"], "gpt-4o");
}

#[tokio::test]
async fn anthropic_gets_x_api_key_and_a_default_version() {
    let gw = start().await;
    let body = json!({"model": "claude-3-5-haiku", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_B),
            &[("x-mock-scenario", "anth"), ("anthropic-beta", "b1")],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(json(resp).await["content"][0]["text"], "mock: hi");
    let seen = gw.mock.last_request("anth").unwrap();
    assert_eq!(seen["headers"]["x-api-key"], "sk-provider-anthropic");
    assert_eq!(seen["headers"]["anthropic-version"], "2023-06-01");
    assert_eq!(seen["headers"]["anthropic-beta"], "b1");
    assert!(seen["headers"].get("authorization").is_none());
}

#[tokio::test]
async fn a_target_model_rewrites_the_request_model() {
    let gw = start().await;
    let resp = gw.chat("rewrite", "", chat("rewrite-me")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        gw.mock.last_request("rewrite").unwrap()["body"]["model"],
        "gpt-4o-mini"
    );
}

#[tokio::test]
async fn streams_are_relayed_before_the_upstream_finishes() {
    let gw = start().await;
    // The upstream sends its first event, then holds the rest for 30 s: a buffering proxy
    // would show the client nothing until then.
    let body = json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hello"}]});
    let resp = gw
        .chat("stream-first", "chunks=2;chunk_delay=30s", body)
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut chunks = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(5), chunks.next())
        .await
        .expect("first chunk arrived while the upstream was still streaming")
        .unwrap()
        .unwrap();
    let first = String::from_utf8_lossy(&first);
    assert!(
        first.starts_with("data: ") && first.contains("\"role\":\"assistant\""),
        "{first}"
    );
}

#[tokio::test]
async fn a_whole_stream_arrives_intact() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o", "stream": true, "stream_options": {"include_usage": true}, "messages": [{"role": "user", "content": "hello world"}]});
    let text = gw
        .chat("stream-all", "chunks=3", body)
        .await
        .text()
        .await
        .unwrap();
    let content: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(content, "mock: hello world");
    assert!(text.contains("\"usage\""));
    assert!(text.trim_end().ends_with("data: [DONE]"));
}

#[tokio::test]
async fn a_stream_cut_after_its_first_byte_ends_with_an_error_event() {
    let gw = start().await;
    let body = json!({"model": "gpt-4o", "stream": true, "messages": [{"role": "user", "content": "hello"}]});
    let text = gw
        .chat("cut-openai", "cut=2", body)
        .await
        .text()
        .await
        .unwrap();
    let last = text.trim_end().lines().last().unwrap().to_string();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "upstream_stream_error", "{text}");

    let body = json!({"model": "claude-x", "stream": true, "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]});
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[("x-mock-scenario", "cut-anth"), ("x-mock-fault", "cut=3")],
            body.to_string(),
        )
        .await;
    let text = resp.text().await.unwrap();
    assert!(text.contains("event: message_start"));
    assert!(text.trim_end().ends_with(r#"data: {"error":{"message":"the upstream stream ended unexpectedly","type":"upstream_stream_error"},"type":"error"}"#), "{text}");
    assert!(text.contains("event: error\n"), "{text}");
}

#[tokio::test]
async fn missing_and_wrong_keys_get_401_in_each_api_shape() {
    let gw = start().await;
    for key in [None, Some("bk-wrong-key")] {
        let resp = gw
            .post(
                "/v1/chat/completions",
                key,
                &[("x-mock-scenario", "auth")],
                chat("gpt-4o").to_string(),
            )
            .await;
        assert_eq!(resp.status(), 401);
        let body = json(resp).await;
        assert_eq!(body["error"]["type"], "authentication_error");
        assert_eq!(body["error"]["code"], "invalid_api_key");

        let resp = gw
            .post("/v1/messages", key, &[("x-mock-scenario", "auth")], "{}")
            .await;
        assert_eq!(resp.status(), 401);
        let body = json(resp).await;
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "authentication_error");
    }
    assert_eq!(gw.mock.attempts("auth"), 0);
}

#[tokio::test]
async fn bad_input_is_refused_before_any_upstream_call() {
    let gw = start().await;
    let big =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x".repeat(5000)}]})
            .to_string();
    let cases: [(&str, String, u16, &str); 5] = [
        (
            "/v1/chat/completions",
            "{\"model\":".into(),
            400,
            "invalid_json",
        ),
        ("/v1/chat/completions", "[1,2]".into(), 400, "invalid_json"),
        (
            "/v1/chat/completions",
            json!({"messages": []}).to_string(),
            400,
            "missing_model",
        ),
        (
            "/v1/chat/completions",
            chat("llama-3").to_string(),
            404,
            "model_not_found",
        ),
        (
            "/v1/chat/completions",
            big.clone(),
            413,
            "request_too_large",
        ),
    ];
    for (path, body, status, code) in cases {
        let resp = gw
            .post(path, Some(KEY_A), &[("x-mock-scenario", "bad")], body)
            .await;
        assert_eq!(resp.status(), status, "{code}");
        assert_eq!(json(resp).await["error"]["code"], code);
    }
    let anthropic: [(String, u16, &str); 4] = [
        ("not json".into(), 400, "invalid_request_error"),
        (
            json!({"max_tokens": 1}).to_string(),
            400,
            "invalid_request_error",
        ),
        (
            json!({"model": "llama-3"}).to_string(),
            404,
            "not_found_error",
        ),
        (big, 413, "request_too_large"),
    ];
    for (body, status, kind) in anthropic {
        let resp = gw
            .post(
                "/v1/messages",
                Some(KEY_A),
                &[("x-mock-scenario", "bad")],
                body,
            )
            .await;
        assert_eq!(resp.status(), status, "{kind}");
        let body = json(resp).await;
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], kind);
    }
    assert_eq!(gw.mock.attempts("bad"), 0);
}

#[tokio::test]
async fn a_model_on_the_other_api_is_translated_or_refused_naming_what_it_lacks() {
    let gw = start().await;
    // Anthropic requires `max_tokens`, and the target sets no default: nothing is sent.
    let resp = gw.chat("mismatch", "", chat("claude-x")).await;
    assert_eq!(resp.status(), 400);
    let error = json(resp).await["error"].clone();
    assert_eq!(error["code"], "unsupported_conversion");
    assert!(
        error["message"].as_str().unwrap().contains("/max_tokens"),
        "{error}"
    );
    assert_eq!(gw.mock.attempts("mismatch"), 0);
    let resp = gw
        .chat("mismatch", "", chat("claude-x").max_tokens(10))
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "translate:chat->messages,ok"
    );
    // Embeddings have no Anthropic counterpart at all.
    let resp = gw
        .post(
            "/v1/embeddings",
            Some(KEY_A),
            &[("x-mock-scenario", "mismatch")],
            r#"{"model":"claude-x","input":"hi"}"#,
        )
        .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(json(resp).await["error"]["code"], "api_mismatch");
    assert_eq!(gw.mock.attempts("mismatch"), 1);
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_a_slow_one_504() {
    let gw = start().await;
    let resp = gw.chat("dead", "", chat("dead-model")).await;
    assert_eq!(resp.status(), 502);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "upstream_unavailable");
    assert_eq!(body["error"]["type"], "upstream_error");

    let resp = gw.chat("slow", "delay=3s", chat("slow-model")).await;
    assert_eq!(resp.status(), 504);
    assert_eq!(json(resp).await["error"]["code"], "upstream_timeout");

    let resp = gw.chat("reset", "reset", chat("gpt-4o")).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(resp.headers()["x-backstop-attempts"], "3");
    assert_eq!(resp.headers()["x-should-retry"], "false");
    assert_eq!(json(resp).await["error"]["code"], "upstream_unavailable");
    assert_eq!(gw.mock.attempts("reset"), 3);
}

#[tokio::test]
async fn the_request_deadline_covers_the_whole_request() {
    let gw = start_with(|c| c.set("server.request_timeout", "300ms")).await;
    let resp = gw.chat("deadline", "delay=3s", chat("gpt-4o")).await;
    assert_eq!(resp.status(), 504);
    assert_eq!(json(resp).await["error"]["code"], "request_timeout");
}

#[tokio::test]
async fn upstream_errors_pass_through_with_their_body() {
    let gw = start().await;
    let resp = gw
        .chat(
            "passthrough",
            "status=400;code=context_length_exceeded",
            chat("gpt-4o"),
        )
        .await;
    assert_eq!(resp.status(), 400);
    assert_eq!(json(resp).await["error"]["code"], "context_length_exceeded");
    let resp = gw
        .chat(
            "passthrough-429",
            "status=429;retry_after=7",
            chat("gpt-4o"),
        )
        .await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["retry-after"], "7");
}

#[tokio::test]
async fn models_health_and_metrics() {
    let gw = start().await;
    let models = gw
        .http
        .get(format!("{}/v1/models", gw.url))
        .bearer_auth(KEY_A)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    let ids: Vec<String> = json(models).await["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    // Concrete ids only: the gpt-* route lists its models, claude-* lists none (so a
    // glob, which no client can pick, is not shown).
    assert_eq!(
        ids,
        [
            "gpt-4o",
            "gpt-4o-mini",
            "rewrite-me",
            "dead-model",
            "slow-model"
        ]
    );
    let unauth = gw
        .http
        .get(format!("{}/v1/models", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(unauth.status(), 401);

    for path in ["/healthz", "/readyz"] {
        assert_eq!(
            gw.http
                .get(format!("{}{path}", gw.url))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
    }
    gw.chat("metrics", "", chat("gpt-4o")).await;
    let text = gw.metrics().await;
    assert!(text.contains("backstop_requests_total{"), "{text}");
    assert!(text.contains("backstop_overhead_seconds_bucket"), "{text}");
    assert!(
        text.contains("backstop_upstream_duration_seconds_bucket{upstream=\"mock-openai\""),
        "{text}"
    );
    assert!(
        !text.contains("sk-provider"),
        "a provider key leaked into metrics"
    );

    let unknown = gw
        .http
        .get(format!("{}/v2/nothing", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    assert_eq!(json(unknown).await["error"]["code"], "unknown_endpoint");
}

#[tokio::test]
async fn shutdown_lets_in_flight_requests_finish_then_stops_accepting() {
    let gw = start().await;
    let url = gw.url.clone();
    let in_flight = tokio::spawn({
        let http = gw.http.clone();
        let url = url.clone();
        async move {
            http.post(format!("{url}/v1/chat/completions"))
                .bearer_auth(KEY_A)
                .header("x-mock-scenario", "in-flight")
                .header("x-mock-fault", "delay=400ms")
                .body(chat("gpt-4o").to_string())
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    until("the request to reach the upstream", || async {
        gw.mock.attempts("in-flight") == 1
    })
    .await;
    gw.server.shutdown().await;
    assert_eq!(
        in_flight.await.unwrap(),
        200,
        "the in-flight request was cut"
    );
    let after = reqwest::Client::new()
        .get(format!("{url}/healthz"))
        .send()
        .await;
    assert!(after.is_err(), "still accepting after shutdown");
}

/// Plain-HTTP upstreams are called through hyper directly, unless a proxy is set in the
/// environment: then reqwest carries every call, and the proxy gets it (in absolute
/// form), as it did before the direct path existed.
#[tokio::test]
async fn a_proxy_in_the_environment_carries_plain_http_upstream_calls() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    // Nothing listens there: only the proxy can answer.
    let upstream_port = dead_port().await;
    let seen = tokio::spawn(async move {
        let (mut conn, _) = proxy.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            conn.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap();
        let mut body = vec![0u8; length];
        conn.read_exact(&mut body).await.unwrap();
        let answer = json!({"id": "chatcmpl-proxied", "object": "chat.completion", "created": 1, "model": "gpt-4o",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "via the proxy"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})
        .to_string();
        let reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
            answer.len()
        );
        conn.write_all(reply.as_bytes()).await.unwrap();
        head.lines().next().unwrap().to_owned()
    });
    let dir = TempDir::new("backstop-proxied");
    let port = free_port();
    let config = dir.0.join("backstop.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ndrain_delay = \"0s\"\n[store]\npath = \":memory:\"\n[retry]\nmax_attempts = 1\n[[upstreams]]\nname = \"m\"\napi = \"openai\"\nbase_url = \"http://127.0.0.1:{upstream_port}\"\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"m\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-proxied\"]\n"
        ),
    )
    .unwrap();
    let proxy_env = format!("HTTP_PROXY=http://127.0.0.1:{proxy_port}");
    let binary = Binary::start_under(
        &["env", &proxy_env],
        &config,
        port,
        std::process::Stdio::null(),
    )
    .await;
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", binary.url))
        .bearer_auth("bk-proxied")
        .header("content-type", "application/json")
        .body(
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "via the proxy");
    let request_line = seen.await.unwrap();
    assert_eq!(
        request_line,
        format!("POST http://127.0.0.1:{upstream_port}/v1/chat/completions HTTP/1.1")
    );
}
