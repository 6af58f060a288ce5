//! The one place where the layers are ordered.
//!
//! A proxied request passes, outer → inner (inside the layers around the whole router,
//! below):
//! 1. [`EdgeLayer`]: request id and the request's record into the extensions, in-flight
//!    gauge, the `x-backstop-*` headers and the metrics at the response head, the
//!    access-log line when the response body ends (also on `/v1/models` and the admin
//!    routes).
//! 2. [`TraceLayer`]: the request's OpenTelemetry span (when tracing is on), ended by
//!    the edge with the log line.
//! 3. [`RespondLayer`]: typed errors and panics become responses in the caller's API shape;
//!    everything above it is infallible.
//! 4. [`DeadlineLayer`]: `server.request_timeout` over the whole request.
//! 5. [`AuthLayer`]: tenant key → [`Tenant`](crate::layers::auth::Tenant), else 401.
//! 6. [`ContextLayer`]: body read once within the size limit, parsed, routed: from
//!    here in, every layer takes a typed [`Call`](crate::layers::context::Call).
//! 7. [`IdempotencyLayer`]: `Idempotency-Key` replays, with no call and no charge.
//! 8. [`AdmissionLayer`]: tenant and session request rates, session concurrency, and the
//!    session guard (loops, repeats, failures, spend velocity); in replica mode one
//!    round trip to Redis for all of them.
//! 9. [`ValidateLayer`]: structured output checked; corrective retries with the
//!    validator's errors; strategy switch to the next target; 502 `output_invalid`.
//!    It writes what recovery did into the request's record. (`count_tokens`, which
//!    nothing validates, charges or guards, has [`RatesLayer`] (the request rates
//!    alone) and [`UnvalidatedLayer`] here and nothing from 7 to 8.)
//! 10. [`SideEffectsLayer`]: `[tenants.side_effects]`: the results a session's request
//!     feeds back for listed tools journaled before it goes on; an answer that proposes
//!     a committed call again corrected once, refused (409 `duplicate_side_effect`) or
//!     annotated.
//! 11. [`RecoveryLayer`]: target selection, classification, retry with backoff and
//!     Retry-After, retry budget, per-upstream circuit breakers, failover; answers
//!     which target answered and what it did
//!     ([`Answered`](crate::layers::recovery::Answered)).
//! 12. [`ResponseOwnersLayer`]: Responses creates only: every stored object named is
//!     checked against its owner, what the provider holds for the call handed to the
//!     meter, and a stored answer's owners made durable before it is released.
//! 13. [`MeterLayer`]: per upstream call (retries and corrections included), reserve
//!     against the session's and tenant's caps, settle to reported usage.
//! 14. [`TranslateLayer`]: an attempt on a target of the other API gets its translated
//!     request sent and its answer (whole, streamed, error) brought back in the caller's
//!     API; every other attempt passes through.
//! 15. [`Forward`]: one upstream attempt (leaf).
//!
//! Around the whole router (every route: proxy, models, admin, health, metrics, 404,
//! 405), outer → inner, tower-http's layers ([`App`]):
//! 1. credentials (`authorization`, `x-api-key`, `cookie`, ...) marked sensitive;
//! 2. the request id, one rule everywhere: a client `x-request-id` that is not 1–128
//!    visible ASCII bytes is dropped, a missing one is made, and it is echoed on every
//!    response;
//! 3. `server.body_read_timeout` on the request body (408 `request_body_timeout`, in the
//!    caller's shape, from the context layer).
//!
//! Just inside each authentication layer (proxy, models, admin, sessions), tower-http's
//! `TraceLayer` opens the request's span with `request_id`, `tenant` and `session`
//! ([`EdgeSpan`](crate::layers::edge::EdgeSpan)): every log line inside carries them.
//!
//! tower-http's `TimeoutLayer`, `CatchPanicLayer` and `RequestBodyLimitLayer` are not
//! used: they answer with empty or plain-text bodies, where ours answer in the caller's
//! API shape (see [`DeadlineLayer`], [`RespondLayer`], [`ContextLayer`]).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Weak,
    },
};

