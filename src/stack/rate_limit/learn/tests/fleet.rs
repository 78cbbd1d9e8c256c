//! A `[fleet]` replica's pacer: under a shared bucket, and its pace split with its peers'.

use super::*;

/// `pacer` sends one unit every 10 ms (100/s) from `from` for `ms`, each admitted and answered
/// after `rtt`, until the last is answered (`drain`) or until `ms` has passed (the last round
/// trip's sends still in flight); returns the time it stopped.
fn sends(pacer: &mut Pacer, from: Instant, ms: u64, rtt: Duration, drain: bool) -> Instant {
    let mut in_flight = VecDeque::new();
    let end = ms + if drain { rtt.as_millis() as u64 } else { 0 };
    let mut now = from;
    for step in 0..=end {
        now = from + Duration::from_millis(step);
        if step < ms && step % 10 == 0 {
            in_flight.push_back((now, pacer.admit_anyway(1.0, now)));
        }
        while in_flight
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= rtt)
        {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, None, now);
        }
    }
    now
}

/// [`sends`] for a second, all answered.
fn steady(pacer: &mut Pacer, from: Instant, rtt: Duration) -> Instant {
    sends(pacer, from, 1000, rtt, true)
}

/// Under a bucket the fleet shares through Redis, a blind pacer's 429 cuts nothing and, past
/// slow start, it gates nothing: the refusal empties the shared bucket for every replica,
/// and a cut of this one's pace would only hand its part to the others. Without that bucket
/// the same 429 cuts.
#[test]
fn a_blind_pacer_under_a_shared_bucket_leaves_the_pace_to_it() {
    let start = Instant::now();
    for shared in [true, false] {
        let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
        pacer.in_fleet();
        pacer.fleet_bucket(shared);
        let now = steady(&mut pacer, start, Duration::from_millis(50));
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now);
        assert_eq!(pacer.source(), Source::Aimd);
        if shared {
            assert!(pacer.cap.is_none(), "no cut under the shared bucket");
            for _ in 0..1000 {
                assert!(matches!(pacer.admits(1.0, now), Ok(Admission::Free)));
                pacer.admit_anyway(1.0, now);
            }
        } else {
            assert!(pacer.cap.is_some(), "the 429 cuts without one");
        }
    }
}

/// A cut's floor is what the upstream admitted since the last edge, over the time whose
/// sends have been answered: the last round trip's are still in flight. At 100/s answered in
/// 100 ms, a 429 300 ms after the edge finds 20 answered: 100/s over the 200 ms they were sent
/// in, not 67/s over 300 ms.
#[test]
fn a_cut_floor_leaves_out_the_sends_still_in_flight() {
    let start = Instant::now();
    let rtt = Duration::from_millis(100);
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    let now = steady(&mut pacer, start, rtt);
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    // 100/s after the edge, a 429 at 300 ms, the sends of its last 100 ms unanswered.
    let now = sends(&mut pacer, now, 300, rtt, false);
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let cut = pacer.cap.unwrap().rate;
    assert!(cut >= 95.0, "cut to {cut}/s, under what was admitted");
}

/// A replica capped by the 429s publishes its pace; its part of the fleet's, split by demand,
/// is a multiple of it that its pace takes (within bounds). A pacer not in a fleet has none.
#[test]
fn a_fleet_replica_paces_at_its_part_of_the_fleets_pace() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    assert_eq!(pacer.fleet_pace(start), None, "not capped");
    pacer.in_fleet();
    let now = steady(&mut pacer, start, Duration::from_millis(50));
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let pace = pacer.fleet_pace(now).expect("capped by the 429");
    let alone = pacer.rate();
    pacer.fleet_scale(2.0, now);
    assert!(
        (pacer.rate() - 2.0 * alone).abs() < 1e-6,
        "{}",
        pacer.rate()
    );
    assert_eq!(
        pacer.fleet_pace(now),
        Some(pace),
        "its own pace is unchanged"
    );
    // A part of nothing (its queue ran dry) still leaves it a quarter.
    pacer.fleet_scale(0.0, now);
    assert!(
        (pacer.rate() - alone / 4.0).abs() < 1e-6,
        "{}",
        pacer.rate()
    );
    // Not in a fleet: nothing to split.
    let mut single = Pacer::new(Kind::Requests, 4096, 1.0, start);
    let now = steady(&mut single, start, Duration::from_millis(50));
    let t = single.admit_anyway(1.0, now);
    single.observe(t, Answer::RateLimited, None, now);
    let rate = single.rate();
    single.fleet_scale(2.0, now);
    assert_eq!(single.fleet_pace(now), None);
    assert_eq!(single.rate(), rate);
}

/// A replica's pace is its cap times its part of the fleet's (`Pacer::fleet_scale`); a cut
/// lowers the pace it sends at, whatever that part. Cutting the scaled pace into the cap raised
/// the cap of a replica at 3.5 times its own 2.5-fold at each 429, to billions a second within
/// 20 ms: four corrals on Redis then sent 20,000 requests into a bucket of 20 a second.
#[test]
fn a_cut_lowers_a_scaled_replicas_pace() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    pacer.in_fleet();
    let mut now = steady(&mut pacer, start, Duration::from_millis(50));
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    pacer.fleet_scale(3.5, now);
    for _ in 0..10 {
        let before = pacer.rate();
        now += Duration::from_millis(20);
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now + Duration::from_millis(1));
        assert!(
            pacer.rate() <= before * BETA + 1e-9 || pacer.rate() <= MIN_RATE * 3.5 + 1e-9,
            "a 429 took the pace from {before}/s to {}/s",
            pacer.rate()
        );
    }
}

/// A replica that takes its part of a report (four on a key whose per-minute report nothing in
/// Redis divides) and finds the report a lie (a 429 with headroom left: demoted) paces at its
/// own part, with a burst of half a second of it. That burst is its own already: divided by
/// the replicas again, its level could not hold one request below 8 a second, and requests
/// went only as lone ones after a quarter second with nothing in flight (four corrals on
/// Anthropic's acceleration limit sent 6 a second in all where each was paced at 4.6).
#[test]
fn a_demoted_replica_sends_at_its_part_of_the_pace() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    pacer.in_fleet();
    pacer.among(4);
    // 16 a second reported per minute: 960, less what was used.
    let report = |remaining: f64| {
        fine_report(
            960.0,
            remaining,
            Duration::from_secs_f64((960.0 - remaining) / 16.0),
        )
    };
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(100.0)), now);
    now += Duration::from_secs(2);
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(800.0)), now);
    assert_eq!(pacer.source(), Source::Observed);
    now += Duration::from_secs(1);
    // Every millisecond for 10 s a request tries; each is answered after 200 ms.
    let rtt = Duration::from_millis(200);
    let mut in_flight: VecDeque<(Instant, Ticket)> = VecDeque::new();
    let (mut count, from) = (0, now);
    for step in 0..10_000 {
        now = from + Duration::from_millis(step);
        while in_flight.front().is_some_and(|(at, _)| now - *at >= rtt) {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, Some(report(800.0)), now);
        }
        while let Ok(t) = pacer.try_acquire(1.0, now) {
            in_flight.push_back((now, t));
            count += 1;
        }
    }
    let pace = pacer.rate();
    assert!((2.0..=4.0).contains(&pace), "its part of 16/s: {pace}");
    assert!(
        count as f64 >= 0.9 * pace * 10.0,
        "{count} sent in 10 s at {pace}/s"
    );
}
