//! Layouts for readers on this node's host (short-circuit reads): where an
//! object version's data shards are, as read-only files of this node's
//! drives, with the version pinned so that no writer removes them while the
//! reader holds the layout.
//!
//! The front (`tarn::local_read`) authenticates and authorizes the caller
//! before asking; this module only finds and opens. Shard files are never
//! changed in place (healing writes a new file and renames it over), so a
//! descriptor reads the bytes of the version it was opened for or nothing.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use super::{validate_key, PinGuard, Store};
use crate::error::StoreError;
use crate::format::Storage;
use crate::types::ObjectInfo;

/// One part of the version and this node's files of its data shards.
pub struct LocalPart {
    /// Object offset of the part's first byte.
    pub offset: u64,
    pub size: u64,
    /// Data shard `i` (`0..k`): its file on a drive of this node, opened
    /// read-only, or None (another node's drive, or a drive out of use, or
    /// the file missing there).
    pub shards: Vec<Option<File>>,
}

/// What a local reader may read of a version, and the pin that keeps it.
pub struct LocalLayout {
    pub info: ObjectInfo,
    pub data_shards: u8,
    pub parity_shards: u8,
    pub stripe_size: u32,
    /// Index of the first part in `parts` among the version's parts.
    pub first_part: u32,
    pub part_count: u32,
    /// The parts that overlap the range asked, at most as many as asked.
    pub parts: Vec<LocalPart>,
    /// The version's data is not removed while this lives.
    pub pin: LocalPin,
}

/// A reader's pin on a version's data (here, and on the drives of the
/// other nodes of its set): released when dropped.
pub struct LocalPin(#[allow(dead_code)] PinGuard);

/// The answer for a version that has no shard files a local reader could
/// read: why, in words (it is read over HTTP instead).
pub enum LocalRead {
    Layout(LocalLayout),
    Elsewhere {
        info: ObjectInfo,
        reason: &'static str,
    },
}

impl Store {
    /// The layout of the version `version` (or the latest) of `bucket/key`
    /// for a reader of bytes `[start, end)` on this host: the overlapping
    /// parts (as many as hold at most `max_files` of this node's files, and
    /// at least one), each with this node's files of its data shards. Errors as a GET's (no such key, a delete marker, ...).
    pub async fn local_layout(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        (start, end): (u64, u64),
        max_files: usize,
    ) -> Result<LocalRead, StoreError> {
        self.bucket_record(bucket)?;
        validate_key(key)?;
        let mut guard = self.lock_read(bucket, key).await?;
        let loc = self.locate(bucket, key).await?;
        if loc.diverged {
            self.queue_heal(bucket, key);
        }
        let set = loc.set;
        let (v, latest) = self.select_version(&loc.rec, bucket, key, version)?;
        if v.delete_marker {
            return Err(StoreError::MethodNotAllowed);
        }
        let info = self.info_from(bucket, key, v, latest);
        let elsewhere = |reason| {
            Ok(LocalRead::Elsewhere {
                info: info.clone(),
                reason,
            })
        };
        if v.seal.is_some() {
            return elsewhere("the version is encrypted");
        }
        let Storage::Parts(parts) = &v.storage else {
            return elsewhere("the version is kept inline in the metadata");
        };
        self.check_layout(set, &v.layout)?;
        let k = v.layout.data_shards as usize;
        // This node's drives of the set, by the data shard they hold.
        let topo = self.topo();
        let local: Vec<Option<crate::drive::DrivePaths>> = (0..k)
            .map(|i| {
                let slot = &topo.slots[topo.sets[set][v.layout.distribution[i] as usize]];
                (!slot.is_remote() && slot.online() && slot.rebuilding().is_none())
                    .then(|| slot.paths.clone())
            })
            .collect();
        if local.iter().all(Option::is_none) {
            return elsewhere("no data shard of the version is on a drive of this node");
        }
        let here = local.iter().filter(|d| d.is_some()).count();
        let max_parts = (max_files / here).max(1);
        // Which of the version's parts the range touches.
        let mut wanted = Vec::new();
        let mut first_part = None;
        let mut offset = 0u64;
        for (index, p) in parts.iter().enumerate() {
            let part_end = offset + p.size;
            let touches = (part_end > start && offset < end) || (start == end && offset == start);
            if touches && wanted.len() < max_parts {
                first_part.get_or_insert(index as u32);
                wanted.push((offset, p.size, p.data_id));
            }
            offset = part_end;
        }
        let mut pin = self.pin_data(set, v);
        pin.lease = guard.pin(self, set, pin.ids.clone()).await;
        drop(guard);
        let paths: Vec<Vec<Option<PathBuf>>> = wanted
            .iter()
            .map(|(_, _, id)| {
                local
                    .iter()
                    .map(|d| d.as_ref().map(|d| d.shard(id)))
                    .collect()
            })
            .collect();
        // Opening is a metadata lookup on the drive: off the core.
        let files = tarn_io::file::run_blocking(move || {
            Ok(paths
                .into_iter()
                .map(|part| {
                    part.into_iter()
                        .map(|p| p.and_then(|p| File::open(p).ok()))
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>())
        })
        .await?;
        Ok(LocalRead::Layout(LocalLayout {
            data_shards: v.layout.data_shards,
            parity_shards: v.layout.parity_shards,
            stripe_size: v.layout.stripe_size_bytes,
            first_part: first_part.unwrap_or(0),
            part_count: parts.len() as u32,
            parts: wanted
                .into_iter()
                .zip(files)
                .map(|((offset, size, _), shards)| LocalPart {
                    offset,
                    size,
                    shards,
                })
                .collect(),
            info,
            pin: LocalPin(pin),
        }))
    }
}
