//! Builds the per-upstream tower stack.
//!
//! Order, outermost first (a request passes down, its response back up):
//!
//! 0. [`CatchPanicLayer`]: outside everything, so a panic in any layer below, or in the client,
//!    is answered with a 500 `internal` (and counted) instead of a closed connection with no
//!    reply. A panic in a response body already streaming is not caught: its head has gone.
//! 1. [`metrics`]: one call per client request: counts, duration, in-flight until the body ends;
//!    marks when the request entered the stack (the start of its `held` time in the log line).
//! 2. [`concurrency`]: the window and its bounded FIFO queue (interactive requests ahead of
//!    queued batch ones: [`priority`]). Outside Retry, so a request keeps
//!    its slot across its retries (a retry never queues behind newer requests), and the slot
//!    moves into the response body: a stream is in flight until its last byte.
//! 3. [`retry`]: re-calls everything below it, so each of the following sees every attempt.
//!    Throttles (429, 529) are retried for as long as the deadline allows, failures within
//!    `max_retries` and the budget: a retried 429 goes straight back to (5), which the 429 has
//!    paused, and takes a token there like a first attempt, so it adds no load.
//! 4. [`breaker`]: every attempt passes the gate (a retry that bypassed it would recreate the
//!    herd) and reports its outcome. Before the rate limiter, so requests held by an open
//!    breaker take no tokens, and when it closes they are paced out by (5), never all at once.
//! 5. [`rate_limit`]: configured ceilings and learned pacing, taken by every attempt, first and
//!    retries alike; it learns from every attempt's answer, and a 429 pauses its partition
//!    until the hint passes. It owns throttles; the retry budget and the breaker own failures.
//! 6. [`timeout`]: per-try time to response head (bounded by the deadline), attempt metrics;
//!    marks when the first attempt got past every gate (the end of its `held` time).
//!
//! The innermost service is the pooled [`UpstreamClient`](crate::client::UpstreamClient).
//!
//! A panic while a std mutex of the stack is held poisons it; every layer takes its mutexes
//! through [`crate::sync::lock`], which ignores the poison, so one panic costs one request.

pub mod breaker;
pub mod concurrency;
pub mod layer;
pub mod metrics;
pub mod priority;
pub mod rate_limit;
pub mod retry;
pub mod timeout;

use std::future::Future;
use std::sync::Arc;

use http::Response;
use tower::ServiceBuilder;

use crate::body::Body;
use crate::client::{Handshakes, UpstreamClient};
use crate::config::{ConcurrencyMode, UpstreamConfig};
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{CatchPanicLayer, StackFuture};

/// A built stack: clone it per request (clones share all state, and a clone is one reference
/// count). Every layer is always ready, so it is called without waiting for readiness.
#[derive(Clone)]
pub struct Stack(Arc<dyn Call>);

impl Stack {
    /// `service` behind one `Arc`: a request clones the service's own handles on the stack,
    /// where a boxed clonable service would box a clone of it, and box its future again.
    /// `service` must always be ready (every corral layer is: waiting happens in the call),
    /// since it is called without `poll_ready`.
    pub(crate) fn new<S: Call + 'static>(service: S) -> Self {
        Self(Arc::new(service))
    }

    /// Send one request through the stack, without taking a count on it: the future owns
    /// what it needs (tower's `oneshot` would take a clone of the stack first).
    pub fn send(&self, req: ProxyRequest) -> StackFuture {
        self.0.call_cloned(req)
    }
}

/// A service called through a shared reference: a clone of it takes the request.
pub(crate) trait Call: Send + Sync {
    fn call_cloned(&self, req: ProxyRequest) -> StackFuture;
}

impl<S> Call for S
where
    S: tower::Service<
            ProxyRequest,
            Response = Response<Body>,
            Error = ProxyError,
            Future = StackFuture,
        > + Clone
        + Send
        + Sync,
{
    fn call_cloned(&self, req: ProxyRequest) -> StackFuture {
        self.clone().call(req)
    }
}

impl tower::Service<ProxyRequest> for Stack {
    type Response = Response<Body>;
    type Error = ProxyError;
    type Future = StackFuture;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), ProxyError>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: ProxyRequest) -> StackFuture {
        self.0.call_cloned(req)
    }
}

impl layer::Next for UpstreamClient {
    fn send(&self, req: ProxyRequest) -> impl Future<Output = layer::Answer> + Send + '_ {
        UpstreamClient::send(self, req)
    }
}

