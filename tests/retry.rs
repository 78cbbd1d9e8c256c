//! Retries and the deadline over real sockets through `server::run`: the client's deadline
//! header, stacked retries and `x-should-retry` on a given-up answer (also with the official
//! `openai` SDK's own retries on), permanent 429s passed on at once, the server's hint as a
//! floor, and the retries clients make on their own counted. Timing bounds are one-sided (a paced
//! wait can only be longer on a slow machine) or generous, and stated per assert.

mod support;

use std::time::Duration;

use support::CHAT_102_TOKENS as BODY;
use support::*;
use tokio::time::Instant;

/// docs/design.md, Deadline: a client may shorten the deadline with `x-corral-deadline-ms`, never
/// lengthen it; the header is corral's and never reaches the upstream; with no answer in time
/// the client gets a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_header_shortens_never_lengthens_and_stays_with_corral() {
    let upstream = MockUpstream::start(|_| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        json(200, serde_json::json!({"ok": true}))
    })
    .await;
    let retry = "[upstream.retry]\ndeadline = \"5s\"\n";
    let corral = Corral::start(&one_upstream(&upstream, retry)).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    for (header, shortest, longest) in [
        // Shortened to 1 s: answered after at least that, well before the 5 s deadline (3 s of
        // slack for a busy machine).
        ("1000", 950, 4000),
        // Asked for 60 s: the configured 5 s still holds (the upstream takes 60 s).
        ("60000", 4950, 15000),
    ] {
        let mut req = post(&url, BODY);
        req.headers_mut()
            .insert("x-corral-deadline-ms", header.parse().unwrap());
        let start = Instant::now();
        let (parts, body) = send(&c, req).await;
        let took = start.elapsed().as_millis();
        assert_eq!(
            parts.status,
            504,
            "{header}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(
            parts.headers[corral::error::CORRAL_ERROR_HEADER],
            "deadline_exceeded"
        );
        assert!(
            (shortest..longest).contains(&took),
            "x-corral-deadline-ms {header}: {took} ms"
        );
        let seen = upstream.last();
        assert!(
            seen.headers.get("x-corral-deadline-ms").is_none(),
            "forwarded: {:?}",
            seen.headers
        );
    }
}

/// docs/design.md, Stacked retries: when corral retried a failure and gives up (`max_retries`), the
/// upstream's own answer reaches the client with `x-should-retry: false` added, so an SDK does
/// not retry it again; `mark_given_up = false` leaves the answer as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_answer_is_marked_unless_marking_is_off() {
    let error = serde_json::json!({"error": {"message": "overloaded", "type": "server_error"}});
    for mark in [true, false] {
        let upstream = always_with(503, error.clone(), &[]).await;
        let retry = format!(
            "[upstream.retry]\nmax_retries = 2\nbase = \"10ms\"\ncap = \"20ms\"\nmark_given_up = {mark}\n"
        );
        let corral = Corral::start(&one_upstream(&upstream, &retry)).await;
        let (parts, body) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 503, "mark_given_up = {mark}");
        // The upstream's answer itself, not one of corral's.
        assert_upstreams_answer(&parts, &body, &error);
        assert_eq!(
            upstream.calls(),
            3,
            "one attempt and max_retries = 2 retries"
        );
        let marked = parts
            .headers
            .get("x-should-retry")
            .map(|v| v.to_str().unwrap().to_owned());
        let want = mark.then(|| "false".to_owned());
        assert_eq!(marked, want, "mark_given_up = {mark}");
    }
}

/// docs/design.md, permanent 429s: a 429 no wait can cure (OpenAI's `insufficient_quota`,
/// Anthropic's `enforced_spend_limit_reached`, also under `error.details`) goes back to the client
/// at once, untouched and never retried; a billing message that comes with a `retry-after` is a
/// throttle, and is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_429_is_passed_on_at_once_and_a_hinted_one_is_retried() {
    let permanent = [
        serde_json::json!({"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota", "code": "insufficient_quota"}}),
        serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": "spend limit", "details": {"error_code": "enforced_spend_limit_reached"}}}),
        serde_json::json!({"error": {"message": "x", "details": {"code": "enforced_spend_limit_reached"}}}),
    ];
    for body in permanent {
        let upstream = always_with(429, body.clone(), &[]).await;
        let corral = Corral::start(&one_upstream(&upstream, "")).await;
        let (parts, got) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 429, "{body}");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&got).unwrap(),
            body
        );
        assert_eq!(upstream.calls(), 1, "a permanent 429 was retried: {body}");
    }
    // Billing words, but a wait named in any of the three headers: a throttle. Retried once
    // (max_throttle_retries = 1), then passed on, marked.
    let billing = serde_json::json!({"error": {"message": "Your credit balance is too low", "type": "rate_limit_error"}});
    let waits: [&'static [(&str, &str)]; 3] = [
        &[("retry-after", "0")],
        &[("retry-after-ms", "0")],
        &[("x-ms-retry-after-ms", "0")],
    ];
    for wait in waits {
        let upstream = always_with(429, billing.clone(), wait).await;
        let retry = "[upstream.retry]\nmax_throttle_retries = 1\n";
        let corral = Corral::start(&one_upstream(&upstream, retry)).await;
        let (parts, got) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 429, "{wait:?}");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&got).unwrap(),
            billing
        );
        assert_eq!(upstream.calls(), 2, "a hinted 429 is a throttle: {wait:?}");
        assert_eq!(parts.headers["x-should-retry"], "false", "{wait:?}");
    }
}

