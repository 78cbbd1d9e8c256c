//! Configuration: TOML in, validated [`Config`] out.
//!
//! One deserialization pass: value types in [`types`] validate themselves (so `toml` reports their
//! line), `#[serde(deny_unknown_fields)]` everywhere rejects unknown keys, and [`validate`] checks
//! what spans several keys (duplicate routes, `cap` below `base`). Last, [`tls`] reads the CA
//! files that `tls_ca_file` names, the one step that touches other files. Every error reads
//! `file:line: key: reason`.

mod load;
pub mod tls;
pub mod types;
mod validate;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

/// The smallest `max_buffered_bytes` corral runs with: the config refuses less, and the
/// request-body budget (`forward::buffer`) never goes below it.
pub const MIN_BUFFER_CAP: usize = 1 << 20;

use serde::{Deserialize, Serialize};
use toml::Spanned;

pub use self::load::{load_file, load_str, ConfigError, DEFAULT_CONFIG};
pub use self::tls::CaFile;
pub use self::types::{
    BaseUrl, ByteSize, HedgeAfter, HumanDuration, ListenAddr, RedisUrl, RoutePrefix, Secret, Text,
};

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where clients connect.
    pub listen: ListenAddr,
    /// Serve `/healthz`, `/readyz`, `/metrics` and `/status` here instead of on `listen`.
    pub admin_listen: Option<ListenAddr>,
    /// Connections open at once on `listen`; at the cap corral stops accepting until one
    /// closes, so new ones wait in the kernel's backlog.
    pub max_connections: NonZeroU32,
    /// Time a new connection has to send its first byte.
    pub first_byte_timeout: HumanDuration,
    /// Time a connection may spend without a request in progress: before its first request
    /// (a slow head, a partial HTTP/2 preface), between HTTP/1 requests, and on HTTP/2 with no
    /// open stream. Then it is closed (HTTP/2 with a GOAWAY).
    pub idle_timeout: HumanDuration,
    /// A response frame the client has not taken this long (it stopped reading: its socket, or
    /// its HTTP/2 window, stays full) ends the connection, so its requests give back their slots.
    pub write_timeout: HumanDuration,
    /// HTTP/2: a PING after this long without a frame from the client; no answer within as long
    /// closes the connection (a peer gone without a word, even mid-stream).
    pub http2_keep_alive_interval: HumanDuration,
    /// After SIGTERM: `/readyz` answers 503 while corral keeps accepting and serving for this
    /// long, so a load balancer stops sending first. None after SIGINT.
    pub drain_delay: HumanDuration,
    /// Then the listener closes and in-flight requests get this long to finish.
    pub drain_timeout: HumanDuration,
    /// Request body bytes held in memory at once, across all upstreams; beyond it new requests
    /// wait briefly, then get a 503 with Retry-After. Unset: a quarter of the container's memory
    /// limit when known, else 256 MiB.
    pub max_buffered_bytes: Option<ByteSize>,
    /// Which requests get a `request` log line: `notable` (errors, retries, requests corral
    /// held, slow ones), `all` or `off`. Applied on reload.
    pub access_log: AccessLog,
    /// With `access_log = "notable"`: a request whose response head took longer than this is
    /// logged. Applied on reload.
    pub slow_request: HumanDuration,
    /// Share rate limits with other corrals on one key, through Redis.
    pub fleet: FleetConfig,
    /// The upstreams, each behind a route (or reached through a group).
    #[serde(rename = "upstream")]
    pub upstreams: Vec<UpstreamConfig>,
    /// Ordered groups of upstreams behind one route, each falling back to the next.
    #[serde(rename = "group")]
    pub groups: Vec<GroupConfig>,
}

