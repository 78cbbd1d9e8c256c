//! The request buckets (one per `--model-limit` model, one for the rest) and the optional
//! tokens-per-minute bucket of the key, and what their headers report.

use std::time::Duration;

use tokio::time::Instant;

use super::bucket::Bucket;
use super::config::{LimitReport, RefillChange, SimConfig};

/// Tokens assumed for the answer when a request names no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Which bucket refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Requests,
    Tokens,
}

/// One bucket as the rate-limit headers describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub limit: u64,
    pub remaining: u64,
    /// Until the bucket is full again.
    pub reset: Duration,
}

/// A refusal: which bucket, and how long until the request would fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    pub kind: Kind,
    pub retry_after: Duration,
}

/// The outcome of one arrival, with the header values as of that arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub requests: View,
    pub tokens: Option<View>,
    pub denied: Option<Denied>,
}

/// The request buckets of one model (or of every model without a `--model-limit`), with the
/// shadow a quantized report describes.
#[derive(Debug)]
struct RequestBuckets {
    requests: Bucket,
    /// `--limit-report quantized`: the per-minute bucket the request headers describe. Its
    /// capacity is the largest `rate * 60` of the schedule, so its deficit (requests admitted
    /// and not yet refilled) is the same whichever rate is in effect; see [`quantized`].
    shadow: Option<Bucket>,
}

impl RequestBuckets {
    fn new(
        capacity: u32,
        refill: f64,
        schedule: &[RefillChange],
        report: LimitReport,
        now: Instant,
    ) -> Self {
        let requests = Bucket::new(f64::from(capacity), refill, schedule.to_vec(), now);
        let shadow = (report == LimitReport::Quantized).then(|| {
            let rates = schedule.iter().map(|c| c.rate);
            let capacity = std::iter::once(refill)
                .chain(rates)
                .map(per_minute)
                .max()
                .unwrap_or(0);
            Bucket::new(capacity as f64, refill, schedule.to_vec(), now)
        });
        Self { requests, shadow }
    }

    fn reset(&mut self, now: Instant) {
        self.requests.reset(now);
        if let Some(shadow) = &mut self.shadow {
            shadow.reset(now);
        }
    }

    /// What the request headers report after refilling to `now` and charging the shadow for
    /// an admitted request (`admitted`).
    fn view(&mut self, report: LimitReport, now: Instant, admitted: bool) -> View {
        match &mut self.shadow {
            Some(shadow) => {
                shadow.refill(now);
                if admitted {
                    shadow.charge(now, 1.0);
                }
                let (limit, remaining) =
                    quantized(shadow.capacity(), shadow.rate(now), shadow.tokens());
                View {
                    limit,
                    remaining,
                    reset: shadow.time_until_full(),
                }
            }
            None => view(report, &self.requests, now),
        }
    }
}

/// The request buckets (one per `--model-limit` model, one for every other model) and the
/// optional tokens-per-minute bucket of the key; lives behind the simulator's mutex.
#[derive(Debug)]
pub struct Limiter {
    default: RequestBuckets,
    models: Vec<(String, RequestBuckets)>,
    tokens: Option<Bucket>,
    report: LimitReport,
}

impl Limiter {
    pub fn new(config: &SimConfig, now: Instant) -> Self {
        let report = config.limit_report;
        let default = RequestBuckets::new(
            config.capacity,
            config.refill,
            &config.refill_changes,
            report,
            now,
        );
        let models = config
            .model_limits
            .iter()
            .map(|m| {
                let buckets = RequestBuckets::new(m.capacity, m.refill, &[], report, now);
                (m.model.clone(), buckets)
            })
            .collect();
        let tokens = config
            .tpm
            .map(|tpm| Bucket::new(tpm as f64, tpm as f64 / 60.0, Vec::new(), now));
        Self {
            default,
            models,
            tokens,
            report,
        }
    }

    pub fn reset(&mut self, now: Instant) {
        self.default.reset(now);
        for (_, buckets) in &mut self.models {
            buckets.reset(now);
        }
        if let Some(tokens) = &mut self.tokens {
            tokens.reset(now);
        }
    }

    /// Takes one request token from `model`'s bucket (the default one for a model without a
    /// limit of its own) and `cost` tokens-per-minute tokens, or neither.
    pub fn admit(&mut self, now: Instant, model: Option<&str>, cost: u64) -> Admission {
        self.decide(now, model, Some(cost))
    }

