//! The engine's view of one drive: `Drive`, implemented here by
//! `LocalDrive` (a drive of this node: its metadata index and shard files)
//! and in `tarn-cluster` by a drive of another node reached over RPC, so
//! that erasure coding, the commit point, verified reads and heal are
//! written once for both.
//!
//! Every method is asynchronous and never blocks a runtime thread: the local
//! drive runs index calls on blocking threads and shard I/O on io_uring.
//! Errors keep what the engine decides on: an `io::Error`'s OS error code
//! (no space left, device errors), a `StoreError`'s kind (a damaged index),
//! a `ShardError`'s kind (missing, short, corrupt).

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;

use tarn_io::file::{rename_durable, run_blocking, sync_dir_async};
use tarn_io::AlignedBuf;

use crate::codec::StripeGeometry;
use crate::drive::{BulkItem, DriveDb, DrivePaths, MissedEntry, MissedPage, ObjectWrite};
use crate::error::StoreError;
use crate::format::{BucketRecord, Id128, ObjectRecord, UploadPartRecord, UploadRecord};
use crate::lock::{LeaseCall, LeaseTable};
use crate::shard::{ShardError, ShardReader, ShardWriter};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a new shard file is written: in place (a new write: nothing refers
/// to it until its metadata commits) or in the drive's tmp directory (a
/// rebuild, renamed into place by `commit_shard` once complete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardPlace {
    Final,
    Tmp,
}

/// Object entries of a bucket in key order: (key, encoded record).
pub type ListEntries = Vec<(String, Vec<u8>)>;

/// A drive as its own node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriveState {
    /// Not in service: it takes nothing and serves nothing.
    Offline,
    /// In service, its index being rebuilt: it takes writes and serves its
    /// shard files, but answers no metadata reads.
    Rebuilding,
    /// In service with a complete index.
    Ready,
}

/// One drive, wherever it is.
pub trait Drive: Send + Sync {
    /// Names the drive in logs: its path, or node and path.
    fn name(&self) -> &str;

    /// This node's drive, for callers that batch index calls of several
    /// local drives on one blocking thread.
    fn as_local(&self) -> Option<&LocalDrive> {
        None
    }

