//! The pooled upstream client: hyper-util's legacy `Client` over rustls, HTTP/2 where the
//! upstream offers it by ALPN, HTTP/1.1 otherwise. The innermost service of every stack.
//!
//! Certificates are verified as rustls does it (a chain to a trusted root, valid now, for the
//! host name of the upstream's `base_url`), with the webpki roots (Mozilla's, compiled in, so
//! the same in every container whatever its OS image holds) and, for a backend behind a private
//! CA, the roots of the upstream's `tls_ca_file`. Those are added to the webpki roots, never in
//! their place, and there is no way to turn verification off.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::ACCEPT_ENCODING;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;

use crate::body::{self, Body};
use crate::error::ProxyError;
use crate::forward::{strip_hop_by_hop, ProxyRequest};

type HyperClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

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
    /// parsed by the config loader) beside the webpki roots.
    pub fn new(
        upstream: &str,
        connect_timeout: Duration,
        extra_roots: &[CertificateDer<'static>],
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
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(https);
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
