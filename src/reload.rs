//! Config reload without a restart (`SIGHUP`, `POST /admin/reload`).
//!
//! The server serves every request from the current [`Generation`]: the routes and the
//! state built from one config. A reload reads and validates the file as `check-config`
//! does, builds the next generation from it over the same live state
//! ([`AppState::reconfigured`]: spend, sessions, trips, breakers and idempotency carry
//! on for every name that stays), and swaps it in atomically. A request holds the
//! generation it started under until its response (and stream) is done, so in-flight
//! work finishes under the old config while new requests see the new one. An invalid
//! file changes nothing.
//!
//! Some keys are bound at start-up: the listener, the store, the shared state, the
//! built-in mock, logging, the connection limits and the runtime's workers. A reload that
//! changes them keeps the running values, applies the rest, and names them as needing a
//! restart.

use std::{
    sync::{Arc, RwLock, Weak},
    time::SystemTime,
};

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::{
    admin::{AdminError, ConfigStamp, Reload, Reloaded},
    app::{router_with, App, AppState},
    config::Config,
    error::GatewayError,
};

/// One config's routes and state.
pub struct Generation {
    pub app: App,
    pub state: AppState,
    pub stamp: ConfigStamp,
}

/// The generation being served, and the one way to replace it.
pub struct Live {
    current: RwLock<Arc<Generation>>,
    /// One reload at a time: two at once would both build on the same old generation.
    reloading: tokio::sync::Mutex<()>,
    this: Weak<Live>,
}

impl Live {
    /// Serves `state` as generation 1.
    pub fn new(state: AppState) -> Arc<Live> {
        Arc::new_cyclic(|this: &Weak<Live>| {
            let stamp = ConfigStamp {
                version: 1,
                loaded_at: SystemTime::now(),
                source: source(&state.config),
            };
            metrics::gauge!("backstop_config_version").set(1.0);
            Live {
                current: RwLock::new(Arc::new(generation(state, this.clone(), stamp))),
                reloading: tokio::sync::Mutex::new(()),
                this: this.clone(),
            }
        })
    }

    /// The generation new requests are served by.
    pub fn current(&self) -> Arc<Generation> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Re-reads the config file and swaps it in; on an invalid file, the running config
    /// is kept and the errors returned.
    pub async fn reload(&self) -> Result<Reloaded, AdminError> {
        let _one = self.reloading.lock().await;
        let started = Instant::now();
        let running = self.current();
        let Some(path) = running.state.config.source.clone() else {
            return Err(AdminError::ReloadUnavailable(
                "the config did not come from a file",
            ));
        };
        let loaded = tokio::task::spawn_blocking(move || Config::load(path))
            .await
            .map_err(|_| AdminError::from(GatewayError::Internal))?;
        let mut config = match loaded {
            Ok(config) => config,
            Err(err) => {
                metrics::counter!("backstop_config_reloads_total", "outcome" => "invalid")
                    .increment(1);
                tracing::error!(error = %err, version = running.stamp.version, "config reload refused: the file is invalid; the running config is kept");
                return Err(AdminError::ConfigInvalid(err.to_string()));
            }
        };
        let restart_required = keep_start_up_keys(&running.state.config, &mut config);
        let stamp = ConfigStamp {
            version: running.stamp.version + 1,
            loaded_at: SystemTime::now(),
            source: source(&config),
        };
        let state = running.state.reconfigured(config);
        let next = Arc::new(generation(state, self.this.clone(), stamp.clone()));
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
        let took = started.elapsed();
        metrics::counter!("backstop_config_reloads_total", "outcome" => "applied").increment(1);
        metrics::gauge!("backstop_config_version").set(stamp.version as f64);
        if restart_required.is_empty() {
            tracing::info!(
                version = stamp.version,
                took_ms = took.as_secs_f64() * 1e3,
                "config reloaded"
            );
        } else {
            tracing::warn!(version = stamp.version, took_ms = took.as_secs_f64() * 1e3, restart_required = ?restart_required, "config reloaded; some changes apply only after a restart");
        }
        Ok(Reloaded {
            stamp,
            restart_required,
            took,
        })
    }
}

impl Reload for Live {
    fn reload(&self) -> BoxFuture<'_, Result<Reloaded, AdminError>> {
        Box::pin(Live::reload(self))
    }

    fn stamp(&self) -> ConfigStamp {
        self.current().stamp.clone()
    }
}

fn generation(state: AppState, live: Weak<Live>, stamp: ConfigStamp) -> Generation {
    let app = router_with(state.clone(), live);
    Generation { app, state, stamp }
}

fn source(config: &Config) -> Option<String> {
    config.source.as_ref().map(|p| p.display().to_string())
}

/// Puts the running values back into `next` for the keys bound at start-up, and names
/// those that the file changed.
fn keep_start_up_keys(running: &Config, next: &mut Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    macro_rules! keep {
        ($($key:literal => $($field:ident).+),* $(,)?) => {$(
            if running.$($field).+ != next.$($field).+ {
                changed.push($key);
                next.$($field).+ = running.$($field).+.clone();
            }
        )*};
    }
    keep! {
        "server.listen" => server.listen,
        "server.max_connections" => server.max_connections,
        "server.header_read_timeout" => server.header_read_timeout,
        "server.idle_timeout" => server.idle_timeout,
        "server.drain_delay" => server.drain_delay,
        "server.shutdown_grace" => server.shutdown_grace,
        "server.workers" => server.workers,
        "store" => store,
        "state" => state,
        "mock" => mock,
        "log" => log,
        "telemetry" => telemetry,
    }
    changed
}
