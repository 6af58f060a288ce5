//! What the budgets show: the admin and tenant JSON views of a session and a tenant's
//! day, and the `x-backstop-budget-remaining` header.

use super::{backend::Day, Budgets};
use crate::{
    clock::Date,
    policy::budget::{Account, SessionSeen, Usd},
    store::{ReportQuery, StoreError},
};

/// The longest window [`Budgets::tenant_days`] reads: a year, leap day included.
pub const MAX_REPORT_DAYS: u32 = 366;

impl Budgets {
    /// What a session has left, formatted for `x-backstop-budget-remaining`; `None` when
    /// the session is not budgeted.
    pub async fn remaining_header(
        &self,
        tenant: &str,
        session: &str,
        seen: Option<SessionSeen>,
    ) -> Option<String> {
        let book = self.tenant(tenant)?;
        if book.session_limits.is_unlimited() {
            return None;
        }
        let account = match seen {
            // What the settle of the request's last call saw (only a backend whose
            // settle reads the session sees it): no read of its own.
            Some(seen) => Account {
                settled: seen.settled,
                reserved: seen.reserved,
            },
            None => self.backend.session_usage(self, book, session).await.ok()?,
        };
        let (calls, tokens, usd) = account.remaining(&book.session_limits);
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

    /// A session's figures for the admin API and the tenant's own view (`None`: no such
    /// tenant).
    pub async fn session_report(
        &self,
        tenant: &str,
        session: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(None);
        };
        let (account, in_flight) = self.backend.session_account(self, book, session).await?;
        let (calls, tokens, usd) = account.remaining(&book.session_limits);
        Ok(Some(serde_json::json!({
            "tenant": tenant,
            "session": session,
            "used": {"calls": account.settled.calls, "tokens": account.settled.tokens, "usd": Usd(account.settled.usd)},
            "reserved": {"calls": account.reserved.calls, "tokens": account.reserved.tokens, "usd": Usd(account.reserved.usd)},
            "in_flight": in_flight,
            "limits": {"max_calls": book.session_limits.calls, "max_tokens": book.session_limits.tokens, "max_usd": book.session_limits.usd.map(Usd), "max_concurrent": book.max_concurrent},
            "remaining": {"calls": calls, "tokens": tokens, "usd": usd.map(Usd)},
        })))
    }

    /// A tenant's day for the admin API (`None`: no such tenant). A ledger that cannot
    /// be read is an error, not a day without spend.
    pub async fn tenant_report(
        &self,
        tenant: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(None);
        };
        let Day {
            day,
            account,
            by_model,
        } = self.backend.tenant_day(self, book).await?;
        let (_, tokens, usd) = account.remaining(&book.day_limits);
        let by_model: Vec<_> = by_model
            .into_iter()
            .map(|(model, u)| serde_json::json!({"model": model, "calls": u.calls, "tokens": u.tokens, "usd": Usd(u.usd)}))
            .collect();
        Ok(Some(serde_json::json!({
            "tenant": tenant,
            "day": day,
            "used_today": {"calls": account.settled.calls, "tokens": account.settled.tokens, "usd": Usd(account.settled.usd)},
            "reserved": {"calls": account.reserved.calls, "tokens": account.reserved.tokens, "usd": Usd(account.reserved.usd)},
            "limits": {"usd_per_day": book.day_limits.usd.map(Usd), "tokens_per_day": book.day_limits.tokens},
            "remaining_today": {"usd": usd.map(Usd), "tokens": tokens},
            "by_model": by_model,
        })))
    }

    /// A tenant's spend in the ledger by UTC day and model over the last `days` days
    /// (today included), for the admin view's `?days=` (`None`: no such tenant). Read
    /// from the ledger of this gateway's store through [`crate::store::Ledger::spend_report`]:
    /// with `[state] backend = "redis"` over SQLite, that is this replica's own file.
    pub async fn tenant_days(
        &self,
        tenant: &str,
        days: u32,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let Some(book) = self.tenant(tenant) else {
            return Ok(None);
        };
        let today = self.clock.today();
        let days = days.clamp(1, MAX_REPORT_DAYS);
        let query = ReportQuery {
            tenant: Some(book.name.to_string()),
            from_day: Some(today - i64::from(days) + 1),
            to_day: Some(today),
        };
        let rows = self.store.spend_report(&query).await?;
        let rows: Vec<_> = rows
            .into_iter()
            .map(|r| {
                let t = &r.tokens;
                serde_json::json!({
                    "day": r.day, "date": Date(r.day).to_string(), "model": r.model,
                    "calls": r.calls, "input_tokens": t.input, "output_tokens": t.output,
                    "cache_write_tokens": t.cache_write(), "cache_write_1h_tokens": t.cache_write_1h,
                    "cache_read_tokens": t.cache_read, "reasoning_tokens": t.reasoning,
                    "web_searches": t.web_searches, "tokens": t.total(), "usd": Usd(r.usd),
                })
            })
            .collect();
        Ok(Some(serde_json::Value::Array(rows)))
    }
}
