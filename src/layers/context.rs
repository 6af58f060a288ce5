//! Context layer (inside auth and the request span, outside idempotency):
//! reads the body once, within `max_body_bytes`, parses it, and
//! resolves the route, turning the HTTP request into a [`Call`]: the typed per-request
//! context every inner layer takes (so none of them can be mounted before this one, and
//! none touches the body or the request extensions again). Refuses with 413 (too large),
//! 400 (not JSON, not an object, a repeated key, no `model`, an invalid `max_tokens` or
//! `max_output_tokens`, an `x-session-id` that is too long or not visible ASCII; a list
//! over an item limit, `too_many_items`, counted by a pre-scan before anything is
//! built), 503 `overloaded` (a large body found no room in the memory budget of bodies
//! in flight, [`BodyMemory`]) or 404 `model_not_found`, all before any upstream call.
//! Nothing the client controls is silently dropped: an identifier Backstop cannot honour
//! is refused, so caps and the guard can never be bypassed by its spelling.
//!
//! This is the one place that reads what the outer layers put in the request
//! extensions: the request id and log (edge), the deadline, the tenant (auth).

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tower::{Layer, Service};

use super::{deadline::Deadline, edge::RequestId, Holding, Middleware, Stack};
use crate::{
    api::{
        scan::{scan, BodyShape},
        Endpoint, ParsedRequest,
    },
    config::ServerConfig,
    error::GatewayError,
    routing::{Route, RouteTable},
    state::{
        body_memory::{BodyMemory, Busy, Charge, LARGE_BODY_BYTES},
        budgets::reservation::Prepaid,
    },
    telemetry::RequestLog,
};

pub use crate::api::MAX_OUTPUT_TOKENS;

/// Where in its route a call starts: a strategy switch by the validate layer moves it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TargetIndex(pub usize);

/// One parsed, authenticated, routed request: what every layer inside the context layer
/// takes. Cheap to clone (a corrective retry is a clone with another body).
#[derive(Debug, Clone)]
pub struct Call {
    /// The body, parsed once: what the upstream leaf is sent.
    pub request: Arc<ParsedRequest>,
    pub route: Arc<Route>,
    /// The authenticated tenant.
    pub tenant: Arc<str>,
    /// The agent run this call belongs to (`x-session-id`), if the caller named one.
    pub session: Option<Arc<str>>,
    /// The client's request headers (credentials are dropped on the way upstream).
    pub headers: Arc<HeaderMap>,
    pub request_id: HeaderValue,
    /// The request's log record, written out by the edge layer.
    pub log: Arc<RequestLog>,
    pub deadline: Deadline,
    /// The first route target to try.
    pub start: TargetIndex,
    /// Keep the parsed answer for validation (set by the validate layer).
    pub keep_answer: bool,
    /// The first attempt's reservation, made with the request's gate (set by the
    /// admission layer in replica mode; see [`crate::layers::meter`]).
    pub prepaid: Option<Arc<Prepaid>>,
}

impl Call {
    /// The same call with another body (a corrective retry, an unstreamed fetch).
    pub fn with_json(&self, json: serde_json::Map<String, serde_json::Value>) -> Call {
        Call {
            request: Arc::new(self.request.with_json(json)),
            ..self.clone()
        }
    }

    pub fn endpoint(&self) -> Endpoint {
        self.request.endpoint
    }
}

#[derive(Clone)]
pub struct ContextLayer {
    routes: Arc<RouteTable>,
    max_body_bytes: usize,
    max_session_id_bytes: usize,
    /// `server.session_id_fields`: body fields (dotted paths) a session id is read from
    /// when there is no `x-session-id` header.
    session_fields: Arc<[(&'static str, Vec<String>)]>,
    /// Large bodies parsed at once: one per core, so a burst of them costs time, not
    /// memory (a parsed body is several times its size).
    large_parses: Arc<tokio::sync::Semaphore>,
    /// What one body may hold, counted before it is parsed.
    items: ItemLimits,
    /// The memory budget of large bodies in flight, all clients together.
    body_memory: Arc<BodyMemory>,
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
            session_fields: Arc::from([]),
            large_parses: Arc::new(tokio::sync::Semaphore::new(cores)),
            items: ItemLimits::from_config(&ServerConfig::default()),
            body_memory: Arc::new(BodyMemory::from_config(&ServerConfig::default())),
        }
    }

