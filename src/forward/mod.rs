//! Turning a client's request into the request corral sends upstream: hop-by-hop headers
//! stripped, Host left to the client (rewritten from the upstream URL), `x-forwarded-for`
//! appended, configured headers injected, and the body buffered (within its bounds, see
//! [`buffer`]) as [`Bytes`] so every retry can replay it.
//!
//! The clocks of one exchange start when the request arrives: the [`deadline`] bounds reading
//! the request body as well as the wait for the response head, and a client's
//! `x-corral-deadline-ms` bounds the streamed response body too ([`time_response`]).

mod asks;
pub mod buffer;
mod names;

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Uri};
use tokio::time::Instant;

pub use self::asks::{Asks, Deadlines, DEADLINE_HEADER, PRIORITY_HEADER};
pub use self::names::{credential, scan};
use self::names::{Name, Present, HOP_BY_HOP};
use crate::body::{Body, Timed, TimeoutKind};
use crate::config::HeaderMode;

/// The methods corral forwards (any other is refused with a 405), as the `method` label names
/// them; `None` for any other.
pub fn proxied_method(method: &Method) -> Option<&'static str> {
    Some(match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        _ => return None,
    })
}

/// A request on its way upstream; two pointers, cheap to clone for each attempt and to move
/// down the stack (everything is shared: the client copies the headers once into the request
/// it sends).
#[derive(Clone, Debug)]
pub struct ProxyRequest {
    /// What every attempt sends alike, and what the layers learn of the request.
    pub target: Arc<Target>,
    /// Apart from the rest: a key pool changes them per attempt.
    pub headers: Arc<HeaderMap>,
}

impl ProxyRequest {
    /// What the layers learn about the request and tell each other.
    pub fn ctx(&self) -> &RequestCtx {
        &self.target.ctx
    }
}

/// The method, upstream URI and body of a [`ProxyRequest`], and its [`RequestCtx`] (one
/// allocation for both: they live as long as the request).
#[derive(Debug)]
pub struct Target {
    pub method: Method,
    pub uri: Uri,
    pub body: Bytes,
    pub ctx: RequestCtx,
}

#[cfg(test)]
impl ProxyRequest {
    /// A POST to `uri` with no headers or body, due within `deadline` from now.
    pub fn for_test(uri: &str, deadline: Duration) -> Self {
        let now = Instant::now();
        Self {
            target: Arc::new(Target {
                method: Method::POST,
                uri: uri.parse().expect("a test URI"),
                body: Bytes::new(),
                ctx: RequestCtx::new(now, now + deadline),
            }),
            headers: Arc::default(),
        }
    }
}

/// What the layers learn about a request and tell each other, shared by all its attempts.
#[derive(Debug)]
pub struct RequestCtx {
    /// When corral received the request.
    pub start: Instant,
    /// When corral stops trying and answers with what it has.
    pub deadline: Instant,
    /// How long the request may wait for capacity (a concurrency slot, rate-limit tokens, the
    /// breaker): the deadline, or sooner for a group member that has a next one to fall back to.
    pub wait_deadline: Instant,
    /// Which waiting requests go first (see [`crate::config::Priority`]).
    pub priority: crate::config::Priority,
    /// Attempts sent upstream so far.
    attempts: AtomicU32,
    /// When the request entered its upstream's stack, in microseconds after `start` (the body
    /// has been read by then).
    entered: AtomicU64,
    /// When its first attempt went out, past every gate, in microseconds after `start`;
    /// [`NOT_SENT`] until then.
    first_sent: AtomicU64,
    /// Whether an attempt may have been acted on upstream (see [`RequestCtx::may_have_reached`]).
    reached: AtomicBool,
}

/// [`RequestCtx::first_sent`] before the first attempt.
const NOT_SENT: u64 = u64::MAX;