use axum::{
    body::Body,
    extract::State,
    http::{header, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, get_service, post_service},
    Router,
};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tower::{
    util::{BoxCloneSyncService, MapRequest, MapRequestLayer},
    Layer, ServiceBuilder,
};
use tower_http::{
    request_id::{PropagateRequestId, PropagateRequestIdLayer, SetRequestId, SetRequestIdLayer},
    sensitive_headers::{
        SetSensitiveRequestHeaders, SetSensitiveRequestHeadersLayer, SetSensitiveResponseHeaders,
        SetSensitiveResponseHeadersLayer,
    },
    timeout::{RequestBodyTimeout, RequestBodyTimeoutLayer},
};

use crate::{
    admin::{AdminState, Reload},
    api::Endpoint,
    clock::Clock,
    config::{Config, StoreBackend},
    error::{respond::error_response, GatewayError},
    layers::translate::TranslateLayer,
    layers::{
        admission::AdmissionLayer,
        auth::{AuthLayer, TenantKeys},
        context::{Call, ContextLayer},
        deadline::DeadlineLayer,
        edge::{self, EdgeLayer, MakeId, X_REQUEST_ID},
        idempotency::{IdempotencyLayer, InFlight},
        meter::{Billed, MeterLayer, Unmetered},
        owners::ResponseOwnersLayer,
        rates::RatesLayer,
        recovery::{RecoveryLayer, RetryPolicy, UnvalidatedLayer},
        respond::RespondLayer,
        side_effects::SideEffectsLayer,
        trace::TraceLayer,
        validate::ValidateLayer,
    },
    routing::RouteTable,
    state::{
        activity::Activity,
        body_memory::BodyMemory,
        budgets::{local::LocalBudgets, redis::RedisBudgets, BudgetBackend, Budgets},
        fleet::{Fleet, FleetBackend, LocalFleet, ReplicaFleet},
        health::HealthRegistry,
        journal::Journal,
        owners::ResponseOwners,
        restarts::{Restarts, SharedRestarts},
        sessions::{GuardBackend, LocalGuards, ReplicaGuards, SessionGuards},
        shared::{Redis, SharedBudgets},
    },
    store::{PgStore, RedisStore, SqliteStore, Store, StoreError},
    telemetry,
    upstream::{self, objects::ForwardObject, Attempt, Forward, StreamCut, Upstream},
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
    /// The store, whole: its roles are handed out from here (each consumer takes the one
    /// it uses) and its purger runs on it.
    pub store: Arc<dyn Store>,
    pub schemas: Arc<Schemas>,
    pub guards: Arc<SessionGuards>,
    /// Each fleet tenant's failure signatures, shared by replicas in Redis.
    pub fleet: Arc<Fleet>,
    /// Which tenant created each stored response (the Responses API).
    pub owners: Arc<ResponseOwners>,
    /// Sessions' side-effect journals (`[tenants.side_effects]`).
    pub journal: Arc<Journal>,
    /// The one clock of the live state (tokio time, and the calendar derived from it).
    pub clock: Clock,
    /// The last hour of requests and recovery, for the dashboard (memory only).
    pub activity: Arc<Activity>,
    pub metrics: PrometheusHandle,
    /// False while starting and once shutdown has begun: `/readyz` answers 503.
    pub ready: Arc<AtomicBool>,
    /// What relayed streams watch for the end of the shutdown grace.
    pub stream_cut: StreamCut,
    /// Set when the shutdown grace elapses: open streams end with an error event.
    pub cut_streams: Arc<tokio::sync::watch::Sender<bool>>,
    /// Idempotency keys whose first request is running (shared across reloads).
    pub idempotent_in_flight: InFlight,
    /// This gateway's tracer (`[telemetry]`), when tracing is on; bound at start-up.
    pub traces: Option<Arc<crate::otel::Traces>>,
    /// The memory budget of large request bodies in flight (kept across reloads that
    /// do not change it, so requests in flight stay counted).
    pub body_memory: Arc<BodyMemory>,
}

