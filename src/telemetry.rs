//! Logs and metrics: the tracing subscriber, the Prometheus recorder, and the per-request
//! record that every layer fills in and the edge layer writes out as one log line.

use std::{
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{filter::Targets, prelude::*};

use crate::{
    config::{LogConfig, LogFormat},
    error::ErrorCode,
    policy::{
        guard::Phase,
        trail::{self, Step},
    },
};

/// Installs the global tracing subscriber once; later calls (tests) are no-ops.
///
/// Lines are written to stderr by a background thread: one `write` per request line on
/// the request's own thread measured 10–20% of saturation throughput. The writer blocks
/// rather than drop lines if it ever falls 8,192 lines behind (a longer queue showed up
/// as megabytes of RSS under saturation).
pub fn init_logging(config: &LogConfig) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let filter: Targets = config
            .level
            .parse()
            .unwrap_or_else(|_| Targets::new().with_default(tracing::Level::INFO));
        let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(false)
            .buffered_lines_limit(8192)
            .finish(std::io::stderr());
        let registry = tracing_subscriber::registry().with(filter);
        // Colour only for a person at a terminal: ANSI codes in a file or a log pipeline
        // are noise (and `NO_COLOR` turns them off anyway).
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
            && std::env::var_os("NO_COLOR").is_none();
        if config.format == LogFormat::Json {
            let _ = JSON_QUEUE.set(writer.clone());
        }
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(ansi);
        let _ = match config.format {
            // The request's span once per line (`"span": {request_id, tenant, session}`),
            // not again as a one-element span list.
            LogFormat::Json => registry
                .with(
                    fmt.json()
                        .flatten_event(true)
                        .with_span_list(false)
                        .fmt_fields(JsonSpanFields),
                )
                .try_init(),
            LogFormat::Text => registry.with(fmt).try_init(),
        };
        *LOG_FLUSH.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
    });
}

/// A span's fields for JSON lines: the JSON object the JSON formatter reads back into
/// each line's `"span"`, written directly. tracing-subscriber's own (`JsonFields`)
/// builds a map and serialises it when every span is made, about 6,700 instructions a
/// request for the request span's three fields, whether or not a line is ever written in
/// it.
struct JsonSpanFields;

impl<'w> tracing_subscriber::fmt::FormatFields<'w> for JsonSpanFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: tracing_subscriber::fmt::format::Writer<'w>,
        fields: R,
    ) -> std::fmt::Result {
        let mut object = JsonObject::new(String::from("{"));
        fields.record(&mut object);
        object.text.push('}');
        writer.write_str(&object.text)
    }

    fn add_fields(
        &self,
        current: &'w mut tracing_subscriber::fmt::FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> std::fmt::Result {
        let mut text = std::mem::take(&mut current.fields);
        if text.ends_with('}') {
            text.pop();
        } else {
            text.push('{');
        }
        let mut object = JsonObject::new(text);
        fields.record(&mut object);
        object.text.push('}');
        current.fields = object.text;
        Ok(())
    }
}

/// A JSON object's members, appended to `text` (which holds `{` and any members
/// already written).
struct JsonObject {
    text: String,
}

impl JsonObject {
    fn new(text: String) -> Self {
        JsonObject { text }
    }

    fn member(&mut self, field: &tracing::field::Field, value: impl serde::Serialize) {
        if !self.text.ends_with('{') {
            self.text.push(',');
        }
        let name = serde_json::to_string(field.name()).unwrap_or_default();
        let value = serde_json::to_string(&value).unwrap_or_else(|_| "null".into());
        self.text.push_str(&name);
        self.text.push(':');
        self.text.push_str(&value);
    }
}

impl tracing::field::Visit for JsonObject {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.member(field, value);
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.member(field, value);
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.member(field, value);
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.member(field, value);
    }

    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.member(field, value);
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.member(field, format!("{value:?}"));
    }
}

/// The log queue, when lines are JSON: the access-log line goes into it directly.
static JSON_QUEUE: OnceLock<tracing_appender::non_blocking::NonBlocking> = OnceLock::new();

