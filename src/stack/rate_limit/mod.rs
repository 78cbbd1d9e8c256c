//! Client-side rate limit for one upstream: configured ceilings (token buckets for requests
//! and tokens per minute), the learned pacers, and the pause a 429 puts on its partition; taken
//! by every attempt in FIFO order while its deadline allows; beyond it, a 429 with a Retry-After
//! computed from the bucket. Partitions follow how providers scope their limits: by default
//! one per credential and model (the model read from the JSON body, through `model_groups`;
//! requests without either share the upstream's), keyed by a hash (never the credential); at
//! most [`MAX_PARTITIONS`] of them, idle ones evicted to make room for new ones.
//!
//! It sits inside Retry, so retries pay for their tokens like first attempts (which is why a
//! throttled request may be retried for as long as its deadline allows without amplifying load:
//! every retry waits for a token here), and it sees every attempt's answer, which is what the
//! pacers learn from.
//!
//! # Layout
//! - `partition`: one partition's buckets, pacers and pause, and the way through them.
//! - `learn`: the pacers, pure state machines in virtual time.
//! - `bucket`: configured ceilings as token buckets on tokio's clock.
//! - `estimate`: token estimates of a request body.
//! - `pool`: several credentials for one upstream (`keys`), a partition each (and one per key
//!   and model in the map of partitions, when the scope includes the model).

/// The token bucket, kept below both of its users (this limiter and the fleet).
pub use crate::bucket;
pub mod estimate;
pub mod learn;
pub mod partition;
pub mod pool;
pub mod usage;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response, StatusCode};
use tokio::time::Instant;

use self::estimate::Estimate;
use self::partition::Partition;
use self::pool::Pool;
use crate::body::Body;
use crate::classify::{Outcome, Throttle};
use crate::client::Handshakes;
use crate::config::{self, LearnMode, UpstreamConfig};
use crate::error::ProxyError;
use crate::fleet::Fleet;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};
use crate::stack::retry::{buffer_error, replay};
use crate::sync::lock;

/// Most partitions kept. When full, a new key evicts the partitions idle for
/// [`PARTITION_IDLE`]; only if none is idle does it share the upstream's default partition (a
/// pooled key's model: the key's own partition) until a later sweep finds room.
pub const MAX_PARTITIONS: usize = 10_000;

/// A partition no request has taken for this long, none holds, and no 429 pauses, may be
/// evicted. What it loses is its learned pace: by then the provider's per-minute buckets have
/// long refilled, and slow start relearns it.
pub const PARTITION_IDLE: Duration = Duration::from_secs(10 * 60);

/// A full map is swept for idle partitions at most this often, so a flood of new keys against
/// a map of busy ones costs one scan a second, not one per request.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One partition of credential and model, and when a request last took it.
struct Keyed {
    partition: Arc<Partition>,
    last_used: Instant,
    /// For `/status`: the model (or limit group), and whether a credential names it too (the
    /// credential itself is never kept).
    model: Option<Box<str>>,
    keyed: bool,
}

/// Tickets admitted and not yet answered; dropped with its request, it gives them up, so a
/// cancelled request does not count as in flight until the pacer forgets it.
struct Unanswered<'a> {
    partition: &'a Partition,
    tickets: Option<partition::Tickets>,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(tickets) = self.tickets.take() {
            self.partition.abandon(tickets);
        }
    }
}

/// The hasher of every upstream's partition keys, one for the process's life: an upstream a
/// reload rebuilds finds each partition under the hash it had.
fn partition_hasher() -> RandomState {
    static HASHER: std::sync::OnceLock<RandomState> = std::sync::OnceLock::new();
    HASHER.get_or_init(RandomState::new).clone()
}

/// Partitions listed by name in `/status`, the most recently used first.
const STATUS_PARTITIONS: usize = 32;

/// Partitions per hash of credential and model.
#[derive(Default)]
struct PartitionMap {
    by_hash: HashMap<u64, Keyed>,
    last_sweep: Option<Instant>,
}

