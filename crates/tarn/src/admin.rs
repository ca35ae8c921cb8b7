//! The admin port: health, metrics and operator actions. It is a separate
//! listener (loopback by default) so that nothing here shares the data port
//! with S3 clients; operator actions also require the secret key as a bearer
//! token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tarn_cluster::node::Node;
use tarn_io::tls::MaybeTls;
use tarn_s3::access::Access;
use tarn_s3::cache::Caches;
use tarn_s3::iam::{Iam, IamError};
use tarn_store::Store;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::Metrics;

pub(crate) fn text(
    status: u16,
    content_type: &'static str,
    body: String,
) -> http::Response<s3s::Body> {
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() =
        http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

/// Compares without an early exit, so response time does not reveal how much
/// of a guessed token was right.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn json_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub(crate) fn json(status: u16, v: serde_json::Value) -> http::Response<s3s::Body> {
    text(status, "application/json", format!("{v}\n"))
}

fn iam_error(e: IamError) -> http::Response<s3s::Body> {
    let status = match &e {
        IamError::InvalidName(_) | IamError::Reserved(_) | IamError::InvalidKey(_) => 400,
        IamError::NoSuchUser(_) | IamError::NoSuchKey { .. } => 404,
        IamError::UserExists(_) | IamError::KeyTaken(_) => 409,
        IamError::NotLoaded | IamError::Store(_) => 503,
        IamError::Corrupt { .. } => 500,
    };
    json(status, serde_json::json!({ "error": e.to_string() }))
}

fn new_key(k: tarn_s3::iam::NewKey) -> http::Response<s3s::Body> {
    json(
        200,
        serde_json::json!({
            "user": k.user,
            "access_key": k.access_key,
            "secret_key": k.secret_key,
        }),
    )
}

/// Users and keys: `GET /admin/users`, `POST|DELETE /admin/users/NAME`,
/// `POST /admin/users/NAME/keys`, `DELETE /admin/users/NAME/keys/ACCESS_KEY`.
/// A POST's body, when there is one, is a key to import
/// (`{"access_key": …, "secret_key": …}`) instead of a random one.
/// A change to users or keys returns once every other reachable node of a
/// cluster applies it too (a revoked key works nowhere after the call
/// returns); nodes that did not confirm are named in a header.
async fn users(
    req: http::Request<Incoming>,
    iam: &Iam,
    node: Option<&Arc<Node>>,
) -> http::Response<s3s::Body> {
    let (method, path) = (
        req.method().as_str().to_string(),
        req.uri().path().to_string(),
    );
    let given = if method == "POST" {
        match crate::admin_cache::body_bytes(req).await {
            Ok(b) if b.is_empty() => None,
            Ok(b) => match serde_json::from_slice::<tarn_s3::iam::Imported>(&b) {
                Ok(k) => Some(k),
                Err(e) => {
                    return json(
                        400,
                        serde_json::json!({ "error": format!("a key to import: {e}") }),
                    )
                }
            },
            Err(r) => return r,
        }
    } else {
        None
    };
    let (method, path) = (method.as_str(), path.as_str());
    let mut r = users_here(method, path, given.as_ref(), iam).await;
    if method != "GET" {
        confirm_everywhere(&mut r, node, "a user or key change").await;
    }
    r
}

/// After a successful change of documents every node reads (users, keys,
/// cache buckets): waits until every other reachable node of a cluster
/// applied it; nodes that did not confirm are named in a header.
pub(crate) async fn confirm_everywhere(
    r: &mut http::Response<s3s::Body>,
    node: Option<&Arc<Node>>,
    what: &str,
) {
    let Some(node) = node.filter(|_| r.status().is_success()) else {
        return;
    };
    let unconfirmed = node.reload_docs_everywhere().await;
    if unconfirmed.is_empty() {
        return;
    }
    tracing::warn!(?unconfirmed, "{what} was not confirmed by every node");
    let names: Vec<String> = unconfirmed
        .iter()
        .map(|(id, why)| format!("{id} ({})", why.replace(['\r', '\n', ','], " ")))
        .collect();
    if let Ok(v) = http::HeaderValue::from_str(&names.join(", ")) {
        r.headers_mut()
            .insert(crate::admin_cli::UNCONFIRMED_HEADER, v);
    }
}

