//! The request path: a client's request routed to an upstream or a group, its body read under
//! the buffer budget, sent through the stack, and logged by the access-log policy.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, Version};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::App;
use crate::access_log::Exchange;
use crate::body::Body;
use crate::error::ProxyError;
use crate::forward;
use crate::forward::buffer::{self, BodyBounds};
use crate::group;
use crate::metrics;
use crate::router::{self, Route};
use crate::upstream::{Attempt, SendResult, Upstream};

impl App {
    /// [`handle`](Self::handle), with a panic anywhere on the way (routing, reading the body,
    /// the stack, which catches its own) answered 500 `internal` instead of an empty reply, and
    /// counted. The stack's own catch-panic layer counts per upstream; this one counts under
    /// `upstream="(none)"`.
    pub(super) async fn handle_caught(
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
                // Boxed: a group's future is several times an upstream's, and every request's
                // future would otherwise be as large, and moved whole.
                Box::pin(group.forward(req, peer, start, router.buffer())).await
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
        let uri = upstream.target(&parts.uri).ok_or_else(|| {
            refuse(ProxyError::NoRoute(
                parts.uri.path().chars().take(256).collect(),
            ))
        })?;
        let asks = forward::Asks::of(&parts.headers);
        let deadlines = asks.deadlines(start, upstream.deadline);
        let priority = asks.priority(upstream.config.priority).map_err(&refuse)?;
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
}
