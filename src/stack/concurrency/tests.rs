use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::sync::Mutex;
use tokio::time::Instant;
use tower::ServiceExt;

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
        1.25,
        100,
        Duration::from_secs(60),
        crate::metrics::Metrics::new().upstream("t"),
    );
    assert_eq!(w.limit(), 16);
    // Saturated (requests always waiting), `limit` in flight, a backend with `slots` slots of
    // 50 ms and a FIFO queue: a round trip's worth of answers per round trip.
    let mut clock = Instant::now();
    let mut answer = |slots: u32| {
        let rtt = Duration::from_millis(50).mul_f64((w.limit() as f64 / slots as f64).max(1.0));
        clock += rtt / w.limit();
        w.sample(gradient::Sample {
            sent: clock - rtt,
            rtt,
            in_flight: w.limit(),
            saturated: true,
        });
    };
    for _ in 0..300 {
        answer(1000);
    }
    assert_eq!(w.limit(), 64, "flat latency grows it to the ceiling");
    for _ in 0..2000 {
        answer(8);
    }
    assert!(
        (8..=12).contains(&w.limit()),
        "a backend with 8 slots brings it to 8 + a quarter: {}",
        w.limit()
    );
    // The semaphore follows the limit: exactly `limit` slots can be held.
    let deadline = Instant::now() + Duration::from_secs(1);
    let held: Vec<_> = hold_slots(&w, w.limit(), deadline).await;
    assert!(Arc::clone(&w.semaphore).try_acquire_owned().is_err());
    assert_eq!(w.in_use(), w.limit() as usize);
    drop(held);
    assert_eq!(w.in_use(), 0);
}

async fn hold_slots(w: &Arc<Window>, n: u32, deadline: Instant) -> Vec<Slot> {
    let mut slots = Vec::new();
    for _ in 0..n {
        slots.push(w.acquire(deadline).await.unwrap());
    }
    slots
}

/// Only 2xx answers to first attempts are samples: a fast error says nothing about the
/// backend's queue, and a retried request's time includes its backoff.
#[tokio::test(start_paused = true)]
async fn only_first_attempt_successes_teach_the_window() {
    let w = Window::adaptive(
        8,
        1,
        64,
        1.25,
        100,
        Duration::from_secs(60),
        crate::metrics::Metrics::new().upstream("t"),
    );
    let backend = tower::service_fn(|req: ProxyRequest| {
        let answer: BoxFuture = Box::pin(async move {
            let status = match req.uri.path() {
                "/busy" => 503,
                "/retried" => {
                    req.ctx.count_attempt();
                    req.ctx.count_attempt();
                    200
                }
                _ => 200,
            };
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok(http::Response::builder()
                .status(status)
                .body(crate::body::full("{}"))
                .unwrap())
        });
        answer
    });
    let stack: crate::stack::Stack = tower::util::BoxCloneSyncService::new(tower::Layer::layer(
        &ConcurrencyLayer::new(Arc::clone(&w)),
        backend,
    ));
    let base = || w.gradient.as_ref().unwrap().lock().unwrap().base_rtt();
    for path in ["/busy", "/retried", "/ok"] {
        for _ in 0..10 {
            let req = ProxyRequest::for_test(&format!("http://b{path}"), Duration::from_secs(60));
            let response = stack.clone().oneshot(req).await.unwrap();
            response.into_body().collect().await.unwrap();
        }
        assert_eq!(base().is_some(), path == "/ok", "{path}");
    }
    assert_eq!(base(), Some(Duration::from_millis(100)));
    assert_eq!(w.in_use(), 0);
}
