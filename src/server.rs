//! The listener and graceful shutdown.
//!
//! Connections are held to `[server]` limits, so idle or slow sockets cannot starve the
//! gateway of file descriptors:
//! - `max_connections`, lowered at start to what the open files limit can hold (see
//!   `server/descriptors.rs`): beyond it a new connection is answered 503 as soon as its request
//!   head is in, and closed;
//! - `header_read_timeout`: a new connection must deliver its first request head this
//!   soon, and a keep-alive connection must finish a request head this soon after its
//!   first byte (slowloris);
//! - `idle_timeout`: a keep-alive connection with nothing in flight and no traffic is
//!   closed;
//! - accept errors (EMFILE when descriptors run out) back off instead of spinning.
//!
//! Shutdown (SIGTERM/SIGINT or a handle's `shutdown`): `/readyz` answers 503 at once while
//! Backstop keeps accepting and serving for `drain_delay`, so a load balancer sees it
//! draining; then the listener closes, idle connections close, and in-flight requests
//! get `shutdown_grace`. Streams still open then end with an error event in their API's
//! format (`server_shutting_down`) before their connections are dropped.

use std::{
    collections::VecDeque,
    convert::Infallible,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
    service::TowerToHyperService,
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore},
    task::{JoinHandle, JoinSet},
    time::Instant,
};
use tower::{Service, ServiceExt};

use crate::{
    admin::{AdminError, Reloaded},
    app::AppState,
    clock::Clock,
    config::{Config, ServerConfig},
    reload::{Generation, Live},
    store,
};

mod descriptors;

/// A running server.
pub struct ServerHandle {
    pub addr: SocketAddr,
    live: Arc<Live>,
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

    /// Re-reads the config file and swaps it in, as `SIGHUP` and `POST /admin/reload` do.
    pub async fn reload(&self) -> Result<Reloaded, AdminError> {
        self.live.reload().await
    }

    /// The generation serving new requests now.
    pub fn current(&self) -> Arc<Generation> {
        self.live.current()
    }

    /// Begins a graceful shutdown without waiting for it (`/readyz` turns 503 at once).
    pub fn begin_shutdown(&self) {
        let _ = self.shutdown.send(true);
    }
}

/// Binds `server.listen` (port 0 picks a free port), starts the built-in mock when
/// `[mock]` asks for it, and serves until shut down.
pub async fn spawn(config: Config) -> io::Result<ServerHandle> {
    spawn_with_clock(config, Clock::system()).await
}

/// As [`spawn`], with the live state on `clock` (tests move it with [`Clock::skip`]).
pub async fn spawn_with_clock(config: Config, clock: Clock) -> io::Result<ServerHandle> {
    let cap = connection_cap(&config);
    let mock = match &config.mock {
        Some(m) => Some(crate::mock::spawn(TcpListener::bind(m.listen).await?)),
        None => None,
    };
    let listener = TcpListener::bind(config.server.listen).await?;
    let addr = listener.local_addr()?;
    let limits = config.server.clone();
    let state = AppState::with_clock(config, clock)
        .await
        .map_err(io::Error::other)?;
    let purger = store::spawn_purger(state.store.clone(), state.clock.clone(), store::PURGE_EVERY);
    let ready = state.ready.clone();
    let live = Live::new(state);
    let idle = live.clone();
    let housekeeping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(60));
        loop {
            tick.tick().await;
            idle.current().state.budgets.forget_idle_limiters();
        }
    });
    let (tx, rx) = watch::channel(false);
    let served = live.clone();
    let task = tokio::spawn(async move {
        let _housekeeping = (AbortOnDrop(housekeeping), AbortOnDrop(purger));
        serve(listener, served, limits, cap, rx).await;
    });
    ready.store(true, Ordering::Relaxed);
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    metrics::gauge!("backstop_runtime_workers").set(workers as f64);
    tracing::info!(%addr, workers, "backstop listening");
    Ok(ServerHandle {
        addr,
        live,
        shutdown: tx,
        task,
        mock,
    })
}

