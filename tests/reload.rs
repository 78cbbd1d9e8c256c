//! Hot reload: a valid config takes effect for new requests without dropping
//! in-flight ones, upstreams whose config is unchanged keep their state, an invalid config is
//! refused with a log line and the old one stays; `/status` and `/metrics` show the generation.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral::config;
use http::Request;
use http_body_util::Full;
use support::binary::{corral_command, Running};
use support::*;

fn two_routes(a: &MockUpstream, b: Option<&MockUpstream>, a_extra: &str) -> String {
    let mut toml = format!(
        "drain_timeout = \"5s\"\n[[upstream]]\nname = \"a\"\nroute = \"/a\"\nbase_url = \"http://{}/v1\"\n{a_extra}\n",
        a.addr
    );
    if let Some(b) = b {
        toml.push_str(&format!(
            "[[upstream]]\nname = \"b\"\nroute = \"/b\"\nbase_url = \"http://{}/v1\"\n",
            b.addr
        ));
    }
    toml
}

async fn status_of(corral: &Corral) -> serde_json::Value {
    let req = Request::get(corral.url("/status"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, body) = send(&client(), req).await;
    serde_json::from_slice(&body).unwrap()
}

/// A request in flight across two reloads finishes on the stack it started on: its
/// concurrency slot stays held on the old `a` until its answer ends, while the new `a` never
/// sees it.
#[tokio::test]
async fn a_reload_changes_routes_for_new_requests_and_keeps_unchanged_upstreams() {
    // `a` answers only when the test says so, so the request is surely in flight meanwhile.
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let a = MockUpstream::start({
        let release = Arc::clone(&release);
        move |_| {
            let release = Arc::clone(&release);
            async move {
                release.acquire().await.unwrap().forget();
                json(200, serde_json::json!({"from": "a"}))
            }
        }
    })
    .await;
    let b = MockUpstream::start(|_| async { json(200, serde_json::json!({"from": "b"})) }).await;
    let corral = Corral::start(&two_routes(&a, None, "")).await;
    let c = client();
    let (parts, _) = send(&c, post(&corral.url("/b/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 404, "no /b route yet");
    let before = Arc::clone(corral.app.upstream("a").as_ref().expect("a is routed"));

    // A request in flight on `a` while the config changes under it.
    let in_flight = tokio::spawn({
        let url = corral.url("/a/chat/completions");
        async move { send(&client(), post(&url, "{}")).await }
    });
    assert!(
        eventually(Duration::from_secs(10), || a.calls() == 1).await,
        "the request never reached `a`"
    );
    assert_eq!(before.state.window.in_use(), 1, "it holds a slot on `a`");

    let unchanged = config::load_str("reload.toml", &two_routes(&a, Some(&b), "")).unwrap();
    let summary = corral.app.reload(&unchanged);
    assert_eq!((summary.kept, summary.built, summary.removed), (1, 1, 0));
    let after = corral.app.upstream("a").expect("a is still routed");
    assert!(
        Arc::ptr_eq(&before, &after),
        "unchanged `a` kept as it was (learned limits, breaker, queue)"
    );
    let (parts, body) = send(&c, post(&corral.url("/b/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 200, "the new route serves at once");
    assert!(String::from_utf8_lossy(&body).contains("\"b\""));

    // Change `a` itself (its limits): a new stack for new requests.
    let changed = config::load_str(
        "reload.toml",
        &two_routes(&a, Some(&b), "[upstream.limits]\nmax_concurrency = 4\n"),
    )
    .unwrap();
    let summary = corral.app.reload(&changed);
    assert_eq!((summary.kept, summary.built, summary.removed), (1, 1, 1));
    let new_a = corral.app.upstream("a").unwrap();
    assert!(!Arc::ptr_eq(&before, &new_a));
    assert_eq!(
        (before.state.window.in_use(), new_a.state.window.in_use()),
        (1, 0),
        "the request in flight stays on the old stack, the new one is empty"
    );
    // A new request takes the new stack.
    let next = tokio::spawn({
        let url = corral.url("/a/chat/completions");
        async move { send(&client(), post(&url, "{}")).await }
    });
    assert!(
        eventually(Duration::from_secs(10), || a.calls() == 2).await,
        "the new request never reached `a`"
    );
    assert_eq!(
        (before.state.window.in_use(), new_a.state.window.in_use()),
        (1, 1),
        "a new request goes through the new stack"
    );

    release.add_permits(2);
    for (what, request) in [("in flight across two reloads", in_flight), ("new", next)] {
        let (parts, body) = request.await.unwrap();
        assert_eq!(parts.status, 200, "the request {what}");
        assert!(String::from_utf8_lossy(&body).contains("\"a\""));
    }
    assert_eq!(
        (before.state.window.in_use(), new_a.state.window.in_use()),
        (0, 0),
        "each slot went back to the stack it came from"
    );

    let status = status_of(&corral).await;
    assert_eq!(status["config_generation"], 3, "{status}");
    let limit = status["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "a")
        .unwrap()["concurrency"]["limit"]
        .clone();
    assert_eq!(limit, 4, "the new limit is in force: {status}");
    let metrics = corral.app.metrics().render();
    assert!(metrics.contains("corral_config_generation 3"), "{metrics}");
    assert!(metrics.contains("corral_config_reloads_total{outcome=\"applied\"} 2"));
}

/// The config generation `/status` reports.
async fn generation(corral: &Running) -> u64 {
    let (_, body) = corral.get(corral.addr, "/status").await;
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["config_generation"]
        .as_u64()
        .unwrap()
}

/// The real binary: SIGHUP re-reads the file; a broken file is refused with a log line and the
/// config in force stays.
#[tokio::test]
async fn sighup_rereads_the_file_and_refuses_a_broken_one() {
    let a = MockUpstream::start(|_| async { json(200, serde_json::json!({"from": "a"})) }).await;
    let b = MockUpstream::start(|_| async { json(200, serde_json::json!({"from": "b"})) }).await;
    let dir = std::env::temp_dir().join(format!("corral-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corral.toml");
    let listen = "listen = \"127.0.0.1:0\"\ndrain_delay = \"0s\"\n";
    std::fs::write(&path, format!("{listen}{}", two_routes(&a, None, ""))).unwrap();
    let corral = Running::spawn(
        corral_command(["--config".as_ref(), path.as_os_str()]),
        false,
    )
    .await;
    assert_eq!(generation(&corral).await, 1);

    std::fs::write(&path, format!("{listen}{}", two_routes(&a, Some(&b), ""))).unwrap();
    corral.signal("HUP");
    let mut reloaded = false;
    for _ in 0..100 {
        if generation(&corral).await == 2 {
            reloaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        reloaded,
        "no reload within 5 s; log:\n{}",
        corral.log().join("\n")
    );
    let (parts, _) = send(&client(), post(&corral.url("/b/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 200, "the new route serves");

    std::fs::write(&path, format!("{listen}[[upstream]]\nname = \"broken\"\n")).unwrap();
    corral.signal("HUP");
    let mut refused = false;
    for _ in 0..100 {
        if corral.log_has("config reload refused") {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        refused,
        "no refusal logged; log:\n{}",
        corral.log().join("\n")
    );
    assert_eq!(generation(&corral).await, 2, "the old config stays");
    let (parts, _) = send(&client(), post(&corral.url("/b/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 200, "and keeps serving");
    corral.sigterm();
    let (status, _) = corral.wait().await;
    assert!(status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reload that changes an upstream builds it a new stack, but what the upstream told corral
/// stays in force: `a`'s open breaker (60 s cool-down) still refuses at once without asking
/// `a`, and the partition `b`'s 429 paused for 60 s (one credential and model) still refuses
/// a request whose 5 s deadline the pause outlasts, without asking `b`.
#[tokio::test]
async fn a_changed_upstream_keeps_its_open_breaker_and_its_429_pause() {
    let a = MockUpstream::start(|_| async {
        json(503, serde_json::json!({"error": {"message": "down"}}))
    })
    .await;
    let b = MockUpstream::start(|_| async {
        let mut r = json(
            429,
            serde_json::json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}),
        );
        r.headers_mut()
            .insert("retry-after", http::HeaderValue::from_static("60"));
        r
    })
    .await;
    let toml = |limits: &str| {
        format!(
            "[[upstream]]\nname = \"a\"\nroute = \"/a\"\nbase_url = \"http://{}/v1\"\nrate_limit = \"off\"\n{limits}\
             [upstream.retry]\nmax_retries = 0\n\
             [upstream.breaker]\nmin_samples = 4\nmin_span = \"1ms\"\ncooldown = \"60s\"\nmax_cooldown = \"60s\"\non_open = \"reject\"\n\
             [[upstream]]\nname = \"b\"\nroute = \"/b\"\nbase_url = \"http://{}/v1\"\n{limits}\
             [upstream.retry]\ndeadline = \"5s\"\n",
            a.addr, b.addr
        )
    };
    let corral = Corral::start(&toml("")).await;
    let c = client();
    let request = |path: &str| {
        let mut req = post(&corral.url(path), r#"{"model":"gpt-4o"}"#);
        req.headers_mut().insert(
            "authorization",
            http::HeaderValue::from_static("Bearer k-1"),
        );
        req
    };
    let corrals = |parts: &http::response::Parts| {
        parts
            .headers
            .get(corral::error::CORRAL_ERROR_HEADER)
            .cloned()
    };
    let mut opened = false;
    for _ in 0..20 {
        let (parts, _) = send(&c, request("/a/chat/completions")).await;
        if corrals(&parts).is_some_and(|e| e == "circuit_open") {
            opened = true;
            break;
        }
    }
    assert!(opened, "a's breaker never opened");
    let (parts, _) = send(&c, request("/b/chat/completions")).await;
    assert_eq!(
        (parts.status.as_u16(), corrals(&parts)),
        (429, None),
        "b's own 429"
    );
    let (parts, _) = send(&c, request("/b/chat/completions")).await;
    assert!(corrals(&parts).is_some(), "paused: corral answers itself");
    let (a_calls, b_calls) = (a.calls(), b.calls());

    let changed = config::load_str(
        "reload.toml",
        &toml("[upstream.limits]\nmax_concurrency = 7\n"),
    )
    .unwrap();
    let summary = corral.app.reload(&changed);
    assert_eq!((summary.kept, summary.built, summary.removed), (0, 2, 2));
    let (parts, _) = send(&c, request("/a/chat/completions")).await;
    assert_eq!(
        (parts.status.as_u16(), corrals(&parts)),
        (503, Some(http::HeaderValue::from_static("circuit_open"))),
        "the breaker was reset by the reload"
    );
    let status = status_of(&corral).await;
    let a_status = status["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == "a")
        .unwrap();
    assert_eq!(a_status["breaker"], "open", "{a_status}");
    let (parts, _) = send(&c, request("/b/chat/completions")).await;
    assert_eq!(parts.status, 429);
    assert!(corrals(&parts).is_some(), "the 429 pause was forgotten");
    assert_eq!(
        (a.calls(), b.calls()),
        (a_calls, b_calls),
        "asked after the reload"
    );
}
