use super::*;

#[test]
fn the_model_is_rewritten_in_json_objects_only() {
    let body = Bytes::from_static(br#"{"model":"gpt-4o","messages":[],"stream":true}"#);
    let out: serde_json::Value = serde_json::from_slice(&with_model(&body, "gpt-4o-mini")).unwrap();
    assert_eq!(out["model"], "gpt-4o-mini");
    assert_eq!(out["stream"], true);
    for not_an_object in [&b"not json"[..], b"[1, 2]", b"\"model\"", b"{\"model\": 1"] {
        let body = Bytes::copy_from_slice(not_an_object);
        assert_eq!(with_model(&body, "m"), body);
    }
}

#[test]
fn only_the_models_bytes_change() {
    // A number beyond u64 and f64, odd whitespace, escapes, a nested "model", key order.
    let body = "\r\n { \"temperature\" :0.70,\"n\":123456789012345678901234567890 ,\n\t\
                \"model\"  :  \"gpt-4o\\u0041\" ,\"tools\":[{\"model\":\"x\"}],\"m\\u006fdel2\":{} }  ";
    let out = with_model(&Bytes::from(body), "gpt-4o-mini \"2\"");
    let want = body.replace(r#""gpt-4o\u0041""#, r#""gpt-4o-mini \"2\"""#);
    assert_eq!(std::str::from_utf8(&out).unwrap(), want);
    // Every top-level "model" (a duplicated key too); an escaped key is still the key.
    let out = with_model(&Bytes::from(r#"{"model":1,"mod\u0065l":[2, 3]}"#), "m");
    assert_eq!(&out[..], br#"{"model":"m","mod\u0065l":"m"}"#);
    // Added first when absent.
    let out = with_model(&Bytes::from(" {\"n\": 1e400}"), "m");
    assert_eq!(&out[..], br#" {"model":"m","n": 1e400}"#);
    let out = with_model(&Bytes::from("{ }"), "m");
    assert_eq!(&out[..], br#"{"model":"m" }"#);
}

#[test]
fn p95_needs_enough_answers_then_reads_the_95th_percentile() {
    let metrics = Metrics::new();
    let config = crate::config::UpstreamConfig::new(
        "m",
        "/m",
        crate::config::types::parse_base_url("http://127.0.0.1:9/v1").unwrap(),
    );
    let member = Member {
        upstream: Arc::new(Upstream::new(&config, &metrics, 1 << 20, None)),
        model: None,
        withheld: Vec::new(),
        aside: Arc::default(),
        answers: metrics.group_answers("g", "m"),
        heads: Arc::default(),
    };
    for ms in 1..MIN_HEAD_SAMPLES as u64 {
        lock(&member.heads).push_back(Duration::from_millis(ms));
    }
    assert_eq!(member.p95(), None, "fewer than {MIN_HEAD_SAMPLES} answers");
    lock(&member.heads).clear();
    // 1..=100 ms, shuffled by a stride: the 95th of 100 is 95 ms.
    for k in 0..100u64 {
        lock(&member.heads).push_back(Duration::from_millis((k * 37) % 100 + 1));
    }
    assert_eq!(member.p95(), Some(Duration::from_millis(95)));
}

/// A group of two members on an unreachable port, from `group` TOML lines.
fn router(group: &str) -> crate::router::Router {
    let toml = format!(
        "[[upstream]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
         [[upstream]]\nname = \"b\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
         [[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\", \"b\"]\n{group}"
    );
    let config = crate::config::load_str("t.toml", &toml).unwrap();
    crate::router::Router::new(
        &config.upstreams,
        &config.groups,
        None,
        &Metrics::new(),
        None,
    )
}

#[test]
fn a_thread_message_is_not_repeatable_by_its_path() {
    let router = router("");
    let group = &router.groups()[0];
    let parts = |method: &str, path: &str| {
        let req = http::Request::builder().method(method).uri(path);
        req.body(()).unwrap().into_parts().0
    };
    assert!(group.repeatable(&parts("POST", "/v1/messages")));
    assert!(group.repeatable(&parts("POST", "/v1/chat/completions")));
    assert!(!group.repeatable(&parts("POST", "/v1/threads/t_1/messages")));
    assert!(!group.repeatable(&parts("POST", "/v1/files")));
    assert!(group.repeatable(&parts("GET", "/v1/threads/t_1/messages")));
}

#[tokio::test(start_paused = true)]
async fn hedges_are_a_share_of_recent_requests_only() {
    let router = router("hedge_after = \"1s\"\nhedge_max_ratio = 0.1\n");
    let group = &router.groups()[0];
    // A quiet past lends an incident nothing.
    for _ in 0..100_000 {
        group.arrived();
    }
    tokio::time::advance(HEDGE_WINDOW + Duration::from_secs(1)).await;
    for _ in 0..100 {
        group.arrived();
    }
    let hedges = (0..100).filter(|_| group.take_hedge(1)).count();
    assert_eq!(hedges, 10, "a tenth of the 100 requests in the window");
    // Within the window, the same requests allow no more.
    tokio::time::advance(HEDGE_WINDOW / 2).await;
    assert!(!group.take_hedge(1));
    // Requests and hedges both leave the window.
    tokio::time::advance(HEDGE_WINDOW).await;
    assert!(!group.take_hedge(1), "no requests in the window");
    for _ in 0..30 {
        group.arrived();
    }
    assert_eq!((0..10).filter(|_| group.take_hedge(1)).count(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_reload_keeps_answer_times_and_recent_requests() {
    let before = router("hedge_after = \"p95\"\nhedge_max_ratio = 0.5\n");
    let group = &before.groups()[0];
    for _ in 0..MIN_HEAD_SAMPLES {
        group.record_head(0, Duration::from_millis(40));
    }
    for _ in 0..4 {
        group.arrived();
    }
    assert!(group.take_hedge(1));
    // A changed member and group: both rebuilt.
    let toml = "[[upstream]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
                [upstream.limits]\nmax_concurrency = 7\n\
                [[upstream]]\nname = \"b\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
                [[group]]\nname = \"g\"\nroute = \"/v1\"\nmembers = [\"a\", \"b\"]\n\
                hedge_after = \"p95\"\nhedge_max_ratio = 0.5\nfallback_wait = 0.5\n";
    let config = crate::config::load_str("t.toml", toml).unwrap();
    let (after, _) = before.reload(&config.upstreams, &config.groups, &Metrics::new(), None);
    let group = &after.groups()[0];
    assert_eq!(group.hedge_delay(0), Some(Duration::from_millis(40)));
    // Four requests allow two hedges at 0.5: one was taken before the reload.
    assert!(group.take_hedge(1));
    assert!(!group.take_hedge(1));
}

#[test]
fn a_hedge_costs_a_whole_number_of_requests_never_more_than_the_ratio() {
    for (ratio, cost) in [(1.0, 1), (0.5, 2), (0.2, 5), (0.1, 10), (0.15, 7), (0.3, 4)] {
        assert_eq!(Hedging::new(HedgeAfter::P95, ratio).cost, cost, "{ratio}");
    }
}

#[test]
fn reasons_to_move_on() {
    assert_eq!(Fallback::of_status(429), Some(Fallback::Failed));
    assert_eq!(Fallback::of_status(503), Some(Fallback::Failed));
    assert_eq!(Fallback::of_status(200), None);
    assert_eq!(Fallback::of_status(400), None);
    assert_eq!(
        Fallback::of_error(&ProxyError::DeadlineExceeded),
        None,
        "the deadline is the group's"
    );
}
