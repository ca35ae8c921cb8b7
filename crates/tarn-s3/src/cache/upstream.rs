//! The upstream of a cache bucket: an S3 endpoint spoken to over HTTP/1.1
//! (hyper's client connection, on the runtime of the core that asks), each
//! request signed with SigV4 (`tarn_client::sigv4`, unsigned payload).
//! Connections are kept and reused; every request has a deadline for its
//! answer's head and each piece of its body.

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use s3s::dto::{Timestamp, TimestampFormat};
use tarn_client::sigv4::{uri_encode, Signer};
use tokio::sync::mpsc;

pub type ReqBody = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// How long a connection may take to open, and an answer's head to come.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// A body that sends nothing for this long has failed.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept per upstream.
const IDLE_MAX: usize = 64;
/// Largest listing or error document read from the upstream.
const DOC_MAX_BYTES: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The upstream could not be reached or broke off (retryable).
    #[error("upstream {endpoint}: {reason}")]
    Unreachable { endpoint: String, reason: String },
    /// The upstream answered with an error status.
    #[error("upstream answered {status}: {code} {message}")]
    Status {
        status: u16,
        code: String,
        message: String,
    },
    #[error("upstream answer unreadable: {0}")]
    Invalid(String),
}

impl UpstreamError {
    /// Worth another try: the network, or the upstream's own 5xx or 429.
    pub fn transient(&self) -> bool {
        match self {
            UpstreamError::Unreachable { .. } => true,
            UpstreamError::Status { status, .. } => *status >= 500 || *status == 429,
            UpstreamError::Invalid(_) => false,
        }
    }
}

/// What the upstream says about one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamMeta {
    pub etag: String,
    pub size: u64,
    pub last_modified_ns: u64,
    pub version_id: Option<String>,
    pub content_type: String,
    /// Stored response headers (cache-control, content-disposition,
    /// content-encoding, content-language, expires).
    pub headers: Vec<(String, String)>,
    pub user_metadata: Vec<(String, String)>,
}

/// Response headers a cached object keeps and serves.
pub const KEPT_HEADERS: [&str; 5] = [
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "expires",
];

/// A conditional HEAD's answer.
#[derive(Debug)]
pub enum Validation {
    Unchanged,
    Changed(UpstreamMeta),
    Gone,
}

/// One entry of an upstream listing, its key relative to the cache's prefix.
#[derive(Debug, Clone)]
pub struct Listed {
    pub key: String,
    pub etag: String,
    pub size: u64,
    pub last_modified_ns: u64,
}

#[derive(Debug, Default)]
pub struct ListPage {
    pub objects: Vec<Listed>,
    pub prefixes: Vec<String>,
    pub truncated: bool,
    pub next_token: Option<String>,
}

pub struct Upstream {
    /// `http://host:port` as configured.
    pub endpoint: String,
    /// host[:port], as sent in Host and signed.
    host: String,
    /// host:port to connect to.
    connect: String,
    tls: Option<Tls>,
    pub bucket: String,
    /// Prefix of the upstream keys this cache shows ("" or ending in `/`
    /// as configured).
    pub prefix: String,
    signer: Option<Signer>,
    idle: Mutex<Vec<SendRequest<ReqBody>>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Where an endpoint is: its host[:port] as written (sent in Host and
/// signed), the address to connect to (with the scheme's default port), and
/// whether it is `https://`. Other schemes, paths and user info are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddr {
    pub host: String,
    pub connect: String,
    pub tls: bool,
}

pub fn endpoint_addr(endpoint: &str) -> Result<EndpointAddr, String> {
    let (tls, rest) = if let Some(r) = endpoint.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = endpoint.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!(
            "upstream endpoint {endpoint:?} must start with http:// or https://"
        ));
    };
    let host = rest.trim_end_matches('/');
    if host.is_empty() || host.contains('/') || host.contains('@') {
        return Err(format!(
            "upstream endpoint {endpoint:?} must be http[s]://host[:port] with no path"
        ));
    }
    // A port follows the last ':' outside an IPv6 literal's brackets.
    let has_port = match host.rsplit_once(':') {
        Some((h, p)) => {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && (!h.contains(':') || h.ends_with(']'))
        }
        None => false,
    };
    let connect = match has_port {
        true => host.to_string(),
        false => format!("{host}:{}", if tls { 443 } else { 80 }),
    };
    Ok(EndpointAddr {
        host: host.to_string(),
        connect,
        tls,
    })
}

