//! The breaker's state machine, free of I/O: fed outcomes and the time, it says who may pass.
//!
//! Vocabulary (the electrical one, not Linkerd's): **closed** = traffic flows; **open** = traffic
//! is held; **half-open** = a few probes test the upstream. An **episode** runs from the moment
//! a closed breaker opens to the moment it closes again (through any number of re-opens).
//!
//! - Closed: outcomes go into a [`Window`] of 100 ms slots. It opens when the window holds at
//!   least `min_samples` outcomes, they span at least `min_span` (from the oldest slot's first
//!   outcome to now), and the window's error rate reaches `open_error_rate`. The rate is the
//!   mean of the slots' own error rates, so each slot weighs the same however many outcomes it
//!   holds: 20 requests that failed at one instant are one slot, one event, and cannot open the
//!   breaker alone (their span is zero), nor outweigh the healthy seconds around them. The
//!   failures' share of the window's outcomes must reach it too: a failure refused at the door
//!   comes back before the successes sent beside it, so a slot can hold it alone.
//! - Open: for a cool-down of `cooldown * 2^(consecutive opens - 1)`, capped at `max_cooldown`,
//!   jittered to 75-100% so several corrals don't probe in step; then half-open. The doubling
//!   restarts from `cooldown` once the breaker has been closed for `healthy_reset` without its
//!   window reaching `close_error_rate` (closing alone does not reset it: an upstream that
//!   flaps open and closed keeps its long cool-down).
//! - Scouts: while open, one request goes through every [`SCOUT_EVERY`] (the official SDKs' first
//!   backoff), one at a time, so the end of an outage is seen within half a second of it, not
//!   at the end of a cool-down that has doubled meanwhile (a client alone, retrying, would
//!   have been served; two requests a second are nothing to a sick upstream). A
//!   scout served well ends the cool-down: the breaker goes half-open at once. A failed one
//!   changes nothing (no cool-down grows for it); a neutral or unsent one lets the next go.
//! - Half-open: admits `half_open_probes` requests. It closes when all have answered with an
//!   error rate below `close_error_rate` (so with 5 probes and 0.25, one may fail; `0` means
//!   none may), and opens again, longer, as soon as the failures alone make that impossible.
//!   Closing starts a fresh window. Held requests wake for the probe slots each at its own
//!   jitter, up to 100 ms after the cool-down, so the probes don't leave in step either. A
//!   probe answered 429 (neutral) or refused locally gives its slot to the next request.
//!
//! **Held requests and the release ramp.** A request that finds the breaker open (or half-open
//! with every probe slot taken) gets a [`Ticket`] recording when it was first held. On closing
//! it is not let go at once with the others: it is released at
//! `close + offset * scale + jitter`, where `offset` is how long after the episode began it
//! arrived, `scale` is `min(1, release_ramp / open period)` and `jitter` is up to 100 ms (drawn
//! once per request). Retries that arrived spread out leave spread out, in the order they came,
//! and the whole backlog goes within `release_ramp` (+100 ms) however long the episode was. A
//! held request that a new episode catches before its release joins it as if it had arrived at
//! its release time, keeping its place. Requests arriving while the backlog drains pass at
//! once: they are the live load, the backlog is replayed beside it at its original pace.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::BreakerConfig;

/// Width of one window slot: outcomes closer together than this are one event.
pub const SLOT: Duration = Duration::from_millis(100);

/// While open, one request goes as a scout this often (the official SDKs' first backoff).
pub const SCOUT_EVERY: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Closed,
    Open {
        until: Instant,
    },
    HalfOpen {
        admitted: u32,
        answered: u32,
        failed: u32,
    },
}

impl Phase {
    pub fn gauge(&self) -> i64 {
        match self {
            Phase::Closed => 0,
            Phase::HalfOpen { .. } => 1,
            Phase::Open { .. } => 2,
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Closed => "closed",
            Phase::HalfOpen { .. } => "half_open",
            Phase::Open { .. } => "open",
        }
    }
}

/// A request the breaker let through to learn the upstream's health: a half-open probe, by the
/// round of probes it belongs to, or an open breaker's scout, by the opening it scouts for. An
/// answer from an earlier round or opening (a slow one outliving it) is not taken for one of
/// this one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    Round(u64),
    Scout(u64),
}

impl Probe {
    pub fn is_scout(self) -> bool {
        matches!(self, Probe::Scout(_))
    }
}

/// May a request pass now?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Yes; `probe` is set when it is one of the half-open probes.
    Pass { probe: Option<Probe> },
    /// Not before this instant (open, or its turn in the release ramp), or not until a probe
    /// answers (half-open: `None`).
    Wait(Option<Instant>),
}

