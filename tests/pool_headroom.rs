//! docs/design.md, Key pools: "A request takes the key with the most headroom: one no 429 has
//! paused, then the one with the fewest requests in flight or waiting for its buckets; ties go
//! round in turn."

mod support;

use std::sync::{Arc, Mutex};

use support::*;

const KEY_A: &str = "sk-pool-a-SECRETVALUE";
const KEY_B: &str = "sk-pool-b-SECRETVALUE";

/// The key a request the upstream saw carried.
fn key_of(seen: &Seen) -> String {
    let auth = seen
        .headers
        .get("authorization")
        .map(|v| v.to_str().unwrap());
    auth.unwrap_or_default()
        .trim_start_matches("Bearer ")
        .to_owned()
}

/// Two idle keys take turns; once the upstream answers one key a 429 that pauses it for 20 s
/// (`retry-after: 20`), the throttled request is resent on the other key, and the next ten
/// requests all go there while the pause lasts (they take milliseconds; the pause 20 s), where
/// turns alone would have sent five of them to the paused key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_takes_a_key_no_429_has_paused() {
    let throttled: Arc<Mutex<Option<String>>> = Arc::default();
    let first = Arc::clone(&throttled);
    let upstream = MockUpstream::start(move |seen| {
        let key = key_of(&seen);
        let mut first = first.lock().unwrap();
        let refuse = first.is_none();
        if refuse {
            *first = Some(key.clone());
        }
        async move {
            if refuse {
                http::Response::builder()
                    .status(429)
                    .header("content-type", "application/json")
                    .header("retry-after", "20")
                    .body(corral::body::full(
                        serde_json::json!({"error": {"message": "slow down", "code": "rate_limit_exceeded"}})
                            .to_string(),
                    ))
                    .unwrap()
            } else {
                json(200, serde_json::json!({"key": key}))
            }
        }
    })
    .await;
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{}\"\n\
         keys = [\"{KEY_A}\", \"{KEY_B}\"]\n\
         [upstream.headers]\nAuthorization = \"Bearer {{key}}\"\n",
        upstream.url("/v1")
    ))
    .await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    for n in 0..11 {
        let (parts, _) = send(&c, post(&url, "{}")).await;
        assert_eq!(parts.status, 200, "request {n}");
    }
    let paused = throttled
        .lock()
        .unwrap()
        .clone()
        .expect("a key was throttled");
    let seen: Vec<String> = upstream.seen.lock().unwrap().iter().map(key_of).collect();
    assert_eq!(
        seen.len(),
        12,
        "the throttled request resent once: {seen:?}"
    );
    assert_eq!(seen[0], paused);
    assert!(
        seen[1..].iter().all(|k| *k != paused),
        "a request went to the paused key: {seen:?}"
    );
    let status = corral
        .app
        .upstream("mock")
        .unwrap()
        .state
        .rate_limit
        .status();
    let keys = status["keys"].as_array().unwrap();
    let paused_ms: Vec<_> = keys
        .iter()
        .map(|k| k["limits"]["paused_ms"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(
        paused_ms.iter().filter(|ms| **ms > 0).count(),
        1,
        "one key paused: {status}"
    );
}
