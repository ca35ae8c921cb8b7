//! Server-side encryption: which key seals an object, and how that key is kept.
//!
//! Every encrypted object has its own random data key (the engine seals its
//! bytes with it, `tarn_store::seal`). The data key is stored only wrapped
//! (AES-256-GCM) under a key-encryption key, in the object's internal headers:
//!
//! - SSE-S3 (`AES256`): a master key of the server's key ring, by id. The
//!   ring's first key wraps new objects; older keys stay to unwrap what they
//!   wrapped, so rotating the master key rewrites no data.
//! - SSE-KMS (`aws:kms`): a named key of the server's KMS key file; with a
//!   bucket key, a key derived from it for the bucket.
//! - SSE-C: the customer's key, sent with every request and never stored.
//!
//! The wrapping binds the bucket, the object key, the mode, the key id and the
//! KMS context, so a wrapped key moved to another object does not open.

use std::path::Path;
use std::sync::Arc;

use s3s::{S3Error, S3ErrorCode, S3Result};
use tarn_store::seal::{self, DataKey, SealSpec};
use tarn_store::ObjectInfo;

/// Internal object headers (never returned: responses list their headers).
pub const MODE_HEADER: &str = "x-tarn-sse";
pub const KEY_ID_HEADER: &str = "x-tarn-sse-key-id";
pub const WRAPPED_HEADER: &str = "x-tarn-sse-dk";
pub const CONTEXT_HEADER: &str = "x-tarn-sse-context";
pub const BUCKET_KEY_HEADER: &str = "x-tarn-sse-bucket-key";

pub const AES256: &str = "AES256";
pub const KMS: &str = "aws:kms";
pub const CUSTOMER: &str = "SSE-C";

/// Whether a stored header is one of encryption's (a copy never takes them
/// from its source).
pub fn is_internal(name: &str) -> bool {
    name == MODE_HEADER || name.starts_with("x-tarn-sse-")
}

/// The environment variable that may hold the SSE-S3 master key
/// (`ID:BASE64` or `BASE64`) when no key file is given.
pub const MASTER_KEY_ENV: &str = "TARN_SSE_MASTER_KEY";

/// The server's keys: SSE-S3 master keys (the first is active) and named
/// KMS keys.
#[derive(Default)]
pub struct KeyRing {
    master: Vec<(String, [u8; 32])>,
    kms: Vec<(String, [u8; 32])>,
    kms_default: Option<String>,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing")
            .field(
                "master",
                &self.master.iter().map(|k| &k.0).collect::<Vec<_>>(),
            )
            .field("kms", &self.kms.iter().map(|k| &k.0).collect::<Vec<_>>())
            .finish()
    }
}

impl Drop for KeyRing {
    fn drop(&mut self) {
        for (_, k) in self.master.iter_mut().chain(self.kms.iter_mut()) {
            for b in k.iter_mut() {
                unsafe { std::ptr::write_volatile(b, 0) };
            }
        }
    }
}

/// Parses a key file: one key per line, `ID:BASE64` (32 bytes once
/// decoded); blank lines and `#` comments skipped. Ids are unique.
pub fn parse_keys(text: &str, what: &str) -> Result<Vec<(String, [u8; 32])>, String> {
    let mut keys: Vec<(String, [u8; 32])> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((id, b64)) = line.split_once(':') else {
            return Err(format!("{what}, line {}: expected ID:BASE64KEY", n + 1));
        };
        let id = id.trim();
        let valid_id = !id.is_empty()
            && id.len() <= 128
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c));
        if !valid_id {
            return Err(format!(
                "{what}, line {}: a key id is 1-128 letters, digits, - _ . /",
                n + 1
            ));
        }
        let key = decode_key(b64.trim())
            .ok_or_else(|| format!("{what}, line {}: the key is not 32 bytes in base64", n + 1))?;
        if keys.iter().any(|(k, _)| k == id) {
            return Err(format!("{what}, line {}: key id {id} appears twice", n + 1));
        }
        keys.push((id.to_string(), key));
    }
    Ok(keys)
}

fn decode_key(b64: &str) -> Option<[u8; 32]> {
    let bytes = base64_simd::STANDARD.decode_to_vec(b64).ok()?;
    bytes.try_into().ok()
}

