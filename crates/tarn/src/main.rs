//! `tarn`: the daemon and its command line. `tarn server` with no arguments
//! serves a single node on ./data at 127.0.0.1:9000.

mod admin;
mod admin_cache;
mod admin_cache_cli;
mod admin_cli;
mod bench;
mod bench_drive;
mod bench_kv;
mod config;
mod conn;
mod console;
mod cosi;
mod fdlimit;
mod jobs;
mod local_read;
mod metrics;
mod mount_cli;
mod server;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use tarn_store::{EtagMode, Store, StoreConfig};

use config::{parse_addr, parse_size, FileConfig, DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY};

#[derive(Parser)]
#[command(
    name = "tarn",
    version,
    about = "Storage that keeps GPUs fed: S3 object store and KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon.
    Server(Box<ServerArgs>),
    /// Heal every object on the drives of a stopped server.
    Heal(DriveArgs),
    /// Load generators.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Operator commands against a running server (users and keys).
    Admin(Box<admin_cli::AdminArgs>),
    /// A COSI driver (Kubernetes' objectstorage.k8s.io v1alpha2): buckets
    /// and bucket access provisioned through this server's APIs.
    Cosi(Box<cosi::CosiArgs>),
    /// Mount a bucket, or a prefix of one, as a file system (FUSE).
    Mount(Box<mount_cli::MountArgs>),
    /// Unmount what `tarn mount` mounted (lazily while files are open).
    Umount(mount_cli::UmountArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Drive any S3-compatible endpoint (path-style, SigV4).
    S3(Box<bench::S3BenchArgs>),
    /// Drive the KV-cache store (`tarn server --kv`) over shared memory or TCP.
    Kv(Box<bench_kv::KvBenchArgs>),
    /// The sequential O_DIRECT write rate of the drive under a directory.
    Drive(bench_drive::DriveBenchArgs),
}

#[derive(clap::Args)]
struct DriveArgs {
    /// Drive directory (repeatable); default ./data.
    #[arg(long = "drive")]
    drives: Vec<PathBuf>,
    /// TOML config file.
    #[arg(long)]
    config: Option<PathBuf>,
}

