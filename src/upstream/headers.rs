//! Header mapping at the upstream boundary. Credentials and hop-by-hop headers never
//! cross it; everything else does, so provider features (beta headers, idempotency keys)
//! keep working through Backstop.

use http::{header, HeaderMap, HeaderName, HeaderValue};

use super::Upstream;
use crate::config::ApiKind;

/// Hop-by-hop headers (RFC 9110 §7.6.1) plus the ones Backstop sets itself.
const STRIPPED: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    header::CONTENT_LENGTH,
];

fn is_stripped(name: &HeaderName, connection_listed: &[String]) -> bool {
    STRIPPED.contains(name)
        || name.as_str() == "keep-alive"
        || connection_listed
            .iter()
            .any(|c| c.eq_ignore_ascii_case(name.as_str()))
}

/// Header names listed in `Connection`, which are hop-by-hop for this message only.
fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The headers an upstream receives: the client's, minus its Backstop credentials,
/// hop-by-hop headers and `accept-encoding` (Backstop reads bodies, so it asks for
/// identity), plus the provider credential.
pub(super) fn upstream_request_headers(client: &HeaderMap, upstream: &Upstream) -> HeaderMap {
    let listed = connection_listed(client);
    let mut out = HeaderMap::with_capacity(client.len() + 2);
    for (name, value) in client {
        if is_stripped(name, &listed)
            || name == header::AUTHORIZATION
            || name.as_str() == "x-api-key"
            || name == header::ACCEPT_ENCODING
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    match upstream.api {
        ApiKind::OpenAi => {
            if let Some(credential) = &upstream.credential {
                out.insert(header::AUTHORIZATION, credential.clone());
            }
        }
        ApiKind::Anthropic => {
            if let Some(credential) = &upstream.credential {
                out.insert(HeaderName::from_static("x-api-key"), credential.clone());
            }
            if !out.contains_key("anthropic-version") {
                out.insert(
                    HeaderName::from_static("anthropic-version"),
                    upstream.anthropic_version.clone(),
                );
            }
        }
    }
    out
}

/// The headers the client receives from an upstream response: hop-by-hop headers and
/// the length (the body may be re-framed) removed; the upstream's own request id kept
/// under another name, since `x-request-id` is Backstop's.
pub(super) fn client_response_headers(upstream: &HeaderMap) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        if is_stripped(name, &listed) {
            continue;
        }
        if name.as_str() == "x-request-id" {
            out.append(
                HeaderName::from_static("x-upstream-request-id"),
                value.clone(),
            );
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(api: ApiKind) -> Upstream {
        Upstream::new(&crate::config::UpstreamConfig {
            name: "u".into(),
            api,
            base_url: "http://127.0.0.1:1".into(),
            api_key: crate::config::Secret::new("sk-provider"),
            attempt_timeout: std::time::Duration::from_secs(1),
            anthropic_version: "2023-06-01".into(),
        })
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
        h
    }

    #[test]
    fn openai_gets_provider_bearer_and_no_tenant_key() {
        let out = upstream_request_headers(&client_headers(), &upstream(ApiKind::OpenAi));
        assert_eq!(out[header::AUTHORIZATION], "Bearer sk-provider");
        assert!(out.get("x-api-key").is_none());
        for gone in ["connection", "x-drop-me", "keep-alive", "accept-encoding"] {
            assert!(out.get(gone).is_none(), "{gone} was forwarded");
        }
        assert_eq!(out["x-session-id"], "s1");
    }

    #[test]
    fn anthropic_gets_x_api_key_and_default_version() {
        let out = upstream_request_headers(&client_headers(), &upstream(ApiKind::Anthropic));
        assert_eq!(out["x-api-key"], "sk-provider");
        assert!(out.get(header::AUTHORIZATION).is_none());
        assert_eq!(out["anthropic-version"], "2023-06-01");
        assert_eq!(out["anthropic-beta"], "tools-2024");

        let mut h = client_headers();
        h.insert("anthropic-version", HeaderValue::from_static("2099-01-01"));
        let out = upstream_request_headers(&h, &upstream(ApiKind::Anthropic));
        assert_eq!(out["anthropic-version"], "2099-01-01");
    }

    #[test]
    fn credential_is_sensitive() {
        let out = upstream_request_headers(&HeaderMap::new(), &upstream(ApiKind::OpenAi));
        assert!(out[header::AUTHORIZATION].is_sensitive());
    }
}
