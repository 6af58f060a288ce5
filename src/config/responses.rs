//! `[responses]`: where the Responses API's stored-response routes go
//! (`GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
//! `GET /v1/responses/{id}/input_items`). They name no model, so no route can choose an
//! upstream for them: one `openai` upstream serves them all.

use serde::Deserialize;

use super::UpstreamApi;
use super::{Config, ConfigError};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponsesConfig {
    /// The `openai` upstream that stores responses. Default: the first `openai` upstream
    /// that is a target of any route, in route and target order.
    #[serde(default)]
    pub upstream: Option<String>,
}

impl ResponsesConfig {
    pub(super) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        let Some(name) = &self.upstream else {
            return Ok(());
        };
        match config.upstreams.iter().find(|u| &u.name == name) {
            None => Err(ConfigError::invalid(
                "responses.upstream",
                format_args!("no upstream is named {name:?}"),
            )),
            // Azure keeps stored responses behind its own preview API, which Backstop
            // does not speak.
            Some(u) if u.api != UpstreamApi::OpenAi => Err(ConfigError::invalid(
                "responses.upstream",
                format_args!(
                    "upstream {name:?} has api = \"{}\"; the Responses API needs an \"openai\" upstream",
                    u.api.as_str()
                ),
            )),
            Some(_) => Ok(()),
        }
    }
}

impl Config {
    /// The upstream that serves stored responses: `[responses] upstream`, else the first
    /// `openai` upstream a route targets; `None` when no route reaches an `openai` one.
    pub fn responses_upstream(&self) -> Option<&str> {
        if let Some(name) = &self.responses.upstream {
            return Some(name);
        }
        let openai = |name: &str| {
            self.upstreams
                .iter()
                .any(|u| u.name == name && u.api == UpstreamApi::OpenAi)
        };
        self.routes
            .iter()
            .flat_map(|r| r.targets.iter().chain(&r.context_fallback))
            .map(|t| t.upstream.as_str())
            .find(|name| openai(name))
    }
}