/// The accept loop, then the drain.
async fn serve(
    listener: TcpListener,
    live: Arc<Live>,
    limits: ServerConfig,
    cap: usize,
    mut stop: watch::Receiver<bool>,
) {
    // Shared by every generation: readiness and the end-of-grace signal.
    let state = live.current().state.clone();
    let limits = Arc::new(limits);
    let permits = Arc::new(Semaphore::new(cap));
    let idle = Arc::new(IdleConnections::default());
    let mut refusals = Refusals::new(cap, descriptors::REFUSAL_SLOTS);
    let (close_tx, close_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut backoff = ACCEPT_BACKOFF_MIN;
    let mut accept_until: Option<Instant> = None;
    loop {
        let draining = async {
            match accept_until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = signalled(&mut stop), if accept_until.is_none() => {
                state.ready.store(false, Ordering::Relaxed);
                tracing::info!(drain_ms = limits.drain_delay.as_millis() as u64, "shutting down: /readyz is 503, still serving");
                accept_until = Some(Instant::now() + limits.drain_delay);
            }
            () = draining => break,
            Some(_) = connections.join_next() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    match permits.clone().try_acquire_owned() {
                        Ok(permit) => {
                            let conn = Connection { live: live.clone(), limits: limits.clone(), idle: idle.clone(), _permit: permit };
                            connections.spawn(conn.run(tcp, close_rx.clone()));
                        }
                        // Full: an idle keep-alive connection makes room before a new
                        // client is refused (the oldest idle first).
                        Err(_) if idle.shed_oldest() => {
                            let conn = (live.clone(), limits.clone(), idle.clone(), permits.clone(), close_rx.clone());
                            connections.spawn(async move {
                                let (live, limits, idle, permits, close) = conn;
                                if let Ok(Ok(permit)) = tokio::time::timeout(SHED_WAIT, permits.acquire_owned()).await {
                                    Connection { live, limits, idle, _permit: permit }.run(tcp, close).await;
                                }
                            });
                        }
                        Err(_) => refusals.refuse(tcp),
                    }
                }
                Err(err) if is_per_connection(&err) => {}
                Err(err) => {
                    // EMFILE/ENFILE and the like: waiting lets connections close.
                    tracing::warn!(error = %err, backoff_ms = backoff.as_millis() as u64, "accept failed; backing off");
                    metrics::counter!("backstop_accept_errors_total").increment(1);
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
                }
            },
        }
    }
    drop(listener);
    state.ready.store(false, Ordering::Relaxed);
    let _ = close_tx.send(true);
    tracing::info!(
        grace_ms = limits.shutdown_grace.as_millis() as u64,
        connections = connections.len(),
        "listener closed: draining in-flight requests"
    );
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            connections = connections.len(),
            "shutdown grace elapsed; ending open streams"
        );
        let _ = state.cut_streams.send(true);
        // Long enough for the error events to be written, not for new work.
        let _ = tokio::time::timeout(Duration::from_millis(250), async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        connections.abort_all();
    }
    if let Some(traces) = &state.traces {
        traces.shutdown().await;
    }
}

/// Raises the open files limit and derives the connection cap from it, logging both.
fn connection_cap(config: &Config) -> usize {
    let open_files_limit = descriptors::raise_open_files_limit();
    let configured = config.server.max_connections;
    let per_connection = descriptors::per_connection(config.mock.is_some());
    let effective = descriptors::connection_cap(configured, open_files_limit, per_connection);
    if effective < configured {
        tracing::warn!(
            configured,
            effective,
            open_files_limit,
            per_connection,
            reserve = descriptors::RESERVE,
            "connection cap lowered below server.max_connections to fit the open files limit; raise the hard `ulimit -n` or lower server.max_connections"
        );
    } else {
        tracing::info!(configured, effective, open_files_limit, "connection cap");
    }
    effective
}

