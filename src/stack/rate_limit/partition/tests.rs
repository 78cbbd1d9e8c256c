use std::time::SystemTime;

use http::HeaderMap;

use super::answers::attribute;
use super::*;
use crate::classify::{Outcome, Throttle};
use crate::config::types::parse_base_url;
use crate::provider::{self, Report};
use crate::stack::rate_limit::learn::Answer;

fn config() -> UpstreamConfig {
    UpstreamConfig::new("t", "/v1", parse_base_url("http://127.0.0.1:1").unwrap())
}

/// What the rate limiter reads in a 429 with these headers and no body.
fn read(h: &HeaderMap) -> Throttle {
    let config = crate::config::RetryConfig::default();
    Throttle::read(h, b"", &config, Duration::from_secs(60), SystemTime::now())
}

#[tokio::test(start_paused = true)]
async fn a_large_request_is_not_starved_by_small_ones() {
    let mut config = config();
    config.rate_limit = LearnMode::Off;
    config.limits.tpm = NonZeroU32::new(6000); // 100 tokens/s
    config.limits.token_burst = NonZeroU32::new(100);
    let partition = Arc::new(Partition::new(&config, None));
    let deadline = Instant::now() + Duration::from_secs(60);
    partition
        .acquire(100, deadline, Priority::Interactive, "t")
        .await
        .unwrap(); // empties the bucket
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (name, cost) in [
        ("large", 100),
        ("small-1", 10),
        ("small-2", 10),
        ("small-3", 10),
    ] {
        let (p, order) = (Arc::clone(&partition), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            p.acquire(cost, deadline, Priority::Interactive, "t")
                .await
                .unwrap();
            order.lock().unwrap().push(name);
        }));
        tokio::task::yield_now().await; // queue in this order
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *order.lock().unwrap(),
        ["large", "small-1", "small-2", "small-3"]
    );
}

/// The largest estimate a body can give takes at most the configured token burst: the
/// next request waits for one burst's refill at most, not for the estimate's.
#[tokio::test(start_paused = true)]
async fn a_huge_estimate_holds_the_partition_for_one_burst_at_most() {
    let mut config = config();
    config.rate_limit = LearnMode::Off;
    config.limits.tpm = NonZeroU32::new(6000); // 100 tokens/s
    config.limits.token_burst = NonZeroU32::new(100);
    let partition = Partition::new(&config, None);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(600);
    let huge = super::super::estimate::estimate_tokens(
        br#"{"prompt":"x","max_tokens":18446744073709551615}"#,
        16,
    );
    assert!(huge >= u32::MAX / 2);
    partition
        .acquire(huge, deadline, Priority::Interactive, "t")
        .await
        .unwrap();
    partition
        .acquire(100, deadline, Priority::Interactive, "t")
        .await
        .unwrap();
    assert!(
        start.elapsed() <= Duration::from_secs(1),
        "the next full-burst request waited {:?}, one burst's refill is 1 s",
        start.elapsed()
    );
}

/// Every ceiling is checked before any is taken: a request the tokens bucket refuses, or
/// that leaves while it waits for tokens, has spent nothing of the requests bucket, so the
/// next small request goes at once.
#[tokio::test(start_paused = true)]
async fn a_request_refused_or_gone_spends_no_other_ceiling() {
    let mut config = config();
    config.rate_limit = LearnMode::Off;
    config.limits.rpm = NonZeroU32::new(60); // 1/s
    config.limits.burst = NonZeroU32::new(1);
    config.limits.tpm = NonZeroU32::new(600); // 10 tokens/s
    config.limits.token_burst = NonZeroU32::new(100);
    let partition = Partition::new(&config, None);
    let far = || Instant::now() + Duration::from_secs(60);
    partition
        .acquire(100, far(), Priority::Interactive, "t")
        .await
        .unwrap(); // both buckets empty
    tokio::time::advance(Duration::from_secs(1)).await; // a request back, 10 tokens
    let refused = partition
        .acquire(
            100,
            Instant::now() + Duration::from_secs(1),
            Priority::Interactive,
            "t",
        )
        .await;
    assert_eq!(refused.unwrap_err().status(), 429, "9 s of tokens short");
    let gone = tokio::time::timeout(
        Duration::from_millis(500),
        partition.acquire(100, far(), Priority::Interactive, "t"),
    )
    .await;
    assert!(gone.is_err(), "the client left while it waited for tokens");
    let start = Instant::now();
    partition
        .acquire(1, far(), Priority::Interactive, "t")
        .await
        .unwrap();
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "the next request waited for what the refused or cancelled ones spent"
    );
}

