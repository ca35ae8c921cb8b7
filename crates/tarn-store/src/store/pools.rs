//! Pools: where a key lives when the engine serves several (expansion).
//!
//! A key has one set in each pool, chosen by the same hash in all of them,
//! and its versions live in one of those sets. Its lock is always taken on
//! its set in the first pool, whichever pool holds it, so writers through
//! any node exclude each other. A read resolves the record in every pool
//! (concurrently) and serves the pool holding the newest version. A new key
//! goes to an active pool chosen by free space; a key that exists keeps its
//! pool. With one pool nothing of this costs anything: the key's set is
//! computed and read as before.

use super::{PoolTopo, Store, Topology, NULL_VERSION};
use crate::error::StoreError;
use crate::format::ObjectRecord;

/// Where bucket/key lives, as `Store::locate` found it.
pub(crate) struct Located {
    /// The set holding its newest version; without one, its set in the
    /// first pool.
    pub set: usize,
    pub rec: ObjectRecord,
    /// Some drive of that set disagrees (a heal is due).
    pub diverged: bool,
    /// Other sets holding a record of it too (a move between pools that
    /// stopped halfway, or two first writes that raced): older versions.
    pub others: Vec<(usize, ObjectRecord)>,
    /// The stamp of the key's record in every set read (a tombstone's in
    /// a set that holds no version), for a write into any of them.
    pub stamps: Vec<(usize, u64)>,
}

impl Located {
    /// The stamp of the key's record in `set` as read (0: not read).
    pub fn stamp_in(&self, set: usize) -> u64 {
        self.stamps
            .iter()
            .find(|(s, _)| *s == set)
            .map_or(0, |(_, t)| *t)
    }
}

/// The modification time of a record's newest version.
pub(crate) fn newest(rec: &ObjectRecord) -> Option<u64> {
    rec.versions.iter().map(|v| v.mod_time_ns).max()
}

