//! One partition's lease on its fleet's shared buckets.
//!
//! Requests take units from what this replica holds; a background task keeps it stocked: when
//! it falls below half a block (and requests want more), one call to the lease script asks for
//! the next block. A grant may run ahead of the shared level: its units then become usable as
//! the shared bucket refills (unit `k` of a grant made at level `L` with rate `r` after
//! `(k - L) / r` seconds), so replicas' blocks queue in Redis in the order they were asked for,
//! and no unit is used before the shared bucket has it.
//!
//! A block is ten requests' worth at least (one round trip per ten requests), one second of this
//! replica's recent rate or the requests waiting if more, and at most half the burst or two
//! seconds of the shared rate. What is not used within three mean gaps between requests (a
//! quarter second to [`IDLE_RETURN`]) of the last request, and
//! everything on shutdown, goes back.
//!
//! Fallen back (Redis slow or down), requests pass local buckets of this replica's share of the
//! last known limit instead: rate and burst over the live replicas, at least one per minute and
//! one at once.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::script::{pause_end, CallArgs, KindArgs};
use super::Fleet;
use crate::config::UpstreamConfig;
use crate::metrics::FleetMode;
use crate::stack::rate_limit::bucket::{take_all, Bucket};
use crate::sync::lock;

/// A block is at least this many requests' worth.
pub const MIN_BLOCK: f64 = 10.0;
/// A block covers this long of the replica's recent rate (if more than [`MIN_BLOCK`]).
const BLOCK_SPAN: f64 = 1.0;
/// At most this long of the shared rate per block...
const MAX_BLOCK_SPAN: f64 = 2.0;
/// ...and at most this share of the burst.
const MAX_BLOCK_BURST: f64 = 0.5;
/// Units held this long after the last request go back to the shared bucket.
/// (Three of this replica's mean gaps between requests, within these bounds: a lull in a busy
/// partition gives back soon, so others lease what it no longer needs; a quiet one keeps its
/// block between requests instead of asking for it again each time.)
pub const IDLE_RETURN: Duration = Duration::from_secs(2);
const IDLE_RETURN_MIN: Duration = Duration::from_millis(250);
const IDLE_GAPS: f64 = 3.0;
/// Refill calls are at least this far apart.
const MIN_SPACING: Duration = Duration::from_millis(5);

/// Which bucket.
const REQUESTS: usize = 0;
const TOKENS: usize = 1;
const KINDS: [&str; 2] = ["requests", "tokens"];

/// Units of one grant, usable as the shared bucket refills.
#[derive(Debug, Clone, Copy)]
struct Drip {
    /// When the grant arrived.
    origin: Instant,
    /// The shared level when it was made (units usable at once, if positive).
    offset: f64,
    rate: f64,
    total: f64,
    released: f64,
}

impl Drip {
    fn due(&self, now: Instant) -> f64 {
        let t = now.saturating_duration_since(self.origin).as_secs_f64();
        (self.offset + self.rate * t).clamp(0.0, self.total)
    }

    /// Units newly usable at `now`.
    fn release(&mut self, now: Instant) -> f64 {
        let due = self.due(now);
        let new = (due - self.released).max(0.0);
        self.released = self.released.max(due);
        new
    }

    fn left(&self) -> f64 {
        self.total - self.released
    }

    /// When `more` units beyond those released will be due.
    fn when(&self, more: f64) -> Instant {
        let target = (self.released + more).min(self.total);
        let secs = ((target - self.offset) / self.rate).max(0.0);
        self.origin + Duration::from_secs_f64(secs.min(3600.0))
    }
}

/// What this replica holds of one shared bucket.
#[derive(Debug, Default)]
struct Holding {
    /// The shared bucket's rate and burst (configured, or as Redis last said); `None`: it does
    /// not gate (nothing known yet).
    shared: Option<(f64, f64)>,
    /// Usable now (negative: a large request took more than was usable; at most one burst).
    available: f64,
    drips: VecDeque<Drip>,
    /// Units to give back with the next call.
    give_back: f64,
    /// The shared bucket's epoch, as Redis last said (a new one after Redis lost it).
    epoch: Option<String>,
    /// What the pacers learned, to share; and what was last shared.
    learned: Option<(f64, f64, Option<f64>)>,
    published: Option<(f64, f64)>,
}

