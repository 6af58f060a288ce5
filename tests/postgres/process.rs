//! Replica binaries on a PostgreSQL ledger, for the tests that need real processes (a
//! `kill -9`, an environment of their own, an exit code): their config, and a run that
//! is expected to end.

use std::{
    path::Path,
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use crate::common::admin_and_prices;
use crate::postgres_support::Postgres;

pub const KEY: &str = "bk-process-key-0001";

/// A replica on `127.0.0.1:port` whose ledger is `[store]` and whose live state is
/// `[state]` (their lines, `backend` included), sending to `mock`; tenant `fleet` (key
/// [`KEY`]) has a day cap, so each of its calls is budgeted.
pub fn replica_toml(port: u16, store: &str, state: &str, mock: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
request_timeout = "30s"
drain_delay = "0s"
shutdown_grace = "1s"

[log]
level = "info"

[store]
{store}

[state]
{state}
{admin_and_prices}
[[upstreams]]
name = "mock"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
api_key = "sk-mock-not-secret"
attempt_timeout = "30s"

[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]

[[tenants]]
name = "fleet"
api_keys = ["{KEY}"]
[tenants.budget]
usd_per_day = 1000.0
"#,
        admin_and_prices = admin_and_prices(),
    )
}

/// Runs `backstop serve` on `config` with `env` set, expecting it to exit (it must not
/// start); its exit status and what it wrote to stderr.
pub fn serve_until_exit(config: &Path, env: &[(&str, &str)]) -> (ExitStatus, String) {
    let log = config.with_extension("log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "still running after 60s: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (status, std::fs::read_to_string(&log).unwrap())
}

/// A budgeted chat call through the replica at `url`, in mock scenario `scenario`
/// with `fault` (none if empty).
pub async fn call(
    http: &reqwest::Client,
    url: &str,
    scenario: &str,
    fault: &str,
) -> reqwest::Result<reqwest::Response> {
    let mut req = http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(KEY)
        .header("x-mock-scenario", scenario)
        .body(serde_json::Value::from(crate::common::chat("gpt-4o").max_tokens(16)).to_string());
    if !fault.is_empty() {
        req = req.header("x-mock-fault", fault);
    }
    req.send().await
}

/// Polls `db` until its ledger holds `rows` rows and no reservation is left open, for
/// 30 s at most; what it holds then: (ledger rows, open reservations).
pub async fn ledger_settles(pg: &Postgres, db: &str, rows: u64) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held: u64 = pg.psql(db, "SELECT COUNT(*) FROM ledger").parse().unwrap();
        let open: u64 = pg
            .psql(db, "SELECT COUNT(*) FROM reservations")
            .parse()
            .unwrap();
        if (held, open) == (rows, 0) || Instant::now() > deadline {
            return (held, open);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
