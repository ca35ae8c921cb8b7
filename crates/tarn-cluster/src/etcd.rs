//! An etcd v3 client over etcd's JSON gateway (`POST /v3/kv/range` and
//! friends; keys and values base64, 64-bit numbers as strings), on the HTTP/1
//! client Tarn already carries: no gRPC stack for a service that is off the
//! data path.
//!
//! Every call has a deadline and tries the endpoints in turn until one
//! answers; an etcd that answers with an error is not retried elsewhere.
//!
//! `https://` endpoints are reached over TLS (rustls): the server's
//! certificate is checked against the CA the operator names, and the
//! client presents its own certificate where etcd asks for one
//! (`--client-cert-auth`).

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{KeyInit, Mac};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint could be reached in time.
    #[error("etcd unreachable ({endpoints}): {reason}")]
    Unreachable { endpoints: String, reason: String },
    /// etcd answered with an error.
    #[error("etcd refused {call}: {status} {message}")]
    Refused {
        call: String,
        status: u16,
        message: String,
    },
    /// A watch started from a revision etcd has compacted away (the oldest
    /// it keeps is given): read everything again and watch from there.
    #[error("etcd compacted the revisions a watch needed (kept from {0})")]
    Compacted(i64),
    /// An answer this client cannot read.
    #[error("etcd answered {call} with something unreadable: {reason}")]
    Protocol { call: String, reason: String },
}

/// One key and its value with etcd's revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    pub lease: i64,
}

/// A transaction's comparison: `key` last changed at `revision` (0: absent).
fn mod_is(key: &str, revision: i64) -> Value {
    json!({
        "key": b64(key.as_bytes()),
        "target": "MOD",
        "result": "EQUAL",
        "mod_revision": revision.to_string(),
    })
}

/// A transaction's comparison: `key` created at `revision`.
fn created_at(key: &str, revision: i64) -> Value {
    json!({
        "key": b64(key.as_bytes()),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": revision.to_string(),
    })
}

/// A client for one etcd cluster (any of its endpoints).
#[derive(Debug, Clone)]
pub struct Etcd {
    /// `host:port` of each endpoint.
    endpoints: Vec<String>,
    /// For `https://` endpoints: how to reach them over TLS.
    tls: Option<Arc<Tls>>,
    timeout: Duration,
    /// With a seal, every value written carries an HMAC under the cluster
    /// secret and every value read must (docs/format.md, "etcd").
    seal: Option<Arc<Seal>>,
    /// etcd's user authentication, when etcd has it enabled.
    auth: Option<Arc<EtcdAuth>>,
}

/// A user and password for etcd, and the token etcd gave for them (simple
/// tokens lapse after a few minutes of disuse: a call refused for its token
/// authenticates again, once).
pub struct EtcdAuth {
    user: String,
    password: String,
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EtcdAuth({})", self.user)
    }
}

/// The files of TLS to etcd (`--etcd-ca`, `--etcd-cert`, `--etcd-key`):
/// the CA that signed etcd's server certificates, and this client's
/// certificate chain and private key (PEM) where etcd checks clients'.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl EtcdTls {
    /// Whether any file was named.
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }

    /// rustls's client configuration for these files: every file read and
    /// checked now, so that a wrong path or a key that does not match its
    /// certificate stops the node at start, not at its first call.
    fn client_config(&self) -> Result<rustls::ClientConfig, String> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let Some(ca) = &self.ca else {
            return Err("https:// etcd endpoints need --etcd-ca FILE (the CA that signed etcd's server certificates, PEM)".into());
        };
        let roots = tarn_io::tls::roots(ca).map_err(|e| format!("--etcd-ca {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        match (&self.cert, &self.key) {
            (None, None) => Ok(builder.with_no_client_auth()),
            (Some(cert), Some(key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| format!("--etcd-cert {}: {e}", cert.display()))?;
                if chain.is_empty() {
                    return Err(format!(
                        "--etcd-cert {}: no PEM certificate in it",
                        cert.display()
                    ));
                }
                let key_der = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("--etcd-key {}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    format!(
                        "--etcd-cert {} and --etcd-key {}: {e}",
                        cert.display(),
                        key.display()
                    )
                })
            }
            _ => Err("--etcd-cert and --etcd-key go together (this node's certificate for etcd and its private key)".into()),
        }
    }
}

