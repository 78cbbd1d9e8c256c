//! Test helpers: an in-process mock upstream (hyper) and corral itself on 127.0.0.1:0; the
//! real binary in [`binary`].
#![allow(dead_code)]

pub mod binary;
pub mod group;
pub mod python;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use corral::body::{self, Body};
use corral::config::{self, Config};
use corral::server::{self, App};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A request as the mock upstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

type Handler =
    Arc<dyn Fn(Seen) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>> + Send + Sync>;

/// An in-process upstream that records what it receives.
pub struct MockUpstream {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub calls: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl MockUpstream {
    pub async fn start<F, Fut>(handler: F) -> Self
    where
        F: Fn(Seen) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response<Body>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |s| Box::pin(handler(s)));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let (seen2, calls2) = (Arc::clone(&seen), Arc::clone(&calls));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (handler, seen, calls) = (
                    Arc::clone(&handler),
                    Arc::clone(&seen2),
                    Arc::clone(&calls2),
                );
                tokio::spawn(async move {
                    let svc =
                        hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                            let (handler, seen, calls) =
                                (Arc::clone(&handler), Arc::clone(&seen), Arc::clone(&calls));
                            async move {
                                calls.fetch_add(1, Ordering::SeqCst);
                                let (parts, body) = req.into_parts();
                                let body = body
                                    .collect()
                                    .await
                                    .map(|c| c.to_bytes())
                                    .unwrap_or_default();
                                let s = Seen {
                                    method: parts.method,
                                    uri: parts.uri,
                                    headers: parts.headers,
                                    body,
                                };
                                seen.lock().unwrap().push(s.clone());
                                Ok::<_, Infallible>(handler(s).await)
                            }
                        });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            seen,
            calls,
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
    pub fn last(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("upstream saw a request")
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A JSON response with `status`.
pub fn json(status: u16, value: serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(body::full(value.to_string()))
        .unwrap()
}

/// An upstream that always answers `status` with `body`, counting its calls.
pub async fn always(status: u16, body: serde_json::Value) -> MockUpstream {
    always_with(status, body, &[]).await
}

/// An upstream that always answers `status` with `body` and `headers`, counting its calls.
pub async fn always_with(
    status: u16,
    body: serde_json::Value,
    headers: &'static [(&'static str, &'static str)],
) -> MockUpstream {
    MockUpstream::start(move |_| {
        let body = body.clone();
        async move {
            let mut response = json(status, body);
            for (name, value) in headers {
                response.headers_mut().insert(*name, value.parse().unwrap());
            }
            response
        }
    })
    .await
}

/// A chat request of 8 prompt characters (2 tokens) and a 100-token budget: 102 tokens, the
/// charge a configured `tpm` takes for it.
pub const CHAT_102_TOKENS: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"max_tokens":100}"#;

/// corral running in-process on 127.0.0.1:0.
pub struct Corral {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Corral {
    /// Start corral on the given TOML (its `listen` is replaced by an ephemeral port).
    pub async fn start(toml: &str) -> Self {
        let config = config::load_str("test.toml", toml).expect("test config is valid");
        Self::start_config(config).await
    }

