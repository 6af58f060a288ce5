//! [`PgStore`]: one PostgreSQL database for every replica (`[store] backend = "postgres"`):
//! the spend ledger, durable reservations, idempotency records and their claims,
//! Responses owners, and the session guard's closes, trips and shared windows, for every
//! replica at once.
//!
//! - **Ids.** Opening the store takes an epoch from a sequence; every reservation (and
//!   every charge without one) gets `epoch << 43 | n`, unique across replicas with no
//!   round trip per call ([`PgStore::next_reservation_id`] is synchronous).
//! - **Exactly once.** A ledger row's key is its reservation's id, and every insert is
//!   `ON CONFLICT (id) DO NOTHING`: a settle retried after a lost acknowledgement, or one
//!   racing the recovery of its reservation, is one row. A row the recovery wrote is
//!   marked `recovered`, and the replica's own settle (it was only cut off, and settles
//!   later or from its spool) replaces it with the true charge, once
//!   (`backstop_ledger_corrections_total{outcome="corrected"}`, logged as an error: the
//!   replica was declared dead); a settle that finds its own earlier row is
//!   `discarded`, counted and logged too.
//! - **Group commit.** Writes queue to one writer task ([`writer`]) that commits each
//!   batch in one transaction, its statements pipelined; a reservation resolves once it
//!   is committed, before the upstream call.
//! - **Crashes.** Each replica heartbeats its epoch in `replicas`; one not seen for
//!   `store.replica_lease` is dead, and a live replica charges its reservations at their
//!   reserved amount (as SQLite does at open). A replica only recovers after its own
//!   heartbeats have gone through for a whole lease, so one that has just found Postgres
//!   again does not take its peers, cut off as long as it was, for dead.
//! - **Outages.** A connection that fails, or a statement past `store.statement_timeout`,
//!   is [`StoreError::Unavailable`]: the budgets then follow `[state] on_unavailable`,
//!   and the writer keeps charges for calls already made in the replica's spool
//!   (`store.spool`, [`spool`]), fsynced, until Postgres takes them; a process opening
//!   the spool replays what its predecessor left there before anything else.
//! - **Schema.** Versioned migrations embedded in the binary, applied at open under an
//!   advisory lock ([`migrate`]).
//!
//! TLS: `sslmode=require` (or `prefer`, tokio-postgres's default) in the URL, through
//! rustls with the system's trusted roots; the certificate is always verified.

use std::{
    sync::{
        atomic::{AtomicI64, AtomicU64, Ordering},
        Arc, Weak,
    },
    time::Duration,
};

mod migrate;
mod spool;
mod writer;

pub use migrate::{Migrated, MIGRATION_LOCK, SCHEMA_VERSION};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{error::SqlState, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use self::{
    spool::Spool,
    writer::{Backlog, PgWrite},
};
use super::{
    count_error, write::Op, Charge, Claim, CommittedUsage, GuardRecord, GuardStates, JournalRecord,
    Journals, Ledger, OwnerRecord, Owners, QueuedSettle, Replays, ReportQuery, ReportRow,
    ReservationRecord, SettleQueue, Store, StoreError, StoreFuture, StoredOwner, StoredResponse,
    Tier, WindowSave,
};
use crate::{billing::Tokens, config::StoreConfig, policy::budget::Usage};

/// Bits of an id under its epoch.
const EPOCH_SHIFT: u32 = 43;

/// The epoch an id was assigned under.
pub(super) fn epoch_of(id: i64) -> i64 {
    id >> EPOCH_SHIFT
}

/// The database's clock, in ms since the epoch: leases and claims are timed by it, so
/// replicas with skewed clocks agree.
const NOW_MS: &str = "(extract(epoch from clock_timestamp()) * 1000)::bigint";

/// Why a Postgres call failed: `transient` when Postgres could not be reached or did
/// not answer in time (retry later), not when it refused the statement.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) transient: bool,
    pub(super) message: Arc<str>,
}

impl From<tokio_postgres::Error> for Failure {
    fn from(err: tokio_postgres::Error) -> Self {
        let transient = match err.code() {
            // No answer from the server: the connection is gone, or never was (a
            // parameter this build failed to encode is not an outage).
            None => {
                err.is_closed()
                    || std::error::Error::source(&err).is_some_and(|e| e.is::<std::io::Error>())
                    || err.to_string().contains("timeout")
            }
            Some(code) => {
                let c = code.code();
                // Connection exceptions, operator intervention (shutdown, statement
                // timeout), insufficient resources, and serialization failures.
                c.starts_with("08")
                    || c.starts_with("57")
                    || c.starts_with("53")
                    || *code == SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == SqlState::T_R_DEADLOCK_DETECTED
            }
        };
        let message = if transient {
            format!("postgres is unavailable: {}", describe(&err))
        } else {
            format!("postgres refused a statement: {}", describe(&err))
        };
        Failure {
            transient,
            message: message.into(),
        }
    }
}

