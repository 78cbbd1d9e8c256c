//! The headers corral removes or rewrites on a message's way through, found in one pass over
//! its names ([`Present::of`]): a lookup or a removal of a header the message does not carry
//! still hashes the name and probes the map, and most messages carry few of these. Headers
//! corral only reads, found the same way: the official SDKs' timeouts in the same pass,
//! [`scan`] for one, [`credential`] for the first credential.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// A header corral removes or rewrites, or reads on every request (the SDKs' timeouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Name {
    Connection,
    KeepAlive,
    ProxyConnection,
    ProxyAuthenticate,
    ProxyAuthorization,
    Te,
    Trailer,
    TransferEncoding,
    Upgrade,
    Host,
    ContentLength,
    Deadline,
    Priority,
    ForwardedFor,
    ReadTimeout,
    Timeout,
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), plus the proxy
/// credentials meant for corral itself, and `Upgrade`; `Connection` first.
pub static HOP_BY_HOP: [(Name, HeaderName); 9] = [
    (Name::Connection, header::CONNECTION),
    (Name::KeepAlive, HeaderName::from_static("keep-alive")),
    (
        Name::ProxyConnection,
        HeaderName::from_static("proxy-connection"),
    ),
    (Name::ProxyAuthenticate, header::PROXY_AUTHENTICATE),
    (Name::ProxyAuthorization, header::PROXY_AUTHORIZATION),
    (Name::Te, header::TE),
    (Name::Trailer, header::TRAILER),
    (Name::TransferEncoding, header::TRANSFER_ENCODING),
    (Name::Upgrade, header::UPGRADE),
];

impl Name {
    /// The [`Name`] a lower-case header name (as a map holds it) is, if any.
    fn of(name: &str) -> Option<Self> {
        Some(match name {
            "connection" => Self::Connection,
            "keep-alive" => Self::KeepAlive,
            "proxy-connection" => Self::ProxyConnection,
            "proxy-authenticate" => Self::ProxyAuthenticate,
            "proxy-authorization" => Self::ProxyAuthorization,
            "te" => Self::Te,
            "trailer" => Self::Trailer,
            "transfer-encoding" => Self::TransferEncoding,
            "upgrade" => Self::Upgrade,
            "host" => Self::Host,
            "content-length" => Self::ContentLength,
            "x-corral-deadline-ms" => Self::Deadline,
            "x-corral-priority" => Self::Priority,
            "x-forwarded-for" => Self::ForwardedFor,
            "x-stainless-read-timeout" => Self::ReadTimeout,
            "x-stainless-timeout" => Self::Timeout,
            _ => return None,
        })
    }

    /// The hop-by-hop header a name in any case (a `Connection` value's) is, if any.
    pub fn hop_by_hop(name: &str) -> Option<Self> {
        HOP_BY_HOP
            .iter()
            .find(|(_, h)| h.as_str().eq_ignore_ascii_case(name))
            .map(|(n, _)| *n)
    }

    const fn bit(self) -> u32 {
        1 << self as u32
    }
}

/// The [`Name`]s a map held when it was looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Present(u32);

impl Present {
    /// One pass over the names of `headers`.
    pub fn of(headers: &HeaderMap) -> Self {
        let bits = headers
            .keys()
            .filter_map(|name| Name::of(name.as_str()))
            .fold(0, |bits, name| bits | name.bit());
        Self(bits)
    }

    pub const fn has(self, name: Name) -> bool {
        self.0 & name.bit() != 0
    }

    /// Whether any of [`HOP_BY_HOP`] was there.
    pub fn any_hop_by_hop(self) -> bool {
        HOP_BY_HOP.iter().any(|(name, _)| self.has(*name))
    }
}

/// The first value of `name` in `headers`, found by a look at each name. For a header most
/// messages do not carry this is cheaper than a lookup, which hashes the name byte by byte
/// whether the map holds it or not, where a message carries a handful of names.
pub fn scan<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a HeaderValue> {
    headers.iter().find_map(|(n, v)| (n == name).then_some(v))
}

