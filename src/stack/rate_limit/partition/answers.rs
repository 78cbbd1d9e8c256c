//! What a partition learns from its answers: [`Partition::observe`] teaches the pacers and
//! sets the pause a 429 puts on the partition; `settle` and `abandon` close a ticket's account.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use http::HeaderMap;
use tokio::time::Instant;

use super::{Pacers, Partition, Shown, Tickets};
use crate::classify::{Outcome, Reason, Throttle};
use crate::fleet::Lease;
use crate::metrics::UpstreamMetrics;
use crate::provider::{self, Report};
use crate::stack::rate_limit::learn::{Answer, Pacer, Source, STORM};
use crate::sync::lock;
/// One attempt's answer as [`Partition::observe`] reads it.
struct Reading<'a> {
    outcome: Outcome,
    /// What a 429 was read as; `None` for any other answer.
    reason: Option<Reason>,
    throttle: Option<&'a Throttle>,
    headers: Option<&'a HeaderMap>,
    sent_at: Option<Instant>,
    /// The 429's wait is the request's own, and a learned pace can stand in for the pause.
    own_wait: bool,
    /// The 429 says a bucket is empty.
    rate_limited: bool,
    /// The 429's wait and its report's reset are both rounded to whole seconds ([`rounded`]).
    rounded: bool,
    now: Instant,
}

/// How long hinted 429s are read as an admission control's after the last of them
/// ([`Partition::admission_control`]).
pub(super) const ADMISSION_MEMORY: Duration = Duration::from_secs(10);

/// What the pacers learned from one answer ([`Partition::learn`]).
struct Learned {
    /// The wait was the request's own: the partition does not pause.
    own_wait_kept: bool,
    /// The 429 was an admission control's: the refused request waits its own hint.
    admission: bool,
    /// The refused attempt was the partition's first send after its pause ended (with a
    /// named wait): its peers are told ([`Partition::admission_control`]).
    first: bool,
    /// The refusing pacer's time for the attempt, on a 429 that says a bucket is empty.
    pause: Option<Duration>,
    /// Whether the requests and the tokens buckets refused.
    refused: (bool, bool),
    /// Whether a bucket that only the 429s show refused: its edge is news to the fleet's
    /// peers. A bucket the provider's headers report is shared through Redis instead.
    edge: bool,
}

/// Each pacer's part of what the provider reports, among the fleet's live replicas `lease`
/// counts (see `Lease::undivided`).
fn fleet_parts(p: &mut Pacers, lease: &Lease) {
    let reported = [&p.requests, &p.tokens].map(|q| q.upstream_model().map(|m| m.0));
    let ([(requests, divided), (tokens, _)], live) = lease.undivided(reported);
    p.requests.among(requests);
    p.requests.fleet_live(live);
    p.requests.fleet_bucket(divided);
    p.tokens.among(tokens);
}

/// The upstream named a wait on a 429 that says a bucket is empty: a storm's cuts recover by
/// doubling after a long one ([`Pacer::long_pause`]), and when the partition pauses for it
/// (`pauses`) the refusing pacers' levels start from nothing at its end ([`Pacer::hold`]).
fn named_pause(p: &mut Pacers, wait: Duration, refused: (bool, bool), pauses: bool, now: Instant) {
    p.requests.long_pause(wait);
    p.tokens.long_pause(wait);
    if pauses {
        let until = now + wait.min(provider::hints::MAX_HINT);
        if refused.0 {
            p.requests.hold(until);
        }
        if refused.1 {
            p.tokens.hold(until);
        }
    }
}

