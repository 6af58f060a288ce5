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