#[derive(clap::Args)]
struct ServerArgs {
    /// TOML config file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// S3 listen address.
    #[arg(long, env = "TARN_LISTEN")]
    listen: Option<String>,
    /// Admin listen address (metrics, health, heal).
    #[arg(long, env = "TARN_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Drive directory (repeatable); default ./data.
    #[arg(long = "drive")]
    drives: Vec<PathBuf>,
    #[arg(long, env = "TARN_ACCESS_KEY", hide_env_values = true)]
    access_key: Option<String>,
    #[arg(long, env = "TARN_SECRET_KEY", hide_env_values = true)]
    secret_key: Option<String>,
    #[arg(long, env = "TARN_REGION")]
    region: Option<String>,
    /// Base domain for virtual-host-style requests (repeatable).
    #[arg(long = "domain")]
    domains: Vec<String>,
    /// Runtime threads (one per core); default: the cores available.
    #[arg(long)]
    cores: Option<usize>,
    /// Drives per erasure set.
    #[arg(long)]
    set_drive_count: Option<usize>,
    /// Data shards per stripe.
    #[arg(long)]
    data_shards: Option<usize>,
    /// Parity shards per stripe.
    #[arg(long)]
    parity_shards: Option<usize>,
    /// Bytes of data per stripe (e.g. 1MiB).
    #[arg(long)]
    stripe_size: Option<String>,
    /// Objects up to this size are stored inline with their metadata (e.g. 128KiB).
    #[arg(long)]
    inline_threshold: Option<String>,
    /// ETag of single-part uploads: auto, md5 or fast.
    #[arg(long)]
    etag_mode: Option<String>,
    /// Requests served at once before answering 503 SlowDown.
    #[arg(long)]
    inflight_requests_max: Option<usize>,
    /// S3 connections open at once; more are closed as they come (default:
    /// half the open-files limit left after a reserve for the drives).
    #[arg(long)]
    connections_max: Option<usize>,
    /// S3 connections one client address may hold open (default: a quarter
    /// of --connections-max).
    #[arg(long)]
    connections_per_client_max: Option<usize>,
    /// Seconds between background heal scans (0 = off).
    #[arg(long)]
    scan_interval_secs: Option<u64>,
    /// Bytes every cache bucket of this node may hold together (e.g.
    /// 500GiB; default: no budget beyond each bucket's --size).
    #[arg(long)]
    cache_max_bytes: Option<String>,
    /// What a bucket created without x-amz-object-ownership gets: `aws`
    /// (AWS's defaults since April 2023: ACLs disabled, public access
    /// blocked) or `legacy` (the defaults before: ObjectWriter ownership,
    /// no public access block; for clients moved from RGW or MinIO that
    /// rely on ACLs). Every node of a cluster needs the same.
    #[arg(long, value_parser = ["aws", "legacy"])]
    bucket_defaults: Option<String>,
    /// Seconds between lifecycle passes over a bucket (default 3600).
    #[arg(long)]
    lifecycle_interval_secs: Option<u64>,
    /// Seconds in a lifecycle day (default 86400; tests shorten it).
    #[arg(long)]
    lifecycle_day_secs: Option<u64>,
    /// Versions and uploads a lifecycle pass visits per second at most
    /// (default 20000; 0 = no bound).
    #[arg(long)]
    lifecycle_rate: Option<u64>,
    /// SSE-S3 master keys: a file of `ID:BASE64` lines (32-byte keys), the
    /// first wrapping new objects, the others kept to read older ones
    /// (rotation). Default: TARN_SSE_MASTER_KEY, else SSE-S3 is refused.
    /// Every node of a cluster needs the same.
    #[arg(long)]
    sse_master_key_file: Option<PathBuf>,
    /// SSE-KMS keys: a file of `NAME:BASE64` lines, each a key requests may
    /// name by x-amz-server-side-encryption-aws-kms-key-id.
    #[arg(long)]
    kms_key_file: Option<PathBuf>,
    /// The KMS key aws:kms requests without a key id use (default: the
    /// key file's first).
    #[arg(long)]
    kms_default_key: Option<String>,
    /// Bytes of objects per second a backfill of a joining drive may visit
    /// (e.g. 200MiB; 0 = no limit).
    #[arg(long)]
    heal_rate: Option<String>,
    /// Use blocking threads for file I/O instead of io_uring.
    #[arg(long)]
    no_io_uring: bool,
    /// Also serve the KV-cache store.
    #[arg(long)]
    kv: bool,
    /// KV protocol listen address (TCP; same-host clients switch to shared memory).
    #[arg(long, env = "TARN_KV_LISTEN")]
    kv_listen: Option<String>,
    /// KV RAM tier size (e.g. 8GiB); default a quarter of the machine's RAM.
    #[arg(long)]
    kv_memory: Option<String>,
    /// KV NVMe tier directory (off unless given).
    #[arg(long)]
    kv_disk: Option<PathBuf>,
    /// KV NVMe tier size; default half the free space of --kv-disk's filesystem.
    #[arg(long)]
    kv_disk_size: Option<String>,
    /// Largest KV value (default 4MiB).
    #[arg(long)]
    kv_value_max: Option<String>,
    /// KV RAM tier on 2 MiB huge pages: auto (when enough are reserved), on
    /// (refuse to start without), off.
    #[arg(long)]
    kv_huge_pages: Option<String>,
    /// Put the KV shared-memory socket in this directory, as a file
    /// (default: an abstract socket, reached only from the server's network
    /// namespace). On Kubernetes: a host path that the pods of one node
    /// mount at the same place.
    #[arg(long, env = "TARN_KV_SHM_DIR")]
    kv_shm_dir: Option<PathBuf>,
    /// In a cluster: the KV endpoint other hosts' clients reach this node's
    /// KV store at (default: the KV listen address, or with an unspecified
    /// IP the --advertise host and the KV port).
    #[arg(long)]
    kv_advertise: Option<String>,
    /// In a cluster: seconds over which a node whose KV store starts empty
    /// ramps its routing weight up to a full share (default 60; 0: at once).
    #[arg(long)]
    kv_ramp_secs: Option<u64>,
    /// Join the cluster of this name (with --etcd, --node-id, --advertise;
    /// the cluster secret comes from TARN_CLUSTER_SECRET or the config).
    #[arg(long, env = "TARN_CLUSTER")]
    cluster: Option<String>,
    /// etcd endpoints, comma-separated http://HOST:PORT or https://HOST:PORT.
    #[arg(long, env = "TARN_ETCD")]
    etcd: Option<String>,
    /// For https:// etcd endpoints: the CA that signed etcd's server
    /// certificates (PEM).
    #[arg(long, env = "TARN_ETCD_CA")]
    etcd_ca: Option<PathBuf>,
    /// This node's certificate chain for etcd (PEM), where etcd checks
    /// clients' certificates (--client-cert-auth); with --etcd-key.
    #[arg(long, env = "TARN_ETCD_CERT")]
    etcd_cert: Option<PathBuf>,
    /// The private key of --etcd-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "TARN_ETCD_KEY")]
    etcd_key: Option<PathBuf>,
    /// etcd's user for this node, where etcd authenticates users (the
    /// password from TARN_ETCD_PASSWORD or cluster.etcd_password).
    #[arg(long, env = "TARN_ETCD_USER")]
    etcd_user: Option<String>,
    /// This node's id in the cluster (a-z, 0-9, '-').
    #[arg(long, env = "TARN_NODE_ID")]
    node_id: Option<String>,
    /// HOST:PORT where the other nodes reach this node (its RPC listener).
    #[arg(long, env = "TARN_ADVERTISE")]
    advertise: Option<String>,
    /// A gateway: serves S3 for the cluster and stores nothing.
    #[arg(long)]
    no_drives: bool,
    /// Once, after upgrading a cluster formed before etcd records were
    /// sealed: seal them all with the cluster secret (every node stopped).
    #[arg(long)]
    seal_etcd_records: bool,
    /// TLS on every listener (S3, admin, KV over TCP, cluster RPC): this
    /// node's certificate chain (PEM), read again when it changes.
    #[arg(long, env = "TARN_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "TARN_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) that signed the other nodes' certificates, for
    /// cluster RPC over TLS (default: the system's trusted roots).
    #[arg(long, env = "TARN_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Serve without TLS on addresses beyond loopback (refused otherwise
    /// when no --tls-cert is given): for a network you trust, or TLS
    /// ended in front of Tarn.
    #[arg(long, env = "TARN_ALLOW_PLAIN_HTTP")]
    allow_plain_http: bool,
    /// Do not serve short-circuit reads (readers on this host reading the
    /// shard files of what they may read themselves; docs/local-reads.md).
    #[arg(long, env = "TARN_NO_LOCAL_READS")]
    no_local_reads: bool,
    /// Seconds a local reader's grant pins its version (default 30).
    #[arg(long)]
    local_read_lease_secs: Option<u64>,
    /// Write every GET body from memory: do not send the bytes read from
    /// this node's shard files from the files themselves (`sendfile`) on
    /// plain HTTP connections.
    #[arg(long, env = "TARN_NO_SENDFILE")]
    no_sendfile: bool,
    /// Keep the host's congestion control on connections from clients on
    /// this host: by default a pacing one (BBR) is switched to one that
    /// does not pace (cubic, or reno), as loopback has no link to pace for.
    #[arg(long, env = "TARN_PACE_LOCAL_CLIENTS")]
    pace_local_clients: bool,
    /// Leave a GET's blocks that are not in the page cache to the kernel's
    /// readahead (4 KiB pages for small files) instead of reading them in
    /// large folios first.
    #[arg(long, env = "TARN_NO_LARGE_FOLIOS")]
    no_large_folios: bool,
}

fn store_config(
    drives: Vec<PathBuf>,
    file: &FileConfig,
    args: Option<&ServerArgs>,
) -> anyhow::Result<StoreConfig> {
    let mut cfg = StoreConfig::default();
    let drives = if !drives.is_empty() {
        drives
    } else {
        file.drives
            .clone()
            .unwrap_or_else(|| vec![PathBuf::from("./data")])
    };
    cfg.drives = drives;
    let e = file.erasure.as_ref();
    cfg.set_drive_count = args
        .and_then(|a| a.set_drive_count)
        .or(e.and_then(|e| e.set_drive_count));
    cfg.data_shards = args
        .and_then(|a| a.data_shards)
        .or(e.and_then(|e| e.data_shards));
    cfg.parity_shards = args
        .and_then(|a| a.parity_shards)
        .or(e.and_then(|e| e.parity_shards));
    if let Some(s) = args.and_then(|a| a.stripe_size.as_deref()) {
        cfg.stripe_size_bytes = parse_size(s)? as usize;
    } else if let Some(s) = file.stripe_size_bytes {
        cfg.stripe_size_bytes = s;
    }
    if let Some(s) = args.and_then(|a| a.inline_threshold.as_deref()) {
        cfg.inline_threshold_bytes = parse_size(s)? as usize;
    } else if let Some(s) = file.inline_threshold_bytes {
        cfg.inline_threshold_bytes = s;
    }
    let mode = args
        .and_then(|a| a.etag_mode.clone())
        .or(file.etag_mode.clone());
    cfg.etag_mode = match mode.as_deref() {
        None | Some("auto") => EtagMode::Auto,
        Some("md5") => EtagMode::Md5,
        Some("fast") => EtagMode::Fast,
        Some(other) => bail!("etag mode must be auto, md5 or fast, not {other:?}"),
    };
    if let Some(m) = file.etag_md5_max_bytes {
        cfg.etag_md5_max_bytes = m;
    }
    if let Some(b) = file.response_buffer_max_bytes {
        cfg.read_ahead_max_bytes = b as usize;
    }
    if let Some(b) = file.buffers_per_core {
        cfg.buffers_per_core = b;
    }
    cfg.drive_reserve_bytes = file.drive_reserve_bytes;
    if let Some(r) = args.and_then(|a| a.heal_rate.as_deref()) {
        cfg.heal_rate_bytes = parse_size(r)?;
    } else if let Some(r) = file.heal_rate_bytes {
        cfg.heal_rate_bytes = r;
    }
    if let Some(c) = file.heal_concurrency {
        if c == 0 {
            bail!("heal_concurrency must be at least 1");
        }
        cfg.heal_concurrency = c;
    }
    Ok(cfg)
}

