//! Amazon Bedrock at the leaf: what makes an InvokeModel call of an Anthropic model out
//! of a Messages request, and a Messages answer out of Bedrock's.
//!
//! Above the leaf a Claude on Bedrock is a Messages target like any other (translation,
//! validation, billing and streaming validation read Anthropic's JSON and events). Here:
//! - the body loses `model` and `stream` (the URL says both) and gains
//!   `anthropic_version: "bedrock-2023-05-31"`; a client's `anthropic-beta` header becomes
//!   the body's `anthropic_beta` list, as Bedrock reads it;
//! - the call is signed with SigV4 ([`sign`]) with credentials from the upstream's
//!   explicit keys or the standard AWS chain ([`Credentials`]);
//! - a streamed answer's binary event-stream is unframed into Anthropic's SSE
//!   ([`crate::wire::eventstream`]); an exception frame ends the stream as a cut connection does;
//! - an error answer (`{"message"}` with its type in `x-amzn-ErrorType`) becomes
//!   Anthropic's error, with the status that puts it in the right class of the taxonomy
//!   ([`error_answer`]).

use std::{sync::Arc, time::Duration};

use aws_credential_types::{provider::ProvideCredentials, Credentials as AwsCredentials};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Map, Value};

use super::{refresh::Refreshing, Fetched, ResponseLimits};
use crate::{config::UpstreamConfig, policy::classify::TransportFailure};

/// The `anthropic_version` InvokeModel requires for Anthropic's models.
pub const ANTHROPIC_VERSION: &str = "bedrock-2023-05-31";

/// The content type of Bedrock's streamed answers.
pub const EVENT_STREAM: &str = "application/vnd.amazon.eventstream";

/// One Bedrock upstream's signing state.
pub struct Bedrock {
    region: String,
    credentials: Credentials,
}

impl std::fmt::Debug for Bedrock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bedrock")
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// Where a Bedrock upstream's AWS credentials come from. One per Bedrock upstream, made
/// at load and never moved: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Credentials {
    /// `access_key_id`, `secret_access_key` (and `session_token`) from the config.
    Explicit(AwsCredentials),
    /// The standard chain (environment, shared profile, web identity, container and
    /// instance metadata), built on first use and cached until shortly before expiry.
    Chain {
        chain: tokio::sync::OnceCell<
            aws_config::default_provider::credentials::DefaultCredentialsChain,
        >,
        cache: Refreshing<AwsCredentials>,
        /// The last fetch that failed, and why: for [`CHAIN_RETRY`] the chain is not
        /// asked again (a missing instance metadata service costs seconds a call).
        failed: std::sync::Mutex<Option<(tokio::time::Instant, String)>>,
    },
}

/// How long fetching credentials from the chain may take (instance metadata that is not
/// there must not hold a request for the SDK's own minutes).
const CHAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a chain that found no credentials is not asked again.
const CHAIN_RETRY: Duration = Duration::from_secs(5);

impl Bedrock {
    /// `None` for an upstream that is not Bedrock's.
    pub fn new(config: &UpstreamConfig) -> Option<Arc<Bedrock>> {
        if config.api != crate::config::UpstreamApi::Bedrock {
            return None;
        }
        let credentials = match (&config.access_key_id, &config.secret_access_key) {
            (Some(id), Some(secret)) => Credentials::Explicit(AwsCredentials::new(
                id.expose(),
                secret.expose(),
                config
                    .session_token
                    .as_ref()
                    .map(|t| t.expose().to_string()),
                None,
                "backstop-config",
            )),
            _ => Credentials::Chain {
                chain: tokio::sync::OnceCell::new(),
                cache: Refreshing::default(),
                failed: std::sync::Mutex::new(None),
            },
        };
        Some(Arc::new(Bedrock {
            region: config.region.clone().unwrap_or_default(),
            credentials,
        }))
    }

