//! The pacers driven in virtual time against an in-memory token bucket that answers like
//! OpenAI (or Anthropic, or Azure), with `tokio::time::pause()`.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use tokio::time::Instant;

use super::*;
use crate::provider::report;

/// How the model's headers describe its bucket.
#[derive(Clone, Copy, PartialEq)]
enum Style {
    /// OpenAI-shaped, `limit` = capacity: honest.
    Capacity,
    /// `limit` = rate x 60, `remaining` shifted by the same offset: honest per minute.
    PerMinute,
    /// `limit` = rate x 60 and `remaining` from a per-minute shadow bucket, while a small
    /// bucket enforces: the level reported is a lie.
    Quantized,
    /// Resets in whole seconds, rounded up (Anthropic's instants, Azure's integers).
    WholeSeconds,
    /// No headers at all.
    None,
}

/// The provider's bucket: capacity, refill per second, continuous.
struct Model {
    capacity: f64,
    rate: f64,
    tokens: f64,
    /// The per-minute shadow reported in `Quantized` style.
    shadow: f64,
    last: Instant,
    style: Style,
}

impl Model {
    fn new(capacity: f64, rate: f64) -> Self {
        Self::styled(capacity, rate, Style::Capacity)
    }
    fn styled(capacity: f64, rate: f64, style: Style) -> Self {
        Self {
            capacity,
            rate,
            tokens: capacity,
            shadow: rate * 60.0,
            last: Instant::now(),
            style,
        }
    }
    /// An arrival: (accepted, headers as the provider sends them, retry hint on a refusal).
    fn arrive(&mut self, now: Instant) -> (bool, HeaderMap, Option<Duration>) {
        let dt = now.duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + self.rate * dt).min(self.capacity);
        self.shadow = (self.shadow + self.rate * dt).min(self.rate * 60.0);
        self.last = now;
        let ok = self.tokens >= 1.0;
        if ok {
            self.tokens -= 1.0;
            self.shadow = (self.shadow - 1.0).max(0.0);
        }
        let hint = (!ok).then(|| Duration::from_secs_f64((1.0 - self.tokens) / self.rate));
        let (limit, remaining, missing) = match self.style {
            Style::Capacity | Style::WholeSeconds | Style::None => {
                (self.capacity, self.tokens, self.capacity - self.tokens)
            }
            Style::PerMinute => {
                let limit = self.rate * 60.0;
                (
                    limit,
                    self.tokens + limit - self.capacity,
                    self.capacity - self.tokens,
                )
            }
            Style::Quantized => (
                self.rate * 60.0,
                self.shadow,
                self.rate * 60.0 - self.shadow,
            ),
        };
        let mut h = HeaderMap::new();
        if self.style == Style::None {
            return (ok, h, None);
        }
        let reset = match self.style {
            Style::WholeSeconds => format!("{}s", (missing / self.rate).ceil()),
            _ => format!("{}ms", (missing / self.rate * 1000.0).ceil()),
        };
        h.insert("x-ratelimit-limit-requests", (limit.round() as u64).into());
        h.insert(
            "x-ratelimit-remaining-requests",
            (remaining.floor() as u64).into(),
        );
        h.insert("x-ratelimit-reset-requests", reset.parse().unwrap());
        (ok, h, hint)
    }
}

/// What a run of [`drive_fleet`] saw.
struct Run {
    /// Accepted per second, all pacers together.
    per_second: Vec<u32>,
    throttles: u32,
    pacers: Vec<Pacer>,
}

/// Drive one pacer; see [`drive_fleet`].
async fn drive(
    model: &mut Model,
    secs: u64,
    change: Option<(u64, f64)>,
    with_headers: bool,
) -> (Vec<u32>, u32, Pacer) {
    if !with_headers {
        model.style = Style::None;
    }
    let mut run = drive_fleet(model, 1, secs, change).await;
    (run.per_second, run.throttles, run.pacers.remove(0))
}

