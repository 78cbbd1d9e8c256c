//! One upstream's metric handles: its label values bound once ([`Metrics::upstream`]), so a
//! request counts with an index and an atomic add, and its pacing gauges by model label.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};

use http::Method;
use prometheus::{Gauge, GaugeVec, Histogram, IntCounter, IntCounterVec, IntGauge};

use super::{
    Metrics, BREAKER_PHASES, CAUSES, GAVE_UP, KEY_REFUSALS, OUTCOMES, RETRY_REASONS,
    THROTTLE_CODES, THROTTLE_REASONS, THROTTLE_SOURCES,
};
use crate::body::TimeoutKind;
use crate::sync::lock;

impl Metrics {
    /// Handles for one upstream, with its label values bound once, and every labelled family
    /// given a zero series for each value it can take (see [`Metrics::init_labels`]). A request
    /// then counts without hashing a label or taking a lock: known values are indexes.
    pub fn upstream(&self, name: &str) -> UpstreamMetrics {
        self.init_labels(name);
        let v = &[name];
        let pacing = PacingFamilies {
            rate: self.learned_rate.clone(),
            burst: self.learned_burst.clone(),
            remaining: self.reported_remaining.clone(),
            source: self.limit_source.clone(),
        };
        let none = pacing.bind(name, NO_MODEL);
        let bound = |family: &IntCounterVec, values| Bound::new(family, name, values);
        UpstreamMetrics(Arc::new(Handles {
            kinds: Mutex::new(vec![(NO_MODEL.into(), none)]),
            pacing,
            name: name.to_owned(),
            requests: (0..METHODS.len() * CODES)
                .map(|_| OnceLock::new())
                .collect(),
            attempts: bound(&self.attempts, OUTCOMES),
            retries: bound(&self.retries, RETRY_REASONS),
            gave_up: bound(&self.gave_up, GAVE_UP),
            keys_set_aside: bound(&self.keys_set_aside, KEY_REFUSALS),
            throttle_reasons: bound(&self.throttle_reasons, &THROTTLE_REASONS),
            breaker_transitions: bound(&self.breaker_transitions, BREAKER_PHASES),
            upstream_throttles: bound(&self.upstream_throttles, THROTTLE_CODES),
            client_throttles: bound(&self.client_throttles, THROTTLE_SOURCES),
            corral_errors: bound(&self.corral_errors, CAUSES),
            family: self.clone(),
            request_duration: self.request_duration.with_label_values(v),
            upstream_duration: self.upstream_duration.with_label_values(v),
            in_flight: self.in_flight.with_label_values(v),
            request_bytes: self.request_bytes.with_label_values(v),
            response_bytes: self.response_bytes.with_label_values(v),
            backoff: self.backoff.with_label_values(v),
            hints_honoured: self.hints_honoured.with_label_values(v),
            hint_seconds: self.hint_seconds.with_label_values(v),
            budget_exhausted: self.budget_exhausted.with_label_values(v),
            client_retries: self.client_retries.with_label_values(v),
            breaker_state: self.breaker_state.with_label_values(v),
            queue_depth: self.queue_depth.with_label_values(v),
            queue_wait: self.queue_wait.with_label_values(v),
            rate_wait: self.rate_wait.with_label_values(v),
            tokens_charged: self.tokens_charged.with_label_values(v),
            concurrency_limit: self.concurrency_limit.with_label_values(v),
            panics: self.panics.with_label_values(v),
            stream_idle_cuts: self
                .stream_timeouts
                .with_label_values(&[name, TimeoutKind::Idle.label()]),
            stream_deadline_cuts: self
                .stream_timeouts
                .with_label_values(&[name, TimeoutKind::Deadline.label()]),
        }))
    }
}

/// The `method` label: one of the methods corral proxies, or `other` (a method corral refuses
/// never reaches a labelled family, but no client-chosen string ever becomes a label).
pub fn method_label(method: &Method) -> &'static str {
    crate::forward::proxied_method(method).unwrap_or("other")
}

/// Every `method` label, in the order of [`method_index`].
const METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other",
];

/// The place of `method`'s label in [`METHODS`].
fn method_index(method: &Method) -> usize {
    match *method {
        Method::GET => 0,
        Method::HEAD => 1,
        Method::POST => 2,
        Method::PUT => 3,
        Method::PATCH => 4,
        Method::DELETE => 5,
        Method::OPTIONS => 6,
        _ => 7,
    }
}

/// Status codes 100-599: one slot each per method (4,000 slots, 64 KiB an upstream). A code
/// outside (http's `StatusCode` allows up to 999) counts through the family.
const CODES: usize = 500;

