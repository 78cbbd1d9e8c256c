//! `corral`: parse flags, validate the whole config before binding any port, serve.

use std::process::ExitCode;

use clap::Parser;
use corral::cli::{init_logging, BenchCommand, Cli, Command};
use corral::{config, server, shutdown};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig { path }) => match config::load_file(&path) {
            Ok(config) => {
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
        Some(Command::Simulate(args)) => {
            let _log = init_logging(cli.log_format);
            match runtime().block_on(corral::simulate::run(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("corral simulate: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(Command::Bench(BenchCommand::Herd(args))) => {
            // corral's own per-request log lines would drown the figures.
            std::env::set_var(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            );
            let _log = init_logging(cli.log_format);
            match runtime().block_on(corral::herd::main(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("corral bench herd: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        None => {
            let config = match cli.run.load() {
                Ok(config) => config,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            let _log = init_logging(cli.log_format);
            match runtime().block_on(serve(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("corral: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

async fn serve(config: config::Config) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.listen.0).await?;
    let admin = match config.admin_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr.0).await?),
        None => None,
    };
    server::run(
        server::App::new(&config),
        listener,
        admin,
        shutdown::signal(),
    )
    .await
}
