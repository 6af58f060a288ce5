//! The fleet view of each tenant with `[tenants.guard.fleet]`: the failure signatures its
//! sessions share, and the prediction's record ([`crate::policy::fleet`] decides). One
//! [`TenantView`](crate::policy::fleet::TenantView) per tenant in this process
//! ([`LocalFleet`]), or, in replica mode, one view in Redis ([`redis`]) that every
//! replica counts into and predicts from, so a signature made hot by sessions on one
//! replica trips a session on another at its first such failure ([`ReplicaFleet`]).
//! Which of the two is a [`FleetBackend`] chosen once, where the state is built
//! (`app.rs`); [`Fleet`] looks up the tenant's rule and hands the call to it.
//!
//! In replica mode each replica keeps a copy of the tenant's *watched* shapes (hot
//! signatures, and those with predictions pending), refreshed from Redis at most every
//! [`WATCH_REFRESH`] in the background (before the request, for a copy older than
//! [`WATCH_STALE`]), and updated by the replies of its own scripts:
//! it tells whether a request's shape is worth hashing and which signatures to ask Redis
//! about, so a tenant without a hot signature costs no round trip and no hash on the
//! success path. When Redis cannot answer, the replica predicts from its own view (its
//! own sessions' failures) until it can.

mod local;
pub mod redis;
mod replica;

use std::{collections::HashMap, sync::Arc};

use futures_util::future::BoxFuture;

use crate::{
    config::Config,
    policy::fleet::{
        session_key, Check, Failed, FleetPolicy, ShapeKey, Signature, SignatureId, SignatureReport,
        Succeeded, Totals,
    },
    state::sessions::{Candidates, Saving},
};

pub use self::{
    local::LocalFleet,
    redis::{SharedFleet, WATCH_REFRESH, WATCH_STALE},
    replica::ReplicaFleet,
};

/// A tenant's view as the admin API shows it.
#[derive(Debug, Clone)]
pub struct FleetReport {
    pub policy: Arc<FleetPolicy>,
    /// `embedded` or `redis`: the backend's.
    pub backend: &'static str,
    pub totals: Totals,
    /// Hot first, then by sessions ([`crate::policy::fleet::sort_reports`]).
    pub signatures: Vec<SignatureReport>,
    /// Redis could not answer: this is the replica's own view.
    pub error: Option<String>,
}

/// Where the fleet views are kept, and how each operation runs on them: this process's
/// views ([`LocalFleet`]) or the replicas' in Redis ([`ReplicaFleet`]). Every method is
/// handed the tenant's rule (a tenant without one never reaches the backend) and, but
/// for [`FleetBackend::failed_and_save`], the session as its key
/// ([`session_key`]). Async methods are boxed, so the trait is object-safe. The two
/// implementations are held to the same decisions by the differential tests in
/// `tests/redis/fleet.rs`, which run each scenario through this trait.
pub trait FleetBackend: Send + Sync {
    /// Under a reloaded config: the views made under an older rule take the new one.
    fn reconfigure(&self, policies: &HashMap<String, Arc<FleetPolicy>>);

    /// See [`Fleet::watching`].
    fn watching<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, bool>;

    /// See [`Fleet::check`].
    fn check<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Check>;

    /// See [`Fleet::failed`].
    fn failed<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        sig: &'a Signature,
        session: u64,
        calls: u32,
        usd: f64,
    ) -> BoxFuture<'a, Failed>;

    /// See [`Fleet::failed_and_save`]. `session` is the session's name: the guard's
    /// state is kept under it.
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
    ) -> BoxFuture<'a, (Failed, Saving<()>)>;

    /// See [`Fleet::succeeded`].
    fn succeeded<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
        shape: ShapeKey,
        session: u64,
    ) -> BoxFuture<'a, Succeeded>;

    /// See [`Fleet::avoided`].
    fn avoided(&self, tenant: &str, policy: &Arc<FleetPolicy>, id: SignatureId, requests: u32);

    /// See [`Fleet::tripped`].
    fn tripped(&self, tenant: &str, policy: &Arc<FleetPolicy>, reason: &'static str);

    /// See [`Fleet::report`].
    fn report<'a>(
        &'a self,
        tenant: &'a str,
        policy: &'a Arc<FleetPolicy>,
    ) -> BoxFuture<'a, FleetReport>;
}

