//! Admission layer (after idempotency, before validation): what a client request must
//! pass before it runs, and what its session learns after.
//!
//! Before: the tenant's and the session's request rate (governor GCRA), the session's
//! concurrent requests, and, for a guarded tenant's session, the session guard, which
//! stops one agent's own loops that upstream breakers cannot see: it fingerprints the
//! request and admits or refuses it ([`SessionGuard::admit`]). Refuses with 429
//! `rate_limited` (Retry-After from the limiter's own wait), `too_many_concurrent`,
//! `session_tripped` or `loop_detected` (Retry-After until the probe, and a message
//! naming the rule and its evidence), before any upstream call.
//!
//! In replica mode all of that is one round trip to Redis ([`Budgets::gate`]): the
//! limits and the guard's compare-and-set write-back in one script, which also makes the
//! first upstream attempt's budget reservation (what the meter would reserve for the
//! route's first target; handed to the attempt through [`Call::prepaid`], given back
//! uncharged if no attempt asks for it), so a request reaches the upstream after one
//! round trip instead of two. After the call the
//! settle of its last upstream call (the meter's one round trip) hands back what the
//! session holds and its guard's version, so the remaining-budget header and the
//! guard's record of a success need no other read or write; only a failure (which
//! changes the guard) writes the guard again.
//!
//! For a tenant with `[tenants.guard.fleet]`, the session's failures are also counted in
//! the tenant's fleet view ([`Fleet`]): a failure whose signature is hot trips the
//! session at once (rule `fleet_pattern`, the signature and how many sessions shared it
//! as evidence; in replica mode counted and imposed in the guard's one write after the
//! call), and with `preempt` a request whose shape is a hot signature's is refused
//! (429 `session_tripped`, `fleet_pattern`) before the limits or any attempt, unless it
//! is the signature's probe. Nothing of this is hashed or asked on the success path
//! unless the tenant has a hot signature or a prediction pending.
//!
//! The concurrency slot is held until the response body ends, so a stream counts while
//! it streams. Every response of a guarded session carries `x-backstop-session-state`,
//! and of a budgeted one `x-backstop-budget-remaining`. A trip is written to the store
//! when it happens (and forgotten when the session is active again), so it outlives a
//! restart or the session idling out of memory. A session whose kept or shared state
//! this replica cannot read (a newer release's format) is refused with 503
//! `state_unavailable`. Spend caps are per upstream call: see the meter layer.
//!
//! [`SessionGuard::admit`]: crate::policy::guard::SessionGuard::admit

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Instant,
};

use axum::body::Body;
use http::Response;
use tower::{Layer, Service};

use super::{
    context::Call,
    meter::{self, HeldContext},
    Holding, Middleware, Stack,
};
use crate::{
    api::{fingerprint::fingerprint, signature, ParsedRequest},
    error::{Category, GatewayError},
    policy::{
        budget::SessionSeen,
        fleet::{
            Check, Failed, FailureKind, FleetPolicy, Hot, Shape, Signature, SignatureId,
            EVIDENCE_MARKS,
        },
        guard::{
            GuardState, Kept, Phase, RequestFingerprint, SessionGuard, Transition, Trip, TripCode,
            TripRule,
        },
        trail,
    },
    state::{
        budgets::{
            reservation::{Ask, Prepaid},
            Budgets, ConcurrencySlot, Gated, Refusal,
        },
        fleet::Fleet,
        guard_view::Write,
        sessions::{lock, GuardedSession, Saving, SessionGuards, TraceEntry, TraceId},
        shared::GuardWrite,
    },
    store::format::UnknownFormat,
    telemetry::{RequestLog, Trail},
};

#[derive(Clone)]
pub struct AdmissionLayer {
    budgets: Arc<Budgets>,
    guards: Arc<SessionGuards>,
    fleet: Arc<Fleet>,
}

impl AdmissionLayer {
    pub fn new(budgets: Arc<Budgets>, guards: Arc<SessionGuards>, fleet: Arc<Fleet>) -> Self {
        AdmissionLayer {
            budgets,
            guards,
            fleet,
        }
    }
}

pub type Admission<S> = Stack<AdmissionLayer, S>;

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;
    fn layer(&self, inner: S) -> Admission<S> {
        Stack::new(self.clone(), inner)
    }
}

