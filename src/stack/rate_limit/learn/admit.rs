//! Admission: whether a request may go now and what it is charged, the ramp that spreads
//! sends while headroom is unconfirmed, and the tickets in flight.

use std::time::Duration;

use tokio::time::Instant;

use super::{
    Admission, Pacer, Source, Ticket, CONSENT, FORGET_UNANSWERED, IDLE, MAX_UNANSWERED,
    MIN_CONSENT, RAMP_CATCH_UP, RAMP_RTT_GUESS, REFUSAL_WORK, SLOW_START_STALL,
};
use crate::provider::Kind;

impl Pacer {
    /// The spacing of sends while headroom is unconfirmed (slow start, or reported headroom
    /// beyond what answers have confirmed): one round trip over the confirmed window.
    pub(super) fn ramp_gap(&self) -> Option<Duration> {
        let window = match self.source {
            Source::SlowStart => self.burst,
            Source::Headers if self.verified < self.burst => self.verified,
            _ => return None,
        };
        // The ramp's round trip is the time to learn whether the bucket took a send: an
        // answer's, or sooner the silence that counts as consent (measured by refusals, or
        // before one by the connections' handshakes; half a second before either). Only
        // until the bucket's edge is found (the first rate 429 sets the floor; slow start ends
        // at it): past it the ramp re-grows per answer, so one corral among others on a key
        // does not outrun its share after each cut. A `[fleet]` replica keeps the guess: its
        // replicas ramp together and meet the key's edge within a millisecond of each other,
        // and what each had sent over a few milliseconds was its first cut's measure, below
        // the refill (four on Redis at `--quick`: each cut to 26-35/s where the key refilled
        // 200/s, gemini 1.51x, no-headers 1.44x; spread over the guess, 1.03x).
        let mut rtt = self.min_rtt.unwrap_or(RAMP_RTT_GUESS);
        if self.floor.is_none() && !self.fleet {
            rtt = rtt.min(self.consent_wait().as_secs_f64());
        }
        Some(Duration::from_secs_f64(rtt / window.max(1.0)))
    }

    /// Whether [`try_acquire`](Self::try_acquire) would admit `cost` units now.
    pub fn can_acquire(&mut self, cost: f64, now: Instant) -> bool {
        if self.source == Source::None {
            return true;
        }
        self.refill(now);
        if let Some(verdict) = self.clock_admits(now) {
            return verdict.is_ok();
        }
        (self.ramp_gap().is_none() || now >= self.next_send)
            && self.level >= self.need(cost)
            && !self.quantum_holds(cost, now)
    }

    /// Admit `cost` units now, or say how long to wait (`None`: until an answer arrives).
    pub fn try_acquire(&mut self, cost: f64, now: Instant) -> Result<Ticket, Option<Duration>> {
        let admission = self.admits(cost, now)?;
        Ok(self.take(admission, cost, now))
    }

    /// [`try_acquire`](Self::try_acquire) right after [`can_acquire`](Self::can_acquire) said
    /// yes at the same `now`: the refill is not done again (a second one at the same instant
    /// changes nothing), so the fast path refills each pacer once.
    pub fn acquire_ready(&mut self, cost: f64, now: Instant) -> Result<Ticket, Option<Duration>> {
        let admission = self.admits_refilled(cost, now)?;
        Ok(self.take(admission, cost, now))
    }

