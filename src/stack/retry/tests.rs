//! Retry in virtual time against a scripted inner service.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Response, StatusCode};
use http_body_util::BodyExt;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::time::Instant;
use tower::{Layer, ServiceExt};

use super::*;
use crate::config::{HumanDuration, Jitter};
use crate::stack::layer::Tower;

/// Answers from a script, recording when each attempt arrived.
#[derive(Clone)]
struct Script {
    answers: Arc<Mutex<VecDeque<Response<Body>>>>,
    times: Arc<Mutex<Vec<Instant>>>,
    calls: Arc<AtomicUsize>,
}

fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Response<Body> {
    let mut b = Response::builder().status(status);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(crate::body::full(body.to_owned())).unwrap()
}

impl Script {
    fn new(answers: Vec<Response<Body>>) -> Self {
        Self {
            answers: Arc::new(Mutex::new(answers.into())),
            times: Arc::default(),
            calls: Arc::default(),
        }
    }
    fn service(&self) -> impl crate::stack::layer::Next + Clone {
        let s = self.clone();
        Tower(tower::service_fn(move |_req: ProxyRequest| {
            let s = s.clone();
            async move {
                s.calls.fetch_add(1, Ordering::SeqCst);
                s.times.lock().unwrap().push(Instant::now());
                let next = s.answers.lock().unwrap().pop_front();
                Ok::<_, ProxyError>(next.unwrap_or_else(|| answer(200, &[], "ok")))
            }
        }))
    }
}

fn config(jitter: Jitter) -> RetryConfig {
    RetryConfig {
        jitter,
        floor_jitter: HumanDuration::from_millis(500),
        ..RetryConfig::default()
    }
}

fn request(deadline: Duration) -> ProxyRequest {
    ProxyRequest::for_test("http://127.0.0.1/v1/chat/completions", deadline)
}

fn retry(config: &RetryConfig, seed: u64) -> RetryLayer {
    let m = crate::metrics::Metrics::new().upstream("t");
    RetryLayer::new(RetryShared::with_rng(
        config,
        m,
        SmallRng::seed_from_u64(seed),
    ))
}

