use serde::Deserialize;

use super::ConfigError;
use crate::billing::{
    price::{RateSpec, TierSpec},
    Price, Prices, Source,
};

/// `[[prices]]`: USD per million tokens of each kind for the upstream models matching
/// `model`, before the built-in catalog. A kind left out is charged at the input price
/// (a one-hour cache write at the five-minute write's, when that is given).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    /// Exact name or glob over the model actually asked of the upstream.
    pub model: String,
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// Anthropic prompt-cache writes kept five minutes.
    #[serde(default)]
    pub cache_write_per_mtok: Option<f64>,
    /// Anthropic prompt-cache writes kept an hour.
    #[serde(default)]
    pub cache_write_1h_per_mtok: Option<f64>,
    /// Anthropic cache reads; OpenAI cached input.
    #[serde(default)]
    pub cache_read_per_mtok: Option<f64>,
    /// USD per thousand server-side web searches (unset: not charged).
    #[serde(default)]
    pub web_search_per_thousand: Option<f64>,
    /// The most the model writes in one answer (reserved for a call that sets no cap
    /// where the endpoint allows none).
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Long-context tiers: other rates once the prompt (every input kind) passes
    /// `above_tokens`.
    #[serde(default)]
    pub tiers: Vec<PriceTierConfig>,
}

/// `[[prices.tiers]]`: the rates that change once a prompt passes `above_tokens`; a
/// kind left out keeps the entry's own rate.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceTierConfig {
    pub above_tokens: u64,
    #[serde(default)]
    pub input_per_mtok: Option<f64>,
    #[serde(default)]
    pub output_per_mtok: Option<f64>,
    #[serde(default)]
    pub cache_write_per_mtok: Option<f64>,
    #[serde(default)]
    pub cache_write_1h_per_mtok: Option<f64>,
    #[serde(default)]
    pub cache_read_per_mtok: Option<f64>,
}

impl PriceConfig {
    /// The entry as a price, `index` naming where it came from.
    pub fn price(&self, index: usize) -> Price {
        let tiers: Vec<TierSpec> = self
            .tiers
            .iter()
            .map(|t| TierSpec {
                above_tokens: t.above_tokens,
                rates: RateSpec {
                    input: t.input_per_mtok,
                    output: t.output_per_mtok,
                    cache_write: t.cache_write_per_mtok,
                    cache_write_1h: t.cache_write_1h_per_mtok,
                    cache_read: t.cache_read_per_mtok,
                },
            })
            .collect();
        Price::new(
            RateSpec {
                input: Some(self.input_per_mtok),
                output: Some(self.output_per_mtok),
                cache_write: self.cache_write_per_mtok,
                cache_write_1h: self.cache_write_1h_per_mtok,
                cache_read: self.cache_read_per_mtok,
            },
            &tiers,
            self.web_search_per_thousand,
            self.max_output_tokens,
            Source::Config(index),
        )
    }
}

/// Every price the config knows: its `[[prices]]` in order, over the built-in catalog
/// unless `billing.catalog = false`.
pub fn prices(config: &super::Config) -> Prices {
    Prices::new(
        config
            .prices
            .iter()
            .enumerate()
            .map(|(i, p)| (p.model.clone(), p.price(i))),
        config.billing.catalog,
    )
}

/// `[billing]`: how spend is estimated and what an unpriced model costs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BillingConfig {
    /// A model that neither `[[prices]]` nor the catalog prices: `refuse` (the default:
    /// 402 `unpriced_model` for a tenant or session with a USD cap, before any attempt)
    /// or `free` (charged zero USD).
    pub unpriced: Unpriced,
    /// Price models from the built-in catalog when no `[[prices]]` entry matches.
    pub catalog: bool,
    /// Completion tokens reserved when a request names no `max_tokens`.
    pub default_max_tokens: u64,
    /// Input tokens reserved at least for a Responses call that names server-held
    /// context Backstop cannot size, for tenants that set none (0: no floor).
    pub min_input_tokens: u64,
    /// Upstream-reported usage above this many tokens (input, output, or both together)
    /// is not believed: the call is charged its reservation instead, logged and counted
    /// (`backstop_usage_rejected_total`).
    pub max_reported_tokens: u64,
    /// Background Responses (`background: true`): `hold` (the default: the create's
    /// reservation is held until the response's usage appears on a later GET, stream
    /// resume or cancel) or `refuse` (400 for a tenant or session with a USD cap).
    pub background: Background,
}

