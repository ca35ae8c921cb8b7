//! The object client: S3 reads and writes at the speed of the network, with
//! the batched interface of 3FS USRBIO: register a buffer, submit many
//! `(bucket, key, offset, length, buffer offset, user data)` reads to a
//! [`Ring`], wait for their completions.
//!
//! Behind the ring, reads of one object that lie close together are merged,
//! long ones are cut into stripe-aligned ranged GETs ([`plan`]), and a pool of
//! worker threads, each with one keep-alive connection, runs them: the body of
//! each response is read from the socket straight into the registered buffer.
//! A request that fails in a way worth retrying (a connection reset, a 503, a
//! body that stalls) is retried from the byte it reached, with backoff; one
//! that runs far longer than its peers is hedged (an idle connection reads
//! the same range; the first answer wins); the bytes of requests in flight
//! are capped. Writes are multipart uploads whose parts go out in parallel
//! from a registered buffer, each with its CRC32C for the server to check.
//!
//! ```no_run
//! use tarn_client::object::{Buffer, ClientConfig, ObjectClient, Read};
//! let client = ObjectClient::new(ClientConfig::from_env()?)?;
//! let buf = Buffer::zeroed(64 << 20);
//! let ring = client.ring();
//! ring.submit(&[Read::new("models", "llama/model-00001.safetensors", 0, 64 << 20, &buf, 0, 7)])?;
//! for c in ring.wait(1, None) {
//!     println!("read {} done: {:?}", c.user_data, c.result);
//! }
//! # Ok::<(), tarn_client::object::Error>(())
//! ```

pub mod config;
mod engine;
mod hostmem;
pub(crate) mod http;
mod local;
pub mod plan;
mod upload;
pub mod xml;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use config::{Addressing, ClientConfig, S3Credentials};
pub use hostmem::HostMemory;
pub use upload::{Multipart, PutOptions};

use engine::{Chunk, Shared};

/// What went wrong with a request, after whatever retries it got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// 404: no such key (or bucket; the code says which).
    NotFound { code: String },
    /// 403: the credentials may not do this.
    Denied { code: String, message: String },
    /// 412: the object is no longer the version the read named (its ETag
    /// changed while it was being read).
    Changed,
    /// The object ends before the bytes asked for (416, or a shorter object).
    OutOfRange { size: Option<u64> },
    /// Any other answer that is not success.
    Status {
        status: u16,
        code: String,
        message: String,
    },
    /// The network: refused, reset, closed mid-body, or no progress for the
    /// I/O timeout.
    Io {
        kind: std::io::ErrorKind,
        message: String,
    },
    /// The server's answer did not make sense (a wrong Content-Range...).
    Protocol(String),
    /// The ring was cancelled or dropped first.
    Cancelled,
}

impl Failure {
    /// Worth another attempt.
    pub fn transient(&self) -> bool {
        match self {
            Failure::Io { .. } => true,
            Failure::Status { status, code, .. } => {
                matches!(status, 429 | 500 | 502 | 503 | 504)
                    || code == "SlowDown"
                    || code == "RequestTimeout"
            }
            _ => false,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NotFound { code } => write!(f, "not found ({code})"),
            Failure::Denied { code, message } => write!(f, "access denied ({code}: {message})"),
            Failure::Changed => write!(
                f,
                "the object changed while it was read (its ETag no longer matches)"
            ),
            Failure::OutOfRange { size: Some(n) } => {
                write!(f, "past the end of the object, which is {n} bytes")
            }
            Failure::OutOfRange { size: None } => write!(f, "past the end of the object"),
            Failure::Status {
                status,
                code,
                message,
            } => {
                write!(f, "HTTP {status}")?;
                if !code.is_empty() {
                    write!(f, " {code}")?;
                }
                if !message.is_empty() {
                    write!(f, ": {message}")?;
                }
                Ok(())
            }
            Failure::Io { message, .. } => write!(f, "{message}"),
            Failure::Protocol(m) => write!(f, "bad response: {m}"),
            Failure::Cancelled => write!(f, "cancelled"),
        }
    }
}

