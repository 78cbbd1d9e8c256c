//! One configured upstream, ready to serve: its config, its built stack and the state its
//! layers share, what it injects and withholds, how a client path maps to its target, and how
//! one request goes through its stack ([`Upstream::send`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{Method, Response, Uri};
use tokio::time::Instant;

use crate::body::{Body, TimeoutKind};
use crate::config::{HeaderMode, Priority, UpstreamConfig};
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::forward::{self, ProxyRequest, RequestCtx};
use crate::metrics::{Metrics, UpstreamMetrics};
use crate::stack::{self, Stack, StackState};

/// What the stack did with a request, for its log line.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tally {
    /// Attempts sent upstream.
    pub attempts: u32,
    /// See [`RequestCtx::held_until`].
    pub held: Duration,
    /// See [`RequestCtx::may_have_reached`].
    pub reached: bool,
}

/// An answer with its tally, or corral's refusal with its tally.
pub type SendResult = Result<(Response<Body>, Tally), (ProxyError, Tally)>;

/// What [`Upstream::send`] sends: the request as it goes to one upstream.
pub struct Attempt<'a> {
    pub method: Method,
    /// The client's, before they are rewritten for the upstream.
    pub headers: http::HeaderMap,
    /// The client's headers the upstream does not receive ([`forward::withheld`]).
    pub withheld: &'a [HeaderName],
    pub uri: Uri,
    pub body: bytes::Bytes,
    pub deadlines: forward::Deadlines,
    /// How long it may wait for capacity ([`RequestCtx::wait_deadline`]).
    pub wait_deadline: Instant,
    pub priority: Priority,
}

/// One configured upstream, ready to serve.
pub struct Upstream {
    /// The config it was built from: a reload keeps this upstream (its learned limits, its
    /// breaker, its queue) when the new config has the same.
    pub config: UpstreamConfig,
    pub name: String,
    pub route: String,
    /// `scheme://authority/base-path` without a trailing slash.
    target_prefix: String,
    /// The base URL's scheme, authority and path (without a trailing slash), for a client path
    /// that goes upstream as it came ([`Upstream::target_of`]).
    base: Option<(Scheme, Authority, String)>,
    /// Made once: a request clones them.
    pub inject: Vec<(HeaderName, HeaderValue)>,
    pub header_mode: HeaderMode,
    /// Every header it injects, a key pool's included.
    pub injects: Vec<HeaderName>,
    /// Whether one of them is a credential ([`forward::withheld`]).
    pub injects_credential: bool,
    /// The client's headers it does not receive on its own route ([`forward::withheld`]); a
    /// group member's are the member's own.
    pub withheld: Vec<HeaderName>,
    /// `body_limit`, at most the buffer budget's cap.
    pub body_limit: usize,
    pub body_idle_timeout: Duration,
    pub stream_idle_timeout: Duration,
    pub deadline: Duration,
    pub metrics: UpstreamMetrics,
    pub stack: Stack,
    /// Shared state of the stack's layers, for `/status`.
    pub state: StackState,
}

impl Upstream {
    pub fn new(
        config: &UpstreamConfig,
        metrics: &Metrics,
        buffer_cap: usize,
        fleet: Option<&Arc<Fleet>>,
    ) -> Self {
        let base = &config.base_url.0;
        let target_prefix = format!(
            "{}://{}{}",
            base.scheme_str().unwrap_or("https"),
            base.authority().map(|a| a.as_str()).unwrap_or_default(),
            config.base_url.path()
        );
        let base_parts = base.scheme().cloned().zip(base.authority().cloned());
        let metrics = metrics.upstream(config.name());
        let (stack, state) = stack::build(config, &metrics, fleet);
        let injects: Vec<HeaderName> = config
            .headers
            .keys()
            .filter_map(|k| HeaderName::from_bytes(k.as_bytes()).ok())
            .collect();
        let injects_credential = !config.keys.is_empty()
            || injects
                .iter()
                .any(|h| forward::CREDENTIAL_HEADERS.contains(h));
        Self {
            withheld: forward::withheld(&injects, injects_credential, &[]),
            injects,
            injects_credential,
            config: config.clone(),
            name: config.name().to_owned(),
            route: config.route().to_owned(),
            target_prefix,
            base: base_parts.map(|(s, a)| (s, a, config.base_url.path().to_owned())),
            // A `{key}` template is filled per attempt from the key pool (`stack/rate_limit/pool`).
            inject: config
                .headers
                .iter()
                .filter(|(_, v)| {
                    config.keys.is_empty() || !v.0.contains(crate::config::KEY_PLACEHOLDER)
                })
                .filter_map(|(k, v)| {
                    let name = HeaderName::from_bytes(k.as_bytes()).ok()?;
                    Some((name, forward::injected_value(&v.0)?))
                })
                .collect(),
            header_mode: config.header_mode,
            body_limit: config.body_limit.0.min(buffer_cap),
            body_idle_timeout: config.body_idle_timeout.0,
            stream_idle_timeout: config.stream_idle_timeout.0,
            deadline: config.retry.deadline.0,
            metrics,
            stack,
            state,
        }
    }

