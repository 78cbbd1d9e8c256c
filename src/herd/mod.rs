//! `corral bench herd`: the thundering-herd benchmark. N tasks fired at once at `corral
//! simulate` (a token bucket answering OpenAI-style 429s), once per strategy, in one run:
//! hand-written client retry loops (deterministic exponential backoff, equal jitter, full
//! jitter; base 1 s, cap 30 s, 6 retries, Retry-After ignored as such loops do), the official
//! openai-python SDK's default retry policy with no corral (`sdk`), and clients that never
//! retry going through corral, unconfigured (learning the limit) and with its rate limit set to
//! the simulator's. Everything runs in this process on 127.0.0.1; the simulator is fresh
//! for each strategy. `--scenario` runs corral in other worlds instead (`scenario`): upstreams
//! that report their limits differently, lie about them, move them, queue, or fail for a moment,
//! and several corrals on one key (`--replicas`).

mod clients;
pub mod fleet;
pub mod redis_server;
mod report;
pub mod scenario;
pub mod sdk;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::clients::{fire, Retries, TaskOutcome};
pub use self::report::{fleet_table, scenario_table, svg, table};
pub use self::scenario::{ModelWorld, Scenario, World};
pub use self::sdk::{SdkPolicy, OPENAI_PYTHON};
use crate::config::{self, Jitter};
use crate::simulate::{LimitReport, Simulator};
use crate::stack::retry::backoff::Backoff;

/// Where the benchmark's simulator and corrals listen.
const LOCALHOST: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));

/// The benchmark's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct HerdArgs {
    /// Tasks fired at once.
    #[arg(long, default_value_t = 500)]
    pub tasks: usize,
    /// The simulator's bucket capacity.
    #[arg(long, default_value_t = 50)]
    pub capacity: u32,
    /// The simulator's refill, requests per second.
    #[arg(long, default_value_t = 20.0)]
    pub refill: f64,
    /// Scale time by 10: refill x10, service time, backoff base and cap /10.
    #[arg(long)]
    pub quick: bool,
    /// Run only these strategies (default: all).
    #[arg(long, value_enum)]
    pub strategy: Vec<Strategy>,
    /// What the simulator's `x-ratelimit-limit-requests` reports: the bucket's capacity, a
    /// per-minute figure, or a quantized one (a per-minute report over a per-second bucket);
    /// `--scenario` sets its own.
    #[arg(long, value_enum, default_value_t = LimitReport::Capacity)]
    pub limit_report: LimitReport,
    /// Run these worlds (`all`: every one), the openai SDK alone, corral unconfigured and
    /// corral with the limit set (or `--strategy`), and print one table of them (instead of
    /// the strategies' table and chart).
    #[arg(long, value_parser = parse_scenarios)]
    pub scenario: Vec<Vec<Scenario>>,
    /// corrals on the one simulator, the clients split evenly among them.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// The corrals share their limits through this Redis (`[fleet] redis`), each told the
    /// whole limit; `auto`: start a throwaway `redis-server` for the run.
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,
    /// Split the clients unevenly: the first corral gets half of them.
    #[arg(long)]
    pub uneven: bool,
    /// Where the table (herd.md) and chart (herd.svg) go.
    #[arg(long, default_value = "bench-out")]
    pub out: std::path::PathBuf,
}

fn parse_scenarios(s: &str) -> Result<Vec<Scenario>, String> {
    if s == "all" {
        return Ok(Scenario::ALL.to_vec());
    }
    <Scenario as clap::ValueEnum>::from_str(s, true).map(|one| vec![one])
}

/// One way of getting N tasks through the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Strategy {
    /// Client-side `base * 2^n` backoff, no jitter.
    Deterministic,
    /// Client-side equal jitter.
    EqualJitter,
    /// Client-side full jitter.
    FullJitter,
    /// Each client is the official openai-python SDK with its default retry policy, straight
    /// at the upstream, no corral (see `sdk`): 2 retries of 408, 409, 429, >= 500 and
    /// connection errors; a `retry-after-ms`/`retry-after` of up to 120 s slept exactly, a
    /// longer one not retried; else `min(0.5 * 2^n, 8)` s times `1 - 0.25 * random()`, divided
    /// by the time scale at `--quick` like the other clients' backoff.
    #[value(name = "openai-sdk")]
    OpenAiSdk,
    /// Clients that never retry, through corral with default settings.
    CorralAuto,
    /// Clients that never retry, through corral with its limit set to the simulator's.
    CorralConfigured,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::Deterministic,
        Strategy::EqualJitter,
        Strategy::FullJitter,
        Strategy::OpenAiSdk,
        Strategy::CorralAuto,
        Strategy::CorralConfigured,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Strategy::Deterministic => "client: deterministic backoff",
            Strategy::EqualJitter => "client: equal jitter",
            Strategy::FullJitter => "client: full jitter",
            Strategy::OpenAiSdk => "openai SDK alone, no corral",
            Strategy::CorralAuto => "corral, unconfigured",
            Strategy::CorralConfigured => "corral, limit set",
        }
    }
}