/// Each fleet tenant's rule, and the backend that keeps their views.
pub struct Fleet {
    policies: HashMap<String, Arc<FleetPolicy>>,
    /// Kept across reloads, with the counts in it.
    backend: Arc<dyn FleetBackend>,
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

impl Fleet {
    /// The views of `config`'s fleet tenants, kept by `backend`.
    pub fn new(config: &Config, backend: Arc<dyn FleetBackend>) -> Fleet {
        Fleet {
            policies: policies(config),
            backend,
        }
    }

    /// Under a reloaded config: the new rules over the same counts.
    pub fn reconfigured(&self, config: &Config) -> Fleet {
        let policies = policies(config);
        self.backend.reconfigure(&policies);
        Fleet {
            policies,
            backend: self.backend.clone(),
        }
    }

    /// The tenant's rule, when it has the fleet view on.
    pub fn policy(&self, tenant: &str) -> Option<&Arc<FleetPolicy>> {
        self.policies.get(tenant)
    }

    /// Whether the tenant's requests are worth a shape now: a signature is hot, or a
    /// prediction awaits its verdict. Cheap: no hash, and no round trip but a replica's
    /// first request of the tenant in [`WATCH_STALE`].
    pub async fn watching(&self, tenant: &str) -> bool {
        if !self.policies.contains_key(tenant) {
            return false;
        }
        self.backend.watching(tenant).await
    }

    /// Before a request of `shape` runs (`preempt`): refused if a hot signature has this
    /// shape and its probe is not due.
    pub async fn check(&self, tenant: &str, shape: ShapeKey, session: &str) -> Check {
        let Some(policy) = self.policies.get(tenant) else {
            return Check::Clear;
        };
        self.backend
            .check(tenant, policy, shape, session_key(session))
            .await
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
        let Some(policy) = self.policies.get(tenant) else {
            return Failed::default();
        };
        self.backend
            .failed(tenant, policy, sig, session_key(session), calls, usd)
            .await
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
        let Some(policy) = self.policies.get(tenant) else {
            return (Failed::default(), Saving::Local(()));
        };
        self.backend
            .failed_and_save(tenant, policy, sig, session, calls, usd, guard)
            .await
    }

    /// A request of `session` with `shape` succeeded while the tenant was watched.
    pub async fn succeeded(&self, tenant: &str, shape: ShapeKey, session: &str) -> Succeeded {
        let Some(policy) = self.policies.get(tenant) else {
            return Succeeded::default();
        };
        self.backend
            .succeeded(tenant, policy, shape, session_key(session))
            .await
    }

    /// `requests` of the tenant refused because of `id`: credited to it (off the
    /// request's path in replica mode).
    pub fn avoided(&self, tenant: &str, id: SignatureId, requests: u32) {
        if let Some(policy) = self.policies.get(tenant) {
            self.backend.avoided(tenant, policy, id, requests);
        }
    }

    /// A session of the tenant was tripped for `reason` (any rule of the guard).
    pub fn tripped(&self, tenant: &str, reason: &'static str) {
        if let Some(policy) = self.policies.get(tenant) {
            self.backend.tripped(tenant, policy, reason);
        }
    }

    /// The tenant's view for the admin API: `None` when it has no fleet view.
    pub async fn report(&self, tenant: &str) -> Option<FleetReport> {
        let policy = self.policies.get(tenant)?;
        Some(self.backend.report(tenant, policy).await)
    }

    /// The tenants with a fleet view, by name.
    pub fn tenants(&self) -> Vec<String> {
        let mut names: Vec<String> = self.policies.keys().cloned().collect();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        clock::Clock,
        config::StateConfig,
        policy::fleet::{FailureKind, Shape},
        state::shared::Redis,
    };

    /// One tenant, `t`, whose fleet view trips the third session failing twice.
    fn config(cool_down: &str) -> Config {
        Config::from_toml_with_env(
            &format!(
                r#"
[[upstreams]]
name = "openai"
api = "openai"
base_url = "https://api.openai.com"
api_key = "sk-test"

[[routes]]
model = "gpt-*"
targets = [{{ upstream = "openai" }}]

[[tenants]]
name = "t"
api_keys = ["bk-fleet-unit-key"]
[tenants.guard]
[tenants.guard.fleet]
min_sessions = 3
min_failures = 2
window = "10m"
cool_down = "{cool_down}"
"#
            ),
            |_| None,
        )
        .unwrap()
    }

