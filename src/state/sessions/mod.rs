//! Live session-guard state: one [`SessionGuard`] and a bounded recovery trace per
//! (tenant, session), for tenants that configure `[tenants.guard]`. Sessions are per
//! tenant: the same id under two tenants is two sessions. Idle sessions leave memory
//! (never while a request holds them), but an operator's close and an active trip are
//! kept in the store ([`SessionGuards::persist`]) and read back when the session returns, after
//! idle eviction or a restart.
//!
//! Where a guard's state lives is its backend's ([`GuardBackend`], chosen once in
//! `app.rs`): this process's memory ([`LocalGuards`]), or a store the replicas share,
//! written back compare-and-set ([`ReplicaGuards`]).
//!
//! Kept or shared state in a format this build does not read (written by a newer
//! release during a rolling upgrade, see [`crate::store::format`]) is never taken for an
//! active session: the session's requests are refused on this replica until it can read
//! it, and nothing of it is overwritten, except by an operator's close or reset.

mod local;
mod replica;

use std::{
    collections::HashMap,
    future::Future,
    marker::PhantomData,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use futures_util::future::BoxFuture;
use serde_json::{json, Value};
use tokio::time::Instant;

pub use self::{local::LocalGuards, replica::ReplicaGuards};
use crate::{
    clock::Clock,
    config::Config,
    policy::{
        budget::SessionSeen,
        guard::{restore_trip, GuardPolicy, Kept, SessionGuard, Transition, Trip},
        restart::Outcome,
    },
    state::{
        guard_view::{self, Write, Written},
        live::{GuardedSession, LiveSessions, Session, SessionKey, TraceEntry},
        restarts::Restarts,
    },
    store::{
        format::{self, UnknownFormat},
        GuardRecord, GuardStates, StoreError,
    },
};

/// How a guard's write-back went ([`SessionGuards::update_with`]), with what the saver
/// decided besides (`T`).
pub enum Saving<T> {
    /// Written, taking the shared state from one version to the next.
    Saved(Written, T),
    /// Another replica wrote first (or, for a joined request, the shared state would not
    /// admit it): its version and state (nothing was written).
    Moved(u64, String),
    /// Not written, and what the update did is undone: the request was refused before
    /// the guard counted it.
    Undone(T),
    /// Not written (unreachable, or not shared): this replica's guard decided.
    Local(T),
}

impl<T> Saving<T> {
    /// How the write went, apart from what the saver decided besides (none when moved).
    fn split(self) -> (Saving<()>, Option<T>) {
        match self {
            Saving::Saved(written, t) => (Saving::Saved(written, ()), Some(t)),
            Saving::Moved(version, state) => (Saving::Moved(version, state), None),
            Saving::Undone(t) => (Saving::Undone(()), Some(t)),
            Saving::Local(t) => (Saving::Local(()), Some(t)),
        }
    }
}

/// A failure's write-back offered two ways ([`SessionGuards::record_failure`]), for
/// the round trip that writes it to pick: compare-and-set at `version`, of `recorded`
/// (the failure recorded) or, when that round trip trips the session, of the failure
/// recorded and the trip imposed: `tripped`, that state cut at its marks, for what the
/// round trip counted to go between the parts (`None`: imposing changes nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidates {
    pub version: u64,
    pub recorded: String,
    pub tripped: Option<Vec<String>>,
    /// How long the state outlives its last write.
    pub ttl_ms: u64,
}

/// The session an update runs on: its tenant's policy and its live entry.
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub tenant: &'a Arc<str>,
    pub session: &'a str,
    pub entry: &'a Mutex<GuardedSession>,
    pub config: &'a Arc<GuardPolicy>,
}

/// An update of a session's guard as a backend runs it: on the guard (again, on a
/// newer state, when a write-back lost a race), then written back.
pub trait GuardUpdate: Send {
    /// Runs the update on `guard`; what the last run decided is the update's answer.
    fn run(&mut self, guard: &mut SessionGuard, now: Instant);

    /// Whether the update writes itself back ([`GuardUpdate::save`]: an admission,
    /// whose write goes with its limits); else a backend's own store takes the write.
    fn writes(&self) -> bool;

    /// Writes `write` back (`None`: nothing to write, the rest, if any, decided alone).
    fn save(&mut self, write: Option<Write>) -> BoxFuture<'_, Saving<()>>;
}

