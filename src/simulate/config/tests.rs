use super::*;
use clap::Parser;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: SimulateArgs,
}

fn parse(extra: &[&str]) -> Result<SimulateArgs, clap::Error> {
    let argv = std::iter::once("simulate").chain(extra.iter().copied());
    Cli::try_parse_from(argv).map(|c| c.args)
}

fn config(extra: &[&str]) -> Result<SimConfig, ConfigError> {
    parse(extra).expect("flags parse").into_config()
}

#[test]
fn defaults_match_sim_config_default() {
    assert_eq!(config(&[]).unwrap(), SimConfig::default());
}

#[test]
fn all_flags_parse() {
    let c = config(&[
        "--listen=0.0.0.0:9000",
        "--capacity=5",
        "--refill=2.5",
        "--tpm=1000",
        "--limit-report=per-minute",
        "--header-style=azure",
        "--queue-slots=4",
        "--service-time=5ms",
        "--service-jitter=1ms",
        "--refill-change=20s=1",
        "--refill-change=10s=0",
        "--fail-503=0.1",
        "--fail-503-window=5s+1s",
        "--fail-503-window=0s+150ms",
        "--fail-529=0.2",
        "--fail-reset=0.3",
        "--slow-first-byte=1s",
        "--slow-fraction=0.5",
        "--stream-chunks=3",
        "--stream-interval=1ms",
        "--overload-429=0.2",
        "--admission-refusals=3",
        "--model-limit=fast=50@20",
        "--model-limit=slow=10@4",
        "--requests-per-day=300",
        "--service-tail=pareto:1.5",
        "--seed=7",
    ])
    .unwrap();
    assert_eq!(c.capacity, 5);
    assert_eq!(c.refill, 2.5);
    assert_eq!(c.tpm, Some(1000));
    assert_eq!(c.limit_report, LimitReport::PerMinute);
    assert_eq!(c.header_style, HeaderStyle::Azure);
    assert_eq!(c.queue_slots, Some(4));
    assert_eq!(c.service_time, Duration::from_millis(5));
    // Sorted by `at`.
    assert_eq!(
        c.refill_changes,
        vec![
            RefillChange {
                at: Duration::from_secs(10),
                rate: 0.0
            },
            RefillChange {
                at: Duration::from_secs(20),
                rate: 1.0
            },
        ]
    );
    // Sorted by `at`.
    assert_eq!(
        c.fail_503_windows,
        vec![
            FailWindow {
                at: Duration::ZERO,
                duration: Duration::from_millis(150)
            },
            FailWindow {
                at: Duration::from_secs(5),
                duration: Duration::from_secs(1)
            },
        ]
    );
    assert_eq!(c.stream_chunks, 3);
    assert_eq!(c.overload_429, 0.2);
    assert_eq!(c.admission_refusals, 3);
    assert_eq!(
        c.model_limits,
        vec![
            ModelLimit {
                model: "fast".into(),
                capacity: 50,
                refill: 20.0
            },
            ModelLimit {
                model: "slow".into(),
                capacity: 10,
                refill: 4.0
            },
        ]
    );
    assert_eq!(c.requests_per_day, Some(300));
    assert_eq!(c.service_tail, Some(ServiceTail::Pareto { alpha: 1.5 }));
    assert_eq!(c.seed, Some(7));
}

#[test]
fn gemini_style_takes_an_array_share() {
    let c = config(&["--header-style=gemini", "--gemini-array=0.5"]).unwrap();
    assert_eq!((c.header_style, c.gemini_array), (HeaderStyle::Gemini, 0.5));
}

#[test]
fn model_limit_parses_names_with_an_equals_sign_and_names_the_format() {
    let limit = parse_model_limit("models/gemini=x = 5 @ 0.5").unwrap();
    assert_eq!(
        limit,
        ModelLimit {
            model: "models/gemini=x".into(),
            capacity: 5,
            refill: 0.5
        }
    );
    for bad in ["fast", "fast=50", "=50@20", "fast=many@20", "fast=50@quick"] {
        assert!(parse_model_limit(bad).is_err(), "{bad} should not parse");
    }
    let err = parse_model_limit("fast=50").unwrap_err();
    assert!(err.contains("MODEL=CAPACITY@REFILL"), "{err}");
}

#[test]
fn limit_report_values() {
    for (flag, want) in [
        ("capacity", LimitReport::Capacity),
        ("per-minute", LimitReport::PerMinute),
        ("quantized", LimitReport::Quantized),
    ] {
        let c = config(&[&format!("--limit-report={flag}")]).unwrap();
        assert_eq!(c.limit_report, want);
    }
}

#[test]
fn header_style_values() {
    for (flag, want) in [
        ("openai", HeaderStyle::OpenAi),
        ("azure", HeaderStyle::Azure),
        ("none", HeaderStyle::None),
        ("gemini", HeaderStyle::Gemini),
    ] {
        let c = config(&[&format!("--header-style={flag}")]).unwrap();
        assert_eq!(c.header_style, want);
    }
    assert!(parse(&["--header-style=open-ai"]).is_err());
}