async fn users_here(
    method: &str,
    path: &str,
    given: Option<&tarn_s3::iam::Imported>,
    iam: &Iam,
) -> http::Response<s3s::Body> {
    let rest = path.trim_start_matches("/admin/users").trim_matches('/');
    let parts: Vec<&str> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split('/').collect()
    };
    let r = match (method, parts.as_slice()) {
        ("GET", []) => {
            if !iam.is_loaded() {
                return iam_error(IamError::NotLoaded);
            }
            let users: Vec<_> = iam
                .list_users()
                .into_iter()
                .map(|u| {
                    serde_json::json!({
                        "name": u.name,
                        "created_ns": u.created_ns,
                        "access_keys": u.access_keys,
                    })
                })
                .collect();
            return json(200, serde_json::json!({ "users": users }));
        }
        ("POST", [name]) => iam.add_user(name, given).await.map(new_key),
        ("DELETE", [name]) => iam
            .remove_user(name)
            .await
            .map(|()| text(204, "text/plain", String::new())),
        ("POST", [name, "keys"]) => iam.add_key(name, given).await.map(new_key),
        ("DELETE", [name, "keys", key]) => iam
            .remove_key(name, key)
            .await
            .map(|()| text(204, "text/plain", String::new())),
        _ => return text(404, "text/plain", "not found\n".into()),
    };
    r.unwrap_or_else(iam_error)
}

fn authorized(req: &http::Request<Incoming>, token: &str) -> bool {
    req.headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes()))
}

/// `GET /admin/cluster/status`, `POST /admin/cluster/init?data_shards=K&parity_shards=M`,
/// `POST /admin/cluster/replace?old=ID&new=ID` and
/// `POST /admin/cluster/pool/add?nodes=A,B,…[&data_shards=K&parity_shards=M]` and
/// `POST /admin/cluster/pool/drain?id=N`.
async fn cluster(
    method: &str,
    path: &str,
    query: Option<&str>,
    node: Option<&Node>,
) -> http::Response<s3s::Body> {
    let Some(node) = node else {
        return json(
            400,
            serde_json::json!({ "error": "this server is not part of a cluster (start it with --cluster, --etcd, --node-id and --advertise)" }),
        );
    };
    let arg = |name: &str| -> Option<&str> {
        query?
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    };
    match (method, path) {
        ("POST", "/admin/cluster/replace") => {
            let (Some(old), Some(new)) = (arg("old"), arg("new")) else {
                return json(400, serde_json::json!({ "error": "give old and new" }));
            };
            match node.replace(old, new).await {
                Ok(map) => json(
                    200,
                    serde_json::json!({ "epoch": map.epoch, "pools": map.pools }),
                ),
                Err(e) => json(409, serde_json::json!({ "error": e })),
            }
        }
        ("POST", "/admin/cluster/pool/add") => {
            let Some(nodes) = arg("nodes").filter(|n| !n.is_empty()) else {
                return json(400, serde_json::json!({ "error": "give nodes" }));
            };
            let nodes: Vec<String> = nodes.split(',').map(str::to_string).collect();
            let num = |name: &str| arg(name).map(|v| v.parse::<usize>());
            let geometry = match (num("data_shards"), num("parity_shards")) {
                (None, None) => None,
                (Some(Ok(k)), Some(Ok(m))) => Some((k, m)),
                _ => {
                    return json(
                        400,
                        serde_json::json!({ "error": "give both data_shards and parity_shards, as numbers, or neither" }),
                    )
                }
            };
            match node.add_pool(&nodes, geometry).await {
                Ok(map) => json(
                    200,
                    serde_json::json!({ "epoch": map.epoch, "pools": map.pools }),
                ),
                Err(e) => json(409, serde_json::json!({ "error": e })),
            }
        }
        ("POST", "/admin/cluster/pool/drain") => {
            let Some(id) = arg("id").and_then(|v| v.parse::<u32>().ok()) else {
                return json(400, serde_json::json!({ "error": "give the pool's id" }));
            };
            match node.drain_pool(id).await {
                Ok(map) => json(
                    200,
                    serde_json::json!({ "epoch": map.epoch, "pools": map.pools }),
                ),
                Err(e) => json(409, serde_json::json!({ "error": e })),
            }
        }
        ("GET", "/admin/cluster/status") => match node.status().await {
            Ok(v) => json(200, v),
            Err(e) => json(503, serde_json::json!({ "error": e })),
        },
        ("POST", "/admin/cluster/init") => {
            let num = |name: &str| arg(name).and_then(|v| v.parse::<usize>().ok());
            let (Some(k), Some(m)) = (num("data_shards"), num("parity_shards")) else {
                return json(
                    400,
                    serde_json::json!({ "error": "give data_shards and parity_shards" }),
                );
            };
            match node.init(k, m).await {
                Ok(map) => json(
                    200,
                    serde_json::json!({
                        "epoch": map.epoch,
                        "deployment_id": map.deployment_id,
                        "pools": map.pools,
                    }),
                ),
                Err(e) => json(409, serde_json::json!({ "error": e })),
            }
        }
        _ => text(404, "text/plain", "not found\n".into()),
    }
}

