//! The accept loop of one listener, and the life of each connection it accepts.
//!
//! An [`Acceptor`] accepts until it is closed, keeps every connection's task in a `JoinSet` (the
//! drain waits for them and cuts what is left) and stops accepting at its cap. Every wait of a
//! connection has an end:
//!
//! 1. Accepted, it has `first_byte_timeout` to send a byte, or it is closed.
//! 2. Without a request in progress it is closed after `idle_timeout`: before its first request
//!    (a partial HTTP/2 preface, a head sent slowly), between HTTP/1 requests, and on HTTP/2
//!    with no open stream (with a GOAWAY). A request is in progress from its head until its
//!    response body is sent or dropped; the request path bounds that part.
//! 3. HTTP/2: a PING after `http2_keep_alive_interval` without a frame from the client; no answer
//!    within as long closes the connection, mid-stream too (a peer gone without a FIN).
//! 4. Header blocks of [`MAX_HEADER_BYTES`] or more get 431, on HTTP/1 and HTTP/2.
//! 5. A response frame the client has not taken for `write_timeout` (it stopped reading, so its
//!    socket or its HTTP/2 window stays full and hyper stops asking the body for more) ends the
//!    connection: its requests give back their concurrency slots and upstream connections. An
//!    upstream that pauses is not this: hyper is then waiting for the body, not the client.
//!
//! **At the cap** (`max_connections`) the loop stops calling `accept` until a connection ends.
//! New connections then wait in the kernel's listen backlog and are served in turn as slots
//! free, instead of being accepted and closed at once: a close is an error every client retries
//! at once, the very herd corral exists to prevent, while a wait in the backlog is only latency,
//! bounded by the client's own connect timeout. Once the backlog is full the kernel drops new
//! SYNs and clients retransmit them, which paces them further.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::body::{Body, Guard, Guarded};
use crate::config::Config;

/// Request heads (HTTP/1: request line and headers; HTTP/2: the decoded header list) of this
/// size or more get 431 Request Header Fields Too Large.
pub const MAX_HEADER_BYTES: usize = 64 << 10;
/// Pause after a failed `accept` (out of file descriptors, say) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// After an idle connection is told to close, how long it may take before its socket is
/// dropped: HTTP/2's GOAWAY takes a PING round trip; an HTTP/1 connection still in its first
/// head counts as busy for hyper and would otherwise wait for a request that never completes.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);
/// At most one "connection cap reached" warning per this long.
const CAP_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// The connection settings of a [`Config`].
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub first_byte_timeout: Duration,
    pub idle_timeout: Duration,
    pub write_timeout: Duration,
    pub http2_keep_alive_interval: Duration,
}

impl ConnLimits {
    pub fn new(config: &Config) -> Self {
        Self {
            max_connections: config.max_connections.get() as usize,
            first_byte_timeout: config.first_byte_timeout.0,
            idle_timeout: config.idle_timeout.0,
            write_timeout: config.write_timeout.0,
            http2_keep_alive_interval: config.http2_keep_alive_interval.0,
        }
    }
}

/// HTTP/2 flow-control window of a connection: unread request data it may hold.
pub const H2_CONNECTION_WINDOW: u32 = 128 << 10;
/// HTTP/2 flow-control window of one stream.
pub const H2_STREAM_WINDOW: u32 = 64 << 10;
/// HTTP/2 streams open at once on one connection.
pub const H2_MAX_STREAMS: u32 = 100;

/// HTTP/1 and h2c on one port, with rules 3 and 4 of the module doc.
pub fn http_builder(limits: &ConnLimits) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Rule 2 bounds a head sent slowly, on both protocols: one clock, not two.
        .header_read_timeout(None)
        // hyper answers 431 when a head does not fit its read buffer (hyper-util's builder has
        // no `max_header_size`); bodies are then read in chunks of at most this.
        .max_buf_size(MAX_HEADER_BYTES);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keep_alive_interval)
        .keep_alive_timeout(limits.http2_keep_alive_interval)
        // h2 answers 431 on the stream when a decoded header list is larger.
        .max_header_list_size(MAX_HEADER_BYTES as u32)
        // Data a client may send before corral reads it sits outside the body buffer's budget:
        // keep it small per connection and per stream (hyper's defaults are 1 MiB each and
        // 200 streams), so memory follows `max_connections`, not what clients push.
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .max_concurrent_streams(H2_MAX_STREAMS);
    builder
}

