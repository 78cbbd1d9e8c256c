//! Learning from the provider's headers: the rate they imply, the floor a 429 shows, the
//! level each report resynchronises, and the demotion of a report caught lying.

use std::time::Duration;

use tokio::time::Instant;

use super::{
    Answer, Pacer, Source, Ticket, LIE_MARGIN, MAX_PROBATION, MIN_RATE, PROBATION,
    RESYNC_SLACK_TIME,
};

use crate::provider::{Kind, Report};

/// How far apart the upstream's clock and this one may be for an instant behind the send to
/// show truncation ([`Pacer::learn_headers`]).
const CLOCK_SKEW: Duration = Duration::from_millis(100);

impl Pacer {
    fn demote(&mut self, now: Instant) {
        if self.distrust_until.is_none() {
            self.demotions += 1;
        }
        let doubling = 2u32.saturating_pow(self.demotions.saturating_sub(1).min(16));
        let probation = PROBATION.saturating_mul(doubling).min(MAX_PROBATION);
        self.distrust_until = Some(now + probation);
        self.source = Source::Observed;
    }

    /// The refill rate a report implies: `limit - remaining` over the time to full.
    fn learn_rate(&mut self, r: &Report, age: Duration) {
        if let Some(reset) = r.reset.map(|d| d + age).filter(|d| !d.is_zero()) {
            if r.limit > r.remaining {
                let used = r.limit - r.remaining;
                let secs = reset.as_secs_f64();
                // Whole-second instants that are truncated (a formatter that drops the
                // fraction), not rounded up, put the bucket's fill up to a second after them,
                // and may lie behind the count: only `used / (secs - past + 1)` bounds the
                // rate from below. Read as rounded up, one a few milliseconds ahead read as a
                // refill of thousands a second (`anthropic` written elsewhere: 3,050/s for a
                // bucket of 25/s, and the level resynchronised from it sent bursts: 18-39
                // rate 429s in 500).
                let truncated = self.truncated && r.instant && r.coarse;
                let sample = if truncated {
                    used / (secs - r.past.as_secs_f64() + 1.0).max(f64::MIN_POSITIVE)
                } else {
                    used / secs
                };
                // A reset in whole seconds (Anthropic's RFC 3339 instants, Azure's integers) is
                // read as rounded up (an instant until one shows truncation, above): the
                // bucket is full in `secs - 1` to `secs`, so the rate is at least
                // `used / secs` and, from two seconds on, less than `used / (secs - 1)`.
                // The estimate is the largest lower bound, lowered only to an upper bound (a
                // lowered limit). A sample below it is no evidence: it was a decay of 2% per
                // such sample, and a fleet that sends a little under the rate keeps its bucket
                // near full, where every sample is low, so the estimate fed on its own
                // shortfall (four corrals on Azure's headers took twice the bound).
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
                    let below = if secs >= 2.0 {
                        used / (secs - 1.0)
                    } else {
                        f64::INFINITY
                    };
                    if sample >= self.header_rate {
                        self.header_rate = sample;
                        self.header_rate_loose = loose;
                    } else if self.header_rate > below {
                        self.header_rate = below;
                        self.header_rate_loose = false;
                    }
                } else {
                    self.header_rate = 0.5 * sample + 0.5 * self.header_rate;
                    self.header_rate_loose = false;
                }
            }
        }
    }

    /// `replicas` corrals read the same reports of this bucket with nothing dividing it (fleet
    /// replicas whose Redis has no shared bucket for it: one whose reset is too coarse to share
    /// a rate by). Each reads the whole key's headroom, so each takes its part of it, and of
    /// the bucket's refill up to a full one: else every replica spends a full bucket at once
    /// after a pause all of them end together, several buckets' worth, and the 429s that come
    /// back pause them all again.
    ///
    /// Without headers, the same count splits the ramp: replicas that each started alone meet
    /// the bucket's edge as one corral `replicas` times as fast, each cuts its pace from its
    /// own share of that rush, and every cut down to the key's rate costs a 429 (10-11 of 500
    /// with four replicas on Redis and no headers, where one corral takes 4-6). So when the
    /// count grows, what the ramp built as if alone shrinks to this replica's part: in slow
    /// start the level and burst (and the answers still due for sends made as if alone owe
    /// back what they would add beyond it), after it a cut's guess. An estimate from the 429s
    /// is this replica's own share already, and is left as it is.
    pub fn among(&mut self, replicas: u64) {
        self.replicas = replicas.max(1) as f64;
        if self.replicas <= self.ramp_among {
            return;
        }
        let keep = self.ramp_among / self.replicas;
        self.ramp_among = self.replicas;
        match self.source {
            Source::SlowStart => {
                let due: f64 = self
                    .unanswered
                    .iter()
                    .filter(|t| t.seq > self.consented_seq)
                    .map(|t| t.cost)
                    .sum();
                // Each answer gives its slot back and one more: `2 * keep` each now.
                let owed = 2.0 * due * (1.0 - keep);
                self.level = self.level.max(0.0) * keep + self.level.min(0.0) - owed;
                self.burst = (self.burst * keep).max(1.0);
            }
            Source::Aimd => {
                if let Some(cap) = self.cap.as_mut().filter(|c| c.before.is_some()) {
                    cap.rate = (cap.rate * keep).max(MIN_RATE);
                    cap.before = cap.before.map(|b| b * keep);
                }
            }
            _ => {}
        }
    }

    /// This pacer's part of what the headers report ([`Self::among`]); 1 when nothing else
    /// reads them, or when they do not pace it.
    pub(super) fn part(&self) -> f64 {
        if matches!(self.source, Source::Headers | Source::Observed) {
            self.replicas
        } else {
            1.0
        }
    }

    /// The most the level may hold: this pacer's part of the burst the headers report, or,
    /// once the burst is its own (half a second of its pace when the report is demoted, the
    /// ramp's window, the 429s' pace), all of it. A request waits for the level to reach its
    /// cost or this, whichever is less ([`Self::need`]), so a ceiling under one unit (a part
    /// of a small burst) paces rather than stalls. Divided again, a
    /// demoted fleet replica's ceiling was an eighth of a second of its pace, under one
    /// request below 8 a second, and its requests went only as lone ones after a quarter
    /// second of nothing in flight: four corrals on Anthropic's acceleration limit sent 6 a
    /// second for 30 s where each was paced at 4.6.
    pub(super) fn ceiling(&self) -> f64 {
        if self.source == Source::Headers {
            self.burst / self.part()
        } else {
            self.burst
        }
    }

    /// What a request of `cost` units waits for the level to hold (see [`Self::ceiling`]).
    pub(super) fn need(&self, cost: f64) -> f64 {
        cost.min(self.ceiling()).max(f64::MIN_POSITIVE)
    }

    /// What `answer` to `ticket` confirms of the reported headroom, in the pacer's units (a
    /// tokens pacer confirms a request's tokens per answer). Only this bucket's refusal halves
    /// it (an overload says nothing about the bucket), and once per round trip, as a cut (TCP
    /// halves its window once per window of losses): the 429s of attempts sent before the
    /// last halving describe the same overrun. Halving per refusal left a window of one after
    /// a burst of 150 refused at once, regrown only per answer: a second with nothing sent on
    /// a bucket refilling 50 a second.
    fn confirm(&mut self, ticket: Ticket, answer: Answer) {
        self.verified = match answer {
            Answer::RateLimited if ticket.seq <= self.verified_cut_seq => self.verified,
            Answer::RateLimited => {
                self.verified_cut_seq = self.sent;
                (self.verified / 2.0).max(1.0)
            }
            Answer::Ok if self.consented(ticket) => self.verified,
            Answer::Ok => self.verified + ticket.cost.max(1.0),
            Answer::RefusedElsewhere | Answer::Overloaded => self.verified,
        };
    }

    pub(super) fn learn_headers(
        &mut self,
        ticket: Ticket,
        answer: Answer,
        r: Report,
        now: Instant,
    ) {
        if answer == Answer::Ok && r.limit > 0.0 {
            self.last_ok_share = Some(r.remaining / r.limit);
        }
        self.last_remaining = Some(r.remaining);
        self.remaining_seq = Some(ticket.seq);
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
        self.confirm(ticket, answer);
        // An instant's wait, read when the answer came, is short by the answer's age.
        let age = if r.instant {
            now.saturating_duration_since(ticket.sent_at)
        } else {
            Duration::ZERO
        };
        // The upstream counted the attempt after it was sent, and a bucket short of full is
        // full after that: rounded up, its instant is after the send. One before it (by more
        // than clocks kept by NTP differ) was truncated. What was learned from the
        // instants before is then a bound from above, not below: it is learned anew.
        if r.instant && r.coarse && r.limit > r.remaining && r.past > age + CLOCK_SKEW {
            if !self.truncated {
                self.header_rate = 0.0;
            }
            self.truncated = true;
        }
        self.learn_rate(&r, age);
        let since = now.saturating_duration_since(ticket.sent_at).as_secs_f64();
        if self.distrust_until.is_some() {
            self.source = Source::Observed;
            return; // the level follows the 429s, not `remaining`
        }
        self.drop_peer_cap();
        self.source = Source::Headers;
        let floor = self.floor.unwrap_or(0.0);
        self.burst = (r.limit - floor).max(1.0);
        let sent_after = (self.sent - ticket.seq).max(0.0) + self.unanswered_before(ticket);
        // The upstream counted `remaining` when the attempt arrived, somewhere between the send
        // and now. Credit refill for at most the fastest round trip seen (none before one is
        // known): a slow connect or a busy machine must not inflate the level. The slack covers
        // the rest.
        let credit = self.min_rtt.map_or(0.0, |m| since.min(m));
        // The slack covers what the credit may have over-counted, so it is never more than the
        // credit: with none (no answer's round trip known yet) there is nothing to cover, and a
        // flood of refusals reporting `remaining: 0` each holding back 10 ms of a fast refill
        // would pin the level below zero for as long as they keep coming.
        let slack_time = RESYNC_SLACK_TIME.as_secs_f64().min(credit);
        let slack = (self.header_rate * slack_time).max(1.0);
        // With a cap below the headers' rate (others draw on the key too), only this pacer's
        // share of the reported headroom is ours: every corral on the key sees the same report.
        let share = match self.cap {
            Some(c) if self.header_rate > 0.0 => (c.at(now) / self.header_rate).min(1.0),
            _ => 1.0,
        };
        // The slack is a share's too: a whole unit held back per answer from a share of a few
        // units a second halves its pace, and the report each answer brings leaves it behind
        // the others on the key for good.
        let slack = slack * share;
        let share = share.min(1.0 / self.part());
        let headroom = (r.remaining - floor) + self.header_rate * credit;
        let level = headroom * share - sent_after - slack;
        // However much was sent since, the level owes only what those sends can still take:
        // the upstream refuses what its bucket cannot hold (no debt), and a send yet to reach it
        // takes at most the refill until it does. (A burst owed held a bucket of 50 refilled
        // 50/s shut for a second after each burst of refusals, answers and all.)
        let owed = (self.header_rate * self.reach() * share)
            .max(slack)
            .min(self.burst);
        // The confirmed headroom is a window: what is in flight unconfirmed is spent from it.
        let level = (level.min(self.ceiling()))
            .min(self.verified - self.unconfirmed())
            .max(-owed);
        // A report newer than the last one used sets the level; an older one (an answer that
        // took long describes the bucket as it was long ago) may only lower it.
        if ticket.seq > self.synced_seq {
            self.synced_seq = ticket.seq;
            self.level = level;
        } else {
            self.level = self.level.min(level);
        }
        if answer == Answer::Ok && self.kind == Kind::Requests {
            self.drained(ticket, r.remaining - floor, now);
        }
    }
}
