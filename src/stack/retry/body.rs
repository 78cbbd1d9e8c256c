//! Buffering a (small) error body without losing it when it turns out to be large.

use bytes::{Bytes, BytesMut};
use http_body::Body as _;
use http_body_util::BodyExt;

use crate::body::{self, Body};

/// Collect `body` if it ends within `limit` bytes; otherwise hand back a body that replays what
/// was read and streams the rest, so nothing is dropped.
pub async fn buffer(mut body: Body, limit: usize) -> Result<Bytes, Body> {
    if body.size_hint().lower() as usize > limit {
        return Err(body);
    }
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        let prefix = http_body_util::Full::new(buf.freeze());
                        let rest = prefix.map_err(|never| match never {}).boxed_unsync();
                        return Err(body::boxed(Chain {
                            first: Some(rest),
                            second: body,
                        }));
                    }
                }
            }
            // A body that broke mid-way: pass on what arrived (the client sees a short body).
            Err(_) => break,
        }
    }
    Ok(buf.freeze())
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

    #[tokio::test]
    async fn small_bodies_buffer_and_large_ones_replay_whole() {
        assert_eq!(
            &buffer(body::full("short"), 10).await.unwrap()[..],
            b"short"
        );
        let big = "x".repeat(100);
        let Err(replayed) = buffer(body::full(big.clone()), 10).await else {
            panic!("buffered")
        };
        let all = replayed.collect().await.unwrap().to_bytes();
        assert_eq!(all.len(), 100);
    }
}
