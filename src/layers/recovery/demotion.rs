//! Outlier demotion: a target failing far more than its peers (a brownout its breaker
//! does not see) is tried after them.

use std::collections::VecDeque;

use tokio::time::Instant;

use super::{Run, Visit};
use crate::{policy::outlier, state::health::UpstreamHealth};

impl<S> Run<S> {
    /// Moves targets failing far more than their peers (a brownout the breaker does not
    /// see) behind them, keeping the route's order otherwise.
    pub(super) fn demote_outliers(&self, queue: &mut VecDeque<Visit<'_>>) {
        let now = Instant::now();
        let healths: Vec<Option<&UpstreamHealth>> = queue
            .iter()
            .map(|v| self.health.get(&v.target.upstream.name))
            .collect();
        let recent: Vec<(f64, f64)> = healths
            .iter()
            .map(|h| h.map_or((0.0, 0.0), |h| h.recent(now)))
            .collect();
        let demoted = outlier::demoted(&recent);
        for ((health, demote), (attempts, _)) in healths.iter().zip(&demoted).zip(&recent) {
            if let Some(health) = health {
                health.judged_outlier(*demote, *attempts);
            }
        }
        if !demoted.contains(&true) {
            return;
        }
        let (front, back): (Vec<_>, Vec<_>) = queue
            .drain(..)
            .zip(demoted)
            .partition(|(_, demote)| !demote);
        for (visit, _) in &back {
            metrics::counter!("backstop_outlier_demotions_total", "upstream" => visit.target.upstream.name.to_string()).increment(1);
        }
        queue.extend(front.into_iter().chain(back).map(|(visit, _)| visit));
    }
}
