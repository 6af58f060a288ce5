//! The guard's state shared by replicas ([`ReplicaGuards`]): each guarded session's
//! state is kept in a store every replica reads (Redis, or PostgreSQL), versioned, and
//! written back compare-and-set, so that every rule counts every replica's requests.
//! This replica's own guard decides while the store cannot be reached, or when races go
//! on.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::future::BoxFuture;

use super::{
    lock, record_imposing, At, Candidates, FailureWrite, Folded, GuardBackend, GuardUpdate, Saving,
    Typed,
};
use crate::{
    clock::Clock,
    policy::{
        budget::SessionSeen,
        guard::{GuardPolicy, SessionGuard, Trip},
        restart::Outcome,
    },
    state::{
        guard_view::{self, Joined, Write, Written},
        live::GuardedSession,
    },
    store::{
        format::{self, UnknownFormat, WindowWrite},
        GuardStates, WindowSave,
    },
};

/// How many times a guard update is redone because another replica changed the same
/// session meanwhile, before this replica decides on its own state.
const MAX_RACES: usize = 8;

/// The version of a replica's guard that is not the shared state at any version (a
/// request it holds was refused by the limits after joins beside it): a whole write from
/// it is handed the shared state back.
const UNKNOWN_VERSION: u64 = u64::MAX;

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

/// A request of a session on its way to the shared state ([`GuardedSession::joining`]),
/// until it is dropped: when the write is answered, or abandoned.
struct OnItsWay<'a>(&'a Mutex<GuardedSession>);

impl Drop for OnItsWay<'_> {
    fn drop(&mut self) {
        lock(self.0).sharing().joining -= 1;
    }
}

/// The guards' state shared by replicas through a store's versioned windows
/// ([`GuardStates::save_guard_window`]).
pub struct ReplicaGuards {
    store: Arc<dyn GuardStates>,
    clock: Clock,
    /// How long a session's shared state outlives its last write (as its memory does).
    ttl_ms: u64,
}

