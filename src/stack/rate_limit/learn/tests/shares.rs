//! A pacer's share of a key that others draw on too, read from the reports' drain.

use super::*;

/// A request sent every `every` for `secs`, each answered 5 ms later: the bucket (50, refilled
/// at 20/s) reports `remaining(t)` when it counts each, as OpenAI does (a reset to full at
/// 20/s).
fn answers(
    pacer: &mut Pacer,
    from: Instant,
    secs: f64,
    every: Duration,
    remaining: impl Fn(f64) -> f64,
) -> Instant {
    let mut now = from;
    while now.duration_since(from).as_secs_f64() < secs {
        let ticket = pacer.admit_anyway(1.0, now);
        let left = remaining(now.duration_since(from).as_secs_f64()).clamp(0.0, 50.0);
        let reset = Duration::from_secs_f64((50.0 - left) / 20.0);
        let report = fine_report(50.0, left, reset);
        let answered = now + Duration::from_millis(5);
        pacer.observe(ticket, Answer::Ok, Some(report), answered);
        now += every;
    }
    now
}

/// Others take three quarters of a key's refill: the bucket stays empty while this pacer gets
/// 5 of its 20 a second. Its reports say so before any 429 does, and it paces at that share.
/// When the others go (the bucket fills again while it sends at its share), the share is
/// lifted: the key's whole rate is its own again.
#[tokio::test(start_paused = true)]
async fn a_share_is_read_from_the_reports_and_lifted_when_the_others_go() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    let every = Duration::from_millis(200);
    let now = answers(&mut pacer, start, 2.0, every, |_| 0.0);
    assert!(
        (4.0..=6.0).contains(&pacer.rate()),
        "{} per second, a share of 5",
        pacer.rate()
    );
    assert_eq!(pacer.throttles, 0);
    // The others are gone: 15 a second left over fill the bucket.
    answers(&mut pacer, now, 2.0, every, |t| 15.0 * t);
    assert!(
        pacer.rate() >= 19.0,
        "{} per second once alone on a 20/s key",
        pacer.rate()
    );
}

/// A pacer alone on its key that keeps its bucket empty took all the refill: its share is the
/// whole, and its pace stays the key's.
#[tokio::test(start_paused = true)]
async fn a_pacer_alone_at_the_edge_keeps_the_whole_rate() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    answers(&mut pacer, start, 5.0, Duration::from_millis(50), |_| 0.0);
    assert!(pacer.rate() >= 19.0, "{} per second", pacer.rate());
}

/// A fleet replica shares the key's bucket through Redis: others' drain is not counted
/// against it.
#[tokio::test(start_paused = true)]
async fn a_fleet_replica_takes_no_share_from_the_reports() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    pacer.in_fleet();
    answers(&mut pacer, start, 2.0, Duration::from_millis(200), |_| 0.0);
    assert!(pacer.rate() >= 19.0, "{} per second", pacer.rate());
}
