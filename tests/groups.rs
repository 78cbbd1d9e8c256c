//! Groups and fallback over real sockets through `server::run`: a route served
//! by an ordered list of upstreams, moving to the next on a permanent 429 (and passing the
//! member over for its cool-down), an open breaker, no capacity within `fallback_wait` of the
//! deadline, or spent retries; never otherwise; `x-corral-upstream` on every answer; `model`
//! rewritten per member; and the configurations a group needs checked at load.

mod support;

use std::time::Duration;

use support::group::{group_config, ok, quota, BODY};
use support::*;
use tokio::time::Instant;

async fn chat(corral: &Corral) -> (http::response::Parts, bytes::Bytes) {
    send(&client(), post(&corral.url("/v1/chat/completions"), BODY)).await
}

fn member(parts: &http::response::Parts) -> &str {
    parts.headers["x-corral-upstream"].to_str().unwrap()
}

fn metric(corral: &Corral, line: &str) -> bool {
    corral.app.metrics().render().contains(line)
}

/// Primary out of quota for good: every request is answered by the backup; after the first
/// permanent 429 the primary is passed over for the group's cool-down instead of being asked
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_out_of_quota_falls_back_and_is_passed_over() {
    let (primary, backup) = (always(429, quota()).await, always(200, ok()).await);
    let corral = Corral::start(&group_config(&primary, "", &backup, "", "")).await;
    for i in 0..5 {
        let (parts, body) = chat(&corral).await;
        assert_eq!(
            parts.status,
            200,
            "request {i}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(member(&parts), "backup");
    }
    assert_eq!(primary.calls(), 1, "passed over after its permanent 429");
    assert_eq!(backup.calls(), 5);
    for line in [
        r#"corral_group_fallbacks_total{group="chat",reason="permanent_429",upstream="primary"} 1"#,
        r#"corral_group_fallbacks_total{group="chat",reason="unavailable",upstream="primary"} 4"#,
        r#"corral_group_answers_total{group="chat",upstream="backup"} 5"#,
    ] {
        assert!(metric(&corral, line), "no `{line}`");
    }
    let req = http::Request::get(corral.url("/status"))
        .body(http_body_util::Full::default())
        .unwrap();
    let (_, status) = send(&client(), req).await;
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    let group = &status["groups"][0];
    assert_eq!(group["name"], "chat");
    assert_eq!(group["members"][0]["upstream"], "primary");
    assert!(
        group["members"][0]["set_aside_ms"].as_u64().unwrap() > 50_000,
        "{group}"
    );
    assert!(group["members"][1]["set_aside_ms"].is_null(), "{group}");
}

/// A reload rebuilds the groups but keeps what they learned: the primary's cool-down after its
/// permanent 429 survives a reload that changes both the primary and the group, so the
/// primary is still passed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_cool_down_survives_a_reload() {
    let (primary, backup) = (always(429, quota()).await, always(200, ok()).await);
    let corral = Corral::start(&group_config(&primary, "", &backup, "", "")).await;
    assert_eq!(member(&chat(&corral).await.0), "backup");
    assert_eq!(primary.calls(), 1);
    let changed = group_config(
        &primary,
        "[upstream.limits]\nmax_concurrency = 7\n",
        &backup,
        "",
        "fallback_wait = 0.5",
    );
    let summary = corral
        .app
        .reload(&corral::config::load_str("reload.toml", &changed).unwrap());
    assert_eq!(
        (summary.kept, summary.built),
        (1, 1),
        "the primary was rebuilt"
    );
    for _ in 0..3 {
        assert_eq!(member(&chat(&corral).await.0), "backup");
    }
    assert_eq!(
        primary.calls(),
        1,
        "the reload ended the primary's cool-down"
    );
}