    /// The item limits from `server`, and the memory budget of large bodies.
    pub fn body_limits(mut self, server: &ServerConfig, memory: Arc<BodyMemory>) -> Self {
        self.items = ItemLimits::from_config(server);
        self.body_memory = memory;
        self
    }

    /// Reads the session id from these body fields (dotted paths, in order) when the
    /// request has no `x-session-id` header.
    pub fn session_id_fields(mut self, fields: &[String]) -> Self {
        self.session_fields = fields
            .iter()
            .map(|f| (field_name(f), f.split('.').map(str::to_owned).collect()))
            .collect();
        self
    }
}

/// `field` as the `&'static str` an error's `param` takes. Each distinct name is
/// allocated once for the life of the process and found again by later configs, so a
/// reload (which builds this layer anew) allocates nothing: the memory is bounded by the
/// names ever configured, not by the number of reloads.
fn field_name(field: &str) -> &'static str {
    static NAMES: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(name) = names.iter().find(|n| **n == field) {
        return name;
    }
    let name: &'static str = Box::leak(field.to_owned().into_boxed_str());
    names.push(name);
    name
}

/// The session id a body carries in one of `fields` (the first present wins): absent or
/// blank is `None`; a value that is not a string of at most `max` visible ASCII bytes is
/// refused naming the field, as the header would be.
fn session_from_body(
    json: &serde_json::Map<String, serde_json::Value>,
    fields: &[(&'static str, Vec<String>)],
    max: usize,
) -> Result<Option<Arc<str>>, GatewayError> {
    use serde_json::Value;
    for (name, path) in fields {
        let Some((first, rest)) = path.split_first() else {
            continue;
        };
        let mut found = json.get(first.as_str());
        for key in rest {
            found = found.and_then(|v| v.get(key.as_str()));
        }
        let invalid = |detail: String| GatewayError::InvalidParameter {
            param: name,
            detail,
        };
        match found {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => {
                let id = s.trim();
                if id.is_empty() {
                    continue;
                }
                if id.len() > max {
                    return Err(invalid(format!(
                        "a session id of {} bytes, over the limit of {max}",
                        id.len()
                    )));
                }
                if !id.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(invalid(
                        "a session id may hold only visible ASCII characters (0x21-0x7E)".into(),
                    ));
                }
                return Ok(Some(Arc::from(id)));
            }
            Some(_) => return Err(invalid("a session id must be a string".into())),
        }
    }
    Ok(None)
}

/// The context layer's service: takes HTTP, hands the inner layers a [`Call`].
pub type ContextService<S> = Stack<ContextLayer, S>;

impl<S> Layer<S> for ContextLayer {
    type Service = ContextService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Stack::new(self.clone(), inner)
    }
}

/// Bodies up to this size are parsed on the async worker (a few microseconds); larger
/// ones on a blocking thread.
const PARSE_INLINE_BYTES: usize = 64 * 1024;

/// A client identifier header by [the one rule](crate::api::headers::identifier); a bad
/// one refuses the request, naming the header.
pub fn identifier(
    headers: &http::HeaderMap,
    name: &'static str,
    max: usize,
) -> Result<Option<String>, GatewayError> {
    crate::api::headers::identifier(headers, name, max).map_err(|invalid| {
        GatewayError::InvalidHeader {
            header: name,
            detail: invalid.to_string(),
        }
    })
}

