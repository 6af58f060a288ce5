//! A guarded session's live part: its guard, its recovery trace and how it stands to the
//! session's shared state (replica mode). The guard's logic is [`crate::state::sessions`];
//! this is the record it keeps in the session's [`super::Session`].

use std::{collections::VecDeque, sync::Arc};

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::{
    policy::guard::{Phase, SessionGuard},
    state::guard_view,
};

/// Trace entries kept per session.
const TRACE_LEN: usize = 100;

/// One line of a session's recovery trace. Kept as a small struct (not JSON) because
/// every live session holds up to [`TRACE_LEN`] of them: 96 bytes, plus the bytes of a
/// trail, a refusal's detail, or a client's own request id.
#[derive(Debug, Clone)]
pub struct TraceEntry {
    pub request_id: TraceId,
    /// 0 for a request the guard refused.
    pub status: u16,
    pub failed: bool,
    /// Recovery's trail (`retry:503,ok`), or `refused:<code>`.
    pub action: Box<str>,
    /// The rule and evidence, for refusals.
    pub detail: Option<Box<str>>,
    pub attempts: u32,
    pub upstream: Option<Arc<str>>,
    pub latency_ms: f32,
    pub cost_usd: f64,
    pub tool_loop: u32,
    pub state: Phase,
}

impl TraceEntry {
    pub(in crate::state) fn to_json(&self) -> Value {
        json!({
            "request_id": self.request_id.to_string(), "status": self.status,
            "class": if self.status == 0 { "refused" } else if self.failed { "failed" } else { "ok" },
            "action": self.action, "detail": self.detail, "attempts": self.attempts, "upstream": self.upstream.as_deref(),
            "latency_ms": self.latency_ms, "cost_usd": crate::policy::budget::Usd(self.cost_usd), "tool_loop": self.tool_loop, "state": self.state.label(),
        })
    }
}

/// A request id as a trace keeps it: one Backstop made (32 lowercase hex digits, see
/// [`crate::layers::edge::new_request_id`]) as its 16 bytes, a client's as it came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceId {
    Hex([u8; 16]),
    Given(Box<str>),
}

impl TraceId {
    pub fn new(id: &str) -> TraceId {
        let b = id.as_bytes();
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        if b.len() == 32 {
            let mut out = [0u8; 16];
            let all = out.iter_mut().zip(b.chunks_exact(2)).all(|(o, pair)| {
                match (digit(pair[0]), digit(pair[1])) {
                    (Some(hi), Some(lo)) => {
                        *o = hi << 4 | lo;
                        true
                    }
                    _ => false,
                }
            });
            if all {
                return TraceId::Hex(out);
            }
        }
        TraceId::Given(id.into())
    }
}

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceId::Hex(bytes) => bytes.iter().try_for_each(|b| write!(f, "{b:02x}")),
            TraceId::Given(id) => f.write_str(id),
        }
    }
}

pub struct GuardedSession {
    pub guard: SessionGuard,
    pub(in crate::state) trace: VecDeque<TraceEntry>,
    /// The session's settled spend as this replica last saw it (the settle of its last
    /// call here), for the guard's spend samples without a read of its own.
    pub seen_usd: f64,
    /// The config generation `guard`'s policy is from (see [`SessionGuards::reconfigured`]).
    pub(in crate::state) generation: u64,
    /// How this replica's guard stands to the session's shared state (replica mode).
    /// Made on first use and boxed: most sessions (every one in embedded mode) never
    /// share theirs, and every live session pays for what is inline here (these 32 bytes
    /// inline put a session's record in jemalloc's 320-byte class, not the 256).
    pub(in crate::state) shared: Option<Box<Sharing>>,
    /// The session's latest changes of state on this replica, with their evidence
    /// (boxed: most sessions never change state).
    pub(in crate::state) changes: Option<Box<Changes>>,
}

/// A session's kept changes of state, oldest first.
#[derive(Debug, Default)]
pub(in crate::state) struct Changes(VecDeque<Change>);

/// Changes of state kept per session.
const CHANGES_LEN: usize = 32;

/// A change of a session's state, as its report shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// Wall clock, ms since the epoch.
    pub at_ms: i64,
    pub from: Phase,
    pub to: Phase,
    pub request_id: TraceId,
    /// What led to it: the rule and evidence, the wait, the time to recovery.
    pub evidence: Option<Box<str>>,
}

