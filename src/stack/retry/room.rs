//! Refusals for lack of room. A server with a bounded queue (SGLang's
//! `--max-queued-requests`, a gateway in front of a fixed pool) answers 503 at once when it
//! is full, with no hint, while it serves what it holds. Such a refusal says "full", not
//! "down": retried on a timer within the failure budget, a herd of them spends the budget in
//! the first second and the rest are given up (420 of 500 clients failed in the `sglang`
//! world written apart, where the SDK alone lost 264), though the server drains them all.
//!
//! So a 503 that names no wait, answered while the upstream still holds other attempts of
//! this corral, first sleeps the backoff a failure would (jittered: retries refused together
//! stay spread). Then, if the upstream still holds others (a full queue draining), it waits
//! for a place: the next answer the upstream serves (a final answer below 500) wakes one such
//! waiter, in the order they came, and its retry spends no budget. These retries go no faster
//! than the upstream frees places, so they cannot multiply its load. If the upstream holds
//! nothing of this corral's any more (a blip: every attempt refused together), or serves
//! nothing for twice the time a served answer recently took (twice the backoff's base before
//! any), the failure path (the budget, the backoff's escalation) takes over, the wait counted
//! as its backoff. Overloads (529, a 429 read as one) are not a full queue but
//! a service refusing arrivals at random, and keep the failure path.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// A waiting retry looks again this often at least (a backoff draw can be a millisecond).
const RECHECK: Duration = Duration::from_millis(100);

/// One upstream's attempts in flight and the retries waiting for a place: the retry layer
/// waits, the per-try timeout layer (right before the wire) counts.
#[derive(Default)]
pub struct Room {
    /// Attempts on the wire to the upstream, not yet answered (their heads): past the breaker
    /// and the rate limiter, whose held attempts the upstream does not hold.
    in_flight: AtomicU32,
    /// Answers the upstream served (below 500, not a 429).
    served_count: AtomicU64,
    /// Retries waiting for a place.
    waiting: AtomicU32,
    /// One permit per answer served while some wait.
    freed: Notify,
    /// How long served answers took (from their attempt's send), smoothed, in microseconds;
    /// 0 before the first.
    answer_micros: AtomicU64,
}

/// How a wait for a place ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Waited {
    /// The upstream served an answer: a place is free.
    Freed,
    /// Nothing served for the patience: the upstream may be down.
    Silent,
    /// The request's deadline came first.
    Deadline,
}

/// An attempt in flight, counted until it is answered or dropped.
pub struct Sending<'a>(&'a Room);

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Room {
    /// Count an attempt in flight while the guard lives.
    pub fn sending(&self) -> Sending<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Sending(self)
    }

    /// Whether attempts of this corral's besides the one just answered are on their way to
    /// the upstream or held by it.
    pub(super) fn holds_others(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) > 0
    }

    /// The upstream served an answer `took` after its attempt went on the wire: wake the
    /// longest waiting retry, if any.
    pub fn served(&self, took: Duration) {
        self.served_count.fetch_add(1, Ordering::Relaxed);
        let micros = took.as_micros().min(u128::from(u64::MAX)) as u64;
        let old = self.answer_micros.load(Ordering::Relaxed);
        // An exponential average over about eight answers (a lost update under a race only
        // drops one sample).
        let new = if old == 0 {
            micros
        } else {
            old - old / 8 + micros / 8
        };
        self.answer_micros.store(new.max(1), Ordering::Relaxed);
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.freed.notify_one();
        }
    }

    /// How long a retry waits for a place with nothing served before it reads the upstream
    /// as down: twice a served answer's recent time, or `before_any` before the first; at
    /// least `backoff`.
    pub(super) fn patience(&self, backoff: Duration, before_any: Duration) -> Duration {
        let micros = self.answer_micros.load(Ordering::Relaxed);
        let answers = if micros == 0 {
            before_any
        } else {
            Duration::from_micros(micros.saturating_mul(2))
        };
        answers.max(backoff)
    }

    /// First the backoff a failure would sleep (`backoff`: jittered, so retries refused
    /// together stay spread); then, if the upstream still holds attempts of this corral's (a
    /// full queue draining), wait for a place: until an answer is served (`Freed`), looking
    /// every [`RECHECK`] at least. `Silent` when the upstream holds nothing of this corral's
    /// at a look with nothing served since the last (a blip: everything was refused
    /// together), or has served nothing for `patience` since the wait began or last saw an
    /// answer served. `Deadline` when it comes first.
    pub(super) async fn wait(
        &self,
        backoff: Duration,
        patience: Duration,
        deadline: Instant,
    ) -> Waited {
        let served = || self.served_count.load(Ordering::Relaxed);
        let (mut moved, mut seen) = (Instant::now(), served());
        tokio::time::sleep_until((moved + backoff).min(deadline)).await;
        if Instant::now() >= deadline {
            return Waited::Deadline;
        }
        if !self.holds_others() {
            return Waited::Silent;
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        // One `Notified` for the whole wait keeps this retry's place in the queue.
        let freed = self.freed.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        let look = backoff.max(RECHECK);
        loop {
            let now = served();
            if now != seen {
                // Others were served meanwhile, those ahead of this one: full, not down.
                (seen, moved) = (now, Instant::now());
            } else if !self.holds_others() || moved.elapsed() >= patience {
                return Waited::Silent;
            }
            let until = (Instant::now() + look).min(deadline);
            tokio::select! {
                () = freed.as_mut() => return Waited::Freed,
                () = tokio::time::sleep_until(until) => {}
            }
            if Instant::now() >= deadline {
                return Waited::Deadline;
            }
        }
    }
}

