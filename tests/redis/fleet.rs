//! Replicas predicting together: two gateways share one fleet view in a real Redis (on
//! one server, and on a three-master cluster), so sessions failing on one make a
//! signature hot for the other, a refusal before the first attempt happens on a replica
//! that never saw the failures, one probe per cool-down is let through across both, and
//! a probe that succeeds on one lets the shape through on the other.
//!
//! The gateways run in this process on one [`Clock`], moved past cool-downs instead of
//! slept through: the fleet's scripts take the replicas' time, never Redis's.

use std::time::Duration;

use crate::common::{admin_and_prices, dead_port, gateway_config, json, until_some, ADMIN};
use crate::redis_support::Redis;
use backstop::{clock::Clock, mock, server};
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
