//! The state machine in virtual time: `now` is passed in, tokio's clock is paused so
//! `Instant::now()` is a fixed origin.

use super::*;
use crate::config::HumanDuration;

const MS: Duration = Duration::from_millis(1);

fn config() -> BreakerConfig {
    BreakerConfig {
        window: 10,
        min_samples: 5,
        min_span: HumanDuration::from_secs(1),
        cooldown: HumanDuration::from_secs(2),
        max_cooldown: HumanDuration::from_secs(20),
        half_open_probes: 2,
        // Longer than the open periods here, so releases keep their offsets unscaled.
        release_ramp: HumanDuration::from_secs(10),
        ..BreakerConfig::default()
    }
}

fn breaker() -> Breaker {
    Breaker::new(config())
}

/// A ticket with no jitter, so releases are exact.
fn ticket() -> Ticket {
    Ticket::new(0.0)
}

fn until(b: &Breaker) -> Instant {
    match b.phase() {
        Phase::Open { until } => until,
        other => panic!("expected open, got {other:?}"),
    }
}

/// Failures every 100 ms from `from` until the breaker opens; the instant it opened.
fn fail_until_open(b: &mut Breaker, from: Instant) -> Instant {
    for i in 0..100 {
        let t = from + 100 * MS * i;
        if b.record(true, None, t, 1.0) {
            return t;
        }
    }
    panic!("never opened")
}

/// A scout out whose answer never comes: no other goes, so held requests wait for the
/// cool-down's end.
fn scout_out(b: &mut Breaker) {
    b.scouting = true;
}

/// Cool-down over, both probes admitted and successful: closed again at the returned instant.
fn probe_and_close(b: &mut Breaker) -> Instant {
    let t = until(b);
    assert_eq!(
        b.admit(t, &mut ticket()),
        (Admit::Pass { probe: b.probe() }, true)
    );
    assert_eq!(
        b.admit(t, &mut ticket()).0,
        Admit::Pass { probe: b.probe() }
    );
    assert!(!b.record(false, b.probe(), t + 10 * MS, 1.0));
    assert!(b.record(false, b.probe(), t + 20 * MS, 1.0));
    assert_eq!(b.phase(), Phase::Closed);
    t + 20 * MS
}

#[tokio::test(start_paused = true)]
async fn failures_at_one_instant_are_one_event() {
    let mut b = breaker();
    let t0 = Instant::now();
    for _ in 0..20 {
        assert!(!b.record(true, None, t0, 1.0));
    }
    assert_eq!(b.phase(), Phase::Closed, "20 failures, zero span");
    // The blip healed: its retries and the traffic after it succeed. The blip stays in the
    // window for a while, but as one slot among healthy ones it never reaches 40%.
    for i in 0..30 {
        assert!(!b.record(false, None, t0 + 50 * MS + 100 * MS * i, 1.0));
    }
    assert_eq!(b.phase(), Phase::Closed);
}