/// docs/design.md, Retry: what the official SDKs retry (408, 409 and every 5xx) corral retries,
/// so a client that leaves its retries to corral (`max_retries=0`) loses none it would have
/// won alone; a 5xx that names something no retry changes (501, 505) goes back at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_sdks_retry_is_retried_and_a_permanent_5xx_is_not() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    for (status, retried) in [
        (408, true),
        (409, true),
        (520, true),
        (524, true),
        (501, false),
        (505, false),
    ] {
        let first = Arc::new(AtomicUsize::new(0));
        let upstream = MockUpstream::start(move |_| {
            let n = first.fetch_add(1, Ordering::SeqCst);
            async move {
                let error =
                    serde_json::json!({"error": {"message": "try again", "type": "server_error"}});
                if n == 0 {
                    json(status, error)
                } else {
                    json(200, serde_json::json!({"ok": true}))
                }
            }
        })
        .await;
        let retry = "[upstream.retry]\nbase = \"10ms\"\ncap = \"20ms\"\n";
        let corral = Corral::start(&one_upstream(&upstream, retry)).await;
        let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        if retried {
            assert_eq!(parts.status, 200, "{status} not retried");
            assert_eq!(upstream.calls(), 2, "{status}");
        } else {
            assert_eq!(parts.status, status, "{status}");
            assert_eq!(upstream.calls(), 1, "{status} retried");
        }
    }
}

/// docs/design.md, Stacked retries: the other two ways corral gives up on a failure, each marked.
/// The retry budget refusing a retry (budget 0) marks the answer after the waits for health the
/// SDKs' own retries get (the first sends one probe into an upstream that never serves; the
/// second waits, here to a 3 s deadline), since the client's own retries would add the load the
/// budget holds back; the deadline passing
/// between retries (or, on a busy machine, during the last attempt) marks the last answer, counted
/// as `deadline` either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn giving_up_on_the_budget_or_the_deadline_is_marked() {
    let error = serde_json::json!({"error": {"message": "unavailable", "type": "server_error"}});
    let cases = [
        (
            "budget",
            "max_retries = 5\nbudget_ratio = 0.0\nbudget_min_per_second = 0\ndeadline = \"3s\"\n",
        ),
        (
            "deadline",
            "max_retries = 100\nbase = \"100ms\"\ncap = \"100ms\"\njitter = \"none\"\ndeadline = \"2s\"\n",
        ),
    ];
    for (why, retry) in cases {
        let upstream = always_with(503, error.clone(), &[]).await;
        let corral = Corral::start(&one_upstream(
            &upstream,
            &format!("[upstream.retry]\n{retry}"),
        ))
        .await;
        let start = Instant::now();
        let (parts, body) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        let took = start.elapsed();
        assert_eq!(parts.status, 503, "{why}");
        assert_upstreams_answer(&parts, &body, &error);
        assert_eq!(parts.headers["x-should-retry"], "false", "{why}");
        let calls = upstream.calls();
        match why {
            "budget" => {
                assert_eq!(calls, 2, "the empty budget allowed more than one probe");
                assert!(took < Duration::from_secs(6), "{took:?}");
            }
            // 100 ms between attempts within 2 s: about twenty; at least two on any machine,
            // and the answer by the deadline plus 3 s of slack.
            _ => {
                assert!((2..=21).contains(&calls), "{calls} attempts");
                assert!(took < Duration::from_secs(5), "{took:?}");
            }
        }
        let metrics = corral.app.metrics().render();
        let line = format!(r#"corral_retry_gave_up_total{{upstream="mock",why="{why}"}} 1"#);
        assert!(metrics.contains(&line), "no `{line}` in\n{metrics}");
    }
}

