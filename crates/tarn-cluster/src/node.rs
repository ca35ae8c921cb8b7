//! One node of a cluster: it claims its drives, records itself in etcd
//! (`nodes/<id>`, permanent) and holds its membership (`members/<id>`, on a
//! lease), serves its drives to the other nodes over RPC, waits for the
//! cluster map (`cluster init`), then opens the engine over the map's sets
//! and follows etcd's changes to buckets and system documents with a watch.
//!
//! The data path never waits on etcd: the engine serves with the map it
//! opened with, bucket records and documents as last seen; a watch that
//! breaks (etcd away) is started again from a full read once etcd answers.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use serde_json::json;
use tarn_store::drive_io::Drive;
use tarn_store::format::{id_from_hex, id_to_hex, new_id, Id128};
use tarn_store::lock::LeaseTable;
use tarn_store::{
    ClusterDrive, ClusterLayout, DrainReport, DriveChange, PoolLayout, Resumed, Store, StoreConfig,
};

use crate::catalog::{decode_bucket, EtcdCatalog};
use crate::etcd::Unsealed;
use crate::etcd::{Etcd, EtcdError, EtcdTls, Event};
use crate::jobs::Leadership;
use crate::keys::{valid_name, Keys, LAYOUT_UNSEALED, LAYOUT_VERSION};
use crate::map::{self, ClusterMap, KvMember, Member, NodeRecord, NodeState, FORMAT};
use crate::membership::Membership;
use crate::remote::{DriveProvider, DriveService, RemoteDrive};
use crate::rpc::client::ClientLimits;
use crate::rpc::server::{serve, ServerStats};
use crate::rpc::wire::op;
use crate::rpc::{Identity, RpcClient};

/// Seconds of a member's lease.
pub const MEMBER_TTL_SECS: i64 = 6;
/// Deadline of one etcd call.
const ETCD_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a node publishes its background progress, and how long a
/// published one outlives the node.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
const PROGRESS_TTL_SECS: i64 = 10;
/// How a drain leader that was fenced off says so (tests wait for it).
const LOST_DRAIN: &str = "lost the drain leadership";
/// Free space is published to this grain (64 MiB), so that every write
/// does not rewrite it.
const SPACE_GRAIN: u64 = (64 << 20) - 1;

/// What `publish_progress` has put in etcd.
#[derive(Default)]
struct Published {
    lease: Option<i64>,
    space: Option<Vec<u8>>,
    progress: bool,
}

/// Sleeps `period`; false when the node stops meanwhile.
async fn pace(stop: &mut tokio::sync::watch::Receiver<bool>, period: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(period) => true,
        _ = stop.changed() => false,
    }
}

/// How often a node without a map (or a broken watch) asks etcd again.
const RETRY: Duration = Duration::from_millis(500);

/// What a new map changes that a running node follows.
#[derive(Debug, Default)]
struct MapDiff {
    /// Set positions given another drive (a node replaced): global set
    /// index (the pools' sets numbered in map order), position, the drive.
    drives: Vec<(usize, usize, map::DriveRef)>,
    /// Pools added after the others (expansion).
    added: Vec<map::Pool>,
    /// The pools draining in the new map, and those retired.
    draining: Vec<u32>,
    retired: Vec<u32>,
}

/// How `next` differs from `cur`. Refused, saying what, for a change a
/// running node cannot follow (a pool removed or reordered, a geometry
/// changed).
fn map_diff(cur: &ClusterMap, next: &ClusterMap) -> Result<MapDiff, String> {
    if next.pools.len() < cur.pools.len() {
        return Err(format!(
            "{} pool(s) became {}",
            cur.pools.len(),
            next.pools.len()
        ));
    }
    let mut diff = MapDiff::default();
    let mut first = 0;
    for (a, b) in cur.pools.iter().zip(&next.pools) {
        if (a.id, a.data_shards, a.parity_shards, a.sets.len())
            != (b.id, b.data_shards, b.parity_shards, b.sets.len())
        {
            return Err(format!("pool {} changed its geometry", a.id));
        }
        for (s, (sa, sb)) in a.sets.iter().zip(&b.sets).enumerate() {
            if sa.len() != sb.len() {
                return Err(format!("set {s} of pool {} changed its size", a.id));
            }
            for (p, (da, db)) in sa.iter().zip(sb).enumerate() {
                if (&da.node, &da.drive) != (&db.node, &db.drive) {
                    diff.drives.push((first + s, p, db.clone()));
                }
            }
        }
        first += a.sets.len();
    }
    diff.added = next.pools[cur.pools.len()..].to_vec();
    diff.draining = next
        .pools
        .iter()
        .filter(|p| p.state == map::PoolState::Draining)
        .map(|p| p.id)
        .collect();
    diff.retired = next
        .pools
        .iter()
        .filter(|p| p.state == map::PoolState::Retired)
        .map(|p| p.id)
        .collect();
    Ok(diff)
}

/// The drives the cluster map places on node `id` that none of `found`
/// (this node's formatted drives) is: lost with their disks' contents.
/// Sorted, the last taken first.
async fn lost_drives(
    etcd: &Etcd,
    keys: &Keys,
    id: &str,
    found: &[(Id128, PathBuf)],
) -> Result<Vec<Id128>, String> {
    let (kv, _) = etcd.get(&keys.map()).await.map_err(etcd_err)?;
    let Some(kv) = kv else {
        return Ok(Vec::new());
    };
    let m: ClusterMap = map::decode("cluster map", &kv.value)?;
    let mut lost: Vec<Id128> = m
        .drives()
        .filter(|(_, _, _, d)| d.node == id)
        .filter_map(|(_, _, _, d)| id_from_hex(&d.drive))
        .filter(|d| !found.iter().any(|(f, _)| f == d))
        .collect();
    lost.sort_unstable_by(|a, b| b.cmp(a));
    Ok(lost)
}

/// A drain this node leads.
#[derive(Debug, Clone)]
pub struct DrainJob {
    pub pool: u32,
    pub token: i64,
    pub started: std::time::Instant,
    pub passes: u64,
    /// The pass under way.
    pub report: DrainReport,
    /// Keys and bytes moved by earlier passes.
    pub moved_before: u64,
    pub bytes_before: u64,
}

impl DrainJob {
    /// Keys moved by this leader's passes.
    pub fn moved(&self) -> u64 {
        self.moved_before + self.report.moved
    }

    /// Bytes of the versions moved by this leader's passes.
    pub fn bytes(&self) -> u64 {
        self.bytes_before + self.report.bytes
    }

    /// Keys the pass under way has yet to move.
    pub fn keys_left(&self) -> u64 {
        self.report
            .keys
            .saturating_sub(self.report.moved + self.report.failures)
    }

    /// Bytes moved a second since this leader took the job.
    pub fn rate_bytes(&self) -> f64 {
        self.bytes() as f64 / self.started.elapsed().as_secs_f64().max(1e-3)
    }

    /// Seconds the pass under way needs yet at this leader's key rate; None
    /// before a key has moved.
    pub fn eta_secs(&self) -> Option<f64> {
        let key_rate = self.moved() as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        (key_rate > 0.0).then(|| (self.keys_left() as f64 / key_rate).ceil())
    }

    fn json(&self, node: &str) -> serde_json::Value {
        json!({
            "node": node,
            "kind": "drain",
            "pool": self.pool,
            "token": self.token,
            "passes": self.passes,
            "keys_in_pass": self.report.keys,
            "keys_left": self.keys_left(),
            "moved": self.moved(),
            "bytes_moved": self.bytes(),
            "failures": self.report.failures,
            "uploads_in_pool": self.report.uploads,
            "rate_bytes_per_s": self.rate_bytes().round(),
            "eta_s": self.eta_secs(),
            "elapsed_s": self.started.elapsed().as_secs(),
        })
    }
}