fn read_key_file(path: &Path, what: &str) -> Result<Vec<(String, [u8; 32])>, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "{what} is readable by other users than its owner: chmod 600 it"
        );
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    let keys = parse_keys(&text, &format!("{what} {}", path.display()))?;
    if keys.is_empty() {
        return Err(format!("{what} {} holds no key", path.display()));
    }
    Ok(keys)
}

impl KeyRing {
    /// The ring of a server: master keys from `master_file` or else the
    /// environment, KMS keys from `kms_file` (its first key is the default
    /// unless `kms_default` names one).
    pub fn load(
        master_file: Option<&Path>,
        kms_file: Option<&Path>,
        kms_default: Option<&str>,
    ) -> Result<KeyRing, String> {
        let master = match master_file {
            Some(p) => read_key_file(p, "the SSE-S3 master key file")?,
            None => match std::env::var(MASTER_KEY_ENV) {
                Ok(v) if !v.trim().is_empty() => {
                    let v = v.trim();
                    let line = if v.contains(':') {
                        v.to_string()
                    } else {
                        format!("env:{v}")
                    };
                    parse_keys(&line, MASTER_KEY_ENV)?
                }
                _ => Vec::new(),
            },
        };
        let kms = match kms_file {
            Some(p) => read_key_file(p, "the KMS key file")?,
            None => Vec::new(),
        };
        let kms_default = match kms_default {
            Some(d) if kms.iter().any(|(k, _)| k == d) => Some(d.to_string()),
            Some(d) => {
                return Err(format!(
                    "--kms-default-key {d}: no such key in the KMS key file"
                ))
            }
            None => kms.first().map(|(k, _)| k.clone()),
        };
        Ok(KeyRing {
            master,
            kms,
            kms_default,
        })
    }

    /// A ring from keys in memory (tests, benchmarks).
    pub fn with_keys(master: Vec<(String, [u8; 32])>, kms: Vec<(String, [u8; 32])>) -> KeyRing {
        let kms_default = kms.first().map(|(k, _)| k.clone());
        KeyRing {
            master,
            kms,
            kms_default,
        }
    }

    pub fn master_ids(&self) -> Vec<String> {
        self.master.iter().map(|k| k.0.clone()).collect()
    }

    pub fn kms_ids(&self) -> Vec<String> {
        self.kms.iter().map(|k| k.0.clone()).collect()
    }

    fn master(&self, id: &str) -> Option<&[u8; 32]> {
        self.master.iter().find(|k| k.0 == id).map(|k| &k.1)
    }

    fn kms(&self, id: &str) -> Option<&[u8; 32]> {
        self.kms.iter().find(|k| k.0 == id).map(|k| &k.1)
    }

    /// A KMS key id as a request may name it (`NAME`, `alias/NAME`, or an
    /// ARN ending in `key/NAME` or `alias/NAME`), as the ring names it.
    pub fn kms_key_named(&self, id: &str) -> S3Result<String> {
        let name = id
            .rsplit_once(":key/")
            .or_else(|| id.rsplit_once(":alias/"))
            .map(|(_, n)| n)
            .or_else(|| id.strip_prefix("alias/"))
            .unwrap_or(id);
        if self.kms(name).is_some() {
            return Ok(name.to_string());
        }
        let mut e = S3Error::with_message(
            S3ErrorCode::Custom("KMS.NotFoundException".into()),
            format!("Invalid keyId {id}: no key of that name in this server's KMS key file."),
        );
        e.set_status_code(http::StatusCode::BAD_REQUEST);
        Err(e)
    }
}

/// What a request asks for (x-amz-server-side-encryption*, or the customer
/// key headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Asked {
    Nothing,
    S3,
    Kms {
        key: Option<String>,
        context: Option<String>,
        bucket_key: Option<bool>,
    },
    Customer(CustomerKey),
}

#[derive(Clone, PartialEq, Eq)]
pub struct CustomerKey {
    pub key: [u8; 32],
    /// As the request sent it (base64), echoed in responses.
    pub md5: String,
}

impl std::fmt::Debug for CustomerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomerKey(md5 {})", self.md5)
    }
}

fn header<'a>(h: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"))
}

fn invalid(msg: impl Into<String>) -> S3Error {
    S3Error::with_message(S3ErrorCode::InvalidArgument, msg.into())
}

