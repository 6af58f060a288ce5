//! The schemas a request carries are checked before they are compiled: reference cycles
//! and schemas over a limit are refused with 400 `invalid_schema` and no upstream call,
//! compilation never stalls other clients, and the request deadline holds.

use std::time::{Duration, Instant};

use crate::common::*;
use base64::Engine;
use serde_json::{json, Value};

fn structured(schema: Value) -> Value {
    json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "answer as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    })
}

fn with_tools(tools: Vec<Value>) -> Value {
    json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "go"}], "tools": tools})
}

fn tool(name: &str, parameters: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": parameters}})
}

/// The gateway's config with `[validation]` keys and a larger body limit.
async fn start_limited(validation: &str, body_bytes: usize, timeout: &str) -> Gateway {
    let validation = validation.to_string();
    let timeout = timeout.to_string();
    start_with(move |c| {
        c.set("server.max_body_bytes", body_bytes as i64)
            .set("server.request_timeout", timeout)
            .merge(&format!("[validation]\n{validation}\n"))
    })
    .await
}

async fn refused(resp: reqwest::Response) -> String {
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "invalid_schema", "{body}");
    body["error"]["message"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_recursive_response_format_schema_is_refused_and_the_gateway_lives_on() {
    let gw = start().await;
    // The mock would answer `{}`: validating it against this schema crashed the process.
    let resp = gw
        .chat(
            "cycle",
            "content_b64=e30=",
            structured(json!({"allOf": [{"$ref": "#"}]})),
        )
        .await;
    let message = refused(resp).await;
    assert!(
        message.contains("reference cycle that consumes no input: # -> #/allOf/0 -> #"),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("cycle"), 0);

    let through_defs = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"});
    let message = refused(
        gw.chat("cycle", "content_b64=e30=", structured(through_defs))
            .await,
    )
    .await;
    assert!(message.contains("#/$defs/a -> #/$defs/b"), "{message}");
    assert_eq!(gw.mock.attempts("cycle"), 0);

    // Still serving.
    let resp = gw
        .chat("after", "", json!({"model": "gpt-4o", "messages": []}))
        .await;
    assert_eq!(resp.status(), 200);
}

#[tokio::test]
async fn a_recursive_tool_schema_is_refused_for_openai_and_anthropic() {
    let gw = start().await;
    let cyclic = json!({"type": "object", "$defs": {"x": {"$anchor": "x", "not": {"$ref": "#x"}}}, "allOf": [{"$ref": "#x"}]});
    let resp = gw
        .chat(
            "tool-cycle",
            "tool=get_weather",
            with_tools(vec![tool("get_weather", cyclic.clone())]),
        )
        .await;
    let message = refused(resp).await;
    assert!(message.starts_with("the request's JSON schema is invalid: tool get_weather: the schema has a reference cycle"), "{message}");
    assert_eq!(gw.mock.attempts("tool-cycle"), 0);

    let body = json!({
        "model": "claude-x", "max_tokens": 100,
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": cyclic}],
    });
    let resp = gw
        .post(
            "/v1/messages",
            Some(KEY_A),
            &[("x-mock-scenario", "tool-cycle-anth")],
            body.to_string(),
        )
        .await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("reference cycle that consumes no input"),
        "{body}"
    );
    assert_eq!(gw.mock.attempts("tool-cycle-anth"), 0);
}

#[tokio::test]
async fn too_many_tools_too_deep_or_too_large_are_refused_naming_the_limit() {
    let gw = start_limited(
        "max_tools = 3\nmax_schema_bytes = 600\nmax_request_schema_bytes = 1000\nmax_schema_depth = 8",
        64 * 1024,
        "10s",
    )
    .await;
    let small = json!({"type": "object"});
    let tools = (0..4)
        .map(|i| tool(&format!("t{i}"), small.clone()))
        .collect();
    let message = refused(gw.chat("limits", "", with_tools(tools)).await).await;
    assert!(
        message.contains("the request has 4 tools; the limit (validation.max_tools) is 3"),
        "{message}"
    );

    let mut deep = json!({"type": "string"});
    for _ in 0..8 {
        deep = json!({"items": deep});
    }
    let message = refused(gw.chat("limits", "", structured(deep)).await).await;
    assert!(
        message.contains("nests 9 levels deep; the limit (validation.max_schema_depth) is 8"),
        "{message}"
    );

    let large = json!({"type": "string", "description": "x".repeat(700)});
    let message = refused(gw.chat("limits", "", structured(large)).await).await;
    assert!(
        message.contains("larger than 600 bytes (validation.max_schema_bytes)"),
        "{message}"
    );

    let medium = json!({"type": "string", "description": "x".repeat(400)});
    let tools = (0..3)
        .map(|i| tool(&format!("t{i}"), medium.clone()))
        .collect();
    let message = refused(gw.chat("limits", "", with_tools(tools)).await).await;
    assert!(
        message.contains("larger than 1000 bytes (validation.max_request_schema_bytes)"),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("limits"), 0);
}

