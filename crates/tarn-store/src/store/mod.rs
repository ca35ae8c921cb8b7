//! The object engine on one node's drives.
//!
//! Metadata of an object lives on every drive of its erasure set; it becomes
//! visible (the commit point) once a write quorum of those drives has durably
//! stored it. Reads resolve the drives' records: a version counts only if at
//! least a read quorum of drives hold it, which a torn commit never reaches
//! without also having all of its data durably written first.

mod backfill;
mod commit;
pub mod drain;
pub mod get;
mod heal;
mod list;
pub mod local;
mod locking;
mod missed;
mod multipart;
mod pools;
pub(crate) mod put;
mod topology;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tarn_io::file::run_blocking;
use tarn_io::BufferPool;
use tokio::sync::mpsc;

use crate::catalog::Catalog;
use crate::config::{default_parity_shards, default_set_drive_count, StoreConfig};
use crate::drive::{self, DriveDb, DrivePaths, DriveProbe, ObjectWrite};
use crate::drive_io::{Drive, DriveState, LocalDrive};
use crate::error::StoreError;
use crate::format::{
    id_from_hex, id_to_hex, new_id, BucketRecord, CodecId, DriveFormat, Durability, Id128, Layout,
    ObjectRecord, Storage, VersionMeta, Versioning,
};
use crate::lock::{LeaseTable, LockTable};
use crate::types::{BucketInfo, DriveStatus, ObjectInfo, PartSummary};

pub use backfill::{BackfillStatus, Resumed};
pub use get::ObjectStream;
pub use missed::UnderReplicated;
pub use topology::DriveChange;

/// The all-zero version id of the "null" version.
pub const NULL_VERSION: Id128 = [0u8; 16];
/// Object keys: S3 allows up to 1024 bytes of UTF-8.
pub const KEY_MAX_BYTES: usize = 1024;
/// Bounded heal queue; a full queue drops requests (the scanner finds them later).
const HEAL_QUEUE_MAX: usize = 10_000;

/// The drives the engine serves and how they form sets. A cluster's map can
/// give a set position another drive while the engine runs (a node
/// replaced): a new topology is swapped in, and a request keeps the one it
/// started with. Set indexes and positions keep their meaning across
/// changes, and slot `i` always holds the drive of the same place.
pub(crate) struct Topology {
    pub slots: Vec<Arc<DriveSlot>>,
    /// Each set's slots, in shard position order.
    pub sets: Vec<Vec<usize>>,
    /// The pools, in the map's order: each a run of consecutive sets.
    pub pools: Vec<PoolTopo>,
}

/// A pool: erasure sets of one geometry. A key has one set in each pool
/// (`Store::key_sets`); its versions live in one of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolTopo {
    pub id: u32,
    /// Its sets' global indexes.
    pub sets: std::ops::Range<usize>,
    pub data_shards: usize,
    pub parity_shards: usize,
    /// Serves its objects, takes no new ones (drain).
    pub draining: bool,
    /// Drained and retired: holds nothing, a key has no set in it.
    pub retired: bool,
}

impl PoolTopo {
    /// Takes new keys (and keys moved out of a draining pool).
    pub fn takes_keys(&self) -> bool {
        !self.draining && !self.retired
    }
}

impl Topology {
    /// The pool set `set` belongs to.
    pub fn pool_of(&self, set: usize) -> &PoolTopo {
        self.pools
            .iter()
            .find(|p| p.sets.contains(&set))
            .expect("every set is in a pool")
    }
}

pub(crate) struct DriveSlot {
    /// Held for the store's life: one process per drive (taken again when a
    /// wiped drive rejoins).
    pub lock: Mutex<Option<drive::DriveLock>>,
    /// Where a drive of this node is (unused for a drive of another node).
    pub paths: DrivePaths,
    /// Names the drive in logs and status: its path, or its node and id.
    pub name: String,
    /// A drive of another node: the engine reaches it over RPC, and its node
    /// looks after its files (probes, locks, free space, rebuild markers).
    remote: Option<Arc<dyn Drive>>,
    state: std::sync::RwLock<SlotState>,
    pub set_index: usize,
    /// Where the drive belongs (deployment, set, position): a drive rejoins
    /// while running only if its format says so, or it is empty.
    pub expected: DriveFormat,
    /// Its filesystem's free space, looked at most once a second.
    space: Mutex<Space>,
    /// A drive of this node: its locks and pins as every node asks for them
    /// (kept while the drive leaves and rejoins).
    leases: Option<Arc<LeaseTable>>,
}

#[derive(Default)]
struct Space {
    at: Option<std::time::Instant>,
    free: u64,
    total: u64,
}

tokio::task_local! {
    /// The read-ahead budget of the caller a request runs for (one access
    /// key, or one anonymous client address; set by the S3 front): its GETs
    /// take room in it before the shared budget, so one caller's unread
    /// responses cannot hold all of it.
    pub static CALLER_READ_AHEAD: Arc<tokio::sync::Semaphore>;

    /// Whether the GET a request makes goes, untouched, to a plain HTTP
    /// connection that sends registered runs from their files (set by the
    /// S3 layer where it hands a GET's stream to the response, when the
    /// front marked the request with [`SendsFromFiles`]). Its blocks that
    /// verify in the page cache then go as views of their files, never
    /// copied (`tarn_io::view`).
    pub static SENDS_FROM_FILES: bool;
}

/// A request extension: the connection sends registered runs from their
/// files and nothing reads an object GET's body on the way to it (a plain
/// HTTP connection, sending from files on).
#[derive(Debug, Clone, Copy)]
pub struct SendsFromFiles;

/// Pieces of read-ahead (`get::PIECE_BYTES` each) in a budget of `bytes`.
pub fn read_ahead_pieces(bytes: usize) -> usize {
    (bytes / get::PIECE_BYTES).max(get::READ_AHEAD_PIECES)
}

/// How long a free-space reading is trusted.
const SPACE_RECHECK: Duration = Duration::from_secs(1);
/// How long another node's report of its drive's space is.
const SPACE_REPORT_TTL: Duration = Duration::from_secs(30);

/// Whether a drive is in use, and why not.
struct SlotState {
    /// The drive while in use.
    db: Option<Arc<dyn Drive>>,
    reason: Option<String>,
    /// Taken out while running (an I/O error): probed until it works again.
    faulty: bool,
    /// Its index is known to lack records (it joined empty, its corrupt index
    /// was set aside, or it missed writes while out): it takes every write and
    /// serves its shards, but answers no metadata reads until a heal that
    /// started after this rebuild began has filled it. The number names the
    /// rebuild, so that a heal promotes only the one it covered.
    rebuilding: Option<u64>,
    /// The rebuild needs a full heal (the drive joined empty, or its index
    /// was set aside); otherwise it is syncing: it only missed writes while
    /// away, which the missed-write log names, and serves reads again once
    /// the set's logs hold nothing for its position.
    full: bool,
    /// Its index was found damaged while running: set aside at rejoin.
    reindex: bool,
}

impl DriveSlot {
    fn new(
        lock: Option<drive::DriveLock>,
        paths: DrivePaths,
        set_index: usize,
        expected: DriveFormat,
        opened: Result<DriveDb, String>,
        rebuilding: Option<u64>,
        full: bool,
    ) -> DriveSlot {
        let leases = Arc::new(LeaseTable::new(paths.clone()));
        let (db, reason) = match opened {
            Ok(db) => (Some(local_drive(db, &paths, &leases)), None),
            Err(r) => (None, Some(r)),
        };
        DriveSlot {
            leases: Some(leases),
            lock: Mutex::new(lock),
            name: paths.root.display().to_string(),
            paths,
            remote: None,
            state: std::sync::RwLock::new(SlotState {
                db,
                reason,
                faulty: false,
                rebuilding,
                full,
                reindex: false,
            }),
            set_index,
            expected,
            space: Mutex::new(Space::default()),
        }
    }

    /// A drive of another node, in use from the start: calls that fail take
    /// it out, and it is tried again every few seconds (`watch_drives`).
    fn remote(drive: Arc<dyn Drive>, set_index: usize, expected: DriveFormat) -> DriveSlot {
        DriveSlot {
            lock: Mutex::new(None),
            paths: DrivePaths {
                root: PathBuf::new(),
            },
            name: drive.name().to_string(),
            remote: Some(drive.clone()),
            state: std::sync::RwLock::new(SlotState {
                db: Some(drive),
                reason: None,
                faulty: false,
                rebuilding: None,
                full: false,
                reindex: false,
            }),
            set_index,
            expected,
            space: Mutex::new(Space::default()),
            leases: None,
        }
    }

    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }

    /// Whether the drive can take `need` more bytes of shard data and keep
    /// its reserve (`reserve`: None for the default, 2% of the drive, at
    /// most 1 GiB). A drive of another node is full only after a write to it
    /// failed for lack of space, until the next reading (its node keeps its
    /// reserve).
    pub fn has_room(&self, need: u64, reserve: Option<u64>) -> bool {
        let mut sp = self.space.lock().expect("drive space");
        if self.remote.is_some() {
            return sp.at.is_none_or(|t| t.elapsed() >= SPACE_RECHECK) || sp.free > 0;
        }
        if !self.read_space(&mut sp) {
            // Unknown: let the write find out.
            return true;
        }
        let reserve = reserve.unwrap_or((sp.total / 50).min(1 << 30));
        sp.free >= reserve.saturating_add(need)
    }

    /// Reads this node's drive's space into `sp` unless a reading less
    /// than `SPACE_RECHECK` old is there: whether `sp` holds one now.
    fn read_space(&self, sp: &mut Space) -> bool {
        if sp.at.is_none_or(|t| t.elapsed() >= SPACE_RECHECK) {
            let Ok((free, total)) = drive::fs_space(&self.paths.root) else {
                return false;
            };
            (sp.free, sp.total) = (free, total);
            sp.at = Some(std::time::Instant::now());
        }
        true
    }

    /// Free and total bytes: read now (at most once a second) for a drive
    /// of this node; for another node's, as its node last reported them
    /// (`set_space`), unknown after `SPACE_REPORT_TTL` without a report.
    pub fn space(&self) -> Option<(u64, u64)> {
        let mut sp = self.space.lock().expect("drive space");
        let known = match (self.remote.is_some(), sp.at) {
            (false, _) => self.read_space(&mut sp),
            (true, Some(t)) => t.elapsed() < SPACE_REPORT_TTL && sp.total > 0,
            (true, None) => false,
        };
        known.then_some((sp.free, sp.total))
    }

    /// What another node reports of its drive's space.
    pub fn set_space(&self, free: u64, total: u64) {
        let mut sp = self.space.lock().expect("drive space");
        sp.free = free;
        sp.total = total;
        sp.at = Some(std::time::Instant::now());
    }

    /// Out of space now (an ENOSPC): full until the next reading says not.
    fn mark_full(&self) {
        let mut sp = self.space.lock().expect("drive space");
        sp.free = 0;
        sp.at = Some(std::time::Instant::now());
    }

    /// Counts a write against the cached free space until the next reading.
    pub fn consumed(&self, bytes: u64) {
        let mut sp = self.space.lock().expect("drive space");
        sp.free = sp.free.saturating_sub(bytes);
    }

    /// The drive for metadata reads: while it is in use and its index is
    /// complete (not rebuilding).
    pub fn db(&self) -> Option<Arc<dyn Drive>> {
        let st = self.state.read().expect("drive state");
        st.db.clone().filter(|_| st.rebuilding.is_none())
    }

    /// The drive for writes (and its shard files): while it is in use,
    /// rebuilding or not.
    pub fn writer(&self) -> Option<Arc<dyn Drive>> {
        self.state.read().expect("drive state").db.clone()
    }

    /// In use: takes writes and serves its shard files.
    pub fn online(&self) -> bool {
        self.state.read().expect("drive state").db.is_some()
    }

    /// In use with a complete index: answers metadata reads.
    pub fn readable(&self) -> bool {
        let st = self.state.read().expect("drive state");
        st.db.is_some() && st.rebuilding.is_none()
    }

    pub fn rebuilding(&self) -> Option<u64> {
        self.state.read().expect("drive state").rebuilding
    }

    /// Rebuilding in full (heal of every object), not only syncing.
    pub fn rebuilding_full(&self) -> Option<u64> {
        let st = self.state.read().expect("drive state");
        st.rebuilding.filter(|_| st.full)
    }

    /// Syncing: readable again once the missed-write log is replayed.
    pub fn syncing(&self) -> Option<u64> {
        let st = self.state.read().expect("drive state");
        st.rebuilding.filter(|_| !st.full && st.db.is_some())
    }

    pub fn reason(&self) -> Option<String> {
        self.state.read().expect("drive state").reason.clone()
    }

    fn faulty(&self) -> bool {
        self.state.read().expect("drive state").faulty
    }
}

/// A drive of this node as the engine reaches it.
fn local_drive(db: DriveDb, paths: &DrivePaths, leases: &Arc<LeaseTable>) -> Arc<dyn Drive> {
    Arc::new(LocalDrive::with_leases(
        Arc::new(db),
        paths.clone(),
        leases.clone(),
    ))
}

/// Whether an error is ENOSPC: an `io::Error` anywhere in its source chain
/// says so, or, for errors the metadata engine hands back as text only, the
/// OS's message does.
fn no_space(error: &(dyn std::error::Error + 'static)) -> bool {
    in_chain(error, |e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::ENOSPC))
    }) || error.to_string().contains("os error 28")
}

/// Whether an error says the process (EMFILE) or the system (ENFILE) ran
/// out of file descriptors.
fn fds_exhausted(error: &(dyn std::error::Error + 'static)) -> bool {
    in_chain(error, |e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| matches!(io.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)))
    }) || {
        let t = error.to_string();
        t.contains("os error 24") || t.contains("os error 23")
    }
}

