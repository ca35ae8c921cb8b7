//! `tarn admin cache`: cache buckets over an upstream S3 bucket
//! (docs/cache.md).

use anyhow::{bail, Context};

#[derive(clap::Subcommand)]
pub enum CacheCommand {
    /// Make BUCKET a cache of an upstream S3 bucket. Upstream credentials
    /// come from --upstream-profile (the shared credentials file) or
    /// AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in this command's
    /// environment; they are stored encrypted. Without either the upstream
    /// is read anonymously.
    Add {
        bucket: String,
        /// s3://UPSTREAM-BUCKET[/PREFIX]
        #[arg(long)]
        upstream: String,
        /// The upstream's S3 endpoint, http[s]://host[:port].
        #[arg(long)]
        upstream_endpoint: String,
        /// CA certificates (PEM file) an https:// upstream's certificate
        /// must chain to (default: the system's); stored with the settings.
        #[arg(long)]
        upstream_ca: Option<std::path::PathBuf>,
        /// A profile of the shared credentials file (~/.aws/credentials,
        /// or AWS_SHARED_CREDENTIALS_FILE).
        #[arg(long)]
        upstream_profile: Option<String>,
        /// The region upstream requests are signed for.
        #[arg(long, default_value = "us-east-1")]
        upstream_region: String,
        /// When a cached object is checked against the upstream: always,
        /// ttl=SECONDS or never (immutable data).
        #[arg(long, default_value = "ttl=60")]
        validate: String,
        /// Writes to the bucket: refuse.
        #[arg(long, default_value = "refuse")]
        writes: String,
        /// Bytes the bucket may cache (e.g. 200GiB); eviction keeps it
        /// under.
        #[arg(long)]
        size: Option<String>,
        /// Copies of each cached object (default: the erasure class).
        #[arg(long)]
        replicas: Option<u8>,
        #[arg(long)]
        json: bool,
    },
    /// The cache buckets and their settings (never secrets).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a cache bucket and everything it cached; the upstream is not
    /// touched.
    Remove { bucket: String },
    /// Hits, misses and bytes of each cache bucket on this node.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Fill a cache bucket ahead of its readers: every object under
    /// --prefix, and the keys of --keys-from (one per line; a
    /// `*.safetensors.index.json` brings every file its weight_map names).
    Prefetch {
        bucket: String,
        #[arg(long)]
        prefix: Option<String>,
        /// A file of keys, one per line (`-`: standard input).
        #[arg(long)]
        keys_from: Option<String>,
        /// Wait for the job, with a progress bar.
        #[arg(long)]
        wait: bool,
        #[arg(long)]
        json: bool,
    },
    /// Prefetch jobs on this node and their progress.
    Jobs {
        #[arg(long)]
        json: bool,
    },
    /// Drop what is cached under --prefix (all of the bucket without it);
    /// objects are fetched again when read.
    Drop {
        bucket: String,
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// Pin a prefix: its cached objects are never evicted (for --ttl
    /// seconds, or until unpinned).
    Pin {
        bucket: String,
        #[arg(long)]
        prefix: String,
        #[arg(long)]
        ttl: Option<u64>,
    },
    /// Remove a pin.
    Unpin {
        bucket: String,
        #[arg(long)]
        prefix: String,
    },
}

fn human_bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// One line of a job's progress: a bar, bytes, objects, rate.
fn progress_line(j: &serde_json::Value) -> String {
    let total = j["bytes_total"].as_f64().unwrap_or(0.0);
    let done = j["bytes_done"].as_f64().unwrap_or(0.0);
    let share = if total > 0.0 {
        (done / total).min(1.0)
    } else {
        0.0
    };
    let width = 30;
    let filled = (share * width as f64).round() as usize;
    format!(
        "[{}{}] {:>5.1}% {} / {} · {}/{} objects · {}/s{}",
        "#".repeat(filled),
        ".".repeat(width - filled),
        share * 100.0,
        human_bytes(done),
        human_bytes(total),
        j["objects_done"],
        j["objects_total"],
        human_bytes(j["bytes_per_second"].as_f64().unwrap_or(0.0)),
        match j["failures"].as_u64() {
            Some(0) | None => String::new(),
            Some(n) => format!(" · {n} failed"),
        }
    )
}

/// (access key, secret key) of a profile of the shared credentials file.
fn profile_credentials(name: &str) -> anyhow::Result<(String, String)> {
    let path = match std::env::var_os("AWS_SHARED_CREDENTIALS_FILE") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME").context("HOME is not set")?;
            std::path::Path::new(&home).join(".aws/credentials")
        }
    };
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let (mut section, mut access, mut secret) = (String::new(), None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.trim().to_string();
            continue;
        }
        if section != name {
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            match k.trim() {
                "aws_access_key_id" => access = Some(v.trim().to_string()),
                "aws_secret_access_key" => secret = Some(v.trim().to_string()),
                _ => {}
            }
        }
    }
    match (access, secret) {
        (Some(a), Some(s)) => Ok((a, s)),
        _ => bail!(
            "profile {name:?} in {} has no aws_access_key_id and aws_secret_access_key",
            path.display()
        ),
    }
}

