//! The operator API, behind `[admin] token`: upstream breakers, tenant spend and
//! budgets, session figures, reset and close, the fleet's failure signatures
//! ([`fleet`]). A reset or close is written to the store
//! before it is answered; if it cannot be, the answer is 503 `store_unavailable`. Plus one
//! tenant-facing read: a tenant key may read its own sessions' budgets
//! (`GET /v1/sessions/{id}`), and nothing of other tenants.
//!
//! Every route passes the same edge as the proxy (request id, log line, metrics with
//! `endpoint="admin"` or `"sessions"`) and the respond layer (errors in the OpenAI shape,
//! `x-should-retry: false`). Then, on the operator routes, [`AdminAuthLayer`]; on the
//! tenant route, the tenant [`AuthLayer`] and the tenant's request rate, as for any
//! tenant call. The handlers see only [`AdminState`], which `app` builds.
//!
//! The operator dashboard ([`dashboard`]): its page at `GET /admin/ui` (no token: it
//! holds no data) and its one poll, `GET /admin/ui/data`, behind the admin token.
//!
//! Every answer of the operator and session routes, refusals included, carries
//! `Cache-Control: no-store`: spend, keys' sessions and config are never for a cache.

mod auth;
mod dashboard;
mod error;
mod fleet;
mod reload;
mod restarts;

use std::{collections::HashMap, convert::Infallible, sync::Arc};

use axum::{
    extract::{Path, RawQuery, State},
    http::{header, HeaderValue},
    response::{IntoResponse, Response},
    routing::{get, post},
    Extension, Router,
};
use serde_json::{json, Value};
use tower::ServiceBuilder;

pub use auth::{AdminAuth, AdminAuthLayer};
pub use error::AdminError;
pub use reload::{no_reload, ConfigStamp, Reload, Reloaded};

use crate::{
    error::GatewayError,
    layers::{
        auth::{AuthLayer, Tenant, TenantKeys},
        edge::{self, EdgeLayer},
        respond::RespondLayer,
    },
    state::{
        activity::Activity,
        budgets::{Budgets, MAX_REPORT_DAYS},
        fleet::Fleet,
        health::HealthRegistry,
        journal::Journal,
        sessions::SessionGuards,
    },
    telemetry::RequestLog,
    wire::Wire,
};

/// What the admin API reads and changes, and nothing else of the gateway.
#[derive(Clone)]
pub struct AdminState {
    /// The running server's reloader (`POST /admin/reload`); weak, since the server
    /// holds the routes that hold this.
    pub reload: std::sync::Weak<dyn Reload>,
    pub health: Arc<HealthRegistry>,
    /// Each upstream's API, by upstream name.
    pub upstream_apis: Arc<HashMap<String, crate::config::UpstreamApi>>,
    pub budgets: Arc<Budgets>,
    pub guards: Arc<SessionGuards>,
    /// Sessions' side-effect journals.
    pub journal: Arc<Journal>,
    /// The fleet views: hot signatures and how well they predict.
    pub fleet: Arc<Fleet>,
    /// Tenant keys, for `GET /v1/sessions/{id}`.
    pub tenants: Arc<TenantKeys>,
    /// `[admin] token`; `None` turns the operator routes off (403 `admin_disabled`).
    pub token: Option<Arc<str>>,
    /// The last hour of requests and recovery, for the dashboard.
    pub activity: Arc<Activity>,
    /// `server.max_session_id_bytes`, for the request span.
    pub max_session_id_bytes: usize,
}

