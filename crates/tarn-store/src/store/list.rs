//! Listing: a merge of the drives' ordered metadata indexes, never a directory
//! walk. Each round scans a bounded batch of keys from every online drive; keys
//! up to the smallest last key of any full batch are complete and can be emitted.

use std::sync::Arc;

use tarn_io::file::run_blocking;

use super::{resolve, version_to_string, Store};
use crate::drive::DriveDb;
use crate::drive_io::Drive;
use crate::error::StoreError;
use crate::format::ObjectRecord;
use crate::types::{ListPage, ListParams, VersionListPage, VersionListParams};

/// Most keys one list response may return (S3's limit).
pub const LIST_KEYS_MAX: usize = 1000;

/// What the walker should do after a key.
pub(crate) enum Step {
    Next,
    /// Skip every key starting with this string (a common prefix was emitted).
    SkipPrefix(String),
    Stop,
}

/// Where a scan resumes.
enum Cursor {
    Start,
    After(String),
    PastPrefix(String),
}

impl Cursor {
    fn lower_bound(&self) -> Option<Vec<u8>> {
        match self {
            Cursor::Start => None,
            Cursor::After(k) => {
                let mut b = k.as_bytes().to_vec();
                b.push(0);
                Some(b)
            }
            // No UTF-8 string contains 0xFF, so prefix+0xFF sorts after every key
            // with that prefix and before the next key without it.
            Cursor::PastPrefix(p) => {
                let mut b = p.as_bytes().to_vec();
                b.push(0xff);
                Some(b)
            }
        }
    }
}

/// The records of one key as read from each drive of its set.
type DriveRecords = Vec<Result<Option<ObjectRecord>, StoreError>>;

struct SetDrives {
    dbs: Vec<Arc<dyn Drive>>,
    quorum: usize,
    /// Drives in the set, those not listed from included.
    size: usize,
}

/// Entries a drive of another node sends per page: a listing page's worth
/// (S3's 1000 keys) in one call. A re-seek past a common prefix starts small
/// and doubles, so skipping prefixes does not fetch pages only to drop them.
const REMOTE_PAGE_MAX: usize = 1024;
const REMOTE_PAGE_FIRST: usize = 16;

/// Where a drive's entries come from.
enum Source {
    /// This node's drive: a lazy cursor over its index (the walk runs on a
    /// blocking thread).
    Local {
        db: Arc<DriveDb>,
        cursor: crate::drive::ObjectCursor,
    },
    /// Another node's: pages fetched over RPC.
    Remote {
        drive: Arc<dyn Drive>,
        page: std::collections::VecDeque<(String, Vec<u8>)>,
        /// Where the next page starts (inclusive); None when there is none.
        from: Option<Option<Vec<u8>>>,
        size: usize,
    },
}

/// One drive's entries and its next one.
struct Head {
    set: usize,
    source: Source,
    next: Option<(String, Vec<u8>)>,
    /// The drive failed during the walk and contributes nothing more.
    failed: bool,
}

impl Head {
    fn new(
        set: usize,
        drive: &Arc<dyn Drive>,
        bucket: &str,
        prefix: &str,
        from: Option<&[u8]>,
    ) -> Head {
        let source = match drive.as_local() {
            Some(l) => Source::Local {
                db: l.db.clone(),
                cursor: l.db.object_cursor(bucket, prefix, from),
            },
            None => Source::Remote {
                drive: drive.clone(),
                page: Default::default(),
                from: Some(from.map(<[u8]>::to_vec)),
                size: REMOTE_PAGE_MAX,
            },
        };
        Head {
            set,
            source,
            next: None,
            failed: false,
        }
    }

