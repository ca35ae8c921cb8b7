//! `tarn bench kv`: a load generator for the KV-cache store.
//!
//! Each of `--concurrency` clients is a thread with its own connection (over
//! shared memory or TCP), as each of an inference engine's loader threads
//! would be. A client issues batches of `--batch` blocks one after another,
//! keys drawn from a working set of `--working-set` bytes (uniformly, or Zipf
//! with `--zipf S`). Latency is recorded per batch in an HDR histogram. The
//! working set is written once before a get, exists or mixed run (blocks
//! already there from an earlier run are kept). Puts always write new blocks,
//! as an engine storing new prefixes does: once RAM is full they evict older
//! ones, which shows in a mixed run's hit rate.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use tarn_client::{
    BlockingKvClient, ConnectOptions, GetInto, PutFrom, RegisteredBuffer, Status, TransportChoice,
    WriteIo,
};
use tarn_kv::Credentials;

use crate::bench::{errors_json, finish, json_string, parse_duration, Outcome};
use crate::config::parse_size;

#[derive(clap::Args, Clone)]
pub struct KvBenchArgs {
    /// KV endpoint (host:port of `tarn server --kv`; `KEY:SECRET@host:port`
    /// for credentials of its own).
    #[arg(long, default_value = "127.0.0.1:9400")]
    pub endpoint: String,
    /// Access key (default: the built-in loopback credentials).
    #[arg(long, env = "TARN_ACCESS_KEY", hide_env_values = true)]
    pub access_key: Option<String>,
    /// Secret key.
    #[arg(long, env = "TARN_SECRET_KEY", hide_env_values = true)]
    pub secret_key: Option<String>,
    /// Bytes per block, e.g. 64KiB, 256KiB, 2MiB.
    #[arg(long, default_value = "256KiB")]
    pub block_size: String,
    /// Blocks per batch (one request).
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// put, get, exists or mixed (80% get, 20% put).
    #[arg(long, default_value = "get")]
    pub op: String,
    /// Client threads, one connection each.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// shm, tcp or auto (shared memory when the server is on this host).
    #[arg(long, default_value = "auto")]
    pub transport: String,
    /// Bytes of distinct blocks the keys are drawn from, e.g. 1GiB.
    #[arg(long, default_value = "256MiB")]
    pub working_set: String,
    /// Zipf exponent of key popularity (0: uniform).
    #[arg(long, default_value_t = 0.0)]
    pub zipf: f64,
    /// Run time, e.g. 10s (ignored when --count is given).
    #[arg(long, default_value = "10s")]
    pub duration: String,
    /// Stop after this many batches in all.
    #[arg(long)]
    pub count: Option<u64>,
    /// Namespace of the bench's blocks (default: one per block size).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Check every byte read against what was written.
    #[arg(long)]
    pub verify: bool,
    /// Puts from the client's registered buffer (`put_registered`): over
    /// shared memory the buffer is the put window of a connection of its
    /// own, and the daemon copies each value straight out of it (one copy,
    /// as with Mooncake's segment in the writing process). Without it puts
    /// are `put_from` of any memory: the client copies into its window,
    /// the daemon from there.
    #[arg(long)]
    pub registered: bool,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Another KV endpoint to run the same workload against (repeatable),
    /// in alternation with --endpoint; ratios to --endpoint are printed.
    #[arg(long)]
    pub compare: Vec<String>,
    /// Phases per endpoint when comparing (each --duration / rounds long).
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
}

