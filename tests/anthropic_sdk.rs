//! The official Python SDKs, unchanged, through corral in front of `corral simulate`:
//!
//! - `anthropic` (`tests/python/test_anthropic_sdk.py`, `ANTHROPIC_BASE_URL` at corral's
//!   `/anthropic` route): a message, a streamed one, the raw event stream, a 429 storm, and a
//!   storm against an upstream that answers some requests 529 (overloaded).
//! - `openai` (`tests/python/test_openai_storm.py`, `OPENAI_BASE_URL` at `/v1`): a 429 storm of
//!   plain and streamed completions.
//!
//! The openai SDK's own retries are off, so a single 429 reaching it fails a call; the
//! anthropic SDK's are on, so a 429 or 529 that reached it would come back with
//! `x-stainless-retry-count`, which corral counts (`corral_client_retries_total`, asserted 0; a
//! control with corral's throttle retries off shows the count follows the SDK's retries). The
//! simulator's stats prove the storm happened upstream. The scripts run under `$CORRAL_PYTHON`
//! (a venv with both SDKs; `.ci/run` makes one). Without it the tests fail, unless
//! `CORRAL_SKIP_PYTHON=1`.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use corral::simulate::{SimConfig, Simulator};
use support::*;

/// Concurrent calls in a 429 storm.
const STORM: usize = 40;
/// Concurrent calls against the upstream that answers 10% of requests 529. Fewer: corral
/// paces an overloaded upstream down hard (each 529 counts as a throttle), and this test
/// checks absorption, not throughput.
const OVERLOADED_CALLS: usize = 10;

fn python() -> Option<String> {
    support::python::python("the openai and anthropic SDKs")
}

/// A rate-limited upstream: a bucket of 5 refilled at 20/s, so a storm of 40 meets 429s.
fn limited() -> SimConfig {
    SimConfig {
        capacity: 5,
        refill: 20.0,
        service_time: Duration::from_millis(20),
        stream_chunks: 4,
        stream_interval: Duration::from_millis(5),
        seed: Some(7),
        ..SimConfig::default()
    }
}

async fn start(config: SimConfig) -> (Simulator, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sim = Simulator::new(config);
    tokio::spawn(sim.clone().serve(listener, std::future::pending()));
    (sim, addr)
}

/// Runs `script` under `python` with `env`, selecting `tests` (all when empty); asserts that
/// `passed` tests passed.
async fn run_script(
    python: &str,
    script: &str,
    tests: &[&str],
    env: &[(&str, String)],
    passed: usize,
) -> String {
    let mut env = env.to_vec();
    env.push(("CORRAL_STORM_CALLS", STORM.to_string()));
    env.push(("CORRAL_OVERLOADED_CALLS", OVERLOADED_CALLS.to_string()));
    support::python::run_sdk_script(python, script, tests, &env, passed, Duration::from_secs(90))
        .await
}

fn upstream_count(sim: &Simulator, status: &str) -> u64 {
    sim.stats().by_status.get(status).copied().unwrap_or(0)
}

/// The value of the sample `series` (name and labels, as rendered) in `metrics`, which must be
/// there.
fn sample(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no `{series}` in the metrics:\n{metrics}"))
}

/// Retries the anthropic SDK may make in the storms: with them on, a throttle that reached it
/// would be retried and counted, not only fail the call.
const SDK_RETRIES: &str = "2";

/// No 429 went back to a client, and no client retried on its own.
fn assert_absorbed(corral: &Corral, upstream: &str) {
    let metrics = corral.app.metrics().render();
    for source in ["upstream", "corral"] {
        assert!(
            metrics.contains(&format!(
                "corral_client_throttled_total{{source=\"{source}\",upstream=\"{upstream}\"}} 0"
            )),
            "a 429 reached a client of {upstream}:\n{metrics}"
        );
    }
    assert!(
        metrics.contains(&format!(
            "corral_client_retries_total{{upstream=\"{upstream}\"}} 0"
        )),
        "the SDK retried on its own:\n{metrics}"
    );
}

