//! Requests arriving at a partition over the last second: the forecast of the next second's.
//!
//! A count in a sliding window of ten 100 ms bins, not a smoothed rate: a batch fired at once
//! (500 clients, one request each) is a burst, and a burst is over once its requests are
//! waiting. A rate smoothed over the run read those 125 arrivals as 45 a second two seconds
//! later, so a replica whose last 8 requests waited asked the fleet for a block of 25 and held
//! the other replicas' units until it gave them back, a quarter second after its queue drained.

use std::time::Duration;

use tokio::time::Instant;

/// One bin of the window.
const BIN: Duration = Duration::from_millis(100);
/// Bins in the window (one second).
const BINS: usize = 10;

#[derive(Debug)]
pub(in crate::fleet) struct Arrivals {
    origin: Instant,
    /// Arrivals per bin, indexed by bin number modulo `BINS`.
    bins: [u32; BINS],
    /// The bin number of the latest arrival.
    last: u64,
}

impl Arrivals {
    pub(in crate::fleet) fn new(now: Instant) -> Self {
        Self {
            origin: now,
            bins: [0; BINS],
            last: 0,
        }
    }

    fn bin(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.origin).as_nanos() / BIN.as_nanos()) as u64
    }

    /// Empty the bins between the latest arrival and `bin`.
    fn advance(&mut self, bin: u64) {
        if bin <= self.last {
            return;
        }
        let stale = (bin - self.last).min(BINS as u64);
        for b in 1..=stale {
            self.bins[((self.last + b) % BINS as u64) as usize] = 0;
        }
        self.last = bin;
    }

    /// An arrival at `now` (one stamped before the latest counts in the latest's bin).
    pub(in crate::fleet) fn record(&mut self, now: Instant) {
        self.advance(self.bin(now));
        let i = (self.last % BINS as u64) as usize;
        self.bins[i] = self.bins[i].saturating_add(1);
    }

    /// Arrivals per second: those of the last second.
    pub(in crate::fleet) fn current(&self, now: Instant) -> f64 {
        let bin = self.bin(now);
        let age = bin.saturating_sub(self.last);
        if age >= BINS as u64 {
            return 0.0;
        }
        // The bins still inside the window: the latest `BINS - age` up to `last`.
        (0..BINS as u64 - age)
            .map(|b| f64::from(self.bins[((self.last + BINS as u64 - b) % BINS as u64) as usize]))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_is_forecast_for_a_second_and_then_forgotten() {
        let t0 = Instant::now();
        let mut a = Arrivals::new(t0);
        for _ in 0..125 {
            a.record(t0);
        }
        assert_eq!(a.current(t0), 125.0);
        assert_eq!(a.current(t0 + Duration::from_millis(950)), 125.0);
        assert_eq!(a.current(t0 + Duration::from_millis(1_000)), 0.0);
        // Two seconds on, the batch is no arrival rate at all.
        assert_eq!(a.current(t0 + Duration::from_secs(2)), 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_steady_stream_reads_as_its_rate() {
        let t0 = Instant::now();
        let mut a = Arrivals::new(t0);
        // 20 a second for five seconds.
        for i in 0..100u64 {
            a.record(t0 + Duration::from_millis(50 * i));
        }
        let now = t0 + Duration::from_millis(4_990);
        assert_eq!(a.current(now), 20.0);
        // A lull empties the window bin by bin.
        let later = t0 + Duration::from_millis(5_460);
        assert_eq!(a.current(later), 10.0);
        a.record(later);
        assert_eq!(a.current(later), 11.0);
    }
}
