//! The recovery layer on a paused tokio clock, over a scripted leaf: exact attempt
//! counts for every row of the taxonomy, Retry-After, the deadline, the retry budget and
//! the breaker lifecycle, with virtual time (no real sleeps).

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use backstop::{
    api::Endpoint,
    error::GatewayError,
    layers::{
        meter::Billed,
        recovery::{follow_trail, RecoveryLayer, RetryPolicy},
    },
    policy::{
        classify::TransportFailure,
        trail::{self, Reason, Step},
    },
    routing::RouteTable,
    state::health::HealthRegistry,
    telemetry::Trail,
    upstream::{build_all, AttemptError, Reply},
};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use crate::common::{layer::CallBuilder, TestConfig};

const CONFIG: &str = r#"
[retry]
max_attempts = 3
base_delay = "200ms"
max_delay = "5s"
max_retry_after = "10s"
budget_ratio = 0.2
budget_floor = 10

[breaker]
failure_threshold = 5
open_for = "30s"
# A fixed opening (the growth from `open_min` is the breaker's unit tests').
open_min = "30s"
half_open_probes = 1

[[upstreams]]
name = "primary"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://primary.invalid"

[[upstreams]]
name = "backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://backup.invalid"

[[upstreams]]
name = "big"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://big.invalid"

[[routes]]
model = "two"
targets = [{ upstream = "primary" }, { upstream = "backup", model = "backup-model" }]
context_fallback = { upstream = "big", model = "big-context" }

[[routes]]
model = "one"
targets = [{ upstream = "primary" }]

[[tenants]]
name = "t"
api_keys = ["bk-test-key"]
"#;

/// One scripted upstream outcome.
#[derive(Clone)]
enum Play {
    Status(u16, &'static str, &'static [(&'static str, &'static str)]),
    Fail(TransportFailure),
}

use Play::*;

const OK: Play = Status(200, r#"{"choices":[]}"#, &[]);
const E503: Play = Status(503, "", &[]);

/// (upstream, model asked for, when) for each call the leaf saw.
type Calls = Vec<(String, Option<String>, Duration)>;

/// A taxonomy row: name, script, final status, recovery trail, upstreams called.
type Row = (
    &'static str,
    Vec<Play>,
    u16,
    &'static str,
    Vec<&'static str>,
);

/// What an upstream answers, chosen per call by the upstream's name.
type Rule = Arc<dyn Fn(&str) -> Play + Send + Sync>;

/// The scripted leaf: plays `script` in order (the last entry repeats), or by `rule`,
/// and records calls.
#[derive(Clone)]
struct Script {
    plays: Arc<Mutex<VecDeque<Play>>>,
    rule: Option<Rule>,
    calls: Arc<Mutex<Calls>>,
    t0: Instant,
}

impl Script {
    fn new(plays: &[Play]) -> Self {
        Script {
            plays: Arc::new(Mutex::new(plays.iter().cloned().collect())),
            rule: None,
            calls: Arc::default(),
            t0: Instant::now(),
        }
    }
    fn by_upstream(rule: impl Fn(&str) -> Play + Send + Sync + 'static) -> Self {
        Script {
            rule: Some(Arc::new(rule)),
            ..Script::new(&[OK])
        }
    }
    fn calls(&self) -> Calls {
        self.calls.lock().unwrap().clone()
    }
    fn upstreams(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.0).collect()
    }
}