/// One upstream's series of a counter family labelled `upstream` and one more label, bound
/// once for each value the label is known to take (the zero series of `init_labels`): a count
/// is a short scan of static strings and an atomic add, where `with_label_values` hashes the
/// labels and takes the family's lock. A value outside the set still counts, through the
/// family.
struct Bound {
    values: &'static [&'static str],
    series: Box<[IntCounter]>,
    family: IntCounterVec,
}

impl Bound {
    fn new(family: &IntCounterVec, upstream: &str, values: &'static [&'static str]) -> Self {
        let series = values
            .iter()
            .map(|v| family.with_label_values(&[upstream, v]))
            .collect();
        Self {
            values,
            series,
            family: family.clone(),
        }
    }

    fn inc(&self, upstream: &str, value: &str) {
        match self.values.iter().position(|v| *v == value) {
            Some(i) => self.series[i].inc(),
            None => self.family.with_label_values(&[upstream, value]).inc(),
        }
    }
}

/// Sources of a pacing limit, in the order of [`KindGauges::sources`]: `config` and every
/// `stack::rate_limit::learn::Source` label (kept here, below the stack; a test there holds
/// the two together).
pub const PACING_SOURCES: [&str; 6] = [
    "config",
    "headers",
    "observed",
    "aimd",
    "slow_start",
    "none",
];

/// One upstream's metric handles: cheap to clone (one `Arc`), label values bound once.
#[derive(Clone)]
pub struct UpstreamMetrics(Arc<Handles>);

impl std::ops::Deref for UpstreamMetrics {
    type Target = Handles;
    fn deref(&self) -> &Handles {
        &self.0
    }
}

/// Learned-limit gauges of one bucket kind.
#[derive(Clone)]
pub struct KindGauges {
    rate: Gauge,
    burst: Gauge,
    remaining: Gauge,
    sources: [Gauge; 6],
}

/// The `model` label of partitions without a model (the scope leaves it out, or the body
/// names none).
pub const NO_MODEL: &str = "none";
/// The `model` label of partitions whose model the config does not name.
pub const OTHER_MODEL: &str = "other";

/// The `model` label of a partition keyed by `model` (already mapped through `model_groups`):
/// the name itself when the config names it (a limit group of `model_groups`, or a model it
/// maps), else `other`, so the label takes only values the config bounds; `none` without one.
pub fn model_label<'a>(model: Option<&'a str>, model_groups: &BTreeMap<String, String>) -> &'a str {
    match model {
        None => NO_MODEL,
        Some(m) if model_groups.values().any(|g| g == m) || model_groups.contains_key(m) => m,
        Some(_) => OTHER_MODEL,
    }
}

/// The pacing gauge families, to bind per upstream, kind and model.
struct PacingFamilies {
    rate: GaugeVec,
    burst: GaugeVec,
    remaining: GaugeVec,
    source: GaugeVec,
}

impl PacingFamilies {
    /// The gauges of `upstream` and `model`, requests then tokens.
    fn bind(&self, upstream: &str, model: &str) -> [KindGauges; 2] {
        ["requests", "tokens"].map(|k| KindGauges {
            rate: self.rate.with_label_values(&[upstream, k, model]),
            burst: self.burst.with_label_values(&[upstream, k, model]),
            remaining: self.remaining.with_label_values(&[upstream, k, model]),
            sources: PACING_SOURCES
                .map(|s| self.source.with_label_values(&[upstream, k, model, s])),
        })
    }
}

/// The handles behind [`UpstreamMetrics`].
pub struct Handles {
    name: String,
    /// The pacing gauges by model label (`none` bound at start, others on first use: as many
    /// as the config names, plus `other`), each for requests and tokens.
    kinds: Mutex<Vec<(Box<str>, [KindGauges; 2])>>,
    pacing: PacingFamilies,
    /// `corral_requests_total` by method and code: [`METHODS`] x [`CODES`] slots, each bound
    /// on its first request (a series appears when its first request is counted, as before).
    requests: Box<[OnceLock<IntCounter>]>,
    attempts: Bound,
    retries: Bound,
    gave_up: Bound,
    keys_set_aside: Bound,
    throttle_reasons: Bound,
    breaker_transitions: Bound,
    upstream_throttles: Bound,
    client_throttles: Bound,
    corral_errors: Bound,
    family: Metrics,
    pub request_duration: Histogram,
    pub upstream_duration: Histogram,
    pub in_flight: IntGauge,
    pub request_bytes: IntCounter,
    pub response_bytes: IntCounter,
    pub backoff: Histogram,
    pub hints_honoured: IntCounter,
    pub hint_seconds: prometheus::Counter,
    pub budget_exhausted: IntCounter,
    pub client_retries: IntCounter,
    pub breaker_state: IntGauge,
    pub queue_depth: IntGauge,
    pub queue_wait: Histogram,
    pub rate_wait: Histogram,
    pub tokens_charged: IntCounter,
    pub concurrency_limit: IntGauge,
    pub panics: IntCounter,
    /// `corral_stream_timeouts_total{kind="idle"}`.
    stream_idle_cuts: IntCounter,
    /// `corral_stream_timeouts_total{kind="deadline"}`.
    stream_deadline_cuts: IntCounter,
}

