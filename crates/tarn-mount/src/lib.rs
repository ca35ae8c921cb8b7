//! `tarn mount`: a bucket, or a prefix of one, as a FUSE file system for
//! the tools that only read files (docs/mount.md). Reads go through the
//! object client (many connections, ranged reads, short-circuit reads from
//! a node on this host); files are written sequentially as multipart
//! uploads and appear when closed.

mod cache;
mod errno;
mod fs;
mod inode;
mod pool;
mod reader;
mod time;
mod writer;

use std::io;
use std::path::Path;
use std::process::Command;

use fuser::{MountOption, SessionACL};
use tarn_client::object::ObjectClient;

pub use fs::{Options, TarnFs};

/// Signals that unmount: blocked in every thread (call this before any
/// thread starts, the object client's included) and taken by one thread
/// of [`serve`].
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn signal_set() -> libc::sigset_t {
    // SAFETY: a sigset_t filled by sigemptyset/sigaddset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the unmounting signals in this thread and every thread started
/// after it.
pub fn block_signals() {
    let set = signal_set();
    // SAFETY: blocking signals of the calling thread.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Mounts at `mountpoint` and serves until it is unmounted (`tarn umount`,
/// `fusermount3 -u`, or SIGINT/SIGTERM/SIGHUP, which unmount, lazily if
/// files are open). `ready` runs once the mount is in place.
pub fn serve(
    mountpoint: &Path,
    opts: Options,
    client: ObjectClient,
    allow_other: bool,
    ready: impl FnOnce(),
) -> io::Result<()> {
    let mountpoint = &std::fs::canonicalize(mountpoint)?;
    // The bucket answers (and the credentials work) before anything is
    // mounted: a mount that cannot list its root is an error now.
    client
        .list_dir(&opts.bucket, &opts.prefix, Some(1))
        .map_err(|e| io::Error::other(format!("s3://{}/{}: {e}", opts.bucket, opts.prefix)))?;
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!("tarn:{}/{}", opts.bucket, opts.prefix)),
        MountOption::Subtype("tarn".into()),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        if opts.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    config.acl = if allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(opts.threads.max(1));
    config.clone_fd = true;
    let cache = match &opts.cache {
        Some((dir, size)) => Some(std::sync::Arc::new(cache::Cache::open(dir, *size)?)),
        None => None,
    };
    let fs = TarnFs::new(opts, client, cache);
    let mut session = fuser::Session::new(fs, mountpoint, &config)?;
    raise_readahead(mountpoint);
    let mut unmounter = session.unmount_callable();
    let at = mountpoint.to_path_buf();
    std::thread::Builder::new()
        .name("tarn-mount-signals".into())
        .spawn(move || {
            let set = signal_set();
            let mut sig: libc::c_int = 0;
            // SAFETY: waiting for one of the blocked signals.
            while unsafe { libc::sigwait(&set, &mut sig) } != 0 {}
            tracing::info!("signal {sig}: unmounting {}", at.display());
            if unmounter.unmount().is_err() {
                // Busy (files open): detach now, end when the last closes.
                let _ = lazy_unmount(&at);
            }
        })?;
    ready();
    match session.run() {
        // The kernel ends a lazily unmounted connection with
        // ECONNABORTED once the last open file closes: a clean end.
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
        r => r,
    }
}

/// The kernel's read-ahead on the mount, KiB: one segment. A FUSE mount
/// starts at 128 KiB, which keeps one small request in flight behind a
/// sequential reader; the mount's own read-ahead has the segments in
/// memory, and the kernel asking for more at once moves them faster.
const KERNEL_READAHEAD_KB: u64 = reader::SEGMENT >> 10;

/// Raises the mount's read-ahead (its backing device's `read_ahead_kb` in
/// sysfs), where this process may (root); else it stays the kernel's.
fn raise_readahead(mountpoint: &Path) {
    let Some(dev) = mount_device(mountpoint) else {
        return;
    };
    let path = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    match std::fs::write(&path, format!("{KERNEL_READAHEAD_KB}\n")) {
        Ok(()) => tracing::debug!("{path}: {KERNEL_READAHEAD_KB}"),
        Err(e) => tracing::debug!("{path}: {e}: the kernel's read-ahead stays as it is"),
    }
}

/// The `MAJOR:MINOR` of the newest tarn mount at `mountpoint` (an absolute
/// path without links), from its mountinfo line (never a stat of the mount
/// point, which would ask the mount itself).
fn mount_device(mountpoint: &Path) -> Option<String> {
    let want = mountpoint.to_string_lossy();
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().rev().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        // After the optional fields, " - TYPE SOURCE OPTIONS": a FUSE
        // file system ("fuse", or "fuse.tarn" where the subtype is kept)
        // whose source is ours ("tarn:BUCKET/PREFIX").
        let dash = f.iter().position(|x| *x == "-")?;
        (f.len() > dash + 2
            && f.len() > 4
            && unescape_mountinfo(f[4]) == want
            && f[dash + 1].starts_with("fuse")
            && f[dash + 2].starts_with("tarn:"))
        .then(|| f[2].to_string())
    })
}

/// Unmounts a `tarn mount`: at once when nothing is open, else lazily (the
/// mount leaves the tree now, open files work until closed).
pub fn unmount(mountpoint: &Path) -> io::Result<()> {
    let out = Command::new("fusermount3")
        .arg("-u")
        .arg(mountpoint)
        .output()?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("busy") {
        return lazy_unmount(mountpoint);
    }
    Err(io::Error::other(format!(
        "fusermount3 -u {}: {}",
        mountpoint.display(),
        err.trim()
    )))
}

fn lazy_unmount(mountpoint: &Path) -> io::Result<()> {
    let out = Command::new("fusermount3")
        .arg("-u")
        .arg("-z")
        .arg(mountpoint)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "fusermount3 -u -z {}: {}",
            mountpoint.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Whether `path` is a FUSE mount of tarn's (its mountinfo line).
pub fn is_mounted(path: &Path) -> bool {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    mount_device(&path).is_some()
}

/// Mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
