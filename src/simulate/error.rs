//! Errors of `corral simulate`.

use std::net::SocketAddr;

use super::config::ConfigError;

/// Why [`run`](super::run) stopped.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("invalid simulate flags: {0}")]
    Config(#[from] ConfigError),
    #[error("bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serve: {0}")]
    Serve(#[source] std::io::Error),
}

/// Returned by the service for `--fail-reset`: hyper closes the connection (HTTP/1) or
/// resets the stream (HTTP/2) without sending a response.
#[derive(Debug, thiserror::Error)]
#[error("simulated connection reset")]
pub struct ConnectionReset;
