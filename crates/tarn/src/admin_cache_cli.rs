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
        /// The upstream's S3 endpoint, http://host:port.
        #[arg(long)]
        upstream_endpoint: String,
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
        /// Bytes the bucket may cache.
        #[arg(long)]
        size: Option<u64>,
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
            let body = serde_json::json!({
                "upstream": upstream,
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
        CacheCommand::Status { json } => {
            let v = call("GET", "/admin/cache/status", b"")?;
            if json {
                println!("{v}");
                return Ok(());
            }
            println!("BUCKET\tHITS\tMISSES\tHIT RATIO\tSERVED\tFROM UPSTREAM");
            for b in v.as_array().into_iter().flatten() {
                println!(
                    "{}\t{}\t{}\t{:.2}\t{}\t{}",
                    b["bucket"].as_str().unwrap_or("-"),
                    b["hits"],
                    b["misses"],
                    b["hit_ratio"].as_f64().unwrap_or(0.0),
                    b["bytes_served"],
                    b["bytes_from_upstream"]
                );
            }
            Ok(())
        }
    }
}
