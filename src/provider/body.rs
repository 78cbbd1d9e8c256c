//! What a provider's error body says that its status cannot: when to come back, over which window
//! the exhausted quota counts, and whether the provider blames the caller's rate or its own load.
//!
//! A 429 is evidence about one bucket for one reason, and the status alone does not say which.
//! A wait of hours on a per-day quota is not a pace to slow to; "the engine is currently
//! overloaded" is not about the caller's rate at all. The body says, in one of these shapes:
//!
//! - OpenAI, and the OpenAI-compatible APIs (Groq): `{"error": {"message", "type", "param",
//!   "code"}}`. A rate limit is `code: "rate_limit_exceeded"`, its message names the limit and the
//!   wait: "... on requests per day (RPD): Limit 10000, Used 10000, Requested 1. Please try again
//!   in 8.64s. ...". Overload is a message ("The engine is currently overloaded, please try again
//!   later"), or on the Responses API `code: "server_is_overloaded"`.
//! - Anthropic: `{"type": "error", "error": {"type", "message"}}`, with `type` one of
//!   `rate_limit_error` and `overloaded_error`.
//! - Gemini and Vertex AI: a `google.rpc.Status` in JSON, `{"error": {"code": 429, "message",
//!   "status": "RESOURCE_EXHAUSTED", "details": [...]}}`, sometimes as the one element of an
//!   array. Its `details` may hold a `google.rpc.RetryInfo` (`retryDelay`, a protobuf `Duration`
//!   such as `"31s"`), a `google.rpc.QuotaFailure` whose `violations[].quotaId` names the window
//!   (`GenerateRequestsPerMinutePerProjectPerModel-FreeTier`,
//!   `GenerateRequestsPerDayPerProjectPerModel-FreeTier`), and a `google.rpc.ErrorInfo` (`reason`,
//!   `metadata.quota_limit`). Real answers in this shape, quoted in the tests:
//!   <https://github.com/googleapis/python-genai/issues/2044> (a day and two minute violations,
//!   `retryDelay: "47s"`), <https://github.com/google-gemini/gemini-cli/issues/14811>
//!   (array-wrapped). Overload is a 503 `UNAVAILABLE` ("The model is overloaded"), and on
//!   Vertex's pay-as-you-go a 429 "Resource exhausted, please try again later", which
//!   <https://cloud.google.com/vertex-ai/generative-ai/docs/error-code-429> says means the shared
//!   pool had no capacity for the request, not that a quota of the caller's was used up.
//!
//! One `serde_json::Value` parse at most. A body that is none of these (not JSON, another shape)
//! says nothing: every signal is off. Pure: no state, no I/O, and no input makes it panic.

use std::time::Duration;

use serde_json::Value;

use super::hints::parse_go_duration;

/// The span over which an exhausted quota counts, shortest first (so `max` is the longest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QuotaWindow {
    Minute,
    Hour,
    Day,
}

impl QuotaWindow {
    /// The window's length (a day's quota may reset at a fixed hour instead, as Gemini's does at
    /// midnight Pacific: this is the longest it can take).
    pub const fn length(self) -> Duration {
        match self {
            QuotaWindow::Minute => Duration::from_secs(60),
            QuotaWindow::Hour => Duration::from_secs(3600),
            QuotaWindow::Day => Duration::from_secs(24 * 3600),
        }
    }
}

/// What one error body says; all off for a body that says nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorSignals {
    /// The wait the body names: Gemini's `RetryInfo.retryDelay`, or the "try again in 1.5s" /
    /// "retry in 10.68s" of a message; the longer when both are there. Capped at
    /// [`super::hints::MAX_HINT`].
    pub retry_delay: Option<Duration>,
    /// The longest window the body names for the limit that was hit: a Gemini quota's `quotaId`
    /// or `quotaMetric` ("PerMinute", "per_minute"), or a message ("requests per day (RPD)",
    /// "tokens per min (TPM)"). With `rate_limited`, a window of an hour or more is a quota to
    /// give up on until it resets, not a pace to slow to.
    pub window: Option<QuotaWindow>,
    /// The provider says it is overloaded, not that the caller went too fast: a code, type or
    /// message saying "overloaded" (Anthropic's `overloaded_error`, OpenAI's "The engine is
    /// currently overloaded", `server_is_overloaded`), Google's `UNAVAILABLE`, and Vertex's
    /// pay-as-you-go "Resource exhausted, please try again later".
    pub overloaded: bool,
    /// The provider says a rate limit or quota of the caller's was hit: OpenAI's
    /// `rate_limit_exceeded`, Anthropic's `rate_limit_error`, Google's `RESOURCE_EXHAUSTED` (and
    /// its `RATE_LIMIT_EXCEEDED`, `rateLimitExceeded` reasons). Not billing: OpenAI's
    /// `insufficient_quota` sets nothing here.
    pub rate_limited: bool,
}