#[tokio::test(start_paused = true)]
async fn a_400_is_returned_on_the_first_attempt() {
    let script = Script::new(vec![answer(400, &[], r#"{"error":{"message":"bad"}}"#)]);
    let svc = retry(&config(Jitter::Full), 1).layer(script.service());
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(script.calls.load(Ordering::SeqCst), 1);
    assert!(response.headers().get("x-should-retry").is_none());
}

/// Retry over the rate limit layer (learning off, no ceilings): the pause a 429 sets is what
/// holds a throttled retry, as in the real stack.
fn retry_over_rate_limit<S: crate::stack::layer::Next + Clone>(
    config: &RetryConfig,
    seed: u64,
    inner: S,
) -> crate::stack::layer::Wrapped<
    RetryShared,
    crate::stack::layer::Wrapped<crate::stack::rate_limit::RateLimitShared, S>,
> {
    let mut upstream = crate::config::UpstreamConfig::new(
        "t",
        "/v1",
        crate::config::types::parse_base_url("http://127.0.0.1:1").unwrap(),
    );
    upstream.rate_limit = crate::config::LearnMode::Off;
    upstream.retry = config.clone();
    let m = crate::metrics::Metrics::new().upstream("t");
    let rate_limit = crate::stack::rate_limit::RateLimitLayer::new(
        crate::stack::rate_limit::RateLimitShared::new(&upstream, m, None, Default::default()),
    );
    retry(config, seed).layer(rate_limit.layer(inner))
}

/// How long each of `seeds` requests waited before its second attempt, its first answered
/// `status` with `retry-after: hint` (through the rate limiter for a 429, whose pause holds a
/// throttled retry), sorted.
async fn waits_after_hint(status: u16, hint: &str, seeds: u64) -> Vec<Duration> {
    let mut waits = Vec::new();
    for seed in 0..seeds {
        let script = Script::new(vec![answer(status, &[("retry-after", hint)], "{}")]);
        let config = config(Jitter::Full);
        let svc = if status == 429 {
            tower::util::BoxCloneSyncService::new(retry_over_rate_limit(
                &config,
                seed,
                script.service(),
            ))
        } else {
            tower::util::BoxCloneSyncService::new(retry(&config, seed).layer(script.service()))
        };
        let start = Instant::now();
        let response = svc
            .oneshot(request(Duration::from_secs(600)))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        waits.push(script.times.lock().unwrap()[1] - start);
    }
    waits.sort();
    waits
}

/// A short hint gets a jitter of at most a fiftieth of itself: `retry-after: 1` is waited 1
/// to 1.02 s, not up to 1.5 s (`floor_jitter` is 500 ms), and still spread.
#[tokio::test(start_paused = true)]
async fn a_short_hint_is_jittered_by_a_fiftieth_of_itself_at_most() {
    let waits = waits_after_hint(503, "1", 40).await;
    let (first, last) = (waits[0], waits[waits.len() - 1]);
    assert!(first >= Duration::from_secs(1), "{first:?}: under the hint");
    // tokio timers round up to the millisecond.
    assert!(
        last <= Duration::from_millis(1_021),
        "{last:?}: over a fiftieth on top"
    );
    assert!(
        last - first >= Duration::from_millis(10),
        "spread only {:?}",
        last - first
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_a_floor_with_jitter_on_top() {
    // 80 requests told "retry-after: 30" must not all return at second 30.
    let mut returns = waits_after_hint(429, "30", 80).await;
    let (first, last) = (returns[0], returns[returns.len() - 1]);
    assert!(
        first >= Duration::from_secs(30),
        "sent again after {first:?}, under the server's floor"
    );
    // tokio timers round up to the millisecond.
    assert!(
        last <= Duration::from_millis(30_501),
        "sent again after {last:?}, more than floor + floor_jitter"
    );
    let spread = last - first;
    returns.dedup();
    // 80 draws over 500 whole milliseconds give about 74 distinct values (a few collide by
    // chance); a synchronized return would give 1.
    assert!(
        returns.len() > 50,
        "returns are spread, not synchronized: {} distinct",
        returns.len()
    );
    assert!(
        spread > Duration::from_millis(300),
        "spread over {spread:?}"
    );
}

/// Throttles wait, failures are budgeted. A run of 429s longer than
/// `max_retries` and than the budget is still retried, through the rate limiter, to success.
#[tokio::test(start_paused = true)]
async fn throttles_are_retried_beyond_max_retries_and_the_budget() {
    let cfg = RetryConfig {
        max_retries: 2,
        budget_min_per_second: 1,
        budget_ratio: 0.0,
        ..config(Jitter::Full)
    };
    let mut answers: Vec<_> = (0..12)
        .map(|_| answer(429, &[("retry-after-ms", "100")], "{}"))
        .collect();
    answers.push(answer(200, &[], "ok"));
    let script = Script::new(answers);
    let svc = retry_over_rate_limit(&cfg, 2, script.service());
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.calls.load(Ordering::SeqCst), 13);
    let times = script.times.lock().unwrap().clone();
    for pair in times.windows(2) {
        assert!(
            pair[1] - pair[0] >= Duration::from_millis(100),
            "each retry waited out the 429's pause: {:?}",
            pair[1] - pair[0]
        );
    }
    // ...while `max_throttle_retries` stays the last guard.
    let cfg = RetryConfig {
        max_throttle_retries: 3,
        ..cfg
    };
    let script = Script::new(
        (0..12)
            .map(|_| answer(429, &[("retry-after-ms", "100")], "{}"))
            .collect(),
    );
    let svc = retry_over_rate_limit(&cfg, 3, script.service());
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(script.calls.load(Ordering::SeqCst), 4);
    assert_eq!(response.headers()["x-should-retry"], "false");
}

/// A throttle whose next permitted send the deadline cannot cover goes back to the client with
/// the upstream's answer, marked, and corral's Retry-After when the upstream gave none.
#[tokio::test(start_paused = true)]
async fn a_throttle_the_deadline_cannot_wait_for_goes_back_marked_with_retry_after() {
    let script = Script::new(vec![
        answer(429, &[("retry-after-ms", "100")], "{}"),
        answer(
            429,
            &[
                ("x-ratelimit-reset-requests", "5s"),
                ("x-ratelimit-remaining-requests", "0"),
            ],
            "{}",
        ),
    ]);
    let svc = retry_over_rate_limit(&config(Jitter::Full), 4, script.service());
    let start = Instant::now();
    let response = svc.oneshot(request(Duration::from_secs(2))).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "gave up before the deadline"
    );
    assert_eq!(script.calls.load(Ordering::SeqCst), 2);
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["x-should-retry"], "false");
    assert_eq!(
        response.headers()["retry-after"],
        "5",
        "corral's Retry-After, read from the exhausted bucket's reset"
    );
    assert_eq!(
        response.headers()["x-ratelimit-reset-requests"],
        "5s",
        "the upstream's answer"
    );
}

#[tokio::test(start_paused = true)]
async fn gives_up_after_max_retries_passing_the_last_answer_marked() {
    let storm: Vec<_> = (0..10)
        .map(|i| answer(503, &[("x-attempt", &i.to_string())], "busy"))
        .collect();
    let script = Script::new(storm);
    let cfg = RetryConfig {
        max_retries: 3,
        ..config(Jitter::Full)
    };
    let svc = retry(&cfg, 2).layer(script.service());
    let response = svc
        .oneshot(request(Duration::from_secs(600)))
        .await
        .unwrap();
    assert_eq!(
        script.calls.load(Ordering::SeqCst),
        4,
        "first attempt plus 3 retries"
    );
    assert_eq!(response.status(), 503);
    assert_eq!(
        response.headers()["x-attempt"],
        "3",
        "the upstream's last answer"
    );
    assert_eq!(response.headers()["x-should-retry"], "false");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"busy", "the upstream's body, untouched");
}

#[tokio::test(start_paused = true)]
async fn a_storm_longer_than_the_deadline_ends_within_it() {
    let script = Script::new((0..1000).map(|_| answer(503, &[], "down")).collect());
    let cfg = RetryConfig {
        max_retries: 1000,
        ..config(Jitter::Full)
    };
    let svc = retry(&cfg, 3).layer(script.service());
    let start = Instant::now();
    let response = svc.oneshot(request(Duration::from_secs(20))).await.unwrap();
    assert!(
        start.elapsed() <= Duration::from_secs(20),
        "ended after {:?}",
        start.elapsed()
    );
    assert_eq!(response.status(), 503);
}

#[tokio::test(start_paused = true)]
async fn a_hint_beyond_the_deadline_passes_the_429_through_marked() {
    let script = Script::new(vec![answer(429, &[("retry-after", "120")], "slow down")]);
    let svc = retry(&config(Jitter::Full), 4).layer(script.service());
    let start = Instant::now();
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(start.elapsed(), Duration::ZERO, "gave up at once");
    assert_eq!(script.calls.load(Ordering::SeqCst), 1);
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "120");
    assert_eq!(
        response.headers()["x-should-retry"],
        "false",
        "the client must not retry a throttle its deadline cannot wait for"
    );
}

