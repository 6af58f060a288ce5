//! The fleet view of each tenant with `[tenants.guard.fleet]`: the failure signatures its
//! sessions share, and the prediction's record ([`crate::policy::fleet`] decides). One
//! [`TenantView`] per tenant in this process, or, in replica mode, one view in Redis
//! ([`redis`]) that every replica counts into and predicts from, so a signature made hot
//! by sessions on one replica trips a session on another at its first such failure.
//!
//! In replica mode each replica keeps a copy of the tenant's *watched* shapes (hot
//! signatures, and those with predictions pending), refreshed from Redis at most every
//! [`WATCH_REFRESH`] in the background (before the request, for a copy older than
//! [`WATCH_STALE`]), and updated by the replies of its own scripts:
//! it tells whether a request's shape is worth hashing and which signatures to ask Redis
//! about, so a tenant without a hot signature costs no round trip and no hash on the
//! success path. When Redis cannot answer, the replica predicts from its own view (its
//! own sessions' failures) until it can.

pub mod redis;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::{
    clock::Clock,
    config::Config,
    policy::fleet::{
        session_key, Check, Failed, FleetPolicy, ShapeKey, Signature, SignatureId, SignatureReport,
        Succeeded, TenantView, Totals,
    },
    state::{
        guard_view::Written,
        sessions::{Candidates, Saving},
        shared::Redis,
    },
    store::WindowSave,
};

pub use self::redis::{SharedFleet, WATCH_REFRESH, WATCH_STALE};

/// A tenant's view as the admin API shows it.
#[derive(Debug, Clone)]
pub struct FleetReport {
    pub policy: Arc<FleetPolicy>,
    /// `embedded` or `redis`.
    pub backend: &'static str,
    pub totals: Totals,
    /// Hot first, then by sessions ([`crate::policy::fleet::sort_reports`]).
    pub signatures: Vec<SignatureReport>,
    /// Redis could not answer: this is the replica's own view.
    pub error: Option<String>,
}

type Views = Arc<Mutex<HashMap<String, Arc<Mutex<TenantView>>>>>;

pub struct Fleet {
    policies: HashMap<String, Arc<FleetPolicy>>,
    /// Each fleet tenant's view in this process: the whole view when embedded, the
    /// fallback while Redis cannot answer in replica mode. Kept across reloads.
    local: Views,
    shared: Option<Arc<SharedFleet>>,
    clock: Clock,
}

