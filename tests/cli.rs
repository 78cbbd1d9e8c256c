//! The real `corral` binary: `check-config` accepts the example and rejects each mistake with
//! `file:line: key: reason`; the `--upstream` quick start and the env overrides serve; SIGTERM
//! drains in-flight requests and exits 0; no credential ever reaches the logs; the access log
//! writes the lines `access_log` asks for, and follows a reload.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use support::binary::{corral_command, Running};
use support::*;

/// A file in the temp dir, removed on drop.
struct TempConfig(std::path::PathBuf);

impl TempConfig {
    fn new(name: &str, text: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("corral-cli-{}-{n}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).expect("write temp config");
        Self(path)
    }
    fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

// ===== check-config =====

/// A valid config; each rejection test changes one line of it.
const SAMPLE: &str = r#"listen = "127.0.0.1:0"
drain_timeout = "5s"

[[upstream]]
name = "openai"
route = "/v1"
base_url = "https://api.openai.com/v1"

[upstream.headers]
Authorization = "Bearer ${CORRAL_CLI_TEST_KEY}"

[upstream.retry]
base = "500ms"
cap = "30s"

[[upstream]]
name = "local"
route = "/local"
base_url = "http://127.0.0.1:8000/v1"
"#;

/// Run `corral check-config` on `text` with one line replaced; (exit code, stdout, stderr, path).
async fn check(name: &str, from: &str, to: &str, key_set: bool) -> (i32, String, String, String) {
    assert!(SAMPLE.contains(from), "sample has no `{from}`");
    let file = TempConfig::new(name, &SAMPLE.replacen(from, to, 1));
    let mut cmd = corral_command(["check-config", file.path()]);
    if key_set {
        cmd.env("CORRAL_CLI_TEST_KEY", "sk-cli-sample");
    } else {
        cmd.env_remove("CORRAL_CLI_TEST_KEY");
    }
    let out = cmd.output().await.expect("run corral check-config");
    let text = |b: Vec<u8>| String::from_utf8(b).expect("utf-8 output");
    (
        out.status.code().expect("exited"),
        text(out.stdout),
        text(out.stderr).trim_end().to_owned(),
        file.path().to_owned(),
    )
}

#[tokio::test]
async fn check_config_accepts_the_example_config() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/config/corral.toml");
    let out = corral_command(["check-config", path])
        .env("OPENAI_API_KEY", "sk-example-openai")
        .env("ANTHROPIC_API_KEY", "sk-ant-example")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    for needle in [
        r#"name = "openai""#,
        r#"name = "anthropic""#,
        r#"name = "vllm""#,
        r#"concurrency = "auto""#,
        r#"Authorization = "*****""#,
    ] {
        assert!(stdout.contains(needle), "missing {needle} in\n{stdout}");
    }
    assert!(!stdout.contains("sk-example-openai") && !stdout.contains("sk-ant-example"));
}

#[tokio::test]
async fn check_config_prints_the_sample_with_defaults_and_hides_secrets() {
    let (code, stdout, stderr, _) = check("valid", "", "", true).await;
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(stdout.contains("max_retries = 6"), "{stdout}");
    assert!(!stdout.contains("sk-cli-sample"), "{stdout}");
}

#[tokio::test]
async fn check_config_rejects_an_unknown_key() {
    let (code, _, stderr, path) = check("unknown", "cap = \"30s\"", "retries = 3", true).await;
    assert_eq!(code, 2);
    let want = format!(
        "{path}:14: upstream.retry.retries: unknown field `retries`, expected one of `max_retries`"
    );
    assert!(stderr.starts_with(&want), "{stderr}");
}

#[tokio::test]
async fn check_config_rejects_a_bad_url() {
    let (code, _, stderr, path) = check(
        "url",
        "https://api.openai.com/v1",
        "ftp://api.openai.com/v1",
        true,
    )
    .await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:7: upstream.base_url: URL `ftp://api.openai.com/v1` has scheme `ftp`; use http or https")
    );
}

#[tokio::test]
async fn check_config_rejects_a_bad_duration() {
    let (code, _, stderr, path) = check("duration", "\"30s\"", "\"30 parsecs\"", true).await;
    assert_eq!(code, 2);
    let want = format!("{path}:14: upstream.retry.cap: invalid duration `30 parsecs`");
    assert!(stderr.starts_with(&want), "{stderr}");
    assert!(
        stderr.ends_with(r#"write e.g. "500ms" or "30s""#),
        "{stderr}"
    );
}

#[tokio::test]
async fn check_config_rejects_a_duplicate_route() {
    let (code, _, stderr, path) = check("route", "\"/local\"", "\"/v1\"", true).await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!(
            "{path}:18: upstream[1].route: duplicate route `/v1` (also used by upstream `openai`)"
        )
    );
}