impl Holding {
    fn release(&mut self, now: Instant) {
        for d in &mut self.drips {
            self.available += d.release(now);
        }
        self.drips.retain(|d| d.left() > 1e-9);
    }

    fn held(&self) -> f64 {
        self.available.max(0.0) + self.drips.iter().map(Drip::left).sum::<f64>()
    }

    /// When `need` units will be usable from what is held, if they will.
    fn ready_at(&self, need: f64) -> Option<Instant> {
        let mut short = need - self.available;
        for d in &self.drips {
            if d.left() >= short {
                return Some(d.when(short));
            }
            short -= d.left();
        }
        None
    }

    /// The shared bucket's epoch is `epoch` as of `now`. A new one means Redis lost the bucket
    /// the units held came from and made another, full or empty from `now` on: units of the
    /// lost one not yet due would spend the same refill twice, so they go (those already
    /// usable stay: they were due when the bucket still had them).
    fn rebase(&mut self, epoch: &str, now: Instant) {
        if self.epoch.as_deref().is_some_and(|e| e != epoch) {
            self.release(now);
            self.drips.clear();
        }
        self.epoch = Some(epoch.to_owned());
    }

    /// Everything held, emptied.
    fn drain(&mut self) -> f64 {
        // A debt (a request larger than the burst took more than was usable) is paid first.
        let held = (self.available + self.drips.iter().map(Drip::left).sum::<f64>()).max(0.0);
        self.available = 0.0;
        self.drips.clear();
        held
    }
}

/// Smoothed requests per second taken.
#[derive(Debug)]
struct Demand {
    since: Instant,
    count: f64,
    rate: f64,
}

impl Demand {
    /// The rate, decayed by a lull since the last sample.
    fn current(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.since).as_secs_f64();
        if dt < 1.0 {
            return self.rate;
        }
        let w = 0.5f64.powf(dt);
        w * self.rate + (1.0 - w) * self.count / dt
    }

    fn record(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.since).as_secs_f64();
        if dt >= 1.0 {
            self.rate = 0.5 * self.rate + 0.5 * self.count / dt;
            self.since = now;
            self.count = 0.0;
        }
        self.count += 1.0;
    }
}

/// Local buckets of this replica's share, while fallen back.
struct Share {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Share {
    /// One request and `cost` tokens, both checked before either is taken.
    async fn take(&self, cost: f64, deadline: Instant) -> Result<(), Duration> {
        let stages: Vec<(&Bucket, u32)> = [(&self.requests, 1), (&self.tokens, cost.ceil() as u32)]
            .into_iter()
            .filter_map(|(bucket, n)| bucket.as_ref().map(|b| (b, n)))
            .collect();
        take_all(&stages, deadline).await
    }
}

struct State {
    holdings: [Holding; 2],
    demand: Demand,
    /// Requests arriving at the partition (attempts), per second.
    arrivals: Demand,
    last_take: Option<Instant>,
    /// Requests waiting on the partition.
    waiting: usize,
    /// Mean token cost of a request.
    avg_cost: f64,
    last_call: Option<Instant>,
    /// A call is wanted now (a 429 to share, a limit newly learned).
    urgent: bool,
    /// The end of this replica's latest 429 pause, to share (what is left of it when the call
    /// goes, not its length: a call that waits for Redis must not lengthen it).
    pause_until: Option<Instant>,
    refused: u8,
    live: u64,
    share: Option<Arc<Share>>,
    /// After a call granted less than it asked (the shared bucket queued far ahead), no
    /// refill call before this.
    not_before: Option<Instant>,
    /// Units held when the fleet fell back: the local share starts with them.
    carried: [f64; 2],
    /// Back from a fallback: also keep to the local share until then, or until this many
    /// replicas are live again.
    rejoin: Option<(Instant, u64)>,
    /// Units the waiting request needs beyond all that is held (a request larger than a
    /// block): the next call asks for at least this much.
    shortfall: [f64; 2],
    /// Fell back since the last answer: a bucket Redis no longer has starts empty.
    resync: bool,
}

/// Where a request stands.
enum Step {
    /// Taken; also take from this share (rejoining after a fallback); wake the refill task
    /// if `true` (the lease runs low).
    Taken(Option<Arc<Share>>, bool),
    Fallback(Arc<Share>),
    /// Wait until then (`None`: for a grant), asking for a refill if `true`.
    Wait(Option<Instant>, bool),
}

/// One partition's lease.
pub struct Lease {
    fleet: Arc<Fleet>,
    keys: [String; 4],
    /// Configured rate (units/s) and burst per bucket.
    config: [Option<(f64, f64)>; 2],
    state: Mutex<State>,
    /// Wakes the refill task.
    wake: Notify,
    /// Wakes waiting requests: a grant arrived, or the mode changed.
    granted: Notify,
    started: Once,
    /// Called with the end of a pause Redis reports.
    on_pause: Box<dyn Fn(Instant) + Send + Sync>,
    /// Requests waiting on the partition (the demand).
    queued: Arc<AtomicUsize>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.keys[0])
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub(super) fn new(
        fleet: Arc<Fleet>,
        key: String,
        upstream: &UpstreamConfig,
        on_pause: Box<dyn Fn(Instant) + Send + Sync>,
        queued: Arc<AtomicUsize>,
    ) -> Arc<Self> {
        let l = &upstream.limits;
        let requests = l.rpm.map(|rpm| {
            let burst = l.burst.map_or((rpm.get() / 60).max(1), NonZeroU32::get);
            (f64::from(rpm.get()) / 60.0, f64::from(burst))
        });
        let tokens = l.tpm.map(|tpm| {
            let burst = l
                .token_burst
                .map_or((tpm.get() / 6).max(1), NonZeroU32::get);
            (f64::from(tpm.get()) / 60.0, f64::from(burst))
        });
        let config = [requests, tokens];
        let now = Instant::now();
        Arc::new(Self {
            fleet,
            keys: ["requests", "tokens", "pause", "replicas"].map(|k| format!("{key}:{k}")),
            config,
            state: Mutex::new(State::new(config, now)),
            wake: Notify::new(),
            granted: Notify::new(),
            started: Once::new(),
            on_pause,
            queued,
        })
    }

