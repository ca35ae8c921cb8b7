//! Prometheus text metrics: requests by operation and status, bytes, latency.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tarn_store::types::DriveStatus;

/// Latency histogram bucket bounds in seconds.
const BUCKETS_S: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Default)]
struct OpStats {
    by_status: BTreeMap<u16, u64>,
    /// Declared body bytes of the requests and of the answers.
    bytes_in: u64,
    bytes_out: u64,
    buckets: [u64; BUCKETS_S.len()],
    sum_s: f64,
    count: u64,
}

static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// Marks the process's start (called first thing in `main`).
pub fn mark_start() {
    STARTED.get_or_init(std::time::Instant::now);
}

/// Time since `mark_start`.
pub fn uptime() -> std::time::Duration {
    STARTED.get_or_init(std::time::Instant::now).elapsed()
}

#[derive(Default)]
pub struct Metrics {
    ops: Mutex<BTreeMap<&'static str, OpStats>>,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub inflight: AtomicU64,
    pub rejected_overload: AtomicU64,
    /// Requests refused because their caller held its share of the slots.
    pub rejected_share: AtomicU64,
    /// The S3 connections and their caps.
    pub connections: std::sync::OnceLock<std::sync::Arc<crate::fdlimit::Connections>>,
    /// The KV engines by tenant when `--kv` is on.
    pub kv: std::sync::OnceLock<Vec<(String, std::sync::Arc<tarn_kv::Engine>)>>,
    /// The KV server's connection counts when `--kv` is on.
    pub kv_connections: std::sync::OnceLock<std::sync::Arc<tarn_kv::server::ConnectionCounts>>,
    /// The local-read socket when short-circuit reads are served.
    pub local_reads: std::sync::OnceLock<std::sync::Arc<crate::local_read::LocalReads>>,
    /// This process's random key for the names it shows a caller without
    /// the admin token (`Names::Redacted`).
    redact_key: std::hash::RandomState,
}

/// Whether the metrics text names KV tenants and namespaces: their names
/// are the users' own (model and deployment names), shown only to a caller
/// with the admin token; anyone else sees `h-` and 16 hex digits, a keyed
/// hash that is stable for this process's life (series stay series) and
/// says nothing of the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Names {
    Shown,
    Redacted,
}

/// Sums over every S3 operation, for the console's charts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Totals {
    pub requests: u64,
    /// Answers with a 5xx status.
    pub errors: u64,
    /// Requests at most `LATENCY_BOUNDS_S[i]` seconds long (cumulative).
    pub latency_le: [u64; BUCKETS_S.len()],
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// The latency histogram's bucket bounds, in seconds.
pub const LATENCY_BOUNDS_S: [f64; BUCKETS_S.len()] = BUCKETS_S;

impl Metrics {
    pub fn totals(&self) -> Totals {
        let mut t = Totals {
            bytes_in: self.bytes_in.load(Ordering::Relaxed),
            bytes_out: self.bytes_out.load(Ordering::Relaxed),
            ..Totals::default()
        };
        for s in self.ops.lock().expect("metrics lock").values() {
            t.requests += s.count;
            t.errors += s
                .by_status
                .iter()
                .filter(|(status, _)| **status >= 500)
                .map(|(_, n)| n)
                .sum::<u64>();
            for (i, n) in s.buckets.iter().enumerate() {
                t.latency_le[i] += n;
            }
        }
        t
    }

    pub fn record(&self, op: &'static str, status: u16, latency: Duration) {
        self.record_with(op, status, latency, (0, 0));
    }

    /// A request served, with the declared body bytes of the request and
    /// of its answer.
    pub fn record_with(
        &self,
        op: &'static str,
        status: u16,
        latency: Duration,
        (bytes_in, bytes_out): (u64, u64),
    ) {
        self.bytes_in.fetch_add(bytes_in, Ordering::Relaxed);
        self.bytes_out.fetch_add(bytes_out, Ordering::Relaxed);
        let s = latency.as_secs_f64();
        let mut ops = self.ops.lock().expect("metrics lock");
        let e = ops.entry(op).or_default();
        e.bytes_in += bytes_in;
        e.bytes_out += bytes_out;
        *e.by_status.entry(status).or_default() += 1;
        for (i, b) in BUCKETS_S.iter().enumerate() {
            if s <= *b {
                e.buckets[i] += 1;
            }
        }
        e.sum_s += s;
        e.count += 1;
    }

