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
    // A second is a rounded-up `retry-after: 1`: a bucket's next token, not a storm.
    pacer.long_pause(STORM);
    assert!(!pacer.cap.unwrap().recovering, "a whole second");
    pacer.long_pause(2 * STORM);
    // Successes sent after the last cut, answered in 100 ms: the pace doubles per round trip.
    let rtt = Duration::from_millis(100);
    let rate = doubles_per_round_trip(&mut pacer, now, rtt, 12);
    assert!((rate - before).abs() < 1e-6, "back to {before}, at {rate}");
    assert!(low < before);
}

/// `rounds` round trips of `rtt` from `now`, each sending what the cap allows over one and all
/// answered: the cap at least doubles each round, up to where the cuts found it. Its last rate.
fn doubles_per_round_trip(pacer: &mut Pacer, mut now: Instant, rtt: Duration, rounds: u32) -> f64 {
    let before = pacer.cap.unwrap().before.unwrap();
    let mut rate = pacer.cap.unwrap().rate;
    for round in 0..rounds {
        let sent = now;
        let n = (rate * rtt.as_secs_f64()).ceil().max(1.0) as usize;
        let tickets: Vec<_> = (0..n).map(|_| pacer.admit_anyway(1.0, sent)).collect();
        now += rtt;
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
    rate
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

/// An estimate is what the upstream admitted between two moments its bucket was empty, with
/// no floor from the last second's successes: answers that bunch up (service times vary) count
/// more than the rate in the second they arrive in.
#[test]
fn an_estimate_is_the_window_not_the_last_seconds_answers() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    // The edge: a 429.
    let t = pacer.admit_anyway(1.0, start);
    pacer.observe(t, Answer::RateLimited, None, start);
    // Five a second for five seconds, all admitted; the first fifteen answered in 100 ms, the
    // last ten all at once at 4.95 s.
    let mut late = Vec::new();
    for i in 0..25u64 {
        let sent = start + Duration::from_millis(200 * i + 100);
        let t = pacer.admit_anyway(1.0, sent);
        if i < 15 {
            pacer.observe(t, Answer::Ok, None, sent + Duration::from_millis(100));
        } else {
            late.push(t);
        }
    }
    let now = start + Duration::from_millis(4950);
    for t in late {
        pacer.observe(t, Answer::Ok, None, now);
    }
    // The next send meets the bucket empty again: 25 admitted over 5 s.
    let now = start + Duration::from_secs(5);
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let cap = pacer.cap.unwrap();
    assert!(cap.before.is_none(), "an estimate, not a cut");
    assert!((cap.rate - 5.0).abs() < 0.3, "estimated {}/s", cap.rate);
}

/// A peer's refusal leaves the level below empty by the replica's own phase, so the replicas
/// that hear of it together do not all send their next request at the same instant.
#[test]
fn a_peers_refusal_leaves_each_replica_at_its_own_phase() {
    let start = Instant::now();
    let mut pacers: Vec<Pacer> = (0..2)
        .map(|_| Pacer::new(Kind::Requests, 10, 1.0, start))
        .collect();
    let mut now = start;
    for p in &mut pacers {
        for _ in 0..10 {
            p.admit_anyway(1.0, now);
        }
    }
    now += Duration::from_millis(20);
    pacers[0].peer_throttled(now, 0.0);
    pacers[1].peer_throttled(now, 0.9);
    let (a, b) = (pacers[0].rate(), pacers[1].rate());
    assert!(a > 0.0 && (a - b).abs() < 1e-9, "same pace: {a}, {b}");
    // The first may send one interval after the edge; the second only 0.9 of one later.
    let interval = Duration::from_secs_f64(1.0 / a);
    let at = now + interval + Duration::from_millis(1);
    assert!(pacers[0].can_acquire(1.0, at));
    assert!(!pacers[1].can_acquire(1.0, at));
    let later = now + interval.mul_f64(1.9) + Duration::from_millis(1);
    assert!(pacers[1].can_acquire(1.0, later));
}

/// The throttle windows added up before they span `MIN_WINDOW` already show what the
/// upstream refilled: a cut does not go below them once they hold a few units. Blind (no
/// headers), a pacer meeting a bucket of 200/s cut 650, 457, 320, 224, then 157 in runs where
/// its admitted rate (a few answers into the span since the edge) said only 100-120, and spent
/// the rest of the herd below the rate (1.2x the bound).
#[test]
fn a_cut_does_not_go_below_the_windows_so_far() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    // A first 429 at 0 ms: the edge.
    let t = pacer.admit_anyway(1.0, start);
    pacer.observe(
        t,
        Answer::RateLimited,
        None,
        start + Duration::from_millis(1),
    );
    // 24 admitted over the next 120 ms (200/s), none answered yet, then the next 429: the
    // window holds 24 units in 120 ms.
    for ms in 0..24u64 {
        pacer.admit_anyway(1.0, start + Duration::from_millis(1 + 5 * ms));
    }
    let at = start + Duration::from_millis(121);
    let t = pacer.admit_anyway(1.0, at);
    pacer.observe(t, Answer::RateLimited, None, at + Duration::from_millis(1));
    let cut = pacer.cap.expect("a second 429 within REPEAT cuts").rate;
    assert!(cut >= 190.0, "cut to {cut} /s, the windows show 200/s");
}

