//! Key pools over real sockets through `server::run`: an upstream with `keys = [...]` spreads
//! requests over its keys, each with its own buckets, a request taking the key with the most
//! headroom; a key the upstream refuses for good (401, 403, a permanent 429) is set aside,
//! counted, and the request moves to the next key; a client's own key wins under
//! `header_mode = "if_absent"`; no key is shown in `/status` or `/metrics`; and the
//! configurations a pool needs are checked at load.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;
use tokio::time::Instant;

const KEY_A: &str = "sk-pool-a-SECRETVALUE";
const KEY_B: &str = "sk-pool-b-SECRETVALUE";

/// An upstream that answers by the key it is sent: `refuse(key)` gives a status and body, or
/// `None` for a 200.
/// How an upstream answers a key: a status and body, or `None` for a 200 naming the key.
type Refuse = fn(&str) -> Option<(u16, serde_json::Value)>;

async fn keyed_upstream(refuse: Refuse) -> MockUpstream {
    MockUpstream::start(move |seen| async move {
        let auth = seen
            .headers
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let key = auth.trim_start_matches("Bearer ");
        match refuse(key) {
            Some((status, body)) => json(status, body),
            None => json(200, serde_json::json!({"key": key})),
        }
    })
    .await
}

fn pool_config(upstream: &MockUpstream, extra: &str) -> String {
    format!(
        "[[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{}\"\n\
         keys = [\"{KEY_A}\", \"{KEY_B}\"]\n{extra}\n\
         [upstream.headers]\nAuthorization = \"Bearer {{key}}\"\n",
        upstream.url("/v1")
    )
}

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

/// The keys the upstream saw, in order.
fn keys_seen(upstream: &MockUpstream) -> Vec<String> {
    upstream.seen.lock().unwrap().iter().map(key_of).collect()
}

async fn get(corral: &Corral, path: &str) -> String {
    let req = http::Request::get(corral.url(path))
        .body(http_body_util::Full::default())
        .unwrap();
    let (_, body) = send(&client(), req).await;
    String::from_utf8(body.to_vec()).unwrap()
}

/// Idle keys take turns; each key has its own bucket (rpm 20, burst 1): two requests at once go
/// out at once on the two keys, where one key would have made the second wait 3 s; a third
/// waits for a key's bucket (3 s). Bounds: 2.5 s either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_spread_over_the_keys_each_with_its_own_bucket() {
    let upstream = keyed_upstream(|_| None).await;
    let limits = "[upstream.limits]\nrpm = 20\nburst = 1\n";
    let toml = pool_config(&upstream, "")
        .replace("[upstream.headers]", &format!("{limits}[upstream.headers]"));
    let corral = Corral::start(&toml).await;
    let c = std::sync::Arc::new(client());
    let url = corral.url("/v1/chat/completions");
    let start = Instant::now();
    let (a, b) = tokio::join!(send(&c, post(&url, "{}")), send(&c, post(&url, "{}")));
    assert_eq!((a.0.status.as_u16(), b.0.status.as_u16()), (200, 200));
    // Bound: 2.5 s for two unpaced requests on a busy machine (one shared bucket: 3 s).
    let both = start.elapsed();
    assert!(
        both < Duration::from_millis(2500),
        "two keys, two buckets: {both:?}"
    );
    let mut seen = keys_seen(&upstream);
    seen.sort();
    assert_eq!(seen, [KEY_A, KEY_B], "one request per key");
    let (third, _) = send(&c, post(&url, "{}")).await;
    assert_eq!(third.status, 200);
    let paced = start.elapsed();
    assert!(
        paced >= Duration::from_millis(2500),
        "the third was not paced: {paced:?}"
    );

    // The keys show nowhere; /status names them by number and fingerprint.
    let status = get(&corral, "/status").await;
    let metrics = get(&corral, "/metrics").await;
    for (what, text) in [("/status", &status), ("/metrics", &metrics)] {
        assert!(!text.contains("SECRETVALUE"), "{what} shows a key:\n{text}");
    }
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let keys = &status["upstreams"][0]["rate_limit"]["keys"];
    assert_eq!(keys.as_array().map(Vec::len), Some(2), "{status}");
    assert_eq!(keys[0]["key"], 1);
    assert_eq!(
        keys[0]["fingerprint"].as_str().map(str::len),
        Some(8),
        "{keys}"
    );
    assert_ne!(keys[0]["fingerprint"], keys[1]["fingerprint"]);
    assert!(keys[0]["limits"]["config_requests"].is_object(), "{keys}");
}

