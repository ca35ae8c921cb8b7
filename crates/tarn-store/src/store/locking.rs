//! The engine's locks on a key or a bucket: this process's lock table and,
//! when other nodes reach the same drives, a quorum of the lease tables of
//! the set's drives (`lock::LeaseTable`), so that a writer on one node and a
//! writer or reader on another exclude each other as two tasks of one
//! process do.
//!
//! A writer holds its key for writing and its bucket for reading on a
//! metadata write quorum of the set's drives; a reader holds the key for
//! reading on enough drives that every write quorum meets them; a bucket's
//! deletion holds the bucket for writing on a write quorum of every set.
//! Each acquire is all or nothing on a drive and never waits there: a
//! caller that misses its quorum releases what it got and tries again after
//! a random pause (no deadlock, whatever the order of callers). A caller
//! asks just a quorum first, its own node's drives among them, and the
//! others only when one is busy, fails or is slow to answer. Holdings
//! lapse after `LEASE_TTL_MS` unless refreshed, so a node that dies holding
//! locks or pins blocks no one for longer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};

use super::Store;
use crate::drive_io::Drive;
use crate::error::StoreError;
use crate::format::{new_id, Id128};
use crate::lock::{resource, KeyGuard, LeaseCall, LeaseTable, LockMode};

/// Time to live of a holding on another drive, and how often a holder
/// extends it.
const LEASE_TTL_MS: u32 = 15_000;
const LEASE_REFRESH: Duration = Duration::from_secs(5);
/// How long a lock is tried before the request fails with SlowDown: longer
/// than a lease lives, so the locks of a node that died are gone first.
const LOCK_WAIT: Duration = Duration::from_secs(30);
const LOCK_BACKOFF_MAX: Duration = Duration::from_millis(50);
/// How long a lock waits for the quorum it asked first before it asks the
/// set's other drives too (a paused node costs a lock this much, once).
const LOCK_HEDGE: Duration = Duration::from_millis(25);
/// How long a reader waits for the pins of slow drives once a read
/// quorum of them answered (the others are still pinned when they answer).
const PIN_GRACE: Duration = Duration::from_millis(200);

/// One drive's vote: its lease table, on this node or over RPC.
#[derive(Clone)]
enum Voter {
    Local(Arc<LeaseTable>),
    Remote(Arc<dyn Drive>),
    /// A table behind a link the test cuts (calls fail while it is down).
    #[cfg(test)]
    Linked(Arc<LeaseTable>, Arc<std::sync::atomic::AtomicBool>),
}

impl Voter {
    async fn call(&self, call: LeaseCall) -> Result<bool, StoreError> {
        match self {
            Voter::Local(t) => t.call(call).await,
            Voter::Remote(d) => d.lease(call).await,
            #[cfg(test)]
            Voter::Linked(t, up) => {
                if up.load(std::sync::atomic::Ordering::SeqCst) {
                    t.call(call).await
                } else {
                    Err(StoreError::QuorumLost {
                        what: "test link down",
                        needed: 1,
                        available: 0,
                    })
                }
            }
        }
    }
}

/// A holding on other nodes' drives: released when dropped, refreshed
/// while it lives.
pub(crate) struct Lease {
    owner: Id128,
    voters: Vec<Voter>,
    refresher: tokio::task::AbortHandle,
}

