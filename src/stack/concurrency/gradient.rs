//! Adaptive concurrency for backends that queue instead of answering 429 (vLLM, llama.cpp,
//! Ollama, TGI below its own cap): a delay-based window in the manner of TCP Vegas, so the
//! queue stays in corral (FIFO, bounded, deadline-aware, visible in the metrics) and not in the
//! backend, where nothing can reorder, shed or even see it.
//!
//! # What it learns from
//!
//! One [`Sample`] per answered request, taken by the window when the first byte of the
//! response body passes (a stream's first token; a complete answer's body, which comes with
//! its head; the head alone says nothing for a stream, which vLLM starts before scheduling
//! it): the time since the request went out, past its slot and the gates below it (the rate
//! limiter's ramp, the breaker), so corral's own waits are excluded; how many slots were held
//! when it got its own; and whether requests were waiting for a slot. Only 2xx answers to
//! first attempts are sampled: a retried request's time includes its backoff, and a fast 400
//! or 503 says nothing about the backend's queue.
//!
//! # The model and the target
//!
//! A backend with `S` slots, service time `T` and an unbounded FIFO queue answers, with `W`
//! requests in flight, after `T × max(1, W / S)`. With `base` the no-load round trip (`T`) and
//! `srtt` the latency averaged over the last round trip, Vegas reads the backend's queue as
//! `W × (1 − base / srtt)`, and the window aims at
//!
//! ```text
//! target = limit × tolerance × base / srtt   ⇒   limit = tolerance × S,  srtt = tolerance × T
//! ```
//!
//! that is, every slot busy plus a queue of `(tolerance − 1) × S` requests in the backend, each
//! waiting `(tolerance − 1) × T` there. The default tolerance of 1.25 keeps that queue at a
//! quarter of the slot count: 16 slots of 200 ms give a window of 20 and 50 ms of waiting in the
//! backend, enough that a freed slot never idles while corral's next request crosses the
//! network. The former gradient shrank only past twice the baseline, so the backend could hold a
//! whole extra service time: with 500 clients at once against 16 slots it took 1.25x the
//! physical bound (500 / 16 × 200 ms = 6.25 s) and requests waited 1.2 s (p99) in the backend.
//! This one takes 1.02x, with 200 ms at most in the backend (one service time, while slow start
//! overshoots), and settles at 20 (`tests.rs` runs that model in virtual time).
//!
//! # How it moves
//!
//! - **Steps**: each answer moves the limit `GAIN × (target − limit) / limit`, about half the gap
//!   per round trip whatever the request rate. Within tolerance the target is at least
//!   `limit + 1`, and after a whole round trip within 5% of the baseline (nothing queued in the
//!   backend: others sharing it left, or it got faster) at least `2 × limit`, half the window
//!   more per round trip. It grows only while the window is the bottleneck (requests wait for
//!   a slot, or every slot is held): an idle window proves nothing, and must not wake up huge.
//! - **Slow start**: from `initial_concurrency`, +1 per answer within tolerance (doubling per
//!   round trip) but never past twice the most requests seen answered at the baseline, until
//!   `srtt` leaves tolerance; then the limit halves (the queue seen was made by the window of a
//!   round trip ago, half the present one) and answers to requests sent before are ignored.
//!   It halves down to the initial window at most: when that was already more than the
//!   backend's slots, the steps shrink it from there on the answers it gets.
//! - **Baseline**: the lowest `srtt` (a mean over a round trip, not the fastest answer: LLM
//!   answers vary, and a minimum would read that variance as a queue and starve the backend).
//!   The first one comes from the first four answers, which are the fastest of their round, so
//!   it is checked soon: unless a whole round trip averages within half the tolerance of it, or
//!   half its answers come within 5% of it (the rest queued behind an initial window larger
//!   than the slots), the window probes after [`VERIFY_ROUNDS`] round trips.
//! - **Probes**: at equilibrium every request queues a little, so no answer shows the no-load
//!   time again; a backend can also become slower for good (longer prompts), which a window can
//!   only read as a queue and shrink for. So the window probes when `srtt` has not come within
//!   5% of `base` for [`PROBE_ROUNDS`] round trips, or has stayed out of tolerance, and not
//!   fallen by 5% over a round trip, for [`STUCK_ROUNDS`] while the window fell below 3/4 of
//!   what was answered at the baseline (a latency still falling is a window still shrinking
//!   toward its part of a backend others load too: four corrals, all probing at once, left its
//!   slots half idle).
//!   It drops to 3/4 of the backend's estimated slots (`limit × base / srtt`); once a request
//!   sent after the drop is answered nothing is queued in the backend, and two probe windows'
//!   worth of answers later the new `base` is Little's law over that stretch (`in flight ×
//!   time / answers`: unbiased, where the mean of the answers would favour the fast ones, which
//!   come back first). The limit then returns, or if the baseline rose, slow start regrows it.
//!   Cost: about one round trip at 3/4 of the slots every 50.

