//! Issue 24 item 5: what a request body may cost in memory is bounded and accounted.
//! Item limits refuse a body before it is parsed (400 `too_many_items` naming the limit
//! and the parameter); large bodies share a budget of bytes in flight, and one that
//! finds no room in time is refused with 503 `overloaded` and `Retry-After`. Real
//! sockets, the real gateway, the real mock.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

fn messages(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect()
}

#[tokio::test]
async fn a_body_over_an_item_limit_is_refused_naming_the_limit_in_both_shapes() {
    let gw = start_with(server_keys(
        "max_messages = 3\nmax_content_parts = 2\nmax_json_values = 60",
    ))
    .await;
    let post = |path: &'static str, key: &'static str, body: Value| {
        let gw = &gw;
        async move {
            gw.post(
                path,
                Some(key),
                &[("x-mock-scenario", "items")],
                body.to_string(),
            )
            .await
        }
    };

    // At the limit: served.
    let resp = post(
        "/v1/chat/completions",
        KEY_A,
        json!({"model": "gpt-4o", "messages": messages(3)}),
    )
    .await;
    assert_eq!(resp.status(), 200);

    let over = [
        (
            json!({"model": "gpt-4o", "messages": messages(4)}),
            Some("messages"),
            "items in `messages`: 4, over the limit of 3 (`server.max_messages`)",
        ),
        (
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": [{"type": "text", "text": "c"}]}]}),
            Some("messages[].content"),
            "content parts in `messages`: 3, over the limit of 2 (`server.max_content_parts`)",
        ),
        (
            json!({"model": "gpt-4o", "messages": messages(1), "metadata": {"x": vec![1; 60]}}),
            None,
            "(`server.max_json_values`)",
        ),
    ];
    for (body, param, message) in over {
        let resp = post("/v1/chat/completions", KEY_A, body).await;
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.headers()["x-should-retry"], "false");
        let err = json(resp).await;
        assert_eq!(err["error"]["code"], "too_many_items", "{err}");
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert_eq!(err["error"]["param"].as_str(), param, "{err}");
        let text = err["error"]["message"].as_str().unwrap();
        assert!(text.ends_with(message), "{text}");
    }

    // The Anthropic shape, on /v1/messages.
    let resp = post(
        "/v1/messages",
        KEY_B,
        json!({"model": "claude-3", "max_tokens": 16, "messages": messages(4)}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let err = json(resp).await;
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`server.max_messages`"));
    // Refused before any upstream call: only the one at the limit reached the mock.
    assert_eq!(gw.mock.attempts("items"), 1);
}

/// A request head for `/v1/chat/completions` announcing `len` bytes of body.
fn head(len: usize) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: backstop\r\nauthorization: Bearer {KEY_A}\r\n\
         content-type: application/json\r\nconnection: close\r\ncontent-length: {len}\r\n\r\n"
    )
}

/// A chat body of exactly `len` bytes (one long message).
fn chat_body(len: usize) -> String {
    let frame = r#"{"model":"gpt-4o","messages":[{"role":"user","content":""}]}"#;
    let pad = "x".repeat(len - frame.len());
    format!(r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{pad}"}}]}}"#)
}

/// The bytes the body pool holds, from `/metrics`.
async fn body_pool_bytes(gw: &Gateway) -> f64 {
    let text = gw.metrics().await;
    text.lines()
        .find(|l| l.starts_with(r#"backstop_body_memory_bytes{pool="body"}"#))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_large_body_that_finds_the_budget_full_waits_then_gets_503_overloaded() {
    const MIB: usize = 1024 * 1024;
    let gw = start_with(|c| {
        server_keys("max_body_bytes_in_flight = 2097152\nin_flight_wait = \"200ms\"")(c)
            .set("server.max_body_bytes", 4194304)
    })
    .await;
    let addr = gw.url.trim_start_matches("http://").to_string();

    // A slow client: 1.9 MiB announced, a little sent, then nothing for now. It holds
    // the whole body budget but one tenth of a MiB.
    let first_len = 19 * MIB / 10;
    let first_body = chat_body(first_len);
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    slow.write_all(head(first_len).as_bytes()).await.unwrap();
    slow.write_all(&first_body.as_bytes()[..1000])
        .await
        .unwrap();
    for _ in 0..200 {
        if body_pool_bytes(&gw).await > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(body_pool_bytes(&gw).await >= first_len as f64);

    // Another large body does not fit: it is refused before its body is read.
    let mut refused = TcpStream::connect(&addr).await.unwrap();
    refused
        .write_all(head(MIB + MIB / 2).as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), refused.read_to_end(&mut answer))
        .await
        .expect("the refusal comes within in_flight_wait")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    let (head_text, body_text) = answer.split_once("\r\n\r\n").unwrap();
    let head_text = head_text.to_ascii_lowercase();
    assert!(head_text.starts_with("http/1.1 503 "), "{head_text}");
    assert!(head_text.contains("\r\nretry-after: 1\r\n"), "{head_text}");
    assert!(
        head_text.contains("\r\nx-should-retry: false\r\n"),
        "{head_text}"
    );
    let err: Value = serde_json::from_str(body_text).unwrap();
    assert_eq!(err["error"]["code"], "overloaded", "{err}");
    assert_eq!(err["error"]["type"], "server_error");

    // Small requests never touch the budget.
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            json!({"model": "gpt-4o", "messages": messages(1)}).to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);

    // The slow body arrives in full and is served; its charge is given back.
    slow.write_all(&first_body.as_bytes()[1000..])
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200 "),
        "{}",
        String::from_utf8_lossy(&answer[..200.min(answer.len())])
    );
    for _ in 0..200 {
        if body_pool_bytes(&gw).await == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(body_pool_bytes(&gw).await, 0.0);
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[],
            chat_body(MIB + MIB / 2),
        )
        .await;
    assert_eq!(resp.status(), 200);
}
