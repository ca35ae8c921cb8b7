//! Errors of the object engine. The S3 layer maps each to one S3 error code.

/// Clone, so that one failure of a commit shared by several writers
/// (`store::commit`) reaches each of them.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("bucket {0} does not exist")]
    NoSuchBucket(String),
    #[error("bucket {0} already exists")]
    BucketExists(String),
    #[error("bucket {0} is not empty")]
    BucketNotEmpty(String),
    #[error("invalid bucket name {0:?}")]
    InvalidBucketName(String),
    #[error("key {0:?} is not a valid object key")]
    InvalidKey(String),
    #[error("no such key {bucket}/{key}")]
    NoSuchKey { bucket: String, key: String },
    #[error("no such version {version} of {bucket}/{key}")]
    NoSuchVersion {
        bucket: String,
        key: String,
        version: String,
    },
    #[error("the latest version of {bucket}/{key} is a delete marker")]
    DeleteMarker {
        bucket: String,
        key: String,
        version: Option<String>,
    },
    #[error("method not allowed on a delete marker")]
    MethodNotAllowed,
    /// Object lock keeps the version: it cannot be deleted, replaced or
    /// have its retention loosened (the reason says which lock).
    #[error("Access Denied because object protected by object lock: {0}")]
    ObjectLocked(String),
    /// The bucket's state forbids the change (S3's 409 InvalidBucketState),
    /// e.g. suspending versioning on a bucket with object lock.
    #[error("{0}")]
    InvalidBucketState(String),
    #[error("no such upload {0}")]
    NoSuchUpload(String),
    #[error("part {0} was not uploaded or its ETag does not match")]
    InvalidPart(u32),
    #[error("parts are not in ascending order")]
    InvalidPartOrder,
    #[error("part {number} is {size} bytes, below the minimum {min} for all but the last part")]
    EntityTooSmall { number: u32, size: u64, min: u64 },
    #[error("object too large: {size} bytes, limit {max}")]
    EntityTooLarge { size: u64, max: u64 },
    /// The named condition (`If-Match`, `If-None-Match`,
    /// `If-Unmodified-Since`, ...) did not hold; S3 names it in the error.
    #[error("precondition failed: {0}")]
    PreconditionFailed(&'static str),
    #[error("not modified")]
    NotModified { etag: String },
    #[error("requested range not satisfiable")]
    InvalidRange,
    #[error("The requested partnumber is not satisfiable")]
    InvalidPartNumber,
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The cluster's catalog (etcd) could not be reached or refused.
    #[error("cluster catalog unavailable: {0}")]
    Catalog(String),
    /// A request that is well-formed but cannot be served as asked (S3's
    /// InvalidRequest), e.g. a part without the checksum its upload requires.
    #[error("{0}")]
    InvalidRequest(String),
    #[error("Content-MD5 does not match the body")]
    BadDigest,
    #[error("checksum {algorithm} does not match the body")]
    ChecksumMismatch { algorithm: String },
    #[error("body length {actual} does not match the declared length {declared}")]
    IncompleteBody { declared: u64, actual: u64 },
    #[error("reading the request body failed: {0}")]
    Body(String),
    /// A chunk of a signed streaming body failed its signature.
    #[error("a chunk signature of the body does not match")]
    BodySignature,
    /// The body does not hash to the SHA-256 its request was signed with.
    #[error("the body does not match its declared SHA-256")]
    BodyHash,
    /// The client stopped sending the body for longer than the idle timeout.
    #[error("the client sent no body for too long: {0}")]
    RequestTimeout(String),
    /// Too few drives of the set have room beyond their free-space reserve
    /// for new data (the reserve is kept for reads, DELETEs and repair).
    #[error("storage full: {0}")]
    StorageFull(String),
    #[error("not enough drives: {what} needs {needed}, {available} available")]
    QuorumLost {
        what: &'static str,
        needed: usize,
        available: usize,
    },
    #[error("object {bucket}/{key} cannot be read: {reason}")]
    Unreadable {
        bucket: String,
        key: String,
        reason: String,
    },
    #[error("drive {drive}: {reason}")]
    Drive { drive: String, reason: String },
    #[error("drive {drive} is in use by another tarn process ({holder}); stop it first")]
    DriveInUse { drive: String, holder: String },
    /// The drive's metadata index itself failed its checksums or does not
    /// parse (as opposed to one record in it): the index is set aside and
    /// rebuilt by heal.
    #[error("metadata index of {drive} is corrupt: {reason}")]
    IndexCorrupt { drive: String, reason: String },
    #[error("corrupt metadata on {drive}: {what}")]
    CorruptMetadata { drive: String, what: String },
    /// A drive refused a record older than the one it holds for the key
    /// (see `ObjectRecord::stamp`): the write reached it after a newer
    /// one. Not a fault of the drive; the writer counts it as a drive the
    /// write missed.
    #[error("drive {drive} holds a newer record of {what} (stamp {held}, offered {offered})")]
    Superseded {
        drive: String,
        what: String,
        held: u64,
        offered: u64,
    },
    /// A drive of another node did not answer in time, its node not (yet)
    /// found silent: the call failed, the drive stays in service (a write
    /// counts it as missed, a read as not answering).
    #[error("drive {drive} did not answer in time: {reason}")]
    Late { drive: String, reason: String },
    #[error("server busy: {0}")]
    SlowDown(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(std::sync::Arc<std::io::Error>),
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(std::sync::Arc::new(e))
    }
}

impl From<tarn_io::PoolExhausted> for StoreError {
    fn from(e: tarn_io::PoolExhausted) -> Self {
        StoreError::SlowDown(e.to_string())
    }
}
