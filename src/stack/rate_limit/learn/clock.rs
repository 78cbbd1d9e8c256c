//! Windows that open on the clock: an upstream that admits a fixed count per fixed window and
//! refuses the rest with 429s that name no wait. Azure enforces its per-minute limits over 1 s
//! or 10 s sub-windows, and its Responses API's 429s carry no `retry-after` and report `-1`
//! (`../shared/PROVIDERS.md`). A bucket that refills as it goes takes a cut pace's next send or
//! the one after; such a window takes nothing until it opens again, so the cut pace's probes
//! into it are all refused (`azure-responses`, 100 a 10 s window: about ten a window, plus the
//! herd each opening's ramp overran the window with, 75 rate 429s in 500 tasks).
//!
//! Each pause no one named that ends in a success (see [`Pacer::unnamed_pause`]) is an
//! opening; the time from one opening to the next, a period. Once two periods agree, the
//! window is learned: what the last whole window admitted goes at the opening, as the
//! upstream counts it, and then nothing until shortly before the next opening is due, when
//! probes go a fiftieth of the period apart until one is admitted (the new opening). Learned
//! only for the requests of a corral alone on its key (a fleet shares its refill otherwise),
//! and dropped when no opening comes within a period past the due one.

use std::time::Duration;

use tokio::time::Instant;

use super::{Admission, Pacer, Ticket};
use crate::provider::Kind;

/// Two periods agree when they are within this share of each other.
const AGREE: f64 = 0.2;
/// Probes for an opening begin this share of the period before it is due...
const EARLY: f64 = 0.05;
/// ...and go this share of the period apart, at least [`PROBE_MIN`].
const PROBE_SHARE: f64 = 0.02;
const PROBE_MIN: Duration = Duration::from_millis(20);
/// A period shorter than this is a bucket's refill seen through a storm, not a window.
const MIN_PERIOD: Duration = Duration::from_secs(2);

/// What the openings have shown ([`Pacer::clock_admitted`]).
#[derive(Debug, Default)]
pub(super) struct Clock {
    /// The latest opening: when its first admitted attempt was sent (the window was open by
    /// then), and the units sent before that attempt (its ticket's `seq` less its cost).
    opened: Option<(Instant, f64)>,
    /// When the last attempt refused before that opening was sent (the window was still
    /// closed then): the opening came between the two.
    closed: Option<Instant>,
    /// Units admitted of the attempts sent since `opened`.
    admitted: f64,
    /// The last period seen, and the learned one (two that agreed).
    last_period: Option<Duration>,
    period: Option<Duration>,
    /// What the last whole window admitted.
    capacity: Option<f64>,
    /// The current window refused an attempt sent within it: its count is spent.
    spent: bool,
    /// The next probe for an opening may go at this instant.
    next_probe: Option<Instant>,
    /// A wait was named since the last opening: that pause was the upstream's word.
    named: bool,
}

impl Clock {
    /// The learned window: its latest opening (instant, units sent before it), period and
    /// capacity.
    fn learned(&self) -> Option<(Instant, f64, Duration, f64)> {
        let (at, seq) = self.opened?;
        Some((at, seq, self.period?, self.capacity?))
    }

    /// When the learned window's next opening may come, less [`EARLY`]: a period after the
    /// latest one's earliest instant (the last refusal before it).
    fn probe_from(&self) -> Option<Instant> {
        let (at, _, period, _) = self.learned()?;
        let earliest = self.closed.map_or(at, |c| c.min(at));
        Some(earliest + period - period.mul_f64(EARLY))
    }

    /// The middle of the latest opening's span (see `closed`).
    fn middle(&self) -> Option<Instant> {
        let (at, _) = self.opened?;
        let closed = self.closed.map_or(at, |c| c.min(at));
        Some(closed + at.saturating_duration_since(closed) / 2)
    }

    /// The upstream named a wait: the pause it ends is no clock's.
    pub(super) fn named(&mut self) {
        self.named = true;
    }
}

impl Pacer {
    /// Whether the clock's window is learned and has a say for this pacer.
    fn clocked(&self) -> bool {
        self.kind == Kind::Requests && !self.fleet && self.clock.learned().is_some()
    }

