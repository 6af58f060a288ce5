//! Where an upstream's calls go. Most upstreams take the client's `/v1/...` path under
//! their `base_url`; Azure OpenAI speaks OpenAI's wire format at per-deployment paths,
//! with its `api-version` as a query parameter.
//!
//! Every URL is built from one parsed at load: for the standard paths the whole URL, for
//! Azure the deployments' base, to which a call appends its deployment's segments
//! (percent-encoded; parsing a URL string per call showed up in profiles).

use std::collections::HashMap;

use reqwest::Url;

use crate::{
    api::Endpoint,
    config::{UpstreamApi, UpstreamConfig},
};

/// How an upstream's URLs are made (not its wire format, which is its `api`).
#[derive(Debug)]
pub enum UrlStyle {
    /// `base_url` + the client's path, parsed once per endpoint.
    Standard { urls: HashMap<Endpoint, Url> },
    /// Azure OpenAI: `{base_url}/openai/deployments/{deployment}/...?api-version=...`,
    /// where the deployment is the model the attempt asks for.
    Azure {
        /// `{base_url}/openai/deployments?api-version={api_version}`.
        deployments: Url,
    },
}

/// Why an upstream cannot be sent a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unserved {
    /// Azure OpenAI deployments serve chat completions and embeddings only: Backstop does
    /// not send Azure the Responses API (its own `/openai/v1/responses` preview) nor
    /// Anthropic's endpoints.
    Endpoint,
    /// The model is no deployment name (`.` or `..` would leave the deployment path).
    Deployment,
}

impl UrlStyle {
    pub fn new(config: &UpstreamConfig) -> Self {
        match (config.api, config.api_version.as_deref()) {
            (UpstreamApi::Azure, Some(version)) => {
                let mut deployments = config.base_url.join("/openai/deployments");
                deployments
                    .query_pairs_mut()
                    .append_pair("api-version", version);
                UrlStyle::Azure { deployments }
            }
            _ => UrlStyle::Standard {
                urls: Endpoint::ALL
                    .into_iter()
                    .map(|e| (e, config.base_url.join(e.path())))
                    .collect(),
            },
        }
    }

    /// The URL of a call to `endpoint` asking for `model`.
    pub fn url(&self, endpoint: Endpoint, model: &str) -> Result<Url, Unserved> {
        match self {
            UrlStyle::Standard { urls } => urls.get(&endpoint).cloned().ok_or(Unserved::Endpoint),
            UrlStyle::Azure { deployments } => {
                let tail: &[&str] = match endpoint {
                    Endpoint::ChatCompletions => &["chat", "completions"],
                    Endpoint::Embeddings => &["embeddings"],
                    Endpoint::Responses | Endpoint::Messages | Endpoint::CountTokens => {
                        return Err(Unserved::Endpoint)
                    }
                };
                if matches!(model, "" | "." | "..") {
                    return Err(Unserved::Deployment);
                }
                let mut url = deployments.clone();
                url.path_segments_mut()
                    .map_err(|()| Unserved::Endpoint)?
                    .push(model)
                    .extend(tail);
                Ok(url)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url_style(api: &str, base_url: &str) -> UrlStyle {
        let version = if api == "azure" {
            "api_version = \"2024-10-21\"\n"
        } else {
            ""
        };
        let config = format!("name = \"u\"\napi = \"{api}\"\nbase_url = \"{base_url}\"\n{version}");
        UrlStyle::new(&toml::from_str(&config).unwrap())
    }

    #[test]
    fn azure_calls_go_to_the_deployment_with_the_api_version() {
        let azure = url_style("azure", "https://example.openai.azure.com");
        assert_eq!(
            azure.url(Endpoint::ChatCompletions, "gpt-4o-prod").unwrap().as_str(),
            "https://example.openai.azure.com/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            azure.url(Endpoint::Embeddings, "embed-small").unwrap().as_str(),
            "https://example.openai.azure.com/openai/deployments/embed-small/embeddings?api-version=2024-10-21"
        );
        // A path prefix is kept, with or without its trailing slash.
        for base in ["https://gw.example/azure", "https://gw.example/azure/"] {
            assert_eq!(
                url_style("azure", base)
                    .url(Endpoint::ChatCompletions, "d")
                    .unwrap()
                    .as_str(),
                "https://gw.example/azure/openai/deployments/d/chat/completions?api-version=2024-10-21"
            );
        }
    }

    #[test]
    fn a_deployment_name_stays_one_path_segment() {
        let azure = url_style("azure", "https://example.openai.azure.com");
        let url = azure.url(Endpoint::ChatCompletions, "a/b?c#d %e").unwrap();
        assert_eq!(
            url.as_str(),
            "https://example.openai.azure.com/openai/deployments/a%2Fb%3Fc%23d%20%25e/chat/completions?api-version=2024-10-21"
        );
        for model in ["", ".", ".."] {
            assert_eq!(
                azure.url(Endpoint::ChatCompletions, model),
                Err(Unserved::Deployment),
                "{model:?}"
            );
        }
    }

    #[test]
    fn azure_serves_chat_and_embeddings_only() {
        let azure = url_style("azure", "https://example.openai.azure.com");
        for endpoint in [
            Endpoint::Responses,
            Endpoint::Messages,
            Endpoint::CountTokens,
        ] {
            assert_eq!(
                azure.url(endpoint, "d"),
                Err(Unserved::Endpoint),
                "{endpoint:?}"
            );
        }
    }

    #[test]
    fn the_others_take_the_clients_path_and_ignore_the_model() {
        let openai = url_style("openai", "https://api.openai.com");
        assert_eq!(
            openai
                .url(Endpoint::ChatCompletions, "gpt-4o")
                .unwrap()
                .as_str(),
            "https://api.openai.com/v1/chat/completions"
        );
        let gemini = url_style(
            "openai",
            "https://generativelanguage.googleapis.com/v1beta/openai",
        );
        assert_eq!(
            gemini
                .url(Endpoint::ChatCompletions, "gemini-2.0-flash")
                .unwrap()
                .as_str(),
            "https://generativelanguage.googleapis.com/v1beta/openai/v1/chat/completions"
        );
    }
}
