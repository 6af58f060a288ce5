//! Early failure prediction across a tenant's sessions, with the clock passed in: when
//! enough sessions fail the same way, the next session failing that way is tripped at
//! its first such failure, and (with `preempt`) a request of the same shape is refused
//! before its first attempt. Rules, not a model: what fired is always one signature and
//! the sessions that shared it.
//!
//! A failed request's [`Signature`] is what repeats across sessions and nothing unique
//! to one: the route and model, the endpoint, the request's normalised [`Shape`] (the
//! system prompt's hash and the last user message's template with numbers and ids
//! masked, read by `api::signature`), and how it failed ([`FailureKind`]: class, code,
//! detail). Its id is XXH3-64 of a versioned text of those fields, so replicas and
//! releases name it alike (docs/fleet-prediction.md specifies it).
//!
//! [`TenantView`] counts, per signature, the distinct sessions that failed with it within
//! `window`, and how often each did. A signature is *hot* once `min_sessions` sessions
//! have each failed with it at least `min_failures` times within the window; then any
//! session's failure with it trips that session. A hot signature cools down when a
//! request of its shape succeeds: with `preempt`, one such request is let through as a
//! probe per `cool_down`. Each trip or refusal is a prediction, later confirmed (the
//! session failed that way again) or not (its next request of that shape succeeded).
//!
//! Memory is bounded per tenant, with exact counts only (no sketch whose collisions
//! could make a false trip): a signature's first failure is kept as a small record (its
//! id, the session, when, what it cost) in a table of [`SINGLES`], pushed out oldest
//! first; a signature that fails a second time within the window becomes a full entry
//! (its description, every session's count, its state and record), at most
//! [`EXACT_SIGNATURES`] of them, the least shared non-hot one making room for a new one.
//! What is pushed out loses its counts, so a flood of distinct failures can cost recall,
//! never cause a false trip. `state::fleet` keeps the same view in Redis for replicas; its
//! scripts follow this module's rules.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::Duration,
};

/// Signatures seen failing once, per tenant (16 bytes of id and session each, and when).
pub const SINGLES: usize = 65_536;
/// Signatures seen failing more than once, counted in full, per tenant.
pub const EXACT_SIGNATURES: usize = 8192;
/// Sessions whose failures one signature keeps (the most recent).
pub const SESSIONS_PER_SIGNATURE: usize = 1024;
/// Predictions awaiting their verdict per signature (the oldest are dropped, counted as
/// expired).
pub const PREDICTIONS_PER_SIGNATURE: usize = 1024;
/// Session records (failure counts and pending predictions) per tenant, all signatures
/// together: past it, the signature holding the most gives up its oldest.
pub const RECORDS_PER_TENANT: usize = 131_072;
/// `[tenants.guard.fleet]`, as the rule reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetPolicy {
    pub min_sessions: u32,
    pub min_failures: u32,
    pub window: Duration,
    pub preempt: bool,
    pub cool_down: Duration,
}

impl FleetPolicy {
    pub fn window_ms(&self) -> i64 {
        ms(self.window)
    }

    pub fn cool_down_ms(&self) -> i64 {
        ms(self.cool_down)
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// XXH3-64 with seed 0 (the reference `XXH3_64bits`), the hash of every fleet id.
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// A session as the fleet view keeps it: the hash of its id.
pub fn session_key(session: &str) -> u64 {
    xxh3(session.as_bytes())
}

/// A request's normalised shape: the part of a signature known before the request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShapeKey(pub u64);

/// A failure signature's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SignatureId(pub u64);

impl std::fmt::Display for SignatureId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl std::fmt::Display for ShapeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What a request looks like across sessions (`api::signature::shape` reads it).
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub key: ShapeKey,
    /// The route's `model` (a pattern) and the model asked for.
    pub route: String,
    pub model: String,
    /// The endpoint's path.
    pub endpoint: &'static str,
    /// XXH3-64 of the masked system prompt.
    pub system: u64,
    /// The last user message with numbers and ids masked, at most
    /// `api::signature::NORMALISED_BYTES` of it.
    pub template: String,
}

impl Shape {
    /// The key of these fields: XXH3-64 of
    /// `shape/1\n{route}\n{model}\n{endpoint}\n{system:016x}\n{template}`.
    pub fn key_of(
        route: &str,
        model: &str,
        endpoint: &str,
        system: u64,
        template: &str,
    ) -> ShapeKey {
        let text = format!("shape/1\n{route}\n{model}\n{endpoint}\n{system:016x}\n{template}");
        ShapeKey(xxh3(text.as_bytes()))
    }
}

/// How a request failed, as its signature names it.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureKind {
    /// `caller_fault`, `malformed` or `loop`.
    pub class: &'static str,
    /// The upstream's error code (`context_length_exceeded`), `http_<status>` when it
    /// named none, or Backstop's code (`output_invalid`, `loop_detected`, ...).
    pub code: String,
    /// What else repeats: `HTTP 400`, the output contract's hash and the first error
    /// path, a tool's name and the hash of its result.
    pub detail: String,
}