impl Default for BillingConfig {
    fn default() -> Self {
        BillingConfig {
            unpriced: Unpriced::Refuse,
            catalog: true,
            default_max_tokens: 4096,
            min_input_tokens: 0,
            max_reported_tokens: 10_000_000,
            background: Background::Hold,
        }
    }
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Background {
    Hold,
    Refuse,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Unpriced {
    Free,
    Refuse,
}

impl BillingConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.default_max_tokens == 0 {
            return Err(ConfigError::invalid(
                "billing.default_max_tokens",
                "must be greater than 0",
            ));
        }
        positive_int(
            "billing.max_reported_tokens",
            Some(self.max_reported_tokens),
        )?;
        below_reported("billing.min_input_tokens", Some(self.min_input_tokens))
    }
}

/// `[tenants.session]`: limits on each `x-session-id` of a tenant.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionLimitsConfig {
    pub requests_per_minute: Option<u32>,
    /// Upstream calls charged to the session, retries and corrections included.
    pub max_calls: Option<u64>,
    pub max_tokens: Option<u64>,
    pub max_usd: Option<f64>,
    pub max_concurrent: Option<u32>,
}

/// `[tenants.budget]`: the whole tenant, per UTC day.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantBudgetConfig {
    pub usd_per_day: Option<f64>,
    pub tokens_per_day: Option<u64>,
    /// Input tokens reserved at least for a Responses call that names server-held
    /// context Backstop cannot size (a conversation, an `item_reference`, a stored
    /// prompt, a file, a remote image); unset takes `billing.min_input_tokens`.
    pub min_input_tokens: Option<u64>,
}

pub(super) fn positive_f64(key: &str, value: Option<f64>) -> Result<(), ConfigError> {
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(ConfigError::invalid(
            key,
            format_args!("must be a positive number, got {v}"),
        )),
        _ => Ok(()),
    }
}

fn non_negative_f64(key: &str, value: Option<f64>) -> Result<(), ConfigError> {
    match value {
        Some(v) if !(v.is_finite() && v >= 0.0) => Err(ConfigError::invalid(
            key,
            format_args!("must be a number of at least 0, got {v}"),
        )),
        _ => Ok(()),
    }
}

/// A token count a provider could report: at most `MAX_OUTPUT_TOKENS`'s 32 bits, so a
/// floor cannot be a typo that refuses every call.
fn below_reported(key: &str, value: Option<u64>) -> Result<(), ConfigError> {
    match value {
        Some(v) if v > crate::api::MAX_OUTPUT_TOKENS => Err(ConfigError::invalid(
            key,
            format_args!("must be at most {}, got {v}", crate::api::MAX_OUTPUT_TOKENS),
        )),
        _ => Ok(()),
    }
}

pub(super) fn positive_int(key: &str, value: Option<u64>) -> Result<(), ConfigError> {
    match value {
        Some(0) => Err(ConfigError::invalid(key, "must be greater than 0")),
        _ => Ok(()),
    }
}

impl SessionLimitsConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        positive_int(
            &format!("{key}.requests_per_minute"),
            self.requests_per_minute.map(u64::from),
        )?;
        positive_int(&format!("{key}.max_calls"), self.max_calls)?;
        positive_int(&format!("{key}.max_tokens"), self.max_tokens)?;
        positive_f64(&format!("{key}.max_usd"), self.max_usd)?;
        positive_int(
            &format!("{key}.max_concurrent"),
            self.max_concurrent.map(u64::from),
        )
    }
}

