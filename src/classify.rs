//! One classifier of attempt outcomes, shared by retry, breaker, learner and metrics, and the
//! reading of a 429 before it moves a pace ([`Throttle`]).
//!
//! A 429 is evidence about one bucket, at one scope, for one reason, and the reason decides
//! what it may change:
//! - **rate**: the bucket is empty. It pauses the partition for the hint and may cut the pace.
//! - **overload**: the provider's overload wording or type, or a 429 while the headers report
//!   clear headroom and no wait is named. It says nothing about the sender's rate: it is retried
//!   like a 503 (backoff, failure budget) and counts against the upstream's health.
//! - **quota**: no wait cures it (billing, spend limit): passed through at once.
//! - **long window**: the wait named (or a per-day quota) is beyond the request's deadline:
//!   passed through at once, marked so the client does not retry either.
//! - **unknown**: no headers, no hint, no wording: most likely an empty bucket, so it is treated
//!   as one, within the bounds the pace keeps on every cut.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, Response, StatusCode};

use crate::config::RetryConfig;
use crate::error::ProxyError;
use crate::provider::body::{error_signals, ErrorSignals, QuotaWindow};
use crate::provider::hints;

/// What one attempt came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 1xx-3xx.
    Success,
    /// A 429 that is about the sender's bucket (rate, quota, long window or unknown).
    Throttled(u16),
    /// The service is overloaded: a 529, or a 429 read as overload ([`Reason::Overload`]).
    Overloaded(u16),
    /// Any other 5xx.
    ServerError(u16),
    /// Any other 4xx: the request itself is at fault.
    ClientError(u16),
    /// No response head within the per-try timeout.
    Timeout,
    /// The connection failed or was reset before a response head.
    Transport,
    /// corral answered itself (queue, rate limit, breaker, deadline): the upstream saw nothing.
    Local,
}

impl Outcome {
    pub fn of<B>(result: &Result<Response<B>, ProxyError>) -> Self {
        match result {
            Ok(response) => Self::of_head(response.status(), response.extensions()),
            Err(ProxyError::TryTimeout { .. }) => Self::Timeout,
            Err(ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamReset { .. }) => {
                Self::Transport
            }
            Err(_) => Self::Local,
        }
    }

    /// From a response head: a 429 read as overload (its [`Throttle`]) is an overload.
    pub fn of_head(status: StatusCode, extensions: &http::Extensions) -> Self {
        match extensions.get::<Throttle>() {
            Some(t) if status == StatusCode::TOO_MANY_REQUESTS && t.reason == Reason::Overload => {
                Self::Overloaded(429)
            }
            _ => Self::of_status(status),
        }
    }

    pub fn of_status(status: StatusCode) -> Self {
        match status.as_u16() {
            429 => Self::Throttled(429),
            529 => Self::Overloaded(529),
            s @ 500..=599 => Self::ServerError(s),
            s @ 400..=499 => Self::ClientError(s),
            _ => Self::Success,
        }
    }

    /// The upstream is unwell: any 5xx, an overload (529, or a 429 read as overload), a timeout,
    /// a connection error. This is what the breaker counts against the upstream's health. A 429 is not: it
    /// is about the caller's quota, not the upstream's health (the breaker counts it only with
    /// `count_throttles`, see `stack::breaker`).
    pub fn is_upstream_failure(self) -> bool {
        matches!(
            self,
            Self::Overloaded(_) | Self::ServerError(_) | Self::Timeout | Self::Transport
        )
    }

    /// Did the upstream see the attempt at all?
    pub fn reached_upstream(self) -> bool {
        !matches!(self, Self::Local)
    }

    /// A bounded label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Throttled(_) => "429",
            Self::Overloaded(429) => "429_overload",
            Self::Overloaded(_) => "529",
            Self::ServerError(500) => "500",
            Self::ServerError(502) => "502",
            Self::ServerError(503) => "503",
            Self::ServerError(504) => "504",
            Self::ServerError(_) => "5xx",
            Self::ClientError(_) => "4xx",
            Self::Timeout => "timeout",
            Self::Transport => "connection",
            Self::Local => "local",
        }
    }
}