/// A retry counted as waiting while the guard lives.
struct Waiting<'a>(&'a AtomicU32);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Arc;

    fn serve(room: &Room) {
        room.served(Duration::from_millis(400));
    }

    #[tokio::test(start_paused = true)]
    async fn each_answer_served_frees_one_waiter_in_the_order_they_came() {
        let room = Arc::new(Room::default());
        // The upstream holds another attempt: a full queue.
        let _held = room.sending();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut waiters = Vec::new();
        for i in 0..3 {
            let room = Arc::clone(&room);
            waiters.push(tokio::spawn(async move {
                // Backoffs of 100, 110 and 120 ms: they queue for a place in that order.
                let w = room
                    .wait(
                        Duration::from_millis(100 + 10 * i),
                        Duration::from_secs(5),
                        deadline,
                    )
                    .await;
                (i, w, Instant::now())
            }));
            tokio::task::yield_now().await;
        }
        let start = Instant::now();
        // Answers served every 400 ms: each wakes the oldest waiter, and those still waiting
        // see the upstream serving (and holding), so none gives up.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            serve(&room);
        }
        for (n, waiter) in waiters.into_iter().enumerate() {
            let (i, w, at) = waiter.await.unwrap();
            assert_eq!((i, w), (n as u64, Waited::Freed));
            assert_eq!(at - start, Duration::from_millis(400 * (n as u64 + 1)));
        }
        assert_eq!(room.waiting.load(Ordering::Relaxed), 0);
    }

    /// One wait in `room` (backoff, patience and deadline in milliseconds from now): how it
    /// ended, and when.
    async fn wait_once(room: &Room, backoff: u64, patience: u64, deadline: u64) -> (Waited, u64) {
        let (start, ms) = (Instant::now(), Duration::from_millis);
        let w = room
            .wait(ms(backoff), ms(patience), start + ms(deadline))
            .await;
        (w, start.elapsed().as_millis() as u64)
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_that_holds_and_serves_nothing_ends_the_wait_at_the_backoff() {
        let room = Room::default();
        assert_eq!(
            wait_once(&room, 300, 5_000, 60_000).await,
            (Waited::Silent, 300)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_that_holds_others_but_serves_nothing_ends_it_after_the_patience() {
        let room = Room::default();
        let _held = room.sending();
        // Looks at 0.3, 0.6, 0.9 and 1.2 s: the first past the patience ends it.
        assert_eq!(
            wait_once(&room, 300, 1_000, 60_000).await,
            (Waited::Silent, 1200)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_the_wait_first() {
        let room = Room::default();
        assert_eq!(
            wait_once(&room, 5_000, 10_000, 200).await,
            (Waited::Deadline, 200)
        );
    }

    #[test]
    fn patience_is_twice_a_served_answer_s_time_and_at_least_the_backoff() {
        let room = Room::default();
        let (ms, s) = (Duration::from_millis, Duration::from_secs);
        assert_eq!(room.patience(ms(100), s(1)), s(1));
        room.served(ms(400));
        assert_eq!(room.patience(ms(100), s(1)), ms(800));
        assert_eq!(room.patience(s(2), s(1)), s(2));
        // Smoothed: one slow answer moves it by an eighth of the difference.
        room.served(ms(1200));
        assert_eq!(room.patience(ms(0), s(1)), ms(1000));
    }

    #[test]
    fn attempts_are_counted_while_in_flight() {
        let room = Room::default();
        assert!(!room.holds_others());
        let a = room.sending();
        let b = room.sending();
        drop(a);
        assert!(room.holds_others());
        drop(b);
        assert!(!room.holds_others());
    }
}