/// The pacers are checked together before either is taken: a request that waits for the
/// tokens pacer and is cancelled has taken no slot of the requests pacer.
#[tokio::test(start_paused = true)]
async fn a_request_cancelled_while_paced_for_tokens_takes_no_request_slot() {
    let mut config = config();
    config.adaptive.initial_burst = 1;
    let partition = Partition::new(&config, None);
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let far = Instant::now() + Duration::from_secs(60);
    let sent = Instant::now();
    let tickets = partition
        .acquire(1, far, Priority::Interactive, "t")
        .await
        .unwrap();
    // The answer: a success (slow start lets two more requests go) whose report shows the
    // tokens bucket empty, refilling 1000 a minute.
    let h = provider::header_map(&[
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "60s"),
    ]);
    partition.observe(
        tickets,
        Outcome::Success,
        None,
        Some(&h),
        Some(sent),
        &metrics,
    );
    let paced = tokio::time::timeout(
        Duration::from_millis(100),
        partition.acquire(500, far, Priority::Interactive, "t"),
    )
    .await;
    assert!(paced.is_err(), "500 tokens at 1000 a minute: still waiting");
    let pacers = partition.pacers.as_ref().unwrap();
    for _ in 0..2 {
        tokio::time::advance(Duration::from_millis(200)).await;
        let now = Instant::now();
        assert!(
            lock(pacers).requests.try_acquire(1.0, now).is_ok(),
            "slow start's two slots are both still there"
        );
    }
}

/// Priorities: twenty batch waiters queue for one token a second, then an
/// interactive one arrives: it passes all but the batch waiter holding the turn and the
/// one queued for it, so it is served third, not twenty-first; and the batch waiters all
/// get through (none starves).
#[tokio::test(start_paused = true)]
async fn interactive_waiters_pass_queued_batch_ones() {
    let mut config = config();
    config.rate_limit = LearnMode::Off;
    config.limits.rpm = NonZeroU32::new(60);
    config.limits.burst = NonZeroU32::new(1);
    let partition = Arc::new(Partition::new(&config, None));
    let deadline = Instant::now() + Duration::from_secs(600);
    partition
        .acquire(1, deadline, Priority::Batch, "t")
        .await
        .unwrap(); // empties the bucket
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut spawn = |name: String, priority: Priority| {
        let (p, order) = (Arc::clone(&partition), Arc::clone(&order));
        tasks.push(tokio::spawn(async move {
            p.acquire(1, deadline, priority, "t").await.unwrap();
            order.lock().unwrap().push(name);
        }));
    };
    for i in 0..20 {
        spawn(format!("batch-{i}"), Priority::Batch);
        tokio::task::yield_now().await;
    }
    spawn("interactive".into(), Priority::Interactive);
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap();
    let at = order.iter().position(|n| n == "interactive").unwrap();
    assert!(at <= 2, "interactive served {}th: {order:?}", at + 1);
    assert_eq!(order.len(), 21, "every batch waiter got through");
}

#[tokio::test(start_paused = true)]
async fn no_capacity_within_the_deadline_is_a_429_with_retry_after() {
    let mut config = config();
    config.rate_limit = LearnMode::Off;
    config.limits.rpm = NonZeroU32::new(60); // 1/s
    config.limits.burst = NonZeroU32::new(1);
    let partition = Partition::new(&config, None);
    let soon = Instant::now() + Duration::from_millis(200);
    partition
        .acquire(1, soon, Priority::Interactive, "t")
        .await
        .unwrap();
    let err = partition
        .acquire(1, soon, Priority::Interactive, "t")
        .await
        .unwrap_err();
    assert_eq!(err.status(), 429);
    assert!(err.retry_after().unwrap() > Duration::from_millis(500));
}

