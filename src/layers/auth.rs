//! Auth layer (inside the deadline; the request span and the context layer inside it):
//! the caller's tenant key, from `Authorization: Bearer` or
//! `x-api-key`, selects its tenant. Keys are compared as SHA-256 digests, in constant time
//! against every configured key, so timing tells nothing about which key matched, how
//! much of one, or how long the keys are.
//! Refuses with 401 `invalid_api_key`; on success puts [`Tenant`] in the extensions.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::future::{ready, Either, Ready};
use http::{header, HeaderMap, Request, Response};
use subtle::ConstantTimeEq;
use tower::{Layer, Service};

use crate::{config::Config, error::GatewayError, telemetry::RequestLog};

pub use crate::api::Tenant;

/// Every tenant key (as its digest), resolved to its tenant.
#[derive(Debug)]
pub struct TenantKeys {
    keys: Vec<([u8; 32], Arc<Tenant>)>,
}

/// The SHA-256 of a key: fixed length, so comparing digests leaks no key length.
pub fn key_digest(key: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(key).into()
}

/// Whether `presented` is `expected`, in time independent of both.
pub fn same_key(expected: &[u8], presented: &[u8]) -> bool {
    bool::from(key_digest(expected).ct_eq(&key_digest(presented)))
}

impl TenantKeys {
    pub fn new(config: &Config) -> Self {
        let keys = config
            .tenants
            .iter()
            .flat_map(|t| {
                let tenant = Arc::new(Tenant {
                    name: t.name.as_str().into(),
                });
                t.api_keys
                    .iter()
                    .map(move |k| (key_digest(k.expose().as_bytes()), tenant.clone()))
            })
            .collect();
        TenantKeys { keys }
    }

    /// Constant-time over the whole key list: every key is compared.
    pub fn lookup(&self, presented: &[u8]) -> Option<Arc<Tenant>> {
        let presented = key_digest(presented);
        let mut found = None;
        for (key, tenant) in &self.keys {
            if bool::from(key.ct_eq(&presented)) {
                found = Some(tenant.clone());
            }
        }
        found
    }
}

/// The key the caller presented, if any.
pub fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            let (scheme, rest) = v.split_at(v.len().min(7));
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
        });
    bearer
        .or_else(|| headers.get("x-api-key").map(|v| v.as_bytes()))
        .map(|k| k.trim_ascii())
        .filter(|k| !k.is_empty())
}

#[derive(Clone)]
pub struct AuthLayer {
    keys: Arc<TenantKeys>,
}

impl AuthLayer {
    pub fn new(keys: Arc<TenantKeys>) -> Self {
        AuthLayer { keys }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            keys: self.keys.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    keys: Arc<TenantKeys>,
}

impl<S> Service<Request<Body>> for Auth<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = GatewayError>,
{
    type Response = Response<Body>;
    type Error = GatewayError;
    type Future = Either<Ready<Result<Response<Body>, GatewayError>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let Some(tenant) = presented_key(req.headers()).and_then(|k| self.keys.lookup(k)) else {
            return Either::Left(ready(Err(GatewayError::Unauthorized)));
        };
        if let Some(log) = req.extensions().get::<Arc<RequestLog>>() {
            log.set_tenant(tenant.name.clone());
        }
        req.extensions_mut().insert(tenant);
        Either::Right(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn bearer_and_x_api_key_are_both_accepted() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer  bk-1 "),
        );
        assert_eq!(presented_key(&h), Some(&b"bk-1"[..]));
        let mut h = HeaderMap::new();
        h.insert("x-api-key", HeaderValue::from_static("bk-2"));
        assert_eq!(presented_key(&h), Some(&b"bk-2"[..]));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic Zm9v"),
        );
        assert_eq!(presented_key(&h), None);
        assert_eq!(presented_key(&HeaderMap::new()), None);
    }
}
