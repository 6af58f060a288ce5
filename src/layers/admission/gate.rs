//! The gate's one round trip ([`Budgets::gate`]), typed: each concern puts its part in
//! one [`GateRequest`] and reads its part of the one [`GateReply`], so that in replica
//! mode a guarded, budgeted request reaches the upstream after exactly one round trip.
//!
//! - the limits ([`super::limits`]): the tenant and the session, whose request rates
//!   and concurrency slot the request counts against; they read whether it passed, and
//!   its slot ([`GateReply::admitted`]);
//! - the session guard ([`super::guard`]): its write-back (replica mode), written only
//!   if the limits let the request through; it reads how the write went
//!   ([`GateReply::saving`]);
//! - the first attempt's reservation ([`super::prepay`]): made in the same round trip
//!   if the request passes, read as [`Admitted::prepaid`].

use std::sync::Arc;

use crate::{
    api::request::{noted, Place},
    error::GatewayError,
    layers::context::Call,
    state::{
        budgets::{
            reservation::{Ask, Prepaid},
            Budgets, ConcurrencySlot, Gated, Refusal,
        },
        guard_view::Write,
        sessions::Saving,
        shared::GuardWrite,
    },
};

/// What one request asks of the gate.
pub(super) struct GateRequest<'a> {
    /// The limits' part: whose request rates (and, with a session, its concurrency).
    pub(super) tenant: &'a str,
    pub(super) session: Option<&'a str>,
    /// The guard's part: its write-back, replica mode only.
    pub(super) guard: Option<GuardWrite>,
    /// The reservation's part: the first attempt's, replica mode only.
    pub(super) prepay: Option<&'a Ask>,
}

impl<'a> GateRequest<'a> {
    /// The limits' part alone.
    pub(super) fn limits(tenant: &'a str, session: Option<&'a str>) -> Self {
        GateRequest {
            tenant,
            session,
            guard: None,
            prepay: None,
        }
    }

    /// With the first attempt's reservation, if there is one to make.
    pub(super) fn prepaying(self, prepay: Option<&'a Ask>) -> Self {
        GateRequest { prepay, ..self }
    }

    /// With the guard's write-back, if there is one: the shared state outlives its last
    /// write by `ttl_ms`; `refuses` when the guard refuses the request (it takes no
    /// concurrency slot then).
    pub(super) fn guarding(self, write: Option<Write>, ttl_ms: u64, refuses: bool) -> Self {
        let guard = write.map(|write| GuardWrite {
            write,
            ttl_ms,
            refuses,
        });
        GateRequest { guard, ..self }
    }

    /// The one round trip.
    pub(super) async fn send(self, budgets: &Arc<Budgets>) -> GateReply {
        let written = self.guard.is_some();
        let reply = budgets
            .gate(self.tenant, self.session, self.guard, self.prepay)
            .await;
        GateReply { written, reply }
    }
}

/// The gate's one reply.
pub(super) struct GateReply {
    /// A guard write-back was asked for.
    written: bool,
    reply: Result<Gated, Refusal>,
}

impl GateReply {
    /// The limits' part (with the reservation): let through, or refused. A moved guard
    /// write is not the limits' to read (only a guard write can be moved, and then
    /// nothing was spent).
    pub(super) fn admitted(self) -> Result<Admitted, GatewayError> {
        match self.reply? {
            Gated::Passed { slot, prepaid, .. } => Ok(Admitted {
                slot,
                prepaid,
                guided: None,
            }),
            Gated::Moved(..) => Ok(Admitted::default()),
        }
    }

    /// The guard's part, with the limits' verdict: written (from and to which
    /// versions), moved (another replica wrote first: its version and state), undone
    /// (the limits refused the request before the guard counted it), or not written
    /// (none asked, or Redis unreachable: this replica's guard decided).
    pub(super) fn saving(self) -> Saving<Result<Admitted, Refusal>> {
        match self.reply {
            Ok(Gated::Passed {
                slot,
                guard: Some(versions),
                prepaid,
            }) if self.written => Saving::Saved(
                versions,
                Ok(Admitted {
                    slot,
                    prepaid,
                    guided: None,
                }),
            ),
            Ok(Gated::Passed { slot, prepaid, .. }) => Saving::Local(Ok(Admitted {
                slot,
                prepaid,
                guided: None,
            })),
            Ok(Gated::Moved(version, state)) => Saving::Moved(version, state),
            Err(refusal) => Saving::Undone(Err(refusal)),
        }
    }
}

/// What the gate let a request through with.
#[derive(Default)]
pub(super) struct Admitted {
    /// Its place under the session's `max_concurrent`, held until its body ends.
    pub(super) slot: Option<ConcurrencySlot>,
    /// Its first attempt's reservation (replica mode).
    pub(super) prepaid: Option<Arc<Prepaid>>,
    /// The session's guard guides it: the note goes with the request.
    pub(super) guided: Option<Guidance>,
}

