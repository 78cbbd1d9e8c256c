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
//! probes go a fiftieth of the period apart (or a fifth of the span the last opening was found
//! within, if wider) until one is admitted (the new opening). Learned
//! only for the requests of a corral alone on its key (a fleet shares its refill otherwise),
//! and dropped when no opening is seen within two periods past the due one, or when the
//! window refuses more than a quarter of its learned count.

use std::time::Duration;

use tokio::time::Instant;

use super::{Admission, Pacer, Ticket};
use crate::provider::Kind;

/// Two periods agree when they are within this share of each other.
const AGREE: f64 = 0.2;
/// Probes for an opening begin this share of the period before it is due...
const EARLY: f64 = 0.05;
/// ...and go this share of the period apart, at least [`PROBE_MIN`], and at least the span the
/// latest opening was found within over [`PROBES_PER_SPAN`]: the first opening of a learned
/// window was found by the cut pace's probes, up to 2 s apart, and probes a fiftieth of the
/// period apart from the span's start drew ten refusals in the window after it
/// (`azure-responses`, 10 s windows).
const PROBE_SHARE: f64 = 0.02;
const PROBE_MIN: Duration = Duration::from_millis(20);
const PROBES_PER_SPAN: u32 = 5;
/// A period shorter than this is a bucket's refill seen through a storm, not a window.
const MIN_PERIOD: Duration = Duration::from_secs(2);

/// What the openings have shown ([`Pacer::clock_admitted`]).
#[derive(Debug, Default)]
pub(super) struct Clock {
    /// The latest opening: when its first admitted attempt was sent (the window was open by
    /// then), and the units sent before that attempt (its ticket's `seq` less its cost).
    opened: Option<(Instant, f64)>,
    /// When the last attempt refused before that opening was sent (once learned, of the
    /// probes for it): the window was still closed then, so the opening came between the two.
    closed: Option<Instant>,
    /// Units admitted of the attempts sent since `opened`.
    admitted: f64,
    /// The last period seen, and the learned one (two that agreed), each with how far off it
    /// may be (half the spans its openings lay in, added).
    last_period: Option<(Duration, Duration)>,
    period: Option<Duration>,
    period_off: Duration,
    /// What the last whole window admitted.
    capacity: Option<f64>,
    /// The current window refused an attempt sent within it: its count is spent.
    spent: bool,
    /// Attempts of the current window's learned count it refused: past a quarter of the
    /// count, the window is no clock's and is forgotten.
    refused_open: f64,
    /// The next probe for an opening may go at this instant.
    next_probe: Option<Instant>,
    /// The end of the last pause the upstream named: a pause it overlapped was its word.
    named_until: Option<Instant>,
}

impl Clock {
    /// The learned window: its latest opening (instant, units sent before it), period and
    /// capacity.
    pub(super) fn learned(&self) -> Option<(Instant, f64, Duration, f64)> {
        let (at, seq) = self.opened?;
        Some((at, seq, self.period?, self.capacity?))
    }

    /// When the learned window's next opening may come, less [`EARLY`]: a period after the
    /// latest one's earliest instant.
    fn probe_from(&self) -> Option<Instant> {
        let (_, _, period, _) = self.learned()?;
        Some(self.earliest()? + period - period.mul_f64(EARLY))
    }

    /// The earliest the latest opening can have come: the last refusal before it (see
    /// `closed`), else its first success.
    fn earliest(&self) -> Option<Instant> {
        let (at, _) = self.opened?;
        Some(self.closed.map_or(at, |c| c.min(at)))
    }

    /// The latest opening's span: from [`Self::earliest`] to its first success.
    fn span(&self) -> Duration {
        match (self.opened, self.earliest()) {
            (Some((at, _)), Some(earliest)) => at - earliest,
            _ => Duration::ZERO,
        }
    }

    /// The middle of the latest opening's span.
    fn middle(&self) -> Option<Instant> {
        Some(self.earliest()? + self.span() / 2)
    }

    /// The upstream named a wait until `until`: the pause it ends is no clock's.
    pub(super) fn named(&mut self, until: Instant) {
        self.named_until = Some(self.named_until.map_or(until, |u| u.max(until)));
    }

    /// A window opens at `sent` (units sent before it: `seq`), the last refusal before it at
    /// `closed`, with `units` admitted.
    fn anchor(&mut self, sent: Instant, seq: f64, closed: Instant, units: f64) {
        self.opened = Some((sent, seq));
        self.closed = Some(closed);
        self.admitted = units;
        self.spent = false;
        self.refused_open = 0.0;
        self.next_probe = None;
    }

    /// A period measured between the middles of two openings, off by up to `off`: learned
    /// once two agree (within [`AGREE`] of each other, and half what each may be off: before
    /// the window is learned the cut pace's probes are up to 2 s apart), then averaged, with
    /// what the window before it admitted as the count.
    fn measured(&mut self, period: Duration, off: Duration) {
        if period < MIN_PERIOD {
            return;
        }
        let agree = |p: Duration, p_off: Duration| {
            period.abs_diff(p) <= p.mul_f64(AGREE) + (off + p_off) / 2
        };
        let (learned, learned_off) = (self.period, self.period_off);
        self.period = match (learned, self.last_period) {
            (Some(learned), _) if agree(learned, learned_off) => {
                self.period_off = (learned_off + off) / 2;
                Some((learned + period) / 2)
            }
            (_, Some((last, last_off))) if agree(last, last_off) => {
                self.period_off = (last_off + off) / 2;
                Some((last + period) / 2)
            }
            _ => None,
        };
        self.last_period = Some((period, off));
        self.capacity = Some(match self.capacity {
            Some(known) if !self.spent => known.max(self.admitted),
            _ => self.admitted,
        });
    }
}

