//! What a replica needs to start on a PostgreSQL ledger, through the real binary: TLS
//! (`sslmode=require`) to a server whose certificate a CA of the operator's own signed,
//! named by `SSL_CERT_FILE`; and a bounded wait for another process's migrations.

use std::time::{Duration, Instant};

use crate::common::{Binary, TempDir};
use crate::postgres_support::Postgres;
use crate::process::{call, replica_toml, serve_until_exit};
use crate::redis_support::{free_port, MockUpstream};

/// `sslmode=require` against a server with a certificate from a private CA: without
/// the CA the replica does not start (the certificate is verified), with it
/// (`SSL_CERT_FILE`) a budgeted call is one ledger row, written over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_reaches_a_server_whose_ca_is_named_by_ssl_cert_file() {
    let pg = Postgres::start_tls();
    let db = pg.create_database();
    let mock = MockUpstream::start().await;
    let dir = TempDir::new("backstop-pg-tls");
    let port = free_port();
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}?sslmode=require\"\nspool = \"{}\"",
        pg.url(&db),
        dir.0.join("spool.db").display()
    );
    let config = dir.0.join("replica.toml");
    std::fs::write(&config, replica_toml(port, &store, "", &mock.base_url())).unwrap();

    // The system's roots do not know the test's CA: refused, and said why.
    let (status, log) = serve_until_exit(&config, &[]);
    assert!(!status.success(), "{log}");
    assert!(log.contains("cannot open the ledger on postgres"), "{log}");
    assert!(log.contains("UnknownIssuer"), "{log}");

    let ca = pg.ca_file();
    let ca = format!("SSL_CERT_FILE={}", ca.display());
    let replica =
        Binary::start_under(&["env", &ca], &config, port, std::process::Stdio::null()).await;
    let http = reqwest::Client::new();
    let resp = call(&http, &replica.url, "tls", "").await.unwrap();
    assert_eq!(resp.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.psql(&db, "SELECT COUNT(*) FROM ledger") != "1" {
        assert!(
            Instant::now() < deadline,
            "the call never reached the ledger"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every connection the replica holds is encrypted.
    let connections = pg.psql(
        &db,
        "SELECT COUNT(*) || ' ' || COUNT(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a
         JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'backstop'",
    );
    let (all, tls) = connections.split_once(' ').unwrap();
    assert!(all.parse::<u32>().unwrap() > 0, "{connections}");
    assert_eq!(all, tls, "connections, encrypted: {connections}");
}

/// A replica that cannot have the migrations' advisory lock (another session holds it)
/// gives up after `store.migration_timeout` with a clear error and a non-zero exit,
/// and starts once the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_waiting_for_the_migration_lock_gives_up_after_the_timeout() {
    let pg = Postgres::start();
    let db = pg.create_database();
    let dir = TempDir::new("backstop-pg-lock");
    let port = free_port();
    let store = format!(
        "backend = \"postgres\"\nurl = \"{}\"\nspool = \"{}\"\nmigration_timeout = \"1s\"",
        pg.url(&db),
        dir.0.join("spool.db").display()
    );
    let config = dir.0.join("replica.toml");
    std::fs::write(
        &config,
        replica_toml(port, &store, "", "http://127.0.0.1:9"),
    )
    .unwrap();
    let (holder, connection) = tokio_postgres::connect(&pg.url(&db), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    holder
        .execute(
            "SELECT pg_advisory_lock($1)",
            &[&backstop::store::MIGRATION_LOCK],
        )
        .await
        .unwrap();

    let started = Instant::now();
    let (status, log) = tokio::task::spawn_blocking(move || serve_until_exit(&config, &[]))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains(&format!(
            "cannot open the ledger on postgres: another session has held the migrations' advisory lock ({}) \
             for longer than store.migration_timeout (1s)",
            backstop::store::MIGRATION_LOCK
        )),
        "{log}"
    );
    // Not one of the connection's own timeouts: the bound is the lock's.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_eq!(
        pg.psql(
            &db,
            "SELECT COUNT(*) FROM pg_tables WHERE tablename = 'ledger'"
        ),
        "0",
        "nothing migrated without the lock"
    );

    drop(holder);
    let _ = connection.await;
    let config = dir.0.join("replica.toml");
    let replica = Binary::start(&config, port).await;
    assert_eq!(
        pg.psql(&db, "SELECT MAX(version) FROM schema_migrations"),
        backstop::store::SCHEMA_VERSION.to_string()
    );
    drop(replica);
}
