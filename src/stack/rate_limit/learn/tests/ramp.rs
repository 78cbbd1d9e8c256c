//! The ramp before the bucket's edge is known: fleet replicas without headers ramp as one
//! corral (what each built alone is split among them once their count is known,
//! [`Pacer::among`]), and a report that names no refill leaves the ramp to silence.

use super::*;

/// A replica sent its first ten as if alone before it heard it is one of four. Its answers give
/// back a quarter of what they would alone, so its second round is a quarter of a lone corral's
/// twenty (the fleet's second round is twenty, as one corral's), and it still doubles per round
/// trip from there.
#[test]
fn replicas_that_started_alone_split_the_slow_start() {
    let start = Instant::now();
    let run = |replicas: u64| {
        let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
        let first = sent(&mut pacer, start, 150);
        assert_eq!(first.len(), 10);
        pacer.among(replicas);
        let answered = start + Duration::from_millis(200);
        for t in first {
            pacer.observe(t, Answer::Ok, None, answered);
        }
        let second = sent(&mut pacer, answered, 150);
        let later = answered + Duration::from_millis(200);
        for t in &second {
            pacer.observe(*t, Answer::Ok, None, later);
        }
        let third = sent(&mut pacer, later, 150);
        (pacer, second.len(), third.len())
    };
    let (alone, second, third) = run(1);
    assert_eq!((second, third), (20, 40), "alone: doubling");
    assert_eq!(alone.source(), Source::SlowStart);
    let (_, second, third) = run(4);
    assert_eq!((second, third), (5, 10), "a quarter of it, doubling");
}

/// A replica that hears the count only after its first 429 has cut its pace from its own rush
/// as if alone: that guess is split too. An estimate from a throttle window is this replica's
/// own share already and stays; a count that falls back splits nothing again.
#[test]
fn a_cut_guessed_alone_is_split_an_estimate_is_not() {
    let mut now = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, now);
    for _ in 0..40 {
        let t = pacer.admit_anyway(1.0, now);
        now += Duration::from_millis(10);
        pacer.observe(t, Answer::Ok, None, now);
    }
    let t = pacer.admit_anyway(1.0, now);
    pacer.observe(t, Answer::RateLimited, None, now + Duration::from_millis(1));
    assert_eq!(pacer.source(), Source::Aimd);
    let guess = pacer.cap.expect("the first 429 cuts");
    assert!(guess.before.is_some(), "a guess");
    pacer.among(4);
    let split = pacer.cap.expect("still capped");
    assert!(
        (split.rate - guess.rate / 4.0).abs() < 1e-9,
        "{} from {}",
        split.rate,
        guess.rate
    );
    pacer.among(2);
    pacer.among(4);
    assert_eq!(pacer.cap.expect("capped").rate, split.rate, "split once");

    let mut estimated = Pacer::new(Kind::Requests, 10, 1.0, now);
    estimated.source = Source::Aimd;
    estimated.cap = Some(Cap {
        before: None,
        ..split
    });
    estimated.among(4);
    assert_eq!(estimated.cap.expect("capped").rate, split.rate, "evidence");
}

/// A report of a full bucket (an overload's 429 before anything was used: `remaining` =
/// `limit`, reset `0s`) names no refill. A tokens pacer's confirmed window starts below one
/// request's tokens; the silence of its sends grows it, and the level within it, so requests
/// go on before any answer (of 10 s here) comes back. (Before, the level waited for the next
/// report: one request per round trip.)
#[test]
fn a_report_of_a_full_bucket_leaves_the_ramp_to_silence() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Tokens, 10, 1.0, start);
    pacer.handshake(0.0001);
    let first = pacer.admit_anyway(19.0, start);
    let full = fine_report(2_000_000.0, 2_000_000.0, Duration::ZERO);
    let refused = start + Duration::from_millis(2);
    pacer.observe(first, Answer::Overloaded, Some(full), refused);
    assert_eq!(pacer.source(), Source::Headers);
    let mut sent = 0;
    for step in 0..500 {
        let now = refused + Duration::from_millis(step);
        while pacer.try_acquire(19.0, now).is_ok() {
            sent += 1;
        }
    }
    assert!(sent >= 50, "sent {sent} in 500 ms of silence");
}

/// Before anything is known, an overload (a 529, or a 429 read as one) took nothing from the
/// bucket: its slot comes back, as another bucket's refusal's does. (Kept, 23 overloads of the
/// first 34 sends in Anthropic's 529 incident left the ramp one send per consent for 3 s while
/// 466 requests waited.)
#[test]
fn an_overload_in_slow_start_gives_its_slot_back() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let first = sent(&mut pacer, start, 150);
    assert_eq!(first.len(), 10);
    let answered = start + Duration::from_millis(150);
    for t in first {
        pacer.observe(t, Answer::Overloaded, None, answered);
    }
    let second = sent(&mut pacer, answered, 150).len();
    assert!(second >= 10, "{second} sent: the ten slots back");
}

/// Reported headroom is confirmed as a window: what is in flight unconfirmed is spent from it,
/// so each answer lets go what it confirmed, not a whole window more. Behind a stream's heads
/// of 3 ms, every answer let a window go: 48 sent in 30 ms at a bucket of 20.
#[test]
fn confirmed_headroom_is_a_window_not_a_gift_per_answer() {
    let start = Instant::now();
    let report = refilling(1200.0, 20.0);
    let mut pacer = Pacer::new(Kind::Requests, 10, 1.0, start);
    let first = pacer.try_acquire(1.0, start).unwrap();
    let answered = start + Duration::from_millis(3);
    pacer.observe(first, Answer::Ok, Some(report(1199.0)), answered);
    assert_eq!(pacer.source(), Source::Headers);
    let window = sent(&mut pacer, answered, 20);
    assert_eq!(window.len(), 11, "the initial ten and the one confirmed");
    // One answer more: one confirmed, one slot back; ten still in flight.
    let later = answered + Duration::from_millis(20);
    pacer.observe(window[0], Answer::Ok, Some(report(1198.0)), later);
    let next = sent(&mut pacer, later, 10);
    assert_eq!(next.len(), 2, "its slot and one more, not a window");
}

