//! `[fleet]` against a real Redis: corrals on one key share one limit, lease it in blocks (one
//! round trip per ten requests or fewer, counted by Redis's own `INFO commandstats`), share one
//! 429's pause and what one of them learned, give back unused leases on shutdown, and never let
//! a slow, hung, lost or flushed Redis fail a client request.
//!
//! Each test starts its own `redis-server` on a free loopback port (`--save ""`), ready when it
//! answers `PING` as the process started. Without one installed the tests fail, unless
//! `CORRAL_SKIP_REDIS=1` says to skip them (never under `CI`).

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use corral::herd::redis_server::{script_calls, RedisServer};
use http::Request;
use http_body_util::Full;
use support::binary::{corral_command, Running};
use support::{client, eventually, json, post, send, Corral, MockUpstream};
use tokio::time::Instant;

/// A fresh `redis-server`; `None` (after a note) when none is installed and
/// `CORRAL_SKIP_REDIS=1`; otherwise a panic that says how to get one.
fn redis() -> Option<RedisServer> {
    if !RedisServer::available() {
        assert!(
            std::env::var("CORRAL_SKIP_REDIS").as_deref() == Ok("1"),
            "redis-server is not installed: install Debian's `redis-server` package (`bash \
             .ci/run` does), or set CORRAL_SKIP_REDIS=1 to skip the fleet tests"
        );
        support::skip(
            "a fleet test",
            "CORRAL_SKIP_REDIS=1 and redis-server is not installed",
        );
        return None;
    }
    Some(RedisServer::start().expect("start redis-server"))
}

/// The limit most tests here set: 100 requests a second, a burst of 10.
const AT_100_PER_SECOND: &str = "[upstream.limits]\nrpm = 6000\nburst = 10\n";

/// A corral config fronting `upstream` at `/v1`, sharing its limits through `redis`.
fn fleet_config(
    upstream: &MockUpstream,
    redis: &str,
    fleet_extra: &str,
    upstream_extra: &str,
) -> String {
    format!(
        "drain_timeout = \"5s\"\n[fleet]\nredis = \"{redis}\"\nname = \"test\"\n{fleet_extra}\n\
         [[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"http://{}/v1\"\n{upstream_extra}\n",
        upstream.addr
    )
}

/// An upstream that answers 200 and records when each request arrived.
async fn recording_upstream() -> (MockUpstream, Arc<Mutex<Vec<Instant>>>) {
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let a = Arc::clone(&arrivals);
    let upstream = MockUpstream::start(move |_| {
        a.lock().unwrap().push(Instant::now());
        async { json(200, serde_json::json!({"ok": true})) }
    })
    .await;
    (upstream, arrivals)
}

async fn get_json(corral: &Corral, path: &str) -> serde_json::Value {
    let req = Request::get(corral.url(path))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, body) = send(&client(), req).await;
    serde_json::from_slice(&body).expect("JSON")
}

