//! The response body type every layer passes along, a wrapper that keeps a guard (a
//! concurrency permit, an in-flight gauge) alive until the body has been fully sent, and one that
//! puts an end to every wait on a body ([`Timed`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

/// Boxed error carried by response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response corral sends: the upstream's stream, or a buffer corral made.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A complete body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Box any body into [`Body`].
pub fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// Told about every data frame a [`Guarded`] body yields; dropped when the body is.
pub trait Guard: Send + 'static {
    /// A data frame of `len` bytes is on its way to the client.
    fn on_data(&mut self, _len: usize) {}
    /// The client's side (hyper) asks for the next frame: it took the previous one.
    fn on_poll(&mut self) {}
}

impl Guard for () {}
impl<T: Send + 'static> Guard for Option<T> {}

pin_project! {
    /// A body that holds `guard` until it is dropped (after the last frame, or on disconnect).
    pub struct Guarded<G> {
        #[pin]
        inner: Body,
        guard: G,
    }
}

impl<G: Guard> Guarded<G> {
    /// `inner` with `guard` living as long as the stream, as a body of its own type: for the
    /// last wrapper, which hyper takes as it is.
    pub fn new(inner: Body, guard: G) -> Self {
        Guarded { inner, guard }
    }

    /// [`Self::new`], boxed into [`Body`].
    pub fn wrap(inner: Body, guard: G) -> Body {
        Self::new(inner, guard).boxed_unsync()
    }
}

impl<G: Guard> HttpBody for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        this.guard.on_poll();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                this.guard.on_data(data.len());
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Which of a [`Timed`] body's clocks ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeoutKind {
    /// No frame within the idle timeout of being asked for one.
    Idle,
    /// The deadline passed.
    Deadline,
}

impl TimeoutKind {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Idle => "idle",
            Self::Deadline => "deadline",
        }
    }
}

impl fmt::Display for TimeoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Idle => "no data within the idle timeout",
            Self::Deadline => "the deadline passed",
        })
    }
}

/// The error a [`Timed`] body ends with: never a clean end, so hyper aborts the message
/// (HTTP/1: the connection closes before the last chunk; HTTP/2: `RST_STREAM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("body timed out: {0}")]
pub struct BodyTimeout(pub TimeoutKind);

pin_project! {
    /// A body with two clocks: at most `idle` from being asked for a frame to getting one (like
    /// tower-http's `TimeoutBody`, whose clock also starts only when polled, so a slow reader
    /// on the other side is never blamed), and nothing after `deadline`, however busy the body.
    /// Written here because `TimeoutBody` has no absolute deadline, no hook to count what it
    /// cut, and hides the inner body's size hint and end (a known length would turn chunked).
    /// When a clock runs out `on_timeout` is called once and the body yields [`BodyTimeout`]
    /// from then on.
    pub struct Timed<B, F> {
        #[pin]
        inner: B,
        idle: Duration,
        #[pin]
        idle_sleep: Option<Sleep>,
        deadline_at: Option<Instant>,
        // Made the first time the body waits: a body whose frames are ready when asked for
        // reads the clock instead of putting a timer in the runtime's wheel.
        #[pin]
        deadline: Option<Sleep>,
        on_timeout: Option<F>,
        timed_out: Option<TimeoutKind>,
    }
}

impl<B, F> Timed<B, F>
where
    F: FnOnce(TimeoutKind),
{
    /// Wrap `inner`; `deadline: None` leaves only the idle clock.
    pub fn new(inner: B, idle: Duration, deadline: Option<Instant>, on_timeout: F) -> Self {
        Self {
            inner,
            idle,
            idle_sleep: None,
            deadline_at: deadline,
            deadline: None,
            on_timeout: Some(on_timeout),
            timed_out: None,
        }
    }
}

