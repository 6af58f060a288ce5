//! How well restarts work, per guarded tenant (`GET /admin/tenants/{t}/guard`): for each
//! restart strategy (guidance of a looping session, waiting out an outage) the sessions
//! it took on, how many recovered and how many were tripped after it, and how long
//! recovery took from the session's first failure (mean, and p90 of the latest
//! [`SAMPLES`]); the sessions failed at once with a diagnosis (`unrecoverable`); trips
//! by rule; and what the trips saved: the requests refused, each priced at its session's
//! mean call cost.
//!
//! Counted in this process ([`LocalRestarts`]) or, with Redis, in one hash and two
//! capped lists per tenant that every replica counts into ([`SharedRestarts`]), off the
//! request's path: a count Redis does not take is lost, never waited for.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::future::BoxFuture;

use crate::state::shared::Redis;

/// Recovery times kept per strategy for the p90.
pub const SAMPLES: usize = 1000;

/// A restart strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// A looping session told once to change course (`guide = true`).
    Guide,
    /// A session told when to come back while every target's breaker is open.
    Wait,
}

impl Strategy {
    pub const ALL: [Strategy; 2] = [Strategy::Guide, Strategy::Wait];

    pub fn label(self) -> &'static str {
        match self {
            Strategy::Guide => "guide",
            Strategy::Wait => "wait",
        }
    }
}

/// One thing a session's restart did.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The strategy took the session on.
    Began(Strategy),
    /// It recovered, this long after its first failure.
    Recovered(Strategy, Duration),
    /// It was tripped while the strategy had it.
    TrippedAfter(Strategy),
    /// A trip, by its rule.
    Tripped(&'static str),
    /// A request refused by a trip, worth `usd` (its session's mean call cost).
    Refused { usd: f64 },
}

/// One strategy's counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    pub began: u64,
    pub recovered: u64,
    pub tripped: u64,
    /// Every recovery's time, summed (for the mean).
    pub recovery_ms_total: f64,
    /// The latest recoveries' times, oldest first (for the p90).
    pub samples: VecDeque<u64>,
}

impl Tally {
    fn add(&mut self, other: &Tally) {
        self.began += other.began;
        self.recovered += other.recovered;
        self.tripped += other.tripped;
        self.recovery_ms_total += other.recovery_ms_total;
        self.samples.extend(other.samples.iter().copied());
    }

    /// Recovered ÷ began; `None` before any began.
    pub fn success_rate(&self) -> Option<f64> {
        (self.began > 0).then(|| self.recovered as f64 / self.began as f64)
    }

    /// Mean time to recovery, in seconds.
    pub fn mttr_mean(&self) -> Option<f64> {
        (self.recovered > 0).then(|| self.recovery_ms_total / self.recovered as f64 / 1e3)
    }

    /// The p90 time to recovery of the kept samples, in seconds (nearest rank).
    pub fn mttr_p90(&self) -> Option<f64> {
        let mut all: Vec<u64> = self.samples.iter().copied().collect();
        if all.is_empty() {
            return None;
        }
        all.sort_unstable();
        let rank = (all.len() * 9).div_ceil(10).max(1);
        Some(all[rank - 1] as f64 / 1e3)
    }
}

/// A tenant's restart record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RestartReport {
    /// `memory`, or `redis` (every replica's).
    pub backend: &'static str,
    pub guide: Tally,
    pub wait: Tally,
    /// Trips by rule name.
    pub trips: BTreeMap<String, u64>,
    /// Requests refused by trips, and what they would have cost.
    pub refused: u64,
    pub saved_usd: f64,
    /// Redis could not answer: this replica's counts of the time it could not.
    pub error: Option<String>,
}

impl RestartReport {
    pub fn tally(&self, strategy: Strategy) -> &Tally {
        match strategy {
            Strategy::Guide => &self.guide,
            Strategy::Wait => &self.wait,
        }
    }

    fn tally_mut(&mut self, strategy: Strategy) -> &mut Tally {
        match strategy {
            Strategy::Guide => &mut self.guide,
            Strategy::Wait => &mut self.wait,
        }
    }