/// An error with its causes ("error performing TLS handshake: invalid peer
/// certificate: UnknownIssuer"): tokio-postgres keeps the reason in the source.
fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text = format!("{text}: {cause_text}");
        }
        source = cause.source();
    }
    text
}

impl Failure {
    fn into_error(self) -> StoreError {
        if self.transient {
            StoreError::Unavailable(self.message)
        } else {
            StoreError::Read(self.message)
        }
    }
}

struct Shared {
    pool: Pool,
    epoch: i64,
    lease: Duration,
    timeout: Duration,
    recovered: AtomicU64,
}

pub struct PgStore {
    shared: Arc<Shared>,
    writer: mpsc::UnboundedSender<PgWrite>,
    next: AtomicI64,
    recovered_at_open: u64,
    /// What this store's settles found of rows already written.
    tally: Arc<writer::Tally>,
    migrated: Migrated,
    /// Ledger rows, session resets and guard states older than this are purged.
    retention: Duration,
    /// The writer's spool, here to say how much it holds.
    spool: Spool,
}

/// rustls with the system's trusted roots (as `rediss://` uses), on ring (the provider
/// reqwest and redis already bring).
fn tls() -> Result<MakeRustlsConnect, StoreError> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for err in &found.errors {
        tracing::debug!(error = %err, "a system root certificate could not be read");
    }
    roots.add_parsable_certificates(found.certs);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| StoreError::Unavailable(format!("store.url: TLS: {e}").into()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The connection settings `store` names, every statement bounded by its timeout.
fn pg_config(store: &StoreConfig) -> Result<tokio_postgres::Config, StoreError> {
    let url = store.url.as_deref().unwrap_or_default();
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| StoreError::Unavailable(format!("store.url: {e}").into()))?;
    let timeout = format!("-c statement_timeout={}", ms(store.statement_timeout));
    let options = match config.get_options() {
        Some(given) => format!("{given} {timeout}"),
        None => timeout,
    };
    config.options(&options);
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(store.statement_timeout);
    }
    if config.get_application_name().is_none() {
        config.application_name("backstop");
    }
    Ok(config)
}

impl PgStore {
    /// Connects, applies the migrations this build has and the database lacks, takes
    /// an epoch, and charges the reservations of replicas found dead. Fails if Postgres
    /// cannot be reached: a replica does not start without its ledger.
    pub async fn open(store: &StoreConfig) -> Result<PgStore, StoreError> {
        PgStore::open_retrying_after(store, writer::RETRY_FIRST).await
    }