/// What a node is told at start (`tarn server --cluster …`).
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub cluster: String,
    /// Comma-separated `http://host:port` (or `https://`) etcd endpoints.
    pub etcd: String,
    /// The CA and this node's certificate for `https://` endpoints.
    pub etcd_tls: EtcdTls,
    pub node_id: String,
    /// `host:port` where the other nodes reach this node's RPC.
    pub advertise: String,
    pub secret: Vec<u8>,
    /// Seal the records of a cluster formed before sealing, once
    /// (`--seal-etcd-records`).
    pub seal_existing: bool,
    /// etcd's user and password, where etcd authenticates users.
    pub etcd_user: Option<(String, String)>,
    /// This node's drives (none for a gateway, `--no-drives`).
    pub drives: Vec<PathBuf>,
    /// Its S3 and admin endpoints, recorded for tools.
    pub s3_url: String,
    pub admin_url: String,
    /// TLS on the cluster's RPC (every node the same).
    pub rpc_tls: Option<crate::rpc::RpcTls>,
    pub zone: Option<String>,
}

/// A running node.
pub struct Node {
    pub cfg: NodeConfig,
    pub etcd: Etcd,
    pub keys: Keys,
    identity: Identity,
    /// This node's drives: id and directory.
    drives: Vec<(Id128, PathBuf)>,
    epoch: Arc<AtomicU64>,
    map: RwLock<Option<ClusterMap>>,
    store: OnceLock<Arc<Store>>,
    client: Arc<RpcClient>,
    membership: Mutex<Option<Membership>>,
    pub rpc_stats: Arc<ServerStats>,
    /// Called after system documents changed on another node (users,
    /// keys, buckets' settings): the S3 layer reads them again.
    docs_changed: OnceLock<DocsChanged>,
    stop: tokio::sync::watch::Sender<bool>,
    /// Set once the engine is open.
    opened: tokio::sync::watch::Sender<bool>,
    rpc_threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    started: AtomicBool,
    /// The drain this node leads, for `cluster status` and /metrics.
    drain: Mutex<Option<DrainJob>>,
    /// Drives found empty at start that took the place of the drive the
    /// map placed here (`lost_drives`): backfilled in full.
    reclaimed: std::collections::HashSet<Id128>,
    /// This node's membership record (its KV part changes as it ramps up).
    member: Mutex<Option<Member>>,
    /// Told the cluster's KV members whenever they change.
    kv_members: OnceLock<Box<dyn Fn(KvMembers) + Send + Sync>>,
}

/// The members that run a KV store, as of an etcd revision: what a KV
/// server routes by and answers CLUSTER with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvMembers {
    pub epoch: u64,
    /// (node id, its KV endpoint and weight), by id.
    pub members: Vec<(String, KvMember)>,
}

/// Weights a node whose KV store started empty publishes, one after the
/// other over its ramp: a restarted node takes a small share of the keys
/// first (its misses fall back to the node that had them), never a third
/// of every lookup at once.
pub const KV_RAMP_WEIGHTS: [u32; 4] = [100, 250, 500, 1000];

/// Reads users and permissions again; done when they apply (false: they
/// could not be read).
pub type DocsChanged = Box<dyn Fn() -> futures::future::BoxFuture<'static, bool> + Send + Sync>;

/// How long a peer gets to read users and permissions again before an
/// admin change returns without its confirmation.
pub const RELOAD_DOCS_TIMEOUT: Duration = Duration::from_secs(3);

/// Serves this node's drives from the engine once it is open.
struct Provider(Arc<Node>);

impl DriveProvider for Provider {
    fn epoch(&self) -> u64 {
        self.0.epoch.load(Ordering::Acquire)
    }

    fn for_read(&self, drive_id: &Id128) -> Option<Arc<dyn Drive>> {
        self.0.store.get()?.local_drive(drive_id)?.0
    }

    fn for_write(&self, drive_id: &Id128) -> Option<Arc<dyn Drive>> {
        self.0.store.get()?.local_drive(drive_id)?.1
    }

    fn leases(&self, drive_id: &Id128) -> Option<Arc<LeaseTable>> {
        self.0.store.get()?.local_leases(drive_id)
    }

    async fn reload_docs(&self) -> bool {
        match self.0.docs_changed.get() {
            Some(f) => f().await,
            None => false,
        }
    }

    async fn ready(&self) {
        if self.0.store.get().is_some() {
            return;
        }
        let mut opened = self.0.opened.subscribe();
        let _ = tokio::time::timeout(OPENING_WAIT, opened.wait_for(|o| *o)).await;
    }
}

/// How long a call from a peer waits for this node's engine to open.
const OPENING_WAIT: Duration = Duration::from_secs(2);

fn etcd_err(e: EtcdError) -> String {
    e.to_string()
}

/// Whether every etcd endpoint is on this host's loopback.
fn etcd_is_local(endpoints: &str) -> bool {
    endpoints.split(',').map(str::trim).all(|e| {
        let host = e
            .trim_start_matches("http://")
            .rsplit_once(':')
            .map_or("", |(h, _)| h);
        host == "localhost"
            || host
                .trim_matches(['[', ']'])
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    })
}

