//! A session's live budget book: what the session has settled and holds, as this replica
//! knows it. The budget logic is [`crate::state::budgets`]; this is the record it keeps in
//! the session's [`super::Session`].

use std::sync::{atomic::AtomicU32, Mutex};

use crate::policy::budget::Account;

/// One session's live state.
pub struct SessionBook {
    pub(in crate::state) account: Mutex<Account>,
    pub(in crate::state) in_flight: AtomicU32,
}

impl SessionBook {
    /// A session whose ledger could not be read: nothing settled that this replica
    /// knows of.
    pub(in crate::state) fn unread() -> SessionBook {
        SessionBook {
            account: Mutex::new(Account::default()),
            in_flight: AtomicU32::new(0),
        }
    }
}