fn transition(tenant: &str, session: &str, change: Option<Transition>, request_id: &str) {
    if let Some((from, to)) = change {
        let (from, to) = (from.label(), to.label());
        tracing::warn!(
            tenant,
            session,
            from,
            to,
            request_id,
            "session state transition"
        );
        metrics::counter!("backstop_session_transitions_total", "from" => from, "to" => to)
            .increment(1);
    }
}

/// A trip, counted by its reason (`backstop_session_trips_total{reason}`, and the
/// tenant's fleet record).
fn tripped(fleet: &Fleet, tenant: &str, guard: &SessionGuard, change: Option<Transition>) {
    if let (Some((_, Phase::Tripped)), GuardState::Tripped { trip, .. }) = (change, guard.state()) {
        let reason = trip.rule.as_str();
        metrics::counter!("backstop_session_trips_total", "reason" => reason).increment(1);
        fleet.tripped(tenant, reason);
    }
}

/// How a request failed, as the fleet's signature names it: the upstream's error
/// answered as it came (its code, else `http_<status>`), or a caller fault or malformed
/// answer of Backstop's own (an `output_invalid` with its contract's hash and first error
/// path). `None` for failures that say nothing of the request itself: an upstream
/// outage, a rate limit or timeout (transient, the breakers' and retries' business), a
/// refusal.
fn failure_kind(
    result: &Result<Response<Body>, GatewayError>,
    trail: &Trail,
    request: &ParsedRequest,
) -> Option<FailureKind> {
    match result {
        Ok(response) => {
            let status = response.status().as_u16();
            if !(400..500).contains(&status) || matches!(status, 408 | 429) {
                return None;
            }
            Some(FailureKind {
                class: if matches!(status, 401..=403) {
                    "credential_or_quota"
                } else {
                    "caller_fault"
                },
                code: trail
                    .upstream_code
                    .as_deref()
                    .map_or_else(|| format!("http_{status}"), str::to_string),
                detail: format!("HTTP {status}"),
            })
        }
        Err(err) => {
            let code = err.code();
            let (class, detail) = match (code.category(), err) {
                (Category::Malformed, GatewayError::OutputInvalid { errors, .. }) => {
                    let path = errors
                        .first()
                        .and_then(|e| e.split_once(": "))
                        .map_or("", |(path, _)| path);
                    let contract = signature::contract_hash(&request.json).unwrap_or(0);
                    (
                        "malformed",
                        format!(
                            "contract {contract:016x}, first error at {}",
                            signature::mask(if path.is_empty() { "/" } else { path })
                        ),
                    )
                }
                (Category::Malformed, _) => ("malformed", "HTTP 502".to_string()),
                (Category::CallerFault, _) => ("caller_fault", format!("HTTP {}", code.status())),
                _ => return None,
            };
            Some(FailureKind {
                class,
                code: code.as_str().to_string(),
                detail,
            })
        }
    }
}

/// A loop the guard tripped a session on, as the fleet's signature names it: the tool
/// and the hash of the result it kept returning, or the identical request.
fn loop_kind(trip: &Trip, request: &ParsedRequest) -> Option<FailureKind> {
    let detail = match trip.rule {
        TripRule::ToolLoopLimit => {
            let (name, result) = signature::last_tool_result(&request.json)?;
            format!(
                "tool {}, result {result:016x}",
                name.as_deref().unwrap_or("(unnamed)")
            )
        }
        TripRule::IdenticalRequestLimit => "identical request".to_string(),
        _ => return None,
    };
    Some(FailureKind {
        class: "loop",
        code: TripCode::LoopDetected.as_str().to_string(),
        detail,
    })
}

/// A fleet trip's evidence, as the trip and its refusals carry it.
fn fleet_trip(hot: &Hot, policy: &FleetPolicy) -> Trip {
    Trip {
        signature: Some(hot.id.0),
        ..Trip::new(TripRule::FleetPattern, hot.evidence(policy))
    }
}

/// The trip a counted failure imposes on its session, if its verdict trips it.
fn fleet_imposed(verdict: &Failed, policy: &FleetPolicy) -> Option<(Trip, std::time::Duration)> {
    let hot = verdict.trip.as_ref()?;
    Some((fleet_trip(hot, policy), policy.cool_down))
}

