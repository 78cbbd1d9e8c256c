//! The request body, read into memory under three bounds: its size (`body_limit`, refused from
//! `Content-Length` before a byte is read), its time (`body_idle_timeout` between pieces and the
//! request's deadline overall, each a 408), and corral's memory ([`BufferBudget`], one for the
//! whole process: a request that finds no room within [`BUFFER_WAIT`] gets a 503 with
//! Retry-After, so a burst of large bodies is refused instead of taking corral past its memory
//! limit).
//!
//! A body with a `Content-Length` takes its whole size from the budget before it is read (it
//! either has all its room or waits holding nothing); a chunked one takes room as it grows. The
//! room is held by the [`Held`] that comes back with the bytes, which the caller keeps until the
//! stack is done with the request (every retry replays the same bytes).
//!
//! tower-http's `RequestBodyLimitLayer` refuses an oversized `Content-Length` the same way, but
//! answers a plain-text 413 outside corral's error shape and knows no shared budget, so the
//! check lives here, next to the budget it comes before.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body::Body as HttpBody;
use http_body_util::BodyExt;
use prometheus::IntGauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::body::{BodyTimeout, BoxError, Timed};
use crate::error::ProxyError;

/// Longest wait for room in the budget (the request's deadline also applies).
pub const BUFFER_WAIT: Duration = Duration::from_secs(1);
/// What a request refused for room is told to wait before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The budget when `max_buffered_bytes` is unset and the container's memory limit is unknown.
pub const DEFAULT_CAP: usize = 256 << 20;
/// The smallest budget corral runs with (the config's floor for `max_buffered_bytes`).
pub const MIN_CAP: usize = crate::config::MIN_BUFFER_CAP;
/// The budget counts whole KiB (a semaphore takes at most `u32::MAX` permits at once).
const GRANULE: usize = 1024;
/// A chunked body's first allocation; it doubles from there.
const FIRST_CHUNKED: usize = 16 * 1024;

/// The process-wide cap on request bytes held in memory.
pub struct BufferBudget {
    semaphore: Arc<Semaphore>,
    cap: usize,
    in_use: IntGauge,
}

impl BufferBudget {
    /// A budget of `cap` bytes (at least [`MIN_CAP`]); `in_use` follows what is held.
    pub fn new(cap: usize, in_use: IntGauge) -> Arc<Self> {
        let cap = cap.max(MIN_CAP);
        Arc::new(Self {
            semaphore: Arc::new(Semaphore::new(cap.div_ceil(GRANULE))),
            cap,
            in_use,
        })
    }

    /// The cap in bytes: no single body may be larger.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Room for `bytes` more (a copy of a body made for one upstream), waiting for it until
    /// [`BUFFER_WAIT`] from now or `deadline`, whichever is sooner.
    pub async fn hold(&self, bytes: usize, deadline: Instant) -> Result<Held, ProxyError> {
        let mut held = self.none();
        let until = || (Instant::now() + BUFFER_WAIT).min(deadline);
        self.cover(&mut held, bytes, until).await?;
        Ok(held)
    }

    /// Nothing held yet.
    fn none(&self) -> Held {
        Held {
            permit: None,
            granules: 0,
            gauge: self.in_use.clone(),
        }
    }

    /// Grow what `held` holds to cover `total` bytes, waiting until `until()` at most (the clock
    /// is read only when there is no room at once).
    async fn cover(
        &self,
        held: &mut Held,
        total: usize,
        until: impl FnOnce() -> Instant,
    ) -> Result<(), ProxyError> {
        let want = total.div_ceil(GRANULE);
        let Some(more) = want.checked_sub(held.granules).filter(|&m| m > 0) else {
            return Ok(());
        };
        let full = || ProxyError::BufferFull {
            cap: self.cap,
            retry_after: RETRY_AFTER,
        };
        let n = u32::try_from(more).map_err(|_| full())?;
        let semaphore = Arc::clone(&self.semaphore);
        let permit = match Arc::clone(&semaphore).try_acquire_many_owned(n) {
            Ok(permit) => permit,
            Err(_) => match tokio::time::timeout_at(until(), semaphore.acquire_many_owned(n)).await
            {
                Ok(Ok(permit)) => permit,
                _ => return Err(full()),
            },
        };
        match &mut held.permit {
            Some(p) => p.merge(permit),
            None => held.permit = Some(permit),
        }
        held.granules = want;
        held.gauge.add((more * GRANULE) as i64);
        Ok(())
    }
}

