//! The budgets replicas count together in Redis (`[state] backend = "redis"`,
//! [`SharedBudgets`]): rates, concurrency slots and budgeted reservations decided by its
//! scripts. While Redis is unavailable, `[state] on_unavailable` decides: `closed`
//! refuses what it would have decided, `open` decides it on this replica's own books
//! ([`LocalBudgets::standing_in`]), counted as blind; a state Redis lost is refused
//! either way. Calls without a cap to reserve against are counted here only.

use std::{sync::Arc, time::Duration};

use futures_util::{future::BoxFuture, FutureExt};

use super::{
    backend::{BudgetBackend, Day},
    local::LocalBudgets,
    reservation::{Ask, Hold, Prepaid, Reservation},
    Budgets, ConcurrencySlot, Gated, Refusal, TenantBook,
};
use crate::{
    config::OnUnavailable,
    policy::budget::{Account, SessionSeen, Usage, SESSION, TENANT_DAY},
    state::shared::{
        Admission, AdmitError, Gate, GateReply, GuardWrite, SharedBudgets, SharedCharge,
        SharedReservation, Unavailable,
    },
    store::{Charge, StoreError},
};

/// The budgets in Redis, with this replica's books standing in while it is away.
pub struct RedisBudgets {
    shared: Arc<SharedBudgets>,
    /// Redis counts and PostgreSQL keeps the replicas' ledger: a budgeted call held in
    /// Redis also has a durable reservation in the ledger, settled there too.
    shared_ledger: bool,
    fallback: LocalBudgets,
}

impl RedisBudgets {
    /// `shared_ledger`: the store is PostgreSQL, the replicas' ledger.
    pub fn new(shared: Arc<SharedBudgets>, shared_ledger: bool) -> RedisBudgets {
        RedisBudgets {
            shared,
            shared_ledger,
            fallback: LocalBudgets::standing_in(),
        }
    }

    /// What a Redis failure means for a decision: refused (`closed`, or lost state), or
    /// `None` to decide on this replica's own state (`open`), counted as blind.
    fn unavailable(&self, err: Unavailable, what: &'static str) -> Option<Refusal> {
        if err != Unavailable::Lost && self.shared.redis.on_unavailable == OnUnavailable::Open {
            self.shared.redis.count_blind(what);
            return None;
        }
        Some(Refusal::StateUnavailable {
            detail: err.to_string(),
            retry_after: Duration::from_secs(1),
        })
    }

