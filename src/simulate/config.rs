//! `corral simulate` flags ([`SimulateArgs`]) and the validated [`SimConfig`] built from them.

use std::net::SocketAddr;
use std::time::Duration;

/// What `x-ratelimit-limit-requests` (and Anthropic's `-limit`) reports.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LimitReport {
    /// The bucket capacity (burst size).
    #[default]
    Capacity,
    /// The refill rate in effect (it follows `--refill-change`) times 60; `remaining` is
    /// shifted so that `(limit - remaining) / reset` still equals the refill rate.
    PerMinute,
    /// Enforcement stays `--capacity`/`--refill` (e.g. 20 at 20/s: "1,200 RPM enforced as 20
    /// per second"), but the request headers describe a per-minute shadow bucket: `limit` is
    /// the refill rate in effect times 60, `remaining` what is left of a bucket of that size
    /// that starts full, is charged one per admitted request and refills at the same rate,
    /// `reset` the time until it is full. `remaining` is large when a 429 arrives (the report
    /// hides the burst) while `(limit - remaining) / reset` is still the refill rate. Token
    /// headers (`--tpm`) are reported as in `capacity` mode.
    Quantized,
}

/// Which rate-limit headers the OpenAI route (`/v1/chat/completions`) sends; the Anthropic
/// route always sends Anthropic's.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderStyle {
    /// `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` with Go duration resets
    /// ("1.5s"); a 429 adds `retry-after` (whole seconds) and `retry-after-ms`.
    #[default]
    #[value(name = "openai")]
    OpenAi,
    /// Azure OpenAI: the same names, but resets in whole seconds rounded up ("2"); a 429 adds
    /// `retry-after` (whole seconds) and `x-ms-retry-after-ms`.
    Azure,
    /// No rate-limit headers and no retry hint (neither header nor "try again in" in the
    /// message): a bare 429 with OpenAI's error JSON.
    None,
}

/// `AT=RATE`: from `AT` after start (or the last reset) on, the request refill rate is `RATE`/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RefillChange {
    /// When the rate changes, from start or the last reset.
    pub at: Duration,
    /// The new refill rate, per second.
    pub rate: f64,
}

/// `AT+DURATION`: admitted requests arriving in `[AT, AT+DURATION)` after start (or the last
/// reset) are answered 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailWindow {
    /// Start of the window, from start or the last reset.
    pub at: Duration,
    /// Length of the window; validation refuses 0.
    pub duration: Duration,
}

impl FailWindow {
    /// Whether an arrival `offset` after start (or the last reset) falls in the window.
    pub fn contains(&self, offset: Duration) -> bool {
        offset
            .checked_sub(self.at)
            .is_some_and(|into| into < self.duration)
    }
}

