//! The live budget state: per tenant a daily account, rate limiters and session limits;
//! per session an account and an in-flight count. Sessions idle out of memory (moka, with
//! a time-to-idle) and are rebuilt from the ledger when they come back, so no history is
//! lost. The arithmetic is in [`crate::policy::budget`]; persistence in [`crate::store`].

use std::{
    collections::HashMap,
    num::NonZeroU32,
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use governor::{
    clock::Clock,
    middleware::NoOpMiddleware,
    state::{keyed::DashMapStateStore, InMemoryState, NotKeyed},
    Quota, RateLimiter,
};
use moka::sync::Cache;

use crate::{
    config::{Config, Unpriced},
    policy::budget::{Account, Exceeded, Limits, Prices, Usage, SESSION, TENANT_DAY},
    store::{Charge, Store},
};

/// Governor's clock on tokio's time, so rate limits run on a paused clock in tests.
#[derive(Clone, Debug)]
pub struct TokioClock {
    origin: tokio::time::Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        TokioClock {
            origin: tokio::time::Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    type Instant = Duration;
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

type Direct = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Duration>>;
type Keyed = RateLimiter<String, DashMapStateStore<String>, TokioClock, NoOpMiddleware<Duration>>;

/// Why a call may not go ahead.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    RateLimited {
        scope: &'static str,
        retry_after: Duration,
    },
    Exceeded(Exceeded),
    TooManyConcurrent {
        limit: u32,
    },
    Unpriced {
        model: String,
    },
}

struct TenantBook {
    name: Arc<str>,
    day_limits: Limits,
    session_limits: Limits,
    max_concurrent: Option<u32>,
    /// (UTC day, that day's account).
    day: Mutex<(i64, Account)>,
    rate: Option<Direct>,
    session_rate: Option<Keyed>,
}

/// One session's live state.
pub struct SessionBook {
    account: Mutex<Account>,
    in_flight: AtomicU32,
}

pub struct Budgets {
    tenants: HashMap<Arc<str>, Arc<TenantBook>>,
    sessions: Cache<(Arc<str>, String), Arc<SessionBook>>,
    store: Arc<Store>,
    prices: Prices,
    unpriced: Unpriced,
    pub default_max_tokens: u64,
    clock: TokioClock,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

pub fn today() -> i64 {
    now_ms().div_euclid(86_400_000)
}

fn per_minute(n: u32) -> Quota {
    Quota::per_minute(NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN))
}

impl Budgets {
    pub fn new(config: &Config, store: Arc<Store>, session_idle: Duration) -> Self {
        let clock = TokioClock::default();
        let day = today();
        let tenants = config
            .tenants
            .iter()
            .map(|t| {
                let name: Arc<str> = t.name.as_str().into();
                let settled = store.tenant_day_usage(&t.name, day).unwrap_or_else(|err| {
                    tracing::error!(tenant = %t.name, error = %err, "cannot read the ledger; starting the day at zero");
                    Usage::default()
                });
                let book = TenantBook {
                    name: name.clone(),
                    day_limits: Limits { calls: None, tokens: t.budget.tokens_per_day, usd: t.budget.usd_per_day },
                    session_limits: Limits { calls: t.session.max_calls, tokens: t.session.max_tokens, usd: t.session.max_usd },
                    max_concurrent: t.session.max_concurrent,
                    day: Mutex::new((day, Account { settled, reserved: Usage::default() })),
                    rate: t.requests_per_minute.map(|n| RateLimiter::direct_with_clock(per_minute(n), clock.clone())),
                    session_rate: t.session.requests_per_minute.map(|n| RateLimiter::dashmap_with_clock(per_minute(n), clock.clone())),
                };
                (name, Arc::new(book))
            })
            .collect();
        Budgets {
            tenants,
            sessions: Cache::builder()
                .time_to_idle(session_idle)
                .max_capacity(1_000_000)
                .build(),
            store,
            prices: Prices::new(&config.prices),
            unpriced: config.billing.unpriced,
            default_max_tokens: config.billing.default_max_tokens,
            clock,
        }
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    fn tenant(&self, name: &str) -> Option<&Arc<TenantBook>> {
        self.tenants.get(name)
    }

    /// The live session, loaded from the ledger if it is not in memory.
    fn session(&self, tenant: &Arc<str>, session: &str) -> Arc<SessionBook> {
        self.sessions.get_with((tenant.clone(), session.to_string()), || {
            let settled = self.store.session_usage(tenant, session).unwrap_or_else(|err| {
                tracing::error!(%tenant, session, error = %err, "cannot read the ledger for a session");
                Usage::default()
            });
            Arc::new(SessionBook { account: Mutex::new(Account { settled, reserved: Usage::default() }), in_flight: AtomicU32::new(0) })
        })
    }

    /// Rate limits (tenant, then session) for one client request.
    pub fn check_rate(&self, tenant: &str, session: Option<&str>) -> Result<(), Refusal> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(());
        };
        let now = self.clock.now();
        if let Some(limiter) = &book.rate {
            limiter.check().map_err(|not_until| Refusal::RateLimited {
                scope: "tenant.requests_per_minute",
                retry_after: not_until.wait_time_from(now),
            })?;
        }
        if let (Some(limiter), Some(session)) = (&book.session_rate, session) {
            limiter
                .check_key(&session.to_string())
                .map_err(|not_until| Refusal::RateLimited {
                    scope: "session.requests_per_minute",
                    retry_after: not_until.wait_time_from(now),
                })?;
        }
        Ok(())
    }

    /// Admits one more in-flight request for the session, up to `max_concurrent`.
    pub fn enter(&self, tenant: &str, session: &str) -> Result<Option<InFlight>, Refusal> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(None);
        };
        let Some(limit) = book.max_concurrent else {
            return Ok(None);
        };
        let live = self.session(&book.name, session);
        let admitted = live
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok();
        if admitted {
            Ok(Some(InFlight(live)))
        } else {
            Err(Refusal::TooManyConcurrent { limit })
        }
    }

    /// Reserves one upstream call's worst case against the session and the tenant's
    /// day, atomically: both fit, or neither is touched.
    pub fn reserve(
        self: &Arc<Self>,
        tenant: &str,
        session: Option<&str>,
        model: &str,
        prompt_tokens: u64,
        max_output: u64,
    ) -> Result<Reservation, Refusal> {
        let Some(book) = self.tenant(tenant).cloned() else {
            return Err(Refusal::Unpriced {
                model: model.into(),
            });
        };
        let live = session.map(|s| (s.to_string(), self.session(&book.name, s)));
        let usd_capped =
            book.day_limits.usd.is_some() || (live.is_some() && book.session_limits.usd.is_some());
        let usd = match self.prices.cost(model, prompt_tokens, max_output) {
            Some(usd) => usd,
            None if usd_capped && self.unpriced == Unpriced::Refuse => {
                return Err(Refusal::Unpriced {
                    model: model.into(),
                })
            }
            None => 0.0,
        };
        let want = Usage {
            calls: 1,
            tokens: prompt_tokens + max_output,
            usd,
        };
        let mut day = lock(&book.day);
        let today = today();
        if day.0 != today {
            *day = (
                today,
                Account {
                    settled: Usage::default(),
                    reserved: day.1.reserved,
                },
            );
        }
        day.1
            .check(want, &book.day_limits, TENANT_DAY)
            .map_err(Refusal::Exceeded)?;
        if let Some((_, s)) = &live {
            let mut account = lock(&s.account);
            account
                .check(want, &book.session_limits, SESSION)
                .map_err(Refusal::Exceeded)?;
            account.reserve(want);
        }
        day.1.reserve(want);
        drop(day);
        Ok(Reservation {
            budgets: self.clone(),
            tenant: book,
            session: live,
            model: model.to_string(),
            amount: want,
            settled: false,
        })
    }

    /// What a session has left, formatted for `x-backstop-budget-remaining`; `None` when
    /// the session is not budgeted.
    pub fn remaining_header(&self, tenant: &str, session: &str) -> Option<String> {
        let book = self.tenant(tenant)?;
        if book.session_limits.is_unlimited() {
            return None;
        }
        let live = self.session(&book.name, session);
        let (calls, tokens, usd) = lock(&live.account).remaining(&book.session_limits);
        let mut parts = Vec::new();
        if let Some(c) = calls {
            parts.push(format!("calls={c}"));
        }
        if let Some(t) = tokens {
            parts.push(format!("tokens={t}"));
        }
        if let Some(u) = usd {
            parts.push(format!("usd={u:.4}"));
        }
        Some(parts.join("; "))
    }

    /// A session's settled spend in USD (0 for unknown tenants).
    pub fn session_usd(&self, tenant: &str, session: &str) -> f64 {
        self.tenant(tenant).map_or(0.0, |book| {
            lock(&self.session(&book.name, session).account).settled.usd
        })
    }

    /// A session's figures for the admin API and the tenant's own view.
    pub fn session_report(&self, tenant: &str, session: &str) -> Option<serde_json::Value> {
        let book = self.tenant(tenant)?;
        let live = self.session(&book.name, session);
        let account = lock(&live.account).clone();
        let (calls, tokens, usd) = account.remaining(&book.session_limits);
        Some(serde_json::json!({
            "tenant": tenant,
            "session": session,
            "used": {"calls": account.settled.calls, "tokens": account.settled.tokens, "usd": account.settled.usd},
            "reserved": {"calls": account.reserved.calls, "tokens": account.reserved.tokens, "usd": account.reserved.usd},
            "in_flight": live.in_flight.load(Ordering::Relaxed),
            "limits": {"max_calls": book.session_limits.calls, "max_tokens": book.session_limits.tokens, "max_usd": book.session_limits.usd, "max_concurrent": book.max_concurrent},
            "remaining": {"calls": calls, "tokens": tokens, "usd": usd},
        }))
    }

    /// A tenant's day for the admin API.
    pub fn tenant_report(&self, tenant: &str) -> Option<serde_json::Value> {
        let book = self.tenant(tenant)?;
        let (day, account) = lock(&book.day).clone();
        let (_, tokens, usd) = account.remaining(&book.day_limits);
        let by_model: Vec<_> = self
            .store
            .tenant_day_by_model(tenant, day)
            .unwrap_or_default()
            .into_iter()
            .map(|(model, u)| serde_json::json!({"model": model, "calls": u.calls, "tokens": u.tokens, "usd": u.usd}))
            .collect();
        Some(serde_json::json!({
            "tenant": tenant,
            "day": day,
            "used_today": {"calls": account.settled.calls, "tokens": account.settled.tokens, "usd": account.settled.usd},
            "reserved": {"calls": account.reserved.calls, "tokens": account.reserved.tokens, "usd": account.reserved.usd},
            "limits": {"usd_per_day": book.day_limits.usd, "tokens_per_day": book.day_limits.tokens},
            "remaining_today": {"usd": usd, "tokens": tokens},
            "by_model": by_model,
        }))
    }

    /// Starts a session over: its usage counts from now (the tenant's spend is kept).
    pub async fn reset_session(&self, tenant: &str, session: &str) -> bool {
        let Some(book) = self.tenant(tenant) else {
            return false;
        };
        self.store.reset_session(tenant, session, now_ms()).await;
        let live = self.session(&book.name, session);
        lock(&live.account).settled = Usage::default();
        true
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
        self.sessions.run_pending_tasks();
    }
}

