//! Every metric corral exports, registered on one explicit [`Registry`], names in this file only.
//!
//! Conventions: `corral_` prefix, `_total` counters, `_seconds` and `_bytes` base units, labels
//! from bounded sets (upstream names from the config, status codes, fixed reason enums, and on
//! the pacing gauges the models the config names, else `other`); never keys, paths or models
//! the config does not name.

mod upstream;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    CounterVec, Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tracing_appender::non_blocking::ErrorCounter;

pub use self::upstream::{
    method_label, model_label, Handles, KindGauges, PacingGauges, UpstreamMetrics, NO_MODEL,
    OTHER_MODEL, PACING_SOURCES,
};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];
const WAIT_BUCKETS: &[f64] = &[
    0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// All of corral's metric families.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    request_duration: HistogramVec,
    upstream_duration: HistogramVec,
    in_flight: IntGaugeVec,
    request_bytes: IntCounterVec,
    response_bytes: IntCounterVec,
    attempts: IntCounterVec,
    retries: IntCounterVec,
    backoff: HistogramVec,
    hints_honoured: IntCounterVec,
    budget_exhausted: IntCounterVec,
    gave_up: IntCounterVec,
    keys_set_aside: IntCounterVec,
    throttle_reasons: IntCounterVec,
    group_answers: IntCounterVec,
    group_fallbacks: IntCounterVec,
    group_hedges: IntCounterVec,
    group_cancelled: IntCounterVec,
    client_retries: IntCounterVec,
    breaker_state: IntGaugeVec,
    breaker_transitions: IntCounterVec,
    queue_depth: IntGaugeVec,
    queue_wait: HistogramVec,
    rate_wait: HistogramVec,
    tokens_charged: IntCounterVec,
    upstream_throttles: IntCounterVec,
    client_throttles: IntCounterVec,
    learned_rate: GaugeVec,
    learned_burst: GaugeVec,
    reported_remaining: GaugeVec,
    limit_source: GaugeVec,
    concurrency_limit: IntGaugeVec,
    corral_errors: IntCounterVec,
    hint_seconds: CounterVec,
    panics: IntCounterVec,
    stream_timeouts: IntCounterVec,
    buffered_bytes: IntGauge,
    buffer_limit: IntGauge,
    /// `corral_config_generation`: 1 at start, +1 per applied reload.
    pub config_generation: IntGauge,
    /// `corral_config_reloads_total{outcome}`.
    config_reloads: IntCounterVec,
    fleet: FleetMetrics,
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}
fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}
fn fgauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}
fn histogram(r: &Registry, name: &str, help: &str, labels: &[&str], b: &[f64]) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(b.to_vec());
    let h = HistogramVec::new(opts, labels).expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let up = &["upstream"];
        let m = Self {
            requests: counter(&r, "corral_requests_total", "Client requests answered, by upstream, method and status code.", &["upstream", "method", "code"]),
            request_duration: histogram(&r, "corral_request_duration_seconds", "Time from a client request to its response head, retries and waits included.", up, LATENCY_BUCKETS),
            upstream_duration: histogram(&r, "corral_upstream_duration_seconds", "Time from sending one attempt upstream to its response head.", up, LATENCY_BUCKETS),
            in_flight: gauge(&r, "corral_in_flight_requests", "Client requests being served, streams until their last byte.", up),
            request_bytes: counter(&r, "corral_request_bytes_total", "Request body bytes received from clients.", up),
            response_bytes: counter(&r, "corral_response_bytes_total", "Response body bytes sent to clients.", up),
            attempts: counter(&r, "corral_upstream_attempts_total", "Attempts sent upstream, by outcome.", &["upstream", "outcome"]),
            retries: counter(&r, "corral_retries_total", "Retries corral made, by the reason for the retry.", &["upstream", "reason"]),
            backoff: histogram(&r, "corral_retry_backoff_seconds", "Sleep before each retry.", up, WAIT_BUCKETS),
            hints_honoured: counter(&r, "corral_retry_after_honoured_total", "Retries whose sleep was set by the upstream's Retry-After or reset header.", up),
            budget_exhausted: counter(&r, "corral_retry_budget_exhausted_total", "Retries refused because the retry budget was spent.", up),
            gave_up: counter(&r, "corral_retry_gave_up_total", "Requests whose last retryable answer was passed through, by why corral stopped.", &["upstream", "why"]),
            throttle_reasons: counter(&r, "corral_upstream_429_reasons_total", "Upstream 429s by what corral read in them: rate (the bucket is empty), overload, quota, long_window (a wait beyond the deadline or a per-day quota), unknown. Only rate and unknown move the pace.", &["upstream", "reason"]),
            keys_set_aside: counter(&r, "corral_keys_set_aside_total", "Pooled keys set aside for their cool-down, by why (401, 403, quota: a permanent 429).", &["upstream", "reason"]),
            group_answers: counter(&r, "corral_group_answers_total", "Answers a group's clients got, by the member that gave them.", &["group", "upstream"]),
            group_fallbacks: counter(&r, "corral_group_fallbacks_total", "Requests that left a group member for the next, by member and why (permanent_429, unavailable, no_capacity, failed).", &["group", "upstream", "reason"]),
            group_hedges: counter(&r, "corral_group_hedges_total", "Hedges a group sent (a second attempt when the first had no answer in time), and those whose answer won.", &["group", "outcome"]),
            group_cancelled: counter(&r, "corral_group_cancelled_total", "Attempts a group cancelled because another attempt's answer won the race.", &["group"]),
            client_retries: counter(&r, "corral_client_retries_total", "Requests arriving with x-stainless-retry-count > 0: clients still retrying on their own.", up),
            breaker_state: gauge(&r, "corral_breaker_state", "Circuit breaker state: 0 closed (traffic flows), 1 half-open, 2 open (traffic held).", up),
            breaker_transitions: counter(&r, "corral_breaker_transitions_total", "Circuit breaker state changes, by new state.", &["upstream", "to"]),
            queue_depth: gauge(&r, "corral_queue_depth", "Requests waiting for a concurrency slot.", up),
            queue_wait: histogram(&r, "corral_queue_wait_seconds", "Time spent waiting for a concurrency slot, by requests that found none free.", up, WAIT_BUCKETS),
            rate_wait: histogram(&r, "corral_rate_limit_wait_seconds", "Time each attempt waited for the client-side rate limit.", up, WAIT_BUCKETS),
            tokens_charged: counter(&r, "corral_tokens_charged_total", "Estimated tokens charged to the client-side token bucket.", up),
            upstream_throttles: counter(&r, "corral_upstream_throttled_total", "Throttling answers (429, 529) received from the upstream.", &["upstream", "code"]),
            client_throttles: counter(&r, "corral_client_throttled_total", "429s sent to clients, by who produced them (upstream passed through, or corral).", &["upstream", "source"]),
            learned_rate: fgauge(&r, "corral_learned_rate_per_second", "Send rate corral paces to, by bucket kind (requests or tokens) and model (a model or limit group named in model_groups, other, or none).", &["upstream", "kind", "model"]),
            learned_burst: fgauge(&r, "corral_learned_burst", "Burst corral allows, by bucket kind and model.", &["upstream", "kind", "model"]),
            reported_remaining: fgauge(&r, "corral_upstream_remaining", "Remaining capacity as last reported by the upstream's headers, by bucket kind and model.", &["upstream", "kind", "model"]),
            limit_source: fgauge(&r, "corral_limit_source", "1 for the source of the current pacing limit (config, headers, aimd, slow_start, none), by bucket kind and model.", &["upstream", "kind", "model", "source"]),
            concurrency_limit: gauge(&r, "corral_concurrency_limit", "Current concurrency window (fixed or adaptive).", up),
            corral_errors: counter(&r, "corral_errors_total", "Answers corral produced itself, by cause.", &["upstream", "cause"]),
            stream_timeouts: counter(&r, "corral_stream_timeouts_total", "Response bodies corral cut because the upstream paused longer than stream_idle_timeout (kind=idle) or the client's x-corral-deadline-ms passed (kind=deadline).", &["upstream", "kind"]),
            buffered_bytes: {
                let g = IntGauge::new("corral_buffered_request_bytes", "Request body bytes held in memory now, across all upstreams (at most max_buffered_bytes).").expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            buffer_limit: {
                let g = IntGauge::new("corral_buffered_request_limit_bytes", "max_buffered_bytes: the cap on request body bytes held in memory at once.").expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            hint_seconds: {
                let c = CounterVec::new(Opts::new("corral_retry_hint_seconds_total", "Seconds of server-hinted waits honoured before retries."), up).expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            config_generation: {
                let g = IntGauge::new("corral_config_generation", "The config in force: 1 at start, one more per reload applied (SIGHUP).").expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g.set(1);
                g
            },
            config_reloads: counter(&r, "corral_config_reloads_total", "Config reloads (SIGHUP), by outcome: applied, or refused (the old config stays).", &["outcome"]),
            fleet: FleetMetrics {
                round_trips: counter(&r, "corral_fleet_round_trips_total", "Calls to the fleet's Redis (one lease script each), by outcome: ok, error, timeout.", &["outcome"]),
                mode: gauge(&r, "corral_fleet_mode", "1 for the fleet mode in force: connecting, shared (leases from Redis), fallback (a local share of the last known limit).", &["mode"]),
                live_replicas: {
                    let g = IntGauge::new("corral_fleet_live_replicas", "Replicas of the fleet counted by the last lease (heartbeats within fleet.heartbeat_ttl).").expect("valid metric");
                    r.register(Box::new(g.clone())).expect("unique metric");
                    g
                },
                leased: counter(&r, "corral_fleet_leased_units_total", "Units leased from the fleet's shared buckets, by kind (requests, tokens).", &["kind"]),
                fallbacks: {
                    let g = IntCounter::new("corral_fleet_fallbacks_total", "Times this corral fell back from Redis to its local share.").expect("valid metric");
                    r.register(Box::new(g.clone())).expect("unique metric");
                    g
                },
            },
            panics: counter(&r, "corral_panics_total", "Panics caught while serving a request; each was answered with a 500 `internal`.", up),
            registry: {
                r.register(Box::new(LogLinesDropped::new())).expect("unique metric");
                r
            },
        };
        for cause in CAUSES {
            m.corral_errors.with_label_values(&[UNROUTED, cause]);
        }
        for result in ["applied", "refused"] {
            m.config_reloads.with_label_values(&[result]);
        }
        for outcome in ["ok", "error", "timeout"] {
            m.fleet.round_trips.with_label_values(&[outcome]);
        }
        for kind in ["requests", "tokens"] {
            m.fleet.leased.with_label_values(&[kind]);
        }
        for mode in FleetMode::ALL {
            m.fleet.mode.with_label_values(&[mode.label()]);
        }
        m
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }

    /// The answers counter of `member` in `group`, bound once when the group is built.
    pub fn group_answers(&self, group: &str, member: &str) -> IntCounter {
        self.group_answers.with_label_values(&[group, member])
    }

    /// A request left `member` of `group` for the next, because of `reason`.
    pub fn group_fallback(&self, group: &str, member: &str, reason: &str) {
        self.group_fallbacks
            .with_label_values(&[group, member, reason])
            .inc();
    }

    /// A group's hedge was `sent`, or `won`.
    pub fn group_hedge(&self, group: &str, outcome: &str) {
        self.group_hedges.with_label_values(&[group, outcome]).inc();
    }

    /// A group cancelled an attempt that lost a race.
    pub fn group_cancelled(&self, group: &str) {
        self.group_cancelled.with_label_values(&[group]).inc();
    }

    /// A zero series for each known value of each bounded label of `upstream`, so a fresh
    /// corral's first scrape already has every family a dashboard panel queries ("No data"
    /// otherwise, until the first sample). Binding them ([`Bound::new`]) makes them; families
    /// labelled by `upstream` alone get theirs from their handles. `corral_requests_total`
    /// gets one: `POST`, `200`.
    fn init_labels(&self, upstream: &str) {
        self.requests.with_label_values(&[upstream, "POST", "200"]);
    }

    /// A config reload: `applied` (the generation moves on) or `refused`.
    pub fn config_reload(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.config_reloads.with_label_values(&[result]).inc();
        if applied {
            self.config_generation.inc();
        }
    }

    /// The fleet's metrics (exported with zeros when no fleet is configured).
    pub fn fleet(&self) -> FleetMetrics {
        self.fleet.clone()
    }

    /// The gauge of request body bytes held, its cap set to `cap`.
    pub fn request_buffer(&self, cap: usize) -> IntGauge {
        self.buffer_limit.set(cap as i64);
        self.buffered_bytes.clone()
    }

    /// A corral-made answer for a request that matched no upstream.
    pub fn unrouted_error(&self, cause: &str) {
        self.corral_errors
            .with_label_values(&[UNROUTED, cause])
            .inc();
    }
}

/// The `upstream` label of answers to requests that matched no upstream.
const UNROUTED: &str = "(none)";

// ===== known label values: zero series from the first scrape =====

/// `outcome` of an attempt: every [`Outcome::label`](crate::classify::Outcome::label) but
/// `429_overload` (attempts are counted below the rate limiter, before a 429 is read; the
/// reading is in `corral_upstream_429_reasons_total`).
const OUTCOMES: &[&str] = &[
    "success",
    "429",
    "529",
    "500",
    "502",
    "503",
    "504",
    "5xx",
    "4xx",
    "timeout",
    "connection",
    "local",
];
/// `reason` of a retry: the retried status, the upstream's `x-should-retry`, or a failure
/// before a response head.
const RETRY_REASONS: &[&str] = &[
    "429",
    "429_overload",
    "529",
    "500",
    "502",
    "503",
    "504",
    "should_retry",
    "timeout",
    "connection",
];
/// Why a pooled key is set aside.
const KEY_REFUSALS: &[&str] = &["401", "403", "quota"];
/// What a 429 was read as: every [`Reason::label`](crate::classify::Reason::label).
const THROTTLE_REASONS: [&str; 5] = {
    let all = crate::classify::Reason::ALL;
    [
        all[0].label(),
        all[1].label(),
        all[2].label(),
        all[3].label(),
        all[4].label(),
    ]
};
/// `why` corral passed a retryable answer through: one of its limits, or its own refusal of
/// the next attempt (the [`ProxyError`](crate::error::ProxyError) label).
const GAVE_UP: &[&str] = &[
    "max_retries",
    "max_throttle_retries",
    "budget",
    "deadline",
    "rate_limited",
    "circuit_open",
];
/// `to`: the breaker's phases, every `stack::breaker::state::Phase::name` (a test there holds
/// them together).
pub const BREAKER_PHASES: &[&str] = &["closed", "half_open", "open"];
/// `code` of a throttle from the upstream.
const THROTTLE_CODES: &[&str] = &["429", "529"];
/// `source` of a 429 sent to a client.
const THROTTLE_SOURCES: &[&str] = &["upstream", "corral"];
/// `cause` of an answer corral made: every [`ProxyError::label`](crate::error::ProxyError::label).
const CAUSES: &[&str] = &[
    "no_route",
    "absolute_form",
    "connect_refused",
    "bad_path",
    "bad_priority",
    "method_not_allowed",
    "body_too_large",
    "body_read",
    "body_timeout",
    "buffer_full",
    "upstream_connect",
    "upstream_reset",
    "try_timeout",
    "deadline_exceeded",
    "queue_full",
    "queue_timeout",
    "rate_limited",
    "circuit_open",
    "internal",
];

// ===== corral_log_lines_dropped_total =====

/// The log writer's count of lines it dropped, once [`crate::cli::init_logging`] has set it.
static LOG_DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Export the log writer's dropped-line count as `corral_log_lines_dropped_total` (the first
/// call wins: there is one log writer per process).
pub fn count_dropped_log_lines(counter: ErrorCounter) {
    let _ = LOG_DROPPED.set(counter);
}

/// `corral_log_lines_dropped_total`, brought up to the log writer's own count at each scrape.
struct LogLinesDropped {
    counter: IntCounter,
    /// The count already added to `counter` (scrapes may overlap).
    reported: AtomicU64,
}

impl LogLinesDropped {
    fn new() -> Self {
        let counter = IntCounter::new(
            "corral_log_lines_dropped_total",
            "Log lines dropped because the log writer was behind (logging never blocks requests).",
        )
        .expect("valid metric");
        Self {
            counter,
            reported: AtomicU64::new(0),
        }
    }
}

impl Collector for LogLinesDropped {
    fn desc(&self) -> Vec<&Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let dropped = LOG_DROPPED.get().map_or(0, |c| c.dropped_lines() as u64);
        let before = self.reported.fetch_max(dropped, Ordering::AcqRel);
        if dropped > before {
            self.counter.inc_by(dropped - before);
        }
        self.counter.collect()
    }
}

