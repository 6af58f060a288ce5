//! Live session-guard state: one [`SessionGuard`] and a bounded recovery trace per
//! (tenant, session), for tenants that configure `[tenants.guard]`. Sessions are per
//! tenant: the same id under two tenants is two sessions. Idle sessions leave memory
//! (never while a request holds them), but an operator's close and an active trip are
//! kept in the store ([`SessionGuards::persist`]) and read back when the session returns, after
//! idle eviction or a restart.
//!
//! Kept or shared state in a format this build does not read (written by a newer
//! release during a rolling upgrade, see [`crate::store::format`]) is never taken for an
//! active session: the session's requests are refused on this replica until it can read
//! it, and nothing of it is overwritten, except by an operator's close or reset.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::{
    clock::Clock,
    config::Config,
    policy::{
        budget::SessionSeen,
        guard::{restore_trip, GuardPolicy, Kept, SessionGuard, Trip},
    },
    state::{
        guard_view::{self, Joined, Write, Written},
        live::{GuardedSession, LiveSessions, Session, SessionKey, TraceEntry},
    },
    store::{
        format::{self, UnknownFormat, WindowWrite},
        GuardRecord, GuardStates, StoreError, WindowSave,
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

/// When the identical-request window that ends at `now_ms` starts (wall clock, ms).
fn window_start(config: &GuardPolicy, now_ms: i64) -> i64 {
    let window = i64::try_from(config.identical_request_window.as_millis()).unwrap_or(i64::MAX);
    now_ms.saturating_sub(window)
}

/// `state` cut at each of `marks`, in order, each found exactly once: the parts around
/// them. `None` when a mark is missing, repeated or out of order.
fn cut(state: &str, marks: &[&str]) -> Option<Vec<String>> {
    let mut parts = Vec::with_capacity(marks.len() + 1);
    let mut rest = state;
    for mark in marks {
        if state.matches(mark).count() != 1 {
            return None;
        }
        let (part, after) = rest.split_once(mark)?;
        parts.push(part.to_string());
        rest = after;
    }
    parts.push(rest.to_string());
    Some(parts)
}

pub struct SessionGuards {
    configs: HashMap<String, Arc<GuardPolicy>>,
    /// Counts reloads: a session whose policy is from an older one takes the current one
    /// when next used here (never an older one, from a request still in flight).
    generation: u64,
    sessions: LiveSessions<Session>,
    store: Arc<dyn GuardStates>,
    clock: Clock,
    /// A session's shared state is forgotten after this long unused, as its memory is.
    idle: Duration,
}

/// How many times a guard update is redone because another replica changed the same
/// session meanwhile, before this replica decides on its own state.
const MAX_RACES: usize = 8;

/// The version of a replica's guard that is not the shared state at any version (a
/// request it holds was refused by the limits after joins beside it): a whole write from
/// it is handed the shared state back.
const UNKNOWN_VERSION: u64 = u64::MAX;

/// A request of a session on its way to the shared state ([`GuardedSession::joining`]),
/// until it is dropped: when the write is answered, or abandoned.
struct OnItsWay<'a>(&'a Mutex<GuardedSession>);

impl Drop for OnItsWay<'_> {
    fn drop(&mut self) {
        lock(self.0).sharing().joining -= 1;
    }
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
    failed: bool,
    imposed: Option<&(Trip, Duration)>,
) -> Option<crate::policy::guard::Transition> {
    let Some((trip, cool_down)) = imposed else {
        return guard.record(now, failed);
    };
    let from = guard.state().phase();
    guard.record(now, failed);
    guard.impose(now, trip.clone(), *cool_down);
    let to = guard.state().phase();
    (from != to).then_some((from, to))
}

pub fn lock(entry: &Mutex<GuardedSession>) -> MutexGuard<'_, GuardedSession> {
    entry.lock().unwrap_or_else(|e| e.into_inner())
}

