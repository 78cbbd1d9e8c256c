use std::sync::Weak;

use http::HeaderValue;

use super::*;
use crate::config::types::parse_base_url;
use crate::metrics::Metrics;

fn per_key() -> Arc<RateLimitShared> {
    let mut config = UpstreamConfig::new("t", "/v1", parse_base_url("http://127.0.0.1:1").unwrap());
    config.limits.partition = Some(config::PartitionScope::ApiKey);
    RateLimitShared::new(&config, Metrics::new().upstream("t"), None, Arc::default())
}

fn key(n: usize) -> HeaderMap {
    let mut h = HeaderMap::new();
    let value = HeaderValue::from_str(&format!("Bearer sk-{n}")).unwrap();
    h.insert("authorization", value);
    h
}

fn partitions(shared: &RateLimitShared) -> usize {
    lock(&shared.by_key.as_ref().unwrap().0).by_hash.len()
}

#[test]
fn the_model_is_read_from_the_top_level_only() {
    let m = |b: &str| model_of(b.as_bytes()).map(|m| m.into_owned());
    assert_eq!(
        m(r#"{"model":"gpt-4o","messages":[]}"#).as_deref(),
        Some("gpt-4o")
    );
    assert_eq!(
        m(r#" {"messages":[{"model":"no"}], "model": "m2"}"#).as_deref(),
        Some("m2")
    );
    assert_eq!(
        m(r#"{"model":"a\"b"}"#).as_deref(),
        Some("a\"b"),
        "escapes decoded"
    );
    assert_eq!(m(r#"{"messages":[]}"#), None);
    assert_eq!(m("not json"), None);
    assert_eq!(m(r#"{"model":"unterminated"#), None);
}

#[test]
fn the_prompt_ratio_follows_what_the_upstream_counted_within_bounds() {
    let r = PromptRatio::new();
    r.learn(8, 100); // too short to teach anything
    assert_eq!(r.get(), 1.0);
    for _ in 0..100 {
        r.learn(100, 150);
    }
    assert!((r.get() - 1.5).abs() < 0.01, "{}", r.get());
    for _ in 0..100 {
        r.learn(100, 100_000);
    }
    assert!(r.get() <= PromptRatio::RANGE.1, "{}", r.get());
}

#[tokio::test(start_paused = true)]
async fn a_full_map_evicts_idle_partitions_for_new_keys() {
    let shared = per_key();
    let first = Arc::downgrade(&shared.partition(&key(0), b"", Instant::now()));
    for n in 1..MAX_PARTITIONS {
        shared.partition(&key(n), b"", Instant::now());
    }
    assert_eq!(partitions(&shared), MAX_PARTITIONS);
    // Nothing idle yet: a new key shares the default partition.
    let newcomer = shared.partition(&key(MAX_PARTITIONS), b"", Instant::now());
    assert!(Arc::ptr_eq(&newcomer, &shared.default));

    // Key 1 is held by a request, key 2 is paused by a 429, key 3 was used recently.
    let held = shared.partition(&key(1), b"", Instant::now());
    let paused = shared.partition(&key(2), b"", Instant::now());
    let mut hint = HeaderMap::new();
    hint.insert("retry-after", HeaderValue::from_static("3600"));
    let m = Metrics::new().upstream("t");
    let rate = Throttle {
        reason: crate::classify::Reason::Rate,
        hint: Some(Duration::from_secs(3600)),
        named: true,
        own_wait: false,
    };
    paused.observe(
        None,
        Outcome::Throttled(429),
        Some(&rate),
        Some(&hint),
        None,
        &m,
    );
    let paused = Arc::downgrade(&paused);
    tokio::time::advance(PARTITION_IDLE - Duration::from_secs(1)).await;
    let recent = Arc::downgrade(&shared.partition(&key(3), b"", Instant::now()));
    tokio::time::advance(Duration::from_secs(1)).await;

    let newcomer = shared.partition(&key(MAX_PARTITIONS), b"", Instant::now());
    assert!(
        !Arc::ptr_eq(&newcomer, &shared.default),
        "a new key got its own partition"
    );
    assert_eq!(
        partitions(&shared),
        4,
        "the idle ones were evicted, the rest kept"
    );
    assert!(first.upgrade().is_none(), "an idle partition was freed");
    let same = |key_n: usize, before: &Weak<Partition>| {
        Arc::ptr_eq(
            &shared.partition(&key(key_n), b"", Instant::now()),
            &before.upgrade().unwrap(),
        )
    };
    assert!(Arc::ptr_eq(
        &shared.partition(&key(1), b"", Instant::now()),
        &held
    ));
    assert!(same(2, &paused), "a paused partition keeps its pause");
    assert!(same(3, &recent));
    // An evicted key comes back as a new partition of its own.
    assert!(!Arc::ptr_eq(
        &shared.partition(&key(0), b"", Instant::now()),
        &shared.default
    ));
    assert_eq!(partitions(&shared), 5);
}

#[tokio::test(start_paused = true)]
async fn a_full_map_of_busy_partitions_is_swept_at_most_once_a_second() {
    let shared = per_key();
    let held: Vec<_> = (0..MAX_PARTITIONS)
        .map(|n| shared.partition(&key(n), b"", Instant::now()))
        .collect();
    tokio::time::advance(PARTITION_IDLE).await;
    let newcomer = shared.partition(&key(MAX_PARTITIONS), b"", Instant::now());
    assert!(
        Arc::ptr_eq(&newcomer, &shared.default),
        "every partition is held"
    );
    drop(held);
    let again = shared.partition(&key(MAX_PARTITIONS), b"", Instant::now());
    assert!(
        Arc::ptr_eq(&again, &shared.default),
        "no second sweep within a second"
    );
    tokio::time::advance(SWEEP_EVERY).await;
    let later = shared.partition(&key(MAX_PARTITIONS), b"", Instant::now());
    assert!(!Arc::ptr_eq(&later, &shared.default));
    assert_eq!(partitions(&shared), 1);
}
