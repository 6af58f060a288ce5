//! The integration tests, one module per feature, in one test binary: each `tests/*.rs`
//! used to link a binary of its own, which was most of CI's build time. Every test
//! starts the real gateway on 127.0.0.1:0 (or the real binary) in front of the real mock.
//!
//! A feature's tests alone: `cargo test --test it budgets::`; one test:
//! `cargo test --test it max_calls_is_exact`.
//!
//! The other test binaries: `redis` (needs `redis-server`) and `alone` (tests that need
//! the process and the machine to themselves).
//!
//! `layers::` is the exception to the real gateway: each layer in process, over a
//! scripted inner service (tests/common/layer.rs), with no socket.

#[path = "../common/mod.rs"]
mod common;

mod azure;
mod bedrock;
mod billing;
mod budgets;
mod dashboard;
mod discovery;
mod docs;
mod durability;
mod edge;
mod fleet;
mod gateway;
mod guard;
mod hardening;
mod idempotency;
mod layers;
mod otel;
mod recovery;
mod recovery_policy;
mod reload;
mod report;
mod responses;
mod schema_fuzz;
mod schema_limits;
mod settle;
mod stream_lossless;
mod streaming;
mod strict_mock;
mod switch_answers;
mod translate;
mod validation;