impl Lease {
    fn new(owner: Id128, voters: Vec<Voter>) -> Lease {
        let held = voters.clone();
        let refresher = tokio::spawn(async move {
            loop {
                tokio::time::sleep(LEASE_REFRESH).await;
                let calls = held.iter().map(|v| {
                    v.call(LeaseCall::Refresh {
                        owner,
                        ttl_ms: LEASE_TTL_MS,
                    })
                });
                futures::future::join_all(calls).await;
            }
        })
        .abort_handle();
        Lease {
            owner,
            voters,
            refresher,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.refresher.abort();
        release(self.owner, std::mem::take(&mut self.voters), Vec::new());
    }
}

/// First wait before a release that failed is sent again, and the longest.
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(100);
const RELEASE_RETRY_MAX: Duration = Duration::from_millis(500);

/// Releases a holding in the background (without a runtime it lapses).
/// A drive that cannot be reached now (its node cut off, paused, busy)
/// is asked again until it answers: a partition that heals leaves no lock
/// of a request that failed during it in the way of the next writer (writes
/// stalled 12-14 s, until the holdings lapsed, before). `granted` voters
/// are asked until the holding has lapsed there anyway (a lease's time to
/// live after it was granted or refreshed). `unknown` voters, whose
/// acquire got no answer, are asked until they answer, for up to
/// `lock::ENDED_FOR`: the acquire may still be on its way (TCP sends it
/// again once a cut link is back, a paused node reads it when it resumes),
/// and when it comes it makes a holding of its own, whole. A release that
/// gave up with the lease's time to live left such a holding to lapse:
/// every writer and reader of the key waited 15 s, from 10 s after a cut
/// node came back (the soak's one stall without a fault).
fn release(owner: Id128, granted: Vec<Voter>, unknown: Vec<Voter>) {
    release_for(
        owner,
        granted,
        unknown,
        Duration::from_millis(LEASE_TTL_MS as u64),
        crate::lock::ENDED_FOR,
    );
}

fn release_for(
    owner: Id128,
    granted: Vec<Voter>,
    unknown: Vec<Voter>,
    granted_for: Duration,
    unknown_for: Duration,
) {
    if granted.is_empty() && unknown.is_empty() {
        return;
    }
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            let now = Instant::now();
            let mut left: Vec<(Voter, Instant)> = granted
                .into_iter()
                .map(|v| (v, now + granted_for))
                .chain(unknown.into_iter().map(|v| (v, now + unknown_for)))
                .collect();
            let mut wait = RELEASE_RETRY_FIRST;
            loop {
                let calls = left
                    .iter()
                    .map(|(v, _)| v.call(LeaseCall::Release { owner }));
                let answers = futures::future::join_all(calls).await;
                let now = Instant::now();
                left = left
                    .into_iter()
                    .zip(answers)
                    .filter(|((_, until), a)| a.is_err() && now + wait <= *until)
                    .map(|(v, _)| v)
                    .collect();
                if left.is_empty() {
                    return;
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RELEASE_RETRY_MAX);
            }
        });
    }
}

/// A voter's answer to an acquire, from its own task.
type AcquireTask = tokio::task::JoinHandle<(usize, Result<bool, StoreError>)>;

/// One try at a lock: the voters that granted it, those whose answer was
/// lost (they may have granted it) and the answers still to come. Dropped,
/// it releases the first two and, as they come, the grants and lost
/// answers of the rest; a try that made its quorum takes `granted` out
/// first (the lease's now).
struct Attempt {
    owner: Id128,
    voters: Vec<Voter>,
    pending: FuturesUnordered<AcquireTask>,
    granted: Vec<Voter>,
    unknown: Vec<Voter>,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let owner = self.owner;
        if !self.pending.is_empty() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let mut pending = std::mem::take(&mut self.pending);
                let voters = self.voters.clone();
                rt.spawn(async move {
                    let (mut late, mut lost) = (Vec::new(), Vec::new());
                    while let Some(r) = pending.next().await {
                        match r {
                            Ok((i, Ok(true))) => late.push(voters[i].clone()),
                            Ok((i, Err(_))) => lost.push(voters[i].clone()),
                            _ => {}
                        }
                    }
                    release(owner, late, lost);
                });
            }
        }
        release(
            owner,
            std::mem::take(&mut self.granted),
            std::mem::take(&mut self.unknown),
        );
    }
}

/// A key (or bucket) held by this process and, in a cluster, on its set's
/// drives.
pub(crate) struct KeyLock {
    _local: KeyGuard,
    /// One per lock set (`Store::lock_sets`); none on one node.
    leases: Vec<Lease>,
}

/// A bucket held against every writer of its objects: by this process
/// and, in a cluster, on a write quorum of every set's drives.
pub(crate) struct BucketLock {
    _local: KeyGuard,
    _leases: Vec<Lease>,
}