    /// As [`PgStore::open`], the writes kept while Postgres is away first retried
    /// `first_retry` after they were kept (not 100 ms): for a test that must be the one
    /// to find Postgres back, without waiting for the backoff to grow long. No
    /// configuration reaches it.
    #[doc(hidden)]
    pub async fn open_retrying_after(
        store: &StoreConfig,
        first_retry: Duration,
    ) -> Result<PgStore, StoreError> {
        let config = pg_config(store)?;
        // Taken first: a replica pointed at another's spool stops here, before Postgres.
        let mut backlog = Backlog::new(Spool::open(&store.spool_path())?);
        let tls = tls()?;
        // Whatever stops the store from opening stops the replica from starting: say
        // what, with its causes.
        let unavailable = |e: tokio_postgres::Error| {
            StoreError::Unavailable(
                format!("cannot open the ledger on postgres: {}", describe(&e)).into(),
            )
        };
        // The migrations' own connection, with no statement timeout: it may wait for
        // another replica's migration, and a migration may take long.
        // (The URL's own options, a search_path say, stay: the schema must be made
        // where the pool will look for it.)
        let (mut client, connection) = config.connect(tls.clone()).await.map_err(unavailable)?;
        let connection = tokio::spawn(connection);
        client
            .batch_execute("SET statement_timeout = 0")
            .await
            .map_err(unavailable)?;
        let migrated = migrate::migrate(&mut client, store.migration_timeout)
            .await
            .map_err(|e| match e {
                migrate::MigrateError::Postgres(e) => unavailable(e),
                wait => StoreError::Unavailable(
                    format!("cannot open the ledger on postgres: {wait}").into(),
                ),
            })?;
        drop(client);
        let _ = connection.await;

        let manager = Manager::from_config(
            config,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(store.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(store.statement_timeout))
            .create_timeout(Some(store.statement_timeout))
            .recycle_timeout(Some(store.statement_timeout))
            .build()
            .map_err(|e| StoreError::Unavailable(format!("store: {e}").into()))?;
        let client = pool.get().await.map_err(|e| {
            StoreError::Unavailable(format!("postgres is unavailable: {}", describe(&e)).into())
        })?;
        let epoch: i64 = client
            .query_one("SELECT nextval('replica_epochs')", &[])
            .await
            .map_err(unavailable)?
            .get(0);
        heartbeat(&client, epoch).await.map_err(unavailable)?;
        // What a predecessor on this spool could not write, before its reservations are
        // charged as a dead replica's: its settles say what the calls really cost.
        if backlog.spool.len() > 0 {
            let left = backlog.spool.len();
            match writer::replay(&pool, &mut backlog).await {
                Ok(n) => tracing::info!(
                    writes = n,
                    spool = backlog.spool.path(),
                    "writes left in the spool by an earlier process are in postgres"
                ),
                Err(failure) => tracing::warn!(
                    writes = left,
                    error = %failure.message,
                    "writes left in the spool by an earlier process wait for postgres"
                ),
            }
        }
        let recovered = recover(&client, epoch, store.replica_lease)
            .await
            .map_err(unavailable)?;
        drop(client);
        if recovered > 0 {
            report_recovered(recovered);
        }
        let shared = Arc::new(Shared {
            pool: pool.clone(),
            epoch,
            lease: store.replica_lease,
            timeout: store.statement_timeout,
            recovered: AtomicU64::new(recovered),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let spool = backlog.spool.clone();
        let tally = backlog.tally.clone();
        tokio::spawn(writer::write_loop(pool, backlog, rx, first_retry));
        tokio::spawn(keep_alive(Arc::downgrade(&shared)));
        tracing::info!(epoch, schema = migrated.to, "ledger on postgres");
        Ok(PgStore {
            shared,
            writer: tx,
            next: AtomicI64::new(1),
            recovered_at_open: recovered,
            tally,
            migrated,
            retention: store.retention,
            spool,
        })
    }

    /// Writes waiting in the spool for Postgres to take them.
    pub fn spooled(&self) -> u64 {
        self.spool.len()
    }

    /// What opening found and applied.
    pub fn migrated(&self) -> &Migrated {
        &self.migrated
    }

    /// This process's epoch (the high bits of its ids).
    pub fn epoch(&self) -> i64 {
        self.shared.epoch
    }

    /// Reservations of dead replicas charged by this one since it opened (at open
    /// included).
    pub fn recovered_total(&self) -> u64 {
        self.shared.recovered.load(Ordering::Relaxed)
    }

    /// Settles of this store that found their row written since it opened: corrected
    /// (the recovery of this replica, taken for dead, had charged the reservation) and
    /// discarded (its own earlier write).
    pub fn ledger_corrections(&self) -> (u64, u64) {
        (
            self.tally.corrected.load(Ordering::Relaxed),
            self.tally.discarded.load(Ordering::Relaxed),
        )
    }

    async fn write(&self, op: Op) -> Result<(), StoreError> {
        let label = op.label();
        let (ack, done) = oneshot::channel();
        if self.writer.send(PgWrite { op, ack: Some(ack) }).is_err() {
            count_error(label);
            return Err(StoreError::Closed);
        }
        done.await.unwrap_or_else(|_| {
            count_error(label);
            Err(StoreError::Closed)
        })
    }

    /// A pooled connection.
    async fn client(&self) -> Result<deadpool_postgres::Object, Failure> {
        Ok(self.shared.pool.get().await?)
    }

    /// Runs a read, bounded by the statement timeout (the server bounds each
    /// statement; this bounds a network that stopped answering), its failure typed and
    /// counted.
    async fn read<T>(
        &self,
        run: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(self.shared.timeout, run).await {
            Ok(result) => result.map_err(Failure::into_error),
            Err(_) => Err(StoreError::Unavailable(
                "postgres is unavailable: no answer within store.statement_timeout".into(),
            )),
        };
        if let Err(err) = &result {
            tracing::debug!(error = %err, "store read failed");
            count_error("read");
        }
        result
    }
}

/// Spend per tenant, UTC day and model: one GROUP BY over `ledger_by_day`, summed as
/// the SQLite store's report is (counts saturate instead of failing the report).
async fn report_rows(
    c: &tokio_postgres::Client,
    query: &ReportQuery,
) -> Result<Vec<ReportRow>, tokio_postgres::Error> {
    let from = query.from_day.unwrap_or(i64::MIN);
    let to = query.to_day.unwrap_or(i64::MAX);
    // A database no replica of this build has migrated yet (a report run first) has
    // no kind columns: zeros in their place.
    let kinds = c
        .query_opt(
            "SELECT 1 FROM information_schema.columns
             WHERE table_schema = current_schema() AND table_name = 'ledger'
               AND column_name = 'web_searches'",
            &[],
        )
        .await?
        .is_some();
    let sums = match kinds {
        true => "SUM(calls)::float8, SUM(input_tokens)::float8, SUM(output_tokens)::float8, \
                 SUM(usd)::float8, SUM(cache_write_tokens)::float8, SUM(cache_write_1h_tokens)::float8, \
                 SUM(cache_read_tokens)::float8, SUM(reasoning_tokens)::float8, SUM(web_searches)::float8",
        false => "SUM(calls)::float8, SUM(input_tokens)::float8, SUM(output_tokens)::float8, \
                  SUM(usd)::float8, 0::float8, 0::float8, 0::float8, 0::float8, 0::float8",
    };
    let rows = match &query.tenant {
        Some(tenant) => {
            let sql = format!(
                "SELECT tenant, day, model, {sums} FROM ledger
                 WHERE tenant = $1 AND day BETWEEN $2 AND $3
                 GROUP BY tenant, day, model ORDER BY tenant, day, model"
            );
            c.query(&sql, &[tenant, &from, &to]).await?
        }
        None => {
            let sql = format!(
                "SELECT tenant, day, model, {sums} FROM ledger WHERE day BETWEEN $1 AND $2
                 GROUP BY tenant, day, model ORDER BY tenant, day, model"
            );
            c.query(&sql, &[&from, &to]).await?
        }
    };
    let count = |v: f64| {
        if v.is_finite() {
            v.max(0.0) as u64
        } else {
            u64::MAX
        }
    };
    Ok(rows
        .iter()
        .map(|r| {
            let written = count(r.get(7));
            let hour = count(r.get(8)).min(written);
            ReportRow {
                tenant: r.get(0),
                day: r.get(1),
                model: r.get(2),
                calls: count(r.get(3)),
                tokens: Tokens {
                    input: count(r.get(4)),
                    output: count(r.get(5)),
                    cache_write_5m: written - hour,
                    cache_write_1h: hour,
                    cache_read: count(r.get(9)),
                    reasoning: count(r.get(10)),
                    web_searches: count(r.get(11)),
                },
                usd: r.get::<_, f64>(6).max(0.0),
            }
        })
        .collect())
}

/// The ledger's report read from Postgres on a connection of its own: no migration, no
/// epoch, no recovery, nothing written (`backstop report` beside running replicas).
pub async fn read_report(
    store: &StoreConfig,
    query: &ReportQuery,
) -> Result<Vec<ReportRow>, StoreError> {
    let config = pg_config(store)?;
    let failed = |e: tokio_postgres::Error| {
        StoreError::Unavailable(
            format!("cannot read the ledger on postgres: {}", describe(&e)).into(),
        )
    };
    let (client, connection) = config.connect(tls()?).await.map_err(failed)?;
    let connection = tokio::spawn(connection);
    client
        .batch_execute("SET default_transaction_read_only = on")
        .await
        .map_err(failed)?;
    let rows = report_rows(&client, query).await.map_err(failed);
    drop(client);
    let _ = connection.await;
    rows
}

fn report_recovered(n: u64) {
    tracing::warn!(
        reservations = n,
        "unsettled reservations of replicas found dead charged at their reserved amount"
    );
    metrics::counter!("backstop_reservations_recovered_total").increment(n);
}

async fn heartbeat(
    client: &tokio_postgres::Client,
    epoch: i64,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            &format!(
                "INSERT INTO replicas (epoch, started_ms, seen_ms) VALUES ($1, {NOW_MS}, {NOW_MS})
                 ON CONFLICT (epoch) DO UPDATE SET seen_ms = EXCLUDED.seen_ms"
            ),
            &[&epoch],
        )
        .await
        .map(drop)
}

/// Charges the reservations of every replica not seen for `lease` (but this one) into
/// the ledger at their reserved amount, once per id. How many it charged.
async fn recover(
    client: &tokio_postgres::Client,
    epoch: i64,
    lease: Duration,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            &format!(
                "WITH moved AS (
                     DELETE FROM reservations WHERE epoch <> $1
                         AND epoch NOT IN (SELECT epoch FROM replicas WHERE seen_ms >= {NOW_MS} - $2)
                     RETURNING id, ts_ms, day, tenant, session, model, calls, tokens, usd)
                 INSERT INTO ledger (id, ts_ms, day, tenant, session, model, calls, input_tokens, output_tokens, usd, recovered)
                 SELECT id, ts_ms, day, tenant, session, model, calls, tokens, 0, usd, true FROM moved ORDER BY id
                 ON CONFLICT (id) DO NOTHING"
            ),
            &[&epoch, &ms(lease)],
        )
        .await
}