/// Whether an error says a drive of another node did not answer in time
/// while its node was not found silent (`StoreError::Late`, or the
/// `TimedOut` I/O error a shard call carries it as): no fault of the drive.
fn late(error: &(dyn std::error::Error + 'static)) -> bool {
    in_chain(error, |e| {
        matches!(
            e.downcast_ref::<StoreError>(),
            Some(StoreError::Late { .. })
        ) || e
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

/// Whether an error says a drive's node refused or closed the connection
/// (stopped, restarting, crashed): its drives are out of use until it
/// answers, which is no drive fault.
pub(crate) fn away(error: &(dyn std::error::Error + 'static)) -> bool {
    let not_connected = |io: &std::io::Error| io.kind() == std::io::ErrorKind::NotConnected;
    in_chain(error, |e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(not_connected)
            || matches!(e.downcast_ref::<StoreError>(), Some(StoreError::Io(io)) if not_connected(io))
    })
}

/// Logs a drive operation that failed: a warning when the drive's node is
/// away (expected while it restarts), an error otherwise.
pub(crate) fn log_drive_failure(
    drive: &str,
    what: &str,
    error: &(dyn std::error::Error + 'static),
) {
    if away(error) {
        tracing::warn!(%drive, %error, "{what}: the drive's node does not answer");
    } else {
        tracing::error!(%drive, %error, "{what}");
    }
}

/// Whether an error says a drive's metadata index is damaged.
fn index_corrupt(error: &(dyn std::error::Error + 'static)) -> bool {
    in_chain(error, |e| {
        matches!(
            e.downcast_ref::<StoreError>(),
            Some(StoreError::IndexCorrupt { .. })
        )
    })
}

/// Whether `test` holds for an error or any error in its source chain,
/// including the payload of an `io::Error` (whose `source` skips it).
fn in_chain(
    error: &(dyn std::error::Error + 'static),
    test: impl Fn(&(dyn std::error::Error + 'static)) -> bool,
) -> bool {
    let mut e = Some(error);
    while let Some(err) = e {
        if test(err) {
            return true;
        }
        if let Some(inner) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if test(inner) {
                return true;
            }
        }
        e = err.source();
    }
    false
}

/// Opens a drive's metadata index; a damaged one (or any when `set_aside`)
/// is set aside and a fresh one opened in its place, to be rebuilt by heal
/// (true in the second place). A drive `alone` in its set has nothing to be
/// healed from: what can still be read of its damaged index is salvaged.
fn open_index(
    root: &std::path::Path,
    set_aside: bool,
    alone: bool,
) -> Result<(DriveDb, bool), String> {
    // A salvage that did not finish (the process stopped in it) starts over.
    let unfinished_salvage =
        alone && drive::rebuild_pending(root) && root.join(drive::CORRUPT_INDEX_DIR).is_dir();
    if unfinished_salvage {
        std::fs::remove_dir_all(root.join(".tarn/meta"))
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::NotFound => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| format!("remove a half-salvaged index: {e}"))?;
    } else if !set_aside {
        match DriveDb::open(root) {
            Ok(db) => return Ok((db, false)),
            Err(StoreError::IndexCorrupt { reason, .. }) => {
                tracing::error!(drive = %root.display(), %reason,
                    "metadata index corrupt: set aside (.tarn/meta.corrupt); a fresh one is rebuilt by heal");
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    if !unfinished_salvage {
        drive::set_aside_index(root).map_err(|e| e.to_string())?;
    }
    let db = DriveDb::open(root).map_err(|e| e.to_string())?;
    if alone {
        match db.salvage(root) {
            Ok((entries, None)) => {
                tracing::warn!(drive = %root.display(), entries, "salvaged the damaged index (it opened whole; entries past a damaged block are lost)")
            }
            Ok((entries, Some((journal, at)))) => {
                tracing::error!(drive = %root.display(), entries, %journal, at,
                    "salvaged the damaged index up to where its journal is damaged: writes recorded after that point are lost")
            }
            Err(reason) => {
                tracing::error!(drive = %root.display(), %reason, "nothing salvaged from the damaged index: its records are lost")
            }
        }
    }
    Ok((db, true))
}

/// How often drives taken out while running are tried again.
const DRIVE_PROBE_INTERVAL: Duration = Duration::from_secs(2);
/// How soon a heal of rebuilding drives that could not finish runs again.
const REBUILD_RETRY: Duration = Duration::from_secs(30);

/// Whether a drive's format says it is the one expected at a place:
/// same deployment, layout and position.
fn belongs_here(f: &DriveFormat, expected: &DriveFormat) -> bool {
    f.deployment_id == expected.deployment_id
        && f.set_count == expected.set_count
        && f.set_drive_count == expected.set_drive_count
        && f.set_index == expected.set_index
        && f.drive_index == expected.drive_index
}

/// Whether a drive taken out while running works again: it is where it was
/// (or an empty directory, which is formatted for its place and healed),
/// its tmp directory takes a write and an fsync, and its metadata index
/// opens (set aside first when `reindex`, or when found damaged). Also says
/// whether it came back empty, and whether its index was set aside.
/// Buckets as the drives in service hold them: the union, each present on
/// a majority of those that answered (a torn create or delete resolves
/// here), and how many answered.
fn bucket_view<'a>(
    drives: impl Iterator<Item = &'a DriveSlot>,
) -> (BTreeMap<String, BucketRecord>, usize) {
    let mut seen: BTreeMap<String, (BucketRecord, usize)> = BTreeMap::new();
    let mut answered = 0;
    for d in drives.filter_map(|d| d.db()) {
        let Some(local) = d.as_local() else { continue };
        if let Ok(list) = local.db.buckets() {
            answered += 1;
            for (name, rec) in list {
                let e = seen.entry(name).or_insert((rec.clone(), 0));
                if rec.versioning != Versioning::Unversioned {
                    e.0.versioning = rec.versioning;
                }
                e.1 += 1;
            }
        }
    }
    let bucket_quorum = answered / 2 + 1;
    let buckets = seen
        .into_iter()
        .filter(|(_, (_, c))| *c >= bucket_quorum || answered == 1)
        .map(|(n, (r, _))| (n, r))
        .collect();
    (buckets, answered)
}

/// A drive found with less free space than its metadata reserve (filled
/// from outside, or while this process was down) gives the reserve back
/// before its index is opened: recovering the journal and taking the
/// DELETEs that free space need room.
fn release_ballast_if_full(root: &std::path::Path) {
    let Ok((free, total)) = drive::fs_space(root) else {
        return;
    };
    if free < drive::ballast_bytes(total) && drive::release_ballast(root) {
        tracing::warn!(drive = %root.display(), free, "the drive is full: released its metadata reserve so its index opens and takes DELETEs");
    }
}

fn rejoin(
    slot_root: &std::path::Path,
    expected: &DriveFormat,
    reindex: bool,
) -> Result<(DriveDb, bool, bool), String> {
    let paths = DrivePaths {
        root: slot_root.to_path_buf(),
    };
    let wiped = match drive::probe(slot_root) {
        DriveProbe::Missing => return Err("drive directory is missing".into()),
        DriveProbe::Unusable(reason) => return Err(reason),
        DriveProbe::Empty => {
            let mut fresh = expected.clone();
            fresh.drive_id = new_id();
            drive::format_drive(slot_root, &fresh).map_err(|e| e.to_string())?;
            drive::mark_rebuilding(slot_root).map_err(|e| e.to_string())?;
            true
        }
        DriveProbe::Formatted(f) => {
            if !belongs_here(&f, expected) {
                return Err("a different drive is mounted here".into());
            }
            false
        }
    };
    release_ballast_if_full(slot_root);
    clean_tmp(&paths.tmp_dir()).map_err(|e| format!("cannot clean tmp: {e}"))?;
    // Where shards are written, too: the fault may have been there only.
    for dir in [paths.tmp_dir(), paths.data_dir()] {
        std::fs::create_dir_all(&dir).map_err(|e| format!("drive is not writable: {e}"))?;
        probe_writable(&dir).map_err(|e| format!("drive is not writable: {e}"))?;
    }
    let alone = expected.set_drive_count == 1;
    let (db, set_aside) = open_index(slot_root, reindex && !wiped, alone)?;
    Ok((db, wiped, set_aside))
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct HealTask {
    pub bucket: String,
    pub key: String,
}

/// Counters exposed as metrics by the binary.
#[derive(Default)]
pub struct StoreStats {
    /// Drive failures that were the process running out of descriptors
    /// (the drive was not taken out).
    pub fd_exhaustion: AtomicU64,
    pub heal_queued: AtomicU64,
    pub heal_dropped: AtomicU64,
    pub shards_reconstructed: AtomicU64,
    pub shards_rebuilt: AtomicU64,
    /// Shard reads given up because they were late (read from others).
    pub hedged_reads: AtomicU64,
    /// Object writes that missed a drive of their set (recorded in the
    /// missed-write log), and keys replayed from the log to a drive back.
    pub missed_writes: AtomicU64,
    pub missed_replayed: AtomicU64,
    /// Drives taken out while running after an I/O error, and brought back.
    pub drive_faults: AtomicU64,
    pub drive_rejoins: AtomicU64,
    /// Metadata reserves given back to a full filesystem.
    pub reserves_released: AtomicU64,
    /// GET stripes that waited for room in the read-ahead budget.
    pub read_ahead_waits: AtomicU64,
    /// Drive indexes found damaged (set aside), and rebuilds heal completed.
    pub index_corruptions: AtomicU64,
    pub index_rebuilds: AtomicU64,
    /// Objects a backfill visited (filled or verified), and their bytes.
    pub backfill_objects: AtomicU64,
    pub backfill_bytes: AtomicU64,
    /// Group commits of new versions (`commit`): rounds, each one durable
    /// write of a key's record, and the versions they committed.
    pub commit_rounds: AtomicU64,
    pub commit_versions: AtomicU64,
}

/// Data ids whose shards are being written and not yet committed (or cleaned
/// up): the orphan sweep must never remove them, however old their files.
pub(crate) type InflightSet = Arc<Mutex<std::collections::HashSet<Id128>>>;

/// Registration of one in-flight data id; removed when dropped.
pub(crate) struct InflightData {
    set: InflightSet,
    id: Id128,
}

impl Drop for InflightData {
    fn drop(&mut self) {
        self.set.lock().expect("inflight lock").remove(&self.id);
    }
}

/// Readers of each data id, and where to delete it once the last one is gone.
#[derive(Default)]
pub(crate) struct PinState {
    readers: usize,
    /// Set when a writer retired this data while it was being read.
    retired_in_set: Option<usize>,
}

/// A reader's hold on the data ids of the version it streams: in this
/// process, and, in a cluster, on the drives of other nodes.
pub(crate) struct PinGuard {
    store: Option<Arc<Store>>,
    set: usize,
    pub(crate) ids: Vec<Id128>,
    pub(crate) lease: Option<locking::Lease>,
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else {
            return;
        };
        let mut retired = Vec::new();
        {
            let mut pins = store.pins.lock().expect("pins lock");
            for id in &self.ids {
                if let Some(p) = pins.get_mut(id) {
                    p.readers -= 1;
                    if p.readers == 0 {
                        if p.retired_in_set.is_some() {
                            retired.push(*id);
                        }
                        pins.remove(id);
                    }
                }
            }
        }
        if retired.is_empty() {
            return;
        }
        // Without a runtime the files stay as orphans for the sweep.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let set = self.set;
            rt.spawn(async move { store.remove_data(set, retired).await });
        }
    }
}

pub struct Store {
    pins: Mutex<std::collections::HashMap<Id128, PinState>>,
    inflight_data: InflightSet,
    cfg: StoreConfig,
    deployment_id: Id128,
    hash_seed: u64,
    /// The drives, sets and pools served now (`Topology`).
    topo: RwLock<Arc<Topology>>,
    /// Where a cluster keeps bucket records and system documents (etcd);
    /// None on a single node (the drives keep them).
    catalog: Option<Arc<dyn Catalog>>,
    buckets: RwLock<BTreeMap<String, BucketRecord>>,
    /// One node: the bucket list was read from fewer than a majority of the
    /// drives (most were offline or full at start), so a bucket missing
    /// from it may exist: such a lookup is answered 503, never
    /// NoSuchBucket, and the list is read again as drives come back.
    buckets_partial: AtomicBool,
    /// Every GET's read-ahead, in pieces (`cfg.read_ahead_max_bytes`).
    pub(crate) read_ahead: Arc<tokio::sync::Semaphore>,
    locks: LockTable,
    /// New versions waiting for their key's group commit (`commit`).
    commits: commit::CommitQueues,
    /// Other nodes reach drives of this engine's sets (or this node reaches
    /// theirs): keys are locked on the drives too (`locking`).
    distributed: bool,
    /// The first 8 bytes of every lock owner of this start of this node
    /// (`lock_owner`).
    lock_holder: Id128,
    /// Drive slots of other nodes told to end this node's earlier
    /// incarnations' holdings (`tell_restart`).
    holder_told: Mutex<std::collections::HashSet<usize>>,
    pool: BufferPool,
    /// Buffers of GET read-ahead pieces (`get::PIECE_BYTES`), reused and,
    /// once idle, given back to the kernel (`trim_buffers`).
    pub(crate) pieces: BufferPool,
    heal_tx: mpsc::Sender<HealTask>,
    heal_rx: Mutex<Option<mpsc::Receiver<HealTask>>>,
    /// Names each drive rebuild (SlotState::rebuilding).
    rebuild_seq: AtomicU64,
    /// A heal run for rebuilding drives: whether one runs, when one ended.
    rebuild_heal: Mutex<(bool, Option<std::time::Instant>)>,
    /// Drives of this node a replay of the missed-write log runs for.
    replaying: Mutex<std::collections::HashSet<usize>>,
    /// The backfill running on this node (`backfill`).
    backfill: Mutex<Option<BackfillStatus>>,
    last_mod_time_ns: AtomicU64,
    /// When this node's drives' tombstones were last swept.
    tombstones_swept: Mutex<Option<std::time::Instant>>,
    pub stats: StoreStats,
}

/// How often each drive's tombstones past `drive::TOMBSTONE_TTL_NS` are
/// swept.
const TOMBSTONE_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// A lock may be put only on versions of a bucket with object lock.
pub(crate) fn check_lock_allowed(
    brec: &BucketRecord,
    lock: &Option<crate::format::ObjectLock>,
) -> Result<(), StoreError> {
    if lock.is_some_and(|l| !l.is_empty()) && !brec.object_lock {
        return Err(StoreError::InvalidRequest(
            "Bucket is missing Object Lock Configuration".into(),
        ));
    }
    Ok(())
}

pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

pub fn version_to_string(id: &Id128) -> Option<String> {
    if *id == NULL_VERSION {
        None
    } else {
        Some(id_to_hex(id))
    }
}

/// Parses a version id from a request: "null" or 32 hex digits. All-zero hex is
/// refused: only the word "null" names the null version.
pub fn parse_version(s: &str) -> Option<Id128> {
    if s == "null" {
        Some(NULL_VERSION)
    } else {
        id_from_hex(s).filter(|id| *id != NULL_VERSION)
    }
}

/// The bucket Tarn keeps its own records in (users and their keys, bucket
/// configuration): erasure-coded, quorum-written and healed like any other,
/// left out of bucket listings, and out of reach of S3 requests (its name is
/// not a valid S3 bucket name, which every S3 request is checked for).
pub const SYSTEM_BUCKET: &str = ".tarn";

pub fn validate_bucket_name(name: &str) -> Result<(), StoreError> {
    let ok = (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
        && !name.contains("..")
        && !name.contains(".-")
        && !name.contains("-.")
        && !(name.split('.').count() == 4 && name.split('.').all(|p| p.parse::<u8>().is_ok()));
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidBucketName(name.to_string()))
    }
}

pub fn validate_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() || key.len() > KEY_MAX_BYTES {
        return Err(StoreError::InvalidKey(key.chars().take(64).collect()));
    }
    Ok(())
}

/// A drive slot of this node from the verdict on its directory: its tmp
/// directory cleaned and written to, its index opened (set aside and
/// rebuilt when damaged), and whether it starts rebuilding. Counts
/// rebuilds and indexes set aside in `counts`.
#[allow(clippy::too_many_arguments)]
fn open_slot(
    lock: Option<drive::DriveLock>,
    paths: DrivePaths,
    set_index: usize,
    want: DriveFormat,
    verdict: Result<(), String>,
    set_size: usize,
    joined_empty: bool,
    sync_first: bool,
    counts: (&mut u64, &mut u64),
) -> DriveSlot {
    let (rebuilds, set_aside_at_start) = counts;
    let path = paths.root.clone();
    let opened = verdict.and_then(|_| {
        release_ballast_if_full(&path);
        clean_tmp(&paths.tmp_dir()).map_err(|e| format!("cannot clean tmp: {e}"))?;
        probe_writable(&paths.tmp_dir()).map_err(|e| format!("drive is not writable: {e}"))?;
        let opened = open_index(&path, false, set_size == 1)?;
        if let Err(error) = drive::ensure_ballast(&path) {
            tracing::warn!(drive = %path.display(), %error, "cannot make the drive's metadata reserve");
        }
        Ok(opened)
    });
    if matches!(&opened, Ok((_, true))) {
        *set_aside_at_start += 1;
    }
    // Joined empty, index set aside, or a rebuild left unfinished: a full
    // heal fills it.
    let full = matches!(&opened, Ok((_, set_aside)) if *set_aside || joined_empty || drive::rebuild_pending(&path));
    let rebuilding = match &opened {
        // Alone in its set: the salvage of its index was its rebuild.
        Ok(_) if set_size == 1 => {
            if let Err(error) = drive::clear_rebuilding(&path) {
                tracing::warn!(drive = %path.display(), %error, "cannot remove the rebuild marker");
            }
            None
        }
        // A cluster node's drive may have missed writes while the node was
        // down: it syncs (the missed-write log) before it serves reads.
        Ok(_) if full || sync_first => {
            *rebuilds += 1;
            Some(*rebuilds)
        }
        _ => None,
    };
    if let Err(reason) = &opened {
        tracing::error!(drive = %path.display(), %reason, "drive offline");
    }
    let opened = opened.map(|(db, _)| db);
    DriveSlot::new(lock, paths, set_index, want, opened, rebuilding, full)
}

/// Whether an erasure layout of `data`+`parity` fits sets of `set_size`
/// drives (`check_erasure`), and the stripe size is one the engine takes.
fn check_geometry(
    cfg: &StoreConfig,
    data: usize,
    parity: usize,
    set_size: usize,
) -> Result<(), StoreError> {
    check_erasure(data, parity, set_size)?;
    if cfg.stripe_size_bytes < 4096
        || !cfg.stripe_size_bytes.is_multiple_of(4096)
        || cfg.stripe_size_bytes > crate::format::STRIPE_SIZE_MAX_BYTES as usize
    {
        return Err(StoreError::Config(
            "stripe size must be a multiple of 4 KiB between 4 KiB and 64 MiB".into(),
        ));
    }
    Ok(())
}

/// Whether the engine can code `data`+`parity` over sets of `set_size`
/// drives (a cluster checks this before it writes a map).
pub fn check_erasure(data: usize, parity: usize, set_size: usize) -> Result<(), StoreError> {
    if data == 0 || data + parity > set_size || data + parity > 255 {
        return Err(StoreError::Config(format!(
            "erasure layout {data}+{parity} does not fit sets of {set_size} drives"
        )));
    }
    if parity > 0 && data > 1 && !reed_solomon_simd::ReedSolomonEncoder::supports(data, parity) {
        return Err(StoreError::Config(format!(
            "erasure layout {data}+{parity} is not supported by the codec"
        )));
    }
    Ok(())
}

/// A drive of this node as it serves it to the others: (for metadata reads,
/// for writes and shard files), each None while the drive is not fit for it.
pub type ServedDrive = (Option<Arc<dyn Drive>>, Option<Arc<dyn Drive>>);

/// A cluster node's engine: the sets of the cluster map, in shard position
/// order, each drive this node's own or another node's (`Store::open_cluster`).
pub struct ClusterLayout {
    /// The cluster's deployment id (its map's): this node's drives are
    /// formatted with it.
    pub deployment_id: Id128,
    pub pools: Vec<PoolLayout>,
    /// Bucket records as the catalog has them (read with the map), and the
    /// catalog that keeps them and the system documents.
    pub buckets: BTreeMap<String, BucketRecord>,
    pub catalog: Arc<dyn Catalog>,
    /// This node's id: its lock owners name it (`Store::lock_owner`).
    pub node_id: String,
}

/// One pool of a cluster map as the engine serves it.
pub struct PoolLayout {
    pub id: u32,
    pub data_shards: usize,
    pub parity_shards: usize,
    /// Serves its objects, takes no new ones.
    pub draining: bool,
    /// Drained: holds nothing, serves nothing.
    pub retired: bool,
    pub sets: Vec<Vec<ClusterDrive>>,
}

pub enum ClusterDrive {
    /// A drive of this node and the id it registered with. `joins`: the
    /// map gave it a place in a set that holds data (it replaced a drive):
    /// if it was never placed before, a full backfill fills it before it
    /// serves reads.
    Local {
        path: PathBuf,
        drive_id: Id128,
        joins: bool,
    },
    /// A drive of another node. `joins` as above: this node reads no
    /// metadata from it until its node serves it in full.
    Remote {
        drive: Arc<dyn Drive>,
        drive_id: Id128,
        joins: bool,
    },
}

/// A pool's drive slots, its sets (as slot indexes) and what it is.
pub(crate) type PoolSlots = (Vec<DriveSlot>, Vec<Vec<usize>>, PoolTopo);

/// The slots of one pool of a cluster map, its sets numbered from global set
/// `first.0` and its slots from `first.1`. A drive's format names its place
/// within its pool (set index and count of the pool), so that adding a pool
/// leaves the drives of the others as they are.
pub(crate) fn pool_slots(
    cfg: &StoreConfig,
    deployment_id: Id128,
    pool: PoolLayout,
    first: (usize, usize),
    counts: (&mut u64, &mut u64),
) -> Result<PoolSlots, StoreError> {
    let (data, parity) = (pool.data_shards, pool.parity_shards);
    let set_count = pool.sets.len();
    let set_size = pool.sets.first().map_or(0, Vec::len);
    if set_count == 0 || pool.sets.iter().any(|s| s.len() != set_size) {
        return Err(StoreError::Config(format!(
            "pool {} of the cluster map has no sets, or sets of different sizes",
            pool.id
        )));
    }
    check_geometry(cfg, data, parity, set_size)?;
    let (rebuilds, set_aside) = counts;
    let mut slots = Vec::with_capacity(set_count * set_size);
    let mut members = Vec::with_capacity(set_count);
    for (set_index, set) in pool.sets.into_iter().enumerate() {
        let mut m = Vec::with_capacity(set_size);
        for (drive_index, place) in set.into_iter().enumerate() {
            let want = DriveFormat {
                deployment_id,
                drive_id: [0u8; 16],
                set_count: set_count as u32,
                set_drive_count: set_size as u32,
                set_index: set_index as u32,
                drive_index: drive_index as u32,
            };
            m.push(first.1 + slots.len());
            slots.push(cluster_slot(
                place,
                want,
                first.0 + set_index,
                (&mut *rebuilds, &mut *set_aside),
            )?);
        }
        members.push(m);
    }
    let topo = PoolTopo {
        id: pool.id,
        sets: first.0..first.0 + set_count,
        data_shards: data,
        parity_shards: parity,
        draining: pool.draining,
        retired: pool.retired,
    };
    Ok((slots, members, topo))
}

/// The slot of one place of a cluster map: a drive of another node, or one
/// of this node's, checked against its format and formatted if the map
/// places it for the first time (`open_cluster`, `change_drives`).
fn cluster_slot(
    place: ClusterDrive,
    mut want: DriveFormat,
    set_index: usize,
    counts: (&mut u64, &mut u64),
) -> Result<DriveSlot, StoreError> {
    let drive_index = want.drive_index as usize;
    let set_size = want.set_drive_count as usize;
    let (path, drive_id, joins) = match place {
        ClusterDrive::Remote {
            drive,
            drive_id,
            joins,
        } => {
            want.drive_id = drive_id;
            let slot = DriveSlot::remote(drive, set_index, want);
            if joins {
                // Syncing in this node's view: promoted once its node
                // serves it (its backfill done) and no log names its place.
                let mut st = slot.state.write().expect("drive state");
                *counts.0 += 1;
                st.rebuilding = Some(*counts.0);
            }
            return Ok(slot);
        }
        ClusterDrive::Local {
            path,
            drive_id,
            joins,
        } => (path, drive_id, joins),
    };
    want.drive_id = drive_id;
    let lock = drive::lock(&path)?;
    let mut joined_empty = false;
    let verdict: Result<(), String> = match drive::probe(&path) {
        DriveProbe::Missing => Err("drive directory is missing; not re-creating it (mount the drive or replace it with an empty directory)".into()),
        DriveProbe::Unusable(reason) => Err(reason),
        DriveProbe::Empty => {
            // Wiped since it registered: it joins and is healed.
            tracing::warn!(drive = %path.display(), "empty drive joins the cluster; it will be healed");
            joined_empty = true;
            drive::format_drive(&path, &want)
                .and_then(|_| drive::mark_rebuilding(&path))
                .map_err(|e| e.to_string())
        }
        DriveProbe::Formatted(f) if f.drive_id != drive_id => Err(format!(
            "drive {} was expected here, drive {} is mounted",
            id_to_hex(&drive_id),
            id_to_hex(&f.drive_id)
        )),
        DriveProbe::Formatted(f) if is_unplaced(&f) => {
            // Placed for the first time: into a new set (nothing to fill
            // it with), or into another drive's place (a full backfill;
            // the marker first, so that a crash still backfills).
            joined_empty = joins;
            if joins {
                tracing::warn!(drive = %path.display(), set = set_index, position = drive_index, "drive takes a replaced drive's place; a full backfill fills it");
            }
            (if joins { drive::mark_rebuilding(&path) } else { Ok(()) })
                .and_then(|_| drive::format_drive(&path, &want))
                .map_err(|e| e.to_string())
        }
        DriveProbe::Formatted(f) if f.deployment_id != want.deployment_id => {
            Err("drive belongs to another deployment".into())
        }
        DriveProbe::Formatted(f) if belongs_here(&f, &want) => Ok(()),
        DriveProbe::Formatted(f) => Err(format!(
            "drive was formatted for set {} position {} of {} sets of {}; the cluster map places it at set {} position {drive_index} of {} sets of {set_size}",
            f.set_index, f.drive_index, f.set_count, f.set_drive_count, want.set_index, want.set_count
        )),
    };
    let lock = match (lock, &verdict) {
        // Formatted just now: locked now.
        (None, Ok(())) => drive::lock(&path)?,
        (lock, _) => lock,
    };
    Ok(open_slot(
        lock,
        DrivePaths { root: path },
        set_index,
        want,
        verdict,
        set_size,
        joined_empty,
        true,
        counts,
    ))
}

/// The format a drive of this node had before the cluster map placed it: a
/// drive id registered with the cluster, no deployment, no place yet.
pub fn is_unplaced(f: &DriveFormat) -> bool {
    f.deployment_id == [0u8; 16] && f.set_count == 0
}

/// Formats an empty (or missing) drive directory for a cluster node before
/// the cluster map places it, or reads the id of one formatted before: the
/// drive id the node registers. A drive of another deployment (a single
/// node's, another cluster's) is refused when the engine opens
/// (`open_cluster`), where the cluster's deployment id is known.
/// The id of a drive directory's format; None for an empty (or missing)
/// directory, which has none yet.
pub fn formatted_drive_id(path: &std::path::Path) -> Result<Option<Id128>, StoreError> {
    match drive::probe(path) {
        DriveProbe::Formatted(f) => Ok(Some(f.drive_id)),
        DriveProbe::Missing | DriveProbe::Empty => Ok(None),
        DriveProbe::Unusable(reason) => Err(StoreError::Config(format!(
            "drive {}: {reason}",
            path.display()
        ))),
    }
}

/// Claims an empty drive directory as drive `id`, one the cluster map
/// places on this node and no drive holds any more (a disk emptied or
/// swapped): the rebuild marker first, then an unplaced format with that
/// id, so that the drive takes its place and is backfilled in full, even
/// after a crash in between (a directory holding only the marker is still
/// empty, and is claimed the same way again).
pub fn claim_drive_in_place_of(path: &std::path::Path, id: Id128) -> Result<(), StoreError> {
    let config = |m: String| StoreError::Config(format!("drive {}: {m}", path.display()));
    std::fs::create_dir_all(path.join(".tarn"))
        .map_err(|e| config(format!("cannot create the directory: {e}")))?;
    drive::mark_rebuilding(path)?;
    let f = DriveFormat {
        deployment_id: [0u8; 16],
        drive_id: id,
        set_count: 0,
        set_drive_count: 0,
        set_index: 0,
        drive_index: 0,
    };
    drive::format_drive(path, &f)
}

pub fn claim_drive(path: &std::path::Path) -> Result<Id128, StoreError> {
    let config = |m: String| StoreError::Config(format!("drive {}: {m}", path.display()));
    match drive::probe(path) {
        DriveProbe::Formatted(f) => Ok(f.drive_id),
        DriveProbe::Unusable(reason) => Err(config(reason)),
        DriveProbe::Missing | DriveProbe::Empty => {
            std::fs::create_dir_all(path)
                .map_err(|e| config(format!("cannot create the directory: {e}")))?;
            let f = DriveFormat {
                deployment_id: [0u8; 16],
                drive_id: new_id(),
                set_count: 0,
                set_drive_count: 0,
                set_index: 0,
                drive_index: 0,
            };
            drive::format_drive(path, &f)?;
            Ok(f.drive_id)
        }
    }
}

impl Store {
    /// Opens (or creates, on first start) the engine over the configured drives.
    /// Blocking: call before the runtimes start or from a blocking thread.
    pub fn open(cfg: StoreConfig) -> Result<Arc<Store>, StoreError> {
        let n = cfg.drives.len();
        if n == 0 {
            return Err(StoreError::Config("no drives configured".into()));
        }
        let set_size = cfg
            .set_drive_count
            .unwrap_or_else(|| default_set_drive_count(n));
        if set_size == 0 || !n.is_multiple_of(set_size) {
            return Err(StoreError::Config(format!(
                "{n} drives cannot be split into erasure sets of {set_size}"
            )));
        }
        let parity = cfg
            .parity_shards
            .unwrap_or_else(|| default_parity_shards(set_size));
        let data = cfg.data_shards.unwrap_or(set_size.saturating_sub(parity));
        check_geometry(&cfg, data, parity, set_size)?;
        let set_count = n / set_size;

        // One process per drive: every drive's lock first, before anything is
        // read or written (another server's fjall lock would otherwise take the
        // drive offline here while this server went on serving).
        let mut locks = cfg
            .drives
            .iter()
            .map(|p| drive::lock(p))
            .collect::<Result<Vec<_>, _>>()?;
        // Probe every drive before touching any.
        let probes: Vec<DriveProbe> = cfg.drives.iter().map(|p| drive::probe(p)).collect();
        let formats: Vec<&DriveFormat> = probes
            .iter()
            .filter_map(|p| {
                if let DriveProbe::Formatted(f) = p {
                    Some(f)
                } else {
                    None
                }
            })
            .collect();
        let fresh_deployment = formats.is_empty();
        let deployment_id = if fresh_deployment {
            new_id()
        } else {
            // The deployment most drives agree on.
            let mut counts: BTreeMap<Id128, usize> = BTreeMap::new();
            for f in &formats {
                *counts.entry(f.deployment_id).or_default() += 1;
            }
            counts
                .into_iter()
                .max_by_key(|(_, c)| *c)
                .map(|(id, _)| id)
                .expect("non-empty")
        };

        let mut drives = Vec::with_capacity(n);
        // Drives formatted just now (into a deployment that has data) and
        // drives whose index was set aside know nothing yet: they rebuild,
        // and neither vote on buckets nor answer reads until healed.
        let mut rebuilds = 0u64;
        let mut set_aside_at_start = 0u64;
        for (i, (path, probe)) in cfg.drives.iter().zip(probes).enumerate() {
            let set_index = i / set_size;
            let want = DriveFormat {
                deployment_id,
                drive_id: new_id(),
                set_count: set_count as u32,
                set_drive_count: set_size as u32,
                set_index: set_index as u32,
                drive_index: (i % set_size) as u32,
            };
            let paths = DrivePaths { root: path.clone() };
            let mut joined_empty = false;
            let verdict: Result<(), String> = match probe {
                DriveProbe::Missing if fresh_deployment => std::fs::create_dir_all(path)
                    .map_err(|e| format!("cannot create drive directory: {e}"))
                    .and_then(|_| {
                        // Created just now: locked before it is formatted.
                        locks[i] = drive::lock(path).map_err(|e| e.to_string())?;
                        drive::format_drive(path, &want).map_err(|e| e.to_string())
                    }),
                DriveProbe::Missing => Err("drive directory is missing; not re-creating it (mount the drive or replace it with an empty directory)".into()),
                DriveProbe::Unusable(reason) => Err(reason),
                DriveProbe::Empty => {
                    joined_empty = !fresh_deployment;
                    if !fresh_deployment {
                        tracing::warn!(drive = %path.display(), "empty drive joins the deployment; it will be healed");
                    }
                    drive::format_drive(path, &want)
                        .and_then(|_| {
                            if joined_empty {
                                drive::mark_rebuilding(path)?;
                            }
                            Ok(())
                        })
                        .map_err(|e| e.to_string())
                }
                DriveProbe::Formatted(f) => {
                    if f.deployment_id != deployment_id {
                        Err("drive belongs to another deployment".into())
                    } else if f.set_count as usize != set_count || f.set_drive_count as usize != set_size {
                        Err(format!(
                            "drive was formatted for {} sets of {} drives, configuration now has {set_count} sets of {set_size}",
                            f.set_count, f.set_drive_count
                        ))
                    } else if f.set_index as usize != set_index || f.drive_index as usize != i % set_size {
                        Err(format!(
                            "drive is configured at position {i} but was formatted for set {} position {}; keep the drive order",
                            f.set_index, f.drive_index
                        ))
                    } else {
                        Ok(())
                    }
                }
            };
            drives.push(open_slot(
                locks[i].take(),
                paths,
                set_index,
                want,
                verdict,
                set_size,
                joined_empty,
                false,
                (&mut rebuilds, &mut set_aside_at_start),
            ));
        }
        let (buckets, answered) = bucket_view(drives.iter());
        let partial = answered < n / 2 + 1;
        if partial {
            tracing::warn!(
                answered,
                drives = n,
                "buckets read from too few drives: a bucket not found is answered 503 until more drives are back"
            );
        }

        // Consecutive slots form a set, in shard position order; one pool.
        let sets: Vec<Vec<usize>> = (0..drives.len() / set_size)
            .map(|s| (s * set_size..(s + 1) * set_size).collect())
            .collect();
        let pool = PoolTopo {
            id: 0,
            sets: 0..sets.len(),
            data_shards: data,
            parity_shards: parity,
            draining: false,
            retired: false,
        };
        let store = Store::assemble(
            cfg,
            deployment_id,
            drives,
            (sets, vec![pool]),
            buckets,
            (rebuilds, set_aside_at_start),
            None,
            "",
        );
        store.buckets_partial.store(partial, Ordering::Release);
        Ok(store)
    }

    /// Opens the engine of a cluster node over the sets of the cluster map:
    /// this node's drives formatted for their place in it (a drive claimed
    /// before the map placed it takes its place now; an empty one joins and
    /// is healed), the other nodes' drives reached through `Drive`. Bucket
    /// records and system documents are the catalog's. Blocking, like
    /// `open`.
    pub fn open_cluster(cfg: StoreConfig, layout: ClusterLayout) -> Result<Arc<Store>, StoreError> {
        if layout.pools.is_empty() {
            return Err(StoreError::Config("the cluster map has no pool".into()));
        }
        let deployment_id = layout.deployment_id;
        let mut counts = (0u64, 0u64);
        let (mut drives, mut sets, mut pools) = (Vec::new(), Vec::new(), Vec::new());
        for pool in layout.pools {
            let (slots, members, topo) = pool_slots(
                &cfg,
                deployment_id,
                pool,
                (sets.len(), drives.len()),
                (&mut counts.0, &mut counts.1),
            )?;
            drives.extend(slots);
            sets.extend(members);
            pools.push(topo);
        }
        Ok(Store::assemble(
            cfg,
            deployment_id,
            drives,
            (sets, pools),
            layout.buckets,
            counts,
            Some(layout.catalog),
            &layout.node_id,
        ))
    }

    /// The engine over opened drive slots (`open`, `open_cluster`).
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        cfg: StoreConfig,
        deployment_id: Id128,
        drives: Vec<DriveSlot>,
        (sets, pools): (Vec<Vec<usize>>, Vec<PoolTopo>),
        buckets: BTreeMap<String, BucketRecord>,
        (rebuilds, set_aside_at_start): (u64, u64),
        catalog: Option<Arc<dyn Catalog>>,
        node_id: &str,
    ) -> Arc<Store> {
        for (s, members) in sets.iter().enumerate() {
            let online = members.iter().filter(|&&d| drives[d].online()).count();
            if online < members.len() / 2 + 1 {
                tracing::error!(
                    set = s,
                    online,
                    needed = members.len() / 2 + 1,
                    "erasure set has lost write quorum"
                );
            } else if online < members.len() {
                tracing::warn!(
                    set = s,
                    online,
                    total = members.len(),
                    "erasure set is degraded"
                );
            }
        }

        let hash_seed = u64::from_le_bytes(deployment_id[..8].try_into().expect("8 bytes"));
        let (heal_tx, heal_rx) = mpsc::channel(HEAL_QUEUE_MAX);
        let pool = BufferPool::new(
            cfg.core_count.max(1),
            cfg.stripe_size_bytes,
            cfg.buffers_per_core.max(8),
        );
        let distributed = drives.iter().any(|d| d.is_remote());
        // Lock owners: this node (4 bytes of its id's hash), this start of
        // it (4 random bytes), then 8 random bytes per owner.
        let mut lock_holder = new_id();
        lock_holder[..4]
            .copy_from_slice(&xxhash_rust::xxh3::xxh3_64(node_id.as_bytes()).to_le_bytes()[..4]);
        lock_holder[8..].fill(0);
        if distributed {
            // Drives name the owner of a lock that lapsed; this says whose.
            tracing::info!(
                node = %node_id,
                prefix = %id_to_hex(&lock_holder)[..16],
                "this start's lock owners"
            );
        }
        Arc::new(Store {
            deployment_id,
            hash_seed,
            distributed,
            lock_holder,
            holder_told: Mutex::default(),
            topo: RwLock::new(Arc::new(Topology {
                slots: drives.into_iter().map(Arc::new).collect(),
                sets,
                pools,
            })),
            catalog,
            buckets: RwLock::new(buckets),
            buckets_partial: AtomicBool::new(false),
            read_ahead: Arc::new(tokio::sync::Semaphore::new(read_ahead_pieces(
                cfg.read_ahead_max_bytes,
            ))),
            locks: LockTable::new(hash_seed),
            commits: commit::CommitQueues::default(),
            pool,
            // The read-ahead budget bounds the pieces out in all; any one
            // core may hold all of them.
            pieces: BufferPool::new(
                cfg.core_count.max(1),
                get::PIECE_BYTES,
                read_ahead_pieces(cfg.read_ahead_max_bytes) + get::READ_AHEAD_PIECES,
            ),
            heal_tx,
            heal_rx: Mutex::new(Some(heal_rx)),
            rebuild_seq: AtomicU64::new(rebuilds),
            rebuild_heal: Mutex::new((false, None)),
            replaying: Mutex::default(),
            backfill: Mutex::default(),
            last_mod_time_ns: AtomicU64::new(0),
            tombstones_swept: Mutex::default(),
            stats: StoreStats {
                index_corruptions: AtomicU64::new(set_aside_at_start),
                ..StoreStats::default()
            },
            inflight_data: Arc::default(),
            pins: Mutex::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub fn deployment_id(&self) -> String {
        id_to_hex(&self.deployment_id)
    }

    /// "k+m" of the first pool's erasure layout.
    pub fn erasure_layout(&self) -> (usize, usize) {
        let t = self.topo();
        (t.pools[0].data_shards, t.pools[0].parity_shards)
    }

    pub fn drive_status(&self) -> Vec<DriveStatus> {
        self.topo()
            .slots
            .iter()
            .enumerate()
            .map(|(i, d)| DriveStatus {
                path: d.name.clone(),
                set_index: d.set_index,
                online: d.online(),
                faulty: d.faulty(),
                rebuilding: d.online() && d.rebuilding_full().is_some(),
                syncing: d.syncing().is_some(),
                space: d.space(),
                full: d.online()
                    && !d.has_room(
                        self.cfg.stripe_size_bytes as u64,
                        self.cfg.drive_reserve_bytes,
                    ),
                reason: d.reason().or_else(|| {
                    if d.syncing().is_some() {
                        return Some("syncing: takes writes; serves reads once the writes it missed are replayed".into());
                    }
                    d.rebuilding()?;
                    let (sources, needed) = self.heal_sources(i);
                    Some(if sources < needed {
                        format!("rebuilding its index: waits for {needed} other drives of its set to heal from, {sources} readable")
                    } else {
                        "rebuilding its index: being healed from the other drives of its set".into()
                    })
                }),
            })
            .collect()
    }

    /// True when every erasure set can take writes and answer reads.
    pub fn is_ready(&self) -> bool {
        let topo = self.topo();
        self.live_sets().into_iter().all(|s| {
            let m = &topo.sets[s];
            self.online_count(m) >= self.meta_write_quorum(m.len())
                && self.readable_count(m) >= self.meta_read_quorum(m.len())
        })
    }

    fn online_count(&self, members: &[usize]) -> usize {
        members.iter().filter(|&&d| self.drive(d).online()).count()
    }

    fn readable_count(&self, members: &[usize]) -> usize {
        members
            .iter()
            .filter(|&&d| self.drive(d).readable())
            .count()
    }

    pub(crate) fn meta_write_quorum(&self, set_size: usize) -> usize {
        set_size / 2 + 1
    }

    pub(crate) fn meta_read_quorum(&self, set_size: usize) -> usize {
        set_size - self.meta_write_quorum(set_size) + 1
    }

    /// Shards that must be durably written for a write to succeed.
    pub(crate) fn data_write_quorum(layout: &Layout) -> usize {
        let k = layout.data_shards as usize;
        let m = layout.parity_shards as usize;
        if m == 0 {
            k
        } else {
            (k + usize::from(k <= m)).min(k + m)
        }
    }

    /// A strictly increasing modification time, so that two writes of one key
    /// in the same nanosecond still order.
    pub(crate) fn next_mod_time(&self, after: u64) -> u64 {
        let mut t = now_ns().max(after + 1);
        loop {
            let prev = self.last_mod_time_ns.load(Ordering::Relaxed);
            if t <= prev {
                t = prev + 1;
            }
            if self
                .last_mod_time_ns
                .compare_exchange(prev, t, Ordering::SeqCst, Ordering::Relaxed)
                .is_ok()
            {
                return t;
            }
        }
    }

    /// The set and layout a new version of bucket/key gets under the
    /// bucket's durability: where the key lives, or for a new key an active
    /// pool by free space (`write_set`), coded as that pool's sets are.
    pub(crate) async fn layout_for(
        &self,
        bucket: &BucketRecord,
        bucket_name: &str,
        key: &str,
    ) -> Result<(usize, Layout), StoreError> {
        let set = self.write_set(bucket_name, key).await?;
        let n = self.set_size(set);
        let (k, m) = match bucket.durability {
            Durability::ErasureCoded => {
                let t = self.topo();
                let p = t.pool_of(set);
                (p.data_shards, p.parity_shards)
            }
            Durability::Replicated(r) => (1, (r as usize).clamp(1, n) - 1),
            Durability::SingleCopy => (1, 0),
        };
        Ok((
            set,
            self.layout_of(
                set,
                (k, m),
                self.cfg.stripe_size_bytes as u32,
                bucket_name,
                key,
            ),
        ))
    }

    /// The layout of k+m shards of bucket/key in `set`: the shards rotated
    /// by a hash of the key, so that parity spreads over the set's drives.
    pub(crate) fn layout_of(
        &self,
        set: usize,
        (k, m): (usize, usize),
        stripe_size_bytes: u32,
        bucket: &str,
        key: &str,
    ) -> Layout {
        let n = self.set_size(set);
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.hash_seed ^ 0xd157);
        h.update(bucket.as_bytes());
        h.update(&[0]);
        h.update(key.as_bytes());
        let rot = (h.digest() % n as u64) as usize;
        Layout {
            data_shards: k as u8,
            parity_shards: m as u8,
            codec: if k == 1 {
                CodecId::Replicate
            } else {
                CodecId::ReedSolomonSimd
            },
            stripe_size_bytes,
            distribution: (0..k + m).map(|i| ((rot + i) % n) as u8).collect(),
        }
    }

    /// An I/O error on a drive while running: the drive is taken out (reads
    /// reconstruct from the others, writes go to the others while quorum
    /// holds) and tried again every few seconds until it works.
    pub(crate) fn drive_failed(
        &self,
        slot: &DriveSlot,
        what: &str,
        error: &(dyn std::error::Error + 'static),
    ) {
        // A full drive is not a faulty one: it keeps serving reads and
        // metadata (DELETEs free space), and takes no new data while it is
        // below its reserve.
        if no_space(error) {
            tracing::warn!(drive = %slot.name, %what, "drive full: no space left");
            slot.mark_full();
            self.release_reserve(slot);
            return;
        }
        // One late answer of another node takes nothing out: its node is
        // probed, and routed around once a probe fails too.
        if slot.is_remote() && late(error) {
            tracing::warn!(drive = %slot.name, %what, "a drive of another node answered late");
            return;
        }
        self.take_out(slot, what, error, false);
    }

    /// A write found no space left on a drive of this node: its metadata
    /// reserve goes back to the filesystem, so that its index can recover
    /// and take DELETEs (the drive rejoins at the next check).
    fn release_reserve(&self, slot: &DriveSlot) {
        if slot.is_remote() {
            return;
        }
        if drive::release_ballast(&slot.paths.root) {
            self.stats.reserves_released.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(drive = %slot.name, "no space left: released the drive's metadata reserve so that reads, DELETEs and repair go on; new data waits for room");
        }
    }

    /// A metadata index write failed on a drive. The index refuses every
    /// later write after one failure (its journal is in an unknown state),
    /// whatever the cause, no space left included: the drive is taken out
    /// and its index reopened (recovering its journal) once it works again.
    pub(crate) fn index_write_failed(
        &self,
        slot: &DriveSlot,
        what: &str,
        error: &(dyn std::error::Error + 'static),
    ) {
        if no_space(error) {
            slot.mark_full();
            self.release_reserve(slot);
        }
        if slot.is_remote() && late(error) {
            return;
        }
        self.take_out(slot, what, error, index_corrupt(error));
    }

    /// A metadata read failed on a drive: a damaged index takes the drive
    /// out and is set aside and rebuilt when it rejoins (within seconds); an
    /// I/O error takes it out until it works. A record that does not decode
    /// is left to heal.
    pub(crate) fn index_read_failed(&self, slot: &DriveSlot, error: &StoreError) {
        match error {
            StoreError::IndexCorrupt { .. } => self.take_out(slot, "metadata read", error, true),
            StoreError::Drive { .. } => self.take_out(slot, "metadata read", error, false),
            StoreError::Io(e) if e.kind() == std::io::ErrorKind::NotConnected => {
                self.take_out(slot, "metadata read", error, false)
            }
            _ => {}
        }
    }

    fn take_out(
        &self,
        slot: &DriveSlot,
        what: &str,
        error: &(dyn std::error::Error + 'static),
        reindex: bool,
    ) {
        // The process ran out of descriptors (EMFILE, ENFILE): nothing is
        // wrong with the drive, and taking every drive out for it turned a
        // flood of idle connections into 500s and 503s for everyone.
        if fds_exhausted(error) {
            self.stats.fd_exhaustion.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(drive = %slot.name, %what, %error, "out of file descriptors: the drive stays in service");
            return;
        }
        // Its node stopped or restarts: out of use until it answers again
        // (checked every drive round), not faulty.
        if slot.is_remote() && away(error) {
            Self::node_away(slot, &format!("its node does not answer ({what}: {error})"));
            return;
        }
        let mut st = slot.state.write().expect("drive state");
        if st.db.is_none() {
            return;
        }
        let reason = format!("{what}: {error}");
        if reindex {
            tracing::error!(drive = %slot.name, %reason, "metadata index corrupt: drive taken out; its index is set aside and rebuilt");
            self.stats.index_corruptions.fetch_add(1, Ordering::Relaxed);
        } else {
            tracing::error!(drive = %slot.name, %reason, "drive faulty: taken out until it works again");
        }
        st.db = None;
        st.faulty = true;
        st.reindex |= reindex;
        st.reason = Some(reason);
        self.stats.drive_faults.fetch_add(1, Ordering::Relaxed);
    }

    /// Looks at every drive: one in use whose format is gone (wiped,
    /// unmounted) or is another drive's is taken out; one taken out while
    /// running that works again rejoins (and is healed).
    async fn watch_drives(self: &Arc<Self>) {
        for slot in self.topo().slots.iter() {
            if let Some(leases) = &slot.leases {
                leases.expire().await;
            }
        }
        self.sweep_tombstones();
        self.tell_restart().await;
        // Nodes asked this round (one drive each) and what they answered:
        // None in service, Some(reason) unreachable.
        let mut asked: HashMap<String, Option<String>> = HashMap::new();
        for i in 0..self.topo().slots.len() {
            let slot = &self.drive(i);
            if let Some(remote) = &slot.remote {
                if slot.online() {
                    self.check_remote(slot, remote, &mut asked).await;
                } else {
                    self.watch_remote(slot, remote).await;
                }
                continue;
            }
            if slot.online() {
                let (root, expected) = (slot.paths.root.clone(), slot.expected.clone());
                let verdict = run_blocking(move || {
                    Ok(match drive::probe(&root) {
                        DriveProbe::Formatted(f) if belongs_here(&f, &expected) => None,
                        DriveProbe::Formatted(_) => {
                            Some("a different drive is mounted here".to_string())
                        }
                        DriveProbe::Missing => Some("the drive directory is gone".to_string()),
                        DriveProbe::Empty => Some(
                            "its contents are gone (wiped, or the mount went away)".to_string(),
                        ),
                        DriveProbe::Unusable(reason) => Some(reason),
                    })
                })
                .await;
                if let Ok(Some(reason)) = verdict {
                    self.drive_failed(slot, "drive check", &std::io::Error::other(reason));
                    continue;
                }
                // The metadata reserve, made again once there is room.
                let root = slot.paths.root.clone();
                let _ = run_blocking(move || Ok(drive::ensure_ballast(&root))).await;
                continue;
            }
            // Taken out while running, or offline since start (a drive
            // mounted or repaired later joins without a restart).
            let (root, expected) = (slot.paths.root.clone(), slot.expected.clone());
            let reindex = slot.state.read().expect("drive state").reindex;
            let unlocked = slot.lock.lock().expect("drive lock").is_none();
            let r = run_blocking(move || {
                // One process per drive, for a drive joining late too.
                let lock = if unlocked {
                    match drive::lock(&root) {
                        Ok(lock) => lock,
                        Err(e) => return Ok(Err(e.to_string())),
                    }
                } else {
                    None
                };
                Ok(rejoin(&root, &expected, reindex).map(|r| (r, lock)))
            })
            .await;
            let r = r.unwrap_or_else(|e| Err(e.to_string()));
            let mut st = slot.state.write().expect("drive state");
            match r {
                Ok(((db, wiped, set_aside), lock)) => {
                    // Found damaged only now (taken out for another fault).
                    if set_aside && !reindex {
                        self.stats.index_corruptions.fetch_add(1, Ordering::Relaxed);
                    }
                    if lock.is_some() {
                        *slot.lock.lock().expect("drive lock") = lock;
                    } else if wiped {
                        // The old lock file went with the old contents.
                        if let Ok(lock) = drive::lock(&slot.paths.root) {
                            *slot.lock.lock().expect("drive lock") = lock;
                        }
                    }
                    st.db = Some(local_drive(
                        db,
                        &slot.paths,
                        slot.leases
                            .as_ref()
                            .expect("a local drive has a lease table"),
                    ));
                    st.faulty = false;
                    st.reindex = false;
                    st.reason = None;
                    // It missed the writes made while it was out: it serves
                    // metadata reads again once the missed-write log is
                    // replayed to it, or, when it lost everything, once a
                    // full heal has filled it.
                    st.rebuilding = Some(self.rebuild_seq.fetch_add(1, Ordering::SeqCst) + 1);
                    st.full = wiped || set_aside;
                    let full = st.full;
                    drop(st);
                    self.stats.drive_rejoins.fetch_add(1, Ordering::Relaxed);
                    if full {
                        tracing::warn!(drive = %slot.name, wiped, "drive works again: back in service; healing in full");
                        self.heal_rebuilding(true);
                    } else {
                        tracing::warn!(drive = %slot.name, "drive works again: back in service; replaying the writes it missed");
                    }
                }
                Err(reason) if st.faulty => {
                    st.reason = Some(format!("faulty, still failing: {reason}"));
                }
                // Offline since start: its reason from then stands.
                Err(_) => {}
            }
        }
        self.reload_partial_buckets();
        self.heal_rebuilding(false);
        self.sync_drives().await;
    }

    /// Every `TOMBSTONE_SWEEP_EVERY`, removes from this node's drives the
    /// tombstones of keys deleted more than `TOMBSTONE_TTL_NS` ago, in the
    /// background.
    fn sweep_tombstones(self: &Arc<Self>) {
        {
            let mut last = self.tombstones_swept.lock().expect("tombstone sweep");
            if last.is_some_and(|t| t.elapsed() < TOMBSTONE_SWEEP_EVERY) {
                return;
            }
            *last = Some(std::time::Instant::now());
        }
        let before = now_ns().saturating_sub(drive::TOMBSTONE_TTL_NS);
        for slot in self.topo().slots.iter() {
            let Some(db) = slot.db().or_else(|| slot.writer()) else {
                continue;
            };
            let Some(local) = db.as_local() else { continue };
            let (db, name) = (local.db.clone(), slot.name.clone());
            tokio::spawn(async move {
                match run_blocking(move || Ok(db.sweep_tombstones(before))).await {
                    Ok(Ok(0)) => {}
                    Ok(Ok(n)) => {
                        tracing::info!(drive = %name, tombstones = n, "swept the tombstones of keys deleted over an hour ago")
                    }
                    Ok(Err(error)) => {
                        tracing::warn!(drive = %name, %error, "sweeping tombstones failed; tried again later")
                    }
                    Err(error) => {
                        tracing::warn!(drive = %name, %error, "sweeping tombstones failed; tried again later")
                    }
                }
            });
        }
    }

    /// A drive of another node in use is checked with its node (one drive
    /// per node and round): a node that stopped or went away takes its
    /// drives out of use within a round, without waiting for a request to
    /// fail on them, so drive states and `/health/ready` follow it. A late
    /// answer takes nothing out (its node is probed, and suspect if the
    /// probe fails too: the next round's call is refused at once).
    async fn check_remote(
        &self,
        slot: &DriveSlot,
        remote: &Arc<dyn Drive>,
        asked: &mut HashMap<String, Option<String>>,
    ) {
        let node = slot
            .name
            .split_once(':')
            .map_or(slot.name.as_str(), |(n, _)| n)
            .to_string();
        if let Some(answer) = asked.get(&node) {
            if let Some(reason) = answer {
                Self::node_away(slot, reason);
            }
            return;
        }
        match remote.state().await {
            Ok(DriveState::Offline) => {
                asked.insert(node, None);
                self.take_out(
                    slot,
                    "drive check",
                    &std::io::Error::other("out of service on its node"),
                    false,
                );
            }
            Ok(_) => {
                asked.insert(node, None);
            }
            Err(e) if late(&e) => {
                asked.insert(node, None);
                self.drive_failed(slot, "drive check", &e);
            }
            Err(e) => {
                let reason = format!("its node does not answer: {e}");
                Self::node_away(slot, &reason);
                asked.insert(node, Some(reason));
            }
        }
    }

    /// Takes a drive of a node that does not answer out of use (a node
    /// stopped for an upgrade is not a drive fault: a warning, once).
    fn node_away(slot: &DriveSlot, reason: &str) {
        let mut st = slot.state.write().expect("drive state");
        if st.db.is_none() {
            return;
        }
        tracing::warn!(drive = %slot.name, %reason, "drive of another node out of use until its node answers");
        st.db = None;
        st.faulty = false;
        st.reason = Some(reason.to_string());
    }

    /// A drive of another node taken out after a failed call (its node away,
    /// or the drive out of service there) is asked again; once it answers it
    /// is back in use, first as rebuilding: it missed the writes this node
    /// made meanwhile, so it answers metadata reads again once healed.
    async fn watch_remote(self: &Arc<Self>, slot: &DriveSlot, remote: &Arc<dyn Drive>) {
        if slot.online() {
            return;
        }
        let answer = remote.state().await;
        let mut st = slot.state.write().expect("drive state");
        match answer {
            Ok(DriveState::Ready | DriveState::Rebuilding) if st.db.is_none() => {
                st.db = Some(remote.clone());
                st.faulty = false;
                st.reason = None;
                st.rebuilding = Some(self.rebuild_seq.fetch_add(1, Ordering::SeqCst) + 1);
                st.full = false;
                drop(st);
                self.stats.drive_rejoins.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(drive = %slot.name, "drive of another node answers again: back in service; syncing (its node replays the writes it missed)");
            }
            Ok(DriveState::Offline) => {
                st.reason = Some("out of service on its node".into());
            }
            Ok(_) => {}
            Err(e) => st.reason = Some(format!("unreachable: {e}")),
        }
    }

    /// Starts a heal for drives that are rebuilding, unless one runs: right
    /// away when `now`, else when the last one ended a while ago (one that
    /// could not finish, say for lack of read quorum, is retried).
    fn heal_rebuilding(self: &Arc<Self>, now: bool) {
        // Only where the other drives of the set can answer for the records.
        if !(0..self.topo().slots.len()).any(|i| {
            let (sources, needed) = self.heal_sources(i);
            self.drive(i).online() && self.drive(i).rebuilding_full().is_some() && sources >= needed
        }) {
            return;
        }
        {
            let mut h = self.rebuild_heal.lock().expect("rebuild heal");
            let due = now || h.1.is_none_or(|t| t.elapsed() >= REBUILD_RETRY);
            if h.0 || !due {
                return;
            }
            h.0 = true;
        }
        let store = self.clone();
        tokio::spawn(async move {
            let report = store.backfill().await;
            tracing::info!(?report, "backfill of rebuilding drives ended");
            *store.rebuild_heal.lock().expect("rebuild heal") =
                (false, Some(std::time::Instant::now()));
        });
    }

    /// Ends rebuild `n` of drive `i` after a heal reached every record: it
    /// serves metadata reads again, unless it failed or began another rebuild
    /// meanwhile, or the other drives of its set were too few to heal from
    /// (then it waits for the next heal).
    pub(crate) fn finish_rebuild(&self, i: usize, n: u64) {
        let (sources, needed) = self.heal_sources(i);
        if sources < needed {
            let slot = &self.drive(i);
            if slot.rebuilding() == Some(n) {
                tracing::warn!(drive = %slot.name, sources, needed, "index not rebuilt: too few drives of its set to heal from");
            }
            return;
        }
        self.end_rebuild(i, n);
    }

    /// Ends rebuild `n` of drive `i` (unless it failed or began another
    /// meanwhile): a heal reached every record (`finish_rebuild`), or the
    /// missed-write logs of its set name nothing for its place (`sync_drives`;
    /// no other drive need be readable for that, so a set whose drives all
    /// came back to this node's view at once, as a new pool's do when this
    /// node applies the map a moment before their node, is promoted too).
    pub(crate) fn end_rebuild(&self, i: usize, n: u64) {
        let slot = &self.drive(i);
        let mut st = slot.state.write().expect("drive state");
        if st.db.is_none() || st.rebuilding != Some(n) {
            return;
        }
        if slot.is_remote() {
            // Its own node keeps the marker: this node's view ends here.
        } else if let Err(error) = drive::clear_rebuilding(&slot.paths.root) {
            // Still rebuilding after a restart: harmless, healed again.
            tracing::warn!(drive = %slot.name, %error, "cannot remove the rebuild marker");
        }
        st.rebuilding = None;
        let full = std::mem::take(&mut st.full);
        st.reason = None;
        drop(st);
        self.stats.index_rebuilds.fetch_add(1, Ordering::Relaxed);
        // Good news, and routine after every start of a cluster node: the
        // warnings were when the drive went or came back.
        if full {
            tracing::info!(drive = %slot.name, "index filled by heal: the drive serves reads again");
        } else {
            tracing::info!(drive = %slot.name, "drive in sync with its set (no write missed): serves reads again");
        }
    }

    /// The other drives of drive `i`'s set with a complete index, and how
    /// many a heal needs to answer for the records (none for a drive alone
    /// in its set, whose rebuild is the salvage of its own index).
    fn heal_sources(&self, i: usize) -> (usize, usize) {
        let topo = self.topo();
        let members = &topo.sets[topo.slots[i].set_index];
        let sources = members
            .iter()
            .filter(|&&d| d != i && topo.slots[d].readable())
            .count();
        let needed = if members.len() == 1 {
            0
        } else {
            self.meta_read_quorum(members.len())
        };
        (sources, needed)
    }

    /// A drive of this node by its id, as the node serves it to the others:
    /// (for metadata reads: in use and not rebuilding in full; for writes
    /// and shard files: in use). None when no drive of this node has that id.
    pub fn local_drive(&self, id: &Id128) -> Option<ServedDrive> {
        self.local_slot(id).map(|d| {
            // A syncing drive answers the others' reads: each node keeps its
            // own view of which drives are behind, and quorum reads never
            // let one drive's missing records hide a committed version.
            let read = d.writer().filter(|_| d.rebuilding_full().is_none());
            (read, d.writer())
        })
    }

    /// This node's drives' free and total bytes, for the other nodes
    /// (placement of new keys by free space).
    pub fn local_space(&self) -> Vec<(Id128, u64, u64)> {
        self.topo()
            .slots
            .iter()
            .filter(|d| !d.is_remote())
            .filter_map(|d| d.space().map(|(f, t)| (d.expected.drive_id, f, t)))
            .collect()
    }

    /// Another node's report of its drive's space.
    pub fn set_remote_space(&self, id: &Id128, free: u64, total: u64) {
        if let Some(d) = self
            .topo()
            .slots
            .iter()
            .find(|d| d.is_remote() && d.expected.drive_id == *id)
        {
            d.set_space(free, total);
        }
    }

    fn local_slot(&self, id: &Id128) -> Option<Arc<DriveSlot>> {
        self.topo()
            .slots
            .iter()
            .find(|d| !d.is_remote() && d.expected.drive_id == *id)
            .cloned()
    }

    /// The lease table of a drive of this node by its id, as the node
    /// serves it to the others: whether or not the drive is in use (its
    /// votes and pins are kept in memory).
    pub fn local_leases(&self, id: &Id128) -> Option<Arc<LeaseTable>> {
        self.local_slot(id).and_then(|d| d.leases.clone())
    }

    /// The topology served now.
    pub(crate) fn topo(&self) -> Arc<Topology> {
        self.topo.read().expect("topology").clone()
    }

    pub(crate) fn slot(&self, set: usize, position: usize) -> Arc<DriveSlot> {
        let t = self.topo();
        t.slots[t.sets[set][position]].clone()
    }

    /// Drive slot `i`.
    pub(crate) fn drive(&self, i: usize) -> Arc<DriveSlot> {
        self.topo().slots[i].clone()
    }

    pub(crate) fn set_count(&self) -> usize {
        self.topo().sets.len()
    }

    /// A stored layout must name drives of its set only; a record that does not
    /// (forged, or from another configuration) is refused instead of indexing
    /// past the set.
    pub(crate) fn check_layout(&self, set: usize, layout: &Layout) -> Result<(), StoreError> {
        let n = self.set_size(set);
        if layout.distribution.iter().any(|&pos| pos as usize >= n) {
            return Err(StoreError::CorruptMetadata {
                drive: String::new(),
                what: format!("layout names drive positions beyond the set of {n}"),
            });
        }
        Ok(())
    }

    pub(crate) fn set_size(&self, set: usize) -> usize {
        self.topo().sets[set].len()
    }

    pub(crate) fn buffer_wait(&self) -> Duration {
        Duration::from_millis(self.cfg.buffer_wait_ms)
    }

    pub(crate) fn pool(&self) -> &BufferPool {
        &self.pool
    }

    /// Frees the stripe buffers that sat unused since the last call (the
    /// server calls it every few seconds): memory a burst took goes back.
    pub fn trim_buffers(&self) -> usize {
        self.pool.trim_idle() + self.pieces.trim_idle()
    }

    /// Bytes of GET data read ahead of clients now, and the budget.
    pub fn read_ahead_bytes(&self) -> (u64, u64) {
        let total = read_ahead_pieces(self.cfg.read_ahead_max_bytes);
        let used = total - self.read_ahead.available_permits();
        (
            (used * get::PIECE_BYTES) as u64,
            (total * get::PIECE_BYTES) as u64,
        )
    }

    /// Pins the shard data of `v` for a reader. Call under the key's read lock.
    pub(crate) fn pin_data(self: &Arc<Self>, set: usize, v: &VersionMeta) -> PinGuard {
        let ids = data_ids_of(std::slice::from_ref(v));
        let mut pins = self.pins.lock().expect("pins lock");
        for id in &ids {
            pins.entry(*id).or_default().readers += 1;
        }
        PinGuard {
            store: Some(self.clone()),
            set,
            ids,
            lease: None,
        }
    }

    /// Deletes the shard data of versions a commit superseded or removed, or,
    /// for data a reader still streams, when its last reader finishes. Call
    /// under the key's write lock, so no reader can pin in between.
    pub(crate) async fn retire_data(&self, set: usize, ids: Vec<Id128>) {
        let now: Vec<Id128> = {
            let mut pins = self.pins.lock().expect("pins lock");
            ids.into_iter()
                .filter(|id| match pins.get_mut(id) {
                    Some(p) => {
                        p.retired_in_set = Some(set);
                        false
                    }
                    None => true,
                })
                .collect()
        };
        self.remove_data(set, now).await;
    }

    pub(crate) fn register_inflight(&self, id: Id128) -> InflightData {
        self.inflight_data.lock().expect("inflight lock").insert(id);
        InflightData {
            set: self.inflight_data.clone(),
            id,
        }
    }

    pub(crate) fn queue_heal(&self, bucket: &str, key: &str) {
        let task = HealTask {
            bucket: bucket.to_string(),
            key: key.to_string(),
        };
        match self.heal_tx.try_send(task) {
            Ok(()) => {
                self.stats.heal_queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats.heal_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Starts the backfill of drives of this node that rebuild in full
    /// (a drive the cluster map just placed in a replaced drive's place),
    /// unless one runs. On a runtime.
    pub fn start_backfill(self: &Arc<Self>) {
        self.heal_rebuilding(true);
    }

    /// Runs the heal queue (and a full heal first when a replaced drive joined)
    /// on the current runtime until the store is dropped. Call once.
    pub fn spawn_background(self: &Arc<Self>, scan_interval: Option<Duration>) {
        let Some(mut rx) = self.heal_rx.lock().expect("heal lock").take() else {
            return;
        };
        // Drives that joined empty or whose index was set aside at start.
        self.heal_rebuilding(true);
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(task) = rx.recv().await {
                let Some(store) = weak.upgrade() else { return };
                if let Err(error) = store.heal_object(&task.bucket, &task.key).await {
                    tracing::warn!(bucket = %task.bucket, key = %task.key, %error, "heal failed");
                }
            }
        });
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            // A cluster node's drives start syncing: the first check comes
            // soon, not a whole interval later (its peers may still be
            // starting; the next interval asks again).
            tokio::time::sleep(DRIVE_PROBE_INTERVAL / 8).await;
            loop {
                let Some(store) = weak.upgrade() else { return };
                store.watch_drives().await;
                drop(store);
                tokio::time::sleep(DRIVE_PROBE_INTERVAL).await;
            }
        });
        if let Some(every) = scan_interval {
            let weak = Arc::downgrade(self);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    let Some(store) = weak.upgrade() else { return };
                    let report = store.heal_all().await;
                    tracing::info!(?report, "background scan finished");
                }
            });
        }
    }

    // ---------------------------------------------------------------------
    // Buckets

    pub(crate) fn bucket_record(&self, name: &str) -> Result<BucketRecord, StoreError> {
        if let Some(r) = self.buckets.read().expect("buckets lock").get(name) {
            return Ok(r.clone());
        }
        if self.buckets_partial() {
            return Err(self.partial_buckets_error());
        }
        Err(StoreError::NoSuchBucket(name.to_string()))
    }

    /// Whether this node's bucket list may lack buckets that exist (read
    /// from too few drives); ListBuckets and a bucket not found answer 503
    /// meanwhile.
    pub fn buckets_partial(&self) -> bool {
        self.buckets_partial.load(Ordering::Acquire)
    }

    pub fn partial_buckets_error(&self) -> StoreError {
        let n = self.topo().slots.len();
        StoreError::QuorumLost {
            what: "reading the bucket list",
            needed: n / 2 + 1,
            available: self
                .topo()
                .slots
                .iter()
                .filter(|s| s.db().is_some())
                .count(),
        }
    }

    /// Reads the bucket list again from the drives in service, once a
    /// majority of them answers (single node; a cluster's list is etcd's).
    fn reload_partial_buckets(&self) {
        if !self.buckets_partial() || self.catalog.is_some() {
            return;
        }
        let topo = self.topo();
        let n = topo.slots.len();
        let (view, answered) = bucket_view(topo.slots.iter().map(|s| s.as_ref()));
        if answered < n / 2 + 1 {
            return;
        }
        let mut buckets = self.buckets.write().expect("buckets lock");
        for (name, rec) in view {
            buckets.entry(name).or_insert(rec);
        }
        drop(buckets);
        self.buckets_partial.store(false, Ordering::Release);
        tracing::warn!(
            answered,
            drives = n,
            "bucket list read again from a majority of the drives"
        );
    }

    /// The indexes of drives in use, for writes (rebuilding ones included),
    /// with their slots.
    pub(crate) fn writers(
        &self,
        slots: impl Iterator<Item = Arc<DriveSlot>>,
    ) -> Vec<(Arc<DriveSlot>, Arc<dyn Drive>)> {
        slots.filter_map(|s| s.writer().map(|db| (s, db))).collect()
    }

    /// Counts the successes of metadata writes to drives; a drive whose
    /// write failed is taken out (its index is reopened when it works).
    pub(crate) fn count_index_writes(
        &self,
        what: &str,
        targets: &[(Arc<DriveSlot>, Arc<dyn Drive>)],
        results: &[Result<(), StoreError>],
    ) -> usize {
        for ((slot, _), r) in targets.iter().zip(results) {
            match r {
                Ok(()) => {}
                // The drive holds a newer record of the key: nothing wrong
                // with it; the write counts as one it missed.
                Err(e @ StoreError::Superseded { .. }) => {
                    tracing::warn!(drive = %slot.name, error = %e, "{what} refused by a drive holding a newer record");
                }
                // Its node is probed; one late answer takes nothing out.
                Err(e @ StoreError::Late { .. }) => {
                    tracing::warn!(drive = %slot.name, error = %e, "{what} missed a drive that answered late");
                }
                Err(e) => {
                    log_drive_failure(&slot.name, &format!("{what} failed on a drive"), e);
                    self.index_write_failed(slot, what, e);
                }
            }
        }
        results.iter().filter(|r| r.is_ok()).count()
    }

    async fn write_bucket_everywhere(
        &self,
        name: &str,
        rec: Option<BucketRecord>,
    ) -> Result<(), StoreError> {
        let total = self.topo().slots.len();
        let quorum = total / 2 + 1;
        let targets = self.writers(self.topo().slots.iter().cloned());
        let futs = targets.iter().map(|(_, d)| match &rec {
            Some(r) => d.put_bucket(name.to_string(), r.clone()),
            None => d.delete_bucket(name.to_string()),
        });
        let results = futures::future::join_all(futs).await;
        let ok = self.count_index_writes("metadata write", &targets, &results);
        if ok < quorum {
            return Err(StoreError::QuorumLost {
                what: "bucket update",
                needed: quorum,
                available: ok,
            });
        }
        Ok(())
    }

    /// Bucket records on the drives: the record itself on one node, where
    /// the drives are what keeps it (a quorum of them must take it); a copy
    /// in a cluster, whose catalog keeps it (drives that miss it get it
    /// from heal).
    async fn write_bucket_records(
        &self,
        name: &str,
        rec: Option<BucketRecord>,
    ) -> Result<(), StoreError> {
        let r = self.write_bucket_everywhere(name, rec).await;
        match r {
            Err(error) if self.catalog.is_some() => {
                tracing::warn!(bucket = %name, %error, "bucket record not on every drive yet; heal completes it");
                Ok(())
            }
            r => r,
        }
    }

    /// Where this store keeps bucket records and system documents, in a
    /// cluster.
    pub fn catalog(&self) -> Option<&Arc<dyn Catalog>> {
        self.catalog.as_ref()
    }

    /// A change of a bucket's record made elsewhere (another node, seen by
    /// the catalog's watch): None when the bucket is gone.
    pub fn apply_bucket(&self, name: &str, rec: Option<BucketRecord>) {
        let mut buckets = self.buckets.write().expect("buckets lock");
        match rec {
            Some(r) => buckets.insert(name.to_string(), r),
            None => buckets.remove(name),
        };
    }

    /// Every bucket record at once, from the catalog's full read.
    pub fn replace_buckets(&self, all: BTreeMap<String, BucketRecord>) {
        *self.buckets.write().expect("buckets lock") = all;
    }

    /// A bucket this node does not know may have been made on another node
    /// a moment ago: the catalog is asked (cluster only). Whether it exists.
    pub async fn refresh_bucket(&self, name: &str) -> bool {
        if self.bucket_created_ns(name).is_some() {
            return true;
        }
        let Some(catalog) = &self.catalog else {
            return false;
        };
        match catalog.bucket(name).await {
            Ok(Some(rec)) => {
                self.apply_bucket(name, Some(rec));
                true
            }
            Ok(None) => false,
            Err(error) => {
                tracing::warn!(bucket = %name, %error, "cannot ask the catalog for a bucket");
                false
            }
        }
    }

    pub async fn create_bucket(
        &self,
        name: &str,
        durability: Durability,
    ) -> Result<(), StoreError> {
        self.create_bucket_with(name, durability, false).await
    }

    /// Creates a bucket; with `object_lock`, one whose versioning is on
    /// for good and whose versions may be locked.
    pub async fn create_bucket_with(
        &self,
        name: &str,
        durability: Durability,
        object_lock: bool,
    ) -> Result<(), StoreError> {
        validate_bucket_name(name)?;
        if self.buckets_partial() && self.catalog.is_none() {
            // It may exist on the drives not read.
            return Err(self.partial_buckets_error());
        }
        self.create_bucket_named(name, durability, object_lock)
            .await
    }

    /// Creates an internal bucket (its name starts with `.`, so no S3
    /// request can name it and listings leave it out): a cache bucket's
    /// chunks. Placed like any bucket of `durability`.
    pub async fn create_internal_bucket(
        &self,
        name: &str,
        durability: Durability,
    ) -> Result<(), StoreError> {
        if !name.starts_with('.') || name == SYSTEM_BUCKET {
            return Err(StoreError::InvalidBucketName(name.to_string()));
        }
        self.create_bucket_named(name, durability, false).await
    }

    /// Creates the system bucket unless it exists (at start, before serving).
    pub async fn ensure_system_bucket(&self) -> Result<(), StoreError> {
        match self
            .create_bucket_named(SYSTEM_BUCKET, Durability::ErasureCoded, false)
            .await
        {
            Ok(()) | Err(StoreError::BucketExists(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn create_bucket_named(
        &self,
        name: &str,
        durability: Durability,
        object_lock: bool,
    ) -> Result<(), StoreError> {
        if let Durability::Replicated(0) = durability {
            return Err(StoreError::InvalidArgument(
                "replica count must be at least 1".into(),
            ));
        }
        let _g = self.locks.write(name, "").await;
        if self
            .buckets
            .read()
            .expect("buckets lock")
            .contains_key(name)
        {
            return Err(StoreError::BucketExists(name.to_string()));
        }
        let rec = BucketRecord {
            created_ns: now_ns(),
            durability,
            versioning: if object_lock {
                Versioning::Enabled
            } else {
                Versioning::Unversioned
            },
            object_lock,
        };
        if let Some(catalog) = &self.catalog {
            if !catalog.create_bucket(name, &rec).await? {
                // Another node made it first: known here from now on.
                if let Some(theirs) = catalog.bucket(name).await? {
                    self.apply_bucket(name, Some(theirs));
                }
                return Err(StoreError::BucketExists(name.to_string()));
            }
        }
        self.write_bucket_records(name, Some(rec.clone())).await?;
        self.buckets
            .write()
            .expect("buckets lock")
            .insert(name.to_string(), rec);
        Ok(())
    }

    /// Deletes an empty bucket. Multipart uploads in progress do not keep a
    /// bucket from being deleted (as in S3): they are aborted first.
    pub async fn delete_bucket(&self, name: &str) -> Result<(), StoreError> {
        self.bucket_record(name)?;
        if self.bucket_has_entries(name, false).await? {
            return Err(StoreError::BucketNotEmpty(name.to_string()));
        }
        let dbs: Vec<_> = self.topo().slots.iter().filter_map(|d| d.db()).collect();
        for (key, id) in multipart::bucket_uploads(dbs, name).await? {
            let id = crate::format::id_to_hex(&id);
            match self.abort_multipart_upload(name, &key, &id).await {
                Ok(()) | Err(StoreError::NoSuchUpload(_)) => {}
                Err(e) => return Err(e),
            }
        }
        // Aborts take their keys' locks, so the bucket's (a lock stripe
        // they may share) is taken only now; an object or upload that
        // arrived meanwhile keeps the bucket. Writers anywhere hold the
        // bucket for reading until their commit is written.
        let _g = self.lock_bucket(name).await?;
        self.bucket_record(name)?;
        if self.bucket_has_entries(name, true).await? {
            return Err(StoreError::BucketNotEmpty(name.to_string()));
        }
        if let Some(catalog) = &self.catalog {
            catalog.delete_bucket(name).await?;
        }
        self.write_bucket_records(name, None).await?;
        self.buckets.write().expect("buckets lock").remove(name);
        Ok(())
    }

    /// Whether any drive holds an object of `name` (or, with `uploads`, a
    /// multipart upload in progress).
    async fn bucket_has_entries(&self, name: &str, uploads: bool) -> Result<bool, StoreError> {
        let drives: Vec<_> = self.topo().slots.iter().filter_map(|d| d.db()).collect();
        let answers = futures::future::join_all(
            drives
                .iter()
                .map(|d| d.bucket_has_entries(name.to_string(), uploads)),
        )
        .await;
        // Any drive holding an entry is enough; otherwise every drive must
        // have answered.
        if answers.iter().any(|a| matches!(a, Ok(true))) {
            return Ok(true);
        }
        answers.into_iter().try_fold(false, |_, a| a)
    }

    pub fn head_bucket(&self, name: &str) -> Result<BucketInfo, StoreError> {
        let r = self.bucket_record(name)?;
        Ok(BucketInfo {
            name: name.to_string(),
            created_ns: r.created_ns,
            durability: r.durability,
            versioning: r.versioning,
            object_lock: r.object_lock,
        })
    }

    /// When a bucket was made (None: no such bucket); cheaper than head_bucket.
    pub fn bucket_created_ns(&self, name: &str) -> Option<u64> {
        self.buckets
            .read()
            .expect("buckets lock")
            .get(name)
            .map(|r| r.created_ns)
    }

    /// The users' buckets (not the system bucket nor internal ones).
    pub fn list_buckets(&self) -> Vec<BucketInfo> {
        self.buckets
            .read()
            .expect("buckets lock")
            .iter()
            .filter(|(n, _)| !n.starts_with('.'))
            .map(|(n, r)| BucketInfo {
                name: n.clone(),
                created_ns: r.created_ns,
                durability: r.durability,
                versioning: r.versioning,
                object_lock: r.object_lock,
            })
            .collect()
    }

    pub async fn set_bucket_versioning(&self, name: &str, enabled: bool) -> Result<(), StoreError> {
        let _g = self.locks.write(name, "").await;
        let mut rec = self.bucket_record(name)?;
        if rec.object_lock && !enabled {
            return Err(StoreError::InvalidBucketState(
                "An Object Lock configuration is present on this bucket, so the versioning state cannot be changed.".into(),
            ));
        }
        rec.versioning = if enabled {
            Versioning::Enabled
        } else {
            Versioning::Suspended
        };
        self.put_bucket_record(name, rec).await
    }

    /// Enables object lock on an existing bucket; its versioning must be
    /// enabled. It cannot be disabled again.
    pub async fn enable_object_lock(&self, name: &str) -> Result<(), StoreError> {
        let _g = self.locks.write(name, "").await;
        let mut rec = self.bucket_record(name)?;
        if rec.object_lock {
            return Ok(());
        }
        if rec.versioning != Versioning::Enabled {
            return Err(StoreError::InvalidBucketState(
                "Versioning must be 'Enabled' on the bucket to apply a Object Lock configuration"
                    .into(),
            ));
        }
        rec.object_lock = true;
        self.put_bucket_record(name, rec).await
    }

    /// Writes a changed bucket record: the catalog's first, then the drives'.
    async fn put_bucket_record(&self, name: &str, rec: BucketRecord) -> Result<(), StoreError> {
        if let Some(catalog) = &self.catalog {
            catalog.put_bucket(name, &rec).await?;
        }
        self.write_bucket_records(name, Some(rec.clone())).await?;
        self.buckets
            .write()
            .expect("buckets lock")
            .insert(name.to_string(), rec);
        Ok(())
    }

    // ---------------------------------------------------------------------
    // Object metadata across a set

    /// Reads the record of bucket/key from every drive of its set.
    /// Returns one entry per set position: Ok(None) = no record, Err = unusable.
    pub(crate) async fn read_records(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
    ) -> Vec<Result<Option<ObjectRecord>, StoreError>> {
        let drives: Vec<Option<Arc<dyn Drive>>> = (0..self.set_size(set))
            .map(|pos| self.slot(set, pos).db())
            .collect();
        let (b, k) = (bucket.to_string(), key.to_string());
        let records = per_drive(
            &drives,
            move |db| db.object(&b, &k),
            |d| d.object(bucket.to_string(), key.to_string()),
        )
        .await;
        // Errors of the drives read, not the "offline" of the others.
        for (pos, r) in records.iter().enumerate() {
            if let (Some(_), Err(e)) = (&drives[pos], r) {
                self.index_read_failed(&self.slot(set, pos), e);
            }
        }
        records
    }

    /// The versions of bucket/key that a read quorum agrees on, and whether any
    /// drive disagrees (then a heal is due).
    pub(crate) async fn resolved(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
    ) -> Result<(ObjectRecord, bool), StoreError> {
        let records = self.read_records(set, bucket, key).await;
        let merged = resolve(&records, self.set_size(set))?;
        let diverged = records.iter().any(|r| match r {
            Ok(Some(rec)) => *rec != merged,
            Ok(None) => !merged.versions.is_empty(),
            Err(StoreError::CorruptMetadata { .. }) => true,
            Err(_) => false,
        });
        Ok((merged, diverged))
    }

    /// Writes `w` to every online drive of the set; succeeds on a write
    /// quorum. Every position the write does not reach (its drive out of
    /// service, or failing the write) is recorded in the missed-write log on
    /// the drives that took it before this returns: with the write itself
    /// for drives known to be out, after it for drives that failed it.
    pub(crate) async fn write_object_everywhere(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        mut w: ObjectWrite,
    ) -> Result<usize, StoreError> {
        // Above every stamp the writer saw (its record came from a merge,
        // which carries the highest), so every drive takes it over what
        // it holds, and none takes an older write over it.
        if let Some(r) = &mut w.record {
            r.stamp = self.next_mod_time(r.stamp);
        }
        let n = self.set_size(set);
        let mut targets = Vec::with_capacity(n);
        let mut positions = Vec::with_capacity(n);
        for pos in 0..n {
            let slot = self.slot(set, pos);
            match slot.writer() {
                Some(d) => {
                    targets.push((slot, d));
                    positions.push(pos as u8);
                }
                None => {
                    if !w.missed.contains(&(pos as u8)) {
                        w.missed.push(pos as u8);
                    }
                }
            }
        }
        let w = Arc::new(w);
        let futs = targets
            .iter()
            .map(|(_, d)| d.write_object(bucket.to_string(), key.to_string(), w.clone()));
        let results = futures::future::join_all(futs).await;
        let ok = self.count_index_writes("metadata write", &targets, &results);
        let quorum = self.meta_write_quorum(n);
        if ok < quorum {
            return Err(StoreError::QuorumLost {
                what: "metadata commit",
                needed: quorum,
                available: ok,
            });
        }
        let failed: Vec<u8> = positions
            .iter()
            .zip(&results)
            .filter(|(_, r)| r.is_err())
            .map(|(p, _)| *p)
            .collect();
        if !failed.is_empty() {
            let took: Vec<_> = targets
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_ok())
                .map(|((slot, d), _)| (slot.clone(), d.clone()))
                .collect();
            self.log_missed_on(set, &took, bucket, key, &failed).await?;
        }
        self.stats
            .missed_writes
            .fetch_add((w.missed.len() + failed.len()) as u64, Ordering::Relaxed);
        Ok(ok)
    }

    pub(crate) fn info_from(
        &self,
        bucket: &str,
        key: &str,
        v: &VersionMeta,
        is_latest: bool,
    ) -> ObjectInfo {
        ObjectInfo {
            bucket: bucket.to_string(),
            key: key.to_string(),
            version_id: version_to_string(&v.version_id),
            is_latest,
            delete_marker: v.delete_marker,
            size: v.size,
            etag: v.etag.clone(),
            last_modified_ns: v.mod_time_ns,
            content_type: v.content_type.clone(),
            headers: v.headers.clone(),
            user_metadata: v.user_metadata.clone(),
            tags: v.tags.clone(),
            checksum: v.checksum.clone(),
            lock: v.lock,
            parts: match &v.storage {
                Storage::Parts(p) if p.len() > 1 || v.etag.contains('-') => p
                    .iter()
                    .map(|p| PartSummary {
                        number: p.number,
                        size: v.plain_part_size(p.size),
                        etag: p.etag.clone(),
                        checksum: p.checksum.clone(),
                    })
                    .collect(),
                _ => Vec::new(),
            },
        }
    }

    /// Picks the version a read addresses: a given id, or the latest.
    pub(crate) fn select_version<'a>(
        &self,
        rec: &'a ObjectRecord,
        bucket: &str,
        key: &str,
        version: Option<&str>,
    ) -> Result<(&'a VersionMeta, bool), StoreError> {
        match version {
            None => {
                let v = rec.versions.first().ok_or_else(|| StoreError::NoSuchKey {
                    bucket: bucket.into(),
                    key: key.into(),
                })?;
                if v.delete_marker {
                    return Err(StoreError::DeleteMarker {
                        bucket: bucket.into(),
                        key: key.into(),
                        version: version_to_string(&v.version_id),
                    });
                }
                Ok((v, true))
            }
            Some(s) => {
                let no_version = || StoreError::NoSuchVersion {
                    bucket: bucket.into(),
                    key: key.into(),
                    version: s.into(),
                };
                let id = parse_version(s).ok_or_else(|| {
                    StoreError::InvalidArgument(format!("invalid version id {s:?}"))
                })?;
                let pos = rec
                    .versions
                    .iter()
                    .position(|v| v.version_id == id)
                    .ok_or_else(no_version)?;
                Ok((&rec.versions[pos], pos == 0))
            }
        }
    }

    pub async fn head_object(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
    ) -> Result<ObjectInfo, StoreError> {
        self.bucket_record(bucket)?;
        validate_key(key)?;
        let loc = self.locate(bucket, key).await?;
        if loc.diverged {
            self.queue_heal(bucket, key);
        }
        let rec = loc.rec;
        let (v, latest) = self.select_version(&rec, bucket, key, version)?;
        if v.delete_marker {
            return Err(StoreError::MethodNotAllowed);
        }
        Ok(self.info_from(bucket, key, v, latest))
    }

    /// Removes the shard files of data ids from every drive of a set (best effort:
    /// leftovers are orphans the scanner can collect).
    pub(crate) async fn remove_data(&self, set: usize, data_ids: Vec<Id128>) {
        if data_ids.is_empty() {
            return;
        }
        let drives: Vec<Arc<dyn Drive>> = (0..self.set_size(set))
            .filter_map(|pos| self.slot(set, pos).writer())
            .collect();
        // This node's drives on one blocking thread; others' concurrently.
        let local: Vec<PathBuf> = drives
            .iter()
            .filter_map(|d| d.as_local())
            .flat_map(|l| data_ids.iter().map(|id| l.paths.shard(id)))
            .collect();
        let remote = drives
            .iter()
            .filter(|d| d.as_local().is_none())
            .map(|d| d.remove_shards(data_ids.clone()));
        let local = run_blocking(move || {
            for p in local {
                if let Err(e) = std::fs::remove_file(&p) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %p.display(), error = %e, "could not remove shard file");
                    }
                }
            }
            Ok(())
        });
        let _ = futures::join!(local, futures::future::join_all(remote));
    }

    // ---------------------------------------------------------------------
    // Deletes and tags

    pub async fn delete_object(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
    ) -> Result<crate::types::DeleteResult, StoreError> {
        self.delete_object_if(bucket, key, version, None).await
    }

    /// DELETE with If-Match, checked under the key's lock on the same metadata
    /// the delete acts on.
    pub async fn delete_object_if(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        if_match: Option<&str>,
    ) -> Result<crate::types::DeleteResult, StoreError> {
        self.delete_object_with(bucket, key, version, if_match, false)
            .await
    }

    /// DELETE as a client asks it: `bypass_governance` when the caller
    /// asked for the governance bypass and holds its permission. A locked
    /// version (legal hold, or a retention not yet ended) is never removed:
    /// `ObjectLocked`.
    pub async fn delete_object_with(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        if_match: Option<&str>,
        bypass_governance: bool,
    ) -> Result<crate::types::DeleteResult, StoreError> {
        self.delete_expecting(bucket, key, version, if_match, None, bypass_governance)
            .await
            .map(|r| r.expect("a delete without expectations happens"))
    }

    /// A lifecycle expiry: deletes as DELETE does (the current version: a
    /// delete marker where versioning is on; a version by its id) only if
    /// the key is still as the scan judged it, checked under the key's
    /// lock. None: it changed meanwhile, and nothing was done.
    pub async fn expire_if_unchanged(
        &self,
        bucket: &str,
        key: &str,
        expect: crate::types::Unchanged,
    ) -> Result<Option<crate::types::DeleteResult>, StoreError> {
        let version = match &expect {
            crate::types::Unchanged::Current { .. } => None,
            crate::types::Unchanged::Version { version } => Some(version.clone()),
            crate::types::Unchanged::SoleDeleteMarker { version } => Some(version.clone()),
        };
        self.delete_expecting(bucket, key, version.as_deref(), None, Some(expect), false)
            .await
    }

    async fn delete_expecting(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        if_match: Option<&str>,
        expect: Option<crate::types::Unchanged>,
        bypass_governance: bool,
    ) -> Result<Option<crate::types::DeleteResult>, StoreError> {
        let brec = self.bucket_record(bucket)?;
        validate_key(key)?;
        let version_id =
            match version {
                Some(s) => Some(parse_version(s).ok_or_else(|| {
                    StoreError::InvalidArgument(format!("invalid version id {s:?}"))
                })?),
                None => None,
            };
        let _g = self.lock_write(bucket, key).await?;
        let loc = self.locate(bucket, key).await?;
        let (set, mut rec) = (loc.set, loc.rec);
        if let Some(expect) = &expect {
            let name =
                |v: &VersionMeta| version_to_string(&v.version_id).unwrap_or_else(|| "null".into());
            let holds = match expect {
                crate::types::Unchanged::Current {
                    version,
                    mod_time_ns,
                } => rec.versions.first().is_some_and(|v| {
                    !v.delete_marker && &name(v) == version && v.mod_time_ns == *mod_time_ns
                }),
                crate::types::Unchanged::Version { version } => {
                    rec.versions.iter().skip(1).any(|v| &name(v) == version)
                }
                crate::types::Unchanged::SoleDeleteMarker { version } => {
                    rec.versions.len() == 1
                        && rec.versions[0].delete_marker
                        && &name(&rec.versions[0]) == version
                }
            };
            if !holds {
                return Ok(None);
            }
        }
        if let Some(condition) = if_match {
            let (v, _) = self.select_version(&rec, bucket, key, version)?;
            if v.delete_marker {
                return Err(StoreError::MethodNotAllowed);
            }
            if !put::etag_matches(condition, &v.etag) {
                return Err(StoreError::PreconditionFailed("If-Match"));
            }
        }
        let mut removed: Vec<VersionMeta> = Vec::new();
        let result;
        match (version_id, brec.versioning) {
            (Some(id), _) => {
                match rec.versions.iter().position(|v| v.version_id == id) {
                    Some(pos) => {
                        if let Some(why) = rec.versions[pos].locked(now_ns(), bypass_governance) {
                            return Err(StoreError::ObjectLocked(why.to_string()));
                        }
                        let v = rec.versions.remove(pos);
                        result = crate::types::DeleteResult {
                            delete_marker: v.delete_marker,
                            version_id: version.map(str::to_string),
                        };
                        removed.push(v);
                    }
                    // Deleting a version that does not exist succeeds (S3 semantics).
                    None => {
                        return Ok(Some(crate::types::DeleteResult {
                            delete_marker: false,
                            version_id: version.map(str::to_string),
                        }))
                    }
                }
            }
            (None, Versioning::Unversioned) => {
                if rec.versions.is_empty() {
                    return Ok(Some(crate::types::DeleteResult {
                        delete_marker: false,
                        version_id: None,
                    }));
                }
                if let Some(why) = rec
                    .versions
                    .iter()
                    .find_map(|v| v.locked(now_ns(), bypass_governance))
                {
                    return Err(StoreError::ObjectLocked(why.to_string()));
                }
                removed.extend(
                    rec.versions
                        .drain(..)
                        .filter(|v| v.version_id == NULL_VERSION),
                );
                result = crate::types::DeleteResult {
                    delete_marker: false,
                    version_id: None,
                };
            }
            (None, versioning) => {
                let id = if versioning == Versioning::Enabled {
                    new_id()
                } else {
                    NULL_VERSION
                };
                if id == NULL_VERSION {
                    if let Some(pos) = rec
                        .versions
                        .iter()
                        .position(|v| v.version_id == NULL_VERSION)
                    {
                        if let Some(why) = rec.versions[pos].locked(now_ns(), bypass_governance) {
                            return Err(StoreError::ObjectLocked(why.to_string()));
                        }
                        removed.push(rec.versions.remove(pos));
                    }
                }
                let after = rec
                    .versions
                    .iter()
                    .map(|v| v.mod_time_ns)
                    .max()
                    .unwrap_or(0);
                let marker = VersionMeta {
                    version_id: id,
                    mod_time_ns: self.next_mod_time(after),
                    delete_marker: true,
                    size: 0,
                    etag: String::new(),
                    content_type: String::new(),
                    headers: Vec::new(),
                    user_metadata: Vec::new(),
                    tags: Vec::new(),
                    checksum: None,
                    layout: Layout::single_copy(self.cfg.stripe_size_bytes as u32),
                    storage: Storage::Inline { crc32c: 0 },
                    seal: None,
                    lock: None,
                };
                rec.versions.insert(0, marker);
                result = crate::types::DeleteResult {
                    delete_marker: true,
                    version_id: version_to_string(&id),
                };
            }
        }
        let w = ObjectWrite {
            record: Some(rec),
            inline_delete: inline_keys_of(&removed),
            ..Default::default()
        };
        self.write_object_everywhere(set, bucket, key, w).await?;
        self.retire_data(set, data_ids_of(&removed)).await;
        Ok(Some(result))
    }

    /// Replaces the tags of a version; never touches its data.
    pub async fn put_object_tags(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        tags: Vec<(String, String)>,
    ) -> Result<Option<String>, StoreError> {
        self.update_version(bucket, key, version, |v| v.tags = tags)
            .await
    }

    /// Sets (or with None removes) one stored header of a version; never
    /// touches its data.
    pub async fn set_object_header(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        name: &str,
        value: Option<String>,
    ) -> Result<Option<String>, StoreError> {
        self.update_version(bucket, key, version, |v| {
            v.headers.retain(|(k, _)| k != name);
            if let Some(value) = value {
                v.headers.push((name.to_string(), value));
            }
        })
        .await
    }

    /// Replaces stored headers of one version (`version`: an id or
    /// `null`), only if its header `expect.0` still has the value
    /// `expect.1`: Ok(false) (nothing written) when it changed or the
    /// version is gone. Never touches data.
    pub async fn replace_headers_if(
        &self,
        bucket: &str,
        key: &str,
        version: &str,
        expect: (&str, &str),
        set: Vec<(String, String)>,
    ) -> Result<bool, StoreError> {
        let mut changed = false;
        let r = self
            .try_update_version(bucket, key, Some(version), |v| {
                let holds = v
                    .headers
                    .iter()
                    .any(|(k, val)| k == expect.0 && val == expect.1);
                if !holds {
                    // Nothing to write: refused so the record stays as it is.
                    return Err(StoreError::PreconditionFailed("stored header"));
                }
                for (name, value) in set {
                    v.headers.retain(|(k, _)| *k != name);
                    v.headers.push((name, value));
                }
                changed = true;
                Ok(())
            })
            .await;
        match r {
            Ok(_) => Ok(changed),
            Err(StoreError::PreconditionFailed(_))
            | Err(StoreError::NoSuchVersion { .. })
            | Err(StoreError::NoSuchKey { .. })
            | Err(StoreError::MethodNotAllowed) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sets a version's retention (None removes it), as the lock allows
    /// (`ObjectLock::may_retain`); `bypass_governance` as for deletes.
    pub async fn set_object_retention(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        retention: Option<crate::format::Retention>,
        bypass_governance: bool,
    ) -> Result<Option<String>, StoreError> {
        self.change_lock(bucket, key, version, |lock| {
            lock.may_retain(retention, now_ns(), bypass_governance)
                .map_err(|why| StoreError::ObjectLocked(why.to_string()))?;
            lock.retention = retention;
            Ok(())
        })
        .await
    }

    /// Puts a legal hold on a version or lifts it.
    pub async fn set_object_legal_hold(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        on: bool,
    ) -> Result<Option<String>, StoreError> {
        self.change_lock(bucket, key, version, |lock| {
            lock.legal_hold = on;
            Ok(())
        })
        .await
    }

    async fn change_lock(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        change: impl FnOnce(&mut crate::format::ObjectLock) -> Result<(), StoreError>,
    ) -> Result<Option<String>, StoreError> {
        let brec = self.bucket_record(bucket)?;
        if !brec.object_lock {
            return Err(StoreError::InvalidRequest(
                "Bucket is missing Object Lock Configuration".into(),
            ));
        }
        self.try_update_version(bucket, key, version, |v| {
            let mut lock = v.lock.unwrap_or_default();
            change(&mut lock)?;
            // Kept even when empty: a legal hold lifted reads as OFF.
            v.lock = Some(lock);
            Ok(())
        })
        .await
    }

    /// Changes the metadata of one version (not a delete marker) in place.
    async fn update_version(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        change: impl FnOnce(&mut VersionMeta),
    ) -> Result<Option<String>, StoreError> {
        self.try_update_version(bucket, key, version, |v| {
            change(v);
            Ok(())
        })
        .await
    }

    /// As `update_version`; `change` may refuse (nothing is written then).
    async fn try_update_version(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        change: impl FnOnce(&mut VersionMeta) -> Result<(), StoreError>,
    ) -> Result<Option<String>, StoreError> {
        self.bucket_record(bucket)?;
        validate_key(key)?;
        let _g = self.lock_write(bucket, key).await?;
        let loc = self.locate(bucket, key).await?;
        let (set, mut rec) = (loc.set, loc.rec);
        let (v, _) = self.select_version(&rec, bucket, key, version)?;
        if v.delete_marker {
            return Err(StoreError::MethodNotAllowed);
        }
        let id = (v.version_id, v.mod_time_ns);
        let target = rec
            .versions
            .iter_mut()
            .find(|v| (v.version_id, v.mod_time_ns) == id)
            .expect("selected version");
        change(target)?;
        let vid = version_to_string(&target.version_id);
        self.write_object_everywhere(
            set,
            bucket,
            key,
            ObjectWrite {
                record: Some(rec),
                ..Default::default()
            },
        )
        .await?;
        Ok(vid)
    }
}

impl Store {
    /// Loads many small objects with the same body at once: records are written
    /// in large batches with one fsync per batch instead of one per object.
    /// For imports into new keys and for benchmarks; it does not merge with
    /// existing versions of the keys (they are replaced) and takes no locks.
    pub async fn bulk_load_inline(
        &self,
        bucket: &str,
        keys: Vec<String>,
        body: &[u8],
    ) -> Result<(), StoreError> {
        self.bucket_record(bucket)?;
        if body.len() > self.cfg.inline_threshold_bytes {
            return Err(StoreError::InvalidArgument(
                "bulk load takes inline-sized bodies only".into(),
            ));
        }
        let etag = put::hex(&<md5::Md5 as md5::Digest>::digest(body));
        let crc = crate::checksum::crc32c(body);
        let mut per_set: Vec<Vec<drive::BulkItem>> = vec![Vec::new(); self.set_count()];
        let topo = self.topo();
        for key in keys {
            validate_key(&key)?;
            let set = self.new_key_set(&topo, self.key_hash(bucket, &key));
            let mtime = self.next_mod_time(0);
            let meta = VersionMeta {
                version_id: NULL_VERSION,
                mod_time_ns: mtime,
                delete_marker: false,
                size: body.len() as u64,
                etag: etag.clone(),
                content_type: "binary/octet-stream".into(),
                headers: Vec::new(),
                user_metadata: Vec::new(),
                tags: Vec::new(),
                checksum: None,
                layout: Layout::single_copy(self.cfg.stripe_size_bytes as u32),
                storage: Storage::Inline { crc32c: crc },
                seal: None,
                lock: None,
            };
            let record = ObjectRecord {
                versions: vec![meta],
                stamp: mtime,
            }
            .encode();
            per_set[set].push((key, record, Some((NULL_VERSION, mtime, body.to_vec()))));
        }
        for (set, items) in per_set.into_iter().enumerate() {
            let items = Arc::new(items);
            for chunk_start in (0..items.len()).step_by(50_000) {
                let end = (chunk_start + 50_000).min(items.len());
                let futs = (0..self.set_size(set))
                    .filter_map(|p| self.slot(set, p).writer())
                    .map(|d| {
                        let (b, items) = (bucket.to_string(), items.clone());
                        async move { d.write_objects_bulk(b, items, chunk_start..end).await }
                    });
                for r in futures::future::join_all(futs).await {
                    r?;
                }
            }
        }
        Ok(())
    }
}

/// One index call on each drive in use (None: not in use, answered as
/// offline). The records are small and usually cached, so the drives of
/// this node are all read on one blocking thread (one hand-off beats one per
/// drive); drives of other nodes are called concurrently.
pub(crate) async fn per_drive<T: Send + 'static>(
    drives: &[Option<Arc<dyn Drive>>],
    local: impl Fn(&DriveDb) -> Result<T, StoreError> + Send + 'static,
    remote: impl for<'a> Fn(&'a dyn Drive) -> crate::drive_io::BoxFuture<'a, Result<T, StoreError>>,
) -> Vec<Result<T, StoreError>> {
    let offline = || StoreError::Drive {
        drive: String::new(),
        reason: "offline".into(),
    };
    let mut out: Vec<Result<T, StoreError>> = drives.iter().map(|_| Err(offline())).collect();
    let locals: Vec<(usize, Arc<DriveDb>)> = drives
        .iter()
        .enumerate()
        .filter_map(|(i, d)| Some((i, d.as_ref()?.as_local()?.db.clone())))
        .collect();
    let local_positions: Vec<usize> = locals.iter().map(|(i, _)| *i).collect();
    let local_reads = async move {
        if locals.is_empty() {
            return Ok(Vec::new());
        }
        run_blocking(move || {
            Ok(locals
                .into_iter()
                .map(|(i, db)| (i, local(&db)))
                .collect::<Vec<_>>())
        })
        .await
    };
    let remote_reads = futures::future::join_all(drives.iter().enumerate().filter_map(|(i, d)| {
        let d = d.as_ref()?;
        if d.as_local().is_some() {
            return None;
        }
        let f = remote(&**d);
        Some(async move { (i, f.await) })
    }));
    let (local_results, remote_results) = futures::join!(local_reads, remote_reads);
    match local_results {
        Ok(v) => {
            for (i, r) in v {
                out[i] = r;
            }
        }
        Err(e) => {
            for i in local_positions {
                out[i] = Err(StoreError::Drive {
                    drive: String::new(),
                    reason: e.to_string(),
                });
            }
        }
    }
    for (i, r) in remote_results {
        out[i] = r;
    }
    out
}

/// The (version id, modification time) of the versions stored inline: what
/// a write removes with them (`ObjectWrite::inline_delete`).
pub(crate) fn inline_keys_of(versions: &[VersionMeta]) -> Vec<(Id128, u64)> {
    versions
        .iter()
        .filter(|v| matches!(v.storage, Storage::Inline { .. }))
        .map(|v| (v.version_id, v.mod_time_ns))
        .collect()
}

pub(crate) fn data_ids_of(versions: &[VersionMeta]) -> Vec<Id128> {
    versions
        .iter()
        .flat_map(|v| match &v.storage {
            Storage::Parts(parts) => parts.iter().map(|p| p.data_id).collect(),
            Storage::Inline { .. } => Vec::new(),
        })
        .collect()
}

/// Merges the records of a set of `set_size` drives, one entry per drive
/// asked (`Err`: it did not answer), into the key's record.
///
/// A version is part of it when at least a read quorum of the drives that
/// answered hold it (same id and modification time): a committed version
/// is on a write quorum, and drives never go back to an older record
/// (`ObjectRecord::stamp`), so any read quorum of answers holds it unless a
/// drive that missed it answered too. A version fewer drives hold that the
/// drives that did not answer could still make a write quorum of may have
/// been committed: then the answers cannot tell, and the merge fails
/// (`QuorumLost`, a 503) rather than answer without it. Fewer still (a
/// write that failed before its quorum, or one since replaced) is dropped.
/// Only the newest null version survives; newest first.
///
/// The stamp is the highest any answer holds when the drives holding it
/// hold exactly the merged versions (the record as its writer wrote it);
/// otherwise one above it, so that heal's copy replaces every record it
/// read.
pub(crate) fn resolve(
    records: &[Result<Option<ObjectRecord>, StoreError>],
    set_size: usize,
) -> Result<ObjectRecord, StoreError> {
    let write_quorum = set_size / 2 + 1;
    let read_quorum = set_size - write_quorum + 1;
    let answers: Vec<Option<&ObjectRecord>> = records
        .iter()
        .filter_map(|r| r.as_ref().ok().map(Option::as_ref))
        .collect();
    let silent = set_size.saturating_sub(answers.len());
    if answers.len() < read_quorum {
        return Err(StoreError::QuorumLost {
            what: "metadata read",
            needed: read_quorum,
            available: answers.len(),
        });
    }
    let mut seen: Vec<(&VersionMeta, usize)> = Vec::new();
    for rec in answers.iter().flatten() {
        for v in &rec.versions {
            match seen
                .iter_mut()
                .find(|(x, _)| x.version_id == v.version_id && x.mod_time_ns == v.mod_time_ns)
            {
                Some(e) => e.1 += 1,
                None => seen.push((v, 1)),
            }
        }
    }
    if seen
        .iter()
        .any(|(_, c)| *c < read_quorum && c + silent >= write_quorum)
    {
        return Err(StoreError::QuorumLost {
            what: "metadata read: too few drives answered to tell whether a version held by fewer than a quorum of them was committed",
            needed: set_size,
            available: answers.len(),
        });
    }
    let mut versions: Vec<VersionMeta> = seen
        .into_iter()
        .filter(|(_, c)| *c >= read_quorum)
        .map(|(v, _)| v.clone())
        .collect();
    newest_first(&mut versions);
    let stamp_of = |r: &Option<&ObjectRecord>| r.map_or(0, |r| r.stamp);
    let highest = answers.iter().map(stamp_of).max().unwrap_or(0);
    let written_whole = answers
        .iter()
        .filter(|r| stamp_of(r) == highest)
        .all(|r| r.map_or(versions.is_empty(), |r| r.versions == versions));
    Ok(ObjectRecord {
        versions,
        stamp: if written_whole { highest } else { highest + 1 },
    })
}

/// Orders versions newest first and keeps only the newest null version;
/// returns the older null versions it dropped.
pub(crate) fn newest_first(versions: &mut Vec<VersionMeta>) -> Vec<VersionMeta> {
    versions.sort_by_key(|v| std::cmp::Reverse(v.mod_time_ns));
    let mut null_seen = false;
    let mut dropped = Vec::new();
    let mut kept = Vec::with_capacity(versions.len());
    for v in versions.drain(..) {
        if v.version_id == NULL_VERSION && std::mem::replace(&mut null_seen, true) {
            dropped.push(v);
        } else {
            kept.push(v);
        }
    }
    *versions = kept;
    dropped
}

fn clean_tmp(dir: &std::path::Path) -> std::io::Result<()> {
    match std::fs::read_dir(dir) {
        Ok(rd) => {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir),
        Err(e) => Err(e),
    }
}

fn probe_writable(dir: &std::path::Path) -> std::io::Result<()> {
    let p = dir.join(".probe");
    std::fs::write(&p, b"tarn")?;
    std::fs::remove_file(&p)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::format::test_version as version;

    type Answer = Result<Option<ObjectRecord>, StoreError>;

    fn has(vs: &[(u8, u64)], stamp: u64) -> Answer {
        Ok(Some(ObjectRecord {
            versions: vs.iter().map(|&(i, t)| version(i, t)).collect(),
            stamp,
        }))
    }

    fn silent() -> Answer {
        Err(StoreError::Drive {
            drive: "d".into(),
            reason: "no answer".into(),
        })
    }

    const W: (u8, u64) = (1, 20);
    const OLD: (u8, u64) = (2, 10);

    #[test]
    fn a_committed_version_is_never_resolved_away() {
        // W committed on three of four drives (write quorum); the fourth
        // missed it. Whatever two or three of them answer, W is there, or
        // the answers cannot tell and the read fails: the create that
        // replaced an acknowledged write of issue 40 read two drives, one
        // of which had lost W to a late write, and took W for absent.
        let with = || has(&[W], 20);
        let behind = || has(&[OLD], 10);
        let cases: Vec<Vec<Answer>> = vec![
            vec![with(), with(), with(), behind()],
            vec![with(), with(), silent(), behind()],
            vec![with(), with(), silent(), silent()],
            vec![with(), silent(), silent(), behind()],
            vec![silent(), with(), with(), silent()],
        ];
        for (i, answers) in cases.iter().enumerate() {
            match resolve(answers, 4) {
                Ok(r) => assert_eq!(r.versions, vec![version(W.0, W.1)], "case {i}"),
                Err(StoreError::QuorumLost { .. }) => {
                    assert!(
                        i == 3,
                        "case {i}: only one W among two answers is undecidable"
                    )
                }
                Err(e) => panic!("case {i}: {e}"),
            }
        }
        // One answer holding it and the rest silent: too few to tell.
        assert!(resolve(&[with(), silent(), silent(), silent()], 4).is_err());
    }

    #[test]
    fn writes_that_failed_before_their_quorum_are_dropped_when_the_answers_say_so() {
        let partial = || has(&[(9, 30), OLD], 30);
        let old = || has(&[OLD], 10);
        // Every drive answered: one copy of the failed write cannot be a
        // committed one. Its stamp is the highest seen, so the merge goes
        // one above it (heal's copy replaces it).
        let r = resolve(&[partial(), old(), old(), old()], 4).unwrap();
        assert_eq!(r.versions, vec![version(OLD.0, OLD.1)]);
        assert_eq!(r.stamp, 31);
        // Three answered and the silent one could not make it a quorum.
        let r = resolve(&[partial(), old(), old(), silent()], 4).unwrap();
        assert_eq!(r.versions, vec![version(OLD.0, OLD.1)]);
        // Two answered: it could be on both silent drives, committed.
        assert!(resolve(&[partial(), old(), silent(), silent()], 4).is_err());
    }

    #[test]
    fn the_merge_keeps_the_writers_stamp_and_deletions_keep_theirs() {
        let r = resolve(
            &[has(&[W], 20), has(&[W], 20), has(&[OLD], 10), silent()],
            4,
        )
        .unwrap();
        assert_eq!(r.stamp, 20);
        // A key deleted on a quorum: its tombstone's stamp, drives without
        // any record of it (swept, or never written) agreeing.
        let gone = || Ok(Some(ObjectRecord::tombstone(40)));
        let r = resolve(&[gone(), gone(), Ok(None), has(&[W], 20)], 4).unwrap();
        assert!(r.versions.is_empty());
        assert_eq!(r.stamp, 40);
        let r = resolve(&[Ok(None), Ok(None), Ok(None), silent()], 4).unwrap();
        assert_eq!(r, ObjectRecord::default());
        // A lone drive is its own quorum.
        assert_eq!(resolve(&[has(&[W], 20)], 1).unwrap().versions.len(), 1);
        assert!(resolve(&[silent()], 1).is_err());
    }
}