/// A cut from slow start before any answer has come cuts the ramp's guess: halved, as TCP
/// halves its window. The cuts after it, and any once answers show what the upstream takes,
/// ease the pace by `BETA`. (Blind on a bucket of 20/s, a corral whose ramp had reached 240/s
/// cut by 0.7 seven times in 320 ms: 12-19 rate 429s in `gemini` at full scale, 9-11 with the
/// first cut halved.)
#[test]
fn a_cut_from_the_ramps_guess_halves() {
    let first_cut = |answered: bool| {
        let start = Instant::now();
        let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
        if answered {
            let t = pacer.admit_anyway(1.0, start);
            pacer.observe(t, Answer::Ok, None, start + Duration::from_millis(20));
        }
        // The window sent at once; the ramp's guess is its measured send rate (at most the
        // window over the guessed round trip).
        let at = start + Duration::from_millis(30);
        let t = sent(&mut pacer, at, 1)[0];
        let refused = at + Duration::from_millis(1);
        let guess = pacer
            .meter
            .current(refused)
            .min(pacer.burst / RAMP_RTT_GUESS);
        pacer.observe(t, Answer::RateLimited, None, refused);
        let first = pacer.cap.unwrap().rate;
        // A second cut, a round trip later.
        let at = at + Duration::from_millis(100);
        let t = pacer.admit_anyway(1.0, at);
        pacer.observe(t, Answer::RateLimited, None, at + Duration::from_millis(1));
        (first / guess, pacer.cap.unwrap().rate / first)
    };
    let (first, second) = first_cut(false);
    assert!(
        (first - GUESS_BETA).abs() < 1e-9,
        "first cut to {first} of the guess"
    );
    assert!(
        (second - BETA).abs() < 1e-9,
        "second cut to {second} of the first"
    );
    let (first, _) = first_cut(true);
    assert!(
        (first - BETA).abs() < 1e-9,
        "answered: cut to {first} of the guess"
    );
}

/// Cuts that met a pause no one named (every probe refused for seconds, then a success: a
/// window that reopens on the clock, as Azure's 10 s ones do with no hint) recover by doubling
/// per round trip, as after a named one; the cuts at a bucket's edge, whose next send at the
/// cut pace is admitted, grow slowly.
#[test]
fn a_pause_no_one_named_recovers_by_doubling_and_an_edge_does_not() {
    // A window of 100 drawn at once, answered in 200 ms; then refusals.
    let start = Instant::now();
    let opened = |pacer: &mut Pacer| {
        let tickets: Vec<_> = (0..100).map(|_| pacer.admit_anyway(1.0, start)).collect();
        let answered = start + Duration::from_millis(200);
        for t in tickets {
            pacer.observe(t, Answer::Ok, None, answered);
        }
        let t = pacer.admit_anyway(1.0, answered);
        pacer.observe(t, Answer::RateLimited, None, answered);
        assert!(pacer.cap.is_some_and(|c| !c.recovering));
    };
    // The edge: the next send, 300 ms on, is admitted.
    let mut edge = Pacer::new(Kind::Requests, 4096, 1.0, start);
    opened(&mut edge);
    let sent = start + Duration::from_millis(500);
    let t = edge.admit_anyway(1.0, sent);
    edge.observe(t, Answer::Ok, None, sent + Duration::from_millis(200));
    assert!(!edge.cap.unwrap().recovering, "a bucket's edge");

    // The window: a probe a second refused until it reopens at 10 s.
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    opened(&mut pacer);
    for s in 1..10u64 {
        let probe = start + Duration::from_secs(s);
        let t = pacer.admit_anyway(1.0, probe);
        pacer.observe(
            t,
            Answer::RateLimited,
            None,
            probe + Duration::from_millis(5),
        );
    }
    let low = pacer.cap.unwrap().rate;
    let before = pacer.cap.unwrap().before.unwrap();
    assert!(!pacer.cap.unwrap().recovering);
    let mut now = start + Duration::from_secs(10);
    let t = pacer.admit_anyway(1.0, now);
    now += Duration::from_millis(200);
    pacer.observe(t, Answer::Ok, None, now);
    assert!(pacer.cap.unwrap().recovering, "a pause no one named");
    // Successes sent after the last cut, answered in 200 ms: the pace doubles per round trip.
    assert!(pacer.cap.unwrap().rate > low);
    let rate = doubles_per_round_trip(&mut pacer, now, Duration::from_millis(200), 6);
    assert!(rate >= (32.0 * low).min(before) * 0.99, "{low} -> {rate}");
}

