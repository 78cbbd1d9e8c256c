//! Connections, listening and the drain, against raw sockets on 127.0.0.1: every wait of a
//! connection has an end (first byte, idle HTTP/1 and HTTP/2, unanswered HTTP/2 PINGs), header
//! blocks over 64 KiB get 431, the connection cap holds new connections in the backlog, SIGTERM
//! drains with `/readyz` at 503 while still serving, admin endpoints answer GET and HEAD only,
//! and a non-loopback listener that injects credentials is warned about.
//!
//! Real sockets need real time (paused time would auto-advance past them), so every test sets
//! timeouts of a few hundred milliseconds in its config, and every wait is bounded.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use corral::config;
use corral::server::{self, App};
use corral::shutdown::Signal;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::binary::corral_command;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Longest any single wait in these tests may take.
const BOUND: Duration = Duration::from_secs(5);

// ===== helpers =====

/// corral in-process on 127.0.0.1:0, stopped by sending it a [`Signal`].
struct Served {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    app: Arc<App>,
    stop: Option<oneshot::Sender<Signal>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Served {
    /// Serve `toml` (its `listen` is replaced by an ephemeral port), with an admin listener if
    /// `admin`.
    async fn start(toml: &str, admin: bool) -> Self {
        let config = config::load_str("test.toml", toml).expect("test config is valid");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = match admin {
            true => Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
            false => None,
        };
        let admin = admin_listener.as_ref().map(|l| l.local_addr().unwrap());
        let app = App::new(&config);
        let (stop, stopped) = oneshot::channel::<Signal>();
        let shutdown = async move { stopped.await.unwrap_or(Signal::Interrupt) };
        let task = tokio::spawn(server::run(
            Arc::clone(&app),
            listener,
            admin_listener,
            shutdown,
        ));
        Self {
            addr,
            admin,
            app,
            stop: Some(stop),
            task: Some(task),
        }
    }

    fn signal(&mut self, signal: Signal) {
        let _ = self.stop.take().expect("signalled once").send(signal);
    }

    /// Wait (bounded) for `server::run` to return.
    async fn stopped(&mut self) {
        let task = self.task.take().expect("running");
        tokio::time::timeout(BOUND, task)
            .await
            .expect("server::run returned in time")
            .unwrap()
            .unwrap();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A config with `top` lines and, if given, the mock upstream at `/v1`.
fn toml(top: &str, upstream: Option<&MockUpstream>) -> String {
    match upstream {
        Some(u) => format!(
            "{top}\n[[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"http://{}/v1\"\n",
            u.addr
        ),
        None => format!("{top}\n"),
    }
}

/// Read until the peer closes (EOF or reset); what was read and when it closed.
async fn read_until_closed(stream: &mut TcpStream) -> (Vec<u8>, Instant) {
    let mut all = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let end = Instant::now() + BOUND;
    loop {
        match tokio::time::timeout_at(end, stream.read(&mut buf)).await {
            Err(_) => panic!(
                "the connection was still open after {BOUND:?}; read {:?}",
                String::from_utf8_lossy(&all)
            ),
            Ok(Ok(0) | Err(_)) => return (all, Instant::now()),
            Ok(Ok(n)) => all.extend_from_slice(&buf[..n]),
        }
    }
}

/// Send one HTTP/1.1 request for `/healthz` and read its whole (`ok\n`) answer.
async fn healthz_h1(stream: &mut TcpStream) {
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: corral\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"\r\n\r\nok\n") {
        let n = tokio::time::timeout(BOUND, stream.read(&mut buf))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed before answering: {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200 "), "{got:?}");
}

/// An HTTP/2 (prior knowledge) connection to `addr` and its driver task.
async fn h2_connect(
    addr: SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    JoinHandle<hyper::Result<()>>,
) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    (send, tokio::spawn(conn))
}

/// Status and body of `GET http://addr/path` on a new connection.
async fn get_status(addr: SocketAddr, path: &str) -> (u16, Bytes) {
    let (parts, body) =
        tokio::time::timeout(BOUND, send(&client(), get(&format!("http://{addr}{path}"))))
            .await
            .expect("answered in time");
    (parts.status.as_u16(), body)
}

/// `GET url` with about `size` bytes of headers: one `x-big` field, or 1 KiB `x-pad-N` fields.
fn padded(url: &str, size: usize, one_field: bool) -> Request<Full<Bytes>> {
    let mut req = Request::get(url);
    if one_field {
        req = req.header("x-big", "a".repeat(size));
    } else {
        for i in 0..size / 1024 {
            req = req.header(format!("x-pad-{i}"), "a".repeat(1024 - 20));
        }
    }
    req.body(Full::new(Bytes::new())).unwrap()
}

// ===== every wait has an end =====

#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_the_first_byte_timeout() {
    let corral = Served::start(&toml("first_byte_timeout = \"300ms\"", None), false).await;
    let start = Instant::now();
    let mut silent = TcpStream::connect(corral.addr).await.unwrap();
    let (read, closed) = read_until_closed(&mut silent).await;
    assert!(read.is_empty(), "{read:?}");
    let after = closed - start;
    assert!(
        after >= Duration::from_millis(300) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );
}

#[tokio::test]
async fn a_partial_http2_preface_or_http1_head_is_closed_after_the_idle_timeout() {
    let corral = Served::start(
        &toml(
            "first_byte_timeout = \"10s\"\nidle_timeout = \"400ms\"",
            None,
        ),
        false,
    )
    .await;
    for partial in [
        &b"PRI * HTTP/2.0\r\n"[..],
        &b"GET /healthz HTTP/1.1\r\nhost: corral\r\n"[..],
    ] {
        let mut stream = TcpStream::connect(corral.addr).await.unwrap();
        let start = Instant::now();
        stream.write_all(partial).await.unwrap();
        let (read, closed) = read_until_closed(&mut stream).await;
        let after = closed - start;
        assert!(
            after >= Duration::from_millis(350) && after < Duration::from_secs(3),
            "{:?}: closed after {after:?}, read {read:?}",
            String::from_utf8_lossy(partial)
        );
    }
}

/// A keep-alive connection used again halfway through its idle timeout (3 s) is still there,
/// and its idle time starts again: it closes 3 s after the second answer, not the first. The
/// bounds leave 0.75 s either side of the 2.25 s that tells the two apart.
#[tokio::test]
async fn an_idle_http1_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let corral = Served::start(&toml("idle_timeout = \"3s\"", None), false).await;
    let mut stream = TcpStream::connect(corral.addr).await.unwrap();
    healthz_h1(&mut stream).await;
    // Used again within the idle timeout, the connection is still there...
    tokio::time::sleep(Duration::from_millis(1500)).await;
    healthz_h1(&mut stream).await;
    let answered = Instant::now();
    // ...and closed once idle for as long again.
    let (read, closed) = read_until_closed(&mut stream).await;
    assert!(read.is_empty(), "{read:?}");
    let idle = closed - answered;
    assert!(
        idle >= Duration::from_millis(2250) && idle < BOUND,
        "closed after {idle:?} idle"
    );
}

#[tokio::test]
async fn an_idle_http2_connection_is_closed_after_the_idle_timeout() {
    let corral = Served::start(&toml("idle_timeout = \"400ms\"", None), false).await;
    let (mut send, conn) = h2_connect(corral.addr).await;
    let response = send
        .send_request(get(&format!("http://{}/healthz", corral.addr)))
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ok\n");
    let answered = Instant::now();
    let ended = tokio::time::timeout(BOUND, conn)
        .await
        .expect("corral closed the idle HTTP/2 connection")
        .unwrap();
    let idle = answered.elapsed();
    assert!(
        ended.is_ok(),
        "closed with a GOAWAY, not an error: {ended:?}"
    );
    assert!(
        idle >= Duration::from_millis(250) && idle < Duration::from_secs(3),
        "closed after {idle:?} idle"
    );
    assert!(send.send_request(get("/healthz")).await.is_err());
}

/// One HTTP/2 frame header: payload length, type, flags, stream id.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut out = len.to_be_bytes()[1..].to_vec();
    out.extend([kind, flags]);
    out.extend(stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// HPACK, no Huffman: a literal field (never indexed) whose name is static table entry `index`.
fn literal(index: u8, value: &str) -> Vec<u8> {
    let mut out = vec![index, value.len() as u8];
    out.extend_from_slice(value.as_bytes());
    out
}

#[tokio::test]
async fn an_http2_peer_that_does_not_answer_pings_is_closed_mid_request() {
    let upstream = MockUpstream::start(|_| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        json(200, serde_json::json!({}))
    })
    .await;
    let corral = Served::start(
        &toml(
            "http2_keep_alive_interval = \"300ms\"\nidle_timeout = \"1m\"",
            Some(&upstream),
        ),
        false,
    )
    .await;
    let mut stream = TcpStream::connect(corral.addr).await.unwrap();
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(frame(0x4, 0, 0, &[])); // SETTINGS, none changed
    let mut block = vec![0x82, 0x86]; // :method GET, :scheme http
    block.extend(literal(0x04, "/v1/slow")); // :path
    block.extend(literal(0x01, "corral")); // :authority
    out.extend(frame(0x1, 0x5, 1, &block)); // HEADERS, END_STREAM | END_HEADERS
    stream.write_all(&out).await.unwrap();
    assert!(
        eventually(BOUND, || upstream.calls() == 1).await,
        "the request reached the upstream"
    );
    // Never answer anything, PINGs included.
    let start = Instant::now();
    let (read, _) = read_until_closed(&mut stream).await;
    let after = start.elapsed();
    let mut kinds = Vec::new();
    let mut rest = &read[..];
    while rest.len() >= 9 {
        let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
        kinds.push(rest[3]);
        rest = &rest[(9 + len).min(rest.len())..];
    }
    assert!(kinds.contains(&0x6), "corral sent a PING; frames {kinds:?}");
    assert!(after < Duration::from_secs(3), "closed after {after:?}");
    let idle = r#"corral_in_flight_requests{upstream="mock"} 0"#;
    assert!(
        eventually(BOUND, || corral.app.metrics().render().contains(idle)).await,
        "the request in flight ended with its connection"
    );
}

// ===== header blocks =====

#[tokio::test]
async fn http1_header_blocks_over_64_kib_get_431() {
    let corral = Served::start(&toml("", None), false).await;
    for (size, want) in [(60 << 10, "200"), (70 << 10, "431")] {
        let stream = TcpStream::connect(corral.addr).await.unwrap();
        let head = format!(
            "GET /healthz HTTP/1.1\r\nhost: corral\r\nx-big: {}\r\nconnection: close\r\n\r\n",
            "a".repeat(size)
        );
        // Written from another task: corral answers 431 before it has read everything.
        let (mut reader, mut writer) = stream.into_split();
        let write = tokio::spawn(async move {
            let _ = writer.write_all(head.as_bytes()).await;
        });
        let mut got = Vec::new();
        let _ = tokio::time::timeout(BOUND, reader.read_to_end(&mut got)).await;
        let status = String::from_utf8_lossy(&got[..got.len().min(12)]).into_owned();
        assert_eq!(
            status.get(9..),
            Some(want),
            "{size} bytes of headers: {status:?}"
        );
        write.abort();
    }
}

#[tokio::test]
async fn http2_header_blocks_over_64_kib_get_431() {
    let corral = Served::start(&toml("", None), false).await;
    let url = format!("http://{}/healthz", corral.addr);
    for one_field in [false, true] {
        for (size, want) in [(60 << 10, 200), (70 << 10, 431)] {
            let (mut send, _conn) = h2_connect(corral.addr).await;
            let request = send.send_request(padded(&url, size, one_field));
            let response = tokio::time::timeout(BOUND, request)
                .await
                .expect("answered in time")
                .expect("an answer, not a reset");
            let shape = if one_field {
                "one field"
            } else {
                "1 KiB fields"
            };
            assert_eq!(
                response.status(),
                want,
                "{size} bytes of headers in {shape}"
            );
        }
    }
    // Past about 96 KiB a block needs more CONTINUATION frames than h2 allows for a 64 KiB
    // list: the connection ends with a GOAWAY (h2's guard against CONTINUATION floods).
    let (mut send, _conn) = h2_connect(corral.addr).await;
    let request = send.send_request(padded(&url, 200 << 10, true));
    let refused = tokio::time::timeout(BOUND, request).await.expect("in time");
    let err = refused.expect_err("200 KiB of headers");
    assert!(format!("{err:?}").contains("GoAway"), "{err:?}");
}

// ===== the connection cap =====

#[tokio::test]
async fn at_the_connection_cap_new_connections_wait_in_the_backlog_until_a_slot_frees() {
    let mut corral = Served::start(
        &toml("max_connections = 2\nidle_timeout = \"30s\"", None),
        true,
    )
    .await;
    let mut first = TcpStream::connect(corral.addr).await.unwrap();
    healthz_h1(&mut first).await;
    let mut second = TcpStream::connect(corral.addr).await.unwrap();
    healthz_h1(&mut second).await;
    // The kernel completes the handshake; corral does not accept, so nothing answers.
    let mut third = TcpStream::connect(corral.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: corral\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut buf)).await;
    assert!(early.is_err(), "answered above the cap: {early:?}");
    let (status, body) = get_status(corral.admin.unwrap(), "/status").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        json["connections"],
        serde_json::json!({"open": 2, "max": 2})
    );
    // A slot frees: the waiting connection is accepted and served.
    drop(first);
    let start = Instant::now();
    healthz_h1(&mut third).await;
    assert!(start.elapsed() < Duration::from_secs(2));
    drop((second, third));
    corral.signal(Signal::Interrupt);
    corral.stopped().await;
}

