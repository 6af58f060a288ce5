//! Typed configuration: TOML file → `${ENV}` interpolation → strict deserialisation →
//! [`Config::validate`]. Nothing is served until every check here has passed, and every
//! error names the key path that is wrong (`upstreams[1].base_url`) and the kind of value
//! expected. No error shows a value that came from `${ENV}`: serde's messages are
//! rendered without the value they quote, and whatever a message still quotes is
//! scrubbed of the interpolated values ([`env::FromEnv`]) before it leaves this module,
//! for `check-config`, a refused start and a refused reload alike.

mod admin;
mod budget;
mod duration;
mod env;
mod log;
mod recovery;
mod responses;
mod route;
mod server;
mod state;
mod store;
mod telemetry;
mod tenant;
mod upstream;
mod validation;

use std::{collections::HashSet, fmt, path::Path};

use serde::Deserialize;

pub use admin::AdminConfig;
pub use budget::{
    prices, Background, BillingConfig, PriceConfig, PriceTierConfig, SessionLimitsConfig,
    TenantBudgetConfig, Unpriced,
};
pub use log::{LogConfig, LogFormat};
pub use recovery::{BreakerConfig, RetryConfig};
pub use responses::ResponsesConfig;
pub use route::{HedgeAfter, RouteConfig, TargetConfig};
pub use server::{MockConfig, ServerConfig, MAX_WORKERS};
pub use state::{OnUnavailable, StateBackend, StateConfig};
pub use store::{StoreBackend, StoreConfig};
pub use telemetry::TelemetryConfig;
pub use tenant::{FleetConfig, GuardConfig, TenantConfig};
pub use upstream::{
    is_bedrock_anthropic, BaseUrl, ProviderKey, UpstreamApi, UpstreamConfig, NEVER_FORWARDED,
};
pub use validation::{StreamValidation, ValidationConfig, ValidationMode};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub log: LogConfig,
    /// When present, `serve` also runs the built-in mock upstream in-process.
    #[serde(default)]
    pub mock: Option<MockConfig>,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub breaker: BreakerConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub validation: ValidationConfig,
    /// Where the Responses API's stored-response routes go.
    #[serde(default)]
    pub responses: ResponsesConfig,
    #[serde(default)]
    pub store: StoreConfig,
    /// Where replicas share budgets, rate limits, the guard and idempotency.
    #[serde(default)]
    pub state: StateConfig,
    /// OpenTelemetry traces (off unless `otlp_endpoint` is set).
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub billing: BillingConfig,
    #[serde(default)]
    pub prices: Vec<PriceConfig>,
    #[serde(default)]
    pub upstreams: Vec<UpstreamConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// Keys read in a deprecated spelling, (old, new): warned of at load.
    #[serde(skip)]
    pub deprecated: Vec<(String, String)>,
    /// The file this was loaded from ([`Config::load`]): what a reload reads again.
    #[serde(skip)]
    pub source: Option<std::path::PathBuf>,
}

/// Why a configuration was refused. `key` is the path of the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid TOML: {0}")]
    Syntax(String),
    #[error("{key}: environment variable {var} is not set")]
    MissingEnv { key: String, var: String },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    pub(crate) fn invalid(key: impl Into<String>, message: impl fmt::Display) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.to_string(),
        }
    }

    /// This error with every value that came from the environment replaced by its
    /// `${VAR}` reference. Keys are never interpolated, so only messages can hold one;
    /// syntax errors come before interpolation.
    fn scrubbed(self, from_env: &env::FromEnv) -> Self {
        match self {
            ConfigError::Invalid { key, message } => ConfigError::Invalid {
                key,
                message: from_env.scrub(&message),
            },
            other => other,
        }
    }
}

