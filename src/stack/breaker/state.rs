//! The breaker's state machine, free of I/O: fed outcomes and the time, it says who may pass.
//!
//! Vocabulary (the electrical one, not Linkerd's): **closed** = traffic flows; **open** = traffic
//! is held; **half-open** = a few probes test the upstream.
//!
//! - Closed: over the last `window` outcomes (once at least `min_samples`), an error rate at or
//!   above `open_error_rate` opens it.
//! - Open: for a cool-down of `cooldown * 2^(consecutive opens - 1)`, capped at `max_cooldown`,
//!   jittered to 75-100% so several corrals don't probe in step; then half-open.
//! - Half-open: admits `half_open_probes` requests; when all have answered, an error rate below
//!   `close_error_rate` closes it (with a fresh window), anything else opens it again, longer.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::BreakerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Closed,
    Open {
        until: Instant,
    },
    HalfOpen {
        admitted: u32,
        answered: u32,
        failed: u32,
    },
}

impl Phase {
    pub fn gauge(&self) -> i64 {
        match self {
            Phase::Closed => 0,
            Phase::HalfOpen { .. } => 1,
            Phase::Open { .. } => 2,
        }
    }
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Closed => "closed",
            Phase::HalfOpen { .. } => "half_open",
            Phase::Open { .. } => "open",
        }
    }
}

/// May a request pass now?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Yes; `probe` tells whether it is one of the half-open probes.
    Pass { probe: bool },
    /// Not before this instant (open), or not until a probe answers (half-open: `None`).
    Wait(Option<Instant>),
}

#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    window: VecDeque<bool>,
    failures: usize,
    phase: Phase,
    consecutive_opens: u32,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        Self {
            window: VecDeque::with_capacity(config.window as usize),
            config,
            failures: 0,
            phase: Phase::Closed,
            consecutive_opens: 0,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Admit one request at `now`; `jitter` in [0, 1) spreads the cool-down. Returns the verdict
    /// and whether the phase changed.
    pub fn admit(&mut self, now: Instant) -> (Admit, bool) {
        let mut changed = false;
        if let Phase::Open { until } = self.phase {
            if now < until {
                return (Admit::Wait(Some(until)), false);
            }
            self.phase = Phase::HalfOpen {
                admitted: 0,
                answered: 0,
                failed: 0,
            };
            changed = true;
        }
        match &mut self.phase {
            Phase::Closed => (Admit::Pass { probe: false }, changed),
            Phase::HalfOpen { admitted, .. } if *admitted < self.config.half_open_probes => {
                *admitted += 1;
                (Admit::Pass { probe: true }, changed)
            }
            _ => (Admit::Wait(None), changed),
        }
    }

    /// Record an answer from the upstream. Returns true when the phase changed.
    pub fn record(&mut self, failed: bool, probe: bool, now: Instant, jitter: f64) -> bool {
        match &mut self.phase {
            Phase::HalfOpen {
                answered,
                failed: f,
                ..
            } if probe => {
                *answered += 1;
                *f += u32::from(failed);
                if *answered >= self.config.half_open_probes {
                    let rate = f64::from(*f) / f64::from(*answered);
                    if rate < self.config.close_error_rate || (*f == 0) {
                        self.close();
                    } else {
                        self.open(now, jitter);
                    }
                    return true;
                }
                false
            }
            Phase::Closed => {
                self.window.push_back(failed);
                self.failures += usize::from(failed);
                if self.window.len() > self.config.window as usize {
                    let old = self.window.pop_front().expect("non-empty window");
                    self.failures -= usize::from(old);
                }
                let n = self.window.len();
                if n >= self.config.min_samples as usize
                    && self.failures as f64 / n as f64 >= self.config.open_error_rate
                {
                    self.open(now, jitter);
                    return true;
                }
                false
            }
            // Answers of requests admitted before the breaker opened don't move it further.
            _ => false,
        }
    }

    /// A probe that never reached the upstream (corral refused it locally) gives its slot back.
    pub fn release_probe(&mut self) {
        if let Phase::HalfOpen { admitted, .. } = &mut self.phase {
            *admitted = admitted.saturating_sub(1);
        }
    }

    fn open(&mut self, now: Instant, jitter: f64) {
        self.consecutive_opens += 1;
        let doubling = 2u32.saturating_pow(self.consecutive_opens.saturating_sub(1).min(16));
        let cooldown = self
            .config
            .cooldown
            .0
            .saturating_mul(doubling)
            .min(self.config.max_cooldown.0);
        let cooldown = cooldown.mul_f64(0.75 + 0.25 * jitter.clamp(0.0, 1.0));
        self.phase = Phase::Open {
            until: now + cooldown.max(Duration::from_millis(1)),
        };
    }

    fn close(&mut self) {
        self.consecutive_opens = 0;
        self.window.clear();
        self.failures = 0;
        self.phase = Phase::Closed;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HumanDuration;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            window: 10,
            min_samples: 5,
            cooldown: HumanDuration::from_secs(2),
            max_cooldown: HumanDuration::from_secs(5),
            half_open_probes: 2,
            ..BreakerConfig::default()
        })
    }

    #[tokio::test(start_paused = true)]
    async fn opens_at_the_error_rate_after_min_samples() {
        let mut b = breaker();
        let now = Instant::now();
        for _ in 0..3 {
            assert!(
                !b.record(true, false, now, 1.0),
                "below min_samples it stays closed"
            );
        }
        b.record(false, false, now, 1.0);
        assert!(
            b.record(false, false, now, 1.0),
            "3 of 5 failed = 60% >= 40%: opens"
        );
        assert_eq!(
            b.phase(),
            Phase::Open {
                until: now + Duration::from_secs(2)
            }
        );
        assert_eq!(
            b.admit(now).0,
            Admit::Wait(Some(now + Duration::from_secs(2)))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_probes_close_or_reopen_longer() {
        let mut b = breaker();
        let t0 = Instant::now();
        for _ in 0..5 {
            b.record(true, false, t0, 1.0);
        }
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(b.admit(t1), (Admit::Pass { probe: true }, true));
        assert_eq!(b.admit(t1).0, Admit::Pass { probe: true });
        assert_eq!(b.admit(t1).0, Admit::Wait(None), "only two probes");
        b.record(false, true, t1, 1.0);
        assert!(b.record(true, true, t1, 1.0), "a failed probe reopens");
        assert_eq!(
            b.phase(),
            Phase::Open {
                until: t1 + Duration::from_secs(4)
            },
            "cool-down doubled"
        );
        let t2 = t1 + Duration::from_secs(4);
        b.admit(t2);
        b.admit(t2);
        b.record(false, true, t2, 1.0);
        assert!(b.record(false, true, t2, 1.0));
        assert_eq!(b.phase(), Phase::Closed);
        for _ in 0..3 {
            b.record(true, false, t2, 1.0);
        }
        assert_eq!(b.phase(), Phase::Closed, "the window restarted on closing");
    }

    #[tokio::test(start_paused = true)]
    async fn cooldown_caps_and_jitters() {
        let mut b = breaker();
        let now = Instant::now();
        b.consecutive_opens = 10;
        b.open(now, 0.0);
        assert_eq!(
            b.phase(),
            Phase::Open {
                until: now + Duration::from_millis(3750)
            },
            "5s cap, 75% jitter floor"
        );
    }
}
