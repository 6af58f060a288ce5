//! A reserved upstream call and how it settles: to the reported usage when it is
//! believable, else to the full reservation; dropped unsettled (a cancelled call), it is
//! charged in full and written to the ledger in the background.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{lock, Budgets, TenantBook};
use crate::{
    billing::{CacheTtl, Tokens},
    policy::budget::{sane_usd, SessionSeen, Usage},
    store::Charge,
};

/// How an upstream call ended, for settling its reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No usable answer (a transport failure or an error status): one call, no tokens.
    Failed,
    /// The upstream reported its usage, every billed kind; believed up to
    /// `billing.max_reported_tokens` (all kinds together).
    Reported(Tokens),
    /// The upstream reported usage that is not a count (negative, fractional, too big
    /// for 64 bits): charged the reservation, logged and counted.
    Invalid,
    /// An answer without usage (a stream that ended early, a body without `usage`):
    /// charged the reservation, never less than what may have been spent.
    Unreported,
    /// Usage without a count the endpoint defines (`usage: {}`, `total_tokens` alone,
    /// another API's names): charged the reservation, logged and counted.
    Missing,
    /// A stream that ended before its final usage: what it had reported so far (an
    /// Anthropic stream reports its input in `message_start`), its output at least the
    /// deltas relayed. Charged the larger of those counts with the reserved output and
    /// the reservation: the output the client never saw may still have been billed.
    Partial(Tokens),
    /// An answer whose usage counts its output but not its input: the output as
    /// reported, the input at the reservation's estimate (and price).
    OutputOnly(Tokens),
}

/// What a body's usage, as the leaf read it, settles as.
impl From<crate::api::ReportedUsage> for Outcome {
    fn from(usage: crate::api::ReportedUsage) -> Outcome {
        use crate::api::ReportedUsage;
        match usage {
            ReportedUsage::Absent => Outcome::Unreported,
            ReportedUsage::Counts(tokens) => Outcome::Reported(tokens),
            ReportedUsage::Invalid => Outcome::Invalid,
            ReportedUsage::Missing => Outcome::Missing,
            ReportedUsage::OutputOnly(tokens) => Outcome::OutputOnly(tokens),
        }
    }
}

/// What a settle charged, and the session as the shared state holds it after.
#[derive(Debug, Clone, Copy)]
pub struct Settlement {
    pub usd: f64,
    /// Replica mode, a session's call: the session after this settle.
    pub seen: Option<SessionSeen>,
}

/// A reserved upstream call. Settle it with how the call ended; dropped unsettled, it is
/// charged its full reservation (never less than what may have been spent).
pub struct Reservation {
    pub(super) budgets: Arc<Budgets>,
    pub(super) tenant: Arc<TenantBook>,
    pub(super) session: Option<String>,
    pub(super) model: String,
    pub(super) amount: Usage,
    /// The output tokens reserved (the call's `max_tokens`, times its choices).
    pub(super) output: u64,
    /// The durable reservation's id in the ledger, for budgeted calls.
    pub(super) durable: Option<i64>,
    /// Where the reservation is held, and so where it settles: this process's books
    /// ([`super::local`]) or Redis ([`super::redis`]), as the backend that made it.
    pub(super) hold: Box<dyn Hold>,
    pub(super) settled: bool,
}

/// Where a reservation is held: what settling it, or giving it back, writes beyond the
/// ledger row and the metrics every reservation has. Made by the backend that reserved
/// it ([`super::BudgetBackend::reserve`]).
pub(super) trait Hold: Send + Sync {
    /// The settled usage (`actual`) in the accounts this process keeps for the call.
    fn count(&self, r: &Reservation, actual: Usage);
    /// Writes `charge` where the reservation is held and waits for it; what the session
    /// holds after, where the same write reads it.
    fn settle<'a>(
        &'a self,
        r: &'a Reservation,
        charge: Charge,
    ) -> BoxFuture<'a, Option<SessionSeen>>;
    /// Writes `charge` in the background.
    fn settle_later(&self, r: &Reservation, charge: Charge);
    /// Gives the reservation back uncharged; `durable` is its ledger reservation, to
    /// withdraw.
    fn give_back(&self, r: &Reservation, durable: Option<i64>);
}

