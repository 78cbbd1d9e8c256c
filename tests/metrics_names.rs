//! corral's `/metrics` after real traffic: `promtool check metrics` accepts it, the names and
//! labels follow Prometheus' conventions, and every metric the Grafana dashboard
//! (`deploy/grafana/corral.json`) queries is in it.
//!
//! One scrape serves every test: corral runs in-process in front of three `corral simulate`
//! upstreams, and the traffic touches each labelled family (a vector with no child is absent
//! from the text format): a 429 storm that corral retries, 529s that open a breaker which then
//! rejects, a queue that overflows, a 429 passed through, an unrouted path, a client retry.
//! A second scrape, of a corral that has served nothing, shows every family the dashboard
//! queries already there, its known label values at zero.
//! promtool is Debian's `prometheus` package (`.ci/run` installs it); without it the promtool
//! test fails with a message, unless `CORRAL_SKIP_PROMTOOL=1`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use corral::simulate::{SimConfig, Simulator};
use http::Request;
use http_body_util::Full;
use support::*;

/// Label names corral may use; each has a bounded set of values.
const LABELS: &[&str] = &[
    "upstream", "method", "code", "outcome", "reason", "why", "to", "source", "kind", "cause",
    "mode", "model",
];
/// Upstream names in the scrape's config, plus the label of requests that matched no route.
const UPSTREAMS: &[&str] = &["openai", "flaky", "strict", "(none)"];

// ===== the scrape =====

/// The text of `GET /metrics` after the traffic described in the module doc, made once.
fn scrape() -> &'static str {
    static SCRAPE: OnceLock<String> = OnceLock::new();
    SCRAPE.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(async { tokio::time::timeout(Duration::from_secs(30), traffic()).await })
            .expect("the traffic finished within 30 s")
    })
}

async fn simulator(config: SimConfig) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(Simulator::new(config).serve(listener, std::future::pending()));
    addr
}