/// The admin port of a cluster node before the cluster is formed: health,
/// and the cluster commands (`cluster init` is what forms it).
pub async fn serve_forming(
    listener: TcpListener,
    node: Arc<Node>,
    (token, tls): (String, Option<tarn_io::tls::tokio_rustls::TlsAcceptor>),
    mut stop: watch::Receiver<bool>,
) {
    let token = Arc::new(token);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let (node, token, tls) = (node.clone(), token.clone(), tls.clone());
                conns.spawn(async move {
                    let Some(stream) = MaybeTls::accept(stream, tls.as_ref()).await else {
                        return;
                    };
                    let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                        let (node, token) = (node.clone(), token.clone());
                        async move {
                            let ok = authorized(&req, &token);
                            let (method, path) = (req.method().as_str(), req.uri().path());
                            let r = match (method, path) {
                                ("GET", "/health/live") => text(200, "text/plain", "ok\n".into()),
                                ("GET", "/health/ready") => text(503, "text/plain", "not ready: waiting for the cluster to be formed (cluster init)\n".into()),
                                (_, p) if p.starts_with("/admin/") && !ok => {
                                    text(401, "text/plain", "missing or wrong bearer token\n".into())
                                }
                                (m, p) if p.starts_with("/admin/cluster/") => {
                                    cluster(m, p, req.uri().query(), Some(&node)).await
                                }
                                _ => text(503, "text/plain", "not serving yet: waiting for the cluster to be formed\n".into()),
                            };
                            Ok::<_, Infallible>(r)
                        }
                    });
                    // One request per connection: when the map arrives,
                    // what was accepted is answered, and nothing waits on an
                    // idle keep-alive connection.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(false)
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    // The runtime ends with this function: finish the answers in progress
    // (an init that arrives as the map does gets "already formed", not a
    // cut connection).
    let _ = tokio::time::timeout(FORMING_DRAIN, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
}

/// How long the forming admin server finishes its answers after the map.
const FORMING_DRAIN: Duration = Duration::from_secs(5);

/// What the admin port serves from.
#[derive(Clone)]
struct Ctx {
    store: Arc<Store>,
    metrics: Arc<Metrics>,
    token: Arc<String>,
    iam: Arc<Iam>,
    caches: Arc<Caches>,
    node: Option<Arc<Node>>,
    keys: Arc<tarn_s3::sse::KeyRing>,
    heal_jobs: Arc<crate::jobs::HealJobs>,
    console: Arc<crate::console::Console>,
    /// This node's S3 endpoint (the console's S3 calls go there) and region.
    s3: std::net::SocketAddr,
    region: Arc<str>,
    /// The connection's client.
    client: std::net::IpAddr,
    /// How the console reaches this node's S3 listener when it is TLS
    /// (trusting exactly this node's certificate).
    s3_tls: Option<tarn_io::tls::tokio_rustls::TlsConnector>,
    /// Whether the connection is TLS (the console's cookie is then
    /// `Secure`).
    secure: bool,
}

/// A drive's state in one word.
pub(crate) fn drive_state(d: &tarn_store::DriveStatus) -> &'static str {
    if d.online && d.rebuilding {
        "rebuilding"
    } else if d.online && d.syncing {
        "syncing"
    } else if d.online && d.full {
        "full"
    } else if d.online {
        "online"
    } else if d.faulty {
        "faulty"
    } else {
        "offline"
    }
}

