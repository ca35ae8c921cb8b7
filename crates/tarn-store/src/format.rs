//! Self-describing binary records: the metadata Tarn keeps on every drive.
//!
//! Every record is an envelope:
//!
//! ```text
//! offset size  field
//! 0      4     magic "TRNM"
//! 4      2     format version, u16 LE (FORMAT_VERSION)
//! 6      1     record kind (RecordKind)
//! 7      1     flags, 0
//! 8      4     payload length N, u32 LE
//! 12     N     payload (fields below, little-endian, strings as u32 length + UTF-8)
//! 12+N   4     CRC32C of bytes [0, 12+N), u32 LE
//! ```
//!
//! Decoding never panics on bad bytes: every length is bounds-checked against the
//! input and the named maxima below, and any mismatch is a `FormatError`.
//! `docs/format.md` holds the byte layout of each payload and the version history.

use crate::checksum::crc32c;

pub const MAGIC: [u8; 4] = *b"TRNM";
/// Version 1: the first format. Version 2: each part of a multipart object
/// keeps its checksum, and an upload in progress its checksum type.
/// Version 3: an object record carries its stamp, and a deleted key keeps
/// an empty record (a tombstone) with one. Version 4: encrypted versions
/// (each version says whether it is sealed, and with which part salts) and
/// encrypted upload parts (their salt). Records with nothing encrypted are
/// still written as version 3, so builds before encryption read them.
/// Version 5: object lock (a version's retention and legal hold; a
/// bucket's object-lock flag). Only records holding a lock are written as
/// 5: a build that cannot enforce a lock refuses the record instead of
/// letting its version be deleted.
pub const FORMAT_VERSION: u16 = 5;
/// The version written when a record needs nothing newer.
const BASE_VERSION: u16 = 3;
const HEADER_BYTES: usize = 12;
const TRAILER_BYTES: usize = 4;

/// Largest payload a record may declare (an object record with many versions).
pub const RECORD_PAYLOAD_MAX_BYTES: usize = 64 << 20;
/// Largest string field (keys are at most 1024 bytes; metadata values are bounded
/// by the 8 KiB S3 header budget; ETags and checksums are short).
pub const STRING_MAX_BYTES: usize = 64 << 10;
/// Most entries in any list field (metadata pairs, tags, parts, versions).
pub const LIST_MAX_ENTRIES: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    Bucket = 1,
    Object = 2,
    Upload = 3,
    UploadPart = 4,
    DriveFormat = 5,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("record truncated: needed {needed} bytes at offset {offset}, have {have}")]
    Truncated {
        offset: usize,
        needed: usize,
        have: usize,
    },
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unsupported format version {0} (this build reads up to {FORMAT_VERSION})")]
    UnsupportedVersion(u16),
    #[error("record kind {found} where {expected:?} was expected")]
    WrongKind { expected: RecordKind, found: u8 },
    #[error("checksum mismatch: stored {stored:08x}, computed {computed:08x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("{field} is {len}, above the maximum {max}")]
    TooLarge {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("invalid value in {0}")]
    Invalid(&'static str),
    #[error("{0} trailing bytes after the payload")]
    TrailingBytes(usize),
}

/// Appends little-endian fields to a payload.
#[derive(Default)]
pub struct Encoder {
    buf: Vec<u8>,
    /// The format version the fields written need (at least `BASE_VERSION`).
    needs: u16,
}

impl Encoder {
    /// Marks the record as needing format `version` to be read.
    pub fn need(&mut self, version: u16) {
        self.needs = self.needs.max(version);
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn fixed(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.u32(u32::try_from(v.len()).expect("field length fits u32"));
        self.buf.extend_from_slice(v);
    }
    pub fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    pub fn pairs(&mut self, v: &[(String, String)]) {
        self.u32(v.len() as u32);
        for (a, b) in v {
            self.str(a);
            self.str(b);
        }
    }
    pub fn opt_pair(&mut self, v: &Option<(String, String)>) {
        match v {
            None => self.u8(0),
            Some((a, b)) => {
                self.u8(1);
                self.str(a);
                self.str(b);
            }
        }
    }

    /// Wraps the payload in the envelope.
    pub fn finish(self, kind: RecordKind) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + self.buf.len() + TRAILER_BYTES);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.needs.max(BASE_VERSION).to_le_bytes());
        out.push(kind as u8);
        out.push(0);
        out.extend_from_slice(&(self.buf.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.buf);
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }
}

/// Reads fields from a payload with bounds checks.
pub struct Decoder<'a> {
    buf: &'a [u8],
    pos: usize,
    version: u16,
}

