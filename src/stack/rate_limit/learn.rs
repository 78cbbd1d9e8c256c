//! Learning the upstream's limit from its own answers: a pacing bucket per kind (requests,
//! tokens) whose rate, burst and level follow the provider's headers, corrected by what its
//! 429s show, or its 429s alone when it sends no headers.
//!
//! What the upstream does is the truth; what its headers report is a hint:
//!
//! - **Headers** (OpenAI `x-ratelimit-*`, Anthropic `anthropic-ratelimit-*`, Azure): refill rate
//!   `(limit - remaining) / reset`, never assuming `limit` is per minute; burst `limit - floor`,
//!   where `floor` is the `remaining` a 429 reported (0 for honest capacity reports, the offset
//!   for per-minute reports). Every answer resynchronises the level: what the upstream had left
//!   when it saw the attempt, plus refill since, minus what corral sent after it. Reported
//!   headroom is spent no faster than answers confirm it (doubling per round trip).
//! - **Demotion**: a 429 whose `remaining` is above the learned floor (a per-minute `limit` with
//!   quantized enforcement: a small bucket refilling per second behind it) shows the report's
//!   level is a lie. The level is then no longer read from `remaining` (it is set to empty by
//!   each 429 and refills at the pace), the burst shrinks to half a second of the pace, and the
//!   source reads `observed`. The headers are trusted again after `PROBATION` without another
//!   such 429, doubling per demotion.
//! - **Throttle windows** (every source): between two 429 events the upstream's bucket went from
//!   empty to empty, so what it admitted in between is exactly what it refilled for us, however
//!   many other clients share the key. Windows are added up until they span `MIN_WINDOW`, then
//!   give an estimate that caps the pace (so four corrals on one key each settle on their share,
//!   even though each sees the whole key's headers). A second event within `REPEAT` of the last
//!   one that completes no estimate cuts the pace by `BETA` (so an estimated cap under steady
//!   contention alternates with cuts, as AIMD does). An estimated cap holds for `HOLD`, then
//!   probes upward by `GROWTH` per second; a cut one grows faster (it is a guess).
//! - **Slow start** before anything is known: `initial_burst` requests go, each success lets two
//!   more go (doubling per round trip), and the first throttle ends it.
//! - **No headers** (source `aimd`): the first 429 cuts the measured send rate by `BETA` (AWS's
//!   adaptive mode); throttle windows then estimate the rate as above.
//! - **Evidence bounds every cut.** Only 429s read as "the bucket is empty" reach
//!   [`Answer::RateLimited`] (an overload moves no pace). A cut never goes below what the
//!   upstream admitted from this pacer over the last `ADMITTED_WINDOW`, and 429s of attempts
//!   sent before the last cut belong to it (at most one cut per round trip, as TCP does). When
//!   the upstream names a long wait (`STORM`), the cuts are a storm's, not a bucket edge's: after
//!   it each success of an attempt sent after the last cut adds its units per its own round
//!   trip, so the pace doubles per round trip back to where it was before the cuts (TCP's slow
//!   start after a timeout): one storm leaves no crawl behind it.
//! - **Settled, never owed.** A request larger than the burst goes at once, charged nothing
//!   here (the upstream's answer is the truth, and its report resynchronises the level); a
//!   request admitted past the pace is charged at most the burst, and the level never owes
//!   more than one burst.
//!
//! A pure state machine: every method takes `now`, so tests drive it in virtual time.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::provider::{Kind, Report};

