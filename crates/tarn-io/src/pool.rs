//! Per-core pools of stripe-sized aligned buffers.
//!
//! Memory for request bodies is bounded here: each pool holds at most
//! `buffers_max` buffers, allocated lazily and reused. A request that cannot get a
//! buffer within its wait budget is answered with SlowDown by the caller rather than
//! queueing without bound.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::buf::AlignedBuf;
use crate::runtime;

#[derive(Debug, thiserror::Error)]
#[error("buffer pool exhausted: all {buffers_max} buffers of {buffer_size_bytes} bytes are in use")]
pub struct PoolExhausted {
    pub buffers_max: usize,
    pub buffer_size_bytes: usize,
}

struct CorePool {
    permits: Arc<Semaphore>,
    /// Buffers not on loan, and the fewest there were since the last trim
    /// (that many sat unused the whole time).
    free: Mutex<(Vec<AlignedBuf>, usize)>,
}

/// Free buffers a core keeps however long they sit unused.
const KEEP_IDLE: usize = 4;

impl CorePool {
    fn pop(&self) -> Option<AlignedBuf> {
        let mut f = self.free.lock().expect("pool lock");
        let b = f.0.pop();
        f.1 = f.1.min(f.0.len());
        b
    }
}

/// A set of pools, one per core; a thread draws from the pool of the core it runs on.
pub struct BufferPool {
    cores: Vec<Arc<CorePool>>,
    buffer_size_bytes: usize,
    buffers_max_per_core: usize,
}

impl BufferPool {
    pub fn new(core_count: usize, buffer_size_bytes: usize, buffers_max_per_core: usize) -> Self {
        assert!(core_count > 0 && buffers_max_per_core > 0);
        let cores = (0..core_count)
            .map(|_| {
                Arc::new(CorePool {
                    permits: Arc::new(Semaphore::new(buffers_max_per_core)),
                    free: Mutex::new((Vec::new(), 0)),
                })
            })
            .collect();
        Self {
            cores,
            buffer_size_bytes,
            buffers_max_per_core,
        }
    }

    pub fn buffer_size_bytes(&self) -> usize {
        self.buffer_size_bytes
    }

    /// A new buffer, in a mapping of its own: the ones `trim_idle` frees go
    /// back to the kernel, not into an allocator arena that keeps them.
    fn fresh(&self) -> AlignedBuf {
        AlignedBuf::mapped(self.buffer_size_bytes)
    }

    /// Frees the buffers that sat unused since the last call (beyond a few
    /// per core): a burst's buffers go back to the allocator once it is
    /// over, instead of staying allocated for good. Returns how many.
    pub fn trim_idle(&self) -> usize {
        let mut freed = 0;
        for core in &self.cores {
            let dropped: Vec<AlignedBuf> = {
                let mut f = core.free.lock().expect("pool lock");
                let idle = f.1.min(f.0.len()).saturating_sub(KEEP_IDLE);
                let keep = f.0.len() - idle;
                let dropped = f.0.split_off(keep);
                f.1 = f.0.len();
                dropped
            };
            freed += dropped.len();
        }
        freed
    }

    /// Free buffers held now, in all cores.
    pub fn idle_buffers(&self) -> usize {
        self.cores
            .iter()
            .map(|c| c.free.lock().expect("pool lock").0.len())
            .sum()
    }

    /// Takes a buffer, waiting at most `wait` for one to be returned.
    pub async fn acquire(&self, wait: Duration) -> Result<PooledBuf, PoolExhausted> {
        let core = &self.cores[runtime::core_id().unwrap_or(0) % self.cores.len()];
        let permit = match tokio::time::timeout(wait, core.permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                return Err(PoolExhausted {
                    buffers_max: self.buffers_max_per_core,
                    buffer_size_bytes: self.buffer_size_bytes,
                })
            }
        };
        let mut buf = core.pop().unwrap_or_else(|| self.fresh());
        buf.clear();
        Ok(PooledBuf {
            buf: Some(buf),
            home: core.clone(),
            _permit: permit,
        })
    }
}