/// The experiment's shape, after `--quick` scaling.
#[derive(Debug, Clone)]
pub struct Spec {
    pub tasks: usize,
    pub capacity: u32,
    pub refill: f64,
    pub service: Duration,
    pub base: Duration,
    pub cap: Duration,
    pub max_retries: u32,
    pub limit_report: LimitReport,
    /// The world (`None`: the classic herd against a capacity-reporting bucket).
    pub scenario: Option<Scenario>,
    /// corrals on the one simulator.
    pub replicas: usize,
    /// The fleet's Redis, when the corrals share their limits.
    pub redis: Option<String>,
    /// The first corral gets half the clients.
    pub uneven: bool,
    /// Kill this Redis at 30% of the bound and start it again at 50%.
    pub kill_redis: Option<Arc<redis_server::RedisServer>>,
    /// 10 at the quick scale (rates x10, times /10), else 1.
    pub scale: f64,
}

impl Spec {
    pub fn from_args(a: &HerdArgs) -> Self {
        let scale = if a.quick { 10.0 } else { 1.0 };
        Self {
            capacity: a.capacity,
            refill: a.refill * scale,
            limit_report: a.limit_report,
            replicas: a.replicas.max(1),
            uneven: a.uneven,
            ..Self::reference(a.tasks, scale)
        }
    }

    /// The reference experiment with `tasks` clients, one corral, at `scale` (rates x scale,
    /// times / scale): a bucket of 50 refilled at 20/s reporting its capacity, 200 ms of
    /// service, clients' backoff from 1 s up to 30 s over 6 retries.
    pub fn reference(tasks: usize, scale: f64) -> Self {
        Self {
            tasks,
            capacity: 50,
            refill: 20.0 * scale,
            service: Duration::from_millis(200).div_f64(scale),
            base: Duration::from_secs(1).div_f64(scale),
            cap: Duration::from_secs(30).div_f64(scale),
            max_retries: 6,
            limit_report: LimitReport::Capacity,
            scenario: None,
            replicas: 1,
            redis: None,
            uneven: false,
            kill_redis: None,
            scale,
        }
    }

    /// The world this spec runs in.
    pub fn world(&self) -> World {
        scenario::world(
            self.scenario,
            self.tasks,
            self.capacity,
            self.refill,
            self.scale,
            self.replicas,
            self.limit_report,
            self.redis.is_some(),
        )
    }

    /// The physical bound of its world: (N - capacity) / refill for the classic herd.
    pub fn bound(&self) -> Duration {
        self.world().bound
    }
}

/// What one strategy achieved.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub strategy: Strategy,
    pub scenario: Option<Scenario>,
    pub tasks: usize,
    pub bound: Duration,
    /// p99 of the time requests waited in the simulator's own queue (queue mode).
    pub backend_queue_p99: Duration,
    pub makespan: Duration,
    pub ok: usize,
    /// Tasks without a 200, the abandoned included.
    pub failed: usize,
    /// Tasks that gave up waiting after the world's patience (`World::patience`).
    pub abandoned: usize,
    /// Every 429 the simulator answered.
    pub upstream_429: u64,
    /// Upstream 429s the sender's rate caused: a bucket was empty.
    pub rate_429: u64,
    /// Upstream 429s that say nothing about the sender's rate: overload, the gateway's
    /// admission control, a spent day.
    pub other_429: u64,
    pub client_429: u64,
    pub upstream_requests: u64,
    /// Each task's time from the start to its last answer, in task order.
    pub latencies: Vec<Duration>,
    /// In a world of several models (`--scenario models`), each one's figures.
    pub per_model: Vec<ModelRun>,
    pub arrivals_per_100ms: Vec<u32>,
    /// corrals, and whether the first had half the clients.
    pub replicas: usize,
    pub uneven: bool,
    /// Lease script calls Redis served during the run (its own `INFO commandstats`).
    pub redis_calls: Option<u64>,
    pub redis_killed: bool,
}

