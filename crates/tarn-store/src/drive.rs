//! One drive: a directory (meant to be its own NVMe) holding shard files and an
//! embedded ordered metadata index (`fjall`, an LSM tree).
//!
//! ```text
//! <drive>/.tarn/format          DriveFormat record (format.rs)
//! <drive>/.tarn/meta/           fjall database: buckets, objects, inline, uploads, parts
//! <drive>/.tarn/tmp/            shard files being written; emptied at start
//! <drive>/data/<aa>/<data id>   committed shard files, <aa> = first byte of the id in hex
//! ```
//!
//! All methods here block; the store calls them from blocking threads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};

use crate::error::StoreError;
use crate::format::{
    id_to_hex, BucketRecord, DriveFormat, Id128, ObjectRecord, UploadPartRecord, UploadRecord,
};

const FORMAT_FILE: &str = ".tarn/format";
const LOCK_FILE: &str = ".tarn/lock";

/// A drive held by this process: an exclusive `flock` on `.tarn/lock`, released
/// when the process exits however it exits. Two servers on one drive would each
/// write metadata the other does not see (and fjall's own lock would take the
/// second one's index offline while it went on serving an empty store); an
/// offline heal on a drive a server is using would race it. Both refuse.
pub struct DriveLock {
    _file: std::fs::File,
}

/// Takes the lock of the drive at `path` when it is (or will become) a Tarn
/// drive. None for a missing directory or a foreign one (nothing is written
/// into those); `DriveInUse` when another process holds it.
pub fn lock(path: &Path) -> Result<Option<DriveLock>, StoreError> {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;
    if !path.is_dir() {
        return Ok(None);
    }
    if !path.join(".tarn").is_dir() {
        if !matches!(probe(path), DriveProbe::Empty) {
            return Ok(None);
        }
        std::fs::create_dir_all(path.join(".tarn")).map_err(|e| StoreError::Drive {
            drive: path.display().to_string(),
            reason: format!("create .tarn: {e}"),
        })?;
    }
    let io = |what: &str, e: std::io::Error| StoreError::Drive {
        drive: path.display().to_string(),
        reason: format!("{what}: {e}"),
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path.join(LOCK_FILE))
        .map_err(|e| io("open the drive lock", e))?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(io("lock the drive", e));
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => "pid unknown".to_string(),
            pid => format!("pid {pid}"),
        };
        return Err(StoreError::DriveInUse {
            drive: path.display().to_string(),
            holder,
        });
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| file.write_all(pid.as_bytes()))
        .map_err(|e| io("write the drive lock", e))?;
    restrict(path).map_err(|e| io("make the drive's directories private", e))?;
    Ok(Some(DriveLock { _file: file }))
}

/// Only the server's user may enter a drive's `.tarn` and `data`
/// directories (0700): other local users reach an object's bytes only
/// through the server (S3, or a local read it authorized), never by opening
/// shard files. Applied at every start, so drives formatted by older builds
/// (0755) are closed too.
fn restrict(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for dir in [".tarn", "data"] {
        match std::fs::set_permissions(path.join(dir), std::fs::Permissions::from_mode(0o700)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// What was found at a drive path before opening it.
#[derive(Debug)]
pub enum DriveProbe {
    Missing,
    /// Exists, no format, nothing else in it: new or replaced.
    Empty,
    Formatted(DriveFormat),
    Unusable(String),
}

pub fn probe(path: &Path) -> DriveProbe {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return DriveProbe::Missing,
        Err(e) => return DriveProbe::Unusable(format!("cannot stat: {e}")),
        Ok(m) if !m.is_dir() => return DriveProbe::Unusable("not a directory".into()),
        Ok(_) => {}
    }
    match std::fs::read(path.join(FORMAT_FILE)) {
        Ok(bytes) => match DriveFormat::decode(&bytes) {
            Ok(f) => DriveProbe::Formatted(f),
            Err(e) => DriveProbe::Unusable(format!("format file is corrupt: {e}")),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let entries = match std::fs::read_dir(path) {
                Ok(rd) => rd
                    .filter_map(Result::ok)
                    .filter(|e| {
                        let n = e.file_name();
                        n != "lost+found" && n != ".tarn" && n != "data"
                    })
                    .count(),
                Err(e) => return DriveProbe::Unusable(format!("cannot list: {e}")),
            };
            if entries == 0 {
                DriveProbe::Empty
            } else {
                DriveProbe::Unusable(
                    "directory holds other files and no Tarn format; refusing to use it".into(),
                )
            }
        }
        Err(e) => DriveProbe::Unusable(format!("cannot read format file: {e}")),
    }
}

/// Writes the drive's directory tree and format file. The drive directory itself
/// must already exist: a missing mount point is never re-created here.
pub fn format_drive(path: &Path, format: &DriveFormat) -> Result<(), StoreError> {
    let io = |what: &str, e: std::io::Error| StoreError::Drive {
        drive: path.display().to_string(),
        reason: format!("{what}: {e}"),
    };
    std::fs::create_dir_all(path.join(".tarn/tmp")).map_err(|e| io("create .tarn/tmp", e))?;
    for b in 0..=255u8 {
        std::fs::create_dir_all(path.join("data").join(format!("{b:02x}")))
            .map_err(|e| io("create data dirs", e))?;
    }
    restrict(path).map_err(|e| io("make the drive's directories private", e))?;
    let tmp = path.join(".tarn/format.tmp");
    std::fs::write(&tmp, format.encode()).map_err(|e| io("write format", e))?;
    std::fs::File::open(&tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| io("sync format", e))?;
    std::fs::rename(&tmp, path.join(FORMAT_FILE)).map_err(|e| io("rename format", e))?;
    tarn_io::file::sync_dir(&path.join(".tarn")).map_err(|e| io("sync .tarn", e))?;
    tarn_io::file::sync_dir(path).map_err(|e| io("sync drive", e))?;
    Ok(())
}

/// Group commit: concurrent writers on a drive share journal fsyncs. A writer
/// commits its batch (visible, not yet durable), takes a ticket, and waits until
/// a sync covering its ticket finished. A blocking writer with no sync running
/// becomes the leader and fsyncs for everyone committed before it started; an
/// async writer (`DriveDb::durable`) registers its ticket and waits without a
/// thread, a leader started on the blocking pool for it if none runs. A
/// leader keeps syncing while async writers wait for tickets its last sync
/// did not cover.
#[derive(Default)]
struct GroupCommit {
    state: std::sync::Mutex<SyncState>,
    done: std::sync::Condvar,
    tickets: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct SyncState {
    synced: u64,
    leader: bool,
    failed: Option<String>,
    /// Async writers: their ticket, and where to answer.
    waiters: Vec<(u64, futures::channel::oneshot::Sender<Result<(), String>>)>,
}

/// The metadata index of one drive.
pub struct DriveDb {
    group: GroupCommit,
    db: Database,
    buckets: Keyspace,
    objects: Keyspace,
    inline: Keyspace,
    uploads: Keyspace,
    parts: Keyspace,
    /// The missed-write log (`MissedEntry`): keys written while another
    /// drive of the set could not take the write.
    missed: Keyspace,
    /// Deleted keys' stamps (object key -> u64 LE), so that a late write
    /// older than the deletion is refused (`write_object_visible`); swept
    /// after `TOMBSTONE_TTL_NS`. `HORIZON_KEY` holds the horizon: the
    /// highest stamp swept, below which a key without a record takes no
    /// write.
    tombstones: Keyspace,
    /// The horizon, as stored.
    horizon: std::sync::atomic::AtomicU64,
    /// Serialises the read-compare-write of one key's record (striped).
    record_locks: Box<[std::sync::Mutex<()>]>,
    /// Entries per set position, counted when first needed (bounds the log:
    /// past `MISSED_LOG_MAX_ENTRIES` the position's log overflows).
    missed_counts: std::sync::Mutex<std::collections::HashMap<u8, u64>>,
    /// Entries per position before the log overflows.
    missed_limit: std::sync::atomic::AtomicU64,
    name: String,
}

/// How many missed-write entries a drive keeps for one set position; past
/// this the position's log overflows (a marker), and the drive at that
/// position is backfilled in full instead of replayed.
pub const MISSED_LOG_MAX_ENTRIES: u64 = 1_000_000;

/// How long a deleted key's tombstone is kept: far longer than any write
/// can stay in flight (RPC deadlines are at most 10 minutes, locks lapse in
/// 15 s), and than the clock skew between nodes a cluster tolerates (a
/// node whose clock is this far behind has its first writes of deleted
/// keys refused as stale).
pub const TOMBSTONE_TTL_NS: u64 = 3600 * 1_000_000_000;

/// Stripes of `DriveDb::record_locks`.
const RECORD_LOCK_STRIPES: usize = 256;

/// The horizon's key in the `tombstones` keyspace (object keys start with
/// their bucket's name, never with a NUL).
const HORIZON_KEY: &[u8] = b"\0horizon";
/// A key whose write did not reach the drive at `position` of the set.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MissedEntry {
    pub position: u8,
    pub bucket: String,
    pub key: String,
}

/// A page of one position's missed-write log on one drive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MissedPage {
    /// (bucket, key, when last missed in ns), in key order.
    pub entries: Vec<(String, String, u64)>,
    /// When the log overflowed (its first entry refused), if it did.
    pub overflow: Option<u64>,
    /// More entries follow the last one.
    pub more: bool,
}

/// Key of a missed-write entry: position, then the object's key.
fn missed_key(position: u8, bucket: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + bucket.len() + 1 + key.len());
    k.push(position);
    k.extend_from_slice(&object_key(bucket, key));
    k
}

