//! The refill rate read from reports whose resets are rounded to whole seconds, and reports
//! that count a long window.

use super::*;

/// A report in Azure's style: the wait until full in whole seconds, rounded up.
fn azure(used: f64, reset_secs: u64) -> Report {
    Report {
        limit: 50.0,
        remaining: 50.0 - used,
        reset: Some(Duration::from_secs(reset_secs)),
        coarse: true,
        instant: false,
        past: Duration::ZERO,
    }
}

/// A bucket kept near full (a fleet sending a little under the rate) reports a small wait,
/// rounded up to a second: a low sample, no evidence of a lower rate. The estimate keeps the
/// largest lower bound; only an upper bound (a wait of two seconds or more) lowers it.
#[tokio::test(start_paused = true)]
async fn low_whole_second_samples_do_not_wear_the_rate_down() {
    let now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let answer = |pacer: &mut Pacer, report: Report| {
        let ticket = pacer.admit_anyway(1.0, now);
        pacer.observe(ticket, Answer::Ok, Some(report), now);
    };
    // 40 used, full within two seconds: at least 20/s (true: 20/s).
    answer(&mut pacer, azure(40.0, 2));
    assert!((pacer.header_rate - 20.0).abs() < 1e-9);
    // A hundred answers from a nearly full bucket: 5 used, full within a second (5/s at
    // least, anything above). They were a 2% decay each, down to 2.7/s.
    for _ in 0..100 {
        answer(&mut pacer, azure(5.0, 1));
    }
    assert!(
        (pacer.header_rate - 20.0).abs() < 1e-9,
        "{}",
        pacer.header_rate
    );
    // 30 used, full in 1-2 s: 15-30/s, and 20/s stands.
    answer(&mut pacer, azure(30.0, 2));
    assert!(
        (pacer.header_rate - 20.0).abs() < 1e-9,
        "{}",
        pacer.header_rate
    );
    // The limit is lowered to 10/s: 50 used, full in 5-6 s, so less than 12.5/s.
    answer(&mut pacer, azure(50.0, 5));
    assert!(pacer.header_rate <= 12.5, "{}", pacer.header_rate);
}

/// An instant (Anthropic's reset) read when a completed answer came is short by its service
/// time: the upstream counted when the request arrived. The wait is taken from the send.
#[tokio::test(start_paused = true)]
async fn an_instants_wait_counts_from_the_send() {
    let sent = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, sent);
    let ticket = pacer.admit_anyway(1.0, sent);
    // 50 used at 20/s: full 2.5 s after the request arrived; the answer came a second later,
    // when the instant was 1.5 s away.
    let now = sent + Duration::from_secs(1);
    let report = Report {
        limit: 50.0,
        remaining: 0.0,
        reset: Some(Duration::from_millis(1500)),
        coarse: true,
        instant: true,
        past: Duration::ZERO,
    };
    pacer.observe(ticket, Answer::Ok, Some(report), now);
    assert!(
        (pacer.header_rate - 20.0).abs() < 1e-6,
        "{} per second, true 20",
        pacer.header_rate
    );
}