/// The value of the first of [`CREDENTIAL_HEADERS`](super::CREDENTIAL_HEADERS) (in their
/// order) that `headers` carry, in one look at each name (see [`scan`]).
pub fn credential(headers: &HeaderMap) -> Option<&HeaderValue> {
    headers
        .iter()
        .filter_map(|(n, v)| credential_rank(n).map(|i| (i, v)))
        .min_by_key(|(i, _)| *i)
        .map(|(_, v)| v)
}

/// Where `name` stands in [`CREDENTIAL_HEADERS`](super::CREDENTIAL_HEADERS), if it is one: a
/// match on the name's text (a length and at most a few bytes for each of a request's names),
/// where looking through the `const` array made and dropped its four names for each one.
fn credential_rank(name: &HeaderName) -> Option<usize> {
    match name.as_str() {
        "authorization" => Some(0),
        "x-api-key" => Some(1),
        "api-key" => Some(2),
        "x-goog-api-key" => Some(3),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::CREDENTIAL_HEADERS;
    use super::*;

    #[test]
    fn every_name_is_found_and_only_those() {
        let names = [
            (Name::Host, "host"),
            (Name::ContentLength, "content-length"),
            (Name::Deadline, "x-corral-deadline-ms"),
            (Name::Priority, "x-corral-priority"),
            (Name::ForwardedFor, "x-forwarded-for"),
            (Name::ReadTimeout, "x-stainless-read-timeout"),
            (Name::Timeout, "x-stainless-timeout"),
        ];
        let every = HOP_BY_HOP
            .iter()
            .map(|(n, h)| (*n, h.as_str()))
            .chain(names);
        for (name, header) in every {
            let mut map = HeaderMap::new();
            map.insert("x-other", "1".parse().unwrap());
            map.insert(HeaderName::from_static(header), "1".parse().unwrap());
            let present = Present::of(&map);
            assert!(present.has(name), "{header}");
            assert_eq!(present.0.count_ones(), 1, "{header}");
            assert_eq!(
                present.any_hop_by_hop(),
                Name::hop_by_hop(header) == Some(name)
            );
        }
        assert_eq!(Name::hop_by_hop("Keep-Alive"), Some(Name::KeepAlive));
        assert_eq!(Name::hop_by_hop("host"), None);
        assert!(!Present::of(&HeaderMap::new()).any_hop_by_hop());
    }

    #[test]
    fn a_credentials_rank_is_its_place_in_the_list() {
        for (i, name) in CREDENTIAL_HEADERS.iter().enumerate() {
            assert_eq!(credential_rank(name), Some(i), "{name}");
        }
        assert_eq!(credential_rank(&http::header::CONTENT_TYPE), None);
        assert_eq!(
            credential_rank(&HeaderName::from_static("x-api-key2")),
            None
        );
    }

    #[test]
    fn a_scan_finds_what_a_lookup_finds() {
        let map = |pairs: &[(&'static str, &'static str)]| -> HeaderMap {
            pairs
                .iter()
                .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
                .collect()
        };
        let h = map(&[
            ("x-api-key", "second"),
            ("content-type", "application/json"),
            ("x-goog-api-key", "fourth"),
            ("authorization", "first"),
            ("authorization", "first again"),
            ("x-stainless-retry-count", "2"),
        ]);
        let lookup = CREDENTIAL_HEADERS.iter().find_map(|c| h.get(c));
        assert_eq!(credential(&h), lookup);
        assert_eq!(credential(&h).unwrap(), "first");
        let mut rest = h.clone();
        rest.remove(header::AUTHORIZATION);
        assert_eq!(credential(&rest).unwrap(), "second");
        assert_eq!(credential(&map(&[("content-type", "a")])), None);
        for name in [
            "x-stainless-retry-count",
            "authorization",
            "content-type",
            "x-none",
        ] {
            let name = HeaderName::from_static(name);
            assert_eq!(scan(&h, &name), h.get(&name), "{name}");
        }
    }
}
