//! The rate-limit report of one bucket: `limit`, `remaining` and `reset`, in OpenAI's
//! `x-ratelimit-*-{requests,tokens}` (Go durations; Azure sends integer seconds), or Anthropic's
//! `anthropic-ratelimit-{requests,tokens}-*` (RFC 3339 instants) family.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName};

use super::hints::{parse_go_duration, parse_rfc3339_from, text};
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
    /// `reset` is rounded up to a whole second (Azure's integer, or an RFC 3339 instant without
    /// a fraction): the true wait is up to a second shorter, so `(limit - remaining) / reset` only
    /// bounds the refill rate from below.
    pub coarse: bool,
    /// `reset` was read from an instant (Anthropic's), against this clock when the answer came:
    /// the upstream counted when the request arrived, so the wait it meant is longer by the
    /// time since (a whole service time for a completed answer).
    pub instant: bool,
    /// How far the instant lay behind this clock when the answer came (zero when ahead, and
    /// for durations): a whole-second instant before the attempt was even sent was truncated,
    /// not rounded up.
    pub past: Duration,
}

/// The reports of both kinds (requests, then tokens). Most answers of an upstream that
/// reports nothing carry a few short names: one pass over them is cheaper than hashing the
/// twelve names [`report`] would look up. The wall clock (`now_wall`) is read only for
/// answers that carry a report.
pub fn reports(headers: &HeaderMap, now_wall: impl FnOnce() -> SystemTime) -> [Option<Report>; 2] {
    let any = headers.keys().any(|name| {
        let name = name.as_str();
        name.starts_with("x-ratelimit-") || name.starts_with("anthropic-ratelimit-")
    });
    if !any {
        return [None, None];
    }
    let now_wall = now_wall();
    [Kind::Requests, Kind::Tokens].map(|kind| report(headers, kind, now_wall))
}

/// Parse the report for `kind` from any provider's header family; `None` when absent or
/// nonsensical (Azure's `-1`, remaining above limit, garbage).
pub fn report(headers: &HeaderMap, kind: Kind, now_wall: SystemTime) -> Option<Report> {
    let get = |name: &HeaderName| text(headers.get(name)?).map(str::trim);
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
    let (limit, remaining, reset, coarse, instant, past) = if let Some(limit) = num(limit_h) {
        let value = get(reset_h);
        let reset = value.and_then(parse_go_duration);
        // Azure's integer seconds are rounded; OpenAI's Go durations ("1s", "6m0s") are exact.
        let coarse =
            reset.is_some() && value.is_some_and(|v| v.bytes().all(|b| b.is_ascii_digit()));
        (
            limit,
            num(remaining_h)?,
            reset,
            coarse,
            false,
            Duration::ZERO,
        )
    } else {
        let value = get(a_reset);
        let read = value.and_then(|v| parse_rfc3339_from(v, now_wall));
        let (reset, past) = (
            read.map(|(ahead, _)| ahead),
            read.map_or(Duration::ZERO, |r| r.1),
        );
        // An instant with a fraction of a second ("...:30.25Z") is as fine as it says.
        let coarse = reset.is_some() && value.is_some_and(|v| !v.contains('.'));
        (num(a_limit)?, num(a_remaining)?, reset, coarse, true, past)
    };
    (limit > 0.0 && remaining <= limit).then_some(Report {
        limit,
        remaining,
        reset,
        coarse,
        instant,
        past,
    })
}

/// The header names of one kind: OpenAI's limit, remaining, reset, then Anthropic's. Made once
/// (a `&str` key is parsed into a name at every lookup, and every answer is read for them).
static REQUESTS: [HeaderName; 6] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
    HeaderName::from_static("anthropic-ratelimit-requests-limit"),
    HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
    HeaderName::from_static("anthropic-ratelimit-requests-reset"),
];
static TOKENS: [HeaderName; 6] = [
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
        assert!(r.coarse, "an instant in whole seconds is rounded");
        let fine = h(&[
            ("anthropic-ratelimit-requests-limit", "1000"),
            ("anthropic-ratelimit-requests-remaining", "999"),
            (
                "anthropic-ratelimit-requests-reset",
                "2025-02-24T22:25:00.250Z",
            ),
        ]);
        let r = report(&fine, Kind::Requests, now).unwrap();
        assert_eq!(r.reset, Some(Duration::from_millis(250)));
        assert!(
            !r.coarse,
            "an instant with a fraction is as fine as it says"
        );
        let openai = h(&[
            ("x-ratelimit-limit-requests", "1000"),
            ("x-ratelimit-remaining-requests", "999"),
            ("x-ratelimit-reset-requests", "60ms"),
        ]);
        assert!(!report(&openai, Kind::Requests, now).unwrap().coarse);
        let exact = h(&[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
        ]);
        let r = report(&exact, Kind::Requests, now).unwrap();
        assert!(!r.coarse, "a Go duration is exact, whole seconds or not");
        let azure = h(&[
            ("x-ratelimit-limit-tokens", "60000"),
            ("x-ratelimit-remaining-tokens", "59000"),
            ("x-ratelimit-reset-tokens", "17"),
        ]);
        let r = report(&azure, Kind::Tokens, now).unwrap();
        assert_eq!(r.reset, Some(Duration::from_secs(17)));
        assert!(r.coarse, "an integer reset is whole seconds");
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

    /// Go writes a duration under a millisecond with a micro sign, which is not visible ASCII:
    /// a token bucket of 2,000,000 a minute that counted 25 tokens reports `728µs`.
    #[test]
    fn a_reset_in_microseconds_is_read() {
        let now = SystemTime::UNIX_EPOCH;
        let tokens = crate::provider::header_map(&[
            ("x-ratelimit-limit-tokens", "2000000"),
            ("x-ratelimit-remaining-tokens", "1999975"),
            ("x-ratelimit-reset-tokens", "728\u{b5}s"),
        ]);
        let r = report(&tokens, Kind::Tokens, now).unwrap();
        assert_eq!(r.reset, Some(Duration::from_micros(728)));
    }
}
