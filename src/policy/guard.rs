//! The session guard's state machine and trip rules, with the clock passed in.
//!
//! active → recovering (a request failed; Backstop's own recovery could not save it)
//!        → tripped (a rule fired: refusing until `cool_down`)
//!        → probing (cool-down over: one request admitted)
//!        → active on success, or tripped again on failure; closed by an operator.
//!
//! Rules: consecutive failed requests; the identical request (model + messages + tools)
//! too often in a window; the same tool call answered by the same result too often in the
//! conversation; spend velocity.

use std::{collections::VecDeque, time::Duration};

use serde_json::{json, Value};
use tokio::time::Instant;

/// Requests remembered per session for the identical-request rule.
const RECENT_CAP: usize = 256;

#[derive(Debug, Clone)]
pub struct GuardPolicy {
    pub max_consecutive_failures: u32,
    pub identical_request_limit: u32,
    pub identical_request_window: Duration,
    pub tool_loop_limit: u32,
    pub max_usd_per_minute: Option<f64>,
    pub cool_down: Duration,
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
    /// An operator closed the session.
    Closed,
    /// Read back from the store under a rule name this build does not know.
    Restored(TripCode),
}

impl TripRule {
    pub fn code(self) -> TripCode {
        match self {
            TripRule::IdenticalRequestLimit | TripRule::ToolLoopLimit => TripCode::LoopDetected,
            TripRule::MaxConsecutiveFailures | TripRule::MaxUsdPerMinute | TripRule::Closed => {
                TripCode::SessionTripped
            }
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
}

impl Trip {
    pub fn code(&self) -> TripCode {
        self.rule.code()
    }
}

/// The guard's states without their data: what transitions, logs and metrics name, and
/// what a [`GuardSnapshot`] stores (by [`Phase::label`]; a name this build does not know
/// does not read as any phase).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Active,
    Recovering,
    Tripped,
    Probing,
    Closed,
}

impl Phase {
    pub fn label(self) -> &'static str {
        match self {
            Phase::Active => "active",
            Phase::Recovering => "recovering",
            Phase::Tripped => "tripped",
            Phase::Probing => "probing",
            Phase::Closed => "closed",
        }
    }

    /// A phase whose refusal must outlive the process (it is written to the store).
    pub fn is_kept(self) -> bool {
        matches!(self, Phase::Tripped | Phase::Probing | Phase::Closed)
    }
}

/// A change of phase, `(from, to)`.
pub type Transition = (Phase, Phase);

#[derive(Debug, Clone, PartialEq)]
pub enum GuardState {
    Active,
    Recovering,
    Tripped { until: Instant, trip: Trip },
    Probing { trip: Trip },
    Closed,
}

impl GuardState {
    pub fn phase(&self) -> Phase {
        match self {
            GuardState::Active => Phase::Active,
            GuardState::Recovering => Phase::Recovering,
            GuardState::Tripped { .. } => Phase::Tripped,
            GuardState::Probing { .. } => Phase::Probing,
            GuardState::Closed => Phase::Closed,
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
        "closed" => TripRule::Closed,
        _ if code == "loop_detected" => TripRule::Restored(TripCode::LoopDetected),
        _ => TripRule::Restored(TripCode::SessionTripped),
    };
    Trip { rule, evidence }
}

/// A guard's counted state on the wall clock (ms since the epoch), as replicas share it.
/// Its stored form, with its format version, is `store::format`'s.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardSnapshot {
    pub phase: Phase,
    pub until_ms: i64,
    pub code: Option<String>,
    pub rule: Option<String>,
    pub evidence: Option<String>,
    pub consecutive_failures: u32,
    /// (when, [`RequestFingerprint::request`]), oldest first.
    pub recent: Vec<(i64, u64)>,
    pub spend: Vec<(i64, f64)>,
    pub transitions: u64,
}

