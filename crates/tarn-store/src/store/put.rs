//! The write path: stream a body into stripes, encode parity, write shard files
//! to their drives concurrently, then commit metadata on a quorum.

use bytes::Bytes;
use futures::StreamExt;
use md5::{Digest, Md5};
use tarn_io::PooledBuf;

use super::commit::NewVersion;
use super::{validate_key, Store, NULL_VERSION};
use crate::checksum::crc32c;
use crate::codec::{codec_for, StripeGeometry};
use crate::config::EtagMode;
use crate::drive_io::{ShardPlace, ShardSink};
use crate::error::StoreError;
use crate::format::{new_id, Id128, Layout, PartMeta, Storage, VersionMeta, Versioning};
use crate::types::{ObjectBody, ObjectInfo, PutOptions};

/// Reads a body while hashing it for the ETag.
pub(crate) struct BodyReader {
    body: ObjectBody,
    /// Chunks already counted and hashed, to be handed out again first.
    pushed_back: std::collections::VecDeque<Bytes>,
    md5: Option<Md5>,
    xxh: xxhash_rust::xxh3::Xxh3,
    pub(crate) total: u64,
    limit: u64,
    /// Encrypted writes: the plaintext, hashed above, is sealed here and
    /// the reader hands out sealed blocks.
    sealer: Option<crate::seal::Sealer>,
    sealed: std::collections::VecDeque<Bytes>,
}

/// How a finished body's ETag is written.
pub(crate) struct BodyDigest {
    pub md5: Option<[u8; 16]>,
    pub xxh128: u128,
    pub checksum: Option<(String, String)>,
}

impl BodyReader {
    pub(crate) fn new(body: ObjectBody, use_md5: bool, limit: u64) -> Self {
        BodyReader {
            body,
            pushed_back: std::collections::VecDeque::new(),
            md5: use_md5.then(Md5::new),
            xxh: xxhash_rust::xxh3::Xxh3::new(),
            total: 0,
            limit,
            sealer: None,
            sealed: std::collections::VecDeque::new(),
        }
    }

    /// Seals what is read from here on as part `part` with `salt`.
    pub(crate) fn seal(&mut self, spec: &crate::seal::SealSpec, salt: &[u8; 16], part: u32) {
        self.sealer = Some(crate::seal::Sealer::new(&spec.key, salt, part));
    }

    /// The next chunk to store: the body's bytes, or sealed blocks of them.
    pub(crate) async fn next(&mut self) -> Result<Option<Bytes>, StoreError> {
        if let Some(b) = self.pushed_back.pop_front() {
            return Ok(Some(b));
        }
        if self.sealer.is_none() {
            return self.next_plain().await;
        }
        loop {
            if let Some(b) = self.sealed.pop_front() {
                return Ok(Some(b));
            }
            let sealer = self.sealer.as_mut().expect("sealing");
            if sealer.finished() {
                // The body ended and its last block went out: the body
                // stream is not polled again.
                return Ok(None);
            }
            match self.next_plain().await? {
                Some(b) => {
                    let sealer = self.sealer.as_mut().expect("sealing");
                    sealer.push(&b, &mut self.sealed);
                }
                None => return Ok(self.sealer.as_mut().expect("sealing").finish()),
            }
        }
    }

