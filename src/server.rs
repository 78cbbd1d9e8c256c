//! The accept loop, the admin endpoints and the per-request path from a client's request to an
//! upstream's stack.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::accept::{self, Acceptor, ConnLimits, Handler};
use crate::access_log::{self, Exchange};
use crate::body::{self, Body};
use crate::config::Config;
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::forward;
use crate::forward::buffer::{self, BodyBounds};
use crate::group;
use crate::metrics::{self, Metrics};
use crate::router::{self, Route, Router};
use crate::shutdown::Signal;
use crate::upstream::{Attempt, SendResult, Upstream};
use arc_swap::ArcSwap;

/// Connections the admin listener serves at once (probes and scrapes need few).
const ADMIN_MAX_CONNECTIONS: usize = 64;
/// The paths [`App::admin`] answers.
const ADMIN_PATHS: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/status"];

/// Everything a connection needs to serve requests.
pub struct App {
    /// Swapped whole by a reload; each request takes the router in force when it arrives.
    router: ArcSwap<Router>,
    metrics: Metrics,
    ready: AtomicBool,
    admin_on_main: bool,
    limits: ConnLimits,
    drain_delay: Duration,
    drain_timeout: Duration,
    /// The config in force: what a reload compares against; its warnings are logged at start
    /// and listed by `/status`.
    config: ArcSwap<Config>,
    /// Connections open on the main listener.
    open_connections: Arc<AtomicUsize>,
    /// The fleet's Redis, with `[fleet] redis`.
    fleet: Option<Arc<Fleet>>,
    /// Which requests get a `request` line: `access_log` and `slow_request`, read per request
    /// without a lock, replaced by a reload.
    access_log: access_log::Policy,
}

impl App {
    pub fn new(config: &Config) -> Arc<Self> {
        let metrics = Metrics::new();
        let fleet = Fleet::new(&config.fleet, metrics.fleet());
        Arc::new(Self {
            router: ArcSwap::from_pointee(Router::new(
                &config.upstreams,
                &config.groups,
                config.max_buffered_bytes,
                &metrics,
                fleet.as_ref(),
            )),
            fleet,
            metrics,
            ready: AtomicBool::new(false),
            admin_on_main: config.admin_listen.is_none(),
            limits: ConnLimits::new(config),
            drain_delay: config.drain_delay.0,
            drain_timeout: config.drain_timeout.0,
            config: ArcSwap::from_pointee(config.clone()),
            open_connections: Arc::default(),
            access_log: access_log::Policy::new(config),
        })
    }

    /// Apply a reloaded config (SIGHUP): routes and upstreams change for new requests at once;
    /// upstreams whose config is unchanged keep their state (learned limits, breaker, queue);
    /// in-flight requests finish on what they started with. Settings of the listeners and the
    /// body buffer take effect on restart only, and a warning names them.
    pub fn reload(&self, config: &Config) -> router::ReloadSummary {
        // What is in force: the new upstreams, the old listeners and buffer (until restart).
        let mut config = config.clone();
        let restart_only = keep_restart_only(&self.config.load(), &mut config);
        if !restart_only.is_empty() {
            tracing::warn!(
                keys = restart_only.join(", "),
                "config reload: these settings take effect on restart only"
            );
        }
        let (router, summary) = self.router.load().reload(
            &config.upstreams,
            &config.groups,
            &self.metrics,
            self.fleet.as_ref(),
        );
        self.router.store(Arc::new(router));
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        self.access_log.set(&config);
        self.config.store(Arc::new(config));
        self.metrics.config_reload(true);
        tracing::info!(
            generation = self.metrics.config_generation.get(),
            kept = summary.kept,
            built = summary.built,
            removed = summary.removed,
            "config reloaded"
        );
        summary
    }

