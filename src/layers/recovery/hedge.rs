//! Hedging (`hedge_after`): when the first target has not answered in time, the next
//! healthy target is asked too, and the first success wins.

use std::time::Duration;

use tower::Service;

use super::{Answered, RecoveryLayer, Run, Unanswered};
use crate::{
    config::HedgeAfter,
    layers::{
        context::{Call, TargetIndex},
        meter::Billed,
    },
    policy::trail::Step,
    telemetry::Trail,
    upstream::{AttemptError, Reply},
};

/// The trail of either outcome.
fn trail_of(result: &mut Result<Answered, Unanswered>) -> &mut Trail {
    match result {
        Ok(answered) => &mut answered.trail,
        Err(unanswered) => &mut unanswered.trail,
    }
}

impl RecoveryLayer {
    /// The first run, and after `after` without an answer a second from target `to`.
    pub(super) async fn hedged<S>(
        &self,
        run: impl Fn(S) -> Run<S>,
        inner: S,
        call: Call,
        after: Duration,
        to: TargetIndex,
    ) -> Result<Answered, Unanswered>
    where
        S: Service<Billed, Response = Reply, Error = AttemptError> + Clone + Send + 'static,
        S::Future: Send + 'static,
    {
        // The first run, and after `after` without an answer a second from the next
        // healthy target: the first success wins and the other is dropped (its attempt
        // is cancelled and charged as any unfinished attempt is).
        let mut hedged = call.clone();
        hedged.start = to;
        let first = run(inner.clone()).recover(call.clone());
        tokio::pin!(first);
        tokio::select! {
            result = &mut first => return result,
            _ = tokio::time::sleep(after) => {}
        }
        let name = call.route.targets[to.0].upstream.name.clone();
        metrics::counter!("backstop_hedges_total", "to" => name.to_string()).increment(1);
        let second = run(inner).recover(hedged);
        tokio::pin!(second);
        let won = |r: &Result<Answered, Unanswered>| {
            r.as_ref().is_ok_and(|a| a.reply.status.is_success())
        };
        // The first to succeed; else both ran to their end, and the first to end answers.
        let (mut result, other) = tokio::select! {
            result = &mut first => if won(&result) { (result, None) } else {
                (result, Some(second.await))
            },
            result = &mut second => if won(&result) { (result, None) } else {
                (result, Some(first.await))
            },
        };
        let mut trail = Trail {
            steps: vec![Step::Hedge(name)],
            ..Trail::default()
        };
        // The trails of the runs that ended, in the order they ended.
        trail.then(std::mem::take(trail_of(&mut result)));
        if let Some(mut other) = other {
            trail.then(std::mem::take(trail_of(&mut other)));
            if won(&other) {
                result = other;
            }
        }
        *trail_of(&mut result) = trail;
        result
    }

    /// How long the first target may take before the hedge: fixed, or the percentile of
    /// its recent answer times (`None`, no hedge, until it has enough of them).
    pub(super) fn hedge_delay(&self, call: &Call, after: HedgeAfter) -> Option<Duration> {
        match after {
            HedgeAfter::After(delay) => Some(delay),
            HedgeAfter::Percentile(q) => self
                .health
                .get(&call.route.targets.get(call.start.0)?.upstream.name)?
                .latency_quantile(q, HedgeAfter::MIN_SAMPLES)
                .map(|d| d.max(Duration::from_millis(1))),
        }
    }

    /// Where a hedge goes: the first target after the call's start that speaks its API
    /// and whose breaker is closed.
    pub(super) fn hedge_target(&self, call: &Call) -> Option<TargetIndex> {
        let caller = call.endpoint().wire();
        call.route
            .targets
            .iter()
            .enumerate()
            .skip(call.start.0 + 1)
            .find(|(_, t)| {
                t.wire(&call.request.model, caller) == caller
                    && self
                        .health
                        .get(&t.upstream.name)
                        .is_some_and(|h| h.is_closed())
            })
            .map(|(i, _)| TargetIndex(i))
    }
}