impl Node {
    /// Claims the drives, checks the etcd layout, records the node and
    /// starts its membership and its RPC listener (on threads of its own).
    /// Blocking.
    pub fn start(cfg: NodeConfig) -> Result<Arc<Node>, String> {
        valid_name("node", &cfg.node_id)?;
        let keys = Keys::new(&cfg.cluster)?;
        if cfg.secret.len() < 16 {
            return Err("the cluster secret must be at least 16 bytes".into());
        }
        let identity =
            Identity::new(&cfg.cluster, &cfg.node_id, &cfg.secret)?.with_tls(cfg.rpc_tls.clone());
        let mut etcd = Etcd::with_tls(&cfg.etcd, ETCD_TIMEOUT, &cfg.etcd_tls)?.sealed(&cfg.secret);
        if !etcd.is_tls() && !etcd_is_local(&cfg.etcd) {
            tracing::warn!(
                etcd = %cfg.etcd,
                "etcd over plain HTTP off this host: anyone on the network can read the cluster's records and passwords in flight; use https:// with --etcd-ca/--etcd-cert/--etcd-key in production (docs/cluster.md)"
            );
        }
        if let Some((user, password)) = &cfg.etcd_user {
            etcd = etcd.with_user(user, password);
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(wait_for_etcd(&etcd, &keys))?;
        let mut drives = Vec::new();
        let mut empty = Vec::new();
        for path in &cfg.drives {
            match tarn_store::formatted_drive_id(path).map_err(|e| e.to_string())? {
                Some(id) => drives.push((id, path.clone())),
                None => empty.push(path.clone()),
            }
        }
        // An empty directory takes the place of a drive the map places on
        // this node and no directory holds (its disk emptied or swapped);
        // otherwise it is a new drive. A missing directory never does: it
        // may be a mount point whose disk is not mounted, and the lost
        // drive's data would land on the disk below.
        let mut reclaimed = std::collections::HashSet::new();
        if !empty.is_empty() {
            let mut lost = rt.block_on(lost_drives(&etcd, &keys, &cfg.node_id, &drives))?;
            for path in empty {
                let reclaim = if path.is_dir() { lost.pop() } else { None };
                let id = match reclaim {
                    Some(id) => {
                        tarn_store::claim_drive_in_place_of(&path, id)
                            .map_err(|e| e.to_string())?;
                        tracing::warn!(drive = %path.display(), id = %id_to_hex(&id), "empty drive takes the place of the drive the cluster map places here; a full backfill fills it");
                        reclaimed.insert(id);
                        id
                    }
                    None => tarn_store::claim_drive(&path).map_err(|e| e.to_string())?,
                };
                drives.push((id, path));
            }
        }
        let client = Arc::new(RpcClient::new(identity.clone(), ClientLimits::default()));
        let (stop, _) = tokio::sync::watch::channel(false);
        let node = Arc::new(Node {
            etcd,
            keys,
            identity,
            drives,
            epoch: Arc::new(AtomicU64::new(0)),
            map: RwLock::new(None),
            store: OnceLock::new(),
            client,
            membership: Mutex::new(None),
            rpc_stats: Arc::default(),
            docs_changed: OnceLock::new(),
            stop,
            opened: tokio::sync::watch::channel(false).0,
            rpc_threads: Mutex::default(),
            started: AtomicBool::new(false),
            reclaimed,
            drain: Mutex::default(),
            member: Mutex::default(),
            kv_members: OnceLock::new(),
            cfg,
        });
        rt.block_on(node.register())?;
        node.start_rpc()?;
        let member = Member {
            format: FORMAT,
            address: node.cfg.advertise.clone(),
            incarnation: u64::from_le_bytes(new_id()[..8].try_into().expect("8 bytes")),
            version: env!("CARGO_PKG_VERSION").to_string(),
            kv: None,
            protocol: Some(node.identity.versions()),
        };
        *node.member.lock().expect("member") = Some(member.clone());
        let m = Membership::start(
            node.etcd.clone(),
            node.keys.member(&node.cfg.node_id),
            serde_json::to_vec(&member).expect("json"),
            MEMBER_TTL_SECS,
        )
        .map_err(|e| format!("membership thread: {e}"))?;
        *node.membership.lock().expect("membership") = Some(m);
        node.started.store(true, Ordering::Release);
        Ok(node)
    }

    /// Seals every permanent record of a cluster formed before sealing (the
    /// values as they are: whatever etcd holds now is taken as Tarn's),
    /// then moves the layout on. Records on leases (members, progress,
    /// space) are left to lapse: their nodes write them again, sealed.
    async fn seal_existing(&self, layout_revision: i64) -> Result<(), String> {
        let layout = self.keys.layout();
        let kvs = self
            .etcd
            .get_prefix_stored(self.keys.root())
            .await
            .map_err(etcd_err)?;
        let mut sealed = 0;
        for kv in kvs {
            if kv.key == layout || kv.lease != 0 || kv.value.starts_with(&crate::etcd::SEAL_MAGIC) {
                continue;
            }
            // Only if unchanged since read: a record changed meanwhile is
            // another writer's, and the migration stops.
            if !self
                .etcd
                .compare_and_swap(&kv.key, kv.mod_revision, &kv.value, None)
                .await
                .map_err(etcd_err)?
            {
                return Err(format!(
                    "{} changed while its record was being sealed; start again",
                    kv.key
                ));
            }
            sealed += 1;
        }
        if !self
            .etcd
            .compare_and_swap(&layout, layout_revision, LAYOUT_VERSION.as_bytes(), None)
            .await
            .map_err(etcd_err)?
        {
            return Err("the layout record changed while sealing; start again".into());
        }
        tracing::warn!(cluster = %self.cfg.cluster, records = sealed, "sealed the cluster's etcd records with the cluster secret (layout {LAYOUT_UNSEALED} -> {LAYOUT_VERSION})");
        Ok(())
    }

    /// The layout version, then this node's permanent record. The layout
    /// record is the first any node of the cluster wrote: one that does not
    /// open under this node's secret means the secret is wrong, and the
    /// node stops here, before it writes anything.
    async fn register(&self) -> Result<(), String> {
        let layout = self.keys.layout();
        let stored = self.etcd.get_stored(&layout).await.map_err(etcd_err)?;
        let seal = self.etcd.seal().expect("a node's etcd client seals");
        match stored {
            Some(kv) => match seal.open(&layout, &kv.value) {
                Ok(v) if v == LAYOUT_VERSION.as_bytes() => {}
                Ok(v) => {
                    return Err(format!(
                        "etcd holds cluster {} in layout {:?}; this binary reads layout {LAYOUT_VERSION}",
                        self.cfg.cluster,
                        String::from_utf8_lossy(v)
                    ))
                }
                Err(Unsealed::Missing) if kv.value == LAYOUT_UNSEALED.as_bytes() => {
                    if !self.cfg.seal_existing {
                        return Err(format!(
                            "etcd holds cluster {} in layout {LAYOUT_UNSEALED}, whose records are not sealed with the cluster secret; \
                             stop every node, upgrade them, and start one once with --seal-etcd-records (docs/cluster.md, \"etcd security\")",
                            self.cfg.cluster
                        ));
                    }
                    self.seal_existing(kv.mod_revision).await?;
                }
                Err(why) => {
                    return Err(format!(
                        "cluster {}'s records in etcd are not sealed with this node's cluster secret ({why:?}): \
                         TARN_CLUSTER_SECRET differs from the one the cluster was formed with (or something else wrote {layout}); \
                         the node does not register",
                        self.cfg.cluster
                    ));
                }
            },
            None => {
                self.etcd
                    .compare_and_swap(&layout, 0, LAYOUT_VERSION.as_bytes(), None)
                    .await
                    .map_err(etcd_err)?;
            }
        }
        let key = self.keys.node(&self.cfg.node_id);
        let (old, _) = self.etcd.get(&key).await.map_err(etcd_err)?;
        let mut ids: Vec<String> = self.drives.iter().map(|(id, _)| id_to_hex(id)).collect();
        let state = match old {
            Some(kv) => {
                let old: NodeRecord = map::decode("node record", &kv.value)?;
                // Drives the map already places stay recorded even when
                // missing now: the map names them.
                let placed: Vec<String> = match self.read_map().await {
                    Ok(Some((m, _))) => m.drives().map(|(_, _, _, d)| d.drive.clone()).collect(),
                    _ => Vec::new(),
                };
                for d in old.drives {
                    if !ids.contains(&d) && placed.contains(&d) {
                        ids.push(d);
                    }
                }
                old.state
            }
            None => NodeState::Active,
        };
        let rec = NodeRecord {
            format: FORMAT,
            id: self.cfg.node_id.clone(),
            address: self.cfg.advertise.clone(),
            s3: self.cfg.s3_url.clone(),
            admin: self.cfg.admin_url.clone(),
            drives: ids,
            zone: self.cfg.zone.clone(),
            state,
        };
        self.etcd
            .put(&key, &serde_json::to_vec(&rec).expect("json"), None)
            .await
            .map_err(etcd_err)?;
        Ok(())
    }

    /// The cluster map and its etcd revision, if the cluster was formed.
    pub async fn read_map(&self) -> Result<Option<(ClusterMap, i64)>, String> {
        let (kv, _) = self.etcd.get(&self.keys.map()).await.map_err(etcd_err)?;
        match kv {
            None => Ok(None),
            Some(kv) => {
                let m: ClusterMap = map::decode("cluster map", &kv.value)?;
                if m.cluster != self.cfg.cluster {
                    return Err(format!("the map in etcd is of cluster {:?}", m.cluster));
                }
                Ok(Some((m, kv.mod_revision)))
            }
        }
    }

    /// The RPC listener on a thread of its own with a small runtime: other
    /// nodes reach this node's drives even while its S3 runtimes are busy.
    fn start_rpc(self: &Arc<Self>) -> Result<(), String> {
        let addr = rpc_bind_address(&self.cfg.advertise)?;
        let std_listener = std::net::TcpListener::bind(addr)
            .map_err(|e| format!("cannot listen for RPC on {addr}: {e}"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        // A few threads, each with its own runtime, accepting on the same
        // socket: a call waits on no other thread's work.
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 4);
        let service = Arc::new(DriveService {
            provider: Provider(self.clone()),
        });
        let mut handles = Vec::new();
        for t in 0..threads {
            let listener = std_listener.try_clone().map_err(|e| e.to_string())?;
            let (node, service, stop) = (self.clone(), service.clone(), self.stop.subscribe());
            let h = std::thread::Builder::new()
                .name(format!("tarn-rpc-{t}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(error) => {
                            tracing::error!(%error, "no runtime for the RPC listener");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let listener = match tokio::net::TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(error) => {
                                tracing::error!(%error, "RPC listener");
                                return;
                            }
                        };
                        serve(
                            listener,
                            node.identity.clone(),
                            service,
                            node.rpc_stats.clone(),
                            stop,
                        )
                        .await;
                    });
                })
                .map_err(|e| e.to_string())?;
            handles.push(h);
        }
        self.rpc_threads
            .lock()
            .expect("rpc threads")
            .extend(handles);
        Ok(())
    }

    /// Waits until the cluster is formed (its map is in etcd). Blocking.
    pub fn wait_for_map(&self) -> Result<ClusterMap, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let mut told = false;
        loop {
            match rt.block_on(self.read_map()) {
                Ok(Some((m, _))) => return Ok(m),
                Ok(None) if !told => {
                    tracing::info!(cluster = %self.cfg.cluster, "waiting for the cluster to be formed (tarn admin … cluster init)");
                    told = true;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read the cluster map yet"),
            }
            std::thread::sleep(RETRY);
        }
    }

    /// Opens the engine over the map's sets. Blocking.
    pub fn open_store(
        self: &Arc<Self>,
        cfg: StoreConfig,
        m: ClusterMap,
    ) -> Result<Arc<Store>, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let (addresses, buckets) = rt.block_on(async {
            let addresses = self.addresses().await?;
            let (kvs, _) = self
                .etcd
                .get_prefix(&self.keys.buckets())
                .await
                .map_err(etcd_err)?;
            Ok::<_, String>((addresses, kvs))
        })?;
        let records = self.bucket_records(buckets)?;
        if m.pools.is_empty() {
            return Err("the cluster map has no pool".into());
        }
        self.epoch.store(m.epoch, Ordering::Release);
        let pools = m
            .pools
            .iter()
            .map(|p| self.pool_layout(p, &addresses, m.epoch))
            .collect::<Result<Vec<_>, _>>()?;
        let deployment_id = id_from_hex(&m.deployment_id)
            .ok_or_else(|| format!("the map's deployment id {:?}", m.deployment_id))?;
        let layout = ClusterLayout {
            deployment_id,
            pools,
            buckets: records,
            catalog: Arc::new(EtcdCatalog::new(self.etcd.clone(), self.keys.clone())),
            node_id: self.cfg.node_id.clone(),
        };
        let store = Store::open_cluster(cfg, layout).map_err(|e| e.to_string())?;
        *self.map.write().expect("map") = Some(m);
        let _ = self.store.set(store.clone());
        self.opened.send_replace(true);
        Ok(store)
    }

    /// How the engine serves one pool of the map of epoch `epoch`.
    fn pool_layout(
        &self,
        p: &map::Pool,
        addresses: &HashMap<String, String>,
        epoch: u64,
    ) -> Result<PoolLayout, String> {
        let mut sets = Vec::with_capacity(p.sets.len());
        for set in &p.sets {
            sets.push(
                set.iter()
                    .map(|d| self.cluster_drive(d, addresses, epoch))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        Ok(PoolLayout {
            id: p.id,
            data_shards: p.data_shards as usize,
            parity_shards: p.parity_shards as usize,
            draining: p.state == map::PoolState::Draining,
            retired: p.state == map::PoolState::Retired,
            sets,
        })
    }

    /// How the engine reaches one place of the map of epoch `epoch`: a
    /// drive of this node (by the id it claimed), or another node's over RPC
    /// (asked with that epoch at least).
    fn cluster_drive(
        &self,
        d: &map::DriveRef,
        addresses: &HashMap<String, String>,
        epoch: u64,
    ) -> Result<ClusterDrive, String> {
        let id =
            id_from_hex(&d.drive).ok_or_else(|| format!("the map names drive {:?}", d.drive))?;
        let joins = d.replaces.is_some() || self.reclaimed.contains(&id);
        if d.node == self.cfg.node_id {
            let path = self
                .drives
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, p)| p.clone())
                .ok_or_else(|| {
                    format!(
                        "the cluster map places drive {} on this node, which has no such drive (give its --drive)",
                        d.drive
                    )
                })?;
            return Ok(ClusterDrive::Local {
                path,
                drive_id: id,
                joins,
            });
        }
        let address = addresses
            .get(&d.node)
            .ok_or_else(|| format!("the map names node {} without a record", d.node))?;
        Ok(ClusterDrive::Remote {
            drive: Arc::new(RemoteDrive::new(
                self.client.clone(),
                address,
                &d.node,
                id,
                self.epoch.clone(),
                epoch,
            )),
            drive_id: id,
            joins,
        })
    }

    /// Node addresses by id, from their records.
    async fn addresses(&self) -> Result<HashMap<String, String>, String> {
        let (nodes, _) = self
            .etcd
            .get_prefix(&self.keys.nodes())
            .await
            .map_err(etcd_err)?;
        let mut addresses = HashMap::new();
        for kv in nodes {
            let rec: NodeRecord = map::decode("node record", &kv.value)?;
            addresses.insert(rec.id, rec.address);
        }
        Ok(addresses)
    }

    /// Bucket records from a read of `buckets/`, by name.
    fn bucket_records(
        &self,
        kvs: Vec<crate::etcd::KeyValue>,
    ) -> Result<BTreeMap<String, tarn_store::format::BucketRecord>, String> {
        let root = self.keys.buckets();
        let mut out = BTreeMap::new();
        for kv in kvs {
            let Some(name) = kv.key.strip_prefix(&root) else {
                continue;
            };
            let rec = decode_bucket(&kv.key, &kv.value).map_err(|e| e.to_string())?;
            out.insert(name.to_string(), rec);
        }
        Ok(out)
    }

    /// Publishes this node's KV store at `endpoint` in its membership
    /// record. With a `ramp` its weight climbs through [`KV_RAMP_WEIGHTS`]
    /// over that time (a store that starts empty); without, it is full at
    /// once.
    pub fn publish_kv(self: &Arc<Self>, endpoint: String, ramp: Option<Duration>) {
        let steps: Vec<u32> = match ramp {
            Some(_) => KV_RAMP_WEIGHTS.to_vec(),
            None => vec![*KV_RAMP_WEIGHTS.last().expect("steps")],
        };
        let every = ramp.unwrap_or_default() / (steps.len() as u32 - 1).max(1);
        let node = self.clone();
        let mut stop = self.stop.subscribe();
        let publish = move |weight: u32| {
            let mut rec = node.member.lock().expect("member");
            let Some(m) = rec.as_mut() else {
                return;
            };
            m.kv = Some(KvMember {
                endpoint: endpoint.clone(),
                weight,
            });
            let value = serde_json::to_vec(&*m).expect("json");
            if let Some(ms) = node.membership.lock().expect("membership").as_ref() {
                ms.update(value);
            }
            tracing::info!(weight, "KV store published to the cluster");
        };
        publish(steps[0]);
        if steps.len() > 1 {
            std::thread::Builder::new()
                .name("tarn-kv-ramp".into())
                .spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("ramp runtime");
                    for w in &steps[1..] {
                        if !rt.block_on(pace(&mut stop, every)) {
                            return;
                        }
                        publish(*w);
                    }
                })
                .expect("spawning the KV ramp thread");
        }
    }

    /// Called with the cluster's KV members whenever they change.
    pub fn on_kv_members(&self, f: Box<dyn Fn(KvMembers) + Send + Sync>) {
        let _ = self.kv_members.set(f);
    }

    /// Reads the members that run a KV store and tells `on_kv_members`.
    async fn read_kv_members(&self) -> Result<(), String> {
        let Some(f) = self.kv_members.get() else {
            return Ok(());
        };
        let (kvs, revision) = self
            .etcd
            .get_prefix(&self.keys.members())
            .await
            .map_err(etcd_err)?;
        let mut members = Vec::new();
        for kv in kvs {
            let Some(id) = kv.key.strip_prefix(&self.keys.members()) else {
                continue;
            };
            match map::decode::<Member>("member record", &kv.value) {
                Ok(Member { kv: Some(k), .. }) => members.push((id.to_string(), k)),
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, member = id, "unreadable member record"),
            }
        }
        members.sort_by(|a, b| a.0.cmp(&b.0));
        f(KvMembers {
            epoch: revision.max(0) as u64,
            members,
        });
        Ok(())
    }

    /// Called after another node changed system documents.
    pub fn on_docs_changed(&self, f: DocsChanged) {
        let _ = self.docs_changed.set(f);
    }

    /// After a change to users, keys or permissions: has every other
    /// registered node read them again, and waits for each (at most
    /// [`RELOAD_DOCS_TIMEOUT`]). The nodes that did not confirm (down,
    /// unreachable, or unable to read etcd), with why; they apply the change
    /// when their etcd watch next delivers it.
    pub async fn reload_docs_everywhere(&self) -> Vec<(String, String)> {
        let nodes = match self.etcd.get_prefix(&self.keys.nodes()).await {
            Ok((kvs, _)) => kvs,
            Err(e) => return vec![("*".into(), format!("etcd: {e}"))],
        };
        let mut calls = Vec::new();
        for kv in nodes {
            let Ok(rec) = map::decode::<NodeRecord>("node record", &kv.value) else {
                continue;
            };
            if rec.id == self.cfg.node_id || rec.state == NodeState::Retired {
                continue;
            }
            let client = self.client.clone();
            let epoch = self.epoch.load(Ordering::Acquire);
            calls.push(async move {
                let r = client
                    .call(
                        &rec.address,
                        Some(&rec.id),
                        op::NODE_RELOAD_DOCS,
                        epoch,
                        &[],
                        RELOAD_DOCS_TIMEOUT,
                    )
                    .await;
                match r {
                    Ok(b) if b == [1] => None,
                    Ok(_) => Some((rec.id, "could not read etcd".to_string())),
                    Err(e) => Some((rec.id, e.to_string())),
                }
            });
        }
        futures::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Follows etcd's changes to bucket records, documents and the map on
    /// the current runtime until the node stops.
    pub fn spawn_watch(self: &Arc<Self>) {
        // A node that was away when a pool of its drives was retired.
        if let Some(store) = self.store.get() {
            sweep_retired(store.clone());
        }
        let node = self.clone();
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            let mut published = Published::default();
            loop {
                node.publish_progress(&mut published).await;
                if !pace(&mut stop, PROGRESS_EVERY).await {
                    return;
                }
            }
        });
        let node = self.clone();
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = node.drain_round() => {}
                    _ = stop.changed() => return,
                }
                if !pace(&mut stop, PROGRESS_EVERY).await {
                    return;
                }
            }
        });
        let node = self.clone();
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = node.watch_once() => {
                        if let Err(error) = r {
                            tracing::warn!(%error, "etcd watch ended; serving with what was last seen, watching again");
                        }
                    }
                    _ = stop.changed() => return,
                }
                tokio::time::sleep(RETRY).await;
            }
        });
    }

    /// Puts this node's background jobs under `progress/<id>` on a short
    /// lease (a node that dies leaves nothing behind), or removes them once
    /// none runs; likewise its drives' space under `space/<id>` (rewritten
    /// only when it changed by 64 MiB or more), and takes the other nodes'
    /// reports of theirs. One lease, renewed, serves both.
    async fn publish_progress(&self, st: &mut Published) {
        let Some(store) = self.store.get() else {
            return;
        };
        let r = async {
            let lease = match st.lease {
                Some(l) if self.etcd.lease_keep_alive(l).await? > 0 => l,
                _ => {
                    // New (or lapsed): what was on the old one is gone.
                    let (l, _) = self.etcd.lease_grant(PROGRESS_TTL_SECS).await?;
                    *st = Published {
                        lease: Some(l),
                        ..Published::default()
                    };
                    l
                }
            };
            let space: serde_json::Map<String, serde_json::Value> = store
                .local_space()
                .into_iter()
                .map(|(id, free, total)| (id_to_hex(&id), json!([free & !SPACE_GRAIN, total])))
                .collect();
            let space = serde_json::to_vec(&space).expect("json");
            if st.space.as_ref() != Some(&space) {
                self.etcd
                    .put(&self.keys.space(&self.cfg.node_id), &space, Some(lease))
                    .await?;
                st.space = Some(space);
            }
            let jobs = self.jobs();
            let key = self.keys.progress(&self.cfg.node_id);
            if !jobs.is_empty() {
                let value = serde_json::to_vec(&jobs).expect("json");
                self.etcd.put(&key, &value, Some(lease)).await?;
            } else if st.progress {
                self.etcd.delete(&key).await?;
            }
            st.progress = !jobs.is_empty();
            let (kvs, _) = self.etcd.get_prefix(&self.keys.space_all()).await?;
            for kv in kvs {
                let Ok(v) = serde_json::from_slice::<HashMap<String, (u64, u64)>>(&kv.value) else {
                    continue;
                };
                for (id, (free, total)) in v {
                    if let Some(id) = id_from_hex(&id) {
                        store.set_remote_space(&id, free, total);
                    }
                }
            }
            Ok::<_, EtcdError>(())
        }
        .await;
        if let Err(error) = r {
            tracing::debug!(%error, "cannot publish background progress");
        }
    }

    /// This node's background jobs, as `cluster status` shows them.
    fn jobs(&self) -> Vec<serde_json::Value> {
        let Some(store) = self.store.get() else {
            return Vec::new();
        };
        let drain = self
            .drain
            .lock()
            .expect("drain")
            .as_ref()
            .map(|d| d.json(&self.cfg.node_id));
        store
            .backfill_status()
            .map(|b| {
                json!({
                    "node": self.cfg.node_id,
                    "kind": "backfill",
                    "phase": b.phase,
                    "drives": b.drives,
                    "sets": b.sets,
                    "objects_total": b.objects_total,
                    "objects_done": b.objects_done,
                    "bytes_done": b.bytes_done,
                    "repaired": b.repaired,
                    "failures": b.failures,
                    "rate_bytes_per_s": b.rate().round(),
                    "eta_s": b.eta_secs().map(f64::ceil),
                    "elapsed_s": b.started.elapsed().as_secs(),
                    "rate_limit_bytes_per_s": b.rate_limit,
                    "resumed_from": b.resumed_from.map(|r| match r {
                        Resumed::Fill { bucket, key } => json!({"phase": "fill", "bucket": bucket, "key": key}),
                        Resumed::Verify => json!({"phase": "verify", "bucket": null, "key": null}),
                    }),
                })
            })
            .into_iter()
            .chain(drain)
            .collect()
    }

    /// The drain this node leads, if any.
    pub fn drain_job(&self) -> Option<DrainJob> {
        self.drain.lock().expect("drain").clone()
    }

    /// Every 2 s: while the map has a draining pool, campaigns for the
    /// drain's leadership and, won, runs the drain to its end (or until the
    /// leadership is lost).
    async fn drain_round(self: &Arc<Self>) {
        let (Some(store), Some(m)) = (
            self.store.get().cloned(),
            self.map.read().expect("map").clone(),
        ) else {
            return;
        };
        let Some(pool) = m
            .pools
            .iter()
            .find(|p| p.state == map::PoolState::Draining)
            .map(|p| p.id)
        else {
            return;
        };
        let lead =
            match Leadership::campaign(&self.etcd, &self.keys, "drain", &self.cfg.node_id).await {
                Ok(Some(l)) => l,
                Ok(None) => return,
                Err(error) => {
                    tracing::debug!(%error, "cannot campaign for the drain");
                    return;
                }
            };
        tracing::info!(pool, token = lead.token, "leading the drain of a pool");
        match self.run_drain(&store, pool, &lead).await {
            Ok(()) => tracing::info!(pool, "pool drained and retired"),
            Err(error) => {
                // A step that failed because this leader was paused past its
                // lease (a peer took the job over) is the fence at work.
                let error = if !error.starts_with(LOST_DRAIN)
                    && matches!(lead.still_leader().await, Ok(false))
                {
                    format!("{LOST_DRAIN} (token {}): {error}", lead.token)
                } else {
                    error
                };
                tracing::warn!(pool, token = lead.token, %error, "the drain stopped; it resumes with the next leader")
            }
        }
        *self.drain.lock().expect("drain") = None;
        lead.resign().await;
    }

    /// Drains pool `pool` under leadership `lead`: passes over the pool
    /// until one finds it empty, a fenced checkpoint after each, then the
    /// fenced map change that retires it.
    async fn run_drain(
        &self,
        store: &Arc<Store>,
        pool: u32,
        lead: &Arc<Leadership>,
    ) -> Result<(), String> {
        let checkpoint = self.keys.job("drain", &pool.to_string());
        let previous = match self.etcd.get(&checkpoint).await.map_err(etcd_err)?.0 {
            Some(kv) => serde_json::from_slice::<serde_json::Value>(&kv.value).unwrap_or_default(),
            None => serde_json::Value::Null,
        };
        let before = |k: &str| previous[k].as_u64().unwrap_or(0);
        if !previous.is_null() {
            tracing::info!(pool, previous_token = %previous["token"], moved = before("moved"), "resuming a drain another leader began");
        }
        *self.drain.lock().expect("drain") = Some(DrainJob {
            pool,
            token: lead.token,
            started: std::time::Instant::now(),
            passes: 0,
            report: DrainReport::default(),
            moved_before: before("moved"),
            bytes_before: before("bytes_moved"),
        });
        let lost = || format!("{LOST_DRAIN} (token {})", lead.token);
        // Checkpointed at once, not only at the first tick: a leader killed
        // right after it took the job still leaves it for the next to resume.
        let job = self
            .drain_job()
            .map(|d| d.json(&self.cfg.node_id))
            .expect("set above");
        if !lead
            .put(&checkpoint, &serde_json::to_vec(&job).expect("json"))
            .await
            .map_err(etcd_err)?
        {
            return Err(lost());
        }
        let mut waiting_for = 0;
        loop {
            if !lead.holds() {
                return Err(lost());
            }
            let proceed = || lead.holds();
            let progress = |r: &DrainReport| {
                if let Some(d) = self.drain.lock().expect("drain").as_mut() {
                    d.report = r.clone();
                }
            };
            // The checkpoint, fenced, every second while the pass runs: a
            // leader that lost the key finds out here too, and stops.
            let passing = AtomicBool::new(true);
            let pass = async {
                let r = store.drain_pass(pool, &proceed, &progress).await;
                passing.store(false, Ordering::Release);
                r
            };
            let ticker = async {
                while passing.load(Ordering::Acquire) {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let Some(job) = self.drain_job().map(|d| d.json(&self.cfg.node_id)) else {
                        break;
                    };
                    if passing.load(Ordering::Acquire)
                        && !lead
                            .put(&checkpoint, &serde_json::to_vec(&job).expect("json"))
                            .await
                            .unwrap_or(true)
                    {
                        break;
                    }
                }
            };
            let (report, ()) = futures::join!(pass, ticker);
            let report = report.map_err(|e| e.to_string())?;
            let job = {
                let mut g = self.drain.lock().expect("drain");
                let d = g.as_mut().expect("set above");
                d.passes += 1;
                d.report = report.clone();
                let v = d.json(&self.cfg.node_id);
                d.moved_before += report.moved;
                d.bytes_before += report.bytes;
                // The uploads the job waits for stay in view between passes.
                d.report = DrainReport {
                    uploads: report.uploads,
                    ..Default::default()
                };
                v
            };
            if !lead.holds()
                || !lead
                    .put(&checkpoint, &serde_json::to_vec(&job).expect("json"))
                    .await
                    .map_err(etcd_err)?
            {
                return Err(lost());
            }
            if report.keys == 0 && report.uploads == 0 && report.failures == 0 {
                break;
            }
            if report.moved == 0 {
                // Only uploads in progress or failures left: wait for them.
                if report.keys == 0 && report.uploads > 0 && report.uploads != waiting_for {
                    tracing::info!(pool, uploads = report.uploads, "the drain waits for multipart uploads in progress in the pool (their keys moved; complete or abort them)");
                }
                waiting_for = report.uploads;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
        // A pass found the pool empty: retire it, under the token.
        let (m, revision) = self.formed_map().await?;
        let next = m.retire_pool(pool)?;
        self.etcd
            .put(
                &self.keys.old_map(m.epoch),
                &serde_json::to_vec(&m).expect("json"),
                None,
            )
            .await
            .map_err(etcd_err)?;
        if !lead
            .swap_map(
                &self.keys,
                revision,
                &serde_json::to_vec(&next).expect("json"),
            )
            .await
            .map_err(etcd_err)?
        {
            return Err("the map changed, or the leadership was lost, before the pool could be retired; the next round retries".into());
        }
        Ok(())
    }

    /// Marks pool `id` draining: the drain job moves its objects to the
    /// other pools and retires it (`pool drain`).
    pub async fn drain_pool(&self, id: u32) -> Result<ClusterMap, String> {
        let (m, revision) = self.formed_map().await?;
        let next = m.drain_pool(id)?;
        self.swap_map(&m, revision, &next).await?;
        Ok(next)
    }

    /// One full read, then a watch from the revision after it.
    async fn watch_once(&self) -> Result<(), String> {
        let Some(store) = self.store.get() else {
            return Ok(());
        };
        let (kvs, revision) = self
            .etcd
            .get_prefix(&self.keys.buckets())
            .await
            .map_err(etcd_err)?;
        let all = self.bucket_records(kvs)?;
        store.replace_buckets(all);
        self.docs_were_changed();
        // A map changed while the watch was down is applied now.
        if let Some((m, _)) = self.read_map().await? {
            self.map_changed(m).await;
        }
        self.read_kv_members().await?;
        let mut watch = self
            .etcd
            .watch_prefix(self.keys.root(), revision + 1)
            .await
            .map_err(etcd_err)?;
        loop {
            let events = watch.next().await.map_err(etcd_err)?;
            let mut docs = false;
            let mut members = false;
            for ev in events {
                let key = match &ev {
                    Event::Put(kv) => kv.key.clone(),
                    Event::Delete(k, _) => k.clone(),
                };
                if let Some(name) = key.strip_prefix(&self.keys.buckets()) {
                    match &ev {
                        Event::Put(kv) => match decode_bucket(&kv.key, &kv.value) {
                            Ok(rec) => store.apply_bucket(name, Some(rec)),
                            Err(e) => {
                                tracing::error!(error = %e, "unreadable bucket record in etcd")
                            }
                        },
                        Event::Delete(..) => store.apply_bucket(name, None),
                    }
                } else if key.starts_with(&self.keys.docs()) {
                    docs = true;
                } else if key.starts_with(&self.keys.members()) {
                    members = true;
                } else if key == self.keys.map() {
                    if let Event::Put(kv) = &ev {
                        match map::decode::<ClusterMap>("cluster map", &kv.value) {
                            Ok(m) => self.map_changed(m).await,
                            Err(error) => {
                                tracing::error!(%error, "unreadable cluster map in etcd")
                            }
                        }
                    }
                }
            }
            if docs {
                self.docs_were_changed();
            }
            if members {
                self.read_kv_members().await?;
            }
        }
    }

    fn docs_were_changed(&self) {
        if let Some(f) = self.docs_changed.get() {
            tokio::spawn(f());
        }
    }

    /// A new map. Set positions given other drives (a node replaced) and
    /// pools added (expansion) are applied to the engine, pools marked
    /// draining or not, then the node takes the new epoch (so it never
    /// claims an epoch whose sets it does not serve). A change a running
    /// node cannot follow is logged, asking for a restart.
    async fn map_changed(&self, m: ClusterMap) {
        let Some(store) = self.store.get() else {
            return;
        };
        let cur = self.map.read().expect("map").clone();
        let Some(cur) = cur else { return };
        if m.epoch <= cur.epoch {
            return;
        }
        let diff = match map_diff(&cur, &m) {
            Ok(d) => d,
            Err(why) => {
                tracing::error!(epoch = m.epoch, %why, "the cluster map's sets changed in a way this node cannot follow running: restart it to serve them");
                return;
            }
        };
        if !diff.drives.is_empty() || !diff.added.is_empty() {
            if let Err(error) = self.apply(store, m.epoch, diff.drives, &diff.added).await {
                tracing::error!(%error, "cannot serve the new cluster map");
                return;
            }
        }
        if !store
            .set_pool_states(&diff.draining, &diff.retired)
            .is_empty()
        {
            sweep_retired(store.clone());
        }
        tracing::info!(epoch = m.epoch, "serving the new cluster map");
        self.epoch.store(m.epoch, Ordering::Release);
        *self.map.write().expect("map") = Some(m);
    }

    /// Gives set positions their new drives and serves added pools (the
    /// map of epoch `epoch`).
    async fn apply(
        &self,
        store: &Arc<Store>,
        epoch: u64,
        drives: Vec<(usize, usize, map::DriveRef)>,
        added: &[map::Pool],
    ) -> Result<(), String> {
        let addresses = self.addresses().await?;
        let mut wanted = Vec::new();
        for (set, position, d) in drives {
            wanted.push(DriveChange {
                set,
                position,
                drive: self.cluster_drive(&d, &addresses, epoch)?,
            });
        }
        let pools = added
            .iter()
            .map(|p| self.pool_layout(p, &addresses, epoch))
            .collect::<Result<Vec<_>, _>>()?;
        let replaced = !wanted.is_empty();
        let st = store.clone();
        tokio::task::spawn_blocking(move || {
            st.change_drives(wanted)?;
            for p in pools {
                st.add_pool(p)?;
            }
            Ok::<_, tarn_store::StoreError>(())
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
        if replaced {
            store.start_backfill();
        }
        Ok(())
    }

    /// Gives node `old`'s places in the map to node `new`, which must be up
    /// and placed nowhere yet: its drives are backfilled from the other
    /// drives of their sets. `old` is recorded retired.
    pub async fn replace(&self, old: &str, new: &str) -> Result<ClusterMap, String> {
        valid_name("node", old)?;
        let (m, revision) = self.formed_map().await?;
        let rec = self.live_node(new).await?;
        let next = m.replace_node(old, &rec)?;
        self.swap_map(&m, revision, &next).await?;
        // The old node keeps its record (its id stays known) as retired.
        let key = self.keys.node(old);
        if let (Some(kv), _) = self.etcd.get(&key).await.map_err(etcd_err)? {
            let mut rec: NodeRecord = map::decode("node record", &kv.value)?;
            rec.state = NodeState::Retired;
            self.etcd
                .put(&key, &serde_json::to_vec(&rec).expect("json"), None)
                .await
                .map_err(etcd_err)?;
        }
        Ok(next)
    }

    /// Adds a pool of `data`+`parity` sets (by default the first pool's
    /// geometry) over the unplaced drives of `nodes`, which must be up
    /// (expansion). Running nodes serve it once they see the map.
    pub async fn add_pool(
        &self,
        nodes: &[String],
        geometry: Option<(usize, usize)>,
    ) -> Result<ClusterMap, String> {
        if nodes.is_empty() {
            return Err("name the nodes whose drives form the pool".into());
        }
        let (m, revision) = self.formed_map().await?;
        let mut records = Vec::with_capacity(nodes.len());
        for n in nodes {
            records.push(self.live_node(n).await?);
        }
        let first = &m.pools[0];
        let (data, parity) =
            geometry.unwrap_or((first.data_shards as usize, first.parity_shards as usize));
        let next = m.add_pool(&records, data, parity)?;
        let set_size = next
            .pools
            .last()
            .and_then(|p| p.sets.first())
            .map_or(0, Vec::len);
        tarn_store::check_erasure(data, parity, set_size).map_err(|e| e.to_string())?;
        self.swap_map(&m, revision, &next).await?;
        Ok(next)
    }

    /// The map and its etcd revision, once the cluster is formed.
    async fn formed_map(&self) -> Result<(ClusterMap, i64), String> {
        self.read_map()
            .await?
            .ok_or_else(|| format!("cluster {} is not formed", self.cfg.cluster))
    }

    /// A node's record, refused unless it is registered, active and up (so
    /// that its drives are claimed and it serves its places at once).
    async fn live_node(&self, id: &str) -> Result<NodeRecord, String> {
        valid_name("node", id)?;
        let (kv, _) = self.etcd.get(&self.keys.node(id)).await.map_err(etcd_err)?;
        let rec: NodeRecord = match kv {
            Some(kv) => map::decode("node record", &kv.value)?,
            None => return Err(format!("node {id} is not registered: start it first")),
        };
        if rec.state != NodeState::Active {
            return Err(format!("node {id} is {:?}, not active", rec.state));
        }
        let (member, _) = self
            .etcd
            .get(&self.keys.member(id))
            .await
            .map_err(etcd_err)?;
        if member.is_none() {
            return Err(format!(
                "node {id} is not up: start it first, so that its drives are claimed and it takes its places at once"
            ));
        }
        Ok(rec)
    }

    /// Replaces map `m` (read at `revision`) with `next`, keeping `m` under
    /// `maps/<epoch>`; refused if the map changed meanwhile.
    async fn swap_map(
        &self,
        m: &ClusterMap,
        revision: i64,
        next: &ClusterMap,
    ) -> Result<(), String> {
        self.etcd
            .put(
                &self.keys.old_map(m.epoch),
                &serde_json::to_vec(m).expect("json"),
                None,
            )
            .await
            .map_err(etcd_err)?;
        let won = self
            .etcd
            .compare_and_swap(
                &self.keys.map(),
                revision,
                &serde_json::to_vec(next).expect("json"),
                None,
            )
            .await
            .map_err(etcd_err)?;
        if !won {
            return Err("the cluster map changed meanwhile; look at it again and retry".into());
        }
        Ok(())
    }

    /// Forms the cluster: one pool of k+m sets over the registered nodes'
    /// drives, written only if no map exists yet.
    pub async fn init(&self, data: usize, parity: usize) -> Result<ClusterMap, String> {
        if self.read_map().await?.is_some() {
            return Err(format!("cluster {} is already formed", self.cfg.cluster));
        }
        let (kvs, _) = self
            .etcd
            .get_prefix(&self.keys.nodes())
            .await
            .map_err(etcd_err)?;
        let nodes = kvs
            .iter()
            .map(|kv| map::decode::<NodeRecord>("node record", &kv.value))
            .collect::<Result<Vec<_>, _>>()?;
        if nodes.is_empty() {
            return Err("no nodes are registered".into());
        }
        // A map the engine cannot open would stop every node: refused here.
        tarn_store::check_erasure(data, parity, data + parity).map_err(|e| e.to_string())?;
        let m = ClusterMap::initial(
            &self.cfg.cluster,
            &id_to_hex(&new_id()),
            &nodes,
            data,
            parity,
        )
        .map_err(|e| e.0)?;
        let won = self
            .etcd
            .compare_and_swap(
                &self.keys.map(),
                0,
                &serde_json::to_vec(&m).expect("json"),
                None,
            )
            .await
            .map_err(etcd_err)?;
        if !won {
            return Err(format!(
                "cluster {} was formed meanwhile by another request",
                self.cfg.cluster
            ));
        }
        Ok(m)
    }

    /// What `cluster status` shows: nodes with their liveness, the map, and
    /// this node's view of every drive.
    pub async fn status(&self) -> Result<serde_json::Value, String> {
        let (nodes, _) = self
            .etcd
            .get_prefix(&self.keys.nodes())
            .await
            .map_err(etcd_err)?;
        let (members, _) = self
            .etcd
            .get_prefix(&self.keys.members())
            .await
            .map_err(etcd_err)?;
        let live: Vec<String> = members
            .iter()
            .filter_map(|kv| {
                kv.key
                    .strip_prefix(&self.keys.members())
                    .map(str::to_string)
            })
            .collect();
        // Each live node's build and protocol versions (a rolling upgrade
        // shows nodes of two releases).
        let builds: std::collections::HashMap<String, Member> = members
            .iter()
            .filter_map(|kv| {
                let id = kv.key.strip_prefix(&self.keys.members())?;
                let m: Member = map::decode("member", &kv.value).ok()?;
                Some((id.to_string(), m))
            })
            .collect();
        let map = self.read_map().await?.map(|(m, _)| m);
        let mut out_nodes = Vec::new();
        for kv in nodes {
            let rec: NodeRecord = map::decode("node record", &kv.value)?;
            out_nodes.push(json!({
                "id": rec.id,
                "address": rec.address,
                "s3": rec.s3,
                "admin": rec.admin,
                "state": rec.state,
                "zone": rec.zone,
                "live": live.contains(&rec.id),
                "drives": rec.drives,
                "version": builds.get(&rec.id).map(|m| m.version.clone()),
                "protocol": builds.get(&rec.id).and_then(|m| m.protocol),
            }));
        }
        let drives = self
            .store
            .get()
            .map_or_else(Vec::new, |store| store.drive_status());
        let behind = drives
            .iter()
            .any(|d| !d.online || d.rebuilding || d.syncing);
        let view: Vec<serde_json::Value> = drives
            .into_iter()
            .map(|d| {
                json!({
                    "drive": d.path,
                    "set": d.set_index,
                    "online": d.online,
                    "rebuilding": d.rebuilding,
                    "syncing": d.syncing,
                    "reason": d.reason,
                })
            })
            .collect();
        let under = match self.store.get() {
            Some(store) => Some(store.under_replicated().await),
            None => None,
        };
        // Every node's jobs as published, this node's as they are now.
        let (published, _) = self
            .etcd
            .get_prefix(&self.keys.progress_all())
            .await
            .map_err(etcd_err)?;
        let mut jobs = self.jobs();
        for kv in published {
            if kv.key == self.keys.progress(&self.cfg.node_id) {
                continue;
            }
            if let Ok(serde_json::Value::Array(theirs)) = serde_json::from_slice(&kv.value) {
                jobs.extend(theirs);
            }
        }
        let suspects: Vec<serde_json::Value> = self
            .client
            .suspects()
            .into_iter()
            .map(|p| {
                json!({
                    "address": p.address,
                    "node": p.node,
                    "suspect_ms": p.since.elapsed().as_millis() as u64,
                    "reason": p.reason,
                })
            })
            .collect();
        // Repair is done once no job runs, no drive in this node's view is
        // behind, and the logs (all answering) hold nothing: each backfill
        // ended with a verifying scan that found nothing to repair.
        let repaired = under
            .as_ref()
            .is_some_and(|u| u.objects == 0 && u.unanswered == 0 && u.overflowed == 0)
            && jobs.is_empty()
            && !behind;
        Ok(json!({
            "cluster": self.cfg.cluster,
            "node": self.cfg.node_id,
            "formed": map.is_some(),
            "epoch": map.as_ref().map_or(0, |m| m.epoch),
            "deployment_id": map.as_ref().map(|m| m.deployment_id.clone()),
            "pools": map.as_ref().map(|m| serde_json::to_value(&m.pools).expect("json")),
            "nodes": out_nodes,
            "live": live,
            "drives_seen_from_here": view,
            "suspect_peers": suspects,
            "jobs": jobs,
            "repair_done": repaired,
            // Objects some write missed on a drive of their set, not healed
            // yet (the missed-write logs of every drive, each position's
            // entries once).
            "under_replicated": under.as_ref().map(|u| u.objects),
            "missed_log": under.map(|u| json!({
                "overflowed": u.overflowed,
                "unanswered": u.unanswered,
            })),
        }))
    }

    /// Whether this node holds its membership now.
    pub fn is_member(&self) -> bool {
        self.membership
            .lock()
            .expect("membership")
            .as_ref()
            .is_some_and(Membership::is_member)
    }

    /// Ends the membership (revoked: peers see the node gone at once) and
    /// the RPC listener.
    pub fn stop(&self) {
        if !self.started.swap(false, Ordering::AcqRel) {
            return;
        }
        let _ = self.stop.send(true);
        if let Some(m) = self.membership.lock().expect("membership").take() {
            m.stop();
        }
        for t in std::mem::take(&mut *self.rpc_threads.lock().expect("rpc threads")) {
            let _ = t.join();
        }
    }
}

/// Removes, in the background, what moves left on this node's drives of
/// retired pools.
fn sweep_retired(store: Arc<Store>) {
    tokio::spawn(async move {
        if let Err(error) = store.sweep_retired().await {
            tracing::warn!(%error, "sweeping the drives of a retired pool failed; the next start tries again");
        }
    });
}

/// How long a starting node waits for etcd to listen.
const ETCD_START_WAIT: Duration = Duration::from_secs(60);

/// Waits, at start, until etcd answers: a node started alongside etcd (a
/// Kubernetes pod, a unit without ordering) waits for it instead of
/// exiting. Only a refused connection or no answer is waited out; any
/// other failure (a TLS refusal, a wrong password) ends the start at once.
async fn wait_for_etcd(etcd: &Etcd, keys: &Keys) -> Result<(), String> {
    let deadline = std::time::Instant::now() + ETCD_START_WAIT;
    let mut told = false;
    loop {
        match etcd.get(&keys.layout()).await {
            Ok(_) => return Ok(()),
            Err(EtcdError::Unreachable { reason, .. })
                if (reason.contains("Connection refused") || reason.contains("no answer in"))
                    && std::time::Instant::now() < deadline =>
            {
                if !told {
                    tracing::warn!(%reason, "etcd does not answer yet: waiting for it (up to 60 s)");
                    told = true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Where the RPC listener binds for `--advertise HOST:PORT`: that address
/// when HOST is an IP, every address on PORT when HOST is a name (a
/// Kubernetes pod's DNS name resolves to an address the pod has, but not
/// necessarily to one it can bind by name).
pub fn rpc_bind_address(advertise: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(a) = advertise.parse::<std::net::SocketAddr>() {
        return Ok(a);
    }
    let bad = |why: &str| format!("--advertise {advertise:?}: {why}");
    let (host, port) = advertise
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| bad("expected HOST:PORT with a port number"))?;
    let name_ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if !name_ok || port == 0 {
        return Err(bad(
            "expected HOST:PORT (an IP address or a DNS name, and a port)",
        ));
    }
    Ok(std::net::SocketAddr::from(([0, 0, 0, 0], port)))
}

#[cfg(test)]
mod tests {
    use super::rpc_bind_address;

    #[test]
    fn advertised_names_bind_every_address_on_their_port() {
        assert_eq!(
            rpc_bind_address("127.0.0.5:7000").unwrap().to_string(),
            "127.0.0.5:7000"
        );
        assert_eq!(
            rpc_bind_address("[::1]:7000").unwrap().to_string(),
            "[::1]:7000"
        );
        assert_eq!(
            rpc_bind_address("tarn-0.tarn-headless.store.svc:7000")
                .unwrap()
                .to_string(),
            "0.0.0.0:7000"
        );
        for bad in [
            "tarn-0",
            "tarn-0:",
            "tarn-0:x",
            ":7000",
            "a..b:7000",
            "-a:7000",
            "a_b:7000",
            "a:0",
            "a:70000",
        ] {
            assert!(rpc_bind_address(bad).is_err(), "{bad}");
        }
    }
}
