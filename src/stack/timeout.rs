//! Innermost layer before the client: one call per attempt. Bounds the wait for a response head
//! by the per-try timeout and the request's deadline, and records what every attempt came to
//! (count, latency to head, outcome, throttles).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Response;
use tokio::time::Instant;

use crate::body::Body;
use crate::classify::Outcome;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;

#[derive(Clone)]
pub struct TimeoutLayer {
    per_try: Duration,
    metrics: UpstreamMetrics,
}

impl TimeoutLayer {
    pub const fn new(per_try: Duration, metrics: UpstreamMetrics) -> Self {
        Self { per_try, metrics }
    }
}

impl<S> tower::Layer<S> for TimeoutLayer {
    type Service = Timeout<S>;
    fn layer(&self, inner: S) -> Timeout<S> {
        Timeout {
            inner,
            per_try: self.per_try,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Timeout<S> {
    inner: S,
    per_try: Duration,
    metrics: UpstreamMetrics,
}

impl<S> tower::Service<ProxyRequest> for Timeout<S>
where
    S: tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, ProxyError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProxyError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: ProxyRequest) -> Self::Future {
        let remaining = req.ctx.remaining();
        let per_try = self.per_try;
        let metrics = self.metrics.clone();
        let ctx = std::sync::Arc::clone(&req.ctx);
        if remaining.is_zero() {
            return Box::pin(async { Err(ProxyError::DeadlineExceeded) });
        }
        ctx.count_attempt();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let start = Instant::now();
            let result = match tokio::time::timeout(per_try.min(remaining), fut).await {
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
            metrics.attempt(outcome.label());
            if let Outcome::Throttled(code) = outcome {
                metrics.upstream_throttle(code);
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tower::{Layer, ServiceExt};

    fn request(deadline: Duration) -> ProxyRequest {
        let now = Instant::now();
        ProxyRequest {
            method: http::Method::POST,
            uri: "http://127.0.0.1/v1".parse().unwrap(),
            headers: Default::default(),
            body: Default::default(),
            ctx: Arc::new(crate::forward::RequestCtx::new(now, now + deadline)),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn per_try_timeout_and_deadline() {
        let m = crate::metrics::Metrics::new().upstream("u");
        let slow = tower::service_fn(|_req: ProxyRequest| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, ProxyError>(Response::new(crate::body::full("")))
        });
        let svc = TimeoutLayer::new(Duration::from_secs(5), m.clone()).layer(slow);
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