    /// How its node sees it (a drive of this node: in service, as the
    /// engine holds it only while it is).
    fn state(&self) -> BoxFuture<'_, Result<DriveState, StoreError>> {
        Box::pin(async { Ok(DriveState::Ready) })
    }

    fn buckets(&self) -> BoxFuture<'_, Result<Vec<(String, BucketRecord)>, StoreError>>;
    fn put_bucket(&self, name: String, rec: BucketRecord) -> BoxFuture<'_, Result<(), StoreError>>;
    fn delete_bucket(&self, name: String) -> BoxFuture<'_, Result<(), StoreError>>;
    fn bucket_has_entries(
        &self,
        bucket: String,
        uploads: bool,
    ) -> BoxFuture<'_, Result<bool, StoreError>>;

    fn object(
        &self,
        bucket: String,
        key: String,
    ) -> BoxFuture<'_, Result<Option<ObjectRecord>, StoreError>>;
    fn write_object(
        &self,
        bucket: String,
        key: String,
        w: Arc<ObjectWrite>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    /// Items `range` of `items`, in one batch with one persist.
    fn write_objects_bulk(
        &self,
        bucket: String,
        items: Arc<Vec<BulkItem>>,
        range: Range<usize>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    fn inline_data(
        &self,
        bucket: String,
        key: String,
        version: Id128,
        mod_time_ns: u64,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, StoreError>>;
    /// Up to `limit` object entries of `bucket` whose keys start with
    /// `prefix`, from key bytes `from` (inclusive) on.
    fn list_page(
        &self,
        bucket: String,
        prefix: String,
        from: Option<Vec<u8>>,
        limit: usize,
    ) -> BoxFuture<'_, Result<ListEntries, StoreError>>;

    fn put_upload(
        &self,
        bucket: String,
        key: String,
        rec: UploadRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    fn upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
    ) -> BoxFuture<'_, Result<Option<UploadRecord>, StoreError>>;
    fn delete_upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
        parts: Vec<u32>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    fn scan_uploads(
        &self,
        bucket: String,
        prefix: String,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<(String, UploadRecord)>, StoreError>>;
    fn put_part(
        &self,
        upload_id: Id128,
        part: UploadPartRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
    fn parts(&self, upload_id: Id128) -> BoxFuture<'_, Result<Vec<UploadPartRecord>, StoreError>>;
    /// Every object key of `bucket` on the drive (the heal scanner's walk).
    fn all_object_keys(&self, bucket: String) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;
    /// Every data id an object version or upload part on the drive refers to.
    fn referenced_data_ids(&self) -> BoxFuture<'_, Result<HashSet<Id128>, StoreError>>;

    /// Starts a shard file of `data_id` holding shard `shard_index`.
    fn create_shard(
        &self,
        data_id: Id128,
        shard_index: u8,
        place: ShardPlace,
    ) -> BoxFuture<'_, io::Result<Box<dyn ShardSink>>>;
    /// Moves a complete tmp shard file into place as `data_id`'s, durably.
    fn commit_shard(&self, tmp_id: Id128, data_id: Id128) -> BoxFuture<'_, io::Result<()>>;
    /// Opens `data_id`'s shard file, checking its length against `geometry`.
    fn open_shard(
        &self,
        data_id: Id128,
        geometry: StripeGeometry,
    ) -> BoxFuture<'_, Result<Box<dyn ShardSource>, ShardError>>;
    /// Removes shard files, in place and in tmp (best effort: what is left
    /// is an orphan the sweep collects).
    fn remove_shards(&self, data_ids: Vec<Id128>) -> BoxFuture<'_, ()>;

    /// A call on the drive's lease table: its vote in locks across nodes,
    /// and pins of the shard data readers stream (`lock::LeaseCall`).
    fn lease(&self, call: LeaseCall) -> BoxFuture<'_, Result<bool, StoreError>>;

    /// The missed-write log (`DriveDb::log_missed`, `missed`,
    /// `clear_missed`).
    fn log_missed(&self, entries: Arc<Vec<MissedEntry>>) -> BoxFuture<'_, Result<(), StoreError>>;
    fn missed(
        &self,
        position: u8,
        after: Option<Vec<u8>>,
        max: usize,
    ) -> BoxFuture<'_, Result<MissedPage, StoreError>>;
    fn clear_missed(
        &self,
        position: u8,
        done: Vec<(String, String, u64)>,
        before: Option<u64>,
    ) -> BoxFuture<'_, Result<(), StoreError>>;
}

/// A shard file being written, block by block.
pub trait ShardSink: Send {
    /// Appends a block; gives the buffer back either way.
    fn write_block(&mut self, buf: AlignedBuf) -> BoxFuture<'_, (io::Result<()>, AlignedBuf)>;
    /// Writes the checksum table and footer and makes the file durable,
    /// its directory entry included.
    fn finish(self: Box<Self>) -> BoxFuture<'static, io::Result<()>>;
}

/// A shard file being read: blocks checked against their checksums.
pub trait ShardSource: Send {
    /// Loads the checksums of blocks `first..=last` (before reading them).
    fn load_checksums(&mut self, first: u64, last: u64) -> BoxFuture<'_, Result<(), ShardError>>;
    /// Reads block `j` into `buf` and verifies it.
    fn read_block(
        &mut self,
        j: u64,
        buf: AlignedBuf,
    ) -> BoxFuture<'_, (Result<(), ShardError>, AlignedBuf)>;
    /// Checks the footer, the table and every block (heal's deep check).
    fn verify_all(&mut self, shard_index: u8) -> BoxFuture<'_, Result<(), ShardError>>;
    /// The file block `j` is in and the block's offset there, when the
    /// shard is a file of this node (a GET then sends the block's bytes
    /// from the file: `tarn_io::spans`).
    fn block_file(&self, _j: u64) -> Option<(Arc<std::os::fd::OwnedFd>, u64)> {
        None
    }
    /// Block `j`'s checksum, when loaded.
    fn block_crc(&self, _j: u64) -> Option<u32> {
        None
    }
}

/// A drive of this node.
pub struct LocalDrive {
    pub db: Arc<DriveDb>,
    pub paths: DrivePaths,
    name: String,
    leases: Arc<LeaseTable>,
}

impl LocalDrive {
    /// A drive with a lease table of its own.
    pub fn new(db: Arc<DriveDb>, paths: DrivePaths) -> LocalDrive {
        let leases = Arc::new(LeaseTable::new(paths.clone()));
        LocalDrive::with_leases(db, paths, leases)
    }

    /// A drive whose lease table outlives it (the engine's drive slot keeps
    /// it while the drive leaves and rejoins).
    pub fn with_leases(db: Arc<DriveDb>, paths: DrivePaths, leases: Arc<LeaseTable>) -> LocalDrive {
        let name = paths.root.display().to_string();
        LocalDrive {
            db,
            paths,
            name,
            leases,
        }
    }

    /// Its locks and pins as every node asks for them.
    pub fn leases(&self) -> &Arc<LeaseTable> {
        &self.leases
    }

    /// Runs an index call on a blocking thread.
    fn index<T: Send + 'static>(
        &self,
        f: impl FnOnce(&DriveDb) -> Result<T, StoreError> + Send + 'static,
    ) -> BoxFuture<'static, Result<T, StoreError>> {
        let db = self.db.clone();
        Box::pin(async move {
            run_blocking(move || Ok(f(&db)))
                .await
                .map_err(StoreError::from)?
        })
    }
}

impl Drive for LocalDrive {
    fn name(&self) -> &str {
        &self.name
    }

    fn as_local(&self) -> Option<&LocalDrive> {
        Some(self)
    }

    fn buckets(&self) -> BoxFuture<'_, Result<Vec<(String, BucketRecord)>, StoreError>> {
        self.index(|db| db.buckets())
    }

    fn put_bucket(&self, name: String, rec: BucketRecord) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.put_bucket(&name, &rec))
    }

    fn delete_bucket(&self, name: String) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.delete_bucket(&name))
    }

    fn bucket_has_entries(
        &self,
        bucket: String,
        uploads: bool,
    ) -> BoxFuture<'_, Result<bool, StoreError>> {
        self.index(move |db| db.bucket_has_entries(&bucket, uploads))
    }

    fn object(
        &self,
        bucket: String,
        key: String,
    ) -> BoxFuture<'_, Result<Option<ObjectRecord>, StoreError>> {
        self.index(move |db| db.object(&bucket, &key))
    }

    fn write_object(
        &self,
        bucket: String,
        key: String,
        w: Arc<ObjectWrite>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        // Committed on a blocking thread, then made durable with the
        // drive's other writers without holding one.
        Box::pin(async move {
            let ticket = self
                .index(move |db| db.write_object_visible(&bucket, &key, &w))
                .await?;
            self.db.durable(ticket, "commit object").await
        })
    }

    fn write_objects_bulk(
        &self,
        bucket: String,
        items: Arc<Vec<BulkItem>>,
        range: Range<usize>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| match items.get(range) {
            Some(items) => db.write_objects_bulk(&bucket, items),
            None => Err(StoreError::InvalidArgument(
                "bulk range out of bounds".into(),
            )),
        })
    }

    fn inline_data(
        &self,
        bucket: String,
        key: String,
        version: Id128,
        mod_time_ns: u64,
    ) -> BoxFuture<'_, Result<Option<Vec<u8>>, StoreError>> {
        self.index(move |db| db.inline_data(&bucket, &key, &version, mod_time_ns))
    }

    fn list_page(
        &self,
        bucket: String,
        prefix: String,
        from: Option<Vec<u8>>,
        limit: usize,
    ) -> BoxFuture<'_, Result<ListEntries, StoreError>> {
        self.index(move |db| {
            db.object_cursor(&bucket, &prefix, from.as_deref())
                .take(limit)
                .collect()
        })
    }

    fn put_upload(
        &self,
        bucket: String,
        key: String,
        rec: UploadRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.put_upload(&bucket, &key, &rec))
    }

    fn upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
    ) -> BoxFuture<'_, Result<Option<UploadRecord>, StoreError>> {
        self.index(move |db| db.upload(&bucket, &key, &upload_id))
    }

    fn delete_upload(
        &self,
        bucket: String,
        key: String,
        upload_id: Id128,
        parts: Vec<u32>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.delete_upload(&bucket, &key, &upload_id, &parts))
    }

    fn scan_uploads(
        &self,
        bucket: String,
        prefix: String,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<(String, UploadRecord)>, StoreError>> {
        self.index(move |db| db.scan_uploads(&bucket, &prefix, limit))
    }

    fn put_part(
        &self,
        upload_id: Id128,
        part: UploadPartRecord,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.put_part(&upload_id, &part))
    }

    fn parts(&self, upload_id: Id128) -> BoxFuture<'_, Result<Vec<UploadPartRecord>, StoreError>> {
        self.index(move |db| db.parts(&upload_id))
    }

    fn all_object_keys(&self, bucket: String) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        self.index(move |db| db.all_object_keys(&bucket))
    }

    fn referenced_data_ids(&self) -> BoxFuture<'_, Result<HashSet<Id128>, StoreError>> {
        self.index(|db| db.referenced_data_ids())
    }

    fn create_shard(
        &self,
        data_id: Id128,
        shard_index: u8,
        place: ShardPlace,
    ) -> BoxFuture<'_, io::Result<Box<dyn ShardSink>>> {
        let path = match place {
            ShardPlace::Final => self.paths.shard(&data_id),
            ShardPlace::Tmp => self.paths.tmp_shard(&data_id),
        };
        Box::pin(async move {
            let parent = path.parent().unwrap_or(&path).to_path_buf();
            let writer = remade_dir(&parent, || ShardWriter::create(&path, shard_index)).await?;
            // A file in place needs its directory entry durable too.
            let dir = match place {
                ShardPlace::Final => path.parent().map(std::path::Path::to_path_buf),
                ShardPlace::Tmp => None,
            };
            Ok(Box::new(LocalShardSink { writer, dir }) as Box<dyn ShardSink>)
        })
    }

    fn commit_shard(&self, tmp_id: Id128, data_id: Id128) -> BoxFuture<'_, io::Result<()>> {
        let (from, to) = (self.paths.tmp_shard(&tmp_id), self.paths.shard(&data_id));
        Box::pin(async move {
            let parent = to.parent().unwrap_or(&to).to_path_buf();
            remade_dir(&parent, || rename_durable(from.clone(), to.clone())).await
        })
    }

    fn open_shard(
        &self,
        data_id: Id128,
        geometry: StripeGeometry,
    ) -> BoxFuture<'_, Result<Box<dyn ShardSource>, ShardError>> {
        let path = self.paths.shard(&data_id);
        Box::pin(async move {
            let r = ShardReader::open(&path, geometry).await?;
            Ok(Box::new(r) as Box<dyn ShardSource>)
        })
    }

    fn remove_shards(&self, data_ids: Vec<Id128>) -> BoxFuture<'_, ()> {
        Box::pin(self.leases.remove_unpinned(data_ids))
    }

    fn lease(&self, call: LeaseCall) -> BoxFuture<'_, Result<bool, StoreError>> {
        Box::pin(self.leases.call(call))
    }

    fn log_missed(&self, entries: Arc<Vec<MissedEntry>>) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.log_missed(&entries))
    }

    fn missed(
        &self,
        position: u8,
        after: Option<Vec<u8>>,
        max: usize,
    ) -> BoxFuture<'_, Result<MissedPage, StoreError>> {
        self.index(move |db| db.missed(position, after.as_deref(), max))
    }

    fn clear_missed(
        &self,
        position: u8,
        done: Vec<(String, String, u64)>,
        before: Option<u64>,
    ) -> BoxFuture<'_, Result<(), StoreError>> {
        self.index(move |db| db.clear_missed(position, &done, before))
    }
}