/// Why a 429 was sent (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Rate,
    Overload,
    Quota,
    LongWindow,
    Unknown,
}

impl Reason {
    pub const ALL: [Reason; 5] = [
        Reason::Rate,
        Reason::Overload,
        Reason::Quota,
        Reason::LongWindow,
        Reason::Unknown,
    ];

    pub const fn label(self) -> &'static str {
        match self {
            Reason::Rate => "rate",
            Reason::Overload => "overload",
            Reason::Quota => "quota",
            Reason::LongWindow => "long_window",
            Reason::Unknown => "unknown",
        }
    }

    /// Whether this 429 says the sender's bucket is empty: only these pause a partition's
    /// sends for a guessed while and move its pace.
    pub fn empties_bucket(self) -> bool {
        matches!(self, Reason::Rate | Reason::Unknown)
    }
}

/// The reading of one 429, carried on the response (its extensions) from the rate limiter,
/// which reads it once, up to retry and the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttle {
    pub reason: Reason,
    /// The wait the upstream named (headers, or a body's `retryDelay`), else the reset of the
    /// bucket it reports exhausted.
    pub hint: Option<Duration>,
    /// Whether `hint` was named outright rather than read from a reset.
    pub named: bool,
    /// A rate 429 whose named wait outlasts the refill of every bucket its report shows empty:
    /// the upstream says the bucket is full again by the time this request may come back, so
    /// the wait is this request's own (an admission control's queue, not a bucket's edge): it
    /// waits, the partition does not pause, and the pace does not move.
    pub own_wait: bool,
}

/// A bucket reported full again within this of a named wait's end counts as full by then.
const REFILL_SLACK: Duration = Duration::from_millis(10);

/// A `remaining` at least this share of its `limit` is clear headroom.
const HEADROOM: f64 = 0.1;

impl Throttle {
    /// Read a 429 from its headers and (buffered) body; `time_left`: until the request's
    /// deadline.
    pub fn read(
        headers: &HeaderMap,
        body: &[u8],
        config: &RetryConfig,
        time_left: Duration,
        now: SystemTime,
    ) -> Self {
        let signals = error_signals(body);
        // The finest wait named first: a body's (a message's "try again in 20ms") beats a
        // `retry-after` rounded up to whole seconds, as `retry-after-ms` does.
        let in_headers = hints::explicit_hint(headers, now);
        let mut rounded = in_headers.is_some() && hints::whole_seconds_only(headers);
        let named = match (in_headers, signals.retry_delay) {
            (Some(h), Some(b)) if rounded && b < h => {
                rounded = false;
                Some(b)
            }
            (h, b) => h.or(b),
        };
        if is_permanent(headers, body, &signals, config) {
            return Throttle {
                reason: Reason::Quota,
                hint: None,
                named: false,
                own_wait: false,
            };
        }
        // The wait the upstream implies: one it named, else the reset of a bucket it reports
        // empty (a bucket with room says nothing about when to come back).
        let implied = named.or_else(|| hints::exhausted_reset(headers, now));
        let (reason, hint) = if signals.overloaded {
            (Reason::Overload, named)
        } else if signals.window == Some(QuotaWindow::Day) || implied.is_some_and(|h| h > time_left)
        {
            (Reason::LongWindow, implied)
        } else if signals.rate_limited || named.is_some() {
            (
                Reason::Rate,
                named.or_else(|| hints::reset_hint(headers, now)),
            )
        } else {
            match headroom(headers, now) {
                Some(true) => (Reason::Overload, None),
                Some(false) => (Reason::Rate, hints::reset_hint(headers, now)),
                None => (Reason::Unknown, None),
            }
        };
        // A wait named in whole seconds alone is rounded up as a coarse reset is.
        let own_wait =
            reason == Reason::Rate && named.is_some_and(|w| refills_by(headers, w, rounded, now));
        Throttle {
            reason,
            hint,
            named: named.is_some(),
            own_wait,
        }
    }
}

