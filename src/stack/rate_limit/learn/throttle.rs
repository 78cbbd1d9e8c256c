//! What the 429s show: throttle windows that estimate the upstream's rate, the cuts that
//! guess it, and their way back (see the module doc of `learn`).

use std::time::Duration;

use tokio::time::Instant;

use super::{
    Pacer, Source, Ticket, ALONE, BETA, GROWTH, GUESS_BETA, GUESS_GROWTH, GUESS_HOLD, HOLD,
    MAX_GAP, MAX_SCALE, MIN_PRESSURE, MIN_RATE, MIN_SCALE, MIN_WINDOW, PAUSE_SENDS, RAMP_RTT_GUESS,
    REPEAT, SHARE_GROWTH, STORM,
};

/// A guess compounds past the pace it was cut from for at most this long ([`Cap::at`]).
const COMPOUND_FOR: Duration = Duration::from_secs(30);

/// Throttle windows short of an estimate floor a cut once they hold this many units admitted
/// (two or three sends over a few milliseconds say little; a floor set high by that noise
/// costs the next window a 429 or two, after which the windows say more).
const PARTIAL_WINDOW_UNITS: f64 = 5.0;

/// What the 429s have shown (see the module doc: throttle windows).
#[derive(Debug, Default)]
pub(super) struct Throttles {
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
    /// The last send, and the longest gap between two sends since the last event: a window
    /// with a long silence in it (a pause, the upstream's or a fleet peer's, or no demand)
    /// saw the bucket refill unasked.
    last_send: Option<Instant>,
    idle: Duration,
    /// The latest estimate, until the fleet lease takes it to share ([`Pacer::take_estimate`]).
    estimated: Option<f64>,
}

impl Throttles {
    /// A send at `now`.
    pub(super) fn sent(&mut self, now: Instant) {
        if let Some(last) = self.last_send {
            self.idle = self.idle.max(now.saturating_duration_since(last));
        }
        self.last_send = Some(now);
    }
}

/// A cap on the pace from the 429s: this pacer's share of the upstream's rate. It holds for a
/// while, then grows additively (so corrals sharing a key, each cutting multiplicatively on its
/// own 429s, drift toward equal shares, as AIMD flows do); a guess, past the pace it was cut
/// from, compounds for a while ([`Cap::at`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Cap {
    pub(super) rate: f64,
    pub(super) since: Instant,
    pub(super) hold: Duration,
    /// Growth after the hold, units per second per second (a guess's until it is back where
    /// it was cut from, then it compounds: see [`Cap::at`]).
    pub(super) slope: f64,
    /// The pace before a cut (`None` for an estimate, which is evidence, not a guess).
    pub(super) before: Option<f64>,
    /// Whether the cut is on its way back: set when a long pause followed it (a storm, not a
    /// bucket's edge), successes then raise `rate` toward `before`, doubling it per round trip.
    pub(super) recovering: bool,
}

impl Cap {
    pub(super) fn at(&self, now: Instant) -> f64 {
        let t = now
            .saturating_duration_since(self.since + self.hold)
            .as_secs_f64();
        match self.before {
            // A guess steps back toward the pace it was cut from, then compounds by
            // `GUESS_GROWTH` a second past it: past where it was cut from with no refusal,
            // the edge that cut it has moved (an acceleration limit allows more the more is
            // sent), and a fixed step would take ever longer to find it. Short of that pace
            // nothing says the edge moved, and the guess steps as it always did. A storm's way
            // back (`recovering`) doubles per round trip instead. The pace never runs past
            // twice what is sent all the same (`Pacer::pace`).
            Some(before) if self.slope > 0.0 && !self.recovering => {
                let back = (before - self.rate).max(0.0) / self.slope;
                if t <= back {
                    return self.rate + self.slope * t;
                }
                // Compounding for `COMPOUND_FOR` at most (17 times where it was cut from),
                // then stepping by a tenth of that a second: a cap left alone for hours is
                // published to the fleet's peers (`Pacer::fleet_pace`) and must stay finite.
                let past = t - back;
                let compounding = past.min(COMPOUND_FOR.as_secs_f64());
                let top = self.rate.max(before) * (1.0 + GUESS_GROWTH).powf(compounding);
                top * (1.0 + GUESS_GROWTH * (past - compounding))
            }
            _ => self.rate + self.slope * t,
        }
    }
}

