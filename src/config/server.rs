use std::{net::SocketAddr, time::Duration};

use serde::Deserialize;

use super::ConfigError;

/// `[server]`: the listener and the limits every request is held to.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Largest request body accepted; larger bodies get 413 before any upstream call.
    pub max_body_bytes: usize,
    /// The whole client request, retries included.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// How long in-flight requests may run after SIGTERM/SIGINT before they are cut.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 10 * 1024 * 1024,
            request_timeout: Duration::from_secs(120),
            shutdown_grace: Duration::from_secs(30),
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
        if self.request_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "server.request_timeout",
                "must be greater than 0",
            ));
        }
        Ok(())
    }
}

/// `[log]`: structured logs on stderr.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A tracing filter such as `info` or `backstop=debug,warn`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// `[mock]`: run the built-in mock upstream inside `serve` (the offline default).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockConfig {
    pub listen: SocketAddr,
}
