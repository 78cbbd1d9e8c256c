use super::*;
use crate::simulate::limits::{Denied, Kind};

#[test]
fn go_duration_matches_go_time_duration_string() {
    // Cases from Go's time/time_test.go durationTests, plus what buckets produce.
    let table: &[(Duration, &str)] = &[
        (Duration::ZERO, "0s"),
        (Duration::from_nanos(1), "1ns"),
        (Duration::from_nanos(1_100), "1.1µs"),
        (Duration::from_micros(2_200), "2.2ms"),
        (Duration::from_millis(3_300), "3.3s"),
        (Duration::from_secs(4 * 60 + 5), "4m5s"),
        (Duration::from_millis((4 * 60 + 5) * 1000 + 1), "4m5.001s"),
        (
            Duration::from_millis(((5 * 60 + 6) * 60 + 7) * 1000 + 1),
            "5h6m7.001s",
        ),
        (Duration::new(8 * 60, 1), "8m0.000000001s"),
        (Duration::from_millis(50), "50ms"),
        (Duration::from_secs(1), "1s"),
        (Duration::from_millis(2_500), "2.5s"),
        (Duration::from_secs(90), "1m30s"),
        (Duration::from_secs(3600), "1h0m0s"),
        (Duration::from_millis(999), "999ms"),
        (Duration::from_micros(1), "1µs"),
    ];
    for (d, want) in table {
        assert_eq!(go_duration(*d), *want, "{d:?}");
    }
}

#[test]
fn ceilings_round_up_only_when_needed() {
    assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
    assert_eq!(ceil_secs(Duration::from_secs(2)), 2);
    assert_eq!(ceil_secs(Duration::from_millis(2_001)), 3);
    assert_eq!(ceil_millis(Duration::from_nanos(1)), 1);
    assert_eq!(ceil_millis(Duration::from_millis(250)), 250);
    assert_eq!(ceil_millis(Duration::from_micros(250_001)), 251);
}

fn admission(denied: bool, tokens: bool) -> Admission {
    let view = View {
        limit: 50,
        remaining: 3,
        reset: Duration::from_micros(2_499_001),
    };
    Admission {
        requests: view,
        tokens: tokens.then_some(View {
            limit: 1000,
            remaining: 10,
            reset: Duration::from_secs(90),
        }),
        denied: denied.then_some(Denied {
            kind: Kind::Requests,
            retry_after: Duration::from_millis(1_250),
        }),
    }
}

fn get<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.to_str().unwrap())
}

#[test]
fn openai_headers_on_success_and_refusal() {
    let mut h = HeaderMap::new();
    openai(&mut h, &admission(false, false));
    assert_eq!(get(&h, "x-ratelimit-limit-requests"), Some("50"));
    assert_eq!(get(&h, "x-ratelimit-remaining-requests"), Some("3"));
    assert_eq!(get(&h, "x-ratelimit-reset-requests"), Some("2.5s"));
    assert_eq!(get(&h, "x-ratelimit-limit-tokens"), None);
    assert_eq!(get(&h, "retry-after"), None);

    let mut h = HeaderMap::new();
    openai(&mut h, &admission(true, true));
    assert_eq!(get(&h, "x-ratelimit-limit-tokens"), Some("1000"));
    assert_eq!(get(&h, "x-ratelimit-remaining-tokens"), Some("10"));
    assert_eq!(get(&h, "x-ratelimit-reset-tokens"), Some("1m30s"));
    assert_eq!(get(&h, "retry-after"), Some("2"));
    assert_eq!(get(&h, "retry-after-ms"), Some("1250"));
}

#[test]
fn anthropic_headers_use_rfc3339_instants() {
    let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut h = HeaderMap::new();
    anthropic(&mut h, &admission(true, true), now);
    assert_eq!(get(&h, "anthropic-ratelimit-requests-limit"), Some("50"));
    assert_eq!(get(&h, "anthropic-ratelimit-requests-remaining"), Some("3"));
    // 2.499s later, rounded up to the next whole second.
    assert_eq!(
        get(&h, "anthropic-ratelimit-requests-reset"),
        Some("2023-11-14T22:13:23Z")
    );
    assert_eq!(
        get(&h, "anthropic-ratelimit-tokens-reset"),
        Some("2023-11-14T22:14:50Z")
    );
    assert_eq!(get(&h, "retry-after"), Some("2"));
    assert_eq!(get(&h, "retry-after-ms"), None);
    assert_eq!(get(&h, "x-ratelimit-limit-requests"), None);
}

#[test]
fn azure_headers_use_whole_seconds_and_x_ms_retry_after_ms() {
    let mut h = HeaderMap::new();
    azure(&mut h, &admission(false, true));
    assert_eq!(get(&h, "x-ratelimit-limit-requests"), Some("50"));
    assert_eq!(get(&h, "x-ratelimit-remaining-requests"), Some("3"));
    // 2.499001s rounded up.
    assert_eq!(get(&h, "x-ratelimit-reset-requests"), Some("3"));
    assert_eq!(get(&h, "x-ratelimit-limit-tokens"), Some("1000"));
    assert_eq!(get(&h, "x-ratelimit-reset-tokens"), Some("90"));
    assert_eq!(get(&h, "retry-after"), None);
    assert_eq!(get(&h, "x-ms-retry-after-ms"), None);

    let mut h = HeaderMap::new();
    azure(&mut h, &admission(true, false));
    assert_eq!(get(&h, "x-ratelimit-limit-tokens"), None);
    assert_eq!(get(&h, "retry-after"), Some("2"));
    assert_eq!(get(&h, "x-ms-retry-after-ms"), Some("1250"));
    assert_eq!(get(&h, "retry-after-ms"), None);
}
