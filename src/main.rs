//! `corral`: parse flags, validate the whole config before binding any port, serve.

use std::process::ExitCode;

use clap::Parser;
use corral::cli::{init_logging, BenchCommand, Cli, Command, LogFormat, RunArgs};
use corral::{config, server, shutdown};

/// mimalloc, built without transparent huge pages (with them, its arenas took peak RSS from
/// 16 to 27 MiB): on `benches/overhead.sh` it cut corral's p99 by about half and its CPU per
/// request by a few percent against glibc's malloc (figures in docs/benchmarks.md, Overhead).
/// Its 2.x line (the crate's `v2`): the crate enters every allocation through
/// `mi_malloc_aligned`, and mimalloc 3 over-allocates there for any block size that is not a
/// power of two (13 of corral's 24 allocations a request under callgrind); mimalloc 2 serves
/// alignments up to 16 from its plain bins (60,788 -> 60,410 instructions a request).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig(args)) => match args.load() {
            Ok(config) => {
                for warning in config.warnings() {
                    eprintln!("warning: {warning}");
                }
                if args.listen.listen.is_some() {
                    println!("# `listen` is the effective address: --listen / CORRAL_LISTEN override the file's");
                }
                print!(
                    "{}",
                    toml::to_string_pretty(&config).expect("config serializes")
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Some(Command::Simulate(args)) => run(
            cli.log_format,
            "corral simulate",
            corral::simulate::run(args, async {
                shutdown::signal().await;
            }),
        ),
        Some(Command::Bench(BenchCommand::Herd(args))) => {
            // corral's own per-request log lines would drown the figures.
            std::env::set_var(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            );
            run(
                cli.log_format,
                "corral bench herd",
                corral::herd::main(args),
            )
        }
        Some(Command::Bench(BenchCommand::Fleet(args))) => {
            std::env::set_var(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            );
            run(
                cli.log_format,
                "corral bench fleet",
                corral::herd::fleet::main(args),
            )
        }
        None => {
            let config = match cli.run.load() {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            run(cli.log_format, "corral", serve(cli.run, config))
        }
    }
}

/// Log, run `work` on a multi-threaded runtime, and turn its error into one line and exit 1.
fn run<E: std::fmt::Display>(
    format: LogFormat,
    what: &str,
    work: impl std::future::Future<Output = Result<(), E>>,
) -> ExitCode {
    let _log = init_logging(format);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{what}: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: RunArgs, config: config::Config) -> std::io::Result<()> {
    let listener = corral::listener::bind(config.listen.0)?;
    let admin = match config.admin_listen {
        Some(addr) => Some(corral::listener::bind(addr.0)?),
        None => None,
    };
    let app = server::App::new(&config);
    // SIGHUP re-reads the config the way it was read at start.
    tokio::spawn(server::reload_on_hangup(
        std::sync::Arc::clone(&app),
        move || args.load(),
    ));
    server::run(app, listener, admin, shutdown::signal()).await
}