use std::time::Duration;

use tokio::time::Instant;

/// Round trips without `srtt` near `base` before the window probes for a fresh one.
pub const PROBE_ROUNDS: f64 = 50.0;
/// Round trips before a baseline that only the first answers showed is checked by a probe.
pub const VERIFY_ROUNDS: f64 = 4.0;
/// `srtt` within this factor of `base` counts as a fresh no-load measurement.
const FRESH: f64 = 1.05;
/// During a probe, the limit is this fraction of the estimated backend slots.
const PROBE_DEPTH: f64 = 0.75;
/// Round trips with latency above tolerance, the window shrinking all along, before the
/// baseline itself is doubted and probed.
pub const STUCK_ROUNDS: f64 = 3.0;
/// ... and the window below this fraction of the most requests seen answered at the baseline.
const STUCK_SHRINK: f64 = 0.75;
/// Out of tolerance, `srtt` below this fraction of a round trip ago is still falling.
const FALLING: f64 = 0.95;
/// Answers averaged before the first baseline (the first answers are the fastest, so it is
/// low rather than high; a low baseline is found out by the probe, a high one would not be).
const WARMUP: f64 = 4.0;
/// Fraction of the gap to the target closed per round trip (about).
const GAIN: f64 = 0.5;

/// What the window tells the limit about one answered request.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// When the request got its slot.
    pub sent: Instant,
    /// From `sent` to the first byte of the response body.
    pub rtt: Duration,
    /// Slots held just after it got its own (itself included).
    pub in_flight: u32,
    /// Whether the window was the bottleneck when the answer came (requests waiting for a
    /// slot, or every slot held). The limit grows only then.
    pub saturated: bool,
}

#[derive(Debug)]
struct Probe {
    /// When the limit went down; answers to requests sent before are still queued behind the
    /// old window.
    started: Instant,
    /// The first answer to a request sent after `started`: from then on nothing is queued in
    /// the backend, and the answers are counted for two round trips.
    clean_since: Option<Instant>,
    /// Answers since `clean_since`.
    answered: u32,
    /// Whether the window was the bottleneck for all of them (in flight = the probe's limit).
    saturated: bool,
    /// Latencies of the answers since `clean_since` to requests sent during the probe.
    sum: f64,
    count: u32,
    resume: f64,
}

#[derive(Debug)]
pub struct Gradient {
    limit: f64,
    min: f64,
    max: f64,
    tolerance: f64,
    /// Latency averaged over about one round trip (seconds).
    srtt: f64,
    /// Answers averaged into `srtt` (it is a plain mean until there are `limit` of them).
    count: f64,

    /// The no-load round trip: the lowest `srtt` since the last probe, or what it measured.
    base: f64,
    /// When `srtt` last came within `FRESH` of `base`.
    base_seen: Option<Instant>,
    /// Whether `base` has been seen again by a full round trip's average (or a probe), and
    /// is not just the first few answers (the fastest ones).
    confirmed: bool,
    /// Answers after the warm-up within `FRESH` of `base`.
    fresh: f64,
    /// When `srtt` was last within tolerance, or out of it fell over a round trip: a latency
    /// still falling is a window still shrinking toward its part, not a stuck one.
    within_seen: Option<Instant>,
    /// Out of tolerance: when and at what `srtt` the last round trip began.
    mark: Option<(Instant, f64)>,
    /// Since when `srtt` has been within `FRESH` of `base` (nothing queued in the backend).
    idle_since: Option<Instant>,
    slow_start: bool,
    /// The window before anything was learned: leaving slow start undoes the doublings made
    /// since, never more.
    initial: f64,
    /// Answers to requests sent before this describe a window that slow start has already
    /// halved: they are ignored.
    ignore_before: Option<Instant>,
    /// The most requests seen in flight for an answer within `FRESH` of `base` (since the
    /// last probe): what the backend took without queueing.
    proven: f64,
    probe: Option<Probe>,
}

