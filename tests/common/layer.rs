//! The layer test kit (issue 48): each layer inside the context layer tested as a layer,
//! in process, through its public constructor and `ServiceExt::oneshot`, with no socket
//! and no server (as tower-http tests its layers; linkerd2-proxy keeps the same kind of
//! kit in `linkerd/app/test`).
//!
//! - [`Kit`]: the state the layers are built from ([`AppState`], from a [`TestConfig`]
//!   over [`LAYERS`]) and each layer's constructor, called as `app.rs` calls it;
//! - [`CallBuilder`]: a [`Call`] as the context layer would make it (the body parsed and
//!   routed by [`parse`]), stating only what a test cares about;
//! - [`Scripted`]: the inner service, at any of the four seams ([`AtCall`],
//!   [`AtRecovery`], [`AtMeter`], [`AtLeaf`]): it plays a queue of [`Canned`] answers and
//!   records every request it received ([`Received`]), so a test asserts exact attempt
//!   counts and what the upstream was sent;
//! - [`TenantLimits`]: the tenant keys the admission and meter layers read, typed.
//!
//! ```ignore
//! let kit = Kit::new().await;
//! let inner = Scripted::at_call([Canned::ok(chat_answer("hi"))]);
//! let call = kit.call().session("s1").idempotency_key("k").build();
//! let response = kit.idempotency().layer(inner.clone()).oneshot(call).await.unwrap();
//! assert_eq!(inner.count(), 1);
//! ```
#![allow(dead_code)]

use std::{
    collections::VecDeque,
    marker::PhantomData,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use backstop::{
    api::Endpoint,
    app::AppState,
    clock::Clock,
    config::ValidationConfig,
    error::GatewayError,
    layers::{
        admission::AdmissionLayer,
        context::{parse, Call, TargetIndex},
        deadline::Deadline,
        idempotency::IdempotencyLayer,
        meter::{Billed, HeldContext, MeterLayer},
        owners::ResponseOwnersLayer,
        recovery::{Answered, AnsweredBy, RecoveryLayer, RetryPolicy, Unanswered},
        validate::ValidateLayer,
    },
    policy::{
        classify::TransportFailure,
        trail::{Reason, Step},
    },
    routing::{Route, RouteTable},
    store::Store,
    telemetry::{RequestLog, Trail},
    translate::Direction,
    upstream::{Attempt, AttemptError, Reply, ReplyBody},
};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};
use tokio::time::Instant;

use super::TestConfig;

/// The tenant every [`CallBuilder`] calls as unless told otherwise.
pub const TENANT: &str = "t";
/// A second tenant, for what must not leak between tenants.
pub const OTHER_TENANT: &str = "u";

/// The kit's config: three upstreams nothing listens on (the inner service stands in for
/// them), routes to each, two tenants and a price for `gpt-4o*`. The retry waits are
/// round numbers, so a test on a paused clock asserts them exactly.
pub const LAYERS: &str = r#"
[store]
path = ":memory:"

[retry]
max_attempts = 2
base_delay = "100ms"
max_delay = "1s"
max_retry_after = "5s"

[[upstreams]]
name = "openai"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://openai.invalid"

[[upstreams]]
name = "backup"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "http://backup.invalid"

[[upstreams]]
name = "anthropic"
api = "anthropic"
base_url = "http://anthropic.invalid"

[[routes]]
model = "gpt-*"
targets = [{ upstream = "openai" }]

[[routes]]
model = "two"
targets = [{ upstream = "openai" }, { upstream = "backup", model = "backup-model" }]

[[routes]]
model = "claude-*"
targets = [{ upstream = "anthropic" }]

[[tenants]]
name = "t"
api_keys = ["bk-layer-kit-t"]

[[tenants]]
name = "u"
api_keys = ["bk-layer-kit-u"]

[[prices]]
model = "gpt-4o*"
input_per_mtok = 2.5
output_per_mtok = 10.0
"#;

/// The retry jitter pinned to the top of its range, so backoff waits are exact.
pub fn pinned_jitter() -> RetryPolicy {
    RetryPolicy {
        jitter: || 0.999_999_999,
    }
}

/// What the layers are built from: the gateway's own state for a config.
pub struct Kit {
    pub state: AppState,
}

impl Kit {
    /// The state for [`LAYERS`].
    pub async fn new() -> Kit {
        Kit::with(|config| config).await
    }

