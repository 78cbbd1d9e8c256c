//! Priorities over real sockets: `x-corral-priority: interactive | batch`
//! (default per route) puts interactive requests ahead of queued batch ones at the rate limiter;
//! the header is corral's and never reaches the upstream; any other value is refused with a 400.

mod support;

use std::time::Duration;

use support::*;

fn with_priority(
    mut req: http::Request<http_body_util::Full<bytes::Bytes>>,
    priority: &str,
) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    req.headers_mut()
        .insert("x-corral-priority", priority.parse().unwrap());
    req
}

/// How many batch requests reached the upstream ahead of an interactive one sent while 20
/// batch requests queue for 5 tokens a second (a bucket of one): those that went upstream after
/// the interactive request arrived and before it did. `route` is the upstream table's extra
/// TOML; `batch_header` the `x-corral-priority` the batch requests send, if any. No timing
/// bounds: the answer is an order, read from what the upstream saw.
async fn batch_ahead_of_interactive(route: &str, batch_header: Option<&str>) -> usize {
    let upstream =
        MockUpstream::start(|_| async { json(200, serde_json::json!({"ok": true})) }).await;
    let limits = format!("rate_limit = \"off\"\n{route}[upstream.limits]\nrpm = 300\nburst = 1\n");
    let corral = Corral::start(&one_upstream(&upstream, &limits)).await;
    let c = std::sync::Arc::new(client());
    let url = corral.url("/v1/chat/completions");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut batch = Vec::new();
    for i in 0..20 {
        let (c, url, done) = (
            std::sync::Arc::clone(&c),
            url.clone(),
            std::sync::Arc::clone(&done),
        );
        let batch_header = batch_header.map(str::to_owned);
        batch.push(tokio::spawn(async move {
            let mut req = post(&url, &format!("{{\"n\": {i}}}"));
            if let Some(p) = batch_header {
                req = with_priority(req, &p);
            }
            let (parts, _) = send(&c, req).await;
            done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            parts.status.as_u16()
        }));
    }
    // Every batch request is inside corral: served, or in flight (waiting at the rate limiter).
    let a = corral.app.upstream("mock").unwrap();
    let inside =
        || a.metrics.in_flight.get() as usize + done.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || inside() == 20).await,
        "the batch requests never all arrived ({} of 20)",
        inside()
    );
    let served_before = upstream.calls();
    assert!(
        served_before < 15,
        "the batch queue drained before the interactive request ({served_before} served)"
    );
    let (parts, _) = send(
        &c,
        with_priority(post(&url, r#"{"n": "interactive"}"#), "interactive"),
    )
    .await;
    assert_eq!(parts.status, 200);
    for t in batch {
        assert_eq!(t.await.unwrap(), 200, "every batch request is served");
    }
    let seen = upstream.seen.lock().unwrap();
    assert!(seen
        .iter()
        .all(|s| s.headers.get("x-corral-priority").is_none()));
    let at = seen
        .iter()
        .position(|s| s.body.as_ref() == br#"{"n": "interactive"}"#)
        .expect("the interactive request reached the upstream");
    at - served_before
}

/// An interactive request passes queued batch ones: at most the batch request holding the turn and
/// the one queued for it go first (docs/design.md, Priorities: two batch requests' worth of
/// capacity), plus one that may be on its way upstream as the interactive request arrives. In
/// arrival order it would be behind about 18. The upstream never sees the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interactive_request_passes_queued_batch_ones() {
    let ahead = batch_ahead_of_interactive("", Some("batch")).await;
    assert!(
        ahead <= 3,
        "{ahead} batch requests went ahead of the interactive one"
    );
}

/// A route's `priority = "batch"` applies to requests that send no `x-corral-priority`: they
/// queue as batch, and an interactive request passes them as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_default_priority_applies_to_requests_without_the_header() {
    let ahead = batch_ahead_of_interactive("priority = \"batch\"\n", None).await;
    assert!(
        ahead <= 3,
        "{ahead} requests went ahead of the interactive one: the route's batch default was not applied"
    );
}

/// A priority that is neither `interactive` nor `batch` gets corral's 400 `bad_priority`, and
/// never reaches the upstream; valid values in any case, and none, are served on a route whose
/// default is `batch`.
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
