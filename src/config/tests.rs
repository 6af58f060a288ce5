use crate::wire::Wire;
use std::collections::HashMap;

use super::*;

const BASE: &str = r#"
[server]
listen = "127.0.0.1:0"
request_timeout = "2m"

[[upstreams]]
name = "openai"
api = "openai"
base_url = "https://api.openai.com"
api_key = "${OPENAI_API_KEY}"
attempt_timeout = "250ms"

[[routes]]
model = "gpt-*"
targets = [{ upstream = "openai" }, { upstream = "openai", model = "gpt-4.1-mini" }]

[[tenants]]
name = "team-a"
api_keys = ["${TEAM_A_KEY}"]
"#;

fn env() -> HashMap<&'static str, &'static str> {
    HashMap::from([
        ("OPENAI_API_KEY", "sk-live"),
        ("TEAM_A_KEY", "bk-team-a-key"),
    ])
}

fn load(text: &str) -> Result<Config, ConfigError> {
    let env = env();
    Config::from_toml_with_env(text, |v| env.get(v).map(|s| s.to_string()))
}

fn error_of(text: &str) -> String {
    load(text)
        .expect_err("config should be refused")
        .to_string()
}

#[test]
fn the_contract_example_loads_with_env_and_durations() {
    let c = load(BASE).unwrap();
    assert_eq!(
        c.server.request_timeout,
        std::time::Duration::from_secs(120)
    );
    assert_eq!(c.server.max_body_bytes, 10 * 1024 * 1024);
    assert_eq!(
        c.upstreams[0].attempt_timeout,
        std::time::Duration::from_millis(250)
    );
    assert_eq!(c.upstreams[0].api_key.expose(), "sk-live");
    assert_eq!(c.tenants[0].api_keys[0].expose(), "bk-team-a-key");
    assert_eq!(
        c.routes[0].targets[1].model.as_deref(),
        Some("gpt-4.1-mini")
    );
}

#[test]
fn unknown_keys_are_named_with_their_path() {
    let err = error_of(&BASE.replace(
        "attempt_timeout = \"250ms\"",
        "attempt_timeout = \"250ms\"\nretries = 3",
    ));
    assert!(
        err.contains("upstreams[0]") && err.contains("retries"),
        "{err}"
    );
    let err = error_of(&BASE.replace("[server]", "[server]\nlisten_port = 1"));
    assert!(
        err.contains("server") && err.contains("listen_port"),
        "{err}"
    );
    let err = error_of(&format!("{BASE}\n[surprise]\nx = 1\n"));
    assert!(err.contains("surprise"), "{err}");
}

#[test]
fn a_missing_env_var_is_named_with_its_key() {
    let err = Config::from_toml_with_env(BASE, |v| {
        (v == "TEAM_A_KEY").then(|| "bk-team-a-key".into())
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("OPENAI_API_KEY") && err.contains("upstreams[0].api_key"),
        "{err}"
    );
}

#[test]
fn bad_values_are_refused_by_key() {
    let cases = [
        (BASE.replace("https://api.openai.com", "ftp://x"), "upstreams[0].base_url"),
        (BASE.replace("https://api.openai.com", "https://x/v1?y=1"), "upstreams[0].base_url"),
        (BASE.replace("{ upstream = \"openai\" }, ", "{ upstream = \"nope\" }, "), "routes[0].targets[0].upstream"),
        (BASE.replace("\"250ms\"", "\"0s\""), "upstreams[0].attempt_timeout"),
        (BASE.replace("\"250ms\"", "\"soon\""), "upstreams[0].attempt_timeout"),
        (BASE.replace("request_timeout = \"2m\"", "request_timeout = \"2m\"\nmax_body_bytes = 0"), "server.max_body_bytes"),
        (BASE.replace("request_timeout = \"2m\"", "request_timeout = \"2m\"\nbody_read_timeout = \"0s\""), "server.body_read_timeout"),
        (BASE.replace("api = \"openai\"", "api = \"gemini\""), "upstreams[0].api"),
        (BASE.replace("targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]", "targets = []"), "routes[0].targets"),
        (format!("{BASE}\n[[tenants]]\nname = \"team-b\"\napi_keys = [\"${{TEAM_A_KEY}}\"]\n"), "tenants[1].api_keys[0]"),
        (BASE.replace("name = \"team-a\"", "name = \"team-a\"\napi_keys_typo = []"), "tenants[0]"),
    ];
    for (text, key) in cases {
        let err = error_of(&text);
        assert!(err.contains(key), "expected {key} in: {err}");
    }
}

#[test]
fn secrets_do_not_show_in_debug_output() {
    let c = load(BASE).unwrap();
    let debug = format!("{c:?}");
    assert!(
        !debug.contains("sk-live") && !debug.contains("bk-team-a-key"),
        "{debug}"
    );
}

#[test]
fn shipped_configs_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    Config::load(format!("{root}/config/backstop.toml")).unwrap();
    let example = std::fs::read_to_string(format!("{root}/config/backstop.example.toml")).unwrap();
    Config::from_toml_with_env(&example, |v| Some(format!("{v}-value-for-test"))).unwrap();
    let replicas =
        std::fs::read_to_string(format!("{root}/config/backstop.replicas.toml")).unwrap();
    let config =
        Config::from_toml_with_env(&replicas, |v| Some(format!("{v}-value-for-test"))).unwrap();
    assert_eq!(config.state.backend, super::StateBackend::Redis);
}

