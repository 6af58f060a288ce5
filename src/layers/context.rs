//! Context layer (step 3): reads the body once, within `max_body_bytes`, parses it, and
//! resolves the route. Everything after reads [`RequestContext`] from the extensions
//! instead of touching the body again. Refuses with 413 (too large), 400 (not JSON, not
//! an object, a repeated key, no `model`, an invalid `max_tokens`, an `x-session-id` that
//! is too long or not visible ASCII) or 404 `model_not_found`, all before any upstream
//! call. Nothing the client controls is silently dropped: an identifier Backstop cannot
//! honour is refused, so caps and the guard can never be bypassed by its spelling.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{header, Request, Response};
use http_body_util::{BodyExt, Limited};
use serde_json::{Map, Value};
use tower::{Layer, Service};

use crate::{
    api::Endpoint,
    error::GatewayError,
    routing::{Route, RouteTable},
    telemetry::RequestLog,
};

/// The parsed request, shared by every inner layer.
#[derive(Debug, Clone)]
pub struct RequestContext {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    /// The agent run this call belongs to (`x-session-id`), if the caller named one.
    pub session_id: Option<String>,
    /// The authenticated tenant (from the auth layer).
    pub tenant: Arc<str>,
    /// The completion cap the caller set (`max_tokens` / `max_completion_tokens`).
    pub max_output_tokens: Option<u64>,
    /// An OpenAI stream for which the caller itself asked usage to be reported.
    pub client_wants_stream_usage: bool,
    /// The body exactly as the client sent it.
    pub body: Bytes,
    /// The same body, parsed once.
    pub json: Map<String, Value>,
    pub route: Arc<Route>,
}

impl RequestContext {
    /// The context the context layer put on a request (an internal error if a layer
    /// that needs it was placed before that layer).
    pub fn of<B>(req: &http::Request<B>) -> Result<Arc<RequestContext>, GatewayError> {
        req.extensions()
            .get::<Arc<RequestContext>>()
            .cloned()
            .ok_or(GatewayError::Internal)
    }

    /// The same request with a different body (a corrective retry, a non-streaming
    /// fetch for validation); `stream` follows the new body.
    pub fn with_json(&self, json: Map<String, Value>) -> RequestContext {
        let body = Bytes::from(serde_json::to_vec(&json).expect("a JSON map serialises"));
        RequestContext {
            stream: matches!(json.get("stream"), Some(Value::Bool(true))),
            body,
            json,
            ..self.clone()
        }
    }

    /// The body to send upstream: as received, unless the model is rewritten or stream
    /// usage must be asked for (then re-serialised from the parsed body).
    pub fn upstream_body(&self, model: Option<&str>, ask_stream_usage: bool) -> Bytes {
        if model.is_none() && !ask_stream_usage {
            return self.body.clone();
        }
        let mut json = self.json.clone();
        if let Some(model) = model {
            json.insert("model".into(), Value::String(model.into()));
        }
        if ask_stream_usage {
            let options = json
                .entry("stream_options")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(options) = options {
                options.insert("include_usage".into(), Value::Bool(true));
            }
        }
        Bytes::from(serde_json::to_vec(&json).expect("a JSON map serialises"))
    }
}

#[derive(Clone)]
pub struct ContextLayer {
    routes: Arc<RouteTable>,
    max_body_bytes: usize,
    max_session_id_bytes: usize,
    /// Large bodies parsed at once: one per core, so a burst of them costs time, not
    /// memory (a parsed body is several times its size).
    large_parses: Arc<tokio::sync::Semaphore>,
}

impl ContextLayer {
    pub fn new(
        routes: Arc<RouteTable>,
        max_body_bytes: usize,
        max_session_id_bytes: usize,
    ) -> Self {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        ContextLayer {
            routes,
            max_body_bytes,
            max_session_id_bytes,
            large_parses: Arc::new(tokio::sync::Semaphore::new(cores)),
        }
    }
}

/// Bodies up to this size are parsed on the async worker (a few microseconds); larger
/// ones on a blocking thread.
const PARSE_INLINE_BYTES: usize = 64 * 1024;

/// The largest `max_tokens` accepted: every provider's field is a 32-bit integer.
pub const MAX_OUTPUT_TOKENS: u64 = i32::MAX as u64;