/// Drive `replicas` pacers (corrals on one key), each with always-busy clients, against one
/// model bucket for `secs`, changing its rate at `change`. A 429 pauses the pacer that got it
/// for the hint (or the pacer's own estimate), as the partition does.
async fn drive_fleet(
    model: &mut Model,
    replicas: usize,
    secs: u64,
    change: Option<(u64, f64)>,
) -> Run {
    let start = Instant::now();
    let mut pacers: Vec<Pacer> = (0..replicas)
        .map(|_| Pacer::new(Kind::Requests, 10, 0.97, start))
        .collect();
    let mut paused = vec![start; replicas];
    let service = Duration::from_millis(100);
    let mut in_flight: Vec<(Instant, usize, Ticket, bool, HeaderMap, Option<Duration>)> =
        Vec::new();
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
        for (_, i, ticket, ok, headers, hint) in due {
            let r = report(&headers, Kind::Requests, SystemTime::now());
            let answer = if ok { Answer::Ok } else { Answer::RateLimited };
            pacers[i].observe(ticket, answer, r, now);
            if !ok {
                let pause = hint.or_else(|| pacers[i].time_for(1.0)).unwrap_or_default();
                paused[i] = paused[i].max(now + pause);
            }
        }
        // Send whatever each pacer admits (the clients always have work).
        for i in 0..replicas {
            if paused[i] > now {
                continue;
            }
            while let Ok(ticket) = pacers[i].try_acquire(1.0, now) {
                let (ok, headers, hint) = model.arrive(now);
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
                in_flight.push((answer_at, i, ticket, ok, headers, hint));
            }
        }
        tokio::time::advance(step).await;
    }
    Run {
        per_second,
        throttles,
        pacers,
    }
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
async fn without_headers_the_429s_alone_find_the_rate() {
    let mut model = Model::new(50.0, 20.0);
    let (per_second, throttles, pacer) = drive(&mut model, 30, None, false).await;
    assert_eq!(pacer.source(), Source::Aimd);
    let tail: u32 = per_second[5..].iter().sum();
    let tail_rate = f64::from(tail) / 25.0;
    assert!(
        (18.0..=20.5).contains(&tail_rate),
        "accepted {tail_rate}/s after the first 5 s ({per_second:?})"
    );
    // The throttle windows estimate the rate; probing upward costs a 429 now and then.
    assert!(throttles <= 40, "{throttles} throttles in 30 s");
}

/// Each world the learner must hold in, 30 s of always-busy clients: the
/// accepted rate after the start, and the 429s it took (the model answers in 100 ms).
async fn world(style: Style, capacity: f64, replicas: usize, change: Option<(u64, f64)>) -> Run {
    let mut model = Model::styled(capacity, 20.0, style);
    drive_fleet(&mut model, replicas, 30, change).await
}

fn rate_after(run: &Run, from: usize) -> f64 {
    let n = run.per_second.len() - from;
    f64::from(run.per_second[from..].iter().sum::<u32>()) / n as f64
}