    /// The state for [`LAYERS`] as `edit` changes it.
    pub async fn with(edit: impl FnOnce(TestConfig) -> TestConfig) -> Kit {
        let config = edit(TestConfig::parse(LAYERS)).config();
        let state = AppState::with_clock(config, Clock::system())
            .await
            .expect("the layer kit's state opens");
        Kit { state }
    }

    /// A call on this config's routes.
    pub fn call(&self) -> CallBuilder {
        CallBuilder::new(self.state.routes.clone())
    }

    /// The store the state writes to (idempotent responses, owners, ledgers).
    pub fn store(&self) -> Arc<dyn Store> {
        self.state.store.clone()
    }

    /// The idempotency layer as `app.rs` builds it (a store that is not shared).
    pub fn idempotency(&self) -> IdempotencyLayer {
        let config = &self.state.config;
        IdempotencyLayer::new(
            self.store(),
            config.store.idempotency_ttl,
            config.server.max_idempotency_key_bytes,
            self.state.clock.clone(),
        )
    }

    pub fn admission(&self) -> AdmissionLayer {
        AdmissionLayer::new(
            self.state.budgets.clone(),
            self.state.guards.clone(),
            self.state.fleet.clone(),
        )
    }

    /// The validate layer with the config's `[validation]`.
    pub fn validate(&self) -> ValidateLayer {
        self.validate_with(self.state.config.validation.clone())
    }

    /// The validate layer with these settings.
    pub fn validate_with(&self, config: ValidationConfig) -> ValidateLayer {
        ValidateLayer::new(self.state.schemas.clone(), config)
    }

    /// The recovery layer, its jitter pinned ([`pinned_jitter`]).
    pub fn recovery(&self) -> RecoveryLayer {
        RecoveryLayer::new(pinned_jitter(), self.state.health.clone())
    }

    pub fn owners(&self) -> ResponseOwnersLayer {
        ResponseOwnersLayer::new(self.state.owners.clone())
    }

    pub fn meter(&self) -> MeterLayer {
        MeterLayer::new(self.state.budgets.clone())
    }
}

/// The `[[tenants]]` keys the admission and meter layers read, typed: each setter is a
/// key of the tenant's table, written into a [`TestConfig`] by [`TenantLimits::apply`].
///
/// ```ignore
/// Kit::with(TenantLimits::of("t").session_max_concurrent(1).edit()).await
/// ```
#[derive(Clone, Debug)]
pub struct TenantLimits {
    tenant: String,
    keys: Vec<(&'static str, toml::Value)>,
}

impl TenantLimits {
    pub fn of(tenant: &str) -> TenantLimits {
        TenantLimits {
            tenant: tenant.to_string(),
            keys: Vec::new(),
        }
    }

    fn key(mut self, key: &'static str, value: impl Into<toml::Value>) -> TenantLimits {
        self.keys.push((key, value.into()));
        self
    }

    /// `requests_per_minute`: the whole tenant's request rate.
    pub fn requests_per_minute(self, n: u32) -> Self {
        self.key("requests_per_minute", i64::from(n))
    }

    /// `session.requests_per_minute`.
    pub fn session_requests_per_minute(self, n: u32) -> Self {
        self.key("session.requests_per_minute", i64::from(n))
    }

    /// `session.max_concurrent`.
    pub fn session_max_concurrent(self, n: u32) -> Self {
        self.key("session.max_concurrent", i64::from(n))
    }

    /// `session.max_calls`: upstream calls, retries included.
    pub fn session_max_calls(self, n: u64) -> Self {
        self.key("session.max_calls", n as i64)
    }

    /// `session.max_usd`.
    pub fn session_max_usd(self, usd: f64) -> Self {
        self.key("session.max_usd", usd)
    }

    /// `budget.usd_per_day`.
    pub fn usd_per_day(self, usd: f64) -> Self {
        self.key("budget.usd_per_day", usd)
    }

    /// `guard.identical_request_limit` (turns the session guard on).
    pub fn guard_identical_requests(self, n: u32) -> Self {
        self.key("guard.identical_request_limit", i64::from(n))
    }

    /// `guard.max_consecutive_failures` (turns the session guard on).
    pub fn guard_consecutive_failures(self, n: u32) -> Self {
        self.key("guard.max_consecutive_failures", i64::from(n))
    }

    /// `guard.guide = true` (turns the session guard on).
    pub fn guard_guide(self) -> Self {
        self.key("guard.guide", true)
    }