    /// [`handle`](Self::handle), with a panic anywhere on the way (routing, reading the body,
    /// the stack, which catches its own) answered 500 `internal` instead of an empty reply, and
    /// counted. The stack's own catch-panic layer counts per upstream; this one counts under
    /// `upstream="(none)"`.
    async fn handle_caught(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        use futures_util::FutureExt;
        let app = Arc::clone(&self);
        match std::panic::AssertUnwindSafe(self.handle(req, peer))
            .catch_unwind()
            .await
        {
            Ok(response) => response,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(panic = %what, "panic while serving a request; answered 500");
                let e = ProxyError::Internal("panic".into());
                app.metrics.unrouted_error(e.label());
                e.into_response()
            }
        }
    }

    /// The upstream named `name` in the config in force.
    pub fn upstream(&self, name: &str) -> Option<Arc<Upstream>> {
        let router = self.router.load();
        router.upstreams().iter().find(|u| u.name == name).cloned()
    }

    /// A reload whose config was refused: the old one stays.
    pub fn reload_refused(&self, error: &dyn std::fmt::Display) {
        self.metrics.config_reload(false);
        tracing::error!(
            error = %error,
            generation = self.metrics.config_generation.get(),
            "config reload refused; the config in force stays"
        );
    }

    /// Whether `/readyz` answers 200 (listening and not draining).
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Serve one request from a client at `peer`.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<Body> {
        if self.admin_on_main {
            if let Some(response) = self.admin(&req) {
                return response;
            }
        }
        // Every clock of the exchange (body read, deadline) starts here.
        let start = Instant::now();
        let method = metrics::method_label(req.method());
        let route = match self.route(&req) {
            Ok(route) => route,
            Err(e) => {
                self.metrics.unrouted_error(e.label());
                tracing::info!(method, status = e.status().as_u16(), error = e.label(), detail = %e, "refused");
                return e.into_response();
            }
        };
        let (result, member) = match &route {
            Route::Upstream(upstream) => (self.forward(upstream, req, peer, start).await, None),
            Route::Group(group) => {
                let router = self.router.load_full();
                group.forward(req, peer, start, router.buffer()).await
            }
        };
        let (mut response, tally, error) = match result {
            Ok((response, tally)) => (response, tally, None),
            Err((e, tally)) => (e.into_response(), tally, Some(e)),
        };
        if let Some(member) = member {
            // Member names are validated plain tokens: a valid header value.
            if let Ok(value) = HeaderValue::from_str(member) {
                response.headers_mut().insert(group::UPSTREAM_HEADER, value);
            }
        }
        let exchange = Exchange {
            status: response.status().as_u16(),
            corral_error: error.is_some(),
            attempts: tally.attempts,
            held: tally.held,
            duration: start.elapsed(),
        };
        // A few comparisons; the fields are formatted only for a line that is written (and
        // `RUST_LOG` above `info` skips even that).
        if let Some(why) = self.access_log.why(&exchange) {
            tracing::info!(
                upstream = %route.name(),
                member,
                method,
                status = exchange.status,
                attempts = exchange.attempts,
                duration_ms = exchange.duration.as_millis() as u64,
                held_ms = exchange.held.as_millis() as u64,
                corral_error = response
                    .headers()
                    .get(crate::error::CORRAL_ERROR_HEADER)
                    .and_then(|v| v.to_str().ok()),
                detail = error.as_ref().map(tracing::field::display),
                why = why.label(),
                "request"
            );
        }
        response
    }

    /// The upstream for a request, or why corral refuses it: a method it does not proxy, an
    /// absolute-form target, a path that could leave its route, or no route at all.
    fn route(&self, req: &Request<Incoming>) -> Result<Route, ProxyError> {
        if req.method() == Method::CONNECT {
            return Err(ProxyError::Connect);
        }
        if forward::proxied_method(req.method()).is_none() {
            let shown: String = req.method().as_str().chars().take(32).collect();
            return Err(ProxyError::MethodNotAllowed {
                method: shown,
                allow: crate::error::ALLOWED_METHODS,
            });
        }
        // HTTP/2 always carries scheme and authority; in HTTP/1 they mean absolute-form.
        let is_h1 = matches!(
            req.version(),
            Version::HTTP_09 | Version::HTTP_10 | Version::HTTP_11
        );
        if is_h1 && (req.uri().scheme().is_some() || req.uri().authority().is_some()) {
            return Err(ProxyError::AbsoluteForm);
        }
        let path = req.uri().path();
        router::check_path(path)?;
        self.router
            .load()
            .find(path)
            .ok_or_else(|| ProxyError::NoRoute(path.chars().take(256).collect()))
    }

    /// Read the body (bounded in size, time and corral's memory), send it through the
    /// upstream's stack, and time the response body on its way back.
    async fn forward(
        &self,
        upstream: &Upstream,
        req: Request<Incoming>,
        peer: SocketAddr,
        start: Instant,
    ) -> SendResult {
        let (parts, incoming) = req.into_parts();
        let refuse = |e: ProxyError| upstream.refuse(&parts.method, e);
        let uri = upstream
            .target(parts.uri.path(), parts.uri.query())
            .ok_or_else(|| {
                refuse(ProxyError::NoRoute(
                    parts.uri.path().chars().take(256).collect(),
                ))
            })?;
        let deadlines = forward::deadline(start, upstream.deadline, &parts.headers);
        let priority =
            forward::priority(&parts.headers, upstream.config.priority).map_err(&refuse)?;
        let bounds = BodyBounds {
            limit: upstream.body_limit,
            idle: upstream.body_idle_timeout,
            deadline: deadlines.head,
        };
        let (body, held) = buffer::read_body(incoming, bounds, self.router.load().buffer())
            .await
            .map_err(&refuse)?;
        let result = upstream
            .send(
                Attempt {
                    method: parts.method,
                    headers: parts.headers,
                    withheld: &upstream.withheld,
                    uri,
                    body,
                    deadlines,
                    wait_deadline: deadlines.head,
                    priority,
                },
                peer,
                start,
            )
            .await;
        // The stack is done with the request body, every retry included: its room goes back.
        drop(held);
        result
    }

    /// `/healthz`, `/readyz`, `/metrics`, `/status` for GET and HEAD (405 for other methods);
    /// `None` for any other path.
    fn admin<B>(&self, req: &Request<B>) -> Option<Response<Body>> {
        let path = req.uri().path();
        if !ADMIN_PATHS.contains(&path) {
            return None;
        }
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return Some(
                ProxyError::MethodNotAllowed {
                    method: req.method().as_str().chars().take(32).collect(),
                    allow: "GET, HEAD",
                }
                .into_response(),
            );
        }
        let (status, content_type, text) = match path {
            "/readyz" if self.is_ready() => (StatusCode::OK, "text/plain", "ready\n".to_owned()),
            "/readyz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                "not ready\n".to_owned(),
            ),
            "/metrics" => (
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
            "/status" => (StatusCode::OK, "application/json", self.status_json()),
            _ => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        };
        let mut response = Response::new(body::full(text));
        *response.status_mut() = status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        Some(response)
    }

    fn status_json(&self) -> String {
        let upstreams: Vec<_> = self
            .router
            .load()
            .upstreams()
            .iter()
            .map(|u| {
                let mut v = u.state.status();
                v["name"] = serde_json::json!(u.name);
                v["route"] = serde_json::json!(u.route);
                v["in_flight"] = serde_json::json!(u.metrics.in_flight.get());
                v
            })
            .collect();
        let json = serde_json::json!({
            "ready": self.is_ready(),
            "connections": {
                "open": self.open_connections.load(Ordering::Relaxed),
                "max": self.limits.max_connections,
            },
            "config_generation": self.metrics.config_generation.get(),
            "warnings": self.config.load().warnings(),
            "fleet": self.fleet.as_ref().map(|f| f.status()),
            "upstreams": upstreams,
            "groups": self.router.load().groups().iter().map(|g| g.status()).collect::<Vec<_>>(),
        });
        serde_json::to_string_pretty(&json).expect("JSON values serialize")
    }

    /// Requests in flight to every upstream.
    fn in_flight(&self) -> i64 {
        let router = self.router.load();
        router
            .upstreams()
            .iter()
            .map(|u| u.metrics.in_flight.get())
            .sum()
    }
}

