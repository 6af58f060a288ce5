//! Amazon Bedrock's InvokeModel for Anthropic's models, as strict as the real one:
//! `POST /model/{model id}/invoke` and `/invoke-with-response-stream`.
//!
//! - Every call must carry a valid SigV4 signature for service `bedrock`: the mock
//!   re-signs the request it received (the headers its `SignedHeaders` names, the body,
//!   the `x-amz-date`) with the secret of the access key it names and compares. It knows
//!   two identities: long-term keys ([`ACCESS_KEY_ID`]) and session credentials
//!   ([`SESSION_ACCESS_KEY_ID`], valid only with [`SESSION_TOKEN`] in
//!   `x-amz-security-token`). An unknown key or a missing or wrong token is 403
//!   `UnrecognizedClientException`, a wrong signature 403 `InvalidSignatureException`, a
//!   date more than five minutes off 403 `InvalidSignatureException` (expired), as AWS
//!   answers.
//! - The body is Anthropic's without `model` and `stream` and with
//!   `anthropic_version: "bedrock-2023-05-31"`; `model`, `stream` or another version is
//!   400 `ValidationException`. The rest is checked as the strict mock checks Anthropic's
//!   Messages (always: Bedrock is never lenient).
//! - Scripted errors (`status=`) answer in Bedrock's shape: `{"message"}`, the exception
//!   in `x-amzn-ErrorType` (`code=ThrottlingException`, else the status's usual one).
//!   `exception=NAME` ends a stream with that exception frame after `cut` events (one by
//!   default), as Bedrock reports a failure in mid-stream.
//! - Answers are the mock's Anthropic answers; streams are framed as AWS event-stream
//!   `chunk` events carrying each Anthropic event, base64 in `{"bytes"}`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{header, HeaderMap, Response, StatusCode};
use serde_json::{json, Value};

use super::{responses, strict, FaultStep};
use crate::wire::{eventstream, sse::Splitter};

/// The long-term access key the mock's Bedrock accepts, with [`SECRET_ACCESS_KEY`].
pub const ACCESS_KEY_ID: &str = "AKIAMOCKBEDROCK00001";
pub const SECRET_ACCESS_KEY: &str = "mock/Bedrock+Secret/Access/Key0000000001";
/// The session credentials it accepts: only with [`SESSION_TOKEN`].
pub const SESSION_ACCESS_KEY_ID: &str = "ASIAMOCKBEDROCK00002";
pub const SESSION_SECRET_ACCESS_KEY: &str = "mock/Bedrock+Session/Secret/Key000000002";
pub const SESSION_TOKEN: &str = "IQoJb3JpZ2luX2VjEMOCKSESSIONTOKEN//////////wEaCXVzLWVhc3QtMQ==";

/// The `x-amzn-requestid` of every answer.
pub const REQUEST_ID: &str = "00000000-mock-bedr-ock0-000000000000";

/// The anthropic_version InvokeModel accepts.
const VERSION: &str = "bedrock-2023-05-31";

/// An InvokeModel call: the model id (decoded) and whether it streams.
pub(super) struct Invoke {
    pub model: String,
    pub stream: bool,
}

/// The InvokeModel call a path asks for, if it is one.
pub(super) fn route(path: &str) -> Option<Invoke> {
    let rest = path.strip_prefix("/model/")?;
    let (id, action) = rest.rsplit_once('/')?;
    let stream = match action {
        "invoke" => false,
        "invoke-with-response-stream" => true,
        _ => return None,
    };
    let model = percent_encoding::percent_decode_str(id)
        .decode_utf8()
        .ok()?
        .into_owned();
    Some(Invoke { model, stream })
}

/// Bedrock's error answer: `{"message"}` with the exception named in `x-amzn-ErrorType`.
pub(super) fn error(status: u16, exception: &str, message: &str) -> Response<Body> {
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .header(
            "x-amzn-errortype",
            format!("{exception}:http://internal.amazon.com/coral/com.amazon.bedrock/"),
        )
        .header("x-amzn-requestid", REQUEST_ID)
        .body(Body::from(json!({ "message": message }).to_string()))
        .expect("valid response parts")
}

/// The exception Bedrock answers a status with, by default.
fn exception_for(status: u16) -> &'static str {
    match status {
        400 => "ValidationException",
        403 => "AccessDeniedException",
        404 => "ResourceNotFoundException",
        408 => "ModelTimeoutException",
        424 => "ModelErrorException",
        429 => "ThrottlingException",
        503 => "ServiceUnavailableException",
        _ => "InternalServerException",
    }
}

