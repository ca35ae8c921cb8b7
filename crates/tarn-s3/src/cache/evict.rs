//! Capacity of cache buckets: what each holds (`Resident`, per object),
//! eviction by whole object when a bucket passes its high watermark or the
//! node its budget, pins, and drops.
//!
//! Eviction is least-recently-used with a probation queue (2Q): objects read
//! once are evicted before objects read again, so one scan over a dataset
//! does not push out the model every request reads. Pinned objects and
//! objects being read are never evicted. An evicted object keeps its entry
//! (listings and HEADs stay cheap); only its chunks go.

use super::*;

/// Eviction starts above this share of a limit and stops at the low one.
pub const HIGH_WATERMARK: f64 = 0.90;
pub const LOW_WATERMARK: f64 = 0.80;

/// What one cached object holds on this node's count.
#[derive(Debug, Clone)]
pub(super) struct Resident {
    pub generation: String,
    pub bytes: u64,
    pub last_ns: u64,
    /// Reads seen: one means probation (evicted first).
    pub uses: u32,
    /// Readers streaming it now.
    pub readers: u32,
}

/// A pinned prefix; `until_ns` None pins until unpinned.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Pin {
    pub prefix: String,
    pub until_ns: Option<u64>,
}

/// Node-wide: the budget over every cache bucket and what they hold.
#[derive(Default)]
pub struct Shared {
    pub budget: AtomicU64,
    pub used: AtomicU64,
    pub buckets: Mutex<Vec<std::sync::Weak<CacheBucket>>>,
    evicting: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn live(&self) -> Vec<Arc<CacheBucket>> {
        let mut b = self.buckets.lock().expect("cache registry");
        b.retain(|w| w.strong_count() > 0);
        b.iter().filter_map(|w| w.upgrade()).collect()
    }
}

fn over(used: u64, limit: u64, mark: f64) -> bool {
    limit > 0 && used as f64 > limit as f64 * mark
}

/// Keeps an object from eviction while a reader streams it.
pub struct Reading {
    bucket: Arc<CacheBucket>,
    key: String,
}

impl Drop for Reading {
    fn drop(&mut self) {
        if let Some(r) = self
            .bucket
            .resident
            .lock()
            .expect("cache residents")
            .get_mut(&self.key)
        {
            r.readers = r.readers.saturating_sub(1);
        }
    }
}

impl CacheBucket {
    /// Bytes this bucket holds (as counted here).
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub(super) fn pinned(&self, key: &str) -> bool {
        let now = now_ns();
        self.pins
            .read()
            .expect("cache pins")
            .iter()
            .any(|p| key.starts_with(&p.prefix) && p.until_ns.is_none_or(|u| u > now))
    }

    pub fn pins(&self) -> Vec<Pin> {
        self.pins.read().expect("cache pins").clone()
    }

    /// A read of `key` begins: counted as a use; kept while it streams.
    pub(super) fn reading(self: &Arc<Self>, key: &str, entry: &Entry) -> Reading {
        let mut res = self.resident.lock().expect("cache residents");
        let r = res.entry(key.to_string()).or_insert_with(|| Resident {
            generation: entry.generation.clone(),
            bytes: 0,
            last_ns: 0,
            uses: 0,
            readers: 0,
        });
        if r.generation != entry.generation {
            // Its old generation's chunks are being deleted (uncharged there).
            r.generation = entry.generation.clone();
        }
        r.last_ns = now_ns();
        r.uses = r.uses.saturating_add(1);
        r.readers += 1;
        Reading {
            bucket: self.clone(),
            key: key.to_string(),
        }
    }

    /// A chunk of `entry` was stored: counted, and eviction started when a
    /// limit is passed.
    pub(super) fn charge(self: &Arc<Self>, key: &str, entry: &Entry, bytes: u64) {
        {
            let mut res = self.resident.lock().expect("cache residents");
            let r = res.entry(key.to_string()).or_insert_with(|| Resident {
                generation: entry.generation.clone(),
                bytes: 0,
                last_ns: now_ns(),
                uses: 0,
                readers: 0,
            });
            if r.generation != entry.generation {
                return;
            }
            r.bytes += bytes;
        }
        self.used.fetch_add(bytes, Ordering::Relaxed);
        self.shared.used.fetch_add(bytes, Ordering::Relaxed);
        self.maybe_evict();
    }

