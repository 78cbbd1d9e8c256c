//! Nothing a config or a client may set makes corral panic: every duration at its bound (365
//! days; `500000000000y` used to pass `check-config` and then panic on every request) and the
//! largest `x-corral-deadline-ms` still serve, and `/metrics` counts no panic.

mod support;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::*;

/// Every duration key of an upstream at the longest value config validation allows.
const AT_THE_BOUND: &str = r#"
connect_timeout = "365d"
body_idle_timeout = "365d"
stream_idle_timeout = "365d"
[upstream.limits]
queue_timeout = "365d"
[upstream.retry]
base = "365d"
cap = "365d"
floor_jitter = "365d"
per_try_timeout = "365d"
deadline = "365d"
[upstream.breaker]
min_span = "365d"
cooldown = "365d"
max_cooldown = "365d"
healthy_reset = "365d"
release_ramp = "365d"
"#;

#[tokio::test]
async fn durations_at_their_bound_and_the_largest_client_deadline_serve() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let config = one_upstream(&upstream, AT_THE_BOUND)
        // The top-level connection and drain settings at their own bound, 1 h.
        .replace(
            "drain_timeout = \"5s\"",
            "drain_timeout = \"1h\"\ndrain_delay = \"1h\"\nfirst_byte_timeout = \"1h\"\nidle_timeout = \"1h\"\nhttp2_keep_alive_interval = \"1h\"",
        );
    let corral = Corral::start(&config).await;
    let c = client();
    for deadline in [None, Some(u64::MAX.to_string()), Some("0".into())] {
        let mut req = Request::post(corral.url("/v1/chat/completions"));
        if let Some(ms) = &deadline {
            req = req.header("x-corral-deadline-ms", ms);
        }
        let req = req.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
        let (parts, _) = send(&c, req).await;
        if deadline.as_deref() == Some("0") {
            // Due at once: answered or refused as past its deadline, never a panic's 500.
            assert_ne!(parts.status, 500, "{parts:?}");
        } else {
            assert_eq!(parts.status, 200, "deadline {deadline:?}: {parts:?}");
        }
    }
    let metrics = Request::get(corral.url("/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, text) = send(&c, metrics).await;
    let text = String::from_utf8(text.to_vec()).unwrap();
    assert!(
        text.contains("corral_panics_total{upstream=\"mock\"} 0"),
        "{text}"
    );
}
