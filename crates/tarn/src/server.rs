//! The daemon: one pinned single-threaded runtime per core, each accepting on
//! its own SO_REUSEPORT listener and serving HTTP/1.1 with hyper. A request stays
//! on the core that accepted it.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use s3s::service::S3Service;
use tarn_store::Store;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::conn::{ConnIo, ConnState};
use crate::metrics::{operation, Metrics};

/// Largest request head hyper will buffer.
const REQUEST_HEAD_MAX_BYTES: usize = 64 << 10;
/// Largest total of header names and values we accept (S3 allows 8 KiB of
/// headers plus 2 KiB of user metadata; this leaves room for long presigned
/// query strings, which are not headers).
const REQUEST_HEADERS_MAX_BYTES: usize = 16 << 10;
/// S3's limit on user metadata (x-amz-meta-*), names plus values.
const USER_METADATA_MAX_BYTES: usize = 2 << 10;
/// The largest body of a request that s3s reads whole (XML and JSON
/// documents: DeleteObjects, CompleteMultipartUpload, policies, tags); s3s's
/// own `xml_max_body_size`, which Tarn leaves at its default.
const WHOLE_BODY_MAX_BYTES: u64 = 20 << 20;
/// How long in-flight requests get to finish after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

pub struct ServerSettings {
    /// S3 connections open now, against their caps (`fdlimit`).
    pub connections: Arc<crate::fdlimit::Connections>,
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub cores: usize,
    pub pin: bool,
    pub io_uring: bool,
    pub inflight_requests_max: usize,
    /// Requests in flight of one access key, or of one client address for
    /// anonymous requests: no one caller takes every slot.
    pub inflight_per_key_max: usize,
    /// Bytes per second a request body must arrive at, and a response be
    /// read at, on average over each `rate_window` (0: no minimum).
    pub body_min_rate: u64,
    pub response_min_rate: u64,
    pub rate_window: Duration,
    /// GET data read ahead of one caller's clients (the shared budget is
    /// the store's `read_ahead_max_bytes`).
    pub read_ahead_per_key_max_bytes: usize,
    pub domains: Vec<String>,
    /// The region requests must be signed for.
    pub region: String,
    pub admin_token: String,
    /// Users and their keys, and cache buckets, managed on the admin port.
    pub access: Arc<tarn_s3::access::Access>,
    /// Server-side encryption's keys (the admin port rewraps data keys).
    pub sse_keys: Arc<tarn_s3::sse::KeyRing>,
    pub scan_interval: Option<Duration>,
    /// The lifecycle scanner's pace (docs/lifecycle.md).
    pub lifecycle: tarn_s3::lifecycle::ScanSettings,
    /// The KV engines by tenant and the KV server's connection counts, for
    /// /metrics.
    pub kv: Vec<(String, Arc<tarn_kv::Engine>)>,
    pub kv_connections: Option<Arc<tarn_kv::server::ConnectionCounts>>,
    /// A request body that sends nothing for this long fails (400
    /// RequestTimeout) and gives back what it held.
    pub body_idle_timeout: Duration,
    /// A response the client reads nothing of for this long is aborted
    /// (the connection reset).
    pub send_idle_timeout: Duration,
    /// The admin listener when already bound (a cluster node serves its
    /// admin port while it waits for the cluster to be formed).
    pub admin_bound: Option<std::net::TcpListener>,
    /// This server as a node of a cluster.
    pub cluster: Option<Arc<tarn_cluster::node::Node>>,
    /// TLS on the S3 and admin listeners (None: plain HTTP).
    pub tls: Option<Arc<tarn_io::tls::ServerCert>>,
    /// Serve short-circuit reads to clients on this host, pinning each
    /// grant this long (None: off).
    pub local_read_lease: Option<Duration>,
    /// Send GET bytes read from this node's shard files from the files
    /// (`tarn_io::spans`) on plain connections.
    pub sendfile: bool,
    /// Switch connections from this host off a pacing congestion control
    /// (`tarn_io::net::unpace_local`).
    pub unpace_local: bool,
    /// Fill the page cache in large folios for GETs (`tarn_io::pagecache`).
    pub large_folios: bool,
}

/// Defaults of the two (docs/configuration.md).
pub const BODY_IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// The default minimum rate of request bodies and responses, bytes/s.
pub const MIN_RATE_DEFAULT_BYTES: u64 = 1024;
/// The default window minimum rates are averaged over.
pub const RATE_WINDOW_DEFAULT: Duration = Duration::from_secs(20);
pub const SEND_IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
/// How often freed memory is handed back to the kernel.
const MEMORY_TRIM_INTERVAL: Duration = Duration::from_secs(5);

/// Refuses an address another process listens on. The S3 listeners use
/// SO_REUSEPORT (one per core), which would let a second server on the same
/// port start and take most of the connections, serving its own (empty)
/// store: a plain bind first finds any listener already there.
fn check_address_free(addr: SocketAddr) -> anyhow::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    match tcp_socket(addr)?.bind(&addr.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            anyhow::bail!("another process is already listening on {addr} (another tarn server?)")
        }
        Err(e) => Err(e).with_context(|| format!("binding {addr}")),
    }
}

/// Claims `addr` for this server for as long as the returned socket lives: an
/// abstract Unix socket named after it, which only one process can bind (the
/// kernel releases it when the process exits, however it exits). It closes the
/// window between two servers' free-address checks.
pub fn claim_address(
    what: &str,
    addr: SocketAddr,
) -> anyhow::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("tarn-{what}.{addr}");
    let unix = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    std::os::unix::net::UnixListener::bind_addr(&unix).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!("another tarn server is already serving {what} on {addr}")
        } else {
            anyhow::Error::new(e).context(format!("claiming {addr}"))
        }
    })
}

/// A TCP socket for `addr` with SO_REUSEADDR, not yet bound.
fn tcp_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    Ok(socket)
}