    /// An attempt sent at its ticket's instant was admitted (`units`); `paused`: a pause no one
    /// named came before it. The first success, and each that ends such a pause or (once
    /// learned) comes from a probe for the next opening, opens a window.
    pub(super) fn clock_admitted(&mut self, ticket: Ticket, units: f64, paused: bool) {
        if self.kind != Kind::Requests || self.fleet {
            return;
        }
        let sent = ticket.sent_at;
        let closed = self
            .refused_sent
            .iter()
            .filter(|&&at| at < sent)
            .max()
            .copied();
        let c = &mut self.clock;
        let (Some((at, _)), Some(middle)) = (c.opened, c.middle()) else {
            c.opened = Some((sent, ticket.seq - ticket.cost));
            c.admitted = units;
            return;
        };
        let opening = match c.probe_from() {
            Some(from) => sent >= from,
            None => paused && !c.named,
        };
        if !opening {
            if sent >= at {
                c.admitted += units;
            }
            return;
        }
        let earliest = closed.filter(|&c| c > at).unwrap_or(sent);
        let period = (earliest + sent.saturating_duration_since(earliest) / 2)
            .saturating_duration_since(middle);
        if period >= MIN_PERIOD {
            let agree = |p: Duration| period.abs_diff(p).as_secs_f64() <= AGREE * p.as_secs_f64();
            c.period = match (c.period, c.last_period) {
                (Some(learned), _) if agree(learned) => Some((learned + period) / 2),
                (_, Some(last)) if agree(last) => Some((last + period) / 2),
                _ => None,
            };
            c.last_period = Some(period);
            c.capacity = Some(if c.spent || c.capacity.is_none() {
                c.admitted
            } else {
                c.capacity.unwrap_or(0.0).max(c.admitted)
            });
        }
        c.opened = Some((sent, ticket.seq - ticket.cost));
        c.closed = Some(earliest);
        c.admitted = units;
        c.spent = false;
        c.named = false;
        c.next_probe = None;
    }

    /// An attempt sent at `sent` was refused as a rate 429: sent within a window's open span,
    /// the window's count is spent.
    pub(super) fn clock_refused(&mut self, sent: Instant) {
        if self.clock.opened.is_some_and(|(at, _)| sent >= at)
            && self.clock.probe_from().is_none_or(|from| sent < from)
        {
            self.clock.spent = true;
        }
    }

    /// What the learned window says of one more request now: `None` when it has no say (not
    /// learned, or lost: no opening came within a period past the due one, and then it is
    /// forgotten), else admit it ([`Admission::Window`]) or wait so long.
    pub(super) fn clock_admits(&mut self, now: Instant) -> Option<Result<Admission, Duration>> {
        if !self.clocked() {
            return None;
        }
        let (at, seq, period, capacity) = self.clock.learned()?;
        let probe_from = self.clock.probe_from()?;
        if now >= at + period * 2 {
            self.clock = Clock::default();
            return None;
        }
        if now < probe_from {
            let used = self.sent - seq;
            if !self.clock.spent && used + 1.0 <= capacity {
                return Some(Ok(Admission::Window));
            }
            return Some(Err(probe_from - now));
        }
        match self.clock.next_probe {
            Some(next) if now < next => Some(Err(next - now)),
            _ => Some(Ok(Admission::Window)),
        }
    }

    /// A request went as the learned window admitted it at `now`: a probe for the opening
    /// spaces the next one.
    pub(super) fn clock_took(&mut self, now: Instant) {
        if let (Some((_, _, period, _)), Some(from)) =
            (self.clock.learned(), self.clock.probe_from())
        {
            if now >= from {
                let gap = period.mul_f64(PROBE_SHARE).max(PROBE_MIN);
                self.clock.next_probe = Some(now + gap);
            }
        }
    }

    /// How long the partition pauses after a rate 429 this pacer's bucket gave: until the
    /// learned window's next send, else until the pace has one unit.
    pub fn refusal_pause(&mut self, now: Instant) -> Option<Duration> {
        match self.clock_admits(now) {
            Some(Err(wait)) => Some(wait),
            Some(Ok(_)) => Some(PROBE_MIN),
            None => self.time_for(1.0),
        }
    }
}
