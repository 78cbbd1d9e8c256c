//! The pacer's rules one at a time, each driven by hand in virtual time.

use super::*;

/// A 429 while `remaining` shows headroom above the learned floor demotes the header model: the
/// level follows the 429s (empty), not the report, and the source says so.
#[tokio::test(start_paused = true)]
async fn a_report_caught_lying_is_demoted_then_trusted_again() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = refilling(1200.0, 20.0);
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, Some(report(1150.0)), now);
    assert_eq!(
        pacer.source(),
        Source::Headers,
        "the first 429 teaches a floor"
    );
    now += Duration::from_secs(2);
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, Some(report(1180.0)), now);
    assert_eq!(
        pacer.source(),
        Source::Observed,
        "30 above the floor: a lie"
    );
    // A report of lots of headroom no longer sets the level.
    now += Duration::from_millis(10);
    let t = pacer.try_acquire(1.0, now);
    assert!(t.is_err(), "empty after the 429, refilling at the pace");
    now += Duration::from_millis(100);
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report(1199.0)), now);
    let mut admitted = 0;
    while pacer.try_acquire(1.0, now).is_ok() {
        admitted += 1;
    }
    assert!(
        admitted <= 1,
        "{admitted} admitted on a report of 1199 remaining"
    );
    // After the probation without another such 429, the headers are believed again.
    now += PROBATION + Duration::from_secs(1);
    assert!(pacer.can_acquire(1.0, now));
    assert_eq!(pacer.source(), Source::Headers);
}

#[test]
fn the_unanswered_list_is_bounded_without_headers() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    // Answered without any report (no headers): each answer leaves the list.
    let t = pacer.try_acquire(1.0, now).unwrap();
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.observe(t, Answer::Ok, None, now);
    assert!(pacer.unanswered.is_empty());
    // Never answered (cancelled): the list keeps the newest MAX_UNANSWERED.
    for _ in 0..(MAX_UNANSWERED + 100) {
        pacer.admit(1.0, now);
    }
    assert_eq!(pacer.unanswered.len(), MAX_UNANSWERED);
}

#[tokio::test(start_paused = true)]
async fn per_minute_reports_learn_their_floor_from_the_first_429() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    // limit 1200 "per minute", but the real bucket is empty at remaining 1150.
    let r = fine_report(1200.0, 1150.0, Duration::from_millis(2500));
    pacer.observe(ticket, Answer::RateLimited, Some(r), now);
    assert_eq!(pacer.burst(), 50.0, "burst = limit - floor");
    assert!(
        pacer.try_acquire(1.0, now).is_err(),
        "the level is at the floor: wait"
    );
}

#[tokio::test(start_paused = true)]
async fn reported_headroom_is_spent_only_as_fast_as_answers_confirm_it() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    // A per-minute style report: 1199 "remaining", nothing yet says the real burst is that big.
    let r = fine_report(1200.0, 1199.0, Duration::from_millis(50));
    pacer.observe(ticket, Answer::Ok, Some(r), now);
    let mut admitted = 0;
    while pacer.try_acquire(1.0, now).is_ok() {
        admitted += 1;
    }
    assert!(
        admitted <= 11,
        "{admitted} admitted on one unconfirmed report"
    );
}

#[tokio::test(start_paused = true)]
async fn an_overload_529_does_not_teach_a_floor() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    let ticket = pacer.try_acquire(1.0, now).unwrap();
    let r = fine_report(1000.0, 999.0, Duration::from_millis(1));
    pacer.observe(ticket, Answer::Overloaded, Some(r), now);
    assert_eq!(pacer.burst(), 1000.0, "a 529 says nothing about our bucket");
}