    /// What Redis's admission script is asked for one call of `model`, today.
    fn admission<'a>(
        budgets: &Budgets,
        book: &'a TenantBook,
        session: Option<&'a str>,
        model: &'a str,
        want: Usage,
    ) -> Admission<'a> {
        Admission {
            tenant: &book.name,
            session,
            model,
            day: budgets.clock.today(),
            want,
            day_caps: &book.day_limits,
            session_caps: &book.session_limits,
            session_names: SESSION,
            day_names: TENANT_DAY,
        }
    }

    /// What the gate reserves for a request's first attempt (`ask`), priced: only for a
    /// budgeted call whose reservation Redis alone holds (with PostgreSQL's ledger the
    /// meter writes it there first), and never for one the meter would refuse unpriced.
    fn prepay(
        &self,
        budgets: &Budgets,
        book: &TenantBook,
        session: Option<&str>,
        ask: &Ask,
    ) -> Option<Usage> {
        if !self.prepays(book, session.is_some()) {
            return None;
        }
        budgets.worst_case(book, session.is_some(), ask).ok()
    }

    /// A reservation Redis holds (`held`), with its durable one in the replicas' ledger.
    fn held(
        &self,
        budgets: &Arc<Budgets>,
        book: Arc<TenantBook>,
        ask: &Ask,
        want: Usage,
        durable: Option<i64>,
        held: SharedReservation,
    ) -> Reservation {
        Reservation {
            budgets: budgets.clone(),
            tenant: book,
            session: held.session.clone(),
            model: ask.model.clone(),
            amount: want,
            output: ask.max_output,
            durable,
            hold: Box::new(SharedHold {
                shared: self.shared.clone(),
                held,
            }),
            settled: false,
        }
    }

    /// A budgeted call's durable reservation in the replicas' ledger, when Redis holds
    /// its reservation: its id, or the refusal (`[state] on_unavailable` decides when
    /// the ledger cannot be reached).
    async fn reserve_in_ledger(
        budgets: &Budgets,
        book: &TenantBook,
        session: Option<&str>,
        model: &str,
        want: Usage,
    ) -> Result<i64, Refusal> {
        let record = budgets.reservation_record(&book.name, session, model, want);
        let id = record.id;
        match budgets.store.reserve(record).await {
            Ok(()) => Ok(id),
            Err(err) if budgets.blind_past(&err, "reservation") => Ok(id),
            Err(err) => {
                tracing::error!(tenant = %book.name, session, error = %err, "cannot record a reservation in the ledger; refusing the call");
                budgets.store.unreserve(id);
                Err(err.into())
            }
        }
    }

    async fn gate_shared(
        &self,
        budgets: &Arc<Budgets>,
        book: &Arc<TenantBook>,
        session: Option<&str>,
        guard: Option<GuardWrite>,
        prepay: Option<&Ask>,
    ) -> Result<Gated, Refusal> {
        let (rpm, session_rpm) = book.rpm;
        let max_concurrent = session.and(book.max_concurrent);
        let prepay = prepay.and_then(|ask| Some((ask, self.prepay(budgets, book, session, ask)?)));
        let asks = rpm.is_some()
            || (session.is_some() && session_rpm.is_some())
            || max_concurrent.is_some()
            || guard.is_some()
            || prepay.is_some();
        let mut shared_err = None;
        if asks {
            let gate = Gate {
                tenant: &book.name,
                session,
                tenant_rpm: rpm,
                session_rpm,
                max_concurrent,
                guard,
                prepay: prepay
                    .map(|(ask, want)| Self::admission(budgets, book, session, &ask.model, want)),
            };
            match self.shared.gate(gate).await {
                Ok(GateReply::Passed {
                    slot,
                    guard,
                    prepaid,
                }) => {
                    let prepaid = prepaid.zip(prepay).map(|(held, (ask, want))| {
                        Prepaid::shared(
                            ask.clone(),
                            self.held(budgets, book.clone(), ask, want, None, held),
                        )
                    });
                    return Ok(Gated::Passed {
                        slot: slot.map(ConcurrencySlot::Shared),
                        guard,
                        prepaid,
                    });
                }
                Ok(GateReply::Moved(version, state)) => return Ok(Gated::Moved(version, state)),
                Ok(GateReply::RateLimited { scope, retry_after }) => {
                    return Err(Refusal::RateLimited { scope, retry_after })
                }
                Ok(GateReply::Busy { limit }) => return Err(Refusal::TooManyConcurrent { limit }),
                Err(err) => {
                    metrics::counter!("backstop_state_fallbacks_total", "op" => "rate_local")
                        .increment(1);
                    shared_err = Some(err);
                }
            }
        }
        // Redis unreachable (or nothing asked of it): the rates on this replica's
        // limiters, the slot as `on_unavailable` says.
        self.fallback.check_rate(budgets, book, session)?;
        if let (Some(_), Some(_), Some(err)) = (session, max_concurrent, shared_err) {
            if let Some(refusal) = self.unavailable(err, "concurrency") {
                return Err(refusal);
            }
        }
        Ok(Gated::Passed {
            slot: self.fallback.enter(budgets, book, session).await?,
            guard: None,
            prepaid: None,
        })
    }

    async fn reserve_shared(
        &self,
        budgets: &Arc<Budgets>,
        book: Arc<TenantBook>,
        session: Option<&str>,
        ask: &Ask,
    ) -> Result<Reservation, Refusal> {
        if !book.budgets(session.is_some()) {
            // Nothing to share: counted on this replica's books, charged to the ledger.
            return self.fallback.reserve(budgets, book, session, ask).await;
        }
        let model = ask.model.as_str();
        let want = budgets.worst_case(&book, session.is_some(), ask)?;
        // In the replicas' ledger first: a refusal by Redis then only withdraws it.
        let durable = match self.shared_ledger {
            true => Some(Self::reserve_in_ledger(budgets, &book, session, model, want).await?),
            false => None,
        };
        let withdraw = || {
            if let Some(id) = durable {
                budgets.store.unreserve(id);
            }
        };
        let admitted = self
            .shared
            .admit(Self::admission(budgets, &book, session, model, want))
            .await;
        match admitted {
            Ok(held) => Ok(self.held(budgets, book, ask, want, durable, held)),
            Err(AdmitError::Over(e)) => {
                withdraw();
                Err(Refusal::Exceeded(e))
            }
            Err(AdmitError::Unavailable(err)) => {
                // Either refused, or reserved again on this replica's books.
                withdraw();
                if let Some(refusal) = self.unavailable(err, "budget") {
                    return Err(refusal);
                }
                self.fallback.reserve(budgets, book, session, ask).await
            }
        }
    }
}

fn unavailable(err: Unavailable) -> StoreError {
    StoreError::Unavailable(err.to_string().into())
}