/// Key of a position's overflow marker: no object key starts with 0xFF
/// (bucket names are ASCII).
fn overflow_key(position: u8) -> [u8; 2] {
    [position, 0xFF]
}

/// The bucket and key of an object key (`object_key`).
fn split_object_key(k: &[u8]) -> Option<(String, String)> {
    let nul = k.iter().position(|&b| b == 0)?;
    Some((
        String::from_utf8(k[..nul].to_vec()).ok()?,
        String::from_utf8(k[nul + 1..].to_vec()).ok()?,
    ))
}

/// Key of an object: bucket, NUL, key. Bucket names cannot hold NUL, so the
/// bucket part is unambiguous and all keys of a bucket sort together by key bytes.
/// A stamp stored as u64 LE (a tombstone, the horizon); anything else is 0.
fn stamp_of(v: &[u8]) -> u64 {
    v.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

/// The stripe of `DriveDb::record_locks` an object key takes.
fn record_stripe(object_key: &[u8]) -> usize {
    (xxhash_rust::xxh3::xxh3_64(object_key) % RECORD_LOCK_STRIPES as u64) as usize
}

pub fn object_key(bucket: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(bucket.len() + 1 + key.len());
    k.extend_from_slice(bucket.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

fn inline_key(bucket: &str, key: &str, version: &Id128, mod_time_ns: u64) -> Vec<u8> {
    let mut k = object_key(bucket, key);
    k.push(0);
    k.extend_from_slice(version);
    k.extend_from_slice(&mod_time_ns.to_be_bytes());
    k
}

fn upload_key(bucket: &str, key: &str, upload_id: &Id128) -> Vec<u8> {
    let mut k = object_key(bucket, key);
    k.push(0);
    k.extend_from_slice(upload_id);
    k
}

fn part_key(upload_id: &Id128, number: u32) -> Vec<u8> {
    let mut k = upload_id.to_vec();
    k.extend_from_slice(&number.to_be_bytes());
    k
}

/// Entries of one bucket in key order, read lazily from the index.
pub struct ObjectCursor {
    iter: fjall::Iter,
    base_len: usize,
    /// bucket NUL prefix: iteration ends at the first key without it.
    want_prefix: Vec<u8>,
    name: String,
}

impl Iterator for ObjectCursor {
    type Item = Result<(String, Vec<u8>), StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let kv = self.iter.next()?;
            let (k, v) = match kv.into_inner() {
                Ok(kv) => kv,
                Err(e) => return Some(Err(index_error(&self.name, "scan objects", &e))),
            };
            if !k.starts_with(&self.want_prefix) {
                return None;
            }
            match std::str::from_utf8(&k[self.base_len..]) {
                Ok(key) => return Some(Ok((key.to_string(), v.to_vec()))),
                Err(_) => {
                    tracing::error!(drive = %self.name, "object key not UTF-8 skipped");
                    continue;
                }
            }
        }
    }
}

/// A record to bulk-load: key, encoded object record, inline bytes (version id,
/// modification time, data).
pub type BulkItem = (String, Vec<u8>, Option<(Id128, u64, Vec<u8>)>);

/// One change to an object's metadata on a drive, applied atomically.
#[derive(Default)]
pub struct ObjectWrite {
    /// The key's new record (one without versions deletes the key, keeping
    /// its tombstone), taken only over an older one; None leaves the
    /// record as it is.
    pub record: Option<ObjectRecord>,
    pub inline_put: Vec<(Id128, u64, Vec<u8>)>,
    pub inline_delete: Vec<(Id128, u64)>,
    /// Upload to retire in the same batch (completion).
    pub upload_delete: Option<(Id128, Vec<u32>)>,
    /// Set positions this write does not reach (their drives out of
    /// service, or missing this version's shards): recorded in the same
    /// batch in the missed-write log.
    pub missed: Vec<u8>,
}

/// Whether a metadata engine error says its files are damaged (checksums,
/// encodings, files missing from it), as opposed to the drive failing an I/O
/// or the index refusing writes after one failed.
pub fn index_corruption(e: &fjall::Error) -> bool {
    use std::io::ErrorKind;
    let damaged_io = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::UnexpectedEof | ErrorKind::InvalidData | ErrorKind::NotFound
        )
    };
    match e {
        fjall::Error::Storage(fjall::LsmError::Io(io)) => damaged_io(io),
        fjall::Error::Storage(_) => true,
        fjall::Error::Io(io) => damaged_io(io),
        fjall::Error::Poisoned | fjall::Error::Locked | fjall::Error::KeyspaceDeleted => false,
        _ => true,
    }
}

/// A metadata engine error as a store error: `IndexCorrupt` for damage.
fn index_error(drive: &str, what: &str, e: &fjall::Error) -> StoreError {
    if index_corruption(e) {
        StoreError::IndexCorrupt {
            drive: drive.to_string(),
            reason: format!("{what}: {e}"),
        }
    } else {
        StoreError::Drive {
            drive: drive.to_string(),
            reason: format!("{what}: {e}"),
        }
    }
}

/// Where a corrupt index is moved to (the previous one set aside is replaced):
/// kept for inspection, never read by Tarn again.
pub const CORRUPT_INDEX_DIR: &str = ".tarn/meta.corrupt";

/// Present while a drive's index is being rebuilt by heal: a restart
/// before the rebuild finished goes on with it instead of trusting an index
/// that lacks records.
pub const REBUILD_MARKER: &str = ".tarn/rebuilding";

/// Whether the drive's index was being rebuilt when the process stopped.
pub fn rebuild_pending(path: &Path) -> bool {
    path.join(REBUILD_MARKER).exists()
}

/// Records durably that the drive's index is being rebuilt.
/// The metadata reserve: a file of zeros each drive keeps, given back to
/// its filesystem the moment a write finds no space left, so that the
/// index can still take what frees space (DELETEs), recover its journal and
/// be repaired. Made again once the drive has room for it four times over.
pub const BALLAST_FILE: &str = ".tarn/reserve";

/// The size of a drive's metadata reserve: 1/64 of the filesystem, at
/// least 1 MiB and at most 128 MiB.
pub fn ballast_bytes(total: u64) -> u64 {
    (total / 64).clamp(1 << 20, 128 << 20)
}

/// Free and total bytes of the filesystem under `path` (for unprivileged
/// writers: `f_bavail`).
pub fn fs_space(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("a path with a NUL byte"))?;
    // SAFETY: statvfs(3) on a NUL-terminated path into a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let frsize = st.f_frsize as u64;
    Ok((st.f_bavail as u64 * frsize, st.f_blocks as u64 * frsize))
}

/// Makes the drive's metadata reserve if it is missing and the drive has
/// room for it four times over: whether the reserve is there now.
pub fn ensure_ballast(path: &Path) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let file = path.join(BALLAST_FILE);
    if file.exists() {
        return Ok(true);
    }
    let (free, total) = fs_space(path)?;
    let size = ballast_bytes(total);
    if free < size.saturating_mul(4) {
        return Ok(false);
    }
    let tmp = path.join(".tarn/reserve.tmp");
    let f = std::fs::File::create(&tmp)?;
    // SAFETY: fallocate(2) on a file this function owns.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, size as libc::off_t) };
    if r != 0 {
        // A filesystem without fallocate: the zeros are written.
        use std::io::Write;
        let zeros = vec![0u8; 1 << 20];
        let mut w = &f;
        let mut left = size;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            if let Err(e) = w.write_all(&zeros[..n]) {
                drop(f);
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            left -= n as u64;
        }
    }
    f.sync_all()?;
    std::fs::rename(&tmp, &file)?;
    Ok(true)
}

