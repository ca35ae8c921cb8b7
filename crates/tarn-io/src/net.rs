//! TCP between two ends on the same host (issue 44).
//!
//! A congestion control that paces (BBR, the default on some hosts) spaces
//! a sender's segments with a timer of the socket's own wherever the device
//! has no `fq` queue to pace them, and loopback has none: every send then
//! arms a high-resolution timer, and much of the data leaves from the timer
//! interrupt instead of from the send. On loopback there is no link to
//! pace for, and the timers cost a quarter of a large GET's server CPU
//! (docs/benchmarks.md, "Server CPU for remote readers").
//!
//! [`unpace_local`] switches such a socket to a congestion control that
//! does not pace (cubic, or reno where this process may not choose cubic:
//! `net.ipv4.tcp_allowed_congestion_control`). Callers use it only for
//! connections whose peer is on this host; anything else keeps the host's
//! choice.
//!
//! The switch is whole only before the connection is set up: BBR, started
//! on an established connection, marks the socket as needing the kernel's
//! own pacing, and a later change of congestion control does not unmark it
//! (the timers go on at the rate cubic then sets: a GET of 1 MiB cost the
//! server 0.42 CPU-s/GB switched after accept, 0.32 with cubic from the
//! start). So a server switches its listener ([`unpace_listener`]) and
//! gives the host's choice back to connections from other hosts
//! ([`ListenerPacing::accepted`]), and a client switches its socket before
//! it connects to a peer on this host ([`connect`]).

use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Connections switched to a congestion control that does not pace.
static UNPACED: AtomicU64 = AtomicU64::new(0);
/// Off: every socket keeps the host's congestion control
/// (`--pace-local-clients`).
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turns [`unpace_local`] on or off for the process.
pub fn set_unpace_local(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Connections [`unpace_local`] switched so far.
pub fn unpaced() -> u64 {
    UNPACED.load(Ordering::Relaxed)
}

/// Whether a connection from `local` to `peer` stays on this host: a
/// loopback peer, or one whose address is this end's own.
pub fn same_host(local: Option<SocketAddr>, peer: SocketAddr) -> bool {
    let same = |ip: IpAddr| local.is_some_and(|l| l.ip() == ip);
    peer.ip().is_loopback() || same(peer.ip()) || {
        // An IPv4 peer seen through an IPv6 socket.
        match peer.ip() {
            IpAddr::V6(v6) => v6
                .to_ipv4_mapped()
                .is_some_and(|v4| v4.is_loopback() || same(IpAddr::V4(v4))),
            IpAddr::V4(_) => false,
        }
    }
}

/// The socket's congestion control, by name.
pub fn congestion_control(fd: RawFd) -> Option<String> {
    let mut name = [0u8; 16];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `name`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r != 0 {
        return None;
    }
    let name = &name[..(len as usize).min(name.len())];
    let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    std::str::from_utf8(&name[..end]).ok().map(str::to_string)
}

/// Sets the socket's congestion control; false where refused.
pub fn set_congestion_control(fd: RawFd, name: &str) -> bool {
    // SAFETY: setsockopt reads `name.len()` bytes of `name`.
    unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        ) == 0
    }
}

/// For a connection whose peer is on this host: a socket whose congestion
/// control paces (BBR) is switched to cubic, else reno. Returns the one it
/// now uses when switched, None when left as it was (or when turned off).
pub fn unpace_local(fd: RawFd) -> Option<&'static str> {
    let (_, to) = switch_off_pacing(fd)?;
    UNPACED.fetch_add(1, Ordering::Relaxed);
    Some(to)
}

/// Unless turned off: a socket whose congestion control paces (BBR) is
/// switched to cubic, else reno; (the one it had, the one it has now).
fn switch_off_pacing(fd: RawFd) -> Option<(String, &'static str)> {
    if !ENABLED.load(Ordering::Relaxed) {
        return None;
    }
    let was = congestion_control(fd).filter(|cc| cc.starts_with("bbr"))?;
    let to = ["cubic", "reno"]
        .into_iter()
        .find(|cc| set_congestion_control(fd, cc))?;
    Some((was, to))
}

/// What a listener's connections start with: the pacing congestion
/// control the listener was switched from by [`unpace_listener`] (None:
/// left as it was).
#[derive(Debug, Clone, Default)]
pub struct ListenerPacing(Option<String>);

/// Switches a listening socket whose congestion control paces to one that
/// does not, so that connections from this host never start paced; the
/// host's choice is given back to the others by
/// [`ListenerPacing::accepted`].
pub fn unpace_listener(fd: RawFd) -> ListenerPacing {
    ListenerPacing(switch_off_pacing(fd).map(|(was, _)| was))
}