/// Whole-second instants may be truncated, not rounded up (a formatter that drops the
/// fraction): a bucket of 25/s reported as 1,500 a minute, 5 used, full 0.2 s after the count,
/// truncated to the second the count fell in (behind it) or the next. Read as rounded up, an
/// instant a few milliseconds ahead is a refill of thousands a second. One instant that lay
/// before its attempt was sent shows the truncation: the rate is then learned as
/// `used / (ahead - behind + 1)`, at most the true one, and near it once the count fell late
/// in its second.
#[tokio::test(start_paused = true)]
async fn a_truncated_instant_is_no_refill_of_thousands() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    // Answers 10 ms after their send (and count), `frac` into its second.
    for (i, frac) in [0.5, 0.9, 0.3, 0.79, 0.95, 0.6].into_iter().enumerate() {
        let sent = start + Duration::from_secs(i as u64);
        let ticket = pacer.admit_anyway(1.0, sent);
        let now = sent + Duration::from_millis(10);
        // floor(count + 0.2 s), against the clock when the answer came.
        let instant = if frac + 0.2 >= 1.0 { 1.0 - frac } else { -frac };
        let ahead = instant - 0.01;
        let (reset, past) = if ahead >= 0.0 {
            (Duration::from_secs_f64(ahead), Duration::ZERO)
        } else {
            (Duration::ZERO, Duration::from_secs_f64(-ahead))
        };
        let report = Report {
            limit: 1_500.0,
            remaining: 1_495.0,
            reset: Some(reset),
            coarse: true,
            instant: true,
            past,
        };
        pacer.observe(ticket, Answer::Ok, Some(report), now);
    }
    let rate = pacer.header_rate;
    assert!(
        (20.0..=25.0 + 1e-6).contains(&rate),
        "{rate} per second, true 25"
    );
}

/// Groq's requests per day: `remaining` 14,378 of 14,400 and a reset of 2m12s (the 22 used,
/// refilled at a day's pace) count a long window, not the bucket that refuses: the pacer
/// learns as without headers. A per-minute report (OpenAI's 4,999 of 5,000, reset 12ms) is a
/// bucket; so is a coarse one whose rounding alone makes the window long.
#[test]
fn a_report_whose_refill_takes_hours_is_a_long_window() {
    let now = Instant::now();
    let read = |report: Report| {
        let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
        let ticket = pacer.admit_anyway(1.0, now);
        pacer.observe(ticket, Answer::Ok, Some(report), now);
        pacer.source()
    };
    let day = fine_report(14_400.0, 14_378.0, Duration::from_secs(132));
    assert_eq!(read(day), Source::SlowStart, "a day's quota");
    let minute = fine_report(5_000.0, 4_999.0, Duration::from_millis(12));
    assert_eq!(read(minute), Source::Headers, "a minute's bucket");
    let coarse = Report {
        coarse: true,
        ..fine_report(10_000.0, 9_999.0, Duration::from_secs(1))
    };
    assert_eq!(read(coarse), Source::Headers, "rounded up, not long");
}

/// A burst that overran its bucket: the refusals answer at once, the successes after the
/// service time. The sends beyond the bucket were refused, not banked as debt: the level the
/// reports leave is what the bucket refills from empty, not a burst owed (which held a bucket
/// of 50 refilled 50/s shut for a second after each such burst).
#[test]
fn sends_a_bucket_refused_are_not_owed() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    let report = refilling(50.0, 50.0);
    // The pace known: one answer of a bucket of 50 refilled 50/s, and its round trip.
    let t = pacer.admit_anyway(1.0, now);
    now += Duration::from_millis(200);
    pacer.observe(t, Answer::Ok, Some(report(49.0)), now);
    now += Duration::from_secs(1);
    // 50 admitted, then 200 more refused; the refusals answer in 5 ms, the successes in 200.
    let ok: Vec<_> = (0..50).map(|_| pacer.admit_anyway(1.0, now)).collect();
    let refused: Vec<_> = (0..200).map(|_| pacer.admit_anyway(1.0, now)).collect();
    now += Duration::from_millis(5);
    for t in refused {
        pacer.observe(t, Answer::RateLimited, Some(report(0.0)), now);
    }
    now += Duration::from_millis(195);
    for (i, t) in ok.into_iter().enumerate() {
        pacer.observe(t, Answer::Ok, Some(report(49.0 - i as f64)), now);
    }
    // The bucket refilled 10 over those 200 ms and refills 50/s: the next 400 ms send about
    // 20, not nothing while 200 phantom sends are paid off.
    let sent = sent(&mut pacer, now, 400).len();
    assert!(sent >= 10, "{sent} sent in 400 ms");
}