/// A primary whose retries are spent on 503s (max_retries = 1: two calls) falls back; once its
/// breaker opens the primary is not asked at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spent_retries_fall_back_and_an_open_breaker_is_skipped() {
    let (primary, backup) = (
        always(503, serde_json::json!({"error": {"message": "down"}})).await,
        always(200, ok()).await,
    );
    let primary_extra = "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 1\nbase = \"10ms\"\ncap = \"10ms\"\n\
                         [upstream.breaker]\nmin_samples = 4\nmin_span = \"1ms\"\n";
    let corral = Corral::start(&group_config(&primary, primary_extra, &backup, "", "")).await;
    let (parts, _) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!(
        primary.calls(),
        2,
        "one attempt and one retry, then the backup"
    );
    let mut opened_at = None;
    for i in 0..10 {
        let (parts, _) = chat(&corral).await;
        assert_eq!(
            (parts.status.as_u16(), member(&parts)),
            (200, "backup"),
            "request {i}"
        );
        if opened_at.is_none()
            && metric(
                &corral,
                r#"corral_group_fallbacks_total{group="chat",reason="unavailable",upstream="primary"} 1"#,
            )
        {
            opened_at = Some(primary.calls());
        }
    }
    let calls = opened_at.expect("the primary's breaker never opened");
    assert_eq!(
        primary.calls(),
        calls,
        "the open breaker's upstream was still asked"
    );
}

/// A primary with no capacity within `fallback_wait` of the deadline (one token a second, a
/// bucket of one; deadline 2 s, fallback_wait 0.25: 500 ms) sends the others to the backup at
/// once instead of queueing them; the backup's own answers come within that bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_capacity_within_the_share_of_the_deadline_falls_back() {
    let (primary, backup) = (always(200, ok()).await, always(200, ok()).await);
    let primary_extra =
        "[upstream.limits]\nrpm = 60\nburst = 1\n[upstream.retry]\ndeadline = \"2s\"\n";
    let corral = Corral::start(&group_config(
        &primary,
        primary_extra,
        &backup,
        "",
        "fallback_wait = 0.25",
    ))
    .await;
    let start = Instant::now();
    let c = std::sync::Arc::new(client());
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (
                std::sync::Arc::clone(&c),
                corral.url("/v1/chat/completions"),
            );
            tokio::spawn(async move {
                let (parts, _) = send(&c, post(&url, BODY)).await;
                (parts.status.as_u16(), member(&parts).to_owned())
            })
        })
        .collect();
    let mut members = Vec::new();
    for t in tasks {
        let (status, member) = t.await.unwrap();
        assert_eq!(status, 200);
        members.push(member);
    }
    members.sort();
    assert_eq!(members, ["backup", "backup", "primary"]);
    // Bound: under the primary's second next token (2 s), which waiting there would take.
    let took = start.elapsed();
    assert!(took < Duration::from_millis(1900), "{took:?}");
    assert!(metric(
        &corral,
        r#"corral_group_fallbacks_total{group="chat",reason="no_capacity",upstream="primary"} 2"#
    ));
}

/// What does not move a request: an answer the member gives for good (200, 400) is the
/// client's; with every member failing, the last one's answer passes through as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_for_good_stay_and_the_last_members_failure_passes_through() {
    let bad = serde_json::json!({"error": {"message": "bad model", "code": "model_not_found"}});
    let (primary, backup) = (always(400, bad.clone()).await, always(200, ok()).await);
    let corral = Corral::start(&group_config(&primary, "", &backup, "", "")).await;
    let (parts, body) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (400, "primary"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        bad
    );
    assert_eq!(backup.calls(), 0);

    let down = serde_json::json!({"error": {"message": "down"}});
    let (primary, backup) = (
        always(503, down.clone()).await,
        always(503, down.clone()).await,
    );
    let no_retry = "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 0\n";
    let corral = Corral::start(&group_config(&primary, no_retry, &backup, no_retry, "")).await;
    let (parts, body) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (503, "backup"));
    assert_upstreams_answer(&parts, &body, &down);
    assert_eq!((primary.calls(), backup.calls()), (1, 1));
}

