//! `backstop report`: the real binary reads the SQLite ledger a gateway wrote and prints
//! spend per tenant, UTC day and model, exactly; bad arguments are refused by name with
//! exit code 2. The gateway's clock is pinned to a date so the days in the output are
//! known, and skipped a day to spend on two of them.

use std::{process::Output, time::Duration};

use backstop::clock::Clock;
use serde_json::{json, Value};

use crate::common::{
    admin_and_prices, chat, start_with_clock, until, with_store, TempDir, ADMIN, KEY_A, KEY_B,
};

/// Tenant B's calls report `{"prompt_tokens":3000,"completion_tokens":2000,"total_tokens":5000,
/// "prompt_tokens_details":{"cached_tokens":1000},"completion_tokens_details":{"reasoning_tokens":500}}`:
/// 2,000 plain input, 1,000 read from the cache (priced at the input price: the test's
/// `gpt-4o*` price gives cached input no price of its own), 2,000 output of which 500
/// reasoning.
const CACHED: &str = "usage_b64=eyJwcm9tcHRfdG9rZW5zIjozMDAwLCJjb21wbGV0aW9uX3Rva2VucyI6MjAwMCwidG90YWxfdG9rZW5zIjo1MDAwLCJwcm9tcHRfdG9rZW5zX2RldGFpbHMiOnsiY2FjaGVkX3Rva2VucyI6MTAwMH0sImNvbXBsZXRpb25fdG9rZW5zX2RldGFpbHMiOnsicmVhc29uaW5nX3Rva2VucyI6NTAwfX0=";

/// 2025-12-01T12:00:00Z.
const DAY_ONE_NOON_MS: i64 = 20_423 * 86_400_000 + 12 * 3_600_000;

fn report(config: &std::path::Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_backstop"))
        .arg("report")
        .arg("--config")
        .arg(config)
        .args(args)
        .output()
        .expect("run backstop report")
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// A gateway on a file store writes the ledger: tenant A spends on 2025-12-01 and
/// 2025-12-02, tenant B on 2025-12-02; a report is read while it serves; tenant B
/// spends once more; then it stops, and the report is read from the
/// file. Returns the folder (holding the config), the config's path, and the CSV report
/// read while the gateway was still serving from the file.
async fn ledger_written_by_a_gateway() -> (TempDir, std::path::PathBuf, String) {
    let dir = TempDir::new("backstop-report");
    let store = format!("path = \"{}\"", dir.0.join("ledger.db").display());
    let mut text = String::new();
    let clock = Clock::starting_at(DAY_ONE_NOON_MS);
    let gw = start_with_clock(
        |config| {
            // No load balancer to tell: stop at once rather than after the default delay.
            let config = with_store(config, &store)
                .merge(&admin_and_prices())
                .merge("[server]\ndrain_delay = \"0s\"");
            text = config.text();
            config
        },
        clock.clone(),
    )
    .await;
    let call = |key: &'static str, model: &'static str, usage: &'static str| {
        let gw = &gw;
        async move {
            let resp = gw
                .post(
                    "/v1/chat/completions",
                    Some(key),
                    &[("x-mock-scenario", "report"), ("x-mock-fault", usage)],
                    chat(model).json().to_string(),
                )
                .await;
            assert_eq!(resp.status(), 200);
            resp.bytes().await.unwrap();
        }
    };
    // gpt-4o* costs $2.50 per million input tokens and $10 per million output tokens.
    call(KEY_A, "gpt-4o", "usage=1000/500").await; // $0.0075
    call(KEY_A, "gpt-4o", "usage=1000/500").await;
    settled(&gw, "team-a", 2).await;
    clock.skip(Duration::from_secs(86_400));
    call(KEY_A, "gpt-4o-mini", "usage=400/100").await; // $0.002
    call(KEY_B, "gpt-4o", CACHED).await; // $0.0275
    settled(&gw, "team-a", 1).await;
    settled(&gw, "team-b", 1).await;
    // The admin view reads the same rows: two days of tenant A by model.
    let view = gw
        .get_json("/admin/tenants/team-a?days=2", Some(ADMIN))
        .await;
    assert_eq!(view["days"], 2, "{view}");
    assert_eq!(
        view["by_day"],
        json!([
            {"day": 20_423, "date": "2025-12-01", "model": "gpt-4o", "calls": 2,
             "input_tokens": 2000, "output_tokens": 1000, "cache_write_tokens": 0,
             "cache_write_1h_tokens": 0, "cache_read_tokens": 0, "reasoning_tokens": 0,
             "web_searches": 0, "tokens": 3000, "usd": 0.015},
            {"day": 20_424, "date": "2025-12-02", "model": "gpt-4o-mini", "calls": 1,
             "input_tokens": 400, "output_tokens": 100, "cache_write_tokens": 0,
             "cache_write_1h_tokens": 0, "cache_read_tokens": 0, "reasoning_tokens": 0,
             "web_searches": 0, "tokens": 500, "usd": 0.002},
        ])
    );
    // Without `days` the view is as it was; a window that is not 1 to 366 days is refused.
    let today = gw.get_json("/admin/tenants/team-a", Some(ADMIN)).await;
    assert!(today.get("by_day").is_none(), "{today}");
    assert_eq!(today["by_model"][0]["model"], "gpt-4o-mini", "{today}");
    for days in ["0", "367", "x", ""] {
        let resp = gw
            .get(&format!("/admin/tenants/team-a?days={days}"), Some(ADMIN))
            .await;
        assert_eq!(resp.status(), 400, "days={days}");
        let body = crate::common::json(resp).await;
        assert_eq!(body["error"]["param"], "days", "{body}");
    }
    let config = dir.0.join("backstop.toml");
    std::fs::write(&config, text).unwrap();
    let while_serving = stdout(&report(&config, &[]));
    // The reader took nothing from the gateway: it still writes to its ledger.
    call(KEY_B, "gpt-4o", CACHED).await;
    settled(&gw, "team-b", 2).await;
    gw.server.shutdown().await;
    (dir, config, while_serving)
}