impl<'a> Decoder<'a> {
    /// Validates the envelope and returns a decoder over its payload.
    pub fn open(record: &'a [u8], kind: RecordKind) -> Result<Self, FormatError> {
        if record.len() < HEADER_BYTES + TRAILER_BYTES {
            return Err(FormatError::Truncated {
                offset: 0,
                needed: HEADER_BYTES + TRAILER_BYTES,
                have: record.len(),
            });
        }
        let magic: [u8; 4] = record[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(FormatError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([record[4], record[5]]);
        if version == 0 || version > FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        if record[6] != kind as u8 {
            return Err(FormatError::WrongKind {
                expected: kind,
                found: record[6],
            });
        }
        let len = u32::from_le_bytes(record[8..12].try_into().expect("4 bytes")) as usize;
        if len > RECORD_PAYLOAD_MAX_BYTES {
            return Err(FormatError::TooLarge {
                field: "payload",
                len,
                max: RECORD_PAYLOAD_MAX_BYTES,
            });
        }
        let end = HEADER_BYTES + len;
        if record.len() < end + TRAILER_BYTES {
            return Err(FormatError::Truncated {
                offset: end,
                needed: TRAILER_BYTES,
                have: record.len().saturating_sub(end),
            });
        }
        if record.len() > end + TRAILER_BYTES {
            return Err(FormatError::TrailingBytes(
                record.len() - end - TRAILER_BYTES,
            ));
        }
        let stored = u32::from_le_bytes(record[end..end + 4].try_into().expect("4 bytes"));
        let computed = crc32c(&record[..end]);
        if stored != computed {
            return Err(FormatError::ChecksumMismatch { stored, computed });
        }
        Ok(Decoder {
            buf: &record[HEADER_BYTES..end],
            pos: 0,
            version,
        })
    }

    /// The format version the record was written in.
    pub fn version(&self) -> u16 {
        self.version
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let have = self.buf.len() - self.pos;
        if n > have {
            return Err(FormatError::Truncated {
                offset: HEADER_BYTES + self.pos,
                needed: n,
                have,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub fn fixed<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        Ok(self.take(N)?.try_into().expect("N"))
    }
    pub fn bytes(&mut self, field: &'static str, max: usize) -> Result<&'a [u8], FormatError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(FormatError::TooLarge { field, len, max });
        }
        self.take(len)
    }
    pub fn str(&mut self, field: &'static str) -> Result<String, FormatError> {
        let b = self.bytes(field, STRING_MAX_BYTES)?;
        String::from_utf8(b.to_vec()).map_err(|_| FormatError::Invalid(field))
    }
    pub fn count(&mut self, field: &'static str) -> Result<usize, FormatError> {
        let n = self.u32()? as usize;
        // Each entry takes at least one byte, so a count beyond the remaining bytes
        // is corrupt; checking here keeps allocations bounded by the input size.
        if n > LIST_MAX_ENTRIES || n > self.buf.len() - self.pos {
            return Err(FormatError::TooLarge {
                field,
                len: n,
                max: LIST_MAX_ENTRIES.min(self.buf.len() - self.pos),
            });
        }
        Ok(n)
    }
    pub fn pairs(&mut self, field: &'static str) -> Result<Vec<(String, String)>, FormatError> {
        let n = self.count(field)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push((self.str(field)?, self.str(field)?));
        }
        Ok(v)
    }
    pub fn opt_pair(
        &mut self,
        field: &'static str,
    ) -> Result<Option<(String, String)>, FormatError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some((self.str(field)?, self.str(field)?))),
            _ => Err(FormatError::Invalid(field)),
        }
    }
    pub fn bool(&mut self, field: &'static str) -> Result<bool, FormatError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(FormatError::Invalid(field)),
        }
    }
    /// Ends decoding; leftover payload bytes mean the record is not what it claims.
    pub fn finish(self) -> Result<(), FormatError> {
        let left = self.buf.len() - self.pos;
        if left != 0 {
            return Err(FormatError::TrailingBytes(left));
        }
        Ok(())
    }
}

/// A 128-bit identifier (version, data, upload, deployment).
pub type Id128 = [u8; 16];

pub fn new_id() -> Id128 {
    let mut id = [0u8; 16];
    getrandom::fill(&mut id).expect("operating system random source");
    id
}

pub fn id_to_hex(id: &Id128) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn id_from_hex(s: &str) -> Option<Id128> {
    if s.len() != 32 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, out) in id.iter_mut().enumerate() {
        *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(id)
}

// ---------------------------------------------------------------------------
// Records

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Reed-Solomon over the erasure set with the configured data/parity counts.
    ErasureCoded,
    /// Full copies on this many drives of the set.
    Replicated(u8),
    /// One copy; for data that can be recomputed.
    SingleCopy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Versioning {
    Unversioned = 0,
    Enabled = 1,
    Suspended = 2,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketRecord {
    pub created_ns: u64,
    pub durability: Durability,
    pub versioning: Versioning,
    /// Object lock is enabled (format 5): versioning stays enabled, and
    /// versions may carry retention and legal holds.
    pub object_lock: bool,
}

impl BucketRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u64(self.created_ns);
        match self.durability {
            Durability::ErasureCoded => {
                e.u8(0);
                e.u8(0)
            }
            Durability::Replicated(n) => {
                e.u8(1);
                e.u8(n)
            }
            Durability::SingleCopy => {
                e.u8(2);
                e.u8(1)
            }
        }
        e.u8(self.versioning as u8);
        if self.object_lock {
            e.need(5);
            e.u8(1);
        }
        e.finish(RecordKind::Bucket)
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::open(b, RecordKind::Bucket)?;
        let created_ns = d.u64()?;
        let durability = match (d.u8()?, d.u8()?) {
            (0, _) => Durability::ErasureCoded,
            (1, n) if n >= 1 => Durability::Replicated(n),
            (2, _) => Durability::SingleCopy,
            _ => return Err(FormatError::Invalid("durability")),
        };
        let versioning = match d.u8()? {
            0 => Versioning::Unversioned,
            1 => Versioning::Enabled,
            2 => Versioning::Suspended,
            _ => return Err(FormatError::Invalid("versioning")),
        };
        let object_lock = d.version() >= 5 && d.bool("object_lock")?;
        d.finish()?;
        Ok(BucketRecord {
            created_ns,
            durability,
            versioning,
            object_lock,
        })
    }
}