/// A member's `model` rewrites the JSON body's model for that member only; each member gets the
/// path after the group's route under its own base URL, and its own headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_model_and_headers_are_its_own() {
    let (primary, backup) = (always(429, quota()).await, always(200, ok()).await);
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\n[upstream.headers]\nAuthorization = \"Bearer sk-primary\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\n[upstream.headers]\napi-key = \"azure-key\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", {{ upstream = \"backup\", model = \"gpt-4o-mini\" }}]\n",
        primary.url("/openai/v1"),
        backup.url("/azure"),
    );
    let corral = Corral::start(&toml).await;
    let (parts, _) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    let (p, b) = (primary.last(), backup.last());
    assert_eq!(p.uri.path(), "/openai/v1/chat/completions");
    assert_eq!(b.uri.path(), "/azure/chat/completions");
    let model = |body: &bytes::Bytes| {
        serde_json::from_slice::<serde_json::Value>(body).unwrap()["model"].clone()
    };
    assert_eq!(model(&p.body), "gpt-4o");
    assert_eq!(model(&b.body), "gpt-4o-mini");
    assert_eq!(p.headers["authorization"], "Bearer sk-primary");
    assert!(b.headers.get("authorization").is_none());
    assert_eq!(b.headers["api-key"], "azure-key");
}

/// A member's `model` changes the body's model value and nothing else: an integer beyond u64,
/// odd whitespace and key order reach the member byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewritten_body_keeps_every_byte_but_the_model() {
    let (primary, backup) = (always(429, quota()).await, always(200, ok()).await);
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", {{ upstream = \"backup\", model = \"gpt-4o-mini\" }}]\n",
        primary.url("/v1"),
        backup.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    let body = "{ \"seed\" :123456789012345678901234567890,\n\t\"model\"\t: \"gpt-4o\" ,\
                \"temperature\":0.70 ,\"messages\":[ ] }\n";
    let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), body)).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!(
        &primary.last().body[..],
        body.as_bytes(),
        "no model of its own"
    );
    let want = body.replace("\"gpt-4o\"", "\"gpt-4o-mini\"");
    assert_eq!(String::from_utf8_lossy(&backup.last().body), want);
}

/// A POST to `path` with an `Idempotency-Key` when `key` is set.
async fn post_to(corral: &Corral, path: &str, key: bool) -> (u16, String) {
    let mut req = post(&corral.url(path), BODY);
    if key {
        req.headers_mut()
            .insert("idempotency-key", http::HeaderValue::from_static("k-1"));
    }
    let (parts, _) = send(&client(), req).await;
    (parts.status.as_u16(), member(&parts).to_owned())
}

/// A request not safe to send twice (a `/files` or `/batches` POST) stays with a member that
/// may have acted on it: a 5xx or a per-try timeout goes to the client as the member's answer,
/// and the backup never sees the request. An allow-listed path, an `Idempotency-Key`, a GET or
/// a path added to `repeatable_paths` moves on as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_not_safe_to_repeat_stays_with_a_member_that_may_have_acted_on_it() {
    let no_retry = "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 0\n";
    let (primary, backup) = (
        always(503, serde_json::json!({"error": {"message": "down"}})).await,
        always(200, ok()).await,
    );
    let group = "repeatable_paths = [\"/chat/completions\", \"/files\"]";
    let corral = Corral::start(&group_config(&primary, no_retry, &backup, "", group)).await;
    assert_eq!(
        post_to(&corral, "/v1/batches", false).await,
        (503, "primary".into())
    );
    assert_eq!(backup.calls(), 0, "a 5xx may come after the work was done");
    assert_eq!(
        post_to(&corral, "/v1/batches", true).await,
        (200, "backup".into())
    );
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "backup".into())
    );
    assert_eq!(
        post_to(&corral, "/v1/chat/completions", false).await,
        (200, "backup".into())
    );
    let get = http::Request::get(corral.url("/v1/batches/b-1"))
        .body(http_body_util::Full::default())
        .unwrap();
    let (parts, _) = send(&client(), get).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!((primary.calls(), backup.calls()), (5, 4));

    // A per-try timeout (200 ms against a member that answers after 5 s): the request may be
    // running there.
    let slow_primary = slow(Duration::from_secs(5)).await;
    let timeout = format!("{no_retry}per_try_timeout = \"200ms\"\n");
    let corral = Corral::start(&group_config(&slow_primary, &timeout, &backup, "", "")).await;
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (504, "primary".into())
    );
    assert_eq!(backup.calls(), 4, "the backup was not asked");
    assert_eq!(
        post_to(&corral, "/v1/embeddings", false).await,
        (200, "backup".into())
    );
}