impl PartitionMap {
    /// Evict what may be evicted at `now` (rate-limited by [`SWEEP_EVERY`]); whether there is
    /// room for a new partition.
    fn make_room(&mut self, now: Instant) -> bool {
        if self.by_hash.len() < MAX_PARTITIONS {
            return true;
        }
        if self
            .last_sweep
            .is_some_and(|at| now.saturating_duration_since(at) < SWEEP_EVERY)
        {
            return false;
        }
        self.last_sweep = Some(now);
        // Under the map's lock no one else can take a clone, so a count of 1 stays 1.
        self.by_hash.retain(|_, k| {
            now.saturating_duration_since(k.last_used) < PARTITION_IDLE
                || Arc::strong_count(&k.partition) > 1
                || k.partition.is_paused(now)
        });
        self.by_hash.len() < MAX_PARTITIONS
    }
}

/// All partitions of one upstream.
pub struct RateLimitShared {
    /// The upstream's partition, and the one for requests without a credential.
    default: Arc<Partition>,
    /// Unless `partition = "upstream"`: one per hash of credential and model.
    by_key: Option<(Mutex<PartitionMap>, RandomState)>,
    /// What the key is made of.
    scope: config::PartitionScope,
    config: UpstreamConfig,
    metrics: UpstreamMetrics,
    /// With `[fleet]`: every partition leases from the fleet's shared buckets.
    fleet: Option<Arc<Fleet>>,
    /// With `keys`: a partition per pooled key (its partitions per model are in `by_key`).
    pool: Option<Pool>,
    /// Tokens the upstream counted per prompt token estimated.
    prompt_ratio: Arc<PromptRatio>,
    /// The upstream's connection times, every partition's first measure of the round trip.
    handshakes: Arc<Handshakes>,
}

/// Tokens the upstream counted per prompt token estimated (characters / 4), smoothed over the
/// answers' `usage`: the estimate calibrates itself to the provider's tokenizer.
pub struct PromptRatio(AtomicU64);

impl PromptRatio {
    /// Prompts shorter than this (estimated) teach nothing: rounding swamps them.
    const MIN_PROMPT: u32 = 16;
    /// The ratio stays within these.
    const RANGE: (f64, f64) = (0.25, 4.0);

    fn new() -> Self {
        Self(AtomicU64::new(1.0f64.to_bits()))
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    /// One answer's evidence: `counted` input tokens for `estimated` prompt tokens.
    pub fn learn(&self, estimated: u32, counted: u64) {
        if estimated < Self::MIN_PROMPT || counted == 0 {
            return;
        }
        let sample = (counted as f64 / f64::from(estimated)).clamp(Self::RANGE.0, Self::RANGE.1);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((0.9 * f64::from_bits(bits) + 0.1 * sample).to_bits())
            });
    }
}

impl RateLimitShared {
    pub fn new(
        config: &UpstreamConfig,
        metrics: UpstreamMetrics,
        fleet: Option<Arc<Fleet>>,
        handshakes: Arc<Handshakes>,
    ) -> Arc<Self> {
        let scope = config.partition();
        let by_key = (scope != config::PartitionScope::Upstream)
            .then(|| (Mutex::default(), partition_hasher()));
        if config.rate_limit == LearnMode::Off {
            let source = |configured: bool| if configured { "config" } else { "none" };
            let gauges = metrics.pacing(crate::metrics::NO_MODEL);
            gauges.limit_source("requests", source(config.limits.rpm.is_some()));
            gauges.limit_source("tokens", source(config.limits.tpm.is_some()));
        }
        Arc::new(Self {
            default: Arc::new(
                Partition::new(config, fleet.as_ref().map(|f| (f, None))).measured(&handshakes),
            ),
            by_key,
            scope,
            config: config.clone(),
            metrics,
            pool: Pool::new(config, fleet.as_ref(), &handshakes),
            fleet,
            prompt_ratio: Arc::new(PromptRatio::new()),
            handshakes,
        })
    }