    pub async fn start_config(config: Config) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = App::new(&config);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server::run(Arc::clone(&app), listener, None, async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            app,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Begin the graceful shutdown, as SIGINT would: no drain delay (`server::run` given
    /// `Signal::Terminate` applies it, as SIGTERM does).
    pub fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for Corral {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// A config fronting `upstream` at `/v1`, plus extra TOML lines for the upstream table.
pub fn one_upstream(upstream: &MockUpstream, extra: &str) -> String {
    format!(
        "drain_timeout = \"5s\"\n[[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"http://{}/v1\"\n{extra}\n",
        upstream.addr
    )
}

pub type TestClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Send a request and collect the whole response.
pub async fn send(
    client: &TestClient,
    req: Request<Full<Bytes>>,
) -> (http::response::Parts, Bytes) {
    let resp = client.request(req).await.expect("corral answered");
    let (parts, body) = resp.into_parts();
    (parts, body.collect().await.expect("body").to_bytes())
}

pub fn get(url: &str) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::new(Bytes::new())).unwrap()
}

pub fn post(url: &str, body: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

/// A mock whose SSE events the test releases one at a time through the returned sender, and a
/// flag set when corral drops the body.
pub async fn sse_upstream() -> (
    MockUpstream,
    Arc<Mutex<Option<tokio::sync::mpsc::Sender<Bytes>>>>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let sender = Arc::new(Mutex::new(None));
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s2, d2) = (Arc::clone(&sender), Arc::clone(&dropped));
    let upstream = MockUpstream::start(move |_| {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        *s2.lock().unwrap() = Some(tx);
        let body = ChannelBody::boxed(rx, Arc::clone(&d2));
        async move {
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap()
        }
    })
    .await;
    (upstream, sender, dropped)
}

/// A response body fed frame by frame from a channel, which flags when the server drops it
/// (the connection to corral closed before the stream ended).
pub struct ChannelBody {
    rx: tokio::sync::mpsc::Receiver<Bytes>,
    dropped: Arc<std::sync::atomic::AtomicBool>,
}

impl ChannelBody {
    /// A boxed body reading from `rx`; `dropped` turns true when it is dropped.
    pub fn boxed(
        rx: tokio::sync::mpsc::Receiver<Bytes>,
        dropped: Arc<std::sync::atomic::AtomicBool>,
    ) -> Body {
        body::boxed(Self { rx, dropped })
    }
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.rx
            .poll_recv(cx)
            .map(|o| o.map(|b| Ok(http_body::Frame::data(b))))
    }
}

impl Drop for ChannelBody {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

/// A `tracing` writer into a shared buffer, for tests that read what corral logged.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Lines logged so far that contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines().filter(|l| l.contains(needle)).count()
    }
}

/// Poll `cond` every 10 ms for up to `limit`.
pub async fn eventually(limit: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < end {
        if cond() {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    cond()
}

// ===== raw sockets: misbehaving clients and upstreams (tests/bounds.rs) =====

/// An h2c (prior knowledge) client.
pub fn h2_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// What a raw exchange came to.
#[derive(Debug)]
pub struct RawReply {
    /// Everything the server sent, lossily decoded.
    pub text: String,
    /// Whether the server closed the connection within the time allowed.
    pub closed: bool,
}

/// Send `request` on a fresh connection to `addr`, then read until the server closes it or
/// `limit` passes; the socket stays open (sending nothing more) meanwhile.
pub async fn raw_exchange(
    addr: SocketAddr,
    request: &[u8],
    limit: std::time::Duration,
) -> RawReply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let end = tokio::time::Instant::now() + limit;
    let closed = loop {
        match tokio::time::timeout_at(end, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => break false,
        }
    };
    RawReply {
        text: String::from_utf8_lossy(&out).into_owned(),
        closed,
    }
}

/// An upstream on a raw socket: reads each connection's request head, writes `response`, then
/// closes the connection (so a `Content-Length` it promised is never met).
pub struct RawUpstream {
    pub addr: SocketAddr,
    pub connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl RawUpstream {
    pub async fn start(response: &'static [u8]) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&connections);
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    // The request, head and body (closing with unread bytes would reset).
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    let whole = |got: &[u8]| {
                        let text = String::from_utf8_lossy(got).to_ascii_lowercase();
                        let Some(end) = text.find("\r\n\r\n") else {
                            return false;
                        };
                        let length = text[..end]
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        got.len() >= end + 4 + length
                    };
                    while !whole(&got) {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = stream.write_all(response).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        Self {
            addr,
            connections,
            task,
        }
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether CI is running these tests (`CI` set to anything but `false`), where nothing may skip.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false")
}

/// Record that a test skips itself for `reason` (a missing tool): a note on stderr and a line in
/// `$CORRAL_SKIP_LOG`, which `.ci/run` counts in its summary. Under CI a skip is a failure.
pub fn skip(test: &str, reason: &str) {
    assert!(
        !under_ci(),
        "{test} would skip ({reason}), and under CI=true nothing may skip"
    );
    eprintln!("skipped: {test}: {reason}");
    if let Ok(path) = std::env::var("CORRAL_SKIP_LOG") {
        use std::io::Write as _;
        let line = format!("{test}: {reason}\n");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        match file {
            Ok(mut f) => f
                .write_all(line.as_bytes())
                .unwrap_or_else(|e| panic!("cannot write the skip log {path}: {e}")),
            Err(e) => panic!("cannot open the skip log {path}: {e}"),
        }
    }
}

/// The answer is the upstream's own JSON `want`, passed through: no `x-corral-error`.
pub fn assert_upstreams_answer(
    parts: &http::response::Parts,
    body: &Bytes,
    want: &serde_json::Value,
) {
    assert!(
        parts
            .headers
            .get(corral::error::CORRAL_ERROR_HEADER)
            .is_none(),
        "corral answered itself: {:?}",
        parts.headers
    );
    let got: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)));
    assert_eq!(&got, want);
}
