//! Response body: one buffer, or frames from a channel as a producer task sends them.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::mpsc;

/// Events buffered between a stream producer and the connection.
const STREAM_BUFFER: usize = 1;

#[derive(Debug)]
pub enum SimBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl SimBody {
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Self::Full(Some(bytes.into()))
    }

    /// A streaming body and the sender its producer writes events into.
    pub fn channel() -> (mpsc::Sender<Bytes>, Self) {
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        (tx, Self::Stream(rx))
    }
}

/// Streams `events`, each sent after its delay, from a task that stops early when the
/// client goes away. `keep` (e.g. an in-flight guard) is dropped after the last event.
pub fn stream(events: Vec<(Duration, Bytes)>, keep: impl Send + 'static) -> SimBody {
    let (tx, body) = SimBody::channel();
    tokio::spawn(async move {
        for (delay, event) in events {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if tx.send(event).await.is_err() {
                tracing::debug!("stream receiver gone; stopping early");
                break;
            }
        }
        drop(keep);
    });
    body
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            Self::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Self::Stream(rx) => rx.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Self::Full(None) => SizeHint::with_exact(0),
            Self::Stream(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn full_body_yields_once() {
        let mut body = SimBody::full("hello");
        assert_eq!(body.size_hint().exact(), Some(5));
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "hello");
        assert!(body.is_end_stream());
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn channel_body_yields_each_send_then_ends() {
        let (tx, mut body) = SimBody::channel();
        let producer = tokio::spawn(async move {
            for event in ["a", "b"] {
                tx.send(Bytes::from(event)).await.unwrap();
            }
        });
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            got.push(frame.unwrap().into_data().unwrap());
        }
        producer.await.unwrap();
        assert_eq!(got, ["a", "b"]);
    }

    #[tokio::test(start_paused = true)]
    async fn stream_spaces_events_by_their_delays() {
        let start = tokio::time::Instant::now();
        let events = vec![
            (Duration::ZERO, Bytes::from("1")),
            (Duration::from_millis(20), Bytes::from("2")),
            (Duration::from_millis(20), Bytes::from("3")),
        ];
        let keep = std::sync::Arc::new(());
        let mut body = stream(events, std::sync::Arc::clone(&keep));
        let mut at = Vec::new();
        while let Some(frame) = body.frame().await {
            frame.unwrap();
            at.push(start.elapsed().as_millis());
        }
        assert_eq!(at, [0, 20, 40]);
        tokio::task::yield_now().await;
        assert_eq!(
            std::sync::Arc::strong_count(&keep),
            1,
            "producer released `keep`"
        );
    }
}