    /// Both strategies together.
    pub fn total(&self) -> Tally {
        let mut total = self.guide.clone();
        total.add(&self.wait);
        total
    }

    fn count(&mut self, event: &Event) {
        match event {
            Event::Began(s) => self.tally_mut(*s).began += 1,
            Event::Recovered(s, after) => {
                let t = self.tally_mut(*s);
                t.recovered += 1;
                let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
                t.recovery_ms_total += ms as f64;
                if t.samples.len() == SAMPLES {
                    t.samples.pop_front();
                }
                t.samples.push_back(ms);
            }
            Event::TrippedAfter(s) => self.tally_mut(*s).tripped += 1,
            Event::Tripped(rule) => *self.trips.entry((*rule).to_string()).or_default() += 1,
            Event::Refused { usd } => {
                self.refused += 1;
                self.saved_usd += usd;
            }
        }
    }
}

/// Where the counts are kept.
pub trait RestartBackend: Send + Sync {
    /// Counts `event` for `tenant` (never waits on a store).
    fn count(&self, tenant: &str, event: Event);

    fn report<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, RestartReport>;
}

/// The counts in this process's memory.
#[derive(Default)]
pub struct LocalRestarts {
    tenants: Mutex<HashMap<String, RestartReport>>,
}

impl LocalRestarts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, RestartReport>> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl RestartBackend for LocalRestarts {
    fn count(&self, tenant: &str, event: Event) {
        let mut all = self.lock();
        match all.get_mut(tenant) {
            Some(report) => report.count(&event),
            None => {
                let mut report = RestartReport {
                    backend: "memory",
                    ..RestartReport::default()
                };
                report.count(&event);
                all.insert(tenant.to_string(), report);
            }
        }
    }

    fn report<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, RestartReport> {
        let report = self.lock().get(tenant).cloned().unwrap_or(RestartReport {
            backend: "memory",
            ..RestartReport::default()
        });
        Box::pin(std::future::ready(report))
    }
}

/// How long a tenant's counts outlive their last change in Redis.
const TTL_MS: u64 = 30 * 86_400_000;

/// The counts every replica shares, in Redis: `restarts` (a hash of counters, trips as
/// `trip:<rule>`) and `restarts:<strategy>:ms` (the latest recovery times).
pub struct SharedRestarts {
    redis: Arc<Redis>,
    /// What this replica counted while Redis could not answer.
    fallback: Arc<LocalRestarts>,
}

impl SharedRestarts {
    pub fn new(redis: Arc<Redis>) -> SharedRestarts {
        SharedRestarts {
            redis,
            fallback: Arc::default(),
        }
    }
}

/// What an event adds to the tenant's hash: (field, integer or float increment), and a
/// recovery time for a strategy's list.
fn increments(event: &Event) -> (String, f64, Option<(Strategy, u64)>) {
    match event {
        Event::Began(s) => (format!("{}:began", s.label()), 1.0, None),
        Event::Recovered(s, after) => {
            let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
            (format!("{}:recovered", s.label()), 1.0, Some((*s, ms)))
        }
        Event::TrippedAfter(s) => (format!("{}:tripped", s.label()), 1.0, None),
        Event::Tripped(rule) => (format!("trip:{rule}"), 1.0, None),
        Event::Refused { usd } => ("saved_usd".into(), *usd, None),
    }
}

