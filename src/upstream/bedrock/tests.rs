use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;

use super::*;

/// AWS's published signing test suite (shipped in the `aws-sigv4` crate as
/// `aws-signing-test-suite/v4/`): its example keys, region, service and time.
fn example_credentials(token: Option<&str>) -> AwsCredentials {
    AwsCredentials::new(
        "AKIDEXAMPLE",
        "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        token.map(str::to_string),
        None,
        "test",
    )
}

/// 2015-08-30T12:36:00Z, the suite's timestamp.
fn suite_time() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_440_938_160)
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers[name].to_str().unwrap().to_string()
}

#[test]
fn the_published_sigv4_vectors_sign_as_aws_says() {
    // post-vanilla: POST / with no body and no headers but the host.
    let url = reqwest::Url::parse("https://example.amazonaws.com/").unwrap();
    let mut headers = HeaderMap::new();
    sign_for(
        "POST",
        "service",
        &example_credentials(None),
        "us-east-1",
        &url,
        &mut headers,
        b"",
        suite_time(),
    )
    .unwrap();
    assert_eq!(header(&headers, "x-amz-date"), "20150830T123600Z");
    assert_eq!(
        header(&headers, "authorization"),
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date, Signature=5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"
    );
    assert!(!headers.contains_key("x-amz-security-token"));

    // get-vanilla-with-session-token: the token is sent and signed.
    let token = "6e86291e8372ff2a2260956d9b8aae1d763fbf315fa00fa31553b73ebf194267";
    let mut headers = HeaderMap::new();
    sign_for(
        "GET",
        "service",
        &example_credentials(Some(token)),
        "us-east-1",
        &url,
        &mut headers,
        b"",
        suite_time(),
    )
    .unwrap();
    assert_eq!(header(&headers, "x-amz-security-token"), token);
    assert_eq!(
        header(&headers, "authorization"),
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, SignedHeaders=host;x-amz-date;x-amz-security-token, Signature=07ec1639c89043aa0e3e2de82b96708f198cceab042d4a97044c66dd9f74e7f8"
    );
    assert!(headers["authorization"].is_sensitive());
}

/// A Bedrock InvokeModel call: service `bedrock`, the content type signed, the model id's
/// `:` sent as `%3A` (and so `%253A` in the canonical request, as the SDK signs it).
/// The expected signature is the one the AWS SDK's settings produce for this request.
#[test]
fn a_bedrock_call_signs_its_content_type_and_encoded_model_id() {
    let url = reqwest::Url::parse(
        "https://bedrock-runtime.us-east-1.amazonaws.com/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/invoke",
    )
    .unwrap();
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    sign(
        &example_credentials(None),
        "us-east-1",
        &url,
        &mut headers,
        b"{}",
        suite_time(),
    )
    .unwrap();
    assert_eq!(
        header(&headers, "authorization"),
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/bedrock/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature=aa1d7e64cb02f9da71e93634b2532c07b3a7779b9ae525f7fea9bea275c0b86b"
    );
    // Another body is another signature.
    let mut other = HeaderMap::new();
    other.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    sign(
        &example_credentials(None),
        "us-east-1",
        &url,
        &mut other,
        b"{ }",
        suite_time(),
    )
    .unwrap();
    assert_ne!(other["authorization"], headers["authorization"]);
}