impl Partition {
    /// Learn from one attempt's answer, with what its 429 was read as (`throttle`). A 429 that
    /// says the bucket is empty (rate, unknown) pauses the partition until its hint passes (a
    /// guessed while when it names none) and may move the pace; one whose wait is beyond the
    /// deadline pauses it for that wait; an overload or a quota moves neither.
    ///
    /// In order: read the answer, teach the pacers ([`Self::learn`], with their lock held),
    /// choose the pause ([`Self::pause_for`]) and set it ([`Self::extend_pause`]), then wake
    /// the waiters that wait for answers. Returns whether the refused request waits its 429's
    /// hint on its own (an admission control's refusal: the partition goes on).
    pub fn observe(
        &self,
        tickets: Option<Tickets>,
        outcome: Outcome,
        throttle: Option<&Throttle>,
        headers: Option<&HeaderMap>,
        sent_at: Option<Instant>,
        metrics: &UpstreamMetrics,
    ) -> bool {
        let now = Instant::now();
        if let Some(lease) = &self.lease {
            lease.answered();
        }
        let reason = match outcome {
            Outcome::Throttled(429) => Some(throttle.map_or(Reason::Unknown, |t| t.reason)),
            _ => None,
        };
        // Only a learned pace can stand in for the pause for the other requests, and only
        // after clear headroom (see `Pacer::had_headroom`).
        let own_wait = throttle.is_some_and(|t| t.own_wait) && self.pacers.is_some();
        let rate_limited = reason.is_some_and(Reason::empties_bucket);
        let reading = Reading {
            outcome,
            reason,
            throttle,
            headers,
            sent_at,
            own_wait,
            rate_limited,
            rounded: reason.is_some() && headers.is_some_and(rounded),
            now,
        };
        let mut learned = Learned {
            own_wait_kept: false,
            admission: false,
            first: false,
            pause: None,
            refused: (rate_limited, false),
            edge: rate_limited,
        };
        if let (Some(pacers), Some(tickets)) = (&self.pacers, tickets) {
            let mut p = self.lock_pacers(pacers);
            learned = self.learn(&mut p, tickets, &reading, metrics);
        }
        if let Some((wait, hinted)) = self.pause_for(&reading, &learned) {
            self.extend_pause(wait, hinted, &reading, &learned);
        }
        if self.queued.load(Ordering::Acquire) > 0 {
            self.answered.notify_waiters();
        }
        learned.admission
    }

    /// Teach both pacers what the answer to the attempt admitted with `tickets` says of their
    /// buckets, called with their lock held (`p`): which bucket refused, what the reports show,
    /// whether the wait was the request's own; then publish what they learned.
    fn learn(
        &self,
        p: &mut Pacers,
        tickets: Tickets,
        reading: &Reading<'_>,
        metrics: &UpstreamMetrics,
    ) -> Learned {
        let Reading {
            outcome,
            reason,
            throttle,
            headers,
            own_wait,
            rate_limited,
            now,
            ..
        } = *reading;
        let [requests_report, tokens_report] =
            headers.map_or([None, None], |h| provider::reports(h, SystemTime::now));
        let named_wait = throttle
            .filter(|t| rate_limited && t.named)
            .and_then(|t| t.hint);
        let (mut for_requests, mut for_tokens) = attribute(
            outcome,
            reason,
            requests_report,
            tokens_report,
            tickets.tokens.cost(),
        );
        // A wait that is the request's own (see `Throttle::own_wait`) is no evidence about
        // the pace, and the headroom the refusing bucket reports after it needs no
        // confirming. Not when it is rounded to whole seconds: a wait and a reset rounded
        // alike say too little to tell an admission control's queue from a bucket's edge,
        // and the edge is what corrals on one key meet.
        let own_wait = own_wait && !reading.rounded;
        let reported = requests_report.is_some() || tokens_report.is_some();
        let (admission, first) = self.admission_control(p, tickets, reading, reported);
        let full_after = (
            own_wait && for_requests == Answer::RateLimited && p.requests.had_headroom(),
            own_wait && for_tokens == Answer::RateLimited && p.tokens.had_headroom(),
        );
        for (answer, own) in [
            (&mut for_requests, full_after.0 || admission),
            (&mut for_tokens, full_after.1 || admission),
        ] {
            if own && *answer == Answer::RateLimited {
                *answer = Answer::RefusedElsewhere;
            }
        }
        let own_wait_kept = full_after.0 || full_after.1 || admission;
        if let Some(lease) = &self.lease {
            fleet_parts(p, lease);
        }
        p.requests
            .observe(tickets.requests, for_requests, requests_report, now);
        if admission || reason == Some(Reason::Quota) {
            p.requests.refused_by_queue(tickets.requests); // no bucket refused it
        }
        p.tokens
            .observe(tickets.tokens, for_tokens, tokens_report, now);
        let refused = (
            for_requests == Answer::RateLimited,
            for_tokens == Answer::RateLimited,
        );
        if let Some(lease) = &self.lease {
            lease.learned(0, p.requests.upstream_model(), p.requests.unseen());
            lease.learned(1, p.tokens.upstream_model(), p.tokens.unseen());
            if let Some(e) = p.requests.take_estimate() {
                lease.estimated(e);
            }
        }
        if full_after.0 {
            p.requests.full_after();
        }
        if full_after.1 {
            p.tokens.full_after();
        }
        if let Some(wait) = named_wait {
            named_pause(p, wait, refused, !own_wait_kept, now);
        }
        let mut learned_pause: Option<Duration> = None;
        if rate_limited {
            let refusing = if for_tokens == Answer::RateLimited {
                p.tokens.time_for(tickets.tokens.cost().max(1.0))
            } else {
                p.requests.refusal_pause(now)
            };
            learned_pause = refusing;
        }
        self.publish(p, metrics);
        let blind = |p: &Pacer| !matches!(p.source(), Source::Headers | Source::Observed);
        Learned {
            own_wait_kept,
            admission,
            first,
            pause: learned_pause,
            refused,
            edge: (refused.0 && blind(&p.requests)) || (refused.1 && blind(&p.tokens)),
        }
    }