/// One request's access-log line in the shape the JSON formatter gives every other line
/// (the same keys in the same order; a `None` is left out), serialised straight into the
/// log queue. Through tracing's formatter the line cost about 33,000 instructions a
/// request (a visitor per field, the timestamp written piece by piece, the line copied
/// twice), a tenth of the every-policy path; this is a few thousand.
#[derive(serde::Serialize)]
pub struct AccessLine<'a> {
    #[serde(serialize_with = "now_rfc3339")]
    pub timestamp: (),
    pub level: &'static str,
    pub message: &'static str,
    pub request_id: &'a str,
    pub endpoint: &'static str,
    pub tenant: &'a str,
    pub session: &'a str,
    pub model: &'a str,
    pub upstream: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    pub error: &'a str,
    pub attempts: u32,
    pub recovery: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Prompt-cache writes (every lifetime), reads and reasoning: only when reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    pub end: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cut: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_ms: Option<f64>,
    pub latency_ms: f64,
    pub upstream_ms: f64,
    pub target: &'static str,
}

fn now_rfc3339<S: serde::Serializer>(_: &(), s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_micros(
        std::time::SystemTime::now(),
    ))
}

impl AccessLine<'_> {
    /// Writes the line when logs are JSON (and the line's level is on); false when they
    /// are text, for the caller to log it through tracing instead.
    pub fn write_json(&self) -> bool {
        let Some(queue) = JSON_QUEUE.get() else {
            return false;
        };
        let mut line = Vec::with_capacity(512);
        if serde_json::to_writer(&mut line, self).is_ok() {
            line.push(b'\n');
            let _ = std::io::Write::write_all(&mut queue.clone(), &line);
        }
        true
    }
}

/// Keeps the background log writer alive; dropping it flushes what is queued.
static LOG_FLUSH: Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> = Mutex::new(None);

/// Writes out every queued log line. Call before the process exits.
pub fn flush_logs() {
    drop(LOG_FLUSH.lock().unwrap_or_else(|e| e.into_inner()).take());
}

/// The process-wide Prometheus recorder. One per process: metrics are global in the
/// `metrics` crate, so every server in a test process shares it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let latency = [
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ];
            // Time to recovery is seconds to an hour, not a request's latency.
            let recovery = [
                1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets(&latency)
                .expect("static bucket list is non-empty")
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full(
                        "backstop_guard_recovery_seconds".into(),
                    ),
                    &recovery,
                )
                .expect("static bucket list is non-empty")
                .build_recorder();
            let handle = recorder.handle();
            // Histogram samples are kept one by one until drained into their buckets,
            // which a scrape of /metrics does: without one they would pile up for every
            // request (about 40 bytes each). Drained every second regardless: at 10,000
            // requests a second, every five seconds held about 2 MB of them at a time.
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    upkeep.run_upkeep();
                });
            // Another recorder may already be installed (embedding apps); then ours
            // renders an empty page rather than failing the server.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

fn describe() {
    metrics::describe_counter!(
        "backstop_requests_total",
        "Client requests by endpoint, tenant and status class"
    );
    metrics::describe_histogram!(
        "backstop_request_duration_seconds",
        "Client request latency until the response head"
    );
    metrics::describe_histogram!(
        "backstop_upstream_duration_seconds",
        "Upstream attempt latency by upstream"
    );
    metrics::describe_histogram!(
        "backstop_owner_write_seconds",
        "Time a stored Responses create waits for its owner to be durable before it is answered"
    );
    metrics::describe_histogram!(
        "backstop_overhead_seconds",
        "Time spent in Backstop outside upstream calls"
    );
    metrics::describe_gauge!(
        "backstop_runtime_workers",
        "Threads running the async runtime (server.workers, or the cores this process may use)"
    );
    metrics::describe_gauge!(
        "backstop_in_flight_requests",
        "Client requests being served"
    );
    metrics::describe_counter!(
        "backstop_upstream_attempts_total",
        "Upstream attempts by upstream and outcome"
    );
    metrics::describe_counter!(
        "backstop_trace_spans_dropped_total",
        "Trace spans not delivered to the collector, by reason (queue_full, export_failed)"
    );
    metrics::describe_counter!(
        "backstop_session_trips_total",
        "Sessions tripped by the guard, by the rule that fired (fleet_pattern included)"
    );
    metrics::describe_counter!(
        "backstop_fleet_refusals_total",
        "Requests refused because of a hot failure signature: preempted before their first attempt, or of a session the fleet tripped"
    );
    metrics::describe_counter!(
        "backstop_fleet_predictions_total",
        "Fleet predictions judged: confirmed (the session failed that way again) or unconfirmed (its next request of that shape succeeded)"
    );
}

