//! Per-key locks: striped async read/write locks keyed by a hash of bucket/key.
//!
//! Readers hold a read lock only while they read metadata and pin the shards of
//! the version they will stream (see `Store::pin_data`); writers hold the write
//! lock around their metadata commit and the retirement of superseded shards,
//! never while receiving a body. A slow reader therefore never delays a writer,
//! and a writer never deletes shards a reader still streams.
//!
//! In a cluster, the writers and readers of a key may be on different nodes.
//! Each drive of this node then keeps a `LeaseTable`: its vote in a quorum
//! lock (a writer holds a write quorum of its set's drives, a reader enough
//! that every writer's quorum meets it) and the pins of readers anywhere, so
//! the same two rules hold across nodes. Holdings lapse unless refreshed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tarn_io::file::run_blocking;

use crate::drive::DrivePaths;
use crate::error::StoreError;
use crate::format::Id128;

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

const LOCK_STRIPES: usize = 4096;

pub struct LockTable {
    stripes: Vec<Arc<RwLock<()>>>,
    seed: u64,
}

pub enum KeyGuard {
    Read(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    Write(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

impl LockTable {
    pub fn new(seed: u64) -> Self {
        LockTable {
            stripes: (0..LOCK_STRIPES)
                .map(|_| Arc::new(RwLock::new(())))
                .collect(),
            seed,
        }
    }

    pub fn stripe(&self, bucket: &str, key: &str) -> usize {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.seed);
        h.update(bucket.as_bytes());
        h.update(&[0]);
        h.update(key.as_bytes());
        (h.digest() % LOCK_STRIPES as u64) as usize
    }

    pub async fn read(&self, bucket: &str, key: &str) -> KeyGuard {
        KeyGuard::Read(
            self.stripes[self.stripe(bucket, key)]
                .clone()
                .read_owned()
                .await,
        )
    }

    pub async fn write(&self, bucket: &str, key: &str) -> KeyGuard {
        KeyGuard::Write(
            self.stripes[self.stripe(bucket, key)]
                .clone()
                .write_owned()
                .await,
        )
    }
}

// -------------------------------------------------------------------------
// Locks across nodes

/// How a resource is held across nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// Shared with other readers; excludes writers.
    Read,
    /// Excludes readers and writers.
    Write,
}

/// A call on the lease table of one drive (`Drive::lease`). Every holding
/// belongs to an owner id, new for every attempt, and lapses after its
/// time to live unless refreshed: a node that dies holding locks or pins
/// holds them up for at most that long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseCall {
    /// Takes every item, all or none (granted: true).
    Acquire {
        owner: Id128,
        items: Vec<(u64, LockMode)>,
        ttl_ms: u32,
    },
    /// Extends the owner's holding (false: it lapsed or was never granted).
    Refresh { owner: Id128, ttl_ms: u32 },
    /// Turns the owner's holding into pins of shard data ids: its locks are
    /// released, and the drive removes no pinned data until the owner
    /// releases or its pins lapse. Granted even if the owner held nothing.
    Pin {
        owner: Id128,
        data_ids: Vec<Id128>,
        ttl_ms: u32,
    },
    /// Ends the owner's holding, locks and pins.
    Release { owner: Id128 },
    /// Ends every holding of an earlier incarnation of a node: those whose
    /// owner has `holder`'s first 4 bytes (the node) but not its next 4
    /// (this start of it). What a node that died holding locks sends when
    /// it starts again, so that its old locks do not wait to lapse.
    ReleaseEarlier { holder: Id128 },
}

/// Whether `owner` is a holding of an earlier incarnation of `holder`'s
/// node (`lock_owner`'s layout).
pub fn earlier_incarnation(owner: &Id128, holder: &Id128) -> bool {
    owner[..4] == holder[..4] && owner[4..8] != holder[4..8]
}