#[tokio::test(start_paused = true)]
async fn permanent_429_is_not_retried() {
    let quota = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
    let script = Script::new(vec![answer(429, &[("retry-after", "1")], quota)]);
    let svc = retry(&config(Jitter::Full), 5).layer(script.service());
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(script.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        response.headers()["x-should-retry"],
        "false",
        "the SDKs would retry a 429 twice more: no wait cures this one"
    );
    let body = response.into_body().collect().await;
    assert_eq!(body.unwrap().to_bytes(), quota.as_bytes(), "body untouched");
}

/// `n` requests at once against an upstream that answers `status` to everything: each gets
/// `status` back; returns the attempts the upstream saw.
async fn burst(cfg: &RetryConfig, seed: u64, status: u16, n: usize) -> usize {
    let script = Script::new((0..10_000).map(|_| answer(status, &[], "{}")).collect());
    let svc = retry(cfg, seed).layer(script.service());
    let handles: Vec<_> = (0..n)
        .map(|_| tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(600)))))
        .collect();
    for h in handles {
        assert_eq!(h.await.unwrap().unwrap().status(), status);
    }
    script.calls.load(Ordering::SeqCst)
}

/// Bare 429s (no wait named) are retried through the rate limiter, which paces them; past the
/// first few of one request they spend the failure budget too, so a pacer that fails to pace
/// (none here: the service answers at once) cannot turn each request into 50 attempts.
#[tokio::test(start_paused = true)]
async fn bare_throttles_past_the_first_few_spend_the_budget() {
    let cfg = RetryConfig {
        budget_min_per_second: 1,
        budget_ratio: 0.0,
        ..config(Jitter::Full)
    };
    let calls = burst(&cfg, 7, 429, 20).await;
    // Three each free, then the budget's reserve (1 a second over 10 s): not 20 x 51.
    assert!(calls <= 20 * 4 + 15, "{calls} attempts");
    assert!(
        calls >= 20 * 4,
        "{calls} attempts: the first three retries are free"
    );
}