/// What one request did: one typed record per request, made by the edge layer and
/// shared through request extensions (so an error raised deep in the stack still finds
/// it). Each fact is written once, by the layer that decided it, through its own typed
/// setter; the edge reads the record twice: at the response head for the `x-backstop-*`
/// headers, and when the response body ends for the access-log line, the span, the
/// request metrics and the dashboard.
#[derive(Default, Debug)]
pub struct RequestLog {
    facts: Mutex<Facts>,
    /// The request's trace span, when tracing is on (set by the trace layer).
    trace: OnceLock<crate::otel::RequestTrace>,
}

/// The facts of one request, as typed values.
#[derive(Default, Clone, Debug)]
pub struct Facts {
    /// The authenticated tenant (the auth layer).
    pub tenant: Option<Arc<str>>,
    /// The session the call belongs to (the context layer).
    pub session: Option<String>,
    /// The model the client asked for (the context layer).
    pub model: Option<String>,
    /// What recovery and validation did (the `x-backstop-recovery` header).
    pub recovery: Trail,
    /// The error the request was answered with (the respond layer, the admin routes).
    pub error: Option<ErrorCode>,
    /// What the session has left (the `x-backstop-budget-remaining` header).
    pub budget_remaining: Option<String>,
    /// The session guard's state after this request (`x-backstop-session-state`).
    pub session_state: Option<Phase>,
    /// Tokens the upstream reported, every kind, summed over the request's calls (a
    /// stream's once it ends).
    pub usage: Option<crate::billing::Tokens>,
    /// Why Backstop cut a relayed stream short (`broken`, `idle`, `too_long`, ...),
    /// if it did.
    pub stream_cut: Option<&'static str>,
    /// USD charged for the request's calls settled before the response head (a
    /// stream's is settled when it ends).
    pub spent_usd: f64,
    /// The session as the last settle in the shared state left it (replica mode,
    /// settled before the response head: not a stream's), so the admission layer reads
    /// what the session has left without another round trip.
    pub session_seen: Option<crate::policy::budget::SessionSeen>,
}

/// What recovery did for a request: its steps in order, the attempts made, the last
/// upstream asked and the time spent waiting on upstreams.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct Trail {
    pub steps: Vec<Step>,
    pub upstream: Option<Arc<str>>,
    /// The model the last attempt asked its upstream for, when its target rewrote the
    /// caller's (else it is the request's own, [`Facts::model`]).
    pub model: Option<Arc<str>>,
    /// Fields a translation dropped because the route allowed it (comma-separated).
    pub dropped: Option<Arc<str>>,
    pub attempts: u32,
    pub upstream_time: Duration,
    /// The upstream's own error (its code, else its type; its message and field) when
    /// its error was answered as it came, for the fleet's failure signatures and the
    /// guard's diagnosis.
    pub upstream_error: Option<Arc<crate::policy::classify::ProviderError>>,
}

impl Trail {
    /// Appends a later run (a correction, a hedge, a strategy switch) after this one.
    pub fn then(&mut self, later: Trail) {
        self.steps.extend(later.steps);
        self.attempts += later.attempts;
        self.upstream_time += later.upstream_time;
        if later.upstream.is_some() {
            self.upstream = later.upstream;
            self.model = later.model;
            self.dropped = later.dropped;
        }
        self.upstream_error = later.upstream_error;
    }
}

impl Facts {
    /// The `x-backstop-recovery` value: the steps taken, else what refused the request.
    pub fn recovery_header(&self) -> Option<String> {
        match self.error {
            _ if !self.recovery.steps.is_empty() => Some(trail::render(&self.recovery.steps)),
            Some(code) => Some(Step::Refused(code.as_str()).to_string()),
            None => None,
        }
    }
}

