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
    /// Amazon Bedrock's InvokeModel: `{base_url}/model/{model id}/invoke` (or
    /// `/invoke-with-response-stream`), the id percent-encoded as the AWS SDK sends it.
    Bedrock {
        /// `{base_url}/model`.
        models: Url,
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
    /// A Bedrock model that is not one of Anthropic's: Bedrock's Converse API, which
    /// every other model is served over, is not spoken yet.
    Converse,
}

impl UrlStyle {
    pub fn new(config: &UpstreamConfig) -> Self {
        let base = config.base();
        match (config.api, config.api_version.as_deref()) {
            (UpstreamApi::Bedrock, _) => UrlStyle::Bedrock {
                models: base.join("/model"),
            },
            (UpstreamApi::Azure, Some(version)) => {
                let mut deployments = base.join("/openai/deployments");
                deployments
                    .query_pairs_mut()
                    .append_pair("api-version", version);
                UrlStyle::Azure { deployments }
            }
            _ => UrlStyle::Standard {
                urls: Endpoint::ALL
                    .into_iter()
                    .map(|e| (e, base.join(e.path())))
                    .collect(),
            },
        }
    }

    /// The URL of a call to `endpoint` asking for `model` (streamed or not).
    pub fn url(&self, endpoint: Endpoint, model: &str, stream: bool) -> Result<Url, Unserved> {
        match self {
            UrlStyle::Bedrock { models } => {
                if endpoint != Endpoint::Messages {
                    return Err(Unserved::Endpoint);
                }
                if !crate::config::is_bedrock_anthropic(model) {
                    return Err(Unserved::Converse);
                }
                if matches!(model, "" | "." | "..") {
                    return Err(Unserved::Deployment);
                }
                /// What the AWS SDK leaves unencoded in a path segment.
                const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
                    .remove(b'-')
                    .remove(b'.')
                    .remove(b'_')
                    .remove(b'~');
                let id = percent_encoding::utf8_percent_encode(model, SEGMENT);
                let action = if stream {
                    "invoke-with-response-stream"
                } else {
                    "invoke"
                };
                let mut url = models.clone();
                url.set_path(&format!("{}/{id}/{action}", models.path()));
                Ok(url)
            }
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
            azure.url(Endpoint::ChatCompletions, "gpt-4o-prod", false).unwrap().as_str(),
            "https://example.openai.azure.com/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            azure.url(Endpoint::Embeddings, "embed-small", false).unwrap().as_str(),
            "https://example.openai.azure.com/openai/deployments/embed-small/embeddings?api-version=2024-10-21"
        );
        // A path prefix is kept, with or without its trailing slash.
        for base in ["https://gw.example/azure", "https://gw.example/azure/"] {
            assert_eq!(
                url_style("azure", base)
                    .url(Endpoint::ChatCompletions, "d", false)
                    .unwrap()
                    .as_str(),
                "https://gw.example/azure/openai/deployments/d/chat/completions?api-version=2024-10-21"
            );
        }
    }

    #[test]
    fn a_deployment_name_stays_one_path_segment() {
        let azure = url_style("azure", "https://example.openai.azure.com");
        let url = azure
            .url(Endpoint::ChatCompletions, "a/b?c#d %e", false)
            .unwrap();
        assert_eq!(
            url.as_str(),
            "https://example.openai.azure.com/openai/deployments/a%2Fb%3Fc%23d%20%25e/chat/completions?api-version=2024-10-21"
        );
        for model in ["", ".", ".."] {
            assert_eq!(
                azure.url(Endpoint::ChatCompletions, model, false),
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
                azure.url(endpoint, "d", false),
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
                .url(Endpoint::ChatCompletions, "gpt-4o", false)
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
                .url(Endpoint::ChatCompletions, "gemini-2.0-flash", false)
                .unwrap()
                .as_str(),
            "https://generativelanguage.googleapis.com/v1beta/openai/v1/chat/completions"
        );
    }

    #[test]
    fn bedrock_invokes_the_encoded_model_id_of_anthropic_models_only() {
        let bedrock = UrlStyle::new(
            &toml::from_str("name = \"b\"\napi = \"bedrock\"\nregion = \"eu-west-3\"\n").unwrap(),
        );
        let id = "anthropic.claude-sonnet-4-5-20250929-v1:0";
        assert_eq!(
            bedrock.url(Endpoint::Messages, id, false).unwrap().as_str(),
            "https://bedrock-runtime.eu-west-3.amazonaws.com/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/invoke"
        );
        assert_eq!(
            bedrock.url(Endpoint::Messages, "us.anthropic.claude-3-5-haiku-20241022-v1:0", true).unwrap().as_str(),
            "https://bedrock-runtime.eu-west-3.amazonaws.com/model/us.anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke-with-response-stream"
        );
        let arn = "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-3-7-sonnet-20250219-v1:0";
        assert_eq!(
            bedrock.url(Endpoint::Messages, arn, false).unwrap().as_str(),
            "https://bedrock-runtime.eu-west-3.amazonaws.com/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.anthropic.claude-3-7-sonnet-20250219-v1%3A0/invoke"
        );
        assert_eq!(
            bedrock.url(Endpoint::Messages, "amazon.nova-pro-v1:0", false),
            Err(Unserved::Converse)
        );
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Responses,
            Endpoint::CountTokens,
            Endpoint::Embeddings,
        ] {
            assert_eq!(
                bedrock.url(endpoint, id, false),
                Err(Unserved::Endpoint),
                "{endpoint:?}"
            );
        }
    }
}
