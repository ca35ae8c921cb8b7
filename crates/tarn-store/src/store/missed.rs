//! The missed-write log: every object write that does not reach a drive of
//! its set is recorded, before it is acknowledged, on the drives that took
//! it (`DriveDb`'s `missed` keyspace: set position, bucket, key). A drive
//! back after an absence is synced from it: the node that owns the drive
//! heals the keys its position missed and clears their entries; until the
//! set's logs hold nothing for its position, no node reads metadata from it.
//! A log that overflowed (`MISSED_LOG_MAX_ENTRIES`) is replaced by a full
//! heal.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::StreamExt;
use tarn_io::file::run_blocking;

use super::{DriveSlot, Store};
use crate::drive::MissedEntry;
use crate::drive_io::{Drive, DriveState};
use crate::error::StoreError;

/// Entries read from one drive's log at a time.
const REPLAY_PAGE: usize = 1000;

/// What `Store::under_replicated` counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnderReplicated {
    /// Distinct (set position, object) pairs some write missed and no
    /// replay has healed yet.
    pub objects: u64,
    /// Set positions whose log overflowed (a full heal replaces it).
    pub overflowed: u64,
    /// Drives whose log could not be read (their entries are not counted).
    pub unanswered: u64,
}

impl Store {
    /// Records on `drives` that the write of bucket/key missed `positions`
    /// of its set; a write quorum of the set must take it, as the write
    /// itself (so every entry is on a write quorum of the other drives,
    /// which `log_empty_for` relies on).
    pub(crate) async fn log_missed_on(
        &self,
        set: usize,
        drives: &[(Arc<DriveSlot>, Arc<dyn Drive>)],
        bucket: &str,
        key: &str,
        positions: &[u8],
    ) -> Result<(), StoreError> {
        let entries: Arc<Vec<MissedEntry>> = Arc::new(
            positions
                .iter()
                .map(|&position| MissedEntry {
                    position,
                    bucket: bucket.to_string(),
                    key: key.to_string(),
                })
                .collect(),
        );
        let results =
            futures::future::join_all(drives.iter().map(|(_, d)| d.log_missed(entries.clone())))
                .await;
        let ok = self.count_index_writes("missed-write log", drives, &results);
        let quorum = self.meta_write_quorum(self.set_size(set));
        if ok < quorum {
            return Err(StoreError::QuorumLost {
                what: "missed-write log",
                needed: quorum,
                available: ok,
            });
        }
        Ok(())
    }

    /// The set and position of drive slot `i`.
    fn place_of(&self, i: usize) -> (usize, u8) {
        let topo = self.topo();
        let set = topo.slots[i].set_index;
        let pos = topo.sets[set]
            .iter()
            .position(|&d| d == i)
            .expect("a drive is in its set");
        (set, pos as u8)
    }

    /// The other drives of slot `i`'s set in use, with their slot indexes.
    fn set_peers(&self, i: usize) -> Vec<(usize, Arc<dyn Drive>)> {
        let topo = self.topo();
        let set = topo.slots[i].set_index;
        topo.sets[set]
            .iter()
            .filter(|&&d| d != i)
            .filter_map(|&d| Some((d, topo.slots[d].writer()?)))
            .collect()
    }

    /// One round of syncing (every few seconds, with the drive checks):
    /// this node's drives get what their position missed replayed, and a
    /// syncing drive serves reads again once the set's logs are empty for
    /// it.
    pub(crate) async fn sync_drives(self: &Arc<Self>) {
        for i in 0..self.topo().slots.len() {
            let slot = &self.drive(i);
            if !slot.online() {
                continue;
            }
            if !slot.is_remote() {
                self.start_replay(i);
            }
            let Some(n) = slot.syncing() else { continue };
            if slot.is_remote() {
                // Its own node must have it in full service too.
                let Some(d) = slot.writer() else { continue };
                if !matches!(d.state().await, Ok(DriveState::Ready)) {
                    continue;
                }
            }
            if self.log_empty_for(i).await {
                self.end_rebuild(i, n);
            }
        }
    }

    /// Whether no other drive of slot `i`'s set holds a missed-write entry
    /// (or overflow) for its position. Every entry is on a write quorum of
    /// the other drives, so all but write quorum - 1 of them must answer
    /// (none for a drive alone in its set: nothing is written without it).
    async fn log_empty_for(&self, i: usize) -> bool {
        let (set, pos) = self.place_of(i);
        let peers = self.set_peers(i);
        let pages =
            futures::future::join_all(peers.iter().map(|(_, d)| d.missed(pos, None, 1))).await;
        let mut answered = 0;
        for p in pages {
            match p {
                Ok(p) if p.entries.is_empty() && p.overflow.is_none() => answered += 1,
                Ok(_) => return false,
                Err(_) => {}
            }
        }
        let n = self.set_size(set);
        answered >= n - self.meta_write_quorum(n)
    }

