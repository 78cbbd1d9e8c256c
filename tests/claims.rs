//! Claims the README makes about the request path, each checked over real sockets through
//! `server::run` (issue 14): key partitions, the client's deadline header, tokens charged from a
//! configured `tpm`. Timing bounds are one-sided (a paced wait can only be longer on a slow
//! machine) or generous, and stated per assert.

mod support;

use std::time::Duration;

use support::*;
use tokio::time::Instant;

/// A chat request of 8 prompt characters (2 tokens) and a 100-token budget: 102 tokens.
const BODY: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"max_tokens":100}"#;

async fn ok_upstream() -> MockUpstream {
    MockUpstream::start(|_| async { json(200, serde_json::json!({"ok": true})) }).await
}

fn with_key(
    mut req: http::Request<http_body_util::Full<bytes::Bytes>>,
    key: Option<&str>,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    if let Some(key) = key {
        let value = format!("Bearer {key}").parse().unwrap();
        req.headers_mut().insert("authorization", value);
    }
    req
}

/// README, `partition = "api_key"`: one set of buckets per client credential. Three callers
/// (two keys and one without a key) each get their bucket of one at once; a key's second
/// request waits for its own bucket (1 a second); and the key appears in neither `/metrics`
/// nor `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_key_has_its_own_buckets_and_shows_nowhere() {
    let upstream = ok_upstream().await;
    let limits = "[upstream.limits]\npartition = \"api_key\"\nrpm = 60\nburst = 1\n";
    let corral = Corral::start(&one_upstream(&upstream, limits)).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let (a, b) = ("sk-tenant-a-SECRETVALUE", "sk-tenant-b-SECRETVALUE");

    let start = Instant::now();
    for key in [Some(a), Some(b), None] {
        let (parts, _) = send(&c, with_key(post(&url, BODY), key)).await;
        assert_eq!(parts.status, 200, "{key:?}");
    }
    // One shared bucket of one would have made the second and third wait a second each.
    // Bound: 900 ms for three unpaced requests on a busy machine.
    let unpaced = start.elapsed();
    assert!(
        unpaced < Duration::from_millis(900),
        "three keys, three buckets: {unpaced:?}"
    );

    // A's second request waits for A's bucket: about a second after A's first.
    let (parts, _) = send(&c, with_key(post(&url, BODY), Some(a))).await;
    assert_eq!(parts.status, 200);
    let paced = start.elapsed();
    assert!(
        paced >= Duration::from_millis(800),
        "a key's second request was not paced: {paced:?}"
    );
    assert_eq!(upstream.calls(), 4);

    let metrics = corral.app.metrics().render();
    let request = http::Request::get(corral.url("/status"))
        .body(http_body_util::Full::default())
        .unwrap();
    let (_, status) = send(&c, request).await;
    let status = String::from_utf8(status.to_vec()).unwrap();
    for (what, text) in [("/metrics", &metrics), ("/status", &status)] {
        assert!(
            !text.contains("SECRETVALUE") && !text.contains("tenant"),
            "{what} shows a key:\n{text}"
        );
    }
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["upstreams"][0]["rate_limit"]["partitions"], 2,
        "{status}"
    );
}

/// README, Deadline: a client may shorten the deadline with `x-corral-deadline-ms`, never
/// lengthen it; the header is corral's and never reaches the upstream; with no answer in time
/// the client gets a 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_header_shortens_never_lengthens_and_stays_with_corral() {
    let upstream = MockUpstream::start(|_| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        json(200, serde_json::json!({"ok": true}))
    })
    .await;
    let retry = "[upstream.retry]\ndeadline = \"1500ms\"\n";
    let corral = Corral::start(&one_upstream(&upstream, retry)).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    for (header, shortest, longest) in [
        // Shortened to 300 ms: answered after at least that, well before the 1.5 s deadline.
        ("300", 250, 1200),
        // Asked for 60 s: the configured 1.5 s still holds (the upstream takes 5 s).
        ("60000", 1400, 4000),
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

/// README, `tpm`: every request is charged its estimate (prompt characters / 4 plus its
/// `max_tokens`), counted in `corral_tokens_charged_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_tpm_charges_each_request_its_estimate() {
    let upstream = ok_upstream().await;
    let limits = "[upstream.limits]\ntpm = 600000\ntoken_burst = 100000\n";
    let corral = Corral::start(&one_upstream(&upstream, limits)).await;
    let c = client();
    for _ in 0..3 {
        let (parts, _) = send(&c, post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 200);
    }
    let metrics = corral.app.metrics().render();
    let line = r#"corral_tokens_charged_total{upstream="mock"} 306"#;
    assert!(metrics.contains(line), "no `{line}` in\n{metrics}");
}

