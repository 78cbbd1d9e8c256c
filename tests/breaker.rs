//! The circuit breaker end to end, in front of a mock upstream: a blip of concurrent 503s costs
//! each request at most one backoff plus one cool-down, its resends reach the upstream spread
//! out (whether the blip opened the breaker or not), 429s don't open it unless counted, and
//! the configurations it refuses are named by file, key and reason.
//!
//! The learned rate limiter is off (`rate_limit = "off"`) so its slow start doesn't pace the
//! burst: these tests time the breaker and retry alone.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

/// How many requests the blip fails, all at once.
const BLIP: usize = 20;
/// `retry.base` (= `retry.cap`): the first retry sleeps uniform(0, 1 s).
const BACKOFF: Duration = Duration::from_secs(1);
/// `breaker.cooldown`: long beside the slack, so a second cool-down (at least 1.5 s with
/// jitter, more as it doubles) cannot hide in it.
const COOLDOWN: Duration = Duration::from_secs(2);
/// On top of one backoff and one cool-down: up to 100 ms of jitter on the probes' wake-up, up
/// to 100 ms on each held request's release, two round trips to the mock, and over a second
/// for scheduling on a busy machine.
const SLACK: Duration = Duration::from_millis(1400);

/// An upstream that holds the first [`BLIP`] requests until all have arrived, answers them 503
/// together, and 200 to everything after. Records when each request arrived.
async fn blip_upstream() -> (MockUpstream, Arc<Mutex<Vec<Instant>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(BLIP));
    let seen = Arc::clone(&arrivals);
    let upstream = MockUpstream::start(move |_| {
        let (seen, count, barrier) = (Arc::clone(&seen), Arc::clone(&count), Arc::clone(&barrier));
        async move {
            seen.lock().unwrap().push(Instant::now());
            if count.fetch_add(1, Ordering::SeqCst) < BLIP {
                barrier.wait().await;
                json(503, serde_json::json!({"error": {"message": "blip"}}))
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    (upstream, arrivals)
}

fn blip_config(upstream: &MockUpstream, breaker: &str) -> String {
    let ms = |d: Duration| d.as_millis();
    one_upstream(
        upstream,
        &format!(
            "rate_limit = \"off\"\n\
             [upstream.retry]\nbase = \"{}ms\"\ncap = \"{}ms\"\n\
             [upstream.breaker]\ncooldown = \"{}ms\"\n{breaker}",
            ms(BACKOFF),
            ms(BACKOFF),
            ms(COOLDOWN)
        ),
    )
}

/// Fire [`BLIP`] requests at once; each one's status and duration.
async fn fire(corral: &Corral) -> Vec<(u16, Duration)> {
    let client = Arc::new(client());
    let tasks: Vec<_> = (0..BLIP)
        .map(|_| {
            let (client, url) = (Arc::clone(&client), corral.url("/v1/chat/completions"));
            tokio::spawn(async move {
                let start = Instant::now();
                let (parts, _) = send(&client, post(&url, r#"{"model":"m"}"#)).await;
                (parts.status.as_u16(), start.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// `corral_breaker_transitions_total{to}` for the mock upstream.
async fn transitions(corral: &Corral, to: &str) -> u64 {
    let req = Request::get(corral.url("/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, body) = send(&client(), req).await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.lines()
        .filter(|l| l.starts_with("corral_breaker_transitions_total{"))
        .filter(|l| l.contains(&format!("to=\"{to}\"")) && l.contains("upstream=\"mock\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

/// The resends (every arrival after the blip) are spread: they span at least 100 ms and no
/// 10 ms holds 8 of them (a herd would put all 20 within a millisecond or two).
fn assert_spread(arrivals: &[Instant]) {
    assert_eq!(arrivals.len(), 2 * BLIP, "one resend per request");
    let mut resends = arrivals[BLIP..].to_vec();
    resends.sort();
    let span = *resends.last().unwrap() - resends[0];
    assert!(
        span >= Duration::from_millis(100),
        "resends within {span:?}"
    );
    for w in resends.windows(8) {
        assert!(
            w[7] - w[0] >= Duration::from_millis(10),
            "8 resends within 10 ms: {:?}",
            resends.iter().map(|t| *t - resends[0]).collect::<Vec<_>>()
        );
    }
}

fn assert_each_within_one_backoff_and_one_cooldown(results: &[(u16, Duration)]) {
    let bound = BACKOFF + COOLDOWN + SLACK;
    for (status, took) in results {
        assert_eq!(*status, 200, "{results:?}");
        assert!(*took <= bound, "took {took:?} > {bound:?}: {results:?}");
    }
}

#[tokio::test]
async fn a_blip_of_503s_is_one_event_not_an_outage() {
    // Default `min_span` (2 s): 20 failures at one instant can't open the breaker.
    let (upstream, arrivals) = blip_upstream().await;
    let corral = Corral::start(&blip_config(&upstream, "")).await;
    let results = fire(&corral).await;
    assert_each_within_one_backoff_and_one_cooldown(&results);
    assert_eq!(
        transitions(&corral, "open").await,
        0,
        "the breaker stayed closed"
    );
    assert_spread(&arrivals.lock().unwrap());
}

#[tokio::test]
async fn a_blip_that_opens_the_breaker_releases_the_held_resends_spread() {
    // `min_span = "0s"`: the old, count-only judgement; the blip opens the breaker, the
    // resends are held, and leave after the probes at their own offsets.
    let (upstream, arrivals) = blip_upstream().await;
    let corral = Corral::start(&blip_config(
        &upstream,
        "min_span = \"0s\"\nmin_samples = 5\nhalf_open_probes = 2",
    ))
    .await;
    let results = fire(&corral).await;
    assert_each_within_one_backoff_and_one_cooldown(&results);
    assert_eq!(transitions(&corral, "open").await, 1, "opened once");
    assert_eq!(transitions(&corral, "closed").await, 1, "and closed");
    assert_spread(&arrivals.lock().unwrap());
}

/// An upstream that answers every request with `status`.
async fn always(status: u16) -> MockUpstream {
    MockUpstream::start(move |_| async move {
        json(status, serde_json::json!({"error": {"message": "no"}}))
    })
    .await
}

/// Send `n` requests one after another, 20 ms apart; their statuses.
async fn trickle(corral: &Corral, n: usize) -> Vec<u16> {
    let client = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let (parts, _) = send(&client, post(&corral.url("/v1/x"), "{}")).await;
        out.push(parts.status.as_u16());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    out
}

const TRICKLE: &str =
    "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 0\nmax_throttle_retries = 0\n\
    [upstream.breaker]\nmin_span = \"100ms\"\nmin_samples = 5\non_open = \"reject\"\n";

#[tokio::test]
async fn throttles_dont_open_the_breaker_unless_counted() {
    let upstream = always(429).await;
    let corral = Corral::start(&one_upstream(&upstream, TRICKLE)).await;
    let statuses = trickle(&corral, 15).await;
    assert!(statuses.iter().all(|s| *s == 429), "{statuses:?}");
    assert_eq!(transitions(&corral, "open").await, 0);
    assert_eq!(upstream.calls(), 15, "every request reached the upstream");

    let counted = Corral::start(&one_upstream(
        &upstream,
        &format!("{TRICKLE}count_throttles = true\n"),
    ))
    .await;
    let statuses = trickle(&counted, 15).await;
    assert_eq!(transitions(&counted, "open").await, 1);
    assert_eq!(
        statuses.last(),
        Some(&503),
        "rejected while open: {statuses:?}"
    );
}

#[tokio::test]
async fn overload_529s_open_the_breaker() {
    let upstream = always(529).await;
    let corral = Corral::start(&one_upstream(&upstream, TRICKLE)).await;
    let statuses = trickle(&corral, 15).await;
    assert_eq!(transitions(&corral, "open").await, 1);
    assert_eq!(statuses.last(), Some(&503), "{statuses:?}");
}

fn config_error(breaker: &str, limits: &str) -> String {
    let toml = format!(
        "[[upstream]]\nname = \"a\"\nroute = \"/v1\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
         [upstream.limits]\n{limits}\n[upstream.breaker]\n{breaker}\n"
    );
    corral::config::load_str("corral.toml", &toml)
        .expect_err("refused")
        .to_string()
}

#[test]
fn counting_throttles_per_upstream_is_refused_with_per_key_buckets() {
    let err = config_error("count_throttles = true", "partition = \"api_key\"");
    assert!(
        err.starts_with("corral.toml:") && err.contains("upstream[0].breaker.count_throttles"),
        "{err}"
    );
    assert!(err.contains("partition = \"api_key\""), "{err}");
    // Either alone is fine.
    let ok = |breaker: &str, limits: &str| {
        let toml = format!(
            "[[upstream]]\nname = \"a\"\nroute = \"/v1\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
             [upstream.limits]\n{limits}\n[upstream.breaker]\n{breaker}\n"
        );
        corral::config::load_str("corral.toml", &toml).is_ok()
    };
    assert!(ok("count_throttles = true", ""));
    assert!(ok("", "partition = \"api_key\""));
}

#[test]
fn a_zero_release_ramp_is_refused() {
    let err = config_error("release_ramp = \"0s\"", "");
    assert!(
        err.contains("upstream[0].breaker.release_ramp") && err.contains("above zero"),
        "{err}"
    );
}

/// What [`switchable`] answers: a 503, a 200, a 503 and a 200 in turn, or nothing for 30 s.
const FAIL: u8 = 0;
const OK: u8 = 1;
const ALTERNATE: u8 = 2;
const HANG: u8 = 3;

/// An upstream whose answer the test switches as it goes.
async fn switchable() -> (MockUpstream, Arc<std::sync::atomic::AtomicU8>) {
    let mode = Arc::new(std::sync::atomic::AtomicU8::new(FAIL));
    let turn = Arc::new(AtomicUsize::new(0));
    let m = Arc::clone(&mode);
    let upstream = MockUpstream::start(move |_| {
        let (mode, turn) = (m.load(Ordering::SeqCst), Arc::clone(&turn));
        async move {
            let fail = match mode {
                FAIL => true,
                ALTERNATE => turn.fetch_add(1, Ordering::SeqCst) % 2 == 0,
                HANG => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    false
                }
                _ => false,
            };
            if fail {
                json(503, serde_json::json!({"error": {"message": "down"}}))
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    (upstream, mode)
}

/// A request sent on a raw connection that is closed, unanswered, once `upstream` has seen
/// `calls` requests.
async fn send_and_leave(corral: &Corral, upstream: &MockUpstream, calls: usize) {
    use tokio::io::AsyncWriteExt;
    let addr = corral
        .url("/")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = "{}";
    let head = format!(
        "POST /v1/x HTTP/1.1\r\nhost: corral\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || upstream.calls() >= calls).await,
        "the request never reached the upstream"
    );
    drop(stream);
}

/// The mock upstream's breaker.
fn breaker(corral: &Corral) -> Arc<corral::stack::breaker::BreakerShared> {
    let upstream = corral.app.upstream("mock").expect("the mock upstream");
    Arc::clone(upstream.state.breaker.as_ref().expect("a breaker"))
}

/// Wait until the open breaker's cool-down (jittered to 75-100% of it) has ended.
async fn cooled_down(corral: &Corral) {
    use corral::stack::breaker::state::Phase;
    match breaker(corral).phase() {
        Phase::Open { until } => tokio::time::sleep_until(until).await,
        other => panic!("the breaker is not open: {other:?}"),
    }
}

/// docs/design.md, the breaker (`on_open = "reject"`) over HTTP, its whole lifecycle: failures open
/// it; while open corral answers 503 itself (`x-corral-error`, `retry-after`) and sends nothing
/// upstream; after the cool-down two probes go out, and one failing of two (with `close_error_rate
/// = 0`) opens it again; two probes whose clients disconnect give their slots back, so the next
/// requests probe, succeed and close it.
#[tokio::test]
async fn the_breakers_lifecycle_over_http_including_a_probe_whose_client_leaves() {
    let (upstream, mode) = switchable().await;
    let config = format!(
        "{TRICKLE}cooldown = \"300ms\"\nmax_cooldown = \"300ms\"\nhalf_open_probes = 2\nclose_error_rate = 0.0\n"
    );
    let corral = Corral::start(&one_upstream(&upstream, &config)).await;
    let c = client();
    let url = corral.url("/v1/x");

    // 1. Failures open it; then corral answers for the upstream.
    let mut rejected = None;
    for _ in 0..40 {
        let (parts, _) = send(&c, post(&url, "{}")).await;
        if parts
            .headers
            .contains_key(corral::error::CORRAL_ERROR_HEADER)
        {
            rejected = Some(parts);
            break;
        }
        assert_eq!(parts.status, 503, "the upstream's own 503");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rejected = rejected.expect("40 failures in a row did not open the breaker");
    assert_eq!(rejected.status, 503);
    assert!(
        rejected.headers.contains_key("retry-after"),
        "{:?}",
        rejected.headers
    );
    assert_eq!(transitions(&corral, "open").await, 1);
    let calls = upstream.calls();
    let (parts, _) = send(&c, post(&url, "{}")).await;
    assert_eq!(parts.status, 503);
    assert_eq!(
        upstream.calls(),
        calls,
        "a rejected request reached the upstream"
    );

    // 2. After the cool-down, two probes; one fails: open again.
    cooled_down(&corral).await;
    mode.store(ALTERNATE, Ordering::SeqCst);
    let (a, b) = tokio::join!(send(&c, post(&url, "{}")), send(&c, post(&url, "{}")));
    let mut probes = [a.0.status.as_u16(), b.0.status.as_u16()];
    probes.sort();
    assert_eq!(probes, [200, 503], "one probe of two failed");
    assert_eq!(upstream.calls(), calls + 2, "two probes went upstream");
    assert_eq!(
        transitions(&corral, "open").await,
        2,
        "a failed probe reopened it"
    );
    let (parts, _) = send(&c, post(&url, "{}")).await;
    assert!(parts
        .headers
        .contains_key(corral::error::CORRAL_ERROR_HEADER));

    // 3. Two probes whose clients leave once both reached the (hanging) upstream.
    cooled_down(&corral).await;
    mode.store(HANG, Ordering::SeqCst);
    tokio::join!(
        send_and_leave(&corral, &upstream, calls + 4),
        send_and_leave(&corral, &upstream, calls + 4)
    );
    assert_eq!(upstream.calls(), calls + 4, "both probes went upstream");
    // Their slots come back: the next two requests probe, succeed, and close the breaker.
    mode.store(OK, Ordering::SeqCst);
    let released = || {
        matches!(
            breaker(&corral).phase(),
            corral::stack::breaker::state::Phase::HalfOpen { admitted: 0, .. }
        )
    };
    assert!(
        eventually(Duration::from_secs(10), released).await,
        "the leaving probes' slots did not come back: {:?}",
        breaker(&corral).phase()
    );
    let (a, b) = tokio::join!(send(&c, post(&url, "{}")), send(&c, post(&url, "{}")));
    assert_eq!(
        (a.0.status.as_u16(), b.0.status.as_u16()),
        (200, 200),
        "probes after the disconnects: {:?} {:?}",
        a.0.headers,
        b.0.headers
    );
    assert_eq!(transitions(&corral, "closed").await, 1);
    let statuses = trickle(&corral, 5).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
}
