//! The request path's bounds: every wait on a body has an end, request bodies are bounded in
//! memory, and hostile inputs are refused before they reach an upstream. Misbehaving clients
//! speak over raw sockets, misbehaving upstreams are in-process mocks or raw sockets; every
//! timeout comes small from the config and every wait in a test is bounded.
//!
//! The load test (`load_2000_connections_stay_under_the_buffer_cap`) is `#[ignore]`d: run it
//! with `benches/load.sh`.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use support::binary::corral_command;
use support::*;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Whether corral's `/metrics` text has `needle` (a whole sample line, usually).
fn metric_line(corral: &Corral, needle: &str) -> bool {
    corral.app.metrics().render().contains(needle)
}

/// The JSON error body of a raw HTTP/1 answer.
fn json_body(text: &str) -> serde_json::Value {
    let body = &text[text.find("\r\n\r\n").expect("a response head") + 4..];
    // The JSON is on a line of its own (after a chunk size, if chunked).
    let json = body
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON body in {text}"));
    serde_json::from_str(json).expect("a JSON error body")
}

// ===== 1. every wait on a body has an end =====

#[tokio::test]
async fn a_request_body_that_stops_gets_408_and_the_connection_ends() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "body_idle_timeout = \"300ms\"")).await;
    let start = Instant::now();
    let reply = raw_exchange(
        corral.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: corral\r\ncontent-type: application/json\r\n\
          content-length: 1000\r\n\r\n{\"model\":",
        Duration::from_secs(5),
    )
    .await;
    let took = start.elapsed();
    assert!(reply.text.starts_with("HTTP/1.1 408"), "{}", reply.text);
    assert!(
        reply.text.contains("x-corral-error: body_timeout"),
        "{}",
        reply.text
    );
    assert_eq!(json_body(&reply.text)["error"]["code"], "body_timeout");
    assert!(reply.closed, "the connection (and its task) ended");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(upstream.calls(), 0);
    assert!(metric_line(
        &corral,
        r#"corral_errors_total{cause="body_timeout",upstream="mock"} 1"#
    ));
}

#[tokio::test]
async fn a_trickling_request_body_ends_at_the_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "body_idle_timeout = \"30s\"")).await;
    let mut stream = tokio::net::TcpStream::connect(corral.addr).await.unwrap();
    let start = Instant::now();
    stream
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: corral\r\nx-corral-deadline-ms: 500\r\n\
              content-length: 1000\r\n\r\n",
        )
        .await
        .unwrap();
    // A byte every 50 ms keeps the idle clock happy; the deadline still ends it.
    let mut out = vec![0u8; 4096];
    let mut read = 0;
    for _ in 0..100 {
        let _ = stream.write_all(b" ").await;
        match tokio::time::timeout(Duration::from_millis(50), stream.read(&mut out[read..])).await {
            Ok(Ok(n)) if n > 0 => {
                read += n;
                break;
            }
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&out[..read]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(upstream.calls(), 0);
}

#[tokio::test]
async fn a_stream_that_stalls_is_cut_after_stream_idle_timeout_over_http1_and_http2() {
    let (upstream, slot, dropped) = sse_upstream().await;
    let corral = Corral::start(&one_upstream(&upstream, "stream_idle_timeout = \"300ms\"")).await;
    for (n, client) in [client(), h2_client()].into_iter().enumerate() {
        dropped.store(false, Ordering::SeqCst);
        let response = client
            .request(post(
                &corral.url("/v1/chat/completions"),
                r#"{"stream":true}"#,
            ))
            .await
            .expect("corral answered");
        assert_eq!(response.status(), 200);
        let tx = slot
            .lock()
            .unwrap()
            .take()
            .expect("the upstream got the request");
        tx.send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
            .await
            .unwrap();
        let mut body = response.into_body();
        let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the first event")
            .unwrap()
            .unwrap();
        assert_eq!(first.data_ref().unwrap().as_ref(), b"data: {\"n\":1}\n\n");
        // Then the upstream says nothing more, holding its end open.
        let start = Instant::now();
        let end = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the stream ended within 5 s");
        let took = start.elapsed();
        assert!(
            matches!(end, Some(Err(_))),
            "cut abruptly, never a clean end: {end:?}"
        );
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(3),
            "{took:?}"
        );
        assert!(
            eventually(Duration::from_secs(5), || dropped.load(Ordering::SeqCst)).await,
            "the upstream's stream was dropped"
        );
        let counted = format!(
            r#"corral_stream_timeouts_total{{kind="idle",upstream="mock"}} {}"#,
            n + 1
        );
        assert!(metric_line(&corral, &counted), "{counted}");
        drop(tx);
    }
    assert!(
        eventually(Duration::from_secs(5), || metric_line(
            &corral,
            r#"corral_in_flight_requests{upstream="mock"} 0"#
        ))
        .await,
        "the slot was given back"
    );
}