/// A failure signature: its id, the shape it is preempted by, and itself in words.
#[derive(Debug, Clone, PartialEq)]
pub struct Signature {
    pub id: SignatureId,
    pub shape: ShapeKey,
    pub description: Arc<str>,
}

/// The template's first characters, as the description quotes them.
const PREVIEW_CHARS: usize = 80;

impl Signature {
    /// The id is XXH3-64 of `signature/1\n{shape key:016x}\n{class}\n{code}\n{detail}`.
    pub fn new(shape: &Shape, failure: &FailureKind) -> Signature {
        let text = format!(
            "signature/1\n{}\n{}\n{}\n{}",
            shape.key, failure.class, failure.code, failure.detail
        );
        let mut preview: String = shape.template.chars().take(PREVIEW_CHARS).collect();
        if shape.template.chars().nth(PREVIEW_CHARS).is_some() {
            preview.push('…');
        }
        let description = format!(
            "{} ({}, {}) from model {} (route {}) on {}; system prompt {:08x}, last user message \"{}\"",
            failure.code,
            failure.class,
            failure.detail,
            shape.model,
            shape.route,
            shape.endpoint,
            shape.system >> 32,
            preview,
        );
        Signature {
            id: SignatureId(xxh3(text.as_bytes())),
            shape: shape.key,
            description: description.into(),
        }
    }
}

/// Where a signature is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SignatureState {
    /// Counting: not enough sessions yet.
    Warm,
    /// Trips every session failing with it; with `preempt`, refuses its shape until
    /// `probe_at_ms`, when one request goes through.
    Hot { since_ms: i64, probe_at_ms: i64 },
    /// A request of its shape succeeded: counting starts over.
    Cooled { at_ms: i64 },
}

impl SignatureState {
    pub fn label(self) -> &'static str {
        match self {
            SignatureState::Warm => "warm",
            SignatureState::Hot { .. } => "hot",
            SignatureState::Cooled { .. } => "cooled",
        }
    }
}

/// The prediction's own record, per signature (and summed per tenant).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Record {
    /// Sessions tripped by a failure with the signature while it was hot.
    pub tripped: u64,
    /// Requests refused before their first attempt (`preempt`).
    pub preempted: u64,
    /// Predicted sessions that failed that way again.
    pub confirmed: u64,
    /// Predicted sessions whose next request of that shape succeeded.
    pub unconfirmed: u64,
    /// Upstream calls and USD the refusals avoided: each refused request is taken to
    /// cost what the signature's failures cost on average.
    pub avoided_calls: f64,
    pub avoided_usd: f64,
}

impl Record {
    pub fn add(&mut self, other: &Record) {
        self.tripped += other.tripped;
        self.preempted += other.preempted;
        self.confirmed += other.confirmed;
        self.unconfirmed += other.unconfirmed;
        self.avoided_calls += other.avoided_calls;
        self.avoided_usd += other.avoided_usd;
    }
}

/// A hot signature, as a trip or a refusal names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Hot {
    pub id: SignatureId,
    pub description: Arc<str>,
    /// Distinct sessions that failed with it within the window.
    pub sessions: u32,
    /// Of those, the ones that failed with it at least `min_failures` times.
    pub qualified: u32,
    /// Until its next probe (`preempt`).
    pub retry_after: Duration,
}

/// What a trip's evidence holds in place of its counts (sessions, then qualified
/// sessions) when it is written before they are known ([`Hot::evidence_marked`]): plain
/// ASCII, so a state holding it holds it verbatim.
pub const EVIDENCE_MARKS: [&str; 2] = ["@fleet-sessions@", "@fleet-qualified@"];

impl Hot {
    /// The trip's evidence: the signature in words and how many sessions shared it.
    pub fn evidence(&self, policy: &FleetPolicy) -> String {
        evidence(
            &self.sessions,
            &self.qualified,
            self.id,
            &self.description,
            policy,
        )
    }

    /// The evidence of a trip by signature `id` whose counts are not known yet: the
    /// [`EVIDENCE_MARKS`] in their place, for the script that counts the failure to put
    /// them in (as decimal integers, which makes it [`Hot::evidence`]).
    pub fn evidence_marked(id: SignatureId, description: &str, policy: &FleetPolicy) -> String {
        let [sessions, qualified] = EVIDENCE_MARKS;
        evidence(&sessions, &qualified, id, description, policy)
    }
}

fn evidence(
    sessions: &dyn std::fmt::Display,
    qualified: &dyn std::fmt::Display,
    id: SignatureId,
    description: &str,
    policy: &FleetPolicy,
) -> String {
    format!(
        "{sessions} sessions of this tenant failed the same way within {} ({qualified} of them at least {} times): signature {id}: {description}",
        humantime::format_duration(policy.window),
        policy.min_failures,
    )
}