// ===== the drain =====

/// A mock upstream whose `/v1/slow` answers once the returned semaphore gets a permit,
/// everything else at once.
async fn slow_and_fast() -> (MockUpstream, Arc<tokio::sync::Semaphore>) {
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::clone(&release);
    let upstream = MockUpstream::start(move |seen| {
        let gate = Arc::clone(&gate);
        async move {
            if seen.uri.path().ends_with("/slow") {
                gate.acquire().await.unwrap().forget();
            }
            json(200, serde_json::json!({"path": seen.uri.path()}))
        }
    })
    .await;
    (upstream, release)
}

/// The drain delay (2 s here) keeps serving new connections after SIGTERM while `/readyz` says
/// 503; the listener closes no sooner than the delay; a request in flight then still finishes.
/// The slow request is held until the test releases it, so no bound races the machine: the
/// only timings asserted are the delay's lower bound and [`BOUND`].
#[tokio::test]
async fn sigterm_answers_readyz_503_while_still_serving_for_the_drain_delay_then_drains() {
    let (upstream, release) = slow_and_fast().await;
    let mut corral = Served::start(
        &toml(
            "drain_delay = \"2s\"\ndrain_timeout = \"30s\"\nadmin_listen = \"127.0.0.1:0\"",
            Some(&upstream),
        ),
        true,
    )
    .await;
    let (addr, admin) = (corral.addr, corral.admin.unwrap());
    assert_eq!(get_status(admin, "/readyz").await.0, 200);
    let in_flight = tokio::spawn(get_status(addr, "/v1/slow"));
    assert!(eventually(BOUND, || upstream.calls() == 1).await);

    let signalled = Instant::now();
    corral.signal(Signal::Terminate);
    assert!(
        eventually(BOUND, || !corral.app.is_ready()).await,
        "readiness flips"
    );
    assert_eq!(
        get_status(admin, "/readyz").await,
        (503, "not ready\n".into())
    );
    // Within the delay a new connection is still accepted and served: after the signal, and
    // before the listener closes (which the assertion on `closed` below bounds from below).
    let (status, _) = get_status(addr, "/v1/fast").await;
    assert_eq!(status, 200);
    let served = signalled.elapsed();

    // Then the listener closes, no sooner than the delay.
    assert!(
        eventually(BOUND, || std::net::TcpStream::connect(addr).is_err()).await,
        "the listener closed after the delay"
    );
    let closed = signalled.elapsed();
    assert!(
        closed >= Duration::from_millis(1950) && closed > served,
        "closed after {closed:?} (the new connection was served after {served:?})"
    );
    assert!(
        !in_flight.is_finished(),
        "the slow request outlives the delay"
    );
    // While it drains, the admin listener still says 503.
    assert_eq!(get_status(admin, "/readyz").await.0, 503);
    release.add_permits(1);
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200, "the in-flight request finished");
    assert_eq!(&body[..], br#"{"path":"/v1/slow"}"#);
    corral.stopped().await;
    assert!(
        std::net::TcpStream::connect(admin).is_err(),
        "admin closes last"
    );
}