#[test]
fn postgres_store_settings_are_checked_by_key() {
    let cases = [
        ("backend = \"postgres\"\n", "store.url"),
        ("backend = \"postgres\"\nurl = \"mysql://x\"\n", "store.url"),
        (
            "backend = \"postgres\"\nurl = \"postgres://h/db?sslmode=sometimes\"\n",
            "store.url",
        ),
        ("url = \"postgres://h/db\"\n", "store.url"),
        (
            // libpq's, not read: the CA is named by SSL_CERT_FILE.
            "backend = \"postgres\"\nurl = \"postgres://h/db?sslrootcert=/ca.pem\"\n",
            "store.url",
        ),
        ("pool_size = 1\n", "store.pool_size"),
        ("statement_timeout = \"1ms\"\n", "store.statement_timeout"),
        ("replica_lease = \"500ms\"\n", "store.replica_lease"),
        ("backend = \"mysql\"\n", "store"),
        ("spool = \"/var/lib/backstop/spool.db\"\n", "store.spool"),
        (
            "backend = \"postgres\"\nurl = \"postgres://h/db\"\nspool = \"/var/lib/backstop/\"\n",
            "store.spool",
        ),
        (
            "backend = \"postgres\"\nurl = \"postgres://h/db\"\nmigration_timeout = \"100ms\"\n",
            "store.migration_timeout",
        ),
        (
            "backend = \"postgres\"\nurl = \"postgres://h/db\"\nmigration_timeout = \"30d\"\n",
            "store.migration_timeout",
        ),
    ];
    for (store, key) in cases {
        let err = error_of(&format!("{BASE}\n[store]\n{store}"));
        assert!(err.contains(key), "expected {key} in: {err}");
    }
    let ok = load(&format!(
        "{BASE}\n[store]\nbackend = \"postgres\"\nurl = \"postgres://backstop@db:5432/ledger?sslmode=require\"\n"
    ))
    .unwrap();
    assert_eq!(ok.store.backend, super::StoreBackend::Postgres);
    assert_eq!(ok.store.pool_size, 16);
    assert_eq!(
        ok.store.statement_timeout,
        std::time::Duration::from_secs(5)
    );
    assert_eq!(
        ok.store.migration_timeout,
        std::time::Duration::from_secs(60)
    );
    assert_eq!(ok.store.spool_path(), "backstop-spool.db", "beside path");
}

#[test]
fn the_spool_is_beside_the_store_path_unless_named() {
    let store = |path: &str, spool: Option<&str>| super::StoreConfig {
        path: path.into(),
        spool: spool.map(str::to_owned),
        ..super::StoreConfig::default()
    };
    assert_eq!(
        store("/var/lib/backstop/ledger.db", None).spool_path(),
        "/var/lib/backstop/ledger-spool.db"
    );
    assert_eq!(store("data/ledger", None).spool_path(), "data/ledger-spool");
    assert_eq!(store(":memory:", None).spool_path(), "backstop-spool.db");
    assert_eq!(
        store("backstop.db", Some("/srv/spool.db")).spool_path(),
        "/srv/spool.db"
    );
}

