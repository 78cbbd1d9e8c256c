//! The herd at the quick scale (time / 10): many clients that never retry, fired at once at
//! `corral simulate` (a token bucket answering OpenAI-style 429s with rate-limit headers),
//! through corral. Bounds are generous for a busy two-core CI machine and stated per assert.

mod support;

use std::sync::Arc;
use std::time::Duration;

use corral::simulate::{SimConfig, Simulator, Stats};
use support::*;
use tokio::time::Instant;

struct Run {
    makespan: Duration,
    ok: usize,
    stats: Stats,
}

/// The herds run one at a time: two at once on a two-core machine measure each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn herd(tasks: usize, capacity: u32, refill: f64, corral_extra: &str) -> Run {
    let _serial = SERIAL.lock().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sim_addr = listener.local_addr().unwrap();
    let sim = Simulator::new(SimConfig {
        capacity,
        refill,
        service_time: Duration::from_millis(20),
        seed: Some(11),
        ..SimConfig::default()
    });
    let sim_task = tokio::spawn(sim.clone().serve(listener, std::future::pending()));
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"sim\"\nroute = \"/v1\"\nbase_url = \"http://{sim_addr}/v1\"\n{corral_extra}\n"
    ))
    .await;
    let client = Arc::new(client());
    let url = corral.url("/v1/chat/completions");
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let (client, url) = (Arc::clone(&client), url.clone());
            tokio::spawn(async move {
                let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"task {i}"}}],"max_tokens":8}}"#);
                let (parts, _) = send(&client, post(&url, &body)).await;
                parts.status
            })
        })
        .collect();
    let mut ok = 0;
    for h in handles {
        if h.await.unwrap() == 200 {
            ok += 1;
        }
    }
    let makespan = start.elapsed();
    let stats = sim.stats();
    eprintln!(
        "herd: {tasks} tasks, makespan {makespan:?}, ok {ok}, upstream statuses {:?}",
        stats.by_status
    );
    sim_task.abort();
    Run {
        makespan,
        ok,
        stats,
    }
}

fn throttled(stats: &Stats) -> u64 {
    stats.by_status.get("429").copied().unwrap_or(0)
}

/// 200 clients, bucket 50 refilled at 200/s, corral told the limit: everyone succeeds and the
/// upstream never sees a synchronized wave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_limit_turns_a_herd_into_a_queue() {
    let run = herd(200, 50, 200.0, "[upstream.limits]\nrpm = 12000\nburst = 50").await;
    assert_eq!(
        run.ok, 200,
        "every client succeeded: {:?}",
        run.stats.by_status
    );
    // Bound: (200 - 50) / 200 = 0.75 s; allow 4x for a loaded CI machine.
    assert!(
        run.makespan < Duration::from_secs(3),
        "makespan {:?}",
        run.makespan
    );
    assert!(
        throttled(&run.stats) <= 4,
        "upstream 429s: {}",
        throttled(&run.stats)
    );
    // After the initial burst, arrivals per 100 ms stay near the refill (20 per 100 ms); a
    // synchronized retry wave would put most of the herd into one slot.
    let after_burst = &run.stats.arrivals_per_100ms[1.min(run.stats.arrivals_per_100ms.len())..];
    let peak = after_burst.iter().copied().max().unwrap_or(0);
    assert!(
        peak <= 45,
        "peak arrivals per 100 ms after the burst: {peak} ({:?})",
        run.stats.arrivals_per_100ms
    );
}

/// Issue 4's quick scale: 500 clients that never retry, corral unconfigured (it learns the
/// limit from the headers): within 1.5x the bound and fewer than 5% of tasks meeting a 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfigured_corral_learns_the_limit() {
    let run = herd(500, 50, 200.0, "").await;
    assert_eq!(
        run.ok, 500,
        "every client succeeded: {:?}",
        run.stats.by_status
    );
    let bound = Duration::from_secs_f64((500.0 - 50.0) / 200.0);
    // 1.5x the bound plus one round trip of slow start and 20 ms service.
    assert!(
        run.makespan < bound.mul_f64(1.5) + Duration::from_millis(100),
        "makespan {:?} vs bound {bound:?}",
        run.makespan
    );
    assert!(
        throttled(&run.stats) < 25,
        "upstream 429s: {} (5% of 500 is 25)",
        throttled(&run.stats)
    );
}
