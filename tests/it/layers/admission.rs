//! The admission layer over a scripted inner service: every refusal (a rate, a
//! session's concurrency, the session guard) is made before the inner service is called.

use std::{sync::Arc, time::Duration};

use backstop::{error::GatewayError, policy::guard::Phase, telemetry::RequestLog};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    body_bytes, chat_answer, refused, Canned, Kit, Scripted, TenantLimits, TENANT,
};

#[tokio::test(start_paused = true)]
async fn a_tenant_over_its_request_rate_is_refused_before_the_call() {
    let kit = Kit::with(TenantLimits::of(TENANT).requests_per_minute(1).edit()).await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("hi")));
    let service = kit.admission().layer(inner.clone());

    let first = service.clone().oneshot(kit.call().build()).await.unwrap();
    assert_eq!(first.status(), 200);
    let err = service
        .clone()
        .oneshot(kit.call().build())
        .await
        .unwrap_err();
    let GatewayError::RateLimited { retry_after, .. } = &err else {
        panic!("{err:?}");
    };
    assert!(
        *retry_after > Duration::ZERO && *retry_after <= Duration::from_secs(60),
        "{retry_after:?}"
    );
    assert_eq!(refused(&err), (429, "rate_limited"));
    assert_eq!(inner.count(), 1, "the refused request made no call");
    // Another tenant has its own rate.
    let other = service
        .clone()
        .oneshot(kit.call().tenant("u").build())
        .await
        .unwrap();
    assert_eq!(other.status(), 200);

    tokio::time::advance(Duration::from_secs(60)).await;
    let later = service.oneshot(kit.call().build()).await.unwrap();
    assert_eq!(later.status(), 200);
    assert_eq!(inner.count(), 3);
}

#[tokio::test]
async fn a_session_holds_its_concurrency_slot_until_the_response_body_ends() {
    let kit = Kit::with(TenantLimits::of(TENANT).session_max_concurrent(1).edit()).await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("hi")));
    let service = kit.admission().layer(inner.clone());
    let in_session = kit.call().session("s1");

    // Answered, its body not read yet: the slot is still held.
    let open = service.clone().oneshot(in_session.build()).await.unwrap();
    let err = service
        .clone()
        .oneshot(in_session.build())
        .await
        .unwrap_err();
    assert!(
        matches!(err, GatewayError::TooManyConcurrent { .. }),
        "{err:?}"
    );
    assert_eq!(refused(&err), (429, "too_many_concurrent"));
    assert_eq!(inner.count(), 1);
    // Another session is not held up by it.
    let other = service
        .clone()
        .oneshot(kit.call().session("s2").build())
        .await
        .unwrap();
    assert_eq!(other.status(), 200);

    body_bytes(open).await;
    let next = service.oneshot(in_session.build()).await.unwrap();
    assert_eq!(next.status(), 200);
    assert_eq!(inner.count(), 3);
    assert_eq!(inner.last().session.as_deref(), Some("s1"));
}

#[tokio::test]
async fn an_identical_request_past_the_guard_limit_is_refused_as_a_loop() {
    let kit = Kit::with(TenantLimits::of(TENANT).guard_identical_requests(2).edit()).await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("hi")));
    let service = kit.admission().layer(inner.clone());
    let log = Arc::new(RequestLog::default());
    let same = kit.call().session("looping").saying("same again");

    for _ in 0..2 {
        let ok = service.clone().oneshot(same.build()).await.unwrap();
        assert_eq!(ok.status(), 200);
        body_bytes(ok).await;
    }
    let err = service
        .clone()
        .oneshot(same.clone().log(log.clone()).build())
        .await
        .unwrap_err();
    let GatewayError::SessionRefused { code, detail, .. } = &err else {
        panic!("{err:?}");
    };
    assert_eq!(code.as_str(), "loop_detected");
    assert!(detail.contains("identical_request_limit"), "{detail}");
    assert_eq!(refused(&err).1, "loop_detected");
    assert_eq!(log.facts().session_state, Some(Phase::Tripped));
    assert_eq!(inner.count(), 2, "the loop's third request made no call");
    // Another session asking the same is not this session's loop.
    let other = service
        .oneshot(same.session("fresh").build())
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
    assert_eq!(inner.count(), 3);
}

#[tokio::test]
async fn consecutive_failures_trip_the_session_before_the_next_call() {
    let kit = Kit::with(
        TenantLimits::of(TENANT)
            .guard_consecutive_failures(2)
            .edit(),
    )
    .await;
    let bad = json!({"error": {"type": "invalid_request_error", "message": "no"}});
    let inner = Scripted::at_call([Canned::json(400, bad.clone()), Canned::json(400, bad)]);
    let service = kit.admission().layer(inner.clone());

    for n in 0..2 {
        let failed = service
            .clone()
            .oneshot(
                kit.call()
                    .session("failing")
                    .saying(&format!("try {n}"))
                    .build(),
            )
            .await
            .unwrap();
        assert_eq!(failed.status(), 400);
        body_bytes(failed).await;
    }
    let err = service
        .oneshot(kit.call().session("failing").saying("try 2").build())
        .await
        .unwrap_err();
    assert_eq!(refused(&err), (429, "session_tripped"));
    assert_eq!(inner.count(), 2);
}

#[tokio::test]
async fn a_budgeted_session_is_told_what_it_has_left() {
    let kit = Kit::with(TenantLimits::of(TENANT).session_max_calls(3).edit()).await;
    let inner = Scripted::at_call([Canned::ok(chat_answer("hi"))]);
    let log = Arc::new(RequestLog::default());
    let response = kit
        .admission()
        .layer(inner.clone())
        .oneshot(kit.call().session("budgeted").log(log.clone()).build())
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    // No upstream call was metered below: all three are left.
    assert_eq!(log.facts().budget_remaining.as_deref(), Some("calls=3"));
    assert_eq!(inner.count(), 1);
}