/// The customer key a request sends, for its target (`copy_source` false)
/// or its copy source. Refused as AWS does: an algorithm other than AES256,
/// a key that is not 32 bytes, a missing or wrong key MD5, half the headers.
pub fn customer_key(h: &http::HeaderMap, copy_source: bool) -> S3Result<Option<CustomerKey>> {
    let prefix = if copy_source {
        "x-amz-copy-source-server-side-encryption-customer-"
    } else {
        "x-amz-server-side-encryption-customer-"
    };
    let algo = header(h, &format!("{prefix}algorithm"));
    let key = header(h, &format!("{prefix}key"));
    let md5 = header(h, &format!("{prefix}key-md5"));
    if algo.is_none() && key.is_none() && md5.is_none() {
        return Ok(None);
    }
    let Some(algo) = algo else {
        return Err(invalid(
            "Requests specifying Server Side Encryption with Customer provided keys must provide a valid encryption algorithm.",
        ));
    };
    if algo != AES256 {
        let mut e = S3Error::with_message(
            S3ErrorCode::Custom("InvalidEncryptionAlgorithmError".into()),
            "The encryption request you specified is not valid. The valid value is AES256.",
        );
        e.set_status_code(http::StatusCode::BAD_REQUEST);
        return Err(e);
    }
    let Some(key) = key else {
        return Err(invalid(
            "Requests specifying Server Side Encryption with Customer provided keys must provide an appropriate secret key.",
        ));
    };
    let Some(raw) = decode_key(key) else {
        return Err(invalid(
            "The secret key was invalid for the specified algorithm.",
        ));
    };
    let Some(md5) = md5 else {
        return Err(invalid(
            "Requests specifying Server Side Encryption with Customer provided keys must provide the client calculated MD5 of the secret key.",
        ));
    };
    let want = {
        use md5::Digest;
        base64_simd::STANDARD.encode_to_string(md5::Md5::digest(raw))
    };
    if md5 != want {
        return Err(invalid(
            "The calculated MD5 hash of the key did not match the hash that was provided.",
        ));
    }
    Ok(Some(CustomerKey {
        key: raw,
        md5: md5.to_string(),
    }))
}

/// What a write request asks for.
pub fn asked(h: &http::HeaderMap) -> S3Result<Asked> {
    let customer = customer_key(h, false)?;
    let mode = header(h, "x-amz-server-side-encryption");
    let kms_key = header(h, "x-amz-server-side-encryption-aws-kms-key-id");
    let context = header(h, "x-amz-server-side-encryption-context");
    let bucket_key = header(h, "x-amz-server-side-encryption-bucket-key-enabled");
    if let Some(c) = customer {
        if mode.is_some() || kms_key.is_some() || context.is_some() {
            return Err(invalid(
                "Server Side Encryption with Customer provided key is incompatible with the encryption method specified.",
            ));
        }
        return Ok(Asked::Customer(c));
    }
    let bucket_key = match bucket_key {
        None => None,
        Some(v) if v.eq_ignore_ascii_case("true") => Some(true),
        Some(v) if v.eq_ignore_ascii_case("false") => Some(false),
        Some(_) => {
            return Err(invalid(
                "x-amz-server-side-encryption-bucket-key-enabled must be true or false.",
            ))
        }
    };
    match mode {
        None if kms_key.is_some() || context.is_some() => Err(invalid(
            "Server Side Encryption with AWS KMS managed key requires HTTP header x-amz-server-side-encryption : aws:kms",
        )),
        None if bucket_key.is_some() => Err(invalid(
            "x-amz-server-side-encryption-bucket-key-enabled needs x-amz-server-side-encryption: aws:kms",
        )),
        None => Ok(Asked::Nothing),
        Some(AES256) if kms_key.is_some() || context.is_some() => Err(invalid(
            "A KMS key id or context applies to aws:kms encryption only, not AES256.",
        )),
        Some(AES256) => Ok(Asked::S3),
        Some(KMS) => {
            if let Some(c) = context {
                let json = base64_simd::STANDARD
                    .decode_to_vec(c)
                    .ok()
                    .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
                let pairs = json.as_ref().and_then(|v| v.as_object()).is_some_and(|o| {
                    o.values().all(|v| v.is_string())
                });
                if !pairs {
                    return Err(invalid(
                        "The x-amz-server-side-encryption-context is not base64 of a JSON object of string values.",
                    ));
                }
            }
            Ok(Asked::Kms {
                key: kms_key.map(str::to_string),
                context: context.map(str::to_string),
                bucket_key,
            })
        }
        Some(other) => Err(invalid(format!(
            "The encryption method {other} is not supported: AES256 (SSE-S3), aws:kms (SSE-KMS) or the customer key headers (SSE-C)."
        ))),
    }
}

