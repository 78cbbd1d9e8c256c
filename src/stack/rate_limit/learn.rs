//! Learning the upstream's limit from its own answers: a pacing bucket per kind (requests,
//! tokens) whose rate, burst and level follow the provider's headers, or AIMD when it sends none.
//!
//! - **Headers** (OpenAI `x-ratelimit-*`, Anthropic `anthropic-ratelimit-*`, Azure): refill rate
//!   `(limit - remaining) / reset`, never assuming `limit` is per minute; burst `limit - floor`,
//!   where `floor` is the `remaining` a 429 reported (0 for honest capacity reports, the offset
//!   for per-minute reports). Every answer resynchronises the level: what the upstream had left
//!   when it saw the attempt, plus refill since, minus what corral sent after it. Reported
//!   headroom is spent no faster than answers confirm it (doubling per round trip).
//! - **Slow start** before anything is known: `initial_burst` requests go, each success lets two
//!   more go (doubling per round trip), and the first throttle ends it.
//! - **AIMD** without headers, as AWS's adaptive retry mode: on a throttle the rate becomes
//!   `min(measured, current) * 0.7` (at least 0.5/s); on success it regrows along a cubic
//!   (C = 0.4), capped at twice the measured send rate.
//!
//! A pure state machine: every method takes `now`, so tests drive it in virtual time.

use std::collections::VecDeque;
use std::time::Duration;

use http::HeaderMap;
use tokio::time::Instant;

const BETA: f64 = 0.7;
const CUBIC_C: f64 = 0.4;
const MIN_RATE: f64 = 0.5;
/// Slow start ends (ungated) once its window reaches this without a header or a throttle.
const SLOW_START_END: f64 = 4096.0;
/// Tickets unanswered this long are forgotten (their requests were cancelled or hang).
const FORGET_UNANSWERED: Duration = Duration::from_secs(600);
/// Held back when resynchronising the level from a report: the refill of this long (the
/// uncertainty in when the upstream counted), and at least one token.
const RESYNC_SLACK_TIME: Duration = Duration::from_millis(10);
/// In slow start, one more request goes after this long without an answer.
const SLOW_START_STALL: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Nothing known yet (tokens: no gating at all).
    None,
    SlowStart,
    Headers,
    Aimd,
}

impl Source {
    pub fn label(self) -> &'static str {
        match self {
            Source::None => "none",
            Source::SlowStart => "slow_start",
            Source::Headers => "headers",
            Source::Aimd => "aimd",
        }
    }
}

/// What one response's headers say about one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    pub limit: f64,
    pub remaining: f64,
    pub reset: Option<Duration>,
}

/// Parse the report for `kind` from any provider's header family; `None` when absent or
/// nonsensical (Azure's `-1`, remaining above limit, garbage).
pub fn report(headers: &HeaderMap, kind: Kind, now_wall: std::time::SystemTime) -> Option<Report> {
    use crate::stack::retry::hints::{parse_go_duration, parse_rfc3339_until};
    let get = |name: &str| headers.get(name)?.to_str().ok().map(str::trim);
    let num = |name: &str| {
        get(name)?
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
    };
    let k = kind.label();
    let (limit, remaining, reset) = if let Some(limit) = num(&format!("x-ratelimit-limit-{k}")) {
        let reset = get(&format!("x-ratelimit-reset-{k}")).and_then(parse_go_duration);
        (limit, num(&format!("x-ratelimit-remaining-{k}"))?, reset)
    } else {
        let reset = get(&format!("anthropic-ratelimit-{k}-reset"))
            .and_then(|v| parse_rfc3339_until(v, now_wall));
        (
            num(&format!("anthropic-ratelimit-{k}-limit"))?,
            num(&format!("anthropic-ratelimit-{k}-remaining"))?,
            reset,
        )
    };
    (limit > 0.0 && remaining <= limit).then_some(Report {
        limit,
        remaining,
        reset,
    })
}

/// What an answer says about the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Anything but a throttle.
    Ok,
    /// 429: our bucket is empty.
    RateLimited,
    /// 529 and the like: the service is overloaded.
    Overloaded,
}

/// Proof of admission, handed back with the answer.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    sent_at: Instant,
    /// Units admitted up to and including this one.
    seq: f64,
}

/// Smoothed send rate over 0.5 s buckets (AWS: smoothing 0.8).
#[derive(Debug)]
struct Meter {
    bucket_start: Instant,
    count: f64,
    rate: f64,
}

impl Meter {
    fn record(&mut self, now: Instant, n: f64) {
        let elapsed = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        if elapsed >= 0.5 {
            let sample = self.count / elapsed;
            self.rate = if self.rate == 0.0 {
                sample
            } else {
                0.8 * sample + 0.2 * self.rate
            };
            self.bucket_start = now;
            self.count = 0.0;
        }
        self.count += n;
    }
}