    /// Admit `cost` units as `admission` says.
    fn take(&mut self, admission: Admission, cost: f64, now: Instant) -> Ticket {
        match admission {
            Admission::Free => self.admit(0.0, now),
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
                self.admit(charge, now)
            }
            Admission::Anyway => {
                self.quiet_since = now;
                self.admit_anyway(cost, now)
            }
            Admission::Window => {
                self.clock_took(now);
                self.admit(cost, now)
            }
        }
    }

    /// How [`try_acquire`](Self::try_acquire) would admit `cost` units now, taking nothing
    /// (but the refill up to `now`); `Err` as there.
    pub fn admits(&mut self, cost: f64, now: Instant) -> Result<Admission, Option<Duration>> {
        if self.source != Source::None {
            self.refill(now);
        }
        self.admits_refilled(cost, now)
    }

    /// [`admits`](Self::admits) with the pacer already refilled up to `now`.
    fn admits_refilled(&mut self, cost: f64, now: Instant) -> Result<Admission, Option<Duration>> {
        if self.source == Source::None || (self.source == Source::Aimd && self.paced_by_fleet()) {
            return Ok(Admission::Free);
        }
        if self.oversize(cost) {
            // Larger than the bucket: no wait here can make room for it. It goes now, charged
            // nothing; the upstream's answer (its report) settles what it cost.
            return Ok(Admission::Free);
        }
        if let Some(verdict) = self.clock_admits(now) {
            return verdict.map_err(Some);
        }
        if self.quantum_holds(cost, now) {
            return Err(self.next_consent(now));
        }
        let need = self.need(cost);
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
        match (self.time_for(need - self.level), self.next_consent(now)) {
            // On the way back from a storm, silence raises the pace sooner than it refills.
            (Some(wait), Some(consent)) => Err(Some(wait.min(consent))),
            (Some(wait), None) => Err(Some(wait)),
            // No pace yet: the next answer, or the next attempt's silence, teaches more.
            (None, consent) => Err(consent),
        }
    }

    /// Confirm the attempts unanswered for twice the slowest recent refusal ([`CONSENT`] before
    /// one is seen): a bucket refuses at once, so one that has not refused them by then
    /// admitted them. Each grows the ramp as a success would (in slow start the level and
    /// window, with headers the confirmed headroom, and a tokens pacer's level within it when
    /// no refill is known; on the way back from a storm, the pace as a success sent after the
    /// last cut would raise it), and its answer later adds nothing.
    pub(super) fn consent(&mut self, now: Instant) {
        if !matches!(self.source, Source::SlowStart | Source::Headers) && !self.recovering() {
            return;
        }
        let wait = self.consent_wait();
        let from = self.first_unconfirmed();
        let (mut units, mut last) = (0.0, None);
        for t in self.unanswered.range(from..) {
            if now.saturating_duration_since(t.sent_at) < wait {
                break;
            }
            units += t.cost.max(1.0);
            last = Some(t.seq);
        }
        let Some(last) = last else { return };
        self.quantum.consented(last);
        if self.recovering() {
            // Each attempt sent after the last cut and not refused within the wait adds its
            // units per that wait: the way back from a window that reopened on the clock
            // doubles per refusal's round trip, not per answer. Per answer of 2 s, each of
            // `azure-responses`' windows of 100 (every 10 s) was half spent regrowing the pace
            // from half a request a second.
            self.consented_seq = last;
            let mut i = from;
            while let Some(&t) = self.unanswered.get(i).filter(|t| t.seq <= last) {
                self.recover_per(t, t.cost.max(1.0), wait.as_secs_f64());
                i += 1;
            }
            return;
        }
        self.consented_seq = last;
        self.verified += units;
        if self.source == Source::SlowStart {
            // As a success: its slot back and one more (the bucket took it; being served
            // holds no rate).
            self.level += 2.0 * units;
            self.burst = self.burst.max(self.level);
        } else if let Some(remaining) = self
            .last_remaining
            .filter(|_| self.header_rate <= 0.0 && self.kind == Kind::Tokens)
        {
            // With headers the level is the report's headroom, less what was sent since,
            // within the confirmed window, and the refill raises it between reports. A report
            // of a full bucket names no refill (no use to measure): a tokens pacer's window
            // grew, so does its level, as in slow start. Else, its window holding less than one
            // request's tokens, it sent nothing more until answers of 10 s came back. (With a
            // refill known, growing it here too drew a third more 429s on a shared key; a
            // requests pacer's window holds whole requests, and the answers pace its ramp.)
            let headroom = (remaining - self.floor.unwrap_or(0.0)) / self.part() - self.unseen();
            let grown = (self.level + 2.0 * units).min(headroom).min(self.verified);
            self.level = self.level.max(grown);
        }
    }

    /// Units in flight neither answered nor confirmed by their silence: spent from the window
    /// of confirmed headroom, as TCP's in flight are from its window. A report that set the
    /// level to the whole window let a window more go per answer: behind a stream's heads of
    /// 3 ms, 48 sent in 30 ms at a bucket of 20 (`openai-stream`, 46 refused).
    pub(super) fn unconfirmed(&self) -> f64 {
        let from = self.first_unconfirmed();
        self.unanswered.range(from..).map(|t| t.cost).sum()
    }

    /// Where the tickets in flight not yet confirmed by their silence begin.
    fn first_unconfirmed(&self) -> usize {
        self.unanswered
            .partition_point(|t| t.seq <= self.consented_seq)
    }

    /// How long until the oldest attempt not yet confirmed is confirmed by its silence.
    fn next_consent(&self, now: Instant) -> Option<Duration> {
        if !matches!(self.source, Source::SlowStart | Source::Headers) && !self.recovering() {
            return None;
        }
        let wait = self.consent_wait();
        let from = self.first_unconfirmed();
        let oldest = self.unanswered.get(from)?;
        let mut due = oldest.sent_at + wait;
        if self.handshake.is_none() && self.min_rtt.is_none() && self.refusal_latency.is_none() {
            // The wait is the half-second guess that the first connection's handshake, a
            // round trip away, replaces: look again then. Slept on, it held the first sends'
            // silence unread until an answer came (`lb-resets`, answers of 0.5 s: the ramp
            // doubled per answer, 2.9 s for the median task where the client alone took 1.6).
            due = due.min(now + REFUSAL_WORK);
        }
        Some(due.saturating_duration_since(now))
    }

    /// How long an attempt must go unanswered to count as admitted: twice the slowest recent
    /// refusal (this upstream's own time to refuse, network included). Before one is seen, once
    /// a connection has opened, twice the slowest recent handshake plus [`REFUSAL_WORK`] (within
    /// `MIN_CONSENT..=CONSENT`); [`CONSENT`] before that. Silence is all a ramp behind answers
    /// of seconds has to go on. Answers faster than the wait pace the ramp themselves (the
    /// wait never goes below `REFUSAL_WORK` before a refusal: four corrals on one key with
    /// answers of 20 ms, each ramping per 10 ms of silence, overshot the key together and cut
    /// each other to 1.3-2x the bound); slower ones do not stand in for it: an answer's time
    /// is the service's, not a refusal's (a herd behind answers of 0.2-0.5 s with no limit,
    /// waiting the half second once one came, doubled per answer: 1.2 s to send 500 where the
    /// client alone sends them at once). A `[fleet]` replica takes the short wait too, but
    /// spreads its sends over the guessed round trip ([`Pacer::ramp_gap`]).
    pub(super) fn consent_wait(&self) -> Duration {
        match (self.refusal_latency, self.handshake, self.min_rtt) {
            (None, Some(h), _) => (Duration::from_secs_f64(2.0 * h.min(60.0)) + REFUSAL_WORK)
                .clamp(MIN_CONSENT, CONSENT),
            (None, _, _) => CONSENT,
            (Some(l), _, _) => Duration::from_secs_f64(2.0 * l.min(60.0)).max(MIN_CONSENT),
        }
    }

    /// The slowest recent handshake of a connection to the upstream, in seconds
    /// ([`crate::client::Handshakes`]).
    pub fn handshake(&mut self, secs: f64) {
        self.handshake = Some(secs);
    }

    /// Whether the attempt admitted with `ticket` left at or after `since` with nothing of this
    /// pacer's sent since then ahead of it still in flight or taken by the upstream: a
    /// refusal of it is a refusal of the first send after `since`.
    pub fn first_since(&self, ticket: Ticket, since: Instant) -> bool {
        ticket.sent_at >= since
            && self.last_ok_sent.is_none_or(|s| s < since)
            && !self
                .unanswered
                .iter()
                .any(|t| t.sent_at >= since && t.seq < ticket.seq)
    }

    /// Whether the attempt admitted with `ticket` was confirmed by its silence.
    pub(super) fn consented(&self, ticket: Ticket) -> bool {
        ticket.cost > 0.0 && ticket.seq <= self.consented_seq
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
        self.level = (self.level + ticket.cost - actual).clamp(-self.burst, self.ceiling());
    }

    pub(super) fn admit(&mut self, cost: f64, now: Instant) -> Ticket {
        self.sent += cost;
        self.throttle_log.sent(now);
        self.meter.record(now, cost.max(1.0));
        let ticket = Ticket {
            sent_at: now,
            seq: self.sent,
            cost,
        };
        if cost > 0.0 {
            if self.kind == Kind::Requests && self.source == Source::Headers && !self.fleet {
                self.drain.sent(self.sent, now);
            }
            self.quantum_sent(self.sent, cost, now);
            if self.unanswered.len() >= MAX_UNANSWERED {
                self.unanswered.pop_front();
            }
            self.unanswered.push_back(ticket);
        }
        ticket
    }

    /// Forget `ticket` (answered) and tickets whose answer never came (cancelled requests).
    pub(super) fn forget(&mut self, ticket: Ticket, now: Instant) {
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
        self.quantum.answered(ticket.seq, false);
    }

    /// Units sent shortly before `ticket` and still unanswered: on a busy machine they may reach
    /// the upstream after it (not yet counted in its `remaining`), so they count as sent after.
    /// Shortly: within the fastest answer's round trip; before any answer, the slowest recent
    /// refusal's (50 ms before either is known). A send older than that has reached the
    /// upstream however long its answer takes: with answers of seconds, a herd's first round is
    /// all unanswered when the first 429 comes, and counting it again would hold the level
    /// below empty for as long as the bucket takes to refill it. Once answers are known their
    /// round trip serves again: with the refusal's, a millisecond here, four unshared corrals
    /// on Anthropic's headers (their sends reach the upstream out of order on two busy cores)
    /// drew 130-146 rate 429s in 500 against 112-121.
    /// How long a send may take to reach the upstream, in seconds: at most a round trip, the
    /// fastest answer's or a refusal's when that is shorter (a refusal comes back from the
    /// front door; an answer takes the service time); 50 ms before either is known.
    pub(super) fn reach(&self) -> f64 {
        let known = match (self.min_rtt, self.refusal_latency) {
            (Some(answer), Some(refusal)) => Some(answer.min(refusal)),
            (answer, refusal) => answer.or(refusal),
        };
        known.unwrap_or(0.05).min(60.0)
    }

    pub(super) fn unanswered_before(&self, ticket: Ticket) -> f64 {
        let window = Duration::from_secs_f64(self.reach());
        let since = ticket.sent_at.checked_sub(window).unwrap_or(ticket.sent_at);
        self.unanswered
            .iter()
            .take_while(|t| t.seq < ticket.seq)
            .filter(|t| t.sent_at >= since)
            .map(|t| t.cost)
            .sum()
    }
}