impl AppState {
    pub async fn new(config: Config) -> Result<Self, StoreError> {
        Self::with_clock(config, Clock::system()).await
    }

    /// As [`AppState::new`], with the live state on `clock`.
    pub async fn with_clock(config: Config, clock: Clock) -> Result<Self, StoreError> {
        let upstreams = upstream::build_all(&config);
        let routes = RouteTable::new(&config, &upstreams);
        // Installed before the store opens, so that what opening counts (reservations
        // recovered, writes replayed from the spool) is on the page.
        let metrics = telemetry::metrics_handle();
        let embedded: Arc<dyn Store> = match config.store.backend {
            StoreBackend::Sqlite => Arc::new(SqliteStore::open_with(&config.store)?),
            StoreBackend::Postgres => Arc::new(PgStore::open(&config.store).await?),
        };
        let redis = match config.state.backend {
            crate::config::StateBackend::Redis => {
                Some(Redis::new(&config.state).map_err(|e| StoreError::Unavailable(e.into()))?)
            }
            crate::config::StateBackend::Embedded => None,
        };
        let store: Arc<dyn Store> = match &redis {
            Some(redis) => Arc::new(RedisStore::new(embedded, redis.clone())),
            None => embedded,
        };
        // Where the budgets count, chosen once: Redis shared by the replicas, or this
        // process's books.
        let budget_backend: Arc<dyn BudgetBackend> = match &redis {
            Some(redis) => {
                let shared = SharedBudgets::new(redis.clone(), config.store.retention);
                if tokio::runtime::Handle::try_current().is_ok() {
                    shared.spawn_renewer();
                    shared.spawn_replayer(store.clone());
                }
                // With PostgreSQL's ledger, Redis's reservations are durable there too.
                let shared_ledger = config.store.backend == StoreBackend::Postgres;
                Arc::new(RedisBudgets::new(shared, shared_ledger))
            }
            None => Arc::new(LocalBudgets::new()),
        };
        let budgets = Budgets::new(
            &config,
            store.clone(),
            config.store.session_idle,
            clock.clone(),
        )
        .with_backend(budget_backend);
        // Where the guards' state lives, chosen once: a store the replicas share (Redis,
        // or PostgreSQL) holds each session's, or this process's memory does.
        let guard_backend: Arc<dyn GuardBackend> = if store.is_shared() {
            Arc::new(ReplicaGuards::new(
                store.clone(),
                clock.clone(),
                config.store.session_idle,
            ))
        } else {
            Arc::new(LocalGuards::new(clock.clone()))
        };
        // One live entry a session for its budget book and its guard.
        let guards = SessionGuards::new(
            &config,
            config.store.session_idle,
            store.clone(),
            clock.clone(),
        )
        .with_backend(guard_backend)
        .sharing(budgets.live())
        .counting(Arc::new(match &redis {
            Some(redis) => Restarts::new(Arc::new(SharedRestarts::new(redis.clone()))),
            None => Restarts::local(),
        }));
        // The fleet views: this process's, or the replicas' in Redis (this replica's
        // own as the fallback).
        let fleet_backend: Arc<dyn FleetBackend> = match &redis {
            Some(redis) => Arc::new(ReplicaFleet::new(redis.clone(), clock.clone())),
            None => Arc::new(LocalFleet::new(clock.clone())),
        };
        let fleet = Arc::new(Fleet::new(&config, fleet_backend));
        warn_unpriced(&config);
        let (stream_cut, cut_streams) = StreamCut::channel();
        let body_memory = Arc::new(BodyMemory::from_config(&config.server));
        Ok(AppState {
            activity: Arc::new(Activity::new(tokio::time::Instant::now())),
            traces: crate::otel::Traces::from_config(&config.telemetry, upstream::client()),
            stream_cut,
            cut_streams: Arc::new(cut_streams),
            budgets: Arc::new(budgets),
            store: store.clone(),
            schemas: Arc::new(Schemas::new(config.validation.schema_settings())),
            owners: Arc::new(ResponseOwners::new(store.clone(), clock.clone())),
            journal: Arc::new(Journal::new(
                store.clone(),
                clock.clone(),
                u64::try_from(config.store.session_idle.as_millis()).unwrap_or(u64::MAX),
            )),
            guards: Arc::new(guards),
            fleet,
            clock,
            tenants: Arc::new(TenantKeys::new(&config)),
            health: Arc::new(HealthRegistry::new(&config)),
            routes: Arc::new(routes),
            upstreams: Arc::new(upstreams),
            config: Arc::new(config),
            metrics,
            ready: Arc::new(AtomicBool::new(false)),
            idempotent_in_flight: InFlight::default(),
            body_memory,
        })
    }

