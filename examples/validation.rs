//! What validation costs: added latency on a valid ~2 KB JSON answer, with and without a
//! `response_format` in the same run, and the schema cache's hit rate over 10,000
//! requests that share 3 schemas.
//!
//!     cargo build --release && cargo run --release --example validation -- [REQUESTS]

#[path = "common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;

use base64::Engine;
use serde_json::{json, Value};

const KEY: &str = "bk-bench-validation1";

fn schema(variant: usize) -> Value {
    json!({
        "type": "object",
        "properties": {
            "report": {"type": "string"},
            "variant": {"const": variant},
            "items": {"type": "array", "items": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["id", "name", "score", "tags"],
                "additionalProperties": false
            }}
        },
        "required": ["report", "variant", "items"],
        "additionalProperties": false
    })
}

fn answer(variant: usize) -> String {
    let items: Vec<Value> = (0..20).map(|i| json!({"id": i, "name": format!("item number {i}"), "score": i as f64 * 1.5, "tags": ["alpha", "beta", "gamma"]})).collect();
    json!({"report": "x".repeat(460), "variant": variant, "items": items}).to_string()
}

async fn run(
    http: &reqwest::Client,
    url: &str,
    bodies: &[(String, String)],
    n: usize,
) -> Vec<Duration> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let (body, fault) = &bodies[i % bodies.len()];
        let t = Instant::now();
        let resp = http
            .post(url)
            .bearer_auth(KEY)
            .header("x-mock-fault", fault)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
        lat.push(t.elapsed());
    }
    lat.sort();
    lat
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let (port, mock_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("backstop-validation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("v.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[log]\nlevel = \"warn\"\n[store]\npath = \":memory:\"\n[mock]\nlisten = \"127.0.0.1:{mock_port}\"\n\
             [[upstreams]]\nname = \"mock\"\napi = \"openai\"\nforward_headers = [\"x-mock-*\"]\nbase_url = \"http://127.0.0.1:{mock_port}\"\n\
             [[routes]]\nmodel = \"gpt-*\"\ntargets = [{{ upstream = \"mock\" }}]\n[[tenants]]\nname = \"b\"\napi_keys = [\"{KEY}\"]\n"
        ),
    )
    .unwrap();
    let _gw = Proc::spawn(
        &backstop_bin(),
        &["serve", "--config", config.to_str().unwrap()],
    );
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if http
            .get(format!("{url}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let chat = format!("{url}/v1/chat/completions");
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let with: Vec<(String, String)> = (0..3)
        .map(|v| {
            let body = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "report"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": format!("r{v}"), "schema": schema(v), "strict": true}}});
            (body.to_string(), format!("content_b64={}", b64(&answer(v))))
        })
        .collect();
    let without: Vec<(String, String)> = (0..3)
        .map(|v| {
            (
                json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "report"}]})
                    .to_string(),
                format!("content_b64={}", b64(&answer(v))),
            )
        })
        .collect();
    println!("answer size: {} bytes of JSON content", answer(0).len());
    run(&http, &chat, &without, 500).await; // warm-up
    let off = run(&http, &chat, &without, n).await;
    let on = run(&http, &chat, &with, n).await;
    println!("\n{n} sequential requests each, release build, same run\n");
    println!("| validation | p50 ms | p99 ms |\n|---|---|---|");
    println!(
        "| off (no response_format) | {:.3} | {:.3} |",
        pct(&off, 0.5),
        pct(&off, 0.99)
    );
    println!(
        "| on (json_schema, valid answer) | {:.3} | {:.3} |",
        pct(&on, 0.5),
        pct(&on, 0.99)
    );
    println!(
        "| added | {:+.3} | {:+.3} |",
        pct(&on, 0.5) - pct(&off, 0.5),
        pct(&on, 0.99) - pct(&off, 0.99)
    );
    let metrics = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let count = |result: &str| -> f64 {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("backstop_schema_cache_total")
                    && l.contains(&format!("result=\"{result}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let (hits, misses) = (count("hit"), count("miss"));
    println!("\nschema cache over {} validated requests sharing 3 schemas: {hits} hits, {misses} misses, hit rate {:.2}%", n, hits / (hits + misses) * 100.0);
    let _ = std::fs::remove_dir_all(dir);
}
