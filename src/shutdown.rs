//! The shutdown signal: SIGINT or SIGTERM, and which one it was.
//!
//! The one signal future of the binary: `main` hands it to the proxy's [`crate::server::run`]
//! and, as a plain `()` future, to the sealed simulator, which imports nothing from here.

/// How a shutdown began; it decides whether the drain delay applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGINT (ctrl-c): a person at a terminal. No drain delay: the listener closes at once.
    Interrupt,
    /// SIGTERM: what orchestrators send. `/readyz` answers 503 while corral keeps serving for
    /// `drain_delay`, so a load balancer stops sending before the listener closes.
    Terminate,
}

impl Signal {
    /// `SIGINT` or `SIGTERM`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Interrupt => "SIGINT",
            Self::Terminate => "SIGTERM",
        }
    }
}

/// A shutdown future that resolves to `()` says "stop now", as SIGINT does.
impl From<()> for Signal {
    fn from((): ()) -> Self {
        Self::Interrupt
    }
}

/// Resolves on the first SIGINT or SIGTERM and says which. A signal that cannot be listened
/// for is logged and never fires; the other still does.
pub async fn signal() -> Signal {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    let signal = tokio::select! {
        () = ctrl_c => Signal::Interrupt,
        () = term => Signal::Terminate,
    };
    tracing::info!(signal = signal.name(), "shutdown requested");
    signal
}