/// A client identifier header: absent or blank is `None`; otherwise it must be at most
/// `max` bytes of visible ASCII (no spaces, no control or non-ASCII bytes), or the
/// request is refused naming the header.
pub fn identifier(
    headers: &http::HeaderMap,
    name: &'static str,
    max: usize,
) -> Result<Option<String>, GatewayError> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    let bytes = value.as_bytes().trim_ascii();
    if bytes.is_empty() {
        return Ok(None);
    }
    let invalid = |detail: String| GatewayError::InvalidHeader {
        header: name,
        detail,
    };
    if bytes.len() > max {
        return Err(invalid(format!(
            "{} bytes, over the limit of {max}",
            bytes.len()
        )));
    }
    if !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(
            "only visible ASCII characters (0x21-0x7E) are allowed".into(),
        ));
    }
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

impl<S> Layer<S> for ContextLayer {
    type Service = ContextService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        ContextService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct ContextService<S> {
    inner: S,
    layer: ContextLayer,
}

impl<S> Service<Request<Body>> for ContextService<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<Response<Body>, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let mut inner = super::take_ready(&mut self.inner);
        let layer = self.layer.clone();
        Box::pin(async move {
            let (mut parts, body) = req.into_parts();
            let endpoint =
                Endpoint::from_path(parts.uri.path()).ok_or_else(|| GatewayError::NotFound {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_string(),
                })?;
            let declared = parts
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            // Not tower-http's `RequestBodyLimitLayer`: its 413 has no body in the caller's shape.
            let limit = layer.max_body_bytes;
            if declared.is_some_and(|n| n > limit) {
                return Err(GatewayError::BodyTooLarge { limit });
            }
            let bytes = Limited::new(body, limit)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        GatewayError::BodyTooLarge { limit }
                    } else if is_body_timeout(&*e) {
                        GatewayError::BodyTimeout
                    } else {
                        GatewayError::BodyRead(e.to_string())
                    }
                })?
                .to_bytes();
            let session_id =
                identifier(&parts.headers, "x-session-id", layer.max_session_id_bytes)?;
            let tenant = parts
                .extensions
                .get::<Arc<crate::layers::auth::Tenant>>()
                .map_or_else(|| Arc::from("-"), |t| t.name.clone());
            let mut ctx = if bytes.len() > PARSE_INLINE_BYTES {
                // A megabyte of JSON is milliseconds of CPU: off the async workers, so
                // other clients' requests are not queued behind it.
                let routes = layer.routes.clone();
                let permit = layer.large_parses.clone().acquire_owned().await;
                tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    parse(endpoint, bytes, session_id, &routes)
                })
                .await
                .map_err(|_| GatewayError::Internal)??
            } else {
                parse(endpoint, bytes, session_id, &layer.routes)?
            };
            ctx.tenant = tenant;
            tracing::Span::current().record("session", ctx.session_id.as_deref());
            if let Some(log) = parts.extensions.get::<Arc<RequestLog>>() {
                log.update(|f| {
                    f.model = Some(ctx.model.clone());
                    f.session = ctx.session_id.clone();
                });
            }
            parts.extensions.insert(Arc::new(ctx));
            inner.call(Request::from_parts(parts, Body::empty())).await
        })
    }
}