/// A request not safe to send twice still moves on from a member that certainly did not act
/// on it: the connection was refused, the member answered 429 (out of quota, nothing done), or
/// corral itself had no capacity for it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_not_safe_to_repeat_moves_on_from_a_member_that_never_acted_on_it() {
    let backup = always(200, ok()).await;
    let no_retry = "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 0\n";
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"http://{closed}/v1\"\n{no_retry}\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"backup\"]\n",
        backup.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "backup".into())
    );

    let quota_primary = always(429, quota()).await;
    let corral = Corral::start(&group_config(&quota_primary, "", &backup, "", "")).await;
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "backup".into())
    );
    assert_eq!(quota_primary.calls(), 1);

    // One request a minute: the second finds no capacity within `fallback_wait`.
    let primary = always(200, ok()).await;
    let one = "[upstream.limits]\nrpm = 1\nburst = 1\n[upstream.retry]\ndeadline = \"2s\"\n";
    let corral = Corral::start(&group_config(&primary, one, &backup, "", "")).await;
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "primary".into())
    );
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "backup".into())
    );
    assert_eq!(primary.calls(), 1);
}

/// A member's copy of the body counts in `max_buffered_bytes` like the body itself: with room
/// for 1 MiB, a 300 KiB body and its copy fit, a 700 KiB body and its copy do not, and the
/// member that needs the copy is refused with `buffer_full` (after waiting a second for room)
/// instead of holding it outside the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_copy_of_the_body_counts_in_the_body_budget() {
    let (primary, backup) = (always(429, quota()).await, always(200, ok()).await);
    let toml = format!(
        "max_buffered_bytes = \"1MiB\"\n\
         [[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\nbody_limit = \"1MiB\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\nbody_limit = \"1MiB\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", {{ upstream = \"backup\", model = \"gpt-4o-mini\" }}]\n",
        primary.url("/v1"),
        backup.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    let body = |kib: usize| {
        format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "x".repeat(kib << 10)
        )
    };
    let (parts, _) = send(
        &client(),
        post(&corral.url("/v1/chat/completions"), &body(300)),
    )
    .await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    let (parts, _) = send(
        &client(),
        post(&corral.url("/v1/chat/completions"), &body(700)),
    )
    .await;
    assert_eq!(parts.status, 503);
    assert_eq!(parts.headers["x-corral-error"], "buffer_full");
    assert_eq!(backup.calls(), 1);
    // A body that is no JSON object has no model to rewrite: no copy, nothing more to hold.
    let (parts, _) = send(
        &client(),
        post(&corral.url("/v1/chat/completions"), &"x".repeat(700 << 10)),
    )
    .await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!(backup.calls(), 2);
}

/// A member whose copy of the body finds no room in the budget is passed over for the next,
/// which may need no copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_room_for_a_members_copy_moves_the_request_on() {
    let (primary, backup) = (always(200, ok()).await, always(200, ok()).await);
    let toml = format!(
        "max_buffered_bytes = \"1MiB\"\n\
         [[upstream]]\nname = \"primary\"\nbase_url = \"{}\"\nbody_limit = \"1MiB\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{}\"\nbody_limit = \"1MiB\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [{{ upstream = \"primary\", model = \"gpt-4o-mini\" }}, \"backup\"]\n",
        primary.url("/v1"),
        backup.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    let body = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(700 << 10)
    );
    let (parts, _) = send(&client(), post(&corral.url("/v1/chat/completions"), &body)).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!((primary.calls(), backup.calls()), (0, 1));
}