    /// The upstream URI for a client URI (its path already known to match this route).
    pub fn target(&self, uri: &Uri) -> Option<Uri> {
        self.target_of(&self.route, uri)
    }

    /// [`Self::target_under`] for the client's URI `uri`. When the base path is the route
    /// (`/v1` to `https://api.openai.com/v1`), the path and query go upstream as they came:
    /// the URI is put together from parts already parsed, not written out and parsed again.
    pub fn target_of(&self, route: &str, uri: &Uri) -> Option<Uri> {
        let path = uri.path();
        if let (Some((scheme, authority, base_path)), Some(pq)) = (&self.base, uri.path_and_query())
        {
            let rest = path.get(route.len()..);
            if route != "/"
                && base_path == route
                && rest.is_some_and(|r| r.is_empty() || r.starts_with('/'))
            {
                let mut parts = http::uri::Parts::default();
                parts.scheme = Some(scheme.clone());
                parts.authority = Some(authority.clone());
                parts.path_and_query = Some(pq.clone());
                return Uri::from_parts(parts).ok();
            }
        }
        self.target_under(route, path, uri.query())
    }

    /// The upstream URI for a client path that matched `route` (this upstream's, or its group's).
    pub fn target_under(&self, route: &str, path: &str, query: Option<&str>) -> Option<Uri> {
        let rest = if route == "/" {
            path
        } else {
            path.get(route.len()..)?
        };
        let mut uri = String::with_capacity(self.target_prefix.len() + rest.len() + 64);
        uri.push_str(&self.target_prefix);
        if !rest.is_empty() && !rest.starts_with('/') {
            uri.push('/');
        }
        uri.push_str(rest);
        if let Some(q) = query {
            uri.push('?');
            uri.push_str(q);
        }
        // From the `String` itself: parsing a `&str` would copy it once more.
        Uri::try_from(uri).ok()
    }

    /// corral's refusal of a request to this upstream before its stack saw it: counted, no
    /// attempts.
    pub fn refuse(&self, method: &Method, e: ProxyError) -> (ProxyError, Tally) {
        self.metrics.request(method, e.status().as_u16());
        self.metrics.corral_error(e.label());
        (e, Tally::default())
    }

    /// One request through this upstream's stack, its response body timed on the way back.
    pub async fn send(&self, attempt: Attempt<'_>, peer: SocketAddr, start: Instant) -> SendResult {
        let Attempt {
            method,
            headers,
            withheld,
            uri,
            body,
            deadlines,
            wait_deadline,
            priority,
        } = attempt;
        let mut ctx = RequestCtx::new(start, deadlines.head);
        ctx.wait_deadline = wait_deadline;
        ctx.priority = priority;
        let headers = forward::upstream_headers(
            headers,
            peer.ip(),
            &self.inject,
            self.header_mode,
            withheld,
            body.len(),
        );
        let target = Arc::new(forward::Target {
            method,
            uri,
            body,
            ctx,
        });
        let request = ProxyRequest {
            target: Arc::clone(&target),
            headers: Arc::new(headers),
        };
        let result = self.stack.send(request).await;
        let ctx = &target.ctx;
        let tally = |ctx: &RequestCtx| Tally {
            attempts: ctx.attempts(),
            // The clock is read only for a request that never made an attempt.
            held: ctx.held_until(Instant::now),
            reached: ctx.may_have_reached(),
        };
        match result {
            Ok(response) => {
                let metrics = self.metrics.clone();
                let cut = move |kind: TimeoutKind| {
                    metrics.stream_timeout(kind);
                    tracing::warn!(
                        upstream = metrics.name(),
                        kind = kind.label(),
                        "response body cut: {kind}"
                    );
                };
                let idle = self.stream_idle_timeout;
                let response = response.map(|b| forward::time_response(b, idle, deadlines, cut));
                Ok((response, tally(ctx)))
            }
            Err(e) => Err((e, tally(ctx))),
        }
    }
}
