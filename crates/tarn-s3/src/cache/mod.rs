//! Cache buckets: Tarn buckets whose objects come from an upstream S3
//! bucket (docs/cache.md).
//!
//! A cached object is kept as two things in the object engine, placed like
//! any other data (so a cluster caches it once and every node serves it):
//! - its *entry*: an empty object at its own key in the cache bucket whose
//!   metadata holds what the upstream said of it (ETag, size,
//!   Last-Modified, version id, content type, user metadata) and its
//!   *generation*, a hash of the key and those;
//! - its bytes, as *chunks* of `CHUNK_BYTES` in the cache's internal bucket
//!   (`.cache.<bucket>`), keyed `<generation>/<index>`.
//!
//! A GET pins one entry and reads only that generation's chunks; a chunk the
//! engine lacks is fetched from the upstream with `If-Match` on the entry's
//! ETag, so bytes of two versions of an object are never served together: an
//! upstream change fails the fill (412), and the reader's response is cut
//! off rather than completed with other bytes. Fills are single-flight per
//! chunk and stream to their readers as the bytes arrive; a chunk is stored
//! only once whole.

mod evict;
mod list;
mod prefetch;
mod read;
pub mod upstream;
mod write;

pub use evict::{Pin, HIGH_WATERMARK, LOW_WATERMARK};
pub use prefetch::{Job, PrefetchSpec};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::Stream;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tarn_store::{
    ByteRange, Durability, ListParams, ObjectBody, ObjectInfo, PutOptions, Store, StoreError,
};
use tokio::sync::{mpsc, Notify, Semaphore};

use crate::iam::Iam;
use crate::sysdoc;
use upstream::{Upstream, UpstreamError, UpstreamMeta, Validation};

/// Bytes of one chunk: the unit of a fill, a range miss's fetch and the
/// read-ahead.
pub const CHUNK_BYTES: u64 = 8 << 20;
/// Chunks filled ahead of a reader that missed.
const READ_AHEAD_CHUNKS: u64 = 4;
/// Chunks filled and stored at once by one node (each held in memory until
/// it is stored).
const FILLS_MAX: usize = 32;
/// Tries of an upstream GET that makes no progress before the fill fails.
const FILL_TRIES: u32 = 4;
/// How long an upstream "no such key" is remembered, and how many are.
const NEGATIVE_TTL: Duration = Duration::from_secs(5);
const NEGATIVE_MAX: usize = 10_000;
/// Entries kept in memory per cache bucket (the rest are read from the
/// engine when asked for).
const ENTRIES_MAX: usize = 100_000;
const DOCS_PREFIX: &str = "cache/buckets/";
const DOC_FORMAT: u32 = 1;
/// The metadata header of an entry object that holds its cache state.
const ENTRY_HEADER: &str = "x-tarn-cache";
/// A GET of `<this><prefix>` in a cache bucket starts a prefetch of
/// `<prefix>` and answers the job (JSON): a prefetch any S3 client can ask
/// for. Upstream keys under it are not reachable through the cache.
pub const PREFETCH_KEY_PREFIX: &str = ".tarn-prefetch/";
/// Prefix of a cache bucket's internal bucket.
pub const CHUNKS_BUCKET_PREFIX: &str = ".cache.";

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{0}")]
    Invalid(String),
    #[error("bucket {0} is already a cache bucket or an ordinary bucket")]
    Exists(String),
    #[error("no cache bucket {0}")]
    NoSuchCache(String),
    #[error("no such key")]
    NoSuchKey,
    /// The upstream object changed while it was read.
    #[error("the upstream object changed while it was read")]
    Changed,
    /// Too much at once (prefetch jobs running): try again later.
    #[error("{0}")]
    Busy(String),
    /// A read broke off (the upstream failed past its retries).
    #[error("{0}")]
    Failed(String),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("stored cache record {what} is unreadable: {reason}")]
    Corrupt { what: String, reason: String },
}

/// When a cached object is checked against the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validate {
    /// Every read asks the upstream (a conditional HEAD).
    Always,
    /// A read asks when the last check is older than this many seconds.
    Ttl(u64),
    /// Never: the upstream's objects do not change.
    Never,
}

