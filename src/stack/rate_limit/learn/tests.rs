//! The pacers driven in virtual time against an in-memory token bucket that answers like
//! OpenAI (or Anthropic, or Azure), with `tokio::time::pause()`.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use tokio::time::Instant;

use super::*;

/// The provider's bucket: capacity, refill per second, continuous.
struct Model {
    capacity: f64,
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl Model {
    fn new(capacity: f64, rate: f64) -> Self {
        Self {
            capacity,
            rate,
            tokens: capacity,
            last: Instant::now(),
        }
    }
    /// An arrival: (accepted, headers as OpenAI sends them).
    fn arrive(&mut self, now: Instant) -> (bool, HeaderMap) {
        self.tokens = (self.tokens + self.rate * now.duration_since(self.last).as_secs_f64())
            .min(self.capacity);
        self.last = now;
        let ok = self.tokens >= 1.0;
        if ok {
            self.tokens -= 1.0;
        }
        let mut h = HeaderMap::new();
        let reset_ms = ((self.capacity - self.tokens) / self.rate * 1000.0).ceil();
        h.insert("x-ratelimit-limit-requests", (self.capacity as u64).into());
        h.insert(
            "x-ratelimit-remaining-requests",
            (self.tokens.floor() as u64).into(),
        );
        h.insert(
            "x-ratelimit-reset-requests",
            format!("{reset_ms}ms").parse().unwrap(),
        );
        (ok, h)
    }
}

/// Drive `clients` always-busy clients through a pacer for `secs`, changing the model's rate
/// at `change`. Returns (accepted per second series, throttles).
async fn drive(
    model: &mut Model,
    secs: u64,
    change: Option<(u64, f64)>,
    with_headers: bool,
) -> (Vec<u32>, u32, Pacer) {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    let service = Duration::from_millis(100);
    let mut in_flight: Vec<(Instant, Ticket, bool, HeaderMap)> = Vec::new();
    let mut per_second = vec![0u32; secs as usize];
    let mut throttles = 0;
    let step = Duration::from_millis(5);
    while start.elapsed() < Duration::from_secs(secs) {
        let now = Instant::now();
        if let Some((at, rate)) = change {
            if now.duration_since(start) >= Duration::from_secs(at) {
                model.rate = rate;
            }
        }
        // Answers due now.
        let (due, rest): (Vec<_>, Vec<_>) = in_flight.into_iter().partition(|(t, ..)| *t <= now);
        in_flight = rest;
        for (_, ticket, ok, headers) in due {
            let report = if with_headers {
                report(&headers, Kind::Requests, SystemTime::now())
            } else {
                None
            };
            pacer.observe(
                ticket,
                if ok { Answer::Ok } else { Answer::RateLimited },
                report,
                now,
            );
        }
        // Send whatever the pacer admits (the clients always have work).
        while let Ok(ticket) = pacer.try_acquire(1.0, now) {
            let (ok, headers) = model.arrive(now);
            if ok {
                per_second[now.duration_since(start).as_secs() as usize] += 1;
            } else {
                throttles += 1;
            }
            let answer_at = if ok {
                now + service
            } else {
                now + Duration::from_millis(1)
            };
            in_flight.push((answer_at, ticket, ok, headers));
        }
        tokio::time::advance(step).await;
    }
    (per_second, throttles, pacer)
}

#[tokio::test(start_paused = true)]
async fn steady_limit_is_learned_within_the_first_second() {
    let mut model = Model::new(50.0, 20.0);
    let (per_second, throttles, pacer) = drive(&mut model, 10, None, true).await;
    assert_eq!(pacer.source(), Source::Headers);
    assert!(
        (pacer.rate() - 20.0 * 0.97).abs() < 1.0,
        "learned rate {}",
        pacer.rate()
    );
    assert!(throttles <= 2, "{throttles} throttles");
    // After the first second (burst spent), throughput sits just under the true 20/s.
    for (s, n) in per_second.iter().enumerate().skip(2) {
        assert!(
            (17..=21).contains(n),
            "second {s}: {n} accepted ({per_second:?})"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_halved_limit_is_followed_within_two_seconds() {
    let mut model = Model::new(50.0, 40.0);
    let (per_second, throttles, pacer) = drive(&mut model, 12, Some((5, 20.0)), true).await;
    assert!(
        (pacer.rate() - 20.0 * 0.97).abs() < 1.5,
        "learned rate {}",
        pacer.rate()
    );
    for (s, n) in per_second.iter().enumerate().skip(7) {
        assert!(
            (17..=21).contains(n),
            "second {s}: {n} accepted after the change ({per_second:?})"
        );
    }
    assert!(throttles <= 5, "{throttles} throttles around the change");
}

#[tokio::test(start_paused = true)]
async fn without_headers_aimd_converges_below_the_true_rate() {
    let mut model = Model::new(50.0, 20.0);
    let (per_second, throttles, pacer) = drive(&mut model, 30, None, false).await;
    assert_eq!(pacer.source(), Source::Aimd);
    let tail: u32 = per_second[20..].iter().sum();
    let tail_rate = f64::from(tail) / 10.0;
    assert!(
        (10.0..=20.5).contains(&tail_rate),
        "accepted {tail_rate}/s in the last 10 s"
    );
    // Throttles keep happening (AIMD probes), but far fewer than the work sent.
    assert!(throttles < 150, "{throttles} throttles in 30 s");
}

#[test]
fn header_shapes_and_garbage() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_740_435_900);
    let h = |pairs: &[(&str, &str)]| -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                )
            })
            .collect()
    };
    let anthropic = h(&[
        ("anthropic-ratelimit-requests-limit", "1000"),
        ("anthropic-ratelimit-requests-remaining", "999"),
        ("anthropic-ratelimit-requests-reset", "2025-02-24T22:25:30Z"),
    ]);
    let r = report(&anthropic, Kind::Requests, now).unwrap();
    assert_eq!((r.limit, r.remaining), (1000.0, 999.0));
    assert_eq!(r.reset, Some(Duration::from_secs(30)));
    let azure = h(&[
        ("x-ratelimit-limit-tokens", "60000"),
        ("x-ratelimit-remaining-tokens", "59000"),
        ("x-ratelimit-reset-tokens", "17"),
    ]);
    assert_eq!(
        report(&azure, Kind::Tokens, now).unwrap().reset,
        Some(Duration::from_secs(17))
    );
    for garbage in [
        h(&[
            ("x-ratelimit-limit-requests", "-1"),
            ("x-ratelimit-remaining-requests", "-1"),
        ]),
        h(&[
            ("x-ratelimit-limit-requests", "10"),
            ("x-ratelimit-remaining-requests", "99"),
        ]),
        h(&[
            ("x-ratelimit-limit-requests", "lots"),
            ("x-ratelimit-remaining-requests", "1"),
        ]),
        h(&[
            ("x-ratelimit-limit-requests", "NaN"),
            ("x-ratelimit-remaining-requests", "1"),
        ]),
        HeaderMap::new(),
    ] {
        assert_eq!(report(&garbage, Kind::Requests, now), None, "{garbage:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn per_minute_reports_learn_their_floor_from_the_first_429() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    // limit 1200 "per minute", but the real bucket is empty at remaining 1150.
    let r = Report {
        limit: 1200.0,
        remaining: 1150.0,
        reset: Some(Duration::from_millis(2500)),
    };
    pacer.observe(ticket, Answer::RateLimited, Some(r), now);
    assert_eq!(pacer.burst(), 50.0, "burst = limit - floor");
    assert!(
        pacer.try_acquire(1.0, now).is_err(),
        "the level is at the floor: wait"
    );
}

#[tokio::test(start_paused = true)]
async fn reported_headroom_is_spent_only_as_fast_as_answers_confirm_it() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    // A per-minute style report: 1199 "remaining", nothing yet says the real burst is that big.
    let r = Report {
        limit: 1200.0,
        remaining: 1199.0,
        reset: Some(Duration::from_millis(50)),
    };
    pacer.observe(ticket, Answer::Ok, Some(r), now);
    let mut admitted = 0;
    while pacer.try_acquire(1.0, now).is_ok() {
        admitted += 1;
    }
    assert!(
        admitted <= 11,
        "{admitted} admitted on one unconfirmed report"
    );
}

