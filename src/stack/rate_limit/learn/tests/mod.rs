//! The pacers driven in virtual time against an in-memory token bucket that answers like
//! OpenAI (or Anthropic, or Azure), with `tokio::time::pause()`.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use tokio::time::Instant;

use super::*;
use crate::provider::report;

mod clock;
mod cuts;
mod fleet;
mod ramp;
mod reports;
mod rules;
mod runs;
mod shares;

/// What `pacer` sends of one unit each, trying every millisecond over `ms` from `from` (a ramp
/// spreads its sends).
fn sent(pacer: &mut Pacer, from: Instant, ms: u64) -> Vec<Ticket> {
    let mut tickets = Vec::new();
    for step in 0..ms {
        let now = from + Duration::from_millis(step);
        while let Ok(t) = pacer.try_acquire(1.0, now) {
            tickets.push(t);
        }
    }
    tickets
}

/// A report with a reset finer than whole seconds (OpenAI's).
fn fine_report(limit: f64, remaining: f64, reset: Duration) -> Report {
    Report {
        limit,
        remaining,
        reset: Some(reset),
        coarse: false,
        instant: false,
        past: Duration::ZERO,
    }
}

/// Reports of a bucket of `limit` refilled `rate` a second, by what it has left (OpenAI's, with
/// a reset finer than whole seconds).
fn refilling(limit: f64, rate: f64) -> impl Fn(f64) -> Report {
    move |remaining| {
        fine_report(
            limit,
            remaining,
            Duration::from_secs_f64((limit - remaining) / rate),
        )
    }
}

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
    drive_peers(model, replicas, secs, change, false).await
}

/// [`drive_fleet`], and with `peers` the pacers are a fleet's: each 429 is also told to the
/// other pacers (`Pacer::peer_throttled`), and the shares their windows estimate are added up
/// and split evenly among those that estimated (`Pacer::fleet_share`; the clients of each are
/// always busy, so their demands are alike).
async fn drive_peers(
    model: &mut Model,
    replicas: usize,
    secs: u64,
    change: Option<(u64, f64)>,
    peers: bool,
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
    let mut events = 0u64;
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
            answer(&mut pacers[i], ticket, ok, &headers, now);
            if !ok {
                let pause = hint.or_else(|| pacers[i].time_for(1.0)).unwrap_or_default();
                paused[i] = paused[i].max(now + pause);
                if peers {
                    // Each peer its own phase, a golden-ratio step from the last one drawn.
                    for (_, p) in pacers.iter_mut().enumerate().filter(|(j, _)| *j != i) {
                        events += 1;
                        p.peer_throttled(now, (events as f64 * 0.618_034).fract());
                    }
                }
            }
            if peers {
                let shares: Vec<(usize, f64)> = (0..replicas)
                    .filter_map(|j| pacers[j].take_estimate().map(|e| (j, e)))
                    .collect();
                let total: f64 = shares.iter().map(|(_, e)| e).sum();
                for (j, _) in &shares {
                    pacers[*j].fleet_share(total / shares.len() as f64, now);
                }
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

/// The model's answer to `ticket` (admitted or refused, with its headers) told to `pacer`.
fn answer(pacer: &mut Pacer, ticket: Ticket, ok: bool, headers: &HeaderMap, now: Instant) {
    let r = report(headers, Kind::Requests, SystemTime::now());
    let answer = if ok { Answer::Ok } else { Answer::RateLimited };
    pacer.observe(ticket, answer, r, now);
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

#[test]
fn every_source_has_its_series_from_the_first_scrape() {
    let sources = [
        Source::None,
        Source::SlowStart,
        Source::Headers,
        Source::Observed,
        Source::Aimd,
    ];
    for source in sources {
        // A match without a wildcard: a new source fails to compile here until it is listed.
        match source {
            Source::None
            | Source::SlowStart
            | Source::Headers
            | Source::Observed
            | Source::Aimd => {
                assert!(
                    crate::metrics::PACING_SOURCES.contains(&source.label()),
                    "{source:?}"
                );
            }
        }
    }
    // The rest is the configured ceiling's.
    assert_eq!(sources.len() + 1, crate::metrics::PACING_SOURCES.len());
    assert!(crate::metrics::PACING_SOURCES.contains(&"config"));
}