/// One in-flight request of a session; dropping it frees the slot.
pub struct InFlight(Arc<SessionBook>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A reserved upstream call. Settle it with the upstream's reported usage; dropped
/// unsettled, it is charged its full reservation (never less than what may have been
/// spent).
pub struct Reservation {
    budgets: Arc<Budgets>,
    tenant: Arc<TenantBook>,
    session: Option<(String, Arc<SessionBook>)>,
    model: String,
    amount: Usage,
    settled: bool,
}

impl Reservation {
    /// The charge for reported usage (`None`: the reservation itself).
    fn charge_for(&self, usage: Option<(u64, u64)>) -> (Charge, Usage) {
        let (input, output) = usage.unwrap_or((self.amount.tokens, 0));
        let usd = match usage {
            Some((i, o)) => self.budgets.prices.cost(&self.model, i, o).unwrap_or(0.0),
            None => self.amount.usd,
        };
        let actual = Usage {
            calls: 1,
            tokens: input + output,
            usd,
        };
        let charge = Charge {
            ts_ms: now_ms(),
            day: today(),
            tenant: self.tenant.name.to_string(),
            session: self.session.as_ref().map(|(s, _)| s.clone()),
            model: self.model.clone(),
            calls: 1,
            input_tokens: input,
            output_tokens: output,
            usd,
        };
        (charge, actual)
    }

    fn apply(&mut self, actual: Usage) {
        self.settled = true;
        {
            let mut day = lock(&self.tenant.day);
            day.1.settle(self.amount, actual);
        }
        if let Some((_, s)) = &self.session {
            lock(&s.account).settle(self.amount, actual);
        }
        let tenant = self.tenant.name.to_string();
        metrics::counter!("backstop_spend_usd_total", "tenant" => tenant.clone(), "model" => self.model.clone()).increment((actual.usd * 1e6) as u64);
        metrics::counter!("backstop_tokens_total", "tenant" => tenant.clone(), "model" => self.model.clone()).increment(actual.tokens);
        if let Some(limit) = self.tenant.day_limits.usd {
            let used = lock(&self.tenant.day).1.committed().usd;
            metrics::gauge!("backstop_tenant_budget_remaining_usd", "tenant" => tenant)
                .set((limit - used).max(0.0));
        }
    }

    /// Settles with the upstream's reported (input, output) tokens, or with nothing
    /// (a failed call: one call, no tokens), and waits until the ledger has it.
    pub async fn settle(mut self, usage: Option<(u64, u64)>) {
        let (charge, actual) = self.charge_for(Some(usage.unwrap_or((0, 0))));
        self.apply(actual);
        self.budgets.store.charge(charge).await;
    }

    /// Settles now in memory and writes the ledger in the background (end of a stream;
    /// `None` charges the full reservation, as nothing was reported).
    pub fn settle_later(mut self, usage: Option<(u64, u64)>) {
        let (charge, actual) = self.charge_for(usage);
        self.apply(actual);
        self.budgets.store.charge_later(charge);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            let (charge, actual) = self.charge_for(None);
            self.apply(actual);
            self.budgets.store.charge_later(charge);
        }
    }
}