/// Resolves once the flag is set (or its sender is gone).
async fn signalled(flag: &mut watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Errors that concern only the connection being accepted: accept again at once.
fn is_per_connection(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Connections refused over the cap. Each gets its 503 once its request head is in (an
/// HTTP/1 client such as hyper drops a response that comes before its request), or
/// after [`REFUSAL_HEAD_WAIT`]; it is then read until the client closes, for at most
/// [`REFUSAL_LINGER`], since closing on unread bytes sends a reset that can destroy the
/// 503 before the client reads it. At most `slots` refusals wait at once, so that they
/// hold few descriptors: one more cuts the longest wait short (503 and close at once).
/// A refusal cut short keeps its descriptor until its task runs, and an accept loop that
/// outruns those tasks ran out of descriptors (a burst of idle connections over the cap,
/// under `ulimit -n 256`): once twice `slots` refusals are open (waiting, or cut short
/// and not yet closed), one more is answered and closed in the accept loop itself.
struct Refusals {
    cap: usize,
    slots: usize,
    waiting: VecDeque<oneshot::Sender<()>>,
    /// Refusal tasks not yet ended, each holding its connection's descriptor.
    open: Arc<AtomicUsize>,
}

/// One refusal task's share of [`Refusals::open`], given back when it ends.
struct OpenRefusal(Arc<AtomicUsize>);

impl Drop for OpenRefusal {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a refused connection may take to send its request head, and then to close.
const REFUSAL_HEAD_WAIT: Duration = Duration::from_millis(250);
const REFUSAL_LINGER: Duration = Duration::from_millis(250);
/// The most a refused connection is read of, head and body together.
const REFUSAL_READ_BYTES: usize = 64 * 1024;

impl Refusals {
    fn new(cap: usize, slots: usize) -> Self {
        Refusals {
            cap,
            slots,
            waiting: VecDeque::with_capacity(slots),
            open: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn refuse(&mut self, tcp: TcpStream) {
        metrics::counter!("backstop_connections_refused_total").increment(1);
        self.waiting.retain(|refusal| !refusal.is_closed());
        if self.waiting.len() >= self.slots {
            if let Some(longest) = self.waiting.pop_front() {
                let _ = longest.send(());
            }
        }
        if self.open.load(Ordering::Acquire) >= 2 * self.slots {
            answer_now(tcp, self.cap, 0);
            return;
        }
        let (cut, cut_short) = oneshot::channel();
        self.waiting.push_back(cut);
        self.open.fetch_add(1, Ordering::AcqRel);
        let open = OpenRefusal(self.open.clone());
        let cap = self.cap;
        tokio::spawn(async move {
            let _open = open;
            refuse(tcp, cap, cut_short).await;
        });
    }
}

/// A refusal answered here and now, holding no descriptor after (one over the bound,
/// or one whose wait was cut short, `read` bytes of it read already): what has arrived
/// is read, without waiting for more (closing on unread bytes sends a reset that can
/// destroy the 503 before the client reads it), the 503 written to the socket's empty
/// buffer, the socket closed.
fn answer_now(tcp: TcpStream, cap: usize, mut read: usize) {
    use std::io::{Read, Write};

    let Ok(mut tcp) = tcp.into_std() else {
        return;
    };
    let mut sink = [0u8; 4096];
    while read < REFUSAL_READ_BYTES {
        match tcp.read(&mut sink) {
            Ok(n @ 1..) => read += n,
            _ => break,
        }
    }
    let _ = tcp.write_all(refusal(cap).as_bytes());
}

/// The 503 a connection over the cap gets.
fn refusal(cap: usize) -> String {
    let body = format!(
        r#"{{"error":{{"message":"too many open connections (at most {cap}); retry shortly","type":"server_error","code":"too_many_connections","param":null}}}}"#
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nx-should-retry: false\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One refusal: wait for the request head, answer 503, linger until the client closes.
async fn refuse(mut tcp: TcpStream, cap: usize, mut cut_short: oneshot::Receiver<()>) {
    use tokio::io::AsyncWriteExt;

    let mut read = 0;
    let mut sink = [0u8; 4096];
    let cut = tokio::select! {
        _ = tokio::time::timeout(REFUSAL_HEAD_WAIT, read_head(&mut tcp, &mut sink, &mut read)) => false,
        _ = &mut cut_short => true,
    };
    if cut {
        answer_now(tcp, cap, read);
        return;
    }
    let response = refusal(cap);
    let answered = tokio::time::timeout(REFUSAL_LINGER, async {
        tcp.write_all(response.as_bytes()).await?;
        tcp.shutdown().await
    })
    .await;
    if !matches!(answered, Ok(Ok(()))) {
        return;
    }
    tokio::select! {
        _ = tokio::time::timeout(REFUSAL_LINGER, drain(&mut tcp, &mut sink, &mut read)) => {}
        _ = cut_short => {}
    }
}

/// Reads until the end of a request head (a blank line), the client closes, or
/// [`REFUSAL_READ_BYTES`] in all.
async fn read_head(io: &mut (impl AsyncRead + Unpin), sink: &mut [u8], read: &mut usize) {
    use tokio::io::AsyncReadExt;

    let mut last4 = 0u32;
    while *read < REFUSAL_READ_BYTES {
        let n = match io.read(sink).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        *read += n;
        for &byte in &sink[..n] {
            last4 = (last4 << 8) | u32::from(byte);
            if last4 == u32::from_be_bytes(*b"\r\n\r\n") {
                return;
            }
        }
    }
}

/// Reads and drops until the client closes or [`REFUSAL_READ_BYTES`] in all.
async fn drain(io: &mut (impl AsyncRead + Unpin), sink: &mut [u8], read: &mut usize) {
    use tokio::io::AsyncReadExt;

    while *read < REFUSAL_READ_BYTES {
        match io.read(sink).await {
            Ok(0) | Err(_) => return,
            Ok(n) => *read += n,
        }
    }
}

/// How long a new client waits for the room an idle connection it displaced makes.
const SHED_WAIT: Duration = Duration::from_millis(250);

type Registry = std::collections::HashMap<u64, (Arc<Activity>, Arc<tokio::sync::Notify>)>;

/// Every open connection's activity, so that a full server closes an idle keep-alive
/// connection (nothing in flight, a request served) before it refuses a new client.
#[derive(Default)]
struct IdleConnections {
    open: std::sync::Mutex<Registry>,
    next: AtomicU64,
}

impl IdleConnections {
    fn register(&self, activity: Arc<Activity>) -> (u64, Arc<tokio::sync::Notify>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let shed = Arc::new(tokio::sync::Notify::new());
        self.lock().insert(id, (activity, shed.clone()));
        (id, shed)
    }

    fn forget(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the connection idle the longest to close; whether there was one.
    fn shed_oldest(&self) -> bool {
        let mut open = self.lock();
        let oldest = open
            .iter()
            .filter_map(|(id, (activity, _))| Some((activity.idle_at()?, *id)))
            .min();
        let Some((_, id)) = oldest else {
            return false;
        };
        // Off the registry at once: the next new client displaces another.
        if let Some((_, shed)) = open.remove(&id) {
            shed.notify_one();
        }
        metrics::counter!("backstop_connections_closed_total", "reason" => "shed_idle")
            .increment(1);
        true
    }
}

/// One accepted connection and what it holds.
struct Connection {
    live: Arc<Live>,
    limits: Arc<ServerConfig>,
    idle: Arc<IdleConnections>,
    _permit: OwnedSemaphorePermit,
}

impl Connection {
    async fn run(self, tcp: TcpStream, mut close: watch::Receiver<bool>) {
        let _ = tcp.set_nodelay(true);
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(Watched {
            inner: tcp,
            activity: activity.clone(),
        });
        let service = TowerToHyperService::new(Counted {
            live: self.live,
            activity: activity.clone(),
        });
        let (id, shed) = self.idle.register(activity.clone());
        let _registered = Forget(&self.idle, id);
        // HTTP/1.1, or HTTP/2 with prior knowledge (h2c: gRPC-style clients and
        // proxies that speak it to a plain port), told apart by the connection preface.
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new());
        builder.http2().timer(TokioTimer::new());
        let conn = builder.serve_connection(io, service);
        tokio::pin!(conn);
        tokio::select! {
            _ = conn.as_mut() => return,
            reason = activity.expiry(&self.limits) => {
                metrics::counter!("backstop_connections_closed_total", "reason" => reason).increment(1);
                return;
            }
            // Displaced by a new client while idle (counted by the shedder).
            () = shed.notified() => return,
            () = signalled(&mut close) => conn.as_mut().graceful_shutdown(),
        }
        tokio::select! {
            _ = conn => {}
            reason = activity.expiry(&self.limits) => {
                metrics::counter!("backstop_connections_closed_total", "reason" => reason).increment(1);
            }
        }
    }
}

/// What a connection has been doing, for its idle and header timeouts. Times are
/// milliseconds since `opened`; `NONE` means not set.
struct Activity {
    opened: Instant,
    in_flight: AtomicU32,
    served: AtomicU64,
    /// When the last request in flight finished.
    idle_since: AtomicU64,
    /// The first byte read since the connection went idle: a request head is arriving.
    head_since: AtomicU64,
}

const NONE: u64 = u64::MAX;

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            in_flight: AtomicU32::new(0),
            served: AtomicU64::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(NONE),
        }
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
    }

    /// Since when a keep-alive connection has had nothing to do (`None` while a request
    /// is in flight or arriving, or before its first).
    fn idle_at(&self) -> Option<Instant> {
        let idle = self.in_flight.load(Ordering::Relaxed) == 0
            && self.served.load(Ordering::Relaxed) > 0
            && self.head_since.load(Ordering::Relaxed) == NONE;
        idle.then(|| self.opened + Duration::from_millis(self.idle_since.load(Ordering::Relaxed)))
    }

    fn read_some(&self) {
        if self.in_flight.load(Ordering::Relaxed) == 0
            && self.head_since.load(Ordering::Relaxed) == NONE
        {
            self.head_since.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    fn begin(self: &Arc<Self>) -> OpenRequest {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.served.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(NONE, Ordering::Relaxed);
        OpenRequest(self.clone())
    }

    /// When this connection must be closed, as of now: `None` while a request is in
    /// flight. Fresh connections get `header_read_timeout` for their first head;
    /// keep-alive ones `idle_timeout` until a byte arrives, then `header_read_timeout`.
    fn deadline_ms(&self, limits: &ServerConfig) -> Option<(u64, &'static str)> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let header = limits.header_read_timeout.as_millis() as u64;
        let head = self.head_since.load(Ordering::Relaxed);
        if self.served.load(Ordering::Relaxed) == 0 {
            return Some((header, "header_timeout"));
        }
        if head != NONE {
            return Some((head.saturating_add(header), "header_timeout"));
        }
        let idle = limits.idle_timeout.as_millis() as u64;
        Some((
            self.idle_since.load(Ordering::Relaxed).saturating_add(idle),
            "idle_timeout",
        ))
    }

    /// Resolves (with the reason) when the connection has overstayed a timeout.
    async fn expiry(&self, limits: &ServerConfig) -> &'static str {
        let tick = (limits.header_read_timeout.min(limits.idle_timeout) / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(1));
        loop {
            if let Some((at, reason)) = self.deadline_ms(limits) {
                if self.now_ms() >= at {
                    return reason;
                }
            }
            tokio::time::sleep(tick).await;
        }
    }
}

/// Takes a connection off the idle registry when its task ends, however it ends.
struct Forget<'a>(&'a IdleConnections, u64);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

/// One request in flight on a connection, until its response body is dropped.
struct OpenRequest(Arc<Activity>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0.idle_since.store(self.0.now_ms(), Ordering::Relaxed);
        }
    }
}

/// The current generation's app, counting each request in flight until its body has
/// been sent. Each request takes the generation current when it arrives (not when its
/// connection opened), so a keep-alive connection sees a reload at its next request.
#[derive(Clone)]
struct Counted {
    live: Arc<Live>,
    activity: Arc<Activity>,
}

impl Service<Request<Incoming>> for Counted {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let guard = self.activity.begin();
        let app = self.live.current().app.clone();
        Box::pin(async move {
            let response = app.oneshot(req).await?;
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &guard;
                    frame
                }))
            }))
        })
    }
}

