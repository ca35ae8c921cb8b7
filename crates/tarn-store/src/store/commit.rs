//! The commit point of a new version, shared by the writers of one key
//! (group commit).
//!
//! A writer whose body is stored queues its new version on the key and
//! waits for its answer. One committer task per key with writers queued
//! takes the key's write lock, then every queued version it can commit
//! together, applies them to the key's resolved record in the order they
//! queued (each one's conditions checked against the record as the ones
//! before it left it; a null version replaced by the next is superseded
//! at once, its bytes never written), writes the result durably on the
//! set's drives once and answers them all. Writers that come meanwhile
//! queue for the next round. A key written by many clients at once so
//! costs one durable write per round, where each writer used to wait for
//! the lock through every earlier writer's own durable write (a convoy
//! that held 4 KiB PUTs at concurrency 64 for 100 ms and more).
//!
//! Queued writers are concurrent (none has been answered), so committing
//! them in one write, in any order, is an order a client could see; a
//! writer answered before another one queued is committed before it. The
//! committer is a task of its own: a writer whose request is dropped does
//! not take other writers' commits down with it (its own version, once
//! queued, commits; its data is kept from the orphan sweep until then).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use futures::channel::oneshot;

use super::{data_ids_of, inline_keys_of, InflightData, Store, NULL_VERSION};
use crate::drive::ObjectWrite;
use crate::error::StoreError;
use crate::format::{Id128, VersionMeta};
use crate::store::put::etag_matches;
use crate::types::{ObjectInfo, PutOptions};

/// A version to commit, with what its writer asked of the commit.
pub(crate) struct NewVersion {
    /// The set its data was written to.
    pub set: usize,
    pub meta: VersionMeta,
    pub inline: Option<Vec<u8>>,
    pub if_match: Option<String>,
    pub if_none_match: Option<String>,
    /// CompleteMultipartUpload: the upload's records, removed in the same
    /// write. Such a version is committed alone.
    pub upload_delete: Option<(Id128, Vec<u32>)>,
    /// Keeps the orphan sweep off the version's data until it is committed.
    pub inflight: Option<InflightData>,
}

impl NewVersion {
    pub(crate) fn new(
        set: usize,
        meta: VersionMeta,
        inline: Option<Vec<u8>>,
        opts: &PutOptions,
    ) -> NewVersion {
        NewVersion {
            set,
            meta,
            inline,
            if_match: opts.if_match.clone(),
            if_none_match: opts.if_none_match.clone(),
            upload_delete: None,
            inflight: None,
        }
    }

    /// Whether this version can be committed in one write with `first`:
    /// the same set, both null versions or both not, no upload to remove.
    fn joins(&self, first: &NewVersion) -> bool {
        self.upload_delete.is_none()
            && first.upload_delete.is_none()
            && self.set == first.set
            && (self.meta.version_id == NULL_VERSION) == (first.meta.version_id == NULL_VERSION)
    }
}

type Answer = Result<ObjectInfo, StoreError>;

struct Queued {
    version: NewVersion,
    answer: oneshot::Sender<Answer>,
}

/// The versions waiting for their key's committer, by bucket and key; a
/// key is here exactly while its committer runs.
#[derive(Default)]
pub(crate) struct CommitQueues(Mutex<HashMap<(String, String), VecDeque<Queued>>>);

impl CommitQueues {
    /// Queues a version; true when the key has no committer yet.
    fn push(&self, bucket: &str, key: &str, q: Queued) -> bool {
        let mut map = self.0.lock().expect("commit queues");
        match map.entry((bucket.to_string(), key.to_string())) {
            Entry::Occupied(mut e) => {
                e.get_mut().push_back(q);
                false
            }
            Entry::Vacant(e) => {
                e.insert(VecDeque::from([q]));
                true
            }
        }
    }

    /// The first queued version and every later one that joins it, in
    /// queue order; the others stay queued in theirs.
    fn take_round(&self, k: &(String, String)) -> Vec<Queued> {
        let mut map = self.0.lock().expect("commit queues");
        let Some(queue) = map.get_mut(k) else {
            return Vec::new();
        };
        let Some(first) = queue.pop_front() else {
            return Vec::new();
        };
        let mut round = vec![first];
        let mut rest = VecDeque::new();
        while let Some(q) = queue.pop_front() {
            if q.version.joins(&round[0].version) {
                round.push(q);
            } else {
                rest.push_back(q);
            }
        }
        *queue = rest;
        round
    }