/// A failure's write-back in the round trip that counts it ([`SessionGuards::record_failure`]).
pub trait FailureWrite: Send {
    /// The round trip, given both states: how the write went.
    fn write(&mut self, candidates: Candidates) -> BoxFuture<'_, Saving<()>>;

    /// The trip that round trip decided to impose, once it ran.
    fn imposed(&self) -> Option<(Trip, Duration)>;
}

/// What became of a failure offered to the round trip that counts it.
pub enum Folded {
    /// Recorded, in that round trip or (when another replica wrote first) by the usual
    /// write: the guard's transition.
    Recorded(Option<Transition>),
    /// Not offered (no such round trip, or the tripped state could not be cut at its
    /// marks): record it the usual way.
    Apart,
}

/// Where the guards' state lives: one implementation of the guard's write-back, chosen
/// once in `app.rs`. The rules are [`SessionGuard`]'s, the same under each.
pub trait GuardBackend: Send + Sync {
    /// Runs `update` on the session's guard and writes back what it changed; `request`:
    /// the update admits that request (fingerprint), `replace`: it replaces the state
    /// (an operator's close or reset), over a shared state this build cannot read too.
    /// Shared state this build cannot read is otherwise an error, `update` not run.
    fn apply<'a>(
        &'a self,
        at: At<'a>,
        update: &'a mut dyn GuardUpdate,
        request: Option<u64>,
        replace: bool,
    ) -> BoxFuture<'a, Result<(), UnknownFormat>>;

    /// A failure recorded in the write-back of the round trip that decides whether
    /// `trip` is imposed (its evidence holding `marks`): see
    /// [`SessionGuards::record_failure`].
    fn record_failure<'a>(
        &'a self,
        at: At<'a>,
        failure: &'a Outcome,
        trip: &'a (Trip, Duration),
        marks: &'a [&'a str],
        write: &'a mut dyn FailureWrite,
    ) -> BoxFuture<'a, Result<Folded, UnknownFormat>>;

    /// Records how a request ended without a write-back, when none is needed (`seen`:
    /// the shared state as the settle of the request's last call saw it); `false`:
    /// nothing recorded, the outcome is to be written by [`GuardBackend::apply`].
    fn records_quietly(
        &self,
        entry: &mut GuardedSession,
        outcome: &Outcome,
        seen: Option<SessionSeen>,
    ) -> bool;

    /// The session's shared state as it is now: its version and state (`None`: none, or
    /// none to be read).
    fn shared_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> BoxFuture<'a, Option<(u64, String)>>;

    /// Whether a request reads the session's spend before its admission, for the
    /// guard's spend samples (else what the session's last settle saw of it).
    fn reads_spend(&self, policy: &GuardPolicy) -> bool;
}

/// An update's closures behind [`GuardUpdate`]: `f` on the guard, written back by
/// `save` (none: by the backend's store), with what they decided.
struct Typed<F, S, Fut, R, T> {
    f: F,
    save: Option<S>,
    result: Option<R>,
    kept: Option<T>,
    /// `save`'s future, named so that it lives as long as the update.
    saving: PhantomData<fn() -> Fut>,
}

/// The writer of an update that has none.
type NoWriter = fn(Option<Write>) -> std::future::Ready<Saving<()>>;

impl<F, R> Typed<F, NoWriter, std::future::Ready<Saving<()>>, R, ()> {
    /// An update written back by the backend's store.
    fn alone(f: F) -> Self {
        Typed::new(f, None)
    }
}

impl<F, S, Fut, R, T> Typed<F, S, Fut, R, T> {
    fn new(f: F, save: Option<S>) -> Self {
        Typed {
            f,
            save,
            result: None,
            kept: None,
            saving: PhantomData,
        }
    }

    /// What the update's last run decided.
    fn ran(&mut self) -> R {
        self.result
            .take()
            .expect("every backend runs an update it answers Ok for")
    }
}

