//! The listener and graceful shutdown: on SIGTERM/SIGINT (or a handle's `shutdown`),
//! stop accepting, report not-ready, let in-flight requests finish for up to
//! `server.shutdown_grace`, then stop.

use std::{future::IntoFuture, net::SocketAddr, sync::atomic::Ordering};

use axum::serve::ListenerExt;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    app::{router, AppState},
    config::Config,
};

/// A running server.
pub struct ServerHandle {
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
    mock: Option<crate::mock::MockHandle>,
}

impl ServerHandle {
    /// Begins a graceful shutdown and waits for it to complete.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
        if let Some(mock) = self.mock {
            mock.shutdown();
        }
    }
}

/// Binds `server.listen` (port 0 picks a free port), starts the built-in mock when
/// `[mock]` asks for it, and serves until shut down.
pub async fn spawn(config: Config) -> std::io::Result<ServerHandle> {
    let mock = match &config.mock {
        Some(m) => Some(crate::mock::spawn(TcpListener::bind(m.listen).await?)),
        None => None,
    };
    let listener = TcpListener::bind(config.server.listen).await?;
    let addr = listener.local_addr()?;
    let grace = config.server.shutdown_grace;
    let state = AppState::new(config).map_err(std::io::Error::other)?;
    let budgets = state.budgets.clone();
    let housekeeping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
        loop {
            tick.tick().await;
            budgets.forget_idle_limiters();
        }
    });
    let ready = state.ready.clone();
    let app = router(state);
    let (tx, mut rx) = watch::channel(false);
    let mut grace_rx = rx.clone();
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
        let _ = rx.wait_for(|stop| *stop).await;
    });
    let stopping = ready.clone();
    let task = tokio::spawn(async move {
        let serve = std::pin::pin!(serve.into_future());
        let bounded = async {
            let _ = grace_rx.wait_for(|stop| *stop).await;
            stopping.store(false, Ordering::Relaxed);
            tracing::info!(
                grace_ms = grace.as_millis() as u64,
                "shutting down: draining in-flight requests"
            );
            tokio::time::sleep(grace).await;
        };
        let _housekeeping = AbortOnDrop(housekeeping);
        tokio::select! {
            result = serve => {
                if let Err(err) = result {
                    tracing::error!(error = %err, "server stopped with an error");
                }
            }
            () = bounded => tracing::warn!("shutdown grace elapsed; cutting remaining requests"),
        }
    });
    ready.store(true, Ordering::Relaxed);
    tracing::info!(%addr, "backstop listening");
    Ok(ServerHandle {
        addr,
        shutdown: tx,
        task,
        mock,
    })
}

/// Stops a background task when its owner ends.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