/// Which erasure codec produced the parity shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecId {
    /// Parity shards are copies of the single data shard (k = 1).
    Replicate = 0,
    /// `reed-solomon-simd` (Leopard-style GF(2^16) FFT).
    ReedSolomonSimd = 1,
}

/// How a version's bytes are cut into stripes and spread over the set's drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub data_shards: u8,
    pub parity_shards: u8,
    pub codec: CodecId,
    pub stripe_size_bytes: u32,
    /// `distribution[shard]` = position of the drive in the erasure set.
    pub distribution: Vec<u8>,
}

/// Largest stripe a layout may name (the configuration allows no more).
pub const STRIPE_SIZE_MAX_BYTES: u32 = 64 << 20;

impl Layout {
    /// One shard, no parity: inline objects and delete markers.
    pub fn single_copy(stripe_size_bytes: u32) -> Self {
        Layout {
            data_shards: 1,
            parity_shards: 0,
            codec: CodecId::Replicate,
            stripe_size_bytes,
            distribution: vec![0],
        }
    }

    pub fn shard_count(&self) -> usize {
        self.data_shards as usize + self.parity_shards as usize
    }

    fn encode(&self, e: &mut Encoder) {
        e.u8(self.data_shards);
        e.u8(self.parity_shards);
        e.u8(self.codec as u8);
        e.u32(self.stripe_size_bytes);
        e.bytes(&self.distribution);
    }

    fn decode(d: &mut Decoder) -> Result<Self, FormatError> {
        let data_shards = d.u8()?;
        let parity_shards = d.u8()?;
        let codec = match d.u8()? {
            0 => CodecId::Replicate,
            1 => CodecId::ReedSolomonSimd,
            _ => return Err(FormatError::Invalid("codec")),
        };
        let stripe_size_bytes = d.u32()?;
        let distribution = d.bytes("distribution", 255)?.to_vec();
        let l = Layout {
            data_shards,
            parity_shards,
            codec,
            stripe_size_bytes,
            distribution,
        };
        let valid = l.data_shards >= 1
            && l.distribution.len() == l.shard_count()
            && l.stripe_size_bytes >= 2
            && l.stripe_size_bytes <= STRIPE_SIZE_MAX_BYTES
            && l.stripe_size_bytes.is_multiple_of(2)
            && (l.codec != CodecId::Replicate || l.data_shards == 1);
        if !valid {
            return Err(FormatError::Invalid("layout"));
        }
        Ok(l)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartMeta {
    pub number: u32,
    pub size: u64,
    pub etag: String,
    pub data_id: Id128,
    /// (algorithm, base64 value) of the part, as UploadPart verified it
    /// (format 2; None in records of format 1).
    pub checksum: Option<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Storage {
    /// The bytes live in the drive's inline table, a full copy on each drive.
    Inline { crc32c: u32 },
    /// Erasure-coded shard files, one data id per part.
    Parts(Vec<PartMeta>),
}

/// How an encrypted version's bytes are sealed (format 4; `crate::seal`):
/// the cipher, and each part's salt, in the order of its parts (one for an
/// inline version). The key is not here: the S3 layer keeps it wrapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seal {
    pub cipher: u8,
    pub salts: Vec<[u8; 16]>,
}

impl Seal {
    fn encode(seal: &Option<Seal>, e: &mut Encoder) {
        match seal {
            None => e.u8(0),
            Some(s) => {
                e.u8(1);
                e.u8(s.cipher);
                e.u32(s.salts.len() as u32);
                for salt in &s.salts {
                    e.fixed(salt);
                }
            }
        }
    }

    fn decode(d: &mut Decoder) -> Result<Option<Seal>, FormatError> {
        if d.version() < 4 || !d.bool("sealed")? {
            return Ok(None);
        }
        let cipher = d.u8()?;
        if cipher != crate::seal::CIPHER_AES256_GCM_64K {
            return Err(FormatError::Invalid("cipher"));
        }
        let n = d.count("salts")?;
        let mut salts = Vec::with_capacity(n);
        for _ in 0..n {
            salts.push(d.fixed()?);
        }
        Ok(Some(Seal { cipher, salts }))
    }
}

/// How a retention protects a version (S3 object lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum LockMode {
    /// Users with the bypass permission may shorten or remove it, and
    /// delete the version, by asking for the bypass explicitly.
    Governance = 1,
    /// No one, root included, can shorten or remove it or delete the
    /// version before it ends.
    Compliance = 2,
}

impl LockMode {
    pub fn as_str(self) -> &'static str {
        match self {
            LockMode::Governance => "GOVERNANCE",
            LockMode::Compliance => "COMPLIANCE",
        }
    }

    pub fn parse(s: &str) -> Option<LockMode> {
        match s {
            "GOVERNANCE" => Some(LockMode::Governance),
            "COMPLIANCE" => Some(LockMode::Compliance),
            _ => None,
        }
    }
}

/// The upload-record header that carries an upload's object lock to its
/// completion (internal: never stored on a version).
pub const UPLOAD_LOCK_HEADER: &str = "x-tarn-object-lock";

/// A version's retention: kept until `until_ns` (Unix nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub mode: LockMode,
    pub until_ns: u64,
}

/// A version's object lock (format 5): its retention, and whether a legal
/// hold is on. A version with neither has `None` as its lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ObjectLock {
    pub retention: Option<Retention>,
    pub legal_hold: bool,
}

