//! The workers behind the object client: a queue of requests, a cap on the
//! bytes in flight, one thread and one keep-alive connection per worker, and
//! the hedge an idle worker runs for a request that is late.
//!
//! A ranged GET (a [`Chunk`]) is read from the socket straight into the
//! destinations of the reads it carries. When it fails in a way worth
//! retrying, the next attempt asks only for the bytes not yet received. A
//! hedge reads the same range into memory of its own; if it finishes first,
//! it stops the first attempt (cutting its socket), waits until that attempt
//! no longer writes, and copies its bytes in. Exactly one of them completes
//! the request, and no byte is written into a destination after its read's
//! completion has been reported.

use std::collections::VecDeque;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::config::{parse_endpoint, Addressing, ClientConfig};
use super::http::{self, Body, Conn, Head};
use super::plan;
use super::upload::PartJob;
use super::{
    xml, Counters, DirListing, Error, Failure, Listed, ObjectError, ObjectInfo, ReadState,
    RingState, Stats, UploadInfo,
};
use crate::sigv4::{uri_encode, Signer};

/// Largest error or listing body read into memory.
const SMALL_BODY_MAX: usize = 16 << 20;
/// How often idle workers look for a late request to hedge.
const HEDGE_POLL: Duration = Duration::from_millis(10);
/// Recent request durations kept for the hedge's median.
const LATENCY_WINDOW: usize = 64;

pub(crate) struct Endpoint {
    pub addrs: Vec<SocketAddr>,
    pub host: String,
    pub url: String,
    /// For an https:// endpoint: its roots and the certificate's name.
    pub tls: Option<super::http::TlsTarget>,
}

/// One S3 call: method, object (an empty key names the bucket), query
/// pairs (decoded) and extra headers.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub method: &'a str,
    pub bucket: &'a str,
    pub key: &'a str,
    pub query: &'a [(&'a str, &'a str)],
    pub headers: &'a [(&'a str, String)],
}

impl<'a> Call<'a> {
    pub fn new(method: &'a str, bucket: &'a str, key: &'a str) -> Call<'a> {
        Call {
            method,
            bucket,
            key,
            query: &[],
            headers: &[],
        }
    }

    pub fn query(self, query: &'a [(&'a str, &'a str)]) -> Call<'a> {
        Call { query, ..self }
    }

    pub fn headers(self, headers: &'a [(&'a str, String)]) -> Call<'a> {
        Call { headers, ..self }
    }
}

pub(crate) struct Shared {
    pub cfg: ClientConfig,
    pub endpoints: Vec<Endpoint>,
    signer: Option<Signer>,
    sched: Mutex<Sched>,
    wake: Condvar,
    pub counters: Counters,
    latency: Mutex<VecDeque<f64>>,
    /// Idle connections for requests made on the caller's thread (HEAD,
    /// listings, starting and completing uploads).
    control: Mutex<Vec<Conn>>,
    next_endpoint: AtomicUsize,
    /// Short-circuit reads, when on (`ClientConfig::local_reads`) and signed.
    pub local: Option<super::local::Local>,
}

pub(crate) enum Job {
    Chunk(Arc<Chunk>),
    Part(Arc<PartJob>),
}

impl Job {
    fn bytes(&self) -> u64 {
        match self {
            Job::Chunk(c) => c.end - c.start,
            Job::Part(p) => p.len,
        }
    }
}

#[derive(Default)]
struct Sched {
    queue: VecDeque<Job>,
    inflight: u64,
    /// Requests being read now (for the hedge).
    running: Vec<Arc<Chunk>>,
    hedges: usize,
    closed: bool,
}

/// A ranged GET and the reads it carries.
pub(crate) struct Chunk {
    pub bucket: Arc<str>,
    pub key: Arc<str>,
    pub etag: Option<Arc<str>>,
    pub start: u64,
    pub end: u64,
    /// (object offset, length, read), in offset order, not overlapping.
    pub pieces: Vec<(u64, u64, Arc<ReadState>)>,
    ring: Arc<RingState>,
    /// Set by whoever completes the request (the first attempt, its hedge,
    /// or a failure): exactly once.
    finished: AtomicBool,
    /// The first attempt must stop writing (its hedge won).
    stop: AtomicBool,
    run: Mutex<Run>,
    run_changed: Condvar,
}

#[derive(Default)]
struct Run {
    started: Option<Instant>,
    /// The socket the first attempt is reading (to cut it).
    fd: Option<i32>,
    /// The first attempt is inside the body loop, writing destinations.
    writing: bool,
    hedged: bool,
    hedge_running: bool,
    /// The first attempt gave up while a hedge was still running: the hedge
    /// reports this if it fails too.
    given_up: Option<(Failure, u32)>,
}

