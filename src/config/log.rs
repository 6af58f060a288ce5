use serde::Deserialize;

use super::ConfigError;

/// `[log]`: structured logs on stderr.
#[derive(Debug, Clone, PartialEq, Deserialize)]
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

/// The level names a `[log] level` directive may use.
const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

impl LogConfig {
    /// `level` is a tracing filter, and tracing reads any word as a target name: a typo
    /// (`inf`) would silently log nothing of Backstop's. Each comma-separated directive
    /// must be a level name or `target=level`.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for directive in self.level.split(',').map(str::trim) {
            let (target, level) = match directive.split_once('=') {
                Some((target, level)) => (Some(target.trim()), level.trim()),
                None => (None, directive),
            };
            let target_ok = target.is_none_or(|t| {
                !t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b':' | b'-'))
            });
            if !target_ok || !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level)) {
                return Err(ConfigError::invalid(
                    "log.level",
                    format_args!(
                        "{directive:?} is not a level or target=level directive; levels are {}",
                        LEVELS.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }
}
