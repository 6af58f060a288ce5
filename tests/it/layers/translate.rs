//! The translate layer over a scripted leaf: under recovery (which translates the
//! request when it judges a target of the other API) as the proxy stack mounts it, and
//! alone, for what it does to a reply.

use std::sync::Arc;

use backstop::{
    api::Endpoint,
    layers::{
        meter::Unmetered,
        recovery::UnvalidatedLayer,
        translate::{untranslatable_reason, TranslateLayer},
    },
    telemetry::RequestLog,
    translate::{AnswerContext, Direction},
    upstream::Attempt,
};
use serde_json::json;
use tower::{Layer, ServiceExt};

use crate::common::layer::{
    body_bytes, body_json, messages_answer, messages_stream, reply_json, AtLeaf, CallBuilder,
    Canned, Kit, Scripted,
};

/// Recovery over the translate layer over `leaf` (no meter), as the client sees it.
async fn through_recovery(
    kit: &Kit,
    leaf: &Scripted<AtLeaf>,
    call: CallBuilder,
) -> (http::Response<axum::body::Body>, Arc<RequestLog>) {
    let log = Arc::new(RequestLog::default());
    let service = UnvalidatedLayer.layer(
        kit.recovery()
            .layer(Unmetered::new(TranslateLayer.layer(leaf.clone()))),
    );
    let response = service
        .oneshot(call.log(log.clone()).build())
        .await
        .unwrap();
    (response, log)
}

/// An attempt on the Anthropic target carrying a chat caller's translation, as
/// recovery makes it.
fn translated_attempt(kit: &Kit) -> Attempt {
    let caller = kit.call().model("claude-sonnet-4-5").build();
    let mut attempt = kit
        .call()
        .endpoint(Endpoint::Messages)
        .model("claude-sonnet-4-5")
        .attempt();
    attempt.translation = Some(AnswerContext {
        direction: Direction::ChatToMessages,
        caller: caller.request.clone(),
    });
    attempt
}

#[tokio::test]
async fn a_chat_request_to_an_anthropic_target_arrives_as_a_messages_body() {
    let kit = Kit::new().await;
    let leaf = Scripted::at_leaf([Canned::ok(messages_answer("hello back"))]);
    let call = kit.call().model("claude-sonnet-4-5").body(json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 100,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"}
        ]
    }));
    let (response, log) = through_recovery(&kit, &leaf, call).await;

    let sent = leaf.last();
    assert_eq!(sent.upstream.as_deref(), Some("anthropic"));
    assert_eq!(sent.endpoint, Endpoint::Messages);
    assert_eq!(sent.translated, Some(Direction::ChatToMessages));
    assert_eq!(sent.body["model"], "claude-sonnet-4-5");
    assert_eq!(sent.body["max_tokens"], 100);
    assert_eq!(sent.body["system"], "be brief", "{}", sent.body);
    assert_eq!(sent.body["messages"].as_array().unwrap().len(), 1);
    assert_eq!(sent.body["messages"][0]["role"], "user");
    // What the real Messages API accepts (the strict mock's checks).
    if let Err(refusal) = backstop::mock::strict::check("/v1/messages", &sent.body) {
        panic!("not a Messages body: {refusal:?}\n{}", sent.body);
    }

    // The answer comes back as a chat completion.
    assert_eq!(response.status(), 200);
    let answer = body_json(response).await;
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["choices"][0]["message"]["content"], "hello back");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    assert_eq!(answer["usage"]["prompt_tokens"], 12);
    assert_eq!(answer["usage"]["completion_tokens"], 6);
    assert_eq!(
        log.facts().recovery_header().as_deref(),
        Some("translate:chat->messages,ok")
    );
    assert_eq!(leaf.count(), 1);
}

#[tokio::test]
async fn an_anthropic_error_comes_back_in_the_callers_shape() {
    let kit = Kit::new().await;
    let error = json!({"type": "error", "error": {"type": "invalid_request_error", "message": "bad thing"}});
    let leaf = Scripted::at_leaf([Canned::json(400, error)]);
    let call = kit
        .call()
        .model("claude-sonnet-4-5")
        .field("max_tokens", json!(64));
    let (response, _) = through_recovery(&kit, &leaf, call).await;
    assert_eq!(response.status(), 400);
    let body = body_json(response).await;
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["message"], "bad thing", "{body}");
    assert_eq!(leaf.count(), 1);
}

#[tokio::test]
async fn an_anthropic_stream_comes_back_as_chat_chunks() {
    let kit = Kit::new().await;
    let leaf = Scripted::at_leaf([Canned::sse(messages_stream("streamed hi"))]);
    let call = kit
        .call()
        .model("claude-sonnet-4-5")
        .field("max_tokens", json!(64))
        .stream();
    let (response, _) = through_recovery(&kit, &leaf, call).await;
    assert_eq!(leaf.last().body["stream"], true);
    assert_eq!(response.status(), 200);
    let text = String::from_utf8(body_bytes(response).await.to_vec()).unwrap();
    let chunks: Vec<serde_json::Value> = text
        .split("\n\n")
        .filter_map(|event| event.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk"),
        "{text}"
    );
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "streamed hi");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
}

#[tokio::test]
async fn an_attempt_without_a_translation_passes_untouched() {
    let kit = Kit::new().await;
    let raw = r#"{"id":"x","object":"chat.completion","choices":[],"extra":{"kept":true}}"#;
    let leaf =
        Scripted::at_leaf([Canned::raw(200, raw).header("content-type", "application/json")]);
    let reply = TranslateLayer
        .layer(leaf.clone())
        .oneshot(kit.call().attempt())
        .await
        .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.bytes(), raw.as_bytes(), "byte for byte");
    assert_eq!(leaf.last().translated, None);
    assert_eq!(leaf.count(), 1);
}

#[tokio::test]
async fn an_answer_that_cannot_be_brought_back_exactly_is_marked_so() {
    let kit = Kit::new().await;
    let mut answer = messages_answer("hi");
    answer["stop_reason"] = json!("a_reason_chat_has_no_word_for");
    let leaf = Scripted::at_leaf([Canned::ok(answer)]);
    let reply = TranslateLayer
        .layer(leaf.clone())
        .oneshot(translated_attempt(&kit))
        .await
        .unwrap();
    // A body no API reads, so recovery classifies it malformed; it names why.
    assert_eq!(reply.status, 200);
    let reason = untranslatable_reason(reply.bytes()).expect("marked untranslatable");
    assert!(reason.contains("a_reason_chat_has_no_word_for"), "{reason}");
    assert_eq!(leaf.count(), 1);
}

#[tokio::test]
async fn anthropics_overloaded_is_an_openai_callers_503() {
    let kit = Kit::new().await;
    let overloaded =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}});
    let leaf = Scripted::at_leaf([Canned::json(529, overloaded)]);
    let reply = TranslateLayer
        .layer(leaf.clone())
        .oneshot(translated_attempt(&kit))
        .await
        .unwrap();
    assert_eq!(reply.status, 503);
    let body = reply_json(&reply);
    assert_eq!(body["error"]["message"], "busy", "{body}");
    assert_eq!(leaf.count(), 1);
}