    /// The state under a reloaded `config`: what it defines (routes, upstreams, tenant
    /// keys, limits, prices, policies) from `config`; what is live (spend, reservations,
    /// sessions, trips, breakers, idempotency, stored-response owners, the store and the
    /// shared state) carried on for every name that stays. Requests in flight keep the
    /// old state they hold and finish under it. `config`'s restart-only parts (see
    /// [`crate::reload`]) must already be the running ones.
    pub fn reconfigured(&self, config: Config) -> AppState {
        let upstreams = upstream::build_all(&config);
        let routes = RouteTable::new(&config, &upstreams);
        warn_unpriced(&config);
        let settings = config.validation.schema_settings();
        let schemas = if settings == self.config.validation.schema_settings() {
            self.schemas.clone()
        } else {
            Arc::new(Schemas::new(settings))
        };
        AppState {
            routes: Arc::new(routes),
            upstreams: Arc::new(upstreams),
            tenants: Arc::new(TenantKeys::new(&config)),
            health: Arc::new(self.health.reconfigured(&config)),
            budgets: Arc::new(self.budgets.reconfigured(&config)),
            store: self.store.clone(),
            guards: Arc::new(self.guards.reconfigured(&config)),
            fleet: Arc::new(self.fleet.reconfigured(&config)),
            schemas,
            owners: self.owners.clone(),
            journal: self.journal.clone(),
            activity: self.activity.clone(),
            traces: self.traces.clone(),
            clock: self.clock.clone(),
            metrics: self.metrics.clone(),
            ready: self.ready.clone(),
            stream_cut: self.stream_cut.clone(),
            cut_streams: self.cut_streams.clone(),
            idempotent_in_flight: self.idempotent_in_flight.clone(),
            body_memory: if BodyMemory::from_config(&config.server).same_budget(&self.body_memory) {
                self.body_memory.clone()
            } else {
                Arc::new(BodyMemory::from_config(&config.server))
            },
            config: Arc::new(config),
        }
    }
}

/// Models that routes may call but neither `[[prices]]` nor the catalog prices: refused
/// under a USD cap (or charged zero, per `billing.unpriced`).
fn warn_unpriced(config: &Config) {
    for (route, model) in crate::prices::unpriced(config) {
        tracing::warn!(route = %route, model, unpriced = ?config.billing.unpriced, "no price for this model: neither [[prices]] nor the built-in catalog");
    }
}

/// Asserts at compile time that `S` is a service of `Req` (linkerd2-proxy's `check_*`):
/// a layer mounted at the wrong seam fails here, naming the seam.
fn check<Req, S: tower::Service<Req>>(service: S) -> S {
    service
}