impl RequestLog {
    fn write(&self, f: impl FnOnce(&mut Facts)) {
        f(&mut self.facts.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn set_tenant(&self, tenant: Arc<str>) {
        self.write(|f| f.tenant = Some(tenant));
    }

    pub fn set_request(&self, model: String, session: Option<String>) {
        self.write(|f| {
            f.model = Some(model);
            f.session = session;
        });
    }

    /// What recovery (and validation around it) did, once it is done.
    pub fn set_recovery(&self, recovery: Trail) {
        self.write(|f| f.recovery = recovery);
    }

    /// A step taken before the recovery's own (the session guard's guidance).
    pub fn precede_recovery(&self, step: Step) {
        self.write(|f| f.recovery.steps.insert(0, step));
    }

    pub fn set_error(&self, code: ErrorCode) {
        self.write(|f| f.error = Some(code));
    }

    pub fn set_budget_remaining(&self, remaining: String) {
        self.write(|f| f.budget_remaining = Some(remaining));
    }

    pub fn set_session_state(&self, phase: Phase) {
        self.write(|f| f.session_state = Some(phase));
    }

    /// Adds reported token usage (one per upstream call: corrections add up).
    pub fn add_usage(&self, tokens: &crate::billing::Tokens) {
        self.write(|f| f.usage = Some(f.usage.unwrap_or_default().plus(*tokens)));
    }

    /// One upstream call settled before the response head: what it charged, and the
    /// session as the shared state holds it after (replica mode).
    pub fn add_settled(&self, usd: f64, seen: Option<crate::policy::budget::SessionSeen>) {
        self.write(|f| {
            f.spent_usd += usd;
            if seen.is_some() {
                f.session_seen = seen;
            }
        });
    }

    /// A relayed stream was cut short by Backstop, for `reason`.
    pub fn set_stream_cut(&self, reason: &'static str) {
        self.write(|f| f.stream_cut = Some(reason));
    }

    /// The request's trace span, when tracing is on.
    pub fn trace(&self) -> Option<&crate::otel::RequestTrace> {
        self.trace.get()
    }

    /// Attaches the request's trace span (once; the trace layer does).
    pub fn set_trace(&self, trace: crate::otel::RequestTrace) {
        let _ = self.trace.set(trace);
    }

    /// The facts as they are now.
    pub fn facts(&self) -> Facts {
        self.facts.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How a response body ended: the `end` of the access-log line and the span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyEnd {
    /// Sent to its end.
    Complete,
    /// Ended early by Backstop with an error event (the upstream broke or went silent,
    /// a bound, shutdown): [`Facts::stream_cut`] says why.
    Cut,
    /// The client went away before the body (or the head) was sent.
    ClientGone,
}

impl BodyEnd {
    /// How a body dropped ended: as its last poll said, else complete if nothing was
    /// left to send (a whole body may be dropped without a last poll), else the client
    /// went away.
    pub fn at_drop(polled: Option<BodyEnd>, end_stream: bool) -> BodyEnd {
        match polled {
            Some(end) => end,
            None if end_stream => BodyEnd::Complete,
            None => BodyEnd::ClientGone,
        }
    }

    /// A stream sent to its end is still `Cut` when Backstop ended it early with an
    /// error event (the upstream broke, went silent, a bound, shutdown).
    pub fn or_cut(self, cut_by_backstop: bool) -> BodyEnd {
        match self {
            BodyEnd::Complete if cut_by_backstop => BodyEnd::Cut,
            end => end,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            BodyEnd::Complete => "complete",
            BodyEnd::Cut => "cut",
            BodyEnd::ClientGone => "client_gone",
        }
    }
}

/// Model names as metric labels, from configured names only: a client can send any
/// `model`, and a label per distinct name would let it grow `/metrics` without bound.
/// An exactly configured name (a route, a target's model, a price) is its own label; a
/// name matching a configured glob is labelled with the glob (`gpt-*`); anything else
/// is `other`.
#[derive(Debug, Default)]
pub struct ModelLabels {
    exact: std::collections::HashMap<String, Arc<str>>,
    globs: Vec<(wildmatch::WildMatch, Arc<str>)>,
}

impl ModelLabels {
    pub fn new(config: &crate::config::Config) -> Self {
        let mut labels = ModelLabels::default();
        let names = config
            .prices
            .iter()
            .map(|p| p.model.as_str())
            .chain(config.routes.iter().map(|r| r.model.as_str()))
            .chain(
                config
                    .routes
                    .iter()
                    .flat_map(|r| r.targets.iter().chain(&r.context_fallback))
                    .filter_map(|t| t.model.as_deref()),
            );
        for name in names {
            if name.contains(['*', '?']) {
                if !labels.globs.iter().any(|(_, l)| &**l == name) {
                    labels
                        .globs
                        .push((wildmatch::WildMatch::new(name), name.into()));
                }
            } else {
                labels.exact.insert(name.to_string(), name.into());
            }
        }
        labels
    }

    /// The label for a model name.
    pub fn label(&self, model: &str) -> Arc<str> {
        if let Some(label) = self.exact.get(model) {
            return label.clone();
        }
        self.globs
            .iter()
            .find(|(glob, _)| glob.matches(model))
            .map_or_else(|| Arc::from("other"), |(_, label)| label.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_ends_complete_cut_or_with_the_client_gone() {
        use BodyEnd::*;
        assert_eq!(BodyEnd::at_drop(Some(Complete), false), Complete);
        assert_eq!(BodyEnd::at_drop(Some(Cut), true), Cut);
        assert_eq!(BodyEnd::at_drop(None, true), Complete);
        assert_eq!(BodyEnd::at_drop(None, false), ClientGone);
        assert_eq!(Complete.or_cut(true), Cut);
        assert_eq!(Complete.or_cut(false), Complete);
        assert_eq!(ClientGone.or_cut(true), ClientGone);
    }

    #[test]
    fn corrections_and_hedges_append_their_trails() {
        let mut trail = Trail {
            steps: vec![Step::Hedge("b".into())],
            ..Trail::default()
        };
        trail.then(Trail {
            steps: vec![Step::Ok],
            upstream: Some("a".into()),
            attempts: 1,
            upstream_time: Duration::from_millis(5),
            ..Trail::default()
        });
        trail.then(Trail {
            steps: vec![Step::GiveUp(trail::Reason::Status(503))],
            upstream: None,
            attempts: 2,
            upstream_time: Duration::from_millis(7),
            ..Trail::default()
        });
        assert_eq!(trail::render(&trail.steps), "hedge:b,ok,giveup:503");
        assert_eq!(trail.attempts, 3);
        assert_eq!(trail.upstream.as_deref(), Some("a"));
        assert_eq!(trail.upstream_time, Duration::from_millis(12));
    }

    #[test]
    fn model_labels_come_from_the_config_only() {
        let config = crate::config::Config::from_toml_with_env(
            r#"
            [[prices]]
            model = "gpt-4o*"
            input_per_mtok = 1.0
            output_per_mtok = 1.0
            [[upstreams]]
            name = "u"
            api = "openai"
            base_url = "http://127.0.0.1:1"
            [[routes]]
            model = "claude-3"
            targets = [{ upstream = "u", model = "rewritten" }]
            [[routes]]
            model = "*"
            targets = [{ upstream = "u" }]
            [[tenants]]
            name = "t"
            api_keys = ["bk-test-key-1"]
            "#,
            |_| None,
        )
        .unwrap();
        let labels = ModelLabels::new(&config);
        assert_eq!(&*labels.label("gpt-4o-mini"), "gpt-4o*");
        assert_eq!(&*labels.label("claude-3"), "claude-3");
        assert_eq!(&*labels.label("rewritten"), "rewritten");
        // The catch-all route is a glob too: everything else collapses into it.
        assert_eq!(&*labels.label("evil\u{0}name-12345"), "*");
        let no_catch_all = ModelLabels {
            globs: Vec::new(),
            ..ModelLabels::new(&config)
        };
        assert_eq!(&*no_catch_all.label("evil\u{0}name-12345"), "other");
    }

    /// The span fields written directly read back as the JSON formatter's own would:
    /// escaped strings, numbers, a field recorded after the span was made.
    #[test]
    fn json_span_fields_are_the_span_object_of_each_line() {
        #[derive(Clone, Default)]
        struct Lines(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Lines {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_span_list(false)
            .fmt_fields(JsonSpanFields)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "request",
                request_id = "say \"hi\"\n",
                attempts = 3u64,
                session = tracing::field::Empty
            );
            span.record("session", "s-1");
            let _entered = span.enter();
            tracing::info!(ok = true, "inside");
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["message"], "inside", "{text}");
        assert_eq!(line["span"]["request_id"], "say \"hi\"\n", "{text}");
        assert_eq!(line["span"]["attempts"], 3, "{text}");
        assert_eq!(line["span"]["session"], "s-1", "{text}");
        assert_eq!(line["span"]["name"], "request", "{text}");
    }
}