/// Flags of `corral simulate`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Request bucket capacity (burst size); the bucket starts full.
    #[arg(long, default_value_t = 50)]
    pub capacity: u32,
    /// Request bucket refill, in requests per second.
    #[arg(long, default_value_t = 20.0)]
    pub refill: f64,
    /// Optional tokens-per-minute bucket (prompt chars/4 + max_tokens per request).
    #[arg(long)]
    pub tpm: Option<u64>,
    /// What the `limit` rate-limit headers report.
    #[arg(long, value_enum, default_value_t = LimitReport::Capacity)]
    pub limit_report: LimitReport,
    /// Rate-limit headers of the OpenAI route: OpenAI's, Azure's, or none at all.
    #[arg(long, value_enum, default_value_t = HeaderStyle::OpenAi)]
    pub header_style: HeaderStyle,
    /// Queue mode (a vLLM-like backend): serve at most N admitted requests at once; the rest
    /// wait in a FIFO queue, refused by nothing, and their service time starts when they get a
    /// slot. The buckets still apply: give a large `--capacity`/`--refill` (and perhaps
    /// `--header-style none`) for a backend that never answers 429.
    #[arg(long, value_name = "N")]
    pub queue_slots: Option<u32>,
    /// Time to answer an admitted request (e.g. "200ms").
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
    pub service_time: Duration,
    /// Uniform extra service time in `0..=jitter`.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub service_jitter: Duration,
    /// `AT=RATE` (e.g. `10s=10`): change the refill rate AT after start; repeatable.
    #[arg(long = "refill-change", value_parser = parse_refill_change)]
    pub refill_changes: Vec<RefillChange>,
    /// Fraction (0..1) of admitted requests answered 503.
    #[arg(long = "fail-503", default_value_t = 0.0)]
    pub fail_503: f64,
    /// `AT+DURATION` (e.g. `0s+150ms`, `5s+1s`): answer 503 to every admitted request arriving
    /// in that window after start (or the last `/_reset`), as `--fail-503` does; repeatable.
    #[arg(long = "fail-503-window", value_name = "AT+DURATION", value_parser = parse_fail_window)]
    pub fail_503_windows: Vec<FailWindow>,
    /// Fraction (0..1) of admitted requests answered 529 (overloaded).
    #[arg(long = "fail-529", default_value_t = 0.0)]
    pub fail_529: f64,
    /// Fraction (0..1) of admitted requests whose connection is closed without a response.
    #[arg(long = "fail-reset", default_value_t = 0.0)]
    pub fail_reset: f64,
    /// Extra delay before the response head for `--slow-fraction` of admitted requests.
    #[arg(long, default_value = "0ms", value_parser = humantime::parse_duration)]
    pub slow_first_byte: Duration,
    /// Fraction (0..1) of admitted requests delayed by `--slow-first-byte`.
    #[arg(long, default_value_t = 0.0)]
    pub slow_fraction: f64,
    /// Number of content events in a streamed (SSE) answer.
    #[arg(long, default_value_t = 8)]
    pub stream_chunks: u32,
    /// Delay between streamed content events.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub stream_interval: Duration,
    /// Seed for jitter and fault rolls (random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Validated simulator settings; [`Default`] matches the flag defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// `--listen`: address `corral simulate` binds (a library user passes a listener to
    /// [`Simulator::serve`](super::Simulator::serve) instead).
    pub listen: SocketAddr,
    /// `--capacity`: request bucket size (burst); the bucket starts full.
    pub capacity: u32,
    /// `--refill`: request bucket refill per second before any `refill_changes`.
    pub refill: f64,
    /// `--tpm`: tokens-per-minute bucket (capacity and per-minute refill); `None`: none.
    pub tpm: Option<u64>,
    /// `--limit-report`: what the request rate-limit headers describe.
    pub limit_report: LimitReport,
    /// `--header-style`: rate-limit headers of the OpenAI route.
    pub header_style: HeaderStyle,
    /// `--queue-slots`: at most this many admitted requests are served at once, the rest
    /// wait in FIFO order (a stream holds its slot until its last event). `None`: no queue.
    pub queue_slots: Option<u32>,
    /// `--service-time`: time to answer an admitted request (after any queue wait).
    pub service_time: Duration,
    /// `--service-jitter`: uniform extra service time in `0..=service_jitter`.
    pub service_jitter: Duration,
    /// `--refill-change`: request refill rate changes, sorted by `at`.
    pub refill_changes: Vec<RefillChange>,
    /// `--fail-503`: fraction of admitted requests answered 503.
    pub fail_503: f64,
    /// `--fail-503-window`: arrival windows whose admitted requests are all answered 503;
    /// sorted by `at`, each longer than 0.
    pub fail_503_windows: Vec<FailWindow>,
    /// `--fail-529`: fraction of admitted requests answered 529.
    pub fail_529: f64,
    /// `--fail-reset`: fraction of admitted requests whose connection is closed unanswered.
    pub fail_reset: f64,
    /// `--slow-first-byte`: extra delay before the head for `slow_fraction` of requests.
    pub slow_first_byte: Duration,
    /// `--slow-fraction`: fraction of admitted requests delayed by `slow_first_byte`.
    pub slow_fraction: f64,
    /// `--stream-chunks`: content events in a streamed answer (at least 1).
    pub stream_chunks: u32,
    /// `--stream-interval`: delay between streamed content events.
    pub stream_interval: Duration,
    /// `--seed`: seed for jitter and fault rolls; `None`: random.
    pub seed: Option<u64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            capacity: 50,
            refill: 20.0,
            tpm: None,
            limit_report: LimitReport::Capacity,
            header_style: HeaderStyle::OpenAi,
            queue_slots: None,
            service_time: Duration::from_millis(200),
            service_jitter: Duration::ZERO,
            refill_changes: Vec::new(),
            fail_503: 0.0,
            fail_503_windows: Vec::new(),
            fail_529: 0.0,
            fail_reset: 0.0,
            slow_first_byte: Duration::ZERO,
            slow_fraction: 0.0,
            stream_chunks: 8,
            stream_interval: Duration::from_millis(20),
            seed: None,
        }
    }
}