impl ListenerPacing {
    /// For a connection just accepted: one from another host gets the
    /// host's congestion control back (set on the new connection, it paces
    /// as the host wants); one from this host keeps the unpaced one it
    /// started with, or, accepted on a listener left as it was, is
    /// switched now ([`unpace_local`], which stops most of the pacing).
    pub fn accepted(&self, fd: RawFd, same_host: bool) {
        match (&self.0, same_host) {
            (Some(_), true) => {
                UNPACED.fetch_add(1, Ordering::Relaxed);
            }
            (Some(host), false) => {
                if !set_congestion_control(fd, host) {
                    tracing::debug!(congestion_control = %host, "cannot give a connection the host's congestion control");
                }
            }
            (None, true) => {
                unpace_local(fd);
            }
            (None, false) => {}
        }
    }
}

/// A TCP connection to `addr` within `timeout`. To a peer on this host, a
/// pacing congestion control is switched off before the connection is made
/// (a loopback address; one of this host's other addresses is known only
/// once connected, and switched then, by [`unpace_local`]).
pub fn connect(
    addr: &SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::AsRawFd;
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(*addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    let early = same_host(None, *addr) && unpace_local(socket.as_raw_fd()).is_some();
    socket.connect_timeout(&(*addr).into(), timeout)?;
    let tcp: std::net::TcpStream = socket.into();
    if !early && same_host(tcp.local_addr().ok(), *addr) {
        unpace_local(tcp.as_raw_fd());
    }
    Ok(tcp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn peers_on_this_host() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(same_host(None, a("127.0.0.5:9000")));
        assert!(same_host(None, a("[::1]:9000")));
        assert!(same_host(None, a("[::ffff:127.0.0.1]:9000")));
        assert!(same_host(Some(a("10.1.2.3:9000")), a("10.1.2.3:5555")));
        assert!(same_host(
            Some(a("[::ffff:10.1.2.3]:9000")),
            a("[::ffff:10.1.2.3]:5555")
        ));
        assert!(!same_host(Some(a("10.1.2.3:9000")), a("10.1.2.4:5555")));
        assert!(!same_host(None, a("10.1.2.4:5555")));
    }

    /// A paced socket is switched, any other left alone. Where this kernel
    /// has no BBR, or this process may not choose it, there is no paced
    /// socket to make and only the second half runs.
    #[test]
    fn a_paced_local_socket_stops_pacing() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let fd = c.as_raw_fd();
        let before = unpaced();
        if set_congestion_control(fd, "bbr") {
            assert_eq!(congestion_control(fd).as_deref(), Some("bbr"));
            let to = unpace_local(fd).expect("switched");
            assert!(to == "cubic" || to == "reno", "{to}");
            assert_eq!(congestion_control(fd).as_deref(), Some(to));
            assert!(unpaced() > before);
        } else {
            eprintln!("no BBR here: the switch itself is not exercised");
        }
        assert!(set_congestion_control(fd, "reno"));
        assert_eq!(unpace_local(fd), None, "reno does not pace");
        assert_eq!(congestion_control(fd).as_deref(), Some("reno"));
        assert!(!set_congestion_control(fd, "no-such-algorithm"));
    }

    /// A listener taken off BBR starts connections unpaced; one from
    /// another host gets BBR back. A client's socket to this host is
    /// switched before it connects. Without BBR here there is nothing to
    /// switch, and nothing is.
    #[test]
    fn listeners_and_clients_start_unpaced() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let lfd = l.as_raw_fd();
        if !set_congestion_control(lfd, "bbr") {
            assert!(unpace_listener(lfd).0.is_none());
            eprintln!("no BBR here: the switch itself is not exercised");
            return;
        }
        let pacing = unpace_listener(lfd);
        assert_eq!(pacing.0.as_deref(), Some("bbr"));
        let now = congestion_control(lfd).unwrap();
        assert!(now == "cubic" || now == "reno", "{now}");
        let before = unpaced();
        let addr = l.local_addr().unwrap();
        let _local = std::net::TcpStream::connect(addr).unwrap();
        let (local, _) = l.accept().unwrap();
        pacing.accepted(local.as_raw_fd(), true);
        assert_eq!(congestion_control(local.as_raw_fd()), Some(now.clone()));
        assert!(unpaced() > before);
        let _remote = std::net::TcpStream::connect(addr).unwrap();
        let (remote, _) = l.accept().unwrap();
        pacing.accepted(remote.as_raw_fd(), false);
        assert_eq!(
            congestion_control(remote.as_raw_fd()).as_deref(),
            Some("bbr")
        );
        // A listener left as it was: a local connection is switched after.
        let l2 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(set_congestion_control(l2.as_raw_fd(), "bbr"));
        let _c = std::net::TcpStream::connect(l2.local_addr().unwrap()).unwrap();
        let (c, _) = l2.accept().unwrap();
        ListenerPacing::default().accepted(c.as_raw_fd(), true);
        assert_ne!(congestion_control(c.as_raw_fd()).as_deref(), Some("bbr"));
        // The client side, where the host's default is BBR.
        let client = connect(&addr, std::time::Duration::from_secs(5)).unwrap();
        let cc = congestion_control(client.as_raw_fd()).unwrap();
        let host = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .unwrap_or_default();
        if host.trim().starts_with("bbr") {
            assert!(cc == "cubic" || cc == "reno", "{cc}");
        } else {
            assert_eq!(cc, host.trim());
        }
    }
}
