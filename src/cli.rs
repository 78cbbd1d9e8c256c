//! Command line: `corral` (run), `corral check-config PATH`, `corral simulate`.

use std::io::{BufWriter, Write};
use std::num::NonZeroU32;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tracing_appender::non_blocking::{NonBlocking, NonBlockingBuilder, WorkerGuard};

use crate::config::{self, types::parse_base_url, Config, ConfigError, ListenAddr, UpstreamConfig};

#[derive(Debug, Parser)]
#[command(
    name = "corral",
    version,
    about = "Keeps LLM workloads from stampeding the APIs they depend on",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate a config file and print the effective configuration, `--listen` and
    /// `CORRAL_LISTEN` applied (exit 2 on any error; warnings on stderr).
    CheckConfig(CheckArgs),
    /// Run a rate-limited fake OpenAI/Anthropic upstream, for offline tests.
    Simulate(crate::simulate::SimulateArgs),
    /// Benchmarks that print figures.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The thundering-herd benchmark: hand-written retry loops against corral, side by side.
    Herd(crate::herd::HerdArgs),
    /// Several corrals on one key, with and without a shared Redis, Redis killed mid-run.
    Fleet(crate::herd::fleet::FleetArgs),
}

/// `corral check-config PATH`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The file to check.
    pub path: PathBuf,
    #[command(flatten)]
    pub listen: ListenArgs,
    /// The fleet's Redis, overriding the config's `[fleet] redis`.
    #[arg(long, env = "CORRAL_REDIS", value_name = "URL")]
    pub redis: Option<String>,
}

impl CheckArgs {
    /// The configuration corral would run on: the file, validated, with the listen and Redis
    /// overrides.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = config::load_file(&self.path)?;
        apply_redis(self.redis.as_deref(), &mut config)?;
        self.listen.apply(&mut config)?;
        Ok(config)
    }
}

/// `--redis` / `CORRAL_REDIS` into `config`.
fn apply_redis(url: Option<&str>, config: &mut Config) -> Result<(), ConfigError> {
    if let Some(url) = url {
        let url = config::types::parse_redis_url(url)
            .map_err(|r| flag_err("--redis / CORRAL_REDIS", r))?;
        config.fleet.redis = Some(url);
    }
    Ok(())
}

/// Where corral listens, over the config file's `listen` and `admin_listen`.
#[derive(Debug, Args, Default)]
pub struct ListenArgs {
    /// Listen address, overriding the config's `listen`.
    #[arg(long, env = "CORRAL_LISTEN")]
    pub listen: Option<String>,
    /// Serve /healthz, /readyz, /metrics, /status on this address instead.
    #[arg(long)]
    pub admin_listen: Option<String>,
}

impl ListenArgs {
    /// Put the given addresses into `config`.
    pub fn apply(&self, config: &mut Config) -> Result<(), ConfigError> {
        let addr = |key: &str, s: &str| {
            s.parse()
                .map(ListenAddr)
                .map_err(|_| flag_err(key, format!("invalid address `{s}`; write host:port")))
        };
        if let Some(listen) = &self.listen {
            config.listen = addr("--listen / CORRAL_LISTEN", listen)?;
        }
        if let Some(admin) = &self.admin_listen {
            config.admin_listen = Some(addr("--admin-listen", admin)?);
        }
        Ok(())
    }
}

fn flag_err(key: &str, reason: String) -> ConfigError {
    ConfigError {
        file: "(command line)".into(),
        line: None,
        key: key.into(),
        reason,
    }
}

/// Running the proxy.
#[derive(Debug, Args, Default)]
pub struct RunArgs {
    /// Config file (default: the embedded config, `/v1` to OpenAI on 127.0.0.1:8080).
    #[arg(long, env = "CORRAL_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub listen: ListenArgs,
    /// Share rate limits with other corrals through this Redis (`[fleet] redis`).
    #[arg(long, env = "CORRAL_REDIS", value_name = "URL")]
    pub redis: Option<String>,
    /// Quick start without a file: front this one upstream base URL at `/v1`.
    #[arg(long, conflicts_with = "config")]
    pub upstream: Option<String>,
    /// Requests per minute for `--upstream` (a hard ceiling).
    #[arg(long, requires = "upstream")]
    pub rpm: Option<NonZeroU32>,
    /// Tokens per minute for `--upstream` (a hard ceiling).
    #[arg(long, requires = "upstream")]
    pub tpm: Option<NonZeroU32>,
    /// Burst size of the requests bucket for `--upstream`.
    #[arg(long, requires = "upstream")]
    pub burst: Option<NonZeroU32>,
    /// Requests in flight at once for `--upstream`.
    #[arg(long, requires = "upstream")]
    pub max_concurrency: Option<NonZeroU32>,
    /// Retries per request for `--upstream`.
    #[arg(long, requires = "upstream")]
    pub max_retries: Option<u32>,
}

