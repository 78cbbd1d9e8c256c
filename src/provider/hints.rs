//! Server retry hints: pure parsers, each capped at [`MAX_HINT`] and never negative.
//!
//! Read in this order: `retry-after-ms` (what the SDKs read first), `x-ms-retry-after-ms`
//! (Azure's, finer than the `retry-after` beside it), `retry-after` (delta seconds, fractional
//! allowed, or an HTTP-date); failing those, the reset
//! of the exhausted bucket: OpenAI's `x-ratelimit-reset-{requests,tokens}` (Go durations such as
//! "1s", "6m0s", "20ms", "1h2m3.5s"; Azure sends integer seconds) and Anthropic's
//! `anthropic-ratelimit-*-reset` (RFC 3339 instants).

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue};

/// No hint is believed beyond this.
pub const MAX_HINT: Duration = Duration::from_secs(24 * 3600);

fn capped(secs: f64) -> Option<Duration> {
    (secs.is_finite() && secs >= 0.0)
        .then(|| Duration::from_secs_f64(secs.min(MAX_HINT.as_secs_f64())))
}

/// `retry-after`: delta-seconds (fractions tolerated) or an HTTP-date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<f64>() {
        return capped(secs);
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_HINT),
    )
}

/// `retry-after-ms`: float milliseconds.
pub fn parse_millis(value: &str) -> Option<Duration> {
    capped(value.trim().parse::<f64>().ok()? / 1000.0)
}

/// A Go `time.Duration` string ("1h2m3.5s", "6m0s", "12ms", "1.5µs"), or plain seconds ("17",
/// as Azure sends).
pub fn parse_go_duration(value: &str) -> Option<Duration> {
    let s = value.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(secs) = s.parse::<f64>() {
        return capped(secs);
    }
    let mut total = 0.0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" | "μs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    capped(total)
}

/// An RFC 3339 instant, as time from `now` (zero if already past).
pub fn parse_rfc3339_until(value: &str, now: SystemTime) -> Option<Duration> {
    parse_rfc3339_from(value, now).map(|(ahead, _)| ahead)
}

/// An RFC 3339 instant against `now`: how far ahead of it (capped at [`MAX_HINT`]), and how
/// far behind it (each zero when the other is not).
pub fn parse_rfc3339_from(value: &str, now: SystemTime) -> Option<(Duration, Duration)> {
    let at = humantime::parse_rfc3339_weak(value.trim().trim_end_matches('Z'))
        .or_else(|_| humantime::parse_rfc3339(value.trim()))
        .ok()?;
    Some(match at.duration_since(now) {
        Ok(ahead) => (ahead.min(MAX_HINT), Duration::ZERO),
        Err(e) => (Duration::ZERO, e.duration()),
    })
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    text(headers.get(name)?)
}

/// A header's value as text. UTF-8, not only visible ASCII as `to_str` takes: Go formats a
/// duration under a millisecond with a micro sign (`728µs`), and OpenAI's resets are Go
/// durations, so a token bucket refilled in under a millisecond reported no reset at all.
pub fn text(value: &HeaderValue) -> Option<&str> {
    std::str::from_utf8(value.as_bytes()).ok()
}

/// The wait the upstream asks for before the next attempt, if it says.
pub fn retry_hint(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    explicit_hint(headers, now).or_else(|| reset_hint(headers, now))
}

/// The wait the upstream names outright, the finest first: `retry-after-ms`,
/// `x-ms-retry-after-ms` (Azure's, beside a `retry-after` rounded up to whole seconds: waiting
/// for the rounded one costs up to a second on a bucket that refills in milliseconds), then
/// `retry-after` (not a bucket's reset, which is the time until it is *full*).
pub fn explicit_hint(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    header(headers, "retry-after-ms")
        .and_then(parse_millis)
        .or_else(|| header(headers, "x-ms-retry-after-ms").and_then(parse_millis))
        .or_else(|| header(headers, "retry-after").and_then(|v| parse_retry_after(v, now)))
}

/// Whether the wait the headers name is `retry-after` alone, in whole seconds (Anthropic's): rounded
/// up, it may outlast by most of a second a bucket that refills in milliseconds.
pub fn whole_seconds_only(headers: &HeaderMap) -> bool {
    header(headers, "retry-after-ms").is_none()
        && header(headers, "x-ms-retry-after-ms").is_none()
        && header(headers, "retry-after").is_some_and(|v| v.trim().parse::<u64>().is_ok())
}

/// The later reset among the buckets reported exhausted (0 left; Azure's `-1` means unknown,
/// not empty); the earliest reset if none says.
pub fn reset_hint(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let (exhausted, any) = resets(headers, now);
    exhausted.or(any)
}

/// The later reset among the buckets reported exhausted, and none if none is: the wait the
/// upstream's report implies (a bucket with room says nothing about when to come back).
pub fn exhausted_reset(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    resets(headers, now).0
}