/// `[[group]]`: a route served by an ordered list of upstreams (`src/group/`). A request
/// goes to the first member and moves to the next when the member answers a permanent 429,
/// its breaker is open, it has no capacity within `fallback_wait` of the deadline, or its
/// retries are spent; never after bytes went to the client.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// A short name used in metrics and logs; distinct from every upstream's and group's.
    pub name: Spanned<Text>,
    /// Requests whose path starts with this prefix go to the group; each member gets the rest
    /// of the path after its own base URL.
    pub route: Spanned<RoutePrefix>,
    /// Upstream names (or other groups', whose members are taken in their place), in order.
    pub members: Vec<MemberConfig>,
    /// The share of a request's deadline a member other than the last may take to find
    /// capacity (a concurrency slot, rate-limit tokens) before the request moves on.
    #[serde(default = "default_fallback_wait")]
    pub fallback_wait: f64,
    /// A member that answered a permanent 429 is passed over for this long.
    #[serde(default = "default_key_cooldown")]
    pub cooldown: HumanDuration,
    /// With no answer by then, a second attempt goes to the next member (the same one in a
    /// group of one): a duration, or `"p95"` (the member's p95 time to an answer). Unset: none.
    #[serde(default)]
    pub hedge_after: Option<HedgeAfter>,
    /// Hedges never exceed this share of the group's requests.
    #[serde(default = "default_hedge_max_ratio")]
    pub hedge_max_ratio: f64,
    /// Requests safe to send twice: a path ending with one of these (or a request with
    /// `Idempotency-Key`, or a GET or HEAD) may be hedged, and may move to the next member
    /// after an error that may have reached the upstream. Any other moves on only when the
    /// member certainly did not act on it.
    #[serde(default = "default_repeatable_paths")]
    pub repeatable_paths: Vec<String>,
    /// The priority of a request that sends no `x-corral-priority` (unset: the first member's).
    #[serde(default)]
    pub priority: Option<Priority>,
}

fn default_hedge_max_ratio() -> f64 {
    0.1
}

fn default_repeatable_paths() -> Vec<String> {
    [
        "/chat/completions",
        "/completions",
        "/messages",
        "/responses",
        "/embeddings",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn default_fallback_wait() -> f64 {
    0.25
}

/// A group member: an upstream's (or a group's) name, or a table that also rewrites the JSON
/// body's `model` for that member.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum MemberConfig {
    Name(String),
    Table {
        upstream: String,
        #[serde(default)]
        model: Option<String>,
    },
}

impl MemberConfig {
    pub fn name(&self) -> &str {
        match self {
            Self::Name(n) | Self::Table { upstream: n, .. } => n,
        }
    }
    pub fn model(&self) -> Option<&str> {
        match self {
            Self::Name(_) => None,
            Self::Table { model, .. } => model.as_deref(),
        }
    }
}

/// The upstreams `group` resolves to (nested groups in their members' place), in order, each
/// with the `model` its member sets. The config is validated: no cycles.
pub fn group_members<'a>(
    upstreams: &'a [UpstreamConfig],
    groups: &'a [GroupConfig],
    group: &'a GroupConfig,
) -> Vec<(&'a UpstreamConfig, Option<&'a str>)> {
    let mut out = Vec::new();
    for m in &group.members {
        if let Some(inner) = groups.iter().find(|g| g.name() == m.name()) {
            out.extend(group_members(upstreams, groups, inner));
        } else if let Some(up) = upstreams.iter().find(|u| u.name() == m.name()) {
            out.push((up, m.model()));
        }
    }
    out
}

impl GroupConfig {
    pub fn name(&self) -> &str {
        &self.name.get_ref().0
    }
    pub fn route(&self) -> &str {
        &self.route.get_ref().0
    }
}

/// `[fleet]`: corrals that share a quota keep its buckets in Redis and lease tokens from them.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// `redis://[user:password@]host:port/db` (also `--redis`, `CORRAL_REDIS`). Unset: no
    /// fleet, every corral paces alone.
    pub redis: Option<RedisUrl>,
    /// Separates fleets on one Redis: only corrals with the same name share buckets.
    pub name: Text,
    /// A lease call slower than this counts as failed: the corral falls back to its share.
    pub lease_timeout: HumanDuration,
    /// Failed lease calls in a row before falling back (a slow one falls back at once).
    pub max_failures: u32,
    /// A corral that has not called Redis for this long is no longer counted as live.
    pub heartbeat_ttl: HumanDuration,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            redis: None,
            name: Text("default".into()),
            lease_timeout: HumanDuration(Duration::from_millis(250)),
            max_failures: 3,
            heartbeat_ttl: HumanDuration::from_secs(30),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: ListenAddr(([127, 0, 0, 1], 8080).into()),
            admin_listen: None,
            max_connections: NonZeroU32::new(10_000).expect("non-zero"),
            first_byte_timeout: HumanDuration::from_secs(10),
            idle_timeout: HumanDuration::from_secs(60),
            write_timeout: HumanDuration::from_secs(300),
            http2_keep_alive_interval: HumanDuration::from_secs(20),
            drain_delay: HumanDuration::from_secs(5),
            drain_timeout: HumanDuration::from_secs(20),
            max_buffered_bytes: None,
            access_log: AccessLog::Notable,
            slow_request: default_slow_request(),
            fleet: FleetConfig::default(),
            upstreams: Vec::new(),
            groups: Vec::new(),
        }
    }
}

