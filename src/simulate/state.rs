//! State shared by every connection: config, buckets and dice behind one mutex, the
//! `--queue-slots` semaphore, stats.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::config::SimConfig;
use super::limits::{Admission, Limiter};
use super::stats::{Recorder, Stats};

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

    /// Charges one request (and `cost` tokens) as of `arrival`; an admitted request also
    /// gets its [`Fate`], a 503 if it arrived in a `--fail-503-window`.
    pub fn admit(&self, arrival: Instant, cost: u64) -> (Admission, Option<Fate>) {
        let mut core = self.core.lock().unwrap_or_else(PoisonError::into_inner);
        let admission = core.limiter.admit(arrival, cost);
        let offset = arrival.saturating_duration_since(core.start);
        let fate = admission.denied.is_none().then(|| {
            let fate = roll(&self.config, &mut core.rng);
            in_window(&self.config, offset, fate)
        });
        (admission, fate)
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
    let mut delay = config.service_time;
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
    use crate::simulate::config::FailWindow;
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
        let fault = |shared: &Shared| shared.admit(Instant::now(), 0).1.unwrap().fault;
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
        assert!(shared.admit(Instant::now(), 0).1.is_some());
        assert!(shared.admit(Instant::now(), 0).1.is_none());
    }
}
