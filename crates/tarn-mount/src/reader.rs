//! An open file for reading: one version of an object (its ETag: every
//! request names it, so a handle never mixes two versions), read through the
//! object client in segments.
//!
//! Sequential reads grow a read-ahead window of segments in flight, from
//! one to `window_max`; a read that jumps elsewhere fetches just the bytes
//! it asks for and starts the window again. The first segment is read when
//! the file is opened, so a file of up to one segment is whole in the
//! handle from its open on: it keeps its content even if the object is
//! replaced while open. A later segment of a replaced object cannot be
//! read any more (unversioned buckets keep no old versions): that read
//! fails with EIO and the log says why, never with bytes of the new one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tarn_client::object::{Buffer, Failure, HostMemory, ObjectClient, Read};

use crate::cache::Cache;
use crate::errno::{from_client, Errno};
use crate::pool::Pool;

/// Bytes per segment: the first read at open, and the read-ahead unit.
pub const SEGMENT: u64 = 8 << 20;
/// A read starting this close to where the last one ended is sequential.
const NEAR: u64 = 2 << 20;

pub struct Reader {
    pub bucket: String,
    pub key: String,
    pub etag: String,
    pub size: u64,
    client: ObjectClient,
    pool: Arc<Pool>,
    cache: Option<Arc<Cache>>,
    window_max: u64,
    /// Its inode was opened for overwriting through this mount.
    superseded: AtomicBool,
    state: Mutex<State>,
    landed: Condvar,
}

#[derive(Default)]
struct State {
    segments: BTreeMap<u64, Segment>,
    /// The segment the reader is in, where its last read ended, and how
    /// many segments in a row it read sequentially.
    last: Option<u64>,
    end: Option<u64>,
    streak: u32,
}

enum Segment {
    Pending,
    Ready(Bytes),
    Failed(Errno),
}

/// Bytes read into a buffer of the client's, and how many of them.
#[derive(Clone)]
pub struct Bytes {
    buf: Buffer,
    len: usize,
}

impl Bytes {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: only completed reads make a `Bytes`; nothing writes the
        // buffer after.
        unsafe { &self.buf.as_slice()[..self.len] }
    }
}

/// What a read gives: a piece of one segment, or bytes put together from
/// several.
pub enum Data {
    Piece(Bytes, usize, usize),
    Joined(Vec<u8>),
}

impl Data {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Data::Piece(b, x, y) => &b.as_slice()[*x..*y],
            Data::Joined(v) => v,
        }
    }
}

/// Reads of this size or more go into [`HostMemory`]: a short-circuit read
/// maps the shard files' verified pages there instead of copying them (the
/// reply to the kernel is then the only copy), and memory read over HTTP is
/// fresh pages, never zeroed by hand.
const HOST_MEMORY_MIN: usize = 1 << 20;

/// Memory for `len` bytes read.
pub(crate) fn buffer(len: usize) -> Buffer {
    if len >= HOST_MEMORY_MIN {
        if let Ok(m) = HostMemory::new(len) {
            let ptr = m.as_ptr();
            // SAFETY: the buffer owns the memory (`keep`), which stays
            // mapped until the last clone of the buffer goes.
            return unsafe { Buffer::from_raw(ptr, len, m) };
        }
    }
    Buffer::zeroed(len)
}