    /// The key of this partition's shared pause (as published).
    pub(super) fn pause_key(&self) -> &str {
        &self.keys[2]
    }

    /// Another replica's 429 paused the partition until then.
    pub(super) fn pause_until(&self, until: Instant) {
        (self.on_pause)(until);
    }

    /// Call Redis now (another replica created the shared bucket).
    pub(super) fn refresh(&self) {
        lock(&self.state).urgent = true;
        self.wake.notify_one();
    }

    /// Whether requests must go through [`acquire`](Self::acquire) (a shared bucket gates, or
    /// the fleet is not answering).
    pub fn gates(&self) -> bool {
        self.fleet.mode() != FleetMode::Shared
            || lock(&self.state)
                .holdings
                .iter()
                .any(|p| p.shared.is_some())
    }

    /// A request arrived at the partition (its demand).
    pub fn arrived(&self) {
        lock(&self.state).arrivals.record(Instant::now());
    }

    /// Whether the shared tokens bucket gates (so requests need a token estimate).
    pub fn charges_tokens(&self) -> bool {
        lock(&self.state).holdings[TOKENS].shared.is_some()
    }

    /// Take one request and `cost` tokens, waiting while the deadline allows; `Err`: the wait
    /// it would need.
    pub async fn acquire(self: &Arc<Self>, cost: f64, deadline: Instant) -> Result<(), Duration> {
        self.start();
        loop {
            let granted = self.granted.notified();
            tokio::pin!(granted);
            granted.as_mut().enable();
            let now = Instant::now();
            let step = {
                let mut s = lock(&self.state);
                s.waiting = self.queued.load(Ordering::Acquire);
                if self.fleet.mode() == FleetMode::Fallback {
                    // Demand: the refill task probes Redis while requests come.
                    s.last_take = Some(now);
                    if self.fleet.may_call(now).is_ok() {
                        self.wake.notify_one();
                    }
                    Step::Fallback(s.share())
                } else {
                    s.try_take(cost, now)
                }
            };
            match step {
                Step::Taken(share, low) => {
                    if low {
                        self.wake.notify_one();
                    }
                    let Some(share) = share else { return Ok(()) };
                    return share.take(cost, deadline).await;
                }
                Step::Fallback(share) => return share.take(cost, deadline).await,
                Step::Wait(at, refill) => {
                    if refill {
                        self.wake.notify_one();
                    }
                    if let Some(at) = at.filter(|at| *at > deadline) {
                        return Err(at.saturating_duration_since(now));
                    }
                    if now >= deadline {
                        return Err(Duration::from_secs(1));
                    }
                    let until = at.unwrap_or(deadline).min(deadline);
                    tokio::select! {
                        () = &mut granted => {}
                        () = tokio::time::sleep_until(until.max(now + Duration::from_micros(100))) => {}
                    }
                }
            }
        }
    }