impl<B, F> HttpBody for Timed<B, F>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
    F: FnOnce(TimeoutKind),
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if let Some(kind) = *this.timed_out {
            return Poll::Ready(Some(Err(BodyTimeout(kind).into())));
        }
        let fired = match this.inner.poll_frame(cx) {
            // A body that always has data ready must still end at the deadline; one that has
            // ended has nothing left to cut.
            Poll::Ready(Some(_)) if this.deadline_at.is_some_and(|d| Instant::now() >= d) => {
                Some(TimeoutKind::Deadline)
            }
            Poll::Ready(frame) => {
                this.idle_sleep.set(None);
                return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
            }
            Poll::Pending
                if this.deadline_at.is_some_and(|at| {
                    if this.deadline.is_none() {
                        this.deadline.set(Some(tokio::time::sleep_until(at)));
                    }
                    let deadline = this.deadline.as_mut().as_pin_mut().expect("just set");
                    deadline.poll(cx).is_ready()
                }) =>
            {
                Some(TimeoutKind::Deadline)
            }
            Poll::Pending => {
                if this.idle_sleep.is_none() {
                    this.idle_sleep.set(Some(tokio::time::sleep(*this.idle)));
                }
                let idle = this.idle_sleep.as_mut().as_pin_mut().expect("just set");
                if idle.poll(cx).is_pending() {
                    return Poll::Pending;
                }
                Some(TimeoutKind::Idle)
            }
        };
        let kind = fired.expect("a clock fired");
        *this.timed_out = Some(kind);
        if let Some(on_timeout) = this.on_timeout.take() {
            on_timeout(kind);
        }
        Poll::Ready(Some(Err(BodyTimeout(kind).into())))
    }

    fn is_end_stream(&self) -> bool {
        self.timed_out.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A body whose first frame was already read (to look at it) and is given back first.
pub struct Prepended {
    first: Option<Result<Frame<Bytes>, BoxError>>,
    rest: Body,
}

impl Prepended {
    pub fn wrap(first: Frame<Bytes>, rest: Body) -> Body {
        Prepended {
            first: Some(Ok(first)),
            rest,
        }
        .boxed_unsync()
    }

    /// A body that fails with `error` (the one its first read met), as the original would.
    pub fn fail(error: BoxError) -> Body {
        Prepended {
            first: Some(Err(error)),
            rest: full(Bytes::new()),
        }
        .boxed_unsync()
    }
}

impl HttpBody for Prepended {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(first));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if matches!(self.first, Some(Err(_))) {
            // A body about to fail has no size to promise (an exact 0 would end it cleanly).
            return SizeHint::default();
        }
        let rest = self.rest.size_hint();
        let len = self
            .first
            .as_ref()
            .and_then(|f| f.as_ref().ok())
            .and_then(Frame::data_ref)
            .map_or(0, |d| d.len() as u64);
        // The upper bound first: `set_lower` refuses a lower bound above the upper one.
        let mut hint = SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + len);
        }
        hint.set_lower(rest.lower() + len);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Count(Arc<AtomicUsize>, Arc<AtomicUsize>);
    impl Guard for Count {
        fn on_data(&mut self, len: usize) {
            self.0.fetch_add(len, Ordering::SeqCst);
        }
    }
    impl Drop for Count {
        fn drop(&mut self) {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn guard_sees_every_byte_and_drops_with_the_body() {
        let (bytes, drops) = (Arc::default(), Arc::default());
        let body = Guarded::wrap(full("hello"), Count(Arc::clone(&bytes), Arc::clone(&drops)));
        let collected = body.collect().await.unwrap().to_bytes();
        assert_eq!(&collected[..], b"hello");
        assert_eq!(bytes.load(Ordering::SeqCst), 5);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// `frames` data frames ready at once, then (`then_stall`) nothing ever, or the end.
    struct Script {
        frames: usize,
        then_stall: bool,
    }
    impl HttpBody for Script {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.frames > 0 {
                self.frames -= 1;
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"a")))));
            }
            if self.then_stall {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        }
    }

    fn kind_of(err: &BoxError) -> TimeoutKind {
        err.downcast_ref::<BodyTimeout>().expect("a BodyTimeout").0
    }

    #[tokio::test(start_paused = true)]
    async fn timed_cuts_an_idle_body_once_and_never_ends_cleanly() {
        let fired = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&fired);
        let stalled = Script {
            frames: 1,
            then_stall: true,
        };
        let mut body = std::pin::pin!(Timed::new(
            stalled,
            Duration::from_secs(5),
            None,
            move |k| {
                assert_eq!(k, TimeoutKind::Idle);
                f.fetch_add(1, Ordering::SeqCst);
            }
        ));
        assert_eq!(
            &body.frame().await.unwrap().unwrap().into_data().unwrap()[..],
            b"a"
        );
        let start = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(kind_of(&err), TimeoutKind::Idle);
        assert!(body.frame().await.unwrap().is_err(), "never a clean end");
        assert!(!body.is_end_stream());
        assert_eq!(fired.load(Ordering::SeqCst), 1, "counted once");
    }

    #[tokio::test(start_paused = true)]
    async fn timed_ends_a_busy_body_at_its_deadline() {
        let endless = Script {
            frames: usize::MAX,
            then_stall: false,
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut body = std::pin::pin!(Timed::new(
            endless,
            Duration::from_secs(60),
            Some(deadline),
            |k| assert_eq!(k, TimeoutKind::Deadline)
        ));
        let mut frames = 0;
        let err = loop {
            match body.frame().await.unwrap() {
                Ok(_) => {
                    frames += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => break e,
            }
        };
        assert_eq!(frames, 20);
        assert_eq!(kind_of(&err), TimeoutKind::Deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn timed_ends_a_waiting_body_at_its_deadline_and_lets_an_ended_one_end() {
        let deadline = Instant::now() + Duration::from_secs(2);
        let stalled = Script {
            frames: 1,
            then_stall: true,
        };
        let mut body = std::pin::pin!(Timed::new(
            stalled,
            Duration::from_secs(60),
            Some(deadline),
            |k| assert_eq!(k, TimeoutKind::Deadline)
        ));
        assert!(body.frame().await.unwrap().is_ok());
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(Instant::now(), deadline, "woken by the deadline's timer");
        assert_eq!(kind_of(&err), TimeoutKind::Deadline);
        // Past its deadline, a body whose end is ready still ends cleanly.
        let ended = Script {
            frames: 0,
            then_stall: false,
        };
        let past = Instant::now() - Duration::from_secs(1);
        let mut body = std::pin::pin!(Timed::new(
            ended,
            Duration::from_secs(60),
            Some(past),
            |_| { panic!("nothing to cut") }
        ));
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn prepended_gives_its_frame_back_first_and_adds_it_to_the_size_hint() {
        let rest = full("world");
        let first = Frame::data(Bytes::from_static(b"hello "));
        let body = Prepended::wrap(first, rest);
        assert_eq!(body.size_hint().exact(), Some(11));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, "hello world");
    }

    #[tokio::test]
    async fn timed_keeps_the_size_hint_and_the_end() {
        let body = Timed::new(full("hello"), Duration::from_secs(1), None, |_| {});
        assert_eq!(body.size_hint().exact(), Some(5));
        let empty = Timed::new(full(""), Duration::from_secs(1), None, |_| {});
        assert!(empty.is_end_stream());
        let done = Script {
            frames: 2,
            then_stall: false,
        };
        let all = Timed::new(done, Duration::from_secs(1), None, |_| {})
            .collect()
            .await;
        assert_eq!(&all.unwrap().to_bytes()[..], b"aa");
    }
}