/// The most items one acquire takes, and the most data ids one pin names
/// (an object's parts): bounds what a peer's call can make a node keep.
pub const LEASE_ITEMS_MAX: usize = 16;
pub const LEASE_PINS_MAX: usize = 10_000;
/// The longest time to live a holding may ask for.
pub const LEASE_TTL_MAX_MS: u32 = 120_000;

/// Names a lock resource: the same on every node of a deployment (the seed
/// comes from its id). An object's key, or, with an empty key, its bucket.
pub fn resource(seed: u64, bucket: &str, key: &str) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(seed ^ 0x6c6f_636b_7265_736f);
    h.update(bucket.as_bytes());
    h.update(&[0]);
    h.update(key.as_bytes());
    h.digest()
}

struct Holding {
    expires: Instant,
    items: Vec<(u64, LockMode)>,
    pins: Vec<Id128>,
    /// When it was granted, and how many times refreshed since: a lock
    /// that lapses is logged with both (its holder never released it).
    granted: Instant,
    refreshes: u32,
}

#[derive(Default)]
struct Resource {
    writer: Option<Id128>,
    readers: Vec<Id128>,
}

#[derive(Default)]
struct Leases {
    holdings: HashMap<Id128, Holding>,
    resources: HashMap<u64, Resource>,
    /// Holdings pinning each data id.
    pins: HashMap<Id128, usize>,
    /// Data whose removal waits for its last pin.
    deferred: HashSet<Id128>,
    /// No holding lapses before this, so a call before it skips the scan
    /// for lapsed holdings.
    earliest_lapse: Option<Instant>,
    /// Owners released while they held nothing here, and when: their
    /// acquire is still on its way (it waited behind a busy core, or in a
    /// paused node's socket), or it failed. Granting it when it comes
    /// would hold the key for a caller that gave up, until the holding
    /// lapsed (writes stalled 12-14 s after a partition healed). At most
    /// `ENDED_MAX`, each for `ENDED_FOR`.
    ended: HashMap<Id128, Instant>,
}

/// How long a release that came before its acquire is remembered: longer
/// than any lease lives, so the acquire can only come later as a holding
/// that lapses sooner than this.
pub(crate) const ENDED_FOR: Duration = Duration::from_secs(LEASE_TTL_MAX_MS as u64 / 1000);
/// The most early releases remembered (the oldest go first).
const ENDED_MAX: usize = 100_000;

/// The locks and pins of one drive of this node, as every node asks for
/// them: the vote of this drive in a quorum lock (`Store::lock_write`), and
/// the shard data that readers anywhere still stream from it.
pub struct LeaseTable {
    paths: DrivePaths,
    inner: Mutex<Leases>,
}

impl LeaseTable {
    pub fn new(paths: DrivePaths) -> LeaseTable {
        LeaseTable {
            paths,
            inner: Mutex::new(Leases::default()),
        }
    }

    /// Answers a call; data its end unpinned is removed before it returns.
    pub async fn call(&self, call: LeaseCall) -> Result<bool, StoreError> {
        let (granted, freed) = self.apply(call, Instant::now())?;
        remove_shard_files(&self.paths, freed).await;
        Ok(granted)
    }

    /// Removes shard data, or, for data pinned by a reader, once its last
    /// pin ends.
    pub async fn remove_unpinned(&self, data_ids: Vec<Id128>) {
        let now = {
            let mut l = self.inner.lock().expect("lease table");
            data_ids
                .into_iter()
                .filter(|id| {
                    if l.pins.contains_key(id) {
                        l.deferred.insert(*id);
                        false
                    } else {
                        true
                    }
                })
                .collect()
        };
        remove_shard_files(&self.paths, now).await;
    }

    /// Ends holdings past their time; removes the data their pins held.
    pub async fn expire(&self) {
        let freed = {
            let mut l = self.inner.lock().expect("lease table");
            let now = Instant::now();
            l.forget_ended(now);
            l.expire(now)
        };
        remove_shard_files(&self.paths, freed).await;
    }

