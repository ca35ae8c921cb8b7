//! Backfill: a drive of this node that joined a set holding data (it took
//! a replaced node's place, came back wiped, or had its index set aside) is
//! filled from the other drives of its set before it serves reads.
//!
//! Set by set, bucket by bucket in key order, each object is healed onto the
//! joining drives (their shards rebuilt from k others; metadata on every
//! drive), a few at a time and under the configured rate (`heal_rate_bytes`),
//! so client requests keep the drives' bandwidth. The position reached is
//! checkpointed in the drive's rebuild marker every second, so a restart of
//! this node resumes there; a failure (a peer away) holds the checkpoint
//! where it was, and the job is tried again. When the fill is through, a
//! verifying scan visits every object again; only a scan that found nothing
//! to repair ends the rebuild, and the drives serve reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::stream::{self, StreamExt};
use tarn_io::file::run_blocking;

use super::Store;
use crate::drive::{self, BackfillCheckpoint};
use crate::error::StoreError;
use crate::types::HealReport;

/// How often the position reached is saved.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// Verifying scans after a fill before the job gives up for this round.
const VERIFY_ROUNDS: usize = 3;

/// A backfill under way on this node, as `cluster status` and `/metrics`
/// show it.
#[derive(Debug, Clone)]
pub struct BackfillStatus {
    /// The drives being filled and their sets.
    pub drives: Vec<String>,
    pub sets: Vec<usize>,
    /// "fill", then "verify".
    pub phase: &'static str,
    /// Objects of the sets (counted when the phase began) and visited.
    pub objects_total: u64,
    pub objects_done: u64,
    /// Bytes of the objects visited.
    pub bytes_done: u64,
    /// Objects this phase had to repair (a verifying scan that ends the
    /// rebuild found none).
    pub repaired: u64,
    pub failures: u64,
    /// Where the job resumed from after a restart, if it did.
    pub resumed_from: Option<Resumed>,
    pub started: Instant,
    /// When the current phase began, and its byte count then.
    pub phase_started: Instant,
    /// The configured limit, bytes per second (0: none).
    pub rate_limit: u64,
}

/// Where a restarted backfill picked up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resumed {
    /// A set's fill, after this (bucket, key).
    Fill { bucket: String, key: String },
    /// No set had a fill position saved, one had filled: its verifying
    /// scan (a set with no checkpoint starts over).
    Verify,
}

impl BackfillStatus {
    /// Bytes per second over the current phase.
    pub fn rate(&self) -> f64 {
        let s = self.phase_started.elapsed().as_secs_f64();
        if s > 0.0 {
            self.bytes_done as f64 / s
        } else {
            0.0
        }
    }

    /// Seconds left in the current phase at its rate so far, once it has
    /// one.
    pub fn eta_secs(&self) -> Option<f64> {
        let s = self.phase_started.elapsed().as_secs_f64();
        if self.objects_done == 0 || s <= 0.0 {
            return None;
        }
        let left = self.objects_total.saturating_sub(self.objects_done) as f64;
        Some(left * s / self.objects_done as f64)
    }
}

/// Adds a pass's counts to the job's.
fn add(report: &mut HealReport, r: &HealReport) {
    report.objects_scanned += r.objects_scanned;
    report.objects_healed += r.objects_healed;
    report.shards_rebuilt += r.shards_rebuilt;
    report.metadata_rewritten += r.metadata_rewritten;
    report.bytes_scanned += r.bytes_scanned;
    report.failures += r.failures;
}

/// One drive being filled: its slot, rebuild number and directory.
struct Target {
    slot: usize,
    rebuild: u64,
    position: usize,
    root: PathBuf,
}

impl Store {
    /// The backfill running on this node, if one is.
    pub fn backfill_status(&self) -> Option<BackfillStatus> {
        self.backfill.lock().expect("backfill").clone()
    }

    fn progress(&self, f: impl FnOnce(&mut BackfillStatus)) {
        if let Some(p) = self.backfill.lock().expect("backfill").as_mut() {
            f(p);
        }
    }

    /// Fills this node's drives that rebuild in full, set by set, and ends
    /// each set's rebuild once a verifying scan finds nothing to repair.
    pub(crate) async fn backfill(&self) -> HealReport {
        let mut report = HealReport::default();
        let topo = self.topo();
        let mut by_set: BTreeMap<usize, Vec<Target>> = BTreeMap::new();
        for (i, slot) in topo.slots.iter().enumerate() {
            if slot.is_remote() || !slot.online() {
                continue;
            }
            let Some(rebuild) = slot.rebuilding_full() else {
                continue;
            };
            let (sources, needed) = self.heal_sources(i);
            if sources < needed {
                continue;
            }
            let set = slot.set_index;
            let position = topo.sets[set]
                .iter()
                .position(|&d| d == i)
                .expect("a drive is in its set");
            by_set.entry(set).or_default().push(Target {
                slot: i,
                rebuild,
                position,
                root: slot.paths.root.clone(),
            });
        }
        if by_set.is_empty() {
            return report;
        }
        let now = Instant::now();
        *self.backfill.lock().expect("backfill") = Some(BackfillStatus {
            drives: by_set
                .values()
                .flatten()
                .map(|t| topo.slots[t.slot].name.clone())
                .collect(),
            sets: by_set.keys().copied().collect(),
            phase: "fill",
            objects_total: 0,
            objects_done: 0,
            bytes_done: 0,
            repaired: 0,
            failures: 0,
            resumed_from: None,
            started: now,
            phase_started: now,
            rate_limit: self.cfg.heal_rate_bytes,
        });
        // Bucket records first: the joining drives take nothing without.
        let drives: Vec<_> = by_set
            .values()
            .flatten()
            .filter_map(|t| topo.slots[t.slot].writer())
            .collect();
        self.heal_bucket_records(drives, &mut report).await;
        if let Err(error) = self.backfill_sets(&by_set, &mut report).await {
            tracing::warn!(%error, "backfill stopped; tried again shortly");
            report.failures += 1;
        }
        *self.backfill.lock().expect("backfill") = None;
        report
    }

