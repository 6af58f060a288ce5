use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use super::{ConfigError, Secret};

/// `[telemetry]`: OpenTelemetry traces over OTLP/HTTP. Off unless `otlp_endpoint` is set.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// The collector: `http://host:4318` (spans go to `/v1/traces` under it) or the full
    /// `.../v1/traces` URL.
    pub otlp_endpoint: Option<String>,
    /// The `service.name` resource attribute.
    pub service_name: String,
    /// Share of new traces recorded (0..=1); a client's sampled flag is followed.
    pub sample_ratio: f64,
    /// One export call to the collector is abandoned after this (its spans dropped).
    #[serde(with = "super::duration")]
    pub export_timeout: Duration,
    /// Spans waiting for export; beyond it new spans are dropped and counted.
    pub max_queue: usize,
    /// Sent with every export (a collector's auth token: use `${VAR}`).
    pub headers: BTreeMap<String, Secret>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "backstop".into(),
            sample_ratio: 1.0,
            export_timeout: Duration::from_secs(10),
            max_queue: 2048,
            headers: BTreeMap::new(),
        }
    }
}

impl TelemetryConfig {
    /// The URL spans are posted to, when tracing is on.
    pub fn traces_url(&self) -> Option<String> {
        let endpoint = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        Some(if endpoint.ends_with("/v1/traces") {
            endpoint.to_string()
        } else {
            format!("{endpoint}/v1/traces")
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = self.traces_url() {
            let parsed = reqwest::Url::parse(&url).ok();
            if !parsed.is_some_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host()) {
                return Err(ConfigError::invalid(
                    "telemetry.otlp_endpoint",
                    "must be an http:// or https:// URL",
                ));
            }
        }
        if self.service_name.is_empty() {
            return Err(ConfigError::invalid(
                "telemetry.service_name",
                "must not be empty",
            ));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(ConfigError::invalid(
                "telemetry.sample_ratio",
                "must be between 0 and 1",
            ));
        }
        if self.export_timeout.is_zero() || self.export_timeout > Duration::from_secs(60) {
            return Err(ConfigError::invalid(
                "telemetry.export_timeout",
                "must be between 1ms and 60s",
            ));
        }
        if !(1..=1_000_000).contains(&self.max_queue) {
            return Err(ConfigError::invalid(
                "telemetry.max_queue",
                "must be between 1 and 1000000",
            ));
        }
        for (name, value) in &self.headers {
            let key = format!("telemetry.headers.{name}");
            if http::HeaderName::from_bytes(name.as_bytes()).is_err()
                || http::HeaderValue::from_str(value.expose()).is_err()
            {
                return Err(ConfigError::invalid(key, "is not a valid HTTP header"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_endpoint(endpoint: &str) -> TelemetryConfig {
        TelemetryConfig {
            otlp_endpoint: Some(endpoint.into()),
            ..TelemetryConfig::default()
        }
    }

    #[test]
    fn endpoint_takes_a_base_or_the_full_traces_url() {
        assert_eq!(TelemetryConfig::default().traces_url(), None);
        for endpoint in [
            "http://127.0.0.1:4318",
            "http://127.0.0.1:4318/",
            "http://127.0.0.1:4318/v1/traces",
        ] {
            let config = with_endpoint(endpoint);
            assert_eq!(
                config.traces_url().as_deref(),
                Some("http://127.0.0.1:4318/v1/traces")
            );
            config.validate().unwrap();
        }
    }

    #[test]
    fn parses_from_toml_strictly() {
        let config: TelemetryConfig = toml::from_str(
            "otlp_endpoint = \"https://otel.example:4318\"\nexport_timeout = \"250ms\"\nheaders = { authorization = \"Bearer x\" }\n",
        )
        .unwrap();
        assert_eq!(config.export_timeout, Duration::from_millis(250));
        assert_eq!(config.service_name, "backstop");
        config.validate().unwrap();
        assert!(toml::from_str::<TelemetryConfig>("endpoint = \"x\"").is_err());
    }

    #[test]
    fn bad_values_name_their_key() {
        let key = |config: TelemetryConfig| match config.validate() {
            Err(ConfigError::Invalid { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        assert_eq!(key(with_endpoint("not a url")), "telemetry.otlp_endpoint");
        assert_eq!(key(with_endpoint("ftp://x")), "telemetry.otlp_endpoint");
        let ratio = TelemetryConfig {
            sample_ratio: 1.5,
            ..TelemetryConfig::default()
        };
        assert_eq!(key(ratio), "telemetry.sample_ratio");
        let queue = TelemetryConfig {
            max_queue: 0,
            ..TelemetryConfig::default()
        };
        assert_eq!(key(queue), "telemetry.max_queue");
        let header = TelemetryConfig {
            headers: [("bad name".to_string(), Secret::new("x"))].into(),
            ..TelemetryConfig::default()
        };
        assert_eq!(key(header), "telemetry.headers.bad name");
    }
}
