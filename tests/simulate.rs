//! `corral simulate` over real sockets: an in-process [`Simulator`] on 127.0.0.1:0 and a
//! hyper-util legacy client. Service times are a few milliseconds; every test is bounded.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use corral::simulate::{
    FailWindow, HeaderStyle, LimitReport, ModelLimit, RefillChange, ServiceTail, SimConfig,
    Simulator, Stats,
};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

const BOUND: Duration = Duration::from_secs(10);

struct Sim {
    addr: SocketAddr,
    sim: Simulator,
    client: HttpClient,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

/// A config with a small service time; tests override what they exercise.
fn fast() -> SimConfig {
    SimConfig {
        service_time: Duration::from_millis(5),
        stream_interval: Duration::from_millis(5),
        seed: Some(7),
        ..SimConfig::default()
    }
}

async fn start(config: SimConfig) -> Sim {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sim = Simulator::new(config);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(sim.clone().serve(listener, async move {
        let _ = stopped.await;
    }));
    let client = Client::builder(TokioExecutor::new()).build_http();
    Sim {
        addr,
        sim,
        client,
        stop: Some(stop),
        task,
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn send(
    client: &HttpClient,
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Bytes,
) -> Result<Response<Incoming>, hyper_util::client::legacy::Error> {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap();
    client.request(req).await
}

impl Sim {
    async fn send(&self, method: Method, path: &str, body: Bytes) -> Response<Incoming> {
        send(&self.client, self.addr, method, path, body)
            .await
            .expect("response")
    }

    async fn post(&self, path: &str, body: Value) -> Response<Incoming> {
        self.send(Method::POST, path, body.to_string().into()).await
    }

    async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let res = self.send(Method::GET, path, Bytes::new()).await;
        let status = res.status();
        (status, json_body(res).await)
    }

    async fn stats(&self) -> Stats {
        let (status, v) = self.get_json("/_stats").await;
        assert_eq!(status, StatusCode::OK);
        serde_json::from_value(v).unwrap()
    }

    async fn shutdown(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        self.task.await.unwrap().unwrap();
    }
}

async fn json_body(res: Response<Incoming>) -> Value {
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}: {bytes:?}"))
}

fn chat(stream: bool) -> Value {
    json!({"model": "gpt-test", "stream": stream, "messages": [{"role": "user", "content": "hello there"}]})
}

fn anthropic_msg(stream: bool) -> Value {
    json!({"model": "claude-test", "max_tokens": 64, "stream": stream,
        "messages": [{"role": "user", "content": "hello"}]})
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .unwrap_or_else(|| panic!("missing {name}: {h:?}"))
        .to_str()
        .unwrap()
}

/// Parses Go duration strings ("50ms", "1m30s", "2.5s") as the headers use them.
fn parse_go_duration(s: &str) -> Duration {
    if s == "0s" {
        return Duration::ZERO;
    }
    let mut total = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap();
        let (num, tail) = rest.split_at(split);
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "µs" | "us" => 1e-6,
            "ns" => 1e-9,
            other => panic!("unit {other:?} in {s:?}"),
        };
        total += num.parse::<f64>().unwrap() * scale;
        rest = tail;
    }
    Duration::from_secs_f64(total)
}

async fn bounded<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("test exceeded its bound")
}

fn assert_openai_rate_headers(h: &HeaderMap, limit: u64) {
    assert_eq!(header(h, "x-ratelimit-limit-requests"), limit.to_string());
    let remaining: u64 = header(h, "x-ratelimit-remaining-requests").parse().unwrap();
    assert!(remaining <= limit);
    parse_go_duration(header(h, "x-ratelimit-reset-requests"));
}

