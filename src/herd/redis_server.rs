//! A throwaway `redis-server` on a free loopback port, for the fleet benchmark and the tests:
//! no persistence (`--save ""`, no AOF), so a kill loses everything, as a crash would.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Ports tried before a start gives up (each clash: another process took the port first).
const PORT_TRIES: usize = 10;
/// A server must answer `PING` within this.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// Why a start did not come up.
enum Start {
    /// The server exited: its port was taken.
    Exited(std::io::Error),
    Failed(std::io::Error),
}

/// Whether the server at `client` answers `PING` and is the process `pid`.
fn answers_as(client: &redis::Client, pid: u32) -> bool {
    let Ok(mut conn) = client.get_connection_with_timeout(Duration::from_secs(1)) else {
        return false;
    };
    let pong: redis::RedisResult<String> = redis::cmd("PING").query(&mut conn);
    if pong.as_deref() != Ok("PONG") {
        return false;
    }
    let info: redis::RedisResult<String> = redis::cmd("INFO").arg("server").query(&mut conn);
    info.is_ok_and(|info| {
        info.lines()
            .filter_map(|l| l.trim().strip_prefix("process_id:"))
            .any(|id| id == pid.to_string())
    })
}

/// A `redis-server` this process started and owns.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    child: Mutex<Option<Child>>,
}

impl RedisServer {
    /// Whether `redis-server` can be run here.
    pub fn available() -> bool {
        Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Start one on a free port and wait until it answers. redis-server cannot pick its own TCP
    /// port (`--port 0` turns TCP off), so the port is one the kernel just had free; another
    /// process may take it first, and then the server exits and another port is tried.
    pub fn start() -> std::io::Result<Self> {
        let mut clash = None;
        for _ in 0..PORT_TRIES {
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let server = Self {
                port,
                child: Mutex::new(None),
            };
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(Start::Exited(e)) => clash = Some(e),
                Err(Start::Failed(e)) => return Err(e),
            }
        }
        Err(clash.unwrap_or_else(|| std::io::Error::other("no port tried")))
    }

    /// Start one on `port`, once: an error if the port is taken (even by another Redis).
    pub fn on_port(port: u16) -> std::io::Result<Self> {
        let server = Self {
            port,
            child: Mutex::new(None),
        };
        match server.spawn_and_wait() {
            Ok(()) => Ok(server),
            Err(Start::Exited(e) | Start::Failed(e)) => Err(e),
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.lock().as_ref().map(Child::id)
    }

    /// Kill it (SIGKILL: its data is gone).
    pub fn kill(&self) {
        if let Some(mut child) = self.lock().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start it again on the same port (empty), after a kill; waits until it answers. The port
    /// may still be held for a moment (another process may even have taken it): the start is
    /// tried again for up to [`READY_WITHIN`].
    pub fn restart(&self) -> std::io::Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(Start::Exited(e)) if Instant::now() >= deadline => return Err(e),
                Err(Start::Exited(_)) => std::thread::sleep(Duration::from_millis(50)),
                Err(Start::Failed(e)) => return Err(e),
            }
        }
    }

    /// Spawn on `self.port` and wait until this very process answers `PING` (a server of
    /// someone else's on the port would answer too: its `process_id` tells them apart).
    fn spawn_and_wait(&self) -> Result<(), Start> {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(Start::Failed)?;
        let pid = child.id();
        *self.lock() = Some(child);
        let client = redis::Client::open(self.url().as_str())
            .map_err(|e| Start::Failed(std::io::Error::other(e)))?;
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            let exited = self
                .lock()
                .as_mut()
                .map_or(Ok(None), Child::try_wait)
                .map_err(Start::Failed)?;
            if let Some(status) = exited {
                self.lock().take();
                return Err(Start::Exited(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!(
                        "redis-server on port {} exited ({status}): the port was taken?",
                        self.port
                    ),
                )));
            }
            if answers_as(&client, pid) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
        Err(Start::Failed(std::io::Error::other(format!(
            "redis-server on port {} did not answer PING within {READY_WITHIN:?}",
            self.port
        ))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `EVALSHA` and `EVAL` calls Redis has served, from its own `INFO commandstats`.
pub async fn script_calls(url: &str) -> redis::RedisResult<u64> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    Ok(parse_script_calls(&info))
}

/// The `calls=` of `cmdstat_evalsha` and `cmdstat_eval` in an `INFO commandstats` text.
pub fn parse_script_calls(info: &str) -> u64 {
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split([':', ','])
                .find_map(|kv| kv.strip_prefix("calls="))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_calls_are_read_from_commandstats() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=41,usec=900,usec_per_call=21.95,rejected_calls=0,failed_calls=0\r\ncmdstat_eval:calls=1,usec=10\r\ncmdstat_get:calls=7,usec=1\r\n";
        assert_eq!(parse_script_calls(info), 42);
        assert_eq!(parse_script_calls(""), 0);
    }
}