impl Pacer {
    /// A success after a cut: the attempt's units per its round trip back on the cap, so the
    /// pace doubles per round trip until it is back where the cut found it.
    pub(super) fn recover(&mut self, ticket: Ticket, units: f64, rtt: f64) {
        if !self.consented(ticket) {
            self.recover_per(ticket, units, rtt.max(self.min_rtt.unwrap_or(0.0)));
        }
    }

    /// [`Pacer::recover`] by `units` per `rtt` seconds (an answer's round trip, or the wait
    /// after which silence is consent).
    pub(super) fn recover_per(&mut self, ticket: Ticket, units: f64, rtt: f64) {
        let after_cut = ticket.seq > self.throttle_log.cut_seq;
        if let Some(cap) = self.cap.as_mut().filter(|c| after_cut && c.recovering) {
            if let Some(to) = cap.before.filter(|to| cap.rate < *to) {
                cap.rate = (cap.rate + units / rtt.max(1e-3)).min(to);
            }
        }
    }

    /// Whether the pace is on its way back from a storm (see [`Pacer::long_pause`]).
    pub(super) fn recovering(&self) -> bool {
        self.source == Source::Aimd && self.cap.is_some_and(|c| c.recovering)
    }

    /// A 429 from this bucket: it was empty when `ticket` arrived.
    pub(super) fn throttled(&mut self, ticket: Ticket, now: Instant) {
        self.level = self.level.min(0.0);
        let log = &mut self.throttle_log;
        if log.last.is_none_or(|l| ticket.seq > l.seq) {
            log.refused += ticket.cost;
        }
        self.drain.refused(ticket.seq, ticket.cost);
        self.drain.edge = true;
        if ticket.seq <= log.cut_seq {
            return; // sent before the last event was taken in: part of it
        }
        self.event(ticket, now, true);
        if self.cap.is_some_and(|c| c.since == now) {
            self.peer_cap = false;
        }
    }

    /// The pace the 429s cap, for a `[fleet]` replica on a key whose rate only they show and
    /// that no shared bucket divides (`None` otherwise): what it publishes for the replicas to
    /// split by demand ([`Pacer::fleet_scale`]).
    pub fn fleet_pace(&self, now: Instant) -> Option<f64> {
        self.cap.filter(|_| self.splits()).map(|c| c.at(now))
    }

    /// Whether the pace is split with the fleet's: see [`Pacer::fleet_pace`].
    pub(super) fn splits(&self) -> bool {
        self.fleet && !self.fleet_bucket && self.source == Source::Aimd
    }

    /// This replica's part of the fleet's paces split by demand, as a multiple of its own
    /// (`scale`): it sends at that, while its own pace goes on moving with its 429s.
    pub fn fleet_scale(&mut self, scale: f64, now: Instant) {
        if !self.splits() || !scale.is_finite() {
            return;
        }
        self.refill(now);
        self.fleet_scale = scale.clamp(MIN_SCALE, MAX_SCALE);
        self.rate = self.pace(now);
    }

    /// A peer on the key (a fleet replica) met this bucket empty `now`: the moment ends a
    /// throttle window as this pacer's own 429s do, since what this pacer sent since the last
    /// one is its share of what the upstream refilled, whoever was refused. So every replica
    /// learns its share from every refusal in the fleet, not only from its own, and the shares
    /// add up to the key's rate. Without an estimate yet it cuts as its own 429 would: the
    /// fleet as a whole is over the key's rate, so every replica sending into it cuts (as AIMD
    /// flows on one link all back off), and a ramp ends where the fleet found the edge. Under
    /// the provider's headers it is ignored: the fleet shares their bucket instead.
    ///
    /// `phase` (uniform in [0, 1)) is the part of a unit the level starts below empty: the
    /// replicas hear of one refusal at the same moment and would refill from empty in step,
    /// each sending its next request into the empty bucket within a millisecond of the others
    /// (a herd of the fleet's own making, a 429 each). Spread over one interval of the pace,
    /// the first to send finds the edge and the others hear of it before they send.
    pub fn peer_throttled(&mut self, now: Instant, phase: f64) {
        if matches!(self.source, Source::Headers | Source::Observed) {
            return;
        }
        self.refill(now);
        self.level = self.level.min(-phase.clamp(0.0, 1.0));
        if self.sent <= self.throttle_log.cut_seq {
            return; // nothing sent since the last event: the window is empty
        }
        let edge = Ticket {
            sent_at: now,
            seq: self.sent,
            cost: 0.0,
        };
        self.event(edge, now, true);
        if self.cap.is_some_and(|c| c.since == now) {
            self.peer_cap = true;
        }
        self.rate = self.pace(now);
    }