    /// The partition of a request with the `headers` it goes upstream with (its credential is
    /// the first of [`crate::forward::CREDENTIAL_HEADERS`] it carries) and `body`, taken at
    /// `now`.
    fn partition(&self, headers: &HeaderMap, body: &[u8], now: Instant) -> Arc<Partition> {
        if self.by_key.is_none() {
            return Arc::clone(&self.default);
        }
        // `headers` are those going upstream: the client's credentials an upstream that
        // injects its own withholds are gone, so a client's junk makes no partitions.
        let credential = (self.scope.by_key())
            .then(|| crate::forward::credential(headers))
            .flatten()
            .map(|v| v.as_bytes());
        let model = self.model(body);
        self.keyed(credential, model.as_deref(), true, now)
            .unwrap_or_else(|| Arc::clone(&self.default))
    }

    /// The model (or its limit group) a request's partition is keyed by, when the scope
    /// includes the model and the body names one.
    fn model<'a>(&'a self, body: &'a [u8]) -> Option<std::borrow::Cow<'a, str>> {
        self.by_key.as_ref()?;
        self.scope
            .by_model()
            .then(|| model_of(body))
            .flatten()
            .map(|m| {
                let group = self.config.limits.model_groups.get(m.as_ref());
                group.map_or(m, |g| std::borrow::Cow::Borrowed(g.as_str()))
            })
    }

    /// The partition of `credential` and `model`, made if `make` and there is room (taken at
    /// `now`); `None` when neither names one (the default partition's), or it is not there (and
    /// not made).
    fn keyed(
        &self,
        credential: Option<&[u8]>,
        model: Option<&str>,
        make: bool,
        now: Instant,
    ) -> Option<Arc<Partition>> {
        let (map, hasher) = self.by_key.as_ref()?;
        if credential.is_none() && model.is_none() {
            return None;
        }
        // What names the partition, for the hash here and the fleet's key in Redis: the
        // credential, a separator no header value holds, the model.
        let name = || {
            let mut name = credential.unwrap_or_default().to_vec();
            if let Some(model) = model {
                name.push(0);
                name.extend_from_slice(model.as_bytes());
            }
            name
        };
        let key = {
            let mut h = hasher.build_hasher();
            h.write(credential.unwrap_or_default());
            if let Some(model) = model {
                h.write_u8(0);
                h.write(model.as_bytes());
            }
            h.finish()
        };
        let mut map = lock(map);
        if let Some(keyed) = map.by_hash.get_mut(&key) {
            if make {
                keyed.last_used = now;
            }
            return Some(Arc::clone(&keyed.partition));
        }
        if !make || !map.make_room(now) {
            return None;
        }
        let name = name();
        let fleet = self.fleet.as_ref().map(|f| (f, Some(name.as_slice())));
        let label = crate::metrics::model_label(model, &self.config.limits.model_groups);
        let partition = Arc::new(
            Partition::new(&self.config, fleet)
                .labelled(label)
                .measured(&self.handshakes),
        );
        let keyed = Keyed {
            partition: Arc::clone(&partition),
            last_used: now,
            model: model.map(Box::from),
            keyed: credential.is_some(),
        };
        map.by_hash.insert(key, keyed);
        Some(partition)
    }

    /// Take on `old`'s 429 pauses (a reload rebuilt this upstream with a changed config): the
    /// upstream's own partition, every paused partition of the same credential and model
    /// (without `[fleet]`, whose partitions lease under their credential's name, which is
    /// not kept: they learn their pauses from Redis again), and each pooled key's pause and
    /// cool-down.
    pub fn carry_from(&self, old: &RateLimitShared) {
        self.default.carry_pause(&old.default);
        if let (Some(pool), Some(was)) = (&self.pool, &old.pool) {
            pool.carry_from(was);
        }
        let (Some((map, _)), Some((was, _))) = (&self.by_key, &old.by_key) else {
            return;
        };
        if self.scope != old.scope || self.fleet.is_some() {
            return;
        }
        let now = Instant::now();
        let was = lock(was);
        let mut map = lock(map);
        // Both maps hash with the process's one hasher: a key names the same partition.
        for (hash, keyed) in was.by_hash.iter() {
            if !keyed.partition.is_paused(now) || map.by_hash.contains_key(hash) {
                continue;
            }
            if !map.make_room(now) {
                break;
            }
            let label = crate::metrics::model_label(
                keyed.model.as_deref(),
                &self.config.limits.model_groups,
            );
            let partition = Arc::new(
                Partition::new(&self.config, None)
                    .labelled(label)
                    .measured(&self.handshakes),
            );
            partition.carry_pause(&keyed.partition);
            let carried = Keyed {
                partition,
                last_used: keyed.last_used,
                model: keyed.model.clone(),
                keyed: keyed.keyed,
            };
            map.by_hash.insert(*hash, carried);
        }
    }

