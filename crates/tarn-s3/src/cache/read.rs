//! Reads of a cache bucket: an object's entry (asked of the upstream as the
//! bucket's validation says), and its bytes, from stored chunks or from
//! fills that stream to their readers as they arrive.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::StreamExt;

use super::*;

/// The bytes of one cached GET, produced by a task that walks its chunks.
pub enum CacheBody {
    Channel(mpsc::Receiver<Result<Bytes, CacheError>>),
    /// A read within one stored chunk: the engine's stream itself (no task
    /// between), the object kept from eviction while it is read.
    Direct(tarn_store::ObjectStream, super::evict::Reading),
}

impl Stream for CacheBody {
    type Item = Result<Bytes, CacheError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match &mut *self {
            CacheBody::Channel(rx) => rx.poll_recv(cx),
            CacheBody::Direct(s, _) => Pin::new(s)
                .poll_next(cx)
                .map(|o| o.map(|r| r.map_err(CacheError::from))),
        }
    }
}

/// Where a chunk's bytes come from.
enum Source {
    Stored(tarn_store::ObjectStream),
    /// A fill, and whether this read started it.
    Fill(Arc<Fill>, bool),
}

/// Pieces queued ahead of the client of a cached GET.
const BODY_QUEUE: usize = 16;

impl CacheBucket {
    pub(super) fn created_ns_matches(&self, doc: &CacheDoc) -> bool {
        self.created_ns == doc.created_ns
    }

    /// The settings as `cache list` shows them (no secret).
    pub fn summary(&self) -> serde_json::Value {
        serde_json::json!({
            "bucket": self.name,
            "upstream": format!("s3://{}/{}", self.upstream.bucket, self.upstream.prefix),
            "endpoint": self.upstream.endpoint,
            "validate": self.validate.to_string(),
            "writes": self.writes.as_str(),
            "size": self.size,
            "replicas": self.replicas,
            "chunk_bytes": CHUNK_BYTES,
        })
    }

    /// Counters, as `cache status` shows them.
    pub fn status(&self) -> serde_json::Value {
        let s = &self.stats;
        let hits = s.hits.load(Ordering::Relaxed);
        let misses = s.misses.load(Ordering::Relaxed);
        serde_json::json!({
            "bucket": self.name,
            "hits": hits,
            "misses": misses,
            "hit_ratio": if hits + misses > 0 { hits as f64 / (hits + misses) as f64 } else { 0.0 },
            "bytes_served": s.bytes_served.load(Ordering::Relaxed),
            "bytes_from_upstream": s.bytes_from_upstream.load(Ordering::Relaxed),
            "upstream_gets": s.upstream_gets.load(Ordering::Relaxed),
            "upstream_heads": s.upstream_heads.load(Ordering::Relaxed),
            "fills_failed": s.fills_failed.load(Ordering::Relaxed),
            "chunks_stored": s.chunks_stored.load(Ordering::Relaxed),
            "evictions": s.evictions.load(Ordering::Relaxed),
            "bytes_evicted": s.bytes_evicted.load(Ordering::Relaxed),
            "size": self.size,
            "pins": self.pins(),
            "usage": self.usage(),
        })
    }

    fn remember(&self, key: &str, e: Arc<Entry>) {
        let mut entries = self.entries.lock().expect("cache entries");
        if entries.len() >= ENTRIES_MAX && !entries.contains_key(key) {
            // Dropped from memory only: the engine keeps every entry.
            if let Some(k) = entries.keys().next().cloned() {
                entries.remove(&k);
            }
        }
        entries.insert(key.to_string(), e);
    }

    pub(super) fn forget(&self, key: &str) {
        self.entries.lock().expect("cache entries").remove(key);
    }

    fn negative_hit(&self, key: &str) -> bool {
        let mut neg = self.negative.lock().expect("cache negatives");
        match neg.get(key) {
            Some(&until) if until > now_ns() => true,
            Some(_) => {
                neg.remove(key);
                false
            }
            None => false,
        }
    }

