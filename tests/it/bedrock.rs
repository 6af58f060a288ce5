//! Amazon Bedrock as an upstream kind (`api = "bedrock"`): the built-in mock plays
//! Bedrock's InvokeModel and checks every call's SigV4 signature, so a call it answers
//! was signed right. What it received is asserted as sent.

use crate::common::*;
use backstop::mock::bedrock::{
    ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_ACCESS_KEY_ID, SESSION_SECRET_ACCESS_KEY,
    SESSION_TOKEN,
};
use serde_json::{json, Value};

const SONNET: &str = "anthropic.claude-sonnet-4-5-20250929-v1:0";
const HAIKU_PROFILE: &str = "us.anthropic.claude-3-5-haiku-20241022-v1:0";

/// Three Bedrock upstreams in front of the mock: long-term keys, session credentials,
/// and a wrong secret; routes to each, and one that falls back to Anthropic.
fn bedrock(config: TestConfig) -> TestConfig {
    let mock = config.str_at("upstreams.mock-openai.base_url");
    config.merge(&format!(
        r#"
[[upstreams]]
name = "bedrock"
api = "bedrock"
region = "us-east-1"
base_url = "{mock}"
access_key_id = "{ACCESS_KEY_ID}"
secret_access_key = "{SECRET_ACCESS_KEY}"
forward_headers = ["x-mock-*"]
attempt_timeout = "5s"

[[upstreams]]
name = "bedrock-session"
api = "bedrock"
region = "us-west-2"
base_url = "{mock}"
access_key_id = "{SESSION_ACCESS_KEY_ID}"
secret_access_key = "{SESSION_SECRET_ACCESS_KEY}"
session_token = "{SESSION_TOKEN}"
forward_headers = ["x-mock-*"]
attempt_timeout = "5s"

[[upstreams]]
name = "bedrock-wrong"
api = "bedrock"
region = "us-east-1"
base_url = "{mock}"
access_key_id = "{ACCESS_KEY_ID}"
secret_access_key = "not-the-secret"
forward_headers = ["x-mock-*"]
attempt_timeout = "5s"

[[upstreams]]
name = "bedrock-chain"
api = "bedrock"
region = "us-east-1"
base_url = "{mock}"
forward_headers = ["x-mock-*"]
attempt_timeout = "5s"

[[routes]]
model = "br-chain"
targets = [{{ upstream = "bedrock-chain", model = "{SONNET}" }}]

[[routes]]
model = "br-sonnet"
targets = [{{ upstream = "bedrock", model = "{SONNET}", max_tokens = 256 }}]

[[routes]]
model = "br-haiku"
targets = [{{ upstream = "bedrock-session", model = "{HAIKU_PROFILE}" }}]

[[routes]]
model = "br-wrong"
targets = [{{ upstream = "bedrock-wrong", model = "{SONNET}" }}]

[[routes]]
model = "amazon.*"
targets = [{{ upstream = "bedrock" }}]

[[routes]]
model = "br-then-anthropic"
targets = [{{ upstream = "bedrock", model = "{SONNET}" }}, {{ upstream = "mock-anthropic", model = "claude-sonnet-4-5" }}]
"#
    ))
}

fn messages(model: &str, stream: bool) -> String {
    json!({"model": model, "max_tokens": 64, "stream": stream,
           "messages": [{"role": "user", "content": "hello"}]})
    .to_string()
}

