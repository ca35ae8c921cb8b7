//! The RAM tier's memory: one preallocated shared-memory file (memfd), mapped
//! by the daemon and by every same-host client.
//!
//! Layout (see docs/kv-protocol.md, "Arena"):
//! ```text
//! 0                 header page (4 KiB): magic, version, geometry
//! 4096              generation table: one u32 per possible slot
//! data_offset       slab pages, page_size_bytes each (2 MiB aligned)
//! ```
//! The generation of a slot changes every time the slot is freed, so a client
//! that copied bytes out of a slot can tell whether the slot was reused while
//! it copied (a seqlock with the server as the only writer of generations).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

pub const ARENA_MAGIC: u64 = u64::from_le_bytes(*b"TARNKVA1");
pub const ARENA_HEADER_BYTES: usize = 4096;
/// Data pages start on a huge-page boundary.
pub const ARENA_DATA_ALIGN: usize = 2 << 20;

/// Whether the arena lives on huge pages (hugetlbfs, 2 MiB). A client maps
/// the whole arena; on 4 KiB pages its first touch of each 64 KiB costs a
/// page fault (the kernel maps 16 pages per read fault), on huge pages one
/// fault per 2 MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugePages {
    /// Huge pages when enough are reserved, else 4 KiB pages (logged).
    #[default]
    Auto,
    /// Huge pages or refuse to start.
    On,
    /// 4 KiB pages.
    Off,
}

impl std::str::FromStr for HugePages {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(HugePages::Auto),
            "on" => Ok(HugePages::On),
            "off" => Ok(HugePages::Off),
            other => Err(format!("huge pages: auto, on or off, not {other:?}")),
        }
    }
}

