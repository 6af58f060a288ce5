use std::{collections::HashSet, time::Duration};

use serde::Deserialize;

use super::{BreakerConfig, ConfigError, RetryConfig, Secret};
use crate::api::ApiKind;

/// `[[upstreams]]`: one model provider.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    pub api: ApiKind,
    /// An origin with an optional path prefix; the client's path (`/v1/...`) is appended.
    pub base_url: String,
    /// The provider key Backstop injects. May be empty for keyless upstreams (the mock).
    #[serde(default = "empty_secret")]
    pub api_key: Secret,
    /// One upstream attempt: until the whole body for non-streaming calls, until the
    /// response head and then between chunks for streams.
    #[serde(default = "default_attempt_timeout", with = "super::duration")]
    pub attempt_timeout: Duration,
    /// `anthropic-version` sent when the client sent none (Anthropic upstreams only).
    #[serde(default = "default_anthropic_version")]
    pub anthropic_version: String,
    /// Client headers forwarded to this upstream beyond the built-in allow-list: exact
    /// names or `prefix-*` globs (the mock's tests use `["x-mock-*"]`). Credentials and
    /// hop-by-hop headers are never forwarded, whatever this says.
    #[serde(default)]
    pub forward_headers: Vec<String>,
    /// Largest body read whole from this upstream (non-streaming answers and error
    /// bodies); larger is 502 `upstream_response_too_large`.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
    /// Largest single SSE event accepted from this upstream's streams.
    #[serde(default = "default_max_sse_event_bytes")]
    pub max_sse_event_bytes: usize,
    /// Longest a stream relayed from this upstream may run in all, however steadily it
    /// flows.
    #[serde(default = "default_max_stream_duration", with = "super::duration")]
    pub max_stream_duration: Duration,
    /// `[retry]` with this upstream's `[upstreams.retry]` keys over it.
    #[serde(default)]
    pub retry: RetryConfig,
    /// `[breaker]` with this upstream's `[upstreams.breaker]` keys over it.
    #[serde(default)]
    pub breaker: BreakerConfig,
}

/// Headers no configuration may forward upstream: client credentials and cookies.
pub const NEVER_FORWARDED: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
];

fn empty_secret() -> Secret {
    Secret::new("")
}

fn default_attempt_timeout() -> Duration {
    Duration::from_secs(60)
}

fn default_max_response_bytes() -> usize {
    32 * 1024 * 1024
}

fn default_max_sse_event_bytes() -> usize {
    1024 * 1024
}

fn default_max_stream_duration() -> Duration {
    Duration::from_secs(600)
}

/// The keys that moved from `[server]` to `[[upstreams]]`: the old spelling is still read
/// (for every upstream), with a warning.
pub(super) const MOVED_FROM_SERVER: [&str; 3] = [
    "max_response_bytes",
    "max_sse_event_bytes",
    "max_stream_duration",
];

fn default_anthropic_version() -> String {
    "2023-06-01".into()
}

impl UpstreamConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.name"),
                "must not be empty",
            ));
        }
        let url = self.base_url.as_str();
        let rest = url
            .strip_prefix("http://")
            .or_else(|| url.strip_prefix("https://"))
            .ok_or_else(|| {
                ConfigError::invalid(
                    format!("{key}.base_url"),
                    "expected a URL that starts with http:// or https://",
                )
            })?;
        let host = rest.split('/').next().unwrap_or("");
        let parses = reqwest::Url::parse(&format!(
            "{}/v1/chat/completions",
            url.trim_end_matches('/')
        ))
        .is_ok();
        if host.is_empty()
            || url.contains(['?', '#'])
            || url.parse::<http::Uri>().is_err()
            || !parses
        {
            return Err(ConfigError::invalid(
                format!("{key}.base_url"),
                "expected an http(s) origin with an optional path prefix, and no query or fragment",
            ));
        }
        let positive = [
            ("attempt_timeout", self.attempt_timeout.is_zero()),
            ("max_response_bytes", self.max_response_bytes == 0),
            ("max_sse_event_bytes", self.max_sse_event_bytes == 0),
            ("max_stream_duration", self.max_stream_duration.is_zero()),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, zero)| *zero) {
            return Err(ConfigError::invalid(
                format!("{key}.{name}"),
                "must be greater than 0",
            ));
        }
        for (i, name) in self.forward_headers.iter().enumerate() {
            let bare = name.strip_suffix('*').unwrap_or(name);
            let valid = !bare.is_empty()
                && http::HeaderName::from_bytes(bare.as_bytes()).is_ok()
                && bare.bytes().all(|b| !b.is_ascii_uppercase());
            if !valid {
                return Err(ConfigError::invalid(
                    format!("{key}.forward_headers[{i}]"),
                    format_args!("{name:?} is not a lower-case header name or `prefix-*` glob"),
                ));
            }
            if NEVER_FORWARDED.iter().any(|n| n.starts_with(bare)) && name.ends_with('*')
                || NEVER_FORWARDED.contains(&bare)
            {
                return Err(ConfigError::invalid(
                    format!("{key}.forward_headers[{i}]"),
                    format_args!("{name:?} would forward client credentials"),
                ));
            }
        }
        self.retry.validate(&format!("{key}.retry"))?;
        self.breaker.validate(&format!("{key}.breaker"))?;
        if http::HeaderValue::from_str(self.api_key.expose()).is_err() {
            return Err(ConfigError::invalid(
                format!("{key}.api_key"),
                "contains characters not allowed in an HTTP header",
            ));
        }
        Ok(())
    }

    /// `base_url` without a trailing slash, ready for a `/v1/...` path to be appended.
    pub fn origin(&self) -> &str {
        self.base_url.trim_end_matches('/')
    }
}

pub(super) fn known(names: &HashSet<&str>, name: &str) -> bool {
    names.contains(name)
}
