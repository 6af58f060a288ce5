//! Recovery scenarios end to end: the real server in front of real mocks whose faults are
//! drawn from fixed seeds. Each asserts counts (success, attempts per request, exact
//! attempts, breaker refusals), never timings; latencies are printed (`--nocapture`) and
//! measured by `backstop demo`.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use backstop::{
    config::Config,
    mock::{self, FaultMix, MockHandle},
    server,
};
use serde_json::Value;
use tokio::net::TcpListener;

const KEY: &str = "bk-scenario-key-0001";

async fn mock_on(mix: &str, seed: u64) -> MockHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    mock::spawn_seeded(listener, FaultMix::parse(mix).unwrap(), seed)
}

/// A gateway with route `gpt-*` over `primary` then `backup`, the demo's recovery
/// settings, and `breaker` as `[breaker]` (`failure_threshold` 5 unless it says). Both upstreams get the client's
/// `x-mock-*` headers unless `backup_scripted` is false.
async fn gateway(
    primary: &MockHandle,
    backup: &MockHandle,
    breaker: &str,
    backup_scripted: bool,
    route: &str,
    attempt_timeout: &str,
) -> server::ServerHandle {
    let backup_forwards = if backup_scripted {
        "forward_headers = [\"x-mock-*\"]"
    } else {
        ""
    };
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_timeout = "30s"
[log]
level = "error"
[store]
path = ":memory:"
[retry]
max_attempts = 3
base_delay = "200ms"
max_delay = "5s"
max_retry_after = "10s"
[breaker]
{breaker}
[[upstreams]]
name = "primary"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://{primary}"
attempt_timeout = "{attempt_timeout}"
[[upstreams]]
name = "backup"
api = "openai"
{backup_forwards}
base_url = "http://{backup}"
attempt_timeout = "{attempt_timeout}"
[[routes]]
model = "gpt-*"
targets = [{{ upstream = "primary" }}, {{ upstream = "backup" }}]
{route}
[[tenants]]
name = "scenarios"
api_keys = ["{KEY}"]
"#,
        primary = primary.addr,
        backup = backup.addr,
    );
    server::spawn(Config::from_toml_with_env(&text, |_| None).unwrap())
        .await
        .unwrap()
}

/// One scenario at a time: each drives 1,000 real-time requests with 1 s attempt
/// timeouts, and run side by side on a 2-core machine they stretch each other's
/// timeouts into failures that are the machine's, not recovery's (a storm measured
/// 987/1000 beside the others, 993-999 alone).
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Outcome {
    status: u16,
    code: String,
    took: Duration,
    recovery: String,
}