/// A counted failure's verdict: a confirmed prediction counted, and the trip to impose
/// (logged) if it trips the session.
fn fleet_verdict(
    g: &Guarded<'_>,
    policy: &FleetPolicy,
    verdict: &Failed,
) -> Option<(Trip, std::time::Duration)> {
    if verdict.confirmed {
        metrics::counter!("backstop_fleet_predictions_total", "outcome" => "confirmed")
            .increment(1);
    }
    if let Some(hot) = &verdict.trip {
        g.hot(hot, "tripped");
    }
    fleet_imposed(verdict, policy)
}

/// What a state change means for the store: `Some(kept)` to write (a trip, a probe, a
/// close), `Some(None)` to forget (active again), `None` for nothing to do.
fn to_keep(
    change: Option<Transition>,
    guard: &SessionGuard,
    now: tokio::time::Instant,
) -> Option<Option<Kept>> {
    let (from, to): (Phase, Phase) = change?;
    if to.is_kept() {
        Some(guard.kept(now))
    } else if from.is_kept() {
        Some(None)
    } else {
        None
    }
}

/// A session whose guard state cannot be read here is refused, not started over: a
/// retry may reach a replica that reads it.
fn unreadable(unknown: UnknownFormat) -> GatewayError {
    GatewayError::StateUnavailable {
        detail: format!("this session's guard state cannot be read by this replica: {unknown}"),
        retry_after: std::time::Duration::from_secs(1),
    }
}

async fn persist(guards: &SessionGuards, tenant: &str, session: &str, keep: Option<Option<Kept>>) {
    if let Some(kept) = keep {
        if let Err(err) = guards.persist(tenant, session, kept).await {
            // The state in memory still holds; only its survival of a restart is lost.
            tracing::error!(tenant, session, error = %err, "cannot keep the session's guard state");
        }
    }
}

/// What the gate let a request through with.
#[derive(Default)]
struct Admitted {
    /// Its place under the session's `max_concurrent`, held until its body ends.
    slot: Option<ConcurrencySlot>,
    /// Its first attempt's reservation (replica mode).
    prepaid: Option<Arc<Prepaid>>,
}

impl Admitted {
    /// The reservation goes with the call to its attempts; the slot stays here.
    fn hand_over(self, call: &mut Call) -> Option<ConcurrencySlot> {
        call.prepaid = self.prepaid;
        self.slot
    }
}

/// Holds `slot` (if any) until the response body ends.
fn holding(response: Response<Body>, slot: Option<ConcurrencySlot>) -> Response<Body> {
    match slot {
        Some(slot) => response.map(|body| Body::new(Holding { body, _guard: slot })),
        None => response,
    }
}

/// One guarded request's facts, for its trace entries.
struct Guarded<'a> {
    tenant: &'a Arc<str>,
    session: &'a str,
    entry: &'a std::sync::Mutex<GuardedSession>,
    request_id: &'a str,
    fp: &'a RequestFingerprint,
    request: &'a ParsedRequest,
    /// The route's `model` (its pattern), for the request's fleet shape.
    route: &'a str,
    /// The tenant's fleet rule, when it has one.
    fleet: Option<&'a Arc<FleetPolicy>>,
}

impl Guarded<'_> {
    fn shape(&self) -> Shape {
        signature::shape(self.route, self.request.endpoint, &self.request.json)
    }

    /// A request refused, or its session tripped (`what`), by a hot signature.
    fn hot(&self, hot: &Hot, what: &'static str) {
        tracing::warn!(
            tenant = &**self.tenant,
            session = self.session,
            signature = %hot.id,
            sessions = hot.sessions,
            request_id = self.request_id,
            what,
            "a hot failure signature (fleet_pattern)"
        );
    }

    /// A refusal's trace entry.
    fn refused(&self, e: &mut GuardedSession, trip: &Trip) {
        let state = e.guard.state().phase();
        e.trace(TraceEntry {
            request_id: TraceId::new(self.request_id),
            status: 0,
            failed: false,
            action: format!("refused:{}", trip.code().as_str()).into(),
            detail: Some(format!("{}: {}", trip.rule.as_str(), trip.evidence).into()),
            attempts: 0,
            upstream: None,
            latency_ms: 0.0,
            cost_usd: 0.0,
            tool_loop: self.fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
            state,
        });
    }
}

