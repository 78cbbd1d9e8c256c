//! Circuit breaker per upstream: a gate in front of every attempt (it sits inside Retry), fed the
//! classified outcome of each. It judges the upstream's **health**, not the caller's budget.
//!
//! **What counts.** Failures: 5xx (529 "overloaded" included), per-try timeouts, connection
//! errors and resets before a response head. These say the upstream itself is unwell, for every
//! caller alike. Successes: 1xx-3xx and 4xx other than 429 (the upstream answered; the request
//! was at fault). Neutral, not recorded at all: 429s, and corral's own refusals (the upstream
//! saw nothing). A 429 says *this caller* spent *its* quota (per API key, per organisation), and
//! pacing it is the rate limiter's job (layer 4 learns from every 429); a breaker that opened on
//! 429s would stop all traffic, other callers' included, when only one was over its limit, and
//! the held requests would then come back together. `count_throttles = true` counts 429s as
//! failures again, for an upstream whose 429s really mean overload.
//!
//! **When it opens, how long, how it closes:** see [`state`]. In short: only on an error rate
//! that lasts (`min_samples` outcomes spanning `min_span`, in 100 ms slots that weigh the same,
//! so a burst of failures at one instant is one event, and the same share of the outcomes),
//! for a growing, capped, jittered cool-down whose growth restarts after `healthy_reset` of
//! health, then `half_open_probes` probes, of which not all need succeed.
//!
//! **While open**, requests wait (up to their deadline) instead of failing, or with
//! `on_open = "reject"` get a 503 with Retry-After. **When it closes**, each waiting request
//! leaves at its own offset into the open period (scaled into `release_ramp`, plus up to 100 ms
//! of jitter), so retries that arrived spread leave spread instead of at the same instant; the
//! rate limiter below then paces them as usual.
//!
//! **Partitions.** The rate limiter keeps buckets per credential and model by default (see
//! `limits.partition`), but there is one breaker per upstream, and that is right for what it
//! counts: 5xx, overloads, timeouts and connection errors are the upstream's health, shared by
//! all partitions, and the
//! per-key signal (429) is not counted, so one tenant's throttling never holds another tenant's
//! traffic. `count_throttles = true` would break that, so configuration validation refuses it
//! together with any explicit `partition` but `"upstream"` (naming `breaker.count_throttles`),
//! and an unset `partition` is then the upstream's alone, rather than keep a
//! breaker per key: per-key breakers would split the shared health evidence (a low-traffic key
//! would need `min_samples` of its own to notice a dead upstream) and need a second, bounded
//! map of keys beside the rate limiter's, for a combination whose point (counting per-key
//! throttles as sickness) is better served by the per-key buckets themselves.

pub mod state;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use tokio::time::Instant;

use self::state::{Admit, Breaker, Phase, Probe, Ticket};
use crate::classify::Outcome;
use crate::config::{BreakerConfig, OnOpen};
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};
use crate::sync::lock;

/// What one outcome says about the upstream's health: `Some(true)` a failure, `Some(false)` a
/// success, `None` nothing (not recorded).
pub fn health(outcome: Outcome, count_throttles: bool) -> Option<bool> {
    match outcome {
        Outcome::Local => None,
        Outcome::Throttled(429) if !count_throttles => None,
        Outcome::Throttled(429) => Some(true),
        other => Some(other.is_upstream_failure()),
    }
}

/// One upstream's breaker, shared by all its requests.
pub struct BreakerShared {
    /// The state machine, and the jitter for its cool-downs and releases.
    state: Mutex<(Breaker, SmallRng)>,
    /// Whether the phase is closed, stored under the lock at every change. A new request then
    /// passes without taking the lock: a closed breaker holds only requests it held while
    /// open, and a new one was never held.
    closed: AtomicBool,
    /// Wakes waiting requests when the phase changes or a probe slot frees up.
    changed: Notify,
    /// Wait or reject while traffic is held.
    on_open: OnOpen,
    /// Whether 429s count as failures.
    count_throttles: bool,
    /// The breaker's gauge and transitions.
    metrics: UpstreamMetrics,
}

