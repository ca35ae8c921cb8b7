//! `tarn bench s3`: a load generator for any S3-compatible endpoint.
//!
//! Each worker owns one keep-alive HTTP/1.1 connection and issues requests one
//! after another; workers are spread over one single-threaded runtime per
//! thread. Requests are signed with SigV4 (unsigned payload). Latency is
//! recorded per request, from sending the head to the last body byte, in an
//! HDR histogram.
//!
//! With `--compare`, the same workload runs against several endpoints in
//! alternation (A B C, B C A, ...: `phase_order`) and each figure is also given as a ratio to the
//! first endpoint's, so that a comparison holds on a noisy machine.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use tarn_client::sigv4::{self, Signer};

#[derive(clap::Args, Clone)]
pub struct S3BenchArgs {
    /// Endpoint, e.g. http://127.0.0.1:9000 (path-style requests); `sink`
    /// runs against a trivial in-process responder that stores nothing, which
    /// measures the bench's own ceiling.
    #[arg(long)]
    pub endpoint: String,
    #[arg(long, env = "AWS_ACCESS_KEY_ID")]
    pub access_key: String,
    #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
    pub secret_key: String,
    #[arg(long, default_value = "us-east-1")]
    pub region: String,
    /// Bucket to use; created and removed unless --keep. Default: a fresh name.
    #[arg(long)]
    pub bucket: Option<String>,
    /// put, get, mixed (70% get, 30% put), list, or multipart (each
    /// operation one whole multipart upload of --size in --part-size parts).
    #[arg(long, default_value = "put")]
    pub op: String,
    /// Part size of --op multipart.
    #[arg(long, default_value = "8MiB")]
    pub part_size: String,
    /// Object size, e.g. 4KiB, 1MiB, 64MiB.
    #[arg(long, default_value = "1MiB")]
    pub size: String,
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Run time, e.g. 10s (ignored when --count is given).
    #[arg(long, default_value = "10s")]
    pub duration: String,
    /// Stop after this many operations.
    #[arg(long)]
    pub count: Option<u64>,
    /// Distinct objects written (put cycles over them; get reads them).
    #[arg(long, default_value_t = 64)]
    pub objects: u64,
    /// Check every byte read against what was written.
    #[arg(long)]
    pub verify: bool,
    /// Keep the bucket and objects afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Client threads (one runtime each); default: available cores.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Another endpoint to run the same workload against (repeatable), in
    /// alternation with --endpoint; `http://KEY:SECRET@host:port` gives it
    /// credentials of its own. Ratios to --endpoint are printed.
    #[arg(long)]
    pub compare: Vec<String>,
    /// Phases per endpoint when comparing (each --duration / rounds long).
    #[arg(long, default_value_t = 4)]
    pub rounds: usize,
    /// For https:// endpoints: the CA bundle (PEM) their certificates are
    /// checked against (default: the system's trusted roots).
    #[arg(long, env = "AWS_CA_BUNDLE")]
    pub ca_bundle: Option<std::path::PathBuf>,
    /// The server's process ID on this host (repeatable: --endpoint's, then
    /// each --compare's): its CPU time (user + system, /proc/PID/stat, all
    /// its threads) over the timed run is reported per GB moved, next to
    /// the bench's own. Setup and teardown are not counted.
    #[arg(long)]
    pub server_pid: Vec<u32>,
}

struct Target {
    host: String,
    addr: String,
    signer: Signer,
    /// For an https:// endpoint.
    tls: Option<std::sync::Arc<tarn_io::tls::rustls::ClientConfig>>,
}

type Conn = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(t: &Target) -> anyhow::Result<Conn> {
    let stream = tokio::net::TcpStream::connect(&t.addr)
        .await
        .with_context(|| format!("connecting to {}", t.addr))?;
    stream.set_nodelay(true)?;
    let stream = tarn_io::tls::MaybeTls::connect(stream, t.tls.as_ref(), &t.addr)
        .await
        .with_context(|| format!("TLS to {}", t.addr))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// What a request got back.
struct Reply {
    status: u16,
    /// Body bytes received.
    len: u64,
    /// The body, when asked to keep it.
    body: Option<Bytes>,
    etag: Option<String>,
}

/// One signed request; returns the status and the body length (and the body
/// itself when `keep_body`).
async fn request(
    c: &mut Conn,
    t: &Target,
    method: &str,
    path: &str,
    query: &[(&str, &str)],
    body: Bytes,
    keep_body: bool,
) -> anyhow::Result<Reply> {
    let unix = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let mut uri = sigv4::uri_encode(path, true);
    if !query.is_empty() {
        let q: Vec<String> = query
            .iter()
            .map(|(k, v)| {
                if v.is_empty() {
                    sigv4::uri_encode(k, false)
                } else {
                    format!(
                        "{}={}",
                        sigv4::uri_encode(k, false),
                        sigv4::uri_encode(v, false)
                    )
                }
            })
            .collect();
        uri = format!("{uri}?{}", q.join("&"));
    }
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header(http::header::HOST, &t.host)
        .header(http::header::CONTENT_LENGTH, body.len());
    for (k, v) in t.signer.sign(method, &t.host, path, query, unix) {
        req = req.header(k, v);
    }
    let req = req.body(Full::new(body))?;
    c.ready().await?;
    let resp = c.send_request(req).await?;
    let status = resp.status().as_u16();
    let etag = resp
        .headers()
        .get(http::header::ETAG)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut body = resp.into_body();
    let mut len = 0u64;
    let mut kept = keep_body.then(bytes::BytesMut::new);
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            len += data.len() as u64;
            if let Some(k) = kept.as_mut() {
                k.extend_from_slice(&data);
            }
        }
    }
    Ok(Reply {
        status,
        len,
        body: kept.map(|k| k.freeze()),
        etag,
    })
}