/// While the store lives: heartbeats every quarter lease, and, once this replica's own
/// heartbeats have gone through for a whole lease, charges dead replicas' reservations.
async fn keep_alive(shared: Weak<Shared>) {
    let every = {
        let Some(s) = shared.upgrade() else { return };
        (s.lease / 4).max(Duration::from_millis(100))
    };
    let mut healthy_since: Option<tokio::time::Instant> = Some(tokio::time::Instant::now());
    let mut last_beat = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(every).await;
        let Some(s) = shared.upgrade() else { return };
        let beat = async {
            let client = s.pool.get().await.ok()?;
            heartbeat(&client, s.epoch).await.ok()?;
            Some(client)
        };
        let Some(client) = tokio::time::timeout(s.timeout, beat).await.ok().flatten() else {
            healthy_since = None;
            continue;
        };
        let now = tokio::time::Instant::now();
        let cut_off = now.duration_since(last_beat);
        last_beat = now;
        if cut_off > s.lease {
            tracing::error!(
                epoch = s.epoch,
                cut_off_ms = cut_off.as_millis() as u64,
                lease_ms = s.lease.as_millis() as u64,
                "this replica was cut off from postgres for longer than store.replica_lease: its peers may have declared it dead and charged its open reservations at their reserved amount; its own settles correct those rows"
            );
            metrics::counter!("backstop_replica_declared_dead_total").increment(1);
        }
        let since = *healthy_since.get_or_insert_with(tokio::time::Instant::now);
        if since.elapsed() < s.lease {
            continue;
        }
        match recover(&client, s.epoch, s.lease).await {
            Ok(0) => {}
            Ok(n) => {
                s.recovered.fetch_add(n, Ordering::Relaxed);
                report_recovered(n);
            }
            Err(err) => {
                tracing::debug!(error = %err, "recovering dead replicas' reservations failed")
            }
        }
    }
}