#[tokio::test]
async fn check_config_rejects_a_missing_env_var() {
    let (code, stdout, stderr, path) = check("env", "", "", false).await;
    assert_eq!(code, 2);
    assert!(stdout.is_empty());
    assert_eq!(
        stderr,
        format!("{path}:10: upstream.headers.Authorization: environment variable `CORRAL_CLI_TEST_KEY` is not set")
    );
}

#[tokio::test]
async fn check_config_rejects_cap_below_base() {
    let (code, _, stderr, path) = check("cap", "cap = \"30s\"", "cap = \"100ms\"", true).await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:14: upstream[0].retry.cap: `cap` (100ms) must be at least `base` (500ms)")
    );
}

#[tokio::test]
async fn check_config_rejects_a_duration_beyond_a_year() {
    let (code, _, stderr, path) =
        check("long", "cap = \"30s\"", "cap = \"500000000000y\"", true).await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:14: upstream.retry.cap: duration `500000000000y` is too long: at most 365 days (\"365d\")")
    );
}

// Config errors never quote a value that may be a credential: each rejection below asserts
// its message and that the secret is not in it.

#[tokio::test]
async fn check_config_hides_a_literal_key_before_a_stray_variable() {
    let (code, _, stderr, path) = check(
        "stray",
        "\"Bearer ${CORRAL_CLI_TEST_KEY}\"",
        "\"Bearer sk-literal-secret ${\"",
        true,
    )
    .await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:10: upstream.headers.Authorization: unterminated `${{`: a variable is written `${{NAME}}`")
    );
    assert!(!stderr.contains("sk-literal"), "{stderr}");
}

#[tokio::test]
async fn check_config_hides_a_header_value_of_the_wrong_type() {
    let (code, _, stderr, path) = check(
        "header-type",
        "\"Bearer ${CORRAL_CLI_TEST_KEY}\"",
        "98765432123456789",
        true,
    )
    .await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:10: upstream.headers.Authorization: invalid type: integer `*****`, expected a string")
    );
    assert!(!stderr.contains("98765432123456789"), "{stderr}");
}

#[tokio::test]
async fn check_config_hides_credentials_in_a_base_url() {
    for (url, shown, secret) in [
        (
            "https://user:sk-url-secret@api.openai.com/v1",
            "`https://*****@api.openai.com/v1` must name a host, without user info",
            "sk-url-secret",
        ),
        (
            "https://api.openai.com/v1?key=sk-query-secret",
            "`https://api.openai.com/v1?*****` must not have a query string",
            "sk-query-secret",
        ),
    ] {
        let (code, _, stderr, path) =
            check("url-secret", "https://api.openai.com/v1", url, true).await;
        assert_eq!(code, 2);
        assert_eq!(stderr, format!("{path}:7: upstream.base_url: URL {shown}"));
        assert!(!stderr.contains(secret), "{stderr}");
    }
}

#[tokio::test]
async fn check_config_quotes_a_refused_value_as_written_not_as_expanded() {
    let (code, _, stderr, path) = check(
        "expanded",
        "\"https://api.openai.com/v1\"",
        "\"${CORRAL_CLI_TEST_KEY}\"",
        true,
    )
    .await;
    assert_eq!(code, 2);
    assert_eq!(
        stderr,
        format!("{path}:7: upstream.base_url: URL `${{CORRAL_CLI_TEST_KEY}}` needs a scheme, e.g. https://${{CORRAL_CLI_TEST_KEY}}")
    );
    assert!(!stderr.contains("sk-cli-sample"), "{stderr}");
}