impl Reservation {
    /// Reported usage believed as is, or `None` (with a log line and a count) when it is
    /// not believable: then the reservation is charged instead.
    fn believe(&self, outcome: Outcome) -> Option<Tokens> {
        let limit = self.budgets.max_reported_tokens;
        let reason = match outcome {
            Outcome::Failed => return Some(Tokens::default()),
            Outcome::Unreported => return None,
            Outcome::Partial(t) | Outcome::OutputOnly(t) => {
                return self.believe(Outcome::Reported(t))
            }
            Outcome::Invalid => "not_a_count",
            Outcome::Missing => "missing_count",
            // Summed without saturating: counts that overflow 64 bits together are not
            // believed either.
            Outcome::Reported(t)
                if [t.cache_write_5m, t.cache_write_1h, t.cache_read, t.output]
                    .into_iter()
                    .try_fold(t.input, u64::checked_add)
                    .is_none_or(|total| total > limit) =>
            {
                "over_max_reported_tokens"
            }
            Outcome::Reported(tokens) => return Some(tokens),
        };
        let (reported_input, reported_output) = match outcome {
            Outcome::Reported(t) => (Some(t.prompt()), Some(t.output)),
            _ => (None, None),
        };
        tracing::warn!(
            tenant = %self.tenant.name,
            session = self.session_name(),
            model = %self.model,
            reported_input,
            reported_output,
            max_reported_tokens = limit,
            reserved_tokens = self.amount.tokens,
            reason,
            "implausible upstream usage; charging the reservation instead"
        );
        metrics::counter!("backstop_usage_rejected_total", "reason" => reason).increment(1);
        None
    }

    pub(super) fn session_name(&self) -> Option<&str> {
        self.session.as_deref()
    }

    /// The ledger row and the usage to settle for how the call ended.
    fn charge_for(&self, outcome: Outcome) -> (Charge, Usage) {
        let (tokens, usd) = match self.believe(outcome) {
            Some(so_far) if matches!(outcome, Outcome::Partial(_)) => {
                let mut tokens = Tokens {
                    output: so_far.output.max(self.output),
                    ..so_far
                };
                let counted = self
                    .budgets
                    .prices
                    .cost(&self.model, &tokens)
                    .unwrap_or(0.0);
                // The reservation's larger input estimate counted as input, so that the
                // books' tokens agree with what was charged.
                tokens.input += self.amount.tokens.saturating_sub(tokens.total());
                (tokens, counted.max(self.amount.usd))
            }
            Some(output) if matches!(outcome, Outcome::OutputOnly(_)) => {
                let cost =
                    |tokens: &Tokens| self.budgets.prices.cost(&self.model, tokens).unwrap_or(0.0);
                let reserved_output = cost(&Tokens::plain(0, self.output));
                let input = self.amount.tokens.saturating_sub(self.output);
                (
                    Tokens { input, ..output },
                    (self.amount.usd - reserved_output).max(0.0) + cost(&output),
                )
            }
            Some(tokens) => (
                tokens,
                self.budgets
                    .prices
                    .cost(&self.model, &tokens)
                    .unwrap_or(0.0),
            ),
            // The whole reservation, its tokens counted as input.
            None => (Tokens::plain(self.amount.tokens, 0), self.amount.usd),
        };
        let actual = Usage {
            calls: 1,
            tokens: tokens.total(),
            usd: sane_usd(usd),
        };
        let charge = Charge {
            ts_ms: self.budgets.clock.now_ms(),
            day: self.budgets.clock.today(),
            tenant: self.tenant.name.to_string(),
            session: self.session_name().map(str::to_string),
            model: self.model.clone(),
            calls: 1,
            tokens,
            usd: actual.usd,
        };
        (charge, actual)
    }

