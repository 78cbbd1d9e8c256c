//! The worlds the herd runs in (`--scenario`): upstreams that signal their limits in different
//! ways, each with its physical bound. corral is tuned on none of them in particular.

use std::time::Duration;

use crate::simulate::{FailWindow, HeaderStyle, LimitReport, RefillChange, SimConfig};

/// One world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// OpenAI headers whose `limit` is the bucket's capacity: honest.
    Capacity,
    /// A per-minute `limit`, `remaining` shifted by the same offset: honest per minute.
    PerMinute,
    /// A per-minute report over a small per-second bucket (capacity = one second of refill):
    /// `remaining` is large when a 429 arrives.
    Quantized,
    /// Anthropic's `/v1/messages`: RFC 3339 resets in whole seconds, `retry-after` in seconds.
    Anthropic,
    /// Azure's shape: resets in whole seconds, `x-ms-retry-after-ms`.
    Azure,
    /// No rate-limit headers and no retry hint at all: a bare 429.
    NoHeaders,
    /// The refill halves a third of the way in.
    LimitDrops,
    /// A tokens-per-minute bucket binds before the request bucket.
    Tokens,
    /// Four corrals on one key, the clients split evenly, no shared state.
    Fleet,
    /// 20 concurrent requests meet a 150 ms blip of 503s, then a healthy upstream.
    Blip,
    /// A vLLM-like backend: 16 slots, an unbounded queue, no headers, never a 429;
    /// corral with `concurrency = "auto"`.
    Queue,
}

impl Scenario {
    pub const ALL: [Scenario; 11] = [
        Scenario::Capacity,
        Scenario::PerMinute,
        Scenario::Quantized,
        Scenario::Anthropic,
        Scenario::Azure,
        Scenario::NoHeaders,
        Scenario::LimitDrops,
        Scenario::Tokens,
        Scenario::Fleet,
        Scenario::Blip,
        Scenario::Queue,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Scenario::Capacity => "capacity",
            Scenario::PerMinute => "per-minute",
            Scenario::Quantized => "quantized",
            Scenario::Anthropic => "anthropic",
            Scenario::Azure => "azure",
            Scenario::NoHeaders => "no-headers",
            Scenario::LimitDrops => "limit-drops",
            Scenario::Tokens => "tokens",
            Scenario::Fleet => "fleet",
            Scenario::Blip => "blip",
            Scenario::Queue => "queue",
        }
    }
}

/// Everything one run needs to know about its world.
#[derive(Debug, Clone)]
pub struct World {
    pub sim: SimConfig,
    /// The route the clients post to.
    pub path: &'static str,
    /// Tasks fired at once.
    pub tasks: usize,
    /// corrals on the one simulator (clients split evenly).
    pub replicas: usize,
    /// Added to each corral's `[[upstream]]` table when unconfigured.
    pub upstream_toml: String,
    /// Each corral's `[upstream.limits]` when the limit is set.
    pub limits_toml: String,
    /// The physical bound on the makespan.
    pub bound: Duration,
}

/// Tokens a herd request costs the simulator: `"task NNNN"` (9 chars / 4) + `max_tokens` 16.
pub const TOKENS_PER_REQUEST: u64 = 2 + 16;