#[tokio::test]
async fn sigint_closes_the_listener_at_once() {
    let mut corral = Served::start(&toml("drain_delay = \"5s\"", None), false).await;
    let addr = corral.addr;
    let signalled = Instant::now();
    corral.signal(Signal::Interrupt);
    assert!(
        eventually(BOUND, || std::net::TcpStream::connect(addr).is_err()).await,
        "the listener closed"
    );
    assert!(signalled.elapsed() < Duration::from_secs(2), "no 5 s delay");
    corral.stopped().await;
}

#[tokio::test]
async fn the_drain_timeout_cuts_what_is_still_in_flight() {
    let upstream = MockUpstream::start(|_| async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        json(200, serde_json::json!({}))
    })
    .await;
    let mut corral =
        Served::start(&toml("drain_timeout = \"300ms\"", Some(&upstream)), false).await;
    let addr = corral.addr;
    let in_flight = tokio::spawn(async move {
        client()
            .request(get(&format!("http://{addr}/v1/endless")))
            .await
    });
    assert!(eventually(BOUND, || upstream.calls() == 1).await);
    let signalled = Instant::now();
    corral.signal(Signal::Interrupt);
    corral.stopped().await;
    let took = signalled.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(3),
        "{took:?}"
    );
    let cut = tokio::time::timeout(BOUND, in_flight)
        .await
        .unwrap()
        .unwrap();
    assert!(cut.is_err(), "the client sees its connection cut: {cut:?}");
}

