//! What a provider's response headers say, parsed once for everyone who needs it: the retry hint
//! (`retry-after-ms`, `x-ms-retry-after-ms`, `retry-after`, the reset of an exhausted bucket),
//! read by retry and by the rate limiter's pause, and the per-bucket rate-limit report (`limit`,
//! `remaining`, `reset` of OpenAI's, Anthropic's and Azure's header families), read by the learner.
//!
//! These are pure functions of a `HeaderMap` and the wall clock: no state, no I/O. What the
//! headers say is a hint; what the upstream does (a 429 while `remaining` claims headroom) is the
//! truth, and the learner (`stack::rate_limit::learn`) decides which to believe.

pub mod body;
pub mod hints;
mod report;

pub use self::body::{error_signals, ErrorSignals, QuotaWindow};
pub use self::hints::retry_hint;
pub use self::report::{report, reports, Report};

/// Which bucket a report describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

impl Kind {
    pub fn label(self) -> &'static str {
        match self {
            Kind::Requests => "requests",
            Kind::Tokens => "tokens",
        }
    }
}

/// A `HeaderMap` from `(name, value)` pairs, for tests.
#[cfg(test)]
pub fn header_map(pairs: &[(&str, &str)]) -> http::HeaderMap {
    pairs
        .iter()
        .map(|(k, v)| {
            (
                http::HeaderName::from_bytes(k.as_bytes()).expect("a header name"),
                v.parse().expect("a header value"),
            )
        })
        .collect()
}
