//! Streaming answers pass frame by frame; a client that goes away cancels the upstream request;
//! a shutdown lets in-flight requests (streams included) finish.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use support::*;
use tokio::sync::mpsc;

fn tx(slot: &Arc<Mutex<Option<mpsc::Sender<Bytes>>>>) -> mpsc::Sender<Bytes> {
    slot.lock()
        .unwrap()
        .take()
        .expect("upstream got the request")
}

/// A streamed chat completion through `corral`, its head received.
async fn open_stream(corral: &Corral) -> http::Response<hyper::body::Incoming> {
    client()
        .request(post(
            &corral.url("/v1/chat/completions"),
            r#"{"stream":true}"#,
        ))
        .await
        .expect("corral answered")
}

#[tokio::test]
async fn first_event_arrives_while_upstream_holds_the_rest() {
    let (upstream, slot, _) = sse_upstream().await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let response = open_stream(&corral).await;
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let sender = tx(&slot);
    sender
        .send(Bytes::from_static(b"data: {\"n\":1}\n\n"))
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("the first event arrived while the upstream still holds the rest")
        .unwrap()
        .unwrap();
    assert_eq!(
        first.data_ref().unwrap(),
        &Bytes::from_static(b"data: {\"n\":1}\n\n")
    );
    sender
        .send(Bytes::from_static(b"data: [DONE]\n\n"))
        .await
        .unwrap();
    drop(sender);
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(&rest[..], b"data: [DONE]\n\n");
}

#[tokio::test]
async fn client_disconnect_cancels_the_upstream_stream() {
    let (upstream, slot, dropped) = sse_upstream().await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let response = open_stream(&corral).await;
    let sender = tx(&slot);
    sender
        .send(Bytes::from_static(b"data: 1\n\n"))
        .await
        .unwrap();
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    assert!(!dropped.load(Ordering::SeqCst));
    drop(body); // the client goes away mid-stream
    assert!(
        eventually(Duration::from_secs(5), || dropped.load(Ordering::SeqCst)).await,
        "the upstream never saw the cancellation"
    );
    assert!(eventually(Duration::from_secs(5), || sender.is_closed()).await);
}

#[tokio::test]
async fn client_disconnect_before_the_head_cancels_the_upstream_request() {
    let cancelled = Arc::new(AtomicBool::new(false));
    let c2 = Arc::clone(&cancelled);
    let upstream = MockUpstream::start(move |_| {
        struct OnDrop(Arc<AtomicBool>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let guard = OnDrop(Arc::clone(&c2));
        async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(guard);
            json(200, serde_json::json!({}))
        }
    })
    .await;
    let corral = Corral::start(&one_upstream(&upstream, "")).await;
    let pending = tokio::spawn(client().request(post(&corral.url("/v1/slow"), "{}")));
    assert!(eventually(Duration::from_secs(5), || upstream.calls() == 1).await);
    pending.abort(); // drops the client connection while corral waits for the head
    assert!(
        eventually(Duration::from_secs(5), || cancelled.load(Ordering::SeqCst)).await,
        "the upstream handler kept running after the client left"
    );
    let idle = r#"corral_in_flight_requests{upstream="mock"} 0"#;
    assert!(
        eventually(Duration::from_secs(5), || corral
            .app
            .metrics()
            .render()
            .contains(idle))
        .await,
        "the in-flight gauge kept the cancelled request"
    );
}

#[tokio::test]
async fn shutdown_drains_an_in_flight_stream() {
    let (upstream, slot, _) = sse_upstream().await;
    let mut corral = Corral::start(&one_upstream(&upstream, "")).await;
    let response = open_stream(&corral).await;
    let sender = tx(&slot);
    corral.shutdown();
    // Readiness flips first; the listener closes.
    assert!(eventually(Duration::from_secs(5), || !corral.app.is_ready()).await);
    assert!(
        eventually(Duration::from_secs(5), || std::net::TcpStream::connect(
            corral.addr
        )
        .is_err())
        .await,
        "listener still accepting during the drain"
    );
    // The in-flight stream still completes.
    sender
        .send(Bytes::from_static(b"data: 1\n\n"))
        .await
        .unwrap();
    sender
        .send(Bytes::from_static(b"data: [DONE]\n\n"))
        .await
        .unwrap();
    drop(sender);
    let all = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&all[..], b"data: 1\n\ndata: [DONE]\n\n");
    let task = corral.task.take().unwrap();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("server stopped after the drain")
        .unwrap()
        .unwrap();
}