/// The admin and session routes, each behind the edge, respond and auth layers.
pub fn routes<S: Clone + Send + Sync + 'static>(state: AdminState) -> Router<S> {
    let operator = ServiceBuilder::new()
        .layer(EdgeLayer::default())
        .layer(RespondLayer)
        .layer(AdminAuthLayer::new(state.token.clone()))
        .map_response(edge::unwrap_body)
        .layer(edge::span_layer(state.max_session_id_bytes))
        .map_err(never);
    let tenant = ServiceBuilder::new()
        .layer(EdgeLayer::default())
        .layer(RespondLayer)
        .layer(AuthLayer::new(state.tenants.clone()))
        .map_response(edge::unwrap_body)
        .layer(edge::span_layer(state.max_session_id_bytes))
        .map_err(never);
    let admin = Router::new()
        .route("/admin/upstreams", get(upstreams))
        .route("/admin/tenants/{tenant}", get(tenant_view))
        .route("/admin/tenants/{tenant}/fleet", get(fleet::fleet_view))
        .route("/admin/tenants/{tenant}/guard", get(restarts::guard_view))
        .route("/admin/tenants/{tenant}/sessions/{session}", get(session))
        .route(
            "/admin/tenants/{tenant}/sessions/{session}/journal",
            get(operator_journal),
        )
        .route(
            "/admin/tenants/{tenant}/sessions/{session}/reset",
            post(reset_session),
        )
        .route(
            "/admin/tenants/{tenant}/sessions/{session}/close",
            post(close_session),
        )
        .route("/admin/ui/data", get(dashboard::data))
        .route("/admin/state", get(state_view))
        .route("/admin/state/adopt", post(adopt_state))
        .route("/admin/reload", post(reload_config))
        .route("/admin/config", get(config_view))
        .route_layer(operator);
    let own = Router::new()
        .route("/v1/sessions/{session}", get(own_session))
        .route("/v1/sessions/{session}/journal", get(own_journal))
        .route_layer(tenant);
    let data = admin
        .merge(own)
        .route_layer(axum::middleware::map_response(no_store));
    // The dashboard's page and assets hold no data: served without the token.
    let page = Router::new()
        .route("/admin/ui", get(dashboard::page))
        .route("/admin/ui/app.js", get(dashboard::script))
        .route("/admin/ui/style.css", get(dashboard::style))
        .route_layer(EdgeLayer::default());
    data.merge(page).with_state(state)
}

async fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Handlers answer with a response, never an error: the layers above expect one.
fn never(never: Infallible) -> GatewayError {
    match never {}
}