    /// What the pacers learned of bucket `kind` (0 requests, 1 tokens): shared with the next
    /// call, at once if it is the first.
    pub fn learned(&self, kind: usize, model: Option<(f64, f64, Option<f64>)>) {
        let Some(model) = model else { return };
        let mut s = lock(&self.state);
        let holding = &mut s.holdings[kind];
        holding.learned = Some(model);
        // The first thing learned goes at once (the fleet may still be pacing blind); later
        // changes ride with the next lease.
        if holding.published.is_none() && self.config[kind].is_none() {
            s.urgent = true;
            drop(s);
            self.wake.notify_one();
        }
    }

    /// A 429: share its pause (and which buckets refused) with the fleet now.
    pub fn throttled(&self, pause: Duration, requests: bool, tokens: bool) {
        let mut s = lock(&self.state);
        let until = Instant::now() + pause;
        s.pause_until = Some(s.pause_until.map_or(until, |u| u.max(until)));
        s.refused |= u8::from(requests) | (u8::from(tokens) << 1);
        s.urgent = true;
        drop(s);
        self.wake.notify_one();
    }

    /// The fleet moved between shared and fallback.
    pub(super) fn mode_changed(&self) {
        let mut s = lock(&self.state);
        match self.fleet.mode() {
            FleetMode::Fallback => {
                // What was usable was paid for (Redis counted it as taken): the local share
                // starts with it instead, never given back too (that would count it twice).
                let now = Instant::now();
                for k in 0..2 {
                    let holding = &mut s.holdings[k];
                    holding.release(now);
                    let usable = holding.available.max(0.0);
                    let ahead = holding.drain() - usable;
                    // Units not yet due go back to Redis when it answers again.
                    holding.give_back += ahead.max(0.0);
                    s.carried[k] = usable;
                }
                s.share = None;
                s.resync = true;
                s.rejoin = None;
            }
            FleetMode::Shared if s.share.is_some() => {
                // Back from a fallback: the others may still be pacing at their shares, and
                // Redis (if it lost its data) does not know them. Until they are back (the live
                // count is what it was) or a heartbeat TTL passes, this one keeps to its share
                // as well as to the lease.
                let until = Instant::now() + self.fleet.heartbeat_ttl;
                s.rejoin = Some((until, s.live));
            }
            _ => {}
        }
        drop(s);
        self.granted.notify_waiters();
        self.wake.notify_one();
    }

    /// Give back everything held and leave the live set (shutdown, or the partition dropped).
    pub(super) async fn give_back(&self) -> f64 {
        let args = {
            let mut s = lock(&self.state);
            for holding in &mut s.holdings {
                holding.give_back += holding.drain();
            }
            self.args(&mut s, true, Instant::now())
        };
        let total: f64 = args.kinds.iter().map(|k| k.give_back).sum();
        let worth_a_call = total > 0.0 || self.fleet.mode() == FleetMode::Shared;
        if worth_a_call && self.fleet.call(&args).await.is_err() {
            return 0.0;
        }
        total
    }

    /// A JSON view for `/status`.
    pub fn status(&self) -> serde_json::Value {
        let s = lock(&self.state);
        let view = |p: &Holding| {
            serde_json::json!({
                "shared_rate_per_second": p.shared.map(|s| s.0),
                "shared_burst": p.shared.map(|s| s.1),
                "held": p.held(),
            })
        };
        serde_json::json!({
            "mode": self.fleet.mode().label(),
            "live_replicas": s.live,
            "requests": view(&s.holdings[REQUESTS]),
            "tokens": view(&s.holdings[TOKENS]),
        })
    }

