//! The operator dashboard: `GET /admin/ui`, one page (HTML, JS, CSS compiled into the
//! binary, nothing fetched from elsewhere), and `GET /admin/ui/data`, everything the
//! page shows in one JSON poll.
//!
//! The page holds no data, so it is served without the admin token; it asks for the
//! token, keeps it in the tab's session storage and sends it as `Authorization: Bearer`
//! on its calls to the data endpoint and the admin API (never in a URL). The data
//! endpoint sits behind [`super::AdminAuthLayer`] like every operator route.
//!
//! History (recovery per minute, upstream attempts and transitions) is this process's
//! memory of the last hour ([`crate::state::activity`]): it survives no restart, and the
//! answer says so.

use std::collections::HashMap;

use axum::{
    extract::{RawQuery, State},
    http::{header, HeaderValue},
    response::{IntoResponse, Response},
};
use serde_json::{json, Value};
use tokio::time::Instant;

use super::{rfc3339, AdminState};
use crate::{
    policy::budget::Usage,
    state::{
        live::SessionKey,
        sessions::{lock, GuardRef},
    },
};

const PAGE: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// Sessions listed when the poll names no `limit`, and the most it may ask for.
const DEFAULT_LIMIT: usize = 200;
const MAX_LIMIT: usize = 1000;

/// Models listed per tenant, by spend.
const TOP_MODELS: usize = 5;

/// The page and its assets: no data in them, so no token; headers that keep them from
/// being framed, cached, or made to load anything from elsewhere.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
        img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; \
        frame-ancestors 'none'";
    let headers = [
        (header::CONTENT_TYPE, content_type),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
    ];
    (headers, body).into_response()
}

pub async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

/// The poll's query: `tenant`, `state` and `limit`, each optional.
#[derive(Debug, Default, PartialEq)]
struct Filter {
    tenant: Option<String>,
    state: Option<String>,
    limit: usize,
}

impl Filter {
    fn parse(query: Option<&str>) -> Filter {
        let mut filter = Filter {
            limit: DEFAULT_LIMIT,
            ..Filter::default()
        };
        for pair in query.unwrap_or_default().split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = value.replace('+', " ");
            let value = percent_encoding::percent_decode_str(&value)
                .decode_utf8_lossy()
                .into_owned();
            if value.is_empty() {
                continue;
            }
            match key {
                "tenant" => filter.tenant = Some(value),
                "state" => filter.state = Some(value),
                "limit" => {
                    if let Ok(n) = value.parse::<usize>() {
                        filter.limit = n.min(MAX_LIMIT);
                    }
                }
                _ => {}
            }
        }
        filter
    }
}

/// A session's state for a tenant without a guard: budgets only.
const UNGUARDED: &str = "unguarded";

/// Most urgent first.
fn urgency(state: &str) -> u8 {
    match state {
        "tripped" => 0,
        "guided" => 1,
        "probing" => 2,
        "waiting" => 3,
        "recovering" => 4,
        "closed" => 5,
        "recovered" => 6,
        "active" => 7,
        _ => 8,
    }
}

/// One row of the sessions table.
struct Row {
    key: SessionKey,
    state: &'static str,
    used: Usage,
    /// The guard's entry, for guarded sessions: its signals are read only for the rows
    /// shown.
    guard: Option<GuardRef>,
    risk: f64,
}

impl Row {
    fn to_json(&self, now: Instant) -> Value {
        let signals = self
            .guard
            .as_ref()
            .map(|g| lock(g).signals(now, self.used.usd));
        let field = |name: &str| signals.as_ref().map_or(Value::Null, |s| s[name].clone());
        json!({
            "tenant": &*self.key.0,
            "session": self.key.1,
            "state": self.state,
            "risk": field("risk"),
            "consecutive_failures": field("consecutive_failures"),
            "calls": self.used.calls,
            "tokens": self.used.tokens,
            "usd": crate::policy::budget::Usd(self.used.usd),
            "trip": field("trip"),
        })
    }
}

/// `GET /admin/ui/data`: upstreams, tenants, live sessions and the last hour's recovery.
pub async fn data(State(state): State<AdminState>, RawQuery(query): RawQuery) -> Response {
    let filter = Filter::parse(query.as_deref());
    let wall_ms = state.budgets.clock().now_ms();
    let sessions = sessions(&state, &filter);
    let body = json!({
        "generated_at": rfc3339(wall_ms),
        "memory_only": "Recovery, upstream attempts and transitions are this process's memory of the last hour; sessions are those in memory now. None of it survives a restart.",
        "config": state.reload.upgrade().map(|r| r.stamp()),
        "upstreams": upstreams(&state),
        "tenants": tenants(&state).await,
        "fleet": fleet(&state).await,
        "restarts": restarts(&state).await,
        "sessions": sessions,
        "recovery": {
            "minute_ms": 60_000,
            "minutes": state.activity.report(tokio::time::Instant::now()),
        },
    });
    // `Cache-Control: no-store` is added to every admin answer by `admin::routes`.
    let headers = [(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    )];
    (headers, body.to_string()).into_response()
}