fn json_response(value: Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

/// A report as JSON, or the refusal in the OpenAI shape.
fn answer(log: &RequestLog, result: Result<Value, AdminError>) -> Response {
    match result {
        Ok(value) => json_response(value),
        Err(err) => error::refuse(Some(log), &err, Wire::Chat),
    }
}

/// `GET /admin/state`: where the shared state lives and whether it answers now.
async fn state_view(State(state): State<AdminState>) -> Response {
    let Some(shared) = state.budgets.shared() else {
        return json_response(json!({"backend": "embedded", "available": true}));
    };
    let redis = &shared.redis;
    let ping = redis
        .run("ping", |mut c| async move {
            redis::cmd("PING").query_async::<String>(&mut c).await
        })
        .await;
    // Lost: an admission found it so, or a generation marker differs now.
    let lost = match &ping {
        Ok(_) => redis
            .check_generations()
            .await
            .unwrap_or_else(|_| redis.lost_tenants()),
        Err(_) => redis.lost_tenants(),
    };
    let kept = state
        .budgets
        .books()
        .queued_settles(10_000)
        .await
        .map(|q| q.len());
    json_response(json!({
        "backend": "redis",
        "available": ping.is_ok() && lost.is_empty(),
        "reachable": ping.is_ok(),
        "error": ping.err().map(|e| e.to_string()),
        "failing_fast": redis.failing_fast(),
        // Budgeted calls of these tenants are refused (503 state_unavailable) until an
        // operator restores the data and calls POST /admin/state/adopt on any replica.
        "state_lost": !lost.is_empty(),
        "lost_tenants": lost,
        "settles_kept": kept.ok(),
        "on_unavailable": format!("{:?}", redis.on_unavailable).to_lowercase(),
        "replicas": redis.replicas,
        "reservation_ttl_ms": redis.reservation_ttl.as_millis() as u64,
        "blind_admissions": redis.blind_admissions(),
        // Breakers are this replica's own view (docs/operations.md, "Running several replicas").
        "breakers": "per replica: GET /admin/upstreams on each",
    }))
}

/// `POST /admin/state/adopt`: after Redis lost its data and was restored (or accepted as
/// empty), work under what it holds now.
async fn adopt_state(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
) -> Response {
    let adopted = async {
        let Some(shared) = state.budgets.shared() else {
            return Ok(json!({"adopted": false, "backend": "embedded"}));
        };
        shared.redis.adopt().await.map_err(|err| {
            AdminError::from(GatewayError::StateUnavailable {
                detail: err.to_string(),
                retry_after: std::time::Duration::from_secs(1),
            })
        })?;
        Ok(json!({"adopted": true, "backend": "redis"}))
    };
    answer(&log, adopted.await)
}

/// `POST /admin/reload`: re-read the config file and swap it in (as `SIGHUP` does); 400
/// `config_invalid` with the key-path errors when it is invalid (the running config is
/// kept).
async fn reload_config(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
) -> Response {
    let reloaded = match state.reload.upgrade() {
        Some(reload) => reload.reload().await.map(|r| r.to_json()),
        None => Err(AdminError::ReloadUnavailable("the server is shutting down")),
    };
    answer(&log, reloaded)
}

/// `GET /admin/config`: which config is running (version, load time, file).
async fn config_view(State(state): State<AdminState>) -> Response {
    let stamp = state.reload.upgrade().map(|r| r.stamp());
    json_response(json!({ "config": stamp }))
}

/// `GET /admin/upstreams`: each upstream's breaker.
async fn upstreams(State(state): State<AdminState>) -> Response {
    let now = tokio::time::Instant::now();
    let upstreams: Vec<_> = state
        .health
        .snapshot(now)
        .into_iter()
        .map(|(name, breaker)| {
            let api = state.upstream_apis.get(&name).map(|api| api.as_str());
            json!({"name": name, "api": api, "breaker": breaker})
        })
        .collect();
    json_response(json!({"upstreams": upstreams}))
}

/// `GET /admin/tenants/{tenant}`: today's spend, by model, and what is left; with
/// `?days=N` (1 to 366), also `by_day`: the ledger's spend by UTC day and model over the
/// last N days, today included.
async fn tenant_view(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path(tenant): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let report = async {
        let days = days_param(query.as_deref())?;
        let Some(mut report) = state.budgets.tenant_report(&tenant).await? else {
            return Err(AdminError::NotFound { what: "tenant" });
        };
        if let Some(days) = days {
            if let Some(by_day) = state.budgets.tenant_days(&tenant, days).await? {
                report["days"] = days.into();
                report["by_day"] = by_day;
            }
        }
        Ok(report)
    };
    answer(&log, report.await)
}

/// The tenant view's `days`: absent, or a whole number of days from 1 to
/// [`MAX_REPORT_DAYS`]; anything else is refused by name.
/// Milliseconds since the Unix epoch as an RFC 3339 time, to the second (the admin
/// views' timestamps).
fn rfc3339(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}

fn days_param(query: Option<&str>) -> Result<Option<u32>, AdminError> {
    let Some(value) = query
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("days="))
    else {
        return Ok(None);
    };
    match value.parse::<u32>() {
        Ok(days) if (1..=MAX_REPORT_DAYS).contains(&days) => Ok(Some(days)),
        _ => Err(AdminError::Gateway(GatewayError::InvalidParameter {
            param: "days",
            detail: format!(
                "expected a whole number of days from 1 to {MAX_REPORT_DAYS}, got `{value}`"
            ),
        })),
    }
}

/// `GET /admin/tenants/{tenant}/sessions/{session}`.
async fn session(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    let report = session_view(&state, &tenant, &session)
        .await
        .and_then(|r| r.ok_or(AdminError::NotFound { what: "tenant" }));
    answer(&log, report)
}

