//! `tarn cosi`: a Container Object Storage Interface driver
//! (`objectstorage.k8s.io` v1alpha2) for Tarn. It serves COSI's gRPC
//! Identity and Provisioner services on the Unix socket the COSI sidecar
//! names (`COSI_ENDPOINT`) and does each call through Tarn's own APIs, as a
//! script would: buckets over S3 (signed with the server's credentials),
//! users and keys over the admin API, access as bucket-policy statements.
//!
//! Every call is idempotent, as COSI retries them: a bucket's name is a
//! function of COSI's name, an account's user name of its name, and its
//! key is derived (HMAC) from a seed and the user name, so a grant called
//! again answers the same credentials without the driver keeping state.
//! See docs/kubernetes.md ("COSI") for what each call does.

mod pb;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use bytes::Bytes;
use hmac::{KeyInit, Mac};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use sha2::{Digest, Sha256};

use crate::admin_cli::exchange;

#[derive(clap::Args)]
pub struct CosiArgs {
    /// Where to serve COSI's gRPC: `unix:///path/to/cosi.sock` (the COSI
    /// sidecar sets COSI_ENDPOINT).
    #[arg(
        long,
        env = "COSI_ENDPOINT",
        default_value = "unix:///var/lib/cosi/cosi.sock"
    )]
    endpoint: String,
    /// Tarn's S3 endpoint, which the driver calls.
    #[arg(
        long,
        env = "TARN_S3_ENDPOINT",
        default_value = "http://127.0.0.1:9000"
    )]
    s3_endpoint: String,
    /// The S3 endpoint workloads are given in their BucketAccess secrets
    /// (default: --s3-endpoint).
    #[arg(long, env = "TARN_COSI_PUBLIC_ENDPOINT")]
    public_endpoint: Option<String>,
    /// Tarn's admin endpoint (users and keys).
    #[arg(
        long,
        env = "TARN_ADMIN_ENDPOINT",
        default_value = "http://127.0.0.1:9001"
    )]
    admin_endpoint: String,
    /// The server's region (S3 signatures, and what clients are told).
    #[arg(long, env = "TARN_REGION", default_value = "us-east-1")]
    region: String,
    /// The server's access key.
    #[arg(long, env = "TARN_ACCESS_KEY", hide_env_values = true)]
    access_key: String,
    /// The server's secret key (the admin token too, unless
    /// --admin-token).
    #[arg(long, env = "TARN_SECRET_KEY", hide_env_values = true)]
    secret_key: String,
    #[arg(long, env = "TARN_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// What accounts' keys are derived from (default: the secret key).
    /// Changing it makes grants of existing accounts fail (ALREADY_EXISTS)
    /// until they are revoked and granted again.
    #[arg(long, env = "TARN_COSI_SEED", hide_env_values = true)]
    seed: Option<String>,
    /// CA bundle (PEM) for https:// endpoints (default: the system's roots).
    #[arg(long, env = "TARN_CA_BUNDLE")]
    ca_bundle: Option<PathBuf>,
    /// The driver's name, which BucketClasses and BucketAccessClasses name.
    #[arg(long, env = "TARN_COSI_DRIVER_NAME", default_value = "cosi.tarn.dev")]
    driver_name: String,
}

// gRPC status codes (grpc/doc/statuscodes.md).
const INVALID_ARGUMENT: u8 = 3;
const NOT_FOUND: u8 = 5;
const ALREADY_EXISTS: u8 = 6;
const PERMISSION_DENIED: u8 = 7;
const FAILED_PRECONDITION: u8 = 9;
const UNIMPLEMENTED: u8 = 12;
const INTERNAL: u8 = 13;
const UNAVAILABLE: u8 = 14;

/// A call's failure: a gRPC status code and a message for the operator
/// (never a secret).
#[derive(Debug)]
struct Status {
    code: u8,
    message: String,
}

fn status(code: u8, message: impl Into<String>) -> Status {
    Status {
        code,
        message: message.into(),
    }
}

/// What each access mode allows on the bucket and its objects.
const READ_ACTIONS: &[&str] = &[
    "s3:GetBucketLocation",
    "s3:ListBucket",
    "s3:ListBucketVersions",
    "s3:GetObject",
    "s3:GetObjectVersion",
    "s3:GetObjectTagging",
    "s3:GetObjectVersionTagging",
    "s3:GetObjectAttributes",
    "s3:GetObjectVersionAttributes",
];
const WRITE_ACTIONS: &[&str] = &[
    "s3:GetBucketLocation",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:DeleteObjectVersion",
    "s3:PutObjectTagging",
    "s3:PutObjectVersionTagging",
    "s3:DeleteObjectTagging",
    "s3:DeleteObjectVersionTagging",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
    "s3:ListBucketMultipartUploads",
];