impl Gradient {
    /// A limit starting at `initial` (in slow start), always within `min..=max`; it aims at
    /// latency `tolerance` times the no-load round trip (at least 1.0).
    pub fn new(initial: u32, min: u32, max: u32, tolerance: f64) -> Self {
        let (min, max) = (f64::from(min.max(1)), f64::from(max.max(min).max(1)));
        let initial = f64::from(initial).clamp(min, max);
        Self {
            limit: initial,
            min,
            max,
            tolerance: tolerance.max(1.0),
            srtt: 0.0,
            count: 0.0,
            base: 0.0,
            base_seen: None,
            confirmed: false,
            fresh: 0.0,
            within_seen: None,
            mark: None,
            idle_since: None,
            slow_start: true,
            initial,
            ignore_before: None,
            proven: 0.0,
            probe: None,
        }
    }

    /// The current limit.
    pub fn limit(&self) -> u32 {
        self.limit as u32
    }

    /// The no-load round trip learned so far.
    pub fn base_rtt(&self) -> Option<Duration> {
        (self.base > 0.0).then(|| Duration::from_secs_f64(self.base))
    }

    /// Whether the window is still doubling per round trip.
    pub fn in_slow_start(&self) -> bool {
        self.slow_start
    }

    /// Whether the window is down for a baseline probe.
    pub fn probing(&self) -> bool {
        self.probe.is_some()
    }

    fn set(&mut self, limit: f64) -> u32 {
        self.limit = limit.clamp(self.min, self.max);
        self.limit()
    }

    /// Learn from one answer; returns the new limit.
    pub fn sample(&mut self, s: Sample) -> u32 {
        let now = s.sent + s.rtt;
        let rtt = s.rtt.as_secs_f64().max(1e-6);
        if self.probe.is_some() {
            return self.probe_sample(&s, rtt, now);
        }
        if self.ignore_before.is_some_and(|t| s.sent <= t) {
            return self.limit();
        }
        let in_flight = f64::from(s.in_flight.max(1));
        self.count += 1.0;
        self.srtt += (rtt - self.srtt) / self.count.min(self.limit).max(1.0);
        if self.count < WARMUP {
            // Too few answers for a baseline: nothing to compare with yet.
            self.proven = self.proven.max(in_flight);
            return self.limit();
        }
        if self.base == 0.0 || self.srtt < self.base {
            self.base = self.srtt;
        }
        if self.srtt <= self.base * FRESH {
            self.base_seen = Some(now);
        }
        if rtt <= self.base * FRESH {
            self.proven = self.proven.max(in_flight);
            self.fresh += 1.0;
        }
        // A whole round trip's average within half the tolerance of it, or most of its answers
        // at the baseline (the rest queued behind a window larger than the slots): the
        // warm-up's baseline was not just the fastest few answers.
        if self.count >= self.limit
            && (self.srtt <= self.base * (1.0 + self.tolerance) / 2.0
                || 2.0 * self.fresh >= self.count - WARMUP)
        {
            self.confirmed = true;
        }
        let within = self.srtt <= self.base * self.tolerance;
        self.track_tolerance(within, now);
        if self.slow_start {
            if !within {
                // The first queue seen was made by the window of a round trip ago: half this,
                // but not below where slow start began (the initial window may itself be
                // what made the queue: the steps below shrink it then). Answers to requests
                // sent before describe a larger window, unless it never grew.
                self.slow_start = false;
                if self.limit > self.initial {
                    self.ignore_before = Some(now);
                }
                return self.set((self.limit / 2.0).max(self.initial).min(self.limit));
            }
            if s.saturated && self.limit < 2.0 * self.proven {
                return self.set(self.limit + 1.0);
            }
            return self.limit();
        }
        let since =
            |seen: Option<Instant>| seen.map_or(0.0, |t| now.duration_since(t).as_secs_f64());
        let rounds = if self.confirmed {
            PROBE_ROUNDS
        } else {
            VERIFY_ROUNDS
        };
        let stale = since(self.base_seen) > rounds * self.base;
        let stuck = since(self.within_seen) > STUCK_ROUNDS * self.srtt
            && self.limit < STUCK_SHRINK * self.proven;
        if stale || stuck {
            self.probe = Some(Probe {
                started: now,
                clean_since: None,
                answered: 0,
                saturated: true,
                sum: 0.0,
                count: 0,
                resume: self.limit,
            });
            let slots = self.limit * self.base / self.srtt;
            return self.set((slots * PROBE_DEPTH).min(self.limit));
        }
        let mut target = self.limit * self.tolerance * self.base / self.srtt;
        if within {
            target = target.max(self.limit + 1.0);
        }
        if self.idle_for_a_round(now) {
            // Nothing queued in the backend for a whole round trip: it has slots idle (others
            // sharing it left, or it got faster). Half the window more per round trip, not an
            // eighth (four corrals on one backend: the last two to finish regrew from a
            // quarter of its slots for half a second, 1.08x the bound).
            target = target.max(2.0 * self.limit);
        }
        if target > self.limit && !s.saturated {
            return self.limit();
        }
        self.set(self.limit + GAIN * (target - self.limit) / self.limit.max(1.0))
    }