#[tokio::test(start_paused = true)]
async fn the_budget_caps_retries_during_an_outage() {
    // ratio 0.2 and 1 retry per second of reserve over 10 s: 100 failing requests in one burst
    // may add at most about 0.2 * 100 + 10 retries, and over the two waits of 16 s the unpaid
    // ones make for health, the reserve's one a second and a probe every 500 ms: not
    // 100 * max_retries.
    let cfg = RetryConfig {
        budget_min_per_second: 1,
        budget_ratio: 0.2,
        max_retries: 6,
        ..config(Jitter::Full)
    };
    let calls = burst(&cfg, 6, 503, 100).await;
    assert!(
        calls <= 100 + 20 + 10 + 32 + 64 + 5,
        "{calls} attempts: the budget let too many retries through"
    );
    assert!(calls > 100, "some retries were allowed");
}

/// An outage shorter than the SDKs' own retries ride out (503s for 2 s, then answers): the
/// retries the budget cannot pay wait, sending nothing, until the upstream serves again, so
/// every request is served, and the outage still sees only what the budget pays for.
#[tokio::test(start_paused = true)]
async fn a_short_outage_loses_no_request_and_the_budget_still_bounds_its_load() {
    let cfg = RetryConfig {
        budget_min_per_second: 1,
        budget_ratio: 0.2,
        ..config(Jitter::Full)
    };
    let start = Instant::now();
    let (during, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (seen_during, seen) = (Arc::clone(&during), Arc::clone(&calls));
    let server = Tower(tower::service_fn(move |_req: ProxyRequest| {
        seen.fetch_add(1, Ordering::SeqCst);
        let down = start.elapsed() < Duration::from_secs(2);
        if down {
            seen_during.fetch_add(1, Ordering::SeqCst);
        }
        let status = if down { 503 } else { 200 };
        async move { Ok::<_, ProxyError>(answer(status, &[], "{}")) }
    }));
    let svc = retry(&cfg, 11).layer(server);
    let handles: Vec<_> = (0..100)
        .map(|_| tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(600)))))
        .collect();
    let mut served = 0;
    for h in handles {
        served += usize::from(h.await.unwrap().unwrap().status() == 200);
    }
    assert_eq!(served, 100, "served after the outage");
    // The first attempts, 0.2 x 100 paid retries, the reserve (one a second over 10 s) and a
    // probe every 500 ms.
    let during = during.load(Ordering::SeqCst);
    assert!(
        during <= 100 + 20 + 10 + 4 + 2,
        "{during} attempts in the outage"
    );
    assert!(
        calls.load(Ordering::SeqCst) <= 300,
        "at most the SDKs' three each"
    );
}