impl BreakerShared {
    pub fn new(config: &BreakerConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        metrics.breaker_state.set(0);
        Arc::new(Self {
            state: Mutex::new((Breaker::new(config.clone()), SmallRng::from_os_rng())),
            closed: AtomicBool::new(true),
            changed: Notify::new(),
            on_open: config.on_open,
            count_throttles: config.count_throttles,
            metrics,
        })
    }

    pub fn phase(&self) -> Phase {
        lock(&self.state).0.phase()
    }

    /// Take on `old`'s state under this breaker's settings (a reload rebuilt the upstream with
    /// a changed config): an open breaker stays open.
    pub fn carry_from(&self, old: &BreakerShared) {
        let carried = lock(&old.state).0.clone();
        let mut guard = lock(&self.state);
        guard.0.carry_from(&carried);
        self.mirror(&guard.0);
        self.metrics.breaker_state.set(guard.0.phase().gauge());
        drop(guard);
        self.changed.notify_waiters();
    }

    /// Whether it is open (holding all traffic); the state lock only when it is not closed.
    pub fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && matches!(self.phase(), Phase::Open { .. })
    }

    /// Keep [`Self::closed`] in step with `breaker` (called with the lock held).
    fn mirror(&self, breaker: &Breaker) {
        let closed = breaker.phase() == Phase::Closed;
        self.closed.store(closed, Ordering::Release);
    }

    fn transitioned(&self, phase: Phase) {
        self.metrics.breaker_state.set(phase.gauge());
        self.metrics.breaker_transition(phase.name());
        tracing::warn!(
            upstream = self.metrics.name(),
            state = phase.name(),
            "circuit breaker changed state"
        );
        self.changed.notify_waiters();
    }

    /// Wait until admitted (as a probe or not) or the deadline passes.
    async fn admit(&self, deadline: Instant) -> Result<Option<Probe>, ProxyError> {
        if self.closed.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut ticket: Option<Ticket> = None;
        loop {
            let notified = self.changed.notified();
            let (verdict, changed, phase) = {
                let mut guard = lock(&self.state);
                let (state, rng) = &mut *guard;
                let ticket = ticket.get_or_insert_with(|| Ticket::new(rng.random()));
                let (verdict, changed) = state.admit(Instant::now(), ticket);
                self.mirror(state);
                (verdict, changed, state.phase())
            };
            if changed {
                self.transitioned(phase);
            }
            let until = match verdict {
                Admit::Pass { probe } => return Ok(probe),
                Admit::Wait(until) => until,
            };
            // Told to come back when the cool-down ends, not at the next scout's turn (one
            // request in half a second goes as a scout; the rest would be refused again).
            let back = match phase {
                Phase::Open { until } => Some(until),
                _ => until,
            };
            let retry_after = back.map_or(Duration::from_secs(1), |u| {
                u.saturating_duration_since(Instant::now())
            });
            if self.on_open == OnOpen::Reject || Instant::now() >= deadline {
                return Err(ProxyError::CircuitOpen {
                    upstream: self.metrics.name().to_owned(),
                    retry_after,
                });
            }
            let wake = until.map_or(deadline, |u| u.min(deadline));
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    fn record(&self, outcome: Outcome, probe: Option<Probe>) {
        let Some(failed) = health(outcome, self.count_throttles) else {
            if let Some(probe) = probe {
                self.release_probe(probe);
            }
            return;
        };
        let mut guard = lock(&self.state);
        let (state, rng) = &mut *guard;
        let jitter = rng.random();
        let changed = state.record(failed, probe, Instant::now(), jitter);
        self.mirror(state);
        let phase = state.phase();
        drop(guard);
        if changed {
            self.transitioned(phase);
        } else if probe.is_some_and(Probe::is_scout) {
            // The next scout's turn is set: the held requests wait for it.
            self.changed.notify_waiters();
        }
    }

    /// A probe slot is free again: wake the waiters so one of them takes it.
    fn release_probe(&self, probe: Probe) {
        lock(&self.state).0.release_probe(probe);
        self.changed.notify_waiters();
    }
}

/// Gives a half-open probe's slot back if its request is dropped (client gone) unanswered.
struct ProbeSlot<'a> {
    shared: &'a BreakerShared,
    probe: Option<Probe>,
}