impl ReplicaGuards {
    pub fn new(store: Arc<dyn GuardStates>, clock: Clock, idle: Duration) -> Self {
        ReplicaGuards {
            store,
            clock,
            ttl_ms: u64::try_from(idle.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// An update's write-back: by the update's own writer (an admission's, with its
    /// limits), else by the store's compare-and-set.
    async fn save(
        &self,
        at: At<'_>,
        update: &mut dyn GuardUpdate,
        write: Option<Write>,
    ) -> Saving<()> {
        if update.writes() {
            update.save(write).await
        } else {
            self.save_window(at.tenant, at.session, write).await
        }
    }

    /// The store's compare-and-set of the guard's shared state (only [`Write::Whole`]:
    /// the store joins no request; joins go with an admission's limits).
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
            .save_guard_window(tenant, session, version, state, window, self.ttl_ms)
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

    /// [`GuardBackend::apply`]: a request admitted with nothing else changed is joined
    /// to the shared state as it is ([`Joined`]), whichever replica wrote it last; only
    /// when the shared state would not admit it is it handed back and the request
    /// decided again on it, by a whole write.
    async fn apply_shared(
        &self,
        at: At<'_>,
        update: &mut dyn GuardUpdate,
        request: Option<u64>,
        replace: bool,
    ) -> Result<(), UnknownFormat> {
        let (entry, config) = (at.entry, at.config);
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
                update.run(&mut admitted, now);
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
                    write
                })
            };
            if let Some(write) = joined {
                let _on_its_way = OnItsWay(entry);
                match self.save(at, update, Some(write)).await {
                    Saving::Saved(written, ()) => {
                        // Joined to a state another replica (or another join) wrote
                        // since: this replica's guard is not that state, so it stays
                        // at its version (a whole write is then handed the state back).
                        let mut e = lock(entry);
                        let s = e.sharing();
                        s.last_writer = s.version == written.from;
                        if s.last_writer {
                            s.version = written.to;
                        }
                        return Ok(());
                    }
                    Saving::Undone(()) => {
                        // The request stays in this replica's guard (joins beside it
                        // may have added theirs since), which is therefore no longer
                        // the shared state at any version.
                        let mut e = lock(entry);
                        let s = e.sharing();
                        s.version = UNKNOWN_VERSION;
                        s.last_writer = false;
                        return Ok(());
                    }
                    Saving::Local(()) => return Ok(()),
                    // The shared state would not admit it: decided again on that state,
                    // alone.
                    Saving::Moved(version, state) => newer = Some((version, state)),
                }
            }
        }
        let _turn = turn.write_owned().await;
        self.write_whole(at, update, replace, request, newer).await
    }

    /// The whole writes of [`ReplicaGuards::apply_shared`], this replica's turn held:
    /// the update on the guard (on `newer` first, the shared state a write was handed
    /// back), written back compare-and-set, redone on the state that won a race.
    async fn write_whole(
        &self,
        at: At<'_>,
        update: &mut dyn GuardUpdate,
        replace: bool,
        request: Option<u64>,
        mut newer: Option<(u64, String)>,
    ) -> Result<(), UnknownFormat> {
        let (entry, config) = (at.entry, at.config);
        // Optimistic: this replica's guard is assumed current; if it is not, the save
        // hands back the shared state, which is loaded and redone.
        for _ in 0..MAX_RACES {
            let (before, write) = {
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
                            unknown.report(&format!("{}/{}", at.tenant, at.session));
                            if !replace {
                                return Err(unknown);
                            }
                        }
                    }
                    e.sharing().version = version;
                }
                let before = e.guard.clone();
                update.run(&mut e.guard, now);
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
                    // An outcome that took a request out of the window (one never sent).
                    None if e.guard.counts().recent.len() != before.counts().recent.len() => {
                        WindowWrite::Replace
                    }
                    _ => WindowWrite::Keep,
                };
                let write = Write::Whole {
                    version: e.version(),
                    state: format::encode_snapshot(&guard_view::snapshot(&e.guard, now, now_ms)),
                    window,
                };
                (before, write)
            };
            match self.save(at, update, Some(write)).await {
                Saving::Saved(written, ()) => {
                    lock(entry).wrote(written.to);
                    return Ok(());
                }
                Saving::Moved(version, state) => {
                    // Undone here; done again on the state that won.
                    lock(entry).guard = before;
                    newer = Some((version, state));
                }
                Saving::Undone(()) => {
                    lock(entry).guard = before;
                    return Ok(());
                }
                Saving::Local(()) => return Ok(()),
            }
        }
        // Races went on: this replica's guard decides, and nothing is written.
        let saving = self.save(at, update, None).await;
        let mut e = lock(entry);
        let now = self.clock.now();
        match saving {
            // Refused before the guard counted it.
            Saving::Undone(()) => update.run(&mut e.guard.clone(), now),
            _ => update.run(&mut e.guard, now),
        }
        Ok(())
    }

    /// [`GuardBackend::record_failure`], in one round trip when nothing raced it.
    async fn record_failure_shared(
        &self,
        at: At<'_>,
        failure: &Outcome,
        trip: &(Trip, Duration),
        marks: &[&str],
        write: &mut dyn FailureWrite,
    ) -> Result<Folded, UnknownFormat> {
        let entry = at.entry;
        let turn = lock(entry).sharing().updating.clone();
        let _turn = turn.write_owned().await;
        let (now, before, recorded, candidates) = {
            let mut e = lock(entry);
            let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
            let mut recorded = e.guard.clone();
            let change = recorded.ended(now, failure);
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
                    None => return Ok(Folded::Apart),
                }
            };
            let candidates = Candidates {
                version: e.version(),
                recorded: recorded_state,
                tripped,
                ttl_ms: self.ttl_ms,
            };
            // As a whole write: done here, undone if the write is handed another state.
            let before = std::mem::replace(&mut e.guard, recorded);
            (now, before, change, candidates)
        };
        let saving = write.write(candidates).await;
        let imposed = write.imposed();
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
                return Ok(Folded::Recorded(change));
            }
            // Another replica wrote first: done again on its state, by the usual write.
            Saving::Moved(version, state) => Some((version, state)),
            // Unreachable: as a write that could not be made, by the usual write (which
            // lets this replica's guard decide while Redis cannot answer).
            Saving::Undone(()) | Saving::Local(()) => None,
        };
        lock(entry).guard = before;
        let mut update = Typed::alone(|guard: &mut SessionGuard, now| {
            record_imposing(guard, now, failure, imposed.as_ref())
        });
        self.write_whole(at, &mut update, false, None, newer)
            .await?;
        Ok(Folded::Recorded(update.ran()))
    }
}

