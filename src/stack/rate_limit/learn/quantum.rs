//! A report per minute over a bucket per second. OpenAI's guide says a limit may be quantized
//! ("60,000 requests/minute may be enforced as 1,000 requests/second"), other hosted APIs that
//! it "may be enforced based on QPS (RPM/60)": until the upstream has admitted more than one
//! second of the reported rate within a second, the headroom a report shows may end a second's
//! worth in. So until the bucket's edge is found, a ramp spending reported headroom sends past
//! that point one probe at a time: the next goes once the probe is admitted (answered, or
//! confirmed by its silence), and a refused probe finds the edge with one 429, not with the
//! whole round trip the ramp had in flight (`openai-stream`: heads of 3 ms doubled the ramp
//! faster than a refusal came back, and once the bucket's 20 were spent 14-19 more sends were
//! refused, all in the run's first 40 ms).
//!
//! A fleet's replicas read the same reports and ramp together: each takes its part of the
//! second (by the live replicas on the key). Without it, four corrals on Redis each spent a
//! whole second's worth on `openai-stream`'s bucket of 20 in its first 47 ms: 52 refused.
//!
//! Requests only: the quantum of a token limit is no count of sends.

use tokio::time::Instant;

use super::meter::Slots;
use super::{Pacer, Source, ADMITTED_WINDOW};
use crate::provider::Kind;

/// Sends over the last second ([`ADMITTED_WINDOW`], the span a quantized limit is enforced
/// over) and the probe beyond it (see the module).
#[derive(Debug, Default)]
pub(super) struct Quantum {
    sends: Slots,
    /// The sequence number of the send past a second of the reported rate, unanswered.
    probe: Option<f64>,
    /// The upstream admitted a probe, or the edge is known: nothing to gate (or count).
    done: bool,
}

impl Quantum {
    /// The attempt with `seq` was answered or given up: a probe admitted (`ok`) ends the gate.
    pub(super) fn answered(&mut self, seq: f64, ok: bool) {
        if self.probe == Some(seq) {
            self.probe = None;
            self.done |= ok;
        }
    }

    /// Attempts up to `seq` were confirmed by their silence.
    pub(super) fn consented(&mut self, seq: f64) {
        if self.probe.is_some_and(|probe| probe <= seq) {
            self.probe = None;
            self.done = true;
        }
    }
}

impl Pacer {
    /// One second of the reported rate (this replica's part of it in a fleet), while the
    /// quantum gates this pacer (see the module).
    fn quantum(&self) -> Option<f64> {
        let gated = !self.quantum.done
            && self.kind == Kind::Requests
            && self.source == Source::Headers
            && self.floor.is_none()
            && self.header_rate > 0.0;
        gated.then(|| self.header_rate * ADMITTED_WINDOW.as_secs_f64() / self.live)
    }

    /// With `[fleet]`: `live` replicas on the key now (see the module).
    pub fn fleet_live(&mut self, live: u64) {
        self.live = live.max(1) as f64;
    }

    /// Whether a send of `cost` now waits for the probe already past the quantum.
    pub(super) fn quantum_holds(&mut self, cost: f64, now: Instant) -> bool {
        let Some(quantum) = self.quantum() else {
            return false;
        };
        self.quantum.sends.expire(now);
        self.quantum.probe.is_some() && self.quantum.sends.sum() + cost.max(1.0) > quantum
    }

    /// A send with sequence number `seq` of `cost` units at `now`: counted while the ramp may
    /// still meet a quantum (slow start's sends too: the first report comes after them), and
    /// the probe if it is the first past one.
    pub(super) fn quantum_sent(&mut self, seq: f64, cost: f64, now: Instant) {
        let ramping = matches!(self.source, Source::SlowStart | Source::Headers);
        if self.quantum.done || self.kind != Kind::Requests || !ramping {
            return;
        }
        if self.floor.is_some() {
            // The first 429 set the report's floor: the edge is known, nothing to gate.
            self.quantum.done = true;
            self.quantum.sends.clear();
            return;
        }
        self.quantum.sends.add(now, cost.max(1.0));
        let past = self.quantum().is_some_and(|q| self.quantum.sends.sum() > q);
        if past && self.quantum.probe.is_none() {
            self.quantum.probe = Some(seq);
        }
    }
}