#[tokio::test(start_paused = true)]
async fn quantized_enforcement_behind_a_per_minute_report() {
    // limit 1200/min reported, 20 per second enforced by a bucket of 20.
    let run = world(Style::Quantized, 20.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 15, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn self_consistent_per_minute_reports() {
    let run = world(Style::PerMinute, 50.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 25, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn whole_second_resets() {
    let run = world(Style::WholeSeconds, 50.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert_eq!(run.throttles, 0);
}

#[tokio::test(start_paused = true)]
async fn a_limit_that_drops_mid_run_is_followed() {
    let run = world(Style::Capacity, 50.0, 1, Some((10, 10.0))).await;
    let rate = rate_after(&run, 12);
    assert!(
        (9.0..=10.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 5, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn four_pacers_on_one_key_share_it() {
    // Each sees the whole key's headers; only the 429s show that others draw on it too.
    let run = world(Style::Capacity, 50.0, 4, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.0..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    // Without shared state the pacers find their shares by 429s: fewer than 1 in 5 sends.
    let sent = run.per_second.iter().sum::<u32>() + run.throttles;
    assert!(
        run.throttles * 5 <= sent,
        "{} throttles of {sent} sends",
        run.throttles
    );
    let sum: f64 = run.pacers.iter().map(Pacer::rate).sum();
    assert!(
        sum <= 40.0,
        "their paces add up to {sum}/s, the key has 20/s"
    );
}

/// A 429 while `remaining` shows headroom above the learned floor demotes the header model: the
/// level follows the 429s (empty), not the report, and the source says so.
#[tokio::test(start_paused = true)]
async fn a_report_caught_lying_is_demoted_then_trusted_again() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = |remaining: f64| Report {
        limit: 1200.0,
        remaining,
        reset: Some(Duration::from_secs_f64((1200.0 - remaining) / 20.0)),
        coarse: false,
    };
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, Some(report(1150.0)), now);
    assert_eq!(
        pacer.source(),
        Source::Headers,
        "the first 429 teaches a floor"
    );
    now += Duration::from_secs(2);
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, Some(report(1180.0)), now);
    assert_eq!(
        pacer.source(),
        Source::Observed,
        "30 above the floor: a lie"
    );
    // A report of lots of headroom no longer sets the level.
    now += Duration::from_millis(10);
    let t = pacer.try_acquire(1.0, now);
    assert!(t.is_err(), "empty after the 429, refilling at the pace");
    now += Duration::from_millis(100);
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report(1199.0)), now);
    let mut admitted = 0;
    while pacer.try_acquire(1.0, now).is_ok() {
        admitted += 1;
    }
    assert!(
        admitted <= 1,
        "{admitted} admitted on a report of 1199 remaining"
    );
    // After the probation without another such 429, the headers are believed again.
    now += PROBATION + Duration::from_secs(1);
    assert!(pacer.can_acquire(1.0, now));
    assert_eq!(pacer.source(), Source::Headers);
}

#[test]
fn the_unanswered_list_is_bounded_without_headers() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    // Answered without any report (no headers): each answer leaves the list.
    let t = pacer.try_acquire(1.0, now).unwrap();
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.observe(t, Answer::Ok, None, now);
    assert!(pacer.unanswered.is_empty());
    // Never answered (cancelled): the list keeps the newest MAX_UNANSWERED.
    for _ in 0..(MAX_UNANSWERED + 100) {
        pacer.admit(1.0, now);
    }
    assert_eq!(pacer.unanswered.len(), MAX_UNANSWERED);
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
        coarse: false,
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
        coarse: false,
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
        coarse: false,
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
                coarse: false,
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

/// A rounded reset under two seconds bounds the rate only from below: the bucket may refill in a
/// fraction of that second. Corrals sharing a key are not paced by it; a finer or longer reset
/// is shared.
#[tokio::test(start_paused = true)]
async fn a_rate_bounded_only_from_below_is_not_shared() {
    let now = Instant::now();
    let model = |used: f64, reset: Duration, coarse: bool| {
        let mut pacer = Pacer::new(Kind::Requests, 1000, 1.0, now);
        let ticket = pacer.try_acquire(1.0, now).unwrap();
        let r = Report {
            limit: 1000.0,
            remaining: 1000.0 - used,
            reset: Some(reset),
            coarse,
        };
        pacer.observe(ticket, Answer::Ok, Some(r), now);
        pacer.upstream_model()
    };
    assert_eq!(model(50.0, Duration::from_secs(1), true), None);
    assert_eq!(model(50.0, Duration::from_millis(1400), true), None);
    let (rate, burst, _) = model(500.0, Duration::from_secs(10), true).unwrap();
    assert_eq!((rate, burst), (50.0, 1000.0));
    let (rate, _, _) = model(50.0, Duration::from_millis(500), false).unwrap();
    assert_eq!(rate, 100.0);
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

#[tokio::test(start_paused = true)]
#[ignore = "diagnostic: prints each scenario's series"]
async fn print_scenarios() {
    for (name, style, replicas, change) in [
        ("capacity", Style::Capacity, 1, None),
        ("per-minute", Style::PerMinute, 1, None),
        ("quantized", Style::Quantized, 1, None),
        ("whole-seconds", Style::WholeSeconds, 1, None),
        ("none", Style::None, 1, None),
        ("drop", Style::Capacity, 1, Some((10, 10.0))),
        ("fleet4", Style::Capacity, 4, None),
        ("fleet4-none", Style::None, 4, None),
    ] {
        let capacity = if style == Style::Quantized {
            20.0
        } else {
            50.0
        };
        let mut model = Model::styled(capacity, 20.0, style);
        let run = drive_fleet(&mut model, replicas, 30, change).await;
        let rates: Vec<String> = run
            .pacers
            .iter()
            .map(|p| format!("{:.1}/{}", p.rate(), p.source().label()))
            .collect();
        println!(
            "{name:>14}: throttles {:>4} rates {rates:?} per second {:?}",
            run.throttles, run.per_second
        );
    }
}

/// An overload (529, or a 429 read as overload) moves no pace, with or without headers.
#[test]
fn an_overload_moves_no_pace() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    for _ in 0..10 {
        let t = pacer.try_acquire(1.0, now).unwrap();
        pacer.observe(t, Answer::Overloaded, None, now);
        now += Duration::from_millis(20);
    }
    assert_eq!(
        pacer.source(),
        Source::SlowStart,
        "no cut: still in slow start"
    );
    assert!(pacer.cap.is_none());
}

/// A cut never goes below what the upstream admitted over the last second, and after a long
/// named wait the successes double the pace per round trip back to where the cuts found it.
#[test]
fn a_cut_is_bounded_by_what_was_admitted_and_recovers_by_doubling() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, now);
    // 100 requests a second for a second, answered in 100 ms, all admitted.
    let mut in_flight = VecDeque::new();
    for ms in 0..1000u64 {
        now = Instant::now() + Duration::from_millis(ms);
        if ms % 10 == 0 {
            in_flight.push_back((now, pacer.try_acquire(1.0, now).unwrap()));
        }
        while in_flight
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= Duration::from_millis(100))
        {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, None, now);
        }
    }
    // Then a bare 429 (no headers): the cut keeps what the upstream admitted, about 90/s.
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, None, now);
    let cut = pacer.cap.unwrap();
    assert!(cut.rate >= 80.0, "cut to {} /s", cut.rate);
    // A storm of cuts: each a round trip apart, all answered 429.
    for _ in 0..5 {
        now += Duration::from_millis(100);
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now);
    }
    let low = pacer.cap.unwrap().rate;
    let before = pacer.cap.unwrap().before.unwrap();
    // Without a long wait named, the cut grows slowly (a bucket's edge); with one, it doubles.
    pacer.long_pause(STORM);
    // Successes sent after the last cut, answered in 100 ms: the pace doubles per round trip.
    let mut rate = low;
    for round in 0..12 {
        let sent = now;
        let n = (rate * 0.1).ceil().max(1.0) as usize;
        let tickets: Vec<_> = (0..n).map(|_| pacer.admit_anyway(1.0, sent)).collect();
        now += Duration::from_millis(100);
        for t in tickets {
            pacer.observe(t, Answer::Ok, None, now);
        }
        let next = pacer.cap.unwrap().rate;
        assert!(
            next >= (2.0 * rate).min(before) * 0.99,
            "round {round}: {rate} -> {next}"
        );
        rate = next;
    }
    assert!((rate - before).abs() < 1e-6, "back to {before}, at {rate}");
}