/// A serde message without the value it quotes: `invalid type: string "sk-...",
/// expected u32` becomes `invalid type: string, expected u32`. The key path is said
/// beside it, and the value is the operator's to look up, not the log's to hold.
fn without_value(message: &str) -> String {
    // The toml deserializer adds "\nin `key`\n": the key is said beside it already.
    let message = message.split("\nin `").next().unwrap_or(message);
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(prefix) {
            // serde's `Unexpected`: its kind, then the value quoted (`string "x"`,
            // `integer `5``), or the kind alone (`sequence`, `map`).
            let kind = rest[..rest.find(['"', '`', ',']).unwrap_or(rest.len())].trim_end();
            return match rest.rfind(", expected ") {
                Some(at) => format!("{prefix}{kind}{}", &rest[at..]),
                None => format!("{prefix}{kind}"),
            };
        }
    }
    if message.starts_with("unknown variant ") {
        return match message.rfind(", expected ") {
            Some(at) => format!("unknown variant{}", &message[at..]),
            None => "unknown variant".to_string(),
        };
    }
    message.to_string()
}

/// The upstream response limits were `[server]` keys; they are `[[upstreams]]` keys now.
/// An old key still applies, to every upstream; set in both places it is refused, as
/// one of the two would silently lose.
fn move_from_server(value: &mut toml::Value) -> Result<Vec<(String, String)>, ConfigError> {
    let mut deprecated = Vec::new();
    let Some(root) = value.as_table_mut() else {
        return Ok(deprecated);
    };
    for name in upstream::MOVED_FROM_SERVER {
        let old = root
            .get_mut("server")
            .and_then(toml::Value::as_table_mut)
            .and_then(|server| server.remove(name));
        let Some(old) = old else { continue };
        let upstreams = root
            .get_mut("upstreams")
            .and_then(toml::Value::as_array_mut);
        for (i, upstream) in upstreams.into_iter().flatten().enumerate() {
            let Some(upstream) = upstream.as_table_mut() else {
                continue;
            };
            if upstream.contains_key(name) {
                return Err(ConfigError::invalid(
                    format!("upstreams[{i}].{name}"),
                    format_args!(
                        "also set as server.{name}, its deprecated spelling: keep only this one"
                    ),
                ));
            }
            upstream.insert(name.into(), old.clone());
        }
        deprecated.push((format!("server.{name}"), format!("upstreams[].{name}")));
    }
    Ok(deprecated)
}

/// `[retry]` and `[breaker]` are every upstream's defaults: an upstream's own
/// `[upstreams.retry]` / `[upstreams.breaker]` overrides them key by key. Merged in the
/// tree, before deserialising, so each upstream holds whole settings (and a bad key is
/// named under the upstream that set it).
fn inherit_defaults(value: &mut toml::Value) {
    let Some(root) = value.as_table_mut() else {
        return;
    };
    for section in ["retry", "breaker"] {
        let defaults = root
            .get(section)
            .and_then(toml::Value::as_table)
            .cloned()
            .unwrap_or_default();
        let upstreams = root
            .get_mut("upstreams")
            .and_then(toml::Value::as_array_mut);
        for upstream in upstreams.into_iter().flatten() {
            let Some(upstream) = upstream.as_table_mut() else {
                continue;
            };
            let merged = match upstream.remove(section) {
                None => defaults.clone(),
                Some(toml::Value::Table(own)) => {
                    let mut merged = defaults.clone();
                    merged.extend(own);
                    merged
                }
                // Not a table: left for deserialising to refuse, by its key.
                Some(other) => {
                    upstream.insert(section.into(), other);
                    continue;
                }
            };
            upstream.insert(section.into(), toml::Value::Table(merged));
        }
    }
}