    /// Ends the key's committer if nothing is queued; false otherwise.
    fn finish(&self, k: &(String, String)) -> bool {
        let mut map = self.0.lock().expect("commit queues");
        if map.get(k).is_some_and(|q| !q.is_empty()) {
            return false;
        }
        map.remove(k);
        true
    }
}

/// Removes the key's queue if its committer ends other than by `finish`
/// (a panic, or the runtime shutting down): the writers still queued get
/// an error instead of waiting for ever, and the next writer starts a
/// committer again.
struct CommitterGuard<'a> {
    queues: &'a CommitQueues,
    key: (String, String),
    finished: bool,
}

impl Drop for CommitterGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            if let Ok(mut map) = self.queues.0.lock() {
                map.remove(&self.key);
            }
        }
    }
}

/// What a committed round answers and leaves to remove.
struct RoundDone {
    answers: Vec<Answer>,
    /// Data of the versions the round superseded: those the record held
    /// and those of the round replaced within it.
    retired: Vec<Id128>,
}

impl Store {
    /// The commit point of a new version: merged into the key's resolved
    /// record under its write lock and written to a quorum of the set's
    /// drives, with the other versions of the key waiting then. Superseded
    /// data is removed after the commit succeeded, before the answer.
    pub(crate) async fn commit_version(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: NewVersion,
    ) -> Result<ObjectInfo, StoreError> {
        let (answer, rx) = oneshot::channel();
        if self.commits.push(bucket, key, Queued { version, answer }) {
            let store = self.clone();
            let (b, k) = (bucket.to_string(), key.to_string());
            tokio::spawn(async move { store.run_commits(b, k).await });
        }
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::SlowDown(format!(
                "the commit of {bucket}/{key} was interrupted; retry it"
            )))
        })
    }

    /// The committer of a key: rounds until nothing is queued.
    async fn run_commits(self: Arc<Self>, bucket: String, key: String) {
        let mut guard = CommitterGuard {
            queues: &self.commits,
            key: (bucket.clone(), key.clone()),
            finished: false,
        };
        loop {
            let lock = self.lock_write(&bucket, &key).await;
            // Taken once the lock is held: every writer that came while
            // the last round wrote is in this one.
            let round = self.commits.take_round(&guard.key);
            let (versions, answers): (Vec<NewVersion>, Vec<_>) =
                round.into_iter().map(|q| (q.version, q.answer)).unzip();
            let set = versions.first().map(|v| v.set).unwrap_or(0);
            let done = match lock {
                Ok(lock) => {
                    let done = self.commit_round(&bucket, &key, versions).await;
                    drop(lock);
                    done
                }
                Err(e) => Err(e),
            };
            match done {
                Err(e) => {
                    for a in answers {
                        let _ = a.send(Err(e.clone()));
                    }
                }
                Ok(RoundDone {
                    answers: results,
                    retired,
                }) => {
                    let answer = move || {
                        for (a, r) in answers.into_iter().zip(results) {
                            let _ = a.send(r);
                        }
                    };
                    if retired.is_empty() {
                        answer();
                    } else {
                        // The superseded data is no record's any more: its
                        // files go with the key free for the next round
                        // (readers that found an old version before the
                        // commit hold pins the removal respects).
                        let store = self.clone();
                        tokio::spawn(async move {
                            store.retire_data(set, retired).await;
                            answer();
                        });
                    }
                }
            }
            if self.commits.finish(&guard.key) {
                guard.finished = true;
                return;
            }
        }
    }

    /// Applies a round's versions, in order, to the key's record and writes
    /// it once; under the key's write lock.
    async fn commit_round(
        &self,
        bucket: &str,
        key: &str,
        mut versions: Vec<NewVersion>,
    ) -> Result<RoundDone, StoreError> {
        let Some(first) = versions.first_mut() else {
            return Ok(RoundDone {
                answers: Vec::new(),
                retired: Vec::new(),
            });
        };
        let set = first.set;
        let upload_delete = first.upload_delete.take();
        let replaces_null = first.meta.version_id == NULL_VERSION;
        // The bucket may have been deleted while the bodies streamed.
        self.bucket_record(bucket)?;
        let loc = self.locate(bucket, key).await?;
        let after = loc
            .rec
            .versions
            .iter()
            .map(|v| v.mod_time_ns)
            .max()
            .unwrap_or(0);
        let (mut rec, stale) = Store::commit_record(set, loc, replaces_null, (bucket, key))?;
        let mut after = rec
            .versions
            .iter()
            .map(|v| v.mod_time_ns)
            .fold(after, u64::max);
        let mut answers = Vec::with_capacity(versions.len());
        // Versions the record held that this round supersedes, and those
        // of the round superseded within it (their bytes never written).
        let mut superseded: Vec<VersionMeta> = Vec::new();
        let mut replaced: Vec<VersionMeta> = Vec::new();
        let mut inline_put: Vec<(Id128, u64, Vec<u8>)> = Vec::new();
        // The versions this round put into the record.
        let mut ours: Vec<(Id128, u64)> = Vec::new();
        for v in &mut versions {
            let current = rec.versions.first().filter(|v| !v.delete_marker);
            if let Some(none) = &v.if_none_match {
                if current.is_some_and(|c| etag_matches(none, &c.etag)) {
                    answers.push(Err(StoreError::PreconditionFailed("If-None-Match")));
                    continue;
                }
            }
            if let Some(want) = &v.if_match {
                // As S3: If-Match on a key with no current version is
                // NoSuchKey, not a failed condition.
                let Some(c) = current else {
                    answers.push(Err(StoreError::NoSuchKey {
                        bucket: bucket.to_string(),
                        key: key.to_string(),
                    }));
                    continue;
                };
                if !etag_matches(want, &c.etag) {
                    answers.push(Err(StoreError::PreconditionFailed("If-Match")));
                    continue;
                }
            }
            if v.meta.version_id == NULL_VERSION {
                // A locked null version is never replaced (object lock).
                let locked = rec
                    .versions
                    .iter()
                    .find(|o| o.version_id == NULL_VERSION)
                    .and_then(|o| o.locked(super::now_ns(), false));
                if let Some(why) = locked {
                    answers.push(Err(StoreError::ObjectLocked(why.to_string())));
                    continue;
                }
            }
            let mut meta = v.meta.clone();
            meta.mod_time_ns = self.next_mod_time(after);
            after = meta.mod_time_ns;
            if meta.version_id == NULL_VERSION {
                if let Some(pos) = rec
                    .versions
                    .iter()
                    .position(|v| v.version_id == NULL_VERSION)
                {
                    let old = rec.versions.remove(pos);
                    let key_of = (old.version_id, old.mod_time_ns);
                    if ours.contains(&key_of) {
                        inline_put.retain(|(id, t, _)| (*id, *t) != key_of);
                        replaced.push(old);
                    } else {
                        superseded.push(old);
                    }
                }
            }
            if let Some(data) = v.inline.take() {
                inline_put.push((meta.version_id, meta.mod_time_ns, data));
            }
            answers.push(Ok(self.info_from(bucket, key, &meta, true)));
            ours.push((meta.version_id, meta.mod_time_ns));
            rec.versions.insert(0, meta);
        }
        if ours.is_empty() {
            // Every condition failed: nothing to write.
            return Ok(RoundDone {
                answers,
                retired: Vec::new(),
            });
        }
        let w = ObjectWrite {
            record: Some(rec),
            inline_put,
            inline_delete: inline_keys_of(&superseded),
            upload_delete,
            missed: Vec::new(),
        };
        self.write_object_everywhere(set, bucket, key, w).await?;
        self.stats.commit_rounds.fetch_add(1, Ordering::Relaxed);
        self.stats
            .commit_versions
            .fetch_add(ours.len() as u64, Ordering::Relaxed);
        for (s, r) in stale {
            self.remove_stale(s, bucket, key, r).await;
        }
        // The round's data is referenced or retired from here on.
        drop(versions);
        superseded.append(&mut replaced);
        Ok(RoundDone {
            answers,
            retired: data_ids_of(&superseded),
        })
    }
}
