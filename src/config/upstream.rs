use std::{collections::HashSet, time::Duration};

use serde::Deserialize;

use super::{BreakerConfig, ConfigError, RetryConfig, Secret};
use crate::wire::Wire;

/// `upstreams[].api`: the kind of provider. Azure OpenAI speaks OpenAI's wire format
/// (so it is an OpenAI upstream to every layer but the leaf) at its own per-deployment
/// URLs, with its key in `api-key`. Amazon Bedrock serves Anthropic's models over
/// InvokeModel, whose body is Anthropic's Messages (so a Claude on Bedrock is a messages
/// target to every layer but the leaf, which signs it with SigV4 and unframes its
/// event-stream).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamApi {
    #[serde(rename = "openai")]
    OpenAi,
    Anthropic,
    Azure,
    Bedrock,
}

impl UpstreamApi {
    /// The wire format this provider is sent `model` in, for a caller speaking `caller`:
    /// the caller's own where the provider serves it natively, else the one the request is
    /// translated to. What translation, error shapes and validation go by.
    pub fn wire(self, model: &str, caller: Wire) -> Wire {
        match self {
            UpstreamApi::OpenAi | UpstreamApi::Azure => match caller {
                Wire::Responses => Wire::Responses,
                _ => Wire::Chat,
            },
            UpstreamApi::Anthropic => Wire::Messages,
            UpstreamApi::Bedrock if is_bedrock_anthropic(model) => Wire::Messages,
            UpstreamApi::Bedrock => Wire::Converse,
        }
    }

    /// OpenTelemetry's `gen_ai.provider.name` for this provider (the GenAI semantic
    /// conventions' well-known values).
    pub fn gen_ai_provider(self) -> &'static str {
        match self {
            UpstreamApi::OpenAi => "openai",
            UpstreamApi::Anthropic => "anthropic",
            UpstreamApi::Azure => "azure.ai.openai",
            UpstreamApi::Bedrock => "aws.bedrock",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamApi::OpenAi => "openai",
            UpstreamApi::Anthropic => "anthropic",
            UpstreamApi::Azure => "azure",
            UpstreamApi::Bedrock => "bedrock",
        }
    }
}

/// Whether a Bedrock model id names one of Anthropic's models (sent over InvokeModel in
/// Anthropic's own body): `anthropic.claude-...`, a cross-region inference profile
/// (`us.anthropic...`, `global.anthropic...`), or the ARN of either.
pub fn is_bedrock_anthropic(model: &str) -> bool {
    let id = model.rsplit('/').next().unwrap_or(model);
    let id = match id.split_once('.') {
        Some((prefix, rest)) if prefix != "anthropic" && !prefix.contains(':') => rest,
        _ => id,
    };
    id.starts_with("anthropic.")
}