/// How this client reaches `https://` endpoints.
struct Tls {
    connector: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

/// The name an endpoint's certificate must carry: its host (a DNS name or
/// an IP address, `[v6]` unbracketed).
fn server_name(hostport: &str) -> Result<rustls_pki_types::ServerName<'static>, String> {
    let host = hostport
        .rsplit_once(':')
        .map_or(hostport, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    rustls_pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a name a certificate can carry: {e}"))
}

/// Whether etcd refused a call for its token (absent, lapsed or revoked).
fn token_refused(status: u16, message: &str) -> bool {
    status == 401
        || message.contains("invalid auth token")
        || message.contains("user name is empty")
        || message.contains("token")
}

/// The first bytes of a sealed value.
pub const SEAL_MAGIC: [u8; 4] = *b"TSL1";
/// A sealed value: magic, then the tag, then the value.
pub const SEAL_BYTES: usize = 4 + 32;

/// Authenticates what Tarn stores in etcd: a value is stored as
/// `"TSL1" ‖ HMAC-SHA256(k, key ‖ 0 ‖ value) ‖ value`, with
/// `k = HMAC-SHA256(cluster secret, "tarn-etcd-seal-v1")`, so that a record
/// written without the secret (by anyone else who can reach etcd) or moved
/// to another key is refused, never applied. It does not stop a writer of
/// etcd from deleting records or putting back an older sealed value: etcd's
/// own authentication (TLS client certificates, users) guards that.
pub struct Seal {
    key: [u8; 32],
    /// Records refused since start, and the last one's key.
    pub refused: AtomicU64,
    last_refused: Mutex<Option<String>>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seal")
    }
}

/// Why a stored value did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsealed {
    /// No seal at all: written by something else, or before sealing.
    Missing,
    /// A seal that does not match: another secret, or a changed value or key.
    Wrong,
}

impl Seal {
    pub fn new(secret: &[u8]) -> Seal {
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
        m.update(b"tarn-etcd-seal-v1");
        Seal {
            key: m.finalize().into_bytes().into(),
            refused: AtomicU64::new(0),
            last_refused: Mutex::new(None),
        }
    }

    fn mac(&self, key: &str, value: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.key).expect("32 bytes");
        m.update(key.as_bytes());
        m.update(&[0]);
        m.update(value);
        m
    }

    /// The stored form of `value` under `key`.
    pub fn seal(&self, key: &str, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(SEAL_BYTES + value.len());
        out.extend_from_slice(&SEAL_MAGIC);
        out.extend_from_slice(&self.mac(key, value).finalize().into_bytes());
        out.extend_from_slice(value);
        out
    }

    /// The value a stored form under `key` carries, checked in constant
    /// time.
    pub fn open<'a>(&self, key: &str, stored: &'a [u8]) -> Result<&'a [u8], Unsealed> {
        if stored.len() < SEAL_BYTES || stored[..4] != SEAL_MAGIC {
            return Err(Unsealed::Missing);
        }
        let (tag, value) = stored[4..].split_at(32);
        self.mac(key, value)
            .verify_slice(tag)
            .map(|()| value)
            .map_err(|_| Unsealed::Wrong)
    }

    fn note_refused(&self, key: &str, why: Unsealed) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last_refused.lock().unwrap_or_else(|p| p.into_inner());
        // Logged once per key in a row, so that a planted record read on
        // every refresh does not flood the log.
        if last.as_deref() != Some(key) {
            tracing::error!(key, ?why, "etcd record refused: not sealed with this cluster's secret (written by something other than a node of this cluster, or changed); ignored");
            *last = Some(key.to_string());
        }
    }

    /// The last key whose record was refused.
    pub fn last_refused(&self) -> Option<String> {
        self.last_refused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn b64(s: &[u8]) -> String {
    base64_simd::STANDARD.encode_to_string(s)
}

/// etcd's JSON carries 64-bit numbers as strings and leaves out zeros.
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// The first key after every key that starts with `prefix` (etcd's
/// `range_end` for a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from the prefix on.
    vec![0]
}