/// What a group needs, checked at load: file, key and reason.
#[test]
fn groups_naming_unknown_upstreams_or_forming_cycles_are_refused() {
    let load = |groups: &str| {
        let toml = format!(
            "[[upstream]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
             [[upstream]]\nname = \"b\"\nroute = \"/b\"\nbase_url = \"http://127.0.0.1:9/v1\"\n{groups}"
        );
        corral::config::load_str("corral.toml", &toml)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        load("[[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\", \"b\"]\n"),
        Ok(())
    );
    // Nested groups resolve in place.
    assert_eq!(
        load("[[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"h\"]\n[[group]]\nname = \"h\"\nroute = \"/h\"\nmembers = [\"a\", \"b\"]\n"),
        Ok(())
    );
    let unknown = load("[[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\", \"nope\"]\n")
        .unwrap_err();
    assert!(
        unknown.starts_with("corral.toml:")
            && unknown.contains("group[0].members")
            && unknown.contains("`nope`"),
        "{unknown}"
    );
    let cycle = load(
        "[[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\", \"h\"]\n[[group]]\nname = \"h\"\nroute = \"/h\"\nmembers = [\"b\", \"g\"]\n",
    )
    .unwrap_err();
    assert!(
        cycle.contains("cycle") && cycle.contains("g -> h -> g"),
        "{cycle}"
    );
    let unreachable = load("").unwrap_err();
    assert!(
        unreachable.contains("upstream[0].route") && unreachable.contains("in no group"),
        "{unreachable}"
    );
    let clash = load("[[group]]\nname = \"b\"\nroute = \"/v1\"\nmembers = [\"a\"]\n").unwrap_err();
    assert!(clash.contains("group[0].name"), "{clash}");
    let route = load("[[group]]\nname = \"g\"\nroute = \"/b\"\nmembers = [\"a\"]\n").unwrap_err();
    assert!(route.contains("duplicate route `/b`"), "{route}");
    let paths = load(
        "[[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\"]\nrepeatable_paths = [\"/files\", \"\"]\n",
    )
    .unwrap_err();
    assert!(
        paths.contains("group[0].repeatable_paths") && paths.contains("got \"\""),
        "{paths}"
    );
}

/// An upstream that answers 200 after `delay`.
async fn slow(delay: Duration) -> MockUpstream {
    MockUpstream::start(move |_| async move {
        tokio::time::sleep(delay).await;
        json(200, ok())
    })
    .await
}

/// An upstream that answers 200 once `release` says so (at once when it already has), counting
/// its calls; each answer says which call it was (`{"call": n}`).
async fn held_until(release: tokio::sync::watch::Receiver<bool>) -> MockUpstream {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    MockUpstream::start(move |_| {
        let mut release = release.clone();
        let call = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        async move {
            let _ = release.wait_for(|go| *go).await;
            json(200, serde_json::json!({"call": call}))
        }
    })
    .await
}

/// Ten chat requests at once; each one's status, member and time, in the order they end.
fn fire_ten(corral: &Corral) -> tokio::sync::mpsc::UnboundedReceiver<(u16, String, Duration)> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let c = std::sync::Arc::new(client());
    for _ in 0..10 {
        let (c, url, tx) = (
            std::sync::Arc::clone(&c),
            corral.url("/v1/chat/completions"),
            tx.clone(),
        );
        tokio::spawn(async move {
            let start = Instant::now();
            let (parts, _) = send(&c, post(&url, BODY)).await;
            let _ = tx.send((
                parts.status.as_u16(),
                member(&parts).to_owned(),
                start.elapsed(),
            ));
        });
    }
    rx
}

/// Hedging: a primary held until the test releases it, a fast backup, `hedge_after =
/// "300ms"`: ten requests at once, and `hedge_max_ratio = 0.2` lets exactly two of them hedge.
/// However the arrivals spread, the second hedge needs all ten requests counted, and no third
/// fits. Those two are answered by the backup, no sooner than `hedge_after`, each with one
/// hedge; their primary attempts are cancelled; the other eight wait for the primary (nothing
/// else has answered when it is released).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_primary_is_hedged_within_the_ratio_and_the_loser_cancelled() {
    let (release, held) = tokio::sync::watch::channel(false);
    let (primary, backup) = (held_until(held).await, always(200, ok()).await);
    let group = "hedge_after = \"300ms\"\nhedge_max_ratio = 0.2\n";
    let corral = Corral::start(&group_config(&primary, "", &backup, "", group)).await;
    let mut answers = fire_ten(&corral);
    // Bound: the hedges' answers come within seconds (10 s, generous for a busy machine).
    for _ in 0..2 {
        let answer = tokio::time::timeout(Duration::from_secs(10), answers.recv()).await;
        let (status, member, took) = answer.expect("a hedged answer").unwrap();
        assert_eq!((status, member.as_str()), (200, "backup"));
        assert!(
            took >= Duration::from_millis(300),
            "hedged before hedge_after: {took:?}"
        );
    }
    // The eight others are held by the primary: none can have answered.
    assert!(
        answers.try_recv().is_err(),
        "a third answer before the primary's release"
    );
    release.send(true).unwrap();
    for _ in 0..8 {
        let (status, member, _) = answers.recv().await.unwrap();
        assert_eq!((status, member.as_str()), (200, "primary"));
    }
    assert_eq!(backup.calls(), 2, "one hedge per hedged request");
    assert_eq!(primary.calls(), 10);
    for line in [
        r#"corral_group_hedges_total{group="chat",outcome="sent"} 2"#,
        r#"corral_group_hedges_total{group="chat",outcome="won"} 2"#,
        r#"corral_group_cancelled_total{group="chat"} 2"#,
    ] {
        assert!(metric(&corral, line), "no `{line}`");
    }
}

