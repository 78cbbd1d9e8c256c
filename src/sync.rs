//! Poison-tolerant locking, below every other module: the stack, the fleet and the groups all
//! keep small state behind std mutexes that must outlive a panic.

use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::time::Instant;

/// Lock `mutex`, even if a thread panicked while holding it.
///
/// The stack's mutexes guard small state machines (a breaker window, pacers, a partition map,
/// an RNG) that every later request needs; a poisoned one must not turn one panic into a
/// panic for every request after it. The state a panic leaves behind is at worst one update
/// half made, which the next answers correct; that beats refusing all traffic for good.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Something set aside until an instant, and why: a pooled key or a group member in its
/// cool-down (`stack::rate_limit::pool`, `crate::group`).
#[derive(Default)]
pub struct SetAside(Mutex<Option<(Instant, &'static str)>>);

impl SetAside {
    /// Until when, and why, if still aside at `now`.
    pub fn until(&self, now: Instant) -> Option<(Instant, &'static str)> {
        lock(&self.0).filter(|(until, _)| *until > now)
    }

    pub fn set(&self, until: Instant, why: &'static str) {
        *lock(&self.0) = Some((until, why));
    }

    pub fn clear(&self) {
        *lock(&self.0) = None;
    }

    /// Milliseconds left at `now`, for `/status`.
    pub fn left_ms(&self, now: Instant) -> Option<u64> {
        self.until(now)
            .map(|(until, _)| until.saturating_duration_since(now).as_millis() as u64)
    }
}

/// Poison `mutex`: a thread panics while holding it (tests of [`lock`]).
#[cfg(test)]
pub fn poison<T: Send>(mutex: &Mutex<T>) {
    std::thread::scope(|s| {
        let _ = s
            .spawn(|| {
                let _held = mutex.lock();
                panic!("a panic while holding a lock (poisoning it for a test)");
            })
            .join();
    });
    assert!(mutex.is_poisoned());
}
