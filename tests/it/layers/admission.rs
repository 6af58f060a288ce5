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

/// The session state the admission left in the request's log.
fn state_of(log: &RequestLog) -> Option<Phase> {
    log.facts().session_state
}

#[tokio::test(start_paused = true)]
async fn a_loop_at_its_limit_is_guided_once_with_a_note_and_a_repeat_trips_it() {
    let kit = Kit::with(
        TenantLimits::of(TENANT)
            .guard_identical_requests(2)
            .guard_guide()
            .edit(),
    )
    .await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("hi")));
    let service = kit.admission().layer(inner.clone());
    let looping = kit.call().session("looping").saying("same again");
    for _ in 0..2 {
        let ok = service.clone().oneshot(looping.build()).await.unwrap();
        assert_eq!(ok.status(), 200);
    }
    // The third identical request would trip the session: it goes on once, guided.
    let log = Arc::new(RequestLog::default());
    let guided = service
        .clone()
        .oneshot(looping.clone().log(log.clone()).build())
        .await
        .unwrap();
    assert_eq!(guided.status(), 200);
    assert_eq!(state_of(&log), Some(Phase::Guided));
    assert_eq!(
        log.facts().recovery_header().as_deref(),
        Some("guided:identical_request_limit")
    );
    assert_eq!(inner.count(), 3);
    let sent = &inner.received()[2].body["messages"];
    let last = sent.as_array().unwrap().last().unwrap();
    assert_eq!(last["role"], "system", "the note comes last: {sent}");
    let note = last["content"].as_str().unwrap();
    assert!(
        note.contains("the same request was sent 3 times") && note.contains("different approach"),
        "{note}"
    );
    assert_eq!(
        inner.received()[1].body["messages"]
            .as_array()
            .unwrap()
            .len(),
        1,
        "the requests before carried no note"
    );
    // The same request again: tripped, no upstream call.
    let err = service.clone().oneshot(looping.build()).await.unwrap_err();
    assert_eq!(refused(&err), (429, "loop_detected"));
    assert!(err.to_string().contains("guided once"), "{err}");
    assert_eq!(inner.count(), 3);
    let record = kit.state.guards.restarts().report(TENANT).await;
    assert_eq!(
        (
            record.guide.began,
            record.guide.recovered,
            record.guide.tripped
        ),
        (1, 0, 1)
    );
    assert_eq!(record.trips.get("identical_request_limit"), Some(&1));
    assert_eq!(record.refused, 1);
}

#[tokio::test(start_paused = true)]
async fn a_guided_session_that_changes_course_recovers() {
    let kit = Kit::with(
        TenantLimits::of(TENANT)
            .guard_identical_requests(2)
            .guard_guide()
            .edit(),
    )
    .await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("hi")));
    let service = kit.admission().layer(inner.clone());
    let looping = kit.call().session("turning").saying("same again");
    for _ in 0..3 {
        assert_eq!(
            service
                .clone()
                .oneshot(looping.build())
                .await
                .unwrap()
                .status(),
            200
        );
    }
    tokio::time::advance(Duration::from_secs(4)).await;
    let log = Arc::new(RequestLog::default());
    let turned = service
        .clone()
        .oneshot(
            kit.call()
                .session("turning")
                .saying("something else")
                .log(log.clone())
                .build(),
        )
        .await
        .unwrap();
    assert_eq!(turned.status(), 200);
    assert_eq!(state_of(&log), Some(Phase::Recovered));
    let last = inner.received()[3].body["messages"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(last, 1, "no note once it changed course");
    let record = kit.state.guards.restarts().report(TENANT).await;
    assert_eq!(
        (
            record.guide.began,
            record.guide.recovered,
            record.guide.tripped
        ),
        (1, 1, 0)
    );
    assert_eq!(record.guide.success_rate(), Some(1.0));
    assert_eq!(
        record.guide.mttr_mean(),
        Some(4.0),
        "from the guidance to the turn"
    );
    // Its next request is active again.
    let log = Arc::new(RequestLog::default());
    let next = kit
        .call()
        .session("turning")
        .saying("and on")
        .log(log.clone());
    assert_eq!(service.oneshot(next.build()).await.unwrap().status(), 200);
    assert_eq!(state_of(&log), Some(Phase::Active));
}

#[tokio::test(start_paused = true)]
async fn an_outage_puts_the_session_in_waiting_and_its_first_success_recovers_it() {
    let kit = Kit::with(
        TenantLimits::of(TENANT)
            .guard_consecutive_failures(2)
            .edit(),
    )
    .await;
    let open = || GatewayError::CircuitOpen {
        retry_after: Duration::from_secs(12),
    };
    let inner = Scripted::at_call([
        Canned::error(open),
        Canned::error(open),
        Canned::error(open),
        Canned::ok(chat_answer("back")),
    ]);
    let service = kit.admission().layer(inner.clone());
    for n in 0..3 {
        let log = Arc::new(RequestLog::default());
        let err = service
            .clone()
            .oneshot(
                kit.call()
                    .session("outage")
                    .saying(&format!("try {n}"))
                    .log(log.clone())
                    .build(),
            )
            .await
            .unwrap_err();
        assert_eq!(refused(&err), (503, "circuit_open"));
        assert_eq!(err.retry_after(), Some(Duration::from_secs(12)));
        assert_eq!(
            state_of(&log),
            Some(Phase::Waiting),
            "waiting, never tripped"
        );
        tokio::time::advance(Duration::from_secs(5)).await;
    }
    let log = Arc::new(RequestLog::default());
    let back = service
        .oneshot(
            kit.call()
                .session("outage")
                .saying("try 3")
                .log(log.clone())
                .build(),
        )
        .await
        .unwrap();
    assert_eq!(back.status(), 200);
    assert_eq!(state_of(&log), Some(Phase::Recovered));
    assert_eq!(inner.count(), 4);
    let record = kit.state.guards.restarts().report(TENANT).await;
    assert_eq!((record.wait.began, record.wait.recovered), (1, 1));
    assert_eq!(
        record.wait.mttr_mean(),
        Some(15.0),
        "from the first refusal: 3 × 5s"
    );
    assert!(record.trips.is_empty());
}