/// A guided request's note, and the loop rule it is for.
pub(super) struct Guidance {
    pub(super) note: String,
    pub(super) rule: &'static str,
}

impl Admitted {
    /// The reservation goes with the call to its attempts, and a guided request's note
    /// in the request, after its last message where the API allows (never in the
    /// client's stream); the slot stays here. The guided rule, for the trace.
    pub(super) fn hand_over(
        self,
        call: &mut Call,
    ) -> (Option<ConcurrencySlot>, Option<&'static str>) {
        call.prepaid = self.prepaid;
        let rule = self.guided.map(|guided| {
            let json = noted(
                call.endpoint(),
                &call.request.json,
                &guided.note,
                Place::Last,
            );
            *call = call.with_json(json);
            guided.rule
        });
        (self.slot, rule)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::state::guard_view::{Joined, Written};

    fn join() -> Write {
        Write::Join(Joined {
            at_ms: 1_000,
            request: 7,
            limit: 3,
            since_ms: 0,
        })
    }

    fn passed(guard: Option<Written>) -> Result<Gated, Refusal> {
        Ok(Gated::Passed {
            slot: None,
            guard,
            prepaid: None,
        })
    }

    const VERSIONS: Written = Written { from: 4, to: 5 };

    #[test]
    fn the_limits_part_alone_asks_no_guard_write_and_no_reservation() {
        let ask = GateRequest::limits("t", Some("s"));
        assert_eq!((ask.tenant, ask.session), ("t", Some("s")));
        assert!(ask.guard.is_none() && ask.prepay.is_none());
        let ask = ask.prepaying(None).guarding(None, 600_000, true);
        assert!(
            ask.guard.is_none(),
            "no write-back to carry: the gate is asked for none"
        );
    }

    #[test]
    fn the_guards_part_carries_its_write_ttl_and_whether_it_refuses() {
        let ask = GateRequest::limits("t", Some("s")).guarding(Some(join()), 600_000, true);
        let guard = ask.guard.expect("a write-back");
        assert_eq!(guard.write, join());
        assert_eq!(guard.ttl_ms, 600_000);
        assert!(guard.refuses, "a refused request takes no slot");
        let ask = GateRequest::limits("t", Some("s")).guarding(Some(join()), 1, false);
        assert!(!ask.guard.unwrap().refuses);
    }

    #[test]
    fn the_guard_reads_its_write_only_when_it_asked_for_one() {
        let saved = GateReply {
            written: true,
            reply: passed(Some(VERSIONS)),
        };
        assert!(matches!(saved.saving(), Saving::Saved(VERSIONS, Ok(_))));
        // Passed without versions (Redis unreachable): this replica's guard decided.
        let local = GateReply {
            written: true,
            reply: passed(None),
        };
        assert!(matches!(local.saving(), Saving::Local(Ok(_))));
        let unasked = GateReply {
            written: false,
            reply: passed(Some(VERSIONS)),
        };
        assert!(matches!(unasked.saving(), Saving::Local(Ok(_))));
        let moved = GateReply {
            written: true,
            reply: Ok(Gated::Moved(9, "state".into())),
        };
        assert!(matches!(moved.saving(), Saving::Moved(9, s) if s == "state"));
    }

    #[test]
    fn a_limits_refusal_undoes_the_guards_update_and_refuses_with_its_own_code() {
        let limited = || Refusal::RateLimited {
            scope: "session.requests_per_minute",
            retry_after: Duration::from_secs(2),
        };
        let reply = GateReply {
            written: true,
            reply: Err(limited()),
        };
        assert!(matches!(reply.saving(), Saving::Undone(Err(r)) if r == limited()));
        let reply = GateReply {
            written: false,
            reply: Err(limited()),
        };
        let err = reply.admitted().err().expect("refused");
        assert_eq!(err.code().as_str(), "rate_limited");
        assert_eq!(err.retry_after(), Some(Duration::from_secs(2)));
        let busy = GateReply {
            written: false,
            reply: Err(Refusal::TooManyConcurrent { limit: 2 }),
        };
        let err = busy.admitted().err().expect("refused");
        assert_eq!(err.code().as_str(), "too_many_concurrent");
        assert_eq!(
            err.to_string(),
            "session.max_concurrent exceeded: 2 requests already in flight"
        );
    }

    #[test]
    fn the_limits_read_a_moved_guard_write_as_nothing_held() {
        let moved = GateReply {
            written: true,
            reply: Ok(Gated::Moved(3, String::new())),
        };
        let admitted = moved.admitted().expect("not a refusal");
        assert!(admitted.slot.is_none() && admitted.prepaid.is_none());
    }
}
