//! `tarn admin`: operator commands against a running server's admin port
//! (`--endpoint`, the admin URL; `--token`, the server's secret key). Plain
//! HTTP/1.1 over a blocking socket: one request per command.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{bail, Context};

#[derive(clap::Args)]
pub struct AdminArgs {
    /// The server's admin URL (`Admin endpoint:` in its output).
    #[arg(
        long,
        env = "TARN_ADMIN_ENDPOINT",
        default_value = "http://127.0.0.1:9001"
    )]
    endpoint: String,
    /// The admin token: the server's secret key.
    #[arg(long, env = "TARN_ADMIN_TOKEN", hide_env_values = true)]
    token: String,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(clap::Subcommand)]
enum AdminCommand {
    /// Users and their access keys.
    #[command(subcommand)]
    User(UserCommand),
    /// The cluster this server is a node of.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Nodes of the cluster.
    #[command(subcommand)]
    Node(NodeCommand),
    /// Pools of erasure sets (expansion).
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Cache buckets over upstream S3 buckets.
    #[command(subcommand)]
    Cache(crate::admin_cache_cli::CacheCommand),
    /// Server-side encryption's keys.
    #[command(subcommand)]
    Sse(SseCommand),
}

#[derive(clap::Subcommand)]
enum SseCommand {
    /// Rewrap the data key of every SSE-S3 object under an older master
    /// key with the active one (the key file's first), rewriting no data;
    /// once it reports no failures, the older keys can leave the key file.
    Rewrap {
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Subcommand)]
enum PoolCommand {
    /// Add a pool of erasure sets over the drives of NODES (up, their
    /// drives placed nowhere yet) with one map change; running nodes serve
    /// it without a restart, and new objects go to pools by free space.
    Add {
        /// Comma-separated node ids.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// Data shards per set (default: the first pool's).
        #[arg(long, requires = "parity_shards")]
        data_shards: Option<usize>,
        /// Parity shards per set (default: the first pool's).
        #[arg(long, requires = "data_shards")]
        parity_shards: Option<usize>,
    },
    /// Drain pool ID: it takes no new objects, a background job (one
    /// leader through etcd, fenced) moves its objects to the other pools,
    /// then retires it. `cluster status` shows the job's progress.
    Drain { id: u32 },
}

#[derive(clap::Subcommand)]
enum NodeCommand {
    /// Give node OLD's places in the cluster map to node NEW (up, and
    /// placed nowhere yet); NEW's drives are backfilled from the other
    /// drives of their sets, and OLD is recorded retired. `cluster status`
    /// shows the backfill's progress.
    Replace {
        old: String,
        #[arg(long = "with")]
        with: String,
    },
}