impl BudgetBackend for RedisBudgets {
    fn gate<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: &'a Arc<TenantBook>,
        session: Option<&'a str>,
        guard: Option<GuardWrite>,
        prepay: Option<&'a Ask>,
    ) -> BoxFuture<'a, Result<Gated, Refusal>> {
        Box::pin(self.gate_shared(budgets, book, session, guard, prepay))
    }

    fn prepays(&self, book: &TenantBook, in_session: bool) -> bool {
        !self.shared_ledger && book.budgets(in_session)
    }

    fn reserve<'a>(
        &'a self,
        budgets: &'a Arc<Budgets>,
        book: Arc<TenantBook>,
        session: Option<&'a str>,
        ask: &'a Ask,
    ) -> BoxFuture<'a, Result<Reservation, Refusal>> {
        Box::pin(self.reserve_shared(budgets, book, session, ask))
    }

    fn session_usage<'a>(
        &'a self,
        _budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<Account, StoreError>> {
        Box::pin(async move {
            let (settled, reserved) = self
                .shared
                .session_usage(&book.name, session)
                .await
                .map_err(unavailable)?;
            Ok(Account { settled, reserved })
        })
    }

    fn session_account<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
        session: &'a str,
    ) -> BoxFuture<'a, Result<(Account, u32), StoreError>> {
        Box::pin(async move {
            let account = self.session_usage(budgets, book, session).await?;
            let in_flight = match book.max_concurrent {
                Some(_) => self
                    .shared
                    .in_flight(&book.name, session)
                    .await
                    .map_err(unavailable)?,
                None => 0,
            };
            Ok((account, in_flight))
        })
    }

    fn tenant_day<'a>(
        &'a self,
        budgets: &'a Budgets,
        book: &'a TenantBook,
    ) -> BoxFuture<'a, Result<Day, StoreError>> {
        Box::pin(async move {
            let day = budgets.clock.today();
            let (settled, reserved) = self
                .shared
                .day_usage(&book.name, day)
                .await
                .map_err(unavailable)?;
            let by_model = self
                .shared
                .day_by_model(&book.name, day)
                .await
                .map_err(unavailable)?;
            Ok(Day {
                day,
                account: Account { settled, reserved },
                by_model,
            })
        })
    }

    fn reset_session<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.shared
                .reset_session(tenant, session)
                .await
                .map_err(unavailable)
        })
    }

    fn shared(&self) -> Option<&Arc<SharedBudgets>> {
        Some(&self.shared)
    }
}

/// A reservation held in Redis: settled there (and, with the replicas' ledger, in the
/// ledger beside it); the accounts of this process are not touched.
struct SharedHold {
    shared: Arc<SharedBudgets>,
    held: SharedReservation,
}

impl SharedHold {
    /// Settles the reservation in Redis. If Redis cannot take it now (down, slow, or a
    /// script error), the settle is kept in the replica's store and replayed until Redis
    /// takes it ([`SharedBudgets::spawn_replayer`]); settling is idempotent per
    /// reservation, so a replay never charges twice.
    fn settle_shared(
        &self,
        budgets: &Arc<Budgets>,
        charge: Charge,
    ) -> impl std::future::Future<Output = Option<SessionSeen>> + Send + 'static {
        let (shared, budgets) = (self.shared.clone(), budgets.clone());
        let settle = shared.settle_of(
            &self.held,
            SharedCharge {
                tenant: &charge.tenant,
                model: &charge.model,
                tokens: charge.tokens,
                usd: charge.usd,
                ts_ms: charge.ts_ms,
                calls: charge.calls,
            },
        );
        async move {
            match shared.settle(&settle).await {
                Ok((_, seen)) => seen,
                Err(err) => {
                    shared
                        .keep(budgets.books(), settle, err, budgets.clock.now_ms())
                        .await;
                    None
                }
            }
        }
    }

    fn spawn_settle(&self, budgets: &Arc<Budgets>, charge: Charge) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(self.settle_shared(budgets, charge).map(drop));
        }
    }
}

impl Hold for SharedHold {
    fn count(&self, _r: &Reservation, _actual: Usage) {}

    fn settle<'a>(
        &'a self,
        r: &'a Reservation,
        charge: Charge,
    ) -> BoxFuture<'a, Option<SessionSeen>> {
        Box::pin(async move {
            if let Some(id) = r.durable {
                // The replicas' ledger (Redis counts): written beside Redis's settle.
                if let Err(err) = r.budgets.store.settle(Some(id), charge.clone()).await {
                    tracing::error!(tenant = %r.tenant.name, error = %err, "cannot record a charge in the ledger");
                }
            }
            self.settle_shared(&r.budgets, charge).await
        })
    }

    fn settle_later(&self, r: &Reservation, charge: Charge) {
        if let Some(id) = r.durable {
            r.budgets.store.settle_later(Some(id), charge.clone());
        }
        self.spawn_settle(&r.budgets, charge);
    }

    fn give_back(&self, r: &Reservation, durable: Option<i64>) {
        if let Some(id) = durable {
            r.budgets.store.unreserve(id);
        }
        self.spawn_settle(&r.budgets, r.nothing());
    }
}