/// `KEY:SECRET@host:port` → (`host:port`, its credentials); a plain
/// `host:port` has none of its own. Printed names never carry the secret.
fn split_credentials(endpoint: &str) -> anyhow::Result<(String, Option<Credentials>)> {
    match endpoint.rsplit_once('@') {
        None => Ok((endpoint.to_string(), None)),
        Some((userinfo, addr)) => {
            let Some((a, s)) = userinfo.split_once(':') else {
                bail!("credentials in an endpoint are KEY:SECRET@host:port");
            };
            Ok((addr.to_string(), Some(Credentials::new(a, s))))
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KvOp {
    Put,
    Get,
    Exists,
    Mixed,
}

struct Plan {
    opts: ConnectOptions,
    block: usize,
    batch: usize,
    blocks: u64,
    op: KvOp,
    verify: bool,
    registered: bool,
    zipf: Option<Zipf>,
    /// Key series of this run's puts (never 0, the working set's).
    put_series: u64,
}

/// What the clients add up.
struct Totals {
    batches: AtomicU64,
    bytes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    verify_failures: AtomicU64,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
    hist: Mutex<Histogram<u64>>,
}

impl Totals {
    fn error(&self, kind: String) {
        *self.errors.lock().expect("errors").entry(kind).or_default() += 1;
    }
}

/// The bytes of block `i`: distinct per block and position, cheap to make
/// again for --verify.
pub fn block_bytes(i: u64, out: &mut [u8]) {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// The key of block `i` of a series: series 0 is the working set, the same
/// in every run; puts write a series of their own per run.
fn digest(series: u64, i: u64) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_le_bytes());
    d[8..16].copy_from_slice(&i.wrapping_mul(0xff51_afd7_ed55_8ccd).to_le_bytes());
    d[16..24].copy_from_slice(&series.to_le_bytes());
    d[24..32].copy_from_slice(b"tarnbnch");
    d
}

/// Zipf-distributed ranks over `n` keys, by inverse CDF on a table.
struct Zipf {
    cdf: Vec<f64>,
}

/// Largest batch of buffers one client holds (--block-size × --batch).
const BATCH_BUFFER_BYTES_MAX: usize = 4 << 30;

/// Keys a Zipf table covers; a larger working set draws its ranks from this
/// many and spreads them over the rest.
const ZIPF_TABLE_KEYS_MAX: u64 = 1 << 22;

impl Zipf {
    fn new(n: u64, s: f64) -> Zipf {
        let n = n.clamp(1, ZIPF_TABLE_KEYS_MAX);
        let mut cdf = Vec::with_capacity(n as usize);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Zipf { cdf }
    }
    /// A rank in 0..n for a uniform `u` in [0, 1).
    fn rank(&self, u: f64) -> u64 {
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) as u64
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Plan {
    fn key(&self, rng: &mut Rng) -> u64 {
        match &self.zipf {
            // Ranks are scattered over the keys so that hot keys are not
            // neighbours in the arena.
            Some(z) => z.rank(rng.unit()).wrapping_mul(0x9e37_79b9) % self.blocks,
            None => rng.next() % self.blocks,
        }
    }
}

pub fn run(args: KvBenchArgs) -> anyhow::Result<()> {
    let block = parse_size(&args.block_size)? as usize;
    let working_set = parse_size(&args.working_set)?;
    let op = match args.op.as_str() {
        "put" => KvOp::Put,
        "get" => KvOp::Get,
        "exists" => KvOp::Exists,
        "mixed" => KvOp::Mixed,
        other => bail!("unknown --op {other:?}: put, get, exists or mixed"),
    };
    let transport = match args.transport.as_str() {
        "shm" => TransportChoice::Shm,
        "tcp" => TransportChoice::Tcp,
        "auto" => TransportChoice::Auto,
        other => bail!("unknown --transport {other:?}: shm, tcp or auto"),
    };
    if block == 0 || args.batch == 0 || args.concurrency == 0 {
        bail!("--block-size, --batch and --concurrency must be positive");
    }
    // Each client holds one batch of buffers (and the prefill one more).
    if block
        .checked_mul(args.batch)
        .is_none_or(|b| b > BATCH_BUFFER_BYTES_MAX)
    {
        bail!(
            "--block-size × --batch must stay within {} GiB per client",
            BATCH_BUFFER_BYTES_MAX >> 30
        );
    }
    if !(0.0..=10.0).contains(&args.zipf) {
        bail!("--zipf must be between 0 and 10");
    }
    let blocks = (working_set / block as u64).max(args.batch as u64);
    let duration = parse_duration(&args.duration)?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| format!("tarn-bench/{block}"));
    let plan = Arc::new(Plan {
        opts: ConnectOptions {
            transport,
            namespace: namespace.into_bytes(),
            ..Default::default()
        },
        block,
        batch: args.batch,
        blocks,
        op,
        verify: args.verify,
        registered: args.registered,
        zipf: (args.zipf > 0.0).then(|| Zipf::new(blocks, args.zipf)),
        put_series: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1,
    });

    let creds = match (&args.access_key, &args.secret_key) {
        (Some(a), Some(s)) => Some(Credentials::new(a.clone(), s.clone())),
        (None, None) => None,
        _ => bail!("give both --access-key and --secret-key, or neither"),
    };
    let mut targets = vec![split_credentials(&args.endpoint)?];
    for c in &args.compare {
        targets.push(split_credentials(c)?);
    }
    let endpoints: Vec<String> = targets.iter().map(|t| t.0.clone()).collect();
    // Connect every client first: a shared-memory client maps the arena and
    // faults it in, which must not count against the run.
    let mut fleets: Vec<Vec<BlockingKvClient>> = Vec::with_capacity(endpoints.len());
    for (endpoint, own) in &targets {
        let mut clients = Vec::with_capacity(args.concurrency);
        let opts = ConnectOptions {
            credentials: own.clone().or(creds.clone()),
            ..plan.opts.clone()
        };
        for _ in 0..args.concurrency {
            clients.push(
                BlockingKvClient::connect(endpoint, opts.clone())
                    .with_context(|| format!("connecting to {endpoint}"))?,
            );
        }
        if op != KvOp::Put {
            prefill(&plan, &mut clients)?;
        }
        fleets.push(clients);
    }
    let transports: Vec<String> = fleets
        .iter()
        .map(|c| format!("{:?}", c[0].transport()).to_lowercase())
        .collect();
    // Alternating phases (`bench::phase_order`), each endpoint getting the
    // same share of the run, so that a noisy machine weighs on every endpoint
    // alike.
    let rounds = if endpoints.len() > 1 {
        args.rounds.max(1)
    } else {
        1
    };
    let mut reports: Vec<Report> = transports
        .iter()
        .map(|t| Report::empty(&args.op, t, block, plan.batch, args.concurrency))
        .collect();
    for round in 0..rounds {
        for i in crate::bench::phase_order(round, endpoints.len()) {
            let endpoint = &endpoints[i];
            let count = args
                .count
                .map(|c| c / rounds as u64 + u64::from((round as u64) < c % rounds as u64));
            let label = if endpoints.len() > 1 {
                format!("[{endpoint}] ")
            } else {
                String::new()
            };
            let clients = std::mem::take(&mut fleets[i]);
            let (clients, phase) = run_phase(
                clients,
                &plan,
                duration / rounds as u32,
                count,
                !args.json,
                &label,
            )?;
            fleets[i] = clients;
            reports[i].merge(&phase);
        }
    }
    if !args.json {
        eprintln!();
    }
    let named: Vec<_> = reports.iter().map(Report::named).collect();
    let outcomes: Vec<Outcome> = reports
        .iter()
        .map(|r| Outcome {
            json: r.json(),
            text: r.text(args.verify),
            errors: r.errors.values().sum(),
            verify_failures: r.verify_failures,
        })
        .collect();
    finish(args.json, rounds, &endpoints, &outcomes, &named)
}

/// One timed phase of every client of one endpoint: `duration`, or `count`
/// batches in all. Returns the clients for the next phase.
fn run_phase(
    clients: Vec<BlockingKvClient>,
    plan: &Arc<Plan>,
    duration: Duration,
    count: Option<u64>,
    progress: bool,
    label: &str,
) -> anyhow::Result<(Vec<BlockingKvClient>, Report<'static>)> {
    let totals = Arc::new(Totals {
        batches: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        hits: AtomicU64::new(0),
        misses: AtomicU64::new(0),
        verify_failures: AtomicU64::new(0),
        errors: Mutex::new(Default::default()),
        hist: Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3)?),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(n, mut client)| {
            let (plan, totals, stop) = (plan.clone(), totals.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("bench-kv-{n}"))
                .spawn(move || {
                    client_loop(n, &mut client, &plan, &totals, &stop, count);
                    client
                })
                .expect("spawn bench thread")
        })
        .collect();
    let mut last = (Instant::now(), 0u64);
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(100));
        if count.is_none() && start.elapsed() >= duration {
            stop.store(true, Ordering::Relaxed);
        }
        if handles.iter().all(|h| h.is_finished()) {
            break;
        }
        if progress && last.0.elapsed() >= Duration::from_secs(1) {
            let b = totals.bytes.load(Ordering::Relaxed);
            eprint!(
                "\r{label}{:>6.1} s  {:>9.1} MB/s  {:>9} batches ",
                start.elapsed().as_secs_f64(),
                (b - last.1) as f64 / last.0.elapsed().as_secs_f64() / 1e6,
                totals.batches.load(Ordering::Relaxed)
            );
            last = (Instant::now(), b);
        }
    }
    let mut clients = Vec::with_capacity(handles.len());
    for h in handles {
        clients.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("bench thread panicked"))?,
        );
    }
    let phase = Report {
        seconds: start.elapsed().as_secs_f64(),
        batches: totals.batches.load(Ordering::Relaxed),
        bytes: totals.bytes.load(Ordering::Relaxed),
        hits: totals.hits.load(Ordering::Relaxed),
        misses: totals.misses.load(Ordering::Relaxed),
        verify_failures: totals.verify_failures.load(Ordering::Relaxed),
        errors: totals.errors.lock().expect("errors").clone(),
        hist: totals.hist.lock().expect("hist").clone(),
        ..Report::empty("", "", plan.block, plan.batch, 0)
    };
    Ok((clients, phase))
}

