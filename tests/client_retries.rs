//! docs/design.md, Stacked retries: "Requests arriving with `x-stainless-retry-count > 0` are
//! counted in `corral_client_retries_total`" (the header the official SDKs send on their own
//! retries).

mod support;

use support::*;

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
