//! Test harness: the real gateway on 127.0.0.1:0 in front of the real mock upstream.
// Each test binary uses part of the kit.
#![allow(dead_code, unused_imports)]

mod body;
mod config;
pub mod journal;
pub mod layer;
mod mock_process;
mod ports;
mod wait;

pub use body::{chat, Chat};
pub use config::{toml_value, TestConfig};
pub use mock_process::MockUpstream;
pub use ports::free_port;
pub use wait::{until, until_some, PATIENCE};

use std::net::SocketAddr;

use backstop::{clock::Clock, mock, server};
use serde_json::Value;
use tokio::net::TcpListener;

pub const KEY_A: &str = "bk-test-a-key";
pub const KEY_B: &str = "bk-test-b-key";
/// The `[admin] token` of [`admin_and_prices`].
pub const ADMIN: &str = "admin-token-0123456789";

/// Config text for the budget and guard tests: the admin API on, and a price for the
/// `gpt-4o*` models so that spend is counted.
pub fn admin_and_prices() -> String {
    format!(
        r#"
[admin]
token = "{ADMIN}"

[[prices]]
model = "gpt-4o*"
input_per_mtok = 2.5
output_per_mtok = 10.0
"#
    )
}

/// `config` with `store` (e.g. `path = "/tmp/x.db"`) as its whole `[store]` section.
pub fn with_store(config: TestConfig, store: &str) -> TestConfig {
    config.remove("store").merge(&format!("[store]\n{store}"))
}

/// An edit for [`start_with`]: `keys` (TOML lines) merged into the `[server]` section.
pub fn server_keys(keys: &str) -> impl FnOnce(TestConfig) -> TestConfig + '_ {
    move |config| config.merge(&format!("[server]\n{keys}"))
}

/// An edit for [`start_with`]: config text (routes, tenants) merged in.
pub fn append(extra: &str) -> impl FnOnce(TestConfig) -> TestConfig + '_ {
    move |config| config.merge(extra)
}

pub struct Gateway {
    pub url: String,
    pub mock: mock::MockHandle,
    pub server: server::ServerHandle,
    pub http: reqwest::Client,
}

/// The sockets that hold the dead ports (bound for the life of the test process, so the
/// kernel hands none of them out again).
static DEAD: std::sync::Mutex<Vec<tokio::net::TcpSocket>> = std::sync::Mutex::new(Vec::new());

/// A port nothing listens on, ever: bound (so nothing else can take it) but never
/// listening, so a connection to it is refused. Held for the life of the test process.
pub async fn dead_port() -> u16 {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = socket.local_addr().unwrap().port();
    DEAD.lock().unwrap().push(socket);
    port
}

/// The test config: a gateway in front of the mock at `mock`, with an upstream `dead`
/// on a port nothing listens on and one (`slow`) whose attempts time out quickly.
pub fn gateway_config(mock: SocketAddr, dead: u16) -> TestConfig {
    TestConfig::parse(&format!(
        r#"
[server]
listen = "127.0.0.1:0"
max_body_bytes = 4096
request_timeout = "10s"
shutdown_grace = "5s"

[log]
level = "warn"

[store]
path = ":memory:"

[retry]
base_delay = "1ms"
max_delay = "5ms"
max_retry_after = "2s"

[[upstreams]]
name = "mock-openai"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}"
api_key = "sk-provider-openai"
attempt_timeout = "5s"

[[upstreams]]
name = "mock-anthropic"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}/"
api_key = "sk-provider-anthropic"
attempt_timeout = "5s"

[[upstreams]]
name = "dead"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://127.0.0.1:{dead}"
api_key = "x"
attempt_timeout = "2s"

[[upstreams]]
name = "slow"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{mock}"
api_key = "x"
attempt_timeout = "200ms"

[[routes]]
model = "gpt-*"
models = ["gpt-4o", "gpt-4o-mini"]
targets = [{{ upstream = "mock-openai" }}]

[[routes]]
model = "rewrite-me"
targets = [{{ upstream = "mock-openai", model = "gpt-4o-mini" }}]

[[routes]]
model = "claude-*"
targets = [{{ upstream = "mock-anthropic" }}]

[[routes]]
model = "dead-model"
targets = [{{ upstream = "dead" }}]

[[routes]]
model = "slow-model"
targets = [{{ upstream = "slow" }}]

[[tenants]]
name = "team-a"
api_keys = ["{KEY_A}"]

[[tenants]]
name = "team-b"
api_keys = ["{KEY_B}"]
"#
    ))
}

pub async fn start() -> Gateway {
    start_with(|config| config).await
}

/// Starts the mock and a gateway whose config ([`gateway_config`]) `edit` may change.
pub async fn start_with(edit: impl FnOnce(TestConfig) -> TestConfig) -> Gateway {
    start_with_clock(edit, Clock::system()).await
}

/// As [`start_with`], with the gateway's live state on `clock`: a test moves time for
/// the state under test with [`Clock::skip`] instead of sleeping.
pub async fn start_with_clock(
    edit: impl FnOnce(TestConfig) -> TestConfig,
    clock: Clock,
) -> Gateway {
    let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
    let config = edit(gateway_config(mock.addr, dead_port().await)).config();
    let server = server::spawn_with_clock(config, clock)
        .await
        .expect("gateway starts");
    Gateway {
        url: format!("http://{}", server.addr),
        mock,
        server,
        http: reqwest::Client::new(),
    }
}