    fn compaction() -> Signature {
        let template = "summarize the conversation so far in # words.";
        let shape = Shape {
            key: Shape::key_of("gpt-*", "gpt-4o", "/v1/chat/completions", 7, template),
            route: "gpt-*".into(),
            model: "gpt-4o".into(),
            endpoint: "/v1/chat/completions",
            system: 7,
            template: template.into(),
        };
        Signature::new(
            &shape,
            &FailureKind {
                class: "caller_fault",
                code: "context_length_exceeded".into(),
                detail: "HTTP 400".into(),
            },
        )
    }

    /// Sessions `s-1` and `s-2` fail twice each: one more such session trips.
    async fn two_sessions_fail_twice(fleet: &Fleet, sig: &Signature) {
        for session in ["s-1", "s-2"] {
            for _ in 0..2 {
                let failed = fleet.failed("t", sig, session, 1, 0.0).await;
                assert_eq!(failed.trip, None, "{session}");
            }
        }
    }

    /// A reload hands the same backend on: the counts made under the old rule trip a
    /// session under the new one.
    #[tokio::test]
    async fn a_reload_keeps_the_counts_and_takes_the_new_rule() {
        let clock = Clock::starting_at(1_800_000_000_000);
        let fleet = Fleet::new(&config("30s"), Arc::new(LocalFleet::new(clock.clone())));
        let sig = compaction();
        two_sessions_fail_twice(&fleet, &sig).await;
        let fleet = fleet.reconfigured(&config("90s"));
        assert_eq!(fleet.failed("t", &sig, "s-3", 1, 0.0).await.trip, None);
        let hot = fleet.failed("t", &sig, "s-3", 1, 0.0).await.trip;
        assert_eq!(hot.map(|h| h.retry_after), Some(Duration::from_secs(90)));
        let report = fleet.report("t").await.unwrap();
        assert_eq!((report.backend, report.error), ("embedded", None));
        assert_eq!(report.policy.cool_down, Duration::from_secs(90));
    }

    /// A replica whose Redis cannot answer counts and decides in its own view: the third
    /// session failing twice trips; a request of the shape is refused (clear in Redis,
    /// which was not asked, but hot here), its probe let through a cool-down later and
    /// its success cooling the signature here; the report is this view's, with the error.
    #[tokio::test]
    async fn a_replica_cut_off_from_redis_decides_from_its_own_view() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("redis://{}", dead.local_addr().unwrap());
        drop(dead);
        let redis = Redis::new(&StateConfig {
            url: Some(url),
            command_timeout: Duration::from_millis(200),
            ..StateConfig::default()
        })
        .unwrap();
        let clock = Clock::starting_at(1_800_000_000_000);
        let config = config("30s");
        let fleet = Fleet::new(&config, Arc::new(ReplicaFleet::new(redis, clock.clone())));
        let sig = compaction();
        assert!(!fleet.watching("t").await);
        two_sessions_fail_twice(&fleet, &sig).await;
        assert_eq!(fleet.failed("t", &sig, "s-3", 1, 0.0).await.trip, None);
        assert!(fleet.failed("t", &sig, "s-3", 1, 0.0).await.trip.is_some());

        assert!(fleet.watching("t").await);
        let check = fleet.check("t", sig.shape, "s-4").await;
        assert!(
            matches!(check, Check::Refuse(ref hot) if hot.id == sig.id),
            "{check:?}"
        );
        let report = fleet.report("t").await.unwrap();
        assert_eq!(report.backend, "redis");
        assert!(report.error.is_some());
        assert_eq!(report.signatures[0].record.preempted, 1);

        clock.skip(Duration::from_secs(31));
        assert_eq!(
            fleet.check("t", sig.shape, "s-5").await,
            Check::Probe(sig.id)
        );
        let done = fleet.succeeded("t", sig.shape, "s-5").await;
        assert_eq!(done.cooled, 1);
        assert_eq!(fleet.check("t", sig.shape, "s-6").await, Check::Clear);
    }
}
