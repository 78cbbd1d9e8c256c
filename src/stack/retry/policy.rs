//! Classification: may this answer be retried, and why? (The schedule lives in `backoff`,
//! `crate::provider`'s hints and the budget.)

use http::response::Parts;

use crate::classify::{is_permanent_answer, should_retry_header, Outcome};
use crate::config::RetryConfig;

/// The verdict on one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Hand it to the client.
    Done,
    /// Try again, for this reason (a metric label).
    Retry(&'static str),
}

/// Server errors that name something no retry changes: not implemented, an HTTP version or a
/// negotiation the server refuses, a loop, a network login it requires.
const PERMANENT_5XX: [u16; 5] = [501, 505, 506, 508, 511];

/// Whether an answer corral judged [`Verdict::Done`] is one the official SDKs would retry
/// though no retry cures it (a permanent 429 such as `insufficient_quota`, or a 5xx of
/// [`PERMANENT_5XX`]), and the upstream did not say either way: it is handed back marked
/// `x-should-retry: false`, so a client does not spend 10 s on two more refusals.
pub fn futile(parts: &Parts) -> bool {
    let status = parts.status.as_u16();
    (status == 429 || PERMANENT_5XX.contains(&status))
        && should_retry_header(&parts.headers).is_none()
}

/// Judge an upstream response head (and, for 429s, its buffered body).
pub fn judge_response(parts: &Parts, body: &[u8], config: &RetryConfig) -> Verdict {
    let outcome = Outcome::of_head(parts.status, &parts.extensions);
    // What the official SDKs retry (408, 409, 429 and every 5xx), but for the 5xx that say no
    // retry can cure them: an answer one of them would have retried is never handed back
    // untried to a client that leaves its retries to corral (a 520-524 from a CDN in front of
    // the provider, a 409 lock conflict).
    let transient = matches!(outcome, Outcome::ClientError(408 | 409));
    let by_status = match outcome {
        Outcome::Throttled(_) => !is_permanent_answer(parts, body, config),
        Outcome::Overloaded(_) => true,
        Outcome::ServerError(500) => config.retry_500,
        Outcome::ServerError(s) => !PERMANENT_5XX.contains(&s),
        _ => transient,
    };
    let retry = should_retry_header(&parts.headers).unwrap_or(by_status);
    if retry && (transient || !matches!(outcome, Outcome::Success | Outcome::ClientError(_))) {
        Verdict::Retry(outcome.label())
    } else if retry && should_retry_header(&parts.headers) == Some(true) {
        Verdict::Retry("should_retry")
    } else {
        Verdict::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::WAIT_HEADERS;
    use http::Response;

    fn parts(status: u16, headers: &[(&str, &str)]) -> Parts {
        let mut b = Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn status_rules() {
        let c = RetryConfig::default();
        for s in [
            408, 409, 429, 529, 500, 502, 503, 504, 507, 520, 522, 524, 599,
        ] {
            assert!(
                matches!(judge_response(&parts(s, &[]), b"", &c), Verdict::Retry(_)),
                "{s}"
            );
        }
        for s in [200, 400, 401, 403, 404, 413, 422, 501, 505, 511] {
            assert_eq!(
                judge_response(&parts(s, &[]), b"", &c),
                Verdict::Done,
                "{s}"
            );
        }
        let no500 = RetryConfig {
            retry_500: false,
            ..RetryConfig::default()
        };
        assert_eq!(judge_response(&parts(500, &[]), b"", &no500), Verdict::Done);
    }

    #[test]
    fn should_retry_header_overrides() {
        let c = RetryConfig::default();
        assert_eq!(
            judge_response(&parts(503, &[("x-should-retry", "false")]), b"", &c),
            Verdict::Done
        );
        assert_eq!(
            judge_response(&parts(400, &[("x-should-retry", "true")]), b"", &c),
            Verdict::Retry("should_retry")
        );
        assert_eq!(
            judge_response(&parts(409, &[("x-should-retry", "false")]), b"", &c),
            Verdict::Done
        );
    }

    #[test]
    fn permanent_429s() {
        let c = RetryConfig {
            permanent_codes: vec!["org_banned".into()],
            ..RetryConfig::default()
        };
        let quota = br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert_eq!(
            judge_response(&parts(429, &[("retry-after", "1")]), quota, &c),
            Verdict::Done
        );
        let spend = br#"{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified API usage limits (spend limit)."}}"#;
        assert_eq!(judge_response(&parts(429, &[]), spend, &c), Verdict::Done);
        // The same message with a named wait, in any of its headers, is a throttle.
        for wait in WAIT_HEADERS {
            assert_eq!(
                judge_response(&parts(429, &[(wait, "1000")]), spend, &c),
                Verdict::Retry("429"),
                "{wait}"
            );
        }
        let configured = br#"{"error":{"code":"org_banned","message":"x"}}"#;
        assert_eq!(
            judge_response(&parts(429, &[]), configured, &c),
            Verdict::Done
        );
        let transient =
            br#"{"error":{"code":"rate_limit_exceeded","message":"Rate limit reached"}}"#;
        assert_eq!(
            judge_response(&parts(429, &[("retry-after", "1")]), transient, &c),
            Verdict::Retry("429")
        );
        assert_eq!(
            judge_response(&parts(429, &[]), b"not json", &c),
            Verdict::Retry("429")
        );
    }

    /// What the SDKs would retry though no retry cures it is marked for them, unless the
    /// upstream said either way; a client error is the client's to read.
    #[test]
    fn futile_answers_are_the_ones_the_sdks_would_retry_in_vain() {
        for (status, headers, futile_) in [
            (429, &[][..], true),
            (501, &[][..], true),
            (505, &[][..], true),
            (511, &[][..], true),
            (429, &[("x-should-retry", "false")][..], false),
            (501, &[("x-should-retry", "true")][..], false),
            (500, &[][..], false),
            (503, &[][..], false),
            (400, &[][..], false),
            (404, &[][..], false),
        ] {
            assert_eq!(
                futile(&parts(status, headers)),
                futile_,
                "{status} {headers:?}"
            );
        }
    }
}