/// Codes, types, statuses and reasons that mean "a limit of yours was hit", compared ignoring
/// ASCII case (Google's `ErrorInfo.reason` is `RATE_LIMIT_EXCEEDED`, its older `errors[].reason`
/// `rateLimitExceeded`).
const RATE_LIMITED: [&str; 4] = [
    "rate_limit_exceeded",
    "rate_limit_error",
    "resource_exhausted",
    "ratelimitexceeded",
];

/// How a window is spelled in quota ids (`PerMinute`), metrics (`per_minute`) and messages
/// ("per minute", "per min"), lowercased; longest window first, so that a text naming two gives
/// the longer.
const WINDOW_SPELLINGS: [(QuotaWindow, [&str; 4]); 3] = [
    (
        QuotaWindow::Day,
        ["perday", "per_day", "per day", "per-day"],
    ),
    (
        QuotaWindow::Hour,
        ["perhour", "per_hour", "per hour", "per-hour"],
    ),
    (
        QuotaWindow::Minute,
        ["permin", "per_min", "per min", "per-min"],
    ),
];

/// The phrases before a wait in a message: OpenAI's and Groq's "Please try again in 8.64s.",
/// Gemini's "Please retry in 10.689924287s.".
const WAIT_CUES: [&str; 2] = ["try again in ", "retry in "];

/// Read an error body: see the module documentation for the shapes understood.
pub fn error_signals(body: &[u8]) -> ErrorSignals {
    let Ok(json) = serde_json::from_slice::<Value>(body) else {
        return ErrorSignals::default();
    };
    let root = match &json {
        Value::Array(items) => items.first().unwrap_or(&Value::Null),
        other => other,
    };
    // `{"error": {...}}`, a bare `{"error": "text"}`, or the error's members at the top.
    let (error, message) = match root.get("error") {
        Some(Value::String(text)) => (&Value::Null, text.as_str()),
        Some(error) => (error, str_at(error, "message")),
        None => (root, str_at(root, "message")),
    };
    let message = message.to_ascii_lowercase();

    let labels = ["code", "type", "status"].map(|key| str_at(error, key));
    let status = labels[2];
    let reasons = items(error, "details")
        .chain(items(error, "errors"))
        .map(|item| str_at(item, "reason"));
    let mut rate_limited = labels
        .iter()
        .copied()
        .chain(reasons)
        .any(|label| RATE_LIMITED.iter().any(|r| label.eq_ignore_ascii_case(r)));

    let quota = read_details(error);
    let window = quota.window.max(window_named(&message));
    let retry_delay = quota.retry_delay.max(message_wait(&message));

    // Vertex's pay-as-you-go refusal: the shared pool had no room, no quota of the caller's is
    // named (Google's error-code-429 page), so it is overload whatever `reason` it carries.
    let shared_pool_busy = status.eq_ignore_ascii_case("resource_exhausted")
        && !quota.violations
        && message.contains("resource exhausted")
        && message.contains("try again later");
    if shared_pool_busy {
        rate_limited = false;
    }
    let overloaded = shared_pool_busy
        || status.eq_ignore_ascii_case("unavailable")
        || message.contains("overloaded")
        || labels
            .iter()
            .any(|label| label.to_ascii_lowercase().contains("overloaded"));

    ErrorSignals {
        retry_delay,
        window,
        overloaded,
        rate_limited,
    }
}

/// What a `google.rpc.Status`'s `details` say about the quota.
#[derive(Default)]
struct QuotaDetails {
    retry_delay: Option<Duration>,
    window: Option<QuotaWindow>,
    /// A `QuotaFailure` listed at least one violated quota.
    violations: bool,
}

