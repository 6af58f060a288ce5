//! Config reload without a restart: what changes, what carries on, what is refused.
//! Real gateway and mock on real sockets; the config is a real file, rewritten and
//! reloaded (`POST /admin/reload`, the server handle, and `SIGHUP` on the binary).

use std::{path::PathBuf, time::Duration};

use crate::common::*;
use backstop::{config::Config, mock, server};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const CAPPED: &str = "bk-capped-key-01";
const GUARDED: &str = "bk-guarded-key-01";
const LATE: &str = "bk-late-key-0001";

/// A gateway serving a config file: the test config plus `extra`; `rewrite` replaces the
/// extra part and leaves the rest as it was.
struct Reloadable {
    gw: Gateway,
    base: TestConfig,
    path: PathBuf,
    _dir: TempDir,
}

fn tenants(max_calls: u32) -> String {
    let prices = admin_and_prices();
    format!(
        r#"{prices}
[breaker]
failure_threshold = 2
open_for = "60s"
open_min = "60s"

[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
[tenants.session]
max_calls = {max_calls}

[[tenants]]
name = "guarded"
api_keys = ["{GUARDED}"]
[tenants.guard]
max_consecutive_failures = 2
cool_down = "60s"
"#
    )
}

impl Reloadable {
    async fn start(extra: &str) -> Reloadable {
        let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let base = gateway_config(mock.addr, dead_port().await);
        let dir = TempDir::new("backstop-reload");
        let path = dir.0.join("backstop.toml");
        std::fs::write(&path, base.clone().merge(extra).text()).unwrap();
        let config = Config::load(&path).expect("test config is valid");
        let server = server::spawn(config).await.expect("gateway starts");
        Reloadable {
            gw: Gateway {
                url: format!("http://{}", server.addr),
                mock,
                server,
                http: reqwest::Client::new(),
            },
            base,
            path,
            _dir: dir,
        }
    }

    /// Rewrites the file: the test config plus `extra`.
    fn rewrite(&self, extra: &str) {
        self.rewrite_all(&self.base.clone().merge(extra));
    }

    fn rewrite_all(&self, config: &TestConfig) {
        std::fs::write(&self.path, config.text()).unwrap();
    }

    /// `POST /admin/reload`, as an operator would.
    async fn reload(&self) -> reqwest::Response {
        self.gw
            .http
            .post(format!("{}/admin/reload", self.gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
    }

    async fn admin(&self, path: &str) -> Value {
        let resp = self
            .gw
            .http
            .get(format!("{}{path}", self.gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        json(resp).await
    }

    /// A stream of `chunks` chunks 150 ms apart, its head received.
    async fn stream(
        &self,
        key: &str,
        session: &str,
        scenario: &str,
        chunks: u32,
    ) -> reqwest::Response {
        let fault = format!("chunks={chunks};chunk_delay=150ms");
        let resp = self
            .gw
            .post(
                "/v1/chat/completions",
                Some(key),
                &[
                    ("x-session-id", session),
                    ("x-mock-scenario", scenario),
                    ("x-mock-fault", &fault),
                ],
                json!({"model": "gpt-4o", "max_tokens": 50, "stream": true,
                       "messages": [{"role": "user", "content": "long"}]})
                .to_string(),
            )
            .await;
        assert_eq!(resp.status(), 200);
        resp
    }

    async fn call(&self, key: &str, session: &str, fault: &str) -> reqwest::Response {
        self.gw
            .in_session(key, session, "reload", fault, &say("hello"))
            .await
    }
}

/// A chat completion saying `content`, with a small `max_tokens` so that spend is counted.
fn say(content: &str) -> Chat {
    chat("gpt-4o").max_tokens(50).saying(content)
}

impl Reloadable {
    /// A chat completion of `model` as tenant `key`, with extra headers.
    async fn ask(&self, key: &str, model: &str, headers: &[(&str, &str)]) -> reqwest::Response {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "x"}]});
        self.gw
            .post("/v1/chat/completions", Some(key), headers, body.to_string())
            .await
    }
}

async fn budget_refusal(resp: reqwest::Response) -> Value {
    assert_eq!(resp.status(), 402);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
    assert_eq!(body["error"]["param"], "session.max_calls", "{body}");
    body
}

#[tokio::test]
async fn a_raised_cap_applies_mid_stream_and_earlier_calls_still_count() {
    let r = Reloadable::start(&tenants(5)).await;
    // A stream in flight across the reload: 6 chunks, 150 ms apart.
    let stream = r.stream(CAPPED, "s", "reload-stream", 6).await;
    for _ in 0..4 {
        assert_eq!(r.call(CAPPED, "s", "").await.status(), 200);
    }
    let body = budget_refusal(r.call(CAPPED, "s", "").await).await;
    assert!(
        body["error"]["message"].as_str().unwrap().contains('5'),
        "{body}"
    );

    r.rewrite(&tenants(10));
    let resp = r.reload().await;
    assert_eq!(resp.status(), 200);
    let reloaded = json(resp).await;
    assert_eq!(reloaded["reloaded"], true);
    assert_eq!(reloaded["config"]["version"], 2);
    assert_eq!(reloaded["restart_required"], json!([]));

    // The stream started under the old config runs to its end.
    let text = stream.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(text.matches("\"delta\"").count() >= 6, "{text}");

    // 5 calls made (the stream among them); 5 more under the new cap, then refused.
    for i in 0..5 {
        assert_eq!(
            r.call(CAPPED, "s", "").await.status(),
            200,
            "call {}",
            i + 6
        );
    }
    let body = budget_refusal(r.call(CAPPED, "s", "").await).await;
    assert!(
        body["error"]["message"].as_str().unwrap().contains("10"),
        "{body}"
    );
    let report = r.admin("/admin/tenants/capped/sessions/s").await;
    assert_eq!(report["used"]["calls"], 10, "{report}");
    assert_eq!(
        r.gw.mock.attempts("reload") + r.gw.mock.attempts("reload-stream"),
        10
    );
    assert_eq!(r.admin("/admin/config").await["config"]["version"], 2);
    // The dashboard shows the running version and when it was loaded.
    let config = &r.admin("/admin/ui/data").await["config"];
    assert_eq!(config["version"], 2, "{config}");
    assert_eq!(
        config["loaded_at"], reloaded["config"]["loaded_at"],
        "{config}"
    );
}

#[tokio::test]
async fn an_invalid_file_keeps_the_running_config_and_says_where() {
    let r = Reloadable::start(&tenants(2)).await;
    assert_eq!(r.call(CAPPED, "s", "").await.status(), 200);

    r.rewrite_all(
        &r.base
            .clone()
            .merge(&tenants(2))
            .set("tenants.capped.session.max_calls", "ten"),
    );
    let resp = r.reload().await;
    assert_eq!(resp.status(), 400);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "config_invalid", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("tenants[2].session.max_calls"),
        "{message}"
    );

    // The same error text as check-config gives for the file.
    let check = Config::load(&r.path).unwrap_err().to_string();
    assert!(message.ends_with(&check), "{message} vs {check}");

    r.rewrite("[[upstreams]]\nname = \"x\"\n");
    let body = json(r.reload().await).await;
    assert_eq!(body["error"]["code"], "config_invalid", "{body}");

    // Nothing changed: version 1, the old cap (2) still holds, the session still counts.
    assert_eq!(r.admin("/admin/config").await["config"]["version"], 1);
    assert_eq!(r.call(CAPPED, "s", "").await.status(), 200);
    budget_refusal(r.call(CAPPED, "s", "").await).await;
    let metrics =
        r.gw.http
            .get(format!("{}/metrics", r.gw.url))
            .send()
            .await
            .unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics.contains("backstop_config_reloads_total{outcome=\"invalid\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn state_carries_on_for_names_that_stay() {
    let r = Reloadable::start(&tenants(5)).await;
    // A breaker opened (the dead upstream), a session tripped, spend, an idempotent call.
    for _ in 0..2 {
        let resp = r.ask(KEY_A, "dead-model", &[]).await;
        assert!(resp.status().is_server_error());
    }
    let breaker = |v: &Value, name: &str| {
        v["upstreams"]
            .as_array()
            .unwrap()
            .iter()
            .find(|u| u["name"] == name)
            .map(|u| u["breaker"]["state"].clone())
            .unwrap()
    };
    assert_eq!(breaker(&r.admin("/admin/upstreams").await, "dead"), "open");
    for _ in 0..2 {
        let resp = r.call(GUARDED, "loop", "status=400").await;
        assert_eq!(resp.status(), 400);
    }
    assert_eq!(r.call(GUARDED, "loop", "").await.status(), 429);
    for _ in 0..3 {
        assert_eq!(
            r.call(CAPPED, "spent", "usage=1000/500").await.status(),
            200
        );
    }
    let spend_before = r.admin("/admin/tenants/capped").await;
    let keyed = || {
        r.gw.post(
            "/v1/chat/completions",
            Some(KEY_A),
            &[("idempotency-key", "once"), ("x-mock-scenario", "keyed")],
            say("once").to_string(),
        )
    };
    assert_eq!(keyed().await.status(), 200);

    // The reload: a new route and a new tenant, team-b removed, the guard's threshold
    // raised; everything named as before keeps its state.
    let late = format!(
        "[[routes]]\nmodel = \"late-model\"\ntargets = [{{ upstream = \"mock-openai\" }}]\n\n[[tenants]]\nname = \"late\"\napi_keys = [\"{LATE}\"]\n",
    );
    r.rewrite_all(
        &r.base
            .clone()
            .merge(&tenants(5))
            .set("tenants.guarded.guard.max_consecutive_failures", 4)
            .merge(&late)
            .remove("tenants.team-b"),
    );
    let resp = r.reload().await;
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());

    assert_eq!(breaker(&r.admin("/admin/upstreams").await, "dead"), "open");
    let tripped = r.call(GUARDED, "loop", "").await;
    assert_eq!(tripped.status(), 429);
    assert_eq!(json(tripped).await["error"]["code"], "session_tripped");
    let spend_after = r.admin("/admin/tenants/capped").await;
    assert_eq!(spend_after["today"], spend_before["today"], "{spend_after}");
    let replayed = keyed().await;
    assert_eq!(replayed.status(), 200);
    assert_eq!(replayed.headers()["x-backstop-replayed"], "true");
    assert_eq!(r.gw.mock.attempts("keyed"), 1);

    // New names are served; a removed tenant's key no longer is.
    let resp = r.ask(LATE, "late-model", &[]).await;
    assert_eq!(resp.status(), 200);
    let resp = r.ask(KEY_B, "gpt-4o", &[]).await;
    assert_eq!(resp.status(), 401);
}