    /// The credentials to sign with now. The error says why there are none (it names no
    /// secret: the chain's errors name sources, not values).
    pub async fn credentials(&self) -> Result<AwsCredentials, String> {
        match &self.credentials {
            Credentials::Explicit(creds) => Ok(creds.clone()),
            Credentials::Chain {
                chain,
                cache,
                failed,
            } => {
                let recent_failure = || {
                    let failed = failed.lock().unwrap_or_else(|e| e.into_inner());
                    failed
                        .as_ref()
                        .filter(|(at, _)| at.elapsed() < CHAIN_RETRY)
                        .map(|(_, why)| why.clone())
                };
                let remember = |why: &String| {
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some((tokio::time::Instant::now(), why.clone()));
                };
                cache
                    .get(|| async {
                        if let Some(why) = recent_failure() {
                            return Err(why);
                        }
                        let chain = chain
                            .get_or_init(|| async {
                                let http = aws_smithy_http_client::Builder::new()
                                    .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                                        aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
                                    ))
                                    .build_https();
                                let config = aws_config::provider_config::ProviderConfig::default()
                                    .with_http_client(http)
                                    .with_region(Some(aws_config::Region::new(self.region.clone())));
                                aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                                    .configure(config)
                                    .build()
                                    .await
                            })
                            .await;
                        let fetched = match tokio::time::timeout(CHAIN_TIMEOUT, chain.provide_credentials()).await {
                            Err(_) => Err(format!("the AWS credential chain did not answer within {CHAIN_TIMEOUT:?}")),
                            Ok(Err(err)) => Err(format!("the AWS credential chain found no credentials: {err}")),
                            Ok(Ok(credentials)) => Ok(credentials),
                        };
                        let fetched = fetched.inspect_err(remember)?;
                        let lifetime = fetched.expiry().map(|at| {
                            at.duration_since(std::time::SystemTime::now())
                                .unwrap_or(Duration::ZERO)
                        });
                        Ok((fetched, lifetime))
                    })
                    .await
            }
        }
    }

    /// Signs a POST of `body` to `url`: adds `x-amz-date`, `authorization` and, with a
    /// session token, `x-amz-security-token` to `headers`.
    pub fn sign(
        &self,
        credentials: &AwsCredentials,
        url: &reqwest::Url,
        headers: &mut HeaderMap,
        body: &[u8],
        time: std::time::SystemTime,
    ) -> Result<(), String> {
        sign(credentials, &self.region, url, headers, body, time)
    }
}

/// SigV4 for service `bedrock`, with the settings the AWS SDK uses for
/// `bedrock-runtime` (URI double-encoded and normalised, the body hashed, no
/// `x-amz-content-sha256` header). Only `content-type` (and the host, which the signer
/// takes from the URL) of the request's own headers is signed.
pub fn sign(
    credentials: &AwsCredentials,
    region: &str,
    url: &reqwest::Url,
    headers: &mut HeaderMap,
    body: &[u8],
    time: std::time::SystemTime,
) -> Result<(), String> {
    sign_for(
        "POST",
        "bedrock",
        credentials,
        region,
        url,
        headers,
        body,
        time,
    )
}

#[allow(clippy::too_many_arguments)]
fn sign_for(
    method: &str,
    service: &str,
    credentials: &AwsCredentials,
    region: &str,
    url: &reqwest::Url,
    headers: &mut HeaderMap,
    body: &[u8],
    time: std::time::SystemTime,
) -> Result<(), String> {
    use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
    let identity: aws_smithy_runtime_api::client::identity::Identity = credentials.clone().into();
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(service)
        .time(time)
        .settings(SigningSettings::default())
        .build()
        .map_err(|err| err.to_string())?
        .into();
    let signed: Vec<(&str, &str)> = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| ("content-type", ct))
        .into_iter()
        .collect();
    let signable = SignableRequest::new(
        method,
        url.as_str(),
        signed.into_iter(),
        SignableBody::Bytes(body),
    )
    .map_err(|err| err.to_string())?;
    let (instructions, _signature) = sign(signable, &params)
        .map_err(|err| err.to_string())?
        .into_parts();
    for (name, value) in instructions.headers() {
        let mut value = HeaderValue::from_str(value).map_err(|err| err.to_string())?;
        value.set_sensitive(true);
        headers.insert(
            http::HeaderName::from_bytes(name.as_bytes()).map_err(|err| err.to_string())?,
            value,
        );
    }
    Ok(())
}

/// The InvokeModel body of a Messages request: the client's fields but `model` and
/// `stream`, with `anthropic_version` (the client's, else Bedrock's) and the client's
/// `anthropic-beta` header as `anthropic_beta`.
pub fn invoke_body(json: &Map<String, Value>, beta: Option<&HeaderValue>) -> Bytes {
    let mut body: Map<String, Value> = json
        .iter()
        .filter(|(key, _)| !matches!(key.as_str(), "model" | "stream"))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    body.entry("anthropic_version")
        .or_insert_with(|| Value::String(ANTHROPIC_VERSION.into()));
    if let Some(beta) = beta.and_then(|v| v.to_str().ok()) {
        let flags: Vec<Value> = beta
            .split(',')
            .map(str::trim)
            .filter(|f| !f.is_empty())
            .map(|f| Value::String(f.into()))
            .collect();
        if !flags.is_empty() {
            body.entry("anthropic_beta").or_insert(Value::Array(flags));
        }
    }
    Bytes::from(serde_json::to_vec(&body).expect("a JSON map serialises"))
}

