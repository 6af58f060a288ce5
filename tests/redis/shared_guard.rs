//! The gate script's joining of an admitted request to a session guard's shared state
//! (`guard_view::Joined`), against the guard itself on a real `redis-server`: random
//! sequences of requests (few fingerprints, so they repeat; time moving on past the
//! window now and then), failures and successes written whole between them (some left
//! with no brief beside them, as builds before briefs wrote them). For every request the
//! script decides as the guard decides on the shared state: joined when the guard admits
//! it with nothing else changed, handed back untouched when the guard would trip or
//! refuse; a joined state's window is the guard's, entry for entry; and the window Redis
//! keeps beside the state (`store::format::to_beside`) always counts each request as
//! often as its list holds it.
//!
//! Needs `redis-server` on PATH (`.ci/run` installs it).

use std::{sync::Arc, time::Duration};

use crate::redis_support::Redis as RedisServer;
use backstop::{
    config::{StateBackend, StateConfig},
    policy::guard::{GuardPolicy, RequestFingerprint, SessionGuard},
    state::{
        guard_view::{self, Joined, Write, RECENT_CAP},
        shared::{Gate, GateReply, GuardWrite, Redis, SharedBudgets},
    },
    store::format::{decode_snapshot, encode_snapshot, from_beside, WindowWrite, HASHED_FIELD},
};
use proptest::prelude::*;
use tokio::time::Instant;

const TENANT: &str = "guards";
const WINDOW: Duration = Duration::from_secs(10);
/// Wall-clock milliseconds at the guard's `t0`.
const T0_MS: i64 = 1_700_000_000_000;

#[derive(Debug, Clone)]
enum Step {
    /// A request with this fingerprint, this long after the last step; sent `as_whole`
    /// too (when the guard admits it plainly), at the shared state's version or a stale
    /// one, as a replica that wrote the state last does.
    Request {
        request: u64,
        after_ms: u64,
        as_whole: Option<bool>,
    },
    /// The last request's outcome, written whole as a replica would; by a build that
    /// writes no brief beside it, when `briefless`.
    Outcome { failed: bool, briefless: bool },
}

fn step() -> impl Strategy<Value = Step> {
    let after = prop_oneof![
        4 => Just(0u64),
        4 => 1u64..2_000,
        1 => Just(WINDOW.as_millis() as u64),
        1 => Just(WINDOW.as_millis() as u64 + 1),
    ];
    prop_oneof![
        6 => (0u64..4, after, proptest::option::of(any::<bool>())).prop_map(
            |(request, after_ms, as_whole)| Step::Request { request, after_ms, as_whole }
        ),
        1 => (any::<bool>(), any::<bool>())
            .prop_map(|(failed, briefless)| Step::Outcome { failed, briefless }),
    ]
}

fn policy(limit: u32) -> GuardPolicy {
    GuardPolicy {
        max_consecutive_failures: 3,
        identical_request_limit: limit,
        identical_request_window: WINDOW,
        tool_loop_limit: 100,
        max_usd_per_minute: None,
        cool_down: Duration::from_secs(3600),
        guide: false,
        same_error_limit: 3,
    }
}

struct Session {
    shared: Arc<SharedBudgets>,
    conn: redis::aio::MultiplexedConnection,
    key: String,
    name: String,
}

impl Session {
    async fn gate(&self, write: Write) -> GateReply {
        self.shared
            .gate(Gate {
                tenant: TENANT,
                session: Some(&self.name),
                tenant_rpm: None,
                session_rpm: None,
                max_concurrent: None,
                guard: Some(GuardWrite {
                    write,
                    ttl_ms: 600_000,
                    refuses: false,
                }),
                prepay: None,
            })
            .await
            .expect("redis")
    }

