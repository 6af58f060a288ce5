//! `GET /admin/tenants/{tenant}/guard`: how well a guarded tenant's restarts work. Per
//! strategy (`guide`: a looping session told once to change course; `wait`: a session
//! told when to come back while every breaker is open) and in total: the sessions it took
//! on, recovered and tripped after it, the restart success rate (recovered ÷ taken on),
//! and the time from a session's first failure to its recovery (mean, p90); the sessions
//! failed at once with a diagnosis (`fail_fast`); trips by rule; and what the trips
//! saved (requests refused, each at its session's mean call cost). The dashboard shows
//! the same beside the fleet prediction's precision.

use std::sync::Arc;

use axum::{
    extract::{Path, State},
    response::Response,
    Extension,
};
use serde_json::{json, Value};

use super::{answer, AdminError, AdminState};
use crate::{
    policy::{budget::Usd, guard::GuardPolicy},
    state::restarts::{RestartReport, Strategy, Tally},
    telemetry::RequestLog,
};

fn round(x: Option<f64>, places: i32) -> Option<f64> {
    let scale = 10f64.powi(places);
    x.map(|x| (x * scale).round() / scale)
}

fn tally_json(t: &Tally) -> Value {
    json!({
        "sessions": t.began,
        "recovered": t.recovered,
        "tripped_after": t.tripped,
        "success_rate": round(t.success_rate(), 4),
        "mttr_seconds": {"mean": round(t.mttr_mean(), 3), "p90": round(t.mttr_p90(), 3)},
    })
}

/// A tenant's restart record as JSON.
pub fn report_json(tenant: &str, policy: &GuardPolicy, r: &RestartReport) -> Value {
    let mut strategies = serde_json::Map::new();
    for s in Strategy::ALL {
        strategies.insert(s.label().into(), tally_json(r.tally(s)));
    }
    json!({
        "tenant": tenant,
        "backend": r.backend,
        "error": r.error,
        "policy": {
            "guide": policy.guide,
            "same_error_limit": policy.same_error_limit,
            "cool_down_seconds": policy.cool_down.as_secs_f64(),
        },
        "strategies": strategies,
        "total": tally_json(&r.total()),
        "fail_fast": {"sessions": r.trips.get("unrecoverable").copied().unwrap_or(0)},
        "trips_by_rule": r.trips,
        "saved_by_trips": {"calls": r.refused, "usd": Usd(r.saved_usd)},
    })
}

/// `GET /admin/tenants/{tenant}/guard`: 404 for a tenant without `[tenants.guard]`.
pub async fn guard_view(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path(tenant): Path<String>,
) -> Response {
    let view = async {
        let policy = state
            .guards
            .policy(&tenant)
            .cloned()
            .ok_or(AdminError::NotFound {
                what: "tenant with a guard",
            })?;
        let report = state.guards.restarts().report(&tenant).await;
        Ok(report_json(&tenant, &policy, &report))
    };
    answer(&log, view.await)
}
