//! A budget refusal as the caller reads it: its message, and the [`GatewayError`] it
//! becomes (counted in `backstop_refusals_total` when it is answered, by
//! [`super::respond`]).

use std::time::Duration;

use super::GatewayError;
use crate::policy::budget::Exceeded;

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
    /// The store could not read or record this call's budget: refused rather than made
    /// unaccounted.
    StoreUnavailable {
        detail: String,
    },
    /// The shared state (Redis) is down, slow or lost its data.
    StateUnavailable {
        detail: String,
        retry_after: Duration,
    },
}

impl From<Refusal> for GatewayError {
    fn from(refusal: Refusal) -> Self {
        let detail = refusal.describe();
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