/// Whether the buckets the headers report empty are all full again by `wait` (and one is).
/// When both are rounded up to whole seconds (`rounded`: the wait is `retry-after` alone), a
/// reset may be a second later than the refill it reports.
fn refills_by(headers: &HeaderMap, wait: Duration, rounded: bool, now: SystemTime) -> bool {
    let reports = crate::provider::reports(headers, || now);
    let mut empty = reports
        .into_iter()
        .flatten()
        .filter(|r| r.remaining < 1.0)
        .peekable();
    empty.peek().is_some()
        && empty.all(|r| {
            let rounding = if r.coarse && rounded {
                Duration::from_secs(1)
            } else {
                Duration::ZERO
            };
            r.reset
                .is_some_and(|reset| reset <= wait + rounding + REFILL_SLACK)
        })
}

/// Whether the rate-limit headers report clear headroom in every bucket they describe; `None`
/// when they describe none.
fn headroom(headers: &HeaderMap, now: SystemTime) -> Option<bool> {
    let reports = crate::provider::reports(headers, || now);
    let mut any = false;
    for r in reports.into_iter().flatten() {
        any = true;
        if r.limit <= 0.0 || r.remaining < 2.0 || r.remaining < HEADROOM * r.limit {
            return Some(false);
        }
    }
    any.then_some(true)
}

/// Codes in a 429's body that no wait cures: OpenAI's billing error, Anthropic's spend limit.
const PERMANENT_CODES: [&str; 2] = ["insufficient_quota", "enforced_spend_limit_reached"];

/// The headers by which an upstream names a wait outright (`crate::provider::hints`).
pub const WAIT_HEADERS: [&str; 3] = ["retry-after", "retry-after-ms", "x-ms-retry-after-ms"];

/// A 429 no wait can cure: a billing code, a configured code, or Anthropic's spend-limit shape
/// (a billing message and no wait named in any of [`WAIT_HEADERS`] or the body: an upstream that says when
/// to come back is throttling, whatever its message says).
pub fn is_permanent_429(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
    config: &RetryConfig,
) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        && is_permanent(headers, body, &error_signals(body), config)
}

/// Whether an answer is a permanent 429, judged from its head and (buffered) body: by the
/// rate limiter's reading when it carries one ([`Throttle`] in its extensions, a `Quota`
/// reason), else by [`is_permanent_429`].
pub fn is_permanent_answer(
    parts: &http::response::Parts,
    body: &[u8],
    config: &RetryConfig,
) -> bool {
    match parts.extensions.get::<Throttle>() {
        Some(t) => t.reason == Reason::Quota,
        None => is_permanent_429(parts.status, &parts.headers, body, config),
    }
}

/// Whether the head of a stream's first frame is an SSE `error` event: a failure before any
/// content, such as Anthropic's `overloaded_error`.
pub fn is_error_event(frame: &[u8]) -> bool {
    let head = &frame[..frame.len().min(512)];
    head.starts_with(b"event: error") || head.windows(13).any(|w| w == b"\nevent: error")
}

fn is_permanent(
    headers: &HeaderMap,
    body: &[u8],
    signals: &ErrorSignals,
    config: &RetryConfig,
) -> bool {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    // Some providers (Gemini) wrap the error object in an array.
    let error = match &json {
        serde_json::Value::Array(items) => items
            .first()
            .map_or(&serde_json::Value::Null, |e| &e["error"]),
        object => &object["error"],
    };
    let fields = [
        &error["code"],
        &error["type"],
        &error["details"]["error_code"],
        &error["details"]["code"],
    ];
    let codes: Vec<&str> = fields.iter().filter_map(|v| v.as_str()).collect();
    let listed =
        |c: &&str| PERMANENT_CODES.contains(c) || config.permanent_codes.iter().any(|p| p == c);
    if codes.iter().any(listed) {
        return true;
    }
    let message = error["message"]
        .as_str()
        .unwrap_or_default()
        .to_ascii_lowercase();
    // The message's own words, not its links': Azure's rate-limit 429 ends "Please go here:
    // https://aka.ms/oai/quotaincrease if you would like to further increase the default rate
    // limit", and a message that says a rate limit was exceeded is about a pace, not billing.
    let words: Vec<&str> = message
        .split_whitespace()
        .filter(|w| !w.contains("://"))
        .collect();
    let text = words.join(" ");
    let billing = !text.contains("rate limit")
        && ["spend limit", "billing", "credit balance", "quota"]
            .iter()
            .any(|w| text.contains(w));
    billing
        && signals.retry_delay.is_none()
        && !WAIT_HEADERS.iter().any(|h| headers.contains_key(*h))
}

