//! State shared by every connection: config, buckets and dice behind one mutex, the
//! `--queue-slots` semaphore, stats.
//!
//! # What an arrival meets, in order
//! 1. The gateway (`--admission-refusals`): a body not yet refused K times is refused.
//! 2. The engine's overload (`--overload-429`): a roll of the dice refuses that share.
//! 3. The day's quota (`--requests-per-day`): once spent, everything is refused.
//! 4. The buckets: the model's request bucket (or the default one) and the TPM bucket.
//!
//! Only an arrival that passes all four is admitted: it takes its bucket tokens, counts
//! against the day, and gets its [`Fate`]. A refusal at any step takes nothing from the steps
//! after it, so an overload or a gateway refusal never costs the sender a token.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::config::{HeaderStyle, SimConfig};
use super::gateway::{self, Gateway};
use super::limits::{Admission, Denied, Kind, Limiter, View};
use super::quota::DailyQuota;
use super::stats::{Recorder, Stats, Throttle};

/// An injected failure for an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// 503 with an error body.
    Unavailable,
    /// 529 "overloaded".
    Overloaded,
    /// Connection closed without a response.
    Reset,
}

/// What happens to an admitted request: how long it takes, and whether it fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fate {
    /// Service time, jitter and any slow-first-byte delay, before the response head.
    pub delay: Duration,
    pub fault: Option<Fault>,
}

/// One arrival on a chat route, as the limits see it.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    pub at: Instant,
    /// The raw body: the gateway knows a request by it.
    pub body: &'a [u8],
    /// The body's `model`, which picks the request bucket.
    pub model: Option<&'a str>,
    /// Tokens charged to the tokens-per-minute bucket.
    pub cost: u64,
}

/// What happens to an arrival: admitted with a fate, or refused with a 429 for a reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Admitted(Fate),
    Refused(Throttle),
}

/// An arrival's [`Outcome`] and what its rate-limit headers report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The header values; `denied` carries the retry hint of a refusal that has one.
    pub admission: Admission,
    pub outcome: Outcome,
    /// `--gemini-array`: this refusal's Gemini body is wrapped in a JSON array.
    pub array: bool,
}

#[derive(Debug)]
pub struct Shared {
    pub config: SimConfig,
    core: Mutex<Core>,
    pub stats: Recorder,
    next_id: AtomicU64,
    /// `--queue-slots`: a fair (FIFO) semaphore with one permit per slot.
    slots: Option<Arc<Semaphore>>,
}

#[derive(Debug)]
struct Core {
    limiter: Limiter,
    gateway: Gateway,
    quota: Option<DailyQuota>,
    rng: SmallRng,
    /// Start or the last reset: the origin of `--fail-503-window`.
    start: Instant,
}

impl Shared {
    pub fn new(config: SimConfig) -> Self {
        let now = Instant::now();
        let rng = match config.seed {
            Some(seed) => SmallRng::seed_from_u64(seed),
            None => SmallRng::from_os_rng(),
        };
        Self {
            core: Mutex::new(Core {
                limiter: Limiter::new(&config, now),
                gateway: Gateway::new(config.admission_refusals),
                quota: config.requests_per_day.map(|n| DailyQuota::new(n, now)),
                rng,
                start: now,
            }),
            stats: Recorder::new(now),
            next_id: AtomicU64::new(1),
            slots: config
                .queue_slots
                .map(|n| Arc::new(Semaphore::new((n as usize).min(Semaphore::MAX_PERMITS)))),
            config,
        }
    }

    /// Takes `arrival` through the gateway, the overload dice, the day's quota and the
    /// buckets, in that order (see the module doc); an admitted request also gets its
    /// [`Fate`], a 503 if it arrived in a `--fail-503-window`. With a day quota the request
    /// headers describe the day, whatever the outcome.
    pub fn admit(&self, arrival: Arrival<'_>) -> Decision {
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        let (mut admission, outcome) = self.decide(&mut core, arrival);
        if let Some(quota) = &mut core.quota {
            // The gateway's refusal still says "none left, back in a second".
            let view = quota.view(arrival.at);
            admission.requests = match outcome {
                Outcome::Refused(Throttle::Admission) => View {
                    remaining: 0,
                    reset: gateway::RETRY_AFTER,
                    ..view
                },
                _ => view,
            };
        }
        let array = matches!(outcome, Outcome::Refused(Throttle::Rate | Throttle::Quota))
            && self.config.header_style == HeaderStyle::Gemini
            && self.config.gemini_array > 0.0
            && core.rng.random_bool(self.config.gemini_array);
        Decision {
            admission,
            outcome,
            array,
        }
    }