    /// Whether a 429 that names a wait is an admission control's, not a bucket's edge: the
    /// first attempt sent after the last named pause had passed was refused again, where a
    /// bucket refilled over the wait it named would have taken it (a gateway's or a
    /// self-hosted server's queue refuses each request a few times whatever the rate). From
    /// then until [`ADMISSION_MEMORY`] after the last such refusal, each hinted refusal is its
    /// request's own wait: the request waits its hint, the partition goes on at its pace and
    /// no pace is cut, as a client honouring `retry-after` alone would do. Only for 429s with
    /// no rate-limit report (a report says which bucket refused, and `Throttle::own_wait`
    /// reads it), naming a wait of a second or more.
    ///
    /// A fleet's replicas share the refill a pause ends with, so a bucket may refuse the first
    /// sends of all but one: there the evidence is every live replica's first send after the
    /// pause refused, this one's and its peers' (told through Redis; the lease finds it and
    /// calls `Peers::admission`). Without it, four corrals in front of an admission control
    /// (each request refused twice with `retry-after: 1`) cut their paces on every refusal and
    /// sent 1,500 attempts in 53 s, where the SDK alone took 4.3 s.
    ///
    /// Returns whether the 429 is an admission control's, and whether the refused attempt was
    /// the partition's first send after its pause ended.
    fn admission_control(
        &self,
        p: &mut Pacers,
        tickets: Tickets,
        reading: &Reading<'_>,
        reported: bool,
    ) -> (bool, bool) {
        // A queue names a wait in seconds ("come back in a second"); a bucket that names one
        // to the millisecond (`retry-after-ms`, Gemini's `retryDelay`) is telling when its next
        // token comes, and when another sender on the key took it the first send after the
        // pause is refused too: four corrals without shared state read Gemini's refusals as a
        // queue's, stopped cutting, and drew 14,000 429s.
        let hinted = reading
            .throttle
            .is_some_and(|t| t.named && t.hint.is_some_and(|h| h >= STORM));
        if !reading.rate_limited || !hinted || reported {
            return (false, false);
        }
        let now = reading.now;
        let known = self.admission.until(now).is_some();
        // In a fleet a peer's refusal of the same moment may have paused it again already.
        let end = match self.lease {
            Some(_) => self.pause.ended_before(tickets.requests.sent_at()),
            None => self.pause.ended(now),
        };
        let first = end.filter(|&end| p.requests.first_since(tickets.requests, end));
        // In a fleet the lease finds it, from every replica's first send ([`Lease::throttled`]).
        let found = !known && self.lease.is_none() && first.is_some();
        if found {
            // The cuts its refusals made before it was found were no bucket's either.
            p.requests.forget_cuts();
            p.tokens.forget_cuts();
        }
        if known || found {
            self.admission.extend(now + ADMISSION_MEMORY);
        }
        (known || found, first.is_some())
    }

