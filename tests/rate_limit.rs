//! `[upstream.limits]` over real sockets through `server::run`: key partitions, tokens charged
//! from a configured `tpm`, and configured `rpm` / `tpm` as ceilings that learning never exceeds.
//! Timing bounds are one-sided (a paced wait can only be longer on a slow machine) and stated per
//! assert. What a 429 may change in the learned pace is in `tests/throttles.rs`.

mod support;

use std::time::Duration;

use support::CHAT_102_TOKENS as BODY;
use support::*;
use tokio::time::Instant;

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

/// docs/configuration.md, `partition = "api_key"`: one set of buckets per client credential. Three
/// callers (two keys and one without a key) each get their bucket of one at once; a key's second
/// request waits for its own bucket (one every 3 s); and the key appears in neither `/metrics` nor
/// `/status`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_key_has_its_own_buckets_and_shows_nowhere() {
    let upstream = ok_upstream().await;
    let limits = "[upstream.limits]\npartition = \"api_key\"\nrpm = 20\nburst = 1\n";
    let corral = Corral::start(&one_upstream(&upstream, limits)).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let (a, b) = ("sk-tenant-a-SECRETVALUE", "sk-tenant-b-SECRETVALUE");

    let start = Instant::now();
    for key in [Some(a), Some(b), None] {
        let (parts, _) = send(&c, with_key(post(&url, BODY), key)).await;
        assert_eq!(parts.status, 200, "{key:?}");
    }
    // One shared bucket of one would have made the second and third wait 3 s each.
    // Bound: 2.5 s for three unpaced requests on a busy machine.
    let unpaced = start.elapsed();
    assert!(
        unpaced < Duration::from_millis(2500),
        "three keys, three buckets: {unpaced:?}"
    );

    // A's second request waits for A's bucket: 3 s after A's first (one-sided bound, 2.5 s).
    let (parts, _) = send(&c, with_key(post(&url, BODY), Some(a))).await;
    assert_eq!(parts.status, 200);
    let paced = start.elapsed();
    assert!(
        paced >= Duration::from_millis(2500),
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

/// docs/configuration.md, `tpm`: every request is charged its estimate (prompt characters / 4 plus
/// its `max_tokens`), counted in `corral_tokens_charged_total`.
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

/// docs/design.md, Learning the limit: explicit `rpm` / `tpm` are hard ceilings learning never
/// exceeds. The upstream reports a limit a thousand times larger on every answer (OpenAI's headers,
/// nearly full buckets); corral still sends at most the configured rate. 25 requests at once under
/// `rpm = 600` (10 a second) with a burst of 5 need at least (25 - 5) / 10 = 2 s; under `tpm` =
/// 61,200 (1,020 tokens a second, 102 a request: the same 10 a second) with a token burst of 510 (5
/// requests) the same. One-sided bound: 1.8 s (a busy machine only adds time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_ceilings_hold_whatever_the_upstream_reports() {
    let generous: &'static [(&str, &str)] = &[
        ("x-ratelimit-limit-requests", "600000"),
        ("x-ratelimit-remaining-requests", "599999"),
        ("x-ratelimit-reset-requests", "1ms"),
        ("x-ratelimit-limit-tokens", "150000000"),
        ("x-ratelimit-remaining-tokens", "149999000"),
        ("x-ratelimit-reset-tokens", "1ms"),
    ];
    for limits in [
        "[upstream.limits]\nrpm = 600\nburst = 5\n",
        "[upstream.limits]\ntpm = 61200\ntoken_burst = 510\n",
    ] {
        let upstream = always_with(200, serde_json::json!({"ok": true}), generous).await;
        let corral = Corral::start(&one_upstream(&upstream, limits)).await;
        let c = std::sync::Arc::new(client());
        let start = Instant::now();
        let tasks: Vec<_> = (0..25)
            .map(|_| {
                let (c, url) = (
                    std::sync::Arc::clone(&c),
                    corral.url("/v1/chat/completions"),
                );
                tokio::spawn(async move { send(&c, post(&url, BODY)).await.0.status })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200, "{limits}");
        }
        let took = start.elapsed();
        assert_eq!(upstream.calls(), 25);
        assert!(
            took >= Duration::from_millis(1800),
            "{limits}: 25 requests in {took:?}, faster than the ceiling allows"
        );
    }
}