/// A failure, counted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Failed {
    /// The signature is hot: trip the session.
    pub trip: Option<Hot>,
    /// The session had been predicted to fail this way.
    pub confirmed: bool,
    /// Not counted: the table is full and the signature is not frequent enough yet.
    pub untracked: bool,
}

/// The preemptive check of a request's shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Check {
    Clear,
    /// A hot signature's probe: the one request of its shape let through this cool-down.
    Probe(SignatureId),
    Refuse(Hot),
}

/// A request of a watched shape succeeded.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Succeeded {
    /// Hot signatures of that shape that cooled down.
    pub cooled: u32,
    /// The session had been predicted to fail that way.
    pub unconfirmed: bool,
}

/// A signature's first failure.
#[derive(Debug, Clone, Copy)]
struct Single {
    session: u64,
    at_ms: i64,
    calls: u32,
    usd: f64,
}

#[derive(Debug, Clone, Copy)]
struct SessionCount {
    session: u64,
    failures: u32,
    last_ms: i64,
}

#[derive(Debug)]
struct Entry {
    shape: ShapeKey,
    description: Arc<str>,
    first_ms: i64,
    /// The last failure, or state change.
    last_ms: i64,
    failures: u64,
    failure_calls: u64,
    failure_usd: f64,
    sessions: Vec<SessionCount>,
    /// (session, when): predicted to fail this way, verdict pending.
    predicted: Vec<(u64, i64)>,
    state: SignatureState,
    record: Record,
}

impl Entry {
    fn watched(&self) -> bool {
        matches!(self.state, SignatureState::Hot { .. }) || !self.predicted.is_empty()
    }

    fn qualified(&self, min_failures: u32) -> u32 {
        self.sessions
            .iter()
            .filter(|s| s.failures >= min_failures)
            .count() as u32
    }

    fn hot(&self, id: SignatureId, policy: &FleetPolicy, now_ms: i64) -> Hot {
        let retry_after = match self.state {
            SignatureState::Hot { probe_at_ms, .. } => (probe_at_ms - now_ms).max(0),
            _ => 0,
        };
        Hot {
            id,
            description: self.description.clone(),
            sessions: self.sessions.len() as u32,
            qualified: self.qualified(policy.min_failures),
            retry_after: Duration::from_millis(retry_after as u64),
        }
    }
}

/// What a tenant's view holds besides its signatures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals {
    /// Session trips by reason (every rule of the guard, `fleet_pattern` included).
    pub trips_by_reason: BTreeMap<String, u64>,
    /// Failures not counted (the table full, the signature too rare so far).
    pub untracked: u64,
    /// Predictions forgotten before a verdict (their signature went quiet for a window,
    /// or made room).
    pub expired: u64,
    /// The records of signatures no longer counted: with the counted ones', the
    /// tenant's whole record.
    pub past: Record,
}

/// One signature, for the admin API and the dashboard.
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureReport {
    pub id: SignatureId,
    pub description: Arc<str>,
    pub state: SignatureState,
    pub sessions: u32,
    pub qualified: u32,
    pub failures: u64,
    pub first_ms: i64,
    pub last_ms: i64,
    pub pending: u32,
    pub record: Record,
}

/// A tenant's view: its signatures and the prediction's record.
#[derive(Debug)]
pub struct TenantView {
    policy: Arc<FleetPolicy>,
    entries: HashMap<SignatureId, Entry>,
    /// Hot signatures and those with predictions pending, by shape: what a request's
    /// shape is looked up in (empty: no shape is hashed on the success path).
    watch: HashMap<ShapeKey, Vec<SignatureId>>,
    records: usize,
    /// Signatures seen failing once (not in `entries`).
    singles: HashMap<SignatureId, Single>,
    /// `singles` in the order they came (an id whose single is gone, or came again
    /// later, is skipped when reached).
    singles_order: std::collections::VecDeque<(SignatureId, i64)>,
    purged_ms: i64,
    totals: Totals,
}

impl TenantView {
    pub fn new(policy: Arc<FleetPolicy>) -> TenantView {
        TenantView {
            policy,
            entries: HashMap::new(),
            watch: HashMap::new(),
            records: 0,
            singles: HashMap::new(),
            singles_order: std::collections::VecDeque::new(),
            purged_ms: i64::MIN,
            totals: Totals::default(),
        }
    }

    /// A reloaded config's rule; the counts carry on.
    pub fn set_policy(&mut self, policy: Arc<FleetPolicy>) {
        self.policy = policy;
    }

    pub fn policy(&self) -> &Arc<FleetPolicy> {
        &self.policy
    }

    /// Whether a request's shape is worth reading: a signature is hot, or a prediction
    /// awaits its verdict.
    pub fn watching(&self) -> bool {
        !self.watch.is_empty()
    }