    /// Advances; a drive that fails (a node paused, killed or cut off) is
    /// dropped from the walk like a drive that does not answer a metadata
    /// read, as long as its set keeps a read quorum of drives that answer.
    async fn step(
        &mut self,
        bucket: &str,
        prefix: &str,
        alive: &mut [usize],
        sets: &[SetDrives],
    ) -> Result<(), StoreError> {
        if self.failed {
            return Ok(());
        }
        let Err(e) = self.advance(bucket, prefix).await else {
            return Ok(());
        };
        self.failed = true;
        self.next = None;
        alive[self.set] -= 1;
        let set = &sets[self.set];
        if alive[self.set] < set.quorum {
            return Err(StoreError::QuorumLost {
                what: "listing",
                needed: set.quorum,
                available: alive[self.set],
            });
        }
        let drive = match &self.source {
            Source::Local { .. } => "local",
            Source::Remote { drive, .. } => drive.name(),
        };
        tracing::warn!(set = self.set, drive, error = %e, "drive failed during a listing; listing from the others");
        Ok(())
    }

    /// Starts again at key bytes `from`.
    fn seek(&mut self, bucket: &str, prefix: &str, from: Option<&[u8]>) {
        match &mut self.source {
            Source::Local { db, cursor } => *cursor = db.object_cursor(bucket, prefix, from),
            Source::Remote {
                page,
                from: next,
                size,
                ..
            } => {
                page.clear();
                *next = Some(from.map(<[u8]>::to_vec));
                *size = REMOTE_PAGE_FIRST;
            }
        }
    }

    async fn advance(&mut self, bucket: &str, prefix: &str) -> Result<(), StoreError> {
        self.next = match &mut self.source {
            Source::Local { cursor, .. } => cursor.next().transpose()?,
            Source::Remote {
                drive,
                page,
                from,
                size,
            } => {
                if page.is_empty() {
                    if let Some(start) = from.take() {
                        // Called on the runtime, where its connections live;
                        // this walk runs on a blocking thread.
                        let (d, b, p, limit) =
                            (drive.clone(), bucket.to_string(), prefix.to_string(), *size);
                        let got = tokio::runtime::Handle::current()
                            .spawn(async move { d.list_page(b, p, start, limit).await })
                            .await
                            .map_err(|e| StoreError::from(std::io::Error::other(e)))??;
                        if got.len() == *size {
                            let mut after = got.last().expect("full page").0.as_bytes().to_vec();
                            after.push(0);
                            *from = Some(Some(after));
                        }
                        *size = (*size * 2).min(REMOTE_PAGE_MAX);
                        page.extend(got);
                    }
                }
                page.pop_front()
            }
        };
        Ok(())
    }
}

/// The record of a key whose drives disagreed during a walk, read again as
/// a GET reads it: every drive of its set at once, under the key's read lock.
/// The walk reads each drive at its own moment, so writes committed between
/// those moments can leave no version on a read quorum of what it saw (with
/// a drive out, two overwrites during a listing are enough).
async fn reread(store: &Arc<Store>, bucket: &str, key: &str) -> Result<ObjectRecord, StoreError> {
    let (store, bucket, key) = (store.clone(), bucket.to_string(), key.to_string());
    // Called on the runtime, where the connections and lock leases live.
    tokio::runtime::Handle::current()
        .spawn(async move {
            let _g = store.lock_read(&bucket, &key).await?;
            let loc = store.locate(&bucket, &key).await?;
            if loc.diverged {
                store.queue_heal(&bucket, &key);
            }
            Ok(loc.rec)
        })
        .await
        .map_err(|e| StoreError::from(std::io::Error::other(e)))?
}

