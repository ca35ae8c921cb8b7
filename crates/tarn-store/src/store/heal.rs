//! Healing: rewrite metadata a drive lacks or holds differently, rebuild shard
//! files that are missing, truncated or corrupt, and restore inline copies.
//! Runs on demand (`heal_all`), from the queue fed by reads that hit damage, and
//! from the background scanner.

use std::sync::atomic::Ordering;
use std::time::Duration;

use std::sync::Arc;

use tarn_io::file::run_blocking;

use super::get::PartReader;
use super::Store;
use crate::checksum::crc32c;
use crate::codec::{codec_for, StripeGeometry};
use crate::drive::ObjectWrite;
use crate::drive_io::ShardPlace;
use crate::error::StoreError;
use crate::format::{new_id, Layout, PartMeta, Storage};
use crate::shard::shard_file_len;
use crate::types::{HealProgress, HealReport};

/// Age before an unreferenced shard file counts as an orphan. Shards are renamed
/// into place immediately before their metadata commits, so anything this old
/// and unreferenced was left by a write that never committed.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(3600);

impl Store {
    /// Heals every bucket and object on every set. Drives whose index is
    /// rebuilding get every record, inline copy and upload in progress; when
    /// this pass reached all of them, they serve metadata reads again.
    pub async fn heal_all(&self) -> HealReport {
        self.heal_with(None, &HealProgress::default())
            .await
            .unwrap_or_default()
    }