    /// The state change of a call, and the data ids it freed for removal.
    fn apply(&self, call: LeaseCall, now: Instant) -> Result<(bool, Vec<Id128>), StoreError> {
        let ttl = |ms: u32| -> Result<Duration, StoreError> {
            if ms == 0 || ms > LEASE_TTL_MAX_MS {
                return Err(StoreError::InvalidArgument(format!(
                    "lease time to live {ms} ms outside 1..={LEASE_TTL_MAX_MS}"
                )));
            }
            Ok(Duration::from_millis(ms as u64))
        };
        let mut l = self.inner.lock().expect("lease table");
        let mut freed = l.expire(now);
        let granted = match call {
            LeaseCall::Acquire {
                owner,
                items,
                ttl_ms,
            } => {
                if items.is_empty() || items.len() > LEASE_ITEMS_MAX {
                    return Err(StoreError::InvalidArgument(format!(
                        "a lock takes 1..={LEASE_ITEMS_MAX} items, not {}",
                        items.len()
                    )));
                }
                let ttl = ttl(ttl_ms)?;
                if l.holdings.contains_key(&owner) || l.ended.contains_key(&owner) {
                    // An owner id names one attempt: a second acquire is a
                    // confused or forged caller, and one after the
                    // owner's release came too late.
                    false
                } else if items.iter().all(|(r, m)| l.free_for(*r, *m)) {
                    for (r, m) in &items {
                        let res = l.resources.entry(*r).or_default();
                        match m {
                            LockMode::Read => res.readers.push(owner),
                            LockMode::Write => res.writer = Some(owner),
                        }
                    }
                    l.hold(
                        owner,
                        Holding {
                            expires: now + ttl,
                            items,
                            pins: Vec::new(),
                            granted: now,
                            refreshes: 0,
                        },
                    );
                    true
                } else {
                    false
                }
            }
            LeaseCall::Refresh { owner, ttl_ms } => {
                let ttl = ttl(ttl_ms)?;
                match l.holdings.remove(&owner) {
                    Some(mut h) => {
                        h.expires = now + ttl;
                        h.refreshes += 1;
                        l.hold(owner, h);
                        true
                    }
                    None => false,
                }
            }
            LeaseCall::Pin {
                owner,
                data_ids,
                ttl_ms,
            } => {
                if data_ids.len() > LEASE_PINS_MAX {
                    return Err(StoreError::InvalidArgument(format!(
                        "a pin names at most {LEASE_PINS_MAX} data ids, not {}",
                        data_ids.len()
                    )));
                }
                let ttl = ttl(ttl_ms)?;
                freed.extend(l.end(&owner));
                for id in &data_ids {
                    *l.pins.entry(*id).or_default() += 1;
                }
                l.hold(
                    owner,
                    Holding {
                        expires: now + ttl,
                        items: Vec::new(),
                        pins: data_ids,
                        granted: now,
                        refreshes: 0,
                    },
                );
                true
            }
            LeaseCall::ReleaseEarlier { holder } => {
                let earlier: Vec<Id128> = l
                    .holdings
                    .keys()
                    .filter(|o| earlier_incarnation(o, &holder))
                    .copied()
                    .collect();
                for o in earlier {
                    freed.extend(l.end(&o));
                }
                true
            }
            LeaseCall::Release { owner } => {
                if l.holdings.contains_key(&owner) {
                    freed.extend(l.end(&owner));
                } else {
                    l.remember_ended(owner, now);
                }
                true
            }
        };
        Ok((granted, freed))
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.inner.lock().expect("lease table").holdings.len()
    }
}

impl Leases {
    fn forget_ended(&mut self, now: Instant) {
        self.ended
            .retain(|_, at| now.duration_since(*at) < ENDED_FOR);
    }