/// `[[upstreams]]`: one model provider.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    pub name: String,
    pub api: UpstreamApi,
    /// Azure OpenAI's `api-version` query parameter (`"2024-10-21"`): required for
    /// `api = "azure"`, refused for the others.
    #[serde(default)]
    pub api_version: Option<String>,
    /// An origin with an optional path prefix; the client's path (`/v1/...`) is appended.
    /// Required, except for Bedrock ([`UpstreamConfig::base`]).
    #[serde(default)]
    pub base_url: Option<BaseUrl>,
    /// Bedrock: the AWS region, the endpoint's and the signature's (`us-east-1`).
    #[serde(default)]
    pub region: Option<String>,
    /// Bedrock: explicit AWS keys, used as a set (with them the environment and the
    /// standard chain are not read; a session token is sent only when given here).
    #[serde(default)]
    pub access_key_id: Option<Secret>,
    #[serde(default)]
    pub secret_access_key: Option<Secret>,
    #[serde(default)]
    pub session_token: Option<Secret>,
    /// The provider key Backstop injects. May be empty for keyless upstreams (the mock).
    #[serde(default)]
    pub api_key: ProviderKey,
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
    /// Where this upstream's calls go: `base_url`, else Bedrock's regional endpoint
    /// (`https://bedrock-runtime.{region}.amazonaws.com`). Validation makes sure one of
    /// them is there.
    pub fn base(&self) -> BaseUrl {
        match (&self.base_url, &self.region) {
            (Some(base), _) => base.clone(),
            (None, Some(region)) => {
                BaseUrl::parse(&format!("https://bedrock-runtime.{region}.amazonaws.com"))
                    .expect("a validated region makes a valid host")
            }
            // Not reached: validation requires `base_url` or (for Bedrock) `region`.
            (None, None) => BaseUrl::parse("http://invalid").expect("a valid URL"),
        }
    }

    /// The keys only some providers read: present where they mean something, absent
    /// where they would be ignored.
    fn validate_provider(&self, key: &str) -> Result<(), ConfigError> {
        let bedrock = self.api == UpstreamApi::Bedrock;
        if self.base_url.is_none() && !bedrock {
            return Err(ConfigError::invalid(
                format!("{key}.base_url"),
                "is required (an http(s) origin such as \"https://api.openai.com\")",
            ));
        }
        let aws_keys = [
            ("region", self.region.is_some()),
            ("access_key_id", self.access_key_id.is_some()),
            ("secret_access_key", self.secret_access_key.is_some()),
            ("session_token", self.session_token.is_some()),
        ];
        if !bedrock {
            if let Some((name, _)) = aws_keys.iter().find(|(_, set)| *set) {
                return Err(ConfigError::invalid(
                    format!("{key}.{name}"),
                    format_args!(
                        "is only for api = \"bedrock\" (this upstream has api = \"{}\")",
                        self.api.as_str()
                    ),
                ));
            }
            return Ok(());
        }
        let region_ok = self.region.as_deref().is_some_and(|r| {
            !r.is_empty()
                && r.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        });
        if !region_ok {
            return Err(ConfigError::invalid(
                format!("{key}.region"),
                "is required when api = \"bedrock\": an AWS region such as \"us-east-1\"",
            ));
        }
        if !self.api_key.expose().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.api_key"),
                "is not read for api = \"bedrock\": calls are signed with AWS credentials (access_key_id and secret_access_key, or the standard AWS chain)",
            ));
        }
        let empty = |s: &Option<Secret>| s.as_ref().is_some_and(|s| s.expose().is_empty());
        for (name, secret) in [
            ("access_key_id", &self.access_key_id),
            ("secret_access_key", &self.secret_access_key),
            ("session_token", &self.session_token),
        ] {
            if empty(secret) {
                return Err(ConfigError::invalid(
                    format!("{key}.{name}"),
                    "must not be empty (leave all three keys out to use the standard AWS chain)",
                ));
            }
        }
        match (&self.access_key_id, &self.secret_access_key) {
            (Some(_), None) => Err(ConfigError::invalid(
                format!("{key}.secret_access_key"),
                "is required with access_key_id (explicit keys are used as a set)",
            )),
            (None, Some(_)) => Err(ConfigError::invalid(
                format!("{key}.access_key_id"),
                "is required with secret_access_key (explicit keys are used as a set)",
            )),
            (None, None) if self.session_token.is_some() => Err(ConfigError::invalid(
                format!("{key}.session_token"),
                "is only read with access_key_id and secret_access_key",
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.name"),
                "must not be empty",
            ));
        }
        self.validate_provider(key)?;
        match (self.api, &self.api_version) {
            (UpstreamApi::Azure, None) => {
                return Err(ConfigError::invalid(
                    format!("{key}.api_version"),
                    "is required when api = \"azure\" (for example \"2024-10-21\")",
                ))
            }
            (UpstreamApi::Azure, Some(version)) => {
                let valid = !version.is_empty()
                    && version
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
                if !valid {
                    return Err(ConfigError::invalid(
                        format!("{key}.api_version"),
                        "expected a version such as \"2024-10-21\" or \"2024-12-01-preview\"",
                    ));
                }
            }
            (api, Some(_)) => {
                return Err(ConfigError::invalid(
                    format!("{key}.api_version"),
                    format_args!(
                        "is only for api = \"azure\" (this upstream has api = \"{}\")",
                        api.as_str()
                    ),
                ))
            }
            (_, None) => {}
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
        Ok(())
    }
}

