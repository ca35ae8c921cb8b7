//! Prefetch jobs: objects of a cache bucket filled ahead of their readers,
//! by prefix, by list of keys, or by a safetensors model index (the index
//! and every file its `weight_map` names), with progress.

use futures::StreamExt;

use super::*;

/// Objects prefetched at once by one job, and chunks of one object.
const OBJECTS_AT_ONCE: usize = 4;
const CHUNKS_AT_ONCE: usize = 8;
/// Jobs remembered (finished ones are forgotten oldest first), and jobs
/// running at most on a node.
const JOBS_KEPT: usize = 100;
/// Failures a job lists (it counts them all).
const FAILURES_LISTED: usize = 20;
/// Largest model index read.
const INDEX_MAX_BYTES: u64 = 64 << 20;

/// What a prefetch asks for.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PrefetchSpec {
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub keys: Vec<String>,
}

const JOBS_PREFIX: &str = "cache/jobs/";

/// A job's record while it runs (a system document: etcd in a cluster), so
/// that it goes on after a restart and on every node of a cluster.
#[derive(Debug, Serialize, Deserialize)]
struct JobDoc {
    format: u32,
    id: String,
    bucket: String,
    prefix: Option<String>,
    keys: Vec<String>,
    created_ns: u64,
}

fn describe(spec: &PrefetchSpec) -> String {
    match (&spec.prefix, spec.keys.len()) {
        (Some(p), 0) => format!("prefix {p:?}"),
        (Some(p), n) => format!("prefix {p:?} and {n} key(s)"),
        (None, n) => format!("{n} key(s)"),
    }
}

#[derive(Debug, Default)]
struct JobState {
    objects_total: u64,
    objects_done: u64,
    bytes_total: u64,
    bytes_done: u64,
    bytes_from_upstream: u64,
    listed: bool,
    failures: u64,
    failed: Vec<(String, String)>,
    finished_ns: Option<u64>,
    error: Option<String>,
}

pub struct Job {
    pub id: String,
    pub bucket: String,
    pub what: String,
    started_ns: u64,
    state: Mutex<JobState>,
}

impl Job {
    pub fn finished(&self) -> bool {
        self.state.lock().expect("job").finished_ns.is_some()
    }

    pub fn json(&self) -> serde_json::Value {
        let s = self.state.lock().expect("job");
        let end = s.finished_ns.unwrap_or_else(now_ns);
        let secs = (end.saturating_sub(self.started_ns)) as f64 / 1e9;
        serde_json::json!({
            "id": self.id,
            "kind": "prefetch",
            "bucket": self.bucket,
            "what": self.what,
            "state": match (&s.finished_ns, &s.error, s.failures) {
                (None, _, _) => "running",
                (Some(_), Some(_), _) => "failed",
                (Some(_), None, 0) => "done",
                (Some(_), None, _) => "done with failures",
            },
            "listed": s.listed,
            "objects_total": s.objects_total,
            "objects_done": s.objects_done,
            "bytes_total": s.bytes_total,
            "bytes_done": s.bytes_done,
            "bytes_from_upstream": s.bytes_from_upstream,
            "failures": s.failures,
            "failed": s.failed.iter().map(|(k, e)| serde_json::json!({"key": k, "error": e})).collect::<Vec<_>>(),
            "error": s.error,
            "seconds": secs,
            "bytes_per_second": if secs > 0.0 { s.bytes_done as f64 / secs } else { 0.0 },
        })
    }

    fn fail(&self, key: &str, e: &CacheError) {
        let mut s = self.state.lock().expect("job");
        s.failures += 1;
        if s.failed.len() < FAILURES_LISTED {
            s.failed.push((key.to_string(), e.to_string()));
        }
    }
}

impl Caches {
    /// Starts a prefetch job on this node; it runs on the calling core.
    pub fn prefetch(&self, name: &str, spec: PrefetchSpec) -> Result<Arc<Job>, CacheError> {
        let b = self
            .get(name)
            .ok_or_else(|| CacheError::NoSuchCache(name.to_string()))?;
        if spec.prefix.is_none() && spec.keys.is_empty() {
            return Err(CacheError::Invalid(
                "a prefetch needs a prefix or keys".into(),
            ));
        }
        if self.jobs().iter().filter(|j| !j.finished()).count() >= JOBS_KEPT {
            return Err(CacheError::Busy(format!(
                "{JOBS_KEPT} prefetch jobs are running on this node: wait for some to finish"
            )));
        }
        let what = describe(&spec);
        let job = Arc::new(Job {
            id: super::write::random_hex(),
            bucket: name.to_string(),
            what,
            started_ns: now_ns(),
            state: Mutex::new(JobState::default()),
        });
        self.remember_job(job.clone());
        let record = Some(JobDoc {
            format: DOC_FORMAT,
            id: job.id.clone(),
            bucket: name.to_string(),
            prefix: spec.prefix.clone(),
            keys: spec.keys.clone(),
            created_ns: job.started_ns,
        });
        self.run_job(b, job.clone(), spec, record);
        Ok(job)
    }