    /// A generation of `key` is being deleted: its bytes are no longer
    /// counted.
    pub(super) fn uncharge(&self, key: &str, generation: &str) {
        let mut res = self.resident.lock().expect("cache residents");
        if let Some(r) = res.get_mut(key).filter(|r| r.generation == generation) {
            let b = std::mem::take(&mut r.bytes);
            self.used.fetch_sub(b.min(self.used()), Ordering::Relaxed);
            let total = self.shared.used.load(Ordering::Relaxed);
            self.shared.used.fetch_sub(b.min(total), Ordering::Relaxed);
            if r.readers == 0 {
                res.remove(key);
            }
        }
    }

    fn needs_eviction(&self, mark: f64) -> bool {
        over(self.used(), self.size.unwrap_or(0), mark)
    }

    /// Starts the node's evictor when a bucket or the node is over its high
    /// watermark.
    pub(super) fn maybe_evict(self: &Arc<Self>) {
        let shared = &self.shared;
        let node_over = over(
            shared.used.load(Ordering::Relaxed),
            shared.budget.load(Ordering::Relaxed),
            HIGH_WATERMARK,
        );
        if !node_over && !self.needs_eviction(HIGH_WATERMARK) {
            return;
        }
        if shared.evicting.swap(true, Ordering::AcqRel) {
            return;
        }
        let shared = self.shared.clone();
        tokio::spawn(async move {
            evict(&shared).await;
            shared.evicting.store(false, Ordering::Release);
        });
    }

    /// This bucket's next victim: probation before protected, oldest first;
    /// never pinned, never read now.
    fn victim(&self) -> Option<(String, Resident)> {
        let res = self.resident.lock().expect("cache residents");
        res.iter()
            .filter(|(k, r)| r.bytes > 0 && r.readers == 0 && !self.pinned(k))
            .min_by_key(|(_, r)| (r.uses > 1, r.last_ns))
            .map(|(k, r)| (k.clone(), r.clone()))
    }