/// The same pause behind answers of seconds: the window's own successes come back after the
/// refusals of the probes sent once it closed, so the refusals are counted by when they were
/// sent, not by when they came back. Counted as they came back, the late successes reset the
/// count, the pause went unseen, and `azure-responses` with answers of 2 s crawled at 1-7
/// requests a second through windows of a hundred from the third window on (100 s for 42).
#[test]
fn a_pause_behind_slow_answers_is_still_a_pause() {
    let start = Instant::now();
    let rtt = Duration::from_secs(2);
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    let window: Vec<_> = (0..100).map(|_| pacer.admit_anyway(1.0, start)).collect();
    let refuse = |pacer: &mut Pacer, at: Instant| {
        let t = pacer.admit_anyway(1.0, at);
        pacer.observe(t, Answer::RateLimited, None, at + Duration::from_millis(5));
    };
    // Four probes refused before the window's answers come back, two after.
    for ms in [500, 1000, 1500, 1900] {
        refuse(&mut pacer, start + Duration::from_millis(ms));
    }
    for t in window {
        pacer.observe(t, Answer::Ok, None, start + rtt);
    }
    for s in [5, 8] {
        refuse(&mut pacer, start + Duration::from_secs(s));
    }
    let low = pacer.cap.unwrap().rate;
    assert!(!pacer.cap.unwrap().recovering);
    let mut now = start + Duration::from_secs(10);
    let t = pacer.admit_anyway(1.0, now);
    now += rtt;
    pacer.observe(t, Answer::Ok, None, now);
    assert!(pacer.cap.unwrap().recovering, "a pause no one named");
    let rate = doubles_per_round_trip(&mut pacer, now, rtt, 4);
    let before = pacer.cap.unwrap().before.unwrap();
    assert!(rate >= (8.0 * low).min(before) * 0.99, "{low} -> {rate}");
}

/// On the way back from such a pause, silence is consent as in slow start: sends the window
/// has not refused within twice its refusals' round trip raise the pace as their successes
/// would, so it regrows within a fraction of a second, not one doubling per answer of 2 s.
#[test]
fn the_way_back_from_a_pause_goes_by_silence_too() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    let window: Vec<_> = (0..100).map(|_| pacer.admit_anyway(1.0, start)).collect();
    for t in window {
        pacer.observe(t, Answer::Ok, None, start + Duration::from_millis(200));
    }
    for s in 1..10u64 {
        let at = start + Duration::from_secs(s);
        let t = pacer.admit_anyway(1.0, at);
        pacer.observe(t, Answer::RateLimited, None, at + Duration::from_millis(5));
    }
    // The window reopens at 10 s; its first success comes back 2 s later.
    let reopened = start + Duration::from_secs(10);
    let t = pacer.admit_anyway(1.0, reopened);
    let mut now = reopened + Duration::from_secs(2);
    pacer.observe(t, Answer::Ok, None, now);
    let cap = pacer.cap.unwrap();
    assert!(cap.recovering);
    // For the next 500 ms it sends as the pace allows; nothing is answered (answers take 2 s)
    // and nothing is refused.
    let mut sent = 0;
    let until = now + Duration::from_millis(500);
    while now < until {
        if pacer.try_acquire(1.0, now).is_ok() {
            sent += 1;
        } else {
            now += Duration::from_millis(1);
        }
    }
    let rate = pacer.cap.unwrap().rate;
    assert!(
        rate >= (16.0 * cap.rate).min(cap.before.unwrap()) * 0.99,
        "{} -> {rate} in 500 ms, {sent} sent",
        cap.rate
    );
}