/// The fleet's metrics (process-wide, not per upstream).
#[derive(Clone)]
pub struct FleetMetrics {
    /// `corral_fleet_round_trips_total{outcome}`: ok, error, timeout.
    pub round_trips: IntCounterVec,
    /// `corral_fleet_mode{mode}`: 1 for the mode in force.
    pub mode: IntGaugeVec,
    /// `corral_fleet_live_replicas`: replicas counted by the last lease.
    pub live_replicas: IntGauge,
    /// `corral_fleet_leased_units_total{kind}`: units granted by Redis.
    pub leased: IntCounterVec,
    /// `corral_fleet_fallbacks_total`: times this corral fell back to its local share.
    pub fallbacks: IntCounter,
}

/// Whether leases come from Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetMode {
    /// No lease has answered yet.
    Connecting,
    /// Leases come from Redis.
    Shared,
    /// Redis is slow or down: each replica paces to its share of the last known limit.
    Fallback,
}

impl FleetMode {
    pub const ALL: [FleetMode; 3] = [
        FleetMode::Connecting,
        FleetMode::Shared,
        FleetMode::Fallback,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FleetMode::Connecting => "connecting",
            FleetMode::Shared => "shared",
            FleetMode::Fallback => "fallback",
        }
    }
}

#[cfg(test)]
mod tests;