    /// The keys written into `config` (the tenant must exist).
    pub fn apply(self, mut config: TestConfig) -> TestConfig {
        for (key, value) in self.keys {
            config = config.set(&format!("tenants.{}.{key}", self.tenant), value);
        }
        config
    }

    /// As an edit for [`Kit::with`].
    pub fn edit(self) -> impl FnOnce(TestConfig) -> TestConfig {
        move |config| self.apply(config)
    }
}

/// A [`Call`] as the context layer makes one: the body parsed and routed as it parses
/// and routes it ([`parse`]), the session in `x-session-id` and in the call. Defaults:
/// tenant [`TENANT`], a chat completion for `gpt-4o` saying "hello", no session, an
/// hour's deadline, the route's first target.
#[derive(Clone)]
pub struct CallBuilder {
    routes: Arc<RouteTable>,
    endpoint: Endpoint,
    model: String,
    body: Option<Value>,
    fields: Map<String, Value>,
    tenant: String,
    session: Option<String>,
    headers: HeaderMap,
    request_id: HeaderValue,
    deadline: Duration,
    route: Option<Arc<Route>>,
    start: usize,
    keep_answer: bool,
    log: Option<Arc<RequestLog>>,
}

impl CallBuilder {
    pub fn new(routes: impl Into<Arc<RouteTable>>) -> CallBuilder {
        CallBuilder {
            routes: routes.into(),
            endpoint: Endpoint::ChatCompletions,
            model: "gpt-4o".into(),
            body: None,
            fields: Map::new(),
            tenant: TENANT.into(),
            session: None,
            headers: HeaderMap::new(),
            request_id: HeaderValue::from_static("test"),
            deadline: Duration::from_secs(3600),
            route: None,
            start: 0,
            keep_answer: false,
            log: None,
        }
    }

    /// Called on `endpoint`, with that endpoint's default body (unless [`Self::body`]).
    pub fn endpoint(mut self, endpoint: Endpoint) -> Self {
        self.endpoint = endpoint;
        self
    }

    /// The model the default body asks for.
    pub fn model(mut self, model: &str) -> Self {
        self.model = model.into();
        self
    }

    /// This whole body instead of the default one (its `model` routes it).
    pub fn body(mut self, body: Value) -> Self {
        self.body = Some(body);
        self
    }

    /// A top-level body field, set over the body.
    pub fn field(mut self, key: &str, value: Value) -> Self {
        self.fields.insert(key.into(), value);
        self
    }

    /// The user message of the default body says `text`.
    pub fn saying(self, text: &str) -> Self {
        let content = match self.endpoint {
            Endpoint::Responses | Endpoint::Embeddings => return self.field("input", json!(text)),
            _ => json!([{"role": "user", "content": text}]),
        };
        self.field("messages", content)
    }

    /// `"stream": true`.
    pub fn stream(self) -> Self {
        self.field("stream", json!(true))
    }

    pub fn tenant(mut self, tenant: &str) -> Self {
        self.tenant = tenant.into();
        self
    }

    /// The session, as `x-session-id` names it.
    pub fn session(mut self, session: &str) -> Self {
        self.session = Some(session.into());
        self.header("x-session-id", session)
    }

