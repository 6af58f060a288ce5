//! The session guard's state machine and trip rules, with the clock passed in.
//!
//! active → recovering (a request failed; Backstop's own recovery could not save it)
//!        → tripped (a rule fired: refusing until `cool_down`)
//!        → probing (cool-down over: one request admitted)
//!        → active on success, or tripped again on failure; closed by an operator.
//!
//! Rules: consecutive failed requests; the identical request (model + messages + tools)
//! too often in a window; the same tool call answered by the same result too often in the
//! conversation; spend velocity; the provider refusing the request itself the same way
//! again and again (`unrecoverable`, its diagnosis as the evidence; at once for a
//! credential failure). One more is decided outside the session, across the tenant's
//! fleet ([`crate::policy::fleet`]), and imposed on it ([`SessionGuard::impose`]).
//!
//! Restart smart: with `guide`, the request at a loop rule's limit (identical request,
//! tool loop) is not refused but admitted once, `guided` (the caller adds a note naming
//! the evidence): the session's next request that repeats the loop trips it, one that
//! changes course is `recovered`. Once per rule per cool-down. When every target's
//! breaker is open the session is `waiting` (told when to come back), not failed; its
//! first success after it is `recovered` too. Recovered lasts until the next request.

use std::{collections::VecDeque, time::Duration};

use tokio::time::Instant;

use super::restart::{Outcome, Restart};

/// Requests remembered per session for the identical-request rule.
pub const RECENT_CAP: usize = 256;

#[derive(Debug, Clone)]
pub struct GuardPolicy {
    pub max_consecutive_failures: u32,
    pub identical_request_limit: u32,
    pub identical_request_window: Duration,
    pub tool_loop_limit: u32,
    pub max_usd_per_minute: Option<f64>,
    pub cool_down: Duration,
    /// Guide a session once (per loop rule, per cool-down) before a loop rule trips it.
    pub guide: bool,
    /// The same provider refusal of the request this many times in a row trips the
    /// session (`unrecoverable`).
    pub same_error_limit: u32,
}

/// The error code a trip is refused with: a closed set (error codes and metric labels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TripCode {
    /// Failures or spend velocity: the session is unwell.
    SessionTripped,
    /// Repeats or tool loops: the agent is going round in circles.
    LoopDetected,
}

impl TripCode {
    pub fn as_str(self) -> &'static str {
        match self {
            TripCode::SessionTripped => "session_tripped",
            TripCode::LoopDetected => "loop_detected",
        }
    }
}

/// The rule that tripped a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TripRule {
    MaxConsecutiveFailures,
    IdenticalRequestLimit,
    ToolLoopLimit,
    MaxUsdPerMinute,
    /// Enough of the tenant's sessions failed the same way that this session's failure
    /// (or its request, with `preempt`) was taken for the same doomed work.
    FleetPattern,
    /// The provider kept refusing the request itself the same way (or refused the
    /// upstream's credentials): retrying cannot help.
    Unrecoverable,
    /// An operator closed the session.
    Closed,
    /// Read back from the store under a rule name this build does not know.
    Restored(TripCode),
}

impl TripRule {
    pub fn code(self) -> TripCode {
        match self {
            TripRule::IdenticalRequestLimit | TripRule::ToolLoopLimit => TripCode::LoopDetected,
            TripRule::MaxConsecutiveFailures
            | TripRule::MaxUsdPerMinute
            | TripRule::FleetPattern
            | TripRule::Unrecoverable
            | TripRule::Closed => TripCode::SessionTripped,
            TripRule::Restored(code) => code,
        }
    }

    /// The name in config, logs, reports and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            TripRule::MaxConsecutiveFailures => "max_consecutive_failures",
            TripRule::IdenticalRequestLimit => "identical_request_limit",
            TripRule::ToolLoopLimit => "tool_loop_limit",
            TripRule::MaxUsdPerMinute => "max_usd_per_minute",
            TripRule::FleetPattern => "fleet_pattern",
            TripRule::Unrecoverable => "unrecoverable",
            TripRule::Closed => "closed",
            TripRule::Restored(_) => "restored",
        }
    }
}

/// Which rule tripped the session, with the evidence an operator can act on.
#[derive(Debug, Clone, PartialEq)]
pub struct Trip {
    pub rule: TripRule,
    pub evidence: String,
    /// For a [`TripRule::FleetPattern`] trip, the fleet signature it was predicted from
    /// (its refusals are credited to it).
    pub signature: Option<u64>,
}

impl Trip {
    pub fn new(rule: TripRule, evidence: String) -> Trip {
        Trip {
            rule,
            evidence,
            signature: None,
        }
    }

    pub fn code(&self) -> TripCode {
        self.rule.code()
    }
}

/// The guard's states without their data: what transitions, logs and metrics name, and
/// what a [`GuardSnapshot`](crate::store::format::GuardSnapshot) stores (by [`Phase::label`]; a name this build does not know
/// does not read as any phase).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Active,
    Recovering,
    Tripped,
    Probing,
    Closed,
    Guided,
    Waiting,
    Recovered,
}

impl Phase {
    pub fn label(self) -> &'static str {
        match self {
            Phase::Active => "active",
            Phase::Recovering => "recovering",
            Phase::Tripped => "tripped",
            Phase::Probing => "probing",
            Phase::Closed => "closed",
            Phase::Guided => "guided",
            Phase::Waiting => "waiting",
            Phase::Recovered => "recovered",
        }
    }

    /// Every phase, in the order the docs list them.
    pub const ALL: [Phase; 8] = [
        Phase::Active,
        Phase::Guided,
        Phase::Waiting,
        Phase::Recovered,
        Phase::Recovering,
        Phase::Tripped,
        Phase::Probing,
        Phase::Closed,
    ];

    /// A phase whose refusal must outlive the process (it is written to the store).
    pub fn is_kept(self) -> bool {
        matches!(self, Phase::Tripped | Phase::Probing | Phase::Closed)
    }
}

/// A change of phase, `(from, to)`.
pub type Transition = (Phase, Phase);