impl AdmissionLayer {
    /// The limits alone (no guard, or this replica's guard decides alone).
    async fn limits(
        &self,
        tenant: &str,
        session: Option<&str>,
        prepay: Option<&Ask>,
    ) -> Result<Admitted, GatewayError> {
        match self
            .budgets
            .gate(tenant, session, None, prepay)
            .await
            .map_err(GatewayError::from)?
        {
            Gated::Passed { slot, prepaid, .. } => Ok(Admitted { slot, prepaid }),
            // Only a guard write can be moved.
            Gated::Moved(..) => Ok(Admitted::default()),
        }
    }

    /// What the request's first attempt will reserve if routing keeps the route's first
    /// target and its API (so the body goes as it came): asked of the gate in replica
    /// mode. Not for a chained Responses call, whose previous response's size the owners
    /// layer looks up.
    fn first_ask(&self, call: &Call) -> Option<Ask> {
        if !self
            .budgets
            .prepays_for(&call.tenant, call.session.is_some())
        {
            return None;
        }
        let request = &call.request;
        let target = call.route.targets.get(call.start.0)?;
        if target.upstream.api != request.endpoint.api() || request.refs.previous_response.is_some()
        {
            return None;
        }
        let model = target.model.as_deref().unwrap_or(&request.model);
        let held = HeldContext {
            tokens: 0,
            unsized_context: request.refs.unsized_context,
        };
        Some(meter::ask(
            &self.budgets,
            &call.tenant,
            model,
            target.upstream.api,
            request,
            held,
        ))
    }

    /// The limits and the guard's admission: in replica mode in one round trip, the
    /// guard's write-back going only if the limits let the request through.
    async fn admit(
        &self,
        g: &Guarded<'_>,
        usd_before: f64,
        prepay: Option<&Ask>,
    ) -> Result<Admitted, GatewayError> {
        let admit = |guard: &mut SessionGuard, now| {
            let usd = usd_before.max(guard.last_spend().unwrap_or(0.0));
            guard.admit(now, g.fp, usd)
        };
        let (verdict, slot) = if self.guards.shares(g.tenant) {
            let refuses = AtomicBool::new(false);
            let ((admitted, change), gated) = self
                .guards
                .update_with(
                    g.tenant,
                    g.session,
                    g.entry,
                    |guard, now| {
                        let verdict = admit(guard, now);
                        refuses.store(verdict.0.is_err(), Ordering::Relaxed);
                        verdict
                    },
                    g.fp.request,
                    |write| self.gate(g, write, refuses.load(Ordering::Relaxed), prepay),
                )
                .await
                .map_err(unreadable)?;
            let slot = match gated {
                Some(Ok(slot)) => slot,
                Some(Err(refusal)) => return Err(refusal.into()),
                None => self.limits(g.tenant, Some(g.session), prepay).await?,
            };
            ((admitted, change), slot)
        } else {
            let slot = self.limits(g.tenant, Some(g.session), prepay).await?;
            let verdict = self
                .guards
                .update(g.tenant, g.session, g.entry, admit)
                .await
                .map_err(unreadable)?;
            (verdict, slot)
        };
        let (admitted, change) = verdict;
        let keep = {
            let mut e = lock(g.entry);
            transition(g.tenant, g.session, change, g.request_id);
            tripped(&self.fleet, g.tenant, &e.guard, change);
            let keep = to_keep(change, &e.guard, self.guards.now());
            if let Err(refused) = &admitted {
                g.refused(&mut e, &refused.trip);
            }
            keep
        };
        persist(&self.guards, g.tenant, g.session, keep).await;
        if let Err(refused) = &admitted {
            self.fleet_refused(g, &refused.trip, change).await;
        }
        if let Err(refused) = admitted {
            let code = refused.trip.code();
            return Err(GatewayError::SessionRefused {
                code,
                detail: format!(
                    "{} ({}): {}",
                    code.as_str(),
                    refused.trip.rule.as_str(),
                    refused.trip.evidence
                ),
                retry_after: refused.retry_after,
            });
        }
        Ok(slot)
    }

