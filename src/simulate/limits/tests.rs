use super::*;
use crate::simulate::config::{ModelLimit, RefillChange};
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
        assert!(l.admit(now, None, 0).denied.is_none());
    }
    let a = l.admit(now, None, 0);
    assert_eq!(a.requests.limit, 1200);
    assert_eq!(a.requests.remaining, 1160);
    assert_eq!(a.requests.reset, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn requests_bucket_denies_with_time_to_one_token() {
    let mut l = limiter(2, 4.0, None, LimitReport::Capacity);
    let now = Instant::now();
    assert!(l.admit(now, None, 0).denied.is_none());
    let second = l.admit(now, None, 0);
    assert!(second.denied.is_none());
    assert_eq!(second.requests.remaining, 0);
    assert_eq!(second.requests.reset, Duration::from_millis(500));
    let third = l.admit(now, None, 0);
    let denied = third.denied.expect("bucket is empty");
    assert_eq!(denied.kind, Kind::Requests);
    assert_eq!(denied.retry_after, Duration::from_millis(250));
    assert!(third.tokens.is_none());
    advance(Duration::from_millis(250)).await;
    assert!(l.admit(Instant::now(), None, 0).denied.is_none());
}

#[tokio::test(start_paused = true)]
async fn tokens_bucket_denies_without_taking_a_request_token() {
    // 600 tpm = 10 tokens/s.
    let mut l = limiter(10, 1.0, Some(600), LimitReport::Capacity);
    let now = Instant::now();
    let a = l.admit(now, None, 500);
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
    let b = l.admit(now, None, 150);
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
    assert!(l.admit(Instant::now(), None, 100).denied.is_none());
    assert!(l.admit(Instant::now(), None, 0).denied.is_some());
    l.reset(Instant::now());
    let a = l.admit(Instant::now(), None, 100);
    assert!(a.denied.is_none());
}

#[test]
fn token_cost_counts_prompt_chars_and_max_tokens() {
    assert_eq!(token_cost(0, None), DEFAULT_MAX_TOKENS);
    assert_eq!(token_cost(41, Some(100)), 110);
}

fn limiter_with_changes(
    capacity: u32,
    refill: f64,
    changes: &[(u64, f64)],
    report: LimitReport,
) -> Limiter {
    let config = SimConfig {
        capacity,
        refill,
        refill_changes: changes
            .iter()
            .map(|&(ms, rate)| RefillChange {
                at: Duration::from_millis(ms),
                rate,
            })
            .collect(),
        limit_report: report,
        ..SimConfig::default()
    };
    Limiter::new(&config, Instant::now())
}

#[test]
fn quantized_reports_limit_minus_the_shadow_deficit() {
    // Shadow of 1200 (20/s) with 20 admitted: 1180 left of 1200.
    assert_eq!(quantized(1200.0, 20.0, 1180.0), (1200, 1180));
    // The schedule dropped the rate to 10/s: the same 20 are owed out of 600.
    assert_eq!(quantized(1200.0, 10.0, 1180.0), (600, 580));
    // More admitted than a minute holds (capacity 100 at 0.5/s): nothing remains.
    assert_eq!(quantized(30.0, 0.5, -5.0), (30, 0));
    assert_eq!(quantized(30.0, 0.5, 30.0), (30, 30));
}

#[tokio::test(start_paused = true)]
async fn quantized_429_reports_a_large_remaining_and_the_true_rate() {
    // "1,200 RPM enforced as 20 per second".
    let mut l = limiter(20, 20.0, None, LimitReport::Quantized);
    let now = Instant::now();
    for i in 0..20 {
        let a = l.admit(now, None, 0);
        assert!(a.denied.is_none(), "request {i}");
        assert_eq!(a.requests.remaining, 1200 - 1 - i);
    }
    let refused = l.admit(now, None, 0);
    let denied = refused.denied.expect("the enforcing bucket is empty");
    assert_eq!(denied.kind, Kind::Requests);
    assert_eq!(denied.retry_after, Duration::from_millis(50));
    let v = refused.requests;
    assert_eq!(
        (v.limit, v.remaining),
        (1200, 1180),
        "a refusal is not charged"
    );
    assert_eq!(v.reset, Duration::from_secs(1));
    let rate = (v.limit - v.remaining) as f64 / v.reset.as_secs_f64();
    assert_eq!(rate, 20.0);
    // Half a second later 10 have refilled in both buckets.
    advance(Duration::from_millis(500)).await;
    let a = l.admit(Instant::now(), None, 0);
    assert!(a.denied.is_none());
    assert_eq!((a.requests.limit, a.requests.remaining), (1200, 1189));
    assert_eq!(a.requests.reset, Duration::from_millis(550));
    l.reset(Instant::now());
    assert_eq!(l.admit(Instant::now(), None, 0).requests.remaining, 1199);
}

#[tokio::test(start_paused = true)]
async fn quantized_tokens_are_reported_honestly() {
    let mut l = limiter(20, 20.0, Some(600), LimitReport::Quantized);
    let a = l.admit(Instant::now(), None, 500);
    assert_eq!(
        a.tokens,
        Some(View {
            limit: 600,
            remaining: 100,
            reset: Duration::from_secs(50)
        })
    );
}

#[tokio::test(start_paused = true)]
async fn quantized_figures_follow_refill_change() {
    // 20/s, then 5/s from 1s on.
    let mut l = limiter_with_changes(20, 20.0, &[(1000, 5.0)], LimitReport::Quantized);
    for _ in 0..20 {
        assert!(l.admit(Instant::now(), None, 0).denied.is_none());
    }
    advance(Duration::from_millis(500)).await;
    // 10 refilled; one more admitted: 11 owed, 10 of them at 20/s, the last at 5/s.
    let a = l.admit(Instant::now(), None, 0);
    assert!(a.denied.is_none());
    assert_eq!((a.requests.limit, a.requests.remaining), (1200, 1189));
    assert_eq!(a.requests.reset, Duration::from_millis(700));
    advance(Duration::from_millis(500)).await;
    // At 1s: 1 owed, one more admitted, reported against 5/s = 300 per minute.
    let a = l.admit(Instant::now(), None, 0);
    assert!(a.denied.is_none());
    assert_eq!((a.requests.limit, a.requests.remaining), (300, 298));
    assert_eq!(a.requests.reset, Duration::from_millis(400));
}

#[tokio::test(start_paused = true)]
async fn per_minute_figures_follow_refill_change() {
    // 20/s, then 10/s from 1s on.
    let mut l = limiter_with_changes(50, 20.0, &[(1000, 10.0)], LimitReport::PerMinute);
    let a = l.admit(Instant::now(), None, 0);
    assert_eq!((a.requests.limit, a.requests.remaining), (1200, 1199));
    assert_eq!(a.requests.reset, Duration::from_millis(50));
    advance(Duration::from_secs(1)).await;
    let a = l.admit(Instant::now(), None, 0);
    assert_eq!((a.requests.limit, a.requests.remaining), (600, 599));
    assert_eq!(a.requests.reset, Duration::from_millis(100));
    let rate = (a.requests.limit - a.requests.remaining) as f64 / a.requests.reset.as_secs_f64();
    assert_eq!(rate, 10.0);
}

fn two_models(report: LimitReport) -> Limiter {
    let config = SimConfig {
        capacity: 50,
        refill: 20.0,
        limit_report: report,
        model_limits: vec![ModelLimit {
            model: "slow".into(),
            capacity: 2,
            refill: 1.0,
        }],
        ..SimConfig::default()
    };
    Limiter::new(&config, Instant::now())
}

#[tokio::test(start_paused = true)]
async fn a_model_with_a_limit_of_its_own_is_refused_alone() {
    let mut l = two_models(LimitReport::Capacity);
    let now = Instant::now();
    for left in [1, 0] {
        let a = l.admit(now, Some("slow"), 0);
        assert!(a.denied.is_none());
        assert_eq!((a.requests.limit, a.requests.remaining), (2, left));
    }
    let refused = l.admit(now, Some("slow"), 0);
    assert_eq!(
        refused.denied,
        Some(Denied {
            kind: Kind::Requests,
            retry_after: Duration::from_secs(1)
        })
    );
    let other = l.admit(now, Some("fast"), 0);
    assert!(other.denied.is_none());
    assert_eq!((other.requests.limit, other.requests.remaining), (50, 49));
    l.reset(now);
    assert_eq!(l.admit(now, Some("slow"), 0).requests.remaining, 1);
}

#[tokio::test(start_paused = true)]
async fn each_model_reports_its_own_per_minute_figures() {
    let mut l = two_models(LimitReport::PerMinute);
    let now = Instant::now();
    let slow = l.admit(now, Some("slow"), 0).requests;
    assert_eq!((slow.limit, slow.remaining), (60, 59));
    let default = l.admit(now, None, 0).requests;
    assert_eq!((default.limit, default.remaining), (1200, 1199));
}

#[tokio::test(start_paused = true)]
async fn peek_reports_the_bucket_and_takes_nothing() {
    let mut l = two_models(LimitReport::Quantized);
    let now = Instant::now();
    for _ in 0..3 {
        let a = l.peek(now, Some("slow"));
        assert_eq!(a.denied, None);
        assert_eq!((a.requests.limit, a.requests.remaining), (60, 60));
    }
    assert!(l.admit(now, Some("slow"), 0).denied.is_none());
    assert_eq!(l.peek(now, Some("slow")).requests.remaining, 59);
}