/// An S3 listener of its own for a core, on `addr` with `SO_REUSEPORT`.
/// A pacing congestion control is switched off before it listens
/// (`tarn_io::net::unpace_listener`): a connection from this host that
/// reached the backlog before the switch would keep BBR's pacing.
fn bind_reuseport(
    addr: SocketAddr,
) -> anyhow::Result<(std::net::TcpListener, tarn_io::net::ListenerPacing)> {
    let socket = tcp_socket(addr)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    let pacing = tarn_io::net::unpace_listener(std::os::fd::AsRawFd::as_raw_fd(&socket));
    socket.listen(1024)?;
    Ok((socket.into(), pacing))
}

/// Wraps the S3 service with admission control and metrics.
#[derive(Clone)]
struct Front {
    s3: S3Service,
    metrics: Arc<Metrics>,
    inflight_max: usize,
    /// Requests in flight by caller, against `inflight_per_key_max`.
    shares: Arc<Shares>,
    body_min_rate: (u64, Duration),
    domains: Arc<Vec<String>>,
    region: Arc<str>,
    body_idle: Duration,
    request_ids: Arc<RequestIds>,
    /// The connection's client (for the `aws:SourceIp` policy condition).
    peer: Option<std::net::IpAddr>,
    /// The connection's TLS version, None when plain (`aws:SecureTransport`,
    /// `s3:TlsVersion`).
    tls: Option<&'static str>,
    /// Buckets' settings (their CORS rules).
    access: Arc<tarn_s3::access::Access>,
    /// The local-read socket's name, when reads are served locally.
    local_reads: Option<Arc<str>>,
    /// Set per connection when its client is on this host: object
    /// responses name the local-read socket.
    local_peer: bool,
}

/// Requests in flight by caller: an access key, or for anonymous
/// requests the client's address.
struct Shares {
    max: usize,
    held: Mutex<std::collections::HashMap<String, usize>>,
    /// Each caller's read-ahead budget (pieces of
    /// `tarn_store::store::read_ahead_pieces`), shared by its GETs.
    read_ahead_pieces: usize,
    budgets: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Semaphore>>>,
}

/// One request's slot in its caller's share, given back when dropped.
struct ShareSlot(Arc<Shares>, String);

impl Shares {
    /// `caller`'s read-ahead budget.
    fn budget(&self, caller: &str) -> Arc<tokio::sync::Semaphore> {
        let mut b = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() > 10_000 {
            // Callers with nothing read ahead now start afresh.
            b.retain(|_, s| Arc::strong_count(s) > 1);
        }
        b.entry(caller.to_string())
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.read_ahead_pieces)))
            .clone()
    }

    fn admit(self: &Arc<Self>, caller: String) -> Option<ShareSlot> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let n = held.entry(caller.clone()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(ShareSlot(self.clone(), caller))
    }
}

impl Drop for ShareSlot {
    fn drop(&mut self) {
        let mut held = self.0.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.1);
            }
        }
    }
}

/// Who a request says it comes from, for its share of the in-flight slots:
/// the access key it names (SigV4 or SigV2, header or query; a false claim
/// is refused at the signature check, before any body is read), else its
/// client's address.
fn caller_of<B>(req: &http::Request<B>, peer: Option<std::net::IpAddr>) -> String {
    if let Some(auth) = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        if let Some(i) = auth.find("Credential=") {
            let rest = &auth[i + "Credential=".len()..];
            return format!("key:{}", rest.split('/').next().unwrap_or(""));
        }
        if let Some(rest) = auth.strip_prefix("AWS ") {
            return format!("key:{}", rest.split(':').next().unwrap_or(""));
        }
    }
    if let Some(q) = req.uri().query() {
        for pair in q.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k == "X-Amz-Credential" {
                let v = v.replace("%2F", "/").replace("%2f", "/");
                return format!("key:{}", v.split('/').next().unwrap_or(""));
            }
            if k == "AWSAccessKeyId" {
                return format!("key:{v}");
            }
        }
    }
    match peer {
        Some(ip) => format!("anon:{ip}"),
        None => "anon".into(),
    }
}

