//! A heap buffer aligned for O_DIRECT, with a length inside a fixed capacity.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::ALIGNMENT_BYTES;

/// A fixed-capacity, 4 KiB-aligned byte buffer. Its capacity never changes after
/// allocation, so a pointer handed to the kernel stays valid while the buffer lives.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
    /// A mapping of its own (`mapped`), unmapped on drop, rather than the
    /// allocator's memory.
    mapped: bool,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only give out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates a zeroed buffer of at least `capacity` bytes, rounded up to the
    /// alignment so that any prefix of whole blocks can be used for O_DIRECT.
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1).next_multiple_of(ALIGNMENT_BYTES);
        let layout = Layout::from_size_align(capacity, ALIGNMENT_BYTES).expect("buffer layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len: 0,
            capacity,
            mapped: false,
        }
    }

    /// Like `with_capacity`, in an anonymous mapping of its own: dropping
    /// it gives the memory back to the kernel at once. For the buffers that
    /// pools keep and reuse: from the allocator, a burst's buffers freed
    /// after it stayed resident in its per-thread arenas (glibc returns
    /// only an arena's top, and only past the trim threshold), RSS twice
    /// the idle's a minute after slow clients left. Costs a page fault per
    /// 4 KiB on first use, which a pool pays once per buffer.
    pub fn mapped(capacity: usize) -> Self {
        let capacity = capacity.max(1).next_multiple_of(ALIGNMENT_BYTES);
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched. Its pages read as zero, page-aligned (ALIGNMENT_BYTES).
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                capacity,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let layout = Layout::from_size_align(capacity, ALIGNMENT_BYTES).expect("buffer layout");
            std::alloc::handle_alloc_error(layout)
        }
        Self {
            ptr: NonNull::new(raw.cast()).expect("mmap gave a non-null address"),
            len: 0,
            capacity,
            mapped: true,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes that can still be appended.
    pub fn remaining(&self) -> usize {
        self.capacity - self.len
    }

    /// Sets the length. Bytes between the old and new length keep whatever the
    /// buffer held (zero at allocation), so this never exposes uninitialised memory.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity, "set_len beyond capacity");
        self.len = len;
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Appends as much of `data` as fits; returns how many bytes were taken.
    pub fn extend_from_slice(&mut self, data: &[u8]) -> usize {
        let take = data.len().min(self.remaining());
        self.spare_mut()[..take].copy_from_slice(&data[..take]);
        self.len += take;
        take
    }

    /// The whole capacity, for filling by a read.
    pub fn spare_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for capacity bytes and initialised (zeroed at alloc).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().add(self.len),
                self.capacity - self.len,
            )
        }
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the first len bytes are initialised.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first len bytes are initialised and exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped in `mapped` with this length, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.capacity) };
            return;
        }
        let layout =
            Layout::from_size_align(self.capacity, ALIGNMENT_BYTES).expect("buffer layout");
        // SAFETY: allocated in with_capacity with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_buffers_are_zeroed_aligned_and_bounded() {
        let mut b = AlignedBuf::mapped(300_000);
        assert_eq!(b.capacity(), 303_104);
        assert_eq!(b.as_ptr() as usize % ALIGNMENT_BYTES, 0);
        assert!(b.spare_mut().iter().all(|&x| x == 0));
        assert_eq!(b.extend_from_slice(&[7u8; 400_000]), 303_104);
        assert!(b.iter().all(|&x| x == 7));
        drop(b);
    }

    #[test]
    fn aligned_and_bounded() {
        let mut b = AlignedBuf::with_capacity(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.as_ptr() as usize % ALIGNMENT_BYTES, 0);
        assert_eq!(b.extend_from_slice(&[7u8; 9000]), 8192);
        assert_eq!(b.remaining(), 0);
        assert!(b.iter().all(|&x| x == 7));
        b.clear();
        assert!(b.is_empty());
    }
}