/// Gives the drive's metadata reserve back to its filesystem: whether there
/// was one.
pub fn release_ballast(path: &Path) -> bool {
    let _ = std::fs::remove_file(path.join(".tarn/reserve.tmp"));
    std::fs::remove_file(path.join(BALLAST_FILE)).is_ok()
}

pub fn mark_rebuilding(path: &Path) -> Result<(), StoreError> {
    let io = |what: &str, e: std::io::Error| StoreError::Drive {
        drive: path.display().to_string(),
        reason: format!("{what}: {e}"),
    };
    std::fs::File::create(path.join(REBUILD_MARKER))
        .and_then(|f| f.sync_all())
        .map_err(|e| io("write the rebuild marker", e))?;
    tarn_io::file::sync_dir(&path.join(".tarn")).map_err(|e| io("sync .tarn", e))
}

/// How far a backfill of a rebuilding drive got (kept in its rebuild
/// marker, format.md "Rebuild marker"): every key of its set up to and
/// including (`bucket`, `key`), in bucket then key order, was healed onto
/// it in phase `phase`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillCheckpoint {
    /// 0: filling; 1: the verifying scan (it restarts from the first key).
    pub phase: u8,
    pub bucket: String,
    pub key: String,
}

const CHECKPOINT_MAGIC: &[u8; 4] = b"TBF1";

impl BackfillCheckpoint {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.bucket.len() + self.key.len());
        out.extend_from_slice(CHECKPOINT_MAGIC);
        out.push(self.phase);
        for s in [&self.bucket, &self.key] {
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        let crc = crate::checksum::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// None for anything but a whole, intact checkpoint (an empty marker,
    /// one cut short, one from another version): the backfill starts over.
    pub fn decode(b: &[u8]) -> Option<BackfillCheckpoint> {
        let (body, crc) = b.split_at_checked(b.len().checked_sub(4)?)?;
        if crate::checksum::crc32c(body).to_le_bytes() != crc {
            return None;
        }
        let rest = body.strip_prefix(CHECKPOINT_MAGIC)?;
        let (&phase, mut rest) = rest.split_first()?;
        let mut text = || {
            let (len, tail) = rest.split_at_checked(2)?;
            let len = u16::from_le_bytes(len.try_into().ok()?) as usize;
            let (s, tail) = tail.split_at_checked(len)?;
            rest = tail;
            String::from_utf8(s.to_vec()).ok()
        };
        let bucket = text()?;
        let key = text()?;
        (rest.is_empty() && phase <= 1).then_some(BackfillCheckpoint { phase, bucket, key })
    }
}

/// The backfill checkpoint in a drive's rebuild marker, if it holds one.
pub fn backfill_checkpoint(path: &Path) -> Option<BackfillCheckpoint> {
    BackfillCheckpoint::decode(&std::fs::read(path.join(REBUILD_MARKER)).ok()?)
}

/// Replaces the rebuild marker by one holding `c` (written aside, synced,
/// renamed over it: a crash leaves the old checkpoint or the new one). Only
/// while the drive is rebuilding: a marker removed meanwhile stays removed.
pub fn save_backfill_checkpoint(path: &Path, c: &BackfillCheckpoint) -> std::io::Result<()> {
    let marker = path.join(REBUILD_MARKER);
    if !marker.exists() {
        return Ok(());
    }
    let tmp = path.join(".tarn/rebuilding.tmp");
    {
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, &c.encode())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &marker)
}

/// Removes the rebuild marker once heal has filled the index.
pub fn clear_rebuilding(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path.join(REBUILD_MARKER)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => tarn_io::file::sync_dir(&path.join(".tarn")),
    }
}

/// Moves a drive's metadata index out of the way so that a fresh one can be
/// opened and rebuilt by heal (marked as rebuilding first, so that a crash
/// in between still rebuilds).
pub fn set_aside_index(path: &Path) -> Result<(), StoreError> {
    let io = |what: &str, e: std::io::Error| StoreError::Drive {
        drive: path.display().to_string(),
        reason: format!("{what}: {e}"),
    };
    mark_rebuilding(path)?;
    let aside = path.join(CORRUPT_INDEX_DIR);
    match std::fs::remove_dir_all(&aside) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io("remove the index set aside before", e))
        }
        _ => {}
    }
    match std::fs::rename(path.join(".tarn/meta"), &aside) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(io("set the corrupt index aside", e))
        }
        _ => {}
    }
    tarn_io::file::sync_dir(&path.join(".tarn")).map_err(|e| io("sync .tarn", e))
}

/// A scratch copy of an index to open: table files (immutable) hard-linked,
/// everything else copied; with `cut` = (j, n), journal j is kept to its
/// first n bytes and later journals are left out.
fn scratch_copy(
    from: &Path,
    to: &Path,
    journals: &[(String, Vec<u8>)],
    cut: Option<(usize, u64)>,
) -> std::io::Result<()> {
    fn walk(from: &Path, to: &Path, in_tables: bool) -> std::io::Result<()> {
        std::fs::create_dir_all(to)?;
        for e in std::fs::read_dir(from)? {
            let e = e?;
            let (src, dst) = (e.path(), to.join(e.file_name()));
            if e.file_type()?.is_dir() {
                walk(&src, &dst, in_tables || e.file_name() == "tables")?;
            } else if in_tables {
                std::fs::hard_link(&src, &dst)?;
            } else if !e.file_name().to_string_lossy().ends_with(".jnl") {
                std::fs::copy(&src, &dst)?;
            }
        }
        Ok(())
    }
    match std::fs::remove_dir_all(to) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    walk(from, to, false)?;
    for (j, (name, data)) in journals.iter().enumerate() {
        let keep = match cut {
            Some((c, _)) if j > c => continue,
            Some((c, n)) if j == c => Some(n),
            _ => None,
        };
        let data = match keep {
            Some(n) => &data[..(n as usize).min(data.len())],
            None => &data[..],
        };
        std::fs::write(to.join(name), data)?;
    }
    Ok(())
}