/// Body of object `i`: a shared random buffer with the index stamped in front,
/// so a read of the wrong object is caught by --verify.
fn object_body(base: &Bytes, i: u64, stamp: bool) -> Bytes {
    if !stamp || base.len() < 8 {
        return base.clone();
    }
    let mut v = base.to_vec();
    v[..8].copy_from_slice(&i.to_le_bytes());
    Bytes::from(v)
}

#[derive(Default)]
struct Shared {
    hist: Mutex<Option<Histogram<u64>>>,
    ops: AtomicU64,
    bytes: AtomicU64,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
    verify_failures: AtomicU64,
}

impl Shared {
    fn error(&self, kind: String) {
        *self.errors.lock().expect("errors").entry(kind).or_default() += 1;
    }
}

/// What a run (or several phases of it, merged) measured at one endpoint.
#[derive(Clone)]
struct Figures {
    /// Latency per request in microseconds.
    hist: Histogram<u64>,
    ops: u64,
    bytes: u64,
    seconds: f64,
    errors: std::collections::BTreeMap<String, u64>,
    verify_failures: u64,
    /// CPU seconds of the server's process (with --server-pid) and of the
    /// bench itself over the timed run.
    server_cpu: Option<f64>,
    client_cpu: f64,
}

impl Figures {
    fn empty() -> anyhow::Result<Figures> {
        Ok(Figures {
            hist: Histogram::new_with_bounds(1, 3_600_000_000, 3)?,
            ops: 0,
            bytes: 0,
            seconds: 0.0,
            errors: Default::default(),
            verify_failures: 0,
            server_cpu: None,
            client_cpu: 0.0,
        })
    }
    fn merge(&mut self, o: &Figures) {
        if let Some(c) = o.server_cpu {
            self.server_cpu = Some(self.server_cpu.unwrap_or(0.0) + c);
        }
        self.client_cpu += o.client_cpu;
        self.hist.add(&o.hist).expect("histograms of equal bounds");
        self.ops += o.ops;
        self.bytes += o.bytes;
        self.seconds += o.seconds;
        for (k, v) in &o.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
        self.verify_failures += o.verify_failures;
    }
    fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.seconds.max(1e-9)
    }
    fn mb_per_sec(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e6
    }
    /// CPU seconds per GB (10^9 bytes) moved.
    fn per_gb(&self, cpu: f64) -> f64 {
        cpu / (self.bytes as f64 / 1e9).max(1e-12)
    }
    /// Latency at quantile `q` in milliseconds (`q` > 1: the maximum).
    fn ms(&self, q: f64) -> f64 {
        let us = if q > 1.0 {
            self.hist.max()
        } else {
            self.hist.value_at_quantile(q)
        };
        us as f64 / 1000.0
    }
    /// The figures compared between endpoints, by name.
    /// p50, p90, p99, p999 and max latency in ms.
    fn percentiles_ms(&self) -> [f64; 5] {
        [0.5, 0.9, 0.99, 0.999, 2.0].map(|q| self.ms(q))
    }
    fn named(&self) -> Vec<(&'static str, f64)> {
        let [p50, p90, p99, p999, max] = self.percentiles_ms();
        vec![
            ("ops_per_sec", self.ops_per_sec()),
            ("mb_per_sec", self.mb_per_sec()),
            ("p50_ms", p50),
            ("p90_ms", p90),
            ("p99_ms", p99),
            ("p999_ms", p999),
            ("max_ms", max),
            ("client_cpu_s_per_gb", self.per_gb(self.client_cpu)),
            (
                "server_cpu_s_per_gb",
                self.server_cpu.map_or(0.0, |c| self.per_gb(c)),
            ),
        ]
    }
    fn json(&self, args: &S3BenchArgs, size: usize) -> String {
        let [p50, p90, p99, p999, max] = self.percentiles_ms();
        format!(
            "{{\"op\":\"{}\",\"size_bytes\":{size},\"concurrency\":{},\"seconds\":{:.3},\"ops\":{},\"ops_per_sec\":{:.1},\"mb_per_sec\":{:.1},\"latency_ms\":{{\"p50\":{:.3},\"p90\":{:.3},\"p99\":{:.3},\"p999\":{:.3},\"max\":{:.3}}},\"errors\":{{{}}},\"verify_failures\":{},\"client_cpu_s_per_gb\":{:.4},\"server_cpu_s_per_gb\":{}}}",
            args.op,
            args.concurrency,
            self.seconds,
            self.ops,
            self.ops_per_sec(),
            self.mb_per_sec(),
            p50,
            p90,
            p99,
            p999,
            max,
            errors_json(&self.errors),
            self.verify_failures,
            self.per_gb(self.client_cpu),
            self.server_cpu
                .map_or("null".to_string(), |c| format!("{:.4}", self.per_gb(c)))
        )
    }
    fn text(&self, verify: bool) -> String {
        let [p50, p90, p99, p999, max] = self.percentiles_ms();
        let mut s = format!(
            "  {} ops in {:.2} s: {:.1} ops/s, {:.1} MB/s\n  latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  p999 {:.3}  max {:.3}\n",
            self.ops,
            self.seconds,
            self.ops_per_sec(),
            self.mb_per_sec(),
            p50,
            p90,
            p99,
            p999,
            max
        );
        s += &format!("  CPU s per GB: bench {:.3}", self.per_gb(self.client_cpu));
        if let Some(c) = self.server_cpu {
            s += &format!("  server {:.3}", self.per_gb(c));
        }
        s += "\n";
        if !self.errors.is_empty() {
            s += &format!("  errors: {:?}\n", self.errors);
        }
        if verify {
            s += &format!("  verify failures: {}\n", self.verify_failures);
        }
        s
    }
}