/// With nothing in flight for a while, one request goes whatever the level.
#[test]
fn a_lone_request_after_a_storm_goes_at_once() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    // Twenty 429s, nothing admitted: the pace is cut to its floor.
    for _ in 0..20 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now);
        now += Duration::from_millis(50);
    }
    assert!(pacer.try_acquire(1.0, now).is_err(), "busy: the pace holds");
    now += IDLE;
    assert!(pacer.try_acquire(1.0, now).is_ok(), "idle: one goes");
}

/// A request larger than the token bucket goes at once, charged nothing; one admitted past the
/// pace owes at most one burst.
#[test]
fn a_token_request_larger_than_the_bucket_goes_at_once_and_debt_is_bounded() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = Report {
        limit: 10_000.0,
        remaining: 9_000.0,
        reset: Some(Duration::from_secs(6)),
        coarse: false,
    };
    let t = pacer.try_acquire(100.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    let huge = pacer.try_acquire(2.0e9, now).expect("goes at once");
    assert_eq!(huge.cost(), 0.0, "charged nothing");
    for _ in 0..100 {
        pacer.admit_anyway(5_000.0, now);
    }
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// What the upstream counted settles the charge: an over-charge comes back to the level.
#[test]
fn usage_settles_what_was_charged() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = Report {
        limit: 10_000.0,
        remaining: 9_000.0,
        reset: Some(Duration::from_secs(6)),
        coarse: false,
    };
    let t = pacer.try_acquire(100.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    let t = pacer.admit_anyway(4_000.0, now);
    let charged = pacer.level;
    pacer.settle(t, 1_000.0, now);
    assert!(
        (pacer.level - (charged + 3_000.0)).abs() < 1e-6,
        "the 3000 over-charged came back: {} from {charged}",
        pacer.level
    );
}

/// An overload answered with a report leaves the confirmed window alone: only this bucket's
/// refusal halves it.
#[test]
fn an_overload_with_headers_leaves_the_confirmed_window_alone() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = Report {
        limit: 1000.0,
        remaining: 990.0,
        reset: Some(Duration::from_secs(1)),
        coarse: false,
    };
    for _ in 0..5 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::Ok, Some(report), now);
        now += Duration::from_millis(20);
    }
    let confirmed = pacer.verified;
    for _ in 0..12 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::Overloaded, Some(report), now);
        now += Duration::from_millis(20);
    }
    assert_eq!(pacer.verified, confirmed);
    assert!(pacer.cap.is_none(), "no cut");
}