    /// A client request header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.insert(
            HeaderName::from_bytes(name.as_bytes()).expect("a header name"),
            HeaderValue::from_str(value).expect("a header value"),
        );
        self
    }

    /// `Idempotency-Key: key`.
    pub fn idempotency_key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    pub fn request_id(mut self, id: &'static str) -> Self {
        self.request_id = HeaderValue::from_static(id);
        self
    }

    /// The request's deadline, from now.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// This route instead of the one the model resolves to.
    pub fn route(mut self, route: Arc<Route>) -> Self {
        self.route = Some(route);
        self
    }

    /// The first target to try.
    pub fn start(mut self, index: usize) -> Self {
        self.start = index;
        self
    }

    /// Keep the parsed answer (what the validate layer asks for).
    pub fn keep_answer(mut self) -> Self {
        self.keep_answer = true;
        self
    }

    /// Writes into this request record (the edge's), to read what layers wrote.
    pub fn log(mut self, log: Arc<RequestLog>) -> Self {
        self.log = Some(log);
        self
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        let mut body = self.body.clone().unwrap_or_else(|| self.default_body());
        let object = body.as_object_mut().expect("a body is a JSON object");
        for (key, value) in &self.fields {
            object.insert(key.clone(), value.clone());
        }
        body
    }

    fn default_body(&self) -> Value {
        let model = &self.model;
        let hello = json!([{"role": "user", "content": "hello"}]);
        match self.endpoint {
            Endpoint::ChatCompletions => json!({"model": model, "messages": hello}),
            Endpoint::Messages | Endpoint::CountTokens => {
                json!({"model": model, "max_tokens": 256, "messages": hello})
            }
            Endpoint::Responses | Endpoint::Embeddings => json!({"model": model, "input": "hello"}),
        }
    }

    /// The call; panics if the context layer would refuse the body.
    pub fn build(&self) -> Call {
        let body = Bytes::from(self.json().to_string());
        let (request, route) = parse(self.endpoint, body, &self.routes)
            .unwrap_or_else(|e| panic!("the context layer would refuse this call: {e}"));
        Call {
            request: Arc::new(request),
            route: self.route.clone().unwrap_or(route),
            tenant: self.tenant.as_str().into(),
            session: self.session.as_deref().map(Arc::from),
            headers: Arc::new(self.headers.clone()),
            request_id: self.request_id.clone(),
            log: self.log.clone().unwrap_or_default(),
            deadline: Deadline {
                at: Instant::now() + self.deadline,
                timeout: self.deadline,
            },
            start: TargetIndex(self.start),
            keep_answer: self.keep_answer,
            prepaid: None,
        }
    }

    /// The attempt recovery would make of this call on its start target, untranslated.
    pub fn attempt(&self) -> Attempt {
        attempt_of(&self.build())
    }

    /// The attempt with who pays for it, as recovery hands it to the meter.
    pub fn billed(&self) -> Billed {
        billed_of(&self.build())
    }
}

/// The attempt recovery makes of `call` on its start target (untranslated: the target
/// must speak the caller's API).
pub fn attempt_of(call: &Call) -> Attempt {
    let target = &call.route.targets[call.start.0];
    Attempt {
        request: call.request.clone(),
        upstream: target.upstream.clone(),
        model: target.model.clone(),
        headers: call.headers.clone(),
        timeout: target.upstream.attempt_timeout,
        stream_usage: false,
        keep_answer: call.keep_answer,
        trace: None,
        translation: None,
    }
}

/// [`attempt_of`] with who pays for it, as recovery hands it to the meter.
pub fn billed_of(call: &Call) -> Billed {
    Billed {
        attempt: attempt_of(call),
        tenant: call.tenant.clone(),
        session: call.session.clone(),
        log: call.log.clone(),
        held: HeldContext::default(),
        prepaid: call.prepaid.clone(),
    }
}

/// Holds the answers it is put on until it is opened.
#[derive(Clone, Default)]
pub struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Gate {
    pub fn new() -> Gate {
        Gate::default()
    }

    pub fn open(&self) {
        self.0.send_replace(true);
    }

    async fn passed(&self) {
        let mut open = self.0.subscribe();
        let _ = open.wait_for(|open| *open).await;
    }
}

/// What a canned answer is.
#[derive(Clone)]
enum Outcome {
    Reply {
        status: StatusCode,
        body: Bytes,
        stream: bool,
    },
    Transport(TransportFailure),
    /// Waits the attempt's timeout, then times out.
    Timeout,
    Error(Arc<dyn Fn() -> GatewayError + Send + Sync>),
}

/// One answer of a [`Scripted`] service: a reply (whole or streamed), a transport
/// failure, or a refusal, optionally held by a [`Gate`] or a delay.
#[derive(Clone)]
pub struct Canned {
    outcome: Outcome,
    headers: HeaderMap,
    delay: Option<Duration>,
    gate: Option<Gate>,
}

impl Canned {
    fn of(outcome: Outcome) -> Canned {
        Canned {
            outcome,
            headers: HeaderMap::new(),
            delay: None,
            gate: None,
        }
    }

    /// `status` with a JSON body.
    pub fn json(status: u16, body: Value) -> Canned {
        Canned::raw(status, body.to_string()).header("content-type", "application/json")
    }

    /// 200 with a JSON body.
    pub fn ok(body: Value) -> Canned {
        Canned::json(200, body)
    }

    /// `status` with an empty body.
    pub fn status(status: u16) -> Canned {
        Canned::raw(status, "")
    }

    /// `status` with this body and no content type.
    pub fn raw(status: u16, body: impl Into<Bytes>) -> Canned {
        Canned::of(Outcome::Reply {
            status: StatusCode::from_u16(status).expect("a status code"),
            body: body.into(),
            stream: false,
        })
    }