/// Sums as `float8`: no overflow (SQLite's `TOTAL`), converted back saturating.
fn usage_at(row: &Row, first: usize) -> Usage {
    let calls: f64 = row.get(first);
    let tokens: f64 = row.get(first + 1);
    let usd: f64 = row.get(first + 2);
    Usage {
        calls: calls.max(0.0) as u64,
        tokens: tokens.max(0.0) as u64,
        usd: if usd.is_nan() {
            0.0
        } else {
            usd.clamp(0.0, f64::MAX)
        },
    }
}

/// Every kind of token together, as the token caps count them.
const SUMS: &str = "COALESCE(SUM(calls), 0)::float8,
     (COALESCE(SUM(input_tokens), 0) + COALESCE(SUM(output_tokens), 0)
      + COALESCE(SUM(cache_write_tokens), 0) + COALESCE(SUM(cache_read_tokens), 0))::float8,
     COALESCE(SUM(usd), 0)::float8";

/// A reservation's worst case as [`SUMS`] reads a charge: its tokens are all "input".
const RESERVED: &str = "COALESCE(SUM(calls), 0)::float8, COALESCE(SUM(tokens), 0)::float8,
     COALESCE(SUM(usd), 0)::float8";

impl Ledger for PgStore {
    fn recovered_reservations(&self) -> u64 {
        self.recovered_at_open
    }