/// On the last member, a hedge goes to that same member: a group of one whose first call never
/// answers and whose second answers at once. The hedge's answer (call 2) wins and the first
/// call is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_members_hedge_goes_to_the_same_member() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let only = MockUpstream::start(move |_| {
        let call = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        async move {
            if call == 1 {
                std::future::pending::<()>().await;
            }
            json(200, serde_json::json!({"call": call}))
        }
    })
    .await;
    let toml = format!(
        "[[upstream]]\nname = \"only\"\nbase_url = \"{}\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"only\"]\n\
         hedge_after = \"100ms\"\nhedge_max_ratio = 1.0\n",
        only.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    let (parts, body) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "only"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        serde_json::json!({"call": 2})
    );
    assert_eq!(only.calls(), 2);
    for line in [
        r#"corral_group_hedges_total{group="chat",outcome="sent"} 1"#,
        r#"corral_group_hedges_total{group="chat",outcome="won"} 1"#,
        r#"corral_group_cancelled_total{group="chat"} 1"#,
    ] {
        assert!(metric(&corral, line), "no `{line}`");
    }
}

/// A hedge takes rate-limit tokens like any attempt: with one token a minute on the backup,
/// the first request's hedge takes it and wins; the second request's hedge waits for a token
/// that does not come, so the primary (released once that hedge was sent) answers it, and the
/// backup is asked once in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_takes_rate_limit_tokens() {
    let (release, held) = tokio::sync::watch::channel(false);
    let (primary, backup) = (held_until(held).await, always(200, ok()).await);
    let one_token = "rate_limit = \"off\"\n[upstream.limits]\nrpm = 1\nburst = 1\n";
    let group = "hedge_after = \"100ms\"\nhedge_max_ratio = 1.0\n";
    let corral = Corral::start(&group_config(&primary, "", &backup, one_token, group)).await;
    assert_eq!(member(&chat(&corral).await.0), "backup");
    let second = tokio::spawn({
        let url = corral.url("/v1/chat/completions");
        async move { send(&client(), post(&url, BODY)).await.0 }
    });
    // Wait for the second hedge to be sent (and held by the backup's limiter), then release.
    let sent = r#"corral_group_hedges_total{group="chat",outcome="sent"} 2"#;
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !metric(&corral, sent) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "no second hedge within 10 s");
    release.send(true).unwrap();
    let parts = second.await.unwrap();
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "primary"));
    assert_eq!(backup.calls(), 1, "the second hedge went without a token");
}

/// A hedge takes a retry from its member's retry budget: with the backup's budget empty
/// (`budget_ratio = 0`, `budget_min_per_second = 0`), no hedge goes and the request waits
/// for the primary (released at 1 s, long after the hedge was due at 100 ms and refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_takes_a_retry_from_the_members_budget() {
    let (release, held) = tokio::sync::watch::channel(false);
    let (primary, backup) = (held_until(held).await, always(200, ok()).await);
    let no_budget = "[upstream.retry]\nbudget_ratio = 0.0\nbudget_min_per_second = 0\n";
    let group = "hedge_after = \"100ms\"\nhedge_max_ratio = 1.0\n";
    let corral = Corral::start(&group_config(&primary, "", &backup, no_budget, group)).await;
    let request = tokio::spawn({
        let url = corral.url("/v1/chat/completions");
        async move { send(&client(), post(&url, BODY)).await.0 }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    release.send(true).unwrap();
    let parts = request.await.unwrap();
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "primary"));
    assert_eq!(backup.calls(), 0);
    assert!(
        !metric(&corral, "corral_group_hedges_total{"),
        "a hedge was sent"
    );
}

