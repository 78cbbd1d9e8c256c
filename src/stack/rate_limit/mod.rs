//! Client-side rate limit for one upstream: configured ceilings (governor buckets for requests
//! and tokens per minute), the learned pacers, and the pause a 429 puts on its partition; taken
//! by every attempt in FIFO order while its deadline allows; beyond it, a 429 with a Retry-After
//! computed from the bucket. Optionally one partition per API key, keyed by a hash of the
//! credential (never the credential).
//!
//! It sits inside Retry, so retries pay for their tokens like first attempts (which is why a
//! throttled request may be retried for as long as its deadline allows without amplifying load:
//! every retry waits for a token here), and it sees every attempt's answer, which is what the
//! pacers learn from.
//!
//! # Layout
//! - `partition`: one partition's buckets, pacers and pause, and the way through them.
//! - `learn`: the pacers, pure state machines in virtual time.
//! - `bucket`: configured ceilings as governor buckets on tokio's clock.
//! - `estimate`: token estimates of a request body.

pub mod bucket;
pub mod estimate;
pub mod learn;
pub mod partition;

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use http::{HeaderMap, Response};
use tokio::time::Instant;
use tower::ServiceExt;

use self::partition::Partition;
use crate::classify::Outcome;
use crate::config::{self, LearnMode, UpstreamConfig};
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{lock, BoxFuture, Middleware, Next, Shared};

/// Most partitions kept; requests with further keys share the upstream's default partition.
const MAX_PARTITIONS: usize = 10_000;

/// Partitions per credential hash.
type PartitionMap = HashMap<u64, Arc<Partition>>;

/// All partitions of one upstream.
pub struct RateLimitShared {
    /// The upstream's partition, and the one for requests without a credential.
    default: Arc<Partition>,
    /// With `partition = "api_key"`: one per credential hash.
    by_key: Option<(Mutex<PartitionMap>, RandomState)>,
    config: UpstreamConfig,
    metrics: UpstreamMetrics,
}

impl RateLimitShared {
    pub fn new(config: &UpstreamConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        let by_key = (config.limits.partition == config::Partition::ApiKey)
            .then(|| (Mutex::new(HashMap::new()), RandomState::new()));
        if config.rate_limit == LearnMode::Off {
            let source = |configured: bool| if configured { "config" } else { "none" };
            metrics.limit_source("requests", source(config.limits.rpm.is_some()));
            metrics.limit_source("tokens", source(config.limits.tpm.is_some()));
        }
        Arc::new(Self {
            default: Arc::new(Partition::new(config)),
            by_key,
            config: config.clone(),
            metrics,
        })
    }

    fn partition(&self, headers: &HeaderMap) -> Arc<Partition> {
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
        let mut map = lock(map);
        if let Some(b) = map.get(&key) {
            return Arc::clone(b);
        }
        if map.len() >= MAX_PARTITIONS {
            return Arc::clone(&self.default);
        }
        Arc::clone(
            map.entry(key)
                .or_insert_with(|| Arc::new(Partition::new(&self.config))),
        )
    }

    pub fn status(&self) -> serde_json::Value {
        let mut v = self.default.status();
        if let Some((map, _)) = &self.by_key {
            v["partitions"] = serde_json::json!(lock(map).len());
        }
        v
    }
}

#[cfg(test)]
impl RateLimitShared {
    /// Poison every std mutex this holds (tests of [`crate::stack::layer::lock`]).
    pub(crate) fn poison_locks(&self) {
        self.default.poison_locks();
        if let Some((map, _)) = &self.by_key {
            for partition in lock(map).values() {
                partition.poison_locks();
            }
            crate::stack::layer::poison(map);
        }
    }
}

/// The rate limit as a tower layer.
pub type RateLimitLayer = Shared<RateLimitShared>;

impl Middleware for RateLimitShared {
    fn call<S: Next>(self: Arc<Self>, next: S, req: ProxyRequest) -> BoxFuture {
        let shared = self;
        Box::pin(async move {
            let m = &shared.metrics;
            let partition = shared.partition(&req.headers);
            // The JSON estimate only where a token bucket will be charged.
            let cost = if partition.charges_tokens() {
                estimate::estimate_tokens(&req.body, shared.config.limits.default_max_tokens)
            } else {
                0
            };
            let start = Instant::now();
            let tickets = partition.acquire(cost, req.ctx.deadline, m.name()).await?;
            m.rate_wait.observe(start.elapsed().as_secs_f64());
            if shared.config.limits.tpm.is_some() {
                m.tokens_charged.inc_by(u64::from(cost));
            }
            let result = next.oneshot(req).await;
            let outcome = Outcome::of(&result);
            if tickets.is_some() || outcome == Outcome::Throttled(429) {
                let headers = result.as_ref().ok().map(Response::headers);
                partition.observe(tickets, outcome, headers, m);
            }
            result
        })
    }
}
