//! Header mapping at the upstream boundary, by explicit allow-list in each direction.
//!
//! To the upstream go only the headers a provider API needs from a client (`accept`,
//! `user-agent`, `anthropic-version`, `anthropic-beta`, `openai-beta`, the SDKs'
//! `x-stainless-*` metadata), plus what the upstream's `forward_headers` names, plus
//! the provider credential. Never: client credentials (`Authorization`, `x-api-key`,
//! `api-key`), cookies, account selectors (`OpenAI-Organization`, `OpenAI-Project`),
//! hop-by-hop headers, or Backstop's own control headers (`x-session-id`,
//! `Idempotency-Key`, `x-mock-*`) unless configured.
//!
//! To the client go only the headers that describe the answer (`content-type`,
//! `content-encoding`, `cache-control`), its rate limits and retry hints (`retry-after`,
//! `retry-after-ms`, `x-ratelimit-*`, `anthropic-ratelimit-*`), and the provider's request
//! id (Anthropic's `request-id`; OpenAI's `x-request-id` renamed `x-upstream-request-id`,
//! since `x-request-id` is Backstop's). Never `server`, cookies, organization ids, or any
//! `x-backstop-*` header: an upstream cannot forge Backstop's own headers.

use http::{header, HeaderMap, HeaderName, HeaderValue};

use super::Upstream;
use crate::config::UpstreamApi;

/// Client request headers every upstream receives (exact names).
const REQUEST_ALLOWED: &[&str] = &[
    "accept",
    "user-agent",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
];

/// Client request header prefixes every upstream receives.
const REQUEST_ALLOWED_PREFIXES: &[&str] = &["x-stainless-"];

/// Upstream response headers the client receives (exact names).
const RESPONSE_ALLOWED: &[&str] = &[
    "content-type",
    "content-encoding",
    "cache-control",
    "retry-after",
    "retry-after-ms",
    "request-id",
    "openai-processing-ms",
    "openai-version",
];

/// Upstream response header prefixes the client receives.
const RESPONSE_ALLOWED_PREFIXES: &[&str] = &["x-ratelimit-", "anthropic-ratelimit-"];

/// A name against `exact` names and `prefix-*` globs.
fn matches(name: &str, pattern: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == pattern,
    }
}

fn never_forwarded(name: &str) -> bool {
    crate::config::NEVER_FORWARDED.contains(&name)
}

/// The headers an upstream receives: the allow-listed client headers, the upstream's
/// `forward_headers`, a JSON content type and the provider credential.
pub(super) fn upstream_request_headers(client: &HeaderMap, upstream: &Upstream) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(8);
    for (name, value) in client {
        let n = name.as_str();
        // Bedrock reads Anthropic's version and betas in the body, and answers what the
        // URL asks for.
        if upstream.provider == UpstreamApi::Bedrock
            && matches!(n, "anthropic-version" | "anthropic-beta" | "accept")
        {
            continue;
        }
        let allowed = REQUEST_ALLOWED.contains(&n)
            || REQUEST_ALLOWED_PREFIXES.iter().any(|p| n.starts_with(p))
            || upstream.forward_headers.iter().any(|p| matches(n, p));
        if allowed && !never_forwarded(n) {
            out.append(name.clone(), value.clone());
        }
    }
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some((name, credential)) = &upstream.credential {
        out.insert(name.clone(), credential.clone());
    }
    if upstream.provider == UpstreamApi::Anthropic && !out.contains_key("anthropic-version") {
        out.insert(
            HeaderName::from_static("anthropic-version"),
            upstream.anthropic_version.clone(),
        );
    }
    out
}