#[test]
fn state_settings_are_checked_by_key() {
    let cases = [
        ("[state]\nbackend = \"redis\"\n", "state.url"),
        (
            "[state]\nbackend = \"redis\"\nurl = \"http://x\"\n",
            "state.url",
        ),
        ("[state]\nkey_prefix = \"a{b}\"\n", "state.key_prefix"),
        (
            "[state]\ncommand_timeout = \"0s\"\n",
            "state.command_timeout",
        ),
        (
            "[state]\nreservation_ttl = \"10ms\"\n",
            "state.reservation_ttl",
        ),
        ("[state]\nreplicas = 0\n", "state.replicas"),
        ("[state]\non_unavailable = \"maybe\"\n", "state"),
    ];
    for (state, key) in cases {
        let err = error_of(&format!("{BASE}\n{state}"));
        assert!(err.contains(key), "expected {key} in: {err}");
    }
    let ok = load(&format!(
        "{BASE}\n[state]\nbackend = \"redis\"\nurl = \"redis://127.0.0.1:6379/0\"\n"
    ))
    .unwrap();
    assert_eq!(ok.state.on_unavailable, super::OnUnavailable::Closed);
    assert_eq!(
        ok.state.command_timeout,
        std::time::Duration::from_millis(100)
    );
}

#[test]
fn budget_values_must_be_positive_and_are_named_by_key() {
    let cases = [
        (
            "[tenants.session]\nmax_calls = 0",
            "tenants[0].session.max_calls",
        ),
        (
            "[tenants.session]\nmax_usd = -1.0",
            "tenants[0].session.max_usd",
        ),
        (
            "[tenants.session]\nmax_tokens = -5",
            "tenants[0].session.max_tokens",
        ),
        (
            "[tenants.session]\nmax_concurrent = 0",
            "tenants[0].session.max_concurrent",
        ),
        (
            "[tenants.budget]\nusd_per_day = 0.0",
            "tenants[0].budget.usd_per_day",
        ),
        (
            "[tenants.budget]\nmin_input_tokens = 3000000000",
            "tenants[0].budget.min_input_tokens",
        ),
        ("requests_per_minute = 0", "tenants[0].requests_per_minute"),
        ("[tenants.session]\nmax_cals = 3", "tenants[0].session"),
    ];
    for (extra, key) in cases {
        let err = error_of(&format!("{BASE}{extra}\n"));
        assert!(err.contains(key), "expected {key} in: {err}");
    }
    let prices = [
        (
            "input_per_mtok = 0.0\noutput_per_mtok = 1.0",
            "prices[0].input_per_mtok",
        ),
        (
            "input_per_mtok = 1.0\noutput_per_mtok = -2.0",
            "prices[0].output_per_mtok",
        ),
    ];
    for (price, key) in prices {
        let err = error_of(&format!("[[prices]]\nmodel = \"gpt-*\"\n{price}\n{BASE}"));
        assert!(err.contains(key), "expected {key} in: {err}");
    }
    let err = error_of(&format!("[billing]\nunpriced = \"maybe\"\n{BASE}"));
    assert!(err.contains("billing.unpriced"), "{err}");
    let err = error_of(&format!("[billing]\nmin_input_tokens = -1\n{BASE}"));
    assert!(err.contains("billing.min_input_tokens"), "{err}");
    let err = error_of(&format!("[billing]\nmin_input_tokens = 3000000000\n{BASE}"));
    assert!(err.contains("billing.min_input_tokens"), "{err}");
    let floor = load(&format!(
        "[billing]\nmin_input_tokens = 50000\n{BASE}[tenants.budget]\nmin_input_tokens = 100000\n"
    ))
    .unwrap();
    assert_eq!(floor.billing.min_input_tokens, 50_000);
    assert_eq!(floor.tenants[0].budget.min_input_tokens, Some(100_000));
}