/// One admin request: method, path, body; the JSON answer.
pub type Call<'a> = &'a dyn Fn(&str, &str, &[u8]) -> anyhow::Result<serde_json::Value>;

pub fn run(command: CacheCommand, call: Call<'_>) -> anyhow::Result<()> {
    match command {
        CacheCommand::Add {
            bucket,
            upstream,
            upstream_endpoint,
            upstream_ca,
            upstream_profile,
            upstream_region,
            validate,
            writes,
            size,
            replicas,
            json,
        } => {
            let credentials = match upstream_profile {
                Some(p) => Some(profile_credentials(&p)?),
                None => match (
                    std::env::var("AWS_ACCESS_KEY_ID").ok(),
                    std::env::var("AWS_SECRET_ACCESS_KEY").ok(),
                ) {
                    (Some(a), Some(s)) => Some((a, s)),
                    (None, None) => None,
                    _ => bail!("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither"),
                },
            };
            let size = size
                .map(|s| crate::config::parse_size(&s).context("--size"))
                .transpose()?;
            let ca = upstream_ca
                .map(|p| {
                    std::fs::read_to_string(&p)
                        .with_context(|| format!("--upstream-ca {}", p.display()))
                })
                .transpose()?;
            let body = serde_json::json!({
                "upstream": upstream,
                "ca": ca,
                "endpoint": upstream_endpoint,
                "region": upstream_region,
                "access_key": credentials.as_ref().map(|c| &c.0),
                "secret_key": credentials.as_ref().map(|c| &c.1),
                "validate": validate,
                "writes": writes,
                "size": size,
                "replicas": replicas,
            });
            let v = call(
                "POST",
                &format!("/admin/cache/buckets/{bucket}"),
                body.to_string().as_bytes(),
            )?;
            if json {
                println!("{v}");
            } else {
                println!(
                    "cache bucket {bucket} over {} at {} (validate {}, writes {})",
                    v["upstream"].as_str().unwrap_or(""),
                    v["endpoint"].as_str().unwrap_or(""),
                    v["validate"].as_str().unwrap_or(""),
                    v["writes"].as_str().unwrap_or("")
                );
            }
            Ok(())
        }
        CacheCommand::List { json } => {
            let v = call("GET", "/admin/cache/buckets", b"")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            println!("BUCKET\tUPSTREAM\tENDPOINT\tVALIDATE\tWRITES");
            for b in v.as_array().into_iter().flatten() {
                let s = |k: &str| b[k].as_str().unwrap_or("-").to_string();
                println!(
                    "{}\t{}\t{}\t{}\t{}",
                    s("bucket"),
                    s("upstream"),
                    s("endpoint"),
                    s("validate"),
                    s("writes")
                );
            }
            Ok(())
        }
        CacheCommand::Remove { bucket } => {
            let v = call("DELETE", &format!("/admin/cache/buckets/{bucket}"), b"")?;
            println!(
                "removed cache bucket {bucket} ({} cached object(s), {} chunk(s))",
                v["entries_removed"], v["chunks_removed"]
            );
            Ok(())
        }
        CacheCommand::Prefetch {
            bucket,
            prefix,
            keys_from,
            wait,
            json,
        } => {
            let keys: Vec<String> = match keys_from {
                None => Vec::new(),
                Some(f) => {
                    let text = if f == "-" {
                        std::io::read_to_string(std::io::stdin())?
                    } else {
                        std::fs::read_to_string(&f).with_context(|| format!("reading {f}"))?
                    };
                    text.lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty() && !l.starts_with('#'))
                        .map(str::to_string)
                        .collect()
                }
            };
            let body = serde_json::json!({ "prefix": prefix, "keys": keys });
            let mut v = call(
                "POST",
                &format!("/admin/cache/buckets/{bucket}/prefetch"),
                body.to_string().as_bytes(),
            )?;
            let id = v["id"].as_str().unwrap_or_default().to_string();
            if !wait {
                if json {
                    println!("{v}");
                } else {
                    println!("prefetch job {id} started (tarn admin cache jobs)");
                }
                return Ok(());
            }
            use std::io::IsTerminal;
            let tty = std::io::stderr().is_terminal();
            let mut last = std::time::Instant::now() - std::time::Duration::from_secs(10);
            while v["state"] == "running" {
                std::thread::sleep(std::time::Duration::from_millis(250));
                v = call("GET", &format!("/admin/cache/jobs/{id}"), b"")?;
                if tty {
                    eprint!("\r{}", progress_line(&v));
                } else if last.elapsed() >= std::time::Duration::from_secs(5) {
                    eprintln!("{}", progress_line(&v));
                    last = std::time::Instant::now();
                }
            }
            if tty {
                eprintln!("\r{}", progress_line(&v));
            }
            if json {
                println!("{v}");
            } else {
                println!(
                    "prefetch {id} {}: {} objects, {} in {:.1} s ({}/s), {} from the upstream",
                    v["state"].as_str().unwrap_or(""),
                    v["objects_done"],
                    human_bytes(v["bytes_done"].as_f64().unwrap_or(0.0)),
                    v["seconds"].as_f64().unwrap_or(0.0),
                    human_bytes(v["bytes_per_second"].as_f64().unwrap_or(0.0)),
                    human_bytes(v["bytes_from_upstream"].as_f64().unwrap_or(0.0)),
                );
                for f in v["failed"].as_array().into_iter().flatten() {
                    println!(
                        "  failed {}: {}",
                        f["key"].as_str().unwrap_or(""),
                        f["error"].as_str().unwrap_or("")
                    );
                }
            }
            if let Some(e) = v["error"].as_str() {
                bail!("prefetch {id} failed: {e}");
            }
            if v["failures"].as_u64().unwrap_or(0) > 0 {
                bail!("prefetch {id}: {} object(s) failed", v["failures"]);
            }
            Ok(())
        }
        CacheCommand::Jobs { json } => {
            let v = call("GET", "/admin/cache/jobs", b"")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            println!("JOB\tBUCKET\tWHAT\tSTATE\tPROGRESS");
            for j in v.as_array().into_iter().flatten() {
                println!(
                    "{}\t{}\t{}\t{}\t{}",
                    j["id"].as_str().unwrap_or(""),
                    j["bucket"].as_str().unwrap_or(""),
                    j["what"].as_str().unwrap_or(""),
                    j["state"].as_str().unwrap_or(""),
                    progress_line(j)
                );
            }
            Ok(())
        }
        CacheCommand::Drop { bucket, prefix } => {
            let body = serde_json::json!({ "prefix": prefix });
            let v = call(
                "POST",
                &format!("/admin/cache/buckets/{bucket}/drop"),
                body.to_string().as_bytes(),
            )?;
            println!(
                "dropped {} object(s) ({}) under {prefix:?} of {bucket}",
                v["objects_dropped"],
                human_bytes(v["bytes_dropped"].as_f64().unwrap_or(0.0))
            );
            Ok(())
        }
        CacheCommand::Pin {
            bucket,
            prefix,
            ttl,
        } => {
            let body = serde_json::json!({ "prefix": prefix, "ttl": ttl });
            call(
                "POST",
                &format!("/admin/cache/buckets/{bucket}/pin"),
                body.to_string().as_bytes(),
            )?;
            match ttl {
                Some(t) => println!("pinned {prefix:?} of {bucket} for {t} s"),
                None => println!("pinned {prefix:?} of {bucket}"),
            }
            Ok(())
        }
        CacheCommand::Unpin { bucket, prefix } => {
            let body = serde_json::json!({ "prefix": prefix });
            call(
                "POST",
                &format!("/admin/cache/buckets/{bucket}/unpin"),
                body.to_string().as_bytes(),
            )?;
            println!("unpinned {prefix:?} of {bucket}");
            Ok(())
        }
        CacheCommand::Status { json } => {
            let v = call("GET", "/admin/cache/status", b"")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            println!("BUCKET\tCACHED\tSIZE\tHITS\tMISSES\tHIT RATIO\tFROM UPSTREAM\tEVICTIONS");
            for b in v.as_array().into_iter().flatten() {
                println!(
                    "{}\t{}\t{}\t{}\t{}\t{:.2}\t{}\t{}",
                    b["bucket"].as_str().unwrap_or("-"),
                    human_bytes(b["usage"]["bytes_cached"].as_f64().unwrap_or(0.0)),
                    b["size"].as_f64().map_or("-".into(), human_bytes),
                    b["hits"],
                    b["misses"],
                    b["hit_ratio"].as_f64().unwrap_or(0.0),
                    human_bytes(b["bytes_from_upstream"].as_f64().unwrap_or(0.0)),
                    b["evictions"]
                );
            }
            Ok(())
        }
    }
}
