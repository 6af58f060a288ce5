//! The limits: the tenant's and the session's request rates (governor GCRA, in replica
//! mode Redis's), then one of the session's `max_concurrent` slots. Alone for a request
//! without a guard (or when this replica's guard decides alone); a guarded session's
//! limits go in the guard's round trip ([`super::guard`]).

use super::{
    gate::{Admitted, GateRequest},
    AdmissionLayer,
};
use crate::{error::GatewayError, state::budgets::reservation::Ask};

impl AdmissionLayer {
    /// The limits alone, with the first attempt's reservation if there is one to make:
    /// 429 `rate_limited` (Retry-After the limiter's wait) or `too_many_concurrent`.
    pub(super) async fn limits(
        &self,
        tenant: &str,
        session: Option<&str>,
        prepay: Option<&Ask>,
    ) -> Result<Admitted, GatewayError> {
        GateRequest::limits(tenant, session)
            .prepaying(prepay)
            .send(&self.budgets)
            .await
            .admitted()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::tests::layer;

    #[tokio::test(start_paused = true)]
    async fn the_tenants_rate_refuses_with_the_limiters_own_wait() {
        let layer = layer("requests_per_minute = 2");
        for _ in 0..2 {
            assert!(layer.limits("t", None, None).await.is_ok());
        }
        let err = layer.limits("t", None, None).await.err().expect("limited");
        assert_eq!(err.code().as_str(), "rate_limited");
        assert_eq!(err.code().status(), 429);
        assert_eq!(
            err.retry_after(),
            Some(Duration::from_secs(30)),
            "GCRA at 2 a minute: one request every 30 s"
        );
        assert!(
            err.to_string().contains("tenant.requests_per_minute"),
            "{err}"
        );
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(layer.limits("t", None, None).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_sessions_rate_is_its_own() {
        let layer = layer("[tenants.session]\nrequests_per_minute = 1");
        assert!(layer.limits("t", Some("a"), None).await.is_ok());
        let err = layer
            .limits("t", Some("a"), None)
            .await
            .err()
            .expect("limited");
        assert_eq!(err.code().as_str(), "rate_limited");
        assert_eq!(err.retry_after(), Some(Duration::from_secs(60)));
        assert!(
            err.to_string().contains("session.requests_per_minute"),
            "{err}"
        );
        assert!(layer.limits("t", Some("b"), None).await.is_ok());
        assert!(
            layer.limits("t", None, None).await.is_ok(),
            "without a session only the tenant's rate counts"
        );
    }

    #[tokio::test]
    async fn a_sessions_slot_is_held_until_dropped() {
        let layer = layer("[tenants.session]\nmax_concurrent = 1");
        let first = layer.limits("t", Some("s"), None).await.expect("admitted");
        assert!(
            first.slot.is_some(),
            "a session under max_concurrent holds a slot"
        );
        let err = layer
            .limits("t", Some("s"), None)
            .await
            .err()
            .expect("busy");
        assert_eq!(err.code().as_str(), "too_many_concurrent");
        assert_eq!(err.code().status(), 429);
        assert_eq!(err.retry_after(), None);
        assert!(layer.limits("t", Some("other"), None).await.is_ok());
        drop(first);
        let again = layer.limits("t", Some("s"), None).await.expect("freed");
        assert!(again.slot.is_some());
        let unsessioned = layer.limits("t", None, None).await.expect("admitted");
        assert!(unsessioned.slot.is_none(), "no session, no slot");
    }

    #[tokio::test]
    async fn an_unlimited_or_unknown_tenant_passes_holding_nothing() {
        let layer = layer("");
        for tenant in ["t", "nobody"] {
            let admitted = layer.limits(tenant, Some("s"), None).await.expect("passes");
            assert!(admitted.slot.is_none() && admitted.prepaid.is_none());
        }
    }
}
