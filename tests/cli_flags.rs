//! The real binary on what the README's quick start promises: `corral` alone runs the embedded
//! default config; `--upstream URL` with `--rpm`, `--tpm`, `--burst`, `--max-concurrency` and
//! `--max-retries` sets that upstream's limits; and SIGHUP re-reads the config the way it was
//! read at start (the flags applied again), keeps the restart-only settings and `[fleet]`, and
//! names those in its log line.

mod support;

use std::time::Duration;

use support::binary::{corral_command, Running};
use support::*;

/// `/status` as JSON.
async fn status(corral: &Running) -> serde_json::Value {
    let (code, body) = corral.get(corral.addr, "/status").await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The one upstream's entry in `/status`.
async fn upstream_status(corral: &Running) -> serde_json::Value {
    let status = status(corral).await;
    let upstreams = status["upstreams"].as_array().expect("upstreams").clone();
    assert_eq!(upstreams.len(), 1, "{status}");
    upstreams[0].clone()
}

/// Wait (up to 10 s) for `/status` to show config generation `n`.
async fn reached_generation(corral: &Running, n: u64) {
    for _ in 0..200 {
        if status(corral).await["config_generation"] == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "no config generation {n} within 10 s; log:\n{}",
        corral.log().join("\n")
    );
}

/// `corral` with no config: the embedded default parses and validates, listens on
/// 127.0.0.1:8080 (here moved by `--listen`, as the port may be taken), sends `/v1` to OpenAI,
/// and serves `/healthz`.
#[tokio::test]
async fn the_embedded_default_config_runs_and_serves_healthz() {
    let embedded = corral::config::load_str("(embedded)", corral::config::DEFAULT_CONFIG)
        .expect("the embedded default config is valid");
    assert_eq!(embedded.listen.0.to_string(), "127.0.0.1:8080");
    assert!(embedded.warnings().is_empty(), "{:?}", embedded.warnings());

    let corral = Running::spawn(corral_command(["--listen", "127.0.0.1:0"]), false).await;
    assert_eq!(
        corral.get(corral.addr, "/healthz").await,
        (200, "ok\n".into())
    );
    assert_eq!(corral.get(corral.addr, "/readyz").await.0, 200);
    let upstream = upstream_status(&corral).await;
    assert_eq!(upstream["name"], "openai", "{upstream}");
    assert_eq!(upstream["route"], "/v1", "{upstream}");
    corral.sigterm();
    let (exit, log) = corral.wait().await;
    assert!(exit.success(), "exit {exit:?}:\n{}", log.join("\n"));
}

/// An upstream that answers `/v1/fail` with a 503 and everything else with a 200.
async fn fail_or_ok() -> MockUpstream {
    MockUpstream::start(|seen| async move {
        match seen.uri.path() {
            "/v1/fail" => json(503, serde_json::json!({"error": {"message": "down"}})),
            _ => json(200, serde_json::json!({"ok": true})),
        }
    })
    .await
}

/// `--upstream URL` and its limit flags, as the quick start runs them.
fn quick_start(upstream: &MockUpstream, flags: &[&str]) -> tokio::process::Command {
    let mut args = vec![
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--upstream".to_owned(),
        upstream.url("/v1"),
    ];
    args.extend(flags.iter().map(|f| (*f).to_owned()));
    corral_command(args)
}

/// Each limit flag is in force: `/status` shows the buckets and window they set (and what
/// the same upstream gets without them), `--rpm 30 --burst 2` lets two requests go at once and
/// paces the third (a token every 2 s; one-sided bound 1.5 s), and `--max-retries 2` makes
/// three attempts at a failing request.
#[tokio::test]
async fn the_quick_start_limit_flags_take_effect() {
    let upstream = fail_or_ok().await;
    let plain = Running::spawn(quick_start(&upstream, &[]), false).await;
    let defaults = upstream_status(&plain).await;
    assert_eq!(
        defaults["rate_limit"]["config_requests"],
        serde_json::Value::Null
    );
    assert_eq!(
        defaults["rate_limit"]["config_tokens"],
        serde_json::Value::Null
    );
    assert_eq!(defaults["concurrency"]["limit"], 1024, "{defaults}");
    drop(plain);

    let flags = [
        "--rpm",
        "30",
        "--burst",
        "2",
        "--tpm",
        "600000",
        "--max-concurrency",
        "7",
        "--max-retries",
        "2",
    ];
    let corral = Running::spawn(quick_start(&upstream, &flags), false).await;
    let set = upstream_status(&corral).await;
    let limits = &set["rate_limit"];
    assert_eq!(limits["config_requests"]["per_second"], 0.5, "{set}");
    assert_eq!(limits["config_requests"]["burst"], 2, "{set}");
    assert_eq!(limits["config_tokens"]["per_second"], 10_000.0, "{set}");
    assert_eq!(set["concurrency"]["limit"], 7, "{set}");

    // --rpm 30 --burst 2: two at once, the third waits for a token.
    let c = client();
    let start = tokio::time::Instant::now();
    let url = corral.url("/v1/chat/completions");
    let (a, b) = tokio::join!(send(&c, post(&url, "{}")), send(&c, post(&url, "{}")));
    assert_eq!((a.0.status.as_u16(), b.0.status.as_u16()), (200, 200));
    let (third, _) = send(&c, post(&url, "{}")).await;
    assert_eq!(third.status, 200);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "the third request was not paced: {took:?}"
    );

    // --max-retries 2: a request the upstream keeps failing is sent three times.
    let before = upstream.calls();
    let (parts, _) = send(&c, post(&corral.url("/v1/fail"), "{}")).await;
    assert_eq!(parts.status, 503);
    assert_eq!(upstream.calls() - before, 3, "one attempt and two retries");
}