impl RestartBackend for SharedRestarts {
    fn count(&self, tenant: &str, event: Event) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let hash = self.redis.key(tenant, "restarts");
        let list = |s: Strategy| {
            self.redis
                .key(tenant, &format!("restarts:{}:ms", s.label()))
        };
        let (field, by, sample) = increments(&event);
        let sample = sample.map(|(s, ms)| (list(s), ms));
        let redis = self.redis.clone();
        let fallback = self.fallback.clone();
        let tenant = tenant.to_string();
        rt.spawn(async move {
            let refused = matches!(event, Event::Refused { .. });
            let result = redis
                .run("restarts_count", |mut c| async move {
                    let mut pipe = redis::pipe();
                    pipe.atomic();
                    match refused {
                        true => {
                            pipe.cmd("HINCRBY")
                                .arg(&hash)
                                .arg("refused")
                                .arg(1)
                                .ignore();
                            pipe.cmd("HINCRBYFLOAT")
                                .arg(&hash)
                                .arg(&field)
                                .arg(by)
                                .ignore();
                        }
                        false => {
                            pipe.cmd("HINCRBY").arg(&hash).arg(&field).arg(1).ignore();
                        }
                    }
                    if let Some((list, ms)) = &sample {
                        pipe.cmd("HINCRBY")
                            .arg(&hash)
                            .arg(format!("{field}_ms"))
                            .arg(*ms)
                            .ignore();
                        pipe.cmd("RPUSH").arg(list).arg(*ms).ignore();
                        pipe.cmd("LTRIM")
                            .arg(list)
                            .arg(-(SAMPLES as i64))
                            .arg(-1)
                            .ignore();
                        pipe.cmd("PEXPIRE").arg(list).arg(TTL_MS).ignore();
                    }
                    pipe.cmd("PEXPIRE").arg(&hash).arg(TTL_MS).ignore();
                    pipe.query_async::<()>(&mut c).await
                })
                .await;
            if result.is_err() {
                // Kept here, and shown while Redis cannot answer.
                fallback.count(&tenant, event);
            }
        });
    }

    fn report<'a>(&'a self, tenant: &'a str) -> BoxFuture<'a, RestartReport> {
        Box::pin(async move {
            let hash = self.redis.key(tenant, "restarts");
            let lists: Vec<String> = Strategy::ALL
                .iter()
                .map(|s| {
                    self.redis
                        .key(tenant, &format!("restarts:{}:ms", s.label()))
                })
                .collect();
            let read = self
                .redis
                .run("restarts_report", |mut c| async move {
                    let mut pipe = redis::pipe();
                    pipe.cmd("HGETALL").arg(&hash);
                    for list in &lists {
                        pipe.cmd("LRANGE").arg(list).arg(0).arg(-1);
                    }
                    pipe.query_async::<(HashMap<String, String>, Vec<u64>, Vec<u64>)>(&mut c)
                        .await
                })
                .await;
            match read {
                Ok((fields, guide, wait)) => from_fields(&fields, [guide, wait]),
                Err(err) => RestartReport {
                    error: Some(format!("Redis could not answer: {err}")),
                    ..self.fallback.report(tenant).await
                },
            }
        })
    }
}

/// A report from the tenant's hash and recovery lists.
fn from_fields(fields: &HashMap<String, String>, samples: [Vec<u64>; 2]) -> RestartReport {
    let int = |name: &str| {
        fields
            .get(name)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let mut report = RestartReport {
        backend: "redis",
        refused: int("refused"),
        saved_usd: fields
            .get("saved_usd")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0),
        ..RestartReport::default()
    };
    for (strategy, samples) in Strategy::ALL.into_iter().zip(samples) {
        let l = strategy.label();
        *report.tally_mut(strategy) = Tally {
            began: int(&format!("{l}:began")),
            recovered: int(&format!("{l}:recovered")),
            tripped: int(&format!("{l}:tripped")),
            recovery_ms_total: int(&format!("{l}:recovered_ms")) as f64,
            samples: samples.into(),
        };
    }
    for (name, value) in fields {
        if let Some(rule) = name.strip_prefix("trip:") {
            report
                .trips
                .insert(rule.to_string(), value.parse().unwrap_or(0));
        }
    }
    report
}

/// The restart counts of every guarded tenant, where their backend keeps them.
pub struct Restarts {
    backend: Arc<dyn RestartBackend>,
}

impl Restarts {
    pub fn new(backend: Arc<dyn RestartBackend>) -> Restarts {
        Restarts { backend }
    }

    /// In this process's memory.
    pub fn local() -> Restarts {
        Restarts::new(Arc::new(LocalRestarts::default()))
    }