/// A server with `held` places (served in `service`) that answers 503 at once, no hint, when
/// they are all taken: SGLang with `--max-queued-requests`. Returns the attempts it saw.
fn bounded_queue(held: usize, service: Duration) -> (impl Next + Clone, Arc<AtomicUsize>) {
    let (taken, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let seen = Arc::clone(&calls);
    let svc = Tower(tower::service_fn(move |_req: ProxyRequest| {
        seen.fetch_add(1, Ordering::SeqCst);
        let taken = Arc::clone(&taken);
        async move {
            if taken.fetch_add(1, Ordering::SeqCst) >= held {
                taken.fetch_sub(1, Ordering::SeqCst);
                return Ok::<_, ProxyError>(answer(503, &[], r#"{"message":"queue full"}"#));
            }
            tokio::time::sleep(service).await;
            taken.fetch_sub(1, Ordering::SeqCst);
            Ok(answer(200, &[], "ok"))
        }
    }));
    (svc, calls)
}

/// Retry over the per-try timeout layer, which counts the attempts on the wire in the retry
/// layer's room, as the stack has them.
fn counted<S: Next + Clone>(
    cfg: &RetryConfig,
    seed: u64,
    server: S,
) -> crate::stack::layer::Wrapped<
    RetryShared,
    crate::stack::layer::Wrapped<crate::stack::timeout::TryTimeout, S>,
> {
    let m = crate::metrics::Metrics::new().upstream("t");
    let shared = RetryShared::with_rng(cfg, m.clone(), SmallRng::seed_from_u64(seed));
    let timeout = crate::stack::timeout::layer(Duration::from_secs(300), m, shared.room());
    RetryLayer::new(shared).layer(timeout.layer(server))
}

/// A full queue is not an outage: 60 requests at once against 4 places of 500 ms, with a
/// budget of about 22 retries, all succeed, each refused one retried when a place frees (not
/// on a timer, so no refusal is wasted), in about the time the places take. Before, the budget
/// ran out in the first instant and most were given up with `x-should-retry: false`.
#[tokio::test(start_paused = true)]
async fn a_full_queue_s_refusals_wait_for_a_place_and_spend_no_budget() {
    let cfg = RetryConfig {
        budget_min_per_second: 1,
        budget_ratio: 0.2,
        ..config(Jitter::Full)
    };
    let (server, calls) = bounded_queue(4, Duration::from_millis(500));
    let svc = counted(&cfg, 3, server);
    let start = Instant::now();
    let handles: Vec<_> = (0..60)
        .map(|_| tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(600)))))
        .collect();
    for h in handles {
        assert_eq!(h.await.unwrap().unwrap().status(), 200);
    }
    // 15 rounds of 4 places; the bound is 7.5 s.
    assert!(
        start.elapsed() <= Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let calls = calls.load(Ordering::SeqCst);
    assert!(
        calls <= 60 + 56 + 4,
        "{calls} attempts: refusals retried before a place freed"
    );
}

/// In an outage (every attempt refused at once, nothing served) a refusal waits no longer
/// than the failure path would have slept before it, and the budget bounds the retries as
/// before (with the reserve's one a second and a probe every 500 ms over the waits for
/// health): nobody waits for a place that never frees.
#[tokio::test(start_paused = true)]
async fn an_outage_s_refusals_do_not_wait_for_a_place_beyond_the_backoff() {
    let cfg = RetryConfig {
        budget_min_per_second: 1,
        budget_ratio: 0.2,
        ..config(Jitter::Full)
    };
    let (server, calls) = bounded_queue(0, Duration::ZERO);
    let svc = counted(&cfg, 5, server);
    let start = Instant::now();
    let handles: Vec<_> = (0..50)
        .map(|_| tokio::spawn(svc.clone().oneshot(request(Duration::from_secs(600)))))
        .collect();
    for h in handles {
        assert_eq!(h.await.unwrap().unwrap().status(), 503);
    }
    let calls = calls.load(Ordering::SeqCst);
    assert!(
        calls <= 50 + 10 + 10 + 32 + 64 + 5,
        "{calls} attempts: the budget let too many through"
    );
    // Six backoffs of at most 30 s, not the 600 s deadline.
    assert!(
        start.elapsed() < Duration::from_secs(200),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn connection_errors_are_retried() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let flaky = tower::service_fn(move |_req: ProxyRequest| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                Err(ProxyError::UpstreamConnect {
                    upstream: "t".into(),
                    reason: "refused".into(),
                })
            } else {
                Ok(answer(200, &[], "ok"))
            }
        }
    });
    let svc = retry(&config(Jitter::Full), 7).layer(Tower(flaky));
    assert_eq!(
        svc.oneshot(request(Duration::from_secs(60)))
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_poisoned_rng_lock_still_retries() {
    let script = Script::new(vec![answer(503, &[], "{}")]);
    let shared = RetryShared::with_rng(
        &config(Jitter::Full),
        crate::metrics::Metrics::new().upstream("t"),
        SmallRng::seed_from_u64(3),
    );
    crate::sync::poison(&shared.rng);
    let svc = RetryLayer::new(shared).layer(script.service());
    let response = svc.oneshot(request(Duration::from_secs(60))).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(script.calls.load(Ordering::SeqCst), 2);
}

/// The deadline that ends an attempt under way (the timeout layer's `DeadlineExceeded`) after
/// an earlier answer gives up as `deadline`, as one that ends the wait between attempts does:
/// the client gets the earlier answer, marked.
#[tokio::test(start_paused = true)]
async fn a_deadline_that_ends_an_attempt_under_way_gives_up_as_deadline() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    let cut = tower::service_fn(move |_req: ProxyRequest| {
        let n = c.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                Ok(answer(503, &[], "busy"))
            } else {
                Err(ProxyError::DeadlineExceeded)
            }
        }
    });
    let m = crate::metrics::Metrics::new();
    let layer = RetryLayer::new(RetryShared::with_rng(
        &config(Jitter::Full),
        m.upstream("t"),
        SmallRng::seed_from_u64(3),
    ));
    let response = layer
        .layer(Tower(cut))
        .oneshot(request(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["x-should-retry"], "false");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let text = m.render();
    let line = r#"corral_retry_gave_up_total{upstream="t",why="deadline"} 1"#;
    assert!(text.contains(line), "no `{line}` in\n{text}");
}

