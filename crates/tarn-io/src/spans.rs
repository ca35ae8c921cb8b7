//! Memory known to hold a span of a file, byte for byte, so that a plain
//! socket can send those bytes from the file instead (`sendfile`): the
//! kernel then hands the file's page-cache pages to the socket, and the
//! copy of every byte into the socket's buffers is not made (issue 44: a
//! third of a large GET's server CPU went to that copy).
//!
//! The store registers a GET piece's bytes that it read, and verified,
//! from a shard file ([`register`]); the connection's writer asks, for
//! what hyper hands it, whether a run of it is registered ([`plan`]) and
//! sends that run with `sendfile`. Anything else, and any `sendfile` that
//! fails or finds the file shorter, is written from memory as before: the
//! memory holds the same bytes, so either way the client gets them.
//!
//! The contract that makes it right: registered memory is not written and
//! not freed while its [`Registration`] lives (the registration is dropped
//! first), and the file's bytes at that offset do not change. Shard files
//! are written once under a temporary name and never written in place;
//! only something with the server's own uid could change one, and that
//! could change its checksums as well.

use std::collections::BTreeMap;
use std::io::IoSlice;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

static ENABLED: AtomicBool = AtomicBool::new(true);
/// Bytes sent from files, and sends that fell back to memory.
static SENT: AtomicU64 = AtomicU64::new(0);
static FALLBACKS: AtomicU64 = AtomicU64::new(0);

/// Turns sending from files on or off for the process (`--no-sendfile`):
/// off, nothing is registered and every write is from memory.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether runs are registered and sent from their files.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// (bytes sent from files, sends that could not send from the file and
/// wrote the bytes from memory instead).
pub fn counters() -> (u64, u64) {
    (
        SENT.load(Ordering::Relaxed),
        FALLBACKS.load(Ordering::Relaxed),
    )
}

/// Counts a send from a file (`Some(bytes)`) or a fallback (`None`).
pub fn count(sent: Option<usize>) {
    match sent {
        Some(n) => SENT.fetch_add(n as u64, Ordering::Relaxed),
        None => FALLBACKS.fetch_add(1, Ordering::Relaxed),
    };
}

struct Entry {
    len: usize,
    fd: Arc<OwnedFd>,
    offset: u64,
    /// The memory is a view of the file (`crate::view`), not to be read.
    view: bool,
}

/// Registered runs by their first address.
static SPANS: RwLock<BTreeMap<usize, Entry>> = RwLock::new(BTreeMap::new());

fn spans() -> std::sync::RwLockReadGuard<'static, BTreeMap<usize, Entry>> {
    SPANS.read().unwrap_or_else(|p| p.into_inner())
}

/// A registered run; dropping it unregisters the run.
#[must_use = "the run is unregistered when this is dropped"]
#[derive(Debug)]
pub struct Registration {
    start: usize,
}

impl Drop for Registration {
    fn drop(&mut self) {
        SPANS
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.start);
    }
}

/// Registers `bytes` as holding bytes `offset..offset + bytes.len()` of the
/// file `fd`. None for an empty run, or when sending from files is off.
///
/// # Safety
/// Until the registration is dropped, the memory of `bytes` must stay
/// allocated and unchanged, and the file's bytes at that offset must not
/// change; a run must not overlap another registered one.
pub unsafe fn register(bytes: &[u8], fd: Arc<OwnedFd>, offset: u64) -> Option<Registration> {
    // SAFETY: the caller's promise.
    unsafe { insert(bytes, fd, offset, false) }
}

/// Registers `view`, a view of `fd`'s bytes from `offset`, to be sent from
/// the file only: a connection whose `sendfile` fails ends the response
/// instead of writing the view from memory. None when sending from files is
/// off (the caller then must not hand the view on).
pub fn register_view(
    view: &crate::view::View,
    fd: Arc<OwnedFd>,
    offset: u64,
) -> Option<Registration> {
    // SAFETY: a view's memory is the file's bytes at `offset` (shard files
    // are never written in place) and lives as long as the view, which its
    // owner drops after the registration; views never overlap (each is its
    // own mapping).
    unsafe { insert(view.as_ref(), fd, offset, true) }
}

/// # Safety
/// As for [`register`].
unsafe fn insert(bytes: &[u8], fd: Arc<OwnedFd>, offset: u64, view: bool) -> Option<Registration> {
    if bytes.is_empty() || !enabled() {
        return None;
    }
    let start = bytes.as_ptr() as usize;
    let mut m = SPANS.write().unwrap_or_else(|p| p.into_inner());
    debug_assert!(
        m.range(..start + bytes.len())
            .next_back()
            .is_none_or(|(s, e)| s + e.len <= start),
        "overlapping registrations"
    );
    m.insert(
        start,
        Entry {
            len: bytes.len(),
            fd,
            offset,
            view,
        },
    );
    Some(Registration { start })
}