/// Thirty seconds. The line is written when the response head is ready: for a stream that is
/// within a few seconds, for a complete answer when the whole of it is generated, ordinarily a
/// few seconds to a few tens of them. Half a minute is past both, so ordinary multi-second calls
/// stay unlogged while the long tail (a long generation, a backend queueing) gets a line, and it
/// is half the 60 s idle timeout of common load balancers, in front of which such a request is
/// at risk.
fn default_slow_request() -> HumanDuration {
    HumanDuration::from_secs(30)
}

/// `access_log`: which requests get a `request` log line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessLog {
    /// An error answer (status 400 or above, corral's own included), a request retried, one
    /// corral held 10 ms or more (queued, paced or held by the breaker) before its first
    /// attempt, or one whose head came after `slow_request`.
    #[default]
    Notable,
    /// Every request.
    All,
    /// None (corral's other log lines stay).
    Off,
}

/// Kubernetes' default `terminationGracePeriodSeconds`: SIGTERM to SIGKILL. The drain should
/// fit in it.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

impl Config {
    /// What the configuration allows but is likely a mistake, one sentence each: `check-config`
    /// prints them, corral logs them at startup and `/status` lists them.
    pub fn warnings(&self) -> Vec<String> {
        validate::warnings(self)
    }
}

/// One upstream API and everything corral does in front of it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// A short name used in metrics and logs.
    pub name: Spanned<Text>,
    /// Requests whose path starts with this prefix go to this upstream, prefix replaced by the
    /// base URL's path. May be left out (empty) for an upstream reached only through a group.
    #[serde(default = "no_route")]
    pub route: Spanned<RoutePrefix>,
    /// Where requests go: `https://api.openai.com/v1`, `http://127.0.0.1:8000`.
    pub base_url: BaseUrl,
    /// Headers corral adds, e.g. `Authorization = "Bearer ${OPENAI_API_KEY}"`.
    #[serde(default)]
    pub headers: BTreeMap<String, Secret>,
    /// `if_absent` (default): inject only when the client sent none; `always`: replace.
    #[serde(default)]
    pub header_mode: HeaderMode,
    /// A pool of credentials (`keys = ["${KEY_A}", "${KEY_B}"]`), each put into the one
    /// `headers` entry whose value holds [`KEY_PLACEHOLDER`]. Each key has its own buckets and
    /// learned limits; a request goes to the key with the most headroom (`stack/rate_limit/pool`).
    #[serde(default)]
    pub keys: Vec<Secret>,
    /// How long a key that answered 401, 403 or a permanent 429 is set aside before it is tried
    /// again.
    #[serde(default = "default_key_cooldown")]
    pub key_cooldown: HumanDuration,
    /// The priority of a request that sends no `x-corral-priority`.
    #[serde(default)]
    pub priority: Priority,
    /// Largest request body corral buffers; beyond it the client gets a 413.
    #[serde(default = "default_body_limit")]
    pub body_limit: ByteSize,
    /// Longest pause between two pieces of a request body; the client then gets a 408.
    #[serde(default = "default_body_idle_timeout")]
    pub body_idle_timeout: HumanDuration,
    /// Longest pause between two pieces of a response body (after its head) before corral cuts
    /// the stream. Generous: reasoning models may think for minutes between events.
    #[serde(default = "default_stream_idle_timeout")]
    pub stream_idle_timeout: HumanDuration,
    /// Time allowed for the TCP and TLS handshake with the upstream.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: HumanDuration,
    /// A PEM file of root certificates trusted for this upstream on top of the webpki roots,
    /// for a backend behind a private CA. A relative path is taken from the config file's
    /// directory. Read when the config is loaded; a reload re-reads it.
    #[serde(default)]
    pub tls_ca_file: Option<Spanned<CaFile>>,
    /// `auto` (default): learn the upstream's limit from its headers and 429s; `off`: don't.
    #[serde(default)]
    pub rate_limit: LearnMode,
    /// `fixed` (default): `limits.max_concurrency` in flight; `auto`: a latency-gradient window
    /// for self-hosted backends that queue instead of answering 429.
    #[serde(default)]
    pub concurrency: ConcurrencyMode,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub breaker: BreakerConfig,
    #[serde(default)]
    pub adaptive: AdaptiveConfig,
}

