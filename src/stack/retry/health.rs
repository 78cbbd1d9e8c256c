//! Retries the budget cannot pay: within the official SDKs' own two of a request, they wait
//! for the upstream to serve again instead of failing (the retry module's doc, "Failures are
//! budgeted").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tower::retry::budget::Budget;

use super::RetryShared;
use crate::forward::ProxyRequest;

/// The retries the official SDKs make by default (`max_retries = 2`): a failure's retries
/// within them wait for health when the budget cannot pay, rather than fail.
pub(super) const SDK_RETRIES: u32 = 2;

/// How long such a retry waits for the upstream to serve again: the SDKs' two retries at their
/// backoff's cap (8 s each). An outage the client alone rides out by retrying, corral rides
/// out by waiting, though the breaker may hold the probes a cooldown longer.
const HEALTH_PATIENCE: Duration = Duration::from_secs(16);

/// One retry waiting for health goes as a probe this often (the SDKs' first backoff): the
/// budget may be spent for its whole window while the outage is already over.
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// A retry waiting for health looks again at least this often, so the waiters go within a
/// second of the upstream serving again, spread over it.
const HEALTH_POLL: Duration = Duration::from_secs(1);

/// When a retry waiting for health last went as the upstream's probe.
#[derive(Debug)]
pub(super) struct Probes {
    /// Milliseconds since `epoch`.
    probed: AtomicU64,
    epoch: Instant,
}

impl Probes {
    pub(super) fn new() -> Self {
        Self {
            probed: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Whether a retry waiting for health may go now as the upstream's probe: one every
    /// [`PROBE_EVERY`] across the upstream, so an outage that has spent the budget still
    /// learns when it ends.
    pub(super) fn take(&self) -> bool {
        let now = self.epoch.elapsed().as_millis() as u64;
        let last = self.probed.load(Ordering::Relaxed);
        now >= last + PROBE_EVERY.as_millis() as u64
            && self
                .probed
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// A retry the budget could not pay: nothing more is sent for it until the upstream serves
/// some request well (since `served`: the outage the budget guards against is over), the
/// budget can pay for it after all, or it is the upstream's next probe (`may_probe`: one that
/// has not been one yet, so a waiter whose probe met the outage waits on rather than spend its
/// second retry on another); until then it backs off as an outage does (looking again within
/// [`HEALTH_POLL`]), for at most [`HEALTH_PATIENCE`]. `false`: that, or the deadline, came
/// first.
pub(super) async fn await_health(
    served: u64,
    mut rung: u32,
    may_probe: bool,
    req: &ProxyRequest,
    shared: &RetryShared,
) -> bool {
    let until = req.ctx().deadline.min(Instant::now() + HEALTH_PATIENCE);
    let mut previous = Duration::ZERO;
    loop {
        if shared.served.load(Ordering::Relaxed) != served
            || shared.budget.withdraw()
            || (may_probe && shared.probes.take())
        {
            return true;
        }
        rung += 1;
        let now = Instant::now();
        if now >= until {
            return false;
        }
        let sleep = shared
            .sleep_for(rung, previous, None)
            .min(HEALTH_POLL)
            .min(until - now);
        tokio::time::sleep(sleep).await;
        previous = sleep;
    }
}