/// A trip is boxed: every live session holds a state, few hold a trip.
#[derive(Debug, Clone, PartialEq)]
pub enum GuardState {
    Active,
    Recovering,
    Tripped {
        until: Instant,
        trip: Box<Trip>,
    },
    Probing {
        trip: Box<Trip>,
    },
    Closed,
    /// A loop rule fired and the request was let through once with a note.
    Guided {
        guide: Box<Guide>,
    },
    /// Every target's breaker is open: the first probe is due at `until`.
    Waiting {
        until: Instant,
    },
    /// Was guided or waiting, then succeeded (until its next request).
    Recovered,
}

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

/// Which of [`Restart::guided_at`] a loop rule uses.
fn loop_slot(rule: TripRule) -> Option<usize> {
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

impl GuardState {
    pub fn phase(&self) -> Phase {
        match self {
            GuardState::Active => Phase::Active,
            GuardState::Recovering => Phase::Recovering,
            GuardState::Tripped { .. } => Phase::Tripped,
            GuardState::Probing { .. } => Phase::Probing,
            GuardState::Closed => Phase::Closed,
            GuardState::Guided { .. } => Phase::Guided,
            GuardState::Waiting { .. } => Phase::Waiting,
            GuardState::Recovered => Phase::Recovered,
        }
    }

    pub fn label(&self) -> &'static str {
        self.phase().label()
    }
}

/// A refused request: the trip behind it and when to come back.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub trip: Trip,
    pub retry_after: Duration,
}

/// What a request looks like to the rules.
#[derive(Debug, Clone, Default)]
pub struct RequestFingerprint {
    /// Hash of the normalised model + messages + tools.
    pub request: u64,
    /// The most repeated (tool call, result) pair in the conversation, with its count.
    pub tool_loop: Option<(String, u32)>,
    /// That pair's result (its start), for a guided request's note.
    pub tool_result: Option<String>,
}

/// What outlives a session's memory (a restart, idle eviction): an operator's close, or
/// a trip with the time left of its cool-down. Everything else starts over.
#[derive(Debug, Clone, PartialEq)]
pub enum Kept {
    Closed,
    Tripped { remaining: Duration, trip: Trip },
}

/// A persisted trip read back: its rule by name, or, for a name this build does not
/// know, its code (so the refusal keeps its meaning).
pub fn restore_trip(code: &str, rule: &str, evidence: String) -> Trip {
    let rule = match rule {
        "max_consecutive_failures" => TripRule::MaxConsecutiveFailures,
        "identical_request_limit" => TripRule::IdenticalRequestLimit,
        "tool_loop_limit" => TripRule::ToolLoopLimit,
        "max_usd_per_minute" => TripRule::MaxUsdPerMinute,
        "fleet_pattern" => TripRule::FleetPattern,
        "unrecoverable" => TripRule::Unrecoverable,
        "closed" => TripRule::Closed,
        _ if code == "loop_detected" => TripRule::Restored(TripCode::LoopDetected),
        _ => TripRule::Restored(TripCode::SessionTripped),
    };
    Trip::new(rule, evidence)
}

#[derive(Debug, Clone)]
pub struct SessionGuard {
    /// Shared by every session of the tenant.
    config: std::sync::Arc<GuardPolicy>,
    state: GuardState,
    consecutive_failures: u32,
    recent: VecDeque<(Instant, u64)>,
    /// (when, session spend total in USD at that time), oldest first: about one sample
    /// a second for a minute, so a `Vec` (8 bytes smaller than a `VecDeque`, which every
    /// live session pays for) whose front is removed at most once a second.
    spend: Vec<(Instant, f64)>,
    /// Saturates (at four billion changes of state); `u32` to share a word with
    /// `consecutive_failures`.
    transitions: u32,
    /// What the restart strategies remember, once one has acted.
    restart: Option<Box<Restart>>,
}

impl SessionGuard {
    pub fn new(config: impl Into<std::sync::Arc<GuardPolicy>>) -> Self {
        // Most sessions are short: start the windows small (a live session costs memory
        // for as long as it stays in the cache).
        SessionGuard {
            config: config.into(),
            state: GuardState::Active,
            consecutive_failures: 0,
            recent: VecDeque::with_capacity(1),
            spend: Vec::with_capacity(1),
            transitions: 0,
            restart: None,
        }
    }

    /// A reloaded config's policy; the state, counters and windows carry on.
    pub fn set_policy(&mut self, config: std::sync::Arc<GuardPolicy>) {
        self.config = config;
    }

    /// A session coming back with what was kept of it; a trip whose cool-down has
    /// passed is due its probe.
    pub fn restored(
        config: impl Into<std::sync::Arc<GuardPolicy>>,
        kept: Kept,
        now: Instant,
    ) -> Self {
        let mut guard = SessionGuard::new(config);
        guard.state = match kept {
            Kept::Closed => GuardState::Closed,
            Kept::Tripped { remaining, trip } => GuardState::Tripped {
                until: now + remaining,
                trip: Box::new(trip),
            },
        };
        guard
    }

    /// What must outlive memory of the current state. A probing session keeps its trip
    /// (cool-down over), so a probe cut short by a restart is probed again.
    pub fn kept(&self, now: Instant) -> Option<Kept> {
        match &self.state {
            GuardState::Closed => Some(Kept::Closed),
            GuardState::Tripped { until, trip } => Some(Kept::Tripped {
                remaining: until.saturating_duration_since(now),
                trip: Trip::clone(trip),
            }),
            GuardState::Probing { trip } => Some(Kept::Tripped {
                remaining: Duration::ZERO,
                trip: Trip::clone(trip),
            }),
            GuardState::Active
            | GuardState::Recovering
            | GuardState::Guided { .. }
            | GuardState::Waiting { .. }
            | GuardState::Recovered => None,
        }
    }

    pub fn state(&self) -> &GuardState {
        &self.state
    }

    /// What the restart strategies remember (nothing until one acts).
    pub fn restart(&self) -> Option<&Restart> {
        self.restart.as_deref()
    }