async fn traffic() -> String {
    let quick = |capacity, refill| SimConfig {
        capacity,
        refill,
        service_time: Duration::from_millis(5),
        stream_chunks: 3,
        stream_interval: Duration::from_millis(2),
        seed: Some(6),
        ..SimConfig::default()
    };
    let storm = simulator(quick(5, 50.0)).await;
    let overloaded = simulator(SimConfig {
        fail_529: 1.0,
        ..quick(1000, 1000.0)
    })
    .await;
    let stingy = simulator(SimConfig {
        service_time: Duration::from_millis(100),
        ..quick(1, 0.1)
    })
    .await;
    let corral = Corral::start(&format!(
        r#"
[[upstream]]
name = "openai"
route = "/v1"
base_url = "http://{storm}/v1"
[upstream.retry]
base = "10ms"
cap = "200ms"
floor_jitter = "10ms"

[[upstream]]
name = "flaky"
route = "/flaky"
base_url = "http://{overloaded}/v1"
[upstream.retry]
max_retries = 1
base = "5ms"
cap = "10ms"
floor_jitter = "1ms"
[upstream.breaker]
window = 10
min_samples = 4
open_error_rate = 0.5
cooldown = "10s"
min_span = "0s"
on_open = "reject"

[[upstream]]
name = "strict"
route = "/strict"
base_url = "http://{stingy}/v1"
rate_limit = "off"
[upstream.limits]
max_concurrency = 1
queue_size = 1
[upstream.retry]
max_retries = 0
max_throttle_retries = 0
"#
    ))
    .await;
    let client = Arc::new(client());
    let chat = |stream: bool| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":8,"stream":{stream}}}"#
        )
    };
    let fire = |path: &str, n: usize| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let client = Arc::clone(&client);
                let (url, body) = (corral.url(path), chat(i % 3 == 0));
                tokio::spawn(async move { send(&client, post(&url, &body)).await.0.status })
            })
            .collect();
        async move {
            let mut statuses = Vec::new();
            for h in handles {
                statuses.push(h.await.unwrap().as_u16());
            }
            statuses
        }
    };
    // A storm that corral absorbs with retries, and a queue that overflows, at once.
    let (storm_statuses, strict_statuses) = tokio::join!(
        fire("/v1/chat/completions", 30),
        fire("/strict/chat/completions", 8)
    );
    assert!(
        storm_statuses.iter().all(|s| *s == 200),
        "corral absorbed the storm: {storm_statuses:?}"
    );
    assert!(
        strict_statuses.contains(&429),
        "the strict upstream refused some: {strict_statuses:?}"
    );
    // 529s until the breaker opens and rejects: the last answers are corral's own 503s.
    let mut flaky = Vec::new();
    for _ in 0..8 {
        let url = corral.url("/flaky/chat/completions");
        let (parts, _) = send(&client, post(&url, &chat(false))).await;
        let corrals = parts
            .headers
            .contains_key(corral::error::CORRAL_ERROR_HEADER);
        flaky.push((parts.status.as_u16(), corrals));
    }
    assert_eq!(
        flaky.last(),
        Some(&(503, true)),
        "the 529s did not open the breaker: {flaky:?}"
    );
    // The stingy upstream's 429 (passed through above: no throttle retries there) paused its
    // partition for about 10 s: a request whose deadline ends sooner gets corral's own 429.
    let paused = Request::post(corral.url("/strict/chat/completions"))
        .header("content-type", "application/json")
        .header("x-corral-deadline-ms", "500")
        .body(Full::new(Bytes::from(chat(false))))
        .unwrap();
    let (parts, _) = send(&client, paused).await;
    assert_eq!(parts.status, 429, "refused while the partition is paused");
    assert!(parts.headers.contains_key("x-corral-error"));
    // A client that retries on its own, and a path no upstream serves.
    let retried = Request::post(corral.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-stainless-retry-count", "1")
        .body(Full::new(Bytes::from(chat(false))))
        .unwrap();
    send(&client, retried).await;
    let unrouted = Request::get(corral.url("/nowhere"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    send(&client, unrouted).await;

    let metrics = Request::get(corral.url("/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (parts, body) = send(&client, metrics).await;
    assert_eq!(parts.status, 200);
    String::from_utf8(body.to_vec()).expect("metrics are UTF-8")
}

/// The text of `GET /metrics` from a corral that has served nothing yet.
fn fresh_scrape() -> &'static str {
    static SCRAPE: OnceLock<String> = OnceLock::new();
    SCRAPE.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(async {
                let corral = Corral::start(
                    "[[upstream]]\nname = \"openai\"\nroute = \"/v1\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
                )
                .await;
                let metrics = Request::get(corral.url("/metrics"))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                let (parts, body) = send(&client(), metrics).await;
                assert_eq!(parts.status, 200);
                String::from_utf8(body.to_vec()).expect("metrics are UTF-8")
            })
    })
}

// ===== the text format =====

/// One family: its `# TYPE`, and the label names and sample names seen.
#[derive(Debug, Default)]
struct Family {
    kind: String,
    help: bool,
    labels: BTreeSet<String>,
    samples: BTreeSet<String>,
}

/// Families by name, from `# HELP`, `# TYPE` and sample lines.
fn families(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            out.entry(name.into()).or_default().kind = kind.into();
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default();
            out.entry(name.into()).or_default().help = true;
        } else if !line.is_empty() && !line.starts_with('#') {
            let name_end = line.find(['{', ' ']).expect("sample line");
            let sample = &line[..name_end];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| {
                    let base = sample.strip_suffix(s)?;
                    out.get(base)
                        .filter(|f| f.kind == "histogram")
                        .map(|_| base)
                })
                .unwrap_or(sample)
                .to_owned();
            let entry = out.entry(family).or_default();
            entry.samples.insert(sample.into());
            for (label, value) in sample_labels(line) {
                entry.labels.insert(label.clone());
                if label == "upstream" {
                    assert!(
                        UPSTREAMS.contains(&value.as_str()),
                        "upstream label value {value:?} is not a configured upstream: {line}"
                    );
                }
            }
        }
    }
    out
}