#[derive(Debug, Clone)]
pub struct SessionGuard {
    /// Shared by every session of the tenant.
    config: std::sync::Arc<GuardPolicy>,
    state: GuardState,
    consecutive_failures: u32,
    recent: VecDeque<(Instant, u64)>,
    /// (when, session spend total in USD at that time), oldest first.
    spend: VecDeque<(Instant, f64)>,
    transitions: u64,
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
            spend: VecDeque::with_capacity(1),
            transitions: 0,
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
                trip,
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
                trip: trip.clone(),
            }),
            GuardState::Probing { trip } => Some(Kept::Tripped {
                remaining: Duration::ZERO,
                trip: trip.clone(),
            }),
            GuardState::Active | GuardState::Recovering => None,
        }
    }

    pub fn state(&self) -> &GuardState {
        &self.state
    }

    fn set(&mut self, state: GuardState) -> Option<Transition> {
        let from = self.state.phase();
        let to = state.phase();
        self.state = state;
        if from != to {
            self.transitions += 1;
            Some((from, to))
        } else {
            None
        }
    }

    fn trip(&mut self, now: Instant, trip: Trip) -> Option<Transition> {
        self.set(GuardState::Tripped {
            until: now + self.config.cool_down,
            trip,
        })
    }

    fn usd_last_minute(&self, now: Instant, total: f64) -> f64 {
        let minute_ago = now.checked_sub(Duration::from_secs(60));
        let base = self
            .spend
            .iter()
            .rev()
            .find(|(t, _)| minute_ago.is_none_or(|m| *t <= m))
            .or_else(|| self.spend.front())
            .map_or(0.0, |(_, usd)| *usd);
        (total - base).max(0.0)
    }

    /// The session's spend at its latest sample (any replica's, in replica mode).
    pub fn last_spend(&self) -> Option<f64> {
        self.spend.back().map(|(_, usd)| *usd)
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
        while self.spend.len() > 1
            && self
                .spend
                .get(1)
                .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= Duration::from_secs(60))
        {
            self.spend.pop_front();
        }
        // One spend sample a second is enough to find the total a minute ago (the
        // current total is `session_usd` itself), and keeps a busy session's window at
        // about 60 entries.
        if self
            .spend
            .back()
            .is_none_or(|last| now.saturating_duration_since(last.0) >= Duration::from_secs(1))
        {
            self.spend.push_back((now, session_usd));
        }
        match &self.state {
            GuardState::Closed => {
                let trip = Trip {
                    rule: TripRule::Closed,
                    evidence: "an operator closed this session".into(),
                };
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
                        trip: trip.clone(),
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
                        trip: trip.clone(),
                        retry_after: Duration::from_secs(1),
                    }),
                    None,
                );
            }
            GuardState::Active | GuardState::Recovering => {}
        }
        let repeats = self.recent.iter().filter(|(_, h)| *h == fp.request).count() as u32;
        let rule = if repeats >= self.config.identical_request_limit {
            Some(Trip {
                rule: TripRule::IdenticalRequestLimit,
                evidence: format!(
                    "the same request was sent {} times within {}",
                    repeats + 1,
                    humantime::format_duration(window)
                ),
            })
        } else if let Some((call, n)) = fp
            .tool_loop
            .as_ref()
            .filter(|(_, n)| *n >= self.config.tool_loop_limit)
        {
            Some(Trip {
                rule: TripRule::ToolLoopLimit,
                evidence: format!("{call} {n} times"),
            })
        } else {
            self.config.max_usd_per_minute.and_then(|limit| {
                let spent = self.usd_last_minute(now, session_usd);
                (spent >= limit).then(|| Trip {
                    rule: TripRule::MaxUsdPerMinute,
                    evidence: format!("spent ${spent:.4} in the last minute (limit ${limit:.4})"),
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

    /// Records how an admitted request ended. A request admitted before the session was
    /// tripped or closed (by a concurrent request, or an operator) that ends after it
    /// changes nothing: its outcome does not undo a refusal decided meanwhile.
    pub fn record(&mut self, now: Instant, failed: bool) -> Option<Transition> {
        if matches!(self.state, GuardState::Tripped { .. } | GuardState::Closed) {
            return None;
        }
        if !failed {
            self.consecutive_failures = 0;
            return self.set(GuardState::Active);
        }
        self.consecutive_failures += 1;
        if let GuardState::Probing { trip } = &self.state {
            let trip = Trip {
                evidence: format!(
                    "{}; the probe after the cool-down failed too",
                    trip.evidence
                ),
                ..trip.clone()
            };
            return self.trip(now, trip);
        }
        if self.consecutive_failures >= self.config.max_consecutive_failures {
            let trip = Trip {
                rule: TripRule::MaxConsecutiveFailures,
                evidence: format!(
                    "{} requests in a row failed after Backstop's own recovery",
                    self.consecutive_failures
                ),
            };
            return self.trip(now, trip);
        }
        self.set(GuardState::Recovering)
    }

    pub fn close(&mut self) -> Option<Transition> {
        self.set(GuardState::Closed)
    }

    pub fn reset(&mut self) {
        *self = SessionGuard::new(self.config.clone());
    }

    /// Everything the rules count, on the wall clock (`now` is `now_ms`), for replicas
    /// that share a session.
    pub fn snapshot(&self, now: Instant, now_ms: i64) -> GuardSnapshot {
        let at = |t: Instant| {
            now_ms.saturating_sub(
                i64::try_from(now.saturating_duration_since(t).as_millis()).unwrap_or(i64::MAX),
            )
        };
        let (phase, until_ms, trip) = match &self.state {
            GuardState::Active => (Phase::Active, 0, None),
            GuardState::Recovering => (Phase::Recovering, 0, None),
            GuardState::Tripped { until, trip } => (
                Phase::Tripped,
                now_ms.saturating_add(
                    i64::try_from(until.saturating_duration_since(now).as_millis())
                        .unwrap_or(i64::MAX),
                ),
                Some(trip),
            ),
            GuardState::Probing { trip } => (Phase::Probing, 0, Some(trip)),
            GuardState::Closed => (Phase::Closed, 0, None),
        };
        GuardSnapshot {
            phase,
            until_ms,
            code: trip.map(|t| t.code().as_str().to_string()),
            rule: trip.map(|t| t.rule.as_str().to_string()),
            evidence: trip.map(|t| t.evidence.clone()),
            consecutive_failures: self.consecutive_failures,
            recent: self.recent.iter().map(|(t, h)| (at(*t), *h)).collect(),
            spend: self.spend.iter().map(|(t, usd)| (at(*t), *usd)).collect(),
            transitions: self.transitions,
        }
    }

    /// A guard counting from a snapshot taken on another replica.
    pub fn from_snapshot(
        config: impl Into<std::sync::Arc<GuardPolicy>>,
        snap: GuardSnapshot,
        now: Instant,
        now_ms: i64,
    ) -> Self {
        let at = |ms: i64| {
            let ago = u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0);
            now.checked_sub(Duration::from_millis(ago)).unwrap_or(now)
        };
        let trip = || {
            restore_trip(
                snap.code.as_deref().unwrap_or(""),
                snap.rule.as_deref().unwrap_or(""),
                snap.evidence.clone().unwrap_or_default(),
            )
        };
        let state = match snap.phase {
            Phase::Active => GuardState::Active,
            Phase::Recovering => GuardState::Recovering,
            Phase::Tripped => GuardState::Tripped {
                until: now
                    + Duration::from_millis(
                        u64::try_from(snap.until_ms.saturating_sub(now_ms)).unwrap_or(0),
                    ),
                trip: trip(),
            },
            Phase::Probing => GuardState::Probing { trip: trip() },
            Phase::Closed => GuardState::Closed,
        };
        SessionGuard {
            config: config.into(),
            state,
            consecutive_failures: snap.consecutive_failures,
            recent: snap.recent.iter().map(|(ms, h)| (at(*ms), *h)).collect(),
            spend: snap.spend.iter().map(|(ms, usd)| (at(*ms), *usd)).collect(),
            transitions: snap.transitions,
        }
    }

    /// The counters behind the rules and a risk score in [0, 1]: how close the nearest
    /// rule is to firing.
    pub fn signals(&self, now: Instant, session_usd: f64, last_tool_loop: u32) -> Value {
        let (risk, max_repeat, velocity) = self.risk_parts(now, session_usd, last_tool_loop);
        let mut out = json!({
            "state": self.state.label(),
            "consecutive_failures": self.consecutive_failures,
            "max_identical_requests_in_window": max_repeat,
            "tool_loop_count": last_tool_loop,
            "usd_last_minute": super::budget::Usd(velocity),
            "risk": (risk * 100.0).round() / 100.0,
            "transitions": self.transitions,
        });
        match &self.state {
            GuardState::Tripped { until, trip } => {
                out["trip"] = json!({"code": trip.code().as_str(), "rule": trip.rule.as_str(), "evidence": trip.evidence, "probe_in_ms": until.saturating_duration_since(now).as_millis() as u64});
            }
            GuardState::Probing { trip } => {
                out["trip"] = json!({"code": trip.code().as_str(), "rule": trip.rule.as_str(), "evidence": trip.evidence})
            }
            _ => {}
        }
        out
    }

    /// The risk score of [`SessionGuard::signals`] alone (the dashboard sorts thousands
    /// of sessions by it).
    pub fn risk(&self, now: Instant, session_usd: f64, last_tool_loop: u32) -> f64 {
        self.risk_parts(now, session_usd, last_tool_loop).0
    }

    /// (risk, most repeats of one request in the window, USD in the last minute).
    fn risk_parts(&self, now: Instant, session_usd: f64, last_tool_loop: u32) -> (f64, u32, f64) {
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
        let risk = ratios.iter().copied().fold(0.0, f64::max).min(1.0);
        (risk, max_repeat, velocity)
    }
}

/// Canonical JSON of a value's parse (so key order and spacing do not matter).
fn canonical(text: &str) -> String {
    serde_json::from_str::<Value>(text).map_or_else(|_| text.trim().to_string(), |v| v.to_string())
}

fn text_of(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

/// The seed of [`fingerprint`]'s hash.
pub const FINGERPRINT_SEED: u64 = 0;

/// The request's fingerprint: a hash of its normalised model + messages + tools (+ a
/// Responses request's instructions, input and previous response), and the
/// most repeated (tool call, tool result) pair in its history (chat `tool_calls` / `tool`
/// messages, Anthropic `tool_use` / `tool_result` blocks, Responses `function_call` /
/// `function_call_output` input items).
///
/// The hash is compared across replicas and releases (it is kept in the shared
/// [`GuardSnapshot::recent`]), so it is a specified one: XXH3-64 with seed
/// [`FINGERPRINT_SEED`] (0, the reference `XXH3_64bits`, which `xxhsum -H3` computes), of
/// each key present followed by the JSON serde_json writes for its value (keys sorted,
/// no spaces). Not std's `DefaultHasher`, whose algorithm Rust may change in any
/// release; not SHA-256, which runs every request's whole conversation through a
/// cryptographic hash when no adversary is in play (a tenant who forged a collision
/// would only trip its own session). A test pins the value of a fixed request, so a
/// change of algorithm, or of how serde_json writes, cannot go unnoticed.
pub fn fingerprint(json: &serde_json::Map<String, Value>) -> RequestFingerprint {
    use xxhash_rust::xxh3::Xxh3;
    /// Feeds serialised JSON straight into the hasher, without building a string.
    struct HashWriter(Xxh3);
    impl std::io::Write for HashWriter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.update(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut hasher = HashWriter(Xxh3::with_seed(FINGERPRINT_SEED));
    for key in ["model", "system", "messages", "tools"] {
        hasher.0.update(key.as_bytes());
        if let Some(value) = json.get(key) {
            let _ = serde_json::to_writer(&mut hasher, value);
        }
    }
    // The Responses API's conversation (hashed only when present, so a chat request's
    // fingerprint is what it always was): without it every turn of a Responses session
    // would look like the same request repeated.
    for key in ["instructions", "input", "previous_response_id"] {
        if let Some(value) = json.get(key) {
            hasher.0.update(key.as_bytes());
            let _ = serde_json::to_writer(&mut hasher, value);
        }
    }
    let hasher = hasher.0;
    let messages = json
        .get("messages")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    // Tool calls by id: "name(args)".
    let mut calls: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    let mut pairs: std::collections::HashMap<(String, String), (u32, bool)> =
        std::collections::HashMap::new();
    for m in messages {
        for c in m
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let (Some(id), Some(name)) = (
                c.get("id").and_then(Value::as_str),
                c.pointer("/function/name").and_then(Value::as_str),
            ) {
                let args = canonical(
                    c.pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or(""),
                );
                calls.insert(id.to_string(), format!("{name}({args})"));
            }
        }
        if m.get("role").and_then(Value::as_str) == Some("tool") {
            if let Some(call) = m
                .get("tool_call_id")
                .and_then(Value::as_str)
                .and_then(|id| calls.get(id))
            {
                let result = text_of(m.get("content"));
                let error = result.to_ascii_lowercase().contains("error");
                let entry = pairs.entry((call.clone(), result)).or_insert((0, error));
                entry.0 += 1;
            }
        }
        for block in m
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            match block.get("type").and_then(Value::as_str) {
                Some("tool_use") => {
                    if let (Some(id), Some(name)) = (
                        block.get("id").and_then(Value::as_str),
                        block.get("name").and_then(Value::as_str),
                    ) {
                        let input = block.get("input").map(Value::to_string).unwrap_or_default();
                        calls.insert(id.to_string(), format!("{name}({input})"));
                    }
                }
                Some("tool_result") => {
                    if let Some(call) = block
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .and_then(|id| calls.get(id))
                    {
                        let result = text_of(block.get("content"));
                        let error = block
                            .get("is_error")
                            .and_then(Value::as_bool)
                            .unwrap_or(false)
                            || result.to_ascii_lowercase().contains("error");
                        let entry = pairs.entry((call.clone(), result)).or_insert((0, error));
                        entry.0 += 1;
                    }
                }
                _ => {}
            }
        }
    }
    // The Responses API's `input` items: `function_call` (by `call_id`) and its
    // `function_call_output`.
    let items = json
        .get("input")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    for item in items {
        let call_id = item.get("call_id").and_then(Value::as_str);
        match (item.get("type").and_then(Value::as_str), call_id) {
            (Some("function_call"), Some(id)) => {
                if let Some(name) = item.get("name").and_then(Value::as_str) {
                    let args =
                        canonical(item.get("arguments").and_then(Value::as_str).unwrap_or(""));
                    calls.insert(id.to_string(), format!("{name}({args})"));
                }
            }
            (Some("function_call_output"), Some(id)) => {
                if let Some(call) = calls.get(id) {
                    let result = text_of(item.get("output"));
                    let error = result.to_ascii_lowercase().contains("error");
                    let entry = pairs.entry((call.clone(), result)).or_insert((0, error));
                    entry.0 += 1;
                }
            }
            _ => {}
        }
    }
    let tool_loop =
        pairs
            .into_iter()
            .max_by_key(|(_, (n, _))| *n)
            .map(|((call, _), (n, error))| {
                (
                    format!(
                        "{call} returned the same {}",
                        if error { "error" } else { "result" }
                    ),
                    n,
                )
            });
    RequestFingerprint {
        request: hasher.digest(),
        tool_loop,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GuardPolicy {
        GuardPolicy {
            max_consecutive_failures: 5,
            identical_request_limit: 3,
            identical_request_window: Duration::from_secs(600),
            tool_loop_limit: 3,
            max_usd_per_minute: Some(1.0),
            cool_down: Duration::from_secs(60),
        }
    }

    fn fp(request: u64) -> RequestFingerprint {
        RequestFingerprint {
            request,
            tool_loop: None,
        }
    }

    /// A guard carried to another replica as a snapshot goes on counting where it was:
    /// its windows, failures and trip (with the cool-down left) come through, with
    /// the times as far in the past on the other replica's clock.
    #[test]
    fn a_snapshot_carries_every_count_to_another_replica() {
        let t0 = Instant::now() + Duration::from_secs(3600);
        let mut g = SessionGuard::new(config());
        for _ in 0..2 {
            assert!(g.admit(t0, &fp(7), 0.1).0.is_ok());
            g.record(t0, true);
        }
        let later = t0 + Duration::from_secs(30);
        let snap = g.snapshot(later, 1_000_000);
        let json = serde_json::to_string(&snap).unwrap();
        // Another replica, whose monotonic clock reads something else entirely.
        let elsewhere = Instant::now() + Duration::from_secs(7200);
        let mut h = SessionGuard::from_snapshot(
            config(),
            serde_json::from_str(&json).unwrap(),
            elsewhere,
            1_000_000,
        );
        assert_eq!(h.snapshot(elsewhere, 1_000_000), snap);
        // The third identical request is still allowed, the fourth trips: counted across.
        assert!(h.admit(elsewhere, &fp(7), 0.1).0.is_ok());
        let (refused, _) = h.admit(elsewhere, &fp(7), 0.1);
        assert_eq!(
            refused.unwrap_err().trip.rule,
            TripRule::IdenticalRequestLimit
        );
        // The trip and its cool-down come back the same way.
        let tripped = h.snapshot(elsewhere, 1_000_000);
        assert_eq!(tripped.phase, Phase::Tripped);
        assert_eq!(tripped.until_ms, 1_060_000);
        let k = SessionGuard::from_snapshot(config(), tripped, t0, 1_010_000);
        let refused = k.clone().admit(t0, &fp(8), 0.0).0.unwrap_err();
        assert_eq!(refused.retry_after, Duration::from_secs(50));
        // Requests older than the window drop out after the move as before it.
        let mut old = SessionGuard::from_snapshot(config(), snap, t0, 1_000_000 + 601_000);
        for _ in 0..3 {
            assert!(old.admit(t0, &fp(7), 0.0).0.is_ok());
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
    fn a_responses_tool_loop_is_seen_in_input_items() {
        let mut input = vec![json!({"role": "user", "content": "weather in Atlantis"})];
        for i in 0..3 {
            input.push(json!({"type": "function_call", "call_id": format!("c{i}"), "name": "get_weather",
                              "arguments": if i == 1 { r#"{ "city": "Atlantis" }"# } else { r#"{"city":"Atlantis"}"# }}));
            input.push(json!({"type": "function_call_output", "call_id": format!("c{i}"), "output": "Error: city not found"}));
        }
        let Value::Object(m) = json!({"model": "gpt-4o", "input": input}) else {
            unreachable!()
        };
        assert_eq!(
            fingerprint(&m).tool_loop,
            Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.to_string(),
                3
            ))
        );
    }

    /// Fingerprints are compared across replicas and releases (they are kept in the
    /// shared snapshot), so their value is pinned: XXH3-64, seed 0, of what serde_json
    /// writes. The same value, from the reference implementation:
    /// `printf '%s' 'model"gpt-4o"systemmessages[{"content":"hi","role":"user"}]tools' | xxhsum -H3`.
    #[test]
    fn the_fingerprint_of_a_fixed_request_is_pinned() {
        let Value::Object(m) = json!({
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.5,
        }) else {
            unreachable!()
        };
        assert_eq!(
            format!("{:016x}", fingerprint(&m).request),
            "594dc1997f111abb"
        );
    }

    #[test]
    fn responses_turns_have_distinct_fingerprints() {
        let turn = |input: &str| {
            let Value::Object(m) = json!({"model": "gpt-4o", "input": input}) else {
                unreachable!()
            };
            fingerprint(&m).request
        };
        assert_ne!(turn("first question"), turn("second question"));
        assert_eq!(turn("same"), turn("same"));
    }

    #[test]
    fn fingerprints_see_tool_loops_in_both_apis_and_ignore_key_order() {
        let openai = |n: usize| {
            let mut messages = vec![json!({"role": "user", "content": "weather in Atlantis"})];
            for i in 0..n {
                messages.push(json!({"role": "assistant", "tool_calls": [{"id": format!("c{i}"), "type": "function", "function": {"name": "get_weather", "arguments": if i % 2 == 0 { r#"{"city":"Atlantis"}"# } else { r#"{ "city" : "Atlantis" }"# }}}]}));
                messages.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "Error: city not found"}));
            }
            let Value::Object(m) = json!({"model": "gpt-4o", "messages": messages}) else {
                unreachable!()
            };
            m
        };
        let fp = fingerprint(&openai(3));
        assert_eq!(
            fp.tool_loop,
            Some((
                r#"get_weather({"city":"Atlantis"}) returned the same error"#.to_string(),
                3
            ))
        );
        assert_ne!(
            fingerprint(&openai(3)).request,
            fingerprint(&openai(2)).request
        );

        let Value::Object(anthropic) = json!({"model": "claude", "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "nothing", "is_error": true}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "search", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "nothing", "is_error": true}]},
        ]}) else {
            unreachable!()
        };
        assert_eq!(
            fingerprint(&anthropic).tool_loop,
            Some((
                r#"search({"q":"x"}) returned the same error"#.to_string(),
                2
            ))
        );

        let a: serde_json::Map<String, Value> = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":1}"#,
        )
        .unwrap();
        let b: serde_json::Map<String, Value> = serde_json::from_str(
            r#"{"temperature":0.2,"messages":[{"content":"hi","role":"user"}],"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(
            fingerprint(&a).request,
            fingerprint(&b).request,
            "same model + messages + tools"
        );
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
}