/// Visits the resolved records of `bucket` with keys starting with `prefix`
/// after `start`, in key order: a k-way merge of one lazy cursor per online
/// drive. Skipping a common prefix re-seeks only the cursors inside it, so a
/// page costs O(page × drives) reads whatever the bucket holds. A key whose
/// drives do not all hold the same record (a write under way, or a drive
/// behind) is read again under its lock (`reread`). Runs on a blocking
/// thread (`futures::executor::block_on`).
async fn walk(
    store: &Arc<Store>,
    sets: &[SetDrives],
    bucket: &str,
    prefix: &str,
    start: Option<String>,
    delimiter: Option<&str>,
    mut visit: impl FnMut(&str, ObjectRecord) -> Step,
) -> Result<(), StoreError> {
    let cursor = match start {
        // A marker that is itself a common prefix (a previous page ended on it)
        // resumes after every key under it, or the prefix would repeat forever.
        Some(s)
            if s.as_str() >= prefix
                && s.starts_with(prefix)
                && delimiter.is_some_and(|d| !d.is_empty() && s[prefix.len()..].ends_with(d)) =>
        {
            Cursor::PastPrefix(s)
        }
        Some(s) if s.as_str() >= prefix => Cursor::After(s),
        _ => Cursor::Start,
    };
    let lower = cursor.lower_bound();
    let mut heads = Vec::new();
    let mut alive: Vec<usize> = sets.iter().map(|s| s.dbs.len()).collect();
    for (s, set) in sets.iter().enumerate() {
        for db in &set.dbs {
            let mut h = Head::new(s, db, bucket, prefix, lower.as_deref());
            h.step(bucket, prefix, &mut alive, sets).await?;
            heads.push(h);
        }
    }
    loop {
        let Some(key) = heads
            .iter()
            .filter_map(|h| h.next.as_ref().map(|(k, _)| k))
            .min()
            .cloned()
        else {
            return Ok(());
        };
        // The drives' records per set: a key in several pools (a move
        // between them under way) is resolved in each, the newest wins.
        let mut by_set: Vec<(usize, DriveRecords)> = Vec::new();
        // Drives still walked per set: all must hold the same record.
        let mut walked = vec![0usize; sets.len()];
        for h in heads.iter().filter(|h| !h.failed) {
            walked[h.set] += 1;
        }
        for h in heads.iter_mut() {
            if h.next.as_ref().is_some_and(|(k, _)| *k == key) {
                let (_, raw) = h.next.take().expect("peeked");
                let recs = match by_set.iter().position(|(s, _)| *s == h.set) {
                    Some(i) => &mut by_set[i].1,
                    None => {
                        by_set.push((h.set, Vec::new()));
                        &mut by_set.last_mut().expect("pushed").1
                    }
                };
                recs.push(ObjectRecord::decode(&raw).map(Some).map_err(|e| {
                    StoreError::CorruptMetadata {
                        drive: String::new(),
                        what: e.to_string(),
                    }
                }));
                h.step(bucket, prefix, &mut alive, sets).await?;
            }
        }
        let agreed = by_set.iter().all(|(s, recs)| {
            recs.len() == walked[*s]
                && recs
                    .iter()
                    .all(|r| matches!((r, &recs[0]), (Ok(a), Ok(b)) if a == b))
        });
        // Drives walked agree, and enough of them to settle it: their
        // record. Otherwise the key is read again as a GET reads it.
        let settled: Option<Vec<ObjectRecord>> = match agreed {
            true => by_set
                .iter()
                .map(|(s, recs)| resolve(recs, sets[*s].size).ok())
                .collect(),
            false => None,
        };
        let rec = match settled {
            Some(recs) => recs
                .into_iter()
                .max_by_key(super::pools::newest)
                .unwrap_or_default(),
            None => reread(store, bucket, &key).await?,
        };
        match visit(&key, rec) {
            Step::Next => {}
            Step::Stop => return Ok(()),
            Step::SkipPrefix(p) => {
                let past = Cursor::PastPrefix(p.clone()).lower_bound();
                for h in heads.iter_mut() {
                    if h.next
                        .as_ref()
                        .is_some_and(|(k, _)| k.starts_with(p.as_str()))
                    {
                        h.seek(bucket, prefix, past.as_deref());
                        h.step(bucket, prefix, &mut alive, sets).await?;
                    }
                }
            }
        }
    }
}