    /// A 200 event stream of these SSE bytes (see [`chat_stream`]).
    pub fn sse(events: impl Into<Bytes>) -> Canned {
        Canned::of(Outcome::Reply {
            status: StatusCode::OK,
            body: events.into(),
            stream: true,
        })
        .header("content-type", "text/event-stream")
    }

    /// No answer: the transport failed (attempt seams only).
    pub fn transport(failure: TransportFailure) -> Canned {
        Canned::of(Outcome::Transport(failure))
    }

    /// The attempt's whole timeout passes, then it times out (attempt seams only).
    pub fn timeout() -> Canned {
        Canned::of(Outcome::Timeout)
    }

    /// A refusal: the error at the call seams, `AttemptError::Refused` at the meter's.
    pub fn error(error: impl Fn() -> GatewayError + Send + Sync + 'static) -> Canned {
        Canned::of(Outcome::Error(Arc::new(error)))
    }

    /// A response header.
    pub fn header(mut self, name: &str, value: &str) -> Canned {
        self.headers.insert(
            HeaderName::from_bytes(name.as_bytes()).expect("a header name"),
            HeaderValue::from_str(value).expect("a header value"),
        );
        self
    }

    /// Answered only after `delay` (on a paused clock, virtual time).
    pub fn after(mut self, delay: Duration) -> Canned {
        self.delay = Some(delay);
        self
    }

    /// Answered only once `gate` is opened.
    pub fn until(mut self, gate: &Gate) -> Canned {
        self.gate = Some(gate.clone());
        self
    }

    async fn wait(&self) {
        if let Some(gate) = &self.gate {
            gate.passed().await;
        }
        if let Some(delay) = self.delay {
            tokio::time::sleep(delay).await;
        }
    }

    /// The reply this answer is for a request on `endpoint`.
    fn reply(
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        stream: bool,
        endpoint: Endpoint,
        keep: bool,
    ) -> Reply {
        if stream {
            Reply {
                status,
                headers,
                body: ReplyBody::Stream(Body::from(body)),
                stream_usage: None,
                view: None,
            }
        } else {
            Reply::whole(endpoint, status, headers, body, keep)
        }
    }
}

/// One request a [`Scripted`] service received, as its seam sees it.
#[derive(Clone, Debug)]
pub struct Received {
    /// The endpoint it is for (an attempt's: the target's, once translated).
    pub endpoint: Endpoint,
    /// The body: at the call seams the call's JSON; at the attempt seams the body the
    /// leaf would send the upstream (the target's model and the usage option written in).
    pub body: Value,
    /// The client's request headers it carried.
    pub headers: HeaderMap,
    pub tenant: Option<String>,
    pub session: Option<String>,
    /// The upstream asked (attempt seams).
    pub upstream: Option<String>,
    /// The model asked: a target's rewrite, else the request's own.
    pub model: String,
    /// The meter asked the leaf to have the stream report usage.
    pub stream_usage: bool,
    /// What the owners layer handed the meter (attempt seams with a [`Billed`]).
    pub held: Option<HeldContext>,
    /// The call's first target (call seams).
    pub start: Option<usize>,
    pub keep_answer: bool,
    /// The translation the attempt carries (attempt seams).
    pub translated: Option<Direction>,
    /// When, from the service's making.
    pub at: Duration,
}

impl Received {
    fn of_call(call: &Call, at: Duration) -> Received {
        Received {
            endpoint: call.endpoint(),
            body: Value::Object(call.request.json.clone()),
            headers: (*call.headers).clone(),
            tenant: Some(call.tenant.to_string()),
            session: call.session.as_deref().map(str::to_owned),
            upstream: None,
            model: call.request.model.clone(),
            stream_usage: false,
            held: None,
            start: Some(call.start.0),
            keep_answer: call.keep_answer,
            translated: None,
            at,
        }
    }

    fn of_attempt(attempt: &Attempt, at: Duration) -> Received {
        let request = &attempt.request;
        let sent = request.upstream_body(
            attempt.model.as_deref(),
            attempt.stream_usage && request.endpoint == Endpoint::ChatCompletions,
        );
        Received {
            endpoint: request.endpoint,
            body: serde_json::from_slice(&sent).expect("an upstream body is JSON"),
            headers: (*attempt.headers).clone(),
            tenant: None,
            session: None,
            upstream: Some(attempt.upstream.name.to_string()),
            model: attempt
                .model
                .as_deref()
                .map_or_else(|| request.model.clone(), str::to_owned),
            stream_usage: attempt.stream_usage,
            held: None,
            start: None,
            keep_answer: attempt.keep_answer,
            translated: attempt.translation.as_ref().map(|t| t.direction),
            at,
        }
    }