async fn send_messages(
    gw: &Gateway,
    scenario: &str,
    fault: &str,
    body: String,
) -> reqwest::Response {
    let mut headers = vec![
        ("x-mock-scenario", scenario),
        ("anthropic-version", "2023-06-01"),
    ];
    if !fault.is_empty() {
        headers.push(("x-mock-fault", fault));
    }
    gw.post("/v1/messages", Some(KEY_A), &headers, body).await
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn an_anthropic_call_goes_to_invoke_model_signed_without_model_or_stream() {
    let gw = start_with(bedrock).await;
    let mut headers = vec![
        ("x-mock-scenario", "br-whole"),
        ("anthropic-version", "2023-06-01"),
        ("anthropic-beta", "context-1m-2025-08-07"),
    ];
    headers.push(("x-mock-fault", "usage=12/5"));
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &headers,
            messages("br-sonnet", false),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        header(&resp, "request-id"),
        "00000000-mock-bedr-ock0-000000000000"
    );
    let body = json(resp).await;
    assert_eq!(body["type"], "message");
    assert_eq!(body["content"][0]["text"], "mock: hello");
    assert_eq!(body["usage"]["input_tokens"], 12);

    let seen = gw.mock.last_request("br-whole").unwrap();
    assert_eq!(
        seen["path"],
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
    );
    assert_eq!(
        seen["body"],
        json!({"anthropic_version": "bedrock-2023-05-31", "anthropic_beta": ["context-1m-2025-08-07"],
               "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]})
    );
    let sent = &seen["headers"];
    let authorization = sent["authorization"].as_str().unwrap();
    assert!(
        authorization.starts_with(&format!("AWS4-HMAC-SHA256 Credential={ACCESS_KEY_ID}/"))
            && authorization.contains("/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature="),
        "{authorization}"
    );
    for absent in [
        "x-api-key",
        "anthropic-version",
        "anthropic-beta",
        "x-amz-security-token",
    ] {
        assert!(sent.get(absent).is_none(), "{absent} sent: {sent}");
    }
    assert!(!sent.to_string().contains(KEY_A) && !sent.to_string().contains(SECRET_ACCESS_KEY));
}

#[tokio::test]
async fn a_stream_comes_back_as_anthropics_events_from_the_event_stream() {
    let gw = start_with(bedrock).await;
    let resp = send_messages(&gw, "br-stream", "chunks=3", messages("br-sonnet", true)).await;
    assert_eq!(resp.status(), 200);
    assert!(header(&resp, "content-type").starts_with("text/event-stream"));
    let text = resp.text().await.unwrap();
    let kinds: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{text}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{text}");
    assert!(kinds.contains(&"content_block_delta"));
    let seen = gw.mock.last_request("br-stream").unwrap();
    assert_eq!(
        seen["path"],
        "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke-with-response-stream"
    );
    assert!(seen["body"].get("stream").is_none());
}

/// Session credentials: the token is sent (and signed); the region is the upstream's.
#[tokio::test]
async fn session_credentials_send_their_token_in_the_upstreams_region() {
    let gw = start_with(bedrock).await;
    let resp = send_messages(&gw, "br-session", "", messages("br-haiku", false)).await;
    assert_eq!(resp.status(), 200);
    let seen = gw.mock.last_request("br-session").unwrap();
    assert_eq!(
        seen["path"],
        "/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke"
    );
    assert_eq!(seen["headers"]["x-amz-security-token"], SESSION_TOKEN);
    let authorization = seen["headers"]["authorization"].as_str().unwrap();
    assert!(authorization.contains("/us-west-2/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date;x-amz-security-token,"), "{authorization}");
}

/// An OpenAI chat client reaches a Claude on Bedrock: translated to Messages and back.
#[tokio::test]
async fn a_chat_client_is_served_by_claude_on_bedrock() {
    let gw = start_with(bedrock).await;
    let resp = gw.chat("br-chat", "", chat("br-sonnet")).await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["content"], "mock: hello");
    let seen = gw.mock.last_request("br-chat").unwrap();
    assert_eq!(seen["body"]["anthropic_version"], "bedrock-2023-05-31");
    assert!(
        seen["body"]["max_tokens"].is_u64(),
        "translation gives Claude a max_tokens"
    );
}

/// A throttled call is retried with backoff: two attempts, the second answers.
#[tokio::test]
async fn throttling_is_retried() {
    let gw = start_with(bedrock).await;
    let resp = send_messages(
        &gw,
        "br-throttle",
        "status=429,ok",
        messages("br-sonnet", false),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(header(&resp, "x-backstop-recovery"), "retry:429,ok");
    assert_eq!(gw.mock.attempts("br-throttle"), 2);

    let resp = send_messages(
        &gw,
        "br-unavailable",
        "status=503,status=408;code=ModelTimeoutException,ok",
        messages("br-sonnet", false),
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.mock.attempts("br-unavailable"), 3);
}

/// A ValidationException is the caller's: never retried, answered in the caller's own
/// shape with Bedrock's message.
#[tokio::test]
async fn a_validation_exception_is_answered_in_the_callers_shape_and_not_retried() {
    let gw = start_with(bedrock).await;
    let fault = "status=400;code=ValidationException";
    let resp = send_messages(&gw, "br-invalid", fault, messages("br-sonnet", false)).await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(
        body["error"]["message"],
        "mock Bedrock fault: status 400 (ValidationException)"
    );
    assert_eq!(gw.mock.attempts("br-invalid"), 1);

    let resp = gw.chat("br-invalid-chat", fault, chat("br-sonnet")).await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(
        body["error"]["message"],
        "mock Bedrock fault: status 400 (ValidationException)"
    );
    assert_eq!(gw.mock.attempts("br-invalid-chat"), 1);
}

/// The real Bedrock refuses Anthropic's own fields in an InvokeModel body; the mock
/// does too, so this proves Backstop strips them (a request the mock refuses is 400).
#[tokio::test]
async fn the_mock_refuses_what_bedrock_refuses() {
    let mock = backstop::mock::spawn(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    let url = reqwest::Url::parse(&format!(
        "http://{}/model/{}/invoke",
        mock.addr, "anthropic.claude-x-v1%3A0"
    ))
    .unwrap();
    let send = |body: Value, secret: &'static str| {
        let url = url.clone();
        async move {
            let body = body.to_string();
            let mut headers = http::HeaderMap::new();
            headers.insert(
                "content-type",
                http::HeaderValue::from_static("application/json"),
            );
            let creds =
                aws_credential_types::Credentials::new(ACCESS_KEY_ID, secret, None, None, "t");
            backstop::upstream::bedrock::sign(
                &creds,
                "us-east-1",
                &url,
                &mut headers,
                body.as_bytes(),
                std::time::SystemTime::now(),
            )
            .unwrap();
            let resp = reqwest::Client::new()
                .post(url)
                .headers(headers)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let kind = resp
                .headers()
                .get("x-amzn-errortype")
                .map(|v| v.to_str().unwrap().split(':').next().unwrap().to_string());
            (status, kind)
        }
    };
    let ok = json!({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(send(ok.clone(), SECRET_ACCESS_KEY).await, (200, None));
    assert_eq!(
        send(ok.clone(), "wrong").await,
        (403, Some("InvalidSignatureException".into()))
    );
    for bad in [
        json!({"model": "m", "anthropic_version": "bedrock-2023-05-31", "max_tokens": 8, "messages": []}),
        json!({"stream": true, "anthropic_version": "bedrock-2023-05-31", "max_tokens": 8, "messages": []}),
        json!({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
        json!({"anthropic_version": "bedrock-2023-05-31", "messages": [{"role": "user", "content": "hi"}]}),
    ] {
        assert_eq!(
            send(bad.clone(), SECRET_ACCESS_KEY).await,
            (400, Some("ValidationException".into())),
            "{bad}"
        );
    }
    // Unsigned: AWS's missing token.
    let resp = reqwest::Client::new()
        .post(url)
        .body(ok.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    mock.shutdown();
}

/// A signature Bedrock refuses is the upstream's credentials: a clear 502 naming the
/// upstream's auth failure, after one attempt, never the caller's 401.
#[tokio::test]
async fn a_refused_signature_is_the_upstreams_auth_failure() {
    let gw = start_with(bedrock).await;
    let resp = send_messages(&gw, "br-wrong", "", messages("br-wrong", false)).await;
    assert_eq!(resp.status(), 502);
    let body = json(resp).await;
    assert_eq!(body["error"]["type"], "upstream_auth_failed", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bedrock-wrong"),
        "{body}"
    );
    assert!(!body.to_string().contains("not-the-secret"));
    assert_eq!(gw.mock.attempts("br-wrong"), 1);
}

/// A quota is not a blip: not retried on Bedrock, the next target answers.
#[tokio::test]
async fn a_service_quota_moves_on_to_the_next_target() {
    let gw = start_with(bedrock).await;
    let fault = "status=400;code=ServiceQuotaExceededException,ok";
    let resp = send_messages(&gw, "br-quota", fault, messages("br-then-anthropic", false)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(gw.mock.attempts("br-quota"), 2);
    let seen = gw.mock.last_request("br-quota").unwrap();
    assert_eq!(
        seen["path"], "/v1/messages",
        "the second attempt went to Anthropic"
    );
}

/// An exception frame in mid-stream ends the client's stream as a cut stream does:
/// with Anthropic's error event, no `message_stop`.
#[tokio::test]
async fn an_exception_in_mid_stream_ends_the_stream_with_an_error_event() {
    let gw = start_with(bedrock).await;
    let fault = "exception=modelStreamErrorException;cut=2";
    let resp = send_messages(&gw, "br-exception", fault, messages("br-sonnet", true)).await;
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.starts_with("event: message_start"), "{text}");
    assert!(text.contains("event: error"), "{text}");
    assert!(!text.contains("message_stop"), "{text}");
    assert_eq!(gw.mock.attempts("br-exception"), 1);
}

/// A Bedrock model that is not Anthropic's needs Converse: a target naming one is refused
/// at load (config tests); one a client names through a target without a `model` is
/// refused with a clear 400, the network untouched.
#[tokio::test]
async fn a_converse_model_is_refused_clearly() {
    let gw = start_with(bedrock).await;
    let resp = send_messages(&gw, "br-nova", "", messages("amazon.nova-pro-v1:0", false)).await;
    let status = resp.status();
    let text = resp.text().await.unwrap();
    assert_eq!(status, 400, "{text}");
    let resp_body: Value = serde_json::from_str(&text).unwrap();
    let body = resp_body;
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("Converse"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("br-nova"), 0);
}

/// No keys in the config and none in the standard chain (taken out of this process's
/// environment; profile files and instance metadata switched off): the call is not sent,
/// and the client reads the upstream's auth failure, not a 401 of its own.
#[tokio::test]
async fn no_credentials_from_the_chain_is_the_upstreams_auth_failure_without_a_call() {
    for (name, value) in [
        ("AWS_CONFIG_FILE", "/dev/null"),
        ("AWS_SHARED_CREDENTIALS_FILE", "/dev/null"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ] {
        // Read by no other test: the other Bedrock upstreams name their keys.
        std::env::set_var(name, value);
    }
    for name in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ] {
        std::env::remove_var(name);
    }
    let gw = start_with(bedrock).await;
    let resp = send_messages(&gw, "br-chain", "", messages("br-chain", false)).await;
    let status = resp.status();
    let body = json(resp).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["type"], "upstream_auth_failed", "{body}");
    // As for a provider refusing Backstop's key: the upstream's breaker is open now.
    let resp = send_messages(&gw, "br-chain", "", messages("br-chain", false)).await;
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    assert_eq!(gw.mock.attempts("br-chain"), 0);
}