/// What `/health/ready` and `/admin/status` say of this node.
struct Readiness {
    /// "ready", "degraded" (serving, with less redundancy than configured)
    /// or "not ready" (a set lacks quorum).
    state: &'static str,
    /// The drives that are not fully in service, and why.
    problems: Vec<String>,
    drives: usize,
}

fn readiness(store: &Store) -> Readiness {
    let drives = store.drive_status();
    let problems: Vec<String> = drives
        .iter()
        .filter(|d| !d.online || d.full || d.rebuilding)
        .map(|d| match &d.reason {
            _ if d.online && d.rebuilding => format!("{} (rebuilding its index)", d.path),
            _ if d.online => format!("{} (full: below its free-space reserve)", d.path),
            Some(r) => format!("{} ({r})", d.path),
            None => d.path.clone(),
        })
        .collect();
    let state = match (store.is_ready(), problems.is_empty()) {
        (true, true) => "ready",
        (true, false) => "degraded",
        (false, _) => "not ready",
    };
    Readiness {
        state,
        problems,
        drives: drives.len(),
    }
}

/// A query parameter's decoded value.
fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| tarn_s3::post::percent_decode(v))
}

fn store_error(e: tarn_store::StoreError) -> http::Response<s3s::Body> {
    let status = match &e {
        tarn_store::StoreError::NoSuchBucket(_) => 404,
        tarn_store::StoreError::InvalidArgument(_) => 400,
        _ => 500,
    };
    json(status, serde_json::json!({ "error": e.to_string() }))
}

fn lifecycle_json() -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &tarn_s3::lifecycle::COUNTERS;
    serde_json::json!({
        "id": "lifecycle",
        "kind": "lifecycle",
        "state": "scheduled",
        "passes": c.passes.load(Relaxed),
        "versions_scanned": c.scanned.load(Relaxed),
        "expired": c.expired.load(Relaxed) + c.noncurrent_expired.load(Relaxed),
        "delete_markers_removed": c.delete_markers_removed.load(Relaxed),
        "uploads_aborted": c.uploads_aborted.load(Relaxed),
        "locked_kept": c.locked_kept.load(Relaxed),
        "errors": c.errors.load(Relaxed),
    })
}

async fn handle(
    req: http::Request<Incoming>,
    ctx: Ctx,
) -> Result<http::Response<s3s::Body>, Infallible> {
    if req.uri().path() == "/console" || req.uri().path().starts_with("/console/") {
        let routed = crate::console::handle(
            req,
            crate::console::Ctx {
                console: &ctx.console,
                iam: &ctx.iam,
                client: ctx.client,
                s3: ctx.s3,
                region: &ctx.region,
                s3_tls: ctx.s3_tls.as_ref(),
                secure: ctx.secure,
            },
        )
        .await;
        return match routed {
            crate::console::Routed::Done(r) => Ok(r),
            // A root session's admin call: answered as with the token.
            crate::console::Routed::Admin(req) => answer(req, ctx, true).await,
        };
    }
    let authorized = authorized(&req, &ctx.token);
    answer(req, ctx, authorized).await
}

