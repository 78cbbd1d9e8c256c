//! `corral simulate` flags ([`SimulateArgs`]) and the validated [`SimConfig`] built from them.

use std::net::SocketAddr;
use std::time::Duration;

pub use super::tail::{parse_service_tail, ServiceTail};

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
    /// Gemini: no rate-limit headers and no `retry-after`; a 429 is Gemini's JSON,
    /// `{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "message", "details"}}`, whose
    /// details carry a `google.rpc.QuotaFailure` naming the window in its `quotaId` and a
    /// `google.rpc.RetryInfo` whose `retryDelay` ("1.5s") is the true wait. With
    /// `--gemini-array` some of them come wrapped in a JSON array.
    Gemini,
}

/// `MODEL=CAPACITY@REFILL`: requests naming `model` draw on a bucket of their own.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelLimit {
    /// The request body's `model`, matched exactly.
    pub model: String,
    /// Bucket size (burst); it starts full.
    pub capacity: u32,
    /// Refill, in requests per second.
    pub refill: f64,
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
    /// Share (0..1) of arrivals answered `429` "The engine is currently overloaded, please try
    /// again later" (OpenAI's overload: it says nothing about the sender's rate). Rolled before
    /// the buckets, which it leaves untouched (the request was never admitted); the answer has
    /// the usual rate-limit headers, `remaining` as it is, and no `retry-after`. The body is
    /// OpenAI's (`type` `server_error`, `code` null) whatever `--header-style`; the Anthropic
    /// route answers Anthropic's overload instead, `529 overloaded_error`.
    #[arg(long = "overload-429", value_name = "SHARE", default_value_t = 0.0)]
    pub overload_429: f64,
    /// Admission storms (a gateway whose queue is full): each distinct request body is
    /// refused K times with `429`, `retry-after: 1`, `retry-after-ms: 1000`,
    /// `x-ratelimit-remaining-requests: 0` and `x-ratelimit-reset-requests: 1s`, whatever the
    /// rate, then goes on to the buckets. These headers are the gateway's, sent whatever
    /// `--header-style` (the Anthropic route sends its own names, `remaining` 0). Bodies are
    /// told apart by a hash; the last 65,536 are remembered. 0: off.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub admission_refusals: u32,
    /// `MODEL=CAPACITY@REFILL` (e.g. `fast=50@20`): requests whose body names `model` MODEL
    /// draw on a request bucket of their own, reported in their own rate-limit headers (OpenAI
    /// limits each model apart on one key); other models use `--capacity`/`--refill`.
    /// Repeatable. The `--tpm` bucket stays one for the key.
    #[arg(long = "model-limit", value_name = "MODEL=CAPACITY@REFILL", value_parser = parse_model_limit)]
    pub model_limits: Vec<ModelLimit>,
    /// A per-day request quota (Groq, Gemini): after N admitted requests, every request gets
    /// `429` until the simulated midnight, 24 h after start (or the last reset); its
    /// `retry-after` is the time until then. The request rate-limit headers then describe the
    /// day, as Groq's do: `limit` N, `remaining` what is left of it, `reset` in hours.
    #[arg(long, value_name = "N")]
    pub requests_per_day: Option<u64>,
    /// With `--header-style gemini`: the share (0..1) of 429 bodies wrapped in a JSON array,
    /// as some Gemini answers are.
    #[arg(long, value_name = "SHARE", default_value_t = 0.0)]
    pub gemini_array: f64,
    /// `pareto:ALPHA` (e.g. `pareto:1.5`): draw each service time from a Pareto distribution
    /// whose median is `--service-time` (smaller ALPHA: heavier tail), capped at 20 medians.
    #[arg(long, value_name = "pareto:ALPHA", value_parser = parse_service_tail)]
    pub service_tail: Option<ServiceTail>,
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
    /// `--overload-429`: share of arrivals answered OpenAI's overload 429, before the buckets.
    pub overload_429: f64,
    /// `--admission-refusals`: times each distinct body is refused before it may pass; 0: off.
    pub admission_refusals: u32,
    /// `--model-limit`: request buckets of their own for these models (names unique).
    pub model_limits: Vec<ModelLimit>,
    /// `--requests-per-day`: admitted requests per simulated day; `None`: no day quota.
    pub requests_per_day: Option<u64>,
    /// `--gemini-array`: share of Gemini 429 bodies wrapped in a JSON array.
    pub gemini_array: f64,
    /// `--service-tail`: the distribution of service times around `service_time`; `None`:
    /// every request takes `service_time` (plus jitter).
    pub service_tail: Option<ServiceTail>,
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
            overload_429: 0.0,
            admission_refusals: 0,
            model_limits: Vec::new(),
            requests_per_day: None,
            gemini_array: 0.0,
            service_tail: None,
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
    #[error("`--model-limit` for `{model}` must have a capacity of at least 1")]
    ZeroModelCapacity { model: String },
    #[error("`--model-limit` names `{model}` twice")]
    DuplicateModel { model: String },
    #[error("`--requests-per-day` must be at least 1")]
    ZeroRequestsPerDay,
    #[error("`--gemini-array` needs `--header-style gemini`")]
    GeminiArrayWithoutGemini,
    #[error("`--service-tail` needs a finite ALPHA > 0, got {alpha}")]
    BadTail { alpha: f64 },
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
            ("overload-429", a.overload_429),
            ("gemini-array", a.gemini_array),
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
        check_model_limits(&a.model_limits)?;
        if a.requests_per_day == Some(0) {
            return Err(ConfigError::ZeroRequestsPerDay);
        }
        if a.gemini_array > 0.0 && a.header_style != HeaderStyle::Gemini {
            return Err(ConfigError::GeminiArrayWithoutGemini);
        }
        if let Some(ServiceTail::Pareto { alpha }) = a.service_tail {
            if !(alpha.is_finite() && alpha > 0.0) {
                return Err(ConfigError::BadTail { alpha });
            }
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
            overload_429: a.overload_429,
            admission_refusals: a.admission_refusals,
            model_limits: a.model_limits,
            requests_per_day: a.requests_per_day,
            gemini_array: a.gemini_array,
            service_tail: a.service_tail,
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

fn check_model_limits(limits: &[ModelLimit]) -> Result<(), ConfigError> {
    for (i, limit) in limits.iter().enumerate() {
        if limit.capacity == 0 {
            return Err(ConfigError::ZeroModelCapacity {
                model: limit.model.clone(),
            });
        }
        check_rate("model-limit", limit.refill)?;
        if limits[..i].iter().any(|l| l.model == limit.model) {
            return Err(ConfigError::DuplicateModel {
                model: limit.model.clone(),
            });
        }
    }
    Ok(())
}

/// clap value parser for `MODEL=CAPACITY@REFILL`.
pub fn parse_model_limit(s: &str) -> Result<ModelLimit, String> {
    let format = || format!("expected MODEL=CAPACITY@REFILL (e.g. `fast=50@20`), got `{s}`");
    let (model, limit) = s.rsplit_once('=').ok_or_else(format)?;
    let (capacity, refill) = limit.split_once('@').ok_or_else(format)?;
    let model = model.trim();
    if model.is_empty() {
        return Err(format());
    }
    let capacity = capacity
        .trim()
        .parse()
        .map_err(|e| format!("CAPACITY `{capacity}`: {e}"))?;
    let refill = refill
        .trim()
        .parse()
        .map_err(|e| format!("REFILL `{refill}`: {e}"))?;
    Ok(ModelLimit {
        model: model.to_owned(),
        capacity,
        refill,
    })
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
