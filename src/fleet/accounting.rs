//! What one partition's lease holds, owes and may spend, kept locally: no I/O, and every
//! change at a `now` it is given, so all of it is tested in virtual time.
//!
//! Requests take units from what this replica holds of each shared bucket ([`Holding`]): the
//! grants Redis made it ([`Grant`]). A grant may run ahead of the shared level: its units then
//! become usable as the shared bucket refills (unit `k` of a grant made at level `L` with rate
//! `r` after `(k - L) / r` seconds), so replicas' blocks queue in Redis in the order they were
//! asked for, and no unit is used before the shared bucket has it.
//!
//! A block is ten requests' worth at least (one round trip per ten requests), one second of this
//! replica's recent rate or the requests waiting if more, and at most half the burst or two
//! seconds of the shared rate. What is not used within three mean gaps between requests (a
//! quarter second to [`IDLE_RETURN`]) of the last request, and everything on shutdown, goes
//! back.
//!
//! Fallen back (Redis slow or down), requests pass local buckets of this replica's share of the
//! last known limit instead ([`Share`]): rate and burst over the live replicas, at least one per
//! minute and one at once.
//!
//! The lease task (`lease`) owns an [`Account`] behind a lock: it asks it when to call and with
//! what ([`Account::next_call`], [`Account::call_args`]) and hands it the answer
//! ([`Account::apply`]); the script's wire format is `script`'s.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use self::arrivals::Arrivals;
use super::script::{CallArgs, KindArgs, Reply};
use crate::bucket::{take_all, Bucket};

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
/// A refusal at a bucket's edge is published to the peers only this soon after it was seen:
/// they take the moment they hear of it as the end of a throttle window.
const EDGE_NEWS: Duration = Duration::from_millis(100);

/// Which bucket.
pub(super) const REQUESTS: usize = 0;
pub(super) const TOKENS: usize = 1;
pub(super) const KINDS: [&str; 2] = ["requests", "tokens"];

/// Units of one grant, usable as the shared bucket refills.
#[derive(Debug, Clone, Copy)]
struct Grant {
    /// When the grant arrived.
    origin: Instant,
    /// The shared level when it was made (units usable at once, if positive).
    offset: f64,
    rate: f64,
    total: f64,
    released: f64,
}

impl Grant {
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
pub(super) struct Holding {
    /// The shared bucket's rate and burst (configured, or as Redis last said); `None`: it does
    /// not gate (nothing known yet).
    pub(super) shared: Option<(f64, f64)>,
    /// Usable now (negative: a large request took more than was usable; at most one burst).
    available: f64,
    grants: VecDeque<Grant>,
    /// Units to give back with the next call.
    give_back: f64,
    /// The shared bucket's epoch, as Redis last said (a new one after Redis lost it).
    epoch: Option<String>,
    /// What the pacers learned, to share; and what was last shared.
    pub(super) learned: Option<(f64, f64, Option<f64>)>,
    pub(super) published: Option<(f64, f64)>,
    /// Units this replica sent after the attempt whose report `learned`'s level is.
    pub(super) unseen: f64,
}

impl Holding {
    fn release(&mut self, now: Instant) {
        for d in &mut self.grants {
            self.available += d.release(now);
        }
        self.grants.retain(|d| d.left() > 1e-9);
    }

    pub(super) fn held(&self) -> f64 {
        self.available.max(0.0) + self.grants.iter().map(Grant::left).sum::<f64>()
    }

    /// When `need` units will be usable from what is held, if they will.
    fn ready_at(&self, need: f64) -> Option<Instant> {
        let mut short = need - self.available;
        for d in &self.grants {
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
            self.grants.clear();
        }
        self.epoch = Some(epoch.to_owned());
    }

    /// At most `part` usable now; grants still to fall due keep their turn.
    fn shrink(&mut self, part: f64, now: Instant) {
        self.release(now);
        self.available = self.available.min(part);
    }

