//! Where the object client connects and with what credentials, read the way
//! the AWS CLI and SDKs read them: `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`,
//! `AWS_REGION` / `AWS_DEFAULT_REGION`, and the profile named by `AWS_PROFILE`
//! (default `default`) in `~/.aws/credentials` and `~/.aws/config` (or the
//! files `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE` name), including
//! a profile's `endpoint_url`, `region` and `s3 = addressing_style`. Nothing
//! is fetched from an instance metadata service: no probe, no delay.
//!
//! With nothing configured it talks to a Tarn server on this host:
//! `http://127.0.0.1:9000`, with `TARN_ACCESS_KEY` / `TARN_SECRET_KEY` or
//! Tarn's built-in loopback credentials.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::Error;

/// Access key, secret and (for temporary credentials) a session token.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Credentials")
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

/// How a bucket is named in a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    /// `http://host/bucket/key`: Tarn's, and the default.
    Path,
    /// `http://bucket.host/key`.
    Virtual,
}

/// Everything the object client can be told. [`ClientConfig::from_env`]
/// fills in the endpoint and credentials; the rest are tuning with defaults
/// sized for a model load on a GPU host (docs/loader.md, "Tuning").
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `http://host:port` of each server; connections are spread over them
    /// and a retry moves to the next.
    pub endpoints: Vec<String>,
    pub region: String,
    /// None: requests go unsigned (public buckets).
    pub credentials: Option<S3Credentials>,
    pub addressing: Addressing,
    /// Worker threads, each with one keep-alive connection.
    pub connections: usize,
    /// Largest ranged GET; long reads are cut at its multiples.
    pub chunk_bytes: u64,
    /// The server's erasure stripe: `chunk_bytes` is kept a multiple of it.
    pub stripe_bytes: u64,
    /// Reads of one object at most this far apart merge into one request.
    pub merge_gap_bytes: u64,
    /// Most bytes of requests in flight at once (a request larger than the
    /// cap still runs, alone).
    pub max_inflight_bytes: u64,
    /// Attempts after the first for a request that failed in a way worth
    /// retrying (connection errors, 500/502/503/504/429, a stalled body).
    pub retries: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub connect_timeout: Duration,
    /// A socket read or write that makes no progress for this long fails
    /// (and is retried).
    pub io_timeout: Duration,
    /// Hedge a request that runs `hedge_factor` times longer than the
    /// recent median (and at least `hedge_min`): an idle connection reads
    /// the same range, and the first answer wins.
    pub hedge: bool,
    pub hedge_factor: f64,
    pub hedge_min: Duration,
    /// Part size of multipart uploads (grown for objects over 10,000 parts).
    pub part_bytes: u64,
    /// For https:// endpoints: the CA bundle (PEM) their certificates are
    /// checked against (`AWS_CA_BUNDLE`, or a profile's `ca_bundle`, as
    /// the AWS tools read it). None: the system's trusted roots.
    pub ca_bundle: Option<PathBuf>,
    /// Read the shard files of a node on this host directly when it offers
    /// (short-circuit reads; `TARN_LOCAL_READS=0` turns them off).
    pub local_reads: bool,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            endpoints: vec![DEFAULT_ENDPOINT.into()],
            region: "us-east-1".into(),
            credentials: None,
            addressing: Addressing::Path,
            connections: 16,
            chunk_bytes: 8 << 20,
            stripe_bytes: 1 << 20,
            merge_gap_bytes: 1 << 20,
            max_inflight_bytes: 512 << 20,
            retries: 6,
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(3),
            io_timeout: Duration::from_secs(30),
            hedge: true,
            hedge_factor: 3.0,
            hedge_min: Duration::from_millis(200),
            part_bytes: 16 << 20,
            ca_bundle: None,
            local_reads: true,
        }
    }
}

pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:9000";
/// Turns short-circuit reads on or off (`ClientConfig::local_reads`).
pub const LOCAL_READS_ENV: &str = "TARN_LOCAL_READS";

