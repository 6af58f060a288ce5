//! What the session guard's restart strategies know beyond its state
//! ([`crate::policy::guard`]): a guided session's loop and the note it is sent with
//! ([`Guide`]), what the strategies remember of a session ([`Restart`]), and how a
//! request ended as they read it ([`Outcome`]: an outage to wait out, a provider
//! refusal with its diagnosis).

use std::time::Duration;

use tokio::time::Instant;

use super::guard::TripRule;

/// The loop a guided session was guided out of: the rule and its evidence, and what a
/// request must show to be that loop again.
#[derive(Debug, Clone, PartialEq)]
pub struct Guide {
    pub rule: TripRule,
    pub evidence: String,
    /// The identical request's fingerprint ([`RequestFingerprint::request`]).
    pub request: u64,
    /// The tool loop's key and count when guided: the same loop counted more times is
    /// the loop again.
    pub tool: Option<(u64, u32)>,
    /// The result the looping tool kept returning, for the note.
    pub result: Option<String>,
}

impl Guide {
    /// The note the guided request carries to the model.
    pub fn note(&self) -> String {
        match (self.rule, &self.result) {
            (TripRule::ToolLoopLimit, Some(result)) => format!(
                "Backstop's session guard: this conversation is in a loop. {}; the last result was: {}. Calling it again with the same arguments will not change that. Try a different approach: other arguments, another tool, or answer the user with what you know.",
                self.evidence,
                result.trim_end().trim_end_matches('.')
            ),
            (TripRule::ToolLoopLimit, None) => format!(
                "Backstop's session guard: this conversation is in a loop: {}. Calling it again with the same arguments will not change that. Try a different approach: other arguments, another tool, or answer the user with what you know.",
                self.evidence
            ),
            _ => format!(
                "Backstop's session guard: {}. Repeating it will get the same answer. Try a different approach.",
                self.evidence
            ),
        }
    }
}

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

/// Which of [`Restart::guided_at`] a loop rule uses.
pub(super) fn loop_slot(rule: TripRule) -> Option<usize> {
    match rule {
        TripRule::IdenticalRequestLimit => Some(0),
        TripRule::ToolLoopLimit => Some(1),
        _ => None,
    }
}

/// A tool loop's key: its description's hash.
pub fn tool_key(description: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(description.as_bytes())
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