impl From<Refusal> for crate::error::GatewayError {
    fn from(refusal: Refusal) -> Self {
        use crate::error::GatewayError;
        let detail = refusal.describe();
        let reason = match &refusal {
            Refusal::RateLimited { .. } => "rate_limited",
            Refusal::Exceeded(_) => "budget_exceeded",
            Refusal::TooManyConcurrent { .. } => "too_many_concurrent",
            Refusal::Unpriced { .. } => "unpriced_model",
        };
        metrics::counter!("backstop_refusals_total", "reason" => reason).increment(1);
        match refusal {
            Refusal::RateLimited { retry_after, .. } => GatewayError::RateLimited {
                detail,
                retry_after,
            },
            Refusal::Exceeded(e) => GatewayError::BudgetExceeded {
                budget: e.budget,
                detail,
            },
            Refusal::TooManyConcurrent { .. } => GatewayError::TooManyConcurrent { detail },
            Refusal::Unpriced { .. } => GatewayError::Unpriced { detail },
        }
    }
}

impl Refusal {
    pub fn describe(&self) -> String {
        match self {
            Refusal::RateLimited { scope, retry_after } => {
                format!("{scope} exceeded; retry after {retry_after:?}")
            }
            Refusal::Exceeded(e) => format!(
                "{} exhausted: limit {}, used {}, this call needs {}",
                e.budget,
                fmt_num(e.limit),
                fmt_num(e.used),
                fmt_num(e.requested)
            ),
            Refusal::TooManyConcurrent { limit } => {
                format!("session.max_concurrent exceeded: {limit} requests already in flight")
            }
            Refusal::Unpriced { model } => {
                format!("model `{model}` has no price and billing.unpriced = \"refuse\"")
            }
        }
    }
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(tenant_extra: &str) -> Arc<Budgets> {
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
        let store = Arc::new(Store::open(":memory:").unwrap());
        Arc::new(Budgets::new(&config, store, Duration::from_secs(600)))
    }