#[tokio::test]
async fn a_stream_in_flight_finishes_on_the_upstream_it_started_with() {
    let r = Reloadable::start(&tenants(5)).await;
    let stream = r.stream(KEY_A, "any", "before", 5).await;
    // gpt-* now goes to the dead upstream.
    let moved = r.base.clone().merge(&tenants(5)).set(
        "routes.gpt-*.targets",
        toml_value(r#"[{ upstream = "dead" }]"#),
    );
    r.rewrite_all(&moved);
    assert_eq!(r.reload().await.status(), 200);
    let text = stream.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let after = r
        .ask(KEY_A, "gpt-4o", &[("x-mock-scenario", "after")])
        .await;
    assert!(after.status().is_server_error(), "{}", after.status());
    assert_eq!(r.gw.mock.attempts("after"), 0);
    assert_eq!(r.gw.mock.attempts("before"), 1);
}

#[tokio::test]
async fn start_up_keys_are_kept_and_named() {
    let r = Reloadable::start(&tenants(5)).await;
    let changed = r
        .base
        .clone()
        .set("server.listen", "127.0.0.1:1")
        .set("server.workers", 3)
        .set("log.level", "debug")
        .merge(&tenants(7))
        .set("telemetry.otlp_endpoint", "http://127.0.0.1:1");
    r.rewrite_all(&changed);
    let resp = r.reload().await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(
        body["restart_required"],
        json!(["server.listen", "server.workers", "log", "telemetry"]),
        "{body}"
    );
    // Still served where it was; the rest applied.
    let current = r.gw.server.current();
    assert_eq!(current.state.config.server.listen.port(), 0);
    assert_eq!(current.state.config.server.workers, None);
    assert!(current.state.traces.is_none());
    assert_eq!(current.state.config.tenants[2].session.max_calls, Some(7));
    assert_eq!(r.call(CAPPED, "s", "").await.status(), 200);
}

/// The config of a real binary on its built-in mock with the `capped` tenant: `before`
/// goes ahead of the upstreams (a table such as `[breaker]`), `tenant` after the tenant's
/// keys (its own tables).
fn binary_config(port: u16, mock_port: u16, before: &str, tenant: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
drain_delay = "0s"
[log]
level = "warn"
[mock]
listen = "127.0.0.1:{mock_port}"
[store]
path = ":memory:"
[admin]
token = "{ADMIN}"
{before}[[upstreams]]
name = "mock"
api = "openai"
base_url = "http://127.0.0.1:{mock_port}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "mock" }}]
[[tenants]]
name = "capped"
api_keys = ["{CAPPED}"]
{tenant}"#
    )
}