impl<F, S, Fut, R, T> GuardUpdate for Typed<F, S, Fut, R, T>
where
    F: Fn(&mut SessionGuard, Instant) -> R + Send,
    S: Fn(Option<Write>) -> Fut + Send,
    Fut: Future<Output = Saving<T>> + Send,
    R: Send,
    T: Send,
{
    fn run(&mut self, guard: &mut SessionGuard, now: Instant) {
        self.result = Some((self.f)(guard, now));
    }

    fn writes(&self) -> bool {
        self.save.is_some()
    }

    fn save(&mut self, write: Option<Write>) -> BoxFuture<'_, Saving<()>> {
        let Typed { save, kept, .. } = self;
        let Some(save) = save else {
            return Box::pin(std::future::ready(Saving::Local(())));
        };
        let saving = save(write);
        Box::pin(async move {
            let (saving, t) = saving.await.split();
            if t.is_some() {
                *kept = t;
            }
            saving
        })
    }
}

/// A failure's round trip behind [`FailureWrite`], with what it decided.
struct FailureTyped<W, I, V, Fut> {
    write: Option<W>,
    imposed: I,
    verdict: Option<V>,
    /// `write`'s future, named so that it lives as long as the write.
    writing: PhantomData<fn() -> Fut>,
}

impl<W, I, V, Fut> FailureWrite for FailureTyped<W, I, V, Fut>
where
    W: FnOnce(Candidates) -> Fut + Send,
    I: Fn(&V) -> Option<(Trip, Duration)> + Send,
    Fut: Future<Output = (V, Saving<()>)> + Send,
    V: Send,
{
    fn write(&mut self, candidates: Candidates) -> BoxFuture<'_, Saving<()>> {
        let write = self.write.take().expect("a failure's round trip runs once");
        let verdict = &mut self.verdict;
        Box::pin(async move {
            let (decided, saving) = write(candidates).await;
            *verdict = Some(decided);
            saving
        })
    }

    fn imposed(&self) -> Option<(Trip, Duration)> {
        self.verdict.as_ref().and_then(&self.imposed)
    }
}

pub struct SessionGuards {
    configs: HashMap<String, Arc<GuardPolicy>>,
    /// Counts reloads: a session whose policy is from an older one takes the current one
    /// when next used here (never an older one, from a request still in flight).
    generation: u64,
    sessions: LiveSessions<Session>,
    /// Where closes and trips are kept.
    store: Arc<dyn GuardStates>,
    backend: Arc<dyn GuardBackend>,
    clock: Clock,
    /// A session's shared state is forgotten after this long unused, as its memory is.
    idle: Duration,
    /// How well the tenants' restarts work (kept across reloads).
    restarts: Arc<Restarts>,
}

/// Each guarded tenant's policy.
fn policies(config: &Config) -> HashMap<String, Arc<GuardPolicy>> {
    config
        .tenants
        .iter()
        .filter_map(|t| {
            t.guard
                .as_ref()
                .map(|g| (t.name.clone(), Arc::new(g.policy())))
        })
        .collect()
}

/// A live session's guard, holding the session in memory (see [`Session`]).
#[derive(Clone)]
pub struct GuardRef(Arc<Session>);

impl std::ops::Deref for GuardRef {
    type Target = Mutex<GuardedSession>;

    fn deref(&self) -> &Mutex<GuardedSession> {
        self.0
            .guard
            .get()
            .expect("a GuardRef is only made for a loaded guard")
    }
}

/// Records how a request ended and imposes a trip decided outside the session, if any:
/// the guard's transition over both.
fn record_imposing(
    guard: &mut SessionGuard,
    now: Instant,
    outcome: &Outcome,
    imposed: Option<&(Trip, Duration)>,
) -> Option<Transition> {
    let Some((trip, cool_down)) = imposed else {
        return guard.ended(now, outcome);
    };
    let from = guard.state().phase();
    guard.ended(now, outcome);
    guard.impose(now, trip.clone(), *cool_down);
    let to = guard.state().phase();
    (from != to).then_some((from, to))
}

pub fn lock(entry: &Mutex<GuardedSession>) -> MutexGuard<'_, GuardedSession> {
    entry.lock().unwrap_or_else(|e| e.into_inner())
}

impl SessionGuards {
    /// Guards whose state is this process's own ([`LocalGuards`]); see
    /// [`SessionGuards::with_backend`].
    pub fn new(config: &Config, idle: Duration, store: Arc<dyn GuardStates>, clock: Clock) -> Self {
        SessionGuards {
            configs: policies(config),
            generation: 0,
            sessions: LiveSessions::new(idle, &clock),
            store,
            backend: Arc::new(LocalGuards::new(clock.clone())),
            clock,
            idle,
            restarts: Arc::default(),
        }
    }

