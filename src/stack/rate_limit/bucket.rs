//! Configured ceilings as governor buckets on tokio's clock (so paused-time tests work), with
//! waiters served in FIFO order through a fair tokio `Mutex`: governor keeps no waiter queue,
//! and without one a large request could starve behind a stream of small ones.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::Clock;
use governor::middleware::NoOpMiddleware;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use tokio::time::Instant;

/// governor's clock, read from tokio's (which obeys `tokio::time::pause()`).
#[derive(Debug, Clone)]
pub struct TokioClock {
    start: Instant,
}

impl Default for TokioClock {
    fn default() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Clock for TokioClock {
    type Instant = Duration;
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
}

type Limiter = RateLimiter<NotKeyed, InMemoryState, TokioClock, NoOpMiddleware<Duration>>;

/// One per-minute governor bucket.
pub struct Bucket {
    limiter: Limiter,
    clock: TokioClock,
    burst: NonZeroU32,
    per_minute: NonZeroU32,
}

impl Bucket {
    pub fn per_minute(per_minute: NonZeroU32, burst: NonZeroU32) -> Self {
        let clock = TokioClock::default();
        let quota = Quota::per_minute(per_minute).allow_burst(burst);
        Self {
            limiter: RateLimiter::direct_with_clock(quota, clock.clone()),
            clock,
            burst,
            per_minute,
        }
    }

    pub fn burst(&self) -> NonZeroU32 {
        self.burst
    }

    pub fn per_second(&self) -> f64 {
        f64::from(self.per_minute.get()) / 60.0
    }

    /// Take `n` (clamped to the burst, since more could never pass): `Ok` now, or how long until
    /// it would succeed.
    pub fn try_take(&self, n: u32) -> Result<(), Duration> {
        let n = NonZeroU32::new(n.clamp(1, self.burst.get())).expect("at least one");
        match self.limiter.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(not_until.wait_time_from(self.clock.now())),
            Err(_insufficient) => Err(Duration::from_secs(60)),
        }
    }
}

/// Wait until `bucket` yields `n`, unless that would pass `deadline`: then the wait it needs.
pub async fn take(bucket: &Bucket, n: u32, deadline: Instant) -> Result<(), Duration> {
    loop {
        match bucket.try_take(n) {
            Ok(()) => return Ok(()),
            Err(wait) if Instant::now() + wait > deadline => return Err(wait),
            Err(wait) => tokio::time::sleep(wait.max(Duration::from_micros(100))).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn burst_then_refill_on_tokio_time() {
        let b = Bucket::per_minute(nz(600), nz(5)); // 10/s
        for _ in 0..5 {
            assert!(b.try_take(1).is_ok());
        }
        let wait = b.try_take(1).unwrap_err();
        assert!(
            wait <= Duration::from_millis(100) && wait > Duration::ZERO,
            "{wait:?}"
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(b.try_take(1).is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn take_refuses_waits_beyond_the_deadline() {
        let b = Bucket::per_minute(nz(60), nz(1)); // 1/s
        let now = Instant::now();
        take(&b, 1, now + Duration::from_secs(5)).await.unwrap();
        let wait = take(&b, 1, now + Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(wait > Duration::from_millis(900), "{wait:?}");
        take(&b, 1, now + Duration::from_secs(5)).await.unwrap();
        assert!(Instant::now() >= now + Duration::from_millis(999));
    }

    #[tokio::test(start_paused = true)]
    async fn oversized_requests_are_clamped_to_the_burst() {
        let b = Bucket::per_minute(nz(6000), nz(100));
        assert!(b.try_take(1000).is_ok(), "clamped to 100");
        assert!(b.try_take(1).is_err());
    }
}