/// Bedrock's exception name in an error answer: `x-amzn-ErrorType`
/// (`ThrottlingException:http://internal.amazon.com/...`), else the body's `__type`
/// (`com.amazon.bedrock#ValidationException`).
fn exception_name(headers: &HeaderMap, body: &Value) -> Option<String> {
    let from_header = headers
        .get("x-amzn-errortype")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(':').next());
    let from_body = body
        .get("__type")
        .and_then(Value::as_str)
        .map(|t| t.rsplit('#').next().unwrap_or(t));
    from_header
        .or(from_body)
        .filter(|name| !name.is_empty())
        .map(str::to_string)
}

/// A Bedrock error answer as Anthropic's (status, body): the status and type put it in
/// the class PRODUCT.md's taxonomy gives Bedrock's exception, the message is Bedrock's.
/// - throttling (429), service unavailable (503), model timeout (408), model not ready
///   (429) and model stream/model errors (502) are transient;
/// - a service quota exceeded is a quota (429 `billing_error`): not retried, the next
///   target is tried;
/// - access denied, unrecognized client, bad or expired signatures are the upstream's
///   credentials (401/403);
/// - validation (400) and not-found (404) are the caller's.
pub fn error_answer(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> (StatusCode, Bytes) {
    let parsed: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let exception = exception_name(headers, &parsed);
    let message = ["message", "Message"]
        .iter()
        .find_map(|key| parsed.get(*key).and_then(Value::as_str))
        .map(str::to_string)
        .unwrap_or_else(|| {
            format!(
                "Amazon Bedrock answered {} {}",
                status.as_u16(),
                exception.as_deref().unwrap_or("without a message")
            )
        });
    let (status, kind) = match exception.as_deref() {
        Some("ThrottlingException" | "ModelNotReadyException") => (429, "rate_limit_error"),
        Some("ServiceUnavailableException") => (503, "overloaded_error"),
        Some("ModelTimeoutException") => (408, "timeout_error"),
        Some("ModelStreamErrorException" | "ModelErrorException") => (502, "api_error"),
        Some("InternalServerException") => (500, "api_error"),
        Some("ServiceQuotaExceededException") => (429, "billing_error"),
        Some("AccessDeniedException") => (403, "permission_error"),
        Some(
            "UnrecognizedClientException"
            | "InvalidSignatureException"
            | "IncompleteSignatureException"
            | "ExpiredTokenException"
            | "MissingAuthenticationTokenException",
        ) => (403, "authentication_error"),
        Some("ValidationException") => (400, "invalid_request_error"),
        Some("ResourceNotFoundException") => (404, "not_found_error"),
        _ => match status.as_u16() {
            429 => (429, "rate_limit_error"),
            401 => (401, "authentication_error"),
            403 => (403, "permission_error"),
            404 => (404, "not_found_error"),
            s @ 500..=599 => (s, "api_error"),
            s => (s, "invalid_request_error"),
        },
    };
    let body = serde_json::json!({
        "type": "error",
        "error": {"type": kind, "message": message},
    });
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
        Bytes::from(body.to_string()),
    )
}

/// Bedrock's answer as the relay and the classifier read Anthropic's: an event-stream
/// unframed into SSE, an error made Anthropic's ([`error_answer`]); Bedrock's request
/// id as `request-id`.
pub(crate) async fn answer(
    fetched: Fetched,
    limits: ResponseLimits,
) -> Result<Fetched, TransportFailure> {
    let Fetched {
        status,
        mut headers,
        content_length,
        chunks,
    } = fetched;
    if let Some(id) = headers.get("x-amzn-requestid").cloned() {
        headers.insert(http::HeaderName::from_static("request-id"), id);
    }
    if status.is_success() {
        let streamed = headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with(EVENT_STREAM));
        if !streamed {
            return Ok(Fetched {
                status,
                headers,
                content_length,
                chunks,
            });
        }
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.remove(http::header::CONTENT_LENGTH);
        return Ok(Fetched {
            status,
            headers,
            content_length: None,
            chunks: crate::wire::eventstream::unframe(chunks, limits.max_event_bytes),
        });
    }
    let raw = Fetched {
        status,
        headers: HeaderMap::new(),
        content_length,
        chunks,
    };
    let body = super::read_capped(raw, limits.max_response_bytes).await?;
    let (status, body) = error_answer(status, &headers, &body);
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.remove(http::header::CONTENT_LENGTH);
    Ok(Fetched {
        status,
        headers,
        content_length: Some(body.len() as u64),
        chunks: futures_util::StreamExt::boxed(futures_util::stream::once(async move { Ok(body) })),
    })
}

#[cfg(test)]
mod tests;