    /// Starts replaying the log to this node's drive `i`, unless a replay
    /// of it runs.
    fn start_replay(self: &Arc<Self>, i: usize) {
        if !self.replaying.lock().expect("replaying").insert(i) {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(error) = store.replay(i).await {
                tracing::warn!(drive = %store.drive(i).name, %error, "replaying missed writes stopped; tried again shortly");
            }
            store.replaying.lock().expect("replaying").remove(&i);
        });
    }

    /// Heals, key by key, what drive `i`'s position missed, clearing the
    /// entries of each key healed; a log that overflowed gets a full heal.
    async fn replay(self: &Arc<Self>, i: usize) -> Result<(), StoreError> {
        let (set, pos) = self.place_of(i);
        let slot = &self.drive(i);
        loop {
            if !slot.online() {
                return Ok(());
            }
            let peers = self.set_peers(i);
            let mut keys: BTreeMap<(String, String), Vec<(usize, u64)>> = BTreeMap::new();
            let mut overflow: Option<u64> = None;
            for (d, drive) in &peers {
                let Ok(page) = drive.missed(pos, None, REPLAY_PAGE).await else {
                    continue;
                };
                overflow = overflow.max(page.overflow);
                for (b, k, at) in page.entries {
                    keys.entry((b, k)).or_default().push((*d, at));
                }
            }
            if let Some(since) = overflow {
                return self.overflowed(i, pos, since).await;
            }
            if keys.is_empty() {
                return Ok(());
            }
            tracing::info!(drive = %slot.name, keys = keys.len(), "replaying writes the drive missed");
            let mut done: HashMap<usize, Vec<(String, String, u64)>> = HashMap::new();
            let mut healed = 0usize;
            let total = keys.len();
            // `heal_concurrency` keys at a time, like the backfill.
            let mut heals = futures::stream::iter(keys)
                .map(|((bucket, key), holders)| async move {
                    let r = self.heal_object_on(Some(set), &bucket, &key, None).await;
                    (r, bucket, key, holders)
                })
                .buffer_unordered(self.cfg.heal_concurrency.max(1));
            while let Some((r, bucket, key, holders)) = heals.next().await {
                match r {
                    Ok(r) if r.failures == 0 && r.metadata_failures == 0 => {
                        healed += 1;
                        self.stats.missed_replayed.fetch_add(1, Ordering::Relaxed);
                        for (d, at) in holders {
                            done.entry(d)
                                .or_default()
                                .push((bucket.clone(), key.clone(), at));
                        }
                    }
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%bucket, %key, %error, "replaying a missed write failed")
                    }
                }
            }
            for (d, items) in done {
                if let Some(drive) = self.drive(d).writer() {
                    drive.clear_missed(pos, items, None).await?;
                }
            }
            // Keys that could not be healed now are tried next round.
            if healed < total {
                return Ok(());
            }
        }
    }

    /// An overflowed log names too little: the drive is rebuilt in full
    /// instead (the checkpointed backfill, resumed after a restart by the
    /// rebuild marker written first), and the position's log is cleared of
    /// what was logged before: the backfill covers all of it.
    async fn overflowed(self: &Arc<Self>, i: usize, pos: u8, since: u64) -> Result<(), StoreError> {
        let slot = self.drive(i);
        let began = super::now_ns();
        tracing::warn!(drive = %slot.name, overflowed_at = since, "missed-write log overflowed: backfilling the drive in full");
        let root = slot.paths.root.clone();
        run_blocking(move || Ok(crate::drive::mark_rebuilding(&root))).await??;
        {
            let mut st = slot.state.write().expect("drive state");
            if st.db.is_none() || st.rebuilding.is_none() {
                return Ok(());
            }
            st.full = true;
        }
        for (_, drive) in self.set_peers(i) {
            drive.clear_missed(pos, Vec::new(), Some(began)).await?;
        }
        self.heal_rebuilding(true);
        Ok(())
    }

    /// Objects some write missed and no replay has healed yet, from every
    /// drive in use (each set position's entries counted once).
    pub async fn under_replicated(&self) -> UnderReplicated {
        let mut out = UnderReplicated::default();
        let topo = self.topo();
        let live = self.live_sets();
        for (set, members) in topo.sets.iter().enumerate() {
            if !live.contains(&set) {
                continue;
            }
            for pos in 0..members.len() as u8 {
                let mut keys = std::collections::BTreeSet::new();
                let mut overflowed = false;
                for p in 0..members.len() {
                    let Some(drive) = self.slot(set, p).writer() else {
                        continue;
                    };
                    let mut after: Option<Vec<u8>> = None;
                    loop {
                        let page = match drive.missed(pos, after.clone(), 10_000).await {
                            Ok(page) => page,
                            Err(_) => {
                                out.unanswered += 1;
                                break;
                            }
                        };
                        overflowed |= page.overflow.is_some();
                        let more = page.more;
                        if let Some((b, k, _)) = page.entries.last() {
                            after = Some(crate::drive::object_key(b, k));
                        }
                        keys.extend(page.entries.into_iter().map(|(b, k, _)| (b, k)));
                        if !more {
                            break;
                        }
                    }
                }
                out.objects += keys.len() as u64;
                out.overflowed += u64::from(overflowed);
            }
        }
        out
    }
}