    #[tokio::test(start_paused = true)]
    async fn rate_limits_refuse_with_the_limiters_wait_and_recover_on_time() {
        let b = budgets("requests_per_minute = 2\n[tenants.session]\nrequests_per_minute = 60");
        assert!(b.check_rate("t", Some("s")).is_ok());
        assert!(b.check_rate("t", Some("s")).is_ok());
        let Err(Refusal::RateLimited { scope, retry_after }) = b.check_rate("t", Some("s")) else {
            panic!("not limited")
        };
        assert_eq!(scope, "tenant.requests_per_minute");
        assert_eq!(
            retry_after,
            Duration::from_secs(30),
            "GCRA: one request per 30 s"
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(b.check_rate("t", Some("s")).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn session_rate_limits_are_per_session() {
        let b = budgets("[tenants.session]\nrequests_per_minute = 1");
        assert!(b.check_rate("t", Some("a")).is_ok());
        assert!(matches!(
            b.check_rate("t", Some("a")),
            Err(Refusal::RateLimited {
                scope: "session.requests_per_minute",
                ..
            })
        ));
        assert!(
            b.check_rate("t", Some("b")).is_ok(),
            "another session has its own limit"
        );
        assert!(
            b.check_rate("t", None).is_ok(),
            "no session: tenant limits only"
        );
    }

    #[tokio::test]
    async fn a_refused_reservation_touches_neither_account() {
        let b =
            budgets("[tenants.session]\nmax_calls = 1\n[tenants.budget]\ntokens_per_day = 1000");
        let r = b.reserve("t", Some("s"), "gpt-4o", 100, 100).unwrap();
        let Err(e) = b.reserve("t", Some("s"), "gpt-4o", 100, 100) else {
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
        assert_eq!(b.tenant_report("t").unwrap()["reserved"]["tokens"], 200);
        r.settle(Some((10, 20))).await;
        let report = b.session_report("t", "s").unwrap();
        assert_eq!(report["used"]["tokens"], 30);
        assert_eq!(report["reserved"]["tokens"], 0);
        assert_eq!(b.tenant_report("t").unwrap()["used_today"]["usd"], 0.000225);
    }

    #[tokio::test]
    async fn unpriced_models_are_refused_under_a_usd_cap_when_configured() {
        let b = budgets("[tenants.session]\nmax_usd = 1.0");
        assert!(
            b.reserve("t", Some("s"), "mystery", 1, 1).is_ok(),
            "free by default"
        );
        let config = Config::from_toml_with_env(
            "[billing]\nunpriced = \"refuse\"\n[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{ upstream = \"u\" }]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]\n[tenants.session]\nmax_usd = 1.0",
            |_| None,
        )
        .unwrap();
        let b = Arc::new(Budgets::new(
            &config,
            Arc::new(Store::open(":memory:").unwrap()),
            Duration::from_secs(60),
        ));
        assert!(matches!(
            b.reserve("t", Some("s"), "mystery", 1, 1),
            Err(Refusal::Unpriced { .. })
        ));
        assert!(
            b.reserve("t", None, "mystery", 1, 1).is_ok(),
            "no USD cap applies without a session"
        );
    }
}
