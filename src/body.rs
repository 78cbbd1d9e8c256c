//! The response body type every layer passes along, and a wrapper that keeps a guard (a
//! concurrency permit, an in-flight gauge) alive until the body has been fully sent.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use pin_project_lite::pin_project;

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
    /// Wrap `inner` so that `guard` lives as long as the stream.
    pub fn wrap(inner: Body, guard: G) -> Body {
        Guarded { inner, guard }.boxed_unsync()
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
}