    /// How long the recovery this guard just made took, once: for the restart record.
    pub fn take_recovery(&mut self) -> Option<Duration> {
        self.restart.as_deref_mut()?.recovered_after.take()
    }

    fn restart_mut(&mut self) -> &mut Restart {
        self.restart.get_or_insert_with(Box::default)
    }

    /// The session's trouble began at `now`, unless it had already.
    fn troubled(&mut self, now: Instant) {
        self.restart_mut().troubled_since.get_or_insert(now);
    }

    /// The trouble is over without a restart (a failure recovered by itself).
    fn untroubled(&mut self) {
        if let Some(r) = self.restart.as_deref_mut() {
            r.troubled_since = None;
            r.same_error = None;
        }
        if self.restart.as_deref().is_some_and(Restart::is_empty) {
            self.restart = None;
        }
    }

    /// Recovered at `now`: how long since the trouble began is kept for the report.
    fn recover(&mut self, now: Instant) -> Option<Transition> {
        let r = self.restart_mut();
        r.recovered_after = r
            .troubled_since
            .take()
            .map(|since| now.saturating_duration_since(since));
        r.same_error = None;
        self.set(GuardState::Recovered)
    }

    fn set(&mut self, state: GuardState) -> Option<Transition> {
        let from = self.state.phase();
        let to = state.phase();
        self.state = state;
        if from != to {
            self.transitions = self.transitions.saturating_add(1);
            Some((from, to))
        } else {
            None
        }
    }

    fn trip(&mut self, now: Instant, trip: Trip) -> Option<Transition> {
        self.set(GuardState::Tripped {
            until: now + self.config.cool_down,
            trip: Box::new(trip),
        })
    }

    fn usd_last_minute(&self, now: Instant, total: f64) -> f64 {
        let minute_ago = now.checked_sub(Duration::from_secs(60));
        let base = self
            .spend
            .iter()
            .rev()
            .find(|(t, _)| minute_ago.is_none_or(|m| *t <= m))
            .or_else(|| self.spend.first())
            .map_or(0.0, |(_, usd)| *usd);
        (total - base).max(0.0)
    }

    /// The session's spend at its latest sample (any replica's, in replica mode).
    pub fn last_spend(&self) -> Option<f64> {
        self.spend.last().map(|(_, usd)| *usd)
    }

    /// Whether [`SessionGuard::admit`] at `now` counts its request in the window (an
    /// active or recovering guard always does, even when the request trips it; a tripped
    /// one whose cool-down is over does, with its probe; a closed, cooling or probing one
    /// refuses without counting). A replica that keeps the window beside the shared
    /// state adds the request there only then.
    pub fn counts_request(&self, now: Instant) -> bool {
        match &self.state {
            GuardState::Active
            | GuardState::Recovering
            | GuardState::Guided { .. }
            | GuardState::Waiting { .. }
            | GuardState::Recovered => true,
            GuardState::Tripped { until, .. } => now >= *until,
            GuardState::Probing { .. } | GuardState::Closed => false,
        }
    }

    /// Admits a request or refuses it; may trip the session. `session_usd` is the
    /// session's settled spend so far. Returns the state change, if any, for logging.
    pub fn admit(
        &mut self,
        now: Instant,
        fp: &RequestFingerprint,
        session_usd: f64,
    ) -> (Result<(), Refused>, Option<Transition>) {
        let window = self.config.identical_request_window;
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
        {
            self.recent.pop_front();
        }
        let stale = self
            .spend
            .iter()
            .skip(1)
            .take_while(|(t, _)| now.saturating_duration_since(*t) >= Duration::from_secs(60))
            .count();
        self.spend.drain(..stale);
        // One spend sample a second is enough to find the total a minute ago (the
        // current total is `session_usd` itself), and keeps a busy session's window at
        // about 60 entries.
        if self
            .spend
            .last()
            .is_none_or(|last| now.saturating_duration_since(last.0) >= Duration::from_secs(1))
        {
            self.spend.push((now, session_usd));
        }
        match &self.state {
            GuardState::Closed => {
                let trip = Trip::new(TripRule::Closed, "an operator closed this session".into());
                return (
                    Err(Refused {
                        trip,
                        retry_after: Duration::from_secs(3600),
                    }),
                    None,
                );
            }
            GuardState::Tripped { until, trip } if now < *until => {
                return (
                    Err(Refused {
                        trip: Trip::clone(trip),
                        retry_after: *until - now,
                    }),
                    None,
                );
            }
            GuardState::Tripped { trip, .. } => {
                let trip = trip.clone();
                let change = self.set(GuardState::Probing { trip });
                self.recent.push_back((now, fp.request));
                return (Ok(()), change);
            }
            GuardState::Probing { trip } => {
                // One probe at a time; its outcome decides.
                return (
                    Err(Refused {
                        trip: Trip::clone(trip),
                        retry_after: Duration::from_secs(1),
                    }),
                    None,
                );
            }
            GuardState::Guided { guide } => {
                // The request after the guided one: the loop again trips the session, a
                // change of course is a recovery.
                // The guided request itself again (its answer dropped) is the loop again
                // too.
                let again = fp.request == guide.request
                    || guide.tool.is_some_and(|(key, n)| {
                        fp.tool_loop
                            .as_ref()
                            .is_some_and(|(d, m)| tool_key(d) == key && *m > n)
                    });
                if again {
                    let trip = Trip::new(
                        guide.rule,
                        format!(
                            "{}; guided once to change course, the session repeated it",
                            guide.evidence
                        ),
                    );
                    self.recent.push_back((now, fp.request));
                    let change = self.trip(now, trip.clone());
                    return (
                        Err(Refused {
                            trip,
                            retry_after: self.config.cool_down,
                        }),
                        change,
                    );
                }
                let from = self.state.phase();
                self.recover(now);
                let (verdict, _) = self.judge(now, fp, session_usd);
                let to = self.state.phase();
                return (verdict, (from != to).then_some((from, to)));
            }
            GuardState::Recovered => {
                let change = self.set(GuardState::Active);
                let (verdict, later) = self.judge(now, fp, session_usd);
                let to = self.state.phase();
                return (verdict, later.or(change).map(|_| (Phase::Recovered, to)));
            }
            GuardState::Active | GuardState::Recovering | GuardState::Waiting { .. } => {}
        }
        self.judge(now, fp, session_usd)
    }

