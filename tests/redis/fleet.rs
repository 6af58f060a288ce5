//! Replicas predicting together: two gateways share one fleet view in a real Redis (on
//! one server, and on a three-master cluster), so sessions failing on one make a
//! signature hot for the other, a refusal before the first attempt happens on a replica
//! that never saw the failures, one probe per cool-down is let through across both, and
//! a probe that succeeds on one lets the shape through on the other.
//!
//! The gateways run in this process on one [`Clock`], moved past cool-downs instead of
//! slept through: the fleet's scripts take the replicas' time, never Redis's.

use std::{sync::Arc, time::Duration};

use crate::common::{admin_and_prices, dead_port, gateway_config, json, until_some, ADMIN};
use crate::redis_support::Redis;
use backstop::{
    api::{signature, Endpoint},
    clock::Clock,
    config::StateConfig,
    mock,
    policy::fleet::{Failed, FailureKind, FleetPolicy, Signature, SESSIONS_PER_SIGNATURE},
    server,
    state::{
        fleet::{FleetBackend, LocalFleet, ReplicaFleet},
        shared,
    },
};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const KEY: &str = "bk-fleet-replica-key";
const OVERFLOW: &str = "status=400;code=context_length_exceeded";

struct Replicas {
    urls: Vec<String>,
    _servers: Vec<server::ServerHandle>,
    mock: mock::MockHandle,
    http: reqwest::Client,
}

impl Replicas {
    async fn start(redis: &Redis, clock: &Clock, n: usize) -> Replicas {
        Replicas::start_with(redis, clock, n, "2s").await
    }

    /// As [`Replicas::start`], each Redis call bounded by `timeout`.
    async fn start_with(redis: &Redis, clock: &Clock, n: usize, timeout: &str) -> Replicas {
        let mock = mock::spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let prefix = format!("fleet-{}", uuid::Uuid::new_v4().simple());
        let mut servers = Vec::new();
        for _ in 0..n {
            let config = gateway_config(mock.addr, dead_port().await)
                .merge(&admin_and_prices())
                .merge(&format!(
                    r#"
[state]
backend = "redis"
url = "{url}"
key_prefix = "{prefix}"
cluster = {cluster}
replicas = {n}
command_timeout = "{timeout}"

[[tenants]]
name = "fleet"
api_keys = ["{KEY}"]
[tenants.guard]
max_consecutive_failures = 5
[tenants.guard.fleet]
min_sessions = 3
min_failures = 2
window = "10m"
cool_down = "30s"
preempt = true
"#,
                    url = redis.url(),
                    cluster = redis.is_cluster(),
                ))
                .config();
            servers.push(
                server::spawn_with_clock(config, clock.clone())
                    .await
                    .expect("replica starts"),
            );
        }
        Replicas {
            urls: servers
                .iter()
                .map(|s| format!("http://{}", s.addr))
                .collect(),
            _servers: servers,
            mock,
            http: reqwest::Client::new(),
        }
    }

    async fn send(
        &self,
        replica: usize,
        run: &str,
        fault: &str,
        attempt: usize,
    ) -> reqwest::Response {
        let body = json!({"model": "gpt-4o", "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": format!("Fix module {run}")},
            {"role": "user", "content": format!("Summarize the conversation so far in under {} tokens for run {run}.", 1000 + attempt)},
        ]});
        let mut req = self
            .http
            .post(format!("{}/v1/chat/completions", self.urls[replica]))
            .bearer_auth(KEY)
            .header("x-session-id", run)
            .header("x-mock-scenario", "compaction")
            .body(body.to_string());
        if !fault.is_empty() {
            req = req.header("x-mock-fault", fault);
        }
        req.send().await.unwrap()
    }

    async fn view(&self, replica: usize) -> Value {
        let resp = self
            .http
            .get(format!("{}/admin/tenants/fleet/fleet", self.urls[replica]))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        json(resp).await
    }
}

fn state(resp: &reqwest::Response) -> (u16, String) {
    (
        resp.status().as_u16(),
        resp.headers()["x-backstop-session-state"]
            .to_str()
            .unwrap()
            .to_string(),
    )
}