    fn of_billed(billed: &Billed, at: Duration) -> Received {
        Received {
            tenant: Some(billed.tenant.to_string()),
            session: billed.session.as_deref().map(str::to_owned),
            held: Some(billed.held),
            ..Received::of_attempt(&billed.attempt, at)
        }
    }

    /// A header's value, as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// The seam a [`Scripted`] service stands at: what it takes and answers.
pub trait Seam: Send + Sync + 'static {}

/// Takes a [`Call`], answers the client's response (the inner service of idempotency and
/// admission: what validation answers).
pub struct AtCall;
/// Takes a [`Call`], answers what recovery does ([`Answered`]): the validate layer's
/// inner service.
pub struct AtRecovery;
/// Takes a [`Billed`] attempt, answers a [`Reply`] or an [`AttemptError`]: where the
/// meter stands, below recovery and the owners layer.
pub struct AtMeter;
/// Takes an [`Attempt`], answers a [`Reply`] or a [`TransportFailure`]: the leaf, below
/// the meter and the translate layer.
pub struct AtLeaf;

impl Seam for AtCall {}
impl Seam for AtRecovery {}
impl Seam for AtMeter {}
impl Seam for AtLeaf {}

struct Script {
    plays: VecDeque<Canned>,
    /// Played once the queue is empty; without it, a request past the script panics.
    otherwise: Option<Canned>,
    received: Vec<Received>,
}

/// A scripted inner service: answers each request with the next [`Canned`] of its
/// queue (then [`Scripted::otherwise`], if set; a request past the script fails the
/// test), and records every request it received. Clones share the script.
pub struct Scripted<At> {
    script: Arc<Mutex<Script>>,
    t0: Instant,
    _at: PhantomData<fn() -> At>,
}

impl<At> Clone for Scripted<At> {
    fn clone(&self) -> Self {
        Scripted {
            script: self.script.clone(),
            t0: self.t0,
            _at: PhantomData,
        }
    }
}

impl Scripted<AtCall> {
    pub fn at_call(plays: impl IntoIterator<Item = Canned>) -> Self {
        Scripted::new(plays)
    }
}

impl Scripted<AtRecovery> {
    pub fn at_recovery(plays: impl IntoIterator<Item = Canned>) -> Self {
        Scripted::new(plays)
    }
}

impl Scripted<AtMeter> {
    pub fn at_meter(plays: impl IntoIterator<Item = Canned>) -> Self {
        Scripted::new(plays)
    }
}

impl Scripted<AtLeaf> {
    pub fn at_leaf(plays: impl IntoIterator<Item = Canned>) -> Self {
        Scripted::new(plays)
    }
}

impl<At: Seam> Scripted<At> {
    fn new(plays: impl IntoIterator<Item = Canned>) -> Self {
        Scripted {
            script: Arc::new(Mutex::new(Script {
                plays: plays.into_iter().collect(),
                otherwise: None,
                received: Vec::new(),
            })),
            t0: Instant::now(),
            _at: PhantomData,
        }
    }

    /// Played for every request once the queue is empty.
    pub fn otherwise(self, canned: Canned) -> Self {
        self.script.lock().unwrap().otherwise = Some(canned);
        self
    }

    /// Queues another answer.
    pub fn push(&self, canned: Canned) {
        self.script.lock().unwrap().plays.push_back(canned);
    }

    /// How many requests it received.
    pub fn count(&self) -> usize {
        self.script.lock().unwrap().received.len()
    }

    /// Every request it received, in order.
    pub fn received(&self) -> Vec<Received> {
        self.script.lock().unwrap().received.clone()
    }

    /// The last request it received.
    pub fn last(&self) -> Received {
        self.received()
            .pop()
            .expect("the scripted service received nothing")
    }

    /// The bodies it received, in order.
    pub fn bodies(&self) -> Vec<Value> {
        self.received().into_iter().map(|r| r.body).collect()
    }

    /// The upstreams it was asked, in order (attempt seams).
    pub fn upstreams(&self) -> Vec<String> {
        self.received()
            .into_iter()
            .map(|r| r.upstream.unwrap_or_default())
            .collect()
    }

    /// Answers not played yet.
    pub fn unplayed(&self) -> usize {
        self.script.lock().unwrap().plays.len()
    }