    /// The rules, on a request of a session in a phase that admits.
    fn judge(
        &mut self,
        now: Instant,
        fp: &RequestFingerprint,
        session_usd: f64,
    ) -> (Result<(), Refused>, Option<Transition>) {
        let window = self.config.identical_request_window;
        let repeats = self.recent.iter().filter(|(_, h)| *h == fp.request).count() as u32;
        let floor = self.restart.as_ref().and_then(|r| r.tool_floor);
        // A waiting session was told to come back: the same request again is no loop.
        let waiting = matches!(self.state, GuardState::Waiting { .. });
        let rule = if repeats >= self.config.identical_request_limit && !waiting {
            Some(Trip::new(
                TripRule::IdenticalRequestLimit,
                format!(
                    "the same request was sent {} times within {}",
                    repeats + 1,
                    humantime::format_duration(window)
                ),
            ))
        } else if let Some((call, n)) = fp.tool_loop.as_ref().filter(|(d, n)| {
            *n >= self.config.tool_loop_limit
                && !floor.is_some_and(|(key, m)| key == tool_key(d) && *n <= m)
        }) {
            Some(Trip::new(
                TripRule::ToolLoopLimit,
                format!("{call} {n} times"),
            ))
        } else {
            self.config.max_usd_per_minute.and_then(|limit| {
                let spent = self.usd_last_minute(now, session_usd);
                (spent >= limit).then(|| {
                    Trip::new(
                        TripRule::MaxUsdPerMinute,
                        format!("spent ${spent:.4} in the last minute (limit ${limit:.4})"),
                    )
                })
            })
        };
        self.recent.push_back((now, fp.request));
        // A loop repeats within its last few requests; a busy session does not need its
        // whole window remembered.
        if self.recent.len() > RECENT_CAP {
            self.recent.pop_front();
        }
        match rule {
            Some(trip) if self.may_guide(now, trip.rule) => (Ok(()), self.guide(now, trip, fp)),
            Some(trip) => {
                let change = self.trip(now, trip.clone());
                (
                    Err(Refused {
                        trip,
                        retry_after: self.config.cool_down,
                    }),
                    change,
                )
            }
            None => (Ok(()), None),
        }
    }

    /// Whether a loop rule that fired at `now` guides rather than trips: `guide` is on,
    /// and the rule has not guided this session within a cool-down.
    fn may_guide(&self, now: Instant, rule: TripRule) -> bool {
        let Some(slot) = loop_slot(rule) else {
            return false;
        };
        self.config.guide
            && self
                .restart
                .as_ref()
                .and_then(|r| r.guided_at[slot])
                .is_none_or(|at| now.saturating_duration_since(at) >= self.config.cool_down)
    }

    fn guide(&mut self, now: Instant, trip: Trip, fp: &RequestFingerprint) -> Option<Transition> {
        let tool = match trip.rule {
            TripRule::ToolLoopLimit => fp.tool_loop.as_ref().map(|(d, n)| (tool_key(d), *n)),
            _ => None,
        };
        self.troubled(now);
        let r = self.restart_mut();
        if let Some(slot) = loop_slot(trip.rule) {
            r.guided_at[slot] = Some(now);
        }
        if tool.is_some() {
            r.tool_floor = tool;
        }
        self.set(GuardState::Guided {
            guide: Box::new(Guide {
                rule: trip.rule,
                evidence: trip.evidence,
                request: fp.request,
                tool,
                result: fp.tool_result.clone().filter(|_| tool.is_some()),
            }),
        })
    }

    /// Records how an admitted request ended: [`SessionGuard::ended`] of a success or a
    /// failure.
    pub fn record(&mut self, now: Instant, failed: bool) -> Option<Transition> {
        let outcome = if failed {
            Outcome::Failed
        } else {
            Outcome::Succeeded
        };
        self.ended(now, &outcome)
    }

    /// Records how an admitted request ended. A request admitted before the session was
    /// tripped or closed (by a concurrent request, or an operator) that ends after it
    /// changes nothing: its outcome does not undo a refusal decided meanwhile.
    pub fn ended(&mut self, now: Instant, outcome: &Outcome) -> Option<Transition> {
        let from = self.state.phase();
        self.end(now, outcome);
        let to = self.state.phase();
        (from != to).then_some((from, to))
    }

    fn end(&mut self, now: Instant, outcome: &Outcome) -> Option<Transition> {
        if matches!(self.state, GuardState::Tripped { .. } | GuardState::Closed) {
            return None;
        }
        let failed = match outcome {
            Outcome::Succeeded => {
                self.consecutive_failures = 0;
                return match self.state {
                    // Guided: its answer is judged by the session's next request.
                    GuardState::Guided { .. } | GuardState::Recovered => None,
                    GuardState::Waiting { .. } => self.recover(now),
                    _ => {
                        self.untroubled();
                        self.set(GuardState::Active)
                    }
                };
            }
            Outcome::Unavailable {
                retry_after,
                request,
            } => {
                self.unguide();
                // Never sent: the request does not count as a repeat of itself (an agent
                // told to come back sends the same request again).
                if let Some(at) = self.recent.iter().rposition(|(_, h)| h == request) {
                    self.recent.remove(at);
                }
                self.troubled(now);
                return self.set(GuardState::Waiting {
                    until: now + *retry_after,
                });
            }
            Outcome::Refused {
                key,
                diagnosis,
                at_once,
            } => Some((*key, diagnosis, *at_once)),
            Outcome::Failed => None,
        };
        self.consecutive_failures += 1;
        self.troubled(now);
        self.unguide();
        let limit = self.config.same_error_limit.max(1);
        let same = self.restart.as_deref_mut().map(|r| &mut r.same_error);
        let repeats = match (failed, same) {
            (Some((key, ..)), Some(Some((k, n)))) if *k == key => {
                *n += 1;
                *n
            }
            (Some((key, ..)), _) => {
                self.restart_mut().same_error = Some((key, 1));
                1
            }
            (None, same) => {
                if let Some(same) = same {
                    *same = None;
                }
                0
            }
        };
        if let Some((_, diagnosis, at_once)) = failed {
            if at_once || repeats >= limit {
                let evidence = if at_once {
                    diagnosis.clone()
                } else {
                    format!("the provider refused the request the same way {repeats} times in a row: {diagnosis}")
                };
                return self.trip(now, Trip::new(TripRule::Unrecoverable, evidence));
            }
        }
        if let GuardState::Probing { trip } = &self.state {
            let trip = Trip {
                evidence: format!(
                    "{}; the probe after the cool-down failed too",
                    trip.evidence
                ),
                ..Trip::clone(trip)
            };
            return self.trip(now, trip);
        }
        if self.consecutive_failures >= self.config.max_consecutive_failures {
            let trip = Trip::new(
                TripRule::MaxConsecutiveFailures,
                format!(
                    "{} requests in a row failed after Backstop's own recovery",
                    self.consecutive_failures
                ),
            );
            return self.trip(now, trip);
        }
        self.set(GuardState::Recovering)
    }

