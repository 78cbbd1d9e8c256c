//! `[fleet]`: corrals on one API key share its rate limit through Redis.
//!
//! Each partition's buckets (requests and tokens) live in Redis and change only through one Lua
//! script (`lease.lua`, called with EVALSHA, loaded again after `SCRIPT FLUSH`), on Redis's own
//! clock. A replica leases a block of tokens at a time, sized from its recent rate, refills it in
//! the background before it runs dry, and gives back what it did not use when it stops; so at
//! steady state it makes one round trip per block, not one per request. The same call carries
//! what the replica learned from the provider's headers and the pause of its 429s, and counts the
//! live replicas by heartbeat. Without headers the 429s themselves are shared: each is
//! published, every replica ends a throttle window there, and the shares those windows estimate
//! are published and split by demand.
//!
//! Redis is never on the startup path and never a reason for a client request to fail: a lease
//! slower than `lease_timeout`, or `max_failures` failures in a row, and the replica falls back
//! to its share of the last known limit (limit / live replicas), logs it once, shows it in
//! `corral_fleet_mode` and `/status`, and probes Redis again with jittered backoff.
//!
//! # Layout
//! - this file: the connection and its health (shared, fallback), the pause listener, the
//!   partitions' bucket keys, metrics, shutdown.
//! - `accounting`: what one partition's lease holds, owes and may spend: local, no I/O, every
//!   change at a given `now`.
//! - `script`: the lease script's wire format: its arguments, its answer, its messages.
//! - `lease`: one partition's lease: the handle its requests take from and the task that
//!   calls the script to keep it stocked.
//! - `shares`: the replicas' shares of a key without rate-limit headers, split by demand.

mod accounting;
pub mod lease;
mod script;
mod shares;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Notify;
use tokio::time::Instant;

pub use self::lease::{Lease, Peers};
use self::script::{pause_end, CallArgs, Message, Reply, SCRIPT};
use crate::config::{FleetConfig, RedisUrl, UpstreamConfig};
use crate::metrics::{FleetMetrics, FleetMode};
use crate::sync::lock;