impl Validate {
    pub fn parse(s: &str) -> Result<Validate, String> {
        match s {
            "always" => Ok(Validate::Always),
            "never" => Ok(Validate::Never),
            _ => s
                .strip_prefix("ttl=")
                .and_then(|n| n.parse().ok())
                .map(Validate::Ttl)
                .ok_or_else(|| format!("--validate {s:?}: expected always, ttl=SECONDS or never")),
        }
    }
}

impl std::fmt::Display for Validate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Validate::Always => write!(f, "always"),
            Validate::Ttl(s) => write!(f, "ttl={s}"),
            Validate::Never => write!(f, "never"),
        }
    }
}

/// What writes to a cache bucket do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writes {
    Refuse,
    Through,
}

impl Writes {
    pub fn parse(s: &str) -> Result<Writes, String> {
        match s {
            "refuse" => Ok(Writes::Refuse),
            "through" => Ok(Writes::Through),
            _ => Err(format!("--writes {s:?}: expected refuse or through")),
        }
    }
    fn as_str(self) -> &'static str {
        match self {
            Writes::Refuse => "refuse",
            Writes::Through => "through",
        }
    }
}

/// A cache bucket as `tarn admin cache add` asks for it.
#[derive(Debug, Clone, Deserialize)]
pub struct CacheSpec {
    /// `s3://BUCKET[/PREFIX]`
    pub upstream: String,
    pub endpoint: String,
    #[serde(default)]
    pub region: Option<String>,
    #[serde(default)]
    pub access_key: Option<String>,
    #[serde(default)]
    pub secret_key: Option<String>,
    #[serde(default)]
    pub validate: Option<String>,
    #[serde(default)]
    pub writes: Option<String>,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub replicas: Option<u8>,
    /// PEM CA certificates of an https:// upstream (default: the system's).
    #[serde(default)]
    pub ca: Option<String>,
}

/// One cache bucket's settings as stored (`cache/buckets/<name>.json`);
/// the upstream secret sealed like users' secrets.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CacheDoc {
    format: u32,
    bucket: String,
    upstream_bucket: String,
    upstream_prefix: String,
    endpoint: String,
    region: String,
    access_key: Option<String>,
    secret: Option<String>,
    validate: String,
    writes: String,
    size: Option<u64>,
    replicas: Option<u8>,
    created_ns: u64,
    #[serde(default)]
    pins: Vec<Pin>,
    /// PEM CA certificates of an https:// upstream.
    #[serde(default)]
    ca: Option<String>,
}

fn doc_key(bucket: &str) -> String {
    format!("{DOCS_PREFIX}{bucket}.json")
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// `s3://bucket[/prefix]` → (bucket, prefix).
pub fn parse_upstream(s: &str) -> Result<(String, String), String> {
    let rest = s
        .strip_prefix("s3://")
        .ok_or_else(|| format!("--upstream {s:?} must be s3://BUCKET[/PREFIX]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(format!("--upstream {s:?} names no bucket"));
    }
    Ok((bucket.to_string(), prefix.to_string()))
}

/// Counters of one cache bucket.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// GETs served from cached bytes only, and those that needed the upstream.
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_served: AtomicU64,
    pub bytes_from_upstream: AtomicU64,
    pub upstream_gets: AtomicU64,
    pub upstream_heads: AtomicU64,
    pub fills_failed: AtomicU64,
    pub chunks_stored: AtomicU64,
    pub evictions: AtomicU64,
    pub bytes_evicted: AtomicU64,
}

/// What the cache knows of one object: the upstream's answer, pinned by a
/// generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub meta: UpstreamMeta,
    pub generation: String,
    /// When the upstream last confirmed it (Unix ns).
    pub validated_ns: u64,
}

#[derive(Serialize, Deserialize)]
struct EntryRecord {
    etag: String,
    size: u64,
    last_modified_ns: u64,
    version_id: Option<String>,
    generation: String,
    validated_ns: u64,
}