impl ObjectLock {
    /// The lock holds nothing.
    pub fn is_empty(&self) -> bool {
        self.retention.is_none() && !self.legal_hold
    }

    /// Why the version cannot be deleted now (None: it can).
    /// `bypass_governance`: the caller asked for the governance bypass and
    /// is allowed it.
    pub fn protects(&self, now_ns: u64, bypass_governance: bool) -> Option<&'static str> {
        if self.legal_hold {
            return Some("a legal hold is on");
        }
        match self.retention {
            Some(r) if r.until_ns > now_ns => match r.mode {
                LockMode::Compliance => Some("it is under COMPLIANCE retention"),
                LockMode::Governance if !bypass_governance => {
                    Some("it is under GOVERNANCE retention")
                }
                LockMode::Governance => None,
            },
            _ => None,
        }
    }

    /// Whether the retention may become `new`: always when the current one
    /// has ended or `new` keeps at least as much (same or later date, and
    /// COMPLIANCE stays COMPLIANCE); a GOVERNANCE retention may be
    /// shortened, loosened or removed only with the bypass; a COMPLIANCE
    /// one never. Err: why not.
    pub fn may_retain(
        &self,
        new: Option<Retention>,
        now_ns: u64,
        bypass_governance: bool,
    ) -> Result<(), &'static str> {
        let Some(cur) = self.retention.filter(|r| r.until_ns > now_ns) else {
            return Ok(());
        };
        let keeps = new.is_some_and(|n| {
            n.until_ns >= cur.until_ns
                && !(cur.mode == LockMode::Compliance && n.mode == LockMode::Governance)
        });
        match cur.mode {
            _ if keeps => Ok(()),
            LockMode::Governance if bypass_governance => Ok(()),
            LockMode::Governance => Err("the version is under GOVERNANCE retention: shortening or removing it needs x-amz-bypass-governance-retention and s3:BypassGovernanceRetention"),
            LockMode::Compliance => Err("the version is under COMPLIANCE retention: it can only be extended"),
        }
    }

    /// The lock as an upload record keeps it until its completion (in the
    /// upload's headers, under `UPLOAD_LOCK_HEADER`): `MODE UNTIL_NS HOLD`.
    pub fn to_header(&self) -> String {
        let (mode, until) = match self.retention {
            Some(r) => (r.mode.as_str(), r.until_ns),
            None => ("-", 0),
        };
        format!("{mode} {until} {}", self.legal_hold as u8)
    }

    pub fn from_header(s: &str) -> Option<ObjectLock> {
        let mut it = s.split(' ');
        let (mode, until, hold) = (it.next()?, it.next()?, it.next()?);
        let retention = match mode {
            "-" => None,
            m => Some(Retention {
                mode: LockMode::parse(m)?,
                until_ns: until.parse().ok()?,
            }),
        };
        let legal_hold = match hold {
            "0" => false,
            "1" => true,
            _ => return None,
        };
        Some(ObjectLock {
            retention,
            legal_hold,
        })
    }

    fn encode(lock: &Option<ObjectLock>, e: &mut Encoder) {
        match lock {
            None => e.u8(0),
            Some(l) => {
                e.u8(1);
                match l.retention {
                    None => e.u8(0),
                    Some(r) => {
                        e.u8(r.mode as u8);
                        e.u64(r.until_ns);
                    }
                }
                e.u8(l.legal_hold as u8);
            }
        }
    }

    fn decode(d: &mut Decoder) -> Result<Option<ObjectLock>, FormatError> {
        if d.version() < 5 || !d.bool("locked")? {
            return Ok(None);
        }
        let retention = match d.u8()? {
            0 => None,
            1 => Some(LockMode::Governance),
            2 => Some(LockMode::Compliance),
            _ => return Err(FormatError::Invalid("lock mode")),
        };
        let retention = match retention {
            Some(mode) => Some(Retention {
                mode,
                until_ns: d.u64()?,
            }),
            None => None,
        };
        let legal_hold = d.bool("legal_hold")?;
        Ok(Some(ObjectLock {
            retention,
            legal_hold,
        }))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionMeta {
    /// All zero for the "null" version of unversioned buckets.
    pub version_id: Id128,
    pub mod_time_ns: u64,
    pub delete_marker: bool,
    pub size: u64,
    pub etag: String,
    pub content_type: String,
    /// System headers kept verbatim (content-encoding, cache-control, …).
    pub headers: Vec<(String, String)>,
    pub user_metadata: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
    /// (algorithm, base64 value) as the client sent it, e.g. ("CRC32C", "…").
    pub checksum: Option<(String, String)>,
    pub layout: Layout,
    pub storage: Storage,
    /// Encrypted versions: how. `size` is then the plaintext's size, and
    /// each part's `size` (and an inline version's stored bytes) the
    /// sealed length (`crate::seal::sealed_len`).
    pub seal: Option<Seal>,
    /// Retention and legal hold (object lock), if any.
    pub lock: Option<ObjectLock>,
}

impl VersionMeta {
    /// The stored length of an inline version's bytes.
    pub fn inline_len(&self) -> u64 {
        match self.seal {
            Some(_) => crate::seal::sealed_len(self.size),
            None => self.size,
        }
    }

    /// A part's plaintext size from its stored size.
    pub fn plain_part_size(&self, stored: u64) -> u64 {
        match self.seal {
            Some(_) => crate::seal::plain_len(stored).unwrap_or(0),
            None => stored,
        }
    }

    /// (part number, stored size, salt) of each part of a sealed version
    /// with data files.
    pub fn sealed_parts(&self) -> Option<Vec<(u32, u64, [u8; 16])>> {
        let seal = self.seal.as_ref()?;
        match &self.storage {
            Storage::Parts(parts) if parts.len() == seal.salts.len() => Some(
                parts
                    .iter()
                    .zip(&seal.salts)
                    .map(|(p, s)| (p.number, p.size, *s))
                    .collect(),
            ),
            Storage::Inline { .. } if seal.salts.len() == 1 => {
                Some(vec![(1, self.inline_len(), seal.salts[0])])
            }
            _ => None,
        }
    }

    /// Why this version cannot be deleted now (None: it can).
    pub fn locked(&self, now_ns: u64, bypass_governance: bool) -> Option<&'static str> {
        self.lock
            .as_ref()
            .and_then(|l| l.protects(now_ns, bypass_governance))
    }

    /// `version`: the record's format version (4 and up carry a seal, 5
    /// and up a lock).
    fn encode(&self, e: &mut Encoder, version: u16) {
        e.fixed(&self.version_id);
        e.u64(self.mod_time_ns);
        e.u8(self.delete_marker as u8);
        e.u64(self.size);
        e.str(&self.etag);
        e.str(&self.content_type);
        e.pairs(&self.headers);
        e.pairs(&self.user_metadata);
        e.pairs(&self.tags);
        e.opt_pair(&self.checksum);
        self.layout.encode(e);
        match &self.storage {
            Storage::Inline { crc32c } => {
                e.u8(0);
                e.u32(*crc32c);
            }
            Storage::Parts(parts) => {
                e.u8(1);
                e.u32(parts.len() as u32);
                for p in parts {
                    e.u32(p.number);
                    e.u64(p.size);
                    e.str(&p.etag);
                    e.fixed(&p.data_id);
                    e.opt_pair(&p.checksum);
                }
            }
        }
        if version >= 4 {
            Seal::encode(&self.seal, e);
        }
        if version >= 5 {
            ObjectLock::encode(&self.lock, e);
        }
    }

    fn decode(d: &mut Decoder) -> Result<Self, FormatError> {
        let version_id = d.fixed::<16>()?;
        let mod_time_ns = d.u64()?;
        let delete_marker = d.bool("delete_marker")?;
        let size = d.u64()?;
        let etag = d.str("etag")?;
        let content_type = d.str("content_type")?;
        let headers = d.pairs("headers")?;
        let user_metadata = d.pairs("user_metadata")?;
        let tags = d.pairs("tags")?;
        let checksum = d.opt_pair("checksum")?;
        let layout = Layout::decode(d)?;
        let storage = match d.u8()? {
            0 => Storage::Inline { crc32c: d.u32()? },
            1 => {
                let n = d.count("parts")?;
                let mut parts = Vec::with_capacity(n);
                for _ in 0..n {
                    parts.push(PartMeta {
                        number: d.u32()?,
                        size: d.u64()?,
                        etag: d.str("part etag")?,
                        data_id: d.fixed()?,
                        checksum: if d.version() >= 2 {
                            d.opt_pair("part checksum")?
                        } else {
                            None
                        },
                    });
                }
                Storage::Parts(parts)
            }
            _ => return Err(FormatError::Invalid("storage")),
        };
        let seal = Seal::decode(d)?;
        let lock = ObjectLock::decode(d)?;
        if let Storage::Parts(parts) = &storage {
            let plain = |p: &PartMeta| match &seal {
                Some(_) => crate::seal::plain_len(p.size),
                None => Some(p.size),
            };
            let sum = parts
                .iter()
                .try_fold(0u64, |acc, p| plain(p).and_then(|s| acc.checked_add(s)));
            if sum != Some(size) {
                return Err(FormatError::Invalid(
                    "part sizes do not add up to the object size",
                ));
            }
        }
        let salts_fit = match (&seal, &storage) {
            (None, _) => true,
            (Some(s), Storage::Parts(p)) => s.salts.len() == p.len(),
            (Some(s), Storage::Inline { .. }) => s.salts.len() == 1,
        };
        if !salts_fit {
            return Err(FormatError::Invalid("a salt for each sealed part"));
        }
        Ok(VersionMeta {
            version_id,
            mod_time_ns,
            delete_marker,
            size,
            etag,
            content_type,
            headers,
            user_metadata,
            tags,
            checksum,
            layout,
            storage,
            seal,
            lock,
        })
    }
}

