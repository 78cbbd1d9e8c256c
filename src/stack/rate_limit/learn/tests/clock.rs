//! Windows that open on the clock (`learn/clock.rs`), driven in virtual time.

use std::collections::VecDeque;

use super::*;

/// A fixed window of `capacity` per `period` counted from `start`, whose 429s name no wait
/// (Azure's sub-windows on the Responses API), answering successes in `service` and refusals
/// in 5 ms; `tasks` queued at once, each sent again when refused, through one pacer trying every
/// millisecond. Returns when each window's refusals were sent (by window) and the makespan.
fn fixed_windows(
    tasks: usize,
    capacity: usize,
    period: Duration,
    service: Duration,
) -> (Vec<usize>, Duration) {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let mut counts: Vec<usize> = Vec::new();
    let mut refused: Vec<usize> = Vec::new();
    let mut queue = tasks;
    let mut done = 0;
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
            let window = (now - start).as_millis() as usize / period.as_millis() as usize;
            if counts.len() <= window {
                counts.resize(window + 1, 0);
                refused.resize(window + 1, 0);
            }
            if counts[window] < capacity {
                counts[window] += 1;
                answers.push_back((now + service, ticket, true));
            } else {
                refused[window] += 1;
                answers.push_back((now + Duration::from_millis(5), ticket, false));
            }
        }
        now += Duration::from_millis(1);
    }
    assert_eq!(done, tasks, "all done within 300 s: {refused:?}");
    (refused, now - start)
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
    let (refused, makespan) = fixed_windows(500, 100, period, Duration::from_millis(200));
    let learned: usize = refused[2..].iter().sum();
    assert!(
        learned <= 5 * (refused.len() - 2),
        "refused by window {refused:?}"
    );
    // Bound: four waits for an opening and a service time (40.2 s); each opening found
    // within its probes' spacing once learned.
    assert!(
        makespan < Duration::from_secs(41),
        "{makespan:?}, {refused:?}"
    );
}