/// An upstream that always answers `status` with `body` (and `headers`), counting its calls.
async fn always(
    status: u16,
    body: serde_json::Value,
    headers: &'static [(&'static str, &'static str)],
) -> MockUpstream {
    MockUpstream::start(move |_| {
        let body = body.clone();
        async move {
            let mut response = json(status, body);
            for (name, value) in headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
            response
        }
    })
    .await
}

/// README, Stacked retries: when corral retried a failure and gives up (`max_retries`), the
/// upstream's own answer reaches the client with `x-should-retry: false` added, so an SDK does
/// not retry it again; `mark_given_up = false` leaves the answer as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_answer_is_marked_unless_marking_is_off() {
    let error = serde_json::json!({"error": {"message": "overloaded", "type": "server_error"}});
    for mark in [true, false] {
        let upstream = always(503, error.clone(), &[]).await;
        let retry = format!(
            "[upstream.retry]\nmax_retries = 2\nbase = \"10ms\"\ncap = \"20ms\"\nmark_given_up = {mark}\n"
        );
        let corral = Corral::start(&one_upstream(&upstream, &retry)).await;
        let (parts, body) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 503, "mark_given_up = {mark}");
        // The upstream's answer itself, not one of corral's.
        assert!(parts
            .headers
            .get(corral::error::CORRAL_ERROR_HEADER)
            .is_none());
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
            error
        );
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

/// README, permanent 429s: a 429 no wait can cure (OpenAI's `insufficient_quota`, Anthropic's
/// `enforced_spend_limit_reached`, also under `error.details`) goes back to the client at once,
/// untouched and never retried; a billing message that comes with a `retry-after` is a
/// throttle, and is retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_429_is_passed_on_at_once_and_a_hinted_one_is_retried() {
    let permanent = [
        serde_json::json!({"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota", "code": "insufficient_quota"}}),
        serde_json::json!({"type": "error", "error": {"type": "rate_limit_error", "message": "spend limit", "details": {"error_code": "enforced_spend_limit_reached"}}}),
        serde_json::json!({"error": {"message": "x", "details": {"code": "enforced_spend_limit_reached"}}}),
    ];
    for body in permanent {
        let upstream = always(429, body.clone(), &[]).await;
        let corral = Corral::start(&one_upstream(&upstream, "")).await;
        let (parts, got) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
        assert_eq!(parts.status, 429, "{body}");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&got).unwrap(),
            body
        );
        assert_eq!(upstream.calls(), 1, "a permanent 429 was retried: {body}");
    }
    // Billing words, but a hint: a throttle. Retried once (max_throttle_retries = 1), then
    // passed on, marked.
    let billing = serde_json::json!({"error": {"message": "Your credit balance is too low", "type": "rate_limit_error"}});
    // (`retry-after` as the README says; a billing message with only `retry-after-ms` is still
    // taken as permanent today: see `is_permanent_429`.)
    let upstream = always(429, billing.clone(), &[("retry-after", "0")]).await;
    let retry = "[upstream.retry]\nmax_throttle_retries = 1\n";
    let corral = Corral::start(&one_upstream(&upstream, retry)).await;
    let (parts, got) = send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await;
    assert_eq!(parts.status, 429);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&got).unwrap(),
        billing
    );
    assert_eq!(upstream.calls(), 2, "a hinted 429 is a throttle: retried");
    assert_eq!(parts.headers["x-should-retry"], "false");
}
