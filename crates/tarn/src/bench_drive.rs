//! `tarn bench drive`: the sequential write rate of the drive under a
//! directory, written the way the object engine writes shards (4 KiB-aligned
//! buffers, O_DIRECT, on the thread's io_uring), with a queue of writes in
//! flight and one fsync at the end. It is the ceiling a PUT's durable write
//! runs toward, measured without fio on hosts that do not have it (a GPU
//! host with no package index).
//!
//! A filesystem that refuses O_DIRECT (tmpfs before Linux 6.6) is written
//! through the page cache instead, and the result says so (`"direct":
//! false`); it also names the filesystem, since a tmpfs that takes O_DIRECT
//! gives memory's rate, not a drive's.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use anyhow::{bail, Context};
use tarn_io::AlignedBuf;

use crate::bench::json_string;
use crate::config::parse_size;

/// The most writes one run keeps in flight (each holds one block buffer).
const DEPTH_MAX: usize = 256;
/// The largest block one write carries.
const BLOCK_MAX_BYTES: u64 = 64 << 20;

#[derive(clap::Args)]
pub struct DriveBenchArgs {
    /// Directory on the drive to measure; a scratch file is written there
    /// and removed afterwards.
    #[arg(long)]
    pub dir: PathBuf,
    /// Bytes written in all, e.g. 4GiB.
    #[arg(long, default_value = "4GiB")]
    pub size: String,
    /// Bytes per write, e.g. 1MiB (a multiple of 4 KiB).
    #[arg(long, default_value = "1MiB")]
    pub block: String,
    /// Writes in flight.
    #[arg(long, default_value_t = 16)]
    pub depth: usize,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// What one run measured.
struct Outcome {
    bytes: u64,
    /// Seconds from the first write to the end of the fsync.
    seconds: f64,
    /// Seconds of the closing fsync alone.
    fsync_seconds: f64,
    direct: bool,
}

pub fn run(args: DriveBenchArgs) -> anyhow::Result<()> {
    let size = parse_size(&args.size).context("--size")?;
    let block = parse_size(&args.block).context("--block")?;
    if block == 0 || block % tarn_io::ALIGNMENT_BYTES as u64 != 0 || block > BLOCK_MAX_BYTES {
        bail!(
            "--block must be a multiple of {} bytes, at most {} MiB",
            tarn_io::ALIGNMENT_BYTES,
            BLOCK_MAX_BYTES >> 20
        );
    }
    if size < block {
        bail!("--size must be at least one --block");
    }
    if args.depth == 0 || args.depth > DEPTH_MAX {
        bail!("--depth must be 1 to {DEPTH_MAX}");
    }
    if !args.dir.is_dir() {
        bail!("{}: not a directory", args.dir.display());
    }
    let path = args
        .dir
        .join(format!(".tarn-bench-drive.{}", std::process::id()));
    let rt = tarn_io::runtime::build_core_runtime(0, false, true)?;
    let blocks = size / block;
    let outcome = rt.block_on(write_blocks(
        path.clone(),
        blocks,
        block as usize,
        args.depth,
    ));
    let _ = std::fs::remove_file(&path);
    let o = outcome.with_context(|| format!("writing {}", path.display()))?;
    let gbps = o.bytes as f64 / o.seconds / 1e9;
    let fs = filesystem(&args.dir);
    if args.json {
        println!(
            "{{\"dir\":{},\"filesystem\":{},\"bytes\":{},\"block_bytes\":{},\"depth\":{},\"direct\":{},\"io_uring\":{},\"seconds\":{:.4},\"fsync_seconds\":{:.4},\"gb_per_sec\":{:.3}}}",
            json_string(&args.dir.display().to_string()),
            json_string(&fs),
            o.bytes,
            block,
            args.depth,
            o.direct,
            rt.block_on(async { tarn_io::IoBackend::current() == tarn_io::IoBackend::IoUring }),
            o.seconds,
            o.fsync_seconds,
            gbps
        );
    } else {
        println!(
            "{} ({fs}): {} MiB in {} KiB writes, {} in flight, {}: {:.2} GB/s ({:.2} s, fsync {:.3} s)",
            args.dir.display(),
            o.bytes >> 20,
            block >> 10,
            args.depth,
            if o.direct {
                "O_DIRECT"
            } else {
                "buffered (the filesystem refuses O_DIRECT)"
            },
            gbps,
            o.seconds,
            o.fsync_seconds
        );
    }
    Ok(())
}

/// The kind of filesystem `dir` is on, by its magic number: a tmpfs takes
/// O_DIRECT on recent kernels, and its rate is memory's, not a drive's.
fn filesystem(dir: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return "unknown".into();
    };
    // SAFETY: statfs into a zeroed struct from a NUL-terminated path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown".into();
    }
    match st.f_type as u64 {
        0x0102_1994 => "tmpfs".into(),
        0xef53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683e => "btrfs".into(),
        0x794c_7630 => "overlayfs".into(),
        0x2fc1_2fc1 => "zfs".into(),
        0x6969 => "nfs".into(),
        other => format!("0x{other:x}"),
    }
}

/// Writes `blocks` blocks of `block` bytes with `depth` writers, each taking
/// the next block number, then syncs the file.
async fn write_blocks(
    path: PathBuf,
    blocks: u64,
    block: usize,
    depth: usize,
) -> anyhow::Result<Outcome> {
    let (file, direct) = tarn_io::File::create_direct(path).await?;
    // Bytes that are not all zeros, so no layer below can skip them.
    let pattern: Vec<u8> = (0..block).map(|i| (i * 131 + 7) as u8).collect();
    let next = Rc::new(std::cell::Cell::new(0u64));
    let started = Instant::now();
    let local = tokio::task::LocalSet::new();
    let writers: Vec<_> = (0..depth)
        .map(|_| {
            let (file, next) = (file.clone(), next.clone());
            let mut buf = AlignedBuf::with_capacity(block);
            buf.extend_from_slice(&pattern);
            local.spawn_local(async move {
                loop {
                    let n = next.get();
                    if n >= blocks {
                        return Ok::<(), std::io::Error>(());
                    }
                    next.set(n + 1);
                    let (res, b) = file.write_all_at(buf, n * block as u64).await;
                    buf = b;
                    res?;
                }
            })
        })
        .collect();
    local
        .run_until(async {
            for w in writers {
                w.await??;
            }
            Ok::<(), anyhow::Error>(())
        })
        .await?;
    let synced = Instant::now();
    file.sync_all().await?;
    let end = Instant::now();
    Ok(Outcome {
        bytes: blocks * block as u64,
        seconds: (end - started).as_secs_f64(),
        fsync_seconds: (end - synced).as_secs_f64(),
        direct,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_block_and_reports_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let rt = tarn_io::runtime::build_core_runtime(0, false, true).unwrap();
        let o = rt
            .block_on(write_blocks(path.clone(), 10, 64 << 10, 4))
            .unwrap();
        assert_eq!(o.bytes, 10 * (64 << 10));
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data.len(), 10 * (64 << 10));
        // Every block carries the pattern: no block was skipped or torn.
        for chunk in data.chunks(64 << 10) {
            assert_eq!(chunk[1], (131 + 7) as u8);
            assert_eq!(chunk[(64 << 10) - 1], (((64 << 10) - 1) * 131 + 7) as u8);
        }
    }
}
