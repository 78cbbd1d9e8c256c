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