impl RequestCtx {
    pub fn new(start: Instant, deadline: Instant) -> Self {
        Self {
            start,
            deadline,
            wait_deadline: deadline,
            priority: crate::config::Priority::Interactive,
            attempts: AtomicU32::new(0),
            entered: AtomicU64::new(0),
            first_sent: AtomicU64::new(NOT_SENT),
            reached: AtomicBool::new(false),
        }
    }
    pub fn attempts(&self) -> u32 {
        self.attempts.load(Ordering::Relaxed)
    }
    pub fn count_attempt(&self) -> u32 {
        self.attempts.fetch_add(1, Ordering::Relaxed) + 1
    }
    /// Micros from `start` to `at`.
    fn offset(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.start).as_micros() as u64
    }
    /// The request enters its upstream's stack at `at` (the stack's outermost layer says so).
    pub fn entered_stack(&self, at: Instant) {
        self.entered.store(self.offset(at), Ordering::Relaxed);
    }
    /// The first attempt leaves for the upstream at `at`, past every gate (the innermost layer
    /// says so).
    pub fn first_attempt_sent(&self, at: Instant) {
        self.first_sent.store(self.offset(at), Ordering::Relaxed);
    }
    /// When the first attempt went out, past every gate (`None` before).
    pub fn first_sent_at(&self) -> Option<Instant> {
        match self.first_sent.load(Ordering::Relaxed) {
            NOT_SENT => None,
            sent => Some(self.start + Duration::from_micros(sent)),
        }
    }
    /// Time corral held the request in its upstream's stack before the first attempt went out:
    /// the concurrency queue, the breaker, the rate limiter. For a request that never made an
    /// attempt (refused, or given up while held), its whole time in the stack until `now()`,
    /// which is called only then.
    pub fn held_until(&self, now: impl FnOnce() -> Instant) -> Duration {
        let sent = match self.first_sent.load(Ordering::Relaxed) {
            NOT_SENT => self.offset(now()),
            sent => sent,
        };
        Duration::from_micros(sent.saturating_sub(self.entered.load(Ordering::Relaxed)))
    }
    /// An attempt ended in a way that may mean the upstream acted on it: anything but a failed
    /// connect or a 429 (the innermost layer says so).
    pub fn reached_upstream(&self) {
        self.reached.store(true, Ordering::Relaxed);
    }
    /// Whether any attempt may have been acted on upstream; `false` means none certainly was
    /// (every one refused by corral, never connected, or answered 429), so sending the request
    /// elsewhere cannot do its work twice.
    pub fn may_have_reached(&self) -> bool {
        self.reached.load(Ordering::Relaxed)
    }
}

/// The headers that carry a credential to an LLM API: `Authorization` (OpenAI and most others),
/// `x-api-key` (Anthropic), `api-key` (Azure OpenAI), `x-goog-api-key` (Gemini). The first a
/// request carries keys its rate-limit partition and its fleet bucket, in this order.
pub static CREDENTIAL_HEADERS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-goog-api-key"),
];

/// Headers a member may inject that name an API's version or features, never a secret: the
/// client's own still reach every member (an Anthropic member answers 400 without
/// `anthropic-version`).
static PROTOCOL_HEADERS: [HeaderName; 3] = [
    HeaderName::from_static("anthropic-version"),
    HeaderName::from_static("anthropic-beta"),
    HeaderName::from_static("openai-beta"),
];

/// The client's headers an upstream does not receive, so that no credential meant for one
/// backend reaches another. An upstream that injects a credential (`credential`: it injects one
/// of [`CREDENTIAL_HEADERS`], or has a key pool) receives none of the client's credential
/// headers and none of `also` (what the other members of its group inject), except those it
/// injects itself (`own`), where `header_mode` decides. One that injects none receives the
/// client's.
pub fn withheld(own: &[HeaderName], credential: bool, also: &[HeaderName]) -> Vec<HeaderName> {
    if !credential {
        return Vec::new();
    }
    let mut withheld: Vec<HeaderName> = CREDENTIAL_HEADERS
        .iter()
        .chain(also.iter().filter(|h| !PROTOCOL_HEADERS.contains(h)))
        .filter(|name| !own.contains(name))
        .cloned()
        .collect();
    withheld.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    withheld.dedup();
    withheld
}

