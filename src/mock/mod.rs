//! The fault-injecting mock upstream: speaks the OpenAI (chat, embeddings, Responses)
//! and Anthropic APIs (streaming and not) on one port, with faults scripted per request. It is part of the product:
//! the default config, the tests, the demo and the load tests all run against it.
//!
//! Scripting, by request header:
//! - `x-mock-scenario: NAME` groups attempts; each scenario counts the attempts it got.
//! - `x-mock-fault: STEP,STEP,...`: attempt k of the scenario plays step k (the last step
//!   repeats). A step is `;`-separated tokens, see [`fault::FaultStep`].
//! - Without a script, a random [`FaultMix`] plays: `x-mock-fault-mix: STEP@P|...` per
//!   request, else the one the mock was started with (`--fault-mix`), for fault storms.
//! - `x-mock-strict: on` (or `off`): strict mode for this request, whatever the instance
//!   says. A strict mock refuses what the real APIs refuse, with their status, error
//!   shape and message (see [`strict`]): unknown top-level fields, Anthropic without
//!   `max_tokens`, `system` inside Anthropic's `messages`, empty text blocks, tool
//!   results that answer no call of the previous turn, ids outside Anthropic's pattern,
//!   OpenAI tool-call ids over 40 characters, out-of-range temperatures, and more. It is
//!   what catches a translation between APIs that the real provider would refuse. An
//!   instance is strict from the start with [`spawn_strict`], [`MockConfig::strict`] or
//!   `backstop mock-upstream --strict`; it is off by default. Scripted redirects and
//!   errors still come first, so fault scripts play the same in both modes.
//!
//! It also plays Amazon Bedrock's InvokeModel for Anthropic's models
//! (`/model/{id}/invoke`, `/invoke-with-response-stream`), SigV4 signatures checked: see
//! [`bedrock`].
//!
//! Introspection: `GET /mock/stats`, `GET /mock/last?scenario=NAME`, `POST /mock/reset`;
//! `POST /mock/release?hold=NAME` lets the attempts scripted `hold=NAME` go on.
//! It logs nothing per request, so it is never the bottleneck of a load test.

