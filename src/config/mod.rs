//! Configuration: TOML in, validated [`Config`] out.
//!
//! One deserialization pass: value types in [`types`] validate themselves (so `toml` reports their
//! line), `#[serde(deny_unknown_fields)]` everywhere rejects unknown keys, and [`validate`] checks
//! what spans several keys (duplicate routes, `cap` below `base`). Last, [`tls`] reads the CA
//! files that `tls_ca_file` names, the one step that touches other files. Every error reads
//! `file:line: key: reason`.

mod group;
mod layers;
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

pub use self::group::{group_members, GroupConfig, MemberConfig};
pub use self::layers::{
    AdaptiveConfig, BreakerConfig, Jitter, LimitsConfig, OnOpen, PartitionScope, RetryConfig,
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
    pub fn partition(&self) -> PartitionScope {
        self.limits
            .partition
            .unwrap_or(if self.breaker.enabled && self.breaker.count_throttles {
                PartitionScope::Upstream
            } else {
                PartitionScope::ApiKeyModel
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
