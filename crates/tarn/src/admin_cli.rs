//! `tarn admin`: operator commands against a running server's admin port
//! (`--endpoint`, the admin URL; `--token`, the server's secret key). Plain
//! HTTP/1.1 over a blocking socket: one request per command.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{bail, Context};

#[derive(clap::Args)]
pub struct AdminArgs {
    /// The server's admin URL (`Admin endpoint:` in its output). Default:
    /// the config file's `endpoint`, else http://127.0.0.1:9001.
    #[arg(long, env = "TARN_ADMIN_ENDPOINT")]
    endpoint: Option<String>,
    /// The admin token: the server's secret key. Default: the config
    /// file's `token`, else `TARN_SECRET_KEY`, else (on a loopback endpoint
    /// only) the built-in credentials' secret a server with no configured
    /// credentials uses.
    #[arg(long, env = "TARN_ADMIN_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// For an https:// endpoint: the CA bundle (PEM) that signed the
    /// server's certificate. Default: the config file's `ca_bundle`, else
    /// the system's trusted roots.
    #[arg(long, env = "TARN_ADMIN_CA_BUNDLE")]
    ca_bundle: Option<std::path::PathBuf>,
    /// A TOML file with `endpoint = "..."`, `token = "..."` and optionally
    /// `ca_bundle = "..."`, readable by its owner only. Default:
    /// ~/.config/tarn/admin.toml when it exists.
    #[arg(long, env = "TARN_ADMIN_CONFIG")]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(clap::Subcommand)]
enum AdminCommand {
    /// Health, drives, capacity, jobs and (in a cluster) nodes at a glance.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Drives of this node's view: set, state, capacity, why not online.
    Drives {
        #[arg(long)]
        json: bool,
    },
    /// Heal everything (or one bucket) as a background job: missing or
    /// corrupt shards rebuilt, metadata a drive lacks rewritten.
    Heal {
        /// Heal this bucket only.
        #[arg(long)]
        bucket: Option<String>,
        /// Follow the job to its end with a progress bar, then print its
        /// summary (exit status 1 if anything failed).
        #[arg(long)]
        wait: bool,
        #[arg(long)]
        json: bool,
    },
    /// Jobs: heals, backfills and drains, cache prefetches, the lifecycle
    /// scanner.
    Jobs {
        #[arg(long)]
        json: bool,
    },
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

/// Where `tarn admin` sends its requests, and with which token.
struct Target {
    endpoint: String,
    token: String,
    ca_bundle: Option<std::path::PathBuf>,
}

#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    endpoint: Option<String>,
    token: Option<String>,
    ca_bundle: Option<std::path::PathBuf>,
}

fn read_config(path: &std::path::Path) -> anyhow::Result<ConfigFile> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        bail!(
            "{}: holds the admin token and is readable by others (chmod 600 it)",
            path.display()
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// Whether an http:// URL names a loopback host.
fn is_loopback(endpoint: &str) -> bool {
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, a)| a)
        .split('/')
        .next()
        .unwrap_or("");
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn target(args: &AdminArgs) -> anyhow::Result<Target> {
    let default_file = std::env::var_os("HOME")
        .map(|h| std::path::PathBuf::from(h).join(".config/tarn/admin.toml"))
        .filter(|p| p.exists());
    let file = match args.config.as_ref().or(default_file.as_ref()) {
        Some(p) => read_config(p)?,
        None => ConfigFile::default(),
    };
    let endpoint = args
        .endpoint
        .clone()
        .or(file.endpoint)
        .unwrap_or_else(|| "http://127.0.0.1:9001".into());
    let token = args
        .token
        .clone()
        .or(file.token)
        .or_else(|| {
            std::env::var(tarn_kv::auth::SECRET_KEY_ENV)
                .ok()
                .filter(|s| !s.is_empty())
        })
        .or_else(|| is_loopback(&endpoint).then(|| crate::config::DEFAULT_SECRET_KEY.to_string()));
    let Some(token) = token else {
        bail!(
            "no admin token for {endpoint}: give --token, set TARN_ADMIN_TOKEN or TARN_SECRET_KEY, or put `token = \"...\"` in ~/.config/tarn/admin.toml (the built-in default is tried only on loopback)"
        );
    };
    let ca_bundle = args.ca_bundle.clone().or(file.ca_bundle);
    Ok(Target {
        endpoint,
        token,
        ca_bundle,
    })
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
        /// Form it only once this many nodes are registered and live (the
        /// nodes of a deployment that start together); fewer is an error,
        /// or with --wait a reason to wait.
        #[arg(long)]
        nodes: Option<usize>,
        /// Wait (up to --timeout seconds) for the admin endpoint to answer
        /// and for --nodes, instead of failing at once.
        #[arg(long)]
        wait: bool,
        #[arg(long, default_value_t = 600)]
        timeout: u64,
        /// A cluster already formed is no error: nothing is changed (a
        /// deployment's init job run again).
        #[arg(long)]
        if_not_formed: bool,
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
    let t = target(&args)?;
    let call = |method: &str, path: &str| request(&t, method, path, b"");
    match args.command {
        AdminCommand::Status { json } => show(&call("GET", "/admin/status")?, json, print_overview),
        AdminCommand::Drives { json } => show(&call("GET", "/admin/drives")?, json, print_drives),
        AdminCommand::Jobs { json } => show(&call("GET", "/admin/jobs")?, json, print_jobs),
        AdminCommand::Heal { bucket, wait, json } => {
            let path = match &bucket {
                Some(b) => format!("/admin/heal/jobs?bucket={b}"),
                None => "/admin/heal/jobs".into(),
            };
            let mut v = call("POST", &path)?;
            let id = v["id"].as_str().unwrap_or("").to_string();
            if v["started"] == false {
                eprintln!("heal job {id} already covers this; following it");
            }
            if !wait {
                if json {
                    println!("{v}");
                } else {
                    println!(
                        "heal job {id} started ({}); `tarn admin jobs` shows its progress",
                        bucket
                            .as_deref()
                            .map_or("every bucket".to_string(), |b| format!("bucket {b}"))
                    );
                }
                return Ok(());
            }
            let bar = !json && std::io::IsTerminal::is_terminal(&std::io::stderr());
            while v["state"] == "running" {
                if bar {
                    eprint!("\r{}", progress_line(&v));
                }
                std::thread::sleep(Duration::from_millis(250));
                v = call("GET", &format!("/admin/jobs/{id}"))?;
            }
            if bar {
                eprintln!("\r{}", progress_line(&v));
            }
            if json {
                println!("{v}");
            } else {
                print_heal_summary(&v);
            }
            if v["state"] != "done" {
                std::process::exit(1);
            }
            Ok(())
        }
        AdminCommand::Cache(c) => {
            crate::admin_cache_cli::run(c, &|method, path, body| request(&t, method, path, body))
        }
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
            nodes,
            wait,
            timeout,
            if_not_formed,
        }) => {
            let deadline = std::time::Instant::now() + Duration::from_secs(timeout);
            let mut said = String::new();
            // Until the endpoint answers, --nodes are live, or the cluster
            // turns out formed already.
            loop {
                let waiting = match call("GET", "/admin/cluster/status") {
                    Err(e) => format!("{e:#}"),
                    Ok(v) if v["formed"].as_bool() == Some(true) => {
                        if if_not_formed {
                            println!("cluster already formed: epoch {}", v["epoch"]);
                            return Ok(());
                        }
                        bail!("the cluster is already formed (epoch {})", v["epoch"]);
                    }
                    Ok(v) => {
                        let live = v["nodes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter(|n| n["live"].as_bool() == Some(true))
                            .count();
                        match nodes {
                            Some(want) if live < want => {
                                format!("{live} of {want} nodes registered and live")
                            }
                            _ => break,
                        }
                    }
                };
                if !wait || std::time::Instant::now() >= deadline {
                    bail!("cannot form the cluster: {waiting}");
                }
                if waiting != said {
                    eprintln!("waiting: {waiting}");
                    said = waiting;
                }
                std::thread::sleep(Duration::from_secs(2));
            }
            let v = match call(
                "POST",
                &format!(
                    "/admin/cluster/init?data_shards={data_shards}&parity_shards={parity_shards}"
                ),
            ) {
                // Another init (a second job) won the race.
                Err(e) if if_not_formed && format!("{e:#}").contains("is already formed") => {
                    println!("cluster already formed");
                    return Ok(());
                }
                r => r?,
            };
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

/// An answer as JSON (`--json`) or for people.
fn show(v: &serde_json::Value, json: bool, human: fn(&serde_json::Value)) -> anyhow::Result<()> {
    if json {
        println!("{v}");
    } else {
        human(v);
    }
    Ok(())
}

/// Bytes for people: 1023 B, 1.5 KiB, 12.3 GiB.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn human_duration(secs: u64) -> String {
    match secs {
        0..=59 => format!("{secs}s"),
        60..=3599 => format!("{}m{:02}s", secs / 60, secs % 60),
        3600..=86_399 => format!("{}h{:02}m", secs / 3600, secs % 3600 / 60),
        _ => format!("{}d{:02}h", secs / 86_400, secs % 86_400 / 3600),
    }
}

/// Rows as columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

fn print_overview(v: &serde_json::Value) {
    let n = |x: &serde_json::Value| x.as_u64().unwrap_or(0);
    println!(
        "tarn {} ({}), up {}",
        v["version"].as_str().unwrap_or("?"),
        v["mode"].as_str().unwrap_or("?"),
        human_duration(n(&v["uptime_seconds"]))
    );
    println!("health:     {}", v["health"].as_str().unwrap_or("?"));
    for p in v["problems"].as_array().into_iter().flatten() {
        println!("            {}", p.as_str().unwrap_or(""));
    }
    let d = &v["drives"];
    let mut states = vec![format!("{} online", n(&d["online"]))];
    for s in ["offline", "rebuilding", "syncing", "full"] {
        if n(&d[s]) > 0 {
            states.push(format!("{} {s}", n(&d[s])));
        }
    }
    println!("drives:     {} ({})", n(&d["total"]), states.join(", "));
    let c = &v["capacity"];
    if n(&c["total_bytes"]) > 0 {
        println!(
            "capacity:   {} used of {}, {} free ({:.0}% used)",
            human_bytes(n(&c["used_bytes"])),
            human_bytes(n(&c["total_bytes"])),
            human_bytes(n(&c["free_bytes"])),
            100.0 * n(&c["used_bytes"]) as f64 / n(&c["total_bytes"]) as f64
        );
    }
    println!("buckets:    {}", n(&v["buckets"]));
    if n(&v["under_replicated"]) > 0 {
        println!("under-replicated objects: {}", n(&v["under_replicated"]));
    }
    println!("jobs:       {} running", n(&v["jobs_running"]));
    let cl = &v["cluster"];
    if cl.is_object() {
        if let Some(e) = cl["error"].as_str() {
            println!("cluster:    unknown ({e})");
        } else {
            println!(
                "cluster:    {} (node {}, map epoch {}): {} of {} nodes live{}",
                cl["id"].as_str().unwrap_or("?"),
                cl["node"].as_str().unwrap_or("?"),
                cl["epoch"],
                n(&cl["nodes_live"]),
                n(&cl["nodes"]),
                match cl["suspect_peers"].as_array().map_or(0, Vec::len) {
                    0 => String::new(),
                    k => format!(", {k} suspect"),
                }
            );
        }
    }
}

fn print_drives(v: &serde_json::Value) {
    let rows: Vec<Vec<String>> = v
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let size = |k: &str| d[k].as_u64().map_or("-".into(), human_bytes);
            vec![
                d["set"].to_string(),
                d["state"].as_str().unwrap_or("?").into(),
                size("used_bytes"),
                size("free_bytes"),
                size("total_bytes"),
                d["path"].as_str().unwrap_or("").into(),
                d["reason"].as_str().unwrap_or("").into(),
            ]
        })
        .collect();
    table(
        &["SET", "STATE", "USED", "FREE", "SIZE", "DRIVE", "REASON"],
        &rows,
    );
}