/// A per-minute report (1,200) over a bucket of 20 refilled 20 a second, answers' heads in
/// 3 ms (a stream's), refusals in 4 ms: each answer confirms a send before any refusal can come
/// back, so the ramp doubles faster than the bucket's edge can show itself. Past a second of
/// the reported rate one probe goes alone; its refusal finds the edge: 1 refused in 2 s, 58
/// admitted. Without the probe, 30 refused (14-19 in `openai-stream`).
#[tokio::test(start_paused = true)]
async fn past_a_second_of_the_reported_rate_one_probe_goes_alone() {
    let start = Instant::now();
    let mut pacer = Pacer::new(Kind::Requests, 10, 0.97, start);
    pacer.handshake(0.0001);
    let (admitted, refused) = stream_heads(&mut [pacer]).await;
    assert!(refused <= 2, "{refused} refused, {admitted} admitted");
    // The bucket's 20 and its refill since, less a little: the probe costs no pace.
    assert!(admitted >= 50, "{admitted} admitted in 2 s");
}

/// The same key behind four fleet replicas that each read its reports (their peers' refusals
/// not heard): each takes its part of the second before its probe. 17 refused in 2 s; with a
/// whole second each, or no quantum in a fleet as before, 46.
#[tokio::test(start_paused = true)]
async fn a_fleet_replica_probes_past_its_part_of_a_second() {
    let start = Instant::now();
    let mut pacers: Vec<Pacer> = (0..4)
        .map(|_| {
            let mut pacer = Pacer::new(Kind::Requests, 3, 0.97, start);
            pacer.handshake(0.0001);
            pacer.in_fleet();
            pacer.fleet_live(4);
            pacer
        })
        .collect();
    let (admitted, refused) = stream_heads(&mut pacers).await;
    assert!(refused <= 24, "{refused} refused, {admitted} admitted");
    assert!(admitted >= 50, "{admitted} admitted in 2 s");
}

/// Pacers on one quantized key (see above) for two seconds, each sending whenever it may and
/// pausing for its learned wait after its refusals: (admitted, refused).
async fn stream_heads(pacers: &mut [Pacer]) -> (usize, usize) {
    let start = Instant::now();
    let mut model = Model::styled(20.0, 20.0, Style::Quantized);
    let mut in_flight: Vec<(Instant, usize, Ticket, bool, HeaderMap)> = Vec::new();
    let (mut admitted, mut refused) = (0, 0);
    let mut paused = vec![start; pacers.len()];
    while start.elapsed() < Duration::from_secs(2) {
        let now = Instant::now();
        let (due, rest): (Vec<_>, Vec<_>) = in_flight.into_iter().partition(|(t, ..)| *t <= now);
        in_flight = rest;
        for (_, k, ticket, ok, headers) in due {
            let pacer = &mut pacers[k];
            answer(pacer, ticket, ok, &headers, now);
            if !ok {
                paused[k] = paused[k].max(now + pacer.time_for(1.0).unwrap_or_default());
            }
        }
        for (k, pacer) in pacers.iter_mut().enumerate() {
            while let Some(ticket) = (paused[k] <= now)
                .then(|| pacer.try_acquire(1.0, now).ok())
                .flatten()
            {
                let (ok, headers, _) = model.arrive(now);
                let delay = Duration::from_millis(if ok { 3 } else { 4 });
                in_flight.push((now + delay, k, ticket, ok, headers));
                if ok {
                    admitted += 1;
                } else {
                    refused += 1;
                }
            }
        }
        tokio::time::advance(Duration::from_micros(250)).await;
    }
    (admitted, refused)
}

/// Before a connection has opened, the wait for the first sends' silence is the half-second
/// guess the first handshake soon replaces: the next look comes within `REFUSAL_WORK`. Slept
/// on, it held the ramp to one doubling per answer (`lb-resets`, answers of 0.5 s).
#[test]
fn before_a_connection_opens_the_first_sends_are_looked_at_again_soon() {
    let start = Instant::now();
    let mut early = Pacer::new(Kind::Requests, 10, 1.0, start);
    assert_eq!(sent(&mut early, start, 100).len(), 10);
    let now = start + Duration::from_millis(100);
    let wait = early.try_acquire(1.0, now).unwrap_err();
    assert!(wait.is_some_and(|w| w <= REFUSAL_WORK), "{wait:?}");
    // Once a connection has opened, the handshake's wait confirms them.
    early.handshake(0.0001);
    let later = now + REFUSAL_WORK;
    assert!(early.try_acquire(1.0, later).is_ok());
}

/// A refusal no bucket made (an admission control's, a quota's) grows slow start's window as a
/// success does; another bucket's refusal only gives its slot back.
#[test]
fn a_refusal_no_bucket_made_grows_the_ramp() {
    let start = Instant::now();
    let later = start + Duration::from_millis(101);
    for grows in [false, true] {
        let mut pacer = Pacer::new(Kind::Requests, 4, 1.0, start);
        let window = sent(&mut pacer, start, 100);
        assert_eq!(window.len(), 4);
        for ticket in window {
            pacer.observe(ticket, Answer::RefusedElsewhere, None, later);
            if grows {
                pacer.refused_by_queue(ticket);
            }
        }
        let want = if grows { 8.0 } else { 4.0 };
        assert_eq!(pacer.burst(), want, "grows: {grows}");
    }
}
