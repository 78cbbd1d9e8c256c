//! Innermost layer before the client: one call per attempt. Bounds the wait for a response head
//! by the per-try timeout and the request's deadline, and records what every attempt came to
//! (count, latency to head, outcome, throttles) and when the first one went out.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::classify::Outcome;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};
use crate::stack::retry::room::Room;

/// The per-try timeout layer.
pub type TimeoutLayer = SharedLayer<TryTimeout>;

/// Bounds each attempt and records what it came to.
pub struct TryTimeout {
    per_try: Duration,
    metrics: UpstreamMetrics,
    /// Attempts on the wire and answers served, for retries waiting for a place.
    room: Arc<Room>,
}

/// The per-try timeout layer for one upstream; it counts its attempts in `room` (the retry
/// layer's).
pub fn layer(per_try: Duration, metrics: UpstreamMetrics, room: Arc<Room>) -> TimeoutLayer {
    SharedLayer::new(Arc::new(TryTimeout {
        per_try,
        metrics,
        room,
    }))
}

impl Middleware for TryTimeout {
    async fn call<S: Next>(self: &Arc<Self>, next: &S, req: ProxyRequest) -> Answer {
        let start = Instant::now();
        let remaining = req.ctx().deadline.saturating_duration_since(start);
        if remaining.is_zero() {
            return Err(ProxyError::DeadlineExceeded);
        }
        let (per_try, metrics) = (self.per_try, &self.metrics);
        let target = Arc::clone(&req.target);
        let ctx = &target.ctx;
        // The first attempt tells the request when it got past every gate (its `held` time).
        if ctx.count_attempt() == 1 {
            ctx.first_attempt_sent(start);
        }
        let fut = next.send(req);
        // Not past the deadline: `remaining` is counted from `start`.
        let until = start + per_try.min(remaining);
        let sending = self.room.sending();
        let result = match tokio::time::timeout_at(until, fut).await {
            Ok(result) => result,
            Err(_) if per_try <= remaining => Err(ProxyError::TryTimeout {
                upstream: metrics.name().to_owned(),
                timeout: per_try,
            }),
            Err(_) => Err(ProxyError::DeadlineExceeded),
        };
        metrics
            .upstream_duration
            .observe(start.elapsed().as_secs_f64());
        let outcome = Outcome::of(&result);
        let outcome = if matches!(result, Err(ProxyError::DeadlineExceeded)) {
            Outcome::Timeout
        } else {
            outcome
        };
        // Only a connect that failed or a 429 certainly left the upstream's work undone.
        let unsent = match &result {
            Ok(response) => response.status() == http::StatusCode::TOO_MANY_REQUESTS,
            Err(e) => matches!(e, ProxyError::UpstreamConnect { .. }),
        };
        drop(sending);
        if !unsent {
            ctx.reached_upstream();
        }
        if !unsent && result.as_ref().is_ok_and(|r| !r.status().is_server_error()) {
            // A place the upstream held is free again.
            self.room.served(start.elapsed());
        }
        metrics.attempt(outcome.label());
        if let Outcome::Throttled(code) | Outcome::Overloaded(code) = outcome {
            metrics.upstream_throttle(code);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, ServiceExt};

    fn request(deadline: Duration) -> ProxyRequest {
        ProxyRequest::for_test("http://127.0.0.1/v1", deadline)
    }

    #[tokio::test(start_paused = true)]
    async fn per_try_timeout_and_deadline() {
        let m = crate::metrics::Metrics::new().upstream("u");
        let slow = tower::service_fn(|_req: ProxyRequest| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, ProxyError>(http::Response::new(crate::body::full("")))
        });
        let svc = layer(Duration::from_secs(5), m.clone(), Arc::default())
            .layer(crate::stack::layer::Tower(slow));
        let err = svc
            .clone()
            .oneshot(request(Duration::from_secs(30)))
            .await
            .unwrap_err();
        assert!(matches!(err, ProxyError::TryTimeout { .. }), "{err}");
        let err = svc
            .oneshot(request(Duration::from_secs(2)))
            .await
            .unwrap_err();
        assert!(matches!(err, ProxyError::DeadlineExceeded), "{err}");
    }
}