/// A bucket's default encryption (PutBucketEncryption).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BucketEncryption {
    /// AES256 or aws:kms.
    pub algorithm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kms_key: Option<String>,
    #[serde(default)]
    pub bucket_key: bool,
}

/// How a write is encrypted: the engine's part, the headers stored with the
/// object, and the headers of the response.
pub struct Sealing {
    pub spec: SealSpec,
    pub stored: Vec<(String, String)>,
    pub response: Vec<(&'static str, String)>,
}

/// Who the wrapping binds: the object and how its key is kept.
fn binding(bucket: &str, key: &str, mode: &str, key_id: &str, context: &str) -> Vec<u8> {
    format!("tarn-sse-v1\0{bucket}\0{key}\0{mode}\0{key_id}\0{context}").into_bytes()
}

/// The key a bucket key mode wraps with: derived from the KMS key for the
/// bucket (its creation time too, so a new bucket of the same name differs).
fn bucket_kek(kms_key: &[u8; 32], bucket: &str, created_ns: u64) -> [u8; 32] {
    seal::derive(
        kms_key,
        format!("tarn-bucket-key\0{bucket}\0{created_ns}").as_bytes(),
    )
}

fn no_master() -> S3Error {
    S3Error::with_message(
        S3ErrorCode::NotImplemented,
        "SSE-S3 needs a master key and this server has none (--sse-master-key-file or TARN_SSE_MASTER_KEY); nothing was stored.",
    )
}

fn no_kms() -> S3Error {
    S3Error::with_message(
        S3ErrorCode::NotImplemented,
        "SSE-KMS needs a key store and this server has none (--kms-key-file); nothing was stored.",
    )
}

impl Sealing {
    /// Makes a write's options encrypt as this says.
    pub fn apply(&self, opts: &mut tarn_store::PutOptions) {
        opts.headers.extend(self.stored.iter().cloned());
        opts.seal = Some(self.spec.clone());
    }
}

/// `x-amz-server-side-encryption*` (other than the customer-key headers)
/// on a request that cannot choose an encryption: refused as AWS does.
fn refuse_mode_headers(h: &http::HeaderMap, what: &str) -> S3Result<()> {
    const MODE: [&str; 4] = [
        "x-amz-server-side-encryption",
        "x-amz-server-side-encryption-aws-kms-key-id",
        "x-amz-server-side-encryption-context",
        "x-amz-server-side-encryption-bucket-key-enabled",
    ];
    match MODE.iter().find(|n| h.contains_key(**n)) {
        Some(n) => Err(invalid(format!("{n} is not supported {what}."))),
        None => Ok(()),
    }
}

/// GET and HEAD: an object is read with the encryption it was written with.
pub fn refuse_on_read(h: &http::HeaderMap) -> S3Result<()> {
    refuse_mode_headers(h, "on a read (the object is read with its own encryption)")
}

/// UploadPart, UploadPartCopy: the upload's encryption applies.
pub fn refuse_on_part(h: &http::HeaderMap) -> S3Result<()> {
    refuse_mode_headers(
        h,
        "on a part (the encryption of an upload is chosen by CreateMultipartUpload)",
    )
}

/// Where an object is written, for the wrapping.
pub struct Target<'a> {
    pub bucket: &'a str,
    pub key: &'a str,
    /// The bucket's creation time (bucket keys).
    pub bucket_created_ns: u64,
}