async fn replicas_predict_together(redis: Redis) {
    let clock = Clock::system();
    let fleet = Replicas::start(&redis, &clock, 3).await;
    // Three sessions fail twice each, each failure on the other replica of A and B.
    for (i, run) in ["r-1", "r-2", "r-3"].into_iter().enumerate() {
        for attempt in 0..2 {
            let resp = fleet.send((i + attempt) % 2, run, OVERFLOW, attempt).await;
            let expected = if run == "r-3" && attempt == 1 {
                "tripped"
            } else {
                "recovering"
            };
            assert_eq!(state(&resp), (400, expected.to_string()), "{run} {attempt}");
        }
    }
    // r-3's second failure, on replica B, made it hot: a fourth session's request there
    // is refused before its first attempt.
    let resp = fleet.send(1, "r-4", OVERFLOW, 0).await;
    assert_eq!(state(&resp), (429, "active".to_string()));
    assert_eq!(fleet.mock.attempts("compaction"), 6);
    // Replica C never saw a failure, nor served the tenant: it reads the watched shapes
    // before judging its first request, and refuses it before any attempt.
    let resp = fleet.send(2, "c-1", OVERFLOW, 0).await;
    assert_eq!(state(&resp), (429, "active".to_string()));
    let message = json(resp).await["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        message.contains("3 sessions of this tenant failed the same way")
            && message.contains("refused before its first attempt"),
        "{message}"
    );
    assert_eq!(fleet.mock.attempts("compaction"), 6);

    // A cool-down later, one probe across all replicas: the first to ask gets it.
    clock.skip(Duration::from_secs(31));
    let resp = fleet.send(0, "p-1", OVERFLOW, 0).await;
    assert_eq!(
        state(&resp),
        (400, "tripped".to_string()),
        "the probe, still failing"
    );
    for replica in 0..3 {
        let resp = fleet
            .send(replica, &format!("p-{}", replica + 2), OVERFLOW, 0)
            .await;
        assert_eq!(
            resp.status(),
            429,
            "replica {replica}: one probe per cool-down"
        );
    }
    assert_eq!(fleet.mock.attempts("compaction"), 7);

    // The bug is fixed: the next probe, on B, succeeds, and A and C let the shape through.
    clock.skip(Duration::from_secs(31));
    for (replica, run) in [(1, "ok-1"), (0, "ok-2"), (2, "ok-3"), (0, "p-2")] {
        let resp = fleet.send(replica, run, "", 1).await;
        assert_eq!(
            state(&resp),
            (200, "active".to_string()),
            "{run} on {replica}"
        );
    }
    assert_eq!(fleet.mock.attempts("compaction"), 11);

    // Every replica reports the one shared view and its record.
    let view = fleet.view(2).await;
    assert_eq!(
        (view["backend"].as_str(), view["error"].as_str()),
        (Some("redis"), None)
    );
    let sig = &view["signatures"][0];
    assert_eq!(sig["state"], "cooled", "{view}");
    let record = &sig["record"];
    assert_eq!(
        [
            &record["tripped"],
            &record["preempted"],
            &record["confirmed"],
            &record["unconfirmed"],
        ],
        [&json!(2), &json!(5), &json!(0), &json!(1)],
        "r-3 and p-1 tripped; r-4, c-1, p-2, p-3, p-4 refused; p-2 then succeeded: {view}"
    );
    assert_eq!(record["avoided_calls"], 5.0);
    assert_eq!(sig["pending"], 6);
    // Trips by reason are counted off the request's path: polled.
    until_some("the trips counted in redis", || async {
        let view = fleet.view(0).await;
        (view["trips_by_reason"]["fleet_pattern"] == 2).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_predict_together_on_one_server() {
    replicas_predict_together(Redis::start()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_predict_together_on_a_cluster() {
    replicas_predict_together(Redis::start_cluster()).await;
}

/// Redis stops answering: the replica counts failures in its own view and predicts from
/// it (its own sessions' failures alone), and its admin view says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_redis_cannot_answer_a_replica_predicts_from_its_own_view() {
    let redis = Redis::start();
    let clock = Clock::system();
    let fleet = Replicas::start_with(&redis, &clock, 1, "200ms").await;
    redis.pause();
    for run in ["r-1", "r-2", "r-3"] {
        for attempt in 0..2 {
            let resp = fleet.send(0, run, OVERFLOW, attempt).await;
            let expected = if run == "r-3" && attempt == 1 {
                "tripped"
            } else {
                "recovering"
            };
            assert_eq!(state(&resp), (400, expected.to_string()), "{run} {attempt}");
        }
    }
    // Hot in this replica's view: a new session's request is refused before its first
    // attempt.
    let resp = fleet.send(0, "r-4", OVERFLOW, 0).await;
    assert_eq!(resp.status(), 429);
    assert_eq!(fleet.mock.attempts("compaction"), 6);
    let view = fleet.view(0).await;
    assert!(
        view["error"].as_str().is_some_and(|e| !e.is_empty()),
        "{view}"
    );
    assert_eq!(view["signatures"][0]["state"], "hot", "{view}");
    redis.resume();
}

/// The replica backend on `redis` alone (no gateway) and the embedded one, on one clock
/// of their own, with a minute's window: 3 sessions failing twice make a signature hot.
fn backends(redis: &Redis) -> (ReplicaFleet, LocalFleet, Clock, Arc<FleetPolicy>) {
    let state = shared::Redis::new(&StateConfig {
        url: Some(redis.url()),
        ..StateConfig::default()
    })
    .unwrap();
    let clock = Clock::starting_at(1_800_000_000_000);
    let policy = Arc::new(FleetPolicy {
        min_sessions: 3,
        min_failures: 2,
        window: Duration::from_secs(60),
        preempt: false,
        cool_down: Duration::from_secs(10),
    });
    let replica = ReplicaFleet::new(state, clock.clone());
    (replica, LocalFleet::new(clock.clone()), clock, policy)
}

/// One failure of `session` with `sig` now, counted through [`FleetBackend`] by the
/// replica backend (the scripts) and by the embedded one: their verdicts, in that order.
/// The embedded one counts first, reading the clock before the scripts do.
async fn fail_both(
    replica: &dyn FleetBackend,
    embedded: &dyn FleetBackend,
    policy: &Arc<FleetPolicy>,
    sig: &Signature,
    session: u64,
) -> (Failed, Failed) {
    let local = embedded.failed("t", policy, sig, session, 1, 0.0).await;
    let scripts = replica.failed("t", policy, sig, session, 1, 0.0).await;
    (scripts, local)
}

/// Redis answered every call: the replica's own view, its fallback, counted nothing.
async fn all_in_redis(replica: &ReplicaFleet, policy: &Arc<FleetPolicy>) {
    let fallback = replica.fallback().report("t", policy).await;
    assert!(
        fallback.signatures.is_empty(),
        "the fallback counted: {:?}",
        fallback.signatures
    );
}

/// `n` signatures of distinct shapes, the same failure.
fn signatures(n: usize) -> Vec<Signature> {
    let failure = FailureKind {
        class: "caller_fault",
        code: "context_length_exceeded".to_string(),
        detail: "HTTP 400".to_string(),
    };
    (0..n)
        .map(|i| {
            let request = json!({"model": "gpt-4o", "messages": [
                {"role": "user", "content": format!("Summarize task {i}")}
            ]});
            let shape = signature::shape(
                "gpt-*",
                Endpoint::ChatCompletions,
                request.as_object().unwrap(),
            );
            Signature::new(&shape, &failure)
        })
        .collect()
}

/// The scripts against the embedded view whose rules they carry, each behind
/// [`FleetBackend`]: random failures of three signatures by eight sessions, the clock
/// moving by up to a third of the window between them (so sessions' counts start again
/// and signatures go stale and are forgotten), on one Redis and in one process. Every
/// failure gets the same verdict from both: a trip or not, the qualified sessions it
/// names, whether it confirmed a prediction. The sessions a trip names are at least the
/// embedded view's: the scripts drop a session whose last failure left the window once
/// per refresh (an eighth of the window), not at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scripts_decide_as_the_embedded_view_does() {
    let redis = Redis::start();
    let (replica, embedded, clock, policy) = backends(&redis);
    let sigs = signatures(3);
    // xorshift64: the same sequence every run.
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let (mut trips, mut confirmed, mut restarts) = (0, 0, 0);
    for step in 0..1500 {
        // Mostly close together, now and then a long pause.
        let pause = if next(10) == 0 {
            next(20_000)
        } else {
            next(2_000)
        };
        clock.skip(Duration::from_millis(pause));
        restarts += usize::from(pause > 10_000);
        let sig = &sigs[next(3) as usize];
        let session = next(8);
        let now = clock.now_ms();
        let (scripts, embedded) = fail_both(&replica, &embedded, &policy, sig, session).await;
        let at = format!("step {step} (t+{} ms)", now - 1_800_000_000_000);
        assert_eq!(scripts.trip.is_some(), embedded.trip.is_some(), "{at}");
        assert_eq!(scripts.confirmed, embedded.confirmed, "{at}");
        assert!(!scripts.untracked && !embedded.untracked, "{at}");
        if let (Some(s), Some(e)) = (&scripts.trip, &embedded.trip) {
            assert_eq!(s.qualified, e.qualified, "{at}");
            assert!(
                s.sessions >= e.sessions,
                "{at}: {} < {}",
                s.sessions,
                e.sessions
            );
            // Its wait to the next probe, as each read its clock (which runs on as well).
            let apart = s.retry_after.abs_diff(e.retry_after);
            assert!(apart < Duration::from_millis(100), "{at}: {apart:?}");
            trips += 1;
        }
        confirmed += usize::from(embedded.confirmed);
    }
    all_in_redis(&replica, &policy).await;
    // The sequence went through every case the comparison is for.
    assert!(
        trips > 50 && confirmed > 20 && restarts > 50,
        "{trips} {confirmed} {restarts}"
    );
}

/// A signature failing in more sessions than it keeps (`SESSIONS_PER_SIGNATURE`): the
/// scripts make room by dropping its least recent eighth at once (one read of the
/// sessions, not one a new session), so it holds between seven eighths of the cap and
/// the cap; the sessions dropped are the least recent, so three recent sessions failing
/// again still qualify and trip it, as in the embedded view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signature_past_its_sessions_cap_drops_the_least_recent() {
    let redis = Redis::start();
    let (replica, embedded, clock, policy) = backends(&redis);
    let sig = &signatures(1)[0];
    let cap = SESSIONS_PER_SIGNATURE as u64;
    let (mut low, mut high) = (u32::MAX, 0);
    for session in 0..cap + 300 {
        clock.skip(Duration::from_millis(1));
        let (scripts, embedded) = fail_both(&replica, &embedded, &policy, sig, session).await;
        assert!(
            scripts.trip.is_none() && embedded.trip.is_none(),
            "{session}"
        );
        if session >= cap {
            let report = replica.report("t", &policy).await;
            assert_eq!(report.error, None, "{session}");
            low = low.min(report.signatures[0].sessions);
            high = high.max(report.signatures[0].sessions);
        }
    }
    let cap = cap as u32;
    assert!(high <= cap && low > cap - cap / 8, "{low}..{high}");
    assert!(low < cap, "room was made at least once: {low}..{high}");
    // The three most recent sessions fail again: qualified, hot, the third one tripped.
    for (n, session) in (cap as u64 + 297..cap as u64 + 300).enumerate() {
        clock.skip(Duration::from_millis(1));
        let (scripts, embedded) = fail_both(&replica, &embedded, &policy, sig, session).await;
        assert_eq!(scripts.trip.is_some(), n == 2, "{session}");
        assert_eq!(embedded.trip.is_some(), n == 2, "{session}");
    }
    all_in_redis(&replica, &policy).await;
}