/// `name{a="x",b="y"} 1` -> [(a, x), (b, y)].
fn sample_labels(line: &str) -> Vec<(String, String)> {
    let Some(open) = line.find('{') else {
        return Vec::new();
    };
    let close = line.rfind('}').expect("closing brace");
    let mut out = Vec::new();
    let mut rest = &line[open + 1..close];
    while let Some((name, after)) = rest.split_once("=\"") {
        let end = after.find('"').expect("closing quote");
        out.push((name.trim_start_matches(',').to_owned(), after[..end].into()));
        rest = &after[end + 1..];
    }
    out
}

// ===== tests =====

/// Runs `promtool ARGS` with `stdin`; `None` when promtool is missing and
/// `CORRAL_SKIP_PROMTOOL=1`. Returns whether it succeeded and what it printed.
fn promtool(args: &[&str], stdin: &str) -> Option<(bool, String)> {
    let promtool = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let child = Command::new(&promtool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(_) if std::env::var("CORRAL_SKIP_PROMTOOL").as_deref() == Ok("1") => {
            support::skip(
                "promtool check metrics",
                &format!("CORRAL_SKIP_PROMTOOL=1 and no `{promtool}`"),
            );
            return None;
        }
        Err(e) => panic!(
            "cannot run `{promtool}` ({e}): install Debian's `prometheus` package \
             (`bash .ci/run` does), set PROMTOOL to its path, or CORRAL_SKIP_PROMTOOL=1 to skip"
        ),
    };
    {
        use std::io::Write as _;
        let mut pipe = child.stdin.take().expect("piped stdin");
        pipe.write_all(stdin.as_bytes()).expect("write to promtool");
    }
    let out = child.wait_with_output().expect("promtool ran");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), report))
}

#[test]
fn promtool_accepts_a_live_scrape() {
    let text = scrape();
    let Some((ok, report)) = promtool(&["check", "metrics"], text) else {
        return;
    };
    // Lint findings (a counter without `_total`, a non-base unit, ...) fail it too.
    assert!(
        ok && report.trim().is_empty(),
        "promtool check metrics:\n{report}\n--- scrape ---\n{text}"
    );
}

/// Dashboard panels show data, zeros, from the first scrape: every labelled family has a
/// series for each value it can take before any request.
#[test]
fn a_fresh_corral_exports_every_dashboard_family_with_zeros() {
    let text = fresh_scrape();
    if let Some((ok, report)) = promtool(&["check", "metrics"], text) {
        assert!(
            ok && report.trim().is_empty(),
            "promtool check metrics:\n{report}\n--- scrape ---\n{text}"
        );
    }
    let families = families(text);
    for (title, expr) in dashboard() {
        for metric in promql::parse(&expr).metrics {
            let family = metric.strip_suffix("_bucket").unwrap_or(&metric).to_owned();
            assert!(
                families.get(&family).is_some_and(|f| !f.samples.is_empty()),
                "panel `{title}`: no `{metric}` series before any traffic:\n{text}"
            );
        }
    }
    for zero in [
        r#"corral_requests_total{code="200",method="POST",upstream="openai"} 0"#,
        r#"corral_upstream_attempts_total{outcome="429",upstream="openai"} 0"#,
        r#"corral_upstream_throttled_total{code="529",upstream="openai"} 0"#,
        r#"corral_client_throttled_total{source="corral",upstream="openai"} 0"#,
        r#"corral_retries_total{reason="503",upstream="openai"} 0"#,
        r#"corral_retry_gave_up_total{upstream="openai",why="deadline"} 0"#,
        r#"corral_breaker_transitions_total{to="open",upstream="openai"} 0"#,
        r#"corral_errors_total{cause="queue_full",upstream="openai"} 0"#,
        r#"corral_errors_total{cause="no_route",upstream="(none)"} 0"#,
        r#"corral_limit_source{kind="tokens",model="none",source="none",upstream="openai"} 0"#,
        r#"corral_panics_total{upstream="openai"} 0"#,
        "corral_log_lines_dropped_total 0",
    ] {
        assert!(
            text.lines().any(|l| l == zero),
            "no `{zero}` before any traffic:\n{text}"
        );
    }
}