struct LocalShardSink {
    writer: ShardWriter,
    dir: Option<std::path::PathBuf>,
}

impl ShardSink for LocalShardSink {
    fn write_block(&mut self, buf: AlignedBuf) -> BoxFuture<'_, (io::Result<()>, AlignedBuf)> {
        Box::pin(self.writer.write_block(buf))
    }

    fn finish(self: Box<Self>) -> BoxFuture<'static, io::Result<()>> {
        Box::pin(async move {
            let LocalShardSink { writer, dir } = *self;
            match dir {
                // The file's fsync and its directory entry's in parallel.
                Some(dir) => {
                    let (file, entry) = futures::join!(writer.finish(), sync_dir_async(&dir));
                    file.and(entry)
                }
                None => writer.finish().await,
            }
        })
    }
}

impl ShardSource for ShardReader {
    fn load_checksums(&mut self, first: u64, last: u64) -> BoxFuture<'_, Result<(), ShardError>> {
        Box::pin(ShardReader::load_checksums(self, first, last))
    }

    fn read_block(
        &mut self,
        j: u64,
        buf: AlignedBuf,
    ) -> BoxFuture<'_, (Result<(), ShardError>, AlignedBuf)> {
        Box::pin(ShardReader::read_block(self, j, buf))
    }

    fn verify_all(&mut self, shard_index: u8) -> BoxFuture<'_, Result<(), ShardError>> {
        Box::pin(ShardReader::verify_all(self, shard_index))
    }

    fn block_file(&self, j: u64) -> Option<(Arc<std::os::fd::OwnedFd>, u64)> {
        Some(ShardReader::block_file(self, j))
    }

    fn block_crc(&self, j: u64) -> Option<u32> {
        ShardReader::block_crc(self, j)
    }
}

/// Runs `op`, and once more after making `dir` again if `op` failed because
/// `dir` (one of a drive's fan-out directories) is gone: someone removed it
/// by hand, and heal and new writes should put shards back, not fail.
async fn remade_dir<T, F, Fut>(dir: &std::path::Path, op: F) -> io::Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = io::Result<T>>,
{
    match op().await {
        Err(e) if e.kind() == io::ErrorKind::NotFound && !dir.exists() => {
            tracing::warn!(dir = %dir.display(), "a drive directory was missing: made again");
            let d = dir.to_path_buf();
            run_blocking(move || {
                std::fs::create_dir_all(&d)?;
                match d.parent() {
                    Some(p) => tarn_io::file::sync_dir(p),
                    None => Ok(()),
                }
            })
            .await?;
            op().await
        }
        r => r,
    }
}