/// The socket, noting reads for [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.read_some();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Stops a background task when its owner ends.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on SIGTERM or SIGINT.
/// Reloads the config on every `SIGHUP` until the server stops (a no-op off Unix). An
/// invalid file is logged and changes nothing.
pub fn reload_on_sighup(handle: &ServerHandle) {
    #[cfg(unix)]
    {
        let live = Arc::downgrade(&handle.live);
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        else {
            tracing::warn!("cannot listen for SIGHUP: reload with POST /admin/reload");
            return;
        };
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                let Some(live) = live.upgrade() else { return };
                tracing::info!("SIGHUP: reloading the config");
                // The outcome is logged and counted by the reload itself.
                let _ = live.reload().await;
            }
        });
    }
    #[cfg(not(unix))]
    let _ = handle;
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// An accept loop that outruns its refusal tasks (here: they never run, the test
    /// holds the only thread) keeps at most twice the slots open; the rest get their 503
    /// at once and are closed.
    #[tokio::test(flavor = "current_thread")]
    async fn refusals_the_accept_loop_outruns_hold_at_most_twice_the_slots() {
        use std::io::Read;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let slots = 4;
        let mut refusals = Refusals::new(7, slots);
        let mut clients = Vec::new();
        for _ in 0..3 * slots {
            let client = std::net::TcpStream::connect(addr).unwrap();
            let (tcp, _) = listener.accept().await.unwrap();
            refusals.refuse(tcp);
            clients.push(client);
        }
        assert_eq!(refusals.open.load(Ordering::Acquire), 2 * slots);
        // Answered at once, never spawned: the 503 and then the close are there already.
        for client in &mut clients[2 * slots..] {
            let mut answer = String::new();
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            client.read_to_string(&mut answer).unwrap();
            assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
            assert!(answer.contains("at most 7"), "{answer}");
        }
    }

    #[tokio::test]
    async fn a_refusal_reads_up_to_the_blank_line_that_ends_the_head() {
        let request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n{\"model\":\"m\"}";
        let head = request.len() - 13;
        // A small buffer, so the blank line falls across reads.
        let (mut sink, mut read) = ([0u8; 5], 0);
        read_head(&mut &request[..], &mut sink, &mut read).await;
        assert!((head..head + 5).contains(&read), "{read} of {head}");

        // No blank line: read to the end.
        let (mut sink, mut read) = ([0u8; 5], 0);
        read_head(&mut &request[..head - 2], &mut sink, &mut read).await;
        assert_eq!(read, head - 2);
    }

    #[tokio::test]
    async fn a_refusal_reads_no_more_than_its_bound() {
        let endless = vec![b'a'; 3 * REFUSAL_READ_BYTES];
        let (mut sink, mut read) = ([0u8; 4096], 0);
        read_head(&mut &endless[..], &mut sink, &mut read).await;
        assert_eq!(read, REFUSAL_READ_BYTES);
        let mut read = 0;
        drain(&mut &endless[..], &mut sink, &mut read).await;
        assert_eq!(read, REFUSAL_READ_BYTES);
    }
}