impl KeyLock {
    /// Pins the data a reader will stream on every drive of the set this
    /// node reaches, then releases its lock on the drives: no
    /// writer anywhere removes that data until the returned lease is
    /// dropped. This process's own hold stays until `self` is dropped. On
    /// one node, or for data kept inline (read under the lock), there is
    /// nothing to do (`Store::pin_data` covers this process).
    pub(crate) async fn pin(
        &mut self,
        store: &Store,
        set: usize,
        data_ids: Vec<Id128>,
    ) -> Option<Lease> {
        if data_ids.is_empty() {
            return None;
        }
        // The lock is released only once the pins are in place, so no writer
        // retires the data in between. The pins have an owner of their own:
        // a late grant of the lock's owner on a drive asked last is released
        // when it comes, and must not take a pin with it.
        if self.leases.is_empty() {
            return None;
        }
        let lock = std::mem::take(&mut self.leases);
        let voters = store.voters(set);
        let owner = store.lock_owner();
        let mut pending: FuturesUnordered<_> = voters
            .iter()
            .map(|v| {
                let (v, data_ids) = (v.clone(), data_ids.clone());
                tokio::spawn(async move {
                    v.call(LeaseCall::Pin {
                        owner,
                        data_ids,
                        ttl_ms: LEASE_TTL_MS,
                    })
                    .await
                })
            })
            .collect();
        let quorum = store.meta_read_quorum(store.set_size(set));
        let mut answered = 0;
        while answered < quorum {
            if pending.next().await.is_none() {
                break;
            }
            answered += 1;
        }
        let _ = tokio::time::timeout(PIN_GRACE, async { while pending.next().await.is_some() {} })
            .await;
        drop(lock);
        Some(Lease::new(owner, voters))
    }
}

impl Store {
    /// A new lock owner id: this node and this start of it (so that a later
    /// start can end what this one held), then random bytes.
    pub(crate) fn lock_owner(&self) -> Id128 {
        let mut o = new_id();
        o[..8].copy_from_slice(&self.lock_holder[..8]);
        o
    }

    /// Once per start, tells every drive of another node this one reaches
    /// to end the holdings of this node's earlier starts: a node killed
    /// holding locks left them in its peers' lease tables until they lapsed
    /// (writes of those keys stalled up to 15 s after it came back).
    pub(crate) async fn tell_restart(&self) {
        if !self.distributed {
            return;
        }
        let topo = self.topo();
        for (i, slot) in topo.slots.iter().enumerate() {
            if slot.leases.is_some() || self.holder_told.lock().expect("holder told").contains(&i) {
                continue;
            }
            let Some(d) = slot.writer() else { continue };
            let call = LeaseCall::ReleaseEarlier {
                holder: self.lock_holder,
            };
            if d.lease(call).await.is_ok() {
                self.holder_told.lock().expect("holder told").insert(i);
            }
        }
    }

    /// The lease tables of a set's drives this node can reach now.
    fn voters(&self, set: usize) -> Vec<Voter> {
        (0..self.set_size(set))
            .filter_map(|p| {
                let slot = self.slot(set, p);
                match &slot.leases {
                    Some(t) => Some(Voter::Local(t.clone())),
                    None => slot.writer().map(Voter::Remote),
                }
            })
            .collect()
    }

    /// Holds a key to change it: its metadata, versions, uploads.
    pub(crate) async fn lock_write(&self, bucket: &str, key: &str) -> Result<KeyLock, StoreError> {
        let local = self.locks.write(bucket, key).await;
        let items = [
            (resource(self.hash_seed, bucket, key), LockMode::Write),
            (resource(self.hash_seed, bucket, ""), LockMode::Read),
        ];
        self.hold_key(local, (bucket, key), &items, |n| self.meta_write_quorum(n))
            .await
    }

    /// Holds a key to read its metadata and pin its data.
    pub(crate) async fn lock_read(&self, bucket: &str, key: &str) -> Result<KeyLock, StoreError> {
        let local = self.locks.read(bucket, key).await;
        let items = [(resource(self.hash_seed, bucket, key), LockMode::Read)];
        self.hold_key(local, (bucket, key), &items, |n| self.meta_read_quorum(n))
            .await
    }

