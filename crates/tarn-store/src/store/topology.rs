//! Changes of the engine's sets while it runs: a cluster map that gives a
//! set position another drive (a node replaced), adds a pool (expansion)
//! or drains one swaps a new `Topology` in.
//! Requests under way keep the one they started with; set indexes and
//! positions keep their meaning, so a request that computed its set stays
//! valid, and writes after the swap reach the new drive.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{cluster_slot, pool_slots, ClusterDrive, DriveFormat, PoolLayout, Store, Topology};
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
            let pool = old.pool_of(c.set);
            let want = DriveFormat {
                deployment_id: self.deployment_id,
                drive_id: [0u8; 16],
                set_count: pool.sets.len() as u32,
                set_drive_count: members.len() as u32,
                set_index: (c.set - pool.sets.start) as u32,
                drive_index: c.position as u32,
            };
            let mut seq = self.rebuild_seq.fetch_add(1, Ordering::SeqCst);
            let slot = cluster_slot(c.drive, want, c.set, (&mut seq, &mut set_aside))?;
            tracing::warn!(set = c.set, position = c.position, old = %slots[i].name, new = %slot.name, "the cluster map gives this set position another drive");
            slots[i] = Arc::new(slot);
        }
        self.stats
            .index_corruptions
            .fetch_add(set_aside, Ordering::Relaxed);
        *self.topo.write().expect("topology") = Arc::new(Topology {
            slots,
            sets: old.sets.clone(),
            pools: old.pools.clone(),
        });
        Ok(())
    }

    /// Serves a pool the cluster map added (expansion): its sets follow the
    /// others', so every set index keeps its meaning. Its drives are new
    /// (formatted for their place, nothing to fill them with). Blocking.
    pub fn add_pool(&self, pool: PoolLayout) -> Result<(), StoreError> {
        let old = self.topo();
        if old.pools.iter().any(|p| p.id == pool.id) {
            return Err(StoreError::Config(format!(
                "pool {} is served already",
                pool.id
            )));
        }
        let mut seq = self.rebuild_seq.fetch_add(1, Ordering::SeqCst);
        let mut set_aside = 0u64;
        let (new_slots, members, topo) = pool_slots(
            &self.cfg,
            self.deployment_id,
            pool,
            (old.sets.len(), old.slots.len()),
            (&mut seq, &mut set_aside),
        )?;
        tracing::warn!(
            pool = topo.id,
            sets = members.len(),
            data = topo.data_shards,
            parity = topo.parity_shards,
            "serving a pool the cluster map added"
        );
        let mut slots = old.slots.clone();
        slots.extend(new_slots.into_iter().map(Arc::new));
        let mut sets = old.sets.clone();
        sets.extend(members);
        let mut pools = old.pools.clone();
        pools.push(topo);
        *self.topo.write().expect("topology") = Arc::new(Topology { slots, sets, pools });
        Ok(())
    }

    /// Marks pools draining or retired as the cluster map says: a draining
    /// pool serves its objects and takes no new ones; a retired one holds
    /// nothing and is no longer looked in. Returns the pools it retired.
    pub fn set_pool_states(&self, draining: &[u32], retired: &[u32]) -> Vec<u32> {
        let old = self.topo();
        let mut pools = old.pools.clone();
        let mut changed = false;
        let mut newly = Vec::new();
        for p in &mut pools {
            let (d, r) = (draining.contains(&p.id), retired.contains(&p.id));
            changed |= (p.draining, p.retired) != (d, r);
            if r && !p.retired {
                newly.push(p.id);
            }
            (p.draining, p.retired) = (d, r);
        }
        if changed {
            *self.topo.write().expect("topology") = Arc::new(Topology {
                slots: old.slots.clone(),
                sets: old.sets.clone(),
                pools,
            });
        }
        newly
    }
}