// ===== rate limiting =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_over_capacity_gets_capacity_200s_and_429s_with_headers() {
    let capacity = 20;
    let sim = start(SimConfig {
        capacity,
        refill: 0.5,
        ..fast()
    })
    .await;
    let mut burst = tokio::task::JoinSet::new();
    for _ in 0..capacity + 10 {
        let (client, addr) = (sim.client.clone(), sim.addr);
        let body = Bytes::from(chat(false).to_string());
        burst.spawn(async move {
            let res = send(&client, addr, Method::POST, "/v1/chat/completions", body).await;
            let res = res.expect("response");
            let (parts, body) = res.into_parts();
            let body = body.collect().await.unwrap().to_bytes();
            (parts, body)
        });
    }
    let responses = bounded(burst.join_all()).await;
    let (mut ok, mut limited) = (0, 0);
    for (parts, body) in responses {
        let h = &parts.headers;
        assert_openai_rate_headers(h, u64::from(capacity));
        match parts.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {
                limited += 1;
                let secs: u64 = header(h, "retry-after").parse().unwrap();
                let ms: f64 = header(h, "retry-after-ms").parse().unwrap();
                // One token at 0.5/s is at most 2s away; both headers name the same instant.
                assert!(ms > 0.0 && ms <= 2000.0, "{ms}");
                assert_eq!(secs, (ms / 1000.0).ceil() as u64);
                let reset = parse_go_duration(header(h, "x-ratelimit-reset-requests"));
                assert!(reset > Duration::from_secs(30), "{reset:?}");
                assert_eq!(header(h, "x-ratelimit-remaining-requests"), "0");
                let body: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(body["error"]["type"], "requests");
                assert_eq!(body["error"]["code"], "rate_limit_exceeded");
                assert_eq!(body["error"]["param"], Value::Null);
                let message = body["error"]["message"].as_str().unwrap();
                assert!(
                    message.starts_with("Rate limit reached for requests"),
                    "{message}"
                );
            }
            other => panic!("unexpected {other}"),
        }
    }
    // The burst takes well under 2s, so at most one token refills during it.
    assert!((capacity..=capacity + 1).contains(&ok), "{ok} admitted");
    assert_eq!(ok + limited, capacity + 10);
    let stats = bounded(sim.stats()).await;
    assert_eq!(stats.requests, u64::from(capacity + 10));
    assert_eq!(stats.by_status.get("200"), Some(&u64::from(ok)));
    assert_eq!(stats.by_status.get("429"), Some(&u64::from(limited)));
    let arrivals: u32 = stats.arrivals_per_100ms.iter().sum();
    assert_eq!(arrivals, capacity + 10);
    assert!(stats.max_in_flight >= 2, "{stats:?}");
    bounded(sim.shutdown()).await;
}