/// An upstream without a route of its own (a group member).
fn no_route() -> Spanned<RoutePrefix> {
    Spanned::new(0..0, RoutePrefix(String::new()))
}

/// Most keys in one pool (each request tries each key at most once, tracked in 64 bits).
pub const MAX_KEYS: usize = 64;

/// Where a pooled key goes in its `headers` template: `Authorization = "Bearer {key}"`.
pub const KEY_PLACEHOLDER: &str = "{key}";

fn default_key_cooldown() -> HumanDuration {
    HumanDuration::from_secs(60)
}
fn default_body_limit() -> ByteSize {
    ByteSize(32 << 20)
}
fn default_connect_timeout() -> HumanDuration {
    HumanDuration::from_secs(10)
}
fn default_body_idle_timeout() -> HumanDuration {
    HumanDuration::from_secs(30)
}
/// Ten minutes: longer than the pauses of reasoning models that stream nothing while they think
/// (several minutes for the largest), and as long as the default `deadline`, so a stalled
/// upstream holds a slot no longer than a request may wait for its head.
fn default_stream_idle_timeout() -> HumanDuration {
    HumanDuration::from_secs(600)
}

impl UpstreamConfig {
    /// How the rate limit is split: `limits.partition`, or when unset credential x model
    /// (the upstream's alone when its breaker counts throttles: one breaker, one partition).
    pub fn partition(&self) -> Partition {
        self.limits
            .partition
            .unwrap_or(if self.breaker.enabled && self.breaker.count_throttles {
                Partition::Upstream
            } else {
                Partition::ApiKeyModel
            })
    }