    fn next_reservation_id(&self) -> i64 {
        (self.shared.epoch << EPOCH_SHIFT) | self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn reserve(&self, reservation: ReservationRecord) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Reserve(reservation)))
    }

    fn settle(&self, reservation: Option<i64>, charge: Charge) -> StoreFuture<'_, ()> {
        // A charge without a reservation still gets an id, so that a retry of it (after
        // a commit whose acknowledgement was lost) is the same row.
        let id = reservation.unwrap_or_else(|| self.next_reservation_id());
        Box::pin(self.write(Op::Settle {
            reservation: Some(id),
            charge,
        }))
    }

    fn settle_later(&self, reservation: Option<i64>, charge: Charge) {
        let id = reservation.unwrap_or_else(|| self.next_reservation_id());
        let op = Op::Settle {
            reservation: Some(id),
            charge,
        };
        if self.writer.send(PgWrite { op, ack: None }).is_err() {
            tracing::error!(
                durable = reservation.is_some(),
                "store writer has stopped: a charge was not written to the ledger"
            );
            count_error("settle");
        }
    }

    fn unreserve(&self, reservation: i64) {
        let op = Op::Unreserve(reservation);
        if self.writer.send(PgWrite { op, ack: None }).is_err() {
            // Left to be charged as a dead replica's at most: never undercounted.
            count_error("reserve");
        }
    }

    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        at_ms: i64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::ResetSession {
            tenant: tenant.into(),
            session: session.into(),
            at_ms,
        }))
    }

    fn session_usage<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, Usage> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
                let sql = format!(
                    "SELECT {SUMS} FROM ledger WHERE tenant = $1 AND session = $2 AND ts_ms >= COALESCE(
                         (SELECT at_ms FROM session_resets WHERE tenant = $1 AND session = $2),
                         -9223372036854775808)"
                );
                let statement = c.prepare_cached(&sql).await?;
                let row = c.query_one(&statement, &[&tenant, &session]).await?;
                Ok(usage_at(&row, 0))
        }))
    }

    fn tenant_day_usage<'a>(&'a self, tenant: &'a str, day: i64) -> StoreFuture<'a, Usage> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let sql = format!("SELECT {SUMS} FROM ledger WHERE tenant = $1 AND day = $2");
            let statement = c.prepare_cached(&sql).await?;
            let row = c.query_one(&statement, &[&tenant, &day]).await?;
            Ok(usage_at(&row, 0))
        }))
    }

    fn tenant_day_by_model<'a>(
        &'a self,
        tenant: &'a str,
        day: i64,
    ) -> StoreFuture<'a, Vec<(String, Usage)>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let sql = format!(
                "SELECT model, {SUMS} FROM ledger WHERE tenant = $1 AND day = $2
                     GROUP BY model ORDER BY model"
            );
            let statement = c.prepare_cached(&sql).await?;
            let rows = c.query(&statement, &[&tenant, &day]).await?;
            Ok(rows
                .iter()
                .map(|r| (r.get::<_, String>(0), usage_at(r, 1)))
                .collect())
        }))
    }

    fn spend_report<'a>(&'a self, query: &'a ReportQuery) -> StoreFuture<'a, Vec<ReportRow>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            Ok(report_rows(&c, query).await?)
        }))
    }

    /// Two reads, pipelined: the day's and the session's ledger sums, each plus the
    /// reservations other replicas hold (this one's are in its own books).
    fn committed_usage<'a>(
        &'a self,
        tenant: &'a str,
        day: i64,
        session: Option<&'a str>,
    ) -> StoreFuture<'a, Option<CommittedUsage>> {
        let epoch = self.shared.epoch;
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let day_sql = format!(
                "WITH l AS (SELECT {SUMS} FROM ledger WHERE tenant = $1 AND day = $2),
                      r AS (SELECT {RESERVED} FROM reservations WHERE tenant = $1 AND day = $2 AND epoch <> $3)
                 SELECT l.*, r.* FROM l, r"
            );
            let session_sql = format!(
                "WITH since AS (SELECT COALESCE(
                          (SELECT at_ms FROM session_resets WHERE tenant = $1 AND session = $2),
                          -9223372036854775808) AS at_ms),
                      l AS (SELECT {SUMS} FROM ledger, since
                            WHERE tenant = $1 AND session = $2 AND ts_ms >= since.at_ms),
                      r AS (SELECT {RESERVED} FROM reservations, since
                            WHERE tenant = $1 AND session = $2 AND epoch <> $3 AND ts_ms >= since.at_ms)
                 SELECT l.*, r.* FROM l, r"
            );
            let both = |row: &Row| {
                let mut u = usage_at(row, 0);
                u.add(usage_at(row, 3));
                u
            };
            let (day_statement, session_statement) =
                futures_util::future::try_join(c.prepare_cached(&day_sql), c.prepare_cached(&session_sql))
                    .await?;
            let day_params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&tenant, &day, &epoch];
            let day_row = c.query_one(&day_statement, &day_params);
            let session_row = async {
                match session {
                    Some(s) => c
                        .query_one(&session_statement, &[&tenant, &s, &epoch])
                        .await
                        .map(Some),
                    None => Ok(None),
                }
            };
            let (day_row, session_row) = futures_util::future::try_join(day_row, session_row).await?;
            Ok(Some(CommittedUsage {
                day: both(&day_row),
                session: session_row.as_ref().map(both),
            }))
        }))
    }

    fn open_reservations(&self) -> StoreFuture<'_, u64> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let row = c
                .query_one("SELECT COUNT(*) FROM reservations", &[])
                .await?;
            Ok(row.get::<_, i64>(0).max(0) as u64)
        }))
    }
}

impl SettleQueue for PgStore {
    fn queue_settle(&self, settle: QueuedSettle) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::QueueSettle(settle)))
    }

    fn queued_settles(&self, limit: usize) -> StoreFuture<'_, Vec<QueuedSettle>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Box::pin(self.read(async move {
            let c = self.client().await?;
                let rows = c
                    .query(
                        "SELECT reservation, body, queued_ms FROM shared_settles ORDER BY queued_ms LIMIT $1",
                        &[&limit],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|r| QueuedSettle {
                        reservation: r.get(0),
                        body: r.get(1),
                        queued_ms: r.get(2),
                    })
                    .collect())
        }))
    }

    fn unqueue_settle(&self, reservation: String) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::UnqueueSettle(reservation)))
    }
}

fn stored_response(tenant: &str, key: &str, r: &Row) -> StoredResponse {
    StoredResponse {
        tenant: tenant.to_string(),
        key: key.to_string(),
        body_hash: r.get(0),
        status: u16::try_from(r.get::<_, i32>(1)).unwrap_or(500),
        content_type: r.get(2),
        body: r.get(3),
        expires_ms: r.get(4),
    }
}