/// A demoted tokens pacer keeps a burst of half a second of pace, but a request is oversize
/// (sent uncharged) only against the bucket the reports describe.
#[test]
fn a_demoted_tokens_pacer_still_charges_requests_that_fit_the_reported_bucket() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = |remaining: f64| Report {
        limit: 30_000.0,
        remaining,
        reset: Some(Duration::from_secs_f64((30_000.0 - remaining) / 500.0)),
        coarse: false,
    };
    let t = pacer.admit_anyway(100.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(1_000.0)), now);
    now += Duration::from_secs(2);
    let t = pacer.admit_anyway(100.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(20_000.0)), now);
    assert_eq!(pacer.source(), Source::Observed);
    pacer.refill(now);
    assert!(pacer.burst() < 1_500.0, "burst {}", pacer.burst());
    let t = pacer.admit_anyway(1_500.0, now);
    assert!(
        t.cost() > 0.0,
        "charged: it fits the reported bucket of 29000"
    );
    let huge = pacer.admit_anyway(50_000.0, now);
    assert_eq!(
        huge.cost(),
        0.0,
        "larger than the reported bucket: uncharged"
    );
}

/// A request cancelled before its answer is no longer in flight: the idle rule still holds.
#[test]
fn a_cancelled_request_is_not_in_flight() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let t = pacer.try_acquire(1.0, now).unwrap();
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.abandon(t, now);
    assert!(pacer.unanswered.is_empty());
    // A ticket of no cost shares its seq with the one before: answering it forgets nothing.
    let kept = pacer.admit_anyway(1.0, now);
    let free = pacer.admit(0.0, now);
    pacer.observe(free, Answer::Ok, None, now);
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.observe(kept, Answer::Ok, None, now);
    assert!(pacer.unanswered.is_empty());
}

