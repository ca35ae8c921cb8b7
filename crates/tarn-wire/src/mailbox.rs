//! The request mailbox of a shared-memory connection: one small shared file
//! per connection through which requests and responses travel without a
//! system call while both sides are awake.
//!
//! Over the Unix socket alone, a round trip costs a `sendmsg`, a `recvmsg`
//! and the same again on the daemon's side: ~20–30 µs on the VM we measure
//! on once a multi-megabyte copy has pushed the kernel's and the runtime's
//! code out of the caches, about a tenth of a 32 × 64 KiB batch. Through the
//! mailbox a request is a write of its frame into shared memory and a store of
//! a sequence number; the daemon, spinning between requests, sees it within
//! a poll. The socket stays for the handshake, for the daemon to notice that
//! the client went away, and as the doorbell when one side is parked.
//!
//! Layout (see docs/kv-protocol.md, "Mailbox"; every word little-endian, each
//! shared word on its own cache line so the two sides do not share lines):
//! ```text
//! 0      u64 magic "TARNKVM1", u32 request area bytes, u32 response area bytes
//! 64     u64 request_seq      written by the client after a whole request
//! 128    u64 response_seq     written by the daemon after a whole response
//! 192    u32 server_parked    1 while the daemon waits on the socket
//! 256    u32 client_parked    1 while the client waits on the socket
//! 320    u64 response_progress  (sequence << 16) | GET_SHM results written
//! 4096   request area         one request frame (header + payload)
//! 4096+R response area        one response frame
//! ```
//! One request is outstanding at a time. Parking follows the event-count
//! pattern: a side sets its `parked` word, fences, and re-checks the other
//! side's sequence before it sleeps; the other side publishes its sequence,
//! fences, and writes one doorbell byte to the socket if it sees the word
//! set. Either the sleeper sees the new sequence or the publisher sees the
//! word, so no wakeup is lost; a doorbell that races with a wakeup is a
//! spurious wakeup, which both sides tolerate.
//!
//! The daemon treats the request area as input from an untrusted process:
//! it copies the frame out once (header, then a payload of the length it
//! validated) and parses only its private copy.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::proto::{BATCH_MAX_KEYS, CONTROL_MAX_BYTES, FRAME_HEADER_BYTES, GET_SHM_RESULT_BYTES};

pub const MAILBOX_MAGIC: u64 = u64::from_le_bytes(*b"TARNKVM1");
const REQUEST_SEQ_AT: usize = 64;
const RESPONSE_SEQ_AT: usize = 128;
const SERVER_PARKED_AT: usize = 192;
const CLIENT_PARKED_AT: usize = 256;
const RESPONSE_PROGRESS_AT: usize = 320;
/// Results a progress word can count: a batch's keys must fit.
const PROGRESS_BITS: u32 = 16;
const _: () = assert!(BATCH_MAX_KEYS < 1 << PROGRESS_BITS);
/// The shared words fit in the first page; the areas follow.
pub const MAILBOX_HEADER_BYTES: usize = 4096;
/// Room for the largest request frame.
pub const REQUEST_AREA_BYTES: usize =
    (FRAME_HEADER_BYTES + CONTROL_MAX_BYTES).next_multiple_of(4096);
/// Room for the largest response frame: a full GET_SHM batch is the biggest
/// (stats and error frames are far smaller, and the daemon checks anyway).
pub const RESPONSE_AREA_BYTES: usize = 64 << 10;
pub const MAILBOX_BYTES: usize = MAILBOX_HEADER_BYTES + REQUEST_AREA_BYTES + RESPONSE_AREA_BYTES;

const _: () =
    assert!(FRAME_HEADER_BYTES + 4 + BATCH_MAX_KEYS * GET_SHM_RESULT_BYTES <= RESPONSE_AREA_BYTES);

/// A mapped mailbox. The daemon creates it; the client maps the descriptor it
/// receives with the HELLO reply.
pub struct Mailbox {
    fd: OwnedFd,
    base: *mut u8,
}

// SAFETY: shared memory accessed through atomics (the words) and raw copies
// (the areas), whose ownership the sequence protocol above decides.
unsafe impl Send for Mailbox {}
unsafe impl Sync for Mailbox {}

