//! `[fleet]`: corrals on one API key share its rate limit through Redis.
//!
//! Each partition's buckets (requests and tokens) live in Redis and change only through one Lua
//! script (`lease.lua`, called with EVALSHA, loaded again after `SCRIPT FLUSH`), on Redis's own
//! clock. A replica leases a block of tokens at a time, sized from its recent rate, refills it in
//! the background before it runs dry, and gives back what it did not use when it stops; so at
//! steady state it makes one round trip per block, not one per request. The same call carries
//! what the replica learned from the provider's headers and the pause of its 429s, and counts the
//! live replicas by heartbeat.
//!
//! Redis is never on the startup path and never a reason for a client request to fail: a lease
//! slower than `lease_timeout`, or `max_failures` failures in a row, and the replica falls back
//! to its share of the last known limit (limit / live replicas), logs it once, shows it in
//! `corral_fleet_mode` and `/status`, and probes Redis again with jittered backoff.
//!
//! # Layout
//! - this file: the connection, its health (shared, fallback), metrics, shutdown.
//! - `lease`: one partition's lease: local accounting, the background refill, the fallback.

pub mod lease;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

pub use self::lease::Lease;
use crate::config::{FleetConfig, RedisUrl, UpstreamConfig};
use crate::stack::layer::lock;

/// The lease script.
const SCRIPT: &str = include_str!("lease.lua");

/// Reconnection probes while fallen back: full jitter over this, doubling per failure...
const PROBE_BASE: Duration = Duration::from_millis(100);
/// ...up to this.
const PROBE_CAP: Duration = Duration::from_secs(5);

/// Whether leases come from Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No lease has answered yet.
    Connecting,
    /// Leases come from Redis.
    Shared,
    /// Redis is slow or down: each replica paces to its share of the last known limit.
    Fallback,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Connecting, Mode::Shared, Mode::Fallback];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Connecting => "connecting",
            Mode::Shared => "shared",
            Mode::Fallback => "fallback",
        }
    }
}

#[derive(Debug)]
struct Health {
    mode: Mode,
    failures: u32,
    last_error: Option<String>,
    /// While fallen back: no probe before this.
    next_probe: Instant,
    probes: u32,
}

/// The fleet's metrics (process-wide, not per upstream).
#[derive(Clone)]
pub struct FleetMetrics {
    /// `corral_fleet_round_trips_total{outcome}`: ok, error, timeout.
    pub round_trips: IntCounterVec,
    /// `corral_fleet_mode{mode}`: 1 for the mode in force.
    pub mode: IntGaugeVec,
    /// `corral_fleet_live_replicas`: replicas counted by the last lease.
    pub live_replicas: IntGauge,
    /// `corral_fleet_leased_units_total{kind}`: units granted by Redis.
    pub leased: IntCounterVec,
    /// `corral_fleet_fallbacks_total`: times this corral fell back to its local share.
    pub fallbacks: IntCounter,
}

