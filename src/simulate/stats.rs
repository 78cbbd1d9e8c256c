//! What the simulator saw: request counts by status, 429s by reason, arrivals over time, peak
//! concurrency, and with `--queue-slots` the queue's length and waits.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::histogram::Histogram;

/// Width of one `arrivals_per_100ms` slot.
pub const SLOT: Duration = Duration::from_millis(100);
/// Arrivals later than this after start/reset (6 hours) are counted but not bucketed.
pub const MAX_SLOTS: usize = 6 * 60 * 60 * 10;
/// Statuses counted (0..=599); anything else is folded into 599.
const STATUSES: usize = 600;

/// Why a request was answered 429. Only [`Throttle::Rate`] says the sender went too fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Throttle {
    /// A bucket was empty: the request bucket (the model's own with `--model-limit`) or the
    /// tokens-per-minute one.
    Rate,
    /// `--overload-429`: the engine is overloaded, whatever the sender's rate.
    Overload,
    /// `--admission-refusals`: the gateway's queue is full, whatever the sender's rate.
    Admission,
    /// `--requests-per-day`: the day's quota is spent.
    Quota,
}

impl Throttle {
    pub const ALL: [Throttle; 4] = [
        Throttle::Rate,
        Throttle::Overload,
        Throttle::Admission,
        Throttle::Quota,
    ];

    /// The key in [`Stats::throttles_by_reason`].
    pub fn label(self) -> &'static str {
        match self {
            Throttle::Rate => "rate",
            Throttle::Overload => "overload",
            Throttle::Admission => "admission",
            Throttle::Quota => "quota",
        }
    }
}

/// Snapshot served at `GET /_stats`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    /// Since start or the last reset.
    pub elapsed_ms: u64,
    /// Arrivals on the rate-limited routes (every status, and resets).
    pub requests: u64,
    /// Responses by status code, e.g. `{"200": 40, "429": 10}`.
    pub by_status: BTreeMap<String, u64>,
    /// 429 answers by reason, every reason present: `rate` (a bucket was empty: the sender's
    /// rate), `overload`, `admission` and `quota`; they add up to `by_status["429"]`.
    #[serde(default)]
    pub throttles_by_reason: BTreeMap<String, u64>,
    /// Connections closed without a response by `--fail-reset`.
    pub resets: u64,
    /// Arrivals per 100 ms slot since start/reset (index = slot).
    pub arrivals_per_100ms: Vec<u32>,
    /// Most requests being answered at once (streams count until their last event; with
    /// `--queue-slots`, requests waiting for a slot count too).
    pub max_in_flight: u64,
    /// `--queue-slots`: median wait of admitted requests for a slot (arrival to slot), in ms;
    /// 0 without queue mode. Exact below 1,024 ms, within 1/64 above.
    #[serde(default)]
    pub queue_wait_p50_ms: u64,
    /// `--queue-slots`: 99th percentile wait for a slot, in ms (as `queue_wait_p50_ms`).
    #[serde(default)]
    pub queue_wait_p99_ms: u64,
    /// `--queue-slots`: longest wait for a slot, in ms.
    #[serde(default)]
    pub queue_wait_max_ms: u64,
    /// `--queue-slots`: admitted requests waiting for a slot now.
    #[serde(default)]
    pub queued_now: u64,
    /// `--queue-slots`: most admitted requests waiting for a slot at once.
    #[serde(default)]
    pub max_queued: u64,
}

/// Lock-free counters plus one mutex around the arrival histogram.
#[derive(Debug)]
pub struct Recorder {
    requests: AtomicU64,
    resets: AtomicU64,
    by_status: Box<[AtomicU64]>,
    /// Indexed like [`Throttle::ALL`].
    throttles: [AtomicU64; 4],
    in_flight: Arc<AtomicU64>,
    max_in_flight: AtomicU64,
    arrivals: Mutex<Arrivals>,
    queued: AtomicU64,
    max_queued: AtomicU64,
    /// Queue waits in ms: a fixed histogram, so memory does not grow with requests.
    waits: Mutex<Histogram>,
}

#[derive(Debug)]
struct Arrivals {
    start: Instant,
    slots: Vec<u32>,
}

