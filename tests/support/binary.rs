//! The real `corral` binary: one harness for every test that runs it (`tests/cli.rs`,
//! `tests/deploy.rs`): a clean environment, spawn, wait for its listeners, collect its stderr,
//! signal it by PID, wait for its exit, and kill it on drop.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use super::{client, send};

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_corral");

/// Longest wait for a started corral to log that it listens.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest wait for a signalled corral to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(15);

/// `corral ARGS` with its own environment variables cleared, `info` logs, no stdin, killed on
/// drop.
pub fn corral_command<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Command {
    let mut cmd = Command::from(corral_std_command(args));
    cmd.kill_on_drop(true);
    cmd
}

/// [`corral_command`] for a blocking caller.
pub fn corral_std_command<S: AsRef<OsStr>>(
    args: impl IntoIterator<Item = S>,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(BIN);
    cmd.args(args)
        .env_remove("CORRAL_CONFIG")
        .env_remove("CORRAL_LISTEN")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    cmd
}

/// Which listener a startup line announces, and its address: `corral listening` or `admin
/// endpoints listening`, with `addr`, in text (`addr=127.0.0.1:PORT`) or JSON logs.
fn listening(line: &str) -> Option<(bool, SocketAddr)> {
    let admin = if line.contains("admin endpoints listening") {
        true
    } else if line.contains("corral listening") {
        false
    } else {
        return None;
    };
    if let Ok(json) = serde_json::from_str::<serde_json::Value>(line) {
        return Some((admin, json["addr"].as_str()?.parse().ok()?));
    }
    let rest = &line[line.find("addr=")? + 5..];
    Some((admin, rest.split_whitespace().next()?.parse().ok()?))
}

/// corral running as a process; its stderr collected line by line.
pub struct Running {
    child: Child,
    /// The main listener.
    pub addr: SocketAddr,
    /// The admin listener, when started with `admin`.
    pub admin: Option<SocketAddr>,
    log: Arc<Mutex<Vec<String>>>,
    reader: JoinHandle<()>,
}

impl Running {
    /// Spawn `cmd` (made by [`corral_command`]) and wait until it logs that it listens (and,
    /// with `admin`, that its admin endpoints do).
    pub async fn spawn(mut cmd: Command, admin: bool) -> Self {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn corral");
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let lines_out = Arc::clone(&log);
        let reader = tokio::spawn(async move {
            let (mut main, mut admin_addr, mut tx) = (None, None, Some(tx));
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                match listening(&line) {
                    Some((false, addr)) => main = Some(addr),
                    Some((true, addr)) => admin_addr = Some(addr),
                    None => {}
                }
                lines_out.lock().unwrap().push(line);
                if let Some(main) = main.filter(|_| !admin || admin_addr.is_some()) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send((main, admin_addr));
                    }
                }
            }
        });
        let Ok(Ok((addr, admin))) = tokio::time::timeout(START_TIMEOUT, rx).await else {
            panic!(
                "corral never logged that it listens; stderr:\n{}",
                log.lock().unwrap().join("\n")
            )
        };
        Self {
            child,
            addr,
            admin,
            log,
            reader,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The stderr lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub fn log_has(&self, needle: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.contains(needle))
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("corral still running")
    }

    /// `kill -SIGNAL <pid>` (`TERM`, `INT`, ...).
    pub fn signal(&self, signal: &str) {
        let pid = self.pid();
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {pid} failed");
    }

    /// `kill -TERM <pid>`, as an orchestrator would.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// `GET path` on `addr`: the status and the body as text.
    pub async fn get(&self, addr: SocketAddr, path: &str) -> (u16, String) {
        let req = Request::get(format!("http://{addr}{path}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let (parts, body) = send(&client(), req).await;
        (
            parts.status.as_u16(),
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    /// Wait for the process to exit; its status and every stderr line.
    pub async fn wait(mut self) -> (ExitStatus, Vec<String>) {
        let status = tokio::time::timeout(EXIT_TIMEOUT, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("corral did not exit within {EXIT_TIMEOUT:?}"))
            .expect("wait for corral");
        tokio::time::timeout(Duration::from_secs(5), &mut self.reader)
            .await
            .expect("stderr closed")
            .unwrap();
        let log = std::mem::take(&mut *self.log.lock().unwrap());
        (status, log)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        self.reader.abort();
    }
}