    pub(super) fn remember_missing(&self, key: &str) {
        let mut neg = self.negative.lock().expect("cache negatives");
        if neg.len() >= NEGATIVE_MAX {
            let now = now_ns();
            neg.retain(|_, until| *until > now);
            if neg.len() >= NEGATIVE_MAX {
                neg.clear();
            }
        }
        neg.insert(key.to_string(), now_ns() + NEGATIVE_TTL.as_nanos() as u64);
    }

    /// The entry stored in the engine for `key`, if any.
    pub(super) async fn stored_entry(&self, key: &str) -> Result<Option<Entry>, CacheError> {
        let info = match self.store.head_object(&self.name, key, None).await {
            Ok(i) => i,
            Err(StoreError::NoSuchKey { .. }) | Err(StoreError::DeleteMarker { .. }) => {
                return Ok(None)
            }
            Err(e) => return Err(e.into()),
        };
        self.entry_of(info).map(Some)
    }

    /// The entry an object of the cache bucket records.
    pub(super) fn entry_of(&self, info: ObjectInfo) -> Result<Entry, CacheError> {
        let corrupt = |reason: String| CacheError::Corrupt {
            what: format!("{}/{}", self.name, info.key),
            reason,
        };
        let rec = info
            .headers
            .iter()
            .find(|(k, _)| k == ENTRY_HEADER)
            .ok_or_else(|| corrupt("no cache record".into()))?;
        let rec: EntryRecord = serde_json::from_str(&rec.1).map_err(|e| corrupt(e.to_string()))?;
        Ok(Entry {
            meta: UpstreamMeta {
                etag: rec.etag,
                size: rec.size,
                last_modified_ns: rec.last_modified_ns,
                version_id: rec.version_id,
                content_type: info.content_type,
                headers: info
                    .headers
                    .into_iter()
                    .filter(|(k, _)| k != ENTRY_HEADER)
                    .collect(),
                user_metadata: info.user_metadata,
            },
            generation: rec.generation,
            validated_ns: rec.validated_ns,
        })
    }

    /// Records `meta` as the object at `key`; a different generation before
    /// it loses its chunks.
    async fn install(
        &self,
        key: &str,
        meta: UpstreamMeta,
        old: Option<&Entry>,
    ) -> Result<Arc<Entry>, CacheError> {
        self.record(key, Entry::new(key, meta), old).await
    }

    /// Stores `e` as the entry of `key`.
    pub(super) async fn record(
        &self,
        key: &str,
        e: Entry,
        old: Option<&Entry>,
    ) -> Result<Arc<Entry>, CacheError> {
        let rec = EntryRecord {
            etag: e.meta.etag.clone(),
            size: e.meta.size,
            last_modified_ns: e.meta.last_modified_ns,
            version_id: e.meta.version_id.clone(),
            generation: e.generation.clone(),
            validated_ns: e.validated_ns,
        };
        let mut headers = e.meta.headers.clone();
        headers.push((
            ENTRY_HEADER.to_string(),
            serde_json::to_string(&rec).expect("an entry record serializes"),
        ));
        self.store
            .put_object(
                &self.name,
                key,
                ObjectBody::from_bytes(Bytes::new()),
                PutOptions {
                    content_type: Some(e.meta.content_type.clone()),
                    headers,
                    user_metadata: e.meta.user_metadata.clone(),
                    ..Default::default()
                },
            )
            .await?;
        let e = Arc::new(e);
        self.remember(key, e.clone());
        if let Some(old) = old.filter(|o| o.generation != e.generation) {
            self.uncharge(key, &old.generation);
            self.drop_generation(old.generation.clone());
        }
        Ok(e)
    }

    /// Deletes a generation's chunks in the background.
    pub(super) fn drop_generation(&self, generation: String) {
        let (store, bucket) = (self.store.clone(), self.chunks_bucket.clone());
        tokio::spawn(async move {
            if let Err(error) = delete_generation(&store, &bucket, &generation).await {
                tracing::warn!(%bucket, %generation, %error, "cannot delete an old generation's chunks yet");
            }
        });
    }