pub mod bedrock;
mod fault;
mod responses;
mod responses_api;
pub mod strict;

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use axum::body::Body;
use bytes::Bytes;
use http::{header, HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

pub use fault::{FaultMix, FaultStep};

/// Most scenarios remembered; beyond it the oldest data is dropped wholesale.
const MAX_SCENARIOS: usize = 100_000;

#[derive(Default)]
struct Scenario {
    attempts: u64,
    last: Option<Value>,
    /// Each attempt's `traceparent` header, in order (the first [`MAX_TRACEPARENTS`]).
    traceparents: Vec<String>,
}

const MAX_TRACEPARENTS: usize = 16;

#[derive(Default)]
pub struct MockState {
    total: AtomicU64,
    scenarios: Mutex<HashMap<String, Scenario>>,
    /// Faults for requests that script none (`--fault-mix`).
    mix: FaultMix,
    /// The draws for `mix`: seeded for reproducible scenarios, else from entropy.
    rng: Mutex<fastrand::Rng>,
    /// Refuse what the real APIs refuse ([`strict`]), unless a request says
    /// `x-mock-strict: off`.
    strict: bool,
    /// The holds of `hold=NAME` steps: `true` once released.
    holds: Mutex<HashMap<String, watch::Sender<bool>>>,
}

/// How a mock instance is started: see [`spawn_config`].
#[derive(Debug, Default, Clone)]
pub struct MockConfig {
    /// Faults for requests that script none (`--fault-mix`).
    pub mix: FaultMix,
    /// The seed of the mix's draws; `None` draws from entropy.
    pub seed: Option<u64>,
    /// Strict mode for every request (`--strict`); a request's `x-mock-strict` header
    /// still decides for itself.
    pub strict: bool,
}

impl MockState {
    /// The next draw in [0, 1) for a fault mix.
    fn draw(&self) -> f64 {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).f64()
    }

    /// Counts an attempt and returns its 0-based index within the scenario.
    fn record(
        &self,
        scenario: Option<&str>,
        traceparent: Option<&str>,
        last: impl FnOnce() -> Value,
    ) -> u64 {
        self.total.fetch_add(1, Ordering::Relaxed);
        let name = scenario.unwrap_or("default");
        let mut map = self.scenarios.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= MAX_SCENARIOS && !map.contains_key(name) {
            map.clear();
        }
        let entry = map.entry(name.to_string()).or_default();
        entry.attempts += 1;
        if scenario.is_some() {
            entry.last = Some(last());
            if entry.traceparents.len() < MAX_TRACEPARENTS {
                entry
                    .traceparents
                    .push(traceparent.unwrap_or_default().to_string());
            }
        }
        entry.attempts - 1
    }

    fn stats(&self) -> Value {
        let map = self.scenarios.lock().unwrap_or_else(|e| e.into_inner());
        let scenarios: serde_json::Map<String, Value> = map
            .iter()
            .map(|(k, v)| (k.clone(), json!(v.attempts)))
            .collect();
        json!({"total": self.total.load(Ordering::Relaxed), "scenarios": scenarios})
    }

    fn last(&self, scenario: &str) -> Option<Value> {
        let map = self.scenarios.lock().unwrap_or_else(|e| e.into_inner());
        map.get(scenario).and_then(|s| s.last.clone())
    }

    /// Runs `f` on the hold `name` (of `hold=NAME` steps), made closed if it is new.
    fn with_hold<R>(&self, name: &str, f: impl FnOnce(&watch::Sender<bool>) -> R) -> R {
        let mut holds = self.holds.lock().unwrap_or_else(|e| e.into_inner());
        f(holds
            .entry(name.to_string())
            .or_insert_with(|| watch::channel(false).0))
    }

    /// Lets every attempt held on `hold` go on, and those that come later at once.
    fn release(&self, hold: &str) {
        self.with_hold(hold, |h| h.send_replace(true));
    }

    fn reset(&self) {
        self.total.store(0, Ordering::Relaxed);
        // Dropped: whatever they held goes on.
        self.holds.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.scenarios
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// A running mock upstream.
pub struct MockHandle {
    pub addr: SocketAddr,
    pub state: Arc<MockState>,
    task: JoinHandle<()>,
}

impl MockHandle {
    pub fn shutdown(self) {
        self.task.abort();
    }

    /// Lets the attempts scripted `hold=NAME` go on (and later ones at once), as
    /// `POST /mock/release?hold=NAME` does.
    pub fn release(&self, hold: &str) {
        self.state.release(hold);
    }

    /// Attempts received in all, every scenario included.
    pub fn state_total(&self) -> u64 {
        self.state.total.load(Ordering::Relaxed)
    }

    /// Attempts received in a scenario so far.
    pub fn attempts(&self, scenario: &str) -> u64 {
        let map = self
            .state
            .scenarios
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.get(scenario).map_or(0, |s| s.attempts)
    }

    /// The `traceparent` each attempt of a scenario carried (`""` for none), in order.
    pub fn traceparents(&self, scenario: &str) -> Vec<String> {
        let map = self
            .state
            .scenarios
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.get(scenario)
            .map(|s| s.traceparents.clone())
            .unwrap_or_default()
    }

    /// The last request seen in a scenario (method, path, headers, body).
    pub fn last_request(&self, scenario: &str) -> Option<Value> {
        self.state.last(scenario)
    }
}

/// Marker error: drop the connection without answering (the `reset` fault).
#[derive(Debug)]
struct Reset;

impl std::fmt::Display for Reset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("mock reset")
    }
}

impl std::error::Error for Reset {}

/// Serves the mock on an already-bound listener.
pub fn spawn(listener: TcpListener) -> MockHandle {
    spawn_with(listener, FaultMix::default())
}

