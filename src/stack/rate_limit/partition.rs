//! One partition of an upstream's rate limit (the whole upstream, or one API key of it): its
//! configured ceilings, its learned pacers, and the pause that a 429 puts on all of it.
//!
//! A request's way through [`Partition::acquire`]:
//! 1. `fast_path`: nobody waiting, no pause, no configured bucket, and the
//!    pacers admit it now: no turn to take, no timer.
//! 2. Otherwise it waits out any pause (each waiter at its own jittered instant when nothing
//!    else will pace them), then `take_turn`: a fair tokio mutex, so
//!    waiters go in FIFO order and a large request is not starved by small ones.
//! 3. `wait`: with the turn held, the configured buckets and the pacers,
//!    re-checking the pause (a 429 may arrive meanwhile), while the deadline allows.
//!
//! What may refuse a request, and what may only delay it:
//! - The user's word (configured `rpm`/`tpm`, the fleet's shared buckets) and the upstream's
//!   (a pause for a wait it named, or the reset of a bucket it reported empty) refuse a request
//!   whose deadline cannot cover the wait, with a 429 and that wait as `Retry-After`.
//! - What corral guessed (the learned pace, the FIFO turn behind it, a pause it chose itself
//!   when a 429 named no wait) only delays: at most half of the time the request has left
//!   ([`pace_by`]), then it goes, since only the upstream's answer can say it must not. A
//!   guess never turns into a refusal.
//!
//! What it learns from each answer, and the pause a 429 puts on it, is in `answers`.

mod answers;
mod peers;

use std::future::Future;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::bucket::{ready_all, take_ready, Bucket};
use super::learn::{Pacer, Source, Ticket};
use crate::client::Handshakes;
use crate::config::{LearnMode, Priority, UpstreamConfig};
use crate::error::ProxyError;
use crate::fleet::{Fleet, Lease};
use crate::metrics::PacingGauges;
use crate::provider::Kind;
use crate::stack::priority::PriorityGate;
use crate::sync::lock;

/// The learned pacers of one partition, one per kind of limit.
#[derive(Debug)]
pub struct Pacers {
    pub requests: Pacer,
    pub tokens: Pacer,
    /// What the pacing gauges last showed of each pacer (requests, tokens): an answer that
    /// changed nothing of it sets none of them.
    pub(super) shown: [Option<Shown>; 2],
}

/// A pacer as the pacing gauges show it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Shown {
    pub(super) rate: f64,
    pub(super) burst: f64,
    pub(super) source: Source,
    pub(super) remaining: Option<f64>,
}

/// Proofs of admission from both pacers, handed back with the answer.
#[derive(Debug, Clone, Copy)]
pub struct Tickets {
    requests: Ticket,
    tokens: Ticket,
    /// Tokens taken from the fleet's shared bucket for it (0: none).
    leased: f64,
}

impl Tickets {
    /// Tokens the tokens pacer charged at admission.
    pub fn charged_tokens(&self) -> f64 {
        self.tokens.cost()
    }
}

/// "No sends before": an instant that each 429 may push later, never earlier. Lock-free: one
/// atomic read on the fast path.
#[derive(Debug)]
struct Pause {
    origin: Instant,
    /// Nanoseconds after `origin`; 0 = never paused.
    until: AtomicU64,
    /// When the pause in force was set, nanoseconds after `origin`.
    set_at: AtomicU64,
    /// The end of the last pause that was over when a later one was set (0: none).
    ended_at: AtomicU64,
    /// Woken when the pause is pushed later.
    later: Notify,
}