    /// Signatures counted exactly now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn stale(&self, entry: &Entry, now_ms: i64) -> bool {
        now_ms.saturating_sub(entry.last_ms) > self.policy.window_ms()
    }

    fn rewatch(&mut self, id: SignatureId) {
        let Some(entry) = self.entries.get(&id) else {
            return;
        };
        let (shape, watched) = (entry.shape, entry.watched());
        let ids = self.watch.entry(shape).or_default();
        match (watched, ids.iter().position(|i| *i == id)) {
            (true, None) => ids.push(id),
            (false, Some(at)) => {
                ids.swap_remove(at);
            }
            _ => {}
        }
        if ids.is_empty() {
            self.watch.remove(&shape);
        }
    }

    fn forget(&mut self, id: SignatureId) {
        let Some(entry) = self.entries.remove(&id) else {
            return;
        };
        self.records -= entry.sessions.len() + entry.predicted.len();
        self.totals.expired += entry.predicted.len() as u64;
        self.totals.past.add(&entry.record);
        if let Some(ids) = self.watch.get_mut(&entry.shape) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.watch.remove(&entry.shape);
            }
        }
    }

    /// Drops every signature quiet for longer than the window.
    pub fn purge(&mut self, now_ms: i64) {
        let stale: Vec<SignatureId> = self
            .entries
            .iter()
            .filter(|(_, e)| self.stale(e, now_ms))
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.forget(id);
        }
        let window = self.policy.window_ms();
        while let Some((id, at)) = self.singles_order.front().copied() {
            if now_ms.saturating_sub(at) <= window {
                break;
            }
            self.singles_order.pop_front();
            if self.singles.get(&id).is_some_and(|s| s.at_ms == at) {
                self.singles.remove(&id);
            }
        }
        self.purged_ms = now_ms;
    }

    fn maybe_purge(&mut self, now_ms: i64) {
        let every = (self.policy.window_ms() / 8).max(1000);
        if now_ms.saturating_sub(self.purged_ms) >= every {
            self.purge(now_ms);
        }
    }

    /// Keeps a signature's first failure; the oldest single makes room.
    fn single(&mut self, id: SignatureId, single: Single) {
        while self.singles.len() >= SINGLES {
            let Some((old, at)) = self.singles_order.pop_front() else {
                break;
            };
            if self.singles.get(&old).is_some_and(|s| s.at_ms == at) {
                self.singles.remove(&old);
            }
        }
        self.singles.insert(id, single);
        self.singles_order.push_back((id, single.at_ms));
        // Ids that came again leave stale places behind: drop them before they pile up.
        if self.singles_order.len() > 2 * SINGLES {
            let singles = &self.singles;
            self.singles_order
                .retain(|(id, at)| singles.get(id).is_some_and(|s| s.at_ms == *at));
        }
    }

    /// A place for one more full entry, if there is one: the least shared signature that
    /// is not hot makes room (a hot one is never pushed out).
    fn admit(&mut self, now_ms: i64) -> bool {
        if self.entries.len() < EXACT_SIGNATURES {
            return true;
        }
        self.purge(now_ms);
        if self.entries.len() < EXACT_SIGNATURES {
            return true;
        }
        let min_failures = self.policy.min_failures;
        let victim = self
            .entries
            .iter()
            .filter(|(_, e)| !matches!(e.state, SignatureState::Hot { .. }))
            .min_by_key(|(_, e)| (e.qualified(min_failures), e.sessions.len(), e.last_ms))
            .map(|(id, _)| *id);
        match victim {
            Some(victim) => {
                self.forget(victim);
                true
            }
            None => false,
        }
    }

    /// Room for one more session record in the tenant: the signature holding the most
    /// gives up its oldest.
    fn reclaim(&mut self) {
        if self.records < RECORDS_PER_TENANT {
            return;
        }
        let Some((_, entry)) = self
            .entries
            .iter_mut()
            .max_by_key(|(_, e)| e.sessions.len().max(e.predicted.len()))
        else {
            return;
        };
        if entry.sessions.len() >= entry.predicted.len() {
            if let Some(at) = (0..entry.sessions.len()).min_by_key(|i| entry.sessions[*i].last_ms) {
                entry.sessions.swap_remove(at);
                self.records -= 1;
            }
        } else if !entry.predicted.is_empty() {
            entry.predicted.remove(0);
            self.records -= 1;
            self.totals.expired += 1;
        }
    }

    fn predict(&mut self, id: SignatureId, session: u64, now_ms: i64) {
        let has = self
            .entries
            .get(&id)
            .is_some_and(|e| e.predicted.iter().any(|(s, _)| *s == session));
        if has {
            return;
        }
        self.reclaim();
        let Some(entry) = self.entries.get_mut(&id) else {
            return;
        };
        if entry.predicted.len() >= PREDICTIONS_PER_SIGNATURE {
            entry.predicted.remove(0);
            self.totals.expired += 1;
        } else {
            self.records += 1;
        }
        entry.predicted.push((session, now_ms));
        self.rewatch(id);
    }

    /// A request of `session` failed with `sig` (`calls` upstream calls, `usd` spent).
    pub fn failed(
        &mut self,
        now_ms: i64,
        sig: &Signature,
        session: u64,
        calls: u32,
        usd: f64,
    ) -> Failed {
        self.maybe_purge(now_ms);
        let id = sig.id;
        if self.entries.get(&id).is_some_and(|e| self.stale(e, now_ms)) {
            self.forget(id);
        }
        if !self.entries.contains_key(&id) {
            let window = self.policy.window_ms();
            let first = match self.singles.remove(&id) {
                Some(first) if now_ms.saturating_sub(first.at_ms) <= window => first,
                _ => {
                    // Its first failure (in the window): kept small until it repeats.
                    let single = Single {
                        session,
                        at_ms: now_ms,
                        calls,
                        usd,
                    };
                    self.single(id, single);
                    return Failed::default();
                }
            };
            if !self.admit(now_ms) {
                self.totals.untracked += 1;
                self.single(id, first);
                return Failed {
                    untracked: true,
                    ..Failed::default()
                };
            }
            self.reclaim();
            self.entries.insert(
                id,
                Entry {
                    shape: sig.shape,
                    description: sig.description.clone(),
                    first_ms: first.at_ms,
                    last_ms: first.at_ms,
                    failures: 1,
                    failure_calls: u64::from(first.calls),
                    failure_usd: first.usd,
                    sessions: vec![SessionCount {
                        session: first.session,
                        failures: 1,
                        last_ms: first.at_ms,
                    }],
                    predicted: Vec::new(),
                    state: SignatureState::Warm,
                    record: Record::default(),
                },
            );
            self.records += 1;
        }
        let window = self.policy.window_ms();
        let has_record = self
            .entries
            .get(&id)
            .is_some_and(|e| e.sessions.iter().any(|s| s.session == session));
        if !has_record {
            self.reclaim();
        }
        let policy = self.policy.clone();
        let Some(entry) = self.entries.get_mut(&id) else {
            return Failed::default();
        };
        entry.last_ms = now_ms;
        entry.failures += 1;
        entry.failure_calls += u64::from(calls);
        entry.failure_usd += usd;
        let before = entry.sessions.len();
        entry
            .sessions
            .retain(|s| now_ms.saturating_sub(s.last_ms) <= window);
        self.records -= before - entry.sessions.len();
        match entry.sessions.iter_mut().find(|s| s.session == session) {
            Some(record) => {
                record.failures = record.failures.saturating_add(1);
                record.last_ms = now_ms;
            }
            None => {
                if entry.sessions.len() >= SESSIONS_PER_SIGNATURE {
                    if let Some(at) =
                        (0..entry.sessions.len()).min_by_key(|i| entry.sessions[*i].last_ms)
                    {
                        entry.sessions.swap_remove(at);
                        self.records -= 1;
                    }
                }
                entry.sessions.push(SessionCount {
                    session,
                    failures: 1,
                    last_ms: now_ms,
                });
                self.records += 1;
            }
        }
        let mut failed = Failed::default();
        if let Some(at) = entry.predicted.iter().position(|(s, _)| *s == session) {
            entry.predicted.remove(at);
            self.records -= 1;
            entry.record.confirmed += 1;
            failed.confirmed = true;
        }
        let hot = match entry.state {
            SignatureState::Hot { .. } => true,
            SignatureState::Warm | SignatureState::Cooled { .. } => {
                if entry.qualified(policy.min_failures) >= policy.min_sessions {
                    entry.state = SignatureState::Hot {
                        since_ms: now_ms,
                        probe_at_ms: now_ms + policy.cool_down_ms(),
                    };
                    true
                } else {
                    false
                }
            }
        };
        if hot {
            entry.record.tripped += 1;
            failed.trip = Some(entry.hot(id, &policy, now_ms));
            self.predict(id, session, now_ms);
        }
        self.rewatch(id);
        failed
    }

    /// A request of `session` with shape `shape` is about to run (`preempt`): refused if
    /// the shape is a hot signature's, unless it is that signature's probe.
    pub fn check(&mut self, now_ms: i64, shape: ShapeKey, session: u64) -> Check {
        let Some(ids) = self.watch.get(&shape).cloned() else {
            return Check::Clear;
        };
        let cool_down = self.policy.cool_down_ms();
        for id in ids {
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            if now_ms.saturating_sub(entry.last_ms) > self.policy.window_ms() {
                continue;
            }
            let SignatureState::Hot {
                since_ms,
                probe_at_ms,
            } = entry.state
            else {
                continue;
            };
            if now_ms >= probe_at_ms {
                entry.state = SignatureState::Hot {
                    since_ms,
                    probe_at_ms: now_ms + cool_down,
                };
                return Check::Probe(id);
            }
            entry.record.preempted += 1;
            let hot = entry.hot(id, &self.policy, now_ms);
            self.predict(id, session, now_ms);
            return Check::Refuse(hot);
        }
        Check::Clear
    }

    /// A request of `session` with shape `shape` succeeded: the hot signatures of that
    /// shape cool down, and a prediction of that session's failure was wrong.
    pub fn succeeded(&mut self, now_ms: i64, shape: ShapeKey, session: u64) -> Succeeded {
        self.maybe_purge(now_ms);
        let Some(ids) = self.watch.get(&shape).cloned() else {
            return Succeeded::default();
        };
        let mut out = Succeeded::default();
        for id in ids {
            let Some(entry) = self.entries.get_mut(&id) else {
                continue;
            };
            if let Some(at) = entry.predicted.iter().position(|(s, _)| *s == session) {
                entry.predicted.remove(at);
                self.records -= 1;
                entry.record.unconfirmed += 1;
                out.unconfirmed = true;
            }
            if matches!(entry.state, SignatureState::Hot { .. }) {
                entry.state = SignatureState::Cooled { at_ms: now_ms };
                entry.last_ms = now_ms;
                self.records -= entry.sessions.len();
                entry.sessions.clear();
                out.cooled += 1;
            }
            self.rewatch(id);
        }
        out
    }

    /// `requests` refused because of `id` (a preemption, or a session it tripped): the
    /// calls and spend they would have cost, as its failures did on average.
    pub fn avoided(&mut self, id: SignatureId, requests: u32) {
        if let Some(entry) = self.entries.get_mut(&id) {
            let n = entry.failures.max(1) as f64;
            let requests = f64::from(requests);
            entry.record.avoided_calls += requests * entry.failure_calls as f64 / n;
            entry.record.avoided_usd += requests * entry.failure_usd / n;
        }
    }

    /// A session of the tenant was tripped, for `reason`.
    pub fn tripped(&mut self, reason: &str) {
        *self
            .totals
            .trips_by_reason
            .entry(reason.to_string())
            .or_default() += 1;
    }

    pub fn totals(&self) -> &Totals {
        &self.totals
    }

    /// Every signature counted now (quiet ones left out), hot first, then by sessions.
    pub fn report(&self, now_ms: i64) -> Vec<SignatureReport> {
        let mut out: Vec<SignatureReport> = self
            .entries
            .iter()
            .filter(|(_, e)| !self.stale(e, now_ms))
            .map(|(id, e)| SignatureReport {
                id: *id,
                description: e.description.clone(),
                state: e.state,
                sessions: e
                    .sessions
                    .iter()
                    .filter(|s| now_ms.saturating_sub(s.last_ms) <= self.policy.window_ms())
                    .count() as u32,
                qualified: e.qualified(self.policy.min_failures),
                failures: e.failures,
                first_ms: e.first_ms,
                last_ms: e.last_ms,
                pending: e.predicted.len() as u32,
                record: e.record,
            })
            .collect();
        sort_reports(&mut out);
        out
    }
}

