//! A per-day request quota (`--requests-per-day`), as Groq and Gemini document them.
//!
//! A quota is not a pace: once the day's requests are spent, no rate gets one through until
//! the day ends, so the honest hint is hours away. The simulated day starts with the simulator
//! (or its last reset) and lasts 24 hours; its "midnight" is the end of each such day. Only
//! admitted requests count (a refusal costs nothing), and the count starts again at midnight.
//!
//! Groq reports its requests-per-day quota in the request rate-limit headers, so while a quota
//! is set [`DailyQuota::view`] is what those headers say: `limit` the day's requests,
//! `remaining` what is left, `reset` the time until midnight (0 while nothing is spent).

use std::time::Duration;

use tokio::time::Instant;

use super::limits::View;

/// The length of a simulated day.
pub const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Requests admitted today against the day's limit.
#[derive(Debug)]
pub struct DailyQuota {
    limit: u64,
    used: u64,
    /// Start of the current day.
    today: Instant,
}

impl DailyQuota {
    pub fn new(limit: u64, now: Instant) -> Self {
        Self {
            limit,
            used: 0,
            today: now,
        }
    }

    /// A fresh day starting at `now`.
    pub fn reset(&mut self, now: Instant) {
        self.used = 0;
        self.today = now;
    }

    /// Whether the day's requests are spent as of `now`.
    pub fn spent(&mut self, now: Instant) -> bool {
        self.roll(now);
        self.used >= self.limit
    }

    /// Counts one admitted request at `now`.
    pub fn count(&mut self, now: Instant) {
        self.roll(now);
        self.used += 1;
    }

    /// Time from `now` until the simulated midnight.
    pub fn until_midnight(&mut self, now: Instant) -> Duration {
        self.roll(now);
        (self.today + DAY).saturating_duration_since(now)
    }

    /// The day as the request rate-limit headers describe it at `now`.
    pub fn view(&mut self, now: Instant) -> View {
        let reset = if self.used == 0 {
            Duration::ZERO
        } else {
            self.until_midnight(now)
        };
        View {
            limit: self.limit,
            remaining: self.limit.saturating_sub(self.used),
            reset,
        }
    }

    /// Moves to the day holding `now`: each midnight passed clears the count.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.today);
        if elapsed >= DAY {
            let days = (elapsed.as_secs_f64() / DAY.as_secs_f64()).floor() as u32;
            self.today += DAY * days;
            self.used = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    #[tokio::test(start_paused = true)]
    async fn the_quota_is_spent_after_its_limit_and_comes_back_at_midnight() {
        let mut q = DailyQuota::new(2, Instant::now());
        let view = q.view(Instant::now());
        assert_eq!(
            (view.limit, view.remaining, view.reset),
            (2, 2, Duration::ZERO)
        );
        q.count(Instant::now());
        advance(Duration::from_secs(3600)).await;
        assert!(!q.spent(Instant::now()));
        q.count(Instant::now());
        assert!(q.spent(Instant::now()));
        let view = q.view(Instant::now());
        assert_eq!(
            (view.remaining, view.reset),
            (0, Duration::from_secs(23 * 3600))
        );
        advance(Duration::from_secs(23 * 3600 - 1)).await;
        assert!(q.spent(Instant::now()));
        assert_eq!(q.until_midnight(Instant::now()), Duration::from_secs(1));
        advance(Duration::from_secs(1)).await;
        assert!(!q.spent(Instant::now()));
        assert_eq!(q.until_midnight(Instant::now()), DAY);
    }

    #[tokio::test(start_paused = true)]
    async fn days_passed_in_silence_are_skipped_and_reset_starts_a_new_day() {
        let mut q = DailyQuota::new(1, Instant::now());
        q.count(Instant::now());
        advance(DAY * 3 + Duration::from_secs(10)).await;
        assert!(!q.spent(Instant::now()));
        assert_eq!(
            q.until_midnight(Instant::now()),
            DAY - Duration::from_secs(10)
        );
        q.count(Instant::now());
        q.reset(Instant::now());
        assert!(!q.spent(Instant::now()));
        assert_eq!(q.until_midnight(Instant::now()), DAY);
    }
}