#[tokio::test]
async fn run_rejects_a_bad_upstream_flag_before_binding() {
    let out = corral_command(["--listen", "127.0.0.1:0", "--upstream", "localhost:8000"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.starts_with("(command line): --upstream: "),
        "{stderr}"
    );
}

// ===== a running corral =====

#[tokio::test]
async fn quick_start_forwards_to_the_upstream_flag() {
    let upstream = MockUpstream::start(|seen| async move {
        json(200, serde_json::json!({"path": seen.uri.path()}))
    })
    .await;
    let corral = Running::spawn(
        corral_command([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.url("/v1"),
        ]),
        false,
    )
    .await;
    let c = client();
    let (parts, body) = send(&c, post(&corral.url("/v1/chat/completions"), "{}")).await;
    assert_eq!(parts.status, 200);
    assert_eq!(&body[..], br#"{"path":"/v1/chat/completions"}"#);
    assert_eq!(upstream.calls(), 1);
    let (parts, body) = send(&c, get(&corral.url("/elsewhere"))).await;
    assert_eq!(parts.status, 404);
    assert_eq!(parts.headers["x-corral-error"], "no_route");
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["code"], "no_route");
    // By default a plain 200 gets no line; the 404 (refused before any upstream) does.
    assert!(
        eventually(Duration::from_secs(5), || corral.log_has("refused")).await,
        "no refused line logged"
    );
    assert!(corral.log_has("status=404"));
    // Only a thread descheduled for 10 ms on a busy machine may make it `held`.
    for line in request_lines(&corral, 200) {
        assert_truly_held(&line);
    }
}

/// A `request` line for a 200 under the default access log: it may only be one that corral held for
/// the 10 ms docs/operations.md names (a thread descheduled on a busy machine), with its one
/// attempt, and says so; anything else is a plain 200 logged.
fn assert_truly_held(line: &str) {
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("no `{name}` in {line}"))
            .to_owned()
    };
    assert_eq!(
        field("why"),
        "\"held\"",
        "a plain 200 logged by default: {line}"
    );
    assert_eq!(field("attempts"), "1", "{line}");
    let held: u64 = field("held_ms").parse().expect("held_ms is a number");
    assert!(held >= 10, "logged as held after {held} ms: {line}");
}

/// The `request` lines for `status` in text logs.
fn request_lines(corral: &Running, status: u16) -> Vec<String> {
    let status = format!(" status={status} ");
    corral
        .log()
        .into_iter()
        .filter(|l| l.contains(" request ") && l.contains(&status))
        .collect()
}

/// `access_log`: by default a plain 200 gets no line and a 500 does (`why=error`); a reload to
/// `access_log = "all"` logs the 200 too (`why=all`).
#[tokio::test]
async fn the_access_log_logs_errors_by_default_and_every_request_with_all() {
    let upstream = MockUpstream::start(|seen| async move {
        match seen.uri.path() {
            "/v1/fail" => json(500, serde_json::json!({"error": "boom"})),
            _ => json(200, serde_json::json!({})),
        }
    })
    .await;
    let config = |top: &str| {
        format!(
            "listen = \"127.0.0.1:0\"\ndrain_delay = \"0s\"\n{top}[[upstream]]\nname = \"mock\"\n\
             route = \"/v1\"\nbase_url = \"{}\"\n[upstream.retry]\nmax_retries = 0\n",
            upstream.url("/v1")
        )
    };
    let file = TempConfig::new("access-log", &config(""));
    let corral = Running::spawn(corral_command(["--config", file.path()]), false).await;
    let c = client();
    let (ok, _) = send(&c, post(&corral.url("/v1/ok"), "{}")).await;
    assert_eq!(ok.status, 200);
    let (failed, _) = send(&c, post(&corral.url("/v1/fail"), "{}")).await;
    assert_eq!(failed.status, 500);
    // Lines are written in order: once the 500's is there, the 200's would be too.
    assert!(
        eventually(Duration::from_secs(5), || !request_lines(&corral, 500)
            .is_empty())
        .await,
        "the 500 was not logged: {:?}",
        corral.log()
    );
    let line = &request_lines(&corral, 500)[0];
    for field in [
        "upstream=mock",
        "attempts=1",
        "why=\"error\"",
        "held_ms=",
        "duration_ms=",
    ] {
        assert!(line.contains(field), "no `{field}` in {line}");
    }
    // A thread descheduled for 10 ms on a busy machine would make the 200 `held`: nothing
    // else may log it.
    for line in request_lines(&corral, 200) {
        assert_truly_held(&line);
    }

    std::fs::write(&file.0, config("access_log = \"all\"\n")).unwrap();
    corral.signal("HUP");
    assert!(
        eventually(Duration::from_secs(5), || corral.log_has("config reloaded")).await,
        "no reload: {:?}",
        corral.log()
    );
    let (ok, _) = send(&c, post(&corral.url("/v1/ok"), "{}")).await;
    assert_eq!(ok.status, 200);
    assert!(
        eventually(Duration::from_secs(5), || request_lines(&corral, 200)
            .iter()
            .any(|l| l.contains("why=\"all\"")))
        .await,
        "the 200 was not logged with access_log = \"all\": {:?}",
        corral.log()
    );
}

