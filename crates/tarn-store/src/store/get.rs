//! The read path: read the k data shards of the stripes a range touches, verify
//! each block, reconstruct from parity when a shard is missing or corrupt, and
//! queue the object for healing.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use tarn_io::PooledBuf;
use tokio::sync::mpsc;

use super::{validate_key, Store};
use crate::checksum::crc32c;
use crate::codec::{codec_for, StripeGeometry};
use crate::drive_io::ShardSource;
use crate::error::StoreError;
use crate::format::{Layout, PartMeta, Storage, VersionMeta};
use crate::shard::ShardError;
use crate::types::{ByteRange, ObjectInfo, ReadConditions};

/// A GET's data goes to the HTTP layer in pieces of this size, each its own
/// allocation: what a client that stops reading keeps alive is what is queued
/// for it plus the one piece being written, not whole stripes.
pub(crate) const PIECE_BYTES: usize = 256 << 10;
/// Pieces queued ahead of the consumer: two stripes (of the default 1 MiB), so
/// that the next stripe is read while the socket takes the last (with room
/// for one stripe only, the read of a stripe waited until the client had
/// taken all of the one before: a third less throughput for large GETs).
/// Bounds memory per GET.
pub(crate) const READ_AHEAD_PIECES: usize = 8;

/// A piece of a GET's data and its share of the read-ahead budget, held
/// (never read) until the piece is dropped.
struct Piece(
    /// Runs of the piece that hold a shard file's bytes (`tarn_io::spans`),
    /// unregistered before the buffer goes back (fields drop in order).
    #[allow(dead_code)]
    Vec<tarn_io::spans::Registration>,
    PieceBuf,
    #[allow(dead_code)] Option<tokio::sync::OwnedSemaphorePermit>,
    #[allow(dead_code)] Option<tokio::sync::OwnedSemaphorePermit>,
);

/// A piece's bytes: a buffer of the store's piece pool (back to it when the
/// piece is dropped), or, for a piece larger than the pool's buffers (a
/// stripe over 1 MiB), its own.
enum PieceBuf {
    Pooled(PooledBuf),
    Own(BytesMut),
}

impl PieceBuf {
    async fn new(store: &Store, len: usize) -> PieceBuf {
        if len <= PIECE_BYTES {
            // The read-ahead budget, already held, leaves one free.
            if let Ok(b) = store.pieces.acquire(Duration::ZERO).await {
                return PieceBuf::Pooled(b);
            }
        }
        PieceBuf::Own(BytesMut::with_capacity(len))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            PieceBuf::Pooled(b) => b,
            PieceBuf::Own(b) => b,
        }
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        match self {
            PieceBuf::Pooled(b) => {
                let took = b.extend_from_slice(bytes);
                debug_assert_eq!(took, bytes.len());
            }
            PieceBuf::Own(b) => b.extend_from_slice(bytes),
        }
    }
}

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        self.1.bytes()
    }
}

/// The bytes of a GET, produced by a reader task on the same core.
pub struct ObjectStream {
    inner: StreamInner,
    remaining: u64,
}

enum StreamInner {
    Ready(Option<Bytes>),
    /// The first chunk, read before the response began, then the rest.
    Channel(Option<Bytes>, mpsc::Receiver<Result<Bytes, StoreError>>),
    /// An encrypted version's plaintext: the first block, opened before the
    /// response began, then the rest.
    Opened(
        Option<Bytes>,
        Pin<Box<dyn Stream<Item = Result<Bytes, StoreError>> + Send + Sync>>,
    ),
}

/// What a read of an encrypted version asks its caller: the version's data
/// key, given what the version is (its stored headers name how the key is
/// kept). Errors end the read before any byte is sent.
pub type Unseal<'a> =
    &'a (dyn Fn(&ObjectInfo) -> Result<crate::seal::DataKey, StoreError> + Send + Sync);

impl ObjectStream {
    /// Bytes still to come.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Collects the whole stream (tests and small objects).
    pub async fn collect(mut self) -> Result<Vec<u8>, StoreError> {
        use futures::StreamExt;
        let mut out = Vec::with_capacity(self.remaining as usize);
        while let Some(chunk) = self.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }
}

impl Stream for ObjectStream {
    type Item = Result<Bytes, StoreError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = match &mut self.inner {
            StreamInner::Ready(b) => Poll::Ready(b.take().map(Ok)),
            StreamInner::Channel(first, rx) => match first.take() {
                Some(b) => Poll::Ready(Some(Ok(b))),
                None => rx.poll_recv(cx),
            },
            StreamInner::Opened(first, s) => match first.take() {
                Some(b) => Poll::Ready(Some(Ok(b))),
                None => s.as_mut().poll_next(cx),
            },
        };
        if let Poll::Ready(Some(Ok(b))) = &item {
            self.remaining = self.remaining.saturating_sub(b.len() as u64);
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, None)
    }
}

/// What a GET returns besides the bytes.
pub struct GetResult {
    pub info: ObjectInfo,
    /// Half-open byte range served.
    pub range: (u64, u64),
    pub stream: ObjectStream,
}

impl Store {
    /// GET: the version (latest or given), optionally a byte range or one part.
    pub async fn get_object(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        range: Option<ByteRange>,
        part_number: Option<u32>,
    ) -> Result<GetResult, StoreError> {
        self.get_object_if(
            bucket,
            key,
            version,
            range,
            part_number,
            &ReadConditions::default(),
        )
        .await
    }