/// The upstream's `x-should-retry: true|false`, which overrides the status rule.
pub fn should_retry_header(headers: &HeaderMap) -> Option<bool> {
    const SHOULD_RETRY: http::HeaderName = http::HeaderName::from_static("x-should-retry");
    match crate::forward::scan(headers, &SHOULD_RETRY)?
        .to_str()
        .ok()?
        .trim()
    {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_that_opens_with_an_error_event_is_a_failure() {
        assert!(is_error_event(b"event: error\ndata: {}\n\n"));
        assert!(is_error_event(b": ping\n\nevent: error\ndata: {}\n\n"));
        assert!(!is_error_event(b"event: message_start\ndata: {}\n\n"));
        let late = [b" ".repeat(512), b"\nevent: error".to_vec()].concat();
        assert!(!is_error_event(&late));
    }

    #[test]
    fn statuses() {
        let s = |c: u16| Outcome::of_status(StatusCode::from_u16(c).unwrap());
        assert_eq!(s(200), Outcome::Success);
        assert_eq!(s(429), Outcome::Throttled(429));
        assert_eq!(s(529), Outcome::Overloaded(529));
        assert_eq!(s(503), Outcome::ServerError(503));
        assert_eq!(s(400), Outcome::ClientError(400));
    }

    #[test]
    fn upstream_failures_are_its_health_not_throttles() {
        let s = |c: u16| Outcome::of_status(StatusCode::from_u16(c).unwrap());
        for failing in [500, 502, 503, 504, 529] {
            assert!(s(failing).is_upstream_failure(), "{failing}");
        }
        assert!(Outcome::Timeout.is_upstream_failure());
        assert!(Outcome::Transport.is_upstream_failure());
        for fine in [200, 204, 301, 400, 404, 429] {
            assert!(!s(fine).is_upstream_failure(), "{fine}");
        }
    }

    fn read(headers: &[(&str, &str)], body: &str, left: Duration) -> Throttle {
        let h: HeaderMap = headers
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                )
            })
            .collect();
        Throttle::read(
            &h,
            body.as_bytes(),
            &RetryConfig::default(),
            left,
            SystemTime::now(),
        )
    }

    const HEALTHY: [(&str, &str); 3] = [
        ("x-ratelimit-limit-requests", "5000"),
        ("x-ratelimit-remaining-requests", "4990"),
        ("x-ratelimit-reset-requests", "12ms"),
    ];
    const MINUTE: Duration = Duration::from_secs(60);

    #[test]
    fn openais_overload_wording_is_an_overload() {
        let body = r#"{"error":{"message":"The engine is currently overloaded, please try again later","type":"server_error","param":null,"code":null}}"#;
        let t = read(&HEALTHY, body, MINUTE);
        assert_eq!(t.reason, Reason::Overload);
        assert!(!t.named, "no wait named");
    }

    #[test]
    fn an_overload_with_a_long_reset_of_a_bucket_with_room_is_still_an_overload() {
        let body = r#"{"error":{"message":"The engine is currently overloaded, please try again later","type":"server_error"}}"#;
        let long_reset = [
            ("x-ratelimit-limit-requests", "5000"),
            ("x-ratelimit-remaining-requests", "4990"),
            ("x-ratelimit-reset-requests", "30s"),
        ];
        let t = read(&long_reset, body, Duration::from_secs(10));
        assert_eq!(t.reason, Reason::Overload);
        assert_eq!(t.hint, None, "a reset of a bucket with room names no wait");
        assert_eq!(
            read(&long_reset, "", Duration::from_secs(10)).reason,
            Reason::Overload
        );
    }

    #[test]
    fn a_429_with_clear_headroom_and_no_wait_named_is_an_overload() {
        assert_eq!(read(&HEALTHY, "", MINUTE).reason, Reason::Overload);
        // The same headroom with a wait named is the bucket: enforcement finer than the report.
        let mut named = HEALTHY.to_vec();
        named.push(("retry-after-ms", "250"));
        let t = read(&named, "", MINUTE);
        assert_eq!(t.reason, Reason::Rate);
        assert_eq!(t.hint, Some(Duration::from_millis(250)));
        assert!(t.named);
    }

    #[test]
    fn an_empty_bucket_reported_is_a_rate_429_with_its_reset_as_hint() {
        let empty = [
            ("x-ratelimit-limit-requests", "5000"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1.5s"),
        ];
        let t = read(&empty, "", MINUTE);
        assert_eq!(t.reason, Reason::Rate);
        assert_eq!(t.hint, Some(Duration::from_millis(1500)));
        assert!(!t.named, "a reset, not a named wait");
    }

    #[test]
    fn a_named_wait_that_outlasts_the_empty_buckets_refill_is_the_requests_own() {
        let admission = [
            ("x-ratelimit-limit-requests", "1000000"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1s"),
            ("retry-after", "1"),
        ];
        let t = read(&admission, "", MINUTE);
        assert_eq!(t.reason, Reason::Rate);
        assert!(t.own_wait);
        // A bucket still refilling when the wait ends: the partition's wait.
        let bucket = [
            ("x-ratelimit-limit-requests", "50"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "2.5s"),
            ("retry-after-ms", "50"),
        ];
        assert!(!read(&bucket, "", MINUTE).own_wait);
        // No report of an empty bucket: nothing says it refills.
        assert!(!read(&[("retry-after", "1")], "", MINUTE).own_wait);
        // Anthropic's: a reset instant in whole seconds, rounded up, may be a second past the
        // refill it reports; `retry-after: 1` still outlasts a bucket full within 0.3 s.
        let wall = SystemTime::now();
        let reset = |d| crate::simulate::headers::rfc3339_ceil(wall + d);
        let soon = reset(Duration::from_millis(300));
        let anthropic = |at: &str| {
            read(
                &[
                    ("anthropic-ratelimit-requests-limit", "50"),
                    ("anthropic-ratelimit-requests-remaining", "0"),
                    ("anthropic-ratelimit-requests-reset", at),
                    ("retry-after", "1"),
                ],
                "",
                MINUTE,
            )
        };
        assert!(anthropic(&soon).own_wait);
        // Full only three seconds on: the bucket's edge, the partition's wait.
        assert!(!anthropic(&reset(Duration::from_secs(3))).own_wait);
    }

    #[test]
    fn a_finer_wait_in_the_body_beats_a_retry_after_in_whole_seconds() {
        let body = r#"{"error":{"message":"Rate limit reached for requests. Please try again in 20ms.","type":"requests","code":"rate_limit_exceeded"}}"#;
        let t = read(&[("retry-after", "1")], body, MINUTE);
        assert_eq!(t.hint, Some(Duration::from_millis(20)));
        // `retry-after-ms` is finer than any message: it stands.
        let t = read(
            &[("retry-after-ms", "700"), ("retry-after", "1")],
            body,
            MINUTE,
        );
        assert_eq!(t.hint, Some(Duration::from_millis(700)));
        // A longer wait in the body does not lengthen the header's.
        let slow = body.replace("20ms", "3s");
        assert_eq!(
            read(&[("retry-after", "1")], &slow, MINUTE).hint,
            Some(Duration::from_secs(1))
        );
    }

    #[test]
    fn a_bare_429_is_unknown() {
        assert_eq!(read(&[], "", MINUTE).reason, Reason::Unknown);
        assert_eq!(read(&[], "not json", MINUTE).reason, Reason::Unknown);
    }

    #[test]
    fn a_wait_beyond_the_deadline_or_a_daily_quota_is_a_long_window() {
        let t = read(&[("retry-after", "30")], "", Duration::from_secs(10));
        assert_eq!(t.reason, Reason::LongWindow);
        assert_eq!(
            read(&[("retry-after", "30")], "", MINUTE).reason,
            Reason::Rate
        );
        let daily = r#"{"error":{"message":"Rate limit reached for model in organization on requests per day (RPD): Limit 200, Used 200, Requested 1.","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert_eq!(read(&[], daily, MINUTE).reason, Reason::LongWindow);
    }

    #[test]
    fn a_billing_429_is_a_quota_unless_a_wait_is_named_even_in_the_body() {
        let quota = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(read(&HEALTHY, quota, MINUTE).reason, Reason::Quota);
        // Gemini's per-minute 429 speaks of quota and names its wait only in the body.
        let gemini = r#"[{"error":{"code":429,"message":"You exceeded your current quota, please check your plan and billing details.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.5s"}]}}]"#;
        let t = read(&[], gemini, MINUTE);
        assert_eq!(t.reason, Reason::Rate);
        assert_eq!(t.hint, Some(Duration::from_millis(1500)));
        // The object form, and without its delay the same words are a quota.
        let object = &gemini[1..gemini.len() - 1];
        assert_eq!(read(&[], object, MINUTE).reason, Reason::Rate);
        let no_delay = object.replace(r#""retryDelay":"1.5s""#, r#""x":"y""#);
        assert_eq!(read(&[], &no_delay, MINUTE).reason, Reason::Quota);
        let wrapped = format!("[{no_delay}]");
        assert_eq!(read(&[], &wrapped, MINUTE).reason, Reason::Quota);
    }

    #[test]
    fn azures_rate_limit_429_is_a_rate_though_it_links_to_a_quota_page() {
        // Azure OpenAI's words (the Responses API sends them with no `retry-after` and -1 in
        // its `x-ratelimit-*`): the link's "quotaincrease" is no billing.
        let azure = r#"{"error":{"code":"429","message":"Requests to the Responses_Create Operation under Azure OpenAI API version 2025-04-01-preview have exceeded call rate limit of your current OpenAI S0 pricing tier. Please go here: https://aka.ms/oai/quotaincrease if you would like to further increase the default rate limit."}}"#;
        let unknown = [
            ("x-ratelimit-limit-requests", "-1"),
            ("x-ratelimit-remaining-requests", "-1"),
        ];
        assert_ne!(read(&unknown, azure, MINUTE).reason, Reason::Quota);
        assert_ne!(read(&[], azure, MINUTE).reason, Reason::Quota);
        // A billing message with a link is still billing.
        let billing = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details. Read the docs: https://platform.openai.com/docs/guides/error-codes/api-errors.","type":"invalid_request_error"}}"#;
        assert_eq!(read(&[], billing, MINUTE).reason, Reason::Quota);
    }

    #[test]
    fn an_overload_read_on_a_429_is_an_upstream_failure() {
        let mut response = Response::builder().status(429).body(()).unwrap();
        assert_eq!(
            Outcome::of_head(response.status(), response.extensions()),
            Outcome::Throttled(429)
        );
        response.extensions_mut().insert(Throttle {
            reason: Reason::Overload,
            hint: None,
            named: false,
            own_wait: false,
        });
        let outcome = Outcome::of_head(response.status(), response.extensions());
        assert_eq!(outcome, Outcome::Overloaded(429));
        assert!(outcome.is_upstream_failure());
        assert_eq!(outcome.label(), "429_overload");
    }
}