impl Reader {
    /// Opens a version: reads its first segment (all of a small file) now.
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        client: &ObjectClient,
        pool: &Arc<Pool>,
        cache: Option<&Arc<Cache>>,
        bucket: &str,
        key: &str,
        etag: &str,
        size: u64,
        window_max: u64,
    ) -> Result<Arc<Reader>, Errno> {
        let r = Arc::new(Reader {
            bucket: bucket.to_string(),
            key: key.to_string(),
            etag: etag.to_string(),
            size,
            client: client.clone(),
            pool: pool.clone(),
            cache: cache.cloned(),
            window_max: window_max.max(1),
            superseded: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            landed: Condvar::new(),
        });
        if size > 0 {
            let first = r.fetch_segment(0)?;
            r.lock().segments.insert(0, Segment::Ready(first));
        }
        Ok(r)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `[offset, offset + len)` of this version, straight from the bucket.
    fn fetch(&self, offset: u64, len: u64) -> Result<Bytes, Errno> {
        let buf = buffer(len as usize);
        let read = Read::new(&self.bucket, &self.key, offset, len, &buf, 0, 0);
        let read = if self.etag.is_empty() {
            read
        } else {
            read.if_match(&self.etag)
        };
        let res = self
            .client
            .read(&[read])
            .map_err(|e| from_client(&e, &self.bucket, &self.key))?;
        match res.into_iter().next().expect("one result per read") {
            Ok(_) => {}
            Err(e) => {
                if e.failure == Failure::Changed {
                    tracing::warn!(
                        "s3://{}/{}: replaced while open (ETag {} no longer matches): \
                         bytes {offset}..{} of the version this handle opened are gone",
                        self.bucket,
                        self.key,
                        self.etag,
                        offset + len
                    );
                }
                // The version is gone (replaced or deleted): ESTALE, which
                // an open turns into a fresh lookup and a read into EIO.
                if matches!(e.failure, Failure::Changed | Failure::NotFound { .. }) {
                    return Err(libc::ESTALE);
                }
                return Err(crate::errno::from_object(&e));
            }
        }
        Ok(Bytes {
            buf,
            len: len as usize,
        })
    }

    /// Segment `seg` of this version: from the cache directory if it is
    /// there, else from the bucket (and then kept there).
    fn fetch_segment(&self, seg: u64) -> Result<Bytes, Errno> {
        let base = seg * SEGMENT;
        let len = (self.size - base).min(SEGMENT);
        if let Some(c) = &self.cache {
            if let Some(buf) = c.get(&self.bucket, &self.key, &self.etag, base, len) {
                return Ok(Bytes {
                    buf,
                    len: len as usize,
                });
            }
        }
        let got = self.fetch(base, len)?;
        if let Some(c) = &self.cache {
            c.put(&self.bucket, &self.key, &self.etag, base, got.as_slice());
        }
        Ok(got)
    }

    /// Its inode is being overwritten through this mount: every later read
    /// that reaches it fails with EIO (the kernel's page cache of the inode
    /// holds only what is written from then on).
    pub fn supersede(&self) {
        self.superseded.store(true, Ordering::Relaxed);
    }

    /// Bytes `[offset, offset + len)` (fewer at the end of the file).
    pub fn read(self: &Arc<Self>, offset: u64, len: u32) -> Result<Data, Errno> {
        if self.superseded.load(Ordering::Relaxed) {
            tracing::warn!(
                "s3://{}/{}: overwritten through this mount while open: \
                 the version this handle opened cannot be read any more",
                self.bucket,
                self.key
            );
            return Err(libc::EIO);
        }
        self.read_inner(offset, len).map_err(|e| match e {
            libc::ESTALE => libc::EIO,
            e => e,
        })
    }

    fn read_inner(self: &Arc<Self>, offset: u64, len: u32) -> Result<Data, Errno> {
        if offset >= self.size || len == 0 {
            return Ok(Data::Joined(Vec::new()));
        }
        let end = (offset + len as u64).min(self.size);
        let first = offset / SEGMENT;
        let last = (end - 1) / SEGMENT;
        let sequential = {
            let mut st = self.lock();
            // Sequential: what was fetched already, or close to where the
            // last read ended (the kernel's reads of one stream arrive a
            // little out of order).
            let near = st
                .end
                .is_some_and(|e| offset <= e + NEAR && offset + NEAR >= e);
            let seq = near || st.segments.contains_key(&first);
            if seq {
                // The window doubles each time the reader enters the next
                // segment.
                if st.last.is_some_and(|l| last > l) {
                    st.streak = st.streak.saturating_add(1);
                }
                st.last = Some(st.last.map_or(last, |l| l.max(last)));
                st.end = Some(st.end.map_or(end, |e| e.max(end)));
            } else {
                st.streak = 0;
                st.last = Some(last);
                st.end = Some(end);
            }
            seq
        };
        if !sequential {
            // Somewhere else: just these bytes, no read-ahead (from the
            // cache directory when their segment is there). The next read
            // that follows on from here starts the window.
            if first == last
                && self
                    .cache
                    .as_ref()
                    .is_some_and(|c| c.has(&self.bucket, &self.key, &self.etag, first * SEGMENT))
            {
                let data = self.fetch_segment(first)?;
                let base = first * SEGMENT;
                return Ok(Data::Piece(
                    data,
                    (offset - base) as usize,
                    (end - base) as usize,
                ));
            }
            let out = self.fetch(offset, end - offset)?;
            let n = out.len;
            return Ok(Data::Piece(out, 0, n));
        }
        self.read_ahead(last);
        let piece = |seg: u64, data: &Bytes| {
            let base = seg * SEGMENT;
            let a = (offset.max(base) - base) as usize;
            let b = (end.min(base + data.len as u64) - base) as usize;
            (a, b)
        };
        let out = if first == last {
            let data = self.segment(first)?;
            let (a, b) = piece(first, &data);
            Data::Piece(data, a, b)
        } else {
            let mut out = Vec::with_capacity((end - offset) as usize);
            for seg in first..=last {
                let data = self.segment(seg)?;
                let (a, b) = piece(seg, &data);
                out.extend_from_slice(&data.as_slice()[a..b]);
            }
            Data::Joined(out)
        };
        // Segments behind the reader are done with.
        let mut st = self.lock();
        let keep_from = first.saturating_sub(1);
        st.segments.retain(|&s, _| s >= keep_from);
        Ok(out)
    }

    /// Starts the segments after `seg` that the window covers.
    fn read_ahead(self: &Arc<Self>, seg: u64) {
        let segments = self.size.div_ceil(SEGMENT);
        let mut st = self.lock();
        let window = (1u64 << st.streak.min(16)).min(self.window_max);
        for s in seg + 1..(seg + 1 + window).min(segments) {
            if st.segments.contains_key(&s) {
                continue;
            }
            st.segments.insert(s, Segment::Pending);
            let me = self.clone();
            let queued = self.pool.spawn(move || {
                let got = me.fetch_segment(s);
                let mut st = me.lock();
                st.segments.insert(
                    s,
                    match got {
                        Ok(d) => Segment::Ready(d),
                        Err(e) => Segment::Failed(e),
                    },
                );
                drop(st);
                me.landed.notify_all();
            });
            if !queued {
                // Nobody will fetch it: the read that needs it does.
                st.segments.remove(&s);
            }
        }
    }

    /// Segment `seg`, waiting for it if it is in flight, reading it now if
    /// nobody is.
    fn segment(&self, seg: u64) -> Result<Bytes, Errno> {
        let mut st = self.lock();
        loop {
            match st.segments.get(&seg) {
                Some(Segment::Ready(d)) => return Ok(d.clone()),
                Some(Segment::Failed(e)) => {
                    let e = *e;
                    // Tried again by the next read, not remembered.
                    st.segments.remove(&seg);
                    return Err(e);
                }
                Some(Segment::Pending) => {
                    st = self.landed.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                None => {
                    st.segments.insert(seg, Segment::Pending);
                    drop(st);
                    let got = self.fetch_segment(seg);
                    st = self.lock();
                    match got {
                        Ok(d) => {
                            st.segments.insert(seg, Segment::Ready(d.clone()));
                            self.landed.notify_all();
                            return Ok(d);
                        }
                        Err(e) => {
                            st.segments.remove(&seg);
                            self.landed.notify_all();
                            return Err(e);
                        }
                    }
                }
            }
        }
    }
}