/// rustls's client configuration for an `https://` upstream: the CA
/// certificates of `ca` (PEM) when given, else the system's (which
/// `SSL_CERT_FILE` and `SSL_CERT_DIR` can name).
fn tls_config(ca: Option<&str>) -> Result<rustls::ClientConfig, String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(pem) => {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                let cert = cert.map_err(|e| format!("upstream CA: {e}"))?;
                roots.add(cert).map_err(|e| format!("upstream CA: {e}"))?;
            }
            if roots.is_empty() {
                return Err("upstream CA: no PEM certificate in it".into());
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                // One unusable certificate of the system's does not stop the rest.
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(format!(
                    "no CA certificates found on this system for https upstreams ({}); install ca-certificates, set SSL_CERT_FILE, or give --upstream-ca FILE",
                    found
                        .errors
                        .first()
                        .map_or("none in the usual places".to_string(), |e| e.to_string())
                ));
            }
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// How an `https://` upstream is reached.
struct Tls {
    connector: tokio_rustls::TlsConnector,
    name: rustls_pki_types::ServerName<'static>,
}

/// hyper's HTTP/1.1 client over `io`, its connection driven by a task.
async fn handshake<T>(io: T) -> Result<SendRequest<ReqBody>, hyper::Error>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn http_date_ns(v: &str) -> Option<u64> {
    let t = Timestamp::parse(TimestampFormat::HttpDate, v).ok()?;
    let secs = time::OffsetDateTime::from(t).unix_timestamp();
    u64::try_from(secs).ok().map(|s| s * 1_000_000_000)
}

fn iso_date_ns(v: &str) -> Option<u64> {
    let t = Timestamp::parse(TimestampFormat::DateTime, v).ok()?;
    let ns = time::OffsetDateTime::from(t).unix_timestamp_nanos();
    u64::try_from(ns).ok()
}

