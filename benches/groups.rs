//! Groups' targets (fallback, hedging, priorities), measured over real sockets on 127.0.0.1:
//! corral in-process (`server::run`) in front of in-process mock upstreams (hyper), a hyper
//! client as the workload.
//!
//! Run: `cargo bench --bench groups` (release build; about 45 s once built). Prints a table:
//!
//! 1. **Fallback**: a primary permanently out of quota (every answer a 429 `insufficient_quota`)
//!    and a fast backup in one group; 2,000 requests, 8 at a time, through the group, then the
//!    same through a route straight to the backup. Target: every request answered by the backup,
//!    and the group's p99 under the direct route's p99 + 5 ms.
//! 2. **Hedging**: a primary whose answer head comes after 5 s, a fast backup,
//!    `hedge_after = "1s"`, `hedge_max_ratio = 1.0`; 40 requests, 20 at a time. Target: p99
//!    under 1.5 s and at most one hedge per request.
//! 3. **Priorities**: 500 batch clients, each sending one request after another for 20 s, into a
//!    limit of 20 requests a second (`rpm = 1200`, `burst = 20`), plus one interactive request a
//!    second. Target: interactive p99 wait under 1 s while batch saturates the limit. A
//!    request's wait is its time through corral less the upstream's (instant) answer.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs the fallback case with 20
//! requests as a smoke check, so CI does not spend the time.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use corral::server::{self, App};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A mock upstream answering every request with `status` and `body` after `delay`; counts calls.
async fn mock(status: u16, body: &'static str, delay: Duration) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let counter = Arc::clone(&counter);
                    async move {
                        let _ = req.into_body().collect().await;
                        counter.fetch_add(1, Ordering::Relaxed);
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        let response = Response::builder()
                            .status(status)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(body.as_bytes())))
                            .unwrap();
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (format!("http://{addr}"), calls)
}

/// corral on an ephemeral port with `toml`; its base URL.
async fn corral(toml: &str) -> (String, Arc<App>) {
    let config = corral::config::load_str("bench.toml", toml).expect("a valid bench config");
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = App::new(&config);
    tokio::spawn(server::run(
        Arc::clone(&app),
        listener,
        None,
        std::future::pending::<()>(),
    ));
    (format!("http://{addr}"), app)
}

const BODY: &str =
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#;
const OK: &str = r#"{"ok":true}"#;
const QUOTA: &str = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;

/// One POST; its status, the member that answered (if any) and its time.
async fn post(
    client: &HttpClient,
    url: &str,
    priority: Option<&str>,
) -> (u16, Option<String>, Duration) {
    let mut req = Request::post(url).header("content-type", "application/json");
    if let Some(p) = priority {
        req = req.header("x-corral-priority", p);
    }
    let req = req
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap();
    let start = Instant::now();
    let response = client.request(req).await.expect("corral answered");
    let status = response.status().as_u16();
    let member = response
        .headers()
        .get("x-corral-upstream")
        .map(|v| v.to_str().unwrap().to_owned());
    let _ = response.into_body().collect().await;
    (status, member, start.elapsed())
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let k = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[k]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

/// `n` requests to `url`, `at_once` at a time: the times, and how many the backup answered.
async fn run(client: &HttpClient, url: &str, n: usize, at_once: usize) -> (Vec<Duration>, usize) {
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..at_once {
        let (client, url, next) = (client.clone(), url.to_owned(), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                out.push(post(&client, &url, None).await);
            }
            out
        }));
    }
    let mut times = Vec::new();
    let mut by_backup = 0;
    for t in tasks {
        for (status, member, took) in t.await.unwrap() {
            assert_eq!(status, 200, "every request is answered");
            by_backup += usize::from(member.as_deref() == Some("backup"));
            times.push(took);
        }
    }
    times.sort();
    (times, by_backup)
}

async fn fallback(n: usize) -> Vec<String> {
    let (primary, primary_calls) = mock(429, QUOTA, Duration::ZERO).await;
    let (backup, _) = mock(200, OK, Duration::ZERO).await;
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"{primary}/v1\"\n\
         [[upstream]]\nname = \"backup\"\nroute = \"/direct\"\nbase_url = \"{backup}/v1\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"backup\"]\n"
    );
    let (url, _app) = corral(&toml).await;
    let client = Client::builder(TokioExecutor::new()).build_http();
    // Warm both paths' connections; then the two routes in turn, a quarter at a time, so a
    // drift of the machine's speed weighs on both alike.
    let (group_url, direct_url) = (
        format!("{url}/v1/chat/completions"),
        format!("{url}/direct/chat/completions"),
    );
    run(&client, &direct_url, 50, 8).await;
    let (mut group, mut direct, mut by_backup) = (Vec::new(), Vec::new(), 0);
    for _ in 0..4 {
        let (times, backup) = run(&client, &group_url, n / 4, 8).await;
        group.extend(times);
        by_backup += backup;
        direct.extend(run(&client, &direct_url, n / 4, 8).await.0);
    }
    group.sort();
    direct.sort();
    let added = quantile(&group, 0.99).saturating_sub(quantile(&direct, 0.99));
    vec![
        format!(
            "| fallback: through the group | {n} | {} | {} | {by_backup} of {n} by the backup; the primary asked {} times |",
            ms(quantile(&group, 0.5)),
            ms(quantile(&group, 0.99)),
            primary_calls.load(Ordering::Relaxed)
        ),
        format!(
            "| fallback: straight to the backup | {n} | {} | {} | added p99 {} ms (target < 5 ms: {}) |",
            ms(quantile(&direct, 0.5)),
            ms(quantile(&direct, 0.99)),
            ms(added),
            if added < Duration::from_millis(5) && by_backup == n { "met" } else { "MISSED" }
        ),
    ]
}