    /// When `srtt` was last within tolerance (`within`), or out of it lower by `FALLING` than a
    /// round trip ago: the window is then still shrinking toward its part of a backend that
    /// others load too, not stuck.
    fn track_tolerance(&mut self, within: bool, now: Instant) {
        if within {
            self.within_seen = Some(now);
            self.mark = None;
            return;
        }
        match self.mark {
            Some((at, was)) if now.duration_since(at).as_secs_f64() >= self.srtt => {
                if self.srtt < was * FALLING {
                    self.within_seen = Some(now);
                }
                self.mark = Some((now, self.srtt));
            }
            None => self.mark = Some((now, self.srtt)),
            Some(_) => {}
        }
    }

    /// Whether `srtt` has been within `FRESH` of `base` (nothing queued in the backend) for a
    /// whole round trip.
    fn idle_for_a_round(&mut self, now: Instant) -> bool {
        if self.srtt > self.base * FRESH {
            self.idle_since = None;
            return false;
        }
        let since = *self.idle_since.get_or_insert(now);
        now.duration_since(since).as_secs_f64() >= self.srtt
    }

    fn probe_sample(&mut self, s: &Sample, rtt: f64, now: Instant) -> u32 {
        let held = self.limit.floor().max(1.0);
        let probe = self.probe.as_mut().expect("probing");
        let Some(since) = probe.clean_since else {
            if s.sent >= probe.started {
                // Sent once the window was down: nothing queued ahead of it in the backend.
                probe.clean_since = Some(now);
            }
            return self.limit();
        };
        if now <= since {
            return self.limit();
        }
        probe.answered += 1;
        probe.saturated &= s.saturated;
        if s.sent >= probe.started {
            probe.sum += rtt;
            probe.count += 1;
        }
        if f64::from(probe.answered) < 2.0 * held {
            return self.limit();
        }
        let elapsed = now.duration_since(since).as_secs_f64();
        let mean = probe.sum / f64::from(probe.count.max(1));
        // Little's law over the clean stretch: `held` requests in flight all along, answered at
        // this rate, each took `held * elapsed / answered` on average. (The mean of the answers
        // themselves would favour the fast ones: they are the first to come back.)
        let base = if probe.saturated {
            held * elapsed / f64::from(probe.answered)
        } else {
            mean
        };
        let (old, resume) = (self.base, probe.resume);
        self.probe = None;
        self.base = base;
        self.srtt = base;
        self.count = held;
        self.base_seen = Some(now);
        self.confirmed = true;
        self.within_seen = Some(now);
        self.mark = None;
        self.idle_since = None;
        self.proven = held;
        // The baseline was too low (a slower backend, or the first answers were the fastest):
        // the window shrank for nothing, so regrow it quickly.
        self.slow_start = base > old * FRESH;
        self.set(if self.slow_start { self.limit } else { resume })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Answers from a backend with `slots` slots of `t` and a FIFO queue, `limit` in flight all
    /// along (`saturated`) or `demand` (not), a round trip's worth per round trip.
    struct Model {
        g: Gradient,
        clock: Instant,
    }

    impl Model {
        fn new(g: Gradient) -> Self {
            Self {
                g,
                clock: Instant::now(),
            }
        }

        fn answer(&mut self, slots: u32, t: Duration, demand: Option<u32>) -> u32 {
            let in_flight = demand.unwrap_or(self.g.limit()).max(1);
            let rtt = t.mul_f64((f64::from(in_flight) / f64::from(slots)).max(1.0));
            self.answer_in(rtt, in_flight, demand.is_none())
        }

        /// One answer after `rtt`, `in_flight` requests in flight (a round trip's worth of
        /// answers per round trip).
        fn answer_in(&mut self, rtt: Duration, in_flight: u32, saturated: bool) -> u32 {
            self.clock += rtt / in_flight;
            self.g.sample(Sample {
                sent: self.clock - rtt,
                rtt,
                in_flight,
                saturated,
            })
        }

        fn run(&mut self, answers: usize, slots: u32, t: Duration) -> u32 {
            for _ in 0..answers {
                self.answer(slots, t, None);
            }
            self.g.limit()
        }
    }

    #[test]
    fn settles_at_tolerance_times_the_slots() {
        for slots in [4, 16, 64, 256] {
            let mut m = Model::new(Gradient::new(8, 1, 4096, 1.25));
            let limit = m.run(200 * slots as usize, slots, 200 * MS);
            let want = slots..=slots * 3 / 2;
            assert!(want.contains(&limit), "{slots} slots: {limit}");
            assert!(!m.g.in_slow_start());
            let base = m.g.base_rtt().unwrap();
            assert!(base.abs_diff(200 * MS) < 10 * MS, "{base:?}");
        }
    }

    #[test]
    fn an_idle_window_does_not_grow() {
        // Three requests at a time, nobody waiting: flat latency proves nothing beyond three.
        let mut m = Model::new(Gradient::new(8, 1, 1024, 1.25));
        for _ in 0..1000 {
            assert_eq!(m.answer(16, 100 * MS, Some(3)), 8);
        }
    }

    #[test]
    fn stays_within_min_and_max() {
        let mut m = Model::new(Gradient::new(4, 2, 8, 1.25));
        assert_eq!(m.run(1000, 100, 10 * MS), 8, "the ceiling");
        for _ in 0..1000 {
            // A backend slower than anything the window can cure: the floor.
            assert!(m.answer(1, 10 * MS, None) >= 2);
        }
        assert_eq!(Gradient::new(100, 2, 8, 1.25).limit(), 8);
        assert_eq!(Gradient::new(0, 2, 8, 1.25).limit(), 2);
    }

    #[test]
    fn a_slower_backend_is_relearned_by_a_probe() {
        let mut m = Model::new(Gradient::new(8, 1, 1024, 1.25));
        assert!((16..=24).contains(&m.run(2000, 16, 100 * MS)));
        // Three times slower for good: the window shrinks (it cannot tell yet), gets stuck
        // above tolerance, probes, and comes back with the new baseline.
        let mut probed = false;
        for _ in 0..4000 {
            m.answer(16, 300 * MS, None);
            probed |= m.g.probing();
        }
        assert!(probed);
        let base = m.g.base_rtt().unwrap();
        assert!(base.abs_diff(300 * MS) < 15 * MS, "{base:?}");
        assert!((16..=24).contains(&m.g.limit()), "{}", m.g.limit());
    }

    #[test]
    fn a_faster_backend_is_relearned_too() {
        let mut m = Model::new(Gradient::new(8, 1, 1024, 1.25));
        m.run(2000, 16, 300 * MS);
        // Three times faster: the window grows while latency stays under the old baseline's
        // tolerance, so the backend queues, at worst, what it did before; the next probe
        // brings the baseline down.
        let mut worst = 0;
        for _ in 0..6000 {
            worst = worst.max(m.answer(16, 100 * MS, None));
        }
        assert!(worst <= 16 * 4, "{worst}");
        let base = m.g.base_rtt().unwrap();
        assert!(base.abs_diff(100 * MS) < 10 * MS, "{base:?}");
        assert!((16..=24).contains(&m.g.limit()), "{}", m.g.limit());
    }

    #[test]
    fn a_window_left_alone_regrows_by_half_per_round_trip() {
        // Others shared the backend's 16 slots: this window settled at its part of them.
        let mut m = Model::new(Gradient::new(8, 1, 1024, 1.25));
        m.run(2000, 4, 100 * MS);
        let part = m.g.limit();
        assert!((4..=6).contains(&part), "{part}");
        // They left: a round trip with nothing queued, then half again per round trip (an
        // eighth, by the steps alone: 4 round trips to 6.4 where 16 slots stand idle).
        let mut rounds = 0;
        while m.g.limit() < 16 {
            let answers = m.g.limit();
            m.run(answers as usize, 16, 100 * MS);
            rounds += 1;
            assert!(rounds <= 6, "{rounds} round trips: {}", m.g.limit());
        }
        assert!(m.g.limit() <= 32, "{}", m.g.limit());
    }

    #[test]
    fn a_latency_still_falling_is_not_stuck() {
        // Others load the backend: this window's answers take three times the baseline, and
        // less each round trip as the windows shrink toward their parts. However low this one
        // falls meanwhile, it is not stuck while the latency falls: a probe would drop it
        // further just as the windows meet their parts (four corrals at once, all probing).
        let mut m = Model::new(Gradient::new(8, 1, 1024, 1.25));
        m.run(2000, 16, 100 * MS);
        let mut latency = 300.0;
        for _ in 0..12 {
            for _ in 0..m.g.limit() {
                let rtt = Duration::from_secs_f64(latency / 1000.0);
                m.answer_in(rtt, m.g.limit(), true);
                assert!(
                    !m.g.probing(),
                    "probed at {latency:.0} ms, limit {}",
                    m.g.limit()
                );
            }
            latency *= 0.9;
        }
    }
}