/// Remove hop-by-hop headers, including any the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_present(headers, Present::of(headers));
}

/// [`strip_hop_by_hop`] with the map's names already looked at (`present`): only the headers
/// it holds are removed, since each removal would hash its name whether the map holds it or not.
fn strip_present(headers: &mut HeaderMap, present: Present) {
    if !present.any_hop_by_hop() {
        return;
    }
    // The `Connection` values are moved out first (no copy, no allocation for the usual one
    // value), so the names they list can be removed by reference: a name that is not a valid
    // header name is in no map, and removing it does nothing. A hop-by-hop name is left to the
    // loop below, which removes it if the map holds it (`Connection: keep-alive` alone: nothing).
    if present.has(Name::Connection) {
        if let header::Entry::Occupied(connection) = headers.entry(header::CONNECTION) {
            let mut values = connection.remove_entry_mult().1;
            let first = values.next();
            let rest: Vec<HeaderValue> = values.collect();
            for name in first
                .iter()
                .chain(&rest)
                // The usual value names only a hop-by-hop header: nothing to split.
                .filter(|v| !v.as_bytes().eq_ignore_ascii_case(b"keep-alive"))
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .map(str::trim)
                .filter(|name| Name::hop_by_hop(name).is_none())
            {
                headers.remove(name);
            }
        }
    }
    // `Connection` itself is gone by now.
    for (name, header) in HOP_BY_HOP.iter().skip(1) {
        if present.has(*name) {
            headers.remove(header);
        }
    }
}

/// Rewrite the client's headers for the upstream: `withheld` (see [`withheld`]) removed,
/// `inject` added by `mode`.
pub fn upstream_headers(
    mut headers: HeaderMap,
    peer: IpAddr,
    inject: &[(HeaderName, HeaderValue)],
    mode: HeaderMode,
    withheld: &[HeaderName],
    body_len: usize,
) -> HeaderMap {
    // One look at the names: the removals and lookups below skip what the client did not send
    // (a name removed since, as a `Connection` value, is only removed or looked up for nothing).
    let present = Present::of(&headers);
    strip_present(&mut headers, present);
    for name in withheld {
        headers.remove(name);
    }
    if present.has(Name::Host) {
        headers.remove(header::HOST);
    }
    // The client's length stays when it states the bytes corral sends (hyper would otherwise
    // write a new value for every attempt); any other is dropped and hyper writes the body's.
    // Exactly one value, digits only (an HTTP/2 client may repeat the field).
    if present.has(Name::ContentLength) {
        let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
        let states_body = match (lengths.next(), lengths.next()) {
            (Some(v), None) => {
                v.as_bytes().iter().all(u8::is_ascii_digit)
                    && v.to_str().ok().and_then(|v| v.parse::<usize>().ok()) == Some(body_len)
            }
            _ => false,
        };
        if !states_body {
            headers.remove(header::CONTENT_LENGTH);
        }
    }
    if present.has(Name::Deadline) {
        headers.remove(DEADLINE_HEADER);
    }
    if present.has(Name::Priority) {
        headers.remove(PRIORITY_HEADER);
    }
    const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    let prior = present
        .has(Name::ForwardedFor)
        .then(|| headers.get(X_FORWARDED_FOR))
        .flatten();
    let forwarded = match prior.and_then(|v| v.to_str().ok()) {
        Some(prior) if !prior.trim().is_empty() => {
            HeaderValue::try_from(format!("{prior}, {peer}")).ok()
        }
        _ => Some(forwarded_for(peer)),
    };
    if let Some(value) = forwarded {
        headers.insert(X_FORWARDED_FOR, value);
    }
    for (name, value) in inject {
        if mode == HeaderMode::Always || !headers.contains_key(name) {
            headers.insert(name.clone(), value.clone());
        }
    }
    headers
}