/// `base_url`, parsed and checked once, at load: an http(s) origin with an optional path
/// prefix, no query or fragment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl(reqwest::Url);

impl BaseUrl {
    /// `text` checked as `base_url` is checked at load.
    pub fn parse(text: &str) -> Result<Self, &'static str> {
        if !text.starts_with("http://") && !text.starts_with("https://") {
            return Err("expected a URL that starts with http:// or https://");
        }
        let url = reqwest::Url::parse(text).ok().filter(|url| {
            url.host_str().is_some_and(|h| !h.is_empty())
                && !text.contains(['?', '#'])
                && text.parse::<http::Uri>().is_ok()
        });
        url.map(BaseUrl).ok_or(
            "expected an http(s) origin with an optional path prefix, and no query or fragment",
        )
    }

    /// The URL of `path` (`/v1/...`) under this base.
    pub fn join(&self, path: &str) -> reqwest::Url {
        let mut url = self.0.clone();
        url.set_path(&format!("{}{path}", self.origin_path()));
        url
    }

    /// The base without a trailing slash, ready for a `/v1/...` path to be appended.
    pub fn origin(&self) -> String {
        let url = self.0.as_str();
        url.strip_suffix(self.0.path())
            .map_or_else(|| url.to_string(), |o| format!("{o}{}", self.origin_path()))
    }

    fn origin_path(&self) -> &str {
        self.0.path().trim_end_matches('/')
    }
}

impl<'de> Deserialize<'de> for BaseUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let text = String::deserialize(d)?;
        BaseUrl::parse(&text).map_err(D::Error::custom)
    }
}

/// `api_key`: checked at load to fit an HTTP header, and held ready in the header form
/// each API sends; never printed.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ProviderKey {
    secret: Option<Secret>,
    /// `Bearer <key>` (OpenAI) and the bare key (Anthropic's `x-api-key`, Azure's
    /// `api-key`), both marked sensitive.
    headers: Option<(http::HeaderValue, http::HeaderValue)>,
}

impl ProviderKey {
    pub fn expose(&self) -> &str {
        self.secret.as_ref().map_or("", Secret::expose)
    }

    /// The credential header for `api`, name and value: `Authorization: Bearer` (OpenAI),
    /// `x-api-key` (Anthropic), `api-key` (Azure); `None` for a keyless upstream.
    pub fn header(&self, api: UpstreamApi) -> Option<(http::HeaderName, http::HeaderValue)> {
        let (bearer, bare) = self.headers.as_ref()?;
        Some(match api {
            UpstreamApi::OpenAi => (http::header::AUTHORIZATION, bearer.clone()),
            UpstreamApi::Anthropic => (http::HeaderName::from_static("x-api-key"), bare.clone()),
            UpstreamApi::Azure => (http::HeaderName::from_static("api-key"), bare.clone()),
            // Signed per call instead (validation refuses an `api_key` here).
            UpstreamApi::Bedrock => return None,
        })
    }
}

impl std::fmt::Debug for ProviderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProviderKey(***)")
    }
}

impl<'de> Deserialize<'de> for ProviderKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let secret = Secret::deserialize(d)?;
        if secret.expose().is_empty() {
            return Ok(ProviderKey::default());
        }
        let sensitive = |text: String| {
            let mut value = http::HeaderValue::try_from(text).map_err(|_| {
                serde::de::Error::custom("contains characters not allowed in an HTTP header")
            })?;
            value.set_sensitive(true);
            Ok::<_, D::Error>(value)
        };
        let headers = (
            sensitive(format!("Bearer {}", secret.expose()))?,
            sensitive(secret.expose().to_string())?,
        );
        Ok(ProviderKey {
            secret: Some(secret),
            headers: Some(headers),
        })
    }
}

pub(super) fn known(names: &HashSet<&str>, name: &str) -> bool {
    names.contains(name)
}