#[tokio::test(start_paused = true)]
async fn whole_second_resets_average_out() {
    // Anthropic-style: 1000/s true, resets rounded up to whole seconds.
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 1000, 1.0, now);
    for used in [1.0, 2.0, 500.0, 900.0, 3.0] {
        let ticket = pacer.try_acquire(1.0, now).unwrap();
        let reset = Duration::from_secs_f64((used / 1000.0_f64).ceil());
        pacer.observe(
            ticket,
            Answer::Ok,
            Some(fine_report(1000.0, 1000.0 - used, reset)),
            now,
        );
    }
    assert!(
        pacer.rate() > 800.0,
        "learned {} per second, true 1000",
        pacer.rate()
    );
}

/// A rounded reset under two seconds bounds the rate only from below: the bucket may refill in a
/// fraction of that second. Corrals sharing a key are not paced by it; a finer or longer reset
/// is shared.
#[tokio::test(start_paused = true)]
async fn a_rate_bounded_only_from_below_is_not_shared() {
    let now = Instant::now();
    let model = |used: f64, reset: Duration, coarse: bool| {
        let mut pacer = Pacer::new(Kind::Requests, 1000, 1.0, now);
        let ticket = pacer.try_acquire(1.0, now).unwrap();
        let r = Report {
            limit: 1000.0,
            remaining: 1000.0 - used,
            reset: Some(reset),
            coarse,
            instant: false,
            past: Duration::ZERO,
        };
        pacer.observe(ticket, Answer::Ok, Some(r), now);
        pacer.upstream_model()
    };
    assert_eq!(model(50.0, Duration::from_secs(1), true), None);
    assert_eq!(model(50.0, Duration::from_millis(1400), true), None);
    let (rate, burst, _) = model(500.0, Duration::from_secs(10), true).unwrap();
    assert_eq!((rate, burst), (50.0, 1000.0));
    let (rate, _, _) = model(50.0, Duration::from_millis(500), false).unwrap();
    assert_eq!(rate, 100.0);
}

#[tokio::test(start_paused = true)]
async fn slow_start_without_any_signal_ends_ungated() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, now);
    for _ in 0..5000 {
        now += Duration::from_millis(1);
        if let Ok(ticket) = pacer.try_acquire(1.0, now) {
            pacer.observe(ticket, Answer::Ok, None, now);
        }
    }
    assert_eq!(pacer.source(), Source::None);
}

/// An overload (529, or a 429 read as overload) moves no pace, with or without headers.
#[test]
fn an_overload_moves_no_pace() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    for _ in 0..10 {
        let t = pacer.try_acquire(1.0, now).unwrap();
        pacer.observe(t, Answer::Overloaded, None, now);
        now += Duration::from_millis(20);
    }
    assert_eq!(
        pacer.source(),
        Source::SlowStart,
        "no cut: still in slow start"
    );
    assert!(pacer.cap.is_none());
}

/// With nothing in flight for a while, one request goes whatever the level.
#[test]
fn a_lone_request_after_a_storm_goes_at_once() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    // Twenty 429s, nothing admitted: the pace is cut to its floor.
    for _ in 0..20 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now);
        now += Duration::from_millis(50);
    }
    assert!(pacer.try_acquire(1.0, now).is_err(), "busy: the pace holds");
    now += IDLE;
    assert!(pacer.try_acquire(1.0, now).is_ok(), "idle: one goes");
}

