//! Admin auth layer (just inside the respond layer on every `/admin/*` route): the
//! caller must present `[admin] token` as `Authorization: Bearer` (or `x-api-key`),
//! compared in constant time. Refuses with 403 `admin_disabled` when no token is
//! configured (the admin API is off), else 401 `invalid_admin_token`: answered here, as
//! an [`AdminError`], so the stack's error type stays the proxy's.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use axum::body::Body;
use futures_util::future::{ready, Either, Ready};
use http::{Request, Response};
use tower::{Layer, Service};

use super::error::{refuse, AdminError};
use crate::{
    api::Endpoint,
    layers::auth::{presented_key, same_key},
    telemetry::RequestLog,
};

#[derive(Clone)]
pub struct AdminAuthLayer {
    token: Option<Arc<str>>,
}

impl AdminAuthLayer {
    /// `None`: the admin API is disabled and every call is refused.
    pub fn new(token: Option<Arc<str>>) -> Self {
        AdminAuthLayer { token }
    }
}

impl<S> Layer<S> for AdminAuthLayer {
    type Service = AdminAuth<S>;
    fn layer(&self, inner: S) -> AdminAuth<S> {
        AdminAuth {
            inner,
            token: self.token.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AdminAuth<S> {
    inner: S,
    token: Option<Arc<str>>,
}

impl<S> AdminAuth<S> {
    fn check(&self, req: &Request<Body>) -> Result<(), AdminError> {
        let Some(token) = &self.token else {
            return Err(AdminError::Disabled);
        };
        let presented = presented_key(req.headers()).unwrap_or_default();
        if same_key(token.as_bytes(), presented) {
            Ok(())
        } else {
            Err(AdminError::Unauthorized)
        }
    }
}

impl<S> Service<Request<Body>> for AdminAuth<S>
where
    S: Service<Request<Body>, Response = Response<Body>>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response<Body>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        match self.check(&req) {
            Ok(()) => Either::Right(self.inner.call(req)),
            Err(err) => {
                let api = Endpoint::wire_for(req.uri().path(), req.headers());
                let log = req.extensions().get::<Arc<RequestLog>>();
                Either::Left(ready(Ok(refuse(log.map(|l| &**l), &err, api))))
            }
        }
    }
}
