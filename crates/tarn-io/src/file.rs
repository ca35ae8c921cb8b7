//! Positional file I/O with owned buffers, on the thread's io_uring when it has one
//! and on tokio's blocking pool otherwise.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use io_uring::{opcode, types};

use crate::buf::AlignedBuf;
use crate::uring;

/// Which engine performs file I/O on the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackend {
    IoUring,
    BlockingThreads,
}

impl IoBackend {
    pub fn current() -> Self {
        if uring::available() {
            IoBackend::IoUring
        } else {
            IoBackend::BlockingThreads
        }
    }
}

/// An open file. Cheap to clone; closed when the last clone drops (and no
/// operation is in flight on it).
#[derive(Clone, Debug)]
pub struct File {
    fd: Arc<OwnedFd>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => handle.spawn_blocking(f).await.map_err(io::Error::other)?,
        Err(_) => f(),
    }
}

fn check(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

impl File {
    /// The descriptor, shared: it stays open while the returned handle
    /// lives, even after every `File` is dropped.
    pub fn shared_fd(&self) -> Arc<OwnedFd> {
        self.fd.clone()
    }

    /// A `File` on a descriptor shared with others.
    pub fn from_shared(fd: Arc<OwnedFd>) -> File {
        File { fd }
    }

    /// Wraps a descriptor opened elsewhere (for example with O_DIRECT).
    pub fn from_fd(fd: OwnedFd) -> File {
        File { fd: Arc::new(fd) }
    }

    /// Creates (truncating) a file for writing and reading.
    pub async fn create(path: impl Into<PathBuf>) -> io::Result<File> {
        crate::fault::check("create")?;
        let path = path.into();
        if uring::available() {
            let fd = uring_open(
                &path,
                libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                0o644,
            )
            .await?;
            return Ok(File { fd: Arc::new(fd) });
        }
        blocking(move || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)?;
            Ok(File {
                fd: Arc::new(f.into()),
            })
        })
        .await
    }

    /// Creates (truncating) a file for writing with O_DIRECT: writes go from
    /// the (4 KiB-aligned) buffers to the device, not through the page
    /// cache. On a filesystem that refuses O_DIRECT the file is opened for
    /// buffered I/O instead; the flag says which.
    pub async fn create_direct(path: impl Into<PathBuf>) -> io::Result<(File, bool)> {
        crate::fault::check("create")?;
        let path = path.into();
        let flags = libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC;
        let attempt = if uring::available() {
            uring_open(&path, flags | libc::O_DIRECT, 0o644).await
        } else {
            let p = path.clone();
            blocking(move || {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
                    .open(&p)
                    .map(OwnedFd::from)
            })
            .await
        };
        match attempt {
            Ok(fd) => Ok((File { fd: Arc::new(fd) }, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Ok((File::create(path).await?, false))
            }
            Err(e) => Err(e),
        }
    }

    /// Turns O_DIRECT off (or on) for later I/O on this descriptor: what a
    /// writer does before a tail that is not a whole number of blocks.
    pub fn set_direct(&self, on: bool) -> io::Result<()> {
        let fd = self.fd.as_raw_fd();
        // SAFETY: fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let want = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, want) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub async fn open(path: impl Into<PathBuf>) -> io::Result<File> {
        let path = path.into();
        if uring::available() {
            let fd = uring_open(&path, libc::O_RDONLY | libc::O_CLOEXEC, 0).await?;
            return Ok(File { fd: Arc::new(fd) });
        }
        blocking(move || {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)?;
            Ok(File {
                fd: Arc::new(f.into()),
            })
        })
        .await
    }

    /// The file's length. fstat on an open descriptor reads the cached inode
    /// and does not wait for the disk, so it runs inline.
    pub async fn len(&self) -> io::Result<u64> {
        // SAFETY: fstat on an fd we own into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st.st_size as u64)
    }

    /// Writes all of `buf` at `offset`. The buffer comes back whatever happens.
    pub async fn write_all_at(&self, buf: AlignedBuf, offset: u64) -> (io::Result<()>, AlignedBuf) {
        if let Err(e) = crate::fault::check("write") {
            return (Err(e), buf);
        }
        let mut buf = buf;
        let mut done = 0usize;
        while done < buf.len() {
            let (res, b) = self.write_at(buf, done, offset + done as u64).await;
            buf = b;
            match res {
                Ok(0) => {
                    return (
                        Err(io::Error::new(io::ErrorKind::WriteZero, "short write")),
                        buf,
                    )
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    async fn write_at(
        &self,
        buf: AlignedBuf,
        from: usize,
        offset: u64,
    ) -> (io::Result<usize>, AlignedBuf) {
        if uring::available() {
            let len = (buf.len() - from) as u32;
            // SAFETY: pointer into buf, which the op owns until completion.
            let ptr = unsafe { buf.as_ptr().add(from) };
            let entry = opcode::Write::new(types::Fd(self.fd.as_raw_fd()), ptr, len)
                .offset(offset)
                .build();
            // SAFETY: entry references buf and fd, both moved into the op.
            match unsafe { uring::submit(entry, (self.fd.clone(), buf)) } {
                Ok(op) => {
                    let (res, (_fd, buf)) = op.await;
                    (check(res), buf)
                }
                Err(_) => {
                    // The resources went to the orphan table with the unsubmitted
                    // entry; report the failure with a fresh buffer of the same size.
                    (
                        Err(io::Error::other("io_uring submit failed")),
                        AlignedBuf::with_capacity(len as usize),
                    )
                }
            }
        } else {
            let fd = self.fd.clone();
            let r = blocking(move || {
                let data = &buf[from..];
                // SAFETY: pwrite from a live slice on an fd we own.
                let n = unsafe {
                    libc::pwrite(
                        fd.as_raw_fd(),
                        data.as_ptr().cast(),
                        data.len(),
                        offset as i64,
                    )
                };
                if n < 0 {
                    return Ok((Err(io::Error::last_os_error()), buf));
                }
                Ok((Ok(n as usize), buf))
            })
            .await;
            match r {
                Ok(pair) => pair,
                Err(e) => (Err(e), AlignedBuf::with_capacity(1)),
            }
        }
    }

    /// Reads exactly `len` bytes at `offset` into `buf` (from its start); a file
    /// that ends early gives `UnexpectedEof`.
    pub async fn read_exact_at(
        &self,
        mut buf: AlignedBuf,
        len: usize,
        offset: u64,
    ) -> (io::Result<()>, AlignedBuf) {
        assert!(len <= buf.capacity(), "read longer than buffer");
        buf.set_len(0);
        while buf.len() < len {
            let want = len - buf.len();
            let at = offset + buf.len() as u64;
            let (res, b) = self.read_at(buf, want, at).await;
            buf = b;
            match res {
                Ok(0) => {
                    return (
                        Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "file ended early",
                        )),
                        buf,
                    )
                }
                Ok(n) => {
                    let l = buf.len();
                    buf.set_len(l + n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return (Err(e), buf),
            }
        }
        (Ok(()), buf)
    }

    async fn read_at(
        &self,
        mut buf: AlignedBuf,
        want: usize,
        offset: u64,
    ) -> (io::Result<usize>, AlignedBuf) {
        if uring::available() {
            let ptr = buf.spare_mut().as_mut_ptr();
            let entry = opcode::Read::new(types::Fd(self.fd.as_raw_fd()), ptr, want as u32)
                .offset(offset)
                .build();
            // SAFETY: entry references buf's spare capacity and fd, both owned by the op.
            match unsafe { uring::submit(entry, (self.fd.clone(), buf)) } {
                Ok(op) => {
                    let (res, (_fd, buf)) = op.await;
                    (check(res), buf)
                }
                Err(_) => (
                    Err(io::Error::other("io_uring submit failed")),
                    AlignedBuf::with_capacity(want),
                ),
            }
        } else {
            let fd = self.fd.clone();
            let r = blocking(move || {
                let spare = buf.spare_mut();
                // SAFETY: pread into a live mutable slice of at least `want` bytes.
                let n = unsafe {
                    libc::pread(
                        fd.as_raw_fd(),
                        spare.as_mut_ptr().cast(),
                        want,
                        offset as i64,
                    )
                };
                if n < 0 {
                    return Ok((Err(io::Error::last_os_error()), buf));
                }
                Ok((Ok(n as usize), buf))
            })
            .await;
            match r {
                Ok(pair) => pair,
                Err(e) => (Err(e), AlignedBuf::with_capacity(want)),
            }
        }
    }

    /// Flushes data and metadata to stable storage.
    pub async fn sync_all(&self) -> io::Result<()> {
        crate::fault::check("fsync")?;
        if uring::available() {
            let entry = opcode::Fsync::new(types::Fd(self.fd.as_raw_fd())).build();
            // SAFETY: the entry references only the fd, owned by the op.
            let op = unsafe { uring::submit(entry, self.fd.clone()) }?;
            let (res, _) = op.await;
            check(res).map(|_| ())
        } else {
            let fd = self.fd.clone();
            blocking(move || {
                // SAFETY: fsync on an fd we own.
                if unsafe { libc::fsync(fd.as_raw_fd()) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            })
            .await
        }
    }
}

/// Runs a blocking filesystem call off the runtime thread.
pub async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    blocking(f).await
}

/// Renames atomically and makes the rename durable by syncing the target directory.
pub async fn rename_durable(from: PathBuf, to: PathBuf) -> io::Result<()> {
    crate::fault::check("rename")?;
    if uring::available() {
        let old = cpath(&from)?;
        let new = cpath(&to)?;
        let entry = opcode::RenameAt::new(
            types::Fd(libc::AT_FDCWD),
            old.as_ptr(),
            types::Fd(libc::AT_FDCWD),
            new.as_ptr(),
        )
        .build();
        // SAFETY: the entry points into `old` and `new`, owned by the op.
        let (res, _) = unsafe { uring::submit(entry, (old, new)) }?.await;
        check(res)?;
        return sync_dir_async(to.parent().unwrap_or(Path::new("."))).await;
    }
    blocking(move || {
        std::fs::rename(&from, &to)?;
        sync_dir(to.parent().unwrap_or(Path::new(".")))
    })
    .await
}

/// fsync of a directory on the thread's ring (blocking pool without one), so
/// that entries created or renamed in it survive a crash.
pub async fn sync_dir_async(dir: &Path) -> io::Result<()> {
    crate::fault::check("fsync dir")?;
    if uring::available() {
        let fd = uring_open(dir, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC, 0).await?;
        let fd = Arc::new(fd);
        let entry = opcode::Fsync::new(types::Fd(fd.as_raw_fd())).build();
        // SAFETY: the entry references only the fd, owned by the op.
        let (res, _) = unsafe { uring::submit(entry, fd) }?.await;
        return check(res).map(|_| ());
    }
    let dir = dir.to_path_buf();
    blocking(move || sync_dir(&dir)).await
}

fn cpath(p: &Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

/// openat(2) on the thread's ring.
async fn uring_open(path: &Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let c = cpath(path)?;
    let entry = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c.as_ptr())
        .flags(flags)
        .mode(mode)
        .build();
    // SAFETY: the entry points into `c`, owned by the op until completion.
    let (res, _) = unsafe { uring::submit_open(entry, c) }?.await;
    let fd = check(res)? as i32;
    // SAFETY: the kernel returned a fresh descriptor that we now own.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// fsync of a directory, so that entries created or renamed in it survive a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn roundtrip(dir: &Path) {
        let path = dir.join("f");
        let f = File::create(&path).await.unwrap();
        let mut buf = AlignedBuf::with_capacity(10_000);
        buf.extend_from_slice(&(0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let (r, _buf) = f.write_all_at(buf, 100).await;
        r.unwrap();
        f.sync_all().await.unwrap();
        assert_eq!(f.len().await.unwrap(), 10_100);
        let g = File::open(&path).await.unwrap();
        let (r, got) = g
            .read_exact_at(AlignedBuf::with_capacity(10_000), 10_000, 100)
            .await;
        r.unwrap();
        assert!(got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        let (r, _) = g
            .read_exact_at(AlignedBuf::with_capacity(4096), 4096, 9_000)
            .await;
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn blocking_backend() {
        let dir = tempfile_dir();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            assert_eq!(IoBackend::current(), IoBackend::BlockingThreads);
            roundtrip(&dir).await;
        });
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn uring_backend() {
        let dir = tempfile_dir();
        std::thread::spawn(move || {
            let rt = crate::runtime::build_core_runtime(0, false, true).unwrap();
            rt.block_on(async {
                assert_eq!(
                    IoBackend::current(),
                    IoBackend::IoUring,
                    "io_uring is expected on this machine"
                );
                roundtrip(&dir).await;
                // Opens, renames and missing files on the ring.
                let missing = File::open(dir.join("nope")).await.unwrap_err();
                assert_eq!(missing.kind(), io::ErrorKind::NotFound);
                rename_durable(dir.join("f"), dir.join("f2")).await.unwrap();
                assert!(!dir.join("f").exists() && dir.join("f2").exists());
                let g = File::open(dir.join("f2")).await.unwrap();
                assert_eq!(g.len().await.unwrap(), 10_100);
                // Dropping an op mid-flight must not free the buffer under the kernel.
                let f = File::create(dir.join("g")).await.unwrap();
                let mut b = AlignedBuf::with_capacity(1 << 20);
                b.set_len(1 << 20);
                let fut = f.write_all_at(b, 0);
                drop(fut);
                f.sync_all().await.unwrap();
            });
            std::fs::remove_dir_all(dir).unwrap();
        })
        .join()
        .unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "tarn-io-test-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }
}
