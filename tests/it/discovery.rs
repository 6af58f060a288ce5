//! Model discovery and unknown paths (issue 11): `GET /v1/models` lists concrete ids,
//! `GET /v1/models/{id}` answers for any id a route serves, and a path Backstop lacks is
//! a 404 in the caller's shape that the operator can see in the logs and metrics.

use crate::common::*;

async fn get(gw: &Gateway, path: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut req = gw.http.get(format!("{}{path}", gw.url)).bearer_auth(KEY_A);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.unwrap()
}

#[tokio::test]
async fn a_model_is_retrieved_by_any_id_a_route_serves_and_404_otherwise() {
    let gw = start().await;
    // Listed under the gpt-* glob, served by that glob but not listed, an exact route.
    for id in ["gpt-4o-mini", "gpt-5-nano", "rewrite-me"] {
        let resp = get(&gw, &format!("/v1/models/{id}"), &[]).await;
        assert_eq!(resp.status(), 200, "{id}");
        let body = json(resp).await;
        assert_eq!(body["id"], id);
        assert_eq!(body["object"], "model");
    }
    let anthropic = json(
        get(
            &gw,
            "/v1/models/claude-sonnet-4-5",
            &[("anthropic-version", "2023-06-01")],
        )
        .await,
    )
    .await;
    assert_eq!(anthropic["type"], "model");
    assert_eq!(anthropic["id"], "claude-sonnet-4-5");

    let missing = get(&gw, "/v1/models/llama-3-70b", &[]).await;
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.headers()["x-should-retry"], "false");
    let body = json(missing).await;
    assert_eq!(body["error"]["code"], "model_not_found");
    let missing = get(
        &gw,
        "/v1/models/llama-3-70b",
        &[("anthropic-version", "2023-06-01")],
    )
    .await;
    assert_eq!(missing.status(), 404);
    let body = json(missing).await;
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], "not_found_error", "{body}");

    // Without a key: 401, like every tenant call.
    let unauth = gw
        .http
        .get(format!("{}/v1/models/gpt-4o", gw.url))
        .send()
        .await
        .unwrap();
    assert_eq!(unauth.status(), 401);
}

