//! Model name → route. Exact names win; otherwise the first glob in config order.

use std::{collections::HashMap, sync::Arc};

use wildmatch::WildMatch;

use crate::{config::Config, upstream::Upstream, wire::Wire};

/// One target of a route, resolved to its upstream.
#[derive(Debug)]
pub struct Target {
    pub upstream: Arc<Upstream>,
    /// The model to ask this upstream for; `None` keeps the client's. Shared, so each
    /// attempt takes it without a copy.
    pub model: Option<Arc<str>>,
    /// The answer cap for a translated request that sets none (Anthropic targets).
    pub max_tokens: Option<u64>,
}

impl Target {
    /// The model this target asks for: its own, or the client's.
    pub fn model_for<'a>(&'a self, client_model: &'a str) -> &'a str {
        self.model.as_deref().unwrap_or(client_model)
    }

    /// The wire format this target is sent a request in, for a caller speaking `caller`
    /// and asking for `client_model`.
    pub fn wire(&self, client_model: &str, caller: Wire) -> Wire {
        self.upstream.wire(self.model_for(client_model), caller)
    }
}

#[derive(Debug)]
pub struct Route {
    pub pattern: String,
    pub targets: Vec<Target>,
    /// Takes requests that a target refused with `context_length_exceeded`.
    pub context_fallback: Option<Target>,
    /// The schema every answer must match (`response_schema`), if the route sets one.
    pub response_schema: Option<Arc<serde_json::Value>>,
    /// The route's `validation.stream`, if it overrides the global one.
    pub validation_stream: Option<crate::config::StreamValidation>,
    /// `hedge_after`: when a second attempt races a slow first one (off when `None`).
    pub hedge_after: Option<crate::config::HedgeAfter>,
    /// Top-level request fields a translation may drop (`translate.drop`).
    pub translate_drop: Vec<String>,
}

#[derive(Debug, Default)]
pub struct RouteTable {
    exact: HashMap<String, Arc<Route>>,
    globs: Vec<(WildMatch, Arc<Route>)>,
    /// Concrete model ids in config order (exact routes and `models` lists), for
    /// `GET /v1/models`.
    ids: Vec<String>,
    /// Glob patterns with no `models` list: listed only when no concrete id is known.
    unlisted_globs: Vec<String>,
}

impl RouteTable {
    /// Builds the table from a validated config; `upstreams` holds one entry per
    /// `[[upstreams]]`, by name.
    pub fn new(config: &Config, upstreams: &HashMap<String, Arc<Upstream>>) -> Self {
        let mut table = RouteTable::default();
        for route in &config.routes {
            let target = |t: &crate::config::TargetConfig| Target {
                upstream: upstreams[&t.upstream].clone(),
                model: t.model.as_deref().map(Arc::from),
                max_tokens: t.max_tokens,
            };
            let resolved = Arc::new(Route {
                pattern: route.model.clone(),
                targets: route.targets.iter().map(target).collect(),
                context_fallback: route.context_fallback.as_ref().map(target),
                response_schema: route.response_schema_value.clone(),
                validation_stream: route.validation.stream,
                hedge_after: route.hedge_after,
                translate_drop: route.translate.drop.clone(),
            });
            if !route.is_glob() {
                table.ids.push(route.model.clone());
            } else if route.models.is_empty() {
                table.unlisted_globs.push(route.model.clone());
            }
            for id in &route.models {
                if !table.ids.contains(id) {
                    table.ids.push(id.clone());
                }
            }
            if route.is_glob() {
                table.globs.push((WildMatch::new(&route.model), resolved));
            } else {
                table.exact.insert(route.model.clone(), resolved);
            }
        }
        table
    }

    pub fn resolve(&self, model: &str) -> Option<&Arc<Route>> {
        self.exact.get(model).or_else(|| {
            self.globs
                .iter()
                .find(|(glob, _)| glob.matches(model))
                .map(|(_, r)| r)
        })
    }

    /// The models `GET /v1/models` lists: the concrete ids a route serves, or, when the
    /// config names none, the route patterns themselves.
    pub fn model_names(&self) -> &[String] {
        if self.ids.is_empty() {
            &self.unlisted_globs
        } else {
            &self.ids
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RouteTable {
        let config = crate::config::Config::from_toml_with_env(
            r#"
            [[upstreams]]
            name = "a"
            api = "openai"
            base_url = "http://127.0.0.1:1"
            [[routes]]
            model = "gpt-*"
            targets = [{ upstream = "a" }]
            [[routes]]
            model = "gpt-4o"
            targets = [{ upstream = "a", model = "exact" }]
            [[routes]]
            model = "*"
            targets = [{ upstream = "a", model = "catch-all" }]
            [[tenants]]
            name = "t"
            api_keys = ["bk-test-key"]
            "#,
            |_| None,
        )
        .unwrap();
        let upstreams = crate::upstream::build_all(&config);
        RouteTable::new(&config, &upstreams)
    }

    #[test]
    fn exact_beats_glob_and_globs_go_in_order() {
        let t = table();
        assert_eq!(
            t.resolve("gpt-4o").unwrap().targets[0].model.as_deref(),
            Some("exact")
        );
        assert_eq!(t.resolve("gpt-4o-mini").unwrap().pattern, "gpt-*");
        assert_eq!(t.resolve("claude").unwrap().pattern, "*");
        // The one exact route is the one concrete id; globs without a list are not ids.
        assert_eq!(t.model_names(), ["gpt-4o"]);
    }
}
