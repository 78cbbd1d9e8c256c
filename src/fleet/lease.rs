//! One partition's lease on its fleet's shared buckets: the handle its requests take from
//! ([`Lease`]) and the task that keeps it stocked.
//!
//! Requests take units from what this replica holds (the accounting: `accounting`). A
//! background task per lease keeps it stocked: when it falls below half a block (and requests
//! want more), one call to the lease script (`script`) asks for the next block. The same call
//! gives back what went unused, shares this replica's 429 pauses and what its pacers learned,
//! and heartbeats while requests draw on a shared bucket. The task ends with its partition,
//! giving back what the lease held.
//!
//! Fallen back (Redis slow or down), requests pass local buckets of this replica's share of the
//! last known limit instead, and the task probes Redis while requests come.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::accounting::{Account, Admission, Holding, KINDS, REQUESTS, TOKENS};
pub use super::accounting::{IDLE_RETURN, MIN_BLOCK};
use super::script::{pause_end, CallArgs};
use super::shares::{MyPace, Paces, Shares};
use super::{CallError, Fleet};
use crate::config::UpstreamConfig;
use crate::metrics::FleetMode;
use crate::sync::lock;

/// A shared bucket divides a reported one when its rate is at most this many times the
/// report's: a learned bucket is the report's own rate, a configured one near it is the
/// limit the user read from the same page.
const DIVIDES: f64 = 1.1;

/// A replica's refused first send after a pause is kept this long ([`Lease::first_refused`]).
const FIRSTS_KEPT: Duration = Duration::from_secs(10);
/// The replicas' refused first sends after one pause are heard within this of each other: the
/// pause ends when its publication reaches each, and each refusal takes its round trip.
const FIRSTS_SPREAD: Duration = Duration::from_millis(500);

/// What a lease tells its partition of its peers' 429s.
pub struct Peers {
    /// The end of a pause Redis reports (a peer's 429 named it).
    pub pause: Box<dyn Fn(Instant) + Send + Sync>,
    /// A peer was refused at the edge of these buckets (requests, tokens): they were empty now.
    /// Returns the requests pacer's share of the key's rate, if that closed an estimate.
    pub edge: Box<dyn Fn(bool, bool) -> Option<f64> + Send + Sync>,
    /// This replica's part of the key's request rate, as the fleet's shares add up.
    pub share: Box<dyn Fn(f64) + Send + Sync>,
    /// The requests pacer's pace, when the 429s of a key that reports no limit cap it.
    pub pace: Box<dyn Fn() -> Option<f64> + Send + Sync>,
    /// This replica's part of the fleet's paces split by demand, as a multiple of its own.
    pub scale: Box<dyn Fn(f64) + Send + Sync>,
    /// Every live replica's first send after one pause was refused with a named wait: the
    /// upstream's refusals are an admission control's, not a bucket's ([`Lease::throttled`]).
    pub admission: Box<dyn Fn() + Send + Sync>,
}