#[derive(Debug)]
pub struct Pacer {
    kind: Kind,
    margin: f64,
    source: Source,
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
    floor: f64,
    true_rate: f64,
    sent: f64,
    w_max: f64,
    last_throttle: Option<Instant>,
    meter: Meter,
    quiet_since: Instant,
    /// The largest level the upstream has confirmed by answering without a throttle: reported
    /// headroom is spent no faster than it is confirmed (it doubles per round trip), so a
    /// `limit` that is a per-minute figure rather than the burst costs a few 429s, not a herd.
    verified: f64,
    /// The newest ticket whose report set the level.
    synced_seq: f64,
    /// The fastest answer seen (seconds from send to head).
    min_rtt: Option<f64>,
    /// Admitted and not yet answered, in admission order.
    unanswered: VecDeque<(Ticket, f64)>,
    pub last_remaining: Option<f64>,
    pub throttles: u64,
}

impl Pacer {
    /// A pacer for `kind`; requests start in slow start with `initial_burst`, tokens ungated.
    pub fn new(kind: Kind, initial_burst: u32, margin: f64, now: Instant) -> Self {
        let (source, tokens) = match kind {
            Kind::Requests => (Source::SlowStart, f64::from(initial_burst)),
            Kind::Tokens => (Source::None, 0.0),
        };
        Self {
            kind,
            margin,
            source,
            rate: 0.0,
            burst: tokens.max(1.0),
            tokens,
            last: now,
            floor: 0.0,
            true_rate: 0.0,
            sent: 0.0,
            w_max: 0.0,
            last_throttle: None,
            meter: Meter {
                bucket_start: now,
                count: 0.0,
                rate: 0.0,
            },
            quiet_since: now,
            verified: f64::from(initial_burst.max(1)),
            synced_seq: f64::NEG_INFINITY,
            min_rtt: None,
            unanswered: VecDeque::new(),
            last_remaining: None,
            throttles: 0,
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }
    pub fn source(&self) -> Source {
        self.source
    }
    pub fn rate(&self) -> f64 {
        self.rate
    }
    pub fn burst(&self) -> f64 {
        self.burst
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        if self.source == Source::Aimd {
            self.rate = self.cubic(now);
        }
        self.tokens = (self.tokens + self.rate * dt).min(self.burst);
    }

    /// Whether [`try_acquire`](Self::try_acquire) would admit `cost` units now.
    pub fn can_acquire(&mut self, cost: f64, now: Instant) -> bool {
        if self.source == Source::None {
            return true;
        }
        self.refill(now);
        self.tokens >= cost.min(self.burst).max(f64::MIN_POSITIVE)
    }

    /// Admit `cost` units now, or say how long to wait (`None`: until an answer arrives).
    pub fn try_acquire(&mut self, cost: f64, now: Instant) -> Result<Ticket, Option<Duration>> {
        if self.source == Source::None {
            return Ok(self.admit(0.0, now));
        }
        self.refill(now);
        let need = cost.min(self.burst).max(f64::MIN_POSITIVE);
        if self.tokens >= need {
            self.tokens -= cost;
            return Ok(self.admit(cost, now));
        }
        if self.source == Source::SlowStart
            && now.saturating_duration_since(self.quiet_since) >= SLOW_START_STALL
        {
            // Nothing answered for a while (cancelled or slow requests): let one more go.
            self.quiet_since = now;
            self.tokens -= cost;
            return Ok(self.admit(cost, now));
        }
        if self.rate > 0.0 {
            Err(Some(Duration::from_secs_f64(
                ((need - self.tokens) / self.rate).min(3600.0),
            )))
        } else {
            Err(None)
        }
    }

    fn admit(&mut self, cost: f64, now: Instant) -> Ticket {
        self.sent += cost;
        self.meter.record(now, cost.max(1.0));
        let ticket = Ticket {
            sent_at: now,
            seq: self.sent,
        };
        if cost > 0.0 {
            self.unanswered.push_back((ticket, cost));
        }
        ticket
    }

    /// Units sent shortly before `ticket` and still unanswered: on a busy machine they may reach
    /// the upstream after it (not yet counted in its `remaining`), so they count as sent after.
    /// Forgets `ticket` itself, and tickets whose answer never came (cancelled requests).
    fn unanswered_before(&mut self, ticket: Ticket, now: Instant) -> f64 {
        while let Some((t, _)) = self.unanswered.front() {
            if now.saturating_duration_since(t.sent_at) > FORGET_UNANSWERED {
                self.unanswered.pop_front();
            } else {
                break;
            }
        }
        if let Some(i) = self
            .unanswered
            .iter()
            .position(|(t, _)| t.seq == ticket.seq)
        {
            self.unanswered.remove(i);
        }
        let window = Duration::from_secs_f64(self.min_rtt.unwrap_or(0.05));
        let since = ticket.sent_at.checked_sub(window).unwrap_or(ticket.sent_at);
        self.unanswered
            .iter()
            .take_while(|(t, _)| t.seq < ticket.seq)
            .filter(|(t, _)| t.sent_at >= since)
            .map(|(_, cost)| cost)
            .sum()
    }

    /// Learn from the answer to the attempt admitted with `ticket`.
    pub fn observe(
        &mut self,
        ticket: Ticket,
        answer: Answer,
        report: Option<Report>,
        now: Instant,
    ) {
        self.refill(now);
        self.quiet_since = now;
        let throttled = answer != Answer::Ok;
        if throttled {
            self.throttles += 1;
        }
        match report {
            Some(r) => self.learn_headers(ticket, answer, r, now),
            None if throttled && self.kind == Kind::Requests && self.source != Source::Headers => {
                self.throttle_aimd(now)
            }
            None if self.source == Source::SlowStart => {
                self.tokens += 2.0;
                self.burst = self.burst.max(self.tokens);
                if self.burst >= SLOW_START_END {
                    // Thousands of answers, no header, no throttle: nothing to learn; stop
                    // gating (a later 429 starts AIMD).
                    self.source = Source::None;
                }
            }
            None => {}
        }
    }

    fn learn_headers(&mut self, ticket: Ticket, answer: Answer, r: Report, now: Instant) {
        let throttled = answer != Answer::Ok;
        self.last_remaining = Some(r.remaining);
        if answer == Answer::RateLimited && r.remaining >= 1.0 {
            // The upstream refused with headroom left: its `remaining` counts from a floor.
            // (Only a 429 says so: a 529 is the whole service overloaded, not our bucket.)
            self.floor = r.remaining;
        }
        self.verified = if throttled {
            (self.verified / 2.0).max(1.0)
        } else {
            self.verified + 1.0
        };
        if let Some(reset) = r.reset.filter(|d| !d.is_zero()) {
            if r.limit > r.remaining {
                let sample = (r.limit - r.remaining) / reset.as_secs_f64();
                // A reset in whole seconds (Anthropic's RFC 3339 instants) is rounded up, so its
                // sample bounds the rate from below: the estimate is the largest recent bound,
                // decaying slowly so a lowered limit is still followed. Finer resets (OpenAI's)
                // are averaged.
                let whole_seconds = reset.subsec_nanos() == 0;
                self.true_rate = if self.true_rate == 0.0 || self.source != Source::Headers {
                    sample
                } else if whole_seconds {
                    sample.max(0.98 * self.true_rate)
                } else {
                    0.5 * sample + 0.5 * self.true_rate
                };
            }
        }
        self.burst = (r.limit - self.floor).max(1.0);
        let since = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
        let sent_after = (self.sent - ticket.seq).max(0.0) + self.unanswered_before(ticket, now);
        // The upstream counted `remaining` when the attempt arrived, somewhere between the send
        // and now. Credit refill for at most the fastest round trip seen (none before one is
        // known): a slow connect or a busy machine must not inflate the level. The slack covers
        // the rest.
        let credit = self.min_rtt.map_or(0.0, |m| since.min(m));
        let slack = (self.true_rate * RESYNC_SLACK_TIME.as_secs_f64()).max(1.0);
        let level = (r.remaining - self.floor) + self.true_rate * credit - sent_after - slack;
        let level = level.min(self.burst).min(self.verified);
        // A report newer than the last one used sets the level; an older one (an answer that
        // took long describes the bucket as it was long ago) may only lower it.
        if ticket.seq > self.synced_seq {
            self.synced_seq = ticket.seq;
            self.tokens = level;
        } else {
            self.tokens = self.tokens.min(level);
        }
        if !throttled {
            self.min_rtt = Some(self.min_rtt.map_or(since, |m| m.min(since)));
        }
        if self.true_rate > 0.0 {
            self.rate = self.true_rate * self.margin;
        }
        self.source = Source::Headers;
    }

    fn throttle_aimd(&mut self, now: Instant) {
        let measured = self.meter.rate.max(MIN_RATE);
        let current = if self.source == Source::Aimd {
            self.rate
        } else {
            measured
        };
        self.w_max = current.min(measured * 2.0).max(MIN_RATE);
        self.rate = (self.w_max * BETA).max(MIN_RATE);
        self.burst = self.rate.max(1.0);
        self.tokens = self.tokens.min(0.0);
        self.last_throttle = Some(now);
        self.source = Source::Aimd;
    }

    /// CUBIC regrowth since the last throttle, capped at twice the measured rate.
    fn cubic(&self, now: Instant) -> f64 {
        let Some(at) = self.last_throttle else {
            return self.rate;
        };
        let t = now.saturating_duration_since(at).as_secs_f64();
        let k = (self.w_max * (1.0 - BETA) / CUBIC_C).cbrt();
        let w = CUBIC_C * (t - k).powi(3) + self.w_max;
        let cap = (self.meter.rate * 2.0).max(self.w_max);
        w.clamp(MIN_RATE, cap)
    }
}

#[cfg(test)]
mod tests;