impl Store {
    pub(crate) fn key_hash(&self, bucket: &str, key: &str) -> u64 {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.hash_seed ^ 0x5e7);
        h.update(bucket.as_bytes());
        h.update(&[0]);
        h.update(key.as_bytes());
        h.digest()
    }

    pub(crate) fn set_in(pool: &PoolTopo, hash: u64) -> usize {
        pool.sets.start + (hash % pool.sets.len() as u64) as usize
    }

    /// The sets of every pool not retired (a retired pool holds nothing and
    /// its drives may be gone).
    pub(crate) fn live_sets(&self) -> Vec<usize> {
        self.topo()
            .pools
            .iter()
            .filter(|p| !p.retired)
            .flat_map(|p| p.sets.clone())
            .collect()
    }

    /// The key's set in every pool not retired, in pool order.
    pub(crate) fn key_sets(&self, bucket: &str, key: &str) -> Vec<usize> {
        let h = self.key_hash(bucket, key);
        self.topo()
            .pools
            .iter()
            .filter(|p| !p.retired)
            .map(|p| Self::set_in(p, h))
            .collect()
    }

    /// The sets the key's lock is taken on: its set in the first pool not
    /// retired and, while that pool drains, its set in the next pool not
    /// retired too. Retiring the first pool moves the locks to the next;
    /// nodes see that map at different moments, and one still on the old
    /// map locks on both, so it meets those on the new one.
    pub(crate) fn lock_sets(&self, bucket: &str, key: &str) -> Vec<usize> {
        Self::lock_sets_in(&self.topo().pools, self.key_hash(bucket, key))
    }

    fn lock_sets_in(pools: &[PoolTopo], h: u64) -> Vec<usize> {
        let mut live = pools.iter().filter(|p| !p.retired);
        let Some(first) = live.next() else {
            return vec![Self::set_in(&pools[0], h)];
        };
        let mut sets = vec![Self::set_in(first, h)];
        if first.draining {
            sets.extend(live.next().map(|p| Self::set_in(p, h)));
        }
        sets
    }

    /// Where bucket/key lives and its record there. Every pool's set is
    /// read; a set that cannot answer fails the lookup (the key could be
    /// there).
    pub(crate) async fn locate(&self, bucket: &str, key: &str) -> Result<Located, StoreError> {
        let sets = self.key_sets(bucket, key);
        if let [set] = sets[..] {
            let (rec, diverged) = self.resolved(set, bucket, key).await?;
            return Ok(Located {
                set,
                stamps: vec![(set, rec.stamp)],
                rec,
                diverged,
                others: Vec::new(),
            });
        }
        let found =
            futures::future::join_all(sets.iter().map(|&s| self.resolved(s, bucket, key))).await;
        let mut all = Vec::with_capacity(sets.len());
        for (&set, r) in sets.iter().zip(found) {
            let (rec, diverged) = r?;
            all.push((set, rec, diverged));
        }
        // The newest version wins; on a tie (a move between pools that
        // stopped after the copy), the pool that takes new objects.
        let topo = self.topo();
        let best = (0..all.len())
            .filter(|&i| !all[i].1.versions.is_empty())
            .max_by_key(|&i| {
                let draining = topo.pool_of(all[i].0).draining;
                (newest(&all[i].1), !draining, std::cmp::Reverse(i))
            })
            .unwrap_or(0);
        let stamps = all.iter().map(|(s, r, _)| (*s, r.stamp)).collect();
        let (set, rec, diverged) = all.swap_remove(best);
        let others = all
            .into_iter()
            .filter(|(_, r, _)| !r.versions.is_empty())
            .map(|(s, r, _)| (s, r))
            .collect();
        Ok(Located {
            set,
            rec,
            diverged,
            others,
            stamps,
        })
    }

    /// The set a new version of bucket/key is written to: where the key
    /// lives, or for a new key an active pool chosen by free space.
    pub(crate) async fn write_set(&self, bucket: &str, key: &str) -> Result<usize, StoreError> {
        let topo = self.topo();
        let h = self.key_hash(bucket, key);
        if let [only] = &topo.pools[..] {
            return Ok(Self::set_in(only, h));
        }
        let loc = self.locate(bucket, key).await?;
        if !loc.rec.versions.is_empty() {
            return Ok(loc.set);
        }
        Ok(self.new_key_set(&topo, h))
    }

    /// A new key's set: in an active pool, each pool taking new keys in
    /// proportion to its free space (as its drives last reported it). The
    /// choice is a function of the key, so a retried write goes to the
    /// same pool.
    pub(crate) fn new_key_set(&self, topo: &Topology, hash: u64) -> usize {
        let active: Vec<&PoolTopo> = topo.pools.iter().filter(|p| p.takes_keys()).collect();
        let Some(first) = active.first() else {
            // Every pool drains: the first not retired keeps taking them.
            let pool = topo
                .pools
                .iter()
                .find(|p| !p.retired)
                .unwrap_or(&topo.pools[0]);
            return Self::set_in(pool, hash);
        };
        if active.len() == 1 {
            return Self::set_in(first, hash);
        }
        let free: Vec<Option<u64>> = active.iter().map(|p| pool_free(topo, p)).collect();
        // Unknown anywhere (a node that has not reported yet): even shares.
        let weights: Vec<u64> = if free.iter().any(Option::is_none) {
            vec![1; active.len()]
        } else {
            // In MiB, so that the sum cannot overflow; a full pool gets none.
            free.iter().map(|f| f.unwrap_or(0) >> 20).collect()
        };
        let total: u64 = weights.iter().sum();
        if total == 0 {
            return Self::set_in(first, hash);
        }
        // Another part of the hash than the one that picks the set.
        let mut pick = hash.rotate_left(32) % total;
        for (p, w) in active.iter().zip(&weights) {
            if pick < *w {
                return Self::set_in(p, hash);
            }
            pick -= w;
        }
        Self::set_in(first, hash)
    }

    /// At a new version's commit, under the key's lock, with the key
    /// located: the record in `set` (where its data was written) to merge
    /// it into. A key that lives in another set meanwhile (a first write
    /// that raced another into another pool, or a move between pools) is
    /// taken over when the new version replaces all it holds there (only
    /// null versions, replaced by a null version); its records elsewhere
    /// are then returned, to be removed after the commit. Otherwise the
    /// write answers SlowDown, to be retried (it then goes where the key
    /// lives).
    pub(crate) fn commit_record(
        set: usize,
        mut loc: Located,
        replaces_null: bool,
        (bucket, key): (&str, &str),
    ) -> Result<(ObjectRecord, Vec<(usize, ObjectRecord)>), StoreError> {
        let here = match loc.others.iter().position(|(s, _)| *s == set) {
            Some(i) => loc.others.swap_remove(i).1,
            None if loc.set == set => std::mem::take(&mut loc.rec),
            None => ObjectRecord::tombstone(loc.stamp_in(set)),
        };
        if loc.set == set || loc.rec.versions.is_empty() {
            return Ok((here, Vec::new()));
        }
        let only_null = |r: &ObjectRecord| r.versions.iter().all(|v| v.version_id == NULL_VERSION);
        if replaces_null && only_null(&here) && only_null(&loc.rec) {
            let mut stale = vec![(loc.set, loc.rec)];
            stale.extend(loc.others.into_iter().filter(|(_, r)| only_null(r)));
            return Ok((here, stale));
        }
        Err(StoreError::SlowDown(format!(
            "{bucket}/{key} moved to another pool while this write ran; retry it"
        )))
    }

    /// Removes the record of bucket/key from `set` (its versions superseded
    /// by a commit in another pool), and their data. Under the key's lock.
    pub(crate) async fn remove_stale(
        &self,
        set: usize,
        bucket: &str,
        key: &str,
        rec: ObjectRecord,
    ) {
        let w = crate::drive::ObjectWrite {
            record: Some(ObjectRecord::tombstone(rec.stamp)),
            inline_delete: super::inline_keys_of(&rec.versions),
            ..Default::default()
        };
        match self.write_object_everywhere(set, bucket, key, w).await {
            Ok(_) => {
                self.retire_data(set, super::data_ids_of(&rec.versions))
                    .await
            }
            Err(error) => {
                tracing::warn!(set, bucket, key, %error, "could not remove the superseded record of a key from its old pool; reads serve the newer one")
            }
        }
    }
}