/// A scripted error, in Bedrock's shape.
pub(super) fn scripted_error(status: u16, step: &FaultStep) -> Response<Body> {
    let exception = step
        .code
        .as_deref()
        .unwrap_or_else(|| exception_for(status));
    error(
        status,
        exception,
        &format!("mock Bedrock fault: status {status} ({exception})"),
    )
}

/// Why AWS refuses a call's signature: its 403's exception and message.
pub(super) struct Refused(&'static str, &'static str);

impl Refused {
    pub(super) fn response(&self) -> Response<Body> {
        error(403, self.0, self.1)
    }
}

/// Checks the call's SigV4 signature; `Err` is AWS's 403.
pub(super) fn verify(
    headers: &HeaderMap,
    path_and_query: &str,
    body: &[u8],
) -> Result<(), Refused> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let unrecognized = || {
        Refused(
            "UnrecognizedClientException",
            "The security token included in the request is invalid.",
        )
    };
    let mismatch = || {
        Refused("InvalidSignatureException", "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.")
    };
    let Some(authorization) = text("authorization") else {
        return Err(Refused(
            "MissingAuthenticationTokenException",
            "Missing Authentication Token",
        ));
    };
    let fields = authorization
        .strip_prefix("AWS4-HMAC-SHA256 ")
        .map(|rest| {
            rest.split(", ")
                .filter_map(|kv| kv.split_once('='))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let field = |name: &str| fields.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let (Some(credential), Some(signed_headers), Some(_)) = (
        field("Credential"),
        field("SignedHeaders"),
        field("Signature"),
    ) else {
        return Err(Refused("IncompleteSignatureException", "Authorization header requires 'Credential', 'Signature' and 'SignedHeaders' parameters."));
    };
    let scope: Vec<&str> = credential.split('/').collect();
    let [key_id, date, region, service, "aws4_request"] = scope[..] else {
        return Err(mismatch());
    };
    let secret = match key_id {
        ACCESS_KEY_ID => SECRET_ACCESS_KEY,
        SESSION_ACCESS_KEY_ID if text("x-amz-security-token") == Some(SESSION_TOKEN) => {
            SESSION_SECRET_ACCESS_KEY
        }
        _ => return Err(unrecognized()),
    };
    if key_id == ACCESS_KEY_ID && headers.contains_key("x-amz-security-token") {
        return Err(unrecognized());
    }
    let Some(signed_at) = text("x-amz-date").and_then(parse_amz_date) else {
        return Err(mismatch());
    };
    let skew = SystemTime::now()
        .duration_since(signed_at)
        .unwrap_or_else(|e| e.duration());
    if skew > Duration::from_secs(300) {
        return Err(Refused("InvalidSignatureException", "Signature expired: the request's x-amz-date is more than 5 minutes from the server's time."));
    }
    if service != "bedrock" || !text("x-amz-date").is_some_and(|d| d.starts_with(date)) {
        return Err(mismatch());
    }
    let names: Vec<&str> = signed_headers.split(';').collect();
    if !names.contains(&"host") || !names.contains(&"x-amz-date") {
        return Err(mismatch());
    }
    // Re-sign what came: the headers it says it signed (the signer adds host, date and
    // token itself), its path and query, its body, at its time.
    let host = text("host").unwrap_or_default();
    let url = format!("http://{host}{path_and_query}");
    let own: Vec<(&str, &str)> = names
        .iter()
        .filter(|n| !matches!(**n, "host" | "x-amz-date" | "x-amz-security-token"))
        .map(|n| (*n, text(n).unwrap_or_default()))
        .collect();
    let token = text("x-amz-security-token").map(str::to_string);
    let credentials = aws_credential_types::Credentials::new(key_id, secret, token, None, "mock");
    let identity: aws_smithy_runtime_api::client::identity::Identity = credentials.into();
    let expected = (|| {
        use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
        let params = aws_sigv4::sign::v4::SigningParams::builder()
            .identity(&identity)
            .region(region)
            .name("bedrock")
            .time(signed_at)
            .settings(SigningSettings::default())
            .build()
            .ok()?
            .into();
        let signable =
            SignableRequest::new("POST", &url, own.into_iter(), SignableBody::Bytes(body)).ok()?;
        let (instructions, _) = sign(signable, &params).ok()?.into_parts();
        let authorization = instructions
            .headers()
            .find(|(name, _)| name.eq_ignore_ascii_case("authorization"))
            .map(|(_, value)| value.to_string());
        authorization
    })();
    if expected.as_deref() != Some(authorization) {
        return Err(mismatch());
    }
    Ok(())
}

/// `20251207T101500Z` as a time.
fn parse_amz_date(text: &str) -> Option<SystemTime> {
    let b = text.as_bytes();
    if b.len() != 16 || b[8] != b'T' || b[15] != b'Z' {
        return None;
    }
    let num = |range: std::ops::Range<usize>| text.get(range)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (hh, mm, ss) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// The answer to a signed InvokeModel call whose scripted step is not an error.
pub(super) fn answer(invoke: &Invoke, request: &Value, step: &FaultStep) -> Response<Body> {
    let Some(body) = request.as_object() else {
        return error(
            400,
            "ValidationException",
            "Malformed input request, please reformat your input and try again.",
        );
    };
    for key in ["model", "stream"] {
        if body.contains_key(key) {
            return error(400, "ValidationException", &format!("Malformed input request: #: extraneous key [{key}] is not permitted, please reformat your input and try again."));
        }
    }
    match body.get("anthropic_version").and_then(Value::as_str) {
        Some(VERSION) => {}
        Some(_) => return error(400, "ValidationException", "Malformed input request: #/anthropic_version: invalid, please reformat your input and try again."),
        None => return error(400, "ValidationException", "Malformed input request: #: required key [anthropic_version] not found, please reformat your input and try again."),
    }
    // Anthropic's own checks, on the body Anthropic's API would have had.
    let mut messages = body.clone();
    messages.remove("anthropic_version");
    messages.remove("anthropic_beta");
    messages.insert("model".into(), Value::String(invoke.model.clone()));
    if let Err(refusal) = strict::anthropic_messages(&Value::Object(messages.clone())) {
        return error(400, "ValidationException", &refusal.message);
    }
    if invoke.stream {
        messages.insert("stream".into(), Value::Bool(true));
    }
    let messages = Value::Object(messages);
    if !invoke.stream {
        let mut response = responses::completion(responses::Api::Anthropic, &messages, step);
        response.headers_mut().insert(
            "x-amzn-requestid",
            http::HeaderValue::from_static(REQUEST_ID),
        );
        return response;
    }
    // The mid-stream exception replaces the cut.
    let mut inner = step.clone();
    let exception = inner
        .exception
        .take()
        .map(|name| (name, inner.cut.take().unwrap_or(1)));
    let sse = responses::completion(responses::Api::Anthropic, &messages, &inner);
    framed(sse, exception)
}

/// An Anthropic SSE answer as Bedrock's event-stream: one `chunk` frame per event; with
/// `exception`, that exception frame after that many events, and the end.
fn framed(sse: Response<Body>, exception: Option<(String, usize)>) -> Response<Body> {
    let (parts, body) = sse.into_parts();
    if !parts.status.is_success() {
        return Response::from_parts(parts, body);
    }
    let mut splitter = Splitter::default();
    let mut sent = 0usize;
    let mut ended = false;
    let frames = body.into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(std::io::Error::other)?;
        let mut out = BytesMut::new();
        for event in splitter.push(&chunk) {
            if ended {
                break;
            }
            let Some(data) = data_of(&event.raw) else {
                continue;
            };
            if let Some((name, after)) = &exception {
                if sent >= *after {
                    out.extend_from_slice(&eventstream::exception_frame(
                        name,
                        "The model stream was interrupted (mock Bedrock).",
                    ));
                    ended = true;
                    break;
                }
            }
            out.extend_from_slice(&eventstream::chunk_frame(data.as_bytes()));
            sent += 1;
        }
        Ok::<Bytes, std::io::Error>(out.freeze())
    });
    let mut response = Response::new(Body::from_stream(frames));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/vnd.amazon.eventstream"),
    );
    response.headers_mut().insert(
        "x-amzn-requestid",
        http::HeaderValue::from_static(REQUEST_ID),
    );
    response
}

/// The `data:` of one SSE event, as it was written.
fn data_of(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect();
    (!data.is_empty()).then(|| data.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amz_dates_read_as_aws_writes_them() {
        assert_eq!(
            parse_amz_date("20150830T123600Z"),
            Some(UNIX_EPOCH + Duration::from_secs(1_440_938_160))
        );
        assert_eq!(parse_amz_date("2015-08-30T12:36:00Z"), None);
        assert_eq!(parse_amz_date("20151330T123600Z"), None);
    }

    #[test]
    fn invoke_paths_decode_the_model_id() {
        let invoke = route(
            "/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke-with-response-stream",
        )
        .unwrap();
        assert_eq!(invoke.model, "us.anthropic.claude-3-5-haiku-20241022-v1:0");
        assert!(invoke.stream);
        assert!(route("/model/x/converse").is_none());
        assert!(route("/v1/messages").is_none());
    }
}