impl KeyRing {
    /// The sealing of a write that asks `asked` into a bucket with default
    /// `default`; None when the object is stored unencrypted.
    pub fn seal_for(
        &self,
        asked: &Asked,
        default: Option<&BucketEncryption>,
        t: &Target<'_>,
    ) -> S3Result<Option<Sealing>> {
        let asked = match (asked, default) {
            (Asked::Nothing, None) => return Ok(None),
            (Asked::Nothing, Some(d)) if d.algorithm == KMS => Asked::Kms {
                key: d.kms_key.clone(),
                context: None,
                bucket_key: Some(d.bucket_key),
            },
            (Asked::Nothing, Some(_)) => Asked::S3,
            (a, d) => match a {
                // A KMS request without a key id takes the bucket's.
                Asked::Kms {
                    key: None,
                    context,
                    bucket_key,
                } => Asked::Kms {
                    key: d
                        .filter(|d| d.algorithm == KMS)
                        .and_then(|d| d.kms_key.clone()),
                    context: context.clone(),
                    bucket_key: bucket_key
                        .or(d.filter(|d| d.algorithm == KMS).map(|d| d.bucket_key)),
                },
                a => a.clone(),
            },
        };
        let data_key = DataKey::random();
        let (mode, key_id, kek, context, bucket_key, keyed_etag, response) = match &asked {
            Asked::Nothing => unreachable!("handled above"),
            Asked::S3 => {
                let (id, k) = self.master.first().ok_or_else(no_master)?;
                (
                    AES256,
                    id.clone(),
                    *k,
                    String::new(),
                    false,
                    false,
                    vec![("x-amz-server-side-encryption", AES256.to_string())],
                )
            }
            Asked::Kms {
                key,
                context,
                bucket_key,
            } => {
                if self.kms.is_empty() {
                    return Err(no_kms());
                }
                let name = match key {
                    Some(k) => self.kms_key_named(k)?,
                    None => self.kms_default.clone().ok_or_else(no_kms)?,
                };
                let k = *self.kms(&name).expect("named above");
                let bk = bucket_key.unwrap_or(false);
                let kek = if bk {
                    bucket_kek(&k, t.bucket, t.bucket_created_ns)
                } else {
                    k
                };
                let mut response = vec![
                    ("x-amz-server-side-encryption", KMS.to_string()),
                    ("x-amz-server-side-encryption-aws-kms-key-id", name.clone()),
                ];
                if bk {
                    response.push((
                        "x-amz-server-side-encryption-bucket-key-enabled",
                        "true".to_string(),
                    ));
                }
                if let Some(c) = context {
                    response.push(("x-amz-server-side-encryption-context", c.clone()));
                }
                (
                    KMS,
                    name,
                    kek,
                    context.clone().unwrap_or_default(),
                    bk,
                    true,
                    response,
                )
            }
            Asked::Customer(c) => (
                CUSTOMER,
                String::new(),
                c.key,
                String::new(),
                false,
                true,
                customer_response(c),
            ),
        };
        let wrapped = seal::wrap(
            &kek,
            &binding(t.bucket, t.key, mode, &key_id, &context),
            data_key.bytes(),
        );
        let mut stored = vec![
            (MODE_HEADER.to_string(), mode.to_string()),
            (
                WRAPPED_HEADER.to_string(),
                base64_simd::STANDARD.encode_to_string(&wrapped),
            ),
        ];
        if !key_id.is_empty() {
            stored.push((KEY_ID_HEADER.to_string(), key_id));
        }
        if !context.is_empty() {
            stored.push((CONTEXT_HEADER.to_string(), context));
        }
        if bucket_key {
            stored.push((BUCKET_KEY_HEADER.to_string(), "true".to_string()));
        }
        Ok(Some(Sealing {
            spec: SealSpec {
                key: data_key,
                keyed_etag,
            },
            stored,
            response,
        }))
    }

    /// The data key of an object (or upload) with these stored headers, for a
    /// request that sent `customer` (its SSE-C key, if any). `bucket` and
    /// `key` are where the object is. Refusals are as AWS answers them.
    pub fn data_key(
        &self,
        headers: &[(String, String)],
        customer: Option<&CustomerKey>,
        bucket: &str,
        key: &str,
        bucket_created_ns: u64,
    ) -> S3Result<Option<DataKey>> {
        let get = |n: &str| stored(headers, n);
        let Some(mode) = get(MODE_HEADER) else {
            if customer.is_some() {
                return Err(not_applicable());
            }
            return Ok(None);
        };
        let key_id = get(KEY_ID_HEADER).unwrap_or("");
        let context = get(CONTEXT_HEADER).unwrap_or("");
        let kek = match mode {
            CUSTOMER => match customer {
                Some(c) => c.key,
                None => {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidRequest,
                        "The object was stored using a form of Server Side Encryption. The correct parameters must be provided to retrieve the object.",
                    ))
                }
            },
            _ if customer.is_some() => return Err(not_applicable()),
            AES256 => *self.master(key_id).ok_or_else(|| {
                unavailable(format!(
                    "The object is encrypted under master key {key_id}, which this server's key ring no longer holds."
                ))
            })?,
            KMS => {
                let k = self.kms(key_id).ok_or_else(|| {
                    unavailable(format!(
                        "The object is encrypted under KMS key {key_id}, which this server's KMS key file does not hold."
                    ))
                })?;
                if get(BUCKET_KEY_HEADER) == Some("true") {
                    bucket_kek(k, bucket, bucket_created_ns)
                } else {
                    *k
                }
            }
            other => {
                return Err(unavailable(format!(
                    "The object is encrypted in a way this server does not know ({other})."
                )))
            }
        };
        let wrapped = get(WRAPPED_HEADER)
            .and_then(|w| base64_simd::STANDARD.decode_to_vec(w).ok())
            .ok_or_else(|| unavailable("The object's wrapped data key is missing or damaged."))?;
        match seal::unwrap(&kek, &binding(bucket, key, mode, key_id, context), &wrapped) {
            Some(dk) => Ok(DataKey::from_slice(&dk)),
            None if mode == CUSTOMER => Err(S3Error::with_message(
                S3ErrorCode::AccessDenied,
                "The provided encryption key does not match the key the object was encrypted with.",
            )),
            None => Err(unavailable(
                "The object's data key does not unwrap with its key (the key or the object's metadata changed).",
            )),
        }
    }
}