    /// Set the pacing gauges from the pacers (`p`, their lock held), and note whether the
    /// tokens pacer has learned anything.
    fn publish(&self, p: &mut Pacers, metrics: &UpstreamMetrics) {
        for (pacer, shown) in [&p.requests, &p.tokens].into_iter().zip(&mut p.shown) {
            let now_shown = Shown {
                rate: pacer.rate(),
                burst: pacer.burst(),
                source: pacer.source(),
                remaining: pacer.last_remaining,
            };
            if *shown == Some(now_shown) {
                continue;
            }
            *shown = Some(now_shown);
            let kind = pacer.kind().label();
            let gauges = self
                .gauges
                .get_or_init(|| metrics.pacing(&self.metric_model));
            gauges.learned(kind, now_shown.rate, now_shown.burst);
            gauges.limit_source(kind, now_shown.source.label());
            if let Some(r) = now_shown.remaining {
                gauges.remaining(kind, r);
            }
        }
        self.tokens_learned
            .store(p.tokens.source() != Source::None, Ordering::Relaxed);
    }

    /// The pause an answer puts on the partition, and whether the upstream named it (`true`)
    /// or corral guessed it; `None`: no pause.
    fn pause_for(&self, reading: &Reading<'_>, learned: &Learned) -> Option<(Duration, bool)> {
        let throttle = reading.throttle;
        let nonzero = |d: Option<Duration>| d.filter(|d| !d.is_zero());
        let named = throttle.filter(|t| t.named).and_then(|t| nonzero(t.hint));
        let reset = throttle.filter(|t| !t.named).and_then(|t| nonzero(t.hint));
        match reading.reason {
            // The request waits on its own: the partition goes on at its pace.
            _ if learned.own_wait_kept => None,
            // The upstream's own word first; a bucket's reset is the time until it is *full*,
            // far longer than one request needs, so the learner's estimate goes before it.
            Some(r) if r.empties_bucket() => match (named, nonzero(learned.pause), reset) {
                // A wait in whole seconds (`retry-after` alone) that the refused request waits
                // on its own (the report says its bucket is full by then), on a bucket whose
                // headers pace it refilling sooner: the request waits its hint, the partition
                // its pace. Paused for the rounded hint, every replica on the key ends the
                // pause together a second later, spends a whole bucket at once, and the 429s
                // it draws pause them all again.
                (Some(wait), Some(paced), _)
                    if paced < wait && reading.own_wait && reading.rounded =>
                {
                    Some((paced, false))
                }
                (Some(wait), _, _) => Some((wait, true)),
                (None, Some(wait), _) => Some((wait, false)),
                (None, None, Some(wait)) => Some((wait, true)),
                (None, None, None) => Some((self.default_pause, false)),
            },
            Some(Reason::LongWindow) => named.or(reset).map(|wait| (wait, true)),
            _ => None,
        }
    }

