//! Host memory whose pages a short-circuit read may map from the shard files
//! instead of copying into them (`docs/local-reads.md`, "Mapped reads").
//!
//! A [`HostMemory`] is an anonymous private mapping the client made itself
//! and keeps a record of, so a read whose destination lies in one may put
//! `MAP_FIXED` mappings of a shard file's pages over whole pages of it. Each
//! such run is a private (copy-on-write) mapping of the file's page-cache
//! pages, locked before it is checked: a page the checksum passed can be
//! neither evicted nor read again from the drive while it is mapped, so what
//! was verified is what stays there. A write to it copies the page, as with
//! any private mapping; the file never changes. Dropping the memory unmaps
//! everything, and the pages are the page cache's to evict again.
//!
//! Nothing is mapped where the pages could not be locked (`RLIMIT_MEMLOCK`
//! without `CAP_IPC_LOCK`), where the kernel lacks `MADV_POPULATE_READ`, or
//! past a budget of mappings (a quarter of `vm.max_map_count`, each run
//! taking up to three of the process's mappings): those reads copy, as into
//! any memory.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tarn_wire::proto::Crc32c;

pub(crate) const PAGE: usize = 4096;
/// Runs shorter than this are copied: the mapping's system calls cost more
/// than copying so few bytes.
pub(crate) const MAP_MIN_BYTES: usize = 64 << 10;

/// Live regions: start address → the region.
static REGIONS: Mutex<BTreeMap<usize, Arc<RegionInfo>>> = Mutex::new(BTreeMap::new());
/// Mapped runs alive in every region, against [`budget`].
static RUNS: AtomicUsize = AtomicUsize::new(0);
/// Set once locking or populating was refused: nothing is mapped any more.
static REFUSED: AtomicBool = AtomicBool::new(false);

pub(crate) struct RegionInfo {
    len: usize,
    /// Mapped runs in this region, given back to [`RUNS`] when it goes.
    runs: AtomicUsize,
}

/// Anonymous, page-aligned, zeroed memory that reads may map file pages
/// into. Unmapped (with everything mapped into it) when dropped.
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    info: Arc<RegionInfo>,
}

// SAFETY: plain memory; who writes it is the caller's business, as for any
// buffer the rings read into.
unsafe impl Send for HostMemory {}
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// `len` bytes (rounded up to whole pages in the mapping; `len()` stays
    /// `len`).
    pub fn new(len: usize) -> std::io::Result<HostMemory> {
        let mapped = len.max(1).next_multiple_of(PAGE);
        // SAFETY: a fresh mapping (no address asked for), owned by the
        // value returned.
        let ptr = unsafe { map_anonymous(None, mapped) }?;
        let info = Arc::new(RegionInfo {
            len: mapped,
            runs: AtomicUsize::new(0),
        });
        lock_regions().insert(ptr as usize, info.clone());
        Ok(HostMemory {
            ptr: ptr.cast(),
            len,
            info,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Runs of file pages mapped into it.
    pub fn mapped_runs(&self) -> usize {
        self.info.runs.load(Ordering::Relaxed)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        lock_regions().remove(&(self.ptr as usize));
        RUNS.fetch_sub(self.info.runs.load(Ordering::Relaxed), Ordering::Relaxed);
        // SAFETY: the mapping this value made; nothing refers to it any more
        // (reads into it hold the value).
        unsafe { libc::munmap(self.ptr.cast(), self.info.len) };
    }
}

fn lock_regions() -> std::sync::MutexGuard<'static, BTreeMap<usize, Arc<RegionInfo>>> {
    REGIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The region `[ptr, ptr + len)` lies in, if any.
fn region_of(ptr: usize, len: usize) -> Option<Arc<RegionInfo>> {
    let regions = lock_regions();
    let (&start, info) = regions.range(..=ptr).next_back()?;
    (ptr + len <= start + info.len).then(|| info.clone())
}

/// Mapped runs allowed at once.
fn budget() -> usize {
    static BUDGET: OnceLock<usize> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65530)
            / 4
    })
}

/// What [`map_block_run`] did.
pub(crate) enum Mapped {
    /// The run is mapped and checked, the rest of the segment copied.
    Done,
    /// Not mapped (not host memory, misaligned, too short, over budget,
    /// refused): read it as usual. Nothing in `dst` changed.
    No,
    /// The block could not be read or failed its checksum; `dst`'s mapped
    /// pages are anonymous zeroes again.
    Failed(String),
}