    /// A guided request that failed or met an outage: its note never had an answer, so
    /// it was no guidance (the rule may guide again, the same request with the note).
    fn unguide(&mut self) {
        let GuardState::Guided { guide } = &self.state else {
            return;
        };
        let (slot, tool) = (loop_slot(guide.rule), guide.tool.is_some());
        let r = self.restart_mut();
        if let Some(slot) = slot {
            r.guided_at[slot] = None;
        }
        if tool {
            r.tool_floor = None;
        }
        self.state = GuardState::Recovering;
        self.transitions = self.transitions.saturating_add(1);
    }

    /// Trips the session for `cool_down` on a rule decided outside it (the fleet's), as
    /// [`SessionGuard::record`] leaves it: an active, recovering or probing session is
    /// tripped; one tripped already (by its own rules: their evidence stands) or closed
    /// is left as it is.
    pub fn impose(&mut self, now: Instant, trip: Trip, cool_down: Duration) -> Option<Transition> {
        match self.state {
            GuardState::Tripped { .. } | GuardState::Closed => None,
            GuardState::Active
            | GuardState::Recovering
            | GuardState::Probing { .. }
            | GuardState::Guided { .. }
            | GuardState::Waiting { .. }
            | GuardState::Recovered => self.set(GuardState::Tripped {
                until: now + cool_down,
                trip: Box::new(trip),
            }),
        }
    }

    pub fn close(&mut self) -> Option<Transition> {
        self.set(GuardState::Closed)
    }

    pub fn reset(&mut self) {
        *self = SessionGuard::new(self.config.clone());
    }

    /// How close the nearest rule is to firing, in [0, 1] (the dashboard sorts thousands
    /// of sessions by it).
    pub fn risk(&self, now: Instant, session_usd: f64, last_tool_loop: u32) -> f64 {
        self.pressure(now, session_usd, last_tool_loop).risk
    }

    /// The counters behind the rules, and the risk they add up to.
    pub fn pressure(&self, now: Instant, session_usd: f64, last_tool_loop: u32) -> Pressure {
        let max_repeat = {
            let mut counts: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
            for (_, h) in &self.recent {
                *counts.entry(*h).or_default() += 1;
            }
            counts.values().copied().max().unwrap_or(0)
        };
        let velocity = self.usd_last_minute(now, session_usd);
        let ratios = [
            f64::from(self.consecutive_failures)
                / f64::from(self.config.max_consecutive_failures.max(1)),
            f64::from(max_repeat) / f64::from(self.config.identical_request_limit.max(1) + 1),
            f64::from(last_tool_loop) / f64::from(self.config.tool_loop_limit.max(1)),
            self.config.max_usd_per_minute.map_or(0.0, |l| velocity / l),
        ];
        Pressure {
            risk: ratios.iter().copied().fold(0.0, f64::max).min(1.0),
            max_repeat,
            usd_last_minute: velocity,
            consecutive_failures: self.consecutive_failures,
            transitions: u64::from(self.transitions),
        }
    }

    /// What the rules have counted, times on this replica's clock (for the snapshot
    /// replicas share, `state::guard_view`).
    pub fn counts(&self) -> Counts<'_> {
        Counts {
            state: &self.state,
            consecutive_failures: self.consecutive_failures,
            recent: &self.recent,
            spend: &self.spend,
            transitions: u64::from(self.transitions),
            restart: self.restart.as_deref(),
        }
    }

    /// A guard that goes on counting from `counts` (carried from another replica).
    pub fn from_counts(config: impl Into<std::sync::Arc<GuardPolicy>>, counts: Counts<'_>) -> Self {
        SessionGuard {
            config: config.into(),
            state: counts.state.clone(),
            consecutive_failures: counts.consecutive_failures,
            recent: counts.recent.clone(),
            spend: counts.spend.to_vec(),
            transitions: u32::try_from(counts.transitions).unwrap_or(u32::MAX),
            restart: counts.restart.cloned().map(Box::new),
        }
    }
}

/// A guard's counters, borrowed: [`SessionGuard::counts`].
pub struct Counts<'a> {
    pub state: &'a GuardState,
    pub consecutive_failures: u32,
    /// (when, [`RequestFingerprint::request`]), oldest first.
    pub recent: &'a VecDeque<(Instant, u64)>,
    /// (when, the session's spend total in USD then), oldest first.
    pub spend: &'a [(Instant, f64)],
    pub transitions: u64,
    pub restart: Option<&'a Restart>,
}