/// Room a request holds in the [`BufferBudget`], given back when dropped.
pub struct Held {
    permit: Option<OwnedSemaphorePermit>,
    granules: usize,
    gauge: IntGauge,
}

impl Held {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.granules * GRANULE
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.sub(self.bytes() as i64);
        drop(self.permit.take());
    }
}

/// What bounds one request body.
#[derive(Debug, Clone, Copy)]
pub struct BodyBounds {
    /// Largest body accepted (the upstream's `body_limit`, at most the budget's cap).
    pub limit: usize,
    /// Longest pause between two pieces of the body.
    pub idle: Duration,
    /// The request's deadline: the whole body must have arrived by then.
    pub deadline: Instant,
}

/// Read the whole body within `bounds`, holding room for it in `budget`.
pub async fn read_body<B>(
    body: B,
    bounds: BodyBounds,
    budget: &BufferBudget,
) -> Result<(Bytes, Held), ProxyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || ProxyError::BodyTooLarge {
        limit: bounds.limit,
    };
    let hint = body.size_hint();
    // `Content-Length` over the limit: refused before a byte is read (and before a `100
    // Continue`, which hyper sends only when the body is first polled).
    if hint.lower() > bounds.limit as u64 {
        return Err(too_large());
    }
    let wait_until = || (Instant::now() + BUFFER_WAIT).min(bounds.deadline);
    let mut held = budget.none();
    let mut buf = Vec::new();
    if let Some(len) = hint.exact() {
        let len = len as usize;
        budget.cover(&mut held, len, wait_until).await?;
        buf.reserve_exact(len);
    }
    let mut body = std::pin::pin!(Timed::new(body, bounds.idle, Some(bounds.deadline), |_| {}));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| match e.downcast_ref::<BodyTimeout>() {
            Some(BodyTimeout(kind)) => ProxyError::BodyTimeout(*kind),
            None => ProxyError::BodyRead(e.to_string()),
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers are not forwarded
        };
        let needed = buf.len() + data.len();
        if needed > bounds.limit {
            return Err(too_large());
        }
        if needed > buf.capacity() {
            let target = needed
                .max(buf.capacity() * 2)
                .max(FIRST_CHUNKED)
                .min(bounds.limit);
            budget.cover(&mut held, target, wait_until).await?;
            buf.reserve_exact(target - buf.len());
        }
        buf.extend_from_slice(&data);
    }
    Ok((Bytes::from(buf), held))
}

/// The budget when `max_buffered_bytes` is unset: a quarter of the container's memory limit
/// when corral can read it (cgroup v2 `memory.max`, else v1 `memory.limit_in_bytes`, as a
/// container sees its own cgroup), else [`DEFAULT_CAP`].
pub fn default_cap() -> usize {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let limit = memory_limit(
        read("/sys/fs/cgroup/memory.max").as_deref(),
        read("/sys/fs/cgroup/memory/memory.limit_in_bytes").as_deref(),
    );
    cap_for(limit)
}

/// A quarter of `limit` (at least [`MIN_CAP`]), or [`DEFAULT_CAP`] without one.
pub fn cap_for(limit: Option<u64>) -> usize {
    limit.map_or(DEFAULT_CAP, |l| {
        usize::try_from(l / 4).unwrap_or(usize::MAX).max(MIN_CAP)
    })
}

