//! Layer 1, just inside catch-panic: one call per client request. Counts requests by method and
//! status, times them to the response head, keeps the in-flight gauge up until the body's last byte, and counts
//! the bytes sent.

use std::future::Future;
use std::sync::Arc;

use http::StatusCode;
use tokio::time::Instant;

use crate::body::{Guard, Guarded};
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};

/// The metrics layer.
pub type MetricsLayer = SharedLayer<RecordMetrics>;

/// Records one upstream's per-request metrics.
pub struct RecordMetrics {
    metrics: UpstreamMetrics,
}

/// The metrics layer for one upstream.
pub fn layer(metrics: UpstreamMetrics) -> MetricsLayer {
    SharedLayer::new(Arc::new(RecordMetrics { metrics }))
}

/// Lowers the in-flight gauge when the response body is dropped; counts bytes out.
struct InFlight(UpstreamMetrics);

impl Guard for InFlight {
    fn on_data(&mut self, len: usize) {
        self.0.response_bytes.inc_by(len as u64);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

impl Middleware for RecordMetrics {
    fn call<'a, S: Next>(
        self: &'a Arc<Self>,
        next: &'a S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'a {
        let m = &self.metrics;
        m.in_flight.inc();
        m.request_bytes.inc_by(req.target.body.len() as u64);
        if client_retry_count(&req) > 0 {
            m.client_retries.inc();
        }
        let method = req.target.method.clone();
        let start = Instant::now();
        // Where the time corral holds the request (`RequestCtx::held_until`) starts.
        req.ctx().entered_stack(start);
        // Made before the wait, so a request cancelled before its head (client gone) still
        // lowers the gauge when its future is dropped.
        let guard = InFlight(m.clone());
        async move {
            // The rest of the stack made here, not outside: a future both held by this one
            // and awaited in it would take its room twice.
            let result = next.send(req).await;
            m.request_duration.observe(start.elapsed().as_secs_f64());

            match result {
                Ok(response) => {
                    m.request(&method, response.status().as_u16());
                    if response.status() == StatusCode::TOO_MANY_REQUESTS {
                        m.client_throttle("upstream");
                    }
                    Ok(response.map(|b| Guarded::wrap(b, guard)))
                }
                Err(e) => {
                    m.request(&method, e.status().as_u16());
                    m.corral_error(e.label());
                    if e.status() == StatusCode::TOO_MANY_REQUESTS {
                        m.client_throttle("corral");
                    }
                    Err(e)
                }
            }
        }
    }
}

static STAINLESS_RETRY_COUNT: http::HeaderName =
    http::HeaderName::from_static("x-stainless-retry-count");

/// The official SDKs' `x-stainless-retry-count`: how many times the client has retried.
fn client_retry_count(req: &ProxyRequest) -> u32 {
    crate::forward::scan(&req.headers, &STAINLESS_RETRY_COUNT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