/// One corral's connection to its fleet.
pub struct Fleet {
    conn: ConnectionManager,
    script: redis::Script,
    url: RedisUrl,
    name: String,
    replica: String,
    lease_timeout: Duration,
    max_failures: u32,
    heartbeat_ttl: Duration,
    health: Mutex<Health>,
    metrics: FleetMetrics,
    leases: Mutex<Vec<Weak<Lease>>>,
    /// Where pauses are published (`corral:fleet:NAME:pauses`).
    channel: String,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("url", &self.url)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// What went wrong with a lease call.
#[derive(Debug)]
pub enum CallError {
    Timeout,
    Redis(String),
}

impl Fleet {
    /// The fleet of `config`, if one is configured. Connects lazily: nothing waits for Redis
    /// here.
    pub fn new(config: &FleetConfig, metrics: FleetMetrics) -> Option<Arc<Self>> {
        let url = config.redis.clone()?;
        let lease_timeout = config.lease_timeout.0;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(lease_timeout.max(Duration::from_millis(100))))
            .set_response_timeout(Some(lease_timeout))
            .set_number_of_retries(1)
            .set_min_delay(PROBE_BASE)
            .set_max_delay(PROBE_CAP);
        let client = redis::Client::open(url.0.as_str());
        let conn = client
            .clone()
            .and_then(|client| ConnectionManager::new_lazy_with_config(client, manager_config));
        let (conn, client) = match (conn, client) {
            (Ok(conn), Ok(client)) => (conn, client),
            (Err(e), _) | (_, Err(e)) => {
                // The URL was checked when the config was read; say why without it.
                tracing::error!(redis = %url, error = %redact(&e.to_string(), &url), "fleet: cannot use Redis; every corral paces alone");
                return None;
            }
        };
        let hostname = std::env::var("HOSTNAME").unwrap_or_else(|_| "corral".into());
        let replica = format!(
            "{hostname}-{}-{:08x}",
            std::process::id(),
            SmallRng::from_os_rng().random::<u32>()
        );
        for mode in Mode::ALL {
            metrics.mode.with_label_values(&[mode.label()]);
        }
        metrics
            .mode
            .with_label_values(&[Mode::Connecting.label()])
            .set(1);
        tracing::info!(redis = %url, fleet = %config.name, replica, "fleet: sharing rate limits through Redis");
        let fleet = Arc::new(Self {
            conn,
            script: redis::Script::new(SCRIPT),
            url,
            name: config.name.0.clone(),
            replica,
            lease_timeout,
            max_failures: config.max_failures.max(1),
            heartbeat_ttl: config.heartbeat_ttl.0,
            health: Mutex::new(Health {
                mode: Mode::Connecting,
                failures: 0,
                last_error: None,
                next_probe: Instant::now(),
                probes: 0,
            }),
            metrics,
            leases: Mutex::default(),
            channel: format!("corral:fleet:{}:pauses", config.name.0),
        });
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(listen(Arc::downgrade(&fleet), client));
            }
            Err(_) => {
                tracing::warn!("fleet: no runtime; pauses reach this corral with its leases only")
            }
        }
        Some(fleet)
    }

    /// A pause another replica shared: "PAUSE-KEY MS".
    fn paused(&self, message: &str) {
        let Some((key, ms)) = message.split_once(' ') else {
            return;
        };
        let Ok(ms) = ms.parse::<u64>() else { return };
        let until = Instant::now() + Duration::from_millis(ms);
        for lease in self.live_leases() {
            if lease.pause_key() == key {
                lease.pause_until(until);
            }
        }
    }

    /// A lease for one partition of `upstream`: `credential` is the partition's credential
    /// (`None`: the upstream's own, from its configured headers).
    /// `on_pause` is given the end of each pause another replica shared; `queued` counts the
    /// partition's waiting requests (the demand).
    pub fn lease(
        self: &Arc<Self>,
        upstream: &UpstreamConfig,
        credential: Option<&[u8]>,
        on_pause: Box<dyn Fn(Instant) + Send + Sync>,
        queued: Arc<AtomicUsize>,
    ) -> Arc<Lease> {
        let key = self.bucket_key(upstream, credential);
        let lease = Lease::new(Arc::clone(self), key, upstream, on_pause, queued);
        let mut leases = lock(&self.leases);
        leases.retain(|l| l.strong_count() > 0);
        leases.push(Arc::downgrade(&lease));
        lease
    }

    /// The hash tag of a partition's keys: a digest of the fleet's name, the upstream's host and
    /// the credential's fingerprint. Never the credential itself.
    fn bucket_key(&self, upstream: &UpstreamConfig, credential: Option<&[u8]>) -> String {
        let base = &upstream.base_url.0;
        let host = base.authority().map(|a| a.as_str()).unwrap_or_default();
        let own = ["authorization", "x-api-key", "api-key"]
            .iter()
            .find_map(|h| upstream.headers.get(*h))
            .map(|s| s.0.as_bytes());
        let credential = credential.or(own).unwrap_or_default();
        let mut digest = sha1_smol::Sha1::new();
        digest.update(self.name.as_bytes());
        digest.update(b"\0");
        digest.update(host.as_bytes());
        digest.update(b"\0");
        digest.update(
            sha1_smol::Sha1::from(credential)
                .digest()
                .to_string()
                .as_bytes(),
        );
        let hex = digest.digest().to_string();
        format!("corral:{{{}}}", &hex[..20])
    }

    pub fn mode(&self) -> Mode {
        lock(&self.health).mode
    }

    /// Whether a lease call may be made now (always, unless fallen back and the next probe is
    /// not due).
    fn may_call(&self, now: Instant) -> Result<(), Instant> {
        let h = lock(&self.health);
        if h.mode == Mode::Fallback && now < h.next_probe {
            return Err(h.next_probe);
        }
        Ok(())
    }

    /// Run the lease script: one round trip.
    async fn call(&self, args: &lease::CallArgs) -> Result<Vec<String>, CallError> {
        let mut invocation = self.script.prepare_invoke();
        for key in &args.keys {
            invocation.key(key);
        }
        invocation
            .arg(&self.replica)
            .arg(self.heartbeat_ttl.as_millis() as u64)
            .arg(if args.leaving { "1" } else { "0" })
            .arg(args.pause_ms)
            .arg(args.refused);
        for kind in &args.kinds {
            invocation
                .arg(kind.want)
                .arg(kind.give_back)
                .arg(kind.config.map_or(0.0, |c| c.0))
                .arg(kind.config.map_or(0.0, |c| c.1))
                .arg(kind.learned.map_or(0.0, |l| l.0))
                .arg(kind.learned.map_or(0.0, |l| l.1))
                .arg(kind.learned.and_then(|l| l.2).unwrap_or(-1.0));
        }
        invocation
            .arg(&self.channel)
            .arg(if args.resync { "1" } else { "0" });
        let mut conn = self.conn.clone();
        let outcome = tokio::time::timeout(
            self.lease_timeout,
            invocation.invoke_async::<Vec<String>>(&mut conn),
        )
        .await;
        let result = match outcome {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(CallError::Redis(redact(&e.to_string(), &self.url))),
            Err(_) => Err(CallError::Timeout),
        };
        self.record(&result);
        result
    }

    /// Count the call and move between shared and fallback.
    fn record(&self, result: &Result<Vec<String>, CallError>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(CallError::Timeout) => "timeout",
            Err(CallError::Redis(_)) => "error",
        };
        self.metrics.round_trips.with_label_values(&[outcome]).inc();
        let mut h = lock(&self.health);
        let before = h.mode;
        match result {
            Ok(_) => {
                h.failures = 0;
                h.probes = 0;
                h.mode = Mode::Shared;
                h.last_error = None;
                if before != Mode::Shared {
                    tracing::info!(redis = %self.url, "fleet: leases from Redis again; pacing to the shared limit");
                }
            }
            Err(e) => {
                h.failures += 1;
                let why = match e {
                    CallError::Timeout => format!(
                        "a lease took longer than lease_timeout ({:?})",
                        self.lease_timeout
                    ),
                    CallError::Redis(msg) => msg.clone(),
                };
                h.last_error = Some(why.clone());
                // A slow lease falls back at once: waiting on it is what hurts.
                let fall = matches!(e, CallError::Timeout)
                    || h.failures >= self.max_failures
                    || before != Mode::Shared;
                if fall {
                    if before != Mode::Fallback {
                        self.metrics.fallbacks.inc();
                        tracing::warn!(redis = %self.url, error = %why, "fleet: Redis is slow or unreachable; pacing to this corral's share of the last known limit until it answers");
                    }
                    h.mode = Mode::Fallback;
                    let ceiling = PROBE_BASE
                        .saturating_mul(1 << h.probes.min(10))
                        .min(PROBE_CAP);
                    let wait = ceiling.mul_f64(SmallRng::from_os_rng().random_range(0.0..1.0));
                    h.next_probe = Instant::now() + wait.max(Duration::from_millis(20));
                    h.probes += 1;
                }
            }
        }
        if h.mode != before {
            self.metrics
                .mode
                .with_label_values(&[before.label()])
                .set(0);
            self.metrics
                .mode
                .with_label_values(&[h.mode.label()])
                .set(1);
            drop(h);
            for lease in self.live_leases() {
                lease.mode_changed();
            }
        }
    }

    fn live_leases(&self) -> Vec<Arc<Lease>> {
        lock(&self.leases)
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Give back every lease's unused tokens and leave the live set: on shutdown, after the
    /// drain. Bounded by `lease_timeout` per partition.
    pub async fn shutdown(&self) {
        let leases = self.live_leases();
        let mut returned = 0.0;
        for lease in &leases {
            returned += lease.give_back().await;
        }
        tracing::info!(
            partitions = leases.len(),
            units_returned = returned,
            "fleet: unused leases returned"
        );
    }

    /// A JSON view for `/status`.
    pub fn status(&self) -> serde_json::Value {
        let round_trips: u64 = ["ok", "error", "timeout"]
            .iter()
            .map(|k| self.metrics.round_trips.with_label_values(&[k]).get())
            .sum();
        let h = lock(&self.health);
        serde_json::json!({
            "redis": self.url.to_string(),
            "name": self.name,
            "replica": self.replica,
            "mode": h.mode.label(),
            "failures_in_a_row": h.failures,
            "last_error": h.last_error,
            "live_replicas": self.metrics.live_replicas.get(),
            "round_trips": round_trips,
        })
    }
}

