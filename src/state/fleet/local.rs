//! The fleet views in this process: one [`TenantView`] per fleet tenant, made at its
//! first use and kept across reloads. The whole fleet view when there is one gateway;
//! in replica mode, each replica's own view, which decides while Redis cannot answer
//! ([`super::ReplicaFleet`]).
//!
//! The `*_at` methods take `now`, so the replica's fallback decides at the time it read
//! before asking Redis, as the view in Redis would have.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use futures_util::future::BoxFuture;

use crate::{
    clock::Clock,
    policy::fleet::{
        session_key, Check, Failed, FleetPolicy, ShapeKey, Signature, SignatureId, Succeeded,
        TenantView,
    },
    state::sessions::{Candidates, Saving},
};

use super::{FleetBackend, FleetReport};

pub struct LocalFleet {
    views: Mutex<HashMap<String, Arc<Mutex<TenantView>>>>,
    clock: Clock,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl LocalFleet {
    pub fn new(clock: Clock) -> LocalFleet {
        LocalFleet {
            views: Mutex::default(),
            clock,
        }
    }

    /// The tenant's view, made under `policy` if it has none yet.
    fn view(&self, tenant: &str, policy: &Arc<FleetPolicy>) -> Arc<Mutex<TenantView>> {
        lock(&self.views)
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(Mutex::new(TenantView::new(policy.clone()))))
            .clone()
    }

    /// The tenant's view, if it has one already.
    fn existing(&self, tenant: &str) -> Option<Arc<Mutex<TenantView>>> {
        lock(&self.views).get(tenant).cloned()
    }

    /// Whether the tenant's view (if it has one) holds a hot signature or a prediction
    /// pending. Makes no view.
    pub fn watching_now(&self, tenant: &str) -> bool {
        self.existing(tenant).is_some_and(|v| lock(&v).watching())
    }

    pub fn check_at(
        &self,
        now: i64,
        tenant: &str,
        policy: &Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> Check {
        let view = self.view(tenant, policy);
        let check = lock(&view).check(now, shape, session);
        check
    }

    #[allow(clippy::too_many_arguments)]
    pub fn failed_at(
        &self,
        now: i64,
        tenant: &str,
        policy: &Arc<FleetPolicy>,
        sig: &Signature,
        session: u64,
        calls: u32,
        usd: f64,
    ) -> Failed {
        let view = self.view(tenant, policy);
        let failed = lock(&view).failed(now, sig, session, calls, usd);
        failed
    }

    /// A success of a watched shape, in the tenant's view if it has one (none has
    /// nothing to cool down).
    pub fn succeeded_at(&self, now: i64, tenant: &str, shape: ShapeKey, session: u64) -> Succeeded {
        match self.existing(tenant) {
            Some(view) => lock(&view).succeeded(now, shape, session),
            None => Succeeded::default(),
        }
    }

    pub fn report_at(&self, now: i64, tenant: &str, policy: &Arc<FleetPolicy>) -> FleetReport {
        let view = self.view(tenant, policy);
        let view = lock(&view);
        FleetReport {
            policy: policy.clone(),
            backend: "embedded",
            totals: view.totals().clone(),
            signatures: view.report(now),
            error: None,
        }
    }
}

impl FleetBackend for LocalFleet {
    fn reconfigure(&self, policies: &HashMap<String, Arc<FleetPolicy>>) {
        for (tenant, view) in lock(&self.views).iter() {
            if let Some(policy) = policies.get(tenant) {
                lock(view).set_policy(policy.clone());
            }
        }
    }

    fn watching<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.watching_now(tenant) })
    }

    fn check<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Check> {
        Box::pin(async move { self.check_at(self.clock.now_ms(), tenant, policy, shape, session) })
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
            self.failed_at(now, tenant, policy, sig, session, calls, usd)
        })
    }

    /// Counted here; nothing is written ([`Saving::Local`]).
    #[allow(clippy::too_many_arguments)]
    fn failed_and_save<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        sig: &'a Signature,
        session: &'a str,
        calls: u32,
        usd: f64,
        _guard: Candidates,
    ) -> BoxFuture<'a, (Failed, Saving<()>)> {
        let session = session_key(session);
        Box::pin(async move {
            let now = self.clock.now_ms();
            let failed = self.failed_at(now, tenant, policy, sig, session, calls, usd);
            (failed, Saving::Local(()))
        })
    }

    fn succeeded<'a>(
        &'a self,
        tenant: &'a str,
        _policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Succeeded> {
        Box::pin(async move { self.succeeded_at(self.clock.now_ms(), tenant, shape, session) })
    }

    fn avoided(&self, tenant: &str, policy: &Arc<FleetPolicy>, id: SignatureId, requests: u32) {
        lock(&self.view(tenant, policy)).avoided(id, requests);
    }

    fn tripped(&self, tenant: &str, policy: &Arc<FleetPolicy>, reason: &'static str) {
        lock(&self.view(tenant, policy)).tripped(reason);
    }

    fn report<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
    ) -> BoxFuture<'a, FleetReport> {
        Box::pin(async move { self.report_at(self.clock.now_ms(), tenant, policy) })
    }
}
