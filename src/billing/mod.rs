//! Money as the provider bills it: the typed usage record ([`Tokens`]), prices with
//! every dimension providers bill ([`Price`]), the built-in dated catalog
//! ([`catalog`]), and the provider's own token rules for media a prompt carries
//! ([`media`]), so that a reservation is a worst case and no more. Pure: nothing here
//! does I/O or knows a request, a tenant or a store.

pub mod catalog;
pub mod media;
pub mod price;
mod prices;
mod usage;

pub use price::{Price, Source};
pub use prices::Prices;
pub use usage::{CacheTtl, Tokens};
