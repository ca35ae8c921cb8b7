//! Heal jobs started from the admin port (`POST /admin/heal/jobs`, the
//! console, `tarn admin heal`): each runs in the background with progress
//! anyone holding the admin token can read (`GET /admin/jobs`). A job
//! asked for while one covering the same objects runs is that job.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use tarn_store::{HealProgress, HealReport, Store, StoreError};

/// Finished jobs kept for `GET /admin/jobs`.
const KEPT: usize = 32;

pub struct HealJob {
    pub id: String,
    /// The bucket healed, or None for every bucket (and the orphan sweep).
    pub bucket: Option<String>,
    started_unix_ms: u64,
    started: Instant,
    progress: HealProgress,
    end: Mutex<Option<End>>,
}

struct End {
    seconds: f64,
    outcome: Result<HealReport, String>,
}

impl HealJob {
    pub fn running(&self) -> bool {
        self.end.lock().expect("heal job").is_none()
    }

    /// Whether this job, while running, heals everything `bucket` asks for.
    fn covers(&self, bucket: Option<&str>) -> bool {
        self.running() && (self.bucket.is_none() || self.bucket.as_deref() == bucket)
    }

    pub fn json(&self) -> serde_json::Value {
        let p = &self.progress;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let end = self.end.lock().expect("heal job");
        let seconds = end
            .as_ref()
            .map_or_else(|| self.started.elapsed().as_secs_f64(), |e| e.seconds);
        let (state, report, error) = match end.as_ref().map(|e| &e.outcome) {
            None => ("running", None, None),
            Some(Ok(r)) if r.failures == 0 => ("done", Some(r), None),
            Some(Ok(r)) => ("done with failures", Some(r), None),
            Some(Err(e)) => ("failed", None, Some(e.clone())),
        };
        let bytes = load(&p.bytes_scanned);
        serde_json::json!({
            "id": self.id,
            "kind": "heal",
            "bucket": self.bucket,
            "state": state,
            "phase": if end.is_some() { "done" } else { p.phase_name() },
            "started_unix_ms": self.started_unix_ms,
            "seconds": seconds,
            "objects_total": load(&p.objects_total),
            "objects_done": load(&p.objects_done),
            "objects_healed": load(&p.objects_healed),
            "failures": load(&p.failures),
            "bytes_scanned": bytes,
            "bytes_per_second": if seconds > 0.0 { bytes as f64 / seconds } else { 0.0 },
            "report": report.map(report_json),
            "error": error,
        })
    }
}

pub fn report_json(r: &HealReport) -> serde_json::Value {
    serde_json::json!({
        "objects_scanned": r.objects_scanned,
        "objects_healed": r.objects_healed,
        "shards_rebuilt": r.shards_rebuilt,
        "metadata_rewritten": r.metadata_rewritten,
        "buckets_healed": r.buckets_healed,
        "orphans_removed": r.orphans_removed,
        "failures": r.failures,
        "bytes_scanned": r.bytes_scanned,
    })
}

#[derive(Default)]
pub struct HealJobs {
    next: AtomicU64,
    jobs: Mutex<VecDeque<Arc<HealJob>>>,
}

impl HealJobs {
    /// The job healing `bucket` (None: everything): a running one that
    /// covers it, else a new one (false: it was already running). A named
    /// bucket that does not exist is an error, and no job.
    pub fn start(
        self: &Arc<Self>,
        store: &Arc<Store>,
        bucket: Option<&str>,
    ) -> Result<(Arc<HealJob>, bool), StoreError> {
        if let Some(b) = bucket {
            store.head_bucket(b)?;
        }
        let mut jobs = self.jobs.lock().expect("heal jobs");
        if let Some(j) = jobs.iter().find(|j| j.covers(bucket)) {
            return Ok((j.clone(), false));
        }
        let job = Arc::new(HealJob {
            id: format!("heal-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1),
            bucket: bucket.map(str::to_string),
            started_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            started: Instant::now(),
            progress: HealProgress::default(),
            end: Mutex::new(None),
        });
        jobs.push_back(job.clone());
        while jobs.len() > KEPT {
            match jobs.iter().position(|j| !j.running()) {
                Some(i) => drop(jobs.remove(i)),
                None => break,
            }
        }
        drop(jobs);
        let (store, run) = (store.clone(), job.clone());
        tokio::spawn(async move {
            let outcome = store
                .heal_with(run.bucket.as_deref(), &run.progress)
                .await
                .map_err(|e| e.to_string());
            match &outcome {
                Ok(r) => {
                    tracing::info!(job = %run.id, bucket = ?run.bucket, objects = r.objects_scanned, healed = r.objects_healed, failures = r.failures, "heal job done")
                }
                Err(error) => tracing::error!(job = %run.id, %error, "heal job failed"),
            }
            *run.end.lock().expect("heal job") = Some(End {
                seconds: run.started.elapsed().as_secs_f64(),
                outcome,
            });
        });
        Ok((job, true))
    }

    /// The job's report once it ends.
    pub async fn wait(job: &HealJob) -> Result<HealReport, String> {
        loop {
            if let Some(e) = job.end.lock().expect("heal job").as_ref() {
                return e.outcome.clone();
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    pub fn jobs(&self) -> Vec<Arc<HealJob>> {
        self.jobs
            .lock()
            .expect("heal jobs")
            .iter()
            .cloned()
            .collect()
    }

    pub fn job(&self, id: &str) -> Option<Arc<HealJob>> {
        self.jobs().into_iter().find(|j| j.id == id)
    }
}