impl<S> Middleware<S, Request<Body>> for ContextLayer
where
    S: Service<Call, Response = Response<Body>, Error = GatewayError> + Send + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Response<Body>;
    type Error = GatewayError;

    async fn call(&self, mut inner: S, req: Request<Body>) -> Result<Response<Body>, GatewayError> {
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
        let limit = self.max_body_bytes;
        if declared.is_some_and(|n| n > limit) {
            return Err(GatewayError::BodyTooLarge { limit });
        }
        let memory = &self.body_memory;
        let until = memory.deadline(Instant::now());
        let mut charge = Charge::default();
        if let Some(n) = declared {
            // Charged before a byte is read: a burst of large bodies waits in the
            // clients' sockets, not in Backstop's memory.
            memory
                .charge_body(&mut charge, n, until)
                .await
                .map_err(overloaded)?;
        }
        let bytes = self.read_body(body, declared, &mut charge, until).await?;
        let session: Option<Arc<str>> =
            identifier(&parts.headers, "x-session-id", self.max_session_id_bytes)?.map(Arc::from);
        let tenant = parts
            .extensions
            .remove::<Arc<crate::layers::auth::Tenant>>()
            .ok_or(GatewayError::Internal)?
            .name
            .clone();
        let items = self.items;
        let (request, route) = if bytes.len() > PARSE_INLINE_BYTES {
            // A megabyte of JSON is milliseconds of CPU: off the async workers, so
            // other clients' requests are not queued behind it. Counted first, without
            // building anything: a body over a limit costs no more than its bytes.
            let (counted, shape) = tokio::task::spawn_blocking(move || {
                let shape = items.check(&bytes);
                (bytes, shape)
            })
            .await
            .map_err(|_| GatewayError::Internal)?;
            let shape = shape?;
            memory
                .charge_parsed(
                    &mut charge,
                    counted.len(),
                    shape.parsed_bytes(counted.len()),
                    // A wait of its own: a slow upload has not used up this one.
                    memory.deadline(Instant::now()),
                )
                .await
                .map_err(overloaded)?;
            let routes = self.routes.clone();
            let permit = self.large_parses.clone().acquire_owned().await;
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                parse(endpoint, counted, &routes)
            })
            .await
            .map_err(|_| GatewayError::Internal)??
        } else {
            // Most agent requests are small enough to be under every limit whatever they
            // hold: those are parsed once, not counted first.
            if !items.hold_any_body_of(bytes.len()) {
                items.check(&bytes)?;
            }
            parse(endpoint, bytes, &self.routes)?
        };
        let session = match session {
            Some(header) => Some(header),
            None => {
                let body = session_from_body(
                    &request.json,
                    &self.session_fields,
                    self.max_session_id_bytes,
                )?;
                if let Some(id) = &body {
                    tracing::Span::current().record("session", &**id);
                }
                body
            }
        };
        let log = parts
            .extensions
            .remove::<Arc<RequestLog>>()
            .unwrap_or_default();
        log.set_request(request.model.clone(), session.as_deref().map(str::to_owned));
        let call = Call {
            request: Arc::new(request),
            route,
            tenant,
            session,
            request_id: parts
                .extensions
                .remove::<RequestId>()
                .map_or_else(|| HeaderValue::from_static("-"), |id| id.0),
            log,
            deadline: parts.extensions.remove::<Deadline>().unwrap_or(Deadline {
                at: Instant::now() + Duration::from_secs(3600),
                timeout: Duration::from_secs(3600),
            }),
            headers: Arc::new(parts.headers),
            start: TargetIndex::default(),
            keep_answer: false,
            prepaid: None,
        };
        let response = inner.call(call).await?;
        Ok(if charge.is_empty() {
            response
        } else {
            // The body's memory stays charged while anything may still hold it: until
            // the response (a stream, a validated retry) has ended.
            response.map(|body| {
                Body::new(Holding {
                    body,
                    _guard: charge,
                })
            })
        })
    }
}

/// The budget had no room for a large body in time.
fn overloaded(_: Busy) -> GatewayError {
    GatewayError::Overloaded {
        retry_after: Duration::from_secs(1),
    }
}

/// `server.max_messages`, `max_content_parts`, `max_json_values`: what one body may hold.
#[derive(Debug, Clone, Copy)]
pub struct ItemLimits {
    pub messages: usize,
    pub content_parts: usize,
    pub json_values: usize,
}

impl ItemLimits {
    pub fn from_config(server: &ServerConfig) -> Self {
        ItemLimits {
            messages: server.max_messages,
            content_parts: server.max_content_parts,
            json_values: server.max_json_values,
        }
    }

