//! Backstop: a reverse proxy between AI agents and model APIs that keeps agent failures
//! cheap. The request pipeline is ordered in [`app`]; each concern is a tower layer in
//! [`layers`]; errors become responses in [`error::respond`].
#![forbid(unsafe_code)]
#![warn(rust_2018_idioms)]

pub mod admin;
pub mod api;
pub mod app;
pub mod billing;
pub mod clock;
pub mod config;
pub mod demo;
pub mod error;
pub mod layers;
pub mod mock;
pub mod otel;
pub mod policy;
pub mod prices;
pub mod reload;
pub mod report;
pub mod routing;
pub mod server;
pub mod state;
pub mod store;
pub mod telemetry;
pub mod translate;
pub mod upstream;
pub mod validation;
pub mod wire;