/// A failed read or write: which object, which bytes, what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectError {
    pub bucket: Arc<str>,
    pub key: Arc<str>,
    /// The bytes `[start, end)` of the request that failed, when it was a
    /// ranged one.
    pub range: Option<(u64, u64)>,
    pub failure: Failure,
    /// Attempts made (1 when it was not retried).
    pub attempts: u32,
}

impl ObjectError {
    /// The error of a request on `key` (or a prefix) of `bucket`, the bytes
    /// `range` when it was a ranged one.
    pub fn new(
        bucket: &str,
        key: &str,
        range: Option<(u64, u64)>,
        failure: Failure,
        attempts: u32,
    ) -> ObjectError {
        ObjectError {
            bucket: bucket.into(),
            key: key.into(),
            range,
            failure,
            attempts,
        }
    }
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)?;
        if let Some((a, b)) = self.range {
            if b > a {
                write!(f, " bytes {a}-{}", b - 1)?;
            } else {
                write!(f, " at byte {a}")?;
            }
        }
        write!(f, ": {}", self.failure)?;
        if self.attempts > 1 {
            write!(f, " (after {} attempts)", self.attempts)?;
        }
        Ok(())
    }
}

impl std::error::Error for ObjectError {}

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A call that cannot be made as asked (a read outside its buffer, a
    /// malformed endpoint): nothing was sent.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Object(Box<ObjectError>),
}

impl From<ObjectError> for Error {
    fn from(e: ObjectError) -> Self {
        Error::Object(Box::new(e))
    }
}

/// Memory reads land in and writes come from. Either owned (allocated here)
/// or registered caller memory ([`Buffer::from_raw`]); the memory stays
/// mapped while any clone of the buffer or any I/O on it lives.
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<BufferInner>,
}

struct BufferInner {
    ptr: *mut u8,
    len: usize,
    _owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the buffer is plain memory; who writes where is the rings'
// business (a submit refuses overlapping destinations in one batch).
unsafe impl Send for BufferInner {}
unsafe impl Sync for BufferInner {}

impl Buffer {
    /// `len` zeroed bytes owned by the buffer.
    pub fn zeroed(len: usize) -> Buffer {
        Buffer::from_vec(vec![0u8; len])
    }

    pub fn from_vec(v: Vec<u8>) -> Buffer {
        let mut v = v.into_boxed_slice();
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        Buffer {
            inner: Arc::new(BufferInner {
                ptr,
                len,
                _owner: Some(Box::new(v)),
            }),
        }
    }

    /// Registers caller memory. `keep` is dropped when the last clone of the
    /// buffer and the last I/O on it are gone (hold the memory's owner in it,
    /// or `()`).
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid for reads and writes until then, and
    /// nothing else may write it while a read into it is in flight.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, keep: impl Send + Sync + 'static) -> Buffer {
        Buffer {
            inner: Arc::new(BufferInner {
                ptr: if len == 0 {
                    std::ptr::NonNull::dangling().as_ptr()
                } else {
                    ptr
                },
                len,
                _owner: Some(Box::new(keep)),
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr
    }

    /// The bytes.
    ///
    /// # Safety
    /// No read into this buffer may be in flight.
    pub unsafe fn as_slice(&self) -> &[u8] {
        std::slice::from_raw_parts(self.inner.ptr, self.inner.len)
    }

    /// A copy of `len` bytes from `offset` (panics out of bounds).
    ///
    /// # Safety
    /// No read into those bytes may be in flight.
    pub unsafe fn copy_out(&self, offset: usize, len: usize) -> Vec<u8> {
        self.as_slice()[offset..offset + len].to_vec()
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("ptr", &self.inner.ptr)
            .field("len", &self.inner.len)
            .finish()
    }
}

/// One read: object bytes `[offset, offset + len)` into
/// `buffer[buffer_offset..]`; `user_data` comes back with its completion.
/// With `etag`, every request of the read asks for that version
/// (`If-Match`), so a read never mixes two versions of an object.
#[derive(Debug, Clone)]
pub struct Read<'a> {
    pub bucket: &'a str,
    pub key: &'a str,
    pub offset: u64,
    pub len: u64,
    pub buffer: &'a Buffer,
    pub buffer_offset: u64,
    pub user_data: u64,
    pub etag: Option<&'a str>,
}

impl<'a> Read<'a> {
    pub fn new(
        bucket: &'a str,
        key: &'a str,
        offset: u64,
        len: u64,
        buffer: &'a Buffer,
        buffer_offset: u64,
        user_data: u64,
    ) -> Read<'a> {
        Read {
            bucket,
            key,
            offset,
            len,
            buffer,
            buffer_offset,
            user_data,
            etag: None,
        }
    }