fn generation_of(key: &str, m: &UpstreamMeta) -> String {
    let mut h = Sha256::new();
    for part in [
        key,
        &m.etag,
        &m.size.to_string(),
        m.version_id.as_deref().unwrap_or(""),
        &m.last_modified_ns.to_string(),
    ] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Entry {
    fn new(key: &str, meta: UpstreamMeta) -> Entry {
        Entry {
            generation: generation_of(key, &meta),
            meta,
            validated_ns: now_ns(),
        }
    }

    /// The object as S3 answers show it.
    pub fn info(&self, bucket: &str, key: &str) -> ObjectInfo {
        ObjectInfo {
            bucket: bucket.to_string(),
            key: key.to_string(),
            version_id: None,
            is_latest: true,
            delete_marker: false,
            size: self.meta.size,
            etag: self.meta.etag.clone(),
            last_modified_ns: self.meta.last_modified_ns,
            content_type: self.meta.content_type.clone(),
            headers: self.meta.headers.clone(),
            user_metadata: self.meta.user_metadata.clone(),
            tags: Vec::new(),
            checksum: None,
            parts: Vec::new(),
            lock: None,
        }
    }

    fn chunks(&self) -> u64 {
        self.meta.size.div_ceil(CHUNK_BYTES)
    }

    fn chunk_key(&self, n: u64) -> String {
        format!("{}/{n}", self.generation)
    }

    fn chunk_bounds(&self, n: u64) -> (u64, u64) {
        let start = n * CHUNK_BYTES;
        (start, (start + CHUNK_BYTES).min(self.meta.size))
    }
}

/// One chunk being fetched: what has arrived, for every reader waiting.
struct Fill {
    state: Mutex<FillState>,
    changed: Notify,
    /// Whether the chunk is stored once whole: a fill holds one of the
    /// node's `FILLS_MAX` slots from its start until it is stored; a read
    /// that misses when every slot is taken streams from the upstream
    /// without keeping the chunk (the cache fills as fast as it can write,
    /// readers get the upstream's speed, memory stays bounded).
    keeps: bool,
}

/// What a fill that does not keep its chunk says to a prefetch waiting on it.
const NOT_KEPT: &str = "read through without being kept (every fill slot was taken)";

#[derive(Default)]
struct FillState {
    pieces: Vec<Bytes>,
    len: u64,
    /// Some once finished: Ok when whole.
    end: Option<Result<(), String>>,
    /// Some once the chunk is stored, or will not be.
    stored: Option<Result<(), String>>,
    /// Whether this node read it from the upstream (not another node).
    fetched: bool,
}

/// Every cache bucket of this node.
pub struct Caches {
    store: Arc<Store>,
    iam: Arc<Iam>,
    buckets: RwLock<HashMap<String, Arc<CacheBucket>>>,
    changes: tokio::sync::Mutex<()>,
    fills: Arc<Semaphore>,
    shared: Arc<evict::Shared>,
    jobs: Mutex<Vec<Arc<Job>>>,
}

/// One cache bucket.
pub struct CacheBucket {
    pub name: String,
    pub chunks_bucket: String,
    pub upstream: Upstream,
    pub validate: Validate,
    pub writes: Writes,
    pub size: Option<u64>,
    pub replicas: Option<u8>,
    pub stats: CacheStats,
    store: Arc<Store>,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
    negative: Mutex<HashMap<String, u64>>,
    fills: Mutex<HashMap<String, Arc<Fill>>>,
    fill_slots: Arc<Semaphore>,
    /// When its settings were made: a bucket removed and added again under
    /// the same name is a new cache.
    created_ns: u64,
    resident: Mutex<HashMap<String, evict::Resident>>,
    used: AtomicU64,
    pins: RwLock<Vec<Pin>>,
    shared: Arc<evict::Shared>,
    /// Whether what the engine holds was counted since the start.
    counted: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CacheBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheBucket")
            .field("name", &self.name)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl Caches {
    pub fn new(store: Arc<Store>, iam: Arc<Iam>) -> Arc<Caches> {
        evict::mark_process_start();
        Arc::new(Caches {
            store,
            iam,
            buckets: RwLock::new(HashMap::new()),
            changes: tokio::sync::Mutex::new(()),
            fills: Arc::new(Semaphore::new(FILLS_MAX)),
            shared: Arc::new(evict::Shared::default()),
            jobs: Mutex::new(Vec::new()),
        })
    }

    /// The node-wide budget over every cache bucket (0: none).
    pub fn set_budget(&self, bytes: u64) {
        self.shared.budget.store(bytes, Ordering::Relaxed);
    }

    pub fn budget(&self) -> u64 {
        self.shared.budget.load(Ordering::Relaxed)
    }

    /// Bytes every cache bucket holds, as counted on this node.
    pub fn used(&self) -> u64 {
        self.shared.used.load(Ordering::Relaxed)
    }

    fn install_bucket(&self, b: CacheBucket) -> Arc<CacheBucket> {
        let b = Arc::new(b);
        self.shared
            .buckets
            .lock()
            .expect("cache registry")
            .push(Arc::downgrade(&b));
        b
    }

    /// The cache bucket `name`, if it is one.
    pub fn get(&self, name: &str) -> Option<Arc<CacheBucket>> {
        self.buckets.read().expect("caches").get(name).cloned()
    }

    pub fn all(&self) -> Vec<Arc<CacheBucket>> {
        let mut v: Vec<_> = self
            .buckets
            .read()
            .expect("caches")
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Reads every cache bucket's settings (at start, and when another node
    /// changed them). Buckets whose settings did not change keep their state.
    pub async fn load(&self) -> Result<(), CacheError> {
        let _g = self.changes.lock().await;
        let keys = sysdoc::list(&self.store, DOCS_PREFIX).await?;
        let mut next = HashMap::new();
        for key in keys {
            let bytes = match sysdoc::read(&self.store, &key).await {
                Ok(b) => b,
                Err(StoreError::NoSuchKey { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let doc: CacheDoc =
                serde_json::from_slice(&bytes).map_err(|e| CacheError::Corrupt {
                    what: key.clone(),
                    reason: e.to_string(),
                })?;
            if doc.format != DOC_FORMAT || doc_key(&doc.bucket) != key {
                return Err(CacheError::Corrupt {
                    what: key,
                    reason: format!("format {} naming bucket {:?}", doc.format, doc.bucket),
                });
            }
            let kept = self.get(&doc.bucket).filter(|b| b.created_ns_matches(&doc));
            let b = match kept {
                Some(b) => {
                    *b.pins.write().expect("cache pins") = doc.pins.clone();
                    b
                }
                None => self.install_bucket(self.bucket_of(&doc)?),
            };
            next.insert(doc.bucket.clone(), b);
        }
        *self.buckets.write().expect("caches") = next;
        Ok(())
    }

    fn bucket_of(&self, doc: &CacheDoc) -> Result<CacheBucket, CacheError> {
        let corrupt = |reason: String| CacheError::Corrupt {
            what: doc_key(&doc.bucket),
            reason,
        };
        let credentials = match (&doc.access_key, &doc.secret) {
            (Some(a), Some(s)) => {
                let secret = self
                    .iam
                    .decrypt(&credential_label(&doc.bucket, a), s)
                    .ok_or_else(|| {
                        corrupt(
                            "the upstream secret does not decrypt: was the root secret key changed?"
                                .into(),
                        )
                    })?;
                Some((a.clone(), secret))
            }
            _ => None,
        };
        let upstream = Upstream::new(
            &doc.endpoint,
            &doc.upstream_bucket,
            &doc.upstream_prefix,
            &doc.region,
            credentials,
            doc.ca.as_deref(),
        )
        .map_err(corrupt)?;
        Ok(CacheBucket {
            name: doc.bucket.clone(),
            chunks_bucket: format!("{CHUNKS_BUCKET_PREFIX}{}", doc.bucket),
            upstream,
            validate: Validate::parse(&doc.validate).map_err(corrupt)?,
            writes: Writes::parse(&doc.writes).map_err(corrupt)?,
            size: doc.size,
            replicas: doc.replicas,
            stats: CacheStats::default(),
            store: self.store.clone(),
            entries: Mutex::new(HashMap::new()),
            negative: Mutex::new(HashMap::new()),
            fills: Mutex::new(HashMap::new()),
            fill_slots: self.fills.clone(),
            created_ns: doc.created_ns,
            resident: Mutex::new(HashMap::new()),
            used: AtomicU64::new(0),
            pins: RwLock::new(doc.pins.clone()),
            shared: self.shared.clone(),
            counted: Default::default(),
        })
    }

    /// Makes `name` a cache bucket of `spec`: the bucket, its internal
    /// bucket and its settings. The upstream is asked first (a listing of
    /// one key), so a wrong endpoint, bucket or key is refused here.
    pub async fn add(&self, name: &str, spec: CacheSpec) -> Result<serde_json::Value, CacheError> {
        tarn_store::validate_bucket_name(name)?;
        let (upstream_bucket, upstream_prefix) =
            parse_upstream(&spec.upstream).map_err(CacheError::Invalid)?;
        let validate = Validate::parse(spec.validate.as_deref().unwrap_or("ttl=60"))
            .map_err(CacheError::Invalid)?;
        let writes = Writes::parse(spec.writes.as_deref().unwrap_or("refuse"))
            .map_err(CacheError::Invalid)?;
        if spec.size == Some(0) {
            return Err(CacheError::Invalid("--size must be at least 1 byte".into()));
        }
        let durability = match spec.replicas {
            None => Durability::ErasureCoded,
            Some(0) => return Err(CacheError::Invalid("--replicas must be at least 1".into())),
            Some(n) => Durability::Replicated(n),
        };
        let credentials = match (spec.access_key, spec.secret_key) {
            (Some(a), Some(s)) if !a.is_empty() => Some((a, s)),
            (None, None) => None,
            _ => {
                return Err(CacheError::Invalid(
                    "upstream credentials need both an access key and a secret key".into(),
                ))
            }
        };
        let region = spec.region.unwrap_or_else(|| "us-east-1".into());
        let probe = Upstream::new(
            &spec.endpoint,
            &upstream_bucket,
            &upstream_prefix,
            &region,
            credentials.clone(),
            spec.ca.as_deref(),
        )
        .map_err(CacheError::Invalid)?;
        probe.list("", None, None, None, 1).await.map_err(|e| {
            CacheError::Invalid(format!(
                "the upstream s3://{upstream_bucket}/{upstream_prefix} at {} cannot be listed: {e}",
                spec.endpoint
            ))
        })?;
        let _g = self.changes.lock().await;
        if self.get(name).is_some() || self.store.bucket_created_ns(name).is_some() {
            return Err(CacheError::Exists(name.to_string()));
        }
        let doc = CacheDoc {
            format: DOC_FORMAT,
            bucket: name.to_string(),
            upstream_bucket,
            upstream_prefix,
            endpoint: spec.endpoint.trim_end_matches('/').to_string(),
            region,
            secret: credentials
                .as_ref()
                .map(|(a, s)| self.iam.encrypt(&credential_label(name, a), s)),
            access_key: credentials.map(|(a, _)| a),
            validate: validate.to_string(),
            writes: writes.as_str().into(),
            size: spec.size,
            replicas: spec.replicas,
            created_ns: now_ns(),
            pins: Vec::new(),
            ca: spec.ca.clone(),
        };
        let chunks = format!("{CHUNKS_BUCKET_PREFIX}{name}");
        match self.store.create_internal_bucket(&chunks, durability).await {
            Ok(()) | Err(StoreError::BucketExists(_)) => {}
            Err(e) => return Err(e.into()),
        }
        // The settings before the bucket: a bucket that exists is never an
        // ordinary one by mistake, even for a moment.
        sysdoc::write(&self.store, &doc_key(name), &doc).await?;
        if let Err(e) = self.store.create_bucket(name, durability).await {
            let _ = sysdoc::delete(&self.store, &doc_key(name)).await;
            return Err(match e {
                StoreError::BucketExists(_) => CacheError::Exists(name.to_string()),
                e => e.into(),
            });
        }
        let b = self.install_bucket(self.bucket_of(&doc)?);
        let summary = b.summary();
        self.buckets
            .write()
            .expect("caches")
            .insert(name.to_string(), b);
        Ok(summary)
    }

    /// Removes a cache bucket: its cached objects, its internal bucket, its
    /// settings and the bucket itself. The upstream is not touched.
    pub async fn remove(&self, name: &str) -> Result<serde_json::Value, CacheError> {
        let _g = self.changes.lock().await;
        let b = self
            .get(name)
            .ok_or_else(|| CacheError::NoSuchCache(name.to_string()))?;
        let entries = delete_all(&self.store, name).await?;
        let chunks = delete_all(&self.store, &b.chunks_bucket).await?;
        match self.store.delete_bucket(&b.chunks_bucket).await {
            Ok(()) | Err(StoreError::NoSuchBucket(_)) => {}
            Err(e) => return Err(e.into()),
        }
        match self.store.delete_bucket(name).await {
            Ok(()) | Err(StoreError::NoSuchBucket(_)) => {}
            Err(e) => return Err(e.into()),
        }
        sysdoc::delete(&self.store, &doc_key(name)).await?;
        self.buckets.write().expect("caches").remove(name);
        Ok(serde_json::json!({
            "bucket": name,
            "entries_removed": entries,
            "chunks_removed": chunks,
        }))
    }
}

impl Caches {
    /// Pins `prefix` of cache bucket `name` (for `ttl` seconds, or until
    /// unpinned): its objects are never evicted. Kept with the settings.
    pub async fn pin(
        &self,
        name: &str,
        prefix: &str,
        ttl: Option<u64>,
    ) -> Result<Vec<Pin>, CacheError> {
        let until_ns = ttl.map(|s| now_ns() + s.saturating_mul(1_000_000_000));
        self.change_pins(name, |pins| {
            pins.retain(|p| p.prefix != prefix);
            pins.push(Pin {
                prefix: prefix.to_string(),
                until_ns,
            });
            Ok(())
        })
        .await
    }

    pub async fn unpin(&self, name: &str, prefix: &str) -> Result<Vec<Pin>, CacheError> {
        self.change_pins(name, |pins| {
            let before = pins.len();
            pins.retain(|p| p.prefix != prefix);
            if pins.len() == before {
                return Err(CacheError::Invalid(format!(
                    "cache bucket {name} has no pin of prefix {prefix:?}"
                )));
            }
            Ok(())
        })
        .await
    }

    async fn change_pins(
        &self,
        name: &str,
        change: impl FnOnce(&mut Vec<Pin>) -> Result<(), CacheError>,
    ) -> Result<Vec<Pin>, CacheError> {
        let _g = self.changes.lock().await;
        let b = self
            .get(name)
            .ok_or_else(|| CacheError::NoSuchCache(name.to_string()))?;
        let key = doc_key(name);
        let mut doc: CacheDoc = serde_json::from_slice(&sysdoc::read(&self.store, &key).await?)
            .map_err(|e| CacheError::Corrupt {
                what: key.clone(),
                reason: e.to_string(),
            })?;
        let now = now_ns();
        doc.pins.retain(|p| p.until_ns.is_none_or(|u| u > now));
        change(&mut doc.pins)?;
        sysdoc::write(&self.store, &key, &doc).await?;
        *b.pins.write().expect("cache pins") = doc.pins.clone();
        Ok(doc.pins)
    }
}

fn credential_label(bucket: &str, access_key: &str) -> String {
    format!("cache:{bucket}:{access_key}")
}

/// Deletes every object of `bucket`; how many.
async fn delete_all(store: &Arc<Store>, bucket: &str) -> Result<u64, StoreError> {
    let mut n = 0;
    loop {
        let page = match engine_page(store, bucket, "", None, None).await {
            Ok(p) => p,
            Err(StoreError::NoSuchBucket(_)) => return Ok(n),
            Err(e) => return Err(e),
        };
        if page.objects.is_empty() {
            return Ok(n);
        }
        for o in page.objects {
            match store.delete_object(bucket, &o.key, None).await {
                Ok(_) | Err(StoreError::NoSuchKey { .. }) => n += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Deletes the chunks of one generation.
/// Keys asked of the engine per page when a cache lists its own buckets.
const ENGINE_PAGE: usize = 1000;

/// One page of the engine's listing of `bucket`: keys under `prefix` after
/// `after`, folded at `delimiter` when given.
async fn engine_page(
    store: &Arc<Store>,
    bucket: &str,
    prefix: &str,
    delimiter: Option<&str>,
    after: Option<String>,
) -> Result<tarn_store::ListPage, StoreError> {
    store
        .list_objects(
            bucket,
            ListParams {
                prefix: prefix.to_string(),
                delimiter: delimiter.map(str::to_string),
                after,
                max_keys: ENGINE_PAGE,
            },
        )
        .await
}

async fn delete_generation(
    store: &Arc<Store>,
    bucket: &str,
    generation: &str,
) -> Result<u64, StoreError> {
    let mut n = 0;
    let mut after = None;
    loop {
        let page = engine_page(
            store,
            bucket,
            &format!("{generation}/"),
            None,
            after.clone(),
        )
        .await?;
        for o in &page.objects {
            match store.delete_object(bucket, &o.key, None).await {
                Ok(_) | Err(StoreError::NoSuchKey { .. }) => n += 1,
                Err(e) => return Err(e),
            }
        }
        if !page.is_truncated {
            return Ok(n);
        }
        after = page.next_after;
    }
}