/// Without limits, ten requests one after another alternate between the two keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keys_take_turns() {
    let upstream = keyed_upstream(|_| None).await;
    let corral = Corral::start(&pool_config(&upstream, "")).await;
    let c = client();
    for _ in 0..10 {
        let (parts, _) = send(&c, post(&corral.url("/v1/chat/completions"), "{}")).await;
        assert_eq!(parts.status, 200);
    }
    let seen = keys_seen(&upstream);
    let a = seen.iter().filter(|k| *k == KEY_A).count();
    assert_eq!((a, seen.len() - a), (5, 5), "{seen:?}");
}

/// docs/design.md, Key pools: "A request takes the key with the most headroom: one no 429 has
/// paused, then the one with the fewest requests in flight or waiting for its buckets; ties go
/// round in turn."
///
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

/// A key refused for good (401, 403, or a permanent 429 such as `insufficient_quota`) is set
/// aside: the request that met the refusal moves to the other key and succeeds, the key is not
/// tried again within its cool-down, and `corral_keys_set_aside_total` counts it by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_key_is_set_aside_and_the_request_moves_on() {
    fn unauthorized(key: &str) -> Option<(u16, serde_json::Value)> {
        (key == KEY_A).then(|| (401, serde_json::json!({"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}})))
    }
    fn forbidden(key: &str) -> Option<(u16, serde_json::Value)> {
        (key == KEY_A).then(|| (403, serde_json::json!({"error": {"message": "forbidden"}})))
    }
    fn out_of_quota(key: &str) -> Option<(u16, serde_json::Value)> {
        (key == KEY_A).then(|| (429, serde_json::json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}})))
    }
    let cases: [(Refuse, &str); 3] = [
        (unauthorized, "401"),
        (forbidden, "403"),
        (out_of_quota, "quota"),
    ];
    for (refuse, reason) in cases {
        let upstream = keyed_upstream(refuse).await;
        let corral = Corral::start(&pool_config(&upstream, "")).await;
        let c = client();
        for i in 0..6 {
            let (parts, body) = send(&c, post(&corral.url("/v1/chat/completions"), "{}")).await;
            assert_eq!(
                parts.status,
                200,
                "{reason}, request {i}: {}",
                String::from_utf8_lossy(&body)
            );
            let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(answer["key"], KEY_B);
        }
        let seen = keys_seen(&upstream);
        assert_eq!(
            seen.iter().filter(|k| *k == KEY_A).count(),
            1,
            "{reason}: the refused key was tried again within its cool-down: {seen:?}"
        );
        let metrics = get(&corral, "/metrics").await;
        let line = format!(r#"corral_keys_set_aside_total{{reason="{reason}",upstream="mock"}} 1"#);
        assert!(metrics.contains(&line), "no `{line}` in\n{metrics}");
        let status: serde_json::Value =
            serde_json::from_str(&get(&corral, "/status").await).unwrap();
        let keys = &status["upstreams"][0]["rate_limit"]["keys"];
        assert_eq!(keys[0]["set_aside_for"], reason, "{keys}");
        assert!(keys[0]["set_aside_ms"].as_u64().unwrap() > 50_000, "{keys}");
        assert!(keys[1]["set_aside_for"].is_null(), "{keys}");
    }
}

/// Every key refused (out of quota: a 401 or a 403 from two keys blames the request instead,
/// below): each is tried once, and the last refusal reaches the client as the upstream sent it.
/// After `key_cooldown` the keys are tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_key_refused_the_refusal_passes_through_until_the_cooldown_ends() {
    let upstream = keyed_upstream(|_| {
        Some((
            429,
            serde_json::json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "code": "insufficient_quota"}}),
        ))
    })
    .await;
    let corral = Corral::start(&pool_config(&upstream, "key_cooldown = \"1s\"")).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let (parts, body) = send(&c, post(&url, "{}")).await;
    assert_eq!(parts.status, 429);
    assert!(parts
        .headers
        .get(corral::error::CORRAL_ERROR_HEADER)
        .is_none());
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["error"]["code"], "insufficient_quota");
    assert_eq!(upstream.calls(), 2, "each key once");
    // Both aside: the next request still goes out (on the key whose cool-down ends first)
    // rather than being refused by corral, and its refusal passes through.
    let (parts, _) = send(&c, post(&url, "{}")).await;
    assert_eq!(parts.status, 429);
    assert_eq!(upstream.calls(), 3);
    // After the cool-down (1 s), both keys are tried again.
    let pool = || {
        corral
            .app
            .upstream("mock")
            .unwrap()
            .state
            .rate_limit
            .status()["keys"]
            .clone()
    };
    let aside = |keys: serde_json::Value| {
        keys.as_array()
            .unwrap()
            .iter()
            .filter(|k| !k["set_aside_for"].is_null())
            .count()
    };
    assert_eq!(aside(pool()), 2, "both keys set aside: {}", pool());
    assert!(
        eventually(Duration::from_secs(10), || aside(pool()) == 0).await,
        "the keys' cool-down never ended: {}",
        pool()
    );
    let (parts, _) = send(&c, post(&url, "{}")).await;
    assert_eq!(parts.status, 429);
    assert_eq!(upstream.calls(), 5);
}