/// How near a session is to tripping: [`SessionGuard::pressure`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pressure {
    /// The nearest rule's ratio to its limit, in [0, 1].
    pub risk: f64,
    /// Most repeats of one request in the window.
    pub max_repeat: u32,
    pub usd_last_minute: f64,
    pub consecutive_failures: u32,
    pub transitions: u64,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn config() -> GuardPolicy {
        GuardPolicy {
            max_consecutive_failures: 5,
            identical_request_limit: 3,
            identical_request_window: Duration::from_secs(600),
            tool_loop_limit: 3,
            max_usd_per_minute: Some(1.0),
            cool_down: Duration::from_secs(60),
            guide: false,
            same_error_limit: 3,
        }
    }

    pub(crate) fn fp(request: u64) -> RequestFingerprint {
        RequestFingerprint {
            request,
            ..RequestFingerprint::default()
        }
    }

    #[test]
    fn consecutive_failures_trip_then_cool_down_probe_and_recover() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for i in 0..5 {
            assert!(g.admit(t0, &fp(i), 0.0).0.is_ok());
            g.record(t0, true);
        }
        assert_eq!(g.state().label(), "tripped");
        let refused = g
            .admit(t0 + Duration::from_secs(10), &fp(99), 0.0)
            .0
            .unwrap_err();
        assert_eq!(
            (refused.trip.rule, refused.retry_after),
            (TripRule::MaxConsecutiveFailures, Duration::from_secs(50))
        );
        // Cool-down over: one probe; a second request meanwhile is refused.
        let t1 = t0 + Duration::from_secs(60);
        assert!(g.admit(t1, &fp(100), 0.0).0.is_ok());
        assert_eq!(g.state().label(), "probing");
        assert!(g.admit(t1, &fp(101), 0.0).0.is_err());
        g.record(t1, false);
        assert_eq!(g.state().label(), "active");
        assert!(g.admit(t1, &fp(102), 0.0).0.is_ok());
    }

    /// Requests still in flight when the session trips (or an operator closes it) end
    /// later: neither their success nor their failure reopens it.
    #[test]
    fn a_request_ending_after_a_trip_or_close_does_not_undo_it() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        // One slow request admitted, then a loop trips the session meanwhile.
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        for _ in 0..3 {
            assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        assert!(g.admit(t0, &fp(42), 0.0).0.is_err());
        assert_eq!(g.state().label(), "tripped");
        assert_eq!(g.record(t0, false), None);
        assert_eq!(g.state().label(), "tripped");
        assert_eq!(g.record(t0, true), None);
        assert_eq!(g.state().label(), "tripped");
        assert!(g.admit(t0, &fp(2), 0.0).0.is_err());

        let mut g = SessionGuard::new(config());
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        g.close();
        assert_eq!(g.record(t0, false), None);
        assert_eq!(g.state().label(), "closed");
        assert!(g.admit(t0, &fp(2), 0.0).0.is_err());
    }

    #[test]
    fn a_failed_probe_trips_again() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for i in 0..5 {
            assert!(g.admit(t0, &fp(i), 0.0).0.is_ok());
            g.record(t0, true);
        }
        let t1 = t0 + Duration::from_secs(61);
        assert!(g.admit(t1, &fp(7), 0.0).0.is_ok());
        g.record(t1, true);
        assert_eq!(g.state().label(), "tripped");
        assert!(g
            .admit(t1 + Duration::from_secs(59), &fp(8), 0.0)
            .0
            .is_err());
    }

    #[test]
    fn the_fourth_identical_request_in_the_window_is_a_loop() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for _ in 0..3 {
            assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
            g.record(t0, false);
        }
        let refused = g.admit(t0, &fp(42), 0.0).0.unwrap_err();
        assert_eq!(
            (refused.trip.code(), refused.trip.rule),
            (TripCode::LoopDetected, TripRule::IdenticalRequestLimit)
        );
        assert!(
            refused.trip.evidence.contains("4 times"),
            "{}",
            refused.trip.evidence
        );
        // Outside the window the old repeats do not count.
        let mut g = SessionGuard::new(config());
        for k in 0..3 {
            assert!(g
                .admit(t0 + Duration::from_secs(k * 400), &fp(42), 0.0)
                .0
                .is_ok());
        }
        assert!(g
            .admit(t0 + Duration::from_secs(1200), &fp(42), 0.0)
            .0
            .is_ok());
    }

    #[test]
    fn tool_loops_and_spend_velocity_trip() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        let looping = RequestFingerprint {
            request: 1,
            tool_loop: Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.into(),
                3,
            )),
            tool_result: None,
        };
        let refused = g.admit(t0, &looping, 0.0).0.unwrap_err();
        assert_eq!(refused.trip.rule, TripRule::ToolLoopLimit);
        assert!(
            refused.trip.evidence.contains("Atlantis") && refused.trip.evidence.contains("3 times")
        );

        let mut g = SessionGuard::new(config());
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        assert!(g.admit(t0 + Duration::from_secs(20), &fp(2), 0.6).0.is_ok());
        let refused = g
            .admit(t0 + Duration::from_secs(40), &fp(3), 1.1)
            .0
            .unwrap_err();
        assert_eq!(refused.trip.rule, TripRule::MaxUsdPerMinute);
        // The same total spread over more than a minute is fine.
        let mut g = SessionGuard::new(config());
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        assert!(g.admit(t0 + Duration::from_secs(61), &fp(2), 0.9).0.is_ok());
        assert!(g
            .admit(t0 + Duration::from_secs(122), &fp(3), 1.8)
            .0
            .is_ok());
    }

    #[test]
    fn a_kept_trip_is_restored_with_its_remaining_cool_down() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for i in 0..5 {
            assert!(g.admit(t0, &fp(i), 0.0).0.is_ok());
            g.record(t0, true);
        }
        let t1 = t0 + Duration::from_secs(20);
        let kept = g.kept(t1).unwrap();
        let Kept::Tripped { remaining, trip } = &kept else {
            panic!("{kept:?}")
        };
        assert_eq!(*remaining, Duration::from_secs(40));
        let trip = restore_trip(
            trip.code().as_str(),
            trip.rule.as_str(),
            trip.evidence.clone(),
        );
        assert_eq!(trip.rule, TripRule::MaxConsecutiveFailures);
        let mut back = SessionGuard::restored(
            config(),
            Kept::Tripped {
                remaining: *remaining,
                trip,
            },
            t1,
        );
        let refused = back.admit(t1, &fp(50), 0.0).0.unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(40));
        assert!(back
            .admit(t1 + Duration::from_secs(40), &fp(51), 0.0)
            .0
            .is_ok());
        assert_eq!(back.state().label(), "probing");

        let mut closed = SessionGuard::restored(config(), Kept::Closed, t1);
        assert!(closed
            .admit(t1 + Duration::from_secs(9999), &fp(1), 0.0)
            .0
            .is_err());
        assert_eq!(closed.kept(t1), Some(Kept::Closed));
        assert_eq!(SessionGuard::new(config()).kept(t1), None);
    }

    #[test]
    fn a_healthy_twelve_step_agent_is_never_tripped() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for step in 0..12u64 {
            let now = t0 + Duration::from_secs(step * 5);
            assert!(
                g.admit(now, &fp(step), step as f64 * 0.01).0.is_ok(),
                "step {step}"
            );
            // One transient-looking failure midway, recovered on the next step.
            g.record(now, step == 6);
        }
        assert_eq!(g.state().label(), "active");
    }

    fn guiding() -> GuardPolicy {
        GuardPolicy {
            guide: true,
            ..config()
        }
    }

    fn looping(n: u32, request: u64) -> RequestFingerprint {
        RequestFingerprint {
            request,
            tool_loop: Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.into(),
                n,
            )),
            tool_result: Some("Error: city not found".into()),
        }
    }

    #[test]
    fn without_guide_a_loop_trips_as_before() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        let (verdict, change) = g.admit(t0, &looping(3, 1), 0.0);
        assert_eq!(verdict.unwrap_err().trip.rule, TripRule::ToolLoopLimit);
        assert_eq!(change, Some((Phase::Active, Phase::Tripped)));
        assert_eq!(g.restart(), None, "nothing remembered");
    }

    #[test]
    fn a_guided_tool_loop_that_changes_course_recovers_and_one_that_repeats_trips() {
        let t0 = Instant::now();
        // Changes course: its latest tool call differs (the old loop still in history).
        let mut g = SessionGuard::new(guiding());
        let (verdict, change) = g.admit(t0, &looping(3, 1), 0.0);
        assert!(verdict.is_ok(), "guided, not refused");
        assert_eq!(change, Some((Phase::Active, Phase::Guided)));
        let GuardState::Guided { guide } = g.state() else {
            panic!("{:?}", g.state())
        };
        let note = guide.note();
        assert!(
            note.contains(r#"get_weather({"city":"Atlantis"})"#)
                && note.contains("3 times")
                && note.contains("Error: city not found"),
            "{note}"
        );
        assert_eq!(g.record(t0, false), None, "its answer leaves it guided");
        let t1 = t0 + Duration::from_secs(7);
        let (verdict, change) = g.admit(t1, &looping(3, 2), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Guided, Phase::Recovered)));
        assert_eq!(
            g.restart().unwrap().recovered_after,
            Some(Duration::from_secs(7)),
            "from the guidance to the change of course"
        );
        // The next request is active again, and the old repeats in history do not fire.
        let (verdict, change) = g.admit(t1, &looping(3, 3), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Recovered, Phase::Active)));

        // Repeats: the same call answered the same way once more.
        let mut g = SessionGuard::new(guiding());
        assert!(g.admit(t0, &looping(3, 1), 0.0).0.is_ok());
        g.record(t0, false);
        let (verdict, change) = g.admit(t1, &looping(4, 2), 0.0);
        let refused = verdict.unwrap_err();
        assert_eq!(
            (refused.trip.rule, refused.trip.code()),
            (TripRule::ToolLoopLimit, TripCode::LoopDetected)
        );
        assert!(
            refused.trip.evidence.contains("guided once"),
            "{}",
            refused.trip.evidence
        );
        assert_eq!(change, Some((Phase::Guided, Phase::Tripped)));
    }

    #[test]
    fn a_guided_identical_request_sent_again_trips_and_a_different_one_recovers() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(guiding());
        for _ in 0..3 {
            assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        let (verdict, change) = g.admit(t0, &fp(42), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Active, Phase::Guided)));
        let mut repeated = g.clone();
        let refused = repeated.admit(t0, &fp(42), 0.0).0.unwrap_err();
        assert_eq!(refused.trip.rule, TripRule::IdenticalRequestLimit);
        assert!(refused.trip.evidence.contains("4 times"));
        let (verdict, change) = g.admit(t0, &fp(43), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Guided, Phase::Recovered)));
    }

    #[test]
    fn a_rule_guides_once_per_cool_down() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(guiding());
        for _ in 0..4 {
            assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        assert!(g.admit(t0, &fp(7), 0.0).0.is_ok(), "changed course");
        // The identical request again within the cool-down: no second guidance.
        let refused = g.admit(t0 + Duration::from_secs(30), &fp(42), 0.0).0;
        assert_eq!(
            refused.unwrap_err().trip.rule,
            TripRule::IdenticalRequestLimit
        );
        // The other loop rule still has its own guidance.
        let mut h = SessionGuard::new(guiding());
        for _ in 0..4 {
            assert!(h.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        assert!(h.admit(t0, &fp(8), 0.0).0.is_ok());
        let (verdict, change) = h.admit(t0, &looping(3, 9), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Recovered, Phase::Guided)));
        // After a cool-down the rule may guide again.
        let mut k = SessionGuard::new(guiding());
        for _ in 0..4 {
            assert!(k.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        assert!(k.admit(t0, &fp(7), 0.0).0.is_ok());
        let later = t0 + Duration::from_secs(61);
        for _ in 0..3 {
            assert!(k.admit(later, &fp(50), 0.0).0.is_ok());
        }
        let (verdict, change) = k.admit(later, &fp(50), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Active, Phase::Guided)));
    }

    #[test]
    fn an_outage_waits_and_the_first_success_after_it_recovers() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        assert!(g.admit(t0, &fp(1), 0.0).0.is_ok());
        let wait = Outcome::Unavailable {
            retry_after: Duration::from_secs(12),
            request: 1,
        };
        assert_eq!(g.ended(t0, &wait), Some((Phase::Active, Phase::Waiting)));
        assert_eq!(
            g.state(),
            &GuardState::Waiting {
                until: t0 + Duration::from_secs(12)
            }
        );
        // Waiting never trips, however long the outage lasts.
        for k in 1..20 {
            let now = t0 + Duration::from_secs(k);
            assert!(g.admit(now, &fp(100 + k), 0.0).0.is_ok());
            g.ended(now, &wait);
        }
        assert_eq!(g.state().phase(), Phase::Waiting);
        let t1 = t0 + Duration::from_secs(30);
        assert!(g.admit(t1, &fp(2), 0.0).0.is_ok());
        assert_eq!(
            g.record(t1, false),
            Some((Phase::Waiting, Phase::Recovered))
        );
        assert_eq!(
            g.restart().unwrap().recovered_after,
            Some(Duration::from_secs(30))
        );
        assert_eq!(g.kept(t1), None, "waiting and recovered are not kept");
    }

    fn refused_by_provider(key: u64, at_once: bool) -> Outcome {
        Outcome::Refused {
            key,
            diagnosis: "invalid_request_error at `messages[1].content`: fix it".into(),
            at_once,
        }
    }

    #[test]
    fn the_same_provider_refusal_three_times_trips_with_its_diagnosis() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        for i in 0..2 {
            assert!(g.admit(t0, &fp(i), 0.0).0.is_ok());
            assert_eq!(
                g.ended(t0, &refused_by_provider(9, false)).map(|c| c.1),
                (i == 0).then_some(Phase::Recovering)
            );
        }
        assert!(g.admit(t0, &fp(3), 0.0).0.is_ok());
        assert_eq!(
            g.ended(t0, &refused_by_provider(9, false)),
            Some((Phase::Recovering, Phase::Tripped))
        );
        let refused = g.admit(t0, &fp(4), 0.0).0.unwrap_err();
        assert_eq!(
            (refused.trip.rule, refused.trip.code()),
            (TripRule::Unrecoverable, TripCode::SessionTripped)
        );
        assert!(
            refused.trip.evidence.contains("3 times in a row")
                && refused.trip.evidence.contains("messages[1].content"),
            "{}",
            refused.trip.evidence
        );
        // Another failure between breaks the run; so does a different refusal.
        let mut g = SessionGuard::new(config());
        g.ended(t0, &refused_by_provider(9, false));
        g.ended(t0, &refused_by_provider(9, false));
        g.ended(t0, &Outcome::Failed);
        g.ended(t0, &refused_by_provider(9, false));
        assert_eq!(g.state().phase(), Phase::Recovering);
        g.record(t0, false);
        g.ended(t0, &refused_by_provider(9, false));
        g.ended(t0, &refused_by_provider(8, false));
        g.ended(t0, &refused_by_provider(9, false));
        assert_eq!(g.state().phase(), Phase::Recovering);
        // A success ends it.
        g.record(t0, false);
        assert_eq!(g.restart(), None, "nothing left to remember");
        // A credential failure trips at once.
        let mut g = SessionGuard::new(config());
        assert_eq!(
            g.ended(t0, &refused_by_provider(1, true)),
            Some((Phase::Active, Phase::Tripped))
        );
    }

    #[test]
    fn a_guided_request_that_fails_or_meets_an_outage_was_no_guidance() {
        let t0 = Instant::now();
        // It failed: the same request again is guided again, note and all.
        let mut g = SessionGuard::new(guiding());
        assert!(g.admit(t0, &looping(3, 1), 0.0).0.is_ok());
        assert_eq!(
            g.ended(t0, &Outcome::Failed),
            Some((Phase::Guided, Phase::Recovering))
        );
        assert_eq!(g.restart().unwrap().guided_at, [None, None]);
        let (verdict, change) = g.admit(t0, &looping(3, 1), 0.0);
        assert!(verdict.is_ok());
        assert_eq!(change, Some((Phase::Recovering, Phase::Guided)));
        // Answered, then sent again as it was (its answer dropped): the loop again.
        g.record(t0, false);
        let refused = g.admit(t0, &looping(3, 1), 0.0).0.unwrap_err();
        assert_eq!(refused.trip.rule, TripRule::ToolLoopLimit);

        // An outage: waiting, and the rule may guide again.
        let mut g = SessionGuard::new(guiding());
        for _ in 0..2 {
            assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        }
        assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        assert_eq!(g.state().phase(), Phase::Guided);
        let wait = Outcome::Unavailable {
            retry_after: Duration::from_secs(5),
            request: 42,
        };
        assert_eq!(g.ended(t0, &wait), Some((Phase::Guided, Phase::Waiting)));
        assert_eq!(g.restart().unwrap().guided_at, [None, None]);
    }

    /// An agent told to come back sends the same request again: while the session
    /// waits, and after, that is no loop.
    #[test]
    fn requests_refused_by_an_outage_are_not_repeats() {
        let t0 = Instant::now();
        let mut g = SessionGuard::new(config());
        let wait = Outcome::Unavailable {
            retry_after: Duration::from_secs(5),
            request: 42,
        };
        for k in 0..10 {
            let now = t0 + Duration::from_secs(k);
            assert!(g.admit(now, &fp(42), 0.0).0.is_ok(), "resend {k}");
            g.ended(now, &wait);
        }
        assert_eq!(g.counts().recent.len(), 0, "none of them was sent");
        assert!(g.admit(t0, &fp(42), 0.0).0.is_ok());
        assert_eq!(
            g.record(t0, false),
            Some((Phase::Waiting, Phase::Recovered))
        );
        // While waiting, even repeats counted before the outage do not fire.
        let mut h = SessionGuard::new(config());
        for _ in 0..3 {
            assert!(h.admit(t0, &fp(7), 0.0).0.is_ok());
            h.record(t0, true);
        }
        h.ended(
            t0,
            &Outcome::Unavailable {
                retry_after: Duration::from_secs(5),
                request: 1,
            },
        );
        assert!(
            h.admit(t0, &fp(7), 0.0).0.is_ok(),
            "the fourth, while waiting"
        );
    }
}