/// Reconnection probes while fallen back: full jitter over this, doubling per failure...
const PROBE_BASE: Duration = Duration::from_millis(100);
/// ...up to this.
const PROBE_CAP: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Health {
    mode: FleetMode,
    failures: u32,
    last_error: Option<String>,
    /// While fallen back: no probe before this.
    next_probe: Instant,
    probes: u32,
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
    /// Wakes the pause listener: resubscribe (back from a fallback: its connection may be a
    /// dead one nobody noticed), or stop (the fleet is gone).
    listener: Arc<Notify>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.listener.notify_one();
    }
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
    /// The connection was refused: the call never reached Redis.
    Refused(String),
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
            // A backstop: the lease's own timeout (`call`) fires first.
            .set_response_timeout(Some(lease_timeout * 2))
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
        metrics
            .mode
            .with_label_values(&[FleetMode::Connecting.label()])
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
                mode: FleetMode::Connecting,
                failures: 0,
                last_error: None,
                next_probe: Instant::now(),
                probes: 0,
            }),
            metrics,
            leases: Mutex::default(),
            channel: format!("corral:fleet:{}:pauses", config.name.0),
            listener: Arc::new(Notify::new()),
        });
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let wake = Arc::clone(&fleet.listener);
                runtime.spawn(listen(Arc::downgrade(&fleet), client, wake));
            }
            Err(_) => {
                tracing::warn!("fleet: no runtime; pauses reach this corral with its leases only")
            }
        }
        Some(fleet)
    }

    /// A message on the fleet's channel: "PAUSE-KEY pause MS" (another replica's 429 paused
    /// the partition), "PAUSE-KEY learned" (a shared bucket now paces it: lease from it),
    /// "PAUSE-KEY joined" (a replica new to it: the count of live replicas grew) or
    /// "PAUSE-KEY throttled BUCKETS REPLICA [first]" (a replica met an empty bucket, with its
    /// first send after its pause ended).
    fn on_message(&self, message: &str) {
        let Some(message) = Message::parse(message) else {
            return;
        };
        let key = match message {
            Message::Pause { key, .. }
            | Message::Learned { key }
            | Message::Joined { key }
            | Message::Share { key, .. }
            | Message::Pace { key, .. } => key,
            // This replica's own refusal taught its pacers already.
            Message::Throttled { replica, .. } if replica == self.replica => return,
            Message::Throttled { key, .. } => key,
        };
        for lease in self.live_leases() {
            if lease.pause_key() == key {
                match message {
                    Message::Pause { ms, .. } => lease.pause_until(pause_end(Instant::now(), ms)),
                    // A call now: its answer brings the new count of live replicas, and
                    // with it each pacer's part of an undivided report.
                    Message::Learned { .. } | Message::Joined { .. } => lease.refresh(),
                    Message::Throttled {
                        refused,
                        replica,
                        first,
                        ..
                    } => {
                        if first {
                            lease.first_refused(replica);
                        }
                        lease.peer_edge(refused);
                    }
                    Message::Share {
                        rate,
                        demand,
                        replica,
                        ..
                    } => lease.peer_share(replica, rate, demand),
                    Message::Pace {
                        pace,
                        demand,
                        replica,
                        ..
                    } => lease.peer_pace(replica, pace, demand),
                }
            }
        }
    }

    /// A lease for one partition of `upstream`: `credential` is the partition's credential
    /// (`None`: the upstream's own, from its configured headers). `peers` is told of each
    /// pause another replica shared and each refusal at a bucket's edge; `queued` counts the
    /// partition's waiting requests (the demand).
    pub fn lease(
        self: &Arc<Self>,
        upstream: &UpstreamConfig,
        credential: Option<&[u8]>,
        peers: Peers,
        queued: Arc<AtomicUsize>,
    ) -> Arc<Lease> {
        let key = self.bucket_key(upstream, credential);
        let lease = Lease::new(Arc::clone(self), key, upstream, peers, queued);
        if tokio::runtime::Handle::try_current().is_ok() {
            // At once: a partition whose requests take the fast path still heartbeats, learns
            // the shared bucket and shares its 429s.
            lease.start();
        }
        let mut leases = lock(&self.leases);
        leases.retain(|l| l.strong_count() > 0);
        leases.push(Arc::downgrade(&lease));
        lease
    }

    /// The hash tag of a partition's keys: a digest of the fleet's name, the upstream's host and
    /// name, and the credential's fingerprint. Never the credential itself.
    fn bucket_key(&self, upstream: &UpstreamConfig, credential: Option<&[u8]>) -> String {
        let base = &upstream.base_url.0;
        let host = base.authority().map(|a| a.as_str()).unwrap_or_default();
        // Header names are case-insensitive; the config's table keeps them as written.
        let own = crate::forward::CREDENTIAL_HEADERS.iter().find_map(|h| {
            upstream
                .headers
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(h.as_str()))
                .map(|(_, value)| value.0.as_bytes())
        });
        let credential = credential.or(own).unwrap_or_default();
        let mut digest = sha1_smol::Sha1::new();
        digest.update(self.name.as_bytes());
        digest.update(b"\0");
        digest.update(host.as_bytes());
        digest.update(b"\0");
        // Two upstreams of one config on one host and key keep apart (their limits may
        // differ); the replicas of a fleet run one config, so theirs meet.
        digest.update(upstream.name().as_bytes());
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

    pub fn mode(&self) -> FleetMode {
        lock(&self.health).mode
    }

    /// Whether a lease call may be made now (always, unless fallen back and the next probe is
    /// not due).
    fn may_call(&self, now: Instant) -> Result<(), Instant> {
        let h = lock(&self.health);
        if h.mode == FleetMode::Fallback && now < h.next_probe {
            return Err(h.next_probe);
        }
        Ok(())
    }

    /// Run the lease script: one round trip.
    async fn call(&self, args: &CallArgs) -> Result<Reply, CallError> {
        let invocation = args.invocation(
            &self.script,
            &self.replica,
            self.heartbeat_ttl,
            &self.channel,
        );
        let mut conn = self.conn.clone();
        let outcome = tokio::time::timeout(
            self.lease_timeout,
            invocation.invoke_async::<Vec<String>>(&mut conn),
        )
        .await;
        let result = match outcome {
            Ok(Ok(reply)) => script::parse(&reply)
                .ok_or_else(|| CallError::Redis(format!("the lease script answered {reply:?}"))),
            // redis' own response timeout (a backstop behind ours) is a slow lease too.
            Ok(Err(e)) if e.is_timeout() => Err(CallError::Timeout),
            Ok(Err(e)) if e.is_connection_refusal() => {
                Err(CallError::Refused(redact(&e.to_string(), &self.url)))
            }
            Ok(Err(e)) => Err(CallError::Redis(redact(&e.to_string(), &self.url))),
            Err(_) => Err(CallError::Timeout),
        };
        self.record(&result);
        result
    }

    /// Count the call and move between shared and fallback.
    fn record<T>(&self, result: &Result<T, CallError>) {
        let outcome = match result {
            Ok(_) => "ok",
            Err(CallError::Timeout) => "timeout",
            Err(CallError::Redis(_) | CallError::Refused(_)) => "error",
        };
        self.metrics.round_trips.with_label_values(&[outcome]).inc();
        let mut h = lock(&self.health);
        let before = h.mode;
        match result {
            Ok(_) => {
                h.failures = 0;
                h.probes = 0;
                h.mode = FleetMode::Shared;
                h.last_error = None;
                if before == FleetMode::Fallback {
                    tracing::info!(redis = %self.url, "fleet: leases from Redis again; pacing to the shared limit");
                    self.listener.notify_one();
                }
            }
            Err(e) => {
                h.failures += 1;
                let why = match e {
                    CallError::Timeout => format!(
                        "a lease took longer than lease_timeout ({:?})",
                        self.lease_timeout
                    ),
                    CallError::Redis(msg) | CallError::Refused(msg) => msg.clone(),
                };
                h.last_error = Some(why.clone());
                // A slow lease falls back at once: waiting on it is what hurts.
                let fall = matches!(e, CallError::Timeout)
                    || h.failures >= self.max_failures
                    || before != FleetMode::Shared;
                if fall {
                    if before != FleetMode::Fallback {
                        self.metrics.fallbacks.inc();
                        tracing::warn!(redis = %self.url, error = %why, "fleet: Redis is slow or unreachable; pacing to this corral's share of the last known limit until it answers");
                    }
                    h.mode = FleetMode::Fallback;
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
        if self.mode() != FleetMode::Shared {
            tracing::info!("fleet: Redis is not answering; unused leases are not returned");
            return;
        }
        let leases = self.live_leases();
        // All at once, within twice the lease timeout in all: a shutdown never waits on Redis
        // for long.
        let returns = futures_util::future::join_all(leases.iter().map(|l| l.give_back()));
        match tokio::time::timeout(self.lease_timeout * 2, returns).await {
            Ok(returned) => tracing::info!(
                partitions = leases.len(),
                units_returned = returned.iter().sum::<f64>(),
                "fleet: unused leases returned"
            ),
            Err(_) => tracing::warn!("fleet: Redis did not take the unused leases back in time"),
        }
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
async fn listen(fleet: Weak<Fleet>, client: redis::Client, wake: Arc<Notify>) {
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
            loop {
                let msg = tokio::select! {
                    msg = messages.next() => msg,
                    () = wake.notified() => None,
                };
                let Some(msg) = msg else { break };
                let Some(fleet) = fleet.upgrade() else { return };
                if let Ok(text) = msg.get_payload::<String>() {
                    fleet.on_message(&text);
                }
            }
        }
        if fleet.strong_count() == 0 {
            return;
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
    let rest = url.0.split_once("://").map_or("", |(_, rest)| rest);
    // The user info runs to the last `@` (a password may hold `/`, `?`, `#`); a unix socket's
    // password is its `pass` query value.
    let userinfo = rest
        .rsplit_once('@')
        .map(|(userinfo, _)| userinfo.split_once(':').map_or(userinfo, |(_, p)| p));
    let query = rest.split_once('?').map_or("", |(_, q)| q);
    let pass = query.split('&').find_map(|kv| {
        kv.strip_prefix("pass=")
            .or_else(|| kv.strip_prefix("password="))
    });
    let mut out = message.to_owned();
    for secret in [userinfo, pass].into_iter().flatten() {
        if !secret.is_empty() {
            out = out.replace(secret, "*****");
        }
    }
    out
}

#[cfg(test)]
mod tests;