/// Sends `n` chat requests at once; answers come back as (head, body) in completion order.
async fn burst(sim: &Sim, n: usize, body: Value) -> Vec<(http::response::Parts, Bytes)> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (client, addr) = (sim.client.clone(), sim.addr);
        let body = Bytes::from(body.to_string());
        set.spawn(async move {
            let res = send(&client, addr, Method::POST, "/v1/chat/completions", body).await;
            let (parts, body) = res.expect("response").into_parts();
            (parts, body.collect().await.unwrap().to_bytes())
        });
    }
    bounded(set.join_all()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_429_reports_a_large_remaining_and_the_refill_rate() {
    // "1,200 RPM enforced as 20 per second".
    let sim = start(SimConfig {
        capacity: 20,
        refill: 20.0,
        limit_report: LimitReport::Quantized,
        ..fast()
    })
    .await;
    let responses = burst(&sim, 30, chat(false)).await;
    let refused: Vec<_> = responses
        .iter()
        .filter(|(p, _)| p.status == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert!(
        !refused.is_empty(),
        "a burst of 30 over 20 is refused in part"
    );
    for (parts, _) in refused {
        let h = &parts.headers;
        assert_eq!(header(h, "x-ratelimit-limit-requests"), "1200");
        let remaining: u64 = header(h, "x-ratelimit-remaining-requests").parse().unwrap();
        assert!(remaining >= 1150, "{remaining}: the report hides the burst");
        let reset = parse_go_duration(header(h, "x-ratelimit-reset-requests"));
        assert!(
            reset > Duration::ZERO && reset <= Duration::from_secs(1),
            "{reset:?}"
        );
        let rate = (1200 - remaining) as f64 / reset.as_secs_f64();
        assert!((15.0..=25.0).contains(&rate), "{rate}/s from the headers");
        let ms: u64 = header(h, "retry-after-ms").parse().unwrap();
        assert!(ms <= 50, "one request token at 20/s: {ms} ms");
    }
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn per_minute_and_quantized_limits_follow_refill_change() {
    for report in [LimitReport::PerMinute, LimitReport::Quantized] {
        let sim = start(SimConfig {
            capacity: 10,
            refill: 20.0,
            refill_changes: vec![RefillChange {
                at: Duration::from_millis(150),
                rate: 5.0,
            }],
            limit_report: report,
            ..fast()
        })
        .await;
        bounded(async {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            let h = res.headers();
            assert_eq!(
                header(h, "x-ratelimit-limit-requests"),
                "1200",
                "{report:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            let h = res.headers();
            assert_eq!(header(h, "x-ratelimit-limit-requests"), "300", "{report:?}");
            // One request owed at 5/s: 200 ms to refill, whatever the report.
            assert_eq!(header(h, "x-ratelimit-remaining-requests"), "299");
            let reset = parse_go_duration(header(h, "x-ratelimit-reset-requests"));
            assert_eq!(reset, Duration::from_millis(200), "{report:?}");
        })
        .await;
        bounded(sim.shutdown()).await;
    }
}

#[tokio::test]
async fn azure_style_sends_whole_second_resets_and_x_ms_retry_after_ms() {
    let sim = start(SimConfig {
        capacity: 2,
        refill: 0.4,
        tpm: Some(6000),
        header_style: HeaderStyle::Azure,
        ..fast()
    })
    .await;
    bounded(async {
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        let h = res.headers();
        assert_eq!(header(h, "x-ratelimit-limit-requests"), "2");
        assert_eq!(header(h, "x-ratelimit-remaining-requests"), "1");
        // One request token at 0.4/s: 2.5s, rounded up.
        assert_eq!(header(h, "x-ratelimit-reset-requests"), "3");
        assert_eq!(header(h, "x-ratelimit-limit-tokens"), "6000");
        // 18 tokens at 100/s: 0.18s, rounded up.
        assert_eq!(header(h, "x-ratelimit-reset-tokens"), "1");
        assert!(!h.contains_key("retry-after"));
        sim.post("/v1/chat/completions", chat(false)).await;
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = res.headers();
        let ms: u64 = header(h, "x-ms-retry-after-ms").parse().unwrap();
        assert!((2000..=2500).contains(&ms), "{ms}");
        assert_eq!(header(h, "retry-after"), "3");
        assert!(!h.contains_key("retry-after-ms"), "{h:?}");
        let reset = header(h, "x-ratelimit-reset-requests");
        assert!(reset == "5" || reset == "4", "{reset}");
        assert_eq!(json_body(res).await["error"]["code"], "rate_limit_exceeded");
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn none_style_sends_no_rate_limit_headers_or_retry_hints() {
    let sim = start(SimConfig {
        capacity: 1,
        refill: 0.1,
        tpm: Some(6000),
        header_style: HeaderStyle::None,
        ..fast()
    })
    .await;
    bounded(async {
        let ok = sim.post("/v1/chat/completions", chat(false)).await;
        let refused = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        for res in [&ok, &refused] {
            let names: Vec<&str> = res.headers().keys().map(|k| k.as_str()).collect();
            assert!(
                !names
                    .iter()
                    .any(|n| n.starts_with("x-ratelimit-") || n.contains("retry-after")),
                "{names:?}"
            );
        }
        let v = json_body(refused).await;
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(!message.contains("try again"), "{message}");
        // The Anthropic route keeps its headers.
        sim.sim.reset();
        let res = sim.post("/v1/messages", anthropic_msg(false)).await;
        assert_eq!(
            header(res.headers(), "anthropic-ratelimit-requests-limit"),
            "1"
        );
    })
    .await;
    bounded(sim.shutdown()).await;
}

// ===== queue mode =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_serves_at_most_n_at_once_and_reports_the_wait() {
    let (slots, service, n) = (4, Duration::from_millis(20), 12);
    let sim = start(SimConfig {
        capacity: 1000,
        refill: 1000.0,
        queue_slots: Some(slots),
        service_time: service,
        ..fast()
    })
    .await;
    let sent = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (client, addr) = (sim.client.clone(), sim.addr);
        let body = Bytes::from(chat(false).to_string());
        set.spawn(async move {
            let res = send(&client, addr, Method::POST, "/v1/chat/completions", body).await;
            let res = res.expect("response");
            assert_eq!(res.status(), StatusCode::OK);
            res.into_body().collect().await.unwrap();
            sent.elapsed()
        });
    }
    let mut latencies = bounded(set.join_all()).await;
    latencies.sort();
    // With 4 slots the k-th answer (0-based) needs k/4 + 1 full service times: nothing is
    // served beside a full set of slots.
    for (k, latency) in latencies.iter().enumerate() {
        let floor = service * (k as u32 / slots + 1);
        assert!(
            *latency >= floor,
            "answer {k} after {latency:?} < {floor:?}"
        );
    }
    let s = bounded(sim.stats()).await;
    assert_eq!(s.by_status.get("200"), Some(&(n as u64)));
    assert_eq!(s.queued_now, 0);
    assert!((1..=8).contains(&s.max_queued), "{s:?}");
    // Waits 0 x4, ~20 x4, ~40 x4: p99 about 40 ms (generous bounds for a busy machine).
    assert!(s.queue_wait_p50_ms <= s.queue_wait_p99_ms, "{s:?}");
    assert_eq!(
        s.queue_wait_p99_ms, s.queue_wait_max_ms,
        "12 waits: p99 is the max"
    );
    assert!((20..=300).contains(&s.queue_wait_p99_ms), "{s:?}");
    bounded(sim.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_mode_stream_holds_its_slot_until_the_last_event() {
    let sim = start(SimConfig {
        queue_slots: Some(1),
        stream_chunks: 4,
        stream_interval: Duration::from_millis(40),
        ..fast()
    })
    .await;
    bounded(async {
        let stream = sim.post("/v1/chat/completions", chat(true)).await;
        assert_eq!(stream.status(), StatusCode::OK);
        // The head is out; the events take 120 ms more.
        let reader = tokio::spawn(read_events(stream));
        let started = Instant::now();
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(60), "{waited:?}");
        assert_eq!(reader.await.unwrap().len(), 5);
        let s = sim.stats().await;
        assert_eq!(s.max_queued, 1);
        assert!(s.queue_wait_max_ms >= 60, "{s:?}");
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn reset_restores_the_bucket_and_clears_stats() {
    let sim = start(SimConfig {
        capacity: 2,
        refill: 0.01,
        ..fast()
    })
    .await;
    bounded(async {
        for want in [200, 200, 429] {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status().as_u16(), want);
        }
        let (status, body) = {
            let res = sim.send(Method::POST, "/_reset", Bytes::new()).await;
            (res.status(), json_body(res).await)
        };
        assert_eq!((status, body), (StatusCode::OK, json!({"reset": true})));
        let stats = sim.stats().await;
        assert_eq!(stats.requests, 0);
        assert!(stats.by_status.is_empty());
        for want in [200, 200, 429] {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status().as_u16(), want);
        }
        // The library call does the same as the admin route.
        sim.sim.reset();
        assert_eq!(sim.sim.stats().requests, 0);
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(res.headers(), "x-ratelimit-remaining-requests"), "1");
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn tpm_bucket_adds_token_headers_and_refuses_large_requests() {
    let sim = start(SimConfig {
        tpm: Some(100),
        ..fast()
    })
    .await;
    bounded(async {
        // "hello there" = 11 chars -> 2 + max_tokens 50 = 52 tokens.
        let body =
            json!({"max_tokens": 50, "messages": [{"role": "user", "content": "hello there"}]});
        let res = sim.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(res.status(), StatusCode::OK);
        let h = res.headers();
        assert_eq!(header(h, "x-ratelimit-limit-tokens"), "100");
        assert_eq!(header(h, "x-ratelimit-remaining-tokens"), "48");
        let reset = parse_go_duration(header(h, "x-ratelimit-reset-tokens"));
        assert!(
            reset > Duration::from_secs(25) && reset <= Duration::from_secs(32),
            "{reset:?}"
        );
        let res = sim.post("/v1/chat/completions", body).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(res.headers().contains_key("retry-after"));
        assert_eq!(json_body(res).await["error"]["type"], "tokens");
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn a_small_tpm_binds_before_the_request_bucket() {
    // 600 tokens per minute = 10/s; 50 requests at 20/s would allow far more.
    let sim = start(SimConfig {
        tpm: Some(600),
        ..fast()
    })
    .await;
    bounded(async {
        // "hello there" = 11 chars -> 2 + max_tokens 100 = 102 tokens; 5 fit in 600.
        let body =
            json!({"max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]});
        for i in 0..5 {
            let res = sim.post("/v1/chat/completions", body.clone()).await;
            assert_eq!(res.status(), StatusCode::OK, "request {i}");
        }
        let res = sim.post("/v1/chat/completions", body).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = res.headers();
        let tokens_left: u64 = header(h, "x-ratelimit-remaining-tokens").parse().unwrap();
        assert!(
            tokens_left < 102,
            "{tokens_left} tokens left: below the cost"
        );
        let requests_left: u64 = header(h, "x-ratelimit-remaining-requests").parse().unwrap();
        assert!(requests_left >= 40, "{requests_left}: requests remain");
        // 12 tokens short at 10/s: 1.2 s, less what refilled during the test.
        let ms: u64 = header(h, "retry-after-ms").parse().unwrap();
        assert!((900..=1200).contains(&ms), "{ms}");
        assert_eq!(header(h, "retry-after"), "2");
        let v = json_body(res).await;
        assert_eq!(v["error"]["type"], "tokens");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("Rate limit reached for tokens"),
            "{message}"
        );
        let stats = sim.stats().await;
        assert_eq!(stats.by_status.get("429"), Some(&1));
    })
    .await;
    bounded(sim.shutdown()).await;
}

// ===== OpenAI routes =====

#[tokio::test]
async fn chat_completion_json_shape() {
    let sim = start(fast()).await;
    bounded(async {
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_openai_rate_headers(res.headers(), 50);
        assert_eq!(
            header(res.headers(), "x-ratelimit-remaining-requests"),
            "49"
        );
        let v = json_body(res).await;
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["model"], "gpt-test");
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert!(!v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty());
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["prompt_tokens"], 2);
    })
    .await;
    bounded(sim.shutdown()).await;
}

/// Reads an SSE body frame by frame, stamping when each complete event arrived.
async fn read_events(res: Response<Incoming>) -> Vec<(Instant, String)> {
    let mut body = res.into_body();
    let mut buf = String::new();
    let mut events = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        buf.push_str(std::str::from_utf8(&data).unwrap());
        while let Some(end) = buf.find("\n\n") {
            events.push((Instant::now(), buf[..end].to_owned()));
            buf.drain(..end + 2);
        }
    }
    assert!(buf.is_empty(), "trailing partial event {buf:?}");
    events
}

#[tokio::test]
async fn chat_stream_sends_events_over_time() {
    let interval = Duration::from_millis(40);
    let sim = start(SimConfig {
        stream_chunks: 5,
        stream_interval: interval,
        ..fast()
    })
    .await;
    bounded(async {
        let res = sim.post("/v1/chat/completions", chat(true)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(res.headers(), "content-type"), "text/event-stream");
        assert_openai_rate_headers(res.headers(), 50);
        let events = read_events(res).await;
        assert_eq!(events.len(), 6, "{events:?}");
        assert_eq!(events[5].1, "data: [DONE]");
        for (_, event) in &events[..5] {
            let chunk: Value = serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["model"], "gpt-test");
        }
        // Not buffered: the first event arrived long before the last was produced.
        let spread = events[4].0 - events[0].0;
        assert!(
            spread >= interval * 3,
            "events arrived together: {spread:?}"
        );
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn injected_503_is_an_openai_error_without_retry_after() {
    let sim = start(SimConfig {
        fail_503: 1.0,
        ..fast()
    })
    .await;
    bounded(async {
        for _ in 0..3 {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert!(!res.headers().contains_key("retry-after"));
            assert_openai_rate_headers(res.headers(), 50);
            let v = json_body(res).await;
            assert!(v["error"]["message"].is_string());
            assert!(v["error"]["type"].is_string());
        }
        assert_eq!(sim.stats().await.by_status.get("503"), Some(&3));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_window_answers_503_inside_and_200_after() {
    let window = Duration::from_millis(500);
    let sim = start(SimConfig {
        fail_503_windows: vec![FailWindow {
            at: Duration::ZERO,
            duration: window,
        }],
        ..fast()
    })
    .await;
    let started = Instant::now();
    // A blip: 20 requests at once all fail...
    for (parts, body) in burst(&sim, 20, chat(false)).await {
        assert_eq!(parts.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(!parts.headers.contains_key("retry-after"));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "server_error");
    }
    assert!(started.elapsed() < window, "the burst outlasted the window");
    // ...and their retries after the window succeed.
    tokio::time::sleep_until(started + window + Duration::from_millis(50)).await;
    for (parts, _) in burst(&sim, 20, chat(false)).await {
        assert_eq!(parts.status, StatusCode::OK);
    }
    let stats = bounded(sim.stats()).await;
    assert_eq!(stats.by_status.get("503"), Some(&20));
    assert_eq!(stats.by_status.get("200"), Some(&20));
    // A reset restarts the window's clock.
    sim.sim.reset();
    let res = bounded(sim.post("/v1/chat/completions", chat(false))).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn injected_reset_closes_the_connection_without_a_response() {
    let sim = start(SimConfig {
        fail_reset: 1.0,
        ..fast()
    })
    .await;
    bounded(async {
        let body = Bytes::from(chat(false).to_string());
        let res = send(
            &sim.client,
            sim.addr,
            Method::POST,
            "/v1/chat/completions",
            body,
        )
        .await;
        assert!(
            res.is_err(),
            "expected no response, got {:?}",
            res.map(|r| r.status())
        );
        let stats = sim.stats().await;
        assert_eq!((stats.requests, stats.resets), (1, 1));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn bad_json_unknown_paths_and_models() {
    let sim = start(fast()).await;
    bounded(async {
        let res = sim
            .send(Method::POST, "/v1/chat/completions", Bytes::from("{oops"))
            .await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert_openai_rate_headers(res.headers(), 50);
        let v = json_body(res).await;
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(
            (&v["error"]["param"], &v["error"]["code"]),
            (&Value::Null, &Value::Null)
        );
        assert!(v["error"]["message"].is_string());

        let (status, v) = sim.get_json("/v2/nothing").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v2/nothing"));

        let (status, _) = sim.get_json("/v1/chat/completions").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);

        let (status, v) = sim.get_json("/v1/models").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"].as_array().unwrap().len(), 1);
        assert_eq!(v["data"][0]["object"], "model");
    })
    .await;
    bounded(sim.shutdown()).await;
}

// ===== Anthropic route =====

#[tokio::test]
async fn anthropic_message_shape_and_headers() {
    let sim = start(fast()).await;
    bounded(async {
        let res = sim.post("/v1/messages", anthropic_msg(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        let h = res.headers();
        assert_eq!(header(h, "anthropic-ratelimit-requests-limit"), "50");
        assert_eq!(header(h, "anthropic-ratelimit-requests-remaining"), "49");
        humantime::parse_rfc3339(header(h, "anthropic-ratelimit-requests-reset")).unwrap();
        assert!(!h.contains_key("x-ratelimit-limit-requests"));
        let v = json_body(res).await;
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        assert_eq!(v["model"], "claude-test");
        assert_eq!(v["content"][0]["type"], "text");
        assert!(v["content"][0]["text"].is_string());
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(v["usage"]["input_tokens"], 1);
        assert!(v["usage"]["output_tokens"].as_u64().unwrap() > 0);
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn anthropic_stream_event_sequence() {
    let sim = start(SimConfig {
        stream_chunks: 3,
        ..fast()
    })
    .await;
    bounded(async {
        let res = sim.post("/v1/messages", anthropic_msg(true)).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(res.headers(), "content-type"), "text/event-stream");
        let events = read_events(res).await;
        let mut names = Vec::new();
        let mut text = String::new();
        for (_, event) in &events {
            let (head, data) = event.split_once('\n').unwrap();
            let name = head.strip_prefix("event: ").unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name);
            if name == "content_block_delta" {
                assert_eq!(data["delta"]["type"], "text_delta");
                text.push_str(data["delta"]["text"].as_str().unwrap());
            }
            if name == "message_delta" {
                assert_eq!(data["delta"]["stop_reason"], "end_turn");
            }
            names.push(name.to_owned());
        }
        names.dedup();
        let want = [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ];
        assert_eq!(names, want);
        assert!(!text.is_empty());
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn anthropic_429_and_529_bodies() {
    let sim = start(SimConfig {
        capacity: 1,
        refill: 0.1,
        fail_529: 1.0,
        ..fast()
    })
    .await;
    bounded(async {
        let res = sim.post("/v1/messages", anthropic_msg(false)).await;
        assert_eq!(res.status().as_u16(), 529);
        let v = json_body(res).await;
        let want = json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
        assert_eq!(v, want);

        let res = sim.post("/v1/messages", anthropic_msg(false)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = res.headers();
        let retry: u64 = header(h, "retry-after").parse().unwrap();
        assert!((9..=10).contains(&retry), "{retry}");
        assert_eq!(header(h, "anthropic-ratelimit-requests-remaining"), "0");
        let v = json_body(res).await;
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert!(v["error"]["message"].is_string());
    })
    .await;
    bounded(sim.shutdown()).await;
}

// ===== worlds built from what providers document =====

fn has_retry_hint(h: &HeaderMap) -> bool {
    h.keys().any(|k| k.as_str().contains("retry-after"))
}

fn throttles(stats: &Stats) -> (u64, u64, u64, u64) {
    let t = &stats.throttles_by_reason;
    (t["rate"], t["overload"], t["admission"], t["quota"])
}

#[tokio::test]
async fn an_overload_429_has_openai_s_message_no_retry_hint_and_healthy_headers() {
    let sim = start(SimConfig {
        capacity: 50,
        refill: 0.0,
        overload_429: 1.0,
        ..fast()
    })
    .await;
    bounded(async {
        for _ in 0..3 {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            let h = res.headers();
            assert!(!has_retry_hint(h), "{h:?}");
            assert_eq!(header(h, "x-ratelimit-remaining-requests"), "50");
            let v = json_body(res).await;
            let e = &v["error"];
            assert_eq!(
                e["message"],
                "The engine is currently overloaded, please try again later"
            );
            assert_eq!(
                (e["type"].as_str(), e["code"].as_null()),
                (Some("server_error"), Some(()))
            );
        }
        // Anthropic says overload with 529.
        let res = sim.post("/v1/messages", anthropic_msg(false)).await;
        assert_eq!(res.status().as_u16(), 529);
        assert!(!has_retry_hint(res.headers()));
        assert_eq!(json_body(res).await["error"]["type"], "overloaded_error");
        let stats = sim.stats().await;
        assert_eq!(stats.by_status["429"], 3);
        assert_eq!(throttles(&stats), (0, 3, 0, 0));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn an_admission_storm_refuses_each_body_k_times_like_an_empty_bucket_then_serves_it() {
    let sim = start(SimConfig {
        capacity: 50,
        refill: 0.0,
        admission_refusals: 2,
        // The gateway speaks for itself, whatever the API behind it sends.
        header_style: HeaderStyle::None,
        ..fast()
    })
    .await;
    bounded(async {
        for _ in 0..2 {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
            let h = res.headers();
            assert_eq!(header(h, "retry-after"), "1");
            assert_eq!(header(h, "retry-after-ms"), "1000");
            assert_eq!(header(h, "x-ratelimit-remaining-requests"), "0");
            assert_eq!(header(h, "x-ratelimit-reset-requests"), "1s");
            let v = json_body(res).await;
            assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        }
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::OK);
        let other =
            json!({"model": "gpt-test", "messages": [{"role": "user", "content": "other"}]});
        let res = sim.post("/v1/chat/completions", other).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let stats = sim.stats().await;
        assert_eq!(throttles(&stats), (0, 0, 3, 0));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn each_listed_model_has_its_own_bucket_and_headers() {
    let sim = start(SimConfig {
        capacity: 50,
        refill: 0.0,
        model_limits: vec![
            ModelLimit {
                model: "fast".into(),
                capacity: 5,
                refill: 0.0,
            },
            ModelLimit {
                model: "slow".into(),
                capacity: 1,
                refill: 0.5,
            },
        ],
        ..fast()
    })
    .await;
    let body =
        |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    bounded(async {
        let res = sim.post("/v1/chat/completions", body("slow")).await;
        assert_eq!(res.status(), StatusCode::OK);
        let res = sim.post("/v1/chat/completions", body("slow")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(res.headers(), "x-ratelimit-limit-requests"), "1");
        assert_eq!(header(res.headers(), "retry-after"), "2");
        let res = sim.post("/v1/chat/completions", body("fast")).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(res.headers(), "x-ratelimit-limit-requests"), "5");
        assert_eq!(header(res.headers(), "x-ratelimit-remaining-requests"), "4");
        let res = sim.post("/v1/chat/completions", body("unlisted")).await;
        assert_eq!(header(res.headers(), "x-ratelimit-limit-requests"), "50");
        assert_eq!(
            header(res.headers(), "x-ratelimit-remaining-requests"),
            "49"
        );
        assert_eq!(throttles(&sim.stats().await), (1, 0, 0, 0));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn a_spent_day_answers_429_hours_away_with_the_day_in_the_headers() {
    let sim = start(SimConfig {
        capacity: 50,
        refill: 0.0,
        requests_per_day: Some(2),
        ..fast()
    })
    .await;
    bounded(async {
        for left in ["1", "0"] {
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(header(res.headers(), "x-ratelimit-limit-requests"), "2");
            assert_eq!(
                header(res.headers(), "x-ratelimit-remaining-requests"),
                left
            );
        }
        let res = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = res.headers();
        let retry: u64 = header(h, "retry-after").parse().unwrap();
        assert!((86_000..=86_400).contains(&retry), "{retry}");
        let reset = parse_go_duration(header(h, "x-ratelimit-reset-requests"));
        assert!(reset > Duration::from_secs(23 * 3600), "{reset:?}");
        assert_eq!(header(h, "x-ratelimit-remaining-requests"), "0");
        let v = json_body(res).await;
        assert_eq!(v["error"]["code"], "rate_limit_exceeded");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("requests per day"), "{message}");
        assert_eq!(throttles(&sim.stats().await), (0, 0, 0, 1));
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn gemini_style_puts_the_true_wait_in_the_body_and_sends_no_headers() {
    let config = SimConfig {
        capacity: 1,
        refill: 2.0,
        header_style: HeaderStyle::Gemini,
        ..fast()
    };
    let sim = start(config.clone()).await;
    bounded(async {
        let ok = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(ok.status(), StatusCode::OK);
        let refused = sim.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        for h in [ok.headers(), refused.headers()] {
            let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
            assert!(
                !names
                    .iter()
                    .any(|n| n.starts_with("x-ratelimit-") || n.contains("retry-after")),
                "{names:?}"
            );
        }
        let v = json_body(refused).await;
        let e = &v["error"];
        assert_eq!(
            (e["code"].as_u64(), e["status"].as_str()),
            (Some(429), Some("RESOURCE_EXHAUSTED"))
        );
        let details = e["details"].as_array().unwrap();
        let quota = &details[0]["violations"][0]["quotaId"];
        assert_eq!(quota, "GenerateRequestsPerMinutePerProjectPerModel");
        assert_eq!(
            details[1]["@type"],
            "type.googleapis.com/google.rpc.RetryInfo"
        );
        let delay = details[1]["retryDelay"].as_str().unwrap();
        let secs: f64 = delay.strip_suffix('s').unwrap().parse().unwrap();
        assert!(secs > 0.0 && secs <= 0.5, "{delay}");
    })
    .await;
    bounded(sim.shutdown()).await;
    // With --gemini-array the same error comes wrapped in an array.
    let sim = start(SimConfig {
        gemini_array: 1.0,
        ..config
    })
    .await;
    bounded(async {
        sim.post("/v1/chat/completions", chat(false)).await;
        let refused = sim.post("/v1/chat/completions", chat(false)).await;
        let v = json_body(refused).await;
        assert_eq!(v[0]["error"]["status"], "RESOURCE_EXHAUSTED", "{v}");
    })
    .await;
    bounded(sim.shutdown()).await;
}

#[tokio::test]
async fn a_heavy_tail_makes_some_answers_several_medians_long() {
    let sim = start(SimConfig {
        capacity: 1000,
        service_time: Duration::from_millis(5),
        service_tail: Some(ServiceTail::Pareto { alpha: 1.0 }),
        ..fast()
    })
    .await;
    bounded(async {
        let mut times = Vec::new();
        for _ in 0..40 {
            let sent = Instant::now();
            let res = sim.post("/v1/chat/completions", chat(false)).await;
            assert_eq!(res.status(), StatusCode::OK);
            json_body(res).await;
            times.push(sent.elapsed());
        }
        times.sort();
        // Seeded: a third of Pareto(1) draws exceed 3 medians; a response never comes before
        // its draw.
        assert!(times[39] >= Duration::from_millis(15), "{times:?}");
    })
    .await;
    bounded(sim.shutdown()).await;
}

// ===== serving =====

#[tokio::test]
async fn serves_h2c_and_stops_on_shutdown() {
    let sim = start(fast()).await;
    let h2: HttpClient = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    bounded(async {
        let body = Bytes::from(chat(false).to_string());
        let res = send(&h2, sim.addr, Method::POST, "/v1/chat/completions", body)
            .await
            .unwrap();
        assert_eq!(res.version(), http::Version::HTTP_2);
        assert_eq!(res.status(), StatusCode::OK);
    })
    .await;
    let addr = sim.addr;
    bounded(sim.shutdown()).await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed"
    );
}