    /// The headers' view as of `now` for `model`, taking nothing: for an answer refused
    /// before the buckets (overload, admission control).
    pub fn peek(&mut self, now: Instant, model: Option<&str>) -> Admission {
        self.decide(now, model, None)
    }

    /// Admits a request of `cost` tokens if both buckets allow; `None`: only look.
    fn decide(&mut self, now: Instant, model: Option<&str>, cost: Option<u64>) -> Admission {
        let Self {
            default,
            models,
            tokens,
            report,
        } = self;
        let buckets = match model {
            Some(name) => models
                .iter_mut()
                .find(|(m, _)| m == name)
                .map_or(default, |(_, b)| b),
            None => default,
        };
        buckets.requests.refill(now);
        if let Some(t) = tokens.as_mut() {
            t.refill(now);
        }
        let denied = cost.and_then(|cost| {
            let cost = cost as f64;
            if buckets.requests.tokens() < 1.0 {
                return Some(Denied {
                    kind: Kind::Requests,
                    retry_after: buckets.requests.time_until(1.0),
                });
            }
            match tokens.as_ref() {
                Some(t) if t.tokens() < cost => Some(Denied {
                    kind: Kind::Tokens,
                    retry_after: t.time_until(cost),
                }),
                _ => None,
            }
        });
        let admitted = cost.is_some() && denied.is_none();
        if admitted {
            buckets.requests.try_take(now, 1.0);
            if let Some(t) = tokens.as_mut() {
                t.try_take(now, cost.unwrap_or(0) as f64);
            }
        }
        let requests = buckets.view(*report, now, admitted);
        // Tokens are reported honestly: per-minute is the same as capacity for a TPM bucket.
        let token_report = match *report {
            LimitReport::Quantized => LimitReport::Capacity,
            other => other,
        };
        Admission {
            requests,
            tokens: tokens.as_ref().map(|t| view(token_report, t, now)),
            denied,
        }
    }
}

fn view(report: LimitReport, bucket: &Bucket, now: Instant) -> View {
    let (limit, remaining) = reported(report, bucket.capacity(), bucket.rate(now), bucket.tokens());
    View {
        limit,
        remaining,
        reset: bucket.time_until_full(),
    }
}

/// `rate`/s as a whole number per minute.
fn per_minute(rate: f64) -> u64 {
    (rate * 60.0).round() as u64
}

/// `(limit, remaining)` for a bucket holding `left` of `capacity` tokens, refilling at `rate`/s.
///
/// In per-minute mode `limit` is `rate * 60` and `remaining` is `left + (limit - capacity)`
/// (at least 0), so `(limit - remaining) / reset` still equals the refill rate for a client
/// that infers the rate from the headers. In quantized mode the request bucket is reported through [`quantized`] instead.
pub fn reported(report: LimitReport, capacity: f64, rate: f64, left: f64) -> (u64, u64) {
    let left = left.max(0.0).floor() as u64;
    match report {
        LimitReport::Capacity => (capacity as u64, left),
        LimitReport::PerMinute | LimitReport::Quantized => {
            let limit = per_minute(rate);
            let shifted = left as i128 + limit as i128 - capacity as i128;
            (limit, shifted.max(0) as u64)
        }
    }
}

/// `(limit, remaining)` of the quantized report, from a shadow bucket of `capacity` (the
/// largest per-minute limit of the schedule) holding `left` tokens (below zero once more was
/// admitted than it holds) and refilling at `rate`/s.
///
/// `limit` is `rate * 60`; `remaining` is `limit` minus the shadow's deficit
/// `capacity - left` (at least 0), so after a burst of `n` admitted requests `remaining` is
/// still `limit - n`, and `(limit - remaining) / reset` is the refill rate.
pub fn quantized(capacity: f64, rate: f64, left: f64) -> (u64, u64) {
    reported(LimitReport::PerMinute, capacity, rate, left)
}

/// Tokens charged to the tokens-per-minute bucket: prompt chars / 4 + `max_tokens`.
pub fn token_cost(prompt_chars: usize, max_tokens: Option<u64>) -> u64 {
    (prompt_chars / 4) as u64 + max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
}

#[cfg(test)]
mod tests;
