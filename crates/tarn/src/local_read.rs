//! The local-read socket (short-circuit reads, `docs/local-reads.md`): a
//! reader on this host proves its S3 credentials, asks for the layout of an
//! object version, and gets read-only descriptors of this node's data shard
//! files with the stripe geometry; it reads and checks the blocks itself.
//!
//! The socket is an abstract Unix socket with a random name, announced in
//! the `x-tarn-local-read` header of object responses to clients on this
//! host. The handshake proves the credentials both ways (a process that
//! binds an old name learns nothing and cannot pass as the server). A
//! layout is judged exactly as a GET of the version would be (the policy
//! engine, with the request taken as coming from 127.0.0.1 without TLS),
//! and the version is pinned: no writer removes its shard files until the
//! lease lapses, the reader releases it, or the connection closes.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tarn_store::store::local::{LocalLayout, LocalPin, LocalRead};
use tarn_store::{Store, StoreError};
use tarn_wire::auth::{self, Side};
use tarn_wire::local::{self as wire, Grant, GrantPart, LayoutRequest, Msg, Refusal};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;

/// How long a grant's pin lasts unless the reader releases it first.
pub const LEASE_DEFAULT: Duration = Duration::from_secs(30);
/// A connection must finish HELLO and AUTH within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection with no frame and no pin for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Connections at once (each holds a task and its pins).
const CONNECTIONS_MAX: usize = 512;
/// Pins one connection may hold at once.
const PINS_PER_CONNECTION_MAX: usize = 1024;

/// What the socket has done, for `/metrics`.
#[derive(Default)]
pub struct Counters {
    pub connections: AtomicUsize,
    pub grants: AtomicU64,
    pub descriptors: AtomicU64,
    pub elsewhere: AtomicU64,
    pub refused: AtomicU64,
    pub handshakes_failed: AtomicU64,
}

pub struct LocalReads {
    store: Arc<Store>,
    access: Arc<tarn_s3::access::Access>,
    lease: Duration,
    /// The abstract socket's name (no leading NUL).
    pub name: Arc<str>,
    pub counters: Counters,
    next_pin: AtomicU64,
}

impl LocalReads {
    /// Binds the socket (named after this process, the S3 port and random
    /// bytes). The listener is served by `serve` on a runtime.
    pub fn bind(
        store: Arc<Store>,
        access: Arc<tarn_s3::access::Access>,
        s3_port: u16,
        lease: Duration,
    ) -> anyhow::Result<(Arc<LocalReads>, std::os::unix::net::UnixListener)> {
        use std::os::linux::net::SocketAddrExt;
        let mut r = [0u8; 8];
        getrandom::fill(&mut r)?;
        let name = format!(
            "tarn-local.{}.{s3_port}.{}",
            std::process::id(),
            r.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        Ok((
            Arc::new(LocalReads {
                store,
                access,
                lease,
                name: name.into(),
                counters: Counters::default(),
                next_pin: AtomicU64::new(1),
            }),
            listener,
        ))
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: std::os::unix::net::UnixListener,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let listener = match UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(error) => {
                tracing::error!(%error, "local reads: cannot serve the socket");
                return;
            }
        };
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = stop.changed() => return,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(error) => {
                    tracing::warn!(%error, "local reads: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            if self.counters.connections.fetch_add(1, Ordering::Relaxed) >= CONNECTIONS_MAX {
                self.counters.connections.fetch_sub(1, Ordering::Relaxed);
                let mut s = stream;
                let _ = s.write_all(&busy("too many local-read connections")).await;
                continue;
            }
            let me = self.clone();
            tokio::spawn(async move {
                let peer = stream.peer_cred().ok();
                if let Err(error) = me.connection(stream).await {
                    tracing::debug!(%error, uid = peer.map(|p| p.uid()), "local-read connection ended");
                }
                me.counters.connections.fetch_sub(1, Ordering::Relaxed);
            });
        }
    }