impl Upstream {
    /// `ca`: PEM CA certificates an `https://` endpoint's certificate must
    /// chain to (default: the system's).
    pub fn new(
        endpoint: &str,
        bucket: &str,
        prefix: &str,
        region: &str,
        credentials: Option<(String, String)>,
        ca: Option<&str>,
    ) -> Result<Upstream, String> {
        let addr = endpoint_addr(endpoint)?;
        if ca.is_some() && !addr.tls {
            return Err(format!(
                "an upstream CA is for https:// endpoints, not {endpoint}"
            ));
        }
        let tls = match addr.tls {
            false => None,
            true => {
                let bare = addr
                    .connect
                    .rsplit_once(':')
                    .map_or(addr.connect.as_str(), |(h, _)| h)
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                let name = rustls_pki_types::ServerName::try_from(bare.to_string())
                    .map_err(|e| format!("{bare:?} is not a name a certificate can carry: {e}"))?;
                Some(Tls {
                    connector: tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls_config(
                        ca,
                    )?)),
                    name,
                })
            }
        };
        Ok(Upstream {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            host: addr.host,
            connect: addr.connect,
            tls,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            signer: credentials.map(|(access_key, secret_key)| Signer {
                access_key,
                secret_key,
                region: region.to_string(),
                session_token: None,
            }),
            idle: Mutex::new(Vec::new()),
        })
    }

    fn unreachable(&self, reason: impl std::fmt::Display) -> UpstreamError {
        UpstreamError::Unreachable {
            endpoint: self.endpoint.clone(),
            reason: reason.to_string(),
        }
    }

    /// The upstream key of a cache key.
    pub fn key_of(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    async fn connection(&self) -> Result<SendRequest<ReqBody>, UpstreamError> {
        loop {
            let Some(mut s) = self.idle.lock().expect("upstream pool").pop() else {
                break;
            };
            if s.is_closed() {
                continue;
            }
            if s.ready().await.is_ok() {
                return Ok(s);
            }
        }
        let stream = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio::net::TcpStream::connect(&self.connect),
        )
        .await
        .map_err(|_| self.unreachable("connect timed out"))?
        .map_err(|e| self.unreachable(format!("connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        let sender = match &self.tls {
            None => handshake(stream).await,
            Some(tls) => {
                let stream = tokio::time::timeout(
                    CONNECT_TIMEOUT,
                    tls.connector.connect(tls.name.clone(), stream),
                )
                .await
                .map_err(|_| self.unreachable("TLS handshake timed out"))?
                .map_err(|e| self.unreachable(format!("TLS: {e}")))?;
                handshake(stream).await
            }
        };
        sender.map_err(|e| self.unreachable(format!("handshake: {e}")))
    }

    fn give_back(&self, s: SendRequest<ReqBody>) {
        let mut idle = self.idle.lock().expect("upstream pool");
        if idle.len() < IDLE_MAX && !s.is_closed() {
            idle.push(s);
        }
    }

    /// Sends one request; the answer's head, and the connection to give
    /// back once its body is read (`Answer::done`).
    async fn send(
        &self,
        method: &str,
        key: Option<&str>,
        query: &[(&str, &str)],
        headers: &[(&str, String)],
        body: ReqBody,
    ) -> Result<Answer<'_>, UpstreamError> {
        let path = match key {
            Some(k) => format!("/{}/{}", self.bucket, k),
            None => format!("/{}", self.bucket),
        };
        let mut uri = uri_encode(&path, true);
        if !query.is_empty() {
            let q: Vec<String> = query
                .iter()
                .map(|(k, v)| format!("{}={}", uri_encode(k, false), uri_encode(v, false)))
                .collect();
            uri.push('?');
            uri.push_str(&q.join("&"));
        }
        let mut req = http::Request::builder()
            .method(method)
            .uri(uri)
            .header("host", &self.host);
        if let Some(s) = &self.signer {
            for (k, v) in s.sign(method, &self.host, &path, query, unix_now()) {
                req = req.header(k, v);
            }
        }
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req
            .body(body)
            .map_err(|e| UpstreamError::Invalid(format!("request: {e}")))?;
        let mut sender = self.connection().await?;
        let resp = tokio::time::timeout(HEAD_TIMEOUT, sender.send_request(req))
            .await
            .map_err(|_| self.unreachable("no answer in time"))?
            .map_err(|e| self.unreachable(e))?;
        Ok(Answer {
            upstream: self,
            sender: Some(sender),
            resp,
        })
    }

    fn empty() -> ReqBody {
        Empty::new().map_err(|never| match never {}).boxed()
    }

    /// HEAD of one object: None when the upstream has no such key.
    pub async fn head(&self, key: &str) -> Result<Option<UpstreamMeta>, UpstreamError> {
        let key = self.key_of(key);
        let a = self
            .send("HEAD", Some(&key), &[], &[], Self::empty())
            .await?;
        match a.resp.status().as_u16() {
            200 => {
                let m = meta_of(a.resp.headers())?;
                a.done();
                Ok(Some(m))
            }
            404 => {
                a.done();
                Ok(None)
            }
            s => Err(a.error(s).await),
        }
    }

    /// A conditional HEAD: whether the object is still the one with `etag`.
    pub async fn validate(&self, key: &str, etag: &str) -> Result<Validation, UpstreamError> {
        let key = self.key_of(key);
        let a = self
            .send(
                "HEAD",
                Some(&key),
                &[],
                &[("if-none-match", format!("\"{etag}\""))],
                Self::empty(),
            )
            .await?;
        match a.resp.status().as_u16() {
            304 => {
                a.done();
                Ok(Validation::Unchanged)
            }
            200 => {
                let m = meta_of(a.resp.headers())?;
                a.done();
                if m.etag == etag {
                    Ok(Validation::Unchanged)
                } else {
                    Ok(Validation::Changed(m))
                }
            }
            404 => {
                a.done();
                Ok(Validation::Gone)
            }
            s => Err(a.error(s).await),
        }
    }

    /// GET of bytes [start, end) of the object that has `etag`: the body,
    /// or PreconditionFailed (412) when the upstream object changed.
    pub async fn get_range(
        &self,
        key: &str,
        etag: &str,
        start: u64,
        end: u64,
    ) -> Result<RangeBody<'_>, UpstreamError> {
        let key = self.key_of(key);
        let a = self
            .send(
                "GET",
                Some(&key),
                &[],
                &[
                    ("range", format!("bytes={start}-{}", end - 1)),
                    ("if-match", format!("\"{etag}\"")),
                ],
                Self::empty(),
            )
            .await?;
        let status = a.resp.status().as_u16();
        if status != 206 && status != 200 {
            return Err(a.error(status).await);
        }
        // A 200 is the whole object: accepted only when that is the range.
        let first = if status == 200 {
            if start != 0 {
                return Err(UpstreamError::Invalid(
                    "the upstream ignored a Range request".into(),
                ));
            }
            0
        } else {
            let cr = a
                .resp
                .headers()
                .get("content-range")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split_once('-'))
                .and_then(|(a, _)| a.parse::<u64>().ok())
                .ok_or_else(|| UpstreamError::Invalid("206 without a Content-Range".into()))?;
            cr
        };
        if first != start {
            return Err(UpstreamError::Invalid(format!(
                "asked for bytes from {start}, the upstream sent from {first}"
            )));
        }
        let got_etag = a
            .resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim_matches('"').to_string());
        if got_etag.as_deref().is_some_and(|e| e != etag) {
            return Err(UpstreamError::Status {
                status: 412,
                code: "PreconditionFailed".into(),
                message: "the upstream object changed".into(),
            });
        }
        Ok(RangeBody { answer: a })
    }

    /// PUT of `len` bytes from `body`; the upstream's ETag and version id.
    pub async fn put(
        &self,
        key: &str,
        len: u64,
        headers: &[(&str, String)],
        body: ReqBody,
    ) -> Result<(String, Option<String>), UpstreamError> {
        let key = self.key_of(key);
        let mut h = headers.to_vec();
        h.push(("content-length", len.to_string()));
        let a = self.send("PUT", Some(&key), &[], &h, body).await?;
        let status = a.resp.status().as_u16();
        if status != 200 {
            return Err(a.error(status).await);
        }
        let etag = header(a.resp.headers(), "etag")
            .map(|e| e.trim_matches('"').to_string())
            .ok_or_else(|| UpstreamError::Invalid("a PUT answered without an ETag".into()))?;
        let version = header(a.resp.headers(), "x-amz-version-id")
            .filter(|v| *v != "null")
            .map(str::to_string);
        a.text().await?;
        Ok((etag, version))
    }

    /// DELETE of one object (a missing one is no error, as in S3), under
    /// the client's If-Match when it sent one.
    pub async fn delete(
        &self,
        key: &str,
        if_match: Option<String>,
    ) -> Result<Option<String>, UpstreamError> {
        let key = self.key_of(key);
        let h: Vec<(&str, String)> = if_match.map(|m| ("if-match", m)).into_iter().collect();
        let a = self
            .send("DELETE", Some(&key), &[], &h, Self::empty())
            .await?;
        let status = a.resp.status().as_u16();
        if status != 204 && status != 200 {
            return Err(a.error(status).await);
        }
        let version = header(a.resp.headers(), "x-amz-version-id").map(str::to_string);
        a.text().await?;
        Ok(version)
    }

    /// A multipart request passed through (create, part, complete, abort):
    /// the answer's headers and body as the upstream sent them.
    pub async fn multipart(
        &self,
        method: &str,
        key: &str,
        query: &[(&str, &str)],
        headers: &[(&str, String)],
        body: ReqBody,
    ) -> Result<(http::HeaderMap, String), UpstreamError> {
        let key = self.key_of(key);
        let a = self.send(method, Some(&key), query, headers, body).await?;
        let status = a.resp.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(a.error(status).await);
        }
        let h = a.resp.headers().clone();
        Ok((h, a.text().await?))
    }

    pub fn body_of(bytes: Bytes) -> ReqBody {
        http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed()
    }

    /// A request body fed piece by piece; an error sent into it aborts the
    /// request (the upstream never completes it).
    pub fn channel_body(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> ReqBody {
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| {
                (
                    item.map(hyper::body::Frame::data)
                        .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>),
                    rx,
                )
            })
        });
        http_body_util::StreamBody::new(stream).boxed()
    }

    /// One page of a ListObjectsV2 under the cache's prefix; keys come back
    /// relative to it.
    pub async fn list(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        token: Option<&str>,
        start_after: Option<&str>,
        max_keys: i32,
    ) -> Result<ListPage, UpstreamError> {
        let full_prefix = self.key_of(prefix);
        let max = max_keys.clamp(0, 1000).to_string();
        let start = start_after.map(|s| self.key_of(s));
        let mut q: Vec<(&str, &str)> = vec![
            ("list-type", "2"),
            ("encoding-type", "url"),
            ("prefix", &full_prefix),
            ("max-keys", &max),
        ];
        if let Some(d) = delimiter {
            q.push(("delimiter", d));
        }
        if let Some(t) = token {
            q.push(("continuation-token", t));
        }
        if let Some(s) = &start {
            q.push(("start-after", s));
        }
        let a = self.send("GET", None, &q, &[], Self::empty()).await?;
        let status = a.resp.status().as_u16();
        if status != 200 {
            return Err(a.error(status).await);
        }
        let doc = a.text().await?;
        let decode = |s: String| -> Result<String, UpstreamError> {
            urlencoding::decode(&s)
                .map(|c| c.into_owned())
                .map_err(|_| {
                    UpstreamError::Invalid(format!("listing key {s:?} is not URL-encoded UTF-8"))
                })
        };
        let strip =
            |k: String| -> Option<String> { k.strip_prefix(&self.prefix).map(str::to_string) };
        let mut page = ListPage::default();
        for block in xml::blocks(&doc, "Contents") {
            let key = decode(xml::first(block, "Key").unwrap_or_default())?;
            let Some(key) = strip(key) else { continue };
            page.objects.push(Listed {
                key,
                etag: xml::first(block, "ETag")
                    .unwrap_or_default()
                    .trim_matches('"')
                    .to_string(),
                size: xml::first(block, "Size")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0),
                last_modified_ns: xml::first(block, "LastModified")
                    .and_then(|s| iso_date_ns(&s))
                    .unwrap_or(0),
            });
        }
        for block in xml::blocks(&doc, "CommonPrefixes") {
            let p = decode(xml::first(block, "Prefix").unwrap_or_default())?;
            if let Some(p) = strip(p) {
                page.prefixes.push(p);
            }
        }
        page.truncated = xml::first(&doc, "IsTruncated").as_deref() == Some("true");
        page.next_token = xml::first(&doc, "NextContinuationToken");
        Ok(page)
    }
}

