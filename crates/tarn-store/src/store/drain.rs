//! Drain: a pool's objects moved to the active pools, key by key, so that
//! the pool can be retired. Each move holds the key's write lock: it copies
//! every version (data re-coded for the target set, version ids, times,
//! ETags and part boundaries kept) into the key's set in an active pool,
//! commits the record there, and only then removes the key from the
//! draining pool. A move stopped at any point leaves the key readable: the
//! copy is invisible until its record commits, and after that the newest
//! version is the same in both pools, where reads prefer the active one. A
//! second move of the same key finishes the first. Clients see no errors:
//! writers of the key wait for the lock, readers are never blocked.

use std::sync::Arc;

use futures::StreamExt;

use super::put::{BodyReader, WrittenData};
use super::{data_ids_of, inline_keys_of, newest_first, Store};
use crate::drive::ObjectWrite;
use crate::error::StoreError;
use crate::format::{CodecId, Layout, ObjectRecord, PartMeta, Storage, VersionMeta};
use crate::types::ObjectBody;

/// What one pass over a draining pool did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DrainReport {
    /// Keys found in the pool.
    pub keys: u64,
    pub moved: u64,
    /// Bytes of the versions moved.
    pub bytes: u64,
    pub failures: u64,
    /// Multipart uploads in progress still in the pool (their keys cannot
    /// leave it until they complete or are aborted).
    pub uploads: u64,
}

impl Store {
    /// The sets of pool `id`, if it is served.
    pub fn pool_sets(&self, id: u32) -> Option<std::ops::Range<usize>> {
        self.topo()
            .pools
            .iter()
            .find(|p| p.id == id)
            .map(|p| p.sets.clone())
    }

    /// Moves every key of pool `id` to the active pools, `heal_concurrency`
    /// keys at a time; `proceed` is asked before each key (the job's fence:
    /// a job that lost its leadership stops). `progress` sees the report
    /// after each key.
    pub async fn drain_pass(
        self: &Arc<Self>,
        id: u32,
        proceed: &(dyn Fn() -> bool + Sync),
        progress: &(dyn Fn(&DrainReport) + Sync),
    ) -> Result<DrainReport, StoreError> {
        let sets = self
            .pool_sets(id)
            .ok_or_else(|| StoreError::Config(format!("pool {id} is not served")))?;
        let mut report = DrainReport::default();
        let buckets: Vec<String> = self
            .buckets
            .read()
            .expect("buckets")
            .keys()
            .cloned()
            .collect();
        let concurrency = self.cfg.heal_concurrency.max(1);
        // Background priority: at most `heal_rate_bytes` a second.
        let (rate, began) = (self.cfg.heal_rate_bytes, std::time::Instant::now());
        for set in sets {
            for bucket in &buckets {
                let keys = self.set_keys(set, bucket).await?;
                report.keys += keys.len() as u64;
                let b = bucket.as_str();
                let mut moves = futures::stream::iter(keys)
                    .take_while(|_| futures::future::ready(proceed()))
                    .map(|key| async move { (self.move_key(set, b, &key).await, key) })
                    .buffer_unordered(concurrency);
                while let Some((r, key)) = moves.next().await {
                    match r {
                        Ok(bytes) => {
                            if let Some(bytes) = bytes {
                                report.moved += 1;
                                report.bytes += bytes;
                            }
                        }
                        Err(error) => {
                            tracing::warn!(bucket = %b, %key, %error, "moving a key out of a draining pool failed; the next pass tries again");
                            report.failures += 1;
                        }
                    }
                    progress(&report);
                    if rate > 0 {
                        let due =
                            std::time::Duration::from_secs_f64(report.bytes as f64 / rate as f64);
                        if let Some(wait) = due.checked_sub(began.elapsed()) {
                            tokio::time::sleep(wait).await;
                        }
                    }
                }
                report.uploads += self.uploads_in(set, bucket).await?;
                if !proceed() {
                    return Ok(report);
                }
            }
        }
        Ok(report)
    }

    /// Uploads in progress of `bucket` in `set`.
    async fn uploads_in(&self, set: usize, bucket: &str) -> Result<u64, StoreError> {
        let sources: Vec<_> = (0..self.set_size(set))
            .filter_map(|p| self.slot(set, p).db())
            .collect();
        Ok(super::multipart::bucket_uploads(sources, bucket)
            .await?
            .len() as u64)
    }