impl RunArgs {
    /// The configuration these arguments describe, fully validated.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let mut config = match &self.config {
            Some(path) => config::load_file(path)?,
            None => config::load_str("(embedded default config)", config::DEFAULT_CONFIG)?,
        };
        if let Some(url) = &self.upstream {
            let base_url = parse_base_url(url).map_err(|r| flag_err("--upstream", r))?;
            let mut up = UpstreamConfig::new("upstream", "/v1", base_url);
            up.limits.rpm = self.rpm;
            up.limits.tpm = self.tpm;
            up.limits.burst = self.burst;
            if let Some(n) = self.max_concurrency {
                up.limits.max_concurrency = n;
            }
            if let Some(n) = self.max_retries {
                up.retry.max_retries = n;
            }
            config.upstreams = vec![up];
        }
        apply_redis(self.redis.as_deref(), &mut config)?;
        self.listen.apply(&mut config)?;
        Ok(config)
    }
}

/// Log lines that may wait for the writer thread; beyond this many a new line is dropped (and
/// counted in `corral_log_lines_dropped_total`). At a few hundred bytes a line that holds at
/// most a few MB, and a burst of several thousand requests' lines.
const LOG_QUEUE_LINES: usize = 8_192;

/// The writer thread's buffer: queued lines go out in one write per batch (or per this much).
const LOG_WRITE_BUFFER: usize = 64 * 1024;

/// Install the tracing subscriber: text or JSON on stderr, `RUST_LOG` filters (default info).
///
/// Logging never blocks a request: lines are queued for a background thread (one request line
/// per request would otherwise cost a locked, unbuffered write on the request path), which
/// writes them through a buffer flushed after each batch. When the queue is full (stderr slower
/// than the lines come) new lines are dropped and counted in `corral_log_lines_dropped_total`.
/// Keep the returned guard alive until exit: dropping it flushes what is queued.
#[must_use = "dropping the guard stops the log writer"]
pub fn init_logging(format: LogFormat) -> WorkerGuard {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let (writer, guard) = log_writer(std::io::stderr());
    crate::metrics::count_dropped_log_lines(writer.error_counter());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.with_ansi(false).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    guard
}

/// A writer that never blocks its caller: lines queue (at most [`LOG_QUEUE_LINES`], then
/// dropped and counted) for a thread that writes them to `out` in batches.
fn log_writer<W: Write + Send + 'static>(out: W) -> (NonBlocking, WorkerGuard) {
    NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("corral-log")
        .finish(BufWriter::with_capacity(LOG_WRITE_BUFFER, Discard(out)))
}

/// `out`, its errors swallowed: a line stderr refuses has nowhere else to go, and a failing
/// flush retried forever would spin the writer thread at exit.
struct Discard<W>(W);

impl<W: Write> Write for Discard<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(self.0.write(buf).unwrap_or(buf.len()))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = self.0.flush();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// A writer whose every write waits until `release` is dropped: a stderr pipe nobody reads.
    struct Stuck(mpsc::Receiver<()>);

    impl Write for Stuck {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stuck_log_writer_drops_lines_instead_of_blocking_requests() {
        let (release, stuck) = mpsc::channel::<()>();
        let (writer, guard) = log_writer(Stuck(stuck));
        let dropped = writer.error_counter();
        let subscriber = tracing_subscriber::fmt().with_writer(writer).finish();
        // More lines than the queue and the write buffer can hold together.
        let lines = 4 * LOG_QUEUE_LINES;
        let (done, finished) = mpsc::channel();
        std::thread::spawn(move || {
            tracing::subscriber::with_default(subscriber, || {
                for n in 0..lines {
                    tracing::info!(n, upstream = "openai", status = 200, "request");
                }
            });
            let _ = done.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(60)).is_ok(),
            "logging blocked behind a stuck writer"
        );
        assert!(
            dropped.dropped_lines() >= lines - LOG_QUEUE_LINES - LOG_WRITE_BUFFER / 32,
            "{} of {lines} lines dropped",
            dropped.dropped_lines()
        );
        drop(release);
        drop(guard);
    }

    #[test]
    fn a_broken_stderr_is_ignored() {
        struct Broken;
        impl Write for Broken {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
        }
        let mut out = BufWriter::new(Discard(Broken));
        out.write_all(b"a line\n").unwrap();
        out.flush().unwrap();
    }
}