/// The later reset among exhausted buckets, and the earliest reset of any.
fn resets(headers: &HeaderMap, now: SystemTime) -> (Option<Duration>, Option<Duration>) {
    let mut exhausted: Option<Duration> = None;
    let mut any: Option<Duration> = None;
    let mut consider = |remaining: Option<&str>, reset: Option<Duration>| {
        let Some(reset) = reset else { return };
        any = Some(any.map_or(reset, |a| a.min(reset)));
        if remaining
            .and_then(|r| r.trim().parse::<f64>().ok())
            .is_some_and(|r| (0.0..1.0).contains(&r))
        {
            exhausted = Some(exhausted.map_or(reset, |e| e.max(reset)));
        }
    };
    for kind in ["requests", "tokens"] {
        consider(
            header(headers, &format!("x-ratelimit-remaining-{kind}")),
            header(headers, &format!("x-ratelimit-reset-{kind}")).and_then(parse_go_duration),
        );
    }
    for kind in ["requests", "tokens", "input-tokens", "output-tokens"] {
        consider(
            header(headers, &format!("anthropic-ratelimit-{kind}-remaining")),
            header(headers, &format!("anthropic-ratelimit-{kind}-reset"))
                .and_then(|v| parse_rfc3339_until(v, now)),
        );
    }
    (exhausted, any)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn go_durations() {
        let table = [
            ("1s", Some(ms(1000))),
            ("6m0s", Some(ms(360_000))),
            ("20ms", Some(ms(20))),
            ("1h2m3.5s", Some(ms(3_723_500))),
            ("2m59.56s", Some(ms(179_560))),
            ("7.66s", Some(ms(7660))),
            ("17", Some(ms(17_000))),
            ("1.5us", Some(Duration::from_nanos(1500))),
            ("", None),
            ("s", None),
            ("5x", None),
            ("-1s", None),
            ("99999h", Some(MAX_HINT)),
        ];
        for (input, want) in table {
            assert_eq!(parse_go_duration(input), want, "{input:?}");
        }
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("30", now), Some(ms(30_000)));
        assert_eq!(parse_retry_after("1.5", now), Some(ms(1500)));
        assert_eq!(parse_retry_after("-3", now), None);
        let later = httpdate::fmt_http_date(now + Duration::from_secs(12));
        assert_eq!(parse_retry_after(&later, now), Some(ms(12_000)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(12));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_millis("250.5"), Some(Duration::from_micros(250_500)));
        assert_eq!(parse_millis("NaN"), None);
    }

    #[test]
    fn rfc3339_resets() {
        let now = humantime::parse_rfc3339("2025-02-24T22:25:00Z").unwrap();
        assert_eq!(
            parse_rfc3339_until("2025-02-24T22:25:30Z", now),
            Some(ms(30_000))
        );
        assert_eq!(
            parse_rfc3339_until("2025-02-24T22:24:30Z", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_rfc3339_until("yesterday", now), None);
    }

    #[test]
    fn hint_precedence_and_exhausted_bucket() {
        let now = SystemTime::now();
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
        h.insert("x-ratelimit-reset-requests", "2s".parse().unwrap());
        h.insert("x-ratelimit-remaining-tokens", "5000".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "6m0s".parse().unwrap());
        assert_eq!(
            retry_hint(&h, now),
            Some(ms(2000)),
            "the exhausted bucket's reset, not the longest"
        );
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(retry_hint(&h, now), Some(ms(7000)));
        h.insert("retry-after-ms", "6500".parse().unwrap());
        assert_eq!(retry_hint(&h, now), Some(ms(6500)));
        assert_eq!(retry_hint(&HeaderMap::new(), now), None);
    }

    #[test]
    fn an_unknown_remaining_is_not_an_empty_bucket() {
        // Azure reports `-1` when it does not know: the earliest reset, as with no report.
        let now = SystemTime::now();
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining-requests", "-1".parse().unwrap());
        h.insert("x-ratelimit-reset-requests", "30".parse().unwrap());
        h.insert("x-ratelimit-remaining-tokens", "-1".parse().unwrap());
        h.insert("x-ratelimit-reset-tokens", "5".parse().unwrap());
        assert_eq!(reset_hint(&h, now), Some(ms(5000)));
    }

    proptest! {
        #[test]
        fn parsers_never_panic_nor_exceed_the_cap(s in "\\PC{0,40}") {
            let now = SystemTime::now();
            for d in [parse_go_duration(&s), parse_retry_after(&s, now), parse_millis(&s), parse_rfc3339_until(&s, now)].into_iter().flatten() {
                prop_assert!(d <= MAX_HINT);
            }
        }

        #[test]
        fn go_durations_round_trip(h in 0u64..20, m in 0u64..60, ms_ in 0u64..60_000) {
            let text = format!("{h}h{m}m{}s", ms_ as f64 / 1000.0);
            let want = Duration::from_millis(h * 3_600_000 + m * 60_000 + ms_);
            let got = parse_go_duration(&text).unwrap();
            prop_assert!((got.as_secs_f64() - want.as_secs_f64()).abs() < 1e-6, "{} -> {:?}", text, got);
        }
    }
}