impl Drop for ProbeSlot<'_> {
    fn drop(&mut self) {
        if let Some(probe) = self.probe.take() {
            self.shared.release_probe(probe);
        }
    }
}

/// The breaker as a tower layer.
pub type BreakerLayer = SharedLayer<BreakerShared>;

impl Middleware for BreakerShared {
    fn call<'a, S: Next>(
        self: &'a Arc<Self>,
        next: &'a S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'a {
        let shared = self;
        async move {
            let probe = shared.admit(req.ctx().wait_deadline).await?;
            let mut slot = ProbeSlot { shared, probe };
            let result = next.send(req).await;
            slot.probe = None;
            shared.record(Outcome::of(&result), probe);
            result
        }
    }
}

#[cfg(test)]
impl BreakerShared {
    /// Poison every std mutex this holds (tests of [`crate::sync::lock`]).
    pub(crate) fn poison_locks(&self) {
        crate::sync::poison(&self.state);
    }
}

#[cfg(test)]
mod tests {
    use super::state::{SCOUT_EVERY, SLOT};
    use super::*;
    use crate::body::Body;
    use crate::config::HumanDuration;
    use http::Response;

    fn config(on_open: OnOpen) -> BreakerConfig {
        BreakerConfig {
            window: 10,
            min_samples: 5,
            min_span: HumanDuration::from_secs(1),
            cooldown: HumanDuration::from_secs(4),
            half_open_probes: 1,
            // Longer than the open periods here, so releases keep their offsets unscaled.
            release_ramp: HumanDuration::from_secs(10),
            on_open,
            ..BreakerConfig::default()
        }
    }

    fn shared_with(config: &BreakerConfig) -> Arc<BreakerShared> {
        BreakerShared::new(config, crate::metrics::Metrics::new().upstream("t"))
    }

    fn shared(on_open: OnOpen) -> Arc<BreakerShared> {
        shared_with(&config(on_open))
    }

    /// Record `outcome` every 100 ms (virtual time) until the breaker opens or 5 s pass; whether
    /// it opened.
    async fn feed(b: &BreakerShared, outcome: Outcome) -> bool {
        for _ in 0..50 {
            b.record(outcome, None);
            if b.phase().name() == "open" {
                return true;
            }
            tokio::time::advance(Duration::from_millis(100)).await;
        }
        false
    }

    /// A request waiting on the breaker in a task of its own, until `deadline`.
    fn waiter(
        b: &Arc<BreakerShared>,
        deadline: Instant,
    ) -> tokio::task::JoinHandle<Result<Option<Probe>, ProxyError>> {
        let b = Arc::clone(b);
        tokio::spawn(async move { b.admit(deadline).await })
    }

    async fn open(b: &BreakerShared) {
        assert!(feed(b, Outcome::ServerError(503)).await, "503s open it");
    }

    #[test]
    fn health_counts_5xx_timeouts_and_connection_errors_not_429s() {
        for failure in [
            Outcome::ServerError(500),
            Outcome::ServerError(503),
            Outcome::Overloaded(529),
            Outcome::Timeout,
            Outcome::Transport,
        ] {
            assert_eq!(health(failure, false), Some(true), "{failure:?}");
        }
        for success in [Outcome::Success, Outcome::ClientError(400)] {
            assert_eq!(health(success, false), Some(false), "{success:?}");
        }
        assert_eq!(health(Outcome::Throttled(429), false), None, "neutral");
        assert_eq!(health(Outcome::Throttled(429), true), Some(true));
        assert_eq!(health(Outcome::Local, true), None);
    }