    /// Records `received` and takes its answer.
    fn take(&self, received: impl FnOnce(Duration) -> Received) -> Canned {
        let mut script = self.script.lock().unwrap();
        script.received.push(received(self.t0.elapsed()));
        let n = script.received.len();
        match script.plays.pop_front() {
            Some(canned) => canned,
            None => script.otherwise.clone().unwrap_or_else(|| {
                panic!("the scripted service received request {n}, past the end of its script")
            }),
        }
    }
}

fn ready<E>(_: &mut Context<'_>) -> Poll<Result<(), E>> {
    Poll::Ready(Ok(()))
}

impl tower::Service<Call> for Scripted<AtCall> {
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        ready(cx)
    }

    fn call(&mut self, call: Call) -> Self::Future {
        let canned = self.take(|at| Received::of_call(&call, at));
        Box::pin(async move {
            canned.wait().await;
            match canned.outcome {
                Outcome::Reply { status, body, .. } => {
                    let mut response = Response::new(Body::from(body));
                    *response.status_mut() = status;
                    *response.headers_mut() = canned.headers;
                    Ok(response)
                }
                Outcome::Error(error) => Err(error()),
                Outcome::Transport(_) | Outcome::Timeout => {
                    panic!("a transport failure has no meaning at the call seam")
                }
            }
        })
    }
}

impl tower::Service<Call> for Scripted<AtRecovery> {
    type Response = Answered;
    type Error = Unanswered;
    type Future = BoxFuture<'static, Result<Answered, Unanswered>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Unanswered>> {
        ready(cx)
    }

    /// Answers as recovery does after one attempt on the call's start target.
    fn call(&mut self, call: Call) -> Self::Future {
        let canned = self.take(|at| Received::of_call(&call, at));
        Box::pin(async move {
            canned.wait().await;
            let target = &call.route.targets[call.start.0];
            let mut trail = Trail {
                upstream: Some(target.upstream.name.clone()),
                model: target.model.clone(),
                attempts: 1,
                ..Trail::default()
            };
            match canned.outcome {
                Outcome::Reply {
                    status,
                    body,
                    stream,
                } => {
                    trail.steps.push(if status.is_success() {
                        Step::Ok
                    } else {
                        Step::Pass(Reason::Status(status.as_u16()))
                    });
                    let reply = Canned::reply(
                        status,
                        canned.headers,
                        body,
                        stream,
                        call.endpoint(),
                        call.keep_answer,
                    );
                    Ok(Answered {
                        reply,
                        by: Some(AnsweredBy::Target(call.start)),
                        trail,
                    })
                }
                Outcome::Error(error) => {
                    let error = error();
                    Err(Unanswered {
                        trail: Trail {
                            steps: vec![Step::Refused(error.code().as_str())],
                            ..Trail::default()
                        },
                        error,
                    })
                }
                Outcome::Transport(_) | Outcome::Timeout => {
                    panic!("a transport failure has no meaning at recovery's seam")
                }
            }
        })
    }
}

impl tower::Service<Billed> for Scripted<AtMeter> {
    type Response = Reply;
    type Error = AttemptError;
    type Future = BoxFuture<'static, Result<Reply, AttemptError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), AttemptError>> {
        ready(cx)
    }

    fn call(&mut self, billed: Billed) -> Self::Future {
        let canned = self.take(|at| Received::of_billed(&billed, at));
        let attempt = billed.attempt;
        Box::pin(async move {
            canned.wait().await;
            match canned.outcome {
                Outcome::Reply {
                    status,
                    body,
                    stream,
                } => Ok(Canned::reply(
                    status,
                    canned.headers,
                    body,
                    stream,
                    attempt.request.endpoint,
                    attempt.keep_answer,
                )),
                Outcome::Transport(failure) => Err(AttemptError::Transport(failure)),
                Outcome::Timeout => {
                    tokio::time::sleep(attempt.timeout).await;
                    Err(AttemptError::Transport(TransportFailure::Timeout))
                }
                Outcome::Error(error) => Err(AttemptError::Refused(error())),
            }
        })
    }
}