/// Writes the working set once, split among the clients.
fn prefill(plan: &Plan, clients: &mut [BlockingKvClient]) -> anyhow::Result<()> {
    let mut data = vec![0u8; plan.block * plan.batch];
    let mut next = 0u64;
    while next < plan.blocks {
        let n = (plan.blocks - next).min(plan.batch as u64) as usize;
        for (j, chunk) in data.chunks_mut(plan.block).take(n).enumerate() {
            block_bytes(next + j as u64, chunk);
        }
        let items: Vec<PutFrom> = data
            .chunks(plan.block)
            .take(n)
            .enumerate()
            .map(|(j, d)| PutFrom {
                digest: digest(0, next + j as u64),
                data: d,
            })
            .collect();
        let c = &mut clients[(next / plan.batch as u64) as usize % clients.len()];
        let st = c.put_from(&items).context("writing the working set")?;
        if let Some(bad) = st
            .iter()
            .find(|s| !matches!(s, Status::Ok | Status::AlreadyExists))
        {
            bail!("writing the working set: {bad:?}");
        }
        next += n as u64;
    }
    Ok(())
}

fn client_loop(
    n: usize,
    client: &mut BlockingKvClient,
    plan: &Plan,
    totals: &Totals,
    stop: &AtomicBool,
    count: Option<u64>,
) {
    let mut rng = Rng(0x7461_726e_6b76_0001 ^ ((n as u64 + 1) << 32));
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram");
    // Page-aligned and pinned, as an engine's KV buffers are.
    let mut buf = match RegisteredBuffer::new(plan.block * plan.batch) {
        Ok(b) => b,
        Err(e) => {
            totals.error(format!("buffer: {e}"));
            return;
        }
    };
    let mut expected = vec![0u8; if plan.verify { plan.block } else { 0 }];
    let mut keys = vec![0u64; plan.batch];
    // Each client's puts have their own range of the run's series.
    let mut put_seq = (n as u64) << 40;
    let mut put_filled = false;
    while !stop.load(Ordering::Relaxed) {
        if let Some(limit) = count {
            if totals.batches.fetch_add(1, Ordering::Relaxed) >= limit {
                totals.batches.fetch_sub(1, Ordering::Relaxed);
                break;
            }
        }
        let op = match plan.op {
            KvOp::Mixed if rng.next().is_multiple_of(5) => KvOp::Put,
            KvOp::Mixed => KvOp::Get,
            op => op,
        };
        if op == KvOp::Put {
            for k in keys.iter_mut() {
                *k = put_seq;
                put_seq += 1;
            }
        } else {
            for k in keys.iter_mut() {
                *k = plan.key(&mut rng);
            }
        }
        let t = Instant::now();
        let (bytes, hits) = match op {
            KvOp::Put => {
                // Generated content costs about as much as the put itself:
                // each slot of the buffer gets a block's pattern once, and
                // later puts only stamp their key into its first bytes (no
                // put is read back and verified; they are their own series).
                for (k, chunk) in keys.iter().zip(buf.as_mut_slice().chunks_mut(plan.block)) {
                    if !put_filled {
                        block_bytes(*k, chunk);
                    }
                    let n = chunk.len().min(8);
                    chunk[..n].copy_from_slice(&k.to_le_bytes()[..n]);
                }
                put_filled = true;
                let t0 = Instant::now();
                let put = if plan.registered {
                    let ios: Vec<WriteIo> = keys
                        .iter()
                        .enumerate()
                        .map(|(i, k)| WriteIo {
                            digest: digest(plan.put_series, *k),
                            buf_offset: i * plan.block,
                            len: plan.block,
                        })
                        .collect();
                    client.put_registered(&buf, &ios)
                } else {
                    let items: Vec<PutFrom> = keys
                        .iter()
                        .zip(buf.as_slice().chunks(plan.block))
                        .map(|(k, d)| PutFrom {
                            digest: digest(plan.put_series, *k),
                            data: d,
                        })
                        .collect();
                    client.put_from(&items)
                };
                match put {
                    Ok(st) => {
                        hist.record(t0.elapsed().as_nanos().max(1) as u64).ok();
                        let mut stored = 0;
                        for s in &st {
                            match s {
                                Status::Ok => stored += 1,
                                s => totals.error(format!("put: {s:?}")),
                            }
                        }
                        (stored * plan.block, 0)
                    }
                    Err(e) => {
                        totals.error(format!("put: {e}"));
                        continue;
                    }
                }
            }
            KvOp::Exists => {
                let digests: Vec<[u8; 32]> = keys.iter().map(|k| digest(0, *k)).collect();
                match client.exists(&digests) {
                    Ok(r) => {
                        hist.record(t.elapsed().as_nanos().max(1) as u64).ok();
                        (0, r.present.iter().filter(|p| **p).count())
                    }
                    Err(e) => {
                        totals.error(format!("exists: {e}"));
                        continue;
                    }
                }
            }
            KvOp::Get | KvOp::Mixed => {
                let mut reqs: Vec<GetInto> = keys
                    .iter()
                    .zip(buf.as_mut_slice().chunks_mut(plan.block))
                    .map(|(k, b)| GetInto::whole(digest(0, *k), b))
                    .collect();
                match client.get_into(&mut reqs) {
                    Ok(out) => {
                        hist.record(t.elapsed().as_nanos().max(1) as u64).ok();
                        let mut hits = 0;
                        for (i, o) in out.iter().enumerate() {
                            match o.status {
                                Status::Ok => hits += 1,
                                Status::NotFound => {}
                                s => totals.error(format!("get: {s:?}")),
                            }
                            if plan.verify && o.status == Status::Ok {
                                block_bytes(keys[i], &mut expected);
                                let got = &buf.as_slice()[i * plan.block..][..o.len as usize];
                                if o.len as usize != plan.block || got != &expected[..] {
                                    totals.verify_failures.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        (hits * plan.block, hits)
                    }
                    Err(e) => {
                        totals.error(format!("get: {e}"));
                        continue;
                    }
                }
            }
        };
        if count.is_none() {
            totals.batches.fetch_add(1, Ordering::Relaxed);
        }
        totals.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if op != KvOp::Put {
            totals.hits.fetch_add(hits as u64, Ordering::Relaxed);
            totals
                .misses
                .fetch_add((keys.len() - hits) as u64, Ordering::Relaxed);
        }
    }
    totals.hist.lock().expect("hist").add(&hist).ok();
}

/// The figures of one run, and their two renderings.
pub struct Report<'a> {
    pub op: &'a str,
    pub transport: &'a str,
    pub block: usize,
    pub batch: usize,
    pub concurrency: usize,
    pub seconds: f64,
    pub batches: u64,
    pub bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub verify_failures: u64,
    pub errors: std::collections::BTreeMap<String, u64>,
    /// Per-batch latency in nanoseconds.
    pub hist: Histogram<u64>,
}

impl<'a> Report<'a> {
    pub fn empty(
        op: &'a str,
        transport: &'a str,
        block: usize,
        batch: usize,
        concurrency: usize,
    ) -> Report<'a> {
        Report {
            op,
            transport,
            block,
            batch,
            concurrency,
            seconds: 0.0,
            batches: 0,
            bytes: 0,
            hits: 0,
            misses: 0,
            verify_failures: 0,
            errors: Default::default(),
            hist: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds"),
        }
    }

    /// Adds another phase's figures (same workload) to these.
    pub fn merge(&mut self, o: &Report<'_>) {
        self.seconds += o.seconds;
        self.batches += o.batches;
        self.bytes += o.bytes;
        self.hits += o.hits;
        self.misses += o.misses;
        self.verify_failures += o.verify_failures;
        for (k, v) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
        self.hist.add(&o.hist).expect("histograms of equal bounds");
    }

    /// The figures compared between endpoints, by name.
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("batches_per_sec", self.batches_per_sec()),
            ("mb_per_sec", self.mb_per_sec()),
            ("hit_rate", self.hit_rate_percent().unwrap_or(0.0)),
            ("p50_us", self.latency_us(0.5)),
            ("p90_us", self.latency_us(0.9)),
            ("p99_us", self.latency_us(0.99)),
            ("p999_us", self.latency_us(0.999)),
            ("max_us", self.hist.max() as f64 / 1000.0),
        ]
    }

    pub fn batches_per_sec(&self) -> f64 {
        self.batches as f64 / self.seconds.max(1e-9)
    }
    pub fn mb_per_sec(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e6
    }
    /// Share of looked-up keys that were found (gets and exists), in
    /// percent; None when nothing was looked up (a put run).
    pub fn hit_rate_percent(&self) -> Option<f64> {
        let looked = self.hits + self.misses;
        (looked > 0).then(|| 100.0 * self.hits as f64 / looked as f64)
    }
    /// Latency at quantile `q`, in microseconds.
    pub fn latency_us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }

    pub fn text(&self, verify: bool) -> String {
        let mut s = format!(
            "kv {} block {} batch {} concurrency {} over {}: {} batches in {:.2} s\n",
            self.op,
            self.block,
            self.batch,
            self.concurrency,
            self.transport,
            self.batches,
            self.seconds
        );
        s += &format!(
            "  {:.1} batches/s, {:.1} blocks/s, {:.1} MB/s",
            self.batches_per_sec(),
            self.batches_per_sec() * self.batch as f64,
            self.mb_per_sec(),
        );
        if let Some(h) = self.hit_rate_percent() {
            s += &format!(", hit rate {h:.1}%");
        }
        s += "\n";
        s += &format!(
            "  latency per batch us: p50 {:.1}  p90 {:.1}  p99 {:.1}  p999 {:.1}  max {:.1}\n",
            self.latency_us(0.5),
            self.latency_us(0.9),
            self.latency_us(0.99),
            self.latency_us(0.999),
            self.hist.max() as f64 / 1000.0
        );
        if !self.errors.is_empty() {
            s += &format!("  errors: {:?}\n", self.errors);
        }
        if verify {
            s += &format!("  verify failures: {}\n", self.verify_failures);
        }
        s
    }

    pub fn json(&self) -> String {
        format!(
            "{{\"op\":{},\"transport\":{},\"block_bytes\":{},\"batch\":{},\"concurrency\":{},\"seconds\":{:.3},\"batches\":{},\"batches_per_sec\":{:.1},\"mb_per_sec\":{:.1},\"hit_rate_percent\":{},\"latency_us\":{{\"p50\":{:.1},\"p90\":{:.1},\"p99\":{:.1},\"p999\":{:.1},\"max\":{:.1}}},\"errors\":{{{}}},\"verify_failures\":{}}}",
            json_string(self.op),
            json_string(self.transport),
            self.block,
            self.batch,
            self.concurrency,
            self.seconds,
            self.batches,
            self.batches_per_sec(),
            self.mb_per_sec(),
            self.hit_rate_percent()
                .map_or("null".to_string(), |h| format!("{h:.2}")),
            self.latency_us(0.5),
            self.latency_us(0.9),
            self.latency_us(0.99),
            self.latency_us(0.999),
            self.hist.max() as f64 / 1000.0,
            errors_json(&self.errors),
            self.verify_failures
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::ratios;

    fn report(hist: Histogram<u64>) -> Report<'static> {
        Report {
            op: "get",
            transport: "shm",
            block: 1 << 20,
            batch: 4,
            concurrency: 1,
            seconds: 2.0,
            batches: 100,
            bytes: 300 << 20,
            hits: 300,
            misses: 100,
            verify_failures: 0,
            errors: [("get: \"x\"".to_string(), 2)].into_iter().collect(),
            hist,
        }
    }

    #[test]
    fn report_arithmetic() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        // 1..=1000 microseconds, one sample each.
        for us in 1..=1000u64 {
            h.record(us * 1000).unwrap();
        }
        let r = report(h);
        assert_eq!(r.batches_per_sec(), 50.0);
        assert!((r.mb_per_sec() - 157.286_4).abs() < 1e-3);
        assert_eq!(r.hit_rate_percent(), Some(75.0));
        // HDR with 3 significant digits: within 0.1% of the exact quantile.
        for (q, exact) in [(0.5, 500.0), (0.9, 900.0), (0.99, 990.0), (0.999, 999.0)] {
            let got = r.latency_us(q);
            assert!((got - exact).abs() <= exact * 0.001 + 0.001, "q {q}: {got}");
        }
        let j = r.json();
        assert!(j.contains("\"hit_rate_percent\":75.00"), "{j}");
        assert!(j.contains("\"get: \\\"x\\\"\":2"), "{j}");
        assert!(r.text(true).contains("hit rate 75.0%"));
        let puts = Report {
            hits: 0,
            misses: 0,
            ..report(Histogram::new(3).unwrap())
        };
        assert!(puts.json().contains("\"hit_rate_percent\":null"));
        assert!(!puts.text(false).contains("hit rate"));
    }

    #[test]
    fn phases_merge_and_compare() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).unwrap();
        for us in 1..=1000u64 {
            h.record(us * 1000).unwrap();
        }
        let a = report(h.clone());
        let mut total = Report::empty("get", "shm", 1 << 20, 4, 1);
        total.merge(&a);
        total.merge(&a);
        assert_eq!((total.batches, total.seconds), (200, 4.0));
        assert_eq!(total.batches_per_sec(), 50.0);
        assert_eq!(total.hit_rate_percent(), Some(75.0));
        assert_eq!(total.errors["get: \"x\""], 4);
        assert_eq!(total.hist.len(), 2000);
        // Twice the work in the same time: rates double, latency unchanged.
        let mut b = report(h);
        b.batches *= 2;
        b.bytes *= 2;
        let r: std::collections::HashMap<_, _> =
            ratios(&a.named(), &b.named()).into_iter().collect();
        assert_eq!(r["batches_per_sec"], 2.0);
        assert_eq!(r["mb_per_sec"], 2.0);
        assert_eq!(r["hit_rate"], 1.0);
        assert_eq!(r["p50_us"], 1.0);
        let empty = Report::empty("get", "shm", 1, 1, 1);
        assert_eq!(ratios(&empty.named(), &a.named())[0].1, 0.0);
    }

    #[test]
    fn zipf_prefers_low_ranks_and_stays_in_range() {
        let z = Zipf::new(1000, 1.0);
        let mut rng = Rng(42);
        let mut counts = vec![0u32; 1000];
        for _ in 0..100_000 {
            counts[z.rank(rng.unit()) as usize] += 1;
        }
        // Rank 0 holds 1/H(1000) ~ 13.4% of the draws; rank 999 ~ 0.013%.
        assert!(counts[0] > 12_000 && counts[0] < 15_000, "{}", counts[0]);
        assert!(counts[0] > 5 * counts[9]);
        assert_eq!(z.rank(0.0), 0);
        assert_eq!(z.rank(0.999_999_999), 999);
    }

    #[test]
    fn block_bytes_differ_by_block() {
        let (mut a, mut b) = (vec![0u8; 100], vec![0u8; 100]);
        block_bytes(1, &mut a);
        block_bytes(2, &mut b);
        assert_ne!(a, b);
        let mut a2 = vec![0u8; 100];
        block_bytes(1, &mut a2);
        assert_eq!(a, a2);
    }
}