    pub fn status(&self) -> serde_json::Value {
        let mut v = self.default.status();
        if let Some((map, _)) = &self.by_key {
            let map = lock(map);
            v["partitions"] = serde_json::json!(map.by_hash.len());
            let mut recent: Vec<&Keyed> = map.by_hash.values().collect();
            recent.sort_by_key(|k| std::cmp::Reverse(k.last_used));
            let listed: Vec<_> = recent
                .into_iter()
                .take(STATUS_PARTITIONS)
                .map(|k| {
                    let mut p = k.partition.status();
                    p["model"] = serde_json::json!(k.model);
                    p["per_credential"] = serde_json::json!(k.keyed);
                    p
                })
                .collect();
            v["by_partition"] = serde_json::json!(listed);
        }
        if let Some(pool) = &self.pool {
            v["keys"] = pool.status();
        }
        v["prompt_tokens_per_estimated"] = serde_json::json!(self.prompt_ratio.get());
        v
    }

    /// One attempt through `partition` from `start` (the clock read when it was chosen): wait
    /// for its turn and capacity, send, and learn from the answer.
    async fn through<S: Next>(
        &self,
        partition: &Arc<Partition>,
        next: &S,
        req: ProxyRequest,
        start: Instant,
    ) -> Result<Response<Body>, ProxyError> {
        let m = &self.metrics;
        // The JSON estimate only where a token bucket will be charged (asked again after a
        // wait: a token limit may have been learned meanwhile).
        let parsed = OnceLock::new();
        let estimate_now = || {
            if partition.charges_tokens() {
                *parsed.get_or_init(|| {
                    estimate::estimate(&req.target.body, self.config.limits.default_max_tokens)
                })
            } else {
                Estimate::default()
            }
        };
        let estimate = estimate_now();
        let cost = estimate.charge(self.prompt_ratio.get());
        // Admitted at once, it is sent at the instant the clock was read for admission: the
        // clock is read again only after a wait.
        let (tickets, sent_at, estimate, cost) = match partition.fast_path(cost, start) {
            Some(tickets) => (tickets, start, estimate, cost),
            None => {
                let (deadline, priority) = (req.ctx().wait_deadline, req.ctx().priority);
                let price = || estimate_now().charge(self.prompt_ratio.get());
                let tickets = partition
                    .wait_for(&price, deadline, priority, m.name())
                    .await?;
                let estimate = estimate_now();
                let cost = estimate.charge(self.prompt_ratio.get());
                (tickets, Instant::now(), estimate, cost)
            }
        };
        m.rate_wait
            .observe(sent_at.saturating_duration_since(start).as_secs_f64());
        if self.config.limits.tpm.is_some() {
            m.tokens_charged.inc_by(u64::from(cost));
        }
        let deadline = req.ctx().deadline;
        // Until the answer is observed: a request cancelled meanwhile gives its tickets up.
        let mut unanswered = Unanswered { partition, tickets };
        let result = match next.send(req).await {
            Ok(response) if response.status() == StatusCode::TOO_MANY_REQUESTS => {
                // Boxed: only a 429 pays for the room its reading takes.
                Ok(Box::pin(self.read_429(response, deadline)).await)
            }
            other => other,
        };
        let tickets = unanswered.tickets.take();
        let mut result = match (result, tickets) {
            (Ok(response), Some(t)) if t.charged_tokens() > 0.0 => {
                Ok(self.settle_on_usage(response, partition, t, estimate))
            }
            (other, _) => other,
        };
        let outcome = Outcome::of(&result);
        let response = result.as_ref().ok();
        let throttle = response.and_then(|r| r.extensions().get::<Throttle>());
        if tickets.is_some() || outcome == Outcome::Throttled(429) {
            let headers = response.map(Response::headers);
            let own = partition.observe(tickets, outcome, throttle, headers, Some(sent_at), m);
            // An admission control's refusal: the retry waits its hint for this request
            // alone (`Partition::admission_control`).
            if let Some(t) = result.as_mut().ok().filter(|_| own) {
                if let Some(t) = t.extensions_mut().get_mut::<Throttle>() {
                    t.own_wait = true;
                }
            }
        }
        result
    }