fn upstreams(state: &AdminState) -> Vec<Value> {
    let now = tokio::time::Instant::now();
    let mut all: Vec<_> = state.health.iter().collect();
    all.sort_by_key(|(name, _)| *name);
    all.into_iter()
        .map(|(name, health)| {
            let ms = |q| health.latency_quantile(q, 1).map(|d| d.as_secs_f64() * 1e3);
            json!({
                "name": name,
                "api": state.upstream_apis.get(name).map(|api| api.as_str()),
                "breaker": health.snapshot(now),
                "latency_ms": {"p50": ms(0.5), "p95": ms(0.95)},
                "hour": health.activity().report(now),
            })
        })
        .collect()
}

async fn tenants(state: &AdminState) -> Vec<Value> {
    let mut out = Vec::new();
    for name in state.budgets.tenant_names() {
        let guarded = state.guards.is_guarded(&name);
        let mut report = match state.budgets.tenant_report(&name).await {
            Ok(Some(report)) => report,
            Ok(None) => continue,
            Err(err) => json!({"tenant": &*name, "error": err.to_string()}),
        };
        if let Some(models) = report["by_model"].as_array_mut() {
            models.sort_by(|a, b| {
                let usd = |m: &Value| m["usd"].as_f64().unwrap_or(0.0);
                usd(b).total_cmp(&usd(a))
            });
            models.truncate(TOP_MODELS);
        }
        report["guarded"] = guarded.into();
        out.push(report);
    }
    out
}

/// Signatures shown per tenant on the dashboard.
const FLEET_SIGNATURES: usize = 10;

/// Each fleet tenant's view: its hot signatures first, and how well it predicts.
async fn fleet(state: &AdminState) -> Vec<Value> {
    let mut out = Vec::new();
    for tenant in state.fleet.tenants() {
        if let Some(report) = state.fleet.report(&tenant).await {
            out.push(super::fleet::report_json(
                &tenant,
                &report,
                FLEET_SIGNATURES,
            ));
        }
    }
    out
}

/// Each guarded tenant's restart record, as `GET /admin/tenants/{t}/guard` answers it.
async fn restarts(state: &AdminState) -> Vec<Value> {
    let mut out = Vec::new();
    for tenant in state.budgets.tenant_names() {
        if let Some(policy) = state.guards.policy(&tenant) {
            let report = state.guards.restarts().report(&tenant).await;
            out.push(super::restarts::report_json(&tenant, policy, &report));
        }
    }
    out
}

/// The live sessions (budget books and guards, joined), filtered, most urgent first,
/// at most `limit` of them, with the total and the count in each state.
fn sessions(state: &AdminState, filter: &Filter) -> Value {
    let now = state.guards.now();
    let wanted = |tenant: &str| filter.tenant.as_deref().is_none_or(|t| t == tenant);
    let mut used: HashMap<SessionKey, Usage> = state
        .budgets
        .live_sessions()
        .into_iter()
        .filter(|(key, _)| wanted(&key.0))
        .collect();
    let mut rows: Vec<Row> = Vec::new();
    let mut by_state: HashMap<&'static str, u64> = HashMap::new();
    let mut keep = |row: Row| {
        *by_state.entry(row.state).or_default() += 1;
        if filter.state.as_deref().is_none_or(|s| s == row.state) {
            rows.push(row);
        }
    };
    for (key, entry) in state.guards.live() {
        if !wanted(&key.0) {
            continue;
        }
        let spent = used.remove(&key).unwrap_or_default();
        let (phase, risk) = {
            let guard = lock(&entry);
            (
                guard.guard.state().phase().label(),
                guard.risk(now, spent.usd),
            )
        };
        let row = Row {
            key,
            state: phase,
            used: spent,
            guard: Some(entry),
            risk,
        };
        keep(row);
    }
    for (key, spent) in used {
        let state = if state.guards.is_guarded(&key.0) {
            // A budget book whose guard left memory first: nothing to say yet.
            "active"
        } else {
            UNGUARDED
        };
        let row = Row {
            key,
            state,
            used: spent,
            guard: None,
            risk: 0.0,
        };
        keep(row);
    }
    let total = rows.len();
    rows.sort_by(|a, b| {
        urgency(a.state)
            .cmp(&urgency(b.state))
            .then(b.risk.total_cmp(&a.risk))
            .then(b.used.usd.total_cmp(&a.used.usd))
            .then_with(|| a.key.cmp(&b.key))
    });
    rows.truncate(filter.limit);
    json!({
        "total": total,
        "limit": filter.limit,
        "by_state": by_state,
        "items": rows.iter().map(|row| row.to_json(now)).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_is_read_leniently_and_bounded() {
        assert_eq!(
            Filter::parse(None),
            Filter {
                tenant: None,
                state: None,
                limit: DEFAULT_LIMIT
            }
        );
        assert_eq!(
            Filter::parse(Some("tenant=team%20a&state=tripped&limit=5000&x=1&empty=")),
            Filter {
                tenant: Some("team a".into()),
                state: Some("tripped".into()),
                limit: MAX_LIMIT
            }
        );
        assert_eq!(
            Filter::parse(Some("limit=abc&tenant=")).limit,
            DEFAULT_LIMIT
        );
    }
}
