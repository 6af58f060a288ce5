//! The budgets counted by this process alone (`[state] backend = "embedded"`, and Redis's
//! stand-in while it is unavailable): its accounts, governor limiters and concurrency
//! counts, each budgeted reservation made durable in the store's ledger.

use std::sync::{atomic::Ordering, Arc};

use futures_util::future::BoxFuture;

use super::{
    backend::{BudgetBackend, Day},
    lock,
    reservation::{Ask, Hold, Reservation},
    session_rate_key, BookRef, Budgets, ConcurrencySlot, Gated, Refusal, TenantBook,
};
use crate::{
    policy::budget::{Account, SessionSeen, Usage, SESSION, TENANT_DAY},
    state::{
        live::SessionBook,
        shared::{GuardWrite, SharedBudgets},
    },
    store::{Charge, StoreError},
};

/// This process's books.
pub struct LocalBudgets {
    /// Whether the accounts first take what the replicas sharing the store committed
    /// ([`LocalBudgets::catch_up_with_the_replicas`]); not while standing in for Redis.
    with_the_replicas: bool,
}

impl LocalBudgets {
    /// The books of `[state] backend = "embedded"`.
    pub fn new() -> LocalBudgets {
        LocalBudgets {
            with_the_replicas: true,
        }
    }

    /// The books that stand in for Redis while it is unavailable (`on_unavailable =
    /// "open"`), and count the calls it does not.
    pub(super) fn standing_in() -> LocalBudgets {
        LocalBudgets {
            with_the_replicas: false,
        }
    }

    /// This process's own rate limiters (tenant, then session).
    pub(super) fn check_rate(
        &self,
        budgets: &Budgets,
        book: &TenantBook,
        session: Option<&str>,
    ) -> Result<(), Refusal> {
        let now = governor::clock::Clock::now(&budgets.clock);
        if let Some(limiter) = &book.rate {
            limiter.check().map_err(|not_until| Refusal::RateLimited {
                scope: "tenant.requests_per_minute",
                retry_after: not_until.wait_time_from(now),
            })?;
        }
        if let (Some(limiter), Some(session)) = (&book.session_rate, session) {
            limiter
                .check_key(&session_rate_key(session))
                .map_err(|not_until| Refusal::RateLimited {
                    scope: "session.requests_per_minute",
                    retry_after: not_until.wait_time_from(now),
                })?;
        }
        Ok(())
    }

    /// One of the session's `max_concurrent` slots, counted here (none asked without a
    /// session or a limit).
    pub(super) async fn enter(
        &self,
        budgets: &Budgets,
        book: &TenantBook,
        session: Option<&str>,
    ) -> Result<Option<ConcurrencySlot>, Refusal> {
        let (Some(session), Some(limit)) = (session, session.and(book.max_concurrent)) else {
            return Ok(None);
        };
        let live = budgets.session(&book.name, session).await?;
        let admitted = live
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            return Err(Refusal::TooManyConcurrent { limit });
        }
        Ok(Some(ConcurrencySlot::Local(live)))
    }

    /// With a store other replicas share and no Redis counting for them: the day's and
    /// the session's accounts take what every replica has committed (settled, and reserved
    /// by the other replicas) before this call is checked against them. Replicas that
    /// reserve at the same moment can each pass on what the other has not written yet:
    /// caps hold to within one call per replica (Redis makes them exact).
    async fn catch_up_with_the_replicas(
        &self,
        budgets: &Budgets,
        book: &TenantBook,
        live: Option<&(String, BookRef)>,
        session: Option<&str>,
    ) -> Result<(), Refusal> {
        let today = budgets.clock.today();
        let committed = match budgets
            .store
            .committed_usage(&book.name, today, session)
            .await
        {
            Ok(Some(committed)) => committed,
            Ok(None) => return Ok(()),
            Err(err) if budgets.blind_past(&err, "fleet") => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        {
            let mut day = lock(&book.day);
            if day.0 <= today {
                // A new day starts from what every replica has spent on it already.
                *day = (
                    today,
                    Account {
                        settled: committed.day,
                        reserved: day.1.reserved,
                    },
                );
            }
        }
        if let (Some((_, s)), Some(used)) = (live, committed.session) {
            lock(&s.account).settled = used;
        }
        Ok(())
    }

    async fn reserve_here(
        &self,
        budgets: &Arc<Budgets>,
        book: Arc<TenantBook>,
        session: Option<&str>,
        ask: &Ask,
    ) -> Result<Reservation, Refusal> {
        let tenant = book.name.clone();
        let live = match session {
            Some(s) => match budgets.session(&book.name, s).await {
                Ok(live) => Some((s.to_string(), live)),
                // Its spend so far unknown: counted from this call on, and not kept, so
                // the next call reads the ledger again.
                Err(err) if budgets.blind_past(&err, "session") => {
                    Some((s.to_string(), BookRef::detached(SessionBook::unread())))
                }
                Err(err) => return Err(err.into()),
            },
            None => None,
        };
        let day_unread = budgets
            .know_day(&book)
            .await
            .err()
            .filter(|err| !budgets.blind_past(err, "day"));
        if book.budgets(session.is_some()) && self.with_the_replicas {
            self.catch_up_with_the_replicas(budgets, &book, live.as_ref(), session)
                .await?;
        }
        let mut reservation = reserve_in_memory(budgets, book, live, day_unread, ask)?;
        let book = &reservation.tenant;
        let budgeted = book.budgets(reservation.session.is_some());
        if budgeted {
            let record = budgets.reservation_record(
                &book.name,
                reservation.session.as_deref(),
                &reservation.model,
                reservation.amount,
            );
            let id = record.id;
            // Named before the write is awaited: if this future is dropped meanwhile,
            // the reservation's drop settles it (the writer keeps the order).
            reservation.durable = Some(id);
            match budgets.store.reserve(record).await {
                Ok(()) => {}
                // Settled all the same: the charge is written once the store answers.
                Err(err) if budgets.blind_past(&err, "reservation") => {}
                Err(err) => {
                    tracing::error!(tenant = &*tenant, session, error = %err, "cannot record a reservation; refusing the call");
                    budgets.store.unreserve(id);
                    reservation.give_back();
                    return Err(err.into());
                }
            }
        }
        Ok(reservation)
    }
}