/// Waits until today's ledger holds `calls` calls of `tenant` (settles are written after
/// the response body ends, off the request's path).
async fn settled(gw: &crate::common::Gateway, tenant: &str, calls: u64) {
    let path = format!("/admin/tenants/{tenant}?days=1");
    until(
        &format!("{calls} calls of {tenant} in today's ledger"),
        || {
            let path = path.clone();
            async move {
                let view = gw.get_json(&path, Some(ADMIN)).await;
                let rows = view["by_day"].as_array().cloned().unwrap_or_default();
                rows.iter()
                    .map(|r| r["calls"].as_u64().unwrap_or(0))
                    .sum::<u64>()
                    == calls
            }
        },
    )
    .await;
}

#[tokio::test]
async fn report_prints_the_ledger_a_gateway_wrote_as_csv_and_json() {
    let (_dir, config, while_serving) = ledger_written_by_a_gateway().await;
    let header = "tenant,day,model,calls,input_tokens,output_tokens,cache_write_tokens,cache_write_1h_tokens,cache_read_tokens,reasoning_tokens,web_searches,usd\n";
    let a1 = "team-a,2025-12-01,gpt-4o,2,2000,1000,0,0,0,0,0,0.015000\n";
    let a2 = "team-a,2025-12-02,gpt-4o-mini,1,400,100,0,0,0,0,0,0.002000\n";
    let b2 = "team-b,2025-12-02,gpt-4o,1,2000,2000,0,0,1000,500,0,0.027500\n";
    assert_eq!(while_serving, format!("{header}{a1}{a2}{b2}"));
    let b2 = "team-b,2025-12-02,gpt-4o,2,4000,4000,0,0,2000,1000,0,0.055000\n";
    assert_eq!(
        stdout(&report(&config, &[])),
        format!("{header}{a1}{a2}{b2}")
    );
    assert_eq!(
        stdout(&report(&config, &["--tenant", "team-a"])),
        format!("{header}{a1}{a2}")
    );
    assert_eq!(
        stdout(&report(&config, &["--from", "2025-12-02"])),
        format!("{header}{a2}{b2}")
    );
    assert_eq!(
        stdout(&report(
            &config,
            &[
                "--from",
                "2025-12-01",
                "--to",
                "2025-12-01",
                "--format",
                "csv"
            ]
        )),
        format!("{header}{a1}")
    );
    assert_eq!(
        stdout(&report(&config, &["--tenant", "nobody"])),
        header,
        "no spend: the header alone"
    );

    let json: Value =
        serde_json::from_str(&stdout(&report(&config, &["--format", "json"]))).unwrap();
    assert_eq!(
        json,
        json!([
            {"tenant": "team-a", "day": "2025-12-01", "model": "gpt-4o", "calls": 2,
             "input_tokens": 2000, "output_tokens": 1000, "cache_write_tokens": 0,
             "cache_write_1h_tokens": 0, "cache_read_tokens": 0, "reasoning_tokens": 0,
             "web_searches": 0, "usd": 0.015},
            {"tenant": "team-a", "day": "2025-12-02", "model": "gpt-4o-mini", "calls": 1,
             "input_tokens": 400, "output_tokens": 100, "cache_write_tokens": 0,
             "cache_write_1h_tokens": 0, "cache_read_tokens": 0, "reasoning_tokens": 0,
             "web_searches": 0, "usd": 0.002},
            {"tenant": "team-b", "day": "2025-12-02", "model": "gpt-4o", "calls": 2,
             "input_tokens": 4000, "output_tokens": 4000, "cache_write_tokens": 0,
             "cache_write_1h_tokens": 0, "cache_read_tokens": 2000, "reasoning_tokens": 1000,
             "web_searches": 0, "usd": 0.055},
        ])
    );
    let usd: f64 = json
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["usd"].as_f64().unwrap())
        .sum();
    assert!((usd - 0.072).abs() < 1e-9, "{usd}");
    let b: Value = serde_json::from_str(&stdout(&report(
        &config,
        &[
            "--format",
            "json",
            "--tenant",
            "team-b",
            "--to",
            "2025-12-01",
        ],
    )))
    .unwrap();
    assert_eq!(b, json!([]));
}

