//! Windows that open on the clock (`learn/clock.rs`), driven in virtual time.

use std::collections::VecDeque;

use super::*;

/// `tasks` queued at once through one pacer trying every millisecond, each sent again when
/// refused: `admits(now)` says whether the upstream takes a send now, which it answers in
/// `service` (refusals, 429s that name no wait, in 5 ms); `each` sees the pacer after every
/// millisecond. Returns when each refused attempt was sent and the makespan.
fn drive(
    tasks: usize,
    service: Duration,
    mut admits: impl FnMut(Instant) -> bool,
    mut each: impl FnMut(&mut Pacer, Instant),
) -> (Vec<Duration>, Duration) {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let (mut queue, mut done, mut refused) = (tasks, 0, Vec::new());
    let mut answers: VecDeque<(Instant, Ticket, bool)> = VecDeque::new();
    let mut now = start;
    let end = start + Duration::from_secs(300);
    while done < tasks && now < end {
        let mut due: Vec<_> = answers.iter().filter(|a| a.0 <= now).copied().collect();
        answers.retain(|a| a.0 > now);
        due.sort_by_key(|a| a.0);
        for (_, ticket, ok) in due {
            if ok {
                pacer.observe(ticket, Answer::Ok, None, now);
                done += 1;
            } else {
                pacer.observe(ticket, Answer::RateLimited, None, now);
                queue += 1;
            }
        }
        while queue > 0 {
            let Ok(ticket) = pacer.try_acquire(1.0, now) else {
                break;
            };
            queue -= 1;
            if admits(now) {
                answers.push_back((now + service, ticket, true));
            } else {
                refused.push(now - start);
                answers.push_back((now + Duration::from_millis(5), ticket, false));
            }
        }
        each(&mut pacer, now);
        now += Duration::from_millis(1);
    }
    assert_eq!(done, tasks, "all done within 300 s");
    (refused, now - start)
}

/// A fixed window of `capacity` per `period` counted from the start (Azure's sub-windows on
/// the Responses API): refusals by the window they were sent in, and the makespan. `named`:
/// 3 s in, the upstream names a wait of half a second once (another 429 on the key, as the
/// partition reports it).
fn fixed_windows(
    tasks: usize,
    capacity: usize,
    period: Duration,
    named: bool,
) -> (Vec<usize>, Duration) {
    let start = Instant::now();
    let mut counts: Vec<usize> = Vec::new();
    let window = |at: Duration| (at.as_millis() / period.as_millis()) as usize;
    let admits = |now: Instant| {
        let w = window(now - start);
        if counts.len() <= w {
            counts.resize(w + 1, 0);
        }
        counts[w] += 1;
        counts[w] <= capacity
    };
    let mut held = !named;
    let hold = |p: &mut Pacer, now: Instant| {
        if !held && now >= start + Duration::from_secs(3) {
            p.hold(now + Duration::from_millis(500));
            held = true;
        }
    };
    let (refusals, makespan) = drive(tasks, Duration::from_millis(200), admits, hold);
    let mut refused = vec![0; window(makespan) + 1];
    for at in refusals {
        refused[window(at)] += 1;
    }
    (refused, makespan)
}

/// Once two openings a period apart have shown the window, each window's count goes at its
/// opening and nothing goes into it once spent, until shortly before the next is due: two
/// windows refused as before while it is learned (about forty each here, the pacer alone
/// without the partition's pauses), then a few a window, the probes for the opening, sent a
/// fiftieth of the period apart from a twentieth of it before (without: 36 and 32 in the third
/// and fourth windows, 43.6 s).
#[test]
fn a_window_that_opens_on_the_clock_is_learned() {
    let period = Duration::from_secs(10);
    let (refused, makespan) = fixed_windows(500, 100, period, false);
    // Bound: four waits for an opening and a service time (40.2 s); each opening found
    // within its probes' spacing once learned.
    learned_from(&refused, 2, makespan, Duration::from_secs(41));
}

/// From window `from` on, at most five refused a window (the probes for its opening), and
/// all done within `bound`.
fn learned_from(refused: &[usize], from: usize, makespan: Duration, bound: Duration) {
    let learned: usize = refused[from..].iter().sum();
    let windows = refused.len() - from;
    assert!(learned <= 5 * windows, "refused by window {refused:?}");
    assert!(makespan < bound, "{makespan:?}, {refused:?}");
}

/// Probes for the next opening go a fiftieth of the period apart, or a fifth of the span the
/// latest opening was found within if wider. The first opening of a learned window is found
/// by the cut pace's probes, up to 2 s apart: probes a fiftieth apart through all of that span
/// drew ten refusals in `azure-responses`' next window, four to six a fifth apart.
#[test]
fn probes_spread_over_the_span_the_last_opening_was_found_in() {
    let t0 = Instant::now();
    let period = Duration::from_secs(10);
    for (span_ms, gap_ms) in [(2_200, 440), (200, 200)] {
        let span = Duration::from_millis(span_ms);
        let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, t0);
        let at = t0 + Duration::from_secs(20);
        pacer.clock = Clock::learned_at(at, span, period, 100.0);
        // Probes begin a twentieth of the period before the earliest the next can open.
        let from = at - span + period - period / 20;
        assert!(
            matches!(pacer.clock_admits(from), Some(Ok(_))),
            "span {span:?}"
        );
        pacer.clock_took(from);
        let next = from + Duration::from_millis(gap_ms);
        assert_eq!(pacer.clock.next_probe(), Some(next), "span {span:?}");
        assert!(matches!(
            pacer.clock_admits(next - Duration::from_millis(1)),
            Some(Err(_))
        ));
    }
}

/// A wait the upstream named in the first window makes that window's pause no measure, and
/// no more: the clock is learned a window later (a named pause once kept it from ever being
/// learned).
#[test]
fn a_named_wait_delays_the_clock_by_a_window() {
    let (refused, makespan) = fixed_windows(600, 100, Duration::from_secs(10), true);
    learned_from(&refused, 3, makespan, Duration::from_secs(51));
}

/// A bucket that refills as it goes (50, refilled 20 a second), refusing with no hint, is no
/// clock's: its refusals never make a pause of a second with four refused in it, so no window
/// is learned, and nothing goes past the pace as a window's count would.
#[test]
fn a_bucket_that_refills_as_it_goes_is_no_clock() {
    let start = Instant::now();
    let (mut level, mut last) = (50.0_f64, start);
    let admits = |now: Instant| {
        level = (level + 20.0 * (now - last).as_secs_f64()).min(50.0);
        last = now;
        let ok = level >= 1.0;
        if ok {
            level -= 1.0;
        }
        ok
    };
    let mut learned = false;
    let (refused, makespan) = drive(500, Duration::from_millis(200), admits, |p, _| {
        learned |= p.clock.learned().is_some();
    });
    assert!(!learned, "a clock learned from a bucket");
    // Bound: (500 - 50) / 20 = 22.5 s, and the cut pace's way there.
    assert!(
        makespan < Duration::from_secs(30),
        "{makespan:?}, {} refused",
        refused.len()
    );
}