impl Mailbox {
    /// A fresh, zeroed mailbox, sealed against resizing so that a client
    /// holding the descriptor cannot make the daemon's accesses fault.
    pub fn create() -> io::Result<Mailbox> {
        // SAFETY: plain syscall with a static C string.
        let fd = unsafe {
            libc::memfd_create(
                c"tarn-kv-mailbox".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscalls on our descriptor.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), MAILBOX_BYTES as libc::off_t) < 0
                || libc::fallocate(fd.as_raw_fd(), 0, 0, MAILBOX_BYTES as libc::off_t) < 0
                || libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
                ) < 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        let mb = Mailbox::map(fd)?;
        // SAFETY: the header page is ours until the descriptor is sent.
        unsafe {
            let head = std::slice::from_raw_parts_mut(mb.base, 16);
            head[..8].copy_from_slice(&MAILBOX_MAGIC.to_le_bytes());
            head[8..12].copy_from_slice(&(REQUEST_AREA_BYTES as u32).to_le_bytes());
            head[12..16].copy_from_slice(&(RESPONSE_AREA_BYTES as u32).to_le_bytes());
        }
        Ok(mb)
    }

    /// Maps a mailbox received from the daemon and checks its header.
    pub fn open(fd: OwnedFd) -> io::Result<Mailbox> {
        // SAFETY: fstat into a zeroed struct on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size as usize != MAILBOX_BYTES {
            return Err(invalid("mailbox has the wrong size"));
        }
        let mb = Mailbox::map(fd)?;
        // SAFETY: the header lies inside the mapping.
        let head = unsafe { std::slice::from_raw_parts(mb.base, 16) };
        let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4"));
        if head[..8] != MAILBOX_MAGIC.to_le_bytes()
            || word(8) as usize != REQUEST_AREA_BYTES
            || word(12) as usize != RESPONSE_AREA_BYTES
        {
            return Err(invalid(
                "shared memory is not a Tarn KV mailbox of this version",
            ));
        }
        Ok(mb)
    }

    fn map(fd: OwnedFd) -> io::Result<Mailbox> {
        // SAFETY: mapping a shared file of (checked) MAILBOX_BYTES we hold open.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MAILBOX_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mailbox { fd, base: p.cast() })
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    fn word64(&self, at: usize) -> &AtomicU64 {
        // SAFETY: inside the header page, 8-byte aligned, only used atomically.
        unsafe { &*(self.base.add(at) as *const AtomicU64) }
    }

    fn word32(&self, at: usize) -> &AtomicU32 {
        // SAFETY: inside the header page, 4-byte aligned, only used atomically.
        unsafe { &*(self.base.add(at) as *const AtomicU32) }
    }

    pub fn request_seq(&self) -> &AtomicU64 {
        self.word64(REQUEST_SEQ_AT)
    }

    pub fn response_seq(&self) -> &AtomicU64 {
        self.word64(RESPONSE_SEQ_AT)
    }

    pub fn server_parked(&self) -> &AtomicU32 {
        self.word32(SERVER_PARKED_AT)
    }

    pub fn client_parked(&self) -> &AtomicU32 {
        self.word32(CLIENT_PARKED_AT)
    }

    /// Daemon: the first `results` GET_SHM results of request `seq` are in
    /// the response area, at their final places in the response frame.
    pub fn publish_progress(&self, seq: u64, results: usize) {
        let word = (seq << PROGRESS_BITS) | results as u64;
        self.word64(RESPONSE_PROGRESS_AT)
            .store(word, Ordering::Release);
    }

    /// Client: how many GET_SHM results of request `seq` are readable.
    pub fn progress(&self, seq: u64) -> usize {
        let word = self.word64(RESPONSE_PROGRESS_AT).load(Ordering::Acquire);
        let mask = u64::MAX >> PROGRESS_BITS;
        if word >> PROGRESS_BITS == seq & mask {
            (word & ((1 << PROGRESS_BITS) - 1)) as usize
        } else {
            0
        }
    }

    /// True when a request waits that has not been answered.
    pub fn request_pending(&self) -> bool {
        self.request_seq().load(Ordering::Acquire) != self.response_seq().load(Ordering::Relaxed)
    }

    /// Copies a frame into the request area (client) or response area
    /// (daemon). The caller owns that area until it publishes its sequence.
    pub fn write(&self, area: Area, frame: &[u8]) -> io::Result<()> {
        self.write_at(area, 0, frame)
    }

    /// Copies `bytes` to `offset` of an area the caller owns.
    pub fn write_at(&self, area: Area, offset: usize, bytes: &[u8]) -> io::Result<()> {
        let (at, cap) = area.span();
        if offset > cap || bytes.len() > cap - offset {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes at {offset} exceed the mailbox's {cap}",
                    bytes.len()
                ),
            ));
        }
        // SAFETY: in bounds (checked); the area belongs to the writer now.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(at + offset), bytes.len())
        };
        Ok(())
    }

    /// Copies `out.len()` bytes at `offset` of an area into private memory.
    /// False when the range is outside the area. The peer may be changing the
    /// bytes (a hostile client): callers parse only what they copied.
    pub fn read(&self, area: Area, offset: usize, out: &mut [u8]) -> bool {
        let (at, cap) = area.span();
        if offset > cap || out.len() > cap - offset {
            return false;
        }
        // SAFETY: in bounds (checked above).
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(at + offset), out.as_mut_ptr(), out.len())
        };
        true
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.base.cast(), MAILBOX_BYTES) };
    }
}