/// A version's wrapped data key as stored, and the headers that replace it.
pub type Rewrapped = (String, Vec<(String, String)>);

impl KeyRing {
    /// An SSE-S3 object's (or version's) stored headers with its data key
    /// wrapped anew under the active master key: (the wrapped key now
    /// stored, the headers to store instead). None when it is not SSE-S3
    /// or already under the active key. No object data is touched: after
    /// every object under an old master key is rewrapped, that key can
    /// leave the key file.
    pub fn rewrapped(
        &self,
        headers: &[(String, String)],
        bucket: &str,
        key: &str,
    ) -> S3Result<Option<Rewrapped>> {
        let get = |n: &str| stored(headers, n);
        let (Some(AES256), Some((active, kek))) = (get(MODE_HEADER), self.master.first()) else {
            return Ok(None);
        };
        if get(KEY_ID_HEADER) == Some(active.as_str()) {
            return Ok(None);
        }
        let old = get(WRAPPED_HEADER).unwrap_or_default().to_string();
        let Some(data_key) = self.data_key(headers, None, bucket, key, 0)? else {
            return Ok(None);
        };
        let wrapped = seal::wrap(
            kek,
            &binding(bucket, key, AES256, active, ""),
            data_key.bytes(),
        );
        Ok(Some((
            old,
            vec![
                (
                    WRAPPED_HEADER.to_string(),
                    base64_simd::STANDARD.encode_to_string(&wrapped),
                ),
                (KEY_ID_HEADER.to_string(), active.clone()),
            ],
        )))
    }
}

/// What a rewrap pass did (`rewrap_all`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RewrapReport {
    pub versions_scanned: u64,
    pub rewrapped: u64,
    /// Versions whose key could not be unwrapped or written (the log says
    /// which); their master key must stay.
    pub failed: u64,
}

/// Rewraps the data key of every SSE-S3 version of every bucket that is
/// not under the active master key (`KeyRing::rewrapped`), each under its
/// key's lock and only if its wrapped key is still the one read (a version
/// replaced meanwhile is left as it now is). Uploads in progress keep
/// their key until they complete or are aborted.
pub async fn rewrap_all(store: &Arc<tarn_store::Store>, keys: &KeyRing) -> RewrapReport {
    let mut report = RewrapReport::default();
    for b in store.list_buckets() {
        let (mut key_marker, mut version_marker) = (None, None);
        loop {
            let page = match store
                .list_object_versions(
                    &b.name,
                    tarn_store::VersionListParams {
                        prefix: String::new(),
                        delimiter: None,
                        key_marker: key_marker.clone(),
                        version_id_marker: version_marker.clone(),
                        max_keys: 1000,
                    },
                )
                .await
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(bucket = %b.name, error = %e, "rewrap: the bucket cannot be listed");
                    report.failed += 1;
                    break;
                }
            };
            for v in &page.versions {
                report.versions_scanned += 1;
                let version = v.version_id.clone().unwrap_or_else(|| "null".into());
                let done = match keys.rewrapped(&v.headers, &b.name, &v.key) {
                    Ok(None) => continue,
                    Ok(Some((old, new))) => store
                        .replace_headers_if(
                            &b.name,
                            &v.key,
                            &version,
                            (WRAPPED_HEADER, old.as_str()),
                            new,
                        )
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match done {
                    Ok(true) => report.rewrapped += 1,
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(bucket = %b.name, key = %v.key, %version, error = %e, "rewrap: a version's data key stays under its old master key");
                        report.failed += 1;
                    }
                }
            }
            if !page.is_truncated {
                break;
            }
            key_marker = page.next_key_marker;
            version_marker = page.next_version_id_marker;
        }
    }
    report
}