    pub fn if_match(mut self, etag: &'a str) -> Read<'a> {
        self.etag = Some(etag);
        self
    }
}

/// A finished read: the bytes read, or why not. When a completion is
/// returned no I/O into its destination is in flight any more.
#[derive(Debug, Clone)]
pub struct Completion {
    pub user_data: u64,
    pub result: Result<u64, ObjectError>,
}

/// What HEAD says of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    pub etag: String,
    /// The `Last-Modified` header as the server sent it (an HTTP date), or
    /// empty.
    pub last_modified: String,
}

/// One level of a `/`-delimited listing: the objects directly under the
/// prefix and the prefixes one level down (each ending in `/`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirListing {
    pub objects: Vec<Listed>,
    pub prefixes: Vec<String>,
    /// More entries were there than the limit asked for.
    pub truncated: bool,
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub key: String,
    pub size: u64,
    pub etag: String,
    /// As the listing gives it (ISO 8601, UTC).
    pub last_modified: String,
}

/// A multipart upload in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadInfo {
    pub key: String,
    pub upload_id: String,
    /// When it was created, as the listing gives it (ISO 8601, UTC).
    pub initiated: String,
}

/// Counters of one client since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// HTTP requests sent (retries and hedges included).
    pub requests: u64,
    /// Body bytes received (read into buffers, or dropped between merged
    /// reads, or by a hedge that lost).
    pub bytes_received: u64,
    /// Body bytes sent (uploads).
    pub bytes_sent: u64,
    pub retries: u64,
    pub hedges: u64,
    pub hedges_won: u64,
    pub connections_opened: u64,
    /// Bytes read from shard files on this host (short-circuit reads), not
    /// over HTTP.
    pub local_bytes: u64,
    /// Bytes a local read could not give (a shard elsewhere or unusable),
    /// read over HTTP instead.
    pub local_fallback_bytes: u64,
    /// Of `local_bytes`, those mapped from the shard files' page cache into
    /// [`HostMemory`] rather than copied.
    pub local_mapped_bytes: u64,
    /// Layouts granted by the local node.
    pub local_grants: u64,
}

/// The object client: cheap to clone, shared by threads. Its worker threads
/// end when the last clone (and the last ring) is dropped.
#[derive(Clone)]
pub struct ObjectClient {
    handle: Arc<Handle>,
}

struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.close();
    }
}

impl fmt::Debug for ObjectClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectClient")
            .field("endpoints", &self.handle.shared.cfg.endpoints)
            .finish_non_exhaustive()
    }
}

impl ObjectClient {
    pub fn new(cfg: ClientConfig) -> Result<ObjectClient, Error> {
        let shared = Shared::start(cfg)?;
        Ok(ObjectClient {
            handle: Arc::new(Handle { shared }),
        })
    }

    /// A client configured from the environment ([`ClientConfig::from_env`]).
    pub fn from_env() -> Result<ObjectClient, Error> {
        ObjectClient::new(ClientConfig::from_env()?)
    }

