//! The live budget state: per tenant a daily account, rate limiters and session limits;
//! per session an account and an in-flight count. Sessions idle out of memory (after
//! `session_idle` unused) and are rebuilt from the ledger when they come back, so no
//! history is lost; a session with a call in flight is never rebuilt (see [`LiveSessions`]). The
//! arithmetic is in [`crate::policy::budget`]; persistence in [`crate::store`]; time
//! (rate limits and the UTC day) comes from the injected [`Clock`].
//!
//! A *budgeted* call (its tenant has a day cap, or it belongs to a session and the tenant
//! has session caps) has its reservation committed to the store before the upstream call
//! and settled into the ledger in the same transaction that deletes it; after a crash,
//! the store charges what was left at its reserved amount when it opens. When the store
//! cannot take the reservation, the call is refused (`store_unavailable`), never made
//! unaccounted. Other calls are reserved in memory only and charged to the ledger after.
//!
//! The store is read when a session is first seen (its ledger sum) and when a tenant's
//! day is first needed; everything after that is in memory.

use std::{
    collections::HashMap,
    num::NonZeroU32,
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

pub mod backend;
pub mod background;
pub mod local;
pub mod redis;
mod report;

pub use backend::BudgetBackend;
pub use report::MAX_REPORT_DAYS;
pub mod reservation;

use governor::{
    middleware::NoOpMiddleware,
    state::{keyed::DashMapStateStore, InMemoryState, NotKeyed},
    Quota, RateLimiter,
};

use self::reservation::{Ask, Prepaid, Reservation};
use crate::{
    billing::Prices,
    clock::Clock,
    config::{Config, OnUnavailable, Unpriced},
    policy::budget::{worst_case, Account, Caps, Usage},
    state::{
        guard_view::Written,
        live::{LiveSessions, Session, SessionBook, SessionKey},
        shared::{GuardWrite, SharedBudgets, SharedSlot},
    },
    store::{Books, ReservationRecord, StoreError},
};

type Direct = RateLimiter<NotKeyed, InMemoryState, Clock, NoOpMiddleware<Duration>>;
/// Keyed by a hash of the session id, not the id: each live session's limiter state is
/// then 16 bytes in the map, with no copy of its id (one is made per request otherwise).
/// The hasher is seeded per process, so no client can aim two ids at one limit.
type Keyed = RateLimiter<u64, DashMapStateStore<u64>, Clock, NoOpMiddleware<Duration>>;

fn session_rate_key(session: &str) -> u64 {
    static SEED: std::sync::LazyLock<std::hash::RandomState> =
        std::sync::LazyLock::new(std::hash::RandomState::new);
    std::hash::BuildHasher::hash_one(&*SEED, session)
}

/// Why a call may not go ahead: typed beside the error it becomes.
pub use crate::error::budget::Refusal;

impl From<StoreError> for Refusal {
    fn from(err: StoreError) -> Self {
        Refusal::StoreUnavailable {
            detail: err.to_string(),
        }
    }
}

/// A tenant's limits and live books under one config.
pub struct TenantBook {
    pub(super) name: Arc<str>,
    pub(super) day_limits: Caps,
    pub(super) session_limits: Caps,
    pub(super) max_concurrent: Option<u32>,
    /// Input reserved at least for a call naming server-held context of unknown size.
    pub(super) min_input_tokens: u64,
    /// (UTC day, that day's account). Shared with the books of later configs (a reload),
    /// so calls in flight under the old one settle into the same account.
    pub(super) day: Arc<Mutex<(i64, Account)>>,
    /// False until the day's settled spend has been read from the ledger (on first
    /// use): a tenant with day caps is refused (`store_unavailable`) while it cannot
    /// be, not started at zero.
    day_known: Arc<AtomicBool>,
    /// Kept across a reload that leaves the tenant's rate as it was.
    rate: Option<Arc<Direct>>,
    session_rate: Option<Arc<Keyed>>,
    /// The configured per-minute limits (tenant, session), for the shared limiter.
    rpm: (Option<u32>, Option<u32>),
}

impl TenantBook {
    /// Whether a call (in a session, or not) has a cap to reserve against.
    fn budgets(&self, in_session: bool) -> bool {
        !self.day_limits.is_unlimited() || (in_session && !self.session_limits.is_unlimited())
    }
}

/// A live session's book, holding the session in memory (see [`Session`]).
#[derive(Clone)]
pub struct BookRef(Arc<Session>);

impl BookRef {
    /// A book kept nowhere: gone with its last holder.
    fn detached(book: SessionBook) -> BookRef {
        BookRef(Arc::new(Session {
            book: book.into(),
            ..Session::default()
        }))
    }
}

impl std::ops::Deref for BookRef {
    type Target = SessionBook;

    fn deref(&self) -> &SessionBook {
        self.0
            .book
            .get()
            .expect("a BookRef is only made for a loaded book")
    }
}

pub struct Budgets {
    tenants: HashMap<Arc<str>, Arc<TenantBook>>,
    sessions: LiveSessions<Session>,
    pub(super) store: Arc<dyn Books>,
    pub(super) prices: Prices,
    /// Model names as metric labels: configured names only.
    pub(super) model_labels: crate::telemetry::ModelLabels,
    unpriced: Unpriced,
    pub default_max_tokens: u64,
    /// Reported usage above this is not believed (`billing.max_reported_tokens`).
    pub(super) max_reported_tokens: u64,
    pub(super) clock: Clock,
    /// Where the budgets count: this process's books, or Redis (`[state] backend =
    /// "redis"`; then the books here stand in while it is unavailable). Chosen once.
    backend: Arc<dyn BudgetBackend>,
    /// `[state] on_unavailable`, for a shared store (PostgreSQL) that cannot be
    /// reached: closed refuses budgeted calls (`store_unavailable`); open admits them
    /// on this replica's books, counted as blind. A store error that is not
    /// [`StoreError::Unavailable`] (SQLite's) always refuses.
    on_unavailable: OnUnavailable,
    /// Background Responses' reservations, held until their usage appears (kept
    /// across reloads).
    pub background: Arc<background::BackgroundHolds>,
    /// `billing.background = "refuse"`: no background create for a USD-capped tenant
    /// or session.
    refuse_background: bool,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn per_minute(n: u32) -> Quota {
    Quota::per_minute(NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN))
}

impl Budgets {
    /// Builds the books; nothing is read from the store until it is needed.
    pub fn new(
        config: &Config,
        store: Arc<dyn Books>,
        session_idle: Duration,
        clock: Clock,
    ) -> Self {
        Budgets {
            tenants: HashMap::new(),
            sessions: LiveSessions::new(session_idle, &clock),
            store,
            prices: Prices::default(),
            model_labels: crate::telemetry::ModelLabels::new(config),
            unpriced: config.billing.unpriced,
            default_max_tokens: 0,
            max_reported_tokens: 0,
            clock,
            backend: Arc::new(local::LocalBudgets::new()),
            on_unavailable: config.state.on_unavailable,
            background: Arc::default(),
            refuse_background: false,
        }
        .reconfigured(config)
    }

    /// The books under a new config (a reload): limits, prices and billing from
    /// `config`; the live state of every tenant and session that keeps its name (spend
    /// today, reservations, sessions, in-flight counts, and a rate limiter whose rate is
    /// unchanged) shared with `self`, so calls in flight under `self` settle into the
    /// same accounts. Tenants no longer configured are dropped with their books.
    pub fn reconfigured(&self, config: &Config) -> Self {
        let day = self.clock.today();
        // With shared state, the local limiters only stand in while Redis is away: each
        // replica then takes its share of the limit.
        let replicas = match config.state.backend {
            crate::config::StateBackend::Redis => config.state.replicas.max(1),
            crate::config::StateBackend::Embedded => 1,
        };
        let share = |n: u32| (n / replicas).max(1);
        let clock = &self.clock;
        let tenants = config
            .tenants
            .iter()
            .map(|t| {
                let name: Arc<str> = t.name.as_str().into();
                let old = self.tenants.get(&name);
                let rpm = (t.requests_per_minute, t.session.requests_per_minute);
                let kept_rate = old.filter(|o| o.rpm.0 == rpm.0);
                let kept_session_rate = old.filter(|o| o.rpm.1 == rpm.1);
                let book = TenantBook {
                    name: name.clone(),
                    day_limits: Caps {
                        calls: None,
                        tokens: t.budget.tokens_per_day,
                        usd: t.budget.usd_per_day,
                    },
                    session_limits: Caps {
                        calls: t.session.max_calls,
                        tokens: t.session.max_tokens,
                        usd: t.session.max_usd,
                    },
                    max_concurrent: t.session.max_concurrent,
                    min_input_tokens: t
                        .budget
                        .min_input_tokens
                        .unwrap_or(config.billing.min_input_tokens),
                    day: old.map_or_else(
                        || Arc::new(Mutex::new((day, Account::default()))),
                        |o| o.day.clone(),
                    ),
                    day_known: old.map_or_else(Arc::default, |o| o.day_known.clone()),
                    rate: match kept_rate {
                        Some(o) => o.rate.clone(),
                        None => t.requests_per_minute.map(|n| {
                            Arc::new(RateLimiter::direct_with_clock(
                                per_minute(share(n)),
                                clock.clone(),
                            ))
                        }),
                    },
                    session_rate: match kept_session_rate {
                        Some(o) => o.session_rate.clone(),
                        None => t.session.requests_per_minute.map(|n| {
                            Arc::new(RateLimiter::dashmap_with_clock(
                                per_minute(share(n)),
                                clock.clone(),
                            ))
                        }),
                    },
                    rpm,
                };
                (name, Arc::new(book))
            })
            .collect();
        Budgets {
            tenants,
            sessions: self.sessions.clone(),
            store: self.store.clone(),
            prices: crate::config::prices(config),
            model_labels: crate::telemetry::ModelLabels::new(config),
            unpriced: config.billing.unpriced,
            default_max_tokens: config.billing.default_max_tokens,
            max_reported_tokens: config.billing.max_reported_tokens,
            clock: self.clock.clone(),
            backend: self.backend.clone(),
            on_unavailable: config.state.on_unavailable,
            background: self.background.clone(),
            refuse_background: config.billing.background == crate::config::Background::Refuse,
        }
    }

    /// Whether a background create by `tenant` is refused (`billing.background =
    /// "refuse"` and a USD cap on the tenant's day or, in a session, on the session).
    pub fn refuses_background(&self, tenant: &str, in_session: bool) -> bool {
        self.refuse_background
            && self.tenant(tenant).is_some_and(|book| {
                book.day_limits.usd.is_some() || (in_session && book.session_limits.usd.is_some())
            })
    }

    /// The most `model` may write in one answer, where its price says.
    pub fn max_output_of(&self, model: &str) -> Option<u64> {
        self.prices.lookup(model)?.max_output_tokens
    }

    /// Counts on `backend` instead of this process's books alone (chosen once, when
    /// the state is built; kept across reloads).
    pub fn with_backend(mut self, backend: Arc<dyn BudgetBackend>) -> Self {
        self.backend = backend;
        self
    }

    /// The input tokens reserved at least for `tenant`'s call that names server-held
    /// context Backstop cannot size (`min_input_tokens`).
    pub fn min_input_tokens(&self, tenant: &str) -> u64 {
        self.tenants.get(tenant).map_or(0, |t| t.min_input_tokens)
    }

    /// The state replicas share, when the backend is Redis.
    pub fn shared(&self) -> Option<&Arc<SharedBudgets>> {
        self.backend.shared()
    }

    /// Whether a budgeted call goes ahead although the store failed with `err`: only
    /// when the store is unreachable and `on_unavailable = "open"` (logged and counted
    /// as blind, as a Redis outage is).
    pub(super) fn blind_past(&self, err: &StoreError, what: &'static str) -> bool {
        if !matches!(err, StoreError::Unavailable(_)) || self.on_unavailable != OnUnavailable::Open
        {
            return false;
        }
        metrics::counter!("backstop_state_blind_admissions_total", "what" => what).increment(1);
        tracing::warn!(
            what,
            error = %err,
            "store unavailable; admitted on this replica's own books (on_unavailable = \"open\")"
        );
        true
    }

    pub fn books(&self) -> &Arc<dyn Books> {
        &self.store
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub(super) fn tenant(&self, name: &str) -> Option<&Arc<TenantBook>> {
        self.tenants.get(name)
    }

    /// The live session: in memory, or loaded from the ledger. A failed read is an
    /// error, not a session starting at zero.
    pub(super) async fn session(
        &self,
        tenant: &Arc<str>,
        session: &str,
    ) -> Result<BookRef, StoreError> {
        let live = self
            .sessions
            .get_or_load((tenant.clone(), session.to_string()), || async {
                Ok::<_, StoreError>(Session::default())
            })
            .await?;
        if live.book.get().is_none() {
            let settled = self.store.session_usage(tenant, session).await.inspect_err(|err| {
                tracing::error!(%tenant, session, error = %err, "cannot read the ledger for a session");
            })?;
            // Another call may have read it meanwhile: the first book set is kept.
            let _ = live.book.set(SessionBook {
                account: Mutex::new(Account {
                    settled,
                    reserved: Usage::default(),
                }),
                in_flight: AtomicU32::new(0),
            });
        }
        Ok(BookRef(live))
    }

    /// The live sessions, for the session guards to keep theirs in the same entries.
    pub fn live(&self) -> &LiveSessions<Session> {
        &self.sessions
    }

    /// Reads the tenant's settled spend today from the ledger, once: the first read that
    /// succeeds sets it, and reads that finish later are dropped, since the account has
    /// moved on by then.
    pub(super) async fn know_day(&self, book: &TenantBook) -> Result<(), StoreError> {
        if book.day_known.load(Ordering::Acquire) {
            return Ok(());
        }
        let day = self.clock.today();
        let settled = self
            .store
            .tenant_day_usage(&book.name, day)
            .await
            .inspect_err(|err| {
                tracing::error!(tenant = %book.name, error = %err, "cannot read the ledger; the tenant's day caps refuse calls until it can be read");
            })?;
        let mut account = lock(&book.day);
        if !book.day_known.load(Ordering::Acquire) && account.0 <= day {
            *account = (
                day,
                Account {
                    settled,
                    reserved: account.1.reserved,
                },
            );
            book.day_known.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Rate limits (tenant, then session) for one client request, alone (the admin
    /// API's self-service reads); [`Budgets::gate`] is the proxy's.
    pub async fn check_rate(
        self: &Arc<Self>,
        tenant: &str,
        session: Option<&str>,
    ) -> Result<(), Refusal> {
        match self.gate(tenant, session, None, None).await? {
            Gated::Passed { .. } | Gated::Moved(..) => Ok(()),
        }
    }

    /// What one client request asks of the limits before it runs: the tenant's and the
    /// session's request rates, then one of the session's `max_concurrent` slots. In
    /// replica mode the session guard's write-back (`guard`) goes in the same round trip
    /// ([`SharedBudgets::gate`]): written only if the request passes the limits, and
    /// handed back as [`Gated::Moved`] (nothing spent) when another replica wrote the
    /// guard's state first. Redis unreachable: the rates fall back to this replica's
    /// limiters, the slot follows `on_unavailable`, and the guard decides alone. With
    /// `prepay` (replica mode, a budgeted call) the same round trip also reserves the
    /// first attempt's call ([`Prepaid`]); a refusal of that reservation is left for
    /// the meter to ask again and report.
    pub async fn gate(
        self: &Arc<Self>,
        tenant: &str,
        session: Option<&str>,
        guard: Option<GuardWrite>,
        prepay: Option<&Ask>,
    ) -> Result<Gated, Refusal> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(Gated::Passed {
                slot: None,
                guard: None,
                prepaid: None,
            });
        };
        self.backend.gate(self, book, session, guard, prepay).await
    }

    /// Whether the gate reserves `tenant`'s first attempts (a call in a session, or
    /// not): replica mode, Redis alone holding the reservation, a cap to reserve against.
    /// Asked before the request's [`Ask`] is made, so other calls make none.
    pub fn prepays_for(&self, tenant: &str, in_session: bool) -> bool {
        self.tenant(tenant)
            .is_some_and(|book| self.backend.prepays(book, in_session))
    }

    /// A call's durable reservation, under a new id, as the store records it.
    pub(super) fn reservation_record(
        &self,
        tenant: &str,
        session: Option<&str>,
        model: &str,
        amount: Usage,
    ) -> ReservationRecord {
        ReservationRecord {
            id: self.store.next_reservation_id(),
            ts_ms: self.clock.now_ms(),
            day: self.clock.today(),
            tenant: tenant.to_string(),
            session: session.map(str::to_owned),
            model: model.to_string(),
            calls: amount.calls,
            tokens: amount.tokens,
            usd: amount.usd,
        }
    }

    /// Reserves one upstream call's worst case against the session and the tenant's
    /// day, atomically: both fit, or neither is touched. A budgeted call's reservation is
    /// committed to the store before this returns; if it cannot be, the call is refused.
    pub async fn reserve(
        self: &Arc<Self>,
        tenant: &str,
        session: Option<&str>,
        ask: &Ask,
    ) -> Result<Reservation, Refusal> {
        let model = ask.model.as_str();
        let Some(book) = self.tenant(tenant).cloned() else {
            return Err(Refusal::Unpriced {
                model: model.into(),
            });
        };
        self.backend.reserve(self, book, session, ask).await
    }

    /// A call's worst case, priced; refused when a USD cap applies and the model has no
    /// price (`billing.unpriced = "refuse"`, the default).
    pub(super) fn worst_case(
        &self,
        book: &TenantBook,
        in_session: bool,
        ask: &Ask,
    ) -> Result<Usage, Refusal> {
        let usd_capped =
            book.day_limits.usd.is_some() || (in_session && book.session_limits.usd.is_some());
        let want = worst_case(ask.input_tokens, ask.max_output, 0.0);
        let usd = match self.prices.lookup(&ask.model) {
            Some(price) => price.worst_case(
                ask.input_tokens,
                ask.max_output,
                ask.cache,
                ask.web_searches,
            ),
            None if usd_capped && self.unpriced == Unpriced::Refuse => {
                return Err(Refusal::Unpriced {
                    model: ask.model.as_str().into(),
                })
            }
            None => 0.0,
        };
        Ok(Usage { usd, ..want })
    }

    /// A session's settled spend in USD (0 for unknown tenants, or when the session
    /// cannot be read: the guard's spend velocity fails open, budgets do not).
    pub async fn session_usd(&self, tenant: &str, session: &str) -> f64 {
        let Some(book) = self.tenant(tenant) else {
            return 0.0;
        };
        self.backend
            .session_usage(self, book, session)
            .await
            .map_or(0.0, |account| account.settled.usd)
    }

    /// Every tenant's name, sorted.
    pub fn tenant_names(&self) -> Vec<Arc<str>> {
        let mut names: Vec<_> = self.tenants.keys().cloned().collect();
        names.sort();
        names
    }

    /// Every session in this process's memory with what it has used (this replica's
    /// books: with shared state, the figures of the sessions it served).
    pub fn live_sessions(&self) -> Vec<(SessionKey, Usage)> {
        self.sessions
            .list()
            .into_iter()
            .filter_map(|(key, live)| Some((key, lock(&live.book.get()?.account).settled)))
            .collect()
    }

    /// Starts a session over: its usage counts from now (the tenant's spend is kept).
    /// `false`: no such tenant.
    pub async fn reset_session(&self, tenant: &str, session: &str) -> Result<bool, StoreError> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(false);
        };
        self.backend.reset_session(tenant, session).await?;
        self.store
            .reset_session(tenant, session, self.clock.now_ms())
            .await?;
        let live = self.session(&book.name, session).await?;
        lock(&live.account).settled = Usage::default();
        Ok(true)
    }

    /// Drops rate-limiter state for sessions whose limit has fully replenished (they
    /// behave as new), so idle sessions do not hold memory forever. Run periodically.
    pub fn forget_idle_limiters(&self) {
        for book in self.tenants.values() {
            if let Some(limiter) = &book.session_rate {
                limiter.retain_recent();
                limiter.shrink_to_fit();
            }
        }
        self.sessions.sweep();
    }
}

/// What the limits decided for a request they let through ([`Budgets::gate`]).
pub enum Gated {
    /// Admitted; the guard's state was written, from and to these versions (`None`: not
    /// written, this replica's guard decided alone).
    Passed {
        slot: Option<ConcurrencySlot>,
        guard: Option<Written>,
        /// The first attempt's reservation, when it was asked for and made (shared
        /// with the request's attempts).
        prepaid: Option<Arc<Prepaid>>,
    },
    /// Another replica wrote the guard's state first (its version and state): nothing
    /// was spent or written; decide the request again on it.
    Moved(u64, String),
}

/// One in-flight request of a session (its place under `session.max_concurrent`);
/// dropping it frees the slot.
pub enum ConcurrencySlot {
    Local(BookRef),
    /// Held in Redis (shared by replicas); freed there on drop.
    Shared(SharedSlot),
}

impl Drop for ConcurrencySlot {
    fn drop(&mut self) {
        if let ConcurrencySlot::Local(book) = self {
            book.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        policy::budget::Exceeded,
        state::budgets::reservation::Outcome,
        store::{Charge, SqliteStore},
    };

    /// A session concurrency slot alone, as the admission layer takes it.
    async fn enter(
        b: &Arc<Budgets>,
        tenant: &str,
        session: &str,
    ) -> Result<Option<ConcurrencySlot>, Refusal> {
        match b.gate(tenant, Some(session), None, None).await? {
            Gated::Passed { slot, .. } => Ok(slot),
            Gated::Moved(..) => unreachable!("no guard write was asked for"),
        }
    }

    fn budgets(tenant_extra: &str) -> Arc<Budgets> {
        budgets_on(
            tenant_extra,
            SqliteStore::open(":memory:").unwrap(),
            Duration::from_secs(600),
        )
    }

    fn budgets_on(tenant_extra: &str, store: SqliteStore, idle: Duration) -> Arc<Budgets> {
        budgets_with(tenant_extra, store, idle, Clock::system())
    }

    fn budgets_with(
        tenant_extra: &str,
        store: SqliteStore,
        idle: Duration,
        clock: Clock,
    ) -> Arc<Budgets> {
        let text = format!(
            r#"
            [[prices]]
            model = "gpt-4o*"
            input_per_mtok = 2.5
            output_per_mtok = 10.0
            [[upstreams]]
            name = "u"
            api = "openai"
            base_url = "http://127.0.0.1:1"
            [[routes]]
            model = "*"
            targets = [{{ upstream = "u" }}]
            [[tenants]]
            name = "t"
            api_keys = ["bk-test-key"]
            {tenant_extra}
            "#
        );
        let config = Config::from_toml_with_env(&text, |_| None).unwrap();
        Arc::new(Budgets::new(&config, Arc::new(store), idle, clock))
    }

    fn reported(input: u64, output: u64) -> Outcome {
        Outcome::Reported(crate::billing::Tokens::plain(input, output))
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limits_refuse_with_the_limiters_wait_and_recover_on_time() {
        let b = budgets("requests_per_minute = 2\n[tenants.session]\nrequests_per_minute = 60");
        assert!(b.check_rate("t", Some("s")).await.is_ok());
        assert!(b.check_rate("t", Some("s")).await.is_ok());
        let Err(Refusal::RateLimited { scope, retry_after }) = b.check_rate("t", Some("s")).await
        else {
            panic!("not limited")
        };
        assert_eq!(scope, "tenant.requests_per_minute");
        assert_eq!(
            retry_after,
            Duration::from_secs(30),
            "GCRA: one request per 30 s"
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.check_rate("t", Some("s")).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn session_rate_limits_are_per_session() {
        let b = budgets("[tenants.session]\nrequests_per_minute = 1");
        assert!(b.check_rate("t", Some("a")).await.is_ok());
        assert!(matches!(
            b.check_rate("t", Some("a")).await,
            Err(Refusal::RateLimited {
                scope: "session.requests_per_minute",
                ..
            })
        ));
        assert!(
            b.check_rate("t", Some("b")).await.is_ok(),
            "another session has its own limit"
        );
        assert!(
            b.check_rate("t", None).await.is_ok(),
            "no session: tenant limits only"
        );
    }

    #[tokio::test]
    async fn a_refused_reservation_touches_neither_account() {
        let b =
            budgets("[tenants.session]\nmax_calls = 1\n[tenants.budget]\ntokens_per_day = 1000");
        let r = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 100, 100))
            .await
            .unwrap();
        let Err(e) = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 100, 100))
            .await
        else {
            panic!("over the cap")
        };
        assert!(matches!(
            e,
            Refusal::Exceeded(Exceeded {
                budget: "session.max_calls",
                ..
            })
        ));
        // The tenant's day only holds the one reservation.
        assert_eq!(
            b.tenant_report("t").await.unwrap().unwrap()["reserved"]["tokens"],
            200
        );
        r.settle(reported(10, 20)).await;
        let report = b.session_report("t", "s").await.unwrap().unwrap();
        assert_eq!(report["used"]["tokens"], 30);
        assert_eq!(report["reserved"]["tokens"], 0);
        assert_eq!(
            b.tenant_report("t").await.unwrap().unwrap()["used_today"]["usd"],
            0.000225
        );
    }

    #[tokio::test]
    async fn unpriced_models_are_refused_under_a_usd_cap_unless_free_is_chosen() {
        let free = budgets("[tenants.session]\nmax_usd = 1.0").reconfigured(
            &Config::from_toml_with_env(
                "[billing]\nunpriced = \"free\"\n[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{ upstream = \"u\" }]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]\n[tenants.session]\nmax_usd = 1.0",
                |_| None,
            )
            .unwrap(),
        );
        assert!(
            Arc::new(free)
                .reserve("t", Some("s"), &Ask::plain("mystery", 1, 1))
                .await
                .is_ok(),
            "free when chosen"
        );
        let config = Config::from_toml_with_env(
            "[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{ upstream = \"u\" }]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]\n[tenants.session]\nmax_usd = 1.0",
            |_| None,
        )
        .unwrap();
        let b = Arc::new(Budgets::new(
            &config,
            Arc::new(SqliteStore::open(":memory:").unwrap()),
            Duration::from_secs(60),
            Clock::system(),
        ));
        assert!(matches!(
            b.reserve("t", Some("s"), &Ask::plain("mystery", 1, 1))
                .await,
            Err(Refusal::Unpriced { .. })
        ));
        assert!(
            b.reserve("t", None, &Ask::plain("mystery", 1, 1))
                .await
                .is_ok(),
            "no USD cap applies without a session"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_session_held_by_a_call_is_not_rebuilt_when_it_idles_out() {
        let b = budgets_on(
            "[tenants.session]\nmax_calls = 2\nmax_concurrent = 1",
            SqliteStore::open(":memory:").unwrap(),
            Duration::from_nanos(1),
        );
        let slot = enter(&b, "t", "s").await.unwrap();
        let first = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        // The live map's idle clock is the real one, not tokio's: evict as `session_idle` would.
        b.sessions.evict_all();
        b.forget_idle_limiters();
        assert!(
            matches!(
                enter(&b, "t", "s").await,
                Err(Refusal::TooManyConcurrent { limit: 1 })
            ),
            "the in-flight slot survived the eviction"
        );
        let second = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        let Err(Refusal::Exceeded(e)) = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, 10))
            .await
        else {
            panic!("a third call under max_calls = 2")
        };
        assert_eq!((e.budget, e.used), ("session.max_calls", 2.0));
        first.settle(reported(1, 1)).await;
        second.settle(reported(1, 1)).await;
        drop(slot);
        b.sessions.evict_all();
        b.forget_idle_limiters();
        // Nobody holds it now: rebuilt from the ledger, which has both calls.
        let report = b.session_report("t", "s").await.unwrap().unwrap();
        assert_eq!(report["used"]["calls"], 2);
        assert_eq!(report["in_flight"], 0);
        assert!(enter(&b, "t", "s").await.unwrap().is_some());
    }

    #[tokio::test]
    async fn budgeted_reservations_are_durable_until_settled() {
        let b = budgets("[tenants.session]\nmax_calls = 5");
        let r = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        assert_eq!(b.books().open_reservations().await.unwrap(), 1);
        r.settle(reported(3, 4)).await;
        assert_eq!(b.books().open_reservations().await.unwrap(), 0);
        assert_eq!(b.books().session_usage("t", "s").await.unwrap().tokens, 7);
        // Dropped unsettled (a cancelled call): charged in full, durably.
        drop(
            b.reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, 10))
                .await
                .unwrap(),
        );
        b.books()
            .charge(Charge {
                ts_ms: 0,
                day: 0,
                tenant: "flush".into(),
                session: None,
                model: "m".into(),
                calls: 1,
                tokens: crate::billing::Tokens::plain(0, 0),
                usd: 0.0,
            })
            .await
            .unwrap();
        assert_eq!(b.books().open_reservations().await.unwrap(), 0);
        assert_eq!(b.books().session_usage("t", "s").await.unwrap().tokens, 27);
        // No session, no day cap: nothing to make durable.
        let r = b
            .reserve("t", None, &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        assert_eq!(b.books().open_reservations().await.unwrap(), 0);
        r.settle(reported(1, 1)).await;
    }

    #[tokio::test]
    async fn a_store_that_cannot_take_the_reservation_refuses_the_call() {
        let dir = std::env::temp_dir().join(format!(
            "backstop-budgets-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.db").to_str().unwrap().to_string();
        let store = SqliteStore::open_with(&crate::config::StoreConfig {
            path: path.clone(),
            busy_timeout: Duration::from_millis(50),
            ..Default::default()
        })
        .unwrap();
        let b = budgets_on(
            "[tenants.budget]\ntokens_per_day = 100000",
            store,
            Duration::from_secs(60),
        );
        let other = rusqlite::Connection::open(&path).unwrap();
        other.execute_batch("BEGIN EXCLUSIVE").unwrap();
        let refused = b.reserve("t", None, &Ask::plain("gpt-4o", 10, 10)).await;
        assert!(
            matches!(refused, Err(Refusal::StoreUnavailable { .. })),
            "{:?}",
            refused.err()
        );
        assert_eq!(
            b.tenant_report("t").await.unwrap().unwrap()["reserved"]["tokens"],
            0,
            "the refused call holds nothing"
        );
        other.execute_batch("COMMIT").unwrap();
        let r = b
            .reserve("t", None, &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        r.settle(reported(1, 1)).await;
        assert_eq!(
            b.tenant_report("t").await.unwrap().unwrap()["used_today"]["tokens"],
            2
        );
        drop(b);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_day_that_cannot_be_read_refuses_instead_of_starting_at_zero() {
        let dir = std::env::temp_dir().join(format!(
            "backstop-budgets-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.db").to_str().unwrap().to_string();
        let store = SqliteStore::open(&path).unwrap();
        let other = rusqlite::Connection::open(&path).unwrap();
        // The ledger unreadable while the budgets start.
        other
            .execute_batch("ALTER TABLE ledger RENAME TO ledger_away")
            .unwrap();
        let b = budgets_on(
            "[tenants.budget]\ntokens_per_day = 100000",
            store,
            Duration::from_secs(60),
        );
        assert!(matches!(
            b.reserve("t", None, &Ask::plain("gpt-4o", 10, 10)).await,
            Err(Refusal::StoreUnavailable { .. })
        ));
        assert!(
            b.tenant_report("t").await.is_err(),
            "an unreadable day is an error in the report too, not a day without spend"
        );
        other
            .execute_batch("ALTER TABLE ledger_away RENAME TO ledger")
            .unwrap();
        let r = b
            .reserve("t", None, &Ask::plain("gpt-4o", 10, 10))
            .await
            .unwrap();
        r.settle(reported(1, 1)).await;
        assert_eq!(
            b.tenant_report("t").await.unwrap().unwrap()["used_today"]["tokens"],
            2
        );
        drop(b);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The tenant's day is the UTC day of the injected clock: crossing midnight on a
    /// paused tokio clock starts the day budget over, and the ledger keeps each day apart.
    #[tokio::test(start_paused = true)]
    async fn the_day_budget_starts_over_at_utc_midnight() {
        const DAY_MS: i64 = 86_400_000;
        let day = 20_000;
        let clock = Clock::starting_at((day + 1) * DAY_MS - 1000);
        let b = budgets_with(
            "[tenants.budget]\ntokens_per_day = 300",
            SqliteStore::open(":memory:").unwrap(),
            Duration::from_secs(600),
            clock.clone(),
        );
        let r = b
            .reserve("t", None, &Ask::plain("gpt-4o", 100, 100))
            .await
            .unwrap();
        r.settle(reported(100, 150)).await;
        let Err(Refusal::Exceeded(e)) = b.reserve("t", None, &Ask::plain("gpt-4o", 10, 100)).await
        else {
            panic!("110 tokens fitted in the 50 left today")
        };
        assert_eq!((e.budget, e.used), ("tenant.tokens_per_day", 250.0));
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(
            b.reserve("t", None, &Ask::plain("gpt-4o", 10, 100))
                .await
                .is_err(),
            "still the same day"
        );
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(clock.today(), day + 1);
        let r = b
            .reserve("t", None, &Ask::plain("gpt-4o", 10, 100))
            .await
            .unwrap();
        r.settle(reported(10, 20)).await;
        let report = b.tenant_report("t").await.unwrap().unwrap();
        assert_eq!(report["day"], day + 1);
        assert_eq!(report["used_today"]["tokens"], 30);
        assert_eq!(
            b.books().tenant_day_usage("t", day).await.unwrap().tokens,
            250
        );
        assert_eq!(
            b.books()
                .tenant_day_usage("t", day + 1)
                .await
                .unwrap()
                .tokens,
            30
        );
    }

    #[tokio::test]
    async fn implausible_usage_is_charged_the_reservation() {
        let b = budgets("[tenants.session]\nmax_tokens = 1000000");
        // Reserved: 100 prompt + 100 output tokens, $0.00125.
        for outcome in [
            reported(u64::MAX, 1),
            reported(10_000_001, 0),
            Outcome::Invalid,
        ] {
            let r = b
                .reserve(
                    "t",
                    Some(&format!("{outcome:?}")),
                    &Ask::plain("gpt-4o", 100, 100),
                )
                .await
                .unwrap();
            r.settle(outcome).await;
            let used = b
                .books()
                .session_usage("t", &format!("{outcome:?}"))
                .await
                .unwrap();
            assert_eq!(used.tokens, 200, "{outcome:?}");
            assert!((used.usd - 0.00125).abs() < 1e-12, "{outcome:?}: {used:?}");
        }
        // Above the reservation but plausible: believed.
        let r = b
            .reserve("t", Some("more"), &Ask::plain("gpt-4o", 100, 100))
            .await
            .unwrap();
        r.settle(reported(5000, 300)).await;
        assert_eq!(
            b.books().session_usage("t", "more").await.unwrap().tokens,
            5300
        );
    }

    #[tokio::test]
    async fn a_huge_max_tokens_cannot_wrap_past_a_token_cap() {
        let b = budgets("[tenants.session]\nmax_tokens = 1000");
        let Err(Refusal::Exceeded(e)) = b
            .reserve("t", Some("s"), &Ask::plain("gpt-4o", 10, u64::MAX))
            .await
        else {
            panic!("2^64 - 1 output tokens fitted under a 1000-token cap")
        };
        assert_eq!(e.budget, "session.max_tokens");
    }
}