/// A request larger than the token bucket goes at once, charged nothing; one admitted past the
/// pace owes at most one burst.
#[test]
fn a_token_request_larger_than_the_bucket_goes_at_once_and_debt_is_bounded() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = fine_report(10_000.0, 9_000.0, Duration::from_secs(6));
    let t = pacer.try_acquire(100.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    let huge = pacer.try_acquire(2.0e9, now).expect("goes at once");
    assert_eq!(huge.cost(), 0.0, "charged nothing");
    for _ in 0..100 {
        pacer.admit_anyway(5_000.0, now);
    }
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// What the upstream counted settles the charge: an over-charge comes back to the level.
#[test]
fn usage_settles_what_was_charged() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = fine_report(10_000.0, 9_000.0, Duration::from_secs(6));
    let t = pacer.try_acquire(100.0, now).unwrap();
    pacer.observe(t, Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    let t = pacer.admit_anyway(4_000.0, now);
    let charged = pacer.level;
    pacer.settle(t, 1_000.0, now);
    assert!(
        (pacer.level - (charged + 3_000.0)).abs() < 1e-6,
        "the 3000 over-charged came back: {} from {charged}",
        pacer.level
    );
}

/// An overload answered with a report leaves the confirmed window alone: only this bucket's
/// refusal halves it.
#[test]
fn an_overload_with_headers_leaves_the_confirmed_window_alone() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = fine_report(1000.0, 990.0, Duration::from_secs(1));
    for _ in 0..5 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::Ok, Some(report), now);
        now += Duration::from_millis(20);
    }
    let confirmed = pacer.verified;
    for _ in 0..12 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::Overloaded, Some(report), now);
        now += Duration::from_millis(20);
    }
    assert_eq!(pacer.verified, confirmed);
    assert!(pacer.cap.is_none(), "no cut");
}

/// A tokens pacer on a report of 30,000 refilled at 500/s, demoted by a second 429 that still
/// shows 20,000 left (`now` is moved past it).
fn demoted_tokens_pacer(now: &mut Instant) -> Pacer {
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, *now);
    let report = |remaining: f64| {
        let reset = Duration::from_secs_f64((30_000.0 - remaining) / 500.0);
        fine_report(30_000.0, remaining, reset)
    };
    let t = pacer.admit_anyway(100.0, *now);
    pacer.observe(t, Answer::RateLimited, Some(report(1_000.0)), *now);
    *now += Duration::from_secs(2);
    let t = pacer.admit_anyway(100.0, *now);
    pacer.observe(t, Answer::RateLimited, Some(report(20_000.0)), *now);
    assert_eq!(pacer.source(), Source::Observed);
    pacer
}

/// A demoted tokens pacer keeps a burst of half a second of pace, but a request is oversize
/// (sent uncharged) only against the bucket the reports describe.
#[test]
fn a_demoted_tokens_pacer_still_charges_requests_that_fit_the_reported_bucket() {
    let mut now = Instant::now();
    let mut pacer = demoted_tokens_pacer(&mut now);
    pacer.refill(now);
    assert!(pacer.burst() < 1_500.0, "burst {}", pacer.burst());
    let t = pacer.admit_anyway(1_500.0, now);
    assert!(
        t.cost() > 0.0,
        "charged: it fits the reported bucket of 29000"
    );
    let huge = pacer.admit_anyway(50_000.0, now);
    assert_eq!(
        huge.cost(),
        0.0,
        "larger than the reported bucket: uncharged"
    );
}

/// A request cancelled before its answer is no longer in flight: the idle rule still holds.
#[test]
fn a_cancelled_request_is_not_in_flight() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let t = pacer.try_acquire(1.0, now).unwrap();
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.abandon(t, now);
    assert!(pacer.unanswered.is_empty());
    // A ticket of no cost shares its seq with the one before: answering it forgets nothing.
    let kept = pacer.admit_anyway(1.0, now);
    let free = pacer.admit(0.0, now);
    pacer.observe(free, Answer::Ok, None, now);
    assert_eq!(pacer.unanswered.len(), 1);
    pacer.observe(kept, Answer::Ok, None, now);
    assert!(pacer.unanswered.is_empty());
}

/// A report of a per-day quota (full again only hours from now) sets no pace: the pacer learns
/// as without headers, and its 429s pace it.
#[test]
fn a_per_day_report_sets_no_pace() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let day = fine_report(300.0, 290.0, Duration::from_secs(5 * 3600));
    for _ in 0..5 {
        let t = pacer.try_acquire(1.0, now).unwrap();
        pacer.observe(t, Answer::Ok, Some(day), now);
        now += Duration::from_millis(20);
    }
    assert_eq!(pacer.source(), Source::SlowStart, "no header model");
    assert_eq!(
        pacer.last_remaining,
        Some(290.0),
        "the day's count is still shown"
    );
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, Some(day), now);
    assert_eq!(pacer.source(), Source::Aimd, "paced from the 429s");
    assert!(pacer.rate() >= MIN_RATE);
}