/// `header_mode = "if_absent"` (the default): a client that brings its own key keeps it; the
/// pool serves the others. With `always`, the pool's key replaces the client's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_key_wins_under_if_absent() {
    for (mode, want_own) in [("if_absent", true), ("always", false)] {
        let upstream = keyed_upstream(|_| None).await;
        let corral = Corral::start(&pool_config(
            &upstream,
            &format!("header_mode = \"{mode}\""),
        ))
        .await;
        let mut req = post(&corral.url("/v1/chat/completions"), "{}");
        req.headers_mut()
            .insert("authorization", "Bearer sk-client-own".parse().unwrap());
        let (parts, _) = send(&client(), req).await;
        assert_eq!(parts.status, 200);
        let seen = keys_seen(&upstream);
        assert_eq!(seen[0] == "sk-client-own", want_own, "{mode}: {seen:?}");
        let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), "{}")).await;
        assert_eq!(parts.status, 200);
        assert!([KEY_A, KEY_B].contains(&keys_seen(&upstream)[1].as_str()));
    }
}

/// What a pool needs, checked at load: the file, the key and the reason.
#[test]
fn a_pool_without_its_template_or_with_a_repeated_key_is_refused() {
    let load = |keys: &str, headers: &str| {
        let toml = format!(
            "[[upstream]]\nname = \"a\"\nroute = \"/v1\"\nbase_url = \"http://127.0.0.1:9/v1\"\n{keys}\n\
             [upstream.headers]\n{headers}\n"
        );
        corral::config::load_str("corral.toml", &toml)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let keys = "keys = [\"sk-1\", \"sk-2\"]";
    assert_eq!(load(keys, "Authorization = \"Bearer {key}\""), Ok(()));
    let no_template = load(keys, "Authorization = \"Bearer sk-fixed\"").unwrap_err();
    assert!(
        no_template.starts_with("corral.toml:")
            && no_template.contains("upstream[0].keys")
            && no_template.contains("{key}"),
        "{no_template}"
    );
    let repeated = load(
        "keys = [\"sk-1\", \"sk-1\"]",
        "Authorization = \"Bearer {key}\"",
    )
    .unwrap_err();
    assert!(repeated.contains("key 2 repeats key 1"), "{repeated}");
    assert!(
        !repeated.contains("sk-1"),
        "the error shows a key: {repeated}"
    );
    let unfilled = load("", "Authorization = \"Bearer {key}\"").unwrap_err();
    assert!(
        unfilled.contains("upstream[0].headers") && unfilled.contains("no `keys`"),
        "{unfilled}"
    );
}

/// A 403 that two keys give the same request is the request's doing (a model or a region the
/// account may not use), not the keys': the 403 goes to the client after two tries, and both
/// keys stay in use (the next request is served). A 403 from one key only still sets it aside
/// (`a_refused_key_is_set_aside_and_the_request_moves_on`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_403_every_key_gives_is_the_requests_not_the_keys() {
    let upstream = MockUpstream::start(|seen| async move {
        if seen.uri.path().ends_with("/forbidden") {
            json(
                403,
                serde_json::json!({"error": {"message": "unsupported_country_region_territory"}}),
            )
        } else {
            json(200, serde_json::json!({"ok": true}))
        }
    })
    .await;
    let corral = Corral::start(&pool_config(&upstream, "")).await;
    let (parts, _) = send(&client(), post(&corral.url("/v1/forbidden"), "{}")).await;
    assert_eq!(parts.status, 403);
    assert_eq!(upstream.calls(), 2, "tried on two keys, then given back");
    let status: serde_json::Value = serde_json::from_str(&get(&corral, "/status").await).unwrap();
    let keys = &status["upstreams"][0]["rate_limit"]["keys"];
    assert!(
        keys[0]["set_aside_for"].is_null() && keys[1]["set_aside_for"].is_null(),
        "{keys}"
    );
    for _ in 0..4 {
        let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), "{}")).await;
        assert_eq!(parts.status, 200);
    }
    let seen = keys_seen(&upstream);
    assert!(
        seen[2..].contains(&KEY_A.to_owned()) && seen[2..].contains(&KEY_B.to_owned()),
        "{seen:?}"
    );
}

