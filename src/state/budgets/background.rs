//! Background Responses (`background: true`): the create answers at once, `queued`,
//! without usage; what the call cost appears only later, on `GET /v1/responses/{id}`, a
//! stream resume (`?stream=true`) or a cancel. The create's reservation is held here
//! under the response id until then, and settled once, to the usage that first appears,
//! against the session and tenant that created it. Until then the reservation counts
//! against their caps; a response nobody fetches again keeps it (a held reservation
//! dropped with the process is charged in full: never less than may have been spent).
//! `billing.background = "refuse"` refuses background creates for USD-capped tenants
//! and sessions instead.

use std::{collections::HashMap, sync::Mutex};

use super::reservation::{Outcome, Reservation};

/// Held reservations at most: past it, a new background create is charged its
/// reservation at once (never less than it may cost), with a warning.
const MAX_HELD: usize = 100_000;

#[derive(Default)]
pub struct BackgroundHolds {
    held: Mutex<HashMap<String, Reservation>>,
}

impl BackgroundHolds {
    /// Holds `reservation` until response `id`'s usage appears.
    pub fn hold(&self, id: String, reservation: Reservation) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if held.len() >= MAX_HELD {
            drop(held);
            tracing::warn!(
                response = %id,
                max = MAX_HELD,
                "too many background responses waiting for their usage; this one is charged its reservation now"
            );
            reservation.settle_later(Outcome::Unreported);
            return;
        }
        metrics::gauge!("backstop_background_held").set((held.len() + 1) as f64);
        held.insert(id, reservation);
    }

    /// The reservation held for response `id`, once: the first answer that carries the
    /// response's final usage settles it.
    pub fn take(&self, id: &str) -> Option<Reservation> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let taken = held.remove(id);
        metrics::gauge!("backstop_background_held").set(held.len() as f64);
        taken
    }

    /// Reservations held now.
    pub fn len(&self) -> usize {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
