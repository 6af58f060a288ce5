//! The layer's fixtures (one in-process gateway state: SQLite in memory, no Redis, no
//! socket) and tests of the whole `call`, through a stub inner service.

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Response};
use tower::{service_fn, Layer, Service, ServiceExt};

use super::AdmissionLayer;
use crate::{
    api::Endpoint,
    clock::Clock,
    config::Config,
    error::GatewayError,
    layers::{
        context::{parse, Call, TargetIndex},
        deadline::Deadline,
    },
    policy::guard::Phase,
    routing::RouteTable,
    state::{
        budgets::Budgets,
        fleet::{Fleet, LocalFleet},
        sessions::SessionGuards,
    },
    store::{GuardStates, SqliteStore},
    telemetry::{RequestLog, Trail},
};

/// A chat request (its shape, for the fleet, is the same in every session).
pub(super) const CHAT: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
/// A guard with the defaults: 3 identical requests in 10m, 5 failures in a row.
pub(super) const GUARDED: &str = "[tenants.guard]\ncool_down = \"60s\"";
pub(super) const COOL_DOWN: Duration = Duration::from_secs(60);

const ROUTES: &str = r#"
[[upstreams]]
name = "u"
api = "openai"
base_url = "http://127.0.0.1:1"
[[routes]]
model = "gpt-*"
targets = [{ upstream = "u" }]
"#;

pub(super) struct Setup {
    pub(super) layer: AdmissionLayer,
    pub(super) routes: RouteTable,
    pub(super) store: Arc<SqliteStore>,
}

/// Tenant `t` with `tenant_extra` (its keys and tables) on `routes` (else one OpenAI
/// upstream `u` behind `gpt-*`).
pub(super) fn setup(routes: &str, tenant_extra: &str) -> Setup {
    let routes = if routes.is_empty() { ROUTES } else { routes };
    let text = format!(
        "[[prices]]\nmodel = \"gpt-4o*\"\ninput_per_mtok = 2.5\noutput_per_mtok = 10.0\n{routes}\n\
         [[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key-1\"]\n{tenant_extra}\n"
    );
    let config = Config::from_toml_with_env(&text, |_| None).unwrap();
    let store = Arc::new(SqliteStore::open(":memory:").unwrap());
    let (clock, idle) = (Clock::system(), Duration::from_secs(600));
    let budgets = Arc::new(Budgets::new(&config, store.clone(), idle, clock.clone()));
    let guards =
        SessionGuards::new(&config, idle, store.clone(), clock.clone()).sharing(budgets.live());
    let fleet = Arc::new(Fleet::new(&config, Arc::new(LocalFleet::new(clock))));
    let upstreams = crate::upstream::build_all(&config);
    Setup {
        layer: AdmissionLayer::new(budgets, Arc::new(guards), fleet),
        routes: RouteTable::new(&config, &upstreams),
        store,
    }
}

pub(super) fn layer(tenant_extra: &str) -> AdmissionLayer {
    setup("", tenant_extra).layer
}

pub(super) fn layer_on(routes: &str, tenant_extra: &str) -> (AdmissionLayer, RouteTable) {
    let s = setup(routes, tenant_extra);
    (s.layer, s.routes)
}

pub(super) fn call(routes: &RouteTable, session: Option<&str>, body: &str) -> Call {
    call_at(routes, Endpoint::ChatCompletions, session, body)
}

/// A call of tenant `t`, as the context layer makes it.
pub(super) fn call_at(
    routes: &RouteTable,
    endpoint: Endpoint,
    session: Option<&str>,
    body: &str,
) -> Call {
    let (request, route) = parse(endpoint, Bytes::from(body.to_owned()), routes).unwrap();
    Call {
        request: Arc::new(request),
        route,
        tenant: "t".into(),
        session: session.map(Into::into),
        headers: Arc::default(),
        request_id: HeaderValue::from_static("req-1"),
        log: Arc::new(RequestLog::default()),
        deadline: Deadline {
            at: tokio::time::Instant::now() + Duration::from_secs(3600),
            timeout: Duration::from_secs(3600),
        },
        start: TargetIndex::default(),
        keep_answer: false,
        prepaid: None,
    }
}

