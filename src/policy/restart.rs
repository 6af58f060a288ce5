//! What the session guard's restart strategies know beyond its state
//! ([`crate::policy::guard`], which holds a guided session's loop and its note): what
//! the strategies remember of a session ([`Restart`]), and how a request ended as they
//! read it ([`Outcome`]: an outage to wait out, a provider refusal with its diagnosis).

use std::time::Duration;

use tokio::time::Instant;

/// What the restart strategies remember of a session besides its state (boxed: most
/// sessions never need it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Restart {
    /// When each loop rule last guided the session ([`loop_slot`]).
    pub guided_at: [Option<Instant>; 2],
    /// The tool loop guided on, with its count then: a conversation keeps its old
    /// repeats, so only more of them are the loop again.
    pub tool_floor: Option<(u64, u32)>,
    /// When the session's current trouble began (its first failure, guidance or wait).
    pub troubled_since: Option<Instant>,
    /// The provider refusal the latest failures repeat (its key), and how many in a row.
    pub same_error: Option<(u64, u32)>,
    /// How long the session's last recovery took, from its trouble's start.
    pub recovered_after: Option<Duration>,
}

impl Restart {
    pub(super) fn is_empty(&self) -> bool {
        *self == Restart::default()
    }
}

/// How an admitted request ended, for [`SessionGuard::ended`](super::guard::SessionGuard::ended).
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Succeeded,
    /// Failed after Backstop's own recovery.
    Failed,
    /// The provider refused the request itself (or the upstream's credentials): `key`
    /// names the refusal, `diagnosis` says what it means and how to fix it; `at_once`
    /// trips without waiting for repeats (a credential failure).
    Refused {
        key: u64,
        diagnosis: String,
        at_once: bool,
    },
    /// Every target's breaker was open: the first probe is due after `retry_after`;
    /// `request` (its fingerprint) was never sent.
    Unavailable {
        retry_after: Duration,
        request: u64,
    },
}

impl Outcome {
    pub fn failed(&self) -> bool {
        matches!(self, Outcome::Failed | Outcome::Refused { .. })
    }
}