/// `POST /admin/reload` to a real binary, as its operator.
async fn reload_binary(http: &reqwest::Client, url: &str) -> reqwest::Response {
    http.post(format!("{url}/admin/reload"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn reload_needs_the_admin_token() {
    let r = Reloadable::start(&tenants(5)).await;
    let resp =
        r.gw.http
            .post(format!("{}/admin/reload", r.gw.url))
            .bearer_auth(KEY_A)
            .send()
            .await
            .unwrap();
    assert_eq!(resp.status(), 401);
    assert_eq!(r.admin("/admin/config").await["config"]["version"], 1);
}

#[tokio::test]
async fn sighup_reloads_the_real_binary() {
    let dir = TempDir::new("backstop-sighup");
    let port = free_port();
    let mock_port = free_port();
    let path = dir.0.join("backstop.toml");
    let text = |max_calls: u32| {
        binary_config(
            port,
            mock_port,
            "",
            &format!("[tenants.session]\nmax_calls = {max_calls}\n"),
        )
    };
    std::fs::write(&path, text(1)).unwrap();
    let gw = Binary::start(&path, port).await;
    let http = reqwest::Client::new();
    let call = || {
        http.post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(CAPPED)
            .header("x-session-id", "h")
            .body(say("x").to_string())
            .send()
    };
    assert_eq!(call().await.unwrap().status(), 200);
    assert_eq!(call().await.unwrap().status(), 402);
    std::fs::write(&path, text(2)).unwrap();
    gw.signal("HUP");
    let mut version = Value::Null;
    for _ in 0..100 {
        let resp = http
            .get(format!("{}/admin/config", gw.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        version = json(resp).await["config"]["version"].clone();
        if version == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(version, 2, "SIGHUP did not reload");
    assert_eq!(call().await.unwrap().status(), 200);
    assert_eq!(call().await.unwrap().status(), 402);
    // An invalid file on SIGHUP: logged, the process and its config carry on.
    std::fs::write(&path, "not toml [").unwrap();
    gw.signal("HUP");
    let refused = "backstop_config_reloads_total{outcome=\"invalid\"} 1";
    let mut metrics = String::new();
    for _ in 0..100 {
        let resp = http
            .get(format!("{}/metrics", gw.url))
            .send()
            .await
            .unwrap();
        metrics = resp.text().await.unwrap();
        if metrics.contains(refused) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        metrics.contains(refused),
        "the reload was not refused: {metrics}"
    );
    let resp = http
        .get(format!("{}/admin/config", gw.url))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(json(resp).await["config"]["version"], 2);
}

/// A secret put by mistake into a duration through `${ENV}`: the refusal names the key
/// and the kind of value expected, in the answer of `POST /admin/reload` and in the log
/// of a `SIGHUP`, and shows nothing of the value (humantime's own message would quote
/// all of it after the first digit).
#[tokio::test]
async fn a_refused_reload_never_shows_a_value_from_the_environment() {
    const SECRET: &str = "9kQvXhTzWmRbLpNs";
    const TAIL: &str = "kQvXhTzWmRbLpNs";
    let dir = TempDir::new("backstop-reload-secret");
    let port = free_port();
    let mock_port = free_port();
    let path = dir.0.join("backstop.toml");
    let log_path = dir.0.join("stderr.log");
    let text = |open_for: &str| {
        binary_config(
            port,
            mock_port,
            &format!("[breaker]\nopen_for = \"{open_for}\"\n"),
            "",
        )
    };
    std::fs::write(&path, text("60s")).unwrap();
    let log = std::fs::File::create(&log_path).unwrap();
    let leak = format!("BACKSTOP_TEST_LEAK={SECRET}");
    let gw = Binary::start_under(&["env", &leak], &path, port, log.into()).await;
    std::fs::write(&path, text("${BACKSTOP_TEST_LEAK}")).unwrap();

    let http = reqwest::Client::new();
    let resp = reload_binary(&http, &gw.url).await;
    assert_eq!(resp.status(), 400);
    let body = json(resp).await;
    assert_eq!(body["error"]["code"], "config_invalid", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("breaker.open_for: expected a duration"),
        "{message}"
    );
    assert!(!body.to_string().contains(TAIL), "{body}");

    gw.signal("HUP");
    // Both refusals are logged with the key: the endpoint's and the signal's.
    let logged = |log: &str| log.matches("breaker.open_for: expected a duration").count();
    let mut log = String::new();
    for _ in 0..100 {
        log = std::fs::read_to_string(&log_path).unwrap();
        if logged(&log) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(logged(&log), 2, "{log}");
    assert!(!log.contains(TAIL), "{log}");
}

/// `server.workers` sizes the real binary's runtime (replicas sharing a host take their
/// share of its cores); a reload cannot change a running runtime, so it says so.
#[tokio::test]
async fn the_binary_runs_on_the_workers_it_was_given_and_a_reload_names_a_change() {
    let dir = TempDir::new("backstop-workers");
    let port = free_port();
    let mock_port = free_port();
    let path = dir.0.join("backstop.toml");
    let text = |workers: usize| {
        binary_config(port, mock_port, "", "").replacen(
            "drain_delay = \"0s\"\n",
            &format!("drain_delay = \"0s\"\nworkers = {workers}\n"),
            1,
        )
    };
    // Never what the runtime would choose on its own, whatever the machine.
    let given = std::thread::available_parallelism().map_or(1, |n| n.get()) + 1;
    std::fs::write(&path, text(given)).unwrap();
    let gw = Binary::start(&path, port).await;
    let http = reqwest::Client::new();
    let metrics = || async {
        let resp = http
            .get(format!("{}/metrics", gw.url))
            .send()
            .await
            .unwrap();
        resp.text().await.unwrap()
    };
    let shown = format!("\nbackstop_runtime_workers {given}\n");
    assert!(metrics().await.contains(&shown), "{}", metrics().await);
    std::fs::write(&path, text(1)).unwrap();
    let resp = reload_binary(&http, &gw.url).await;
    assert_eq!(resp.status(), 200);
    let body = json(resp).await;
    assert_eq!(
        body["restart_required"],
        json!(["server.workers"]),
        "{body}"
    );
    assert!(metrics().await.contains(&shown));
}

/// The mock upstream binary takes its runtime's threads too (benchmarks run it beside
/// the gateways on the same cores), and refuses a count of none before it starts.
#[tokio::test]
async fn the_mock_upstream_binary_takes_workers_and_refuses_none() {
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["mock-upstream", "--listen", "127.0.0.1:0", "--workers", "0"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--workers"));

    let mock = MockUpstream::start_with(&["--workers", "1"]).await;
    assert_eq!(mock.attempts("anything").await, 0);
}
