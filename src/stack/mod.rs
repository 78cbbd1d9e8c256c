//! Builds the per-upstream tower stack.
//!
//! Order, outermost first (a request passes down, its response back up):
//!
//! 0. [`metrics`]: one call per client request: counts, duration, in-flight until the body ends.
//!
//! The innermost service is the pooled [`UpstreamClient`](crate::client::UpstreamClient).

pub mod metrics;

use std::sync::Arc;

use http::Response;
use tower::util::BoxCloneSyncService;
use tower::ServiceBuilder;

use crate::body::Body;
use crate::client::UpstreamClient;
use crate::config::UpstreamConfig;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;

/// A built stack: clone it per request (clones share all state).
pub type Stack = BoxCloneSyncService<ProxyRequest, Response<Body>, ProxyError>;

/// Handles on the stack's shared state, for `/status`.
#[derive(Clone, Default)]
pub struct StackState {
    _private: Arc<()>,
}

/// Build the stack for one upstream.
pub fn build(config: &UpstreamConfig, metrics: &UpstreamMetrics) -> (Stack, StackState) {
    let client = UpstreamClient::new(config.name(), config.connect_timeout.0);
    let service = ServiceBuilder::new()
        // Outside everything: one observation per client request, streams counted to the end.
        .layer(metrics::MetricsLayer::new(metrics.clone()))
        .service(client);
    (BoxCloneSyncService::new(service), StackState::default())
}

/// A JSON summary of one upstream's stack for `/status`.
pub fn status(upstream: &crate::router::Upstream) -> serde_json::Value {
    serde_json::json!({
        "name": upstream.name,
        "route": upstream.route,
        "in_flight": upstream.metrics.in_flight.get(),
    })
}