fn progress_line(v: &serde_json::Value) -> String {
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let (done, total) = (n("objects_done"), n("objects_total"));
    let frac = if total > 0 {
        (done as f64 / total as f64).min(1.0)
    } else if v["state"] == "running" {
        0.0
    } else {
        1.0
    };
    let filled = (frac * 30.0).round() as usize;
    format!(
        "[{}{}] {:>3.0}%  {done}/{total} objects, {} healed, {} failed, {}/s  {}",
        "#".repeat(filled),
        ".".repeat(30 - filled),
        frac * 100.0,
        n("objects_healed"),
        n("failures"),
        human_bytes(v["bytes_per_second"].as_f64().unwrap_or(0.0) as u64),
        v["phase"].as_str().unwrap_or("")
    )
}

fn print_heal_summary(v: &serde_json::Value) {
    let r = &v["report"];
    if let Some(e) = v["error"].as_str() {
        println!("heal job {} failed: {e}", v["id"].as_str().unwrap_or(""));
        return;
    }
    println!(
        "heal job {} {} in {:.1} s ({}):",
        v["id"].as_str().unwrap_or(""),
        v["state"].as_str().unwrap_or(""),
        v["seconds"].as_f64().unwrap_or(0.0),
        v["bucket"]
            .as_str()
            .map_or("every bucket".to_string(), |b| format!("bucket {b}"))
    );
    println!(
        "  {} object(s) checked ({}), {} healed: {} shard(s) rebuilt, {} metadata record(s) rewritten",
        r["objects_scanned"],
        human_bytes(r["bytes_scanned"].as_u64().unwrap_or(0)),
        r["objects_healed"],
        r["shards_rebuilt"],
        r["metadata_rewritten"]
    );
    if r["buckets_healed"].as_u64().unwrap_or(0) + r["orphans_removed"].as_u64().unwrap_or(0) > 0 {
        println!(
            "  {} bucket record(s) restored, {} orphaned shard file(s) removed",
            r["buckets_healed"], r["orphans_removed"]
        );
    }
    match r["failures"].as_u64().unwrap_or(0) {
        0 => println!("  no failures"),
        f => println!(
            "  {f} failure(s): the server's log names them; run again once their drives are back"
        ),
    }
}