    /// Counts `event`, and its Prometheus metrics: `backstop_guard_recovery_seconds`
    /// for every recovery, `backstop_guard_guided_total{outcome}` for how guidance ended.
    pub fn count(&self, tenant: &str, event: Event) {
        match &event {
            Event::Recovered(strategy, after) => {
                metrics::histogram!("backstop_guard_recovery_seconds", "strategy" => strategy.label())
                    .record(after.as_secs_f64());
                if *strategy == Strategy::Guide {
                    metrics::counter!("backstop_guard_guided_total", "outcome" => "recovered")
                        .increment(1);
                }
            }
            Event::TrippedAfter(Strategy::Guide) => {
                metrics::counter!("backstop_guard_guided_total", "outcome" => "tripped")
                    .increment(1);
            }
            _ => {}
        }
        self.backend.count(tenant, event);
    }

    pub async fn report(&self, tenant: &str) -> RestartReport {
        self.backend.report(tenant).await
    }
}

impl Default for Restarts {
    fn default() -> Self {
        Restarts::local()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_tenants_record_adds_up_per_strategy() {
        let restarts = Restarts::local();
        for _ in 0..4 {
            restarts.count("t", Event::Began(Strategy::Guide));
        }
        for s in [1, 2, 3] {
            restarts.count(
                "t",
                Event::Recovered(Strategy::Guide, Duration::from_secs(s)),
            );
        }
        restarts.count("t", Event::TrippedAfter(Strategy::Guide));
        restarts.count("t", Event::Began(Strategy::Wait));
        restarts.count(
            "t",
            Event::Recovered(Strategy::Wait, Duration::from_secs(30)),
        );
        restarts.count("t", Event::Tripped("tool_loop_limit"));
        restarts.count("t", Event::Refused { usd: 0.25 });
        restarts.count("t", Event::Refused { usd: 0.5 });
        let r = restarts.report("t").await;
        assert_eq!(
            (r.guide.began, r.guide.recovered, r.guide.tripped),
            (4, 3, 1)
        );
        assert_eq!(r.guide.success_rate(), Some(0.75));
        assert_eq!(r.guide.mttr_mean(), Some(2.0));
        assert_eq!(r.guide.mttr_p90(), Some(3.0));
        let total = r.total();
        assert_eq!((total.began, total.recovered), (5, 4));
        assert_eq!(total.mttr_mean(), Some(9.0));
        assert_eq!(total.mttr_p90(), Some(30.0));
        assert_eq!(r.trips.get("tool_loop_limit"), Some(&1));
        assert_eq!((r.refused, r.saved_usd), (2, 0.75));
        let other = restarts.report("u").await;
        assert_eq!(
            (other.guide.success_rate(), other.backend),
            (None, "memory")
        );
    }

    #[test]
    fn the_p90_is_the_nearest_rank_of_the_kept_samples() {
        let tally = Tally {
            samples: (1..=10).map(|s| s * 1000).collect(),
            ..Tally::default()
        };
        assert_eq!(tally.mttr_p90(), Some(9.0));
        let one = Tally {
            samples: [4000].into(),
            ..Tally::default()
        };
        assert_eq!(one.mttr_p90(), Some(4.0));
    }

    #[test]
    fn a_redis_hash_reads_back_as_the_same_record() {
        let fields: HashMap<String, String> = [
            ("guide:began", "4"),
            ("guide:recovered", "3"),
            ("guide:recovered_ms", "6000"),
            ("guide:tripped", "1"),
            ("wait:began", "1"),
            ("trip:unrecoverable", "2"),
            ("refused", "2"),
            ("saved_usd", "0.75"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let r = from_fields(&fields, [vec![1000, 2000, 3000], vec![]]);
        assert_eq!(r.guide.mttr_mean(), Some(2.0));
        assert_eq!(r.guide.mttr_p90(), Some(3.0));
        assert_eq!(r.wait.began, 1);
        assert_eq!(r.trips.get("unrecoverable"), Some(&2));
        assert_eq!((r.refused, r.saved_usd, r.backend), (2, 0.75, "redis"));
    }
}
