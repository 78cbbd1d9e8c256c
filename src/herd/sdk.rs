//! The official openai-python SDK's retry policy: the baseline of a client with no corral.
//!
//! Read from openai-python's `src/openai/_base_client.py` (`_parse_retry_after_header`,
//! `_should_retry`, `_calculate_retry_timeout` and the request loop that calls them) and
//! `src/openai/_constants.py`, at v3.3.1:
//!
//! - `DEFAULT_MAX_RETRIES = 2`: three attempts in all. Connection errors and timeouts are
//!   retried while retries remain; an HTTP error only if `_should_retry` says so.
//! - `_should_retry`: a server-directed wait over `MAX_RETRY_AFTER_DELAY` (120 s) means no
//!   retry at all; then `x-should-retry: true|false` is obeyed; then 408, 409, 429 and >= 500
//!   are retried, nothing else.
//! - The server-directed wait (`_parse_retry_after_header`): `retry-after-ms` (float ms) first,
//!   then `retry-after` as float seconds, then `retry-after` as an HTTP date (minus now).
//! - `_calculate_retry_timeout`: a wait that is finite and in `(0, 120]` s is slept exactly;
//!   otherwise `min(0.5 * 2^n, 8.0)` seconds times `1 - 0.25 * random()`, `n` the retries
//!   taken so far (0 before the first retry).
//!
//! Up to v2.51 the ceiling was 60 s and a longer hint was not refused but ignored: the client
//! fell back to its backoff ([`OPENAI_PYTHON_BEFORE_2_52`]). The herd runs the current one,
//! [`OPENAI_PYTHON`].
//!
//! These are pure functions of the response head, the retry count and a uniform draw, so they
//! are tested without a clock; the herd divides the SDK's own backoff by its time scale and
//! sleeps a server-directed wait as sent (the simulator already speaks in scaled time).

use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, RETRY_AFTER};

/// One SDK's retry policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdkPolicy {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Backoff before the first retry, doubled each retry.
    pub initial_delay: Duration,
    /// Backoff ceiling.
    pub max_delay: Duration,
    /// Longest server-directed wait honoured.
    pub max_retry_after: Duration,
    /// What a longer server-directed wait does.
    pub long_hint: LongHint,
}

/// What the SDK does with a server-directed wait over [`SdkPolicy::max_retry_after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LongHint {
    /// Surface the error at once (openai-python from v2.52.0).
    GiveUp,
    /// Ignore the hint and back off as if there were none (openai-python up to v2.51).
    Backoff,
}

/// openai-python's defaults, v2.52.0 on.
pub const OPENAI_PYTHON: SdkPolicy = SdkPolicy {
    max_retries: 2,
    initial_delay: Duration::from_millis(500),
    max_delay: Duration::from_secs(8),
    max_retry_after: Duration::from_secs(120),
    long_hint: LongHint::GiveUp,
};

/// openai-python's defaults up to v2.51.
pub const OPENAI_PYTHON_BEFORE_2_52: SdkPolicy = SdkPolicy {
    max_retry_after: Duration::from_secs(60),
    long_hint: LongHint::Backoff,
    ..OPENAI_PYTHON
};

/// How long to sleep before a retry, and whether the server chose it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wait {
    /// The server-directed wait, slept exactly.
    Hinted(Duration),
    /// The SDK's own jittered exponential backoff.
    Backoff(Duration),
}

/// The server-directed wait in seconds, as `_parse_retry_after_header` reads it (at `now`, for
/// an HTTP date): may be zero, negative or infinite; `None` when absent or unreadable.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<f64> {
    let text = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = text("retry-after-ms").and_then(|s| s.parse::<f64>().ok()) {
        return Some(ms / 1000.0);
    }
    let retry_after = text(RETRY_AFTER.as_str())?;
    if let Ok(secs) = retry_after.parse::<f64>() {
        return Some(secs);
    }
    let date = httpdate::parse_http_date(retry_after).ok()?;
    Some(match date.duration_since(now) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    })
}

impl SdkPolicy {
    /// Whether an HTTP error answer with `status` and `headers` (read at `now`) is retried,
    /// retries remaining.
    pub fn should_retry(&self, status: u16, headers: &HeaderMap, now: SystemTime) -> bool {
        let hint = retry_after(headers, now);
        let too_long = hint.is_some_and(|s| s.is_finite() && s > self.max_retry_after_secs());
        if too_long && self.long_hint == LongHint::GiveUp {
            return false;
        }
        match headers.get("x-should-retry").map(|v| v.as_bytes()) {
            Some(b"true") => return true,
            Some(b"false") => return false,
            _ => {}
        }
        matches!(status, 408 | 409 | 429) || status >= 500
    }

