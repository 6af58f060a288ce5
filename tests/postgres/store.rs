//! The store contract (src/store/tests.rs, which SQLite passes) against a real
//! PostgreSQL, and what sharing one database across replicas adds: ids unique across
//! stores, charges written once per reservation id, claims and guard windows taken by
//! one store at a time, a dead replica's reservations charged once by another, and
//! migrations applied once by stores opening together.

use std::{sync::Arc, time::Duration};

use backstop::{
    billing::Tokens,
    config::{StoreBackend, StoreConfig},
    policy::budget::Usage,
    store::{
        format::WindowWrite, Charge, Claim, GuardRecord, GuardStates, Ledger, OwnerRecord, Owners,
        PgStore, QueuedSettle, Replays, ReportQuery, ReservationRecord, SettleQueue, Store,
        StoreError, StoredOwner, StoredResponse, Tier, WindowSave, SCHEMA_VERSION,
    },
};

use crate::common::TempDir;
use crate::postgres_support::Postgres;

/// A server and one empty database on it, and a folder for the stores' spools.
struct Db {
    pg: Postgres,
    name: String,
    dir: TempDir,
}

impl Db {
    fn new() -> Db {
        let pg = Postgres::start();
        let name = pg.create_database();
        Db {
            pg,
            name,
            dir: TempDir::new("backstop-pg-spools"),
        }
    }

    /// The settings of a store of its own: each gets a new spool, as each replica has.
    fn config(&self) -> StoreConfig {
        self.config_on(&self.new_spool())
    }

    /// The settings of a store on the spool at `spool`.
    fn config_on(&self, spool: &str) -> StoreConfig {
        StoreConfig {
            backend: StoreBackend::Postgres,
            url: Some(self.pg.url(&self.name)),
            statement_timeout: Duration::from_secs(2),
            replica_lease: Duration::from_secs(1),
            spool: Some(spool.to_string()),
            ..StoreConfig::default()
        }
    }

    /// A path for a new spool.
    fn new_spool(&self) -> String {
        let file = format!("spool-{}.db", uuid::Uuid::new_v4().simple());
        self.dir.0.join(file).to_str().unwrap().to_string()
    }

    async fn open(&self) -> PgStore {
        PgStore::open(&self.config()).await.unwrap()
    }

    fn sql(&self, sql: &str) -> String {
        self.pg.psql(&self.name, sql)
    }

    fn ledger_rows(&self) -> u64 {
        self.sql("SELECT COUNT(*) FROM ledger").parse().unwrap()
    }
}

fn charge(session: Option<&str>, day: i64, ts_ms: i64, usd: f64) -> Charge {
    Charge {
        ts_ms,
        day,
        tenant: "t".into(),
        session: session.map(str::to_owned),
        model: "gpt-4o".into(),
        calls: 1,
        tokens: Tokens::plain(10, 5),
        usd,
    }
}

fn reservation(store: &PgStore, session: &str, ts_ms: i64, tokens: u64) -> ReservationRecord {
    ReservationRecord {
        id: store.next_reservation_id(),
        ts_ms,
        day: 1,
        tenant: "t".into(),
        session: Some(session.into()),
        model: "gpt-4o".into(),
        calls: 1,
        tokens,
        usd: 0.5,
    }
}

fn response(key: &str, expires_ms: i64) -> StoredResponse {
    StoredResponse {
        tenant: "t".into(),
        key: key.into(),
        body_hash: "h".into(),
        status: 200,
        content_type: "application/json".into(),
        body: b"{}".to_vec(),
        expires_ms,
    }
}

#[tokio::test]
async fn charges_sum_per_session_and_per_day_and_resets_hide_the_past() {
    let db = Db::new();
    let store = db.open().await;
    store
        .charge(charge(Some("s1"), 100, 1_000, 0.5))
        .await
        .unwrap();
    store
        .charge(charge(Some("s1"), 100, 2_000, 0.25))
        .await
        .unwrap();
    store.charge(charge(None, 100, 3_000, 1.0)).await.unwrap();
    store
        .charge(charge(Some("s1"), 99, 500, 7.0))
        .await
        .unwrap();
    assert_eq!(
        store.session_usage("t", "s1").await.unwrap(),
        Usage {
            calls: 3,
            tokens: 45,
            usd: 7.75
        }
    );
    assert_eq!(
        store.tenant_day_usage("t", 100).await.unwrap(),
        Usage {
            calls: 3,
            tokens: 45,
            usd: 1.75
        }
    );
    store.reset_session("t", "s1", 1_500).await.unwrap();
    assert_eq!(
        store.session_usage("t", "s1").await.unwrap(),
        Usage {
            calls: 1,
            tokens: 15,
            usd: 0.25
        }
    );
    assert_eq!(store.tenant_day_usage("t", 100).await.unwrap().usd, 1.75);
    let by_model = store.tenant_day_by_model("t", 100).await.unwrap();
    assert_eq!(by_model.len(), 1);
    assert_eq!(by_model[0].0, "gpt-4o");
    assert_eq!(by_model[0].1.calls, 3);
    assert_eq!(
        store.session_usage("t", "nobody").await.unwrap(),
        Usage::default()
    );
}

