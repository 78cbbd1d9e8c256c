//! Running the `tests/python/` scripts under `$CORRAL_PYTHON` (the `.venv` that `.ci/run` makes,
//! with the official SDKs and kubernetes-validate).

use std::process::Stdio;

/// `$CORRAL_PYTHON`; `None` (after a note) when `CORRAL_SKIP_PYTHON=1`; otherwise a panic that
/// says how to get one. `needs` names what that python must have installed.
pub fn python(needs: &str) -> Option<String> {
    match std::env::var("CORRAL_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ if std::env::var("CORRAL_SKIP_PYTHON").as_deref() == Ok("1") => {
            super::skip(
                &format!("a test needing {needs}"),
                "CORRAL_SKIP_PYTHON=1 and no CORRAL_PYTHON",
            );
            None
        }
        _ => panic!(
            "CORRAL_PYTHON is not set: run `bash .ci/run` (it creates .venv with {needs}), or set \
             CORRAL_PYTHON to a python that has {needs} installed (or CORRAL_SKIP_PYTHON=1 to \
             skip this test)"
        ),
    }
}

/// `python tests/python/SCRIPT`, talking only to 127.0.0.1: no proxies, no ambient SDK account
/// settings from the environment.
pub fn script(python: &str, script: &str) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(format!(
        "{}/tests/python/{script}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .env("NO_PROXY", "127.0.0.1,localhost")
    .stdin(Stdio::null())
    .kill_on_drop(true);
    for var in [
        "OPENAI_ORG_ID",
        "OPENAI_PROJECT_ID",
        "ANTHROPIC_AUTH_TOKEN",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// Run `script` (a `tests/python/` runner script) under `python` with `env` and the `tests`
/// it names (all when empty), within `limit`; its stdout, once it exited 0 and reported
/// `passed` tests passed and none failed (`runner.py`'s summary line).
pub async fn run_sdk_script(
    python: &str,
    script: &str,
    tests: &[&str],
    env: &[(&str, String)],
    passed: usize,
    limit: std::time::Duration,
) -> String {
    let mut cmd = self::script(python, script);
    cmd.args(tests);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(limit, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within {limit:?}"))
        .unwrap_or_else(|e| panic!("cannot run CORRAL_PYTHON=`{python}`: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{python} {script} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains(&format!("{passed} passed, 0 failed")),
        "{stdout}"
    );
    stdout
}