#[tokio::test(start_paused = true)]
async fn failures_spread_over_min_span_open_it() {
    let mut b = breaker();
    let t0 = Instant::now();
    let opened = fail_until_open(&mut b, t0);
    assert_eq!(
        opened,
        t0 + Duration::from_secs(1),
        "opens at the first failure that makes the window span `min_span`"
    );
    assert_eq!(until(&b), opened + Duration::from_secs(2));
    assert_eq!(
        b.admit(opened, &mut ticket()).0,
        Admit::Wait(Some(opened + SCOUT_EVERY)),
        "held until the first scout's turn"
    );
    let scout_at = opened + SCOUT_EVERY;
    assert_eq!(
        b.admit(scout_at, &mut ticket()),
        (
            Admit::Pass {
                probe: Some(Probe::Scout(1))
            },
            false
        )
    );
    assert_eq!(
        b.admit(scout_at, &mut ticket()).0,
        Admit::Wait(Some(opened + Duration::from_secs(2))),
        "one scout at a time: the next waits for its answer or the cool-down's end"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_scout_changes_nothing_but_the_next_ones_turn() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    let end = until(&b);
    let scout_at = opened + SCOUT_EVERY;
    let (Admit::Pass { probe: scout }, _) = b.admit(scout_at, &mut ticket()) else {
        panic!("a scout")
    };
    assert!(!b.record(true, scout, scout_at + 20 * MS, 0.0));
    assert_eq!(until(&b), end, "the cool-down neither grows nor ends");
    let next = scout_at + 20 * MS + SCOUT_EVERY;
    assert_eq!(
        b.admit(next - MS, &mut Ticket::new(0.5)).0,
        Admit::Wait(Some(next + 50 * MS)),
        "held requests wake spread for the next scout's turn"
    );
    assert_eq!(b.admit(next, &mut ticket()).0, Admit::Pass { probe: scout });
    // Refused by corral or answered 429: the next may go at once.
    b.release_probe(scout.unwrap());
    assert_eq!(b.admit(next, &mut ticket()).0, Admit::Pass { probe: scout });
}

#[tokio::test(start_paused = true)]
async fn a_scout_served_well_ends_the_cooldown_at_once() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    let scout_at = opened + SCOUT_EVERY;
    let (Admit::Pass { probe: scout }, _) = b.admit(scout_at, &mut ticket()) else {
        panic!("a scout")
    };
    let served = scout_at + 200 * MS;
    assert!(b.record(false, scout, served, 0.0), "half-open now");
    assert!(matches!(b.phase(), Phase::HalfOpen { .. }));
    assert_eq!(
        b.admit(served, &mut ticket()).0,
        Admit::Pass { probe: b.probe() },
        "a half-open probe, 1.3 s before the cool-down would have ended"
    );
    // A scout of an earlier opening, answered late, moves nothing.
    let mut late = breaker();
    let opened = fail_until_open(&mut late, Instant::now());
    let (Admit::Pass { probe: old }, _) = late.admit(opened + SCOUT_EVERY, &mut ticket()) else {
        panic!("a scout")
    };
    probe_and_close(&mut late);
    let reopened = fail_until_open(&mut late, Instant::now() + Duration::from_secs(10));
    assert!(!late.record(false, old, reopened + MS, 0.0));
    assert_eq!(late.phase().name(), "open");
}

#[tokio::test(start_paused = true)]
async fn opens_at_the_error_rate_with_min_samples() {
    // Every slot half failed: 50% >= 40%, once there are 5 outcomes over 1 s.
    let mut b = breaker();
    let t0 = Instant::now();
    b.record(true, None, t0, 1.0);
    assert!(!b.record(false, None, t0, 1.0));
    assert!(
        !b.record(true, None, t0 + Duration::from_secs(1), 1.0),
        "3 outcomes: below min_samples"
    );
    assert!(!b.record(false, None, t0 + Duration::from_secs(1), 1.0));
    assert!(b.record(true, None, t0 + Duration::from_millis(1050), 1.0));
    assert_eq!(b.phase().name(), "open");

    // One failing slot in three: 33% < 40%, however many outcomes the failing slot holds.
    let mut b = breaker();
    for i in 0..3 {
        let t = t0 + Duration::from_millis(600) * i;
        let failed = i == 1;
        for _ in 0..5 {
            assert!(!b.record(failed, None, t, 1.0));
        }
    }
    assert_eq!(b.phase(), Phase::Closed);
}

#[tokio::test(start_paused = true)]
async fn the_window_keeps_the_last_outcomes_and_at_least_min_span() {
    let t0 = Instant::now();
    // Fast traffic: far more than `window` outcomes within `min_span` stay.
    let mut b = breaker();
    for i in 0..400 {
        b.record(false, None, t0 + 5 * MS * i, 1.0);
    }
    let last = t0 + 5 * MS * 399;
    assert!(b.window.outcomes > 10, "{}", b.window.outcomes);
    assert!(b.window.span(last) >= Duration::from_secs(1));
    assert!(b.window.span(last) < Duration::from_millis(1200));
    // Slow traffic: the last `window` outcomes, however long they took.
    let mut b = breaker();
    for i in 0..30 {
        b.record(false, None, t0 + Duration::from_secs(i), 1.0);
    }
    assert_eq!(b.window.outcomes, 10);
    assert_eq!(b.window.slots.len(), 10);
}