/// Budgets, and for guarded tenants the guard's signals and the recovery trace.
async fn session_view(
    state: &AdminState,
    tenant: &str,
    session: &str,
) -> Result<Option<Value>, AdminError> {
    let Some(mut report) = state.budgets.session_report(tenant, session).await? else {
        return Ok(None);
    };
    let session_usd = state.budgets.session_usd(tenant, session).await;
    if let Some(guard) = state.guards.report(tenant, session, session_usd).await {
        report["guard"] = guard;
    }
    // The journal is the report's extra: a store that cannot read it leaves it out.
    let journal = state
        .journal
        .session(tenant, session)
        .await
        .unwrap_or_default();
    let committed: Vec<Value> = journal
        .entries
        .iter()
        .filter(|e| e.is_committed())
        .map(|e| e.to_json())
        .collect();
    if !committed.is_empty() {
        report["side_effects"] = json!({"committed": committed});
    }
    Ok(Some(report))
}

/// A session's side-effect journal, oldest first: `{"session": ..., "entries": [...]}`;
/// none (a session with no journaled call, or another tenant's) is 404.
async fn journal_view(
    state: &AdminState,
    tenant: &str,
    session: &str,
) -> Result<Value, AdminError> {
    let journal = state.journal.session(tenant, session).await?;
    if journal.entries.is_empty() {
        return Err(AdminError::NotFound {
            what: "session journal",
        });
    }
    let entries: Vec<Value> = journal.entries.iter().map(|e| e.to_json()).collect();
    Ok(json!({"session": session, "entries": entries}))
}

/// `GET /v1/sessions/{session}/journal`, with the tenant's own key.
async fn own_journal(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Extension(tenant): Extension<Arc<Tenant>>,
    Path(session): Path<String>,
) -> Response {
    let view = async {
        // As `GET /v1/sessions/{id}`: a read of the tenant's, held to its request rate.
        state
            .budgets
            .check_rate(&tenant.name, None)
            .await
            .map_err(GatewayError::from)?;
        journal_view(&state, &tenant.name, &session).await
    };
    answer(&log, view.await)
}

/// `GET /admin/tenants/{tenant}/sessions/{session}/journal`.
async fn operator_journal(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    answer(&log, journal_view(&state, &tenant, &session).await)
}

/// The session's view after an operator's action.
async fn view_after(state: &AdminState, tenant: &str, session: &str) -> Result<Value, AdminError> {
    Ok(session_view(state, tenant, session)
        .await?
        .unwrap_or(Value::Null))
}

/// `POST /admin/tenants/{tenant}/sessions/{session}/close`: refuse the session for good.
async fn close_session(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    let closed = async {
        if !state.guards.close(&tenant, &session).await? {
            return Err(AdminError::NotFound {
                what: "guarded tenant",
            });
        }
        view_after(&state, &tenant, &session).await
    };
    answer(&log, closed.await)
}

/// `POST /admin/tenants/{tenant}/sessions/{session}/reset`: the session starts over.
async fn reset_session(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    let reset = async {
        if !state.budgets.reset_session(&tenant, &session).await? {
            return Err(AdminError::NotFound { what: "tenant" });
        }
        state.guards.reset(&tenant, &session).await?;
        tracing::info!(%tenant, %session, "session reset by an operator");
        view_after(&state, &tenant, &session).await
    };
    answer(&log, reset.await)
}

/// `GET /v1/sessions/{session}` with a tenant key: that tenant's own session only, within
/// the tenant's request rate like any of its calls.
async fn own_session(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Extension(tenant): Extension<Arc<Tenant>>,
    Path(session): Path<String>,
) -> Response {
    let report = async {
        state
            .budgets
            .check_rate(&tenant.name, None)
            .await
            .map_err(GatewayError::from)?;
        state
            .budgets
            .session_report(&tenant.name, &session)
            .await?
            .ok_or(AdminError::NotFound { what: "session" })
    };
    let report = report.await;
    answer(&log, report)
}
