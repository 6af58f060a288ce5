//! Waiting for background work by its effect: a poll with a deadline, never a fixed sleep
//! that is too short on a loaded machine and too long everywhere else.
#![allow(dead_code)]

use std::{future::Future, time::Duration};

/// How long a poll waits before it fails the test: far beyond any healthy wait, so only
/// a condition that never comes true fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Polls `check` until it returns `Some`, and returns that; panics naming `what` after
/// [`PATIENCE`].
pub async fn until_some<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {PATIENCE:?} for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls `check` until it is true; panics naming `what` after [`PATIENCE`].
pub async fn until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    until_some(what, || {
        let done = check();
        async move { done.await.then_some(()) }
    })
    .await
}