/// `peer` as an `X-Forwarded-For` value. Each worker thread keeps the last one it made: a
/// sidecar's clients share one address, and a clone of a kept value is a reference count
/// where a new one is two allocations.
fn forwarded_for(peer: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: std::cell::RefCell<Option<(IpAddr, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((ip, value)) if *ip == peer => value.clone(),
        _ => {
            let value = HeaderValue::try_from(peer.to_string())
                .expect("an IP address is a valid header value");
            *last = Some((peer, value.clone()));
            value
        }
    })
}

/// An injected header's value, made once per upstream and marked sensitive (kept out of debug
/// output and from HPACK's index); `None` for a value no header can carry.
pub fn injected_value(value: &str) -> Option<HeaderValue> {
    let mut value = HeaderValue::from_str(value).ok()?;
    value.set_sensitive(true);
    Some(value)
}

/// The response body on its way to the client, cut (abruptly) when the upstream pauses longer
/// than `idle` or the client's deadline passes; `on_timeout` counts it.
pub fn time_response<B>(
    body: B,
    idle: Duration,
    deadlines: Deadlines,
    on_timeout: impl FnOnce(TimeoutKind) + Send + 'static,
) -> Body
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<crate::body::BoxError>,
{
    crate::body::boxed(Timed::new(body, idle, deadlines.exchange, on_timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header map of `pairs`, in order (the `asks` tests' too).
    pub(super) fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_headers() {
        let h = map(&[
            ("connection", "close, x-private"),
            ("x-private", "1"),
            // A second `Connection` line, its name in another case.
            ("connection", " X-Other "),
            ("x-other", "2"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("host", "127.0.0.1:8080"),
            ("authorization", "Bearer k"),
        ]);
        let out = upstream_headers(h, [10, 0, 0, 1].into(), &[], HeaderMode::IfAbsent, &[], 0);
        for gone in [
            "connection",
            "x-private",
            "x-other",
            "keep-alive",
            "transfer-encoding",
            "upgrade",
            "host",
        ] {
            assert!(!out.contains_key(gone), "{gone} survived");
        }
        assert_eq!(out["authorization"], "Bearer k");
        assert_eq!(out["x-forwarded-for"], "10.0.0.1");
    }

    #[test]
    fn a_hop_by_hop_header_connection_names_in_another_case_goes_too() {
        let mut h = map(&[
            ("connection", "Keep-Alive, TE"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("x-kept", "1"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h, map(&[("x-kept", "1")]));
        let mut alone = map(&[("connection", "keep-alive"), ("x-kept", "1")]);
        strip_hop_by_hop(&mut alone);
        assert_eq!(alone, map(&[("x-kept", "1")]));
    }

    #[test]
    fn the_clients_length_stays_only_when_it_states_the_body_sent() {
        let h = map(&[("content-length", "17")]);
        let out = |len| {
            upstream_headers(
                h.clone(),
                [127, 0, 0, 1].into(),
                &[],
                HeaderMode::IfAbsent,
                &[],
                len,
            )
        };
        assert_eq!(out(17)["content-length"], "17");
        for len in [0, 16, 170] {
            assert!(!out(len).contains_key("content-length"), "{len}");
        }
        // A list, a sign, or the field twice (HTTP/2 lets a client repeat it): hyper writes one.
        for junk in [
            map(&[("content-length", "17, 17")]),
            map(&[("content-length", "+17")]),
            map(&[("content-length", "17"), ("content-length", "17")]),
        ] {
            let out = upstream_headers(
                junk,
                [127, 0, 0, 1].into(),
                &[],
                HeaderMode::IfAbsent,
                &[],
                17,
            );
            assert!(!out.contains_key("content-length"));
        }
    }

    #[test]
    fn each_peer_gets_its_own_forwarded_for_whatever_came_before() {
        let of = |peer: [u8; 4]| {
            let out = upstream_headers(
                HeaderMap::new(),
                peer.into(),
                &[],
                HeaderMode::IfAbsent,
                &[],
                0,
            );
            out["x-forwarded-for"].to_str().unwrap().to_owned()
        };
        for (peer, want) in [
            ([10, 0, 0, 1], "10.0.0.1"),
            ([10, 0, 0, 1], "10.0.0.1"),
            ([10, 0, 0, 2], "10.0.0.2"),
            ([10, 0, 0, 1], "10.0.0.1"),
        ] {
            assert_eq!(of(peer), want);
        }
    }

    #[test]
    fn appends_forwarded_for_and_injects_by_mode() {
        let inject = [(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer corral"),
        )];
        let h = map(&[
            ("x-forwarded-for", "1.2.3.4"),
            ("authorization", "Bearer client"),
        ]);
        let kept = upstream_headers(
            h.clone(),
            [127, 0, 0, 1].into(),
            &inject,
            HeaderMode::IfAbsent,
            &[],
            0,
        );
        assert_eq!(kept["x-forwarded-for"], "1.2.3.4, 127.0.0.1");
        assert_eq!(kept["authorization"], "Bearer client");
        let forced = upstream_headers(
            h,
            [127, 0, 0, 1].into(),
            &inject,
            HeaderMode::Always,
            &[],
            0,
        );
        assert_eq!(forced["authorization"], "Bearer corral");
        let added = upstream_headers(
            HeaderMap::new(),
            [127, 0, 0, 1].into(),
            &inject,
            HeaderMode::IfAbsent,
            &[],
            0,
        );
        assert_eq!(added["authorization"], "Bearer corral");
    }

    #[test]
    fn an_upstream_injecting_a_credential_withholds_the_clients_others() {
        let names = |v: Vec<HeaderName>| -> Vec<String> {
            v.iter().map(|h| h.as_str().to_owned()).collect()
        };
        let api_key = HeaderName::from_static("api-key");
        let org = HeaderName::from_static("openai-organization");
        assert_eq!(
            names(withheld(
                std::slice::from_ref(&api_key),
                true,
                &[api_key.clone(), org.clone()]
            )),
            [
                "authorization",
                "openai-organization",
                "x-api-key",
                "x-goog-api-key"
            ]
        );
        assert!(withheld(
            std::slice::from_ref(&org),
            false,
            std::slice::from_ref(&api_key)
        )
        .is_empty());
        // What another member injects to name an API version is no secret: the client's stays.
        let version = HeaderName::from_static("anthropic-version");
        assert!(!withheld(&[], true, &[version, api_key.clone()])
            .iter()
            .any(|h| h == "anthropic-version"));
        let h = map(&[("authorization", "Bearer client"), ("api-key", "client")]);
        let inject = [(
            HeaderName::from_static("api-key"),
            HeaderValue::from_static("corral"),
        )];
        let withheld = withheld(&[inject[0].0.clone()], true, &[]);
        let out = upstream_headers(
            h,
            [127, 0, 0, 1].into(),
            &inject,
            HeaderMode::IfAbsent,
            &withheld,
            0,
        );
        assert!(!out.contains_key("authorization"));
        assert_eq!(
            out["api-key"], "client",
            "its own header follows `header_mode`"
        );
    }

    #[test]
    fn the_allow_header_lists_the_proxied_methods() {
        let listed: Vec<Method> = crate::error::ALLOWED_METHODS
            .split(", ")
            .map(|m| m.parse().unwrap())
            .collect();
        assert_eq!(listed.len(), 7);
        for m in &listed {
            assert_eq!(proxied_method(m), Some(m.as_str()));
        }
        for m in ["TRACE", "CONNECT", "BREW", "get"] {
            assert_eq!(proxied_method(&m.parse().unwrap()), None, "{m}");
        }
    }
}