/// The scripted leaf stands where the meter does: it takes what recovery hands on.
impl Service<Billed> for Script {
    type Response = Reply;
    type Error = AttemptError;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply, AttemptError>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), AttemptError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, billed: Billed) -> Self::Future {
        let attempt = billed.attempt;
        self.calls.lock().unwrap().push((
            attempt.upstream.name.to_string(),
            attempt.model.as_deref().map(str::to_owned),
            self.t0.elapsed(),
        ));
        let play = if let Some(rule) = &self.rule {
            rule(&attempt.upstream.name)
        } else {
            let mut plays = self.plays.lock().unwrap();
            if plays.len() > 1 {
                plays.pop_front().unwrap()
            } else {
                plays.front().cloned().unwrap()
            }
        };
        Box::pin(async move {
            match play {
                Fail(TransportFailure::Timeout) => {
                    tokio::time::sleep(attempt.timeout).await;
                    Err(AttemptError::Transport(TransportFailure::Timeout))
                }
                Fail(f) => Err(AttemptError::Transport(f)),
                Status(status, body, headers) => {
                    let mut map = HeaderMap::new();
                    for (k, v) in headers {
                        map.insert(*k, HeaderValue::from_static(v));
                    }
                    Ok(Reply::whole(
                        Endpoint::ChatCompletions,
                        StatusCode::from_u16(status).unwrap(),
                        map,
                        Bytes::from_static(body.as_bytes()),
                        attempt.keep_answer,
                    ))
                }
            }
        })
    }
}

struct Harness {
    routes: Arc<RouteTable>,
    health: Arc<HealthRegistry>,
    policy: RetryPolicy,
}

fn harness(edit: impl FnOnce(TestConfig) -> TestConfig) -> Harness {
    let config = edit(TestConfig::parse(CONFIG)).config();
    let upstreams = build_all(&config);
    Harness {
        routes: Arc::new(RouteTable::new(&config, &upstreams)),
        health: Arc::new(HealthRegistry::new(&config)),
        // Jitter pinned to the top of its range, so backoff waits are exact.
        policy: RetryPolicy {
            jitter: || 0.999_999_999,
        },
    }
}

struct Outcome {
    status: u16,
    error: Option<GatewayError>,
    headers: HeaderMap,
    /// The trail as the `x-backstop-recovery` header renders it.
    recovery: String,
    steps: Vec<Step>,
    attempts: u32,
    elapsed: Duration,
}

impl Harness {
    async fn send(&self, model: &str, script: &Script, deadline: Duration) -> Outcome {
        let call = CallBuilder::new(self.routes.clone())
            .body(serde_json::json!({"model": model, "messages": []}))
            .deadline(deadline)
            .build();
        let service =
            RecoveryLayer::new(self.policy.clone(), self.health.clone()).layer(script.clone());
        let started = Instant::now();
        // Recovery answers what it did with its outcome, trail and all.
        let mut trail = Trail::default();
        let result = follow_trail(service.oneshot(call).await, &mut trail);
        let (status, error, headers) = match result {
            Ok((reply, _)) => (reply.status.as_u16(), None, reply.headers.clone()),
            Err(e) => (e.code().status(), Some(e), HeaderMap::new()),
        };
        Outcome {
            status,
            error,
            headers,
            recovery: trail::render(&trail.steps),
            steps: trail.steps,
            attempts: trail.attempts,
            elapsed: started.elapsed(),
        }
    }
}

const LONG: Duration = Duration::from_secs(120);