#[test]
fn hedging_needs_a_delay_and_a_second_target() {
    let one = BASE.replace(
        "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]",
        "targets = [{ upstream = \"openai\" }]\nhedge_after = \"300ms\"",
    );
    assert!(error_of(&one).contains("routes[0].hedge_after"));
    let zero = BASE.replace(
        "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]",
        "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]\nhedge_after = \"0s\"",
    );
    assert!(error_of(&zero).contains("routes[0].hedge_after"));
    let ok = BASE.replace(
        "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]",
        "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]\nhedge_after = \"300ms\"",
    );
    assert_eq!(
        load(&ok).unwrap().routes[0].hedge_after,
        Some(super::HedgeAfter::After(std::time::Duration::from_millis(
            300
        )))
    );
    let p95 = ok.replace("hedge_after = \"300ms\"", "hedge_after = \"p95\"");
    assert_eq!(
        load(&p95).unwrap().routes[0].hedge_after,
        Some(super::HedgeAfter::Percentile(0.95))
    );
    for bad in ["p0", "p100", "soon"] {
        let text = ok.replace(
            "hedge_after = \"300ms\"",
            &format!("hedge_after = \"{bad}\""),
        );
        assert!(
            error_of(&text).contains("hedge_after"),
            "{bad}: {}",
            error_of(&text)
        );
    }
}

/// A secret put by mistake where a duration, a number, a URL or a name of a kind is
/// expected: the error names the key and the kind expected, never the value.
#[test]
fn errors_never_show_a_value_from_the_environment() {
    const SECRET: &str = "9kQvXhTzWmRbLpNs\"x";
    let cases = [
        (
            BASE.replace("\"250ms\"", "\"${LEAK}\""),
            "upstreams[0].attempt_timeout",
            "expected a duration",
        ),
        (
            BASE.replace("request_timeout = \"2m\"", "request_timeout = \"${LEAK}\""),
            "server.request_timeout",
            "expected a duration",
        ),
        (
            BASE.replace("request_timeout = \"2m\"", "max_body_bytes = \"${LEAK}\""),
            "server.max_body_bytes",
            "invalid type: string, expected",
        ),
        (
            BASE.replace("https://api.openai.com", "${LEAK}"),
            "upstreams[0].base_url",
            "expected a URL that starts with http:// or https://",
        ),
        (
            BASE.replace("https://api.openai.com", "https://${LEAK}?"),
            "upstreams[0].base_url",
            "expected an http(s) origin",
        ),
        (
            BASE.replace("api = \"openai\"", "api = \"${LEAK}\""),
            "upstreams[0].api",
            "unknown variant, expected one of `openai`, `anthropic`, `azure`, `bedrock`",
        ),
        (
            BASE.replace(
                "targets = [{ upstream = \"openai\" }, {",
                "hedge_after = \"${LEAK}\"\ntargets = [{ upstream = \"openai\" }, {",
            ),
            "routes[0].hedge_after",
            "expected a duration",
        ),
        (
            BASE.replace(
                "{ upstream = \"openai\" }, ",
                "{ upstream = \"${LEAK}\" }, ",
            ),
            "routes[0].targets[0].upstream",
            "no upstream named \"${LEAK}\"",
        ),
    ];
    for (text, key, expected) in cases {
        let err = Config::from_toml_with_env(&text, |v| match v {
            "LEAK" => Some(SECRET.to_string()),
            _ => env().get(v).map(|s| s.to_string()),
        })
        .expect_err("config should be refused")
        .to_string();
        assert!(err.starts_with(&format!("{key}: ")), "{key} in: {err}");
        assert!(err.contains(expected), "{expected:?} in: {err}");
        assert!(!err.contains("kQvXhTzWmRbLpNs"), "the value in: {err}");
    }
}

#[test]
fn serde_messages_are_rendered_without_the_value() {
    for (message, rendered) in [
        (
            "invalid type: string \"sk-1, expected x\", expected u32",
            "invalid type: string, expected u32",
        ),
        (
            "invalid value: integer `-1`, expected u64",
            "invalid value: integer, expected u64",
        ),
        (
            "invalid type: floating point `1.5`, expected a string",
            "invalid type: floating point, expected a string",
        ),
        (
            "invalid type: sequence, expected a string",
            "invalid type: sequence, expected a string",
        ),
        (
            "unknown variant `sk-1`, expected `openai` or `anthropic`",
            "unknown variant, expected `openai` or `anthropic`",
        ),
        ("missing field `name`", "missing field `name`"),
        (
            "unknown variant `x`, expected `text` or `json`\nin `log.format`\n",
            "unknown variant, expected `text` or `json`",
        ),
    ] {
        assert_eq!(super::without_value(message), rendered);
    }
}