/// Serves the mock, playing `mix` for requests that script no fault of their own.
pub fn spawn_with(listener: TcpListener, mix: FaultMix) -> MockHandle {
    spawn_seeded(listener, mix, fastrand::u64(..))
}

/// As [`spawn_with`], drawing the mix's faults from `seed`: the same seed plays the
/// same sequence of faults (which request gets which still depends on arrival order).
pub fn spawn_seeded(listener: TcpListener, mix: FaultMix, seed: u64) -> MockHandle {
    spawn_config(
        listener,
        MockConfig {
            mix,
            seed: Some(seed),
            strict: false,
        },
    )
}

/// Serves a mock in strict mode: requests the real APIs refuse are refused
/// ([`strict`]), unless a request says `x-mock-strict: off`.
pub fn spawn_strict(listener: TcpListener) -> MockHandle {
    spawn_config(
        listener,
        MockConfig {
            strict: true,
            ..MockConfig::default()
        },
    )
}

/// Serves a mock started as `config` says.
pub fn spawn_config(listener: TcpListener, config: MockConfig) -> MockHandle {
    let addr = listener
        .local_addr()
        .expect("bound listener has an address");
    let state = Arc::new(MockState {
        mix: config.mix,
        rng: Mutex::new(fastrand::Rng::with_seed(
            config.seed.unwrap_or_else(|| fastrand::u64(..)),
        )),
        strict: config.strict,
        ..MockState::default()
    });
    let shared = state.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let state = shared.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| handle(state.clone(), req));
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    MockHandle { addr, state, task }
}

async fn handle(state: Arc<MockState>, req: Request<Incoming>) -> Result<Response<Body>, Reset> {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_string();
    match (&parts.method, path.as_str()) {
        (&Method::GET, "/mock/stats") => return Ok(json_response(StatusCode::OK, &state.stats())),
        (&Method::POST, "/mock/reset") => {
            state.reset();
            return Ok(json_response(StatusCode::OK, &json!({"ok": true})));
        }
        (&Method::POST, "/mock/release") => {
            let hold = query_param(parts.uri.query(), "hold").unwrap_or_default();
            state.release(&hold);
            return Ok(json_response(StatusCode::OK, &json!({"ok": true})));
        }
        (&Method::GET, "/mock/last") => {
            let scenario = query_param(parts.uri.query(), "scenario").unwrap_or_default();
            return Ok(match state.last(&scenario) {
                Some(v) => json_response(StatusCode::OK, &v),
                None => json_response(StatusCode::NOT_FOUND, &json!({"error": "no request seen"})),
            });
        }
        (&Method::GET, "/v1/models") | (&Method::GET, "/healthz") => {
            return Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": []}),
            ));
        }
        _ => {}
    }
    // Azure OpenAI's deployment paths answer as the OpenAI paths they stand for; the
    // path as sent (deployment, `api-version` query) is what `last_request` records.
    let served = azure_path(&path).unwrap_or(&path);
    let invoke = (parts.method == Method::POST)
        .then(|| bedrock::route(&path))
        .flatten();
    let api = match served {
        _ if invoke.is_some() => responses::Api::Anthropic,
        "/v1/chat/completions" | "/v1/embeddings" => responses::Api::OpenAi,
        "/v1/messages" | "/v1/messages/count_tokens" => responses::Api::Anthropic,
        "/v1/responses" => responses::Api::Responses,
        p if p.starts_with("/v1/responses/") => responses::Api::Responses,
        _ => {
            return Ok(json_response(
                StatusCode::NOT_FOUND,
                &json!({"error": {"message": "unknown path", "type": "invalid_request_error"}}),
            ))
        }
    };
    let bytes = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let request: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let scenario = header_str(&parts.headers, "x-mock-scenario");
    let traceparent = header_str(&parts.headers, "traceparent");
    let attempt = state.record(scenario, traceparent, || {
        json!({
            "method": parts.method.as_str(),
            "path": path,
            "query": parts.uri.query(),
            "headers": headers_json(&parts.headers),
            "body": if request.is_null() { Value::String(String::from_utf8_lossy(&bytes).into_owned()) } else { request.clone() },
        })
    });
    let step = match header_str(&parts.headers, "x-mock-fault") {
        Some(script) => FaultStep::for_attempt(script, attempt),
        None => match header_str(&parts.headers, "x-mock-fault-mix").map(FaultMix::parse) {
            Some(Ok(mix)) => mix.pick(state.draw()),
            _ if !state.mix.is_empty() => state.mix.pick(state.draw()),
            _ => FaultStep::default(),
        },
    };

    if let Some(name) = &step.hold {
        // A hold dropped by a reset lets it go on too.
        let mut hold = state.with_hold(name, watch::Sender::subscribe);
        let _ = hold.wait_for(|released| *released).await;
    }
    if let Some(delay) = step.delay {
        tokio::time::sleep(delay).await;
    }
    if step.hang {
        std::future::pending::<()>().await;
    }
    if step.reset {
        return Err(Reset);
    }
    let strict = match header_str(&parts.headers, "x-mock-strict") {
        Some(v) => matches!(v.trim().to_ascii_lowercase().as_str(), "on" | "true" | "1"),
        None => state.strict,
    };
    let strict = strict && parts.method == Method::POST;
    let mut response = match &invoke {
        Some(invoke) => {
            let signed = parts
                .uri
                .path_and_query()
                .map_or(path.as_str(), |pq| pq.as_str());
            match bedrock::verify(&parts.headers, signed, &bytes) {
                Err(refused) => refused.response(),
                Ok(()) => match step.status.filter(|s| *s >= 400) {
                    Some(status) => bedrock::scripted_error(status, &step),
                    None => bedrock::answer(invoke, &request, &step),
                },
            }
        }
        None => answer(
            api,
            &parts.method,
            served,
            parts.uri.query(),
            &request,
            &step,
            strict,
        ),
    };
    for (name, value) in &step.headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    Ok(response)
}

