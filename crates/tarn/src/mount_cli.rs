//! `tarn mount` and `tarn umount` (docs/mount.md).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use tarn_client::object::{ClientConfig, ObjectClient};

/// Names the pipe a background mount says "ready" on (set by the parent
/// for the child it starts).
const READY_FD_ENV: &str = "TARN_MOUNT_READY_FD";

#[derive(clap::Args)]
pub struct MountArgs {
    /// What to mount: s3://BUCKET or s3://BUCKET/PREFIX.
    source: String,
    /// An empty directory to mount it on.
    mountpoint: PathBuf,
    /// Refuse every change (EROFS).
    #[arg(long)]
    read_only: bool,
    /// The S3 endpoint (default: as the AWS tools find it, AWS_ENDPOINT_URL
    /// and the profile files).
    #[arg(long)]
    endpoint: Option<String>,
    /// A local directory that keeps the segments read (by version), for
    /// later reads in this mount and later ones (made mode 0700; one mount
    /// at a time).
    #[arg(long, requires = "cache_size")]
    cache_dir: Option<PathBuf>,
    /// Bytes the cache directory may hold at most (e.g. 10GiB): the least
    /// recently used go first.
    #[arg(long, requires = "cache_dir")]
    cache_size: Option<String>,
    /// Stay in the foreground (logs on stderr) instead of detaching once
    /// mounted.
    #[arg(long)]
    foreground: bool,
    /// Seconds what the bucket said of a name is trusted before asking
    /// again (it exists, its version, its size).
    #[arg(long, default_value = "1")]
    metadata_ttl: f64,
    /// Seconds a request may make no progress before it fails (and the call
    /// with EIO or ETIMEDOUT).
    #[arg(long, default_value = "10")]
    timeout: f64,
    /// Bytes read ahead of a sequential reader at most (whole segments of
    /// 8 MiB).
    #[arg(long, default_value = "64MiB")]
    read_ahead: String,
    /// Connections to the endpoint.
    #[arg(long, default_value = "16")]
    connections: usize,
    /// Owner of every file (default: the user mounting).
    #[arg(long)]
    uid: Option<u32>,
    /// Group of every file (default: the user's).
    #[arg(long)]
    gid: Option<u32>,
    /// Mode of files (octal).
    #[arg(long, default_value = "644")]
    file_mode: String,
    /// Mode of directories (octal).
    #[arg(long, default_value = "755")]
    dir_mode: String,
    /// mkdir writes an empty NAME/ object (else a new directory exists here
    /// until a file is written in it).
    #[arg(long)]
    dir_markers: bool,
    /// Reads bypass the kernel's page cache (one copy fewer: for files
    /// streamed once); nothing read stays cached by the kernel.
    #[arg(long)]
    direct_io: bool,
    /// Let other users use the mount (needs user_allow_other in
    /// /etc/fuse.conf unless root).
    #[arg(long)]
    allow_other: bool,
    /// Where a background mount writes its log (default:
    /// $XDG_STATE_HOME/tarn or ~/.local/state/tarn, mount-<name>.log).
    #[arg(long)]
    log_file: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct UmountArgs {
    /// Where `tarn mount` mounted.
    mountpoint: PathBuf,
}

/// `s3://bucket/some/prefix` → ("bucket", "some/prefix/").
fn parse_source(s: &str) -> anyhow::Result<(String, String)> {
    let Some(rest) = s.strip_prefix("s3://") else {
        bail!("{s}: say s3://BUCKET or s3://BUCKET/PREFIX");
    };
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        bail!("{s}: no bucket");
    }
    let prefix = prefix.trim_matches('/');
    if prefix.split('/').any(|c| c == "." || c == "..") || prefix.contains("//") {
        bail!("{s}: a prefix of . or .. or empty components cannot be a directory");
    }
    let prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    Ok((bucket.to_string(), prefix))
}

fn parse_mode(s: &str, what: &str) -> anyhow::Result<u16> {
    let m = u16::from_str_radix(s.trim_start_matches("0o"), 8)
        .with_context(|| format!("--{what} {s}: an octal mode such as 644"))?;
    if m > 0o7777 {
        bail!("--{what} {s}: at most 7777");
    }
    Ok(m)
}

fn secs(v: f64, what: &str) -> anyhow::Result<Duration> {
    if !(v.is_finite() && (0.0..=86_400.0).contains(&v)) {
        bail!("--{what} {v}: seconds from 0 to 86400");
    }
    Ok(Duration::from_secs_f64(v))
}