/// `http(s)://host:port`, or `http(s)://KEY:SECRET@host:port` for an
/// endpoint with credentials of its own.
fn target_for(endpoint: &str, args: &S3BenchArgs) -> anyhow::Result<Target> {
    let url = endpoint.trim_end_matches('/');
    let (rest, tls) = if let Some(r) = url.strip_prefix("http://") {
        (r, None)
    } else if let Some(r) = url.strip_prefix("https://") {
        let config = tarn_io::tls::client_config(args.ca_bundle.as_deref())
            .map_err(|e| anyhow::anyhow!("--ca-bundle: {e}"))?;
        (r, Some(config))
    } else {
        bail!("only http:// and https:// endpoints are supported: {endpoint}")
    };
    let (access_key, secret_key, hostport) = match rest.rsplit_once('@') {
        Some((user, hostport)) => match user.split_once(':') {
            Some((k, s)) => (k.to_string(), s.to_string(), hostport),
            None => bail!("credentials in {endpoint} must be KEY:SECRET"),
        },
        None => (args.access_key.clone(), args.secret_key.clone(), rest),
    };
    let addr = if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !hostport.ends_with(']')
    {
        hostport.to_string()
    } else {
        format!("{hostport}:{}", if tls.is_some() { 443 } else { 80 })
    };
    Ok(Target {
        host: hostport.to_string(),
        addr,
        tls,
        signer: Signer {
            access_key,
            secret_key,
            region: args.region.clone(),
            session_token: None,
        },
    })
}