impl Replays for PgStore {
    fn remember(&self, response: StoredResponse) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::Remember(response)))
    }

    /// A kept response that has not expired is the answer; otherwise the claim row is
    /// taken if it is free or its lease has run out (on the database's clock), in one
    /// statement, so two replicas cannot both take it.
    fn claim<'a>(&'a self, tenant: &'a str, key: &'a str, lease_ms: i64) -> StoreFuture<'a, Claim> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
                let done = c
                    .query_opt(
                        &format!(
                            "SELECT body_hash, status, content_type, body, expires_ms FROM idempotency
                             WHERE tenant = $1 AND key = $2 AND expires_ms > {NOW_MS}"
                        ),
                        &[&tenant, &key],
                    )
                    .await?;
                if let Some(row) = done {
                    return Ok(Claim::Done(stored_response(tenant, key, &row)));
                }
                let taken = c
                    .query_opt(
                        &format!(
                            "INSERT INTO idempotency_claims (tenant, key, until_ms) VALUES ($1, $2, {NOW_MS} + $3)
                             ON CONFLICT (tenant, key) DO UPDATE SET until_ms = EXCLUDED.until_ms
                                 WHERE idempotency_claims.until_ms <= {NOW_MS}
                             RETURNING 1"
                        ),
                        &[&tenant, &key, &lease_ms.max(1000)],
                    )
                    .await?;
                Ok(if taken.is_some() {
                    Claim::Claimed
                } else {
                    Claim::Pending
                })
        }))
    }

    fn release_claim(&self, tenant: &str, key: &str) {
        let (tenant, key) = (tenant.to_string(), key.to_string());
        let pool = self.shared.pool.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                // A failure leaves the claim to expire with its lease.
                if let Ok(c) = pool.get().await {
                    let _ = c
                        .execute(
                            "DELETE FROM idempotency_claims WHERE tenant = $1 AND key = $2",
                            &[&tenant, &key],
                        )
                        .await;
                }
            });
        }
    }

    fn recall<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        now_ms: i64,
    ) -> StoreFuture<'a, Option<StoredResponse>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let row = c
                .query_opt(
                    "SELECT body_hash, status, content_type, body, expires_ms FROM idempotency
                         WHERE tenant = $1 AND key = $2 AND expires_ms > $3",
                    &[&tenant, &key, &now_ms],
                )
                .await?;
            Ok(row.map(|r| stored_response(tenant, key, &r)))
        }))
    }
}

impl Owners for PgStore {
    fn record_owners(&self, owners: Vec<OwnerRecord>) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::RecordOwners(owners)))
    }

    fn owner_of<'a>(&'a self, id: &'a str, now_ms: i64) -> StoreFuture<'a, Option<StoredOwner>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
                let row = c
                    .query_opt(
                        "SELECT tenant, context_tokens FROM response_owners WHERE id = $1 AND expires_ms > $2",
                        &[&id, &now_ms],
                    )
                    .await?;
                Ok(row.map(|r| StoredOwner {
                    tenant: r.get(0),
                    context_tokens: r.get::<_, Option<i64>>(1).map(|n| n.max(0) as u64),
                }))
        }))
    }
}

impl Journals for PgStore {
    fn journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Vec<JournalRecord>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let rows = c
                .query(
                    "SELECT call_id, at_ms, proposed, entry FROM side_effects
                         WHERE tenant = $1 AND session = $2 ORDER BY at_ms, call_id",
                    &[&tenant, &session],
                )
                .await?;
            Ok(rows
                .iter()
                .map(|r| JournalRecord {
                    call_id: r.get(0),
                    at_ms: r.get(1),
                    proposed: r.get(2),
                    entry: r.get(3),
                })
                .collect())
        }))
    }

    fn write_journal<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        records: Vec<JournalRecord>,
        max_entries: usize,
        _ttl_ms: u64,
    ) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::Journal {
            tenant: tenant.into(),
            session: session.into(),
            records,
            max_entries,
        }))
    }
}

impl GuardStates for PgStore {
    fn save_guard(&self, record: GuardRecord) -> StoreFuture<'_, ()> {
        Box::pin(self.write(Op::SaveGuard(record)))
    }

    fn clear_guard<'a>(&'a self, tenant: &'a str, session: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(self.write(Op::ClearGuard {
            tenant: tenant.into(),
            session: session.into(),
        }))
    }

    fn guard_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> StoreFuture<'a, Option<GuardRecord>> {
        Box::pin(self.read(async move {
            let c = self.client().await?;
            let row = c
                .query_opt(
                    "SELECT closed, until_ms, code, rule, evidence, updated_ms FROM guard_states
                         WHERE tenant = $1 AND session = $2",
                    &[&tenant, &session],
                )
                .await?;
            Ok(row.map(|r| GuardRecord {
                tenant: tenant.to_string(),
                session: session.to_string(),
                closed: r.get(0),
                until_ms: r.get(1),
                code: r.get(2),
                rule: r.get(3),
                evidence: r.get(4),
                updated_ms: r.get(5),
            }))
        }))
    }

    /// Compare-and-set in one statement: an expired window counts as version 0. The
    /// state holds its own window here (`_window` is for Redis).
    fn save_guard_window<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
        version: u64,
        state: String,
        _window: super::format::WindowWrite,
        ttl_ms: u64,
    ) -> StoreFuture<'a, Option<WindowSave>> {
        let version = i64::try_from(version).unwrap_or(i64::MAX);
        let ttl_ms = i64::try_from(ttl_ms).unwrap_or(i64::MAX).max(1000);
        Box::pin(self.read(async move {
            let c = self.client().await?;
                let saved = c
                    .query_opt(
                        &format!(
                            "INSERT INTO guard_windows AS w (tenant, session, version, state, expires_ms)
                             VALUES ($1, $2, $3::bigint + 1, $4, {NOW_MS} + $5::bigint)
                             ON CONFLICT (tenant, session) DO UPDATE
                                 SET version = EXCLUDED.version, state = EXCLUDED.state, expires_ms = EXCLUDED.expires_ms
                                 WHERE (CASE WHEN w.expires_ms <= {NOW_MS} THEN 0 ELSE w.version END) = $3::bigint
                             RETURNING version"
                        ),
                        &[&tenant, &session, &version, &state, &ttl_ms],
                    )
                    .await?;
                if let Some(row) = saved {
                    return Ok(Some(WindowSave::Saved(row.get::<_, i64>(0).max(0) as u64)));
                }
                let row = c
                    .query_opt(
                        &format!(
                            "SELECT version, state FROM guard_windows
                             WHERE tenant = $1 AND session = $2 AND expires_ms > {NOW_MS}"
                        ),
                        &[&tenant, &session],
                    )
                    .await?;
                Ok(Some(match row {
                    Some(r) => WindowSave::Moved(r.get::<_, i64>(0).max(0) as u64, r.get(1)),
                    // Expired in between: the next save starts it over.
                    None => WindowSave::Moved(0, String::new()),
                }))
        }))
    }
}

