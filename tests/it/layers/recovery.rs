//! The recovery layer over a scripted meter, under the [`UnvalidatedLayer`] that writes
//! its trail into the request's record (from which the edge sets `x-backstop-attempts`
//! and `x-backstop-recovery`). On a paused clock: the waits are exact, in virtual time.
//! (tests/it/recovery_policy.rs covers the whole taxonomy, hedging and the breakers.)

use std::{sync::Arc, time::Duration};

use backstop::{
    error::GatewayError,
    layers::recovery::UnvalidatedLayer,
    telemetry::{Facts, RequestLog},
};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    body_json, chat_answer, refused, AtMeter, CallBuilder, Canned, Kit, Scripted,
};

/// Recovery over `inner`, as the stack without validation mounts it; the call's record.
async fn recover(
    kit: &Kit,
    inner: &Scripted<AtMeter>,
    call: CallBuilder,
) -> (
    Result<http::Response<axum::body::Body>, GatewayError>,
    Facts,
) {
    let log = Arc::new(RequestLog::default());
    let service = UnvalidatedLayer.layer(kit.recovery().layer(inner.clone()));
    let result = service.oneshot(call.log(log.clone()).build()).await;
    (result, log.facts())
}

#[tokio::test(start_paused = true)]
async fn a_503_then_a_200_reaches_the_meter_twice_and_the_trail_says_so() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([Canned::status(503), Canned::ok(chat_answer("hi"))]);
    let call = kit.call().session("s1").header("x-mock-trace", "abc");
    let (result, facts) = recover(&kit, &inner, call).await;
    let response = result.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(body_json(response).await, chat_answer("hi"));

    assert_eq!(inner.count(), 2);
    assert_eq!(inner.upstreams(), ["openai", "openai"]);
    let [first, retry] = <[_; 2]>::try_from(inner.received()).unwrap();
    // The backoff ceiling of the first retry is `base_delay` (jitter pinned at the top).
    assert_eq!(
        (first.at, retry.at),
        (Duration::ZERO, Duration::from_millis(100))
    );
    for attempt in [&first, &retry] {
        assert_eq!(attempt.tenant.as_deref(), Some("t"));
        assert_eq!(attempt.session.as_deref(), Some("s1"));
        assert_eq!(attempt.header("x-mock-trace"), Some("abc"));
    }
    // `x-backstop-recovery` and `x-backstop-attempts`.
    assert_eq!(facts.recovery_header().as_deref(), Some("retry:503,ok"));
    assert_eq!(facts.recovery.attempts, 2);
    assert_eq!(facts.recovery.upstream.as_deref(), Some("openai"));
}

#[tokio::test(start_paused = true)]
async fn a_callers_fault_is_passed_through_after_one_attempt() {
    let kit = Kit::new().await;
    let error = json!({"error": {"type": "invalid_request_error", "message": "bad"}});
    let inner = Scripted::at_meter([Canned::json(400, error.clone())]);
    let (result, facts) = recover(&kit, &inner, kit.call().model("two")).await;
    let response = result.unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(body_json(response).await, error);
    assert_eq!(inner.count(), 1, "neither retried nor failed over");
    assert_eq!(facts.recovery_header().as_deref(), Some("pass:400"));
}

#[tokio::test(start_paused = true)]
async fn a_refused_credential_fails_over_to_the_next_target_and_its_model() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([
        Canned::json(
            401,
            json!({"error": {"type": "authentication_error", "message": "key"}}),
        ),
        Canned::ok(chat_answer("from backup")),
    ]);
    let (result, facts) = recover(&kit, &inner, kit.call().model("two")).await;
    assert_eq!(result.unwrap().status(), 200);
    assert_eq!(inner.upstreams(), ["openai", "backup"]);
    let models: Vec<_> = inner.received().into_iter().map(|r| r.model).collect();
    assert_eq!(models, ["two", "backup-model"]);
    assert_eq!(
        inner.last().body["model"],
        "backup-model",
        "the target's model is sent"
    );
    assert_eq!(
        facts.recovery_header().as_deref(),
        Some("giveup:401,failover:backup,ok")
    );
    assert_eq!(facts.recovery.attempts, 2);
    assert_eq!(facts.recovery.upstream.as_deref(), Some("backup"));
}

#[tokio::test(start_paused = true)]
async fn a_refusal_from_below_is_neither_retried_nor_failed_over() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([Canned::error(|| GatewayError::BudgetExceeded {
        budget: "session.max_calls",
        detail: "spent".into(),
    })]);
    let (result, facts) = recover(&kit, &inner, kit.call().model("two")).await;
    let err = result.unwrap_err();
    assert_eq!(refused(&err), (402, "budget_exceeded"));
    assert_eq!(inner.count(), 1);
    assert_eq!(
        facts.recovery_header().as_deref(),
        Some("refused:budget_exceeded")
    );
    assert_eq!(facts.recovery.attempts, 0, "a refusal is no attempt");
}

#[tokio::test(start_paused = true)]
async fn an_upstreams_retry_after_is_waited_in_virtual_time() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([
        Canned::status(429).header("retry-after", "2"),
        Canned::ok(chat_answer("hi")),
    ]);
    let (result, facts) = recover(&kit, &inner, kit.call()).await;
    assert_eq!(result.unwrap().status(), 200);
    let at: Vec<_> = inner.received().into_iter().map(|r| r.at).collect();
    assert_eq!(at, [Duration::ZERO, Duration::from_secs(2)]);
    assert_eq!(facts.recovery_header().as_deref(), Some("retry:429,ok"));
}

#[tokio::test(start_paused = true)]
async fn transient_failures_past_max_attempts_become_the_clients_answer() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([]).otherwise(Canned::status(503));
    let (result, facts) = recover(&kit, &inner, kit.call()).await;
    // `retry.max_attempts = 2` on the one target, then the upstream's own 503.
    let response = result.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(inner.count(), 2);
    assert_eq!(
        facts.recovery_header().as_deref(),
        Some("retry:503,giveup:503")
    );
}
