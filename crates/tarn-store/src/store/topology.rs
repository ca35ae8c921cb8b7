//! Changes of the engine's sets while it runs: a cluster map that gives a
//! set position another drive (a node replaced) swaps a new `Topology` in.
//! Requests under way keep the one they started with; set indexes and
//! positions keep their meaning, so a request that computed its set stays
//! valid, and writes after the swap reach the new drive.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{cluster_slot, ClusterDrive, DriveFormat, Store, Topology};
use crate::error::StoreError;

/// One set position and the drive the map puts there now.
pub struct DriveChange {
    pub set: usize,
    pub position: usize,
    pub drive: ClusterDrive,
}

impl Store {
    /// Gives set positions the drives the cluster map now names there. A
    /// drive of this node is formatted for its place; one that joins a set
    /// holding data is backfilled in full before it serves reads. A drive of
    /// another node that joins takes writes at once and answers this
    /// node's metadata reads once its node serves it and no missed-write
    /// entry names its place. Blocking (drives are probed and formatted).
    pub fn change_drives(&self, changes: Vec<DriveChange>) -> Result<(), StoreError> {
        let old = self.topo();
        let mut slots = old.slots.clone();
        let mut set_aside = 0u64;
        for c in changes {
            let members = old.sets.get(c.set).ok_or_else(|| {
                StoreError::Config(format!(
                    "the map changes set {}, which is not served",
                    c.set
                ))
            })?;
            let &i = members.get(c.position).ok_or_else(|| {
                StoreError::Config(format!(
                    "the map changes position {} of set {}, a set of {}",
                    c.position,
                    c.set,
                    members.len()
                ))
            })?;
            let want = DriveFormat {
                deployment_id: self.deployment_id,
                drive_id: [0u8; 16],
                set_count: old.sets.len() as u32,
                set_drive_count: members.len() as u32,
                set_index: c.set as u32,
                drive_index: c.position as u32,
            };
            let mut seq = self.rebuild_seq.fetch_add(1, Ordering::SeqCst);
            let slot = cluster_slot(c.drive, want, (&mut seq, &mut set_aside))?;
            tracing::warn!(set = c.set, position = c.position, old = %slots[i].name, new = %slot.name, "the cluster map gives this set position another drive");
            slots[i] = Arc::new(slot);
        }
        self.stats
            .index_corruptions
            .fetch_add(set_aside, Ordering::Relaxed);
        *self.topo.write().expect("topology") = Arc::new(Topology {
            slots,
            sets: old.sets.clone(),
        });
        Ok(())
    }
}
