//! Admission storms (`--admission-refusals K`): a gateway in front of the API whose own queue
//! is full.
//!
//! Gateways and self-hosted servers refuse with 429 and `retry-after` when their queue is
//! full, whatever the sender's rate. Here each distinct request is refused K times before it
//! may pass on to the buckets. A request is known by a hash of its body: a client retrying
//! sends the same body, and so does a proxy replaying it. The refusal says "come back in a
//! second" ([`RETRY_AFTER`]) and looks like an empty bucket (`remaining` 0, reset 1 s), which
//! is what makes it a storm: nothing about it tells it apart from a rate limit.
//!
//! Memory is bounded: the last [`MAX_BODIES`] bodies are remembered, the oldest forgotten
//! first (a forgotten body is refused K times again).

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;
use std::time::Duration;

/// Bodies remembered at once.
pub const MAX_BODIES: usize = 65_536;

/// The wait every refusal asks for.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// Refusals so far per body hash.
#[derive(Debug)]
pub struct Gateway {
    refusals: u32,
    seen: HashMap<u64, u32>,
    /// Hashes in the order first seen, to forget the oldest.
    order: VecDeque<u64>,
    max_bodies: usize,
}

impl Gateway {
    /// Refuses each body `refusals` times.
    pub fn new(refusals: u32) -> Self {
        Self::with_memory(refusals, MAX_BODIES)
    }

    fn with_memory(refusals: u32, max_bodies: usize) -> Self {
        Self {
            refusals,
            seen: HashMap::new(),
            order: VecDeque::new(),
            max_bodies: max_bodies.max(1),
        }
    }

    /// Whether this arrival of `body` is refused; counts the refusal.
    pub fn refuse(&mut self, body: &[u8]) -> bool {
        if self.refusals == 0 {
            return false;
        }
        let hash = hash(body);
        match self.seen.entry(hash) {
            Entry::Occupied(mut e) if *e.get() < self.refusals => {
                *e.get_mut() += 1;
                true
            }
            Entry::Occupied(_) => false,
            Entry::Vacant(e) => {
                e.insert(1);
                self.order.push_back(hash);
                if self.order.len() > self.max_bodies {
                    if let Some(oldest) = self.order.pop_front() {
                        self.seen.remove(&oldest);
                    }
                }
                true
            }
        }
    }

    /// Forgets every body.
    pub fn reset(&mut self) {
        self.seen.clear();
        self.order.clear();
    }
}

/// The same bytes always give the same hash (SipHash with fixed keys).
fn hash(body: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(body);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_body_is_refused_k_times_then_passes_for_good() {
        let mut g = Gateway::new(3);
        let (a, b) = (&b"{\"n\":1}"[..], &b"{\"n\":2}"[..]);
        let a_refused: Vec<bool> = (0..5).map(|_| g.refuse(a)).collect();
        assert_eq!(a_refused, [true, true, true, false, false]);
        assert!(g.refuse(b), "another body has its own count");
    }

    #[test]
    fn zero_refusals_refuse_nothing_and_remember_nothing() {
        let mut g = Gateway::new(0);
        assert!(!g.refuse(b"x"));
        assert!(g.seen.is_empty());
    }

    #[test]
    fn memory_is_bounded_and_forgets_the_oldest_body() {
        let mut g = Gateway::with_memory(1, 2);
        for body in [&b"a"[..], b"b", b"c"] {
            assert!(g.refuse(body));
        }
        assert_eq!(g.seen.len(), 2);
        assert!(!g.refuse(b"c"), "remembered: refused once already");
        assert!(g.refuse(b"a"), "forgotten: refused again");
    }

    #[test]
    fn reset_forgets_every_body() {
        let mut g = Gateway::new(1);
        assert!(g.refuse(b"a"));
        g.reset();
        assert!(g.refuse(b"a"));
    }
}
