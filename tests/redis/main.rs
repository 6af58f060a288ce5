//! The tests that need a real `redis-server` on PATH (`.ci/run` installs it; without it
//! they fail, not skip): replicas sharing live state, the shared books, and every
//! server-side script compiling.
//!
//! `cargo test --test redis replicas::`, `cargo test --test redis shared_books::`,
//! `cargo test --test redis shared_guard::`, `cargo test --test redis scripts::`.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/redis.rs"]
mod redis_support;

mod fleet;
mod replicas;
mod scripts;
mod shared_books;
mod shared_guard;