/// A demoted tokens pacer (its burst half a second of pace) admits a request that fits the
/// reported bucket but not its own burst: it owes at most one burst, not the whole request.
#[test]
fn a_request_beyond_a_demoted_burst_owes_at_most_one_burst() {
    let mut now = Instant::now();
    let mut pacer = demoted_tokens_pacer(&mut now);
    now += Duration::from_secs(10); // the level refills to the (small) burst
    let t = pacer
        .try_acquire(20_000.0, now)
        .expect("the level is full: it goes");
    assert!(t.cost() > 0.0, "charged: it fits the reported bucket");
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// A report that predates many sends resynchronises the level to what it says less what was
/// sent since, but never to a debt beyond one burst.
#[test]
fn a_resync_from_an_old_report_owes_at_most_one_burst() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, now);
    let report = |remaining: f64| fine_report(1_000.0, remaining, Duration::from_secs(1));
    let t = pacer.admit_anyway(10.0, now);
    pacer.observe(t, Answer::Ok, Some(report(990.0)), now);
    assert_eq!(pacer.source(), Source::Headers);
    let first = pacer.admit_anyway(10.0, now);
    for _ in 0..100 {
        pacer.admit_anyway(1_000.0, now);
    }
    pacer.observe(first, Answer::Ok, Some(report(0.0)), now);
    assert!(
        pacer.level >= -pacer.burst(),
        "owes {} of a burst of {}",
        -pacer.level,
        pacer.burst()
    );
}

/// A bucket refuses at once: an attempt not refused within `CONSENT` was admitted, and grows
/// the slow start as a success would, so answers that take seconds still let it double per
/// `CONSENT`. Its answer, when it comes, adds nothing more.
#[test]
fn silence_confirms_what_the_bucket_did_not_refuse() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let first = sent(&mut pacer, start, 200);
    assert_eq!(first.len(), 10);
    // Up to the wait: nothing confirmed, nothing more goes.
    let more = sent(&mut pacer, start + Duration::from_millis(200), 299);
    assert!(more.is_empty(), "{} more", more.len());
    // The first ten confirmed (each 500 ms after its send): twenty more go.
    let second = sent(&mut pacer, start + Duration::from_millis(499), 250);
    assert_eq!(second.len(), 20, "doubled");
    // Their answers, seconds later, give nothing the silence did not already give.
    let late = start + Duration::from_secs(3);
    let level = {
        pacer.refill(late);
        pacer.level
    };
    for t in first {
        pacer.observe(t, Answer::Ok, None, late);
    }
    assert!(pacer.level <= level + 1e-9, "{} after {level}", pacer.level);
}

/// A throttle window with a long silence in it (a pause of a whole second named for a refill of
/// milliseconds, or a fleet peer's pause) saw the bucket refill unasked: it estimates nothing,
/// so no cap is read from it far below the upstream's rate (the cuts it makes instead are
/// guesses, and recover).
#[test]
fn a_window_with_a_long_silence_estimates_nothing() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    // Headers: a bucket of 50 refilled at 200/s.
    let t = pacer.try_acquire(1.0, now).unwrap();
    let ok = fine_report(50.0, 40.0, Duration::from_millis(50));
    pacer.observe(t, Answer::Ok, Some(ok), now);
    let empty = fine_report(50.0, 0.0, Duration::from_millis(250));
    // Rounds of: a 429, a second's silence, twelve sends over 12 ms, the next 429.
    for _ in 0..5 {
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, Some(empty), now);
        now += Duration::from_secs(1);
        for _ in 0..12 {
            pacer.admit_anyway(1.0, now);
            now += Duration::from_millis(1);
        }
    }
    let cap = pacer.cap.expect("the repeated 429s cut");
    assert!(
        cap.before.is_some(),
        "an estimate from silent windows: {cap:?}"
    );
}