/// The scripted answer for one attempt. Scripted redirects and errors come first; then,
/// in strict mode, the real API's refusals; then the answer.
fn answer(
    api: responses::Api,
    method: &Method,
    path: &str,
    query: Option<&str>,
    request: &Value,
    step: &FaultStep,
    strict: bool,
) -> Response<Body> {
    if let Some(status) = step.status.filter(|s| (300..400).contains(s)) {
        return Response::builder()
            .status(status)
            .header(header::LOCATION, step.location.as_deref().unwrap_or("/"))
            .body(Body::empty())
            .expect("valid redirect");
    }
    if let Some(status) = step.status.filter(|s| *s >= 400) {
        return responses::error(api, status, step);
    }
    if strict {
        if let Err(refusal) = strict::check(path, request) {
            return refusal.response(api);
        }
    }
    if step.invalid_json {
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(Bytes::from_static(
                b"{\"id\": \"broken\", \"choices\": [",
            )))
            .expect("static response");
    }
    let streaming = request.get("stream").and_then(Value::as_bool) == Some(true);
    if let Some(raw) = step.events.as_deref().filter(|_| streaming) {
        return responses::sse(fault::split_events(raw), step);
    }
    match path {
        "/v1/embeddings" => responses::embeddings(request, step),
        "/v1/messages/count_tokens" => responses::count_tokens(request, step),
        "/v1/responses" => responses_api::create(request, step),
        p if p.starts_with("/v1/responses/") => responses_api::stored(method, p, query, step),
        _ => responses::completion(api, request, step),
    }
}