/// A request's failures escalate its backoff only while the upstream serves nobody: with other
/// requests served between them (one arrival in five refused, say), each retry waits `base`
/// again (jitter off, so the waits are exact); in an outage they double as before.
#[tokio::test(start_paused = true)]
async fn backoff_escalates_only_while_nobody_is_served() {
    let cfg = RetryConfig {
        max_retries: 6,
        ..config(Jitter::None)
    };
    let gaps = |times: &[Instant]| -> Vec<u64> {
        times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_millis() as u64)
            .collect()
    };
    let refusals = || Script::new((0..3).map(|_| answer(503, &[], "busy")).collect());

    // An outage: nothing else is served, the waits double.
    let alone = refusals();
    let layer = retry(&cfg, 1);
    let response = layer
        .layer(alone.service())
        .oneshot(request(Duration::from_secs(600)))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(gaps(&alone.times.lock().unwrap()), [500, 1000, 2000]);

    // The same refusals while another request is served every 400 ms: base each time.
    let unlucky = refusals();
    let layer = retry(&cfg, 1);
    let task = tokio::spawn(
        layer
            .layer(unlucky.service())
            .oneshot(request(Duration::from_secs(600))),
    );
    let others = Script::new(Vec::new());
    let served = layer.layer(others.service());
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let ok = served
            .clone()
            .oneshot(request(Duration::from_secs(600)))
            .await
            .unwrap();
        assert_eq!(ok.status(), 200);
    }
    assert_eq!(task.await.unwrap().unwrap().status(), 200);
    assert_eq!(gaps(&unlucky.times.lock().unwrap()), [500, 500, 500]);
}