/// What the environment and the profile files say; explicit arguments go
/// over it (`ClientConfig::from_env` then changes fields).
#[derive(Debug)]
struct Found {
    endpoint: Option<String>,
    region: Option<String>,
    credentials: Option<S3Credentials>,
    addressing: Option<Addressing>,
    ca_bundle: Option<PathBuf>,
}

impl ClientConfig {
    /// The defaults, with the endpoint, region, credentials and addressing
    /// style read from the environment and the AWS profile files.
    pub fn from_env() -> Result<ClientConfig, Error> {
        Self::from_sources(&|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// `from_env` against any lookup of environment variables (tests).
    pub fn from_sources(env: &dyn Fn(&str) -> Option<String>) -> Result<ClientConfig, Error> {
        let found = resolve(env)?;
        let mut c = ClientConfig::default();
        if let Some(e) = found.endpoint {
            c.endpoints = vec![e];
        }
        if let Some(r) = found.region {
            c.region = r;
        }
        if let Some(a) = found.addressing {
            c.addressing = a;
        }
        c.ca_bundle = found.ca_bundle;
        if let Some(v) = env(LOCAL_READS_ENV) {
            c.local_reads = match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "on" | "yes" => true,
                "0" | "false" | "off" | "no" => false,
                _ => {
                    return Err(Error::Usage(format!(
                        "{LOCAL_READS_ENV}={v}: say 1 or 0 (true or false)"
                    )))
                }
            };
        }
        c.credentials = Some(match found.credentials {
            Some(cr) => cr,
            None => tarn_default(env)?,
        });
        Ok(c)
    }
}

fn tarn_default(env: &dyn Fn(&str) -> Option<String>) -> Result<S3Credentials, Error> {
    use tarn_wire::auth::{ACCESS_KEY_ENV, DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY, SECRET_KEY_ENV};
    match (env(ACCESS_KEY_ENV), env(SECRET_KEY_ENV)) {
        (Some(a), Some(s)) => Ok(S3Credentials {
            access_key: a,
            secret_key: s,
            session_token: None,
        }),
        (None, None) => Ok(S3Credentials {
            access_key: DEFAULT_ACCESS_KEY.into(),
            secret_key: DEFAULT_SECRET_KEY.into(),
            session_token: None,
        }),
        _ => Err(Error::Usage(format!(
            "set both {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}, or neither"
        ))),
    }
}

fn resolve(env: &dyn Fn(&str) -> Option<String>) -> Result<Found, Error> {
    let home = env("HOME").map(PathBuf::from);
    let profile = env("AWS_PROFILE")
        .or_else(|| env("AWS_DEFAULT_PROFILE"))
        .unwrap_or_else(|| "default".into());
    let named = env("AWS_PROFILE").is_some() || env("AWS_DEFAULT_PROFILE").is_some();
    let creds_file = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".aws/credentials")));
    let config_file = env("AWS_CONFIG_FILE")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".aws/config")));
    let read = |p: &Option<PathBuf>| -> Result<Option<Ini>, Error> {
        let Some(p) = p else { return Ok(None) };
        match std::fs::read_to_string(p) {
            Ok(s) => Ok(Some(parse_ini(&s))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Usage(format!("reading {}: {e}", p.display()))),
        }
    };
    let creds_ini = read(&creds_file)?;
    let config_ini = read(&config_file)?;
    let in_creds = creds_ini.as_ref().and_then(|i| i.get(&profile));
    let config_section = if profile == "default" {
        "default".to_string()
    } else {
        format!("profile {profile}")
    };
    let in_config = config_ini.as_ref().and_then(|i| i.get(&config_section));
    if named && in_creds.is_none() && in_config.is_none() {
        return Err(Error::Usage(format!(
            "AWS profile {profile:?} is in neither {} nor {}",
            show(&creds_file),
            show(&config_file)
        )));
    }
    let pick = |key: &str| -> Option<String> {
        in_creds
            .and_then(|s| s.get(key))
            .or_else(|| in_config.and_then(|s| s.get(key)))
            .cloned()
    };
    let sub = |key: &str| -> Option<String> {
        in_config.and_then(|s| s.get(&format!("s3.{key}"))).cloned()
    };

    let addressing = match sub("addressing_style").as_deref() {
        Some("virtual") => Some(Addressing::Virtual),
        Some("path") | Some("auto") => Some(Addressing::Path),
        Some(other) => {
            return Err(Error::Usage(format!(
                "addressing_style {other:?} in profile {profile:?}: expected path, virtual or auto"
            )))
        }
        None => None,
    };
    let mut f = Found {
        endpoint: env("AWS_ENDPOINT_URL_S3")
            .or_else(|| env("AWS_ENDPOINT_URL"))
            .or_else(|| sub("endpoint_url"))
            .or_else(|| pick("endpoint_url")),
        region: env("AWS_REGION")
            .or_else(|| env("AWS_DEFAULT_REGION"))
            .or_else(|| pick("region")),
        credentials: None,
        addressing,
        ca_bundle: env("AWS_CA_BUNDLE")
            .or_else(|| pick("ca_bundle"))
            .map(PathBuf::from),
    };
    match (env("AWS_ACCESS_KEY_ID"), env("AWS_SECRET_ACCESS_KEY")) {
        (Some(a), Some(s)) => {
            f.credentials = Some(S3Credentials {
                access_key: a,
                secret_key: s,
                session_token: env("AWS_SESSION_TOKEN"),
            })
        }
        (None, None) => {
            if let (Some(a), Some(s)) = (pick("aws_access_key_id"), pick("aws_secret_access_key")) {
                f.credentials = Some(S3Credentials {
                    access_key: a,
                    secret_key: s,
                    session_token: pick("aws_session_token"),
                });
            }
        }
        _ => {
            return Err(Error::Usage(
                "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither".into(),
            ))
        }
    }
    Ok(f)
}

