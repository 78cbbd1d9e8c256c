//! Client-side rate limit for one upstream: configured ceilings (governor buckets for requests
//! and tokens per minute) and the learned pacers, taken by every attempt in FIFO order while its
//! deadline allows; beyond it, a 429 with a Retry-After computed from the bucket. Optionally one
//! set of buckets per API key, keyed by a hash of the credential (never the credential).
//!
//! It sits inside Retry, so retries pay for their tokens like first attempts, and it sees every
//! attempt's answer, which is what the pacers learn from.

pub mod buckets;
pub mod estimate;
pub mod learn;

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use self::buckets::{take, Bucket};
use self::learn::{Answer, Kind, Pacer, Ticket};
use crate::classify::Outcome;
use crate::config::{LearnMode, Partition, UpstreamConfig};
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{BoxFuture, Middleware, Next, Shared};

/// Most partitions kept; requests with further keys share the upstream's default buckets.
const MAX_PARTITIONS: usize = 10_000;

/// The buckets of one partition (the upstream, or one API key of it).
pub struct Buckets {
    turn: tokio::sync::Mutex<()>,
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    pacers: Option<Mutex<[Pacer; 2]>>,
    answered: Notify,
    /// Requests on the slow path (waiting for their turn or for capacity).
    queued: AtomicUsize,
    /// Whether the tokens pacer has learned anything (else token estimates are not needed).
    tokens_learned: AtomicBool,
}