/// docs/design.md, The server's hint is a floor: a retried failure that names a wait (here a 503
/// with `retry-after: 3`) is resent after the hint plus U(0, min(floor_jitter, hint / 50)), so
/// eight clients told "3 s" do not come back at once. Each resend is at least 3 s after its first
/// answer and at most 3 s + 60 ms + 1 s of scheduling slack; the eight resends span more than
/// 12 ms (all eight draws of U(0, 60 ms) within 12 ms: p < 1e-4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hinted_failure_waits_the_hint_plus_the_floor_jitter() {
    const CLIENTS: usize = 8;
    let arrivals = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = std::sync::Arc::clone(&arrivals);
    let upstream = MockUpstream::start(move |req| {
        let seen = std::sync::Arc::clone(&seen);
        async move {
            let id = String::from_utf8_lossy(&req.body).into_owned();
            let mut seen = seen.lock().unwrap();
            seen.push((id.clone(), Instant::now()));
            let first = seen.iter().filter(|(i, _)| *i == id).count() == 1;
            drop(seen);
            if first {
                let mut r = json(503, serde_json::json!({"error": {"message": "busy"}}));
                r.headers_mut().insert("retry-after", "3".parse().unwrap());
                r
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    let retry = "rate_limit = \"off\"\n[upstream.retry]\nbase = \"10ms\"\ncap = \"10ms\"\nfloor_jitter = \"500ms\"\n";
    let corral = Corral::start(&one_upstream(&upstream, retry)).await;
    let c = std::sync::Arc::new(client());
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (c, url) = (
                std::sync::Arc::clone(&c),
                corral.url("/v1/chat/completions"),
            );
            tokio::spawn(async move {
                send(&c, post(&url, &format!("{{\"id\":{i}}}")))
                    .await
                    .0
                    .status
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let arrivals = arrivals.lock().unwrap().clone();
    assert_eq!(arrivals.len(), 2 * CLIENTS);
    let mut resends = Vec::new();
    for i in 0..CLIENTS {
        let id = format!("{{\"id\":{i}}}");
        let times: Vec<Instant> = arrivals
            .iter()
            .filter(|(x, _)| *x == id)
            .map(|(_, t)| *t)
            .collect();
        let gap = times[1] - times[0];
        assert!(
            gap >= Duration::from_secs(3) && gap <= Duration::from_millis(4060),
            "resent {gap:?} after a 3 s hint"
        );
        resends.push(times[1]);
    }
    resends.sort();
    let span = resends[CLIENTS - 1] - resends[0];
    assert!(
        span > Duration::from_millis(12),
        "eight resends within {span:?}: no jitter on the hint"
    );
}

/// docs/design.md, Stacked retries: the one case marking exists for. The official `openai` SDK with
/// its default retries ON (2) against an upstream that always answers 503: corral retries
/// (`max_retries = 2`) and gives up marked, and the SDK obeys `x-should-retry: false`, so the
/// upstream sees corral's 3 attempts and no more. With `mark_given_up = false` the SDK retries
/// corral's answer twice more: 9 attempts (what the marking saves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_with_its_retries_on_does_not_retry_a_given_up_answer() {
    let Some(python) = support::python::python("the openai SDK") else {
        return;
    };
    let error = serde_json::json!({"error": {"message": "unavailable", "type": "server_error", "code": null, "param": null}});
    for (mark, want) in [(true, 3), (false, 9)] {
        let upstream = always_with(503, error.clone(), &[]).await;
        let retry = format!(
            "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 2\nbase = \"10ms\"\ncap = \"20ms\"\nmark_given_up = {mark}\n"
        );
        let corral = Corral::start(&one_upstream(&upstream, &retry)).await;
        let env = [
            ("OPENAI_BASE_URL", corral.url("/v1")),
            ("OPENAI_API_KEY", "sk-test".to_owned()),
        ];
        let limit = Duration::from_secs(120);
        support::python::run_sdk_script(&python, "test_openai_retries.py", &[], &env, 1, limit)
            .await;
        assert_eq!(upstream.calls(), want, "mark_given_up = {mark}");
    }
}

/// docs/design.md, Stacked retries: "Requests arriving with `x-stainless-retry-count > 0` are
/// counted in `corral_client_retries_total`" (the header the official SDKs send on their own
/// retries).
///
/// Requests with `x-stainless-retry-count` 1 and 3 are counted; 0, none, and a value that is
/// not a count are not. The header still reaches the upstream (it is the client's).
#[tokio::test]
async fn requests_an_sdk_retried_are_counted() {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"ok": true})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    for count in [Some("0"), Some("1"), None, Some("3"), Some("many")] {
        let mut req = post(&url, "{}");
        if let Some(n) = count {
            req.headers_mut()
                .insert("x-stainless-retry-count", n.parse().unwrap());
        }
        let (parts, _) = send(&c, req).await;
        assert_eq!(parts.status, 200);
        assert_eq!(
            upstream
                .last()
                .headers
                .get("x-stainless-retry-count")
                .map(|v| v.to_str().unwrap()),
            count,
            "forwarded as sent"
        );
    }
    let metrics = corral.app.metrics().render();
    let line = "corral_client_retries_total{upstream=\"mock\"} 2";
    assert!(metrics.contains(line), "no `{line}` in\n{metrics}");
}