async fn answer(
    req: http::Request<Incoming>,
    ctx: Ctx,
    authorized: bool,
) -> Result<http::Response<s3s::Body>, Infallible> {
    let Ctx {
        store,
        metrics,
        iam,
        caches,
        node,
        keys,
        heal_jobs,
        ..
    } = ctx;
    let path = req.uri().path();
    if authorized && (path == "/admin/cache" || path.starts_with("/admin/cache/")) {
        return Ok(crate::admin_cache::handle(req, &caches, node.as_ref()).await);
    }
    if authorized && (path == "/admin/users" || path.starts_with("/admin/users/")) {
        return Ok(users(req, &iam, node.as_ref()).await);
    }
    let r = match (req.method().as_str(), req.uri().path()) {
        ("GET", "/health/live") => text(200, "text/plain", "ok\n".into()),
        ("GET", "/health/ready") => {
            let r = readiness(&store);
            let body = match r.state {
                "ready" => "ready\n".to_string(),
                "degraded" => format!(
                    "degraded: {} of {} drives offline, full or rebuilding: {}\n",
                    r.problems.len(),
                    r.drives,
                    r.problems.join(", ")
                ),
                _ => "not ready: an erasure set lacks write or read quorum\n".to_string(),
            };
            text(
                if r.state == "not ready" { 503 } else { 200 },
                "text/plain",
                body,
            )
        }
        ("GET", "/metrics") => {
            let under = store.under_replicated().await.objects;
            let names = || {
                if authorized {
                    crate::metrics::Names::Shown
                } else {
                    crate::metrics::Names::Redacted
                }
            };
            let mut out = metrics.render(
                &store,
                under,
                node.as_ref().and_then(|n| n.drain_job()).as_ref(),
                names(),
            );
            out.push_str(&metrics.render_cache(&caches, names()));
            out.push_str(&crate::metrics::render_lifecycle());
            text(200, "text/plain; version=0.0.4", out)
        }
        (_, p) if p.starts_with("/admin/") && !authorized => {
            text(401, "text/plain", "missing or wrong bearer token\n".into())
        }
        (m, p) if p.starts_with("/admin/cluster/") => {
            cluster(m, p, req.uri().query(), node.as_deref()).await
        }
        ("POST", "/admin/heal") => {
            // Runs as a job (seen in /admin/jobs) and answers its report.
            let bucket = query_param(req.uri().query(), "bucket");
            match heal_jobs.start(&store, bucket.as_deref()) {
                Ok((job, _)) => match crate::jobs::HealJobs::wait(&job).await {
                    Ok(r) => json(200, crate::jobs::report_json(&r)),
                    Err(e) => json(500, serde_json::json!({ "error": e })),
                },
                Err(e) => store_error(e),
            }
        }
        ("POST", "/admin/heal/jobs") => {
            let bucket = query_param(req.uri().query(), "bucket");
            match heal_jobs.start(&store, bucket.as_deref()) {
                Ok((job, started)) => {
                    let mut v = job.json();
                    v["started"] = serde_json::Value::Bool(started);
                    json(202, v)
                }
                Err(e) => store_error(e),
            }
        }
        ("GET", "/admin/jobs") => {
            let mut all: Vec<serde_json::Value> =
                heal_jobs.jobs().iter().map(|j| j.json()).collect();
            if let Some(n) = node.as_ref() {
                if let Ok(st) = n.status().await {
                    all.extend(st["jobs"].as_array().cloned().unwrap_or_default());
                }
            }
            all.extend(caches.jobs().iter().map(|j| j.json()));
            all.push(lifecycle_json());
            json(200, serde_json::json!({ "jobs": all }))
        }
        ("GET", p) if p.starts_with("/admin/jobs/") => {
            let id = &p["/admin/jobs/".len()..];
            match (heal_jobs.job(id), caches.job(id)) {
                (Some(j), _) => json(200, j.json()),
                (None, Some(j)) => json(200, j.json()),
                _ => json(404, serde_json::json!({ "error": format!("no job {id}") })),
            }
        }
        ("GET", "/admin/status") => {
            let r = readiness(&store);
            let drives = store.drive_status();
            let count =
                |f: fn(&tarn_store::DriveStatus) -> bool| drives.iter().filter(|d| f(d)).count();
            let (free, total) = drives
                .iter()
                .filter_map(|d| d.space)
                .fold((0u64, 0u64), |(f, t), (df, dt)| (f + df, t + dt));
            let under = store.under_replicated().await.objects;
            let running = heal_jobs.jobs().iter().filter(|j| j.running()).count()
                + caches.jobs().iter().filter(|j| !j.finished()).count();
            let cluster = match node.as_ref() {
                None => serde_json::Value::Null,
                Some(n) => match n.status().await {
                    Ok(st) => {
                        let nodes = st["nodes"].as_array().cloned().unwrap_or_default();
                        let live = nodes.iter().filter(|n| n["live"] == true).count();
                        serde_json::json!({
                            "id": st["cluster"],
                            "node": st["node"],
                            "epoch": st["epoch"],
                            "nodes": nodes.len(),
                            "nodes_live": live,
                            "suspect_peers": st["suspect_peers"],
                            "repair_done": st["repair_done"],
                        })
                    }
                    Err(e) => serde_json::json!({ "error": e }),
                },
            };
            json(
                200,
                serde_json::json!({
                    "version": env!("CARGO_PKG_VERSION"),
                    "uptime_seconds": crate::metrics::uptime().as_secs(),
                    "mode": if node.is_some() { "cluster" } else { "single node" },
                    "health": r.state,
                    "problems": r.problems,
                    "drives": {
                        "total": drives.len(),
                        "online": count(|d| d.online && !d.rebuilding && !d.syncing && !d.full),
                        "offline": count(|d| !d.online),
                        "rebuilding": count(|d| d.online && d.rebuilding),
                        "syncing": count(|d| d.online && d.syncing),
                        "full": count(|d| d.online && d.full),
                    },
                    "capacity": { "total_bytes": total, "free_bytes": free, "used_bytes": total.saturating_sub(free) },
                    "buckets": store.list_buckets().len(),
                    "under_replicated": under,
                    "jobs_running": running,
                    "cluster": cluster,
                }),
            )
        }
        ("POST", "/admin/sse/rewrap") => {
            let r = tarn_s3::sse::rewrap_all(&store, &keys).await;
            text(
                200,
                "application/json",
                format!(
                    "{{\"active_master_key\":{},\"versions_scanned\":{},\"rewrapped\":{},\"failed\":{}}}\n",
                    keys.master_ids()
                        .first()
                        .map(|k| format!("\"{}\"", json_escape(k)))
                        .unwrap_or_else(|| "null".into()),
                    r.versions_scanned,
                    r.rewrapped,
                    r.failed
                ),
            )
        }
        ("GET", "/admin/drives") => {
            let drives: Vec<serde_json::Value> = store
                .drive_status()
                .into_iter()
                .map(|d| {
                    serde_json::json!({
                        "path": d.path,
                        "set": d.set_index,
                        "online": d.online,
                        "state": drive_state(&d),
                        "reason": d.reason,
                        "total_bytes": d.space.map(|s| s.1),
                        "free_bytes": d.space.map(|s| s.0),
                        "used_bytes": d.space.map(|(f, t)| t.saturating_sub(f)),
                    })
                })
                .collect();
            json(200, serde_json::Value::Array(drives))
        }
        _ => text(404, "text/plain", "not found\n".into()),
    };
    Ok(r)
}

