//! Side effects committed once, measured (issue 49):
//!
//! - **Replan to zero**: an agent sends three emails (`send_email` to a, b, c: three
//!   model turns proposing them, one answering "done"), loses its state, and starts over
//!   on the same session; the model, as replanned models do, proposes the same three
//!   emails again. Printed: the emails the agent sent, the model calls made and the
//!   session's dollars, with `[tenants.side_effects]` off and on (`on_repeat =
//!   "correct"`).
//! - **What the journal costs a request**: one session request carrying ten tool results
//!   (five of a listed tool) and answered with text, through one gateway, for a tenant
//!   without the table and one with it, taking turns request by request; p50 and p99.
//!
//!     cargo run --release --example replan

mod common;

use std::time::Instant;

use backstop::{mock, server};
use common::*;
use serde_json::{json, Value};
use tokio::net::TcpListener;

const OFF: &str = "bk-replan-off-key";
const ON: &str = "bk-replan-on-key";

fn config(mock: std::net::SocketAddr) -> backstop::config::Config {
    in_process_config(
        mock,
        &format!(
            r#"
[[prices]]
model = "gpt-*"
input_per_mtok = 2.5
output_per_mtok = 10.0
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "off"
api_keys = ["{OFF}"]
[[tenants]]
name = "on"
api_keys = ["{ON}"]
[tenants.side_effects]
tools = ["send_email"]
"#
        ),
    )
}

fn b64(text: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(text)
}

fn email(to: &str) -> String {
    json!({"to": format!("{to}@example.com"), "subject": "invoice"}).to_string()
}

/// The model's script for the whole session: each run proposes a, b, c, then is done.
fn script() -> String {
    let turn = |to: &str| {
        format!(
            "tool=send_email;tool_args_b64={};usage=1000/100",
            b64(&email(to))
        )
    };
    let run = ["a", "b", "c"].map(turn).join(",") + ",content=all three sent;usage=1000/20";
    format!("{run},{run}")
}

/// One agent run from an empty state: it executes every `send_email` the model asks
/// for, feeds the result back, and stops at the first answer without a tool call.
async fn run(http: &reqwest::Client, url: &str, key: &str, session: &str, sent: &mut u32) -> u32 {
    let mut messages = vec![json!({"role": "user", "content": "Email a, b and c the invoice."})];
    let mut turns = 0;
    loop {
        turns += 1;
        let resp = http
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth(key)
            .header("x-session-id", session)
            .header("x-mock-scenario", session)
            .header("x-mock-fault", script())
            .body(json!({"model": "gpt-4o", "messages": messages}).to_string())
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert_eq!(status, 200, "{text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        let message = answer["choices"][0]["message"].clone();
        let Some(calls) = message["tool_calls"]
            .as_array()
            .filter(|c| !c.is_empty())
            .cloned()
        else {
            return turns;
        };
        messages.push(message);
        for call in calls {
            *sent += 1; // the agent sends the email
            messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "sent"}));
        }
    }
}

async fn replan(http: &reqwest::Client, url: &str, mock: &mock::MockHandle) {
    println!("| side effects | emails sent | model calls | dollars |\n|---|---|---|---|");
    for (key, name, label) in [(OFF, "off", "off"), (ON, "on", "on (correct)")] {
        let session = format!("replan-{name}");
        let mut sent = 0;
        run(http, url, key, &session, &mut sent).await;
        run(http, url, key, &session, &mut sent).await; // state lost: from zero
        let report: Value = serde_json::from_str(
            &http
                .get(format!("{url}/v1/sessions/{session}"))
                .bearer_auth(key)
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap(),
        )
        .unwrap();
        println!(
            "| {label} | {sent} | {} | ${:.4} |",
            mock.attempts(&session),
            report["used"]["usd"].as_f64().unwrap_or(0.0)
        );
    }
}

/// A request of a long tool loop: ten results fed back, five of them `send_email`.
fn loop_request(n: usize) -> String {
    let mut messages = vec![json!({"role": "user", "content": "work"})];
    for i in 0..10 {
        let tool = if i % 2 == 0 { "send_email" } else { "lookup" };
        let id = format!("call_{n}_{i}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": tool, "arguments": email(&format!("u{i}"))}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "done"}));
    }
    json!({"model": "gpt-4o", "messages": messages}).to_string()
}

async fn cost(http: &reqwest::Client, url: &str) {
    let mut times = [Vec::new(), Vec::new()];
    for round in 0..4 {
        for n in 0..500usize {
            for k in [n % 2, 1 - n % 2] {
                let key = [OFF, ON][k];
                let body = loop_request(n);
                let started = Instant::now();
                let resp = http
                    .post(format!("{url}/v1/chat/completions"))
                    .bearer_auth(key)
                    .header("x-session-id", format!("cost-{round}-{n}"))
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                let _ = resp.bytes().await;
                if round > 0 {
                    times[k].push(started.elapsed());
                }
            }
        }
    }
    for t in &mut times {
        t.sort();
    }
    println!(
        "\n| a session request, 10 tool results (5 listed) | p50 ms | p99 ms |\n|---|---|---|"
    );
    for (k, label) in [
        "without `[tenants.side_effects]`",
        "with it (5 entries journaled)",
    ]
    .iter()
    .enumerate()
    {
        println!(
            "| {label} | {:.3} | {:.3} |",
            pct(&times[k], 0.5),
            pct(&times[k], 0.99)
        );
    }
    println!(
        "\nadded by the journal: p50 {:+.3} ms, p99 {:+.3} ms ({} requests each)",
        pct(&times[1], 0.5) - pct(&times[0], 0.5),
        pct(&times[1], 0.99) - pct(&times[0], 0.99),
        times[0].len()
    );
}

#[tokio::main]
async fn main() {
    let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let gw = server::spawn(config(mock.addr)).await.unwrap();
    let url = format!("http://{}", gw.addr);
    let http = reqwest::Client::new();
    replan(&http, &url, &mock).await;
    cost(&http, &url).await;
    gw.shutdown().await;
}
