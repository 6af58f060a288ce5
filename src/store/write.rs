//! The writes a store queues for its writer, which commits them in batches (group
//! commit): one list for both the SQLite and the PostgreSQL writer, so a write means the
//! same on either.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::{
    Charge, GuardRecord, JournalRecord, OwnerRecord, QueuedSettle, ReservationRecord,
    StoredResponse,
};

pub(crate) enum Op {
    Reserve(ReservationRecord),
    /// Appends a ledger row and, for a durable reservation, deletes it, atomically.
    Settle {
        reservation: Option<i64>,
        charge: Charge,
    },
    ResetSession {
        tenant: String,
        session: String,
        at_ms: i64,
    },
    Remember(StoredResponse),
    QueueSettle(QueuedSettle),
    UnqueueSettle(String),
    RecordOwners(Vec<OwnerRecord>),
    SaveGuard(GuardRecord),
    ClearGuard {
        tenant: String,
        session: String,
    },
    /// Journal entries of one session, then its newest `max_entries` kept.
    Journal {
        tenant: String,
        session: String,
        records: Vec<JournalRecord>,
        max_entries: usize,
    },
    Purge {
        now_ms: i64,
    },
    /// Deletes a reservation whose call was refused after its write failed: the write
    /// may have landed all the same (its acknowledgement lost with the connection).
    Unreserve(i64),
}

impl Op {
    /// The `op` label of `backstop_store_errors_total`.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Op::Reserve(_) | Op::Unreserve(_) => "reserve",
            Op::Settle { .. } => "settle",
            Op::ResetSession { .. } => "reset_session",
            Op::Remember(_) => "remember",
            Op::QueueSettle(_) | Op::UnqueueSettle(_) => "queued_settle",
            Op::RecordOwners(_) => "owners",
            Op::SaveGuard(_) | Op::ClearGuard { .. } => "guard",
            Op::Journal { .. } => "journal",
            Op::Purge { .. } => "purge",
        }
    }
}

type Ack = oneshot::Sender<Result<(), Arc<str>>>;

pub(crate) struct Write {
    pub(crate) op: Op,
    pub(crate) ack: Option<Ack>,
}