// ===== configuration =====

#[test]
fn connection_settings_are_checked() {
    let err = |top: &str| {
        config::load_str("t.toml", &format!("listen = \"127.0.0.1:0\"\n{top}\n"))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err("first_byte_timeout = \"0s\""),
        "t.toml:2: first_byte_timeout: `first_byte_timeout` must be above zero"
    );
    assert_eq!(
        err("idle_timeout = \"2h\""),
        "t.toml:2: idle_timeout: `idle_timeout` must be at most 1h, got 2h"
    );
    assert_eq!(
        err("http2_keep_alive_interval = \"0ms\""),
        "t.toml:2: http2_keep_alive_interval: `http2_keep_alive_interval` must be above zero"
    );
    assert_eq!(
        err("drain_delay = \"90m\""),
        "t.toml:2: drain_delay: `drain_delay` must be at most 1h, got 1h 30m"
    );
    assert!(err("max_connections = 0").starts_with("t.toml:2: max_connections: "));
    let ok = config::load_str("t.toml", "drain_delay = \"0s\"\ndrain_timeout = \"0s\"\n");
    assert!(ok.is_ok(), "no delay and no drain are allowed: {ok:?}");
}

// ===== admin endpoints =====

#[tokio::test]
async fn admin_endpoints_answer_get_and_head_only() {
    let corral = Served::start(&toml("", None), true).await;
    for addr in [corral.addr, corral.admin.unwrap()] {
        for (method, path) in [
            ("POST", "/readyz"),
            ("DELETE", "/metrics"),
            ("PUT", "/status"),
        ] {
            let req = Request::builder()
                .method(method)
                .uri(format!("http://{addr}{path}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let (parts, body) = send(&client(), req).await;
            assert_eq!(parts.status, 405, "{method} {path}");
            assert_eq!(parts.headers["x-corral-error"], "method_not_allowed");
            assert_eq!(parts.headers["allow"], "GET, HEAD");
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["error"]["code"], "method_not_allowed");
        }
        let head = Request::head(format!("http://{addr}/healthz"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (parts, body) = send(&client(), head).await;
        assert_eq!(parts.status, 200);
        assert!(body.is_empty());
    }
}

// ===== safe listening =====

/// A config injecting a credential for upstream `openai`, listening on `listen`.
fn injecting(listen: &str) -> config::Config {
    config::load_str(
        "test.toml",
        &format!(
            "listen = \"{listen}\"\n[[upstream]]\nname = \"openai\"\nroute = \"/v1\"\n\
             base_url = \"https://api.openai.com/v1\"\n[upstream.headers]\n\
             Authorization = \"Bearer sk-never-shown\"\n"
        ),
    )
    .unwrap()
}

#[test]
fn a_non_loopback_listener_that_injects_credentials_is_warned_about() {
    for listen in ["127.0.0.1:8080", "[::1]:8080", "[::ffff:127.0.0.1]:8080"] {
        assert!(injecting(listen).warnings().is_empty(), "{listen}");
    }
    for listen in ["0.0.0.0:8080", "[::]:8080", "10.1.2.3:8080"] {
        let warnings = injecting(listen).warnings();
        assert_eq!(warnings.len(), 1, "{listen}: {warnings:?}");
        assert!(
            warnings[0].contains("not a loopback address"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("`openai`"), "{warnings:?}");
        assert!(!warnings[0].contains("sk-never-shown"));
    }
    // Clients bringing their own keys: nothing to spend.
    let open = config::load_str("t.toml", &toml("listen = \"0.0.0.0:8080\"", None)).unwrap();
    assert!(open.warnings().is_empty());
}

#[test]
fn a_drain_longer_than_the_default_grace_period_is_warned_about() {
    let at = |top: &str| {
        config::load_str("t.toml", &toml(top, None))
            .unwrap()
            .warnings()
    };
    assert!(at("").is_empty(), "the defaults fit: {:?}", at(""));
    assert!(at("drain_delay = \"10s\"\ndrain_timeout = \"20s\"").is_empty());
    let warnings = at("drain_delay = \"10s\"\ndrain_timeout = \"25s\"");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("terminationGracePeriodSeconds"),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn the_warning_is_logged_at_start_and_listed_by_status() {
    use tracing::instrument::WithSubscriber;
    let app = App::new(&injecting("0.0.0.0:8080"));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let task = tokio::spawn(
        server::run(
            Arc::clone(&app),
            listener,
            None,
            std::future::pending::<()>(),
        )
        .with_subscriber(subscriber),
    );
    let (status, body) = get_status(addr, "/status").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let listed = json["warnings"][0].as_str().unwrap_or_default();
    assert!(listed.contains("not a loopback address"), "{json}");
    let log = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("not a loopback address"))
        .unwrap_or_else(|| panic!("no warning logged:\n{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(log.find("not a loopback").unwrap() < log.find("corral listening").unwrap());
    task.abort();
}

#[tokio::test]
async fn check_config_prints_the_effective_listen_and_the_warning() {
    let path = std::env::temp_dir().join(format!("corral-connections-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "listen = \"127.0.0.1:8080\"\n[[upstream]]\nname = \"openai\"\nroute = \"/v1\"\n\
         base_url = \"https://api.openai.com/v1\"\n[upstream.headers]\n\
         Authorization = \"Bearer ${CORRAL_CONN_TEST_KEY}\"\n",
    )
    .unwrap();
    let path_arg = path.to_str().unwrap();
    let run = |flag: Option<&str>, env: Option<&str>| {
        let mut cmd = corral_command(["check-config", path_arg]);
        if let Some(listen) = flag {
            cmd.args(["--listen", listen]);
        }
        if let Some(listen) = env {
            cmd.env("CORRAL_LISTEN", listen);
        }
        cmd.env("CORRAL_CONN_TEST_KEY", "sk-conn-test");
        async move {
            let out = cmd.output().await.expect("run corral check-config");
            assert_eq!(out.status.code(), Some(0), "{out:?}");
            let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
            (text(out.stdout), text(out.stderr))
        }
    };
    let (stdout, stderr) = run(None, None).await;
    assert!(stdout.contains("listen = \"127.0.0.1:8080\""), "{stdout}");
    assert!(stderr.is_empty(), "{stderr}");
    let (stdout, stderr) = run(None, Some("0.0.0.0:9999")).await;
    assert!(stdout.contains("listen = \"0.0.0.0:9999\""), "{stdout}");
    assert!(!stdout.contains("127.0.0.1:8080"), "{stdout}");
    assert!(
        stderr.starts_with("warning: `listen` (0.0.0.0:9999"),
        "{stderr}"
    );
    let (stdout, _) = run(Some("0.0.0.0:7777"), Some("0.0.0.0:9999")).await;
    assert!(
        stdout.contains("listen = \"0.0.0.0:7777\""),
        "the flag wins: {stdout}"
    );
    assert!(!stdout.contains("sk-conn-test") && !stderr.contains("sk-conn-test"));
    let _ = std::fs::remove_file(&path);
}

// ===== rule 5: a client that stops reading =====

/// corral with `write_timeout`, and a raw HTTP/1 client that has asked it for a stream.
async fn stream_request(write_timeout: &str, upstream: &MockUpstream) -> (Corral, TcpStream) {
    let top = format!("write_timeout = \"{write_timeout}\"");
    let corral = Corral::start(&toml(&top, Some(upstream))).await;
    let mut client = TcpStream::connect(corral.addr).await.unwrap();
    client
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: corral\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
    (corral, client)
}

/// A client that asks for a stream and never reads it: once the socket and hyper's buffers are
/// full, the frame waiting for it passes `write_timeout` and corral ends the connection, so the
/// upstream's stream is dropped and the slot comes back.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_after_the_write_timeout() {
    let (upstream, sender, dropped) = sse_upstream().await;
    let (corral, client) = stream_request("300ms", &upstream).await;
    // Never read. Feed 256 KiB chunks until corral stops taking them (its buffers and the
    // socket are full), at most 256 MiB.
    let chunk = Bytes::from(vec![b'x'; 256 << 10]);
    let start = Instant::now();
    let mut sent = 0usize;
    while start.elapsed() < BOUND && sent < 1024 {
        let Some(tx) = sender.lock().unwrap().clone() else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        match tokio::time::timeout(Duration::from_millis(200), tx.send(chunk.clone())).await {
            Ok(Ok(())) => sent += 1,
            // Full (corral stopped polling) or closed (corral dropped the stream): stop feeding.
            Ok(Err(_)) | Err(_) => break,
        }
    }
    let end = Instant::now() + BOUND;
    while !dropped.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            Instant::now() < end,
            "the stream is still held {BOUND:?} after the client stopped reading ({sent} chunks sent)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = corral.app.metrics().render();
    assert!(
        metrics.contains("corral_in_flight_requests{upstream=\"mock\"} 0"),
        "the request gave its slot back"
    );
    drop(client);
}

/// An upstream that pauses longer than `write_timeout` while the client reads is not a stall:
/// hyper is waiting for the body then, not for the client.
#[tokio::test]
async fn an_upstream_pause_is_not_a_client_stall() {
    let (upstream, sender, dropped) = sse_upstream().await;
    let (_corral, mut client) = stream_request("200ms", &upstream).await;
    let mut buf = [0u8; 4096];
    let feed = |text: &'static str| {
        let sender = Arc::clone(&sender);
        async move {
            let end = Instant::now() + BOUND;
            loop {
                let tx = sender.lock().unwrap().clone();
                if let Some(tx) = tx {
                    tx.send(Bytes::from_static(text.as_bytes())).await.unwrap();
                    return;
                }
                assert!(Instant::now() < end, "the upstream was never asked");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    feed("data: one\n\n").await;
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: one") {
        let n = tokio::time::timeout(BOUND, client.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed early");
        got.extend_from_slice(&buf[..n]);
    }
    tokio::time::sleep(Duration::from_millis(800)).await; // four write timeouts of silence
    feed("data: two\n\n").await;
    while !String::from_utf8_lossy(&got).contains("data: two") {
        let n = tokio::time::timeout(BOUND, client.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "corral cut a stream whose upstream only paused");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
}
