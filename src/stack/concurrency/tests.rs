use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::*;

fn window(limit: u32, queue: usize, timeout: Duration) -> Arc<Window> {
    Window::new(
        limit,
        queue,
        timeout,
        crate::metrics::Metrics::new().upstream("t"),
    )
}

#[tokio::test(start_paused = true)]
async fn waiters_are_served_in_fifo_order() {
    let w = window(1, 100, Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = w.acquire(deadline).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for i in 0..10 {
        let (w, order) = (Arc::clone(&w), Arc::clone(&order));
        handles.push(tokio::spawn(async move {
            let slot = w.acquire(deadline).await.unwrap();
            order.lock().await.push(i);
            tokio::time::sleep(Duration::from_millis(10)).await;
            drop(slot);
        }));
        tokio::task::yield_now().await; // enqueue in this order
    }
    assert_eq!(w.waiting(), 10);
    drop(first);
    for h in handles {
        h.await.unwrap();
    }
    assert_eq!(*order.lock().await, (0..10).collect::<Vec<_>>());
}

#[tokio::test(start_paused = true)]
async fn overflow_and_timeout_get_429s_with_retry_after() {
    let w = window(1, 1, Duration::from_secs(2));
    let deadline = Instant::now() + Duration::from_secs(60);
    let _held = w.acquire(deadline).await.unwrap();
    let w2 = Arc::clone(&w);
    let queued = tokio::spawn(async move { w2.acquire(deadline).await.map(|_| ()) });
    tokio::task::yield_now().await;
    let full = w.acquire(deadline).await.err().expect("queue is full");
    assert!(matches!(full, ProxyError::QueueFull { .. }), "{full}");
    assert!(full.retry_after().unwrap() >= Duration::from_secs(1));
    let timed_out = queued.await.unwrap().unwrap_err();
    assert!(
        matches!(timed_out, ProxyError::QueueTimeout { .. }),
        "{timed_out}"
    );
    assert_eq!(timed_out.status(), 429);
}

#[tokio::test(start_paused = true)]
async fn limit_moves_at_run_time() {
    let w = window(2, 100, Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(60);
    let a = w.acquire(deadline).await.unwrap();
    let b = w.acquire(deadline).await.unwrap();
    w.set_limit(1); // both held: one becomes debt
    drop(a); // pays the debt
    assert!(
        Arc::clone(&w.semaphore).try_acquire_owned().is_err(),
        "limit 1, one held"
    );
    drop(b);
    let c = w.acquire(deadline).await.unwrap();
    assert!(Arc::clone(&w.semaphore).try_acquire_owned().is_err());
    w.set_limit(3);
    let _d = w.acquire(deadline).await.unwrap();
    let _e = w.acquire(deadline).await.unwrap();
    drop(c);
    assert_eq!(w.limit(), 3);
}
