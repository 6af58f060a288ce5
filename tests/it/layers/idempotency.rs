//! The idempotency layer over a scripted inner service: a replay never reaches it, a
//! reused key with another body is refused before it, a failure is not kept.

use std::time::Duration;

use backstop::{api::Endpoint, error::GatewayError};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::{
    layer::{body_bytes, body_json, chat_answer, header, refused, Canned, Gate, Kit, Scripted},
    until,
};

#[tokio::test]
async fn a_replay_does_not_reach_the_inner_service() {
    let kit = Kit::new().await;
    let inner = Scripted::at_call([Canned::ok(chat_answer("first"))]);
    let service = kit.idempotency().layer(inner.clone());
    let call = kit.call().idempotency_key("key-1");

    let first = service.clone().oneshot(call.build()).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(header(&first, "x-backstop-replayed"), None);
    // Kept once its body has ended whole.
    let kept = body_bytes(first).await;

    let replay = service.oneshot(call.build()).await.unwrap();
    assert_eq!(replay.status(), 200);
    assert_eq!(header(&replay, "x-backstop-replayed"), Some("true"));
    assert_eq!(header(&replay, "content-type"), Some("application/json"));
    assert_eq!(body_bytes(replay).await, kept);
    assert_eq!(inner.count(), 1, "the replay made no call");
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_without_a_call() {
    let kit = Kit::new().await;
    let inner = Scripted::at_call([Canned::ok(chat_answer("first"))]);
    let service = kit.idempotency().layer(inner.clone());
    let call = kit.call().idempotency_key("key-2");

    let first = service.clone().oneshot(call.build()).await.unwrap();
    body_bytes(first).await;
    let err = service
        .oneshot(call.saying("something else").build())
        .await
        .unwrap_err();
    assert!(matches!(err, GatewayError::IdempotencyKeyReused), "{err:?}");
    assert_eq!(refused(&err), (422, "idempotency_key_reused"));
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn a_failed_answer_is_not_kept_so_the_key_can_be_retried() {
    let kit = Kit::new().await;
    let inner = Scripted::at_call([
        Canned::json(500, json!({"error": {"message": "boom"}})),
        Canned::ok(chat_answer("second")),
    ]);
    let service = kit.idempotency().layer(inner.clone());
    let call = kit.call().idempotency_key("key-3");

    let failed = service.clone().oneshot(call.build()).await.unwrap();
    assert_eq!(failed.status(), 500);
    body_bytes(failed).await;
    let retried = service.oneshot(call.build()).await.unwrap();
    assert_eq!(retried.status(), 200);
    assert_eq!(header(&retried, "x-backstop-replayed"), None);
    assert_eq!(
        body_json(retried).await["choices"][0]["message"]["content"],
        "second"
    );
    assert_eq!(inner.count(), 2, "the retry after a failure was made");
}

#[tokio::test]
async fn a_key_it_cannot_honour_is_refused_before_any_call() {
    let kit = Kit::new().await;
    let max = kit.state.config.server.max_idempotency_key_bytes;
    let inner = Scripted::at_call([]);
    let service = kit.idempotency().layer(inner.clone());
    for key in ["x".repeat(max + 1), "has space".to_string()] {
        let err = service
            .clone()
            .oneshot(kit.call().idempotency_key(&key).build())
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                GatewayError::InvalidHeader {
                    header: "idempotency-key",
                    ..
                }
            ),
            "{key}: {err:?}"
        );
        assert_eq!(refused(&err), (400, "invalid_header"));
    }
    assert_eq!(inner.count(), 0);
}

#[tokio::test]
async fn keys_are_scoped_by_tenant_and_endpoint() {
    let kit = Kit::new().await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("fresh")));
    let service = kit.idempotency().layer(inner.clone());
    let call = kit.call().idempotency_key("shared");

    body_bytes(service.clone().oneshot(call.build()).await.unwrap()).await;
    // Another tenant, the same key and body: its own call, not a replay.
    let other = service
        .clone()
        .oneshot(call.clone().tenant("u").build())
        .await
        .unwrap();
    assert_eq!(header(&other, "x-backstop-replayed"), None);
    body_bytes(other).await;
    // Another endpoint, the same key: not the chat answer, and not a reuse either.
    let embeddings = service
        .clone()
        .oneshot(call.endpoint(Endpoint::Embeddings).build())
        .await
        .unwrap();
    assert_eq!(header(&embeddings, "x-backstop-replayed"), None);
    assert_eq!(inner.count(), 3);
    // Without a key, every request is made.
    for _ in 0..2 {
        let plain = service.clone().oneshot(kit.call().build()).await.unwrap();
        body_bytes(plain).await;
    }
    assert_eq!(inner.count(), 5);
}

#[tokio::test(start_paused = true)]
async fn a_concurrent_duplicate_waits_for_the_first_and_is_its_replay() {
    let kit = Kit::new().await;
    let gate = Gate::new();
    let inner = Scripted::at_call([Canned::ok(chat_answer("once")).until(&gate)]);
    let service = kit.idempotency().layer(inner.clone());
    let call = kit.call().idempotency_key("key-4");

    let first = tokio::spawn({
        let (service, call) = (service.clone(), call.build());
        async move { body_bytes(service.oneshot(call).await.unwrap()).await }
    });
    until("the first request reaches the inner service", || async {
        inner.count() == 1
    })
    .await;
    let duplicate = tokio::spawn({
        let (service, call) = (service.clone(), call.build());
        async move {
            let response = service.oneshot(call).await.unwrap();
            let replayed = header(&response, "x-backstop-replayed").map(str::to_owned);
            (replayed, body_bytes(response).await)
        }
    });
    // Virtual time: the paused clock moves only once every task is idle, so the
    // duplicate has run up to its wait on the first by then.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !duplicate.is_finished(),
        "the duplicate waits for the first"
    );
    assert_eq!(inner.count(), 1);

    gate.open();
    let first = first.await.unwrap();
    let (replayed, body) = duplicate.await.unwrap();
    assert_eq!(replayed.as_deref(), Some("true"));
    assert_eq!(body, first);
    assert_eq!(inner.count(), 1, "one call for both");
}

/// The race a duplicate sent just as the first request's response is kept used to lose:
/// it read the store before the response was kept, then found nobody in flight (the
/// first had just left) and called again. Each round here is that timing's chance (on
/// two workers, so the duplicate and the first's write run side by side).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_sent_as_the_first_is_kept_is_always_its_replay() {
    let kit = Kit::new().await;
    let inner = Scripted::at_call([]).otherwise(Canned::ok(chat_answer("once")));
    let service = kit.idempotency().layer(inner.clone());
    for round in 0..200 {
        let call = kit.call().idempotency_key(&format!("round-{round}"));
        let first = service.clone().oneshot(call.build()).await.unwrap();
        body_bytes(first).await;
        let duplicate = service.clone().oneshot(call.build()).await.unwrap();
        assert_eq!(
            header(&duplicate, "x-backstop-replayed"),
            Some("true"),
            "round {round}"
        );
        assert_eq!(inner.count(), round + 1, "round {round}: one call a key");
    }
}
