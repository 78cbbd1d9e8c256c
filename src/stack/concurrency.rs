//! Concurrency window: at most `limit` requests in flight per upstream, the rest in a bounded
//! FIFO queue (tokio's fair semaphore) for at most `queue_timeout` or their deadline; batch
//! requests join that queue one at a time, so interactive ones pass the rest of them, and may
//! fill nine tenths of it (`stack::priority`). Overflow
//! and timeouts get a 429 with a Retry-After estimated from the queue; nothing is dropped
//! silently. The permit moves into the response body, so a stream counts as in flight until its
//! last byte. The limit can move at run time (adaptive concurrency): growing adds permits,
//! shrinking forgets free ones and takes the rest as debt from permits coming back.
//!
//! With `concurrency = "auto"` the limit is [`gradient::Gradient`]'s, which keeps a queueing
//! backend's own queue short so the waiting happens here. It learns from one sample per
//! request, taken when the first byte of a 2xx response body to a first attempt goes to the
//! client: the time since the request got its slot (corral's queue excluded), the slots held
//! then, and whether requests were waiting for one.

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::body::{Guard, Guarded};
use crate::config::Priority;
use crate::error::ProxyError;
use crate::forward::ProxyRequest;
use crate::metrics::UpstreamMetrics;
use crate::stack::layer::{Answer, Middleware, Next, SharedLayer};
use crate::stack::priority::PriorityGate;
use crate::sync::lock;

pub mod gradient;

/// One upstream's window, shared by all its requests.
pub struct Window {
    semaphore: Arc<Semaphore>,
    /// Interactive requests ahead of queued batch ones.
    gate: PriorityGate,
    limit: AtomicU32,
    debt: AtomicU32,
    /// Slots held (can exceed `limit` while it shrinks: the difference is `debt`).
    held: AtomicU32,
    waiting: AtomicUsize,
    queue_size: usize,
    queue_timeout: Duration,
    /// Smoothed time a request holds its slot, for Retry-After estimates (microseconds).
    hold_micros: AtomicU32,
    /// With `concurrency = "auto"`: the latency-gradient limit.
    gradient: Option<std::sync::Mutex<gradient::Gradient>>,
    metrics: UpstreamMetrics,
}

impl Window {
    /// A fixed window of `limit`.
    pub fn new(
        limit: u32,
        queue_size: usize,
        queue_timeout: Duration,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        Arc::new(Self::build(limit, queue_size, queue_timeout, metrics, None))
    }

    fn build(
        limit: u32,
        queue_size: usize,
        queue_timeout: Duration,
        metrics: UpstreamMetrics,
        gradient: Option<gradient::Gradient>,
    ) -> Self {
        metrics.concurrency_limit.set(i64::from(limit));
        Self {
            semaphore: Arc::new(Semaphore::new(limit as usize)),
            gate: PriorityGate::default(),
            limit: AtomicU32::new(limit),
            debt: AtomicU32::new(0),
            held: AtomicU32::new(0),
            waiting: AtomicUsize::new(0),
            queue_size,
            queue_timeout,
            hold_micros: AtomicU32::new(1_000_000),
            gradient: gradient.map(std::sync::Mutex::new),
            metrics,
        }
    }

    /// A window whose limit follows the upstream's latency, between `min` and `max`, starting at
    /// `initial` and aiming at `tolerance` times the no-load latency (see [`gradient`]).
    pub fn adaptive(
        initial: u32,
        min: u32,
        max: u32,
        tolerance: f64,
        queue_size: usize,
        queue_timeout: Duration,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        let initial = initial.clamp(min, max);
        let gradient = gradient::Gradient::new(initial, min, max, tolerance);
        Arc::new(Self::build(
            initial,
            queue_size,
            queue_timeout,
            metrics,
            Some(gradient),
        ))
    }

    /// Feed one answer into the adaptive limit, if there is one.
    fn sample(&self, sample: gradient::Sample) {
        if let Some(g) = &self.gradient {
            let new = lock(g).sample(sample);
            if new != self.limit() {
                self.set_limit(new);
            }
        }
    }

    /// Whether the window is the bottleneck: requests wait for a slot, or every slot is held.
    fn saturated(&self) -> bool {
        self.waiting() > 0 || self.held.load(Ordering::Relaxed) >= self.limit()
    }

    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn in_use(&self) -> usize {
        self.held.load(Ordering::Relaxed) as usize
    }

    /// Move the limit to `new` (at least 1).
    pub fn set_limit(&self, new: u32) {
        let new = new.max(1);
        let old = self.limit.swap(new, Ordering::AcqRel);
        if new > old {
            let mut grow = new - old;
            // Cancel outstanding debt first.
            while grow > 0 {
                let debt = self.debt.load(Ordering::Acquire);
                if debt == 0 {
                    break;
                }
                let pay = debt.min(grow);
                if self
                    .debt
                    .compare_exchange(debt, debt - pay, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    grow -= pay;
                }
            }
            self.semaphore.add_permits(grow as usize);
        } else if new < old {
            let shrink = (old - new) as usize;
            let forgotten = self.semaphore.forget_permits(shrink);
            self.debt
                .fetch_add((shrink - forgotten) as u32, Ordering::AcqRel);
        }
        self.metrics.concurrency_limit.set(i64::from(new));
    }

    fn retry_after(&self, waiting: usize) -> Duration {
        let hold = Duration::from_micros(u64::from(self.hold_micros.load(Ordering::Relaxed)));
        let per_slot = hold.as_secs_f64() / f64::from(self.limit().max(1));
        Duration::from_secs_f64((per_slot * (waiting as f64 + 1.0)).clamp(1.0, 600.0))
    }