/// One partition's lease.
pub struct Lease {
    fleet: Arc<Fleet>,
    keys: [String; 4],
    /// Configured rate (units/s) and burst per bucket.
    config: [Option<(f64, f64)>; 2],
    account: Mutex<Account>,
    /// Wakes the refill task.
    wake: Notify,
    /// Wakes waiting requests: a grant arrived, or the mode changed.
    granted: Notify,
    started: Once,
    /// What the partition is told of its peers.
    peers: Peers,
    /// The replicas' latest shares of the key's request rate.
    shares: Mutex<Shares>,
    /// The replicas' latest paces, capped by the 429s, and their demands.
    paces: Mutex<Paces>,
    /// This replica's pace and demand as published.
    mine: Mutex<MyPace>,
    /// Requests waiting on the partition (the demand).
    queued: Arc<AtomicUsize>,
    /// Answers to the partition's attempts, counted ([`Lease::answered`]).
    answers: AtomicU64,
    /// When each replica's first send after a pause was last refused, this one's and its
    /// peers' ([`Lease::first_refused`]).
    firsts: Mutex<Vec<(String, Instant)>>,
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
        peers: Peers,
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
            account: Mutex::new(Account::new(config, now)),
            wake: Notify::new(),
            granted: Notify::new(),
            started: Once::new(),
            peers,
            shares: Mutex::new(Shares::default()),
            paces: Mutex::new(Paces::default()),
            mine: Mutex::new(MyPace::default()),
            queued,
            answers: AtomicU64::new(0),
            firsts: Mutex::new(Vec::new()),
        })
    }

    /// The key of this partition's shared pause (as published).
    pub(super) fn pause_key(&self) -> &str {
        &self.keys[2]
    }

    /// Another replica's 429 paused the partition until then.
    pub(super) fn pause_until(&self, until: Instant) {
        (self.peers.pause)(until);
    }

    /// This replica estimated its share of the key's request rate (`rate`, from throttle
    /// windows): publish it with its demand (what it sends at that rate in the next second,
    /// plus the requests waiting), so that the replicas split the key's rate by demand.
    pub fn estimated(&self, rate: f64) {
        let demand = rate + self.queued.load(Ordering::Acquire) as f64;
        let mut s = lock(&self.account);
        s.estimate = Some((rate, demand));
        s.urgent = true;
        drop(s);
        self.wake.notify_one();
    }

    /// An attempt of the partition's was answered (what it sends, when none waits).
    pub fn answered(&self) {
        self.answers.fetch_add(1, Ordering::Relaxed);
    }

    /// When this replica's pace and demand are next checked: while no shared bucket divides
    /// the key, until an idle demand is published and no request waits.
    fn pace_due(&self, now: Instant) -> Option<Instant> {
        if self.shared_requests() {
            return None;
        }
        let active = self.queued.load(Ordering::Acquire) > 0;
        lock(&self.mine).due(active, now)
    }

    /// Check this replica's pace and demand at `now`: when the 429s cap the pace and either
    /// moved far from what was published, publish them with the next call.
    fn check_pace(&self, now: Instant) {
        if self.pace_due(now).is_none_or(|due| due > now) {
            return;
        }
        let pace = (self.peers.pace)();
        let answers = self.answers.load(Ordering::Relaxed);
        let queued = self.queued.load(Ordering::Acquire);
        let Some(news) = lock(&self.mine).check(now, pace, queued, answers) else {
            return;
        };
        let mut s = lock(&self.account);
        s.pace_news = Some(news);
        s.urgent = true;
    }

    /// `replica` (this one too: the channel echoes it) published its pace and demand: this
    /// replica sends at its part of the paces' sum, split by demand.
    pub(super) fn peer_pace(&self, replica: &str, pace: f64, demand: f64) {
        if self.shared_requests() {
            return;
        }
        let mut paces = lock(&self.paces);
        paces.heard(replica, pace, demand, Instant::now());
        let scale = paces.scale(&self.fleet.replica);
        drop(paces);
        if let Some(scale) = scale {
            (self.peers.scale)(scale);
        }
    }

    /// Whether Redis holds a shared requests bucket for the key (configured, or learned from
    /// the provider's headers): then the peers' refusals and shares have nothing to add (they
    /// are for a key whose rate only the 429s show; where the bucket is faster than the
    /// provider's report, the pacers take their part of the report, [`Self::undivided`]).
    fn shared_requests(&self) -> bool {
        lock(&self.account).holdings[REQUESTS].shared.is_some()
    }

    /// For each bucket (requests, tokens), the replicas that read the provider's reports of it
    /// with nothing dividing it (the live ones while Redis has no shared bucket of its kind, else
    /// 1), and whether a shared bucket divides it. `reported`: the rate each pacer reads from
    /// the provider's headers, if any. A shared bucket faster than that by more than
    /// [`DIVIDES`] divides nothing the upstream enforces (a configured limit above the
    /// provider's: one told for a key, over a model whose own limit is lower, or a limit that
    /// dropped): each replica then takes its part of the report. Each reading all of it under
    /// a bucket that never bound, four replicas sent four times the slow model's rate
    /// (`models` on Redis with the limit set: 40-53 rate 429s of 500). Also the live replicas
    /// on the key (1 before Redis has counted them), from the same look at the account.
    pub fn undivided(&self, reported: [Option<f64>; 2]) -> ([(u64, bool); 2], u64) {
        let s = lock(&self.account);
        let live = s.live.max(1);
        let parts = [0, 1].map(|k| match (s.holdings[k].shared, reported[k]) {
            (Some((rate, _)), Some(report)) if rate > report * DIVIDES => (live, false),
            (Some(_), _) => (1, true),
            (None, _) => (live, false),
        });
        (parts, live)
    }

    /// `replica` (this one too: the fleet's channel echoes it) published its share and demand.
    pub(super) fn peer_share(&self, replica: &str, rate: f64, demand: f64) {
        if self.shared_requests() {
            return;
        }
        let me = &self.fleet.replica;
        let part = lock(&self.shares).heard(replica, rate, demand, me, Instant::now());
        if let Some(part) = part {
            (self.peers.share)(part);
        }
    }

    /// Set the count of live replicas as a lease's answer would.
    #[cfg(test)]
    pub(super) fn set_live(&self, live: u64) {
        let mut s = lock(&self.account);
        s.live = live;
        s.counted = true;
    }

    /// `replica`'s first send after its pause ended was refused with a named wait (this
    /// replica's own, or a peer's as told): when every live replica's was, within
    /// [`FIRSTS_SPREAD`] of this replica's, no bucket refilled over the wait the upstream named
    /// (one of them would have been admitted), and the partition is told that its refusals
    /// are an admission control's. Pauses named are a second or more apart, so the firsts of
    /// one pause are not counted with the next's. Not before Redis has counted the replicas,
    /// nor while the fleet has fallen back.
    pub(super) fn first_refused(&self, replica: &str) {
        let now = Instant::now();
        let mut firsts = lock(&self.firsts);
        firsts.retain(|(r, at)| r != replica && now.saturating_duration_since(*at) < FIRSTS_KEPT);
        firsts.push((replica.to_owned(), now));
        let me = &self.fleet.replica;
        let Some(mine) = firsts.iter().find(|(r, _)| r == me).map(|f| f.1) else {
            return;
        };
        let near = |at: Instant| at.max(mine) - at.min(mine) < FIRSTS_SPREAD;
        let peers = firsts.iter().filter(|(r, at)| r != me && near(*at)).count();
        drop(firsts);
        let (live, counted) = {
            let s = lock(&self.account);
            (s.live, s.counted)
        };
        let fallen = self.fleet.mode() == FleetMode::Fallback;
        if counted && !fallen && peers as u64 + 1 >= live {
            (self.peers.admission)();
        }
    }

    /// A peer was refused at the edge of the `refused` buckets (1 requests, 2 tokens).
    pub(super) fn peer_edge(&self, refused: u8) {
        if self.shared_requests() {
            return;
        }
        if let Some(share) = (self.peers.edge)(refused & 1 != 0, refused & 2 != 0) {
            self.estimated(share);
        }
    }

    /// Call Redis now (another replica created the shared bucket).
    pub(super) fn refresh(&self) {
        lock(&self.account).urgent = true;
        self.wake.notify_one();
    }

    /// Whether requests must go through [`acquire`](Self::acquire) (a shared bucket gates, or
    /// the fleet is not answering).
    pub fn gates(&self) -> bool {
        self.fleet.mode() != FleetMode::Shared
            || lock(&self.account)
                .holdings
                .iter()
                .any(|p| p.shared.is_some())
    }

    /// A request arrived at the partition (its demand).
    pub fn arrived(&self) {
        lock(&self.account).arrivals.record(Instant::now());
        if self.queued.load(Ordering::Acquire) == 1 && !self.shared_requests() {
            // Requests wait again (perhaps after an idle demand was published): check it.
            self.wake.notify_one();
        }
    }

    /// Whether the shared tokens bucket gates (so requests need a token estimate).
    pub fn charges_tokens(&self) -> bool {
        lock(&self.account).holdings[TOKENS].shared.is_some()
    }

    /// A request that took `charged` tokens from the shared bucket was counted `actual` by the
    /// upstream: the difference is this replica's again (or owed), to spend or give back. Left
    /// charged, each request's `max_tokens` stayed spent in Redis, and four corrals on a key
    /// whose tokens bind paced at what the estimates would cost (`openai-tokens`: 35 s for a
    /// bound of 25.7 s settled, 37.4 s unsettled; one corral 26.5 s).
    pub fn settle_tokens(&self, charged: f64, actual: f64) {
        lock(&self.account).settle(TOKENS, charged - actual);
    }

    /// Take one request and `cost` tokens, waiting while the deadline allows: the tokens taken
    /// from the shared bucket (none from a fallback's local share), to settle from usage
    /// ([`Lease::settle_tokens`]); `Err`: the wait it would need.
    pub async fn acquire(self: &Arc<Self>, cost: f64, deadline: Instant) -> Result<f64, Duration> {
        self.start();
        loop {
            let granted = self.granted.notified();
            tokio::pin!(granted);
            granted.as_mut().enable();
            let now = Instant::now();
            let admission = {
                let mut s = lock(&self.account);
                s.waiting = self.queued.load(Ordering::Acquire);
                if self.fleet.mode() == FleetMode::Fallback {
                    // Demand: the refill task probes Redis while requests come.
                    s.last_take = Some(now);
                    if self.fleet.may_call(now).is_ok() {
                        self.wake.notify_one();
                    }
                    Admission::Fallback(s.share())
                } else {
                    s.try_take(cost, now)
                }
            };
            match admission {
                Admission::Taken { share, low, tokens } => {
                    if low {
                        self.wake.notify_one();
                    }
                    let Some(share) = share else {
                        return Ok(tokens);
                    };
                    return share.take(cost, deadline).await.map(|()| tokens);
                }
                Admission::Fallback(share) => {
                    return share.take(cost, deadline).await.map(|()| 0.0)
                }
                Admission::Wait { until: at, refill } => {
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

    /// What the pacers learned of bucket `kind` (0 requests, 1 tokens), and the units this
    /// replica sent that the level's report has not seen: shared with the next call, at once
    /// if it is the first.
    pub fn learned(&self, kind: usize, model: Option<(f64, f64, Option<f64>)>, unseen: f64) {
        let Some(model) = model else { return };
        let mut s = lock(&self.account);
        let holding = &mut s.holdings[kind];
        holding.learned = Some(model);
        holding.unseen = unseen;
        // The first thing learned goes at once (the fleet may still be pacing blind); later
        // changes ride with the next lease.
        if holding.published.is_none() && self.config[kind].is_none() {
            s.urgent = true;
            drop(s);
            self.wake.notify_one();
        }
    }

    /// A 429: share its pause (`None`: the upstream named none, and corral's own guess stays
    /// its own), which buckets refused, and whether they refused at their edge (`edge`: the
    /// bucket was empty; the peers end a throttle window there; `first`: the partition's first
    /// send after its pause ended), with the fleet now.
    pub fn throttled(
        &self,
        pause: Option<Duration>,
        requests: bool,
        tokens: bool,
        edge: bool,
        first: bool,
    ) {
        let mut s = lock(&self.account);
        let now = Instant::now();
        if let Some(pause) = pause {
            let until = now + pause;
            s.pause_until = Some(s.pause_until.map_or(until, |u| u.max(until)));
        }
        if edge {
            s.edge_at = Some(now);
            s.first |= first;
        }
        s.refused |= u8::from(requests) | (u8::from(tokens) << 1);
        s.urgent = true;
        drop(s);
        self.wake.notify_one();
        if edge && first {
            self.first_refused(&self.fleet.replica);
        }
    }

    /// The fleet moved between shared and fallback.
    pub(super) fn mode_changed(&self) {
        let mut s = lock(&self.account);
        match self.fleet.mode() {
            FleetMode::Fallback => s.fall_back(Instant::now()),
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
            let mut s = lock(&self.account);
            s.give_back_all();
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
        let s = lock(&self.account);
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
    fn args(&self, s: &mut Account, leaving: bool, now: Instant) -> CallArgs {
        let fallen = self.fleet.mode() == FleetMode::Fallback;
        s.call_args(&self.keys, self.config, leaving, fallen, now)
    }

    /// When the refill task should call next (now or earlier: at once).
    fn next_call(&self, now: Instant) -> Instant {
        let mut s = lock(&self.account);
        s.waiting = self.queued.load(Ordering::Acquire);
        let probe = match self.fleet.may_call(now) {
            Ok(()) => now,
            Err(at) => at,
        };
        let fallen = self.fleet.mode() == FleetMode::Fallback;
        s.next_call(now, probe, self.fleet.heartbeat_ttl, fallen)
    }

    /// One call: ask, give back, share; apply the answer.
    async fn call_once(&self) {
        let sent;
        let (args, idle) = {
            let mut s = lock(&self.account);
            sent = Instant::now();
            let idle = s.idle_holding(sent);
            if idle {
                s.give_back_all();
            }
            s.urgent = false;
            s.last_call = Some(sent);
            (self.args(&mut s, false, sent), idle)
        };
        let result = self.fleet.call(&args).await;
        let now = Instant::now();
        let mut s = lock(&self.account);
        let reply = match result {
            Ok(reply) => reply,
            Err(e) => {
                let refused = matches!(e, CallError::Refused(_));
                s.undelivered(&args, refused, sent, idle);
                return;
            }
        };
        let leased = s.apply(&args, &reply, now);
        for (k, units) in leased.into_iter().enumerate() {
            if units > 0.0 {
                self.fleet
                    .metrics
                    .leased
                    .with_label_values(&[KINDS[k]])
                    .inc_by(units as u64);
            }
        }
        self.fleet.metrics.live_replicas.set(reply.live as i64);
        drop(s);
        if reply.pause_ms > 0 {
            (self.peers.pause)(pause_end(now, reply.pause_ms));
        }
        self.granted.notify_waiters();
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
        lease.check_pace(now);
        let at = lease.next_call(now);
        if at <= now {
            lease.call_once().await;
            continue;
        }
        let woken = lease.wake.notified();
        let check = lease.pace_due(now).map_or(at, |due| due.min(at));
        tokio::select! {
            () = woken => {}
            () = tokio::time::sleep_until(check) => {}
        }
    }
}
