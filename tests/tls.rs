//! HTTPS upstreams over real sockets: a test CA and leaf certificates made at test
//! time (rcgen), an upstream served by tokio-rustls and hyper-util's auto builder, corral in
//! front of it. With `tls_ca_file` naming the CA the upstream's answer passes through, over
//! HTTP/2 when the upstream offers it by ALPN and HTTP/1.1 when it does not; with the webpki
//! roots alone, or with a certificate for another host name, corral refuses the certificate
//! (the upstream sees the client's alert, never a request) and answers its own 502; a reload
//! re-reads the file; `check-config` names the file, the key and the reason when it is
//! missing or holds no certificate.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use corral::config;
use http::{Response, Version};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use support::binary::corral_command;
use support::*;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The upstream's answer, compared byte for byte after passing through corral.
const ANSWER: &str = r#"{"id":"chatcmpl-tls","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"over TLS"},"finish_reason":"stop"}]}"#;

const REQUEST: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

// ===== a private CA =====

type Ca = CertifiedIssuer<'static, KeyPair>;

/// A self-signed CA, as a private PKI would have.
fn test_ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

/// A server certificate for `names` (DNS names or IP addresses) signed by `ca`: the chain
/// (leaf, then CA) and the leaf's key.
fn leaf(ca: &Ca, names: &[&str]) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(names)
        .unwrap()
        .signed_by(&key, ca)
        .unwrap();
    let key = PrivatePkcs8KeyDer::from(key.serialize_der()).into();
    (vec![cert.der().clone(), ca.der().clone()], key)
}

// ===== the upstream =====

/// A TLS upstream on 127.0.0.1 that answers every request 200 with [`ANSWER`].
struct TlsUpstream {
    port: u16,
    /// TCP connections accepted.
    connections: Arc<AtomicUsize>,
    /// Each failed handshake's error, as the server saw it (the client's alert).
    refused: Arc<Mutex<Vec<String>>>,
    /// The HTTP version of each request served.
    requests: Arc<Mutex<Vec<Version>>>,
    task: JoinHandle<()>,
}