impl Etcd {
    /// `endpoints`: comma-separated `http://host:port` URLs (`--etcd`).
    pub fn new(endpoints: &str, timeout: Duration) -> Result<Etcd, String> {
        Etcd::with_tls(endpoints, timeout, &EtcdTls::default())
    }

    /// `endpoints`: comma-separated `http://host:port` or (all of them)
    /// `https://host:port` URLs; `tls`: the CA and client certificate for
    /// `https://` ones (and none for plain ones: a certificate given for a
    /// connection that would not use it is a mistake said at once).
    pub fn with_tls(endpoints: &str, timeout: Duration, tls: &EtcdTls) -> Result<Etcd, String> {
        let mut out = Vec::new();
        let mut schemes = Vec::new();
        for e in endpoints
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let (https, rest) = match (e.strip_prefix("http://"), e.strip_prefix("https://")) {
                (Some(rest), _) => (false, rest),
                (_, Some(rest)) => (true, rest),
                _ => {
                    return Err(format!(
                        "etcd endpoint {e:?} must be http://HOST:PORT or https://HOST:PORT"
                    ))
                }
            };
            let hostport = rest.trim_end_matches('/');
            if hostport.is_empty() || hostport.contains('/') || !hostport.contains(':') {
                return Err(format!("etcd endpoint {e:?} must be http(s)://HOST:PORT"));
            }
            if https {
                server_name(hostport).map_err(|why| format!("etcd endpoint {e:?}: {why}"))?;
            }
            out.push(hostport.to_string());
            schemes.push(https);
        }
        if out.is_empty() {
            return Err("no etcd endpoint given".into());
        }
        let https = schemes[0];
        if schemes.iter().any(|&s| s != https) {
            return Err(format!(
                "etcd endpoints {endpoints:?} mix http:// and https://: give one kind"
            ));
        }
        let tls = match (https, tls.is_empty()) {
            (false, true) => None,
            (false, false) => return Err(
                "--etcd-ca, --etcd-cert and --etcd-key are for https:// etcd endpoints; these are http://"
                    .into(),
            ),
            (true, _) => Some(Arc::new(Tls {
                connector: tokio_rustls::TlsConnector::from(Arc::new(tls.client_config()?)),
            })),
        };
        Ok(Etcd {
            endpoints: out,
            tls,
            timeout,
            seal: None,
            auth: None,
        })
    }

    /// Whether this client reaches etcd over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// This client, authenticating to etcd as `user` (etcd's own users,
    /// `etcdctl auth enable`).
    pub fn with_user(mut self, user: &str, password: &str) -> Etcd {
        self.auth = Some(Arc::new(EtcdAuth {
            user: user.to_string(),
            password: password.to_string(),
            token: Mutex::new(None),
        }));
        self
    }

    /// `token` for `ep`, with an unreachable endpoint noted in `reasons`
    /// (`Ok(None)`: try the next endpoint); etcd's refusal is the error.
    async fn token_or_reason(
        &self,
        ep: &str,
        fresh: bool,
        reasons: &mut Vec<String>,
    ) -> Result<Option<Option<String>>, EtcdError> {
        match self.token(ep, fresh).await {
            Ok(t) => Ok(Some(t)),
            Err(EtcdError::Unreachable { reason, .. }) => {
                reasons.push(format!("{ep}: {reason}"));
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// The token to send to `ep`: the one held, or a new one (`fresh`).
    async fn token(&self, ep: &str, fresh: bool) -> Result<Option<String>, EtcdError> {
        let Some(a) = &self.auth else { return Ok(None) };
        if !fresh {
            if let Some(t) = a.token.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                return Ok(Some(t));
            }
        }
        let body = Bytes::from(
            serde_json::to_vec(&json!({ "name": a.user, "password": a.password })).expect("json"),
        );
        let (status, bytes) = match tokio::time::timeout(
            self.timeout,
            post(ep, self.tls.as_deref(), "/v3/auth/authenticate", body, None),
        )
        .await
        {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                return Err(EtcdError::Unreachable {
                    endpoints: ep.to_string(),
                    reason: e,
                })
            }
            Err(_) => {
                return Err(EtcdError::Unreachable {
                    endpoints: ep.to_string(),
                    reason: format!("no answer in {:?}", self.timeout),
                })
            }
        };
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let token = v
            .get("token")
            .and_then(Value::as_str)
            .filter(|_| status == 200);
        let Some(token) = token else {
            return Err(EtcdError::Refused {
                call: "authenticate".into(),
                status,
                message: format!(
                    "etcd refused user {:?}: {}",
                    a.user,
                    v.get("message").and_then(Value::as_str).unwrap_or("")
                ),
            });
        };
        *a.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(token.to_string());
        Ok(Some(token.to_string()))
    }

    /// This client, sealing what it writes and refusing what it reads
    /// unsealed under `secret` (every node's client; see [`Seal`]).
    pub fn sealed(mut self, secret: &[u8]) -> Etcd {
        self.seal = Some(Arc::new(Seal::new(secret)));
        self
    }

    /// The seal, if this client has one.
    pub fn seal(&self) -> Option<&Arc<Seal>> {
        self.seal.as_ref()
    }

    /// `value` as stored under `key`: sealed when this client seals.
    fn stored(&self, key: &str, value: &[u8]) -> Vec<u8> {
        match &self.seal {
            Some(s) => s.seal(key, value),
            None => value.to_vec(),
        }
    }

    /// Opens the values of `kvs` read from etcd: a value that is not
    /// sealed under this client's secret is refused (logged, counted) and
    /// left out, as if absent.
    fn opened(&self, kvs: Vec<KeyValue>) -> Vec<KeyValue> {
        let Some(seal) = &self.seal else { return kvs };
        kvs.into_iter()
            .filter_map(|mut kv| match seal.open(&kv.key, &kv.value) {
                Ok(v) => {
                    kv.value = v.to_vec();
                    Some(kv)
                }
                Err(why) => {
                    seal.note_refused(&kv.key, why);
                    None
                }
            })
            .collect()
    }

    /// One key as stored, unopened (to tell a record of another secret from
    /// one written before sealing).
    pub async fn get_stored(&self, key: &str) -> Result<Option<KeyValue>, EtcdError> {
        let v = self
            .call("/v3/kv/range", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        Ok(Self::kvs("range", &v)?.pop())
    }

    /// Every key under `prefix` as stored, unopened.
    pub async fn get_prefix_stored(&self, prefix: &str) -> Result<Vec<KeyValue>, EtcdError> {
        let v = self.range_prefix(prefix).await?;
        Self::kvs("range", &v)
    }

    pub fn endpoints(&self) -> String {
        self.endpoints.join(",")
    }

    /// POSTs `body` to `path` on the first endpoint that answers (with the
    /// user's token when etcd authenticates users).
    async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let body = Bytes::from(serde_json::to_vec(&body).expect("json"));
        let mut reasons = Vec::new();
        for ep in &self.endpoints {
            let mut fresh = false;
            loop {
                let Some(token) = self.token_or_reason(ep, fresh, &mut reasons).await? else {
                    break;
                };
                match tokio::time::timeout(
                    self.timeout,
                    post(
                        ep,
                        self.tls.as_deref(),
                        path,
                        body.clone(),
                        token.as_deref(),
                    ),
                )
                .await
                {
                    Ok(Ok((status, bytes))) => {
                        let value: Value =
                            serde_json::from_slice(&bytes).map_err(|e| EtcdError::Protocol {
                                call: path.into(),
                                reason: format!("{e}"),
                            })?;
                        if status != 200 {
                            let message = value
                                .get("message")
                                .or_else(|| value.get("error"))
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string();
                            if self.auth.is_some() && !fresh && token_refused(status, &message) {
                                fresh = true;
                                continue;
                            }
                            return Err(EtcdError::Refused {
                                call: path.into(),
                                status,
                                message,
                            });
                        }
                        return Ok(value);
                    }
                    Ok(Err(e)) => reasons.push(format!("{ep}: {e}")),
                    Err(_) => reasons.push(format!("{ep}: no answer in {:?}", self.timeout)),
                }
                break;
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints(),
            reason: reasons.join("; "),
        })
    }

    fn protocol(call: &str, reason: impl Into<String>) -> EtcdError {
        EtcdError::Protocol {
            call: call.into(),
            reason: reason.into(),
        }
    }

    fn kvs(call: &str, v: &Value) -> Result<Vec<KeyValue>, EtcdError> {
        let Some(list) = v.get("kvs") else {
            return Ok(Vec::new());
        };
        let list = list
            .as_array()
            .ok_or_else(|| Self::protocol(call, "kvs is not a list"))?;
        list.iter()
            .map(|kv| {
                let field = |name: &str| -> Result<Vec<u8>, EtcdError> {
                    match kv.get(name).and_then(Value::as_str) {
                        None => Ok(Vec::new()),
                        Some(s) => base64_simd::STANDARD
                            .decode_to_vec(s)
                            .map_err(|e| Self::protocol(call, format!("{name}: {e}"))),
                    }
                };
                let key = String::from_utf8(field("key")?)
                    .map_err(|_| Self::protocol(call, "a key is not UTF-8"))?;
                Ok(KeyValue {
                    key,
                    value: field("value")?,
                    create_revision: int(&kv["create_revision"]),
                    mod_revision: int(&kv["mod_revision"]),
                    version: int(&kv["version"]),
                    lease: int(&kv["lease"]),
                })
            })
            .collect()
    }

    /// etcd's answer to a range read of every key under `prefix`.
    async fn range_prefix(&self, prefix: &str) -> Result<Value, EtcdError> {
        self.call(
            "/v3/kv/range",
            json!({
                "key": b64(prefix.as_bytes()),
                "range_end": b64(&prefix_end(prefix.as_bytes())),
            }),
        )
        .await
    }

    fn revision(v: &Value) -> i64 {
        int(&v["header"]["revision"])
    }

    /// One key, and the store's revision at the read.
    pub async fn get(&self, key: &str) -> Result<(Option<KeyValue>, i64), EtcdError> {
        let v = self
            .call("/v3/kv/range", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        let mut kvs = self.opened(Self::kvs("range", &v)?);
        Ok((kvs.pop(), Self::revision(&v)))
    }

    /// Every key under `prefix`, in key order, and the store's revision at
    /// the read (where a watch of the prefix starts).
    pub async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let v = self.range_prefix(prefix).await?;
        Ok((self.opened(Self::kvs("range", &v)?), Self::revision(&v)))
    }

    /// Writes `key` (on `lease` when given); the revision it was written at.
    pub async fn put(&self, key: &str, value: &[u8], lease: Option<i64>) -> Result<i64, EtcdError> {
        let value = self.stored(key, value);
        let mut body = json!({ "key": b64(key.as_bytes()), "value": b64(&value) });
        if let Some(l) = lease {
            body["lease"] = json!(l.to_string());
        }
        let v = self.call("/v3/kv/put", body).await?;
        Ok(Self::revision(&v))
    }

    /// Deletes `key`; whether it existed.
    pub async fn delete(&self, key: &str) -> Result<bool, EtcdError> {
        let v = self
            .call("/v3/kv/deleterange", json!({ "key": b64(key.as_bytes()) }))
            .await?;
        Ok(int(&v["deleted"]) > 0)
    }

    /// Writes `key` only if its last change was at `mod_revision` (0: only
    /// if it does not exist). Whether it was written: two concurrent swaps
    /// from the same revision never both win.
    pub async fn compare_and_swap(
        &self,
        key: &str,
        mod_revision: i64,
        value: &[u8],
        lease: Option<i64>,
    ) -> Result<bool, EtcdError> {
        self.put_if(&[mod_is(key, mod_revision)], key, value, lease)
            .await
    }

    /// Writes `key` only while `guard` is the key created at revision
    /// `created` (a leader key and its fencing token): whether it was
    /// written. A holder whose key lapsed and was taken by another is
    /// refused, whatever it believes.
    pub async fn put_fenced(
        &self,
        guard: &str,
        created: i64,
        key: &str,
        value: &[u8],
    ) -> Result<bool, EtcdError> {
        self.put_if(&[created_at(guard, created)], key, value, None)
            .await
    }

    /// `compare_and_swap` that also requires `guard` to be the key created
    /// at revision `created` (a job's fencing token).
    pub async fn compare_and_swap_fenced(
        &self,
        key: &str,
        mod_revision: i64,
        value: &[u8],
        (guard, created): (&str, i64),
    ) -> Result<bool, EtcdError> {
        let compares = [mod_is(key, mod_revision), created_at(guard, created)];
        self.put_if(&compares, key, value, None).await
    }

    /// A transaction that puts `key` if every comparison holds: whether it
    /// did.
    async fn put_if(
        &self,
        compares: &[Value],
        key: &str,
        value: &[u8],
        lease: Option<i64>,
    ) -> Result<bool, EtcdError> {
        let value = self.stored(key, value);
        let mut put = json!({ "key": b64(key.as_bytes()), "value": b64(&value) });
        if let Some(l) = lease {
            put["lease"] = json!(l.to_string());
        }
        let v = self
            .call(
                "/v3/kv/txn",
                json!({ "compare": compares, "success": [{ "request_put": put }] }),
            )
            .await?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    /// A new lease of `ttl` seconds: (its id, the granted TTL).
    pub async fn lease_grant(&self, ttl: i64) -> Result<(i64, i64), EtcdError> {
        let v = self.call("/v3/lease/grant", json!({ "TTL": ttl })).await?;
        let id = int(&v["ID"]);
        if id == 0 {
            return Err(Self::protocol("lease grant", "no lease id"));
        }
        Ok((id, int(&v["TTL"])))
    }

    /// Renews a lease: the TTL left, 0 when it has already expired (its keys
    /// are gone).
    pub async fn lease_keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        let v = self
            .call("/v3/lease/keepalive", json!({ "ID": id.to_string() }))
            .await?;
        Ok(int(&v["result"]["TTL"]))
    }

    /// Ends a lease now: its keys are deleted.
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        match self
            .call("/v3/lease/revoke", json!({ "ID": id.to_string() }))
            .await
        {
            Ok(_) => Ok(()),
            // Already expired: what revoking wanted.
            Err(EtcdError::Refused { message, .. }) if message.contains("not found") => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// What happened to one key (`Watch::next`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put(KeyValue),
    /// The key, and the revision of its deletion.
    Delete(String, i64),
}

/// A watch of every key under a prefix, from a revision on: changes in the
/// order etcd made them, read from one streaming response.
pub struct Watch {
    seal: Option<Arc<Seal>>,
    auth: Option<Arc<EtcdAuth>>,
    body: hyper::body::Incoming,
    pending: Vec<u8>,
    driver: tokio::task::JoinHandle<()>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// Watch messages longer than this are refused (a runaway stream).
const WATCH_MESSAGE_MAX: usize = 64 << 20;

impl Watch {
    /// The next batch of changes. `Err` ends the watch: the stream broke,
    /// or the revision it started from was compacted away
    /// (`EtcdError::Compacted`): the caller reads everything again and
    /// watches from that read.
    pub async fn next(&mut self) -> Result<Vec<Event>, EtcdError> {
        use hyper::body::Body;
        loop {
            if let Some(nl) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=nl).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let v: Value = serde_json::from_slice(&line)
                    .map_err(|e| Etcd::protocol("watch", e.to_string()))?;
                let Some(result) = v.get("result") else {
                    let message = v["error"]["message"].as_str().unwrap_or("").to_string();
                    if let Some(a) = &self.auth {
                        if token_refused(0, &message) {
                            // The next watch authenticates again.
                            *a.token.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        }
                    }
                    return Err(EtcdError::Refused {
                        call: "watch".into(),
                        status: 200,
                        message,
                    });
                };
                let compacted = int(&result["compact_revision"]);
                if compacted > 0 {
                    return Err(EtcdError::Compacted(compacted));
                }
                if result.get("canceled").and_then(Value::as_bool) == Some(true) {
                    return Err(Etcd::protocol("watch", "canceled by etcd"));
                }
                let Some(list) = result.get("events").and_then(Value::as_array) else {
                    continue;
                };
                let mut events = Vec::with_capacity(list.len());
                for ev in list {
                    let mut kv = Etcd::kvs("watch", &json!({ "kvs": [ev["kv"].clone()] }))?
                        .pop()
                        .ok_or_else(|| Etcd::protocol("watch", "an event without a key"))?;
                    if ev.get("type").and_then(Value::as_str) == Some("DELETE") {
                        events.push(Event::Delete(kv.key, kv.mod_revision));
                        continue;
                    }
                    if let Some(seal) = &self.seal {
                        match seal.open(&kv.key, &kv.value) {
                            Ok(v) => kv.value = v.to_vec(),
                            Err(why) => {
                                seal.note_refused(&kv.key, why);
                                continue;
                            }
                        }
                    }
                    events.push(Event::Put(kv));
                }
                if !events.is_empty() {
                    return Ok(events);
                }
                continue;
            }
            if self.pending.len() > WATCH_MESSAGE_MAX {
                return Err(Etcd::protocol("watch", "a message over 64 MiB"));
            }
            let frame = std::future::poll_fn(|cx| Pin::new(&mut self.body).poll_frame(cx)).await;
            match frame {
                None => return Err(Etcd::protocol("watch", "the stream ended")),
                Some(Err(e)) => return Err(Etcd::protocol("watch", e.to_string())),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.pending.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

impl Etcd {
    /// Watches every key under `prefix` from `revision` on (one after a
    /// full read's revision, so that nothing is missed between the two).
    pub async fn watch_prefix(&self, prefix: &str, revision: i64) -> Result<Watch, EtcdError> {
        let body = Bytes::from(
            serde_json::to_vec(&json!({
                "create_request": {
                    "key": b64(prefix.as_bytes()),
                    "range_end": b64(&prefix_end(prefix.as_bytes())),
                    "start_revision": revision.to_string(),
                }
            }))
            .expect("json"),
        );
        let mut reasons = Vec::new();
        for ep in &self.endpoints {
            // A watch that etcd refuses for its token ends at its first
            // message; the caller watches again, and this takes a new one.
            let Some(token) = self.token_or_reason(ep, false, &mut reasons).await? else {
                continue;
            };
            match tokio::time::timeout(
                self.timeout,
                open_stream(
                    ep,
                    self.tls.as_deref(),
                    "/v3/watch",
                    body.clone(),
                    token.as_deref(),
                ),
            )
            .await
            {
                Ok(Ok((200, body, driver))) => {
                    return Ok(Watch {
                        seal: self.seal.clone(),
                        auth: self.auth.clone(),
                        body,
                        pending: Vec::new(),
                        driver,
                    })
                }
                Ok(Ok((status, _, driver))) => {
                    driver.abort();
                    if let Some(a) = &self.auth {
                        if token_refused(status, "") {
                            *a.token.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        }
                    }
                    return Err(EtcdError::Refused {
                        call: "watch".into(),
                        status,
                        message: String::new(),
                    });
                }
                Ok(Err(e)) => reasons.push(format!("{ep}: {e}")),
                Err(_) => reasons.push(format!("{ep}: no answer in {:?}", self.timeout)),
            }
        }
        Err(EtcdError::Unreachable {
            endpoints: self.endpoints(),
            reason: reasons.join("; "),
        })
    }
}

/// A POST whose response streams: (status, its body, the connection's task).
async fn open_stream(
    hostport: &str,
    tls: Option<&Tls>,
    path: &str,
    body: Bytes,
    token: Option<&str>,
) -> Result<(u16, hyper::body::Incoming, tokio::task::JoinHandle<()>), String> {
    let stream = tokio::net::TcpStream::connect(hostport)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = stream.set_nodelay(true);
    let request = Request {
        hostport,
        path,
        body,
        token,
    };
    match tls {
        None => request.send(hyper_util::rt::TokioIo::new(stream)).await,
        Some(tls) => {
            let stream = tls
                .connector
                .connect(server_name(hostport)?, stream)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            request.send(hyper_util::rt::TokioIo::new(stream)).await
        }
    }
}

/// One POST to etcd, on a connection of either kind.
struct Request<'a> {
    hostport: &'a str,
    path: &'a str,
    body: Bytes,
    token: Option<&'a str>,
}

impl Request<'_> {
    async fn send<I>(
        self,
        io: I,
    ) -> Result<(u16, hyper::body::Incoming, tokio::task::JoinHandle<()>), String>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = http::Request::post(self.path)
            .header(http::header::HOST, self.hostport)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(t) = self.token {
            req = req.header(http::header::AUTHORIZATION, t);
        }
        let req = req
            .body(Full::new(self.body))
            .map_err(|e| format!("request: {e}"))?;
        match sender.send_request(req).await {
            Ok(resp) => Ok((resp.status().as_u16(), resp.into_body(), driver)),
            Err(e) => {
                driver.abort();
                // With the causes: a TLS server that wants a client
                // certificate and got none (or one it does not trust) says
                // so in an alert after the handshake, under hyper's error.
                let mut why = format!("send: {e}");
                let mut cause = std::error::Error::source(&e);
                while let Some(c) = cause {
                    why.push_str(&format!(": {c}"));
                    cause = c.source();
                }
                Err(why)
            }
        }
    }
}

/// One POST on a fresh connection: (status, body).
async fn post(
    hostport: &str,
    tls: Option<&Tls>,
    path: &str,
    body: Bytes,
    token: Option<&str>,
) -> Result<(u16, Bytes), String> {
    let (status, body, driver) = open_stream(hostport, tls, path, body, token).await?;
    let bytes = body.collect().await.map_err(|e| format!("read: {e}"));
    driver.abort();
    Ok((status, bytes?.to_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_prefix_end() {
        let e = Etcd::new(
            "http://127.0.0.1:2379, http://10.0.0.2:2379/",
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(e.endpoints(), "127.0.0.1:2379,10.0.0.2:2379");
        // https:// needs the CA; certificates need https://; no mixing.
        let err = Etcd::new("https://x:1", Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("--etcd-ca"), "{err}");
        let ca = EtcdTls {
            ca: Some("/nonexistent/ca.pem".into()),
            ..EtcdTls::default()
        };
        let err = Etcd::with_tls("http://x:1", Duration::from_secs(1), &ca).unwrap_err();
        assert!(err.contains("https://"), "{err}");
        let err = Etcd::with_tls("https://x:1", Duration::from_secs(1), &ca).unwrap_err();
        assert!(err.contains("/nonexistent/ca.pem"), "{err}");
        let err = Etcd::new("http://x:1,https://y:1", Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("mix"), "{err}");
        assert_eq!(
            server_name("[::1]:2379").unwrap(),
            rustls_pki_types::ServerName::try_from("::1").unwrap()
        );
        assert!(Etcd::new("127.0.0.1:2379", Duration::from_secs(1)).is_err());
        assert!(Etcd::new("", Duration::from_secs(1)).is_err());
        assert_eq!(prefix_end(b"/tarn/a/"), b"/tarn/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