/// Counts a request on the slow path for as long as it is there.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Buckets {
    fn new(config: &UpstreamConfig) -> Self {
        let l = &config.limits;
        let requests = l.rpm.map(|rpm| {
            let burst = l
                .burst
                .unwrap_or_else(|| NonZeroU32::new((rpm.get() / 60).max(1)).expect("non-zero"));
            Bucket::per_minute(rpm, burst)
        });
        let tokens = l.tpm.map(|tpm| {
            let burst = l
                .token_burst
                .unwrap_or_else(|| NonZeroU32::new((tpm.get() / 6).max(1)).expect("non-zero"));
            Bucket::per_minute(tpm, burst)
        });
        let a = &config.adaptive;
        let now = Instant::now();
        // A configured burst is the user's word on the upstream's: slow start may spend it.
        let initial = l.burst.map_or(a.initial_burst, NonZeroU32::get);
        let pacers = (config.rate_limit == LearnMode::Auto).then(|| {
            Mutex::new([
                Pacer::new(Kind::Requests, initial, a.rate_margin, now),
                Pacer::new(Kind::Tokens, a.initial_burst, a.rate_margin, now),
            ])
        });
        Self {
            turn: tokio::sync::Mutex::new(()),
            requests,
            tokens,
            pacers,
            answered: Notify::new(),
            queued: AtomicUsize::new(0),
            tokens_learned: AtomicBool::new(false),
        }
    }

    /// Wait for this request's turn and capacity. Returns the pacers' tickets.
    async fn acquire(
        &self,
        cost: u32,
        deadline: Instant,
        upstream: &str,
    ) -> Result<Option<[Ticket; 2]>, ProxyError> {
        let limited = |retry_after: Duration| ProxyError::RateLimited {
            upstream: upstream.to_owned(),
            retry_after,
        };
        // Fast path: nobody waiting, no governor bucket, and the pacers say go now: no turn to
        // take, no timer. (With a governor bucket the slow path keeps its two takes ordered.)
        if self.queued.load(Ordering::Acquire) == 0
            && self.requests.is_none()
            && self.tokens.is_none()
        {
            let Some(pacers) = &self.pacers else {
                return Ok(None);
            };
            let mut p = pacers.lock().expect("pacer lock");
            let now = Instant::now();
            let units = [1.0, f64::from(cost)];
            if p.iter_mut()
                .zip(units)
                .all(|(pacer, u)| pacer.can_acquire(u, now))
            {
                let mut take = |i: usize| {
                    p[i].try_acquire(units[i], now)
                        .expect("checked under the same lock")
                };
                return Ok(Some([take(0), take(1)]));
            }
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let _queued = Queued(&self.queued);
        let _turn = tokio::time::timeout_at(deadline, self.turn.lock())
            .await
            .map_err(|_| limited(Duration::from_secs(1)))?;
        if let Some(bucket) = &self.requests {
            take(bucket, 1, deadline).await.map_err(limited)?;
        }
        if let Some(bucket) = &self.tokens {
            take(bucket, cost, deadline).await.map_err(limited)?;
        }
        let Some(pacers) = &self.pacers else {
            return Ok(None);
        };
        let mut tickets = [None, None];
        for (i, units) in [1.0, f64::from(cost)].into_iter().enumerate() {
            loop {
                let answered = self.answered.notified();
                let verdict =
                    pacers.lock().expect("pacer lock")[i].try_acquire(units, Instant::now());
                match verdict {
                    Ok(ticket) => {
                        tickets[i] = Some(ticket);
                        break;
                    }
                    Err(Some(wait)) if Instant::now() + wait > deadline => {
                        return Err(limited(wait))
                    }
                    Err(Some(wait)) => {
                        tokio::time::sleep(wait.max(Duration::from_micros(200))).await
                    }
                    Err(None) => {
                        // Slow start: wait for an answer to teach us more (or re-check soon).
                        let wake = (Instant::now() + Duration::from_millis(250)).min(deadline);
                        if Instant::now() >= deadline {
                            return Err(limited(Duration::from_secs(1)));
                        }
                        tokio::select! {
                            () = answered => {}
                            () = tokio::time::sleep_until(wake) => {}
                        }
                    }
                }
            }
        }
        Ok(Some([
            tickets[0].expect("acquired"),
            tickets[1].expect("acquired"),
        ]))
    }

    fn observe(
        &self,
        tickets: [Ticket; 2],
        outcome: Outcome,
        headers: Option<&HeaderMap>,
        metrics: &UpstreamMetrics,
    ) {
        let Some(pacers) = &self.pacers else { return };
        let answer = match outcome {
            Outcome::Throttled(429) => Answer::RateLimited,
            Outcome::Throttled(_) => Answer::Overloaded,
            _ => Answer::Ok,
        };
        let wall = SystemTime::now();
        let now = Instant::now();
        let mut pacers = pacers.lock().expect("pacer lock");
        for (pacer, ticket) in pacers.iter_mut().zip(tickets) {
            let report = headers.and_then(|h| learn::report(h, pacer.kind(), wall));
            pacer.observe(ticket, answer, report, now);
            let kind = pacer.kind().label();
            metrics.learned(kind, pacer.rate(), pacer.burst());
            metrics.limit_source(kind, pacer.source().label());
            if let Some(r) = pacer.last_remaining {
                metrics.remaining(kind, r);
            }
        }
        self.tokens_learned
            .store(pacers[1].source() != learn::Source::None, Ordering::Relaxed);
        drop(pacers);
        if self.queued.load(Ordering::Acquire) > 0 {
            self.answered.notify_waiters();
        }
    }

    /// A JSON view for `/status`.
    pub fn status(&self) -> serde_json::Value {
        let ceiling = |b: &Option<Bucket>| {
            b.as_ref().map(
                |b| serde_json::json!({"per_second": b.per_second(), "burst": b.burst().get()}),
            )
        };
        let learned = self.pacers.as_ref().map(|p| {
            let p = p.lock().expect("pacer lock");
            p.iter()
                .map(|pacer| {
                    serde_json::json!({
                        "kind": pacer.kind().label(),
                        "source": pacer.source().label(),
                        "rate_per_second": pacer.rate(),
                        "burst": pacer.burst(),
                        "remaining_reported": pacer.last_remaining,
                        "throttles_seen": pacer.throttles,
                    })
                })
                .collect::<Vec<_>>()
        });
        serde_json::json!({
            "config_requests": ceiling(&self.requests),
            "config_tokens": ceiling(&self.tokens),
            "learned": learned,
        })
    }
}

/// Buckets per credential hash.
type PartitionMap = HashMap<u64, Arc<Buckets>>;

/// All partitions of one upstream.
pub struct RateLimitShared {
    default: Arc<Buckets>,
    by_key: Option<(Mutex<PartitionMap>, RandomState)>,
    config: UpstreamConfig,
    metrics: UpstreamMetrics,
}

impl RateLimitShared {
    pub fn new(config: &UpstreamConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        let by_key = (config.limits.partition == Partition::ApiKey)
            .then(|| (Mutex::new(HashMap::new()), RandomState::new()));
        if config.rate_limit == LearnMode::Off {
            let source = |configured: bool| if configured { "config" } else { "none" };
            metrics.limit_source("requests", source(config.limits.rpm.is_some()));
            metrics.limit_source("tokens", source(config.limits.tpm.is_some()));
        }
        Arc::new(Self {
            default: Arc::new(Buckets::new(config)),
            by_key,
            config: config.clone(),
            metrics,
        })
    }

