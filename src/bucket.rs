//! Configured ceilings as token buckets on tokio's clock (so paused-time tests work). A bucket
//! can say how long until it could yield `n` without taking them ([`Bucket::wait_for`]), so a
//! request checks every ceiling before it takes from any ([`take_all`]): a unit is never spent
//! in one bucket for a request another bucket then refuses, or that leaves while it waits.
//! (governor's buckets only answer by taking and give nothing back: a check that does not take
//! is its open issue `boinkor-net/governor#15` and unmerged PR #211.) Waiters are served in
//! FIFO order by the partition's fair turn, so a large request is not starved by small ones.

use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::sync::lock;

/// Rounding in the level's arithmetic (units): a level this close to `n` holds `n`.
const EPSILON: f64 = 1e-9;

/// One per-minute bucket: `burst` at most, refilled at `per_minute` a minute; it starts full.
pub struct Bucket {
    /// The level and when it was last refilled.
    state: Mutex<(f64, Instant)>,
    burst: NonZeroU32,
    per_minute: NonZeroU32,
}

impl Bucket {
    pub fn per_minute(per_minute: NonZeroU32, burst: NonZeroU32) -> Self {
        Self {
            state: Mutex::new((f64::from(burst.get()), Instant::now())),
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

    /// `n` clamped to the burst, since more could never pass.
    fn clamp(&self, n: u32) -> f64 {
        f64::from(n.clamp(1, self.burst.get()))
    }

    /// The level at `now`, refilled since `at`.
    fn level(&self, (level, at): (f64, Instant), now: Instant) -> f64 {
        let dt = now.saturating_duration_since(at).as_secs_f64();
        (level + self.per_second() * dt).min(f64::from(self.burst.get()))
    }

    /// How long until `n` (clamped to the burst) could be taken; zero: now. Takes nothing.
    pub fn wait_for(&self, n: u32) -> Duration {
        let level = self.level(*lock(&self.state), Instant::now());
        self.short(self.clamp(n), level)
    }

    fn short(&self, n: f64, level: f64) -> Duration {
        if level + EPSILON >= n {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((n - level) / self.per_second())
        }
    }

    /// Take `n` (clamped to the burst, since more could never pass): `Ok` now, or how long until
    /// it would succeed.
    pub fn try_take(&self, n: u32) -> Result<(), Duration> {
        let n = self.clamp(n);
        let now = Instant::now();
        let mut state = lock(&self.state);
        let level = self.level(*state, now);
        let wait = self.short(n, level);
        if wait.is_zero() {
            *state = ((level - n).max(0.0), now);
            Ok(())
        } else {
            Err(wait)
        }
    }
}

/// Wait until every bucket of `stages` yields its units, then take them all, unless the wait
/// would pass `deadline`: then the wait it needs, with nothing taken. Nothing is taken while it
/// waits either, so a request refused or cancelled here has spent nothing. (Callers hold their
/// partition's turn: no one else takes from these buckets meanwhile.)
pub async fn take_all(stages: &[(&Bucket, u32)], deadline: Instant) -> Result<(), Duration> {
    ready_all(stages, deadline).await?;
    take_ready(stages);
    Ok(())
}

/// Wait until every bucket of `stages` could yield its units now, taking nothing; `Err`: the
/// wait it would need beyond `deadline`.
pub async fn ready_all(stages: &[(&Bucket, u32)], deadline: Instant) -> Result<(), Duration> {
    loop {
        let wait = stages
            .iter()
            .map(|(bucket, n)| bucket.wait_for(*n))
            .max()
            .unwrap_or_default();
        if wait.is_zero() {
            return Ok(());
        }
        if Instant::now() + wait > deadline {
            return Err(wait);
        }
        tokio::time::sleep(wait.max(Duration::from_micros(100))).await;
    }
}

/// Take the units of `stages`, which [`ready_all`] found there (under the turn, they still are).
pub fn take_ready(stages: &[(&Bucket, u32)]) {
    for (bucket, n) in stages {
        let _ = bucket.try_take(*n);
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
        take_all(&[(&b, 1)], now + Duration::from_secs(5))
            .await
            .unwrap();
        let wait = take_all(&[(&b, 1)], now + Duration::from_millis(500))
            .await
            .unwrap_err();
        assert!(wait > Duration::from_millis(900), "{wait:?}");
        take_all(&[(&b, 1)], now + Duration::from_secs(5))
            .await
            .unwrap();
        assert!(Instant::now() >= now + Duration::from_millis(999));
    }

    #[tokio::test(start_paused = true)]
    async fn oversized_requests_are_clamped_to_the_burst() {
        let b = Bucket::per_minute(nz(6000), nz(100));
        assert!(b.try_take(1000).is_ok(), "clamped to 100");
        assert!(b.try_take(1).is_err());
    }
}