    fn apply(&mut self, actual: Usage, tokens: &Tokens) {
        self.settled = true;
        self.hold.count(self, actual);
        let tenant = self.tenant.name.to_string();
        let model = self.budgets.model_labels.label(&self.model);
        metrics::counter!("backstop_spend_usd_total", "tenant" => tenant.clone(), "model" => model.to_string()).increment((actual.usd * 1e6) as u64);
        for (kind, n) in tokens.by_kind() {
            if n > 0 {
                metrics::counter!("backstop_tokens_total", "tenant" => tenant.clone(), "model" => model.to_string(), "kind" => kind).increment(n);
            }
        }
    }

    /// The charge of a reservation given back: no call, no tokens, nothing spent.
    pub(super) fn nothing(&self) -> Charge {
        Charge {
            calls: 0,
            tokens: Tokens::default(),
            usd: 0.0,
            ..self.charge_for(Outcome::Failed).0
        }
    }

    /// Gives the reservation back without a charge because no call was made under it
    /// (the first attempt's reservation the gate made, when that attempt reserved
    /// something else or never ran; an attempt whose connection was never made). Held in Redis: released there in the background,
    /// kept and replayed like a settle if Redis cannot take it now.
    pub fn give_back(mut self) {
        self.settled = true;
        let durable = self.durable.take();
        self.hold.give_back(&self, durable);
    }

    /// Settles with how the call ended and waits until the ledger has it. If the ledger
    /// write fails, the durable reservation stays and counts in full after a restart.
    /// Returns what was charged and, settled in Redis, what the session holds now (read
    /// by the same round trip).
    pub async fn settle(mut self, outcome: Outcome) -> Settlement {
        let (charge, actual) = self.charge_for(outcome);
        self.apply(actual, &charge.tokens);
        Settlement {
            usd: actual.usd,
            seen: self.hold.settle(&self, charge).await,
        }
    }

    /// Settles now in memory and writes the ledger in the background (end of a stream).
    pub fn settle_later(mut self, outcome: Outcome) {
        let (charge, actual) = self.charge_for(outcome);
        self.apply(actual, &charge.tokens);
        self.hold.settle_later(&self, charge);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            let (charge, actual) = self.charge_for(Outcome::Unreported);
            self.apply(actual, &charge.tokens);
            self.hold.settle_later(self, charge);
        }
    }
}

/// What one upstream attempt reserves: the model it asks for, its input estimate, the
/// output it may produce, whether the prompt may be written to the cache (and for how
/// long), and the web searches it may make (the meter's arithmetic,
/// [`crate::layers::meter::ask`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub model: String,
    pub input_tokens: u64,
    pub max_output: u64,
    pub cache: Option<CacheTtl>,
    pub web_searches: u64,
}

impl Ask {
    /// Input and output alone: no cache write, no searches.
    pub fn plain(model: &str, input_tokens: u64, max_output: u64) -> Ask {
        Ask {
            model: model.to_string(),
            input_tokens,
            max_output,
            cache: None,
            web_searches: 0,
        }
    }
}

/// The first attempt's reservation, made by the gate's round trip before the request
/// was routed (replica mode). The meter takes it for the attempt that asks exactly the
/// same ([`Prepaid::take`]); if none does (another target, a translated or corrected
/// body, a request refused on the way), it is given back uncharged when the request
/// ends.
pub struct Prepaid {
    ask: Ask,
    held: std::sync::Mutex<Option<Reservation>>,
}

impl std::fmt::Debug for Prepaid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepaid").field("ask", &self.ask).finish()
    }
}

impl Prepaid {
    pub(super) fn shared(ask: Ask, reservation: Reservation) -> Arc<Prepaid> {
        Arc::new(Prepaid {
            ask,
            held: std::sync::Mutex::new(Some(reservation)),
        })
    }

    /// The reservation, once, for an attempt that asks what it was made for.
    pub fn take(&self, ask: &Ask) -> Option<Reservation> {
        if *ask != self.ask {
            return None;
        }
        lock(&self.held).take()
    }
}

impl Drop for Prepaid {
    fn drop(&mut self) {
        if let Some(reservation) = lock(&self.held).take() {
            metrics::counter!("backstop_state_prepaid_returned_total").increment(1);
            reservation.give_back();
        }
    }
}
