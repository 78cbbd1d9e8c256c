//! Circuit breaker per upstream: a gate in front of every attempt (it sits inside Retry), fed the
//! classified outcome of each. While open, requests wait (up to their deadline) instead of
//! failing, or with `on_open = "reject"` get a 503 with Retry-After. When it closes, waiters go
//! on to the rate limiter, which paces them: never all at once.

pub mod state;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower::ServiceExt;

use self::state::{Admit, Breaker, Phase};
use crate::classify::Outcome;
use crate::config::{BreakerConfig, OnOpen};
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{BoxFuture, Middleware, Next, Shared};

/// One upstream's breaker, shared by all its requests.
pub struct BreakerShared {
    state: Mutex<Breaker>,
    changed: Notify,
    rng: Mutex<SmallRng>,
    on_open: OnOpen,
    metrics: UpstreamMetrics,
}

impl BreakerShared {
    pub fn new(config: &BreakerConfig, metrics: UpstreamMetrics) -> Arc<Self> {
        metrics.breaker_state.set(0);
        Arc::new(Self {
            state: Mutex::new(Breaker::new(config.clone())),
            changed: Notify::new(),
            rng: Mutex::new(SmallRng::from_os_rng()),
            on_open: config.on_open,
            metrics,
        })
    }

    pub fn phase(&self) -> Phase {
        self.state.lock().expect("breaker lock").phase()
    }

    fn transitioned(&self, phase: Phase) {
        self.metrics.breaker_state.set(phase.gauge());
        self.metrics.breaker_transition(phase.name());
        tracing::warn!(
            upstream = self.metrics.name(),
            state = phase.name(),
            "circuit breaker changed state"
        );
        self.changed.notify_waiters();
    }

    /// Wait until admitted or the deadline passes.
    async fn admit(&self, deadline: Instant) -> Result<bool, ProxyError> {
        loop {
            let notified = self.changed.notified();
            let (verdict, changed) = self
                .state
                .lock()
                .expect("breaker lock")
                .admit(Instant::now());
            if changed {
                self.transitioned(self.phase());
            }
            let until = match verdict {
                Admit::Pass { probe } => return Ok(probe),
                Admit::Wait(until) => until,
            };
            let retry_after = until.map_or(Duration::from_secs(1), |u| {
                u.saturating_duration_since(Instant::now())
            });
            if self.on_open == OnOpen::Reject || Instant::now() >= deadline {
                return Err(ProxyError::CircuitOpen {
                    upstream: self.metrics.name().to_owned(),
                    retry_after,
                });
            }
            let wake = until.map_or(deadline, |u| u.min(deadline));
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    fn record(&self, outcome: Outcome, probe: bool) {
        let mut state = self.state.lock().expect("breaker lock");
        let changed = if outcome.reached_upstream() {
            let jitter = self.rng.lock().expect("rng lock").random::<f64>();
            state.record(outcome.is_upstream_failure(), probe, Instant::now(), jitter)
        } else {
            if probe {
                state.release_probe();
            }
            false
        };
        let phase = state.phase();
        drop(state);
        if changed {
            self.transitioned(phase);
        }
    }
}

/// Gives a half-open probe's slot back if its request is dropped (client gone) unanswered.
struct ProbeSlot {
    shared: Arc<BreakerShared>,
    probe: Option<bool>,
}

impl Drop for ProbeSlot {
    fn drop(&mut self) {
        if self.probe == Some(true) {
            self.shared
                .state
                .lock()
                .expect("breaker lock")
                .release_probe();
        }
    }
}

/// The breaker as a tower layer.
pub type BreakerLayer = Shared<BreakerShared>;

impl Middleware for BreakerShared {
    fn call<S: Next>(self: Arc<Self>, next: S, req: ProxyRequest) -> BoxFuture {
        let shared = self;
        Box::pin(async move {
            let probe = shared.admit(req.ctx.deadline).await?;
            let mut slot = ProbeSlot {
                shared: Arc::clone(&shared),
                probe: Some(probe),
            };
            let result = next.oneshot(req).await;
            slot.probe = None;
            shared.record(Outcome::of(&result), probe);
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HumanDuration;

    fn shared(on_open: OnOpen) -> Arc<BreakerShared> {
        let config = BreakerConfig {
            window: 10,
            min_samples: 5,
            cooldown: HumanDuration::from_secs(4),
            half_open_probes: 1,
            on_open,
            ..BreakerConfig::default()
        };
        BreakerShared::new(&config, crate::metrics::Metrics::new().upstream("t"))
    }

    fn open(b: &BreakerShared) {
        for _ in 0..5 {
            b.record(Outcome::ServerError(503), false);
        }
        assert_eq!(b.phase().name(), "open");
    }

    #[tokio::test(start_paused = true)]
    async fn reject_answers_503_with_the_remaining_cooldown() {
        let b = shared(OnOpen::Reject);
        open(&b);
        let err = b
            .admit(Instant::now() + Duration::from_secs(60))
            .await
            .unwrap_err();
        assert_eq!(err.status(), 503);
        let after = err.retry_after().unwrap();
        assert!(
            after > Duration::from_secs(2) && after <= Duration::from_secs(4),
            "{after:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn queue_waits_for_the_half_open_probe_within_the_deadline() {
        let b = shared(OnOpen::Queue);
        open(&b);
        let start = Instant::now();
        let probe = b.admit(start + Duration::from_secs(60)).await.unwrap();
        assert!(probe, "admitted as a half-open probe");
        assert!(
            start.elapsed() >= Duration::from_secs(3),
            "waited out the cool-down"
        );
        open_again_then_deadline(&b).await;
    }

    async fn open_again_then_deadline(b: &BreakerShared) {
        b.record(Outcome::Timeout, true);
        assert_eq!(b.phase().name(), "open", "the failed probe reopened it");
        // A deadline shorter than the (doubled) cool-down ends the wait with a 503.
        let err = b
            .admit(Instant::now() + Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, ProxyError::CircuitOpen { .. }), "{err}");
    }
}
