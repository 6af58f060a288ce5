//! The guard's state as this process's own ([`LocalGuards`]): each update runs on the
//! session's guard in memory, and nothing is written back.

use std::time::Duration;

use futures_util::future::BoxFuture;

use super::{lock, At, FailureWrite, Folded, GuardBackend, GuardUpdate, Saving};
use crate::{
    clock::Clock,
    policy::{
        budget::SessionSeen,
        guard::{GuardPolicy, Trip},
        restart::Outcome,
    },
    state::live::GuardedSession,
    store::format::UnknownFormat,
};

/// Guards no other replica shares.
pub struct LocalGuards {
    clock: Clock,
}

impl LocalGuards {
    pub fn new(clock: Clock) -> Self {
        LocalGuards { clock }
    }
}

impl GuardBackend for LocalGuards {
    /// An update with a writer of its own (an admission, whose writer is its limits) asks
    /// it first, with nothing to write: a request the limits refuse is not counted.
    fn apply<'a>(
        &'a self,
        at: At<'a>,
        update: &'a mut dyn GuardUpdate,
        _request: Option<u64>,
        _replace: bool,
    ) -> BoxFuture<'a, Result<(), UnknownFormat>> {
        Box::pin(async move {
            let saving = if update.writes() {
                update.save(None).await
            } else {
                Saving::Local(())
            };
            let mut e = lock(at.entry);
            let now = self.clock.now();
            match saving {
                // Refused before the guard counted it: decided on a copy.
                Saving::Undone(()) => update.run(&mut e.guard.clone(), now),
                _ => update.run(&mut e.guard, now),
            }
            Ok(())
        })
    }

    /// No round trip to fold a failure into: recorded the usual way.
    fn record_failure<'a>(
        &'a self,
        _at: At<'a>,
        _failure: &'a Outcome,
        _trip: &'a (Trip, Duration),
        _marks: &'a [&'a str],
        _write: &'a mut dyn FailureWrite,
    ) -> BoxFuture<'a, Result<Folded, UnknownFormat>> {
        Box::pin(std::future::ready(Ok(Folded::Apart)))
    }

    /// Every outcome is recorded in memory, which costs nothing to write.
    fn records_quietly(
        &self,
        _entry: &mut GuardedSession,
        _outcome: &Outcome,
        _seen: Option<SessionSeen>,
    ) -> bool {
        false
    }

    fn shared_state<'a>(
        &'a self,
        _tenant: &'a str,
        _session: &'a str,
    ) -> BoxFuture<'a, Option<(u64, String)>> {
        Box::pin(std::future::ready(None))
    }

    /// The session's spend is in this process's books: read, exact, every time.
    fn reads_spend(&self, _policy: &GuardPolicy) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::super::SessionGuards;
    use super::*;
    use crate::{config::Config, policy::guard::tests::fp, store::SqliteStore};

    fn guards() -> SessionGuards {
        let config = Config::from_toml_with_env(
            "[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{ upstream = \"u\" }]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]\n[tenants.guard]\nidentical_request_limit = 2",
            |_| None,
        )
        .unwrap();
        let store = Arc::new(SqliteStore::open(":memory:").unwrap());
        SessionGuards::new(&config, Duration::from_secs(600), store, Clock::system())
    }

    /// An admission's writer (its limits) is asked before the guard decides, with
    /// nothing to write; a request it refuses is decided on a copy, so the guard does
    /// not count it, and the writer's answer is the update's.
    #[tokio::test(start_paused = true)]
    async fn the_limits_are_asked_first_and_a_request_they_refuse_is_not_counted() {
        let guards = guards();
        let tenant: Arc<str> = "t".into();
        let entry = guards.entry(&tenant, "s").await.unwrap().unwrap();
        let events = Mutex::new(Vec::new());
        for refused in [true, true, false, false] {
            let (admitted, answer) = guards
                .update_with(
                    &tenant,
                    "s",
                    &entry,
                    |guard, now| {
                        events.lock().unwrap().push("guard");
                        guard.admit(now, &fp(1), 0.0).0.is_ok()
                    },
                    1,
                    |write| {
                        assert!(write.is_none(), "nothing is written back here");
                        events.lock().unwrap().push("limits");
                        std::future::ready(if refused {
                            Saving::Undone("refused")
                        } else {
                            Saving::Local("passed")
                        })
                    },
                )
                .await
                .unwrap();
            assert!(admitted, "two identical requests are within the limit");
            assert_eq!(answer, Some(if refused { "refused" } else { "passed" }));
        }
        assert_eq!(
            lock(&entry).guard.counts().recent.len(),
            2,
            "only the requests the limits let through"
        );
        assert_eq!(
            events.into_inner().unwrap(),
            ["limits", "guard"].repeat(4),
            "the limits before the guard, every time"
        );
    }

    /// Nothing is folded into a failure's round trip here: the caller records it apart,
    /// and the round trip is never run.
    #[tokio::test]
    async fn a_failure_is_never_folded_into_another_round_trip() {
        let guards = guards();
        let tenant: Arc<str> = "t".into();
        let entry = guards.entry(&tenant, "s").await.unwrap().unwrap();
        let trip = (
            Trip::new(crate::policy::guard::TripRule::FleetPattern, "x".into()),
            Duration::from_secs(30),
        );
        let recorded = guards
            .record_failure(
                &tenant,
                "s",
                &entry,
                &Outcome::Failed,
                &trip,
                &[],
                |_| async { panic!("no round trip to fold into") },
                |_: &()| None,
            )
            .await
            .unwrap();
        assert!(recorded.is_none());
        assert_eq!(lock(&entry).guard.counts().consecutive_failures, 0);
        assert!(!guards
            .backend
            .records_quietly(&mut lock(&entry), &Outcome::Succeeded, None));
    }
}
