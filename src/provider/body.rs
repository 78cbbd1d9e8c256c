//! What an error body says (placeholder: replaced by the full parser).

use std::time::Duration;

/// The window a quota names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaWindow {
    Minute,
    Hour,
    Day,
}

/// What an error body says about a refusal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorSignals {
    pub retry_delay: Option<Duration>,
    pub window: Option<QuotaWindow>,
    pub overloaded: bool,
    pub rate_limited: bool,
}

pub fn error_signals(body: &[u8]) -> ErrorSignals {
    let text = String::from_utf8_lossy(body).to_ascii_lowercase();
    ErrorSignals {
        retry_delay: None,
        window: None,
        overloaded: text.contains("overloaded"),
        rate_limited: text.contains("rate_limit_exceeded") || text.contains("rate_limit_error"),
    }
}