/// One request's place while the breaker holds it: ask [`Breaker::admit`] with the same ticket
/// every time it wakes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ticket {
    /// In [0, 1): this request's share of the 100 ms jitter on its release.
    jitter: f64,
    /// Set when first held: the episode, and the instant counted as its arrival in it.
    held: Option<(u64, Instant)>,
}

impl Ticket {
    /// A request not held yet; `jitter` in [0, 1) spreads its release.
    pub fn new(jitter: f64) -> Self {
        Self {
            jitter: jitter.clamp(0.0, 1.0),
            held: None,
        }
    }
}

/// One 100 ms slot of outcomes.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// The slot's first outcome.
    start: Instant,
    /// Outcomes recorded in it.
    outcomes: u32,
    /// Of which failures.
    failures: u32,
}

/// The closed breaker's evidence: the last `window` outcomes, stretched back to cover at least
/// `min_span`, in 100 ms slots.
#[derive(Debug, Default, Clone)]
struct Window {
    /// Oldest first.
    slots: VecDeque<Slot>,
    /// Outcomes in all slots.
    outcomes: u64,
    /// Failures in all slots.
    failures: u64,
}

impl Window {
    fn push(&mut self, failed: bool, now: Instant, keep: u32, min_span: Duration) {
        match self.slots.back_mut() {
            Some(slot) if now < slot.start + SLOT => {
                slot.outcomes += 1;
                slot.failures += u32::from(failed);
            }
            _ => self.slots.push_back(Slot {
                start: now,
                outcomes: 1,
                failures: u32::from(failed),
            }),
        }
        self.outcomes += 1;
        self.failures += u64::from(failed);
        // Drop the oldest slot while the rest still hold `keep` outcomes spanning `min_span`.
        while let (Some(oldest), Some(next)) = (self.slots.front(), self.slots.get(1)) {
            let rest = self.outcomes - u64::from(oldest.outcomes);
            if rest < u64::from(keep) || now.saturating_duration_since(next.start) < min_span {
                break;
            }
            self.outcomes = rest;
            self.failures -= u64::from(oldest.failures);
            self.slots.pop_front();
        }
    }