/// Counts one request as in flight until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<AtomicU64>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Counts one request as waiting for a slot until dropped.
#[derive(Debug)]
pub struct Queued<'a>(&'a AtomicU64);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl Recorder {
    pub fn new(now: Instant) -> Self {
        Self {
            requests: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            by_status: (0..STATUSES).map(|_| AtomicU64::new(0)).collect(),
            throttles: Default::default(),
            in_flight: Arc::new(AtomicU64::new(0)),
            max_in_flight: AtomicU64::new(0),
            arrivals: Mutex::new(Arrivals {
                start: now,
                slots: Vec::with_capacity(1024),
            }),
            queued: AtomicU64::new(0),
            max_queued: AtomicU64::new(0),
            waits: Mutex::new(Histogram::default()),
        }
    }

    /// Records an arrival at `now`; the guard keeps it in flight.
    pub fn arrive(&self, now: Instant) -> InFlight {
        self.requests.fetch_add(1, Relaxed);
        let current = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.max_in_flight.fetch_max(current, Relaxed);
        let mut arrivals = self.arrivals.lock().unwrap_or_else(PoisonError::into_inner);
        let slot =
            (now.saturating_duration_since(arrivals.start).as_millis() / SLOT.as_millis()) as usize;
        if slot < MAX_SLOTS {
            if arrivals.slots.len() <= slot {
                arrivals.slots.resize(slot + 1, 0);
            }
            arrivals.slots[slot] += 1;
        }
        InFlight(Arc::clone(&self.in_flight))
    }

