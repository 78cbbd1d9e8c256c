//! The rate-limit report of one bucket: `limit`, `remaining` and `reset`, in OpenAI's
//! `x-ratelimit-*-{requests,tokens}` (Go durations; Azure sends integer seconds), or Anthropic's
//! `anthropic-ratelimit-{requests,tokens}-*` (RFC 3339 instants) family.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

use super::hints::{parse_go_duration, parse_rfc3339_until};
use super::Kind;

/// What one response's headers say about one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// The bucket's reported size (a burst, or a per-minute figure: providers differ).
    pub limit: f64,
    /// What was left when the upstream counted this request.
    pub remaining: f64,
    /// Until the bucket is full again, if said.
    pub reset: Option<Duration>,
}

/// Parse the report for `kind` from any provider's header family; `None` when absent or
/// nonsensical (Azure's `-1`, remaining above limit, garbage).
pub fn report(headers: &HeaderMap, kind: Kind, now_wall: SystemTime) -> Option<Report> {
    let get = |name: &HeaderName| headers.get(name)?.to_str().ok().map(str::trim);
    let num = |name: &HeaderName| {
        get(name)?
            .parse::<f64>()
            .ok()
            .filter(|n| n.is_finite() && *n >= 0.0)
    };
    let [limit_h, remaining_h, reset_h, a_limit, a_remaining, a_reset] = match kind {
        Kind::Requests => &REQUESTS,
        Kind::Tokens => &TOKENS,
    };
    let (limit, remaining, reset) = if let Some(limit) = num(limit_h) {
        let reset = get(reset_h).and_then(parse_go_duration);
        (limit, num(remaining_h)?, reset)
    } else {
        let reset = get(a_reset).and_then(|v| parse_rfc3339_until(v, now_wall));
        (num(a_limit)?, num(a_remaining)?, reset)
    };
    (limit > 0.0 && remaining <= limit).then_some(Report {
        limit,
        remaining,
        reset,
    })
}

/// The header names of one kind: OpenAI's limit, remaining, reset, then Anthropic's. Made once
/// (a `&str` key is parsed into a name at every lookup, and every answer is read for them).
const REQUESTS: [HeaderName; 6] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
    HeaderName::from_static("anthropic-ratelimit-requests-limit"),
    HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
    HeaderName::from_static("anthropic-ratelimit-requests-reset"),
];
const TOKENS: [HeaderName; 6] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
    HeaderName::from_static("anthropic-ratelimit-tokens-limit"),
    HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
    HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_shapes_and_garbage() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_740_435_900);
        let h = crate::provider::header_map;
        let anthropic = h(&[
            ("anthropic-ratelimit-requests-limit", "1000"),
            ("anthropic-ratelimit-requests-remaining", "999"),
            ("anthropic-ratelimit-requests-reset", "2025-02-24T22:25:30Z"),
        ]);
        let r = report(&anthropic, Kind::Requests, now).unwrap();
        assert_eq!((r.limit, r.remaining), (1000.0, 999.0));
        assert_eq!(r.reset, Some(Duration::from_secs(30)));
        let azure = h(&[
            ("x-ratelimit-limit-tokens", "60000"),
            ("x-ratelimit-remaining-tokens", "59000"),
            ("x-ratelimit-reset-tokens", "17"),
        ]);
        assert_eq!(
            report(&azure, Kind::Tokens, now).unwrap().reset,
            Some(Duration::from_secs(17))
        );
        for garbage in [
            h(&[
                ("x-ratelimit-limit-requests", "-1"),
                ("x-ratelimit-remaining-requests", "-1"),
            ]),
            h(&[
                ("x-ratelimit-limit-requests", "10"),
                ("x-ratelimit-remaining-requests", "99"),
            ]),
            h(&[
                ("x-ratelimit-limit-requests", "lots"),
                ("x-ratelimit-remaining-requests", "1"),
            ]),
            h(&[
                ("x-ratelimit-limit-requests", "NaN"),
                ("x-ratelimit-remaining-requests", "1"),
            ]),
            HeaderMap::new(),
        ] {
            assert_eq!(report(&garbage, Kind::Requests, now), None, "{garbage:?}");
        }
    }
}