/// All versions of one key on one drive, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ObjectRecord {
    pub versions: Vec<VersionMeta>,
    /// Orders the records of one key on a drive: every write of a record
    /// carries a stamp above every stamp its writer saw, and a drive takes
    /// a record only over one with a lower stamp (`DriveDb::write_object`),
    /// so a write that arrives late (a call whose caller gave up, one that
    /// waited behind a busy core) never replaces a newer record. A record
    /// with no versions is a deleted key's tombstone, kept for its stamp.
    /// Nanoseconds, from the writer's clock and the stamps it saw
    /// (`Store::next_mod_time`). Records of format 1 and 2 take their
    /// newest version's modification time.
    pub stamp: u64,
}

impl ObjectRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        let version = if self.versions.iter().any(|v| v.lock.is_some()) {
            5
        } else if self.versions.iter().any(|v| v.seal.is_some()) {
            4
        } else {
            BASE_VERSION
        };
        e.need(version);
        e.u32(self.versions.len() as u32);
        for v in &self.versions {
            v.encode(&mut e, version);
        }
        e.u64(self.stamp);
        e.finish(RecordKind::Object)
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::open(b, RecordKind::Object)?;
        let n = d.count("versions")?;
        let mut versions = Vec::with_capacity(n);
        for _ in 0..n {
            versions.push(VersionMeta::decode(&mut d)?);
        }
        let stamp = if d.version() >= 3 {
            d.u64()?
        } else {
            versions.iter().map(|v| v.mod_time_ns).max().unwrap_or(0)
        };
        d.finish()?;
        Ok(ObjectRecord { versions, stamp })
    }

    /// A deleted key's record: no versions, only the stamp.
    pub fn tombstone(stamp: u64) -> ObjectRecord {
        ObjectRecord {
            versions: Vec::new(),
            stamp,
        }
    }

    /// Whether two records hold the same versions, whatever their stamps.
    pub fn same_versions(&self, other: &ObjectRecord) -> bool {
        self.versions == other.versions
    }
}

