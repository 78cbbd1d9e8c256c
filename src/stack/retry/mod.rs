//! Retry: every retryable answer is tried again, after a sleep of
//! `max(server hint, jittered backoff) + U(0, floor_jitter)` (the jitter on top of a hint only),
//! while attempts, the retry budget and the request's deadline allow. Giving up passes the
//! upstream's last answer through, with `x-should-retry: false` when corral did retry, so the
//! client's own loop does not multiply the load again.
//!
//! Classification (`policy`) is apart from the schedule (`backoff`, `hints`, the budget), as in
//! Vector's `RetryLogic` vs `FibonacciRetryPolicy`. tower's `Retry` is not used: its policy can't
//! read a response body (needed to tell `insufficient_quota` from a transient 429) or pass the
//! last answer through on giving up; tower's `TpsBudget` is.

pub mod backoff;
mod body;
pub mod hints;
pub mod policy;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Response};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};
use tower::ServiceExt;

use self::backoff::Backoff;
use self::policy::{judge_response, Verdict};
use crate::body::{self as corral_body, Body};
use crate::config::RetryConfig;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{BoxFuture, Middleware, Next, Shared};

/// Retryable answers' bodies are buffered (to read their error code and to replay them on
/// giving up) up to this size; larger ones pass through unretried.
const MAX_BUFFERED_ERROR: usize = 64 * 1024;

/// State shared by every request to one upstream.
pub struct RetryShared {
    config: RetryConfig,
    backoff: Backoff,
    budget: TpsBudget,
    rng: Mutex<SmallRng>,
    metrics: UpstreamMetrics,
}

impl RetryShared {
    /// The RNG is seeded from the OS, once per upstream.
    pub fn new(config: &RetryConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        Self::with_rng(config, metrics, SmallRng::from_os_rng())
    }

    /// With a given RNG (tests seed it).
    pub fn with_rng(config: &RetryConfig, metrics: UpstreamMetrics, rng: SmallRng) -> Arc<Self> {
        Arc::new(Self {
            backoff: Backoff {
                base: config.base.0,
                cap: config.cap.0,
                jitter: config.jitter,
            },
            budget: TpsBudget::new(
                config.budget_ttl.0,
                config.budget_min_per_second,
                config.budget_ratio as f32,
            ),
            rng: Mutex::new(rng),
            config: config.clone(),
            metrics,
        })
    }

    fn sleep_for(&self, retry: u32, previous: Duration, hint: Option<Duration>) -> Duration {
        let mut rng = self.rng.lock().expect("rng lock");
        let backoff = self.backoff.sleep(retry, previous, &mut *rng);
        match hint {
            Some(hint) if hint >= backoff => {
                let floor_jitter = self.config.floor_jitter.0;
                let extra = if floor_jitter.is_zero() {
                    Duration::ZERO
                } else {
                    Duration::from_secs_f64(rng.random_range(0.0..floor_jitter.as_secs_f64()))
                };
                hint + extra
            }
            _ => backoff,
        }
    }
}

/// Retry as a tower layer.
pub type RetryLayer = Shared<RetryShared>;

impl Middleware for RetryShared {
    fn call<S: Next>(self: Arc<Self>, next: S, req: ProxyRequest) -> BoxFuture {
        Box::pin(run(next, req, self))
    }
}

/// The last retryable answer, kept to pass through when corral gives up.
enum Last {
    Response(http::response::Parts, Bytes),
    Error(ProxyError),
}

async fn run<S>(
    inner: S,
    req: ProxyRequest,
    shared: Arc<RetryShared>,
) -> Result<Response<Body>, ProxyError>
where
    S: tower::Service<ProxyRequest, Response = Response<Body>, Error = ProxyError> + Clone,
{
    let config = &shared.config;
    let metrics = &shared.metrics;
    shared.budget.deposit();
    let mut retries = 0u32;
    let mut previous = Duration::ZERO;
    let mut previous_answer: Option<Last> = None;
    loop {
        let result = inner.clone().oneshot(req.clone()).await;
        let (last, reason, hint) = match result {
            Ok(response) => {
                if !may_retry(&response) {
                    return Ok(response);
                }
                let (parts, body) = response.into_parts();
                let bytes = match body::buffer(body, MAX_BUFFERED_ERROR).await {
                    Ok(bytes) => bytes,
                    Err(whole) => return Ok(Response::from_parts(parts, whole)),
                };
                match judge_response(&parts, &bytes, config) {
                    Verdict::Done => {
                        return Ok(Response::from_parts(parts, corral_body::full(bytes)))
                    }
                    Verdict::Retry(reason) => {
                        let hint = hints::retry_hint(&parts.headers, SystemTime::now());
                        (Last::Response(parts, bytes), reason, hint)
                    }
                }
            }
            Err(e) if e.is_retryable() => {
                let reason = if matches!(e, ProxyError::TryTimeout { .. }) {
                    "timeout"
                } else {
                    "connection"
                };
                (Last::Error(e), reason, None)
            }
            // corral's own refusal (deadline, breaker, rate limit) after an earlier upstream
            // answer: the client gets that answer, not corral's.
            Err(e) => {
                return match previous_answer {
                    Some(last) => give_up(last, retries, e.label(), &shared),
                    None => Err(e),
                }
            }
        };
        if retries >= config.max_retries {
            return give_up(last, retries, "max_retries", &shared);
        }
        if !shared.budget.withdraw() {
            metrics.budget_exhausted.inc();
            return give_up(last, retries, "budget", &shared);
        }
        let sleep = shared.sleep_for(retries, previous, hint);
        if Instant::now() + sleep >= req.ctx.deadline {
            return give_up(last, retries, "deadline", &shared);
        }
        previous_answer = Some(last);
        metrics.retry(reason);
        metrics.backoff.observe(sleep.as_secs_f64());
        if let Some(h) = hint {
            metrics.hints_honoured.inc();
            metrics.hint_seconds.inc_by(h.as_secs_f64());
        }
        tracing::debug!(
            upstream = metrics.name(),
            reason,
            retry = retries + 1,
            sleep_ms = sleep.as_millis() as u64,
            "retrying"
        );
        tokio::time::sleep(sleep).await;
        retries += 1;
        previous = sleep;
    }
}

/// Worth buffering the body to judge: a retryable status, or an upstream that says to retry.
fn may_retry(response: &Response<Body>) -> bool {
    let status = response.status().as_u16();
    matches!(status, 429 | 500..=599)
        || crate::classify::should_retry_header(response.headers()) == Some(true)
}

/// Pass the last answer through. Once corral has retried, mark it so the SDKs don't retry again.
fn give_up(
    last: Last,
    retries: u32,
    why: &'static str,
    shared: &RetryShared,
) -> Result<Response<Body>, ProxyError> {
    shared.metrics.gave_up(why);
    match last {
        Last::Response(mut parts, bytes) => {
            if retries > 0 && shared.config.mark_given_up {
                parts
                    .headers
                    .insert("x-should-retry", HeaderValue::from_static("false"));
            }
            Ok(Response::from_parts(parts, corral_body::full(bytes)))
        }
        Last::Error(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
