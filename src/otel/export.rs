//! Batched export that never holds up a request: ended spans go into a bounded queue
//! (`telemetry.max_queue`) with a non-blocking send; a task on the tokio runtime exports
//! them in batches over OTLP/HTTP (protobuf) through Backstop's own reqwest client. A
//! full queue, a failed export or one slower than `export_timeout` drops spans; every
//! dropped span is counted in `backstop_trace_spans_dropped_total{reason}` and failures
//! are logged at most once a minute.
//!
//! The SDK's `BatchSpanProcessor` is not used: it counts what it drops but only logs the
//! total at shutdown, and its exports run on a thread with no tokio runtime, where the
//! shared reqwest 0.12 client cannot run (the otlp crate's own reqwest client is 0.13:
//! a second HTTP stack).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use bytes::Bytes;
use opentelemetry::Context;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{
    error::OTelSdkResult,
    trace::{Span, SpanData, SpanExporter, SpanProcessor},
    Resource,
};
use tokio::sync::{mpsc, oneshot};

use crate::config::TelemetryConfig;

/// Spans per export call.
const MAX_BATCH: usize = 512;
/// A partial batch waits at most this long.
const EXPORT_INTERVAL: Duration = Duration::from_secs(1);
/// Export failures are logged at most once per this.
const WARN_INTERVAL: Duration = Duration::from_secs(60);

enum Queued {
    Span(Box<SpanData>),
    Flush(oneshot::Sender<()>),
}

fn dropped(reason: &'static str, n: usize) {
    metrics::counter!("backstop_trace_spans_dropped_total", "reason" => reason).increment(n as u64);
}

/// The span processor: hands ended spans to the export task, never waiting.
#[derive(Debug)]
pub(super) struct Queue {
    tx: mpsc::Sender<Queued>,
    /// Dropped because the queue was full, since the last warning.
    full: Arc<AtomicU64>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _: &mut Span, _: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.tx.try_send(Queued::Span(Box::new(span))).is_err() {
            self.full.fetch_add(1, Ordering::Relaxed);
            dropped("queue_full", 1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Flushes the export task's queue.
pub(super) struct QueueHandle {
    tx: mpsc::Sender<Queued>,
    timeout: Duration,
}

impl QueueHandle {
    /// Waits until every span queued before now has been exported (or dropped), within
    /// the export timeout.
    pub(super) async fn flush(&self) {
        let (ack, done) = oneshot::channel();
        let _ = tokio::time::timeout(self.timeout * 2, async {
            if self.tx.send(Queued::Flush(ack)).await.is_ok() {
                let _ = done.await;
            }
        })
        .await;
    }
}

/// The processor to install and the handle that flushes it; spawns the export task.
pub(super) fn start(
    config: &TelemetryConfig,
    url: &str,
    client: reqwest::Client,
    resource: &Resource,
) -> Result<(Queue, QueueHandle), opentelemetry_otlp::ExporterBuildError> {
    let headers: HashMap<String, String> = config
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.expose().to_string()))
        .collect();
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(config.export_timeout)
        .with_headers(headers)
        // Lost spans are counted, not retried: a retry would hold the queue.
        .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled())
        .with_http_client(Reqwest {
            client,
            timeout: config.export_timeout,
        })
        .build()?;
    exporter.set_resource(resource);
    let (tx, rx) = mpsc::channel(config.max_queue);
    let full = Arc::new(AtomicU64::new(0));
    tokio::spawn(run(rx, exporter, config.export_timeout, full.clone()));
    Ok((
        Queue {
            tx: tx.clone(),
            full,
        },
        QueueHandle {
            tx,
            timeout: config.export_timeout,
        },
    ))
}

/// The export task: batches of up to [`MAX_BATCH`], at least every [`EXPORT_INTERVAL`].
async fn run(
    mut rx: mpsc::Receiver<Queued>,
    exporter: impl SpanExporter,
    timeout: Duration,
    full: Arc<AtomicU64>,
) {
    let mut batch: Vec<SpanData> = Vec::new();
    let mut tick = tokio::time::interval(EXPORT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned: Option<tokio::time::Instant> = None;
    let mut export = async |batch: &mut Vec<SpanData>| {
        if batch.is_empty() {
            return;
        }
        let n = batch.len();
        let error =
            match tokio::time::timeout(timeout, exporter.export(std::mem::take(batch))).await {
                Ok(Ok(())) => return,
                Ok(Err(err)) => err.to_string(),
                Err(_) => format!("no answer within {}", humantime::format_duration(timeout)),
            };
        dropped("export_failed", n);
        let now = tokio::time::Instant::now();
        if warned.is_none_or(|at| now - at >= WARN_INTERVAL) {
            warned = Some(now);
            let queue_full = full.swap(0, Ordering::Relaxed);
            tracing::warn!(
                spans = n,
                queue_full,
                error,
                "trace export failed; spans dropped"
            );
        }
    };
    loop {
        tokio::select! {
            queued = rx.recv() => match queued {
                Some(Queued::Span(span)) => {
                    batch.push(*span);
                    if batch.len() >= MAX_BATCH {
                        export(&mut batch).await;
                    }
                }
                Some(Queued::Flush(ack)) => {
                    export(&mut batch).await;
                    let _ = ack.send(());
                }
                None => {
                    export(&mut batch).await;
                    return;
                }
            },
            _ = tick.tick() => export(&mut batch).await,
        }
    }
}

/// The otlp exporter's HTTP client: Backstop's reqwest 0.12, bounded by the timeout.
#[derive(Debug)]
struct Reqwest {
    client: reqwest::Client,
    timeout: Duration,
}

#[async_trait::async_trait]
impl HttpClient for Reqwest {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let response = self
            .client
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .timeout(self.timeout)
            .send()
            .await?;
        let mut out = Response::new(Bytes::new());
        *out.status_mut() = response.status();
        *out.headers_mut() = response.headers().clone();
        *out.body_mut() = response.bytes().await?;
        Ok(out)
    }
}