    /// Whether every body of `len` bytes is under every limit: `len` bytes of JSON hold at
    /// most `(len + 1) / 2` values (a one-byte value and a separator each), and items and
    /// content parts are values. Such a body needs no counting pass before its parse.
    pub fn hold_any_body_of(&self, len: usize) -> bool {
        let most = len.saturating_add(1) / 2;
        most <= self.messages.min(self.content_parts).min(self.json_values)
    }

    /// Counts `body` (see [`scan`]) and refuses it, naming the limit, if it holds more
    /// than a limit allows. Not JSON: the parser's own error.
    pub fn check(&self, body: &[u8]) -> Result<BodyShape, GatewayError> {
        let shape = scan(body).map_err(|e| GatewayError::InvalidJson(e.to_string()))?;
        let over = [
            (
                Some("messages"),
                "items in `messages`",
                shape.messages as u64,
                self.messages,
                "server.max_messages",
            ),
            (
                Some("input"),
                "items in `input`",
                shape.input as u64,
                self.messages,
                "server.max_messages",
            ),
            (
                Some("messages[].content"),
                "content parts in `messages`",
                shape.message_parts as u64,
                self.content_parts,
                "server.max_content_parts",
            ),
            (
                Some("input[].content"),
                "content parts in `input`",
                shape.input_parts as u64,
                self.content_parts,
                "server.max_content_parts",
            ),
            (
                None,
                "JSON values in the body",
                shape.values,
                self.json_values,
                "server.max_json_values",
            ),
        ]
        .into_iter()
        .find(|(.., count, limit, _)| *count > *limit as u64);
        match over {
            Some((param, what, count, limit, key)) => Err(GatewayError::TooManyItems {
                param,
                what,
                count,
                limit: limit as u64,
                key,
            }),
            None => Ok(shape),
        }
    }
}