    /// The four steps of the module doc, each one returning as soon as it refuses.
    fn decide(&self, core: &mut Core, arrival: Arrival<'_>) -> (Admission, Outcome) {
        let (now, model) = (arrival.at, arrival.model);
        if core.gateway.refuse(arrival.body) {
            let mut admission = core.limiter.peek(now, model);
            admission.requests.remaining = 0;
            admission.requests.reset = gateway::RETRY_AFTER;
            admission.denied = Some(Denied {
                kind: Kind::Requests,
                retry_after: gateway::RETRY_AFTER,
            });
            return (admission, Outcome::Refused(Throttle::Admission));
        }
        let overload = self.config.overload_429;
        if overload > 0.0 && core.rng.random_bool(overload) {
            let admission = core.limiter.peek(now, model);
            return (admission, Outcome::Refused(Throttle::Overload));
        }
        if let Some(quota) = &mut core.quota {
            if quota.spent(now) {
                let mut admission = core.limiter.peek(now, model);
                admission.denied = Some(Denied {
                    kind: Kind::Requests,
                    retry_after: quota.until_midnight(now),
                });
                return (admission, Outcome::Refused(Throttle::Quota));
            }
        }
        let admission = core.limiter.admit(now, model, arrival.cost);
        if admission.denied.is_some() {
            return (admission, Outcome::Refused(Throttle::Rate));
        }
        if let Some(quota) = &mut core.quota {
            quota.count(now);
        }
        let offset = now.saturating_duration_since(core.start);
        let fate = roll(&self.config, &mut core.rng);
        let fate = in_window(&self.config, offset, fate);
        (admission, Outcome::Admitted(fate))
    }

    /// With `--queue-slots`, waits in FIFO order for a slot, held until the permit drops, and
    /// records the wait since `arrival`; `None` at once without queue mode.
    pub async fn slot(&self, arrival: Instant) -> Option<OwnedSemaphorePermit> {
        let slots = Arc::clone(self.slots.as_ref()?);
        let queued = self.stats.enqueue();
        let permit = slots
            .acquire_owned()
            .await
            .expect("the slot semaphore is never closed");
        drop(queued);
        self.stats
            .waited(Instant::now().saturating_duration_since(arrival));
        Some(permit)
    }

    /// Refills the buckets, restarts the refill schedule and clears the stats.
    pub fn reset(&self) {
        let now = Instant::now();
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        core.limiter.reset(now);
        core.gateway.reset();
        if let Some(quota) = &mut core.quota {
            quota.reset(now);
        }
        core.start = now;
        self.stats.clear(now);
    }

    pub fn stats(&self) -> Stats {
        self.stats.snapshot(Instant::now())
    }

    /// A process-unique number for response ids.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }
}

fn roll(config: &SimConfig, rng: &mut impl Rng) -> Fate {
    let mut delay = match config.service_tail {
        Some(tail) => tail.draw(config.service_time, rng.random()),
        None => config.service_time,
    };
    if !config.service_jitter.is_zero() {
        let max = u64::try_from(config.service_jitter.as_nanos()).unwrap_or(u64::MAX);
        delay += Duration::from_nanos(rng.random_range(0..=max));
    }
    if config.slow_fraction > 0.0 && rng.random_bool(config.slow_fraction) {
        delay += config.slow_first_byte;
    }
    let fault = if config.fail_503 + config.fail_529 + config.fail_reset > 0.0 {
        let x: f64 = rng.random();
        if x < config.fail_503 {
            Some(Fault::Unavailable)
        } else if x < config.fail_503 + config.fail_529 {
            Some(Fault::Overloaded)
        } else if x < config.fail_503 + config.fail_529 + config.fail_reset {
            Some(Fault::Reset)
        } else {
            None
        }
    } else {
        None
    };
    Fate { delay, fault }
}