    /// Adds the hold on the drives of the key's lock sets to this
    /// process's, in a cluster (`quorum` of a set's size).
    async fn hold_key(
        &self,
        local: KeyGuard,
        (bucket, key): (&str, &str),
        items: &[(u64, LockMode)],
        quorum: impl Fn(usize) -> usize,
    ) -> Result<KeyLock, StoreError> {
        let mut leases = Vec::new();
        if self.distributed {
            for set in self.lock_sets(bucket, key) {
                let q = quorum(self.set_size(set));
                leases.push(self.acquire(set, items.to_vec(), q).await?);
            }
        }
        Ok(KeyLock {
            _local: local,
            leases,
        })
    }

    /// Holds a bucket against every writer of its objects (to delete it).
    pub(crate) async fn lock_bucket(&self, name: &str) -> Result<BucketLock, StoreError> {
        let local = self.locks.write(name, "").await;
        let mut leases = Vec::new();
        if self.distributed {
            for set in self.live_sets() {
                let items = vec![(resource(self.hash_seed, name, ""), LockMode::Write)];
                let quorum = self.meta_write_quorum(self.set_size(set));
                leases.push(self.acquire(set, items, quorum).await?);
            }
        }
        Ok(BucketLock {
            _local: local,
            _leases: leases,
        })
    }