    /// Runs `job` on this node. Its record is kept while it runs: a node
    /// that starts finds it and runs the job again (what is stored is not
    /// fetched twice), and in a cluster every node runs it too (the chunks'
    /// claims share the work, so each chunk is fetched once), so it goes on
    /// when this node stops. The first node to finish it deletes the record.
    fn run_job(
        &self,
        b: Arc<CacheBucket>,
        job: Arc<Job>,
        spec: PrefetchSpec,
        record: Option<JobDoc>,
    ) {
        let store = self.store.clone();
        tokio::spawn(async move {
            let key = format!("{JOBS_PREFIX}{}.json", job.id);
            if let Some(doc) = &record {
                if let Err(error) = sysdoc::write(&store, &key, doc).await {
                    tracing::warn!(job = %job.id, %error, "a prefetch job runs on this node only: its record was not written");
                }
            }
            let r = b.run_prefetch(&job, spec).await;
            {
                let mut s = job.state.lock().expect("job");
                if let Err(e) = r {
                    s.error = Some(e.to_string());
                }
                s.finished_ns = Some(now_ns());
            }
            {
                // Done for everyone: every chunk it could fetch is stored,
                // and what it could not is reported here (nodes that run it
                // still finish their copies).
                match sysdoc::delete(&store, &key).await {
                    Ok(()) | Err(StoreError::NoSuchKey { .. }) => {}
                    Err(error) => {
                        tracing::warn!(job = %job.id, %error, "cannot delete a finished prefetch job's record")
                    }
                }
            }
        });
    }

    /// Prefetch jobs recorded (by this node before it stopped, or by other
    /// nodes of its cluster) that this node does not run yet: started here.
    /// Called at start and after a change of a cluster's documents.
    pub async fn join_jobs(&self) -> Result<(), CacheError> {
        for key in sysdoc::list(&self.store, JOBS_PREFIX).await? {
            let bytes = match sysdoc::read(&self.store, &key).await {
                Ok(b) => b,
                Err(StoreError::NoSuchKey { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let Ok(doc) = serde_json::from_slice::<JobDoc>(&bytes) else {
                tracing::warn!(%key, "an unreadable prefetch job record is ignored");
                continue;
            };
            if self.job(&doc.id).is_some() {
                continue;
            }
            if self.jobs().iter().filter(|j| !j.finished()).count() >= JOBS_KEPT {
                tracing::warn!(job = %doc.id, "a cluster prefetch job is left to the other nodes: {JOBS_KEPT} run here");
                continue;
            }
            let Some(b) = self.get(&doc.bucket) else {
                // Its cache bucket was removed.
                match sysdoc::delete(&self.store, &key).await {
                    Ok(()) | Err(StoreError::NoSuchKey { .. }) => {}
                    Err(error) => {
                        tracing::warn!(%key, %error, "cannot delete a removed cache bucket's prefetch job record")
                    }
                }
                continue;
            };
            let spec = PrefetchSpec {
                prefix: doc.prefix,
                keys: doc.keys,
            };
            let job = Arc::new(Job {
                id: doc.id,
                bucket: doc.bucket,
                what: describe(&spec),
                started_ns: now_ns(),
                state: Mutex::new(JobState::default()),
            });
            self.remember_job(job.clone());
            self.run_job(b, job, spec, None);
        }
        Ok(())
    }

    fn remember_job(&self, job: Arc<Job>) {
        let mut jobs = self.jobs.lock().expect("cache jobs");
        if jobs.len() >= JOBS_KEPT {
            if let Some(i) = jobs.iter().position(|j| j.finished()) {
                jobs.remove(i);
            }
        }
        jobs.push(job);
    }

    pub fn jobs(&self) -> Vec<Arc<Job>> {
        self.jobs.lock().expect("cache jobs").clone()
    }

    pub fn job(&self, id: &str) -> Option<Arc<Job>> {
        self.jobs().into_iter().find(|j| j.id == id)
    }
}

impl CacheBucket {
    async fn run_prefetch(
        self: &Arc<Self>,
        job: &Arc<Job>,
        spec: PrefetchSpec,
    ) -> Result<(), CacheError> {
        let mut keys: Vec<(String, Option<u64>)> = Vec::new();
        for k in &spec.keys {
            keys.push((k.clone(), None));
            if k.ends_with(".safetensors.index.json") {
                for f in self.index_files(k).await? {
                    if !keys.iter().any(|(x, _)| x == &f) {
                        keys.push((f, None));
                    }
                }
            }
        }
        if let Some(prefix) = &spec.prefix {
            let mut token: Option<String> = None;
            loop {
                let page = self
                    .upstream
                    .list(prefix, None, token.as_deref(), None, 1000)
                    .await?;
                for o in page.objects {
                    if !keys.iter().any(|(x, _)| x == &o.key) {
                        keys.push((o.key, Some(o.size)));
                    }
                }
                match page.next_token.filter(|_| page.truncated) {
                    Some(t) => token = Some(t),
                    None => break,
                }
            }
        }
        {
            let mut s = job.state.lock().expect("job");
            s.objects_total = keys.len() as u64;
            s.bytes_total = keys.iter().filter_map(|(_, n)| *n).sum();
            s.listed = true;
        }
        futures::stream::iter(keys)
            .map(|(key, listed_size)| {
                let (this, job) = (self.clone(), job.clone());
                async move {
                    match this.prefetch_object(&job, &key, listed_size).await {
                        Ok(()) => {}
                        Err(e) => job.fail(&key, &e),
                    }
                    job.state.lock().expect("job").objects_done += 1;
                }
            })
            .buffer_unordered(OBJECTS_AT_ONCE)
            .collect::<Vec<()>>()
            .await;
        Ok(())
    }

    /// The files a safetensors index names (beside it).
    async fn index_files(self: &Arc<Self>, index_key: &str) -> Result<Vec<String>, CacheError> {
        let entry = self.entry(index_key).await?;
        if entry.meta.size > INDEX_MAX_BYTES {
            return Err(CacheError::Invalid(format!(
                "model index {index_key} is larger than {INDEX_MAX_BYTES} bytes"
            )));
        }
        let mut body = self.body_of(index_key, entry.clone(), (0, entry.meta.size), false);
        let mut bytes = Vec::with_capacity(entry.meta.size as usize);
        while let Some(p) = body.next().await {
            bytes.extend_from_slice(&p?);
        }
        let doc: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            CacheError::Invalid(format!("model index {index_key} is not JSON: {e}"))
        })?;
        let dir = index_key.rsplit_once('/').map_or("", |(d, _)| d);
        let mut files: Vec<String> = doc["weight_map"]
            .as_object()
            .ok_or_else(|| {
                CacheError::Invalid(format!("model index {index_key} has no weight_map"))
            })?
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| {
                if dir.is_empty() {
                    f.to_string()
                } else {
                    format!("{dir}/{f}")
                }
            })
            .collect();
        files.sort();
        files.dedup();
        Ok(files)
    }

