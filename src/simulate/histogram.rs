//! A fixed-size histogram of millisecond waits (`--queue-slots`): exact below 1,024 ms, then
//! 64 bins per doubling, so memory never grows with the number of requests.

/// Waits below this many milliseconds each have a bin of their own.
const EXACT: u64 = 1024;
/// Bins per doubling above [`EXACT`]: a coarse bin spans under 1/64 (1.6%) of its values.
const PER_DOUBLING: u64 = 64;
/// Longer waits (about 12 days) are counted in the last bin.
const MAX_MS: u64 = (1 << 30) - 1;
/// The exact bins, then [`PER_DOUBLING`] for each doubling from 2^10 to 2^30 ms.
const BINS: usize = (EXACT + 20 * PER_DOUBLING) as usize;

/// Counts of waits by bin, their number and the longest wait.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Box<[u64]>,
    total: u64,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BINS].into_boxed_slice(),
            total: 0,
            max: 0,
        }
    }
}

impl Histogram {
    pub fn record(&mut self, ms: u64) {
        self.counts[bin(ms)] += 1;
        self.total += 1;
        self.max = self.max.max(ms);
    }

    pub fn clear(&mut self) {
        self.counts.fill(0);
        self.total = 0;
        self.max = 0;
    }

    /// Longest wait recorded (exact); 0 when empty.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The nearest-rank `q`-quantile (`q` in 0..=1) as the lowest value of its bin: exact
    /// below 1,024 ms, at most 1/64 low above. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return low(i);
            }
        }
        self.max
    }
}

/// The bin of a wait of `ms` milliseconds.
fn bin(ms: u64) -> usize {
    let ms = ms.min(MAX_MS);
    if ms < EXACT {
        return ms as usize;
    }
    // `ms` has its top bit at `e` (10..=29); its next 6 bits pick one of 64 bins.
    let e = u64::from(63 - ms.leading_zeros());
    let sub = (ms >> (e - 6)) - PER_DOUBLING;
    (EXACT + (e - 10) * PER_DOUBLING + sub) as usize
}

/// The lowest wait that falls in bin `i`.
fn low(i: usize) -> u64 {
    let i = i as u64;
    if i < EXACT {
        return i;
    }
    let k = i - EXACT;
    let e = k / PER_DOUBLING + 10;
    (PER_DOUBLING + k % PER_DOUBLING) << (e - 6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_are_exact_then_relative() {
        for ms in [0, 1, 40, 1023] {
            assert_eq!(low(bin(ms)), ms);
        }
        assert_eq!(bin(1024), 1024);
        assert_eq!(bin(1039), 1024, "16 ms wide just above 1,024");
        assert_eq!(bin(1040), 1025);
        assert_eq!(bin(MAX_MS), BINS - 1);
        assert_eq!(bin(u64::MAX), BINS - 1);
        for ms in [1024, 1500, 65_537, 10_000_000, MAX_MS] {
            let lo = low(bin(ms));
            assert!(lo <= ms && ms - lo <= ms / 64, "{ms} -> {lo}");
            assert_eq!(bin(lo), bin(ms));
        }
        // Every bin's low edge maps back to it, in order.
        for i in 1..BINS {
            assert_eq!(bin(low(i)), i);
            assert!(low(i) > low(i - 1));
        }
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut h = Histogram::default();
        assert_eq!((h.quantile(0.5), h.quantile(0.99), h.max()), (0, 0, 0));
        for ms in [0, 0, 0, 0, 20, 20, 20, 21, 40, 40, 41, 42] {
            h.record(ms);
        }
        assert_eq!(h.quantile(0.5), 20);
        assert_eq!(h.quantile(0.99), 42);
        assert_eq!(h.quantile(0.0), 0);
        assert_eq!(h.max(), 42);
        h.record(5_000);
        assert_eq!(h.max(), 5_000);
        assert_eq!(h.quantile(1.0), 4_992);
        h.clear();
        assert_eq!((h.quantile(0.5), h.max()), (0, 0));
    }
}