/// Reserved huge pages the machine has free, from /proc/meminfo.
fn huge_pages_free() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("HugePages_Free:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A mapped arena. The daemon creates it and maps it writable; clients map
/// the fd it sends them read-only, and the kernel refuses them anything else.
pub struct Arena {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
    pub huge_pages: bool,
    /// The memfd is sealed so that no writable mapping of it can be made any
    /// more (F_SEAL_FUTURE_WRITE), checked by trying: only then may clients
    /// be given it. The daemon's own mapping predates the seal.
    pub write_sealed: bool,
    pub geometry: Geometry,
    prefault: Option<Prefault>,
}

/// Faults the mapping in on a background thread. A first touch costs a page
/// fault per 4 KiB page (~2.5 µs each on the VM we test on: 15 s for 6 GiB),
/// which must not happen in the middle of gets, nor delay start-up or connect.
struct Prefault {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Bytes populated per step; the thread checks for a stop between steps.
const PREFAULT_STEP_BYTES: usize = 64 << 20;

impl Prefault {
    /// Populates the daemon's writable mapping (pages allocated as for a
    /// write).
    fn start(base: *mut u8, len: usize) -> Option<Prefault> {
        let advice = libc::MADV_POPULATE_WRITE;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let addr = base as usize;
        let thread = std::thread::Builder::new()
            .name("tarn-kv-prefault".into())
            .spawn(move || {
                let mut at = 0;
                while at < len && !flag.load(Ordering::Relaxed) {
                    let n = PREFAULT_STEP_BYTES.min(len - at);
                    // SAFETY: a range of our live mapping (Drop joins this
                    // thread before unmapping). Populating changes no bytes.
                    let rc = unsafe { libc::madvise((addr + at) as *mut libc::c_void, n, advice) };
                    if rc != 0 {
                        // Older kernels: pages fault in on first use instead.
                        return;
                    }
                    at += n;
                }
            })
            .ok()?;
        Some(Prefault {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// SAFETY: the mapping is shared memory; all access goes through raw pointers
// with ownership rules enforced by the engine (reservations, read refs).
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

/// Where things are in the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub page_size_bytes: usize,
    pub page_count: usize,
    /// Slots a page can hold in the smallest class: the generation table has
    /// `page_count * slots_per_page_max` entries.
    pub slots_per_page_max: usize,
    pub data_offset: usize,
}

impl Geometry {
    pub fn new(page_size_bytes: usize, page_count: usize, slot_min_bytes: usize) -> Geometry {
        let slots_per_page_max = page_size_bytes / slot_min_bytes;
        let gen_bytes = page_count * slots_per_page_max * 4;
        let data_offset = (ARENA_HEADER_BYTES + gen_bytes).next_multiple_of(ARENA_DATA_ALIGN);
        Geometry {
            page_size_bytes,
            page_count,
            slots_per_page_max,
            data_offset,
        }
    }
    pub fn total_bytes(&self) -> usize {
        self.data_offset + self.page_size_bytes * self.page_count
    }
    fn encode(&self) -> [u8; 40] {
        let mut b = [0u8; 40];
        b[0..8].copy_from_slice(&ARENA_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&(self.page_size_bytes as u64).to_le_bytes());
        b[16..24].copy_from_slice(&(self.page_count as u64).to_le_bytes());
        b[24..32].copy_from_slice(&(self.slots_per_page_max as u64).to_le_bytes());
        b[32..40].copy_from_slice(&(self.data_offset as u64).to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> io::Result<Geometry> {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8")) as usize;
        if word(0) as u64 != ARENA_MAGIC {
            return Err(invalid("shared memory is not a Tarn KV arena"));
        }
        let g = Geometry {
            page_size_bytes: word(8),
            page_count: word(16),
            slots_per_page_max: word(24),
            data_offset: word(32),
        };
        let check = Geometry::new(
            g.page_size_bytes.max(1),
            g.page_count,
            g.page_size_bytes.max(1) / g.slots_per_page_max.max(1),
        );
        if g.page_size_bytes == 0 || g.slots_per_page_max == 0 || check != g {
            return Err(invalid("arena header geometry is inconsistent"));
        }
        Ok(g)
    }
}

/// True when the kernel refuses every way to a writable mapping of `fd`: a
/// shared writable mmap of it, and of the same file opened anew through
/// /proc (a client could do either with the descriptor it receives).
fn refuses_writers(fd: &OwnedFd) -> bool {
    let try_map = |raw: i32| {
        // SAFETY: a one-page shared writable mapping attempt, unmapped at once.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            );
            if p == libc::MAP_FAILED {
                false
            } else {
                libc::munmap(p, 4096);
                true
            }
        }
    };
    if try_map(fd.as_raw_fd()) {
        return false;
    }
    let path = format!("/proc/self/fd/{}\0", fd.as_raw_fd());
    // SAFETY: open of a NUL-terminated path; the descriptor is closed below.
    let reopened = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
    if reopened < 0 {
        return true;
    }
    let writable = try_map(reopened);
    // write(2) of the byte that is already there: refused when sealed, and
    // changes nothing when not.
    let mut byte = [0u8; 1];
    // SAFETY: one-byte pread/pwrite through live buffers; then closing our
    // own descriptor.
    let write_ok = unsafe {
        libc::pread(reopened, byte.as_mut_ptr().cast(), 1, 0) == 1
            && libc::pwrite(reopened, byte.as_ptr().cast(), 1, 0) >= 0
    };
    unsafe { libc::close(reopened) };
    !writable && !write_ok
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

impl Arena {
    /// Creates and preallocates the arena: huge pages (hugetlbfs) when the
    /// machine has them reserved and `huge` allows, else normal shared
    /// memory with transparent huge pages requested. Says which in the log.
    pub fn create(geometry: Geometry, huge: HugePages) -> io::Result<Arena> {
        let len = geometry.total_bytes();
        let name = c"tarn-kv-arena";
        let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
        let tries: &[bool] = match huge {
            HugePages::Auto => &[true, false],
            HugePages::On => &[true],
            HugePages::Off => &[false],
        };
        for &huge in tries {
            let f = if huge {
                flags | libc::MFD_HUGETLB
            } else {
                flags
            };
            // SAFETY: plain syscall with a static C string.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), f) };
            if fd < 0 {
                continue;
            }
            // SAFETY: fresh descriptor we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: plain syscalls on our fd.
            if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } < 0 {
                continue;
            }
            // Preallocate now so that running out of memory is a start-up error,
            // not a SIGBUS in the middle of a put.
            let rc = unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len as libc::off_t) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if huge {
                    continue;
                }
                return Err(io::Error::new(
                    e.kind(),
                    format!("preallocating {len} bytes of shared memory for the KV arena: {e}"),
                ));
            }
            let mut arena = Arena::map(fd, len, geometry, true)?;
            arena.huge_pages = huge;
            // Sealed after our own writable mapping exists: no one may shrink
            // the arena under the daemon (a client with the fd could otherwise
            // make our accesses SIGBUS), and no one may map it writable or
            // write(2) it, so clients can read blocks but never forge them.
            // SAFETY: plain syscall on our fd.
            unsafe {
                libc::fcntl(
                    arena.fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK
                        | libc::F_SEAL_GROW
                        | libc::F_SEAL_FUTURE_WRITE
                        | libc::F_SEAL_SEAL,
                )
            };
            arena.write_sealed = refuses_writers(&arena.fd);
            if !huge {
                // SAFETY: advice on our own mapping.
                let rc = unsafe {
                    libc::madvise(
                        arena.base.add(geometry.data_offset).cast(),
                        len - geometry.data_offset,
                        libc::MADV_HUGEPAGE,
                    )
                };
                let _ = rc;
            }
            arena.header_mut().copy_from_slice(&geometry.encode());
            arena.prefault = Prefault::start(arena.base, len);
            return Ok(arena);
        }
        if huge != HugePages::On {
            return Err(io::Error::last_os_error());
        }
        let needed = len.div_ceil(ARENA_DATA_ALIGN);
        let free = huge_pages_free().unwrap_or(0);
        Err(io::Error::other(format!(
            "the KV arena needs {needed} huge pages of 2 MiB and {free} are free \
             (reserve them with sysctl vm.nr_hugepages, or run with --kv-huge-pages auto)"
        )))
    }

    /// One line for the log: which pages the arena is on, and why.
    pub fn pages_report(&self, asked: HugePages) -> String {
        if self.huge_pages {
            return "2 MiB huge pages (hugetlbfs)".into();
        }
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .ok()
            .and_then(|m| {
                m.split_whitespace()
                    .find(|w| w.starts_with('['))
                    .map(|w| w.trim_matches(['[', ']']).to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let why = match asked {
            HugePages::Off => "huge pages are off (--kv-huge-pages off)".to_string(),
            _ => format!(
                "{} huge pages free, {} needed (sysctl vm.nr_hugepages)",
                huge_pages_free().unwrap_or(0),
                self.len.div_ceil(ARENA_DATA_ALIGN)
            ),
        };
        format!(
            "4 KiB pages: {why}; shared-memory THP {thp}; a client's first touch \
             of each 64 KiB of the arena is a page fault"
        )
    }

    /// Maps an arena received from the daemon and checks its header.
    pub fn open(fd: OwnedFd) -> io::Result<Arena> {
        // SAFETY: fstat into a zeroed struct on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            return Err(io::Error::last_os_error());
        }
        let len = st.st_size as usize;
        if len < ARENA_HEADER_BYTES {
            return Err(invalid("arena too small"));
        }
        let mut arena = Arena::map(
            fd,
            len,
            Geometry {
                page_size_bytes: 0,
                page_count: 0,
                slots_per_page_max: 0,
                data_offset: 0,
            },
            false,
        )?;
        // SAFETY: the header page lies inside the mapping.
        let head = unsafe { std::slice::from_raw_parts(arena.base, 40) };
        let g = Geometry::decode(head)?;
        if g.total_bytes() != len {
            return Err(invalid("arena length does not match its header"));
        }
        arena.geometry = g;
        arena.write_sealed = refuses_writers(&arena.fd);
        // No prefault here. Populating a client's mapping of the whole arena
        // (~65,000 faults and 0.3 s of CPU per 4 GiB on 4 KiB pages) made
        // every fresh process pay for the whole arena, on a thread of its
        // own that competed with its first calls; its faults landed in
        // whatever calls ran meanwhile. A read fault maps 64 KiB around
        // it (fault-around), so a 256 KiB block costs 4 faults the first
        // time this process reads where it lies, and none after.
        Ok(arena)
    }

    fn map(fd: OwnedFd, len: usize, geometry: Geometry, writable: bool) -> io::Result<Arena> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mapping a shared file we hold open; length checked by callers.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Arena {
            fd,
            base: p.cast(),
            len,
            huge_pages: false,
            write_sealed: false,
            geometry,
            prefault: None,
        })
    }

    fn header_mut(&mut self) -> &mut [u8] {
        // SAFETY: the header page is inside the mapping and only written here.
        unsafe { std::slice::from_raw_parts_mut(self.base, 40) }
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The generation counter of slot `index` (page * slots_per_page_max + slot).
    pub fn generation(&self, index: usize) -> Option<&AtomicU32> {
        let g = &self.geometry;
        if index >= g.page_count * g.slots_per_page_max {
            return None;
        }
        // SAFETY: in bounds (checked above), 4-byte aligned (header is 4 KiB),
        // and only ever accessed atomically.
        Some(unsafe { &*(self.base.add(ARENA_HEADER_BYTES + index * 4) as *const AtomicU32) })
    }

    /// Bumps a slot's generation: called whenever the slot stops holding what a
    /// reader may have been told it holds.
    pub fn bump_generation(&self, index: usize) {
        if let Some(g) = self.generation(index) {
            g.fetch_add(1, Ordering::Release);
        }
    }

    /// Checks that `[offset, offset+len)` lies inside the data pages.
    pub fn check_range(&self, offset: u64, len: u64) -> bool {
        let start = self.geometry.data_offset as u64;
        let end = self.len as u64;
        offset >= start && offset <= end && len <= end - offset
    }

    /// Bytes of the arena. The caller must own the range for writing (a
    /// reservation) or accept that another writer may change it (seqlock +
    /// checksum on every read).
    ///
    /// # Safety
    /// `check_range(offset, len)` must hold.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.base.add(offset as usize), len) }
    }

    /// # Safety
    /// `check_range(offset, len)` must hold and the caller must hold the slot
    /// exclusively (its reservation).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: usize) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.base.add(offset as usize), len) }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // Stop and join the prefault thread before the mapping goes.
        self.prefault.take();
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_then_open_by_fd() {
        let g = Geometry::new(4 << 20, 3, 4096);
        let a = Arena::create(g, HugePages::Auto).unwrap();
        assert_eq!(a.len(), g.total_bytes());
        // SAFETY: in range.
        unsafe { a.slice_mut(g.data_offset as u64, 4)[..].copy_from_slice(b"abcd") };
        a.bump_generation(5);
        let dup = a.fd().try_clone().unwrap();
        let b = Arena::open(dup).unwrap();
        assert_eq!(b.geometry, g);
        assert_eq!(unsafe { b.slice(g.data_offset as u64, 4) }, b"abcd");
        assert_eq!(b.generation(5).unwrap().load(Ordering::Acquire), 1);
        assert!(b.generation(3 * 1024).is_none());
        assert!(!b.check_range(0, 1));
        assert!(!b.check_range(g.total_bytes() as u64 - 1, 2));
        assert!(b.check_range(
            g.data_offset as u64,
            (g.total_bytes() - g.data_offset) as u64
        ));
    }

    /// `on` gets huge pages or a clear error naming the reservation, and
    /// `off` never uses them, whatever the machine has reserved.
    #[test]
    fn huge_pages_on_or_a_clear_error() {
        let g = Geometry::new(4 << 20, 2, 4096);
        let needed = g.total_bytes().div_ceil(ARENA_DATA_ALIGN) as u64;
        match Arena::create(g, HugePages::On) {
            Ok(a) => {
                assert!(a.huge_pages);
                assert!(a
                    .pages_report(HugePages::On)
                    .starts_with("2 MiB huge pages"));
            }
            Err(e) => {
                assert!(
                    huge_pages_free().unwrap_or(0) < needed,
                    "{needed} huge pages are free and `on` failed: {e}"
                );
                let msg = e.to_string();
                assert!(msg.contains("vm.nr_hugepages"), "{msg}");
                assert!(msg.contains(&format!("needs {needed} huge pages")), "{msg}");
            }
        }
        let a = Arena::create(g, HugePages::Off).unwrap();
        assert!(!a.huge_pages);
        assert!(a
            .pages_report(HugePages::Off)
            .contains("--kv-huge-pages off"));
        assert_eq!("auto".parse::<HugePages>(), Ok(HugePages::Auto));
        assert!("yes".parse::<HugePages>().is_err());
    }

    /// The forgery this seal stops (issue 12): a client took the arena's
    /// descriptor from the handshake, mapped it writable, rewrote another
    /// client's block and fixed its CRC up. Every way to write it must fail.
    #[test]
    fn clients_cannot_write_the_arena() {
        let g = Geometry::new(4 << 20, 2, 4096);
        let a = Arena::create(g, HugePages::Off).unwrap();
        assert!(
            a.write_sealed,
            "this kernel must honour F_SEAL_FUTURE_WRITE"
        );
        unsafe {
            a.slice_mut(g.data_offset as u64, 4)
                .copy_from_slice(b"good")
        };
        let fd = a.fd().try_clone().unwrap();
        let raw = fd.as_raw_fd();
        unsafe {
            // A shared writable mapping, directly or through /proc.
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            );
            assert_eq!(p, libc::MAP_FAILED);
            let path = format!("/proc/self/fd/{raw}\0");
            let rw = libc::open(path.as_ptr().cast(), libc::O_RDWR);
            assert!(rw >= 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                rw,
                0,
            );
            assert_eq!(p, libc::MAP_FAILED);
            // write(2), punching a hole, truncating.
            let off = g.data_offset as i64;
            assert!(libc::pwrite(rw, b"evil".as_ptr().cast(), 4, off) < 0);
            assert!(
                libc::fallocate(
                    rw,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off,
                    4096
                ) < 0
            );
            assert!(libc::ftruncate(rw, 0) < 0);
            libc::close(rw);
        }
        // A client's read-only mapping cannot be made writable either.
        let b = Arena::open(fd).unwrap();
        let rc = unsafe {
            libc::mprotect(
                b.base.add(g.data_offset).cast(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
        assert!(rc < 0, "mprotect to writable must fail");
        assert_eq!(unsafe { b.slice(g.data_offset as u64, 4) }, b"good");
    }
}