/// A request not safe to send twice is never hedged: a `/files` POST waits for the slow
/// primary (600 ms, `hedge_after = "100ms"`); the same POST with an `Idempotency-Key` is
/// hedged to the backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_not_safe_to_repeat_is_not_hedged() {
    let (primary, backup) = (
        slow(Duration::from_millis(600)).await,
        always(200, ok()).await,
    );
    let group = "hedge_after = \"100ms\"\nhedge_max_ratio = 1.0\n";
    let corral = Corral::start(&group_config(&primary, "", &backup, "", group)).await;
    assert_eq!(
        post_to(&corral, "/v1/files", false).await,
        (200, "primary".into())
    );
    assert_eq!(backup.calls(), 0);
    assert!(
        !metric(&corral, "corral_group_hedges_total{"),
        "a hedge was sent"
    );
    assert_eq!(
        post_to(&corral, "/v1/files", true).await,
        (200, "backup".into())
    );
    assert!(metric(
        &corral,
        r#"corral_group_hedges_total{group="chat",outcome="sent"} 1"#
    ));
}

/// A stream whose first event is an Anthropic `error` event (`overloaded_error`, before any
/// content) is a failure: the request moves on to the backup, whose stream the client gets
/// whole; no byte of the failed stream reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_opens_with_an_error_event_falls_back() {
    fn stream(text: &'static str) -> http::Response<corral::body::Body> {
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(corral::body::full(text))
            .unwrap()
    }
    const OVERLOADED: &str = "event: error\ndata: {\"type\": \"error\", \"error\": {\"type\": \"overloaded_error\", \"message\": \"Overloaded\"}}\n\n";
    const GOOD: &str = "event: message_start\ndata: {\"type\": \"message_start\"}\n\nevent: message_stop\ndata: {\"type\": \"message_stop\"}\n\n";
    let primary = MockUpstream::start(|_| async { stream(OVERLOADED) }).await;
    let backup = MockUpstream::start(|_| async { stream(GOOD) }).await;
    let corral = Corral::start(&group_config(&primary, "", &backup, "", "")).await;
    let (parts, body) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!(String::from_utf8_lossy(&body), GOOD);
    assert_eq!((primary.calls(), backup.calls()), (1, 1));
    // The last member's stream goes to the client as it came, error event and all.
    let also_overloaded = MockUpstream::start(|_| async { stream(OVERLOADED) }).await;
    let corral = Corral::start(&group_config(&primary, "", &also_overloaded, "", "")).await;
    let (parts, body) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "backup"));
    assert_eq!(String::from_utf8_lossy(&body), OVERLOADED);
}

/// At most one hedge per request, however many members it goes through: the primary and its
/// hedge on the second member both fail (503 after 600 ms), and the third (answering after
/// 500 ms, past `hedge_after`) is not hedged again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_hedges_once_across_its_members() {
    let failing = || {
        MockUpstream::start(|_| async {
            tokio::time::sleep(Duration::from_millis(600)).await;
            json(503, serde_json::json!({"error": {"message": "down"}}))
        })
    };
    let (first, second, third) = (
        failing().await,
        failing().await,
        slow(Duration::from_millis(500)).await,
    );
    let no_retry = "rate_limit = \"off\"\n[upstream.retry]\nmax_retries = 0\n";
    let toml = format!(
        "[[upstream]]\nname = \"first\"\nbase_url = \"{}\"\n{no_retry}\
         [[upstream]]\nname = \"second\"\nbase_url = \"{}\"\n{no_retry}\
         [[upstream]]\nname = \"third\"\nbase_url = \"{}\"\n{no_retry}\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"first\", \"second\", \"third\"]\n\
         hedge_after = \"300ms\"\nhedge_max_ratio = 1.0\n",
        first.url("/v1"),
        second.url("/v1"),
        third.url("/v1"),
    );
    let corral = Corral::start(&toml).await;
    let (parts, _) = chat(&corral).await;
    assert_eq!((parts.status.as_u16(), member(&parts)), (200, "third"));
    assert_eq!((first.calls(), second.calls(), third.calls()), (1, 1, 1));
    assert!(metric(
        &corral,
        r#"corral_group_hedges_total{group="chat",outcome="sent"} 1"#
    ));
}

