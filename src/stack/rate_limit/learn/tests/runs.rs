//! The pacers against the model bucket: what they learn, and the 429s it costs them.

use super::*;

#[tokio::test(start_paused = true)]
async fn steady_limit_is_learned_within_the_first_second() {
    let mut model = Model::new(50.0, 20.0);
    let (per_second, throttles, pacer) = drive(&mut model, 10, None, true).await;
    assert_eq!(pacer.source(), Source::Headers);
    assert!(
        (pacer.rate() - 20.0 * 0.97).abs() < 1.0,
        "learned rate {}",
        pacer.rate()
    );
    assert!(throttles <= 2, "{throttles} throttles");
    // After the first second (burst spent), throughput sits just under the true 20/s.
    for (s, n) in per_second.iter().enumerate().skip(2) {
        assert!(
            (17..=21).contains(n),
            "second {s}: {n} accepted ({per_second:?})"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_halved_limit_is_followed_within_two_seconds() {
    let mut model = Model::new(50.0, 40.0);
    let (per_second, throttles, pacer) = drive(&mut model, 12, Some((5, 20.0)), true).await;
    assert!(
        (pacer.rate() - 20.0 * 0.97).abs() < 1.5,
        "learned rate {}",
        pacer.rate()
    );
    for (s, n) in per_second.iter().enumerate().skip(7) {
        assert!(
            (17..=21).contains(n),
            "second {s}: {n} accepted after the change ({per_second:?})"
        );
    }
    assert!(throttles <= 5, "{throttles} throttles around the change");
}

#[tokio::test(start_paused = true)]
async fn without_headers_the_429s_alone_find_the_rate() {
    let mut model = Model::new(50.0, 20.0);
    let (per_second, throttles, pacer) = drive(&mut model, 30, None, false).await;
    assert_eq!(pacer.source(), Source::Aimd);
    let tail: u32 = per_second[5..].iter().sum();
    let tail_rate = f64::from(tail) / 25.0;
    assert!(
        (18.0..=20.5).contains(&tail_rate),
        "accepted {tail_rate}/s after the first 5 s ({per_second:?})"
    );
    // The throttle windows estimate the rate; probing upward costs a 429 now and then.
    assert!(throttles <= 40, "{throttles} throttles in 30 s");
}

#[tokio::test(start_paused = true)]
async fn quantized_enforcement_behind_a_per_minute_report() {
    // limit 1200/min reported, 20 per second enforced by a bucket of 20.
    let run = world(Style::Quantized, 20.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 15, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn self_consistent_per_minute_reports() {
    let run = world(Style::PerMinute, 50.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 25, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn whole_second_resets() {
    let run = world(Style::WholeSeconds, 50.0, 1, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.5..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert_eq!(run.throttles, 0);
}

#[tokio::test(start_paused = true)]
async fn a_limit_that_drops_mid_run_is_followed() {
    let run = world(Style::Capacity, 50.0, 1, Some((10, 10.0))).await;
    let rate = rate_after(&run, 12);
    assert!(
        (9.0..=10.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    assert!(run.throttles <= 5, "{} throttles", run.throttles);
}

#[tokio::test(start_paused = true)]
async fn four_pacers_on_one_key_share_it() {
    // Each sees the whole key's headers, and in them what the others draw.
    let run = world(Style::Capacity, 50.0, 4, None).await;
    let rate = rate_after(&run, 2);
    assert!(
        (18.0..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        run.per_second
    );
    // Without shared state the pacers find their shares from the reports' drain, not by
    // 429s: the first round's (each sends as if alone until its first share) and few after.
    // By 429s alone it took 23 in these 30 s, the paces adding up to 33/s.
    assert!(run.throttles <= 12, "{} throttles", run.throttles);
    let paces: Vec<f64> = run.pacers.iter().map(Pacer::rate).collect();
    let sum: f64 = paces.iter().sum();
    assert!(
        (16.0..=22.0).contains(&sum),
        "their paces {paces:?} add up to {sum}/s, the key has 20/s"
    );
    let (low, high) = paces
        .iter()
        .fold((f64::MAX, 0.0f64), |(l, h), p| (l.min(*p), h.max(*p)));
    assert!(high <= 1.5 * low, "paces {paces:?}");
}

#[tokio::test(start_paused = true)]
async fn four_pacers_without_headers_share_the_key_from_each_others_429s() {
    // Alone, each corral learns from its own 429s only: they compete as AIMD flows do.
    let mut model = Model::styled(50.0, 20.0, Style::None);
    let alone = drive_peers(&mut model, 4, 30, None, false).await;
    // A fleet's: every refusal ends every replica's throttle window, and their shares add up.
    let mut model = Model::styled(50.0, 20.0, Style::None);
    let fleet = drive_peers(&mut model, 4, 30, None, true).await;
    let rate = rate_after(&fleet, 2);
    assert!(
        (18.0..=20.5).contains(&rate),
        "{rate}/s ({:?})",
        fleet.per_second
    );
    // The paces end up even, adding up to the key's rate: between refusals they probe
    // upward (a cut grows by a tenth a second), so at any one instant the sum is within a
    // fifth of it, above or below.
    let paces: Vec<f64> = fleet.pacers.iter().map(Pacer::rate).collect();
    let sum: f64 = paces.iter().sum();
    assert!((16.0..=24.0).contains(&sum), "paces {paces:?}");
    let (low, high) = paces
        .iter()
        .fold((f64::MAX, 0.0f64), |(l, h), p| (l.min(*p), h.max(*p)));
    assert!(high <= 1.25 * low, "paces {paces:?}");
    assert!(
        fleet.throttles * 3 <= alone.throttles * 2,
        "{} throttles as a fleet against {} alone",
        fleet.throttles,
        alone.throttles
    );
}

#[tokio::test(start_paused = true)]
#[ignore = "diagnostic: prints each scenario's series"]
async fn print_scenarios() {
    for (name, style, replicas, change) in [
        ("capacity", Style::Capacity, 1, None),
        ("per-minute", Style::PerMinute, 1, None),
        ("quantized", Style::Quantized, 1, None),
        ("whole-seconds", Style::WholeSeconds, 1, None),
        ("none", Style::None, 1, None),
        ("drop", Style::Capacity, 1, Some((10, 10.0))),
        ("fleet4", Style::Capacity, 4, None),
        ("fleet4-none", Style::None, 4, None),
    ] {
        let capacity = if style == Style::Quantized {
            20.0
        } else {
            50.0
        };
        let mut model = Model::styled(capacity, 20.0, style);
        let run = drive_fleet(&mut model, replicas, 30, change).await;
        let rates: Vec<String> = run
            .pacers
            .iter()
            .map(|p| format!("{:.1}/{}", p.rate(), p.source().label()))
            .collect();
        println!(
            "{name:>14}: throttles {:>4} rates {rates:?} per second {:?}",
            run.throttles, run.per_second
        );
    }
}

/// A ramp through reported headroom doubles per round trip, whatever the timer's tick: 500
/// requests at once, a bucket far larger than that, a 20 ms round trip and every fifth answer
/// an overload. The sender wakes once per millisecond, as tokio's timers do. Doubling from 10
/// per round trip sends the 500 in about seven round trips (140 ms, with the slow start's first
/// spacing); one send per tick would take 500 ms. Bound: 250 ms.
#[tokio::test(start_paused = true)]
async fn a_ramp_is_not_held_to_one_send_per_timer_tick() {
    let start = Instant::now();
    let mut model = Model::new(1e6, 1e6);
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    let mut in_flight: Vec<(Instant, Ticket, bool, HeaderMap)> = Vec::new();
    let mut sent = 0u32;
    while sent < 500 {
        let now = Instant::now();
        assert!(
            now.duration_since(start) < Duration::from_millis(250),
            "{sent} of 500 sent after 250 ms"
        );
        let (due, rest): (Vec<_>, Vec<_>) = in_flight.into_iter().partition(|(t, ..)| *t <= now);
        in_flight = rest;
        for (_, ticket, ok, headers) in due {
            let r = report(&headers, Kind::Requests, SystemTime::now());
            let answer = if ok { Answer::Ok } else { Answer::Overloaded };
            pacer.observe(ticket, answer, r, now);
        }
        while sent < 500 {
            let Ok(ticket) = pacer.try_acquire(1.0, now) else {
                break;
            };
            let (_, headers, _) = model.arrive(now);
            sent += 1;
            let ok = !sent.is_multiple_of(5);
            let rtt = Duration::from_millis(if ok { 20 } else { 1 });
            in_flight.push((now + rtt, ticket, ok, headers));
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
}