impl BufferPool {
    /// Takes `n` buffers at once: all or none, so requests that need several
    /// never hold part of a set while waiting for the rest (which would let
    /// concurrent requests starve each other into timeouts).
    pub async fn acquire_many(
        &self,
        n: usize,
        wait: Duration,
    ) -> Result<Vec<PooledBuf>, PoolExhausted> {
        let core = &self.cores[runtime::core_id().unwrap_or(0) % self.cores.len()];
        let exhausted = || PoolExhausted {
            buffers_max: self.buffers_max_per_core,
            buffer_size_bytes: self.buffer_size_bytes,
        };
        if n > self.buffers_max_per_core {
            return Err(exhausted());
        }
        let mut permit =
            match tokio::time::timeout(wait, core.permits.clone().acquire_many_owned(n as u32))
                .await
            {
                Ok(Ok(permit)) => permit,
                _ => return Err(exhausted()),
            };
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let one = permit.split(1).expect("permit holds n");
            let mut buf = core.pop().unwrap_or_else(|| self.fresh());
            buf.clear();
            out.push(PooledBuf {
                buf: Some(buf),
                home: core.clone(),
                _permit: one,
            });
        }
        Ok(out)
    }
}

/// A buffer on loan from a pool; returned to it on drop.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    home: Arc<CorePool>,
    _permit: OwnedSemaphorePermit,
}

impl PooledBuf {
    /// Takes the buffer out for an owned I/O call; put it back with `restore`.
    pub fn take(&mut self) -> AlignedBuf {
        self.buf.take().expect("pooled buffer already taken")
    }

    /// Swaps in a larger buffer when this one cannot hold `len` bytes (data
    /// written under an earlier, larger stripe size than the pool's).
    pub fn ensure_capacity(&mut self, len: usize) {
        if self.capacity() < len {
            self.buf = Some(AlignedBuf::with_capacity(len));
        }
    }

    pub fn restore(&mut self, buf: AlignedBuf) {
        assert!(self.buf.is_none(), "pooled buffer restored twice");
        self.buf = Some(buf);
    }
}

impl std::ops::Deref for PooledBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        self.buf.as_ref().expect("pooled buffer taken")
    }
}

impl std::ops::DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        self.buf.as_mut().expect("pooled buffer taken")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        // A buffer lost to a cancelled I/O (taken and never restored) is simply not
        // returned; its permit is, and a fresh buffer is allocated next time.
        if let Some(buf) = self.buf.take() {
            self.home.free.lock().expect("pool lock").0.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bounded_and_reused() {
        let pool = BufferPool::new(1, 8192, 2);
        let a = pool.acquire(Duration::from_millis(10)).await.unwrap();
        let b = pool.acquire(Duration::from_millis(10)).await.unwrap();
        assert!(pool.acquire(Duration::from_millis(10)).await.is_err());
        let ptr = a.as_ptr();
        drop(a);
        let c = pool.acquire(Duration::from_millis(10)).await.unwrap();
        assert_eq!(c.as_ptr(), ptr, "a returned buffer is reused");
        assert!(c.is_empty());
        drop(b);
        // All or nothing: three buffers cannot come from a pool with one left.
        assert!(pool
            .acquire_many(2, Duration::from_millis(10))
            .await
            .is_err());
        drop(c);
        let two = pool
            .acquire_many(2, Duration::from_millis(10))
            .await
            .unwrap();
        assert_eq!(two.len(), 2);
        assert!(pool.acquire(Duration::from_millis(10)).await.is_err());
        drop(two);
        assert!(
            pool.acquire_many(3, Duration::from_millis(10))
                .await
                .is_err(),
            "more than the pool holds"
        );
    }

    #[tokio::test]
    async fn buffers_idle_for_a_whole_trim_interval_are_freed() {
        let pool = BufferPool::new(1, 8192, 32);
        // A burst: 20 buffers allocated, then all back in the pool.
        let burst = pool
            .acquire_many(20, Duration::from_millis(10))
            .await
            .unwrap();
        drop(burst);
        assert_eq!(pool.idle_buffers(), 20);
        // The first trim only starts the count (they were in use since).
        pool.trim_idle();
        // Two stay in use throughout; the rest sit idle a whole interval.
        let busy = pool
            .acquire_many(2, Duration::from_millis(10))
            .await
            .unwrap();
        assert_eq!(pool.trim_idle(), 18 - KEEP_IDLE);
        assert_eq!(pool.idle_buffers(), KEEP_IDLE);
        drop(busy);
        assert_eq!(pool.idle_buffers(), KEEP_IDLE + 2);
        // Buffers in steady use are kept.
        for _ in 0..3 {
            let b = pool
                .acquire_many(KEEP_IDLE + 2, Duration::from_millis(10))
                .await
                .unwrap();
            drop(b);
            assert_eq!(pool.trim_idle(), 0);
        }
    }
}