type Answered = Result<Response<Body>, GatewayError>;

/// An inner service answering `status`, as the upstream's error `code` if it names one
/// (what recovery writes in the request's trail), counting its calls in `calls`.
pub(super) fn answering(
    status: u16,
    code: Option<&'static str>,
    calls: Arc<AtomicUsize>,
) -> impl Service<Call, Response = Response<Body>, Error = GatewayError, Future: Send>
       + Clone
       + Send
       + 'static {
    service_fn(move |call: Call| {
        calls.fetch_add(1, Ordering::SeqCst);
        call.log.set_recovery(Trail {
            attempts: 1,
            upstream_error: code.map(|code| {
                Arc::new(crate::policy::classify::ProviderError {
                    code: code.into(),
                    ..Default::default()
                })
            }),
            ..Trail::default()
        });
        let response = Response::builder().status(status).body(Body::empty());
        async move { Ok(response.unwrap()) }
    })
}

/// One call through the layer: its answer and its request record's log.
pub(super) async fn through(
    s: &Setup,
    session: &str,
    status: u16,
    code: Option<&'static str>,
) -> (Answered, Arc<RequestLog>, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let call = call(&s.routes, Some(session), CHAT);
    let log = call.log.clone();
    let service = s.layer.layer(answering(status, code, calls.clone()));
    let answer = service.oneshot(call).await;
    (answer, log, calls.load(Ordering::SeqCst))
}

#[tokio::test]
async fn a_guarded_budgeted_session_is_told_its_state_and_what_it_has_left() {
    let s = setup("", &format!("{GUARDED}\n[tenants.session]\nmax_calls = 10"));
    let (answer, log, calls) = through(&s, "s", 200, None).await;
    assert_eq!(answer.unwrap().status(), 200);
    assert_eq!(calls, 1);
    let facts = log.facts();
    assert_eq!(facts.session_state, Some(Phase::Active));
    assert_eq!(facts.budget_remaining.as_deref(), Some("calls=10"));
    // A session without a guard: no state, still its budget.
    let s = setup("", "[tenants.session]\nmax_calls = 10");
    let (_, log, _) = through(&s, "s", 200, None).await;
    let facts = log.facts();
    assert_eq!(facts.session_state, None);
    assert_eq!(facts.budget_remaining.as_deref(), Some("calls=10"));
}

#[tokio::test(start_paused = true)]
async fn a_looping_session_is_refused_before_its_call_and_told_it_is_tripped() {
    let s = setup("", GUARDED);
    for _ in 0..3 {
        let (answer, log, calls) = through(&s, "s", 200, None).await;
        assert!(answer.is_ok() && calls == 1);
        assert_eq!(log.facts().session_state, Some(Phase::Active));
    }
    let (answer, log, calls) = through(&s, "s", 200, None).await;
    let err = answer.expect_err("refused");
    assert_eq!(calls, 0, "refused before the inner service");
    assert_eq!(err.code().as_str(), "loop_detected");
    assert_eq!(err.retry_after(), Some(COOL_DOWN));
    assert_eq!(log.facts().session_state, Some(Phase::Tripped));
    let (answer, _, _) = through(&s, "other", 200, None).await;
    assert!(answer.is_ok(), "another session has its own guard");
}

