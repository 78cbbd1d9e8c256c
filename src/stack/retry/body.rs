//! Buffering a (small) error body to judge it, without losing it when it turns out to be large,
//! and without waiting past the request's deadline for one that stalls.

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{HeaderValue, Response};
use http_body::Body as _;
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::body::{self, Body};

/// What [`buffer`] made of a body.
pub enum Buffered {
    /// The whole body.
    Whole(Bytes),
    /// What arrived before the body broke or the deadline passed.
    Cut(Bytes),
    /// Larger than the limit: what was read, then the rest, streaming.
    TooLarge(Body),
}

/// Collect `body` if it ends within `limit` bytes and by `deadline`; a body larger than `limit`
/// comes back whole, replaying what was read and streaming the rest, so nothing is dropped.
pub async fn buffer(mut body: Body, limit: usize, deadline: Instant) -> Buffered {
    if body.size_hint().lower() as usize > limit {
        return Buffered::TooLarge(body);
    }
    let mut buf = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(Some(Ok(frame))) => frame,
            Ok(None) => return Buffered::Whole(buf.freeze()),
            // Broken mid-way, or still arriving at the deadline.
            Ok(Some(Err(_))) | Err(_) => return Buffered::Cut(buf.freeze()),
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                let prefix = http_body_util::Full::new(buf.freeze());
                let rest = prefix.map_err(|never| match never {}).boxed_unsync();
                return Buffered::TooLarge(body::boxed(Chain {
                    first: Some(rest),
                    second: body,
                }));
            }
        }
    }
}

/// A buffered answer as a response again. A cut body is passed with its length corrected: the
/// upstream's `Content-Length` would promise bytes that never come (an HTTP/1 client would wait
/// for them, an HTTP/2 one get nothing).
pub fn replay(mut parts: http::response::Parts, bytes: Bytes, cut: bool) -> Response<Body> {
    if cut {
        parts
            .headers
            .insert(CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    }
    Response::from_parts(parts, body::full(bytes))
}

/// `first`, then `second`.
struct Chain {
    first: Option<Body>,
    second: Body,
}

impl http_body::Body for Chain {
    type Data = Bytes;
    type Error = body::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if let Some(first) = self.first.as_mut() {
            match std::pin::Pin::new(first).poll_frame(cx) {
                std::task::Poll::Ready(None) => self.first = None,
                other => return other,
            }
        }
        std::pin::Pin::new(&mut self.second).poll_frame(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(60)
    }

    #[tokio::test]
    async fn small_bodies_buffer_and_large_ones_replay_whole() {
        let Buffered::Whole(short) = buffer(body::full("short"), 10, later()).await else {
            panic!("not buffered whole")
        };
        assert_eq!(&short[..], b"short");
        let big = "x".repeat(100);
        let Buffered::TooLarge(replayed) = buffer(body::full(big.clone()), 10, later()).await
        else {
            panic!("buffered")
        };
        let all = replayed.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_body_is_cut_at_the_deadline_and_replayed_with_its_real_length() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        tx.send(Bytes::from_static(b"{\"err")).await.unwrap();
        let stalled = body::boxed(Channel(rx));
        let start = Instant::now();
        let deadline = start + Duration::from_secs(3);
        let Buffered::Cut(bytes) = buffer(stalled, 1000, deadline).await else {
            panic!("not cut")
        };
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert_eq!(&bytes[..], b"{\"err");
        let (mut parts, _) = Response::new(()).into_parts();
        parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(100));
        let response = replay(parts, bytes, true);
        assert_eq!(response.headers()[CONTENT_LENGTH], "5");
        assert_eq!(response.into_body().size_hint().exact(), Some(5));
        drop(tx);
    }

    struct Channel(tokio::sync::mpsc::Receiver<Bytes>);
    impl http_body::Body for Channel {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            self.0
                .poll_recv(cx)
                .map(|b| b.map(|b| Ok(http_body::Frame::data(b))))
        }
    }
}