#[test]
fn a_log_level_typo_is_refused_with_the_levels_named() {
    for level in [
        "info",
        "WARN",
        "backstop=debug,warn",
        "tower_http::trace=off",
    ] {
        let c = load(&format!("[log]\nlevel = \"{level}\"\n{BASE}")).unwrap();
        assert_eq!(c.log.level, level);
    }
    for level in ["inf", "backstop=loud", "=debug", "info,"] {
        let err = error_of(&format!("[log]\nlevel = \"{level}\"\n{BASE}"));
        assert!(
            err.starts_with("log.level: ") && err.contains("trace, debug, info, warn, error, off"),
            "{level}: {err}"
        );
    }
}

#[test]
fn every_enumerated_value_names_its_key_and_the_allowed_values() {
    for (table, key, allowed) in [
        ("[log]", "log.format", "`text` or `json`"),
        ("[billing]", "billing.unpriced", "`free` or `refuse`"),
        ("[state]", "state.backend", "`embedded` or `redis`"),
        ("[state]", "state.on_unavailable", "`closed` or `open`"),
        ("[validation]", "validation.mode", "`enforce` or `annotate`"),
        (
            "[validation]",
            "validation.stream",
            "`buffer` or `passthrough`",
        ),
    ] {
        let field = key.split_once('.').unwrap().1;
        let err = error_of(&format!("{table}\n{field} = \"bogus\"\n{BASE}"));
        assert_eq!(err, format!("{key}: unknown variant, expected {allowed}"));
    }
    let err = error_of(&BASE.replace("api = \"openai\"", "api = \"gemini\""));
    assert_eq!(
        err,
        "upstreams[0].api: unknown variant, expected one of `openai`, `anthropic`, `azure`, `bedrock`"
    );
}

#[test]
fn an_upstream_overrides_retry_and_breaker_defaults_key_by_key() {
    let text = format!(
        "[retry]\nmax_attempts = 4\nbase_delay = \"100ms\"\n[breaker]\nfailure_threshold = 7\n{BASE}\n[upstreams.retry]\nmax_attempts = 1\n[upstreams.breaker]\nfailure_threshold = 2\nopen_for = \"5s\"\n\n[[upstreams]]\nname = \"other\"\napi = \"anthropic\"\nbase_url = \"https://api.anthropic.com\"\n"
    );
    let c = load(&text).unwrap();
    let (own, other) = (&c.upstreams[0], &c.upstreams[1]);
    assert_eq!(own.retry.max_attempts, 1);
    assert_eq!(own.retry.base_delay, std::time::Duration::from_millis(100));
    assert_eq!(own.retry.budget_floor, RetryConfig::default().budget_floor);
    assert_eq!(own.breaker.failure_threshold, 2);
    assert_eq!(own.breaker.open_for, std::time::Duration::from_secs(5));
    assert_eq!(own.breaker.window, BreakerConfig::default().window);
    assert_eq!(other.retry.max_attempts, 4);
    assert_eq!(other.breaker.failure_threshold, 7);
    assert_eq!(other.breaker.open_for, BreakerConfig::default().open_for);

    let err = error_of(&format!(
        "{BASE}\n[upstreams.breaker]\nfailure_threshold = 0\n"
    ));
    assert!(
        err.starts_with("upstreams[0].breaker.failure_threshold:"),
        "{err}"
    );
    let err = error_of(&format!(
        "[retry]\nmax_delay = \"1s\"\n{BASE}\n[upstreams.retry]\nbase_delay = \"2s\"\n"
    ));
    assert!(err.starts_with("upstreams[0].retry.max_delay:"), "{err}");
    let err = error_of(&format!("{BASE}\n[upstreams.retry]\nattempts = 2\n"));
    assert!(err.starts_with("upstreams[0].retry"), "{err}");
    let err = error_of(&format!("[breaker]\nopen_for = \"0s\"\n{BASE}"));
    assert!(err.starts_with("breaker.open_for:"), "{err}");
}

