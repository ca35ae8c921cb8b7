//! Values the engine hands to and takes from its callers (the S3 layer).

use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;

use crate::error::StoreError;
use crate::format::{Durability, Versioning};

pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, StoreError>> + Send>>;

/// Called once the whole body was read and before the commit point: verifies
/// checksums only known at the end (trailers) and returns the checksum to store.
pub type BodyFinish = Box<dyn FnOnce() -> Result<Option<(String, String)>, StoreError> + Send>;

pub struct ObjectBody {
    pub stream: BodyStream,
    /// Declared length (Content-Length or x-amz-decoded-content-length), checked.
    pub declared_len: Option<u64>,
    pub finish: Option<BodyFinish>,
}

impl ObjectBody {
    pub fn from_bytes(data: impl Into<Bytes>) -> Self {
        let data: Bytes = data.into();
        let len = data.len() as u64;
        ObjectBody {
            stream: Box::pin(futures::stream::iter([Ok(data)])),
            declared_len: Some(len),
            finish: None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct PutOptions {
    pub content_type: Option<String>,
    pub headers: Vec<(String, String)>,
    pub user_metadata: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
    pub content_md5: Option<[u8; 16]>,
    /// A checksum the client declared up front, already verified by the caller's
    /// body wrapper; stored and returned on GET/HEAD.
    pub checksum: Option<(String, String)>,
    /// Conditional write (If-Match / If-None-Match as sent, `*` or ETags):
    /// fails with PreconditionFailed unless a current version exists and
    /// matches `if_match`, and unless no current version matches
    /// `if_none_match` (`*` matches any).
    pub if_match: Option<String>,
    pub if_none_match: Option<String>,
    /// CreateMultipartUpload: the checksum type of the upload (with its
    /// algorithm). CompleteMultipartUpload: the type the client declared,
    /// which must be the upload's.
    pub checksum_type: Option<crate::checksum::ChecksumType>,
    /// CompleteMultipartUpload: (part number, algorithm, base64 value) the
    /// client listed for its parts; each must be what the part was uploaded
    /// with. (`checksum`, there, is the whole object's checksum the client
    /// expects, checked against the one formed from the parts.)
    pub part_checksums: Vec<(u32, String, String)>,
    /// Encrypt the body with this data key (`crate::seal`).
    pub seal: Option<crate::seal::SealSpec>,
    /// The new version's object lock (retention, legal hold). Only in a
    /// bucket with object lock enabled.
    pub lock: Option<crate::format::ObjectLock>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketInfo {
    pub name: String,
    pub created_ns: u64,
    pub durability: Durability,
    pub versioning: Versioning,
    pub object_lock: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartSummary {
    pub number: u32,
    pub size: u64,
    pub etag: String,
    /// The part's own checksum (algorithm, base64), when it was uploaded with one.
    pub checksum: Option<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub bucket: String,
    pub key: String,
    /// None for the null version.
    pub version_id: Option<String>,
    pub is_latest: bool,
    pub delete_marker: bool,
    pub size: u64,
    pub etag: String,
    pub last_modified_ns: u64,
    pub content_type: String,
    pub headers: Vec<(String, String)>,
    pub user_metadata: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
    pub checksum: Option<(String, String)>,
    pub parts: Vec<PartSummary>,
    /// Retention and legal hold (object lock), if any.
    pub lock: Option<crate::format::ObjectLock>,
}

impl ObjectInfo {
    /// Byte range [start, end) of part `n`. An object written in one piece has
    /// exactly part 1.
    pub fn part_range(&self, n: u32) -> Result<(u64, u64), StoreError> {
        if self.parts.is_empty() {
            return if n == 1 {
                Ok((0, self.size))
            } else {
                Err(StoreError::InvalidPartNumber)
            };
        }
        let mut offset = 0;
        for p in &self.parts {
            if p.number == n {
                return Ok((offset, offset + p.size));
            }
            offset += p.size;
        }
        Err(StoreError::InvalidPartNumber)
    }

    /// How many parts the object has (1 for one written in one piece).
    pub fn parts_count(&self) -> u32 {
        self.parts.len().max(1) as u32
    }
}

/// Conditional-read headers, evaluated on the version before any byte is read
/// (RFC 9110 order: If-Match, else If-Unmodified-Since; then If-None-Match,
/// else If-Modified-Since). Times are whole seconds since the epoch.
#[derive(Debug, Clone, Default)]
pub struct ReadConditions {
    /// `Some("*")` matches any version.
    pub if_match: Option<String>,
    pub if_none_match: Option<String>,
    pub if_modified_since_s: Option<i64>,
    pub if_unmodified_since_s: Option<i64>,
}

impl ReadConditions {
    pub fn check(&self, info: &ObjectInfo) -> Result<(), StoreError> {
        let matches = |c: &str| c == "*" || c.trim_matches('"') == info.etag;
        let modified = (info.last_modified_ns / 1_000_000_000) as i64;
        if let Some(c) = &self.if_match {
            if !matches(c) {
                return Err(StoreError::PreconditionFailed("If-Match"));
            }
        } else if let Some(t) = self.if_unmodified_since_s {
            if modified > t {
                return Err(StoreError::PreconditionFailed("If-Unmodified-Since"));
            }
        }
        let not_modified = || StoreError::NotModified {
            etag: info.etag.clone(),
        };
        if let Some(c) = &self.if_none_match {
            if matches(c) {
                return Err(not_modified());
            }
        } else if let Some(t) = self.if_modified_since_s {
            if modified <= t {
                return Err(not_modified());
            }
        }
        Ok(())
    }
}

/// A byte range as requested; resolved against the object size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteRange {
    /// bytes=a-b (inclusive)
    Closed(u64, u64),
    /// bytes=a-
    From(u64),
    /// bytes=-n
    Suffix(u64),
}

impl ByteRange {
    /// Half-open [start, end) within an object of `size` bytes.
    pub fn resolve(&self, size: u64) -> Result<(u64, u64), StoreError> {
        match *self {
            ByteRange::Closed(a, b) if a <= b && a < size => Ok((a, (b + 1).min(size))),
            ByteRange::From(a) if a < size => Ok((a, size)),
            ByteRange::Suffix(n) if n > 0 && size > 0 => Ok((size - n.min(size), size)),
            _ => Err(StoreError::InvalidRange),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ListParams {
    pub prefix: String,
    pub delimiter: Option<String>,
    /// Exclusive start (marker / start-after / decoded continuation token).
    pub after: Option<String>,
    pub max_keys: usize,
}

#[derive(Debug, Clone, Default)]
pub struct ListPage {
    pub objects: Vec<ObjectInfo>,
    pub common_prefixes: Vec<String>,
    pub is_truncated: bool,
    /// Last key or prefix returned, for the next page's `after`.
    pub next_after: Option<String>,
}

#[derive(Debug, Clone, Default)]
pub struct VersionListParams {
    pub prefix: String,
    pub delimiter: Option<String>,
    pub key_marker: Option<String>,
    pub version_id_marker: Option<String>,
    pub max_keys: usize,
}

#[derive(Debug, Clone, Default)]
pub struct VersionListPage {
    pub versions: Vec<ObjectInfo>,
    pub common_prefixes: Vec<String>,
    pub is_truncated: bool,
    pub next_key_marker: Option<String>,
    pub next_version_id_marker: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteResult {
    pub delete_marker: bool,
    pub version_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct UploadInfo {
    pub bucket: String,
    pub key: String,
    pub upload_id: String,
    pub initiated_ns: u64,
    /// The headers the upload was created with (the object's to be).
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
pub struct PartInfo {
    pub number: u32,
    pub size: u64,
    pub etag: String,
    pub last_modified_ns: u64,
    pub checksum: Option<(String, String)>,
}

#[derive(Debug, Clone, Default)]
pub struct HealReport {
    pub objects_scanned: u64,
    pub objects_healed: u64,
    pub shards_rebuilt: u64,
    pub metadata_rewritten: u64,
    pub buckets_healed: u64,
    /// Shard files no metadata refers to, removed after the grace period.
    pub orphans_removed: u64,
    pub failures: u64,
    /// Of the failures, drives an object's record could not be written to.
    pub metadata_failures: u64,
    /// Bytes of the object versions healed or found whole.
    pub bytes_scanned: u64,
}

/// How far a heal pass has come, readable while it runs (`Store::heal_with`).
#[derive(Debug, Default)]
pub struct HealProgress {
    /// 0 counting objects, 1 healing them, 2 sweeping orphans, 3 done.
    pub phase: std::sync::atomic::AtomicU8,
    /// Objects the pass found to heal (known once counting ends).
    pub objects_total: std::sync::atomic::AtomicU64,
    pub objects_done: std::sync::atomic::AtomicU64,
    pub objects_healed: std::sync::atomic::AtomicU64,
    pub failures: std::sync::atomic::AtomicU64,
    pub bytes_scanned: std::sync::atomic::AtomicU64,
}

impl HealProgress {
    pub const COUNTING: u8 = 0;
    pub const HEALING: u8 = 1;
    pub const SWEEPING: u8 = 2;
    pub const DONE: u8 = 3;

    pub fn phase_name(&self) -> &'static str {
        match self.phase.load(std::sync::atomic::Ordering::Relaxed) {
            Self::COUNTING => "counting",
            Self::HEALING => "healing",
            Self::SWEEPING => "sweeping orphans",
            _ => "done",
        }
    }
}

#[derive(Debug, Clone)]
pub struct DriveStatus {
    pub path: String,
    pub set_index: usize,
    pub online: bool,
    /// Taken out while running after an I/O error (retried until it works).
    pub faulty: bool,
    /// In use, but below its free-space reserve: no new data goes to it.
    pub full: bool,
    /// In use, its index being rebuilt by heal: takes writes, answers no
    /// metadata reads yet.
    pub rebuilding: bool,
    /// Back after an absence: takes writes, serves no metadata reads until
    /// the writes it missed are replayed to it.
    pub syncing: bool,
    pub reason: Option<String>,
    /// Free and total bytes of the drive's filesystem (this node's drives;
    /// None for another node's or when they cannot be read).
    pub space: Option<(u64, u64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(ByteRange::Closed(0, 9).resolve(100).unwrap(), (0, 10));
        assert_eq!(ByteRange::Closed(90, 200).resolve(100).unwrap(), (90, 100));
        assert_eq!(ByteRange::From(99).resolve(100).unwrap(), (99, 100));
        assert_eq!(ByteRange::Suffix(10).resolve(100).unwrap(), (90, 100));
        assert_eq!(ByteRange::Suffix(1000).resolve(100).unwrap(), (0, 100));
        assert!(ByteRange::From(100).resolve(100).is_err());
        assert!(ByteRange::Closed(5, 4).resolve(100).is_err());
        assert!(ByteRange::Suffix(0).resolve(100).is_err());
        assert!(ByteRange::From(0).resolve(0).is_err());
    }
}

/// What a lifecycle expiry requires of a key when it acts
/// (`Store::expire_if_unchanged`); versions by their S3 id (`null` too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unchanged {
    /// The current version is still this one (not a delete marker), not
    /// rewritten since.
    Current { version: String, mod_time_ns: u64 },
    /// This version is still there and not the current one.
    Version { version: String },
    /// This delete marker is the key's only version.
    SoleDeleteMarker { version: String },
}
