//! Cuts: how far a throttle moves the pace, and how it comes back.

use super::*;

/// A cut never goes below what the upstream admitted over the last second, and after a long
/// named wait the successes double the pace per round trip back to where the cuts found it.
#[test]
fn a_cut_is_bounded_by_what_was_admitted_and_recovers_by_doubling() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, now);
    // 100 requests a second for a second, answered in 100 ms, all admitted.
    let mut in_flight = VecDeque::new();
    for ms in 0..1000u64 {
        now = Instant::now() + Duration::from_millis(ms);
        if ms % 10 == 0 {
            in_flight.push_back((now, pacer.try_acquire(1.0, now).unwrap()));
        }
        while in_flight
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= Duration::from_millis(100))
        {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, None, now);
        }
    }
    // Then a bare 429 (no headers): the cut keeps what the upstream admitted, about 90/s.
    let t = pacer.try_acquire(1.0, now).unwrap();
    pacer.observe(t, Answer::RateLimited, None, now);
    let cut = pacer.cap.unwrap();
    assert!(cut.rate >= 80.0, "cut to {} /s", cut.rate);
    // A storm of cuts: each a round trip apart, all answered 429.
    for _ in 0..5 {
        now += Duration::from_millis(100);
        let t = pacer.admit_anyway(1.0, now);
        pacer.observe(t, Answer::RateLimited, None, now);
    }
    let low = pacer.cap.unwrap().rate;
    let before = pacer.cap.unwrap().before.unwrap();
    // Without a long wait named, the cut grows slowly (a bucket's edge); with one, it doubles.
    pacer.long_pause(STORM);
    // Successes sent after the last cut, answered in 100 ms: the pace doubles per round trip.
    let mut rate = low;
    for round in 0..12 {
        let sent = now;
        let n = (rate * 0.1).ceil().max(1.0) as usize;
        let tickets: Vec<_> = (0..n).map(|_| pacer.admit_anyway(1.0, sent)).collect();
        now += Duration::from_millis(100);
        for t in tickets {
            pacer.observe(t, Answer::Ok, None, now);
        }
        let next = pacer.cap.unwrap().rate;
        assert!(
            next >= (2.0 * rate).min(before) * 0.99,
            "round {round}: {rate} -> {next}"
        );
        rate = next;
    }
    assert!((rate - before).abs() < 1e-6, "back to {before}, at {rate}");
}

/// A burst drawn from a full bucket before its edge was found is no rate: the first cut keeps
/// it (nothing shows yet that it was a burst), but the cuts after the edge are bounded only by
/// what the upstream admitted since.
#[test]
fn a_burst_before_the_edge_does_not_hold_up_the_cuts_after_it() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    // 50 requests in a second, answered in 50 ms, all admitted: a full bucket of 50 drawn
    // down while it refilled (at 1/s, say: nothing tells).
    let mut now = start;
    for i in 0..50u64 {
        let sent = start + Duration::from_millis(i * 20);
        let t = pacer.admit_anyway(1.0, sent);
        now = sent + Duration::from_millis(50);
        pacer.observe(t, Answer::Ok, None, now);
    }
    // The bucket is empty: a 429. The first cut keeps what was admitted (50 in the last second).
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let first = pacer.cap.unwrap().rate;
    assert!(first >= 45.0, "first cut to {first}/s");
    // A round trip later, another 429 of an attempt sent after the cut: the upstream admitted
    // nothing since the edge, so the cut goes on down.
    now += Duration::from_millis(100);
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let second = pacer.cap.unwrap().rate;
    assert!(second <= first * 0.75, "{first}/s, then {second}/s");
}
