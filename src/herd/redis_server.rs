//! A throwaway `redis-server` on a free loopback port, for the fleet benchmark and the tests:
//! no persistence (`--save ""`, no AOF), so a kill loses everything, as a crash would.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

    /// Start one on a free port and wait until it answers.
    pub fn start() -> std::io::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let server = Self {
            port,
            child: Mutex::new(None),
        };
        server.restart()?;
        Ok(server)
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

    /// Start it again on the same port (empty), after a kill; waits until it answers.
    pub fn restart(&self) -> std::io::Result<()> {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        *self.lock() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(std::io::Error::other(format!(
            "redis-server on port {} did not answer within 10 s",
            self.port
        )))
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