impl GuardBackend for ReplicaGuards {
    fn apply<'a>(
        &'a self,
        at: At<'a>,
        update: &'a mut dyn GuardUpdate,
        request: Option<u64>,
        replace: bool,
    ) -> BoxFuture<'a, Result<(), UnknownFormat>> {
        Box::pin(self.apply_shared(at, update, request, replace))
    }

    fn record_failure<'a>(
        &'a self,
        at: At<'a>,
        failure: &'a Outcome,
        trip: &'a (Trip, Duration),
        marks: &'a [&'a str],
        write: &'a mut dyn FailureWrite,
    ) -> BoxFuture<'a, Result<Folded, UnknownFormat>> {
        Box::pin(self.record_failure_shared(at, failure, trip, marks, write))
    }

    /// A success of a quiet session (active, no failures in a row; the common case),
    /// whichever replica wrote it last, or an outcome that leaves the guard as it was
    /// when the shared state was still at this replica's version (`seen`: as the settle
    /// of the request's last call saw it).
    fn records_quietly(
        &self,
        e: &mut GuardedSession,
        outcome: &Outcome,
        seen: Option<SessionSeen>,
    ) -> bool {
        if *outcome == Outcome::Succeeded && seen.is_some_and(|s| s.guard_quiet) {
            // Nothing to write. This replica's guard, behind the shared state if
            // another replica wrote since, takes the success too; the change, if any,
            // was the other replica's.
            e.guard.record(self.clock.now(), false);
            return true;
        }
        if seen.map(|s| s.guard_version) != Some(e.version()) {
            return false;
        }
        let (now, now_ms) = (self.clock.now(), self.clock.now_ms());
        let before = guard_view::snapshot(&e.guard, now, now_ms);
        let mut after = e.guard.clone();
        let change = after.ended(now, outcome);
        change.is_none() && guard_view::snapshot(&after, now, now_ms) == before
    }

    fn shared_state<'a>(
        &'a self,
        tenant: &'a str,
        session: &'a str,
    ) -> BoxFuture<'a, Option<(u64, String)>> {
        Box::pin(async move {
            // None shared yet, or unreachable: `None`.
            self.store
                .guard_window(tenant, session)
                .await
                .ok()
                .flatten()
        })
    }

    /// Only for a guard watching spend velocity: otherwise what this replica last saw
    /// of the session's spend spares the round trip.
    fn reads_spend(&self, policy: &GuardPolicy) -> bool {
        policy.max_usd_per_minute.is_some()
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::{super::SessionGuards, *};
    use crate::{
        config::Config,
        policy::guard::tests::fp,
        store::{connection::Redis, RedisStore, SqliteStore},
    };

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
        let store: Arc<dyn GuardStates> = Arc::new(store);
        let (idle, clock) = (Duration::from_secs(600), Clock::system());
        let replica = ReplicaGuards::new(store.clone(), clock.clone(), idle);
        SessionGuards::new(&config, idle, store, clock).with_backend(Arc::new(replica))
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