/// Total RAM from /proc/meminfo.
fn machine_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

fn free_space_bytes(dir: &std::path::Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: statvfs into a zeroed struct with a NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).context("statvfs of the KV disk");
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The KV store's settings, when it is enabled.
struct KvSettings {
    /// The default tenant's engine (its credentials are the server's).
    config: tarn_kv::KvConfig,
    listen: std::net::SocketAddr,
    shm: bool,
    shm_dir: Option<PathBuf>,
    idle_timeout: Duration,
    frame_timeout: Duration,
    handshake_timeout: Duration,
    /// Set only when configured (the defaults follow the descriptor limit).
    connections_max: Option<usize>,
    connections_per_tenant_max: Option<usize>,
    advertise: Option<String>,
    /// Set only when configured (a cluster's nodes default to
    /// [`KV_RAMP_DEFAULT_SECS`]).
    ramp: Option<Duration>,
    /// Further tenants: name, credentials, grants, engine settings.
    tenants: Vec<(
        String,
        tarn_kv::Credentials,
        tarn_kv::Grants,
        tarn_kv::KvConfig,
    )>,
}

fn kv_settings(args: &ServerArgs, file: &FileConfig) -> anyhow::Result<Option<KvSettings>> {
    let f = file.kv.as_ref();
    let enabled = args.kv
        || args.kv_listen.is_some()
        || args.kv_memory.is_some()
        || args.kv_disk.is_some()
        || args.kv_huge_pages.is_some()
        || args.kv_shm_dir.is_some()
        || f.and_then(|k| k.enabled).unwrap_or(false);
    if !enabled {
        return Ok(None);
    }
    let mut cfg = tarn_kv::KvConfig::default();
    let listen = parse_addr(
        args.kv_listen
            .as_deref()
            .or(f.and_then(|k| k.listen.as_deref()))
            .unwrap_or("127.0.0.1:9400"),
    )?;
    cfg.memory_bytes = match args
        .kv_memory
        .as_deref()
        .or(f.and_then(|k| k.memory.as_deref()))
    {
        Some(s) => parse_size(s)?,
        None => machine_memory_bytes().unwrap_or(4 << 30) / 4,
    };
    if let Some(s) = args
        .kv_value_max
        .as_deref()
        .or(f.and_then(|k| k.value_max.as_deref()))
    {
        cfg.value_max_bytes = parse_size(s)?;
    }
    if let Some(s) = f.and_then(|k| k.segment_size.as_deref()) {
        cfg.segment_bytes = parse_size(s)?;
    }
    if let Some(s) = args
        .kv_huge_pages
        .as_deref()
        .or(f.and_then(|k| k.huge_pages.as_deref()))
    {
        cfg.huge_pages = s.parse().map_err(|e: String| anyhow::anyhow!(e))?;
    }
    cfg.disk_dir = args.kv_disk.clone().or(f.and_then(|k| k.disk.clone()));
    if let Some(dir) = &cfg.disk_dir {
        cfg.disk_bytes = match args
            .kv_disk_size
            .as_deref()
            .or(f.and_then(|k| k.disk_size.as_deref()))
        {
            Some(s) => parse_size(s)?,
            None => free_space_bytes(dir)? / 2,
        };
    } else if args.kv_disk_size.is_some() {
        bail!("--kv-disk-size needs --kv-disk");
    }
    let secs = |v: Option<u64>, default: Duration, what: &str| -> anyhow::Result<Duration> {
        idle_secs(v, default, &format!("kv.{what}"))
    };
    let mut tenants = Vec::new();
    for t in f.and_then(|k| k.tenants.as_ref()).into_iter().flatten() {
        let mut tc = cfg.clone();
        tc.memory_bytes =
            parse_size(&t.memory).with_context(|| format!("kv tenant {}: memory", t.name))?;
        match (&cfg.disk_dir, &t.disk_size) {
            (Some(dir), Some(size)) => {
                tc.disk_dir = Some(dir.join("tenants").join(&t.name));
                tc.disk_bytes =
                    parse_size(size).with_context(|| format!("kv tenant {}: disk_size", t.name))?;
            }
            (Some(_), None) => bail!(
                "kv tenant {}: set disk_size (its NVMe tier goes under kv.disk/tenants/{})",
                t.name,
                t.name
            ),
            (None, Some(_)) => bail!("kv tenant {}: disk_size needs kv.disk", t.name),
            (None, None) => tc.disk_dir = None,
        }
        let grants =
            tarn_kv::Grants::prefixes(t.namespaces.iter().map(|n| n.as_bytes().to_vec()).collect())
                .map_err(|e| anyhow::anyhow!("kv tenant {}: {e}", t.name))?;
        let creds = tarn_kv::Credentials::new(t.access_key.clone(), t.secret_key.clone());
        if creds.is_default() {
            bail!(
                "kv tenant {}: the built-in default credentials are the server's own",
                t.name
            );
        }
        tenants.push((t.name.clone(), creds, grants, tc));
    }
    let shm = f.and_then(|k| k.shared_memory).unwrap_or(true);
    let shm_dir = args
        .kv_shm_dir
        .clone()
        .or(f.and_then(|k| k.shared_memory_dir.clone()));
    if shm_dir.is_some() && !shm {
        bail!("--kv-shm-dir (kv.shared_memory_dir) with kv.shared_memory = false: the socket would never be offered");
    }
    Ok(Some(KvSettings {
        config: cfg,
        listen,
        shm,
        shm_dir,
        idle_timeout: secs(
            f.and_then(|k| k.idle_timeout_secs),
            tarn_kv::server::IDLE_TIMEOUT_DEFAULT,
            "idle_timeout_secs",
        )?,
        frame_timeout: secs(
            f.and_then(|k| k.frame_timeout_secs),
            tarn_kv::server::FRAME_TIMEOUT_DEFAULT,
            "frame_timeout_secs",
        )?,
        handshake_timeout: secs(
            f.and_then(|k| k.handshake_timeout_secs),
            tarn_kv::server::HANDSHAKE_TIMEOUT_DEFAULT,
            "handshake_timeout_secs",
        )?,
        connections_max: f.and_then(|k| k.connections_max),
        connections_per_tenant_max: f.and_then(|k| k.connections_per_tenant_max),
        advertise: match args
            .kv_advertise
            .clone()
            .or(f.and_then(|k| k.advertise.clone()))
        {
            Some(a) => Some(kv_advertise_checked(a)?),
            None => None,
        },
        ramp: args
            .kv_ramp_secs
            .or(f.and_then(|k| k.ramp_secs))
            .map(Duration::from_secs),
        tenants,
    }))
}