    /// Moves bucket/key out of set `from` (of a draining pool) into its set
    /// in an active pool: the bytes of the versions moved, or None when the
    /// set holds no version of it (moved already, or deleted).
    pub async fn move_key(
        self: &Arc<Self>,
        from: usize,
        bucket: &str,
        key: &str,
    ) -> Result<Option<u64>, StoreError> {
        let _g = self.lock_write(bucket, key).await?;
        let (src, _) = self.resolved(from, bucket, key).await?;
        if src.versions.is_empty() {
            return Ok(None);
        }
        let (to, dst) = self.move_target(bucket, key).await?;
        let mut written = Vec::new();
        let mut merged = dst;
        let mut inline_put = Vec::new();
        let mut bytes = 0u64;
        for v in &src.versions {
            let id = (v.version_id, v.mod_time_ns);
            if merged
                .versions
                .iter()
                .any(|d| (d.version_id, d.mod_time_ns) == id)
            {
                continue; // copied by a move that stopped before removing it here
            }
            match self
                .copy_version(v, (from, to), (bucket, key), &mut written)
                .await
            {
                Ok((copy, inline)) => {
                    inline_put.extend(inline.map(|d| (id.0, id.1, d)));
                    bytes += v.size;
                    merged.versions.push(copy);
                }
                Err(e) => {
                    let ids = written.iter().map(|w: &WrittenData| w.data_id).collect();
                    self.remove_data(to, ids).await;
                    return Err(e);
                }
            }
        }
        // Two null versions (the key was in both pools): the older goes.
        let dropped = newest_first(&mut merged.versions);
        inline_put.retain(|(id, t, _)| {
            !dropped
                .iter()
                .any(|d| (d.version_id, d.mod_time_ns) == (*id, *t))
        });
        let w = ObjectWrite {
            record: Some(merged),
            inline_put,
            inline_delete: inline_keys_of(&dropped),
            ..Default::default()
        };
        if let Err(e) = self.write_object_everywhere(to, bucket, key, w).await {
            let ids = written.iter().map(|w| w.data_id).collect();
            self.remove_data(to, ids).await;
            return Err(e);
        }
        drop(written);
        self.retire_data(to, data_ids_of(&dropped)).await;
        self.remove_stale(from, bucket, key, src).await;
        Ok(Some(bytes))
    }

    /// Copies version `v` of bucket/key from set `sets.0` to set `sets.1`:
    /// the version as it is to be recorded there, and its inline bytes. The
    /// data written is added to `written` (kept from the orphan sweep until
    /// the caller commits, removed by the caller if it does not).
    pub(super) async fn copy_version(
        self: &Arc<Self>,
        v: &VersionMeta,
        (from, to): (usize, usize),
        (bucket, key): (&str, &str),
        written: &mut Vec<WrittenData>,
    ) -> Result<(VersionMeta, Option<Vec<u8>>), StoreError> {
        let mut copy = v.clone();
        let parts = match &v.storage {
            Storage::Inline { .. } if v.delete_marker => return Ok((copy, None)),
            Storage::Inline { crc32c } => {
                let d = self.read_inline(from, bucket, key, v, *crc32c).await?;
                return Ok((copy, Some(d)));
            }
            Storage::Parts(parts) => parts,
        };
        let layout = self.layout_in(to, &v.layout, bucket, key);
        let mut moved = Vec::with_capacity(parts.len());
        let mut start = 0u64;
        for p in parts {
            let pin = self.pin_data(from, v);
            let end = start + p.size;
            let stream = self
                .stream_version(from, bucket, key, v.clone(), start, end, pin)
                .await?;
            let body = ObjectBody {
                stream: Box::pin(stream),
                declared_len: Some(p.size),
                finish: None,
            };
            let mut reader = BodyReader::new(body, false, p.size);
            let w = self.write_data(to, &layout, &mut reader).await?;
            moved.push(PartMeta {
                data_id: w.data_id,
                ..p.clone()
            });
            written.push(w);
            start = end;
        }
        copy.layout = layout;
        copy.storage = Storage::Parts(moved);
        Ok((copy, None))
    }

    /// Where a key of a draining pool goes, and its record there: its set in
    /// an active pool that holds it already, or for a key no active pool
    /// holds, one by free space.
    async fn move_target(
        &self,
        bucket: &str,
        key: &str,
    ) -> Result<(usize, ObjectRecord), StoreError> {
        let topo = self.topo();
        let h = self.key_hash(bucket, key);
        let mut read = Vec::new();
        for p in topo.pools.iter().filter(|p| p.takes_keys()) {
            let set = Self::set_in(p, h);
            let (rec, _) = self.resolved(set, bucket, key).await?;
            if !rec.versions.is_empty() {
                return Ok((set, rec));
            }
            read.push((set, rec));
        }
        // Every active pool's set was read above and holds nothing (but
        // maybe a deleted key's tombstone, whose stamp the write must pass).
        let set = self.new_key_set(&topo, h);
        if !topo.pool_of(set).takes_keys() {
            return Err(StoreError::Config(
                "no active pool to move objects to: every pool drains".into(),
            ));
        }
        let rec = read
            .into_iter()
            .find(|(s, _)| *s == set)
            .map(|(_, r)| r)
            .unwrap_or_default();
        Ok((set, rec))
    }

    /// A version's layout re-made for set `to`: the same durability (the
    /// target pool's k+m for erasure-coded data, the same copy count for
    /// replicated data), shards rotated by the key as for a new version.
    fn layout_in(&self, to: usize, old: &Layout, bucket: &str, key: &str) -> Layout {
        let n = self.set_size(to);
        let (k, m) = if old.codec == CodecId::Replicate {
            (1, (old.parity_shards as usize).min(n - 1))
        } else {
            let t = self.topo();
            let p = t.pool_of(to);
            (p.data_shards, p.parity_shards)
        };
        self.layout_of(to, (k, m), old.stripe_size_bytes, bucket, key)
    }
}