fn show(p: &Option<PathBuf>) -> String {
    p.as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(no home directory)".into())
}

/// Sections of an INI file, keys lowercased; a nested block (`s3 =` then
/// indented `key = value` lines) becomes `s3.key`.
type Ini = HashMap<String, HashMap<String, String>>;

fn parse_ini(text: &str) -> Ini {
    let mut out: Ini = HashMap::new();
    let mut section: Option<String> = None;
    let mut nested: Option<String> = None;
    for raw in text.lines() {
        let indented = raw.starts_with([' ', '\t']);
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            nested = None;
            continue;
        }
        let Some(sec) = &section else { continue };
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
        let entry = out.entry(sec.clone()).or_default();
        if indented {
            if let Some(n) = &nested {
                entry.insert(format!("{n}.{k}"), v);
            }
            continue;
        }
        if v.is_empty() {
            nested = Some(k);
            continue;
        }
        nested = None;
        entry.insert(k, v);
    }
    out
}

/// Splits `http(s)://host:port[/]` into the socket address to dial, the
/// Host header and whether it is TLS; refuses what this client cannot speak.
pub(crate) fn parse_endpoint(e: &str) -> Result<(String, String, bool), Error> {
    let (rest, https) = if let Some(r) = e.strip_prefix("http://") {
        (r, false)
    } else if let Some(r) = e.strip_prefix("https://") {
        (r, true)
    } else if e.contains("://") {
        return Err(Error::Usage(format!(
            "endpoint {e}: expected http://HOST:PORT or https://HOST:PORT"
        )));
    } else {
        (e, false)
    };
    let hostport = rest.trim_end_matches('/');
    if hostport.is_empty() || hostport.contains('/') {
        return Err(Error::Usage(format!(
            "endpoint {e}: expected http://HOST[:PORT] with no path"
        )));
    }
    let dial = if hostport
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !hostport.ends_with(']')
    {
        hostport.to_string()
    } else {
        format!("{hostport}:{}", if https { 443 } else { 80 })
    };
    Ok((dial, hostport.to_string(), https))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn environment_variables_win() {
        let c = ClientConfig::from_sources(&env_of(&[
            ("AWS_ENDPOINT_URL", "http://10.0.0.1:9000"),
            ("AWS_ACCESS_KEY_ID", "ak"),
            ("AWS_SECRET_ACCESS_KEY", "sk"),
            ("AWS_SESSION_TOKEN", "tok"),
            ("AWS_DEFAULT_REGION", "eu-west-1"),
            ("HOME", "/nonexistent"),
        ]))
        .unwrap();
        assert_eq!(c.endpoints, vec!["http://10.0.0.1:9000"]);
        assert_eq!(c.region, "eu-west-1");
        let cr = c.credentials.unwrap();
        assert_eq!(
            (cr.access_key.as_str(), cr.secret_key.as_str()),
            ("ak", "sk")
        );
        assert_eq!(cr.session_token.as_deref(), Some("tok"));
        assert_eq!(c.addressing, Addressing::Path);
    }

    #[test]
    fn profiles_in_the_aws_files() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join(".aws")).unwrap();
        std::fs::write(
            d.path().join(".aws/credentials"),
            "[default]\naws_access_key_id = dk\naws_secret_access_key = ds\n\n[train]\naws_access_key_id=tk\naws_secret_access_key=ts\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join(".aws/config"),
            "[default]\nregion = us-west-2\n[profile train]\nregion = ap-south-1\ns3 =\n  endpoint_url = http://127.0.0.5:9000\n  addressing_style = virtual\n",
        )
        .unwrap();
        let home = d.path().to_str().unwrap();
        let c = ClientConfig::from_sources(&env_of(&[("HOME", home)])).unwrap();
        assert_eq!(c.credentials.unwrap().access_key, "dk");
        assert_eq!(c.region, "us-west-2");
        assert_eq!(c.endpoints, vec![DEFAULT_ENDPOINT]);
        let c = ClientConfig::from_sources(&env_of(&[("HOME", home), ("AWS_PROFILE", "train")]))
            .unwrap();
        assert_eq!(c.credentials.unwrap().access_key, "tk");
        assert_eq!(c.region, "ap-south-1");
        assert_eq!(c.endpoints, vec!["http://127.0.0.5:9000"]);
        assert_eq!(c.addressing, Addressing::Virtual);
        let e = ClientConfig::from_sources(&env_of(&[("HOME", home), ("AWS_PROFILE", "nope")]))
            .unwrap_err();
        assert!(e.to_string().contains("\"nope\""), "{e}");
    }

    #[test]
    fn nothing_configured_means_the_local_tarn() {
        let c = ClientConfig::from_sources(&env_of(&[("HOME", "/nonexistent")])).unwrap();
        assert_eq!(c.endpoints, vec![DEFAULT_ENDPOINT]);
        assert_eq!(c.credentials.unwrap().access_key, "tarnadmin");
        let e = ClientConfig::from_sources(&env_of(&[("AWS_ACCESS_KEY_ID", "x")])).unwrap_err();
        assert!(e.to_string().contains("AWS_SECRET_ACCESS_KEY"));
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("http://127.0.0.1:9000/").unwrap(),
            ("127.0.0.1:9000".into(), "127.0.0.1:9000".into(), false)
        );
        assert_eq!(
            parse_endpoint("http://store.local").unwrap(),
            ("store.local:80".into(), "store.local".into(), false)
        );
        assert_eq!(
            parse_endpoint("https://s3.amazonaws.com").unwrap(),
            (
                "s3.amazonaws.com:443".into(),
                "s3.amazonaws.com".into(),
                true
            )
        );
        assert_eq!(
            parse_endpoint("https://tarn.store.svc:9000").unwrap(),
            (
                "tarn.store.svc:9000".into(),
                "tarn.store.svc:9000".into(),
                true
            )
        );
        assert!(parse_endpoint("http://h:1/path").is_err());
        assert!(parse_endpoint("ftp://h:1").is_err());
    }
}
