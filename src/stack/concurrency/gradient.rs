//! Adaptive concurrency for backends that queue instead of answering 429 (vLLM): a latency
//! gradient as in Netflix's Gradient2. The long-term RTT is the no-load baseline (it decays
//! slowly, so a baseline measured under load is forgotten); when the short-term RTT climbs above
//! `tolerance` times it, the window shrinks; while latency stays flat it grows by about
//! `sqrt(limit)` per update (the allowance for a short queue).

use std::time::Duration;

#[derive(Debug)]
pub struct Gradient {
    limit: f64,
    min: f64,
    max: f64,
    tolerance: f64,
    long_rtt: f64,
    short_rtt: f64,
}

impl Gradient {
    pub fn new(initial: u32, min: u32, max: u32, tolerance: f64) -> Self {
        Self {
            limit: f64::from(initial),
            min: f64::from(min),
            max: f64::from(max),
            tolerance,
            long_rtt: 0.0,
            short_rtt: 0.0,
        }
    }

    /// Feed one response's latency; returns the new limit.
    pub fn sample(&mut self, rtt: Duration) -> u32 {
        let rtt = rtt.as_secs_f64().max(1e-6);
        if self.long_rtt == 0.0 {
            self.long_rtt = rtt;
            self.short_rtt = rtt;
        }
        self.short_rtt = 0.9 * self.short_rtt + 0.1 * rtt;
        // The baseline follows lower samples quickly and higher ones slowly.
        let alpha = if rtt < self.long_rtt { 0.5 } else { 0.002 };
        self.long_rtt = (1.0 - alpha) * self.long_rtt + alpha * rtt.min(self.short_rtt);
        let gradient = (self.tolerance * self.long_rtt / self.short_rtt).clamp(0.5, 1.0);
        let queue = self.limit.sqrt();
        let target = self.limit * gradient + queue;
        self.limit = (0.8 * self.limit + 0.2 * target).clamp(self.min, self.max);
        self.limit as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_while_flat_and_shrinks_when_latency_climbs() {
        let mut g = Gradient::new(16, 1, 256, 2.0);
        let ms = Duration::from_millis;
        let mut limit = 16;
        for _ in 0..200 {
            limit = g.sample(ms(100));
        }
        assert!(limit > 64, "flat latency lets the window grow: {limit}");
        // The backend queues: latency climbs well past twice the baseline.
        for _ in 0..200 {
            limit = g.sample(ms(800));
        }
        assert!(limit < 32, "rising latency shrinks the window: {limit}");
        for _ in 0..400 {
            limit = g.sample(ms(100));
        }
        assert!(limit > 64, "it regrows when latency falls: {limit}");
        let mut floor = Gradient::new(4, 2, 8, 2.0);
        for i in 0..100 {
            floor.sample(ms(10 + i * 100));
        }
        assert!(
            floor.sample(ms(100_000)) >= 2,
            "never under min_concurrency"
        );
    }
}
