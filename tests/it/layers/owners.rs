//! The response-owners layer over a scripted meter: a create's stored objects become
//! its tenant's before the answer is released, another tenant's are refused before the
//! meter, and what the provider holds for a chained call is handed on.

use backstop::{api::Endpoint, error::GatewayError, layers::meter::HeldContext};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    chat_answer, refusal_of, refused, reply_json, responses_answer, Canned, Kit, Scripted,
    OTHER_TENANT,
};

#[tokio::test]
async fn a_call_that_is_not_a_responses_create_passes_straight_through() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([Canned::ok(chat_answer("hi"))]);
    let reply = kit
        .owners()
        .layer(inner.clone())
        .oneshot(kit.call().billed())
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply_json(&reply), chat_answer("hi"));
    let sent = inner.last();
    assert_eq!(sent.endpoint, Endpoint::ChatCompletions);
    assert_eq!(sent.held, Some(HeldContext::default()));
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn another_tenants_previous_response_is_refused_before_the_meter() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([
        Canned::ok(responses_answer("resp_1", "msg_1", "first")),
        Canned::ok(responses_answer("resp_2", "msg_2", "second")),
    ]);
    let owners = kit.owners().layer(inner.clone());
    let create = kit.call().endpoint(Endpoint::Responses);

    let reply = owners.clone().oneshot(create.billed()).await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(inner.last().held, Some(HeldContext::default()));

    let chained = create.field("previous_response_id", json!("resp_1"));
    let err = refusal_of(
        owners
            .clone()
            .oneshot(chained.clone().tenant(OTHER_TENANT).billed())
            .await,
    );
    assert!(
        matches!(&err, GatewayError::PreviousResponseNotFound(id) if id == "resp_1"),
        "{err:?}"
    );
    assert_eq!(refused(&err), (400, "previous_response_not_found"));
    assert_eq!(inner.count(), 1, "refused before the meter");

    // Its own tenant chains onto it, and the meter is told the context it carries:
    // the first answer's 20 input and 10 output tokens.
    let reply = owners.oneshot(chained.billed()).await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        inner.last().held,
        Some(HeldContext {
            tokens: 30,
            unsized_context: false
        })
    );
    assert_eq!(inner.count(), 2);
}

#[tokio::test]
async fn another_tenants_output_item_is_refused_by_its_place() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([Canned::ok(responses_answer("resp_3", "msg_3", "hi"))]);
    let owners = kit.owners().layer(inner.clone());
    let create = kit.call().endpoint(Endpoint::Responses);

    owners.clone().oneshot(create.billed()).await.unwrap();
    let referring = create
        .tenant(OTHER_TENANT)
        .field("input", json!([{"type": "item_reference", "id": "msg_3"}]));
    let err = refusal_of(owners.oneshot(referring.billed()).await);
    assert!(
        matches!(&err, GatewayError::ItemNotFound { id, param } if id == "msg_3" && param == "input[0].id"),
        "{err:?}"
    );
    assert_eq!(refused(&err), (400, "item_not_found"));
    assert_eq!(inner.count(), 1);
}

#[tokio::test]
async fn a_create_that_is_not_stored_is_nobodys() {
    let kit = Kit::new().await;
    let inner = Scripted::at_meter([
        Canned::ok(responses_answer("resp_4", "msg_4", "unstored")),
        Canned::ok(responses_answer("resp_5", "msg_5", "chained")),
    ]);
    let owners = kit.owners().layer(inner.clone());
    let create = kit.call().endpoint(Endpoint::Responses);

    owners
        .clone()
        .oneshot(create.clone().field("store", json!(false)).billed())
        .await
        .unwrap();
    // Not recorded as the tenant's: another tenant naming it is not refused, and its
    // size is unknown (the meter reserves the floor for it).
    let reply = owners
        .oneshot(
            create
                .tenant(OTHER_TENANT)
                .field("previous_response_id", json!("resp_4"))
                .billed(),
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        inner.last().held,
        Some(HeldContext {
            tokens: 0,
            unsized_context: true
        })
    );
    assert_eq!(inner.count(), 2);
}