/// One slow refusal does not hold consent off for good: each later refusal halves its weight.
#[test]
fn a_slow_refusal_is_forgotten_as_fast_ones_come() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let t = pacer.try_acquire(1.0, start).unwrap();
    pacer.observe(t, Answer::RateLimited, None, start + Duration::from_secs(5));
    assert_eq!(pacer.consent_wait(), Duration::from_secs(10));
    let mut now = start + Duration::from_secs(5);
    for _ in 0..6 {
        let t = pacer.admit_anyway(1.0, now);
        now += Duration::from_millis(2);
        pacer.observe(t, Answer::RateLimited, None, now);
    }
    // 5 s halved six times is 78 ms: the wait is back to twice that.
    let wait = pacer.consent_wait();
    assert!(wait < Duration::from_millis(200), "{wait:?}");
}

/// Silence counts after twice the slowest recent refusal of any kind (an overload's too), not
/// after the half second assumed before any is seen: a ramp behind answers that take seconds
/// doubles per refusal round trip, and slow refusals make it wait longer.
#[test]
fn silence_counts_after_twice_the_slowest_refusal() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    assert_eq!(pacer.consent_wait(), CONSENT, "nothing refused yet");
    let t = pacer.try_acquire(1.0, start).unwrap();
    pacer.observe(
        t,
        Answer::Overloaded,
        None,
        start + Duration::from_millis(20),
    );
    assert_eq!(pacer.consent_wait(), Duration::from_millis(40));
    // Refusals of a millisecond: the 20 ms one halves away, down to the floor.
    for _ in 0..6 {
        let t = pacer.admit_anyway(1.0, start);
        pacer.observe(
            t,
            Answer::RateLimited,
            None,
            start + Duration::from_millis(1),
        );
    }
    assert_eq!(pacer.consent_wait(), MIN_CONSENT, "never below a floor");
    // A refusal that took 400 ms: silence now counts after 800 ms.
    let t = pacer.admit_anyway(1.0, start);
    pacer.observe(
        t,
        Answer::RateLimited,
        None,
        start + Duration::from_millis(400),
    );
    assert_eq!(pacer.consent_wait(), Duration::from_millis(800));
}

/// Until the bucket's edge is found, a ramp spreads its sends over the time silence takes to
/// count (refusals seen: an engine's overloads), not over a slow answer's round trip; past the
/// first rate 429 it spreads them over the round trip again.
#[test]
fn the_ramp_spreads_over_the_refusal_time_until_the_edge() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let plenty = fine_report(1_000_000.0, 999_990.0, Duration::from_millis(10));
    // Answers take 200 ms: the ramp's round trip.
    let t = pacer.try_acquire(1.0, start).unwrap();
    let now = start + Duration::from_millis(200);
    pacer.observe(t, Answer::Ok, Some(plenty), now);
    let round = |p: &Pacer| p.ramp_gap().unwrap().as_secs_f64() * p.verified;
    assert!((round(&pacer) - 0.2).abs() < 1e-6, "{}", round(&pacer));
    // A refusal 2 ms after its send, with `report`: the ramp's round trip after it.
    let refused = |p: &mut Pacer, answer: Answer, report: Report| {
        let t = p.admit_anyway(1.0, now);
        p.observe(t, answer, Some(report), now + Duration::from_millis(2));
        round(p)
    };
    // An overload: silence counts after 10 ms, and the ramp spreads over that.
    let after = refused(&mut pacer, Answer::Overloaded, plenty);
    assert!((after - 0.01).abs() < 1e-6, "{after}");
    // A rate 429 finds the edge: the round trip again.
    let empty = fine_report(1_000_000.0, 0.0, Duration::from_secs(1));
    let after = refused(&mut pacer, Answer::RateLimited, empty);
    assert!((after - 0.2).abs() < 1e-6, "{after}");
}

