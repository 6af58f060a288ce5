//! Pure policy: the decisions of the recovery path as plain functions and state machines
//! that take `now` as an argument. No sockets, no sleeps: the layers call these, and the
//! tests drive them directly.

pub mod backoff;
pub mod breaker;
pub mod budget;
pub mod classify;
pub mod fleet;
pub mod guard;
pub mod outlier;
pub mod restart;
pub mod retry_budget;
pub mod side_effects;
pub mod trail;
pub mod window;