/// The headers the client receives from an upstream response: the allow-list only.
pub(super) fn client_response_headers(upstream: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(upstream.len().min(16));
    for (name, value) in upstream {
        let n = name.as_str();
        if n == "x-request-id" {
            out.append(
                HeaderName::from_static("x-upstream-request-id"),
                value.clone(),
            );
        } else if RESPONSE_ALLOWED.contains(&n)
            || RESPONSE_ALLOWED_PREFIXES.iter().any(|p| n.starts_with(p))
        {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(api: UpstreamApi) -> Upstream {
        upstream_of(api.as_str(), "")
    }

    fn upstream_of(api: &str, extra: &str) -> Upstream {
        let config = format!(
            "name = \"u\"\napi = \"{api}\"\nbase_url = \"http://127.0.0.1:1\"\napi_key = \"sk-provider\"\nattempt_timeout = \"1s\"\nforward_headers = [\"x-mock-*\"]\n{extra}"
        );
        Upstream::new(&toml::from_str(&config).unwrap())
    }

    fn client_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer bk-tenant"),
        );
        h.insert("x-api-key", HeaderValue::from_static("bk-tenant"));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-drop-me"),
        );
        h.insert("x-drop-me", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        h.insert("x-session-id", HeaderValue::from_static("s1"));
        h.insert("anthropic-beta", HeaderValue::from_static("tools-2024"));
        h.insert("api-key", HeaderValue::from_static("bk-azure-style"));
        h.insert(header::COOKIE, HeaderValue::from_static("session=abc"));
        h.insert("openai-organization", HeaderValue::from_static("org-evil"));
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        h.insert("x-mock-fault", HeaderValue::from_static("ok"));
        h.insert("x-stainless-lang", HeaderValue::from_static("python"));
        h
    }

    #[test]
    fn openai_gets_provider_bearer_and_no_tenant_key() {
        let out = upstream_request_headers(&client_headers(), &upstream(UpstreamApi::OpenAi));
        assert_eq!(out[header::AUTHORIZATION], "Bearer sk-provider");
        assert!(out.get("x-api-key").is_none());
        for gone in [
            "connection",
            "x-drop-me",
            "keep-alive",
            "accept-encoding",
            "api-key",
            "cookie",
            "openai-organization",
            "x-session-id",
            "idempotency-key",
        ] {
            assert!(out.get(gone).is_none(), "{gone} was forwarded");
        }
        assert_eq!(out["x-mock-fault"], "ok", "configured forward_headers pass");
        assert_eq!(out["x-stainless-lang"], "python");
    }

    #[test]
    fn upstream_response_headers_are_allow_listed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("server", "evil/1.0"),
            ("openai-organization", "org-secret"),
            ("x-backstop-attempts", "99"),
            ("x-backstop-recovery", "forged"),
            ("set-cookie", "a=b"),
            ("content-type", "application/json"),
            ("retry-after", "3"),
            ("x-ratelimit-remaining-requests", "7"),
            ("anthropic-ratelimit-tokens-remaining", "100"),
            ("request-id", "req_1"),
            ("x-request-id", "up-1"),
        ] {
            h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        let out = client_response_headers(&h);
        for gone in [
            "server",
            "openai-organization",
            "x-backstop-attempts",
            "x-backstop-recovery",
            "set-cookie",
            "x-request-id",
        ] {
            assert!(out.get(gone).is_none(), "{gone} reached the client");
        }
        assert_eq!(out["retry-after"], "3");
        assert_eq!(out["x-ratelimit-remaining-requests"], "7");
        assert_eq!(out["anthropic-ratelimit-tokens-remaining"], "100");
        assert_eq!(out["request-id"], "req_1");
        assert_eq!(out["x-upstream-request-id"], "up-1");
    }

    #[test]
    fn anthropic_gets_x_api_key_and_default_version() {
        let out = upstream_request_headers(&client_headers(), &upstream(UpstreamApi::Anthropic));
        assert_eq!(out["x-api-key"], "sk-provider");
        assert!(out.get(header::AUTHORIZATION).is_none());
        assert_eq!(out["anthropic-version"], "2023-06-01");
        assert_eq!(out["anthropic-beta"], "tools-2024");

        let mut h = client_headers();
        h.insert("anthropic-version", HeaderValue::from_static("2099-01-01"));
        let out = upstream_request_headers(&h, &upstream(UpstreamApi::Anthropic));
        assert_eq!(out["anthropic-version"], "2099-01-01");
    }

    #[test]
    fn azure_gets_the_bare_key_in_api_key_and_no_bearer() {
        let azure = upstream_of("azure", "api_version = \"2024-10-21\"");
        let out = upstream_request_headers(&client_headers(), &azure);
        assert_eq!(
            out["api-key"], "sk-provider",
            "the provider's, not the client's"
        );
        assert!(out["api-key"].is_sensitive());
        for gone in ["authorization", "x-api-key", "anthropic-version"] {
            assert!(out.get(gone).is_none(), "{gone} was sent to azure");
        }
        assert_eq!(out["x-mock-fault"], "ok");
    }

    #[test]
    fn credential_is_sensitive() {
        let out = upstream_request_headers(&HeaderMap::new(), &upstream(UpstreamApi::OpenAi));
        assert!(out[header::AUTHORIZATION].is_sensitive());
    }
}
