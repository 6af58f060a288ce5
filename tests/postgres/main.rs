//! The tests that need a real PostgreSQL (`initdb` and `pg_ctl`: `.ci/run` installs
//! `postgresql`; without it they fail, not skip). Each test starts a server of its own
//! (tests/common/postgres.rs).
//!
//! `cargo test --test postgres store::`, `outage::`, `replicas::`.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/postgres.rs"]
mod postgres_support;

mod outage;
mod replicas;
mod store;