/// A small inline version for tests: id bytes all `id`, the given time.
#[cfg(test)]
pub(crate) fn test_version(id: u8, mod_time_ns: u64) -> VersionMeta {
    VersionMeta {
        version_id: [id; 16],
        mod_time_ns,
        delete_marker: false,
        size: 1,
        etag: String::new(),
        content_type: String::new(),
        headers: Vec::new(),
        user_metadata: Vec::new(),
        tags: Vec::new(),
        checksum: None,
        layout: Layout::single_copy(4096),
        storage: Storage::Inline { crc32c: 0 },
        seal: None,
        lock: None,
    }
}

/// A multipart upload in progress; its parts are separate `UploadPartRecord`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadRecord {
    pub upload_id: Id128,
    pub initiated_ns: u64,
    pub content_type: String,
    pub headers: Vec<(String, String)>,
    pub user_metadata: Vec<(String, String)>,
    pub tags: Vec<(String, String)>,
    pub checksum_algorithm: String,
    pub layout: Layout,
    /// COMPOSITE or FULL_OBJECT when `checksum_algorithm` is set (format 2;
    /// empty in records of format 1, which means the algorithm's default).
    pub checksum_type: String,
}

impl UploadRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.fixed(&self.upload_id);
        e.u64(self.initiated_ns);
        e.str(&self.content_type);
        e.pairs(&self.headers);
        e.pairs(&self.user_metadata);
        e.pairs(&self.tags);
        e.str(&self.checksum_algorithm);
        self.layout.encode(&mut e);
        e.str(&self.checksum_type);
        e.finish(RecordKind::Upload)
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::open(b, RecordKind::Upload)?;
        let r = UploadRecord {
            upload_id: d.fixed()?,
            initiated_ns: d.u64()?,
            content_type: d.str("content_type")?,
            headers: d.pairs("headers")?,
            user_metadata: d.pairs("user_metadata")?,
            tags: d.pairs("tags")?,
            checksum_algorithm: d.str("checksum_algorithm")?,
            layout: Layout::decode(&mut d)?,
            checksum_type: if d.version() >= 2 {
                d.str("checksum_type")?
            } else {
                String::new()
            },
        };
        d.finish()?;
        Ok(r)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadPartRecord {
    pub number: u32,
    pub size: u64,
    pub etag: String,
    pub data_id: Id128,
    pub mod_time_ns: u64,
    pub checksum: Option<(String, String)>,
    /// An encrypted part's salt (format 4); `size` is then its sealed length.
    pub salt: Option<[u8; 16]>,
}

impl UploadPartRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.u32(self.number);
        e.u64(self.size);
        e.str(&self.etag);
        e.fixed(&self.data_id);
        e.u64(self.mod_time_ns);
        e.opt_pair(&self.checksum);
        if let Some(salt) = &self.salt {
            e.need(4);
            e.u8(1);
            e.fixed(salt);
        }
        e.finish(RecordKind::UploadPart)
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::open(b, RecordKind::UploadPart)?;
        let r = UploadPartRecord {
            number: d.u32()?,
            size: d.u64()?,
            etag: d.str("etag")?,
            data_id: d.fixed()?,
            mod_time_ns: d.u64()?,
            checksum: d.opt_pair("checksum")?,
            salt: if d.version() >= 4 && d.bool("sealed")? {
                Some(d.fixed()?)
            } else {
                None
            },
        };
        d.finish()?;
        Ok(r)
    }
}

/// Written once per drive when a deployment is created: ties the directory to
/// its deployment and its position, so a drive moved to the wrong slot or a
/// foreign directory is refused instead of silently used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveFormat {
    pub deployment_id: Id128,
    pub drive_id: Id128,
    pub set_count: u32,
    pub set_drive_count: u32,
    pub set_index: u32,
    pub drive_index: u32,
}

impl DriveFormat {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        e.fixed(&self.deployment_id);
        e.fixed(&self.drive_id);
        e.u32(self.set_count);
        e.u32(self.set_drive_count);
        e.u32(self.set_index);
        e.u32(self.drive_index);
        e.finish(RecordKind::DriveFormat)
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        let mut d = Decoder::open(b, RecordKind::DriveFormat)?;
        let r = DriveFormat {
            deployment_id: d.fixed()?,
            drive_id: d.fixed()?,
            set_count: d.u32()?,
            set_drive_count: d.u32()?,
            set_index: d.u32()?,
            drive_index: d.u32()?,
        };
        d.finish()?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_pairs() -> impl Strategy<Value = Vec<(String, String)>> {
        proptest::collection::vec((".{0,12}", ".{0,20}"), 0..4)
    }

