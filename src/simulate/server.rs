//! Accept loop (HTTP/1 and h2c via hyper-util's auto builder) and graceful stop; the caller
//! brings the shutdown future.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::service;
use super::state::Shared;

/// How long open connections may keep going after `shutdown` resolves.
const DRAIN: Duration = Duration::from_secs(10);
/// Pause after a failed `accept` (e.g. out of file descriptors) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves until `shutdown` resolves, then stops accepting and drains for up to [`DRAIN`];
/// connections still open after that are aborted (every connection task is in a `JoinSet`).
pub async fn serve(
    shared: Arc<Shared>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut tasks = JoinSet::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "set_nodelay failed");
        }
        let shared = Arc::clone(&shared);
        let svc = service_fn(move |req| {
            let shared = Arc::clone(&shared);
            async move { service::handle(&shared, req).await }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        let conn = graceful.watch(conn);
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    tracing::info!(open, "simulate: stopped accepting; draining connections");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("simulate: all connections closed"),
        () = tokio::time::sleep(DRAIN) => {
            tracing::warn!(
                drain = ?DRAIN,
                cut = tasks.len(),
                "simulate: drain deadline passed; cutting connections"
            );
            tasks.abort_all();
        }
    }
    Ok(())
}