    /// Fills every chunk of `key` that is not stored; returns once they are.
    async fn prefetch_object(
        self: &Arc<Self>,
        job: &Job,
        key: &str,
        listed_size: Option<u64>,
    ) -> Result<(), CacheError> {
        let entry = self.entry(key).await?;
        if listed_size.is_none() {
            job.state.lock().expect("job").bytes_total += entry.meta.size;
        }
        let results: Vec<Result<(), CacheError>> = futures::stream::iter(0..entry.chunks())
            .map(|n| {
                let (this, entry, key) = (self.clone(), entry.clone(), key.to_string());
                async move {
                    let (cs, ce) = entry.chunk_bounds(n);
                    let fetched = this.ensure_chunk(&key, &entry, n).await?;
                    let mut s = job.state.lock().expect("job");
                    s.bytes_done += ce - cs;
                    if fetched {
                        s.bytes_from_upstream += ce - cs;
                    }
                    Ok(())
                }
            })
            .buffer_unordered(CHUNKS_AT_ONCE)
            .collect()
            .await;
        results.into_iter().collect::<Result<(), _>>()?;
        // Counted as held (probation: a prefetch is not a read).
        Ok(())
    }

    /// Chunk `n` stored (filled now if it was not); whether it was fetched.
    pub(super) async fn ensure_chunk(
        self: &Arc<Self>,
        key: &str,
        entry: &Arc<Entry>,
        n: u64,
    ) -> Result<bool, CacheError> {
        let ck = entry.chunk_key(n);
        let (cs, ce) = entry.chunk_bounds(n);
        loop {
            let filling = self.fills.lock().expect("cache fills").get(&ck).cloned();
            let fill = match filling {
                Some(f) => f,
                None => {
                    match self.store.head_object(&self.chunks_bucket, &ck, None).await {
                        Ok(i) if i.size == ce - cs => return Ok(false),
                        Ok(_) | Err(StoreError::NoSuchKey { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                    // A prefetch waits for a slot: it always keeps.
                    let slot = self
                        .fill_slots
                        .clone()
                        .acquire_owned()
                        .await
                        .expect("the fill semaphore is never closed");
                    self.fill(key, entry, n, Some(slot))
                }
            };
            if !fill.keeps {
                // A read through in progress: once it ends, fill for keeps.
                let _ = wait_stored(&fill).await;
                while self.fills.lock().expect("cache fills").contains_key(&ck) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                continue;
            }
            wait_stored(&fill).await?;
            let fetched = fill.state.lock().expect("fill").fetched;
            return Ok(fetched);
        }
    }
}

/// Waits until a fill's chunk is stored (or the fill failed).
async fn wait_stored(fill: &Fill) -> Result<(), CacheError> {
    loop {
        let notified = fill.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        {
            let st = fill.state.lock().expect("fill");
            if let Some(r) = &st.stored {
                return r.clone().map_err(CacheError::Failed);
            }
        }
        notified.await;
    }
}
