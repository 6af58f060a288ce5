//! What recovery did for one request, as typed steps: decided by the recovery and
//! validate layers, rendered to `x-backstop-recovery` in one place ([`render`]), read by
//! the session guard's trace. A test asserts the steps, not a string.

use std::{fmt, sync::Arc};

use super::classify::TransportFailure;

/// Why an attempt did not answer: what its class was decided from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The upstream answered with this status.
    Status(u16),
    /// A 2xx that is not the answer it claims to be.
    Malformed,
    /// A 3xx, never followed.
    Redirect,
    /// No answer: the transport failed.
    Transport(TransportFailure),
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Status(status) => write!(f, "{status}"),
            Reason::Malformed => f.write_str("malformed"),
            Reason::Redirect => f.write_str("redirect"),
            Reason::Transport(failure) => f.write_str(failure.label()),
        }
    }
}

/// One thing recovery (or validation) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The attempt answered successfully.
    Ok,
    /// A transient failure, retried on the same target after a backoff.
    Retry(Reason),
    /// A failure this target will not be asked again for.
    GiveUp(Reason),
    /// A failure whose wait here (a Retry-After, a hang) is traded for the next target
    /// now; this target resumes with its attempts left if the others fail.
    Defer(Reason),
    /// A transient failure not retried: the upstream's retry budget is spent.
    Budget(Reason),
    /// The caller's fault, passed through unchanged.
    Pass(Reason),
    /// The next target is tried.
    Failover(Arc<str>),
    /// The first target is slow (`hedge_after`): this target is asked too, at once.
    Hedge(Arc<str>),
    /// The upstream's breaker is open: skipped without a call.
    Open(Arc<str>),
    /// `context_length_exceeded` sent to the route's context fallback.
    Fallback(Arc<str>),
    /// A layer refused the call before any network (a budget), with its error code.
    Refused(&'static str),
    /// The answer broke its schema: asked again with the errors (the problem's label).
    Correct(&'static str),
    /// The answer proposed a side effect the session already committed (`tool`, first
    /// made as `call`): asked again, told it was made.
    Repeat { tool: Arc<str>, call: Arc<str> },
    /// Corrections exhausted on one target: the next target is asked.
    Switch(Arc<str>),
    /// The session guard let a request at a loop rule's limit (its name) through once,
    /// with a note naming the loop.
    Guided(&'static str),
    /// A target of the other API that cannot carry this request exactly: skipped
    /// before any attempt, with the JSON paths it would lose (space-separated).
    Untranslatable { upstream: Arc<str>, paths: Arc<str> },
    /// The target speaks the other API: the request and its answer are translated
    /// (`chat->messages`).
    Translate(&'static str),
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Ok => f.write_str("ok"),
            Step::Retry(r) => write!(f, "retry:{r}"),
            Step::GiveUp(r) => write!(f, "giveup:{r}"),
            Step::Defer(r) => write!(f, "defer:{r}"),
            Step::Budget(r) => write!(f, "budget:{r}"),
            Step::Pass(r) => write!(f, "pass:{r}"),
            Step::Failover(to) => write!(f, "failover:{to}"),
            Step::Hedge(to) => write!(f, "hedge:{to}"),
            Step::Open(upstream) => write!(f, "open:{upstream}"),
            Step::Fallback(to) => write!(f, "fallback:{to}"),
            Step::Refused(code) => write!(f, "refused:{code}"),
            Step::Correct(kind) => write!(f, "correct:{kind}"),
            Step::Repeat { tool, call } => write!(f, "repeat:{tool}@{call}"),
            Step::Switch(to) => write!(f, "switch:{to}"),
            Step::Guided(rule) => write!(f, "guided:{rule}"),
            Step::Untranslatable { upstream, paths } => {
                write!(f, "skip:{upstream}(untranslatable: {paths})")
            }
            Step::Translate(direction) => write!(f, "translate:{direction}"),
        }
    }
}

/// The steps as the `x-backstop-recovery` header and log field: comma-separated.
pub fn render(steps: &[Step]) -> String {
    use fmt::Write as _;
    let mut out = String::with_capacity(steps.len() * 8);
    for (i, step) in steps.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(out, "{step}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_render_as_the_header_always_has() {
        let steps = [
            Step::Retry(Reason::Status(503)),
            Step::Retry(Reason::Transport(TransportFailure::Reset)),
            Step::GiveUp(Reason::Malformed),
            Step::Failover("backup".into()),
            Step::Correct("schema"),
            Step::Ok,
        ];
        assert_eq!(
            render(&steps),
            "retry:503,retry:reset,giveup:malformed,failover:backup,correct:schema,ok"
        );
        assert_eq!(render(&[]), "");
    }
}