/// The `--upstream` quick start: a reload re-reads the config as at start, the limit flags
/// applied again, so the upstream is unchanged (kept with its state) and its limits hold. Had
/// the flags been dropped, the reload would have swapped it for the embedded default's OpenAI.
#[tokio::test]
async fn a_reload_applies_the_quick_start_flags_again() {
    let upstream = fail_or_ok().await;
    let flags = ["--rpm", "30", "--burst", "2", "--max-concurrency", "7"];
    let corral = Running::spawn(quick_start(&upstream, &flags), false).await;
    corral.signal("HUP");
    reached_generation(&corral, 2).await;
    let after = upstream_status(&corral).await;
    assert_eq!(after["name"], "upstream", "{after}");
    assert_eq!(after["concurrency"]["limit"], 7, "{after}");
    assert_eq!(
        after["rate_limit"]["config_requests"]["burst"], 2,
        "{after}"
    );
    // The generation shows in /status before the log line has come through the pipe; the
    // restart-only warning, if any, is logged before it.
    eventually(Duration::from_secs(5), || corral.log_has("config reloaded")).await;
    let reloaded = corral
        .log()
        .into_iter()
        .find(|l| l.contains("config reloaded"))
        .expect("a reload line");
    for field in ["kept=1", "built=0", "removed=0"] {
        assert!(reloaded.contains(field), "no `{field}` in {reloaded}");
    }
    assert!(
        !corral.log_has("restart only"),
        "nothing restart-only changed:\n{}",
        corral.log().join("\n")
    );
}

/// A config file with `--listen` and `--admin-listen`: a reload applies both flags again (so
/// the file's own `listen` is no change to warn about), keeps the restart-only settings and
/// `[fleet]` as they were, names exactly those that changed in its log line, and applies the
/// rest.
#[tokio::test]
async fn a_reload_keeps_restart_only_settings_and_fleet_and_names_them() {
    let upstream = fail_or_ok().await;
    let file = |extra: &str, concurrency: u32| {
        format!(
            "listen = \"127.0.0.1:1\"\ndrain_delay = \"0s\"\n{extra}\
             [[upstream]]\nname = \"mock\"\nroute = \"/v1\"\nbase_url = \"{}\"\n\
             [upstream.limits]\nmax_concurrency = {concurrency}\n",
            upstream.url("/v1")
        )
    };
    let dir = std::env::temp_dir().join(format!("corral-flags-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corral.toml");
    std::fs::write(&path, file("max_connections = 100\n", 5)).unwrap();
    let args = [
        "--config".as_ref(),
        path.as_os_str(),
        "--listen".as_ref(),
        "127.0.0.1:0".as_ref(),
        "--admin-listen".as_ref(),
        "127.0.0.1:0".as_ref(),
    ];
    let corral = Running::spawn(corral_command(args), true).await;
    let admin = corral.admin.expect("the admin listener");
    let status = |addr| {
        let corral = &corral;
        async move {
            let (code, body) = corral.get(addr, "/status").await;
            assert_eq!(code, 200, "{body}");
            serde_json::from_str::<serde_json::Value>(&body).unwrap()
        }
    };
    assert_eq!(status(admin).await["connections"]["max"], 100);

    std::fs::write(
        &path,
        file("max_connections = 50\n[fleet]\nname = \"elsewhere\"\n", 3),
    )
    .unwrap();
    corral.signal("HUP");
    let mut applied = None;
    for _ in 0..200 {
        let s = status(admin).await;
        if s["config_generation"] == 2 {
            applied = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let applied =
        applied.unwrap_or_else(|| panic!("no reload within 10 s:\n{}", corral.log().join("\n")));
    assert_eq!(
        applied["connections"]["max"], 100,
        "max_connections waits for a restart: {applied}"
    );
    assert_eq!(
        applied["upstreams"][0]["concurrency"]["limit"], 3,
        "the upstream's new limit is in force: {applied}"
    );
    // Both listeners still answer where they were.
    assert_eq!(corral.get(corral.addr, "/v1/ok").await.0, 200);
    assert_eq!(corral.get(admin, "/healthz").await.0, 200);

    // The log line comes through the pipe after the generation shows in /status.
    eventually(Duration::from_secs(5), || {
        corral.log_has("take effect on restart only")
    })
    .await;
    let warning = corral
        .log()
        .into_iter()
        .find(|l| l.contains("take effect on restart only"))
        .unwrap_or_else(|| panic!("no restart-only line:\n{}", corral.log().join("\n")));
    let keys = warning
        .split("keys=")
        .nth(1)
        .expect("a `keys` field")
        .trim_matches('"');
    assert_eq!(keys, "fleet, max_connections", "{warning}");
    let _ = std::fs::remove_dir_all(&dir);
}