    /// A refusal by the session's guard, for the fleet: one of a fleet trip's refusals
    /// is credited to its signature; a loop the guard just tripped the session on is a
    /// failure with a signature of its own.
    async fn fleet_refused(&self, g: &Guarded<'_>, trip: &Trip, change: Option<Transition>) {
        if g.fleet.is_none() {
            return;
        }
        if let (TripRule::FleetPattern, Some(id)) = (trip.rule, trip.signature) {
            metrics::counter!("backstop_fleet_refusals_total", "kind" => "tripped_session")
                .increment(1);
            self.fleet.avoided(g.tenant, SignatureId(id), 1);
            return;
        }
        let Some(kind) = matches!(change, Some((_, Phase::Tripped)))
            .then(|| loop_kind(trip, g.request))
            .flatten()
        else {
            return;
        };
        let sig = Signature::new(&g.shape(), &kind);
        // The session is tripped already: a hot loop signature only adds its count.
        self.fleet.failed(g.tenant, &sig, g.session, 0, 0.0).await;
    }

    /// With `preempt`, a request whose shape is a hot signature's is refused before it
    /// runs, unless it is the signature's probe (or the session's own guard refuses it
    /// anyway, with its own reason).
    async fn preempt(&self, g: &Guarded<'_>, shape: Option<&Shape>) -> Result<(), GatewayError> {
        let (Some(policy), Some(shape)) = (g.fleet, shape) else {
            return Ok(());
        };
        if !policy.preempt {
            return Ok(());
        }
        let now = self.guards.now();
        let refusing = match lock(g.entry).guard.state() {
            GuardState::Closed | GuardState::Probing { .. } => true,
            GuardState::Tripped { until, .. } => now < *until,
            GuardState::Active | GuardState::Recovering => false,
        };
        if refusing {
            return Ok(());
        }
        let Check::Refuse(hot) = self.fleet.check(g.tenant, shape.key, g.session).await else {
            return Ok(());
        };
        let trip = fleet_trip(&hot, policy);
        g.refused(&mut lock(g.entry), &trip);
        metrics::counter!("backstop_fleet_refusals_total", "kind" => "preempted").increment(1);
        self.fleet.avoided(g.tenant, hot.id, 1);
        g.hot(&hot, "preempted");
        Err(GatewayError::SessionRefused {
            code: TripCode::SessionTripped,
            detail: format!(
                "{} ({}): {}; refused before its first attempt (probe in {}s)",
                TripCode::SessionTripped.as_str(),
                TripRule::FleetPattern.as_str(),
                trip.evidence,
                hot.retry_after.as_secs()
            ),
            retry_after: hot.retry_after.max(std::time::Duration::from_secs(1)),
        })
    }

    /// How the request ended, for the fleet: a failure is counted under its signature
    /// (and, hot, trips the session: the trip to impose is returned); a success of a
    /// watched shape cools its hot signatures down and judges predictions.
    async fn fleet_outcome(
        &self,
        g: &Guarded<'_>,
        shape: Option<Shape>,
        failure: Option<FailureKind>,
        failed: bool,
        facts: &crate::telemetry::Facts,
    ) -> Option<(Trip, std::time::Duration)> {
        let policy = g.fleet?;
        if !failed {
            let shape = shape?;
            let done = self.fleet.succeeded(g.tenant, shape.key, g.session).await;
            if done.unconfirmed {
                metrics::counter!("backstop_fleet_predictions_total", "outcome" => "unconfirmed")
                    .increment(1);
            }
            if done.cooled > 0 {
                tracing::info!(
                    tenant = &**g.tenant,
                    session = g.session,
                    cooled = done.cooled,
                    "a hot failure signature cooled down: a request of its shape succeeded"
                );
            }
            return None;
        }
        // A failure that says nothing of the request is not read at all.
        let failure = failure?;
        let sig = Signature::new(&shape.unwrap_or_else(|| g.shape()), &failure);
        self.fleet_failed(g, policy, &sig, facts).await
    }

    /// A failure counted under its signature: the trip to impose, if it trips the session.
    async fn fleet_failed(
        &self,
        g: &Guarded<'_>,
        policy: &FleetPolicy,
        sig: &Signature,
        facts: &crate::telemetry::Facts,
    ) -> Option<(Trip, std::time::Duration)> {
        let verdict = self
            .fleet
            .failed(
                g.tenant,
                sig,
                g.session,
                facts.recovery.attempts,
                facts.spent_usd,
            )
            .await;
        fleet_verdict(g, policy, &verdict)
    }