    #[tokio::test(start_paused = true)]
    async fn throttles_dont_open_it_unless_counted() {
        let b = shared(OnOpen::Queue);
        assert!(!feed(&b, Outcome::Throttled(429)).await, "5 s of 429s");
        assert!(
            feed(&b, Outcome::Overloaded(529)).await,
            "529s are overload"
        );

        let counted = shared_with(&BreakerConfig {
            count_throttles: true,
            ..config(OnOpen::Queue)
        });
        assert!(feed(&counted, Outcome::Throttled(429)).await);
    }

    #[tokio::test(start_paused = true)]
    async fn reject_answers_503_with_the_remaining_cooldown() {
        let b = shared(OnOpen::Reject);
        open(&b).await;
        let err = b
            .admit(Instant::now() + Duration::from_secs(60))
            .await
            .unwrap_err();
        assert_eq!(err.status(), 503);
        let after = err.retry_after().unwrap();
        assert!(
            after > Duration::from_secs(2) && after <= Duration::from_millis(4100),
            "{after:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn queue_waits_for_a_scout_or_the_half_open_probe_within_the_deadline() {
        let b = shared(OnOpen::Queue);
        open(&b).await;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        let scout = b.admit(deadline).await.unwrap();
        assert!(scout.is_some_and(Probe::is_scout), "{scout:?}");
        let first_turn = SCOUT_EVERY..=SCOUT_EVERY + SLOT;
        assert!(
            first_turn.contains(&start.elapsed()),
            "the first scout's turn (plus the waiter's jitter): {:?}",
            start.elapsed()
        );
        // A scout out: the next waits for its answer, then for the next scout's turn.
        let next = waiter(&b, deadline);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!next.is_finished(), "one scout at a time");
        b.record(Outcome::Timeout, scout);
        assert_eq!(b.phase().name(), "open", "a failed scout changes nothing");
        let at = Instant::now();
        let second = next.await.unwrap().unwrap();
        assert!(second.is_some_and(Probe::is_scout), "{second:?}");
        assert!(
            first_turn.contains(&at.elapsed()),
            "half a second after the last answered: {:?}",
            at.elapsed()
        );
        // A deadline shorter than the next scout's turn ends the wait with a 503.
        b.record(Outcome::Timeout, second);
        let err = b
            .admit(Instant::now() + Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, ProxyError::CircuitOpen { .. }), "{err}");
        // The cool-down over, a waiter is a half-open probe.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let probe = b.admit(deadline).await.unwrap();
        assert_eq!(b.phase().name(), "half_open");
        assert!(probe.is_some_and(|p| !p.is_scout()), "{probe:?}");
        b.record(Outcome::Timeout, probe);
        assert_eq!(b.phase().name(), "open", "the failed probe reopened it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_scout_served_well_ends_the_cooldown() {
        let b = shared(OnOpen::Queue);
        open(&b).await;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        // Held requests; the upstream has recovered by the first scout's turn.
        let held: Vec<_> = (0..5)
            .map(|_| {
                let b = Arc::clone(&b);
                tokio::spawn(async move {
                    let probe = b.admit(deadline).await.unwrap();
                    b.record(Outcome::Success, probe);
                    Instant::now()
                })
            })
            .collect();
        let mut passed = Vec::new();
        for h in held {
            passed.push(h.await.unwrap() - start);
        }
        assert_eq!(b.phase(), Phase::Closed);
        let last = passed.iter().max().unwrap();
        assert!(
            *last < Duration::from_secs(1),
            "all served within a scout's turn and the release's jitter, not after the 3-4 s \
             cool-down: {passed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn held_waiters_are_released_spread_in_arrival_order() {
        let b = shared(OnOpen::Queue);
        open(&b).await;
        let opened = Instant::now();
        let tasks: Vec<_> = (0..8u32)
            .map(|i| {
                let b = Arc::clone(&b);
                tokio::spawn(async move {
                    let arrival = Duration::from_millis(300) * i;
                    tokio::time::sleep(arrival).await;
                    let probe = b.admit(opened + Duration::from_secs(60)).await.unwrap();
                    let passed = Instant::now();
                    // The scout hangs (its answer never comes): no other goes, and the
                    // breaker waits out its cool-down.
                    let scout = probe.is_some_and(Probe::is_scout);
                    if probe.is_some() && !scout {
                        b.record(Outcome::Success, probe);
                    }
                    (arrival, passed, probe.is_some(), scout)
                })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            let (arrival, passed, probe, scout) = t.await.unwrap();
            if !scout {
                results.push((arrival, passed, probe));
            }
        }
        assert_eq!(results.len(), 7, "one scout");
        let probes: Vec<_> = results.iter().filter(|r| r.2).collect();
        assert_eq!(probes.len(), 1, "one probe");
        let closed = probes[0].1;
        assert_eq!(b.phase(), Phase::Closed);
        let mut passes: Vec<Instant> = results.iter().map(|r| r.1).collect();
        passes.sort();
        passes.dedup();
        assert_eq!(passes.len(), 7, "no two released at the same instant");
        let mut previous = closed;
        for (arrival, passed, _) in results.iter().filter(|r| !r.2) {
            let offset = *arrival;
            assert!(
                *passed >= closed + offset && *passed <= closed + offset + SLOT_SLACK,
                "held {offset:?} into the open period, released {:?} after closing",
                *passed - closed
            );
            assert!(*passed > previous, "in arrival order");
            previous = *passed;
        }
    }

    /// The release jitter (up to one 100 ms slot) plus rounding.
    const SLOT_SLACK: Duration = Duration::from_millis(101);

    #[tokio::test(start_paused = true)]
    async fn a_429_probe_frees_its_slot_for_a_waiter() {
        let b = shared(OnOpen::Queue);
        open(&b).await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let scout = b.admit(deadline).await.unwrap();
        b.record(Outcome::Success, scout);
        assert!(matches!(b.phase(), Phase::HalfOpen { .. }), "scouted");
        let first = b.admit(deadline).await.unwrap();
        assert!(
            first.is_some_and(|p| !p.is_scout()),
            "the first waiter probes"
        );
        let waiter = waiter(&b, deadline);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!waiter.is_finished(), "the only probe slot is taken");
        b.record(Outcome::Throttled(429), first);
        assert!(
            matches!(b.phase(), Phase::HalfOpen { .. }),
            "a 429 says nothing about health"
        );
        let second = tokio::time::timeout(Duration::from_millis(10), waiter)
            .await
            .expect("woken at once")
            .unwrap()
            .unwrap();
        assert!(second.is_some(), "the waiter took the freed probe slot");
    }

    #[tokio::test(start_paused = true)]
    async fn probe_slot_is_released_when_the_client_leaves() {
        let b = shared(OnOpen::Queue);
        open(&b).await;
        tokio::time::advance(Duration::from_secs(5)).await;
        let never = tower::service_fn(|_req: ProxyRequest| {
            std::future::pending::<Result<Response<Body>, ProxyError>>()
        });
        let req = ProxyRequest::for_test("http://up/v1", Duration::from_secs(60));
        let never = crate::stack::layer::Tower(never);
        let call = b.call(&never, req);
        assert!(tokio::time::timeout(Duration::from_millis(10), call)
            .await
            .is_err());
        assert!(
            matches!(b.phase(), Phase::HalfOpen { admitted: 0, .. }),
            "{:?}",
            b.phase()
        );
    }
}