impl SessionGuards {
    pub fn new(config: &Config, idle: Duration, store: Arc<dyn GuardStates>, clock: Clock) -> Self {
        SessionGuards {
            configs: policies(config),
            generation: 0,
            sessions: LiveSessions::new(idle, &clock),
            store,
            clock,
            idle,
        }
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
            clock: self.clock.clone(),
            idle: self.idle,
        }
    }

    /// Now, on the clock the guards' cool-downs and windows run on.
    pub fn now(&self) -> Instant {
        self.clock.now()
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

    /// Runs `f` on a session's guard. With a store shared by replicas, what `f` changed
    /// is written back only if no other replica changed the shared state meanwhile (else
    /// the guard is brought up to the shared state and `f` runs again), so every rule
    /// counts every replica's requests. When the store cannot be reached, or races go on,
    /// this replica's own guard decides. Shared state this build cannot read is an error:
    /// `f` is not run and nothing is written.
    pub async fn update<R>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        f: impl Fn(&mut SessionGuard, Instant) -> R,
    ) -> Result<R, UnknownFormat> {
        let save = |write: Option<Write>| self.save_window(tenant, session, write);
        Ok(self
            .apply(tenant, session, entry, f, None, save, false)
            .await?
            .0)
    }

    /// [`SessionGuards::update`] of an admission: `f` admits (or refuses) the request
    /// whose fingerprint is `request`, and the write-back is done by `save` (given what
    /// to write; `None` when races went on: write nothing), which may decide more in the
    /// same round trip (the request's limits) and may undo what `f` did
    /// ([`Saving::Undone`]). A request admitted with nothing else changed is joined to the
    /// shared state as it is ([`Joined`]), whichever replica wrote it last: only when
    /// the shared state would not admit it is it handed back and the request decided
    /// again on it. Without shared state, `f` runs alone and `save` is not called.
    pub async fn update_with<R, T, Fut>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        f: impl Fn(&mut SessionGuard, Instant) -> R,
        request: u64,
        save: impl Fn(Option<Write>) -> Fut,
    ) -> Result<(R, Option<T>), UnknownFormat>
    where
        Fut: std::future::Future<Output = Saving<T>>,
    {
        self.apply(tenant, session, entry, f, Some(request), save, false)
            .await
    }

    /// Records how an admitted request ended ([`SessionGuard::record`]), and imposes a
    /// trip decided outside the session (`imposed`: the fleet's, with its cool-down;
    /// [`SessionGuard::impose`]) in the same write. In replica mode the write-back is
    /// skipped when it would change nothing, as the settle of the request's last call saw
    /// the shared state (`seen`): a success of a quiet session (active, no failures in a
    /// row; the common case), whichever replica wrote it last, or an outcome that leaves
    /// the guard as it was when the shared state was still at this replica's version.
    pub async fn record(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        failed: bool,
        seen: Option<SessionSeen>,
        imposed: Option<(Trip, Duration)>,
    ) -> Result<Option<crate::policy::guard::Transition>, UnknownFormat> {
        if let Some(imposed) = imposed {
            return self
                .update(tenant, session, entry, |guard, now| {
                    record_imposing(guard, now, failed, Some(&imposed))
                })
                .await;
        }
        if self.shares(tenant) {
            let mut e = lock(entry);
            if !failed && seen.is_some_and(|s| s.guard_quiet) {
                // Nothing to write. This replica's guard, behind the shared state if
                // another replica wrote since, takes the success too; the change, if any,
                // was the other replica's.
                e.guard.record(self.clock.now(), false);
                return Ok(None);
            }
            if seen.map(|s| s.guard_version) == Some(e.version()) {
                let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
                let before = guard_view::snapshot(&e.guard, now, now_ms);
                let mut after = e.guard.clone();
                let change = after.record(now, failed);
                if change.is_none() && guard_view::snapshot(&after, now, now_ms) == before {
                    return Ok(None);
                }
            }
        }
        self.update(tenant, session, entry, |guard, now| {
            guard.record(now, failed)
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
        trip: &(Trip, Duration),
        marks: &[&str],
        write: impl FnOnce(Candidates) -> Fut,
        imposed: impl Fn(&V) -> Option<(Trip, Duration)>,
    ) -> Result<Option<(V, Option<crate::policy::guard::Transition>)>, UnknownFormat>
    where
        Fut: std::future::Future<Output = (V, Saving<()>)>,
    {
        let Some(config) = self
            .configs
            .get(&**tenant)
            .filter(|_| self.store.is_shared())
        else {
            return Ok(None);
        };
        let turn = lock(entry).sharing().updating.clone();
        let _turn = turn.write_owned().await;
        let (now, before, recorded, candidates) = {
            let mut e = lock(entry);
            let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
            let mut recorded = e.guard.clone();
            let change = recorded.record(now, true);
            let mut tripped = recorded.clone();
            tripped.impose(now, trip.0.clone(), trip.1);
            let state =
                |g: &SessionGuard| format::encode_snapshot(&guard_view::snapshot(g, now, now_ms));
            let recorded_state = state(&recorded);
            let tripped_state = state(&tripped);
            let tripped = if tripped_state == recorded_state {
                // Tripped already, or by this failure: nothing to impose.
                None
            } else {
                match cut(&tripped_state, marks) {
                    Some(parts) => Some(parts),
                    None => return Ok(None),
                }
            };
            let candidates = Candidates {
                version: e.version(),
                recorded: recorded_state,
                tripped,
                ttl_ms: self.shared_ttl_ms(),
            };
            // As a whole write: done here, undone if the write is handed another state.
            let before = std::mem::replace(&mut e.guard, recorded);
            (now, before, change, candidates)
        };
        let (verdict, saving) = write(candidates).await;
        let imposed = imposed(&verdict);
        let f = |guard: &mut SessionGuard, now| record_imposing(guard, now, true, imposed.as_ref());
        let newer = match saving {
            Saving::Saved(written, ()) => {
                let mut e = lock(entry);
                let change = match &imposed {
                    Some((trip, cool_down)) => {
                        e.guard.impose(now, trip.clone(), *cool_down);
                        let (from, to) = (before.state().phase(), e.guard.state().phase());
                        (from != to).then_some((from, to))
                    }
                    None => recorded,
                };
                e.wrote(written.to);
                return Ok(Some((verdict, change)));
            }
            // Another replica wrote first: done again on its state, by the usual write.
            Saving::Moved(version, state) => Some((version, state)),
            // Unreachable: as a write that could not be made, by the usual write (which
            // lets this replica's guard decide while Redis cannot answer).
            Saving::Undone(()) | Saving::Local(()) => None,
        };
        lock(entry).guard = before;
        let save = |write: Option<Write>| self.save_window(tenant, session, write);
        let (change, _) = self
            .write_whole(tenant, session, entry, config, f, save, false, None, newer)
            .await?;
        Ok(Some((verdict, change)))
    }

    /// Whether the tenant's guard watches the session's spend (`max_usd_per_minute`),
    /// for which a request needs the session's spend read before it is admitted.
    pub fn watches_spend(&self, tenant: &str) -> bool {
        self.configs
            .get(tenant)
            .is_some_and(|c| c.max_usd_per_minute.is_some())
    }

    /// Whether this tenant's guards share their state with other replicas.
    pub fn shares(&self, tenant: &str) -> bool {
        self.store.is_shared() && self.configs.contains_key(tenant)
    }

    /// The store's compare-and-set of the guard's shared state (only [`Write::Whole`]:
    /// the store joins no request, see [`SessionGuards::update_with`]).
    async fn save_window(&self, tenant: &str, session: &str, write: Option<Write>) -> Saving<()> {
        let Some(Write::Whole {
            version,
            state,
            window,
        }) = write
        else {
            return Saving::Local(());
        };
        match self
            .store
            .save_guard_window(
                tenant,
                session,
                version,
                state,
                window,
                self.shared_ttl_ms(),
            )
            .await
        {
            Ok(Some(WindowSave::Saved(saved))) => Saving::Saved(
                Written {
                    from: version,
                    to: saved,
                },
                (),
            ),
            Ok(Some(WindowSave::Moved(version, state))) => Saving::Moved(version, state),
            // Unreachable, or not shared after all: this replica's guard decided.
            Ok(None) | Err(_) => Saving::Local(()),
        }
    }

    /// How long a guard's shared state outlives its last use.
    pub fn shared_ttl_ms(&self) -> u64 {
        u64::try_from(self.idle.as_millis()).unwrap_or(u64::MAX)
    }

    /// [`SessionGuards::update_with`] (with `request`: `f` admits it) or
    /// [`SessionGuards::update`], or, with `replace` (an operator's close or reset, which
    /// replaces the state), over shared state this build cannot read as well.
    #[allow(clippy::too_many_arguments)]
    async fn apply<R, T, Fut>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        f: impl Fn(&mut SessionGuard, Instant) -> R,
        request: Option<u64>,
        save: impl Fn(Option<Write>) -> Fut,
        replace: bool,
    ) -> Result<(R, Option<T>), UnknownFormat>
    where
        Fut: std::future::Future<Output = Saving<T>>,
    {
        let Some(config) = self
            .configs
            .get(&**tenant)
            .filter(|_| self.store.is_shared())
        else {
            let mut e = lock(entry);
            return Ok((f(&mut e.guard, self.clock.now()), None));
        };
        let turn = lock(entry).sharing().updating.clone();
        let mut newer: Option<(u64, String)> = None;
        if let Some(request) = request {
            // Joins go together: each is decided on the shared state by the script, so
            // one session's requests on this replica do not wait for each other's round
            // trips. A request that cannot be joined waits for them, and they for it.
            // The replica that wrote the shared state last offers its whole state too
            // (see [`Write::WholeOrJoin`]) when none of the session's requests here is
            // on its way to the shared state: the whole state holds those requests,
            // which would be counted twice if one of them were joined after it. The
            // requests that come while it is on its way are joined beside it, in
            // either order: the script takes the whole state only at its version.
            let _joining = turn.read().await;
            let joined = {
                let mut e = lock(entry);
                let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
                let mut admitted = e.guard.clone();
                let result = f(&mut admitted, now);
                // A new session here writes whole (there may be no shared state yet), and
                // spend samples are only written whole.
                let joins = e.version() > 0
                    && config.max_usd_per_minute.is_none()
                    && guard_view::joins(&e.guard, &admitted, now, request);
                joins.then(|| {
                    e.guard = admitted;
                    let join = Joined {
                        at_ms: now_ms,
                        request,
                        limit: config.identical_request_limit,
                        since_ms: window_start(config, now_ms),
                    };
                    let whole = {
                        let s = e.sharing();
                        s.last_writer && s.joining == 0
                    };
                    let write = if whole {
                        Write::WholeOrJoin {
                            version: e.version(),
                            state: format::encode_snapshot(&guard_view::snapshot(
                                &e.guard, now, now_ms,
                            )),
                            join,
                        }
                    } else {
                        Write::Join(join)
                    };
                    e.sharing().joining += 1;
                    (result, write)
                })
            };
            if let Some((result, write)) = joined {
                let _on_its_way = OnItsWay(entry);
                match save(Some(write)).await {
                    Saving::Saved(written, t) => {
                        // Joined to a state another replica (or another join) wrote
                        // since: this replica's guard is not that state, so it stays
                        // at its version (a whole write is then handed the state back).
                        let mut e = lock(entry);
                        let s = e.sharing();
                        s.last_writer = s.version == written.from;
                        if s.last_writer {
                            s.version = written.to;
                        }
                        return Ok((result, Some(t)));
                    }
                    Saving::Undone(t) => {
                        // The request stays in this replica's guard (joins beside it
                        // may have added theirs since), which is therefore no longer
                        // the shared state at any version.
                        let mut e = lock(entry);
                        let s = e.sharing();
                        s.version = UNKNOWN_VERSION;
                        s.last_writer = false;
                        return Ok((result, Some(t)));
                    }
                    Saving::Local(t) => return Ok((result, Some(t))),
                    // The shared state would not admit it: decided again on that state,
                    // alone.
                    Saving::Moved(version, state) => newer = Some((version, state)),
                }
            }
        }
        let _turn = turn.write_owned().await;
        self.write_whole(
            tenant, session, entry, config, f, save, replace, request, newer,
        )
        .await
    }

    /// The whole writes of [`SessionGuards::apply`], this replica's turn held: `f` on
    /// the guard (on `newer` first, the shared state a write was handed back), written
    /// back compare-and-set, redone on the state that won a race.
    #[allow(clippy::too_many_arguments)]
    async fn write_whole<R, T, Fut>(
        &self,
        tenant: &Arc<str>,
        session: &str,
        entry: &Mutex<GuardedSession>,
        config: &Arc<GuardPolicy>,
        f: impl Fn(&mut SessionGuard, Instant) -> R,
        save: impl Fn(Option<Write>) -> Fut,
        replace: bool,
        request: Option<u64>,
        mut newer: Option<(u64, String)>,
    ) -> Result<(R, Option<T>), UnknownFormat>
    where
        Fut: std::future::Future<Output = Saving<T>>,
    {
        // Optimistic: this replica's guard is assumed current; if it is not, the save
        // hands back the shared state, which is loaded and redone.
        for _ in 0..MAX_RACES {
            let (result, before, write) = {
                let mut e = lock(entry);
                let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
                if let Some((version, state)) = newer.take() {
                    let shared = if state.is_empty() {
                        // Nothing shared (expired, or Redis emptied): a fresh guard.
                        Ok(SessionGuard::new(config.clone()))
                    } else {
                        format::decode_snapshot(&state).map(|snap| {
                            guard_view::from_snapshot(config.clone(), snap, now, now_ms)
                        })
                    };
                    match shared {
                        Ok(guard) => e.guard = guard,
                        // Not read as anything: refused, or replaced whole.
                        Err(unknown) => {
                            unknown.report(&format!("{tenant}/{session}"));
                            if !replace {
                                return Err(unknown);
                            }
                        }
                    }
                    e.sharing().version = version;
                }
                let before = e.guard.clone();
                let result = f(&mut e.guard, now);
                let window = match request {
                    _ if replace => WindowWrite::Replace,
                    // The guard counted the request: the window's one change. (Not told
                    // by the window's last entry: one read from another replica's write
                    // in the same millisecond is the same entry.)
                    Some(request) if before.counts_request(now) => WindowWrite::Append {
                        at_ms: now_ms,
                        request,
                        since_ms: window_start(config, now_ms),
                    },
                    _ => WindowWrite::Keep,
                };
                let write = Write::Whole {
                    version: e.version(),
                    state: format::encode_snapshot(&guard_view::snapshot(&e.guard, now, now_ms)),
                    window,
                };
                (result, before, write)
            };
            match save(Some(write)).await {
                Saving::Saved(written, t) => {
                    lock(entry).wrote(written.to);
                    return Ok((result, Some(t)));
                }
                Saving::Moved(version, state) => {
                    // Undone here; done again on the state that won.
                    lock(entry).guard = before;
                    newer = Some((version, state));
                }
                Saving::Undone(t) => {
                    lock(entry).guard = before;
                    return Ok((result, Some(t)));
                }
                Saving::Local(t) => return Ok((result, Some(t))),
            }
        }
        // Races went on: this replica's guard decides, and nothing is written.
        let t = save(None).await;
        let mut e = lock(entry);
        let before = e.guard.clone();
        let result = f(&mut e.guard, self.clock.now());
        match t {
            Saving::Undone(t) => {
                e.guard = before;
                Ok((result, Some(t)))
            }
            Saving::Saved(_, t) | Saving::Local(t) => Ok((result, Some(t))),
            Saving::Moved(..) => Ok((result, None)),
        }
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

    /// Signals (counters, risk) and the trace, for the admin API. In replica mode the
    /// signals are the shared state's (this replica's guard may be behind it: requests
    /// joined through other replicas are not loaded into it until it writes whole).
    pub async fn report(&self, tenant: &str, session: &str, session_usd: f64) -> Option<Value> {
        let tenant: Arc<str> = tenant.into();
        let entry = match self.entry(&tenant, session).await {
            Ok(entry) => entry?,
            Err(unknown) => return Some(json!({"unreadable": unknown.to_string()})),
        };
        let shared = match self.configs.get(&*tenant).filter(|_| self.shares(&tenant)) {
            Some(config) => match self.store.guard_window(&tenant, session).await {
                Ok(Some((version, state))) => Some((config.clone(), version, state)),
                // None shared yet, or unreachable: this replica's own.
                Ok(None) | Err(_) => None,
            },
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
        let change = self
            .apply(
                &tenant,
                session,
                &entry,
                |guard, _| guard.close(),
                None,
                |write| self.save_window(&tenant, session, write),
                true,
            )
            .await
            .ok()
            .and_then(|(change, _)| change);
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
            let _ = self
                .apply(
                    &tenant,
                    session,
                    &entry,
                    |guard, _| guard.reset(),
                    None,
                    |write| self.save_window(&tenant, session, write),
                    true,
                )
                .await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        policy::guard::tests::fp,
        store::{connection::Redis, RedisStore, SqliteStore},
    };

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

    /// Guards of tenant `t` over a store replicas share (its Redis is never called: the
    /// tests give the write-backs' answers themselves).
    fn guards() -> SessionGuards {
        let config = Config::from_toml_with_env(
            "[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{ upstream = \"u\" }]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]\n[tenants.guard]\nidentical_request_limit = 100",
            |_| None,
        )
        .unwrap();
        let mut state = config.state.clone();
        state.url = Some("redis://127.0.0.1:1/0".into());
        let store = RedisStore::new(
            Arc::new(SqliteStore::open(":memory:").unwrap()),
            Redis::new(&state).unwrap(),
        );
        SessionGuards::new(
            &config,
            Duration::from_secs(600),
            Arc::new(store),
            Clock::system(),
        )
    }

    /// A session whose guard is the shared state at `version`, which this replica wrote.
    fn session(guards: &SessionGuards, version: u64) -> Mutex<GuardedSession> {
        let mut session = GuardedSession::new(SessionGuard::new(guards.configs["t"].clone()), 0);
        session.wrote(version);
        Mutex::new(session)
    }

    fn admit(n: u64) -> impl Fn(&mut SessionGuard, Instant) -> bool {
        move |guard, now| guard.admit(now, &fp(n), 0.0).0.is_ok()
    }

    fn kind(write: &Write) -> (&'static str, Option<u64>) {
        match write {
            Write::Whole { version, .. } => ("whole", Some(*version)),
            Write::Join(_) => ("join", None),
            Write::WholeOrJoin { version, .. } => ("whole_or_join", Some(*version)),
        }
    }

    /// The replica that wrote a session's shared state last offers its whole state with
    /// a request; the session's other requests meanwhile are joined beside it, without
    /// waiting for its round trip, and none of them offers the whole state (it holds the
    /// first request, which would then be counted twice). Once every write is answered,
    /// the whole state is offered again.
    #[tokio::test(start_paused = true)]
    async fn a_whole_state_offered_beside_a_join_holds_no_request_back() {
        let guards = guards();
        let tenant: Arc<str> = "t".into();
        let entry = session(&guards, 5);
        let writes = Mutex::new(Vec::new());
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let held = Mutex::new(Some(held));
        let first = guards.update_with(&tenant, "s", &entry, admit(1), 1, |write| {
            writes.lock().unwrap().push(kind(write.as_ref().unwrap()));
            let held = held.lock().unwrap().take().unwrap();
            async move {
                let _ = held.await;
                Saving::Saved(Written { from: 5, to: 6 }, ())
            }
        });
        tokio::pin!(first);
        // On its way to Redis, not answered.
        assert!(futures_util::poll!(&mut first).is_pending());
        for (n, from) in [(2, 6), (3, 7)] {
            let beside = guards.update_with(&tenant, "s", &entry, admit(n), n, |write| {
                writes.lock().unwrap().push(kind(write.as_ref().unwrap()));
                async move { Saving::Saved(Written { from, to: from + 1 }, ()) }
            });
            let (admitted, saved) = tokio::time::timeout(Duration::from_secs(1), beside)
                .await
                .expect("held back by the whole state's round trip")
                .unwrap();
            assert!(admitted && saved.is_some());
        }
        release.send(()).unwrap();
        let (admitted, _) = first.await.unwrap();
        assert!(admitted);
        assert_eq!(
            *writes.lock().unwrap(),
            [("whole_or_join", Some(5)), ("join", None), ("join", None)]
        );
        {
            // The whole state was taken at 5; the joins landed after it.
            let mut e = lock(&entry);
            let s = e.sharing();
            assert_eq!((s.version, s.last_writer, s.joining), (6, true, 0));
            assert_eq!(e.guard.counts().recent.len(), 3);
        }
        let next = guards.update_with(&tenant, "s", &entry, admit(4), 4, |write| {
            writes.lock().unwrap().push(kind(write.as_ref().unwrap()));
            async move { Saving::Saved(Written { from: 8, to: 9 }, ()) }
        });
        assert!(next.await.unwrap().0);
        assert_eq!(writes.lock().unwrap()[3], ("whole_or_join", Some(6)));
    }

    /// A request the guard counts is added to the window Redis keeps beside the shared
    /// state even when the window already ends with the same request at the same
    /// instant (one read from another replica's write in the same millisecond is): taken
    /// for "not counted", it let a burst over three replicas through once too often.
    #[tokio::test(start_paused = true)]
    async fn a_counted_request_is_appended_even_when_the_window_ends_with_it() {
        let guards = guards();
        let tenant: Arc<str> = "t".into();
        let entry = session(&guards, 0);
        let now = guards.clock.now();
        assert!(lock(&entry).guard.admit(now, &fp(1), 0.0).0.is_ok());
        let windows = Mutex::new(Vec::new());
        let (admitted, _) = guards
            .update_with(&tenant, "s", &entry, admit(1), 1, |write| {
                if let Some(Write::Whole { window, .. }) = &write {
                    windows.lock().unwrap().push(*window);
                }
                async move { Saving::Saved(Written { from: 0, to: 1 }, ()) }
            })
            .await
            .unwrap();
        assert!(admitted);
        let windows = windows.into_inner().unwrap();
        assert!(
            matches!(windows[..], [WindowWrite::Append { request: 1, .. }]),
            "{windows:?}"
        );
        assert_eq!(lock(&entry).guard.counts().recent.len(), 2);
    }

    /// A request abandoned on its way (its client left) no longer keeps the whole state
    /// from being offered.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_write_does_not_stop_whole_offers() {
        let guards = guards();
        let tenant: Arc<str> = "t".into();
        let entry = session(&guards, 5);
        let writes = Mutex::new(Vec::new());
        let save = |write: Option<Write>| {
            writes.lock().unwrap().push(kind(write.as_ref().unwrap()));
            std::future::pending::<Saving<()>>()
        };
        let abandoned = tokio::time::timeout(
            Duration::from_secs(1),
            guards.update_with(&tenant, "s", &entry, admit(1), 1, save),
        )
        .await;
        assert!(abandoned.is_err());
        assert_eq!(lock(&entry).sharing().joining, 0);
        let next = tokio::time::timeout(
            Duration::from_secs(1),
            guards.update_with(&tenant, "s", &entry, admit(2), 2, save),
        )
        .await;
        assert!(next.is_err());
        assert_eq!(
            *writes.lock().unwrap(),
            [("whole_or_join", Some(5)), ("whole_or_join", Some(5))]
        );
    }

    #[test]
    fn a_state_is_cut_at_each_mark_found_once_in_order() {
        let marks = ["@s@", "@q@"];
        assert_eq!(
            cut(r#"{"evidence":"@s@ sessions (@q@ of them)"}"#, &marks),
            Some(vec![
                r#"{"evidence":""#.to_string(),
                " sessions (".to_string(),
                r#" of them)"}"#.to_string()
            ])
        );
        // A description quoting a mark, a mark missing, or out of order: not cut.
        assert_eq!(cut("@s@ (@q@) said @s@", &marks), None);
        assert_eq!(cut("@s@ only", &marks), None);
        assert_eq!(cut("@q@ before @s@", &marks), None);
    }
}
