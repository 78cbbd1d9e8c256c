//! The accept loop, the admin endpoints and the per-request path from a client's request to an
//! upstream's stack.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tower::ServiceExt;

use crate::body::{self, Body, TimeoutKind};
use crate::config::Config;
use crate::error::ProxyError;
use crate::forward::buffer::{self, BodyBounds};
use crate::forward::{self, ProxyRequest, RequestCtx};
use crate::metrics::{self, Metrics};
use crate::router::{self, Router, Upstream};

/// Everything a connection needs to serve requests.
pub struct App {
    router: Router,
    metrics: Metrics,
    ready: AtomicBool,
    admin_on_main: bool,
    drain_timeout: Duration,
}

impl App {
    pub fn new(config: &Config) -> Arc<Self> {
        let metrics = Metrics::new();
        Arc::new(Self {
            router: Router::new(&config.upstreams, config.max_buffered_bytes, &metrics),
            metrics,
            ready: AtomicBool::new(false),
            admin_on_main: config.admin_listen.is_none(),
            drain_timeout: config.drain_timeout.0,
        })
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
        let upstream = match self.route(&req) {
            Ok(upstream) => Arc::clone(upstream),
            Err(e) => {
                self.metrics.unrouted_error(e.label());
                tracing::info!(method, status = e.status().as_u16(), error = e.label(), detail = %e, "refused");
                return e.into_response();
            }
        };
        let result = self.forward(&upstream, req, peer, start).await;
        let (response, attempts, detail) = match result {
            Ok((response, attempts)) => (response, attempts, None),
            Err((e, attempts)) => (e.into_response(), attempts, Some(e.to_string())),
        };
        tracing::info!(
            upstream = %upstream.name,
            method,
            status = response.status().as_u16(),
            attempts,
            duration_ms = start.elapsed().as_millis() as u64,
            corral_error = response.headers().get(crate::error::CORRAL_ERROR_HEADER).and_then(|v| v.to_str().ok()),
            detail,
            "request"
        );
        response
    }

    /// The upstream for a request, or why corral refuses it: a method it does not proxy, an
    /// absolute-form target, a path that could leave its route, or no route at all.
    fn route(&self, req: &Request<Incoming>) -> Result<&Arc<Upstream>, ProxyError> {
        if req.method() == Method::CONNECT {
            return Err(ProxyError::Connect);
        }
        if forward::proxied_method(req.method()).is_none() {
            let shown: String = req.method().as_str().chars().take(32).collect();
            return Err(ProxyError::MethodNotAllowed(shown));
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
    ) -> Result<(Response<Body>, u32), (ProxyError, u32)> {
        let (parts, incoming) = req.into_parts();
        let refuse = |e: ProxyError| {
            upstream.metrics.request(&parts.method, e.status().as_u16());
            upstream.metrics.corral_error(e.label());
            (e, 0)
        };
        let uri = upstream
            .target(parts.uri.path(), parts.uri.query())
            .ok_or_else(|| {
                refuse(ProxyError::NoRoute(
                    parts.uri.path().chars().take(256).collect(),
                ))
            })?;
        let deadlines = forward::deadline(start, upstream.deadline, &parts.headers);
        let bounds = BodyBounds {
            limit: upstream.body_limit,
            idle: upstream.body_idle_timeout,
            deadline: deadlines.head,
        };
        let (body, held) = buffer::read_body(incoming, bounds, self.router.buffer())
            .await
            .map_err(&refuse)?;
        let ctx = Arc::new(RequestCtx::new(start, deadlines.head));
        let headers = forward::upstream_headers(
            parts.headers,
            peer.ip(),
            &upstream.inject,
            upstream.header_mode,
        );
        let request = ProxyRequest {
            method: parts.method,
            uri,
            headers,
            body,
            ctx: Arc::clone(&ctx),
        };
        let result = upstream.stack.clone().oneshot(request).await;
        // The stack is done with the request body, every retry included: its room goes back.
        drop(held);
        match result {
            Ok(response) => {
                let metrics = upstream.metrics.clone();
                let cut = move |kind: TimeoutKind| {
                    metrics.stream_timeout(kind);
                    tracing::warn!(
                        upstream = metrics.name(),
                        kind = kind.label(),
                        "response body cut: {kind}"
                    );
                };
                let idle = upstream.stream_idle_timeout;
                let response = response.map(|b| forward::time_response(b, idle, deadlines, cut));
                Ok((response, ctx.attempts()))
            }
            Err(e) => Err((e, ctx.attempts())),
        }
    }

    /// `/healthz`, `/readyz`, `/metrics`, `/status`; `None` for any other path.
    fn admin<B>(&self, req: &Request<B>) -> Option<Response<Body>> {
        let (status, content_type, text) = match req.uri().path() {
            "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
            "/readyz" if self.ready.load(Ordering::SeqCst) => {
                (StatusCode::OK, "text/plain", "ready\n".to_owned())
            }
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
            _ => return None,
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
            "ready": self.ready.load(Ordering::SeqCst),
            "upstreams": upstreams,
        });
        serde_json::to_string_pretty(&json).expect("JSON values serialize")
    }
}

/// Serve `listener` (and `admin`, if given) until `shutdown` resolves, then drain: readiness
/// flips to false, the listeners close, and in-flight requests (streams included) get up to the
/// configured drain timeout to finish.
pub async fn run(
    app: Arc<App>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    builder.http2().timer(TokioTimer::new());
    app.ready.store(true, Ordering::SeqCst);
    tracing::info!(addr = %listener.local_addr()?, "corral listening");
    if let Some(admin) = &admin {
        tracing::info!(addr = %admin.local_addr()?, "admin endpoints listening");
    }
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            conn = listener.accept() => conn.map(|c| (c, false)),
            conn = accept_opt(admin.as_ref()) => conn.map(|c| (c, true)),
        };
        let ((stream, peer), is_admin) = match accepted {
            Ok(conn) => conn,
            Err(e) => {
                // Out of file descriptors and the like: back off rather than spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = Arc::clone(&app);
        let service = hyper::service::service_fn(move |req| {
            let app = Arc::clone(&app);
            async move {
                let response = if is_admin {
                    app.admin(&req).unwrap_or_else(|| {
                        ProxyError::NoRoute(req.uri().path().to_owned()).into_response()
                    })
                } else {
                    app.handle(req, peer).await
                };
                Ok::<_, Infallible>(response)
            }
        });
        let conn = graceful.watch(
            builder
                .serve_connection(TokioIo::new(stream), service)
                .into_owned(),
        );
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    app.ready.store(false, Ordering::SeqCst);
    drop(listener);
    drop(admin);
    let in_flight: i64 = app
        .router
        .upstreams()
        .iter()
        .map(|u| u.metrics.in_flight.get())
        .sum();
    tracing::info!(in_flight, drain_timeout = ?app.drain_timeout, "draining");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("drained; all connections closed"),
        () = tokio::time::sleep(app.drain_timeout) => {
            let cut: i64 = app.router.upstreams().iter().map(|u| u.metrics.in_flight.get()).sum();
            tracing::warn!(cut, "drain timeout passed; cutting remaining requests");
        }
    }
    Ok(())
}

async fn accept_opt(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}
