//! What the reports show of others drawing on the key: between two answers' reports, the
//! bucket lost what the reports' `remaining` fell by plus what it refilled, and whatever of that
//! this pacer did not send, someone else did (see [`Pacer::drained`]).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::throttle::Cap;
use super::{
    Pacer, Ticket, ALONE, DRAIN_UNITS, MAX_GAP, MIN_PRESSURE, MIN_RATE, MIN_WINDOW, SHARE_GROWTH,
};

/// A report is taken only of a send this far from this pacer's others ([`Drain::apart`]).
const APART: Duration = Duration::from_millis(2);
/// Sends remembered for that.
const SENDS_KEPT: usize = 1024;

/// Reports' drain added up toward a share (see [`Pacer::drained`]).
#[derive(Debug, Default)]
pub(super) struct Drain {
    /// The last report taken: its attempt's sequence number and send, and the headroom it
    /// reported.
    last: Option<(f64, Instant, f64)>,
    /// Units refused since that attempt.
    refused: f64,
    /// Units this pacer had admitted, units the bucket gave out, and the span, since the last
    /// share was taken.
    own: f64,
    all: f64,
    secs: f64,
    /// Stretches added up, and those at whose end this pacer's level could not send: a share
    /// says something only of a pacer held back by the bucket, not of one whose clients asked
    /// little (a herd's last requests read as a fifth of the key).
    stretches: u32,
    held: u32,
    /// Sends since the last report taken, `SENDS_KEPT` at most: sequence number and when.
    sends: VecDeque<(f64, Instant)>,
    /// A report or a 429 has shown the bucket empty.
    pub(super) edge: bool,
}

impl Drain {
    /// A send of one request as `seq` (remembered for [`Self::apart`]).
    pub(super) fn sent(&mut self, seq: f64, at: Instant) {
        if self.sends.len() >= SENDS_KEPT {
            self.sends.pop_front();
        }
        self.sends.push_back((seq, at));
    }

    /// Whether `ticket` was sent at least `APART` from this pacer's sends before and after it.
    /// Sends closer together may reach the upstream in either order (each on its own
    /// connection and task), and a report then counts a burst's later sends before its own:
    /// one report read 18 units gone where one was sent (43 in another), a lone corral took
    /// itself for a fifth of its key, and a herd with long answers took 1.4-2.7x its bound.
    /// Between two reports of sends set apart, every send in between arrived in between, in
    /// whatever order.
    fn apart(&self, ticket: Ticket, now: Instant) -> bool {
        let Ok(i) = self
            .sends
            .binary_search_by(|(seq, _)| seq.total_cmp(&ticket.seq))
        else {
            return false;
        };
        let before = i.checked_sub(1).map(|j| self.sends[j].1);
        let after = self.sends.get(i + 1).map(|(_, at)| *at);
        before.is_none_or(|b| ticket.sent_at.saturating_duration_since(b) >= APART)
            && after
                .unwrap_or(now)
                .saturating_duration_since(ticket.sent_at)
                >= APART
    }

    /// Count the next window from nothing (a share taken, or a stretch that says nothing).
    fn restart(&mut self) {
        (self.own, self.all, self.secs, self.held, self.stretches) = (0.0, 0.0, 0.0, 0, 0);
    }

    /// A refusal of `units` sent as `seq`: not given out by the bucket.
    pub(super) fn refused(&mut self, seq: f64, units: f64) {
        if self.last.is_none_or(|(last, ..)| seq > last) {
            self.refused += units;
        }
    }
}

