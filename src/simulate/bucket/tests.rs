use super::*;
use tokio::time::advance;

fn change(at_secs: u64, rate: f64) -> RefillChange {
    RefillChange {
        at: Duration::from_secs(at_secs),
        rate,
    }
}

fn approx(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[tokio::test(start_paused = true)]
async fn starts_full_then_refuses_when_empty() {
    let mut b = Bucket::new(3.0, 10.0, vec![], Instant::now());
    for _ in 0..3 {
        assert!(b.try_take(Instant::now(), 1.0));
    }
    assert!(!b.try_take(Instant::now(), 1.0));
    assert_eq!(b.time_until(1.0), Duration::from_millis(100));
    assert_eq!(b.time_until_full(), Duration::from_millis(300));
}

#[tokio::test(start_paused = true)]
async fn refills_continuously_and_caps_at_capacity() {
    let mut b = Bucket::new(10.0, 4.0, vec![], Instant::now());
    assert!(b.try_take(Instant::now(), 10.0));
    advance(Duration::from_millis(250)).await;
    assert!(b.try_take(Instant::now(), 1.0));
    assert!(!b.try_take(Instant::now(), 1.0));
    advance(Duration::from_millis(1250)).await;
    b.refill(Instant::now());
    assert!(approx(b.tokens(), 5.0), "{}", b.tokens());
    advance(Duration::from_secs(60)).await;
    b.refill(Instant::now());
    assert_eq!(b.tokens(), 10.0);
    assert_eq!(b.time_until_full(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn an_earlier_instant_adds_nothing() {
    let before = Instant::now();
    let mut b = Bucket::new(2.0, 1.0, vec![], before);
    advance(Duration::from_secs(1)).await;
    assert!(b.try_take(Instant::now(), 2.0));
    assert!(!b.try_take(before, 1.0));
    assert_eq!(b.tokens(), 0.0);
}

#[tokio::test(start_paused = true)]
async fn schedule_changes_the_rate_mid_interval() {
    // 10/s for 2s, then 1/s from 2s on, then 0 from 10s on.
    let mut b = Bucket::new(
        100.0,
        10.0,
        vec![change(2, 1.0), change(10, 0.0)],
        Instant::now(),
    );
    assert!(b.try_take(Instant::now(), 100.0));
    advance(Duration::from_secs(1)).await;
    assert_eq!(b.rate(Instant::now()), 10.0);
    b.refill(Instant::now());
    assert!(approx(b.tokens(), 10.0));
    // One refill call spanning the change: 1s at 10/s + 2s at 1/s.
    advance(Duration::from_secs(3)).await;
    assert_eq!(b.rate(Instant::now()), 1.0);
    b.refill(Instant::now());
    assert!(approx(b.tokens(), 22.0), "{}", b.tokens());
    // 6s at 1/s until the rate drops to 0 at 10s: never full.
    assert_eq!(b.time_until(25.0), Duration::from_secs(3));
    assert_eq!(b.time_until_full(), MAX_WAIT);
    advance(Duration::from_secs(100)).await;
    b.refill(Instant::now());
    assert!(approx(b.tokens(), 28.0), "{}", b.tokens());
}

#[tokio::test(start_paused = true)]
async fn time_until_walks_future_rate_changes() {
    // 1/s until 5s, then 10/s.
    let mut b = Bucket::new(50.0, 1.0, vec![change(5, 10.0)], Instant::now());
    assert!(b.try_take(Instant::now(), 50.0));
    // 5 tokens in the first 5s, the other 45 at 10/s: 4.5s.
    assert_eq!(b.time_until_full(), Duration::from_millis(9500));
    assert_eq!(b.time_until(3.0), Duration::from_secs(3));
}

#[tokio::test(start_paused = true)]
async fn reset_refills_and_restarts_the_schedule() {
    let mut b = Bucket::new(5.0, 1.0, vec![change(2, 100.0)], Instant::now());
    advance(Duration::from_secs(3)).await;
    assert_eq!(b.rate(Instant::now()), 100.0);
    assert!(b.try_take(Instant::now(), 5.0));
    b.reset(Instant::now());
    assert_eq!(b.tokens(), 5.0);
    assert_eq!(b.rate(Instant::now()), 1.0);
    advance(Duration::from_secs(2)).await;
    assert_eq!(b.rate(Instant::now()), 100.0);
}

#[tokio::test(start_paused = true)]
async fn charge_may_go_below_zero_and_refills_pay_the_debt_first() {
    let mut b = Bucket::new(2.0, 1.0, vec![], Instant::now());
    for _ in 0..3 {
        b.charge(Instant::now(), 1.0);
    }
    assert_eq!(b.tokens(), -1.0);
    assert_eq!(b.time_until(1.0), Duration::from_secs(2));
    assert_eq!(b.time_until_full(), Duration::from_secs(3));
    assert!(!b.try_take(Instant::now(), 1.0));
    advance(Duration::from_secs(2)).await;
    assert!(b.try_take(Instant::now(), 1.0));
}
