//! The worlds the herd runs in (`--scenario`): upstreams that signal their limits in different
//! ways, each with its physical bound. corral is tuned on none of them in particular: each
//! world plays what a provider documents, not what corral expects.
//!
//! Some worlds answer 429s that say nothing about the sender's rate (an overloaded engine, a
//! gateway's full queue, a spent day): the simulator counts them apart, so a run reports "429s
//! the sender's rate caused" separately from the rest.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::simulate::{
    FailWindow, HeaderStyle, LimitReport, ModelLimit, RefillChange, ServiceTail, SimConfig,
    ADMISSION_RETRY_AFTER,
};

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
    /// No rate limit, but one arrival in five is OpenAI's documented overload, `429 - The engine
    /// is currently overloaded, please try again later`: no retry hint, healthy `remaining`.
    Overload,
    /// A gateway whose queue is full (admission control): each request is refused 3 times with
    /// `retry-after: 1` and `remaining` 0, whatever the rate; the bucket is generous.
    Admission,
    /// Two models on one key, limited apart as OpenAI documents (per project and model): the
    /// clients alternate `fast` and `slow`, whose limit is a fifth of `fast`'s.
    Models,
    /// The classic bucket plus a requests-per-day quota of three fifths of the tasks (Groq's
    /// and Gemini's RPD): the rest must fail; the 429 is a day away and the request headers
    /// describe the day, as Groq's do.
    DailyQuota,
    /// The classic bucket speaking Gemini: no rate-limit headers and no `retry-after`, the wait
    /// in the body's `RetryInfo.retryDelay`, half the bodies wrapped in a JSON array.
    Gemini,
    /// The classic bucket with Pareto (alpha 1.5) service times around the usual median,
    /// capped at 20 medians: long answers are many times the median.
    HeavyTail,
    /// The classic bucket with answers that take an LLM's time, [`LONG_ANSWER`] whatever the
    /// herd's scale: a success says nothing for seconds, while a 429 comes back at once (as
    /// OpenAI's and Anthropic's do: the limit is checked on arrival).
    LongAnswers,
    /// A key whose limit holds the whole herd (OpenAI's documented example: 5,000 requests a
    /// minute, the bucket full) with answers of [`LONG_ANSWER`]: nothing needs pacing, the SDK
    /// alone is at the bound, and an unconfigured corral, which knows nothing of the limit until
    /// the first answer comes seconds later, must not hold the herd back meanwhile.
    BigLimit,
}

impl Scenario {
    pub const ALL: [Scenario; 19] = [
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
        Scenario::Overload,
        Scenario::Admission,
        Scenario::Models,
        Scenario::DailyQuota,
        Scenario::Gemini,
        Scenario::HeavyTail,
        Scenario::LongAnswers,
        Scenario::BigLimit,
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
            Scenario::Overload => "overload",
            Scenario::Admission => "admission",
            Scenario::Models => "models",
            Scenario::DailyQuota => "daily-quota",
            Scenario::Gemini => "gemini",
            Scenario::HeavyTail => "heavy-tail",
            Scenario::LongAnswers => "long-answers",
            Scenario::BigLimit => "big-limit",
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
    /// How long a client waits for its answer before it gives up (10 bounds, at least a
    /// minute of scaled time): the herd's own guard, so that a run stays bounded in time
    /// whatever the strategy does. A run that needs it has failed anyway.
    pub patience: Duration,
    /// Models the clients alternate by round of the corrals (task `i` of `n` corrals names
    /// `models[(i / n) % len]`, so every corral serves every model), each with its own bound;
    /// empty: every client names the one model `sim`.
    pub models: Vec<ModelWorld>,
}

/// One model of a world with several, as its clients see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWorld {
    /// The body's `model`.
    pub name: &'static str,
    /// Tasks naming it.
    pub tasks: usize,
    /// When all of them can have gone through its own bucket.
    pub bound: Duration,
}