    async fn connection(&self, mut s: UnixStream) -> std::io::Result<()> {
        let Some(access_key) = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.handshake(&mut s))
            .await
            .unwrap_or_else(|_| Err(bad("the handshake took too long")))?
        else {
            self.counters
                .handshakes_failed
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        // Frames are read by a task of their own, so that waiting for one
        // can give way to a pin lapsing without losing half a frame.
        let (mut rd, mut wr) = s.into_split();
        let (tx, mut frames) = tokio::sync::mpsc::channel(4);
        let reader = tokio::spawn(async move {
            loop {
                let f = read_frame(&mut rd).await;
                let end = !matches!(f, Ok(Some(_)));
                if tx.send(f).await.is_err() || end {
                    return;
                }
            }
        });
        let _reader = AbortOnDrop(reader.abort_handle());
        // Pins by id, with when each lapses.
        let mut pins: BTreeMap<u64, (Instant, LocalPin)> = BTreeMap::new();
        loop {
            let lapse = pins.values().map(|(t, _)| *t).min();
            let idle = Instant::now() + IDLE_TIMEOUT;
            let frame = tokio::select! {
                f = frames.recv() => f.unwrap_or(Ok(None))?,
                _ = tokio::time::sleep_until(lapse.unwrap_or(idle)) => {
                    if lapse.is_none() {
                        return Ok(());
                    }
                    let now = Instant::now();
                    pins.retain(|_, (t, _)| *t > now);
                    continue;
                }
            };
            let Some(body) = frame else {
                return Ok(());
            };
            match Msg::decode(&body) {
                Ok(Msg::Layout(req)) => {
                    let id = req.id;
                    if pins.len() >= PINS_PER_CONNECTION_MAX {
                        self.counters.refused.fetch_add(1, Ordering::Relaxed);
                        let m = Msg::Refused {
                            id,
                            code: Refusal::Busy,
                            message: format!(
                                "this connection holds {PINS_PER_CONNECTION_MAX} pins: release some"
                            ),
                        };
                        wr.write_all(&m.encode()).await?;
                        continue;
                    }
                    match self.layout(&access_key, &req).await {
                        Answer::Granted(layout) => {
                            let pin = self.next_pin.fetch_add(1, Ordering::Relaxed);
                            let (grant, files) = grant_of(id, pin, self.lease, &layout);
                            self.counters.grants.fetch_add(1, Ordering::Relaxed);
                            self.counters
                                .descriptors
                                .fetch_add(files.len() as u64, Ordering::Relaxed);
                            let lapses = Instant::now() + self.lease;
                            send_with_fds(wr.as_ref(), &Msg::Granted(grant).encode(), &files)
                                .await?;
                            // The files close here; the reader's copies live on.
                            pins.insert(pin, (lapses, layout.pin));
                        }
                        Answer::Reply(m) => {
                            if matches!(m, Msg::Elsewhere { .. }) {
                                self.counters.elsewhere.fetch_add(1, Ordering::Relaxed);
                            } else {
                                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                            }
                            wr.write_all(&m.encode()).await?;
                        }
                    }
                }
                Ok(Msg::Release { pin }) => {
                    pins.remove(&pin);
                }
                Ok(_) => {
                    let m = Msg::Error {
                        code: Refusal::Invalid,
                        message: "only LAYOUT and RELEASE after the handshake".into(),
                    };
                    let _ = wr.write_all(&m.encode()).await;
                    return Err(bad("an unexpected message"));
                }
                Err(e) => {
                    let m = Msg::Error {
                        code: Refusal::Invalid,
                        message: e.to_string(),
                    };
                    let _ = wr.write_all(&m.encode()).await;
                    return Err(bad("a malformed frame"));
                }
            }
        }
    }

