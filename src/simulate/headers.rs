//! OpenAI and Anthropic rate-limit headers, and the Go duration strings OpenAI uses.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};

use super::limits::{Admission, View};

const OA_LIMIT_REQ: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
const OA_REMAINING_REQ: HeaderName = HeaderName::from_static("x-ratelimit-remaining-requests");
const OA_RESET_REQ: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
const OA_LIMIT_TOK: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
const OA_REMAINING_TOK: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
const OA_RESET_TOK: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
const MS_RETRY_AFTER_MS: HeaderName = HeaderName::from_static("x-ms-retry-after-ms");
const AN_LIMIT_REQ: HeaderName = HeaderName::from_static("anthropic-ratelimit-requests-limit");
const AN_REMAINING_REQ: HeaderName =
    HeaderName::from_static("anthropic-ratelimit-requests-remaining");
const AN_RESET_REQ: HeaderName = HeaderName::from_static("anthropic-ratelimit-requests-reset");
const AN_LIMIT_TOK: HeaderName = HeaderName::from_static("anthropic-ratelimit-tokens-limit");
const AN_REMAINING_TOK: HeaderName =
    HeaderName::from_static("anthropic-ratelimit-tokens-remaining");
const AN_RESET_TOK: HeaderName = HeaderName::from_static("anthropic-ratelimit-tokens-reset");

/// `x-ratelimit-*` (requests, and tokens with `--tpm`), plus `retry-after`/`retry-after-ms`
/// on a refusal.
pub fn openai(headers: &mut HeaderMap, a: &Admission) {
    x_ratelimit(headers, a, |reset| {
        text(go_duration(Duration::from_millis(ceil_millis(reset))))
    });
    if let Some(d) = &a.denied {
        headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(d.retry_after)));
        headers.insert(
            RETRY_AFTER_MS,
            HeaderValue::from(ceil_millis(d.retry_after)),
        );
    }
}

/// Azure OpenAI's flavour: the `x-ratelimit-*` names with resets in whole seconds (rounded
/// up), plus `retry-after` and `x-ms-retry-after-ms` on a refusal.
pub fn azure(headers: &mut HeaderMap, a: &Admission) {
    x_ratelimit(headers, a, |reset| HeaderValue::from(ceil_secs(reset)));
    if let Some(d) = &a.denied {
        headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(d.retry_after)));
        headers.insert(
            MS_RETRY_AFTER_MS,
            HeaderValue::from(ceil_millis(d.retry_after)),
        );
    }
}

/// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, each reset formatted by `reset`.
fn x_ratelimit(h: &mut HeaderMap, a: &Admission, reset: impl Fn(Duration) -> HeaderValue) {
    let names = [
        [OA_LIMIT_REQ, OA_REMAINING_REQ, OA_RESET_REQ],
        [OA_LIMIT_TOK, OA_REMAINING_TOK, OA_RESET_TOK],
    ];
    let views = [Some(&a.requests), a.tokens.as_ref()];
    for (v, [limit, remaining, reset_name]) in views.into_iter().zip(names) {
        if let Some(v) = v {
            h.insert(limit, HeaderValue::from(v.limit));
            h.insert(remaining, HeaderValue::from(v.remaining));
            h.insert(reset_name, reset(v.reset));
        }
    }
}

/// `anthropic-ratelimit-*` with RFC 3339 reset instants relative to `wall_now`, plus
/// `retry-after` on a refusal.
pub fn anthropic(headers: &mut HeaderMap, a: &Admission, wall_now: SystemTime) {
    let [limit, remaining, reset] = [AN_LIMIT_REQ, AN_REMAINING_REQ, AN_RESET_REQ];
    anthropic_view(headers, &a.requests, wall_now, limit, remaining, reset);
    if let Some(t) = &a.tokens {
        let [limit, remaining, reset] = [AN_LIMIT_TOK, AN_REMAINING_TOK, AN_RESET_TOK];
        anthropic_view(headers, t, wall_now, limit, remaining, reset);
    }
    if let Some(d) = &a.denied {
        headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(d.retry_after)));
    }
}

fn anthropic_view(
    h: &mut HeaderMap,
    v: &View,
    wall_now: SystemTime,
    limit: HeaderName,
    rem: HeaderName,
    reset: HeaderName,
) {
    h.insert(limit, HeaderValue::from(v.limit));
    h.insert(rem, HeaderValue::from(v.remaining));
    h.insert(reset, text(rfc3339_ceil(wall_now + v.reset)));
}

/// RFC 3339 UTC with whole seconds, rounded up so a client never comes back early.
pub fn rfc3339_ceil(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let up = Duration::from_secs(ceil_secs(since));
    humantime::format_rfc3339_seconds(UNIX_EPOCH + up).to_string()
}

pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

pub fn ceil_millis(d: Duration) -> u64 {
    let ms = d.as_millis();
    let up = ms + u128::from(d.as_nanos() > ms * 1_000_000);
    u64::try_from(up).unwrap_or(u64::MAX)
}

/// Formats like Go's `time.Duration.String()`: "0s", "1.5ms", "2.5s", "1m30s", "1h0m0s".
pub fn go_duration(d: Duration) -> String {
    let n = d.as_nanos();
    let mut out = String::new();
    if n == 0 {
        out.push_str("0s");
    } else if n < 1_000 {
        let _ = write!(out, "{n}ns");
    } else if n < 1_000_000 {
        push_fraction(&mut out, n, 3);
        out.push_str("µs");
    } else if n < 1_000_000_000 {
        push_fraction(&mut out, n, 6);
        out.push_str("ms");
    } else {
        let secs = n / 1_000_000_000;
        let (h, m) = (secs / 3600, secs / 60 % 60);
        if h > 0 {
            let _ = write!(out, "{h}h{m}m");
        } else if m > 0 {
            let _ = write!(out, "{m}m");
        }
        push_fraction(&mut out, n % 60_000_000_000, 9);
        out.push('s');
    }
    out
}

/// Writes `n / 10^digits` with its fractional digits, trailing zeros trimmed.
fn push_fraction(out: &mut String, n: u128, digits: u32) {
    let scale = 10u128.pow(digits);
    let _ = write!(out, "{}", n / scale);
    let frac = n % scale;
    if frac > 0 {
        let s = format!("{frac:0width$}", width = digits as usize);
        out.push('.');
        out.push_str(s.trim_end_matches('0'));
    }
}

fn text(s: String) -> HeaderValue {
    HeaderValue::try_from(s).expect("durations and timestamps are visible ASCII")
}

#[cfg(test)]
mod tests;