/// If `key` (under `prefix`) rolls up into a common prefix, returns it.
fn common_prefix(key: &str, prefix: &str, delimiter: Option<&str>) -> Option<String> {
    let d = delimiter.filter(|d| !d.is_empty())?;
    let rest = &key[prefix.len()..];
    rest.find(d)
        .map(|pos| format!("{prefix}{}", &rest[..pos + d.len()]))
}

impl Store {
    /// Every set's drives to list from; none for a retired pool's.
    fn set_drives(&self) -> Vec<SetDrives> {
        let live = self.live_sets();
        (0..self.set_count())
            .map(|s| match live.contains(&s) {
                true => SetDrives {
                    dbs: (0..self.set_size(s))
                        .filter_map(|p| self.slot(s, p).db())
                        .collect(),
                    quorum: self.meta_read_quorum(self.set_size(s)),
                    size: self.set_size(s),
                },
                false => SetDrives {
                    dbs: Vec::new(),
                    quorum: 0,
                    size: self.set_size(s),
                },
            })
            .collect()
    }

    fn check_list_quorum(&self, sets: &[SetDrives]) -> Result<(), StoreError> {
        for s in sets {
            if s.dbs.len() < s.quorum {
                return Err(StoreError::QuorumLost {
                    what: "listing",
                    needed: s.quorum,
                    available: s.dbs.len(),
                });
            }
        }
        Ok(())
    }

    /// ListObjects (V1 and V2): latest versions that are not delete markers.
    pub async fn list_objects(
        self: &Arc<Self>,
        bucket: &str,
        p: ListParams,
    ) -> Result<ListPage, StoreError> {
        self.bucket_record(bucket)?;
        let sets = self.set_drives();
        self.check_list_quorum(&sets)?;
        let max = p.max_keys.min(LIST_KEYS_MAX);
        let store = self.clone();
        let bucket = bucket.to_string();
        let result = run_blocking(move || {
            let mut page = ListPage::default();
            if max == 0 {
                return Ok(Ok(page));
            }
            let res = futures::executor::block_on(walk(
                &store,
                &sets,
                &bucket,
                &p.prefix,
                p.after.clone(),
                p.delimiter.as_deref(),
                |key, rec| {
                    let Some(latest) = rec.versions.first() else {
                        return Step::Next;
                    };
                    if latest.delete_marker {
                        return Step::Next;
                    }
                    let cp = common_prefix(key, &p.prefix, p.delimiter.as_deref());
                    if page.objects.len() + page.common_prefixes.len() >= max {
                        page.is_truncated = true;
                        return Step::Stop;
                    }
                    match cp {
                        Some(cp) => {
                            page.common_prefixes.push(cp.clone());
                            page.next_after = Some(cp.clone());
                            Step::SkipPrefix(cp)
                        }
                        None => {
                            page.objects
                                .push(store.info_from(&bucket, key, latest, true));
                            page.next_after = Some(key.to_string());
                            Step::Next
                        }
                    }
                },
            ));
            Ok(res.map(|_| page))
        })
        .await??;
        Ok(result)
    }