/// What the admin port of a serving node answers from.
pub struct Services {
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    pub token: String,
    pub access: Arc<Access>,
    pub node: Option<Arc<Node>>,
    pub keys: Arc<tarn_s3::sse::KeyRing>,
    /// This node's S3 endpoint and region (the console's S3 calls).
    pub s3: std::net::SocketAddr,
    pub region: String,
    /// TLS on the admin listener (and on the S3 listener it calls).
    pub tls: Option<Arc<tarn_io::tls::ServerCert>>,
}

pub async fn serve(listener: TcpListener, services: Services, mut stop: watch::Receiver<bool>) {
    let Services {
        store,
        metrics,
        token,
        access,
        node,
        keys,
        s3,
        region,
        tls,
    } = services;
    let acceptor = tls.as_ref().map(|c| c.acceptor(&[b"http/1.1"]));
    let console = Arc::new(crate::console::Console::default());
    console.spawn_sampler(metrics.clone());
    // The S3 listener's own address, reachable from here.
    let s3 = match s3.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
            std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, s3.port()))
        }
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, s3.port()))
        }
        _ => s3,
    };
    let ctx = Ctx {
        store,
        metrics,
        token: Arc::new(token),
        iam: access.iam.clone(),
        caches: access.caches.clone(),
        node,
        keys,
        heal_jobs: Arc::default(),
        console,
        s3,
        region: Arc::from(region.as_str()),
        client: std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        s3_tls: tls.as_ref().map(|c| {
            tarn_io::tls::tokio_rustls::TlsConnector::from(tarn_io::tls::trusting_only(c))
        }),
        secure: false,
    };
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, peer)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let mut ctx = ctx.clone();
                ctx.client = peer.ip();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Some(stream) = MaybeTls::accept(stream, acceptor.as_ref()).await else {
                        return;
                    };
                    ctx.secure = stream.is_tls();
                    let svc = hyper::service::service_fn(move |req| handle(req, ctx.clone()));
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison() {
        assert!(super::constant_time_eq(b"secret", b"secret"));
        assert!(!super::constant_time_eq(b"secret", b"secreT"));
        assert!(!super::constant_time_eq(b"secret", b"secret2"));
    }
}