    /// Fills every set's joining drives from their checkpoints, then
    /// verifies them all; a set whose verifying scan found nothing to
    /// repair ends its drives' rebuild.
    async fn backfill_sets(
        &self,
        by_set: &BTreeMap<usize, Vec<Target>>,
        report: &mut HealReport,
    ) -> Result<(), StoreError> {
        // Each set's earliest checkpoint of its joining drives (a drive
        // with none starts over); a verify checkpoint skips the fill.
        let mut fill = Vec::new();
        let mut verify = Vec::new();
        for (&set, targets) in by_set {
            let roots: Vec<PathBuf> = targets.iter().map(|t| t.root.clone()).collect();
            let saved = run_blocking(move || {
                Ok(roots
                    .iter()
                    .map(|r| drive::backfill_checkpoint(r))
                    .collect::<Vec<_>>())
            })
            .await?;
            let from = if saved.iter().any(Option::is_none) {
                None
            } else {
                saved
                    .into_iter()
                    .flatten()
                    .min_by(|a, b| (a.phase, &a.bucket, &a.key).cmp(&(b.phase, &b.bucket, &b.key)))
            };
            match from {
                Some(c) if c.phase == 1 => {
                    tracing::warn!(
                        set,
                        "backfill resumes at its verifying scan: the set had filled"
                    );
                    self.progress(|p| {
                        p.resumed_from.get_or_insert(Resumed::Verify);
                    });
                    verify.push(set);
                }
                Some(c) => {
                    tracing::warn!(set, bucket = %c.bucket, key = %c.key, "backfill resumes from its checkpoint");
                    // A fill's position says more than a verify: it wins.
                    self.progress(|p| {
                        p.resumed_from = Some(Resumed::Fill {
                            bucket: c.bucket.clone(),
                            key: c.key.clone(),
                        })
                    });
                    fill.push((set, Some((c.bucket, c.key))));
                }
                None => fill.push((set, None)),
            }
        }
        // The fill: every set's keys listed first, so the total (and the
        // ETA) covers them all.
        let mut lists = Vec::new();
        for (set, start) in fill {
            lists.push((set, self.list_set(set, start.as_ref()).await?));
        }
        for (set, work) in lists {
            let targets = &by_set[&set];
            let r = self.backfill_pass(set, targets, 0, work).await;
            add(report, &r);
            if r.failures > 0 {
                tracing::warn!(
                    set,
                    failures = r.failures,
                    "backfill of a set incomplete; its checkpoint holds, tried again shortly"
                );
                continue;
            }
            self.save_checkpoint(targets, 1, "", "").await;
            verify.push(set);
        }
        // The verifying scans, from the first key of each set.
        verify.sort_unstable();
        for round in 0..VERIFY_ROUNDS {
            if verify.is_empty() {
                break;
            }
            self.progress(|p| {
                p.phase = "verify";
                p.phase_started = Instant::now();
                p.objects_total = 0;
                p.objects_done = 0;
                p.bytes_done = 0;
                p.repaired = 0;
            });
            let mut lists = Vec::new();
            for &set in &verify {
                lists.push((set, self.list_set(set, None).await?));
            }
            verify.clear();
            for (set, work) in lists {
                let targets = &by_set[&set];
                let scan = self.backfill_pass(set, targets, 1, work).await;
                add(report, &scan);
                if scan.failures == 0 && scan.objects_healed == 0 {
                    tracing::warn!(
                        set,
                        objects = scan.objects_scanned,
                        "verifying scan found every object whole on the joining drives"
                    );
                    for t in targets {
                        self.finish_rebuild(t.slot, t.rebuild);
                    }
                } else {
                    tracing::warn!(
                        set,
                        round,
                        repaired = scan.objects_healed,
                        failures = scan.failures,
                        "verifying scan repaired objects or failed; scanning again"
                    );
                    verify.push(set);
                }
            }
        }
        if verify.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Config(format!(
                "the verifying scans of set(s) {verify:?} keep finding objects to repair"
            )))
        }
    }

    /// A set's keys by bucket, in (bucket, key) order after `start`;
    /// counted into the phase's total.
    async fn list_set(
        &self,
        set: usize,
        start: Option<&(String, String)>,
    ) -> Result<Vec<(String, BTreeSet<String>)>, StoreError> {
        let buckets: Vec<String> = self
            .buckets
            .read()
            .expect("buckets lock")
            .keys()
            .filter(|b| start.is_none_or(|(sb, _)| *b >= sb))
            .cloned()
            .collect();
        let mut work = Vec::with_capacity(buckets.len());
        for bucket in buckets {
            let mut all = self.set_keys(set, &bucket).await?;
            if let Some((sb, sk)) = start {
                if *sb == bucket {
                    all = all.split_off(sk);
                    all.remove(sk);
                }
            }
            self.progress(|p| p.objects_total += all.len() as u64);
            work.push((bucket, all));
        }
        Ok(work)
    }

    /// One pass over a set's listed objects, in order: each healed onto
    /// the joining drives' positions, a few at a time, under the rate
    /// limit. The fill (`phase` 0) saves its position each second while no
    /// object before it failed.
    async fn backfill_pass(
        &self,
        set: usize,
        targets: &[Target],
        phase: u8,
        work: Vec<(String, BTreeSet<String>)>,
    ) -> HealReport {
        let positions: Vec<usize> = targets.iter().map(|t| t.position).collect();
        let positions = positions.as_slice();
        let mut report = HealReport::default();
        let rate = self.cfg.heal_rate_bytes;
        let concurrency = self.cfg.heal_concurrency.max(1);
        let began = Instant::now();
        let mut saved_at = Instant::now();
        let mut clean = true;
        for (bucket, keys) in work {
            let b = bucket.as_str();
            let mut healed = stream::iter(keys)
                .map(|key| async move {
                    let r = self
                        .heal_object_on(Some(set), b, &key, Some(positions))
                        .await;
                    (key, r)
                })
                .buffered(concurrency);
            let mut last = None;
            while let Some((key, r)) = healed.next().await {
                report.objects_scanned += 1;
                match r {
                    Ok(r) => {
                        report.bytes_scanned += r.bytes_scanned;
                        report.shards_rebuilt += r.shards_rebuilt;
                        report.metadata_rewritten += r.metadata_rewritten;
                        if r.shards_rebuilt + r.metadata_rewritten > 0 {
                            report.objects_healed += 1;
                        }
                        if r.failures > 0 {
                            report.failures += r.failures;
                            clean = false;
                        }
                        self.stats
                            .backfill_bytes
                            .fetch_add(r.bytes_scanned, Ordering::Relaxed);
                        self.progress(|p| {
                            p.objects_done += 1;
                            p.bytes_done += r.bytes_scanned;
                            p.repaired += u64::from(r.shards_rebuilt + r.metadata_rewritten > 0);
                        });
                    }
                    // Deleted since it was listed: nothing to fill.
                    Err(StoreError::NoSuchKey { .. }) => {
                        self.progress(|p| p.objects_done += 1);
                    }
                    Err(error) => {
                        tracing::warn!(%bucket, %key, %error, "backfill of an object failed");
                        report.failures += 1;
                        clean = false;
                        self.progress(|p| {
                            p.objects_done += 1;
                            p.failures += 1;
                        });
                    }
                }
                self.stats.backfill_objects.fetch_add(1, Ordering::Relaxed);
                if clean {
                    last = Some(key);
                }
                if phase == 0 && clean && saved_at.elapsed() >= CHECKPOINT_EVERY {
                    if let Some(k) = &last {
                        self.save_checkpoint(targets, 0, &bucket, k).await;
                    }
                    saved_at = Instant::now();
                }
                // Background priority: no faster than the configured rate.
                if rate > 0 {
                    let due = Duration::from_secs_f64(report.bytes_scanned as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(began.elapsed()) {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
            if phase == 0 && clean {
                if let Some(k) = &last {
                    self.save_checkpoint(targets, 0, &bucket, k).await;
                }
            }
            // Multipart uploads in progress, onto the joining drives.
            let joining = self.writers(targets.iter().map(|t| self.drive(t.slot)));
            if !joining.is_empty() {
                if let Err(error) = self.heal_uploads(set, &bucket, &joining).await {
                    tracing::warn!(%bucket, %error, "copying uploads to a joining drive failed");
                    report.failures += 1;
                }
            }
        }
        report
    }

    /// Saves the position reached on every joining drive still in the
    /// rebuild this job fills.
    async fn save_checkpoint(&self, targets: &[Target], phase: u8, bucket: &str, key: &str) {
        let c = BackfillCheckpoint {
            phase,
            bucket: bucket.to_string(),
            key: key.to_string(),
        };
        let roots: Vec<PathBuf> = targets
            .iter()
            .filter(|t| self.drive(t.slot).rebuilding_full() == Some(t.rebuild))
            .map(|t| t.root.clone())
            .collect();
        let r = run_blocking(move || {
            for r in &roots {
                drive::save_backfill_checkpoint(r, &c)?;
            }
            Ok(())
        })
        .await;
        if let Err(error) = r {
            tracing::warn!(%error, "cannot save the backfill checkpoint");
        }
    }
}