pub fn run_mount(a: MountArgs) -> anyhow::Result<()> {
    // Before any thread starts: the signals that unmount go to the thread
    // that handles them.
    tarn_mount::block_signals();
    let (bucket, prefix) = parse_source(&a.source)?;
    let meta = std::fs::metadata(&a.mountpoint)
        .with_context(|| format!("mountpoint {}", a.mountpoint.display()))?;
    if !meta.is_dir() {
        bail!("mountpoint {}: not a directory", a.mountpoint.display());
    }
    if !a.foreground && std::env::var_os(READY_FD_ENV).is_none() {
        return detach(&a);
    }
    let mut cfg = ClientConfig::from_env().context("S3 endpoint and credentials")?;
    if let Some(e) = &a.endpoint {
        cfg.endpoints = vec![e.clone()];
    }
    if cfg.endpoints.is_empty() {
        bail!("no endpoint: pass --endpoint URL or set AWS_ENDPOINT_URL");
    }
    cfg.connections = a.connections.max(1);
    cfg.io_timeout = secs(a.timeout, "timeout")?;
    if cfg.io_timeout.is_zero() {
        // A socket timeout of 0 is refused by the kernel's API: every
        // request would fail.
        bail!("--timeout 0: a request needs some time (seconds above 0)");
    }
    cfg.connect_timeout = cfg.io_timeout.min(Duration::from_secs(3));
    cfg.retries = cfg.retries.min(3);
    let read_ahead = crate::config::parse_size(&a.read_ahead)?;
    let cache = match (&a.cache_dir, &a.cache_size) {
        (Some(dir), Some(size)) => {
            let size = crate::config::parse_size(size)?;
            if size < 8 << 20 {
                bail!("--cache-size {size}: at least one segment (8MiB)");
            }
            Some((dir.clone(), size))
        }
        _ => None,
    };
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let opts = tarn_mount::Options {
        bucket,
        prefix,
        read_only: a.read_only,
        metadata_ttl: secs(a.metadata_ttl, "metadata-ttl")?,
        uid: a.uid.unwrap_or(uid),
        gid: a.gid.unwrap_or(gid),
        file_mode: parse_mode(&a.file_mode, "file-mode")?,
        dir_mode: parse_mode(&a.dir_mode, "dir-mode")?,
        read_ahead_segments: read_ahead.div_ceil(8 << 20).max(1),
        dir_markers: a.dir_markers,
        direct_io: a.direct_io,
        threads: 16,
        cache,
    };
    let client = ObjectClient::new(cfg).context("the object client")?;
    let ready_fd = std::env::var(READY_FD_ENV).ok();
    let log_file = a.log_file.clone();
    let at = a.mountpoint.clone();
    let source = a.source.clone();
    tarn_mount::serve(&a.mountpoint, opts, client, a.allow_other, move || {
        tracing::info!("mounted {source} on {}", at.display());
        if let Some(fd) = ready_fd.and_then(|f| f.parse::<i32>().ok()) {
            // SAFETY: the descriptor the parent passed for this; owned here.
            let mut pipe = unsafe { std::fs::File::from_raw_fd(fd) };
            let _ = pipe.write_all(b"ready\n");
            // From now on the log goes to its file: the parent is gone.
            if let Some(path) = &log_file {
                if let Ok(f) = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                {
                    // SAFETY: stderr replaced by the log file.
                    unsafe { libc::dup2(f.as_raw_fd(), 2) };
                }
            }
        }
    })
    .with_context(|| format!("mount {} on {}", a.source, a.mountpoint.display()))
}

/// Starts the mount in the background (the same command, `--foreground`,
/// in its own session) and returns once it is mounted, or with its error.
fn detach(a: &MountArgs) -> anyhow::Result<()> {
    let log = match &a.log_file {
        Some(p) => p.clone(),
        None => default_log(&a.mountpoint)?,
    };
    let mut fds = [0i32; 2];
    // SAFETY: a pipe into a two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the descriptors pipe2 just made, owned once each.
    let (read_end, write_end) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    let child_fd = write_end.as_raw_fd();
    let mut args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    args.push("--foreground".into());
    if a.log_file.is_none() {
        args.push("--log-file".into());
        args.push(log.clone().into());
    }
    let exe = std::env::current_exe().context("this program's path")?;
    let mut cmd = Command::new(exe);
    cmd.args(&args)
        .env(READY_FD_ENV, child_fd.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec: a new session, and the ready pipe's
    // write end kept open across exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            libc::setsid();
            let flags = libc::fcntl(child_fd, libc::F_GETFD);
            libc::fcntl(child_fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("start the mount")?;
    drop(write_end);
    let stderr = child.stderr.take().expect("piped");
    // What the child says before it is ready is this command's to show.
    let errors = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            lines.push(l);
        }
        lines
    });
    let mut line = String::new();
    let _ = BufReader::new(read_end).read_line(&mut line);
    if line.trim() == "ready" {
        println!(
            "mounted {} on {} (log: {})",
            a.source,
            a.mountpoint.display(),
            log.display()
        );
        return Ok(());
    }
    let status = child.wait().context("the mount")?;
    let lines = errors.join().unwrap_or_default();
    for l in &lines {
        eprintln!("{l}");
    }
    bail!("the mount did not start ({status})");
}

fn default_log(mountpoint: &Path) -> anyhow::Result<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME")?).join(".local/state"),
    }
    .join("tarn");
    std::fs::create_dir_all(&base).with_context(|| format!("log directory {}", base.display()))?;
    let full = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
    let name: String = full
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Ok(base.join(format!("mount-{}.log", name.trim_matches('_'))))
}

pub fn run_umount(a: UmountArgs) -> anyhow::Result<()> {
    tarn_mount::unmount(&a.mountpoint)
        .with_context(|| format!("unmount {}", a.mountpoint.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_and_modes() {
        assert_eq!(parse_source("s3://b").unwrap(), ("b".into(), "".into()));
        assert_eq!(parse_source("s3://b/").unwrap(), ("b".into(), "".into()));
        assert_eq!(
            parse_source("s3://b/x/y/").unwrap(),
            ("b".into(), "x/y/".into())
        );
        assert_eq!(parse_source("s3://b/x").unwrap(), ("b".into(), "x/".into()));
        for bad in [
            "b",
            "s3://",
            "s3:///x",
            "s3://b/../x",
            "s3://b/a//c",
            "http://b",
        ] {
            assert!(parse_source(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_mode("644", "m").unwrap(), 0o644);
        assert_eq!(parse_mode("0o755", "m").unwrap(), 0o755);
        assert!(parse_mode("9", "m").is_err());
        assert!(parse_mode("17777", "m").is_err());
    }
}
