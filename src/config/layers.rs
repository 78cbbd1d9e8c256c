//! The sections that configure an upstream's layers: `[upstream.limits]` and how its rate
//! limit is partitioned, `[upstream.retry]`, `[upstream.breaker]` and `[upstream.adaptive]`.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use super::HumanDuration;

/// How an upstream's rate limit is split: providers enforce limits per credential (project,
/// key) and per model, so by default a partition is one credential and one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum PartitionScope {
    /// One set of buckets for the whole upstream.
    #[serde(rename = "upstream", alias = "none")]
    Upstream,
    /// One per credential as it goes upstream (keyed by a hash): the client's, or the one the
    /// upstream injects in place of the client's (`forward::withheld`).
    #[serde(rename = "api_key")]
    ApiKey,
    /// One per model (or limit group of models).
    #[serde(rename = "model")]
    Model,
    /// One per credential and model.
    #[default]
    #[serde(rename = "api_key+model")]
    ApiKeyModel,
}

impl PartitionScope {
    pub fn label(self) -> &'static str {
        match self {
            PartitionScope::Upstream => "upstream",
            PartitionScope::ApiKey => "api_key",
            PartitionScope::Model => "model",
            PartitionScope::ApiKeyModel => "api_key+model",
        }
    }
    pub fn by_key(self) -> bool {
        matches!(self, PartitionScope::ApiKey | PartitionScope::ApiKeyModel)
    }
    pub fn by_model(self) -> bool {
        matches!(self, PartitionScope::Model | PartitionScope::ApiKeyModel)
    }
}

/// Client-side buckets and the concurrency window. Explicit values are hard ceilings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests per minute (a token bucket).
    pub rpm: Option<NonZeroU32>,
    /// Tokens per minute, charged from an estimate of each request.
    pub tpm: Option<NonZeroU32>,
    /// Requests that may go at once from a full bucket (default: rpm / 60, at least 1).
    pub burst: Option<NonZeroU32>,
    /// Tokens that may go at once from a full bucket (default: tpm / 6).
    pub token_burst: Option<NonZeroU32>,
    /// Requests in flight at once.
    pub max_concurrency: NonZeroU32,
    /// Requests that may wait for a slot; beyond it, a 429.
    pub queue_size: usize,
    /// Longest wait for a slot (the request's deadline also applies).
    pub queue_timeout: HumanDuration,
    /// `upstream` (or `none`): one set of buckets per upstream; `api_key`: one per credential
    /// (keyed by a hash); `model`: one per model; `api_key+model`: one per both. Unset:
    /// `api_key+model`, or `upstream` when the breaker counts throttles (one breaker judges
    /// the whole upstream).
    pub partition: Option<PartitionScope>,
    /// Models that share one limit (a model family): model name -> limit group name.
    pub model_groups: BTreeMap<String, String>,
    /// Completion tokens assumed when a request names no `max_tokens`.
    pub default_max_tokens: u32,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            rpm: None,
            tpm: None,
            burst: None,
            token_burst: None,
            max_concurrency: NonZeroU32::new(1024).expect("non-zero"),
            queue_size: 10_000,
            queue_timeout: HumanDuration::from_secs(600),
            partition: None,
            model_groups: BTreeMap::new(),
            default_max_tokens: 1024,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Jitter {
    #[default]
    Full,
    Equal,
    Decorrelated,
    None,
}

/// Retries, their schedule and their budget.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Retries of failures (5xx, resets, timeouts) per request.
    pub max_retries: u32,
    /// Retries of throttles (retryable 429s) per request, and apart from them of a full
    /// queue's 503s: the last guard, since each waits for the rate limiter, or for a place the
    /// upstream freed, and the deadline bounds them anyway.
    pub max_throttle_retries: u32,
    pub base: HumanDuration,
    pub cap: HumanDuration,
    pub jitter: Jitter,
    /// Added on top of a server's retry hint: uniform(0, floor_jitter).
    pub floor_jitter: HumanDuration,
    /// Time allowed for each attempt to produce a response head.
    pub per_try_timeout: HumanDuration,
    /// Time allowed for the whole request, retries included; a client's `x-corral-deadline-ms`
    /// may shorten it.
    pub deadline: HumanDuration,
    /// Whether a 500 is retried.
    pub retry_500: bool,
    /// Error codes (the body's `error.code` or `error.type`) that make a 429 permanent, on top
    /// of `insufficient_quota` and Anthropic's spend limit.
    pub permanent_codes: Vec<String>,
    /// Add `x-should-retry: false` to the upstream's answer when corral gives up after retrying
    /// (or the budget refuses a retry), and to one no retry cures that the SDKs would retry.
    pub mark_given_up: bool,
    /// Retries may add at most this fraction of the recent request rate...
    pub budget_ratio: f64,
    /// ...plus this many per second...
    pub budget_min_per_second: u32,
    /// ...over this window.
    pub budget_ttl: HumanDuration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_retries: 6,
            max_throttle_retries: 50,
            base: HumanDuration::from_millis(500),
            cap: HumanDuration::from_secs(30),
            jitter: Jitter::Full,
            floor_jitter: HumanDuration::from_millis(500),
            per_try_timeout: HumanDuration::from_secs(300),
            deadline: HumanDuration::from_secs(600),
            retry_500: true,
            permanent_codes: Vec::new(),
            mark_given_up: true,
            budget_ratio: 0.2,
            budget_min_per_second: 10,
            budget_ttl: HumanDuration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnOpen {
    /// Requests wait (up to their deadline) until the breaker lets traffic through again.
    #[default]
    Queue,
    /// Requests get a 503 with Retry-After at once.
    Reject,
}