/// Seconds a cluster node whose KV store starts empty takes to reach a full
/// routing weight.
const KV_RAMP_DEFAULT_SECS: u64 = 60;

/// A configured KV endpoint as clients must be able to use it: `host:port`
/// that fits a CLUSTER answer.
fn kv_advertise_checked(a: String) -> anyhow::Result<String> {
    let ok = a.len() <= tarn_kv::proto::VIEW_ENDPOINT_MAX_BYTES
        && a.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
    if !ok {
        bail!(
            "--kv-advertise {a:?}: expected HOST:PORT (at most {} bytes)",
            tarn_kv::proto::VIEW_ENDPOINT_MAX_BYTES
        );
    }
    Ok(a)
}

/// Where other hosts reach this node's KV store: as configured, else the
/// listen address, else (listening on every address) the node's advertised
/// host with the KV port.
fn kv_endpoint(
    configured: Option<&str>,
    bound: std::net::SocketAddr,
    node_advertise: &str,
) -> String {
    if let Some(a) = configured {
        return a.to_string();
    }
    if !bound.ip().is_unspecified() {
        return bound.to_string();
    }
    let host = node_advertise
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(node_advertise);
    format!("{host}:{}", bound.port())
}

/// Each tenant's name and engine (for /metrics).
type KvEngines = Vec<(String, Arc<tarn_kv::Engine>)>;

/// Opens every tenant's engine and starts the KV server.
fn start_kv(
    kv: KvSettings,
    root: tarn_kv::Credentials,
    (cores, io_uring, nofile): (usize, bool, u64),
    tls: Option<&Tls>,
) -> anyhow::Result<(KvEngines, tarn_kv::Server)> {
    let (conn_max, per_tenant) = fdlimit::kv_default_caps(nofile);
    let mut list = Vec::new();
    let mut engines = Vec::new();
    let root_engine = tarn_kv::Engine::open(kv.config.clone()).context("opening the KV store")?;
    engines.push(("default".to_string(), root_engine.clone()));
    list.push(
        tarn_kv::Tenant::new("default", root, tarn_kv::Grants::all(), root_engine)
            .map_err(anyhow::Error::msg)?,
    );
    for (name, creds, grants, cfg) in kv.tenants {
        let engine = tarn_kv::Engine::open(cfg)
            .with_context(|| format!("opening the KV store of tenant {name}"))?;
        engines.push((name.clone(), engine.clone()));
        list.push(tarn_kv::Tenant::new(name, creds, grants, engine).map_err(anyhow::Error::msg)?);
    }
    let tenants = tarn_kv::Tenants::new(list).map_err(anyhow::Error::msg)?;
    let server = tarn_kv::Server::start(
        tenants,
        tarn_kv::ServerOptions {
            listen: kv.listen,
            threads: cores,
            io_uring,
            shm: kv.shm,
            shm_dir: kv.shm_dir.clone(),
            idle_timeout: kv.idle_timeout,
            frame_timeout: kv.frame_timeout,
            handshake_timeout: kv.handshake_timeout,
            connections_max: kv.connections_max.unwrap_or(conn_max),
            connections_per_tenant_max: kv.connections_per_tenant_max.unwrap_or(per_tenant),
            tls: tls.map(|t| t.cert.server_config(&[])),
            // Threads unpinned, as by default: the KV daemon shares its host
            // with the engines it serves, and a thread pinned to a core an
            // engine keeps busy waited there, runnable, for seconds while
            // other cores idled (issue 12's 30-second stall; tests/kv_stall.rs
            // in tarn-client).
            ..tarn_kv::ServerOptions::default()
        },
    )
    .context("starting the KV server")?;
    Ok((engines, server))
}