#[tokio::test]
async fn env_vars_choose_the_config_file_and_override_its_listen() {
    let upstream = MockUpstream::start(|_| async { json(200, serde_json::json!({})) }).await;
    // If CORRAL_LISTEN were ignored, corral would bind 8080 and the port check below fails.
    let file = TempConfig::new(
        "env",
        &format!(
            "listen = \"127.0.0.1:8080\"\n[[upstream]]\nname = \"mock\"\nroute = \"/llm\"\nbase_url = \"{}\"\n",
            upstream.url("/v1")
        ),
    );
    let mut cmd = corral_command::<&str>([]);
    cmd.env("CORRAL_CONFIG", file.path())
        .env("CORRAL_LISTEN", "127.0.0.1:0");
    let corral = Running::spawn(cmd, false).await;
    assert_ne!(corral.addr.port(), 8080);
    let (parts, _) = send(&client(), post(&corral.url("/llm/models"), "{}")).await;
    assert_eq!(parts.status, 200);
    assert_eq!(upstream.last().uri.path(), "/v1/models");
}

#[tokio::test]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let upstream = MockUpstream::start(|_| async {
        // Longer than the default 5 s drain_delay, during which the listener stays open.
        tokio::time::sleep(Duration::from_secs(7)).await;
        json(200, serde_json::json!({"slow": true}))
    })
    .await;
    let corral = Running::spawn(
        corral_command([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.url("/v1"),
        ]),
        false,
    )
    .await;
    let addr = corral.addr;
    let in_flight = tokio::spawn(send_owned(corral.url("/v1/chat/completions")));
    assert!(eventually(Duration::from_secs(5), || upstream.calls() == 1).await);
    corral.sigterm();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        std::net::TcpStream::connect(addr).is_ok(),
        "SIGTERM keeps the listener open for the drain delay"
    );
    assert!(
        eventually(Duration::from_secs(10), || std::net::TcpStream::connect(
            addr
        )
        .is_err())
        .await,
        "corral still accepts connections after the drain delay"
    );
    assert!(
        !in_flight.is_finished(),
        "the listener should close while the slow request is still in flight"
    );
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200, "the in-flight request completed");
    assert_eq!(&body[..], br#"{"slow":true}"#);
    let (exit, log) = corral.wait().await;
    assert!(exit.success(), "exit {exit:?}; stderr:\n{}", log.join("\n"));
    assert!(std::net::TcpStream::connect(addr).is_err());
    assert!(log.iter().any(|l| l.contains("draining")), "{log:?}");
}

async fn send_owned(url: String) -> (u16, Bytes) {
    let (parts, body) = send(&client(), post(&url, "{}")).await;
    (parts.status.as_u16(), body)
}

