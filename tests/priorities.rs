//! Priorities (issue 13, item 4) over real sockets: `x-corral-priority: interactive | batch`
//! (default per route) puts interactive requests ahead of queued batch ones at the rate limiter;
//! the header is corral's and never reaches the upstream; any other value is refused with a 400.

mod support;

use std::time::Duration;

use support::*;
use tokio::time::Instant;

fn with_priority(
    mut req: http::Request<http_body_util::Full<bytes::Bytes>>,
    priority: &str,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req.headers_mut()
        .insert("x-corral-priority", priority.parse().unwrap());
    req
}

/// 20 batch requests queue for 5 tokens a second (a bucket of one), then an interactive one:
/// it waits for at most the batch request holding the turn and the one queued for it (0.6 s at
/// this rate; bound 1.5 s for a busy machine, and under a third of the slowest batch request's
/// wait, about 4 s). The upstream never sees the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_request_passes_queued_batch_ones() {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"ok": true})) }).await;
    let limits = "rate_limit = \"off\"\n[upstream.limits]\nrpm = 300\nburst = 1\n";
    let corral = Corral::start(&one_upstream(&upstream, limits)).await;
    let c = std::sync::Arc::new(client());
    let url = corral.url("/v1/chat/completions");
    let mut batch = Vec::new();
    for _ in 0..20 {
        let (c, url) = (std::sync::Arc::clone(&c), url.clone());
        batch.push(tokio::spawn(async move {
            let start = Instant::now();
            let (parts, _) = send(&c, with_priority(post(&url, "{}"), "batch")).await;
            (parts.status.as_u16(), start.elapsed())
        }));
    }
    // Let the batch requests queue.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    let (parts, _) = send(&c, with_priority(post(&url, "{}"), "interactive")).await;
    let interactive = start.elapsed();
    assert_eq!(parts.status, 200);
    let mut slowest = Duration::ZERO;
    for t in batch {
        let (status, took) = t.await.unwrap();
        assert_eq!(status, 200, "every batch request is served");
        slowest = slowest.max(took);
    }
    assert!(
        interactive < Duration::from_millis(1500),
        "interactive waited {interactive:?}"
    );
    assert!(
        slowest > interactive * 3,
        "the interactive request ({interactive:?}) did not pass the batch queue (slowest {slowest:?})"
    );
    let seen = upstream.seen.lock().unwrap();
    assert!(seen
        .iter()
        .all(|s| s.headers.get("x-corral-priority").is_none()));
}

/// A priority that is neither `interactive` nor `batch` gets corral's 400 `bad_priority`, and
/// never reaches the upstream; a route's `priority` is the default without the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_priority_is_refused() {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"ok": true})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "priority = \"batch\"\n")).await;
    let url = corral.url("/v1/chat/completions");
    let (parts, body) = send(&client(), with_priority(post(&url, "{}"), "urgent")).await;
    assert_eq!(parts.status, 400);
    assert_eq!(
        parts.headers[corral::error::CORRAL_ERROR_HEADER],
        "bad_priority"
    );
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("interactive"),
        "{error}"
    );
    assert_eq!(upstream.calls(), 0);
    for ok in ["batch", "Interactive", "BATCH"] {
        let (parts, _) = send(&client(), with_priority(post(&url, "{}"), ok)).await;
        assert_eq!(parts.status, 200, "{ok}");
    }
    let (parts, _) = send(&client(), post(&url, "{}")).await;
    assert_eq!(parts.status, 200);
}
