//! `GET /admin/tenants/{tenant}/fleet`: a tenant's fleet view and how well it predicts.
//! The hot signatures first (sessions, first and last seen, state, the next probe), then
//! the prediction's own record: trips by reason, predictions confirmed (the session
//! failed that way again) and not (its next request of that shape succeeded), and the
//! upstream calls and spend the refusals avoided. The dashboard shows the same.

use std::sync::Arc;

use axum::{
    extract::{Path, RawQuery, State},
    response::Response,
    Extension,
};
use serde_json::{json, Value};

use super::{answer, rfc3339, AdminError, AdminState};
use crate::{
    error::GatewayError,
    policy::{
        budget::Usd,
        fleet::{total_record, Record, SignatureReport, SignatureState},
    },
    state::fleet::FleetReport,
    telemetry::RequestLog,
};

/// Signatures listed when the query names no `limit`, and the most it may ask for.
const DEFAULT_LIMIT: usize = 50;
const MAX_LIMIT: usize = 500;

fn record_json(r: &Record) -> Value {
    json!({
        "tripped": r.tripped,
        "preempted": r.preempted,
        "confirmed": r.confirmed,
        "unconfirmed": r.unconfirmed,
        "avoided_calls": (r.avoided_calls * 10.0).round() / 10.0,
        "avoided_usd": Usd(r.avoided_usd),
    })
}

fn signature_json(s: &SignatureReport) -> Value {
    let mut out = json!({
        "id": s.id.to_string(),
        "description": &*s.description,
        "state": s.state.label(),
        "sessions": s.sessions,
        "sessions_at_min_failures": s.qualified,
        "failures": s.failures,
        "first_seen": rfc3339(s.first_ms),
        "last_seen": rfc3339(s.last_ms),
        "pending": s.pending,
        "record": record_json(&s.record),
    });
    match s.state {
        SignatureState::Hot {
            since_ms,
            probe_at_ms,
        } => {
            out["hot_since"] = rfc3339(since_ms).into();
            out["next_probe"] = rfc3339(probe_at_ms).into();
        }
        SignatureState::Cooled { at_ms } => out["cooled_at"] = rfc3339(at_ms).into(),
        SignatureState::Warm => {}
    }
    out
}

/// A tenant's fleet view as JSON, with at most `limit` signatures.
pub fn report_json(tenant: &str, report: &FleetReport, limit: usize) -> Value {
    let mut record = report.totals.past;
    record.add(&total_record(&report.signatures));
    let decided = record.confirmed + record.unconfirmed;
    let p = &report.policy;
    json!({
        "tenant": tenant,
        "backend": report.backend,
        "error": report.error,
        "policy": {
            "min_sessions": p.min_sessions,
            "min_failures": p.min_failures,
            "window": humantime::format_duration(p.window).to_string(),
            "preempt": p.preempt,
            "cool_down": humantime::format_duration(p.cool_down).to_string(),
        },
        "hot": report.signatures.iter().filter(|s| matches!(s.state, SignatureState::Hot { .. })).count(),
        "counted": report.signatures.len(),
        "trips_by_reason": report.totals.trips_by_reason,
        "predictions": {
            "confirmed": record.confirmed,
            "unconfirmed": record.unconfirmed,
            "pending": report.signatures.iter().map(|s| u64::from(s.pending)).sum::<u64>(),
            "expired": report.totals.expired,
            // Of the predictions judged, the share confirmed.
            "precision": (decided > 0).then(|| (record.confirmed as f64 / decided as f64 * 1000.0).round() / 1000.0),
        },
        "record": record_json(&record),
        "untracked_failures": report.totals.untracked,
        "signatures": report.signatures.iter().take(limit).map(signature_json).collect::<Vec<_>>(),
    })
}

fn limit_param(query: Option<&str>) -> Result<usize, AdminError> {
    let Some(value) = query
        .unwrap_or_default()
        .split('&')
        .find_map(|pair| pair.strip_prefix("limit="))
    else {
        return Ok(DEFAULT_LIMIT);
    };
    match value.parse::<usize>() {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(AdminError::Gateway(GatewayError::InvalidParameter {
            param: "limit",
            detail: format!("expected a whole number from 1 to {MAX_LIMIT}, got `{value}`"),
        })),
    }
}

/// `GET /admin/tenants/{tenant}/fleet` (`?limit=N`, 1 to 500 signatures; 50 by default):
/// 404 for a tenant without `[tenants.guard.fleet]`.
pub async fn fleet_view(
    State(state): State<AdminState>,
    Extension(log): Extension<Arc<RequestLog>>,
    Path(tenant): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let view = async {
        let limit = limit_param(query.as_deref())?;
        let report = state
            .fleet
            .report(&tenant)
            .await
            .ok_or(AdminError::NotFound {
                what: "tenant with a fleet view",
            })?;
        Ok(report_json(&tenant, &report, limit))
    };
    answer(&log, view.await)
}
