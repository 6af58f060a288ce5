//! What the admin API asks of a reload: the seam between the operator routes and the
//! live server ([`crate::reload`]), so the admin module needs nothing above it.

use std::{
    sync::Weak,
    time::{Duration, SystemTime},
};

use futures_util::future::BoxFuture;
use serde::Serialize;
use serde_json::{json, Value};

use super::AdminError;

/// Re-reads the config and swaps it in (`POST /admin/reload`), and says which config
/// is running.
pub trait Reload: Send + Sync {
    fn reload(&self) -> BoxFuture<'_, Result<Reloaded, AdminError>>;
    fn stamp(&self) -> ConfigStamp;
}

/// Which config is running: its version (1 at start, +1 per applied reload), when it was
/// loaded, and from where.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigStamp {
    pub version: u64,
    #[serde(serialize_with = "rfc3339")]
    pub loaded_at: SystemTime,
    pub source: Option<String>,
}

fn rfc3339<S: serde::Serializer>(at: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*at))
}

/// An applied reload.
#[derive(Debug, Clone)]
pub struct Reloaded {
    pub stamp: ConfigStamp,
    /// Keys that changed in the file but apply only after a restart (the running values
    /// are kept for them).
    pub restart_required: Vec<&'static str>,
    pub took: Duration,
}

impl Reloaded {
    pub fn to_json(&self) -> Value {
        json!({
            "reloaded": true,
            "config": self.stamp,
            "restart_required": self.restart_required,
            "took_ms": self.took.as_secs_f64() * 1e3,
        })
    }
}

/// A gateway built without a reloader (tests, embedding): reload answers 409.
struct NoReload;

impl Reload for NoReload {
    fn reload(&self) -> BoxFuture<'_, Result<Reloaded, AdminError>> {
        Box::pin(async { Err(AdminError::ReloadUnavailable("no reloader")) })
    }
    fn stamp(&self) -> ConfigStamp {
        ConfigStamp {
            version: 1,
            loaded_at: SystemTime::UNIX_EPOCH,
            source: None,
        }
    }
}

/// A handle that never reaches a reloader.
pub fn no_reload() -> Weak<dyn Reload> {
    Weak::<NoReload>::new()
}
