//! The first attempt's reservation, made in the gate's round trip (replica mode): what
//! the meter would reserve for the route's first target, handed to the attempt through
//! [`Call::prepaid`] and given back uncharged if no attempt asks for it.

use super::AdmissionLayer;
use crate::{
    layers::{
        context::Call,
        meter::{self, HeldContext},
    },
    routing::Target,
    state::budgets::reservation::Ask,
};

/// The target and model the request's first attempt goes to, if routing keeps the
/// route's first target (from [`Call::start`]) and its API, so the body goes as it came:
/// `None` for a target of the other API (the body is translated) and for a chained
/// Responses call (the owners layer looks up the previous response's size).
pub(super) fn first_target(call: &Call) -> Option<(&Target, &str)> {
    let request = &call.request;
    let target = call.route.targets.get(call.start.0)?;
    let caller = request.endpoint.wire();
    if target.wire(&request.model, caller) != caller || request.refs.previous_response.is_some() {
        return None;
    }
    Some((target, target.model_for(&request.model)))
}

impl AdmissionLayer {
    /// What the request's first attempt will reserve ([`first_target`]), asked of the
    /// gate only where the gate reserves ([`Budgets::prepays_for`]: replica mode, a cap to
    /// reserve against), so other calls make no [`Ask`].
    ///
    /// [`Budgets::prepays_for`]: crate::state::budgets::Budgets::prepays_for
    pub(super) fn first_ask(&self, call: &Call) -> Option<Ask> {
        if !self
            .budgets
            .prepays_for(&call.tenant, call.session.is_some())
        {
            return None;
        }
        let (target, model) = first_target(call)?;
        let held = HeldContext {
            tokens: 0,
            unsized_context: call.request.refs.unsized_context,
        };
        Some(meter::ask(
            &self.budgets,
            &call.tenant,
            model,
            target.wire(&call.request.model, call.request.endpoint.wire()),
            &call.request,
            held,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{
        super::tests::{call, call_at, layer_on, CHAT},
        *,
    };
    use crate::{api::Endpoint, layers::context::TargetIndex};

    /// A route whose first target is the caller's API and rewrites the model, and whose
    /// second is the other API.
    const ROUTES: &str = r#"
        [[upstreams]]
        name = "o"
        api = "openai"
        base_url = "http://127.0.0.1:1"
        [[upstreams]]
        name = "a"
        api = "anthropic"
        base_url = "http://127.0.0.1:1"
        [[routes]]
        model = "gpt-*"
        targets = [{ upstream = "o", model = "gpt-4o-mini" }, { upstream = "a", model = "claude-x" }]
    "#;

    #[test]
    fn the_first_attempt_is_the_routes_first_target_of_the_callers_api() {
        let (_, routes) = layer_on(ROUTES, "");
        let call = call(&routes, Some("s"), CHAT);
        let (target, model) = first_target(&call).expect("the first target");
        assert_eq!(&*target.upstream.name, "o");
        assert_eq!(model, "gpt-4o-mini", "the target's model, not the caller's");
    }

    #[test]
    fn a_translated_first_attempt_is_not_reserved_ahead() {
        let (_, routes) = layer_on(ROUTES, "");
        let mut call = call(&routes, Some("s"), CHAT);
        call.start = TargetIndex(1);
        assert!(
            first_target(&call).is_none(),
            "anthropic target, openai body"
        );
        call.start = TargetIndex(2);
        assert!(first_target(&call).is_none(), "past the route's targets");
    }

    #[test]
    fn a_chained_responses_call_is_not_reserved_ahead() {
        let (_, routes) = layer_on(ROUTES, "");
        let body = r#"{"model":"gpt-4o","input":"hi","previous_response_id":"resp_1"}"#;
        let call = call_at(&routes, Endpoint::Responses, Some("s"), body);
        assert!(first_target(&call).is_none());
    }

    #[test]
    fn without_shared_state_the_gate_reserves_nothing() {
        // A capped session, but embedded mode: the meter reserves, not the gate.
        let (layer, routes) = layer_on("", "[tenants.session]\nmax_usd = 1.0");
        let call = call(&routes, Some("s"), CHAT);
        assert!(first_target(&call).is_some());
        assert!(layer.first_ask(&call).is_none());
    }
}