/// One 429 stops every send to the partition until its hint passes, and
/// requests already waiting do not walk into the empty bucket.
#[tokio::test(start_paused = true)]
async fn one_429_pauses_the_partition_until_its_hint_passes() {
    let partition = Arc::new(Partition::new(&config(), None));
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let far = Instant::now() + Duration::from_secs(60);
    let tickets = partition
        .acquire(1, far, Priority::Interactive, "t")
        .await
        .unwrap();
    let start = Instant::now();
    let h = provider::header_map(&[("retry-after-ms", "1500")]);
    let t = read(&h);
    partition.observe(
        tickets,
        Outcome::Throttled(429),
        Some(&t),
        Some(&h),
        None,
        &metrics,
    );
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let p = Arc::clone(&partition);
            tokio::spawn(async move {
                p.acquire(1, far, Priority::Interactive, "t").await.unwrap();
                Instant::now()
            })
        })
        .collect();
    for w in waiters {
        let sent = w.await.unwrap();
        assert!(
            sent >= start + Duration::from_millis(1500),
            "sent {:?} after the 429, inside its 1.5 s hint",
            sent - start
        );
    }
    // A deadline inside the pause is refused at once with the pause as Retry-After.
    let p = Partition::new(&config(), None);
    let tickets = p.acquire(1, far, Priority::Interactive, "t").await.unwrap();
    p.observe(
        tickets,
        Outcome::Throttled(429),
        Some(&t),
        Some(&h),
        None,
        &metrics,
    );
    let err = p
        .acquire(
            1,
            Instant::now() + Duration::from_millis(500),
            Priority::Interactive,
            "t",
        )
        .await
        .unwrap_err();
    assert_eq!(err.status(), 429);
    assert!(err.retry_after().unwrap() >= Duration::from_millis(1400));
}

/// Anthropic names its wait in whole seconds: `retry-after: 1` for a bucket its headers show
/// refilling in milliseconds. The refused request waits its second (it is its own: the report
/// says the bucket is full by then); the partition goes on at the headers' pace, and so would
/// every replica of a fleet, instead of all of them ending one pause together.
#[tokio::test(start_paused = true)]
async fn a_wait_rounded_to_seconds_is_the_requests_not_the_partitions() {
    let partition = Arc::new(Partition::new(&config(), None));
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let far = Instant::now() + Duration::from_secs(60);
    let wall = SystemTime::now;
    let reset = |ms| crate::simulate::headers::rfc3339_ceil(wall() + Duration::from_millis(ms));
    let report = |remaining: &str, at: &str, wait: Option<&str>| {
        let mut h = vec![
            ("anthropic-ratelimit-requests-limit", "50".to_owned()),
            (
                "anthropic-ratelimit-requests-remaining",
                remaining.to_owned(),
            ),
            ("anthropic-ratelimit-requests-reset", at.to_owned()),
        ];
        if let Some(w) = wait {
            h.push(("retry-after", w.to_owned()));
        }
        let pairs: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        provider::header_map(&pairs)
    };
    // A success teaches the headers' pace: 40 used, full again within the second (and the
    // bucket near empty: the 429 after it is this bucket's edge, no admission control's).
    let tickets = partition
        .acquire(1, far, Priority::Interactive, "t")
        .await
        .unwrap();
    let ok = report("10", &reset(200), None);
    partition.observe(tickets, Outcome::Success, None, Some(&ok), None, &metrics);
    let tickets = partition
        .acquire(1, far, Priority::Interactive, "t")
        .await
        .unwrap();
    let refused = report("0", &reset(300), Some("1"));
    let t = read(&refused);
    assert!(t.own_wait && t.named);
    let start = Instant::now();
    partition.observe(
        tickets,
        Outcome::Throttled(429),
        Some(&t),
        Some(&refused),
        None,
        &metrics,
    );
    partition
        .acquire(1, far, Priority::Interactive, "t")
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "the next request waited {:?}, the partition paused for the rounded second",
        start.elapsed()
    );
}