fn print_jobs(v: &serde_json::Value) {
    let n = |j: &serde_json::Value, k: &str| j[k].as_u64().unwrap_or(0);
    let rows: Vec<Vec<String>> = v["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|j| {
            let kind = j["kind"].as_str().unwrap_or("?");
            let (progress, detail) = match kind {
                "heal" => (
                    format!("{}/{} objects", n(j, "objects_done"), n(j, "objects_total")),
                    format!(
                        "{}; {} healed, {} failed{}",
                        j["phase"].as_str().unwrap_or(""),
                        n(j, "objects_healed"),
                        n(j, "failures"),
                        j["bucket"].as_str().map_or(String::new(), |b| format!("; bucket {b}"))
                    ),
                ),
                "prefetch" => (
                    format!("{}/{} objects", n(j, "objects_done"), n(j, "objects_total")),
                    format!(
                        "bucket {}; {} of {}, {} failed",
                        j["bucket"].as_str().unwrap_or(""),
                        human_bytes(n(j, "bytes_done")),
                        human_bytes(n(j, "bytes_total")),
                        n(j, "failures")
                    ),
                ),
                "lifecycle" => (
                    format!("{} passes", n(j, "passes")),
                    format!(
                        "{} versions scanned, {} expired, {} uploads aborted, {} kept by object lock, {} errors",
                        n(j, "versions_scanned"),
                        n(j, "expired"),
                        n(j, "uploads_aborted"),
                        n(j, "locked_kept"),
                        n(j, "errors")
                    ),
                ),
                "drain" => (
                    format!("{} keys moved", n(j, "moved")),
                    format!(
                        "pool {}, led by {}; {} left in this pass, {} moved",
                        j["pool"],
                        j["node"].as_str().unwrap_or(""),
                        n(j, "keys_left"),
                        human_bytes(n(j, "bytes_moved"))
                    ),
                ),
                _ => (
                    format!("{}/{} objects", n(j, "objects_done"), n(j, "objects_total")),
                    format!(
                        "{} on {}; {} at {}/s",
                        j["phase"].as_str().unwrap_or(""),
                        j["node"].as_str().unwrap_or(""),
                        human_bytes(n(j, "bytes_done")),
                        human_bytes(j["rate_bytes_per_s"].as_f64().unwrap_or(0.0) as u64)
                    ),
                ),
            };
            vec![
                j["id"].as_str().map_or_else(|| kind.to_string(), str::to_string),
                kind.into(),
                j["state"].as_str().unwrap_or("running").into(),
                progress,
                detail,
            ]
        })
        .collect();
    table(&["ID", "KIND", "STATE", "PROGRESS", "DETAIL"], &rows);
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
        // A node built before protocol ranges were published speaks 3 only.
        let protocol = match n["protocol"].as_array().map(Vec::as_slice) {
            Some([a, b]) if a == b => format!("protocol {a}"),
            Some([a, b]) => format!("protocol {a}-{b}"),
            _ if n["version"].is_string() => "protocol 3".to_string(),
            _ => "-".to_string(),
        };
        println!(
            "  {:<16} {:<6} {:<8} rpc {}  s3 {}  {} drive(s)  {} {}",
            s(&n["id"]),
            if n["live"].as_bool() == Some(true) {
                "live"
            } else {
                "DOWN"
            },
            s(&n["state"]),
            s(&n["address"]),
            s(&n["s3"]),
            n["drives"].as_array().map_or(0, Vec::len),
            s(&n["version"]),
            protocol
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

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// The header naming the nodes that did not confirm an admin change.
pub const UNCONFIRMED_HEADER: &str = "tarn-unconfirmed-nodes";

/// One request; the answer's JSON (null for an empty body). A non-2xx
/// answer is an error carrying the server's message.
fn request(t: &Target, method: &str, path: &str, body: &[u8]) -> anyhow::Result<serde_json::Value> {
    let auth = format!("Bearer {}", t.token);
    let (status, head, body) = exchange(
        (&t.endpoint, t.ca_bundle.as_deref()),
        method,
        path,
        &[("Authorization", auth.as_str())],
        body,
    )?;
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

/// One HTTP/1.1 exchange over a fresh connection (TLS for an https://
/// endpoint, checked against `ca_bundle` or the system's roots): the
/// status, the head's text and the body (de-chunked). `target` is the
/// path and query as sent.
pub(crate) fn exchange(
    (endpoint, ca_bundle): (&str, Option<&std::path::Path>),
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> anyhow::Result<(u16, String, Vec<u8>)> {
    let (tls, authority) = match endpoint.split_once("://") {
        Some(("http", a)) => (false, a),
        Some(("https", a)) => (true, a),
        _ => bail!("--endpoint {endpoint}: an http:// or https:// URL"),
    };
    let authority = authority.trim_end_matches('/');
    if authority.contains('/') {
        bail!("--endpoint {endpoint}: no path expected");
    }
    let tcp = connect(authority).with_context(|| format!("connecting to {endpoint}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(60)))?;
    tcp.set_write_timeout(Some(Duration::from_secs(60)))?;
    let mut s: Box<dyn ReadWrite> = if tls {
        let config = tarn_io::tls::client_config(ca_bundle)
            .map_err(|e| anyhow::anyhow!("--ca-bundle: {e}"))?;
        let name = tarn_io::tls::server_name(authority).map_err(anyhow::Error::msg)?;
        let conn = tarn_io::tls::rustls::ClientConnection::new(config, name)
            .with_context(|| format!("TLS to {endpoint}"))?;
        Box::new(tarn_io::tls::rustls::StreamOwned::new(conn, tcp))
    } else {
        if ca_bundle.is_some() {
            bail!("--ca-bundle is for an https:// endpoint, not {endpoint}");
        }
        Box::new(tcp)
    };
    let mut req = format!("{method} {target} HTTP/1.1\r\nHost: {authority}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    s.write_all(req.as_bytes())
        .with_context(|| format!("sending to {endpoint}"))?;
    s.write_all(body)?;
    s.flush()?;
    let mut raw = Vec::new();
    match s.read_to_end(&mut raw) {
        Ok(_) => {}
        // A TLS peer that closed without close_notify after a whole answer
        // (Connection: close): what arrived is checked below.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
        Err(e) => return Err(e).with_context(|| format!("reading the answer of {endpoint}")),
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("malformed answer from {endpoint}"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut body = raw[split + 4..].to_vec();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("malformed status line from {endpoint}"))?;
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body).context("malformed chunked answer")?;
    }
    Ok((status, head, body))
}

/// A connection to `authority` (HOST:PORT), each of its addresses tried
/// for at most 10 s: a host that drops packets is an error, not a hang.
fn connect(authority: &str) -> std::io::Result<std::net::TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for addr in authority.to_socket_addrs()? {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "the host has no address")
    }))
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
    fn loopback_endpoints() {
        for e in [
            "http://127.0.0.1:9001",
            "http://localhost:9001",
            "http://[::1]:9001",
            "http://127.0.0.5",
            "127.0.0.1:9001",
        ] {
            assert!(super::is_loopback(e), "{e}");
        }
        for e in [
            "http://10.0.0.11:9001",
            "http://tarn.example.com:9001",
            "http://[::2]:9001",
            "http://127.0.0.1.example.com:9001",
        ] {
            assert!(!super::is_loopback(e), "{e}");
        }
    }

    #[test]
    fn sizes_and_durations_for_people() {
        assert_eq!(super::human_bytes(1023), "1023 B");
        assert_eq!(super::human_bytes(1536), "1.5 KiB");
        assert_eq!(super::human_bytes(5 << 40), "5.0 TiB");
        assert_eq!(super::human_duration(59), "59s");
        assert_eq!(super::human_duration(3 * 3600 + 12 * 60), "3h12m");
        assert_eq!(super::human_duration(2 * 86_400 + 3600), "2d01h");
    }

    #[test]
    fn chunked_bodies() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(super::dechunk(b"5\r\nab").is_none());
    }
}