#[tokio::test]
async fn settling_replaces_the_durable_reservation_by_the_charge() {
    let db = Db::new();
    let store = db.open().await;
    let r = reservation(&store, "s", 10, 500);
    let id = r.id;
    store.reserve(r).await.unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 1);
    assert_eq!(store.session_usage("t", "s").await.unwrap().calls, 0);
    store
        .settle(Some(id), charge(Some("s"), 1, 20, 0.01))
        .await
        .unwrap();
    assert_eq!(store.open_reservations().await.unwrap(), 0);
    assert_eq!(store.session_usage("t", "s").await.unwrap().tokens, 15);
    assert_eq!(db.sql("SELECT id FROM ledger"), id.to_string());
}

/// Exactly once: a settle retried (its acknowledgement lost, a replay), or sent again
/// by `settle_later`, is the same row.
#[tokio::test]
async fn a_charge_settled_twice_for_one_reservation_id_is_one_row() {
    let db = Db::new();
    let store = db.open().await;
    let r = reservation(&store, "s", 10, 500);
    let id = r.id;
    store.reserve(r).await.unwrap();
    store
        .settle(Some(id), charge(Some("s"), 1, 20, 0.01))
        .await
        .unwrap();
    store
        .settle(Some(id), charge(Some("s"), 1, 21, 0.02))
        .await
        .unwrap();
    store.settle_later(Some(id), charge(Some("s"), 1, 22, 0.03));
    // Ordered behind the settle_later by the writer.
    store
        .charge(charge(Some("other"), 1, 23, 1.0))
        .await
        .unwrap();
    assert_eq!(db.ledger_rows(), 2);
    let used = store.session_usage("t", "s").await.unwrap();
    assert_eq!(used.calls, 1);
    assert!(
        (used.usd - 0.01).abs() < 1e-12,
        "the first settle stands: {used:?}"
    );
}

/// Two replicas' ids never meet: each store takes its own epoch.
#[tokio::test]
async fn reservation_ids_are_unique_across_stores() {
    let db = Db::new();
    let (a, b) = (db.open().await, db.open().await);
    assert_ne!(a.epoch(), b.epoch());
    let mut ids = std::collections::HashSet::new();
    for _ in 0..1000 {
        assert!(ids.insert(a.next_reservation_id()));
        assert!(ids.insert(b.next_reservation_id()));
    }
    assert!(ids.iter().all(|id| *id > 0));
}

/// Reservations of a replica that stopped heartbeating (killed) are charged at their
/// reserved amount once its lease has passed, once, by a live replica or the next store
/// to open; a live replica's reservations are never taken.
#[tokio::test]
async fn reservations_left_by_a_dead_replica_are_charged_once_by_another() {
    let db = Db::new();
    let live = db.open().await;
    live.reserve(reservation(&live, "live", 1, 40))
        .await
        .unwrap();
    {
        // A long lease of its own: it heartbeats only at open, so none can land after
        // its last heartbeat is made a lease old below.
        let dead = PgStore::open(&StoreConfig {
            replica_lease: Duration::from_secs(60),
            ..db.config()
        })
        .await
        .unwrap();
        let settled = reservation(&dead, "s", 10, 100);
        let id = settled.id;
        dead.reserve(settled).await.unwrap();
        dead.settle(Some(id), charge(Some("s"), 1, 11, 0.01))
            .await
            .unwrap();
        dead.reserve(reservation(&dead, "s", 12, 700))
            .await
            .unwrap();
        dead.reserve(reservation(&dead, "s", 13, 700))
            .await
            .unwrap();
        // Its last heartbeat made older than the others' 1 s lease (on the database's
        // clock, what waiting 1.5 s would do), and dropped: as a kill would leave it.
        db.sql(&format!(
            "UPDATE replicas SET seen_ms = seen_ms - 1500 WHERE epoch = {}",
            dead.epoch()
        ));
    }
    let next = db.open().await;
    // Whichever found it dead first: the live replica's heartbeat loop, or the store
    // opening now.
    assert_eq!(
        live.recovered_total() + next.recovered_reservations(),
        2,
        "the dead replica's two open reservations, once"
    );
    let used = next.session_usage("t", "s").await.unwrap();
    assert_eq!((used.calls, used.tokens), (3, 15 + 1400));
    assert!((used.usd - 1.01).abs() < 1e-9, "{used:?}");
    assert_eq!(
        next.open_reservations().await.unwrap(),
        1,
        "the live one's stays"
    );
    drop(next);
    let again = db.open().await;
    assert_eq!(again.recovered_reservations(), 0, "charged once, not again");
    assert_eq!(again.session_usage("t", "s").await.unwrap().calls, 3);
}