impl Gateway {
    /// POSTs `body` to `path` with the tenant key and extra headers.
    pub async fn post(
        &self,
        path: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        let mut req = self.http.post(format!("{}{path}", self.url)).body(body);
        if let Some(key) = key {
            req = if path == "/v1/messages" {
                req.header("x-api-key", key)
            } else {
                req.bearer_auth(key)
            };
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.unwrap()
    }

    /// GETs `path`, with `token` (a tenant key or the admin token) as a bearer.
    pub async fn get(&self, path: &str, token: Option<&str>) -> reqwest::Response {
        let mut req = self.http.get(format!("{}{path}", self.url));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        req.send().await.unwrap()
    }

    /// A chat completion as tenant A, with a mock scenario and an optional fault script.
    pub async fn chat(
        &self,
        scenario: &str,
        fault: &str,
        body: impl Into<Value>,
    ) -> reqwest::Response {
        let mut headers = vec![("x-mock-scenario", scenario)];
        if !fault.is_empty() {
            headers.push(("x-mock-fault", fault));
        }
        self.post(
            "/v1/chat/completions",
            Some(KEY_A),
            &headers,
            body.into().to_string(),
        )
        .await
    }
}

impl Gateway {
    /// A chat completion in a session, with a mock scenario and an optional fault script.
    pub async fn in_session(
        &self,
        key: &str,
        session: &str,
        scenario: &str,
        fault: &str,
        body: &Value,
    ) -> reqwest::Response {
        let mut headers = vec![("x-session-id", session), ("x-mock-scenario", scenario)];
        if !fault.is_empty() {
            headers.push(("x-mock-fault", fault));
        }
        self.post(
            "/v1/chat/completions",
            Some(key),
            &headers,
            body.to_string(),
        )
        .await
    }
}

impl Gateway {
    /// The `/metrics` page.
    pub async fn metrics(&self) -> String {
        self.get("/metrics", None).await.text().await.unwrap()
    }

    /// `GET path` with `token` as a bearer, as JSON.
    pub async fn get_json(&self, path: &str, token: Option<&str>) -> Value {
        json(self.get(path, token).await).await
    }

    /// The tenant's report on `session` (`/v1/sessions/{session}`) once `settled` holds
    /// for it: spend is settled after a response body ends, off the request's path.
    pub async fn session_report_when(
        &self,
        key: &str,
        session: &str,
        settled: impl Fn(&Value) -> bool,
    ) -> Value {
        let path = format!("/v1/sessions/{session}");
        let (path, settled) = (&path, &settled);
        until_some(&format!("the report on {session}"), move || async move {
            let report = self.get_json(path, Some(key)).await;
            settled(&report).then_some(report)
        })
        .await
    }
}

pub async fn json(resp: reqwest::Response) -> Value {
    let text = resp.text().await.unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The real `backstop` binary, serving a config file (with its built-in mock).
pub struct Binary {
    pub url: String,
    pub config: std::path::PathBuf,
    child: std::process::Child,
}

impl Binary {
    /// Starts the binary on `config` and waits until it is ready.
    pub async fn start(config: &std::path::Path, port: u16) -> Binary {
        Self::start_with(config, port, std::process::Stdio::null()).await
    }

    /// As [`Binary::start`], with the binary's stderr (its logs) going to `stderr`.
    pub async fn start_with(
        config: &std::path::Path,
        port: u16,
        stderr: std::process::Stdio,
    ) -> Binary {
        Self::start_under(&[], config, port, stderr).await
    }

    /// As [`Binary::start_with`], run by the command `wrapper` (e.g. `prlimit` and its
    /// options); none when empty.
    pub async fn start_under(
        wrapper: &[&str],
        config: &std::path::Path,
        port: u16,
        stderr: std::process::Stdio,
    ) -> Binary {
        let binary = env!("CARGO_BIN_EXE_backstop");
        let (program, args) = match wrapper.split_first() {
            Some((program, args)) => (*program, [args, &[binary]].concat()),
            None => (binary, Vec::new()),
        };
        let child = std::process::Command::new(program)
            .args(args)
            .args(["serve", "--config", config.to_str().unwrap()])
            .stderr(stderr)
            .spawn()
            .unwrap();
        // Owned from here on, so the process is killed even if it never gets ready.
        let binary = Binary {
            url: format!("http://127.0.0.1:{port}"),
            config: config.to_path_buf(),
            child,
        };
        let http = reqwest::Client::new();
        for _ in 0..200 {
            if http
                .get(format!("{}/readyz", binary.url))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
            {
                return binary;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("backstop did not start");
    }

    /// SIGTERM, then waits for the graceful stop (another process: blocking here cannot
    /// deadlock it); returns what the binary wrote to a piped stderr.
    pub fn terminate(mut self) -> String {
        self.signal("TERM");
        let _ = self.child.wait();
        let mut text = String::new();
        if let Some(err) = self.child.stderr.as_mut() {
            std::io::Read::read_to_string(err, &mut text).unwrap();
        }
        text
    }

    /// The process's anonymous resident memory (heap and stacks), in KiB.
    pub fn rss_anon_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("RssAnon in /proc/PID/status")
    }

    /// Sends the process a signal (`"HUP"`, ...).
    pub fn signal(&self, name: &str) {
        std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    /// SIGKILL: no graceful shutdown, no flushing.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A temporary folder, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
