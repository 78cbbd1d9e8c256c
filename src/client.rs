//! The pooled upstream client: hyper-util's legacy `Client` over rustls, HTTP/2 where the
//! upstream offers it by ALPN, HTTP/1.1 otherwise. The innermost service of every stack.
//!
//! Certificates are verified as rustls does it (a chain to a trusted root, valid now, for the
//! host name of the upstream's `base_url`), with the webpki roots (Mozilla's, compiled in, so
//! the same in every container whatever its OS image holds) and, for a backend behind a private
//! CA, the roots of the upstream's `tls_ca_file`. Those are added to the webpki roots, never in
//! their place, and there is no way to turn verification off.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::ACCEPT_ENCODING;
use http::{HeaderMap, HeaderValue, Request, Response, Uri};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;
use tokio::time::Instant;

use crate::body::{self, Body};
use crate::error::ProxyError;
use crate::forward::{strip_hop_by_hop, ProxyRequest};

type HyperClient = Client<Timed<HttpsConnector<HttpConnector>>, Full<Bytes>>;

/// How long this upstream's connections took to open (the TCP handshake, and TLS's where the
/// upstream is `https`; a name's lookup too): before any answer or refusal comes back, the
/// only measure of the network's round trip the pacers have ([`crate::stack::rate_limit::learn`],
/// "silence is consent"). Kept as the slowest recent one, each new one halving what older ones
/// weigh, as the pacers weigh refusals.
#[derive(Debug, Default)]
pub struct Handshakes(AtomicU64);

impl Handshakes {
    /// One connection opened in `took`.
    pub fn record(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some(secs.max(0.5 * f64::from_bits(bits)).to_bits())
            });
    }

    /// The slowest recent handshake, in seconds; `None` before the first connection opened.
    pub fn get(&self) -> Option<f64> {
        let secs = f64::from_bits(self.0.load(Ordering::Relaxed));
        (secs > 0.0).then_some(secs)
    }
}

/// A connector that times each connection it opens into [`Handshakes`]; a failed one teaches
/// nothing.
#[derive(Clone)]
struct Timed<C> {
    inner: C,
    handshakes: Arc<Handshakes>,
}

impl<C> tower::Service<Uri> for Timed<C>
where
    C: tower::Service<Uri>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
    C::Error: Send + 'static,
{
    type Response = C::Response;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (start, handshakes) = (Instant::now(), Arc::clone(&self.handshakes));
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let connected = connecting.await;
            if connected.is_ok() {
                handshakes.record(start.elapsed());
            }
            connected
        })
    }
}

/// Sends one attempt upstream and returns the response head with its body still streaming.
/// A clone (the stack below each layer is cloned per call) is two reference counts: hyper's
/// `Client` clones its connector, pool, executor and timers one by one.
#[derive(Clone)]
pub struct UpstreamClient {
    client: Arc<HyperClient>,
    upstream: Arc<str>,
}

impl UpstreamClient {
    /// The client for upstream `upstream`, trusting `extra_roots` (its `tls_ca_file`, already
    /// parsed by the config loader) beside the webpki roots, timing its connections into
    /// `handshakes`.
    pub fn new(
        upstream: &str,
        connect_timeout: Duration,
        extra_roots: &[CertificateDer<'static>],
        handshakes: Arc<Handshakes>,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect_timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config(extra_roots))
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let timed = Timed {
            inner: https,
            handshakes,
        };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(timed);
        Self {
            client: Arc::new(client),
            upstream: upstream.into(),
        }
    }
}

/// rustls (ring) trusting the webpki roots plus `extra_roots`; no ALPN yet: the connector
/// builder sets h2 and http/1.1.
fn tls_config(extra_roots: &[CertificateDer<'static>]) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    let (_, unparsable) = roots.add_parsable_certificates(extra_roots.iter().cloned());
    // The loader refused the config if any of them did not parse as a trust anchor.
    debug_assert_eq!(
        unparsable, 0,
        "tls_ca_file certificates are checked at load"
    );
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring offers TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

impl UpstreamClient {
    /// Send one attempt: the response head, its body still streaming (the innermost step of
    /// every stack: `stack::layer::Next` for this client).
    pub fn send(
        &self,
        req: ProxyRequest,
    ) -> impl Future<Output = Result<Response<Body>, ProxyError>> + Send + '_ {
        let target = &*req.target;
        let mut out = Request::new(Full::new(target.body.clone()));
        *out.method_mut() = target.method.clone();
        *out.uri_mut() = target.uri.clone();
        // The one copy of the headers an attempt costs: the retry layer holds them for the next.
        *out.headers_mut() = HeaderMap::clone(&req.headers);
        // Any attempt's answer may be a 429 or a 5xx whose body corral reads (a quota, a named
        // wait), and a success's `usage` settles its token charge: a compressed body would hide
        // them. The upstream is asked for the body as it is; the client gets it so, its
        // headers still describing it.
        out.headers_mut()
            .insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        let fut = self.client.request(out);
        async move {
            match fut.await {
                Ok(response) => {
                    let (mut parts, incoming) = response.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    Ok(Response::from_parts(parts, body::boxed(incoming)))
                }
                Err(e) => {
                    let reason = error_chain(&e);
                    let upstream = self.upstream.to_string();
                    Err(if e.is_connect() {
                        ProxyError::UpstreamConnect { upstream, reason }
                    } else {
                        ProxyError::UpstreamReset { upstream, reason }
                    })
                }
            }
        }
    }
}

/// An error and its sources on one line.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshakes_keep_the_slowest_recent_one() {
        let h = Handshakes::default();
        assert_eq!(h.get(), None, "no connection yet");
        h.record(Duration::from_millis(40));
        assert_eq!(h.get(), Some(0.04));
        // A fast one halves what the slow one weighs.
        h.record(Duration::from_millis(1));
        assert_eq!(h.get(), Some(0.02));
        h.record(Duration::from_millis(50));
        assert_eq!(h.get(), Some(0.05));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_timed_and_a_failed_one_is_not() {
        let handshakes = Arc::new(Handshakes::default());
        let connect = |took: Duration, ok: bool| Timed {
            inner: tower::service_fn(move |_: Uri| async move {
                tokio::time::sleep(took).await;
                if ok {
                    Ok(())
                } else {
                    Err("refused")
                }
            }),
            handshakes: Arc::clone(&handshakes),
        };
        let uri = Uri::from_static("http://127.0.0.1:1");
        let mut failing = connect(Duration::from_millis(7), false);
        assert!(tower::Service::call(&mut failing, uri.clone())
            .await
            .is_err());
        assert_eq!(handshakes.get(), None);
        let mut opening = connect(Duration::from_millis(30), true);
        tower::Service::call(&mut opening, uri).await.unwrap();
        assert_eq!(handshakes.get(), Some(0.03));
    }
}