impl Config {
    /// Reads, interpolates, parses and validates a config file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut config = Self::from_toml_in(&text, |var| std::env::var(var).ok(), &base)?;
        config.source = Some(path.to_path_buf());
        Ok(config)
    }

    /// Parses config text, resolving `${VAR}` through `lookup` (the process environment in
    /// production, a map in tests), then validates it.
    pub fn from_toml_with_env(
        text: &str,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        Self::from_toml_in(text, lookup, Path::new(""))
    }

    /// As [`Config::from_toml_with_env`], with relative file paths in the config (route
    /// schemas) resolved against `base`.
    pub fn from_toml_in(
        text: &str,
        lookup: impl Fn(&str) -> Option<String>,
        base: &Path,
    ) -> Result<Self, ConfigError> {
        let mut value: toml::Value =
            toml::from_str(text).map_err(|e| ConfigError::Syntax(e.message().to_string()))?;
        let mut from_env = env::FromEnv::default();
        env::interpolate(&mut value, "", &lookup, &mut from_env)?;
        Self::from_value(value, base).map_err(|e| e.scrubbed(&from_env))
    }

    /// Deserialises and validates the interpolated tree.
    fn from_value(mut value: toml::Value, base: &Path) -> Result<Self, ConfigError> {
        let deprecated = move_from_server(&mut value)?;
        inherit_defaults(&mut value);
        let mut config: Config = serde_path_to_error::deserialize(value).map_err(|e| {
            let key = e.path().to_string();
            ConfigError::Invalid {
                key: if key == "." { "(root)".into() } else { key },
                message: without_value(&e.into_inner().to_string()),
            }
        })?;
        for (i, route) in config.routes.iter_mut().enumerate() {
            route.load_schema(&format!("routes[{i}].response_schema"), base)?;
        }
        config.validate()?;
        config.deprecated = deprecated;
        config.warn_deprecated();
        Ok(config)
    }

    /// One warning per key read in its deprecated spelling (at load, and again by
    /// `serve` once logging is up).
    pub fn warn_deprecated(&self) {
        for (old, new) in &self.deprecated {
            tracing::warn!(old = %old, new = %new, "deprecated config key: use the new one");
        }
    }

    /// Cross-field checks that the type system cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.log.validate()?;
        self.retry.validate("retry")?;
        self.breaker.validate("breaker")?;
        self.validation.validate()?;
        self.admin.validate()?;
        for (i, price) in self.prices.iter().enumerate() {
            price.validate(&format!("prices[{i}]"))?;
        }
        self.billing.validate()?;
        self.store.validate()?;
        self.state.validate()?;
        self.telemetry.validate()?;
        if self.upstreams.is_empty() {
            return Err(ConfigError::invalid(
                "upstreams",
                "at least one upstream is required",
            ));
        }
        let mut names = HashSet::new();
        for (i, upstream) in self.upstreams.iter().enumerate() {
            upstream.validate(&format!("upstreams[{i}]"))?;
            if !names.insert(upstream.name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("upstreams[{i}].name"),
                    format_args!("duplicate upstream name {:?}", upstream.name),
                ));
            }
        }
        if self.routes.is_empty() {
            return Err(ConfigError::invalid(
                "routes",
                "at least one route is required",
            ));
        }
        let mut patterns = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            route.validate(&format!("routes[{i}]"), &names)?;
            for (j, target) in route.targets.iter().enumerate() {
                let bedrock = self
                    .upstreams
                    .iter()
                    .any(|u| u.name == target.upstream && u.api == UpstreamApi::Bedrock);
                if let Some(model) = target.model.as_deref().filter(|_| bedrock) {
                    if !is_bedrock_anthropic(model) {
                        return Err(ConfigError::invalid(
                            format!("routes[{i}].targets[{j}].model"),
                            format_args!("{model:?} is not one of Anthropic's Bedrock models (`anthropic.*`, or an inference profile of one): the others need Bedrock's Converse API, which Backstop does not speak yet"),
                        ));
                    }
                }
            }
            if !patterns.insert(route.model.as_str()) {
                return Err(ConfigError::invalid(
                    format!("routes[{i}].model"),
                    format_args!("duplicate route model {:?}", route.model),
                ));
            }
        }
        self.responses.validate(self)?;
        if self.tenants.is_empty() {
            return Err(ConfigError::invalid(
                "tenants",
                "at least one tenant is required",
            ));
        }
        let mut tenant_names = HashSet::new();
        let mut keys = HashSet::new();
        for (i, tenant) in self.tenants.iter().enumerate() {
            tenant.validate(&format!("tenants[{i}]"))?;
            if !tenant_names.insert(tenant.name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("tenants[{i}].name"),
                    format_args!("duplicate tenant name {:?}", tenant.name),
                ));
            }
            for (k, key) in tenant.api_keys.iter().enumerate() {
                if !keys.insert(key.expose()) {
                    return Err(ConfigError::invalid(
                        format!("tenants[{i}].api_keys[{k}]"),
                        "this key is already used by another tenant entry",
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A string that must never be printed: provider keys and tenant keys.
#[derive(Clone, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

#[cfg(test)]
mod tests;
