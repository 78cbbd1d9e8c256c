use super::*;
use tokio::time::advance;

fn limiter(capacity: u32, refill: f64, tpm: Option<u64>, report: LimitReport) -> Limiter {
    let config = SimConfig {
        capacity,
        refill,
        tpm,
        limit_report: report,
        ..SimConfig::default()
    };
    Limiter::new(&config, Instant::now())
}

#[test]
fn capacity_mode_reports_capacity_and_tokens_left() {
    assert_eq!(reported(LimitReport::Capacity, 50.0, 20.0, 12.7), (50, 12));
    assert_eq!(reported(LimitReport::Capacity, 50.0, 20.0, 0.0), (50, 0));
}

#[test]
fn per_minute_mode_shifts_remaining_so_the_rate_is_preserved() {
    // capacity 50, refill 20/s: limit 1200; 10 left -> 1160 remaining.
    let (limit, remaining) = reported(LimitReport::PerMinute, 50.0, 20.0, 10.0);
    assert_eq!((limit, remaining), (1200, 1160));
    // The bucket needs 40 tokens = 2s to be full; (limit - remaining) / reset = 20/s.
    let reset_secs = (50.0 - 10.0) / 20.0;
    assert_eq!((limit - remaining) as f64 / reset_secs, 20.0);
    // Full bucket: remaining == limit.
    assert_eq!(
        reported(LimitReport::PerMinute, 50.0, 20.0, 50.0),
        (1200, 1200)
    );
    // Refill below capacity per minute: clamped at 0, never negative.
    assert_eq!(reported(LimitReport::PerMinute, 100.0, 0.5, 10.0), (30, 0));
}

#[tokio::test(start_paused = true)]
async fn per_minute_headers_from_a_live_limiter() {
    let mut l = limiter(50, 20.0, None, LimitReport::PerMinute);
    let now = Instant::now();
    for _ in 0..39 {
        assert!(l.admit(now, 0).denied.is_none());
    }
    let a = l.admit(now, 0);
    assert_eq!(a.requests.limit, 1200);
    assert_eq!(a.requests.remaining, 1160);
    assert_eq!(a.requests.reset, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn requests_bucket_denies_with_time_to_one_token() {
    let mut l = limiter(2, 4.0, None, LimitReport::Capacity);
    let now = Instant::now();
    assert!(l.admit(now, 0).denied.is_none());
    let second = l.admit(now, 0);
    assert!(second.denied.is_none());
    assert_eq!(second.requests.remaining, 0);
    assert_eq!(second.requests.reset, Duration::from_millis(500));
    let third = l.admit(now, 0);
    let denied = third.denied.expect("bucket is empty");
    assert_eq!(denied.kind, Kind::Requests);
    assert_eq!(denied.retry_after, Duration::from_millis(250));
    assert!(third.tokens.is_none());
    advance(Duration::from_millis(250)).await;
    assert!(l.admit(Instant::now(), 0).denied.is_none());
}

#[tokio::test(start_paused = true)]
async fn tokens_bucket_denies_without_taking_a_request_token() {
    // 600 tpm = 10 tokens/s.
    let mut l = limiter(10, 1.0, Some(600), LimitReport::Capacity);
    let now = Instant::now();
    let a = l.admit(now, 500);
    assert!(a.denied.is_none());
    assert_eq!(a.requests.remaining, 9);
    assert_eq!(
        a.tokens,
        Some(View {
            limit: 600,
            remaining: 100,
            reset: Duration::from_secs(50)
        })
    );
    let b = l.admit(now, 150);
    assert_eq!(
        b.denied,
        Some(Denied {
            kind: Kind::Tokens,
            retry_after: Duration::from_secs(5)
        })
    );
    assert_eq!(b.requests.remaining, 9, "a refused request takes nothing");
}

#[tokio::test(start_paused = true)]
async fn reset_refills_both_buckets() {
    let mut l = limiter(1, 0.0, Some(100), LimitReport::Capacity);
    assert!(l.admit(Instant::now(), 100).denied.is_none());
    assert!(l.admit(Instant::now(), 0).denied.is_some());
    l.reset(Instant::now());
    let a = l.admit(Instant::now(), 100);
    assert!(a.denied.is_none());
}

#[test]
fn token_cost_counts_prompt_chars_and_max_tokens() {
    assert_eq!(token_cost(0, None), DEFAULT_MAX_TOKENS);
    assert_eq!(token_cost(41, Some(100)), 110);
}