    /// GET with conditions, checked on the same metadata read that serves it.
    /// An encrypted version is refused (its key is not known here).
    pub async fn get_object_if(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        range: Option<ByteRange>,
        part_number: Option<u32>,
        conditions: &ReadConditions,
    ) -> Result<GetResult, StoreError> {
        let refuse = |_: &ObjectInfo| {
            Err(StoreError::InvalidRequest(
                "The object is encrypted: reading it needs its key.".into(),
            ))
        };
        self.get_object_with(
            bucket,
            key,
            version,
            range,
            part_number,
            conditions,
            &refuse,
        )
        .await
    }

    /// GET with conditions; an encrypted version is decrypted with the key
    /// `unseal` gives for it (only the blocks the range touches are read).
    #[allow(clippy::too_many_arguments)]
    pub async fn get_object_with(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        range: Option<ByteRange>,
        part_number: Option<u32>,
        conditions: &ReadConditions,
        unseal: Unseal<'_>,
    ) -> Result<GetResult, StoreError> {
        self.bucket_record(bucket)?;
        validate_key(key)?;
        let mut guard = self.lock_read(bucket, key).await?;
        let loc = self.locate(bucket, key).await?;
        let (set, rec, diverged) = (loc.set, loc.rec, loc.diverged);
        if diverged {
            self.queue_heal(bucket, key);
        }
        let (v, latest) = self.select_version(&rec, bucket, key, version)?;
        if v.delete_marker {
            return Err(StoreError::MethodNotAllowed);
        }
        let info = self.info_from(bucket, key, v, latest);
        conditions.check(&info)?;
        let (start, end) = match (part_number, range) {
            (Some(_), Some(_)) => {
                return Err(StoreError::InvalidArgument(
                    "Range and partNumber together".into(),
                ))
            }
            (Some(n), None) => info.part_range(n)?,
            (None, Some(r)) => r.resolve(v.size)?,
            (None, None) => (0, v.size),
        };
        // Inline bytes are read while the key's read lock is held (an overwrite
        // deletes them in its commit batch). Shard data is pinned instead, and
        // the lock is released before streaming: a slow reader never holds up
        // a writer's commit, and the writer defers deleting the shards the
        // reader still uses until it unpins.
        let sealed = match &v.seal {
            None => None,
            Some(_) => {
                let data_key = unseal(&info)?;
                let parts = v.sealed_parts().ok_or_else(|| StoreError::Unreadable {
                    bucket: bucket.into(),
                    key: key.into(),
                    reason: "an encrypted version without a salt for each part".into(),
                })?;
                (start < end)
                    .then(|| crate::seal::map_range(&data_key, &parts, start, end))
                    .transpose()?
            }
        };
        let (s0, s1) = match &sealed {
            Some(r) => r.stored,
            None if v.seal.is_some() => (0, 0),
            None => (start, end),
        };
        let mut pin = self.pin_data(set, v);
        pin.lease = guard.pin(self, set, pin.ids.clone()).await;
        let mut stream = self
            .stream_version(set, bucket, key, v.clone(), s0, s1, pin)
            .await?;
        drop(guard);
        if let Some(r) = sealed {
            // The first block is opened before the answer starts: a wrong
            // key or changed bytes are an error response, not a cut body.
            let mut opened = Box::pin(crate::seal::Opener::new(stream, r));
            let first = match opened.next().await {
                Some(Ok(b)) => Some(b),
                Some(Err(e)) => {
                    return Err(StoreError::Unreadable {
                        bucket: bucket.into(),
                        key: key.into(),
                        reason: e.to_string(),
                    })
                }
                None => None,
            };
            stream = ObjectStream {
                inner: StreamInner::Opened(first, opened),
                remaining: end - start,
            };
        }
        Ok(GetResult {
            info,
            range: (start, end),
            stream,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn stream_version(
        self: &Arc<Self>,
        set: usize,
        bucket: &str,
        key: &str,
        v: VersionMeta,
        start: u64,
        end: u64,
        pin: super::PinGuard,
    ) -> Result<ObjectStream, StoreError> {
        let remaining = end - start;
        match &v.storage {
            Storage::Inline { crc32c: want } => {
                let data = self.read_inline(set, bucket, key, &v, *want).await?;
                let b = Bytes::from(data).slice(start as usize..end as usize);
                Ok(ObjectStream {
                    inner: StreamInner::Ready(if b.is_empty() { None } else { Some(b) }),
                    remaining,
                })
            }
            Storage::Parts(_) if start == end => Ok(ObjectStream {
                inner: StreamInner::Ready(None),
                remaining: 0,
            }),
            Storage::Parts(_) => {
                let (tx, mut rx) = mpsc::channel(READ_AHEAD_PIECES);
                let store = self.clone();
                let (bucket, key) = (bucket.to_string(), key.to_string());
                let caller = super::CALLER_READ_AHEAD.try_with(Arc::clone).ok();
                // Views only where the bytes go untouched to the connection:
                // an encrypted version's are opened on the way.
                let views =
                    v.seal.is_none() && super::SENDS_FROM_FILES.try_with(|s| *s).unwrap_or(false);
                let read = async move {
                    let _pin = pin;
                    if let Err(e) = store
                        .send_range(set, &bucket, &key, &v, start, end, views, &tx)
                        .await
                    {
                        tracing::error!(%bucket, %key, error = %e, "read failed mid-stream");
                        let _ = tx.send(Err(e)).await;
                    }
                };
                match caller {
                    Some(c) => tokio::spawn(super::CALLER_READ_AHEAD.scope(c, read)),
                    None => tokio::spawn(read),
                };
                // The first stripe is read before the answer starts: a read
                // that cannot get buffers (503) or finds the object unreadable
                // is an error response, never a 200 whose body breaks off.
                match rx.recv().await {
                    Some(Ok(first)) => Ok(ObjectStream {
                        inner: StreamInner::Channel(Some(first), rx),
                        remaining,
                    }),
                    Some(Err(e)) => Err(e),
                    None => Err(StoreError::from(std::io::Error::other(
                        "the object's read ended before any data",
                    ))),
                }
            }
        }
    }

    /// Inline data from the first drive whose copy verifies.
    pub(crate) async fn read_inline(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        v: &VersionMeta,
        want: u32,
    ) -> Result<Vec<u8>, StoreError> {
        let mut bad = false;
        for pos in 0..self.set_size(set) {
            let Some(db) = self.slot(set, pos).db() else {
                continue;
            };
            let read = db
                .inline_data(
                    bucket.to_string(),
                    key.to_string(),
                    v.version_id,
                    v.mod_time_ns,
                )
                .await;
            match read {
                Ok(Some(data)) if crc32c(&data) == want && data.len() as u64 == v.inline_len() => {
                    if bad {
                        self.queue_heal(bucket, key);
                    }
                    return Ok(data);
                }
                _ => bad = true,
            }
        }
        Err(StoreError::Unreadable {
            bucket: bucket.into(),
            key: key.into(),
            reason: "no drive holds a valid copy of the inline data".into(),
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn send_range(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        v: &VersionMeta,
        start: u64,
        end: u64,
        views: bool,
        tx: &mpsc::Sender<Result<Bytes, StoreError>>,
    ) -> Result<(), StoreError> {
        let Storage::Parts(parts) = &v.storage else {
            unreachable!("inline handled by caller")
        };
        let mut part_start = 0u64;
        let mut damaged = false;
        for part in parts {
            let part_end = part_start + part.size;
            if part_end > start && part_start < end {
                let a = start.max(part_start) - part_start;
                let b = end.min(part_end) - part_start;
                let ok = self
                    .read_part_range(set, &v.layout, part, (a, b), views, tx, &mut damaged)
                    .await;
                if let Err(e) = ok {
                    if damaged {
                        self.queue_heal(bucket, key);
                    }
                    return Err(match e {
                        StoreError::Unreadable { reason, .. } => StoreError::Unreadable {
                            bucket: bucket.into(),
                            key: key.into(),
                            reason,
                        },
                        e => e,
                    });
                }
                if tx.is_closed() {
                    break;
                }
            }
            part_start = part_end;
        }
        if damaged {
            self.queue_heal(bucket, key);
        }
        Ok(())
    }

    /// Reads bytes [a, b) of one part, sending them stripe by stripe;
    /// `views`: blocks that verify in the page cache may go as views of
    /// their files (`Self::view_stripe`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn read_part_range(
        &self,
        set: usize,
        layout: &Layout,
        part: &PartMeta,
        (a, b): (u64, u64),
        views: bool,
        tx: &mpsc::Sender<Result<Bytes, StoreError>>,
        damaged: &mut bool,
    ) -> Result<(), StoreError> {
        let mut reader = PartReader::open(
            self,
            set,
            layout,
            part,
            a / layout.stripe_size_bytes as u64,
            (b - 1) / layout.stripe_size_bytes as u64,
        )
        .await?;
        let stripe = layout.stripe_size_bytes as u64;
        for j in reader.first..=reader.last {
            reader.fill_ahead(j).await;
            let lo = a.max(j * stripe) - j * stripe;
            let hi = b.min((j + 1) * stripe) - j * stripe;
            let sl = reader.geometry.shard_len(j);
            let len = (hi - lo) as usize;
            // At most half the queue, so that two stripes always fit.
            let pieces = len.div_ceil(PIECE_BYTES).min(READ_AHEAD_PIECES / 2);
            let piece = len.div_ceil(pieces);
            // The data blocks the range touches, when they may go as views
            // (one piece each, so no more than half the queue either).
            let view_blocks = if views {
                reader.direct_blocks(j).map(|blocks| {
                    let (first, end) = ((lo / sl) as usize, hi.div_ceil(sl) as usize);
                    let touched = blocks.into_iter().enumerate().skip(first);
                    touched.take(end - first).collect::<Vec<_>>()
                })
            } else {
                None
            }
            .filter(|b| b.len() <= READ_AHEAD_PIECES / 2);
            let room = pieces.max(view_blocks.as_ref().map_or(0, Vec::len));
            // Room in the channel first: while the client is not taking
            // what is queued, this read holds no pool buffers (they go back
            // to the pool for other requests) and no data of its own.
            let mut permits = match tx.try_reserve_many(room) {
                Ok(p) => p,
                Err(mpsc::error::TrySendError::Full(())) => {
                    reader.release_buffers();
                    match tx.reserve_many(room).await {
                        Ok(p) => p,
                        Err(_) => return Ok(()), // the client went away
                    }
                }
                Err(mpsc::error::TrySendError::Closed(())) => return Ok(()),
            };
            // And room in the budgets of read-ahead, its caller's, then all
            // GETs': past them, this stripe waits for clients to take what
            // is queued to them.
            let caller = super::CALLER_READ_AHEAD.try_with(Arc::clone).ok();
            let mut caller_budget = match caller {
                Some(c) => Some(self.read_ahead_room(&c, room, &mut reader).await?),
                None => None,
            };
            let budget = self
                .read_ahead_room(&self.read_ahead, room, &mut reader)
                .await?;
            let mut budget = Some(budget);
            if let Some(viewed) = view_blocks.and_then(|b| view_stripe(&b, sl, lo, hi)) {
                for (reg, view) in viewed {
                    let Some(permit) = permits.next() else {
                        unreachable!("a permit for each view")
                    };
                    let (share, caller_share) = (one_of(&mut budget), one_of(&mut caller_budget));
                    permit.send(Ok(Bytes::from_owner(ViewPiece(
                        reg,
                        view,
                        share,
                        caller_share,
                    ))));
                }
                continue;
            }
            let mut out: Vec<PieceBuf> = Vec::with_capacity(pieces);
            let mut runs: Vec<Vec<Run>> = Vec::with_capacity(pieces);
            // A whole stripe whose blocks split into the pieces planned is
            // read straight into them when it can be.
            let direct = if lo == 0
                && hi == reader.k as u64 * sl
                && reader.k * (sl as usize).div_ceil(PIECE_BYTES) == pieces
            {
                match reader.direct_blocks(j) {
                    Some(blocks) => self.read_stripe_direct(blocks, sl as usize).await,
                    None => None,
                }
            } else {
                None
            };
            if let Some((bufs, rs)) = direct {
                (out, runs) = (bufs, rs);
            } else {
                let data = reader.read_stripe_files(self, j).await?;
                let mut room = 0;
                for (i, (shard, file)) in data.iter().enumerate() {
                    let s_lo = i as u64 * sl;
                    let s_hi = s_lo + sl;
                    let from = lo.max(s_lo);
                    let to = hi.min(s_hi);
                    let mut bytes = if from < to {
                        &shard[(from - s_lo) as usize..(to - s_lo) as usize]
                    } else {
                        &[][..]
                    };
                    let mut at_file = file
                        .as_ref()
                        .filter(|_| tarn_io::spans::enabled())
                        .map(|(fd, block)| (fd, block + from.saturating_sub(s_lo)));
                    while !bytes.is_empty() {
                        if room == 0 {
                            out.push(PieceBuf::new(self, piece).await);
                            runs.push(Vec::new());
                            room = piece;
                        }
                        let take = room.min(bytes.len());
                        let p = out.last_mut().expect("a piece");
                        let at = p.bytes().len();
                        p.extend_from_slice(&bytes[..take]);
                        if let Some((fd, off)) = at_file.as_mut() {
                            let run = runs.last_mut().expect("a piece");
                            run.push((at, take, Arc::clone(fd), *off));
                            *off += take as u64;
                        }
                        bytes = &bytes[take..];
                        room -= take;
                    }
                }
            }
            *damaged |= reader.damaged;
            for ((permit, p), runs) in permits.zip(out).zip(runs) {
                // A plain HTTP connection sends these runs from the shard
                // files (`sendfile`) instead of copying them into the socket.
                let regs = runs
                    .into_iter()
                    .filter_map(|(at, len, fd, off)| {
                        // SAFETY: the piece is not written again and its
                        // buffer goes back only after these registrations
                        // are dropped (Piece's fields drop in order); the
                        // bytes are those just read (and verified) from the
                        // file at `off`, and shard files are never written
                        // in place.
                        unsafe { tarn_io::spans::register(&p.bytes()[at..at + len], fd, off) }
                    })
                    .collect();
                // Each piece holds its share of the budget until the HTTP
                // layer drops it (written out, or the connection gone).
                let (share, caller_share) = (one_of(&mut budget), one_of(&mut caller_budget));
                permit.send(Ok(Bytes::from_owner(Piece(regs, p, share, caller_share))));
            }
        }
        *damaged |= reader.damaged;
        Ok(())
    }
}

/// A run of a piece copied from a shard file of this node: (offset in the
/// piece, length, the file, offset in the file).
type Run = (usize, usize, Arc<std::os::fd::OwnedFd>, u64);

/// A data block of a stripe in a file of this node: its index in the
/// stripe, and (the file, the block's offset there, its checksum).
type FileBlock = (usize, (Arc<std::os::fd::OwnedFd>, u64, u32));

/// A GET's piece that is a view of a shard file's bytes, verified in the
/// page cache (`tarn_io::view`), and its shares of the read-ahead budget.
/// The registration drops before the view is unmapped (fields drop in
/// order).
struct ViewPiece(
    #[allow(dead_code)] tarn_io::spans::Registration,
    tarn_io::view::View,
    #[allow(dead_code)] Option<tokio::sync::OwnedSemaphorePermit>,
    #[allow(dead_code)] Option<tokio::sync::OwnedSemaphorePermit>,
);

impl AsRef<[u8]> for ViewPiece {
    fn as_ref(&self) -> &[u8] {
        self.1.as_ref()
    }
}

/// Bytes `lo..hi` of a stripe (blocks of `sl` bytes), whose touched data
/// `blocks` are all files of this node, as one view of each block's share,
/// registered to be sent from its file; None unless every block is whole
/// in the page cache and verifies against its checksum there (read through
/// the thread's scratch buffer, never waiting for the drive). The usual
/// path then reads the stripe and deals with whatever is wrong.
fn view_stripe(
    blocks: &[FileBlock],
    sl: u64,
    lo: u64,
    hi: u64,
) -> Option<Vec<(tarn_io::spans::Registration, tarn_io::view::View)>> {
    let missed = || {
        tarn_io::view::count(None);
        None
    };
    // Every block whole and verified before any view is made.
    for (_, (fd, off, want)) in blocks {
        if !verified_in_cache(fd, *off, sl as usize, *want) {
            return missed();
        }
    }
    let mut out = Vec::with_capacity(blocks.len());
    for (i, (fd, off, _)) in blocks {
        let s_lo = *i as u64 * sl;
        let (from, to) = (lo.max(s_lo), hi.min(s_lo + sl));
        let at = off + (from - s_lo);
        let Ok(view) = tarn_io::view::View::map(fd, at, (to - from) as usize) else {
            return missed();
        };
        let reg = tarn_io::spans::register_view(&view, fd.clone(), at)?;
        out.push((reg, view));
    }
    tarn_io::view::count(Some((hi - lo) as usize));
    Some(out)
}

/// Whether `len` bytes of the file from `off` are all in the page cache and
/// their CRC32C is `want`: read a scratch buffer at a time, each checked
/// while it is in the core's cache.
fn verified_in_cache(fd: &std::os::fd::OwnedFd, off: u64, len: usize, want: u32) -> bool {
    tarn_io::view::with_scratch(|scratch| {
        let mut crc = crate::checksum::Crc32c::new();
        let mut at = 0;
        while at < len {
            let n = (len - at).min(scratch.len());
            match tarn_io::view::read_cached(fd, off + at as u64, &mut scratch[..n]) {
                Ok(true) => crc.update(&scratch[..n]),
                Ok(false) | Err(_) => return false,
            }
            at += n;
        }
        crc.finish() == want
    })
}

impl Store {
    /// A whole stripe (its data `blocks`, from `PartReader::direct_blocks`,
    /// of `sl` bytes each) read straight from this node's shard files into
    /// pooled pieces, each block split into pieces
    /// of `PIECE_BYTES`: no stripe buffer, no copy from it into the pieces
    /// (a seventh of a large GET's server CPU). None when it cannot be: a
    /// data shard that is not a sound file of this node or whose checksum
    /// is not loaded, no pooled piece free, a read that fails or is late, a
    /// block that fails its checksum. The usual path then reads the stripe
    /// and deals with what is wrong (parity, hedging, heal).
    async fn read_stripe_direct(
        &self,
        blocks: Vec<(Arc<std::os::fd::OwnedFd>, u64, u32)>,
        sl: usize,
    ) -> Option<(Vec<PieceBuf>, Vec<Vec<Run>>)> {
        let per = sl.div_ceil(PIECE_BYTES);
        let mut bufs = self
            .pieces
            .acquire_many(blocks.len() * per, Duration::ZERO)
            .await
            .ok()?;
        let at = |n: usize| (n % per) * PIECE_BYTES;
        let len = |n: usize| PIECE_BYTES.min(sl - at(n));
        let reads = bufs.iter_mut().enumerate().map(|(n, b)| {
            let (fd, off, _) = &blocks[n / per];
            let file = tarn_io::file::File::from_shared(fd.clone());
            let (off, len) = (off + at(n) as u64, len(n));
            async move {
                let (res, buf) = file.read_exact_at(b.take(), len, off).await;
                b.restore(buf);
                res
            }
        });
        let done = tokio::time::timeout(SHARD_HEDGE_AFTER, futures::future::join_all(reads))
            .await
            .ok()?;
        if done.iter().any(|r| r.is_err()) {
            return None;
        }
        for (i, (_, _, want)) in blocks.iter().enumerate() {
            let parts: Vec<&[u8]> = bufs[i * per..(i + 1) * per]
                .iter()
                .map(|b| &b[..])
                .collect();
            if crate::checksum::crc32c_parts(&parts) != *want {
                return None;
            }
        }
        let runs = (0..bufs.len())
            .map(|n| {
                let (fd, off, _) = &blocks[n / per];
                vec![(0, len(n), fd.clone(), off + at(n) as u64)]
            })
            .collect();
        Some((bufs.into_iter().map(PieceBuf::Pooled).collect(), runs))
    }
}

/// One permit of `held` (the last one is `held` itself).
fn one_of(
    held: &mut Option<tokio::sync::OwnedSemaphorePermit>,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    match held.as_mut() {
        Some(b) if b.num_permits() > 1 => b.split(1),
        _ => held.take(),
    }
}

impl Store {
    /// `pieces` of room in read-ahead budget `budget`, waiting (with the
    /// reader's pool buffers given back) at most `read_ahead_wait_ms`.
    async fn read_ahead_room(
        &self,
        budget: &Arc<tokio::sync::Semaphore>,
        pieces: usize,
        reader: &mut PartReader,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, StoreError> {
        if let Ok(b) = budget.clone().try_acquire_many_owned(pieces as u32) {
            return Ok(b);
        }
        reader.release_buffers();
        self.stats.read_ahead_waits.fetch_add(1, Ordering::Relaxed);
        let wait = Duration::from_millis(self.cfg.read_ahead_wait_ms);
        match tokio::time::timeout(wait, budget.clone().acquire_many_owned(pieces as u32)).await {
            Ok(Ok(b)) => Ok(b),
            _ => Err(StoreError::SlowDown(format!(
                "no room for GET read-ahead within {wait:?} (response_buffer_max_bytes)"
            ))),
        }
    }
}

/// How much of each local data shard file a GET brings into the page cache
/// at a time when it is not there (`PartReader::fill_ahead`).
const FILL_WINDOW_BYTES: u64 = 4 << 20;

/// How long a stripe's read waits for a shard before it reads another in its
/// place (when the set has one to spare).
pub(crate) const SHARD_HEDGE_AFTER: std::time::Duration = std::time::Duration::from_millis(300);

/// Shard readers for one part and the stripes [first, last].
pub(crate) struct PartReader {
    pub geometry: StripeGeometry,
    pub first: u64,
    pub last: u64,
    k: usize,
    layout: Layout,
    set: usize,
    data_id: crate::format::Id128,
    readers: Vec<Option<Box<dyn ShardSource>>>,
    /// Shards known bad (missing, short, corrupt); never read again.
    bad: Vec<bool>,
    opened: Vec<bool>,
    bufs: Vec<Option<PooledBuf>>,
    /// Which data shards the last stripe read rebuilt from parity.
    rebuilt: Vec<bool>,
    pub damaged: bool,
    /// Stripes before this one have had their local blocks found in the
    /// page cache or filled into it (`fill_ahead`).
    filled_to: u64,
}

impl PartReader {
    pub(crate) async fn open(
        store: &Store,
        set: usize,
        layout: &Layout,
        part: &PartMeta,
        first: u64,
        last: u64,
    ) -> Result<Self, StoreError> {
        store.check_layout(set, layout)?;
        let n = layout.shard_count();
        let k = layout.data_shards as usize;
        let mut r = PartReader {
            geometry: StripeGeometry::new(part.size, layout.stripe_size_bytes, layout.data_shards),
            first,
            last,
            k,
            layout: layout.clone(),
            set,
            data_id: part.data_id,
            readers: (0..n).map(|_| None).collect(),
            bad: vec![false; n],
            opened: vec![false; n],
            bufs: (0..n).map(|_| None).collect(),
            rebuilt: vec![false; k],
            damaged: false,
            filled_to: first,
        };
        // Drives behind (rebuilding or syncing) may lack the part's shard:
        // read from the others while k of them are left.
        let topo = store.topo();
        let behind: Vec<bool> = layout
            .distribution
            .iter()
            .map(|&p| {
                topo.slots[topo.sets[set][p as usize]]
                    .rebuilding()
                    .is_some()
            })
            .collect();
        if behind.iter().filter(|b| !**b).count() >= k {
            r.bad = behind;
        }
        let wanted: Vec<usize> = (0..n).filter(|&i| !r.bad[i]).take(k).collect();
        r.open_shards(store, &wanted).await;
        Ok(r)
    }

    /// Before stripe `j` is read: the blocks of this node's data shard files
    /// from `j` on (a window of about `FILL_WINDOW_BYTES` a shard, within
    /// the range read) that are not all in the page cache are read into it
    /// in large folios (`tarn_io::pagecache`), on the blocking pool, all
    /// shards at once, waiting at most the hedge delay. Reads from the page
    /// cache, and sends from it, then cost half as much per byte for small
    /// files as when the kernel's readahead fills it in 4 KiB pages. A
    /// window already in memory costs one `cachestat` a shard; whatever
    /// fails here (a page that cannot be read) is met again, and dealt
    /// with, by the read that follows.
    async fn fill_ahead(&mut self, j: u64) {
        if j < self.filled_to || !tarn_io::pagecache::enabled() {
            return;
        }
        let sl = self.geometry.shard_len(j).max(1);
        let end = (j + (FILL_WINDOW_BYTES / sl).max(1)).min(self.last + 1);
        self.filled_to = end;
        let mut cold = Vec::new();
        for i in 0..self.k {
            if self.bad[i] {
                continue;
            }
            let Some(r) = self.readers[i].as_ref() else {
                continue;
            };
            let (Some((fd, from)), Some((_, to))) = (r.block_file(j), r.block_file(end - 1)) else {
                continue;
            };
            let len = (to + self.geometry.shard_len(end - 1) - from) as usize;
            match tarn_io::pagecache::resident(&fd, from, len) {
                Ok(false) => cold.push((fd, from, len)),
                Ok(true) => {}
                Err(_) => return,
            }
        }
        if cold.is_empty() {
            return;
        }
        let fills = cold.into_iter().map(|(fd, from, len)| {
            tarn_io::file::run_blocking(move || tarn_io::pagecache::fill(&fd, from, len))
        });
        let _ = tokio::time::timeout(SHARD_HEDGE_AFTER, futures::future::join_all(fills)).await;
    }

    /// Gives the pool buffers back (they are taken again by the next read).
    pub(crate) fn release_buffers(&mut self) {
        for b in &mut self.bufs {
            *b = None;
        }
    }

    async fn open_shards(&mut self, store: &Store, shards: &[usize]) {
        let geometry = self.geometry;
        let (first, last) = (self.first, self.last);
        let opens = shards.iter().map(|&i| {
            let slot = store.slot(self.set, self.layout.distribution[i] as usize);
            let drive = slot.writer();
            let data_id = self.data_id;
            async move {
                let Some(drive) = drive else {
                    return (i, Err(ShardError::Missing));
                };
                let mut r = match drive.open_shard(data_id, geometry).await {
                    Ok(r) => r,
                    Err(e) => return (i, Err(e)),
                };
                if geometry.stripe_count() > 0 {
                    if let Err(e) = r.load_checksums(first, last).await {
                        return (i, Err(e));
                    }
                }
                (i, Ok(r))
            }
        });
        for (i, res) in futures::future::join_all(opens).await {
            self.opened[i] = true;
            match res {
                Ok(r) => self.readers[i] = Some(r),
                Err(e) => {
                    if !matches!(e, ShardError::Missing)
                        || store
                            .slot(self.set, self.layout.distribution[i] as usize)
                            .online()
                    {
                        tracing::warn!(shard = i, error = %e, "shard unusable, reconstructing from parity");
                    }
                    self.device_failed(store, i, &e);
                    self.bad[i] = true;
                    self.damaged = true;
                }
            }
        }
    }

    /// Reads stripe `j` and returns its k data shards (verified or rebuilt).
    /// A read the device itself failed (not a missing or corrupt file, which
    /// heal repairs) takes the drive out like a failed write.
    fn device_failed(&self, store: &Store, i: usize, e: &ShardError) {
        if let ShardError::Io(io) = e {
            if matches!(
                io.raw_os_error(),
                Some(libc::EIO | libc::ENXIO | libc::ENODEV)
            ) {
                let slot = store.slot(self.set, self.layout.distribution[i] as usize);
                store.drive_failed(&slot, "reading a shard", io);
            }
        }
    }

    pub(crate) async fn read_stripe(
        &mut self,
        store: &Store,
        j: u64,
    ) -> Result<Vec<&[u8]>, StoreError> {
        let sl = self.fill_stripe(store, j).await?;
        Ok((0..self.k)
            .map(|i| &self.bufs[i].as_ref().expect("buffer")[..sl])
            .collect())
    }

    /// For each data shard of stripe `j`, in order: its file of this node,
    /// the block's offset there and its checksum; None unless every one is
    /// a file of this node, not known bad, with its checksum loaded.
    fn direct_blocks(&self, j: u64) -> Option<Vec<(Arc<std::os::fd::OwnedFd>, u64, u32)>> {
        (0..self.k)
            .map(|i| {
                if self.bad[i] {
                    return None;
                }
                let r = self.readers[i].as_ref()?;
                let (fd, off) = r.block_file(j)?;
                Some((fd, off, r.block_crc(j)?))
            })
            .collect()
    }

    /// As `read_stripe`, with, for each data shard whose block was read
    /// from a file of this node (not rebuilt from parity, not from another
    /// node), that file and the block's offset in it.
    pub(crate) async fn read_stripe_files(
        &mut self,
        store: &Store,
        j: u64,
    ) -> Result<Vec<(&[u8], Option<(Arc<std::os::fd::OwnedFd>, u64)>)>, StoreError> {
        let sl = self.fill_stripe(store, j).await?;
        let (bufs, readers, rebuilt) = (&self.bufs, &self.readers, &self.rebuilt);
        Ok((0..self.k)
            .map(|i| {
                let file = match (&readers[i], rebuilt[i]) {
                    (Some(r), false) => r.block_file(j),
                    _ => None,
                };
                (&bufs[i].as_ref().expect("buffer")[..sl], file)
            })
            .collect())
    }

    /// Reads stripe `j`'s k data shards into `bufs` (verified or rebuilt;
    /// `rebuilt` says which were); returns their length.
    async fn fill_stripe(&mut self, store: &Store, j: u64) -> Result<usize, StoreError> {
        let sl = self.geometry.shard_len(j) as usize;
        let n = self.layout.shard_count();
        let mut done = vec![false; n];
        loop {
            let good_or_pending: Vec<usize> = (0..n).filter(|&i| !self.bad[i]).collect();
            // The shards to read: data shards first, then parity to make up for bad ones.
            let want: Vec<usize> = good_or_pending.iter().copied().take(self.k).collect();
            // Short of shards: those of drives behind, skipped at first,
            // are tried after all.
            let skipped: Vec<usize> = (0..n).filter(|&i| self.bad[i] && !self.opened[i]).collect();
            if want.len() < self.k && !skipped.is_empty() {
                for i in skipped {
                    self.bad[i] = false;
                }
                continue;
            }
            if want.len() < self.k {
                return Err(StoreError::Unreadable {
                    bucket: String::new(),
                    key: String::new(),
                    reason: format!(
                        "only {} of {} needed shards are readable",
                        want.len(),
                        self.k
                    ),
                });
            }
            let to_open: Vec<usize> = want.iter().copied().filter(|&i| !self.opened[i]).collect();
            if !to_open.is_empty() {
                self.open_shards(store, &to_open).await;
                continue;
            }
            let lacking: Vec<usize> = want
                .iter()
                .copied()
                .filter(|&i| self.bufs[i].is_none())
                .collect();
            if !lacking.is_empty() {
                let bufs = store
                    .pool()
                    .acquire_many(lacking.len(), store.buffer_wait())
                    .await?;
                for (i, b) in lacking.into_iter().zip(bufs) {
                    self.bufs[i] = Some(b);
                }
            }
            for &i in &want {
                self.bufs[i].as_mut().expect("buffer").ensure_capacity(sl);
            }
            // Shards of this stripe already read (kept when a retry
            // replaces a failed or late one).
            let mut taken: Vec<Option<PooledBuf>> = (0..n)
                .map(|i| {
                    (want.contains(&i) && !done[i]).then(|| self.bufs[i].take().expect("buffer"))
                })
                .collect();
            let mut reads: futures::stream::FuturesUnordered<_> = self
                .readers
                .iter_mut()
                .zip(taken.iter_mut())
                .enumerate()
                .filter_map(|(i, (reader, pooled))| {
                    let mut pooled = pooled.take()?;
                    let reader = reader.as_mut().expect("opened");
                    Some(async move {
                        let (res, buf) = reader.read_block(j, pooled.take()).await;
                        pooled.restore(buf);
                        (i, res, pooled)
                    })
                })
                .collect();
            // A shard that is late while another could stand in for it is
            // given up (hedged): its drive may be on a node that stopped.
            let spare = (0..n).filter(|&i| !self.bad[i]).count() > self.k;
            let hedge_at = tokio::time::Instant::now() + SHARD_HEDGE_AFTER;
            let mut errors = Vec::new();
            let mut late = false;
            loop {
                let next = if spare {
                    match tokio::time::timeout_at(hedge_at, reads.next()).await {
                        Ok(next) => next,
                        Err(_) => {
                            late = true;
                            break;
                        }
                    }
                } else {
                    reads.next().await
                };
                let Some((i, res, pooled)) = next else { break };
                self.bufs[i] = Some(pooled);
                match res {
                    Ok(()) => done[i] = true,
                    Err(e) => errors.push((i, e)),
                }
            }
            // Dropping the reads still running cancels them.
            drop(reads);
            let mut failed = false;
            for (i, e) in errors {
                tracing::warn!(shard = i, stripe = j, error = %e, "shard block unusable, reconstructing from parity");
                self.device_failed(store, i, &e);
                self.bad[i] = true;
                self.damaged = true;
                failed = true;
            }
            if late {
                // Only as many as others can stand in for: the rest are
                // asked again with them.
                let mut spares = (0..n).filter(|&i| !self.bad[i]).count() - self.k;
                for &i in &want {
                    if !done[i] && !self.bad[i] && spares > 0 {
                        spares -= 1;
                        tracing::warn!(
                            shard = i,
                            stripe = j,
                            "shard read late: read from the others instead"
                        );
                        store
                            .stats
                            .hedged_reads
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        // Not damaged: only not waited for, here or in the
                        // rest of this read.
                        self.bad[i] = true;
                    }
                }
                continue;
            }
            if failed {
                continue;
            }
            // Rebuild missing data shards into their buffers.
            let missing: Vec<usize> = (0..self.k).filter(|i| !want.contains(i)).collect();
            if !missing.is_empty() {
                for &i in &missing {
                    if self.bufs[i].is_none() {
                        self.bufs[i] = Some(store.pool().acquire(store.buffer_wait()).await?);
                    }
                    self.bufs[i].as_mut().expect("buffer").ensure_capacity(sl);
                }
                let codec = codec_for(
                    self.layout.codec,
                    self.k,
                    self.layout.parity_shards as usize,
                );
                let mut outs: Vec<(usize, PooledBuf)> = missing
                    .iter()
                    .map(|&i| (i, self.bufs[i].take().expect("buffer")))
                    .collect();
                {
                    let present: Vec<Option<&[u8]>> = (0..n)
                        .map(|i| {
                            if want.contains(&i) {
                                self.bufs[i].as_deref().map(|b| &b[..])
                            } else {
                                None
                            }
                        })
                        .collect();
                    let mut wanted: Vec<(usize, &mut [u8])> = outs
                        .iter_mut()
                        .map(|(i, b)| {
                            b.set_len(sl);
                            (*i, &mut b[..])
                        })
                        .collect();
                    codec.reconstruct(&present, &mut wanted).map_err(|e| {
                        StoreError::Unreadable {
                            bucket: String::new(),
                            key: String::new(),
                            reason: e.to_string(),
                        }
                    })?;
                }
                store
                    .stats
                    .shards_reconstructed
                    .fetch_add(missing.len() as u64, std::sync::atomic::Ordering::Relaxed);
                for (i, b) in outs {
                    self.bufs[i] = Some(b);
                }
            }
            for i in 0..self.k {
                self.rebuilt[i] = missing.contains(&i);
            }
            return Ok(sl);
        }
    }
}