async fn call(http: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> Outcome {
    let started = Instant::now();
    let mut req = http
        .post(url)
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hello"}]}"#);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let recovery = resp
        .headers()
        .get("x-backstop-recovery")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap_or_default();
    Outcome {
        status,
        code: body["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        took: started.elapsed(),
        recovery,
    }
}

/// `total` requests over `concurrency` closed-loop clients.
async fn drive(
    url: &str,
    total: usize,
    concurrency: usize,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<Outcome> {
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (http, url, next) = (http.clone(), url.to_string(), next.clone());
            tokio::spawn(async move {
                let mut out = Vec::new();
                while next.fetch_add(1, Ordering::Relaxed) < total {
                    out.push(call(&http, &url, headers).await);
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

fn p99_ms(outcomes: &[Outcome]) -> f64 {
    let mut took: Vec<Duration> = outcomes.iter().map(|o| o.took).collect();
    took.sort();
    took[(took.len() - 1) * 99 / 100].as_secs_f64() * 1e3
}

/// The storm of issue 14: each attempt on either target fails 20% with 503, 10% with
/// 429 (Retry-After 1 s), 5% by a reset, 5% by hanging past the 1 s attempt timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_storm_is_recovered_at_low_amplification() {
    let _alone = ALONE.lock().await;
    storm("").await;
}

/// The same storm with hedging on: as many successes, no more attempts (a hang's
/// attempt is made anyway; the hedge replaces the retry that would follow it). The
/// demo hedges at 300 ms; see [`STORM_ATTEMPT_TIMEOUT`] for why this one waits longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_storm_is_recovered_at_the_same_amplification() {
    let _alone = ALONE.lock().await;
    storm("hedge_after = \"600ms\"").await;
}

/// The storms' attempt timeout. A `hang` never answers, so it times out at any value;
/// an answer that is merely slow must not. At 1 s (and a 300 ms hedge) a loaded machine
/// turns slow answers into timeouts and hedges: a hedged storm measured 1.81 attempts per
/// request beside six busy processes, when clean answers took 240 ms at p50 (2 ms
/// unloaded, 102 ms at most). That is the machine's failure, not recovery's: 2 s, and a
/// 600 ms hedge, leave the scripted hangs as the only timeouts and hedges.
const STORM_ATTEMPT_TIMEOUT: &str = "2s";

/// The storms' breakers: 10 failures in a row, and out for 1 s. The storms measure
/// retries and hedges; with the default breaker (5 in a row, out for 30 s) twice a run
/// came out at 1866 and 1875 of 2000 with "open:backup" starting every slow request's
/// trail: the backup's breaker had opened and stayed open for the rest of the run, so
/// whatever the primary failed had nowhere to go. A breaker judges its rate on what its
/// window holds, so early in a run, or after a stall that times out every attempt in
/// flight, five in a row can open it in a 35%-failing storm. The breaker's own behaviour
/// is the hard-down and brownout scenarios' to test, with the default.
const STORM_BREAKER: &str = "failure_threshold = 10\nopen_for = \"1s\"";

async fn storm(route: &str) {
    let primary = mock_on(backstop::demo::STORM, 14).await;
    let backup = mock_on(backstop::demo::STORM, 41).await;
    let gw = gateway(
        &primary,
        &backup,
        STORM_BREAKER,
        true,
        route,
        STORM_ATTEMPT_TIMEOUT,
    )
    .await;
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    // 2,000 requests (the demo runs 1,000): the few that exhaust every attempt make the
    // share noisy, and 1,000 measured 993-999 alone, too close to a 99% line to hold it
    // on every run.
    let outcomes = drive(&url, 2000, 32, &[]).await;
    let ok = outcomes.iter().filter(|o| o.status == 200).count();
    let attempts = primary.state_total() + backup.state_total();
    let per_request = attempts as f64 / outcomes.len() as f64;
    println!(
        "storm {route:?}: {ok}/2000 succeeded, {per_request:.2} attempts per request, p99 {:.0} ms",
        p99_ms(&outcomes)
    );
    let mut slow: Vec<&Outcome> = outcomes.iter().collect();
    slow.sort_by_key(|o| std::cmp::Reverse(o.took));
    for o in slow.iter().take(8) {
        println!("slow: {:?} {} {}", o.took, o.status, o.recovery);
    }
    assert!(ok >= 1980, "{ok} of 2000 succeeded");
    assert!(per_request <= 1.7, "{per_request:.2} attempts per request");
}

/// Both targets answer 503 to everything: each breaker opens after `failure_threshold`
/// attempts, and from then on requests are refused without touching the network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_down_route_costs_almost_nothing() {
    let _alone = ALONE.lock().await;
    let primary = mock_on("status=503@1", 1).await;
    let backup = mock_on("status=503@1", 2).await;
    // The default growing open time (1 s, doubling per failed probe): a slow run sees a
    // probe or two more per upstream, and still costs little.
    let gw = gateway(&primary, &backup, "open_for = \"60s\"", true, "", "1s").await;
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let outcomes = drive(&url, 200, 1, &[]).await;
    for (name, mock) in [("primary", &primary), ("backup", &backup)] {
        let attempts = mock.state_total();
        assert!(
            (5..=8).contains(&attempts),
            "the {name}'s breaker opened at its threshold, then probes at 1, 3, 7 s: {attempts}"
        );
    }
    let attempts = primary.state_total() + backup.state_total();
    assert!(attempts as f64 / 200.0 <= 0.2, "{attempts} attempts");
    let refused: Vec<_> = outcomes
        .iter()
        .filter(|o| o.code == "circuit_open")
        .collect();
    assert!(
        refused.len() >= 190,
        "{} refused as circuit_open",
        refused.len()
    );
    assert!(refused.iter().all(|o| o.status == 503));
    let mut took: Vec<Duration> = refused.iter().map(|o| o.took).collect();
    took.sort();
    println!(
        "hard down: {attempts} attempts for 200 requests; refusals p50 {:?}",
        took[took.len() / 2]
    );
}

/// A brownout: the primary fails 90%, the backup is healthy. The primary's breaker
/// takes it out of the way, and once it recovers, traffic goes back to it within its
/// probe interval (`open_for`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browned_out_target_is_ejected_and_readmitted_when_it_recovers() {
    let _alone = ALONE.lock().await;
    // The brownout is the client's `x-mock-fault-mix`, which only the primary is given:
    // when the client stops sending it, the primary has recovered.
    let primary = mock_on("", 7).await;
    let backup = mock_on("", 8).await;
    let gw = gateway(&primary, &backup, "open_for = \"1s\"", false, "", "1s").await;
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let outcomes = drive(&url, 400, 8, &[("x-mock-fault-mix", "status=503@0.9")]).await;
    let ok = outcomes.iter().filter(|o| o.status == 200).count();
    let attempts = primary.state_total() + backup.state_total();
    let per_request = attempts as f64 / 400.0;
    println!("brownout: {ok}/400 succeeded, {per_request:.2} attempts per request");
    assert!(ok * 1000 >= 400 * 995, "{ok} of 400 succeeded");
    assert!(per_request <= 1.2, "{per_request:.2} attempts per request");

    // Recovered: within the probe interval the breaker half-opens, the probe succeeds,
    // and the primary serves everything again.
    let http = reqwest::Client::new();
    let (started, served) = (Instant::now(), primary.state_total());
    while primary.state_total() == served && started.elapsed() < Duration::from_secs(5) {
        assert_eq!(call(&http, &url, &[]).await.status, 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "traffic never went back to the primary"
    );
    println!(
        "brownout: the primary served again after {:?}",
        started.elapsed()
    );
    let before = (primary.state_total(), backup.state_total());
    for _ in 0..20 {
        assert_eq!(call(&http, &url, &[]).await.status, 200);
    }
    assert_eq!(
        primary.state_total() - before.0,
        20,
        "all traffic is the primary's again"
    );
    assert_eq!(backup.state_total(), before.1);
}

/// A milder brownout, below the breaker's failure rate: the primary fails 30%, the
/// backup 0%. The primary is demoted behind the backup once it is an outlier, and back in
/// front within a breaker window of recovering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_failing_far_more_than_its_peer_is_demoted_until_it_recovers() {
    let _alone = ALONE.lock().await;
    let primary = mock_on("", 5).await;
    let backup = mock_on("", 6).await;
    // The breaker is not what this tests: out for 1 s, not 30, if a stalled machine's
    // timeouts ever open it.
    let breaker = "window = \"2s\"\nopen_for = \"1s\"";
    let gw = gateway(&primary, &backup, breaker, false, "", "1s").await;
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let started = Instant::now();
    let outcomes = drive(&url, 400, 8, &[("x-mock-fault-mix", "status=503@0.3")]).await;
    let took = started.elapsed();
    let ok = outcomes.iter().filter(|o| o.status == 200).count();
    let attempts = primary.state_total() + backup.state_total();
    let per_request = attempts as f64 / 400.0;
    println!(
        "30% brownout: {ok}/400 succeeded in {took:?}, {per_request:.2} attempts per request, {} on the primary",
        primary.state_total()
    );
    assert_eq!(ok, 400);
    assert!(per_request <= 1.15, "{per_request:.2} attempts per request");
    // Demoted, the primary comes back once a window (2 s) and fails about MIN_SAMPLES
    // more attempts before it is demoted again: some 30 attempts a window started, where
    // undemoted it would take every request's first attempt and their retries (over
    // 500). The bound follows the drive's length, which a loaded machine stretches: 29
    // attempts in 0.5 s unloaded, 58-91 in 3.9-4.6 s beside six busy processes.
    let windows = (took.as_secs_f64() / 2.0).ceil() + 1.0;
    assert!(
        (primary.state_total() as f64) < 40.0 * windows,
        "the primary took {} attempts in {took:?}: not demoted",
        primary.state_total()
    );

    // Recovered: its window empties, it is back in front and keeps the traffic.
    let http = reqwest::Client::new();
    let (started, served) = (Instant::now(), primary.state_total());
    while primary.state_total() == served && started.elapsed() < Duration::from_secs(6) {
        assert_eq!(call(&http, &url, &[]).await.status, 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        primary.state_total() > served,
        "traffic never went back to the primary"
    );
    println!(
        "30% brownout: the primary served again after {:?}",
        started.elapsed()
    );
    let before = (primary.state_total(), backup.state_total());
    for _ in 0..20 {
        assert_eq!(call(&http, &url, &[]).await.status, 200);
    }
    assert_eq!(primary.state_total() - before.0, 20);
    assert_eq!(backup.state_total(), before.1);
}

/// Caller faults are the caller's: exactly one attempt each, no retry, no failover, and
/// no breaker opens however many there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_faults_get_exactly_one_attempt_and_never_open_a_breaker() {
    let _alone = ALONE.lock().await;
    let primary = mock_on("", 3).await;
    let backup = mock_on("", 4).await;
    let gw = gateway(&primary, &backup, "", true, "", "1s").await;
    let url = format!("http://{}/v1/chat/completions", gw.addr);
    let http = reqwest::Client::new();
    for status in [400, 404, 422] {
        let fault = format!("status={status}");
        for n in 0..20 {
            let scenario = format!("caller-{status}-{n}");
            let out = call(
                &http,
                &url,
                &[("x-mock-fault", &fault), ("x-mock-scenario", &scenario)],
            )
            .await;
            assert_eq!(out.status, status);
            assert_eq!(primary.attempts(&scenario), 1);
            assert_eq!(backup.attempts(&scenario), 0);
        }
    }
    let out = call(&http, &url, &[("x-mock-scenario", "after")]).await;
    assert_eq!(out.status, 200, "the primary's breaker is still closed");
    assert_eq!(primary.attempts("after"), 1);
}
