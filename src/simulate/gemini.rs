//! Gemini-shaped 429 bodies (`--header-style gemini`): the hint is in the body.
//!
//! Gemini (also through its OpenAI-compatible endpoint) sends no `retry-after` and no
//! rate-limit headers. Its 429 is `RESOURCE_EXHAUSTED` with `error.details`: a
//! `google.rpc.QuotaFailure` whose violation names the quota (`quotaId` says the window, e.g.
//! `GenerateRequestsPerMinutePerProjectPerModel` or `...PerDay...`) and a
//! `google.rpc.RetryInfo` whose `retryDelay` is a protobuf duration string ("31s", "1.5s").
//! Some answers wrap the error object in a JSON array.

use std::time::Duration;

use bytes::Bytes;
use serde_json::json;

use super::headers::ceil_millis;

/// Which Gemini quota a refusal names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quota {
    RequestsPerMinute,
    InputTokensPerMinute,
    RequestsPerDay,
}

impl Quota {
    fn metric(self) -> &'static str {
        match self {
            Quota::RequestsPerMinute => "generativelanguage.googleapis.com/generate_requests",
            Quota::InputTokensPerMinute => {
                "generativelanguage.googleapis.com/generate_content_input_token_count"
            }
            Quota::RequestsPerDay => "generativelanguage.googleapis.com/generate_requests_per_day",
        }
    }

    fn id(self) -> &'static str {
        match self {
            Quota::RequestsPerMinute => "GenerateRequestsPerMinutePerProjectPerModel",
            Quota::InputTokensPerMinute => "GenerateContentInputTokensPerModelPerMinute",
            Quota::RequestsPerDay => "GenerateRequestsPerDayPerProjectPerModel",
        }
    }
}

/// A 429 `RESOURCE_EXHAUSTED` naming `quota` (of `limit`, for `model`), whose `RetryInfo`
/// says `retry_delay`; with `array`, wrapped in a JSON array.
pub fn resource_exhausted(
    quota: Quota,
    limit: u64,
    model: &str,
    retry_delay: Duration,
    array: bool,
) -> Bytes {
    let message = format!(
        "You exceeded your current quota, please check your plan and billing details \
         (corral simulate). Quota exceeded for metric: {}, limit: {limit}, model: {model}",
        quota.metric()
    );
    let error = json!({
        "error": {
            "code": 429,
            "message": message,
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.QuotaFailure",
                    "violations": [{
                        "quotaMetric": quota.metric(),
                        "quotaId": quota.id(),
                        "quotaDimensions": {"location": "global", "model": model},
                        "quotaValue": limit.to_string(),
                    }],
                },
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": retry_delay_string(retry_delay),
                },
            ],
        },
    });
    let body = if array { json!([error]) } else { error };
    serde_json::to_vec(&body)
        .expect("a Value always serializes")
        .into()
}

/// A protobuf JSON duration in seconds, rounded up to the millisecond so a client that obeys
/// it never comes back early: "1.5s", "0.05s", "31s".
pub fn retry_delay_string(d: Duration) -> String {
    let ms = ceil_millis(d);
    let (secs, frac) = (ms / 1000, ms % 1000);
    if frac == 0 {
        format!("{secs}s")
    } else {
        let digits = format!("{frac:03}");
        format!("{secs}.{}s", digits.trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn retry_delays_are_fractional_seconds_rounded_up() {
        let ms = Duration::from_millis;
        assert_eq!(retry_delay_string(ms(1500)), "1.5s");
        assert_eq!(retry_delay_string(ms(50)), "0.05s");
        assert_eq!(retry_delay_string(ms(31_000)), "31s");
        assert_eq!(
            retry_delay_string(Duration::from_micros(1_234_001)),
            "1.235s"
        );
        assert_eq!(retry_delay_string(Duration::ZERO), "0s");
    }

    #[test]
    fn the_body_names_the_quota_and_the_delay() {
        let body = resource_exhausted(
            Quota::RequestsPerMinute,
            50,
            "gemini-x",
            Duration::from_millis(1500),
            false,
        );
        let v: Value = serde_json::from_slice(&body).unwrap();
        let e = &v["error"];
        assert_eq!(
            (e["code"].as_u64(), e["status"].as_str()),
            (Some(429), Some("RESOURCE_EXHAUSTED"))
        );
        let details = e["details"].as_array().unwrap();
        assert_eq!(
            details[0]["@type"],
            "type.googleapis.com/google.rpc.QuotaFailure"
        );
        let violation = &details[0]["violations"][0];
        assert_eq!(
            violation["quotaId"],
            "GenerateRequestsPerMinutePerProjectPerModel"
        );
        assert_eq!(violation["quotaValue"], "50");
        assert_eq!(
            details[1]["@type"],
            "type.googleapis.com/google.rpc.RetryInfo"
        );
        assert_eq!(details[1]["retryDelay"], "1.5s");
    }

    #[test]
    fn an_array_body_wraps_the_same_error() {
        let day = Duration::from_secs(3600);
        let plain = resource_exhausted(Quota::RequestsPerDay, 9, "m", day, false);
        let wrapped = resource_exhausted(Quota::RequestsPerDay, 9, "m", day, true);
        let plain: Value = serde_json::from_slice(&plain).unwrap();
        let wrapped: Value = serde_json::from_slice(&wrapped).unwrap();
        assert_eq!(wrapped, Value::Array(vec![plain.clone()]));
        let id = &plain["error"]["details"][0]["violations"][0]["quotaId"];
        assert_eq!(id, "GenerateRequestsPerDayPerProjectPerModel");
    }
}