    /// HELLO and AUTH. The access key proven, or None (refused: the
    /// refusal was sent).
    async fn handshake(&self, s: &mut UnixStream) -> std::io::Result<Option<String>> {
        let refuse = |code, message: &str| {
            Msg::Error {
                code,
                message: message.to_string(),
            }
            .encode()
        };
        let Some(body) = read_frame(s).await? else {
            return Ok(None);
        };
        let Ok(Msg::Hello { min, max }) = Msg::decode(&body) else {
            s.write_all(&refuse(Refusal::Invalid, "the first message must be HELLO"))
                .await?;
            return Ok(None);
        };
        let Some(version) = wire::negotiate(min, max) else {
            let m = format!(
                "this server speaks local-read version {}, not {min}..={max}",
                wire::VERSION
            );
            s.write_all(&refuse(Refusal::Invalid, &m)).await?;
            return Ok(None);
        };
        let server_nonce = auth::nonce();
        s.write_all(
            &Msg::HelloReply {
                version,
                nonce: server_nonce,
            }
            .encode(),
        )
        .await?;
        let Some(body) = read_frame(s).await? else {
            return Ok(None);
        };
        let Ok(Msg::Auth {
            access_key,
            nonce,
            proof,
        }) = Msg::decode(&body)
        else {
            s.write_all(&refuse(Refusal::Invalid, "the second message must be AUTH"))
                .await?;
            return Ok(None);
        };
        let secret = self.access.iam.secret_of(&access_key).ok().flatten();
        let proven = secret.as_ref().is_some_and(|secret| {
            auth::verify_for(
                wire::LABELS,
                Side::Client,
                secret.expose(),
                &server_nonce,
                &nonce,
                access_key.as_bytes(),
                &proof,
            )
        });
        let (Some(secret), true) = (secret, proven) else {
            // Whether the key exists or the proof was wrong: the same answer.
            s.write_all(&refuse(
                Refusal::Denied,
                "the credentials were not accepted",
            ))
            .await?;
            return Ok(None);
        };
        let proof = auth::proof_for(
            wire::LABELS,
            Side::Server,
            secret.expose(),
            &server_nonce,
            &nonce,
            access_key.as_bytes(),
        );
        s.write_all(&Msg::AuthReply { proof }.encode()).await?;
        Ok(Some(access_key))
    }

    /// Judges and answers one layout request.
    async fn layout(&self, access_key: &str, req: &LayoutRequest) -> Answer {
        let refused = |code, message: String| {
            Answer::Reply(Msg::Refused {
                id: req.id,
                code,
                message,
            })
        };
        let path = s3s::path::S3Path::Object {
            bucket: req.bucket.as_str().into(),
            key: req.key.as_str().into(),
        };
        let query = (!req.version.is_empty())
            .then(|| format!("versionId={}", tarn_s3::post::percent_encode(&req.version)));
        let existing_tags = self.access.existing_tags(&path, query.as_deref()).await;
        let headers = http::HeaderMap::new();
        let permit = match self.access.authorize(&tarn_s3::access::AccessRequest {
            access_key: Some(access_key),
            op: "GetObject",
            path: &path,
            headers: &headers,
            query: query.as_deref(),
            peer: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            tls: None,
            existing_tags,
        }) {
            Ok(p) => p,
            Err(e) => {
                let code = match e.code() {
                    s3s::S3ErrorCode::NoSuchBucket => Refusal::NotFound,
                    s3s::S3ErrorCode::AccessDenied => Refusal::Denied,
                    _ => Refusal::Unavailable,
                };
                return refused(code, e.message().unwrap_or("refused").to_string());
            }
        };
        let version = (!req.version.is_empty()).then_some(req.version.as_str());
        let elsewhere = |info: &tarn_store::ObjectInfo, reason: &str| {
            Answer::Reply(Msg::Elsewhere {
                id: req.id,
                reason: reason.to_string(),
                version: info.version_id.clone().unwrap_or_default(),
                etag: info.etag.clone(),
                size: info.size,
            })
        };
        if self.access.caches.get(&req.bucket).is_some() {
            // A cache bucket's reads check the upstream's version (and fill
            // misses) through the node; nothing here says more of the object.
            return Answer::Reply(Msg::Elsewhere {
                id: req.id,
                reason: "a cache bucket: read through the node".into(),
                version: String::new(),
                etag: String::new(),
                size: 0,
            });
        }
        let found = self
            .store
            .local_layout(
                &req.bucket,
                &req.key,
                version,
                (req.start, req.end),
                wire::FDS_MAX,
            )
            .await;
        let (info, layout) = match found {
            Ok(LocalRead::Layout(l)) => (l.info.clone(), Some(l)),
            Ok(LocalRead::Elsewhere { info, reason }) => {
                if permit.allows_object(&info).is_err() {
                    return refused(Refusal::Denied, "Access Denied".into());
                }
                return elsewhere(&info, reason);
            }
            Err(e) => {
                let code = match &e {
                    StoreError::NoSuchKey { .. }
                    | StoreError::NoSuchVersion { .. }
                    | StoreError::NoSuchBucket(_)
                    | StoreError::DeleteMarker { .. }
                    | StoreError::MethodNotAllowed
                        if permit.hide_missing =>
                    {
                        return refused(Refusal::Denied, "Access Denied".into());
                    }
                    StoreError::NoSuchKey { .. }
                    | StoreError::NoSuchVersion { .. }
                    | StoreError::NoSuchBucket(_)
                    | StoreError::DeleteMarker { .. }
                    | StoreError::MethodNotAllowed => Refusal::NotFound,
                    StoreError::InvalidArgument(_) | StoreError::InvalidKey(_) => Refusal::Invalid,
                    _ => Refusal::Unavailable,
                };
                return refused(code, e.to_string());
            }
        };
        if permit.allows_object(&info).is_err() {
            return refused(Refusal::Denied, "Access Denied".into());
        }
        if !req.if_match.is_empty() && req.if_match.trim_matches('"') != info.etag.trim_matches('"')
        {
            return refused(
                Refusal::Changed,
                "the object is no longer the version asked for".into(),
            );
        }
        if req.end > info.size {
            return refused(
                Refusal::Invalid,
                format!("the range ends past the object's {} bytes", info.size),
            );
        }
        let Some(layout) = layout else {
            return elsewhere(&info, "nothing to read locally");
        };
        if layout.data_shards as usize > wire::FDS_MAX {
            return elsewhere(&info, "more data shards than one reply carries");
        }
        Answer::Granted(Box::new(layout))
    }
}