    /// Start the refill task (on creation, with a runtime; else on the first request).
    pub(super) fn start(self: &Arc<Self>) {
        self.started
            .call_once(|| match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(refill(Arc::downgrade(self)));
                }
                Err(_) => tracing::warn!("fleet: a lease without a runtime never calls Redis"),
            });
    }

    /// The next call's arguments, taking what is to be shared and given back.
    fn args(&self, s: &mut State, leaving: bool, now: Instant) -> CallArgs {
        let fallen = self.fleet.mode() == FleetMode::Fallback;
        let kind = |s: &mut State, k: usize| {
            // A whole block, so that each call covers ten requests or more.
            // Probes while fallen back ask for nothing: one that times out may still run.
            let want = if !leaving && !fallen && s.wants_more(k, now) {
                s.want(k, now).max(s.shortfall[k]).ceil()
            } else {
                0.0
            };
            let holding = &mut s.holdings[k];
            KindArgs {
                want,
                epoch: holding.epoch.clone(),
                give_back: std::mem::take(&mut holding.give_back),
                config: self.config[k],
                learned: holding.learned,
            }
        };
        let kinds = [kind(s, REQUESTS), kind(s, TOKENS)];
        let pause_ms = s
            .pause_until
            .take()
            .map_or(0, |u| u.saturating_duration_since(now).as_millis() as u64);
        // A refusal whose pause has passed is old news.
        let refused = std::mem::take(&mut s.refused);
        CallArgs {
            keys: self.keys.clone(),
            resync: s.resync,
            leaving,
            pause_ms,
            refused: if pause_ms > 0 { refused } else { 0 },
            kinds,
        }
    }

    /// When the refill task should call next (now or earlier: at once).
    fn next_call(&self, now: Instant) -> Instant {
        let heartbeat = self.fleet.heartbeat_ttl / 3;
        let mut s = lock(&self.state);
        s.waiting = self.queued.load(Ordering::Acquire);
        let probe = match self.fleet.may_call(now) {
            Ok(()) => now,
            Err(at) => at,
        };
        // Never a busy loop: calls at least MIN_SPACING apart.
        let spaced = s.last_call.map_or(now, |at| at + MIN_SPACING).max(probe);
        if s.urgent || s.last_call.is_none() || s.idle_holding(now) {
            return spaced;
        }
        if (0..2).any(|k| s.wants_more(k, now)) {
            // None while the shared bucket is queued beyond what it would grant.
            return spaced.max(s.not_before.unwrap_or(now));
        }
        // Heartbeats and probes only while requests draw on a shared bucket: the live count is
        // the replicas that use it, and idle partitions (thousands, with `api_key`) cost Redis
        // nothing. A request wakes the task again when its lease runs low.
        let active = s.waiting > 0
            || s.last_take
                .is_some_and(|at| now.saturating_duration_since(at) < self.fleet.heartbeat_ttl);
        let gated = s.holdings.iter().any(|p| p.shared.is_some());
        let beat = (active && gated).then(|| s.last_call.map_or(now, |at| at + heartbeat));
        let idle = s
            .last_take
            .filter(|_| s.waiting == 0 && s.holdings.iter().any(|p| p.held() > 0.0))
            .map(|at| at + s.idle_after());
        let fallback = (self.fleet.mode() == FleetMode::Fallback && active).then_some(probe);
        [beat, idle, fallback]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + Duration::from_secs(3600))
            .max(spaced)
    }

    /// One call: ask, give back, share; apply the answer.
    async fn call_once(&self) {
        let sent;
        let (args, idle) = {
            let mut s = lock(&self.state);
            sent = Instant::now();
            let idle = s.idle_holding(sent);
            if idle {
                for holding in &mut s.holdings {
                    holding.give_back += holding.drain();
                }
            }
            s.urgent = false;
            s.last_call = Some(sent);
            (self.args(&mut s, false, sent), idle)
        };
        let result = self.fleet.call(&args).await;
        let now = Instant::now();
        let mut s = lock(&self.state);
        let reply = match result {
            Ok(reply) => reply,
            Err(e) => {
                // Not delivered: share with the next call. Units to give back only if the
                // connection was refused: a call that timed out or broke may still have run (a
                // paused or stopped Redis runs it later), and losing them is the safe way to be
                // wrong.
                if matches!(e, super::CallError::Refused(_)) {
                    for (holding, kind) in s.holdings.iter_mut().zip(&args.kinds) {
                        holding.give_back += kind.give_back;
                    }
                }
                if args.pause_ms > 0 {
                    let until = sent + Duration::from_millis(args.pause_ms);
                    s.pause_until = Some(s.pause_until.map_or(until, |u| u.max(until)));
                    s.refused |= args.refused;
                    s.urgent = true;
                }
                if idle {
                    s.urgent = true;
                }
                return;
            }
        };
        let mut not_before: Option<Instant> = None;
        for (k, holding) in s.holdings.iter_mut().enumerate() {
            let (grant, before, rate, burst) = reply.kinds[k];
            holding.rebase(&reply.epochs[k], now);
            if rate > 0.0 && grant < args.kinds[k].want {
                let wait = ((args.kinds[k].want - grant) / rate).clamp(0.01, 1.0);
                let until = now + Duration::from_secs_f64(wait);
                not_before = Some(not_before.map_or(until, |t: Instant| t.max(until)));
            }
            holding.shared = (rate > 0.0).then_some((rate, burst));
            if let Some(l) = args.kinds[k].learned {
                holding.published = Some((l.0, l.1));
            }
            if rate > 0.0 && grant > 0.0 {
                holding.drips.push_back(Drip {
                    origin: now,
                    offset: before,
                    rate,
                    total: grant,
                    released: 0.0,
                });
                self.fleet
                    .metrics
                    .leased
                    .with_label_values(&[KINDS[k]])
                    .inc_by(grant as u64);
            }
        }
        s.not_before = not_before;
        s.resync = false;
        s.live = reply.live;
        self.fleet.metrics.live_replicas.set(reply.live as i64);
        drop(s);
        if reply.pause_ms > 0 {
            (self.on_pause)(pause_end(now, reply.pause_ms));
        }
        self.granted.notify_waiters();
    }
}