/// Serves one request from a client at the given address: any such closure. Its future is
/// not boxed: hyper keeps a connection's request future in one slot it reuses, where a boxed
/// one would cost every request an allocation and one more copy of the future.
pub trait Handler: Send + Sync + 'static {
    type Future: Future<Output = Response<Body>> + Send + 'static;
    fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Self::Future;
}

impl<F, R> Handler for F
where
    F: Fn(Request<Incoming>, SocketAddr) -> R + Send + Sync + 'static,
    R: Future<Output = Response<Body>> + Send + 'static,
{
    type Future = R;
    fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> R {
        self(req, peer)
    }
}

/// One listener and the connections it accepted, served by `H`.
pub struct Acceptor<H> {
    /// `proxy` or `admin`, for logs.
    name: &'static str,
    /// `None` once closed.
    listener: Option<TcpListener>,
    conns: JoinSet<()>,
    limits: ConnLimits,
    builder: Arc<auto::Builder<TokioExecutor>>,
    handler: Arc<H>,
    /// `true` asks every connection to finish.
    drain: watch::Sender<bool>,
    /// Open connections, for `/status`.
    open: Arc<AtomicUsize>,
    last_cap_warning: Option<Instant>,
}

impl<H: Handler> Acceptor<H> {
    pub fn new(
        name: &'static str,
        listener: TcpListener,
        limits: ConnLimits,
        builder: Arc<auto::Builder<TokioExecutor>>,
        handler: H,
        open: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            name,
            listener: Some(listener),
            conns: JoinSet::new(),
            limits,
            builder,
            handler: Arc::new(handler),
            drain: watch::Sender::new(false),
            open,
            last_cap_warning: None,
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.conns.len()
    }