/// `fate` as rolled, or a 503 when `offset` (arrival after start/reset) is in a
/// `--fail-503-window`; the service time stays as rolled.
fn in_window(config: &SimConfig, offset: Duration, fate: Fate) -> Fate {
    if config.fail_503_windows.iter().any(|w| w.contains(offset)) {
        Fate {
            fault: Some(Fault::Unavailable),
            ..fate
        }
    } else {
        fate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::config::{FailWindow, ModelLimit, ServiceTail};
    use tokio::time::advance;

    fn rolls(config: SimConfig, n: usize) -> Vec<Fate> {
        let mut rng = SmallRng::seed_from_u64(1);
        (0..n).map(|_| roll(&config, &mut rng)).collect()
    }

    #[test]
    fn no_faults_or_jitter_by_default() {
        for fate in rolls(SimConfig::default(), 100) {
            assert_eq!(
                fate,
                Fate {
                    delay: Duration::from_millis(200),
                    fault: None
                }
            );
        }
    }

    #[test]
    fn fractions_of_one_always_fire() {
        let config = SimConfig {
            fail_529: 1.0,
            ..SimConfig::default()
        };
        assert!(rolls(config, 100)
            .iter()
            .all(|f| f.fault == Some(Fault::Overloaded)));
        let config = SimConfig {
            slow_fraction: 1.0,
            slow_first_byte: Duration::from_secs(1),
            ..SimConfig::default()
        };
        assert!(rolls(config, 100)
            .iter()
            .all(|f| f.delay == Duration::from_millis(1200)));
    }

    #[test]
    fn faults_split_by_their_fractions() {
        let config = SimConfig {
            fail_503: 0.2,
            fail_529: 0.3,
            fail_reset: 0.1,
            service_jitter: Duration::from_millis(10),
            ..SimConfig::default()
        };
        let fates = rolls(config, 10_000);
        let share = |f: Option<Fault>| fates.iter().filter(|x| x.fault == f).count() as f64 / 1e4;
        assert!((share(Some(Fault::Unavailable)) - 0.2).abs() < 0.03);
        assert!((share(Some(Fault::Overloaded)) - 0.3).abs() < 0.03);
        assert!((share(Some(Fault::Reset)) - 0.1).abs() < 0.03);
        assert!((share(None) - 0.4).abs() < 0.03);
        let (lo, hi) = (Duration::from_millis(200), Duration::from_millis(210));
        assert!(fates.iter().all(|f| (lo..=hi).contains(&f.delay)));
        assert!(fates
            .iter()
            .any(|f| f.delay > lo + Duration::from_millis(5)));
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn queue_serves_at_most_n_in_arrival_order_and_records_waits() {
        let shared = Arc::new(Shared::new(SimConfig {
            queue_slots: Some(2),
            ..SimConfig::default()
        }));
        let served = Arc::new(Mutex::new(Vec::new()));
        let busy = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..6 {
            let (shared, served, busy) = (shared.clone(), served.clone(), busy.clone());
            tasks.push(tokio::spawn(async move {
                let slot = shared.slot(Instant::now()).await;
                assert!(slot.is_some());
                assert!(busy.fetch_add(1, Relaxed) < 2, "more than 2 served at once");
                served.lock().unwrap().push(i);
                tokio::time::sleep(ms(20)).await;
                busy.fetch_sub(1, Relaxed);
            }));
            // Let it take a slot or join the queue before the next one arrives.
            tokio::task::yield_now().await;
        }
        let s = shared.stats();
        assert_eq!((s.queued_now, s.max_queued), (4, 4));
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*served.lock().unwrap(), [0, 1, 2, 3, 4, 5]);
        let s = shared.stats();
        assert_eq!((s.queued_now, s.max_queued), (0, 4));
        // Waits 0, 0, 20, 20, 40, 40.
        let waits = (
            s.queue_wait_p50_ms,
            s.queue_wait_p99_ms,
            s.queue_wait_max_ms,
        );
        assert_eq!(waits, (20, 40, 40));
    }

    #[tokio::test(start_paused = true)]
    async fn no_queue_no_slot_no_waits() {
        let shared = Shared::new(SimConfig::default());
        assert!(shared.slot(Instant::now()).await.is_none());
        let s = shared.stats();
        assert_eq!((s.queue_wait_max_ms, s.max_queued), (0, 0));
    }

    #[test]
    fn windows_turn_any_fate_into_a_503() {
        let config = SimConfig {
            fail_503_windows: vec![FailWindow {
                at: ms(100),
                duration: ms(50),
            }],
            ..SimConfig::default()
        };
        let ok = Fate {
            delay: ms(200),
            fault: None,
        };
        let reset = Fate {
            fault: Some(Fault::Reset),
            ..ok
        };
        let unavailable = Fate {
            fault: Some(Fault::Unavailable),
            ..ok
        };
        assert_eq!(in_window(&config, ms(99), ok), ok);
        assert_eq!(in_window(&config, ms(100), ok), unavailable);
        assert_eq!(in_window(&config, ms(149), reset), unavailable);
        assert_eq!(in_window(&config, ms(150), reset), reset);
    }

    #[tokio::test(start_paused = true)]
    async fn windows_count_from_start_and_from_the_last_reset() {
        let shared = Shared::new(SimConfig {
            capacity: 1000,
            fail_503_windows: vec![FailWindow {
                at: ms(0),
                duration: ms(150),
            }],
            seed: Some(1),
            ..SimConfig::default()
        });
        let fault = |shared: &Shared| fate(arrive(shared, b"{}")).unwrap().fault;
        assert_eq!(fault(&shared), Some(Fault::Unavailable));
        advance(ms(150)).await;
        assert_eq!(fault(&shared), None);
        shared.reset();
        assert_eq!(fault(&shared), Some(Fault::Unavailable));
        // A refused request gets no fate at all.
        let shared = Shared::new(SimConfig {
            capacity: 1,
            refill: 0.0,
            ..shared.config.clone()
        });
        assert!(fate(arrive(&shared, b"{}")).is_some());
        assert!(fate(arrive(&shared, b"{}")).is_none());
    }

    fn arrive(shared: &Shared, body: &[u8]) -> Decision {
        arrive_as(shared, body, None)
    }

    fn arrive_as(shared: &Shared, body: &[u8], model: Option<&str>) -> Decision {
        shared.admit(Arrival {
            at: Instant::now(),
            body,
            model,
            cost: 0,
        })
    }

    fn fate(d: Decision) -> Option<Fate> {
        match d.outcome {
            Outcome::Admitted(fate) => Some(fate),
            Outcome::Refused(_) => None,
        }
    }

    fn refused(d: &Decision) -> Option<Throttle> {
        match d.outcome {
            Outcome::Admitted(_) => None,
            Outcome::Refused(reason) => Some(reason),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_overload_refuses_without_a_hint_and_without_touching_the_bucket() {
        let shared = Shared::new(SimConfig {
            capacity: 2,
            refill: 0.0,
            overload_429: 1.0,
            seed: Some(1),
            ..SimConfig::default()
        });
        for _ in 0..10 {
            let d = arrive(&shared, b"{}");
            assert_eq!(refused(&d), Some(Throttle::Overload));
            assert_eq!(d.admission.denied, None, "no retry hint");
            assert_eq!(d.admission.requests.remaining, 2, "healthy headers");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn overloads_take_their_share_of_arrivals() {
        let shared = Shared::new(SimConfig {
            capacity: 1_000_000,
            overload_429: 0.2,
            seed: Some(3),
            ..SimConfig::default()
        });
        let overloads = (0..10_000)
            .filter(|_| refused(&arrive(&shared, b"{}")) == Some(Throttle::Overload))
            .count();
        assert!((1_800..2_200).contains(&overloads), "{overloads}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_gateway_refuses_each_body_k_times_like_an_empty_bucket_then_admits_it() {
        let shared = Shared::new(SimConfig {
            capacity: 10,
            refill: 0.0,
            admission_refusals: 2,
            ..SimConfig::default()
        });
        for _ in 0..2 {
            let d = arrive(&shared, b"{\"n\":1}");
            assert_eq!(refused(&d), Some(Throttle::Admission));
            let v = d.admission.requests;
            assert_eq!(
                (v.limit, v.remaining, v.reset),
                (10, 0, Duration::from_secs(1))
            );
            let hint = d.admission.denied.map(|d| d.retry_after);
            assert_eq!(hint, Some(Duration::from_secs(1)));
        }
        let d = arrive(&shared, b"{\"n\":1}");
        assert!(fate(d).is_some());
        assert_eq!(
            d.admission.requests.remaining, 9,
            "the refusals took no token"
        );
        assert_eq!(
            refused(&arrive(&shared, b"{\"n\":2}")),
            Some(Throttle::Admission)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn each_listed_model_has_a_bucket_of_its_own() {
        let shared = Shared::new(SimConfig {
            capacity: 3,
            refill: 0.0,
            model_limits: vec![
                ModelLimit {
                    model: "fast".into(),
                    capacity: 5,
                    refill: 0.0,
                },
                ModelLimit {
                    model: "slow".into(),
                    capacity: 1,
                    refill: 0.5,
                },
            ],
            ..SimConfig::default()
        });
        let slow = arrive_as(&shared, b"{}", Some("slow"));
        assert_eq!(slow.admission.requests.limit, 1);
        assert!(fate(slow).is_some());
        let slow = arrive_as(&shared, b"{}", Some("slow"));
        assert_eq!(refused(&slow), Some(Throttle::Rate));
        let hint = slow.admission.denied.map(|d| d.retry_after);
        assert_eq!(hint, Some(Duration::from_secs(2)));
        // The fast model and the rest are untouched by the slow model's empty bucket.
        for left in (0..5).rev() {
            let fast = arrive_as(&shared, b"{}", Some("fast"));
            assert_eq!(
                (
                    fast.admission.requests.limit,
                    fast.admission.requests.remaining
                ),
                (5, left)
            );
            assert!(fate(fast).is_some());
        }
        let other = arrive_as(&shared, b"{}", Some("other"));
        assert_eq!(
            (
                other.admission.requests.limit,
                other.admission.requests.remaining
            ),
            (3, 2)
        );
        let none = arrive(&shared, b"{}");
        assert_eq!(none.admission.requests.remaining, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_spent_day_refuses_until_midnight_and_only_admissions_count() {
        let shared = Shared::new(SimConfig {
            capacity: 2,
            refill: 1.0,
            requests_per_day: Some(3),
            ..SimConfig::default()
        });
        for _ in 0..2 {
            assert!(fate(arrive(&shared, b"{}")).is_some());
        }
        // The bucket refuses: that costs nothing of the day.
        let rate = arrive(&shared, b"{}");
        assert_eq!(refused(&rate), Some(Throttle::Rate));
        let v = rate.admission.requests;
        assert_eq!(
            (v.limit, v.remaining),
            (3, 1),
            "the headers describe the day"
        );
        let hint = rate.admission.denied.map(|d| d.retry_after);
        assert_eq!(hint, Some(Duration::from_secs(1)), "the bucket's own hint");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(fate(arrive(&shared, b"{}")).is_some());
        tokio::time::advance(Duration::from_secs(1)).await;
        let quota = arrive(&shared, b"{}");
        assert_eq!(refused(&quota), Some(Throttle::Quota));
        let v = quota.admission.requests;
        let until_midnight = crate::simulate::quota::DAY - Duration::from_secs(2);
        assert_eq!((v.limit, v.remaining, v.reset), (3, 0, until_midnight));
        let hint = quota.admission.denied.map(|d| d.retry_after);
        assert_eq!(hint, Some(until_midnight));
        tokio::time::advance(until_midnight).await;
        assert!(fate(arrive(&shared, b"{}")).is_some(), "a new day");
    }

    #[tokio::test(start_paused = true)]
    async fn gemini_arrays_are_rolled_for_rate_and_quota_refusals_only() {
        let shared = Shared::new(SimConfig {
            capacity: 1,
            refill: 0.0,
            header_style: HeaderStyle::Gemini,
            gemini_array: 1.0,
            ..SimConfig::default()
        });
        assert!(!arrive(&shared, b"{}").array, "admitted");
        assert!(arrive(&shared, b"{}").array, "refused by the bucket");
        let shared = Shared::new(SimConfig {
            gemini_array: 0.5,
            ..shared.config.clone()
        });
        let arrays = (0..1_000).filter(|_| arrive(&shared, b"{}").array).count();
        assert!((400..600).contains(&arrays), "{arrays}");
    }

    #[test]
    fn a_heavy_tail_draws_around_the_median_and_a_seed_repeats_it() {
        let config = SimConfig {
            service_tail: Some(ServiceTail::Pareto { alpha: 1.5 }),
            ..SimConfig::default()
        };
        let fates = rolls(config.clone(), 2_001);
        assert_eq!(fates, rolls(config, 2_001), "seeded");
        let mut delays: Vec<Duration> = fates.iter().map(|f| f.delay).collect();
        delays.sort();
        let median = delays[1_000].as_secs_f64();
        assert!((0.18..0.22).contains(&median), "median {median}");
        assert!(delays[2_000] > Duration::from_secs(1), "a long tail");
        assert!(
            delays[2_000] <= Duration::from_secs(4),
            "capped at 20 medians"
        );
    }
}