    /// Records a request starting to wait for a slot; the guard keeps it queued.
    pub fn enqueue(&self) -> Queued<'_> {
        let current = self.queued.fetch_add(1, Relaxed) + 1;
        self.max_queued.fetch_max(current, Relaxed);
        Queued(&self.queued)
    }

    /// Records how long a request waited for its slot.
    pub fn waited(&self, wait: Duration) {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let mut waits = self.waits.lock().unwrap_or_else(PoisonError::into_inner);
        waits.record(ms);
    }

    pub fn status(&self, status: u16) {
        let i = usize::from(status).min(STATUSES - 1);
        self.by_status[i].fetch_add(1, Relaxed);
    }

    /// Counts a 429 answered for `reason` (its status is counted by [`Recorder::status`]).
    pub fn throttle(&self, reason: Throttle) {
        self.throttles[reason as usize].fetch_add(1, Relaxed);
    }

    pub fn reset_connection(&self) {
        self.resets.fetch_add(1, Relaxed);
    }

    /// Clears the counters; requests still in flight (or queued) keep counting as such.
    pub fn clear(&self, now: Instant) {
        let mut arrivals = self.arrivals.lock().unwrap_or_else(PoisonError::into_inner);
        self.waits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.max_queued.store(self.queued.load(Relaxed), Relaxed);
        arrivals.start = now;
        arrivals.slots.clear();
        self.requests.store(0, Relaxed);
        self.resets.store(0, Relaxed);
        for count in self.by_status.iter().chain(&self.throttles) {
            count.store(0, Relaxed);
        }
        self.max_in_flight
            .store(self.in_flight.load(Relaxed), Relaxed);
    }

    pub fn snapshot(&self, now: Instant) -> Stats {
        let arrivals = self.arrivals.lock().unwrap_or_else(PoisonError::into_inner);
        let by_status = self
            .by_status
            .iter()
            .enumerate()
            .filter_map(|(code, n)| {
                let n = n.load(Relaxed);
                (n > 0).then(|| (code.to_string(), n))
            })
            .collect();
        let throttles_by_reason = Throttle::ALL
            .iter()
            .map(|t| {
                (
                    t.label().to_owned(),
                    self.throttles[*t as usize].load(Relaxed),
                )
            })
            .collect();
        let waits = self.waits.lock().unwrap_or_else(PoisonError::into_inner);
        Stats {
            elapsed_ms: now.saturating_duration_since(arrivals.start).as_millis() as u64,
            requests: self.requests.load(Relaxed),
            by_status,
            throttles_by_reason,
            resets: self.resets.load(Relaxed),
            arrivals_per_100ms: arrivals.slots.clone(),
            max_in_flight: self.max_in_flight.load(Relaxed),
            queue_wait_p50_ms: waits.quantile(0.50),
            queue_wait_p99_ms: waits.quantile(0.99),
            queue_wait_max_ms: waits.max(),
            queued_now: self.queued.load(Relaxed),
            max_queued: self.max_queued.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    #[tokio::test(start_paused = true)]
    async fn counts_arrivals_by_slot_status_and_peak() {
        let r = Recorder::new(Instant::now());
        let a = r.arrive(Instant::now());
        let b = r.arrive(Instant::now());
        r.status(200);
        r.status(429);
        drop(a);
        advance(Duration::from_millis(250)).await;
        let c = r.arrive(Instant::now());
        r.status(200);
        drop((b, c));
        let s = r.snapshot(Instant::now());
        assert_eq!(s.elapsed_ms, 250);
        assert_eq!(s.requests, 3);
        assert_eq!(s.arrivals_per_100ms, vec![2, 0, 1]);
        assert_eq!(s.max_in_flight, 2);
        let want: BTreeMap<String, u64> = [("200".into(), 2), ("429".into(), 1)].into();
        assert_eq!(s.by_status, want);
    }

    #[tokio::test(start_paused = true)]
    async fn throttles_are_counted_by_reason_and_cleared_with_the_rest() {
        let r = Recorder::new(Instant::now());
        let zeros = r.snapshot(Instant::now()).throttles_by_reason;
        let labels: Vec<&str> = zeros.keys().map(String::as_str).collect();
        assert_eq!(labels, ["admission", "overload", "quota", "rate"]);
        assert!(zeros.values().all(|n| *n == 0));
        for reason in [
            Throttle::Rate,
            Throttle::Rate,
            Throttle::Overload,
            Throttle::Quota,
        ] {
            r.throttle(reason);
        }
        let s = r.snapshot(Instant::now()).throttles_by_reason;
        let counts = (s["rate"], s["overload"], s["admission"], s["quota"]);
        assert_eq!(counts, (2, 1, 0, 1));
        r.clear(Instant::now());
        let s = r.snapshot(Instant::now()).throttles_by_reason;
        assert!(s.values().all(|n| *n == 0));
    }

    #[tokio::test(start_paused = true)]
    async fn queue_counters_and_wait_percentiles() {
        let r = Recorder::new(Instant::now());
        let s = r.snapshot(Instant::now());
        let waits = (
            s.queue_wait_p50_ms,
            s.queue_wait_p99_ms,
            s.queue_wait_max_ms,
        );
        assert_eq!((waits, s.queued_now, s.max_queued), ((0, 0, 0), 0, 0));
        let a = r.enqueue();
        let b = r.enqueue();
        drop(a);
        let _c = r.enqueue();
        for ms in [0, 10, 20, 30] {
            r.waited(Duration::from_micros(ms * 1000 + 900));
        }
        let s = r.snapshot(Instant::now());
        assert_eq!((s.queued_now, s.max_queued), (2, 2));
        let waits = (
            s.queue_wait_p50_ms,
            s.queue_wait_p99_ms,
            s.queue_wait_max_ms,
        );
        assert_eq!(waits, (10, 30, 30));
        drop(b);
        r.clear(Instant::now());
        let s = r.snapshot(Instant::now());
        assert_eq!((s.queued_now, s.max_queued, s.queue_wait_max_ms), (1, 1, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn clear_restarts_the_clock_but_keeps_live_requests_in_flight() {
        let r = Recorder::new(Instant::now());
        let live = r.arrive(Instant::now());
        let _gone = r.arrive(Instant::now());
        r.status(503);
        r.reset_connection();
        advance(Duration::from_secs(1)).await;
        r.clear(Instant::now());
        let s = r.snapshot(Instant::now());
        assert_eq!((s.elapsed_ms, s.requests, s.resets), (0, 0, 0));
        assert!(s.by_status.is_empty() && s.arrivals_per_100ms.is_empty());
        assert_eq!(s.max_in_flight, 2);
        drop(live);
        let _next = r.arrive(Instant::now());
        assert_eq!(r.snapshot(Instant::now()).max_in_flight, 2);
    }
}