enum Answer {
    Granted(Box<LocalLayout>),
    Reply(Msg),
}

/// The grant of `layout` and the files to attach, in its order, with as
/// many parts as fit in one reply's descriptors.
fn grant_of(
    id: u32,
    pin: u64,
    lease: Duration,
    layout: &LocalLayout,
) -> (Grant, Vec<std::os::fd::RawFd>) {
    let mut parts = Vec::new();
    let mut fds = Vec::new();
    for p in &layout.parts {
        let present = p.shards.iter().filter(|f| f.is_some()).count();
        if !parts.is_empty() && fds.len() + present > wire::FDS_MAX {
            break;
        }
        fds.extend(p.shards.iter().flatten().map(|f| f.as_raw_fd()));
        parts.push(GrantPart {
            offset: p.offset,
            size: p.size,
            shards: p.shards.iter().map(Option::is_some).collect(),
        });
    }
    let grant = Grant {
        id,
        pin,
        lease_ms: lease.as_millis().min(u32::MAX as u128) as u32,
        version: layout.info.version_id.clone().unwrap_or_default(),
        etag: layout.info.etag.clone(),
        size: layout.info.size,
        data_shards: layout.data_shards,
        parity_shards: layout.parity_shards,
        stripe_size: layout.stripe_size,
        part_count: layout.part_count,
        first_part: layout.first_part,
        parts,
    };
    (grant, fds)
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

fn busy(message: &str) -> Vec<u8> {
    Msg::Error {
        code: Refusal::Busy,
        message: message.to_string(),
    }
    .encode()
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One frame's body, or None at a clean end of the stream.
async fn read_frame(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
) -> std::io::Result<Option<Vec<u8>>> {
    let mut head = [0u8; 4];
    match s.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = Msg::frame_len(head).map_err(|e| bad(e.0))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// Writes a frame with descriptors attached to its first byte.
async fn send_with_fds(
    s: &UnixStream,
    frame: &[u8],
    fds: &[std::os::fd::RawFd],
) -> std::io::Result<()> {
    let mut sent = 0;
    while sent < frame.len() {
        s.writable().await?;
        let attach: &[std::os::fd::RawFd] = if sent == 0 { fds } else { &[] };
        match s.try_io(tokio::io::Interest::WRITABLE, || {
            tarn_wire::fdpass::send(s.as_raw_fd(), &frame[sent..], attach)
        }) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
