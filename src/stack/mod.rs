//! Builds the per-upstream tower stack.
//!
//! Order, outermost first (a request passes down, its response back up):
//!
//! 0. [`metrics`]: one call per client request: counts, duration, in-flight until the body ends.
//! 1. [`concurrency`]: the window and its bounded FIFO queue. Outside Retry, so a request keeps
//!    its slot across its retries (a retry never queues behind newer requests), and the slot
//!    moves into the response body: a stream is in flight until its last byte.
//! 2. [`retry`]: re-calls everything below it, so each of the following sees every attempt.
//!    Throttles (429, 529) are retried for as long as the deadline allows, failures within
//!    `max_retries` and the budget: a retried 429 goes straight back to (4), which the 429 has
//!    paused, and takes a token there like a first attempt, so it adds no load.
//! 3. [`breaker`]: every attempt passes the gate (a retry that bypassed it would recreate the
//!    herd) and reports its outcome. Before the rate limiter, so requests held by an open
//!    breaker take no tokens, and when it closes they are paced out by (4), never all at once.
//! 4. [`rate_limit`]: configured ceilings and learned pacing, taken by every attempt, first and
//!    retries alike; it learns from every attempt's answer, and a 429 pauses its partition
//!    until the hint passes. It owns throttles; the retry budget and the breaker own failures.
//! 5. [`timeout`]: per-try time to response head (bounded by the deadline), attempt metrics.
//!
//! The innermost service is the pooled [`UpstreamClient`](crate::client::UpstreamClient).

pub mod breaker;
pub mod concurrency;
pub mod layer;
pub mod metrics;
pub mod rate_limit;
pub mod retry;
pub mod timeout;

use std::sync::Arc;

use http::Response;
use tower::util::BoxCloneSyncService;
use tower::ServiceBuilder;

use crate::body::Body;
use crate::client::UpstreamClient;
use crate::config::{ConcurrencyMode, UpstreamConfig};
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;

/// A built stack: clone it per request (clones share all state).
pub type Stack = BoxCloneSyncService<ProxyRequest, Response<Body>, ProxyError>;

/// Handles on the stack's shared state, for `/status`.
#[derive(Clone)]
pub struct StackState {
    pub window: Arc<concurrency::Window>,
    pub breaker: Option<Arc<breaker::BreakerShared>>,
    pub rate_limit: Arc<rate_limit::RateLimitShared>,
}

impl StackState {
    /// A JSON view of the stack's state (the server adds the upstream's name and route).
    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "concurrency": {"limit": self.window.limit(), "in_use": self.window.in_use(), "queued": self.window.waiting()},
            "breaker": self.breaker.as_ref().map(|b| b.phase().name()),
            "rate_limit": self.rate_limit.status(),
        })
    }
}

/// Build the stack for one upstream.
pub fn build(config: &UpstreamConfig, metrics: &UpstreamMetrics) -> (Stack, StackState) {
    let client = UpstreamClient::new(config.name(), config.connect_timeout.0);
    let limits = &config.limits;
    let a = &config.adaptive;
    let window = match config.concurrency {
        ConcurrencyMode::Fixed => concurrency::Window::new(
            limits.max_concurrency.get(),
            limits.queue_size,
            limits.queue_timeout.0,
            metrics.clone(),
        ),
        // `max_concurrency` stays the hard ceiling.
        ConcurrencyMode::Auto => concurrency::Window::adaptive(
            a.initial_concurrency,
            a.min_concurrency,
            limits.max_concurrency.get(),
            a.latency_tolerance,
            limits.queue_size,
            limits.queue_timeout.0,
            metrics.clone(),
        ),
    };
    let breaker = config
        .breaker
        .enabled
        .then(|| breaker::BreakerShared::new(&config.breaker, metrics.clone()));
    let rate_limit = rate_limit::RateLimitShared::new(config, metrics.clone());
    let retry = retry::RetryShared::new(&config.retry, metrics.clone());
    let service = ServiceBuilder::new()
        // 0. Outside everything: one observation per client request, streams counted to the end.
        .layer(metrics::layer(metrics.clone()))
        // 1. One slot per client request, held across retries and until the body ends.
        .layer(concurrency::ConcurrencyLayer::new(Arc::clone(&window)))
        // 2. Re-runs 3-5 for each attempt.
        .layer(retry::RetryLayer::new(retry))
        // 3. Every attempt passes the breaker (optional: `breaker.enabled = false`).
        .option_layer(breaker.clone().map(breaker::BreakerLayer::new))
        // 4. Every attempt takes its tokens; every answer teaches the pacers.
        .layer(rate_limit::RateLimitLayer::new(Arc::clone(&rate_limit)))
        // 5. Per-try timeout and per-attempt metrics, right before the wire.
        .layer(timeout::layer(
            config.retry.per_try_timeout.0,
            metrics.clone(),
        ))
        .service(client);
    let state = StackState {
        window,
        breaker,
        rate_limit,
    };
    (BoxCloneSyncService::new(service), state)
}
