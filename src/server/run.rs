//! Serving the listeners until shutdown, the drain that follows, and reloading the config on
//! SIGHUP.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use tokio::net::TcpListener;

use super::App;
use crate::accept::{self, Acceptor, ConnLimits, Handler};
use crate::config::Config;
use crate::error::ProxyError;
use crate::shutdown::Signal;

/// Connections the admin listener serves at once (probes and scrapes need few).
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// Serve `listener` (and `admin`, if given) until `shutdown` resolves, then drain:
///
/// 1. Readiness flips: `/readyz` answers 503.
/// 2. On [`Signal::Terminate`] (SIGTERM), corral keeps accepting and serving for `drain_delay`,
///    so a load balancer sees the 503 and stops sending before the port closes. On
///    [`Signal::Interrupt`], or a shutdown future that resolves to `()`, there is no delay.
/// 3. The listener closes; every connection is asked to finish (HTTP/1 after its response in
///    progress, HTTP/2 with a GOAWAY) and in-flight requests, streams included, get up to
///    `drain_timeout`; what is left is cut.
///
/// The admin listener serves throughout (its `/readyz` answers 503 until the end) and closes
/// last.
pub async fn run<S: Into<Signal>>(
    app: Arc<App>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = S>,
) -> std::io::Result<()> {
    let builder = Arc::new(accept::http_builder(&app.limits));
    let addr = listener.local_addr()?;
    let proxy_handler = {
        let app = Arc::clone(&app);
        move |req, peer| Arc::clone(&app).handle_caught(req, peer)
    };
    let mut proxy = Acceptor::new(
        "proxy",
        listener,
        app.limits,
        Arc::clone(&builder),
        proxy_handler,
        Arc::clone(&app.open_connections),
    );
    let mut admin = match admin {
        Some(listener) => {
            tracing::info!(addr = %listener.local_addr()?, "admin endpoints listening");
            let limits = ConnLimits {
                max_connections: ADMIN_MAX_CONNECTIONS,
                ..app.limits
            };
            let app = Arc::clone(&app);
            let handler = move |req: Request<Incoming>, _| {
                let response = app.admin(&req).unwrap_or_else(|| {
                    ProxyError::NoRoute(req.uri().path().to_owned()).into_response()
                });
                std::future::ready(response)
            };
            let open = Arc::default();
            Some(Acceptor::new(
                "admin", listener, limits, builder, handler, open,
            ))
        }
        None => None,
    };
    for warning in app.config.load().warnings() {
        tracing::warn!("{warning}");
    }
    app.ready.store(true, Ordering::SeqCst);
    tracing::info!(%addr, max_connections = app.limits.max_connections, "corral listening");

    let signal: Signal = serve_until(&mut proxy, admin.as_mut(), shutdown)
        .await
        .into();
    app.ready.store(false, Ordering::SeqCst);
    let delay = match signal {
        Signal::Terminate => app.drain_delay,
        Signal::Interrupt => Duration::ZERO,
    };
    tracing::info!(
        signal = signal.name(),
        drain_delay = ?delay,
        "draining: /readyz answers 503; serving on for the drain delay, then closing the listener"
    );
    serve_until(&mut proxy, admin.as_mut(), tokio::time::sleep(delay)).await;

    proxy.close();
    tracing::info!(
        open = proxy.open(),
        in_flight = app.in_flight(),
        drain_timeout = ?app.drain_timeout,
        "listener closed; draining connections"
    );
    let cut = tokio::select! {
        cut = proxy.drain(app.drain_timeout) => cut,
        () = serve_admin_forever(admin.as_mut()) => unreachable!("the admin loop never ends"),
    };
    if cut == 0 {
        tracing::info!("drained; all connections closed");
    } else {
        tracing::warn!(cut, "drain timeout passed; cut the connections still open");
    }
    if let Some(fleet) = &app.fleet {
        fleet.shutdown().await;
    }
    if let Some(admin) = &mut admin {
        admin.drain(Duration::ZERO).await;
    }
    Ok(())
}

/// Serve both listeners until `until` resolves.
async fn serve_until<T>(
    proxy: &mut Acceptor<impl Handler>,
    mut admin: Option<&mut Acceptor<impl Handler>>,
    until: impl Future<Output = T>,
) -> T {
    let mut until = std::pin::pin!(until);
    loop {
        tokio::select! {
            out = &mut until => return out,
            () = proxy.step() => {}
            () = serve_admin(admin.as_deref_mut()) => {}
        }
    }
}

/// One step of the admin listener; never resolves when there is none.
async fn serve_admin(admin: Option<&mut Acceptor<impl Handler>>) {
    match admin {
        Some(admin) => admin.step().await,
        None => std::future::pending().await,
    }
}

/// The admin listener, if any, until the caller stops polling.
async fn serve_admin_forever(mut admin: Option<&mut Acceptor<impl Handler>>) {
    loop {
        serve_admin(admin.as_deref_mut()).await;
    }
}

/// Reload the config on every SIGHUP: `load` reads it again (file, flags and environment, as at
/// start); a valid one is applied ([`App::reload`]), an invalid one is refused with a log line
/// and the old one stays. The handler is installed when this is called (so a SIGHUP right after
/// start-up does not hit the default action, which ends the process); the returned future runs
/// until the process ends.
pub fn reload_on_hangup<E: std::fmt::Display>(
    app: Arc<App>,
    load: impl Fn() -> Result<Config, E>,
) -> impl Future<Output = ()> {
    #[cfg(unix)]
    let hangups = {
        use tokio::signal::unix::{signal, SignalKind};
        signal(SignalKind::hangup())
            .map_err(|e| tracing::warn!(error = %e, "no SIGHUP handler: config reload is off"))
            .ok()
    };
    #[cfg(not(unix))]
    let hangups: Option<()> = None;
    async move {
        #[cfg(unix)]
        if let Some(mut hangups) = hangups {
            while hangups.recv().await.is_some() {
                tracing::info!(signal = "SIGHUP", "config reload requested");
                match load() {
                    Ok(config) => {
                        app.reload(&config);
                    }
                    Err(e) => app.reload_refused(&e),
                }
            }
        }
        #[cfg(not(unix))]
        let _ = (app, load, hangups);
    }
}