/// A 429 whose wait and reset are both rounded to whole seconds cannot tell an admission
/// control's queue from a bucket's edge: after clear headroom it is still the pacer's
/// evidence (corrals on one key meet the edge), where an exact wait would be the request's own.
#[tokio::test(start_paused = true)]
async fn a_rounded_wait_after_headroom_still_teaches_the_pacer() {
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let far = Instant::now() + Duration::from_secs(60);
    let wall = SystemTime::now;
    let reset = |ms| crate::simulate::headers::rfc3339_ceil(wall() + Duration::from_millis(ms));
    let metrics = &metrics;
    let seen = |exact: bool| async move {
        let partition = Partition::new(&config(), None);
        let ok = provider::header_map(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "40"),
            ("anthropic-ratelimit-requests-reset", &reset(200)),
        ]);
        let tickets = partition.acquire(1, far, Priority::Interactive, "t").await;
        partition.observe(
            tickets.unwrap(),
            Outcome::Success,
            None,
            Some(&ok),
            None,
            metrics,
        );
        let at = reset(300);
        let mut refused = vec![
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", at.as_str()),
            ("retry-after", "1"),
        ];
        if exact {
            refused.push(("retry-after-ms", "2000"));
        }
        let refused = provider::header_map(&refused);
        let t = read(&refused);
        assert!(t.own_wait);
        let tickets = partition.acquire(1, far, Priority::Interactive, "t").await;
        partition.observe(
            tickets.unwrap(),
            Outcome::Throttled(429),
            Some(&t),
            Some(&refused),
            None,
            metrics,
        );
        let pacers = partition.pacers.as_ref().expect("learning");
        let throttles = lock(pacers).requests.throttles;
        throttles
    };
    assert_eq!(seen(false).await, 1, "rounded: the bucket's edge");
    assert_eq!(
        seen(true).await,
        0,
        "exact, after headroom: the request's own"
    );
}

#[test]
fn a_429_is_blamed_on_the_bucket_its_reports_show_empty() {
    let r = |remaining: f64| {
        Some(Report {
            limit: 1000.0,
            remaining,
            reset: None,
            coarse: false,
            instant: false,
            past: Duration::ZERO,
        })
    };
    let t = Outcome::Throttled(429);
    use Answer::{RateLimited as Rl, RefusedElsewhere as El};
    assert_eq!(
        attribute(t, None, r(5.0), r(10.0), 100.0),
        (El, Rl),
        "tokens short"
    );
    assert_eq!(
        attribute(t, None, r(0.0), r(5000.0), 100.0),
        (Rl, El),
        "requests out"
    );
    assert_eq!(
        attribute(t, None, r(900.0), r(900.0), 10.0),
        (Rl, El),
        "unexplained"
    );
    assert_eq!(attribute(t, None, None, None, 10.0), (Rl, El), "no headers");
    assert_eq!(
        attribute(Outcome::Overloaded(529), None, None, None, 1.0),
        (Answer::Overloaded, Answer::Overloaded)
    );
    assert_eq!(
        attribute(Outcome::Success, None, None, None, 1.0),
        (Answer::Ok, Answer::Ok)
    );
}