#[tokio::test]
async fn the_clients_deadline_ends_a_stream_that_keeps_going() {
    let (upstream, slot, _) = sse_upstream().await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let start = Instant::now();
    let mut request = post(&corral.url("/v1/chat/completions"), r#"{"stream":true}"#);
    request
        .headers_mut()
        .insert("x-corral-deadline-ms", "800".parse().unwrap());
    let response = client().request(request).await.expect("corral answered");
    assert_eq!(response.status(), 200);
    let tx = slot
        .lock()
        .unwrap()
        .take()
        .expect("the upstream got the request");
    // An event every 50 ms, for at most 5 s.
    let feeder = tokio::spawn(async move {
        for i in 0..100 {
            let event = Bytes::from(format!("data: {{\"n\":{i}}}\n\n"));
            if tx.send(event).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut body = response.into_body();
    let mut events = 0;
    let end = loop {
        match tokio::time::timeout(Duration::from_secs(5), body.frame()).await {
            Ok(Some(Ok(_))) => events += 1,
            Ok(other) => break other,
            Err(_) => panic!("the stream outlived the deadline by 5 s"),
        }
    };
    let took = start.elapsed();
    assert!(matches!(end, Some(Err(_))), "cut abruptly: {end:?}");
    assert!(events >= 3, "events flowed until the deadline: {events}");
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(metric_line(
        &corral,
        r#"corral_stream_timeouts_total{kind="deadline",upstream="mock"} 1"#
    ));
    feeder.await.unwrap();
}

#[tokio::test]
async fn a_retryable_answer_whose_body_stalls_is_passed_on_within_the_deadline() {
    let held = Arc::new(Mutex::new(Vec::new()));
    let h2 = Arc::clone(&held);
    let upstream = MockUpstream::start(move |_| {
        let (tx, rx) = mpsc::channel(4);
        tx.try_send(Bytes::from_static(b"{\"error\":")).unwrap();
        h2.lock().unwrap().push(tx); // kept open: the body never ends
        let body = ChannelBody::boxed(rx, Arc::new(AtomicBool::new(false)));
        async move {
            Response::builder()
                .status(503)
                .header("content-type", "application/json")
                .body(body)
                .unwrap()
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(
        &upstream,
        "[upstream.retry]\ndeadline = \"700ms\"\nbase = \"10ms\"\ncap = \"50ms\"\n",
    ))
    .await;
    let start = Instant::now();
    let (parts, body) = tokio::time::timeout(
        Duration::from_secs(5),
        send(&client(), post(&corral.url("/v1/chat/completions"), "{}")),
    )
    .await
    .expect("an answer within 5 s");
    let took = start.elapsed();
    assert_eq!(parts.status, 503);
    assert_eq!(&body[..], b"{\"error\":");
    assert_eq!(parts.headers["content-length"], "9");
    assert!(
        took >= Duration::from_millis(650) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(upstream.calls(), 1, "no time was left to retry");
    assert!(metric_line(
        &corral,
        r#"corral_retry_gave_up_total{upstream="mock",why="deadline"} 1"#
    ));
}

#[tokio::test]
async fn a_retryable_answer_whose_body_breaks_is_passed_on_with_its_real_length() {
    let upstream = RawUpstream::start(
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"error\":",
    )
    .await;
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"raw\"\nroute = \"/v1\"\nbase_url = \"http://{}/v1\"\n\
         [upstream.retry]\nmax_retries = 1\nbase = \"10ms\"\ncap = \"20ms\"\n",
        upstream.addr
    ))
    .await;
    for client in [client(), h2_client()] {
        let (parts, body) = tokio::time::timeout(
            Duration::from_secs(5),
            send(&client, post(&corral.url("/v1/chat/completions"), "{}")),
        )
        .await
        .expect("the client got the whole (short) answer: no hang");
        assert_eq!(parts.status, 503);
        assert_eq!(parts.headers["content-length"], "9");
        assert_eq!(&body[..], b"{\"error\":");
    }
    assert_eq!(upstream.connections(), 4, "each request was tried twice");
}

// ===== 2. bounded memory =====

#[tokio::test]
async fn a_huge_content_length_gets_413_before_a_byte_is_read() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let start = Instant::now();
    // 10 GB announced, nothing sent: an answer that waited for the body would never come.
    let reply = raw_exchange(
        corral.addr,
        b"POST /v1/files HTTP/1.1\r\nhost: corral\r\ncontent-length: 10000000000\r\n\
          expect: 100-continue\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(reply.text.starts_with("HTTP/1.1 413"), "{}", reply.text);
    assert!(!reply.text.contains("100 Continue"), "{}", reply.text);
    assert!(reply.text.contains("x-corral-error: body_too_large"));
    assert!(
        reply.closed,
        "the connection closed instead of draining 10 GB"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    assert_eq!(upstream.calls(), 0);
}

#[tokio::test]
async fn beyond_the_buffer_cap_requests_get_503_with_retry_after() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&format!(
        "max_buffered_bytes = \"1MiB\"\n{}",
        one_upstream(
            &upstream,
            "body_limit = \"1MiB\"\nbody_idle_timeout = \"10s\""
        )
    ))
    .await;
    // A client announces 900 KiB and sends 10 bytes: its room is taken up front.
    let holder = tokio::spawn(raw_exchange(
        corral.addr,
        b"POST /v1/files HTTP/1.1\r\nhost: corral\r\ncontent-length: 921600\r\n\r\n0123456789",
        Duration::from_secs(8),
    ));
    let held = r#"corral_buffered_request_bytes 921600"#;
    assert!(
        eventually(Duration::from_secs(5), || metric_line(&corral, held)).await,
        "{}",
        corral.app.metrics().render()
    );
    assert!(metric_line(
        &corral,
        "corral_buffered_request_limit_bytes 1048576"
    ));
    // 200 KiB more does not fit: a brief wait, then 503 with Retry-After.
    let big = "x".repeat(200 * 1024);
    let start = Instant::now();
    let (parts, body) = send(&client(), post(&corral.url("/v1/files"), &big)).await;
    let took = start.elapsed();
    assert_eq!(parts.status, 503);
    assert_eq!(parts.headers["x-corral-error"], "buffer_full");
    assert_eq!(parts.headers["retry-after"], "1");
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "buffer_full");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // A small one still fits.
    let (ok, _) = send(&client(), post(&corral.url("/v1/chat/completions"), "{}")).await;
    assert_eq!(ok.status, 200);
    // The holder goes away: its room comes back, and the large body passes.
    holder.abort();
    let _ = holder.await;
    assert!(
        eventually(Duration::from_secs(5), || metric_line(
            &corral,
            "corral_buffered_request_bytes 0"
        ))
        .await
    );
    let (parts, _) = send(&client(), post(&corral.url("/v1/files"), &big)).await;
    assert_eq!(parts.status, 200);
    assert_eq!(upstream.calls(), 2);
}

// ===== 3. inputs =====

#[tokio::test]
async fn dot_segments_and_encoded_separators_get_400_bad_path_and_are_never_forwarded() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    for path in [
        "/v1/../x",
        "/v1/../../admin",
        "/v1/..",
        "/v1/./chat/completions",
        "/v1/%2e%2e/x",
        "/v1/%2E%2E/x",
        "/v1/.%2e/x",
        "/v1/%2e./x",
        "/v1/%2e/x",
        "/v1/a%2f..%2fb",
        "/v1/a%2Fb",
        "/v1/a%5cb",
        "/v1/a%5C..%5Cb",
        "/v1/%252e%252e/x",
    ] {
        let request = format!("GET {path} HTTP/1.1\r\nhost: corral\r\nconnection: close\r\n\r\n");
        let reply = raw_exchange(corral.addr, request.as_bytes(), Duration::from_secs(5)).await;
        assert!(
            reply.text.starts_with("HTTP/1.1 400"),
            "{path}: {}",
            reply.text
        );
        assert!(
            reply.text.contains("x-corral-error: bad_path"),
            "{path}: {}",
            reply.text
        );
        assert!(!reply.text.contains(path), "{path} echoed: {}", reply.text);
    }
    // A raw backslash is refused too (by hyper's parser or by corral).
    let reply = raw_exchange(
        corral.addr,
        b"GET /v1/a\\..\\b HTTP/1.1\r\nhost: corral\r\nconnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(reply.text.starts_with("HTTP/1.1 400"), "{}", reply.text);
    // Over HTTP/2 as well.
    let response = h2_client()
        .request(
            Request::get(corral.url("/v1/%2e%2e/x"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(response.headers()["x-corral-error"], "bad_path");
    assert_eq!(upstream.calls(), 0, "the upstream saw nothing");
    let (ok, _) = send(&client(), post(&corral.url("/v1/chat/completions"), "{}")).await;
    assert_eq!(ok.status, 200, "a plain path still passes");
}

#[tokio::test]
async fn methods_outside_the_seven_get_405_and_never_become_labels() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let long = "X".repeat(10_000);
    for method in ["TRACE", "BREW", "PROPFIND", long.as_str()] {
        let request = format!(
            "{method} /v1/chat/completions HTTP/1.1\r\nhost: corral\r\nconnection: close\r\n\r\n"
        );
        let reply = raw_exchange(corral.addr, request.as_bytes(), Duration::from_secs(5)).await;
        let shown = &method[..method.len().min(20)];
        assert!(
            reply.text.starts_with("HTTP/1.1 405"),
            "{shown}: {}",
            reply.text
        );
        assert!(
            reply.text.contains("x-corral-error: method_not_allowed"),
            "{shown}"
        );
        assert!(
            reply
                .text
                .contains("allow: GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"),
            "{shown}: {}",
            reply.text
        );
    }
    for method in ["GET", "POST", "DELETE", "OPTIONS"] {
        let request = Request::builder()
            .method(method)
            .uri(corral.url("/v1/models"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (parts, _) = send(&client(), request).await;
        assert_eq!(parts.status, 200, "{method}");
    }
    assert_eq!(upstream.calls(), 4);
    let metrics = corral.app.metrics().render();
    for invented in ["TRACE", "BREW", "PROPFIND", "XXXXXXXX"] {
        assert!(!metrics.contains(invented), "{invented} in /metrics");
    }
    assert!(metrics.contains(r#"method="DELETE""#));
    assert!(
        metrics.len() < 200_000,
        "/metrics grew to {} bytes",
        metrics.len()
    );
}

#[tokio::test]
async fn a_refused_upstream_connection_gets_a_fixed_message() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"gone\"\nroute = \"/v1\"\nbase_url = \"http://127.0.0.1:{port}/v1\"\n\
         [upstream.retry]\nmax_retries = 0\n[upstream.breaker]\nenabled = false\n"
    ))
    .await;
    let (parts, body) = send(&client(), post(&corral.url("/v1/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 502);
    assert_eq!(parts.headers["x-corral-error"], "upstream_connect");
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        json["error"]["message"],
        "connecting to upstream `gone` failed"
    );
    let text = String::from_utf8_lossy(&body).to_lowercase();
    for detail in ["os error", "refused", "tcp connect", "127.0.0.1"] {
        assert!(!text.contains(detail), "{detail} in {text}");
    }
}

// ===== 4. load: 2,000 connections, large bodies, a slow upstream (ignored; benches/load.sh) =====

/// A slow upstream in this process: reads (and drops) each body, waits `service`, answers 200.
async fn slow_upstream(service: Duration) -> std::net::SocketAddr {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    move |req: Request<hyper::body::Incoming>| async move {
                        let mut body = req.into_body();
                        let mut bytes = 0usize;
                        while let Some(Ok(frame)) = body.frame().await {
                            bytes += frame.data_ref().map_or(0, |d| d.len());
                        }
                        tokio::time::sleep(service).await;
                        let answer = format!("{{\"received\":{bytes}}}");
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(
                            answer,
                        ))))
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// `VmRSS` and `VmHWM` of `pid`, in bytes.
fn rss(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// `corral_buffered_request_bytes` from corral's `/metrics`, or what came back instead.
async fn buffered_bytes(addr: std::net::SocketAddr) -> Result<u64, String> {
    let reply = raw_exchange(
        addr,
        b"GET /metrics HTTP/1.1\r\nhost: corral\r\nconnection: close\r\n\r\n",
        Duration::from_secs(10),
    )
    .await;
    reply
        .text
        .lines()
        .find_map(|l| l.strip_prefix("corral_buffered_request_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no corral_buffered_request_bytes in {:?}", reply.text))
}

/// One client's request: a fresh connection, `size` bytes of body, the status line back (0:
/// no answer, the connection reset or closed first).
async fn load_request(addr: std::net::SocketAddr, payload: &[u8], deadline: Instant) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let head = format!(
            "POST /v1/files HTTP/1.1\r\nhost: corral\r\ncontent-type: application/octet-stream\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            payload.len()
        );
        stream.write_all(head.as_bytes()).await.ok()?;
        // A write that fails (corral answered early and closed) still leaves its answer to read.
        let _ = stream.write_all(payload).await;
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        let line = String::from_utf8_lossy(&answer[..answer.len().min(32)]).into_owned();
        line.split_whitespace().nth(1)?.parse().ok()
    };
    tokio::time::timeout_at(deadline, attempt)
        .await
        .ok()
        .flatten()
        .unwrap_or(0)
}

/// 2,000 concurrent connections each send a 1-8 MB body (and, refused, try again after
/// Retry-After, up to 5 times) through the real binary to an upstream that takes 2 s per
/// request. Prints corral's peak RSS against its buffer cap. Figures only: timings are not
/// asserted; the only assertions are that corral survived, that its buffered bytes (scraped from
/// `/metrics` on the admin listener every 100 ms, every scrape answered) were seen above zero and
/// never passed the cap, and that its RSS stayed within budget. Environment: LOAD_CONNECTIONS (2000), LOAD_CAP_MIB (128), LOAD_SECONDS (150).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a load test: run benches/load.sh"]
async fn load_2000_connections_stay_under_the_buffer_cap() {
    use tokio::io::AsyncBufReadExt;
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let connections = env("LOAD_CONNECTIONS", 2000) as usize;
    let cap_mib = env("LOAD_CAP_MIB", 128);
    let seconds = env("LOAD_SECONDS", 150);
    const ATTEMPTS: usize = 5;
    const SERVICE: Duration = Duration::from_secs(2);
    const MB: usize = 1_000_000;

    let upstream = slow_upstream(SERVICE).await;
    let config = std::env::temp_dir().join(format!("corral-load-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        format!(
            "max_buffered_bytes = \"{cap_mib}MiB\"\n\
             [[upstream]]\nname = \"slow\"\nroute = \"/v1\"\nbase_url = \"http://{upstream}/v1\"\n\
             body_limit = \"8MiB\"\nrate_limit = \"off\"\n\
             [upstream.limits]\nmax_concurrency = 1024\nqueue_size = 10000\n\
             [upstream.retry]\nmax_retries = 0\ndeadline = \"5m\"\nper_try_timeout = \"2m\"\n\
             [upstream.breaker]\nenabled = false\n"
        ),
    )
    .unwrap();
    let mut child = corral_command([
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--log-format",
        "json",
    ])
    .env("RUST_LOG", "warn,corral=info")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("spawn corral");
    let pid = child.id().expect("a pid");
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    // The main listener and the admin one (scraped apart from the load).
    let (addr, admin): (std::net::SocketAddr, std::net::SocketAddr) =
        tokio::time::timeout(Duration::from_secs(10), async {
            let (mut addr, mut admin) = (None, None);
            while let Ok(Some(line)) = lines.next_line().await {
                let json: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
                let at = || json["addr"].as_str().unwrap().parse().unwrap();
                if json["message"] == "corral listening" {
                    addr = Some(at());
                } else if json["message"] == "admin endpoints listening" {
                    admin = Some(at());
                }
                if let (Some(addr), Some(admin)) = (addr, admin) {
                    return (addr, admin);
                }
            }
            panic!("corral exited before listening")
        })
        .await
        .expect("corral listens within 10 s");
    // Drain the rest of corral's log so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let (idle_rss, _) = rss(pid).expect("corral's /proc status");

    // One 8 MB buffer; each client sends a prefix of it (1..=8 MB by its index).
    let payload: Arc<Vec<u8>> = Arc::new(vec![b'x'; 8 * MB]);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            let (mut peak_rss, mut peak_buffered, mut scrapes) = (0u64, 0u64, 0usize);
            while !done.load(Ordering::SeqCst) {
                if let Some((now, _)) = rss(pid) {
                    peak_rss = peak_rss.max(now);
                }
                // A failed scrape would leave the peak at 0 and the cap unchecked.
                let b = buffered_bytes(admin)
                    .await
                    .unwrap_or_else(|e| panic!("scrape {scrapes} failed: {e}"));
                peak_buffered = peak_buffered.max(b);
                scrapes += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (peak_rss, peak_buffered, scrapes)
        })
    };
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..connections {
        let payload = Arc::clone(&payload);
        clients.spawn(async move {
            let size = (1 + i % 8) * MB;
            let mut statuses = Vec::new();
            for attempt in 0..ATTEMPTS {
                let status = load_request(addr, &payload[..size], deadline).await;
                statuses.push(status);
                if status == 200 || Instant::now() >= deadline {
                    break;
                }
                // Retry-After: 1, plus a spread so the retries don't return as one herd.
                let spread =
                    Duration::from_millis((i as u64 * 7919 + attempt as u64 * 104_729) % 1000);
                tokio::time::sleep(Duration::from_secs(1) + spread).await;
            }
            (size, statuses)
        });
    }
    let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
    let (mut sent, mut served, mut bytes_served) = (0usize, 0usize, 0usize);
    while let Some(result) = clients.join_next().await {
        let (size, statuses) = result.expect("a client task");
        sent += statuses.len();
        for s in &statuses {
            *by_status.entry(*s).or_default() += 1;
        }
        if statuses.last() == Some(&200) {
            served += 1;
            bytes_served += size;
        }
    }
    let elapsed = started.elapsed();
    done.store(true, Ordering::SeqCst);
    let (peak_rss_sampled, peak_buffered, scrapes) = sampler.await.expect("every scrape answered");
    let (_, hwm) = rss(pid).expect("corral still running");
    assert!(
        child.try_wait().unwrap().is_none(),
        "corral exited under load"
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("load: {connections} concurrent connections, bodies 1-8 MB (mean 4.5 MB), upstream service time {SERVICE:?}, up to {ATTEMPTS} tries each");
    println!("load: {sent} requests sent in {:.1} s; answers by status (0 = none, connection closed): {by_status:?}", elapsed.as_secs_f64());
    println!(
        "load: {served}/{connections} clients served ({:.0} MB of bodies forwarded)",
        bytes_served as f64 / MB as f64
    );
    println!(
        "load: corral RSS idle {:.1} MiB, peak {:.1} MiB (VmHWM; sampled peak {:.1} MiB); buffer cap {cap_mib} MiB, peak buffered {:.1} MiB; offered {:.0} MiB of bodies at once",
        mib(idle_rss),
        mib(hwm),
        mib(peak_rss_sampled),
        mib(peak_buffered),
        mib((connections * 9 / 2 * MB) as u64),
    );
    assert!(
        peak_buffered > 0,
        "{scrapes} scrapes never saw a buffered byte while {connections} clients sent bodies"
    );
    assert!(
        peak_buffered <= cap_mib << 20,
        "buffered {peak_buffered} bytes, over the cap"
    );
    // RSS follows the cap, not the offered load: idle, the cap with half again for the heap's
    // slack, and 64 KiB per connection (the budget tests/deploy.rs uses for the sidecar).
    let budget = idle_rss + (cap_mib << 20) * 3 / 2 + connections as u64 * (64 << 10);
    assert!(
        hwm <= budget,
        "peak RSS {:.1} MiB over {:.1} MiB (idle + 1.5 x cap + 64 KiB per connection)",
        mib(hwm),
        mib(budget)
    );
    let _ = child.start_kill();
    let _ = std::fs::remove_file(&config);
}