#[test]
fn names_units_and_labels_follow_prometheus_conventions() {
    let families = families(scrape());
    assert!(families.len() >= 25, "{:?}", families.keys());
    for (name, f) in &families {
        assert!(name.starts_with("corral_"), "{name}: no corral_ prefix");
        assert!(f.help, "{name}: no # HELP");
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{name}: snake_case ASCII"
        );
        match f.kind.as_str() {
            "counter" => assert!(name.ends_with("_total"), "{name}: counter without _total"),
            "histogram" => assert!(
                name.ends_with("_seconds") || name.ends_with("_bytes"),
                "{name}: histogram not in seconds or bytes"
            ),
            "gauge" => assert!(!name.ends_with("_total"), "{name}: gauge named _total"),
            other => panic!("{name}: unexpected type {other}"),
        }
        for unit in [
            "_ms",
            "_millis",
            "_milliseconds",
            "_sec",
            "_minutes",
            "_kb",
            "_mb",
        ] {
            assert!(
                !name.contains(&format!("{unit}_")) && !name.ends_with(unit),
                "{name}: not a base unit ({unit})"
            );
        }
        for label in &f.labels {
            assert!(
                LABELS.contains(&label.as_str()) || (label == "le" && f.kind == "histogram"),
                "{name}: label `{label}` is not one of corral's bounded labels {LABELS:?}"
            );
        }
    }
    // The families the traffic was meant to touch are all there.
    for name in [
        "corral_requests_total",
        "corral_retries_total",
        "corral_retry_gave_up_total",
        "corral_breaker_transitions_total",
        "corral_upstream_throttled_total",
        "corral_client_throttled_total",
        "corral_upstream_attempts_total",
        "corral_errors_total",
        "corral_learned_rate_per_second",
    ] {
        assert!(families.contains_key(name), "{name} missing after traffic");
    }
    let throttled = &families["corral_client_throttled_total"].samples;
    assert!(!throttled.is_empty());
    let text = scrape();
    for source in ["corral", "upstream"] {
        assert!(
            text.contains(&format!("source=\"{source}\"")),
            "corral_client_throttled_total{{source=\"{source}\"}} missing"
        );
    }
}

#[test]
fn every_metric_the_dashboard_queries_is_exported() {
    let families = families(scrape());
    let queries = dashboard();
    assert!(queries.len() >= 15, "few queries: {queries:?}");
    let mut used = BTreeSet::new();
    for (title, expr) in &queries {
        let parsed = promql::parse(expr);
        assert!(
            !parsed.metrics.is_empty(),
            "panel `{title}`: no metric in `{expr}`"
        );
        let mut labels_here = BTreeSet::new();
        for metric in &parsed.metrics {
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| metric.strip_suffix(s))
                .filter(|base| families.get(*base).is_some_and(|f| f.kind == "histogram"))
                .unwrap_or(metric);
            let Some(f) = families.get(family) else {
                panic!(
                    "panel `{title}` queries `{metric}`, which /metrics does not export\n\
                     exported: {:?}",
                    families.keys()
                )
            };
            if family != metric.as_str() {
                assert!(f.samples.contains(metric), "{metric}: not a sample name");
            }
            used.insert(family.to_owned());
            labels_here.extend(f.labels.iter().cloned());
        }
        for label in &parsed.labels {
            let target = ["instance", "job", "namespace", "pod"].contains(&label.as_str());
            assert!(
                labels_here.contains(label) || label == "le" || target,
                "panel `{title}`: label `{label}` is on none of the metrics in `{expr}`"
            );
        }
    }
    // The issue's list: traffic, 429s both ways, retries and reasons, backoff, queue wait,
    // breaker, bucket waits and tokens, latency.
    for needed in [
        "corral_requests_total",
        "corral_upstream_throttled_total",
        "corral_client_throttled_total",
        "corral_retries_total",
        "corral_retry_backoff_seconds",
        "corral_queue_wait_seconds",
        "corral_breaker_state",
        "corral_rate_limit_wait_seconds",
        "corral_tokens_charged_total",
        "corral_request_duration_seconds",
        "corral_upstream_duration_seconds",
    ] {
        assert!(
            used.contains(needed),
            "the dashboard never queries {needed}"
        );
    }
}