    /// A success charged tokens at admission: its body is tapped for the `usage` the upstream
    /// reports, which settles the charge (the pacer gets back what it over-charged, or gives
    /// what it under-charged) and calibrates the prompt estimate. The answer passes unchanged.
    fn settle_on_usage(
        &self,
        response: Response<Body>,
        partition: &Arc<Partition>,
        tickets: partition::Tickets,
        estimate: Estimate,
    ) -> Response<Body> {
        let format = usage::Format::of(response.headers());
        let Some(format) = format.filter(|_| response.status().is_success()) else {
            return response;
        };
        let (partition, ratio) = (Arc::clone(partition), Arc::clone(&self.prompt_ratio));
        response.map(|body| {
            usage::tap(
                body,
                format,
                Box::new(move |counted| {
                    if let Some(u) = counted {
                        partition.settle(tickets, u.total() as f64);
                        ratio.learn(estimate.prompt, u.input);
                    }
                }),
            )
        })
    }

    /// Read a 429 ([`Throttle::read`]) from its head and its buffered body, and carry the
    /// reading on the response for the layers above; the answer itself passes unchanged.
    async fn read_429(&self, response: Response<Body>, deadline: Instant) -> Response<Body> {
        let (mut parts, bytes, cut) = match buffer_error(response, deadline).await {
            Ok(buffered) => buffered,
            Err(whole) => return whole,
        };
        let now = Instant::now();
        let throttle = Throttle::read(
            &parts.headers,
            &bytes,
            &self.config.retry,
            deadline.saturating_duration_since(now),
            SystemTime::now(),
        );
        self.metrics.throttle_reason(throttle.reason.label());
        parts.extensions.insert(throttle);
        replay(parts, bytes, cut)
    }

