//! `corral simulate`: a rate-limited fake OpenAI- and Anthropic-compatible upstream.
//!
//! Users run it to test pipelines offline; corral's tests and benchmarks use it as the
//! upstream. It shares nothing with the proxy's request path.
//!
//! # Behaviour
//! - A request token bucket (`--capacity`, `--refill`/s, optional `--refill-change AT=RATE`
//!   schedule) starts full; each chat request takes one token at arrival, before its service
//!   time. With `--tpm` a second bucket is charged prompt chars/4 + `max_tokens` (16 if absent).
//!   No token: 429 at once, with `retry-after` (and `retry-after-ms` on OpenAI routes).
//! - `--limit-report` chooses what the request headers say: `capacity` (the bucket as it is),
//!   `per-minute` (refill x 60, `remaining` shifted to keep the rate), or `quantized` (a
//!   per-minute shadow bucket charged per admitted request: `remaining` stays large on a 429,
//!   hiding the burst, while `(limit - remaining) / reset` is still the refill rate).
//! - `POST /v1/chat/completions` (OpenAI) and `POST /v1/messages` (Anthropic) answer JSON, or
//!   SSE with `"stream": true`; every response carries the provider's rate-limit headers.
//!   `--header-style` changes the OpenAI route's: `openai` (Go duration resets,
//!   `retry-after-ms`), `azure` (whole-second resets, `x-ms-retry-after-ms`) or `none` (no
//!   rate-limit header, no retry hint: a bare 429). The Anthropic route keeps its own.
//! - Admitted requests may be failed on purpose: `--fail-503`, `--fail-529`, `--fail-reset`
//!   (connection closed without a response), `--slow-first-byte` for `--slow-fraction`.
//!   `--fail-503-window AT+DURATION` plays a blip: every admitted request arriving in that
//!   window after start (or the last reset) is answered 503 like `--fail-503`, after its
//!   service time; retries after the window succeed.
//! - Refusals that say nothing about the sender's rate, each counted apart in
//!   `throttles_by_reason`: `--overload-429 SHARE` (OpenAI's "The engine is currently
//!   overloaded" 429, no retry hint, healthy headers), `--admission-refusals K` (a gateway that
//!   refuses each distinct body K times with `retry-after: 1` and `remaining` 0) and
//!   `--requests-per-day N` (a quota whose 429 is hours away, the request headers describing
//!   the day as Groq's do). The order an arrival meets them in is `state`'s module doc.
//! - `--model-limit MODEL=CAPACITY@REFILL`: a request bucket of its own per model, picked by
//!   the body's `model` (OpenAI limits each model apart on one key).
//! - `--header-style gemini`: no rate-limit headers; a 429 is Gemini's `RESOURCE_EXHAUSTED`
//!   body whose `RetryInfo.retryDelay` is the true wait (`--gemini-array`: some wrapped in an
//!   array).
//! - `--service-tail pareto:ALPHA`: heavy-tailed service times around `--service-time`.
//! - `--queue-slots N` (a vLLM-like backend): at most N admitted requests are served at once;
//!   the rest wait in a FIFO queue (refused by nothing) and their service time starts when
//!   they get a slot; a stream holds its slot until its last event. The buckets still apply,
//!   so such a backend takes a large `--capacity`/`--refill`. [`Stats`] reports the queue
//!   waits (p50, p99, max, from a fixed-size histogram) and the queue length.
//! - `GET /v1/models`, `GET /_stats` ([`Stats`]), `POST /_reset` ([`Simulator::reset`]);
//!   anything else is a JSON 404. `/v1/models` and the admin routes are not rate limited.
//!
//! # Layout
//! - `config`: [`SimulateArgs`] (clap) -> [`SimConfig`].
//! - `bucket`, `limits`: token buckets and the values their headers report; `quota`: the
//!   per-day quota; `gateway`: admission storms; `tail`: heavy-tailed service times.
//! - `headers`: OpenAI/Azure/Anthropic rate-limit headers, Go duration strings.
//! - `state`: buckets, fault dice and fail windows behind one mutex, the queue's semaphore;
//!   `stats`: counters for `/_stats`; `histogram`: fixed-size histogram of queue waits.
//! - `service`: routing and the request flow; `openai`, `anthropic`, `gemini`, `request`:
//!   bodies.
//! - `body`: buffered or channel-fed streaming response body; `server`: accept loop.

mod anthropic;
mod body;
mod bucket;
mod config;
mod error;
mod gateway;
mod gemini;
pub(crate) mod headers;
mod histogram;
mod limits;
mod openai;
mod quota;
mod request;
mod server;
mod service;
mod state;
mod stats;
mod tail;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

pub use self::config::{
    ConfigError, FailWindow, HeaderStyle, LimitReport, ModelLimit, RefillChange, ServiceTail,
    SimConfig, SimulateArgs,
};
pub use self::error::SimulateError;
pub use self::gateway::RETRY_AFTER as ADMISSION_RETRY_AFTER;
pub use self::stats::{Stats, Throttle};

/// The simulated upstream; clones share buckets and stats.
#[derive(Debug, Clone)]
pub struct Simulator {
    shared: Arc<state::Shared>,
}

impl Simulator {
    /// A simulator with full buckets whose clock (schedule, stats) starts now.
    pub fn new(config: SimConfig) -> Self {
        Self {
            shared: Arc::new(state::Shared::new(config)),
        }
    }

    /// Serves HTTP/1 and h2c on `listener` until `shutdown` resolves, then drains open
    /// connections (bounded) and returns.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        server::serve(self.shared, listener, shutdown).await
    }

    /// What `GET /_stats` serves.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// Refills the buckets, restarts the clock of `--refill-change` and clears the stats.
    pub fn reset(&self) {
        self.shared.reset();
    }
}

/// `corral simulate`: validates the flags, binds `--listen`, serves until `shutdown` resolves
/// (the binary passes its SIGINT/SIGTERM future).
pub async fn run(
    args: SimulateArgs,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), SimulateError> {
    let config = args.into_config()?;
    let addr = config.listen;
    let listener =
        crate::listener::bind(addr).map_err(|source| SimulateError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| SimulateError::Bind { addr, source })?;
    tracing::info!(addr = %local, "simulate listening");
    println!("simulate listening on {local}");
    Simulator::new(config)
        .serve(listener, shutdown)
        .await
        .map_err(SimulateError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimulateArgs,
    }

    fn args(extra: &[&str]) -> SimulateArgs {
        let argv = std::iter::once("simulate").chain(extra.iter().copied());
        Cli::parse_from(argv).args
    }

    #[tokio::test]
    async fn run_rejects_bad_flags_before_binding() {
        let err = run(
            args(&["--capacity=0", "--listen=127.0.0.1:0"]),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, SimulateError::Config(ConfigError::ZeroCapacity)),
            "{err}"
        );
    }

    #[tokio::test]
    async fn run_reports_a_busy_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = taken.local_addr().unwrap().to_string();
        let err = run(args(&["--listen", &addr]), std::future::pending())
            .await
            .unwrap_err();
        assert!(matches!(err, SimulateError::Bind { .. }), "{err}");
        assert!(
            err.to_string().starts_with(&format!("bind {addr}: ")),
            "{err}"
        );
    }
}