/// Hot first, then by sessions, then most recent.
pub fn sort_reports(reports: &mut [SignatureReport]) {
    reports.sort_by(|a, b| {
        let hot = |r: &SignatureReport| matches!(r.state, SignatureState::Hot { .. });
        hot(b)
            .cmp(&hot(a))
            .then(b.sessions.cmp(&a.sessions))
            .then(b.last_ms.cmp(&a.last_ms))
            .then(a.id.cmp(&b.id))
    });
}

/// Sums the records of `reports`.
pub fn total_record(reports: &[SignatureReport]) -> Record {
    let mut sum = Record::default();
    for r in reports {
        sum.add(&r.record);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn policy() -> FleetPolicy {
        FleetPolicy {
            min_sessions: 3,
            min_failures: 2,
            window: Duration::from_secs(600),
            preempt: true,
            cool_down: Duration::from_secs(60),
        }
    }

    fn shape(template: &str) -> Shape {
        let key = Shape::key_of("gpt-*", "gpt-4o", "/v1/chat/completions", 7, template);
        Shape {
            key,
            route: "gpt-*".into(),
            model: "gpt-4o".into(),
            endpoint: "/v1/chat/completions",
            system: 7,
            template: template.into(),
        }
    }

    fn compaction() -> Signature {
        Signature::new(
            &shape("summarize the conversation so far in # words."),
            &FailureKind {
                class: "caller_fault",
                code: "context_length_exceeded".into(),
                detail: "HTTP 400".into(),
            },
        )
    }

    /// The wall clock of a paused tokio clock, as `Clock` derives it.
    fn now_ms(clock: &crate::clock::Clock) -> i64 {
        clock.now_ms()
    }

    #[test]
    fn ids_are_specified_hashes_of_the_fields() {
        let sig = compaction();
        // XXH3-64 of the documented texts; `xxhsum -H3` computes the same.
        let shape_text = "shape/1\ngpt-*\ngpt-4o\n/v1/chat/completions\n0000000000000007\nsummarize the conversation so far in # words.";
        assert_eq!(sig.shape, ShapeKey(xxh3(shape_text.as_bytes())));
        let text = format!(
            "signature/1\n{}\ncaller_fault\ncontext_length_exceeded\nHTTP 400",
            sig.shape
        );
        assert_eq!(sig.id, SignatureId(xxh3(text.as_bytes())));
        assert_eq!(
            format!("{}", sig.shape),
            format!("{:016x}", xxh3(shape_text.as_bytes()))
        );
        assert!(
            sig.description.starts_with(
                "context_length_exceeded (caller_fault, HTTP 400) from model gpt-4o (route gpt-*) on /v1/chat/completions"
            ),
            "{}",
            sig.description
        );
    }

    /// Three sessions failing twice each make the signature hot; the fourth session is
    /// tripped on its first such failure. One failure each, or failures outside the
    /// window, make nothing hot. Counted on a paused clock.
    #[tokio::test(start_paused = true)]
    async fn the_windowed_counts_decide_when_a_signature_is_hot() {
        let clock = crate::clock::Clock::starting_at(1_700_000_000_000);
        let mut view = TenantView::new(Arc::new(policy()));
        let sig = compaction();
        // Ten sessions failing once each: no session has failed twice.
        for s in 0..10 {
            let f = view.failed(now_ms(&clock), &sig, 100 + s, 1, 0.01);
            assert_eq!(f.trip, None);
        }
        // Sessions 1 and 2 fail twice; session 3 fails twice, but its first failure is
        // outside the window by the time of its second.
        for s in [1, 2] {
            for _ in 0..2 {
                assert_eq!(view.failed(now_ms(&clock), &sig, s, 1, 0.01).trip, None);
            }
        }
        assert_eq!(view.failed(now_ms(&clock), &sig, 3, 1, 0.01).trip, None);
        tokio::time::advance(Duration::from_secs(601)).await;
        // The window moved on: sessions 1 and 2's counts are gone too, and session 3's
        // failure is the signature's first again (a single, not reported).
        assert_eq!(view.failed(now_ms(&clock), &sig, 3, 1, 0.01).trip, None);
        assert!(view.report(now_ms(&clock)).is_empty());
        // Within one window: 1 and 2 twice, 3 once more; the third to qualify is tripped.
        tokio::time::advance(Duration::from_secs(10)).await;
        for s in [1, 2] {
            for _ in 0..2 {
                assert_eq!(view.failed(now_ms(&clock), &sig, s, 1, 0.01).trip, None);
            }
        }
        let third = view.failed(now_ms(&clock), &sig, 3, 1, 0.01);
        let hot = third
            .trip
            .expect("the third qualifying session makes it hot");
        assert_eq!((hot.sessions, hot.qualified), (3, 3));
        assert_eq!(hot.retry_after, Duration::from_secs(60));
        // A new session's first failure trips it at once.
        tokio::time::advance(Duration::from_secs(5)).await;
        let next = view.failed(now_ms(&clock), &sig, 4, 1, 0.01);
        let hot = next.trip.expect("hot: the first failure trips");
        assert_eq!((hot.sessions, hot.qualified), (4, 3));
        assert_eq!(hot.retry_after, Duration::from_secs(55));
        assert!(hot
            .evidence(&policy())
            .starts_with("4 sessions of this tenant failed the same way within 10m (3 of them at least 2 times): signature "));
        // Another signature of the same shape is counted apart.
        let other = Signature::new(
            &shape("summarize the conversation so far in # words."),
            &FailureKind {
                class: "caller_fault",
                code: "http_422".into(),
                detail: "HTTP 422".into(),
            },
        );
        assert_eq!(view.failed(now_ms(&clock), &other, 5, 1, 0.0).trip, None);
        assert!(view.watching());
    }

    /// With `preempt`, a hot shape is refused until its probe is due, then exactly one
    /// request goes through per cool-down; its success cools the signature down, and the
    /// predictions are judged: a session that failed again confirms its prediction, one
    /// whose next request succeeded does not.
    /// The evidence written before its counts are known is the evidence once the script
    /// puts them in: the replicas' guard states must not differ by who wrote them.
    #[test]
    fn marked_evidence_filled_in_is_the_evidence() {
        let sig = compaction();
        let hot = Hot {
            id: sig.id,
            description: sig.description.clone(),
            sessions: 12,
            qualified: 3,
            retry_after: Duration::from_secs(9),
        };
        let marked = Hot::evidence_marked(sig.id, &sig.description, &policy());
        let [sessions, qualified] = EVIDENCE_MARKS;
        assert_eq!(
            (
                marked.matches(sessions).count(),
                marked.matches(qualified).count()
            ),
            (1, 1)
        );
        assert!(marked.find(sessions) < marked.find(qualified));
        assert_eq!(
            marked.replace(sessions, "12").replace(qualified, "3"),
            hot.evidence(&policy())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn probes_cool_a_signature_down_and_predictions_are_judged() {
        let clock = crate::clock::Clock::starting_at(1_700_000_000_000);
        let mut view = TenantView::new(Arc::new(policy()));
        let sig = compaction();
        for s in 1..=3 {
            for _ in 0..2 {
                view.failed(now_ms(&clock), &sig, s, 2, 0.5);
            }
        }
        // Session 3 was tripped (predicted). Session 10 is refused before its attempt.
        let Check::Refuse(hot) = view.check(now_ms(&clock), sig.shape, 10) else {
            panic!("a hot shape is refused")
        };
        assert_eq!(hot.id, sig.id);
        assert_eq!(view.check(now_ms(&clock), ShapeKey(1), 10), Check::Clear);
        view.avoided(sig.id, 1);
        // Session 3 fails that way again (after its trip, say on another replica).
        assert!(view.failed(now_ms(&clock), &sig, 3, 2, 0.5).confirmed);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(
            view.check(now_ms(&clock), sig.shape, 11),
            Check::Probe(sig.id)
        );
        // One probe per cool-down: the next is refused.
        assert!(matches!(
            view.check(now_ms(&clock), sig.shape, 12),
            Check::Refuse(_)
        ));
        // The probe fails: still hot, next probe a cool-down later.
        assert!(view.failed(now_ms(&clock), &sig, 11, 2, 0.5).trip.is_some());
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(matches!(
            view.check(now_ms(&clock), sig.shape, 13),
            Check::Refuse(_)
        ));
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(
            view.check(now_ms(&clock), sig.shape, 14),
            Check::Probe(sig.id)
        );
        // The upstream is fixed: the probe succeeds, and session 10's next request too.
        let done = view.succeeded(now_ms(&clock), sig.shape, 14);
        assert_eq!(done.cooled, 1);
        assert!(view.succeeded(now_ms(&clock), sig.shape, 10).unconfirmed);
        assert_eq!(view.check(now_ms(&clock), sig.shape, 15), Check::Clear);
        let report = &view.report(now_ms(&clock))[0];
        assert_eq!(report.state.label(), "cooled");
        assert_eq!(
            (
                report.record.tripped,
                report.record.preempted,
                report.record.confirmed,
                report.record.unconfirmed
            ),
            (3, 3, 1, 1)
        );
        // Each failure cost 2 calls and $0.50: the one refusal credited avoided that.
        assert_eq!(report.record.avoided_calls, 2.0);
        assert_eq!(report.record.avoided_usd, 0.5);
        // Predictions still pending: session 3 (tripped again by its confirming failure),
        // 11 (tripped by its probe), 12 and 13 (refused).
        assert_eq!(report.pending, 4);
        // A quiet window later the signature is forgotten, its pending ones expired.
        tokio::time::advance(Duration::from_secs(601)).await;
        view.purge(now_ms(&clock));
        assert!(view.is_empty() && !view.watching());
        assert_eq!(view.totals().expired, 4);
    }

    /// 100,000 distinct signatures of one session each: the tables stay at their bounds,
    /// and a signature failing in a few sessions among them is counted exactly as in an
    /// empty view.
    #[test]
    fn the_view_is_bounded_and_a_shared_signature_still_gets_in() {
        let mut view = TenantView::new(Arc::new(FleetPolicy {
            min_failures: 1,
            ..policy()
        }));
        let t = 1_700_000_000_000;
        let one_off = |i: u64| {
            Signature::new(
                &shape(&format!("task {i:x}{}", "q".repeat((i % 7) as usize))),
                &FailureKind {
                    class: "caller_fault",
                    code: "http_400".into(),
                    detail: "HTTP 400".into(),
                },
            )
        };
        let sig = compaction();
        let mut trips = Vec::new();
        for i in 0..100_000u64 {
            assert_eq!(view.failed(t + i as i64, &one_off(i), i, 1, 0.0).trip, None);
            // Every 10,000 of them, a session fails the compaction way.
            if i % 10_000 == 5_000 {
                trips.push(
                    view.failed(t + i as i64, &sig, 1_000_000 + i, 1, 0.0)
                        .trip
                        .is_some(),
                );
            }
        }
        assert_eq!(
            trips,
            [false, false, true, true, true, true, true, true, true, true]
        );
        assert_eq!((view.len(), view.singles.len()), (1, SINGLES));
        assert!(view.singles_order.len() <= 2 * SINGLES);
        assert_eq!(view.totals().untracked, 0);
        assert_eq!(view.report(t + 100_000)[0].id, sig.id);
        // Signatures failing twice each fill the full table to its bound, no further.
        for i in 0..(EXACT_SIGNATURES as u64 + 100) {
            for _ in 0..2 {
                view.failed(t + 100_000, &one_off(200_000 + i), 7, 1, 0.0);
            }
        }
        assert_eq!(view.len(), EXACT_SIGNATURES);
        assert!(view.records <= RECORDS_PER_TENANT);
        assert_eq!(view.report(t + 100_000)[0].id, sig.id, "a hot one stays");
    }
}