/// Multiplicative cut on a throttle without an estimate (AWS adaptive retry's beta).
const BETA: f64 = 0.7;
/// No learned pace goes below this (requests or tokens per second).
const MIN_RATE: f64 = 0.5;
/// Slow start ends (ungated) once its window reaches this without a header or a throttle.
const SLOW_START_END: f64 = 4096.0;
/// Tickets unanswered this long are forgotten (their requests were cancelled or hang).
const FORGET_UNANSWERED: Duration = Duration::from_secs(600);
/// At most this many unanswered tickets are remembered (the oldest go first).
const MAX_UNANSWERED: usize = 16_384;
/// Held back when resynchronising the level from a report: the refill of this long (the
/// uncertainty in when the upstream counted), and at least one token.
const RESYNC_SLACK_TIME: Duration = Duration::from_millis(10);
/// With nothing in flight and no answer for this long, one request goes whatever the level:
/// a storm's cuts never hold a lone request.
const IDLE: Duration = Duration::from_millis(250);
/// In slow start, one more request goes after this long without an answer.
const SLOW_START_STALL: Duration = Duration::from_secs(1);
/// Throttle windows are added up until they span this much before they give an estimate.
const MIN_WINDOW: Duration = Duration::from_secs(1);
/// The round trip assumed for spreading a ramp's sends before one is measured.
const RAMP_RTT_GUESS: f64 = 0.1;
/// A ramp's sends due this long ago may still go back to back (timers tick per millisecond).
const RAMP_CATCH_UP: Duration = Duration::from_millis(2);
/// A throttle window counts only if at least this many units per second were sent in it.
const MIN_PRESSURE: f64 = 2.0;
/// Two throttle events further apart than this may have had a full bucket in between: their
/// window says nothing.
const MAX_GAP: Duration = Duration::from_secs(10);
/// A throttle event this soon after the previous one, with no estimate yet, cuts the pace.
const REPEAT: Duration = Duration::from_secs(2);
/// An estimate near the headers' whole rate (this corral is alone on the key) holds this long
/// before probing upward...
const HOLD: Duration = Duration::from_secs(10);
/// ...by this fraction of it per second.
const GROWTH: f64 = 0.01;
/// An estimate below this share of the headers' rate means others draw on the key too...
const ALONE: f64 = 0.8;
/// ...and then the cap grows at once, by this fraction of the key's rate per second.
const SHARE_GROWTH: f64 = 0.01;
/// A cut (a guess, not an estimate) holds this long, then grows by `GUESS_GROWTH` of itself per
/// second.
const GUESS_HOLD: Duration = Duration::from_millis(500);
const GUESS_GROWTH: f64 = 0.1;
/// A report whose reset is further away than this counts a long window, not a refill.
const LONG_REPORT: Duration = Duration::from_secs(3600);
/// An estimate from the 429s this many times the headers' rate says the report counts another
/// window than the bucket that refuses.
const OTHER_UNIT: f64 = 2.0;
/// A named wait this long makes the cuts before it recover by doubling.
pub const STORM: Duration = Duration::from_secs(1);
/// A cut never goes below what the upstream admitted over this window.
const ADMITTED_WINDOW: Duration = Duration::from_secs(1);
/// Admitted units are counted in slots of this length.
const ADMITTED_SLOT: Duration = Duration::from_millis(50);
/// A header model caught lying is distrusted this long, doubling per demotion...
const PROBATION: Duration = Duration::from_secs(60);
/// ...up to this.
const MAX_PROBATION: Duration = Duration::from_secs(3600);
/// While demoted, the burst is the pace over this long.
const DEMOTED_BURST: Duration = Duration::from_millis(500);
/// A 429 whose `remaining` is at least this far above the learned floor says the report lies.
const LIE_MARGIN: f64 = 2.0;

/// Where the pace comes from (the `corral_limit_source` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Nothing known yet (tokens: no gating at all).
    None,
    SlowStart,
    /// The provider's headers, trusted.
    Headers,
    /// The provider's headers were caught lying: pace from their rate and from the 429s.
    Observed,
    /// No headers: pace from the 429s alone.
    Aimd,
}

impl Source {
    pub fn label(self) -> &'static str {
        match self {
            Source::None => "none",
            Source::SlowStart => "slow_start",
            Source::Headers => "headers",
            Source::Observed => "observed",
            Source::Aimd => "aimd",
        }
    }
}

/// What an answer says about this pacer's bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Anything but a throttle.
    Ok,
    /// 429, and this bucket is the one that refused.
    RateLimited,
    /// 429 from another bucket (the report still describes this one).
    RefusedElsewhere,
    /// 529 and the like: the service is overloaded.
    Overloaded,
}

/// How a pacer would admit a request now ([`Pacer::admits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Ungated, or larger than the bucket: charged nothing.
    Free,
    /// Within the pace.
    Paced,
    /// Past the pace: nothing in flight or answered for a while.
    Anyway,
}

/// Proof of admission, handed back with the answer.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    sent_at: Instant,
    /// Units admitted up to and including this one.
    seq: f64,
    /// Units this one took.
    cost: f64,
}

impl Ticket {
    /// Units this one took.
    pub fn cost(&self) -> f64 {
        self.cost
    }
}

/// Smoothed send rate over 0.5 s buckets (AWS: smoothing 0.8).
#[derive(Debug)]
struct Meter {
    bucket_start: Instant,
    count: f64,
    rate: f64,
}