    async fn acquire(
        self: &Arc<Self>,
        deadline: Instant,
        priority: Priority,
    ) -> Result<Slot, ProxyError> {
        let upstream = || self.metrics.name().to_owned();
        if let Ok(permit) = Arc::clone(&self.semaphore).try_acquire_owned() {
            // No wait, and nothing observed: the histogram is of the waits that happened.
            return Ok(Slot::new(self, permit));
        }
        let waiting = self.waiting.fetch_add(1, Ordering::AcqRel);
        let _queued = Queued(self);
        // A tenth of the queue is kept for interactive requests: batch ones cannot fill it.
        let room = match priority {
            Priority::Interactive => self.queue_size,
            Priority::Batch => self.queue_size - self.queue_size / 10,
        };
        if waiting >= room {
            return Err(ProxyError::QueueFull {
                upstream: upstream(),
                retry_after: self.retry_after(waiting),
            });
        }
        self.metrics.queue_depth.set(waiting as i64 + 1);
        let start = Instant::now();
        let until = start
            .checked_add(self.queue_timeout)
            .map_or(deadline, |t| t.min(deadline));
        let wait = self
            .gate
            .wait(priority, Arc::clone(&self.semaphore).acquire_owned());
        match tokio::time::timeout_at(until, wait).await {
            Ok(Ok(permit)) => {
                self.metrics
                    .queue_wait
                    .observe(start.elapsed().as_secs_f64());
                Ok(Slot::new(self, permit))
            }
            Ok(Err(_closed)) => Err(ProxyError::Internal("concurrency window closed".into())),
            Err(_) => Err(ProxyError::QueueTimeout {
                upstream: upstream(),
                waited: start.elapsed(),
                retry_after: self.retry_after(self.waiting()),
            }),
        }
    }
}

/// Keeps the waiting count (and the queue-depth gauge) right however the wait ends.
struct Queued<'a>(&'a Window);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let left = self.0.waiting.fetch_sub(1, Ordering::AcqRel) - 1;
        self.0.metrics.queue_depth.set(left as i64);
    }
}

/// A held slot; dropping it (when the response body ends) frees it, or pays down debt.
pub struct Slot {
    window: Arc<Window>,
    permit: Option<OwnedSemaphorePermit>,
    since: Instant,
    /// When its first attempt went out (`since` until known).
    sent: Instant,
    /// Slots held just after this one was taken.
    in_flight: u32,
    /// Whether the first body byte still has to be reported to the adaptive limit.
    learn: bool,
}

impl Slot {
    fn new(window: &Arc<Window>, permit: OwnedSemaphorePermit) -> Self {
        let in_flight = window.held.fetch_add(1, Ordering::AcqRel) + 1;
        let since = Instant::now();
        Self {
            window: Arc::clone(window),
            permit: Some(permit),
            since,
            sent: since,
            in_flight,
            learn: false,
        }
    }

    /// The adaptive limit learns from a 2xx answered at the first attempt (a retried request's
    /// time includes its backoff; an error's says nothing about the backend's queue), timed
    /// from when that attempt went out (`sent`): a wait in the gates below the window is
    /// corral's, not the backend's (a slow start's ramp held some of the first window's
    /// requests for up to a quarter second, the first answers' average read as the no-load
    /// time came out 9% high, and the probe that doubted it held the window at three
    /// quarters of the slots for three round trips: `corral bench herd --scenario queue`
    /// 1.05-1.07x, the SDK alone 1.03-1.04x).
    fn learn_from(&mut self, status: http::StatusCode, ctx: &crate::forward::RequestCtx) {
        self.learn = self.window.gradient.is_some() && status.is_success() && ctx.attempts() <= 1;
        if let Some(sent) = ctx.first_sent_at().filter(|_| self.learn) {
            self.sent = self.sent.max(sent);
        }
    }
}

impl Guard for Slot {
    /// The first body byte ends the round trip: for a stream that is the first token (the
    /// head may come before the backend has even scheduled the request), for a complete
    /// answer it comes with the head.
    fn on_data(&mut self, _len: usize) {
        if std::mem::take(&mut self.learn) {
            self.window.sample(gradient::Sample {
                sent: self.sent,
                rtt: self.sent.elapsed(),
                in_flight: self.in_flight,
                saturated: self.window.saturated(),
            });
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.window.held.fetch_sub(1, Ordering::AcqRel);
        let held = self.since.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        let old = self.window.hold_micros.load(Ordering::Relaxed);
        self.window
            .hold_micros
            .store(old / 8 * 7 + held / 8, Ordering::Relaxed);
        let permit = self.permit.take().expect("slot holds a permit");
        let paid = self
            .window
            .debt
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| d.checked_sub(1))
            .is_ok();
        if paid {
            permit.forget();
        }
    }
}

/// The window as a tower layer.
pub type ConcurrencyLayer = SharedLayer<Window>;

impl Middleware for Window {
    fn call<'a, S: Next>(
        self: &'a Arc<Self>,
        next: &'a S,
        req: ProxyRequest,
    ) -> impl Future<Output = Answer> + Send + 'a {
        let window = self;
        async move {
            let target = Arc::clone(&req.target);
            let ctx = &target.ctx;
            let mut slot = window.acquire(ctx.wait_deadline, ctx.priority).await?;
            let response = next.send(req).await?;
            slot.learn_from(response.status(), ctx);
            Ok(response.map(|body| Guarded::wrap(body, slot)))
        }
    }
}

#[cfg(test)]
impl Window {
    /// Poison every std mutex this holds (tests of [`crate::sync::lock`]).
    pub(crate) fn poison_locks(&self) {
        if let Some(g) = &self.gradient {
            crate::sync::poison(g);
        }
    }
}

#[cfg(test)]
mod tests;