    fn remember_ended(&mut self, owner: Id128, now: Instant) {
        if self.ended.len() >= ENDED_MAX {
            self.forget_ended(now);
            if self.ended.len() >= ENDED_MAX {
                let oldest = self
                    .ended
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(o, _)| *o);
                if let Some(o) = oldest {
                    self.ended.remove(&o);
                }
            }
        }
        self.ended.insert(owner, now);
    }

    fn hold(&mut self, owner: Id128, h: Holding) {
        self.earliest_lapse = Some(self.earliest_lapse.map_or(h.expires, |e| e.min(h.expires)));
        self.holdings.insert(owner, h);
    }

    fn free_for(&self, resource: u64, mode: LockMode) -> bool {
        match self.resources.get(&resource) {
            None => true,
            Some(r) => r.writer.is_none() && (mode == LockMode::Read || r.readers.is_empty()),
        }
    }

    /// Ends a holding; returns the deferred data ids it was the last pin of.
    fn end(&mut self, owner: &Id128) -> Vec<Id128> {
        let Some(h) = self.holdings.remove(owner) else {
            return Vec::new();
        };
        for (r, _) in &h.items {
            if let Some(res) = self.resources.get_mut(r) {
                if res.writer == Some(*owner) {
                    res.writer = None;
                }
                res.readers.retain(|o| o != owner);
                if res.writer.is_none() && res.readers.is_empty() {
                    self.resources.remove(r);
                }
            }
        }
        let mut freed = Vec::new();
        for id in &h.pins {
            if let Some(n) = self.pins.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    self.pins.remove(id);
                    if self.deferred.remove(id) {
                        freed.push(*id);
                    }
                }
            }
        }
        freed
    }

    fn expire(&mut self, now: Instant) -> Vec<Id128> {
        if self.earliest_lapse.is_none_or(|e| now < e) {
            return Vec::new();
        }
        let lapsed: Vec<Id128> = self
            .holdings
            .iter()
            .filter(|(_, h)| h.expires <= now)
            .map(|(o, h)| {
                // A lock nobody released: its holder died, was cut off, or
                // lost track of it (every key it names waited meanwhile).
                if !h.items.is_empty() {
                    tracing::warn!(
                        owner = %crate::format::id_to_hex(o),
                        held_ms = now.duration_since(h.granted).as_millis() as u64,
                        refreshes = h.refreshes,
                        items = h.items.len(),
                        "a lock lapsed on this drive without its holder's release"
                    );
                }
                *o
            })
            .collect();
        let freed = lapsed.iter().flat_map(|o| self.end(o)).collect();
        self.earliest_lapse = self.holdings.values().map(|h| h.expires).min();
        freed
    }
}

