//! Priorities where requests wait: `interactive` requests go ahead of queued `batch`
//! ones. A [`PriorityGate`] sits in front of a FIFO wait (tokio's fair semaphore or mutex): batch
//! waiters pass the gate one at a time, so at most one of them is in the FIFO queue at once and
//! an interactive waiter finds at most that one ahead of it. Batch never starves: the one in the
//! queue is served in its turn, whatever arrives after it.

use std::future::Future;

use crate::config::Priority;

/// The gate batch waiters take turns through before they join a FIFO queue.
#[derive(Default)]
pub struct PriorityGate {
    batch: tokio::sync::Mutex<()>,
}

impl PriorityGate {
    /// Wait for `fifo` (the queue's own wait, e.g. a semaphore's `acquire`), a batch waiter
    /// first passing the gate, which it holds until `fifo` is done: then the next may queue.
    pub async fn wait<F: Future>(&self, priority: Priority, fifo: F) -> F::Output {
        let _gate = match priority {
            Priority::Batch => Some(self.batch.lock().await),
            Priority::Interactive => None,
        };
        fifo.await
    }
}