    /// The upstream object is no longer `entry` (a fill's If-Match failed):
    /// the entry goes, unless another has replaced it, so the next read
    /// asks the upstream again, whatever the bucket's validation.
    async fn invalidate(&self, key: &str, entry: &Entry) {
        self.forget(key);
        match self.stored_entry(key).await {
            Ok(Some(e)) if e.generation == entry.generation => {
                if let Err(error) = self.vanish(key, &e).await {
                    tracing::warn!(bucket = %self.name, %key, %error, "cannot drop a changed object's entry yet");
                }
                // Not known missing: only changed.
                self.negative.lock().expect("cache negatives").remove(key);
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(bucket = %self.name, %key, %error, "cannot read a changed object's entry");
            }
        }
    }

    /// The object at `key` gone upstream: its entry and chunks go too.
    pub(super) async fn vanish(&self, key: &str, old: &Entry) -> Result<(), CacheError> {
        self.forget(key);
        match self.store.delete_object(&self.name, key, None).await {
            Ok(_) | Err(StoreError::NoSuchKey { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        self.uncharge(key, &old.generation);
        self.drop_generation(old.generation.clone());
        self.remember_missing(key);
        Ok(())
    }

    /// Whether a read may serve `e` without asking the upstream.
    pub(super) fn fresh(&self, e: &Entry) -> bool {
        match self.validate {
            Validate::Never => true,
            Validate::Ttl(s) => now_ns().saturating_sub(e.validated_ns) < s * 1_000_000_000,
            Validate::Always => false,
        }
    }

    /// The entry of `key`, checked against the upstream as the bucket's
    /// validation asks; NoSuchKey when the upstream has no such object.
    pub async fn entry(&self, key: &str) -> Result<Arc<Entry>, CacheError> {
        let memo = self
            .entries
            .lock()
            .expect("cache entries")
            .get(key)
            .cloned();
        let known = match memo {
            Some(e) => Some(e),
            None => self.stored_entry(key).await?.map(Arc::new),
        };
        if let Some(e) = known {
            if self.fresh(&e) {
                self.remember(key, e.clone());
                return Ok(e);
            }
            self.stats.upstream_heads.fetch_add(1, Ordering::Relaxed);
            return match self.upstream.validate(key, &e.meta.etag).await? {
                Validation::Unchanged => {
                    let e = Arc::new(Entry {
                        validated_ns: now_ns(),
                        ..(*e).clone()
                    });
                    self.remember(key, e.clone());
                    Ok(e)
                }
                Validation::Changed(m) => self.install(key, m, Some(&e)).await,
                Validation::Gone => {
                    self.vanish(key, &e).await?;
                    Err(CacheError::NoSuchKey)
                }
            };
        }
        if self.negative_hit(key) {
            return Err(CacheError::NoSuchKey);
        }
        self.stats.upstream_heads.fetch_add(1, Ordering::Relaxed);
        match self.upstream.head(key).await? {
            None => {
                self.remember_missing(key);
                Err(CacheError::NoSuchKey)
            }
            Some(m) => self.install(key, m, None).await,
        }
    }

    /// The bytes [start, end) of `entry`'s object.
    pub async fn body(
        self: &Arc<Self>,
        key: &str,
        entry: Arc<Entry>,
        start: u64,
        end: u64,
    ) -> CacheBody {
        let (first, last) = (start / CHUNK_BYTES, end.saturating_sub(1) / CHUNK_BYTES);
        if end > start && first == last {
            let ck = entry.chunk_key(first);
            let filling = self.fills.lock().expect("cache fills").contains_key(&ck);
            let (cs, ce) = entry.chunk_bounds(first);
            if !filling {
                let got = self
                    .store
                    .get_object(
                        &self.chunks_bucket,
                        &ck,
                        None,
                        Some(ByteRange::Closed(start - cs, end - cs - 1)),
                        None,
                    )
                    .await;
                if let Some(got) = got.ok().filter(|g| g.info.size == ce - cs) {
                    let reading = self.reading(key, &entry);
                    self.ensure_counted();
                    self.stats.hits.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .bytes_served
                        .fetch_add(end - start, Ordering::Relaxed);
                    return CacheBody::Direct(got.stream, reading);
                }
            }
        }
        self.body_of(key, entry, (start, end), true)
    }

    /// A read of the server's own (a model index a prefetch reads): not
    /// counted as a client's hit or miss.
    pub(super) fn body_of(
        self: &Arc<Self>,
        key: &str,
        entry: Arc<Entry>,
        (start, end): (u64, u64),
        counted: bool,
    ) -> CacheBody {
        let (tx, rx) = mpsc::channel(BODY_QUEUE);
        if end > start {
            tokio::spawn(
                self.clone()
                    .pump(key.to_string(), entry, (start, end), counted, tx),
            );
        }
        CacheBody::Channel(rx)
    }

    async fn pump(
        self: Arc<Self>,
        key: String,
        entry: Arc<Entry>,
        (start, end): (u64, u64),
        counted: bool,
        tx: mpsc::Sender<Result<Bytes, CacheError>>,
    ) {
        self.ensure_counted();
        let _reading = self.reading(&key, &entry);
        let first = start / CHUNK_BYTES;
        let last = (end - 1) / CHUNK_BYTES;
        let mut missed = false;
        let span = |n: u64| {
            let (cs, ce) = entry.chunk_bounds(n);
            (start.max(cs) - cs, end.min(ce) - cs)
        };
        // The next chunk is opened (its metadata read, its first stripe
        // read ahead) while this one is sent: no gap between chunks.
        let mut next = Some(self.open_ahead(&key, &entry, first, span(first), last));
        for n in first..=last {
            let opened = match next.take() {
                Some(h) => h.await.unwrap_or_else(|e| {
                    Err(CacheError::Failed(format!("a chunk's read stopped: {e}")))
                }),
                None => unreachable!("each chunk is opened before it is sent"),
            };
            if n < last {
                next = Some(self.open_ahead(&key, &entry, n + 1, span(n + 1), last));
            }
            let (a, b) = span(n);
            let sent = match opened {
                Ok(src) => self.send_source(src, &entry, n, (a, b), &tx).await,
                Err(e) => Err(e),
            };
            match sent {
                Ok((true, fill)) => missed |= fill,
                Ok((false, _)) => return,
                Err(e) => {
                    if matches!(e, CacheError::Changed) {
                        self.invalidate(&key, &entry).await;
                    }
                    tracing::warn!(bucket = %self.name, %key, error = %e, "a cached read failed; its response is cut off");
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            }
        }
        if !counted {
            return;
        }
        let counter = if missed {
            &self.stats.misses
        } else {
            &self.stats.hits
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn open_ahead(
        self: &Arc<Self>,
        key: &str,
        entry: &Arc<Entry>,
        n: u64,
        span: (u64, u64),
        last: u64,
    ) -> tokio::task::JoinHandle<Result<Source, CacheError>> {
        let (this, key, entry) = (self.clone(), key.to_string(), entry.clone());
        tokio::spawn(async move { this.open_chunk(&key, &entry, n, span, last).await })
    }

    /// Where bytes [a, b) of chunk `n` come from: the engine, or a fill
    /// (started here when the chunk is not stored, with its read-ahead).
    async fn open_chunk(
        self: &Arc<Self>,
        key: &str,
        entry: &Arc<Entry>,
        n: u64,
        (a, b): (u64, u64),
        last: u64,
    ) -> Result<Source, CacheError> {
        let ck = entry.chunk_key(n);
        let filling = self.fills.lock().expect("cache fills").get(&ck).cloned();
        if let Some(fill) = filling {
            return Ok(Source::Fill(fill, false));
        }
        let (cs, ce) = entry.chunk_bounds(n);
        match self
            .store
            .get_object(
                &self.chunks_bucket,
                &ck,
                None,
                Some(ByteRange::Closed(a, b - 1)),
                None,
            )
            .await
        {
            Ok(got) if got.info.size == ce - cs => return Ok(Source::Stored(got.stream)),
            Ok(got) => {
                tracing::warn!(bucket = %self.chunks_bucket, chunk = %ck, size = got.info.size, "a stored chunk has the wrong size; fetched again");
            }
            Err(StoreError::NoSuchKey { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let slot = self.fill_slots.clone().try_acquire_owned().ok();
        let fill = self.fill(key, entry, n, slot);
        // The chunks of the read that follow are filled ahead of it, and a
        // ranged read's next chunk (a reader of ranges tends to go on).
        let ahead_end = (n + READ_AHEAD_CHUNKS)
            .min(last + 1)
            .min(entry.chunks().saturating_sub(1));
        for m in n + 1..=ahead_end {
            self.read_ahead(key, entry, m);
        }
        Ok(Source::Fill(fill, true))
    }

    /// Sends bytes [a, b) of chunk `n` from where it was opened: (whether
    /// the reader is still there, whether the upstream was needed).
    async fn send_source(
        &self,
        src: Source,
        entry: &Entry,
        n: u64,
        (a, b): (u64, u64),
        tx: &mpsc::Sender<Result<Bytes, CacheError>>,
    ) -> Result<(bool, bool), CacheError> {
        match src {
            Source::Fill(fill, started) => {
                // A fill already whole (being stored) serves like a stored chunk.
                let whole =
                    !started && matches!(fill.state.lock().expect("fill").end, Some(Ok(())));
                let sent = send_from_fill(&fill, a, b, tx, &self.stats).await?;
                // Another node's fill, read from the engine, is no miss.
                Ok((sent, !whole && fetched(&fill)))
            }
            Source::Stored(mut stream) => {
                let mut sent = 0;
                while let Some(piece) = stream.next().await {
                    let piece = piece?;
                    sent += piece.len() as u64;
                    self.stats
                        .bytes_served
                        .fetch_add(piece.len() as u64, Ordering::Relaxed);
                    if tx.send(Ok(piece)).await.is_err() {
                        return Ok((false, false));
                    }
                }
                if sent != b - a {
                    return Err(CacheError::Failed(format!(
                        "chunk {} gave {sent} of {} bytes",
                        entry.chunk_key(n),
                        b - a
                    )));
                }
                Ok((true, false))
            }
        }
    }

    /// Starts filling chunk `m` unless it is stored or being filled.
    fn read_ahead(self: &Arc<Self>, key: &str, entry: &Arc<Entry>, m: u64) {
        if self
            .fills
            .lock()
            .expect("cache fills")
            .contains_key(&entry.chunk_key(m))
        {
            return;
        }
        // Only into a free slot: read-ahead is never read through.
        let Ok(slot) = self.fill_slots.clone().try_acquire_owned() else {
            return;
        };
        let (this, key, entry) = (self.clone(), key.to_string(), entry.clone());
        tokio::spawn(async move {
            let stored = this
                .store
                .head_object(&this.chunks_bucket, &entry.chunk_key(m), None)
                .await;
            if let Err(StoreError::NoSuchKey { .. }) = stored {
                this.fill(&key, &entry, m, Some(slot));
            }
        });
    }

    /// The fill of chunk `n`: the one in progress, or a new one, which keeps
    /// the chunk when it has a slot.
    pub(super) fn fill(
        self: &Arc<Self>,
        key: &str,
        entry: &Arc<Entry>,
        n: u64,
        slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Arc<Fill> {
        let ck = entry.chunk_key(n);
        let mut fills = self.fills.lock().expect("cache fills");
        if let Some(f) = fills.get(&ck) {
            return f.clone();
        }
        let fill = Arc::new(Fill {
            state: Mutex::new(FillState::default()),
            changed: Notify::new(),
            keeps: slot.is_some(),
        });
        fills.insert(ck, fill.clone());
        drop(fills);
        tokio::spawn(
            self.clone()
                .run_fill(key.to_string(), entry.clone(), n, fill.clone(), slot),
        );
        fill
    }

    async fn run_fill(
        self: Arc<Self>,
        key: String,
        entry: Arc<Entry>,
        n: u64,
        fill: Arc<Fill>,
        _slot: Option<tokio::sync::OwnedSemaphorePermit>,
    ) {
        let ck = entry.chunk_key(n);
        let finish = |end: Result<(), String>| {
            fill.state.lock().expect("fill").end = Some(end);
            fill.changed.notify_waiters();
        };
        let stored = |r: Result<(), String>| {
            fill.state.lock().expect("fill").stored = Some(r);
            fill.changed.notify_waiters();
        };
        // In a cluster one node fills a chunk: the others wait for it to be
        // stored and read it from the engine.
        let claim = if fill.keeps {
            self.claim(&entry, n).await
        } else {
            Ok(Claim::None)
        };
        let claimed = match claim {
            Ok(Claim::Ours(c)) => Some(c),
            Ok(Claim::None) => None,
            Ok(Claim::StoredElsewhere) => {
                let r = self.fill_from_store(&entry, n, &fill).await;
                let r = r.map_err(|e| e.to_string());
                finish(r.clone());
                stored(r);
                self.fills.lock().expect("cache fills").remove(&ck);
                return;
            }
            Err(e) => {
                tracing::warn!(bucket = %self.name, %key, chunk = n, error = %e, "cannot claim a chunk's fill");
                finish(Err(e.to_string()));
                stored(Err(e.to_string()));
                self.fills.lock().expect("cache fills").remove(&ck);
                return;
            }
        };
        let result = self.fetch(&key, &entry, n, &fill).await;
        match result {
            Ok(()) if !fill.keeps => {
                finish(Ok(()));
                stored(Err(NOT_KEPT.into()));
            }
            Ok(()) => {
                finish(Ok(()));
                let (pieces, len) = {
                    let st = fill.state.lock().expect("fill");
                    (st.pieces.clone(), st.len)
                };
                let body = ObjectBody {
                    stream: Box::pin(futures::stream::iter(pieces.into_iter().map(Ok))),
                    declared_len: Some(len),
                    finish: None,
                };
                match self
                    .store
                    .put_object(&self.chunks_bucket, &ck, body, PutOptions::default())
                    .await
                {
                    Ok(_) => {
                        self.stats.chunks_stored.fetch_add(1, Ordering::Relaxed);
                        self.charge(&key, &entry, len);
                        stored(Ok(()));
                    }
                    Err(error) => {
                        tracing::warn!(bucket = %self.name, %key, chunk = n, %error, "a fetched chunk could not be stored; it is fetched again when read");
                        stored(Err(format!("the chunk could not be stored: {error}")));
                    }
                }
            }
            Err(e) => {
                self.stats.fills_failed.fetch_add(1, Ordering::Relaxed);
                if matches!(e, CacheError::Changed) {
                    self.invalidate(&key, &entry).await;
                }
                tracing::warn!(bucket = %self.name, %key, chunk = n, error = %e, "a chunk could not be fetched from the upstream");
                finish(Err(e.to_string()));
                stored(Err(e.to_string()));
            }
        }
        if let Some(c) = claimed {
            self.release_claim(&c).await;
        }
        self.fills.lock().expect("cache fills").remove(&ck);
    }

    /// Fetches chunk `n` into `fill`, resuming from where a broken answer
    /// stopped.
    async fn fetch(&self, key: &str, entry: &Entry, n: u64, fill: &Fill) -> Result<(), CacheError> {
        let (cs, ce) = entry.chunk_bounds(n);
        let mut got = 0u64;
        let mut failures = 0u32;
        let mut backoff = Duration::from_millis(50);
        loop {
            let before = got;
            self.stats.upstream_gets.fetch_add(1, Ordering::Relaxed);
            let error = match self
                .upstream
                .get_range(key, &entry.meta.etag, cs + got, ce)
                .await
            {
                Ok(mut body) => {
                    let mut broke = None;
                    while let Some(piece) = body.next().await {
                        match piece {
                            Ok(mut p) => {
                                let room = (ce - cs - got) as usize;
                                if p.len() > room {
                                    p.truncate(room);
                                }
                                got += p.len() as u64;
                                self.stats
                                    .bytes_from_upstream
                                    .fetch_add(p.len() as u64, Ordering::Relaxed);
                                {
                                    let mut st = fill.state.lock().expect("fill");
                                    st.len += p.len() as u64;
                                    st.pieces.push(p);
                                    st.fetched = true;
                                }
                                fill.changed.notify_waiters();
                                if got == ce - cs {
                                    break;
                                }
                            }
                            Err(e) => {
                                broke = Some(e);
                                break;
                            }
                        }
                    }
                    if got == ce - cs {
                        return Ok(());
                    }
                    broke.unwrap_or_else(|| UpstreamError::Unreachable {
                        endpoint: self.upstream.endpoint.clone(),
                        reason: format!("the answer ended {} bytes short", ce - cs - got),
                    })
                }
                Err(UpstreamError::Status { status: 412, .. }) => return Err(CacheError::Changed),
                Err(UpstreamError::Status { status: 404, .. }) => {
                    // Gone meanwhile: asked again on the next read.
                    return Err(CacheError::Changed);
                }
                Err(e) => e,
            };
            if !error.transient() {
                return Err(error.into());
            }
            if got > before {
                failures = 0;
                backoff = Duration::from_millis(50);
            }
            failures += 1;
            if failures >= FILL_TRIES {
                return Err(error.into());
            }
            tracing::info!(bucket = %self.name, %key, chunk = n, from = got, %error, "upstream read broke off; resuming");
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
    }
}

fn fetched(fill: &Fill) -> bool {
    fill.state.lock().expect("fill").fetched
}

/// Sends bytes [a, b) of a fill as they arrive; whether the reader is still
/// there.
async fn send_from_fill(
    fill: &Fill,
    a: u64,
    b: u64,
    tx: &mpsc::Sender<Result<Bytes, CacheError>>,
    stats: &CacheStats,
) -> Result<bool, CacheError> {
    let mut pos = a;
    while pos < b {
        let piece = loop {
            let notified = fill.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = fill.state.lock().expect("fill");
                if pos < st.len {
                    let mut off = 0u64;
                    let mut found = None;
                    for p in &st.pieces {
                        let len = p.len() as u64;
                        if pos < off + len {
                            let from = (pos - off) as usize;
                            let to = ((b - off).min(len)) as usize;
                            found = Some(p.slice(from..to));
                            break;
                        }
                        off += len;
                    }
                    break found.expect("a position below the length is in a piece");
                }
                match &st.end {
                    Some(Err(e)) => {
                        return Err(if e == &CacheError::Changed.to_string() {
                            CacheError::Changed
                        } else {
                            CacheError::Failed(format!("upstream read failed: {e}"))
                        })
                    }
                    Some(Ok(())) => {
                        return Err(CacheError::Failed(
                            "a fill ended before the bytes asked for".into(),
                        ))
                    }
                    None => {}
                }
            }
            notified.await;
        };
        pos += piece.len() as u64;
        stats
            .bytes_served
            .fetch_add(piece.len() as u64, Ordering::Relaxed);
        if tx.send(Ok(piece)).await.is_err() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Who fills a chunk, in a cluster.
enum Claim {
    /// This node: its claim object's key, deleted once the chunk is stored.
    Ours(String),
    /// Another node filled it while this one waited.
    StoredElsewhere,
    /// One node: no claims needed (fills are single-flight in memory).
    None,
}

/// How long a node waits for a chunk another node claimed before it takes
/// the claim over (the claimer stopped or stalled).
const CLAIM_WAIT: Duration = Duration::from_secs(30);
const CLAIMS_PREFIX: &str = "claims/";

impl CacheBucket {
    /// Claims the fill of chunk `n` across a cluster with a conditional
    /// create of `claims/<chunk>` in the internal bucket (creates are
    /// linearizable): the node whose create succeeds fetches; the others
    /// wait for the chunk. A claim older than `CLAIM_WAIT` is taken over.
    async fn claim(&self, entry: &Entry, n: u64) -> Result<Claim, CacheError> {
        if self.store.catalog().is_none() {
            return Ok(Claim::None);
        }
        let ck = entry.chunk_key(n);
        let (cs, ce) = entry.chunk_bounds(n);
        let claim = format!("{CLAIMS_PREFIX}{ck}");
        loop {
            if self.create_claim(&claim).await?.is_some() {
                // The chunk may have been stored before this claim.
                return match self.store.head_object(&self.chunks_bucket, &ck, None).await {
                    Ok(i) if i.size == ce - cs => {
                        self.release_claim(&claim).await;
                        Ok(Claim::StoredElsewhere)
                    }
                    _ => Ok(Claim::Ours(claim)),
                };
            }
            let deadline = tokio::time::Instant::now() + CLAIM_WAIT;
            let mut pause = Duration::from_millis(20);
            loop {
                match self.store.head_object(&self.chunks_bucket, &ck, None).await {
                    Ok(i) if i.size == ce - cs => return Ok(Claim::StoredElsewhere),
                    _ => {}
                }
                match self
                    .store
                    .head_object(&self.chunks_bucket, &claim, None)
                    .await
                {
                    // Released without the chunk (its fill failed): try to
                    // claim it.
                    Err(StoreError::NoSuchKey { .. }) => break,
                    Ok(c)
                        if tokio::time::Instant::now() >= deadline
                            && now_ns().saturating_sub(c.last_modified_ns)
                                >= CLAIM_WAIT.as_nanos() as u64 =>
                    {
                        tracing::warn!(bucket = %self.chunks_bucket, chunk = %ck, "a chunk's claim outlived its fill; taking it over");
                        let _ = self
                            .store
                            .delete_object_if(&self.chunks_bucket, &claim, None, Some(&c.etag))
                            .await;
                        break;
                    }
                    _ => {}
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(250));
            }
        }
    }

    /// Creates `claim` in the internal bucket unless it exists (a
    /// conditional create, linearizable in a cluster): its ETag, or None
    /// when another holds it. Each claim has its own bytes, so its own
    /// ETag: a takeover deletes only the claim it found stale.
    pub(super) async fn create_claim(&self, claim: &str) -> Result<Option<String>, StoreError> {
        let made = self
            .store
            .put_object(
                &self.chunks_bucket,
                claim,
                ObjectBody::from_bytes(Bytes::from(super::write::random_hex())),
                PutOptions {
                    if_none_match: Some("*".into()),
                    ..Default::default()
                },
            )
            .await;
        match made {
            Ok(info) => Ok(Some(info.etag)),
            Err(StoreError::PreconditionFailed(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn release_claim(&self, claim: &str) {
        if let Err(error) = self
            .store
            .delete_object(&self.chunks_bucket, claim, None)
            .await
        {
            tracing::warn!(bucket = %self.chunks_bucket, %claim, %error, "cannot release a chunk's claim; it lapses");
        }
    }

    /// A chunk another node stored, into `fill` for its readers.
    async fn fill_from_store(&self, entry: &Entry, n: u64, fill: &Fill) -> Result<(), CacheError> {
        let got = self
            .store
            .get_object(&self.chunks_bucket, &entry.chunk_key(n), None, None, None)
            .await?;
        let mut stream = got.stream;
        while let Some(p) = stream.next().await {
            let p = p?;
            {
                let mut st = fill.state.lock().expect("fill");
                st.len += p.len() as u64;
                st.pieces.push(p);
            }
            fill.changed.notify_waiters();
        }
        Ok(())
    }
}