/// `--scenario overload`: the share of arrivals answered OpenAI's overload 429.
pub const OVERLOAD_SHARE: f64 = 0.2;
/// `--scenario admission`: refusals per request before the gateway lets it through.
pub const ADMISSION_REFUSALS: u32 = 3;
/// `--scenario models`: how many times the slow model's limit the fast model has.
pub const FAST_OVER_SLOW: f64 = 5.0;
/// `--scenario daily-quota`: the day's requests as a share of the tasks.
pub const DAY_SHARE: f64 = 0.6;
/// `--scenario heavy-tail`: the Pareto shape of service times.
pub const TAIL_ALPHA: f64 = 1.5;
/// `--scenario heavy-tail`: herds of draws averaged for the bound.
const TAIL_TRIALS: u32 = 200;
/// `--scenario long-answers`: every answer's service time, not scaled at `--quick` (a
/// completion of a few hundred tokens).
pub const LONG_ANSWER: Duration = Duration::from_secs(3);

/// `--scenario big-limit`: the requests a minute of OpenAI's documented example headers
/// (`x-ratelimit-limit-requests: 5000`), the bucket full at the start.
pub const BIG_LIMIT: u32 = 5000;

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
    let herd = Herd {
        tasks,
        capacity,
        refill,
        scale,
        replicas,
        shared,
        service: Duration::from_millis(200).div_f64(scale),
    };
    let mut w = herd.classic(limit_report);
    match scenario {
        None | Some(Scenario::Capacity) => {}
        Some(Scenario::PerMinute) => w.sim.limit_report = LimitReport::PerMinute,
        Some(Scenario::Quantized) => quantized(&herd, &mut w),
        Some(Scenario::Anthropic) => w.path = "/v1/messages",
        Some(Scenario::Azure) => w.sim.header_style = HeaderStyle::Azure,
        Some(Scenario::NoHeaders) => w.sim.header_style = HeaderStyle::None,
        Some(Scenario::LimitDrops) => limit_drops(&herd, &mut w),
        Some(Scenario::Tokens) => tokens(&herd, &mut w),
        Some(Scenario::Fleet) => fleet(&herd, &mut w),
        Some(Scenario::Blip) => blip(&herd, &mut w),
        Some(Scenario::Queue) => queue(&herd, &mut w),
        Some(Scenario::Overload) => overload(&herd, &mut w),
        Some(Scenario::Admission) => admission(&herd, &mut w),
        Some(Scenario::Models) => models(&herd, &mut w),
        Some(Scenario::DailyQuota) => daily_quota(&herd, &mut w),
        Some(Scenario::Gemini) => {
            w.sim.header_style = HeaderStyle::Gemini;
            w.sim.gemini_array = 0.5;
        }
        Some(Scenario::HeavyTail) => heavy_tail(&herd, &mut w),
        Some(Scenario::LongAnswers) => {
            // The last request the bucket lets through is answered that much later.
            w.sim.service_time = LONG_ANSWER;
            w.bound += LONG_ANSWER;
        }
        Some(Scenario::BigLimit) => big_limit(&herd, &mut w),
    }
    w.patience = (w.bound * 10).max(Duration::from_secs(60).div_f64(scale));
    w
}

/// The herd as [`world`] is asked for it, before a scenario changes anything.
struct Herd {
    tasks: usize,
    capacity: u32,
    refill: f64,
    scale: f64,
    replicas: usize,
    shared: bool,
    /// The simulator's service time at this scale.
    service: Duration,
}

impl Herd {
    /// Each corral's share of a limit `x`: all of it when the corrals share their limits, at
    /// least 1.
    fn per_replica(&self, x: f64) -> f64 {
        let split = if self.shared {
            1.0
        } else {
            self.replicas as f64
        };
        (x / split).max(1.0)
    }

    /// The classic herd: one bucket, reported as `limit_report` says; the patience is left for
    /// [`world`] to set once the scenario has fixed the bound.
    fn classic(&self, limit_report: LimitReport) -> World {
        let (capacity, refill) = (self.capacity, self.refill);
        World {
            sim: SimConfig {
                capacity,
                refill,
                service_time: self.service,
                limit_report,
                ..SimConfig::default()
            },
            path: "/v1/chat/completions",
            tasks: self.tasks,
            replicas: self.replicas,
            upstream_toml: String::new(),
            limits_toml: format!(
                "rpm = {}\nburst = {}\n",
                self.per_replica(refill * 60.0).round() as u64,
                self.per_replica(f64::from(capacity)).round() as u64
            ),
            bound: bucket_bound(self.tasks, f64::from(capacity), refill, None),
            patience: Duration::ZERO,
            models: Vec::new(),
        }
    }
}