    /// The shared state as replicas read it (its window spliced back in), after checking
    /// that the counts kept beside the window are the window's.
    async fn stored(&mut self) -> (u64, String) {
        let (v, state): (Option<u64>, Option<String>) = redis::cmd("HMGET")
            .arg(&self.key)
            .arg(&["v", "state"])
            .query_async(&mut self.conn)
            .await
            .unwrap();
        let window: Vec<String> = redis::cmd("LRANGE")
            .arg(format!("{}:recent", self.key))
            .arg(0)
            .arg(-1)
            .query_async(&mut self.conn)
            .await
            .unwrap();
        let mut seen: std::collections::BTreeMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("{}:seen", self.key))
            .query_async(&mut self.conn)
            .await
            .unwrap();
        // The field that keeps the counts a hash table, there whenever the window is.
        let hashed = seen.remove(HASHED_FIELD);
        assert!(hashed.is_some() || window.is_empty(), "{seen:?}");
        if !window.is_empty() {
            let encoding: String = redis::cmd("OBJECT")
                .arg("ENCODING")
                .arg(format!("{}:seen", self.key))
                .query_async(&mut self.conn)
                .await
                .unwrap();
            assert_eq!(encoding, "hashtable");
        }
        let seen: std::collections::BTreeMap<String, u64> = seen
            .into_iter()
            .map(|(k, v)| (k, v.parse().expect("a count")))
            .collect();
        let mut counted = std::collections::BTreeMap::new();
        for entry in &window {
            let (_, request) = entry.split_once(',').expect("ms,fingerprint");
            *counted.entry(request.to_string()).or_insert(0u64) += 1;
        }
        assert_eq!(seen, counted, "the counts beside the window are its own");
        assert!(window.len() <= RECENT_CAP);
        // Each key there expires its expiry after the last request, or up to a second
        // later (the gate pushes it out once it is less than that away), never earlier;
        // a key the window made anew included.
        for k in [
            self.key.clone(),
            format!("{}:recent", self.key),
            format!("{}:seen", self.key),
        ] {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&k)
                .query_async(&mut self.conn)
                .await
                .unwrap();
            assert!(
                ttl == -2 || (590_000..=601_000).contains(&ttl),
                "{k} expires in {ttl} ms"
            );
        }
        (
            v.unwrap_or(0),
            from_beside(&state.unwrap_or_default(), &window.join(";")),
        )
    }
}