    /// The metrics text; `under_replicated` is the count the missed-write
    /// logs hold (`Store::under_replicated`), read by the caller; `drain`
    /// the drain job this node leads, if any.
    pub fn render(
        &self,
        store: &tarn_store::Store,
        under_replicated: u64,
        drain: Option<&tarn_cluster::node::DrainJob>,
        names: Names,
    ) -> String {
        let mut out = String::new();
        out.push_str("# HELP tarn_requests_total S3 requests by operation and HTTP status.\n# TYPE tarn_requests_total counter\n");
        let ops = self.ops.lock().expect("metrics lock");
        for (op, s) in ops.iter() {
            for (status, n) in &s.by_status {
                let _ = writeln!(
                    out,
                    "tarn_requests_total{{op=\"{op}\",status=\"{status}\"}} {n}"
                );
            }
        }
        type OpBytes = (&'static str, &'static str, fn(&OpStats) -> u64);
        let by_op: [OpBytes; 2] = [
            (
                "tarn_request_bytes_in_total",
                "Declared request body bytes (Content-Length), by operation.",
                |s| s.bytes_in,
            ),
            (
                "tarn_response_bytes_out_total",
                "Declared response body bytes (Content-Length), by operation.",
                |s| s.bytes_out,
            ),
        ];
        for (name, help, value) in by_op {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (op, s) in ops.iter() {
                let _ = writeln!(out, "{name}{{op=\"{op}\"}} {}", value(s));
            }
        }
        out.push_str("# HELP tarn_request_duration_seconds S3 request latency (to response headers).\n# TYPE tarn_request_duration_seconds histogram\n");
        for (op, s) in ops.iter() {
            for (i, b) in BUCKETS_S.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "tarn_request_duration_seconds_bucket{{op=\"{op}\",le=\"{b}\"}} {}",
                    s.buckets[i]
                );
            }
            let _ = writeln!(
                out,
                "tarn_request_duration_seconds_bucket{{op=\"{op}\",le=\"+Inf\"}} {}",
                s.count
            );
            let _ = writeln!(
                out,
                "tarn_request_duration_seconds_sum{{op=\"{op}\"}} {}",
                s.sum_s
            );
            let _ = writeln!(
                out,
                "tarn_request_duration_seconds_count{{op=\"{op}\"}} {}",
                s.count
            );
        }
        drop(ops);
        if let Some(c) = self.connections.get() {
            let _ = writeln!(
                out,
                "# HELP tarn_connections_open S3 connections open.\n# TYPE tarn_connections_open gauge\ntarn_connections_open {}\n\
                 # HELP tarn_connections_max S3 connections allowed open at once, and per client address.\n# TYPE tarn_connections_max gauge\n\
                 tarn_connections_max{{per=\"server\"}} {}\ntarn_connections_max{{per=\"client\"}} {}\n\
                 # HELP tarn_connections_refused_total S3 connections closed as they came: over the cap in all, over one client address's cap, or accepts that failed.\n# TYPE tarn_connections_refused_total counter\n\
                 tarn_connections_refused_total{{reason=\"server_cap\"}} {}\ntarn_connections_refused_total{{reason=\"client_cap\"}} {}\ntarn_connections_refused_total{{reason=\"accept_failed\"}} {}",
                c.open(),
                c.max(),
                c.per_client_max(),
                c.refused_total.load(Ordering::Relaxed),
                c.refused_per_client.load(Ordering::Relaxed),
                c.accept_errors.load(Ordering::Relaxed),
            );
        }
        let st = &store.stats;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let scalars: [(&str, &str, &str, u64); 23] = [
            (
                "tarn_fd_exhaustion_total",
                "Drive operations that failed because the process ran out of file descriptors (the drive stays in service).",
                "counter",
                load(&st.fd_exhaustion),
            ),
            (
                "tarn_requests_inflight",
                "Requests being served.",
                "gauge",
                load(&self.inflight),
            ),
            (
                "tarn_requests_rejected_overload_total",
                "Requests answered 503 SlowDown by admission control.",
                "counter",
                load(&self.rejected_overload),
            ),
            (
                "tarn_requests_rejected_share_total",
                "Requests answered 503 SlowDown because their access key (or, anonymous, their client address) held its share of the in-flight slots.",
                "counter",
                load(&self.rejected_share),
            ),
            (
                "tarn_heal_queued_total",
                "Objects queued for healing by reads.",
                "counter",
                load(&st.heal_queued),
            ),
            (
                "tarn_heal_dropped_total",
                "Heal requests dropped because the queue was full.",
                "counter",
                load(&st.heal_dropped),
            ),
            (
                "tarn_shards_reconstructed_total",
                "Shard blocks rebuilt from parity during reads.",
                "counter",
                load(&st.shards_reconstructed),
            ),
            (
                "tarn_shard_reads_hedged_total",
                "Shard reads given up for being late (another shard was read in their place).",
                "counter",
                load(&st.hedged_reads),
            ),
            (
                "tarn_missed_writes_total",
                "Drives object writes missed (recorded in the missed-write log before the write was acknowledged).",
                "counter",
                load(&st.missed_writes),
            ),
            (
                "tarn_missed_writes_replayed_total",
                "Keys replayed from the missed-write log to a drive of this node that was away.",
                "counter",
                load(&st.missed_replayed),
            ),
            (
                "tarn_under_replicated",
                "Objects some write missed on a drive of their set and no replay or backfill has healed yet (cluster status's under_replicated).",
                "gauge",
                under_replicated,
            ),
            (
                "tarn_commit_rounds_total",
                "Durable writes of a key's record that committed new versions (PUT, CompleteMultipartUpload, CopyObject): writers of one key queued meanwhile share the next.",
                "counter",
                load(&st.commit_rounds),
            ),
            (
                "tarn_commit_versions_total",
                "New versions those writes committed (over tarn_commit_rounds_total: writers per durable write).",
                "counter",
                load(&st.commit_versions),
            ),
            (
                "tarn_backfill_objects_visited_total",
                "Objects a backfill of a joining drive filled or verified.",
                "counter",
                load(&st.backfill_objects),
            ),
            (
                "tarn_backfill_bytes_total",
                "Bytes of the objects a backfill filled or verified.",
                "counter",
                load(&st.backfill_bytes),
            ),
            (
                "tarn_shards_rebuilt_total",
                "Shard files rewritten by healing.",
                "counter",
                load(&st.shards_rebuilt),
            ),
            (
                "tarn_drive_faults_total",
                "Drives taken out while running after an I/O error.",
                "counter",
                load(&st.drive_faults),
            ),
            (
                "tarn_drive_rejoins_total",
                "Drives that worked again and rejoined while running.",
                "counter",
                load(&st.drive_rejoins),
            ),
            (
                "tarn_read_ahead_bytes",
                "GET data read ahead of clients now (bounded by response_buffer_max_bytes).",
                "gauge",
                store.read_ahead_bytes().0,
            ),
            (
                "tarn_read_ahead_waits_total",
                "GET stripes that waited for room in the read-ahead budget.",
                "counter",
                load(&st.read_ahead_waits),
            ),
            (
                "tarn_drive_reserves_released_total",
                "Drive metadata reserves given back to a filesystem with no space left (so reads, DELETEs and repair go on).",
                "counter",
                load(&st.reserves_released),
            ),
            (
                "tarn_index_corruptions_total",
                "Drive metadata indexes found damaged and set aside to be rebuilt.",
                "counter",
                load(&st.index_corruptions),
            ),
            (
                "tarn_index_rebuilds_total",
                "Drive metadata indexes rebuilt by heal (the drive serves reads again).",
                "counter",
                load(&st.index_rebuilds),
            ),
        ];
        for (name, help, kind, v) in scalars {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        }
        let drives = store.drive_status();
        type DriveGauge = (&'static str, &'static str, fn(&DriveStatus) -> bool);
        let gauges: [DriveGauge; 3] = [
            (
                "tarn_drive_online",
                "Whether a drive is in use (0: offline since start, or faulty).",
                |d| d.online,
            ),
            (
                "tarn_drive_rebuilding",
                "Whether a drive's index is being rebuilt by heal (it answers no metadata reads meanwhile).",
                |d| d.rebuilding,
            ),
            (
                "tarn_drive_syncing",
                "Whether a drive back after an absence is being synced from the missed-write log (it answers no metadata reads meanwhile).",
                |d| d.syncing,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for d in &drives {
                let _ = writeln!(
                    out,
                    "{name}{{drive=\"{}\",set=\"{}\"}} {}",
                    d.path.replace('"', "'"),
                    d.set_index,
                    u8::from(value(d))
                );
            }
        }
        type DriveBytes = (&'static str, &'static str, fn((u64, u64)) -> u64);
        let sizes: [DriveBytes; 3] = [
            (
                "tarn_drive_total_bytes",
                "Size of a drive's filesystem (drives whose size is known: this node's, and other nodes' as they last reported it).",
                |(_, total)| total,
            ),
            (
                "tarn_drive_free_bytes",
                "Bytes free on a drive's filesystem (for unprivileged writers).",
                |(free, _)| free,
            ),
            (
                "tarn_drive_used_bytes",
                "Bytes used on a drive's filesystem (total less free).",
                |(free, total)| total.saturating_sub(free),
            ),
        ];
        for (name, help, value) in sizes {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for d in &drives {
                if let Some(space) = d.space {
                    let _ = writeln!(
                        out,
                        "{name}{{drive=\"{}\",set=\"{}\"}} {}",
                        d.path.replace('"', "'"),
                        d.set_index,
                        value(space)
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP tarn_build_info The running build (value 1).\n# TYPE tarn_build_info gauge\ntarn_build_info{{version=\"{}\"}} 1\n\
             # HELP tarn_uptime_seconds Seconds since this process started.\n# TYPE tarn_uptime_seconds gauge\ntarn_uptime_seconds {:.3}",
            env!("CARGO_PKG_VERSION"),
            uptime().as_secs_f64()
        );
        render_backfill(&mut out, store.backfill_status().as_ref());
        render_drain(&mut out, drain);
        if let Some(c) = self.kv_connections.get() {
            let _ = writeln!(
                out,
                "# HELP tarn_kv_connections_open KV connections open (TCP and shared memory).\n# TYPE tarn_kv_connections_open gauge\ntarn_kv_connections_open {}\n\
                 # HELP tarn_kv_connections_refused_total KV connections refused: closed as they came (over connections_max) or AUTH answered Limit (over connections_per_tenant_max).\n# TYPE tarn_kv_connections_refused_total counter\n\
                 tarn_kv_connections_refused_total{{reason=\"server_cap\"}} {}\ntarn_kv_connections_refused_total{{reason=\"tenant_cap\"}} {}",
                c.open(),
                c.refused_open.load(Ordering::Relaxed),
                c.refused_tenant.load(Ordering::Relaxed)
            );
        }
        let (sent, fallbacks) = tarn_io::spans::counters();
        let _ = writeln!(
            out,
            "# HELP tarn_get_sendfile_bytes_total GET bytes sent from this node's shard files (sendfile) on plain HTTP connections, not copied into the socket.\n# TYPE tarn_get_sendfile_bytes_total counter\ntarn_get_sendfile_bytes_total {sent}\n\
             # HELP tarn_get_sendfile_fallbacks_total Sends from a shard file that could not send (the file shorter, an error) and wrote the same bytes from memory.\n# TYPE tarn_get_sendfile_fallbacks_total counter\ntarn_get_sendfile_fallbacks_total {fallbacks}"
        );
        let (viewed, view_missed) = tarn_io::view::counters();
        let _ = writeln!(
            out,
            "# HELP tarn_get_file_view_bytes_total GET bytes verified where they lay in the page cache and sent from their shard files as views, never copied.\n# TYPE tarn_get_file_view_bytes_total counter\ntarn_get_file_view_bytes_total {viewed}\n\
             # HELP tarn_get_file_view_misses_total Stripes a GET could not send as views (a block not all in the page cache, or one whose checksum failed there) and read the usual way.\n# TYPE tarn_get_file_view_misses_total counter\ntarn_get_file_view_misses_total {view_missed}"
        );
        let (filled, fill_failed) = tarn_io::pagecache::counters();
        let _ = writeln!(
            out,
            "# HELP tarn_get_large_folio_fill_bytes_total Bytes of GETs' shard files that were not in the page cache and were read into it in large folios before being read.\n# TYPE tarn_get_large_folio_fill_bytes_total counter\ntarn_get_large_folio_fill_bytes_total {filled}\n\
             # HELP tarn_get_large_folio_fill_failures_total Fills that failed (the read that followed met the same error and dealt with it).\n# TYPE tarn_get_large_folio_fill_failures_total counter\ntarn_get_large_folio_fill_failures_total {fill_failed}\n\
             # HELP tarn_s3_connections_unpaced_total Connections from clients on this host switched from a pacing congestion control (BBR) to one that does not pace.\n# TYPE tarn_s3_connections_unpaced_total counter\ntarn_s3_connections_unpaced_total {}",
            tarn_io::net::unpaced()
        );
        if let Some(l) = self.local_reads.get() {
            let c = &l.counters;
            let _ = writeln!(
                out,
                "# HELP tarn_local_read_connections_open Connections to the local-read socket (short-circuit reads).\n# TYPE tarn_local_read_connections_open gauge\ntarn_local_read_connections_open {}\n\
                 # HELP tarn_local_read_answers_total Layout requests on the local-read socket by answer: granted (descriptors sent), elsewhere (nothing to read locally: inline, encrypted, other nodes' drives, a cache bucket), refused.\n# TYPE tarn_local_read_answers_total counter\n\
                 tarn_local_read_answers_total{{answer=\"granted\"}} {}\ntarn_local_read_answers_total{{answer=\"elsewhere\"}} {}\ntarn_local_read_answers_total{{answer=\"refused\"}} {}\n\
                 # HELP tarn_local_read_descriptors_total Shard file descriptors passed to local readers.\n# TYPE tarn_local_read_descriptors_total counter\ntarn_local_read_descriptors_total {}\n\
                 # HELP tarn_local_read_handshakes_refused_total Local-read connections whose credentials were not accepted.\n# TYPE tarn_local_read_handshakes_refused_total counter\ntarn_local_read_handshakes_refused_total {}",
                c.connections.load(Ordering::Relaxed),
                c.grants.load(Ordering::Relaxed),
                c.elsewhere.load(Ordering::Relaxed),
                c.refused.load(Ordering::Relaxed),
                c.descriptors.load(Ordering::Relaxed),
                c.handshakes_failed.load(Ordering::Relaxed),
            );
        }
        if let Some(kv) = self.kv.get() {
            let name = |n: &[u8]| -> String {
                match names {
                    Names::Shown => label(n),
                    Names::Redacted => {
                        use std::hash::BuildHasher;
                        format!("h-{:016x}", self.redact_key.hash_one(n))
                    }
                }
            };
            render_kv(&mut out, kv, &name);
        }
        out
    }
}

impl Metrics {
    /// The cache buckets' counters (docs/cache.md), bucket names redacted
    /// as the KV namespaces are.
    pub fn render_cache(&self, caches: &tarn_s3::cache::Caches, names: Names) -> String {
        use std::fmt::Write;
        let name = |n: &str| -> String {
            match names {
                Names::Shown => label(n.as_bytes()),
                Names::Redacted => {
                    use std::hash::BuildHasher;
                    format!("h-{:016x}", self.redact_key.hash_one(n.as_bytes()))
                }
            }
        };
        let buckets = caches.all();
        let mut out = String::new();
        let series: [(&str, &str, &str); 11] = [
            (
                "tarn_cache_hits_total",
                "counter",
                "GETs of cache buckets served from cached bytes only.",
            ),
            (
                "tarn_cache_misses_total",
                "counter",
                "GETs of cache buckets that needed the upstream.",
            ),
            (
                "tarn_cache_served_bytes_total",
                "counter",
                "Bytes cache buckets served.",
            ),
            (
                "tarn_cache_upstream_bytes_total",
                "counter",
                "Bytes read from upstreams.",
            ),
            (
                "tarn_cache_upstream_gets_total",
                "counter",
                "Ranged GETs sent to upstreams (retries included).",
            ),
            (
                "tarn_cache_upstream_heads_total",
                "counter",
                "HEADs sent to upstreams (lookups and validations).",
            ),
            (
                "tarn_cache_fills_failed_total",
                "counter",
                "Chunk fills that failed (their readers cut off).",
            ),
            ("tarn_cache_evictions_total", "counter", "Objects evicted."),
            (
                "tarn_cache_evicted_bytes_total",
                "counter",
                "Bytes evicted.",
            ),
            (
                "tarn_cache_bytes",
                "gauge",
                "Bytes a cache bucket holds, as counted on this node.",
            ),
            (
                "tarn_cache_size_bytes",
                "gauge",
                "A cache bucket's size limit (0: none).",
            ),
        ];
        for (metric, kind, help) in series {
            let _ = writeln!(out, "# HELP {metric} {help}\n# TYPE {metric} {kind}");
            for b in &buckets {
                let st = &b.stats;
                let v = match metric {
                    "tarn_cache_hits_total" => st.hits.load(Ordering::Relaxed),
                    "tarn_cache_misses_total" => st.misses.load(Ordering::Relaxed),
                    "tarn_cache_served_bytes_total" => st.bytes_served.load(Ordering::Relaxed),
                    "tarn_cache_upstream_bytes_total" => {
                        st.bytes_from_upstream.load(Ordering::Relaxed)
                    }
                    "tarn_cache_upstream_gets_total" => st.upstream_gets.load(Ordering::Relaxed),
                    "tarn_cache_upstream_heads_total" => st.upstream_heads.load(Ordering::Relaxed),
                    "tarn_cache_fills_failed_total" => st.fills_failed.load(Ordering::Relaxed),
                    "tarn_cache_evictions_total" => st.evictions.load(Ordering::Relaxed),
                    "tarn_cache_evicted_bytes_total" => st.bytes_evicted.load(Ordering::Relaxed),
                    "tarn_cache_bytes" => b.used(),
                    _ => b.size.unwrap_or(0),
                };
                let _ = writeln!(out, "{metric}{{bucket=\"{}\"}} {v}", name(&b.name));
            }
        }
        let jobs = caches.jobs();
        let running = jobs.iter().filter(|j| !j.finished()).count();
        let _ = write!(
            out,
            "# HELP tarn_cache_budget_bytes Bytes every cache bucket of the node may hold together (0: no budget).\n# TYPE tarn_cache_budget_bytes gauge\ntarn_cache_budget_bytes {}\n\
             # HELP tarn_cache_used_bytes Bytes every cache bucket holds, as counted on this node.\n# TYPE tarn_cache_used_bytes gauge\ntarn_cache_used_bytes {}\n\
             # HELP tarn_cache_prefetch_jobs Prefetch jobs this node remembers, by state.\n# TYPE tarn_cache_prefetch_jobs gauge\n\
             tarn_cache_prefetch_jobs{{state=\"running\"}} {running}\ntarn_cache_prefetch_jobs{{state=\"finished\"}} {}\n",
            caches.budget(),
            caches.used(),
            jobs.len() - running
        );
        out
    }
}

/// The lifecycle scanner's counters (docs/lifecycle.md).
pub fn render_lifecycle() -> String {
    use std::fmt::Write;
    let c = &tarn_s3::lifecycle::COUNTERS;
    let mut out = String::new();
    let series: [(&str, &str, &std::sync::atomic::AtomicU64); 6] = [
        (
            "tarn_lifecycle_passes_total",
            "Lifecycle passes over a bucket this node finished.",
            &c.passes,
        ),
        (
            "tarn_lifecycle_scanned_total",
            "Versions lifecycle passes visited.",
            &c.scanned,
        ),
        (
            "tarn_lifecycle_uploads_aborted_total",
            "Incomplete multipart uploads lifecycle aborted.",
            &c.uploads_aborted,
        ),
        (
            "tarn_lifecycle_errors_total",
            "Lifecycle passes that failed (tried again next interval).",
            &c.errors,
        ),
        (
            "tarn_lifecycle_delete_markers_removed_total",
            "Delete markers with no other version that lifecycle removed.",
            &c.delete_markers_removed,
        ),
        (
            "tarn_lifecycle_locked_kept_total",
            "Expiries lifecycle skipped because object lock keeps the version.",
            &c.locked_kept,
        ),
    ];
    for (metric, help, v) in series {
        let _ = writeln!(
            out,
            "# HELP {metric} {help}\n# TYPE {metric} counter\n{metric} {}",
            v.load(Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP tarn_lifecycle_expired_total Versions lifecycle expired: current ones (a delete marker where versioning is on, else removed) and noncurrent ones.\n# TYPE tarn_lifecycle_expired_total counter\n\
         tarn_lifecycle_expired_total{{version=\"current\"}} {}\ntarn_lifecycle_expired_total{{version=\"noncurrent\"}} {}",
        c.expired.load(Ordering::Relaxed),
        c.noncurrent_expired.load(Ordering::Relaxed)
    );
    out
}

/// A Prometheus label value: escaped, at most 200 characters.
fn label(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw)
        .chars()
        .take(200)
        .flat_map(|c| match c {
            '\\' => vec!['\\', '\\'],
            '"' => vec!['\\', '"'],
            '\n' => vec!['\\', 'n'],
            c => vec![c],
        })
        .collect()
}

/// The backfill running on this node: its progress, rate and ETA (all 0
/// while none runs).
fn render_backfill(out: &mut String, b: Option<&tarn_store::BackfillStatus>) {
    let gauges: [(&str, &str, f64); 7] = [
        (
            "tarn_backfill_running",
            "Whether a backfill of a joining drive runs on this node.",
            f64::from(u8::from(b.is_some())),
        ),
        (
            "tarn_backfill_verifying",
            "Whether the running backfill is in its verifying scan (the fill is through).",
            f64::from(u8::from(b.is_some_and(|b| b.phase == "verify"))),
        ),
        (
            "tarn_backfill_objects",
            "Objects the current backfill phase covers.",
            b.map_or(0.0, |b| b.objects_total as f64),
        ),
        (
            "tarn_backfill_objects_done",
            "Objects the current backfill phase has visited.",
            b.map_or(0.0, |b| b.objects_done as f64),
        ),
        (
            "tarn_backfill_rate_bytes_per_second",
            "Bytes per second of the current backfill phase so far.",
            b.map_or(0.0, |b| b.rate()),
        ),
        (
            "tarn_backfill_eta_seconds",
            "Seconds the current backfill phase needs yet at its rate so far (-1: not known yet).",
            b.map_or(0.0, |b| b.eta_secs().unwrap_or(-1.0)),
        ),
        (
            "tarn_backfill_rate_limit_bytes_per_second",
            "The configured background rate limit (0: none).",
            b.map_or(0.0, |b| b.rate_limit as f64),
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
}

/// The drain this node leads: its pool, progress, rate and ETA (all 0, the
/// pool -1, while it leads none; the other nodes show 0).
fn render_drain(out: &mut String, d: Option<&tarn_cluster::node::DrainJob>) {
    let gauges: [(&str, &str, f64); 9] = [
        (
            "tarn_drain_running",
            "Whether this node leads the drain of a pool (one node of the cluster does while a pool drains).",
            f64::from(u8::from(d.is_some())),
        ),
        (
            "tarn_drain_pool",
            "The pool being drained (-1: none led here).",
            d.map_or(-1.0, |d| f64::from(d.pool)),
        ),
        (
            "tarn_drain_keys_left",
            "Keys the drain's current pass has yet to move.",
            d.map_or(0.0, |d| d.keys_left() as f64),
        ),
        (
            "tarn_drain_keys_moved",
            "Keys moved since this node took the drain's leadership.",
            d.map_or(0.0, |d| d.moved() as f64),
        ),
        (
            "tarn_drain_bytes_moved",
            "Bytes of the versions moved since this node took the drain's leadership.",
            d.map_or(0.0, |d| d.bytes() as f64),
        ),
        (
            "tarn_drain_failures",
            "Keys the current pass could not move (the next pass tries again).",
            d.map_or(0.0, |d| d.report.failures as f64),
        ),
        (
            "tarn_drain_uploads_in_pool",
            "Multipart uploads in progress still in the draining pool (their keys wait for them).",
            d.map_or(0.0, |d| d.report.uploads as f64),
        ),
        (
            "tarn_drain_rate_bytes_per_second",
            "Bytes per second moved since this node took the drain's leadership.",
            d.map_or(0.0, |d| d.rate_bytes()),
        ),
        (
            "tarn_drain_eta_seconds",
            "Seconds the current pass needs yet at its key rate so far (-1: not known yet).",
            d.map_or(0.0, |d| d.eta_secs().unwrap_or(-1.0)),
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
}

/// Bucket subresources and the operations that GET, PUT, POST and DELETE
/// name with them ("" where AWS has none); configurations kept by id also
/// have a List operation for a GET without `id`.
const BUCKET_SUBRESOURCES: &[(&str, &str, &str, &str, &str)] = &[
    ("abac", "GetBucketAbac", "PutBucketAbac", "", ""),
    (
        "accelerate",
        "GetBucketAccelerateConfiguration",
        "PutBucketAccelerateConfiguration",
        "",
        "",
    ),
    ("acl", "GetBucketAcl", "PutBucketAcl", "", ""),
    (
        "analytics",
        "GetBucketAnalyticsConfiguration",
        "PutBucketAnalyticsConfiguration",
        "",
        "DeleteBucketAnalyticsConfiguration",
    ),
    (
        "cors",
        "GetBucketCors",
        "PutBucketCors",
        "",
        "DeleteBucketCors",
    ),
    ("delete", "", "", "DeleteObjects", ""),
    (
        "encryption",
        "GetBucketEncryption",
        "PutBucketEncryption",
        "",
        "DeleteBucketEncryption",
    ),
    (
        "intelligent-tiering",
        "GetBucketIntelligentTieringConfiguration",
        "PutBucketIntelligentTieringConfiguration",
        "",
        "DeleteBucketIntelligentTieringConfiguration",
    ),
    (
        "inventory",
        "GetBucketInventoryConfiguration",
        "PutBucketInventoryConfiguration",
        "",
        "DeleteBucketInventoryConfiguration",
    ),
    (
        "lifecycle",
        "GetBucketLifecycleConfiguration",
        "PutBucketLifecycleConfiguration",
        "",
        "DeleteBucketLifecycle",
    ),
    ("location", "GetBucketLocation", "", "", ""),
    ("logging", "GetBucketLogging", "PutBucketLogging", "", ""),
    (
        "metadataAnnotationTable",
        "",
        "UpdateBucketMetadataAnnotationTableConfiguration",
        "",
        "",
    ),
    (
        "metadataConfiguration",
        "GetBucketMetadataConfiguration",
        "",
        "CreateBucketMetadataConfiguration",
        "DeleteBucketMetadataConfiguration",
    ),
    (
        "metadataInventoryTable",
        "",
        "UpdateBucketMetadataInventoryTableConfiguration",
        "",
        "",
    ),
    (
        "metadataJournalTable",
        "",
        "UpdateBucketMetadataJournalTableConfiguration",
        "",
        "",
    ),
    (
        "metadataTable",
        "GetBucketMetadataTableConfiguration",
        "",
        "CreateBucketMetadataTableConfiguration",
        "DeleteBucketMetadataTableConfiguration",
    ),
    (
        "metrics",
        "GetBucketMetricsConfiguration",
        "PutBucketMetricsConfiguration",
        "",
        "DeleteBucketMetricsConfiguration",
    ),
    (
        "notification",
        "GetBucketNotificationConfiguration",
        "PutBucketNotificationConfiguration",
        "",
        "",
    ),
    (
        "object-lock",
        "GetObjectLockConfiguration",
        "PutObjectLockConfiguration",
        "",
        "",
    ),
    (
        "ownershipControls",
        "GetBucketOwnershipControls",
        "PutBucketOwnershipControls",
        "",
        "DeleteBucketOwnershipControls",
    ),
    (
        "policy",
        "GetBucketPolicy",
        "PutBucketPolicy",
        "",
        "DeleteBucketPolicy",
    ),
    ("policyStatus", "GetBucketPolicyStatus", "", "", ""),
    (
        "publicAccessBlock",
        "GetPublicAccessBlock",
        "PutPublicAccessBlock",
        "",
        "DeletePublicAccessBlock",
    ),
    (
        "replication",
        "GetBucketReplication",
        "PutBucketReplication",
        "",
        "DeleteBucketReplication",
    ),
    (
        "requestPayment",
        "GetBucketRequestPayment",
        "PutBucketRequestPayment",
        "",
        "",
    ),
    ("session", "CreateSession", "", "", ""),
    (
        "tagging",
        "GetBucketTagging",
        "PutBucketTagging",
        "",
        "DeleteBucketTagging",
    ),
    ("uploads", "ListMultipartUploads", "", "", ""),
    (
        "versioning",
        "GetBucketVersioning",
        "PutBucketVersioning",
        "",
        "",
    ),
    ("versions", "ListObjectVersions", "", "", ""),
    (
        "website",
        "GetBucketWebsite",
        "PutBucketWebsite",
        "",
        "DeleteBucketWebsite",
    ),
];

/// Bucket configurations kept by id: a GET without `id` lists them.
const LISTED_BY_ID: &[(&str, &str)] = &[
    ("analytics", "ListBucketAnalyticsConfigurations"),
    (
        "intelligent-tiering",
        "ListBucketIntelligentTieringConfigurations",
    ),
    ("inventory", "ListBucketInventoryConfigurations"),
    ("metrics", "ListBucketMetricsConfigurations"),
];

/// Object subresources and the operations that GET, PUT, POST and DELETE
/// name with them.
const OBJECT_SUBRESOURCES: &[(&str, &str, &str, &str, &str)] = &[
    ("acl", "GetObjectAcl", "PutObjectAcl", "", ""),
    ("attributes", "GetObjectAttributes", "", "", ""),
    (
        "legal-hold",
        "GetObjectLegalHold",
        "PutObjectLegalHold",
        "",
        "",
    ),
    (
        "retention",
        "GetObjectRetention",
        "PutObjectRetention",
        "",
        "",
    ),
    (
        "tagging",
        "GetObjectTagging",
        "PutObjectTagging",
        "",
        "DeleteObjectTagging",
    ),
    ("torrent", "GetObjectTorrent", "", "", ""),
    ("restore", "", "", "RestoreObject", ""),
    ("select", "", "", "SelectObjectContent", ""),
    ("renameObject", "", "RenameObject", "", ""),
    (
        "annotation",
        "GetObjectAnnotation",
        "PutObjectAnnotation",
        "",
        "DeleteObjectAnnotation",
    ),
    ("encryption", "", "UpdateObjectEncryption", "", ""),
];

/// Operations of AWS's S3 that the S3 layer has no route for: without a
/// refusal up front they would be taken for another operation (a PUT of
/// `?encryption` on a key for a PutObject that empties it, a DELETE of
/// `?annotation` for a DeleteObject, a PUT of `?abac` on a bucket for a
/// CreateBucket answered 200). The front answers them 501 NotImplemented.
pub fn unrouted(op: &str) -> bool {
    matches!(
        op,
        "CreateBucketMetadataConfiguration"
            | "GetBucketMetadataConfiguration"
            | "DeleteBucketMetadataConfiguration"
            | "CreateBucketMetadataTableConfiguration"
            | "GetBucketMetadataTableConfiguration"
            | "DeleteBucketMetadataTableConfiguration"
            | "UpdateBucketMetadataAnnotationTableConfiguration"
            | "UpdateBucketMetadataInventoryTableConfiguration"
            | "UpdateBucketMetadataJournalTableConfiguration"
            | "GetBucketAbac"
            | "PutBucketAbac"
            | "GetObjectAnnotation"
            | "PutObjectAnnotation"
            | "DeleteObjectAnnotation"
            | "ListObjectAnnotations"
            | "UpdateObjectEncryption"
    )
}

/// The S3 operation a request names, from its method, path and query, by
/// AWS's names, those Tarn refuses included (for metrics and logs; s3s does
/// the authoritative routing). "Other" for what names no S3 operation.
pub fn operation(
    method: &http::Method,
    path: &str,
    query: &str,
    bucket_in_host: bool,
    has_copy_source: bool,
) -> &'static str {
    let has = |k: &str| {
        query.split('&').any(|p| {
            p.strip_prefix(k)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
        })
    };
    let segments = path
        .trim_start_matches('/')
        .splitn(2, '/')
        .filter(|s| !s.is_empty())
        .count()
        + usize::from(bucket_in_host);
    let m = method.as_str();
    if m == "OPTIONS" && segments > 0 {
        return "PreflightRequest";
    }
    match segments {
        0 => match m {
            "GET" => "ListBuckets",
            _ => "Other",
        },
        1 => {
            let sub = BUCKET_SUBRESOURCES.iter().find(|(k, ..)| has(k));
            if let Some(&(k, get, put, post, delete)) = sub {
                let name = match m {
                    "GET" if !has("id") => LISTED_BY_ID
                        .iter()
                        .find(|(l, _)| *l == k)
                        .map_or(get, |(_, list)| list),
                    "GET" => get,
                    "PUT" => put,
                    "POST" => post,
                    "DELETE" => delete,
                    _ => "",
                };
                return if name.is_empty() { "Other" } else { name };
            }
            match m {
                "GET" if query.contains("list-type=2") => "ListObjectsV2",
                "GET" => "ListObjects",
                "PUT" => "CreateBucket",
                "HEAD" => "HeadBucket",
                "DELETE" => "DeleteBucket",
                "POST" if has("delete") => "DeleteObjects",
                // An HTML form upload.
                "POST" => "PostObject",
                _ => "Other",
            }
        }
        _ => {
            let sub = OBJECT_SUBRESOURCES.iter().find(|(k, ..)| has(k));
            if let Some(&(k, get, put, post, delete)) = sub {
                let name = match m {
                    "GET" if k == "annotation" && !has("annotationName") => "ListObjectAnnotations",
                    "GET" => get,
                    "PUT" => put,
                    "POST" => post,
                    "DELETE" => delete,
                    _ => "",
                };
                return if name.is_empty() { "Other" } else { name };
            }
            match m {
                "PUT" if has("partNumber") && has_copy_source => "UploadPartCopy",
                "PUT" if has("partNumber") => "UploadPart",
                "POST" if has("uploadId") => "CompleteMultipartUpload",
                "POST" if has("uploads") => "CreateMultipartUpload",
                "GET" if has("uploadId") => "ListParts",
                "DELETE" if has("uploadId") => "AbortMultipartUpload",
                "PUT" if has_copy_source => "CopyObject",
                "PUT" => "PutObject",
                "GET" => "GetObject",
                "HEAD" => "HeadObject",
                "DELETE" => "DeleteObject",
                _ => "Other",
            }
        }
    }
}

/// KV store gauges and counters, with hit and miss counts per namespace so a
/// low hit rate can be explained. Each tenant's engine is labelled with
/// `name` of the tenant's name (the name or its redaction).
/// The type and meaning of a KV engine figure (`Engine::stats`).
fn kv_stat_meta(stat: &str) -> (&'static str, &'static str) {
    match stat {
        "blocks" => ("gauge", "KV blocks stored (RAM and disk tiers)."),
        "ram_blocks" => ("gauge", "KV blocks in the RAM tier."),
        "ram_used_bytes" => ("gauge", "Bytes of KV blocks in the RAM tier."),
        "ram_capacity_bytes" => ("gauge", "Size of the RAM tier's arena."),
        "ram_huge_pages" => ("gauge", "Whether the RAM tier's arena is on huge pages (1) or not (0)."),
        "evicted_demoted" => ("counter", "Blocks evicted from RAM and kept on the disk tier."),
        "evicted_dropped" => ("counter", "Blocks evicted from RAM and dropped (no disk tier, or it had no room)."),
        "promoted" => ("counter", "Blocks read from the disk tier and copied back into RAM."),
        "demote_dropped" => ("counter", "Blocks evicted from RAM that the disk tier had no room for (dropped instead of demoted)."),
        "disk_segments_dropped" => ("counter", "Disk tier segments dropped to make room."),
        "disk_blocks_dropped" => ("counter", "Blocks dropped with their disk tier segments."),
        "pinned_relocated" => ("counter", "Pinned blocks copied forward on the disk tier when their segment was dropped to make room."),
        "corrupt_ram" => ("counter", "Blocks found corrupt in RAM (their checksum failed) and dropped."),
        "corrupt_disk" => ("counter", "Blocks found corrupt on the disk tier and dropped."),
        "reservations_aborted" => ("counter", "Put reservations given up (the client went away before committing)."),
        "checksum_mismatches" => ("counter", "Blocks a client wrote whose checksum did not match at commit (refused, nothing stored)."),
        "parts_abandoned" => ("counter", "Multi-part values left unfinished and dropped (docs/kv-protocol.md)."),
        "pages_stolen" => ("counter", "RAM pages taken from one slab class for another."),
        "value_max_bytes" => ("gauge", "Largest block the store takes."),
        "disk_used_bytes" => ("gauge", "Bytes used on the disk tier."),
        "disk_capacity_bytes" => ("gauge", "Size of the disk tier."),
        "disk_segments" => ("gauge", "Segments on the disk tier."),
        "disk_direct_io" => ("gauge", "Whether the disk tier uses O_DIRECT (1) or the page cache (0)."),
        _ => ("gauge", "A KV store figure (see docs/kv-protocol.md, STATS)."),
    }
}

fn render_kv(
    out: &mut String,
    engines: &[(String, std::sync::Arc<tarn_kv::Engine>)],
    name: &dyn Fn(&[u8]) -> String,
) {
    // One family per figure, every tenant's line under its HELP and TYPE.
    let mut families: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for (tenant, kv) in engines {
        let tenant = name(tenant.as_bytes());
        for (stat, v) in kv.stats(None) {
            // Per-class figures are labels of their own metric below.
            if stat.starts_with("class.") {
                continue;
            }
            families.entry(stat).or_default().push((tenant.clone(), v));
        }
    }
    for (stat, lines) in families {
        let (kind, help) = kv_stat_meta(&stat);
        let _ = writeln!(
            out,
            "# HELP tarn_kv_{stat} {help}\n# TYPE tarn_kv_{stat} {kind}"
        );
        for (tenant, v) in lines {
            let _ = writeln!(out, "tarn_kv_{stat}{{tenant=\"{tenant}\"}} {v}");
        }
    }
    out.push_str("# HELP tarn_kv_class RAM tier slab classes: occupancy (pages, blocks, bytes), pages moved in and out, blocks evicted by reason (room: the class's own SIEVE victim; page_moved: their page went to another class).\n# TYPE tarn_kv_class gauge\n");
    for (tenant, kv) in engines {
        let tenant = name(tenant.as_bytes());
        for c in kv.class_reports() {
            for (what, v) in c.named() {
                let _ = writeln!(
                    out,
                    "tarn_kv_class{{tenant=\"{tenant}\",slot_bytes=\"{}\",counter=\"{what}\"}} {v}",
                    c.slot_bytes
                );
            }
        }
    }
    out.push_str("# HELP tarn_kv_namespace KV counters per namespace (gets, hits by tier, misses by reason, puts, cluster routing: fallback gets and hits, copies, hot blocks).\n# TYPE tarn_kv_namespace counter\n");
    for (tenant, kv) in engines {
        let tenant = name(tenant.as_bytes());
        for (ns, s) in kv.namespace_stats() {
            let ns = name(&ns);
            for (what, v) in s.named() {
                let _ = writeln!(
                    out,
                    "tarn_kv_namespace{{tenant=\"{tenant}\",namespace=\"{ns}\",counter=\"{what}\"}} {v}"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Method;

    #[test]
    fn names() {
        assert_eq!(
            operation(&Method::GET, "/", "", false, false),
            "ListBuckets"
        );
        assert_eq!(
            operation(&Method::GET, "/b", "list-type=2&prefix=a", false, false),
            "ListObjectsV2"
        );
        assert_eq!(
            operation(&Method::PUT, "/b/k/x", "", false, false),
            "PutObject"
        );
        assert_eq!(
            operation(&Method::PUT, "/k", "partNumber=1&uploadId=x", true, false),
            "UploadPart"
        );
        assert_eq!(operation(&Method::GET, "/", "", true, false), "ListObjects");
        assert_eq!(
            operation(&Method::POST, "/b", "delete", false, false),
            "DeleteObjects"
        );
    }

    #[test]
    fn every_operation_by_its_aws_name() {
        let cases: &[(Method, &str, &str, bool, &str)] = &[
            (
                Method::PUT,
                "/b",
                "lifecycle",
                false,
                "PutBucketLifecycleConfiguration",
            ),
            (
                Method::GET,
                "/b",
                "lifecycle",
                false,
                "GetBucketLifecycleConfiguration",
            ),
            (
                Method::DELETE,
                "/b",
                "lifecycle",
                false,
                "DeleteBucketLifecycle",
            ),
            (
                Method::GET,
                "/b/k",
                "attributes",
                false,
                "GetObjectAttributes",
            ),
            (Method::PUT, "/b", "cors", false, "PutBucketCors"),
            (Method::OPTIONS, "/b/k", "", false, "PreflightRequest"),
            (Method::POST, "/b", "", false, "PostObject"),
            (
                Method::GET,
                "/b",
                "encryption",
                false,
                "GetBucketEncryption",
            ),
            (
                Method::PUT,
                "/b",
                "object-lock",
                false,
                "PutObjectLockConfiguration",
            ),
            (
                Method::PUT,
                "/b/k",
                "retention",
                false,
                "PutObjectRetention",
            ),
            (
                Method::GET,
                "/b/k",
                "legal-hold",
                false,
                "GetObjectLegalHold",
            ),
            (Method::POST, "/b/k", "restore", false, "RestoreObject"),
            (
                Method::POST,
                "/b/k",
                "select&select-type=2",
                false,
                "SelectObjectContent",
            ),
            (Method::GET, "/b", "tagging", false, "GetBucketTagging"),
            (
                Method::DELETE,
                "/b/k",
                "tagging",
                false,
                "DeleteObjectTagging",
            ),
            (
                Method::GET,
                "/b",
                "metrics",
                false,
                "ListBucketMetricsConfigurations",
            ),
            (
                Method::GET,
                "/b",
                "metrics&id=x",
                false,
                "GetBucketMetricsConfiguration",
            ),
            (
                Method::GET,
                "/b",
                "policyStatus",
                false,
                "GetBucketPolicyStatus",
            ),
            (Method::GET, "/b", "policy", false, "GetBucketPolicy"),
            (
                Method::GET,
                "/b",
                "versions&prefix=a",
                false,
                "ListObjectVersions",
            ),
            (Method::PUT, "/b", "", false, "CreateBucket"),
            (Method::GET, "/", "logging", true, "GetBucketLogging"),
            (
                Method::GET,
                "/b",
                "requestPayment",
                false,
                "GetBucketRequestPayment",
            ),
            (Method::PUT, "/b/k", "", false, "PutObject"),
            (Method::PATCH, "/b/k", "", false, "Other"),
            (Method::PUT, "/b", "location", false, "Other"),
        ];
        for (m, path, query, vhost, want) in cases {
            assert_eq!(
                operation(m, path, query, *vhost, false),
                *want,
                "{m} {path}?{query}"
            );
        }
        assert_eq!(
            operation(&Method::PUT, "/b/k", "partNumber=2&uploadId=u", false, true),
            "UploadPartCopy"
        );
        assert_eq!(
            operation(&Method::PUT, "/b/k", "", false, true),
            "CopyObject"
        );
    }
}
