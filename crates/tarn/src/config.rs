//! Server configuration: flags, environment and an optional TOML file.
//! Precedence: flag or environment variable > config file > built-in default.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Credentials accepted only while every listener is on loopback (S3 and KV
/// share them; clients fall back to them too).
pub use tarn_kv::auth::{DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    pub drives: Option<Vec<PathBuf>>,
    pub region: Option<String>,
    pub access_key: Option<String>,
    pub secret_key: Option<String>,
    pub domains: Option<Vec<String>>,
    pub cores: Option<usize>,
    pub erasure: Option<ErasureConfig>,
    pub stripe_size_bytes: Option<usize>,
    pub inline_threshold_bytes: Option<usize>,
    pub etag_mode: Option<String>,
    pub etag_md5_max_bytes: Option<u64>,
    pub inflight_requests_max: Option<usize>,
    /// Requests in flight of one access key (anonymous: of one client
    /// address); default a quarter of `inflight_requests_max`.
    pub inflight_requests_per_key_max: Option<usize>,
    /// The slowest a request body may arrive, and a response be read, on
    /// average over each 20 s (bytes per second; 0: no minimum).
    pub request_body_min_rate_bytes: Option<u64>,
    pub response_min_rate_bytes: Option<u64>,
    /// Seconds the minimum rates are averaged over (default 20).
    pub min_rate_window_secs: Option<u64>,
    /// S3 connections open at once, and per client address.
    pub connections_max: Option<usize>,
    pub connections_per_client_max: Option<usize>,
    pub buffers_per_core: Option<usize>,
    /// GET data read ahead of clients, in all (bytes; default 256 MiB),
    /// and of one access key's (anonymous: one address's); default half
    /// of it (a loader's many parallel GETs keep their read-ahead).
    pub response_buffer_max_bytes: Option<u64>,
    pub response_buffer_per_key_max_bytes: Option<u64>,
    pub scan_interval_secs: Option<u64>,
    /// Bytes every cache bucket of the node may hold together.
    pub cache_max_bytes: Option<u64>,
    /// `aws` (default) or `legacy`: see `--bucket-defaults`.
    pub bucket_defaults: Option<String>,
    /// See `--lifecycle-interval-secs`, `--lifecycle-day-secs`, `--lifecycle-rate`.
    pub lifecycle_interval_secs: Option<u64>,
    pub lifecycle_day_secs: Option<u64>,
    pub lifecycle_rate: Option<u64>,
    /// See `--sse-master-key-file`, `--kms-key-file`, `--kms-default-key`.
    pub sse_master_key_file: Option<std::path::PathBuf>,
    pub kms_key_file: Option<std::path::PathBuf>,
    pub kms_default_key: Option<String>,
    pub io_uring: Option<bool>,
    /// Free space kept on every drive (bytes); default 2% of it, at most 1 GiB.
    pub drive_reserve_bytes: Option<u64>,
    /// Bytes of objects per second a backfill may visit (0: no limit).
    pub heal_rate_bytes: Option<u64>,
    /// Objects a backfill heals at once.
    pub heal_concurrency: Option<usize>,
    /// Seconds a request body may send nothing before the request fails.
    pub request_body_idle_timeout_secs: Option<u64>,
    /// Seconds a response may wait for the client to read before the
    /// connection is reset.
    pub response_send_idle_timeout_secs: Option<u64>,
    pub kv: Option<KvFileConfig>,
    pub cluster: Option<ClusterFileConfig>,
    pub tls: Option<TlsFileConfig>,
    /// Serve without TLS on addresses beyond loopback.
    pub allow_plain_http: Option<bool>,
    /// Serve short-circuit reads to readers on this host (default true).
    pub local_reads: Option<bool>,
    /// Seconds a local reader's grant pins its version (default 30).
    pub local_read_lease_secs: Option<u64>,
    /// Send GET bytes read from this node's shard files from the files
    /// (`sendfile`) on plain HTTP connections (default true).
    pub sendfile: Option<bool>,
    /// Keep the host's congestion control for clients on this host
    /// (default false: a pacing one is switched to one that does not pace).
    pub pace_local_clients: Option<bool>,
    /// Read a GET's blocks that are not in the page cache into it in large
    /// folios first (default true).
    pub large_folios: Option<bool>,
}