impl Default for LocalBudgets {
    fn default() -> Self {
        LocalBudgets::new()
    }
}

/// The reservation's arithmetic, under the day's lock: no await in here.
fn reserve_in_memory(
    budgets: &Arc<Budgets>,
    book: Arc<TenantBook>,
    live: Option<(String, BookRef)>,
    day_unread: Option<StoreError>,
    ask: &Ask,
) -> Result<Reservation, Refusal> {
    let want = budgets.worst_case(&book, live.is_some(), ask)?;
    let mut day = lock(&book.day);
    let today = budgets.clock.today();
    if day.0 < today {
        *day = (
            today,
            Account {
                settled: Usage::default(),
                reserved: day.1.reserved,
            },
        );
    }
    if let Some(err) = day_unread {
        if !book.day_limits.is_unlimited() {
            return Err(err.into());
        }
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
    let (session, live) = live.unzip();
    Ok(Reservation {
        budgets: budgets.clone(),
        tenant: book,
        session,
        model: ask.model.clone(),
        amount: want,
        output: ask.max_output,
        durable: None,
        hold: Box::new(LocalHold { session: live }),
        settled: false,
    })
}

impl BudgetBackend for LocalBudgets {
    fn gate<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: &'a Arc<TenantBook>,
        session: Option<&'a str>,
        // Nothing to write back to: the guard decides alone.
        _guard: Option<GuardWrite>,
        _prepay: Option<&'a Ask>,
    ) -> BoxFuture<'a, Result<Gated, Refusal>> {
        Box::pin(async move {
            self.check_rate(budgets, book, session)?;
            Ok(Gated::Passed {
                slot: self.enter(budgets, book, session).await?,
                guard: None,
                prepaid: None,
            })
        })
    }

    fn prepays(&self, _book: &TenantBook, _in_session: bool) -> bool {
        false
    }

    fn reserve<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: Arc<TenantBook>,
        session: Option<&'a str>,
        ask: &'a Ask,
    ) -> BoxFuture<'a, Result<Reservation, Refusal>> {
        Box::pin(self.reserve_here(budgets, book, session, ask))
    }

    fn session_usage<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<Account, StoreError>> {
        Box::pin(async move {
            let (account, _) = self.session_account(budgets, book, session).await?;
            Ok(account)
        })
    }

    fn session_account<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<(Account, u32), StoreError>> {
        Box::pin(async move {
            let live = budgets.session(&book.name, session).await?;
            let account = lock(&live.account).clone();
            Ok((account, live.in_flight.load(Ordering::Relaxed)))
        })
    }

    fn tenant_day<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
    ) -> BoxFuture<'a, Result<Day, StoreError>> {
        Box::pin(async move {
            budgets.know_day(book).await?;
            let (day, account) = lock(&book.day).clone();
            let by_model = match account.settled.calls {
                // Nothing settled today: nothing in the ledger to break down (the
                // dashboard asks this of every tenant on each poll; idle ones cost no
                // store read).
                0 => Vec::new(),
                _ => budgets.store.tenant_day_by_model(&book.name, day).await?,
            };
            Ok(Day {
                day,
                account,
                by_model,
            })
        })
    }

    fn reset_session<'a>(
        &'a self,
        _tenant: &'a str,
        _session: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        // The ledger and this process's account are all there is: started over by the
        // caller.
        Box::pin(async { Ok(()) })
    }

    fn shared(&self) -> Option<&Arc<SharedBudgets>> {
        None
    }
}

/// A reservation on this process's books: the tenant's day and, in a session, the
/// session's account.
struct LocalHold {
    session: Option<BookRef>,
}

impl Hold for LocalHold {
    fn count(&self, r: &Reservation, actual: Usage) {
        lock(&r.tenant.day).1.settle(r.amount, actual);
        if let Some(s) = &self.session {
            lock(&s.account).settle(r.amount, actual);
        }
        if let Some(limit) = r.tenant.day_limits.usd {
            let used = lock(&r.tenant.day).1.committed().usd;
            metrics::gauge!("backstop_tenant_budget_remaining_usd", "tenant" => r.tenant.name.to_string())
                .set((limit - used).max(0.0));
        }
    }

    fn settle<'a>(
        &'a self,
        r: &'a Reservation,
        charge: Charge,
    ) -> BoxFuture<'a, Option<SessionSeen>> {
        Box::pin(async move {
            if let Err(err) = r.budgets.store.settle(r.durable, charge).await {
                tracing::error!(
                    tenant = %r.tenant.name,
                    session = r.session_name(),
                    durable = r.durable.is_some(),
                    error = %err,
                    "cannot record a charge in the ledger"
                );
            }
            None
        })
    }

    fn settle_later(&self, r: &Reservation, charge: Charge) {
        r.budgets.store.settle_later(r.durable, charge);
    }

    fn give_back(&self, r: &Reservation, durable: Option<i64>) {
        lock(&r.tenant.day).1.settle(r.amount, Usage::default());
        if let Some(s) = &self.session {
            lock(&s.account).settle(r.amount, Usage::default());
        }
        if let Some(id) = durable {
            r.budgets.store.unreserve(id);
        }
    }
}