/// The proxy stack for `/v1/chat/completions`, `/v1/messages`, `/v1/embeddings` and
/// `/v1/responses`, built inside out so each seam is checked where it is made.
fn proxy_stack(state: &AppState) -> HttpService {
    let server = &state.config.server;
    // The attempt level: one upstream call, metered.
    let leaf = check::<Attempt, _>(TranslateLayer.layer(Forward::new(
        upstream::Clients::new(),
        state.stream_cut.clone(),
    )));
    let metered = check::<Billed, _>(MeterLayer::new(state.budgets.clone()).layer(leaf));
    let metered = check::<Billed, _>(ResponseOwnersLayer::new(state.owners.clone()).layer(metered));
    // The call level: a parsed, routed request, answered by one target.
    let recovered = check::<Call, _>(
        RecoveryLayer::new(RetryPolicy::default(), state.health.clone()).layer(metered),
    );
    let calls = check::<Call, _>(
        ServiceBuilder::new()
            .layer(
                IdempotencyLayer::new(
                    state.store.clone(),
                    state.config.store.idempotency_ttl,
                    server.max_idempotency_key_bytes,
                    state.clock.clone(),
                )
                .in_flight(state.idempotent_in_flight.clone())
                .shared(
                    server.request_timeout,
                    state.store.is_shared()
                        && state.config.state.on_unavailable
                            == crate::config::OnUnavailable::Closed,
                ),
            )
            .layer(AdmissionLayer::new(
                state.budgets.clone(),
                state.guards.clone(),
                state.fleet.clone(),
            ))
            .layer(ValidateLayer::new(
                state.schemas.clone(),
                state.config.validation.clone(),
            ))
            .layer(SideEffectsLayer::new(&state.config, state.journal.clone()))
            .service(recovered),
    );
    http_front(state, calls)
}

/// The HTTP level of every stack that serves calls: edge, errors, deadline, tenant auth,
/// the request span, and the context layer that turns HTTP into a [`Call`] for `calls`.
fn http_front<S>(state: &AppState, calls: S) -> HttpService
where
    S: tower::Service<Call, Response = Response, Error = GatewayError>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let server = &state.config.server;
    let stack = ServiceBuilder::new()
        .layer(EdgeLayer::counted(state.activity.clone()))
        .layer(TraceLayer::new(state.traces.clone()))
        .layer(RespondLayer)
        .layer(DeadlineLayer::new(server.request_timeout))
        .layer(AuthLayer::new(state.tenants.clone()))
        .map_response(edge::unwrap_body)
        .layer(edge::span_layer(server.max_session_id_bytes))
        .layer(
            ContextLayer::new(
                state.routes.clone(),
                server.max_body_bytes,
                server.max_session_id_bytes,
            )
            .session_id_fields(&server.session_id_fields)
            .body_limits(server, state.body_memory.clone()),
        )
        .service(calls);
    BoxCloneSyncService::new(stack)
}

/// `POST /v1/messages/count_tokens`: routed by `model` to the route's Anthropic targets
/// and recovered like any call (retries, breakers, failover), held to the tenant's and
/// session's request rates, but never charged or guarded: counting tokens spends
/// nothing, and agents do it before each call.
fn count_tokens_stack(state: &AppState) -> HttpService {
    let leaf = check::<Billed, _>(Unmetered::new(Forward::new(
        upstream::Clients::new(),
        state.stream_cut.clone(),
    )));
    let recovered = check::<Call, _>(
        RecoveryLayer::new(RetryPolicy::default(), state.health.clone()).layer(leaf),
    );
    let calls = ServiceBuilder::new()
        .layer(RatesLayer::new(state.budgets.clone()))
        .layer(UnvalidatedLayer)
        .service(recovered);
    http_front(state, calls)
}

