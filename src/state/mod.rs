//! The live state tier: everything Backstop keeps in memory between requests, in one
//! place. Per tenant and session the budgets (rate limiters, concurrency, reservations;
//! [`budgets`], [`reservation`]) and the session guards with their traces
//! ([`sessions`]), both on one injected [`crate::clock`]; per upstream the breakers and retry
//! budgets ([`health`]). The decisions are pure functions in [`crate::policy`]; what
//! must outlive the process goes to [`crate::store`]. The layers hold this state;
//! nothing here knows about HTTP.

pub mod activity;
pub mod body_memory;
pub mod budgets;
pub mod fleet;
pub mod guard_view;
pub mod health;
pub mod journal;
pub mod live;
pub mod owners;
pub mod redis;
pub mod restarts;
pub mod sessions;
pub mod shared;
