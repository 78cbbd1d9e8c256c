//! A continuously refilling token bucket whose refill rate may follow a schedule.

use std::time::Duration;

use tokio::time::Instant;

use super::config::RefillChange;

/// Longest wait the bucket reports; used when it can never refill (rate 0).
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 60 * 60);

/// Token bucket: starts full, refills at `rate_at(now)` per second up to `capacity`.
#[derive(Debug, Clone)]
pub struct Bucket {
    capacity: f64,
    tokens: f64,
    base_rate: f64,
    /// Sorted by `at`, offsets from `start`.
    schedule: Vec<RefillChange>,
    start: Instant,
    last: Instant,
}

impl Bucket {
    pub fn new(capacity: f64, rate: f64, schedule: Vec<RefillChange>, now: Instant) -> Self {
        debug_assert!(schedule.windows(2).all(|w| w[0].at <= w[1].at));
        Self {
            capacity,
            tokens: capacity,
            base_rate: rate,
            schedule,
            start: now,
            last: now,
        }
    }

    /// Refills completely and restarts the schedule clock at `now`.
    pub fn reset(&mut self, now: Instant) {
        self.tokens = self.capacity;
        self.start = now;
        self.last = now;
    }

    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    /// Tokens left as of the last [`Bucket::refill`].
    pub fn tokens(&self) -> f64 {
        self.tokens
    }

    /// Refill rate in effect at `now` (per second).
    pub fn rate(&self, now: Instant) -> f64 {
        self.rate_at_offset(now.saturating_duration_since(self.start))
    }

    /// Adds what was refilled between the last call and `now`. An earlier `now` adds nothing.
    pub fn refill(&mut self, now: Instant) {
        let mut t = self.last;
        while t < now {
            let offset = t - self.start;
            let rate = self.rate_at_offset(offset);
            let seg_end = match self.next_change_after(offset) {
                Some(at) => now.min(self.start + at),
                None => now,
            };
            self.tokens += rate * (seg_end - t).as_secs_f64();
            if self.tokens >= self.capacity {
                self.tokens = self.capacity;
            }
            t = seg_end;
        }
        self.last = self.last.max(now);
    }

    /// Refills to `now`, then takes `n` tokens if there are that many.
    pub fn try_take(&mut self, now: Instant, n: f64) -> bool {
        self.refill(now);
        if self.tokens >= n {
            self.tokens -= n;
            true
        } else {
            false
        }
    }

    /// Refills to `now`, then takes `n` tokens even if that leaves the bucket below zero (a
    /// debt that later refills pay off first).
    pub fn charge(&mut self, now: Instant, n: f64) {
        self.refill(now);
        self.tokens -= n;
    }

    /// Time from the last refill until the bucket holds `level` tokens (capped at [`MAX_WAIT`]).
    pub fn time_until(&self, level: f64) -> Duration {
        let mut deficit = level.min(self.capacity) - self.tokens;
        let mut offset = self.last.saturating_duration_since(self.start);
        let mut waited = Duration::ZERO;
        while deficit > 0.0 && waited < MAX_WAIT {
            let rate = self.rate_at_offset(offset);
            let segment = self.next_change_after(offset).map(|at| at - offset);
            let gained = segment.map_or(f64::INFINITY, |s| rate * s.as_secs_f64());
            match segment {
                Some(s) if gained < deficit => {
                    deficit -= gained;
                    waited += s;
                    offset += s;
                }
                _ if rate > 0.0 => return (waited + secs(deficit / rate)).min(MAX_WAIT),
                _ => return MAX_WAIT,
            }
        }
        waited.min(MAX_WAIT)
    }

    /// Time from the last refill until the bucket is full again.
    pub fn time_until_full(&self) -> Duration {
        self.time_until(self.capacity)
    }

    fn rate_at_offset(&self, offset: Duration) -> f64 {
        self.schedule
            .iter()
            .rev()
            .find(|c| c.at <= offset)
            .map_or(self.base_rate, |c| c.rate)
    }

    fn next_change_after(&self, offset: Duration) -> Option<Duration> {
        self.schedule.iter().map(|c| c.at).find(|at| *at > offset)
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(MAX_WAIT)
}

#[cfg(test)]
mod tests;