/// The circuit breaker: judges the upstream's health (5xx, 529, timeouts, connection errors;
/// 429s only with `count_throttles`) over a window of outcomes that spans time as well as a
/// count, and holds traffic while it is unhealthy (see `stack/breaker`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Whether the breaker runs at all.
    pub enabled: bool,
    /// Outcomes remembered: the window holds at least the last `window` outcomes, and at least
    /// the last `min_span` of them.
    pub window: u32,
    /// Outcomes needed in the window before the breaker may open.
    pub min_samples: u32,
    /// Time the window's outcomes must span (from its oldest outcome) before the breaker may
    /// open: failures at one instant are one event, however many requests they hit.
    pub min_span: HumanDuration,
    /// Opens when the window's error rate (each 100 ms slot of outcomes weighing the same)
    /// reaches this.
    pub open_error_rate: f64,
    /// Closes again when the probes' error rate is below this (`0`: every probe must succeed);
    /// while closed, a window at or above it restarts the `healthy_reset` clock.
    pub close_error_rate: f64,
    /// Whether 429s count as failures. Off by default: a 429 says the caller's budget is spent,
    /// not that the upstream is unwell, and is neither a success nor a failure.
    pub count_throttles: bool,
    /// First cool-down; each consecutive open doubles it, up to `max_cooldown` (jittered). A
    /// scout served well ends it early (`stack::breaker::state`).
    pub cooldown: HumanDuration,
    /// Longest cool-down.
    pub max_cooldown: HumanDuration,
    /// After being closed this long with the window below `close_error_rate`, the next open
    /// starts again from `cooldown`.
    pub healthy_reset: HumanDuration,
    /// Requests admitted while half-open.
    pub half_open_probes: u32,
    /// On closing, requests held while open are released over at most this long, each at its
    /// own offset into the open period (offsets scaled down when the open period was longer).
    pub release_ramp: HumanDuration,
    /// What requests do while the breaker holds traffic.
    pub on_open: OnOpen,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window: 50,
            min_samples: 20,
            min_span: HumanDuration::from_secs(2),
            open_error_rate: 0.4,
            close_error_rate: 0.25,
            count_throttles: false,
            cooldown: HumanDuration::from_secs(2),
            max_cooldown: HumanDuration::from_secs(60),
            healthy_reset: HumanDuration::from_secs(30),
            half_open_probes: 5,
            release_ramp: HumanDuration::from_secs(2),
            on_open: OnOpen::Queue,
        }
    }
}

/// Learning knobs: slow start and the latency-gradient window.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveConfig {
    /// Requests sent before the upstream has said anything about its limit.
    pub initial_burst: u32,
    /// Learned rates are used times this (a margin under the provider's limit).
    pub rate_margin: f64,
    /// Adaptive concurrency: the latency the window aims at, as a multiple of the no-load
    /// latency; the backend then holds `(tolerance - 1) x` its slots in its own queue.
    pub latency_tolerance: f64,
    /// Adaptive concurrency: the window's floor.
    pub min_concurrency: u32,
    /// Adaptive concurrency: the window's size before it has learned anything; slow start
    /// doubles it per round trip from there.
    pub initial_concurrency: u32,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        Self {
            initial_burst: 10,
            rate_margin: 0.97,
            latency_tolerance: 1.25,
            min_concurrency: 1,
            initial_concurrency: 20,
        }
    }
}