/// A report credited no refill (no answer's round trip known yet) holds back no slack for one:
/// a stream of refusals reporting `remaining: 0` from a bucket refilling a million a second (an
/// admission control's, each naming its own wait) does not pin the level 10 ms below zero.
#[test]
fn a_report_credited_no_refill_holds_back_no_slack() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let refused = fine_report(1_000_000.0, 0.0, Duration::from_secs(1));
    let t = pacer.admit_anyway(1.0, now);
    let later = now + Duration::from_millis(2);
    pacer.observe(t, Answer::RefusedElsewhere, Some(refused), later);
    assert!(pacer.level >= -1.0, "{}", pacer.level);
}

/// A peer's refusal ends a ramp before any answer came (the fleet found the edge); the
/// provider's headers, once they come, carry the key's rate and replace that guess, where a
/// cut of this pacer's own 429 stays.
#[test]
fn headers_replace_what_the_fleet_guessed_before_them() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let tickets: Vec<_> = (0..10).map(|_| pacer.admit_anyway(1.0, now)).collect();
    now += Duration::from_millis(5);
    pacer.peer_throttled(now, 0.0);
    assert_eq!(pacer.source(), Source::Aimd);
    assert!(pacer.cap.is_some(), "the ramp ended");
    now += Duration::from_millis(100);
    let report = fine_report(100.0, 80.0, Duration::from_secs(1));
    pacer.observe(tickets[0], Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    assert!(
        pacer.cap.is_none(),
        "the headers' pace, not the fleet's guess"
    );
    // This pacer's own 429s cut as before, and the next report keeps the cut.
    let empty = fine_report(100.0, 0.0, Duration::from_secs(1));
    for _ in 0..2 {
        let t = pacer.admit_anyway(1.0, now);
        now += Duration::from_millis(1);
        pacer.observe(t, Answer::RateLimited, Some(empty), now);
        now += Duration::from_millis(500);
    }
    let cut = pacer.cap.expect("a repeat 429 cuts");
    pacer.observe(tickets[1], Answer::Ok, Some(report), now);
    assert!(
        pacer.cap.is_some_and(|c| c.rate == cut.rate),
        "its own cut stays"
    );
}

/// Replicas that read the same reports with nothing dividing them each take their part of the
/// reported headroom, and refill to their part of the bucket, not to all of it.
#[test]
fn replicas_reading_one_report_take_their_part_of_it() {
    let mut now = Instant::now();
    // Slow start's window (100) confirms more than the headroom: only the part bounds it.
    let mut pacer = Pacer::new(Kind::Requests, 100, 1.0, now);
    pacer.among(4);
    let t = pacer.admit_anyway(1.0, now);
    now += Duration::from_millis(5);
    let report = fine_report(40.0, 36.0, Duration::from_millis(200));
    pacer.observe(t, Answer::Ok, Some(report), now);
    assert_eq!(pacer.source(), Source::Headers);
    assert!(pacer.level <= 10.0, "a quarter of 40: {}", pacer.level);
    pacer.refill(now + Duration::from_secs(10));
    assert!(
        pacer.level <= 10.0,
        "refilled to a quarter: {}",
        pacer.level
    );
    pacer.among(1);
    pacer.refill(now + Duration::from_secs(20));
    assert_eq!(pacer.level, pacer.burst, "alone: the whole bucket");
}