/// Each refusal: exit code 2 (the arguments or the config), or 1 (the store), a message
/// that names what is wrong, nothing on stdout, and never a panic.
#[tokio::test]
async fn report_refuses_bad_arguments_by_name_with_exit_code_2() {
    let dir = TempDir::new("backstop-report-args");
    let memory = dir.0.join("memory.toml");
    let text = crate::common::gateway_config("127.0.0.1:9".parse().unwrap(), 9).text();
    std::fs::write(&memory, &text).unwrap();
    let missing = dir.0.join("missing.toml");
    std::fs::write(
        &missing,
        with_store(
            crate::common::TestConfig::parse(&text),
            &format!("path = \"{}\"", dir.0.join("none.db").display()),
        )
        .text(),
    )
    .unwrap();
    let cases: &[(&std::path::Path, &[&str], u8, &str)] = &[
        (
            &missing,
            &["--from", "2025-02-30"],
            2,
            "`2025-02-30` is not a day of the calendar",
        ),
        (
            &missing,
            &["--to", "12/01/2025"],
            2,
            "`12/01/2025` is not a date: expected YYYY-MM-DD",
        ),
        (
            &missing,
            &["--from", "2025-12-02", "--to", "2025-12-01"],
            2,
            "--from 2025-12-02 is after --to 2025-12-01",
        ),
        (
            &missing,
            &["--format", "xml"],
            2,
            "`xml` is not a format: csv or json",
        ),
        (&dir.0.join("nowhere.toml"), &[], 2, "nowhere.toml"),
        (&memory, &[], 2, "store.path is \":memory:\""),
        (&missing, &[], 1, "unable to open database file"),
    ];
    for (config, args, code, says) in cases {
        let out = report(config, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(i32::from(*code)),
            "{args:?}: {stderr}"
        );
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    assert!(
        !dir.0.join("none.db").exists(),
        "a report never creates a store"
    );
}

/// A model name is the caller's to choose and a tenant's is free text, so either may
/// read as a spreadsheet formula: the CSV writes such a name as text (a leading `'`),
/// quoted as RFC 4180 asks when it holds a quote or a comma; the JSON keeps it as it is.
#[tokio::test]
async fn report_csv_writes_names_a_spreadsheet_would_run_as_text() {
    let dir = TempDir::new("backstop-report-formula");
    let store = format!("path = \"{}\"", dir.0.join("ledger.db").display());
    let mut text = String::new();
    let gw = start_with_clock(
        |config| {
            let config = with_store(config, &store)
                .merge(&admin_and_prices())
                .merge("[server]\ndrain_delay = \"0s\"")
                .merge(
                    r#"
[[routes]]
model = "*"
targets = [{ upstream = "mock-openai" }]

[[tenants]]
name = "@finance"
api_keys = ["bk-formula-key-0001"]
"#,
                );
            text = config.text();
            config
        },
        Clock::starting_at(DAY_ONE_NOON_MS),
    )
    .await;
    let hyperlink = r#"=HYPERLINK("http://evil.example","refund")"#;
    for model in ["-1+2", hyperlink] {
        let resp = gw
            .post(
                "/v1/chat/completions",
                Some("bk-formula-key-0001"),
                &[("x-mock-fault", "usage=1000/500")],
                chat(model).json().to_string(),
            )
            .await;
        assert_eq!(resp.status(), 200, "{model}");
        resp.bytes().await.unwrap();
    }
    settled(&gw, "@finance", 2).await;
    gw.server.shutdown().await;
    let config = dir.0.join("backstop.toml");
    std::fs::write(&config, text).unwrap();
    assert_eq!(
        stdout(&report(&config, &["--tenant", "@finance"])),
        "tenant,day,model,calls,input_tokens,output_tokens,cache_write_tokens,cache_write_1h_tokens,cache_read_tokens,reasoning_tokens,web_searches,usd\n\
         '@finance,2025-12-01,'-1+2,1,1000,500,0,0,0,0,0,0.000000\n\
         '@finance,2025-12-01,\"'=HYPERLINK(\"\"http://evil.example\"\",\"\"refund\"\")\",1,1000,500,0,0,0,0,0,0.000000\n"
    );
    let json: Value = serde_json::from_str(&stdout(&report(
        &config,
        &["--tenant", "@finance", "--format", "json"],
    )))
    .unwrap();
    assert_eq!(json[0]["tenant"], "@finance");
    assert_eq!(json[1]["model"], hyperlink);
}