#[test]
fn open_min_defaults_to_a_second_and_never_exceeds_open_for() {
    use std::time::Duration;
    let c = load(BASE).unwrap();
    assert_eq!(c.upstreams[0].breaker.open_min(), Duration::from_secs(1));
    assert_eq!(c.upstreams[0].breaker.open_for, Duration::from_secs(30));
    // Unset, it follows a shorter open_for: such a config keeps a fixed opening.
    let c = load(&format!("[breaker]\nopen_for = \"500ms\"\n{BASE}")).unwrap();
    assert_eq!(
        c.upstreams[0].breaker.open_min(),
        Duration::from_millis(500)
    );
    let c = load(&format!("[breaker]\nopen_min = \"2s\"\n{BASE}")).unwrap();
    assert_eq!(c.upstreams[0].breaker.open_min(), Duration::from_secs(2));

    let err = error_of(&format!("[breaker]\nopen_min = \"31s\"\n{BASE}"));
    assert_eq!(
        err,
        "breaker.open_min: must not be greater than breaker.open_for"
    );
    let err = error_of(&format!(
        "{BASE}\n[upstreams.breaker]\nopen_min = \"5s\"\nopen_for = \"2s\"\n"
    ));
    assert_eq!(
        err,
        "upstreams[0].breaker.open_min: must not be greater than upstreams[0].breaker.open_for"
    );
    let err = error_of(&format!("[breaker]\nopen_min = \"0s\"\n{BASE}"));
    assert_eq!(err, "breaker.open_min: must be greater than 0");
}

#[test]
fn upstream_response_limits_are_upstream_keys_and_the_server_spelling_still_reads() {
    let c = load(BASE).unwrap();
    assert_eq!(c.upstreams[0].max_response_bytes, 32 * 1024 * 1024);
    assert!(c.deprecated.is_empty());

    let c = load(&format!(
        "{BASE}\n[[upstreams]]\nname = \"b\"\napi = \"openai\"\nbase_url = \"http://b\"\nmax_response_bytes = 8192\nmax_stream_duration = \"5s\"\n"
    ))
    .unwrap();
    assert_eq!(c.upstreams[0].max_response_bytes, 32 * 1024 * 1024);
    assert_eq!(c.upstreams[1].max_response_bytes, 8192);
    assert_eq!(
        c.upstreams[1].max_stream_duration,
        std::time::Duration::from_secs(5)
    );
    assert!(c.deprecated.is_empty());

    // The old spelling applies to every upstream, and is named with its new key.
    let old = BASE.replace(
        "request_timeout = \"2m\"",
        "request_timeout = \"2m\"\nmax_sse_event_bytes = 4096",
    );
    let c = load(&old).unwrap();
    assert_eq!(c.upstreams[0].max_sse_event_bytes, 4096);
    assert_eq!(
        c.deprecated,
        [(
            "server.max_sse_event_bytes".to_string(),
            "upstreams[].max_sse_event_bytes".to_string()
        )]
    );

    let both = old.replacen(
        "attempt_timeout = \"250ms\"",
        "attempt_timeout = \"250ms\"\nmax_sse_event_bytes = 8192",
        1,
    );
    let err = error_of(&both);
    assert!(
        err.starts_with("upstreams[0].max_sse_event_bytes: also set as server.max_sse_event_bytes"),
        "{err}"
    );
    let err = error_of(&BASE.replace(
        "attempt_timeout = \"250ms\"",
        "attempt_timeout = \"250ms\"\nmax_response_bytes = 0",
    ));
    assert_eq!(
        err,
        "upstreams[0].max_response_bytes: must be greater than 0"
    );
}

#[test]
fn base_url_and_api_key_are_parsed_once_into_typed_values() {
    let prefixed = BASE.replace("https://api.openai.com", "https://proxy.example/openai/");
    let c = load(&prefixed).unwrap();
    let upstream = &c.upstreams[0];
    assert_eq!(upstream.base().origin(), "https://proxy.example/openai");
    assert_eq!(
        upstream.base().join("/v1/chat/completions").as_str(),
        "https://proxy.example/openai/v1/chat/completions"
    );
    let (name, bearer) = upstream.api_key.header(UpstreamApi::OpenAi).unwrap();
    assert_eq!(
        (name.as_str(), bearer.to_str().unwrap()),
        ("authorization", "Bearer sk-live")
    );
    assert!(bearer.is_sensitive());
    let (name, bare) = upstream.api_key.header(UpstreamApi::Anthropic).unwrap();
    assert_eq!(
        (name.as_str(), bare.to_str().unwrap()),
        ("x-api-key", "sk-live")
    );
    let (name, azure) = upstream.api_key.header(UpstreamApi::Azure).unwrap();
    assert_eq!(
        (name.as_str(), azure.to_str().unwrap()),
        ("api-key", "sk-live")
    );
    assert!(azure.is_sensitive());
    assert!(!format!("{upstream:?}").contains("sk-live"));

    let keyless = load(&BASE.replace("api_key = \"${OPENAI_API_KEY}\"\n", "")).unwrap();
    assert_eq!(
        keyless.upstreams[0].api_key.header(UpstreamApi::OpenAi),
        None
    );
    let err = error_of(&BASE.replace("${OPENAI_API_KEY}", "sk\\nlive"));
    assert_eq!(
        err,
        "upstreams[0].api_key: contains characters not allowed in an HTTP header"
    );
}