impl Pause {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            until: AtomicU64::new(0),
            set_at: AtomicU64::new(0),
            ended_at: AtomicU64::new(0),
            later: Notify::new(),
        }
    }

    fn extend(&self, until: Instant) {
        let nanos = self.nanos(until);
        let old = self.until.fetch_max(nanos, Ordering::AcqRel);
        if old < nanos {
            if old > 0 && old <= self.nanos(Instant::now()) {
                self.ended_at.fetch_max(old, Ordering::AcqRel);
            }
            self.later.notify_waiters();
        }
    }

    /// Until the pause is pushed beyond `deadline` (by this replica's 429 or, in a fleet, a
    /// peer's): how far beyond it then.
    async fn beyond(&self, deadline: Instant) -> Duration {
        loop {
            let later = self.later.notified();
            tokio::pin!(later);
            later.as_mut().enable();
            let now = Instant::now();
            if let Some(until) = self.until(now).filter(|until| *until > deadline) {
                return until - now;
            }
            later.await;
        }
    }

    /// Extend the pause for a 429 of an attempt sent at `sent_at`, unless the attempt left
    /// before the pause in force was set: its 429 is part of the event that set it (as TCP
    /// takes one loss per round trip), so refusals of one round, however many, pause once.
    fn extend_for(&self, until: Instant, sent_at: Instant, now: Instant) {
        let set = self.set_at.load(Ordering::Acquire);
        if self.until(now).is_some() && self.nanos(sent_at) < set {
            return;
        }
        self.set_at.fetch_max(self.nanos(now), Ordering::AcqRel);
        self.extend(until);
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The end of the last pause, when it has passed by `now`.
    fn ended(&self, now: Instant) -> Option<Instant> {
        let nanos = self.until.load(Ordering::Acquire);
        let until = self.origin + Duration::from_nanos(nanos);
        (nanos > 0 && until <= now).then_some(until)
    }

    /// The end of the last pause that was over by `sent`, if any (one set since may be in force
    /// now).
    fn ended_before(&self, sent: Instant) -> Option<Instant> {
        let sent = self.nanos(sent);
        [&self.until, &self.ended_at]
            .into_iter()
            .map(|a| a.load(Ordering::Acquire))
            .find(|&end| end > 0 && end <= sent)
            .map(|end| self.origin + Duration::from_nanos(end))
    }

    /// The end of the pause in force at `now`, if any.
    fn until(&self, now: Instant) -> Option<Instant> {
        let nanos = self.until.load(Ordering::Acquire);
        let until = self.origin + Duration::from_nanos(nanos);
        (nanos > 0 && until > now).then_some(until)
    }
}

/// The buckets of one partition.
pub struct Partition {
    /// Waiters on the slow path take turns through this fair mutex (FIFO).
    turn: tokio::sync::Mutex<()>,
    /// Interactive waiters ahead of queued batch ones (`stack::priority`).
    gate: PriorityGate,
    /// The configured requests-per-minute ceiling.
    requests: Option<Bucket>,
    /// The configured tokens-per-minute ceiling.
    tokens: Option<Bucket>,
    /// The learned pacers (`rate_limit = "auto"`); the fleet lease tells them of its peers'
    /// refusals.
    pacers: Option<Arc<Mutex<Pacers>>>,
    /// Notified on every answer: slow start waits for answers, not for time.
    answered: Notify,
    /// Requests on the slow path (waiting for their turn or for capacity); shared with the
    /// fleet lease, which sizes its blocks from it.
    queued: Arc<AtomicUsize>,
    /// Whether the tokens pacer has learned anything (else token estimates are not needed).
    tokens_learned: AtomicBool,
    /// Set by 429s that name a wait (this corral's, and with `[fleet]` its peers'): nothing is
    /// sent to this partition before it passes, and a deadline it cannot cover is refused.
    pause: Arc<Pause>,
    /// Set by 429s that name none: a wait corral chose, so it only delays (see the module doc).
    guessed_pause: Pause,
    /// Until when hinted 429s are read as an admission control's, each the refused request's
    /// own wait (see `Partition::admission_control`).
    admission: Arc<Pause>,
    /// With `[fleet]`: the lease on the fleet's shared buckets (instead of the configured
    /// ceilings, which then live in Redis).
    lease: Option<Arc<Lease>>,
    /// The `model` label of its pacing metrics, and their gauges (taken on its first answer).
    metric_model: Box<str>,
    gauges: OnceLock<PacingGauges>,
    /// The upstream's connection times, which the pacers' silence waits from until a refusal
    /// shows how long this upstream takes to refuse ([`Partition::measured`]).
    handshakes: Option<Arc<Handshakes>>,
    /// With nothing else to pace waiters released by a pause, each waits up to this much more.
    release_jitter: Duration,
    /// The pause after a 429 with no hint and no learned pace.
    default_pause: Duration,
    rng: Mutex<SmallRng>,
}

