//! The fleet views of replica mode: one view per tenant in Redis ([`SharedFleet`]) that
//! every replica counts into and predicts from, and this replica's own views
//! ([`LocalFleet`]), which count and decide while Redis cannot answer, each such call
//! counted in `backstop_state_fallbacks_total{op}`. Redis answering again does not make
//! the own views irrelevant: a signature one of them made hot during an outage is still
//! refused here, and cools down here, until it is no longer watched.

use std::{collections::HashMap, sync::Arc};

use futures_util::future::BoxFuture;

use crate::{
    clock::Clock,
    policy::fleet::{
        session_key, Check, Failed, FleetPolicy, ShapeKey, Signature, SignatureId, Succeeded,
    },
    state::{
        guard_view::Written,
        sessions::{Candidates, Saving},
        shared::{Redis, Unavailable},
    },
    store::WindowSave,
};

use super::{FleetBackend, FleetReport, LocalFleet, SharedFleet};

pub struct ReplicaFleet {
    shared: SharedFleet,
    /// The fallback, kept across reloads like the views in Redis.
    local: LocalFleet,
    clock: Clock,
}

impl ReplicaFleet {
    pub fn new(redis: Arc<Redis>, clock: Clock) -> ReplicaFleet {
        ReplicaFleet {
            shared: SharedFleet::new(redis, clock.clone()),
            local: LocalFleet::new(clock.clone()),
            clock,
        }
    }

    /// This replica's own views: what counted and decided while Redis could not answer.
    pub fn fallback(&self) -> &LocalFleet {
        &self.local
    }
}

impl FleetBackend for ReplicaFleet {
    fn reconfigure(&self, policies: &HashMap<String, Arc<FleetPolicy>>) {
        // Redis keeps no rule: each script is handed the tenant's.
        self.local.reconfigure(policies);
    }

    fn watching<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(
            async move { self.shared.watching(tenant).await || self.local.watching_now(tenant) },
        )
    }

    fn check<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Check> {
        Box::pin(async move {
            let now = self.clock.now_ms();
            match self.shared.check(tenant, policy, shape, session).await {
                Ok(Check::Clear) => {}
                Ok(check) => return check,
                Err(err) => unavailable("check", &err),
            }
            // Clear in Redis (or not asked: nothing watched there), but this replica's
            // own view may hold a signature it made hot while Redis could not answer.
            if !self.local.watching_now(tenant) {
                return Check::Clear;
            }
            self.local.check_at(now, tenant, policy, shape, session)
        })
    }

    fn failed<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        sig: &'a Signature,
        session: u64,
        calls: u32,
        usd: f64,
    ) -> BoxFuture<'a, Failed> {
        Box::pin(async move {
            let now = self.clock.now_ms();
            match self
                .shared
                .failed(tenant, policy, sig, session, calls, usd)
                .await
            {
                Ok(failed) => return failed,
                Err(err) => unavailable("failed", &err),
            }
            self.local
                .failed_at(now, tenant, policy, sig, session, calls, usd)
        })
    }

    /// When Redis cannot answer, this replica's own view counts the failure and nothing
    /// is written ([`Saving::Local`]).
    #[allow(clippy::too_many_arguments)]
    fn failed_and_save<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        sig: &'a Signature,
        session: &'a str,
        calls: u32,
        usd: f64,
        guard: Candidates,
    ) -> BoxFuture<'a, (Failed, Saving<()>)> {
        Box::pin(async move {
            match self
                .shared
                .failed_and_save(tenant, policy, sig, session, calls, usd, &guard)
                .await
            {
                Ok((failed, WindowSave::Saved(to))) => {
                    let written = Written {
                        from: guard.version,
                        to,
                    };
                    return (failed, Saving::Saved(written, ()));
                }
                Ok((failed, WindowSave::Moved(version, state))) => {
                    return (failed, Saving::Moved(version, state))
                }
                Err(err) => unavailable("failed", &err),
            }
            let now = self.clock.now_ms();
            let failed =
                self.local
                    .failed_at(now, tenant, policy, sig, session_key(session), calls, usd);
            (failed, Saving::Local(()))
        })
    }

    fn succeeded<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Succeeded> {
        Box::pin(async move {
            let now = self.clock.now_ms();
            let mut out = Succeeded::default();
            match self.shared.succeeded(tenant, policy, shape, session).await {
                Ok(done) => out = done,
                Err(err) => unavailable("succeeded", &err),
            }
            // The replica's own view too: it may hold hot signatures counted while Redis
            // could not answer, which must cool down as well.
            let local = self.local.succeeded_at(now, tenant, shape, session);
            out.cooled += local.cooled;
            out.unconfirmed |= local.unconfirmed;
            out
        })
    }

    /// Off the request's path.
    fn avoided(&self, tenant: &str, _policy: &Arc<FleetPolicy>, id: SignatureId, requests: u32) {
        self.shared.spawn_avoided(tenant, id, requests);
    }

    /// Off the request's path.
    fn tripped(&self, tenant: &str, _policy: &Arc<FleetPolicy>, reason: &'static str) {
        self.shared.spawn_tripped(tenant, reason);
    }

    /// The view in Redis, or, when Redis cannot answer, this replica's own with the
    /// error.
    fn report<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
    ) -> BoxFuture<'a, FleetReport> {
        Box::pin(async move {
            let now = self.clock.now_ms();
            match self.shared.report(tenant, policy).await {
                Ok((totals, signatures)) => FleetReport {
                    policy: policy.clone(),
                    backend: "redis",
                    totals,
                    signatures,
                    error: None,
                },
                Err(err) => FleetReport {
                    backend: "redis",
                    error: Some(err.to_string()),
                    ..self.local.report_at(now, tenant, policy)
                },
            }
        })
    }
}

fn unavailable(op: &'static str, err: &Unavailable) {
    metrics::counter!("backstop_state_fallbacks_total", "op" => op).increment(1);
    tracing::warn!(op, error = %err, "fleet view: redis could not answer; this replica's own view decides");
}
