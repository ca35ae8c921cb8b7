//! Filling the page cache in large folios (issue 44).
//!
//! Shard files are written with O_DIRECT, so a GET is what brings their
//! blocks into the page cache, and the kernel's readahead does so in small
//! folios (4 KiB pages at first, larger as a sequential read goes on): a
//! file of a few hundred KiB stays in 4 KiB pages. Every later read of it,
//! and every `sendfile` of it, then looks up and references one folio per
//! 4 KiB: for 1 MiB GETs that doubled the server's cost per byte of a read
//! from the page cache (a read of the same bytes held in large folios costs
//! what a read of a 64 MiB file does).
//!
//! A range that is not all in memory ([`resident`], one `cachestat(2)`) is
//! read in by [`fill`] instead: a read-only mapping asked for huge pages
//! (`MADV_HUGEPAGE`) and faulted in with `MADV_POPULATE_READ`, which makes
//! the kernel read the file into folios as large as the range and its
//! alignment allow. The mapping is never read by Tarn (the bytes are read
//! and verified as before, from the page cache now filled): a page the
//! drive cannot give is an error of the populate, never a signal, and the
//! read that follows meets the same error and deals with it.
//!
//! Where the kernel lacks `cachestat` (before 6.5) or `MADV_POPULATE_READ`
//! (before 5.14), or a sandbox refuses `cachestat`, [`enabled`] turns false
//! and reads go on as before.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(true);
/// Bytes read into the page cache by [`fill`], and fills that failed.
static FILLED: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

/// Turns filling on or off for the process (`--no-large-folios`).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether ranges not in memory are filled in large folios.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// (bytes of ranges filled, fills that failed or were refused).
pub fn counters() -> (u64, u64) {
    (
        FILLED.load(Ordering::Relaxed),
        FAILED.load(Ordering::Relaxed),
    )
}

pub(crate) fn page() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// The pages holding `len` bytes from `offset`: (first byte, length).
fn pages(offset: u64, len: usize) -> (u64, u64) {
    let page = page();
    let start = offset - offset % page;
    let end = (offset + len as u64).div_ceil(page) * page;
    (start, end - start)
}

/// Whether every page of `len` bytes of the file from `offset` is in the
/// page cache (`cachestat(2)`). An error where the kernel has no cachestat
/// or a sandbox refuses it, which also turns filling off for the process.
pub fn resident(fd: &OwnedFd, offset: u64, len: usize) -> io::Result<bool> {
    // (cachestat reads a range of length 0 as "to the end of the file".)
    if len == 0 {
        return Ok(true);
    }
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// The same number on every architecture (the unified syscall table).
    const SYS_CACHESTAT: libc::c_long = 451;
    let (off, len) = pages(offset, len);
    let range = Range { off, len };
    let mut stat = Stat::default();
    // SAFETY: cachestat reads `range` and writes `stat`, live locals of the
    // layouts the kernel defines.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd.as_raw_fd(),
            &raw const range,
            &raw mut stat,
            0u32,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        // No such call here, or a sandbox (seccomp) that refuses it: the
        // same answer every time.
        if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) {
            set_enabled(false);
        }
        return Err(e);
    }
    Ok(stat.nr_cache >= len / page())
}

/// Reads `len` bytes of the file from `offset` into the page cache, in
/// folios as large as the range allows. Blocking (it reads the drive): run
/// it on the blocking pool. An error for a page that cannot be read (an I/O
/// error, the file shorter than the range).
pub fn fill(fd: &OwnedFd, offset: u64, len: usize) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let (start, map_len) = pages(offset, len);
    let map_len = map_len as usize;
    // Unmapped below, never read.
    let base = match map_read_only(fd, start, map_len) {
        Ok(base) => base,
        Err(e) => {
            FAILED.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
    };
    // Refused (THP off) or not, the populate reads the range in.
    // SAFETY: advice on our own mapping.
    unsafe { libc::madvise(base, map_len, libc::MADV_HUGEPAGE) };
    let r = loop {
        // SAFETY: as above; a page that cannot be read is an error here.
        if unsafe { libc::madvise(base, map_len, libc::MADV_POPULATE_READ) } == 0 {
            break Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            if e.raw_os_error() == Some(libc::EINVAL) {
                // A kernel before 5.14.
                set_enabled(false);
            }
            break Err(e);
        }
    };
    // SAFETY: our mapping, unmapped once; nothing refers to it.
    unsafe { libc::munmap(base, map_len) };
    match &r {
        Ok(()) => FILLED.fetch_add(len as u64, Ordering::Relaxed),
        Err(_) => FAILED.fetch_add(1, Ordering::Relaxed),
    };
    r
}

/// A fresh read-only shared mapping of `len` bytes of the file from
/// `start` (a page boundary), not populated; the caller unmaps it.
pub(crate) fn map_read_only(fd: &OwnedFd, start: u64, len: usize) -> io::Result<*mut libc::c_void> {
    // SAFETY: a new mapping of an open descriptor at an address the kernel
    // picks: it aliases nothing of ours.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            start as libc::off_t,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(base)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Drops the file's clean pages from the page cache.
    fn evict(fd: &OwnedFd) {
        // SAFETY: advice on an open descriptor.
        let r = unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
    }

    fn file(dir: &std::path::Path, bytes: &[u8]) -> (std::path::PathBuf, OwnedFd) {
        let path = dir.join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
        let fd = std::fs::File::open(&path).unwrap().into();
        (path, fd)
    }

    #[test]
    fn fills_what_is_not_resident() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..600_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (path, fd) = file(dir.path(), &data);
        evict(&fd);
        // Eviction of clean pages is advice the kernel follows at once,
        // where the file lives on a drive (tmpfs keeps its pages).
        let on_tmpfs = {
            // SAFETY: statfs writes the struct it is given.
            let mut st: libc::statfs = unsafe { std::mem::zeroed() };
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: a NUL-terminated path and a live struct.
            let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
            r == 0 && st.f_type == libc::TMPFS_MAGIC
        };
        if !on_tmpfs {
            assert!(!resident(&fd, 0, data.len()).unwrap());
        }
        for (off, len) in [(1, 4096), (12_345, 300_000), (599_999, 1), (0, 600_000)] {
            fill(&fd, off, len).unwrap();
            assert!(resident(&fd, off, len).unwrap(), "{off} {len}");
        }
        assert!(fill(&fd, 0, 0).is_ok());
        assert!(resident(&fd, 5, 0).unwrap());
        // The bytes read back are the file's.
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }

    /// Pages past the file's end are an error of the fill, never a signal.
    #[test]
    fn a_range_past_the_end_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let (_, fd) = file(dir.path(), &[1u8; 4096]);
        let (_, failed0) = counters();
        assert!(fill(&fd, 0, 3 * 4096).is_err());
        assert!(counters().1 > failed0);
        assert!(fill(&fd, 0, 4096).is_ok());
    }
}
