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

#[tokio::test(start_paused = true)]
async fn adaptive_window_follows_latency_within_its_bounds() {
    let w = Window::adaptive(
        16,
        2,
        64,
        2.0,
        100,
        Duration::from_secs(60),
        crate::metrics::Metrics::new().upstream("t"),
    );
    assert_eq!(w.limit(), 16);
    for _ in 0..300 {
        w.sample(Duration::from_millis(50));
    }
    assert_eq!(
        w.limit(),
        64,
        "flat latency grows it to the ceiling (max_concurrency)"
    );
    // 60 answers at 40x the baseline (the baseline itself drifts up over hundreds).
    for _ in 0..60 {
        w.sample(Duration::from_millis(2000));
    }
    assert!(
        w.limit() < 16,
        "a queueing backend shrinks it: {}",
        w.limit()
    );
    assert!(w.limit() >= 2);
    // The semaphore follows the limit: exactly `limit` slots can be held.
    let deadline = Instant::now() + Duration::from_secs(1);
    let held: Vec<_> = hold_slots(&w, w.limit(), deadline).await;
    assert!(Arc::clone(&w.semaphore).try_acquire_owned().is_err());
    drop(held);
}

async fn hold_slots(w: &Arc<Window>, n: u32, deadline: Instant) -> Vec<Slot> {
    let mut slots = Vec::new();
    for _ in 0..n {
        slots.push(w.acquire(deadline).await.unwrap());
    }
    slots
}