    /// From the oldest outcome to `now`.
    fn span(&self, now: Instant) -> Duration {
        self.slots
            .front()
            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s.start))
    }

    /// The mean of the slots' error rates (0 when empty).
    fn error_rate(&self) -> f64 {
        if self.slots.is_empty() {
            return 0.0;
        }
        let sum: f64 = self
            .slots
            .iter()
            .map(|s| f64::from(s.failures) / f64::from(s.outcomes))
            .sum();
        sum / self.slots.len() as f64
    }

    /// Failures over outcomes, each outcome weighing the same. A failure comes back at once
    /// (an overload refused at the door) where a success takes the service time: after a
    /// pause, the slot of a burst's sends holds its failures alone and its successes land in
    /// later slots, so 5% of answers refused as overloaded read as a slot mean of 50%. The
    /// breaker opens only when the count agrees.
    fn counted_rate(&self) -> f64 {
        if self.outcomes == 0 {
            return 0.0;
        }
        self.failures as f64 / self.outcomes as f64
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

/// From a closed breaker opening to its closing again.
#[derive(Debug, Clone, Copy)]
struct Episode {
    /// Counts from 1.
    id: u64,
    /// When the closed breaker opened.
    opened_at: Instant,
    /// When it closed again; `None` while it lasts.
    closed_at: Option<Instant>,
}

#[derive(Debug, Clone)]
pub struct Breaker {
    /// The upstream's `[upstream.breaker]`.
    config: BreakerConfig,
    /// Outcomes while closed.
    window: Window,
    /// Where the breaker is.
    phase: Phase,
    /// Opens since the cool-down last started over; the cool-down doubles with each.
    consecutive_opens: u32,
    /// Closed and healthy since then: the instant it closed or the window last reached
    /// `close_error_rate`, whichever is later. `None` before the first close.
    healthy_since: Option<Instant>,
    /// When the last cool-down ended (the breaker went half-open).
    half_open_at: Option<Instant>,
    /// Rounds of probes so far (one per half-open phase).
    round: u64,
    /// Openings so far (the first and every re-opening), for the scouts' [`Probe`].
    opened: u64,
    /// While open: when the next scout may go, and whether one is out.
    scout_at: Instant,
    scouting: bool,
    /// The current (or last) episode, and the one before it.
    episode: Option<Episode>,
    previous: Option<Episode>,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            config,
            window: Window::default(),
            phase: Phase::Closed,
            consecutive_opens: 0,
            healthy_since: None,
            half_open_at: None,
            round: 0,
            opened: 0,
            scout_at: Instant::now(),
            scouting: false,
            episode: None,
            previous: None,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Take on `old`'s state under this breaker's settings (a reload changed its upstream's
    /// config): an open breaker stays open for the rest of its cool-down, and its evidence and
    /// history carry on. A half-open round starts over: its probes answer to the breaker that
    /// admitted them.
    pub fn carry_from(&mut self, old: &Breaker) {
        *self = Self {
            config: self.config.clone(),
            ..old.clone()
        };
        if let Phase::HalfOpen { .. } = self.phase {
            self.phase = Phase::HalfOpen {
                admitted: 0,
                answered: 0,
                failed: 0,
            };
            self.round += 1;
        }
    }

    /// Admit one request at `now`, `ticket` being its place if it has to wait (the same ticket
    /// on every call for one request). Returns the verdict and whether the phase changed.
    pub fn admit(&mut self, now: Instant, ticket: &mut Ticket) -> (Admit, bool) {
        let mut changed = false;
        if let Phase::Open { until } = self.phase {
            if now < until {
                if !self.scouting && now >= self.scout_at {
                    self.scouting = true;
                    let scout = Probe::Scout(self.opened);
                    return (Admit::Pass { probe: Some(scout) }, false);
                }
                self.hold(ticket, now);
                // A held request wakes for the next scout's turn too (spread over 100 ms: the
                // first to wake goes), unless one is out: its answer wakes them.
                let mut wake = self.wake_at(until, ticket);
                if !self.scouting {
                    wake = wake.min(self.wake_at(self.scout_at, ticket));
                }
                return (Admit::Wait(Some(wake)), false);
            }
            self.half_open(until);
            changed = true;
        }
        // Held requests wake for the probes spread over 100 ms, so the probes don't leave in
        // step, even when the first to wake makes it half-open and wakes them all.
        let held_here = matches!(
            (ticket.held, self.episode),
            (Some((id, _)), Some(e)) if id == e.id
        );
        let wake = self.half_open_at.map(|at| self.wake_at(at, ticket));
        let probes = self.config.half_open_probes;
        let round = Probe::Round(self.round);
        match &mut self.phase {
            Phase::Closed => match self.release_at(ticket) {
                Some(due) if now < due => (Admit::Wait(Some(due)), changed),
                _ => (Admit::Pass { probe: None }, changed),
            },
            Phase::HalfOpen { .. } if held_here && wake.is_some_and(|w| now < w) => {
                (Admit::Wait(wake), changed)
            }
            Phase::HalfOpen { admitted, .. } if *admitted < probes => {
                *admitted += 1;
                (Admit::Pass { probe: Some(round) }, changed)
            }
            _ => {
                self.hold(ticket, now);
                (Admit::Wait(None), changed)
            }
        }
    }

    /// Record an answer from the upstream (`failed`: it counts against its health; neutral
    /// answers are not recorded at all). `jitter` in [0, 1) spreads a cool-down it starts.
    /// Returns true when the phase changed.
    pub fn record(
        &mut self,
        failed: bool,
        probe: Option<Probe>,
        now: Instant,
        jitter: f64,
    ) -> bool {
        let close_rate = self.config.close_error_rate;
        let this_round = probe == Some(Probe::Round(self.round));
        if let Some(Probe::Scout(opened)) = probe {
            return self.scouted(opened, failed, now);
        }
        match &mut self.phase {
            Phase::HalfOpen {
                answered,
                failed: f,
                ..
            } if this_round => {
                *answered += 1;
                *f += u32::from(failed);
                let probes = self.config.half_open_probes;
                // Even if every other probe succeeds, the rate can't get below `close_rate`.
                let hopeless = *f > 0 && f64::from(*f) / f64::from(probes) >= close_rate;
                if hopeless {
                    self.open(now, jitter);
                    true
                } else if *answered >= probes {
                    self.close(now);
                    true
                } else {
                    false
                }
            }
            Phase::Closed => {
                if self.healthy_since.is_some_and(|h| {
                    now.saturating_duration_since(h) >= self.config.healthy_reset.0
                }) {
                    self.consecutive_opens = 0;
                }
                let config = &self.config;
                self.window
                    .push(failed, now, config.window, config.min_span.0);
                let rate = self.window.error_rate();
                if self.window.failures > 0 && rate >= close_rate {
                    self.healthy_since = Some(now);
                }
                if self.window.failures > 0
                    && self.window.outcomes >= u64::from(config.min_samples)
                    && self.window.span(now) >= config.min_span.0
                    && rate >= config.open_error_rate
                    && self.window.counted_rate() >= config.open_error_rate
                {
                    self.open(now, jitter);
                    return true;
                }
                false
            }
            // Answers of requests admitted before the breaker opened, or of earlier rounds'
            // probes, don't move it further.
            _ => false,
        }
    }

    /// A scout of the opening `opened` answered (`failed`: it counts against the upstream's
    /// health): served well, the cool-down ends and the breaker goes half-open now; else the
    /// next scout goes [`SCOUT_EVERY`] from now. A scout of an earlier opening changes
    /// nothing. Returns true when the phase changed.
    fn scouted(&mut self, opened: u64, failed: bool, now: Instant) -> bool {
        if opened != self.opened || !matches!(self.phase, Phase::Open { .. }) {
            return false;
        }
        self.scouting = false;
        if failed {
            self.scout_at = now + SCOUT_EVERY;
            return false;
        }
        self.half_open(now);
        true
    }

    /// The cool-down ended at `at`: a new round of probes.
    fn half_open(&mut self, at: Instant) {
        self.phase = Phase::HalfOpen {
            admitted: 0,
            answered: 0,
            failed: 0,
        };
        self.half_open_at = Some(at);
        self.round += 1;
    }

    /// A probe or scout that never reached the upstream (corral refused it locally, the client
    /// left) or whose answer was neutral (a 429) gives its place back.
    pub fn release_probe(&mut self, probe: Probe) {
        match (probe, &mut self.phase) {
            (Probe::Round(round), Phase::HalfOpen { admitted, .. }) if round == self.round => {
                *admitted = admitted.saturating_sub(1);
            }
            (Probe::Scout(opened), Phase::Open { .. }) if opened == self.opened => {
                self.scouting = false;
            }
            _ => {}
        }
    }

    /// When a held request wakes for the probes after a cool-down ending at `until`.
    fn wake_at(&self, until: Instant, ticket: &Ticket) -> Instant {
        until + SLOT.mul_f64(ticket.jitter)
    }

    /// The probe this round's probes carry.
    #[cfg(test)]
    fn probe(&self) -> Option<Probe> {
        Some(Probe::Round(self.round))
    }

    /// Give `ticket` its place in the current episode (the breaker is not closed).
    fn hold(&self, ticket: &mut Ticket, now: Instant) {
        let Some(current) = self.episode else {
            return;
        };
        match ticket.held {
            Some((id, _)) if id == current.id => {}
            // Caught again before its release: it arrives, in this episode, when it was due.
            Some(_) => {
                let due = self.release_at(ticket).unwrap_or(now);
                ticket.held = Some((current.id, due.max(current.opened_at)));
            }
            None => ticket.held = Some((current.id, now)),
        }
    }

    /// When a ticket held in an episode that has closed goes (`None`: never held, or in an
    /// episode forgotten since).
    fn release_at(&self, ticket: &Ticket) -> Option<Instant> {
        let (id, since) = ticket.held?;
        let episode = [self.episode, self.previous]
            .into_iter()
            .flatten()
            .find(|e| e.id == id)?;
        let closed = episode.closed_at?;
        let ramp = self.config.release_ramp.0;
        let open_for = closed.saturating_duration_since(episode.opened_at);
        let offset = since.saturating_duration_since(episode.opened_at);
        let scaled = if open_for > ramp {
            offset.mul_f64(ramp.as_secs_f64() / open_for.as_secs_f64())
        } else {
            offset
        };
        Some(closed + scaled.min(ramp) + ramp.min(SLOT).mul_f64(ticket.jitter))
    }

    fn open(&mut self, now: Instant, jitter: f64) {
        if self.phase == Phase::Closed {
            let id = self.episode.map_or(1, |e| e.id + 1);
            self.previous = self.episode;
            self.episode = Some(Episode {
                id,
                opened_at: now,
                closed_at: None,
            });
        }
        self.consecutive_opens += 1;
        self.opened += 1;
        self.scout_at = now + SCOUT_EVERY;
        self.scouting = false;
        let doubling = 2u32.saturating_pow(self.consecutive_opens.saturating_sub(1).min(16));
        let cooldown = self
            .config
            .cooldown
            .0
            .saturating_mul(doubling)
            .min(self.config.max_cooldown.0);
        let cooldown = cooldown.mul_f64(0.75 + 0.25 * jitter.clamp(0.0, 1.0));
        self.phase = Phase::Open {
            until: now + cooldown.max(Duration::from_millis(1)),
        };
    }

    fn close(&mut self, now: Instant) {
        if let Some(e) = &mut self.episode {
            e.closed_at = Some(now);
        }
        self.window.clear();
        self.healthy_since = Some(now);
        self.phase = Phase::Closed;
    }
}

#[cfg(test)]
mod tests;