/// A herd arrives before any token limit is known, so each request is estimated at nothing;
/// the first answer's report shows the tokens bucket empty (1,000 a 10 s reset: 100 a second).
/// A request still queued then is priced again when it may go, and waits for its 100 tokens
/// (about a second) instead of going uncharged past the bucket: four corrals on Redis drew
/// 74-90 rate 429s of 500 in `bench herd --scenario tokens` while requests queued at the
/// start went out at the request rate, five times the tokens bucket's.
#[tokio::test(start_paused = true)]
async fn a_request_queued_before_a_token_limit_was_learned_is_charged_when_it_goes() {
    let partition = Arc::new(Partition::new(&config(), None));
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let far = Instant::now() + Duration::from_secs(60);
    let mut first = Vec::new();
    for _ in 0..10 {
        let tickets = partition.acquire(0, far, Priority::Interactive, "t").await;
        first.push(tickets.unwrap().expect("paced"));
    }
    assert!(!partition.charges_tokens());
    let waiter = {
        let p = Arc::clone(&partition);
        tokio::spawn(async move {
            let price = || if p.charges_tokens() { 100 } else { 0 };
            let tickets = p
                .wait_for(&price, far, Priority::Interactive, "t")
                .await
                .unwrap()
                .expect("paced");
            (Instant::now(), tickets.charged_tokens())
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "slow start waits for an answer");
    let start = Instant::now();
    let h = provider::header_map(&[
        ("x-ratelimit-limit-requests", "1000"),
        ("x-ratelimit-remaining-requests", "990"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-tokens", "0"),
        ("x-ratelimit-reset-tokens", "10s"),
    ]);
    partition.observe(
        Some(first.remove(0)),
        Outcome::Success,
        None,
        Some(&h),
        Some(start - Duration::from_millis(50)),
        &metrics,
    );
    assert!(partition.charges_tokens(), "the token limit is learned");
    let (sent, charged) = waiter.await.unwrap();
    assert_eq!(charged, 100.0, "priced when it went");
    assert!(
        sent >= start + Duration::from_millis(500),
        "went {:?} after the report, before its tokens refilled",
        sent - start
    );
}

/// The attempt admitted with `tickets` answered 429 with headers `h` (read as `t`): whether
/// the refused request waits its hint on its own (an admission queue's refusal).
fn refused(
    partition: &Partition,
    tickets: Option<Tickets>,
    t: &Throttle,
    h: &HeaderMap,
    metrics: &crate::metrics::UpstreamMetrics,
) -> bool {
    partition.observe(
        tickets,
        Outcome::Throttled(429),
        Some(t),
        Some(h),
        Some(Instant::now()),
        metrics,
    )
}

/// A queue names its wait in seconds; a bucket naming one to the millisecond says when its
/// next token comes. The first send after a pause refused again reads as an admission
/// control's only after a wait of a second or more: after one of 50 ms it is a bucket whose
/// token another sender took (four corrals sharing nothing on a Gemini-like key read it as a
/// queue, stopped cutting, and drew 14,000 429s).
#[tokio::test(start_paused = true)]
async fn only_a_wait_of_seconds_names_an_admission_queue() {
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let refused_after_pause = |hint: (&'static str, &'static str)| {
        let metrics = &metrics;
        async move {
            let partition = Partition::new(&config(), None);
            let far = Instant::now() + Duration::from_secs(60);
            let h = provider::header_map(&[hint]);
            let t = read(&h);
            let throttled = |tickets| refused(&partition, tickets, &t, &h, metrics);
            let first = partition.acquire(1, far, Priority::Interactive, "t").await;
            assert!(!throttled(first.unwrap()), "a first refusal is a bucket's");
            tokio::time::sleep(t.hint.unwrap() + Duration::from_millis(1)).await;
            let after = partition.acquire(1, far, Priority::Interactive, "t").await;
            throttled(after.unwrap())
        }
    };
    assert!(refused_after_pause(("retry-after", "1")).await);
    assert!(!refused_after_pause(("retry-after-ms", "50")).await);
}

/// An admission queue refuses each request a few times whatever the rate: once its refusals
/// are found to be a queue's, the cut the first one made is forgotten and the ramp has its
/// window back. With the pace's burst instead (half a second of a pace cut from one refusal)
/// the ramp let 2.4 requests out per refusal's round trip, and as every answer was another
/// refusal it never grew: the `admission` world's herd got its first answers at 5 s, not 2 s.
#[tokio::test(start_paused = true)]
async fn an_admission_queue_found_gives_the_ramp_its_window_back() {
    let metrics = crate::metrics::Metrics::new().upstream("t");
    let partition = Arc::new(Partition::new(&config(), None));
    let far = Instant::now() + Duration::from_secs(60);
    let h = provider::header_map(&[("retry-after", "1")]);
    let t = read(&h);
    let refuse = {
        let (partition, metrics, h) = (Arc::clone(&partition), metrics.clone(), h.clone());
        move |tickets| refused(&partition, tickets, &t, &h, &metrics)
    };
    let first = partition.acquire(1, far, Priority::Interactive, "t").await;
    assert!(!refuse(first.unwrap()), "a first refusal is a bucket's");
    tokio::time::sleep(Duration::from_millis(1001)).await;
    let after = partition.acquire(1, far, Priority::Interactive, "t").await;
    assert!(
        refuse(after.unwrap()),
        "refused again after the pause: a queue"
    );
    // The queue refuses every request 5 ms after it is sent, long before its silence could
    // count as consent: only the ramp's window lets requests go.
    let start = Instant::now();
    let mut sent = 0;
    while let Ok(tickets) = tokio::time::timeout(
        (start + Duration::from_millis(100)).saturating_duration_since(Instant::now()),
        partition.acquire(1, far, Priority::Interactive, "t"),
    )
    .await
    {
        let refuse = refuse.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            refuse(tickets.unwrap());
        });
        sent += 1;
    }
    assert!(
        sent >= 60,
        "{sent} sent in 100 ms: the ramp's window of 10 per 5 ms round trip is back"
    );
}