    /// Whether a bucket the fleet shares through Redis divides the key (`divided`). A pacer
    /// blind to the key's rate (no headers) then neither cuts nor caps on its 429s: the
    /// refusal empties the shared bucket for every replica (`lease.lua`), which is the fleet's
    /// answer to it, and a cut here would only hand this replica's part to its peers, to leave
    /// it crawling through its queue once they are done (four replicas sharing a configured
    /// limit, one of them cut four times in its first second: its last requests came in at a
    /// ninth of the key's rate, 1.2-2.5x the bound). Past slow start it does not gate: the
    /// shared bucket does.
    pub fn fleet_bucket(&mut self, divided: bool) {
        if divided && !self.fleet_bucket && self.blind() {
            self.cap = None;
            self.peer_cap = false;
        }
        self.fleet_bucket = divided;
    }

    /// Whether the shared bucket paces this pacer's key alone ([`Pacer::fleet_bucket`]).
    pub(super) fn paced_by_fleet(&self) -> bool {
        self.fleet_bucket && self.blind()
    }

    fn blind(&self) -> bool {
        !matches!(self.source, Source::Headers | Source::Observed)
    }

    /// The provider's headers came: a cap the fleet set before them (a peer's refusal, or the
    /// replicas' shares) gives way to the key's rate they carry. One of its own 429s stays.
    pub(super) fn drop_peer_cap(&mut self) {
        if self.peer_cap && self.source != Source::Headers {
            self.cap = None;
            self.peer_cap = false;
        }
    }

    /// This pacer's newest share of the key's rate from the 429s (a throttle window's
    /// estimate), once, to share with the fleet; `None` when the provider's headers pace it
    /// (the fleet shares the headers' bucket instead).
    pub fn take_estimate(&mut self) -> Option<f64> {
        let e = self.throttle_log.estimated.take();
        e.filter(|_| !matches!(self.source, Source::Headers | Source::Observed))
    }

    /// The fleet's share for this pacer: the key's rate as the replicas' estimates add up, split
    /// by their demand. Evidence as an estimate is: it caps the pace as one would, holding
    /// before it probes upward. Ignored under the provider's headers.
    pub fn fleet_share(&mut self, rate: f64, now: Instant) {
        if matches!(self.source, Source::Headers | Source::Observed) {
            return;
        }
        self.refill(now);
        let rate = rate.max(MIN_RATE);
        self.peer_cap = true;
        self.cap = Some(Cap {
            rate,
            since: now,
            hold: HOLD,
            slope: GROWTH * rate,
            before: None,
            recovering: false,
        });
        self.rate = self.pace(now);
    }

