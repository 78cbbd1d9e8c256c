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
//!   when it saw the attempt, plus refill since, minus what corral sent after it, owing no
//!   more than sends yet to reach the bucket can take of its refill (what it cannot hold, it
//!   refuses). Reported headroom is spent no faster than answers confirm it (doubling per
//!   round trip), and a burst's 429s halve what is confirmed once, not once each.
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
//!   probes upward by `GROWTH` per second; a cut one (a guess) steps back faster, and past
//!   the pace it was cut from compounds. In a fleet
//!   without headers, a peer's 429 ends a window too ([`Pacer::peer_throttled`], each replica
//!   starting again at a phase of its own, so they do not all meet the empty bucket at once),
//!   and the replicas' estimates add up to the key's rate, split by demand
//!   ([`Pacer::fleet_share`]). An estimate takes no floor: it is what was admitted. Once a
//!   replica knows how many share the key, what it ramped to as if alone (slow start, and a
//!   cut guessed from that rush) shrinks to its part, so the fleet meets the edge as one
//!   corral would ([`Pacer::among`]). Between 429s the replicas' capped paces are split by
//!   demand ([`Pacer::fleet_scale`]), so their queues drain together. Under a bucket the fleet
//!   shares through Redis a blind pacer neither cuts nor gates past slow start
//!   ([`Pacer::fleet_bucket`]): the shared bucket paces the key.
//! - **Others' drain** (trusted headers, no `[fleet]`): between two answers' reports the bucket
//!   gave out what `remaining` fell by plus its refill, and what this pacer did not send of that,
//!   others did. Added up over a window, a share well under the whole caps the pace at that
//!   share of the key's rate before any 429 shows it; a share near the whole lifts such a cap
//!   (`learn/drain.rs`).
//! - **A second's quantum** (requests, a corral alone on its key): a report per minute may hide
//!   a bucket per second (OpenAI's quantized limits). Until the edge is found, a ramp past one
//!   second of the reported rate sends one probe and waits for it to be admitted
//!   (`learn/quantum.rs`).
//! - **Slow start** before anything is known: `initial_burst` requests go, each success lets two
//!   more go (doubling per round trip), and the first throttle ends it.
//! - **Silence is consent.** A bucket refuses at once; an answer takes the service time, for an
//!   LLM seconds. An attempt not refused within twice the slowest recent refusal (any 429 or
//!   overload: each shows how long this upstream takes to refuse; before one is seen, twice
//!   the slowest recent connection handshake plus `REFUSAL_WORK`, answers or not; `CONSENT`
//!   before a connection opened; `MIN_CONSENT` at least) was admitted, and confirms its units
//!   as a success would (its answer then adds nothing). So the ramp doubles per refusal round
//!   trip when answers are slower than that, not per answer: a herd behind answers of a
//!   fraction of a second or of seconds, on a key whose limit holds it all, is not held back
//!   by an answer's time per doubling.
//! - **No headers** (source `aimd`): the first 429 cuts the measured send rate by `BETA` (AWS's
//!   adaptive mode); throttle windows then estimate the rate as above.
//! - **Evidence bounds every cut.** Only 429s read as "the bucket is empty" reach
//!   [`Answer::RateLimited`] (an overload moves no pace). A cut never goes below what the
//!   upstream admitted from this pacer over the last `ADMITTED_WINDOW` (once a throttle event
//!   has found the bucket's edge, of attempts sent after the last one: a burst drawn from a
//!   full bucket before it is no rate; the last round trip's sends, unanswered, are left out
//!   of the span as well as the count), nor below what the throttle windows added up so far
//!   show once they hold a few units (short of `MIN_WINDOW` they give no estimate, but they
//!   are the upstream's refill, measured), and 429s of attempts
//!   sent before the last cut belong to it (at most one cut per round trip, as TCP does). When
//!   the upstream names a long wait (`STORM`), the cuts are a storm's, not a bucket edge's: after
//!   it each success of an attempt sent after the last cut adds its units per its own round
//!   trip, so the pace doubles per round trip back to where it was before the cuts (TCP's slow
//!   start after a timeout): one storm leaves no crawl behind it. So do the cuts before a pause
//!   no one named, measured instead: nothing admitted for longer than `STORM`, `PAUSE_SENDS`
//!   sent into that gap refused (counted by when they were sent: behind answers of seconds
//!   the window's own successes come back after the probes' refusals), then a success (a
//!   window that opens on the clock, as Azure's 10 s ones do when their 429s carry no hint:
//!   [`Pacer::unnamed_pause`]).
//! - **Windows that open on the clock** (requests, a corral alone on its key): each pause no
//!   one named that ends in a success is an opening; once two periods between openings agree,
//!   what the last whole window admitted goes at each opening and nothing after until just
//!   before the next is due, when probes look for it (`learn/clock.rs`: Azure's sub-windows,
//!   whose 429s on the Responses API name no wait).
//! - **A named pause ends at the pace.** The bucket that named a wait was empty: a level no
//!   report resynchronises (no headers, or demoted ones) banks nothing over the pause, so its
//!   end sends at the pace, not in one burst ([`Pacer::hold`]).
//! - **Instants rounded either way.** A whole-second reset instant is read as rounded up until
//!   one lies before its attempt was sent: then it was truncated, and the rate is learned from
//!   a second more than it says.
//! - **Settled, never owed.** A request larger than the burst goes at once, charged nothing
//!   here (the upstream's answer is the truth, and its report resynchronises the level); a
//!   request admitted past the pace is charged at most the burst, and the level never owes
//!   more than one burst.
//!
//! A pure state machine: every method takes `now`, so tests drive it in virtual time.