/// One model's share of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelRun {
    pub model: &'static str,
    pub tasks: usize,
    pub failed: usize,
    /// When all its tasks can have gone through its own bucket.
    pub bound: Duration,
    /// Its last task's latency.
    pub makespan: Duration,
    /// Its median task latency.
    pub median: Duration,
}

impl RunResult {
    pub fn retries_per_task(&self, tasks: usize) -> f64 {
        self.upstream_requests.saturating_sub(tasks as u64) as f64 / tasks as f64
    }

    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let mut l = self.latencies.clone();
        l.sort();
        l[((l.len() - 1) as f64 * p).round() as usize]
    }

    /// Variance of upstream arrivals per whole second.
    pub fn arrival_variance(&self) -> f64 {
        let per_s: Vec<f64> = self
            .arrivals_per_100ms
            .chunks(10)
            .map(|c| c.iter().map(|n| f64::from(*n)).sum())
            .collect();
        if per_s.is_empty() {
            return 0.0;
        }
        let mean = per_s.iter().sum::<f64>() / per_s.len() as f64;
        per_s.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / per_s.len() as f64
    }
}

/// Run `strategies` one after another.
pub async fn run(spec: &Spec, strategies: &[Strategy]) -> std::io::Result<Vec<RunResult>> {
    let mut results = Vec::new();
    for s in strategies {
        let result = run_one(spec, *s).await?;
        eprintln!(
            "{:<30} makespan {:>7.2}s  ok {:>4}  failed {:>4} (abandoned {})  upstream 429s {:>5} (rate {}, other {})",
            s.label(),
            result.makespan.as_secs_f64(),
            result.ok,
            result.failed,
            result.abandoned,
            result.upstream_429,
            result.rate_429,
            result.other_429,
        );
        results.push(result);
    }
    Ok(results)
}