impl State {
    /// Nothing held yet, for buckets of these configured rates and bursts.
    fn new(config: [Option<(f64, f64)>; 2], now: Instant) -> Self {
        let holding = |c: Option<(f64, f64)>| Holding {
            shared: c,
            ..Holding::default()
        };
        let demand = || Demand {
            since: now,
            count: 0.0,
            rate: 0.0,
        };
        Self {
            holdings: config.map(holding),
            demand: demand(),
            arrivals: demand(),
            last_take: None,
            waiting: 0,
            avg_cost: 1.0,
            last_call: None,
            urgent: true,
            pause_until: None,
            refused: 0,
            live: 1,
            share: None,
            not_before: None,
            carried: [0.0; 2],
            rejoin: None,
            shortfall: [0.0; 2],
            resync: false,
        }
    }

    /// The block size of bucket `k`, in its units.
    fn block(&self, k: usize) -> f64 {
        let Some((rate, burst)) = self.holdings[k].shared else {
            return 0.0;
        };
        let unit = if k == TOKENS {
            self.avg_cost.max(1.0)
        } else {
            1.0
        };
        let demand = (self.demand.rate * BLOCK_SPAN).max(self.waiting as f64) * unit;
        let min = MIN_BLOCK * unit;
        let max = (burst * MAX_BLOCK_BURST)
            .min(rate * MAX_BLOCK_SPAN)
            .max(min);
        demand.clamp(min, max)
    }

    /// What to ask for: a block, but no more than the requests waiting and a second of
    /// arrivals need beyond what is held (a batch whose queue drains must not hold units the
    /// other replicas wait behind).
    fn want(&self, k: usize, now: Instant) -> f64 {
        let unit = if k == TOKENS {
            self.avg_cost.max(1.0)
        } else {
            1.0
        };
        self.block(k)
            .min((self.need(k, now) - self.holdings[k].held()).max(unit))
    }

    /// Bucket `k` gates, holds less than half a block, and requests wait. (Never ahead of
    /// demand when none waits: a batch that ends must not leave units queued ahead of the
    /// replicas still working; a request that finds the lease empty waits one round trip.)
    fn wants_more(&self, k: usize, now: Instant) -> bool {
        let held = self.holdings[k].held();
        self.holdings[k].shared.is_some()
            && self.waiting > 0
            && ((held < self.block(k) / 2.0 && self.need(k, now) > held) || self.shortfall[k] > 0.0)
    }

    /// Units the requests waiting and a second of arrivals need.
    fn need(&self, k: usize, now: Instant) -> f64 {
        let unit = if k == TOKENS {
            self.avg_cost.max(1.0)
        } else {
            1.0
        };
        (self.waiting as f64 + self.arrivals.current(now) * BLOCK_SPAN) * unit
    }

    /// After how long without a request units held go back: three mean gaps between
    /// requests, between [`IDLE_RETURN_MIN`] and [`IDLE_RETURN`].
    fn idle_after(&self) -> Duration {
        let gaps = IDLE_GAPS / self.demand.rate.max(f64::MIN_POSITIVE);
        Duration::from_secs_f64(gaps.min(IDLE_RETURN.as_secs_f64())).max(IDLE_RETURN_MIN)
    }