async fn fleet_mode(corral: &Corral) -> String {
    get_json(corral, "/status").await["fleet"]["mode"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

async fn wait_for_mode(corral: &Corral, mode: &str, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if fleet_mode(corral).await == mode {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// What `read` finds in `corral`'s `/status`, polled every 20 ms for up to 2 s until it finds
/// something.
async fn polled<T>(corral: &Corral, read: impl Fn(&serde_json::Value) -> Option<T>) -> Option<T> {
    for _ in 0..100 {
        if let Some(found) = read(&get_json(corral, "/status").await) {
            return Some(found);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// `/status` of the partition of model `m` (the one `burst` sends to).
fn model_m(status: &serde_json::Value) -> serde_json::Value {
    status["upstreams"][0]["rate_limit"]["by_partition"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["model"] == "m"))
        .cloned()
        .unwrap_or_default()
}

/// Two unconfigured corrals on one fleet in front of `upstream`, both listening to the fleet's
/// channel.
async fn two_corrals(upstream: &MockUpstream, server: &RedisServer) -> (Corral, Corral) {
    let toml = fleet_config(upstream, &server.url(), "", "");
    let a = Corral::start(&toml).await;
    let b = Corral::start(&toml).await;
    subscribed(server, 2).await;
    (a, b)
}

/// `n` requests through `corral` from `concurrency` clients at once; the statuses.
async fn burst(corral: &Corral, n: usize, concurrency: usize) -> Vec<u16> {
    let next = Arc::new(AtomicUsize::new(0));
    let statuses = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, statuses, url) = (
                Arc::clone(&next),
                Arc::clone(&statuses),
                corral.url("/v1/chat/completions"),
            );
            tokio::spawn(async move {
                let c = client();
                while next.fetch_add(1, Ordering::SeqCst) < n {
                    let (parts, _) = send(&c, post(&url, r#"{"model":"m"}"#)).await;
                    statuses.lock().unwrap().push(parts.status.as_u16());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let out = statuses.lock().unwrap().clone();
    out
}

/// Requests sent through `corral` by `concurrency` loops until stopped: (sent, not 200).
struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(corral: &Corral, concurrency: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let tasks = (0..concurrency)
            .map(|_| {
                let (stop, sent, failed, url) = (
                    Arc::clone(&stop),
                    Arc::clone(&sent),
                    Arc::clone(&failed),
                    corral.url("/v1/chat/completions"),
                );
                tokio::spawn(async move {
                    let c = client();
                    while !stop.load(Ordering::SeqCst) {
                        let (parts, _) = send(&c, post(&url, r#"{"model":"m"}"#)).await;
                        sent.fetch_add(1, Ordering::SeqCst);
                        if parts.status != 200 {
                            failed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            sent,
            failed,
            tasks,
        }
    }

    /// Stop and wait: (sent, failed).
    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        (
            self.sent.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
        )
    }
}

async fn redis_cmd(server: &RedisServer, args: &[&str]) -> redis::Value {
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn).await.unwrap()
}

/// Wait until `n` corrals listen on the fleet's channel (`PUBSUB NUMSUB`).
async fn subscribed(server: &RedisServer, n: i64) {
    for _ in 0..250 {
        let v = redis_cmd(server, &["PUBSUB", "NUMSUB", "corral:fleet:test:pauses"]).await;
        if let redis::Value::Array(items) = v {
            if items.get(1) == Some(&redis::Value::Int(n)) {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{n} corrals never subscribed to the fleet's channel");
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
}

async fn metrics(corral: &Corral) -> String {
    let req = Request::get(corral.url("/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, body) = send(&client(), req).await;
    String::from_utf8(body.to_vec()).unwrap()
}

/// Two corrals told the same limit (100/s, burst 10) share it: 400 requests split between
/// them take as long as one limit allows, not half as long, and Redis served at most one
/// lease call per ten requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_corrals_share_one_limit_leasing_in_blocks() {
    let Some(server) = redis() else { return };
    let (upstream, arrivals) = recording_upstream().await;
    let toml = fleet_config(&upstream, &server.url(), "", AT_100_PER_SECOND);
    let a = Corral::start(&toml).await;
    let b = Corral::start(&toml).await;
    let before = script_calls(&server.url()).await.unwrap();
    let start = Instant::now();
    let (ra, rb) = tokio::join!(burst(&a, 200, 10), burst(&b, 200, 10));
    let elapsed = start.elapsed();
    let calls = script_calls(&server.url()).await.unwrap() - before;
    assert!(
        ra.iter().chain(&rb).all(|s| *s == 200),
        "every request succeeded: {ra:?} {rb:?}"
    );
    // (400 - 10) / 100 = 3.9 s at the shared limit; each alone at the whole limit would be
    // done in about half that. Bound: 3.3 s (15% for timer slack).
    assert!(
        elapsed >= Duration::from_millis(3300),
        "400 requests through two corrals sharing 100/s took {elapsed:?}: the limit was not shared"
    );
    // Nor did the upstream ever see more than the shared bucket allows: in any second, at
    // most burst + rate (+10% slack).
    let arrivals = arrivals.lock().unwrap().clone();
    for (i, t) in arrivals.iter().enumerate() {
        let in_a_second = arrivals[i..]
            .iter()
            .take_while(|u| u.duration_since(*t) < Duration::from_secs(1))
            .count();
        assert!(
            in_a_second <= 130,
            "{in_a_second} requests within 1 s of one another"
        );
    }
    // One lease call per ten requests, plus for each corral its first call, the smaller asks
    // of the first second (before arrivals are measured), a give-back at the end and a
    // NOSCRIPT retry: 15 in all.
    eprintln!("{calls} lease calls for 400 requests");
    assert!(
        calls <= 400 / 10 + 15,
        "{calls} lease calls for 400 requests: more than one per ten"
    );
    assert!(
        calls >= 400 / 25,
        "{calls} lease calls: were the leases used at all?"
    );
}

/// A 429 (with `retry-after-ms: 1500`) seen by one corral pauses the other at once: its
/// request reaches the upstream only after the hint passed, though it never saw a 429. (B has
/// used the partition before, so it has joined the fleet's pause channel for it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_429_pauses_every_replica() {
    let Some(server) = redis() else { return };
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let a2 = Arc::clone(&arrivals);
    let upstream = MockUpstream::start(move |_| {
        let n = {
            let mut a = a2.lock().unwrap();
            a.push(Instant::now());
            a.len()
        };
        async move {
            if n == 2 {
                let mut r = json(429, serde_json::json!({"error": {"type": "rate_limit"}}));
                r.headers_mut()
                    .insert("retry-after-ms", "1500".parse().unwrap());
                r
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    let (a, b) = two_corrals(&upstream, &server).await;
    assert_eq!(
        burst(&b, 1, 1).await,
        [200],
        "B's partition of model m is in use"
    );
    let url = a.url("/v1/chat/completions");
    // The same model as `burst`'s: one partition, paused as one.
    let first = tokio::spawn(async move {
        send(&client(), post(&url, r#"{"model":"m"}"#))
            .await
            .0
            .status
    });
    assert!(
        eventually(Duration::from_secs(5), || arrivals.lock().unwrap().len()
            >= 2)
        .await,
        "corral A's request reached the upstream"
    );
    let refused_at = arrivals.lock().unwrap()[1];
    // The pause travels: A's answer, its lease call, the script's PUBLISH, B's listener; B's
    // `/status` shows it once it arrived. A few milliseconds; polled for up to the hint itself
    // (after which there is no pause left to see).
    let mut paused = false;
    while !paused && refused_at.elapsed() < Duration::from_millis(1500) {
        paused = model_m(&get_json(&b, "/status").await)["paused_ms"].as_u64() > Some(0);
    }
    assert!(paused, "B never saw the pause A's 429 set");
    assert_eq!(burst(&b, 1, 1).await, [200], "B's request went through");
    assert_eq!(
        first.await.unwrap(),
        200,
        "A retried its 429 after the pause"
    );
    let seen = arrivals.lock().unwrap().clone();
    assert_eq!(seen.len(), 4, "B's first, the 429, A's retry, B's request");
    for t in &seen[2..] {
        let after = t.duration_since(refused_at);
        assert!(
            after >= Duration::from_millis(1400),
            "a request reached the upstream {after:?} after the 429 whose hint was 1.5 s"
        );
    }
}

/// What one corral learned from the provider's headers reaches another that never saw them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_learns_all_know() {
    let Some(server) = redis() else { return };
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = Arc::clone(&calls);
    let upstream = MockUpstream::start(move |_| {
        let n = c2.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut r = json(200, serde_json::json!({"ok": true}));
            if n < 3 {
                // Only A's first three answers carry headers: 600 per minute, 10/s.
                let h = r.headers_mut();
                h.insert("x-ratelimit-limit-requests", "600".parse().unwrap());
                h.insert("x-ratelimit-remaining-requests", "597".parse().unwrap());
                h.insert("x-ratelimit-reset-requests", "300ms".parse().unwrap());
            }
            r
        }
    })
    .await;
    let (a, b) = two_corrals(&upstream, &server).await;
    assert_eq!(burst(&a, 3, 1).await, [200, 200, 200]);
    let learned = model_m(&get_json(&a, "/status").await)["learned"][0]["rate_per_second"]
        .as_f64()
        .unwrap();
    assert!(learned > 0.0, "A learned a pace from the headers");
    assert_eq!(burst(&b, 1, 1).await, [200]);
    let shared =
        |v: &serde_json::Value| model_m(v)["fleet"]["requests"]["shared_rate_per_second"].as_f64();
    let seen = polled(&b, shared)
        .await
        .expect("B paces to the shared bucket A's headers set");
    assert!(
        (seen - learned).abs() < 0.25 * learned,
        "B's shared rate {seen} is what A learned ({learned})"
    );
}

/// A replica that joins a key is counted by the others at once, not at their next lease: the
/// count is each replica's part of a report nothing divides (a key without a shared bucket), and
/// one that still counted itself alone took the whole headroom (four corrals on Anthropic's
/// headers at the quick scale: 6-41 rate 429s of 500 from run to run, none once counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_joins_is_counted_at_once() {
    let Some(server) = redis() else { return };
    let (upstream, _) = recording_upstream().await;
    let (a, b) = two_corrals(&upstream, &server).await;
    let live = |v: &serde_json::Value| model_m(v)["fleet"]["live_replicas"].as_u64();
    assert_eq!(burst(&a, 1, 1).await, [200]);
    // A's lease calls Redis once, alone on the key.
    assert_eq!(polled(&a, live).await, Some(1), "A leased alone");
    assert_eq!(burst(&b, 1, 1).await, [200]);
    // A sends nothing more: only the fleet's channel can tell it. Bound: 2 s, where the
    // message and the call it prompts take milliseconds; without it A counts 1 for good (an
    // unconfigured key without headers has no shared bucket to keep a heartbeat).
    let counted = polled(&a, |v| live(v).filter(|&n| n == 2)).await;
    assert_eq!(counted, Some(2), "A still counts itself alone");
    assert_eq!(live(&get_json(&b, "/status").await), Some(2));
}

/// A's first attempt is refused with a 429 carrying `headers` (its retry is answered), while B
/// has seen three answers and no 429: B's `/status` as it stands `within` after A's refusal
/// (sooner, once its source has moved from `slow_start`).
async fn peer_refused(
    server: &RedisServer,
    headers: &'static [(&'static str, &'static str)],
    within: Duration,
) -> serde_json::Value {
    let refuse_next = Arc::new(AtomicBool::new(false));
    let r2 = Arc::clone(&refuse_next);
    let upstream = MockUpstream::start(move |_| {
        let refuse = r2.swap(false, Ordering::SeqCst);
        async move {
            if refuse {
                let body = serde_json::json!({"error": {
                    "message": "Rate limit reached for requests",
                    "type": "requests",
                    "code": "rate_limit_exceeded"}});
                let mut answer = json(429, body);
                for (name, value) in headers {
                    answer.headers_mut().insert(*name, value.parse().unwrap());
                }
                answer
            } else {
                json(200, serde_json::json!({"ok": true}))
            }
        }
    })
    .await;
    let (a, b) = two_corrals(&upstream, server).await;
    let learned = |v: &serde_json::Value| model_m(v)["learned"][0].clone();
    assert_eq!(burst(&b, 3, 1).await, [200, 200, 200]);
    assert_eq!(
        learned(&get_json(&b, "/status").await)["source"],
        "slow_start"
    );
    refuse_next.store(true, Ordering::SeqCst);
    assert_eq!(burst(&a, 1, 1).await, [200]);
    assert_eq!(learned(&get_json(&a, "/status").await)["throttles_seen"], 1);
    let mut seen = serde_json::Value::Null;
    let start = Instant::now();
    while start.elapsed() < within {
        seen = learned(&get_json(&b, "/status").await);
        if seen["source"] != "slow_start" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen["throttles_seen"], 0, "B met no 429 itself");
    seen
}

/// Without rate-limit headers, a 429 that one replica meets ends the others' throttle windows
/// too: B, never refused itself, stops its ramp (its pace now comes from the 429s: `aimd`)
/// when A is refused, as it would on a 429 of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_429_teaches_a_replica_that_met_none() {
    let Some(server) = redis() else { return };
    let seen = peer_refused(&server, &[], Duration::from_secs(2)).await;
    assert_eq!(seen["source"], "aimd", "B learned of A's 429: {seen}");
}

/// A 429 whose headers report the bucket is no edge for the peers: the fleet shares that
/// bucket through Redis, and B, still waiting for the key's headers in answers of its own,
/// keeps its ramp rather than cutting it on A's refusal (the test above sees an edge within
/// milliseconds; this one waits a second for one that must not come).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_429_under_headers_leaves_its_ramp_alone() {
    let Some(server) = redis() else { return };
    let headers = &[
        ("x-ratelimit-limit-requests", "100"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "600ms"),
    ];
    let seen = peer_refused(&server, headers, Duration::from_secs(1)).await;
    assert_eq!(seen["source"], "slow_start", "B kept its ramp: {seen}");
}

/// Units leased and never used go back to the shared bucket (after a lull, or at shutdown),
/// and a corral that stops leaves the live set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unused_leases_go_back_and_a_stopped_corral_leaves() {
    let Some(server) = redis() else { return };
    let (upstream, arrivals) = recording_upstream().await;
    // 1 per second, burst 5: twelve requests at once lease what they need, a block of 10 (5 at
    // once, 5 over the next 5 s); once the five have reached the upstream, the other seven give
    // up, so most of the block is never used.
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "",
        "[upstream.limits]\nrpm = 60\nburst = 5\n",
    );
    let mut corral = Corral::start(&toml).await;
    let url = corral.url("/v1/chat/completions");
    let tries: Vec<_> = (0..12)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { send(&client(), post(&url, "{}")).await })
        })
        .collect();
    let start = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || arrivals.lock().unwrap().len()
            >= 5)
        .await,
        "the burst of 5 reached the upstream within 10 s"
    );
    for t in &tries {
        t.abort();
    }
    for t in tries {
        let _ = t.await;
    }
    // Five at once; each second spent getting here may have let one more through.
    let served = arrivals.lock().unwrap().len();
    let allowed = 5 + start.elapsed().as_secs() as usize + 1;
    assert!(
        (5..=allowed).contains(&served),
        "{served} served from a burst of 5 (at most {allowed} by now)"
    );
    let keys = match redis_cmd(&server, &["KEYS", "corral:*:requests"]).await {
        redis::Value::Array(keys) => keys,
        other => panic!("KEYS answered {other:?}"),
    };
    assert_eq!(keys.len(), 1, "one bucket, under a hashed key");
    let key = match &keys[0] {
        redis::Value::BulkString(k) => String::from_utf8(k.clone()).unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(
        key.starts_with("corral:{") && key.ends_with("}:requests"),
        "{key}"
    );
    let level = |v: redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8(b).unwrap().parse::<f64>().unwrap(),
        other => panic!("{other:?}"),
    };
    // The grant took the shared level below zero (units queued behind the refill).
    let leased = level(redis_cmd(&server, &["HGET", &key, "level"]).await);
    let start = Instant::now();
    corral.shutdown();
    corral.task.take().unwrap().await.unwrap().unwrap();
    let after = level(redis_cmd(&server, &["HGET", &key, "level"]).await);
    // Refill alone adds 1 a second; the unused units (about 4 of the 5 queued, fewer if more
    // were served) add more.
    let refill = start.elapsed().as_secs_f64() + 0.5;
    let unused = 10.0 - served as f64;
    assert!(
        after >= leased + refill + unused - 2.5,
        "the unused units came back: {leased} -> {after} ({refill:.1} of refill)"
    );
    let replicas_key = key.replace(":requests", ":replicas");
    let live = redis_cmd(&server, &["ZCARD", &replicas_key]).await;
    assert_eq!(live, redis::Value::Int(0), "it left the live set");
}

/// Redis unreachable from the start: corral starts, serves every request at its local share,
/// says `fallback` in `/status` and `/metrics`, and never prints the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_never_blocks_startup_nor_fails_a_request() {
    let (upstream, _) = recording_upstream().await;
    let dead = "redis://user:hunter2@127.0.0.1:1/0";
    let toml = fleet_config(&upstream, dead, "", AT_100_PER_SECOND);
    let path = std::env::temp_dir().join(format!("corral-fleet-{}.toml", std::process::id()));
    std::fs::write(&path, &toml).unwrap();
    let mut cmd = corral_command([
        "--config",
        path.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
    ]);
    cmd.env("RUST_LOG", "info");
    let running = Running::spawn(cmd, false).await;
    let c = client();
    for _ in 0..20 {
        let (parts, _) = send(&c, post(&running.url("/v1/chat/completions"), "{}")).await;
        assert_eq!(parts.status, 200, "requests pass while Redis is down");
    }
    let (_, status) = running.get(running.addr, "/status").await;
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["fleet"]["mode"], "fallback", "{status}");
    assert_eq!(status["fleet"]["redis"], "redis://user:*****@127.0.0.1:1/0");
    let (_, metrics) = running.get(running.addr, "/metrics").await;
    assert!(
        metrics.contains("corral_fleet_mode{mode=\"fallback\"} 1"),
        "{metrics}"
    );
    assert!(running.log_has("fleet: Redis is slow or unreachable"));
    running.signal("INT");
    let (_, log) = running.wait().await;
    let _ = std::fs::remove_file(&path);
    assert!(
        !log.iter().any(|l| l.contains("hunter2")) && !status.to_string().contains("hunter2"),
        "the Redis password was printed"
    );
}

/// The faults: each one, under steady load through a corral with the limit set (100/s): no
/// client request fails; a slow, hung or lost Redis is a fallback, counted, and corral
/// leases from Redis again when it is back; `SCRIPT FLUSH` is no fallback at all.
async fn under_fault(
    fault: impl std::future::Future<Output = ()>,
    expect_fallback: bool,
    server: &RedisServer,
) {
    let (upstream, _) = recording_upstream().await;
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "lease_timeout = \"500ms\"",
        AT_100_PER_SECOND,
    );
    let corral = Corral::start(&toml).await;
    let load = Load::start(&corral, 8);
    assert!(wait_for_mode(&corral, "shared", Duration::from_secs(5)).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Watched while the fault lasts (a hung Redis is back by the time the fault returns).
    let ((), noticed) = tokio::join!(
        fault,
        wait_for_mode(&corral, "fallback", Duration::from_secs(5))
    );
    assert_eq!(
        noticed, expect_fallback,
        "a fallback, if and only if expected"
    );
    assert!(
        wait_for_mode(&corral, "shared", Duration::from_secs(15)).await,
        "corral leases from Redis again once it is back"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (sent, failed) = load.finish().await;
    assert!(sent > 50, "the load ran ({sent} requests)");
    assert_eq!(failed, 0, "{failed} of {sent} client requests failed");
    let m = metrics(&corral).await;
    let fallbacks = metric(&m, "corral_fleet_fallbacks_total");
    if expect_fallback {
        assert!(fallbacks >= 1.0, "counted: {fallbacks}");
    } else {
        assert_eq!(fallbacks, 0.0, "no fallback");
    }
    assert!(metric(&m, "corral_fleet_round_trips_total{outcome=\"ok\"}") > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_is_a_fallback_and_no_failure() {
    let Some(server) = redis() else { return };
    let fault = async {
        redis_cmd(&server, &["CLIENT", "PAUSE", "1500"]).await;
    };
    under_fault(fault, true, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_redis_is_a_fallback_and_no_failure() {
    let Some(server) = redis() else { return };
    let pid = server.pid().unwrap().to_string();
    let fault = async {
        let kill = |sig: &str| {
            let ok = std::process::Command::new("kill")
                .args([sig, &pid])
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill {sig} {pid}");
        };
        kill("-STOP");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        kill("-CONT");
    };
    under_fault(fault, true, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_redis_is_a_fallback_and_no_failure() {
    let Some(server) = redis() else { return };
    let fault = async {
        server.kill();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        server.restart().unwrap();
    };
    under_fault(fault, true, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_is_loaded_again() {
    let Some(server) = redis() else { return };
    let fault = async {
        assert_eq!(
            redis_cmd(&server, &["SCRIPT", "FLUSH"]).await,
            redis::Value::Okay
        );
    };
    under_fault(fault, false, &server).await;
}

/// The herd's 500 clients over four corrals sharing `server`, at `scale` (rates times it,
/// times over it).
fn four_on_redis(server: &RedisServer, scale: f64) -> corral::herd::Spec {
    corral::herd::Spec {
        replicas: 4,
        redis: Some(server.url()),
        ..corral::herd::Spec::reference(500, scale)
    }
}

/// The herd (at a fifth of its time scale: bucket 50 refilled at 100/s, bound 4.5 s) split
/// unevenly over four corrals that share the whole limit through Redis: every client
/// succeeds, near the bound, with few 429s and few Redis round trips. Bounds are generous
/// for a busy two-core machine running a debug build. (At the quick scale, 10x, timer slack
/// alone made 2-5% of requests 429s with the limit set.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_herd_over_four_corrals_sharing_redis() {
    use corral::herd::{run_one, Spec, Strategy};
    let Some(server) = redis() else { return };
    let spec = Spec {
        uneven: true,
        ..four_on_redis(&server, 5.0)
    };
    for strategy in [Strategy::CorralConfigured, Strategy::CorralAuto] {
        let r = run_one(&spec, strategy).await.unwrap();
        let label = strategy.label();
        assert_eq!(r.failed, 0, "{label}: no client failed");
        // Bound 4.5 s; allow 2x.
        assert!(r.makespan < r.bound * 2, "{label}: {:?}", r.makespan);
        // At most 5% 429s (the benchmark's target is 1% with the limit set, 2% unconfigured).
        assert!(
            r.upstream_429 <= 25,
            "{label}: {} upstream 429s",
            r.upstream_429
        );
        // The steady-state ratio (one per ten) is asserted by
        // `two_corrals_share_one_limit_leasing_in_blocks`. A whole 5-second run adds each
        // corral's first calls and smaller asks, a pause per 429, the give-backs at the end
        // (and on a loaded machine, a lease over `lease_timeout` and its probes): 0.2 a
        // request in all; typically 0.07-0.09 here.
        let calls = r.redis_calls.expect("counted");
        assert!(
            calls as f64 <= 0.2 * 500.0,
            "{label}: {calls} Redis round trips for 500 requests ({} upstream 429s, {:?})",
            r.upstream_429,
            r.makespan
        );
    }
}

/// Four corrals on Redis told one limit for the key (the sum of its two models' rows, as one
/// might add the rows of a limits page) over a model whose own limit is a sixth of it: the
/// shared bucket never binds for that model, so each replica must take its part of the
/// model's own report rather than all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_set_above_a_models_own_leaves_each_replica_its_part_of_the_report() {
    use corral::herd::{run_one, Scenario, Spec, Strategy};
    let Some(server) = redis() else { return };
    let spec = Spec {
        scenario: Some(Scenario::Models),
        ..four_on_redis(&server, 5.0)
    };
    let r = run_one(&spec, Strategy::CorralConfigured).await.unwrap();
    assert_eq!(r.failed, 0, "no client failed");
    // At this scale (bound 12 s), each replica reading the whole report: 44-51 rate 429s of
    // 500 in three runs; its part: 6-13 in five. 5% leaves room for a loaded machine.
    assert!(
        r.rate_429 <= 25,
        "{} rate 429s of 500 ({:?} for a bound of {:?})",
        r.rate_429,
        r.makespan,
        r.bound
    );
}

/// A request that needs more tokens than a block (a large `max_tokens`) gets a lease of its
/// size at once, instead of waiting for its deadline behind a block that cannot cover it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_a_block_is_leased_what_it_needs() {
    let Some(server) = redis() else { return };
    let (upstream, _) = recording_upstream().await;
    // 10,000 tokens a second, a burst of 50,000: each request below costs about 8,000.
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "",
        "[upstream.limits]\ntpm = 600000\ntoken_burst = 50000\n",
    );
    let corral = Corral::start(&toml).await;
    let c = client();
    let start = Instant::now();
    for _ in 0..3 {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8000}"#;
        let (parts, _) = send(&c, post(&corral.url("/v1/chat/completions"), body)).await;
        assert_eq!(parts.status, 200);
    }
    // 24,000 tokens of a 50,000 burst: no wait at all; 5 s allowed.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
}

/// A partition made after the fleet answered (here a new API key's, with nothing to pace it
/// locally, so its requests take the fast path) still joins the fleet: it heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_partition_joins_the_fleet_at_once() {
    let Some(server) = redis() else { return };
    let (upstream, _) = recording_upstream().await;
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "",
        "[upstream.limits]\npartition = \"api_key\"\n",
    );
    let corral = Corral::start(&toml).await;
    assert!(wait_for_mode(&corral, "shared", Duration::from_secs(5)).await);
    let req = Request::post(corral.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-one")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let (parts, _) = send(&client(), req).await;
    assert_eq!(parts.status, 200);
    let mut partitions = 0;
    for _ in 0..100 {
        partitions = match redis_cmd(&server, &["KEYS", "corral:*:replicas"]).await {
            redis::Value::Array(keys) => keys.len(),
            _ => 0,
        };
        if partitions == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        partitions, 2,
        "the upstream's partition and the key's both heartbeat"
    );
}

/// Redis down when corral starts, up later: corral, fallen back, keeps probing while requests
/// come (light traffic, one at a time), and leases from Redis once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_comes_up_later_is_found() {
    let Some(server) = redis() else { return };
    server.kill();
    let (upstream, _) = recording_upstream().await;
    let toml = fleet_config(&upstream, &server.url(), "", AT_100_PER_SECOND);
    let corral = Corral::start(&toml).await;
    assert_eq!(burst(&corral, 1, 1).await, [200]);
    assert_eq!(fleet_mode(&corral).await, "fallback");
    server.restart().unwrap();
    let mut shared = false;
    for _ in 0..50 {
        assert_eq!(burst(&corral, 1, 1).await, [200]);
        if fleet_mode(&corral).await == "shared" {
            shared = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(shared, "corral never leased from the Redis that came up");
}

/// The test server is ready only when the process it started answers `PING`: a port another
/// Redis holds is a clash (the new server exits), not a server ready to use.
#[test]
fn a_taken_port_is_a_clash_not_a_ready_server() {
    let Some(server) = redis() else { return };
    let clash = RedisServer::on_port(server.port());
    assert!(
        clash.is_err(),
        "a second redis-server on a taken port was taken for ready"
    );
    // The first is untouched.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let pong: String = redis::cmd("PING").query(&mut conn).unwrap();
    assert_eq!(pong, "PONG");
}

/// Pooled keys each get their own fleet bucket: two keys at 1 request a second with a burst
/// of 5 each send ten requests at once (five per key), where one bucket shared by both would
/// hold the last five for 5 s. Redis holds a requests bucket per key and model (the requests
/// name model `m`), one per key for requests without a model, and the upstream's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pooled_keys_each_lease_from_their_own_fleet_bucket() {
    let Some(server) = redis() else { return };
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = Arc::clone(&seen);
    let upstream = MockUpstream::start(move |req| {
        let auth = req.headers.get("authorization").cloned();
        s2.lock().unwrap().push(auth);
        async { json(200, serde_json::json!({"ok": true})) }
    })
    .await;
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "",
        "keys = [\"sk-a\", \"sk-b\"]\n[upstream.limits]\nrpm = 60\nburst = 5\n\
         [upstream.headers]\nAuthorization = \"Bearer {key}\"\n",
    );
    let corral = Corral::start(&toml).await;
    assert!(wait_for_mode(&corral, "shared", Duration::from_secs(5)).await);
    let start = Instant::now();
    let statuses = burst(&corral, 10, 10).await;
    let took = start.elapsed();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // Five at once per key; a shared bucket would need 5 s for the second five. 3 s allowed.
    assert!(
        took < Duration::from_secs(3),
        "ten requests over two keys took {took:?}: the keys share one bucket"
    );
    let seen = seen.lock().unwrap().clone();
    for key in ["Bearer sk-a", "Bearer sk-b"] {
        let n = seen
            .iter()
            .filter(|a| a.as_ref().is_some_and(|a| a == key))
            .count();
        assert!(n >= 4, "{n} of 10 requests went with {key}");
    }
    let buckets = || async {
        match redis_cmd(&server, &["KEYS", "corral:*:requests"]).await {
            redis::Value::Array(keys) => keys.len(),
            other => panic!("KEYS answered {other:?}"),
        }
    };
    let mut n = 0;
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        n = buckets().await;
        if n == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        n, 5,
        "a requests bucket for each key and model, each key's own, and the upstream's"
    );
}

/// docs/operations.md: a lost Redis costs at most one burst. Redis loses its data (`FLUSHALL`)
/// under steady load at 1 request a second with a burst of 5; the corral does not notice (no
/// fallback), and its next lease recreates the bucket full. From the loss until 5 s after that
/// lease (long enough for any units granted from the lost bucket to fall due), the upstream sees at
/// most the refill, that one burst, and one for timer slack: units of the lost bucket not yet due
/// are not spent on top of the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_redis_costs_at_most_one_burst() {
    let Some(server) = redis() else { return };
    let (upstream, arrivals) = recording_upstream().await;
    let toml = fleet_config(
        &upstream,
        &server.url(),
        "",
        "[upstream.limits]\nrpm = 60\nburst = 5\n",
    );
    let corral = Corral::start(&toml).await;
    let load = Load::start(&corral, 12);
    assert!(wait_for_mode(&corral, "shared", Duration::from_secs(5)).await);
    // Steady state: the burst spent, blocks leased ahead of the refill.
    assert!(
        eventually(Duration::from_secs(20), || arrivals.lock().unwrap().len()
            >= 8)
        .await,
        "the load reached the upstream"
    );
    assert_eq!(redis_cmd(&server, &["FLUSHALL"]).await, redis::Value::Okay);
    let lost = Instant::now();
    let mut recreated = false;
    while !recreated && lost.elapsed() < Duration::from_secs(30) {
        recreated = match redis_cmd(&server, &["KEYS", "corral:*:requests"]).await {
            redis::Value::Array(keys) => !keys.is_empty(),
            other => panic!("KEYS answered {other:?}"),
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(recreated, "no lease within 30 s of the loss");
    eprintln!("recreated after {:?}", lost.elapsed());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let end = Instant::now();
    let (_, failed) = load.finish().await;
    assert_eq!(failed, 0);
    assert_eq!(
        fleet_mode(&corral).await,
        "shared",
        "no fallback: not noticed"
    );
    let after = arrivals
        .lock()
        .unwrap()
        .iter()
        .filter(|t| **t > lost && **t <= end)
        .count();
    let secs = (end - lost).as_secs_f64();
    let allowed = secs.ceil() as usize + 5 + 1;
    eprintln!("{after} arrivals in {secs:.1} s after the loss (allowed {allowed})");
    assert!(
        after <= allowed,
        "{after} requests reached the upstream in the {secs:.1} s after Redis lost its \
         buckets: more than the refill, one burst and one ({allowed})"
    );
}

/// One lease call as replica `replica`, learning (or not) a requests bucket of 20/s (its burst,
/// level and the units the report has not seen), through the script itself; the reply's
/// requests level before the grant, and the bucket's burst.
async fn lease_call(
    server: &RedisServer,
    replica: &str,
    learned: Option<(u32, u32, u32)>,
) -> (f64, f64) {
    let script = include_str!("../src/fleet/lease.lua");
    let keys = ["requests", "tokens", "pause", "replicas"].map(|k| format!("{{t}}:{k}"));
    let (burst, level, unseen) = learned.map_or(("0".into(), "-1".into(), "0".into()), |l| {
        (l.0.to_string(), l.1.to_string(), l.2.to_string())
    });
    let rate = if learned.is_some() { "20" } else { "0" };
    let mut args: Vec<&str> = vec!["EVAL", script, "4"];
    args.extend(keys.iter().map(String::as_str));
    // Replica, TTL, leaving, pause, refused; requests: want, back, configured rate and burst,
    // learned rate, burst, level; tokens alike (nothing); channel, resync, epochs, edge,
    // estimate; the units unseen (requests, tokens).
    args.extend([replica, "10000", "0", "0", "0"]);
    args.extend(["0", "0", "0", "0", rate, &burst, &level]);
    args.extend(["0", "0", "0", "0", "0", "0", "-1"]);
    args.extend(["c", "0", "-", "-", "0", "-", &unseen, "0"]);
    let number = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).parse().unwrap(),
        other => panic!("a number: {other:?}"),
    };
    match redis_cmd(server, &args).await {
        redis::Value::Array(v) => (number(&v[1]), number(&v[3])),
        other => panic!("reply: {other:?}"),
    }
}

/// A bucket learned from a report starts at the report's level less what the replicas sent
/// that it has not seen (the caller's own sends since, as many for each other live replica),
/// not at the report split over the replicas: four corrals at a fresh burst of 50, each with
/// 2 requests in flight, start with 42 where a split gave 12.5 and a quarter second was lost.
#[tokio::test]
async fn a_learned_bucket_starts_at_the_report_less_what_it_has_not_seen() {
    let Some(server) = redis() else { return };
    for other in ["b", "c", "d"] {
        assert_eq!(lease_call(&server, other, None).await.0, 0.0);
    }
    let (level, _) = lease_call(&server, "a", Some((50, 50, 2))).await;
    assert_eq!(
        level,
        50.0 - 4.0 * 2.0,
        "the report less 2 unseen per replica"
    );
    // Once the bucket stands, a later report does not reset it.
    assert!(lease_call(&server, "b", Some((50, 50, 0))).await.0 < 43.0);
}

/// A per-minute report built a bucket of 12,000; a replica's 429 taught the bucket is 50 and
/// empty. The shrunk bucket is as empty as that replica's report says, not full at the new
/// burst: the level was counted in the old unit.
#[tokio::test]
async fn a_shrunk_bucket_keeps_the_level_its_report_gives() {
    let Some(server) = redis() else { return };
    let (level, burst) = lease_call(&server, "a", Some((12_000, 11_990, 0))).await;
    assert_eq!((level, burst), (11_990.0, 12_000.0));
    let (level, burst) = lease_call(&server, "b", Some((50, 0, 0))).await;
    assert_eq!(burst, 50.0);
    assert!(
        level < 1.0,
        "the report's empty bucket, not a full one: {level}"
    );
}

/// A pause beyond the deadline (a per-day quota's) refuses the request waiting for the shared
/// bucket at once: it noticed the pause only once it held a token, spent on a request refused
/// after it, and in each replica the queue behind it waited as long (`corral bench herd --scenario daily-quota --replicas 4 --redis
/// auto`, limit set: the last refusals 0.3 s after the quota's 429, 1.28x its bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_beyond_the_deadline_refuses_the_fleets_queue_at_once() {
    let Some(server) = redis() else { return };
    let (upstream, arrivals) = {
        let arrivals = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&arrivals);
        let upstream = MockUpstream::start(move |_| {
            let n = seen.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                if n == 1 {
                    json(200, serde_json::json!({"ok": true}))
                } else {
                    let mut r = json(429, serde_json::json!({"error": {"type": "rate_limit"}}));
                    r.headers_mut()
                        .insert("retry-after", "3600".parse().unwrap());
                    r
                }
            }
        })
        .await;
        (upstream, arrivals)
    };
    // One request a second: the queue waits for the shared bucket, a second a request.
    let limit = "[upstream.limits]\nrpm = 60\nburst = 1\n";
    let corral = Corral::start(&fleet_config(&upstream, &server.url(), "", limit)).await;
    let url = corral.url("/v1/chat/completions");
    let start = Instant::now();
    let tasks: Vec<_> = (0..5)
        .map(|i| {
            let mut req = post(&url, &format!(r#"{{"model":"m","input":"{i}"}}"#));
            req.headers_mut()
                .insert("x-corral-deadline-ms", "30000".parse().unwrap());
            tokio::spawn(async move { send(&client(), req).await.0 })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        let parts = t.await.unwrap();
        let refused_here = parts.headers.get("x-corral-error").is_some();
        statuses.push((parts.status.as_u16(), refused_here));
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [
            (200, false),
            (429, false),
            (429, true),
            (429, true),
            (429, true)
        ],
        "one served, the quota's 429 passed on, the rest refused by corral"
    );
    assert_eq!(
        arrivals.load(Ordering::SeqCst),
        2,
        "none sent after the 429"
    );
    // Bound: the second request's token comes a second after the first, the refusals at
    // once after its 429 (1.04 s here); the request that held the turn waiting for the next
    // token would be refused a second later (2.04 s without the race), 0.6 s of slack.
    let took = start.elapsed();
    assert!(took < Duration::from_millis(1700), "took {took:?}");
}