/// Ledger rows deleted per purge statement, and statements per purge.
const PURGE_STEP: i64 = 10_000;
const PURGE_STEPS: usize = 10;

impl Tier for PgStore {
    fn is_shared(&self) -> bool {
        true
    }
}

impl Store for PgStore {
    /// Beside the writer, on a connection of its own: every replica purges, and
    /// deletes of rows already gone cost nothing.
    fn purge(&self, now_ms: i64) -> StoreFuture<'_, ()> {
        let cutoff = now_ms.saturating_sub(ms(self.retention));
        Box::pin(async move {
            let result = async {
                let client = self.shared.pool.get().await.map_err(|e| Failure {
                    transient: true,
                    message: format!("postgres is unavailable: {}", describe(&e)).into(),
                })?;
                let idempotency = client
                    .execute("DELETE FROM idempotency WHERE expires_ms <= $1", &[&now_ms])
                    .await?;
                client
                    .execute(
                        &format!("DELETE FROM idempotency_claims WHERE until_ms <= {NOW_MS}"),
                        &[],
                    )
                    .await?;
                let owners = client
                    .execute("DELETE FROM response_owners WHERE expires_ms <= $1", &[&now_ms])
                    .await?;
                client
                    .execute("DELETE FROM session_resets WHERE at_ms < $1", &[&cutoff])
                    .await?;
                client
                    .execute("DELETE FROM guard_states WHERE updated_ms < $1", &[&cutoff])
                    .await?;
                client
                    .execute("DELETE FROM side_effects WHERE at_ms < $1", &[&cutoff])
                    .await?;
                client
                    .execute(
                        &format!("DELETE FROM guard_windows WHERE expires_ms <= {NOW_MS}"),
                        &[],
                    )
                    .await?;
                // Epochs long gone with nothing left to recover.
                client
                    .execute(
                        &format!(
                            "DELETE FROM replicas r WHERE seen_ms < {NOW_MS} - $1
                             AND NOT EXISTS (SELECT 1 FROM reservations WHERE epoch = r.epoch)"
                        ),
                        &[&ms(self.shared.lease.max(Duration::from_secs(86_400)))],
                    )
                    .await?;
                let mut ledger = 0;
                for _ in 0..PURGE_STEPS {
                    let n = client
                        .execute(
                            "DELETE FROM ledger WHERE id IN (SELECT id FROM ledger WHERE ts_ms < $1 LIMIT $2)",
                            &[&cutoff, &PURGE_STEP],
                        )
                        .await?;
                    ledger += n;
                    if n == 0 {
                        break;
                    }
                }
                if idempotency + owners + ledger > 0 {
                    tracing::info!(idempotency, owners, ledger, "store purged expired rows");
                    metrics::counter!("backstop_store_purged_rows_total", "table" => "response_owners")
                        .increment(owners);
                    metrics::counter!("backstop_store_purged_rows_total", "table" => "idempotency")
                        .increment(idempotency);
                    metrics::counter!("backstop_store_purged_rows_total", "table" => "ledger")
                        .increment(ledger);
                }
                Ok::<_, Failure>(())
            }
            .await;
            result.map_err(|failure| {
                tracing::error!(error = %failure.message, "store purge failed");
                count_error("purge");
                failure.into_error()
            })
        })
    }
}

impl From<deadpool_postgres::PoolError> for Failure {
    fn from(err: deadpool_postgres::PoolError) -> Self {
        Failure {
            transient: true,
            message: format!("postgres is unavailable: {}", describe(&err)).into(),
        }
    }
}
