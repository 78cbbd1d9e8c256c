//! The fleet's tests that need no Redis.

use super::*;

#[tokio::test]
async fn bucket_keys_are_digests_of_host_name_and_credential() {
    use crate::config::types::parse_base_url;
    let config = FleetConfig {
        redis: Some(RedisUrl("redis://127.0.0.1:1/0".into())),
        ..FleetConfig::default()
    };
    let fleet = Fleet::new(&config, crate::metrics::Metrics::new().fleet()).unwrap();
    let upstream = |name: &str, header: &str, key: &str| {
        let base = parse_base_url("https://api.openai.com/v1").unwrap();
        let mut u = UpstreamConfig::new(name, "/v1", base);
        u.headers
            .insert(header.into(), crate::config::Secret(key.into()));
        u
    };
    let a = fleet.bucket_key(&upstream("openai", "Authorization", "Bearer sk-a"), None);
    let same = fleet.bucket_key(&upstream("openai", "authorization", "Bearer sk-a"), None);
    let other = fleet.bucket_key(&upstream("openai", "Authorization", "Bearer sk-b"), None);
    let elsewhere = fleet.bucket_key(&upstream("mirror", "Authorization", "Bearer sk-a"), None);
    assert_eq!(a, same, "header names are case-insensitive");
    assert_ne!(a, other, "another key, another bucket");
    assert_ne!(a, elsewhere, "another upstream, another bucket");
    assert!(a.starts_with("corral:{") && a.ends_with('}'), "{a}");
    assert!(!a.contains("sk-a"));
    let by_request = fleet.bucket_key(&upstream("openai", "x", "y"), Some(b"Bearer sk-c"));
    assert_ne!(
        by_request, a,
        "a request's credential keys its own partition"
    );
    let same_key = fleet.bucket_key(&upstream("openai", "x", "y"), Some(b"Bearer sk-a"));
    assert_eq!(
        same_key, a,
        "the same credential, from the config or a request"
    );
}

/// A fleet whose Redis is never reached (its messages are handed to it directly), and an
/// upstream to lease for.
fn offline_fleet() -> (Arc<Fleet>, UpstreamConfig) {
    use crate::config::types::parse_base_url;
    let config = FleetConfig {
        redis: Some(RedisUrl("redis://127.0.0.1:1/0".into())),
        ..FleetConfig::default()
    };
    let fleet = Fleet::new(&config, crate::metrics::Metrics::new().fleet()).unwrap();
    let base = parse_base_url("https://api.openai.com/v1").unwrap();
    (fleet, UpstreamConfig::new("openai", "/v1", base))
}

/// A pause from Redis (published by a peer, or in a lease's answer) is capped as a local
/// hint is: a corrupt or hostile value neither panics nor stops the partition for longer.
#[tokio::test]
async fn a_pause_from_redis_is_capped_as_a_local_hint() {
    use crate::provider::hints::MAX_HINT;
    let (fleet, upstream) = offline_fleet();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    let lease = fleet.lease(
        &upstream,
        None,
        Peers {
            pause: Box::new(move |until| record.lock().unwrap().push(until)),
            edge: Box::new(|_, _| None),
            share: Box::new(|_| {}),
            pace: Box::new(|| None),
            scale: Box::new(|_| {}),
            admission: Box::new(|| {}),
        },
        Arc::default(),
    );
    let key = lease.pause_key().to_owned();
    let month = Duration::from_secs(30 * 24 * 3600).as_millis();
    for ms in [month.to_string(), u64::MAX.to_string()] {
        let before = Instant::now();
        fleet.on_message(&format!("{key} pause {ms}"));
        let until = *seen.lock().unwrap().last().expect("the pause was applied");
        assert!(
            until <= Instant::now() + MAX_HINT && until >= before + MAX_HINT,
            "pause of {ms} ms ends {:?} from now",
            until - before
        );
    }
    let now = Instant::now();
    assert_eq!(
        pause_end(now, u64::MAX) - now,
        MAX_HINT,
        "a lease's answer is capped the same way"
    );
}

