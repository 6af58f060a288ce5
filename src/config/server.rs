use std::{net::SocketAddr, time::Duration};

use serde::Deserialize;

use super::ConfigError;

/// Most `server.workers` accepted: past it a typo, not a machine.
pub const MAX_WORKERS: usize = 1024;

/// `[server]`: the listener and the limits every request is held to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Largest request body accepted; larger bodies get 413 before any upstream call.
    pub max_body_bytes: usize,
    /// Items in the body's `messages` list, or its `input` list (Responses API,
    /// embeddings); more are refused with 400 `too_many_items` before parsing.
    pub max_messages: usize,
    /// Content parts in all of a body's messages or input items (`messages[].content`,
    /// `input[].content` lists), summed; more are refused with 400 `too_many_items`.
    pub max_content_parts: usize,
    /// JSON values anywhere in a body (every object, list, string, number...): each
    /// costs memory once parsed. More are refused with 400 `too_many_items`.
    pub max_json_values: usize,
    /// Bytes of large request bodies (over 1 MiB) held at once, all clients together;
    /// a body is charged its `Content-Length` before it is read.
    pub max_body_bytes_in_flight: usize,
    /// Estimated bytes of large bodies' parsed forms held at once, all clients together
    /// (a body estimated over it is charged all of it, so it runs alone).
    pub max_parsed_bytes_in_flight: usize,
    /// How long a large body waits for room under those budgets before it is refused
    /// with 503 `overloaded` (and `Retry-After`).
    #[serde(with = "humantime_serde")]
    pub in_flight_wait: Duration,
    /// The whole client request, retries included.
    #[serde(with = "super::duration")]
    pub request_timeout: Duration,
    /// How long in-flight requests may run after SIGTERM/SIGINT before they are cut.
    #[serde(with = "super::duration")]
    pub shutdown_grace: Duration,
    /// After SIGTERM/SIGINT, how long Backstop keeps accepting and serving while `/readyz`
    /// answers 503, so a load balancer sees it draining before the listener closes.
    #[serde(with = "super::duration")]
    pub drain_delay: Duration,
    /// A connection must deliver a complete request head this soon after it opens or
    /// after its previous response (slowloris and silent sockets are closed).
    #[serde(with = "super::duration")]
    pub header_read_timeout: Duration,
    /// A request body that sends nothing for this long is cut off with 408
    /// `request_body_timeout` (a slow or stalled client; reset by every chunk).
    #[serde(with = "super::duration")]
    pub body_read_timeout: Duration,
    /// A keep-alive connection with no request in flight and no traffic is closed after
    /// this long.
    #[serde(with = "super::duration")]
    pub idle_timeout: Duration,
    /// Client connections open at once; beyond it new connections are answered 503 and
    /// closed. Lowered at start to what the open files limit can hold (`server`'s
    /// `descriptors`).
    pub max_connections: usize,
    /// Longest `x-session-id` accepted (visible ASCII only).
    pub max_session_id_bytes: usize,
    /// Longest `Idempotency-Key` accepted (visible ASCII only).
    pub max_idempotency_key_bytes: usize,
    /// Where a session id is read from when the request has no `x-session-id` header
    /// (which always wins): body fields as dotted paths, tried in order, for agent
    /// frameworks that set headers per client, not per run.
    pub session_id_fields: Vec<String>,
    /// Threads running the async runtime. Unset: the cores this process may use (its CPU
    /// affinity and cgroup quota honoured). Replicas sharing a host each take their share
    /// (three replicas on two cores: 1 each): more workers than cores make every wake-up
    /// a trip through the kernel's scheduler. Bound at start-up.
    pub workers: Option<usize>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 10 * 1024 * 1024,
            max_messages: 10_000,
            max_content_parts: 10_000,
            max_json_values: 500_000,
            max_body_bytes_in_flight: 64 * 1024 * 1024,
            max_parsed_bytes_in_flight: 128 * 1024 * 1024,
            in_flight_wait: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(30),
            drain_delay: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_session_id_bytes: 256,
            max_idempotency_key_bytes: 255,
            session_id_fields: vec!["metadata.session_id".into()],
            workers: None,
        }
    }
}

impl ServerConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(ConfigError::invalid(
                "server.max_body_bytes",
                "must be greater than 0",
            ));
        }
        let positive = [
            ("server.request_timeout", self.request_timeout.is_zero()),
            (
                "server.header_read_timeout",
                self.header_read_timeout.is_zero(),
            ),
            ("server.body_read_timeout", self.body_read_timeout.is_zero()),
            ("server.idle_timeout", self.idle_timeout.is_zero()),
            ("server.max_connections", self.max_connections == 0),
            ("server.max_messages", self.max_messages == 0),
            ("server.max_content_parts", self.max_content_parts == 0),
            ("server.max_json_values", self.max_json_values == 0),
            (
                "server.max_body_bytes_in_flight",
                self.max_body_bytes_in_flight == 0,
            ),
            (
                "server.max_parsed_bytes_in_flight",
                self.max_parsed_bytes_in_flight == 0,
            ),
            (
                "server.max_session_id_bytes",
                self.max_session_id_bytes == 0,
            ),
            (
                "server.max_idempotency_key_bytes",
                self.max_idempotency_key_bytes == 0,
            ),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, zero)| *zero) {
            return Err(ConfigError::invalid(*key, "must be greater than 0"));
        }
        if let Some(workers) = self.workers {
            if !(1..=MAX_WORKERS).contains(&workers) {
                return Err(ConfigError::invalid(
                    "server.workers",
                    format_args!("must be between 1 and {MAX_WORKERS}"),
                ));
            }
        }
        for (i, path) in self.session_id_fields.iter().enumerate() {
            let valid = path.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
            if !valid {
                return Err(ConfigError::invalid(
                    format!("server.session_id_fields[{i}]"),
                    format_args!(
                        "{path:?} is not a dotted path of field names (e.g. \"metadata.session_id\")"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `[mock]`: run the built-in mock upstream inside `serve` (the offline default).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockConfig {
    pub listen: SocketAddr,
}