    /// A throttle event marked by `ticket` (its own or a peer's): close the window since the last
    /// one, and cap the pace, or cut it (`may_cut`).
    fn event(&mut self, ticket: Ticket, now: Instant, may_cut: bool) {
        let log = &mut self.throttle_log;
        let mut estimate = None;
        match log.last {
            Some(last) if ticket.sent_at > last.sent_at => {
                let span = ticket.sent_at.duration_since(last.sent_at);
                let between = (ticket.seq - ticket.cost) - last.seq;
                let secs = span.as_secs_f64();
                // A window says what the upstream refilled only if corral kept asking
                // throughout: sparse sends, or a silence of half the window (a named pause of
                // a whole second for a refill of milliseconds), saw a bucket that may have
                // filled up, and are no estimate.
                let asked = between >= MIN_PRESSURE * secs && log.idle * 2 <= span;
                if span <= MAX_GAP && asked {
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
        log.idle = Duration::ZERO;
        let headers_pace =
            matches!(self.source, Source::Headers | Source::Observed) && self.header_rate > 0.0;
        match estimate {
            _ if self.paced_by_fleet() => {}
            Some(e) => {
                // What the upstream admitted between two moments it was empty: the rate
                // itself, with no floor from the last second's successes (after a lull that
                // let the bucket fill, they count its drain too, and four replicas each
                // holding to that would share out more than the key refills).
                let e = e.max(MIN_RATE);
                self.throttle_log.estimated = Some(e);
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
            None if may_cut && (repeat || !headers_pace) => self.cut(now),
            None => {}
        }
        if !matches!(self.source, Source::Headers | Source::Observed) {
            self.source = Source::Aimd;
        }
        self.admitted.edge(ticket.sent_at);
    }

    /// Whether the last success's report showed at least half the bucket left (or none came
    /// yet): a refusal right after clear headroom is not this sender's overrun. A bucket shared
    /// with others runs near empty, and its refusals stay evidence about the pace.
    pub fn had_headroom(&self) -> bool {
        self.last_ok_share.is_none_or(|share| share >= 0.5)
    }

    /// This pacer's bucket refused with a named wait by whose end its report says it is full
    /// again (`Throttle::own_wait`): the refusal is no sign that sending as fast as the report
    /// allows overran it (an admission control's queue, not a bucket's edge), so the headroom
    /// the report shows after the wait needs no confirming. A client that honours the hint
    /// resends every refused request then; so may corral.
    pub fn full_after(&mut self) {
        if self.source == Source::Headers {
            self.verified = self.verified.max(self.burst);
        }
    }

    /// The upstream named a long wait (longer than [`STORM`]): what follows is a storm, not a
    /// bucket's edge found by pacing, so a cut's way back is by doubling per round trip
    /// (TCP's slow start after a timeout) rather than by its slow growth.
    pub fn long_pause(&mut self, wait: Duration) {
        if wait > STORM {
            if let Some(cap) = self.cap.as_mut().filter(|c| c.before.is_some()) {
                cap.recovering = true;
            }
        }
    }

    /// A success sent at `sent`, the one before it at `previous`, and a cut in between: when
    /// nothing was admitted for longer than [`STORM`] and [`PAUSE_SENDS`] sends into that gap
    /// were refused (by when they were sent, not by when their answers came), the upstream
    /// paused without naming it (a fixed window that opens on the clock, an outage), and the
    /// cuts that met it were a storm's, not a bucket's edge: they recover as after a long pause
    /// it named ([`Pacer::long_pause`]). A bucket that refills as it goes
    /// admits the cut pace's next send or the one after; a window that reopens only after
    /// seconds left a pace cut by each refused probe to crawl at a few a second through
    /// windows of a hundred (`azure-responses`: 439 of 500 done in 120 s for a 40 s bound).
    pub(super) fn unnamed_pause(&mut self, previous: Instant, sent: Instant) -> bool {
        let paused = self.paused_between(previous, sent);
        if let Some(cap) = self.cap.as_mut() {
            if paused && !cap.recovering && cap.before.is_some() && cap.since > previous {
                cap.recovering = true;
            }
        }
        paused
    }

    /// Whether nothing sent between `previous` and `sent` was admitted for longer than
    /// [`STORM`], with [`PAUSE_SENDS`] sends into that gap refused.
    fn paused_between(&self, previous: Instant, sent: Instant) -> bool {
        let gap = sent.saturating_duration_since(previous);
        let refused = self
            .refused_sent
            .iter()
            .filter(|&&at| at > previous && at < sent)
            .count();
        gap > STORM && refused >= PAUSE_SENDS
    }

    /// This pacer's bucket refused and the upstream named when it takes the next send
    /// (`until`): a level only corral keeps (no report resynchronises it) starts from nothing
    /// then, not from what its pace would have banked over the wait. Banked, it went out in
    /// one burst when the pause ended, and the bucket refused all of it past what it held
    /// (`together`, a bucket of 20 refilled at 20/s naming `retry-after: 1`: 34 sent within
    /// 3 ms of each pause's end, 12 refused). From nothing, the sends are spread at the pace
    /// and the first refusal stops them.
    pub fn hold(&mut self, until: Instant) {
        self.clock.named(until);
        if matches!(self.source, Source::Aimd | Source::Observed) {
            self.level = self.level.min(0.0);
            self.held_until = Some(self.held_until.map_or(until, |h| h.max(until)));
        }
    }

    /// The attempt admitted with `ticket` was refused on the request's or the key's own
    /// account, whatever the pace (an admission control's queue, see
    /// `Partition::admission_control`; a quota): the upstream answered and no bucket was the
    /// refuser, so in slow start the answer grows the ramp as a success's does (its slot back
    /// came with the refusal). Held to its slot, a fleet's ramp stayed at the window its first
    /// refusals found: ten attempts per round trip per replica, and four corrals on a key out of
    /// quota told their 500 clients so over 5.6 s, the SDK alone over 3.4 s.
    pub fn refused_by_queue(&mut self, ticket: Ticket) {
        if self.source == Source::SlowStart && !self.consented(ticket) {
            self.level += 1.0;
            self.slow_start_grew();
        }
    }

    /// The 429s that cut this pace were an admission control's, not the bucket's edge (see
    /// `Partition::admission_control`): the pace goes back to where they found it, the ramp
    /// it was on when nothing had refused it.
    pub fn forget_cuts(&mut self) {
        if self.source == Source::Aimd && self.cap.is_some() {
            self.cap = None;
            self.floor = None;
            self.source = Source::SlowStart;
            // Back to the window the ramp had, less what is out: the aimd pace's burst (half a
            // second of a pace cut from one refusal) held an admission-controlled upstream,
            // which refuses each request twice whatever the rate, to 2.4 requests per
            // refusal's round trip, and its herd's first answers to the fifth second.
            let window = self.ramp_window.take().unwrap_or(0.0);
            let out = self.unanswered.len() as f64;
            self.burst = self.burst.max(window);
            self.level = self.level.max(0.0).max(window - out);
        }
    }

    /// Cut the pace by `BETA` (`GUESS_BETA` from slow start before any answer; from the
    /// measured send rate when nothing paces yet), never below what the upstream admitted over
    /// the last window.
    fn cut(&mut self, now: Instant) {
        let ramp = self.rate <= 0.0;
        let current = if !ramp {
            self.rate / self.margin
        } else {
            // Nothing paced yet (slow start): the send rate measured is the ramp's, which
            // spreads a window over the wait for its silence, a few milliseconds on a near
            // upstream. Taken whole it starts the cuts at thousands a second, and each cut
            // down to a bucket of 20/s costs a 429 or more (30-50 in `gemini` at full scale):
            // the window over the round trip guessed before one is known is the most a cut
            // starts from.
            self.meter
                .current(now)
                .min(self.burst.max(1.0) / RAMP_RTT_GUESS)
        };
        let lag = Duration::from_secs_f64(self.min_rtt.unwrap_or(0.0));
        // The windows added up so far, short of an estimate, already show what the upstream
        // refilled between moments it was empty: a cut does not go below them once they hold
        // enough units to say it.
        let log = &self.throttle_log;
        let windows = if log.units >= PARTIAL_WINDOW_UNITS && log.secs > 0.0 {
            log.units / log.secs
        } else {
            0.0
        };
        // A cut from slow start before any answer cuts the ramp's guess, not a rate the
        // upstream took: halved, as TCP halves its window, rather than eased. Only that one:
        // halving every cut until an answer came drove four corrals on one key behind 3 s
        // answers, each cut by the others' sends, to 1.2-2.8x the bound (1.02-1.18x before).
        let beta = if ramp && self.min_rtt.is_none() {
            GUESS_BETA
        } else {
            BETA
        };
        // What this corral sends at and was admitted at; the cap is its own, before a fleet's
        // split by demand scales it (`Pacer::fleet_scale`), so the cut is taken back to the
        // cap's terms. Cutting the scaled pace into the cap multiplied a replica's cap by
        // `BETA` times its scale at each 429: at a scale of 3.5 each cut raised it 2.5 times,
        // to billions a second within 20 ms, and four corrals on Redis sent 20,000 requests
        // into a bucket of 20 a second (in about one run of seven of `no-headers`).
        let scale = if self.splits() { self.fleet_scale } else { 1.0 };
        let current = current / scale;
        let rate = ((current * beta)
            .max(self.admitted.rate(now, lag) / scale)
            .max(windows / scale))
        .max(MIN_RATE);
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
        if self.source == Source::SlowStart {
            self.ramp_window = Some(self.burst);
        }
        if matches!(self.source, Source::SlowStart | Source::None) {
            self.source = Source::Aimd;
        }
    }
}