/// A pool's free bytes as its drives last reported them; None while any is
/// unknown.
fn pool_free(topo: &Topology, pool: &PoolTopo) -> Option<u64> {
    let mut sum = 0u64;
    for s in pool.sets.clone() {
        for &i in &topo.sets[s] {
            sum = sum.saturating_add(topo.slots[i].space()?.0);
        }
    }
    Some(sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::test_version;

    fn rec(versions: &[(u8, u64)]) -> ObjectRecord {
        ObjectRecord {
            stamp: versions.iter().map(|v| v.1).max().unwrap_or(0),
            versions: versions
                .iter()
                .map(|&(id, t)| test_version(id, t))
                .collect(),
        }
    }

    fn at(set: usize, r: ObjectRecord, others: Vec<(usize, ObjectRecord)>) -> Located {
        let mut stamps = vec![(set, r.stamp)];
        stamps.extend(others.iter().map(|(s, r)| (*s, r.stamp)));
        Located {
            set,
            rec: r,
            diverged: false,
            others,
            stamps,
        }
    }

    const K: (&str, &str) = ("b", "k");

    fn pool(id: u32, sets: std::ops::Range<usize>, draining: bool, retired: bool) -> PoolTopo {
        PoolTopo {
            id,
            sets,
            data_shards: 2,
            parity_shards: 2,
            draining,
            retired,
        }
    }

    #[test]
    fn while_the_first_pool_drains_locks_are_also_taken_where_they_go_next() {
        let h = 5; // set 1 of two in each pool
        let active = |r: usize| pool(r as u32, r * 2..r * 2 + 2, false, false);
        assert_eq!(Store::lock_sets_in(&[active(0), active(1)], h), vec![1]);
        // Pool 0 draining: pool 0 and pool 1, so that a node that sees pool 0
        // retired (locking in pool 1 only) meets one that does not yet.
        let draining = pool(0, 0..2, true, false);
        assert_eq!(Store::lock_sets_in(&[draining, active(1)], h), vec![1, 3]);
        let retired = pool(0, 0..2, false, true);
        assert_eq!(
            Store::lock_sets_in(&[retired.clone(), active(1)], h),
            vec![3]
        );
        // Pools 0 and 1 drained one after the other: each step overlaps.
        let drains = |r: usize| pool(r as u32, r * 2..r * 2 + 2, true, false);
        assert_eq!(
            Store::lock_sets_in(&[retired.clone(), drains(1), active(2)], h),
            vec![3, 5]
        );
        // A pool other than the first draining changes nothing.
        assert_eq!(Store::lock_sets_in(&[active(0), drains(1)], h), vec![1]);
    }

    #[test]
    fn a_commit_merges_where_the_key_lives_and_takes_over_only_what_it_replaces() {
        // Where it lives: its record there, nothing to remove.
        let (r, stale) = Store::commit_record(1, at(1, rec(&[(7, 5)]), vec![]), false, K).unwrap();
        assert_eq!((r, stale.len()), (rec(&[(7, 5)]), 0));
        // Nowhere yet: an empty record.
        let (r, stale) = Store::commit_record(1, at(0, rec(&[]), vec![]), true, K).unwrap();
        assert!(r.versions.is_empty() && stale.is_empty());
        // An older copy in the written set, the newest elsewhere: a null
        // version replaces both, and the other is removed after the commit.
        let loc = at(0, rec(&[(0, 9)]), vec![(1, rec(&[(0, 3)]))]);
        let (r, stale) = Store::commit_record(1, loc, true, K).unwrap();
        assert_eq!(r, rec(&[(0, 3)]));
        assert_eq!(stale, vec![(0, rec(&[(0, 9)]))]);
        // Versions elsewhere are never dropped: retry (SlowDown).
        let loc = at(0, rec(&[(7, 9), (0, 3)]), vec![]);
        assert!(matches!(
            Store::commit_record(1, loc, true, K),
            Err(StoreError::SlowDown(_))
        ));
        let loc = at(0, rec(&[(0, 9)]), vec![]);
        assert!(matches!(
            Store::commit_record(1, loc, false, K),
            Err(StoreError::SlowDown(_))
        ));
    }
}