#[tokio::test(start_paused = true)]
async fn transient_errors_are_retried_with_capped_backoff_then_succeed() {
    let h = harness(|c| c);
    let script = Script::new(&[E503, E503, OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.status, 200);
    assert_eq!(
        out.steps,
        [
            Step::Retry(Reason::Status(503)),
            Step::Retry(Reason::Status(503)),
            Step::Ok
        ]
    );
    assert_eq!(out.recovery, "retry:503,retry:503,ok");
    assert_eq!(out.attempts, 3);
    let at: Vec<_> = script.calls().iter().map(|c| c.2.as_millis()).collect();
    // Full-jitter ceilings 200 ms then 400 ms (jitter pinned at the top of its range;
    // tokio's timer rounds up to the millisecond).
    assert_eq!(at, [0, 200, 600]);
}

#[tokio::test(start_paused = true)]
async fn each_taxonomy_row_makes_the_exact_attempts() {
    let quota: &'static str =
        r#"{"error":{"type":"insufficient_quota","code":"insufficient_quota","message":"quota"}}"#;
    let context: &'static str = r#"{"error":{"type":"invalid_request_error","code":"context_length_exceeded","message":"too long"}}"#;
    let rows: Vec<Row> = vec![
        // transient everywhere: max_attempts on each of the two targets
        (
            "503",
            vec![E503],
            503,
            "retry:503,retry:503,giveup:503,failover:backup,retry:503,retry:503,giveup:503",
            vec!["primary"; 3]
                .into_iter()
                .chain(vec!["backup"; 3])
                .collect(),
        ),
        (
            "529",
            vec![
                Status(
                    529,
                    r#"{"type":"error","error":{"type":"overloaded_error","message":"x"}}"#,
                    &[],
                ),
                OK,
            ],
            200,
            "retry:529,ok",
            vec!["primary", "primary"],
        ),
        (
            "reset",
            vec![Fail(TransportFailure::Reset), OK],
            200,
            "retry:reset,ok",
            vec!["primary", "primary"],
        ),
        (
            "connect",
            vec![
                Fail(TransportFailure::Connect),
                Fail(TransportFailure::Connect),
                Fail(TransportFailure::Connect),
                OK,
            ],
            200,
            "retry:connect,retry:connect,giveup:connect,failover:backup,ok",
            vec!["primary", "primary", "primary", "backup"],
        ),
        (
            "timeout",
            // A hang is not waited out again while a healthy target can answer now.
            vec![Fail(TransportFailure::Timeout), OK],
            200,
            "defer:timeout,failover:backup,ok",
            vec!["primary", "backup"],
        ),
        // caller fault: one attempt, passed through
        (
            "400",
            vec![Status(
                400,
                r#"{"error":{"type":"invalid_request_error","message":"bad"}}"#,
                &[],
            )],
            400,
            "pass:400",
            vec!["primary"],
        ),
        (
            "422",
            vec![Status(422, "{}", &[])],
            422,
            "pass:422",
            vec!["primary"],
        ),
        // credential/quota: never retried on that upstream, straight to the next target
        (
            "quota",
            vec![Status(429, quota, &[]), OK],
            200,
            "giveup:429,failover:backup,ok",
            vec!["primary", "backup"],
        ),
        (
            "401",
            vec![Status(401, "{}", &[]), OK],
            200,
            "giveup:401,failover:backup,ok",
            vec!["primary", "backup"],
        ),
        // malformed 200: next target
        (
            "malformed",
            vec![Status(200, "{\"choices\": [", &[]), OK],
            200,
            "giveup:malformed,failover:backup,ok",
            vec!["primary", "backup"],
        ),
        // context too long: the context_fallback target takes it
        (
            "context",
            vec![Status(400, context, &[]), OK],
            200,
            "fallback:big,failover:big,ok",
            vec!["primary", "big"],
        ),
    ];
    for (name, plays, status, recovery, upstreams) in rows {
        let h = harness(|c| c);
        let script = Script::new(&plays);
        let out = h.send("two", &script, LONG).await;
        assert_eq!(out.status, status, "{name}: {:?}", out.error);
        assert_eq!(out.recovery, recovery, "{name}");
        assert_eq!(script.upstreams(), upstreams, "{name}");
        assert_eq!(out.attempts as usize, upstreams.len(), "{name}");
    }
}

#[tokio::test(start_paused = true)]
async fn failover_and_fallback_ask_for_the_targets_model() {
    let h = harness(|c| c);
    let script = Script::new(&[E503, E503, E503, OK]);
    h.send("two", &script, LONG).await;
    let models: Vec<_> = script.calls().into_iter().map(|c| c.1).collect();
    assert_eq!(models, [None, None, None, Some("backup-model".to_string())]);
}

#[tokio::test(start_paused = true)]
async fn final_failures_become_the_right_answer() {
    let h = harness(|c| c);
    let out = h
        .send("one", &Script::new(&[Status(401, "{}", &[])]), LONG)
        .await;
    assert_eq!(
        (out.status, out.error.unwrap().code().as_str()),
        (502, "upstream_auth_failed")
    );
    let h = harness(|c| c);
    let out = h
        .send(
            "one",
            &Script::new(&[Fail(TransportFailure::Connect)]),
            LONG,
        )
        .await;
    assert_eq!(
        (out.status, out.error.unwrap().code().as_str()),
        (502, "upstream_unavailable")
    );
    assert_eq!(out.attempts, 3);
    // Three 1 s attempt timeouts fit the deadline: the upstream was slow, not the client's
    // deadline short.
    let h = harness(|c| c.set("upstreams.primary.attempt_timeout", "1s"));
    let out = h
        .send(
            "one",
            &Script::new(&[Fail(TransportFailure::Timeout)]),
            LONG,
        )
        .await;
    assert_eq!(
        (out.status, out.error.unwrap().code().as_str()),
        (504, "upstream_timeout")
    );
    let h = harness(|c| c);
    let out = h
        .send("one", &Script::new(&[Status(200, "not json", &[])]), LONG)
        .await;
    assert_eq!(
        (out.status, out.error.unwrap().code().as_str()),
        (502, "upstream_malformed")
    );
    assert_eq!(out.attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_inside_the_cap_is_waited_in_virtual_time() {
    let h = harness(|c| c);
    let script = Script::new(&[Status(429, "", &[("retry-after", "2")]), OK]);
    let out = h.send("one", &script, LONG).await;
    assert_eq!(out.status, 200);
    assert_eq!(out.recovery, "retry:429,ok");
    assert_eq!(out.elapsed, Duration::from_secs(2));
    assert_eq!(script.calls()[1].2, Duration::from_secs(2));

    let h = harness(|c| c);
    let script = Script::new(&[Status(503, "", &[("retry-after-ms", "750")]), OK]);
    let out = h.send("one", &script, LONG).await;
    assert_eq!(out.elapsed, Duration::from_millis(750));
}

/// Hedging (opt-in per route): a first attempt slower than `hedge_after` gets a second
/// on the next target; the first answer wins and the slow one is cancelled. A fast
/// answer is never hedged; a hedge that fails leaves the first attempt to finish.
#[tokio::test(start_paused = true)]
async fn a_slow_first_attempt_is_hedged_on_the_next_target() {
    let hedged = |c: TestConfig| c.set("routes.two.hedge_after", "100ms");
    let h = harness(hedged);
    let script = Script::new(&[Fail(TransportFailure::Timeout), OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.status, 200);
    assert_eq!(out.recovery, "hedge:backup,ok");
    assert_eq!(out.elapsed, Duration::from_millis(100));
    assert_eq!(script.upstreams(), ["primary", "backup"]);

    let h = harness(hedged);
    let script = Script::new(&[OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.recovery, "ok", "answered before hedge_after: no hedge");
    assert_eq!(script.upstreams(), ["primary"]);

    // The hedge fails at once (a 503 whose Retry-After is past the cap): the first run
    // goes on, fails over after its timeout, and its answer is the one returned.
    let h = harness(hedged);
    let script = Script::new(&[
        Fail(TransportFailure::Timeout),
        Status(503, "", &[("retry-after", "30")]),
        OK,
    ]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.status, 200, "{:?}", out.error);
    assert_eq!(script.upstreams(), ["primary", "backup", "backup"]);
    assert_eq!(
        out.recovery,
        "hedge:backup,giveup:503,defer:timeout,failover:backup,ok"
    );
}

/// `hedge_after = "p95"`: the delay is the first target's recent answer times' 95th
/// percentile, and there is no hedge until it has answered 20 times.
#[tokio::test(start_paused = true)]
async fn a_percentile_hedge_waits_for_a_record_then_follows_it() {
    let h = harness(|c| c.set("routes.two.hedge_after", "p95"));
    let slow = Script::new(&[Fail(TransportFailure::Timeout), OK]);
    let out = h.send("two", &slow, LONG).await;
    assert_eq!(
        out.recovery, "defer:timeout,failover:backup,ok",
        "no record yet"
    );
    // Twenty answers taking no (virtual) time: the 95th percentile is 0, floored at 1 ms.
    for _ in 0..20 {
        assert_eq!(
            h.send("two", &Script::new(&[OK]), LONG).await.recovery,
            "ok"
        );
    }
    let slow = Script::new(&[Fail(TransportFailure::Timeout), OK]);
    let out = h.send("two", &slow, LONG).await;
    assert_eq!(out.recovery, "hedge:backup,ok");
    assert_eq!(out.elapsed, Duration::from_millis(1));
}

/// A wait on one target (a Retry-After, or after a hang) is traded for an immediate
/// attempt on a healthy second target; with no second target the first is waited on as
/// before.
#[tokio::test(start_paused = true)]
async fn a_healthy_spare_target_beats_waiting() {
    let h = harness(|c| c);
    let script = Script::new(&[Status(429, "", &[("retry-after", "2")]), OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!((out.status, out.elapsed), (200, Duration::ZERO));
    assert_eq!(out.recovery, "defer:429,failover:backup,ok");
    assert_eq!(script.upstreams(), ["primary", "backup"]);

    let h = harness(|c| c);
    let script = Script::new(&[Fail(TransportFailure::Timeout), OK]);
    let out = h.send("one", &script, LONG).await;
    assert_eq!(
        out.recovery, "retry:timeout,ok",
        "no spare: retried in place"
    );
    assert_eq!(script.upstreams(), ["primary", "primary"]);

    // The spare failing too, the deferred target resumes with its attempts left, once
    // its Retry-After has passed.
    let h = harness(|c| c);
    let script = Script::new(&[
        Status(429, "", &[("retry-after", "2")]),
        E503,
        E503,
        E503,
        OK,
    ]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.status, 200);
    assert_eq!(
        out.recovery,
        "defer:429,failover:backup,retry:503,retry:503,giveup:503,failover:primary,ok"
    );
    assert_eq!(
        script.upstreams(),
        ["primary", "backup", "backup", "backup", "primary"]
    );
    assert!(out.elapsed >= Duration::from_secs(2), "{:?}", out.elapsed);
    assert!(script.calls()[4].2 >= Duration::from_secs(2));

    // A 429 without Retry-After waits only the backoff: retried in place.
    let h = harness(|c| c);
    let script = Script::new(&[Status(429, "", &[]), OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!(out.recovery, "retry:429,ok");
}

#[tokio::test(start_paused = true)]
async fn retry_after_beyond_the_cap_fails_fast_with_the_upstreams_answer() {
    let h = harness(|c| c);
    let script = Script::new(&[Status(
        429,
        r#"{"error":{"code":"rate_limit_exceeded"}}"#,
        &[("retry-after", "30")],
    )]);
    let out = h.send("one", &script, LONG).await;
    assert_eq!(out.status, 429);
    assert_eq!(out.headers["retry-after"], "30");
    assert_eq!(out.elapsed, Duration::ZERO);
    assert_eq!(out.attempts, 1);
    assert_eq!(out.recovery, "giveup:429");
    // With a second target, that target is tried at once instead.
    let h = harness(|c| c);
    let script = Script::new(&[Status(503, "", &[("retry-after", "30")]), OK]);
    let out = h.send("two", &script, LONG).await;
    assert_eq!((out.status, out.elapsed), (200, Duration::ZERO));
    assert_eq!(out.recovery, "giveup:503,failover:backup,ok");
}

#[tokio::test(start_paused = true)]
async fn no_wait_ever_runs_past_the_deadline() {
    // A 5 s Retry-After is within the cap but not within a 3 s deadline.
    let h = harness(|c| c);
    let script = Script::new(&[Status(503, "", &[("retry-after", "5")])]);
    let out = h.send("one", &script, Duration::from_secs(3)).await;
    assert_eq!(
        (out.status, out.attempts, out.elapsed),
        (503, 1, Duration::ZERO)
    );
    // Timeouts: attempts are cut to the time left, and the loop stops at the deadline.
    let h = harness(|c| c.set("upstreams.primary.attempt_timeout", "2s"));
    let script = Script::new(&[Fail(TransportFailure::Timeout)]);
    let out = h.send("one", &script, Duration::from_secs(3)).await;
    // Attempt 1 times out at 2 s; after a 200 ms backoff, attempt 2 gets only the 800 ms
    // left, and the answer comes exactly at the deadline.
    assert_eq!(out.elapsed, Duration::from_secs(3));
    assert_eq!((out.status, out.attempts), (504, 2));
    assert_eq!(out.error.unwrap().code().as_str(), "request_timeout");
    let starts: Vec<_> = script
        .calls()
        .into_iter()
        .map(|c| c.2.as_millis())
        .collect();
    assert_eq!(starts, [0, 2200]);
}

#[tokio::test(start_paused = true)]
async fn the_breaker_opens_skips_then_probes_and_closes() {
    let h = harness(|c| c.set("retry.max_attempts", 1));
    let down = Script::new(&[E503]);
    for _ in 0..5 {
        assert_eq!(h.send("one", &down, LONG).await.status, 503);
    }
    assert_eq!(down.calls().len(), 5);
    // Open: no network, 503 circuit_open with the time until half-open.
    tokio::time::advance(Duration::from_secs(10)).await;
    let out = h.send("one", &down, LONG).await;
    assert_eq!(out.status, 503);
    assert!(
        matches!(out.error, Some(GatewayError::CircuitOpen { retry_after }) if retry_after == Duration::from_secs(20))
    );
    assert_eq!(out.recovery, "open:primary");
    assert_eq!(down.calls().len(), 5, "an open breaker touched the network");
    // With a second target, the open upstream is skipped and the backup answers.
    let up = Script::new(&[OK]);
    let out = h.send("two", &up, LONG).await;
    assert_eq!(
        (out.status, out.recovery.as_str()),
        (200, "open:primary,failover:backup,ok")
    );
    assert_eq!(up.upstreams(), ["backup"]);
    // Half-open after open_for: one probe; its failure reopens.
    tokio::time::advance(Duration::from_secs(20)).await;
    assert_eq!(h.send("one", &down, LONG).await.status, 503);
    assert_eq!(down.calls().len(), 6);
    assert_eq!(h.send("one", &down, LONG).await.recovery, "open:primary");
    // Next probe succeeds: closed again, traffic flows.
    tokio::time::advance(Duration::from_secs(30)).await;
    let healthy = Script::new(&[OK]);
    assert_eq!(h.send("one", &healthy, LONG).await.status, 200);
    assert_eq!(h.send("one", &healthy, LONG).await.status, 200);
    assert_eq!(healthy.calls().len(), 2);
}

/// A brownout on the primary (every third of its attempts fails; the backup is healthy)
/// demotes it behind the backup. After it recovers, its failures age out a bucket at a
/// time (a 2 s window of 200 ms buckets); once too few are left to judge it, it is back
/// in front, and it stays there: its first successes are judged on their own. (Judged
/// with the brownout's last failures, 20 attempts with 5 or 6 of them failed, it went
/// back and forth: 9 requests to the backup, 3 to the primary, 7 to the backup, ...)
#[tokio::test(start_paused = true)]
async fn a_readmitted_outlier_stays_in_front_while_its_old_failures_age_out() {
    let h = harness(|c| c.set("breaker.window", "2s"));
    let browned = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let primary_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let script = Script::by_upstream({
        let (browned, primary_calls) = (browned.clone(), primary_calls.clone());
        move |upstream| {
            use std::sync::atomic::Ordering::Relaxed;
            let failing = upstream == "primary"
                && browned.load(Relaxed)
                && primary_calls.fetch_add(1, Relaxed) % 3 == 0;
            if failing {
                E503
            } else {
                OK
            }
        }
    });
    // Where each request's first attempt went.
    let first = |script: &Script, before: usize| script.upstreams()[before].clone();

    let mut demoted = false;
    for _ in 0..200 {
        let before = script.calls().len();
        assert_eq!(h.send("two", &script, LONG).await.status, 200);
        if first(&script, before) == "backup" {
            demoted = true;
            break;
        }
        tokio::time::advance(Duration::from_millis(20)).await;
    }
    assert!(demoted, "the browned-out primary was never demoted");

    browned.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut readmitted = None;
    for n in 0..40 {
        tokio::time::advance(Duration::from_millis(20)).await;
        let before = script.calls().len();
        assert_eq!(h.send("two", &script, LONG).await.status, 200);
        if first(&script, before) == "primary" {
            readmitted = Some(n);
            break;
        }
    }
    assert!(
        readmitted.is_some(),
        "the recovered primary never came back in front"
    );
    let mut after = Vec::new();
    for _ in 0..30 {
        tokio::time::advance(Duration::from_millis(20)).await;
        let before = script.calls().len();
        assert_eq!(h.send("two", &script, LONG).await.status, 200);
        after.push(first(&script, before));
    }
    assert_eq!(
        after.iter().filter(|u| *u == "primary").count(),
        30,
        "after coming back in front: {after:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn caller_faults_never_open_the_breaker() {
    let h = harness(|c| c);
    let bad = Script::new(&[Status(400, "{}", &[])]);
    for _ in 0..50 {
        assert_eq!(h.send("one", &bad, LONG).await.status, 400);
    }
    assert_eq!(
        bad.calls().len(),
        50,
        "every caller fault reached the upstream exactly once"
    );
    let ok = Script::new(&[OK]);
    assert_eq!(h.send("one", &ok, LONG).await.recovery, "ok");
}

#[tokio::test(start_paused = true)]
async fn credential_failures_open_the_breaker_at_once() {
    let h = harness(|c| c);
    let script = Script::new(&[Status(401, "{}", &[]), OK]);
    h.send("one", &script, LONG).await;
    let out = h.send("one", &script, LONG).await;
    assert_eq!(out.recovery, "open:primary");
    assert_eq!(script.calls().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_retry_budget_caps_retries_during_an_outage() {
    // A fixed budget (max ratio = ratio): floor 2, ratio 0.2, threshold high enough
    // that the breaker stays out of it.
    let h = harness(|c| {
        c.set("retry.budget_floor", 2)
            .set("retry.budget_max_ratio", 0.2)
            .set("breaker.failure_threshold", 100000)
    });
    let down = Script::new(&[E503]);
    for _ in 0..100 {
        h.send("one", &down, LONG).await;
    }
    // 100 first attempts, at most 2 + 0.2 × 100 = 22 retries.
    assert_eq!(down.calls().len(), 100 + 22);
}

#[tokio::test(start_paused = true)]
async fn the_adaptive_budget_clamps_an_outage_and_spends_on_a_storm() {
    // Adaptive (the default, up to 1.0 while retries work): in an outage every retry
    // fails, so the allowance falls to the ratio; only the first retries, granted before
    // any failed, get more. Same floor and threshold as above.
    let h = harness(|c| {
        c.set("retry.budget_floor", 2)
            .set("breaker.failure_threshold", 100000)
    });
    let down = Script::new(&[E503]);
    for _ in 0..100 {
        h.send("one", &down, LONG).await;
    }
    let retries = down.calls().len() - 100;
    assert!(
        (22..=27).contains(&retries),
        "{retries} retries for 100 requests"
    );

    // A storm where every other attempt fails and retries work: each request's one
    // retry is granted, far beyond a fixed 20%.
    let h = harness(|c| {
        c.set("retry.budget_floor", 2)
            .set("breaker.failure_threshold", 100000)
    });
    let plays: Vec<Play> = (0..100).flat_map(|_| [E503, OK]).collect();
    let storm = Script::new(&plays);
    let mut ok = 0;
    for _ in 0..100 {
        ok += usize::from(h.send("one", &storm, LONG).await.status == 200);
    }
    assert_eq!(ok, 100, "every request's retry was granted and worked");
    assert_eq!(storm.calls().len(), 200);
}