/// One block's bytes, for [`map_block_run`].
pub(crate) struct Block<'a> {
    pub fd: &'a OwnedFd,
    /// Where the block starts in the file.
    pub offset: u64,
    pub len: usize,
    pub crc: u32,
}

/// Puts the whole pages of `dst` (which holds block bytes `[in_block,
/// in_block + dst.len())`) as a locked private mapping of the file's pages,
/// checks the block's checksum over them and the block's other bytes (read
/// into `scratch`), and copies the partial pages at `dst`'s ends from
/// `scratch`.
pub(crate) fn map_block_run(
    dst: &mut [u8],
    block: &Block<'_>,
    in_block: usize,
    scratch: &mut Vec<u8>,
) -> Mapped {
    if REFUSED.load(Ordering::Relaxed) {
        return Mapped::No;
    }
    let addr = dst.as_ptr() as usize;
    let file_at = block.offset + in_block as u64;
    if addr % PAGE != (file_at % PAGE as u64) as usize {
        return Mapped::No;
    }
    let a = addr.next_multiple_of(PAGE);
    let b = (addr + dst.len()) / PAGE * PAGE;
    if b <= a || b - a < MAP_MIN_BYTES {
        return Mapped::No;
    }
    let Some(region) = region_of(addr, dst.len()) else {
        return Mapped::No;
    };
    if RUNS.fetch_add(1, Ordering::Relaxed) >= budget() {
        RUNS.fetch_sub(1, Ordering::Relaxed);
        return Mapped::No;
    }
    let run = b - a;
    let run_at = file_at + (a - addr) as u64;
    // What a run that is not kept leaves: anonymous zeroes, as before.
    let undo = || {
        anonymous_again(a, run);
        RUNS.fetch_sub(1, Ordering::Relaxed);
    };
    // SAFETY: [a, b) lies in a live region this client mapped (its owner is
    // kept by the read), whole pages that only this read writes.
    let got = unsafe {
        libc::mmap(
            a as *mut libc::c_void,
            run,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            block.fd.as_raw_fd(),
            run_at as libc::off_t,
        )
    };
    if got == libc::MAP_FAILED {
        // A failed MAP_FIXED may have unmapped the range.
        undo();
        return Mapped::No;
    }
    // Locked before it is populated and checked: a page that is checked
    // stays the page that was checked.
    // SAFETY: mlock2 and madvise on the run just mapped.
    let locked = unsafe {
        libc::syscall(
            libc::SYS_mlock2,
            a as *mut libc::c_void,
            run,
            libc::MLOCK_ONFAULT,
        )
    } == 0;
    let populated = locked
        && unsafe { libc::madvise(a as *mut libc::c_void, run, libc::MADV_POPULATE_READ) } == 0;
    if !populated {
        let e = std::io::Error::last_os_error();
        undo();
        // Not allowed to lock, or a kernel without MADV_POPULATE_READ: never
        // again. A page the drive could not give (EFAULT): the usual path,
        // which falls back for this block.
        return match e.raw_os_error() {
            Some(libc::EFAULT) | Some(libc::EIO) if locked => {
                Mapped::Failed(format!("the shard file's pages could not be read: {e}"))
            }
            _ => {
                REFUSED.store(true, Ordering::Relaxed);
                Mapped::No
            }
        };
    }
    // The block's bytes before and after the run, read into `scratch`.
    let head = in_block + (a - addr);
    let tail = head + run;
    if scratch.len() < block.len {
        scratch.resize(block.len, 0);
    }
    let scratch = &mut scratch[..block.len];
    let read =
        super::local::pread_exact(block.fd, &mut scratch[..head], block.offset).and_then(|()| {
            super::local::pread_exact(block.fd, &mut scratch[tail..], block.offset + tail as u64)
        });
    if let Err(e) = read {
        undo();
        return Mapped::Failed(e.to_string());
    }
    let mut crc = Crc32c::default();
    crc.update(&scratch[..head]);
    // SAFETY: the run is mapped, populated and locked: reading it faults on
    // nothing.
    crc.update(unsafe { std::slice::from_raw_parts(a as *const u8, run) });
    crc.update(&scratch[tail..]);
    if crc.finish() != block.crc {
        undo();
        return Mapped::Failed("a shard block failed its checksum".into());
    }
    region.runs.fetch_add(1, Ordering::Relaxed);
    let lead = a - addr;
    dst[..lead].copy_from_slice(&scratch[in_block..head]);
    let trail = addr + dst.len() - b;
    let n = dst.len();
    dst[n - trail..].copy_from_slice(&scratch[tail..tail + trail]);
    Mapped::Done
}