/// Read `RetryInfo.retryDelay`, `QuotaFailure.violations[]` and `ErrorInfo.metadata.quota_limit`
/// from `error.details`, by their members rather than their `@type` (which proxies rewrite).
fn read_details(error: &Value) -> QuotaDetails {
    let mut found = QuotaDetails::default();
    for detail in items(error, "details") {
        let delay = parse_go_duration(str_at(detail, "retryDelay"));
        found.retry_delay = found.retry_delay.max(delay);
        for violation in items(detail, "violations") {
            found.violations = true;
            for key in ["quotaId", "quotaMetric"] {
                found.window = found.window.max(window_named(str_at(violation, key)));
            }
        }
        let limit = detail
            .get("metadata")
            .map_or("", |m| str_at(m, "quota_limit"));
        found.window = found.window.max(window_named(limit));
    }
    found
}

/// The longest window `text` names, if any.
fn window_named(text: &str) -> Option<QuotaWindow> {
    if text.is_empty() {
        return None;
    }
    let text = text.to_ascii_lowercase();
    WINDOW_SPELLINGS
        .iter()
        .find(|(_, spellings)| spellings.iter().any(|s| text.contains(s)))
        .map(|(window, _)| *window)
}

/// The wait a (lowercased) message names after one of [`WAIT_CUES`]: a Go duration ("1m26.4s",
/// "375ms") or plain seconds, up to the next space, comma or parenthesis, a final period dropped.
fn message_wait(message: &str) -> Option<Duration> {
    WAIT_CUES.iter().find_map(|cue| {
        let start = message.find(cue)? + cue.len();
        let word = message[start..]
            .split(|c: char| c.is_whitespace() || matches!(c, ',' | ')' | ';'))
            .next()?;
        parse_go_duration(word.trim_end_matches('.'))
    })
}

/// `value[key]` as a string, or "" when absent or not a string.
fn str_at<'a>(value: &'a Value, key: &str) -> &'a str {
    value.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// The elements of the array `value[key]`; none when absent or not an array.