    /// Accepts one connection (below the cap) or reaps one that ended. Cancel-safe: made to be
    /// called in a loop under `select!`.
    pub async fn step(&mut self) {
        let full = self.conns.len() >= self.limits.max_connections;
        if full && self.listener.is_some() {
            self.warn_at_cap();
        }
        let listener = self.listener.as_ref().filter(|_| !full);
        tokio::select! {
            Some(joined) = self.conns.join_next(), if !self.conns.is_empty() => {
                if let Err(e) = joined {
                    if e.is_panic() {
                        tracing::error!(listener = self.name, error = %e, "connection task panicked");
                    }
                }
            }
            accepted = accept(listener) => match accepted {
                Ok((stream, peer)) => self.spawn(stream, peer),
                Err(e) => {
                    tracing::warn!(listener = self.name, error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
        }
        self.open.store(self.conns.len(), Ordering::Relaxed);
    }

    /// Stops accepting: the listening socket closes, so new connections are refused.
    pub fn close(&mut self) {
        self.listener = None;
    }

    /// Closes the listener and asks every connection to finish (HTTP/1 after the response in
    /// progress, HTTP/2 with a GOAWAY); waits up to `timeout`, then aborts the rest. Returns
    /// how many connections were cut.
    pub async fn drain(&mut self, timeout: Duration) -> usize {
        self.close();
        self.drain.send_replace(true);
        let (conns, open) = (&mut self.conns, &self.open);
        let all_ended = async {
            while conns.join_next().await.is_some() {
                open.store(conns.len(), Ordering::Relaxed);
            }
        };
        let cut = match tokio::time::timeout(timeout, all_ended).await {
            Ok(()) => 0,
            Err(_) => self.conns.len(),
        };
        self.conns.shutdown().await;
        self.open.store(0, Ordering::Relaxed);
        cut
    }

    fn warn_at_cap(&mut self) {
        let now = Instant::now();
        if self
            .last_cap_warning
            .is_some_and(|at| now < at + CAP_WARN_INTERVAL)
        {
            return;
        }
        self.last_cap_warning = Some(now);
        tracing::warn!(
            listener = self.name,
            max_connections = self.limits.max_connections,
            "connection cap reached: not accepting until a connection closes; new connections \
             wait in the kernel's backlog"
        );
    }

    fn spawn(&mut self, stream: TcpStream, peer: SocketAddr) {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "set_nodelay failed");
        }
        let conn = Connection {
            peer,
            limits: self.limits,
            builder: Arc::clone(&self.builder),
            handler: Arc::clone(&self.handler),
            drain: self.drain.subscribe(),
        };
        self.conns.spawn(conn.serve(stream));
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// One accepted connection and what it needs.
struct Connection<H> {
    peer: SocketAddr,
    limits: ConnLimits,
    builder: Arc<auto::Builder<TokioExecutor>>,
    handler: Arc<H>,
    drain: watch::Receiver<bool>,
}

impl<H: Handler> Connection<H> {
    async fn serve(mut self, stream: TcpStream) {
        let peer = self.peer;
        // 1. The first byte (peeked: hyper reads it again).
        let mut byte = [0u8; 1];
        let first = tokio::select! {
            peeked = tokio::time::timeout(self.limits.first_byte_timeout, stream.peek(&mut byte)) => peeked,
            () = drained(&mut self.drain) => return,
        };
        match first {
            Ok(Ok(n)) if n > 0 => {}
            Ok(Ok(_)) => return,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "connection failed before its first byte");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, timeout = ?self.limits.first_byte_timeout, "closed: no first byte in time");
                return;
            }
        }

        // 2. Serve; close when idle or draining.
        let activity = Arc::new(Activity::new());
        let service = {
            let (activity, handler) = (Arc::clone(&activity), Arc::clone(&self.handler));
            service_fn(move |req| {
                let in_flight = activity.begin();
                let response = handler.handle(req, peer);
                async move {
                    let response = response.await;
                    // Unboxed: hyper takes any body type, and this wrapper is the last.
                    Ok::<_, Infallible>(response.map(|body| Guarded::new(body, in_flight)))
                }
            })
        };
        let conn = self.builder.serve_connection(TokioIo::new(stream), service);
        let mut conn = std::pin::pin!(conn);
        let limits = self.limits;
        // The watchers in a `FuturesUnordered`, which polls one only when its own timer or
        // the drain woke it: beside the connection in one `select!`, all three would be polled
        // at every wakeup of the connection (several per request).
        let mut watchers: FuturesUnordered<Pin<Box<dyn Future<Output = Watch> + Send + '_>>> =
            FuturesUnordered::new();
        watchers.push(Box::pin(async {
            activity.idle_for(limits.idle_timeout).await;
            Watch::Idle
        }));
        let drain = &mut self.drain;
        watchers.push(Box::pin(async {
            drained(drain).await;
            Watch::Drained
        }));
        watchers.push(Box::pin(async {
            activity.stalled_for(limits.write_timeout).await;
            Watch::Stalled
        }));
        let idle = tokio::select! {
            result = conn.as_mut() => return log_end(peer, result),
            Some(watch) = watchers.next() => match watch {
                Watch::Idle => true,
                Watch::Drained => false,
                Watch::Stalled => {
                    tracing::warn!(%peer, timeout = ?limits.write_timeout, "closing a connection whose client stopped reading its response");
                    return;
                }
            },
        };
        drop(watchers);
        conn.as_mut().graceful_shutdown();
        if !idle {
            // The drain's deadline bounds this wait.
            return log_end(peer, conn.await);
        }
        tracing::debug!(%peer, timeout = ?self.limits.idle_timeout, "closing an idle connection");
        match tokio::time::timeout(IDLE_CLOSE_GRACE, conn).await {
            Ok(result) => log_end(peer, result),
            Err(_) => tracing::debug!(%peer, "idle connection did not close in time; dropped"),
        }
    }
}

/// Which of a connection's watchers ended its service.
enum Watch {
    /// No request in progress for `idle_timeout`.
    Idle,
    /// The drain has begun.
    Drained,
    /// A response frame waited `write_timeout` for its client.
    Stalled,
}

/// Resolves once the drain has begun (or the acceptor is gone).
async fn drained(drain: &mut watch::Receiver<bool>) {
    let _ = drain.wait_for(|draining| *draining).await;
}

fn log_end(peer: SocketAddr, result: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// Requests in progress on one connection, and since when none has been; and, per response,
/// since when a frame waits for the client to take it.
///
/// Counted in atomics the connection's own watchers read when their timers fire: a request
/// beginning or ending wakes nothing (a channel here re-polled the whole connection twice per
/// request).
struct Activity {
    origin: Instant,
    /// Requests in progress.
    in_progress: AtomicUsize,
    /// When the last request ended (nanoseconds after `origin`).
    idle_since: AtomicU64,
    /// One per request in progress. A request that ends leaves its entry for the next one (an
    /// entry only this list holds is free), so requests on a kept-alive connection allocate
    /// none; the list is as long as the most requests this connection had in progress at once.
    handed: std::sync::Mutex<Vec<Arc<Handed>>>,
}

/// When a response's last frame went to hyper and hyper has not asked for the next one since
/// (nanoseconds after `origin`, plus one; 0: the client has taken everything handed so far).
struct Handed {
    origin: Instant,
    at: AtomicU64,
}

impl Handed {
    fn since(&self) -> Option<Instant> {
        let n = self.at.load(Ordering::Relaxed);
        (n > 0).then(|| self.origin + Duration::from_nanos(n - 1))
    }
}

/// Nanoseconds from `origin` to now.
fn nanos_since(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX - 1)
}