impl Change {
    fn to_json(&self) -> Value {
        json!({
            "at_ms": self.at_ms, "from": self.from.label(), "to": self.to.label(),
            "request_id": self.request_id.to_string(), "evidence": self.evidence,
        })
    }
}

/// A session's guard against its shared state, on this replica.
#[derive(Default)]
pub(in crate::state) struct Sharing {
    /// The shared state's version the guard is at (0: none known).
    pub(in crate::state) version: u64,
    /// Whole writes of this session's shared state one at a time from this replica, and
    /// none while requests are being joined to it (those go together), so races (and
    /// their retries) are only ever between replicas, and a whole write never holds a
    /// request that is still being joined.
    pub(in crate::state) updating: Arc<tokio::sync::RwLock<()>>,
    /// The session's requests on their way to the shared state from this replica (joined,
    /// or offered whole beside a join): while any is, no whole state is offered.
    pub(in crate::state) joining: usize,
    /// The shared state was this replica's guard before its last write (nobody wrote
    /// between): it likely still is at the next.
    pub(in crate::state) last_writer: bool,
}

impl GuardedSession {
    pub(in crate::state) fn new(guard: SessionGuard, generation: u64) -> Self {
        GuardedSession {
            guard,
            trace: VecDeque::with_capacity(1),
            seen_usd: 0.0,
            generation,
            shared: None,
            changes: None,
        }
    }

    /// The shared state's version this replica's guard is at.
    pub fn version(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.version)
    }

    pub(in crate::state) fn sharing(&mut self) -> &mut Sharing {
        self.shared.get_or_insert_with(Box::default)
    }

    /// This replica wrote the shared state whole, at `version`.
    pub(in crate::state) fn wrote(&mut self, version: u64) {
        let s = self.sharing();
        s.version = version;
        s.last_writer = true;
    }

    pub fn trace(&mut self, item: TraceEntry) {
        if self.trace.len() == TRACE_LEN {
            self.trace.pop_front();
        }
        self.trace.push_back(item);
    }

    /// Keeps a change of state for the session's report.
    pub fn changed(&mut self, change: Change) {
        let changes = &mut self.changes.get_or_insert_with(Box::default).0;
        if changes.len() == CHANGES_LEN {
            changes.pop_front();
        }
        changes.push_back(change);
    }

    /// The kept changes of state, oldest first, as JSON.
    pub fn changes_json(&self) -> Vec<Value> {
        self.changes
            .iter()
            .flat_map(|c| c.0.iter())
            .map(Change::to_json)
            .collect()
    }

    /// The mean cost of the session's traced calls that reached an upstream (0 before
    /// any did): what one refused request would have cost.
    pub fn mean_call_usd(&self) -> f64 {
        let (n, usd) = self
            .trace
            .iter()
            .filter(|t| t.status != 0)
            .fold((0u32, 0.0), |(n, usd), t| (n + 1, usd + t.cost_usd));
        if n == 0 {
            0.0
        } else {
            usd / f64::from(n)
        }
    }

    /// The guard's signals (state, risk, the trip and its evidence), as of `now`.
    pub fn signals(&self, now: Instant, session_usd: f64) -> Value {
        guard_view::signals(&self.guard, now, session_usd, self.tool_loop())
    }

    /// The signals' risk score alone.
    pub fn risk(&self, now: Instant, session_usd: f64) -> f64 {
        self.guard.risk(now, session_usd, self.tool_loop())
    }

    pub(in crate::state) fn tool_loop(&self) -> u32 {
        self.trace.back().map_or(0, |t| t.tool_loop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_keeps_request_ids_as_they_came() {
        let made = crate::layers::edge::new_request_id();
        let made = made.to_str().unwrap();
        assert!(matches!(TraceId::new(made), TraceId::Hex(_)));
        for id in [
            made,
            "00000000000000000000000000000000",
            "0123456789abcdef0123456789abcdef",
            // Not Backstop's shape: kept as given, case and all.
            "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0",
            "0123456789abcdeg0123456789abcdef",
            "client-id-42",
            "-",
        ] {
            assert_eq!(TraceId::new(id).to_string(), id);
        }
        assert!(matches!(
            TraceId::new("0123456789ABCDEF0123456789ABCDEF"),
            TraceId::Given(_)
        ));
    }

    #[test]
    fn a_trace_entry_stays_small() {
        // Every live session holds at least one.
        assert!(std::mem::size_of::<TraceEntry>() <= 96);
    }
}