/// Serve `listener` (and `admin`, if given) until `shutdown` resolves, then drain:
///
/// 1. Readiness flips: `/readyz` answers 503.
/// 2. On [`Signal::Terminate`] (SIGTERM), corral keeps accepting and serving for `drain_delay`,
///    so a load balancer sees the 503 and stops sending before the port closes. On
///    [`Signal::Interrupt`], or a shutdown future that resolves to `()`, there is no delay.
/// 3. The listener closes; every connection is asked to finish (HTTP/1 after its response in
///    progress, HTTP/2 with a GOAWAY) and in-flight requests, streams included, get up to
///    `drain_timeout`; what is left is cut.
///
/// The admin listener serves throughout (its `/readyz` answers 503 until the end) and closes
/// last.
pub async fn run<S: Into<Signal>>(
    app: Arc<App>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = S>,
) -> std::io::Result<()> {
    let builder = Arc::new(accept::http_builder(&app.limits));
    let addr = listener.local_addr()?;
    let proxy_handler: Handler = {
        let app = Arc::clone(&app);
        Arc::new(move |req, peer| Box::pin(Arc::clone(&app).handle_caught(req, peer)))
    };
    let mut proxy = Acceptor::new(
        "proxy",
        listener,
        app.limits,
        Arc::clone(&builder),
        proxy_handler,
        Arc::clone(&app.open_connections),
    );
    let mut admin = match admin {
        Some(listener) => {
            tracing::info!(addr = %listener.local_addr()?, "admin endpoints listening");
            let limits = ConnLimits {
                max_connections: ADMIN_MAX_CONNECTIONS,
                ..app.limits
            };
            let app = Arc::clone(&app);
            let handler: Handler = Arc::new(move |req: Request<Incoming>, _| {
                let response = app.admin(&req).unwrap_or_else(|| {
                    ProxyError::NoRoute(req.uri().path().to_owned()).into_response()
                });
                Box::pin(std::future::ready(response))
            });
            let open = Arc::default();
            Some(Acceptor::new(
                "admin", listener, limits, builder, handler, open,
            ))
        }
        None => None,
    };
    for warning in app.config.load().warnings() {
        tracing::warn!("{warning}");
    }
    app.ready.store(true, Ordering::SeqCst);
    tracing::info!(%addr, max_connections = app.limits.max_connections, "corral listening");

    let signal: Signal = serve_until(&mut proxy, admin.as_mut(), shutdown)
        .await
        .into();
    app.ready.store(false, Ordering::SeqCst);
    let delay = match signal {
        Signal::Terminate => app.drain_delay,
        Signal::Interrupt => Duration::ZERO,
    };
    tracing::info!(
        signal = signal.name(),
        drain_delay = ?delay,
        "draining: /readyz answers 503; serving on for the drain delay, then closing the listener"
    );
    serve_until(&mut proxy, admin.as_mut(), tokio::time::sleep(delay)).await;

    proxy.close();
    tracing::info!(
        open = proxy.open(),
        in_flight = app.in_flight(),
        drain_timeout = ?app.drain_timeout,
        "listener closed; draining connections"
    );
    let cut = tokio::select! {
        cut = proxy.drain(app.drain_timeout) => cut,
        () = serve_admin_forever(admin.as_mut()) => unreachable!("the admin loop never ends"),
    };
    if cut == 0 {
        tracing::info!("drained; all connections closed");
    } else {
        tracing::warn!(cut, "drain timeout passed; cut the connections still open");
    }
    if let Some(fleet) = &app.fleet {
        fleet.shutdown().await;
    }
    if let Some(admin) = &mut admin {
        admin.drain(Duration::ZERO).await;
    }
    Ok(())
}

