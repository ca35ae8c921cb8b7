//! `tarn-io` owns the bottom of the stack: aligned buffers, per-core buffer pools,
//! and file I/O on io_uring (one ring per runtime thread) with a blocking-thread
//! fallback where io_uring is missing.
//!
//! It must never know about objects, buckets or HTTP, and it must never block a
//! runtime thread: every syscall that can block runs either on the thread's ring or
//! on tokio's blocking pool. It depends on no other Tarn crate.

pub mod buf;
pub mod fault;
pub mod file;
pub mod net;
pub mod pagecache;
pub mod pool;
pub mod runtime;
pub mod spans;
pub mod tls;
mod uring;
pub mod view;

pub use buf::AlignedBuf;
pub use file::{File, IoBackend};
pub use pool::{BufferPool, PoolExhausted, PooledBuf};

/// Alignment of every buffer handed to the disk: the largest logical block size
/// O_DIRECT needs on the drives we target (NVMe namespaces use 512 B or 4 KiB).
pub const ALIGNMENT_BYTES: usize = 4096;
