//! A budget refusal as the caller reads it: its message, and the [`GatewayError`] (with
//! its `backstop_refusals_total` reason) it becomes.

use super::GatewayError;
use crate::state::budgets::Refusal;

impl From<Refusal> for GatewayError {
    fn from(refusal: Refusal) -> Self {
        let detail = refusal.describe();
        let reason = match &refusal {
            Refusal::RateLimited { .. } => "rate_limited",
            Refusal::Exceeded(_) => "budget_exceeded",
            Refusal::TooManyConcurrent { .. } => "too_many_concurrent",
            Refusal::Unpriced { .. } => "unpriced_model",
            Refusal::StoreUnavailable { .. } => "store_unavailable",
            Refusal::StateUnavailable { .. } => "state_unavailable",
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
            Refusal::StoreUnavailable { .. } => GatewayError::StoreUnavailable { detail },
            Refusal::StateUnavailable { retry_after, .. } => GatewayError::StateUnavailable {
                detail,
                retry_after,
            },
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
            Refusal::StoreUnavailable { detail } => format!(
                "the budget store is unavailable, so this call cannot be accounted and was not made: {detail}"
            ),
            Refusal::StateUnavailable { detail, .. } => format!(
                "the shared state is unavailable, so this call cannot be accounted and was not made: {detail}"
            ),
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