    /// Deletes the chunks of one object; its entry stays.
    async fn evict_object(&self, key: &str, r: &Resident) -> Result<(), StoreError> {
        self.uncharge(key, &r.generation);
        delete_generation(&self.store, &self.chunks_bucket, &r.generation).await?;
        self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_evicted
            .fetch_add(r.bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Drops what is cached under `prefix` (pinned or not): every entry's
    /// chunks, found from the entries in the engine (so what other nodes
    /// cached goes too). Entries stay. How many objects and bytes.
    pub async fn drop_prefix(&self, prefix: &str) -> Result<(u64, u64), CacheError> {
        let (mut objects, mut bytes) = (0, 0);
        let mut after = None;
        loop {
            let page = engine_page(&self.store, &self.name, prefix, None, after.clone()).await?;
            for o in &page.objects {
                self.forget(&o.key);
                let Some(e) = self.stored_entry(&o.key).await? else {
                    continue;
                };
                let held = self
                    .resident
                    .lock()
                    .expect("cache residents")
                    .get(&o.key)
                    .map_or(0, |r| r.bytes);
                self.uncharge(&o.key, &e.generation);
                let n = delete_generation(&self.store, &self.chunks_bucket, &e.generation).await?;
                if n > 0 {
                    objects += 1;
                    bytes += held;
                }
            }
            if !page.is_truncated {
                return Ok((objects, bytes));
            }
            after = page.next_after;
        }
    }

    /// What this bucket holds: its objects and bytes by first path segment.
    pub fn usage(&self) -> serde_json::Value {
        let res = self.resident.lock().expect("cache residents");
        let mut by_prefix: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
        let mut objects = 0;
        for (k, r) in res.iter().filter(|(_, r)| r.bytes > 0) {
            objects += 1;
            let p = match k.find('/') {
                Some(i) => k[..=i].to_string(),
                None => String::new(),
            };
            let e = by_prefix.entry(p).or_default();
            e.0 += 1;
            e.1 += r.bytes;
        }
        serde_json::json!({
            "objects_cached": objects,
            "bytes_cached": self.used(),
            "prefixes": by_prefix
                .into_iter()
                .take(1000)
                .map(|(p, (o, b))| serde_json::json!({"prefix": p, "objects": o, "bytes": b}))
                .collect::<Vec<_>>(),
        })
    }

    /// Whether the bucket is shared by the nodes of a cluster (counted
    /// again from time to time; one node evicts it at a time).
    fn clustered(&self) -> bool {
        self.store.catalog().is_some()
    }

    /// Counts what the engine holds for this bucket: once after the start
    /// on one node; in a cluster again every `RECOUNT_MIN` or more (ten
    /// times what a count takes), so that each node's count includes what
    /// the others filled, evicted and dropped.
    pub(super) fn ensure_counted(self: &Arc<Self>) {
        if self.counted.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(this) = weak.upgrade() else { return };
                let t0 = std::time::Instant::now();
                let r = this.count().await;
                if let Err(error) = &r {
                    tracing::warn!(bucket = %this.name, %error, "cannot count what the cache holds; counted again later");
                }
                if !this.clustered() {
                    if r.is_err() {
                        // Again on the next read.
                        this.counted.store(false, Ordering::Release);
                    }
                    return;
                }
                let pause = RECOUNT_MIN.max(t0.elapsed() * 10);
                drop(this);
                tokio::time::sleep(pause).await;
            }
        });
    }

    /// Counts what the engine holds for this bucket: the chunks of each
    /// entry's generation, which replace this node's count. Chunks of no
    /// entry's generation (left by a change or a crash) are deleted: on one
    /// node those written before this process started, in a cluster those
    /// untouched for `ORPHAN_AGE` (a write through another node may be
    /// storing a generation whose entry comes last).
    pub(super) async fn count(self: &Arc<Self>) -> Result<(), CacheError> {
        // Generation → (bytes, newest chunk's time).
        let mut gens: HashMap<String, (u64, u64)> = HashMap::new();
        let mut after = None;
        loop {
            let page =
                engine_page(&self.store, &self.chunks_bucket, "", None, after.clone()).await?;
            for o in &page.objects {
                match o.key.split_once('/') {
                    // A fill's claim or the evictor's lease, not a generation.
                    Some(("claims", _)) | None => {}
                    Some((g, _)) => {
                        let e = gens.entry(g.to_string()).or_default();
                        e.0 += o.size;
                        e.1 = e.1.max(o.last_modified_ns);
                    }
                }
            }
            if !page.is_truncated {
                break;
            }
            after = page.next_after;
        }
        let mut after = None;
        let mut found: HashMap<String, (Entry, u64)> = HashMap::new();
        loop {
            let page = engine_page(&self.store, &self.name, "", None, after.clone()).await?;
            let last = page.next_after.clone();
            for o in page.objects {
                let key = o.key.clone();
                match self.entry_of(o) {
                    Ok(e) => {
                        if let Some((bytes, _)) = gens.remove(&e.generation) {
                            found.insert(key, (e, bytes));
                        }
                    }
                    Err(error) => {
                        tracing::warn!(bucket = %self.name, %key, %error, "an unreadable cache entry is not counted")
                    }
                }
            }
            if !page.is_truncated {
                break;
            }
            after = last;
        }
        {
            let mut res = self.resident.lock().expect("cache residents");
            if !self.clustered() {
                // One node: what was filled and read since the start is
                // counted already (and may be newer than the listing).
                found.retain(|k, _| !res.contains_key(k));
            }
            for (key, r) in res.iter_mut() {
                if !self.clustered() {
                    break;
                }
                match found.remove(key) {
                    Some((e, bytes)) => {
                        r.generation = e.generation;
                        r.bytes = bytes;
                    }
                    // Evicted or dropped (by another node), or not stored.
                    None => r.bytes = 0,
                }
            }
            res.retain(|_, r| r.bytes > 0 || r.readers > 0);
            for (key, (e, bytes)) in found {
                res.insert(
                    key,
                    Resident {
                        generation: e.generation,
                        bytes,
                        last_ns: e.validated_ns,
                        uses: 1,
                        readers: 0,
                    },
                );
            }
            let total: u64 = res.values().map(|r| r.bytes).sum();
            let before = self.used.swap(total, Ordering::Relaxed);
            if total >= before {
                self.shared
                    .used
                    .fetch_add(total - before, Ordering::Relaxed);
            } else {
                let d = before - total;
                let _ = self
                    .shared
                    .used
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                        Some(u.saturating_sub(d))
                    });
            }
        }
        let filling: Vec<String> = self
            .fills
            .lock()
            .expect("cache fills")
            .keys()
            .filter_map(|k| k.split_once('/').map(|(g, _)| g.to_string()))
            .collect();
        let orphan_before = match self.clustered() {
            true => now_ns().saturating_sub(ORPHAN_AGE.as_nanos() as u64),
            false => *PROCESS_START_NS,
        };
        for (g, (_, newest)) in gens {
            if !filling.contains(&g) && newest < orphan_before {
                delete_generation(&self.store, &self.chunks_bucket, &g).await?;
            }
        }
        self.maybe_evict();
        Ok(())
    }

    /// The lease that lets one node of a cluster evict this bucket at a
    /// time: its ETag when this node took it, None when another holds it.
    /// A lease older than `LEASE_TTL` (its node stopped) is taken over.
    async fn take_lease(&self) -> Result<Option<String>, StoreError> {
        for _ in 0..2 {
            if let Some(etag) = self.create_claim(EVICTOR_LEASE).await? {
                return Ok(Some(etag));
            }
            match self
                .store
                .head_object(&self.chunks_bucket, EVICTOR_LEASE, None)
                .await
            {
                Ok(l)
                    if now_ns().saturating_sub(l.last_modified_ns)
                        >= LEASE_TTL.as_nanos() as u64 =>
                {
                    tracing::warn!(bucket = %self.name, "an evictor's lease outlived it; taking it over");
                    let _ = self
                        .store
                        .delete_object_if(&self.chunks_bucket, EVICTOR_LEASE, None, Some(&l.etag))
                        .await;
                }
                Ok(_) => return Ok(None),
                // Released meanwhile: try again.
                Err(StoreError::NoSuchKey { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    async fn release_lease(&self, etag: &str) {
        if let Err(error) = self
            .store
            .delete_object_if(&self.chunks_bucket, EVICTOR_LEASE, None, Some(etag))
            .await
        {
            tracing::warn!(bucket = %self.name, %error, "cannot release the evictor's lease; it lapses");
        }
    }
}

/// The evictor's lease in a cluster (among the claims: never a generation).
const EVICTOR_LEASE: &str = "claims/evictor";
/// How long a lease is held at most (then it is released, and taken again
/// after a fresh count), and when another node takes it over.
const LEASE_HOLD: Duration = Duration::from_secs(20);
const LEASE_TTL: Duration = Duration::from_secs(60);
/// A cluster's counts are renewed at most this often.
const RECOUNT_MIN: Duration = Duration::from_secs(10);
/// Chunks of no entry untouched this long are orphans (cluster).
const ORPHAN_AGE: Duration = Duration::from_secs(3600);

static PROCESS_START_NS: std::sync::LazyLock<u64> = std::sync::LazyLock::new(now_ns);

/// Sets the time before which chunks of no entry are orphans on one node.
pub(super) fn mark_process_start() {
    std::sync::LazyLock::force(&PROCESS_START_NS);
}

/// Evicts until every bucket is under its low watermark and the node under
/// its budget's. In a cluster a bucket is evicted by the node that holds
/// its lease, after a fresh count (so two nodes never evict for the same
/// excess); a bucket another node evicts is left to it.
async fn evict(shared: &Arc<Shared>) {
    let mut leases: HashMap<String, (Arc<CacheBucket>, String, std::time::Instant)> =
        HashMap::new();
    let mut others: std::collections::HashSet<String> = Default::default();
    loop {
        let buckets: Vec<_> = shared
            .live()
            .into_iter()
            .filter(|b| !others.contains(&b.name))
            .collect();
        let budget = shared.budget.load(Ordering::Relaxed);
        let node_over = over(shared.used.load(Ordering::Relaxed), budget, LOW_WATERMARK);
        // A bucket over its own limit first; then, for the node's budget,
        // the oldest victim of any bucket.
        let pick = buckets
            .iter()
            .filter(|b| b.needs_eviction(LOW_WATERMARK))
            .find_map(|b| b.victim().map(|v| (b.clone(), v)))
            .or_else(|| {
                node_over
                    .then(|| {
                        buckets
                            .iter()
                            .filter_map(|b| b.victim().map(|v| (b.clone(), v)))
                            .min_by_key(|(_, (_, r))| (r.uses > 1, r.last_ns))
                    })
                    .flatten()
            });
        let Some((bucket, (key, r))) = pick else {
            break;
        };
        if bucket.clustered() {
            if let Some((b, etag, since)) = leases.get(&bucket.name) {
                if since.elapsed() >= LEASE_HOLD {
                    b.release_lease(etag).await;
                    leases.remove(&bucket.name);
                }
            }
            if !leases.contains_key(&bucket.name) {
                match bucket.take_lease().await {
                    Ok(Some(etag)) => {
                        leases.insert(
                            bucket.name.clone(),
                            (bucket.clone(), etag, std::time::Instant::now()),
                        );
                        // What the other nodes filled and evicted, then pick again.
                        if let Err(error) = bucket.count().await {
                            tracing::warn!(bucket = %bucket.name, %error, "cannot count the cache before evicting");
                            break;
                        }
                    }
                    Ok(None) => {
                        others.insert(bucket.name.clone());
                    }
                    Err(error) => {
                        tracing::warn!(bucket = %bucket.name, %error, "cannot take the evictor's lease now");
                        break;
                    }
                }
                continue;
            }
        }
        if let Err(error) = bucket.evict_object(&key, &r).await {
            tracing::warn!(bucket = %bucket.name, %key, %error, "cannot evict a cached object now");
            break;
        }
    }
    for (b, etag, _) in leases.values() {
        b.release_lease(etag).await;
    }
}