#[tokio::test]
async fn a_recursion_that_doubles_per_level_is_refused() {
    let gw = start().await;
    // An answer nested 22 arrays deep made this 58-byte schema exhaust 3 GB.
    let doubling = json!({"allOf": [{"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]});
    let message = refused(
        gw.chat("doubling", "", with_tools(vec![tool("nest", doubling)]))
            .await,
    )
    .await;
    assert!(
        message.contains("tool nest: the schema's recursion through #/allOf/1/items reaches the same part of a value along more than one path, so validation doubles with each level of nesting"),
        "{message}"
    );
    assert_eq!(gw.mock.attempts("doubling"), 0);
}

#[tokio::test]
async fn a_legitimate_recursive_schema_still_validates_and_corrects() {
    let gw = start().await;
    let tree = json!({"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}}});
    let invalid =
        r#"{"name": "root", "children": [{"name": "a", "children": [{"children": []}]}]}"#;
    let valid = r#"{"name": "root", "children": [{"name": "a", "children": [{"name": "b", "children": []}]}]}"#;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let fault = format!("content_b64={},content_b64={}", b64(invalid), b64(valid));
    let resp = gw.chat("tree", &fault, structured(tree)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-backstop-recovery"],
        "ok,correct:schema,ok"
    );
    assert_eq!(resp.headers()["x-backstop-validation"], "corrected");
    let feedback = gw.mock.last_request("tree").unwrap()["body"]["messages"][2]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        feedback.contains("/children/0/children/0/name: "),
        "{feedback}"
    );
    assert_eq!(json(resp).await["choices"][0]["message"]["content"], valid);
}

/// Tools whose properties each carry a pattern no other uses: compiling a Unicode class
/// costs jsonschema about half a millisecond a pattern in a debug build, so a tool costs
/// tens of ms and `n` of them far more than the deadline.
fn slow_tools(n: usize) -> Value {
    let tools = (0..n)
        .map(|i| {
            let properties: serde_json::Map<String, Value> = (0..48)
                .map(|j| {
                    let pattern = format!("^[\\p{{L}}\\p{{N}}_]{{1,{}}}$", i * 48 + j + 1);
                    (
                        format!("p{j}"),
                        json!({"type": "string", "pattern": pattern}),
                    )
                })
                .collect();
            tool(
                &format!("tool_{i}"),
                json!({"type": "object", "properties": properties}),
            )
        })
        .collect();
    with_tools(tools)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compilation_does_not_stall_other_clients_and_the_deadline_holds() {
    let gw = start_limited("", 512 * 1024, "500ms").await;
    let body = slow_tools(60).to_string();
    let started = Instant::now();
    let heavy = gw.post(
        "/v1/chat/completions",
        Some(KEY_A),
        &[("x-mock-scenario", "heavy")],
        body,
    );
    let plain = async {
        // Let the heavy request reach its compilation first.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let asked = Instant::now();
        let resp = gw
            .chat("plain", "", json!({"model": "gpt-4o", "messages": []}))
            .await;
        (resp.status(), asked.elapsed())
    };
    let (heavy, (plain_status, plain_took)) = tokio::join!(heavy, plain);
    let heavy_took = started.elapsed();
    eprintln!("heavy: {heavy_took:?}, plain: {plain_took:?}");
    assert_eq!(plain_status, 200);
    assert!(
        plain_took < Duration::from_millis(500),
        "another client waited {plain_took:?}"
    );
    assert_eq!(heavy.status(), 504);
    assert_eq!(json(heavy).await["error"]["code"], "request_timeout");
    assert!(
        heavy_took < Duration::from_millis(1500),
        "the 500ms deadline answered after {heavy_took:?}"
    );
    assert_eq!(gw.mock.attempts("heavy"), 0);
}

#[test]
fn a_route_schema_with_a_cycle_stops_the_config() {
    let dir = TempDir::new("backstop-schema");
    std::fs::write(
        dir.0.join("loop.json"),
        r##"{"type": "object", "anyOf": [{"$ref": "#"}]}"##,
    )
    .unwrap();
    let text = gateway_config("127.0.0.1:9".parse().unwrap(), 9)
        .merge("[[routes]]\nmodel = \"looped\"\ntargets = [{ upstream = \"mock-openai\" }]\nresponse_schema = \"loop.json\"\n")
        .text();
    let err = backstop::config::Config::from_toml_in(&text, |_| None, &dir.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("routes[5].response_schema"), "{err}");
    assert!(
        err.contains("reference cycle that consumes no input: # -> #/anyOf/0 -> #"),
        "{err}"
    );
}