    /// Takes `items` on at least `quorum` of a set's drives, trying again
    /// while other holders are in the way.
    async fn acquire(
        &self,
        set: usize,
        items: Vec<(u64, LockMode)>,
        quorum: usize,
    ) -> Result<Lease, StoreError> {
        let deadline = Instant::now() + LOCK_WAIT;
        let mut backoff = Duration::from_millis(1);
        loop {
            let voters = self.voters(set);
            if voters.len() < quorum {
                return Err(StoreError::QuorumLost {
                    what: "lock",
                    needed: quorum,
                    available: voters.len(),
                });
            }
            let owner = self.lock_owner();
            // This node's drives first (no round trip), then the others from
            // a random place: a quorum is asked first, the rest only for a
            // voter that is busy, fails, or has not answered in time.
            let (mut order, mut others): (Vec<usize>, Vec<usize>) =
                (0..voters.len()).partition(|&i| matches!(voters[i], Voter::Local(_)));
            if !others.is_empty() {
                let at = owner[0] as usize % others.len();
                others.rotate_left(at);
            }
            order.extend(others);
            let launch = |i: usize| {
                let (v, items) = (voters[i].clone(), items.clone());
                tokio::spawn(async move {
                    let r = v
                        .call(LeaseCall::Acquire {
                            owner,
                            items,
                            ttl_ms: LEASE_TTL_MS,
                        })
                        .await;
                    (i, r)
                })
            };
            // What this try holds or may hold, released whatever happens
            // next, the caller giving up mid-way included (a request whose
            // client went away is dropped here: its grants stayed until they
            // lapsed, 15 s of every writer of the key waiting).
            let mut attempt = Attempt {
                owner,
                voters: voters.clone(),
                pending: FuturesUnordered::new(),
                granted: Vec::new(),
                unknown: Vec::new(),
            };
            let mut asked = 0;
            let hedge = tokio::time::sleep(LOCK_HEDGE);
            tokio::pin!(hedge);
            let (mut busy, mut failed) = (0, 0);
            while attempt.granted.len() < quorum && voters.len() - busy - failed >= quorum {
                while attempt.granted.len() + attempt.pending.len() < quorum && asked < order.len()
                {
                    attempt.pending.push(launch(order[asked]));
                    asked += 1;
                }
                tokio::select! {
                    r = attempt.pending.next() => match r {
                        Some(Ok((i, Ok(true)))) => attempt.granted.push(voters[i].clone()),
                        Some(Ok((_, Ok(false)))) => busy += 1,
                        Some(Ok((i, Err(_)))) => {
                            failed += 1;
                            attempt.unknown.push(voters[i].clone());
                        }
                        Some(Err(_)) => failed += 1,
                        None => break,
                    },
                    () = &mut hedge, if asked < order.len() => {
                        while asked < order.len() {
                            attempt.pending.push(launch(order[asked]));
                            asked += 1;
                        }
                    }
                }
            }
            if attempt.granted.len() >= quorum {
                let granted = std::mem::take(&mut attempt.granted);
                return Ok(Lease::new(owner, granted));
            }
            drop(attempt);
            if voters.len() - failed < quorum {
                return Err(StoreError::QuorumLost {
                    what: "lock",
                    needed: quorum,
                    available: voters.len() - failed,
                });
            }
            if Instant::now() + backoff > deadline {
                return Err(StoreError::SlowDown(
                    "the key is held by other writers; try again".into(),
                ));
            }
            let jitter = u64::from(new_id()[0]) * backoff.as_micros() as u64 / 255;
            tokio::time::sleep(backoff / 2 + Duration::from_micros(jitter / 2)).await;
            backoff = (backoff * 2).min(LOCK_BACKOFF_MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drive::DrivePaths;

    fn table() -> Arc<LeaseTable> {
        Arc::new(LeaseTable::new(DrivePaths {
            root: std::env::temp_dir(),
        }))
    }

    async fn acquire(t: &LeaseTable, owner: Id128) -> bool {
        t.call(LeaseCall::Acquire {
            owner,
            items: vec![(7, LockMode::Write)],
            ttl_ms: LEASE_TTL_MS,
        })
        .await
        .unwrap()
    }

    /// Whether another writer could take the key on `t` now (and leaves it
    /// free again).
    async fn free(t: &LeaseTable) -> bool {
        let owner = new_id();
        let got = acquire(t, owner).await;
        t.call(LeaseCall::Release { owner }).await.unwrap();
        got
    }

    /// A try dropped mid-way (its caller gone) leaves nothing held: the
    /// drives that granted it, and the one whose grant comes after.
    #[tokio::test]
    async fn a_try_given_up_mid_way_releases_what_it_got_and_what_comes_later() {
        let (a, b, c) = (table(), table(), table());
        let owner = new_id();
        assert!(acquire(&a, owner).await);
        // b's grant is still on its way when the try is dropped.
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let late = {
            let b = b.clone();
            tokio::spawn(async move {
                let _ = wait.await;
                (1, Ok(acquire(&b, owner).await))
            })
        };
        let attempt = Attempt {
            owner,
            voters: vec![
                Voter::Local(a.clone()),
                Voter::Local(b.clone()),
                Voter::Local(c.clone()),
            ],
            pending: [late].into_iter().collect(),
            granted: vec![Voter::Local(a.clone())],
            unknown: Vec::new(),
        };
        drop(attempt);
        go.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let (on_a, on_b) = (free(&a).await, free(&b).await);
            if on_a && on_b {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "still held after the try was dropped: a {on_a}, b {on_b}"
            );
        }
        assert!(free(&c).await);
    }

    /// An acquire whose answer was lost can reach its drive long after the
    /// try gave up (TCP sends it again once a cut link is back): its
    /// release goes on past a lease's lifetime, until the drive answers,
    /// and ends the holding the late acquire made.
    #[tokio::test]
    async fn a_lost_acquire_that_arrives_late_is_released_when_it_comes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let t = table();
        let up = Arc::new(AtomicBool::new(false));
        let owner = new_id();
        // Lifetimes scaled down: a lease of 200 ms; the link is down 1 s.
        let lease = Duration::from_millis(200);
        release_for(
            owner,
            Vec::new(),
            vec![Voter::Linked(t.clone(), up.clone())],
            lease,
            Duration::from_secs(10),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        // The link is back and the acquire, sent before the cut, arrives
        // first: granted (the release has not come yet).
        up.store(true, Ordering::SeqCst);
        assert!(acquire(&t, owner).await);
        let deadline = Instant::now() + Duration::from_secs(2);
        while !free(&t).await {
            assert!(
                Instant::now() < deadline,
                "the late acquire's holding stayed: its release gave up"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A granted voter is asked for a lease's lifetime only (its holding
        // lapses by itself after that).
        let (t2, down) = (table(), Arc::new(AtomicBool::new(false)));
        let other = new_id();
        assert!(acquire(&t2, other).await);
        release_for(
            other,
            vec![Voter::Linked(t2.clone(), down.clone())],
            Vec::new(),
            lease,
            Duration::from_secs(10),
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
        down.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            !free(&t2).await,
            "a granted voter is not asked past the lease's lifetime"
        );
    }
}