/// Request ids: unique in this process (a random start, then a bijection of
/// a counter), 16 hex digits as S3's.
struct RequestIds {
    seed: u64,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        RequestIds {
            seed: h.finish(),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016X}", self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// A form upload whose key named `${filename}`: s3s made its 201 body or
/// 303 redirect from the form's key as given; the name goes in.
fn post_filename(r: &mut Resp) {
    use tarn_s3::post::{percent_decode, percent_encode, FILENAME_HEADER};
    policy_condition_refused(r);
    let Some(v) = r.headers_mut().remove(FILENAME_HEADER) else {
        return;
    };
    let Some(name) = v.to_str().ok().and_then(percent_decode) else {
        return;
    };
    if let Some(loc) = r
        .headers()
        .get(http::header::LOCATION)
        .and_then(|l| l.to_str().ok())
    {
        let fixed = loc.replace("%24%7Bfilename%7D", &percent_encode(&name));
        if let Ok(v) = http::HeaderValue::from_str(&fixed) {
            r.headers_mut().insert(http::header::LOCATION, v);
        }
    }
    let Some(body) = r.body().bytes() else { return };
    if find(&body, b"${filename}").is_none() {
        return;
    }
    let escaped = name
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&apos;");
    let out = String::from_utf8_lossy(&body).replace("${filename}", &escaped);
    replace_body(r, out);
}

/// GetObjectAttributes names the ETag without quotes (AWS's answer; every
/// other ETag in S3 is quoted, and s3s quotes this one too).
fn unquote_attributes_etag(r: &mut Resp) {
    if r.status() != http::StatusCode::OK {
        return;
    }
    let Some(body) = r.body().bytes() else { return };
    let text = String::from_utf8_lossy(&body);
    let (Some(a), Some(b)) = (text.find("<ETag>\""), text.find("\"</ETag>")) else {
        return;
    };
    if b < a {
        return;
    }
    let out = format!(
        "{}<ETag>{}</ETag>{}",
        &text[..a],
        &text[a + 7..b],
        &text[b + 8..]
    );
    replace_body(r, out);
}

/// A form whose field fails its policy's condition: S3 answers 403
/// AccessDenied ("Invalid according to Policy"); s3s 400
/// InvalidPolicyDocument, which S3 keeps for a policy it cannot read.
fn policy_condition_refused(r: &mut Resp) {
    if r.status() != http::StatusCode::BAD_REQUEST {
        return;
    }
    let Some(body) = r.body().bytes() else { return };
    let text = String::from_utf8_lossy(&body);
    if !text.contains("<Code>InvalidPolicyDocument</Code>")
        || !text.contains("<Message>Policy condition ")
    {
        return;
    }
    let out = text
        .replace(
            "<Code>InvalidPolicyDocument</Code>",
            "<Code>AccessDenied</Code>",
        )
        .replace(
            "<Message>Policy condition ",
            "<Message>Invalid according to Policy: Policy condition ",
        );
    *r.status_mut() = http::StatusCode::FORBIDDEN;
    replace_body(r, out);
}

/// Puts a rewritten body into a response, its Content-Length (if it has
/// one) kept true.
fn replace_body(r: &mut Resp, out: impl Into<Vec<u8>>) {
    let out: Vec<u8> = out.into();
    if r.headers().contains_key(http::header::CONTENT_LENGTH) {
        r.headers_mut().insert(
            http::header::CONTENT_LENGTH,
            http::HeaderValue::from(out.len()),
        );
    }
    *r.body_mut() = s3s::Body::from(out);
}

/// Every response carries `x-amz-request-id`; an error body also names it in
/// `<RequestId>`, as S3's do (clients log it, support asks for it), and a
/// failed precondition its `<Condition>` (clients tell "exists" from
/// "changed" by it).
fn stamp_request_id(r: &mut Resp, id: &str) {
    let condition = r.headers_mut().remove(tarn_s3::error::CONDITION_HEADER);
    let bucket = r.headers_mut().remove(tarn_s3::error::BUCKET_NAME_HEADER);
    let Ok(v) = http::HeaderValue::from_str(id) else {
        return;
    };
    r.headers_mut().insert("x-amz-request-id", v);
    if r.status().as_u16() < 400 {
        return;
    }
    let Some(body) = r.body().bytes() else { return };
    let Some(end) = find(&body, b"</Error>") else {
        return;
    };
    let message = match find(&body, b"<Message>") {
        Some(_) => None,
        None => Some(default_message(&body)),
    };
    let condition = condition.filter(|_| find(&body, b"<Condition>").is_none());
    let bucket = bucket.filter(|_| find(&body, b"<BucketName>").is_none());
    if find(&body, b"<RequestId>").is_some()
        && message.is_none()
        && condition.is_none()
        && bucket.is_none()
    {
        return;
    }
    let mut out = Vec::with_capacity(body.len() + id.len() + 128);
    out.extend_from_slice(&body[..end]);
    if let Some(m) = message {
        out.extend_from_slice(format!("<Message>{m}</Message>").as_bytes());
    }
    if let Some(c) = condition {
        out.extend_from_slice(b"<Condition>");
        out.extend_from_slice(c.as_bytes());
        out.extend_from_slice(b"</Condition>");
    }
    if let Some(b) = bucket {
        // Bucket names are letters, digits, dots and hyphens; escaped all
        // the same.
        let name = String::from_utf8_lossy(b.as_bytes())
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        out.extend_from_slice(format!("<BucketName>{name}</BucketName>").as_bytes());
    }
    if find(&body, b"<RequestId>").is_none() {
        out.extend_from_slice(format!("<RequestId>{id}</RequestId>").as_bytes());
    }
    out.extend_from_slice(&body[end..]);
    replace_body(r, out);
}

/// S3's message for an error whose body has none (s3s answers some of its
/// own refusals, an invalid bucket name among them, with a code only).
fn default_message(body: &[u8]) -> &'static str {
    let code = find(body, b"<Code>")
        .and_then(|a| {
            let rest = &body[a + 6..];
            find(rest, b"</Code>").map(|b| &rest[..b])
        })
        .unwrap_or_default();
    match code {
        b"InvalidBucketName" => "The specified bucket is not valid.",
        b"NoSuchBucket" => "The specified bucket does not exist",
        b"NoSuchKey" => "The specified key does not exist.",
        b"MethodNotAllowed" => "The specified method is not allowed against this resource.",
        b"MalformedXML" => "The XML you provided was not well-formed or did not validate against our published schema.",
        b"AccessDenied" => "Access Denied",
        b"NotImplemented" => "A header or operation you provided implies functionality that is not implemented.",
        b"SignatureDoesNotMatch" => "The request signature we calculated does not match the signature you provided. Check your key and signing method.",
        b"InvalidURI" => "Couldn't parse the specified URI.",
        b"InvalidArgument" => "Invalid Argument",
        b"InvalidRequest" => "Invalid Request",
        _ => "The request could not be served.",
    }
}

/// An ACL body that is not valid XML is `MalformedACLError` in S3, not the
/// generic `MalformedXML` the XML layer answers.
fn malformed_acl(r: &mut Resp) {
    if r.status() != http::StatusCode::BAD_REQUEST {
        return;
    }
    let Some(body) = r.body().bytes() else { return };
    let from: &[u8] = b"<Code>MalformedXML</Code>";
    let Some(at) = find(&body, from) else { return };
    let mut out = body[..at].to_vec();
    out.extend_from_slice(b"<Code>MalformedACLError</Code>");
    out.extend_from_slice(&body[at + from.len()..]);
    replace_body(r, out);
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The error a request body gives when the client stops sending it; the S3
/// layer answers it with 400 RequestTimeout (`tarn_s3::body::body_error`).
#[derive(Debug)]
struct BodyIdle(Duration);

impl std::fmt::Display for BodyIdle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: nothing for {}s",
            tarn_s3::body::BODY_IDLE_MESSAGE,
            self.0.as_secs()
        )
    }
}

