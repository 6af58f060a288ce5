//! Azure OpenAI as an upstream kind (`api = "azure"`): the built-in mock stands in for
//! Azure, answering its deployment paths; what it received is asserted as sent.

use crate::common::*;
use serde_json::json;

/// An Azure upstream in front of the mock, two routes to it (the second names the
/// deployment), and the same mock as an `openai` upstream for comparison.
fn azure(config: TestConfig) -> TestConfig {
    let mock = config.str_at("upstreams.mock-openai.base_url");
    config.merge(&format!(
        r#"
[[upstreams]]
name = "azure"
api = "azure"
base_url = "{mock}"
api_version = "2024-10-21"
api_key = "azure-provider-key"
forward_headers = ["x-mock-*"]
attempt_timeout = "5s"

[[routes]]
model = "az-*"
targets = [{{ upstream = "azure" }}]

[[routes]]
model = "az-named"
targets = [{{ upstream = "azure", model = "prod/gpt 4o" }}]

[[routes]]
model = "text-embedding-*"
targets = [{{ upstream = "azure" }}]
"#
    ))
}

#[tokio::test]
async fn a_call_goes_to_the_deployment_with_the_api_version_and_the_api_key() {
    let gw = start_with(azure).await;
    let resp = gw.chat("az", "", chat("az-gpt-4o")).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        json(resp).await["choices"][0]["message"]["content"],
        "mock: hello"
    );
    let seen = gw.mock.last_request("az").unwrap();
    assert_eq!(
        seen["path"],
        "/openai/deployments/az-gpt-4o/chat/completions"
    );
    assert_eq!(seen["query"], "api-version=2024-10-21");
    assert_eq!(seen["headers"]["api-key"], "azure-provider-key");
    assert!(
        seen["headers"].get("authorization").is_none(),
        "no bearer goes to azure: {seen}"
    );
    assert!(!seen["headers"].to_string().contains(KEY_A), "{seen}");

    // A target's `model` names the deployment, percent-encoded as one path segment.
    let resp = gw.chat("az-named", "", chat("az-named")).await;
    assert_eq!(resp.status(), 200);
    let seen = gw.mock.last_request("az-named").unwrap();
    assert_eq!(
        seen["path"],
        "/openai/deployments/prod%2Fgpt%204o/chat/completions"
    );
    assert_eq!(seen["body"]["model"], "prod/gpt 4o");
}

#[tokio::test]
async fn embeddings_go_to_the_deployment_too() {
    let gw = start_with(azure).await;
    let body = json!({"model": "text-embedding-3-small", "input": "hello"});
    let resp = gw
        .post(
            "/v1/embeddings",
            Some(KEY_A),
            &[("x-mock-scenario", "az-embed")],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 200);
    let seen = gw.mock.last_request("az-embed").unwrap();
    assert_eq!(
        seen["path"],
        "/openai/deployments/text-embedding-3-small/embeddings"
    );
    assert_eq!(seen["query"], "api-version=2024-10-21");
}

/// Same wire, same recovery: a 503 then a 200 is one retry on Azure as on OpenAI.
#[tokio::test]
async fn a_transient_failure_is_retried_on_azure_as_on_openai() {
    let gw = start_with(azure).await;
    let mut trails = Vec::new();
    for (scenario, model) in [("az-retry", "az-gpt-4o"), ("oa-retry", "gpt-4o")] {
        let resp = gw.chat(scenario, "status=503,ok", chat(model)).await;
        assert_eq!(resp.status(), 200, "{scenario}");
        trails.push((
            resp.headers()["x-backstop-attempts"]
                .to_str()
                .unwrap()
                .to_string(),
            resp.headers()["x-backstop-recovery"]
                .to_str()
                .unwrap()
                .to_string(),
            gw.mock.attempts(scenario),
        ));
    }
    assert_eq!(trails[0], ("2".into(), "retry:503,ok".into(), 2));
    assert_eq!(trails[0], trails[1]);
}

/// Backstop does not send Azure the Responses API: the caller is told so, and the
/// network is not touched.
#[tokio::test]
async fn the_responses_api_is_refused_for_an_azure_upstream() {
    let gw = start_with(azure).await;
    let body = json!({"model": "az-gpt-4o", "input": "hello"});
    let resp = gw
        .post(
            "/v1/responses",
            Some(KEY_A),
            &[("x-mock-scenario", "az-responses")],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "unsupported_endpoint", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/chat/completions and /v1/embeddings only"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("az-responses"), 0);
}
