//! Bytes of a file verified where they lie in the page cache and handed on
//! as a view of the file, never copied out (issue 44).
//!
//! A GET's block sent with `sendfile` (`crate::spans`) still had to be read
//! once, to check its checksum: the read copied it from the page cache into
//! a piece buffer that only the checksum ever looked at. With sixteen GETs
//! in flight those buffers are tens of MiB, so the copy wrote to memory and
//! the checksum read it back from memory: a third of a large GET's server
//! CPU. Here a block is instead read, a slice at a time, into one small
//! buffer per thread that stays in the core's cache ([`with_scratch`]),
//! with a read that never waits for the drive ([`read_cached`]: a block not
//! all in memory is left to the usual path), and the checksum runs over
//! each slice while it is hot.
//!
//! What then goes to the connection is a [`View`]: a read-only shared
//! mapping of the block's bytes in the file, never populated. The
//! connection sends it from the file (the mapping's address is only the
//! key of its `spans` registration, which marks it as a view); nothing in
//! Tarn reads it, so no page-table entry is made and none is torn down
//! (populating mappings of 512 KiB blocks cost more than the copy, issue
//! 44's notes). Were something to read it, it would read the file's bytes,
//! the very ones just verified. A connection whose `sendfile` fails ends
//! the response rather than read the view (a view of a page the drive can
//! no longer give would raise SIGBUS).

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// The per-thread buffer blocks are verified through: small enough to stay
/// in a core's L2 cache with room to spare, large enough that a syscall per
/// slice is nothing.
pub const SCRATCH_BYTES: usize = 128 << 10;

/// Bytes handed on as views, and stripes that could not be (a block not all
/// in the page cache, a checksum that did not match, a mapping refused).
static VIEWED: AtomicU64 = AtomicU64::new(0);
static MISSED: AtomicU64 = AtomicU64::new(0);

/// (bytes sent as views of their files, stripes left to the usual path).
pub fn counters() -> (u64, u64) {
    (
        VIEWED.load(Ordering::Relaxed),
        MISSED.load(Ordering::Relaxed),
    )
}

/// Counts bytes handed on as views (`Some`) or a stripe left to the usual
/// path (`None`).
pub fn count(viewed: Option<usize>) {
    match viewed {
        Some(n) => VIEWED.fetch_add(n as u64, Ordering::Relaxed),
        None => MISSED.fetch_add(1, Ordering::Relaxed),
    };
}

thread_local! {
    static SCRATCH: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; SCRATCH_BYTES].into_boxed_slice());
}

/// Runs `f` with this thread's scratch buffer (`SCRATCH_BYTES`). Not
/// reentrant: `f` must not call it again.
pub fn with_scratch<R>(f: impl FnOnce(&mut [u8]) -> R) -> R {
    SCRATCH.with(|s| f(&mut s.borrow_mut()))
}

/// Reads `buf.len()` bytes of the file from `offset` if they are all in the
/// page cache, without waiting for the drive (`preadv2` with `RWF_NOWAIT`):
/// Ok(false) when some are not (or the read came up short), an error for
/// anything else.
pub fn read_cached(fd: &OwnedFd, offset: u64, buf: &mut [u8]) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        let iov = libc::iovec {
            iov_base: buf[done..].as_mut_ptr().cast(),
            iov_len: buf.len() - done,
        };
        // SAFETY: one iovec over the live, writable rest of `buf`.
        let n = unsafe {
            libc::preadv2(
                fd.as_raw_fd(),
                &iov,
                1,
                (offset + done as u64) as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) => return Ok(false),
                _ => return Err(e),
            }
        }
        if n == 0 {
            return Ok(false);
        }
        done += n as usize;
    }
    Ok(true)
}

/// A read-only view of `len` bytes of a file: a shared mapping, never
/// populated by Tarn, unmapped when dropped.
#[derive(Debug)]
pub struct View {
    base: *mut libc::c_void,
    map_len: usize,
    /// The view's first byte in the mapping (the mapping starts at a page).
    at: usize,
    len: usize,
}

// SAFETY: the mapping is read-only and owned by the view alone; it is
// unmapped once, by Drop.
unsafe impl Send for View {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for View {}

impl View {
    /// A view of `len` (> 0) bytes of the file from `offset`.
    pub fn map(fd: &OwnedFd, offset: u64, len: usize) -> io::Result<View> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a view of no bytes",
            ));
        }
        let start = offset - offset % crate::pagecache::page();
        let at = (offset - start) as usize;
        let map_len = at + len;
        // Owned by the view from here.
        let base = crate::pagecache::map_read_only(fd, start, map_len)?;
        Ok(View {
            base,
            map_len,
            at,
            len,
        })
    }
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `at..at + len` lies in the live mapping; reading it (which
        // Tarn does not do) reads the file.
        unsafe { std::slice::from_raw_parts(self.base.cast::<u8>().add(self.at), self.len) }
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once; its registration (if any) is
        // dropped before the view (the owner's fields drop in order).
        unsafe { libc::munmap(self.base, self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(dir: &std::path::Path, bytes: &[u8]) -> OwnedFd {
        let path = dir.join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
        std::fs::File::open(&path).unwrap().into()
    }

    #[test]
    fn reads_what_is_cached_and_views_any_range() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + i / 257) as u8).collect();
        let fd = file(dir.path(), &data);
        // Written through the page cache: all of it is there.
        let mut buf = vec![0u8; 70_001];
        assert!(read_cached(&fd, 12_345, &mut buf).unwrap());
        assert_eq!(buf, data[12_345..12_345 + 70_001]);
        // Past the end: short, so not read.
        let mut tail = vec![0u8; 10];
        assert!(!read_cached(&fd, 299_995, &mut tail).unwrap());
        for (off, len) in [(0, 1), (1, 4096), (4095, 2), (100_000, 200_000)] {
            let v = View::map(&fd, off, len).unwrap();
            assert_eq!(v.as_ref(), &data[off as usize..off as usize + len]);
        }
        assert!(View::map(&fd, 0, 0).is_err());
    }

    /// A block dropped from the page cache is not read (the usual path
    /// reads it), where the file system lets its pages go.
    #[test]
    fn does_not_wait_for_the_drive() {
        let dir = tempfile::tempdir().unwrap();
        let data = vec![7u8; 1 << 20];
        let fd = file(dir.path(), &data);
        // SAFETY: advice on an open descriptor.
        let r = unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path and a live struct.
        let on_tmpfs =
            unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type == libc::TMPFS_MAGIC;
        let mut buf = vec![0u8; SCRATCH_BYTES];
        let got = read_cached(&fd, 512 << 10, &mut buf).unwrap();
        assert!(got == on_tmpfs, "read {got} on tmpfs {on_tmpfs}");
        with_scratch(|s| assert_eq!(s.len(), SCRATCH_BYTES));
    }
}