/// A replica found dead that settles after all (it was only cut off): one row, the
/// recovery's or its own, never both.
#[tokio::test]
async fn a_settle_racing_the_recovery_of_its_reservation_is_one_row() {
    let db = Db::new();
    // A long lease of its own: its next heartbeat (a quarter lease away) cannot undo
    // the partition below before the other store has opened.
    let slow = PgStore::open(&StoreConfig {
        replica_lease: Duration::from_secs(60),
        ..db.config()
    })
    .await
    .unwrap();
    let r = reservation(&slow, "s", 1, 300);
    let id = r.id;
    slow.reserve(r).await.unwrap();
    // Its heartbeat made old, as a partition would.
    db.sql(&format!(
        "UPDATE replicas SET seen_ms = 0 WHERE epoch = {}",
        slow.epoch()
    ));
    let other = db.open().await;
    assert_eq!(other.recovered_reservations(), 1);
    let row = || {
        db.sql(&format!(
            "SELECT usd, calls, recovered FROM ledger WHERE id = {id}"
        ))
    };
    let reserved = row();
    assert!(
        reserved.ends_with("|1|t"),
        "charged at its reservation: {reserved}"
    );
    slow.settle(Some(id), charge(Some("s"), 1, 2, 0.01))
        .await
        .unwrap();
    assert_eq!(db.ledger_rows(), 1);
    // Before: the recovery's row stayed and the true charge was discarded, silently.
    assert_eq!(
        row(),
        "0.01|1|f",
        "the true charge replaced the reservation's"
    );
    assert_eq!(slow.ledger_corrections(), (1, 0));
    // The same settle again (a replay after a lost acknowledgement): once, counted.
    slow.settle(Some(id), charge(Some("s"), 1, 2, 0.01))
        .await
        .unwrap();
    assert_eq!(row(), "0.01|1|f");
    assert_eq!(slow.ledger_corrections(), (1, 1));
    let used = other.session_usage("t", "s").await.unwrap();
    assert_eq!(used.calls, 1);
    assert!((used.usd - 0.01).abs() < 1e-9, "{used:?}");
}