/// What to do with the front of a vectored write.
#[derive(Debug)]
pub enum Plan {
    /// Nothing in the write is registered: write it all from memory.
    All,
    /// Write the first `n` bytes from memory: those before the first
    /// registered byte.
    Memory(usize),
    /// The first `len` bytes are the file's from `offset`: send them from
    /// the file. `view`: their memory is a view of the file, sent from the
    /// file or not at all.
    File {
        fd: Arc<OwnedFd>,
        offset: u64,
        len: usize,
        view: bool,
    },
}

/// How the front of `bufs` is best written.
pub fn plan(bufs: &[IoSlice<'_>]) -> Plan {
    if !enabled() {
        return Plan::All;
    }
    let m = spans();
    let mut before = 0usize;
    for b in bufs {
        if b.is_empty() {
            continue;
        }
        let (a, z) = (b.as_ptr() as usize, b.as_ptr() as usize + b.len());
        // A run that holds the slice's first byte.
        if let Some((&s, e)) = m.range(..=a).next_back() {
            if s + e.len > a {
                if before > 0 {
                    return Plan::Memory(before);
                }
                return Plan::File {
                    fd: e.fd.clone(),
                    offset: e.offset + (a - s) as u64,
                    len: (s + e.len).min(z) - a,
                    view: e.view,
                };
            }
        }
        // Else the first run that starts inside the slice.
        if let Some((&s, _)) = m.range(a + 1..z).next() {
            return Plan::Memory(before + (s - a));
        }
        before += b.len();
    }
    Plan::All
}

/// The first `n` bytes of `bufs`, as slices.
pub fn prefix<'a>(bufs: &'a [IoSlice<'a>], mut n: usize) -> Vec<IoSlice<'a>> {
    let mut out = Vec::with_capacity(bufs.len());
    for b in bufs {
        if n == 0 {
            break;
        }
        let take = n.min(b.len());
        let s: &'a [u8] = b;
        out.push(IoSlice::new(&s[..take]));
        n -= take;
    }
    out
}

/// Sends up to `len` bytes of `file` from `offset` on `socket` (a
/// non-blocking socket: `WouldBlock` when it has no room). Ok(0): the file
/// ended before `offset`.
pub fn sendfile(
    socket: std::os::fd::RawFd,
    file: &OwnedFd,
    offset: u64,
    len: usize,
) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut off = offset as libc::off_t;
    // SAFETY: both descriptors are open for the call; `off` is a live
    // local the kernel updates.
    let n = unsafe { libc::sendfile(socket, file.as_raw_fd(), &mut off, len) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> Arc<OwnedFd> {
        Arc::new(std::fs::File::open("/dev/null").unwrap().into())
    }

    #[test]
    fn plans_the_front_of_a_write() {
        let a = vec![1u8; 100];
        let b = vec![2u8; 100];
        let c = vec![3u8; 100];
        let bufs = [IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&c)];
        assert!(matches!(plan(&bufs), Plan::All));
        // SAFETY: the vectors outlive the registrations and are not changed.
        let r = unsafe { register(&b[10..60], fd(), 1000) }.unwrap();
        assert!(matches!(plan(&bufs), Plan::Memory(110)));
        let rest = [IoSlice::new(&b[10..]), IoSlice::new(&c)];
        match plan(&rest) {
            Plan::File { offset, len, .. } => assert_eq!((offset, len), (1000, 50)),
            p => panic!("{p:?}"),
        }
        // From inside the run.
        let mid = [IoSlice::new(&b[30..])];
        match plan(&mid) {
            Plan::File { offset, len, .. } => assert_eq!((offset, len), (1020, 30)),
            p => panic!("{p:?}"),
        }
        let after = [IoSlice::new(&b[60..])];
        assert!(matches!(plan(&after), Plan::All));
        // Two runs in one slice: the first one first.
        // SAFETY: as above.
        let r2 = unsafe { register(&b[70..80], fd(), 5000) }.unwrap();
        match plan(&rest) {
            Plan::File { offset, len, .. } => assert_eq!((offset, len), (1000, 50)),
            p => panic!("{p:?}"),
        }
        assert!(matches!(plan(&after), Plan::Memory(10)));
        let inside = [IoSlice::new(&b[75..])];
        match plan(&inside) {
            Plan::File { offset, len, .. } => assert_eq!((offset, len), (5005, 5)),
            p => panic!("{p:?}"),
        }
        drop(r2);
        drop(r);
        assert!(matches!(plan(&rest), Plan::All));
        let p = prefix(&bufs, 150);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].len(), p[1].len()), (100, 50));
    }

    #[test]
    fn sends_a_file_span() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        let dir = std::env::temp_dir().join(format!("tarn-spans-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::File::create(&path)
            .unwrap()
            .write_all(b"0123456789")
            .unwrap();
        let file: OwnedFd = std::fs::File::open(&path).unwrap().into();
        let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(sendfile(tx.as_raw_fd(), &file, 3, 4).unwrap(), 4);
        assert_eq!(sendfile(tx.as_raw_fd(), &file, 20, 4).unwrap(), 0);
        drop(tx);
        let mut got = Vec::new();
        rx.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"3456");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
