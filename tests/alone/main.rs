//! Tests that need the process and the machine to themselves, so they run in a test
//! binary of their own (test binaries run one after another):
//! - `body_memory`: reads the process-wide `backstop_body_memory_bytes` gauge, which any
//!   other gateway in the process would move;
//! - `recovery_scenarios`: storms of 1,000 real-time requests with 1 s attempt timeouts,
//!   which tests beside them would stretch into failures.
//!
//! `cargo test --test alone body_memory::`.

#[path = "../common/mod.rs"]
mod common;

mod body_memory;
mod recovery_scenarios;