    /// The guards with their restarts counted in `restarts`.
    pub fn counting(mut self, restarts: Arc<Restarts>) -> Self {
        self.restarts = restarts;
        self
    }

    /// How well the tenants' restarts work.
    pub fn restarts(&self) -> &Restarts {
        &self.restarts
    }

    /// The guards with their state where `backend` keeps it.
    pub fn with_backend(mut self, backend: Arc<dyn GuardBackend>) -> Self {
        self.backend = backend;
        self
    }

    /// The guards under a new config (a reload): the new tenants' policies over the same
    /// live sessions, so counters, windows, trips and closes carry on. A tenant whose
    /// guard is removed is no longer guarded; one that gets a guard starts one per session.
    pub fn reconfigured(&self, config: &Config) -> Self {
        SessionGuards {
            configs: policies(config),
            generation: self.generation + 1,
            sessions: self.sessions.clone(),
            store: self.store.clone(),
            backend: self.backend.clone(),
            clock: self.clock.clone(),
            idle: self.idle,
            restarts: self.restarts.clone(),
        }
    }

    /// Now, on the clock the guards' cool-downs and windows run on.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Now on the wall clock (ms since the epoch), for what reports show.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The tenant's guard policy, if it has one.
    pub fn policy(&self, tenant: &str) -> Option<&Arc<GuardPolicy>> {
        self.configs.get(tenant)
    }

    pub fn is_guarded(&self, tenant: &str) -> bool {
        self.configs.contains_key(tenant)
    }

    /// What the store kept of a session, as of now; an error for a record this build
    /// cannot read (a close or trip of a newer release's, most likely).
    async fn kept(&self, tenant: &str, session: &str) -> Result<Option<Kept>, UnknownFormat> {
        match self.kept_record(tenant, session).await {
            Ok(kept) => Ok(kept),
            Err(StoreError::UnknownFormat(unknown)) => Err(unknown),
            Err(err) => {
                // The guard protects against loops, not money: a session whose kept
                // state cannot be read starts fresh (budgets still fail closed).
                tracing::error!(tenant, session, error = %err, "cannot read a session's guard state");
                Ok(None)
            }
        }
    }

    async fn kept_record(&self, tenant: &str, session: &str) -> Result<Option<Kept>, StoreError> {
        let Some(record) = self.store.guard_state(tenant, session).await? else {
            return Ok(None);
        };
        let trip = restore_trip(&record.code, &record.rule, record.evidence);
        Ok(Some(if record.closed {
            Kept::Closed
        } else {
            let left = record.until_ms.saturating_sub(self.clock.now_ms()).max(0);
            Kept::Tripped {
                remaining: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
                trip,
            }
        }))
    }

    /// `update` on the session's guard, by its backend ([`GuardBackend::apply`]); a
    /// session whose tenant's guard a reload removed runs it alone.
    async fn apply(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        update: &mut dyn GuardUpdate,
        request: Option<u64>,
        replace: bool,
    ) -> Result<(), UnknownFormat> {
        let Some(config) = self.configs.get(&**tenant) else {
            update.run(&mut lock(entry).guard, self.clock.now());
            return Ok(());
        };
        let at = At {
            tenant,
            session,
            entry,
            config,
        };
        self.backend.apply(at, update, request, replace).await
    }