/// The memory limit in bytes from cgroup v2's `memory.max` (`max`: none) or v1's
/// `memory.limit_in_bytes` (a huge number: none).
fn memory_limit(v2: Option<&str>, v1: Option<&str>) -> Option<u64> {
    if let Some(v2) = v2 {
        return v2.trim().parse().ok();
    }
    v1?.trim().parse().ok().filter(|&l: &u64| l < 1 << 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    fn budget(cap: usize) -> Arc<BufferBudget> {
        BufferBudget::new(cap, IntGauge::new("g", "g").unwrap())
    }

    fn bounds(limit: usize) -> BodyBounds {
        BodyBounds {
            limit,
            idle: Duration::from_secs(30),
            deadline: Instant::now() + Duration::from_secs(60),
        }
    }

    /// A chunked body (no size hint) of `n` chunks of `size` bytes.
    fn chunked(n: usize, size: usize) -> Chunks {
        Chunks { left: n, size }
    }

    struct Chunks {
        left: usize,
        size: usize,
    }
    impl HttpBody for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            if self.left == 0 {
                return std::task::Poll::Ready(None);
            }
            self.left -= 1;
            let data = Bytes::from(vec![b'x'; self.size]);
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(data))))
        }
    }

    #[tokio::test]
    async fn a_known_length_takes_its_room_first_and_gives_it_back() {
        let b = budget(MIN_CAP);
        let (bytes, held) = read_body(Full::new(Bytes::from(vec![1; 5000])), bounds(MIN_CAP), &b)
            .await
            .unwrap();
        assert_eq!(bytes.len(), 5000);
        assert_eq!(held.bytes(), 5 * 1024);
        assert_eq!(b.in_use.get(), 5 * 1024);
        drop(held);
        assert_eq!(b.in_use.get(), 0);
    }

    #[tokio::test]
    async fn over_the_limit_is_refused_by_length_or_as_it_grows() {
        let b = budget(MIN_CAP);
        let err = read_body(Full::new(Bytes::from(vec![1; 6])), bounds(5), &b)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(err, ProxyError::BodyTooLarge { limit: 5 }),
            "{err}"
        );
        let err = read_body(chunked(10, 1000), bounds(5000), &b)
            .await
            .err()
            .unwrap();
        assert!(
            matches!(err, ProxyError::BodyTooLarge { limit: 5000 }),
            "{err}"
        );
        assert_eq!(b.in_use.get(), 0, "room given back");
        let (bytes, held) = read_body(chunked(10, 1000), bounds(10_000), &b)
            .await
            .unwrap();
        assert_eq!(bytes.len(), 10_000);
        assert!(
            held.bytes() >= 10_000 && held.bytes() <= 16 * 1024,
            "{}",
            held.bytes()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_budget_waits_briefly_then_refuses_with_retry_after() {
        let b = budget(MIN_CAP);
        let (_, first) = read_body(
            Full::new(Bytes::from(vec![1; MIN_CAP - 1024])),
            bounds(MIN_CAP),
            &b,
        )
        .await
        .unwrap();
        let start = Instant::now();
        let err = read_body(Full::new(Bytes::from(vec![1; 4096])), bounds(MIN_CAP), &b)
            .await
            .err()
            .unwrap();
        assert_eq!(start.elapsed(), BUFFER_WAIT);
        assert!(matches!(err, ProxyError::BufferFull { .. }), "{err}");
        assert_eq!(err.retry_after(), Some(RETRY_AFTER));
        // Room that frees up within the wait is taken.
        let b2 = Arc::clone(&b);
        let waiting = tokio::spawn(async move {
            read_body(Full::new(Bytes::from(vec![1; 4096])), bounds(MIN_CAP), &b2)
                .await
                .map(|(bytes, _)| bytes.len())
        });
        tokio::time::sleep(BUFFER_WAIT / 2).await;
        drop(first);
        assert_eq!(waiting.await.unwrap().unwrap(), 4096);
    }

    #[test]
    fn the_default_cap_is_a_quarter_of_the_cgroup_limit() {
        assert_eq!(memory_limit(Some("268435456\n"), None), Some(256 << 20));
        assert_eq!(memory_limit(Some("max\n"), Some("1000")), None);
        assert_eq!(memory_limit(None, Some("536870912")), Some(512 << 20));
        assert_eq!(memory_limit(None, Some("9223372036854771712")), None);
        assert_eq!(memory_limit(None, None), None);
        assert_eq!(cap_for(Some(256 << 20)), 64 << 20);
        assert_eq!(cap_for(Some(1 << 20)), MIN_CAP);
        assert_eq!(cap_for(None), DEFAULT_CAP);
    }
}