use tarn_client::object::xml;

/// An answer in progress: its connection goes back to the pool once the
/// body has been read to the end.
pub struct Answer<'a> {
    upstream: &'a Upstream,
    sender: Option<SendRequest<ReqBody>>,
    pub resp: http::Response<Incoming>,
}

impl Answer<'_> {
    /// The answer had no body to read (HEAD, 304): the connection is free.
    fn done(mut self) {
        if let Some(s) = self.sender.take() {
            self.upstream.give_back(s);
        }
    }

    async fn text(mut self) -> Result<String, UpstreamError> {
        let mut out = Vec::new();
        let body = self.resp.body_mut();
        loop {
            let frame = tokio::time::timeout(BODY_IDLE_TIMEOUT, body.frame())
                .await
                .map_err(|_| self.upstream.unreachable("the answer stalled"))?;
            match frame {
                None => break,
                Some(Err(e)) => return Err(self.upstream.unreachable(e)),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        out.extend_from_slice(&d);
                        if out.len() > DOC_MAX_BYTES {
                            return Err(UpstreamError::Invalid("answer too large".into()));
                        }
                    }
                }
            }
        }
        self.done();
        String::from_utf8(out).map_err(|_| UpstreamError::Invalid("answer is not UTF-8".into()))
    }

    /// An error status: its S3 code and message (the body read, bounded).
    async fn error(self, status: u16) -> UpstreamError {
        let text = if status == 304 {
            Ok(String::new())
        } else {
            self.text().await
        };
        let doc = text.unwrap_or_default();
        UpstreamError::Status {
            status,
            code: xml::first(&doc, "Code").unwrap_or_else(|| status.to_string()),
            message: xml::first(&doc, "Message").unwrap_or_default(),
        }
    }
}