#[test]
fn the_invoke_body_drops_model_and_stream_and_names_bedrocks_version() {
    let json = json!({"model": "claude", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let body = invoke_body(
        json.as_object().unwrap(),
        Some(&HeaderValue::from_static("a-2025, b-2025")),
    );
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body,
        json!({"anthropic_version": "bedrock-2023-05-31", "anthropic_beta": ["a-2025", "b-2025"], "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    );
    // A client's own version is kept.
    let json = json!({"anthropic_version": "bedrock-2099-01-01", "max_tokens": 8, "messages": []});
    let body: Value =
        serde_json::from_slice(&invoke_body(json.as_object().unwrap(), None)).unwrap();
    assert_eq!(body["anthropic_version"], "bedrock-2099-01-01");
    assert!(body.get("anthropic_beta").is_none());
}

fn bedrock_error(status: u16, exception: &str, message: &str) -> (u16, Value) {
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-amzn-errortype",
        HeaderValue::from_str(&format!(
            "{exception}:http://internal.amazon.com/coral/com.amazon.bedrock/"
        ))
        .unwrap(),
    );
    let body = json!({"message": message}).to_string();
    let (status, body) = error_answer(
        StatusCode::from_u16(status).unwrap(),
        &headers,
        body.as_bytes(),
    );
    (status.as_u16(), serde_json::from_slice(&body).unwrap())
}

/// Each exception the issue names, in the class it must land in.
#[test]
fn bedrocks_exceptions_map_into_the_taxonomy() {
    use crate::policy::classify::{classify, Class, Observed, RetryHints};
    let class = |status: u16, exception: &str| {
        let (status, body) = bedrock_error(status, exception, "m");
        let body = body.to_string();
        classify(
            Observed::Response {
                status,
                hints: RetryHints::default(),
                body: body.as_bytes(),
                readable: false,
            },
            SystemTime::now(),
        )
    };
    let transient = |rate_limited| Class::Transient {
        retry_after: None,
        rate_limited,
    };
    let table = [
        (429, "ThrottlingException", transient(true)),
        (503, "ServiceUnavailableException", transient(false)),
        (408, "ModelTimeoutException", transient(false)),
        (429, "ModelNotReadyException", transient(true)),
        (424, "ModelStreamErrorException", transient(false)),
        (424, "ModelErrorException", transient(false)),
        (500, "InternalServerException", transient(false)),
        (
            400,
            "ServiceQuotaExceededException",
            Class::CredentialOrQuota,
        ),
        (403, "AccessDeniedException", Class::CredentialOrQuota),
        (403, "UnrecognizedClientException", Class::CredentialOrQuota),
        (403, "InvalidSignatureException", Class::CredentialOrQuota),
        (
            400,
            "ValidationException",
            Class::CallerFault {
                context_length: false,
            },
        ),
        (
            404,
            "ResourceNotFoundException",
            Class::CallerFault {
                context_length: false,
            },
        ),
    ];
    for (status, exception, expected) in table {
        assert_eq!(class(status, exception), expected, "{exception}");
    }
    // Bedrock's own words for a prompt over the window: the context-length class.
    let (status, body) = bedrock_error(
        400,
        "ValidationException",
        "prompt is too long: 212345 tokens > 200000 maximum",
    );
    assert_eq!(status, 400);
    let body = body.to_string();
    assert_eq!(
        classify(
            Observed::Response {
                status,
                hints: RetryHints::default(),
                body: body.as_bytes(),
                readable: false
            },
            SystemTime::now()
        ),
        Class::CallerFault {
            context_length: true
        }
    );
}

#[test]
fn a_bedrock_error_becomes_anthropics_with_bedrocks_message() {
    let (status, body) = bedrock_error(
        400,
        "ValidationException",
        "messages.0.content: Field required",
    );
    assert_eq!(status, 400);
    assert_eq!(
        body,
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "messages.0.content: Field required"}})
    );
    // The type may come in the body only (`__type`), the message capitalised.
    let (status, body) = error_answer(
        StatusCode::BAD_REQUEST,
        &HeaderMap::new(),
        br#"{"__type":"com.amazon.bedrock#ThrottlingException","Message":"slow down"}"#,
    );
    assert_eq!(status, 429);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body["error"],
        json!({"type": "rate_limit_error", "message": "slow down"})
    );
    // Neither: the status decides, and the message says what came.
    let (status, body) = error_answer(StatusCode::BAD_GATEWAY, &HeaderMap::new(), b"<html>");
    assert_eq!(status, 502);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        body["error"]["message"],
        "Amazon Bedrock answered 502 without a message"
    );
}

#[tokio::test]
async fn explicit_keys_are_used_as_a_set() {
    let config: UpstreamConfig = toml::from_str(
        "name = \"b\"\napi = \"bedrock\"\nregion = \"us-west-2\"\naccess_key_id = \"AKIDCONFIG\"\nsecret_access_key = \"s3cret\"\n",
    )
    .unwrap();
    let bedrock = Bedrock::new(&config).unwrap();
    let creds = bedrock.credentials().await.unwrap();
    assert_eq!(creds.access_key_id(), "AKIDCONFIG");
    assert_eq!(
        creds.session_token(),
        None,
        "a session token only when session_token is given"
    );
    assert!(!format!("{bedrock:?}").contains("s3cret"));
}
