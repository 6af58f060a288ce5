//! The one place where the layers are ordered.
//!
//! A proxied request passes, outer → inner:
//! 1. [`EdgeLayer`]: request id, in-flight gauge, the request's log line and metrics.
//! 2. [`RespondLayer`]: typed errors and panics become responses in the caller's API shape;
//!    everything above it is infallible.
//! 3. [`DeadlineLayer`]: `server.request_timeout` over the whole request.
//! 4. [`AuthLayer`]: tenant key → [`Tenant`](crate::layers::auth::Tenant), else 401.
//! 5. [`ContextLayer`]: body read once within the size limit, parsed, routed.
//! 6. [`IdempotencyLayer`]: `Idempotency-Key` replays, with no call and no charge.
//! 7. [`LimitsLayer`]: tenant and session request rates, session concurrency.
//! 8. [`GuardLayer`]: the session guard: loops, repeats, failures, spend velocity.
//! 9. [`ValidateLayer`]: structured output checked; corrective retries with the
//!    validator's errors; strategy switch to the next target; 502 `output_invalid`.
//! 10. [`RecoveryLayer`]: target selection, classification, retry with backoff and
//!     Retry-After, retry budget, per-upstream circuit breakers, failover.
//! 11. [`MeterLayer`]: per upstream call (retries and corrections included), reserve
//!     against the session's and tenant's caps, settle to reported usage.
//! 12. [`Forward`]: one upstream attempt (leaf).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use axum::{
    body::Body,
    extract::State,
    http::{header, HeaderMap, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post_service},
    Router,
};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tower::{util::BoxCloneSyncService, ServiceBuilder};

use crate::{
    api::Endpoint,
    config::Config,
    error::{respond::error_response, GatewayError},
    layers::{
        auth::{AuthLayer, TenantKeys},
        context::ContextLayer,
        deadline::DeadlineLayer,
        edge::{EdgeLayer, X_REQUEST_ID},
        guard::GuardLayer,
        idempotency::IdempotencyLayer,
        limits::LimitsLayer,
        meter::MeterLayer,
        recovery::{RecoveryLayer, RetryPolicy},
        respond::RespondLayer,
        validate::ValidateLayer,
    },
    policy::budget::Prices,
    routing::RouteTable,
    state::{budgets::Budgets, clock::Clock, health::HealthRegistry, sessions::SessionGuards},
    store::{SqliteStore, Store, StoreError},
    telemetry,
    upstream::{self, Forward, StreamLimits, Upstream},
    validation::Schemas,
};

type HttpService = BoxCloneSyncService<Request<Body>, Response, std::convert::Infallible>;

/// Everything built from the config once at start-up.
#[derive(Clone)]
pub struct AppState {
    pub config: Arc<Config>,
    pub routes: Arc<RouteTable>,
    pub upstreams: Arc<HashMap<String, Arc<Upstream>>>,
    pub tenants: Arc<TenantKeys>,
    pub health: Arc<HealthRegistry>,
    pub budgets: Arc<Budgets>,
    pub schemas: Arc<Schemas>,
    pub guards: Arc<SessionGuards>,
    /// The one clock of the live state (tokio time, and the calendar derived from it).
    pub clock: Clock,
    pub metrics: PrometheusHandle,
    /// False while starting and once shutdown has begun: `/readyz` answers 503.
    pub ready: Arc<AtomicBool>,
    /// Bounds on upstream bodies and relayed streams.
    pub stream_limits: StreamLimits,
    /// Set when the shutdown grace elapses: open streams end with an error event.
    pub cut_streams: Arc<tokio::sync::watch::Sender<bool>>,
}

impl AppState {
    pub fn new(config: Config) -> Result<Self, StoreError> {
        Self::with_clock(config, Clock::system())
    }