const AZURE: &str = "\n[[upstreams]]\nname = \"azure\"\napi = \"azure\"\nbase_url = \"https://example.openai.azure.com\"\napi_version = \"2024-10-21\"\n";

#[test]
fn azure_needs_its_api_version_and_the_others_refuse_one() {
    let c = load(&format!("{BASE}{AZURE}")).unwrap();
    let azure = &c.upstreams[1];
    assert_eq!(azure.api, UpstreamApi::Azure);
    assert_eq!(azure.api.wire("gpt-4o", Wire::Messages), Wire::Chat);
    assert_eq!(azure.api.wire("gpt-4o", Wire::Responses), Wire::Responses);
    assert_eq!(azure.api_version.as_deref(), Some("2024-10-21"));

    let err = error_of(&format!(
        "{BASE}{}",
        AZURE.replace("api_version = \"2024-10-21\"\n", "")
    ));
    assert!(
        err.starts_with("upstreams[1].api_version: is required"),
        "{err}"
    );
    let err = error_of(&format!(
        "{BASE}{}",
        AZURE.replace("2024-10-21", "2024-10-21&x=1")
    ));
    assert!(
        err.starts_with("upstreams[1].api_version: expected a version"),
        "{err}"
    );
    let err = error_of(&BASE.replace(
        "api = \"openai\"",
        "api = \"openai\"\napi_version = \"2024-10-21\"",
    ));
    assert_eq!(
        err,
        "upstreams[0].api_version: is only for api = \"azure\" (this upstream has api = \"openai\")"
    );
}

const BEDROCK: &str =
    "\n[[upstreams]]\nname = \"bedrock\"\napi = \"bedrock\"\nregion = \"eu-west-1\"\n";

#[test]
fn bedrock_needs_a_region_and_takes_explicit_keys_only_as_a_set() {
    let c = load(&format!("{BASE}{BEDROCK}")).unwrap();
    let bedrock = &c.upstreams[1];
    assert_eq!(bedrock.api, UpstreamApi::Bedrock);
    assert_eq!(
        bedrock.base().origin(),
        "https://bedrock-runtime.eu-west-1.amazonaws.com"
    );
    assert_eq!(
        bedrock
            .api
            .wire("anthropic.claude-3-haiku-20240307-v1:0", Wire::Chat),
        Wire::Messages
    );
    assert_eq!(
        bedrock.api.wire(
            "global.anthropic.claude-sonnet-4-5-20250929-v1:0",
            Wire::Responses
        ),
        Wire::Messages
    );
    assert_eq!(
        bedrock.api.wire("amazon.nova-pro-v1:0", Wire::Messages),
        Wire::Converse
    );
    assert_eq!(bedrock.api_key.header(bedrock.api), None);

    let refused = [
        (
            BEDROCK.replace("region = \"eu-west-1\"\n", ""),
            "upstreams[1].region: is required when api = \"bedrock\"",
        ),
        (
            BEDROCK.replace("eu-west-1", "EU West"),
            "upstreams[1].region: is required when api = \"bedrock\"",
        ),
        (
            format!("{BEDROCK}api_key = \"k\"\n"),
            "upstreams[1].api_key: is not read for api = \"bedrock\"",
        ),
        (
            format!("{BEDROCK}access_key_id = \"AKID\"\n"),
            "upstreams[1].secret_access_key: is required with access_key_id",
        ),
        (
            format!("{BEDROCK}secret_access_key = \"s\"\n"),
            "upstreams[1].access_key_id: is required with secret_access_key",
        ),
        (
            format!("{BEDROCK}session_token = \"t\"\n"),
            "upstreams[1].session_token: is only read with access_key_id and secret_access_key",
        ),
        (
            format!("{BEDROCK}access_key_id = \"\"\nsecret_access_key = \"s\"\n"),
            "upstreams[1].access_key_id: must not be empty",
        ),
    ];
    for (upstream, expected) in refused {
        let err = error_of(&format!("{BASE}{upstream}"));
        assert!(err.starts_with(expected), "{err}");
    }
    let err = error_of(&BASE.replace(
        "api = \"openai\"",
        "api = \"openai\"\nregion = \"us-east-1\"",
    ));
    assert_eq!(
        err,
        "upstreams[0].region: is only for api = \"bedrock\" (this upstream has api = \"openai\")"
    );
    let err = error_of(&BASE.replace("base_url = \"https://api.openai.com\"\n", ""));
    assert!(
        err.starts_with("upstreams[0].base_url: is required"),
        "{err}"
    );

    // A target naming a model Bedrock serves over Converse only is refused at load.
    let converse = format!(
        "{}{BEDROCK}",
        BASE.replace(
            "{ upstream = \"openai\", model = \"gpt-4.1-mini\" }",
            "{ upstream = \"bedrock\", model = \"amazon.nova-pro-v1:0\" }"
        )
    );
    let err = error_of(&converse);
    assert!(err.starts_with("routes[0].targets[1].model: \"amazon.nova-pro-v1:0\" is not one of Anthropic's Bedrock models"), "{err}");
}