#[derive(clap::Subcommand)]
enum ClusterCommand {
    /// Form the cluster: one pool of erasure sets over the registered
    /// nodes' drives, no node holding more than M shards of any set.
    Init {
        #[arg(long)]
        data_shards: usize,
        #[arg(long)]
        parity_shards: usize,
    },
    /// Nodes, drives, sets, the map's epoch and who is live.
    Status {
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Subcommand)]
enum UserCommand {
    /// Make a user with one access key; prints the key and its secret (shown
    /// only this once).
    Add {
        name: String,
        /// Print {"user", "access_key", "secret_key"} as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List users and their access keys (never secrets).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a user; all its keys stop working at once.
    Remove { name: String },
    /// Access keys of a user.
    #[command(subcommand)]
    Key(KeyCommand),
}

#[derive(clap::Subcommand)]
enum KeyCommand {
    /// Give a user another access key; prints it and its secret.
    Add {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Revoke one access key of a user (it stops working at once).
    Remove { name: String, access_key: String },
}

pub fn run(args: AdminArgs) -> anyhow::Result<()> {
    let call = |method: &str, path: &str| request(&args.endpoint, &args.token, method, path, b"");
    match args.command {
        AdminCommand::Cache(c) => crate::admin_cache_cli::run(c, &|method, path, body| {
            request(&args.endpoint, &args.token, method, path, body)
        }),
        AdminCommand::User(UserCommand::Add { name, json }) => {
            print_key(&call("POST", &format!("/admin/users/{name}"))?, json)
        }
        AdminCommand::User(UserCommand::Key(KeyCommand::Add { name, json })) => {
            print_key(&call("POST", &format!("/admin/users/{name}/keys"))?, json)
        }
        AdminCommand::User(UserCommand::List { json }) => {
            let v = call("GET", "/admin/users")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            for u in v["users"].as_array().into_iter().flatten() {
                let keys: Vec<&str> = u["access_keys"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|k| k.as_str())
                    .collect();
                println!("{}\t{}", u["name"].as_str().unwrap_or(""), keys.join(","));
            }
            Ok(())
        }
        AdminCommand::Cluster(ClusterCommand::Init {
            data_shards,
            parity_shards,
        }) => {
            let v = call(
                "POST",
                &format!(
                    "/admin/cluster/init?data_shards={data_shards}&parity_shards={parity_shards}"
                ),
            )?;
            let sets = v["pools"][0]["sets"].as_array().map_or(0, Vec::len);
            println!(
                "cluster formed: epoch {}, {sets} erasure set(s) of {data_shards}+{parity_shards}",
                v["epoch"]
            );
            Ok(())
        }
        AdminCommand::Node(NodeCommand::Replace { old, with }) => {
            let v = call(
                "POST",
                &format!("/admin/cluster/replace?old={old}&new={with}"),
            )?;
            println!(
                "node {with} takes node {old}'s places: cluster map epoch {}; its drives are being backfilled (see cluster status)",
                v["epoch"]
            );
            Ok(())
        }
        AdminCommand::Pool(PoolCommand::Add {
            nodes,
            data_shards,
            parity_shards,
        }) => {
            let mut path = format!("/admin/cluster/pool/add?nodes={}", nodes.join(","));
            if let (Some(k), Some(m)) = (data_shards, parity_shards) {
                path.push_str(&format!("&data_shards={k}&parity_shards={m}"));
            }
            let v = call("POST", &path)?;
            let pool = v["pools"].as_array().and_then(|p| p.last()).cloned();
            let pool = pool.unwrap_or_default();
            println!(
                "pool {} added: {} erasure set(s) of {}+{}; cluster map epoch {}",
                pool["id"],
                pool["sets"].as_array().map_or(0, Vec::len),
                pool["data_shards"],
                pool["parity_shards"],
                v["epoch"]
            );
            Ok(())
        }
        AdminCommand::Sse(SseCommand::Rewrap { json }) => {
            let v = call("POST", "/admin/sse/rewrap")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            println!(
                "{} version(s) scanned, {} rewrapped under master key {}, {} failed{}",
                v["versions_scanned"],
                v["rewrapped"],
                v["active_master_key"].as_str().unwrap_or("(none)"),
                v["failed"],
                if v["failed"].as_u64() == Some(0) {
                    ""
                } else {
                    " (the server's log names them; keep their master keys)"
                }
            );
            Ok(())
        }
        AdminCommand::Pool(PoolCommand::Drain { id }) => {
            let v = call("POST", &format!("/admin/cluster/pool/drain?id={id}"))?;
            println!(
                "pool {id} draining: cluster map epoch {}; its objects are being moved to the other pools (see cluster status)",
                v["epoch"]
            );
            Ok(())
        }
        AdminCommand::Cluster(ClusterCommand::Status { json }) => {
            let v = call("GET", "/admin/cluster/status")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            print_status(&v);
            Ok(())
        }
        AdminCommand::User(UserCommand::Remove { name }) => {
            call("DELETE", &format!("/admin/users/{name}"))?;
            println!("removed user {name}");
            Ok(())
        }
        AdminCommand::User(UserCommand::Key(KeyCommand::Remove { name, access_key })) => {
            call("DELETE", &format!("/admin/users/{name}/keys/{access_key}"))?;
            println!("removed access key {access_key} of user {name}");
            Ok(())
        }
    }
}

fn print_status(v: &serde_json::Value) {
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("-").to_string();
    println!(
        "cluster {}  epoch {}  {}",
        s(&v["cluster"]),
        v["epoch"],
        if v["formed"].as_bool() == Some(true) {
            "formed"
        } else {
            "not formed yet (cluster init)"
        }
    );
    println!("nodes:");
    for n in v["nodes"].as_array().into_iter().flatten() {
        println!(
            "  {:<16} {:<6} {:<8} rpc {}  s3 {}  {} drive(s)",
            s(&n["id"]),
            if n["live"].as_bool() == Some(true) {
                "live"
            } else {
                "DOWN"
            },
            s(&n["state"]),
            s(&n["address"]),
            s(&n["s3"]),
            n["drives"].as_array().map_or(0, Vec::len)
        );
    }
    for p in v["pools"].as_array().into_iter().flatten() {
        println!(
            "pool {} ({}): {}+{}",
            p["id"],
            s(&p["state"]),
            p["data_shards"],
            p["parity_shards"]
        );
        for (i, set) in p["sets"].as_array().into_iter().flatten().enumerate() {
            let drives: Vec<String> = set
                .as_array()
                .into_iter()
                .flatten()
                .map(|d| {
                    let drive: String = s(&d["drive"]).chars().take(8).collect();
                    format!("{}/{drive}", s(&d["node"]))
                })
                .collect();
            println!("  set {i}: {}", drives.join(" "));
        }
    }
    let view = v["drives_seen_from_here"].as_array();
    if let Some(view) = view.filter(|v| !v.is_empty()) {
        println!("drives as node {} sees them:", s(&v["node"]));
        for d in view {
            let state = if d["online"].as_bool() != Some(true) {
                "offline"
            } else if d["rebuilding"].as_bool() == Some(true) {
                "rebuilding"
            } else if d["syncing"].as_bool() == Some(true) {
                "syncing"
            } else {
                "online"
            };
            println!("  set {}  {:<10} {}", d["set"], state, s(&d["drive"]));
        }
    }
    for p in v["suspect_peers"].as_array().into_iter().flatten() {
        println!(
            "peer {} ({}) suspect for {} ms: {}",
            s(&p["node"]),
            s(&p["address"]),
            p["suspect_ms"],
            s(&p["reason"])
        );
    }
    if let Some(n) = v["under_replicated"].as_u64() {
        let overflowed = v["missed_log"]["overflowed"].as_u64().unwrap_or(0);
        println!(
            "under-replicated objects: {n}{}",
            if overflowed > 0 {
                format!(" (and {overflowed} set position(s) whose missed-write log overflowed: healing in full)")
            } else {
                String::new()
            }
        );
    }
    for j in v["jobs"].as_array().into_iter().flatten() {
        let mib = |b: &serde_json::Value| b.as_f64().unwrap_or(0.0) / (1024.0 * 1024.0);
        let eta = match j["eta_s"].as_f64() {
            Some(e) => format!("ETA {e:.0} s"),
            None => "ETA not known yet".into(),
        };
        if j["kind"] == "drain" {
            println!(
                "drain of pool {} led by {} (token {}): pass {}, {} key(s) moved, {} left in this pass, {:.1} MiB at {:.1} MiB/s, {eta}{}",
                j["pool"],
                s(&j["node"]),
                j["token"],
                j["passes"].as_u64().unwrap_or(0) + 1,
                j["moved"],
                j["keys_left"],
                mib(&j["bytes_moved"]),
                mib(&j["rate_bytes_per_s"]),
                match j["uploads_in_pool"].as_u64() {
                    Some(u) if u > 0 => format!(", waiting for {u} upload(s) in progress"),
                    _ => String::new(),
                },
            );
            continue;
        }
        println!(
            "{} on {}: {} {}/{} objects, {:.1} MiB at {:.1} MiB/s, {eta}{}  (drives {})",
            s(&j["kind"]),
            s(&j["node"]),
            s(&j["phase"]),
            j["objects_done"],
            j["objects_total"],
            mib(&j["bytes_done"]),
            mib(&j["rate_bytes_per_s"]),
            match j["failures"].as_u64() {
                Some(f) if f > 0 => format!(", {f} failed (retried)"),
                _ => String::new(),
            },
            j["drives"]
                .as_array()
                .into_iter()
                .flatten()
                .map(&s)
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    if v["formed"].as_bool() == Some(true) {
        println!(
            "repair: {}",
            if v["repair_done"].as_bool() == Some(true) {
                "done (no job runs, no drive behind, nothing under-replicated)"
            } else {
                "under way"
            }
        );
    }
}

fn print_key(v: &serde_json::Value, json: bool) -> anyhow::Result<()> {
    if json {
        println!(
            "{}",
            serde_json::json!({
                "user": v["user"],
                "access_key": v["access_key"],
                "secret_key": v["secret_key"],
            })
        );
    } else {
        println!("user:       {}", v["user"].as_str().unwrap_or(""));
        println!("access key: {}", v["access_key"].as_str().unwrap_or(""));
        println!("secret key: {}", v["secret_key"].as_str().unwrap_or(""));
    }
    Ok(())
}

/// The header naming the nodes that did not confirm an admin change.
pub const UNCONFIRMED_HEADER: &str = "tarn-unconfirmed-nodes";

/// One request; the answer's JSON (null for an empty body). A non-2xx
/// answer is an error carrying the server's message.
fn request(
    endpoint: &str,
    token: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> anyhow::Result<serde_json::Value> {
    let authority = endpoint
        .strip_prefix("http://")
        .with_context(|| format!("--endpoint {endpoint}: an http:// URL"))?
        .trim_end_matches('/');
    if authority.contains('/') {
        bail!("--endpoint {endpoint}: no path expected");
    }
    let mut s = std::net::TcpStream::connect(authority)
        .with_context(|| format!("connecting to {endpoint}"))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nAuthorization: Bearer {token}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("malformed answer from the admin port")?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("malformed status line from the admin port")?;
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body).context("malformed chunked answer")?;
    }
    let text = String::from_utf8_lossy(&body).into_owned();
    if !(200..300).contains(&status) {
        let msg = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| text.trim().to_string());
        bail!("{method} {path}: {status}: {msg}");
    }
    for line in head.lines() {
        if let Some((name, value)) = line.split_once(':') {
            if name.trim().eq_ignore_ascii_case(UNCONFIRMED_HEADER) {
                eprintln!(
                    "warning: not confirmed by node(s) {}: they apply the change when their etcd watch delivers it",
                    value.trim()
                );
            }
        }
    }
    if text.trim().is_empty() {
        return Ok(serde_json::Value::Null);
    }
    serde_json::from_str(&text).context("the admin port answered something other than JSON")
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..eol]).ok()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(super::dechunk(b"5\r\nab").is_none());
    }
}
