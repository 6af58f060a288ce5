//! The meter layer over a scripted leaf: a call the budget refuses is never made, a call
//! that was never sent is given back, what was sent is settled to its reported usage.

use std::sync::Arc;

use backstop::{
    billing::Tokens, policy::classify::TransportFailure, telemetry::RequestLog,
    upstream::AttemptError,
};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    chat_answer, chat_stream, err_of, refusal_of, refused, Canned, Kit, Scripted, TenantLimits,
    TENANT,
};

#[tokio::test]
async fn a_budget_refusal_never_calls_the_leaf() {
    // Less than the worst case of any call.
    let kit = Kit::with(TenantLimits::of(TENANT).usd_per_day(0.000_001).edit()).await;
    let leaf = Scripted::at_leaf([]);
    let err = refusal_of(
        kit.meter()
            .layer(leaf.clone())
            .oneshot(kit.call().billed())
            .await,
    );
    assert_eq!(refused(&err), (402, "budget_exceeded"));
    assert_eq!(err.budget(), Some("tenant.usd_per_day"));
    assert_eq!(leaf.count(), 0);
}

#[tokio::test]
async fn each_attempt_is_one_of_the_sessions_calls() {
    let kit = Kit::with(TenantLimits::of(TENANT).session_max_calls(1).edit()).await;
    let leaf = Scripted::at_leaf([Canned::ok(chat_answer("hi"))]);
    let meter = kit.meter().layer(leaf.clone());
    let attempt = kit.call().session("s1");

    let reply = meter.clone().oneshot(attempt.billed()).await.unwrap();
    assert_eq!(reply.status, 200);
    let err = refusal_of(meter.clone().oneshot(attempt.billed()).await);
    assert_eq!(refused(&err), (402, "budget_exceeded"));
    assert_eq!(err.budget(), Some("session.max_calls"));
    assert_eq!(leaf.count(), 1, "the refused attempt was not made");
    assert_eq!(leaf.last().session, None, "the leaf gets the attempt alone");
}

#[tokio::test]
async fn an_attempt_that_never_connected_is_given_back() {
    let kit = Kit::with(TenantLimits::of(TENANT).session_max_calls(1).edit()).await;
    let leaf = Scripted::at_leaf([
        Canned::transport(TransportFailure::Connect),
        Canned::ok(chat_answer("hi")),
    ]);
    let meter = kit.meter().layer(leaf.clone());
    let attempt = kit.call().session("s1");

    let err = err_of(meter.clone().oneshot(attempt.billed()).await);
    assert!(
        matches!(err, AttemptError::Transport(TransportFailure::Connect)),
        "{err:?}"
    );
    // Nothing was sent: the session still has its one call.
    let reply = meter.clone().oneshot(attempt.billed()).await.unwrap();
    assert_eq!(reply.status, 200);
    let err = refusal_of(meter.oneshot(attempt.billed()).await);
    assert_eq!(err.budget(), Some("session.max_calls"));
    assert_eq!(leaf.count(), 2);
}

#[tokio::test]
async fn an_openai_stream_is_asked_for_its_usage_unless_the_client_asked() {
    let kit = Kit::new().await;
    let leaf = Scripted::at_leaf([]).otherwise(Canned::sse(chat_stream(&["hi"])));
    let meter = kit.meter().layer(leaf.clone());

    let reply = meter
        .clone()
        .oneshot(kit.call().stream().billed())
        .await
        .unwrap();
    assert!(reply.is_stream());
    let sent = leaf.last();
    assert!(
        sent.stream_usage,
        "the leaf strips the usage chunk it asked for"
    );
    assert_eq!(sent.body["stream_options"], json!({"include_usage": true}));

    let asked = kit
        .call()
        .stream()
        .field("stream_options", json!({"include_usage": true}));
    meter.clone().oneshot(asked.billed()).await.unwrap();
    assert!(
        !leaf.last().stream_usage,
        "the client keeps the chunk it asked for"
    );
    assert_eq!(
        leaf.last().body["stream_options"],
        json!({"include_usage": true})
    );

    // Not a stream: nothing asked.
    meter.oneshot(kit.call().billed()).await.unwrap();
    let whole = leaf.last();
    assert!(!whole.stream_usage);
    assert_eq!(whole.body.get("stream_options"), None);
    assert_eq!(leaf.count(), 3);
}

#[tokio::test]
async fn reported_usage_is_settled_into_the_request_record() {
    let kit = Kit::new().await;
    let leaf = Scripted::at_leaf([Canned::ok(chat_answer("hi"))]);
    let log = Arc::new(RequestLog::default());
    let reply = kit
        .meter()
        .layer(leaf.clone())
        .oneshot(kit.call().session("s1").log(log.clone()).billed())
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    let facts = log.facts();
    // chat_answer reports 10 prompt and 5 completion tokens.
    assert_eq!(facts.usage, Some(Tokens::plain(10, 5)));
    // gpt-4o at $2.50 and $10 per million.
    let usd = 10.0 * 2.5e-6 + 5.0 * 10e-6;
    assert!((facts.spent_usd - usd).abs() < 1e-12, "{}", facts.spent_usd);
    assert_eq!(leaf.count(), 1);
}