#[tokio::test(start_paused = true)]
async fn half_open_closes_despite_one_failed_probe_and_reopens_early() {
    let mut b = Breaker::new(BreakerConfig {
        half_open_probes: 5,
        close_error_rate: 0.25,
        ..config()
    });
    let t0 = Instant::now();
    fail_until_open(&mut b, t0);
    let t1 = until(&b);
    for _ in 0..5 {
        assert_eq!(
            b.admit(t1, &mut ticket()).0,
            Admit::Pass { probe: b.probe() }
        );
    }
    assert_eq!(b.admit(t1, &mut ticket()).0, Admit::Wait(None), "only five");
    assert!(!b.record(true, b.probe(), t1, 1.0), "1 of 5 may fail");
    for _ in 0..3 {
        assert!(!b.record(false, b.probe(), t1, 1.0));
    }
    assert!(b.record(false, b.probe(), t1, 1.0));
    assert_eq!(b.phase(), Phase::Closed, "20% < 25%: closed");

    let t2 = fail_until_open(&mut b, t1 + Duration::from_secs(1));
    let t3 = until(&b);
    assert!(
        t3 - t2 == Duration::from_secs(4),
        "no healthy period: doubled"
    );
    for _ in 0..5 {
        b.admit(t3, &mut ticket());
    }
    assert!(!b.record(true, b.probe(), t3, 1.0));
    assert!(
        b.record(true, b.probe(), t3, 1.0),
        "2 of 5 can't end below 25%: open again without waiting for the other three"
    );
    assert_eq!(until(&b), t3 + Duration::from_secs(8));
    // The other probes' late answers don't move it.
    assert!(!b.record(false, b.probe(), t3, 1.0));
}

#[tokio::test(start_paused = true)]
async fn zero_close_error_rate_needs_every_probe() {
    let mut b = Breaker::new(BreakerConfig {
        close_error_rate: 0.0,
        ..config()
    });
    fail_until_open(&mut b, Instant::now());
    let t = until(&b);
    b.admit(t, &mut ticket());
    b.admit(t, &mut ticket());
    assert!(!b.record(false, b.probe(), t, 1.0));
    assert!(b.record(false, b.probe(), t, 1.0));
    assert_eq!(b.phase(), Phase::Closed);
    fail_until_open(&mut b, t + Duration::from_secs(1));
    let t = until(&b);
    b.admit(t, &mut ticket());
    assert!(b.record(true, b.probe(), t, 1.0), "one failure reopens");
}

#[tokio::test(start_paused = true)]
async fn cooldown_growth_resets_after_a_healthy_period() {
    let mut b = breaker();
    let t0 = Instant::now();
    let opened = fail_until_open(&mut b, t0);
    assert_eq!(until(&b) - opened, Duration::from_secs(2));
    let closed = probe_and_close(&mut b);
    // Failing again soon after closing: the cool-down keeps growing.
    let opened = fail_until_open(&mut b, closed + Duration::from_secs(5));
    assert_eq!(until(&b) - opened, Duration::from_secs(4), "doubled");
    let closed = probe_and_close(&mut b);
    // Healthy for `healthy_reset` (30 s) after closing, a few failures along the way below
    // `close_error_rate`...
    for i in 0..=31 {
        let failed = i % 10 == 5;
        assert!(!b.record(failed, None, closed + Duration::from_secs(i), 1.0));
    }
    // ...then failing again: back to the first cool-down.
    let opened = fail_until_open(&mut b, closed + Duration::from_secs(32));
    assert_eq!(until(&b) - opened, Duration::from_secs(2), "growth reset");
}