fn run_server(args: ServerArgs) -> anyhow::Result<()> {
    // Before any drive is opened: the descriptors the drives need must not
    // be those the clients' connections took.
    let nofile = fdlimit::raise_nofile();
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let listen = parse_addr(
        args.listen
            .as_deref()
            .or(file.listen.as_deref())
            .unwrap_or("127.0.0.1:9000"),
    )?;
    let admin_listen = match args
        .admin_listen
        .as_deref()
        .or(file.admin_listen.as_deref())
    {
        Some(a) => parse_addr(a)?,
        None => std::net::SocketAddr::new(
            listen.ip(),
            if listen.port() == 0 {
                0
            } else {
                listen.port().wrapping_add(1)
            },
        ),
    };
    let access = args.access_key.clone().or(file.access_key.clone());
    let secret = args.secret_key.clone().or(file.secret_key.clone());
    let (access, secret) = match (access, secret) {
        (Some(a), Some(s)) => (a, s),
        (None, None) => (
            DEFAULT_ACCESS_KEY.to_string(),
            DEFAULT_SECRET_KEY.to_string(),
        ),
        _ => bail!("set both TARN_ACCESS_KEY and TARN_SECRET_KEY, or neither"),
    };
    // The built-in credentials are in the README: anyone could use them. They
    // are accepted only while nothing listens beyond loopback, whether they
    // came by default or were set explicitly.
    let root = tarn_kv::Credentials::new(access.clone(), secret.clone());
    let defaulted = root.is_default();
    let kv = kv_settings(&args, &file)?;
    if defaulted {
        let listeners = [
            Some(listen),
            Some(admin_listen),
            kv.as_ref().map(|k| k.listen),
        ];
        if let Some(open) = listeners
            .into_iter()
            .flatten()
            .find(|a| !a.ip().is_loopback())
        {
            bail!("refusing to listen on {open} with the built-in default credentials: set TARN_ACCESS_KEY and TARN_SECRET_KEY to your own");
        }
    }
    if secret.len() < 8 {
        bail!("the secret key must be at least 8 characters");
    }
    let tls = tls_settings(&args, &file)?;
    let allow_plain = args.allow_plain_http || file.allow_plain_http.unwrap_or(false);
    if tls.is_none() && !allow_plain {
        refuse_plain_beyond_loopback(
            [
                Some(listen),
                Some(admin_listen),
                kv.as_ref().map(|k| k.listen),
            ]
            .into_iter()
            .flatten(),
        )?;
    }
    let cores = args
        .cores
        .or(file.cores)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
        .max(1);
    let mut cfg = store_config(args.drives.clone(), &file, Some(&args))?;
    cfg.core_count = cores;
    for d in &cfg.drives {
        if d.as_os_str().is_empty() {
            bail!("empty drive path");
        }
    }
    let cluster = cluster_settings(
        &args,
        &file,
        &cfg.drives,
        (listen, admin_listen),
        (tls.as_ref(), allow_plain),
    )?;
    let (store, node, admin_bound) = match cluster {
        None => (
            Store::open(cfg).context("opening the object engine")?,
            None,
            None,
        ),
        Some(nc) => {
            let (store, node, admin) =
                join_cluster(nc, cfg, admin_listen, (&secret, tls.as_ref()))?;
            (store, Some(node), Some(admin))
        }
    };
    for d in store.drive_status().iter().filter(|d| !d.online) {
        eprintln!(
            "warning: drive {} is offline: {}",
            d.path,
            d.reason.as_deref().unwrap_or("unknown")
        );
    }
    let (k, m) = store.erasure_layout();
    let region = args
        .region
        .clone()
        .or(file.region.clone())
        .unwrap_or_else(|| "us-east-1".into());
    let mut domains = if !args.domains.is_empty() {
        args.domains.clone()
    } else {
        file.domains.clone().unwrap_or_default()
    };
    if domains.is_empty() {
        domains.push("localhost".into());
    }
    let keys = tarn_s3::sse::KeyRing::load(
        args.sse_master_key_file
            .as_deref()
            .or(file.sse_master_key_file.as_deref()),
        args.kms_key_file
            .as_deref()
            .or(file.kms_key_file.as_deref()),
        args.kms_default_key
            .as_deref()
            .or(file.kms_default_key.as_deref()),
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!(
        master_keys = ?keys.master_ids(),
        kms_keys = ?keys.kms_ids(),
        "server-side encryption keys"
    );
    let settings = tarn_s3::S3Settings {
        region: region.clone(),
        domains: domains.clone(),
        keys: Arc::new(keys),
    };
    let io_uring = !args.no_io_uring && file.io_uring.unwrap_or(true);
    let permissions = load_permissions(&store, &access, &secret, io_uring)?;
    let cache_budget = match &args.cache_max_bytes {
        Some(b) => parse_size(b).context("--cache-max-bytes")?,
        None => file.cache_max_bytes.unwrap_or(0),
    };
    permissions.caches.set_budget(cache_budget);
    match args
        .bucket_defaults
        .as_deref()
        .or(file.bucket_defaults.as_deref())
    {
        None | Some("aws") => {}
        Some("legacy") => permissions.set_legacy_bucket_defaults(true),
        Some(other) => anyhow::bail!("bucket_defaults must be aws or legacy, not {other:?}"),
    }
    if let Some(node) = &node {
        // Users, keys and buckets' settings changed through another node.
        let p = permissions.clone();
        node.on_docs_changed(Box::new(move || {
            let p = p.clone();
            Box::pin(async move {
                match p.reload().await {
                    Ok(()) => true,
                    Err(error) => {
                        tracing::warn!(%error, "cannot read users and permissions again");
                        false
                    }
                }
            })
        }));
    }
    let permissions_of_admin = permissions.clone();
    let s3 = tarn_s3::build_service(store.clone(), permissions, &settings);
    let sse_keys = settings.keys.clone();
    println!(
        "Tarn {} — {} drive(s), erasure {k}+{m}, region {region}",
        env!("CARGO_PKG_VERSION"),
        store.drive_status().len()
    );
    println!("Access key: {access}");
    if defaulted {
        println!("Secret key: {secret}   (built-in default, accepted on loopback only)");
    } else {
        println!("Secret key: (as configured)");
    }
    let scan = args
        .scan_interval_secs
        .or(file.scan_interval_secs)
        .unwrap_or(6 * 3600);
    // The KV store runs on its own runtime threads, one per core like S3's.
    let kv = match kv {
        Some(kv) => {
            let shm_wanted = kv.shm;
            let (kv_advertise, kv_ramp) = (kv.advertise.clone(), kv.ramp);
            if node.is_none() && (kv_advertise.is_some() || kv_ramp.is_some()) {
                bail!("--kv-advertise and --kv-ramp-secs (kv.advertise, kv.ramp_secs) are for a cluster node (--cluster)");
            }
            let kv_ramp = kv_ramp.unwrap_or(Duration::from_secs(KV_RAMP_DEFAULT_SECS));
            let (engines, server) = start_kv(kv, root, (cores, io_uring, nofile), tls.as_ref())?;
            let e = &engines[0].1;
            println!(
                "KV endpoint: {} ({}{} MiB RAM{}{}{})",
                server.tcp_addr,
                if tls.is_some() { "TLS, " } else { "" },
                e.config().memory_bytes >> 20,
                match &e.config().disk_dir {
                    Some(d) => format!(
                        ", NVMe tier {} ({} MiB)",
                        d.display(),
                        e.config().disk_bytes >> 20
                    ),
                    None => String::new(),
                },
                if server.shm_socket.is_some() {
                    ", shared memory for local clients"
                } else if shm_wanted {
                    ", no shared memory: this kernel cannot seal the arena"
                } else {
                    ""
                },
                match engines.len() {
                    1 => String::new(),
                    n => format!(", {} more tenant(s)", n - 1),
                }
            );
            if let Some(node) = &node {
                // Clients route keys over the members that run a KV store:
                // this node answers CLUSTER with them and checks routed
                // batches against them.
                let views = server.views.clone();
                let me = node.cfg.node_id.clone();
                node.on_kv_members(Box::new(move |m| {
                    let n = m.members.len();
                    let members = m
                        .members
                        .into_iter()
                        .map(|(id, k)| tarn_kv::proto::ViewMember {
                            id,
                            endpoint: k.endpoint,
                            weight: k.weight,
                        })
                        .collect();
                    let view = tarn_kv::proto::ClusterView::new(m.epoch, members, &me);
                    if view.members.len() < n {
                        tracing::warn!(
                            left_out = n - view.members.len(),
                            "KV members whose id or endpoint is too long for clients are left out"
                        );
                    }
                    views.set(view);
                }));
                // A store that starts empty takes a full share of the keys
                // only gradually; its misses fall back to the next node.
                let empty = engines.iter().all(|(_, e)| e.is_empty());
                let ramp = (empty && !kv_ramp.is_zero()).then_some(kv_ramp);
                let endpoint = kv_endpoint(
                    kv_advertise.as_deref(),
                    server.tcp_addr,
                    &node.cfg.advertise,
                );
                println!(
                    "KV cluster member at {endpoint}{}",
                    match ramp {
                        Some(r) => format!(" (empty: weight ramps up over {} s)", r.as_secs()),
                        None => String::new(),
                    }
                );
                node.publish_kv(endpoint, ramp);
            }
            Some((engines, server))
        }
        None => None,
    };
    // In a cluster this counts the other nodes' drives too: a larger reserve.
    let local_drives = store.drive_status().len();
    let (conn_max, per_client) = fdlimit::default_caps(nofile, local_drives);
    let conn_max = args
        .connections_max
        .or(file.connections_max)
        .unwrap_or(conn_max);
    let per_client = args
        .connections_per_client_max
        .or(file.connections_per_client_max)
        .unwrap_or(per_client.min(conn_max));
    if conn_max == 0 || per_client == 0 {
        bail!("connections_max and connections_per_client_max must be at least 1");
    }
    tracing::info!(
        open_files_limit = nofile,
        connections_max = conn_max,
        connections_per_client_max = per_client,
        "S3 connections capped below the open-files limit"
    );
    let inflight_max = args
        .inflight_requests_max
        .or(file.inflight_requests_max)
        .unwrap_or(1024);
    let lease_secs = args.local_read_lease_secs.or(file.local_read_lease_secs);
    if lease_secs.is_some_and(|s| !(1..=3600).contains(&s)) {
        bail!("--local-read-lease-secs (local_read_lease_secs) must be between 1 and 3600");
    }
    let settings = server::ServerSettings {
        connections: fdlimit::Connections::new(conn_max, per_client),
        listen,
        admin_listen,
        cores,
        pin: cores > 1,
        io_uring,
        inflight_requests_max: inflight_max,
        inflight_per_key_max: file
            .inflight_requests_per_key_max
            .unwrap_or((inflight_max / 4).max(8))
            .max(1),
        body_min_rate: file
            .request_body_min_rate_bytes
            .unwrap_or(server::MIN_RATE_DEFAULT_BYTES),
        response_min_rate: file
            .response_min_rate_bytes
            .unwrap_or(server::MIN_RATE_DEFAULT_BYTES),
        read_ahead_per_key_max_bytes: file
            .response_buffer_per_key_max_bytes
            .map(|b| b as usize)
            .unwrap_or(
                file.response_buffer_max_bytes
                    .map_or(StoreConfig::default().read_ahead_max_bytes, |b| b as usize)
                    / 2,
            ),
        rate_window: idle_secs(
            file.min_rate_window_secs,
            server::RATE_WINDOW_DEFAULT,
            "min_rate_window_secs",
        )?,
        domains,
        region,
        admin_token: secret,
        access: permissions_of_admin,
        sse_keys,
        scan_interval: (scan > 0).then(|| Duration::from_secs(scan)),
        lifecycle: {
            let d = tarn_s3::lifecycle::ScanSettings::default();
            let secs = |a: Option<u64>, f: Option<u64>, d: Duration| {
                a.or(f).map_or(d, |s| Duration::from_secs(s.max(1)))
            };
            tarn_s3::lifecycle::ScanSettings {
                interval: secs(
                    args.lifecycle_interval_secs,
                    file.lifecycle_interval_secs,
                    d.interval,
                ),
                day: secs(args.lifecycle_day_secs, file.lifecycle_day_secs, d.day),
                rate: args
                    .lifecycle_rate
                    .or(file.lifecycle_rate)
                    .unwrap_or(d.rate),
            }
        },
        kv: kv.as_ref().map(|(e, _)| e.clone()).unwrap_or_default(),
        kv_connections: kv.as_ref().map(|(_, s)| s.connections.clone()),
        tls: tls.as_ref().map(|t| t.cert.clone()),
        sendfile: !args.no_sendfile && file.sendfile.unwrap_or(true),
        unpace_local: !args.pace_local_clients && !file.pace_local_clients.unwrap_or(false),
        large_folios: !args.no_large_folios && file.large_folios.unwrap_or(true),
        local_read_lease: (!args.no_local_reads && file.local_reads.unwrap_or(true))
            .then(|| lease_secs.map_or(local_read::LEASE_DEFAULT, Duration::from_secs)),
        admin_bound,
        cluster: node.clone(),
        body_idle_timeout: idle_secs(
            file.request_body_idle_timeout_secs,
            server::BODY_IDLE_TIMEOUT_DEFAULT,
            "request_body_idle_timeout_secs",
        )?,
        send_idle_timeout: idle_secs(
            file.response_send_idle_timeout_secs,
            server::SEND_IDLE_TIMEOUT_DEFAULT,
            "response_send_idle_timeout_secs",
        )?,
    };
    let result = server::run(store, s3, settings);
    if let Some((engines, kv_server)) = kv {
        kv_server.stop();
        // A clean stop keeps the KV store for the next start when it has
        // an NVMe tier: the blocks only in RAM are written there.
        for (tenant, engine) in &engines {
            let (blocks, bytes) = engine.spill_to_disk();
            if blocks > 0 {
                tracing::info!(
                    tenant,
                    blocks,
                    bytes,
                    "KV blocks held only in RAM written to the NVMe tier"
                );
            }
        }
    }
    if let Some(node) = node {
        node.stop();
    }
    result
}

/// This node's TLS: its certificate (read again when its files change)
/// and the CA bundle that signed the other nodes'.
struct Tls {
    cert: Arc<tarn_io::tls::ServerCert>,
    ca: Option<PathBuf>,
}

/// TLS from --tls-cert/--tls-key/--tls-ca or `[tls]`; None without a
/// certificate. Half of it is an error, never a plain server.
fn tls_settings(args: &ServerArgs, file: &FileConfig) -> anyhow::Result<Option<Tls>> {
    let f = file.tls.as_ref();
    let cert = args.tls_cert.clone().or(f.and_then(|t| t.cert.clone()));
    let key = args.tls_key.clone().or(f.and_then(|t| t.key.clone()));
    let ca = args.tls_ca.clone().or(f.and_then(|t| t.ca.clone()));
    let (cert, key) = match (cert, key) {
        (None, None) => {
            if ca.is_some() {
                bail!("--tls-ca (tls.ca) is for a node serving TLS: give --tls-cert and --tls-key too");
            }
            return Ok(None);
        }
        (Some(c), Some(k)) => (c, k),
        _ => bail!("--tls-cert and --tls-key (tls.cert, tls.key) go together: this node's certificate chain and its private key, PEM"),
    };
    if let Some(ca) = &ca {
        tarn_io::tls::roots(ca).map_err(|e| anyhow::anyhow!("--tls-ca {e}"))?;
    }
    let cert =
        tarn_io::tls::ServerCert::load(&cert, &key).map_err(|e| anyhow::anyhow!("TLS: {e}"))?;
    cert.watch();
    Ok(Some(Tls { cert, ca }))
}

/// Plain HTTP (or plain cluster RPC) only on loopback unless asked for:
/// credentials and data would cross the network readable by anyone on it.
fn refuse_plain_beyond_loopback(
    addrs: impl IntoIterator<Item = std::net::SocketAddr>,
) -> anyhow::Result<()> {
    if let Some(open) = addrs.into_iter().find(|a| !a.ip().is_loopback()) {
        bail!("refusing to serve without TLS on {open}, beyond loopback: give --tls-cert and --tls-key, or --allow-plain-http (allow_plain_http = true) where the network is trusted or TLS ends in front of Tarn");
    }
    Ok(())
}

/// A listener's URL as the cluster status shows it: on every address
/// (0.0.0.0, ::) it is reached by the advertised host.
fn published_url(scheme: &str, listen: std::net::SocketAddr, advertise: &str) -> String {
    if !listen.ip().is_unspecified() {
        return format!("{scheme}://{listen}");
    }
    let host = advertise.rsplit_once(':').map_or(advertise, |(h, _)| h);
    format!("{scheme}://{host}:{}", listen.port())
}

/// The cluster this server joins, from flags, environment and the config
/// file; None for a single node (no --etcd). Half a cluster configuration
/// is an error, never a single node that ignored it.
fn cluster_settings(
    args: &ServerArgs,
    file: &FileConfig,
    drives: &[PathBuf],
    (listen, admin_listen): (std::net::SocketAddr, std::net::SocketAddr),
    (tls, allow_plain): (Option<&Tls>, bool),
) -> anyhow::Result<Option<tarn_cluster::node::NodeConfig>> {
    let f = file.cluster.as_ref();
    let name = args.cluster.clone().or(f.and_then(|c| c.name.clone()));
    let etcd = args.etcd.clone().or(f.and_then(|c| c.etcd.clone()));
    let node_id = args.node_id.clone().or(f.and_then(|c| c.node_id.clone()));
    let advertise = args
        .advertise
        .clone()
        .or(f.and_then(|c| c.advertise.clone()));
    let no_drives = args.no_drives || f.and_then(|c| c.no_drives).unwrap_or(false);
    let (name, etcd) = match (name, etcd) {
        (None, None) => {
            if node_id.is_some()
                || advertise.is_some()
                || no_drives
                || args.seal_etcd_records
                || args.etcd_user.is_some()
                || args.etcd_ca.is_some()
                || args.etcd_cert.is_some()
                || args.etcd_key.is_some()
            {
                bail!("--node-id, --advertise, --no-drives and the --etcd-* options are for a cluster: give --cluster and --etcd too");
            }
            return Ok(None);
        }
        (Some(n), Some(e)) => (n, e),
        (Some(_), None) => bail!("--cluster needs --etcd (the cluster's etcd endpoints)"),
        (None, Some(_)) => bail!("--etcd needs --cluster (the cluster's name)"),
    };
    let Some(node_id) = node_id else {
        bail!("a cluster node needs --node-id");
    };
    if args.set_drive_count.is_some()
        || args.data_shards.is_some()
        || args.parity_shards.is_some()
        || file.erasure.is_some()
    {
        bail!("a cluster's erasure layout is its map's (tarn admin … cluster init --data-shards K --parity-shards M), not a node's flags");
    }
    let Some(advertise) = advertise else {
        bail!("a cluster node needs --advertise HOST:PORT (where the other nodes reach it)");
    };
    let secret = match std::env::var("TARN_CLUSTER_SECRET") {
        Ok(s) if !s.is_empty() => s,
        _ => match f.and_then(|c| c.secret.clone()) {
            Some(s) => s,
            None => bail!("a cluster node needs the cluster secret: set TARN_CLUSTER_SECRET (or cluster.secret in the config file); there is no default"),
        },
    };
    if no_drives && !args.drives.is_empty() {
        bail!("--no-drives and --drive contradict each other");
    }
    let etcd_user = match args
        .etcd_user
        .clone()
        .or(f.and_then(|c| c.etcd_user.clone()))
    {
        None => None,
        Some(user) => {
            let password = match std::env::var("TARN_ETCD_PASSWORD") {
                Ok(p) if !p.is_empty() => p,
                _ => match f.and_then(|c| c.etcd_password.clone()) {
                    Some(p) => p,
                    None => bail!("--etcd-user {user} needs its password: set TARN_ETCD_PASSWORD (or cluster.etcd_password)"),
                },
            };
            Some((user, password))
        }
    };
    let etcd_tls = tarn_cluster::etcd::EtcdTls {
        ca: args.etcd_ca.clone().or(f.and_then(|c| c.etcd_ca.clone())),
        cert: args
            .etcd_cert
            .clone()
            .or(f.and_then(|c| c.etcd_cert.clone())),
        key: args.etcd_key.clone().or(f.and_then(|c| c.etcd_key.clone())),
    };
    let drives = if no_drives {
        Vec::new()
    } else {
        drives.to_vec()
    };
    let rpc = tarn_cluster::node::rpc_bind_address(&advertise).map_err(anyhow::Error::msg)?;
    if tls.is_none() && !allow_plain {
        refuse_plain_beyond_loopback([rpc])?;
    }
    let rpc_tls = match tls {
        None => None,
        Some(t) => Some(tarn_cluster::rpc::RpcTls::new(
            &t.cert,
            tarn_io::tls::client_config(t.ca.as_deref())
                .map_err(|e| anyhow::anyhow!("--tls-ca: {e}"))?,
        )),
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    Ok(Some(tarn_cluster::node::NodeConfig {
        cluster: name,
        etcd,
        etcd_tls,
        node_id,
        s3_url: published_url(scheme, listen, &advertise),
        admin_url: published_url(scheme, admin_listen, &advertise),
        advertise,
        secret: secret.into_bytes(),
        seal_existing: args.seal_etcd_records,
        etcd_user,
        drives,
        rpc_tls,
        zone: f.and_then(|c| c.zone.clone()),
    }))
}

/// Joins the cluster: the node registers and serves its drives, waits
/// (its admin port up, for `cluster init`) until the cluster is formed,
/// then opens the engine over the cluster map's sets.
fn join_cluster(
    nc: tarn_cluster::node::NodeConfig,
    cfg: StoreConfig,
    admin_listen: std::net::SocketAddr,
    (token, tls): (&str, Option<&Tls>),
) -> anyhow::Result<(
    Arc<Store>,
    Arc<tarn_cluster::node::Node>,
    std::net::TcpListener,
)> {
    let node = tarn_cluster::node::Node::start(nc).map_err(anyhow::Error::msg)?;
    let admin = std::net::TcpListener::bind(admin_listen)
        .with_context(|| format!("binding admin {admin_listen}"))?;
    admin.set_nonblocking(true)?;
    println!(
        "Cluster {}: node {} (RPC {}{}), admin endpoint {}://{}",
        node.cfg.cluster,
        node.cfg.node_id,
        node.cfg.advertise,
        if tls.is_some() { ", TLS" } else { "" },
        if tls.is_some() { "https" } else { "http" },
        admin.local_addr()?
    );
    let acceptor = tls.map(|t| t.cert.acceptor(&[b"http/1.1"]));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let forming = {
        let (listener, node, token) = (admin.try_clone()?, node.clone(), token.to_string());
        std::thread::Builder::new()
            .name("tarn-forming".into())
            .spawn(move || -> anyhow::Result<()> {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    admin::serve_forming(listener, node, (token, acceptor), stop_rx).await;
                    Ok(())
                })
            })?
    };
    let map = node.wait_for_map();
    let _ = stop_tx.send(true);
    let _ = forming.join();
    let map = map.map_err(anyhow::Error::msg)?;
    let store = node
        .open_store(cfg, map)
        .map_err(anyhow::Error::msg)
        .context("opening the object engine over the cluster map")?;
    Ok((store, node, admin))
}