/// `/openai/deployments/{d}/chat/completions` → `/v1/chat/completions`, likewise
/// `embeddings`; `None` for any other path.
fn azure_path(path: &str) -> Option<&'static str> {
    let (_deployment, tail) = path.strip_prefix("/openai/deployments/")?.split_once('/')?;
    match tail {
        "chat/completions" => Some("/v1/chat/completions"),
        "embeddings" => Some("/v1/embeddings"),
        _ => None,
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn headers_json(headers: &HeaderMap) -> Value {
    let map: serde_json::Map<String, Value> = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned()),
            )
        })
        .collect();
    Value::Object(map)
}

fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.replace("%20", " "))
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(value.to_string()))
        .expect("valid response parts")
}

/// Convenience for `main`: bind and serve until the process ends.
pub async fn run(addr: SocketAddr, config: MockConfig) -> std::io::Result<Infallible> {
    let strict = config.strict;
    let handle = spawn_config(TcpListener::bind(addr).await?, config);
    tracing::info!(addr = %handle.addr, strict, "mock upstream listening");
    let _ = handle.task.await;
    std::future::pending().await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn post(mock: &MockHandle, strict: Option<&str>, body: &Value) -> (u16, Value) {
        let mut req = reqwest::Client::new()
            .post(format!("http://{}/v1/messages", mock.addr))
            .body(body.to_string());
        if let Some(strict) = strict {
            req = req.header("x-mock-strict", strict);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (
            status,
            serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap(),
        )
    }

    async fn bind() -> TcpListener {
        TcpListener::bind("127.0.0.1:0").await.unwrap()
    }

    /// Without `max_tokens`: a real Claude refuses it.
    fn no_max_tokens() -> Value {
        json!({"model": "claude", "messages": [{"role": "user", "content": "hi"}]})
    }

    #[tokio::test]
    async fn strict_mode_per_instance_and_per_request() {
        let lenient = spawn(bind().await);
        assert_eq!(post(&lenient, None, &no_max_tokens()).await.0, 200);
        let (status, body) = post(&lenient, Some("on"), &no_max_tokens()).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"]["message"], "max_tokens: Field required");

        let strict = spawn_strict(bind().await);
        assert_eq!(post(&strict, None, &no_max_tokens()).await.0, 400);
        assert_eq!(post(&strict, Some("off"), &no_max_tokens()).await.0, 200);
        let mut ok = no_max_tokens();
        ok["max_tokens"] = json!(16);
        assert_eq!(post(&strict, None, &ok).await.0, 200);
        lenient.shutdown();
        strict.shutdown();
    }

    #[tokio::test]
    async fn scripted_errors_come_before_strict_refusals() {
        let strict = spawn_strict(bind().await);
        let resp = reqwest::Client::new()
            .post(format!("http://{}/v1/messages", strict.addr))
            .header("x-mock-fault", "status=529")
            .body(no_max_tokens().to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 529);
        strict.shutdown();
    }

    /// `hold=NAME` keeps an attempt (counted) until `POST /mock/release?hold=NAME`;
    /// an attempt on a hold already released goes on at once.
    #[tokio::test]
    async fn a_held_attempt_answers_once_released_and_later_ones_at_once() {
        let mock = spawn(TcpListener::bind("127.0.0.1:0").await.unwrap());
        let base = format!("http://{}", mock.addr);
        let http = reqwest::Client::new();
        let send = |scenario: &'static str| {
            http.post(format!("{base}/v1/chat/completions"))
                .header("x-mock-scenario", scenario)
                .header("x-mock-fault", "hold=h")
                .body(r#"{"model":"m","messages":[]}"#)
                .send()
        };
        let held = tokio::spawn(send("held"));
        while mock.state.stats()["scenarios"]["held"] != 1 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(!held.is_finished(), "answered before its release");
        let released = http
            .post(format!("{base}/mock/release?hold=h"))
            .send()
            .await
            .unwrap();
        assert_eq!(released.status(), 200);
        assert_eq!(held.await.unwrap().unwrap().status(), 200);
        assert_eq!(send("later").await.unwrap().status(), 200);
    }
}