#[test]
fn stored_responses_are_never_sent_to_azure() {
    let only_azure = format!(
        "{}{AZURE}",
        BASE.replace(
            "targets = [{ upstream = \"openai\" }, { upstream = \"openai\", model = \"gpt-4.1-mini\" }]",
            "targets = [{ upstream = \"azure\" }, { upstream = \"openai\" }]"
        )
    );
    let c = load(&only_azure).unwrap();
    assert_eq!(
        c.responses_upstream(),
        Some("openai"),
        "azure is passed over"
    );
    let err = error_of(&format!("[responses]\nupstream = \"azure\"\n{only_azure}"));
    assert!(err.starts_with("responses.upstream:"), "{err}");
    assert!(err.contains("api = \"azure\""), "{err}");
}

/// `[tenants.guard.fleet]`: off without the table, its defaults with an empty one, and
/// each bad value refused by its key.
#[test]
fn the_fleet_view_is_off_by_default_and_checked_by_key() {
    let guarded = format!("{BASE}\n[tenants.guard]\n");
    let c = load(&guarded).unwrap();
    assert_eq!(c.tenants[0].guard.as_ref().unwrap().fleet, None);
    let c = load(&format!("{guarded}\n[tenants.guard.fleet]\n")).unwrap();
    let fleet = c.tenants[0].guard.as_ref().unwrap().fleet.clone().unwrap();
    assert_eq!(fleet, FleetConfig::default());
    assert_eq!(
        (fleet.min_sessions, fleet.min_failures, fleet.preempt),
        (3, 2, false)
    );
    let cases = [
        ("min_sessions = 1", "tenants[0].guard.fleet.min_sessions"),
        ("min_sessions = 1001", "tenants[0].guard.fleet.min_sessions"),
        ("min_failures = 0", "tenants[0].guard.fleet.min_failures"),
        ("window = \"0s\"", "tenants[0].guard.fleet.window"),
        ("cool_down = \"500ms\"", "tenants[0].guard.fleet.cool_down"),
        ("cool_down = \"soon\"", "tenants[0].guard.fleet.cool_down"),
        ("min_session = 3", "min_session"),
    ];
    for (line, key) in cases {
        let err = error_of(&format!("{guarded}\n[tenants.guard.fleet]\n{line}\n"));
        assert!(err.contains(key), "expected {key} in: {err}");
    }
}

#[test]
fn workers_default_to_the_runtimes_choice_and_are_refused_out_of_range() {
    assert_eq!(load(BASE).unwrap().server.workers, None);
    let with = |n: &str| BASE.replacen("[server]\n", &format!("[server]\nworkers = {n}\n"), 1);
    assert_eq!(load(&with("1")).unwrap().server.workers, Some(1));
    assert_eq!(load(&with("1024")).unwrap().server.workers, Some(1024));
    for refused in ["0", "1025"] {
        assert_eq!(
            error_of(&with(refused)),
            "server.workers: must be between 1 and 1024"
        );
    }
    assert!(error_of(&with("-1")).contains("server.workers"));
}
