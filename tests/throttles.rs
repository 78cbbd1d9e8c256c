//! What a 429 says decides what it may change, checked over real sockets through
//! `server::run`: an overload is retried like a 503 and moves no pace; a storm of refusals the
//! sender did not cause costs its hints and leaves no crawl behind; two models on one key are
//! two partitions; a request larger than any token bucket is not held. Timing bounds are
//! generous (a loaded two-core machine) and stated per assert.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;
use tokio::time::Instant;

/// OpenAI's documented overload answer: no wait named, healthy `x-ratelimit-*`.
fn overloaded() -> http::Response<corral::body::Body> {
    let mut r = json(
        429,
        serde_json::json!({"error": {
            "message": "The engine is currently overloaded, please try again later",
            "type": "server_error", "param": null, "code": null}}),
    );
    healthy(&mut r);
    r
}

fn healthy(r: &mut http::Response<corral::body::Body>) {
    with_headers(
        r,
        &[
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-remaining-requests", "9990"),
            ("x-ratelimit-reset-requests", "6ms"),
        ],
    );
}

fn with_headers(r: &mut http::Response<corral::body::Body>, pairs: &[(&'static str, &str)]) {
    for (k, v) in pairs {
        r.headers_mut().insert(*k, v.parse().unwrap());
    }
}

/// A token report of `limit` with 1000 used, resetting in 6 s.
fn tokens_reported(r: &mut http::Response<corral::body::Body>, limit: u32) {
    let (limit, remaining) = (limit.to_string(), (limit - 1000).to_string());
    with_headers(
        r,
        &[
            ("x-ratelimit-limit-tokens", &limit),
            ("x-ratelimit-remaining-tokens", &remaining),
            ("x-ratelimit-reset-tokens", "6s"),
        ],
    );
}

/// Attempts seen per request body (a retry carries the same body): this one's count, from 1.
type Seen = Arc<Mutex<HashMap<bytes::Bytes, u32>>>;

fn count_attempt(seen: &Seen, body: &bytes::Bytes) -> u32 {
    let mut seen = seen.lock().unwrap();
    let n = seen.entry(body.clone()).or_default();
    *n += 1;
    *n
}

/// A chat request with `input` and a deadline of `ms` milliseconds.
fn with_deadline(
    url: &str,
    input: &str,
    ms: u64,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let mut req = post(url, &format!(r#"{{"model":"m","input":"{input}"}}"#));
    req.headers_mut()
        .insert("x-corral-deadline-ms", ms.to_string().parse().unwrap());
    req
}

/// `n` requests at once, inputs `{prefix} {i}`, each with a deadline of `ms` milliseconds.
fn at_once(
    c: &TestClient,
    url: &str,
    prefix: &str,
    n: usize,
    ms: u64,
) -> Vec<tokio::task::JoinHandle<(http::response::Parts, bytes::Bytes)>> {
    (0..n)
        .map(|i| {
            let (c, req) = (c.clone(), with_deadline(url, &format!("{prefix} {i}"), ms));
            tokio::spawn(async move { send(&c, req).await })
        })
        .collect()
}

async fn status(c: &TestClient, corral: &Corral) -> serde_json::Value {
    let req = http::Request::get(corral.url("/status"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let (_, body) = send(c, req).await;
    serde_json::from_slice(&body).unwrap()
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn metrics(c: &TestClient, corral: &Corral) -> String {
    let req = http::Request::get(corral.url("/metrics"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let (_, body) = send(c, req).await;
    String::from_utf8(body.to_vec()).unwrap()
}

/// One request in five is answered with an overload 429 the first time, then 200. Clients that
/// never retry all get their 200 through corral, the 429s are counted as overload, retried
/// as failures, and the learned pace is never cut: a second burst goes out as fast as the
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_429s_are_retried_like_503s_and_never_slow_the_pace() {
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    let upstream = MockUpstream::start(move |req| {
        let n = count_attempt(&s, &req.body);
        // One request in five, as in the overload world (the breaker stays closed).
        let chosen = String::from_utf8_lossy(&req.body).contains(r#""overload":true"#);
        async move {
            if n == 1 && chosen {
                overloaded()
            } else {
                let mut r = json(200, serde_json::json!({"ok": true}));
                healthy(&mut r);
                r
            }
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let burst = |round: usize| {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let start = Instant::now();
            let tasks: Vec<_> = (0..60)
                .map(|i| {
                    let (c, url) = (c.clone(), url.clone());
                    tokio::spawn(async move {
                        let overload = i % 5 == 0;
                        let body = format!(
                            r#"{{"model":"m","input":"{round}-{i}","overload":{overload}}}"#
                        );
                        send(&c, post(&url, &body)).await.0.status
                    })
                })
                .collect();
            for t in tasks {
                assert_eq!(t.await.unwrap(), 200, "every client is served");
            }
            start.elapsed()
        }
    };
    let first = burst(0).await;
    let second = burst(1).await;
    // Each request waits one full-jitter backoff, U(0, 0.5 s): well under 5 s even loaded.
    assert!(first < Duration::from_secs(5), "first burst {first:?}");
    assert!(second < Duration::from_secs(5), "second burst {second:?}");
    assert_eq!(
        upstream.calls(),
        144,
        "one overload per chosen request, one success each"
    );
    let text = metrics(&c, &corral).await;
    let overloads = metric(
        &text,
        r#"corral_upstream_429_reasons_total{reason="overload",upstream="mock"}"#,
    );
    assert_eq!(overloads, 24.0, "every overload read as one");
    let rate = metric(
        &text,
        r#"corral_upstream_429_reasons_total{reason="rate",upstream="mock"}"#,
    );
    assert_eq!(rate, 0.0);
    let retried = metric(
        &text,
        r#"corral_retries_total{reason="429_overload",upstream="mock"}"#,
    );
    assert_eq!(retried, 24.0, "retried as overloads");
}

/// An upstream's admission control refuses each "storm" request three times with
/// `retry-after: 1` and an empty bucket, whatever the rate, then serves it. Ten parallel
/// clients are done after about three hints; then requests with a 2 s deadline go out at once
/// and none is refused by corral itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admission_storm_costs_its_hints_and_leaves_no_crawl() {
    let seen: Seen = Arc::default();
    let arrivals: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let (s, a) = (Arc::clone(&seen), Arc::clone(&arrivals));
    let upstream = MockUpstream::start(move |req| {
        let body = String::from_utf8_lossy(&req.body).into_owned();
        a.lock().unwrap().push((body.clone(), Instant::now()));
        let n = count_attempt(&s, &req.body);
        async move {
            let refuse = body.contains("storm") && n <= 3;
            let mut r = if refuse {
                json(
                    429,
                    serde_json::json!({"error": {"message": "Too many requests, please retry",
                        "type": "requests", "code": "rate_limit_exceeded"}}),
                )
            } else {
                json(200, serde_json::json!({"ok": true}))
            };
            let remaining = if refuse { "0" } else { "99" };
            with_headers(
                &mut r,
                &[
                    ("x-ratelimit-limit-requests", "100"),
                    ("x-ratelimit-remaining-requests", remaining),
                    ("x-ratelimit-reset-requests", "1s"),
                ],
            );
            if refuse {
                with_headers(&mut r, &[("retry-after", "1")]);
            }
            r
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let start = Instant::now();
    for t in at_once(&c, &url, "storm", 10, 10_000) {
        let (parts, body) = t.await.unwrap();
        let (status, what) = (parts.status, format!("{parts:?} {body:?}"));
        if status != 200 {
            let text = metrics(&c, &corral).await;
            let gave_up: Vec<_> = text
                .lines()
                .filter(|l| l.starts_with("corral_retry_gave_up_total") && !l.ends_with(" 0"))
                .collect();
            panic!("a storm request failed: {what}; gave up: {gave_up:?}");
        }
    }
    // Three hints of 1 s each (plus their jitter): about 3 s; 8 s on a loaded machine.
    let storm_time = start.elapsed();
    assert!(
        storm_time < Duration::from_secs(8),
        "storm took {storm_time:?}"
    );

    // After the storm: requests with a 2 s deadline, one alone, then twenty at once.
    let sent = Instant::now();
    let (parts, _) = send(&c, with_deadline(&url, "after", 2000)).await;
    assert_eq!(parts.status, 200);
    let reached = arrivals
        .lock()
        .unwrap()
        .iter()
        .find(|(b, _)| b.contains("after"))
        .map(|(_, at)| *at)
        .expect("the upstream saw it");
    // Target 100 ms; bound 300 ms for a loaded machine. A crawl left by the storm (a pace of
    // one a second) would hold it a second, and a refusal would never reach the upstream.
    let waited = reached - sent;
    assert!(waited < Duration::from_millis(300), "held {waited:?}");
    for t in at_once(&c, &url, "later", 20, 2000) {
        let (parts, _) = t.await.unwrap();
        let (status, corrals_own) = (parts.status, parts.headers.contains_key("x-corral-error"));
        assert!(
            !corrals_own,
            "corral refused a request on a pace it guessed"
        );
        assert_eq!(status, 200);
    }
}

/// A gateway's queue refuses each request twice with a bare `429` and `retry-after: 1` (no
/// rate-limit headers), whatever the rate, then serves it. A bucket refilled over the hint
/// would take the first send after the pause; this one refuses it, so each refusal is the
/// request's own wait: forty parallel clients are done after about two hints, as each would
/// be honouring `retry-after` alone, with three attempts each. (Read as a bucket's edge, each
/// refusal paused everything for a second and cut the pace: one attempt a second.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateways_queue_refusing_whatever_the_rate_costs_only_its_hints() {
    let seen: Seen = Arc::default();
    let s = Arc::clone(&seen);
    let upstream = MockUpstream::start(move |req| {
        let n = count_attempt(&s, &req.body);
        async move {
            if n <= 2 {
                let mut r = json(
                    429,
                    serde_json::json!({"error": {"message": "Server busy: queue full",
                        "type": "server_busy", "code": "queue_full"}}),
                );
                with_headers(&mut r, &[("retry-after", "1")]);
                r
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let start = Instant::now();
    for t in at_once(&c, &url, "queued", 40, 20_000) {
        assert_eq!(t.await.unwrap().0.status, 200);
    }
    // Two hints of 1 s (plus their jitter): about 2.5 s; 8 s on a loaded machine.
    let took = start.elapsed();
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 40);
    assert!(
        seen.values().all(|&n| n == 3),
        "attempts per request: {seen:?}"
    );
}

/// Two models on one key: the slow model's long 429 pauses its own partition only, and the
/// fast model's requests go at once; `/status` counts two partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_on_one_key_are_two_partitions() {
    let upstream = MockUpstream::start(|req| async move {
        if String::from_utf8_lossy(&req.body).contains("slow-model") {
            let mut r = json(
                429,
                serde_json::json!({"error": {"message": "Rate limit reached for slow-model",
                    "type": "requests", "code": "rate_limit_exceeded"}}),
            );
            r.headers_mut().insert("retry-after", "20".parse().unwrap());
            r
        } else {
            json(200, serde_json::json!({"ok": true}))
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let mut slow = post(&url, r#"{"model":"slow-model","input":"x"}"#);
    slow.headers_mut()
        .insert("x-corral-deadline-ms", "5000".parse().unwrap());
    let (parts, _) = send(&c, slow).await;
    assert_eq!(
        parts.status, 429,
        "a 20 s wait beyond a 5 s deadline passes through"
    );
    assert_eq!(parts.headers["x-should-retry"], "false");
    let start = Instant::now();
    for i in 0..5 {
        let mut fast = post(&url, &format!(r#"{{"input":"{i}","model":"fast-model"}}"#));
        fast.headers_mut()
            .insert("x-corral-deadline-ms", "5000".parse().unwrap());
        let (parts, _) = send(&c, fast).await;
        assert_eq!(
            parts.status, 200,
            "the fast model is not paused by the slow one"
        );
    }
    // Bound: five unpaced requests in 2 s on a loaded machine (one shared partition would
    // have refused them, the pause being 20 s).
    assert!(start.elapsed() < Duration::from_secs(2));
    let status = status(&c, &corral).await;
    assert_eq!(
        status["upstreams"][0]["rate_limit"]["partitions"], 2,
        "{status}"
    );
}

/// A token limit learned from OpenAI's headers, then a request whose `max_tokens` no bucket
/// can hold: it goes at once (the upstream's answer is the truth), and the next request is not
/// held behind a debt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_any_token_bucket_is_not_held() {
    let upstream = MockUpstream::start(|_| async {
        let mut r = json(200, serde_json::json!({"ok": true}));
        tokens_reported(&mut r, 10_000);
        r
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let small = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":10}"#;
    for _ in 0..3 {
        assert_eq!(send(&c, post(&url, small)).await.0.status, 200);
    }
    let start = Instant::now();
    let absurd =
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2000000000}"#;
    let mut req = post(&url, absurd);
    req.headers_mut()
        .insert("x-corral-deadline-ms", "5000".parse().unwrap());
    assert_eq!(send(&c, req).await.0.status, 200, "sent, not held");
    assert_eq!(send(&c, post(&url, small)).await.0.status, 200);
    // Bound: two unpaced requests in 2 s on a loaded machine; held, the first would have
    // waited for its 5 s deadline.
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

/// The answers' `usage` calibrates the prompt estimate: an upstream that counts twice the
/// characters / 4 guess moves the ratio in `/status` toward 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_calibrates_the_prompt_estimate() {
    let upstream = MockUpstream::start(|_| async {
        // The prompt below is 400 characters: 100 tokens guessed, 200 counted.
        let mut r = json(
            200,
            serde_json::json!({"usage": {"prompt_tokens": 200, "completion_tokens": 5,
                "total_tokens": 205}}),
        );
        tokens_reported(&mut r, 100_000);
        r
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let prompt = "x".repeat(400);
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{prompt}"}}],"max_tokens":5}}"#
    );
    for _ in 0..40 {
        assert_eq!(send(&c, post(&url, &body)).await.0.status, 200);
    }
    let status = status(&c, &corral).await;
    let ratio = status["upstreams"][0]["rate_limit"]["prompt_tokens_per_estimated"]
        .as_f64()
        .unwrap();
    // 0.9^39 of the distance left after 39 samples (the first answer teaches the token
    // limit): about 1.98; 1.9 allowed.
    assert!(ratio > 1.9, "ratio {ratio}");
}

/// OpenAI's `insufficient_quota` 429 body, gzipped (Python's `gzip.compress(body, mtime=0)`).
const QUOTA_429_GZIP: &str = "1f8b080000000000020375ca310e80200c00c0af349d8d0fe0274e86946218b45a682221fc5d7477be6bc8aaa2e81aee9cb3df181d2e62c03731070e50c514c854f9287099143fe384a59eef4c47b61813a581eb87c348c28ff5fe00dce952fa70000000";

/// A client that accepts gzip still has its permanent 429 read as one: corral asks the
/// upstream for `identity` (an upstream that gzips when asked would hide `insufficient_quota`
/// and the 429 would be retried as a throttle), and the client gets a body its headers
/// describe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_accepting_gzip_still_gets_its_429_read() {
    let plain = serde_json::json!({"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota", "code": "insufficient_quota"}});
    let gzipped: Vec<u8> = (0..QUOTA_429_GZIP.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&QUOTA_429_GZIP[i..i + 2], 16).unwrap())
        .collect();
    let body = plain.clone();
    let upstream = MockUpstream::start(move |req| {
        let gzip = req
            .headers
            .get_all("accept-encoding")
            .iter()
            .any(|v| v.to_str().unwrap_or_default().contains("gzip"));
        let (body, gzipped) = (body.clone(), gzipped.clone());
        async move {
            if gzip {
                http::Response::builder()
                    .status(429)
                    .header("content-type", "application/json")
                    .header("content-encoding", "gzip")
                    .body(corral::body::full(bytes::Bytes::from(gzipped)))
                    .unwrap()
            } else {
                json(429, body)
            }
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let mut req = post(&corral.url("/v1/chat/completions"), r#"{"model":"m"}"#);
    req.headers_mut()
        .insert("accept-encoding", "gzip, deflate, br".parse().unwrap());
    let (parts, got) = send(&client(), req).await;
    assert_eq!(parts.status, 429);
    assert_eq!(
        upstream.calls(),
        1,
        "the quota 429 was retried as a throttle"
    );
    assert!(
        parts.headers.get("content-encoding").is_none(),
        "{:?}",
        parts.headers
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&got).unwrap(),
        plain
    );
    let seen = upstream.seen.lock().unwrap();
    assert_eq!(seen[0].headers["accept-encoding"], "identity");
}

/// A bucket of 20 refilled at 20 a second, with no rate-limit headers, that names
/// `retry-after: 1` when empty (Together's shape: the next token is 50 ms away, rounded up
/// to a second). Each named pause says when the bucket takes its next send: a level banked
/// over the pause and spent at its end in one burst is refused past what the bucket holds.
/// 160 clients at once through an unconfigured corral, answers in 20 ms: each pause ends
/// with sends spread at the pace, so the first refusal stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_pause_ends_at_the_pace_not_in_a_burst() {
    let bucket = Arc::new(Mutex::new((20.0_f64, Instant::now())));
    let refused = Arc::new(Mutex::new(0_u32));
    let (b, r) = (Arc::clone(&bucket), Arc::clone(&refused));
    let upstream = MockUpstream::start(move |_req| {
        let taken = {
            let mut b = b.lock().unwrap();
            let now = Instant::now();
            b.0 = (b.0 + 20.0 * (now - b.1).as_secs_f64()).min(20.0);
            b.1 = now;
            let taken = b.0 >= 1.0;
            if taken {
                b.0 -= 1.0;
            }
            taken
        };
        if !taken {
            *r.lock().unwrap() += 1;
        }
        async move {
            if !taken {
                let mut r = json(
                    429,
                    serde_json::json!({"error": {"message": "You have been rate limited.",
                        "type": "rate_limit", "code": "rate_limit_exceeded"}}),
                );
                with_headers(&mut r, &[("retry-after", "1")]);
                return r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            json(200, serde_json::json!({"ok": true}))
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    for t in at_once(&c, &url, "paced", 160, 60_000) {
        assert_eq!(t.await.unwrap().0.status, 200);
    }
    // The ramp's edge costs a few, then about one per pause (the bound takes 7 s, a pause a
    // second or more): 12 at most (4-5 measured). A burst at each pause's end cost 21-27.
    let refused = *refused.lock().unwrap();
    assert!(refused <= 12, "the bucket refused {refused} sends");
}

/// Gemini's per-day quota spent, its reset minutes away (`retryDelay` 300 s: within corral's
/// 10-minute deadline, beyond the client's). The official SDKs say how long they wait for the
/// head (`x-stainless-read-timeout`, openai-python 3.63 `_base_client.py`), so the 429 is
/// answered at once and so is the next request, refused under the named pause: not held for
/// the reset past the client's own timeout (seen in the `gemini-daily` world at 23:52 Pacific:
/// 299 clients held until their 60 s timeouts). Without the header the same wait is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_wait_beyond_the_sdks_timeout_is_answered_at_once() {
    let upstream = MockUpstream::start(|_| async {
        json(
            429,
            serde_json::json!([{"error": {
            "code": 429, "status": "RESOURCE_EXHAUSTED",
            "message": "Quota exceeded for metric: generate_requests_per_model_per_day",
            "details": [
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                 "violations": [{"quotaId": "GenerateRequestsPerDayPerProjectPerModel"}]},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "300s"}
            ]}}]),
        )
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let sdk = |i: usize| {
        let mut req = post(&url, &format!(r#"{{"model":"m","input":"{i}"}}"#));
        req.headers_mut()
            .insert("x-stainless-read-timeout", "5.0".parse().unwrap());
        req
    };
    let start = Instant::now();
    let (first, _) = send(&c, sdk(0)).await;
    assert_eq!(first.status, 429);
    assert!(
        first.headers.get("x-corral-error").is_none(),
        "the upstream's"
    );
    let (second, _) = send(&c, sdk(1)).await;
    assert_eq!(second.status, 429);
    assert_eq!(second.headers["x-corral-error"], "rate_limited");
    // Bound: two answers with no wait in 2 s on a loaded machine; held, each would wait out
    // its 4.75 s (the timeout less a twentieth) or the 300 s.
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(upstream.calls(), 1, "the second was never sent");
    // A client that names no timeout is held for the reset, within corral's deadline.
    let plain = post(&url, r#"{"model":"m","input":"plain"}"#);
    let held = tokio::time::timeout(Duration::from_secs(1), send(&c, plain)).await;
    assert!(held.is_err(), "held under the 300 s pause");
}
