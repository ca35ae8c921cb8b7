//! File descriptors and the connections that may take them (issue 40).
//!
//! 1,100 idle unauthenticated connections against a soft limit of 1,024
//! left the drives no descriptor to open: every drive was marked faulty
//! ("Too many open files"), GETs answered 500 and PUTs 503. So at start the
//! soft limit is raised to the hard one, and S3 connections are capped below
//! it, in all and per client address, leaving the rest to the drives (their
//! indexes, the shard files of requests in flight), etcd and the cluster's
//! RPC. A connection over a cap is closed at once and counted; one client
//! that opens thousands cannot take the others' share.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Descriptors kept for everything but S3 connections, whatever the
/// limit: the listeners, etcd, logs, the admin port, a runtime's own.
const FD_RESERVE_FIXED: u64 = 256;
/// And per local drive: its metadata index's files (journals, tables).
const FD_RESERVE_PER_DRIVE: u64 = 64;
/// The least the caps come to, however low the limit.
const CONNECTIONS_MAX_MIN: usize = 64;
const PER_CLIENT_MAX_MIN: usize = 16;

/// Raises this process's soft limit of open files to its hard limit and
/// returns the limit now in force.
pub fn raise_nofile() -> u64 {
    // SAFETY: getrlimit/setrlimit on a zeroed struct of the right type.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024;
        }
        if r.rlim_cur < r.rlim_max {
            let want = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                r.rlim_cur = r.rlim_max;
            } else {
                tracing::warn!(soft = r.rlim_cur, hard = r.rlim_max, error = %std::io::Error::last_os_error(), "could not raise the open-files limit");
            }
        }
        r.rlim_cur as u64
    }
}

/// The default caps for a limit of `nofile` descriptors and `drives` local
/// drives: half of what the reserve leaves for connections (the other half
/// for the shard files of the requests they carry), a quarter of that for
/// one client address.
pub fn default_caps(nofile: u64, drives: usize) -> (usize, usize) {
    let reserve = FD_RESERVE_FIXED + FD_RESERVE_PER_DRIVE * drives as u64;
    let total = ((nofile.saturating_sub(reserve)) / 2) as usize;
    let total = total.max(CONNECTIONS_MAX_MIN);
    (total, (total / 4).max(PER_CLIENT_MAX_MIN))
}

/// The default KV connection caps for a limit of `nofile` descriptors: an
/// eighth of what the fixed reserve leaves (at least 64, at most the KV
/// server's own default), three quarters of that for one tenant's
/// authenticated connections.
pub fn kv_default_caps(nofile: u64) -> (usize, usize) {
    let total = ((nofile.saturating_sub(FD_RESERVE_FIXED)) / 8) as usize;
    let total = total.clamp(
        CONNECTIONS_MAX_MIN,
        tarn_kv::server::CONNECTIONS_MAX_DEFAULT,
    );
    (total, (total * 3 / 4).max(1))
}

/// Open S3 connections, in all and per client address, against their caps.
pub struct Connections {
    max: usize,
    per_client_max: usize,
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Refused for the cap in all, for one client's cap, and accepts that
    /// failed (out of descriptors despite the caps).
    pub refused_total: AtomicU64,
    pub refused_per_client: AtomicU64,
    pub accept_errors: AtomicU64,
}

/// One admitted connection; its slot is given back when dropped.
pub struct Admitted {
    conns: Arc<Connections>,
    peer: IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.conns.open.lock().unwrap_or_else(|p| p.into_inner());
        open.0 -= 1;
        if let Some(n) = open.1.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.peer);
            }
        }
    }
}

impl Connections {
    pub fn new(max: usize, per_client_max: usize) -> Arc<Connections> {
        Arc::new(Connections {
            max,
            per_client_max: per_client_max.min(max),
            open: Mutex::default(),
            refused_total: AtomicU64::new(0),
            refused_per_client: AtomicU64::new(0),
            accept_errors: AtomicU64::new(0),
        })
    }

    pub fn max(&self) -> usize {
        self.max
    }

    pub fn per_client_max(&self) -> usize {
        self.per_client_max
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// A slot for a new connection from `peer`, or None (counted) when a cap
    /// is reached.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Admitted> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.0 >= self.max {
            self.refused_total.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let n = open.1.entry(peer).or_insert(0);
        if *n >= self.per_client_max {
            self.refused_per_client.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *n += 1;
        open.0 += 1;
        Some(Admitted {
            conns: self.clone(),
            peer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_in_all_and_per_client_and_slots_come_back() {
        let c = Connections::new(5, 3);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let held: Vec<_> = (0..3).map(|_| c.admit(a).unwrap()).collect();
        assert!(c.admit(a).is_none(), "one client's cap");
        let more: Vec<_> = (0..2).map(|_| c.admit(b).unwrap()).collect();
        assert!(c.admit(b).is_none(), "the cap in all");
        assert_eq!(c.refused_per_client.load(Ordering::Relaxed), 1);
        assert_eq!(c.refused_total.load(Ordering::Relaxed), 1);
        assert_eq!(c.open(), 5);
        drop(held);
        assert_eq!(c.open(), 2);
        assert!(c.admit(a).is_some());
        drop(more);
    }

    #[test]
    fn defaults_leave_the_drives_their_share() {
        // A soft limit of 1,024 raised to nothing more, four drives.
        assert_eq!(default_caps(1024, 4), (256, 64));
        assert_eq!(default_caps(20_000, 4), (9744, 2436));
        assert_eq!(default_caps(100, 4), (64, 16));
        assert_eq!(kv_default_caps(1024), (96, 72));
        assert_eq!(kv_default_caps(20_000), (2468, 1851));
        assert_eq!(kv_default_caps(1 << 20), (4096, 3072));
    }
}
