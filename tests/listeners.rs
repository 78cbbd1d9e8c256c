//! docs/operations.md, Connections and Admin endpoints, the claims `tests/connections.rs` leaves
//! out: a stream that pauses longer than `idle_timeout` is not idle; the HTTP/2 flow-control
//! windows and stream limit corral announces; the connection-cap warning at most every 10 s; the
//! admin listener's own cap of 64; and the admin paths no route may take.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use corral::config;
use corral::server::{self, App};
use http_body_util::BodyExt;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::instrument::WithSubscriber;

/// Longest any single wait in these tests may take.
const BOUND: Duration = Duration::from_secs(10);

/// corral in-process on `toml`, with an admin listener when `admin`; its log captured. The
/// server stops when the returned task is dropped (aborted).
struct Served {
    addr: SocketAddr,
    admin: Option<SocketAddr>,
    log: Captured,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(toml: &str, admin: bool) -> Self {
        let config = config::load_str("test.toml", toml).expect("test config is valid");
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin_listener = match admin {
            true => Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
            false => None,
        };
        let admin = admin_listener.as_ref().map(|l| l.local_addr().unwrap());
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let task = tokio::spawn(
            server::run(
                App::new(&config),
                listener,
                admin_listener,
                std::future::pending::<()>(),
            )
            .with_subscriber(subscriber),
        );
        Self {
            addr,
            admin,
            log,
            task,
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Send one HTTP/1.1 `GET /healthz` on `stream` and read its whole (`ok\n`) answer.
async fn healthz(stream: &mut TcpStream) {
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: corral\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.ends_with(b"ok\n") {
        let n = tokio::time::timeout(BOUND, stream.read(&mut buf))
            .await
            .expect("an answer in time")
            .unwrap();
        assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200"), "{got:?}");
}

/// A connection on which `/healthz` was answered, so corral has surely accepted it.
async fn accepted(addr: SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    healthz(&mut stream).await;
    stream
}

// ===== a paused stream is not idle =====

/// An SSE answer that pauses for five times `idle_timeout` between two events reaches the
/// client whole, over HTTP/1.1 and HTTP/2: a request is in progress until its response body
/// ends, so the connection is not idle meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_pauses_past_the_idle_timeout_is_not_cut() {
    for (protocol, client) in [("HTTP/1.1", client()), ("HTTP/2", h2_client())] {
        let (upstream, sender, _dropped) = sse_upstream().await;
        let corral = Corral::start(&format!(
            "idle_timeout = \"300ms\"\n{}",
            one_upstream(&upstream, "")
        ))
        .await;
        let response = client
            .request(post(&corral.url("/v1/chat/completions"), "{}"))
            .await
            .expect("the stream's head");
        assert_eq!(response.status(), 200, "{protocol}");
        let tx = sender.lock().unwrap().take().expect("the upstream streams");
        let reader =
            tokio::spawn(async move { response.into_body().collect().await.map(|b| b.to_bytes()) });
        tx.send(Bytes::from("data: one\n\n")).await.unwrap();
        // The pause under test: five idle timeouts with nothing on the connection.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        tx.send(Bytes::from("data: two\n\n"))
            .await
            .unwrap_or_else(|_| panic!("{protocol}: corral dropped the paused stream"));
        drop(tx);
        let body = tokio::time::timeout(BOUND, reader)
            .await
            .expect("the stream ended")
            .unwrap()
            .unwrap_or_else(|e| panic!("{protocol}: the stream was cut: {e:?}"));
        assert_eq!(&body[..], b"data: one\n\ndata: two\n\n", "{protocol}");
    }
}

// ===== HTTP/2 flow control =====

/// One HTTP/2 frame: its type, stream and payload.
struct Frame {
    kind: u8,
    stream: u32,
    payload: Vec<u8>,
}

async fn read_frame(stream: &mut TcpStream) -> Frame {
    let mut head = [0u8; 9];
    tokio::time::timeout(BOUND, stream.read_exact(&mut head))
        .await
        .expect("a frame in time")
        .expect("a frame");
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).await.unwrap();
    Frame {
        kind: head[3],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    }
}

/// docs/operations.md: "128 KiB per connection, 64 KiB per stream, at most 100 streams per
/// connection". corral's first SETTINGS announce the stream window and the stream limit; a
/// WINDOW_UPDATE on the connection raises its window from the protocol's 65,535 bytes to 128 KiB.
#[tokio::test]
async fn http2_announces_the_documented_windows_and_stream_limit() {
    let corral = Served::start("", false).await;
    let mut stream = TcpStream::connect(corral.addr).await.unwrap();
    // The client preface and an empty SETTINGS frame.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.unwrap();

    let (mut settings, mut connection_window) = (None, None);
    while settings.is_none() || connection_window.is_none() {
        let frame = read_frame(&mut stream).await;
        match (frame.kind, frame.stream) {
            // SETTINGS, not an ACK (an ACK has no payload).
            (4, 0) if !frame.payload.is_empty() => {
                let entries: Vec<(u16, u32)> = frame
                    .payload
                    .chunks(6)
                    .map(|e| {
                        (
                            u16::from_be_bytes([e[0], e[1]]),
                            u32::from_be_bytes([e[2], e[3], e[4], e[5]]),
                        )
                    })
                    .collect();
                settings = Some(entries);
            }
            (8, 0) => {
                let p = &frame.payload;
                let increment = u32::from_be_bytes([p[0], p[1], p[2], p[3]]) & 0x7fff_ffff;
                connection_window = Some(65_535 + increment);
            }
            _ => {}
        }
    }
    let settings = settings.unwrap();
    let setting = |id: u16| settings.iter().find(|(i, _)| *i == id).map(|(_, v)| *v);
    assert_eq!(
        setting(0x3),
        Some(100),
        "MAX_CONCURRENT_STREAMS: {settings:?}"
    );
    assert_eq!(
        setting(0x4),
        Some(64 << 10),
        "INITIAL_WINDOW_SIZE: {settings:?}"
    );
    assert_eq!(
        connection_window,
        Some(128 << 10),
        "the connection's window"
    );
}

// ===== the connection caps =====

const CAP_WARNING: &str = "connection cap reached";

/// docs/operations.md: at the cap "a warning is logged (at most every 10 s)". The cap (1
/// connection) is reached three times within a second or two: one warning. Reached again more than
/// 10 s after the first: a second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_warning_is_logged_at_most_every_ten_seconds() {
    let corral = Served::start("max_connections = 1\nidle_timeout = \"1m\"", false).await;
    let first = tokio::time::Instant::now();
    for _ in 0..3 {
        // Each is accepted once the one before it has closed: the cap is reached anew.
        let stream = accepted(corral.addr).await;
        assert!(
            eventually(BOUND, || corral.log.count(CAP_WARNING) >= 1).await,
            "no warning at the cap"
        );
        drop(stream);
    }
    // The interval under test: wait until it has passed since the first warning.
    tokio::time::sleep_until(first + Duration::from_millis(10_500)).await;
    assert_eq!(
        corral.log.count(CAP_WARNING),
        1,
        "warned more than once in 10 s"
    );
    let _stream = accepted(corral.addr).await;
    assert!(
        eventually(BOUND, || corral.log.count(CAP_WARNING) == 2).await,
        "no second warning after 10 s"
    );
}

/// docs/operations.md: "The admin listener has its own cap of 64, so probes still get through".
/// With the main listener at its cap (1), the admin listener serves; 64 open admin connections fill
/// its own cap, so a 65th waits (no answer within 1 s) until one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_has_its_own_cap_of_64() {
    let corral = Served::start("max_connections = 1\nidle_timeout = \"1m\"", true).await;
    let admin = corral.admin.unwrap();
    let _main = accepted(corral.addr).await;
    let mut held = Vec::new();
    for _ in 0..64 {
        held.push(accepted(admin).await);
    }
    let mut waiting = TcpStream::connect(admin).await.unwrap();
    waiting
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: corral\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let early = tokio::time::timeout(Duration::from_secs(1), waiting.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "a 65th admin connection was served: {early:?}"
    );
    drop(held.pop());
    let mut got = Vec::new();
    while !got.ends_with(b"ok\n") {
        let n = tokio::time::timeout(BOUND, waiting.read(&mut buf))
            .await
            .expect("served once a slot freed")
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
}

// ===== admin paths =====

/// docs/operations.md: "Without `admin_listen`, no route may be one of these paths": an upstream's
/// or a group's route on `/healthz`, `/readyz`, `/metrics` or `/status` is refused, naming the
/// route; with `admin_listen` set it is allowed, and the main listener forwards the path. A
/// catch-all route `/` does not hide the admin endpoints on the main listener.
#[tokio::test]
async fn the_admin_paths_are_reserved_unless_the_admin_endpoints_move() {
    for path in ["/healthz", "/readyz", "/metrics", "/status"] {
        let upstream = format!(
            "[[upstream]]\nname = \"a\"\nroute = \"{path}\"\nbase_url = \"http://127.0.0.1:9/v1\"\n"
        );
        let err = config::load_str("t.toml", &upstream)
            .expect_err("an admin path as a route")
            .to_string();
        assert!(
            err.contains(&format!("route `{path}` is reserved")),
            "{path}: {err}"
        );
        let grouped = format!(
            "[[upstream]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:9/v1\"\n\
             [[group]]\nname = \"g\"\nroute = \"{path}\"\nmembers = [\"a\"]\n"
        );
        let err = config::load_str("t.toml", &grouped)
            .expect_err("an admin path as a group's route")
            .to_string();
        assert!(
            err.contains(&format!("route `{path}` is reserved")),
            "{path}: {err}"
        );
        let moved = format!("admin_listen = \"127.0.0.1:0\"\n{upstream}");
        assert!(config::load_str("t.toml", &moved).is_ok(), "{path}");
    }

    // With admin_listen, the main listener forwards `/status`.
    let upstream = MockUpstream::start(|seen| async move {
        json(200, serde_json::json!({"path": seen.uri.path()}))
    })
    .await;
    let toml = format!(
        "admin_listen = \"127.0.0.1:0\"\n[[upstream]]\nname = \"s\"\nroute = \"/status\"\nbase_url = \"{}\"\n",
        upstream.url("/up")
    );
    let corral = Served::start(&toml, true).await;
    let (parts, body) = send(&client(), get(&format!("http://{}/status", corral.addr))).await;
    assert_eq!(parts.status, 200);
    assert_eq!(&body[..], br#"{"path":"/up"}"#);

    // A catch-all route does not take the admin paths from the main listener.
    let toml = format!(
        "[[upstream]]\nname = \"all\"\nroute = \"/\"\nbase_url = \"{}\"\n",
        upstream.url("/up")
    );
    let corral = Served::start(&toml, false).await;
    let calls = upstream.calls();
    let (parts, body) = send(&client(), get(&format!("http://{}/healthz", corral.addr))).await;
    assert_eq!((parts.status.as_u16(), &body[..]), (200, &b"ok\n"[..]));
    assert_eq!(upstream.calls(), calls, "/healthz went upstream");
}