impl std::error::Error for BodyIdle {}

/// A request body with an idle timeout, which also records whether it was
/// read to its end (a response to a request whose body was not read closes
/// the connection).
struct IdleBody {
    inner: Incoming,
    idle: Duration,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    done: Arc<AtomicBool>,
    /// Bytes over which the body is ended (`u64::MAX`: no limit) and
    /// whether it went past [`WHOLE_BODY_MAX_BYTES`]: s3s answers a body
    /// over its own limit with 500 when it arrives in pieces, so the front
    /// answers that 500 with 400 MaxMessageLengthExceeded.
    limit: u64,
    seen: u64,
    over: Arc<AtomicBool>,
    /// The minimum rate (bytes/s, 0: none), and the current window's start
    /// and bytes.
    min_rate: (u64, Duration),
    window: Option<(Instant, u64)>,
    /// A form upload's body: read for its file's name as it passes.
    tap: Option<tarn_s3::post::FileNameTap>,
}

/// The error a whole-read body gives past [`WHOLE_BODY_MAX_BYTES`].
#[derive(Debug)]
struct BodyTooLarge;

impl std::fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request body over {WHOLE_BODY_MAX_BYTES} bytes")
    }
}

impl std::error::Error for BodyTooLarge {}

fn too_large() -> Resp {
    error_response(
        http::StatusCode::BAD_REQUEST,
        "MaxMessageLengthExceeded",
        "Your request was too big.",
    )
}

impl IdleBody {
    /// Counts `n` more bytes: whether the window that just closed carried
    /// less than the minimum rate.
    fn too_slow(&mut self, n: u64) -> bool {
        let (rate, window) = self.min_rate;
        if rate == 0 {
            return false;
        }
        let (start, bytes) = self.window.get_or_insert((Instant::now(), 0));
        *bytes += n;
        if start.elapsed() < window {
            return false;
        }
        let slow = (*bytes as f64) < rate as f64 * window.as_secs_f64();
        self.window = Some((Instant::now(), 0));
        slow
    }
}

/// The error of a request body that arrives slower than the minimum rate;
/// answered, as an idle one, 400 RequestTimeout.
#[derive(Debug)]
struct BodyTooSlow((u64, Duration));

impl std::fmt::Display for BodyTooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: slower than {} bytes/s over {}s",
            tarn_s3::body::BODY_IDLE_MESSAGE,
            self.0 .0,
            self.0 .1.as_secs_f64()
        )
    }
}

impl std::error::Error for BodyTooSlow {}

