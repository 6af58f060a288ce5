//! The schema, as versioned migrations embedded in the binary.
//!
//! `schema_migrations` holds one row per applied version. Opening the store takes a
//! session-level advisory lock ([`MIGRATION_LOCK`]) on a connection of its own, reads
//! the versions applied, applies the missing ones in order (each in its own transaction
//! with its row), and lets go: replicas starting together wait for the first, then find
//! nothing left to do. The lock goes with the connection, so a replica killed while
//! migrating holds no one up (and its transaction rolls back). The wait for it is
//! bounded by `store.migration_timeout` (`lock_timeout` on the server, and the same
//! bound plus a margin here, for a network that stopped answering): a replica that
//! cannot have it gives up with [`MigrateError::LockWait`] instead of hanging at start.
//!
//! A migration is never edited once released: a change is a new file and a new entry.
//! A database at a version newer than this build knows is used as it is (a rolling
//! upgrade meets the older replicas there: migrations only add), with a warning.

use std::time::Duration;

use tokio_postgres::{error::SqlState, Client};

/// One version of the schema.
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "ledger",
        sql: include_str!("migrations/0001_ledger.sql"),
    },
    Migration {
        version: 2,
        name: "token_kinds",
        sql: include_str!("migrations/0002_token_kinds.sql"),
    },
    Migration {
        version: 3,
        name: "recovered_mark",
        sql: include_str!("migrations/0003_recovered_mark.sql"),
    },
    Migration {
        version: 4,
        name: "side_effects",
        sql: include_str!("migrations/0004_side_effects.sql"),
    },
];

/// The schema version this build applies (its newest migration).
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// `pg_advisory_lock` key of the migrations: "bkstpmig" in ASCII, so no other
/// application's lock is likely to meet it.
pub const MIGRATION_LOCK: i64 = 0x626b_7374_706d_6967;

/// What opening the store found and did.
#[derive(Debug, Clone, PartialEq)]
pub struct Migrated {
    /// The version before (0: an empty database).
    pub from: i32,
    /// The version after.
    pub to: i32,
}

/// Why the migrations did not run.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Another session held the lock for longer than the wait allowed.
    #[error(
        "another session has held the migrations' advisory lock ({MIGRATION_LOCK}) for longer than \
         store.migration_timeout ({0:?}): a migration still running, or a session stuck holding it \
         (pg_locks, locktype 'advisory'); giving up"
    )]
    LockWait(Duration),
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
}

/// Applies what is missing, under the advisory lock, waited for `wait` at most.
/// `client` is a connection of the migration's own, without a statement timeout (a
/// migration may outlast one).
pub async fn migrate(client: &mut Client, wait: Duration) -> Result<Migrated, MigrateError> {
    let ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
    client
        .batch_execute(&format!("SET lock_timeout = {ms}"))
        .await?;
    let lock = client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]);
    match tokio::time::timeout(wait + Duration::from_secs(5), lock).await {
        Ok(Ok(_)) => {}
        Ok(Err(err)) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            return Err(MigrateError::LockWait(wait))
        }
        Ok(Err(err)) => return Err(err.into()),
        Err(_) => return Err(MigrateError::LockWait(wait)),
    }
    // The migrations themselves wait for what they need.
    client.batch_execute("SET lock_timeout = 0").await?;
    let result = apply(client).await.map_err(MigrateError::from);
    // On an error the connection is dropped by the caller, which releases it too.
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await?;
    result
}

async fn apply(client: &mut Client) -> Result<Migrated, tokio_postgres::Error> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (
                version INTEGER PRIMARY KEY,
                name TEXT NOT NULL,
                applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
            )",
        )
        .await?;
    let from: i32 = client
        .query_one(
            "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
            &[],
        )
        .await?
        .get(0);
    if from > SCHEMA_VERSION {
        tracing::warn!(
            database = from,
            build = SCHEMA_VERSION,
            "the ledger's schema is newer than this build's: used as it is"
        );
        return Ok(Migrated { from, to: from });
    }
    for m in MIGRATIONS.iter().filter(|m| m.version > from) {
        let tx = client.transaction().await?;
        tx.batch_execute(m.sql).await?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
            &[&m.version, &m.name],
        )
        .await?;
        tx.commit().await?;
        tracing::info!(version = m.version, name = m.name, "ledger schema migrated");
    }
    Ok(Migrated {
        from,
        to: SCHEMA_VERSION,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_run_from_one_without_gaps() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i as i32 + 1, "{}", m.name);
        }
    }
}