/// The Responses API's stored-response routes (`/v1/responses/{id}`, `.../cancel`,
/// `.../input_items`): edge, errors, deadline, auth and span as for the proxy, then one
/// forwarded call to the `[responses] upstream` with its key; no budget, guard or
/// validation, since nothing is generated (see [`upstream::objects`]).
fn response_objects_stack(state: &AppState) -> HttpService {
    let server = &state.config.server;
    let upstream = state
        .config
        .responses_upstream()
        .and_then(|name| state.upstreams.get(name).cloned());
    let leaf = check::<Request<Body>, _>(ForwardObject::new(
        upstream::client(),
        upstream,
        state.owners.clone(),
        server.max_body_bytes,
        state.stream_cut.clone(),
        state.budgets.background.clone(),
    ));
    let stack = ServiceBuilder::new()
        .layer(EdgeLayer::default())
        .layer(RespondLayer)
        .layer(DeadlineLayer::new(server.request_timeout))
        .layer(AuthLayer::new(state.tenants.clone()))
        .map_response(edge::unwrap_body)
        .layer(edge::span_layer(server.max_session_id_bytes))
        .service(leaf);
    BoxCloneSyncService::new(stack)
}

/// `GET /v1/models`: the same edge, error and auth layers over a listing of the routes.
fn models_stack(state: &AppState) -> HttpService {
    let routes = state.routes.clone();
    let answer = tower::service_fn(move |req: Request<Body>| {
        let routes = routes.clone();
        async move {
            let anthropic = req.headers().contains_key("anthropic-version");
            match req.uri().path().strip_prefix("/v1/models/") {
                None => Ok(list_models(&routes, anthropic)),
                Some(id) => retrieve_model(&routes, id, anthropic),
            }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(EdgeLayer::default())
        .layer(RespondLayer)
        .layer(AuthLayer::new(state.tenants.clone()))
        .map_response(edge::unwrap_body)
        .layer(edge::span_layer(state.config.server.max_session_id_bytes))
        .service(answer);
    BoxCloneSyncService::new(stack)
}

/// One model object, in the Anthropic shape when the caller sent `anthropic-version`
/// (the Anthropic SDK always does), else the OpenAI shape.
fn model_object(id: &str, anthropic: bool) -> serde_json::Value {
    if anthropic {
        json!({"type": "model", "id": id, "display_name": id, "created_at": "1970-01-01T00:00:00Z"})
    } else {
        json!({"id": id, "object": "model", "created": 0, "owned_by": "backstop"})
    }
}

fn json_ok(body: serde_json::Value) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The concrete model ids the routes serve (see [`RouteTable::model_names`]).
fn list_models(routes: &RouteTable, anthropic: bool) -> Response {
    let names = routes.model_names();
    let data: Vec<_> = names.iter().map(|id| model_object(id, anthropic)).collect();
    json_ok(if anthropic {
        json!({"data": data, "has_more": false, "first_id": names.first(), "last_id": names.last()})
    } else {
        json!({"object": "list", "data": data})
    })
}

/// Any id a route would serve (a glob route serves every id it matches); else 404
/// `model_not_found`, in the caller's shape.
fn retrieve_model(
    routes: &RouteTable,
    raw: &str,
    anthropic: bool,
) -> Result<Response, GatewayError> {
    let id = percent_encoding::percent_decode_str(raw).decode_utf8_lossy();
    match routes.resolve(&id) {
        Some(_) if !id.is_empty() => Ok(json_ok(model_object(&id, anthropic))),
        _ => Err(GatewayError::ModelNotFound(id.into_owned())),
    }
}

/// The whole HTTP surface as served: the router inside the layers every route shares
/// (see the module doc). Named, not boxed: no allocation per request for the wrapping.
pub type App = SetSensitiveRequestHeaders<
    MapRequest<
        SetRequestId<
            PropagateRequestId<SetSensitiveResponseHeaders<RequestBodyTimeout<Router>>>,
            MakeId,
        >,
        fn(Request<Incoming>) -> Request<Incoming>,
    >,
>;

/// The full HTTP surface, with no reload (`POST /admin/reload` answers 409).
pub fn router(state: AppState) -> App {
    router_with(state, crate::admin::no_reload())
}

/// The full HTTP surface; `POST /admin/reload` and the config stamp go to `reload`.
pub fn router_with(state: AppState, reload: Weak<dyn Reload>) -> App {
    let sensitive = edge::sensitive_headers();
    let body_read_timeout = state.config.server.body_read_timeout;
    ServiceBuilder::new()
        .layer(SetSensitiveRequestHeadersLayer::new(sensitive.clone()))
        .layer(MapRequestLayer::new(
            edge::drop_invalid_request_id::<Incoming> as fn(_) -> _,
        ))
        .layer(SetRequestIdLayer::new(X_REQUEST_ID.clone(), MakeId))
        .layer(PropagateRequestIdLayer::new(X_REQUEST_ID.clone()))
        .layer(SetSensitiveResponseHeadersLayer::new(sensitive))
        .layer(RequestBodyTimeoutLayer::new(body_read_timeout))
        .service(routes(state, reload))
}

/// The routes; the proxy, model-list and admin ones each behind their own stack.
fn routes(state: AppState, reload: Weak<dyn Reload>) -> Router {
    let proxy = proxy_stack(&state);
    let models = models_stack(&state);
    let objects = response_objects_stack(&state);
    Router::new()
        .route(
            Endpoint::ChatCompletions.path(),
            post_service(proxy.clone()),
        )
        .route(Endpoint::Messages.path(), post_service(proxy.clone()))
        .route(
            Endpoint::CountTokens.path(),
            post_service(count_tokens_stack(&state)),
        )
        .route(Endpoint::Embeddings.path(), post_service(proxy.clone()))
        .route(Endpoint::Responses.path(), post_service(proxy))
        .route(
            "/v1/responses/{id}",
            get_service(objects.clone()).delete_service(objects.clone()),
        )
        .route("/v1/responses/{id}/cancel", post_service(objects.clone()))
        .route("/v1/responses/{id}/input_items", get_service(objects))
        .route("/v1/models", get_service(models.clone()))
        .route("/v1/models/{*id}", get_service(models))
        .merge(crate::admin::routes(admin_state(&state, reload)))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .fallback_service(unknown_path_stack())
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// What the admin API may see: its own narrow state, not [`AppState`].
fn admin_state(state: &AppState, reload: Weak<dyn Reload>) -> AdminState {
    AdminState {
        reload,
        health: state.health.clone(),
        upstream_apis: Arc::new(
            state
                .upstreams
                .iter()
                .map(|(name, upstream)| (name.clone(), upstream.provider))
                .collect(),
        ),
        budgets: state.budgets.clone(),
        guards: state.guards.clone(),
        journal: state.journal.clone(),
        fleet: state.fleet.clone(),
        tenants: state.tenants.clone(),
        activity: state.activity.clone(),
        max_session_id_bytes: state.config.server.max_session_id_bytes,
        token: state
            .config
            .admin
            .token
            .as_ref()
            .map(|token| Arc::from(token.expose())),
    }
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
    let api = Endpoint::wire_for(req.uri().path(), req.headers());
    let err = GatewayError::MethodNotAllowed {
        method: req.method().to_string(),
        path: req.uri().path().to_string(),
    };
    let mut response = error_response(&err, api);
    crate::error::respond::mark_no_retry(&mut response);
    response
}

/// Any other path: 404 `not_found` in the caller's API shape, through the edge (a log
/// line, `backstop_requests_total{endpoint="unknown"}`) and the respond layer
/// (`x-should-retry: false`), so an operator sees agents calling what Backstop lacks.
fn unknown_path_stack() -> HttpService {
    let refuse = tower::service_fn(|req: Request<Body>| async move {
        Err::<Response, _>(GatewayError::NotFound {
            method: req.method().to_string(),
            path: req.uri().path().to_string(),
        })
    });
    BoxCloneSyncService::new(
        ServiceBuilder::new()
            .layer(EdgeLayer::labelled("unknown"))
            .layer(RespondLayer)
            .service(refuse),
    )
}