    async fn next_plain(&mut self) -> Result<Option<Bytes>, StoreError> {
        loop {
            match self.body.stream.next().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(e),
                Some(Ok(b)) if b.is_empty() => continue,
                Some(Ok(b)) => {
                    self.total += b.len() as u64;
                    if self.total > self.limit {
                        return Err(StoreError::EntityTooLarge {
                            size: self.total,
                            max: self.limit,
                        });
                    }
                    if let Some(m) = self.md5.as_mut() {
                        m.update(&b);
                    }
                    self.xxh.update(&b);
                    return Ok(Some(b));
                }
            }
        }
    }

    /// Returns a chunk so that the next `next()` yields it again.
    pub(crate) fn push_back(&mut self, b: Bytes) {
        self.pushed_back.push_front(b);
    }

    /// After the last chunk: length and checksum checks, then the digests.
    pub(crate) fn finish(
        mut self,
        content_md5: Option<[u8; 16]>,
    ) -> Result<BodyDigest, StoreError> {
        if let Some(declared) = self.body.declared_len {
            if declared != self.total {
                return Err(StoreError::IncompleteBody {
                    declared,
                    actual: self.total,
                });
            }
        }
        let checksum = match self.body.finish.take() {
            Some(f) => f()?,
            None => None,
        };
        let md5: Option<[u8; 16]> = self.md5.map(|m| m.finalize().into());
        if let Some(want) = content_md5 {
            if md5 != Some(want) {
                return Err(StoreError::BadDigest);
            }
        }
        Ok(BodyDigest {
            md5,
            xxh128: self.xxh.digest128(),
            checksum,
        })
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The ETag of a body (an object written in one piece, or a part): the MD5
/// when computed, else the fast digest marked `-1`, which clients that check
/// ETags against MD5s (s3cmd, also for parts) know to skip. Either way 16
/// bytes a multipart ETag is derived from (`multipart::part_digest`).
pub(crate) fn single_etag(d: &BodyDigest) -> String {
    match d.md5 {
        Some(m) => hex(&m),
        None => format!("{}-1", hex(&d.xxh128.to_be_bytes())),
    }
}

/// The shard files a part was written to: committed under `data_id` on the
/// drives at the set positions in `written`.
pub(crate) struct WrittenData {
    pub data_id: Id128,
    pub size: u64,
    /// Keeps the orphan sweep away from these shards until the caller's commit
    /// is done (or failed and cleaned up).
    pub inflight: super::InflightData,
}

impl Store {
    pub(crate) fn wants_md5(&self, opts_md5: bool, declared: Option<u64>) -> bool {
        opts_md5
            || match self.cfg.etag_mode {
                EtagMode::Md5 => true,
                EtagMode::Fast => false,
                EtagMode::Auto => declared.is_some_and(|l| l <= self.cfg.etag_md5_max_bytes),
            }
    }

    /// Streams the rest of `reader` into shard files on the set's drives and
    /// renames them into place. Nothing is visible until metadata commits.
    pub(crate) async fn write_data(
        &self,
        set: usize,
        layout: &Layout,
        reader: &mut BodyReader,
    ) -> Result<WrittenData, StoreError> {
        let data_id = new_id();
        // Registered before the first file exists, released by the caller.
        let inflight = self.register_inflight(data_id);
        let res = self.write_data_inner(set, layout, reader, data_id).await;
        match res {
            Ok((data_id, size)) => Ok(WrittenData {
                data_id,
                size,
                inflight,
            }),
            Err(e) => {
                self.remove_tmp_and_data(set, layout, data_id).await;
                Err(e)
            }
        }
    }

    async fn write_data_inner(
        &self,
        set: usize,
        layout: &Layout,
        reader: &mut BodyReader,
        data_id: Id128,
    ) -> Result<(Id128, u64), StoreError> {
        let k = layout.data_shards as usize;
        let n = layout.shard_count();
        let stripe = layout.stripe_size_bytes as usize;
        let quorum = Self::data_write_quorum(layout);
        let codec = codec_for(layout.codec, k, layout.parity_shards as usize);

        let mut writers: Vec<Option<Box<dyn ShardSink>>> = Vec::with_capacity(n);
        let mut full = 0;
        for (shard, &pos) in layout.distribution.iter().enumerate() {
            let slot = self.slot(set, pos as usize);
            let Some(drive) = slot.writer() else {
                writers.push(None);
                continue;
            };
            // Room for a stripe's worth beyond the reserve (the same test
            // `/admin/drives` reports "full" by).
            if !slot.has_room(stripe as u64, self.cfg.drive_reserve_bytes) {
                tracing::warn!(drive = %slot.name, "drive full (below its reserve): no new data on it");
                writers.push(None);
                full += 1;
                continue;
            }
            match drive
                .create_shard(data_id, shard as u8, ShardPlace::Final)
                .await
            {
                Ok(w) => writers.push(Some(w)),
                Err(error) => {
                    super::log_drive_failure(&slot.name, "cannot create shard file", &error);
                    self.drive_failed(&slot, "creating a shard file", &error);
                    writers.push(None);
                }
            }
        }
        if let Err(e) = check_alive(&writers, quorum) {
            // Full drives are the reason only if, with room, they would
            // have made the quorum; otherwise the set is short of drives.
            let alive = writers.iter().filter(|w| w.is_some()).count();
            if full > 0 && alive + full >= quorum {
                return Err(StoreError::StorageFull(format!(
                    "{full} of {n} drives of the set are below their free-space reserve; {quorum} needed with room"
                )));
            }
            return Err(e);
        }
        let slots: Vec<std::sync::Arc<super::DriveSlot>> = layout
            .distribution
            .iter()
            .map(|&pos| self.slot(set, pos as usize))
            .collect();

        // A stripe's body bytes are kept as the chunks they came in (the
        // HTTP layer's own buffers) until the stripe is complete; pool
        // buffers are taken only then, for the copy into shards and the
        // parity, and go back as soon as the stripe's blocks are written.
        // The writes of one stripe run while the next stripe's body
        // arrives (two stripes in flight: the network and the drives
        // overlap). A client that stops sending mid-stripe holds no pool
        // buffer once the last stripe's writes are done, so slow clients
        // cannot starve the others of the pool.
        let wait = self.buffer_wait();
        let mut pending: Vec<Bytes> = Vec::new();
        let mut size = 0u64;
        let mut writing: Option<StripeWrite<'_>> = None;
        loop {
            let receive = receive_stripe(reader, &mut pending, stripe);
            let received = match writing.take() {
                Some(w) => {
                    let (received, (ws, written)) = futures::join!(receive, w);
                    writers = ws;
                    written?;
                    received
                }
                None => receive.await,
            };
            let (pending_len, ended) = received?;
            if pending_len > 0 {
                size += pending_len as u64;
                let mut shard_bufs: Vec<PooledBuf> = self.pool().acquire_many(n, wait).await?;
                let sl = fill_stripe(&pending, pending_len, &mut shard_bufs, codec.as_ref(), k)?;
                pending.clear();
                writing = Some(Box::pin(self.write_blocks(
                    std::mem::take(&mut writers),
                    shard_bufs,
                    sl,
                    &slots,
                    quorum,
                )));
            }
            if ended {
                break;
            }
        }
        if let Some(w) = writing.take() {
            let (ws, written) = w.await;
            writers = ws;
            written?;
        }

        // Footers, then the file's fsync and its directory entry's fsync in
        // parallel, concurrently on every drive. Shards are written in place:
        // nothing refers to them until the metadata commits, and the orphan
        // sweep never touches a data id that is still being written.
        let finishing = writers.iter_mut().zip(&slots).map(|(w, slot)| async move {
            let Some(writer) = w.take() else { return false };
            match writer.finish().await {
                Ok(()) => true,
                Err(error) => {
                    super::log_drive_failure(&slot.name, "finishing shard file failed", &error);
                    self.drive_failed(slot, "finishing a shard file", &error);
                    false
                }
            }
        });
        let renamed = futures::future::join_all(finishing)
            .await
            .into_iter()
            .filter(|ok| *ok)
            .count();
        if renamed < quorum {
            return Err(StoreError::QuorumLost {
                what: "shard write",
                needed: quorum,
                available: renamed,
            });
        }
        Ok((data_id, size))
    }

    /// Writes one stripe's blocks to their drives (concurrently) and gives
    /// the buffers back to the pool; returns the writers, a drive that
    /// failed or filled up taken out.
    async fn write_blocks(
        &self,
        mut writers: Vec<Option<Box<dyn ShardSink>>>,
        mut shard_bufs: Vec<PooledBuf>,
        sl: usize,
        slots: &[std::sync::Arc<super::DriveSlot>],
        quorum: usize,
    ) -> (Vec<Option<Box<dyn ShardSink>>>, Result<(), StoreError>) {
        let writes = writers
            .iter_mut()
            .zip(shard_bufs.iter_mut())
            .zip(slots)
            .map(|((w, pooled), slot)| async move {
                let Some(writer) = w.as_mut() else { return };
                if !slot.has_room(sl as u64, self.cfg.drive_reserve_bytes) {
                    tracing::warn!(drive = %slot.name, "drive full (below its reserve): no new data on it");
                    *w = None;
                    return;
                }
                let (res, buf) = writer.write_block(pooled.take()).await;
                slot.consumed(sl as u64);
                pooled.restore(buf);
                if let Err(error) = res {
                    super::log_drive_failure(&slot.name, "shard write failed; continuing without this drive", &error);
                    self.drive_failed(slot, "writing a shard", &error);
                    *w = None;
                }
            });
        futures::future::join_all(writes).await;
        drop(shard_bufs);
        let alive = check_alive(&writers, quorum);
        (writers, alive)
    }

    async fn remove_tmp_and_data(&self, set: usize, layout: &Layout, data_id: Id128) {
        let drives: Vec<_> = layout
            .distribution
            .iter()
            .filter_map(|&pos| self.slot(set, pos as usize).writer())
            .collect();
        futures::future::join_all(drives.iter().map(|d| d.remove_shards(vec![data_id]))).await;
    }

    /// PUT: stores the body as a new version of bucket/key.
    pub async fn put_object(
        self: &std::sync::Arc<Self>,
        bucket: &str,
        key: &str,
        body: ObjectBody,
        opts: PutOptions,
    ) -> Result<ObjectInfo, StoreError> {
        let brec = self.bucket_record(bucket)?;
        validate_key(key)?;
        super::check_lock_allowed(&brec, &opts.lock)?;
        let limit = self.cfg.object_size_max_bytes;
        if let Some(len) = body.declared_len {
            if len > limit {
                return Err(StoreError::EntityTooLarge {
                    size: len,
                    max: limit,
                });
            }
        }
        let (set, layout) = self.layout_for(&brec, bucket, key).await?;
        let use_md5 = self.wants_md5(opts.content_md5.is_some(), body.declared_len);
        let mut reader = BodyReader::new(body, use_md5, limit);
        // Drawn only for encrypted writes (a plain PUT asks no randomness).
        let salt = opts.seal.as_ref().map(|spec| {
            let salt = crate::seal::new_salt();
            reader.seal(spec, &salt, 1);
            salt
        });

        // Small bodies are stored inline in the metadata: one write, no files.
        // Read until the body ends or passes the threshold, keeping the chunks
        // as they came (no copy unless the body does go inline).
        let threshold = self.cfg.inline_threshold_bytes;
        let mut head: Vec<Bytes> = Vec::new();
        let mut head_len = 0usize;
        let mut ended = false;
        while head_len <= threshold {
            match reader.next().await? {
                None => {
                    ended = true;
                    break;
                }
                Some(chunk) => {
                    head_len += chunk.len();
                    head.push(chunk);
                }
            }
        }
        // Held until the commit below is done, so the orphan sweep keeps out.
        let mut inflight = None;
        let (storage, inline, written_layout) = if ended && head_len <= threshold {
            // Inline data goes into every drive's metadata: it may not take
            // the reserve that keeps reads, DELETEs and repair working on
            // full drives (issue 40: small PUTs filled every drive's
            // journal to the last byte and every request then failed).
            // The system bucket's documents (users, bucket settings) are
            // metadata themselves: they may use the reserve.
            if bucket != crate::SYSTEM_BUCKET {
                self.check_metadata_room(set, head_len as u64)?;
            }
            let data = head.concat();
            (
                Storage::Inline {
                    crc32c: crc32c(&data),
                },
                Some(data),
                Layout::single_copy(layout.stripe_size_bytes),
            )
        } else {
            // Hand the read-ahead back in order, then stream the rest.
            for chunk in head.into_iter().rev() {
                reader.push_back(chunk);
            }
            let written = self.write_data(set, &layout, &mut reader).await?;
            let storage = Storage::Parts(vec![PartMeta {
                number: 1,
                size: written.size,
                etag: String::new(),
                data_id: written.data_id,
                // The object's own checksum is the part's.
                checksum: None,
            }]);
            inflight = Some(written.inflight);
            (storage, None, layout)
        };
        let data_ids = match &storage {
            Storage::Parts(p) => p.iter().map(|p| p.data_id).collect(),
            Storage::Inline { .. } => Vec::new(),
        };
        let result = async {
            let size = reader.total;
            let digest = reader.finish(opts.content_md5)?;
            let mut etag = single_etag(&digest);
            if let Some(spec) = &opts.seal {
                etag = spec.etag(etag);
            }
            let storage = match storage {
                Storage::Parts(mut p) => {
                    p[0].etag = etag.clone();
                    Storage::Parts(p)
                }
                s => s,
            };
            let checksum = digest.checksum.or(opts.checksum.clone());
            let version_id = if brec.versioning == Versioning::Enabled {
                new_id()
            } else {
                NULL_VERSION
            };
            let meta = VersionMeta {
                version_id,
                mod_time_ns: 0,
                delete_marker: false,
                size,
                etag,
                content_type: opts
                    .content_type
                    .clone()
                    .unwrap_or_else(|| "binary/octet-stream".into()),
                headers: opts.headers.clone(),
                user_metadata: opts.user_metadata.clone(),
                tags: opts.tags.clone(),
                checksum,
                layout: written_layout,
                storage,
                seal: salt.map(|salt| crate::format::Seal {
                    cipher: crate::seal::CIPHER_AES256_GCM_64K,
                    salts: vec![salt],
                }),
                lock: opts.lock.filter(|l| !l.is_empty()),
            };
            let mut version = NewVersion::new(set, meta, inline, &opts);
            version.inflight = inflight.take();
            self.commit_version(bucket, key, version).await
        }
        .await;
        if result.is_err() {
            self.remove_data(set, data_ids).await;
        }
        drop(inflight);
        result
    }
}

/// Compares an If-Match / If-None-Match value with an ETag: `*`, quoted or not.
pub fn etag_matches(condition: &str, etag: &str) -> bool {
    condition
        .split(',')
        .map(|c| c.trim().trim_start_matches("W/").trim_matches('"'))
        .any(|c| c == "*" || c == etag)
}

/// The writes of one stripe, in flight while the next stripe arrives.
type StripeWrite<'a> = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = (Vec<Option<Box<dyn ShardSink>>>, Result<(), StoreError>)>
            + Send
            + 'a,
    >,
>;

/// Reads body chunks into `pending` until it holds a stripe or the body
/// ends; returns the bytes pending and whether the body ended.
async fn receive_stripe(
    reader: &mut BodyReader,
    pending: &mut Vec<Bytes>,
    stripe: usize,
) -> Result<(usize, bool), StoreError> {
    let mut len: usize = pending.iter().map(|b| b.len()).sum();
    while len < stripe {
        match reader.next().await? {
            None => return Ok((len, true)),
            Some(chunk) => {
                let room = stripe - len;
                if chunk.len() > room {
                    pending.push(chunk.slice(..room));
                    reader.push_back(chunk.slice(room..));
                    len += room;
                } else {
                    len += chunk.len();
                    pending.push(chunk);
                }
            }
        }
    }
    Ok((len, false))
}

/// Cuts a stripe's chunks into k data shards of equal, even length (the
/// last zero-padded) and computes the parity into the rest of `shard_bufs`;
/// returns the shard length.
fn fill_stripe(
    chunks: &[Bytes],
    len: usize,
    shard_bufs: &mut [PooledBuf],
    codec: &dyn crate::codec::Codec,
    k: usize,
) -> Result<usize, StoreError> {
    let g = StripeGeometry {
        part_size: len as u64,
        stripe_size: len as u64,
        data_shards: k as u64,
    };
    let sl = g.shard_len_for(len as u64) as usize;
    for buf in shard_bufs.iter_mut() {
        buf.clear();
    }
    // The chunks, in order, cut into k data shards of sl bytes.
    let mut shard = 0;
    for chunk in chunks {
        let mut c = &chunk[..];
        while !c.is_empty() {
            let buf = &mut shard_bufs[shard];
            let take = (sl - buf.len()).min(c.len());
            buf.extend_from_slice(&c[..take]);
            c = &c[take..];
            if buf.len() == sl {
                shard += 1;
            }
        }
    }
    for buf in shard_bufs.iter_mut() {
        // Zero padding of the last data shard, and room for parity.
        let filled = buf.len();
        buf.set_len(sl);
        buf[filled..].fill(0);
    }
    let (data_shards, parity_shards) = shard_bufs.split_at_mut(k);
    let refs: Vec<&[u8]> = data_shards.iter().map(|b| &b[..]).collect();
    let mut outs: Vec<&mut [u8]> = parity_shards.iter_mut().map(|b| &mut b[..]).collect();
    codec
        .encode(&refs, &mut outs)
        .map_err(|e| StoreError::from(std::io::Error::other(e.to_string())))?;
    Ok(sl)
}

impl Store {
    /// Whether a write quorum of `set`'s drives in service has room for
    /// `bytes` of new metadata beyond their reserve.
    pub(crate) fn check_metadata_room(&self, set: usize, bytes: u64) -> Result<(), StoreError> {
        let topo = self.topo();
        let members = &topo.sets[set];
        // A record is written twice on a drive (journal, then the flushed
        // table): counted so until the free space is read again.
        let need = bytes.saturating_mul(2) + 8192;
        let online: Vec<_> = members
            .iter()
            .map(|&i| &topo.slots[i])
            .filter(|s| s.writer().is_some())
            .collect();
        let room: Vec<_> = online
            .iter()
            .filter(|s| s.has_room(need, self.cfg.drive_reserve_bytes))
            .collect();
        let quorum = self.meta_write_quorum(members.len());
        if online.len() < quorum {
            // Short of drives, not of room: what the write would answer
            // (drives out of reach were counted as full, and a set with two
            // of four drives cut off answered 507 InsufficientStorage).
            // Nothing is counted as used for a write that will not happen.
            return Err(StoreError::QuorumLost {
                what: "metadata write",
                needed: quorum,
                available: online.len(),
            });
        }
        for s in &room {
            s.consumed(need);
        }
        let room = room.len();
        if room < quorum {
            return Err(StoreError::StorageFull(format!(
                "{room} of {} drives of the set have room beyond their reserve, {quorum} needed",
                members.len()
            )));
        }
        Ok(())
    }
}

fn check_alive<W>(writers: &[Option<W>], quorum: usize) -> Result<(), StoreError> {
    let alive = writers.iter().filter(|w| w.is_some()).count();
    if alive < quorum {
        return Err(StoreError::QuorumLost {
            what: "shard write",
            needed: quorum,
            available: alive,
        });
    }
    Ok(())
}