    /// An attempt with a pooled key: the key with the most headroom; if the upstream refuses
    /// that key for good, the key is set aside and the attempt moves to the next usable key
    /// (each key once at most); with none left, the last refusal goes back as it came.
    async fn pooled<S: Next>(
        &self,
        pool: &Pool,
        next: &S,
        req: ProxyRequest,
    ) -> Result<Response<Body>, ProxyError> {
        let mut tried = 0u64;
        // The key a 401 or a 403 set aside during this request, if one did, and which.
        let mut refused: Option<(&'static str, Arc<pool::PoolKey>)> = None;
        // With a model in the scope, each key has a partition per model (providers limit per
        // key and model): keys are chosen by that model's partitions, never made just to look.
        let model = self.model(&req.target.body);
        let of_model = |key: &pool::PoolKey, make: bool| match &model {
            Some(m) => self.keyed(Some(key.credential()), Some(m), make, Instant::now()),
            None => Some(Arc::clone(&key.partition)),
        };
        for _ in 0..pool.keys() {
            let Some(key) = pool.choose(tried, Instant::now(), |k| of_model(k, false)) else {
                break;
            };
            tried |= 1 << (key.number - 1);
            let partition = of_model(&key, true).unwrap_or_else(|| Arc::clone(&key.partition));
            let mut attempt = req.clone();
            let mut headers = HeaderMap::clone(&attempt.headers);
            let _in_flight = pool.use_key(&key, &mut headers);
            attempt.headers = Arc::new(headers);
            let response = self
                .through(&partition, next, attempt, Instant::now())
                .await?;
            let (why, response) = refusal(response, &self.config, req.ctx().deadline).await;
            let Some(why) = why else {
                return Ok(response);
            };
            if why == "401" || why == "403" {
                match refused.take() {
                    Some((first_why, first)) if first_why == why => {
                        // Two keys refused the same request alike: the request is the cause (a
                        // model or a region the account may not use, a bad
                        // `OpenAI-Organization`), not the keys. Neither stays aside.
                        pool.restore(&first);
                        tracing::info!(
                            upstream = self.metrics.name(),
                            keys = ?[first.number, key.number],
                            status = why,
                            "two keys refused one request alike: the refusal goes to the client and both keys stay in use"
                        );
                        return Ok(response);
                    }
                    earlier => refused = earlier.or(Some((why, Arc::clone(&key)))),
                }
            }
            let now = Instant::now();
            pool.set_aside(&key, why, now);
            self.metrics.key_set_aside(why);
            let moving_on = pool.has_another(tried, now);
            tracing::warn!(
                upstream = self.metrics.name(),
                key = key.number,
                fingerprint = %key.fingerprint,
                status = response.status().as_u16(),
                why,
                cooldown = ?pool.cooldown(),
                moving_on,
                "key set aside"
            );
            if !moving_on {
                return Ok(response);
            }
        }
        unreachable!("a pool has a key for the first attempt, and returns when none is left")
    }
}

/// The top-level `"model"` of a JSON body, if it has one (escapes decoded).
fn model_of(body: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    #[derive(serde::Deserialize)]
    struct Head<'a> {
        #[serde(borrow, default)]
        model: Option<std::borrow::Cow<'a, str>>,
    }
    // The SDKs write `"model"` first: read it there without parsing the rest.
    const FIRST: &[u8] = br#"{"model":""#;
    if let Some(rest) = body.strip_prefix(FIRST) {
        let end = rest.iter().position(|b| *b == b'"' || *b == b'\\')?;
        if rest[end] == b'"' {
            return std::str::from_utf8(&rest[..end])
                .ok()
                .map(std::borrow::Cow::Borrowed);
        }
    }
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<Head<'_>>(body).ok()?.model
}

/// Whether an answer refuses its key for good, and why: the credential is refused (401, 403) or
/// its quota is spent (a permanent 429, judged as the retry layer judges it).
async fn refusal(
    response: Response<Body>,
    config: &UpstreamConfig,
    deadline: Instant,
) -> (Option<&'static str>, Response<Body>) {
    match response.status().as_u16() {
        401 => (Some("401"), response),
        403 => (Some("403"), response),
        429 => {
            let (permanent, response) =
                crate::stack::retry::permanent_429(response, &config.retry, deadline).await;
            (permanent.then_some("quota"), response)
        }
        _ => (None, response),
    }
}

#[cfg(test)]
impl RateLimitShared {
    /// Poison every std mutex this holds (tests of [`crate::sync::lock`]).
    pub(crate) fn poison_locks(&self) {
        self.default.poison_locks();
        if let Some((map, _)) = &self.by_key {
            for keyed in lock(map).by_hash.values() {
                keyed.partition.poison_locks();
            }
            crate::sync::poison(map);
        }
    }
}

/// The rate limit as a tower layer.
pub type RateLimitLayer = SharedLayer<RateLimitShared>;

impl Middleware for RateLimitShared {
    async fn call<S: Next>(self: &Arc<Self>, next: &S, req: ProxyRequest) -> Answer {
        match &self.pool {
            Some(pool) if pool.applies(&req.headers) => {
                Box::pin(self.pooled(pool, next, req)).await
            }
            _ => {
                // One clock reading for the partition's use and the attempt's admission.
                let now = Instant::now();
                let partition = self.partition(&req.headers, &req.target.body, now);
                self.through(&partition, next, req, now).await
            }
        }
    }
}

#[cfg(test)]
mod tests;