/// Puts fresh anonymous pages over `[a, a + len)` of a region.
fn anonymous_again(a: usize, len: usize) {
    // SAFETY: the range lies in a live region of this client's (see
    // map_block_run); anonymous zeroes are what it held before.
    let got = unsafe { map_anonymous(Some(a), len) };
    // Without its pages the region would fault on the next write: nothing
    // else can be done about an mmap that fails here.
    if let Err(e) = got {
        panic!("could not restore anonymous pages: {e}");
    }
}

/// Zeroed private memory, at `at` (MAP_FIXED) or where the kernel puts it.
///
/// # Safety
/// With `at`, the range must be memory the caller owns and nothing else
/// refers to the pages it replaces.
unsafe fn map_anonymous(at: Option<usize>, len: usize) -> std::io::Result<*mut libc::c_void> {
    let fixed = if at.is_some() { libc::MAP_FIXED } else { 0 };
    // SAFETY: as the caller promises.
    let ptr = unsafe {
        libc::mmap(
            at.unwrap_or(0) as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(ptr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// A file in the temporary directory, removed when dropped.
    struct TempFile(std::path::PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn file_with(bytes: &[u8]) -> (TempFile, OwnedFd) {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tarn-hostmem-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = std::fs::File::create(&p).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
        let fd = std::fs::File::open(&p).unwrap().into();
        (TempFile(p), fd)
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn a_run_is_mapped_checked_and_copy_on_write() {
        let block = pattern(512 << 10, 7);
        let mut file = pattern(8192, 1);
        file.extend_from_slice(&block);
        let (path, fd) = file_with(&file);
        let crc = tarn_wire::proto::crc32c(&block);
        let b = Block {
            fd: &fd,
            offset: 8192,
            len: block.len(),
            crc,
        };
        // The segment: block bytes [1000, 1000 + 400 KiB), at an address
        // congruent to their file offset.
        let mem = HostMemory::new(1 << 20).unwrap();
        let len = 400 << 10;
        let dst = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr().add(1000), len) };
        let mut scratch = Vec::new();
        assert!(matches!(
            map_block_run(dst, &b, 1000, &mut scratch),
            Mapped::Done
        ));
        assert_eq!(mem.mapped_runs(), 1);
        assert_eq!(&dst[..], &block[1000..1000 + len]);
        // The run is the file's pages, not a copy.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let name = path.0.to_str().unwrap();
        assert!(maps.lines().any(|l| l.ends_with(name)), "{maps}");
        // Writes copy the page; the file is unchanged.
        dst[5000] ^= 0xff;
        dst[0] ^= 0xff;
        assert_ne!(dst[5000], block[6000]);
        assert_eq!(std::fs::read(&path.0).unwrap(), file);
        drop(mem);
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(!maps.lines().any(|l| l.ends_with(name)), "{maps}");
    }

    #[test]
    fn a_failed_checksum_leaves_zeroes_and_misaligned_runs_are_not_mapped() {
        let block = pattern(256 << 10, 3);
        let (_path, fd) = file_with(&block);
        let wrong = Block {
            fd: &fd,
            offset: 0,
            len: block.len(),
            crc: tarn_wire::proto::crc32c(&block) ^ 1,
        };
        let mem = HostMemory::new(256 << 10).unwrap();
        let dst = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr(), 256 << 10) };
        let mut scratch = Vec::new();
        assert!(matches!(
            map_block_run(dst, &wrong, 0, &mut scratch),
            Mapped::Failed(_)
        ));
        assert!(dst.iter().all(|&x| x == 0));
        assert_eq!(mem.mapped_runs(), 0);
        let right = Block {
            crc: tarn_wire::proto::crc32c(&block),
            ..wrong
        };
        // Address and file offset not congruent modulo a page.
        let off = unsafe { std::slice::from_raw_parts_mut(mem.as_ptr().add(8), 128 << 10) };
        assert!(matches!(
            map_block_run(off, &right, 0, &mut scratch),
            Mapped::No
        ));
        // Memory that is not a HostMemory's.
        let mut plain = vec![0u8; 256 << 10];
        assert!(matches!(
            map_block_run(&mut plain, &right, 0, &mut scratch),
            Mapped::No
        ));
    }
}