impl Handles {
    /// The pacing gauges of the partitions labelled `model` (see [`model_label`]), bound on
    /// first use: a partition takes them once and sets them without a lock on every answer.
    pub fn pacing(&self, model: &str) -> PacingGauges {
        let mut kinds = lock(&self.kinds);
        if let Some((_, gauges)) = kinds.iter().find(|(m, _)| &**m == model) {
            return PacingGauges(gauges.clone());
        }
        let gauges = self.pacing.bind(&self.name, model);
        kinds.push((model.into(), gauges.clone()));
        PacingGauges(gauges)
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn request(&self, method: &Method, code: u16) {
        let m = method_index(method);
        let bind = || {
            let code = code.to_string();
            let labels = [self.name.as_str(), METHODS[m], code.as_str()];
            self.family.requests.with_label_values(&labels)
        };
        match usize::from(code).checked_sub(100).filter(|c| *c < CODES) {
            Some(c) => self.requests[m * CODES + c].get_or_init(bind).inc(),
            None => bind().inc(),
        }
    }
    /// A response body cut by one of corral's clocks.
    pub fn stream_timeout(&self, kind: TimeoutKind) {
        match kind {
            TimeoutKind::Idle => self.stream_idle_cuts.inc(),
            TimeoutKind::Deadline => self.stream_deadline_cuts.inc(),
        }
    }
    pub fn attempt(&self, outcome: &str) {
        self.attempts.inc(&self.name, outcome);
    }
    pub fn retry(&self, reason: &str) {
        self.retries.inc(&self.name, reason);
    }
    pub fn gave_up(&self, why: &str) {
        self.gave_up.inc(&self.name, why);
    }
    pub fn throttle_reason(&self, reason: &str) {
        self.throttle_reasons.inc(&self.name, reason);
    }
    pub fn key_set_aside(&self, why: &str) {
        self.keys_set_aside.inc(&self.name, why);
    }
    pub fn breaker_transition(&self, to: &str) {
        self.breaker_transitions.inc(&self.name, to);
    }
    pub fn upstream_throttle(&self, code: u16) {
        match code {
            429 => self.upstream_throttles.inc(&self.name, "429"),
            529 => self.upstream_throttles.inc(&self.name, "529"),
            other => self.upstream_throttles.inc(&self.name, &other.to_string()),
        }
    }
    pub fn client_throttle(&self, source: &str) {
        self.client_throttles.inc(&self.name, source);
    }
    pub fn corral_error(&self, cause: &str) {
        self.corral_errors.inc(&self.name, cause);
    }
}

/// One model label's pacing gauges (see [`Handles::pacing`]), requests then tokens.
pub struct PacingGauges([KindGauges; 2]);

impl PacingGauges {
    fn kind(&self, kind: &str) -> &KindGauges {
        &self.0[usize::from(kind != "requests")]
    }
    /// The pace of bucket `kind`, and its burst.
    pub fn learned(&self, kind: &str, rate: f64, burst: f64) {
        let k = self.kind(kind);
        set_if_changed(&k.rate, rate);
        set_if_changed(&k.burst, burst);
    }
    pub fn remaining(&self, kind: &str, remaining: f64) {
        set_if_changed(&self.kind(kind).remaining, remaining);
    }
    pub fn limit_source(&self, kind: &str, source: &str) {
        for (gauge, s) in self.kind(kind).sources.iter().zip(PACING_SOURCES) {
            set_if_changed(gauge, if s == source { 1.0 } else { 0.0 });
        }
    }
}

/// Set `gauge` to `value` unless it holds it already. Every answer reports the pacers'
/// state, which rarely moves: a read leaves the gauge's cache line shared between the
/// workers, where a store would take it from the others each time. Two answers racing may
/// leave the older value shown until the next answer that differs from it, as two plain
/// stores racing could.
fn set_if_changed(gauge: &Gauge, value: f64) {
    if gauge.get().to_bits() != value.to_bits() {
        gauge.set(value);
    }
}