    /// Units held and no request for [`idle_after`](Self::idle_after).
    fn idle_holding(&self, now: Instant) -> bool {
        self.waiting == 0
            && self
                .last_take
                .is_some_and(|at| now.saturating_duration_since(at) >= self.idle_after())
            && self.holdings.iter().any(|p| p.held() > 0.0)
    }

    fn try_take(&mut self, cost: f64, now: Instant) -> Step {
        for holding in &mut self.holdings {
            holding.release(now);
        }
        let need = |p: &Holding, units: f64| match p.shared {
            Some((_, burst)) if units > 0.0 => Some(units.min(burst).max(f64::MIN_POSITIVE)),
            _ => None,
        };
        let needs = [
            need(&self.holdings[REQUESTS], 1.0),
            need(&self.holdings[TOKENS], cost),
        ];
        let short: Vec<usize> = (0..2)
            .filter(|&k| needs[k].is_some_and(|n| self.holdings[k].available < n))
            .collect();
        self.shortfall = [0.0; 2];
        if short.is_empty() {
            // A request larger than what is usable (its estimate beyond the burst) owes the
            // rest, but never more than one burst: the upstream's bucket cannot hold more, and a
            // larger debt would hold the partition for the whole of one request's cost.
            for (k, units) in [(REQUESTS, 1.0), (TOKENS, cost)] {
                if let (Some(_), Some((_, burst))) = (needs[k], self.holdings[k].shared) {
                    let holding = &mut self.holdings[k];
                    holding.available = (holding.available - units).max(-burst);
                }
            }
            self.demand.record(now);
            self.last_take = Some(now);
            if cost > 0.0 {
                self.avg_cost = 0.9 * self.avg_cost + 0.1 * cost;
            }
            let rejoining = match self.rejoin {
                Some((until, live)) if now < until && self.live < live => true,
                _ => {
                    self.rejoin = None;
                    false
                }
            };
            // Others still waiting (this request is counted until it returns). With none, the
            // refill task is woken too, to give back what is held after a lull.
            self.waiting = self.waiting.saturating_sub(1);
            let low = (0..2).any(|k| self.wants_more(k, now))
                || (self.waiting == 0 && self.holdings.iter().any(|p| p.held() > 0.0));
            return Step::Taken(rejoining.then(|| self.share()), low);
        }
        let mut at = Some(now);
        for &k in &short {
            let need = needs[k].unwrap_or(0.0);
            let ready = self.holdings[k].ready_at(need);
            if ready.is_none() {
                let held = self.holdings[k].available
                    + self.holdings[k].drips.iter().map(Drip::left).sum::<f64>();
                self.shortfall[k] = (need - held).max(0.0);
            }
            at = match (at, ready) {
                (Some(a), Some(r)) => Some(a.max(r)),
                _ => None,
            };
        }
        let refill = short
            .iter()
            .any(|&k| self.holdings[k].held() < self.block(k) / 2.0 || self.shortfall[k] > 0.0)
            || self.last_call.is_none();
        Step::Wait(at, refill)
    }

    /// This replica's share of the last known limit, built once per fallback.
    fn share(&mut self) -> Arc<Share> {
        if let Some(share) = &self.share {
            return Arc::clone(share);
        }
        let live = self.live.max(1) as f64;
        let bucket = |p: &Holding, carried: f64| {
            p.shared.map(|(rate, burst)| {
                let per_minute = ((rate * 60.0 / live).round() as u32).max(1);
                let burst = ((burst / live).round() as u32).max(1);
                let bucket = Bucket::per_minute(
                    NonZeroU32::new(per_minute).expect("at least 1"),
                    NonZeroU32::new(burst).expect("at least 1"),
                );
                // It starts with what this replica held, not full: the upstream's bucket was
                // being spent at the shared rate.
                let spent = burst.saturating_sub(carried.floor() as u32);
                if spent > 0 {
                    let _ = bucket.try_take(spent);
                }
                bucket
            })
        };
        let share = Arc::new(Share {
            requests: bucket(&self.holdings[REQUESTS], self.carried[REQUESTS]),
            tokens: bucket(&self.holdings[TOKENS], self.carried[TOKENS]),
        });
        self.share = Some(Arc::clone(&share));
        share
    }
}