/// How long one request may wait in a partition.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Beyond it, a wait the user or the upstream asked for is refused.
    deadline: Instant,
    /// Beyond it, a wait corral guessed ends: the request goes.
    pace_by: Instant,
}

/// Corral's guesses (the learned pace, a pause no hint named) hold a request at most half the
/// time it has left: the other half is for the upstream to answer it.
fn pace_by(now: Instant, deadline: Instant) -> Instant {
    now + deadline.saturating_duration_since(now) / 2
}

/// What a waiting request costs in tokens, asked again each time it may go: a request that
/// arrived before any token limit was known was estimated at nothing, and a limit learned
/// while it waited (from the first answers' reports) must charge it when it leaves, or every
/// request of a herd queued at the start goes uncharged past a token bucket that binds.
pub type Price<'a> = &'a (dyn Fn() -> u32 + Sync);

/// Counts a request on the slow path for as long as it is there.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Partition {
    /// `fleet`: the fleet to lease from, and the partition's credential (`None`: the
    /// upstream's own).
    pub fn new(config: &UpstreamConfig, fleet: Option<(&Arc<Fleet>, Option<&[u8]>)>) -> Self {
        let l = &config.limits;
        let pause = Arc::new(Pause::new());
        let admission = Arc::new(Pause::new());
        let queued = Arc::new(AtomicUsize::new(0));
        let a = &config.adaptive;
        let now = Instant::now();
        // A configured burst is the user's word on the upstream's: slow start may spend it.
        let initial = l.burst.map_or(a.initial_burst, NonZeroU32::get);
        let pacers = (config.rate_limit == LearnMode::Auto).then(|| {
            Arc::new(Mutex::new(Pacers {
                requests: Pacer::new(Kind::Requests, initial, a.rate_margin, now),
                tokens: Pacer::new(Kind::Tokens, a.initial_burst, a.rate_margin, now),
                shown: [None; 2],
            }))
        });
        let lease = fleet.map(|(fleet, credential)| {
            let peers = peers::peers(pacers.as_ref(), &pause, &admission);
            fleet.lease(config, credential, peers, Arc::clone(&queued))
        });
        if let (Some(pacers), Some(_)) = (&pacers, &lease) {
            lock(pacers).requests.in_fleet();
        }
        let l_local = lease.is_none().then_some(l);
        let requests = l_local.and_then(|l| l.rpm).map(|rpm| {
            let burst = l
                .burst
                .unwrap_or_else(|| NonZeroU32::new((rpm.get() / 60).max(1)).expect("non-zero"));
            Bucket::per_minute(rpm, burst)
        });
        let tokens = l_local.and_then(|l| l.tpm).map(|tpm| {
            let burst = l
                .token_burst
                .unwrap_or_else(|| NonZeroU32::new((tpm.get() / 6).max(1)).expect("non-zero"));
            Bucket::per_minute(tpm, burst)
        });
        Self {
            turn: tokio::sync::Mutex::new(()),
            gate: PriorityGate::default(),
            requests,
            tokens,
            pacers,
            answered: Notify::new(),
            queued,
            tokens_learned: AtomicBool::new(false),
            pause,
            lease,
            guessed_pause: Pause::new(),
            admission,
            release_jitter: config.retry.floor_jitter.0,
            default_pause: config.retry.base.0,
            rng: Mutex::new(SmallRng::from_os_rng()),
            metric_model: crate::metrics::NO_MODEL.into(),
            gauges: OnceLock::new(),
            handshakes: None,
        }
    }

    /// This partition's pacers learn the network's round trip from the upstream's connection
    /// times in `handshakes` (the upstream's client records them).
    pub fn measured(mut self, handshakes: &Arc<Handshakes>) -> Self {
        self.handshakes = Some(Arc::clone(handshakes));
        self
    }

    /// The pacers, locked, told the upstream's latest handshake time first.
    pub(super) fn lock_pacers<'a>(&self, pacers: &'a Mutex<Pacers>) -> MutexGuard<'a, Pacers> {
        let mut p = lock(pacers);
        if let Some(secs) = self.handshakes.as_ref().and_then(|h| h.get()) {
            p.requests.handshake(secs);
            p.tokens.handshake(secs);
        }
        p
    }

    /// This partition's `model` label on the pacing metrics (see [`crate::metrics::model_label`]).
    pub fn labelled(mut self, model: &str) -> Self {
        self.metric_model = model.into();
        self
    }

    /// Requests waiting for their turn or for capacity.
    pub fn waiting(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    /// Whether a 429's pause is in force at `now`.
    pub fn is_paused(&self, now: Instant) -> bool {
        self.pause.until(now).is_some() || self.guessed_pause.until(now).is_some()
    }

    /// Take on the pauses `old` has in force (a reload rebuilt this partition's upstream).
    pub fn carry_pause(&self, old: &Partition) {
        let now = Instant::now();
        if let Some(until) = old.pause.until(now) {
            self.pause.extend(until);
        }
        if let Some(until) = old.guessed_pause.until(now) {
            self.guessed_pause.extend(until);
        }
    }

    /// Whether requests must be charged a token estimate.
    pub fn charges_tokens(&self) -> bool {
        self.tokens.is_some()
            || self.tokens_learned.load(Ordering::Relaxed)
            || self.lease.as_ref().is_some_and(|l| l.charges_tokens())
    }

    /// Wait for this request's turn and capacity: the fast path, else the slow one, as
    /// `RateLimitShared::through` takes them (it keeps the fast path's clock reading as the
    /// send time). Returns the pacers' tickets.
    pub async fn acquire(
        &self,
        cost: u32,
        deadline: Instant,
        priority: Priority,
        upstream: &str,
    ) -> Result<Option<Tickets>, ProxyError> {
        match self.fast_path(cost, Instant::now()) {
            Some(tickets) => Ok(tickets),
            None => {
                self.wait_for(&move || cost, deadline, priority, upstream)
                    .await
            }
        }
    }

    /// The slow path, for a request [`Self::fast_path`] did not admit; boxed, so the future
    /// of every attempt through the stack stays small. `price`: its cost in tokens, asked
    /// again each time it may go ([`Price`]).
    pub fn wait_for<'a>(
        &'a self,
        price: Price<'a>,
        deadline: Instant,
        priority: Priority,
        upstream: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Option<Tickets>, ProxyError>> + Send + 'a>> {
        Box::pin(self.slow_path(price, deadline, priority, upstream))
    }

    /// Wait for a turn and for capacity: the way of a request `fast_path` did not admit.
    async fn slow_path(
        &self,
        price: Price<'_>,
        deadline: Instant,
        priority: Priority,
        upstream: &str,
    ) -> Result<Option<Tickets>, ProxyError> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        let _queued = Queued(&self.queued);
        if let Some(lease) = &self.lease {
            lease.arrived();
        }
        let limited = |retry_after: Duration| ProxyError::RateLimited {
            upstream: upstream.to_owned(),
            retry_after,
        };
        let unpaced = self.pacers.is_none()
            && self.requests.is_none()
            && self.tokens.is_none()
            && self.lease.is_none();
        let limits = Limits {
            deadline,
            pace_by: pace_by(Instant::now(), deadline),
        };
        self.wait_pause(limits, unpaced).await.map_err(limited)?;
        let _turn = self.take_turn(limits, priority).await.map_err(limited)?;
        self.wait(price, limits).await.map_err(limited)
    }

    /// Whether only guesses gate this partition (no configured ceiling, no fleet bucket).
    fn only_guesses(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none() && self.lease.is_none()
    }

    /// Admit at once when nothing waits, nothing is paused and the pacers say go now; `None`:
    /// take the slow path.
    pub fn fast_path(&self, cost: u32, now: Instant) -> Option<Option<Tickets>> {
        if self.queued.load(Ordering::Acquire) > 0
            || self.requests.is_some()
            || self.tokens.is_some()
            || self.lease.as_ref().is_some_and(|l| l.gates())
        {
            return None;
        }
        if self.is_paused(now) {
            return None;
        }
        let Some(pacers) = &self.pacers else {
            return Some(None);
        };
        let mut p = self.lock_pacers(pacers);
        let units = f64::from(cost);
        if !(p.requests.can_acquire(1.0, now) && p.tokens.can_acquire(units, now)) {
            return None;
        }
        let requests = p.requests.acquire_ready(1.0, now).ok()?;
        let tokens = p.tokens.acquire_ready(units, now).ok()?;
        Some(Some(Tickets {
            requests,
            tokens,
            leased: 0.0,
        }))
    }

    /// Sleep until no pause is in force; `jitter`: each waiter then waits a little more, at
    /// random, since nothing else will spread them. `Err`: the wait a named pause would need
    /// beyond the deadline. A guessed pause is waited for only until `pace_by`.
    async fn wait_pause(&self, limits: Limits, jitter: bool) -> Result<(), Duration> {
        loop {
            let now = Instant::now();
            let named = self.pause.until(now);
            let guessed = self
                .guessed_pause
                .until(now)
                .filter(|_| now < limits.pace_by);
            let Some(until) = named.max(guessed) else {
                return Ok(());
            };
            let extra = if jitter && !self.release_jitter.is_zero() {
                let spread = lock(&self.rng).random_range(0.0..1.0);
                self.release_jitter.mul_f64(spread)
            } else {
                Duration::ZERO
            };
            if named.is_some_and(|n| n > limits.deadline) {
                return Err(until.saturating_duration_since(now));
            }
            let end = if named == Some(until) {
                limits.deadline
            } else {
                limits.pace_by
            };
            let wake = (until + extra).min(end);
            tokio::time::sleep_until(wake).await;
        }
    }

    /// This request's turn, in FIFO order; `None`: the pace it waits behind is a guess that
    /// has held it for as long as it may (`pace_by`), so it goes without.
    async fn take_turn(
        &self,
        limits: Limits,
        priority: Priority,
    ) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>, Duration> {
        let turn = self.gate.wait(priority, self.turn.lock());
        if self.only_guesses() {
            return Ok(tokio::time::timeout_at(limits.pace_by, turn).await.ok());
        }
        tokio::time::timeout_at(limits.deadline, turn)
            .await
            .map(Some)
            .map_err(|_| Duration::from_secs(1))
    }

    /// With the turn held: every stage (the configured ceilings, the fleet's lease, the
    /// pacers) is checked before any is taken, re-checking the pause (a 429 may arrive
    /// meanwhile), while the deadline allows; so a request refused here, or whose client leaves
    /// while it waits, has spent nothing. At `pace_by` the pacers admit it anyway (the pace is
    /// corral's guess: only the upstream may refuse).
    async fn wait(&self, price: Price<'_>, limits: Limits) -> Result<Option<Tickets>, Duration> {
        let deadline = limits.deadline;
        loop {
            let mut leased = 0.0;
            let cost = price();
            let units = f64::from(cost);
            let ceilings: Vec<(&Bucket, u32)> = [(&self.requests, 1), (&self.tokens, cost)]
                .into_iter()
                .filter_map(|(bucket, n)| bucket.as_ref().map(|b| (b, n)))
                .collect();
            ready_all(&ceilings, deadline).await?;
            self.wait_pause(limits, false).await?;
            let answered = self.answered.notified();
            let now = Instant::now();
            let wake = self
                .pacers
                .as_ref()
                .and_then(|p| pacers_wait(&mut self.lock_pacers(p), units, now, limits.pace_by));
            if let Some(wake) = wake {
                tokio::select! {
                    // Slow start waits for answers, not for time.
                    () = answered => {}
                    () = tokio::time::sleep_until(wake) => {}
                }
                continue;
            }
            if let Some(lease) = &self.lease {
                // Taken whole when it has the units (the fleet has no configured ceilings here);
                // a pause may have begun while it waited for them. One beyond the deadline (a
                // per-day quota's, here or a peer's) refuses the request at once: its wait for
                // the shared bucket held a fleet's queue past the quota's 429 (`daily-quota`,
                // four on Redis, limit set: the last refusals 0.3 s after the quota's, 1.28x).
                leased = tokio::select! {
                    taken = lease.acquire(units, deadline) => taken?,
                    beyond = self.pause.beyond(deadline) => return Err(beyond),
                };
                self.wait_pause(limits, false).await?;
            }
            take_ready(&ceilings);
            let now = Instant::now();
            return Ok(self.pacers.as_ref().map(|p| {
                let mut p = self.lock_pacers(p);
                let take = |pacer: &mut Pacer, units: f64| {
                    pacer
                        .try_acquire(units, now)
                        .unwrap_or_else(|_| pacer.admit_anyway(units, now))
                };
                let requests = take(&mut p.requests, 1.0);
                let tokens = take(&mut p.tokens, units);
                Tickets {
                    requests,
                    tokens,
                    leased,
                }
            }));
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
            let p = lock(p);
            [&p.requests, &p.tokens]
                .iter()
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
        let now = Instant::now();
        let paused_ms = (self.pause.until(now))
            .max(self.guessed_pause.until(now))
            .map(|u| u.saturating_duration_since(now).as_millis() as u64);
        serde_json::json!({
            "config_requests": ceiling(&self.requests),
            "config_tokens": ceiling(&self.tokens),
            "learned": learned,
            "paused_ms": paused_ms,
            "fleet": self.lease.as_ref().map(|l| l.status()),
        })
    }
}

/// Until when a request of `units` tokens must wait for both pacers at `now`; `None`: both
/// admit it now (or `pace_by` has come: they admit it anyway). Takes nothing.
fn pacers_wait(p: &mut Pacers, units: f64, now: Instant, pace_by: Instant) -> Option<Instant> {
    if now >= pace_by {
        return None;
    }
    let wait = |verdict: Result<_, Option<Duration>>| match verdict {
        Ok(_) => Duration::ZERO,
        Err(Some(wait)) => wait.max(Duration::from_micros(200)),
        // Slow start: wait for an answer to teach us more (or re-check soon).
        Err(None) => Duration::from_millis(250),
    };
    let needed = wait(p.requests.admits(1.0, now)).max(wait(p.tokens.admits(units, now)));
    (!needed.is_zero()).then(|| (now + needed).min(pace_by))
}

#[cfg(test)]
impl Partition {
    /// Poison every std mutex this holds (tests of [`crate::sync::lock`]).
    pub(crate) fn poison_locks(&self) {
        if let Some(p) = &self.pacers {
            crate::sync::poison(p);
        }
        crate::sync::poison(&self.rng);
    }
}

#[cfg(test)]
mod tests;