fn policies(config: &Config) -> HashMap<String, Arc<FleetPolicy>> {
    config
        .tenants
        .iter()
        .filter_map(|t| {
            let fleet = t.guard.as_ref()?.fleet.as_ref()?;
            Some((t.name.clone(), Arc::new(fleet.policy())))
        })
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Fleet {
    /// The views of `config`'s fleet tenants, in Redis when `redis` is given.
    pub fn new(config: &Config, redis: Option<Arc<Redis>>, clock: Clock) -> Fleet {
        Fleet {
            policies: policies(config),
            local: Views::default(),
            shared: redis.map(|r| Arc::new(SharedFleet::new(r, clock.clone()))),
            clock,
        }
    }

    /// Under a reloaded config: the new rules over the same counts.
    pub fn reconfigured(&self, config: &Config) -> Fleet {
        let policies = policies(config);
        for (tenant, view) in lock(&self.local).iter() {
            if let Some(policy) = policies.get(tenant) {
                lock(view).set_policy(policy.clone());
            }
        }
        Fleet {
            policies,
            local: self.local.clone(),
            shared: self.shared.clone(),
            clock: self.clock.clone(),
        }
    }

    /// The tenant's rule, when it has the fleet view on.
    pub fn policy(&self, tenant: &str) -> Option<&Arc<FleetPolicy>> {
        self.policies.get(tenant)
    }

    fn view(&self, tenant: &str, policy: &Arc<FleetPolicy>) -> Arc<Mutex<TenantView>> {
        lock(&self.local)
            .entry(tenant.to_string())
            .or_insert_with(|| Arc::new(Mutex::new(TenantView::new(policy.clone()))))
            .clone()
    }

    fn local_view(&self, tenant: &str) -> Option<Arc<Mutex<TenantView>>> {
        let policy = self.policies.get(tenant)?;
        Some(self.view(tenant, policy))
    }

    /// Whether the tenant's requests are worth a shape now: a signature is hot, or a
    /// prediction awaits its verdict. Cheap: no hash, and no round trip but a replica's
    /// first request of the tenant in [`WATCH_STALE`].
    pub async fn watching(&self, tenant: &str) -> bool {
        if !self.policies.contains_key(tenant) {
            return false;
        }
        match &self.shared {
            Some(shared) => shared.watching(tenant).await || self.locally_watching(tenant),
            None => self.locally_watching(tenant),
        }
    }

    fn locally_watching(&self, tenant: &str) -> bool {
        let view = lock(&self.local).get(tenant).cloned();
        view.is_some_and(|v| lock(&v).watching())
    }

    /// Before a request of `shape` runs (`preempt`): refused if a hot signature has this
    /// shape and its probe is not due.
    pub async fn check(&self, tenant: &str, shape: ShapeKey, session: &str) -> Check {
        let Some(policy) = self.policies.get(tenant).cloned() else {
            return Check::Clear;
        };
        let session = session_key(session);
        let now = self.clock.now_ms();
        if let Some(shared) = &self.shared {
            match shared.check(tenant, &policy, shape, session).await {
                Ok(Check::Clear) => {}
                Ok(check) => return check,
                Err(err) => unavailable("check", &err),
            }
            // Clear in Redis (or not asked: nothing watched there), but this replica's
            // own view may hold a signature it made hot while Redis could not answer.
            if !self.locally_watching(tenant) {
                return Check::Clear;
            }
        }
        let view = self.view(tenant, &policy);
        let check = lock(&view).check(now, shape, session);
        check
    }

    /// A request of `session` failed with `sig`, after `calls` upstream calls that cost
    /// `usd`: counted, and whether the session is to be tripped.
    pub async fn failed(
        &self,
        tenant: &str,
        sig: &Signature,
        session: &str,
        calls: u32,
        usd: f64,
    ) -> Failed {
        let Some(policy) = self.policies.get(tenant).cloned() else {
            return Failed::default();
        };
        let session = session_key(session);
        let now = self.clock.now_ms();
        if let Some(shared) = &self.shared {
            match shared
                .failed(tenant, &policy, sig, session, calls, usd)
                .await
            {
                Ok(failed) => return failed,
                Err(err) => unavailable("failed", &err),
            }
        }
        let view = self.view(tenant, &policy);
        let failed = lock(&view).failed(now, sig, session, calls, usd);
        failed
    }

    /// Whether the tenant's view is in Redis (replica mode).
    pub fn shares(&self, tenant: &str) -> bool {
        self.shared.is_some() && self.policies.contains_key(tenant)
    }

    /// [`Fleet::failed`] in replica mode, and the session guard's write-back in the same
    /// round trip ([`SessionGuards::record_failure`]): the state written is `guard`'s
    /// tripped one when this failure trips the session. When Redis cannot answer, this
    /// replica's own view counts it and nothing is written ([`Saving::Local`]).
    ///
    /// [`SessionGuards::record_failure`]: crate::state::sessions::SessionGuards::record_failure
    pub async fn failed_and_save(
        &self,
        tenant: &str,
        sig: &Signature,
        session: &str,
        calls: u32,
        usd: f64,
        guard: Candidates,
    ) -> (Failed, Saving<()>) {
        let Some(policy) = self.policies.get(tenant).cloned() else {
            return (Failed::default(), Saving::Local(()));
        };
        if let Some(shared) = &self.shared {
            match shared
                .failed_and_save(tenant, &policy, sig, session, calls, usd, &guard)
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
        }
        let now = self.clock.now_ms();
        let view = self.view(tenant, &policy);
        let failed = lock(&view).failed(now, sig, session_key(session), calls, usd);
        (failed, Saving::Local(()))
    }

    /// A request of `session` with `shape` succeeded while the tenant was watched.
    pub async fn succeeded(&self, tenant: &str, shape: ShapeKey, session: &str) -> Succeeded {
        let Some(policy) = self.policies.get(tenant).cloned() else {
            return Succeeded::default();
        };
        let session = session_key(session);
        let now = self.clock.now_ms();
        let mut out = Succeeded::default();
        if let Some(shared) = &self.shared {
            match shared.succeeded(tenant, &policy, shape, session).await {
                Ok(done) => out = done,
                Err(err) => unavailable("succeeded", &err),
            }
        }
        // The replica's own view too: it may hold hot signatures counted while Redis
        // could not answer, which must cool down as well.
        if let Some(view) = lock(&self.local).get(tenant).cloned() {
            let local = lock(&view).succeeded(now, shape, session);
            out.cooled += local.cooled;
            out.unconfirmed |= local.unconfirmed;
        }
        out
    }

    /// `requests` of the tenant refused because of `id`: credited to it (off the
    /// request's path in replica mode).
    pub fn avoided(&self, tenant: &str, id: SignatureId, requests: u32) {
        if !self.policies.contains_key(tenant) {
            return;
        }
        match &self.shared {
            Some(shared) => shared.spawn_avoided(tenant, id, requests),
            None => {
                if let Some(view) = self.local_view(tenant) {
                    lock(&view).avoided(id, requests);
                }
            }
        }
    }

    /// A session of the tenant was tripped for `reason` (any rule of the guard).
    pub fn tripped(&self, tenant: &str, reason: &'static str) {
        if !self.policies.contains_key(tenant) {
            return;
        }
        match &self.shared {
            Some(shared) => shared.spawn_tripped(tenant, reason),
            None => {
                if let Some(view) = self.local_view(tenant) {
                    lock(&view).tripped(reason);
                }
            }
        }
    }

    /// The tenant's view for the admin API: `None` when it has no fleet view.
    pub async fn report(&self, tenant: &str) -> Option<FleetReport> {
        let policy = self.policies.get(tenant)?.clone();
        let now = self.clock.now_ms();
        let mut error = None;
        if let Some(shared) = &self.shared {
            match shared.report(tenant, &policy).await {
                Ok((totals, signatures)) => {
                    return Some(FleetReport {
                        policy,
                        backend: "redis",
                        totals,
                        signatures,
                        error: None,
                    })
                }
                Err(err) => error = Some(err.to_string()),
            }
        }
        let view = self.view(tenant, &policy);
        let view = lock(&view);
        Some(FleetReport {
            backend: if self.shared.is_some() {
                "redis"
            } else {
                "embedded"
            },
            totals: view.totals().clone(),
            signatures: view.report(now),
            policy,
            error,
        })
    }

    /// The tenants with a fleet view, by name.
    pub fn tenants(&self) -> Vec<String> {
        let mut names: Vec<String> = self.policies.keys().cloned().collect();
        names.sort();
        names
    }
}

fn unavailable(op: &'static str, err: &crate::state::shared::Unavailable) {
    metrics::counter!("backstop_state_fallbacks_total", "op" => op).increment(1);
    tracing::warn!(op, error = %err, "fleet view: redis could not answer; this replica's own view decides");
}
