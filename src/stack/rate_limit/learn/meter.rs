//! What a pacer measures of its own sends: their smoothed rate ([`Meter`]) and the units the
//! upstream admitted over the last window ([`Admitted`]).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::{ADMITTED_SLOT, ADMITTED_WINDOW};

/// Smoothed send rate over 0.5 s buckets (AWS: smoothing 0.8).
#[derive(Debug)]
pub(super) struct Meter {
    pub(super) bucket_start: Instant,
    pub(super) count: f64,
    pub(super) rate: f64,
}

impl Meter {
    /// The smoothed rate, or before the first sample the rate of the bucket so far.
    pub(super) fn current(&self, now: Instant) -> f64 {
        if self.rate > 0.0 {
            return self.rate;
        }
        let elapsed = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        self.count / elapsed.max(0.1)
    }

    pub(super) fn record(&mut self, now: Instant, n: f64) {
        let elapsed = now
            .saturating_duration_since(self.bucket_start)
            .as_secs_f64();
        if elapsed >= 0.5 {
            let sample = self.count / elapsed;
            self.rate = if self.rate == 0.0 {
                sample
            } else {
                0.8 * sample + 0.2 * self.rate
            };
            self.bucket_start = now;
            self.count = 0.0;
        }
        self.count += n;
    }
}

/// Units over the last [`ADMITTED_WINDOW`], in slots of [`ADMITTED_SLOT`]: a few dozen entries
/// whatever the rate.
#[derive(Debug, Default)]
pub(super) struct Slots(VecDeque<(Instant, f64)>);

impl Slots {
    /// `units` at `now`, after dropping the slots the window has left behind.
    pub(super) fn add(&mut self, now: Instant, units: f64) {
        self.expire(now);
        match self.0.back_mut() {
            Some((start, n)) if now.saturating_duration_since(*start) < ADMITTED_SLOT => {
                *n += units
            }
            _ => self.0.push_back((now, units)),
        }
    }

    pub(super) fn expire(&mut self, now: Instant) {
        while let Some((start, _)) = self.0.front() {
            if now.saturating_duration_since(*start) > ADMITTED_WINDOW {
                self.0.pop_front();
            } else {
                break;
            }
        }
    }

    /// The units the window holds (as of the last [`Self::expire`]).
    pub(super) fn sum(&self) -> f64 {
        self.0.iter().map(|(_, n)| n).sum()
    }

    pub(super) fn clear(&mut self) {
        self.0.clear();
    }
}

/// Units the upstream admitted (answered without a throttle) over the last
/// [`ADMITTED_WINDOW`], in slots of [`ADMITTED_SLOT`]; once a throttle event has shown the
/// bucket empty, only of attempts sent after the last one. Until the bucket's edge is found it
/// may hold a burst, and a cut may not go below what it gave; after, what it admits is what it
/// refilled, and a burst drawn before the edge is no rate to keep (four replicas' first second
/// drew 12 each from a bucket of 50 refilled at 20/s, and cuts held at that floor for the
/// rest of that second let 26 more 429s through).
#[derive(Debug, Default)]
pub(super) struct Admitted {
    slots: Slots,
    /// When the attempt that marked the last throttle event was sent.
    edge: Option<Instant>,
}

impl Admitted {
    /// An attempt sent at `sent` was admitted, as its answer at `now` shows.
    pub(super) fn record(&mut self, now: Instant, sent: Instant, units: f64) {
        if self.edge.is_some_and(|edge| sent < edge) {
            return;
        }
        self.slots.add(now, units);
    }

    /// Units per second over the window, or since the edge when that is shorter (but at
    /// least a slot: one answer just after it is no rate). Since the edge, the last `lag` (the
    /// fastest round trip) is left out of the span: what was sent in it is not answered yet,
    /// and counting its time without its units took a cut a tenth under what the upstream
    /// admitted, a little lower at each 429 (four replicas at the key's rate, one 429: 15%
    /// under it, for seconds).
    pub(super) fn rate(&mut self, now: Instant, lag: Duration) -> f64 {
        self.slots.expire(now);
        let span = self.edge.map_or(ADMITTED_WINDOW, |edge| {
            now.saturating_duration_since(edge)
                .saturating_sub(lag)
                .clamp(ADMITTED_SLOT, ADMITTED_WINDOW)
        });
        self.slots.sum() / span.as_secs_f64()
    }

    /// A throttle event marked by an attempt sent at `sent`: the bucket was empty then, and
    /// what is counted from now on is what it refilled since.
    pub(super) fn edge(&mut self, sent: Instant) {
        self.slots.clear();
        self.edge = Some(sent);
    }
}