/// Removes shard files (final and tmp) of data ids; a missing file is not
/// an error (another remover, or never written here).
pub(crate) async fn remove_shard_files(paths: &DrivePaths, data_ids: Vec<Id128>) {
    if data_ids.is_empty() {
        return;
    }
    let paths = paths.clone();
    let _ = run_blocking(move || {
        for id in &data_ids {
            for p in [paths.shard(id), paths.tmp_shard(id)] {
                if let Err(e) = std::fs::remove_file(&p) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(path = %p.display(), error = %e, "could not remove shard file");
                    }
                }
            }
        }
        Ok(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(dir: &std::path::Path) -> LeaseTable {
        LeaseTable::new(DrivePaths {
            root: dir.to_path_buf(),
        })
    }

    fn acquire(owner: u8, items: &[(u64, LockMode)], ttl_ms: u32) -> LeaseCall {
        LeaseCall::Acquire {
            owner: [owner; 16],
            items: items.to_vec(),
            ttl_ms,
        }
    }

    fn at(t: &LeaseTable, call: LeaseCall, now: Instant) -> bool {
        t.apply(call, now).unwrap().0
    }

    /// A node killed holding locks on other nodes' drives blocked their
    /// keys until the holdings lapsed (15 s); started again, it ends its
    /// earlier incarnations' holdings and no one else's.
    #[test]
    fn a_node_started_again_ends_its_earlier_holdings_only() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        let now = Instant::now();
        let owner = |node: u8, inc: u8, n: u8| {
            let mut o = [n; 16];
            o[..4].copy_from_slice(&[node; 4]);
            o[4..8].copy_from_slice(&[inc; 4]);
            o
        };
        let take = |o: Id128, r: u64| LeaseCall::Acquire {
            owner: o,
            items: vec![(r, LockMode::Write)],
            ttl_ms: 15_000,
        };
        assert!(at(&t, take(owner(1, 1, 1), 10), now));
        assert!(at(&t, take(owner(1, 2, 2), 11), now));
        assert!(at(&t, take(owner(2, 1, 3), 12), now));
        assert!(at(
            &t,
            LeaseCall::ReleaseEarlier {
                holder: owner(1, 2, 0)
            },
            now
        ));
        assert_eq!(t.held(), 2);
        assert!(
            at(&t, take(owner(3, 1, 4), 10), now),
            "node 1's old lock is gone"
        );
        assert!(
            !at(&t, take(owner(3, 1, 5), 11), now),
            "its current one stays"
        );
        assert!(
            !at(&t, take(owner(3, 1, 6), 12), now),
            "another node's stays"
        );
    }

    /// Writes stalled 12-14 s after a partition healed (issue 40): an
    /// acquire that reached a drive after its caller had given up on it
    /// (released it, or failed the call) held the key for nobody until the
    /// holding lapsed. A release that comes first now bars the acquire.
    #[test]
    fn an_acquire_that_arrives_after_its_release_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        let now = Instant::now();
        assert!(at(&t, LeaseCall::Release { owner: [1; 16] }, now));
        assert!(!at(&t, acquire(1, &[(7, LockMode::Write)], 15_000), now));
        assert_eq!(t.held(), 0);
        assert!(
            at(&t, acquire(2, &[(7, LockMode::Write)], 15_000), now),
            "the key is free"
        );
        // A release of a holding ends it and is not remembered.
        assert!(at(&t, LeaseCall::Release { owner: [2; 16] }, now));
        assert!(t.inner.lock().unwrap().ended.len() == 1);
        // Remembered for a while, not for ever.
        let later = now + ENDED_FOR + Duration::from_secs(1);
        t.inner.lock().unwrap().forget_ended(later);
        assert!(at(&t, acquire(1, &[(8, LockMode::Write)], 15_000), later));
    }

    #[test]
    fn writers_exclude_readers_and_writers() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        let now = Instant::now();
        use LockMode::{Read, Write};
        assert!(at(&t, acquire(1, &[(7, Read)], 1000), now));
        assert!(at(&t, acquire(2, &[(7, Read)], 1000), now));
        assert!(!at(&t, acquire(3, &[(7, Write)], 1000), now));
        // All or nothing: the free item is not taken either.
        assert!(!at(&t, acquire(3, &[(8, Write), (7, Write)], 1000), now));
        assert!(at(&t, acquire(4, &[(8, Write)], 1000), now));
        at(&t, LeaseCall::Release { owner: [1; 16] }, now);
        at(&t, LeaseCall::Release { owner: [2; 16] }, now);
        assert!(at(&t, acquire(3, &[(7, Write), (9, Read)], 1000), now));
        assert!(!at(&t, acquire(5, &[(7, Read)], 1000), now));
        assert!(at(&t, acquire(5, &[(9, Read)], 1000), now));
        // An owner id names one attempt.
        assert!(!at(&t, acquire(5, &[(10, Read)], 1000), now));
    }

    #[test]
    fn holdings_lapse_unless_refreshed() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        let now = Instant::now();
        let ms = Duration::from_millis;
        assert!(at(&t, acquire(1, &[(7, LockMode::Write)], 100), now));
        assert!(at(
            &t,
            LeaseCall::Refresh {
                owner: [1; 16],
                ttl_ms: 100
            },
            now + ms(90)
        ));
        assert!(!at(
            &t,
            acquire(2, &[(7, LockMode::Write)], 100),
            now + ms(150)
        ));
        // The holder died: its lock is gone after its time to live.
        assert!(at(
            &t,
            acquire(2, &[(7, LockMode::Write)], 100),
            now + ms(191)
        ));
        assert!(!at(
            &t,
            LeaseCall::Refresh {
                owner: [1; 16],
                ttl_ms: 100
            },
            now + ms(200)
        ));
        assert_eq!(t.held(), 1);
    }

    /// A refresh may shorten a holding: it lapses at the new time, not at
    /// the first one.
    #[test]
    fn a_shortened_holding_lapses_on_time() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        let now = Instant::now();
        let ms = Duration::from_millis;
        assert!(at(&t, acquire(1, &[(7, LockMode::Write)], 10_000), now));
        assert!(at(
            &t,
            LeaseCall::Refresh {
                owner: [1; 16],
                ttl_ms: 10
            },
            now
        ));
        assert!(at(
            &t,
            acquire(2, &[(7, LockMode::Write)], 100),
            now + ms(11)
        ));
    }

    #[test]
    fn bad_calls_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = table(dir.path());
        assert!(t.apply(acquire(1, &[], 100), Instant::now()).is_err());
        assert!(t
            .apply(acquire(1, &[(1, LockMode::Read)], 0), Instant::now())
            .is_err());
        assert!(t
            .apply(
                acquire(1, &[(1, LockMode::Read)], LEASE_TTL_MAX_MS + 1),
                Instant::now()
            )
            .is_err());
        let many = vec![(1, LockMode::Read); LEASE_ITEMS_MAX + 1];
        assert!(t.apply(acquire(1, &many, 100), Instant::now()).is_err());
        assert_eq!(t.held(), 0);
    }

    /// A reader on another node pinned data; a writer there replaced the
    /// object and asked for its old data to be removed. The files stay
    /// until the reader's pin ends (release, or lapse).
    #[tokio::test]
    async fn pinned_data_is_removed_after_its_last_pin() {
        let dir = tempfile::tempdir().unwrap();
        let paths = DrivePaths {
            root: dir.path().to_path_buf(),
        };
        let t = LeaseTable::new(paths.clone());
        let (a, b) = ([1u8; 16], [2u8; 16]);
        for id in [&a, &b] {
            let p = paths.shard(id);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, b"shard").unwrap();
        }
        let pin = |owner: u8, ttl_ms: u32| LeaseCall::Pin {
            owner: [owner; 16],
            data_ids: vec![a],
            ttl_ms,
        };
        // A read lock turned into a pin releases the lock.
        assert!(t
            .call(acquire(9, &[(7, LockMode::Read)], 1000))
            .await
            .unwrap());
        assert!(t.call(pin(9, 60_000)).await.unwrap());
        assert!(t
            .call(acquire(8, &[(7, LockMode::Write)], 1000))
            .await
            .unwrap());
        assert!(t.call(pin(10, 60_000)).await.unwrap());
        t.remove_unpinned(vec![a, b]).await;
        assert!(paths.shard(&a).exists());
        assert!(!paths.shard(&b).exists());
        t.call(LeaseCall::Release { owner: [9; 16] }).await.unwrap();
        assert!(paths.shard(&a).exists());
        t.call(LeaseCall::Release { owner: [10; 16] })
            .await
            .unwrap();
        assert!(!paths.shard(&a).exists());

        // A pin whose holder vanished lapses, and the data goes with it.
        std::fs::write(paths.shard(&a), b"shard").unwrap();
        assert!(t.call(pin(11, 1)).await.unwrap());
        t.remove_unpinned(vec![a]).await;
        assert!(paths.shard(&a).exists());
        tokio::time::sleep(Duration::from_millis(5)).await;
        t.expire().await;
        assert!(!paths.shard(&a).exists());
    }
}