pub fn run(args: S3BenchArgs) -> anyhow::Result<()> {
    let size = crate::config::parse_size(&args.size)? as usize;
    let duration = parse_duration(&args.duration)?;
    let threads = args
        .threads
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
        .clamp(1, args.concurrency.max(1));
    if !["put", "get", "mixed", "list", "multipart"].contains(&args.op.as_str()) {
        bail!("--op must be put, get, mixed, list or multipart");
    }
    let part_size = args.part_size_bytes()?;
    if args.server_pid.len() > 1 + args.compare.len() {
        bail!("--server-pid: at most one per endpoint (--endpoint, then each --compare)");
    }
    if let Some(pid) = args.server_pid.iter().find(|&&p| p == 0) {
        bail!("--server-pid {pid}: not a process ID");
    }
    for &pid in &args.server_pid {
        process_cpu(pid).with_context(|| format!("--server-pid {pid}"))?;
    }
    if args.op == "multipart" && part_size < 5 << 20 && part_size < size {
        bail!("--part-size must be at least 5MiB (S3's smallest part but the last)");
    }
    let mut base = vec![0u8; size];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for b in base.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let base = Bytes::from(base);
    let mut endpoints = vec![args.endpoint.clone()];
    endpoints.extend(args.compare.iter().cloned());
    for e in endpoints.iter_mut().filter(|e| *e == "sink") {
        *e = start_sink(base.clone(), args.verify, threads)?;
    }
    let targets: Vec<Arc<Target>> = endpoints
        .iter()
        .map(|e| target_for(e, &args).map(Arc::new))
        .collect::<anyhow::Result<_>>()?;
    // Alternating phases (`phase_order`), each endpoint getting the same
    // share of the run, so that a noisy machine weighs on every endpoint alike.
    let rounds = if targets.len() > 1 {
        args.rounds.max(1)
    } else {
        1
    };
    let bucket = args.bucket.clone().unwrap_or_else(|| {
        format!(
            "tarn-bench-{}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0)
        )
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;

    for target in &targets {
        rt.block_on(setup(target, &bucket, &args, &base))?;
    }
    let shown: Vec<String> = endpoints.iter().map(|e| redact(e)).collect();
    let mut figures = vec![Figures::empty()?; targets.len()];
    let mut outcome = Ok(());
    'rounds: for round in 0..rounds {
        for i in phase_order(round, targets.len()) {
            let target = &targets[i];
            let phase_count = args
                .count
                .map(|c| c / rounds as u64 + u64::from((round as u64) < c % rounds as u64));
            let label = if targets.len() > 1 {
                format!("[{}] ", shown[i])
            } else {
                String::new()
            };
            match phase(
                target,
                &bucket,
                &args,
                &base,
                duration / rounds as u32,
                phase_count,
                threads,
                &label,
                args.server_pid.get(i).copied(),
            ) {
                Ok(f) => figures[i].merge(&f),
                Err(e) => {
                    outcome = Err(e);
                    break 'rounds;
                }
            }
        }
    }
    if !args.json {
        eprintln!();
    }
    if !args.keep {
        for target in &targets {
            rt.block_on(teardown(target, &bucket, &args));
        }
    }
    outcome?;

    let named: Vec<_> = figures.iter().map(Figures::named).collect();
    if !args.json {
        println!(
            "op {} size {} concurrency {} threads {threads}{}",
            args.op,
            args.size,
            args.concurrency,
            if rounds > 1 {
                format!(", {rounds} alternating rounds")
            } else {
                String::new()
            }
        );
    }
    let outcomes: Vec<Outcome> = figures
        .iter()
        .map(|f| Outcome {
            json: f.json(&args, size),
            text: f.text(args.verify),
            errors: f.errors.values().sum(),
            verify_failures: f.verify_failures,
        })
        .collect();
    finish(args.json, rounds, &shown, &outcomes, &named)
}

/// The members of a JSON object counting errors by kind.
pub fn errors_json<K: AsRef<str>>(errors: &std::collections::BTreeMap<K, u64>) -> String {
    let each: Vec<String> = errors
        .iter()
        .map(|(k, v)| format!("{}:{v}", json_string(k.as_ref())))
        .collect();
    each.join(",")
}

/// One endpoint's finished run, as a bench prints it.
pub struct Outcome {
    pub json: String,
    pub text: String,
    pub errors: u64,
    pub verify_failures: u64,
}

/// The endpoints' order in one round of a comparison: each round starts one
/// endpoint later (A B C, B C A, C A B, ...), so that over a multiple of n
/// rounds each endpoint runs as often in each position (first after setup,
/// right after another, last) and no position's drift falls on one alone.
pub fn phase_order(round: usize, n: usize) -> impl Iterator<Item = usize> {
    (0..n).map(move |j| (round + j) % n)
}

/// Prints every endpoint's report (JSON: one object, or one comparison of
/// them all; text: each report, then the ratios to the first endpoint) and
/// fails the run if any request failed or read back wrong bytes.
pub fn finish(
    json: bool,
    rounds: usize,
    endpoints: &[String],
    outcomes: &[Outcome],
    named: &[Vec<(&'static str, f64)>],
) -> anyhow::Result<()> {
    if json {
        if let [only] = outcomes {
            println!("{}", only.json);
        } else {
            let each: Vec<String> = outcomes.iter().map(|o| o.json.clone()).collect();
            println!("{}", comparison_json(rounds, endpoints, &each, named));
        }
    } else {
        for (e, o) in endpoints.iter().zip(outcomes) {
            if outcomes.len() > 1 {
                println!("{e}");
            }
            print!("{}", o.text);
        }
        print!("{}", ratio_lines(endpoints, named));
    }
    let errors: u64 = outcomes.iter().map(|o| o.errors).sum();
    let verify_failures: u64 = outcomes.iter().map(|o| o.verify_failures).sum();
    if verify_failures > 0 || errors > 0 {
        bail!("{errors} errors, {verify_failures} verify failures");
    }
    Ok(())
}

/// Each figure of `other` divided by the same figure of `first` (0 where
/// `first`'s is 0). Both list the same names in the same order.
pub fn ratios(
    first: &[(&'static str, f64)],
    other: &[(&'static str, f64)],
) -> Vec<(&'static str, f64)> {
    first
        .iter()
        .zip(other)
        .map(|((n, a), (_, b))| (*n, if *a == 0.0 { 0.0 } else { b / a }))
        .collect()
}

/// A `--compare` run as one JSON object: each endpoint's report (`reports`,
/// JSON objects) with its name, and each later endpoint's figures (`named`)
/// as ratios to the first's.
pub fn comparison_json(
    rounds: usize,
    endpoints: &[String],
    reports: &[String],
    named: &[Vec<(&'static str, f64)>],
) -> String {
    let each: Vec<String> = endpoints
        .iter()
        .zip(reports)
        .map(|(e, r)| format!("{{\"endpoint\":{},{}", json_string(e), &r[1..]))
        .collect();
    let ratios: Vec<String> = named[1..]
        .iter()
        .map(|other| {
            let r: Vec<String> = ratios(&named[0], other)
                .iter()
                .map(|(n, v)| format!("\"{n}\":{v:.3}"))
                .collect();
            format!("{{{}}}", r.join(","))
        })
        .collect();
    format!(
        "{{\"rounds\":{rounds},\"endpoints\":[{}],\"ratios_to_first\":[{}]}}",
        each.join(","),
        ratios.join(",")
    )
}

/// The text lines of a comparison's ratios, one per later endpoint.
pub fn ratio_lines(endpoints: &[String], named: &[Vec<(&'static str, f64)>]) -> String {
    let mut s = String::new();
    for (e, other) in endpoints.iter().zip(named).skip(1) {
        let r: Vec<String> = ratios(&named[0], other)
            .iter()
            .map(|(n, v)| format!("{n} {v:.3}"))
            .collect();
        s += &format!("{e} / {}: {}\n", endpoints[0], r.join("  "));
    }
    s
}

/// A JSON string literal (error kinds carry server messages).
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl S3BenchArgs {
    /// --part-size, checked once by `run` before any request is sent.
    fn part_size_bytes(&self) -> anyhow::Result<usize> {
        match crate::config::parse_size(&self.part_size)? {
            0 => bail!("--part-size must be positive"),
            n => Ok(n as usize),
        }
    }
}

/// One whole multipart upload of `body` to `key`: create, the parts in order
/// on this connection, complete. Returns the completion's reply.
async fn multipart_upload(
    c: &mut Conn,
    t: &Target,
    key: &str,
    body: Bytes,
    part_size: usize,
) -> anyhow::Result<Reply> {
    let created = request(c, t, "POST", key, &[("uploads", "")], Bytes::new(), true).await?;
    if created.status != 200 {
        return Ok(created);
    }
    let xml = created.body.unwrap_or_default();
    let xml = std::str::from_utf8(&xml).context("CreateMultipartUpload reply")?;
    let upload_id = xml
        .split_once("<UploadId>")
        .and_then(|(_, rest)| rest.split_once("</UploadId>"))
        .map(|(id, _)| id.to_string())
        .context("no UploadId in the CreateMultipartUpload reply")?;
    let mut complete = String::from("<CompleteMultipartUpload>");
    let parts = body.len().div_ceil(part_size).max(1);
    for n in 0..parts {
        let part = body.slice(n * part_size..((n + 1) * part_size).min(body.len()));
        let number = (n + 1).to_string();
        let r = request(
            c,
            t,
            "PUT",
            key,
            &[("partNumber", &number), ("uploadId", &upload_id)],
            part,
            false,
        )
        .await?;
        let Some(etag) = r.etag.clone().filter(|_| r.status == 200) else {
            // Leave nothing behind on the server.
            let _ = request(
                c,
                t,
                "DELETE",
                key,
                &[("uploadId", &upload_id)],
                Bytes::new(),
                false,
            )
            .await;
            return Ok(r);
        };
        complete += &format!("<Part><PartNumber>{number}</PartNumber><ETag>{etag}</ETag></Part>");
    }
    complete += "</CompleteMultipartUpload>";
    request(
        c,
        t,
        "POST",
        key,
        &[("uploadId", &upload_id)],
        Bytes::from(complete),
        false,
    )
    .await
}

/// Starts the trivial S3 responder `--endpoint sink` runs against, on
/// `threads` threads of its own; returns its URL. It reads every request
/// body, answers GETs of `obj-N` with the bytes the bench would have stored
/// (no copy unless --verify stamps them), and everything else with the
/// smallest valid reply. It stores nothing, so what the bench measures
/// against it is the bench's own cost per request and per byte.
fn start_sink(base: Bytes, stamp: bool, threads: usize) -> anyhow::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let url = format!("http://{}", listener.local_addr()?);
    for n in 0..threads {
        let listener = listener.try_clone()?;
        let base = base.clone();
        std::thread::Builder::new()
            .name(format!("bench-sink-{n}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("sink runtime");
                rt.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("sink listener");
                    while let Ok((stream, _)) = listener.accept().await {
                        let _ = stream.set_nodelay(true);
                        let base = base.clone();
                        tokio::spawn(async move {
                            let svc = hyper::service::service_fn(move |req| {
                                sink_reply(req, base.clone(), stamp)
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                });
            })?;
    }
    Ok(url)
}

async fn sink_reply(
    req: http::Request<hyper::body::Incoming>,
    base: Bytes,
    stamp: bool,
) -> Result<http::Response<Full<Bytes>>, std::convert::Infallible> {
    let (parts, mut body) = req.into_parts();
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            break;
        }
    }
    let query = parts.uri.query().unwrap_or("");
    let object = parts
        .uri
        .path()
        .rsplit_once("/obj-")
        .and_then(|(_, n)| n.parse::<u64>().ok());
    let reply = |status: u16, body: Bytes| {
        http::Response::builder()
            .status(status)
            .header(http::header::ETAG, "\"0\"")
            .body(Full::new(body))
            .expect("static response")
    };
    Ok(match (parts.method.as_str(), object) {
        ("GET", Some(i)) => reply(200, object_body(&base, i, stamp)),
        ("GET", None) => reply(200, Bytes::from_static(b"<ListBucketResult></ListBucketResult>")),
        ("POST", _) if query.contains("uploads") => reply(
            200,
            Bytes::from_static(b"<InitiateMultipartUploadResult><UploadId>sink</UploadId></InitiateMultipartUploadResult>"),
        ),
        ("DELETE", _) => reply(204, Bytes::new()),
        _ => reply(200, Bytes::new()),
    })
}

/// An endpoint as printed: its access key names whose requests these were,
/// its secret key is never shown.
fn redact(endpoint: &str) -> String {
    match endpoint
        .strip_prefix("http://")
        .and_then(|r| r.rsplit_once('@'))
    {
        Some((creds, hostport)) => {
            let key = creds.split_once(':').map_or(creds, |(k, _)| k);
            format!("http://{key}@{hostport}")
        }
        None => endpoint.to_string(),
    }
}

/// The bucket, and the objects reads need.
async fn setup(
    target: &Target,
    bucket: &str,
    args: &S3BenchArgs,
    base: &Bytes,
) -> anyhow::Result<()> {
    let mut c = connect(target).await?;
    let st = request(
        &mut c,
        target,
        "PUT",
        &format!("/{bucket}"),
        &[],
        Bytes::new(),
        false,
    )
    .await?
    .status;
    if st != 200 && st != 409 {
        bail!("creating bucket {bucket}: HTTP {st}");
    }
    if args.op == "get" || args.op == "mixed" || args.op == "list" {
        let n = if args.op == "list" {
            args.objects.max(1000)
        } else {
            args.objects
        };
        let body = if args.op == "list" {
            Bytes::from_static(b"x")
        } else {
            base.clone()
        };
        for i in 0..n {
            let st = request(
                &mut c,
                target,
                "PUT",
                &format!("/{bucket}/obj-{i}"),
                &[],
                object_body(&body, i, args.verify),
                false,
            )
            .await?
            .status;
            if st != 200 {
                bail!("preparing object {i}: HTTP {st}");
            }
        }
    }
    Ok(())
}

/// Removes what the run created (best effort: the run's result stands).
async fn teardown(target: &Target, bucket: &str, args: &S3BenchArgs) {
    let Ok(mut c) = connect(target).await else {
        return;
    };
    let n = match args.op.as_str() {
        "list" => args.objects.max(1000),
        _ => args.objects,
    };
    for i in 0..n {
        let _ = request(
            &mut c,
            target,
            "DELETE",
            &format!("/{bucket}/obj-{i}"),
            &[],
            Bytes::new(),
            false,
        )
        .await;
    }
    let _ = request(
        &mut c,
        target,
        "DELETE",
        &format!("/{bucket}"),
        &[],
        Bytes::new(),
        false,
    )
    .await;
}

/// One timed phase against one endpoint: `duration`, or `count` requests.
#[allow(clippy::too_many_arguments)]
fn phase(
    target: &Arc<Target>,
    bucket: &str,
    args: &S3BenchArgs,
    base: &Bytes,
    duration: Duration,
    count: Option<u64>,
    threads: usize,
    label: &str,
    server_pid: Option<u32>,
) -> anyhow::Result<Figures> {
    let shared = Arc::new(Shared {
        hist: Mutex::new(Some(Histogram::new_with_bounds(1, 3_600_000_000, 3)?)),
        ..Default::default()
    });
    let stop = Arc::new(AtomicBool::new(false));
    let issued = Arc::new(AtomicU64::new(0));
    let mut phase_args = args.clone();
    phase_args.count = count;
    let server_cpu0 = server_pid.map(process_cpu).transpose()?;
    let client_cpu0 = process_cpu(0)?;
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..threads {
        let workers = args.concurrency / threads + usize::from(t < args.concurrency % threads);
        let (target, shared, stop, issued, base, bucket, args) = (
            target.clone(),
            shared.clone(),
            stop.clone(),
            issued.clone(),
            base.clone(),
            bucket.to_string(),
            phase_args.clone(),
        );
        handles.push(std::thread::spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let tasks: Vec<_> = (0..workers)
                    .map(|w| {
                        let (target, shared, stop, issued, base, bucket, args) = (
                            target.clone(),
                            shared.clone(),
                            stop.clone(),
                            issued.clone(),
                            base.clone(),
                            bucket.clone(),
                            args.clone(),
                        );
                        tokio::spawn(async move {
                            worker(w, &target, &shared, &stop, &issued, &base, &bucket, &args).await
                        })
                    })
                    .collect();
                for t in tasks {
                    let _ = t.await;
                }
            });
            Ok(())
        }));
    }
    // Progress line and the stop condition.
    let mut last = 0;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let elapsed = start.elapsed();
        if count.is_none() && elapsed >= duration {
            stop.store(true, Ordering::Relaxed);
        }
        if handles.iter().all(|h| h.is_finished()) {
            break;
        }
        let secs = elapsed.as_secs();
        if secs != last && !args.json {
            last = secs;
            let ops = shared.ops.load(Ordering::Relaxed);
            eprint!(
                "\r{label}{secs:>4}s  {ops:>9} ops  {:>9.1} ops/s  {:>9.1} MB/s",
                ops as f64 / elapsed.as_secs_f64(),
                shared.bytes.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64() / 1e6
            );
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("bench thread panicked"))??;
    }
    let server_cpu = match server_pid.zip(server_cpu0) {
        Some((pid, c)) => Some(process_cpu(pid)? - c),
        None => None,
    };
    let client_cpu = process_cpu(0)? - client_cpu0;
    let hist = shared.hist.lock().expect("hist").take().expect("histogram");
    let errors = shared.errors.lock().expect("errors").clone();
    Ok(Figures {
        hist,
        ops: shared.ops.load(Ordering::Relaxed),
        bytes: shared.bytes.load(Ordering::Relaxed),
        seconds,
        errors,
        verify_failures: shared.verify_failures.load(Ordering::Relaxed),
        server_cpu,
        client_cpu,
    })
}

/// CPU seconds (user + system, all threads) process `pid` has used so far;
/// 0: this process.
fn process_cpu(pid: u32) -> anyhow::Result<f64> {
    let path = if pid == 0 {
        "/proc/self/stat".to_string()
    } else {
        format!("/proc/{pid}/stat")
    };
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    cpu_seconds_of_stat(&stat).with_context(|| format!("parsing {path}"))
}

/// utime + stime of a /proc/PID/stat line, in seconds. The command name
/// (field 2, in parentheses) may hold spaces and parentheses itself: the
/// fields are counted after its last ')'.
fn cpu_seconds_of_stat(stat: &str) -> anyhow::Result<f64> {
    let (_, rest) = stat
        .rsplit_once(')')
        .ok_or_else(|| anyhow::anyhow!("no command name"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime and stime are fields 14 and 15.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        Ok(f.get(i - 3)
            .ok_or_else(|| anyhow::anyhow!("short stat line"))?
            .parse()?)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((ticks(14)? + ticks(15)?) as f64 / hz)
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    w: usize,
    t: &Target,
    shared: &Shared,
    stop: &AtomicBool,
    issued: &AtomicU64,
    base: &Bytes,
    bucket: &str,
    args: &S3BenchArgs,
) {
    let mut conn: Option<Conn> = None;
    let mut local = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("histogram");
    let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let n = issued.fetch_add(1, Ordering::Relaxed);
        if args.count.is_some_and(|c| n >= c) {
            break;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let i = n % args.objects.max(1);
        let op = match args.op.as_str() {
            "mixed" if rng % 10 < 3 => "put",
            "mixed" => "get",
            o => o,
        };
        if conn.is_none() {
            match connect(t).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    shared.error(format!("connect: {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connection");
        let begin = Instant::now();
        let key = format!("/{bucket}/obj-{i}");
        let result = match op {
            "multipart" => match args.part_size_bytes() {
                Ok(part_size) => {
                    let body = object_body(base, i, args.verify);
                    multipart_upload(c, t, &key, body, part_size).await
                }
                Err(e) => Err(e),
            },
            "put" => {
                request(
                    c,
                    t,
                    "PUT",
                    &key,
                    &[],
                    object_body(base, i, args.verify),
                    false,
                )
                .await
            }
            "get" => request(c, t, "GET", &key, &[], Bytes::new(), args.verify).await,
            _ => {
                request(
                    c,
                    t,
                    "GET",
                    &format!("/{bucket}"),
                    &[("list-type", "2"), ("max-keys", "1000")],
                    Bytes::new(),
                    false,
                )
                .await
            }
        };
        let elapsed = begin.elapsed();
        match result {
            Ok(Reply {
                status, len, body, ..
            }) if (200..300).contains(&status) => {
                let _ = local.record(elapsed.as_micros().max(1) as u64);
                shared.ops.fetch_add(1, Ordering::Relaxed);
                let payload = match op {
                    "put" | "multipart" => base.len() as u64,
                    _ => len,
                };
                shared.bytes.fetch_add(payload, Ordering::Relaxed);
                if op == "get" && args.verify {
                    let want = object_body(base, i, true);
                    if body.as_deref() != Some(&want[..]) {
                        shared.verify_failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Ok(Reply { status, .. }) => shared.error(format!("HTTP {status}")),
            Err(e) => {
                shared.error(format!("{e}").chars().take(60).collect());
                conn = None;
            }
        }
    }
    shared
        .hist
        .lock()
        .expect("hist")
        .as_mut()
        .expect("histogram")
        .add(&local)
        .expect("merge histograms");
}

pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (n, unit) = s.split_at(
        s.find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(s.len()),
    );
    let n: f64 = n
        .parse()
        .with_context(|| format!("invalid duration {s:?}"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        _ => bail!("invalid duration unit in {s:?}"),
    };
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("5x").is_err());
    }

    fn figures(latencies_us: std::ops::RangeInclusive<u64>, seconds: f64) -> Figures {
        let mut f = Figures::empty().unwrap();
        for us in latencies_us {
            f.hist.record(us).unwrap();
            f.ops += 1;
            f.bytes += 1_000_000;
        }
        f.seconds = seconds;
        f
    }

    #[test]
    fn figures_arithmetic_and_merging() {
        let a = figures(1..=1000, 2.0);
        assert_eq!(a.ops_per_sec(), 500.0);
        assert_eq!(a.mb_per_sec(), 500.0);
        for (q, exact) in [(0.5, 0.5), (0.9, 0.9), (0.99, 0.99), (0.999, 0.999)] {
            let got = a.ms(q);
            assert!((got - exact).abs() <= exact * 0.001 + 1e-6, "q {q}: {got}");
        }
        assert_eq!(a.ms(2.0), 1.0);
        // Merging two phases adds counts and time; quantiles cover both.
        let mut m = a.clone();
        let mut b = figures(1001..=2000, 2.0);
        b.errors.insert("HTTP 503".into(), 2);
        m.merge(&b);
        assert_eq!((m.ops, m.seconds), (2000, 4.0));
        assert_eq!(m.ops_per_sec(), 500.0);
        assert!((m.ms(0.5) - 1.0).abs() < 0.002, "{}", m.ms(0.5));
        assert_eq!(m.errors["HTTP 503"], 2);
        let j = m.json(&S3BenchArgs::for_test(), 1 << 20);
        assert!(
            j.contains("\"ops\":2000") && j.contains("\"HTTP 503\":2"),
            "{j}"
        );
    }

    #[test]
    fn ratios_to_the_first_endpoint() {
        let a = figures(1..=1000, 2.0);
        let b = figures(1..=1000, 1.0); // the same work in half the time
        let r: std::collections::HashMap<_, _> =
            ratios(&a.named(), &b.named()).into_iter().collect();
        assert_eq!(r["ops_per_sec"], 2.0);
        assert_eq!(r["mb_per_sec"], 2.0);
        assert_eq!(r["p50_ms"], 1.0);
        let empty = Figures::empty().unwrap();
        assert_eq!(
            ratios(&empty.named(), &a.named())[0].1,
            0.0,
            "no division by zero"
        );
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        let j = comparison_json(
            2,
            &["A".into(), "B".into()],
            &[
                a.json(&S3BenchArgs::for_test(), 1),
                b.json(&S3BenchArgs::for_test(), 1),
            ],
            &[a.named(), b.named()],
        );
        assert!(
            j.starts_with("{\"rounds\":2,\"endpoints\":[{\"endpoint\":\"A\",\"op\":"),
            "{j}"
        );
        assert!(
            j.contains("\"ratios_to_first\":[{\"ops_per_sec\":2.000,"),
            "{j}"
        );
        assert!(
            ratio_lines(&["A".into(), "B".into()], &[a.named(), b.named()])
                .starts_with("B / A: ops_per_sec 2.000")
        );
    }

    #[test]
    fn endpoints_with_credentials_and_redaction() {
        let args = S3BenchArgs::for_test();
        let t = target_for("http://k2:s2@127.0.0.1:9100/", &args).unwrap();
        assert_eq!(
            (
                t.addr.as_str(),
                t.signer.access_key.as_str(),
                t.signer.secret_key.as_str()
            ),
            ("127.0.0.1:9100", "k2", "s2")
        );
        let t = target_for("http://127.0.0.1:9000", &args).unwrap();
        assert_eq!(t.signer.access_key, "k");
        let t = target_for("https://store.example:9443", &args).unwrap();
        assert!(t.tls.is_some() && t.addr == "store.example:9443");
        assert_eq!(
            target_for("https://store.example", &args).unwrap().addr,
            "store.example:443"
        );
        assert!(target_for("ftp://x:1", &args).is_err());
        assert!(target_for("http://nosecret@x:1", &args).is_err());
        assert_eq!(
            redact("http://k2:s2@127.0.0.1:9100"),
            "http://k2@127.0.0.1:9100"
        );
        assert_eq!(redact("http://127.0.0.1:9100"), "http://127.0.0.1:9100");
    }

    impl S3BenchArgs {
        fn for_test() -> S3BenchArgs {
            S3BenchArgs {
                endpoint: "http://127.0.0.1:9000".into(),
                access_key: "k".into(),
                secret_key: "s".into(),
                region: "us-east-1".into(),
                bucket: None,
                op: "get".into(),
                size: "1MiB".into(),
                concurrency: 1,
                duration: "1s".into(),
                count: None,
                objects: 1,
                verify: false,
                keep: false,
                threads: None,
                json: false,
                compare: Vec::new(),
                rounds: 4,
                part_size: "8MiB".into(),
                ca_bundle: None,
                server_pid: Vec::new(),
            }
        }
    }

    #[test]
    fn cpu_time_from_a_stat_line() {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        // A command name with a space and a ')' in it.
        let line = "4242 (tarn) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 1 2 3";
        let got = cpu_seconds_of_stat(line).unwrap();
        assert!((got - 300.0 / hz).abs() < 1e-9, "{got}");
        assert!(cpu_seconds_of_stat("4242 (tarn) S 1").is_err());
        assert!(cpu_seconds_of_stat("no name").is_err());
        // This process has used some CPU, and a figure per GB divides by
        // the bytes moved.
        assert!(process_cpu(0).unwrap() >= 0.0);
        let mut f = Figures::empty().unwrap();
        f.bytes = 2_000_000_000;
        assert!((f.per_gb(1.0) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn phases_rotate() {
        let order = |r| phase_order(r, 3).collect::<Vec<_>>();
        assert_eq!(order(0), [0, 1, 2]);
        assert_eq!(order(1), [1, 2, 0]);
        assert_eq!(order(5), [2, 0, 1]);
        assert_eq!(phase_order(0, 1).collect::<Vec<_>>(), [0]);
    }

    #[test]
    fn stamped_bodies_differ() {
        let base = Bytes::from(vec![7u8; 64]);
        assert_ne!(object_body(&base, 1, true), object_body(&base, 2, true));
        assert_eq!(object_body(&base, 1, false), base);
    }
}