/// The two halves of a mailbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Area {
    Request,
    Response,
}

impl Area {
    fn span(self) -> (usize, usize) {
        match self {
            Area::Request => (MAILBOX_HEADER_BYTES, REQUEST_AREA_BYTES),
            Area::Response => (
                MAILBOX_HEADER_BYTES + REQUEST_AREA_BYTES,
                RESPONSE_AREA_BYTES,
            ),
        }
    }
}

/// Spins until `ready` or until `budget` is spent; returns `ready`'s last word.
pub fn spin_until(budget: std::time::Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    let mut backoff = Backoff::default();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= budget {
            return false;
        }
        backoff.turn();
    }
}

/// Turns of a wait loop spent spinning before it starts yielding the CPU
/// (about 2–3 µs with the clock read of each turn).
const PURE_SPIN_TURNS: u32 = 64;

/// One turn of a loop that waits for the other side of a shared-memory
/// connection: a CPU pause at first, then `sched_yield`.
///
/// Both sides spin while they wait for each other, and both may be on the
/// same core (the scheduler wakes a thread on its waker's core, and a
/// two-core machine has little choice). A pure spin then holds the core the
/// other side needs until its budget runs out and it parks: a round trip
/// went from ~30 µs to 130–600 µs, and stayed there for as long as the two
/// threads shared the core, so latency flipped between two levels from one
/// run to the next (issue 19). Yielding hands the core to the other side at
/// once when it is runnable there, and returns at once when it is not; the
/// cost is a system call per turn (~0.3 µs) after the first few
/// microseconds of a wait, on a core that is only waiting anyway.
#[derive(Default)]
pub struct Backoff {
    turns: u32,
}

impl Backoff {
    pub fn turn(&mut self) {
        if self.turns < PURE_SPIN_TURNS {
            self.turns += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Writes one doorbell byte to a non-blocking socket. A full socket already
/// holds doorbells the peer has yet to drain, and a closed one is noticed by
/// the peer's next read: neither is an error here.
pub fn ring(fd: i32) {
    // SAFETY: send of one byte from a live buffer on a descriptor we hold.
    unsafe {
        libc::send(
            fd,
            [1u8].as_ptr().cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// Spins until `fd` is readable or the budget is spent.
pub fn spin_until_readable(fd: i32, budget: std::time::Duration) {
    let start = std::time::Instant::now();
    let mut backoff = Backoff::default();
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: poll on one live descriptor with a zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        if n != 0 || start.elapsed() >= budget {
            return;
        }
        backoff.turn();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_and_areas() {
        let a = Mailbox::create().unwrap();
        let b = Mailbox::open(a.fd().try_clone().unwrap()).unwrap();
        a.write(Area::Request, b"hello").unwrap();
        let mut got = [0u8; 5];
        assert!(b.read(Area::Request, 0, &mut got));
        assert_eq!(&got, b"hello");
        b.request_seq().store(3, Ordering::Release);
        assert!(a.request_pending());
        a.response_seq().store(3, Ordering::Release);
        assert!(!b.request_pending());
        // Out-of-area reads and oversized writes are refused.
        assert!(!b.read(Area::Response, RESPONSE_AREA_BYTES - 1, &mut got));
        assert!(!b.read(Area::Request, usize::MAX, &mut got));
        assert!(a
            .write(Area::Response, &vec![0; RESPONSE_AREA_BYTES + 1])
            .is_err());
        // Sealed: nobody can shrink it under the daemon.
        let rc = unsafe { libc::ftruncate(b.fd().as_raw_fd(), 4096) };
        assert!(rc < 0);
    }

    #[test]
    fn open_rejects_other_files() {
        // SAFETY: plain syscalls on a fresh descriptor.
        let fd = unsafe { libc::memfd_create(c"x".as_ptr(), libc::MFD_CLOEXEC) };
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        assert!(Mailbox::open(fd.try_clone().unwrap()).is_err());
        unsafe { libc::ftruncate(fd.as_raw_fd(), MAILBOX_BYTES as libc::off_t) };
        assert!(Mailbox::open(fd).is_err());
    }
}