    pub fn config(&self) -> &ClientConfig {
        &self.handle.shared.cfg
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    /// A submission and completion queue.
    pub fn ring(&self) -> Ring {
        Ring {
            client: self.clone(),
            state: Arc::new(RingState::default()),
        }
    }

    /// Reads a batch and waits for all of it: one result per read, in order.
    pub fn read(&self, reads: &[Read<'_>]) -> Result<Vec<Result<u64, ObjectError>>, Error> {
        let ring = self.ring();
        let tagged: Vec<Read<'_>> = reads
            .iter()
            .enumerate()
            .map(|(i, r)| Read {
                user_data: i as u64,
                ..r.clone()
            })
            .collect();
        ring.submit(&tagged)?;
        let mut out: Vec<Option<Result<u64, ObjectError>>> = vec![None; reads.len()];
        let mut left = reads.len();
        while left > 0 {
            for c in ring.wait(left, None) {
                out[c.user_data as usize] = Some(c.result);
                left -= 1;
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every read completes"))
            .collect())
    }

    /// HEAD: the object's size and ETag.
    pub fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo, Error> {
        self.shared().head(bucket, key)
    }

    /// The first `len` bytes of an object (fewer if it is shorter), with its
    /// size and ETag, in one ranged GET.
    pub fn read_prefix(
        &self,
        bucket: &str,
        key: &str,
        len: u64,
    ) -> Result<(Vec<u8>, ObjectInfo), Error> {
        self.shared().read_prefix(bucket, key, len)
    }

    /// Creates a bucket (one this account already owns is not an error).
    pub fn create_bucket(&self, bucket: &str) -> Result<(), Error> {
        self.shared().create_bucket(bucket)
    }

    /// Every object under `prefix` (ListObjectsV2, all pages).
    pub fn list(&self, bucket: &str, prefix: &str) -> Result<Vec<Listed>, Error> {
        self.shared().list(bucket, prefix)
    }

    /// One level under `prefix` (ListObjectsV2 with delimiter `/`, every
    /// page, or until `limit` entries).
    pub fn list_dir(
        &self,
        bucket: &str,
        prefix: &str,
        limit: Option<usize>,
    ) -> Result<DirListing, Error> {
        self.shared().list_dir(bucket, prefix, limit)
    }

    /// Server-side copy of `src` to `dst` in one bucket (CopyObject);
    /// returns the new object's ETag. With `if_match`, only while `src` is
    /// still that version.
    pub fn copy(
        &self,
        bucket: &str,
        src: &str,
        dst: &str,
        if_match: Option<&str>,
    ) -> Result<String, Error> {
        self.shared().copy(bucket, src, dst, if_match)
    }

    /// Deletes an object (one that is not there is not an error).
    pub fn delete(&self, bucket: &str, key: &str) -> Result<(), Error> {
        self.shared().delete(bucket, key)
    }

    /// Multipart uploads in progress under `prefix`.
    pub fn list_uploads(&self, bucket: &str, prefix: &str) -> Result<Vec<UploadInfo>, Error> {
        self.shared().list_uploads(bucket, prefix)
    }

    /// Aborts a multipart upload: its parts are dropped.
    pub fn abort_upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<(), Error> {
        self.shared().abort_upload(bucket, key, upload_id)
    }

    /// Starts a multipart upload whose parts the caller sends one at a time
    /// (see [`Multipart`]); `opts` gives its content type and the
    /// conditions its completion carries.
    pub fn multipart(
        &self,
        bucket: &str,
        key: &str,
        opts: &PutOptions,
    ) -> Result<Multipart, Error> {
        upload::Multipart::create(self.shared(), bucket, key, opts)
    }

    /// Writes `buffer[offset..offset + len]` as object `key`: one PUT when it
    /// fits in a part, else a multipart upload whose parts go out in parallel
    /// (aborted if any part fails for good). Returns the ETag.
    pub fn put(
        &self,
        bucket: &str,
        key: &str,
        buffer: &Buffer,
        offset: u64,
        len: u64,
        opts: &PutOptions,
    ) -> Result<String, Error> {
        upload::put(self.shared(), bucket, key, buffer, offset, len, opts)
    }

    pub fn stats(&self) -> Stats {
        self.shared().stats()
    }
}

/// Bucket, key and (when reads name one) version ETag.
type ObjectName = (Arc<str>, Arc<str>, Option<Arc<str>>);

/// Completions not yet taken, and reads still running.
#[derive(Default)]
pub(crate) struct RingState {
    done: Mutex<RingDone>,
    changed: Condvar,
    cancelled: AtomicBool,
}

#[derive(Default)]
struct RingDone {
    queue: VecDeque<Completion>,
    outstanding: usize,
}

impl RingState {
    fn lock(&self) -> MutexGuard<'_, RingDone> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn complete(&self, c: Completion) {
        let mut d = self.lock();
        d.outstanding -= 1;
        d.queue.push_back(c);
        drop(d);
        self.changed.notify_all();
    }
}

/// A submission and completion queue (3FS's ior): `submit` queues reads and
/// returns at once; `wait` returns completions. Dropping a ring cancels what
/// it still has queued and waits until none of its I/O is in flight, so its
/// buffers may be freed after.
pub struct Ring {
    client: ObjectClient,
    state: Arc<RingState>,
}

/// The state one read carries until its last request finishes.
pub(crate) struct ReadState {
    ring: Arc<RingState>,
    user_data: u64,
    offset: u64,
    len: u64,
    /// Keeps the destination mapped.
    _buffer: Buffer,
    /// The destination: `buffer + buffer_offset`.
    dst: usize,
    requests_left: Mutex<(usize, Option<ObjectError>)>,
}

impl ReadState {
    /// One of its requests finished; the last one reports the read.
    pub(crate) fn request_done(&self, err: Option<&ObjectError>) {
        let mut g = self.requests_left.lock().unwrap_or_else(|p| p.into_inner());
        if let (Some(e), None) = (err, &g.1) {
            g.1 = Some(e.clone());
        }
        g.0 -= 1;
        if g.0 > 0 {
            return;
        }
        let result = match g.1.take() {
            Some(e) => Err(e),
            None => Ok(self.len),
        };
        drop(g);
        self.ring.complete(Completion {
            user_data: self.user_data,
            result,
        });
    }

    /// Where object byte `at` of this read goes.
    pub(crate) fn dst_at(&self, at: u64) -> *mut u8 {
        debug_assert!(at >= self.offset && at <= self.offset + self.len);
        (self.dst + (at - self.offset) as usize) as *mut u8
    }
}

impl Ring {
    /// Queues `reads`. Every read is checked first (its range inside its
    /// buffer, destinations of the batch not overlapping); a batch with a
    /// bad read is refused whole and nothing is queued.
    pub fn submit(&self, reads: &[Read<'_>]) -> Result<(), Error> {
        let sh = self.client.shared();
        check_batch(reads)?;
        if self.state.cancelled.load(Ordering::Relaxed) {
            return Err(Error::Usage("the ring was cancelled".into()));
        }
        // Reads of one object version share an index for the planner.
        let mut objects: HashMap<(&str, &str, Option<&str>), usize> = HashMap::new();
        let mut names: Vec<ObjectName> = Vec::new();
        let mut spans = Vec::with_capacity(reads.len());
        for r in reads {
            let n = objects.len();
            let id = *objects.entry((r.bucket, r.key, r.etag)).or_insert_with(|| {
                names.push((r.bucket.into(), r.key.into(), r.etag.map(Into::into)));
                n
            });
            spans.push(plan::Span {
                object: id,
                offset: r.offset,
                len: r.len,
            });
        }
        let chunk = sh.chunk_bytes();
        let planned = plan::plan(&spans, sh.cfg.merge_gap_bytes, chunk);
        let mut per_read = vec![0usize; reads.len()];
        for req in &planned {
            for p in &req.pieces {
                per_read[p.read] += 1;
            }
        }
        let states: Vec<Arc<ReadState>> = reads
            .iter()
            .enumerate()
            .map(|(i, r)| {
                Arc::new(ReadState {
                    ring: self.state.clone(),
                    user_data: r.user_data,
                    offset: r.offset,
                    len: r.len,
                    _buffer: r.buffer.clone(),
                    dst: r.buffer.as_ptr() as usize + r.buffer_offset as usize,
                    requests_left: Mutex::new((per_read[i], None)),
                })
            })
            .collect();
        self.state.lock().outstanding += reads.len();
        // Empty reads complete at once.
        for (i, st) in states.iter().enumerate() {
            if per_read[i] == 0 {
                self.state.complete(Completion {
                    user_data: st.user_data,
                    result: Ok(0),
                });
            }
        }
        let chunks: Vec<Arc<Chunk>> = planned
            .into_iter()
            .map(|req| {
                let (bucket, key, etag) = names[req.object].clone();
                Chunk::new(bucket, key, etag, &req, &states, self.state.clone())
            })
            .collect();
        sh.enqueue(chunks);
        Ok(())
    }

    /// Waits until at least `min` completions are ready (or fewer, when
    /// fewer reads are outstanding), or `timeout` passes, and returns every
    /// ready completion.
    pub fn wait(&self, min: usize, timeout: Option<Duration>) -> Vec<Completion> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut d = self.state.lock();
        loop {
            let target = min.min(d.queue.len() + d.outstanding);
            if d.queue.len() >= target {
                return d.queue.drain(..).collect();
            }
            d = match deadline {
                None => self
                    .state
                    .changed
                    .wait(d)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(t) => {
                    let now = Instant::now();
                    if now >= t {
                        return d.queue.drain(..).collect();
                    }
                    self.state
                        .changed
                        .wait_timeout(d, t - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Reads submitted whose completion has not been returned by `wait`.
    pub fn pending(&self) -> usize {
        let d = self.state.lock();
        d.outstanding + d.queue.len()
    }

    /// Stops what this ring has queued and cuts what it has running; each
    /// such read completes with [`Failure::Cancelled`]. The ring takes no
    /// more submissions.
    pub fn cancel(&self) {
        self.state.cancelled.store(true, Ordering::Relaxed);
        self.client.shared().cancel_ring(&self.state);
    }

    pub fn client(&self) -> &ObjectClient {
        &self.client
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.cancel();
        let mut d = self.state.lock();
        while d.outstanding > 0 {
            d = self
                .state
                .changed
                .wait(d)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Ranges inside their buffers; destinations that do not overlap.
fn check_batch(reads: &[Read<'_>]) -> Result<(), Error> {
    // Absolute addresses: distinct buffers over the same memory count too.
    let mut regions: Vec<(usize, usize, usize)> = Vec::with_capacity(reads.len());
    for (i, r) in reads.iter().enumerate() {
        if r.bucket.is_empty() || r.key.is_empty() {
            return Err(Error::Usage(format!("read {i}: empty bucket or key")));
        }
        let end = r.buffer_offset.checked_add(r.len);
        if end.is_none_or(|e| e > r.buffer.len() as u64) {
            return Err(Error::Usage(format!(
                "read {i} (s3://{}/{}): {} bytes at buffer offset {} do not fit in its buffer of {} bytes",
                r.bucket,
                r.key,
                r.len,
                r.buffer_offset,
                r.buffer.len()
            )));
        }
        if r.offset.checked_add(r.len).is_none() {
            return Err(Error::Usage(format!("read {i}: offset + length overflows")));
        }
        if r.len > 0 {
            let at = r.buffer.as_ptr() as usize + r.buffer_offset as usize;
            regions.push((at, at + r.len as usize, i));
        }
    }
    regions.sort();
    for w in regions.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        if b.0 < a.1 {
            return Err(Error::Usage(format!(
                "reads {} and {} write overlapping bytes of one buffer",
                a.2, b.2
            )));
        }
    }
    Ok(())
}

/// A counter cell for [`Stats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub requests: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub retries: AtomicU64,
    pub hedges: AtomicU64,
    pub hedges_won: AtomicU64,
    pub connections_opened: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> Stats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            requests: g(&self.requests),
            bytes_received: g(&self.bytes_received),
            bytes_sent: g(&self.bytes_sent),
            retries: g(&self.retries),
            hedges: g(&self.hedges),
            hedges_won: g(&self.hedges_won),
            connections_opened: g(&self.connections_opened),
            ..Stats::default()
        }
    }
}