#[tokio::test(start_paused = true)]
async fn an_unhealthy_closed_period_keeps_the_growth() {
    let mut b = breaker();
    let t0 = Instant::now();
    fail_until_open(&mut b, t0);
    let closed = probe_and_close(&mut b);
    // Closed for 40 s, but a fifth to a third of the slots failed throughout: below the open
    // rate, at or above the close rate every few seconds.
    for i in 0..40 {
        b.record(i % 4 == 2, None, closed + Duration::from_secs(i), 1.0);
    }
    assert_eq!(b.phase(), Phase::Closed);
    let opened = fail_until_open(&mut b, closed + Duration::from_secs(40));
    assert_eq!(until(&b) - opened, Duration::from_secs(4), "still growing");
}

#[tokio::test(start_paused = true)]
async fn cooldown_caps_and_jitters() {
    let mut b = breaker();
    let now = Instant::now();
    b.consecutive_opens = 10;
    b.open(now, 0.0);
    assert_eq!(
        b.phase(),
        Phase::Open {
            until: now + Duration::from_secs(15)
        },
        "20s cap, 75% jitter floor"
    );
}

#[tokio::test(start_paused = true)]
async fn held_requests_are_released_at_their_offset_into_the_open_period() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    scout_out(&mut b);
    // Four requests held 0.1, 0.5, 1.0 and 1.5 s into the open period.
    let offsets = [100, 500, 1000, 1500].map(|ms| ms * MS);
    let mut held: Vec<Ticket> = offsets.iter().map(|_| ticket()).collect();
    for (t, offset) in held.iter_mut().zip(offsets) {
        let (verdict, _) = b.admit(opened + offset, t);
        assert_eq!(verdict, Admit::Wait(Some(until(&b))));
    }
    let closed = probe_and_close(&mut b);
    for (t, offset) in held.iter_mut().zip(offsets) {
        assert_eq!(
            b.admit(closed, t).0,
            Admit::Wait(Some(closed + offset)),
            "released at close + its offset"
        );
        assert_eq!(b.admit(closed + offset, t).0, Admit::Pass { probe: None });
    }
    // A request that was never held passes at once.
    assert_eq!(
        b.admit(closed, &mut ticket()).0,
        Admit::Pass { probe: None }
    );
}

#[tokio::test(start_paused = true)]
async fn requests_held_at_one_instant_leave_jittered() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    let mut held: Vec<Ticket> = (0..10).map(|i| Ticket::new(f64::from(i) / 10.0)).collect();
    for t in &mut held {
        b.admit(opened, t);
    }
    let closed = probe_and_close(&mut b);
    let releases: Vec<Instant> = held
        .iter_mut()
        .map(|t| match b.admit(closed, t).0 {
            Admit::Wait(Some(due)) => due,
            Admit::Pass { .. } => closed,
            other => panic!("{other:?}"),
        })
        .collect();
    for (i, due) in releases.iter().enumerate() {
        assert_eq!(*due, closed + 10 * MS * i as u32, "spread over 100 ms");
    }
}

