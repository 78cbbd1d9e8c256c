//! `corral bench fleet`: several corrals on one simulator and one key, the herd split among
//! them evenly and unevenly (the first corral with half the clients), without Redis (each
//! told its share of the limit) and with it (each told the whole limit, sharing it), corral
//! unconfigured and with the limit set; then Redis killed mid-run and restarted.

use std::sync::Arc;

use super::redis_server::RedisServer;
use super::{fleet_table, run_one, Spec, Strategy};

/// The fleet benchmark's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct FleetArgs {
    /// Tasks fired at once.
    #[arg(long, default_value_t = 500)]
    pub tasks: usize,
    /// Scale time by 10 (as `bench herd --quick`).
    #[arg(long)]
    pub quick: bool,
    /// Corral counts to run.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    pub replicas: Vec<usize>,
    /// Use this Redis instead of starting a throwaway `redis-server` (the kill rows then need
    /// one started here, and are skipped).
    #[arg(long, value_name = "URL")]
    pub redis: Option<String>,
    /// Skip the runs without Redis.
    #[arg(long)]
    pub redis_only: bool,
    /// Where the table (fleet.md) goes.
    #[arg(long, default_value = "bench-out")]
    pub out: std::path::PathBuf,
}

pub async fn main(args: FleetArgs) -> std::io::Result<()> {
    let own = match &args.redis {
        Some(_) => None,
        None => Some(Arc::new(RedisServer::start().map_err(|e| {
            std::io::Error::other(format!(
                "cannot start redis-server ({e}); install it (apt install redis-server) or pass --redis URL"
            ))
        })?)),
    };
    let url = args
        .redis
        .clone()
        .or_else(|| own.as_ref().map(|s| s.url()))
        .expect("a Redis");
    let herd = super::HerdArgs {
        tasks: args.tasks,
        capacity: 50,
        refill: 20.0,
        quick: args.quick,
        strategy: Vec::new(),
        limit_report: crate::simulate::LimitReport::Capacity,
        scenario: Vec::new(),
        replicas: 1,
        redis: None,
        uneven: false,
        out: args.out.clone(),
    };
    let base = Spec::from_args(&herd);
    eprintln!(
        "fleet: {} tasks, bucket 50 refilled at {}/s, bound {:.2}s; Redis {}",
        base.tasks,
        base.refill,
        base.bound().as_secs_f64(),
        crate::config::RedisUrl(url.clone())
    );
    let mut results = Vec::new();
    for &replicas in &args.replicas {
        for uneven in [false, true] {
            let shared = [true, false].into_iter().filter(|s| *s || !args.redis_only);
            for redis in shared {
                for strategy in [Strategy::CorralConfigured, Strategy::CorralAuto] {
                    let spec = Spec {
                        replicas,
                        uneven,
                        redis: redis.then(|| url.clone()),
                        ..base.clone()
                    };
                    results.push(one(&spec, strategy).await?);
                }
            }
        }
        if let Some(server) = &own {
            for strategy in [Strategy::CorralConfigured, Strategy::CorralAuto] {
                let spec = Spec {
                    replicas,
                    redis: Some(url.clone()),
                    kill_redis: Some(Arc::clone(server)),
                    ..base.clone()
                };
                results.push(one(&spec, strategy).await?);
            }
        }
    }
    let md = fleet_table(&results);
    println!("{md}");
    std::fs::create_dir_all(&args.out)?;
    std::fs::write(args.out.join("fleet.md"), &md)?;
    eprintln!("wrote {}", args.out.join("fleet.md").display());
    Ok(())
}

async fn one(spec: &Spec, strategy: Strategy) -> std::io::Result<super::RunResult> {
    let r = run_one(spec, strategy).await?;
    eprintln!(
        "{} corrals{} {:<26} redis {:<6} makespan {:>6.2}s ({:.2}x)  failed {:>3}  upstream 429s {:>4}  redis calls {}",
        r.replicas,
        if r.uneven { " uneven" } else { "" },
        strategy.label(),
        if spec.kill_redis.is_some() { "killed" } else if spec.redis.is_some() { "shared" } else { "none" },
        r.makespan.as_secs_f64(),
        r.makespan.as_secs_f64() / r.bound.as_secs_f64().max(1e-9),
        r.failed,
        r.upstream_429,
        r.redis_calls.map_or("-".into(), |n| n.to_string()),
    );
    Ok(r)
}