/// Client keys, injected keys and `partition = "api_key"`'s per-key buckets: no secret in any log
/// line (debug level, every request logged) on success, 404, 413, retries, the breaker, a
/// connection error, nor in `/status`, `/metrics`, `/healthz` or `/readyz`.
#[tokio::test]
async fn secrets_never_reach_the_logs() {
    const SECRETS: [&str; 4] = [
        "sk-client-secret",
        "sk-ant-secret",
        "azure-secret",
        "sk-injected-secret",
    ];
    // `/v1/fail` answers 503: retried, then failing until the breaker opens and rejects.
    let upstream = MockUpstream::start(|seen| async move {
        let status = if seen.uri.path().ends_with("/fail") {
            503
        } else {
            200
        };
        json(status, serde_json::json!({}))
    })
    .await;
    // Nothing listens on a port just closed: the `dead` upstream's attempts fail to connect.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let file = TempConfig::new(
        "secrets",
        &format!(
            "listen = \"127.0.0.1:0\"\naccess_log = \"all\"\n\
             [[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{}\"\nbody_limit = \"1KiB\"\nrate_limit = \"off\"\n\
             [upstream.headers]\nAuthorization = \"Bearer ${{SECRET_VAR}}\"\n\
             [upstream.retry]\nmax_retries = 1\nbase = \"10ms\"\ncap = \"10ms\"\n\
             [upstream.breaker]\nmin_samples = 3\nmin_span = \"1ms\"\non_open = \"reject\"\n\
             [upstream.limits]\npartition = \"api_key\"\n\
             [[upstream]]\nname = \"dead\"\nroute = \"/dead\"\nbase_url = \"http://{dead}/v1\"\n\
             [upstream.headers]\nAuthorization = \"Bearer ${{SECRET_VAR}}\"\n\
             [upstream.retry]\nmax_retries = 1\nbase = \"10ms\"\ncap = \"10ms\"\n",
            upstream.url("/v1")
        ),
    );
    let mut cmd = corral_command(["--log-format", "json", "--config", file.path()]);
    cmd.env("SECRET_VAR", "sk-injected-secret")
        .env("RUST_LOG", "debug");
    let corral = Running::spawn(cmd, false).await;
    let c = client();
    let with_secrets = |path: &str, body: String| {
        Request::post(corral.url(path))
            .header("authorization", "Bearer sk-client-secret")
            .header("x-api-key", "sk-ant-secret")
            .header("api-key", "azure-secret")
            .body(Full::new(Bytes::from(body)))
            .unwrap()
    };
    let (ok, _) = send(&c, with_secrets("/v1/chat/completions", "{}".into())).await;
    assert_eq!(ok.status, 200);
    // The client's own `Authorization` wins under `if_absent`; its other credentials are kept
    // from an upstream that injects one (`tests/credentials.rs`).
    let seen = upstream.last().headers;
    assert_eq!(seen["authorization"], "Bearer sk-client-secret");
    assert!(!seen.contains_key("x-api-key") && !seen.contains_key("api-key"));
    let (injected, _) = send(&c, post(&corral.url("/v1/models"), "{}")).await;
    assert_eq!(injected.status, 200);
    assert_eq!(
        upstream.last().headers["authorization"],
        "Bearer sk-injected-secret"
    );
    let (not_found, _) = send(&c, with_secrets("/v2/nowhere", "{}".into())).await;
    assert_eq!(not_found.status, 404);
    let (too_large, _) = send(&c, with_secrets("/v1/chat/completions", "x".repeat(2048))).await;
    assert_eq!(too_large.status, 413);
    assert_eq!(upstream.calls(), 2);
    // Retried 503s until the breaker opens (its transition is logged), then its rejection.
    let mut failing = Vec::new();
    for _ in 0..10 {
        let (parts, _) = send(&c, with_secrets("/v1/fail", "{}".into())).await;
        let corrals = parts
            .headers
            .contains_key(corral::error::CORRAL_ERROR_HEADER);
        failing.push((parts.status.as_u16(), corrals));
        if corrals {
            break;
        }
    }
    assert_eq!(
        failing.last(),
        Some(&(503, true)),
        "the breaker never rejected: {failing:?}"
    );
    assert!(upstream.calls() > 3, "the 503s were retried: {failing:?}");
    // A connection error, retried and given up on.
    let (refused, _) = send(&c, with_secrets("/dead/chat/completions", "{}".into())).await;
    assert_eq!(refused.status, 502);
    // What corral shows about itself, asked with the secrets in the request.
    for path in ["/status", "/metrics", "/healthz", "/readyz"] {
        let req = Request::get(corral.url(path))
            .header("authorization", "Bearer sk-client-secret")
            .header("x-api-key", "sk-ant-secret")
            .header("api-key", "azure-secret")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (parts, body) = send(&c, req).await;
        assert_eq!(parts.status, 200, "{path}");
        let body = String::from_utf8_lossy(&body);
        for secret in SECRETS {
            assert!(!body.contains(secret), "{path} shows `{secret}`:\n{body}");
        }
    }

    corral.sigterm();
    let (exit, log) = corral.wait().await;
    assert!(exit.success(), "exit {exit:?}");
    let all = log.join("\n");
    for secret in SECRETS {
        assert!(!all.contains(secret), "`{secret}` was logged:\n{all}");
    }
    // The lines this test exists for were written (and so checked above).
    for wanted in ["retrying", "breaker", "connect"] {
        assert!(
            log.iter().any(|l| l.contains(wanted)),
            "no log line mentions `{wanted}`:\n{all}"
        );
    }
    let mut statuses = Vec::new();
    for line in &log {
        let json: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        if json["message"] != "request" {
            continue;
        }
        if json["upstream"] != "mock" {
            assert_eq!(json["upstream"], "dead", "{line}");
            assert_eq!(json["status"], 502, "{line}");
            continue;
        }
        for field in ["status", "attempts", "duration_ms", "held_ms"] {
            assert!(json[field].is_u64(), "`{field}` missing in {line}");
        }
        let status = json["status"].as_u64().unwrap();
        let why = if status >= 400 { "error" } else { "all" };
        // A 200 held 10 ms by a descheduled thread says so instead.
        if json["why"] == "held" && status < 400 {
            assert!(json["held_ms"].as_u64().unwrap() >= 10, "{line}");
        } else {
            assert_eq!(json["why"], why, "{line}");
        }
        statuses.push(status);
    }
    statuses.sort_unstable();
    statuses.dedup();
    assert_eq!(statuses, [200, 413, 503], "request lines:\n{all}");
}