impl Meter {
    /// The smoothed rate, or before the first sample the rate of the bucket so far.
    fn current(&self, now: Instant) -> f64 {
        if self.rate > 0.0 {
            return self.rate;
        }
        let elapsed = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        self.count / elapsed.max(0.1)
    }

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

/// Units the upstream admitted (answered without a throttle) over the last
/// [`ADMITTED_WINDOW`], in slots of [`ADMITTED_SLOT`].
#[derive(Debug, Default)]
struct Admitted {
    slots: VecDeque<(Instant, f64)>,
}

impl Admitted {
    fn record(&mut self, now: Instant, units: f64) {
        self.expire(now);
        match self.slots.back_mut() {
            Some((start, n)) if now.saturating_duration_since(*start) < ADMITTED_SLOT => {
                *n += units
            }
            _ => self.slots.push_back((now, units)),
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some((start, _)) = self.slots.front() {
            if now.saturating_duration_since(*start) > ADMITTED_WINDOW {
                self.slots.pop_front();
            } else {
                break;
            }
        }
    }

    /// Units per second over the window.
    fn rate(&mut self, now: Instant) -> f64 {
        self.expire(now);
        self.slots.iter().map(|(_, n)| n).sum::<f64>() / ADMITTED_WINDOW.as_secs_f64()
    }
}

/// What the 429s have shown (see the module doc: throttle windows).
#[derive(Debug, Default)]
struct Throttles {
    /// The attempt whose 429 marked the last event: the bucket was empty when it arrived.
    last: Option<Ticket>,
    /// Units sent when the last event was taken in: 429s of attempts sent before belong to it.
    cut_seq: f64,
    /// When the last event was taken in.
    at: Option<Instant>,
    /// Units refused since `last`.
    refused: f64,
    /// Saturated windows added up toward an estimate: units admitted, and their span.
    units: f64,
    secs: f64,
}

/// A cap on the pace from the 429s: this pacer's share of the upstream's rate. It holds for a
/// while, then grows additively (so corrals sharing a key, each cutting multiplicatively on its
/// own 429s, drift toward equal shares, as AIMD flows do).
#[derive(Debug, Clone, Copy)]
struct Cap {
    rate: f64,
    since: Instant,
    hold: Duration,
    /// Growth after the hold, units per second per second.
    slope: f64,
    /// The pace before a cut (`None` for an estimate, which is evidence, not a guess).
    before: Option<f64>,
    /// Whether the cut is on its way back: set when a long pause followed it (a storm, not a
    /// bucket's edge), successes then raise `rate` toward `before`, doubling it per round trip.
    recovering: bool,
}

impl Cap {
    fn at(&self, now: Instant) -> f64 {
        let t = now
            .saturating_duration_since(self.since + self.hold)
            .as_secs_f64();
        self.rate + self.slope * t
    }
}

#[derive(Debug)]
pub struct Pacer {
    kind: Kind,
    /// Learned rates are used times this.
    margin: f64,
    source: Source,
    /// The pace in effect (units per second); 0 while only answers drive the level.
    rate: f64,
    /// Most units the level may hold.
    burst: f64,
    /// The level: units that may go now (negative: owed).
    level: f64,
    /// When the level was last refilled.
    last: Instant,
    /// The `remaining` at which the upstream refuses (per-minute reports count from an offset).
    floor: Option<f64>,
    /// The refill rate the headers imply, `(limit - remaining) / reset`, smoothed.
    header_rate: f64,
    /// `header_rate` is only a bound from below (a reset rounded to whole seconds, under two):
    /// the bucket may refill much faster, so it is not shared as the key's rate.
    header_rate_loose: bool,
    /// Units admitted so far (tickets' sequence numbers).
    sent: f64,
    meter: Meter,
    /// The last answer (or slow-start stall release).
    quiet_since: Instant,
    /// The largest level the upstream has confirmed by answering without a throttle: reported
    /// headroom is spent no faster than it is confirmed (it doubles per round trip), so a
    /// `limit` that is a per-minute figure rather than the burst costs a few 429s, not a herd.
    verified: f64,
    /// The newest ticket whose report set the level.
    synced_seq: f64,
    /// The fastest answer seen (seconds from send to head).
    min_rtt: Option<f64>,
    /// While ramping (headroom not yet confirmed), sends are spread over the round trip instead
    /// of leaving in a burst when a batch of answers arrives: the next may go at this instant.
    /// A 429 comes back fast, pauses the partition and stops the rest of the round, so the
    /// round that finds the bucket's edge costs a 429 or two instead of half the round.
    next_send: Instant,
    /// Admitted and not yet answered, in admission order.
    unanswered: VecDeque<Ticket>,
    throttle_log: Throttles,
    cap: Option<Cap>,
    /// While set and in the future, the headers' level is not believed (demoted).
    distrust_until: Option<Instant>,
    demotions: u32,
    /// The last `remaining` reported, for `/status` and the gauge.
    pub last_remaining: Option<f64>,
    /// The share of its `limit` the last success's report had left.
    last_ok_share: Option<f64>,
    /// The bucket the reports describe: `limit` less the learned floor.
    reported_size: Option<f64>,
    /// 429s and 529s attributed to this bucket.
    pub throttles: u64,
    admitted: Admitted,
}

impl Pacer {
    /// A pacer for `kind`; requests start in slow start with `initial_burst`, tokens ungated.
    pub fn new(kind: Kind, initial_burst: u32, margin: f64, now: Instant) -> Self {
        let (source, level) = match kind {
            Kind::Requests => (Source::SlowStart, f64::from(initial_burst)),
            Kind::Tokens => (Source::None, 0.0),
        };
        Self {
            kind,
            margin,
            source,
            rate: 0.0,
            burst: level.max(1.0),
            level,
            last: now,
            floor: None,
            header_rate: 0.0,
            header_rate_loose: false,
            sent: 0.0,
            meter: Meter {
                bucket_start: now,
                count: 0.0,
                rate: 0.0,
            },
            quiet_since: now,
            verified: f64::from(initial_burst.max(1)),
            synced_seq: f64::NEG_INFINITY,
            min_rtt: None,
            next_send: now,
            unanswered: VecDeque::new(),
            throttle_log: Throttles::default(),
            cap: None,
            distrust_until: None,
            demotions: 0,
            last_remaining: None,
            reported_size: None,
            last_ok_share: None,
            throttles: 0,
            admitted: Admitted::default(),
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

    /// What this pacer has learned of the upstream's whole bucket, for corrals sharing it
    /// (`[fleet]`): the refill its headers imply (times the margin), the burst, and the level
    /// last reported above the floor. `None` until headers have been read.
    pub fn upstream_model(&self) -> Option<(f64, f64, Option<f64>)> {
        let trusted = matches!(self.source, Source::Headers | Source::Observed);
        (trusted && self.header_rate > 0.0 && !self.header_rate_loose).then(|| {
            let level = self
                .last_remaining
                .map(|r| (r - self.floor.unwrap_or(0.0)).max(0.0));
            (self.header_rate * self.margin, self.burst, level)
        })
    }

    /// How long until `units` could go at the current pace, if it is known.
    pub fn time_for(&self, units: f64) -> Option<Duration> {
        (self.rate > 0.0).then(|| Duration::from_secs_f64((units / self.rate).min(3600.0)))
    }

    /// The pace from the source, capped by what the 429s showed.
    fn pace(&self, now: Instant) -> f64 {
        let cap = self.cap.map(|c| {
            // A cap never runs far ahead of what is actually sent.
            c.at(now).min(c.rate.max(2.0 * self.meter.rate))
        });
        let base = match self.source {
            Source::Headers | Source::Observed => self.header_rate,
            Source::Aimd => 0.0,
            Source::None | Source::SlowStart => return 0.0,
        };
        let estimated_above = |c: f64| {
            self.cap
                .is_some_and(|cap| cap.before.is_none() && c > OTHER_UNIT * base)
        };
        let pace = match (base > 0.0, cap) {
            // The 429s showed the upstream admitting far more than the headers' rate: the
            // report counts another window than the bucket that refuses (a per-day quota over
            // a per-minute bucket). What happens beats what is reported.
            (true, Some(c)) if estimated_above(c) => c,
            (true, Some(c)) => base.min(c),
            (true, None) => base,
            (false, Some(c)) => c,
            (false, None) => return 0.0,
        };
        pace.max(MIN_RATE) * self.margin
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        if self.source == Source::Observed && self.distrust_until.is_some_and(|until| now >= until)
        {
            self.distrust_until = None;
            self.source = Source::Headers;
        }
        self.rate = self.pace(now);
        if matches!(self.source, Source::Observed | Source::Aimd) {
            self.burst = (self.rate * DEMOTED_BURST.as_secs_f64()).max(1.0);
        }
        self.level = (self.level + self.rate * dt).min(self.burst);
    }

    /// The spacing of sends while headroom is unconfirmed (slow start, or reported headroom
    /// beyond what answers have confirmed): one round trip over the confirmed window.
    fn ramp_gap(&self) -> Option<Duration> {
        let window = match self.source {
            Source::SlowStart => self.burst,
            Source::Headers if self.verified < self.burst => self.verified,
            _ => return None,
        };
        let rtt = self.min_rtt.unwrap_or(RAMP_RTT_GUESS);
        Some(Duration::from_secs_f64(rtt / window.max(1.0)))
    }

    /// Whether [`try_acquire`](Self::try_acquire) would admit `cost` units now.
    pub fn can_acquire(&mut self, cost: f64, now: Instant) -> bool {
        if self.source == Source::None {
            return true;
        }
        self.refill(now);
        (self.ramp_gap().is_none() || now >= self.next_send)
            && self.level >= cost.min(self.burst).max(f64::MIN_POSITIVE)
    }

    /// Admit `cost` units now, or say how long to wait (`None`: until an answer arrives).
    pub fn try_acquire(&mut self, cost: f64, now: Instant) -> Result<Ticket, Option<Duration>> {
        match self.admits(cost, now)? {
            Admission::Free => Ok(self.admit(0.0, now)),
            Admission::Paced => {
                // Larger than a demoted burst (but within the reported bucket): charged down
                // to one burst owed, not the whole of it.
                let charge = cost.min(self.level + self.burst);
                self.level -= charge;
                if let Some(gap) = self.ramp_gap() {
                    // Spaced from the last send's slot, not from now: a waiter woken late (a
                    // timer's tick is a millisecond) does not lose the sends its lateness owes,
                    // so a ramp is not held to one send per tick. At most `RAMP_CATCH_UP` of
                    // sends go back to back after a lull.
                    let from = now.checked_sub(RAMP_CATCH_UP).unwrap_or(now);
                    self.next_send = self.next_send.max(from) + gap;
                }
                Ok(self.admit(charge, now))
            }
            Admission::Anyway => {
                self.quiet_since = now;
                Ok(self.admit_anyway(cost, now))
            }
        }
    }

    /// How [`try_acquire`](Self::try_acquire) would admit `cost` units now, taking nothing
    /// (but the refill up to `now`); `Err` as there.
    pub fn admits(&mut self, cost: f64, now: Instant) -> Result<Admission, Option<Duration>> {
        if self.source == Source::None {
            return Ok(Admission::Free);
        }
        self.refill(now);
        if self.oversize(cost) {
            // Larger than the bucket: no wait here can make room for it. It goes now, charged
            // nothing; the upstream's answer (its report) settles what it cost.
            return Ok(Admission::Free);
        }
        let need = cost.min(self.burst).max(f64::MIN_POSITIVE);
        let gap = self.ramp_gap();
        if gap.is_some() && now < self.next_send && self.level >= need {
            return Err(Some(self.next_send - now));
        }
        if self.level >= need {
            return Ok(Admission::Paced);
        }
        let quiet = now.saturating_duration_since(self.quiet_since);
        let stalled = self.source == Source::SlowStart && quiet >= SLOW_START_STALL;
        if stalled || (self.unanswered.is_empty() && quiet >= IDLE) {
            // Nothing answered for a while (cancelled or slow requests), or nothing in flight
            // for a while: one request alone cannot overrun anything, so it goes now.
            return Ok(Admission::Anyway);
        }
        match self.time_for(need - self.level) {
            Some(wait) => Err(Some(wait)),
            None => Err(None),
        }
    }

    /// Whether `cost` tokens exceed the whole bucket the upstream reports (not the pacer's own
    /// burst, which a demoted model keeps at half a second of pace).
    fn oversize(&self, cost: f64) -> bool {
        self.kind == Kind::Tokens && cost > self.reported_size.unwrap_or(self.burst)
    }

    /// Admit `cost` units past the pace (the pace is corral's guess, and the request's time to
    /// wait for it is up): charged at most the burst, and the level never owes more than one.
    pub fn admit_anyway(&mut self, cost: f64, now: Instant) -> Ticket {
        if self.source == Source::None || self.oversize(cost) {
            return self.admit(0.0, now);
        }
        self.refill(now);
        let charge = cost.min(self.burst);
        self.level = (self.level - charge).max(-self.burst);
        self.admit(charge, now)
    }

    /// The upstream counted `actual` units for the attempt admitted with `ticket`: the level
    /// gets back what was over-charged, or gives what was under-charged, never owing more than
    /// one burst. (The next report resynchronises the level anyway; this closes the gap until
    /// then.)
    pub fn settle(&mut self, ticket: Ticket, actual: f64, now: Instant) {
        // A report newer than the attempt's own has set the level since: it counted this.
        if self.source == Source::None || ticket.cost == 0.0 || self.synced_seq > ticket.seq {
            return;
        }
        self.refill(now);
        self.level = (self.level + ticket.cost - actual).clamp(-self.burst, self.burst);
    }

    fn admit(&mut self, cost: f64, now: Instant) -> Ticket {
        self.sent += cost;
        self.meter.record(now, cost.max(1.0));
        let ticket = Ticket {
            sent_at: now,
            seq: self.sent,
            cost,
        };
        if cost > 0.0 {
            if self.unanswered.len() >= MAX_UNANSWERED {
                self.unanswered.pop_front();
            }
            self.unanswered.push_back(ticket);
        }
        ticket
    }

    /// Forget `ticket` (answered) and tickets whose answer never came (cancelled requests).
    fn forget(&mut self, ticket: Ticket, now: Instant) {
        while let Some(t) = self.unanswered.front() {
            if now.saturating_duration_since(t.sent_at) > FORGET_UNANSWERED {
                self.unanswered.pop_front();
            } else {
                break;
            }
        }
        // A ticket of no cost was never listed (and shares its `seq` with the one before).
        if ticket.cost == 0.0 {
            return;
        }
        if let Some(i) = self.unanswered.iter().position(|t| t.seq == ticket.seq) {
            self.unanswered.remove(i);
        }
    }

    /// The attempt admitted with `ticket` will never be answered (its request was cancelled).
    pub fn abandon(&mut self, ticket: Ticket, now: Instant) {
        self.forget(ticket, now);
    }

    /// Units sent shortly before `ticket` and still unanswered: on a busy machine they may reach
    /// the upstream after it (not yet counted in its `remaining`), so they count as sent after.
    fn unanswered_before(&self, ticket: Ticket) -> f64 {
        let window = Duration::from_secs_f64(self.min_rtt.unwrap_or(0.05));
        let since = ticket.sent_at.checked_sub(window).unwrap_or(ticket.sent_at);
        self.unanswered
            .iter()
            .take_while(|t| t.seq < ticket.seq)
            .filter(|t| t.sent_at >= since)
            .map(|t| t.cost)
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
        self.forget(ticket, now);
        // A report whose bucket is full again only hours from now counts a long window (a
        // per-day quota, as Groq's request headers do): its rate is a day's average and its
        // `remaining` the day's, nothing about the bucket that refuses first. The pacer learns
        // as without headers; the quota's own 429 is read as a long window.
        let report = match report {
            Some(r) if r.reset.is_some_and(|d| d > LONG_REPORT) => {
                self.last_remaining = Some(r.remaining);
                None
            }
            other => other,
        };
        if answer == Answer::Ok {
            let rtt = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
            self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
            let units = ticket.cost.max(1.0);
            self.admitted.record(now, units);
            self.recover(ticket, units, rtt);
        }
        if matches!(answer, Answer::RateLimited | Answer::Overloaded) {
            self.throttles += 1;
        }
        match report {
            Some(r) => self.learn_headers(ticket, answer, r, now),
            None if answer == Answer::Ok && self.source == Source::SlowStart => {
                self.level += 2.0;
                self.burst = self.burst.max(self.level);
                if self.burst >= SLOW_START_END {
                    // Thousands of answers, no header, no throttle: nothing to learn; stop
                    // gating (a later 429 paces from the 429s).
                    self.source = Source::None;
                }
            }
            None => {}
        }
        // An overload is the whole service, not this bucket: it moves no pace (the retry
        // layer backs off, the breaker counts it).
        if answer == Answer::RateLimited {
            self.throttled(ticket, now);
        }
        self.rate = self.pace(now);
    }

    /// A success after a cut: the attempt's units per its round trip back on the cap, so the
    /// pace doubles per round trip until it is back where the cut found it.
    fn recover(&mut self, ticket: Ticket, units: f64, rtt: f64) {
        let after_cut = ticket.seq > self.throttle_log.cut_seq;
        if let Some(cap) = self.cap.as_mut().filter(|c| after_cut && c.recovering) {
            if let Some(to) = cap.before.filter(|to| cap.rate < *to) {
                let rtt = rtt.max(self.min_rtt.unwrap_or(0.0)).max(1e-3);
                cap.rate = (cap.rate + units / rtt).min(to);
            }
        }
    }

    /// A 429 from this bucket: it was empty when `ticket` arrived.
    fn throttled(&mut self, ticket: Ticket, now: Instant) {
        self.level = self.level.min(0.0);
        let log = &mut self.throttle_log;
        if log.last.is_none_or(|l| ticket.seq > l.seq) {
            log.refused += ticket.cost;
        }
        if ticket.seq <= log.cut_seq {
            return; // sent before the last event was taken in: part of it
        }
        let mut estimate = None;
        match log.last {
            Some(last) if ticket.sent_at > last.sent_at => {
                let span = ticket.sent_at.duration_since(last.sent_at);
                let between = (ticket.seq - ticket.cost) - last.seq;
                let secs = span.as_secs_f64();
                // A window says what the upstream refilled only if corral kept asking
                // throughout: sparse sends (a bucket that may have filled up) are no estimate.
                if span <= MAX_GAP && between >= MIN_PRESSURE * secs {
                    log.units += (between - (log.refused - ticket.cost)).max(0.0);
                    log.secs += secs;
                    if log.secs >= MIN_WINDOW.as_secs_f64() {
                        estimate = Some(log.units / log.secs);
                        log.units = 0.0;
                        log.secs = 0.0;
                    }
                } else {
                    log.units = 0.0;
                    log.secs = 0.0;
                }
            }
            _ => {}
        }
        let repeat = log
            .at
            .is_some_and(|at| now.saturating_duration_since(at) <= REPEAT);
        log.last = Some(ticket);
        log.cut_seq = self.sent;
        log.at = Some(now);
        log.refused = 0.0;
        let headers_pace =
            matches!(self.source, Source::Headers | Source::Observed) && self.header_rate > 0.0;
        match estimate {
            Some(e) => {
                let e = e.max(MIN_RATE).max(self.admitted.rate(now));
                let alone = !headers_pace || e >= ALONE * self.header_rate;
                self.cap = Some(if alone {
                    Cap {
                        rate: e,
                        since: now,
                        hold: HOLD,
                        slope: GROWTH * e,
                        before: None,
                        recovering: false,
                    }
                } else {
                    Cap {
                        rate: e,
                        since: now,
                        hold: Duration::ZERO,
                        slope: SHARE_GROWTH * self.header_rate,
                        before: None,
                        recovering: false,
                    }
                });
            }
            None if repeat || !headers_pace => self.cut(now),
            None => {}
        }
        if !matches!(self.source, Source::Headers | Source::Observed) {
            self.source = Source::Aimd;
        }
    }

    /// This pacer's bucket refused with a named wait by whose end its report says it is full
    /// again (`Throttle::own_wait`): the refusal is no sign that sending as fast as the report
    /// allows overran it (an admission control's queue, not a bucket's edge), so the headroom
    /// the report shows after the wait needs no confirming. A client that honours the hint
    /// resends every refused request then; so may corral.
    /// Whether the last success's report showed at least half the bucket left (or none came
    /// yet): a refusal right after clear headroom is not this sender's overrun. A bucket shared
    /// with others runs near empty, and its refusals stay evidence about the pace.
    pub fn had_headroom(&self) -> bool {
        self.last_ok_share.is_none_or(|share| share >= 0.5)
    }

    pub fn full_after(&mut self) {
        if self.source == Source::Headers {
            self.verified = self.verified.max(self.burst);
        }
    }

    /// The upstream named a long wait ([`STORM`] or more): what follows is a storm, not a
    /// bucket's edge found by pacing, so a cut's way back is by doubling per round trip
    /// (TCP's slow start after a timeout) rather than by its slow growth.
    pub fn long_pause(&mut self, wait: Duration) {
        if wait >= STORM {
            if let Some(cap) = self.cap.as_mut().filter(|c| c.before.is_some()) {
                cap.recovering = true;
            }
        }
    }

    /// Cut the pace by `BETA` (from the measured send rate when nothing paces yet), never
    /// below what the upstream admitted over the last window.
    fn cut(&mut self, now: Instant) {
        let current = if self.rate > 0.0 {
            self.rate / self.margin
        } else {
            self.meter.current(now)
        };
        let rate = (current * BETA).max(self.admitted.rate(now)).max(MIN_RATE);
        // A cut of a cut still recovers to where the first one found the pace.
        let before = match self.cap {
            Some(Cap {
                before: Some(b), ..
            }) => b.max(current),
            _ => current,
        };
        self.cap = Some(Cap {
            rate,
            since: now,
            hold: GUESS_HOLD,
            slope: GUESS_GROWTH * rate,
            before: Some(before),
            recovering: false,
        });
        self.level = self.level.min(0.0);
        if matches!(self.source, Source::SlowStart | Source::None) {
            self.source = Source::Aimd;
        }
    }

    fn demote(&mut self, now: Instant) {
        if self.distrust_until.is_none() {
            self.demotions += 1;
        }
        let doubling = 2u32.saturating_pow(self.demotions.saturating_sub(1).min(16));
        let probation = PROBATION.saturating_mul(doubling).min(MAX_PROBATION);
        self.distrust_until = Some(now + probation);
        self.source = Source::Observed;
    }

    fn learn_headers(&mut self, ticket: Ticket, answer: Answer, r: Report, now: Instant) {
        if answer == Answer::Ok && r.limit > 0.0 {
            self.last_ok_share = Some(r.remaining / r.limit);
        }
        self.last_remaining = Some(r.remaining);
        if answer == Answer::RateLimited {
            // Only a 429 says where the bucket refuses (a 529 is the whole service).
            match self.floor {
                Some(floor) if r.remaining >= floor + LIE_MARGIN => self.demote(now),
                Some(_) => {}
                // The first 429 says where this report refuses: 0 for an honest one, the offset
                // for a per-minute one.
                None => self.floor = Some(r.remaining),
            }
        }
        self.reported_size = Some((r.limit - self.floor.unwrap_or(0.0)).max(1.0));
        // In the pacer's units: a tokens pacer confirms a request's tokens per answer. Only
        // this bucket's refusal halves it (an overload says nothing about the bucket).
        self.verified = match answer {
            Answer::RateLimited => (self.verified / 2.0).max(1.0),
            Answer::Ok => self.verified + ticket.cost.max(1.0),
            Answer::RefusedElsewhere | Answer::Overloaded => self.verified,
        };
        if let Some(reset) = r.reset.filter(|d| !d.is_zero()) {
            if r.limit > r.remaining {
                let sample = (r.limit - r.remaining) / reset.as_secs_f64();
                // A reset in whole seconds (Anthropic's RFC 3339 instants, Azure's integers) is
                // rounded up, so its sample bounds the rate from below: the estimate is the
                // largest recent bound, decaying slowly so a lowered limit is still followed.
                // Finer resets (OpenAI's) are averaged.
                let whole_seconds = r.coarse || reset.subsec_nanos() == 0;
                let fresh = self.header_rate == 0.0
                    || !matches!(self.source, Source::Headers | Source::Observed);
                // A rounded reset under two seconds bounds little from above: the bucket may
                // refill within a fraction of a second, at this rate or many times it.
                let loose = r.coarse && reset < Duration::from_secs(2);
                if fresh {
                    self.header_rate = sample;
                    self.header_rate_loose = loose;
                } else if whole_seconds {
                    if sample >= 0.98 * self.header_rate {
                        self.header_rate = sample;
                        self.header_rate_loose = loose;
                    } else {
                        self.header_rate *= 0.98;
                    }
                } else {
                    self.header_rate = 0.5 * sample + 0.5 * self.header_rate;
                    self.header_rate_loose = false;
                }
            }
        }
        let since = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
        if self.distrust_until.is_some() {
            self.source = Source::Observed;
            return; // the level follows the 429s, not `remaining`
        }
        self.source = Source::Headers;
        let floor = self.floor.unwrap_or(0.0);
        self.burst = (r.limit - floor).max(1.0);
        let sent_after = (self.sent - ticket.seq).max(0.0) + self.unanswered_before(ticket);
        // The upstream counted `remaining` when the attempt arrived, somewhere between the send
        // and now. Credit refill for at most the fastest round trip seen (none before one is
        // known): a slow connect or a busy machine must not inflate the level. The slack covers
        // the rest.
        let credit = self.min_rtt.map_or(0.0, |m| since.min(m));
        let slack = (self.header_rate * RESYNC_SLACK_TIME.as_secs_f64()).max(1.0);
        // With a cap below the headers' rate (others draw on the key too), only this pacer's
        // share of the reported headroom is ours: every corral on the key sees the same report.
        let share = match self.cap {
            Some(c) if self.header_rate > 0.0 => (c.at(now) / self.header_rate).min(1.0),
            _ => 1.0,
        };
        let headroom = (r.remaining - floor) + self.header_rate * credit;
        let level = headroom * share - sent_after - slack;
        // However much was sent since, the level owes at most one burst (the upstream refuses
        // what its bucket cannot hold, it does not bank it as debt).
        let level = level.min(self.burst).min(self.verified).max(-self.burst);
        // A report newer than the last one used sets the level; an older one (an answer that
        // took long describes the bucket as it was long ago) may only lower it.
        if ticket.seq > self.synced_seq {
            self.synced_seq = ticket.seq;
            self.level = level;
        } else {
            self.level = self.level.min(level);
        }
    }
}

#[cfg(test)]
mod tests;