/// `--scenario big-limit`: a bucket of [`BIG_LIMIT`] refilled per minute (per a tenth of
/// one at `--quick`), reported as its capacity, and answers of [`LONG_ANSWER`].
fn big_limit(herd: &Herd, w: &mut World) {
    w.sim.capacity = BIG_LIMIT;
    w.sim.refill = f64::from(BIG_LIMIT) / 60.0 * herd.scale;
    w.sim.service_time = LONG_ANSWER;
    w.limits_toml = format!(
        "rpm = {}\nburst = {}\n",
        herd.per_replica(w.sim.refill * 60.0).round() as u64,
        herd.per_replica(f64::from(BIG_LIMIT)).round() as u64
    );
    w.bound = bucket_bound(herd.tasks, f64::from(BIG_LIMIT), w.sim.refill, None) + LONG_ANSWER;
}

/// `--scenario quantized`: a bucket of one second's refill, and corral told so.
fn quantized(herd: &Herd, w: &mut World) {
    let (tasks, refill) = (herd.tasks, herd.refill);
    w.sim.limit_report = LimitReport::Quantized;
    w.sim.capacity = refill.round().max(1.0) as u32;
    w.limits_toml = format!(
        "rpm = {}\nburst = {}\n",
        herd.per_replica(refill * 60.0).round() as u64,
        herd.per_replica(f64::from(w.sim.capacity)).round() as u64
    );
    w.bound = bucket_bound(tasks, f64::from(w.sim.capacity), refill, None);
}

/// `--scenario limit-drops`: the refill halves a third of the way to the classic bound.
fn limit_drops(herd: &Herd, w: &mut World) {
    let (tasks, capacity, refill) = (herd.tasks, herd.capacity, herd.refill);
    let at = w.bound / 3;
    let change = RefillChange {
        at,
        rate: refill / 2.0,
    };
    w.sim.refill_changes = vec![change];
    w.bound = bucket_bound(tasks, f64::from(capacity), refill, Some(change));
}

/// `--scenario tokens`: a tokens-per-minute bucket that binds before the request bucket.
fn tokens(herd: &Herd, w: &mut World) {
    let (tasks, capacity, refill) = (herd.tasks, herd.capacity, herd.refill);
    // A quarter of the request refill in tokens: the minute's burst (60 s of refill)
    // carries most of the herd, then tokens bind.
    let token_rate = refill / 4.0 * TOKENS_PER_REQUEST as f64;
    let tpm = (token_rate * 60.0).round() as u64;
    w.sim.tpm = Some(tpm);
    let per_second = tpm as f64 / 60.0 / TOKENS_PER_REQUEST as f64;
    let burst = (tpm / TOKENS_PER_REQUEST) as f64;
    let share = herd.per_replica(tpm as f64).round() as u64;
    w.limits_toml.push_str(&format!(
        "tpm = {share}\ntoken_burst = {share}\ndefault_max_tokens = 16\n"
    ));
    w.bound = bucket_bound(tasks, f64::from(capacity), refill, None)
        .max(bucket_bound(tasks, burst, per_second, None));
}

/// `--scenario fleet`: at least four corrals, each told its share unless they share limits.
fn fleet(herd: &Herd, w: &mut World) {
    let (capacity, refill) = (herd.capacity, herd.refill);
    w.replicas = herd.replicas.max(4);
    let split = if herd.shared { 1.0 } else { w.replicas as f64 };
    w.limits_toml = format!(
        "rpm = {}\nburst = {}\n",
        (refill * 60.0 / split).round() as u64,
        (f64::from(capacity) / split).round().max(1.0) as u64
    );
}

/// `--scenario blip`: 20 requests meet a window of 503s on an otherwise unlimited upstream.
fn blip(herd: &Herd, w: &mut World) {
    w.tasks = 20;
    w.sim.capacity = 1_000_000;
    w.sim.refill = 1_000_000.0;
    w.sim.fail_503_windows = vec![FailWindow {
        at: Duration::ZERO,
        duration: Duration::from_millis(150).div_f64(herd.scale),
    }];
    w.limits_toml = String::new();
    // Every request fails once: one service time, then the retry's.
    w.bound = herd.service * 2;
}

