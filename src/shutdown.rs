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

/// Resolves on the first SIGINT or SIGTERM and says which. Both handlers are installed when
/// this is called (inside a tokio runtime), not when the future is first polled, so a signal
/// that arrives between start-up and the first poll is not lost to the default action. A signal
/// that cannot be listened for is logged and never fires; the other still does.
#[cfg(unix)]
pub fn signal() -> impl std::future::Future<Output = Signal> {
    use tokio::signal::unix::{signal, SignalKind};
    let listen = |kind: SignalKind, name: &'static str| match signal(kind) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, signal = name, "cannot listen for the signal");
            None
        }
    };
    let mut interrupt = listen(SignalKind::interrupt(), "SIGINT");
    let mut terminate = listen(SignalKind::terminate(), "SIGTERM");
    async move {
        let signal = tokio::select! {
            () = recv(interrupt.as_mut()) => Signal::Interrupt,
            () = recv(terminate.as_mut()) => Signal::Terminate,
        };
        tracing::info!(signal = signal.name(), "shutdown requested");
        signal
    }
}

/// The next delivery of `signal`, or never when it could not be listened for.
#[cfg(unix)]
async fn recv(signal: Option<&mut tokio::signal::unix::Signal>) {
    match signal {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// Resolves on ctrl-c (no SIGTERM off unix).
#[cfg(not(unix))]
pub fn signal() -> impl std::future::Future<Output = Signal> {
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        tracing::info!(signal = "SIGINT", "shutdown requested");
        Signal::Interrupt
    }
}