/// A stored header's value.
fn stored<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn not_applicable() -> S3Error {
    S3Error::with_message(
        S3ErrorCode::InvalidRequest,
        "The encryption parameters are not applicable to this object.",
    )
}

fn unavailable(msg: impl Into<String>) -> S3Error {
    S3Error::with_message(S3ErrorCode::InternalError, msg.into())
}

fn customer_response(c: &CustomerKey) -> Vec<(&'static str, String)> {
    vec![
        (
            "x-amz-server-side-encryption-customer-algorithm",
            AES256.to_string(),
        ),
        (
            "x-amz-server-side-encryption-customer-key-md5",
            c.md5.clone(),
        ),
    ]
}

/// The encryption headers of a response about an object with these stored
/// headers (GET, HEAD, CompleteMultipartUpload, UploadPart…).
pub fn response_headers(
    headers: &[(String, String)],
    customer: Option<&CustomerKey>,
) -> Vec<(&'static str, String)> {
    let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
    match get(MODE_HEADER).as_deref() {
        Some(AES256) => vec![("x-amz-server-side-encryption", AES256.to_string())],
        Some(KMS) => {
            let mut out = vec![("x-amz-server-side-encryption", KMS.to_string())];
            if let Some(k) = get(KEY_ID_HEADER) {
                out.push(("x-amz-server-side-encryption-aws-kms-key-id", k));
            }
            if get(BUCKET_KEY_HEADER).as_deref() == Some("true") {
                out.push((
                    "x-amz-server-side-encryption-bucket-key-enabled",
                    "true".to_string(),
                ));
            }
            out
        }
        Some(CUSTOMER) => customer.map(customer_response).unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Whether an object's ETag is a keyed digest (SSE-KMS, SSE-C) rather than
/// its MD5.
pub fn keyed_etag(info: &ObjectInfo) -> bool {
    info.headers
        .iter()
        .any(|(k, v)| k == MODE_HEADER && (v == KMS || v == CUSTOMER))
}

/// Whether an object is encrypted with a customer key (SSE-C).
pub fn is_customer(info: &ObjectInfo) -> bool {
    info.headers
        .iter()
        .any(|(k, v)| k == MODE_HEADER && v == CUSTOMER)
}

/// Adds headers to a response.
pub fn add_headers(h: &mut http::HeaderMap, pairs: &[(&'static str, String)]) {
    for (k, v) in pairs {
        if let Ok(v) = http::HeaderValue::from_str(v) {
            h.insert(*k, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> KeyRing {
        KeyRing::with_keys(
            vec![("m2".into(), [2; 32]), ("m1".into(), [1; 32])],
            vec![("k1".into(), [7; 32])],
        )
    }

    fn target() -> Target<'static> {
        Target {
            bucket: "b",
            key: "k",
            bucket_created_ns: 5,
        }
    }

    #[test]
    fn key_files_parse_and_refuse_bad_lines() {
        let k = base64_simd::STANDARD.encode_to_string([3u8; 32]);
        let keys = parse_keys(&format!("# c\n\nnew:{k}\nold: {k}\n"), "f").unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0].0, "new");
        assert!(parse_keys("x:c2hvcnQ=", "f").is_err());
        assert!(parse_keys(&format!("a:{k}\na:{k}"), "f").is_err());
        assert!(parse_keys(&format!("bad id:{k}"), "f").is_err());
    }

    #[test]
    fn every_mode_wraps_a_key_only_its_object_unwraps() {
        let r = ring();
        let c = CustomerKey {
            key: [9; 32],
            md5: "x".into(),
        };
        for asked in [
            Asked::S3,
            Asked::Kms {
                key: Some("alias/k1".into()),
                context: None,
                bucket_key: Some(true),
            },
            Asked::Customer(c.clone()),
        ] {
            let s = r.seal_for(&asked, None, &target()).unwrap().unwrap();
            let cust = matches!(asked, Asked::Customer(_)).then_some(&c);
            let dk = r.data_key(&s.stored, cust, "b", "k", 5).unwrap().unwrap();
            assert_eq!(dk.bytes(), s.spec.key.bytes());
            // Another object's place: no key.
            assert!(r.data_key(&s.stored, cust, "b", "other", 5).is_err());
            // The wrapped key is not the key.
            let wrapped = &s
                .stored
                .iter()
                .find(|(k, _)| k == WRAPPED_HEADER)
                .unwrap()
                .1;
            let raw = base64_simd::STANDARD.decode_to_vec(wrapped).unwrap();
            assert!(!raw.windows(32).any(|w| w == dk.bytes()));
        }
        // The wrong customer key is AccessDenied; none is InvalidRequest.
        let s = r
            .seal_for(&Asked::Customer(c.clone()), None, &target())
            .unwrap()
            .unwrap();
        let wrong = CustomerKey {
            key: [8; 32],
            md5: "y".into(),
        };
        let e = r
            .data_key(&s.stored, Some(&wrong), "b", "k", 5)
            .unwrap_err();
        assert_eq!(e.code(), &S3ErrorCode::AccessDenied);
        let e = r.data_key(&s.stored, None, "b", "k", 5).unwrap_err();
        assert_eq!(e.code(), &S3ErrorCode::InvalidRequest);
    }

    #[test]
    fn rotation_keeps_old_objects_readable() {
        let old = KeyRing::with_keys(vec![("m1".into(), [1; 32])], vec![]);
        let s = old.seal_for(&Asked::S3, None, &target()).unwrap().unwrap();
        assert!(s
            .stored
            .contains(&(KEY_ID_HEADER.to_string(), "m1".to_string())));
        let new = ring();
        assert!(new
            .data_key(&s.stored, None, "b", "k", 5)
            .unwrap()
            .is_some());
        let s2 = new.seal_for(&Asked::S3, None, &target()).unwrap().unwrap();
        assert!(s2
            .stored
            .contains(&(KEY_ID_HEADER.to_string(), "m2".to_string())));
        let gone = KeyRing::with_keys(vec![("m2".into(), [2; 32])], vec![]);
        assert!(gone.data_key(&s.stored, None, "b", "k", 5).is_err());
    }

    #[test]
    fn bucket_defaults_apply_when_a_request_asks_nothing() {
        let r = ring();
        let d = BucketEncryption {
            algorithm: KMS.into(),
            kms_key: Some("k1".into()),
            bucket_key: true,
        };
        let s = r
            .seal_for(&Asked::Nothing, Some(&d), &target())
            .unwrap()
            .unwrap();
        assert!(s
            .stored
            .contains(&(MODE_HEADER.to_string(), KMS.to_string())));
        assert!(s
            .stored
            .contains(&(BUCKET_KEY_HEADER.to_string(), "true".to_string())));
        assert!(r
            .seal_for(&Asked::Nothing, None, &target())
            .unwrap()
            .is_none());
        let none = KeyRing::default();
        assert!(none.seal_for(&Asked::S3, None, &target()).is_err());
    }

    #[test]
    fn customer_key_headers_are_checked_as_aws_does() {
        use md5::Digest;
        let key = [4u8; 32];
        let b64 = base64_simd::STANDARD.encode_to_string(key);
        let md5 = base64_simd::STANDARD.encode_to_string(md5::Md5::digest(key));
        let mut h = http::HeaderMap::new();
        h.insert(
            "x-amz-server-side-encryption-customer-algorithm",
            "AES256".parse().unwrap(),
        );
        h.insert(
            "x-amz-server-side-encryption-customer-key",
            b64.parse().unwrap(),
        );
        assert!(customer_key(&h, false).is_err(), "no md5");
        h.insert(
            "x-amz-server-side-encryption-customer-key-md5",
            md5.parse().unwrap(),
        );
        assert_eq!(customer_key(&h, false).unwrap().unwrap().key, key);
        assert!(customer_key(&h, true).unwrap().is_none());
        h.insert(
            "x-amz-server-side-encryption-customer-key-md5",
            "AAAA".parse().unwrap(),
        );
        assert!(customer_key(&h, false).is_err());
        h.insert("x-amz-server-side-encryption", "AES256".parse().unwrap());
        assert!(asked(&h).is_err());
    }
}