impl TenantBudgetConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        positive_f64(&format!("{key}.usd_per_day"), self.usd_per_day)?;
        positive_int(&format!("{key}.tokens_per_day"), self.tokens_per_day)?;
        below_reported(&format!("{key}.min_input_tokens"), self.min_input_tokens)
    }
}

impl PriceConfig {
    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.model.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.model"),
                "must not be empty",
            ));
        }
        positive_f64(&format!("{key}.input_per_mtok"), Some(self.input_per_mtok))?;
        // Zero is a price (embeddings write nothing); only a negative one is a typo.
        let rates = [
            ("output_per_mtok", Some(self.output_per_mtok)),
            ("cache_write_per_mtok", self.cache_write_per_mtok),
            ("cache_write_1h_per_mtok", self.cache_write_1h_per_mtok),
            ("cache_read_per_mtok", self.cache_read_per_mtok),
            ("web_search_per_thousand", self.web_search_per_thousand),
        ];
        for (name, rate) in rates {
            non_negative_f64(&format!("{key}.{name}"), rate)?;
        }
        positive_int(&format!("{key}.max_output_tokens"), self.max_output_tokens)?;
        let mut above = Vec::new();
        for (i, tier) in self.tiers.iter().enumerate() {
            let key = format!("{key}.tiers[{i}]");
            positive_int(&format!("{key}.above_tokens"), Some(tier.above_tokens))?;
            if above.contains(&tier.above_tokens) {
                return Err(ConfigError::invalid(
                    format!("{key}.above_tokens"),
                    format_args!("{} is given twice", tier.above_tokens),
                ));
            }
            above.push(tier.above_tokens);
            let rates = [
                ("input_per_mtok", tier.input_per_mtok),
                ("output_per_mtok", tier.output_per_mtok),
                ("cache_write_per_mtok", tier.cache_write_per_mtok),
                ("cache_write_1h_per_mtok", tier.cache_write_1h_per_mtok),
                ("cache_read_per_mtok", tier.cache_read_per_mtok),
            ];
            for (name, rate) in rates {
                non_negative_f64(&format!("{key}.{name}"), rate)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, ConfigError};

    fn load(extra: &str) -> Result<Config, ConfigError> {
        Config::from_toml_with_env(
            &format!(
                "{extra}\n[[upstreams]]\nname = \"u\"\napi = \"openai\"\nbase_url = \"http://x\"\n[[routes]]\nmodel = \"*\"\ntargets = [{{ upstream = \"u\" }}]\n[[tenants]]\nname = \"t\"\napi_keys = [\"bk-test-key\"]"
            ),
            |_| None,
        )
    }

    #[test]
    fn store_and_billing_limits_have_safe_defaults_and_are_checked() {
        let config = load("").unwrap();
        assert_eq!(config.store.busy_timeout, std::time::Duration::from_secs(2));
        assert_eq!(config.store.max_wal_bytes, 64 * 1024 * 1024);
        assert_eq!(
            config.store.retention,
            std::time::Duration::from_secs(90 * 86_400)
        );
        assert_eq!(config.billing.max_reported_tokens, 10_000_000);
        for (text, key) in [
            ("[store]\nmax_wal_bytes = 1000", "store.max_wal_bytes"),
            ("[store]\nretention = \"1h\"", "store.retention"),
            (
                "[billing]\nmax_reported_tokens = 0",
                "billing.max_reported_tokens",
            ),
        ] {
            match load(text) {
                Err(ConfigError::Invalid { key: k, .. }) => assert_eq!(k, key),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(load(
            "[store]\nbusy_timeout = \"100ms\"\nmax_wal_bytes = 1048576\nretention = \"1d\""
        )
        .is_ok());
    }
}