#[tokio::test(start_paused = true)]
async fn failures_in_a_row_trip_the_session_on_the_last_ones_answer() {
    let s = setup(
        "",
        "[tenants.guard]\nmax_consecutive_failures = 2\ncool_down = \"60s\"",
    );
    let (answer, log, _) = through(&s, "s", 500, None).await;
    assert_eq!(answer.unwrap().status(), 500, "the answer goes as it came");
    assert_eq!(log.facts().session_state, Some(Phase::Recovering));
    let (_, log, _) = through(&s, "s", 500, None).await;
    assert_eq!(log.facts().session_state, Some(Phase::Tripped));
    let kept = s.store.guard_state("t", "s").await.unwrap().expect("kept");
    assert_eq!(kept.rule, "max_consecutive_failures");
    let (answer, _, calls) = through(&s, "s", 200, None).await;
    let err = answer.expect_err("refused");
    assert_eq!((err.code().as_str(), calls), ("session_tripped", 0));
    assert_eq!(err.retry_after(), Some(COOL_DOWN));
    // Cooled down: the probe goes through, and its success closes the trip.
    tokio::time::advance(COOL_DOWN).await;
    let (answer, log, _) = through(&s, "s", 200, None).await;
    assert!(answer.is_ok());
    assert_eq!(log.facts().session_state, Some(Phase::Active));
    assert!(
        s.store.guard_state("t", "s").await.unwrap().is_none(),
        "forgotten"
    );
}

#[tokio::test]
async fn the_concurrency_slot_is_held_until_the_response_body_is_dropped() {
    let s = setup("", "[tenants.session]\nmax_concurrent = 1");
    let (first, _, _) = through(&s, "s", 200, None).await;
    let first = first.unwrap();
    let (second, _, calls) = through(&s, "s", 200, None).await;
    let err = second.expect_err("busy");
    assert_eq!((err.code().as_str(), calls), ("too_many_concurrent", 0));
    drop(first);
    let (third, _, calls) = through(&s, "s", 200, None).await;
    assert!(third.is_ok() && calls == 1, "freed with the first body");
}

/// Tenant `t` with a fleet view: two sessions failing once with a signature make it hot.
const FLEET: &str = "[tenants.guard]\ncool_down = \"60s\"\n[tenants.guard.fleet]\n\
    min_sessions = 2\nmin_failures = 1\nwindow = \"10m\"\ncool_down = \"30s\"\npreempt = true";

#[tokio::test(start_paused = true)]
async fn a_hot_signature_trips_its_failing_sessions_and_preempts_its_shape() {
    let s = setup("", FLEET);
    let code = Some("invalid_request_error");
    let (answer, log, _) = through(&s, "a", 400, code).await;
    assert_eq!(answer.unwrap().status(), 400, "the answer goes as it came");
    assert_eq!(log.facts().session_state, Some(Phase::Recovering));
    // The second session failing the same way makes the signature hot: tripped at once.
    let (_, log, _) = through(&s, "b", 400, code).await;
    assert_eq!(log.facts().session_state, Some(Phase::Tripped));
    let kept = s.store.guard_state("t", "b").await.unwrap().expect("kept");
    assert_eq!(
        (&*kept.code, &*kept.rule),
        ("session_tripped", "fleet_pattern")
    );
    // A request of its shape is refused before its call, unless it is the probe.
    let (answer, log, calls) = through(&s, "c", 200, None).await;
    let err = answer.expect_err("preempted");
    assert_eq!((err.code().as_str(), calls), ("session_tripped", 0));
    assert_eq!(err.retry_after(), Some(Duration::from_secs(30)));
    let detail = err.to_string();
    assert!(
        detail.starts_with("session_tripped (fleet_pattern): 2 sessions"),
        "{detail}"
    );
    assert!(
        detail.ends_with("refused before its first attempt (probe in 30s)"),
        "{detail}"
    );
    assert_eq!(
        log.facts().session_state,
        Some(Phase::Active),
        "preempted, not tripped"
    );
    // Past the cool-down one request is the probe; failing, it trips its session too.
    tokio::time::advance(Duration::from_secs(30)).await;
    let (answer, log, calls) = through(&s, "d", 400, code).await;
    assert_eq!((answer.unwrap().status().as_u16(), calls), (400, 1));
    assert_eq!(log.facts().session_state, Some(Phase::Tripped));
}