async fn hedging() -> Vec<String> {
    let (primary, primary_calls) = mock(200, OK, Duration::from_secs(5)).await;
    let (backup, backup_calls) = mock(200, OK, Duration::ZERO).await;
    let toml = format!(
        "[[upstream]]\nname = \"primary\"\nbase_url = \"{primary}/v1\"\n\
         [[upstream]]\nname = \"backup\"\nbase_url = \"{backup}/v1\"\n\
         [[group]]\nname = \"chat\"\nroute = \"/v1\"\nmembers = [\"primary\", \"backup\"]\n\
         hedge_after = \"1s\"\nhedge_max_ratio = 1.0\n"
    );
    let (url, app) = corral(&toml).await;
    let client = Client::builder(TokioExecutor::new()).build_http();
    let n = 40;
    let (times, by_backup) = run(&client, &format!("{url}/v1/chat/completions"), n, 20).await;
    let metrics = app.metrics().render();
    let count = |needle: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(needle))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as usize
    };
    let sent = count(r#"corral_group_hedges_total{group="chat",outcome="sent"}"#);
    let p99 = quantile(&times, 0.99);
    vec![format!(
        "| hedging: primary 5 s, hedge after 1 s | {n} | {} | {} | {by_backup} answered by the backup; hedges sent {sent}, backup calls {}, primary calls {} (the others were still waiting for the primary's slow start when their hedge won) (target p99 < 1.5 s and <= 1 hedge a request: {}) |",
        ms(quantile(&times, 0.5)),
        ms(p99),
        backup_calls.load(Ordering::Relaxed),
        primary_calls.load(Ordering::Relaxed),
        if p99 < Duration::from_millis(1500) && sent <= n { "met" } else { "MISSED" }
    )]
}

async fn priorities() -> Vec<String> {
    let (upstream, calls) = mock(200, OK, Duration::ZERO).await;
    let toml = format!(
        "[[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{upstream}/v1\"\n\
         rate_limit = \"off\"\n[upstream.limits]\nrpm = 1200\nburst = 20\n"
    );
    let (url, _app) = corral(&toml).await;
    let url = format!("{url}/v1/chat/completions");
    let run_for = Duration::from_secs(20);
    let end = Instant::now() + run_for;
    let mut batch = Vec::new();
    for _ in 0..500 {
        let (url, client) = (
            url.clone(),
            Client::builder(TokioExecutor::new()).build_http(),
        );
        batch.push(tokio::spawn(async move {
            let mut times = Vec::new();
            while Instant::now() < end {
                let (status, _, took) = post(&client, &url, Some("batch")).await;
                if status == 200 {
                    times.push(took);
                }
            }
            times
        }));
    }
    // Interactive: one a second, from 2 s in (the batch queue is full by then).
    let client = Client::builder(TokioExecutor::new()).build_http();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut interactive = Vec::new();
    while Instant::now() + Duration::from_secs(1) < end {
        let tick = tokio::time::Instant::now() + Duration::from_secs(1);
        let (status, _, took) = post(&client, &url, Some("interactive")).await;
        assert_eq!(status, 200);
        interactive.push(took);
        tokio::time::sleep_until(tick).await;
    }
    let mut batch_times = Vec::new();
    for t in batch {
        batch_times.extend(t.await.unwrap());
    }
    // The batch requests still queued at the end are answered after it: the rate is over the
    // whole time to the last answer.
    let elapsed = run_for + end.elapsed();
    interactive.sort();
    batch_times.sort();
    let served = calls.load(Ordering::Relaxed);
    let p99 = quantile(&interactive, 0.99);
    vec![
        format!(
            "| priorities: interactive, 1 a second | {} | {} | {} | target p99 wait < 1 s: {} |",
            interactive.len(),
            ms(quantile(&interactive, 0.5)),
            ms(p99),
            if p99 < Duration::from_secs(1) { "met" } else { "MISSED" }
        ),
        format!(
            "| priorities: batch, 500 clients | {} | {} | {} | the limit: {:.1} requests/s served of 20 (over {:.1} s, to the last queued answer) |",
            batch_times.len(),
            ms(quantile(&batch_times, 0.5)),
            ms(quantile(&batch_times, 0.99)),
            served as f64 / elapsed.as_secs_f64(),
            elapsed.as_secs_f64()
        ),
    ]
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        if !bench {
            let rows = fallback(20).await;
            assert!(
                rows[1].contains("20 of 20") || rows[0].contains("20 of 20"),
                "{rows:?}"
            );
            println!("groups bench smoke check: ok (run `cargo bench --bench groups` for figures)");
            return;
        }
        println!("| case | requests | p50 ms | p99 ms | notes |");
        println!("| --- | ---: | ---: | ---: | --- |");
        for row in fallback(2000)
            .await
            .into_iter()
            .chain(hedging().await)
            .chain(priorities().await)
        {
            println!("{row}");
        }
    });
}