/// A corral started for one run: its stop signal and its task.
struct Corral {
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

/// The corrals of one run, and the URLs its clients post to (one per corral, or the
/// simulator's own when the clients go direct).
struct Started {
    corrals: Vec<Corral>,
    targets: Vec<String>,
}

/// One strategy against a fresh simulator, in the spec's world.
pub async fn run_one(spec: &Spec, strategy: Strategy) -> std::io::Result<RunResult> {
    let world = spec.world();
    let sim_listener = crate::listener::bind(LOCALHOST)?;
    let sim_addr = sim_listener.local_addr()?;
    let sim = Simulator::new(world.sim.clone());
    let (stop_sim, sim_stopped) = oneshot::channel::<()>();
    let sim_task = tokio::spawn(sim.clone().serve(sim_listener, async {
        let _ = sim_stopped.await;
    }));
    let Started { corrals, targets } = match strategy {
        Strategy::CorralAuto | Strategy::CorralConfigured => {
            start_corrals(spec, &world, strategy, sim_addr).await?
        }
        _ => Started {
            corrals: Vec::new(),
            targets: vec![format!("http://{sim_addr}{}", world.path)],
        },
    };
    let redis_before = match &spec.redis {
        Some(url) => redis_server::script_calls(url).await.ok(),
        None => None,
    };
    let start = Instant::now();
    let fault = spec.kill_redis.clone().map(|server| {
        let (kill_at, restart_at) = (world.bound.mul_f64(0.3), world.bound.mul_f64(0.5));
        tokio::spawn(async move {
            tokio::time::sleep_until(start + kill_at).await;
            server.kill();
            tokio::time::sleep_until(start + restart_at).await;
            let _ = tokio::task::spawn_blocking(move || server.restart()).await;
        })
    });
    let uneven = spec.uneven && targets.len() > 1;
    let client_429 = Arc::new(AtomicU64::new(0));
    let outcomes = fire(
        &world,
        &targets,
        uneven,
        retries(spec, strategy),
        &client_429,
        start,
    )
    .await?;
    let makespan = start.elapsed();
    if let Some(fault) = fault {
        let _ = fault.await;
    }
    let stats = sim.stats();
    // Counted after the corrals stopped: their shutdown calls (unused leases given back)
    // are round trips too. A killed Redis restarts with zeroed stats: then nothing is known.
    let redis_after = |before: Option<u64>| async move {
        let url = spec.redis.as_ref()?;
        let after = redis_server::script_calls(url).await.ok()?;
        Some(after.saturating_sub(before.unwrap_or(0)))
    };
    for corral in corrals {
        let _ = corral.stop.send(());
        let _ = corral.task.await;
    }
    let redis_calls = if spec.kill_redis.is_some() {
        None
    } else {
        redis_after(redis_before).await
    };
    let _ = stop_sim.send(());
    let _ = sim_task.await;
    let slots = (makespan.as_millis() / 100) as usize + 1;
    let mut arrivals = stats.arrivals_per_100ms.clone();
    arrivals.resize(slots, 0);
    let ok = outcomes.iter().filter(|t| t.ok).count();
    let abandoned = outcomes.iter().filter(|t| t.abandoned).count();
    let upstream_429 = stats.by_status.get("429").copied().unwrap_or(0);
    let rate_429 = stats.throttles_by_reason.get("rate").copied().unwrap_or(0);
    Ok(RunResult {
        strategy,
        scenario: spec.scenario,
        tasks: world.tasks,
        bound: world.bound,
        backend_queue_p99: Duration::from_millis(stats.queue_wait_p99_ms),
        makespan,
        ok,
        failed: world.tasks - ok,
        abandoned,
        upstream_429,
        rate_429,
        other_429: upstream_429.saturating_sub(rate_429),
        client_429: client_429.load(Ordering::Relaxed),
        upstream_requests: stats.requests,
        per_model: per_model(&world, &outcomes),
        latencies: outcomes.into_iter().map(|t| t.latency).collect(),
        arrivals_per_100ms: arrivals,
        replicas: targets.len(),
        uneven,
        redis_calls,
        redis_killed: spec.kill_redis.is_some(),
    })
}

/// The world's corrals in front of the simulator at `sim_addr`, and the URLs clients post to.
async fn start_corrals(
    spec: &Spec,
    world: &World,
    strategy: Strategy,
    sim_addr: SocketAddr,
) -> std::io::Result<Started> {
    // Unconfigured: the world's upstream keys (e.g. `concurrency = "auto"`); limit set: its
    // limits (e.g. a fixed window of the backend's slots).
    let extra = if strategy == Strategy::CorralConfigured {
        format!("[upstream.limits]\n{}", world.limits_toml)
    } else {
        world.upstream_toml.clone()
    };
    // A fleet name of its own per run: runs never share buckets.
    let fleet = spec.redis.as_ref().map_or(String::new(), |url| {
        let name = format!("herd-{:08x}", SmallRng::from_os_rng().random::<u32>());
        format!("[fleet]\nredis = \"{url}\"\nname = \"{name}\"\n")
    });
    // At a scale other than 1 corral's own clock for failures (backoff base, cap, the jitter on
    // a hint) is scaled as the clients' backoff is, so its rows compare with theirs.
    let retry = if spec.scale == 1.0 {
        String::new()
    } else {
        let d = crate::config::RetryConfig::default();
        let ms = |x: std::time::Duration| x.div_f64(spec.scale).as_millis().max(1);
        format!(
            "\n[upstream.retry]\nbase = \"{}ms\"\ncap = \"{}ms\"\nfloor_jitter = \"{}ms\"\n",
            ms(d.base.0),
            ms(d.cap.0),
            ms(d.floor_jitter.0)
        )
    };
    let toml = format!(
        "{fleet}[[upstream]]\nname = \"sim\"\nroute = \"/v1\"\nbase_url = \"http://{sim_addr}/v1\"\n{extra}{retry}"
    );
    let config = config::load_str("(herd benchmark)", &toml).map_err(std::io::Error::other)?;
    let (mut corrals, mut targets) = (Vec::new(), Vec::new());
    for _ in 0..world.replicas {
        let listener = crate::listener::bind(LOCALHOST)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(crate::server::run(
            crate::server::App::new(&config),
            listener,
            None,
            async {
                let _ = stopped.await;
            },
        ));
        corrals.push(Corral { stop, task });
        targets.push(format!("http://{addr}{}", world.path));
    }
    Ok(Started { corrals, targets })
}

/// The retry policy of `strategy`'s clients.
fn retries(spec: &Spec, strategy: Strategy) -> Retries {
    let hand_written = |jitter| Retries::HandWritten {
        backoff: Backoff {
            base: spec.base,
            cap: spec.cap,
            jitter,
        },
        max_retries: spec.max_retries,
    };
    match strategy {
        Strategy::Deterministic => hand_written(Jitter::None),
        Strategy::EqualJitter => hand_written(Jitter::Equal),
        Strategy::FullJitter => hand_written(Jitter::Full),
        Strategy::OpenAiSdk => Retries::Sdk {
            policy: sdk::OPENAI_PYTHON,
            scale: spec.scale,
        },
        Strategy::CorralAuto | Strategy::CorralConfigured => Retries::Never,
    }
}

/// Each model's share of a run: the tasks that named it.
fn per_model(world: &World, outcomes: &[TaskOutcome]) -> Vec<ModelRun> {
    world
        .models
        .iter()
        .enumerate()
        .map(|(m, model)| {
            let mine: Vec<TaskOutcome> =
                outcomes.iter().filter(|t| t.model == m).copied().collect();
            let mut latencies: Vec<Duration> = mine.iter().map(|t| t.latency).collect();
            latencies.sort();
            ModelRun {
                model: model.name,
                tasks: mine.len(),
                failed: mine.iter().filter(|t| !t.ok).count(),
                bound: model.bound,
                makespan: latencies.last().copied().unwrap_or_default(),
                median: latencies
                    .get(latencies.len().saturating_sub(1) / 2)
                    .copied()
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// `corral bench herd`: run, print the table, write `herd.md` and `herd.svg` (or, with
/// `--scenario`, `scenarios.md`).
pub async fn main(args: HerdArgs) -> std::io::Result<()> {
    let mut spec = Spec::from_args(&args);
    let _own_redis = match args.redis.as_deref() {
        Some("auto") => {
            let server = redis_server::RedisServer::start()?;
            spec.redis = Some(server.url());
            Some(server)
        }
        Some(url) => {
            spec.redis = Some(url.to_owned());
            None
        }
        None => None,
    };
    let scenarios: Vec<Scenario> = args.scenario.iter().flatten().copied().collect();
    if !scenarios.is_empty() {
        return scenarios_main(&args, spec, &scenarios).await;
    }
    let strategies = if args.strategy.is_empty() {
        Strategy::ALL.to_vec()
    } else {
        args.strategy.clone()
    };
    eprintln!(
        "herd: {} tasks, bucket {} refilled at {}/s, service {:?}; bound {:.2}s",
        spec.tasks,
        spec.capacity,
        spec.refill,
        spec.service,
        spec.bound().as_secs_f64()
    );
    let results = run(&spec, &strategies).await?;
    let md = table(&spec, &results);
    println!("{md}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("herd.md"), &md)?;
    std::fs::write(args.out.join("herd.svg"), svg(&spec, &results))?;
    eprintln!(
        "wrote {} and {}",
        args.out.join("herd.md").display(),
        args.out.join("herd.svg").display()
    );
    Ok(())
}

/// Each scenario: the openai SDK alone, corral unconfigured and corral with the limit set (or
/// the `--strategy` given).
async fn scenarios_main(
    args: &HerdArgs,
    spec: Spec,
    scenarios: &[Scenario],
) -> std::io::Result<()> {
    let strategies: Vec<Strategy> = if args.strategy.is_empty() {
        vec![
            Strategy::OpenAiSdk,
            Strategy::CorralAuto,
            Strategy::CorralConfigured,
        ]
    } else {
        args.strategy.clone()
    };
    let mut results = Vec::new();
    for scenario in scenarios {
        let spec = Spec {
            scenario: Some(*scenario),
            ..spec.clone()
        };
        let world = spec.world();
        eprintln!(
            "{}: {} tasks over {} corral(s), bound {:.2}s",
            scenario.label(),
            world.tasks,
            world.replicas,
            world.bound.as_secs_f64()
        );
        results.extend(run(&spec, &strategies).await?);
    }
    let md = scenario_table(&results);
    println!("{md}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("scenarios.md"), &md)?;
    eprintln!("wrote {}", args.out.join("scenarios.md").display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_model_figures_take_the_tasks_that_named_the_model() {
        let spec = Spec {
            scenario: Some(Scenario::Models),
            ..Spec::reference(5, 10.0)
        };
        let world = spec.world();
        let ms = Duration::from_millis;
        // Tasks 0, 2, 4 named `fast`; 1 and 3 `slow`.
        let outcomes = [(true, 10), (false, 70), (true, 30), (true, 50), (true, 20)]
            .into_iter()
            .enumerate()
            .map(|(i, (ok, latency))| TaskOutcome {
                ok,
                latency: ms(latency),
                abandoned: false,
                model: i % 2,
            })
            .collect::<Vec<_>>();
        let figures: Vec<_> = per_model(&world, &outcomes)
            .into_iter()
            .map(|m| (m.model, m.tasks, m.failed, m.makespan, m.median))
            .collect();
        assert_eq!(
            figures,
            [
                ("fast", 3, 0, ms(30), ms(20)),
                ("slow", 2, 1, ms(70), ms(50)),
            ]
        );
        let none = Spec::reference(5, 10.0).world();
        assert!(per_model(&none, &outcomes).is_empty());
    }
}