/// `[cluster]`: join a cluster (flags and environment take precedence).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFileConfig {
    pub name: Option<String>,
    pub etcd: Option<String>,
    pub node_id: Option<String>,
    pub advertise: Option<String>,
    /// The cluster secret, when TARN_CLUSTER_SECRET is not set.
    pub secret: Option<String>,
    /// etcd's user for this node (etcd with authentication enabled), and
    /// its password when TARN_ETCD_PASSWORD is not set.
    pub etcd_user: Option<String>,
    pub etcd_password: Option<String>,
    /// TLS to `https://` etcd endpoints: the CA of etcd's server
    /// certificates, and this node's certificate and key (PEM files).
    pub etcd_ca: Option<std::path::PathBuf>,
    pub etcd_cert: Option<std::path::PathBuf>,
    pub etcd_key: Option<std::path::PathBuf>,
    pub zone: Option<String>,
    pub no_drives: Option<bool>,
}

/// `[tls]`: this node's certificate and key for every listener, and the CA
/// bundle that signed the other nodes' certificates.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFileConfig {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
}

/// `[kv]`: the KV-cache store (off unless `enabled` or `--kv`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvFileConfig {
    pub enabled: Option<bool>,
    pub listen: Option<String>,
    pub memory: Option<String>,
    pub disk: Option<PathBuf>,
    pub disk_size: Option<String>,
    pub value_max: Option<String>,
    pub segment_size: Option<String>,
    /// "auto", "on" or "off": the RAM tier on 2 MiB huge pages.
    pub huge_pages: Option<String>,
    pub shared_memory: Option<bool>,
    /// The shared-memory socket as a file in this directory (`--kv-shm-dir`).
    pub shared_memory_dir: Option<std::path::PathBuf>,
    /// Seconds an authenticated connection may stay silent.
    pub idle_timeout_secs: Option<u64>,
    /// Seconds the rest of a frame may take once its header arrived.
    pub frame_timeout_secs: Option<u64>,
    /// Seconds from accept to a completed HELLO and AUTH.
    pub handshake_timeout_secs: Option<u64>,
    /// Open KV connections (TCP and shared memory) past which a new one is
    /// closed at once.
    pub connections_max: Option<usize>,
    /// Authenticated KV connections one tenant may hold.
    pub connections_per_tenant_max: Option<usize>,
    /// In a cluster: the KV endpoint other hosts reach this node at.
    pub advertise: Option<String>,
    /// In a cluster: seconds a node whose KV store starts empty ramps its
    /// routing weight over.
    pub ramp_secs: Option<u64>,
    /// Tenants besides the default one (whose credentials are the server's).
    pub tenants: Option<Vec<KvTenantConfig>>,
}

/// `[[kv.tenants]]`: a tenant with its own credentials, namespaces and memory.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvTenantConfig {
    pub name: String,
    pub access_key: String,
    pub secret_key: String,
    /// Namespace prefixes the tenant may use; `""` grants every name.
    pub namespaces: Vec<String>,
    /// Its RAM arena (e.g. "2GiB").
    pub memory: String,
    /// Its NVMe tier under `<kv.disk>/tenants/<name>` (needs `kv.disk`).
    pub disk_size: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErasureConfig {
    pub set_drive_count: Option<usize>,
    pub data_shards: Option<usize>,
    pub parity_shards: Option<usize>,
}

impl FileConfig {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config file {}", path.display()))
    }
}

pub fn parse_addr(s: &str) -> anyhow::Result<SocketAddr> {
    s.parse()
        .with_context(|| format!("invalid address {s:?} (expected IP:PORT)"))
}

/// Parses sizes like `1MiB`, `128KiB`, `4096`.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().with_context(|| format!("invalid size {s:?}"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => bail!("unknown size unit {other:?}"),
    };
    Ok(n * mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("128KiB").unwrap(), 128 << 10);
        assert_eq!(parse_size("42").unwrap(), 42);
        assert!(parse_size("1XB").is_err());
    }

    #[test]
    fn config_file_rejects_unknown_keys() {
        assert!(toml::from_str::<FileConfig>("listen = \"127.0.0.1:1\"\nbogus = 1").is_err());
        let c: FileConfig = toml::from_str(
            "drives = [\"/a\", \"/b\"]\n[erasure]\ndata_shards = 1\nparity_shards = 1",
        )
        .unwrap();
        assert_eq!(c.drives.unwrap().len(), 2);
        assert_eq!(c.erasure.unwrap().parity_shards, Some(1));
    }
}