/// The edge's `server.body_read_timeout` (tower-http's `RequestBodyTimeoutLayer`) ended
/// the body: the client stopped sending. The error arrives wrapped (axum's body, then
/// `Limited`), so the whole source chain is searched.
fn is_body_timeout(err: &(dyn std::error::Error + 'static)) -> bool {
    std::iter::successors(Some(err), |e| e.source())
        .any(|e| e.is::<tower_http::timeout::TimeoutError>())
}

/// Parses and routes one body. Pure: no I/O, so it is unit-tested directly.
pub fn parse(
    endpoint: Endpoint,
    body: Bytes,
    session_id: Option<String>,
    routes: &RouteTable,
) -> Result<RequestContext, GatewayError> {
    let value = crate::api::json::parse_strict(&body)
        .map_err(|e| GatewayError::InvalidJson(e.to_string()))?;
    let Value::Object(json) = value else {
        return Err(GatewayError::NotAnObject);
    };
    let model = match json.get("model") {
        Some(Value::String(m)) if !m.trim().is_empty() => m.clone(),
        _ => return Err(GatewayError::MissingModel),
    };
    let stream = matches!(json.get("stream"), Some(Value::Bool(true)));
    let mut max_output_tokens = None;
    for param in ["max_completion_tokens", "max_tokens"] {
        match json.get(param) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64().filter(|n| *n <= MAX_OUTPUT_TOKENS) {
                Some(n) => {
                    max_output_tokens.get_or_insert(n);
                }
                None => {
                    return Err(GatewayError::InvalidParameter {
                        param,
                        detail: format!(
                            "must be an integer from 0 to {MAX_OUTPUT_TOKENS}, got {v}"
                        ),
                    })
                }
            },
        }
    }
    let client_wants_stream_usage = json
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        == Some(true);
    let route = routes
        .resolve(&model)
        .cloned()
        .ok_or_else(|| GatewayError::ModelNotFound(model.clone()))?;
    Ok(RequestContext {
        endpoint,
        model,
        stream,
        session_id,
        tenant: Arc::from("-"),
        max_output_tokens,
        client_wants_stream_usage,
        body,
        json,
        route,
    })
}

/// A fuzz harness for the request parser (issue 16): arbitrary bytes and arbitrary JSON
/// bodies never panic, and whatever is accepted keeps the invariants later layers rely
/// on. `PROPTEST_CASES=100000 cargo test --release --lib fuzz_` runs it longer.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn routes() -> RouteTable {
        let config = crate::config::Config::from_toml_with_env(
            r#"
            [[upstreams]]
            name = "u"
            api = "openai"
            base_url = "http://127.0.0.1:1"
            [[routes]]
            model = "gpt-*"
            targets = [{ upstream = "u" }]
            [[tenants]]
            name = "t"
            api_keys = ["bk-fuzz-key-1"]
            "#,
            |_| None,
        )
        .unwrap();
        let upstreams = crate::upstream::build_all(&config);
        RouteTable::new(&config, &upstreams)
    }

    /// Bodies that are mostly chat requests, with fields of every JSON type.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        let scalar = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "[a-z*-]{0,12}".prop_map(Value::String),
        ];
        let keys = prop::sample::select(vec![
            "model",
            "stream",
            "max_tokens",
            "max_completion_tokens",
            "messages",
            "stream_options",
            "tools",
            "x",
        ]);
        let object = prop::collection::vec((keys, scalar), 0..8).prop_map(|fields| {
            let mut text = String::from("{");
            for (i, (k, v)) in fields.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&format!("{:?}:{v}", k));
            }
            text.push('}');
            text.into_bytes()
        });
        prop_oneof![object, prop::collection::vec(any::<u8>(), 0..128)]
    }

    proptest! {
        #[test]
        fn fuzz_request_parser(bytes in body()) {
            let routes = routes();
            match parse(Endpoint::ChatCompletions, Bytes::from(bytes.clone()), None, &routes) {
                Ok(ctx) => {
                    prop_assert!(!ctx.model.trim().is_empty());
                    prop_assert!(ctx.model.starts_with("gpt-"));
                    prop_assert!(ctx.max_output_tokens.is_none_or(|n| n <= MAX_OUTPUT_TOKENS));
                    // What is routed is what the upstream is sent: one parse, no duplicates.
                    let upstream: Value = serde_json::from_slice(&ctx.upstream_body(None, false)).unwrap();
                    prop_assert_eq!(upstream.get("model").and_then(Value::as_str), Some(ctx.model.as_str()));
                }
                Err(err) => {
                    prop_assert!(err.kind().status == 400 || err.kind().status == 404, "{err:?}");
                }
            }
        }

        #[test]
        fn fuzz_identifier_headers(raw in prop::collection::vec(any::<u8>(), 0..300)) {
            let mut headers = http::HeaderMap::new();
            if let Ok(value) = http::HeaderValue::from_bytes(&raw) {
                headers.insert("x-session-id", value);
                match identifier(&headers, "x-session-id", 256) {
                    Ok(Some(id)) => prop_assert!(id.len() <= 256 && id.bytes().all(|b| b.is_ascii_graphic())),
                    Ok(None) => prop_assert!(raw.trim_ascii().is_empty()),
                    Err(err) => prop_assert_eq!(err.kind().code, "invalid_header"),
                }
            }
        }
    }
}