/// The body of a ranged GET, read piece by piece.
pub struct RangeBody<'a> {
    answer: Answer<'a>,
}

impl RangeBody<'_> {
    /// The next piece; None at the end (the connection then goes back).
    pub async fn next(&mut self) -> Option<Result<Bytes, UpstreamError>> {
        loop {
            let frame =
                match tokio::time::timeout(BODY_IDLE_TIMEOUT, self.answer.resp.body_mut().frame())
                    .await
                {
                    Err(_) => {
                        return Some(Err(self.answer.upstream.unreachable("the body stalled")))
                    }
                    Ok(f) => f,
                };
            match frame {
                None => {
                    if let Some(s) = self.answer.sender.take() {
                        self.answer.upstream.give_back(s);
                    }
                    return None;
                }
                Some(Err(e)) => return Some(Err(self.answer.upstream.unreachable(e))),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        if !d.is_empty() {
                            return Some(Ok(d));
                        }
                    }
                }
            }
        }
    }
}

fn header<'a>(h: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

fn meta_of(h: &http::HeaderMap) -> Result<UpstreamMeta, UpstreamError> {
    let etag = header(h, "etag")
        .map(|e| e.trim_matches('"').to_string())
        .filter(|e| !e.is_empty())
        .ok_or_else(|| UpstreamError::Invalid("no ETag".into()))?;
    let size = header(h, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| UpstreamError::Invalid("no Content-Length".into()))?;
    let last_modified_ns = header(h, "last-modified")
        .and_then(http_date_ns)
        .unwrap_or(0);
    let mut user_metadata: Vec<(String, String)> = h
        .iter()
        .filter_map(|(k, v)| {
            let name = k.as_str().strip_prefix("x-amz-meta-")?;
            Some((name.to_string(), v.to_str().ok()?.to_string()))
        })
        .collect();
    user_metadata.sort();
    Ok(UpstreamMeta {
        etag,
        size,
        last_modified_ns,
        version_id: header(h, "x-amz-version-id")
            .filter(|v| *v != "null")
            .map(str::to_string),
        content_type: header(h, "content-type")
            .unwrap_or("binary/octet-stream")
            .to_string(),
        headers: KEPT_HEADERS
            .iter()
            .filter_map(|n| Some((n.to_string(), header(h, n)?.to_string())))
            .collect(),
        user_metadata,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let a = endpoint_addr("http://127.0.0.1:9000").unwrap();
        assert_eq!(
            (a.host.as_str(), a.connect.as_str(), a.tls),
            ("127.0.0.1:9000", "127.0.0.1:9000", false)
        );
        let a = endpoint_addr("http://s3.local/").unwrap();
        assert_eq!(
            (a.host.as_str(), a.connect.as_str()),
            ("s3.local", "s3.local:80")
        );
        let a = endpoint_addr("https://s3.us-west-2.amazonaws.com").unwrap();
        assert_eq!(
            (a.host.as_str(), a.connect.as_str(), a.tls),
            (
                "s3.us-west-2.amazonaws.com",
                "s3.us-west-2.amazonaws.com:443",
                true
            )
        );
        let a = endpoint_addr("https://[::1]").unwrap();
        assert_eq!(a.connect, "[::1]:443");
        let a = endpoint_addr("https://[::1]:9443").unwrap();
        assert_eq!(a.connect, "[::1]:9443");
        assert!(endpoint_addr("ftp://x").is_err());
        assert!(endpoint_addr("http://x/path").is_err());
        assert!(endpoint_addr("http://").is_err());
        assert!(endpoint_addr("https://user@x").is_err());
    }

    #[test]
    fn a_ca_is_only_for_https() {
        assert!(Upstream::new("http://x:1", "b", "", "us-east-1", None, Some("x")).is_err());
        let e =
            Upstream::new("https://x:1", "b", "", "us-east-1", None, Some("not pem")).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
    }

    #[test]
    fn dates() {
        assert_eq!(
            http_date_ns("Thu, 01 Jan 1970 00:00:10 GMT"),
            Some(10_000_000_000)
        );
        assert_eq!(iso_date_ns("1970-01-01T00:00:01.500Z"), Some(1_500_000_000));
    }
}