async fn session(server: &RedisServer) -> Session {
    let prefix = format!("g{}", uuid::Uuid::new_v4().simple());
    let config = StateConfig {
        backend: StateBackend::Redis,
        url: Some(server.url()),
        key_prefix: prefix.clone(),
        command_timeout: Duration::from_secs(5),
        ..StateConfig::default()
    };
    let shared = SharedBudgets::new(Redis::new(&config).unwrap(), Duration::from_secs(3600));
    let client = redis::Client::open(server.url().as_str()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    let name = "s".to_string();
    Session {
        shared,
        conn,
        key: format!("{prefix}:{{{TENANT}}}:guard-window:{name}"),
        name,
    }
}

fn fp(request: u64) -> RequestFingerprint {
    RequestFingerprint {
        request,
        ..RequestFingerprint::default()
    }
}

fn run_sequence(
    rt: &tokio::runtime::Runtime,
    server: &RedisServer,
    limit: u32,
    steps: Vec<Step>,
) -> Result<u32, TestCaseError> {
    rt.block_on(async {
        let mut s = session(server).await;
        let t0 = Instant::now();
        let mut elapsed = Duration::ZERO;
        let clock = |elapsed: Duration| (t0 + elapsed, T0_MS + elapsed.as_millis() as i64);
        // The shared state, as a guard; the first state is written whole.
        let mut guard = SessionGuard::new(policy(limit));
        let (now, now_ms) = clock(elapsed);
        let first = encode_snapshot(&guard_view::snapshot(&guard, now, now_ms));
        let GateReply::Passed { guard: Some(w), .. } = s
            .gate(Write::Whole {
                version: 0,
                state: first,
                window: WindowWrite::Keep,
            })
            .await
        else {
            panic!("a first whole write at version 0 is taken")
        };
        let mut version = w.to;
        let mut joined = 0;
        for step in steps {
            match step {
                Step::Request {
                    request,
                    after_ms,
                    as_whole,
                } => {
                    elapsed += Duration::from_millis(after_ms);
                    let (now, now_ms) = clock(elapsed);
                    let (before_v, before) = s.stored().await;
                    let mut admitted = guard.clone();
                    let (verdict, change) = admitted.admit(now, &fp(request), 0.0);
                    let plain = verdict.is_ok()
                        && change.is_none()
                        && guard_view::joins(&guard, &admitted, now, request);
                    let join = Joined {
                        at_ms: now_ms,
                        request,
                        limit,
                        since_ms: now_ms - WINDOW.as_millis() as i64,
                    };
                    let write = match as_whole.filter(|_| plain) {
                        Some(current) => Write::WholeOrJoin {
                            version: if current { version } else { version + 7 },
                            state: encode_snapshot(&guard_view::snapshot(&admitted, now, now_ms)),
                            join,
                        },
                        None => Write::Join(join),
                    };
                    let reply = s.gate(write).await;
                    match reply {
                        GateReply::Passed { guard: Some(w), .. } => {
                            prop_assert!(
                                plain,
                                "joined a request the guard does not admit plainly: {:?}",
                                guard.state()
                            );
                            prop_assert_eq!((w.from, w.to), (version, version + 1));
                            version = w.to;
                            joined += 1;
                            guard = admitted;
                            let (_, state) = s.stored().await;
                            let stored = decode_snapshot(&state).expect("a joined state reads");
                            let model = guard_view::snapshot(&guard, now, now_ms);
                            prop_assert_eq!(&stored.recent, &model.recent);
                            prop_assert_eq!(stored.phase, model.phase);
                            prop_assert_eq!(
                                stored.consecutive_failures,
                                model.consecutive_failures
                            );
                        }
                        GateReply::Moved(v, state) => {
                            prop_assert!(!plain, "handed back a request the guard admits plainly");
                            prop_assert_eq!((v, &state), (before_v, &before));
                            prop_assert_eq!(
                                s.stored().await,
                                (before_v, before),
                                "nothing written"
                            );
                        }
                        _ => prop_assert!(false, "neither joined nor handed back"),
                    }
                }
                Step::Outcome { failed, briefless } => {
                    let (now, now_ms) = clock(elapsed);
                    guard.record(now, failed);
                    let state = encode_snapshot(&guard_view::snapshot(&guard, now, now_ms));
                    let GateReply::Passed { guard: Some(w), .. } = s
                        .gate(Write::Whole {
                            version,
                            state,
                            window: WindowWrite::Keep,
                        })
                        .await
                    else {
                        panic!("a whole write at the current version is taken")
                    };
                    version = w.to;
                    if briefless {
                        let _: i64 = redis::cmd("HDEL")
                            .arg(&s.key)
                            .arg("brief")
                            .query_async(&mut s.conn)
                            .await
                            .unwrap();
                    }
                }
            }
        }
        Ok(joined)
    })
}

/// Case count for the property test.
const CASES: u32 = 256;

/// A `redis-server` and a runtime to drive it from a test.
fn bench() -> (RedisServer, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (RedisServer::start(), rt)
}

#[test]
fn a_joined_request_is_decided_as_the_guard_decides_on_the_shared_state() {
    let (server, rt) = bench();
    let config = ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let joined = std::sync::atomic::AtomicU32::new(0);
    proptest!(config, |(limit in 1u32..5, steps in proptest::collection::vec(step(), 1..60))| {
        let n = run_sequence(&rt, &server, limit, steps)?;
        joined.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(joined.into_inner() > 0, "no request was ever joined");
}

/// The window a join keeps is the guard's last [`RECENT_CAP`] requests.
#[test]
fn a_joined_window_keeps_the_guards_last_requests() {
    let (server, rt) = bench();
    let steps: Vec<Step> = (0..RECENT_CAP as u64 + 20)
        .map(|i| Step::Request {
            request: 1000 + i,
            after_ms: 1,
            as_whole: None,
        })
        .collect();
    let joined = run_sequence(&rt, &server, 3, steps).unwrap();
    assert_eq!(joined as usize, RECENT_CAP + 20);
    // Requests that left the window are no longer counted towards the cap: 150, then
    // 100 of them out of the window, then the window filled past the cap again.
    let request = |i: u64, after_ms: u64| Step::Request {
        request: 5000 + i,
        after_ms,
        as_whole: None,
    };
    let out = WINDOW.as_millis() as u64 + 101 - 150;
    let steps: Vec<Step> = (0..150)
        .map(|i| request(i, 1))
        .chain([request(150, out)])
        .chain((151..500).map(|i| request(i, 1)))
        .collect();
    assert_eq!(run_sequence(&rt, &server, 3, steps).unwrap(), 500);
}

/// A state an older build wrote (version 1, its window inside it, no brief) is never
/// joined to: it is handed back as it is, and the next whole write moves its window
/// beside it, so the requests it counted go on counting.
#[test]
fn a_version_1_state_is_handed_back_then_its_window_moved_beside_it() {
    let (server, rt) = bench();
    rt.block_on(async {
        let mut s = session(&server).await;
        let t0 = Instant::now();
        let mut guard = SessionGuard::new(policy(3));
        for ms in [0, 1] {
            let counted = guard.admit(t0 + Duration::from_millis(ms), &fp(7), 0.0);
            assert!(counted.0.is_ok());
        }
        let (now, now_ms) = (t0 + Duration::from_millis(2), T0_MS + 2);
        let v1 = encode_snapshot(&guard_view::snapshot(&guard, now, now_ms));
        let _: () = redis::cmd("HSET")
            .arg(&s.key)
            .arg(&["v", "4", "state", &v1])
            .query_async(&mut s.conn)
            .await
            .unwrap();
        let join = Joined {
            at_ms: now_ms,
            request: 7,
            limit: 3,
            since_ms: now_ms - WINDOW.as_millis() as i64,
        };
        let GateReply::Moved(4, state) = s.gate(Write::Join(join)).await else {
            panic!("a version 1 state is handed back")
        };
        assert_eq!(state, v1);
        // Decided again on it (the third 7 is admitted) and written whole.
        let snap = decode_snapshot(&state).unwrap();
        let mut shared = guard_view::from_snapshot(policy(3), snap, now, now_ms);
        assert!(shared.admit(now, &fp(7), 0.0).0.is_ok());
        let whole = Write::Whole {
            version: 4,
            state: encode_snapshot(&guard_view::snapshot(&shared, now, now_ms)),
            window: WindowWrite::Append {
                at_ms: now_ms,
                request: 7,
                since_ms: join.since_ms,
            },
        };
        let GateReply::Passed { guard: Some(w), .. } = s.gate(whole).await else {
            panic!("a whole write at the version read is taken")
        };
        assert_eq!((w.from, w.to), (4, 5));
        let raw: String = redis::cmd("HGET")
            .arg(&s.key)
            .arg("state")
            .query_async(&mut s.conn)
            .await
            .unwrap();
        assert!(raw.starts_with(r#"{"v":2,"#), "{raw}");
        let (v, text) = s.stored().await;
        assert_eq!(v, 5);
        assert_eq!(decode_snapshot(&text).unwrap().recent.len(), 3);
        // The fourth 7 is not joined: all three count, two of them from version 1.
        let fourth = Joined {
            at_ms: now_ms + 1,
            ..join
        };
        let GateReply::Moved(5, _) = s.gate(Write::Join(fourth)).await else {
            panic!("the fourth identical request is the guard's to refuse")
        };
    });
}