impl tower::Service<Attempt> for Scripted<AtLeaf> {
    type Response = Reply;
    type Error = TransportFailure;
    type Future = BoxFuture<'static, Result<Reply, TransportFailure>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), TransportFailure>> {
        ready(cx)
    }

    fn call(&mut self, attempt: Attempt) -> Self::Future {
        let canned = self.take(|at| Received::of_attempt(&attempt, at));
        Box::pin(async move {
            canned.wait().await;
            match canned.outcome {
                Outcome::Reply {
                    status,
                    body,
                    stream,
                } => Ok(Canned::reply(
                    status,
                    canned.headers,
                    body,
                    stream,
                    attempt.request.endpoint,
                    attempt.keep_answer,
                )),
                Outcome::Transport(failure) => Err(failure),
                Outcome::Timeout => {
                    tokio::time::sleep(attempt.timeout).await;
                    Err(TransportFailure::Timeout)
                }
                Outcome::Error(_) => panic!("the leaf refuses nothing: refusals are the meter's"),
            }
        })
    }
}

// ---------------------------------------------------------------------------------------
// Canned bodies, in each API's shape.

/// An OpenAI chat completion saying `text`, with usage (10 prompt, 5 completion tokens).
pub fn chat_answer(text: &str) -> Value {
    json!({
        "id": "chatcmpl-kit",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt-4o",
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop"
        }],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    })
}

/// An Anthropic message saying `text` (12 input, 6 output tokens).
pub fn messages_answer(text: &str) -> Value {
    json!({
        "id": "msg_kit",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {"input_tokens": 12, "output_tokens": 6}
    })
}

/// A stored Responses API answer `id` saying `text`, with one message item `item`
/// (20 input, 10 output tokens).
pub fn responses_answer(id: &str, item: &str, text: &str) -> Value {
    json!({
        "id": id,
        "object": "response",
        "created_at": 1,
        "status": "completed",
        "model": "gpt-4o",
        "output": [{
            "type": "message",
            "id": item,
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
        }],
        "usage": {
            "input_tokens": 20,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 10,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 30
        }
    })
}

/// An OpenAI chat stream whose content is `pieces`, then its finish and `[DONE]`.
pub fn chat_stream(pieces: &[&str]) -> String {
    let chunk = |delta: Value, finish: Value| {
        let chunk = json!({
            "id": "chatcmpl-kit",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "gpt-4o",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
        });
        format!("data: {chunk}\n\n")
    };
    let mut out = chunk(json!({"role": "assistant", "content": ""}), Value::Null);
    for piece in pieces {
        out.push_str(&chunk(json!({"content": piece}), Value::Null));
    }
    out.push_str(&chunk(json!({}), json!("stop")));
    out.push_str("data: [DONE]\n\n");
    out
}

/// An Anthropic message stream saying `text`.
pub fn messages_stream(text: &str) -> String {
    let event = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    [
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": "msg_kit", "type": "message", "role": "assistant",
                "model": "claude-sonnet-4-5", "content": [], "stop_reason": null,
                "stop_sequence": null, "usage": {"input_tokens": 12, "output_tokens": 1}}}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0,
                   "delta": {"type": "text_delta", "text": text}}),
        ),
        event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                   "usage": {"output_tokens": 6}}),
        ),
        event("message_stop", json!({"type": "message_stop"})),
    ]
    .concat()
}

// ---------------------------------------------------------------------------------------
// Reading what a layer answered.

/// A response's body, read whole.
pub async fn body_bytes(response: Response<Body>) -> Bytes {
    response
        .into_body()
        .collect()
        .await
        .expect("the body reads")
        .to_bytes()
}

/// A response's body as JSON.
pub async fn body_json(response: Response<Body>) -> Value {
    let bytes = body_bytes(response).await;
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&bytes)))
}

/// A response header, as text.
pub fn header<'a>(response: &'a Response<Body>, name: &str) -> Option<&'a str> {
    response.headers().get(name).and_then(|v| v.to_str().ok())
}

/// A reply's whole body as JSON.
pub fn reply_json(reply: &Reply) -> Value {
    serde_json::from_slice(reply.bytes())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(reply.bytes())))
}

/// The status and code a client would be answered with for `error`.
pub fn refused(error: &GatewayError) -> (u16, &'static str) {
    (error.code().status(), error.code().as_str())
}

/// The error of a result whose answer has no `Debug` (a [`Reply`], an [`Answered`]).
pub fn err_of<T, E>(result: Result<T, E>) -> E {
    match result {
        Ok(_) => panic!("answered, where an error was expected"),
        Err(err) => err,
    }
}

/// The refusal an attempt seam answered with (not a transport failure).
pub fn refusal_of<T>(result: Result<T, AttemptError>) -> GatewayError {
    match err_of(result) {
        AttemptError::Refused(refusal) => refusal,
        AttemptError::Transport(failure) => panic!("a transport failure: {failure:?}"),
    }
}