    /// How the request ended, for the fleet and the session's guard: the guard's
    /// transition. In replica mode a failure the fleet counts is counted in the guard's
    /// write-back, one round trip that also imposes the trip it decides
    /// ([`SessionGuards::record_failure`]); otherwise the fleet's count comes first and
    /// the guard's write-back after, imposing its trip.
    ///
    /// [`SessionGuards::record_failure`]: crate::state::sessions::SessionGuards::record_failure
    async fn outcome(
        &self,
        g: &Guarded<'_>,
        shape: Option<Shape>,
        failure: Option<FailureKind>,
        failed: bool,
        facts: &crate::telemetry::Facts,
        seen: Option<SessionSeen>,
    ) -> Option<Transition> {
        let folded = failed && self.fleet.shares(g.tenant) && self.guards.shares(g.tenant);
        let imposed = match (g.fleet, failure) {
            (Some(policy), Some(failure)) if folded => {
                let sig = Signature::new(&shape.unwrap_or_else(|| g.shape()), &failure);
                match self
                    .fleet_failed_in_write_back(g, policy, &sig, facts)
                    .await
                {
                    Some(change) => return change,
                    None => self.fleet_failed(g, policy, &sig, facts).await,
                }
            }
            (_, failure) => self.fleet_outcome(g, shape, failure, failed, facts).await,
        };
        // Shared state that became unreadable meanwhile is left as it is (already logged):
        // this outcome goes uncounted.
        self.guards
            .record(g.tenant, g.session, g.entry, failed, seen, imposed)
            .await
            .unwrap_or_default()
    }

    /// A failure counted under its signature in the guard's write-back (replica mode):
    /// the guard's transition, or `None` when it cannot be (the tripped state would not
    /// hold the evidence's marks once each): nothing done, count it the usual way.
    async fn fleet_failed_in_write_back(
        &self,
        g: &Guarded<'_>,
        policy: &FleetPolicy,
        sig: &Signature,
        facts: &crate::telemetry::Facts,
    ) -> Option<Option<Transition>> {
        let marked = Trip {
            signature: Some(sig.id.0),
            ..Trip::new(
                TripRule::FleetPattern,
                Hot::evidence_marked(sig.id, &sig.description, policy),
            )
        };
        let write = |candidates| {
            self.fleet.failed_and_save(
                g.tenant,
                sig,
                g.session,
                facts.recovery.attempts,
                facts.spent_usd,
                candidates,
            )
        };
        let imposed = |verdict: &Failed| fleet_imposed(verdict, policy);
        let recorded = self
            .guards
            .record_failure(
                g.tenant,
                g.session,
                g.entry,
                &(marked, policy.cool_down),
                &EVIDENCE_MARKS,
                write,
                imposed,
            )
            .await;
        match recorded {
            Ok(Some((verdict, change))) => {
                fleet_verdict(g, policy, &verdict);
                Some(change)
            }
            Ok(None) => None,
            // Unreadable (already logged): counted in the fleet, not in the guard.
            Err(_) => Some(None),
        }
    }

    /// What the session has left, for `x-backstop-budget-remaining`: what the settle of
    /// the request's last call saw of the shared state (`seen`), else read.
    async fn remaining(
        &self,
        log: &RequestLog,
        tenant: &str,
        session: &str,
        seen: Option<SessionSeen>,
    ) {
        if let Some(remaining) = self.budgets.remaining_header(tenant, session, seen).await {
            log.set_budget_remaining(remaining);
        }
    }

    /// The guard's write-back as the limits' round trip carries it.
    async fn gate(
        &self,
        g: &Guarded<'_>,
        write: Option<Write>,
        refuses: bool,
        prepay: Option<&Ask>,
    ) -> Saving<Result<Admitted, Refusal>> {
        let write = write.map(|write| GuardWrite {
            write,
            ttl_ms: self.guards.shared_ttl_ms(),
            refuses,
        });
        let written = write.is_some();
        match self
            .budgets
            .gate(g.tenant, Some(g.session), write, prepay)
            .await
        {
            Ok(Gated::Passed {
                slot,
                guard: Some(versions),
                prepaid,
            }) if written => Saving::Saved(versions, Ok(Admitted { slot, prepaid })),
            Ok(Gated::Passed { slot, prepaid, .. }) => {
                Saving::Local(Ok(Admitted { slot, prepaid }))
            }
            Ok(Gated::Moved(version, state)) => Saving::Moved(version, state),
            Err(refusal) => Saving::Undone(Err(refusal)),
        }
    }
}