impl DriveDb {
    /// Opens the drive's index: `IndexCorrupt` when its files are damaged.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let name = path.display().to_string();
        let err = |e: fjall::Error| index_error(&name, "open metadata index", &e);
        tarn_io::fault::check("open db").map_err(|e| StoreError::Drive {
            drive: name.clone(),
            reason: e.to_string(),
        })?;
        let db = Database::builder(path.join(".tarn/meta"))
            .open()
            .map_err(err)?;
        let ks = |n: &str| db.keyspace(n, KeyspaceCreateOptions::default).map_err(err);
        Ok(DriveDb {
            buckets: ks("buckets")?,
            objects: ks("objects")?,
            inline: ks("inline")?,
            uploads: ks("uploads")?,
            parts: ks("parts")?,
            missed: ks("missed")?,
            tombstones: ks("tombstones")?,
            horizon: Default::default(),
            record_locks: (0..RECORD_LOCK_STRIPES)
                .map(|_| std::sync::Mutex::new(()))
                .collect(),
            missed_counts: Default::default(),
            missed_limit: std::sync::atomic::AtomicU64::new(MISSED_LOG_MAX_ENTRIES),
            db: db.clone(),
            name: name.clone(),
            group: GroupCommit::default(),
        })
        .and_then(|d| {
            let h = d
                .tombstones
                .get(HORIZON_KEY)
                .map_err(|e| index_error(&name, "read the tombstone horizon", &e))?
                .map_or(0, |v| stamp_of(&v));
            d.horizon.store(h, std::sync::atomic::Ordering::Relaxed);
            Ok(d)
        })
    }

    /// Copies into this (fresh) index every entry that can still be read from
    /// the damaged one set aside at `.tarn/meta.corrupt`: the salvage of a
    /// drive that has no other drive to be healed from. A damaged journal is
    /// cut before the first batch that fails its checksum (the writes from
    /// there on are lost); damaged tables leave their entries behind. Works
    /// on a scratch copy (`.tarn/meta.salvage`, removed after): the set-aside
    /// index stays as it was found. Returns the entries copied and, when the
    /// journal was cut, which file at which byte.
    pub fn salvage(&self, root: &Path) -> Result<(u64, Option<(String, u64)>), String> {
        let aside = root.join(CORRUPT_INDEX_DIR);
        let scratch = root.join(".tarn/meta.salvage");
        let mut journals: Vec<(u64, String)> = std::fs::read_dir(&aside)
            .map_err(|e| format!("list the set-aside index: {e}"))?
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                Some((name.strip_suffix(".jnl")?.parse().ok()?, name))
            })
            .collect();
        journals.sort();
        // Each journal read once; every trial below writes its cut of it.
        let journals: Vec<(String, Vec<u8>)> = journals
            .into_iter()
            .map(|(_, name)| Ok((name.clone(), std::fs::read(aside.join(&name))?)))
            .collect::<std::io::Result<_>>()
            .map_err(|e| format!("read the set-aside journal: {e}"))?;
        // Journals are preallocated with zeros: up to the last non-zero byte.
        let written: Vec<u64> = journals
            .iter()
            .map(|(_, data)| {
                data.iter()
                    .rposition(|&b| b != 0)
                    .map_or(0, |i| i as u64 + 1)
            })
            .collect();
        let open = |cut: Option<(usize, u64)>| -> Result<Database, String> {
            scratch_copy(&aside, &scratch, &journals, cut)
                .map_err(|e| format!("copy the set-aside index: {e}"))?;
            Database::builder(&scratch)
                .open()
                .map_err(|e| e.to_string())
        };
        // Whole first; else the longest journal prefix that opens: the first
        // journal that fails when kept whole, cut by bisection.
        let found = match open(None) {
            Ok(db) => Some((db, None)),
            Err(_) => {
                let mut found = None;
                for j in 0..journals.len() {
                    if open(Some((j, written[j]))).is_ok() {
                        continue;
                    }
                    let (mut lo, mut hi) = (0u64, written[j]);
                    if open(Some((j, 0))).is_ok() {
                        // Invariant: a cut at lo opens, one at hi does not.
                        while hi - lo > 1 {
                            let mid = lo + (hi - lo) / 2;
                            if open(Some((j, mid))).is_ok() {
                                lo = mid;
                            } else {
                                hi = mid;
                            }
                        }
                        let db = open(Some((j, lo)))?;
                        found = Some((db, Some((journals[j].0.clone(), lo))));
                    }
                    break;
                }
                found
            }
        };
        let Some((src, cut)) = found else {
            let _ = std::fs::remove_dir_all(&scratch);
            return Err("nothing could be salvaged: the index's tables are damaged".into());
        };
        let mut copied = 0u64;
        for (name, dst) in [
            ("buckets", &self.buckets),
            ("objects", &self.objects),
            ("inline", &self.inline),
            ("uploads", &self.uploads),
            ("parts", &self.parts),
            ("tombstones", &self.tombstones),
        ] {
            let ks = src
                .keyspace(name, KeyspaceCreateOptions::default)
                .map_err(|e| format!("open {name}: {e}"))?;
            let mut batch = self.db.batch();
            let mut pending = 0;
            for kv in ks.iter() {
                // A damaged block ends what this keyspace gives.
                let Ok((k, v)) = kv.into_inner() else {
                    tracing::error!(drive = %self.name, keyspace = name, "salvage stopped at a damaged block");
                    break;
                };
                batch.insert(dst, k.to_vec(), v.to_vec());
                pending += 1;
                copied += 1;
                if pending == 10_000 {
                    std::mem::replace(&mut batch, self.db.batch())
                        .commit()
                        .map_err(|e| format!("write salvaged entries: {e}"))?;
                    pending = 0;
                }
            }
            batch
                .commit()
                .map_err(|e| format!("write salvaged entries: {e}"))?;
        }
        drop(src);
        let _ = std::fs::remove_dir_all(&scratch);
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| format!("persist salvaged entries: {e}"))?;
        Ok((copied, cut))
    }

    /// Commits `batch` and returns once it is durable, sharing the fsync with
    /// concurrent committers on this drive.
    fn commit_durable(&self, batch: fjall::OwnedWriteBatch, what: &str) -> Result<(), StoreError> {
        let ticket = self.commit_visible(batch, what)?;
        self.wait_synced(ticket)
    }

    /// Blocks until the commit of `ticket` is durable, leading a sync
    /// when none runs.
    fn wait_synced(&self, ticket: u64) -> Result<(), StoreError> {
        let mut st = self.group.state.lock().expect("group commit lock");
        loop {
            if st.synced >= ticket {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(self.fail("persist", e.clone()));
            }
            if !st.leader {
                st.leader = true;
                st = self.lead_syncs(st);
                continue;
            }
            st = self.group.done.wait(st).expect("group commit lock");
        }
    }

    /// Commits `batch` (visible, not durable yet): the ticket a sync must
    /// cover. Taken after the commit, so a sync that starts later covers it.
    fn commit_visible(&self, batch: fjall::OwnedWriteBatch, what: &str) -> Result<u64, StoreError> {
        use std::sync::atomic::Ordering;
        batch.commit().map_err(|e| self.fail(what, e))?;
        Ok(self.group.tickets.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// Returns once the commit of `ticket` is durable, without holding a
    /// thread while it waits.
    pub async fn durable(self: &Arc<Self>, ticket: u64, what: &str) -> Result<(), StoreError> {
        let rx = {
            let mut st = self.group.state.lock().expect("group commit lock");
            if st.synced >= ticket {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(self.fail(what, format!("persist: {e}")));
            }
            let (tx, rx) = futures::channel::oneshot::channel();
            st.waiters.push((ticket, tx));
            if !st.leader {
                st.leader = true;
                let db = self.clone();
                drop(st);
                // A sync runs on the blocking pool; without a runtime, here.
                let lead =
                    move || drop(db.lead_syncs(db.group.state.lock().expect("group commit lock")));
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => drop(rt.spawn_blocking(lead)),
                    Err(_) => lead(),
                }
            }
            rx
        };
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.fail(what, format!("persist: {e}"))),
            Err(_) => Err(self.fail(what, "the journal sync was abandoned")),
        }
    }

    /// Syncs the journal for everyone committed, as the leader (`st.leader`
    /// set by the caller), until no async writer waits for a later ticket;
    /// answers them and wakes the blocking ones after each sync.
    fn lead_syncs<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, SyncState>,
    ) -> std::sync::MutexGuard<'a, SyncState> {
        use std::sync::atomic::Ordering;
        loop {
            let target = self.group.tickets.load(Ordering::SeqCst);
            drop(st);
            let res = self.db.persist(PersistMode::SyncAll);
            st = self.group.state.lock().expect("group commit lock");
            match res {
                Ok(()) => st.synced = st.synced.max(target),
                // A failed fsync leaves the journal in an unknown state: every
                // later commit on this drive fails too.
                Err(e) => st.failed = Some(e.to_string()),
            }
            let synced = st.synced;
            let failed = st.failed.clone();
            let waiters = std::mem::take(&mut st.waiters);
            for (ticket, tx) in waiters {
                match &failed {
                    Some(e) => drop(tx.send(Err(e.clone()))),
                    None if ticket <= synced => drop(tx.send(Ok(()))),
                    None => st.waiters.push((ticket, tx)),
                }
            }
            self.group.done.notify_all();
            if st.waiters.is_empty() {
                st.leader = false;
                return st;
            }
        }
    }

    fn fail<E: std::fmt::Display + 'static>(&self, what: &str, e: E) -> StoreError {
        if let Some(e) = (&e as &dyn std::any::Any).downcast_ref::<fjall::Error>() {
            return index_error(&self.name, what, e);
        }
        StoreError::Drive {
            drive: self.name.clone(),
            reason: format!("{what}: {e}"),
        }
    }

    fn check_fault(&self, what: &'static str) -> Result<(), StoreError> {
        tarn_io::fault::check(what).map_err(|e| self.fail(what, e))
    }

    pub fn buckets(&self) -> Result<Vec<(String, BucketRecord)>, StoreError> {
        let mut out = Vec::new();
        for kv in self.buckets.iter() {
            let (k, v) = kv.into_inner().map_err(|e| self.fail("read buckets", e))?;
            let name = String::from_utf8(k.to_vec())
                .map_err(|_| self.fail("read buckets", "bucket name not UTF-8"))?;
            match BucketRecord::decode(&v) {
                Ok(r) => out.push((name, r)),
                Err(e) => {
                    tracing::error!(drive = %self.name, bucket = %name, error = %e, "corrupt bucket record skipped")
                }
            }
        }
        Ok(out)
    }

    pub fn put_bucket(&self, name: &str, rec: &BucketRecord) -> Result<(), StoreError> {
        self.check_fault("put bucket")?;
        self.buckets
            .insert(name.as_bytes(), rec.encode())
            .map_err(|e| self.fail("put bucket", e))?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| self.fail("persist", e))
    }

    pub fn delete_bucket(&self, name: &str) -> Result<(), StoreError> {
        self.check_fault("delete bucket")?;
        self.buckets
            .remove(name.as_bytes())
            .map_err(|e| self.fail("delete bucket", e))?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| self.fail("persist", e))
    }

    /// Whether any object or upload of `bucket` exists on this drive.
    /// Whether the bucket holds any object (or, with `uploads`, any
    /// multipart upload in progress) on this drive.
    pub fn bucket_has_entries(&self, bucket: &str, uploads: bool) -> Result<bool, StoreError> {
        let prefix = object_key(bucket, "");
        if let Some(kv) = self.objects.prefix(&prefix).next() {
            kv.into_inner().map_err(|e| self.fail("scan objects", e))?;
            return Ok(true);
        }
        if !uploads {
            return Ok(false);
        }
        if let Some(kv) = self.uploads.prefix(&prefix).next() {
            kv.into_inner().map_err(|e| self.fail("scan uploads", e))?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Reads an object record; a record that fails to decode is reported
    /// as corrupt. A deleted key whose tombstone is kept reads as a record
    /// without versions, with the deletion's stamp.
    pub fn object(&self, bucket: &str, key: &str) -> Result<Option<ObjectRecord>, StoreError> {
        let ok = object_key(bucket, key);
        let raw = self
            .objects
            .get(&ok)
            .map_err(|e| self.fail("read object", e))?;
        match raw {
            None => Ok(self
                .tombstones
                .get(&ok)
                .map_err(|e| self.fail("read tombstone", e))?
                .map(|v| ObjectRecord::tombstone(stamp_of(&v)))),
            Some(v) => {
                ObjectRecord::decode(&v)
                    .map(Some)
                    .map_err(|e| StoreError::CorruptMetadata {
                        drive: self.name.clone(),
                        what: format!("{bucket}/{key}: {e}"),
                    })
            }
        }
    }

    /// Applies one object change atomically and durably.
    pub fn write_object(&self, bucket: &str, key: &str, w: &ObjectWrite) -> Result<(), StoreError> {
        let ticket = self.write_object_visible(bucket, key, w)?;
        self.wait_synced(ticket)
    }

    /// Applies one object change atomically, visible at once: the ticket
    /// `durable` waits for.
    ///
    /// A record is taken only over one with a lower stamp (or the same
    /// record again): a write that reaches the drive after a newer one of
    /// the same key, whatever delayed it, is refused (`Superseded`) and
    /// changes nothing. A record without versions is kept as the key's
    /// tombstone.
    pub fn write_object_visible(
        &self,
        bucket: &str,
        key: &str,
        w: &ObjectWrite,
    ) -> Result<u64, StoreError> {
        self.check_fault("write object")?;
        let mut batch = self.db.batch();
        let ok = object_key(bucket, key);
        let _serial = w.record.as_ref().map(|_| {
            self.record_locks[record_stripe(&ok)]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        });
        if let Some(r) = &w.record {
            let (held, tombstoned) = self.held_stamp(&ok)?;
            if r.stamp < held.stamp
                || (r.stamp == held.stamp && !held.same_versions(r) && held.stamp != 0)
            {
                return Err(StoreError::Superseded {
                    drive: self.name.clone(),
                    what: format!("{bucket}/{key}"),
                    held: held.stamp,
                    offered: r.stamp,
                });
            }
            if r.versions.is_empty() {
                batch.remove(&self.objects, ok.clone());
                batch.insert(&self.tombstones, ok, r.stamp.to_le_bytes());
            } else {
                batch.insert(&self.objects, ok.clone(), r.encode());
                if tombstoned {
                    batch.remove(&self.tombstones, ok);
                }
            }
        }
        for (vid, mtime, data) in &w.inline_put {
            batch.insert(
                &self.inline,
                inline_key(bucket, key, vid, *mtime),
                data.as_slice(),
            );
        }
        for (vid, mtime) in &w.inline_delete {
            batch.remove(&self.inline, inline_key(bucket, key, vid, *mtime));
        }
        if let Some((upload_id, parts)) = &w.upload_delete {
            batch.remove(&self.uploads, upload_key(bucket, key, upload_id));
            for n in parts {
                batch.remove(&self.parts, part_key(upload_id, *n));
            }
        }
        let now = crate::store::now_ns();
        for &pos in &w.missed {
            self.add_missed(&mut batch, pos, bucket, key, now)?;
        }
        self.commit_visible(batch, "commit object")
    }

    /// The record of a key this drive holds, for ordering a write against
    /// it: its record, else its tombstone's stamp (true), else the horizon.
    /// A record that does not decode orders below everything (heal
    /// replaces it).
    fn held_stamp(&self, ok: &[u8]) -> Result<(ObjectRecord, bool), StoreError> {
        if let Some(v) = self
            .objects
            .get(ok)
            .map_err(|e| self.fail("read object", e))?
        {
            return Ok((ObjectRecord::decode(&v).unwrap_or_default(), false));
        }
        if let Some(v) = self
            .tombstones
            .get(ok)
            .map_err(|e| self.fail("read tombstone", e))?
        {
            return Ok((ObjectRecord::tombstone(stamp_of(&v)), true));
        }
        let horizon = self.horizon.load(std::sync::atomic::Ordering::Relaxed);
        Ok((ObjectRecord::tombstone(horizon), false))
    }

    /// Removes the tombstones whose stamp is below `before` (ns) and raises
    /// the horizon to the highest of them, durably: how many went.
    pub fn sweep_tombstones(&self, before: u64) -> Result<u64, StoreError> {
        self.check_fault("sweep tombstones")?;
        let mut batch = self.db.batch();
        let mut horizon = self.horizon.load(std::sync::atomic::Ordering::Relaxed);
        let mut removed = 0u64;
        let mut locks = Vec::new();
        for kv in self.tombstones.iter() {
            let (k, v) = kv
                .into_inner()
                .map_err(|e| self.fail("scan tombstones", e))?;
            if &*k == HORIZON_KEY {
                continue;
            }
            let stamp = stamp_of(&v);
            if stamp < before {
                locks.push(k.to_vec());
                horizon = horizon.max(stamp);
            }
        }
        for k in locks {
            // A write of the key between the scan and here replaced the
            // tombstone: only one still holding the stamp seen goes.
            let _serial = self.record_locks[record_stripe(&k)]
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match self
                .tombstones
                .get(&k)
                .map_err(|e| self.fail("read tombstone", e))?
            {
                Some(v) if stamp_of(&v) < before => {
                    batch.remove(&self.tombstones, k);
                    removed += 1;
                }
                _ => {}
            }
        }
        if removed == 0 {
            return Ok(0);
        }
        batch.insert(&self.tombstones, HORIZON_KEY, horizon.to_le_bytes());
        // The horizon is raised before the batch is visible: a write that
        // finds a swept key's tombstone gone finds the horizon above it.
        self.horizon
            .fetch_max(horizon, std::sync::atomic::Ordering::SeqCst);
        self.commit_durable(batch, "sweep tombstones")?;
        Ok(removed)
    }

    /// Puts one missed-write entry into `batch`, or the position's overflow
    /// marker once its log is full.
    fn add_missed(
        &self,
        batch: &mut fjall::OwnedWriteBatch,
        position: u8,
        bucket: &str,
        key: &str,
        now: u64,
    ) -> Result<(), StoreError> {
        let limit = self.missed_limit.load(std::sync::atomic::Ordering::Relaxed);
        let mut counts = self.missed_counts.lock().expect("missed counts");
        let count = match counts.get(&position) {
            Some(&n) => n,
            None => {
                let mut n = 0u64;
                for kv in self.missed.prefix([position]) {
                    kv.into_inner()
                        .map_err(|e| self.fail("count missed writes", e))?;
                    n += 1;
                    if n > limit {
                        break;
                    }
                }
                counts.insert(position, n);
                n
            }
        };
        if count >= limit {
            let marker = overflow_key(position);
            let known = self
                .missed
                .get(marker)
                .map_err(|e| self.fail("read the missed-write log", e))?
                .is_some();
            if !known {
                batch.insert(&self.missed, marker, now.to_be_bytes());
                counts.insert(position, count + 1);
            }
            return Ok(());
        }
        let k = missed_key(position, bucket, key);
        let known = self
            .missed
            .contains_key(&k)
            .map_err(|e| self.fail("read the missed-write log", e))?;
        batch.insert(&self.missed, k, now.to_be_bytes());
        if !known {
            counts.insert(position, count + 1);
        }
        Ok(())
    }

    /// Sets how many entries a position's log keeps before it overflows.
    pub fn set_missed_limit(&self, entries: u64) {
        self.missed_limit
            .store(entries, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records durably that writes of these keys missed drives of the set.
    pub fn log_missed(&self, entries: &[MissedEntry]) -> Result<(), StoreError> {
        self.check_fault("log missed writes")?;
        let mut batch = self.db.batch();
        let now = crate::store::now_ns();
        for e in entries {
            self.add_missed(&mut batch, e.position, &e.bucket, &e.key, now)?;
        }
        self.commit_durable(batch, "log missed writes")
    }

    /// Up to `max` entries of `position`'s missed-write log after key bytes
    /// `after` (exclusive; the raw object key), and its overflow marker.
    pub fn missed(
        &self,
        position: u8,
        after: Option<&[u8]>,
        max: usize,
    ) -> Result<MissedPage, StoreError> {
        let fail = |e: fjall::Error| self.fail("read the missed-write log", e);
        let mut page = MissedPage {
            overflow: self
                .missed
                .get(overflow_key(position))
                .map_err(fail)?
                .and_then(|v| Some(u64::from_be_bytes(v.as_ref().try_into().ok()?))),
            ..MissedPage::default()
        };
        let lo = match after {
            Some(a) => {
                let mut k = vec![position];
                k.extend_from_slice(a);
                k.push(0);
                k
            }
            None => vec![position],
        };
        let hi = overflow_key(position).to_vec();
        for kv in self.missed.range(lo..hi) {
            let (k, v) = kv.into_inner().map_err(fail)?;
            if page.entries.len() == max {
                page.more = true;
                break;
            }
            let Some((bucket, key)) = split_object_key(&k[1..]) else {
                tracing::error!(drive = %self.name, "unreadable missed-write entry skipped");
                continue;
            };
            let at = v.as_ref().try_into().map(u64::from_be_bytes).unwrap_or(0);
            page.entries.push((bucket, key, at));
        }
        Ok(page)
    }

    /// Removes missed-write entries of `position` once their keys are
    /// healed: each only if it was not logged again since (`at` as read);
    /// with `before`, the overflow marker and every entry logged before
    /// then (a full backfill that began at `before` covered them). Not made
    /// durable at once: an entry that comes back after a crash is replayed
    /// again, harmlessly.
    pub fn clear_missed(
        &self,
        position: u8,
        done: &[(String, String, u64)],
        before: Option<u64>,
    ) -> Result<(), StoreError> {
        let fail = |e: fjall::Error| self.fail("clear missed writes", e);
        let mut batch = self.db.batch();
        let mut removed = 0u64;
        for (bucket, key, at) in done {
            let k = missed_key(position, bucket, key);
            let now = self.missed.get(&k).map_err(fail)?;
            if now.is_some_and(|v| v.as_ref() == at.to_be_bytes()) {
                batch.remove(&self.missed, k);
                removed += 1;
            }
        }
        if let Some(before) = before {
            batch.remove(&self.missed, overflow_key(position));
            for kv in self
                .missed
                .range(vec![position]..overflow_key(position).to_vec())
            {
                let (k, v) = kv.into_inner().map_err(fail)?;
                let at = v.as_ref().try_into().map(u64::from_be_bytes).unwrap_or(0);
                if at < before {
                    batch.remove(&self.missed, k.to_vec());
                    removed += 1;
                }
            }
        }
        batch.commit().map_err(fail)?;
        let mut counts = self.missed_counts.lock().expect("missed counts");
        if let Some(n) = counts.get_mut(&position) {
            *n = n.saturating_sub(removed);
        }
        if before.is_some() {
            counts.remove(&position);
        }
        Ok(())
    }

    /// Writes many object records (and inline bytes) in one batch and persists
    /// once: the bulk-load path for imports and benchmarks.
    pub fn write_objects_bulk(&self, bucket: &str, items: &[BulkItem]) -> Result<(), StoreError> {
        self.check_fault("bulk write")?;
        let mut batch = self.db.batch();
        for (key, record, inline) in items {
            batch.insert(&self.objects, object_key(bucket, key), record.as_slice());
            if let Some((vid, mtime, data)) = inline {
                batch.insert(
                    &self.inline,
                    inline_key(bucket, key, vid, *mtime),
                    data.as_slice(),
                );
            }
        }
        batch.commit().map_err(|e| self.fail("bulk commit", e))?;
        self.db
            .persist(PersistMode::SyncAll)
            .map_err(|e| self.fail("persist", e))
    }

    pub fn inline_data(
        &self,
        bucket: &str,
        key: &str,
        version: &Id128,
        mod_time_ns: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let v = self
            .inline
            .get(inline_key(bucket, key, version, mod_time_ns))
            .map_err(|e| self.fail("read inline", e))?;
        Ok(v.map(|v| v.to_vec()))
    }

    /// A lazy cursor over the object entries of `bucket` whose keys start with
    /// `prefix` and are at least `from` (raw key bytes, inclusive).
    pub fn object_cursor(&self, bucket: &str, prefix: &str, from: Option<&[u8]>) -> ObjectCursor {
        let base = object_key(bucket, "");
        let mut lo = object_key(bucket, prefix);
        if let Some(f) = from {
            let mut k = base.clone();
            k.extend_from_slice(f);
            if k > lo {
                lo = k;
            }
        }
        let mut want = base.clone();
        want.extend_from_slice(prefix.as_bytes());
        ObjectCursor {
            iter: self.objects.range(lo..),
            base_len: base.len(),
            want_prefix: want,
            name: self.name.clone(),
        }
    }

    pub fn put_upload(
        &self,
        bucket: &str,
        key: &str,
        rec: &UploadRecord,
    ) -> Result<(), StoreError> {
        self.check_fault("put upload")?;
        let mut batch = self.db.batch();
        batch.insert(
            &self.uploads,
            upload_key(bucket, key, &rec.upload_id),
            rec.encode(),
        );
        self.commit_durable(batch, "put upload")
    }

    pub fn upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &Id128,
    ) -> Result<Option<UploadRecord>, StoreError> {
        let v = self
            .uploads
            .get(upload_key(bucket, key, upload_id))
            .map_err(|e| self.fail("read upload", e))?;
        match v {
            None => Ok(None),
            Some(v) => {
                UploadRecord::decode(&v)
                    .map(Some)
                    .map_err(|e| StoreError::CorruptMetadata {
                        drive: self.name.clone(),
                        what: format!("upload {}: {e}", id_to_hex(upload_id)),
                    })
            }
        }
    }

    /// Removes an upload and the given parts (abort).
    pub fn delete_upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &Id128,
        parts: &[u32],
    ) -> Result<(), StoreError> {
        self.check_fault("delete upload")?;
        let mut batch = self.db.batch();
        batch.remove(&self.uploads, upload_key(bucket, key, upload_id));
        for n in parts {
            batch.remove(&self.parts, part_key(upload_id, *n));
        }
        self.commit_durable(batch, "delete upload")
    }

    /// Uploads of `bucket` whose key starts with `prefix`, in (key, upload id) order.
    pub fn scan_uploads(
        &self,
        bucket: &str,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, UploadRecord)>, StoreError> {
        let base = object_key(bucket, "");
        let mut out = Vec::new();
        for kv in self.uploads.prefix(object_key(bucket, prefix)) {
            let (k, v) = kv.into_inner().map_err(|e| self.fail("scan uploads", e))?;
            if k.len() < base.len() + 17 {
                continue;
            }
            let key = &k[base.len()..k.len() - 17];
            let (Ok(key), Ok(rec)) = (std::str::from_utf8(key), UploadRecord::decode(&v)) else {
                tracing::error!(drive = %self.name, "corrupt upload record skipped");
                continue;
            };
            out.push((key.to_string(), rec));
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    pub fn put_part(&self, upload_id: &Id128, part: &UploadPartRecord) -> Result<(), StoreError> {
        self.check_fault("put part")?;
        let mut batch = self.db.batch();
        batch.insert(&self.parts, part_key(upload_id, part.number), part.encode());
        self.commit_durable(batch, "put part")
    }

    pub fn parts(&self, upload_id: &Id128) -> Result<Vec<UploadPartRecord>, StoreError> {
        let mut out = Vec::new();
        for kv in self.parts.prefix(upload_id) {
            let (_, v) = kv.into_inner().map_err(|e| self.fail("scan parts", e))?;
            match UploadPartRecord::decode(&v) {
                Ok(p) => out.push(p),
                Err(e) => {
                    tracing::error!(drive = %self.name, error = %e, "corrupt part record skipped")
                }
            }
        }
        Ok(out)
    }

    /// Every object key of every bucket, for the heal scanner.
    pub fn all_object_keys(&self, bucket: &str) -> Result<Vec<String>, StoreError> {
        let base = object_key(bucket, "");
        let mut out = Vec::new();
        for kv in self.objects.prefix(&base) {
            let k = kv.key().map_err(|e| self.fail("scan objects", e))?;
            if let Ok(key) = std::str::from_utf8(&k[base.len()..]) {
                out.push(key.to_string());
            }
        }
        Ok(out)
    }
}

impl DriveDb {
    /// Every data id any object version or upload part on this drive refers to.
    pub fn referenced_data_ids(&self) -> Result<std::collections::HashSet<Id128>, StoreError> {
        let mut out = std::collections::HashSet::new();
        for kv in self.objects.iter() {
            let (_, v) = kv.into_inner().map_err(|e| self.fail("scan objects", e))?;
            // A record that does not decode may still point at data: keep the
            // drive's files until it is healed (the sweep skips such drives).
            let rec = ObjectRecord::decode(&v).map_err(|e| StoreError::CorruptMetadata {
                drive: self.name.clone(),
                what: e.to_string(),
            })?;
            for ver in rec.versions {
                if let crate::format::Storage::Parts(parts) = ver.storage {
                    out.extend(parts.into_iter().map(|p| p.data_id));
                }
            }
        }
        for kv in self.parts.iter() {
            let (_, v) = kv.into_inner().map_err(|e| self.fail("scan parts", e))?;
            let p = UploadPartRecord::decode(&v).map_err(|e| StoreError::CorruptMetadata {
                drive: self.name.clone(),
                what: e.to_string(),
            })?;
            out.insert(p.data_id);
        }
        Ok(out)
    }
}

/// Paths of a drive's files.
#[derive(Debug, Clone)]
pub struct DrivePaths {
    pub root: PathBuf,
}

impl DrivePaths {
    pub fn shard(&self, data_id: &Id128) -> PathBuf {
        let hex = id_to_hex(data_id);
        self.root.join("data").join(&hex[..2]).join(hex)
    }
    pub fn tmp_shard(&self, data_id: &Id128) -> PathBuf {
        self.root.join(".tarn/tmp").join(id_to_hex(data_id))
    }
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join(".tarn/tmp")
    }
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(position: u8, key: &str) -> MissedEntry {
        MissedEntry {
            position,
            bucket: "bkt".into(),
            key: key.into(),
        }
    }

    #[test]
    fn backfill_checkpoints_round_trip_and_refuse_damage() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        let c = BackfillCheckpoint {
            phase: 0,
            bucket: "b".into(),
            key: "dir/k\n\u{e9}".into(),
        };
        // Nothing is saved where no rebuild is marked.
        save_backfill_checkpoint(dir.path(), &c).unwrap();
        assert!(!rebuild_pending(dir.path()));
        mark_rebuilding(dir.path()).unwrap();
        assert_eq!(
            backfill_checkpoint(dir.path()),
            None,
            "an empty marker starts over"
        );
        save_backfill_checkpoint(dir.path(), &c).unwrap();
        assert_eq!(backfill_checkpoint(dir.path()), Some(c.clone()));
        // A new rebuild starts over.
        mark_rebuilding(dir.path()).unwrap();
        assert_eq!(backfill_checkpoint(dir.path()), None);
        let bytes = c.encode();
        for cut in 0..bytes.len() {
            assert_eq!(
                BackfillCheckpoint::decode(&bytes[..cut]),
                None,
                "cut at {cut}"
            );
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert_eq!(BackfillCheckpoint::decode(&bad), None, "byte {i} flipped");
        }
    }

    fn version(t: u64) -> crate::format::VersionMeta {
        crate::format::VersionMeta {
            etag: format!("e{t}"),
            ..crate::format::test_version(0, t)
        }
    }

    fn record(t: u64) -> ObjectWrite {
        ObjectWrite {
            record: Some(ObjectRecord {
                versions: vec![version(t)],
                stamp: t,
            }),
            ..Default::default()
        }
    }

    fn deletion(stamp: u64) -> ObjectWrite {
        ObjectWrite {
            record: Some(ObjectRecord::tombstone(stamp)),
            ..Default::default()
        }
    }

    /// The lost write of issue 40: a DELETE's record write to one drive
    /// waited behind a busy core (its caller had given up on it) and was
    /// applied after the next PUT's record had reached that drive, putting
    /// the key back to "deleted" there; with another drive slow to answer,
    /// the PUT's version was on too few of the drives a conditional create
    /// read, which then replaced it. A drive now takes a record only over
    /// an older one.
    #[test]
    fn a_late_record_write_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        let db = DriveDb::open(dir.path()).unwrap();
        db.write_object("b", "k", &record(10)).unwrap();
        // The PUT after the DELETE arrives first, the DELETE (stamp 20) late.
        db.write_object("b", "k", &record(30)).unwrap();
        let late = db.write_object("b", "k", &deletion(20)).unwrap_err();
        assert!(
            matches!(
                late,
                StoreError::Superseded {
                    held: 30,
                    offered: 20,
                    ..
                }
            ),
            "{late}"
        );
        assert_eq!(db.object("b", "k").unwrap().unwrap().stamp, 30);
        // A late older PUT is refused alike; the same record again is not.
        assert!(db.write_object("b", "k", &record(25)).is_err());
        db.write_object("b", "k", &record(30)).unwrap();
        // Another record with the same stamp is refused.
        let mut other = record(30);
        other.record.as_mut().unwrap().versions[0].etag = "other".into();
        assert!(db.write_object("b", "k", &other).is_err());
        // A deletion keeps the key's stamp: an older PUT arriving after it
        // does not bring the key back, and the key lists as gone.
        db.write_object("b", "k", &deletion(40)).unwrap();
        assert_eq!(
            db.object("b", "k").unwrap(),
            Some(ObjectRecord::tombstone(40))
        );
        assert!(db.write_object("b", "k", &record(35)).is_err());
        assert!(!db.bucket_has_entries("b", true).unwrap());
        assert!(db.all_object_keys("b").unwrap().is_empty());
        // A newer PUT replaces the tombstone.
        db.write_object("b", "k", &record(50)).unwrap();
        assert_eq!(db.object("b", "k").unwrap().unwrap().versions.len(), 1);
        assert_eq!(db.all_object_keys("b").unwrap(), vec!["k".to_string()]);
        // What a drive holds survives a reopen.
        drop(db);
        let db = DriveDb::open(dir.path()).unwrap();
        assert_eq!(db.object("b", "k").unwrap().unwrap().stamp, 50);
        assert!(db.write_object("b", "k", &deletion(45)).is_err());
    }

    #[test]
    fn swept_tombstones_leave_a_horizon_older_writes_cannot_pass() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        let db = DriveDb::open(dir.path()).unwrap();
        for (k, t) in [("a", 100), ("b", 200), ("c", 300)] {
            db.write_object("bk", k, &record(t)).unwrap();
            db.write_object("bk", k, &deletion(t + 1)).unwrap();
        }
        assert_eq!(db.sweep_tombstones(250).unwrap(), 2);
        assert_eq!(db.object("bk", "a").unwrap(), None);
        assert_eq!(
            db.object("bk", "c").unwrap(),
            Some(ObjectRecord::tombstone(301))
        );
        // A write older than the highest swept stamp (201) finds no record
        // but is refused all the same, for any key: it may be one of the
        // swept keys' late writes.
        assert!(db.write_object("bk", "a", &record(150)).is_err());
        assert!(db.write_object("bk", "new", &record(201)).is_err());
        db.write_object("bk", "new", &record(202)).unwrap();
        drop(db);
        let db = DriveDb::open(dir.path()).unwrap();
        assert!(
            db.write_object("bk", "b", &record(190)).is_err(),
            "the horizon is durable"
        );
        assert_eq!(db.sweep_tombstones(250).unwrap(), 0);
    }

    #[test]
    fn the_missed_write_log_pages_clears_and_overflows() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        let db = DriveDb::open(dir.path()).unwrap();
        db.set_missed_limit(5);
        // With an object write, and on its own; a key logged twice is one
        // entry.
        let w = ObjectWrite {
            missed: vec![1, 2],
            ..Default::default()
        };
        db.write_object("bkt", "a", &w).unwrap();
        db.log_missed(&[entry(1, "b"), entry(1, "c"), entry(1, "a")])
            .unwrap();
        let page = db.missed(1, None, 2).unwrap();
        let keys: Vec<_> = page.entries.iter().map(|e| e.1.as_str()).collect();
        assert_eq!(keys, ["a", "b"]);
        assert!(page.more && page.overflow.is_none());
        let rest = db.missed(1, Some(&object_key("bkt", "b")), 10).unwrap();
        assert_eq!(rest.entries.len(), 1);
        assert_eq!(rest.entries[0].1, "c");
        assert!(!rest.more);
        assert_eq!(db.missed(2, None, 10).unwrap().entries.len(), 1);
        assert!(db.missed(3, None, 10).unwrap().entries.is_empty());
        // Cleared only as read: an entry logged again since stays.
        let all = db.missed(1, None, 10).unwrap().entries;
        std::thread::sleep(std::time::Duration::from_millis(2));
        db.log_missed(&[entry(1, "c")]).unwrap();
        db.clear_missed(1, &all, None).unwrap();
        let left = db.missed(1, None, 10).unwrap().entries;
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].1, "c");
        // Past the limit the position overflows: a marker, no more entries.
        let many: Vec<_> = (0..10).map(|i| entry(4, &format!("k{i}"))).collect();
        db.log_missed(&many).unwrap();
        let p = db.missed(4, None, 100).unwrap();
        assert_eq!(p.entries.len(), 5);
        let at = p.overflow.expect("overflowed");
        // A full heal begun after them clears the marker and the entries.
        db.clear_missed(4, &[], Some(at + 1)).unwrap();
        let p = db.missed(4, None, 100).unwrap();
        assert!(p.entries.is_empty() && p.overflow.is_none());
        // Kept across a reopen (durable).
        drop(db);
        let db = DriveDb::open(dir.path()).unwrap();
        assert_eq!(db.missed(1, None, 10).unwrap().entries.len(), 1);
        assert_eq!(db.missed(2, None, 10).unwrap().entries.len(), 1);
    }

    #[test]
    fn async_and_blocking_writers_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        {
            let db = Arc::new(DriveDb::open(dir.path()).unwrap());
            // Blocking writers on threads and async ones on a runtime at
            // once: each kind leads syncs the other waits for.
            let threads: Vec<_> = (0..4u8)
                .map(|t| {
                    let db = db.clone();
                    std::thread::spawn(move || put_parts(&db, t, 50))
                })
                .collect();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let writes = (0..200u64).map(|i| {
                    let db = db.clone();
                    async move {
                        let w = ObjectWrite {
                            inline_put: vec![([7; 16], i, vec![i as u8; 10])],
                            ..Default::default()
                        };
                        let commit = db.clone();
                        let ticket = tokio::task::spawn_blocking(move || {
                            commit.write_object_visible("b", &format!("k{i}"), &w)
                        })
                        .await
                        .unwrap()
                        .unwrap();
                        db.durable(ticket, "test write").await.unwrap();
                    }
                });
                futures::future::join_all(writes).await;
            });
            for t in threads {
                t.join().unwrap();
            }
        }
        let db = DriveDb::open(dir.path()).unwrap();
        for i in 0..200u64 {
            let got = db.inline_data("b", &format!("k{i}"), &[7; 16], i).unwrap();
            assert_eq!(got, Some(vec![i as u8; 10]), "async write {i} lost");
        }
        for t in 0..4u8 {
            assert_eq!(
                db.parts(&[t; 16]).unwrap().len(),
                50,
                "writer {t} lost commits"
            );
        }
    }

    #[test]
    fn a_damaged_index_is_told_from_a_failing_drive() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        {
            let db = DriveDb::open(dir.path()).unwrap();
            for i in 0..100 {
                let part = UploadPartRecord {
                    number: i,
                    size: 1,
                    etag: format!("etag {i}"),
                    data_id: [1; 16],
                    mod_time_ns: 1,
                    checksum: None,
                    salt: None,
                };
                db.put_part(&[1; 16], &part).unwrap();
            }
        }
        let journal = dir.path().join(".tarn/meta/0.jnl");
        let mut bytes = std::fs::read(&journal).unwrap();
        let written = bytes.iter().rposition(|&b| b != 0).unwrap();
        bytes[written / 2] ^= 0x5a;
        std::fs::write(&journal, bytes).unwrap();
        match DriveDb::open(dir.path()) {
            Err(StoreError::IndexCorrupt { .. }) => {}
            Err(e) => panic!("not told as corruption: {e}"),
            Ok(_) => panic!("a flipped journal byte went unnoticed"),
        }
        // Set aside, a fresh index opens (and the marker says it rebuilds).
        set_aside_index(dir.path()).unwrap();
        assert!(rebuild_pending(dir.path()));
        assert!(dir.path().join(CORRUPT_INDEX_DIR).join("0.jnl").exists());
        let db = DriveDb::open(dir.path()).unwrap();
        assert!(db.parts(&[1; 16]).unwrap().is_empty());
        // What precedes the damaged batch is salvaged, in order; the
        // set-aside index is left as it was.
        let before = std::fs::read(dir.path().join(CORRUPT_INDEX_DIR).join("0.jnl")).unwrap();
        let (entries, cut) = db.salvage(dir.path()).unwrap();
        let (journal, at) = cut.expect("the journal was cut");
        assert_eq!(journal, "0.jnl");
        assert!(at > 0 && at <= written as u64, "{at}");
        let parts = db.parts(&[1; 16]).unwrap();
        assert_eq!(parts.len() as u64, entries);
        assert!((30..100).contains(&entries), "{entries}");
        assert!(parts.iter().enumerate().all(|(i, p)| p.number == i as u32));
        assert_eq!(
            std::fs::read(dir.path().join(CORRUPT_INDEX_DIR).join("0.jnl")).unwrap(),
            before
        );
        assert!(!dir.path().join(".tarn/meta.salvage").exists());
        clear_rebuilding(dir.path()).unwrap();
        assert!(!rebuild_pending(dir.path()));
        // Refusals that are not damage.
        assert!(!index_corruption(&fjall::Error::Poisoned));
        assert!(!index_corruption(&fjall::Error::Locked));
        assert!(!index_corruption(&fjall::Error::Io(
            std::io::Error::from_raw_os_error(libc::EIO)
        )));
    }

    /// Parts 0..n of upload [t; 16], each committed durably on its own.
    fn put_parts(db: &DriveDb, t: u8, n: u32) {
        for i in 0..n {
            let part = UploadPartRecord {
                number: i,
                size: 1,
                etag: "e".into(),
                data_id: [t; 16],
                mod_time_ns: 1,
                checksum: None,
                salt: None,
            };
            db.put_part(&[t; 16], &part).unwrap();
        }
    }

    #[test]
    fn group_commit_keeps_every_concurrent_write() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(".tarn")).unwrap();
        {
            let db = std::sync::Arc::new(DriveDb::open(dir.path()).unwrap());
            let threads: Vec<_> = (0..8)
                .map(|t| {
                    let db = db.clone();
                    std::thread::spawn(move || put_parts(&db, t as u8, 50))
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
        }
        let db = DriveDb::open(dir.path()).unwrap();
        for t in 0..8u8 {
            assert_eq!(
                db.parts(&[t; 16]).unwrap().len(),
                50,
                "writer {t} lost commits"
            );
        }
    }
}