/// A message, a streamed one, the raw event stream, and a storm of 40 against a bucket of 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_sdk_through_corral() {
    let Some(python) = python() else { return };
    let (sim, sim_addr) = start(limited()).await;
    // The SDK appends /v1/messages to its base URL: /anthropic/v1/messages reaches the
    // simulator's /v1/messages. Learning is off so that the storm surely meets the upstream's
    // 429s (a learning corral paces it without any): the point is that the SDK never sees one.
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"anthropic\"\nroute = \"/anthropic\"\nbase_url = \"http://{sim_addr}/\"\nrate_limit = \"off\"\n"
    ))
    .await;
    let env = [
        ("ANTHROPIC_BASE_URL", corral.url("/anthropic")),
        ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
        ("CORRAL_SDK_MAX_RETRIES", SDK_RETRIES.to_owned()),
    ];
    let tests = [
        "test_message",
        "test_streamed_message",
        "test_raw_event_stream",
        "test_429_storm_is_absorbed",
    ];
    let stdout = run_script(&python, "test_anthropic_sdk.py", &tests, &env, tests.len()).await;
    eprintln!("{stdout}upstream statuses: {:?}", sim.stats().by_status);
    assert!(
        upstream_count(&sim, "429") > 0,
        "the storm met the upstream's limit: {:?}",
        sim.stats().by_status
    );
    assert_absorbed(&corral, "anthropic");
}

/// Concurrent calls to an upstream that answers 10% of admitted requests 529 (overloaded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_sdk_never_sees_529() {
    let Some(python) = python() else { return };
    let (sim, sim_addr) = start(SimConfig {
        capacity: 1000,
        refill: 1000.0,
        fail_529: 0.1,
        ..limited()
    })
    .await;
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"overloaded\"\nroute = \"/overloaded\"\nbase_url = \"http://{sim_addr}/\"\n"
    ))
    .await;
    let env = [
        ("ANTHROPIC_BASE_URL", corral.url("/overloaded")),
        ("CORRAL_OVERLOADED_BASE_URL", corral.url("/overloaded")),
        ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
        ("CORRAL_SDK_MAX_RETRIES", SDK_RETRIES.to_owned()),
    ];
    let tests = ["test_529_overloads_are_absorbed"];
    let stdout = run_script(&python, "test_anthropic_sdk.py", &tests, &env, 1).await;
    eprintln!("{stdout}upstream statuses: {:?}", sim.stats().by_status);
    assert!(
        upstream_count(&sim, "529") > 0,
        "the upstream answered 529s: {:?}",
        sim.stats().by_status
    );
    assert_absorbed(&corral, "overloaded");
}

/// The control for [`assert_absorbed`]: with corral's throttle retries off, the storm's 429s
/// reach the SDK, which retries each (`x-stainless-retry-count` 1, 2, ...), and corral counts
/// one client retry per 429 it passed through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_sdks_own_retries_are_counted() {
    let Some(python) = python() else { return };
    let (sim, sim_addr) = start(limited()).await;
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"anthropic\"\nroute = \"/anthropic\"\nbase_url = \"http://{sim_addr}/\"\nrate_limit = \"off\"\n[upstream.retry]\nmax_throttle_retries = 0\n"
    ))
    .await;
    let env = [
        ("ANTHROPIC_BASE_URL", corral.url("/anthropic")),
        ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
        ("CORRAL_SDK_MAX_RETRIES", "20".to_owned()),
    ];
    let tests = ["test_429_storm_is_absorbed"];
    let stdout = run_script(&python, "test_anthropic_sdk.py", &tests, &env, 1).await;
    eprintln!("{stdout}upstream statuses: {:?}", sim.stats().by_status);
    let metrics = corral.app.metrics().render();
    let passed_through = sample(
        &metrics,
        "corral_client_throttled_total{source=\"upstream\",upstream=\"anthropic\"}",
    );
    assert!(passed_through > 0, "no 429 reached the SDK:\n{metrics}");
    assert_eq!(
        sample(
            &metrics,
            "corral_client_retries_total{upstream=\"anthropic\"}"
        ),
        passed_through,
        "one SDK retry counted per 429 passed through"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_429_storm() {
    let Some(python) = python() else { return };
    let (sim, sim_addr) = start(limited()).await;
    // Learning off: the storm must meet the upstream's 429s for the SDK to be spared them.
    let corral = Corral::start(&format!(
        "[[upstream]]\nname = \"openai\"\nroute = \"/v1\"\nbase_url = \"http://{sim_addr}/v1\"\nrate_limit = \"off\"\n"
    ))
    .await;
    let env = [
        ("OPENAI_BASE_URL", corral.url("/v1")),
        ("OPENAI_API_KEY", "sk-test".to_owned()),
    ];
    let stdout = run_script(&python, "test_openai_storm.py", &[], &env, 1).await;
    eprintln!("{stdout}upstream statuses: {:?}", sim.stats().by_status);
    assert!(
        upstream_count(&sim, "429") > 0,
        "the storm met the upstream's limit: {:?}",
        sim.stats().by_status
    );
    assert_eq!(
        upstream_count(&sim, "200"),
        STORM as u64,
        "one success upstream per call"
    );
    assert_absorbed(&corral, "openai");
}