impl hyper::body::Body for IdleBody {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.done.store(true, Ordering::Relaxed);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.timer = None;
                if let Some(d) = frame.data_ref() {
                    if this.too_slow(d.len() as u64) {
                        return Poll::Ready(Some(Err(Box::new(BodyTooSlow(this.min_rate)))));
                    }
                    this.seen += d.len() as u64;
                    if let Some(t) = &mut this.tap {
                        t.feed(d);
                    }
                    if this.seen > WHOLE_BODY_MAX_BYTES && this.limit != u64::MAX {
                        // Over s3s's limit if these are the document's
                        // own bytes, not aws-chunked framing: s3s decides,
                        // and its 500 for it becomes a 400.
                        this.over.store(true, Ordering::Relaxed);
                    }
                    if this.seen > this.limit {
                        return Poll::Ready(Some(Err(Box::new(BodyTooLarge))));
                    }
                }
                if hyper::body::Body::is_end_stream(&this.inner) {
                    this.done.store(true, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyIdle(idle))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

/// Marks a response that is sent before its request's body was read: the
/// connection closes after it (its framing is lost), cleanly, with the
/// unread body drained (conn.rs) so that the client gets the answer.
fn close_after(r: &mut Resp) {
    r.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
}

type Resp = http::Response<s3s::Body>;

fn error_response(status: http::StatusCode, code: &str, message: &str) -> Resp {
    let body = format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>");
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    r
}

/// A request signed for another region, or a presigned URL valid too long.
fn scope_error(e: tarn_s3::scope::ScopeError) -> Resp {
    let mut body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{}</Code><Message>{}</Message>",
        e.code, e.message
    );
    if let Some(r) = &e.region {
        body.push_str(&format!("<Region>{r}</Region>"));
    }
    body.push_str("</Error>");
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() = http::StatusCode::BAD_REQUEST;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    if let Some(v) = e.region.and_then(|r| http::HeaderValue::from_str(&r).ok()) {
        r.headers_mut().insert("x-amz-bucket-region", v);
    }
    r
}

fn slow_down() -> Resp {
    let mut r = error_response(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "SlowDown",
        "Please reduce your request rate.",
    );
    r.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    r
}

/// Rejects oversized header sections before any parsing or authentication.
fn check_header_sizes(headers: &http::HeaderMap) -> Option<Resp> {
    let mut total = 0;
    let mut meta = 0;
    for (name, value) in headers {
        let n = name.as_str().len() + value.len();
        total += n;
        if let Some(m) = name.as_str().strip_prefix("x-amz-meta-") {
            meta += m.len() + value.len();
        }
    }
    if total > REQUEST_HEADERS_MAX_BYTES {
        return Some(error_response(
            http::StatusCode::BAD_REQUEST,
            "RequestHeaderSectionTooLarge",
            "Your request header section exceeds the maximum allowed size.",
        ));
    }
    if meta > USER_METADATA_MAX_BYTES {
        return Some(error_response(
            http::StatusCode::BAD_REQUEST,
            "MetadataTooLarge",
            "Your metadata headers exceed the maximum allowed metadata size.",
        ));
    }
    None
}

/// SigV2 signs a path-style request for a bucket as `/bucket/` (AWS's
/// CanonicalizedResource; botocore and s3cmd sign it so) while the request
/// goes to `/bucket`, and s3s signs the path as sent: such a request's path
/// gets its trailing slash, the same bucket to s3s.
fn sigv2_bucket_path<B>(req: &mut http::Request<B>, bucket_in_host: bool) {
    let v2_header = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .is_some_and(|v| v.as_bytes().starts_with(b"AWS "));
    let v2_query = req.uri().query().is_some_and(|q| {
        q.split('&')
            .any(|p| p.split_once('=').map_or(p, |(k, _)| k) == "Signature")
    });
    let path = req.uri().path();
    let one_segment = path.len() > 1 && path.starts_with('/') && !path[1..].contains('/');
    if !(v2_header || v2_query) || bucket_in_host || !one_segment {
        return;
    }
    let target = match req.uri().query() {
        Some(q) => format!("{path}/?{q}"),
        None => format!("{path}/"),
    };
    let mut parts = req.uri().clone().into_parts();
    if let Ok(pq) = http::uri::PathAndQuery::try_from(target) {
        parts.path_and_query = Some(pq);
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
}

impl Front {
    /// An OPTIONS preflight, answered from the bucket's CORS rules without
    /// credentials (as S3 answers it).
    fn preflight(&self, bucket: Option<&str>, origin: Option<&str>, h: &http::HeaderMap) -> Resp {
        let forbidden = |m: &str| error_response(http::StatusCode::FORBIDDEN, "AccessForbidden", m);
        let method = h
            .get("access-control-request-method")
            .and_then(|v| v.to_str().ok());
        let (Some(origin), Some(method)) = (origin, method) else {
            return error_response(
                http::StatusCode::BAD_REQUEST,
                "BadRequest",
                "Insufficient information. Origin request header needed.",
            );
        };
        let Some(cors) = bucket
            .and_then(|b| self.access.bucket(b))
            .and_then(|b| b.doc.cors.clone())
        else {
            return forbidden("CORSResponse: CORS is not enabled for this bucket.");
        };
        let asked = h
            .get("access-control-request-headers")
            .and_then(|v| v.to_str().ok());
        let headers = tarn_s3::cors::requested_headers(asked);
        let Some(rule) = cors.matching(origin, method, &headers) else {
            return forbidden("CORSResponse: This CORS request is not allowed. This is usually because the evalution of Origin, request method / Access-Control-Request-Method or Access-Control-Request-Headers are not whitelisted by the resource's CORS spec.");
        };
        let mut r = http::Response::new(s3s::Body::empty());
        for (k, v) in rule.headers_for(origin, asked) {
            if let Ok(v) = http::HeaderValue::from_str(&v) {
                r.headers_mut().insert(k, v);
            }
        }
        r.headers_mut()
            .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
        r
    }
}

impl hyper::service::Service<http::Request<Incoming>> for Front {
    type Response = Resp;
    type Error = s3s::HttpError;
    type Future = Pin<Box<dyn Future<Output = Result<Resp, s3s::HttpError>> + Send>>;

    fn call(&self, mut req: http::Request<Incoming>) -> Self::Future {
        if let Some(ip) = self.peer {
            req.extensions_mut().insert(tarn_s3::access::ClientAddr(ip));
        }
        if let Some(version) = self.tls {
            req.extensions_mut()
                .insert(tarn_s3::access::SecureTransport(version));
        }
        let metrics = self.metrics.clone();
        let request_id = self.request_ids.next();
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let host_name = host.rsplit_once(':').map_or(host, |(h, _)| h);
        let bucket_in_host = self
            .domains
            .iter()
            .any(|d| host_name.len() > d.len() && host_name.ends_with(&format!(".{d}")));
        let host_bucket = self
            .domains
            .iter()
            .find_map(|d| host_name.strip_suffix(&format!(".{d}")))
            .map(str::to_string);
        sigv2_bucket_path(&mut req, bucket_in_host);
        let op = operation(
            req.method(),
            req.uri().path(),
            req.uri().query().unwrap_or(""),
            bucket_in_host,
            req.headers().contains_key("x-amz-copy-source"),
        );
        // CORS: the bucket a browser request names, and the rule that lets
        // its origin in (its headers go on the response, errors too).
        let bucket = if bucket_in_host {
            host_bucket
        } else {
            req.uri()
                .path()
                .trim_start_matches('/')
                .split('/')
                .next()
                .filter(|b| !b.is_empty())
                .map(str::to_string)
        };
        let origin = req
            .headers()
            .get(http::header::ORIGIN)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if req.method() == http::Method::OPTIONS {
            let mut r = self.preflight(bucket.as_deref(), origin.as_deref(), req.headers());
            metrics.record(op, r.status().as_u16(), Duration::ZERO);
            stamp_request_id(&mut r, &request_id);
            return Box::pin(async move { Ok(r) });
        }
        let cors: Vec<(&'static str, String)> = match (&bucket, &origin) {
            (Some(b), Some(o)) => self
                .access
                .bucket(b)
                .and_then(|a| {
                    a.doc
                        .cors
                        .as_ref()
                        .and_then(|c| c.matching(o, req.method().as_str(), &[]))
                        .map(|r| r.headers_for(o, None))
                })
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let declared_in = req
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        let has_body =
            declared_in > 0 || req.headers().contains_key(http::header::TRANSFER_ENCODING);
        // Bodies that s3s reads whole into memory; object data (a form
        // upload's too) streams.
        let whole_body = !matches!(op, "PutObject" | "UploadPart" | "PostObject" | "Other");
        let declared_payload = req
            .headers()
            .get("x-amz-decoded-content-length")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(declared_in);
        let early = |mut r: Resp| {
            if has_body {
                close_after(&mut r);
            }
            stamp_request_id(&mut r, &request_id);
            r
        };
        if let Some(r) = check_header_sizes(req.headers()) {
            metrics.record(op, 400, Duration::ZERO);
            let r = early(r);
            return Box::pin(async move { Ok(r) });
        }
        if crate::metrics::unrouted(op) {
            metrics.record(op, 501, Duration::ZERO);
            let r = early(error_response(
                http::StatusCode::NOT_IMPLEMENTED,
                "NotImplemented",
                &format!("{op} is not implemented by this server"),
            ));
            return Box::pin(async move { Ok(r) });
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if let Err(e) = tarn_s3::scope::check(req.headers(), req.uri().query(), &self.region, now) {
            metrics.record(op, 400, Duration::ZERO);
            let r = early(scope_error(e));
            return Box::pin(async move { Ok(r) });
        }
        if whole_body && declared_payload > WHOLE_BODY_MAX_BYTES {
            metrics.record(op, 400, Duration::ZERO);
            let r = early(too_large());
            return Box::pin(async move { Ok(r) });
        }
        // Admission control: answer quickly instead of queueing without bound.
        let inflight = metrics.inflight.fetch_add(1, Ordering::Relaxed) + 1;
        if inflight as usize > self.inflight_max {
            metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            metrics.rejected_overload.fetch_add(1, Ordering::Relaxed);
            metrics.record(op, 503, Duration::ZERO);
            let r = early(slow_down());
            return Box::pin(async move { Ok(r) });
        }
        // One caller's share: the others keep slots however many requests
        // it holds open.
        let caller = caller_of(&req, self.peer);
        let read_ahead = self.shares.budget(&caller);
        let Some(share) = self.shares.admit(caller) else {
            metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            metrics.rejected_share.fetch_add(1, Ordering::Relaxed);
            metrics.record(op, 503, Duration::ZERO);
            let r = early(slow_down());
            return Box::pin(async move { Ok(r) });
        };
        let start = Instant::now();
        let body_done = Arc::new(AtomicBool::new(false));
        let (idle, done) = (self.body_idle, body_done.clone());
        let over = Arc::new(AtomicBool::new(false));
        // An aws-chunked body carries its chunk framing too (under 1%).
        let limit = if whole_body {
            WHOLE_BODY_MAX_BYTES + WHOLE_BODY_MAX_BYTES / 64
        } else {
            u64::MAX
        };
        let body_over = over.clone();
        let min_rate = self.body_min_rate;
        let mut req = req;
        // A plain connection sends a GET's blocks from their files, and
        // nothing reads them on the way: they may go as views of the files
        // (`tarn_io::view`). TLS reads every byte to encrypt it.
        if op == "GetObject" && self.tls.is_none() && tarn_io::spans::enabled() {
            req.extensions_mut()
                .insert(tarn_store::store::SendsFromFiles);
        }
        let tap = if op == "PostObject" {
            req.headers()
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(tarn_s3::post::FileNameTap::for_content_type)
                .map(|(tap, name)| {
                    req.extensions_mut().insert(name);
                    tap
                })
        } else {
            None
        };
        let req = req.map(move |inner| {
            s3s::Body::http_body(IdleBody {
                inner,
                idle,
                timer: None,
                done,
                limit,
                seen: 0,
                over: body_over,
                min_rate,
                window: None,
                tap,
            })
        });
        let s3 = self.s3.clone();
        let local_reads = self.local_reads.clone().filter(|_| self.local_peer);
        Box::pin(async move {
            let mut res = tarn_store::store::CALLER_READ_AHEAD
                .scope(read_ahead, s3.call(req))
                .await;
            metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            drop(share);
            let failed = match &res {
                Ok(r) => r.status().is_server_error(),
                Err(_) => true,
            };
            if over.load(Ordering::Relaxed) && failed {
                let mut r = too_large();
                close_after(&mut r);
                res = Ok(r);
            }
            if let Ok(r) = res.as_mut() {
                if has_body && !body_done.load(Ordering::Relaxed) {
                    close_after(r);
                }
                if matches!(op, "PutBucketAcl" | "PutObjectAcl") {
                    malformed_acl(r);
                }
                if op == "PostObject" {
                    post_filename(r);
                }
                if op == "GetObjectAttributes" {
                    unquote_attributes_etag(r);
                }
                if let Some(name) = &local_reads {
                    if matches!(op, "GetObject" | "HeadObject") && r.status().is_success() {
                        if let Ok(v) = http::HeaderValue::from_str(name) {
                            r.headers_mut().insert(tarn_wire::local::HEADER, v);
                        }
                    }
                }
                for (k, v) in &cors {
                    if let Ok(v) = http::HeaderValue::from_str(v) {
                        r.headers_mut().insert(*k, v);
                    }
                }
                stamp_request_id(r, &request_id);
            }
            match &res {
                Ok(r) => {
                    let out = r
                        .headers()
                        .get(http::header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                    metrics.record_with(
                        op,
                        r.status().as_u16(),
                        start.elapsed(),
                        (declared_in, out),
                    );
                    if r.status().is_server_error() {
                        tracing::warn!(op, status = r.status().as_u16(), "request failed");
                    }
                }
                Err(_) => metrics.record_with(op, 500, start.elapsed(), (declared_in, 0)),
            }
            res
        })
    }
}

/// Runs the server until SIGTERM/SIGINT. Blocks the calling thread.
pub fn run(store: Arc<Store>, s3: S3Service, mut settings: ServerSettings) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    let _ = metrics.connections.set(settings.connections.clone());
    if !settings.kv.is_empty() {
        let _ = metrics.kv.set(settings.kv.clone());
    }
    if let Some(c) = &settings.kv_connections {
        let _ = metrics.kv_connections.set(c.clone());
    }
    // Bind the first listener to learn the port (the flag may say :0), then give
    // every core its own listener on that same port.
    check_address_free(settings.listen)?;
    // No pacing to clients on this host: loopback has no link to pace for,
    // and a pacing congestion control's timers cost a quarter of a large
    // GET's CPU (`tarn_io::net`).
    tarn_io::net::set_unpace_local(settings.unpace_local);
    let first = bind_reuseport(settings.listen)?;
    let addr = first.0.local_addr()?;
    let _claim = claim_address("s3", addr)?;
    let mut listeners = vec![first];
    for _ in 1..settings.cores {
        listeners.push(bind_reuseport(addr)?);
    }
    let admin = match settings.admin_bound.take() {
        Some(bound) => bound,
        None => std::net::TcpListener::bind(settings.admin_listen)
            .with_context(|| format!("binding admin {}", settings.admin_listen))?,
    };
    admin.set_nonblocking(true)?;
    let admin_addr = admin.local_addr()?;
    tarn_io::spans::set_enabled(settings.sendfile);
    tarn_io::pagecache::set_enabled(settings.large_folios);
    let local_reads = match settings.local_read_lease {
        Some(lease) => Some(
            crate::local_read::LocalReads::bind(
                store.clone(),
                settings.access.clone(),
                addr.port(),
                lease,
            )
            .context("binding the local-read socket")?,
        ),
        None => None,
    };
    if let Some((l, _)) = &local_reads {
        let _ = metrics.local_reads.set(l.clone());
    }
    let mut local_reads_listener = local_reads;

    let (stop_tx, stop_rx) = watch::channel(false);
    let front = Front {
        s3,
        metrics: metrics.clone(),
        inflight_max: settings.inflight_requests_max,
        shares: Arc::new(Shares {
            max: settings.inflight_per_key_max,
            held: Mutex::default(),
            read_ahead_pieces: tarn_store::store::read_ahead_pieces(
                settings.read_ahead_per_key_max_bytes,
            ),
            budgets: Mutex::default(),
        }),
        body_min_rate: (settings.body_min_rate, settings.rate_window),
        domains: Arc::new(settings.domains.clone()),
        region: Arc::from(settings.region.as_str()),
        body_idle: settings.body_idle_timeout,
        request_ids: Arc::new(RequestIds::new()),
        peer: None,
        tls: None,
        access: settings.access.clone(),
        local_reads: local_reads_listener.as_ref().map(|(l, _)| l.name.clone()),
        local_peer: false,
    };
    let tls = settings
        .tls
        .as_ref()
        .map(|cert| cert.acceptor(&[b"http/1.1"]));
    let send_idle = settings.send_idle_timeout;
    let min_rate = (settings.response_min_rate, settings.rate_window);
    let connections = settings.connections.clone();

    tune_allocator();
    let mut threads = Vec::new();
    for (core, (listener, pacing)) in listeners.into_iter().enumerate() {
        let front = front.clone();
        let stop = stop_rx.clone();
        let store = store.clone();
        let connections = connections.clone();
        let (pin, uring) = (settings.pin, settings.io_uring);
        let admin = if core == 0 {
            admin.try_clone().ok()
        } else {
            None
        };
        let local_reads = if core == 0 {
            local_reads_listener.take()
        } else {
            None
        };
        let admin_ctx = (
            metrics.clone(),
            settings.admin_token.clone(),
            settings.access.clone(),
            settings.cluster.clone(),
            settings.sse_keys.clone(),
            settings.tls.clone(),
        );
        let tls = tls.clone();
        let scan = settings.scan_interval;
        let lifecycle = settings.lifecycle;
        let (s3_addr, region) = (addr, settings.region.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("tarn-core-{core}"))
                .spawn(move || -> anyhow::Result<()> {
                    let rt = tarn_io::runtime::build_core_runtime(core, pin, uring)?;
                    rt.block_on(async move {
                        let mut resumed = None;
                        if core == 0 {
                            store.spawn_background(scan);
                            if let Some(node) = &admin_ctx.3 {
                                node.spawn_watch();
                            }
                            tokio::spawn(trim_memory(store.clone()));
                            let resume = tokio::spawn(resume_prefetches(admin_ctx.2.clone()));
                            // Settings loaded at start are read at once;
                            // otherwise the jobs resume once they are loaded.
                            resumed = admin_ctx.2.is_loaded().then_some(resume);
                            tokio::spawn(
                                tarn_s3::lifecycle::Scanner::new(
                                    admin_ctx.2.clone(),
                                    store.clone(),
                                    lifecycle,
                                )
                                .run(),
                            );
                        }
                        if let Some((local, listener)) = local_reads {
                            tokio::spawn(local.serve(listener, stop.clone()));
                        }
                        if let Some(admin) = admin {
                            let listener = TcpListener::from_std(admin)?;
                            let services = crate::admin::Services {
                                store: store.clone(),
                                metrics: admin_ctx.0,
                                token: admin_ctx.1,
                                access: admin_ctx.2,
                                node: admin_ctx.3,
                                keys: admin_ctx.4,
                                s3: s3_addr,
                                region: region.to_string(),
                                tls: admin_ctx.5,
                            };
                            let stop = stop.clone();
                            tokio::spawn(async move {
                                // The jobs that were running are running
                                // again before the admin API answers, so its
                                // first listing of jobs shows them; S3 is
                                // served meanwhile.
                                if let Some(resume) = resumed {
                                    if tokio::time::timeout(RESUME_WAIT, resume).await.is_err() {
                                        tracing::warn!(
                                            "the prefetch jobs that were running are still being read: serving the admin API meanwhile"
                                        );
                                    }
                                }
                                crate::admin::serve(listener, services, stop).await
                            });
                        }
                        let listener = TcpListener::from_std(listener)?;
                        serve_core(
                            listener,
                            pacing,
                            front,
                            tls,
                            (send_idle, min_rate),
                            connections,
                            stop,
                        )
                        .await;
                        Ok::<_, anyhow::Error>(())
                    })
                })?,
        );
    }
    let backend = if settings.io_uring {
        "io_uring"
    } else {
        "blocking threads"
    };
    let scheme = if settings.tls.is_some() {
        "https"
    } else {
        "http"
    };
    println!("S3 endpoint: {scheme}://{addr}");
    println!("Admin endpoint: {scheme}://{admin_addr} (/metrics, /health/live, /health/ready)");
    tracing::info!(%addr, %admin_addr, cores = settings.cores, backend, "tarn serving");

    // Signals on their own small runtime; cores are told through the watch.
    let signal_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    signal_rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let _ = stop_tx.send(true);
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "core runtime failed"),
            Err(_) => tracing::error!("core thread panicked"),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

/// Allocations up to this size come from the allocator's heap, not from a
/// fresh mapping each; and the heap keeps up to `TRIM_THRESHOLD_BYTES` free
/// at its top instead of handing it back at every free. Without both, a
/// GET's 256 KiB pieces were mapped (or the heap regrown) one by one, a page
/// fault per 4 KiB on first touch: a third of large-GET throughput. What
/// stays free after a burst is still returned by the periodic trim.
const MMAP_THRESHOLD_BYTES: i32 = 4 << 20;
const TRIM_THRESHOLD_BYTES: i32 = 64 << 20;

fn tune_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes glibc's allocation policy, before the
    // threads that serve requests start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES);
    }
}

/// Frees the stripe buffers that sat unused for a whole interval, then hands
/// memory the allocator keeps after a burst (request bodies, stripes
/// queued to slow readers) back to the kernel, so that RSS comes back down
/// once the clients are gone. glibc returns only the top of each arena by
/// itself; `malloc_trim` releases the free pages inside them too.
async fn trim_memory(store: Arc<Store>) {
    loop {
        tokio::time::sleep(MEMORY_TRIM_INTERVAL).await;
        // Stripe buffers a burst allocated and that sat unused since.
        store.trim_buffers();
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim only returns free pages; it takes the arenas'
        // locks itself.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

async fn serve_core(
    listener: TcpListener,
    pacing: tarn_io::net::ListenerPacing,
    front: Front,
    tls: Option<tarn_io::tls::tokio_rustls::TlsAcceptor>,
    (send_idle, min_rate): (Duration, (u64, Duration)),
    connections: Arc<crate::fdlimit::Connections>,
    mut stop: watch::Receiver<bool>,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_buf_size(REQUEST_HEAD_MAX_BYTES)
        .keep_alive(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    let http = Arc::new(http);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(s) => s,
                    Err(error) => {
                        // Out of descriptors despite the caps (another
                        // part of the process took them): the connection
                        // waits in the backlog; nothing else is touched.
                        connections.accept_errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                // Over a cap, the connection is closed at once (counted):
                // its descriptor goes back before any request is read.
                let Some(admitted) = connections.admit(peer.ip()) else {
                    tracing::debug!(%peer, "connection refused: over the connection cap");
                    drop(stream);
                    continue;
                };
                // Small responses must not wait for the delayed-ACK timer.
                let _ = stream.set_nodelay(true);
                let same_host = tarn_io::net::same_host(stream.local_addr().ok(), peer);
                pacing.accepted(std::os::fd::AsRawFd::as_raw_fd(&stream), same_host);
                let state = Arc::new(ConnState::default());
                let mut front = front.clone();
                front.peer = Some(peer.ip());
                front.local_peer = front.local_reads.is_some() && same_host;
                let io = ConnIo::new(stream, send_idle, min_rate, state.clone());
                let (http, watcher, tls) = (http.clone(), graceful.watcher(), tls.clone());
                tokio::spawn(async move {
                    let _admitted = admitted;
                    // A client that stalls in its TLS handshake holds a
                    // connection slot: it gets the handshake timeout.
                    let Some(io) = tarn_io::tls::MaybeTls::accept(io, tls.as_ref()).await else {
                        return;
                    };
                    front.tls = io.tls_version();
                    serve_connection(&http, watcher, io, front, state).await;
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("in-flight requests did not finish within the grace period");
    }
}

/// Serves HTTP/1.1 on one connection (plain or TLS) until it ends.
async fn serve_connection<I>(
    http: &hyper::server::conn::http1::Builder,
    watcher: hyper_util::server::graceful::Watcher,
    io: I,
    front: Front,
    state: Arc<ConnState>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = watcher.watch(http.serve_connection(TokioIo::new(io), front));
    // Awaited by reference: the connection (and its socket) is dropped only
    // at the end of this function, after `abort` below has been set.
    let mut conn = std::pin::pin!(conn);
    if let Err(error) = (&mut conn).await {
        // Mid-response this is a body cut short: the socket closes with a
        // reset, so the client cannot take the truncated body for a whole
        // one.
        state.abort();
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// How long serving the admin API waits at start for the prefetch jobs that
/// were running to be read again.
const RESUME_WAIT: Duration = Duration::from_secs(10);

/// Prefetch jobs that were running when the server stopped (their records
/// are kept until they finish) run again, once the settings are read.
async fn resume_prefetches(access: Arc<tarn_s3::access::Access>) {
    while !access.is_loaded() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if let Err(error) = access.caches.join_jobs().await {
        tracing::warn!(%error, "cannot read the prefetch jobs that were running");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// A connection from this host that reaches a core's listener before
    /// the core accepts anything (it waits in the backlog while the server
    /// starts) starts unpaced all the same: the listener was switched
    /// before it listened. Where the host's congestion control does not
    /// pace, nothing is switched and the connection keeps it.
    #[test]
    fn a_connection_in_the_backlog_starts_unpaced() {
        let (listener, pacing) = bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
        let _client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        listener.set_nonblocking(false).unwrap();
        let (conn, peer) = listener.accept().unwrap();
        let same_host = tarn_io::net::same_host(conn.local_addr().ok(), peer);
        assert!(same_host);
        pacing.accepted(conn.as_raw_fd(), same_host);
        let cc = tarn_io::net::congestion_control(conn.as_raw_fd()).unwrap();
        assert!(!cc.starts_with("bbr"), "{cc}");
    }
}