impl<S> Middleware<S, Call> for AdmissionLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, mut call: Call) -> Result<Response<Body>, GatewayError> {
        let entry = match call.session.as_deref() {
            Some(s) => self
                .guards
                .entry(&call.tenant, s)
                .await
                .map_err(unreadable)?,
            None => None,
        };
        let log = call.log.clone();
        let tenant = call.tenant.clone();
        let prepay = self.first_ask(&call);
        let (Some(entry), Some(session)) = (entry, call.session.clone()) else {
            let session = call.session.clone();
            let admitted = self
                .limits(&tenant, session.as_deref(), prepay.as_ref())
                .await?;
            let slot = admitted.hand_over(&mut call);
            let result = inner.call(call).await;
            if let Some(session) = session {
                let seen = log.facts().session_seen;
                self.remaining(&log, &tenant, &session, seen).await;
            }
            return Ok(holding(result?, slot));
        };
        let request_id = call.request_id.to_str().unwrap_or("-").to_owned();
        let fp = fingerprint(&call.request.json);
        let request = call.request.clone();
        let route = call.route.clone();
        let fleet = self.fleet.policy(&tenant).cloned();
        // The session's spend so far, for the guard's spend samples: in replica mode what
        // this replica last saw of it (the settle of its last call here, or another
        // replica's newer sample), read afresh only for a guard watching spend velocity.
        let usd_before = if !self.guards.shares(&tenant) || self.guards.watches_spend(&tenant) {
            self.budgets.session_usd(&tenant, &session).await
        } else {
            lock(&entry).seen_usd
        };
        let g = Guarded {
            tenant: &tenant,
            session: &session,
            entry: &entry,
            request_id: &request_id,
            fp: &fp,
            request: &request,
            route: &route.pattern,
            fleet: fleet.as_ref(),
        };
        // The request's shape, only while the tenant's fleet view watches one.
        let shape = match fleet {
            Some(_) if self.fleet.watching(&tenant).await => Some(g.shape()),
            _ => None,
        };
        if let Err(refused) = self.preempt(&g, shape.as_ref()).await {
            log.set_session_state(lock(&entry).guard.state().phase());
            return Err(refused);
        }
        let admitted = self.admit(&g, usd_before, prepay.as_ref()).await;
        log.set_session_state(lock(&entry).guard.state().phase());
        let slot = admitted?.hand_over(&mut call);
        let started = Instant::now();
        let result = inner.call(call).await;
        let (status, failed) = match &result {
            Ok(r) => (r.status().as_u16(), r.status().as_u16() >= 400),
            Err(e) => (e.code().status(), !e.code().is_refusal()),
        };
        let facts = log.facts();
        let seen = facts.session_seen;
        let failure = match &fleet {
            Some(_) if failed => failure_kind(&result, &facts.recovery, &request),
            _ => None,
        };
        let change = self.outcome(&g, shape, failure, failed, &facts, seen).await;
        let keep = {
            let mut e = lock(&entry);
            if let Some(seen) = seen {
                e.seen_usd = e.seen_usd.max(seen.settled.usd);
            }
            let now = self.guards.now();
            transition(&tenant, &session, change, &request_id);
            tripped(&self.fleet, &tenant, &e.guard, change);
            let keep = to_keep(change, &e.guard, now);
            let state = e.guard.state().phase();
            // The trip this request's failure caused, named in the trace.
            let detail = match (change, e.guard.state()) {
                (Some((_, Phase::Tripped)), GuardState::Tripped { trip, .. }) => {
                    Some(format!("tripped: {}: {}", trip.rule.as_str(), trip.evidence).into())
                }
                _ => None,
            };
            e.trace(TraceEntry {
                request_id: TraceId::new(&request_id),
                status,
                failed,
                action: trail::render(&facts.recovery.steps).into(),
                detail,
                attempts: facts.recovery.attempts,
                upstream: facts.recovery.upstream,
                latency_ms: (started.elapsed().as_secs_f64() * 1e3) as f32,
                cost_usd: facts.spent_usd,
                tool_loop: fp.tool_loop.as_ref().map_or(0, |(_, n)| *n),
                state,
            });
            log.set_session_state(e.guard.state().phase());
            keep
        };
        persist(&self.guards, &tenant, &session, keep).await;
        self.remaining(&log, &tenant, &session, seen).await;
        Ok(holding(result?, slot))
    }
}
