//! Where the budgets count: one [`BudgetBackend`], chosen once when the state is built
//! (`app.rs`): this process's books ([`super::local::LocalBudgets`]) or Redis, which
//! replicas share ([`super::redis::RedisBudgets`], with this replica's books standing in
//! while it is away). [`Budgets`] keeps the rules every backend follows (the worst
//! case, the caps' names, what a settle charges) and the books of this process; the
//! backend decides where a request's limits are checked, where a reservation is held
//! and where the figures are read. Nothing in [`Budgets`] asks which backend it has.
//!
//! The Redis scripts and the Rust arithmetic are held to one contract by the
//! differential tests (`tests/redis/`).
//!
//! Object safe: async methods return a [`BoxFuture`], as the store's do
//! ([`crate::store::StoreFuture`]).

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{
    reservation::{Ask, Reservation},
    Budgets, Gated, Refusal, TenantBook,
};
use crate::{
    policy::budget::{Account, Usage},
    state::shared::{GuardWrite, SharedBudgets},
    store::StoreError,
};

/// A tenant's day as a backend reads it.
pub struct Day {
    /// The UTC day.
    pub day: i64,
    pub account: Account,
    /// Its spend by model, in model order.
    pub by_model: Vec<(String, Usage)>,
}

/// One implementation of the budgets' counting: the request gate, reservations and
/// the figures read back.
pub trait BudgetBackend: Send + Sync {
    /// What one client request of `book`'s tenant asks of the limits before it runs:
    /// the tenant's and the session's request rates, then one of the session's
    /// `max_concurrent` slots; where the guard's state is shared, its write-back
    /// (`guard`), and where the gate reserves ([`BudgetBackend::prepays`]), the first
    /// attempt's reservation (`prepay`). See [`Budgets::gate`].
    fn gate<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: &'a Arc<TenantBook>,
        session: Option<&'a str>,
        guard: Option<GuardWrite>,
        prepay: Option<&'a Ask>,
    ) -> BoxFuture<'a, Result<Gated, Refusal>>;

    /// Whether the gate reserves a call's first attempt (`in_session`, or not).
    fn prepays(&self, book: &TenantBook, in_session: bool) -> bool;

    /// Reserves one upstream call's worst case. See [`Budgets::reserve`].
    fn reserve<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: Arc<TenantBook>,
        session: Option<&'a str>,
        ask: &'a Ask,
    ) -> BoxFuture<'a, Result<Reservation, Refusal>>;

    /// A session's account (settled and reserved).
    fn session_usage<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<Account, StoreError>>;

    /// A session's account and its requests in flight.
    fn session_account<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<(Account, u32), StoreError>>;

    /// The tenant's day: its account and its spend by model.
    fn tenant_day<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
    ) -> BoxFuture<'a, Result<Day, StoreError>>;

    /// Starts a session's usage over where the backend counts it beyond the ledger and
    /// this process's account (which [`Budgets::reset_session`] starts over after).
    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The shared state, for the admin's view of it and its adoption (`None`: there
    /// is none).
    fn shared(&self) -> Option<&Arc<SharedBudgets>>;
}