    /// Everything held, emptied.
    fn drain(&mut self) -> f64 {
        // A debt (a request larger than the burst took more than was usable) is paid first.
        let held = (self.available + self.grants.iter().map(Grant::left).sum::<f64>()).max(0.0);
        self.available = 0.0;
        self.grants.clear();
        held
    }
}

/// Smoothed requests per second taken.
#[derive(Debug)]
pub(super) struct Demand {
    since: Instant,
    count: f64,
    rate: f64,
}

impl Demand {
    pub(super) fn record(&mut self, now: Instant) {
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
pub(super) struct Share {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Share {
    /// One request and `cost` tokens, both checked before either is taken.
    pub(super) async fn take(&self, cost: f64, deadline: Instant) -> Result<(), Duration> {
        let stages: Vec<(&Bucket, u32)> = [(&self.requests, 1), (&self.tokens, cost.ceil() as u32)]
            .into_iter()
            .filter_map(|(bucket, n)| bucket.as_ref().map(|b| (b, n)))
            .collect();
        take_all(&stages, deadline).await
    }
}

/// One partition's account: what it holds of each bucket, what its requests want, and what
/// the next call is to share.
pub(super) struct Account {
    pub(super) holdings: [Holding; 2],
    demand: Demand,
    /// Requests arriving at the partition (attempts) over the last second.
    pub(super) arrivals: Arrivals,
    pub(super) last_take: Option<Instant>,
    /// Requests waiting on the partition.
    pub(super) waiting: usize,
    /// Mean token cost of a request.
    avg_cost: f64,
    pub(super) last_call: Option<Instant>,
    /// A call is wanted now (a 429 to share, a limit newly learned).
    pub(super) urgent: bool,
    /// The end of this replica's latest 429 pause, to share (what is left of it when the call
    /// goes, not its length: a call that waits for Redis must not lengthen it).
    pub(super) pause_until: Option<Instant>,
    pub(super) refused: u8,
    /// When this replica's latest refusal at a bucket's edge was seen, to publish to the peers
    /// while it is news ([`EDGE_NEWS`]).
    pub(super) edge_at: Option<Instant>,
    /// The latest edge was the partition's first send after its pause ended, refused (see
    /// `Partition::admission_control`): published with it.
    pub(super) first: bool,
    /// This replica's estimate of its share of the key's request rate and its demand, to
    /// publish with the next call.
    pub(super) estimate: Option<(f64, f64)>,
    /// This replica's pace (capped by the 429s) and demand, moved since the last published, to
    /// publish.
    pub(super) pace_news: Option<(f64, f64)>,
    pub(super) live: u64,
    /// Redis has counted the live replicas (`live` is its answer, not the starting guess).
    pub(super) counted: bool,
    pub(super) share: Option<Arc<Share>>,
    /// After a call granted less than it asked (the shared bucket queued far ahead), no
    /// refill call before this.
    not_before: Option<Instant>,
    /// Units held when the fleet fell back: the local share starts with them.
    carried: [f64; 2],
    /// Back from a fallback: also keep to the local share until then, or until this many
    /// replicas are live again.
    pub(super) rejoin: Option<(Instant, u64)>,
    /// Units the waiting request needs beyond all that is held (a request larger than a
    /// block): the next call asks for at least this much.
    shortfall: [f64; 2],
    /// Fell back since the last answer: a bucket Redis no longer has starts empty.
    resync: bool,
}

/// Whether a request may go, and if not, how long it waits.
pub(super) enum Admission {
    /// Taken from the lease.
    Taken {
        /// Also take from this share (rejoining after a fallback).
        share: Option<Arc<Share>>,
        /// The lease runs low: wake the refill task.
        low: bool,
        /// Tokens taken from the shared bucket's holding (to settle from usage).
        tokens: f64,
    },
    /// The fleet has fallen back: take from this share instead.
    Fallback(Arc<Share>),
    /// Not yet.
    Wait {
        /// Until then (`None`: for a grant).
        until: Option<Instant>,
        /// Ask for a refill.
        refill: bool,
    },
}

impl Account {
    /// Nothing held yet, for buckets of these configured rates and bursts.
    pub(super) fn new(config: [Option<(f64, f64)>; 2], now: Instant) -> Self {
        let holding = |c: Option<(f64, f64)>| Holding {
            shared: c,
            ..Holding::default()
        };
        Self {
            holdings: config.map(holding),
            demand: Demand {
                since: now,
                count: 0.0,
                rate: 0.0,
            },
            arrivals: Arrivals::new(now),
            last_take: None,
            waiting: 0,
            avg_cost: 1.0,
            last_call: None,
            urgent: true,
            pause_until: None,
            refused: 0,
            edge_at: None,
            first: false,
            estimate: None,
            pace_news: None,
            live: 1,
            counted: false,
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
    pub(super) fn idle_holding(&self, now: Instant) -> bool {
        self.waiting == 0
            && self
                .last_take
                .is_some_and(|at| now.saturating_duration_since(at) >= self.idle_after())
            && self.holdings.iter().any(|p| p.held() > 0.0)
    }

    /// `units` of bucket `kind` taken for a request were more than it cost (negative: less):
    /// usable again, within one burst either way.
    pub(super) fn settle(&mut self, kind: usize, units: f64) {
        let holding = &mut self.holdings[kind];
        if let Some((_, burst)) = holding.shared {
            holding.available = (holding.available + units).clamp(-burst, burst);
        }
    }

    pub(super) fn try_take(&mut self, cost: f64, now: Instant) -> Admission {
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
            let mut tokens = 0.0;
            for (k, units) in [(REQUESTS, 1.0), (TOKENS, cost)] {
                if let (Some(_), Some((_, burst))) = (needs[k], self.holdings[k].shared) {
                    let holding = &mut self.holdings[k];
                    let before = holding.available;
                    holding.available = (before - units).max(-burst);
                    if k == TOKENS {
                        tokens = before - holding.available;
                    }
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
            return Admission::Taken {
                share: rejoining.then(|| self.share()),
                low,
                tokens,
            };
        }
        let mut at = Some(now);
        for &k in &short {
            let need = needs[k].unwrap_or(0.0);
            let ready = self.holdings[k].ready_at(need);
            if ready.is_none() {
                let held = self.holdings[k].available
                    + self.holdings[k].grants.iter().map(Grant::left).sum::<f64>();
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
        Admission::Wait { until: at, refill }
    }

    /// This replica's share of the last known limit, built once per fallback.
    pub(super) fn share(&mut self) -> Arc<Share> {
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

    /// Everything held, to give back with the next call.
    pub(super) fn give_back_all(&mut self) {
        for holding in &mut self.holdings {
            holding.give_back += holding.drain();
        }
    }

    /// The fleet fell back at `now`.
    pub(super) fn fall_back(&mut self, now: Instant) {
        // What was usable was paid for (Redis counted it as taken): the local share starts
        // with it instead, never given back too (that would count it twice).
        for k in 0..2 {
            let holding = &mut self.holdings[k];
            holding.release(now);
            let usable = holding.available.max(0.0);
            let ahead = holding.drain() - usable;
            // Units not yet due go back to Redis when it answers again.
            holding.give_back += ahead.max(0.0);
            self.carried[k] = usable;
        }
        self.share = None;
        self.resync = true;
        self.rejoin = None;
    }

    /// The next call's arguments, taking what is to be shared and given back: `keys` are the
    /// partition's, `config` its configured rate and burst per bucket; `fallen`: the fleet
    /// has fallen back.
    pub(super) fn call_args(
        &mut self,
        keys: &[String; 4],
        config: [Option<(f64, f64)>; 2],
        leaving: bool,
        fallen: bool,
        now: Instant,
    ) -> CallArgs {
        let kind = |s: &mut Self, k: usize| {
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
                config: config[k],
                learned: holding.learned,
                unseen: holding.unseen,
            }
        };
        let kinds = [kind(self, REQUESTS), kind(self, TOKENS)];
        let pause_ms = self
            .pause_until
            .take()
            .map_or(0, |u| u.saturating_duration_since(now).as_millis() as u64);
        // A refusal whose pause has passed, or an edge seen a while ago, is old news.
        let refused = std::mem::take(&mut self.refused);
        let edge = self
            .edge_at
            .take()
            .is_some_and(|at| now.saturating_duration_since(at) < EDGE_NEWS);
        let first = std::mem::take(&mut self.first) && edge;
        CallArgs {
            keys: keys.clone(),
            resync: self.resync,
            leaving,
            pause_ms,
            refused: if pause_ms > 0 || edge { refused } else { 0 },
            edge,
            first,
            estimate: self.estimate.take(),
            pace: self.pace_news.take(),
            kinds,
        }
    }

    /// When the lease task should call next (now or earlier: at once). `probe`: when the fleet
    /// may call Redis (now, unless fallen back and the next probe is not due); `fallen`: the
    /// fleet has fallen back.
    pub(super) fn next_call(
        &self,
        now: Instant,
        probe: Instant,
        heartbeat_ttl: Duration,
        fallen: bool,
    ) -> Instant {
        let heartbeat = heartbeat_ttl / 3;
        // Never a busy loop: calls at least MIN_SPACING apart.
        let spaced = self.last_call.map_or(now, |at| at + MIN_SPACING).max(probe);
        if self.urgent || self.last_call.is_none() || self.idle_holding(now) {
            return spaced;
        }
        if (0..2).any(|k| self.wants_more(k, now)) {
            // None while the shared bucket is queued beyond what it would grant.
            return spaced.max(self.not_before.unwrap_or(now));
        }
        // Heartbeats and probes only while requests draw on a shared bucket: the live count is
        // the replicas that use it, and idle partitions (thousands, with `api_key`) cost Redis
        // nothing. A request wakes the task again when its lease runs low.
        let active = self.waiting > 0
            || self
                .last_take
                .is_some_and(|at| now.saturating_duration_since(at) < heartbeat_ttl);
        let gated = self.holdings.iter().any(|p| p.shared.is_some());
        let beat = (active && gated).then(|| self.last_call.map_or(now, |at| at + heartbeat));
        let idle = self
            .last_take
            .filter(|_| self.waiting == 0 && self.holdings.iter().any(|p| p.held() > 0.0))
            .map(|at| at + self.idle_after());
        let fallback = (fallen && active).then_some(probe);
        [beat, idle, fallback]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + Duration::from_secs(3600))
            .max(spaced)
    }

    /// The call made at `sent` with `args` brought no answer: what it was to share goes with
    /// the next call. Units to give back only if the connection was `refused`: a call that
    /// timed out or broke may still have run (a paused or stopped Redis runs it later), and
    /// losing them is the safe way to be wrong. `idle`: the call gave back an idle lease.
    pub(super) fn undelivered(
        &mut self,
        args: &CallArgs,
        refused: bool,
        sent: Instant,
        idle: bool,
    ) {
        if refused {
            for (holding, kind) in self.holdings.iter_mut().zip(&args.kinds) {
                holding.give_back += kind.give_back;
            }
        }
        if args.pause_ms > 0 {
            let until = sent + Duration::from_millis(args.pause_ms);
            self.pause_until = Some(self.pause_until.map_or(until, |u| u.max(until)));
            self.refused |= args.refused;
            self.urgent = true;
        }
        if args.edge {
            // Its age still counts from `sent`: a late edge is no window's end.
            self.edge_at = Some(self.edge_at.map_or(sent, |at| at.max(sent)));
            self.first |= args.first;
            self.refused |= args.refused;
            self.urgent = true;
        }
        if idle {
            self.urgent = true;
        }
    }

    /// The script's `reply`, at `now`, to the call made with `args`: per bucket, the units
    /// granted (0: none).
    pub(super) fn apply(&mut self, args: &CallArgs, reply: &Reply, now: Instant) -> [f64; 2] {
        let mut leased = [0.0; 2];
        let mut not_before: Option<Instant> = None;
        for (k, holding) in self.holdings.iter_mut().enumerate() {
            let (grant, before, rate, burst) = reply.kinds[k];
            holding.rebase(&reply.epochs[k], now);
            // The shared burst shrank (a report in another unit than the bucket, found out by a
            // 429): units usable now were granted from a bucket that was never there, so this
            // replica keeps at most its part of what the shared bucket has.
            if rate > 0.0 && holding.shared.is_some_and(|(_, old)| burst < old) {
                holding.shrink(before.clamp(0.0, burst) / reply.live.max(1) as f64, now);
            }
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
                holding.grants.push_back(Grant {
                    origin: now,
                    offset: before,
                    rate,
                    total: grant,
                    released: 0.0,
                });
                leased[k] = grant;
            }
        }
        self.not_before = not_before;
        self.resync = false;
        self.live = reply.live;
        self.counted = true;
        leased
    }
}

mod arrivals;
#[cfg(test)]
mod tests;