#[tokio::test(start_paused = true)]
async fn long_open_periods_are_compressed_into_the_ramp() {
    let mut b = Breaker::new(BreakerConfig {
        release_ramp: HumanDuration::from_secs(4),
        cooldown: HumanDuration::from_secs(8),
        ..config()
    });
    let opened = fail_until_open(&mut b, Instant::now());
    scout_out(&mut b);
    let mut early = ticket();
    let mut late = ticket();
    b.admit(opened + Duration::from_secs(2), &mut early);
    b.admit(opened + Duration::from_secs(6), &mut late);
    let closed = probe_and_close(&mut b);
    // Open for 8.02 s, ramp 4 s: offsets halved (almost).
    let scale = 4.0 / (closed - opened).as_secs_f64();
    for (t, offset) in [(&mut early, 2.0), (&mut late, 6.0)] {
        let Admit::Wait(Some(due)) = b.admit(closed, t).0 else {
            panic!("held")
        };
        let got = (due - closed).as_secs_f64();
        assert!(
            (got - offset * scale).abs() < 1e-6,
            "{got} vs {offset} * {scale}"
        );
        assert!(got <= 4.0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_caught_by_a_new_episode_keeps_its_place() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    scout_out(&mut b);
    let mut t = ticket();
    b.admit(opened + Duration::from_millis(1500), &mut t);
    let closed = probe_and_close(&mut b);
    let due = closed + Duration::from_millis(1500);
    assert_eq!(b.admit(closed, &mut t).0, Admit::Wait(Some(due)));
    // The breaker opens again before its release (failures right after closing).
    let reopened = fail_until_open(&mut b, closed);
    scout_out(&mut b);
    assert!(reopened < due);
    b.admit(reopened, &mut t);
    let closed_again = probe_and_close(&mut b);
    assert_eq!(
        b.admit(closed_again, &mut t).0,
        Admit::Wait(Some(closed_again + (due - reopened))),
        "it arrives in the new episode when it was due"
    );
}

#[tokio::test(start_paused = true)]
async fn held_requests_wake_spread_for_the_probes() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    scout_out(&mut b);
    let end = until(&b);
    assert_eq!(
        b.admit(opened, &mut Ticket::new(0.5)).0,
        Admit::Wait(Some(end + 50 * MS))
    );
}

#[tokio::test(start_paused = true)]
async fn released_probes_free_their_slot() {
    let mut b = breaker();
    fail_until_open(&mut b, Instant::now());
    let t = until(&b);
    b.admit(t, &mut ticket());
    b.admit(t, &mut ticket());
    assert_eq!(b.admit(t, &mut ticket()).0, Admit::Wait(None));
    b.release_probe(b.probe().unwrap());
    assert_eq!(
        b.admit(t, &mut ticket()).0,
        Admit::Pass { probe: b.probe() }
    );
}

#[tokio::test(start_paused = true)]
async fn held_probes_keep_their_own_wake_time_once_half_open() {
    let mut b = breaker();
    let opened = fail_until_open(&mut b, Instant::now());
    let end = until(&b);
    let mut early = Ticket::new(0.1);
    let mut late = Ticket::new(0.6);
    b.admit(opened, &mut early);
    b.admit(opened, &mut late);
    // The early one wakes first and makes it half-open; the late one, woken with it, waits
    // for its own time although a probe slot is free.
    let at = end + 10 * MS;
    assert_eq!(
        b.admit(at, &mut early),
        (Admit::Pass { probe: b.probe() }, true)
    );
    assert_eq!(b.admit(at, &mut late).0, Admit::Wait(Some(end + 60 * MS)));
    // A new arrival may take the free slot at once.
    assert_eq!(
        b.admit(at, &mut ticket()).0,
        Admit::Pass { probe: b.probe() }
    );
    assert_eq!(b.admit(end + 60 * MS, &mut late).0, Admit::Wait(None));
}

#[tokio::test(start_paused = true)]
async fn a_slow_probe_from_an_earlier_round_is_not_taken_for_this_one() {
    let mut b = breaker();
    fail_until_open(&mut b, Instant::now());
    let t1 = until(&b);
    let (Admit::Pass { probe: slow }, _) = b.admit(t1, &mut ticket()) else {
        panic!("a probe")
    };
    let (Admit::Pass { probe: failing }, _) = b.admit(t1, &mut ticket()) else {
        panic!("a probe")
    };
    assert!(b.record(true, failing, t1, 1.0), "reopened");
    let t2 = until(&b);
    b.admit(t2, &mut ticket());
    // The first round's slow probe answers in the second round: ignored, not a second answer.
    assert!(!b.record(false, slow, t2, 1.0));
    b.release_probe(slow.unwrap());
    assert_eq!(
        b.phase(),
        Phase::HalfOpen {
            admitted: 1,
            answered: 0,
            failed: 0
        }
    );
}

#[test]
fn a_carried_breaker_stays_open_and_starts_its_probes_over() {
    let mut old = breaker();
    let opened = fail_until_open(&mut old, Instant::now());
    let open_until = until(&old);
    let mut new = Breaker::new(BreakerConfig {
        half_open_probes: 1,
        ..config()
    });
    new.carry_from(&old);
    assert_eq!(new.phase(), Phase::Open { until: open_until });
    assert!(matches!(new.admit(opened, &mut ticket()).0, Admit::Wait(_)));
    // Half-open with both of its probes out: the new breaker admits its own (one, by its
    // settings); the old round's answers do not count.
    assert!(matches!(
        old.admit(open_until, &mut ticket()).0,
        Admit::Pass { .. }
    ));
    assert!(matches!(
        old.admit(open_until, &mut ticket()).0,
        Admit::Pass { .. }
    ));
    let old_probe = old.probe();
    let mut new = Breaker::new(BreakerConfig {
        half_open_probes: 1,
        ..config()
    });
    new.carry_from(&old);
    assert!(!new.record(false, old_probe, open_until, 1.0));
    assert_eq!(
        new.admit(open_until, &mut ticket()).0,
        Admit::Pass { probe: new.probe() }
    );
    assert!(new.record(false, new.probe(), open_until + 10 * MS, 1.0));
    assert_eq!(new.phase(), Phase::Closed);
}

#[test]
fn every_phase_has_its_series_from_the_first_scrape() {
    let now = Instant::now();
    let phases = [
        Phase::Closed,
        Phase::Open { until: now },
        Phase::HalfOpen {
            admitted: 0,
            answered: 0,
            failed: 0,
        },
    ];
    for phase in phases {
        assert!(
            crate::metrics::BREAKER_PHASES.contains(&phase.name()),
            "{phase:?}"
        );
    }
    assert_eq!(phases.len(), crate::metrics::BREAKER_PHASES.len());
}

/// Bursts after pauses: each second a burst's one overload comes back at once, alone in its
/// slot, and its 19 successes a service time later in the next: a slot mean of 50%, 5% of
/// answers. The breaker stays closed (it opened at 1 s when the mean alone decided); an
/// upstream failing half its answers still opens it.
#[tokio::test(start_paused = true)]
async fn fast_failures_beside_slow_successes_are_counted_not_averaged() {
    let mut b = Breaker::new(BreakerConfig {
        window: 50,
        min_samples: 20,
        min_span: HumanDuration::from_secs(1),
        ..config()
    });
    let start = Instant::now();
    for second in 0..10u32 {
        let t = start + 1000 * MS * second;
        assert!(!b.record(true, None, t, 1.0), "opened at {second} s");
        for i in 0..19 {
            assert!(!b.record(false, None, t + 200 * MS + i * MS, 1.0));
        }
    }
    assert_eq!(b.phase(), Phase::Closed);
    let t = start + 20_000 * MS;
    let opened = (0..100u32).any(|i| b.record(i % 2 == 0, None, t + 100 * MS * i, 1.0));
    assert!(opened, "half its answers failed");
}

#[tokio::test(start_paused = true)]
async fn by_default_a_backlog_leaves_within_a_clients_second_backoff() {
    // A 6 s outage's backlog: with a 10 s ramp a sixth of it waited 4 s after the end.
    let mut b = Breaker::new(BreakerConfig {
        cooldown: HumanDuration::from_secs(6),
        ..config()
    });
    b.config.release_ramp = BreakerConfig::default().release_ramp;
    let opened = fail_until_open(&mut b, Instant::now());
    scout_out(&mut b);
    let mut held: Vec<Ticket> = (0..6).map(|_| ticket()).collect();
    for (i, t) in held.iter_mut().enumerate() {
        b.admit(opened + Duration::from_secs(i as u64), t);
    }
    let closed = probe_and_close(&mut b);
    for t in &mut held {
        let due = match b.admit(closed, t).0 {
            Admit::Wait(Some(due)) => due,
            Admit::Pass { .. } => closed,
            other => panic!("{other:?}"),
        };
        assert!(due <= closed + Duration::from_secs(2), "{:?}", due - closed);
    }
}