impl ContextLayer {
    /// Reads the body within `max_body_bytes` into one buffer sized from its
    /// `Content-Length` (no second copy to join the chunks). A body without one is
    /// charged the whole limit once it grows large, and given back what it did not use.
    async fn read_body(
        &self,
        body: Body,
        declared: Option<usize>,
        charge: &mut Charge,
        until: Instant,
    ) -> Result<Bytes, GatewayError> {
        let limit = self.max_body_bytes;
        let read_error = |e: axum::BoxError| {
            if e.is::<http_body_util::LengthLimitError>() {
                GatewayError::BodyTooLarge { limit }
            } else if is_body_timeout(&*e) {
                GatewayError::BodyTimeout
            } else {
                GatewayError::BodyRead(e.to_string())
            }
        };
        let mut body = Limited::new(body, limit);
        let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(limit));
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.map_err(read_error)?.into_data() else {
                continue;
            };
            if declared.is_none() && buf.len() + data.len() > LARGE_BODY_BYTES {
                self.body_memory
                    .charge_body(charge, limit, until)
                    .await
                    .map_err(overloaded)?;
            }
            buf.extend_from_slice(&data);
        }
        self.body_memory.settle_body(charge, buf.len());
        Ok(buf.freeze())
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
    routes: &RouteTable,
) -> Result<(ParsedRequest, Arc<Route>), GatewayError> {
    let request = ParsedRequest::parse(endpoint, body)?;
    let route = routes
        .resolve(&request.model)
        .cloned()
        .ok_or_else(|| GatewayError::ModelNotFound(request.model.clone()))?;
    Ok((request, route))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The densest JSON there is, one-byte values and separators, is just over a limit
    /// only past the length `hold_any_body_of` lets through uncounted.
    #[test]
    fn a_body_skipped_by_the_length_bound_cannot_be_over_a_limit() {
        let limits = ItemLimits {
            messages: 10,
            content_parts: 50,
            json_values: 50,
        };
        for n in 1..40usize {
            // {"messages":[0,0,...]}: n items, n + 1 values.
            let items = vec!["0"; n].join(",");
            let body = format!(r#"{{"messages":[{items}]}}"#);
            if limits.hold_any_body_of(body.len()) {
                assert!(limits.check(body.as_bytes()).is_ok(), "{body}");
            }
            let bare = vec!["0"; n].join(",");
            let bare = format!("[{bare}]");
            if limits.hold_any_body_of(bare.len()) {
                assert!(scan(bare.as_bytes()).unwrap().values <= 10, "{bare}");
            }
        }
        // 20 bytes hold at most 10 values; 21 bytes hold 11 (`[0,0,0,0,0,0,0,0,0,0]`).
        assert!(limits.hold_any_body_of(20));
        assert!(!limits.hold_any_body_of(21));
    }

    #[test]
    fn a_field_name_is_allocated_once_whatever_the_reloads() {
        let first = field_name("metadata.run_id");
        for _ in 0..3 {
            assert!(std::ptr::eq(first, field_name("metadata.run_id")));
        }
    }

    fn fields(paths: &[&str]) -> Vec<(&'static str, Vec<String>)> {
        let owned: Vec<String> = paths.iter().map(|p| p.to_string()).collect();
        ContextLayer::new(Arc::new(RouteTable::default()), 1, 1)
            .session_id_fields(&owned)
            .session_fields
            .to_vec()
    }

    fn body(text: &str) -> serde_json::Map<String, serde_json::Value> {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn a_session_id_is_read_from_the_first_body_field_present() {
        let f = fields(&["metadata.session_id", "user", "metadata.user_id"]);
        let read = |text: &str| session_from_body(&body(text), &f, 16);
        assert_eq!(
            read(r#"{"metadata":{"session_id":"run-1"},"user":"u"}"#)
                .unwrap()
                .as_deref(),
            Some("run-1")
        );
        assert_eq!(
            read(r#"{"user":"u-2","metadata":{"user_id":"x"}}"#)
                .unwrap()
                .as_deref(),
            Some("u-2")
        );
        assert_eq!(
            read(r#"{"metadata":{"user_id":"a-3"}}"#)
                .unwrap()
                .as_deref(),
            Some("a-3")
        );
        assert_eq!(
            read(r#"{"metadata":{"session_id":"  "},"user":null}"#).unwrap(),
            None
        );
        assert_eq!(read(r#"{"messages":[]}"#).unwrap(), None);
        for bad in [
            r#"{"metadata":{"session_id":7}}"#,
            r#"{"metadata":{"session_id":"has space"}}"#,
            r#"{"metadata":{"session_id":"a-very-long-session-id"}}"#,
        ] {
            let err = read(bad).unwrap_err();
            assert_eq!(err.code().as_str(), "invalid_parameter", "{bad}");
            assert!(
                matches!(
                    err,
                    GatewayError::InvalidParameter {
                        param: "metadata.session_id",
                        ..
                    }
                ),
                "{bad}"
            );
        }
        // Not configured: never read.
        assert_eq!(
            session_from_body(&body(r#"{"user":"u"}"#), &fields(&[]), 16).unwrap(),
            None
        );
    }
}

/// A fuzz harness for the request parser (issue 16): arbitrary bytes and arbitrary JSON
/// bodies never panic, and whatever is accepted keeps the invariants later layers rely
/// on. `PROPTEST_CASES=100000 cargo test --release --lib fuzz_` runs it longer.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

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
            match parse(Endpoint::ChatCompletions, Bytes::from(bytes.clone()), &routes) {
                Ok((ctx, _route)) => {
                    prop_assert!(!ctx.model.trim().is_empty());
                    prop_assert!(ctx.model.starts_with("gpt-"));
                    prop_assert!(ctx.max_output_tokens.is_none_or(|n| n <= MAX_OUTPUT_TOKENS));
                    // What is routed is what the upstream is sent: one parse, no duplicates.
                    let upstream: Value = serde_json::from_slice(&ctx.upstream_body(None, false)).unwrap();
                    prop_assert_eq!(upstream.get("model").and_then(Value::as_str), Some(ctx.model.as_str()));
                }
                Err(err) => {
                    prop_assert!(err.code().status() == 400 || err.code().status() == 404, "{err:?}");
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
                    Err(err) => prop_assert_eq!(err.code().as_str(), "invalid_header"),
                }
            }
        }
    }
}