    /// Heals one bucket (`Some`), or everything as `heal_all`, telling
    /// `progress` how far it has come: first the objects to heal are
    /// counted, then healed. A pass over one bucket neither ends a drive's
    /// index rebuild (that needs every bucket) nor sweeps orphans.
    pub async fn heal_with(
        &self,
        only: Option<&str>,
        progress: &HealProgress,
    ) -> Result<HealReport, StoreError> {
        if let Some(b) = only {
            self.bucket_record(b)?;
        }
        let mut report = HealReport::default();
        // Rebuilds this pass covers: those begun before it started.
        let rebuilding: Vec<(usize, u64)> = self
            .topo()
            .slots
            .iter()
            .enumerate()
            .filter(|(_, d)| d.online())
            .filter_map(|(i, d)| d.rebuilding_full().map(|n| (i, n)))
            .collect();
        // Whether every record reached every drive in use.
        let mut complete = true;
        let buckets: Vec<String> = self
            .buckets
            .read()
            .expect("buckets lock")
            .keys()
            .filter(|b| only.is_none_or(|o| o == b.as_str()))
            .cloned()
            .collect();
        let drives: Vec<_> = self
            .topo()
            .slots
            .iter()
            .filter_map(|d| d.writer())
            .collect();
        complete &= self.heal_bucket_records(drives, &mut report).await;
        // Counted first, so that progress has a total (listing keys is
        // cheap next to healing them).
        for bucket in &buckets {
            for set in self.live_sets() {
                if let Ok(keys) = self.set_keys(set, bucket).await {
                    progress
                        .objects_total
                        .fetch_add(keys.len() as u64, Ordering::Relaxed);
                }
            }
        }
        progress
            .phase
            .store(HealProgress::HEALING, Ordering::Relaxed);
        for bucket in &buckets {
            for set in self.live_sets() {
                let keys = match self.set_keys(set, bucket).await {
                    Ok(k) => k,
                    Err(error) => {
                        tracing::error!(%bucket, %error, "listing keys to heal failed");
                        report.failures += 1;
                        complete = false;
                        continue;
                    }
                };
                for key in keys {
                    match self.heal_object_on(Some(set), bucket, &key, None).await {
                        Ok(r) => {
                            report.objects_scanned += 1;
                            report.shards_rebuilt += r.shards_rebuilt;
                            report.metadata_rewritten += r.metadata_rewritten;
                            report.bytes_scanned += r.bytes_scanned;
                            // Drives the object could not be rewritten on.
                            report.failures += r.failures;
                            progress.failures.fetch_add(r.failures, Ordering::Relaxed);
                            progress
                                .bytes_scanned
                                .fetch_add(r.bytes_scanned, Ordering::Relaxed);
                            complete &= r.metadata_failures == 0;
                            if r.shards_rebuilt + r.metadata_rewritten > 0 {
                                report.objects_healed += 1;
                                progress.objects_healed.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(error) => {
                            tracing::error!(%bucket, %key, %error, "heal failed");
                            report.failures += 1;
                            progress.failures.fetch_add(1, Ordering::Relaxed);
                            // Shards that cannot be rebuilt come after the
                            // metadata was written; anything else did not.
                            complete &= matches!(error, StoreError::Unreadable { .. });
                        }
                    }
                    progress.objects_done.fetch_add(1, Ordering::Relaxed);
                }
                // Multipart uploads in progress, onto rebuilding drives.
                let targets = self.writers(
                    (0..self.set_size(set))
                        .map(|p| self.slot(set, p))
                        .filter(|s| s.rebuilding_full().is_some()),
                );
                if !targets.is_empty() {
                    if let Err(error) = self.heal_uploads(set, bucket, &targets).await {
                        tracing::error!(%bucket, %error, "copying uploads to a rebuilding drive failed");
                        report.failures += 1;
                        complete = false;
                    }
                }
            }
        }
        if only.is_some() {
            progress.phase.store(HealProgress::DONE, Ordering::Relaxed);
            return Ok(report);
        }
        if complete {
            for (i, n) in rebuilding {
                self.finish_rebuild(i, n);
            }
        }
        progress
            .phase
            .store(HealProgress::SWEEPING, Ordering::Relaxed);
        match self.sweep_orphans(ORPHAN_GRACE).await {
            Ok(n) => report.orphans_removed = n,
            Err(error) => {
                tracing::error!(%error, "orphan sweep failed");
                report.failures += 1;
                progress.failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        progress.phase.store(HealProgress::DONE, Ordering::Relaxed);
        Ok(report)
    }

    /// Every key of a bucket on a set, as the set's drives in use hold
    /// them (rebuilding ones included), in order.
    pub(crate) async fn set_keys(
        &self,
        set: usize,
        bucket: &str,
    ) -> Result<std::collections::BTreeSet<String>, StoreError> {
        let drives: Vec<_> = (0..self.set_size(set))
            .filter_map(|p| self.slot(set, p).writer())
            .collect();
        let mut all = std::collections::BTreeSet::new();
        for d in drives {
            all.extend(d.all_object_keys(bucket.to_string()).await?);
        }
        Ok(all)
    }

    /// Bucket records onto every drive given that lacks them or holds
    /// another; whether every drive took them.
    pub(crate) async fn heal_bucket_records(
        &self,
        drives: Vec<Arc<dyn crate::drive_io::Drive>>,
        report: &mut HealReport,
    ) -> bool {
        let mut complete = true;
        let buckets: Vec<(String, crate::format::BucketRecord)> = self
            .buckets
            .read()
            .expect("buckets lock")
            .iter()
            .map(|(n, r)| (n.clone(), r.clone()))
            .collect();
        for d in drives {
            let healed = async {
                let have = d.buckets().await?;
                let mut n = 0;
                for (name, rec) in &buckets {
                    if !have.iter().any(|(h, r)| h == name && r == rec) {
                        d.put_bucket(name.clone(), rec.clone()).await?;
                        n += 1;
                    }
                }
                Ok::<_, StoreError>(n)
            }
            .await;
            match healed {
                Ok(n) => report.buckets_healed += n,
                Err(error) => {
                    tracing::error!(%error, "healing bucket records failed");
                    report.failures += 1;
                    complete = false;
                }
            }
        }
        complete
    }

    /// Removes shard files that no object version or upload part refers to and
    /// that are older than `grace`: leftovers of writes interrupted between
    /// renaming their shards into place and committing metadata. The grace
    /// period keeps the sweep away from writes that are committing right now.
    pub async fn sweep_orphans(&self, grace: Duration) -> Result<u64, StoreError> {
        let mut removed = 0;
        for set in self.live_sets() {
            removed += self.sweep_set(set, grace).await?;
        }
        Ok(removed)
    }

    /// Removes the shard files left on this node's drives of retired pools:
    /// a drained pool holds no record, so whatever a move stopped between
    /// removing a record and its files (a leader killed there) is nobody's.
    /// Nothing is written to a retired pool, so there is no grace period; a
    /// file some record of the set still names is kept.
    pub async fn sweep_retired(&self) -> Result<u64, StoreError> {
        let topo = self.topo();
        let mut removed = 0;
        for pool in topo.pools.iter().filter(|p| p.retired) {
            for set in pool.sets.clone() {
                let local = topo.sets[set].iter().any(|&i| !topo.slots[i].is_remote());
                if local {
                    removed += self.sweep_set(set, Duration::ZERO).await?;
                }
            }
        }
        if removed > 0 {
            tracing::info!(
                files = removed,
                "removed the shard files left on drives of retired pools"
            );
        }
        Ok(removed)
    }

    /// The orphan sweep of one set's drives on this node.
    async fn sweep_set(&self, set: usize, grace: Duration) -> Result<u64, StoreError> {
        let members: Vec<_> = (0..self.set_size(set))
            .map(|p| (self.slot(set, p).db(), self.slot(set, p).paths.clone()))
            .collect();
        // A drive alone in its set whose index was salvaged: the files of
        // the records it lost are nobody's, and kept for the operator
        // until the set-aside index is removed.
        if members.len() == 1
            && !self.slot(set, 0).is_remote()
            && members[0]
                .1
                .root
                .join(crate::drive::CORRUPT_INDEX_DIR)
                .exists()
        {
            tracing::warn!(drive = %members[0].1.root.display(), "orphan sweep skipped: the drive's index was salvaged; remove .tarn/meta.corrupt to sweep");
            return Ok(0);
        }
        // Union of references across the set: a file is an orphan only if
        // no drive of its set knows it. A drive whose metadata cannot be
        // read fully stops the sweep of this set.
        let mut referenced = std::collections::HashSet::new();
        for (d, _) in &members {
            let Some(d) = d else { continue };
            referenced.extend(d.referenced_data_ids().await?);
        }
        // This node sweeps its own drives (other nodes sweep theirs,
        // with the same union).
        let dirs: Vec<std::path::PathBuf> = members
            .iter()
            .filter_map(|(d, _)| Some(d.as_ref()?.as_local()?.paths.data_dir()))
            .collect();
        let inflight = self.inflight_data.clone();
        let removed = run_blocking(move || {
            let now = std::time::SystemTime::now();
            let mut n = 0u64;
            for dir in &dirs {
                for sub in std::fs::read_dir(dir)?.flatten() {
                    let Ok(files) = std::fs::read_dir(sub.path()) else { continue };
                    for f in files.flatten() {
                        let name = f.file_name();
                        let Some(id) = name.to_str().and_then(crate::format::id_from_hex) else { continue };
                        // A write in progress is not an orphan yet, however
                        // long it has been running.
                        if referenced.contains(&id) || inflight.lock().expect("inflight lock").contains(&id) {
                            continue;
                        }
                        let old = f.metadata().and_then(|m| m.modified()).ok().and_then(|t| now.duration_since(t).ok()).is_some_and(|age| age >= grace);
                        if old && std::fs::remove_file(f.path()).is_ok() {
                            tracing::info!(path = %f.path().display(), "removed orphaned shard file");
                            n += 1;
                        }
                    }
                }
            }
            Ok(n)
        })
        .await?;
        Ok(removed)
    }

    /// Heals one object: its metadata on every online drive of its set, the
    /// inline copies, and every shard file of every version.
    pub async fn heal_object(&self, bucket: &str, key: &str) -> Result<HealReport, StoreError> {
        self.heal_object_on(None, bucket, key, None).await
    }

    /// `heal_object`, with shard files verified (and rebuilt) only on the
    /// set positions `only` names when it is given: a backfill fills the
    /// drives that joined and reads only the shards it rebuilds from.
    /// Metadata and inline copies are healed on every drive either way.
    /// `set`: heal the key in that set only (a backfill or replay of one
    /// set); None: in each of its sets (one per pool).
    pub(crate) async fn heal_object_on(
        &self,
        set: Option<usize>,
        bucket: &str,
        key: &str,
        only: Option<&[usize]>,
    ) -> Result<HealReport, StoreError> {
        let _g = self.lock_write(bucket, key).await?;
        let sets = match set {
            Some(s) => vec![s],
            None => self.key_sets(bucket, key),
        };
        let mut report = HealReport::default();
        for set in sets {
            self.heal_in_set(set, bucket, key, only, &mut report)
                .await?;
        }
        self.stats
            .shards_rebuilt
            .fetch_add(report.shards_rebuilt, Ordering::Relaxed);
        Ok(report)
    }

    /// Heals bucket/key in one set, under the key's lock.
    async fn heal_in_set(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        only: Option<&[usize]>,
        report: &mut HealReport,
    ) -> Result<(), StoreError> {
        let records = self.read_records(set, bucket, key).await;
        // A record that does not decode says nothing of the key: its drive
        // counts as one that did not answer (and gets the merged record).
        let merged = super::resolve(&records, self.set_size(set)).map_err(|e| match e {
            StoreError::QuorumLost {
                needed, available, ..
            } => StoreError::QuorumLost {
                what: "heal",
                needed,
                available,
            },
            e => e,
        })?;

        // Inline data: a verified copy to give drives that lack one.
        let mut inline_copies = Vec::new();
        for v in &merged.versions {
            if let Storage::Inline { crc32c: want } = v.storage {
                if v.delete_marker {
                    continue;
                }
                let mut good = None;
                for pos in 0..self.set_size(set) {
                    let Some(db) = self.slot(set, pos).db() else {
                        continue;
                    };
                    if let Ok(Some(d)) = db
                        .inline_data(
                            bucket.to_string(),
                            key.to_string(),
                            v.version_id,
                            v.mod_time_ns,
                        )
                        .await
                    {
                        if crc32c(&d) == want {
                            good = Some(d);
                            break;
                        }
                    }
                }
                if let Some(d) = good {
                    inline_copies.push((v.version_id, v.mod_time_ns, d, want));
                }
            }
        }

        for (pos, current) in records.iter().enumerate() {
            let slot = self.slot(set, pos);
            let Some(db) = slot.writer() else {
                continue;
            };
            // A drive behind answers no reads, but heal compares what it
            // holds: rewriting a record it has would make every pass over
            // it look like a repair.
            let behind;
            let current = if current.is_err() && slot.rebuilding().is_some() {
                behind = db.object(bucket.to_string(), key.to_string()).await;
                &behind
            } else {
                current
            };
            let meta_ok = matches!(current, Ok(Some(r)) if *r == merged)
                || (matches!(current, Ok(None)) && merged.versions.is_empty());
            // Which inline copies this drive lacks or holds corrupt.
            let mut missing_inline = Vec::new();
            for (vid, mt, data, want) in &inline_copies {
                let have = db
                    .inline_data(bucket.to_string(), key.to_string(), *vid, *mt)
                    .await;
                let ok = matches!(&have, Ok(Some(d)) if crc32c(d) == *want);
                if !ok {
                    missing_inline.push((*vid, *mt, data.clone()));
                }
            }
            if meta_ok && missing_inline.is_empty() {
                continue;
            }
            let w = ObjectWrite {
                record: Some(merged.clone()),
                inline_put: missing_inline,
                ..Default::default()
            };
            match db
                .write_object(bucket.to_string(), key.to_string(), Arc::new(w))
                .await
            {
                Ok(()) => report.metadata_rewritten += 1,
                // A newer record reached the drive after the read (or the
                // drive did not answer it): the next heal settles it.
                Err(error @ (StoreError::Superseded { .. } | StoreError::Late { .. })) => {
                    tracing::warn!(%bucket, %key, %error, "metadata heal did not reach a drive; healed again later");
                    report.failures += 1;
                    report.metadata_failures += 1;
                }
                Err(error) => {
                    tracing::error!(%bucket, %key, %error, "rewriting metadata failed");
                    self.index_write_failed(&self.slot(set, pos), "metadata heal", &error);
                    report.failures += 1;
                    report.metadata_failures += 1;
                }
            }
        }

        for v in &merged.versions {
            report.bytes_scanned += v.size;
            let Storage::Parts(parts) = &v.storage else {
                continue;
            };
            for part in parts {
                let (rebuilt, skipped) = self.heal_part(set, &v.layout, part, only).await?;
                report.shards_rebuilt += rebuilt;
                report.failures += skipped;
            }
        }
        Ok(())
    }

    /// Verifies every shard file of a part and rebuilds the bad ones: how
    /// many were rebuilt, and how many could not be for lack of room (a drive
    /// below its reserve takes no rebuilt shards either).
    async fn heal_part(
        &self,
        set: usize,
        layout: &Layout,
        part: &PartMeta,
        only: Option<&[usize]>,
    ) -> Result<(u64, u64), StoreError> {
        self.check_layout(set, layout)?;
        let g = StripeGeometry::new(part.size, layout.stripe_size_bytes, layout.data_shards);
        let mut bad = Vec::new();
        for (shard, &pos) in layout.distribution.iter().enumerate() {
            if only.is_some_and(|only| !only.contains(&(pos as usize))) {
                continue;
            }
            let Some(drive) = self.slot(set, pos as usize).writer() else {
                continue;
            };
            let ok = match drive.open_shard(part.data_id, g).await {
                Ok(mut r) => r.verify_all(shard as u8).await.is_ok(),
                Err(_) => false,
            };
            if !ok {
                bad.push(shard);
            }
        }
        if bad.is_empty() {
            return Ok((0, 0));
        }
        let k = layout.data_shards as usize;
        let n = layout.shard_count();
        let survivors = n - bad.len();
        let shard_bytes = shard_file_len(&g);
        let before = bad.len();
        bad.retain(|&shard| {
            let slot = self.slot(set, layout.distribution[shard] as usize);
            let room = slot.has_room(shard_bytes, self.cfg.drive_reserve_bytes);
            if !room {
                tracing::warn!(drive = %slot.name, part = part.number, shard, "shard not rebuilt: the drive is below its free-space reserve");
            }
            room
        });
        let skipped = (before - bad.len()) as u64;
        if bad.is_empty() {
            return Ok((0, skipped));
        }
        if survivors < k {
            return Err(StoreError::Unreadable {
                bucket: String::new(),
                key: String::new(),
                reason: format!(
                    "part {}: only {} of {} needed shards survive",
                    part.number, survivors, k
                ),
            });
        }
        // Read stripes from good shards, rebuild the bad ones into fresh files.
        let tmp_id = new_id();
        let mut writers = Vec::new();
        for &shard in &bad {
            let slot = self.slot(set, layout.distribution[shard] as usize);
            let drive = slot.writer().ok_or_else(|| StoreError::Drive {
                drive: slot.name.clone(),
                reason: "went offline during heal".into(),
            })?;
            let w = drive
                .create_shard(tmp_id, shard as u8, ShardPlace::Tmp)
                .await?;
            writers.push((shard, drive, w));
        }
        let count = g.stripe_count();
        if count > 0 {
            let mut reader = PartReader::open(self, set, layout, part, 0, count - 1).await?;
            let codec = codec_for(layout.codec, k, layout.parity_shards as usize);
            // Rebuilt blocks are reconstructed straight into the aligned buffers
            // the writes take, reused for every stripe.
            let mut outs: Vec<tarn_io::AlignedBuf> = bad
                .iter()
                .map(|_| tarn_io::AlignedBuf::with_capacity(g.shard_len(0) as usize))
                .collect();
            for j in 0..count {
                let sl = g.shard_len(j) as usize;
                for o in outs.iter_mut() {
                    o.set_len(sl);
                }
                {
                    let data = reader.read_stripe(self, j).await?;
                    let present: Vec<Option<&[u8]>> = (0..n)
                        .map(|i| if i < k { Some(data[i]) } else { None })
                        .collect();
                    let mut wanted: Vec<(usize, &mut [u8])> = bad
                        .iter()
                        .copied()
                        .zip(outs.iter_mut().map(|o| &mut o[..]))
                        .collect();
                    codec
                        .reconstruct(&present, &mut wanted)
                        .map_err(|e| StoreError::from(std::io::Error::other(e.to_string())))?;
                }
                for ((_, _, w), out) in writers.iter_mut().zip(outs.iter_mut()) {
                    let buf = std::mem::replace(out, tarn_io::AlignedBuf::with_capacity(0));
                    let (res, buf) = w.write_block(buf).await;
                    *out = buf;
                    res?;
                }
            }
        }
        let mut rebuilt = 0;
        for (shard, drive, w) in writers {
            w.finish().await?;
            drive.commit_shard(tmp_id, part.data_id).await?;
            tracing::info!(drive = %drive.name(), part = part.number, shard, "shard rebuilt");
            self.slot(set, layout.distribution[shard] as usize)
                .consumed(shard_bytes);
            rebuilt += 1;
        }
        Ok((rebuilt, skipped))
    }
}