/// A 401 that two keys give the same request is the request's doing too (a bad
/// `OpenAI-Organization` header the client sent), not the keys': one such request does not set
/// every key aside in turn. The 401 goes to the client after two tries and all three keys stay
/// in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_401_two_keys_give_one_request_is_the_requests_not_the_keys() {
    let upstream = MockUpstream::start(|seen| async move {
        if seen.headers.contains_key("openai-organization") {
            json(
                401,
                serde_json::json!({"error": {"message": "No such organization: org-bad", "code": "invalid_organization"}}),
            )
        } else {
            json(200, serde_json::json!({"ok": true}))
        }
    })
    .await;
    let toml =
        pool_config(&upstream, "").replace("keys = [", "keys = [\"sk-pool-c-SECRETVALUE\", ");
    let corral = Corral::start(&toml).await;
    let mut req = post(&corral.url("/v1/chat/completions"), "{}");
    req.headers_mut()
        .insert("openai-organization", "org-bad".parse().unwrap());
    let (parts, body) = send(&client(), req).await;
    assert_eq!(parts.status, 401);
    let answer: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        answer["error"]["code"], "invalid_organization",
        "as it came"
    );
    assert_eq!(upstream.calls(), 2, "tried on two keys, then given back");
    let status: serde_json::Value = serde_json::from_str(&get(&corral, "/status").await).unwrap();
    let keys = status["upstreams"][0]["rate_limit"]["keys"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(keys.len(), 3);
    assert!(
        keys.iter().all(|k| k["set_aside_for"].is_null()),
        "{keys:?}"
    );
}

/// Providers limit a key per model (OpenAI: per project and model), so each pooled key has a
/// partition per model: a 429 that pauses key A for one model leaves key A in turn for
/// another model, while requests for the paused model go to key B. (One partition per key put
/// every model's requests on key B.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_key_paused_for_one_model_still_serves_another() {
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let once = std::sync::Arc::clone(&refused);
    let upstream = MockUpstream::start(move |seen| {
        let once = std::sync::Arc::clone(&once);
        async move {
            let auth = seen.headers["authorization"].to_str().unwrap().to_owned();
            let key = auth.trim_start_matches("Bearer ").to_owned();
            let body: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
            let first_slow_on_a = key == KEY_A
                && body["model"] == "slow"
                && !once.swap(true, std::sync::atomic::Ordering::SeqCst);
            if first_slow_on_a {
                let mut r = json(
                    429,
                    serde_json::json!({"error": {"message": "Rate limit reached for slow", "type": "requests", "code": "rate_limit_exceeded"}}),
                );
                r.headers_mut()
                    .insert("retry-after", http::HeaderValue::from_static("30"));
                return r;
            }
            json(200, serde_json::json!({"key": key, "model": body["model"]}))
        }
    })
    .await;
    // No retries: the 429 comes back to the client and leaves (A, slow) paused for 30 s.
    let toml = pool_config(&upstream, "").replace(
        "[upstream.headers]",
        "[upstream.retry]\nmax_retries = 0\nmax_throttle_retries = 0\n[upstream.headers]",
    );
    let corral = Corral::start(&toml).await;
    let c = client();
    let url = corral.url("/v1/chat/completions");
    let slow = r#"{"model":"slow","messages":[]}"#;
    let fast = r#"{"model":"fast","messages":[]}"#;
    let (first, _) = send(&c, post(&url, slow)).await;
    assert_eq!(first.status, 429, "key A refused model slow");
    assert_eq!(keys_seen(&upstream), [KEY_A]);
    let mut key_of = Vec::new();
    for body in [fast, fast, slow, slow] {
        let (parts, answer) = send(&c, post(&url, body)).await;
        assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&answer));
        let answer: serde_json::Value = serde_json::from_slice(&answer).unwrap();
        key_of.push(answer["key"].as_str().unwrap().to_owned());
    }
    let mut fast_keys = key_of[..2].to_vec();
    fast_keys.sort();
    assert_eq!(
        fast_keys,
        [KEY_A, KEY_B],
        "model fast takes turns on both keys"
    );
    assert_eq!(
        key_of[2..],
        [KEY_B, KEY_B],
        "model slow avoids key A, paused for it"
    );
}