    /// Pause the partition for `wait`: the named pause when the upstream named it (`hinted`),
    /// shared with the fleet's peers, else the guessed one; `learned`: which buckets refused.
    fn extend_pause(&self, wait: Duration, hinted: bool, reading: &Reading<'_>, learned: &Learned) {
        let now = reading.now;
        let wait = wait.min(provider::hints::MAX_HINT);
        let target = if hinted {
            &*self.pause
        } else {
            &self.guessed_pause
        };
        match (reading.reason, reading.sent_at) {
            (Some(r), Some(sent)) if r.empties_bucket() => target.extend_for(now + wait, sent, now),
            _ => target.extend(now + wait),
        }
        // Peers extend their named pause with it: only the upstream's word is shared. A
        // refusal at the edge of a bucket no header reports is shared even without one: each
        // peer ends a throttle window there (what it sent since its last is its share of the
        // refill). Under headers the peers learn the bucket from Redis instead: an edge would
        // only cut those still waiting for their first answer to the key's headers.
        if let Some(lease) = &self.lease {
            let edge = reading.rate_limited && learned.edge;
            if hinted || edge {
                let (requests, tokens) = learned.refused;
                lease.throttled(
                    hinted.then_some(wait),
                    requests,
                    tokens,
                    edge,
                    learned.first,
                );
            }
        }
    }

    /// The upstream counted `tokens` for the attempt admitted with `tickets`: settle what the
    /// tokens pacer charged for it, and what the fleet's shared bucket did.
    pub fn settle(&self, tickets: Tickets, tokens: f64) {
        if let Some(pacers) = &self.pacers {
            lock(pacers)
                .tokens
                .settle(tickets.tokens, tokens, Instant::now());
        }
        if let Some(lease) = self.lease.as_ref().filter(|_| tickets.leased > 0.0) {
            lease.settle_tokens(tickets.leased, tokens);
        }
    }

    /// The request admitted with `tickets` left before its answer came (cancelled): its tickets
    /// are no longer in flight.
    pub fn abandon(&self, tickets: Tickets) {
        if let Some(pacers) = &self.pacers {
            let now = Instant::now();
            let mut p = lock(pacers);
            p.requests.abandon(tickets.requests, now);
            p.tokens.abandon(tickets.tokens, now);
        }
    }
}

/// Which bucket a 429 came from, by the reports on it: a bucket whose `remaining` cannot cover
/// the attempt refused it (honestly). When no report explains the refusal, the requests bucket
/// is blamed: that is where providers quantize (a per-minute report over a per-second bucket).
pub(super) fn attribute(
    outcome: Outcome,
    reason: Option<Reason>,
    requests: Option<Report>,
    tokens: Option<Report>,
    token_cost: f64,
) -> (Answer, Answer) {
    match outcome {
        // A quota or a long window: the reports still describe the buckets, but no pace moves.
        Outcome::Throttled(429) if reason.is_some_and(|r| !r.empties_bucket()) => {
            (Answer::RefusedElsewhere, Answer::RefusedElsewhere)
        }
        Outcome::Throttled(429) => {
            let requests_out = requests.is_some_and(|r| r.remaining < 1.0);
            let tokens_out = tokens.is_some_and(|r| r.remaining < token_cost.max(1.0));
            match (requests_out, tokens_out) {
                (false, true) => (Answer::RefusedElsewhere, Answer::RateLimited),
                (true, true) => (Answer::RateLimited, Answer::RateLimited),
                _ => (Answer::RateLimited, Answer::RefusedElsewhere),
            }
        }
        Outcome::Overloaded(_) => (Answer::Overloaded, Answer::Overloaded),
        _ => (Answer::Ok, Answer::Ok),
    }
}

/// Whether the 429's named wait is `retry-after` in whole seconds alone and the report it
/// comes with shows an empty bucket whose reset is rounded up to whole seconds as well
/// (Anthropic's): the two together say no more than "within a second or so". An exact reset
/// (OpenAI's `1s`) beside a `retry-after: 1` says the bucket is full when the wait ends.
fn rounded(headers: &HeaderMap) -> bool {
    provider::hints::whole_seconds_only(headers)
        && provider::reports(headers, SystemTime::now)
            .into_iter()
            .flatten()
            .any(|r| r.coarse && r.remaining < 1.0)
}
