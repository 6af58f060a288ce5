//! Each layer inside the context layer, tested as a layer: built by its public
//! constructor around a scripted inner service ([`crate::common::layer`]) and called
//! with `ServiceExt::oneshot`, in process (no socket, no server). A test states the
//! call it cares about, the inner service's answers, and asserts the exact status or
//! error, the headers, how many requests reached the inner service and what they were.
//!
//! The gateway-level tests (`idempotency::`, `recovery::`, `translate::`, ...) keep
//! testing the whole stack over the mock; these pin each layer's own contract.

mod admission;
mod idempotency;
mod meter;
mod owners;
mod recovery;
mod translate;
mod validate;