/// Serve both listeners until `until` resolves.
async fn serve_until<T>(
    proxy: &mut Acceptor,
    mut admin: Option<&mut Acceptor>,
    until: impl Future<Output = T>,
) -> T {
    let mut until = std::pin::pin!(until);
    loop {
        tokio::select! {
            out = &mut until => return out,
            () = proxy.step() => {}
            () = serve_admin(admin.as_deref_mut()) => {}
        }
    }
}

/// One step of the admin listener; never resolves when there is none.
async fn serve_admin(admin: Option<&mut Acceptor>) {
    match admin {
        Some(admin) => admin.step().await,
        None => std::future::pending().await,
    }
}

/// The admin listener, if any, until the caller stops polling.
async fn serve_admin_forever(mut admin: Option<&mut Acceptor>) {
    loop {
        serve_admin(admin.as_deref_mut()).await;
    }
}

/// Keep in `new` the top-level settings that apply only on restart (the listeners, their
/// connection limits, the drain, the body buffer) as they are in `old`; the names of those that
/// `new` would have changed.
fn keep_restart_only(old: &Config, new: &mut Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    macro_rules! keep {
        ($($key:ident),*) => {$(
            if new.$key != old.$key {
                changed.push(stringify!($key));
                new.$key = old.$key.clone();
            }
        )*};
    }
    keep!(
        fleet,
        listen,
        admin_listen,
        max_connections,
        first_byte_timeout,
        idle_timeout,
        write_timeout,
        http2_keep_alive_interval,
        drain_delay,
        drain_timeout,
        max_buffered_bytes
    );
    changed
}

/// Reload the config on every SIGHUP: `load` reads it again (file, flags and environment, as at
/// start); a valid one is applied ([`App::reload`]), an invalid one is refused with a log line
/// and the old one stays. The handler is installed when this is called (so a SIGHUP right after
/// start-up does not hit the default action, which ends the process); the returned future runs
/// until the process ends.
pub fn reload_on_hangup<E: std::fmt::Display>(
    app: Arc<App>,
    load: impl Fn() -> Result<Config, E>,
) -> impl Future<Output = ()> {
    #[cfg(unix)]
    let hangups = {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "no SIGHUP handler: config reload is off"))
            .ok()
    };
    #[cfg(not(unix))]
    let hangups: Option<()> = None;
    async move {
        #[cfg(unix)]
        if let Some(mut hangups) = hangups {
            while hangups.recv().await.is_some() {
                tracing::info!(signal = "SIGHUP", "config reload requested");
                match load() {
                    Ok(config) => {
                        app.reload(&config);
                    }
                    Err(e) => app.reload_refused(&e),
                }
            }
        }
        #[cfg(not(unix))]
        let _ = (app, load, hangups);
    }
}