fn actions(mode: i32) -> Vec<&'static str> {
    let mut v: Vec<&str> = match mode {
        pb::MODE_READ_ONLY => READ_ACTIONS.to_vec(),
        pb::MODE_WRITE_ONLY => WRITE_ACTIONS.to_vec(),
        _ => READ_ACTIONS.iter().chain(WRITE_ACTIONS).copied().collect(),
    };
    v.sort_unstable();
    v.dedup();
    v
}

fn short_hash(s: &str) -> String {
    Sha256::digest(s.as_bytes())[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn valid_bucket_name(n: &str) -> bool {
    (3..=63).contains(&n.len())
        && n.bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.')
        && n.as_bytes()[0].is_ascii_alphanumeric()
        && n.as_bytes()[n.len() - 1].is_ascii_alphanumeric()
        && !n.contains("..")
        && n.parse::<std::net::Ipv4Addr>().is_err()
}

/// The Tarn bucket for a COSI bucket name (up to 253 characters of a DNS
/// subdomain): the name itself when it is a valid bucket name, else its
/// first characters and a hash of all of it.
fn bucket_name_for(name: &str) -> Result<String, Status> {
    if valid_bucket_name(name) {
        return Ok(name.to_string());
    }
    let head: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .map(|c| c.to_ascii_lowercase())
        .take(50)
        .collect();
    let b = format!("{}-{}", head.trim_matches('-'), short_hash(name));
    let b = b.trim_start_matches('-').to_string();
    if valid_bucket_name(&b) {
        Ok(b)
    } else {
        Err(status(
            INVALID_ARGUMENT,
            format!("no bucket name can be made of {name:?}"),
        ))
    }
}

/// The Tarn user for a COSI account name: the name when it fits Tarn's
/// user names (64 characters of A-Z a-z 0-9 + = , . @ _ -), else its
/// first characters and a hash of all of it.
fn user_name_for(name: &str) -> Result<String, Status> {
    let ok = |c: char| c.is_ascii_alphanumeric() || "+=,.@_-".contains(c);
    if name.is_empty() {
        return Err(status(INVALID_ARGUMENT, "account_name is required"));
    }
    if name.len() <= 64 && name.chars().all(ok) {
        return Ok(name.to_string());
    }
    let head: String = name.chars().filter(|c| ok(*c)).take(51).collect();
    Ok(format!("{head}-{}", short_hash(name)))
}

/// The statement id of an account's access in a bucket policy.
fn sid_for(user: &str) -> String {
    format!("TarnCosi{}", short_hash(user))
}

/// The account's key: derived from the seed and the user name, so a grant
/// called again answers the same key.
fn derive_key(seed: &str, user: &str) -> (String, String) {
    let mac = |label: &str| {
        let mut m = hmac::Hmac::<Sha256>::new_from_slice(seed.as_bytes()).expect("any key length");
        m.update(format!("tarn-cosi-v1 {label} {user}").as_bytes());
        m.finalize().into_bytes()
    };
    let a = mac("access");
    let upper = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let access: String = std::iter::once("TK".to_string())
        .chain(
            a.iter()
                .take(18)
                .map(|b| (upper[usize::from(b % 32)] as char).to_string()),
        )
        .collect();
    let s = mac("secret");
    let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    // 40 characters of 6 bits each: 240 of the 256 bits.
    let secret: String = (0..40)
        .map(|i| {
            let bit = i * 6;
            let v = (u16::from(s[bit / 8]) << 8 | u16::from(s[bit / 8 + 1])) >> (10 - bit % 8);
            alphabet[usize::from(v & 63)] as char
        })
        .collect();
    (access, secret)
}

/// The one parameter a BucketClass may give: `versioning` (`enabled` or
/// `disabled`). Anything else is refused, never ignored.
fn versioning_parameter(p: &BTreeMap<String, String>) -> Result<Option<bool>, Status> {
    let mut out = None;
    for (k, v) in p {
        match (k.as_str(), v.to_ascii_lowercase().as_str()) {
            ("versioning", "enabled" | "true") => out = Some(true),
            ("versioning", "disabled" | "false") => out = Some(false),
            ("versioning", _) => {
                return Err(status(
                    INVALID_ARGUMENT,
                    format!("parameter versioning={v:?}: enabled or disabled"),
                ))
            }
            _ => {
                return Err(status(
                    INVALID_ARGUMENT,
                    format!(
                    "unknown parameter {k:?}: Tarn's buckets take versioning (enabled or disabled)"
                ),
                ))
            }
        }
    }
    Ok(out)
}

fn s3_only(protocols: &[i32]) -> Result<(), Status> {
    match protocols.iter().find(|p| **p != pb::PROTOCOL_S3) {
        Some(p) => Err(status(
            INVALID_ARGUMENT,
            format!("protocol {p} is not served: Tarn serves S3 only"),
        )),
        None => Ok(()),
    }
}

/// The `<Code>` of an S3 error body.
fn s3_code(body: &[u8]) -> String {
    let t = String::from_utf8_lossy(body);
    t.split_once("<Code>")
        .and_then(|(_, r)| r.split_once("</Code>"))
        .map_or_else(String::new, |(c, _)| c.to_string())
}

struct Driver {
    s3_endpoint: String,
    public_endpoint: String,
    admin_endpoint: String,
    region: String,
    signer: tarn_client::sigv4::Signer,
    admin_token: String,
    seed: String,
    ca_bundle: Option<PathBuf>,
    name: String,
    /// One change at a time: bucket policies are read, changed and written.
    changes: Mutex<()>,
}

impl Driver {
    fn s3(
        &self,
        method: &str,
        bucket: &str,
        query: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(u16, Vec<u8>), Status> {
        let host = self
            .s3_endpoint
            .split_once("://")
            .map_or(self.s3_endpoint.as_str(), |(_, a)| a)
            .trim_end_matches('/')
            .to_string();
        let path = format!("/{bucket}");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let signed = self.signer.sign(method, &host, &path, query, now);
        let mut target = tarn_client::sigv4::uri_encode(&path, true);
        for (i, (k, v)) in query.iter().enumerate() {
            target.push(if i == 0 { '?' } else { '&' });
            target.push_str(&tarn_client::sigv4::uri_encode(k, false));
            target.push('=');
            target.push_str(&tarn_client::sigv4::uri_encode(v, false));
        }
        let headers: Vec<(&str, &str)> = signed
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let (code, _, body) = exchange(
            (&self.s3_endpoint, self.ca_bundle.as_deref()),
            method,
            &target,
            &headers,
            body,
        )
        .map_err(|e| status(UNAVAILABLE, format!("Tarn's S3 endpoint: {e:#}")))?;
        if code == 403 {
            return Err(status(
                PERMISSION_DENIED,
                format!("{method} {path}: access denied ({}): are the driver's credentials the server's?", s3_code(&body)),
            ));
        }
        Ok((code, body))
    }

    fn admin(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Result<(u16, serde_json::Value), Status> {
        let auth = format!("Bearer {}", self.admin_token);
        let (code, _, body) = exchange(
            (&self.admin_endpoint, self.ca_bundle.as_deref()),
            method,
            path,
            &[
                ("Authorization", &auth),
                ("Content-Type", "application/json"),
            ],
            body,
        )
        .map_err(|e| status(UNAVAILABLE, format!("Tarn's admin endpoint: {e:#}")))?;
        if code == 401 {
            return Err(status(
                PERMISSION_DENIED,
                "the admin endpoint refused the driver's token",
            ));
        }
        let v = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        Ok((code, v))
    }

    fn unexpected(what: &str, code: u16, body: &[u8]) -> Status {
        let detail = match s3_code(body) {
            c if c.is_empty() => String::from_utf8_lossy(body)
                .trim()
                .chars()
                .take(200)
                .collect(),
            c => c,
        };
        status(
            if code >= 500 { UNAVAILABLE } else { INTERNAL },
            format!("{what}: {code} {detail}"),
        )
    }

    fn bucket_info<'a>(&'a self, bucket_id: &'a str) -> pb::S3Bucket<'a> {
        pb::S3Bucket {
            bucket_id,
            endpoint: &self.public_endpoint,
            region: &self.region,
        }
    }

    /// The bucket's versioning status: "" (never set), Enabled, Suspended.
    fn versioning(&self, bucket: &str) -> Result<String, Status> {
        let (code, body) = self.s3("GET", bucket, &[("versioning", "")], b"")?;
        if code != 200 {
            return Err(Self::unexpected(
                "reading the bucket's versioning",
                code,
                &body,
            ));
        }
        let t = String::from_utf8_lossy(&body);
        Ok(t.split_once("<Status>")
            .and_then(|(_, r)| r.split_once("</Status>"))
            .map_or_else(String::new, |(s, _)| s.to_string()))
    }

    /// Whether the bucket holds no object, version or delete marker.
    fn is_empty(&self, bucket: &str) -> Result<bool, Status> {
        let (code, body) = self.s3("GET", bucket, &[("max-keys", "1"), ("versions", "")], b"")?;
        if code != 200 {
            return Err(Self::unexpected("listing the bucket", code, &body));
        }
        let t = String::from_utf8_lossy(&body);
        Ok(!t.contains("<Version>") && !t.contains("<DeleteMarker>"))
    }

    /// Makes the bucket's versioning what was asked, or says why it cannot
    /// (a bucket that exists with other settings).
    fn match_versioning(&self, bucket: &str, want: Option<bool>) -> Result<(), Status> {
        let Some(want) = want else { return Ok(()) };
        let now = self.versioning(bucket)?;
        match (want, now.as_str()) {
            (true, "Enabled") | (false, "") => Ok(()),
            // Created by an earlier call that stopped before this step (an
            // empty bucket); one holding data is another bucket.
            (true, "") if self.is_empty(bucket)? => {
                let body = b"<VersioningConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Status>Enabled</Status></VersioningConfiguration>";
                let (code, body) = self.s3("PUT", bucket, &[("versioning", "")], body)?;
                if code == 200 {
                    Ok(())
                } else {
                    Err(Self::unexpected("enabling versioning", code, &body))
                }
            }
            (_, now) => Err(status(
                ALREADY_EXISTS,
                format!(
                    "bucket {bucket} exists with versioning {}, not {}",
                    if now.is_empty() { "never enabled" } else { now },
                    if want { "enabled" } else { "disabled" }
                ),
            )),
        }
    }

    fn get_info(&self) -> Result<Vec<u8>, Status> {
        Ok(pb::get_info_response(&self.name))
    }

    fn create_bucket(&self, r: pb::BucketRequest) -> Result<Vec<u8>, Status> {
        if r.name.is_empty() {
            return Err(status(INVALID_ARGUMENT, "name is required"));
        }
        s3_only(&r.protocols)?;
        let versioning = versioning_parameter(&r.parameters)?;
        let bucket = bucket_name_for(&r.name)?;
        let _g = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let (code, body) = self.s3("PUT", &bucket, &[], b"")?;
        match (code, s3_code(&body).as_str()) {
            (200, _) | (409, "BucketAlreadyOwnedByYou") => {}
            (409, "BucketAlreadyExists") => {
                return Err(status(
                    ALREADY_EXISTS,
                    format!("bucket {bucket} exists and belongs to another user"),
                ))
            }
            _ => return Err(Self::unexpected("creating the bucket", code, &body)),
        }
        self.match_versioning(&bucket, versioning)?;
        tracing::info!(cosi = %r.name, %bucket, "COSI: bucket provisioned");
        Ok(pb::bucket_response(&self.bucket_info(&bucket)))
    }

    fn get_existing_bucket(&self, r: pb::BucketRequest) -> Result<Vec<u8>, Status> {
        if r.name.is_empty() {
            return Err(status(INVALID_ARGUMENT, "existing_bucket_id is required"));
        }
        s3_only(&r.protocols)?;
        let versioning = versioning_parameter(&r.parameters)?;
        let (code, body) = self.s3("HEAD", &r.name, &[], b"")?;
        match code {
            200 => {}
            404 => return Err(status(NOT_FOUND, format!("no bucket {}", r.name))),
            _ => return Err(Self::unexpected("looking the bucket up", code, &body)),
        }
        if let Some(want) = versioning {
            let now = self.versioning(&r.name)?;
            if want != (now == "Enabled") {
                return Err(status(
                    ALREADY_EXISTS,
                    format!("bucket {} has versioning {now:?}", r.name),
                ));
            }
        }
        Ok(pb::bucket_response(&self.bucket_info(&r.name)))
    }

    fn delete_bucket(&self, r: pb::DeleteBucketRequest) -> Result<Vec<u8>, Status> {
        if r.bucket_id.is_empty() {
            return Err(status(INVALID_ARGUMENT, "bucket_id is required"));
        }
        versioning_parameter(&r.parameters)?;
        let _g = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let (code, body) = self.s3("DELETE", &r.bucket_id, &[], b"")?;
        match (code, s3_code(&body).as_str()) {
            (200 | 204, _) | (404, "NoSuchBucket") => {
                tracing::info!(bucket = %r.bucket_id, "COSI: bucket deleted");
                Ok(Vec::new())
            }
            (409, "BucketNotEmpty") => Err(status(
                FAILED_PRECONDITION,
                format!(
                    "bucket {} is not empty: Tarn deletes no data for COSI; empty it (every version) and the deletion goes through on the next try",
                    r.bucket_id
                ),
            )),
            _ => Err(Self::unexpected("deleting the bucket", code, &body)),
        }
    }

    /// Adds (`Some(actions)`) or removes (`None`) the account's statement
    /// in a bucket's policy, keeping every other statement.
    fn set_statement(
        &self,
        bucket: &str,
        user: &str,
        grant: Option<&[&str]>,
    ) -> Result<(), Status> {
        let sid = sid_for(user);
        let (code, body) = self.s3("GET", bucket, &[("policy", "")], b"")?;
        let mut doc = match (code, s3_code(&body).as_str()) {
            (200, _) => serde_json::from_slice::<serde_json::Value>(&body).map_err(|e| {
                status(
                    INTERNAL,
                    format!("bucket {bucket}'s policy is not JSON: {e}"),
                )
            })?,
            (404, "NoSuchBucketPolicy") => serde_json::json!({ "Version": "2012-10-17" }),
            (404, "NoSuchBucket") if grant.is_none() => return Ok(()),
            (404, "NoSuchBucket") => return Err(status(NOT_FOUND, format!("no bucket {bucket}"))),
            _ => return Err(Self::unexpected("reading the bucket policy", code, &body)),
        };
        let mut statements = match doc.get("Statement").cloned() {
            Some(serde_json::Value::Array(a)) => a,
            Some(one @ serde_json::Value::Object(_)) => vec![one],
            _ => Vec::new(),
        };
        let at = statements
            .iter()
            .position(|s| s.get("Sid").and_then(|v| v.as_str()) == Some(sid.as_str()));
        match (at, grant) {
            (None, None) => return Ok(()),
            (Some(i), None) => {
                statements.remove(i);
            }
            (Some(i), Some(want)) => {
                let mut have: Vec<String> = match &statements[i]["Action"] {
                    serde_json::Value::String(a) => vec![a.clone()],
                    serde_json::Value::Array(a) => a
                        .iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect(),
                    _ => Vec::new(),
                };
                have.sort_unstable();
                if have == want {
                    return Ok(());
                }
                return Err(status(
                    ALREADY_EXISTS,
                    format!("account {user} already has other access to bucket {bucket}"),
                ));
            }
            (None, Some(want)) => statements.push(serde_json::json!({
                "Sid": sid,
                "Effect": "Allow",
                "Principal": { "AWS": [user] },
                "Action": want,
                "Resource": [format!("arn:aws:s3:::{bucket}"), format!("arn:aws:s3:::{bucket}/*")],
            })),
        }
        let (code, body) = if statements.is_empty() {
            self.s3("DELETE", bucket, &[("policy", "")], b"")?
        } else {
            doc["Statement"] = serde_json::Value::Array(statements);
            let text = serde_json::to_vec(&doc).expect("json");
            self.s3("PUT", bucket, &[("policy", "")], &text)?
        };
        if (200..300).contains(&code) {
            Ok(())
        } else {
            Err(Self::unexpected("writing the bucket policy", code, &body))
        }
    }

    fn grant(&self, r: pb::AccessRequest) -> Result<Vec<u8>, Status> {
        let user = user_name_for(&r.account)?;
        if r.protocol != pb::PROTOCOL_S3 {
            return Err(status(
                INVALID_ARGUMENT,
                format!("protocol {}: Tarn serves S3 only", r.protocol),
            ));
        }
        match r.authentication_type {
            pb::AUTH_KEY => {}
            pb::AUTH_SERVICE_ACCOUNT => {
                return Err(status(
                    INVALID_ARGUMENT,
                    "authentication by service account is not supported: use Key",
                ))
            }
            t => {
                return Err(status(
                    INVALID_ARGUMENT,
                    format!("authentication type {t} is not supported: use Key"),
                ))
            }
        }
        if let Some(k) = r.parameters.keys().next() {
            return Err(status(
                INVALID_ARGUMENT,
                format!("unknown parameter {k:?}: bucket accesses take none"),
            ));
        }
        if r.buckets.is_empty() {
            return Err(status(INVALID_ARGUMENT, "no bucket to grant access to"));
        }
        let mut modes: BTreeMap<&str, i32> = BTreeMap::new();
        for (bucket, mode) in &r.buckets {
            if bucket.is_empty() {
                return Err(status(INVALID_ARGUMENT, "a bucket without bucket_id"));
            }
            if !(pb::MODE_READ_WRITE..=pb::MODE_WRITE_ONLY).contains(mode) {
                return Err(status(
                    INVALID_ARGUMENT,
                    format!(
                        "bucket {bucket}: access mode {mode} (read-write, read-only or write-only)"
                    ),
                ));
            }
            if modes.insert(bucket, *mode).is_some_and(|m| m != *mode) {
                return Err(status(
                    INVALID_ARGUMENT,
                    format!("bucket {bucket} given twice with different access modes"),
                ));
            }
        }
        let (access_key, secret_key) = derive_key(&self.seed, &user);
        let _g = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        for bucket in modes.keys() {
            let (code, body) = self.s3("HEAD", bucket, &[], b"")?;
            match code {
                200 => {}
                404 => return Err(status(NOT_FOUND, format!("no bucket {bucket}"))),
                _ => return Err(Self::unexpected("looking the bucket up", code, &body)),
            }
        }
        let (code, users) = self.admin("GET", "/admin/users", b"")?;
        if code != 200 {
            return Err(status(
                UNAVAILABLE,
                format!("listing users: {code} {users}"),
            ));
        }
        let existing = users["users"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|u| u["name"].as_str() == Some(user.as_str()));
        match existing {
            Some(u) => {
                let has = u["access_keys"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k.as_str() == Some(access_key.as_str()));
                if !has {
                    return Err(status(
                        ALREADY_EXISTS,
                        format!("user {user} exists without this driver's key for it (made by someone else, or under another seed)"),
                    ));
                }
            }
            None => {
                let body = serde_json::to_vec(&serde_json::json!({
                    "access_key": access_key,
                    "secret_key": secret_key,
                }))
                .expect("json");
                let (code, v) = self.admin("POST", &format!("/admin/users/{user}"), &body)?;
                if code != 200 {
                    return Err(status(
                        if code == 409 {
                            ALREADY_EXISTS
                        } else {
                            INTERNAL
                        },
                        format!("making user {user}: {}", v["error"].as_str().unwrap_or("")),
                    ));
                }
            }
        }
        for (bucket, mode) in &modes {
            self.set_statement(bucket, &user, Some(&actions(*mode)))?;
        }
        tracing::info!(account = %r.account, %user, buckets = modes.len(), "COSI: access granted");
        let infos: Vec<pb::S3Bucket<'_>> = modes.keys().map(|b| self.bucket_info(b)).collect();
        Ok(pb::grant_response(
            &user,
            &infos,
            (&access_key, &secret_key),
        ))
    }

    fn revoke(&self, r: pb::AccessRequest) -> Result<Vec<u8>, Status> {
        if r.account.is_empty() {
            return Err(status(INVALID_ARGUMENT, "account_id is required"));
        }
        let user = r.account;
        let _g = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        for (bucket, _) in &r.buckets {
            if !bucket.is_empty() {
                self.set_statement(bucket, &user, None)?;
            }
        }
        let (code, v) = self.admin("DELETE", &format!("/admin/users/{user}"), b"")?;
        match code {
            200 | 204 | 404 => {
                tracing::info!(%user, "COSI: access revoked");
                Ok(Vec::new())
            }
            400 => Err(status(
                INVALID_ARGUMENT,
                format!("account {user}: {}", v["error"].as_str().unwrap_or("")),
            )),
            _ => Err(status(
                UNAVAILABLE,
                format!(
                    "removing user {user}: {code} {}",
                    v["error"].as_str().unwrap_or("")
                ),
            )),
        }
    }

    /// One call by its gRPC path.
    fn call(&self, method: &str, msg: &[u8]) -> Result<Vec<u8>, Status> {
        let bad = |e: pb::DecodeError| status(INVALID_ARGUMENT, e.to_string());
        match method {
            "/sigs.k8s.io.cosi.v1alpha2.Identity/DriverGetInfo" => self.get_info(),
            "/sigs.k8s.io.cosi.v1alpha2.Provisioner/DriverCreateBucket" => {
                self.create_bucket(pb::BucketRequest::decode(msg).map_err(bad)?)
            }
            "/sigs.k8s.io.cosi.v1alpha2.Provisioner/DriverGetExistingBucket" => {
                self.get_existing_bucket(pb::BucketRequest::decode(msg).map_err(bad)?)
            }
            "/sigs.k8s.io.cosi.v1alpha2.Provisioner/DriverDeleteBucket" => {
                self.delete_bucket(pb::DeleteBucketRequest::decode(msg).map_err(bad)?)
            }
            "/sigs.k8s.io.cosi.v1alpha2.Provisioner/DriverGrantBucketAccess" => {
                self.grant(pb::AccessRequest::decode(msg).map_err(bad)?)
            }
            "/sigs.k8s.io.cosi.v1alpha2.Provisioner/DriverRevokeBucketAccess" => {
                self.revoke(pb::AccessRequest::decode(msg).map_err(bad)?)
            }
            _ => Err(status(UNIMPLEMENTED, format!("no method {method}"))),
        }
    }
}

/// A gRPC response body: the one message, then the trailers.
struct GrpcBody {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl http_body::Body for GrpcBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if let Some(d) = self.data.take() {
            return std::task::Poll::Ready(Some(Ok(http_body::Frame::data(d))));
        }
        std::task::Poll::Ready(
            self.trailers
                .take()
                .map(|t| Ok(http_body::Frame::trailers(t))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }
}

/// grpc-message is percent-encoded (gRPC over HTTP/2, "Responses").
fn grpc_message(m: &str) -> http::HeaderValue {
    let mut out = String::new();
    for b in m.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    http::HeaderValue::from_str(&out).unwrap_or_else(|_| http::HeaderValue::from_static("error"))
}

/// The largest request message taken (COSI's are a few KiB).
const MESSAGE_MAX_BYTES: usize = 1 << 20;

async fn handle(
    req: http::Request<Incoming>,
    driver: Arc<Driver>,
) -> Result<http::Response<GrpcBody>, Infallible> {
    let method = req.uri().path().to_string();
    let result = match read_message(req).await {
        Ok(msg) => {
            let d = driver.clone();
            let m = method.clone();
            match tokio::task::spawn_blocking(move || d.call(&m, &msg)).await {
                Ok(r) => r,
                Err(e) => Err(status(INTERNAL, format!("the call failed: {e}"))),
            }
        }
        Err(s) => Err(s),
    };
    let mut resp = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc");
    let body = match result {
        Ok(msg) => {
            let mut framed = Vec::with_capacity(5 + msg.len());
            framed.push(0);
            framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            framed.extend_from_slice(&msg);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            GrpcBody {
                data: Some(Bytes::from(framed)),
                trailers: Some(trailers),
            }
        }
        Err(s) => {
            if s.code != NOT_FOUND && s.code != ALREADY_EXISTS {
                tracing::warn!(%method, code = s.code, message = %s.message, "COSI call failed");
            }
            // Trailers-only: the status in the headers, no body.
            resp = resp
                .header("grpc-status", s.code.to_string())
                .header("grpc-message", grpc_message(&s.message));
            GrpcBody {
                data: None,
                trailers: None,
            }
        }
    };
    Ok(resp.body(body).expect("a response of static parts"))
}

/// The request's one message (uncompressed, length-prefixed).
async fn read_message(req: http::Request<Incoming>) -> Result<Vec<u8>, Status> {
    if req.method() != http::Method::POST {
        return Err(status(UNIMPLEMENTED, "gRPC calls are POSTs"));
    }
    let grpc = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/grpc"));
    if !grpc {
        return Err(status(
            INVALID_ARGUMENT,
            "content-type is not application/grpc",
        ));
    }
    let body = http_body_util::Limited::new(req.into_body(), MESSAGE_MAX_BYTES + 5)
        .collect()
        .await
        .map_err(|e| status(INVALID_ARGUMENT, format!("request body: {e}")))?
        .to_bytes();
    if body.len() < 5 {
        return Err(status(INVALID_ARGUMENT, "no message in the request"));
    }
    if body[0] != 0 {
        return Err(status(
            UNIMPLEMENTED,
            "compressed messages are not supported",
        ));
    }
    let n = u32::from_be_bytes(body[1..5].try_into().expect("4 bytes")) as usize;
    if n != body.len() - 5 {
        return Err(status(
            INVALID_ARGUMENT,
            "one message per call (its length prefix does not match the body)",
        ));
    }
    Ok(body[5..].to_vec())
}

fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .with_context(|| {
            format!("COSI_ENDPOINT {endpoint:?}: a Unix socket, unix:///path/to/cosi.sock")
        })?;
    if !path.starts_with('/') {
        bail!("COSI_ENDPOINT {endpoint:?}: an absolute path, unix:///path/to/cosi.sock");
    }
    Ok(PathBuf::from(path))
}

pub fn run(a: CosiArgs) -> anyhow::Result<()> {
    let path = socket_path(&a.endpoint)?;
    for (flag, url) in [
        ("--s3-endpoint", &a.s3_endpoint),
        ("--admin-endpoint", &a.admin_endpoint),
    ] {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("{flag} {url}: an http:// or https:// URL");
        }
    }
    let driver = Arc::new(Driver {
        public_endpoint: a.public_endpoint.unwrap_or_else(|| a.s3_endpoint.clone()),
        s3_endpoint: a.s3_endpoint,
        admin_endpoint: a.admin_endpoint,
        signer: tarn_client::sigv4::Signer {
            access_key: a.access_key,
            secret_key: a.secret_key.clone(),
            region: a.region.clone(),
            session_token: None,
        },
        region: a.region,
        admin_token: a.admin_token.unwrap_or_else(|| a.secret_key.clone()),
        seed: a.seed.unwrap_or(a.secret_key),
        ca_bundle: a.ca_bundle,
        name: a.driver_name,
        changes: Mutex::new(()),
    });
    // A socket file left by a driver that died is replaced; one that a
    // live driver answers on is not.
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(&path).is_ok() {
            bail!("{}: another driver serves on it", path.display());
        }
        std::fs::remove_file(&path).with_context(|| format!("{}", path.display()))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::UnixListener::bind(&path)
            .with_context(|| format!("binding {}", path.display()))?;
        // The sidecar reaches it as a member of the socket's group (on
        // Kubernetes the pod's fsGroup); nobody else.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660))
                .with_context(|| format!("{}", path.display()))?;
        }
        println!(
            "COSI driver {} on unix://{} (S3 {}, admin {})",
            driver.name,
            path.display(),
            driver.s3_endpoint,
            driver.admin_endpoint
        );
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let d = driver.clone();
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |req| handle(req, d.clone()));
                        let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                        if let Err(error) = conn.await {
                            tracing::debug!(%error, "COSI connection");
                        }
                    });
                }
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
            }
        }
        let _ = std::fs::remove_file(&path);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_tarn() {
        assert_eq!(bucket_name_for("bc-1234").unwrap(), "bc-1234");
        let long = format!("bucketclaim-{}", "a1b2c3d4-".repeat(20));
        let b = bucket_name_for(&long).unwrap();
        assert!(valid_bucket_name(&b) && b.len() <= 63, "{b}");
        assert_eq!(b, bucket_name_for(&long).unwrap(), "stable");
        assert_ne!(b, bucket_name_for(&format!("{long}x")).unwrap());
        assert!(valid_bucket_name(&bucket_name_for("ab").unwrap()));
        assert!(valid_bucket_name(&bucket_name_for("10.0.0.1").unwrap()));
        let u = user_name_for(&"a.".repeat(100)).unwrap();
        assert!(u.len() <= 64, "{u}");
        assert!(user_name_for("").is_err());
    }

    #[test]
    fn keys_are_derived_stably_and_fit_imported_keys() {
        let (a, s) = derive_key("seed", "ba-1");
        assert_eq!((a.clone(), s.clone()), derive_key("seed", "ba-1"));
        assert_ne!(a, derive_key("seed", "ba-2").0);
        assert_ne!(s, derive_key("other", "ba-1").1);
        assert_eq!(a.len(), 20);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit()));
        assert_eq!(s.len(), 40);
        assert!(s.bytes().all(|c| c.is_ascii_graphic()));
    }

    #[test]
    fn parameters_are_checked() {
        let p = |k: &str, v: &str| BTreeMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(versioning_parameter(&BTreeMap::new()).unwrap(), None);
        assert_eq!(
            versioning_parameter(&p("versioning", "Enabled")).unwrap(),
            Some(true)
        );
        assert_eq!(
            versioning_parameter(&p("versioning", "disabled")).unwrap(),
            Some(false)
        );
        assert!(versioning_parameter(&p("versioning", "maybe")).is_err());
        assert!(versioning_parameter(&p("replication", "on")).is_err());
        assert!(s3_only(&[pb::PROTOCOL_S3]).is_ok());
        assert!(s3_only(&[2]).is_err());
        assert_eq!(
            socket_path("unix:///run/cosi/cosi.sock").unwrap(),
            PathBuf::from("/run/cosi/cosi.sock")
        );
        assert!(socket_path("tcp://127.0.0.1:9").is_err());
        assert!(socket_path("unix://relative.sock").is_err());
    }
}