    prop_compose! {
        fn arb_version()(
            version_id in any::<[u8; 16]>(),
            mod_time_ns in any::<u64>(),
            delete_marker in any::<bool>(),
            part_sizes in proptest::collection::vec(0u64..1 << 40, 0..5),
            inline in any::<bool>(),
            crc in any::<u32>(),
            etag in "[0-9a-f]{32}(-[0-9]{1,4})?",
            content_type in ".{0,30}",
            headers in arb_pairs(), user_metadata in arb_pairs(), tags in arb_pairs(),
            checksum in proptest::option::of(("CRC32|CRC32C|SHA256", "[A-Za-z0-9+/=]{8,44}")),
            k in 1u8..8, m in 0u8..4, stripe in 1u32..1 << 22,
            sealed in any::<bool>(), salt in any::<[u8; 16]>(),
            lock in proptest::option::of((0u8..3, any::<u64>(), any::<bool>())),
        ) -> VersionMeta {
            let stored = |s: u64| if sealed { crate::seal::sealed_len(s) } else { s };
            let storage = if inline { Storage::Inline { crc32c: crc } } else {
                Storage::Parts(part_sizes.iter().enumerate().map(|(i, &s)| PartMeta { number: i as u32 + 1, size: stored(s), etag: etag.clone(), data_id: version_id, checksum: checksum.clone() }).collect())
            };
            let size = match &storage { Storage::Inline { .. } => 7, Storage::Parts(_) => part_sizes.iter().sum() };
            let salts = match &storage { Storage::Inline { .. } => vec![salt], Storage::Parts(p) => vec![salt; p.len()] };
            let seal = sealed.then_some(Seal { cipher: crate::seal::CIPHER_AES256_GCM_64K, salts });
            let codec = if k == 1 { CodecId::Replicate } else { CodecId::ReedSolomonSimd };
            VersionMeta { version_id, mod_time_ns, delete_marker, size, etag, content_type, headers, user_metadata, tags, checksum,
                layout: Layout { data_shards: k, parity_shards: m, codec, stripe_size_bytes: stripe * 2, distribution: (0..k + m).collect() },
                storage, seal, lock: lock.map(|(mode, until_ns, legal_hold)| ObjectLock {
                    retention: match mode { 0 => None, 1 => Some(Retention { mode: LockMode::Governance, until_ns }), _ => Some(Retention { mode: LockMode::Compliance, until_ns }) },
                    legal_hold,
                }) }
        }
    }