/// Before any refusal, a connection's handshake measures the round trip: silence counts after
/// twice it plus `REFUSAL_WORK` (at least `MIN_CONSENT`, at most `CONSENT`), so a ramp behind
/// answers that take seconds doubles per few tens of milliseconds on a near network instead of
/// per half second. A refusal, once seen, is the better measure.
#[test]
fn before_a_refusal_silence_counts_after_the_handshake() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    pacer.handshake(0.0001);
    assert_eq!(
        pacer.consent_wait(),
        (Duration::from_micros(200) + REFUSAL_WORK).max(MIN_CONSENT)
    );
    pacer.handshake(0.04);
    assert_eq!(
        pacer.consent_wait(),
        Duration::from_millis(80) + REFUSAL_WORK
    );
    pacer.handshake(2.0);
    assert_eq!(pacer.consent_wait(), CONSENT, "never above the guess");
    // A local upstream: each send is confirmed 40 ms after it goes and lets two more go, so in
    // 300 ms the ramp doubles several times; without a handshake, it waits 500 ms to double.
    // Nothing is confirmed sooner, however near: a front door reading a herd's requests one
    // after another refuses tens of milliseconds late.
    let mut near = Pacer::new(Kind::Requests, 10, 1.0, start);
    near.handshake(0.0001);
    let first = sent(&mut near, start, 40).len();
    let fast = first + sent(&mut near, start + Duration::from_millis(40), 260).len();
    let mut unknown = Pacer::new(Kind::Requests, 10, 1.0, start);
    let slow = sent(&mut unknown, start, 300).len();
    assert!(
        first <= 10,
        "{first}: the initial burst, nothing confirmed in 40 ms"
    );
    assert_eq!(slow, 10, "the initial burst, nothing confirmed");
    assert!(fast >= 80, "{fast} sent in 300 ms");
    // A fleet replica counts silence as soon, but spreads its window over `RAMP_RTT_GUESS`
    // (sends spread over a few ms made its first cut's measure say nothing of the refill).
    let mut replica = Pacer::new(Kind::Requests, 10, 1.0, start);
    replica.in_fleet();
    replica.handshake(0.0001);
    assert_eq!(replica.consent_wait(), near.consent_wait());
    let spread = sent(&mut replica, start, 300).len();
    assert!(
        spread > slow && spread < fast / 2,
        "{spread} sent in 300 ms, {fast} alone"
    );
    // Answers do not replace the handshake's measure: one of 200 ms says how long the
    // service takes, not how long a refusal would (a herd behind answers of 0.2-0.5 s with
    // no limit doubled per answer, 1.2 s to send 500 where the client alone sends at once).
    let mut answered = Pacer::new(Kind::Requests, 10, 1.0, start);
    answered.handshake(0.0001);
    let t = answered.try_acquire(1.0, start).unwrap();
    answered.observe(t, Answer::Ok, None, start + Duration::from_millis(200));
    assert_eq!(answered.consent_wait(), near.consent_wait());
    // A refusal of 100 ms replaces the handshake's measure.
    let t = near.admit_anyway(1.0, start);
    near.observe(
        t,
        Answer::RateLimited,
        None,
        start + Duration::from_millis(100),
    );
    assert_eq!(near.consent_wait(), Duration::from_millis(200));
}

/// A 429's `remaining` already counts the sends that reached the upstream before it: with
/// answers that take seconds, the whole first round is unanswered when the first 429 comes,
/// but sends older than the refusal's round trip are not counted again as sent after it (which
/// held the level a whole burst below empty: 250 ms of a bucket of 50 at 200/s with nothing
/// sent).
#[test]
fn a_429_does_not_count_the_round_it_already_counted() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 50, 1.0, start);
    // Fifty sent at once, none answered (answers take seconds).
    for _ in 0..50 {
        pacer.admit_anyway(1.0, start);
    }
    // 20 ms later one more, refused within a millisecond: the bucket is empty.
    let sent_at = start + Duration::from_millis(20);
    let t = pacer.admit_anyway(1.0, sent_at);
    let now = sent_at + Duration::from_millis(1);
    let empty = fine_report(50.0, 0.0, Duration::from_millis(250));
    pacer.observe(t, Answer::RateLimited, Some(empty), now);
    assert!(
        pacer.level > -5.0,
        "the level is {} after a report of an empty bucket",
        pacer.level
    );
}