    /// An upstream with every knob at its default.
    pub fn new(name: &str, route: &str, base_url: BaseUrl) -> Self {
        Self {
            name: Spanned::new(0..0, Text(name.into())),
            route: Spanned::new(0..0, RoutePrefix(route.into())),
            base_url,
            headers: BTreeMap::new(),
            header_mode: HeaderMode::default(),
            keys: Vec::new(),
            key_cooldown: default_key_cooldown(),
            priority: Priority::default(),
            body_limit: default_body_limit(),
            body_idle_timeout: default_body_idle_timeout(),
            stream_idle_timeout: default_stream_idle_timeout(),
            connect_timeout: default_connect_timeout(),
            tls_ca_file: None,
            rate_limit: LearnMode::default(),
            concurrency: ConcurrencyMode::default(),
            limits: LimitsConfig::default(),
            retry: RetryConfig::default(),
            breaker: BreakerConfig::default(),
            adaptive: AdaptiveConfig::default(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name.get_ref().0
    }
    pub fn route(&self) -> &str {
        &self.route.get_ref().0
    }
    /// The certificates of `tls_ca_file` (none when unset), trusted beside the webpki roots.
    pub fn extra_roots(&self) -> &[rustls::pki_types::CertificateDer<'static>] {
        self.tls_ca_file
            .as_ref()
            .map_or(&[], |file| file.get_ref().certs.as_slice())
    }
}

/// Which waiting requests go first: `interactive` ahead of `batch` in the concurrency queue and
/// the rate limiter's turns (`x-corral-priority`, else the route's `priority`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    #[default]
    Interactive,
    Batch,
}

impl Priority {
    /// The `x-corral-priority` value, if it is one.
    pub fn parse(value: &[u8]) -> Option<Self> {
        if value.eq_ignore_ascii_case(b"interactive") {
            Some(Self::Interactive)
        } else if value.eq_ignore_ascii_case(b"batch") {
            Some(Self::Batch)
        } else {
            None
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderMode {
    #[default]
    IfAbsent,
    Always,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LearnMode {
    #[default]
    Auto,
    Off,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConcurrencyMode {
    #[default]
    Fixed,
    Auto,
}

/// How an upstream's rate limit is split: providers enforce limits per credential (project,
/// key) and per model, so by default a partition is one credential and one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum Partition {
    /// One set of buckets for the whole upstream.
    #[serde(rename = "upstream", alias = "none")]
    Upstream,
    /// One per credential as it goes upstream (keyed by a hash): the client's, or the one the
    /// upstream injects in place of the client's (`forward::withheld`).
    #[serde(rename = "api_key")]
    ApiKey,
    /// One per model (or limit group of models).
    #[serde(rename = "model")]
    Model,
    /// One per credential and model.
    #[default]
    #[serde(rename = "api_key+model")]
    ApiKeyModel,
}

impl Partition {
    pub fn label(self) -> &'static str {
        match self {
            Partition::Upstream => "upstream",
            Partition::ApiKey => "api_key",
            Partition::Model => "model",
            Partition::ApiKeyModel => "api_key+model",
        }
    }
    pub fn by_key(self) -> bool {
        matches!(self, Partition::ApiKey | Partition::ApiKeyModel)
    }
    pub fn by_model(self) -> bool {
        matches!(self, Partition::Model | Partition::ApiKeyModel)
    }
}

/// Client-side buckets and the concurrency window. Explicit values are hard ceilings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests per minute (a token bucket).
    pub rpm: Option<NonZeroU32>,
    /// Tokens per minute, charged from an estimate of each request.
    pub tpm: Option<NonZeroU32>,
    /// Requests that may go at once from a full bucket (default: rpm / 60, at least 1).
    pub burst: Option<NonZeroU32>,
    /// Tokens that may go at once from a full bucket (default: tpm / 6).
    pub token_burst: Option<NonZeroU32>,
    /// Requests in flight at once.
    pub max_concurrency: NonZeroU32,
    /// Requests that may wait for a slot; beyond it, a 429.
    pub queue_size: usize,
    /// Longest wait for a slot (the request's deadline also applies).
    pub queue_timeout: HumanDuration,
    /// `upstream` (or `none`): one set of buckets per upstream; `api_key`: one per credential
    /// (keyed by a hash); `model`: one per model; `api_key+model`: one per both. Unset:
    /// `api_key+model`, or `upstream` when the breaker counts throttles (one breaker judges
    /// the whole upstream).
    pub partition: Option<Partition>,
    /// Models that share one limit (a model family): model name -> limit group name.
    pub model_groups: BTreeMap<String, String>,
    /// Completion tokens assumed when a request names no `max_tokens`.
    pub default_max_tokens: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            rpm: None,
            tpm: None,
            burst: None,
            token_burst: None,
            max_concurrency: NonZeroU32::new(1024).expect("non-zero"),
            queue_size: 10_000,
            queue_timeout: HumanDuration::from_secs(600),
            partition: None,
            model_groups: BTreeMap::new(),
            default_max_tokens: 1024,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Jitter {
    #[default]
    Full,
    Equal,
    Decorrelated,
    None,
}

/// Retries, their schedule and their budget.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Retries of failures (5xx, resets, timeouts) per request.
    pub max_retries: u32,
    /// Retries of throttles (retryable 429s and 529s) per request: the last guard, since each
    /// waits for the rate limiter like a first attempt and the deadline bounds them anyway.
    pub max_throttle_retries: u32,
    pub base: HumanDuration,
    pub cap: HumanDuration,
    pub jitter: Jitter,
    /// Added on top of a server's retry hint: uniform(0, floor_jitter).
    pub floor_jitter: HumanDuration,
    /// Time allowed for each attempt to produce a response head.
    pub per_try_timeout: HumanDuration,
    /// Time allowed for the whole request, retries included; a client's `x-corral-deadline-ms`
    /// may shorten it.
    pub deadline: HumanDuration,
    /// Whether a 500 is retried.
    pub retry_500: bool,
    /// Error codes (the body's `error.code` or `error.type`) that make a 429 permanent, on top
    /// of `insufficient_quota` and Anthropic's spend limit.
    pub permanent_codes: Vec<String>,
    /// Add `x-should-retry: false` to the upstream's answer when corral gives up after retrying
    /// (or the budget refuses a retry).
    pub mark_given_up: bool,
    /// Retries may add at most this fraction of the recent request rate...
    pub budget_ratio: f64,
    /// ...plus this many per second...
    pub budget_min_per_second: u32,
    /// ...over this window.
    pub budget_ttl: HumanDuration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_retries: 6,
            max_throttle_retries: 50,
            base: HumanDuration::from_millis(500),
            cap: HumanDuration::from_secs(30),
            jitter: Jitter::Full,
            floor_jitter: HumanDuration::from_millis(500),
            per_try_timeout: HumanDuration::from_secs(300),
            deadline: HumanDuration::from_secs(600),
            retry_500: true,
            permanent_codes: Vec::new(),
            mark_given_up: true,
            budget_ratio: 0.2,
            budget_min_per_second: 10,
            budget_ttl: HumanDuration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnOpen {
    /// Requests wait (up to their deadline) until the breaker lets traffic through again.
    #[default]
    Queue,
    /// Requests get a 503 with Retry-After at once.
    Reject,
}

/// The circuit breaker: judges the upstream's health (5xx, 529, timeouts, connection errors;
/// 429s only with `count_throttles`) over a window of outcomes that spans time as well as a
/// count, and holds traffic while it is unhealthy (see `stack/breaker`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Whether the breaker runs at all.
    pub enabled: bool,
    /// Outcomes remembered: the window holds at least the last `window` outcomes, and at least
    /// the last `min_span` of them.
    pub window: u32,
    /// Outcomes needed in the window before the breaker may open.
    pub min_samples: u32,
    /// Time the window's outcomes must span (from its oldest outcome) before the breaker may
    /// open: failures at one instant are one event, however many requests they hit.
    pub min_span: HumanDuration,
    /// Opens when the window's error rate (each 100 ms slot of outcomes weighing the same)
    /// reaches this.
    pub open_error_rate: f64,
    /// Closes again when the probes' error rate is below this (`0`: every probe must succeed);
    /// while closed, a window at or above it restarts the `healthy_reset` clock.
    pub close_error_rate: f64,
    /// Whether 429s count as failures. Off by default: a 429 says the caller's budget is spent,
    /// not that the upstream is unwell, and is neither a success nor a failure.
    pub count_throttles: bool,
    /// First cool-down; each consecutive open doubles it, up to `max_cooldown` (jittered).
    pub cooldown: HumanDuration,
    /// Longest cool-down.
    pub max_cooldown: HumanDuration,
    /// After being closed this long with the window below `close_error_rate`, the next open
    /// starts again from `cooldown`.
    pub healthy_reset: HumanDuration,
    /// Requests admitted while half-open.
    pub half_open_probes: u32,
    /// On closing, requests held while open are released over at most this long, each at its
    /// own offset into the open period (offsets scaled down when the open period was longer).
    pub release_ramp: HumanDuration,
    /// What requests do while the breaker holds traffic.
    pub on_open: OnOpen,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window: 50,
            min_samples: 20,
            min_span: HumanDuration::from_secs(2),
            open_error_rate: 0.4,
            close_error_rate: 0.25,
            count_throttles: false,
            cooldown: HumanDuration::from_secs(2),
            max_cooldown: HumanDuration::from_secs(60),
            healthy_reset: HumanDuration::from_secs(30),
            half_open_probes: 5,
            release_ramp: HumanDuration::from_secs(10),
            on_open: OnOpen::Queue,
        }
    }
}

/// Learning knobs: slow start and the latency-gradient window.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveConfig {
    /// Requests sent before the upstream has said anything about its limit.
    pub initial_burst: u32,
    /// Learned rates are used times this (a margin under the provider's limit).
    pub rate_margin: f64,
    /// Adaptive concurrency: the latency the window aims at, as a multiple of the no-load
    /// latency; the backend then holds `(tolerance - 1) x` its slots in its own queue.
    pub latency_tolerance: f64,
    /// Adaptive concurrency: the window's floor.
    pub min_concurrency: u32,
    /// Adaptive concurrency: the window's size before it has learned anything; slow start
    /// doubles it per round trip from there.
    pub initial_concurrency: u32,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            initial_burst: 10,
            rate_margin: 0.97,
            latency_tolerance: 1.25,
            min_concurrency: 1,
            initial_concurrency: 8,
        }
    }
}