fn items<'a>(value: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    value
        .get(key)
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice)
        .iter()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::hints::MAX_HINT;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    // Where each body comes from is said above it: "documented" (a provider's docs or
    // PROVIDERS.md), "captured" (a real answer pasted on the public page linked), or
    // "constructed" (put together from the documented shape; the values are made up).

    #[test]
    fn an_openai_token_rate_limit_names_the_minute_and_its_wait() {
        // Constructed: the body of tests/fixtures/headers/openai_429_rate_limit.txt (shape and
        // code documented in PROVIDERS.md, message wording as OpenAI's).
        let body = br#"{"error":{"message":"Rate limit reached on tokens per min (TPM): Limit 160000, Used 160000, Requested 1000. Please try again in 375ms.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
        assert_eq!(
            error_signals(body),
            ErrorSignals {
                retry_delay: Some(ms(375)),
                window: Some(QuotaWindow::Minute),
                overloaded: false,
                rate_limited: true,
            }
        );
    }

    #[test]
    fn an_openai_requests_per_day_limit_is_a_day_window() {
        // Captured: https://github.com/MSU-AI-Agents/fall-2025-course/issues/76 (printed as a
        // Python dict there, written back as JSON here).
        let body = br#"{"error":{"message":"Rate limit reached for gpt-3.5-turbo in organization org-pR2Z3LP86Rl3jvVG0S9Kv3IT on requests per day (RPD): Limit 10000, Used 10000, Requested 1. Please try again in 8.64s. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Day));
        assert_eq!(signals.retry_delay, Some(ms(8640)));
        assert!(signals.rate_limited && !signals.overloaded);
    }

    #[test]
    fn a_groq_tokens_per_day_limit_reads_its_compound_wait() {
        // Captured message: https://github.com/continuedev/continue/issues/10920 (Groq,
        // llama-3.3-70b-versatile); its JSON wrapper constructed as Groq sends it
        // (https://github.com/danielmiessler/Fabric/issues/364 shows
        // `'type': 'tokens', 'code': 'rate_limit_exceeded'`).
        let body = br#"{"error":{"message":"Rate limit reached for model `llama-3.3-70b-versatile` in organization `org_01kjh7p9n8f1qs6nz2bz77vy6b` service tier `on_demand` on tokens per day (TPD): Limit 100000, Used 97050, Requested 3619. Please try again in 9m38.016s. Need more tokens? Upgrade to Dev Tier today at https://console.groq.com/settings/billing","type":"tokens","code":"rate_limit_exceeded"}}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Day));
        assert_eq!(signals.retry_delay, Some(ms(9 * 60_000 + 38_016)));
        assert!(signals.rate_limited);
    }

    #[test]
    fn openais_engine_overloaded_429_is_overload_not_a_rate_limit() {
        // Documented message (PROVIDERS.md, from OpenAI's error-code guide); `type` and `code`
        // as in captured overload answers ("That model is currently overloaded with other
        // requests", type server_error, code null:
        // https://github.com/ikechan8370/chatgpt-plugin/issues/125).
        let body = br#"{"error":{"message":"The engine is currently overloaded, please try again later","type":"server_error","param":null,"code":null}}"#;
        let signals = error_signals(body);
        assert!(signals.overloaded);
        assert!(!signals.rate_limited);
        assert_eq!(
            signals.retry_delay, None,
            "\"try again later\" names no wait"
        );
    }

    #[test]
    fn openais_responses_api_server_is_overloaded_code_is_overload() {
        // Captured: https://github.com/Wei-Shaw/sub2api/issues/6631 (the upstream detail of a
        // Responses API stream).
        let body = br#"{"error":{"code":"server_is_overloaded","message":"Our servers are currently overloaded. Please try again later.","param":null,"type":"service_unavailable_error"}}"#;
        let signals = error_signals(body);
        assert!(signals.overloaded && !signals.rate_limited);
    }

    #[test]
    fn openais_insufficient_quota_is_neither_a_rate_limit_nor_overload() {
        // Documented code (PROVIDERS.md: billing, permanent); message constructed.
        let body = br#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        assert_eq!(error_signals(body), ErrorSignals::default());
    }

    #[test]
    fn an_anthropic_rate_limit_error_names_its_minute() {
        // Documented type (PROVIDERS.md "Anthropic"); message constructed in Anthropic's wording.
        let body = br#"{"type":"error","error":{"type":"rate_limit_error","message":"This request would exceed the rate limit for your organization of 50,000 input tokens per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits."}}"#;
        let signals = error_signals(body);
        assert!(signals.rate_limited && !signals.overloaded);
        assert_eq!(signals.window, Some(QuotaWindow::Minute));
        assert_eq!(signals.retry_delay, None);
    }

    #[test]
    fn an_anthropic_overloaded_error_is_overload() {
        // Captured: https://github.com/anthropics/anthropic-sdk-typescript/issues/616 (a 529).
        let body =
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        let signals = error_signals(body);
        assert!(signals.overloaded && !signals.rate_limited);
    }

    #[test]
    fn a_gemini_per_minute_quota_gives_its_retry_delay() {
        // Constructed from the documented shape (PROVIDERS.md "Hints in the body"): one
        // per-minute violation and a RetryInfo of 31s.
        let body = br#"{"error":{"code":429,"message":"You exceeded your current quota, please check your plan and billing details.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier","quotaDimensions":{"location":"global","model":"gemini-2.0-flash"},"quotaValue":"15"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"31s"}]}}"#;
        assert_eq!(
            error_signals(body),
            ErrorSignals {
                retry_delay: Some(secs(31)),
                window: Some(QuotaWindow::Minute),
                overloaded: false,
                rate_limited: true,
            }
        );
    }

    #[test]
    fn a_gemini_per_day_quota_is_a_day_window() {
        // Captured: https://oppl.ai/llms/gemini_complex_1/JE00B3XR4V72.json (gemini-2.5-flash
        // free tier, quotaValue 250, a google.rpc.Help detail between the two that matter).
        let body = br#"{"error":{"code":429,"message":"You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaDimensions":{"location":"global","model":"gemini-2.5-flash"},"quotaValue":"250"}]},{"@type":"type.googleapis.com/google.rpc.Help","links":[{"description":"Learn more about Gemini API quotas","url":"https://ai.google.dev/gemini-api/docs/rate-limits"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"22s"}]}}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Day));
        assert_eq!(signals.retry_delay, Some(secs(22)));
        assert!(signals.rate_limited);
    }

    #[test]
    fn gemini_naming_a_day_and_a_minute_gives_the_day_and_the_longer_wait() {
        // Captured (a Gemini 429 pasted into a web page; the same three violations appear in
        // https://github.com/googleapis/python-genai/issues/2044): the day and the minute quota
        // both violated, the message's "retry in 10.689924287s" more precise than RetryInfo's
        // whole "10s".
        let body = br#"{"error":{"code":429,"message":"You exceeded your current quota, please check your plan and billing details. For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits. To monitor your current usage, head to: https://ai.dev/rate-limit. \n* Quota exceeded for metric: generativelanguage.googleapis.com/generate_content_free_tier_requests, limit: 0, model: gemini-2.0-flash\n* Quota exceeded for metric: generativelanguage.googleapis.com/generate_content_free_tier_input_token_count, limit: 0, model: gemini-2.0-flash\nPlease retry in 10.689924287s.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.Help","links":[{"description":"Learn more about Gemini API quotas","url":"https://ai.google.dev/gemini-api/docs/rate-limits"}]},{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerDayPerProjectPerModel-FreeTier","quotaDimensions":{"location":"global","model":"gemini-2.0-flash"}},{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_requests","quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier","quotaDimensions":{"model":"gemini-2.0-flash","location":"global"}},{"quotaMetric":"generativelanguage.googleapis.com/generate_content_free_tier_input_token_count","quotaId":"GenerateContentInputTokensPerModelPerMinute-FreeTier","quotaDimensions":{"location":"global","model":"gemini-2.0-flash"}}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"10s"}]}}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Day));
        assert_eq!(
            signals.retry_delay,
            Some(Duration::from_nanos(10_689_924_287))
        );
        assert!(signals.rate_limited);
    }

    #[test]
    fn a_gemini_error_inside_an_array_is_read_like_a_bare_one() {
        // Constructed: the per-minute body above as the one element of an array (PROVIDERS.md:
        // "Some responses are a JSON array around the error object").
        let body = br#"[{"error":{"code":429,"message":"Quota exceeded.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure","violations":[{"quotaId":"GenerateRequestsPerMinutePerProjectPerModel-FreeTier"}]},{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"1.5s"}]}}]"#;
        assert_eq!(
            error_signals(body),
            ErrorSignals {
                retry_delay: Some(ms(1500)),
                window: Some(QuotaWindow::Minute),
                overloaded: false,
                rate_limited: true,
            }
        );
    }

    #[test]
    fn googles_error_info_quota_limit_names_the_window_too() {
        // Constructed: the ErrorInfo of
        // https://github.com/google-gemini/deprecated-generative-ai-python/issues/206 (printed in
        // protobuf text there) in its JSON form.
        let body = br#"{"error":{"code":429,"message":"Quota exceeded for quota metric 'Generate Content API requests per minute' and limit 'GenerateContent request limit per minute for a region' of service 'generativelanguage.googleapis.com'.","status":"RESOURCE_EXHAUSTED","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"RATE_LIMIT_EXCEEDED","domain":"googleapis.com","metadata":{"quota_limit":"GenerateContentRequestsPerMinutePerProjectPerRegion","quota_limit_value":"0"}}]}}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Minute));
        assert!(signals.rate_limited);
    }

    #[test]
    fn a_bare_resource_exhausted_from_ai_studio_is_a_rate_limit_without_a_window() {
        // Captured: https://github.com/google-gemini/gemini-cli/issues/1906 (the inner body of
        // the CLI's wrapper).
        let body = br#"{"error":{"code":429,"message":"Resource has been exhausted (e.g. check quota).","status":"RESOURCE_EXHAUSTED"}}"#;
        let signals = error_signals(body);
        assert!(signals.rate_limited && !signals.overloaded);
        assert_eq!(signals.window, None);
    }

    #[test]
    fn vertexs_pay_as_you_go_resource_exhausted_is_a_busy_shared_pool() {
        // Captured: https://github.com/google-gemini/gemini-cli/issues/14811, array-wrapped, with
        // Google's older `errors[].reason`. Vertex's error-code-429 page says this message means
        // the shared pay-as-you-go pool had no capacity, whatever the reason field says.
        let body = br#"[{
            "error": {
              "code": 429,
              "message": "Resource exhausted. Please try again later. Please refer to https://cloud.google.com/vertex-ai/generative-ai/docs/error-code-429 for more details.",
              "errors": [
                {
                  "message": "Resource exhausted. Please try again later. Please refer to https://cloud.google.com/vertex-ai/generative-ai/docs/error-code-429 for more details.",
                  "domain": "global",
                  "reason": "rateLimitExceeded"
                }
              ],
              "status": "RESOURCE_EXHAUSTED"
            }
          }
        ]"#;
        let signals = error_signals(body);
        assert!(signals.overloaded);
        assert!(!signals.rate_limited);
    }

    #[test]
    fn gemini_unavailable_is_overload() {
        // Captured: https://github.com/google-gemini/gemini-cli/issues/5191 (a 503); the second
        // from https://github.com/continuedev/continue/issues/10639, the same status with
        // "This model is currently experiencing high demand".
        let body = br#"{"error":{"code":503,"message":"The model is overloaded. Please try again later.","status":"UNAVAILABLE"}}"#;
        let signals = error_signals(body);
        assert!(signals.overloaded && !signals.rate_limited);
        let demand = br#"{"error":{"code":503,"message":"This model is currently experiencing high demand. Spikes in demand are usually temporary. Please try again later.","status":"UNAVAILABLE"}}"#;
        assert!(error_signals(demand).overloaded);
    }

    #[test]
    fn a_bare_error_string_is_read_as_the_message() {
        // Constructed: the `{"error": "..."}` some gateways send.
        let body = br#"{"error":"Too many requests: 100 requests per minute. Try again in 20s."}"#;
        let signals = error_signals(body);
        assert_eq!(signals.window, Some(QuotaWindow::Minute));
        assert_eq!(signals.retry_delay, Some(secs(20)));
    }

    #[test]
    fn a_wait_in_words_is_no_wait() {
        let body =
            br#"{"error":{"message":"Please try again in an hour.","code":"rate_limit_exceeded"}}"#;
        assert_eq!(error_signals(body).retry_delay, None);
    }

    #[test]
    fn anything_else_says_nothing() {
        let deep_array = "[".repeat(100_000);
        let deep_object = r#"{"error":"#.repeat(50_000);
        let bodies: [&[u8]; 10] = [
            b"",
            b"   ",
            b"not json",
            b"\xff\xfe\x00garbage\x80",
            b"null",
            b"429",
            b"[]",
            br#"{"id":"chatcmpl-1","choices":[]}"#,
            deep_array.as_bytes(),
            deep_object.as_bytes(),
        ];
        for body in bodies {
            assert_eq!(
                error_signals(body),
                ErrorSignals::default(),
                "{:?}",
                String::from_utf8_lossy(&body[..body.len().min(40)])
            );
        }
    }

    #[test]
    fn members_of_the_wrong_type_are_ignored() {
        let body = br#"{"error":{"code":429,"message":17,"status":["RESOURCE_EXHAUSTED"],"details":{"retryDelay":"5s"},"errors":"x"}}"#;
        assert_eq!(error_signals(body), ErrorSignals::default());
        let body = br#"{"error":{"status":"RESOURCE_EXHAUSTED","details":[7,null,{"retryDelay":12},{"violations":[1,{"quotaId":null}]}]}}"#;
        let signals = error_signals(body);
        assert!(signals.rate_limited);
        assert_eq!((signals.retry_delay, signals.window), (None, None));
    }

    #[test]
    fn a_huge_retry_delay_is_capped() {
        let body =
            br#"{"error":{"status":"RESOURCE_EXHAUSTED","details":[{"retryDelay":"999999999s"}]}}"#;
        assert_eq!(error_signals(body).retry_delay, Some(MAX_HINT));
    }

    #[test]
    fn window_spellings_are_found_in_ids_metrics_and_prose() {
        let table = [
            (
                "GenerateRequestsPerMinutePerProjectPerModel",
                Some(QuotaWindow::Minute),
            ),
            (
                "GenerateRequestsPerDayPerProjectPerModel-FreeTier",
                Some(QuotaWindow::Day),
            ),
            (
                "aiplatform.googleapis.com/embed_content_input_tokens_per_minute_per_base_model",
                Some(QuotaWindow::Minute),
            ),
            ("requests per hour", Some(QuotaWindow::Hour)),
            ("tokens per min (TPM)", Some(QuotaWindow::Minute)),
            ("per minute and per day", Some(QuotaWindow::Day)),
            ("permission denied", None),
            ("", None),
        ];
        for (text, want) in table {
            assert_eq!(window_named(text), want, "{text:?}");
        }
    }

    proptest! {
        #[test]
        fn no_bytes_make_it_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = error_signals(&body);
        }

        #[test]
        fn no_error_shaped_json_makes_it_panic(
            message in "\\PC{0,80}",
            code in "[a-zA-Z_]{0,24}",
            delay in "\\PC{0,12}",
            id in "[a-zA-Z_-]{0,40}",
        ) {
            let body = serde_json::json!([{"error": {
                "message": message, "code": code, "type": code, "status": code,
                "details": [{"retryDelay": delay}, {"violations": [{"quotaId": id}]}],
            }}]);
            let signals = error_signals(body.to_string().as_bytes());
            prop_assert!(signals.retry_delay.is_none_or(|d| d <= MAX_HINT));
        }
    }
}