/// Handles on the stack's shared state, for `/status`.
#[derive(Clone)]
pub struct StackState {
    pub window: Arc<concurrency::Window>,
    pub breaker: Option<Arc<breaker::BreakerShared>>,
    pub rate_limit: Arc<rate_limit::RateLimitShared>,
    /// The retry budget a group's hedges draw on.
    pub retry: Arc<retry::RetryShared>,
}

impl StackState {
    /// Take on what `old` learned that a config change does not undo (a reload rebuilt the
    /// upstream under the same name): its breaker's state and its 429 pauses.
    pub fn carry_from(&self, old: &StackState) {
        if let (Some(breaker), Some(was)) = (&self.breaker, &old.breaker) {
            breaker.carry_from(was);
        }
        self.rate_limit.carry_from(&old.rate_limit);
    }

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
pub fn build(
    config: &UpstreamConfig,
    metrics: &UpstreamMetrics,
    fleet: Option<&Arc<Fleet>>,
) -> (Stack, StackState) {
    let handshakes = Arc::default();
    let client = UpstreamClient::new(
        config.name(),
        config.connect_timeout.0,
        config.extra_roots(),
        Arc::clone(&handshakes),
    );
    build_on(client, config, metrics, fleet, handshakes)
}

/// The stack for one upstream in front of `client` (tests put a fake upstream there), whose
/// connections' times are in `handshakes`.
fn build_on<C>(
    client: C,
    config: &UpstreamConfig,
    metrics: &UpstreamMetrics,
    fleet: Option<&Arc<Fleet>>,
    handshakes: Arc<Handshakes>,
) -> (Stack, StackState)
where
    C: layer::Next,
{
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
    let rate_limit =
        rate_limit::RateLimitShared::new(config, metrics.clone(), fleet.cloned(), handshakes);
    let retry = retry::RetryShared::new(&config.retry, metrics.clone());
    let service = ServiceBuilder::new()
        // 0. Outside everything: a panic anywhere below is a 500 `internal`, never no reply.
        .layer(CatchPanicLayer::new(metrics.clone()))
        // 1. One observation per client request, streams counted to the end.
        .layer(metrics::layer(metrics.clone()))
        // 2. One slot per client request, held across retries and until the body ends.
        .layer(concurrency::ConcurrencyLayer::new(Arc::clone(&window)))
        // 3. Re-runs 4-6 for each attempt.
        .layer(retry::RetryLayer::new(Arc::clone(&retry)))
        // 4. Every attempt passes the breaker (optional: `breaker.enabled = false`).
        .option_layer(breaker.clone().map(breaker::BreakerLayer::new))
        // 5. Every attempt takes its tokens; every answer teaches the pacers.
        .layer(rate_limit::RateLimitLayer::new(Arc::clone(&rate_limit)))
        // 6. Per-try timeout and per-attempt metrics, right before the wire.
        .layer(timeout::layer(
            config.retry.per_try_timeout.0,
            metrics.clone(),
            retry.room(),
        ))
        .service(client);
    let state = StackState {
        window,
        breaker,
        rate_limit,
        retry,
    };
    (Stack::new(service), state)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use futures_util::FutureExt;
    use http::{HeaderValue, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::body::Body;
    use crate::config::types::parse_base_url;
    use crate::config::PartitionScope;
    use crate::metrics::Metrics;

    fn config() -> UpstreamConfig {
        UpstreamConfig::new("t", "/v1", parse_base_url("http://127.0.0.1:1").unwrap())
    }

    fn request(key: &str) -> ProxyRequest {
        let mut req = ProxyRequest::for_test("http://127.0.0.1:1/v1/x", Duration::from_secs(60));
        let value = HeaderValue::from_str(&format!("Bearer {key}")).unwrap();
        Arc::make_mut(&mut req.headers).insert("authorization", value);
        req
    }

    fn ok() -> Response<Body> {
        Response::new(crate::body::full("ok"))
    }

    /// Answers 200, except that call number `panic_on` (0-based) panics: in `call` itself when
    /// `in_call`, else inside its future.
    fn upstream(panic_on: usize, in_call: bool) -> impl layer::Next {
        let calls = Arc::new(AtomicUsize::new(0));
        layer::Tower(tower::service_fn(move |_req: ProxyRequest| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            assert!(!(in_call && n == panic_on), "a bug in call");
            async move {
                tokio::task::yield_now().await;
                assert!(n != panic_on, "a bug in the future");
                Ok::<_, ProxyError>(ok())
            }
        }))
    }

    async fn send(stack: &Stack, key: &str) -> (StatusCode, http::HeaderMap, String) {
        let response = stack.clone().oneshot(request(key)).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_panic_below_is_a_500_internal_counted_and_the_next_request_is_served() {
        for in_call in [true, false] {
            let metrics = Metrics::new().upstream("t");
            let (stack, state) = build_on(
                upstream(0, in_call),
                &config(),
                &metrics,
                None,
                Arc::default(),
            );
            let (status, headers, body) = send(&stack, "sk-a").await;
            assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(headers[crate::error::CORRAL_ERROR_HEADER], "internal");
            assert_eq!(headers[http::header::CONTENT_TYPE], "application/json");
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(json["error"]["code"], "internal", "{body}");
            assert_eq!(json["error"]["type"], "corral_error", "{body}");
            assert!(
                !body.contains("a bug in"),
                "the panic stays in the log: {body}"
            );
            assert_eq!(metrics.panics.get(), 1);
            // What the panic unwound through was released: slot, gauge.
            assert_eq!(state.window.in_use(), 0);
            assert_eq!(metrics.in_flight.get(), 0);
            let (status, _, body) = send(&stack, "sk-a").await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
        }
    }

    /// `held`: from entering the stack to the first attempt, past the concurrency queue and the
    /// rate limiter; zero for a request that waited for neither.
    #[tokio::test(start_paused = true)]
    async fn held_is_the_time_spent_in_the_gates_before_the_first_attempt() {
        let queued = {
            let mut config = config();
            config.limits.max_concurrency = std::num::NonZeroU32::new(1).unwrap();
            config
        };
        let paced = {
            let mut config = config();
            config.limits.rpm = std::num::NonZeroU32::new(60);
            config.limits.burst = std::num::NonZeroU32::new(1);
            config
        };
        for (gate, config) in [("queue", queued), ("rate limit", paced)] {
            let slow = tower::service_fn(|_req: ProxyRequest| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Ok::<_, ProxyError>(ok())
            });
            let metrics = Metrics::new().upstream("t");
            let (stack, _) = build_on(layer::Tower(slow), &config, &metrics, None, Arc::default());
            let (first, second) = (request("sk-a"), request("sk-a"));
            let (first_target, second_target) =
                (Arc::clone(&first.target), Arc::clone(&second.target));
            // Each response is dropped at once: a held slot goes back with its body.
            let a = tokio::spawn(stack.clone().oneshot(first).map(|r| r.map(drop)));
            tokio::time::sleep(Duration::from_millis(100)).await;
            let b = tokio::spawn(stack.clone().oneshot(second).map(|r| r.map(drop)));
            a.await.unwrap().unwrap();
            b.await.unwrap().unwrap();
            let never = || -> tokio::time::Instant { unreachable!("both made an attempt") };
            assert_eq!(first_target.ctx.held_until(never), Duration::ZERO, "{gate}");
            let held = second_target.ctx.held_until(never);
            // Queue: until the first is answered (1.5 s); rate limit: a token a second.
            let want = if gate == "queue" { 1400 } else { 900 };
            assert!(
                (want..want + 10).contains(&(held.as_millis() as u64)),
                "{gate}: held {held:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_poisoned_lock_costs_no_later_request() {
        let mut config = config();
        config.limits.partition = Some(PartitionScope::ApiKey);
        config.concurrency = ConcurrencyMode::Auto;
        let metrics = Metrics::new().upstream("t");
        let (stack, state) = build_on(
            upstream(usize::MAX, false),
            &config,
            &metrics,
            None,
            Arc::default(),
        );
        assert_eq!(send(&stack, "sk-a").await.0, StatusCode::OK);
        state.window.poison_locks();
        state.breaker.as_ref().unwrap().poison_locks();
        state.rate_limit.poison_locks();
        for key in ["sk-a", "sk-b", "sk-a"] {
            let (status, _, body) = send(&stack, key).await;
            assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"), "{key}");
        }
        assert_eq!(metrics.panics.get(), 0);
        let status = state.status();
        assert_eq!(status["rate_limit"]["partitions"], 2, "{status}");
    }
}