/// `--scenario queue`: 16 slots before an unbounded queue, no headers; corral adapts its
/// concurrency.
fn queue(herd: &Herd, w: &mut World) {
    let slots = 16;
    w.sim.capacity = 1_000_000;
    w.sim.refill = 1_000_000.0;
    w.sim.header_style = HeaderStyle::None;
    w.sim.queue_slots = Some(slots);
    w.upstream_toml = "concurrency = \"auto\"\n".into();
    // Concurrency is not shared through Redis: always split.
    w.limits_toml = format!(
        "max_concurrency = {}\n",
        (f64::from(slots) / herd.replicas as f64).max(1.0).round() as u64
    );
    w.bound = herd.service.mul_f64(herd.tasks as f64 / f64::from(slots));
}

/// `--scenario overload`: no rate limit, a share of arrivals answered the overload 429.
fn overload(herd: &Herd, w: &mut World) {
    w.sim.capacity = 1_000_000;
    w.sim.refill = 1_000_000.0;
    w.sim.overload_429 = OVERLOAD_SHARE;
    w.limits_toml = String::new();
    // No limit: every task could be answered in one service time (an overload 429
    // comes back at once).
    w.bound = herd.service;
}

/// `--scenario admission`: a gateway that refuses each request a fixed number of times.
fn admission(herd: &Herd, w: &mut World) {
    w.sim.capacity = 1_000_000;
    w.sim.refill = 1_000_000.0;
    w.sim.admission_refusals = ADMISSION_REFUSALS;
    w.limits_toml = String::new();
    // A client that waits as each refusal asks (the gateway's own second, not scaled
    // with the herd) is let through after K of them.
    w.bound = ADMISSION_RETRY_AFTER * ADMISSION_REFUSALS + herd.service;
}

/// `--scenario heavy-tail`: the classic bucket, each answer its own Pareto draw. A sender that
/// meets the bucket's bound still waits for every answer, and a long one drawn late ends the
/// run: the bound is that sender's makespan, the mean of [`TAIL_TRIALS`] seeded draws of the
/// whole herd's service times (a run's own draws fall around it).
fn heavy_tail(herd: &Herd, w: &mut World) {
    let tail = ServiceTail::Pareto { alpha: TAIL_ALPHA };
    w.sim.service_tail = Some(tail);
    let mut rng = SmallRng::seed_from_u64(19);
    let capacity = herd.capacity as usize;
    let total: f64 = (0..TAIL_TRIALS)
        .map(|_| {
            (0..herd.tasks)
                .map(|i| {
                    // The bucket's schedule: its capacity at once, then one per refill.
                    let sent = (i + 1).saturating_sub(capacity) as f64 / herd.refill;
                    sent + tail.draw(herd.service, rng.random::<f64>()).as_secs_f64()
                })
                .fold(0.0, f64::max)
        })
        .sum();
    w.bound = Duration::from_secs_f64(total / f64::from(TAIL_TRIALS));
}

/// `--scenario models`: a fast and a slow model limited apart, the clients alternating.
fn models(herd: &Herd, w: &mut World) {
    let (tasks, capacity, refill) = (herd.tasks, herd.capacity, herd.refill);
    let slow = (f64::from(capacity) / FAST_OVER_SLOW).round().max(1.0);
    let slow_refill = refill / FAST_OVER_SLOW;
    w.sim.model_limits = vec![
        ModelLimit {
            model: "fast".into(),
            capacity,
            refill,
        },
        ModelLimit {
            model: "slow".into(),
            capacity: slow as u32,
            refill: slow_refill,
        },
    ];
    // One limit for the key cannot say two; told the sum, as one might add the two rows
    // of a limits page.
    w.limits_toml = format!(
        "rpm = {}\nburst = {}\n",
        herd.per_replica((refill + slow_refill) * 60.0).round() as u64,
        herd.per_replica(f64::from(capacity) + slow).round() as u64
    );
    let (fast_tasks, slow_tasks) = (tasks.div_ceil(2), tasks / 2);
    w.models = vec![
        ModelWorld {
            name: "fast",
            tasks: fast_tasks,
            bound: bucket_bound(fast_tasks, f64::from(capacity), refill, None),
        },
        ModelWorld {
            name: "slow",
            tasks: slow_tasks,
            bound: bucket_bound(slow_tasks, slow, slow_refill, None),
        },
    ];
    w.bound = w.models.iter().map(|m| m.bound).max().unwrap_or_default();
}