    proptest! {
        #[test]
        fn object_record_roundtrip(versions in proptest::collection::vec(arb_version(), 0..4), stamp in any::<u64>()) {
            let r = ObjectRecord { versions, stamp };
            let bytes = r.encode();
            prop_assert_eq!(ObjectRecord::decode(&bytes).unwrap(), r);
        }

        #[test]
        fn corrupt_object_record_is_an_error(versions in proptest::collection::vec(arb_version(), 1..3), pos in any::<usize>(), bit in 0u8..8, cut in any::<usize>()) {
            let bytes = ObjectRecord { versions, stamp: 7 }.encode();
            let mut flipped = bytes.clone();
            let i = pos % flipped.len();
            flipped[i] ^= 1 << bit;
            prop_assert!(ObjectRecord::decode(&flipped).is_err());
            let cut = cut % bytes.len();
            prop_assert!(ObjectRecord::decode(&bytes[..cut]).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = ObjectRecord::decode(&bytes);
            let _ = BucketRecord::decode(&bytes);
            let _ = UploadRecord::decode(&bytes);
            let _ = UploadPartRecord::decode(&bytes);
            let _ = DriveFormat::decode(&bytes);
        }

        #[test]
        fn forged_envelope_with_valid_crc_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..512), kind in 1u8..6) {
            // A payload of random bytes under a correct header and checksum reaches
            // the field decoders; they must reject it with an error, not a panic.
            let mut e = Encoder::default();
            e.fixed(&payload);
            let kind = match kind { 1 => RecordKind::Bucket, 2 => RecordKind::Object, 3 => RecordKind::Upload, 4 => RecordKind::UploadPart, _ => RecordKind::DriveFormat };
            let bytes = e.finish(kind);
            let _ = ObjectRecord::decode(&bytes);
            let _ = BucketRecord::decode(&bytes);
            let _ = UploadRecord::decode(&bytes);
            let _ = UploadPartRecord::decode(&bytes);
            let _ = DriveFormat::decode(&bytes);
        }
    }

    #[test]
    fn other_records_roundtrip() {
        let b = BucketRecord {
            created_ns: 5,
            durability: Durability::Replicated(3),
            versioning: Versioning::Suspended,
            object_lock: false,
        };
        assert_eq!(BucketRecord::decode(&b.encode()).unwrap(), b);
        // Only a bucket with object lock needs format 5.
        assert_eq!(&b.encode()[4..6], &3u16.to_le_bytes());
        let locked = BucketRecord {
            versioning: Versioning::Enabled,
            object_lock: true,
            ..b.clone()
        };
        assert_eq!(&locked.encode()[4..6], &5u16.to_le_bytes());
        assert_eq!(BucketRecord::decode(&locked.encode()).unwrap(), locked);
        let f = DriveFormat {
            deployment_id: [1; 16],
            drive_id: [2; 16],
            set_count: 1,
            set_drive_count: 4,
            set_index: 0,
            drive_index: 3,
        };
        assert_eq!(DriveFormat::decode(&f.encode()).unwrap(), f);
        let p = UploadPartRecord {
            number: 3,
            size: 9,
            etag: "x".into(),
            data_id: [3; 16],
            mod_time_ns: 1,
            checksum: None,
            salt: None,
        };
        assert_eq!(UploadPartRecord::decode(&p.encode()).unwrap(), p);
        // Only an encrypted part needs format 4.
        assert_eq!(&p.encode()[4..6], &3u16.to_le_bytes());
        let sealed = UploadPartRecord {
            salt: Some([5; 16]),
            ..p.clone()
        };
        assert_eq!(&sealed.encode()[4..6], &4u16.to_le_bytes());
        assert_eq!(UploadPartRecord::decode(&sealed.encode()).unwrap(), sealed);
        assert!(matches!(
            BucketRecord::decode(&f.encode()),
            Err(FormatError::WrongKind { .. })
        ));
    }

    #[test]
    fn locks_judge_deletes_and_changes() {
        let now = 1_000;
        let gov = |until_ns| Retention {
            mode: LockMode::Governance,
            until_ns,
        };
        let comp = |until_ns| Retention {
            mode: LockMode::Compliance,
            until_ns,
        };
        let l = |r: Option<Retention>, legal_hold| ObjectLock {
            retention: r,
            legal_hold,
        };
        // Deletes.
        assert!(l(Some(comp(2_000)), false).protects(now, true).is_some());
        assert!(l(Some(gov(2_000)), false).protects(now, false).is_some());
        assert!(l(Some(gov(2_000)), false).protects(now, true).is_none());
        assert!(l(Some(comp(1_000)), false).protects(now, false).is_none());
        assert!(l(Some(comp(10)), true).protects(now, true).is_some());
        assert!(l(None, false).protects(now, false).is_none());
        // Retention changes.
        let c = l(Some(comp(2_000)), false);
        assert!(c.may_retain(Some(comp(3_000)), now, false).is_ok());
        assert!(c.may_retain(Some(comp(1_500)), now, true).is_err());
        assert!(c.may_retain(Some(gov(3_000)), now, true).is_err());
        assert!(c.may_retain(None, now, true).is_err());
        let g = l(Some(gov(2_000)), false);
        assert!(g.may_retain(Some(comp(2_000)), now, false).is_ok());
        assert!(g.may_retain(Some(gov(2_500)), now, false).is_ok());
        assert!(g.may_retain(Some(gov(1_500)), now, false).is_err());
        assert!(g.may_retain(None, now, false).is_err());
        assert!(g.may_retain(None, now, true).is_ok());
        // An ended retention may become anything.
        assert!(l(Some(comp(900)), false)
            .may_retain(None, now, false)
            .is_ok());
    }

    #[test]
    fn newer_version_is_refused() {
        let mut b = BucketRecord {
            created_ns: 5,
            durability: Durability::ErasureCoded,
            versioning: Versioning::Enabled,
            object_lock: false,
        }
        .encode();
        b[4] = 9;
        assert_eq!(
            BucketRecord::decode(&b),
            Err(FormatError::UnsupportedVersion(9))
        );
    }

    /// Rewrites a record as format 1 wrote it: `cut` payload bytes (the
    /// fields format 2 added at the end) removed, the version set to 1.
    fn as_format1(record: &[u8], cut: usize) -> Vec<u8> {
        let payload_end = record.len() - TRAILER_BYTES - cut;
        let mut out = record[..payload_end].to_vec();
        out[4..6].copy_from_slice(&1u16.to_le_bytes());
        let len = (payload_end - HEADER_BYTES) as u32;
        out[8..12].copy_from_slice(&len.to_le_bytes());
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn format1_records_still_decode() {
        let layout = Layout::single_copy(1 << 20);
        let upload = UploadRecord {
            upload_id: [7; 16],
            initiated_ns: 3,
            content_type: "a/b".into(),
            headers: vec![],
            user_metadata: vec![],
            tags: vec![],
            checksum_algorithm: "CRC32".into(),
            layout: layout.clone(),
            checksum_type: String::new(),
        };
        // An empty checksum type is its 4-byte length.
        let old = as_format1(&upload.encode(), 4);
        assert_eq!(UploadRecord::decode(&old).unwrap(), upload);
        let v = VersionMeta {
            version_id: [1; 16],
            mod_time_ns: 9,
            delete_marker: false,
            size: 5,
            etag: "e-1".into(),
            content_type: "x".into(),
            headers: vec![],
            user_metadata: vec![],
            tags: vec![],
            checksum: None,
            layout,
            storage: Storage::Parts(vec![PartMeta {
                number: 1,
                size: 5,
                etag: "p".into(),
                data_id: [2; 16],
                checksum: None,
            }]),
            seal: None,
            lock: None,
        };
        let rec = ObjectRecord {
            versions: vec![v],
            stamp: 99,
        };
        // The stamp is 8 bytes, the last part's absent checksum one; a
        // record without a stamp takes its newest version's time.
        let old = as_format1(&rec.encode(), 9);
        let want = ObjectRecord {
            stamp: rec.versions[0].mod_time_ns,
            ..rec.clone()
        };
        assert_eq!(ObjectRecord::decode(&old).unwrap(), want);
    }

    #[test]
    fn hex_ids() {
        let id = new_id();
        assert_eq!(id_from_hex(&id_to_hex(&id)), Some(id));
        assert_eq!(id_from_hex("zz"), None);
        assert_eq!(id_from_hex(&"g".repeat(32)), None);
    }
}