/// The world of `scenario` (`None`: the classic herd) at `scale` (10 = quick: rates x10,
/// times /10), with `tasks` clients over `replicas` corrals. `shared`: the corrals share their
/// rate limits (`[fleet]`), so each is told the whole limit; else each is told its share.
#[allow(clippy::too_many_arguments)]
pub fn world(
    scenario: Option<Scenario>,
    tasks: usize,
    capacity: u32,
    refill: f64,
    scale: f64,
    replicas: usize,
    limit_report: LimitReport,
    shared: bool,
) -> World {
    let service = Duration::from_millis(200).div_f64(scale);
    let mut sim = SimConfig {
        capacity,
        refill,
        service_time: service,
        limit_report,
        ..SimConfig::default()
    };
    let mut path = "/v1/chat/completions";
    let mut upstream_toml = String::new();
    let mut tasks = tasks;
    let mut replicas = replicas;
    let split = if shared { 1.0 } else { replicas as f64 };
    let per_replica = |x: f64| (x / split).max(1.0);
    let mut limits_toml = format!(
        "rpm = {}\nburst = {}\n",
        (per_replica(refill * 60.0)).round() as u64,
        per_replica(f64::from(capacity)).round() as u64
    );
    let mut bound = bucket_bound(tasks, f64::from(capacity), refill, None);
    match scenario {
        None | Some(Scenario::Capacity) => {}
        Some(Scenario::PerMinute) => sim.limit_report = LimitReport::PerMinute,
        Some(Scenario::Quantized) => {
            sim.limit_report = LimitReport::Quantized;
            sim.capacity = refill.round().max(1.0) as u32;
            limits_toml = format!(
                "rpm = {}\nburst = {}\n",
                per_replica(refill * 60.0).round() as u64,
                per_replica(f64::from(sim.capacity)).round() as u64
            );
            bound = bucket_bound(tasks, f64::from(sim.capacity), refill, None);
        }
        Some(Scenario::Anthropic) => path = "/v1/messages",
        Some(Scenario::Azure) => sim.header_style = HeaderStyle::Azure,
        Some(Scenario::NoHeaders) => sim.header_style = HeaderStyle::None,
        Some(Scenario::LimitDrops) => {
            let at = bound / 3;
            let change = RefillChange {
                at,
                rate: refill / 2.0,
            };
            sim.refill_changes = vec![change];
            bound = bucket_bound(tasks, f64::from(capacity), refill, Some(change));
        }
        Some(Scenario::Tokens) => {
            // A quarter of the request refill in tokens: the minute's burst (60 s of refill)
            // carries most of the herd, then tokens bind.
            let token_rate = refill / 4.0 * TOKENS_PER_REQUEST as f64;
            let tpm = (token_rate * 60.0).round() as u64;
            sim.tpm = Some(tpm);
            let per_second = tpm as f64 / 60.0 / TOKENS_PER_REQUEST as f64;
            let burst = (tpm / TOKENS_PER_REQUEST) as f64;
            let share = per_replica(tpm as f64).round() as u64;
            limits_toml.push_str(&format!(
                "tpm = {share}\ntoken_burst = {share}\ndefault_max_tokens = 16\n"
            ));
            bound = bucket_bound(tasks, f64::from(capacity), refill, None)
                .max(bucket_bound(tasks, burst, per_second, None));
        }
        Some(Scenario::Fleet) => {
            replicas = replicas.max(4);
            let split = if shared { 1.0 } else { replicas as f64 };
            limits_toml = format!(
                "rpm = {}\nburst = {}\n",
                (refill * 60.0 / split).round() as u64,
                (f64::from(capacity) / split).round().max(1.0) as u64
            );
        }
        Some(Scenario::Blip) => {
            tasks = 20;
            sim.capacity = 1_000_000;
            sim.refill = 1_000_000.0;
            sim.fail_503_windows = vec![FailWindow {
                at: Duration::ZERO,
                duration: Duration::from_millis(150).div_f64(scale),
            }];
            limits_toml = String::new();
            // Every request fails once: one service time, then the retry's.
            bound = service * 2;
        }
        Some(Scenario::Queue) => {
            let slots = 16;
            sim.capacity = 1_000_000;
            sim.refill = 1_000_000.0;
            sim.header_style = HeaderStyle::None;
            sim.queue_slots = Some(slots);
            upstream_toml = "concurrency = \"auto\"\n".into();
            // Concurrency is not shared through Redis: always split.
            limits_toml = format!(
                "max_concurrency = {}\n",
                (f64::from(slots) / replicas as f64).max(1.0).round() as u64
            );
            bound = service.mul_f64(tasks as f64 / f64::from(slots));
        }
    }
    World {
        sim,
        path,
        tasks,
        replicas,
        upstream_toml,
        limits_toml,
        bound,
    }
}

/// When `tasks` requests can all have gone through a bucket of `capacity` refilled at `rate`
/// per second (halving to `change.rate` at `change.at`): `(tasks - capacity) / rate` in the
/// simple case.
fn bucket_bound(tasks: usize, capacity: f64, rate: f64, change: Option<RefillChange>) -> Duration {
    let need = (tasks as f64 - capacity).max(0.0);
    match change {
        Some(c) if need > rate * c.at.as_secs_f64() => {
            let rest = need - rate * c.at.as_secs_f64();
            c.at + Duration::from_secs_f64(rest / c.rate.max(1e-9))
        }
        _ => Duration::from_secs_f64(need / rate),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        let w = |s| world(Some(s), 500, 50, 20.0, 1.0, 1, LimitReport::Capacity, false).bound;
        assert_eq!(w(Scenario::Capacity), Duration::from_secs_f64(22.5));
        assert_eq!(w(Scenario::Quantized), Duration::from_secs(24));
        // 7.5 s at 20/s (150), then the other 300 at 10/s.
        assert_eq!(w(Scenario::LimitDrops), Duration::from_secs_f64(37.5));
        assert_eq!(w(Scenario::Queue), Duration::from_secs_f64(6.25));
        // tokens: 5 requests' worth per second, a minute's burst of 300: (500 - 300) / 5.
        assert_eq!(w(Scenario::Tokens), Duration::from_secs(40));
    }
}