/// `--scenario daily-quota`: the classic bucket under a requests-per-day quota.
fn daily_quota(herd: &Herd, w: &mut World) {
    let (tasks, capacity, refill) = (herd.tasks, herd.capacity, herd.refill);
    let day = day_quota(tasks);
    w.sim.requests_per_day = Some(day);
    // The day's requests go through the bucket; the rest fail at once, whoever sends.
    w.bound = bucket_bound(tasks.min(day as usize), f64::from(capacity), refill, None);
}

/// `--scenario daily-quota`: the day's requests for `tasks` clients, at least 1.
pub fn day_quota(tasks: usize) -> u64 {
    ((tasks as f64 * DAY_SHARE).round() as u64).max(1)
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
        assert_eq!(w(Scenario::LongAnswers), Duration::from_secs_f64(25.5));
        // The whole herd fits the bucket: one long answer.
        assert_eq!(w(Scenario::BigLimit), Duration::from_secs(3));
        assert_eq!(w(Scenario::Quantized), Duration::from_secs(24));
        // 7.5 s at 20/s (150), then the other 300 at 10/s.
        assert_eq!(w(Scenario::LimitDrops), Duration::from_secs_f64(37.5));
        assert_eq!(w(Scenario::Queue), Duration::from_secs_f64(6.25));
        // tokens: 5 requests' worth per second, a minute's burst of 300: (500 - 300) / 5.
        assert_eq!(w(Scenario::Tokens), Duration::from_secs(40));
        // No limit: one service time.
        assert_eq!(w(Scenario::Overload), Duration::from_millis(200));
        // Three refusals a second apart, then the service time.
        assert_eq!(w(Scenario::Admission), Duration::from_millis(3200));
        // The slow model's 250 tasks through a bucket of 10 refilled at 4/s.
        assert_eq!(w(Scenario::Models), Duration::from_secs(60));
        // 300 of the day's requests through the classic bucket: (300 - 50) / 20.
        assert_eq!(w(Scenario::DailyQuota), Duration::from_secs_f64(12.5));
        assert_eq!(w(Scenario::Gemini), Duration::from_secs_f64(22.5));
        // The bucket's 22.5 s plus the long answers drawn near the end: at least the median
        // (200 ms), at most the cap (4 s).
        let tail = w(Scenario::HeavyTail).as_secs_f64();
        assert!((22.7..26.5).contains(&tail), "{tail}");
    }

    #[test]
    fn two_models_have_a_bound_each_and_the_slow_one_binds() {
        let w = world(
            Some(Scenario::Models),
            501,
            50,
            200.0,
            10.0,
            1,
            LimitReport::Capacity,
            false,
        );
        let figures: Vec<_> = w.models.iter().map(|m| (m.name, m.tasks)).collect();
        assert_eq!(figures, [("fast", 251), ("slow", 250)]);
        // fast: (251 - 50) / 200; slow: (250 - 10) / 40.
        assert_eq!(w.models[0].bound, Duration::from_secs_f64(1.005));
        assert_eq!(w.models[1].bound, Duration::from_secs(6));
        assert_eq!(w.bound, Duration::from_secs(6));
        let limits: Vec<_> = w
            .sim
            .model_limits
            .iter()
            .map(|m| (m.capacity, m.refill))
            .collect();
        assert_eq!(limits, [(50, 200.0), (10, 40.0)]);
        // corral told the key's sum: 240/s and a burst of 60.
        assert_eq!(w.limits_toml, "rpm = 14400\nburst = 60\n");
    }

    #[test]
    fn the_quick_scale_keeps_the_gateway_s_second_and_scales_the_rest() {
        let w = |s| {
            world(
                Some(s),
                500,
                50,
                200.0,
                10.0,
                1,
                LimitReport::Capacity,
                false,
            )
        };
        assert_eq!(w(Scenario::Admission).bound, Duration::from_millis(3020));
        assert_eq!(w(Scenario::Overload).bound, Duration::from_millis(20));
        // Patience: 10 bounds, at least a scaled minute.
        assert_eq!(
            w(Scenario::Admission).patience,
            Duration::from_millis(30_200)
        );
        assert_eq!(w(Scenario::Overload).patience, Duration::from_secs(6));
        let quota = w(Scenario::DailyQuota);
        assert_eq!(quota.sim.requests_per_day, Some(300));
        assert_eq!(quota.bound, Duration::from_secs_f64(1.25));
        assert!(w(Scenario::Capacity).models.is_empty());
    }
}