    fn buckets(&self, headers: &HeaderMap) -> Arc<Buckets> {
        let Some((map, hasher)) = &self.by_key else {
            return Arc::clone(&self.default);
        };
        let credential = ["authorization", "x-api-key", "api-key"]
            .iter()
            .find_map(|h| headers.get(*h));
        let Some(credential) = credential else {
            return Arc::clone(&self.default);
        };
        let key = hasher.hash_one(credential.as_bytes());
        let mut map = map.lock().expect("partition lock");
        if let Some(b) = map.get(&key) {
            return Arc::clone(b);
        }
        if map.len() >= MAX_PARTITIONS {
            return Arc::clone(&self.default);
        }
        Arc::clone(
            map.entry(key)
                .or_insert_with(|| Arc::new(Buckets::new(&self.config))),
        )
    }

    pub fn status(&self) -> serde_json::Value {
        let mut v = self.default.status();
        if let Some((map, _)) = &self.by_key {
            v["partitions"] = serde_json::json!(map.lock().expect("partition lock").len());
        }
        v
    }
}

/// The rate limit as a tower layer.
pub type RateLimitLayer = Shared<RateLimitShared>;

impl Middleware for RateLimitShared {
    fn call<S: Next>(self: Arc<Self>, next: S, req: ProxyRequest) -> BoxFuture {
        let shared = self;
        Box::pin(async move {
            let m = &shared.metrics;
            let buckets = shared.buckets(&req.headers);
            // The JSON estimate only where a token bucket will be charged.
            let cost = if buckets.tokens.is_some() || buckets.tokens_learned.load(Ordering::Relaxed)
            {
                estimate::estimate_tokens(&req.body, shared.config.limits.default_max_tokens)
            } else {
                0
            };
            let start = Instant::now();
            let tickets = buckets.acquire(cost, req.ctx.deadline, m.name()).await?;
            m.rate_wait.observe(start.elapsed().as_secs_f64());
            if shared.config.limits.tpm.is_some() {
                m.tokens_charged.inc_by(u64::from(cost));
            }
            let result = next.oneshot(req).await;
            if let Some(tickets) = tickets {
                let headers = result.as_ref().ok().map(Response::headers);
                buckets.observe(tickets, Outcome::of(&result), headers, m);
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::types::parse_base_url;

    #[tokio::test(start_paused = true)]
    async fn a_large_request_is_not_starved_by_small_ones() {
        let mut config =
            UpstreamConfig::new("t", "/v1", parse_base_url("http://127.0.0.1:1").unwrap());
        config.rate_limit = LearnMode::Off;
        config.limits.tpm = NonZeroU32::new(6000); // 100 tokens/s
        config.limits.token_burst = NonZeroU32::new(100);
        let buckets = Arc::new(Buckets::new(&config));
        let deadline = Instant::now() + Duration::from_secs(60);
        buckets.acquire(100, deadline, "t").await.unwrap(); // empties the bucket
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, cost) in [
            ("large", 100),
            ("small-1", 10),
            ("small-2", 10),
            ("small-3", 10),
        ] {
            let (b, order) = (Arc::clone(&buckets), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                b.acquire(cost, deadline, "t").await.unwrap();
                order.lock().unwrap().push(name);
            }));
            tokio::task::yield_now().await; // queue in this order
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["large", "small-1", "small-2", "small-3"]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_capacity_within_the_deadline_is_a_429_with_retry_after() {
        let mut config =
            UpstreamConfig::new("t", "/v1", parse_base_url("http://127.0.0.1:1").unwrap());
        config.rate_limit = LearnMode::Off;
        config.limits.rpm = NonZeroU32::new(60); // 1/s
        config.limits.burst = NonZeroU32::new(1);
        let buckets = Buckets::new(&config);
        let soon = Instant::now() + Duration::from_millis(200);
        buckets.acquire(1, soon, "t").await.unwrap();
        let err = buckets.acquire(1, soon, "t").await.unwrap_err();
        assert_eq!(err.status(), 429);
        assert!(err.retry_after().unwrap() > Duration::from_millis(500));
    }
}
