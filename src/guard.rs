//! Live session-guard state: one [`SessionGuard`] and a bounded recovery trace per
//! (tenant, session), for tenants that configure `[tenants.guard]`. Sessions are per
//! tenant: the same id under two tenants is two sessions. Idle sessions leave memory.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use moka::sync::Cache;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::{
    config::Config,
    policy::guard::{GuardConfig, SessionGuard},
};

/// Trace entries kept per session.
const TRACE_LEN: usize = 100;

/// One line of a session's recovery trace. Kept as a small struct (not JSON) because
/// every live session holds up to [`TRACE_LEN`] of them.
#[derive(Debug, Clone)]
pub struct TraceEntry {
    pub request_id: String,
    /// 0 for a request the guard refused.
    pub status: u16,
    pub failed: bool,
    /// Recovery's trail (`retry:503,ok`), or `refused:<code>`.
    pub action: String,
    /// The rule and evidence, for refusals.
    pub detail: Option<String>,
    pub attempts: u32,
    pub upstream: Option<Arc<str>>,
    pub latency_ms: f32,
    pub cost_usd: f64,
    pub tool_loop: u32,
    pub state: &'static str,
}

impl TraceEntry {
    fn to_json(&self) -> Value {
        json!({
            "request_id": self.request_id, "status": self.status,
            "class": if self.status == 0 { "refused" } else if self.failed { "failed" } else { "ok" },
            "action": self.action, "detail": self.detail, "attempts": self.attempts, "upstream": self.upstream.as_deref(),
            "latency_ms": self.latency_ms, "cost_usd": self.cost_usd, "tool_loop": self.tool_loop, "state": self.state,
        })
    }
}

pub struct Entry {
    pub guard: SessionGuard,
    trace: VecDeque<TraceEntry>,
}

impl Entry {
    pub fn trace(&mut self, item: TraceEntry) {
        if self.trace.len() == TRACE_LEN {
            self.trace.pop_front();
        }
        self.trace.push_back(item);
    }
}

pub struct Guards {
    configs: HashMap<String, Arc<GuardConfig>>,
    sessions: Cache<(Arc<str>, String), Arc<Mutex<Entry>>>,
}

pub fn lock(entry: &Mutex<Entry>) -> MutexGuard<'_, Entry> {
    entry.lock().unwrap_or_else(|e| e.into_inner())
}

impl Guards {
    pub fn new(config: &Config, idle: Duration) -> Self {
        let configs = config
            .tenants
            .iter()
            .filter_map(|t| {
                t.guard
                    .as_ref()
                    .map(|g| (t.name.clone(), Arc::new(g.policy())))
            })
            .collect();
        Guards {
            configs,
            sessions: Cache::builder()
                .time_to_idle(idle)
                .max_capacity(1_000_000)
                .build(),
        }
    }

    pub fn is_guarded(&self, tenant: &str) -> bool {
        self.configs.contains_key(tenant)
    }

    /// The session's guard, created on first use; `None` when the tenant has no guard.
    pub fn entry(&self, tenant: &Arc<str>, session: &str) -> Option<Arc<Mutex<Entry>>> {
        let config = self.configs.get(&**tenant)?;
        Some(
            self.sessions
                .get_with((tenant.clone(), session.to_string()), || {
                    Arc::new(Mutex::new(Entry {
                        guard: SessionGuard::new(config.clone()),
                        trace: VecDeque::with_capacity(1),
                    }))
                }),
        )
    }

    /// Signals (counters, risk) and the trace, for the admin API.
    pub fn report(&self, tenant: &str, session: &str, session_usd: f64) -> Option<Value> {
        let tenant: Arc<str> = tenant.into();
        let entry = self.entry(&tenant, session)?;
        let entry = lock(&entry);
        let tool_loop = entry.trace.back().map_or(0, |t| t.tool_loop);
        Some(json!({
            "signals": entry.guard.signals(Instant::now(), session_usd, tool_loop),
            "trace": entry.trace.iter().map(TraceEntry::to_json).collect::<Vec<_>>(),
        }))
    }

    pub fn close(&self, tenant: &str, session: &str) -> bool {
        let tenant: Arc<str> = tenant.into();
        let Some(entry) = self.entry(&tenant, session) else {
            return false;
        };
        if let Some((from, to)) = lock(&entry).guard.close() {
            tracing::warn!(%tenant, session, from, to, "session closed by an operator");
        }
        true
    }

    pub fn reset(&self, tenant: &str, session: &str) {
        let tenant: Arc<str> = tenant.into();
        if let Some(entry) = self.entry(&tenant, session) {
            lock(&entry).guard.reset();
        }
    }
}