/// The 429s of one burst halve the confirmed headroom once, as a cut is taken once per round
/// trip: a ramp that overran a bucket of 200 (refilled 200/s) by a hundred sends at once goes
/// on near the refill, not from a window of one regrown per answer.
#[test]
fn a_bursts_refusals_halve_the_confirmed_window_once() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = refilling(200.0, 200.0);
    // 128 admitted and answered in 200 ms, each confirming one more unit of headroom.
    let ok: Vec<_> = (0..128).map(|_| pacer.admit_anyway(1.0, now)).collect();
    now += Duration::from_millis(200);
    for (i, t) in ok.into_iter().enumerate() {
        pacer.observe(t, Answer::Ok, Some(report(199.0 - i as f64)), now);
    }
    let confirmed = pacer.verified;
    assert!(confirmed >= 128.0, "confirmed {confirmed}");
    // A hundred sent at once, all refused within a few milliseconds: one overrun.
    let refused: Vec<_> = (0..100).map(|_| pacer.admit_anyway(1.0, now)).collect();
    now += Duration::from_millis(5);
    for t in refused {
        pacer.observe(t, Answer::RateLimited, Some(report(0.0)), now);
    }
    assert_eq!(pacer.verified, confirmed / 2.0, "halved once");
    // Over the next 400 ms it sends near the refill (80), not one per answer's round trip.
    let sent = sent(&mut pacer, now, 400).len();
    assert!(sent >= 40, "{sent} sent in 400 ms");
    // A refusal of an attempt sent after that halving is a new overrun: halved again.
    let before = pacer.verified;
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, Some(report(0.0)), now);
    assert_eq!(pacer.verified, before / 2.0);
}

/// A cut is a guess: it steps back by a tenth of itself a second to the pace it was cut from,
/// and past that with no refusal it compounds by `GUESS_GROWTH` a second, so a limit that
/// allows more the more is sent (Anthropic's acceleration limits) is followed at a growing
/// pace, not a fixed step. Sending all it allows, a pacer cut at the 20 a second it was
/// admitted at sends about 2.4 times that ten seconds on (the step alone: 1.95 times).
#[test]
fn a_guess_compounds_while_nothing_refuses() {
    let now = Instant::now();
    let guess = Cap {
        rate: 10.0,
        since: now,
        hold: Duration::ZERO,
        slope: 1.0,
        before: Some(20.0),
        recovering: false,
    };
    let at = |secs: f64| guess.at(now + Duration::from_secs_f64(secs));
    assert!((at(5.0) - 15.0).abs() < 1e-9, "a step back: {}", at(5.0));
    assert!((at(10.0) - 20.0).abs() < 1e-9, "where it was cut from");
    assert!(
        (at(12.0) - 24.2).abs() < 1e-9,
        "then compounding: {}",
        at(12.0)
    );
    // For 30 s at most, then stepping by a tenth of where that left it: finite for good.
    let top = 20.0 * 1.1f64.powi(30);
    assert!((at(40.0) - top).abs() < 1e-6 * top);
    assert!((at(50.0) - 2.0 * top).abs() < 1e-6 * top, "{}", at(50.0));
    assert!(at(1e9).is_finite());
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 4096, 1.0, start);
    // 20 a second for two seconds, answered in 50 ms, then a bare 429: a cut.
    let rtt = Duration::from_millis(50);
    let mut in_flight: VecDeque<(Instant, Ticket)> = VecDeque::new();
    let mut now = start;
    for ms in 0..2000u64 {
        now = start + Duration::from_millis(ms);
        if ms % 50 == 0 {
            in_flight.push_back((now, pacer.admit_anyway(1.0, now)));
        }
        while in_flight.front().is_some_and(|(at, _)| now - *at >= rtt) {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, None, now);
        }
    }
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now);
    let cut = pacer.cap.expect("a cut").rate;
    // Every millisecond a request tries; each is answered after 50 ms.
    let from = now;
    let mut last_second = 0;
    for ms in 0..11_000u64 {
        now = from + Duration::from_millis(ms);
        while in_flight.front().is_some_and(|(at, _)| now - *at >= rtt) {
            let (_, t) = in_flight.pop_front().unwrap();
            pacer.observe(t, Answer::Ok, None, now);
        }
        while let Ok(t) = pacer.try_acquire(1.0, now) {
            in_flight.push_back((now, t));
            if ms >= 10_000 {
                last_second += 1;
            }
        }
    }
    let grown = last_second as f64 / cut;
    assert!(
        (2.1..3.0).contains(&grown),
        "cut to {cut}/s, {last_second} sent in the 11th second: {grown} times"
    );
}
