//! One tower layer per concern. Their order is set in one place: [`crate::app`].

pub mod auth;
pub mod context;
pub mod deadline;
pub mod edge;
pub mod guard;
pub mod idempotency;
pub mod limits;
pub mod meter;
pub mod recovery;
pub mod respond;
pub mod validate;

/// Takes the service that `poll_ready` made ready, leaving a clone in its place: tower's
/// idiom for a service that must be called from inside a boxed future.
pub(crate) fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