#[tokio::test(start_paused = true)]
async fn an_overload_529_does_not_teach_a_floor() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    let r = Report {
        limit: 1000.0,
        remaining: 999.0,
        reset: Some(Duration::from_millis(1)),
    };
    pacer.observe(ticket, Answer::Overloaded, Some(r), now);
    assert_eq!(pacer.burst(), 1000.0, "a 529 says nothing about our bucket");
}

#[tokio::test(start_paused = true)]
async fn whole_second_resets_average_out() {
    // Anthropic-style: 1000/s true, resets rounded up to whole seconds.
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 1000, 1.0, now);
    for used in [1.0, 2.0, 500.0, 900.0, 3.0] {
        let ticket = pacer.try_acquire(1.0, now).unwrap();
        let reset = Duration::from_secs_f64((used / 1000.0_f64).ceil());
        pacer.observe(
            ticket,
            Answer::Ok,
            Some(Report {
                limit: 1000.0,
                remaining: 1000.0 - used,
                reset: Some(reset),
            }),
            now,
        );
    }
    assert!(
        pacer.rate() > 800.0,
        "learned {} per second, true 1000",
        pacer.rate()
    );
}

#[tokio::test(start_paused = true)]
async fn slow_start_without_any_signal_ends_ungated() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    for _ in 0..5000 {
        now += Duration::from_millis(1);
        if let Ok(ticket) = pacer.try_acquire(1.0, now) {
            pacer.observe(ticket, Answer::Ok, None, now);
        }
    }
    assert_eq!(pacer.source(), Source::None);
}