/// A flag value that parsed but makes no sense.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("`--capacity` must be at least 1")]
    ZeroCapacity,
    #[error("`--tpm` must be at least 1")]
    ZeroTpm,
    #[error("`--{flag}` must be a finite rate >= 0, got {value}")]
    BadRate { flag: &'static str, value: f64 },
    #[error("`--{flag}` must be a fraction in 0..=1, got {value}")]
    BadFraction { flag: &'static str, value: f64 },
    #[error("`--fail-503` + `--fail-529` + `--fail-reset` must not exceed 1, got {sum}")]
    FaultsOverOne { sum: f64 },
    #[error("`--stream-chunks` must be at least 1")]
    ZeroChunks,
    #[error("`--queue-slots` must be at least 1")]
    ZeroQueueSlots,
    #[error("`--fail-503-window` must last longer than 0, got `{}+0s`", humantime::format_duration(*at))]
    EmptyFailWindow { at: Duration },
}

impl SimulateArgs {
    /// Validates the flags; same as `SimConfig::try_from(self)`.
    pub fn into_config(self) -> Result<SimConfig, ConfigError> {
        SimConfig::try_from(self)
    }
}

impl TryFrom<SimulateArgs> for SimConfig {
    type Error = ConfigError;

    fn try_from(a: SimulateArgs) -> Result<Self, ConfigError> {
        if a.capacity == 0 {
            return Err(ConfigError::ZeroCapacity);
        }
        if a.tpm == Some(0) {
            return Err(ConfigError::ZeroTpm);
        }
        check_rate("refill", a.refill)?;
        for change in &a.refill_changes {
            check_rate("refill-change", change.rate)?;
        }
        for (flag, value) in [
            ("fail-503", a.fail_503),
            ("fail-529", a.fail_529),
            ("fail-reset", a.fail_reset),
            ("slow-fraction", a.slow_fraction),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(ConfigError::BadFraction { flag, value });
            }
        }
        let sum = a.fail_503 + a.fail_529 + a.fail_reset;
        if sum > 1.0 + 1e-9 {
            return Err(ConfigError::FaultsOverOne { sum });
        }
        if a.stream_chunks == 0 {
            return Err(ConfigError::ZeroChunks);
        }
        if a.queue_slots == Some(0) {
            return Err(ConfigError::ZeroQueueSlots);
        }
        if let Some(w) = a.fail_503_windows.iter().find(|w| w.duration.is_zero()) {
            return Err(ConfigError::EmptyFailWindow { at: w.at });
        }
        let mut refill_changes = a.refill_changes;
        refill_changes.sort_by_key(|c| c.at);
        let mut fail_503_windows = a.fail_503_windows;
        fail_503_windows.sort_by_key(|w| w.at);
        Ok(Self {
            listen: a.listen,
            capacity: a.capacity,
            refill: a.refill,
            tpm: a.tpm,
            limit_report: a.limit_report,
            header_style: a.header_style,
            queue_slots: a.queue_slots,
            service_time: a.service_time,
            service_jitter: a.service_jitter,
            refill_changes,
            fail_503: a.fail_503,
            fail_503_windows,
            fail_529: a.fail_529,
            fail_reset: a.fail_reset,
            slow_first_byte: a.slow_first_byte,
            slow_fraction: a.slow_fraction,
            stream_chunks: a.stream_chunks,
            stream_interval: a.stream_interval,
            seed: a.seed,
        })
    }
}

fn check_rate(flag: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::BadRate { flag, value })
    }
}

/// clap value parser for `AT=RATE`.
pub fn parse_refill_change(s: &str) -> Result<RefillChange, String> {
    let (at, rate) = s
        .split_once('=')
        .ok_or_else(|| format!("expected AT=RATE (e.g. `10s=10`), got `{s}`"))?;
    let at = humantime::parse_duration(at.trim()).map_err(|e| format!("AT `{at}`: {e}"))?;
    let rate: f64 = rate
        .trim()
        .parse()
        .map_err(|e| format!("RATE `{rate}`: {e}"))?;
    Ok(RefillChange { at, rate })
}

/// clap value parser for `AT+DURATION`.
pub fn parse_fail_window(s: &str) -> Result<FailWindow, String> {
    let (at, duration) = s
        .split_once('+')
        .ok_or_else(|| format!("expected AT+DURATION (e.g. `5s+1s`), got `{s}`"))?;
    let at = humantime::parse_duration(at.trim()).map_err(|e| format!("AT `{at}`: {e}"))?;
    let duration = humantime::parse_duration(duration.trim())
        .map_err(|e| format!("DURATION `{duration}`: {e}"))?;
    Ok(FailWindow { at, duration })
}

#[cfg(test)]
mod tests;