#[tokio::test]
async fn two_stores_opened_at_once_on_an_empty_database_migrate_once() {
    let db = Db::new();
    let opens: Vec<_> = (0..4)
        .map(|_| {
            let config = db.config();
            tokio::spawn(async move { PgStore::open(&config).await })
        })
        .collect();
    let mut froms = Vec::new();
    for open in opens {
        let store = open.await.unwrap().expect("every store opens");
        assert_eq!(store.migrated().to, SCHEMA_VERSION);
        froms.push(store.migrated().from);
    }
    froms.sort();
    assert_eq!(froms[0], 0, "one applied the migrations");
    assert!(froms[1..].iter().all(|v| *v == SCHEMA_VERSION), "{froms:?}");
    assert_eq!(
        db.sql("SELECT string_agg(version::text, ',' ORDER BY version) FROM schema_migrations"),
        (1..=SCHEMA_VERSION)
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
}

#[tokio::test]
async fn absurd_counts_saturate_instead_of_wrapping_negative() {
    let db = Db::new();
    let store = db.open().await;
    let mut huge = charge(Some("s"), 1, 1, 0.0);
    huge.tokens = Tokens {
        cache_read: u64::MAX,
        ..Tokens::plain(u64::MAX, u64::MAX)
    };
    store.charge(huge.clone()).await.unwrap();
    store.charge(huge).await.unwrap();
    let used = store.session_usage("t", "s").await.unwrap();
    assert_eq!(used.calls, 2);
    assert!(used.tokens >= i64::MAX as u64, "{used:?}");
    assert!(store.tenant_day_by_model("t", 1).await.is_ok());
}

#[tokio::test]
async fn expired_idempotency_rows_and_rows_past_the_retention_are_purged() {
    let day = 86_400_000;
    let db = Db::new();
    let store = PgStore::open(&StoreConfig {
        retention: Duration::from_secs(2 * 86_400),
        ..db.config()
    })
    .await
    .unwrap();
    let now = 10 * day;
    store.remember(response("old", now - 1)).await.unwrap();
    store.remember(response("live", now + 1000)).await.unwrap();
    store
        .charge(charge(Some("s"), 7, now - 3 * day, 1.0))
        .await
        .unwrap();
    store
        .charge(charge(Some("s"), 9, now - day, 2.0))
        .await
        .unwrap();
    store
        .save_guard(GuardRecord {
            tenant: "t".into(),
            session: "closed-long-ago".into(),
            closed: true,
            until_ms: 0,
            code: "session_tripped".into(),
            rule: "closed".into(),
            evidence: "x".into(),
            updated_ms: now - 3 * day,
        })
        .await
        .unwrap();
    store.purge(now).await.unwrap();
    assert!(store.recall("t", "old", 0).await.unwrap().is_none());
    assert!(store.recall("t", "live", now).await.unwrap().is_some());
    assert_eq!(store.session_usage("t", "s").await.unwrap().usd, 2.0);
    assert!(store
        .guard_state("t", "closed-long-ago")
        .await
        .unwrap()
        .is_none());
}

#[tokio::test]
async fn response_owners_are_kept_in_one_write_read_by_id_and_purged_when_expired() {
    let db = Db::new();
    let store = db.open().await;
    let owner = |id: &str, tenant: &str, expires_ms| OwnerRecord {
        id: id.into(),
        tenant: tenant.into(),
        expires_ms,
        context_tokens: None,
    };
    store
        .record_owners(vec![
            owner("resp_a", "t1", 1_000),
            owner("resp_b", "t2", 5_000),
        ])
        .await
        .unwrap();
    let tenant = |o: Option<StoredOwner>| o.map(|o| o.tenant);
    assert_eq!(
        tenant(store.owner_of("resp_a", 500).await.unwrap()).as_deref(),
        Some("t1")
    );
    let sized = OwnerRecord {
        context_tokens: Some(200_100),
        ..owner("resp_b", "t2", 5_000)
    };
    store.record_owners(vec![sized]).await.unwrap();
    store
        .record_owners(vec![owner("resp_b", "t2", 5_000)])
        .await
        .unwrap();
    assert_eq!(
        store.owner_of("resp_b", 500).await.unwrap(),
        Some(StoredOwner {
            tenant: "t2".into(),
            context_tokens: Some(200_100)
        })
    );
    assert_eq!(store.owner_of("resp_a", 1_000).await.unwrap(), None);
    store.purge(2_000).await.unwrap();
    assert_eq!(store.owner_of("resp_a", 0).await.unwrap(), None);
    assert!(store.owner_of("resp_b", 2_000).await.unwrap().is_some());
}

#[tokio::test]
async fn guard_states_are_kept_and_cleared() {
    let db = Db::new();
    let store = db.open().await;
    let record = GuardRecord {
        tenant: "t".into(),
        session: "s".into(),
        closed: false,
        until_ms: 123_456,
        code: "loop_detected".into(),
        rule: "identical_request_limit".into(),
        evidence: "the same request was sent 4 times".into(),
        updated_ms: 1,
    };
    store.save_guard(record.clone()).await.unwrap();
    assert_eq!(store.guard_state("t", "s").await.unwrap(), Some(record));
    assert_eq!(store.guard_state("other", "s").await.unwrap(), None);
    store.clear_guard("t", "s").await.unwrap();
    assert_eq!(store.guard_state("t", "s").await.unwrap(), None);
    assert!(store.is_shared());
}

/// A key is claimed by one store at a time; the others wait (`Pending`) until the
/// response is kept (`Done`), the claim is given back, or its lease runs out.
#[tokio::test]
async fn an_idempotency_key_is_claimed_by_one_store_at_a_time() {
    let db = Db::new();
    let (a, b) = (db.open().await, db.open().await);
    assert!(matches!(
        a.claim("t", "k", 60_000).await.unwrap(),
        Claim::Claimed
    ));
    assert!(matches!(
        b.claim("t", "k", 60_000).await.unwrap(),
        Claim::Pending
    ));
    assert!(matches!(
        a.claim("t", "k", 60_000).await.unwrap(),
        Claim::Pending
    ));
    a.remember(response("k", i64::MAX)).await.unwrap();
    match b.claim("t", "k", 60_000).await.unwrap() {
        Claim::Done(stored) => assert_eq!(stored.body, b"{}"),
        other => panic!("{other:?}"),
    }
    // Given back: the next request takes it.
    assert!(matches!(
        a.claim("t", "k2", 60_000).await.unwrap(),
        Claim::Claimed
    ));
    a.release_claim("t", "k2");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        if matches!(b.claim("t", "k2", 60_000).await.unwrap(), Claim::Claimed) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A lease that ran out (its holder died): taken over.
    assert!(matches!(
        a.claim("t", "k3", 60_000).await.unwrap(),
        Claim::Claimed
    ));
    assert!(matches!(
        b.claim("t", "k3", 60_000).await.unwrap(),
        Claim::Pending
    ));
    // The claim made a lease old (on the database's clock, what waiting out the lease
    // would do).
    db.sql("UPDATE idempotency_claims SET until_ms = until_ms - 60000 WHERE key = 'k3'");
    assert!(matches!(
        b.claim("t", "k3", 60_000).await.unwrap(),
        Claim::Claimed
    ));
}

/// A compare-and-set of session `t`/`s`'s guard state at `version` (PostgreSQL keeps the
/// window inside the state: the write's window op is Redis's alone).
async fn save_window(store: &impl GuardStates, version: u64, state: &str) -> Option<WindowSave> {
    store
        .save_guard_window("t", "s", version, state.into(), WindowWrite::Keep, 60_000)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_guard_window_is_replaced_only_at_the_version_read() {
    let db = Db::new();
    let (a, b) = (db.open().await, db.open().await);
    assert_eq!(save_window(&a, 0, "one").await, Some(WindowSave::Saved(1)));
    assert_eq!(
        save_window(&b, 0, "other").await,
        Some(WindowSave::Moved(1, "one".into()))
    );
    assert_eq!(save_window(&b, 1, "two").await, Some(WindowSave::Saved(2)));
    assert_eq!(
        save_window(&a, 1, "late").await,
        Some(WindowSave::Moved(2, "two".into()))
    );
}

#[tokio::test]
async fn settles_kept_for_redis_are_queued_read_oldest_first_and_unqueued() {
    let db = Db::new();
    let store = db.open().await;
    for (reservation, queued_ms) in [("r2", 2), ("r1", 1)] {
        store
            .queue_settle(QueuedSettle {
                reservation: reservation.into(),
                body: format!("body-{reservation}"),
                queued_ms,
            })
            .await
            .unwrap();
    }
    let queued = store.queued_settles(10).await.unwrap();
    assert_eq!(
        queued
            .iter()
            .map(|q| q.reservation.as_str())
            .collect::<Vec<_>>(),
        ["r1", "r2"]
    );
    store.unqueue_settle("r1".into()).await.unwrap();
    assert_eq!(store.queued_settles(10).await.unwrap().len(), 1);
}

/// Postgres stopped: reads and writes fail as `Unavailable` (what `on_unavailable`
/// decides on), and a charge for a call already made is kept and written once it is
/// back, exactly once.
#[tokio::test]
async fn a_charge_made_while_postgres_is_down_is_written_when_it_returns() {
    let db = Db::new();
    let store = Arc::new(db.open().await);
    let r = reservation(&store, "s", 1, 300);
    let id = r.id;
    store.reserve(r).await.unwrap();
    db.pg.stop_now();
    let err = store.session_usage("t", "s").await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    let refused = reservation(&store, "s", 2, 10);
    let refused_id = refused.id;
    let err = store.reserve(refused).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    // Its call refused, the budgets withdraw it (its write may land all the same).
    store.unreserve(refused_id);
    let err = store
        .settle(Some(id), charge(Some("s"), 1, 3, 0.5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("kept in the spool"), "{err}");
    store.settle_later(None, charge(Some("s"), 1, 4, 0.25));
    // The reservation and its withdrawal, and the two charges; each on disk before it
    // was answered.
    crate::common::until("four writes spooled", || async { store.spooled() == 4 }).await;
    db.pg.start_again();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(used) = store.session_usage("t", "s").await {
            if used.calls == 2 {
                assert!((used.usd - 0.75).abs() < 1e-9, "{used:?}");
                break;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the kept charges never came"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(store.open_reservations().await.unwrap(), 0);
    assert_eq!(db.ledger_rows(), 2);
    assert_eq!(store.spooled(), 0, "forgotten once postgres has them");
}

/// A reservation spooled while Postgres was down and its settle made the moment it is
/// back: the settle goes in behind the reservation (or the reservation, landing after
/// its settle, would be left open and charged again as a dead replica's).
#[tokio::test]
async fn a_write_made_as_postgres_returns_goes_in_behind_what_the_spool_holds() {
    let db = Db::new();
    // The spool's first replay an hour away (not 100 ms): the settle below, not the
    // retry timer, is what finds Postgres back.
    let store = PgStore::open_retrying_after(&db.config(), Duration::from_secs(3600))
        .await
        .unwrap();
    db.pg.stop_now();
    let r = reservation(&store, "s", 1, 300);
    let id = r.id;
    let err = store.reserve(r).await.unwrap_err();
    assert!(err.to_string().contains("kept in the spool"), "{err}");
    assert_eq!(store.spooled(), 1);
    db.pg.start_again();
    store
        .settle(Some(id), charge(Some("s"), 1, 2, 0.5))
        .await
        .unwrap();
    assert_eq!(store.spooled(), 0);
    assert_eq!(db.ledger_rows(), 1);
    assert_eq!(
        store.open_reservations().await.unwrap(),
        0,
        "none left open"
    );
}

/// A copy of the spool file at `from` (its write-ahead log with it) at `to`: what the
/// spool held at that moment, as a process killed then would have left it.
fn copy_spool(from: &str, to: &str) {
    std::fs::copy(from, to).unwrap();
    let wal = format!("{from}-wal");
    if std::path::Path::new(&wal).exists() {
        std::fs::copy(&wal, format!("{to}-wal")).unwrap();
    }
}

/// A spool replayed after Postgres took part of it (the process died between the
/// commit and forgetting what it committed, or the commit's acknowledgement was lost):
/// each write is in the ledger once, the ones already there unchanged.
#[tokio::test]
async fn a_spool_replayed_after_a_partial_success_does_not_double() {
    let db = Db::new();
    let spool = db.new_spool();
    let store = PgStore::open(&db.config_on(&spool)).await.unwrap();
    let r = reservation(&store, "s", 1, 300);
    let reserved = r.id;
    store.reserve(r).await.unwrap();
    db.pg.stop_now();
    let usds = [0.5, 0.25, 0.125, 0.0625];
    for (i, usd) in usds.iter().enumerate() {
        let id = match i {
            0 => Some(reserved),
            _ => None,
        };
        let err = store
            .settle(id, charge(Some("s"), 1, 10 + i as i64, *usd))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("kept in the spool"), "{err}");
    }
    assert_eq!(store.spooled(), 4);
    let (left, left_again) = (db.new_spool(), db.new_spool());
    copy_spool(&spool, &left);
    copy_spool(&spool, &left_again);
    db.pg.start_again();
    crate::common::until("the spool replayed", || async {
        store.spooled() == 0 && db.ledger_rows() == 4
    })
    .await;
    drop(store);
    // Postgres took the first two of the four, the last two were lost with the
    // connection: the copy lists all four.
    db.sql("DELETE FROM ledger WHERE ts_ms >= 12");
    assert_eq!(db.ledger_rows(), 2);
    let next = PgStore::open(&db.config_on(&left)).await.unwrap();
    assert_eq!(next.spooled(), 0, "replayed at open");
    assert_eq!(db.ledger_rows(), 4, "each once");
    assert_eq!(
        db.sql("SELECT string_agg(usd::text, ',' ORDER BY ts_ms) FROM ledger"),
        "0.5,0.25,0.125,0.0625"
    );
    assert_eq!(next.open_reservations().await.unwrap(), 0);
    // And a replay of writes all taken already changes nothing either.
    let again = PgStore::open(&db.config_on(&left_again)).await.unwrap();
    assert_eq!((again.spooled(), db.ledger_rows()), (0, 4));
}

/// The cost of the ledger per budgeted call (a reservation committed, then settled)
/// and ledger rows per second at 32-way concurrency, PostgreSQL against SQLite in the
/// same run (a debug build unless run with --release; not run by default):
/// `cargo test --test postgres store::ledger_cost -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn ledger_cost_per_budgeted_call_postgres_against_sqlite() {
    const CALLS: usize = 8_000;
    const CONCURRENCY: usize = 32;
    let db = Db::new();
    let dir = std::env::temp_dir().join(format!("backstop-cost-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let stores: Vec<(&str, Arc<dyn Store>)> = vec![
        (
            "sqlite",
            Arc::new(
                backstop::store::SqliteStore::open(dir.join("ledger.db").to_str().unwrap())
                    .unwrap(),
            ),
        ),
        ("postgres", Arc::new(db.open().await)),
    ];
    for (name, store) in stores {
        let started = std::time::Instant::now();
        let tasks: Vec<_> = (0..CONCURRENCY)
            .map(|t| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut took = Vec::new();
                    for i in (t..CALLS).step_by(CONCURRENCY) {
                        let session = format!("session-{}", i / 50);
                        let call = std::time::Instant::now();
                        let id = store.next_reservation_id();
                        store
                            .reserve(ReservationRecord {
                                id,
                                ts_ms: i as i64,
                                day: 1,
                                tenant: "t".into(),
                                session: Some(session.clone()),
                                model: "gpt-4o".into(),
                                calls: 1,
                                tokens: 4096,
                                usd: 0.01,
                            })
                            .await
                            .unwrap();
                        store
                            .settle(Some(id), charge(Some(&session), 1, i as i64, 0.001))
                            .await
                            .unwrap();
                        took.push(call.elapsed());
                    }
                    took
                })
            })
            .collect();
        let mut took = Vec::new();
        for t in tasks {
            took.extend(t.await.unwrap());
        }
        let elapsed = started.elapsed();
        took.sort();
        let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
        println!(
            "{name}: {CALLS} budgeted calls at {CONCURRENCY}-way: {:.0} ledger rows/s, reserve+settle p50 {:?} p99 {:?}",
            CALLS as f64 / elapsed.as_secs_f64(),
            at(0.5),
            at(0.99)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// TLS goes through rustls: a server without it is refused under `sslmode=require`,
/// never spoken to in plain text.
#[tokio::test]
async fn sslmode_require_refuses_a_server_without_tls() {
    let db = Db::new();
    let err = PgStore::open(&StoreConfig {
        url: Some(format!("{}?sslmode=require", db.pg.url(&db.name))),
        ..db.config()
    })
    .await
    .err()
    .expect("refused");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err}");
    assert!(err.to_string().contains("TLS"), "{err}");
}

/// `backstop check-config` names the schema version a postgres store would be brought
/// to, without connecting.
#[test]
fn check_config_reports_the_schema_version_it_would_apply() {
    let dir = std::env::temp_dir().join(format!("backstop-cc-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("backstop.toml");
    std::fs::write(
        &config,
        r#"
[store]
backend = "postgres"
url = "postgres://backstop@db.invalid:5432/ledger?sslmode=require"

[[upstreams]]
name = "mock"
api = "openai"
base_url = "http://127.0.0.1:9"
api_key = "x"

[[routes]]
model = "gpt-*"
targets = [{ upstream = "mock" }]

[[tenants]]
name = "t"
api_keys = ["bk-check-config-key-1"]
"#,
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args(["check-config", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("store: postgres, schema version {SCHEMA_VERSION}")),
        "{stdout}"
    );
    assert!(
        stdout.contains("store: writes postgres cannot take are spooled to backstop-spool.db\n"),
        "the spool's default, beside store.path: {stdout}"
    );
}

/// `n` calls' worth of every kind of token.
fn kinds(n: u64) -> Tokens {
    Tokens {
        input: 10 * n,
        cache_write_5m: 3 * n,
        cache_write_1h: 2 * n,
        cache_read: 7 * n,
        output: 5 * n,
        reasoning: n,
        web_searches: n,
    }
}

#[tokio::test]
async fn the_spend_report_is_summed_per_tenant_day_and_model_and_printed_by_the_command() {
    let db = Db::new();
    let store = db.open().await;
    for (tenant, day, model, usd) in [
        ("b", 101, "gpt-4o", 0.5),
        ("a", 100, "gpt-4o", 0.25),
        ("a", 100, "gpt-4o", 0.125),
        ("a", 100, "claude", 1.0),
        ("a", 101, "gpt-4o", 2.0),
    ] {
        let charge = Charge {
            tenant: tenant.into(),
            day,
            model: model.into(),
            tokens: kinds(1),
            ..charge(None, day, day * 86_400_000, usd)
        };
        store.charge(charge).await.unwrap();
    }
    let query = ReportQuery {
        tenant: Some("a".into()),
        from_day: Some(100),
        to_day: Some(100),
    };
    let rows = store.spend_report(&query).await.unwrap();
    let got: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.tenant.as_str(),
                r.day,
                r.model.as_str(),
                r.calls,
                r.tokens,
                r.usd,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("a", 100, "claude", 1, kinds(1), 1.0),
            ("a", 100, "gpt-4o", 2, kinds(2), 0.375)
        ]
    );
    // Every kind is in the ledger's columns, and the token caps count them all.
    assert_eq!(
        store.tenant_day_usage("a", 100).await.unwrap().tokens,
        3 * kinds(1).total()
    );
    // The command reads the same rows on a connection of its own, writing nothing.
    let all = backstop::store::read_postgres_report(&db.config(), &ReportQuery::default())
        .await
        .unwrap();
    assert_eq!(
        all.len(),
        4,
        "a/100 claude, a/100 gpt-4o, a/101 gpt-4o, b/101 gpt-4o"
    );
    assert_eq!((all[3].tenant.as_str(), all[3].day), ("b", 101));
    let dir = tempfile_dir();
    let config = dir.join("pg.toml");
    std::fs::write(
        &config,
        format!(
            "[store]\nbackend = \"postgres\"\nurl = \"{}\"\n\n[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://127.0.0.1:1\"\n\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"u\" }}]\n\n[[tenants]]\nname = \"a\"\napi_keys = [\"bk-report-key-0001\"]\n",
            db.pg.url(&db.name)
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_backstop"))
        .args([
            "report",
            "--config",
            config.to_str().unwrap(),
            "--tenant",
            "a",
        ])
        .args(["--from", "1970-04-11", "--to", "1970-04-11"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "tenant,day,model,calls,input_tokens,output_tokens,cache_write_tokens,cache_write_1h_tokens,cache_read_tokens,reasoning_tokens,web_searches,usd\n\
         a,1970-04-11,claude,1,10,5,5,2,7,1,1,1.000000\n\
         a,1970-04-11,gpt-4o,2,20,10,10,4,14,2,2,0.375000\n"
    );
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("backstop-pg-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A database at schema version 1 (what the last build made): the report reads its rows
/// with the new kinds at 0 before any replica of this build has migrated it, and opening
/// the store migrates it to version 2 with the old rows intact and readable.
#[tokio::test]
async fn a_ledger_of_schema_one_is_read_as_it_is_then_migrated_with_its_rows_kept() {
    let db = Db::new();
    db.sql(&format!(
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,
             applied_at TIMESTAMPTZ NOT NULL DEFAULT now());
         {}
         INSERT INTO schema_migrations (version, name) VALUES (1, 'ledger');
         INSERT INTO ledger (id, ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd)
             VALUES (1, 0, 100, 't', 's', 'gpt-4o', 1, 30, 20, 0.5);",
        include_str!("../../src/store/postgres/migrations/0001_ledger.sql")
    ));
    let old = Tokens::plain(30, 20);
    let query = ReportQuery::default();
    let before = backstop::store::read_postgres_report(&db.config(), &query)
        .await
        .unwrap();
    assert_eq!(before.len(), 1);
    assert_eq!((before[0].tokens, before[0].usd), (old, 0.5));
    let store = db.open().await;
    assert_eq!(store.migrated().from, 1);
    assert_eq!(store.migrated().to, SCHEMA_VERSION);
    let mut cached = charge(Some("s"), 100, 1, 0.25);
    cached.tokens = kinds(1);
    store.charge(cached).await.unwrap();
    let after = store.spend_report(&query).await.unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!((after[0].tokens, after[0].usd), (old.plus(kinds(1)), 0.75));
    assert_eq!(
        store.session_usage("t", "s").await.unwrap().tokens,
        old.total() + kinds(1).total(),
        "the token caps count the old row and every kind of the new"
    );
}

/// The journal contract on PostgreSQL, and one journal per database: what one replica's
/// store wrote, another's reads.
#[tokio::test]
async fn journals_are_kept_once_per_call_and_shared_by_the_stores_of_one_database() {
    let db = Db::new();
    let (a, b) = (db.open().await, db.open().await);
    crate::common::journal::journal_contract(&a, "t").await;
    let seen: Vec<String> = backstop::store::Journals::journal(&b, "t", "s")
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.call_id)
        .collect();
    assert_eq!(seen, ["a", "c", "d", "p"]);
}