#[cfg(test)]
impl Clock {
    /// A window of `capacity` a `period`, learned, its latest opening found at `at` within
    /// `span` of the refusal before it.
    pub(super) fn learned_at(at: Instant, span: Duration, period: Duration, capacity: f64) -> Self {
        Self {
            opened: Some((at, 0.0)),
            closed: Some(at - span),
            period: Some(period),
            capacity: Some(capacity),
            ..Self::default()
        }
    }

    /// When the next probe for an opening may go.
    pub(super) fn next_probe(&self) -> Option<Instant> {
        self.next_probe
    }
}

impl Pacer {
    /// Whether the clock's window is learned and has a say for this pacer.
    fn clocked(&self) -> bool {
        self.kind == Kind::Requests && !self.fleet && self.clock.learned().is_some()
    }

    /// An attempt sent at its ticket's instant was admitted (`units`); `paused`: a pause came
    /// before it (see [`Pacer::unnamed_pause`]). The first success opens a window; so does each
    /// that ends such a pause, measuring a period if no wait the upstream named overlapped the
    /// pause, and, once learned, each sent from a twentieth of the period before the next
    /// opening is due: measuring a period when a probe was refused before it, else (the window
    /// never closed: its count is more than learned) with a tenth more room and no period.
    pub(super) fn clock_admitted(&mut self, ticket: Ticket, units: f64, paused: bool) {
        if self.kind != Kind::Requests || self.fleet {
            return;
        }
        let sent = ticket.sent_at;
        let probe_from = self.clock.probe_from();
        // Once learned, only the probes' refusals bound the opening: the window's own, once
        // spent, came a period before it.
        let closed = (self.refused_sent.iter())
            .filter(|&&at| at < sent && probe_from.is_none_or(|from| at >= from))
            .max()
            .copied();
        let seq = ticket.seq - ticket.cost;
        let c = &mut self.clock;
        let (Some((at, _)), Some(middle)) = (c.opened, c.middle()) else {
            c.anchor(sent, seq, sent, units);
            return;
        };
        // A refusal before the last opening bounds none after it.
        let closed = closed.filter(|&closed| closed > at);
        let named = c.named_until.is_some_and(|until| until > at);
        let opening = match probe_from {
            Some(from) => sent >= from,
            None => paused,
        };
        if !opening {
            if sent >= at {
                c.admitted += units;
            }
            if c.named_until.is_some_and(|until| sent >= until) {
                c.named_until = None;
            }
            return;
        }
        match (probe_from, closed) {
            (Some(_), None) => {
                let known = c.capacity.unwrap_or(0.0);
                c.capacity = Some(known + (known / 10.0).max(1.0));
                c.anchor(sent, seq, sent, units);
                return;
            }
            (None, _) if named => c.named_until = None,
            (_, closed) => {
                let earliest = closed.unwrap_or(sent);
                let span = sent.saturating_duration_since(earliest);
                let off = (span
                    + c.closed
                        .map_or(Duration::ZERO, |c| at.saturating_duration_since(c)))
                    / 2;
                c.measured((earliest + span / 2).saturating_duration_since(middle), off);
            }
        }
        c.anchor(sent, seq, closed.unwrap_or(sent), units);
    }

    /// An attempt sent at `sent` was refused as a rate 429: sent within a window's open span,
    /// the window's count is spent.
    pub(super) fn clock_refused(&mut self, sent: Instant) {
        let c = &mut self.clock;
        if c.opened.is_some_and(|(at, _)| sent >= at) && c.probe_from().is_none_or(|f| sent < f) {
            c.spent = true;
            if let Some((_, _, _, capacity)) = c.learned() {
                c.refused_open += 1.0;
                if c.refused_open > capacity / 4.0 {
                    *c = Clock::default();
                }
            }
        }
    }

    /// What the learned window says of one more request now: `None` when it has no say (not
    /// learned, or lost: no opening seen within two periods past the due one, which leaves
    /// a period for the answer to a probe to come back, and then it is forgotten), else admit
    /// it ([`Admission::Window`]) or wait so long. A pause the upstream named holds it too.
    pub(super) fn clock_admits(&mut self, now: Instant) -> Option<Result<Admission, Duration>> {
        if !self.clocked() {
            return None;
        }
        let (at, seq, period, capacity) = self.clock.learned()?;
        let probe_from = self.clock.probe_from()?;
        if now >= at + period * 3 {
            self.clock = Clock::default();
            return None;
        }
        if let Some(held) = self.held_until.filter(|held| *held > now) {
            return Some(Err(held - now));
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
                let gap = (period.mul_f64(PROBE_SHARE).max(PROBE_MIN))
                    .max(self.clock.span() / PROBES_PER_SPAN);
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