mod admit;
mod clock;
mod drain;
mod headers;
mod meter;
mod quantum;
mod throttle;

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::provider::{Kind, Report};

use self::clock::Clock;
use self::drain::Drain;
use self::meter::{Admitted, Meter};
use self::quantum::Quantum;
use self::throttle::{Cap, Throttles};

/// Multiplicative cut on a throttle without an estimate (AWS adaptive retry's beta).
const BETA: f64 = 0.7;
/// ...and by this for the cut from slow start before any answer (it cuts the ramp's guess).
const GUESS_BETA: f64 = 0.5;
/// No learned pace goes below this (requests or tokens per second).
const MIN_RATE: f64 = 0.5;
/// Slow start ends (ungated) once its window reaches this without a header or a throttle.
const SLOW_START_END: f64 = 4096.0;
/// Tickets unanswered this long are forgotten (their requests were cancelled or hang).
const FORGET_UNANSWERED: Duration = Duration::from_secs(600);
/// At most this many unanswered tickets are remembered (the oldest go first).
const MAX_UNANSWERED: usize = 16_384;
/// Held back when resynchronising the level from a report: the refill of this long (the
/// uncertainty in when the upstream counted), at most the refill credited, and at least one
/// token.
const RESYNC_SLACK_TIME: Duration = Duration::from_millis(10);
/// With nothing in flight and no answer for this long, one request goes whatever the level:
/// a storm's cuts never hold a lone request.
const IDLE: Duration = Duration::from_millis(250);
/// In slow start, one more request goes after this long without an answer.
const SLOW_START_STALL: Duration = Duration::from_secs(1);
/// Before any refusal is seen, an attempt unanswered this long was admitted: a bucket refuses
/// at once, an answer takes the service time ([`Pacer::consent`]). Once refusals are seen, twice
/// the slowest recent one, but at least `MIN_CONSENT` (a timer's tick and a busy scheduler).
/// Before a refusal, once a connection to the upstream has opened: twice
/// its handshake (a round trip, two with TLS) plus `REFUSAL_WORK`, the time a front door takes
/// to refuse beyond the network, within `MIN_CONSENT..=CONSENT`. A herd's requests reach it at
/// once and it reads them one after another: behind a Python upstream on loopback (handshakes
/// of 0.1 ms), 10 ms of work let corral send 488 of 500 before the first refusal came back,
/// 300 of them refused (`azure`, a window of 200); 20 ms, 32; 30 ms, 2; 40 ms, 2-3 in five
/// runs. The price is the ramp's: a herd of 500 behind answers of 3 s on a limit that holds it
/// all starts 0.25 s later than at 10 ms.
const CONSENT: Duration = Duration::from_millis(500);
const MIN_CONSENT: Duration = Duration::from_millis(10);
const REFUSAL_WORK: Duration = Duration::from_millis(40);
/// Throttle windows are added up until they span this much before they give an estimate.
const MIN_WINDOW: Duration = Duration::from_secs(1);
/// The round trip assumed for spreading a ramp's sends before one is measured.
const RAMP_RTT_GUESS: f64 = 0.1;
/// A ramp's sends due this long ago may still go back to back (timers tick per millisecond).
const RAMP_CATCH_UP: Duration = Duration::from_millis(2);
/// A throttle window counts only if at least this many units per second were sent in it.
const MIN_PRESSURE: f64 = 2.0;
/// The reports' drain is added up until the bucket gave out this many units before it gives a
/// share ([`Pacer::drained`]): each report is rounded to a unit, so a share is good to a tenth.
const DRAIN_UNITS: f64 = 20.0;
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
/// A cut (a guess, not an estimate) holds this long, then steps by `GUESS_GROWTH` of itself a
/// second back to the pace it was cut from, and past that compounds by it (`Cap::at`).
const GUESS_HOLD: Duration = Duration::from_millis(500);
const GUESS_GROWTH: f64 = 0.1;
/// A report whose reset is further away than this counts a long window, not a refill.
const LONG_REPORT: Duration = Duration::from_secs(3600);
/// An estimate from the 429s this many times the headers' rate says the report counts another
/// window than the bucket that refuses.
const OTHER_UNIT: f64 = 2.0;
/// A named wait longer than this makes the cuts before it recover by doubling. A whole second
/// is what a `retry-after` rounded up to seconds names for a bucket's next token.
pub const STORM: Duration = Duration::from_secs(1);
/// A pace refused this many times in a row, for longer than `STORM`, met a pause, not the edge
/// of a bucket that refills as it goes (see [`Pacer::unnamed_pause`]).
const PAUSE_SENDS: usize = 4;
/// At most this many refusals' send times are kept ([`Pacer::unnamed_pause`] needs a few).
const REFUSALS_KEPT: usize = 64;
/// A cut never goes below what the upstream admitted over this window.
const ADMITTED_WINDOW: Duration = Duration::from_secs(1);
/// Admitted units are counted in slots of this length.
const ADMITTED_SLOT: Duration = Duration::from_millis(50);
/// A replica's part of the fleet's paces is at most this many times its own cap...
const MAX_SCALE: f64 = 16.0;
/// ...and at least this share of it: one that published no demand may have requests again
/// before its next word reaches the others, and its waiters sleep to the pace they were given.
const MIN_SCALE: f64 = 0.25;
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
    /// As a window that opens on the clock takes it (`learn/clock.rs`): counted as sent, the
    /// level untouched.
    Window,
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
    /// When the attempt was sent.
    pub fn sent_at(&self) -> Instant {
        self.sent_at
    }

    /// Units this one took.
    pub fn cost(&self) -> f64 {
        self.cost
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
    /// The level refills from this instant on ([`Pacer::hold`]).
    held_until: Option<Instant>,
    /// The `remaining` at which the upstream refuses (per-minute reports count from an offset).
    floor: Option<f64>,
    /// The refill rate the headers imply, `(limit - remaining) / reset`, smoothed.
    header_rate: f64,
    /// The reports' whole-second instants are truncated, not rounded up: one lay before its
    /// attempt was sent ([`Pacer::learn_headers`]).
    truncated: bool,
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
    /// Units sent when a 429 last halved `verified`: the 429s of attempts sent before belong
    /// to that halving.
    verified_cut_seq: f64,
    /// The newest ticket whose report set the level.
    synced_seq: f64,
    /// The fastest answer seen (seconds from send to head).
    min_rtt: Option<f64>,
    /// Units admitted up to this sequence number were confirmed by silence ([`Pacer::consent`]).
    consented_seq: f64,
    /// The slowest recent refusal (seconds from send to a 429 or an overload; each refusal
    /// halves the older ones' weight); `None` before the first.
    refusal_latency: Option<f64>,
    /// The slowest recent handshake of a connection to the upstream (seconds), the round trip's
    /// measure until a refusal gives a better one; `None` before the first connection.
    handshake: Option<f64>,
    /// While ramping (headroom not yet confirmed), sends are spread over the round trip instead
    /// of leaving in a burst when a batch of answers arrives: the next may go at this instant.
    /// A 429 comes back fast, pauses the partition and stops the rest of the round, so the
    /// round that finds the bucket's edge costs a 429 or two instead of half the round.
    next_send: Instant,
    /// Admitted and not yet answered, in admission order.
    unanswered: VecDeque<Ticket>,
    /// When the latest attempt answered with a success had been sent.
    last_ok_sent: Option<Instant>,
    /// When the attempts refused as rate 429s were sent, for those sent after the newest success's
    /// attempt (oldest first, at most [`REFUSALS_KEPT`]): a pause is told by what was sent into
    /// it, not by the order answers came back in.
    refused_sent: VecDeque<Instant>,
    throttle_log: Throttles,
    /// The windows that open on the clock, if the 429s show them (`learn/clock.rs`).
    clock: Clock,
    cap: Option<Cap>,
    /// The slow start's window when a cut ended it: the ramp [`Pacer::forget_cuts`] goes back to.
    ramp_window: Option<f64>,
    /// The cap was set by the fleet (a peer's refusal, or the replicas' shares), for a key
    /// whose rate only the 429s show: the provider's headers, once they come, replace it.
    peer_cap: bool,
    /// Corrals that read the same reports of the key's bucket with nothing dividing it (fleet
    /// replicas with no shared bucket for this kind): each takes this part of what they report.
    replicas: f64,
    /// The replicas the slow start is already split among ([`Pacer::among`]).
    ramp_among: f64,
    /// With `[fleet]`: the live replicas on the key, whatever divides it: each one's part of
    /// the second a quantized limit may enforce ([`Pacer::fleet_live`]).
    live: f64,
    /// While set and in the future, the headers' level is not believed (demoted).
    distrust_until: Option<Instant>,
    demotions: u32,
    /// The last `remaining` reported, for `/status` and the gauge.
    pub last_remaining: Option<f64>,
    /// The ticket whose answer reported `last_remaining`: what was sent after it, the report
    /// has not seen.
    remaining_seq: Option<f64>,
    /// The share of its `limit` the last success's report had left.
    last_ok_share: Option<f64>,
    /// The bucket the reports describe: `limit` less the learned floor.
    reported_size: Option<f64>,
    /// 429s and 529s attributed to this bucket.
    pub throttles: u64,
    admitted: Admitted,
    /// Others' drain on the key, from the reports ([`Pacer::drained`]).
    drain: Drain,
    /// Sends over the last second while a per-minute report may hide a per-second bucket.
    quantum: Quantum,
    /// A `[fleet]` replica ([`Pacer::in_fleet`]).
    fleet: bool,
    /// A bucket the fleet shares through Redis (configured, or learned from the headers)
    /// divides the key among the replicas ([`Pacer::fleet_bucket`]).
    fleet_bucket: bool,
    /// This replica's part of the fleet's paces split by demand, as a multiple of its own cap
    /// ([`Pacer::fleet_scale`]).
    fleet_scale: f64,
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
            held_until: None,
            floor: None,
            header_rate: 0.0,
            header_rate_loose: false,
            truncated: false,
            sent: 0.0,
            meter: Meter {
                bucket_start: now,
                count: 0.0,
                rate: 0.0,
            },
            quiet_since: now,
            verified: f64::from(initial_burst.max(1)),
            verified_cut_seq: 0.0,
            synced_seq: f64::NEG_INFINITY,
            min_rtt: None,
            consented_seq: 0.0,
            refusal_latency: None,
            handshake: None,
            next_send: now,
            unanswered: VecDeque::new(),
            last_ok_sent: None,
            refused_sent: VecDeque::new(),
            throttle_log: Throttles::default(),
            clock: Clock::default(),
            cap: None,
            ramp_window: None,
            peer_cap: false,
            replicas: 1.0,
            ramp_among: 1.0,
            live: 1.0,
            distrust_until: None,
            demotions: 0,
            last_remaining: None,
            remaining_seq: None,
            reported_size: None,
            last_ok_share: None,
            throttles: 0,
            admitted: Admitted::default(),
            drain: Drain::default(),
            quantum: Quantum::default(),
            fleet_bucket: false,
            fleet_scale: 1.0,
            fleet: false,
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

    /// Whether `r` counts a long window rather than the bucket that refuses first: it is full
    /// again only hours from now, or (a requests report with a fine reset) the refill it
    /// implies would take hours to fill it from empty. Groq's requests per day read `remaining`
    /// 14,378 of 14,400 and a reset of 2m12s, the time to refill the 22 used at a day's pace:
    /// read as a bucket, that paced a key that takes 20 a second at one request per 6 s. A
    /// coarse reset (whole seconds, rounded up) says too little: one request of 10,000 a
    /// minute reads as a window of hours.
    fn long_window(&self, r: &Report) -> bool {
        let Some(reset) = r.reset else {
            return false;
        };
        let used = r.limit - r.remaining;
        reset > LONG_REPORT
            || (self.kind == Kind::Requests
                && !r.coarse
                && used > 0.0
                && reset.as_secs_f64() * r.limit / used > LONG_REPORT.as_secs_f64())
    }

    /// Units this pacer sent after the attempt whose answer reported `last_remaining`: the
    /// report has not seen them.
    pub fn unseen(&self) -> f64 {
        self.remaining_seq
            .map_or(0.0, |seq| (self.sent - seq).max(0.0))
    }

    /// How long until `units` could go at the current pace, if it is known.
    pub fn time_for(&self, units: f64) -> Option<Duration> {
        (self.rate > 0.0).then(|| Duration::from_secs_f64((units / self.rate).min(3600.0)))
    }

    /// The pace from the source, capped by what the 429s showed.
    fn pace(&self, now: Instant) -> f64 {
        let scale = if self.splits() { self.fleet_scale } else { 1.0 };
        let cap = self.cap.map(|c| {
            // A cap never runs far ahead of what is actually sent.
            c.at(now).min(c.rate.max(2.0 * self.meter.rate)) * scale
        });
        let base = match self.source {
            Source::Headers | Source::Observed => self.header_rate / self.part(),
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
        let from = self.held_until.map_or(self.last, |h| h.max(self.last));
        let dt = now.saturating_duration_since(from).as_secs_f64();
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
        self.level = (self.level + self.rate * dt).min(self.ceiling());
        self.consent(now);
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
        self.quantum.answered(ticket.seq, answer == Answer::Ok);
        // A report of a long window (a per-day quota, as Groq's request headers are): its rate
        // is a day's average and its `remaining` the day's, nothing about the bucket that
        // refuses first. The pacer learns as without headers; the quota's own 429 is read as
        // a long window.
        let report = match report {
            Some(r) if self.long_window(&r) => {
                self.last_remaining = Some(r.remaining);
                self.remaining_seq = Some(ticket.seq);
                None
            }
            other => other,
        };
        if answer == Answer::Ok {
            let rtt = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
            self.min_rtt = Some(self.min_rtt.map_or(rtt, |m| m.min(rtt)));
            let units = ticket.cost.max(1.0);
            let paused = self
                .last_ok_sent
                .is_some_and(|previous| self.unnamed_pause(previous, ticket.sent_at));
            self.clock_admitted(ticket, units, paused);
            let last_ok_sent = self
                .last_ok_sent
                .map_or(ticket.sent_at, |s| s.max(ticket.sent_at));
            self.last_ok_sent = Some(last_ok_sent);
            self.refused_sent.retain(|&sent| sent > last_ok_sent);
            self.admitted.record(now, ticket.sent_at, units);
            self.recover(ticket, units, rtt);
        }
        if matches!(answer, Answer::RateLimited | Answer::Overloaded) {
            self.throttles += 1;
        }
        if answer == Answer::RateLimited {
            self.clock_refused(ticket.sent_at);
        }
        if answer == Answer::RateLimited && self.last_ok_sent.is_none_or(|ok| ticket.sent_at > ok) {
            if self.refused_sent.len() >= REFUSALS_KEPT {
                self.refused_sent.pop_front();
            }
            self.refused_sent.push_back(ticket.sent_at);
        }
        if answer != Answer::Ok {
            // Any refusal shows how long this upstream takes to refuse (an overload too: it
            // comes from the same front door, and a slow one only makes silence wait longer).
            // Each refusal halves what older ones weigh: one slow 429 (a cold connection, a
            // body that trickled) does not hold consent off for good.
            let latency = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
            let older = self.refusal_latency.map_or(0.0, |l| l * 0.5);
            self.refusal_latency = Some(latency.max(older));
        }
        match report {
            Some(r) => self.learn_headers(ticket, answer, r, now),
            // A refusal that was not the bucket's (another bucket's, or the whole service's
            // overload) took nothing from it: its slot back.
            None if matches!(answer, Answer::RefusedElsewhere | Answer::Overloaded)
                && self.source == Source::SlowStart
                && !self.consented(ticket) =>
            {
                self.level += 1.0;
            }
            None if answer == Answer::Ok && self.source == Source::SlowStart => {
                // Its slot back and one more, unless its silence already gave them.
                if !self.consented(ticket) {
                    self.level += 2.0;
                }
                self.slow_start_grew();
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

    /// Slow start's window holds what its level grew to; at `SLOW_START_END` (thousands of
    /// answers, no header, no throttle: nothing to learn) it stops gating (a later 429 paces
    /// from the 429s).
    fn slow_start_grew(&mut self) {
        self.burst = self.burst.max(self.level);
        if self.burst >= SLOW_START_END {
            self.source = Source::None;
        }
    }
}

#[cfg(test)]
mod tests;