/// The users and the buckets' permissions, read from the drives before
/// serving. When the drives that hold them lack a read quorum the server
/// starts anyway (root's key works, other requests are answered 503) and a
/// thread retries until they are read.
fn load_permissions(
    store: &Arc<Store>,
    access: &str,
    secret: &str,
    io_uring: bool,
) -> anyhow::Result<Arc<tarn_s3::access::Access>> {
    const RETRY: Duration = Duration::from_secs(5);
    let iam = tarn_s3::iam::Iam::new(store.clone(), access, secret);
    let permissions = tarn_s3::access::Access::new(store.clone(), iam);
    let rt = tarn_io::runtime::build_core_runtime(0, false, io_uring)?;
    match rt.block_on(permissions.load()) {
        Ok(()) => {}
        Err(tarn_s3::iam::IamError::Corrupt { what, reason }) => {
            bail!("reading users and permissions: {what}: {reason}")
        }
        Err(e) => {
            tracing::warn!(error = %e, "users not loaded yet; retrying every 5 s");
            let permissions = permissions.clone();
            std::thread::Builder::new()
                .name("tarn-users".into())
                .spawn(move || {
                    let rt = match tarn_io::runtime::build_core_runtime(0, false, io_uring) {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "no runtime to load users on");
                            return;
                        }
                    };
                    while let Err(e) = rt.block_on(permissions.load()) {
                        tracing::warn!(error = %e, "users not loaded yet");
                        std::thread::sleep(RETRY);
                    }
                    tracing::info!("users loaded");
                })?;
        }
    }
    Ok(permissions)
}