impl TlsUpstream {
    /// Serve `chain` and `key`, offering `alpn` (e.g. `h2` and `http/1.1`).
    async fn start(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        alpn: &[&[u8]],
    ) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (conns, refs, reqs) = (
            Arc::clone(&connections),
            Arc::clone(&refused),
            Arc::clone(&requests),
        );
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                conns.fetch_add(1, Ordering::SeqCst);
                let (acceptor, refs, reqs) =
                    (acceptor.clone(), Arc::clone(&refs), Arc::clone(&reqs));
                tokio::spawn(async move {
                    let tls = match acceptor.accept(tcp).await {
                        Ok(tls) => tls,
                        Err(e) => return refs.lock().unwrap().push(e.to_string()),
                    };
                    let svc = hyper::service::service_fn(move |req: http::Request<_>| {
                        reqs.lock().unwrap().push(req.version());
                        async {
                            Ok::<_, std::convert::Infallible>(
                                Response::builder()
                                    .header("content-type", "application/json")
                                    .body(Full::new(Bytes::from_static(ANSWER.as_bytes())))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        Self {
            port,
            connections,
            refused,
            requests,
            task,
        }
    }

    fn requests(&self) -> Vec<Version> {
        self.requests.lock().unwrap().clone()
    }
    fn refused(&self) -> Vec<String> {
        self.refused.lock().unwrap().clone()
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ===== corral's config =====

/// A directory of its own under the temp dir, removed on drop: the config and its CA file.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("corral-tls-{}-{n}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `corral.toml` in `dir`: one upstream at `https://localhost:PORT/v1`, with `tls_ca_file =
/// "ca.pem"` (relative: next to the config) when `with_ca`, and no retries, so a refused
/// certificate is answered at once.
fn write_config(dir: &TempDir, port: u16, with_ca: bool) -> PathBuf {
    let ca = if with_ca {
        "tls_ca_file = \"ca.pem\"\n"
    } else {
        ""
    };
    dir.write(
        "corral.toml",
        &format!(
            "drain_timeout = \"5s\"\n\n[[upstream]]\nname = \"private\"\nroute = \"/v1\"\n\
             base_url = \"https://localhost:{port}/v1\"\nconnect_timeout = \"5s\"\n{ca}\n\
             [upstream.retry]\nmax_retries = 0\n"
        ),
    )
}

async fn start_corral(config: &Path) -> Corral {
    Corral::start_config(config::load_file(config).expect("test config is valid")).await
}

/// POST a chat request through corral: status, `x-corral-error`, body.
async fn chat(corral: &Corral) -> (u16, Option<String>, String) {
    let (parts, body) = send(
        &client(),
        post(&corral.url("/v1/chat/completions"), REQUEST),
    )
    .await;
    let marker = parts
        .headers
        .get("x-corral-error")
        .map(|v| v.to_str().unwrap().to_owned());
    (
        parts.status.as_u16(),
        marker,
        String::from_utf8(body.to_vec()).unwrap(),
    )
}

/// corral's own answer to a refused certificate: a 502 `upstream_connect` in OpenAI's shape.
fn assert_refused_by_corral(status: u16, marker: Option<String>, body: &str) {
    assert_eq!(status, 502, "{body}");
    assert_eq!(marker.as_deref(), Some("upstream_connect"));
    let json: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(json["error"]["code"], "upstream_connect", "{body}");
    assert_eq!(
        json["error"]["message"], "connecting to upstream `private` failed",
        "{body}"
    );
}

// ===== the tests =====

/// The private CA in `tls_ca_file`: the request goes through and the answer comes back byte
/// for byte, over HTTP/2 when the upstream offers `h2` by ALPN and HTTP/1.1 when it offers only
/// `http/1.1`.
#[tokio::test]
async fn a_private_ca_in_tls_ca_file_is_trusted_over_http2_and_http1() {
    let ca = test_ca("corral test CA");
    for (alpn, want) in [
        (&[&b"h2"[..], b"http/1.1"][..], Version::HTTP_2),
        (&[&b"http/1.1"[..]][..], Version::HTTP_11),
    ] {
        let (chain, key) = leaf(&ca, &["localhost", "127.0.0.1"]);
        let upstream = TlsUpstream::start(chain, key, alpn).await;
        let dir = TempDir::new("trusted");
        dir.write("ca.pem", &ca.pem());
        let corral = start_corral(&write_config(&dir, upstream.port, true)).await;

        let (status, marker, body) = chat(&corral).await;
        assert_eq!(status, 200, "ALPN {want:?}: {body}");
        assert_eq!(marker, None);
        assert_eq!(body, ANSWER);
        assert_eq!(upstream.requests(), vec![want], "the protocol ALPN chose");
        assert_eq!(upstream.refused(), Vec::<String>::new());
    }
}

/// Without `tls_ca_file` the webpki roots alone do not know the private CA: corral refuses the
/// certificate (the upstream receives an `UnknownCA` alert and no request) and answers 502.
#[tokio::test]
async fn the_webpki_roots_alone_refuse_a_private_ca() {
    let ca = test_ca("corral test CA");
    let (chain, key) = leaf(&ca, &["localhost", "127.0.0.1"]);
    let upstream = TlsUpstream::start(chain, key, &[b"h2", b"http/1.1"]).await;
    let dir = TempDir::new("webpki-only");
    dir.write("ca.pem", &ca.pem()); // There, but not named.
    let corral = start_corral(&write_config(&dir, upstream.port, false)).await;

    assert_refused_at_handshake(&corral, &upstream, "UnknownCA").await;
}

/// corral answered its own 502 after connecting: the upstream refused the handshake with
/// `alert` (as its TLS error names it) and saw no request.
async fn assert_refused_at_handshake(corral: &Corral, upstream: &TlsUpstream, alert: &str) {
    let (status, marker, body) = chat(corral).await;
    assert_refused_by_corral(status, marker, &body);
    assert!(
        upstream.connections.load(Ordering::SeqCst) >= 1,
        "corral connected"
    );
    assert_eq!(upstream.requests(), vec![], "no request past the handshake");
    let refused = upstream.refused();
    assert!(
        !refused.is_empty() && refused.iter().all(|e| e.contains(alert)),
        "{refused:?}"
    );
}

/// A certificate from the trusted CA for another host name than the `base_url`'s is refused:
/// the CA file adds roots, it does not switch off the name check.
#[tokio::test]
async fn a_certificate_for_another_host_is_refused_even_with_the_ca() {
    let ca = test_ca("corral test CA");
    let (chain, key) = leaf(&ca, &["upstream.internal"]);
    let upstream = TlsUpstream::start(chain, key, &[b"h2", b"http/1.1"]).await;
    let dir = TempDir::new("wrong-host");
    dir.write("ca.pem", &ca.pem());
    let corral = start_corral(&write_config(&dir, upstream.port, true)).await;

    // rustls answers a name mismatch with a bad_certificate alert (an unknown issuer would
    // have been UnknownCA).
    assert_refused_at_handshake(&corral, &upstream, "BadCertificate").await;
}

/// The file is read when the config is loaded: a reload that finds new contents at the same
/// path rebuilds the upstream's client with them; one that finds the same contents keeps it.
#[tokio::test]
async fn a_reload_reads_the_ca_file_again() {
    let (old_ca, new_ca) = (test_ca("old CA"), test_ca("new CA"));
    let (chain, key) = leaf(&new_ca, &["localhost", "127.0.0.1"]);
    let upstream = TlsUpstream::start(chain, key, &[b"h2", b"http/1.1"]).await;
    let dir = TempDir::new("reload");
    dir.write("ca.pem", &old_ca.pem());
    let path = write_config(&dir, upstream.port, true);
    let corral = start_corral(&path).await;

    let (status, marker, body) = chat(&corral).await;
    assert_refused_by_corral(status, marker, &body);

    dir.write("ca.pem", &new_ca.pem());
    let summary = corral.app.reload(&config::load_file(&path).unwrap());
    assert_eq!(
        (summary.kept, summary.built),
        (0, 1),
        "new contents, new client"
    );
    let (status, _, body) = chat(&corral).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, ANSWER);

    let summary = corral.app.reload(&config::load_file(&path).unwrap());
    assert_eq!(
        (summary.kept, summary.built),
        (1, 0),
        "same contents, same upstream"
    );
}

/// `corral check-config PATH`, run from `/` (so a relative `tls_ca_file` cannot be found from
/// the working directory): exit code, stdout, stderr.
async fn check_config(config: &Path) -> (Option<i32>, String, String) {
    let out = corral_command(["check-config".as_ref(), config.as_os_str()])
        .current_dir("/")
        .output()
        .await
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (
        out.status.code(),
        text(out.stdout),
        text(out.stderr).trim_end().to_owned(),
    )
}

/// `corral check-config` on a config whose `tls_ca_file` is missing, or holds no certificate
/// (a key, the wrong half of a pair): exit 2, and `file:line: key: reason` with the CA file's
/// path, resolved against the config's directory whatever the working directory.
#[tokio::test]
async fn check_config_names_the_ca_file_the_key_and_the_reason() {
    let dir = TempDir::new("check");
    let config = write_config(&dir, 8443, true);
    let ca = dir.0.join("ca.pem");
    let at = format!("{}:8: upstream[0].tls_ca_file:", config.display());

    let (code, _, stderr) = check_config(&config).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "{at} cannot read `{}`: No such file or directory (os error 2)",
            ca.display()
        )
    );

    dir.write("ca.pem", &KeyPair::generate().unwrap().serialize_pem());
    let (code, _, stderr) = check_config(&config).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "{at} `{}` holds no certificate: expected PEM blocks (`-----BEGIN CERTIFICATE-----`); \
             a DER file must be converted to PEM first",
            ca.display()
        )
    );

    // With the CA there, the effective config names the file as resolved.
    dir.write("ca.pem", &test_ca("corral test CA").pem());
    let (code, stdout, stderr) = check_config(&config).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains(&format!("tls_ca_file = \"{}\"", ca.display())),
        "{stdout}"
    );
}