    /// As [`AppState::new`], with the live state on `clock`.
    pub fn with_clock(config: Config, clock: Clock) -> Result<Self, StoreError> {
        let upstreams = upstream::build_all(&config);
        let routes = RouteTable::new(&config, &upstreams);
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open_with(&config.store)?);
        warn_unpriced(&config);
        let (stream_limits, cut_streams) = StreamLimits::from_config(&config.server);
        Ok(AppState {
            stream_limits,
            cut_streams: Arc::new(cut_streams),
            budgets: Arc::new(Budgets::new(
                &config,
                store.clone(),
                config.store.session_idle,
                clock.clone(),
            )),
            schemas: Arc::new(Schemas::new(&config.validation)),
            guards: Arc::new(SessionGuards::new(
                &config,
                config.store.session_idle,
                store,
                clock.clone(),
            )),
            clock,
            tenants: Arc::new(TenantKeys::new(&config)),
            health: Arc::new(HealthRegistry::new(&config)),
            routes: Arc::new(routes),
            upstreams: Arc::new(upstreams),
            config: Arc::new(config),
            metrics: telemetry::metrics_handle(),
            ready: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// Models that routes may call but no `[[prices]]` entry covers: their USD cost is zero
/// (or they are refused under a USD budget, per `billing.unpriced`).
fn warn_unpriced(config: &Config) {
    let prices = Prices::new(&config.prices);
    for route in &config.routes {
        for target in route.targets.iter().chain(&route.context_fallback) {
            let model = target.model.as_deref().unwrap_or(&route.model);
            if prices.cost(model, 0, 0).is_none() {
                tracing::warn!(route = %route.model, model, unpriced = ?config.billing.unpriced, "no [[prices]] entry matches this model");
            }
        }
    }
}

/// The proxy stack for `/v1/chat/completions`, `/v1/messages` and `/v1/embeddings`.
fn proxy_stack(state: &AppState) -> HttpService {
    let server = &state.config.server;
    let stack = ServiceBuilder::new()
        .layer(EdgeLayer)
        .layer(RespondLayer)
        .layer(DeadlineLayer::new(server.request_timeout))
        .layer(AuthLayer::new(state.tenants.clone()))
        .layer(ContextLayer::new(
            state.routes.clone(),
            server.max_body_bytes,
            server.max_session_id_bytes,
        ))
        .layer(IdempotencyLayer::new(
            state.budgets.store().clone(),
            state.config.store.idempotency_ttl,
            server.max_idempotency_key_bytes,
            state.clock.clone(),
        ))
        .layer(LimitsLayer::new(state.budgets.clone()))
        .layer(GuardLayer::new(state.guards.clone(), state.budgets.clone()))
        .layer(ValidateLayer::new(
            state.schemas.clone(),
            state.config.validation.clone(),
        ))
        .layer(RecoveryLayer::new(
            RetryPolicy::from_config(&state.config.retry),
            state.health.clone(),
        ))
        .layer(MeterLayer::new(state.budgets.clone()))
        .service(Forward::new(
            upstream::client(),
            state.stream_limits.clone(),
        ));
    BoxCloneSyncService::new(stack)
}

/// `GET /v1/models`: the same edge, error and auth layers over a listing of the routes.
fn models_stack(state: &AppState) -> HttpService {
    let routes = state.routes.clone();
    let list = tower::service_fn(move |req: Request<Body>| {
        let routes = routes.clone();
        async move { Ok::<_, GatewayError>(list_models(&routes, req.headers())) }
    });
    let stack = ServiceBuilder::new()
        .layer(EdgeLayer)
        .layer(RespondLayer)
        .layer(AuthLayer::new(state.tenants.clone()))
        .service(list);
    BoxCloneSyncService::new(stack)
}

/// Route patterns as a model list, in the Anthropic shape when the caller sent
/// `anthropic-version` (the Anthropic SDK always does), else the OpenAI shape.
fn list_models(routes: &RouteTable, headers: &HeaderMap) -> Response {
    let names = routes.model_names();
    let body = if headers.contains_key("anthropic-version") {
        let data: Vec<_> = names
            .iter()
            .map(|id| json!({"type": "model", "id": id, "display_name": id, "created_at": "1970-01-01T00:00:00Z"}))
            .collect();
        json!({"data": data, "has_more": false, "first_id": names.first(), "last_id": names.last()})
    } else {
        let data: Vec<_> = names
            .iter()
            .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "backstop"}))
            .collect();
        json!({"object": "list", "data": data})
    };
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The full HTTP surface.
pub fn router(state: AppState) -> Router {
    let proxy = proxy_stack(&state);
    let models = models_stack(&state);
    Router::new()
        .route(
            Endpoint::ChatCompletions.path(),
            post_service(proxy.clone()),
        )
        .route(Endpoint::Messages.path(), post_service(proxy.clone()))
        .route(Endpoint::Embeddings.path(), post_service(proxy))
        .route("/v1/models", axum::routing::get_service(models))
        .merge(crate::admin::routes())
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
        .layer(axum::middleware::from_fn(ensure_request_id))
}

/// Responses that did not pass the edge layer (health, metrics, 404s) still carry an
/// id, by the edge layer's rule.
async fn ensure_request_id(req: Request<Body>, next: axum::middleware::Next) -> Response {
    // Only the client's header is kept here: the proxy routes set their own id, so a new
    // one is made only for the responses that lack it.
    let mut sent = Request::new(());
    if let Some(id) = req.headers().get(&X_REQUEST_ID) {
        sent.headers_mut().insert(X_REQUEST_ID.clone(), id.clone());
    }
    let mut response = next.run(req).await;
    if !response.headers().contains_key(&X_REQUEST_ID) {
        let id = crate::layers::edge::request_id(&sent);
        response.headers_mut().insert(X_REQUEST_ID.clone(), id);
    }
    response
}

async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

/// A known path with the wrong method: 405 in the caller's API shape, never an empty body.
async fn method_not_allowed(req: Request<Body>) -> Response {
    let api = Endpoint::api_for_path(req.uri().path());
    let err = GatewayError::MethodNotAllowed {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
    };
    let mut response = error_response(&err, api);
    crate::error::respond::mark_no_retry(&mut response);
    response
}

async fn not_found(req: Request<Body>) -> Response {
    let api = Endpoint::api_for_path(req.uri().path());
    let err = GatewayError::NotFound {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
    };
    error_response(&err, api)
}