#[test]
fn clap_rejects_malformed_values() {
    for bad in [
        "--service-time=fast",
        "--refill-change=10s",
        "--refill-change=soon=3",
        "--refill-change=10s=lots",
        "--fail-503-window=5s",
        "--fail-503-window=soon+1s",
        "--fail-503-window=5s+long",
        "--header-style=aws",
        "--model-limit=fast",
        "--service-tail=lognormal:1",
        "--admission-refusals=-1",
        "--requests-per-day=lots",
        "--queue-slots=-1",
        "--queue-slots=many",
        "--limit-report=hourly",
        "--capacity=-1",
        "--listen=localhost",
    ] {
        assert!(parse(&[bad]).is_err(), "{bad} should not parse");
    }
}

#[test]
fn refill_change_message_names_the_format() {
    let err = parse_refill_change("10s").unwrap_err();
    assert!(err.contains("AT=RATE"), "{err}");
}

#[test]
fn validation_rejects_nonsense() {
    let cases: &[(&[&str], ConfigError)] = &[
        (&["--capacity=0"], ConfigError::ZeroCapacity),
        (&["--tpm=0"], ConfigError::ZeroTpm),
        (
            &["--refill=-1"],
            ConfigError::BadRate {
                flag: "refill",
                value: -1.0,
            },
        ),
        (
            &["--refill=inf"],
            ConfigError::BadRate {
                flag: "refill",
                value: f64::INFINITY,
            },
        ),
        (
            &["--refill-change=1s=-2"],
            ConfigError::BadRate {
                flag: "refill-change",
                value: -2.0,
            },
        ),
        (
            &["--fail-503=1.5"],
            ConfigError::BadFraction {
                flag: "fail-503",
                value: 1.5,
            },
        ),
        (
            &["--slow-fraction=-0.1"],
            ConfigError::BadFraction {
                flag: "slow-fraction",
                value: -0.1,
            },
        ),
        (
            &["--fail-503=0.6", "--fail-529=0.6"],
            ConfigError::FaultsOverOne { sum: 1.2 },
        ),
        (&["--stream-chunks=0"], ConfigError::ZeroChunks),
        (&["--queue-slots=0"], ConfigError::ZeroQueueSlots),
        (
            &["--overload-429=1.5"],
            ConfigError::BadFraction {
                flag: "overload-429",
                value: 1.5,
            },
        ),
        (
            &["--header-style=gemini", "--gemini-array=-0.5"],
            ConfigError::BadFraction {
                flag: "gemini-array",
                value: -0.5,
            },
        ),
        (
            &["--gemini-array=0.5"],
            ConfigError::GeminiArrayWithoutGemini,
        ),
        (
            &["--model-limit=fast=0@20"],
            ConfigError::ZeroModelCapacity {
                model: "fast".into(),
            },
        ),
        (
            &["--model-limit=fast=5@-1"],
            ConfigError::BadRate {
                flag: "model-limit",
                value: -1.0,
            },
        ),
        (
            &["--model-limit=fast=5@1", "--model-limit=fast=9@2"],
            ConfigError::DuplicateModel {
                model: "fast".into(),
            },
        ),
        (&["--requests-per-day=0"], ConfigError::ZeroRequestsPerDay),
        (
            &["--service-tail=pareto:0"],
            ConfigError::BadTail { alpha: 0.0 },
        ),
        (
            &["--fail-503-window=0s+1s", "--fail-503-window=2s+0s"],
            ConfigError::EmptyFailWindow {
                at: Duration::from_secs(2),
            },
        ),
    ];
    for (flags, want) in cases {
        assert_eq!(&config(flags).unwrap_err(), want, "{flags:?}");
    }
}

#[test]
fn error_messages_name_the_flag() {
    let err = config(&["--fail-529=2"]).unwrap_err().to_string();
    assert_eq!(err, "`--fail-529` must be a fraction in 0..=1, got 2");
    let err = config(&["--fail-503-window=5s+0ms"])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "`--fail-503-window` must last longer than 0, got `5s+0s`"
    );
}

#[test]
fn fail_window_parses_and_is_half_open() {
    let w = parse_fail_window("5s + 1s").unwrap();
    let ms = Duration::from_millis;
    assert_eq!(
        w,
        FailWindow {
            at: ms(5000),
            duration: ms(1000)
        }
    );
    assert!(!w.contains(ms(4999)));
    assert!(w.contains(ms(5000)));
    assert!(w.contains(ms(5999)));
    assert!(!w.contains(ms(6000)));
    let err = parse_fail_window("5s").unwrap_err();
    assert!(err.contains("AT+DURATION"), "{err}");
}
