//! The tests that need a real PostgreSQL (`initdb` and `pg_ctl`: `.ci/run` installs
//! `postgresql`; without it they fail, not skip), and for Redis in front of it
//! `redis-server`. Each test starts a server of its own
//! (tests/common/postgres.rs).
//!
//! `cargo test --test postgres store::`, `outage::`, `replicas::`, `spool::`, `start::`; `cost::` (ignored: a measurement).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/postgres.rs"]
mod postgres_support;
#[path = "../common/redis.rs"]
mod redis_support;

mod cost;
mod fleet;
mod outage;
mod process;
mod replicas;
mod spool;
mod start;
mod store;
