//! Backoff schedules by AWS's formulas, with the RNG passed in so tests can seed it.
//!
//! With `e = min(cap, base * 2^n)` for retry `n` (0-based): full jitter `U(0, e)`, equal jitter
//! `e/2 + U(0, e/2)`, decorrelated `min(cap, U(base, 3 * previous))`, none `e`.

use std::time::Duration;

use rand::Rng;

use crate::config::Jitter;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
    pub jitter: Jitter,
}

impl Backoff {
    /// The un-jittered ceiling for retry `n`.
    pub fn ceiling(&self, n: u32) -> Duration {
        let factor = 2u32.saturating_pow(n.min(31));
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The sleep before retry `n`; `previous` is the last sleep (for decorrelated jitter).
    pub fn sleep(&self, n: u32, previous: Duration, rng: &mut impl Rng) -> Duration {
        let e = self.ceiling(n);
        let uniform = |rng: &mut dyn rand::RngCore, lo: Duration, hi: Duration| {
            if hi <= lo {
                lo
            } else {
                Duration::from_secs_f64(rng.random_range(lo.as_secs_f64()..hi.as_secs_f64()))
            }
        };
        match self.jitter {
            Jitter::None => e,
            Jitter::Full => uniform(rng, Duration::ZERO, e),
            Jitter::Equal => e / 2 + uniform(rng, Duration::ZERO, e / 2),
            Jitter::Decorrelated => {
                let prev = previous.max(self.base);
                uniform(rng, self.base, prev.saturating_mul(3)).min(self.cap)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    fn b(jitter: Jitter) -> Backoff {
        Backoff {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
            jitter,
        }
    }

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let b = b(Jitter::None);
        let want = [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000];
        for (n, ms) in want.iter().enumerate() {
            assert_eq!(b.ceiling(n as u32), Duration::from_millis(*ms));
        }
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn each_jitter_stays_in_its_bounds_and_spreads() {
        let mut rng = SmallRng::seed_from_u64(7);
        for n in 0..8 {
            let e = b(Jitter::None).ceiling(n);
            let full: Vec<_> = (0..2000)
                .map(|_| b(Jitter::Full).sleep(n, Duration::ZERO, &mut rng))
                .collect();
            assert!(full.iter().all(|d| *d <= e));
            let mean = full.iter().map(Duration::as_secs_f64).sum::<f64>() / 2000.0;
            assert!(
                (mean - e.as_secs_f64() / 2.0).abs() < e.as_secs_f64() * 0.05,
                "full jitter mean {mean} for {e:?}"
            );
            let below_quarter = full.iter().filter(|d| **d < e / 4).count();
            assert!(
                (400..600).contains(&below_quarter),
                "full jitter is uniform: {below_quarter}/2000 under e/4"
            );
            for _ in 0..500 {
                let eq = b(Jitter::Equal).sleep(n, Duration::ZERO, &mut rng);
                assert!(eq >= e / 2 && eq <= e);
            }
            assert_eq!(b(Jitter::None).sleep(n, Duration::ZERO, &mut rng), e);
        }
        let mut prev = Duration::ZERO;
        for n in 0..50 {
            let d = b(Jitter::Decorrelated).sleep(n, prev, &mut rng);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_secs(30));
            assert!(d <= prev.max(Duration::from_millis(500)) * 3);
            prev = d;
        }
    }

    #[test]
    fn zero_base_never_panics() {
        let z = Backoff {
            base: Duration::ZERO,
            cap: Duration::ZERO,
            jitter: Jitter::Full,
        };
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(z.sleep(3, Duration::ZERO, &mut rng), Duration::ZERO);
    }
}