/// A peer's refusal at a bucket's edge reaches this replica's pacers; its own (echoed by
/// the channel) does not, having taught them already. Shares, its own among them, are
/// added up and split by demand; so are paces.
#[tokio::test]
async fn peers_refusals_shares_and_paces_reach_the_partition() {
    let (fleet, upstream) = offline_fleet();
    let edges = Arc::new(Mutex::new(Vec::new()));
    let parts = Arc::new(Mutex::new(Vec::new()));
    let scales = Arc::new(Mutex::new(Vec::new()));
    let (e, p, sc) = (Arc::clone(&edges), Arc::clone(&parts), Arc::clone(&scales));
    let lease = fleet.lease(
        &upstream,
        None,
        Peers {
            pause: Box::new(|_| {}),
            edge: Box::new(move |r, t| {
                e.lock().unwrap().push((r, t));
                None
            }),
            share: Box::new(move |part| p.lock().unwrap().push(part)),
            pace: Box::new(|| Some(50.0)),
            scale: Box::new(move |scale| sc.lock().unwrap().push(scale)),
            admission: Box::new(|| {}),
        },
        Arc::default(),
    );
    let key = lease.pause_key().to_owned();
    let first_key = key.clone();
    let me = fleet.replica.clone();
    fleet.on_message(&format!("{key} throttled 1 {me}"));
    fleet.on_message(&format!("{key} throttled 3 peer"));
    fleet.on_message("other-key throttled 1 peer");
    assert_eq!(*edges.lock().unwrap(), [(true, true)]);
    fleet.on_message(&format!("{key} share 6 10 peer"));
    assert!(parts.lock().unwrap().is_empty(), "no share of its own yet");
    fleet.on_message(&format!("{key} share 2 30 {me}"));
    assert_eq!(*parts.lock().unwrap(), [6.0]);
    fleet.on_message(&format!("{key} pace 50 100 peer"));
    assert!(scales.lock().unwrap().is_empty(), "no pace of its own yet");
    // 100/s between them; this replica has three quarters of the demand: 75/s.
    fleet.on_message(&format!("{key} pace 50 300 {me}"));
    assert_eq!(*scales.lock().unwrap(), [1.5]);
    // Where a shared bucket divides the key (here a configured limit), they add nothing.
    let mut limited = upstream.clone();
    limited.limits.rpm = std::num::NonZeroU32::new(600);
    let calls = Arc::new(Mutex::new(0));
    let (e, s, c) = (Arc::clone(&calls), Arc::clone(&calls), Arc::clone(&calls));
    let lease = fleet.lease(
        &limited,
        Some(b"another key".as_slice()),
        Peers {
            pause: Box::new(|_| {}),
            edge: Box::new(move |_, _| {
                *e.lock().unwrap() += 1;
                None
            }),
            share: Box::new(move |_| *s.lock().unwrap() += 1),
            pace: Box::new(|| Some(50.0)),
            scale: Box::new(move |_| *c.lock().unwrap() += 1),
            admission: Box::new(|| {}),
        },
        Arc::default(),
    );
    let key = lease.pause_key().to_owned();
    assert_ne!(key, first_key);
    fleet.on_message(&format!("{key} throttled 1 peer"));
    fleet.on_message(&format!("{key} share 2 30 {me}"));
    fleet.on_message(&format!("{key} pace 50 100 peer"));
    fleet.on_message(&format!("{key} pace 50 300 {me}"));
    assert_eq!(*calls.lock().unwrap(), 0);
}

/// Every live replica's first send after one pause refused (this one's, and its peers' as
/// the channel tells) is an admission control's; the firsts of two pauses a second apart, a
/// peer's refusal that was not its first send, or this one's alone before Redis has counted
/// the replicas, are not.
#[tokio::test(start_paused = true)]
async fn every_replicas_first_send_refused_after_a_pause_is_an_admission_control() {
    let (fleet, upstream) = offline_fleet();
    let found = Arc::new(Mutex::new(0));
    let lease_on = |credential: &'static [u8], live: Option<u64>| {
        let f = Arc::clone(&found);
        let lease = fleet.lease(
            &upstream,
            Some(credential),
            Peers {
                pause: Box::new(|_| {}),
                edge: Box::new(|_, _| None),
                share: Box::new(|_| {}),
                pace: Box::new(|| None),
                scale: Box::new(|_| {}),
                admission: Box::new(move || *f.lock().unwrap() += 1),
            },
            Arc::default(),
        );
        if let Some(live) = live {
            lease.set_live(live);
        }
        let key = lease.pause_key().to_owned();
        (lease, key)
    };
    let second = Duration::from_secs(1);
    // Before Redis has counted the replicas, this one's own first proves nothing.
    let (lease, _) = lease_on(b"uncounted key", None);
    lease.throttled(Some(second), true, false, true, true);
    assert_eq!(*found.lock().unwrap(), 0, "the replicas not yet counted");
    let (lease, key) = lease_on(b"one key", Some(3));
    lease.throttled(Some(second), true, false, true, true);
    fleet.on_message(&format!("{key} throttled 1 peer-a first"));
    fleet.on_message(&format!("{key} throttled 1 peer-b"));
    assert_eq!(
        *found.lock().unwrap(),
        0,
        "peer-b's refusal was not its first"
    );
    tokio::time::advance(Duration::from_millis(50)).await;
    fleet.on_message(&format!("{key} throttled 1 peer-b first"));
    assert_eq!(*found.lock().unwrap(), 1);

    let (lease, key) = lease_on(b"another key", Some(3));
    lease.throttled(Some(second), true, false, true, true);
    fleet.on_message(&format!("{key} throttled 1 peer-a first"));
    tokio::time::advance(second).await;
    fleet.on_message(&format!("{key} throttled 1 peer-b first"));
    assert_eq!(
        *found.lock().unwrap(),
        1,
        "peer-b's first came after the next pause"
    );
    // This replica's own first of that next pause completes it.
    lease.throttled(Some(second), true, false, true, true);
    fleet.on_message(&format!("{key} throttled 1 peer-a first"));
    assert_eq!(*found.lock().unwrap(), 2);
}

#[test]
fn errors_never_carry_the_password() {
    let url = RedisUrl("redis://user:hunter2@redis:6379/0".into());
    assert_eq!(
        redact("auth failed for hunter2 at redis", &url),
        "auth failed for ***** at redis"
    );
    let bare = RedisUrl("redis://redis:6379".into());
    assert_eq!(redact("refused", &bare), "refused");
    let slashed = RedisUrl("redis://u:a/b#c@redis:6379/0".into());
    assert_eq!(redact("no auth a/b#c", &slashed), "no auth *****");
    let unix = RedisUrl("unix:///run/redis.sock?db=1&pass=hunter2".into());
    assert_eq!(redact("bad hunter2", &unix), "bad *****");
}