impl Activity {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            in_progress: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            handed: std::sync::Mutex::default(),
        }
    }

    /// A request has begun; it ends when the returned guard drops.
    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_progress.fetch_add(1, Ordering::AcqRel);
        let mut all = self
            .handed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Entries are cloned only here, under the lock: one held by the list alone stays free.
        let handed = match all.iter().find(|h| Arc::strong_count(h) == 1) {
            Some(free) => {
                // The last owner's marks (Relaxed) happen before its count dropped (Release):
                // this reset comes after them.
                std::sync::atomic::fence(Ordering::Acquire);
                free.at.store(0, Ordering::Relaxed);
                Arc::clone(free)
            }
            None => {
                let handed = Arc::new(Handed {
                    origin: self.origin,
                    at: AtomicU64::new(0),
                });
                all.push(Arc::clone(&handed));
                handed
            }
        };
        drop(all);
        InFlight(Arc::clone(self), handed)
    }

    /// Resolves once a response's frame has waited `limit` for its client to take it. Checks a
    /// few times per `limit` (a stall is found within about a tenth of it late).
    async fn stalled_for(&self, limit: Duration) {
        let tick = (limit / 10).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(tick).await;
            let now = Instant::now();
            let all = self
                .handed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // A free entry (the list's alone) keeps its last request's mark: skipped.
            let stalled = all
                .iter()
                .filter(|h| Arc::strong_count(h) > 1)
                .filter_map(|h| h.since())
                .any(|since| now.saturating_duration_since(since) >= limit);
            if stalled {
                return;
            }
        }
    }

    /// Resolves once no request has been in progress for `limit`. Looks when its timer fires:
    /// at the end of `limit` after the last request ended, or `limit` after a look that found
    /// one in progress (which then ends no earlier than it did).
    async fn idle_for(&self, limit: Duration) {
        loop {
            let wake = if self.in_progress.load(Ordering::Acquire) > 0 {
                Instant::now() + limit
            } else {
                let since = self.idle_since.load(Ordering::Acquire);
                let due = self.origin + Duration::from_nanos(since) + limit;
                // Read again: a request that began and ended meanwhile moved `since`.
                if Instant::now() >= due
                    && self.in_progress.load(Ordering::Acquire) == 0
                    && self.idle_since.load(Ordering::Acquire) == since
                {
                    return;
                }
                due
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

/// Keeps its request counted as in progress until dropped with the response body, and marks
/// when a frame waits for the client.
struct InFlight(Arc<Activity>, Arc<Handed>);

impl Guard for InFlight {
    fn on_data(&mut self, _len: usize) {
        self.1
            .at
            .store(nanos_since(self.1.origin) + 1, Ordering::Relaxed);
    }

    fn on_poll(&mut self) {
        self.1.at.store(0, Ordering::Relaxed);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let activity = &self.0;
        // Stored before the count drops: a watcher that sees none in progress sees this end.
        let now = nanos_since(activity.origin);
        activity.idle_since.fetch_max(now, Ordering::AcqRel);
        activity.in_progress.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(activity: &Activity) -> usize {
        activity.handed.lock().unwrap().len()
    }

    #[test]
    fn an_ended_requests_write_mark_is_never_the_next_ones() {
        let activity = Arc::new(Activity::new());
        let mut first = activity.begin();
        first.on_data(1);
        assert!(first.1.since().is_some(), "a frame waits for the client");
        drop(first);
        let second = activity.begin();
        assert_eq!(entries(&activity), 1, "the ended request's entry is reused");
        assert!(
            second.1.since().is_none(),
            "the new request has handed nothing"
        );
        // Two at once (HTTP/2 streams) hold two entries.
        let third = activity.begin();
        assert_eq!(entries(&activity), 2);
        assert!(!Arc::ptr_eq(&second.1, &third.1));
    }
}