/// The refill task of one lease: ends when only it holds the lease (its partition is gone),
/// giving back what the lease held.
async fn refill(lease: Weak<Lease>) {
    loop {
        let Some(lease) = lease.upgrade() else { return };
        if Arc::strong_count(&lease) == 1 {
            lease.give_back().await;
            return;
        }
        let now = Instant::now();
        let at = lease.next_call(now);
        if at <= now {
            lease.call_once().await;
            continue;
        }
        let woken = lease.wake.notified();
        tokio::select! {
            () = woken => {}
            () = tokio::time::sleep_until(at) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_grant_below_the_shared_level_is_usable_as_the_bucket_refills() {
        let now = Instant::now();
        // 10 units granted at level 4, refilling 2/s: 4 at once, then one every half second.
        let mut holding = Holding {
            shared: Some((2.0, 50.0)),
            ..Holding::default()
        };
        holding.drips.push_back(Drip {
            origin: now,
            offset: 4.0,
            rate: 2.0,
            total: 10.0,
            released: 0.0,
        });
        holding.release(now);
        assert_eq!(holding.available, 4.0);
        assert_eq!(
            holding.ready_at(5.0),
            Some(now + Duration::from_millis(500))
        );
        holding.release(now + Duration::from_secs(2));
        assert_eq!(holding.available, 8.0);
        holding.release(now + Duration::from_secs(60));
        assert_eq!(holding.available, 10.0, "never more than granted");
        assert_eq!(holding.held(), 10.0);
        assert_eq!(
            holding.ready_at(11.0),
            None,
            "beyond the grant: wait for another"
        );
        // A grant that queued behind others (level -6): nothing before 3 s.
        let mut queued = Holding::default();
        queued.drips.push_back(Drip {
            origin: now,
            offset: -6.0,
            rate: 2.0,
            total: 10.0,
            released: 0.0,
        });
        queued.release(now + Duration::from_millis(2999));
        assert!(queued.available < 1.0);
        assert_eq!(
            queued.ready_at(1.0),
            Some(now + Duration::from_millis(3500))
        );
    }

    /// A request larger than the shared burst takes what is usable and owes at most one burst:
    /// the partition is not held for the whole of its cost at the shared rate.
    #[tokio::test(start_paused = true)]
    async fn a_huge_request_owes_the_lease_at_most_one_burst() {
        let now = Instant::now();
        let (rate, burst) = (100.0, 1_000.0);
        let mut s = State::new([Some((10.0, 50.0)), Some((rate, burst))], now);
        for holding in &mut s.holdings {
            holding.available = holding.shared.unwrap().1;
        }
        assert!(matches!(s.try_take(1.0e9, now), Step::Taken(..)));
        let tokens = &s.holdings[TOKENS];
        assert!(
            tokens.available >= -burst,
            "owes {} tokens, more than the burst of {burst}",
            -tokens.available
        );
        // Granted again at the shared rate, the next request waits for the debt and its own
        // units: at most two bursts' worth of refill.
        s.holdings[TOKENS].drips.push_back(Drip {
            origin: now,
            offset: 0.0,
            rate,
            total: 2.0 * burst,
            released: 0.0,
        });
        let ready = s.holdings[TOKENS].ready_at(1.0).expect("within the grant");
        assert!(
            ready <= now + Duration::from_secs_f64(2.0 * burst / rate),
            "ready after {:?}",
            ready - now
        );
    }

    /// Redis lost the bucket a grant came from (a new epoch): the grant's units not yet due are
    /// dropped, the usable ones kept; the same epoch keeps everything.
    #[tokio::test(start_paused = true)]
    async fn units_not_yet_due_from_a_lost_bucket_are_dropped() {
        let now = Instant::now();
        let mut holding = Holding {
            shared: Some((1.0, 5.0)),
            ..Holding::default()
        };
        holding.rebase("1:a", now);
        holding.drips.push_back(Drip {
            origin: now,
            offset: 2.0,
            rate: 1.0,
            total: 10.0,
            released: 0.0,
        });
        holding.rebase("1:a", now);
        assert_eq!(holding.held(), 10.0, "same bucket: all kept");
        holding.rebase("2:b", now);
        assert_eq!(holding.available, 2.0, "the two due at once are kept");
        assert_eq!(holding.held(), 2.0, "the eight not yet due are gone");
    }
}