/// Three `corral simulate` upstreams in one group: a primary that fails mid-run (every answer
/// a 503 from 0.3 s after it was made), a slow member (300 ms a request) and a fast one,
/// `hedge_after = "100ms"`. A hundred requests, ten clients each pausing 100 ms between its
/// requests (about a second in all), over the failure: every client gets a 200; the primary
/// answered before its failure, and every request that started after it went to the others;
/// hedges were sent, within one a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_simulators_one_failing_mid_run_one_slow_one_fast() {
    use corral::simulate::{FailWindow, SimConfig, Simulator};
    async fn simulator(config: SimConfig) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(Simulator::new(config).serve(listener, std::future::pending()));
        format!("http://{addr}/v1")
    }
    let roomy = SimConfig {
        capacity: 1000,
        refill: 1000.0,
        seed: Some(13),
        ..SimConfig::default()
    };
    let primary = simulator(SimConfig {
        service_time: Duration::from_millis(5),
        fail_503_windows: vec![FailWindow {
            at: Duration::from_millis(300),
            duration: Duration::from_secs(60),
        }],
        ..roomy.clone()
    })
    .await;
    let slow = simulator(SimConfig {
        service_time: Duration::from_millis(300),
        ..roomy.clone()
    })
    .await;
    let fast = simulator(SimConfig {
        service_time: Duration::from_millis(5),
        ..roomy
    })
    .await;
    let upstream = |name: &str, url: &str| {
        format!(
            "[[upstream]]\nname = \"{name}\"\nbase_url = \"{url}\"\n\
             [upstream.retry]\nmax_retries = 1\nbase = \"10ms\"\ncap = \"20ms\"\n"
        )
    };
    let toml = format!(
        "{}{}{}[[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"slow\", \"fast\"]\n\
         hedge_after = \"100ms\"\nhedge_max_ratio = 1.0\n",
        upstream("primary", &primary),
        upstream("slow", &slow),
        upstream("fast", &fast),
    );
    let corral = Corral::start(&toml).await;
    // The simulators were made before this: the primary fails by then + 300 ms.
    let failed_by = Instant::now() + Duration::from_millis(300);
    let c = std::sync::Arc::new(client());
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..10)
        .map(|_| {
            let (c, next) = (std::sync::Arc::clone(&c), std::sync::Arc::clone(&next));
            let url = corral.url("/v1/chat/completions");
            tokio::spawn(async move {
                let mut out = Vec::new();
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < 100 {
                    let start = Instant::now();
                    let (parts, _) = send(&c, post(&url, BODY)).await;
                    out.push((start, parts.status.as_u16(), member(&parts).to_owned()));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                out
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.extend(t.await.unwrap());
    }
    answers.sort_by_key(|(start, _, _)| *start);
    assert_eq!(answers.len(), 100);
    for (_, status, who) in &answers {
        assert_eq!(*status, 200, "answered by {who}");
    }
    let order: Vec<&str> = answers.iter().map(|(_, _, who)| who.as_str()).collect();
    assert!(order.contains(&"primary"), "{order:?}");
    let after: Vec<&str> = answers
        .iter()
        .filter(|(start, _, _)| *start >= failed_by)
        .map(|(_, _, who)| who.as_str())
        .collect();
    assert!(!after.is_empty(), "no request started after the failure");
    assert!(
        after.iter().all(|who| *who == "slow" || *who == "fast"),
        "the primary answered after its failure: {order:?}"
    );
    let metrics = corral.app.metrics().render();
    let sent = metrics
        .lines()
        .find(|l| l.starts_with(r#"corral_group_hedges_total{group="chat",outcome="sent"}"#))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .expect("no hedge was sent: a slow member's 300 ms is past hedge_after");
    assert!(
        (1.0..=100.0).contains(&sent),
        "{sent} hedges for 100 requests"
    );
}