    /// The wait before retry number `retries_taken + 1`, given the server-directed `hint` in
    /// seconds and a uniform draw `random` in `[0, 1)`.
    pub fn wait(&self, retries_taken: u32, hint: Option<f64>, random: f64) -> Wait {
        if let Some(secs) = hint {
            if secs.is_finite() && secs > 0.0 && secs <= self.max_retry_after_secs() {
                return Wait::Hinted(Duration::from_secs_f64(secs));
            }
        }
        let doubled = self.initial_delay.as_secs_f64() * 2f64.powi(retries_taken.min(1000) as i32);
        let sleep = doubled.min(self.max_delay.as_secs_f64());
        let jitter = 1.0 - 0.25 * random;
        Wait::Backoff(Duration::from_secs_f64((sleep * jitter).max(0.0)))
    }

    fn max_retry_after_secs(&self) -> f64 {
        self.max_retry_after.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        h
    }

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn retry_after_ms_is_read_first_then_seconds_then_a_date() {
        let both = headers(&[("retry-after-ms", "1500"), ("retry-after", "9")]);
        assert_eq!(retry_after(&both, now()), Some(1.5));
        let fractional = headers(&[("retry-after", "2.5")]);
        assert_eq!(retry_after(&fractional, now()), Some(2.5));
        let bad_ms = headers(&[("retry-after-ms", "soon"), ("retry-after", "3")]);
        assert_eq!(retry_after(&bad_ms, now()), Some(3.0));
        let date = httpdate::fmt_http_date(now() + Duration::from_secs(30));
        assert_eq!(
            retry_after(&headers(&[("retry-after", &date)]), now()),
            Some(30.0)
        );
        let past = httpdate::fmt_http_date(now() - Duration::from_secs(5));
        assert_eq!(
            retry_after(&headers(&[("retry-after", &past)]), now()),
            Some(-5.0)
        );
        assert_eq!(retry_after(&HeaderMap::new(), now()), None);
        assert_eq!(
            retry_after(&headers(&[("retry-after", "later")]), now()),
            None
        );
    }

    #[test]
    fn a_hint_up_to_two_minutes_is_slept_exactly() {
        let p = OPENAI_PYTHON;
        for (hint, n) in [(0.001, 0), (1.0, 1), (59.5, 2), (120.0, 0)] {
            assert_eq!(p.wait(n, Some(hint), 0.9), Wait::Hinted(secs(hint)));
        }
    }

    #[test]
    fn a_missing_zero_negative_or_infinite_hint_falls_back_to_backoff() {
        let p = OPENAI_PYTHON;
        for hint in [
            None,
            Some(0.0),
            Some(-3.0),
            Some(f64::INFINITY),
            Some(f64::NAN),
        ] {
            assert_eq!(p.wait(0, hint, 0.0), Wait::Backoff(secs(0.5)), "{hint:?}");
        }
    }

    #[test]
    fn backoff_doubles_from_half_a_second_to_eight_within_a_quarter_of_jitter() {
        let p = OPENAI_PYTHON;
        for (n, base) in [
            (0, 0.5),
            (1, 1.0),
            (2, 2.0),
            (3, 4.0),
            (4, 8.0),
            (9, 8.0),
            (5000, 8.0),
        ] {
            assert_eq!(p.wait(n, None, 0.0), Wait::Backoff(secs(base)), "n = {n}");
            let Wait::Backoff(least) = p.wait(n, None, 0.999_999) else {
                panic!("a backoff")
            };
            assert!(least >= secs(base * 0.75), "n = {n}: {least:?}");
            assert!(least < secs(base * 0.75 + 1e-5), "n = {n}: {least:?}");
        }
    }

    #[test]
    fn a_hint_over_two_minutes_stops_the_current_sdk_and_is_ignored_by_the_old_one() {
        let day = headers(&[("retry-after", "86400")]);
        assert!(!OPENAI_PYTHON.should_retry(429, &day, now()));
        let old = OPENAI_PYTHON_BEFORE_2_52;
        assert!(old.should_retry(429, &day, now()));
        assert_eq!(old.wait(1, Some(86_400.0), 0.0), Wait::Backoff(secs(1.0)));
        // Between the two ceilings: the current SDK sleeps it, the old one backs off.
        assert_eq!(
            OPENAI_PYTHON.wait(0, Some(90.0), 0.0),
            Wait::Hinted(secs(90.0))
        );
        assert_eq!(old.wait(0, Some(90.0), 0.0), Wait::Backoff(secs(0.5)));
        assert_eq!(old.wait(0, Some(60.0), 0.0), Wait::Hinted(secs(60.0)));
    }

    #[test]
    fn statuses_retried_and_x_should_retry_over_them() {
        let p = OPENAI_PYTHON;
        let none = HeaderMap::new();
        for status in [408, 409, 429, 500, 503, 529] {
            assert!(p.should_retry(status, &none, now()), "{status}");
        }
        for status in [400, 401, 404, 413, 422] {
            assert!(!p.should_retry(status, &none, now()), "{status}");
        }
        let no = headers(&[("x-should-retry", "false")]);
        assert!(!p.should_retry(429, &no, now()));
        let yes = headers(&[("x-should-retry", "true")]);
        assert!(p.should_retry(400, &yes, now()));
        // A hint beyond the ceiling wins even over `x-should-retry: true`.
        let both = headers(&[("x-should-retry", "true"), ("retry-after", "121")]);
        assert!(!p.should_retry(429, &both, now()));
    }
}
