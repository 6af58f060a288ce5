//! The operator API, behind `[admin] token`: upstream breakers, tenant spend and
//! budgets, session figures, reset and close. A reset or close is written to the store
//! before it is answered; if it cannot be, the answer is 503 `store_unavailable`. Plus one tenant-facing read: a tenant key may read
//! its own sessions' budgets (`GET /v1/sessions/{id}`), and nothing of other tenants.

use axum::{
    extract::{Path, State},
    http::{header, HeaderMap},
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use serde_json::{json, Value};

use crate::{
    app::AppState,
    config::ApiKind,
    error::{respond::error_response, GatewayError},
    layers::auth::{presented_key, same_key},
};

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/admin/upstreams", get(upstreams))
        .route("/admin/tenants/{tenant}", get(tenant))
        .route("/admin/tenants/{tenant}/sessions/{session}", get(session))
        .route(
            "/admin/tenants/{tenant}/sessions/{session}/reset",
            post(reset_session),
        )
        .route(
            "/admin/tenants/{tenant}/sessions/{session}/close",
            post(close_session),
        )
        .route("/v1/sessions/{session}", get(own_session))
}

fn json_response(value: Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn refuse(err: GatewayError) -> Response {
    let mut response = error_response(&err, ApiKind::OpenAi);
    crate::error::respond::mark_no_retry(&mut response);
    response
}

/// The admin token, compared in constant time; the admin API is off without one.
fn admin_auth(state: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let Some(token) = &state.config.admin.token else {
        return Err(Box::new(refuse(GatewayError::AdminDisabled)));
    };
    let presented = presented_key(headers).unwrap_or_default();
    if same_key(token.expose().as_bytes(), presented) {
        Ok(())
    } else {
        Err(Box::new(refuse(GatewayError::AdminUnauthorized)))
    }
}

/// `GET /admin/upstreams`: each upstream's breaker.
async fn upstreams(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(r) = admin_auth(&state, &headers) {
        return *r;
    }
    let now = tokio::time::Instant::now();
    let upstreams: Vec<_> = state
        .health
        .snapshot(now)
        .into_iter()
        .map(|(name, breaker)| {
            let api = state.upstreams.get(&name).map(|u| u.api.as_str());
            json!({"name": name, "api": api, "breaker": breaker})
        })
        .collect();
    json_response(json!({"upstreams": upstreams}))
}

/// `GET /admin/tenants/{tenant}`: today's spend, by model, and what is left.
async fn tenant(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Response {
    if let Err(r) = admin_auth(&state, &headers) {
        return *r;
    }
    match state.budgets.tenant_report(&tenant).await {
        Ok(Some(report)) => json_response(report),
        Ok(None) => refuse(GatewayError::NotFoundAdmin { what: "tenant" }),
        Err(err) => refuse(store_error(err)),
    }
}

/// `GET /admin/tenants/{tenant}/sessions/{session}`.
async fn session(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    if let Err(r) = admin_auth(&state, &headers) {
        return *r;
    }
    match session_view(&state, &tenant, &session).await {
        Ok(Some(report)) => json_response(report),
        Ok(None) => refuse(GatewayError::NotFoundAdmin { what: "tenant" }),
        Err(err) => refuse(err),
    }
}

fn store_error(err: crate::store::StoreError) -> GatewayError {
    GatewayError::StoreUnavailable {
        detail: err.to_string(),
    }
}

/// Budgets, and for guarded tenants the guard's signals and the recovery trace.
async fn session_view(
    state: &AppState,
    tenant: &str,
    session: &str,
) -> Result<Option<Value>, GatewayError> {
    let Some(mut report) = state
        .budgets
        .session_report(tenant, session)
        .await
        .map_err(store_error)?
    else {
        return Ok(None);
    };
    let session_usd = state.budgets.session_usd(tenant, session).await;
    if let Some(guard) = state.guards.report(tenant, session, session_usd).await {
        report["guard"] = guard;
    }
    Ok(Some(report))
}

/// The session's view after an operator's action.
async fn view_after(state: &AppState, tenant: &str, session: &str) -> Response {
    match session_view(state, tenant, session).await {
        Ok(report) => json_response(report.unwrap_or(Value::Null)),
        Err(err) => refuse(err),
    }
}

/// `POST /admin/tenants/{tenant}/sessions/{session}/close`: refuse the session for good.
async fn close_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    if let Err(r) = admin_auth(&state, &headers) {
        return *r;
    }
    match state.guards.close(&tenant, &session).await {
        Ok(true) => {}
        Ok(false) => {
            return refuse(GatewayError::NotFoundAdmin {
                what: "guarded tenant",
            })
        }
        Err(err) => return refuse(store_error(err)),
    }
    view_after(&state, &tenant, &session).await
}

/// `POST /admin/tenants/{tenant}/sessions/{session}/reset`: the session starts over.
async fn reset_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((tenant, session)): Path<(String, String)>,
) -> Response {
    if let Err(r) = admin_auth(&state, &headers) {
        return *r;
    }
    match state.budgets.reset_session(&tenant, &session).await {
        Ok(true) => {}
        Ok(false) => return refuse(GatewayError::NotFoundAdmin { what: "tenant" }),
        Err(err) => return refuse(store_error(err)),
    }
    if let Err(err) = state.guards.reset(&tenant, &session).await {
        return refuse(store_error(err));
    }
    tracing::info!(%tenant, %session, "session reset by an operator");
    view_after(&state, &tenant, &session).await
}

/// `GET /v1/sessions/{session}` with a tenant key: that tenant's own session only.
async fn own_session(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(session): Path<String>,
) -> Response {
    let Some(tenant) = presented_key(&headers).and_then(|k| state.tenants.lookup(k)) else {
        return refuse(GatewayError::Unauthorized);
    };
    match state.budgets.session_report(&tenant.name, &session).await {
        Ok(Some(report)) => json_response(report),
        Ok(None) => refuse(GatewayError::NotFoundAdmin { what: "session" }),
        Err(err) => refuse(store_error(err)),
    }
}