    /// ListObjectVersions: every version and delete marker, newest first per key.
    pub async fn list_object_versions(
        self: &Arc<Self>,
        bucket: &str,
        p: VersionListParams,
    ) -> Result<VersionListPage, StoreError> {
        self.bucket_record(bucket)?;
        let sets = self.set_drives();
        self.check_list_quorum(&sets)?;
        let max = p.max_keys.min(LIST_KEYS_MAX);
        let store = self.clone();
        let bucket = bucket.to_string();
        let result = run_blocking(move || {
            let mut page = VersionListPage::default();
            if max == 0 {
                return Ok(Ok(page));
            }
            // Resume inside the marker key when a version-id marker is given.
            let (start, resume_in) = match (&p.key_marker, &p.version_id_marker) {
                (Some(k), Some(v)) if !v.is_empty() => {
                    let before = k.as_bytes().to_vec();
                    // Start at the marker key itself: scan from the largest key below it.
                    (predecessor(&before), Some((k.clone(), v.clone())))
                }
                (Some(k), _) => (Some(k.clone()), None),
                _ => (None, None),
            };
            let mut emitted = 0usize;
            let res = futures::executor::block_on(walk(
                &store,
                &sets,
                &bucket,
                &p.prefix,
                start,
                p.delimiter.as_deref(),
                |key, rec| {
                    if rec.versions.is_empty() {
                        return Step::Next;
                    }
                    if let Some(cp) = common_prefix(key, &p.prefix, p.delimiter.as_deref()) {
                        if emitted >= max {
                            page.is_truncated = true;
                            return Step::Stop;
                        }
                        emitted += 1;
                        page.common_prefixes.push(cp.clone());
                        page.next_key_marker = Some(cp.clone());
                        page.next_version_id_marker = None;
                        return Step::SkipPrefix(cp);
                    }
                    let mut versions = rec.versions.iter().enumerate().peekable();
                    if let Some((mk, mv)) = &resume_in {
                        if key < mk.as_str() {
                            return Step::Next;
                        }
                        if key == mk.as_str() {
                            // Skip up to and including the marker version.
                            // A marker version deleted since (a client that
                            // deletes each page before asking for the next)
                            // leaves no position to resume from: version ids
                            // are random, so which of the key's versions came
                            // after it is unknown. Every version the key still
                            // has is listed then: what the page before
                            // showed may show again, but nothing older is
                            // skipped (it was, and DeleteBucket then failed).
                            let pos = rec.versions.iter().position(|v| {
                                version_to_string(&v.version_id)
                                    .as_deref()
                                    .unwrap_or("null")
                                    == mv
                            });
                            if let Some(pos) = pos {
                                for _ in 0..=pos {
                                    versions.next();
                                }
                            }
                        }
                    }
                    for (i, v) in versions {
                        if emitted >= max {
                            page.is_truncated = true;
                            return Step::Stop;
                        }
                        emitted += 1;
                        page.versions.push(store.info_from(&bucket, key, v, i == 0));
                        page.next_key_marker = Some(key.to_string());
                        page.next_version_id_marker =
                            Some(version_to_string(&v.version_id).unwrap_or_else(|| "null".into()));
                    }
                    Step::Next
                },
            ));
            Ok(res.map(|_| page))
        })
        .await??;
        Ok(result)
    }
}

/// A string that sorts just before `key` for the purpose of resuming at `key`:
/// the key without its last character is before it, and no key between them
/// can exist that is not also a prefix-extension we would visit anyway.
fn predecessor(key: &[u8]) -> Option<String> {
    if key.is_empty() {
        return None;
    }
    let s = String::from_utf8_lossy(key).to_string();
    let mut chars: Vec<char> = s.chars().collect();
    chars.pop();
    if chars.is_empty() {
        None
    } else {
        // Keys between `chars` and `key` are visited and skipped by the callback
        // (it ignores keys below the marker).
        Some(chars.into_iter().collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefixes() {
        assert_eq!(common_prefix("a/b/c", "", Some("/")), Some("a/".into()));
        assert_eq!(common_prefix("a/b/c", "a/", Some("/")), Some("a/b/".into()));
        assert_eq!(common_prefix("a/b", "a/", Some("/")), None);
        assert_eq!(common_prefix("a/b", "", None), None);
        assert_eq!(common_prefix("a--b--c", "", Some("--")), Some("a--".into()));
    }

    #[test]
    fn past_prefix_bound_is_after_all_extensions() {
        let b = Cursor::PastPrefix("a/".into()).lower_bound().unwrap();
        assert!(b.as_slice() > "a/\u{10FFFF}zzz".as_bytes());
        assert!(b.as_slice() < "a0".as_bytes());
    }
}