/// A timeout in whole seconds from the file: at least 1.
fn idle_secs(v: Option<u64>, default: Duration, key: &str) -> anyhow::Result<Duration> {
    match v {
        None => Ok(default),
        Some(0) => anyhow::bail!("{key} must be at least 1 second"),
        Some(s) => Ok(Duration::from_secs(s)),
    }
}

fn run_heal(args: DriveArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(p) => FileConfig::load(p)?,
        None => FileConfig::default(),
    };
    let cfg = store_config(args.drives, &file, None)?;
    let store: Arc<Store> = Store::open(cfg)?;
    let rt = tarn_io::runtime::build_core_runtime(0, false, true)?;
    let report = rt.block_on(store.heal_all());
    println!("{report:?}");
    if report.failures > 0 {
        bail!("{} objects could not be healed", report.failures);
    }
    Ok(())
}

fn main() {
    metrics::mark_start();
    let filter = tracing_subscriber::EnvFilter::try_from_env("TARN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // s3s logs every client error (a wrong bucket name, malformed XML, a 404) at
    // ERROR; those are the client's, not ours. Server-side failures are logged by
    // tarn itself, so s3s's own logging is off unless TARN_LOG names it.
    let filter = if std::env::var("TARN_LOG").is_ok_and(|v| v.contains("s3s")) {
        filter
    } else {
        filter.add_directive("s3s=off".parse().expect("static directive"))
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Server(a) => run_server(*a),
        Command::Heal(a) => run_heal(a),
        Command::Bench(BenchCommand::S3(a)) => bench::run(*a),
        Command::Bench(BenchCommand::Kv(a)) => bench_kv::run(*a),
        Command::Bench(BenchCommand::Drive(a)) => bench_drive::run(a),
        Command::Admin(a) => admin_cli::run(*a),
        Command::Cosi(a) => cosi::run(*a),
        Command::Mount(a) => mount_cli::run_mount(*a),
        Command::Umount(a) => mount_cli::run_umount(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_endpoints_clients_can_use() {
        for good in ["10.0.0.5:9400", "kv-3.example:1", "[::1]:9400"] {
            assert_eq!(kv_advertise_checked(good.into()).unwrap(), good);
        }
        for bad in [
            "10.0.0.5",
            ":9400",
            "host:",
            "host:0",
            "host:70000",
            &"h".repeat(300),
        ] {
            assert!(kv_advertise_checked(bad.to_string()).is_err(), "{bad}");
        }
        let any = "0.0.0.0:9401".parse().unwrap();
        assert_eq!(kv_endpoint(None, any, "10.1.2.3:7000"), "10.1.2.3:9401");
        let one = "10.9.9.9:9401".parse().unwrap();
        assert_eq!(kv_endpoint(None, one, "10.1.2.3:7000"), "10.9.9.9:9401");
        assert_eq!(kv_endpoint(Some("kv:1"), one, "x:1"), "kv:1");
    }
}