#[tokio::test]
async fn unknown_paths_are_404_in_the_callers_shape_logged_and_counted() {
    let gw = start().await;
    let openai = gw
        .http
        .post(format!("{}/v1/assistants", gw.url))
        .bearer_auth(KEY_A)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(openai.status(), 404);
    assert_eq!(openai.headers()["x-should-retry"], "false");
    assert!(openai.headers().contains_key("x-request-id"));
    let body = json(openai).await;
    assert_eq!(body["error"]["code"], "unknown_endpoint", "{body}");

    // An Anthropic path (or the Anthropic SDK's version header) gets Anthropic's shape.
    for (path, version) in [
        ("/v1/messages/batches", None),
        ("/v1/files", Some("2023-06-01")),
    ] {
        let mut req = gw
            .http
            .post(format!("{}{path}", gw.url))
            .header("x-api-key", KEY_A);
        if let Some(v) = version {
            req = req.header("anthropic-version", v);
        }
        let resp = req.body("{}").send().await.unwrap();
        assert_eq!(resp.status(), 404, "{path}");
        assert_eq!(resp.headers()["x-should-retry"], "false");
        let body = json(resp).await;
        assert_eq!(body["type"], "error", "{path}: {body}");
        assert_eq!(body["error"]["type"], "not_found_error", "{path}: {body}");
    }

    let metrics = gw.metrics().await;
    let unknown: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("backstop_requests_total{") && l.contains("endpoint=\"unknown\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(unknown >= 3.0, "{metrics}");
}

#[tokio::test]
async fn count_tokens_is_forwarded_with_the_provider_key_recovered_and_never_charged() {
    let gw = start().await;
    let chat = serde_json::json!({"model": "claude-3", "max_tokens": 10, "messages": [{"role": "user", "content": "hello"}]});
    // One charged call in the session, so the session's figures exist.
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[
                ("x-session-id", "ct-1"),
                ("anthropic-version", "2023-06-01"),
            ],
            chat.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let count = serde_json::json!({"model": "claude-3", "messages": [{"role": "user", "content": "hello"}]});
    let resp = gw
        .http
        .post(format!("{}/v1/messages/count_tokens", gw.url))
        .header("x-api-key", KEY_A)
        .header("anthropic-version", "2023-06-01")
        .header("x-session-id", "ct-1")
        .header("x-mock-scenario", "count-tokens")
        .header("x-mock-fault", "status=529,usage=42/0")
        .body(count.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // 529 is transient: retried, like any call.
    assert_eq!(resp.headers()["x-backstop-attempts"], "2");
    assert_eq!(json(resp).await["input_tokens"], 42);
    let seen = gw.mock.last_request("count-tokens").unwrap();
    assert_eq!(seen["path"], "/v1/messages/count_tokens");
    assert_ne!(
        seen["headers"]["x-api-key"], KEY_A,
        "the tenant key went upstream"
    );
    assert!(
        seen["headers"]["x-api-key"].is_string(),
        "no provider key: {seen}"
    );

    // count_tokens is charged like a call: one, settled when its body has ended.
    gw.session_report_when(KEY_A, "ct-1", |r| r["used"]["calls"] == 1)
        .await;

    // An OpenAI-only model has no Anthropic target: a caller error, in Anthropic's shape.
    let resp = gw
        .http
        .post(format!("{}/v1/messages/count_tokens", gw.url))
        .header("x-api-key", KEY_A)
        .body(serde_json::json!({"model": "gpt-4o", "messages": []}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["type"], "error", "{body}");
}

/// Frameworks that set headers per client, not per run, name the run in the body.
#[tokio::test]
async fn a_session_id_comes_from_the_body_when_no_header_names_one() {
    let gw = start_with(|c| {
        c.set(
            "server.session_id_fields",
            vec!["metadata.session_id", "user"],
        )
    })
    .await;
    // Calls are counted when their answer has ended.
    let report = |session: &'static str| {
        gw.session_report_when(KEY_A, session, |r| r["used"]["calls"].as_u64() >= Some(1))
    };
    let chat = |extra: serde_json::Value| {
        let mut body =
            serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        body
    };
    let resp = gw
        .chat(
            "body-session",
            "",
            chat(serde_json::json!({"metadata": {"session_id": "from-body"}})),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let body = report("from-body").await;
    assert_eq!(body["used"]["calls"], 1, "{body}");

    // The second configured field is used when the first is absent.
    let resp = gw
        .chat(
            "body-user",
            "",
            chat(serde_json::json!({"user": "end-user-9"})),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(report("end-user-9").await["used"]["calls"], 1);

    // The header wins over the body.
    let resp = gw
        .post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("x-session-id", "from-header")],
            chat(serde_json::json!({"metadata": {"session_id": "from-body"}})).to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(report("from-header").await["used"]["calls"], 1);
    assert_eq!(report("from-body").await["used"]["calls"], 1);

    // A body session id Backstop cannot honour is refused, never ignored.
    let resp = gw
        .chat(
            "body-bad",
            "",
            chat(serde_json::json!({"metadata": {"session_id": 12}})),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "invalid_parameter");
    assert_eq!(body["error"]["param"], "metadata.session_id");
    assert_eq!(gw.mock.attempts("body-bad"), 0);
}

/// Hardening v3, 8: counting tokens is uncharged but not unlimited. Before, 60 of 60
/// were forwarded from a 5-a-minute tenant.
#[tokio::test]
async fn count_tokens_is_held_to_the_tenants_request_rate() {
    const LIMITED: &str = "bk-count-limited-01";
    let gw = start_with(|c| {
        c.merge(&format!(
            "[[tenants]]\nname = \"counting\"\napi_keys = [\"{LIMITED}\"]\nrequests_per_minute = 5\n"
        ))
    })
    .await;
    let count = serde_json::json!({"model": "claude-3", "messages": [{"role": "user", "content": "hello"}]});
    let mut statuses = Vec::new();
    let mut refused = None;
    for _ in 0..8 {
        let resp = gw
            .http
            .post(format!("{}/v1/messages/count_tokens", gw.url))
            .header("x-api-key", LIMITED)
            .header("x-mock-scenario", "counting")
            .body(count.to_string())
            .send()
            .await
            .unwrap();
        statuses.push(resp.status().as_u16());
        if resp.status() == 429 && refused.is_none() {
            let retry_after = resp.headers()["retry-after"].to_str().unwrap().to_string();
            refused = Some((retry_after, json(resp).await));
        }
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429, 429]);
    assert_eq!(gw.mock.attempts("counting"), 5);
    let (retry_after, body) = refused.unwrap();
    assert!(retry_after.parse::<u64>().unwrap() >= 1, "{retry_after}");
    assert_eq!(body["type"], "error", "Anthropic's shape: {body}");
    assert_eq!(body["error"]["type"], "rate_limited", "{body}");
}