    /// Runs `f` on a session's guard. With a store shared by replicas, what `f` changed
    /// is written back only if no other replica changed the shared state meanwhile (else
    /// the guard is brought up to the shared state and `f` runs again), so every rule
    /// counts every replica's requests. When the store cannot be reached, or races go on,
    /// this replica's own guard decides. Shared state this build cannot read is an error:
    /// `f` is not run and nothing is written.
    pub async fn update<R: Send>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        f: impl Fn(&mut SessionGuard, Instant) -> R + Send,
    ) -> Result<R, UnknownFormat> {
        let mut update = Typed::alone(f);
        self.apply(tenant, session, entry, &mut update, None, false)
            .await?;
        Ok(update.ran())
    }

    /// [`SessionGuards::update`] of an admission: `f` admits (or refuses) the request
    /// whose fingerprint is `request`, and the write-back is done by `save` (given what
    /// to write; `None`: nothing to write), which may decide more in the same round trip
    /// (the request's limits) and may undo what `f` did ([`Saving::Undone`]). In replica
    /// mode a request admitted with nothing else changed is joined to the shared state
    /// as it is, whichever replica wrote it last: only when the shared state would not
    /// admit it is it handed back and the request decided again on it. With this
    /// process's own guards, `save` is asked first, with nothing to write, and `f` runs
    /// after it unless it refused. What `save` decided is `None` only when it could not
    /// be asked (races went on) or the tenant's guard is gone.
    pub async fn update_with<R, T, Fut>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        f: impl Fn(&mut SessionGuard, Instant) -> R + Send,
        request: u64,
        save: impl Fn(Option<Write>) -> Fut + Send,
    ) -> Result<(R, Option<T>), UnknownFormat>
    where
        Fut: Future<Output = Saving<T>> + Send,
        R: Send,
        T: Send,
    {
        let mut update = Typed::new(f, Some(save));
        self.apply(tenant, session, entry, &mut update, Some(request), false)
            .await?;
        Ok((update.ran(), update.kept))
    }

    /// Records how an admitted request ended ([`SessionGuard::record`]), and imposes a
    /// trip decided outside the session (`imposed`: the fleet's, with its cool-down;
    /// [`SessionGuard::impose`]) in the same write. The write-back is skipped when the
    /// backend needs none ([`GuardBackend::records_quietly`], as the settle of the
    /// request's last call saw the shared state: `seen`).
    pub async fn record(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        outcome: &Outcome,
        seen: Option<SessionSeen>,
        imposed: Option<(Trip, Duration)>,
    ) -> Result<Option<Transition>, UnknownFormat> {
        if let Some(imposed) = imposed {
            return self
                .update(tenant, session, entry, |guard, now| {
                    record_imposing(guard, now, outcome, Some(&imposed))
                })
                .await;
        }
        let quiet = self.is_guarded(tenant)
            && self
                .backend
                .records_quietly(&mut lock(entry), outcome, seen);
        if quiet {
            return Ok(None);
        }
        self.update(tenant, session, entry, |guard, now| {
            guard.ended(now, outcome)
        })
        .await
    }

    /// [`SessionGuards::record`] of a failure in replica mode when the round trip that
    /// writes it back also decides whether a trip is imposed (the fleet's count, with
    /// `trip` as the trip it would impose, its evidence holding `marks` in place of what
    /// that round trip counts). `write` is that round trip, given both states
    /// ([`Candidates`]); it answers what it decided (`V`, of which `imposed` tells the
    /// trip) and how the write went. It runs once: when another replica wrote the
    /// shared state first, the failure (and the trip it decided, if any) is written
    /// again by the plain compare-and-set, never counted again. Unreachable, as
    /// [`SessionGuards::record`]. `None` (and `write` not run): the tenant's guard does
    /// not share its state, or the tripped state does not hold each mark exactly once
    /// (a description quoting one): record it the usual way.
    #[allow(clippy::too_many_arguments)]
    pub async fn record_failure<V, Fut>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        failure: &Outcome,
        trip: &(Trip, Duration),
        marks: &[&str],
        write: impl FnOnce(Candidates) -> Fut + Send,
        imposed: impl Fn(&V) -> Option<(Trip, Duration)> + Send,
    ) -> Result<Option<(V, Option<Transition>)>, UnknownFormat>
    where
        Fut: Future<Output = (V, Saving<()>)> + Send,
        V: Send,
    {
        let Some(config) = self.configs.get(&**tenant) else {
            return Ok(None);
        };
        let at = At {
            tenant,
            session,
            entry,
            config,
        };
        let mut write = FailureTyped {
            write: Some(write),
            imposed,
            verdict: None,
            writing: PhantomData,
        };
        match self
            .backend
            .record_failure(at, failure, trip, marks, &mut write)
            .await?
        {
            Folded::Recorded(change) => {
                let verdict = write
                    .verdict
                    .expect("a failure recorded in its round trip ran it");
                Ok(Some((verdict, change)))
            }
            Folded::Apart => Ok(None),
        }
    }

    /// Whether a request reads the session's spend before its admission, for the
    /// guard's spend samples ([`GuardBackend::reads_spend`]).
    pub fn reads_spend(&self, tenant: &str) -> bool {
        self.configs
            .get(tenant)
            .is_some_and(|policy| self.backend.reads_spend(policy))
    }

    /// How long a guard's shared state outlives its last use.
    pub fn shared_ttl_ms(&self) -> u64 {
        u64::try_from(self.idle.as_millis()).unwrap_or(u64::MAX)
    }

    /// The session's guard, created on first use (with what the store kept of it);
    /// `None` when the tenant has no guard; an error when what the store kept of it is
    /// in a format this build does not read (nothing is created then: the next request
    /// reads it again).
    pub async fn entry(
        &self,
        tenant: &Arc<str>,
        session: &str,
    ) -> Result<Option<GuardRef>, UnknownFormat> {
        self.load(tenant, session, false).await
    }

    /// [`SessionGuards::entry`], or, with `replace` (an operator's close or reset), a
    /// fresh guard in place of a kept state this build cannot read.
    async fn load(
        &self,
        tenant: &Arc<str>,
        session: &str,
        replace: bool,
    ) -> Result<Option<GuardRef>, UnknownFormat> {
        let Some(config) = self.configs.get(&**tenant) else {
            return Ok(None);
        };
        let live = self
            .sessions
            .get_or_load((tenant.clone(), session.to_string()), || async {
                Ok::<_, UnknownFormat>(Session::default())
            })
            .await?;
        if live.guard.get().is_none() {
            let kept = match self.kept(tenant, session).await {
                Ok(kept) => kept,
                Err(_) if replace => None,
                Err(unknown) => return Err(unknown),
            };
            let guard = match kept {
                Some(kept) => SessionGuard::restored(config.clone(), kept, self.clock.now()),
                None => SessionGuard::new(config.clone()),
            };
            // Another request may have made it meanwhile: the first one set is kept.
            let _ = live
                .guard
                .set(Mutex::new(GuardedSession::new(guard, self.generation)));
        }
        let entry = GuardRef(live);
        {
            let mut e = lock(&entry);
            if e.generation < self.generation {
                e.guard.set_policy(config.clone());
                e.generation = self.generation;
            }
        }
        Ok(Some(entry))
    }

    /// Writes what must outlive memory of a session's state (a close or a trip), or
    /// forgets it once the session is active again.
    pub async fn persist(
        &self,
        tenant: &str,
        session: &str,
        kept: Option<Kept>,
    ) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let (closed, until_ms, trip) = match kept {
            None => return self.store.clear_guard(tenant, session).await,
            Some(Kept::Closed) => (
                true,
                0,
                restore_trip(
                    "session_tripped",
                    "closed",
                    "an operator closed this session".into(),
                ),
            ),
            Some(Kept::Tripped { remaining, trip }) => (
                false,
                now.saturating_add(i64::try_from(remaining.as_millis()).unwrap_or(i64::MAX)),
                trip,
            ),
        };
        self.store
            .save_guard(GuardRecord {
                tenant: tenant.to_string(),
                session: session.to_string(),
                closed,
                until_ms,
                code: trip.code().as_str().to_string(),
                rule: trip.rule.as_str().to_string(),
                evidence: trip.evidence,
                updated_ms: now,
            })
            .await
    }

    /// Signals (counters, risk) and the trace, for the admin API. With a shared state
    /// ([`GuardBackend::shared_state`]) the signals are its (this replica's guard may be
    /// behind it: requests joined through other replicas are not loaded into it until it
    /// writes whole).
    pub async fn report(&self, tenant: &str, session: &str, session_usd: f64) -> Option<Value> {
        let tenant: Arc<str> = tenant.into();
        let entry = match self.entry(&tenant, session).await {
            Ok(entry) => entry?,
            Err(unknown) => return Some(json!({"unreadable": unknown.to_string()})),
        };
        let shared = match self.configs.get(&*tenant) {
            Some(config) => self
                .backend
                .shared_state(&tenant, session)
                .await
                .map(|(version, state)| (config.clone(), version, state)),
            None => None,
        };
        let entry = lock(&entry);
        let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
        let signals = match shared.filter(|(_, version, _)| *version != entry.version()) {
            Some((config, _, state)) => match format::decode_snapshot(&state) {
                Ok(snap) => {
                    let guard = guard_view::from_snapshot(config, snap, now, now_ms);
                    guard_view::signals(&guard, now, session_usd, entry.tool_loop())
                }
                Err(unknown) => return Some(json!({"unreadable": unknown.to_string()})),
            },
            None => entry.signals(now, session_usd),
        };
        Some(json!({
            "signals": signals,
            "trace": entry.trace.iter().map(TraceEntry::to_json).collect::<Vec<_>>(),
            "transitions": entry.changes_json(),
        }))
    }

    /// Every guarded session in memory now, in no order.
    pub fn live(&self) -> Vec<(SessionKey, GuardRef)> {
        self.sessions
            .list()
            .into_iter()
            .filter(|(_, live)| live.guard.get().is_some())
            .map(|(key, live)| (key, GuardRef(live)))
            .collect()
    }

    /// The guards kept in the same live sessions as the budget books (one map entry a
    /// session for both); the sessions' idle time is theirs.
    pub fn sharing(mut self, sessions: &LiveSessions<Session>) -> Self {
        self.sessions = sessions.clone();
        self
    }

    /// An operator closes a session for good (kept in the store first: a close that
    /// could not be kept is an error, not a close that lasts until the next restart).
    /// `false`: the tenant has no guard.
    pub async fn close(&self, tenant: &str, session: &str) -> Result<bool, StoreError> {
        let tenant: Arc<str> = tenant.into();
        // A close replaces whatever was kept or shared, readable by this build or not.
        let Ok(Some(entry)) = self.load(&tenant, session, true).await else {
            return Ok(false);
        };
        self.persist(&tenant, session, Some(Kept::Closed)).await?;
        let mut update = Typed::alone(|guard: &mut SessionGuard, _| guard.close());
        let change = match self
            .apply(&tenant, session, &entry, &mut update, None, true)
            .await
        {
            Ok(()) => update.ran(),
            Err(_) => None,
        };
        if let Some((from, to)) = change {
            tracing::warn!(%tenant, session, from = from.label(), to = to.label(), "session closed by an operator");
        }
        Ok(true)
    }

    pub async fn reset(&self, tenant: &str, session: &str) -> Result<(), StoreError> {
        let tenant: Arc<str> = tenant.into();
        // As a close, a reset replaces whatever was kept or shared.
        if let Ok(Some(entry)) = self.load(&tenant, session, true).await {
            self.persist(&tenant, session, None).await?;
            // With `replace`, never refused.
            let mut update = Typed::alone(|guard: &mut SessionGuard, _| guard.reset());
            let _ = self
                .apply(&tenant, session, &entry, &mut update, None, true)
                .await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sessions_book_and_guard_share_one_live_entry() {
        use crate::{state::budgets::Budgets, store::SqliteStore};
        let text = r#"
            [[upstreams]]
            name = "u"
            api = "openai"
            base_url = "http://127.0.0.1:1"
            [[routes]]
            model = "*"
            targets = [{ upstream = "u" }]
            [[tenants]]
            name = "guarded"
            api_keys = ["bk-test-key-1"]
            [tenants.guard]
            max_consecutive_failures = 3
            [[tenants]]
            name = "plain"
            api_keys = ["bk-test-key-2"]
        "#;
        let config = Config::from_toml_with_env(text, |_| None).unwrap();
        let store = Arc::new(SqliteStore::open(":memory:").unwrap());
        let idle = Duration::from_secs(600);
        let budgets = Arc::new(Budgets::new(&config, store.clone(), idle, Clock::system()));
        let guards =
            SessionGuards::new(&config, idle, store, Clock::system()).sharing(budgets.live());
        for tenant in ["guarded", "plain"] {
            let tenant: Arc<str> = tenant.into();
            budgets.check_rate(&tenant, Some("s")).await.unwrap();
            budgets.session_usd(&tenant, "s").await;
            let entry = guards.entry(&tenant, "s").await.unwrap();
            assert_eq!(entry.is_some(), &*tenant == "guarded");
        }
        // One entry a session, whichever part made it first.
        assert_eq!(budgets.live().len(), 2);
        let books = budgets.live_sessions();
        assert_eq!(books.len(), 2, "both sessions have a book");
        let guarded = guards.live();
        assert_eq!(
            guarded.len(),
            1,
            "only the guarded tenant's session has a guard"
        );
        assert_eq!(&*guarded[0].0 .0, "guarded");
        // A guard made before the book: the book is loaded into the same entry.
        let tenant: Arc<str> = "guarded".into();
        guards.entry(&tenant, "g").await.unwrap().unwrap();
        budgets.session_usd(&tenant, "g").await;
        assert_eq!(budgets.live().len(), 3);
        assert_eq!((budgets.live_sessions().len(), guards.live().len()), (3, 2));
    }
}