/// A report of a per-day quota (full again only hours from now) sets no pace: the pacer learns
/// as without headers, and its 429s pace it.
#[test]
fn a_per_day_report_sets_no_pace() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let day = Report {
        limit: 300.0,
        remaining: 290.0,
        reset: Some(Duration::from_secs(5 * 3600)),
        coarse: false,
    };
    for _ in 0..5 {
        let t = pacer.try_acquire(1.0, now).unwrap();
        pacer.observe(t, Answer::Ok, Some(day), now);
        now += Duration::from_millis(20);
    }
    assert_eq!(pacer.source(), Source::SlowStart, "no header model");
    assert_eq!(
        pacer.last_remaining,
        Some(290.0),
        "the day's count is still shown"
    );
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, Some(day), now);
    assert_eq!(pacer.source(), Source::Aimd, "paced from the 429s");
    assert!(pacer.rate() >= MIN_RATE);
}

/// A demoted tokens pacer (its burst half a second of pace) admits a request that fits the
/// reported bucket but not its own burst: it owes at most one burst, not the whole request.
#[test]
fn a_request_beyond_a_demoted_burst_owes_at_most_one_burst() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = |remaining: f64| Report {
        limit: 30_000.0,
        remaining,
        reset: Some(Duration::from_secs_f64((30_000.0 - remaining) / 500.0)),
        coarse: false,
    };
    let t = pacer.admit_anyway(100.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(1_000.0)), now);
    now += Duration::from_secs(2);
    let t = pacer.admit_anyway(100.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(20_000.0)), now);
    assert_eq!(pacer.source(), Source::Observed);
    now += Duration::from_secs(10); // the level refills to the (small) burst
    let t = pacer
        .try_acquire(20_000.0, now)
        .expect("the level is full: it goes");
    assert!(t.cost() > 0.0, "charged: it fits the reported bucket");
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// A report that predates many sends resynchronises the level to what it says less what was
/// sent since, but never to a debt beyond one burst.
#[test]
fn a_resync_from_an_old_report_owes_at_most_one_burst() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = |remaining: f64| Report {
        limit: 1_000.0,
        remaining,
        reset: Some(Duration::from_secs(1)),
        coarse: false,
    };
    let t = pacer.admit_anyway(10.0, now);
    pacer.observe(t, Answer::Ok, Some(report(990.0)), now);
    assert_eq!(pacer.source(), Source::Headers);
    let first = pacer.admit_anyway(10.0, now);
    for _ in 0..100 {
        pacer.admit_anyway(1_000.0, now);
    }
    pacer.observe(first, Answer::Ok, Some(report(0.0)), now);
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// A ramp through reported headroom doubles per round trip, whatever the timer's tick: 500
/// requests at once, a bucket far larger than that, a 20 ms round trip and every fifth answer
/// an overload. The sender wakes once per millisecond, as tokio's timers do. Doubling from 10
/// per round trip sends the 500 in about seven round trips (140 ms, with the slow start's first
/// spacing); one send per tick would take 500 ms. Bound: 250 ms.
#[tokio::test(start_paused = true)]
async fn a_ramp_is_not_held_to_one_send_per_timer_tick() {
    let start = Instant::now();
    let mut model = Model::new(1e6, 1e6);
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    let mut in_flight: Vec<(Instant, Ticket, bool, HeaderMap)> = Vec::new();
    let mut sent = 0u32;
    while sent < 500 {
        let now = Instant::now();
        assert!(
            now.duration_since(start) < Duration::from_millis(250),
            "{sent} of 500 sent after 250 ms"
        );
        let (due, rest): (Vec<_>, Vec<_>) = in_flight.into_iter().partition(|(t, ..)| *t <= now);
        in_flight = rest;
        for (_, ticket, ok, headers) in due {
            let r = report(&headers, Kind::Requests, SystemTime::now());
            let answer = if ok { Answer::Ok } else { Answer::Overloaded };
            pacer.observe(ticket, answer, r, now);
        }
        while sent < 500 {
            let Ok(ticket) = pacer.try_acquire(1.0, now) else {
                break;
            };
            let (_, headers, _) = model.arrive(now);
            sent += 1;
            let ok = !sent.is_multiple_of(5);
            let rtt = Duration::from_millis(if ok { 20 } else { 1 });
            in_flight.push((now + rtt, ticket, ok, headers));
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
}
