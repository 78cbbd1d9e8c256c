//! One classifier of attempt outcomes, shared by retry, breaker, learner and metrics.

use http::{HeaderMap, Response, StatusCode};

use crate::error::ProxyError;

/// What one attempt came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 1xx-3xx.
    Success,
    /// 429 or 529: the upstream asks us to slow down.
    Throttled(u16),
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
            Ok(response) => Self::of_status(response.status()),
            Err(ProxyError::TryTimeout { .. }) => Self::Timeout,
            Err(ProxyError::UpstreamConnect { .. } | ProxyError::UpstreamReset { .. }) => {
                Self::Transport
            }
            Err(_) => Self::Local,
        }
    }

    pub fn of_status(status: StatusCode) -> Self {
        match status.as_u16() {
            429 | 529 => Self::Throttled(status.as_u16()),
            s @ 500..=599 => Self::ServerError(s),
            s @ 400..=499 => Self::ClientError(s),
            _ => Self::Success,
        }
    }

    /// The upstream is unwell: any 5xx (529 "overloaded" included), a timeout, a connection
    /// error. This is what the breaker counts against the upstream's health. A 429 is not: it
    /// is about the caller's quota, not the upstream's health (the breaker counts it only with
    /// `count_throttles`, see `stack::breaker`).
    pub fn is_upstream_failure(self) -> bool {
        matches!(
            self,
            Self::Throttled(529) | Self::ServerError(_) | Self::Timeout | Self::Transport
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
            Self::Throttled(429) => "429",
            Self::Throttled(_) => "529",
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

/// The upstream's `x-should-retry: true|false`, which overrides the status rule.
pub fn should_retry_header(headers: &HeaderMap) -> Option<bool> {
    const SHOULD_RETRY: http::HeaderName = http::HeaderName::from_static("x-should-retry");
    match headers.get(SHOULD_RETRY)?.to_str().ok()?.trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        let s = |c: u16| Outcome::of_status(StatusCode::from_u16(c).unwrap());
        assert_eq!(s(200), Outcome::Success);
        assert_eq!(s(429), Outcome::Throttled(429));
        assert_eq!(s(529), Outcome::Throttled(529));
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
}
