use std::collections::BTreeMap;

use http::Method;

use super::*;
use crate::body::TimeoutKind;

/// The `model` label takes only what the config names: a limit group, or a model that maps
/// to one; anything else is `other`, no model `none`. Each gets its own pacing series.
#[test]
fn pacing_series_carry_the_models_the_config_names() {
    let groups: BTreeMap<String, String> = [("gpt-4o-2024-08-06", "gpt-4o"), ("o3", "o3")]
        .into_iter()
        .map(|(m, g)| (m.to_owned(), g.to_owned()))
        .collect();
    assert_eq!(model_label(Some("gpt-4o"), &groups), "gpt-4o");
    assert_eq!(model_label(Some("o3"), &groups), "o3");
    assert_eq!(
        model_label(Some("gpt-4o-2024-08-06"), &groups),
        "gpt-4o-2024-08-06"
    );
    assert_eq!(model_label(Some("my-fine-tune-123"), &groups), OTHER_MODEL);
    assert_eq!(model_label(None, &groups), NO_MODEL);

    let m = Metrics::new();
    let up = m.upstream("openai");
    up.pacing("gpt-4o").learned("requests", 50.0, 100.0);
    up.pacing(OTHER_MODEL).learned("requests", 5.0, 10.0);
    let text = m.render();
    for line in [
        r#"corral_learned_rate_per_second{kind="requests",model="gpt-4o",upstream="openai"} 50"#,
        r#"corral_learned_rate_per_second{kind="requests",model="other",upstream="openai"} 5"#,
        r#"corral_learned_rate_per_second{kind="requests",model="none",upstream="openai"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
    }
}

#[test]
fn renders_registered_families_with_bound_labels() {
    let m = Metrics::new();
    let up = m.upstream("openai");
    up.request(&Method::POST, 200);
    up.request(&Method::from_bytes(b"BREW").unwrap(), 405);
    up.in_flight.inc();
    let text = m.render();
    assert!(
        text.contains(r#"corral_requests_total{code="200",method="POST",upstream="openai"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"corral_in_flight_requests{upstream="openai"} 1"#));
    assert!(
        text.contains(r#"method="other""#) && !text.contains("BREW"),
        "{text}"
    );
    assert!(text.contains(r#"corral_stream_timeouts_total{kind="idle",upstream="openai"} 0"#));
}

#[test]
fn a_fresh_registry_has_a_zero_series_for_every_known_label_value() {
    let m = Metrics::new();
    m.upstream("openai");
    let text = m.render();
    for line in [
        r#"corral_upstream_attempts_total{outcome="529",upstream="openai"} 0"#,
        r#"corral_retries_total{reason="should_retry",upstream="openai"} 0"#,
        r#"corral_retry_gave_up_total{upstream="openai",why="budget"} 0"#,
        r#"corral_breaker_transitions_total{to="half_open",upstream="openai"} 0"#,
        r#"corral_upstream_throttled_total{code="429",upstream="openai"} 0"#,
        r#"corral_client_throttled_total{source="corral",upstream="openai"} 0"#,
        r#"corral_errors_total{cause="internal",upstream="openai"} 0"#,
        r#"corral_errors_total{cause="no_route",upstream="(none)"} 0"#,
        r#"corral_requests_total{code="200",method="POST",upstream="openai"} 0"#,
        r#"corral_panics_total{upstream="openai"} 0"#,
        "corral_log_lines_dropped_total 0",
    ] {
        assert!(text.contains(line), "no `{line}` in\n{text}");
    }
}

/// Every outcome and every corral answer has its zero series. The matches are exhaustive:
/// a new variant does not compile here until it is given a sample (and its label a place
/// in [`OUTCOMES`] or [`CAUSES`]).
#[test]
fn known_label_values_cover_every_outcome_and_cause() {
    use crate::classify::Outcome;
    use crate::error::ProxyError;
    use std::time::Duration;

    let outcomes = [
        Outcome::Success,
        Outcome::Throttled(429),
        Outcome::Overloaded(529),
        Outcome::ServerError(500),
        Outcome::ServerError(501),
        Outcome::ServerError(502),
        Outcome::ServerError(503),
        Outcome::ServerError(504),
        Outcome::ClientError(400),
        Outcome::Timeout,
        Outcome::Transport,
        Outcome::Local,
    ];
    for outcome in outcomes {
        match outcome {
            Outcome::Success
            | Outcome::Throttled(_)
            | Outcome::Overloaded(_)
            | Outcome::ServerError(_)
            | Outcome::ClientError(_)
            | Outcome::Timeout
            | Outcome::Transport
            | Outcome::Local => assert!(OUTCOMES.contains(&outcome.label()), "{outcome:?}"),
        }
    }
    let s = String::new;
    let d = Duration::ZERO;
    let causes = [
        ProxyError::NoRoute(s()),
        ProxyError::BadPath(s()),
        ProxyError::BadPriority,
        ProxyError::BodyTimeout(TimeoutKind::Idle),
        ProxyError::BufferFull {
            cap: 1,
            retry_after: d,
        },
        ProxyError::AbsoluteForm,
        ProxyError::Connect,
        ProxyError::MethodNotAllowed {
            method: "TRACE".into(),
            allow: "GET, HEAD",
        },
        ProxyError::BodyTooLarge { limit: 0 },
        ProxyError::BodyRead(s()),
        ProxyError::UpstreamConnect {
            upstream: s(),
            reason: s(),
        },
        ProxyError::UpstreamReset {
            upstream: s(),
            reason: s(),
        },
        ProxyError::TryTimeout {
            upstream: s(),
            timeout: d,
        },
        ProxyError::DeadlineExceeded,
        ProxyError::QueueFull {
            upstream: s(),
            retry_after: d,
        },
        ProxyError::QueueTimeout {
            upstream: s(),
            waited: d,
            retry_after: d,
        },
        ProxyError::RateLimited {
            upstream: s(),
            retry_after: d,
        },
        ProxyError::CircuitOpen {
            upstream: s(),
            retry_after: d,
        },
        ProxyError::Internal(s()),
    ];
    for e in &causes {
        match e {
            ProxyError::NoRoute(_)
            | ProxyError::BadPath(_)
            | ProxyError::BadPriority
            | ProxyError::BodyTimeout(_)
            | ProxyError::BufferFull { .. }
            | ProxyError::AbsoluteForm
            | ProxyError::Connect
            | ProxyError::MethodNotAllowed { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyRead(_)
            | ProxyError::UpstreamConnect { .. }
            | ProxyError::UpstreamReset { .. }
            | ProxyError::TryTimeout { .. }
            | ProxyError::DeadlineExceeded
            | ProxyError::QueueFull { .. }
            | ProxyError::QueueTimeout { .. }
            | ProxyError::RateLimited { .. }
            | ProxyError::CircuitOpen { .. }
            | ProxyError::Internal(_) => assert!(CAUSES.contains(&e.label()), "{e:?}"),
        }
    }
    assert_eq!(causes.len(), CAUSES.len(), "one sample per cause");
}
