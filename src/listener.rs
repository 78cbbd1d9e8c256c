//! Binding a TCP listener with a backlog fit for a herd.
//!
//! `tokio::net::TcpListener::bind` listens with std's backlog of 128 (mio 1.2). corral exists
//! for hundreds or thousands of clients that connect at the same instant; past 128 handshakes
//! waiting to be accepted the kernel drops SYNs, and each dropped client retransmits one a
//! second later (Linux's initial RTO): a 500-client burst cost a second to a third of them
//! before a single byte was read. [`bind`] listens with [`BACKLOG`] instead (the kernel caps it
//! at `net.core.somaxconn`), as nginx and haproxy let their operators do.

use std::io;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// Connections the kernel may hold completed but not yet accepted.
pub const BACKLOG: u32 = 4096;

/// A listener on `addr` (`SO_REUSEADDR`, as tokio's own `bind` sets) with [`BACKLOG`].
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// More clients than std's backlog of 128 (600, or the kernel's cap if lower) connect at
    /// once, and none is accepted yet: every handshake completes (none waits on a
    /// retransmitted SYN), so all of them can write.
    #[tokio::test]
    async fn a_burst_beyond_128_connects_before_any_accept() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        // The kernel caps the backlog at `net.core.somaxconn` (4096 since Linux 5.4, 128
        // before): a burst past that cap would be dropped whatever corral asks.
        let cap: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(4096);
        let burst = 600.min(cap);
        assert!(
            burst > 128,
            "net.core.somaxconn is {cap}: no backlog past std's to test"
        );
        let connects = (0..burst).map(|_| tokio::net::TcpStream::connect(addr));
        let started = std::time::Instant::now();
        // With std's backlog most of them would never connect until accepted: 5 s bounds that.
        let all = futures_util::future::join_all(connects);
        let streams = tokio::time::timeout(Duration::from_secs(5), all)
            .await
            .expect("the burst connects within 5 s");
        let elapsed = started.elapsed();
        assert!(streams.iter().all(Result::is_ok));
        // A dropped SYN is retransmitted after a second: well under that, none was dropped.
        assert!(
            elapsed < Duration::from_millis(900),
            "{burst} connects took {elapsed:?}"
        );
        drop(listener);
    }
}
