//! The validate layer over a scripted recovery: what a call that expects structured
//! output is sent again (the validator's errors), how many attempts it takes, and what
//! the client is told; whole answers and streams (its streaming half).

use std::sync::Arc;

use backstop::{
    config::{ValidationConfig, ValidationMode},
    error::GatewayError,
    telemetry::RequestLog,
};
use serde_json::{json, Value};
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    body_bytes, body_json, chat_answer, chat_stream, header, refused, Canned, Kit, Scripted,
};

/// A chat `response_format` asking for `{"n": <integer>}`.
fn wants_n() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "answer", "strict": true, "schema": {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": false
    }}})
}

const INVALID: &str = r#"{"n":"not a number"}"#;
const VALID: &str = r#"{"n":1}"#;

#[tokio::test]
async fn a_call_that_expects_nothing_passes_through_unvalidated() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([Canned::ok(chat_answer("free text"))]);
    let log = Arc::new(RequestLog::default());
    let response = kit
        .validate()
        .layer(inner.clone())
        .oneshot(kit.call().log(log.clone()).build())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-backstop-validation"), None);
    assert_eq!(body_json(response).await, chat_answer("free text"));
    assert!(
        !inner.last().keep_answer,
        "nothing to validate, nothing kept"
    );
    // What recovery did is written into the request's record.
    assert_eq!(log.facts().recovery_header().as_deref(), Some("ok"));
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn an_invalid_answer_is_sent_back_with_the_validators_errors() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([
        Canned::ok(chat_answer(INVALID)),
        Canned::ok(chat_answer(VALID)),
    ]);
    let log = Arc::new(RequestLog::default());
    let response = kit
        .validate()
        .layer(inner.clone())
        .oneshot(
            kit.call()
                .field("response_format", wants_n())
                .log(log.clone())
                .build(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(&response, "x-backstop-validation"),
        Some("corrected")
    );
    assert_eq!(
        body_json(response).await["choices"][0]["message"]["content"],
        VALID
    );

    let [first, second] = <[_; 2]>::try_from(inner.received()).unwrap();
    assert!(first.keep_answer && second.keep_answer);
    assert_eq!((first.start, second.start), (Some(0), Some(0)));
    // The correction: the invalid answer as the assistant's turn, then the errors.
    let messages = second.body["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert_eq!(messages[1]["role"], "assistant");
    assert_eq!(messages[1]["content"], INVALID);
    let feedback = messages[2]["content"].as_str().unwrap();
    assert!(
        feedback.contains("did not match the required JSON schema") && feedback.contains("/n"),
        "{feedback}"
    );
    assert_eq!(
        log.facts().recovery_header().as_deref(),
        Some("ok,correct:schema,ok")
    );
}

#[tokio::test]
async fn corrections_exhausted_switch_to_the_next_target_then_fail() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([]).otherwise(Canned::ok(chat_answer(INVALID)));
    let layer = kit.validate_with(ValidationConfig {
        corrective_retries: 1,
        ..ValidationConfig::default()
    });
    let log = Arc::new(RequestLog::default());
    let err = layer
        .layer(inner.clone())
        .oneshot(
            kit.call()
                .model("two")
                .field("response_format", wants_n())
                .log(log.clone())
                .build(),
        )
        .await
        .unwrap_err();
    let GatewayError::OutputInvalid { attempts, errors } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(*attempts, 4);
    assert!(errors[0].starts_with("/n"), "{errors:?}");
    assert_eq!(refused(&err), (502, "output_invalid"));
    // One correction on each target, the strategy switch between.
    let starts: Vec<_> = inner.received().iter().map(|r| r.start).collect();
    assert_eq!(starts, [Some(0), Some(0), Some(1), Some(1)]);
    assert_eq!(
        log.facts().recovery_header().as_deref(),
        Some("ok,correct:schema,ok,switch:backup,ok,correct:schema,ok")
    );
}

#[tokio::test]
async fn an_invalid_schema_is_refused_before_any_call() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([]);
    let bad = json!({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}});
    let err = kit
        .validate()
        .layer(inner.clone())
        .oneshot(kit.call().field("response_format", bad).build())
        .await
        .unwrap_err();
    assert!(matches!(err, GatewayError::InvalidSchema(_)), "{err:?}");
    assert_eq!(refused(&err), (400, "invalid_schema"));
    assert_eq!(inner.count(), 0);
}

#[tokio::test]
async fn annotate_mode_passes_an_invalid_answer_flagged() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([Canned::ok(chat_answer(INVALID))]);
    let layer = kit.validate_with(ValidationConfig {
        mode: ValidationMode::Annotate,
        ..ValidationConfig::default()
    });
    let response = layer
        .layer(inner.clone())
        .oneshot(kit.call().field("response_format", wants_n()).build())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(header(&response, "x-backstop-validation"), Some("invalid"));
    let error = header(&response, "x-backstop-validation-error").unwrap();
    assert!(error.starts_with("/n"), "{error}");
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn an_upstream_error_is_the_answer_without_a_correction() {
    let kit = Kit::new().await;
    let error = json!({"error": {"type": "invalid_request_error", "message": "bad"}});
    let inner = Scripted::at_recovery([Canned::json(400, error.clone())]);
    let response = kit
        .validate()
        .layer(inner.clone())
        .oneshot(kit.call().field("response_format", wants_n()).build())
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(header(&response, "x-backstop-validation"), None);
    assert_eq!(body_json(response).await, error);
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn a_buffered_stream_is_corrected_before_the_client_sees_it() {
    let kit = Kit::new().await;
    let inner = Scripted::at_recovery([
        Canned::sse(chat_stream(&[r#"{"n":"#, r#""x"}"#])),
        Canned::sse(chat_stream(&[r#"{"n":"#, "1}"])),
    ]);
    let response = kit
        .validate()
        .layer(inner.clone())
        .oneshot(
            kit.call()
                .stream()
                .field("response_format", wants_n())
                .build(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        header(&response, "x-backstop-validation"),
        Some("corrected")
    );
    let body = String::from_utf8(body_bytes(response).await.to_vec()).unwrap();
    // The accepted attempt's events, verbatim; nothing of the invalid one.
    assert_eq!(body, chat_stream(&[r#"{"n":"#, "1}"]));
    assert_eq!(inner.count(), 2);
    let correction = &inner.last().body["messages"];
    assert_eq!(correction[1]["content"], r#"{"n":"x"}"#);
}