impl Pacer {
    /// A success whose trusted report left `headroom` (its `remaining` above the floor) once
    /// the upstream had counted it. Between it and the previous one the bucket gave out what
    /// `remaining` fell by plus the refill of the time between their sends, and this pacer sent
    /// its own part of that; the rest went to others on the key. Added up over `DRAIN_UNITS`
    /// given out, a share well under the whole (`ALONE`), of a pacer that kept asking (held back
    /// by its level at the end of at least half the stretches), caps the pace at that share of
    /// the headers' rate (growing at once, as a throttle window's shared estimate does); a share
    /// near the whole while the bucket fills lifts such a cap (the others have gone). So corrals
    /// on one key without shared state find their shares from the reports every answer carries,
    /// not from the 429s that the whole rate each would otherwise send draws: four of them drew
    /// 19-23 rate 429s in 500 at full scale, most while cutting down to their shares. A stretch
    /// in which either report showed the bucket full says nothing (its refill may have
    /// overflowed). Corrals in a `[fleet]` share the key's bucket through Redis instead, and do
    /// not count.
    pub(super) fn drained(&mut self, ticket: Ticket, headroom: f64, now: Instant) {
        let (rate, full) = (
            self.header_rate,
            self.reported_size.unwrap_or(f64::INFINITY),
        );
        let level = self.level;
        if self.fleet || self.header_rate_loose || rate <= 0.0 {
            return;
        }
        // Until a report or a 429 shows the bucket empty, it holds what nobody has asked for
        // yet: a corral's first sends drain it in bursts, and no share shows in them.
        self.drain.edge |= headroom < 1.0;
        if !self.drain.edge || !self.drain.apart(ticket, now) {
            return;
        }
        let capped = self.share_capped();
        let d = &mut self.drain;
        if d.last.is_some_and(|(seq, ..)| ticket.seq <= seq) {
            return; // an older report than the last one taken
        }
        // No later report is taken of an earlier send: what came before this one is done with.
        while d.sends.front().is_some_and(|(seq, _)| *seq < ticket.seq) {
            d.sends.pop_front();
        }
        let sample = (ticket.seq, ticket.sent_at, headroom);
        if let Some((seq, sent, before)) = d.last.replace(sample) {
            let secs = ticket.sent_at.saturating_duration_since(sent).as_secs_f64();
            let topped = before >= full - 1.0 || headroom >= full - 1.0;
            if topped || secs > MAX_GAP.as_secs_f64() {
                d.restart();
            } else {
                let own = (ticket.seq - seq - d.refused).max(0.0);
                d.stretches += 1;
                if level < 1.0 {
                    d.held += 1;
                }
                d.own += own;
                d.all += (before - headroom + rate * secs).max(own);
                d.secs += secs;
            }
        }
        d.refused = 0.0;
        // A window is as good as the units it counts (each report's `remaining` is rounded to
        // one), whatever the key's rate. The first share is taken from half as many: until it
        // comes, each corral on the key sends as if alone, and that costs 429s.
        // A bucket that gives out little (the others gone, it fills) ends a window by time.
        let units = DRAIN_UNITS * if capped { 1.0 } else { 0.5 };
        if d.all < units && d.secs < MIN_WINDOW.as_secs_f64() {
            return;
        }
        let (own, all, secs) = (d.own, d.all, d.secs);
        let asked = own >= MIN_PRESSURE * secs && 2 * d.held >= d.stretches;
        d.restart();
        let share = own / all.max(1.0);
        // Lifted only while the bucket gives out less than it refills (it fills: the others
        // are gone); a burst of this pacer's own into an emptied bucket is no such sign.
        if share >= ALONE {
            if self.share_capped() && all <= rate * secs {
                self.cap = None;
            }
        } else if asked {
            self.cap = Some(Cap {
                rate: (share * rate).max(MIN_RATE),
                since: now,
                hold: Duration::ZERO,
                slope: SHARE_GROWTH * rate,
                before: None,
                recovering: false,
            });
        }
    }

    /// Whether the pace is capped at a share of the key (an estimate that grows at once), not
    /// by a cut or an estimate of the whole.
    fn share_capped(&self) -> bool {
        self.cap
            .is_some_and(|c| c.before.is_none() && c.hold.is_zero())
    }

    /// This pacer is a `[fleet]` replica: the fleet shares the key's bucket, and others' drain
    /// is not counted against it ([`Pacer::drained`]).
    pub fn in_fleet(&mut self) {
        self.fleet = true;
    }
}