#[test]
fn dashboard_queries_are_valid_promql() {
    let queries = dashboard();
    // Each panel query as a recording rule, Grafana's variables filled in, for promtool's parser.
    let mut rules = String::from("groups:\n  - name: corral-dashboard\n    rules:\n");
    for (i, (_, expr)) in queries.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$upstream", ".*");
        let quoted = serde_json::to_string(&expr).expect("a string serializes");
        rules += &format!("      - record: corral_dashboard:query{i}\n        expr: {quoted}\n");
    }
    let dir = std::env::temp_dir().join(format!("corral-rules-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("dashboard.rules.yml");
    std::fs::write(&path, &rules).expect("write rules");
    let result = promtool(&["check", "rules", path.to_str().expect("utf-8 path")], "");
    let _ = std::fs::remove_dir_all(&dir);
    let Some((ok, report)) = result else { return };
    assert!(
        ok,
        "promtool check rules on the dashboard's queries:\n{report}\n{rules}"
    );
}

/// `(panel title, expr)` for every query in `deploy/grafana/corral.json`.
fn dashboard() -> Vec<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/corral.json");
    let text = std::fs::read_to_string(path).expect("read the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    promql::dashboard_queries(&dashboard)
}

/// Just enough PromQL to find the metric and label names in Grafana queries.
mod promql {
    use std::collections::BTreeSet;

    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "and",
        "or",
        "unless",
        "inf",
        "nan",
    ];
    /// Aggregation operators, which may be followed by `by (...)` rather than `(`.
    const AGGREGATIONS: &[&str] = &[
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];

    #[derive(Debug, Default)]
    pub struct Parsed {
        pub metrics: BTreeSet<String>,
        pub labels: BTreeSet<String>,
    }

    /// `(panel title, expr)` for every target of every panel (rows' panels included) and every
    /// query variable.
    pub fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<(String, String)> {
        let mut out = Vec::new();
        fn panels(list: &serde_json::Value, out: &mut Vec<(String, String)>) {
            for panel in list.as_array().into_iter().flatten() {
                let title = panel["title"].as_str().unwrap_or("(untitled)");
                for target in panel["targets"].as_array().into_iter().flatten() {
                    let expr = target["expr"].as_str().unwrap_or_default();
                    assert!(!expr.is_empty(), "panel `{title}`: a target with no expr");
                    out.push((title.to_owned(), expr.to_owned()));
                }
                panels(&panel["panels"], out);
            }
        }
        panels(&dashboard["panels"], &mut out);
        for var in dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if var["type"] == "query" {
                let query = match &var["query"] {
                    serde_json::Value::String(s) => s.clone(),
                    q => q["query"].as_str().unwrap_or_default().to_owned(),
                };
                let name = var["name"].as_str().unwrap_or_default();
                out.push((format!("variable ${name}"), label_values(&query)));
            }
        }
        out
    }

    /// Grafana's `label_values(metric, label)` as the PromQL `metric` with `by (label)`.
    fn label_values(query: &str) -> String {
        let inner = query
            .trim()
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("unsupported variable query `{query}`"));
        let (metric, label) = inner.rsplit_once(',').expect("label_values(metric, label)");
        format!("count by ({}) ({})", label.trim(), metric.trim())
    }

    /// The metric names and label names an expression mentions. Panics on what it cannot read.
    pub fn parse(expr: &str) -> Parsed {
        let mut parsed = Parsed::default();
        let chars: Vec<char> = expr.chars().collect();
        let mut i = 0;
        let mut label_list = false;
        while i < chars.len() {
            let c = chars[i];
            if c == '"' || c == '\'' || c == '`' {
                i = skip_string(&chars, i);
            } else if c == '[' {
                i += chars[i..]
                    .iter()
                    .position(|&c| c == ']')
                    .expect("closing ]")
                    + 1;
            } else if c == '{' {
                let end = i + chars[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .expect("closing }");
                matchers(&chars[i + 1..end], &mut parsed.labels);
                i = end + 1;
            } else if c == '$' {
                // A Grafana variable: $name, ${name}, $__rate_interval.
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || "_{}:".contains(chars[i])) {
                    i += 1;
                }
            } else if c.is_ascii_digit()
                || (c == '.' && chars.get(i + 1).is_some_and(|d| d.is_ascii_digit()))
            {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i]))
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().find(|c| !c.is_whitespace()).copied();
                if label_list {
                    parsed.labels.insert(word);
                } else if KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                    if [
                        "by",
                        "without",
                        "on",
                        "ignoring",
                        "group_left",
                        "group_right",
                    ]
                    .contains(&word.as_str())
                        && next == Some('(')
                    {
                        label_list = true;
                    }
                } else if next != Some('(') && !AGGREGATIONS.contains(&word.as_str()) {
                    parsed.metrics.insert(word);
                }
            } else {
                if c == ')' {
                    label_list = false;
                }
                i += 1;
            }
        }
        parsed
    }

    fn skip_string(chars: &[char], start: usize) -> usize {
        let quote = chars[start];
        let mut i = start + 1;
        while i < chars.len() && chars[i] != quote {
            if chars[i] == '\\' {
                i += 1;
            }
            i += 1;
        }
        assert!(i < chars.len(), "unterminated string in PromQL");
        i + 1
    }

    /// `a="x", b=~"y"` -> a, b (and `__name__` matchers are not supported).
    fn matchers(chars: &[char], labels: &mut BTreeSet<String>) {
        let text: String = chars.iter().collect();
        let mut i = 0;
        let bytes: Vec<char> = text.chars().collect();
        while i < bytes.len() {
            while i < bytes.len() && (bytes[i].is_whitespace() || bytes[i] == ',') {
                i += 1;
            }
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_') {
                i += 1;
            }
            if start == i {
                break;
            }
            let name: String = bytes[start..i].iter().collect();
            assert_ne!(name, "__name__", "__name__ matchers are not supported");
            labels.insert(name);
            while i < bytes.len() && !['"', '\'', '`'].contains(&bytes[i]) {
                i += 1;
            }
            assert!(i < bytes.len(), "matcher without a value in {{{text}}}");
            i = skip_string(&bytes, i);
        }
    }

    #[test]
    fn reads_metrics_and_labels() {
        let p = parse(
            r#"histogram_quantile(0.99, sum by (le, upstream) (rate(corral_x_seconds_bucket{upstream=~"$upstream", code!="2.."}[$__rate_interval]))) / ignoring(kind) corral_y offset 5m"#,
        );
        let metrics: Vec<_> = p.metrics.iter().map(String::as_str).collect();
        assert_eq!(metrics, ["corral_x_seconds_bucket", "corral_y"]);
        let labels: Vec<_> = p.labels.iter().map(String::as_str).collect();
        assert_eq!(labels, ["code", "kind", "le", "upstream"]);
        assert_eq!(
            label_values("label_values(corral_requests_total, upstream)"),
            "count by (upstream) (corral_requests_total)"
        );
    }
}