impl Chunk {
    pub(crate) fn new(
        bucket: Arc<str>,
        key: Arc<str>,
        etag: Option<Arc<str>>,
        req: &plan::Request,
        reads: &[Arc<ReadState>],
        ring: Arc<RingState>,
    ) -> Arc<Chunk> {
        Arc::new(Chunk {
            bucket,
            key,
            etag,
            start: req.start,
            end: req.end,
            pieces: req
                .pieces
                .iter()
                .map(|p| (p.offset, p.len, reads[p.read].clone()))
                .collect(),
            ring,
            finished: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            run: Mutex::new(Run::default()),
            run_changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Run> {
        self.run.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cancelled(&self) -> bool {
        self.ring.cancelled.load(Ordering::Relaxed)
    }

    /// Reports the request to each of its reads (once).
    fn complete(&self, failure: Option<(Failure, u32)>) {
        let err = failure.map(|(f, attempts)| ObjectError {
            bucket: self.bucket.clone(),
            key: self.key.clone(),
            range: Some((self.start, self.end)),
            failure: f,
            attempts,
        });
        for (_, _, read) in &self.pieces {
            read.request_done(err.as_ref());
        }
    }
}

/// How one attempt ended, when not in success.
enum Attempt {
    /// Stop: the failure stands.
    Fatal(Failure),
    /// Worth another try. `stale` when a reused connection failed before
    /// any answer (the server had closed it): retried at once, uncounted.
    Transient(Failure, bool),
}

fn io_failure(e: &std::io::Error) -> Failure {
    let kind = e.kind();
    let message = match kind {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "no progress within the I/O timeout".to_string()
        }
        _ => e.to_string(),
    };
    Failure::Io { kind, message }
}

fn stale(conn: &Conn, e: &std::io::Error) -> bool {
    conn.uses > 1
        && matches!(
            e.kind(),
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::ConnectionAborted
        )
}

impl Shared {
    pub(crate) fn start(mut cfg: ClientConfig) -> Result<Arc<Shared>, Error> {
        if cfg.endpoints.is_empty() {
            return Err(Error::Usage("no endpoint".into()));
        }
        if cfg.connections == 0 {
            return Err(Error::Usage("connections must be at least 1".into()));
        }
        if cfg.chunk_bytes == 0 || cfg.stripe_bytes == 0 {
            return Err(Error::Usage(
                "chunk and stripe sizes must be positive".into(),
            ));
        }
        cfg.chunk_bytes = cfg.chunk_bytes.div_ceil(cfg.stripe_bytes) * cfg.stripe_bytes;
        let mut endpoints = Vec::new();
        let mut tls_config = None;
        for e in &cfg.endpoints {
            let (dial, host, https) = parse_endpoint(e)?;
            let tls = if https {
                if tls_config.is_none() {
                    tls_config = Some(
                        tarn_io::tls::client_config(cfg.ca_bundle.as_deref()).map_err(|why| {
                            Error::Usage(match &cfg.ca_bundle {
                                Some(p) => format!("CA bundle {}: {why}", p.display()),
                                None => format!("the system's trusted roots: {why}"),
                            })
                        })?,
                    );
                }
                let name = tarn_io::tls::server_name(&dial)
                    .map_err(|why| Error::Usage(format!("endpoint {e}: {why}")))?;
                Some((tls_config.clone().expect("made above"), name))
            } else {
                None
            };
            let addrs: Vec<SocketAddr> = dial
                .to_socket_addrs()
                .map_err(|err| Error::Usage(format!("endpoint {e}: {err}")))?
                .collect();
            if addrs.is_empty() {
                return Err(Error::Usage(format!("endpoint {e}: no address")));
            }
            endpoints.push(Endpoint {
                addrs,
                host,
                url: e.clone(),
                tls,
            });
        }
        let signer = cfg.credentials.as_ref().map(|c| Signer {
            access_key: c.access_key.clone(),
            secret_key: c.secret_key.clone(),
            region: cfg.region.clone(),
            session_token: c.session_token.clone(),
        });
        let shared = Arc::new(Shared {
            signer,
            endpoints,
            sched: Mutex::new(Sched::default()),
            wake: Condvar::new(),
            counters: Counters::default(),
            latency: Mutex::new(VecDeque::new()),
            control: Mutex::new(Vec::new()),
            next_endpoint: AtomicUsize::new(0),
            local: cfg
                .credentials
                .clone()
                .filter(|_| cfg.local_reads)
                .map(|c| super::local::Local::new(c, cfg.io_timeout)),
            cfg,
        });
        for i in 0..shared.cfg.connections {
            let sh = shared.clone();
            std::thread::Builder::new()
                .name(format!("tarn-object-{i}"))
                .spawn(move || worker(sh, i))
                .map_err(|e| Error::Usage(format!("starting worker threads: {e}")))?;
        }
        Ok(shared)
    }

    /// An object response that names the node's local-read socket (the
    /// node is on this host): later reads try it.
    pub(crate) fn note_local(&self, h: &Head) {
        if let (Some(local), Some(name)) = (&self.local, h.header(tarn_wire::local::HEADER)) {
            local.announced(name);
        }
    }

    pub(crate) fn chunk_bytes(&self) -> u64 {
        self.cfg.chunk_bytes
    }

    fn sched(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn close(&self) {
        self.sched().closed = true;
        self.wake.notify_all();
    }

    /// Cuts the sockets of a cancelled ring's running requests, so they stop
    /// now rather than at their next byte.
    pub(crate) fn cancel_ring(&self, ring: &Arc<RingState>) {
        let s = self.sched();
        for c in s.running.iter().filter(|c| Arc::ptr_eq(&c.ring, ring)) {
            if let Some(fd) = c.lock().fd {
                Conn::shutdown_fd(fd);
            }
        }
        drop(s);
        self.wake.notify_all();
    }

    pub(crate) fn enqueue(&self, chunks: Vec<Arc<Chunk>>) {
        let mut s = self.sched();
        s.queue.extend(chunks.into_iter().map(Job::Chunk));
        drop(s);
        self.wake.notify_all();
    }

    pub(crate) fn enqueue_parts(&self, parts: Vec<Arc<PartJob>>) {
        let mut s = self.sched();
        s.queue.extend(parts.into_iter().map(Job::Part));
        drop(s);
        self.wake.notify_all();
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut s = self.counters.snapshot();
        if let Some(l) = &self.local {
            let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            s.local_bytes = g(&l.counters.bytes);
            s.local_fallback_bytes = g(&l.counters.fallback_bytes);
            s.local_mapped_bytes = g(&l.counters.mapped_bytes);
            s.local_grants = g(&l.counters.grants);
        }
        s
    }

    /// The wait before retry `attempt` (1-based): exponential with jitter.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        let base = self.cfg.backoff_base.as_secs_f64() * 2f64.powi(attempt.min(16) as i32 - 1);
        let capped = base.min(self.cfg.backoff_max.as_secs_f64());
        let mut r = [0u8; 2];
        let _ = getrandom::fill(&mut r);
        let jitter = 0.5 + f64::from(u16::from_le_bytes(r)) / f64::from(u16::MAX) / 2.0;
        Duration::from_secs_f64(capped * jitter)
    }

    /// The request head for one S3 call, signed.
    pub(crate) fn request_head(&self, endpoint: usize, call: &Call<'_>, body_len: u64) -> Vec<u8> {
        let Call {
            method,
            bucket,
            key,
            query,
            headers,
        } = *call;
        let ep = &self.endpoints[endpoint];
        let (host, path) = match self.cfg.addressing {
            Addressing::Path if key.is_empty() => (ep.host.clone(), format!("/{bucket}")),
            Addressing::Path => (ep.host.clone(), format!("/{bucket}/{key}")),
            Addressing::Virtual => (format!("{bucket}.{}", ep.host), format!("/{key}")),
        };
        let mut uri = uri_encode(&path, true);
        if !query.is_empty() {
            let q: Vec<String> = query
                .iter()
                .map(|(k, v)| {
                    if v.is_empty() {
                        uri_encode(k, false)
                    } else {
                        format!("{}={}", uri_encode(k, false), uri_encode(v, false))
                    }
                })
                .collect();
            uri.push('?');
            uri.push_str(&q.join("&"));
        }
        let mut h = format!("{method} {uri} HTTP/1.1\r\nHost: {host}\r\n");
        if method != "GET" && method != "HEAD" || body_len > 0 {
            h.push_str(&format!("Content-Length: {body_len}\r\n"));
        }
        for (k, v) in headers {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(s) = &self.signer {
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            for (k, v) in s.sign(method, &host, &path, query, unix) {
                h.push_str(&format!("{k}: {v}\r\n"));
            }
        }
        h.push_str("\r\n");
        h.into_bytes()
    }

    pub(crate) fn connect(&self, endpoint: usize) -> Result<Conn, Failure> {
        let ep = &self.endpoints[endpoint];
        let mut last = None;
        for a in &ep.addrs {
            let timeouts = (self.cfg.connect_timeout, self.cfg.io_timeout);
            match Conn::connect(a, endpoint, timeouts, ep.tls.as_ref()) {
                Ok(c) => {
                    self.counters
                        .connections_opened
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e) => last = Some(e),
            }
        }
        let e = last.expect("an endpoint has addresses");
        Err(Failure::Io {
            kind: e.kind(),
            message: format!("connecting to {}: {e}", ep.url),
        })
    }

    /// The endpoint for a worker's connection, moved on after a failure.
    pub(crate) fn pick_endpoint(&self, hint: usize) -> usize {
        if self.endpoints.len() == 1 {
            0
        } else {
            (hint + self.next_endpoint.fetch_add(1, Ordering::Relaxed)) % self.endpoints.len()
        }
    }

    /// A request made on the calling thread (HEAD, listings, upload control),
    /// with retries. Returns the head and the (small) body.
    pub(crate) fn control(
        &self,
        call: &Call<'_>,
        body: &[u8],
    ) -> Result<(Head, Vec<u8>), (Failure, u32)> {
        let method = call.method;
        let mut attempt = 0u32;
        let mut endpoint = 0usize;
        loop {
            let pooled = self.control.lock().unwrap_or_else(|p| p.into_inner()).pop();
            let mut conn = match pooled {
                Some(c) => c,
                None => match self.connect(endpoint) {
                    Ok(c) => c,
                    Err(f) => {
                        attempt += 1;
                        if attempt > self.cfg.retries {
                            return Err((f, attempt));
                        }
                        endpoint = self.pick_endpoint(endpoint + 1);
                        std::thread::sleep(self.backoff(attempt));
                        continue;
                    }
                },
            };
            let head = self.request_head(conn.endpoint, call, body.len() as u64);
            self.counters.requests.fetch_add(1, Ordering::Relaxed);
            let r = conn.send(&head, body).and_then(|_| conn.read_head());
            let result = match r {
                Ok(h) => {
                    self.note_local(&h);
                    let h = if method == "HEAD" {
                        http::head_of_head(h)
                    } else {
                        h
                    };
                    match conn.read_body_to_vec(&h, SMALL_BODY_MAX) {
                        Ok(b) => Ok((h, b)),
                        Err(e) => Err(Attempt::Transient(io_failure(&e), false)),
                    }
                }
                Err(e) => Err(Attempt::Transient(io_failure(&e), stale(&conn, &e))),
            };
            if conn.reusable() {
                self.control
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(conn);
            }
            let failure = match result {
                Ok((h, b)) if (200..300).contains(&h.status) => {
                    // S3 can answer 200 with an error inside (CompleteMultipartUpload).
                    let text = String::from_utf8_lossy(&b);
                    if h.status == 200 && method == "POST" && text.contains("<Error>") {
                        status_failure(500, &b)
                    } else {
                        return Ok((h, b));
                    }
                }
                Ok((h, b)) => status_failure(h.status, &b),
                Err(Attempt::Transient(_, true)) => continue,
                Err(Attempt::Transient(f, false)) | Err(Attempt::Fatal(f)) => f,
            };
            attempt += 1;
            if !failure.transient() || attempt > self.cfg.retries {
                return Err((failure, attempt));
            }
            self.counters.retries.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(self.backoff(attempt));
        }
    }

    pub(crate) fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo, Error> {
        let err = |f: Failure, attempts| ObjectError::new(bucket, key, None, f, attempts);
        let (h, _) = self
            .control(&Call::new("HEAD", bucket, key), &[])
            .map_err(|(f, a)| err(f, a))?;
        let size = h
            .header("content-length")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| err(Failure::Protocol("HEAD without Content-Length".into()), 1))?;
        Ok(ObjectInfo {
            size,
            etag: h.header("etag").unwrap_or_default().to_string(),
            last_modified: h.header("last-modified").unwrap_or_default().to_string(),
        })
    }

    /// Creates a bucket; one this account already owns is not an error.
    pub(crate) fn create_bucket(&self, bucket: &str) -> Result<(), Error> {
        match self.control(&Call::new("PUT", bucket, ""), &[]) {
            Ok(_) => Ok(()),
            Err((Failure::Status { code, .. }, _)) if code == "BucketAlreadyOwnedByYou" => Ok(()),
            Err((f, attempts)) => Err(ObjectError::new(bucket, "", None, f, attempts).into()),
        }
    }

    /// Deletes an object (one that is not there is not an error, as in S3).
    pub(crate) fn delete(&self, bucket: &str, key: &str) -> Result<(), Error> {
        match self.control(&Call::new("DELETE", bucket, key), &[]) {
            Ok(_) | Err((Failure::NotFound { .. }, _)) => Ok(()),
            Err((f, attempts)) => Err(ObjectError::new(bucket, key, None, f, attempts).into()),
        }
    }

    /// Multipart uploads in progress under `prefix` (ListMultipartUploads,
    /// all pages).
    pub(crate) fn list_uploads(
        &self,
        bucket: &str,
        prefix: &str,
    ) -> Result<Vec<UploadInfo>, Error> {
        let mut out = Vec::new();
        let mut markers: Option<(String, String)> = None;
        loop {
            let mut q: Vec<(&str, &str)> = vec![("uploads", ""), ("prefix", prefix)];
            if let Some((k, u)) = &markers {
                q.push(("key-marker", k));
                q.push(("upload-id-marker", u));
            }
            let (_, body) = self
                .control(&Call::new("GET", bucket, "").query(&q), &[])
                .map_err(|(f, a)| ObjectError::new(bucket, prefix, None, f, a))?;
            let doc = String::from_utf8_lossy(&body);
            for u in xml::blocks(&doc, "Upload") {
                out.push(UploadInfo {
                    key: xml::first(u, "Key").unwrap_or_default(),
                    upload_id: xml::first(u, "UploadId").unwrap_or_default(),
                    initiated: xml::first(u, "Initiated").unwrap_or_default(),
                });
            }
            let truncated = xml::first(&doc, "IsTruncated").as_deref() == Some("true");
            let next =
                xml::first(&doc, "NextKeyMarker").zip(xml::first(&doc, "NextUploadIdMarker"));
            if !truncated || next.is_none() || next == markers {
                return Ok(out);
            }
            markers = next;
        }
    }

    /// Aborts a multipart upload (one already gone is not an error).
    pub(crate) fn abort_upload(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<(), Error> {
        let q = [("uploadId", upload_id)];
        match self.control(&Call::new("DELETE", bucket, key).query(&q), &[]) {
            Ok(_) | Err((Failure::NotFound { .. }, _)) => Ok(()),
            Err((f, attempts)) => Err(ObjectError::new(bucket, key, None, f, attempts).into()),
        }
    }

    /// The first `len` bytes of an object (fewer if it is shorter) with its
    /// size and ETag, in one request: what a loader needs of a file's header.
    pub(crate) fn read_prefix(
        &self,
        bucket: &str,
        key: &str,
        len: u64,
    ) -> Result<(Vec<u8>, ObjectInfo), Error> {
        let err = |f: Failure, attempts| ObjectError::new(bucket, key, Some((0, len)), f, attempts);
        let range = [("Range", format!("bytes=0-{}", len.max(1) - 1))];
        let (h, body) = match self.control(&Call::new("GET", bucket, key).headers(&range), &[]) {
            Ok(r) => r,
            Err((Failure::Status { status: 416, .. }, _)) => {
                // An empty object has no byte 0.
                return Ok((
                    Vec::new(),
                    ObjectInfo {
                        size: 0,
                        etag: String::new(),
                        last_modified: String::new(),
                    },
                ));
            }
            Err((f, a)) => return Err(err(f, a).into()),
        };
        let etag = h.header("etag").unwrap_or_default().to_string();
        let size = match h.status {
            206 => h
                .header("content-range")
                .and_then(http::content_range)
                .and_then(|c| c.total)
                .ok_or_else(|| err(Failure::Protocol("206 without the object's size".into()), 1))?,
            _ => body.len() as u64,
        };
        let mut body = body;
        body.truncate(len as usize);
        let last_modified = h.header("last-modified").unwrap_or_default().to_string();
        Ok((
            body,
            ObjectInfo {
                size,
                etag,
                last_modified,
            },
        ))
    }

    pub(crate) fn list_dir(
        &self,
        bucket: &str,
        prefix: &str,
        limit: Option<usize>,
    ) -> Result<DirListing, Error> {
        let mut out = DirListing::default();
        self.list_pages(bucket, prefix, true, limit, |doc| {
            out.objects
                .extend(xml::blocks(doc, "Contents").into_iter().map(listed));
            for p in xml::blocks(doc, "CommonPrefixes") {
                if let Some(p) = xml::first(p, "Prefix") {
                    out.prefixes.push(p);
                }
            }
            let had = out.objects.len() + out.prefixes.len();
            match limit {
                Some(l) if had >= l => {
                    out.truncated = xml::first(doc, "IsTruncated").as_deref() == Some("true");
                    None
                }
                Some(l) => Some(l - had),
                None => Some(usize::MAX),
            }
        })?;
        Ok(out)
    }

    /// ListObjectsV2 page by page (`/`-delimited if asked), asking for
    /// `want` entries at first: `page` takes each page's document and says
    /// how many more entries are wanted (None: no more pages).
    fn list_pages(
        &self,
        bucket: &str,
        prefix: &str,
        delimited: bool,
        want: Option<usize>,
        mut page: impl FnMut(&str) -> Option<usize>,
    ) -> Result<(), Error> {
        let max_keys = |n: usize| (n < 1000).then(|| n.max(1).to_string());
        let mut token: Option<String> = None;
        let mut max: Option<String> = want.and_then(max_keys);
        loop {
            let mut q: Vec<(&str, &str)> = vec![("list-type", "2"), ("prefix", prefix)];
            if delimited {
                q.push(("delimiter", "/"));
            }
            if let Some(m) = &max {
                q.push(("max-keys", m));
            }
            if let Some(t) = &token {
                q.push(("continuation-token", t));
            }
            let (_, body) = self
                .control(&Call::new("GET", bucket, "").query(&q), &[])
                .map_err(|(f, a)| ObjectError::new(bucket, prefix, None, f, a))?;
            let doc = String::from_utf8_lossy(&body);
            let more = page(&doc);
            let truncated = xml::first(&doc, "IsTruncated").as_deref() == Some("true");
            token = xml::first(&doc, "NextContinuationToken");
            match more {
                Some(n) if truncated && token.is_some() => max = max_keys(n),
                _ => return Ok(()),
            }
        }
    }

    pub(crate) fn copy(
        &self,
        bucket: &str,
        src: &str,
        dst: &str,
        if_match: Option<&str>,
    ) -> Result<String, Error> {
        let err = |f: Failure, attempts| ObjectError::new(bucket, dst, None, f, attempts);
        let mut headers = vec![(
            "x-amz-copy-source",
            format!("/{bucket}/{}", uri_encode(src, true)),
        )];
        if let Some(e) = if_match {
            headers.push(("x-amz-copy-source-if-match", e.to_string()));
        }
        let (_, body) = self
            .control(&Call::new("PUT", bucket, dst).headers(&headers), &[])
            .map_err(|(f, a)| err(f, a))?;
        let doc = String::from_utf8_lossy(&body);
        // A copy can fail after its 200 (the error in the body, as S3 does).
        if let Some(code) = xml::first(&doc, "Code") {
            let message = xml::first(&doc, "Message").unwrap_or_default();
            return Err(err(
                Failure::Status {
                    status: 200,
                    code,
                    message,
                },
                1,
            )
            .into());
        }
        Ok(xml::first(&doc, "ETag").unwrap_or_default())
    }

    pub(crate) fn list(&self, bucket: &str, prefix: &str) -> Result<Vec<Listed>, Error> {
        let mut out = Vec::new();
        self.list_pages(bucket, prefix, false, None, |doc| {
            out.extend(xml::blocks(doc, "Contents").into_iter().map(listed));
            Some(usize::MAX)
        })?;
        Ok(out)
    }

    fn record_latency(&self, bytes: u64, took: Duration) {
        let mib = (bytes as f64 / (1u64 << 20) as f64).max(0.25);
        let mut l = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        if l.len() == LATENCY_WINDOW {
            l.pop_front();
        }
        l.push_back(took.as_secs_f64() / mib);
    }

    /// How long a request of `bytes` may run before it is hedged.
    fn hedge_after(&self, bytes: u64) -> Duration {
        let l = self.latency.lock().unwrap_or_else(|p| p.into_inner());
        let floor = self.cfg.hedge_min;
        if l.len() < 8 {
            // Too little to know what is normal yet.
            return floor.max(Duration::from_secs(1));
        }
        let mut v: Vec<f64> = l.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        let mib = (bytes as f64 / (1u64 << 20) as f64).max(0.25);
        floor.max(Duration::from_secs_f64(
            median * mib * self.cfg.hedge_factor,
        ))
    }
}

/// A failure from a non-success status and its S3 error body.
pub(crate) fn status_failure(status: u16, body: &[u8]) -> Failure {
    let text = String::from_utf8_lossy(body);
    let code = xml::first(&text, "Code").unwrap_or_default();
    let message = xml::first(&text, "Message").unwrap_or_default();
    match status {
        404 => Failure::NotFound {
            code: if code.is_empty() {
                "NoSuchKey".into()
            } else {
                code
            },
        },
        403 => Failure::Denied { code, message },
        412 => Failure::Changed,
        _ => Failure::Status {
            status,
            code,
            message,
        },
    }
}

enum Next {
    Job(Job),
    Hedge(Arc<Chunk>),
    Exit,
}

fn worker(sh: Arc<Shared>, index: usize) {
    let mut conn: Option<Conn> = None;
    loop {
        match next(&sh) {
            Next::Exit => return,
            Next::Job(Job::Chunk(c)) => {
                let bytes = c.end - c.start;
                run_chunk(&sh, &mut conn, &c, index);
                let mut s = sh.sched();
                s.inflight -= bytes;
                s.running.retain(|r| !Arc::ptr_eq(r, &c));
                drop(s);
                sh.wake.notify_all();
            }
            Next::Job(Job::Part(p)) => {
                let bytes = p.len;
                super::upload::run_part(&sh, &mut conn, &p, index);
                sh.sched().inflight -= bytes;
                sh.wake.notify_all();
            }
            Next::Hedge(c) => {
                run_hedge(&sh, &mut conn, &c, index);
                sh.sched().hedges -= 1;
                sh.wake.notify_all();
            }
        }
    }
}

/// The next job that fits under the cap, else a late request to hedge, else
/// a wait.
fn next(sh: &Shared) -> Next {
    let mut s = sh.sched();
    loop {
        if s.closed && s.queue.is_empty() {
            return Next::Exit;
        }
        if let Some(front) = s.queue.front() {
            let bytes = front.bytes();
            if s.inflight == 0 || s.inflight + bytes <= sh.cfg.max_inflight_bytes {
                let job = s.queue.pop_front().expect("front exists");
                s.inflight += bytes;
                if let Job::Chunk(c) = &job {
                    c.lock().started = Some(Instant::now());
                    s.running.push(c.clone());
                }
                return Next::Job(job);
            }
        }
        if sh.cfg.hedge && s.hedges < (sh.cfg.connections / 4).max(1) && s.queue.is_empty() {
            let now = Instant::now();
            let late = s.running.iter().find(|c| {
                let r = c.lock();
                !r.hedged
                    && !c.finished.load(Ordering::Relaxed)
                    && r.started
                        .is_some_and(|t| now - t > sh.hedge_after(c.end - c.start))
            });
            if let Some(c) = late.cloned() {
                c.lock().hedged = true;
                s.hedges += 1;
                return Next::Hedge(c);
            }
        }
        s = if sh.cfg.hedge && !s.running.is_empty() {
            sh.wake
                .wait_timeout(s, HEDGE_POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0
        } else {
            sh.wake.wait(s).unwrap_or_else(|p| p.into_inner())
        };
    }
}

/// A connection for this worker: its own if it has one, else a new one.
pub(crate) fn ensure<'a>(
    sh: &Shared,
    conn: &'a mut Option<Conn>,
    index: usize,
) -> Result<&'a mut Conn, Failure> {
    if conn.as_ref().is_some_and(|c| !c.reusable()) {
        *conn = None;
    }
    if conn.is_none() {
        *conn = Some(sh.connect(sh.pick_endpoint(index))?);
    }
    Ok(conn.as_mut().expect("just set"))
}

/// The first attempt and its retries: the bytes a local read could not
/// give (all of them without local reads) over HTTP, span by span.
fn run_chunk(sh: &Shared, conn: &mut Option<Conn>, c: &Arc<Chunk>, index: usize) {
    let t0 = Instant::now();
    let mut spans = vec![(c.start, c.end)];
    let mut etag = c.etag.clone();
    if let Some(local) = sh.local.as_ref().filter(|l| l.known()) {
        // Local reads write the destinations themselves: no hedge.
        c.lock().hedged = true;
        (spans, etag) = local.read_chunk(c);
    }
    let mut attempts = 0u32;
    let mut result = Ok(());
    for span in spans {
        if let Err((f, a)) = fetch_span(sh, conn, c, span, etag.as_deref(), index) {
            attempts += a;
            result = Err(f);
            break;
        }
    }
    let mut r = c.lock();
    match result {
        Ok(()) => {
            drop(r);
            if !c.finished.swap(true, Ordering::AcqRel) {
                sh.record_latency(c.end - c.start, t0.elapsed());
                c.complete(None);
            }
        }
        Err(f) => {
            if r.hedge_running && !c.finished.load(Ordering::Acquire) && f != Failure::Cancelled {
                // The hedge may still bring the bytes; it reports this if not.
                r.given_up = Some((f, attempts));
                return;
            }
            drop(r);
            if !c.finished.swap(true, Ordering::AcqRel) {
                c.complete(Some((f, attempts.max(1))));
            }
        }
    }
}

/// Object bytes `span` of the chunk over HTTP, with retries: the failure
/// that stands and the attempts made.
fn fetch_span(
    sh: &Shared,
    conn: &mut Option<Conn>,
    c: &Arc<Chunk>,
    span: (u64, u64),
    etag: Option<&str>,
    index: usize,
) -> Result<(), (Failure, u32)> {
    // Bytes of the span received, in order.
    let mut done = 0u64;
    let mut attempts = 0u32;
    loop {
        if c.finished.load(Ordering::Acquire) {
            return Ok(());
        }
        if c.cancelled() || c.stop.load(Ordering::Acquire) {
            return Err((Failure::Cancelled, attempts));
        }
        attempts += 1;
        match fetch(sh, conn, c, span, etag, &mut done, index) {
            Ok(()) => return Ok(()),
            Err(Attempt::Fatal(f)) => return Err((f, attempts)),
            Err(Attempt::Transient(_, true)) => {
                // A keep-alive connection the server had closed: again, now.
                attempts -= 1;
                *conn = None;
            }
            Err(Attempt::Transient(f, false)) => {
                *conn = None;
                if attempts > sh.cfg.retries {
                    return Err((f, attempts));
                }
                sh.counters.retries.fetch_add(1, Ordering::Relaxed);
                // Sleep, but wake for a cancel or a hedge that won.
                let deadline = Instant::now() + sh.backoff(attempts);
                let mut r = c.lock();
                while Instant::now() < deadline
                    && !c.finished.load(Ordering::Acquire)
                    && !c.cancelled()
                {
                    let left = deadline.saturating_duration_since(Instant::now());
                    r = c
                        .run_changed
                        .wait_timeout(r, left.min(Duration::from_millis(50)))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }
}

/// One attempt: GET the bytes not yet received, straight into the reads'
/// destinations.
fn fetch(
    sh: &Shared,
    conn: &mut Option<Conn>,
    c: &Chunk,
    (start, to): (u64, u64),
    etag: Option<&str>,
    done: &mut u64,
    index: usize,
) -> Result<(), Attempt> {
    let from = start + *done;
    let cn = ensure(sh, conn, index).map_err(|f| Attempt::Transient(f, false))?;
    let head = range_request(sh, cn.endpoint, c, (from, to), etag);
    {
        let mut r = c.lock();
        if c.stop.load(Ordering::Acquire) {
            return Err(Attempt::Fatal(Failure::Cancelled));
        }
        r.fd = Some(cn.fd());
    }
    let result = fetch_on(sh, cn, c, (start, from, to), etag, done, &head);
    // Never leave the descriptor where a hedge could cut it after this.
    c.lock().fd = None;
    if result.is_err() {
        cn.mark_broken();
    }
    result
}

fn range_request(
    sh: &Shared,
    endpoint: usize,
    c: &Chunk,
    (from, to): (u64, u64),
    etag: Option<&str>,
) -> Vec<u8> {
    let mut headers = vec![("Range", format!("bytes={}-{}", from, to - 1))];
    if let Some(e) = etag {
        headers.push(("If-Match", e.to_string()));
    }
    sh.counters.requests.fetch_add(1, Ordering::Relaxed);
    sh.request_head(
        endpoint,
        &Call::new("GET", &c.bucket, &c.key).headers(&headers),
        0,
    )
}

fn fetch_on(
    sh: &Shared,
    cn: &mut Conn,
    c: &Chunk,
    (start, from, to): (u64, u64, u64),
    etag: Option<&str>,
    done: &mut u64,
    head_bytes: &[u8],
) -> Result<(), Attempt> {
    let head = match cn.send(head_bytes, &[]).and_then(|_| cn.read_head()) {
        Ok(h) => h,
        Err(e) => return Err(Attempt::Transient(io_failure(&e), stale(cn, &e))),
    };
    sh.note_local(&head);
    let skip = check_range(cn, (from, to), etag, &head)?;
    let Body::Length(_) = head.body else {
        return Err(Attempt::Fatal(Failure::Protocol(
            "a ranged GET answered without Content-Length".into(),
        )));
    };
    {
        let mut r = c.lock();
        if c.stop.load(Ordering::Acquire) {
            return Err(Attempt::Fatal(Failure::Cancelled));
        }
        r.writing = true;
    }
    let result = stream_body(sh, cn, c, (start, from, to), skip, done);
    {
        let mut r = c.lock();
        r.writing = false;
    }
    c.run_changed.notify_all();
    result?;
    if skip > 0 || to - from + skip < body_len(&head) {
        // A 200 with the whole object: the rest is not wanted.
        cn.mark_broken();
    } else {
        cn.finish(&head);
    }
    Ok(())
}

/// Checks a GET's answer. Returns how many body bytes precede `from` (a
/// server that ignored the Range and sent the whole object).
fn check_range(
    cn: &mut Conn,
    (from, to): (u64, u64),
    etag: Option<&str>,
    head: &Head,
) -> Result<u64, Attempt> {
    let want = to - from;
    match head.status {
        206 => {
            let cr = head.header("content-range").and_then(http::content_range);
            let Some(http::ContentRange {
                range: Some((a, b)),
                total,
            }) = cr
            else {
                return Err(Attempt::Fatal(Failure::Protocol(
                    "206 without a usable Content-Range".into(),
                )));
            };
            if a != from || b < a {
                return Err(Attempt::Fatal(Failure::Protocol(format!(
                    "asked for bytes {from}-{}, got {a}-{b}",
                    to - 1
                ))));
            }
            if b + 1 < to {
                return Err(Attempt::Fatal(Failure::OutOfRange { size: total }));
            }
            if b + 1 > to {
                return Err(Attempt::Fatal(Failure::Protocol(format!(
                    "asked for bytes {from}-{}, got {a}-{b}",
                    to - 1
                ))));
            }
            if head.body != Body::Length(want) {
                return Err(Attempt::Fatal(Failure::Protocol(format!(
                    "Content-Length {:?} for a range of {want} bytes",
                    head.body
                ))));
            }
            check_etag(etag, head)?;
            Ok(0)
        }
        200 => {
            let Body::Length(n) = head.body else {
                return Err(Attempt::Fatal(Failure::Protocol(
                    "200 without Content-Length".into(),
                )));
            };
            if n < to {
                return Err(Attempt::Fatal(Failure::OutOfRange { size: Some(n) }));
            }
            check_etag(etag, head)?;
            Ok(from)
        }
        status => {
            let body = cn
                .read_body_to_vec(head, SMALL_BODY_MAX)
                .unwrap_or_default();
            if status == 416 {
                let size = head
                    .header("content-range")
                    .and_then(http::content_range)
                    .and_then(|c| c.total);
                return Err(Attempt::Fatal(Failure::OutOfRange { size }));
            }
            let f = status_failure(status, &body);
            Err(if f.transient() {
                Attempt::Transient(f, false)
            } else {
                Attempt::Fatal(f)
            })
        }
    }
}

fn body_len(h: &Head) -> u64 {
    match h.body {
        Body::Length(n) => n,
        _ => u64::MAX,
    }
}

fn check_etag(etag: Option<&str>, head: &Head) -> Result<(), Attempt> {
    if let (Some(want), Some(got)) = (etag, head.header("etag")) {
        if want.trim_matches('"') != got.trim_matches('"') {
            return Err(Attempt::Fatal(Failure::Changed));
        }
    }
    Ok(())
}

/// Reads the body into the pieces' destinations; bytes between pieces (and
/// `skip` bytes before `from`) are dropped. `done` follows every byte.
fn stream_body(
    sh: &Shared,
    cn: &mut Conn,
    c: &Chunk,
    (start, from, to): (u64, u64, u64),
    mut skip: u64,
    done: &mut u64,
) -> Result<(), Attempt> {
    let mut scratch = [0u8; 16 << 10];
    let transient = |e: std::io::Error| Attempt::Transient(io_failure(&e), false);
    while skip > 0 {
        let n = cn
            .read_body(&mut scratch[..skip.min(16 << 10) as usize])
            .map_err(transient)?;
        if n == 0 {
            return Err(transient(http::truncated()));
        }
        sh.counters
            .bytes_received
            .fetch_add(n as u64, Ordering::Relaxed);
        skip -= n as u64;
    }
    let mut at = from;
    for (off, len, read) in &c.pieces {
        let end = (off + len).min(to);
        if end <= at {
            continue;
        }
        while at < end {
            if c.stop.load(Ordering::Acquire) || c.cancelled() {
                return Err(Attempt::Fatal(Failure::Cancelled));
            }
            let n = if at < *off {
                // A gap between merged reads.
                let gap = (off - at).min(scratch.len() as u64) as usize;
                cn.read_body(&mut scratch[..gap]).map_err(transient)?
            } else {
                let want = (end - at) as usize;
                // SAFETY: the destination lies inside the read's buffer
                // (checked at submit), which the read state keeps mapped; no
                // other request writes these bytes (the planner gives each
                // byte to one request), and a hedge writes only after this
                // attempt left the body loop.
                let dst = unsafe { std::slice::from_raw_parts_mut(read.dst_at(at), want) };
                cn.read_body(dst).map_err(transient)?
            };
            if n == 0 {
                return Err(transient(http::truncated()));
            }
            sh.counters
                .bytes_received
                .fetch_add(n as u64, Ordering::Relaxed);
            at += n as u64;
            *done = at - start;
        }
    }
    Ok(())
}

/// A second reading of a late request into memory of its own; the first to
/// finish completes the request.
fn run_hedge(sh: &Shared, conn: &mut Option<Conn>, c: &Arc<Chunk>, index: usize) {
    {
        let mut r = c.lock();
        if c.finished.load(Ordering::Acquire) || c.cancelled() {
            return;
        }
        r.hedge_running = true;
    }
    sh.counters.hedges.fetch_add(1, Ordering::Relaxed);
    let len = (c.end - c.start) as usize;
    let mut scratch = vec![0u8; len];
    let got = hedge_fetch(sh, conn, c, index, &mut scratch);
    let mut r = c.lock();
    r.hedge_running = false;
    if got.is_err() {
        // A failed hedge changes nothing: the first attempt goes on (or, if
        // it gave up meanwhile, its failure stands).
        *conn = None;
        if let Some((f, attempts)) = r.given_up.take() {
            drop(r);
            if !c.finished.swap(true, Ordering::AcqRel) {
                c.complete(Some((f, attempts)));
            }
        }
        return;
    }
    if c.finished.swap(true, Ordering::AcqRel) {
        return;
    }
    // Won: stop the first attempt and wait until it no longer writes.
    c.stop.store(true, Ordering::Release);
    if let Some(fd) = r.fd {
        Conn::shutdown_fd(fd);
    }
    while r.writing {
        r = c.run_changed.wait(r).unwrap_or_else(|p| p.into_inner());
    }
    drop(r);
    for (off, plen, read) in &c.pieces {
        let from = (off - c.start) as usize;
        // SAFETY: as in `stream_body`; the first attempt has stopped writing
        // and will not start again (`stop` is set under the same lock).
        unsafe {
            std::ptr::copy_nonoverlapping(
                scratch.as_ptr().add(from),
                read.dst_at(*off),
                *plen as usize,
            );
        }
    }
    sh.counters.hedges_won.fetch_add(1, Ordering::Relaxed);
    c.complete(None);
}

/// One attempt at the whole range into `scratch`; `Err(None)` when the
/// request finished meanwhile.
fn hedge_fetch(
    sh: &Shared,
    conn: &mut Option<Conn>,
    c: &Chunk,
    index: usize,
    scratch: &mut [u8],
) -> Result<(), Option<Failure>> {
    let cn = ensure(sh, conn, index + 1).map_err(Some)?;
    let head = range_request(sh, cn.endpoint, c, (c.start, c.end), c.etag.as_deref());
    let h = cn
        .send(&head, &[])
        .and_then(|_| cn.read_head())
        .map_err(|e| Some(io_failure(&e)))?;
    let skip = check_range(cn, (c.start, c.end), c.etag.as_deref(), &h).map_err(|a| match a {
        Attempt::Fatal(f) | Attempt::Transient(f, _) => Some(f),
    })?;
    if skip > 0 {
        return Err(Some(Failure::Protocol("no range support".into())));
    }
    let mut at = 0;
    while at < scratch.len() {
        if c.finished.load(Ordering::Acquire) || c.cancelled() {
            cn.mark_broken();
            return Err(None);
        }
        let end = (at + (1 << 20)).min(scratch.len());
        let n = cn
            .read_body(&mut scratch[at..end])
            .map_err(|e| Some(io_failure(&e)))?;
        if n == 0 {
            return Err(Some(io_failure(&http::truncated())));
        }
        sh.counters
            .bytes_received
            .fetch_add(n as u64, Ordering::Relaxed);
        at += n;
    }
    cn.finish(&h);
    Ok(())
}

/// A listing's `<Contents>` entry.
fn listed(c: &str) -> Listed {
    Listed {
        key: xml::first(c, "Key").unwrap_or_default(),
        size: xml::first(c, "Size")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        etag: xml::first(c, "ETag").unwrap_or_default(),
        last_modified: xml::first(c, "LastModified").unwrap_or_default(),
    }
}