/// Subscribe to the fleet's pauses and apply each, reconnecting with jittered backoff, for as
/// long as the fleet lives.
async fn listen(fleet: Weak<Fleet>, client: redis::Client) {
    use futures_util::StreamExt;
    let mut attempt: u32 = 0;
    loop {
        let Some((channel, timeout)) = fleet
            .upgrade()
            .map(|f| (f.channel.clone(), f.lease_timeout))
        else {
            return;
        };
        let connect = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        let subscribed = tokio::time::timeout(timeout.max(Duration::from_secs(1)), connect).await;
        if let Ok(Ok(mut pubsub)) = subscribed {
            attempt = 0;
            let mut messages = pubsub.on_message();
            while let Some(msg) = messages.next().await {
                let Some(fleet) = fleet.upgrade() else { return };
                if let Ok(text) = msg.get_payload::<String>() {
                    fleet.paused(&text);
                }
            }
        }
        let ceiling = PROBE_BASE
            .saturating_mul(1 << attempt.min(10))
            .min(PROBE_CAP);
        let wait = ceiling.mul_f64(SmallRng::from_os_rng().random_range(0.0..1.0));
        tokio::time::sleep(wait.max(Duration::from_millis(20))).await;
        attempt += 1;
    }
}

/// `message` with the URL's password, if any, replaced.
fn redact(message: &str, url: &RedisUrl) -> String {
    let password = url
        .0
        .split_once("://")
        .and_then(|(_, rest)| rest.split(['/', '?', '#']).next())
        .and_then(|authority| authority.rsplit_once('@'))
        .map(|(userinfo, _)| userinfo.split_once(':').map_or(userinfo, |(_, p)| p))
        .filter(|p| !p.is_empty());
    match password {
        Some(p) => message.replace(p, "*****"),
        None => message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_never_carry_the_password() {
        let url = RedisUrl("redis://user:hunter2@redis:6379/0".into());
        assert_eq!(
            redact("auth failed for hunter2 at redis", &url),
            "auth failed for ***** at redis"
        );
        let bare = RedisUrl("redis://redis:6379".into());
        assert_eq!(redact("refused", &bare), "refused");
    }
}
