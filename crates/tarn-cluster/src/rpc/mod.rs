//! Node-to-node RPC: binary frames over TCP (`wire`), both ends proving
//! knowledge of the cluster secret when a connection opens and failing
//! closed, one call at a time per connection, several connections per peer
//! kept in pools per core and per channel (control messages apart from bulk
//! shard streams), a deadline on every call and the caller's map epoch on
//! every request.
//!
//! The frames are authenticated at connect, not encrypted or signed one by
//! one: cluster traffic belongs on a private network (docs/rpc.md).

pub mod client;
pub mod fuzz;
pub mod server;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

pub use client::{Call, RpcClient};
pub use server::{serve, serve_connection, Handler, HandlerError, ServerCall, ServerStats};
use wire::{
    Challenge, Channel, Header, Hello, Refusal, Side, Transcript, Welcome, WireError,
    CHALLENGE_FIXED_BYTES, HEADER_BYTES, HELLO_FIXED_BYTES, PROTOCOL_VERSION, WELCOME_BYTES,
};

/// How long either side waits for the other's handshake messages.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Payloads up to this size go out with their header in one write.
const COALESCE_MAX_BYTES: usize = 64 << 10;
/// Read buffer of a connection (headers and small payloads come in one read).
const READ_BUFFER_BYTES: usize = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("peer {peer} unreachable: {reason}")]
    Unreachable { peer: String, reason: String },
    #[error("deadline passed")]
    Deadline,
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("connection closed")]
    Closed,
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer's map is newer: the caller's map is stale.
    #[error("stale map epoch: the peer is at epoch {peer_epoch}")]
    StaleEpoch { peer_epoch: u64 },
    /// The peer's map is older: it reloads; the call may be retried.
    #[error("the peer's map is behind (epoch {peer_epoch})")]
    EpochAhead { peer_epoch: u64 },
    /// The peer is an older node that speaks up to `version`: the next
    /// connection offers that (the caller connects again at once).
    #[error("the peer speaks protocol version {version} at most: connecting again with it")]
    VersionRetry { version: u16 },
    /// The call reached the peer and failed there.
    #[error("remote error ({code:?}): {message}")]
    Remote {
        code: wire::ErrorCode,
        message: String,
    },
}

impl From<WireError> for RpcError {
    fn from(e: WireError) -> Self {
        RpcError::Protocol(e.to_string())
    }
}

impl RpcError {
    /// Whether the call may have left the connection mid-frame: it is then
    /// closed, never reused.
    pub(crate) fn poisons_connection(&self) -> bool {
        match self {
            RpcError::StaleEpoch { .. } | RpcError::EpochAhead { .. } => false,
            // The peer closes the connection after a protocol error.
            RpcError::Remote { code, .. } => *code == wire::ErrorCode::Protocol,
            _ => true,
        }
    }
}

/// Who this node is in the cluster, and the secret every node shares.
#[derive(Clone)]
pub struct Identity {
    pub cluster: String,
    pub node_id: String,
    secret: Arc<[u8]>,
    /// TLS on every RPC connection, both ways (None: plain TCP).
    pub tls: Option<RpcTls>,
    /// The protocol versions this node speaks, oldest and newest
    /// (`wire::PROTOCOL_MIN`, `wire::PROTOCOL_VERSION`; tests pretend to be
    /// other builds).
    versions: (u16, u16),
    /// The version each peer address last agreed on and when, so that a
    /// call to an older node does not first try the newest version every
    /// time; after `AGREED_FOR` the newest is offered again (the peer may
    /// have been upgraded since).
    agreed: Arc<std::sync::Mutex<std::collections::HashMap<String, (u16, std::time::Instant)>>>,
}

/// TLS of the cluster's RPC: this node's certificate for the connections
/// it accepts, and the roots it checks the other nodes' certificates
/// against (the name checked is the host of the address called, the
/// other node's `--advertise`). The handshake that follows still proves
/// the cluster secret both ways: TLS keeps the traffic private and whole.
#[derive(Clone)]
pub struct RpcTls {
    pub acceptor: tarn_io::tls::tokio_rustls::TlsAcceptor,
    pub connector: tarn_io::tls::tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for RpcTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RpcTls")
    }
}

impl RpcTls {
    pub fn new(
        cert: &Arc<tarn_io::tls::ServerCert>,
        client: Arc<tarn_io::tls::rustls::ClientConfig>,
    ) -> RpcTls {
        RpcTls {
            acceptor: cert.acceptor(&[]),
            connector: tarn_io::tls::tokio_rustls::TlsConnector::from(client),
        }
    }
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("cluster", &self.cluster)
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// How long an older version agreed with a peer is offered first before
/// the newest is tried again.
const AGREED_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// The shortest cluster secret accepted: a guessable secret lets anyone on
/// the network act as a node.
pub const SECRET_MIN_BYTES: usize = 16;

impl Identity {
    pub fn new(cluster: &str, node_id: &str, secret: &[u8]) -> Result<Identity, String> {
        for (what, name) in [("cluster name", cluster), ("node id", node_id)] {
            if name.is_empty()
                || name.len() > wire::NAME_MAX_BYTES
                || !name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            {
                return Err(format!(
                    "{what} {name:?}: 1 to {} characters of A-Z a-z 0-9 - _ .",
                    wire::NAME_MAX_BYTES
                ));
            }
        }
        if secret.len() < SECRET_MIN_BYTES {
            return Err(format!(
                "the cluster secret must be at least {SECRET_MIN_BYTES} bytes"
            ));
        }
        Ok(Identity {
            cluster: cluster.to_string(),
            node_id: node_id.to_string(),
            secret: secret.into(),
            tls: None,
            versions: (wire::PROTOCOL_MIN, PROTOCOL_VERSION),
            agreed: Arc::default(),
        })
    }

    /// This identity speaking only versions `oldest..=newest` (a test's
    /// stand-in for another build).
    #[doc(hidden)]
    pub fn speaking(mut self, oldest: u16, newest: u16) -> Identity {
        self.versions = (oldest, newest);
        self.agreed = Arc::default();
        self
    }

    /// The versions this node speaks, oldest and newest.
    pub fn versions(&self) -> (u16, u16) {
        self.versions
    }

    /// The version to offer `peer` first: the one it last agreed on, else
    /// the newest.
    pub(crate) fn version_for(&self, peer: &str) -> u16 {
        match self
            .agreed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(peer)
        {
            Some((v, at)) if at.elapsed() < AGREED_FOR => *v,
            _ => self.versions.1,
        }
    }

    fn agree(&self, peer: &str, version: u16) {
        let mut m = self.agreed.lock().unwrap_or_else(|p| p.into_inner());
        if version == self.versions.1 {
            m.remove(peer);
        } else {
            m.insert(peer.to_string(), (version, std::time::Instant::now()));
        }
    }

    /// This identity with TLS on its connections.
    pub fn with_tls(mut self, tls: Option<RpcTls>) -> Identity {
        self.tls = tls;
        self
    }
}

/// A buffer a body's data frame is received into: straight into the
/// caller's memory (an aligned shard buffer on the data path), never copied
/// through another buffer first.
pub trait BodyBuf {
    /// Makes the buffer `len` bytes long (their contents to be overwritten)
    /// and returns them.
    fn frame(&mut self, len: usize) -> &mut [u8];
}

impl BodyBuf for Vec<u8> {
    fn frame(&mut self, len: usize) -> &mut [u8] {
        self.resize(len, 0);
        &mut self[..]
    }
}

impl BodyBuf for tarn_io::AlignedBuf {
    fn frame(&mut self, len: usize) -> &mut [u8] {
        if self.capacity() < len {
            *self = tarn_io::AlignedBuf::with_capacity(len);
        }
        self.set_len(len);
        &mut self[..]
    }
}

/// A byte stream a connection runs on: TCP between nodes, an in-memory pipe
/// in tests and fuzzing.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}
pub type BoxStream = Box<dyn Stream>;

/// One authenticated connection: frames in and out.
pub struct Conn {
    io: BufReader<BoxStream>,
    /// The authenticated peer's node id.
    pub peer_id: String,
    pub channel: Channel,
    /// The protocol version both sides agreed on: an operation newer than
    /// it is not sent on this connection.
    pub version: u16,
}

impl Conn {
    pub(crate) fn new(io: BoxStream, peer_id: String, channel: Channel, version: u16) -> Conn {
        Conn {
            io: BufReader::with_capacity(READ_BUFFER_BYTES, io),
            peer_id,
            channel,
            version,
        }
    }

    /// The stream under the connection (fuzzing writes raw bytes on it).
    pub fn into_stream(self) -> BufReader<BoxStream> {
        self.io
    }

    pub(crate) async fn write_frame(&mut self, h: Header, payload: &[u8]) -> std::io::Result<()> {
        let head = h.encode(payload);
        let w = self.io.get_mut();
        if payload.len() <= COALESCE_MAX_BYTES {
            let mut one = Vec::with_capacity(HEADER_BYTES + payload.len());
            one.extend_from_slice(&head);
            one.extend_from_slice(payload);
            w.write_all(&one).await?;
        } else {
            w.write_all(&head).await?;
            w.write_all(payload).await?;
        }
        w.flush().await
    }

    /// The next frame's header; `None` when the peer closed cleanly between
    /// frames.
    pub(crate) async fn read_header(&mut self) -> Result<Option<Header>, RpcError> {
        let mut b = [0u8; HEADER_BYTES];
        // A clean close is EOF before the first byte of a header.
        if self.io.fill_buf().await?.is_empty() {
            return Ok(None);
        }
        self.io.read_exact(&mut b).await.map_err(eof_is_closed)?;
        Ok(Some(Header::decode(&b)?))
    }

    /// Reads a frame's payload into a new buffer and checks its CRC.
    pub(crate) async fn read_payload(&mut self, h: &Header) -> Result<Vec<u8>, RpcError> {
        let mut p = vec![0u8; h.len as usize];
        self.read_payload_into(h, &mut p).await?;
        Ok(p)
    }

    /// Reads a frame's payload into `buf` (exactly `h.len` bytes) and checks
    /// its CRC.
    pub(crate) async fn read_payload_into(
        &mut self,
        h: &Header,
        buf: &mut [u8],
    ) -> Result<(), RpcError> {
        self.io.read_exact(buf).await.map_err(eof_is_closed)?;
        h.check_payload(buf)?;
        Ok(())
    }

    /// Whether the peer has sent something we have not read (without waiting).
    pub(crate) fn has_pending_input(&mut self) -> bool {
        use futures::FutureExt;
        // Ready at all means bytes, an end of stream or an error: each is
        // something the caller must read to learn.
        self.io.fill_buf().now_or_never().is_some()
    }
}

fn eof_is_closed(e: std::io::Error) -> RpcError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        RpcError::Closed
    } else {
        RpcError::Io(e)
    }
}

/// The client side of the handshake: proves the secret first, then checks
/// the server's proof. `expect` names the node the caller meant to reach.
pub async fn client_handshake(
    mut io: BoxStream,
    me: &Identity,
    channel: Channel,
    peer: &str,
    expect: Option<&str>,
) -> Result<Conn, RpcError> {
    let auth = |reason: String| RpcError::Auth {
        peer: peer.to_string(),
        reason,
    };
    let offered = me.version_for(peer);
    let hello = Hello {
        version: offered,
        channel,
        cluster: me.cluster.clone(),
        node_id: me.node_id.clone(),
        nonce: wire::nonce(),
    };
    io.write_all(&hello.encode()).await?;
    io.flush().await?;
    let mut fixed = [0u8; CHALLENGE_FIXED_BYTES];
    io.read_exact(&mut fixed).await.map_err(eof_is_closed)?;
    let (mut challenge, n) = Challenge::decode_fixed(&fixed)?;
    let (oldest, _) = me.versions;
    if challenge.status == Refusal::Version {
        // The refusal names the newest version the peer speaks: an older
        // node during a rolling upgrade. The next connection offers it.
        let theirs = challenge.version;
        if (oldest..offered).contains(&theirs) {
            me.agree(peer, theirs);
            return Err(RpcError::VersionRetry { version: theirs });
        }
        return Err(auth(format!(
            "it speaks protocol versions up to {theirs}, this node {oldest} to {}: upgrade the cluster one release at a time",
            me.versions.1
        )));
    }
    if challenge.status != Refusal::Accepted {
        return Err(auth(format!("refused: {}", challenge.status.describe())));
    }
    if challenge.version != offered {
        return Err(auth(format!(
            "offered protocol version {offered}, the peer answered {}",
            challenge.version
        )));
    }
    me.agree(peer, offered);
    let mut id = vec![0u8; n];
    io.read_exact(&mut id).await.map_err(eof_is_closed)?;
    let mut whole = fixed.to_vec();
    whole.extend_from_slice(&id);
    challenge = Challenge::decode(&whole)?;
    if let Some(want) = expect {
        // Checked before proving anything: a proof is only for the node
        // the caller meant to reach.
        if want != challenge.node_id {
            return Err(auth(format!(
                "expected node {want}, found node {}",
                challenge.node_id
            )));
        }
    }
    let t = Transcript {
        cluster: &me.cluster,
        client_id: &me.node_id,
        server_id: &challenge.node_id,
        client_nonce: &hello.nonce,
        server_nonce: &challenge.nonce,
    };
    io.write_all(&wire::proof(Side::Client, &me.secret, &t))
        .await?;
    io.flush().await?;
    let mut welcome = [0u8; WELCOME_BYTES];
    io.read_exact(&mut welcome)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => auth("the peer closed the connection".into()),
            _ => RpcError::Io(e),
        })?;
    let welcome = Welcome::decode(&welcome)?;
    if welcome.status != Refusal::Accepted {
        return Err(auth(format!("refused: {}", welcome.status.describe())));
    }
    if !wire::verify(Side::Server, &me.secret, &t, &welcome.proof) {
        return Err(auth(
            "the peer does not know the cluster secret".to_string(),
        ));
    }
    Ok(Conn::new(io, challenge.node_id, channel, offered))
}

/// The server side of the handshake. Every refusal is answered (so the
/// client can say why) and ends the connection. The server proves the
/// secret only to a caller that proved it first.
pub async fn server_handshake(mut io: BoxStream, me: &Identity) -> Result<Conn, RpcError> {
    let (oldest, newest) = me.versions;
    async fn refuse(io: &mut BoxStream, status: Refusal, newest: u16) {
        let c = Challenge {
            version: newest,
            status,
            node_id: String::new(),
            nonce: [0; wire::NONCE_BYTES],
        };
        let _ = io.write_all(&c.encode()).await;
        let _ = io.flush().await;
    }
    let mut fixed = [0u8; HELLO_FIXED_BYTES];
    io.read_exact(&mut fixed).await.map_err(eof_is_closed)?;
    let (version, _, c, n, _) = match Hello::decode_fixed(&fixed) {
        Ok(f) => f,
        Err(e) => {
            refuse(&mut io, Refusal::Malformed, newest).await;
            return Err(e.into());
        }
    };
    let mut names = vec![0u8; c + n];
    io.read_exact(&mut names).await.map_err(eof_is_closed)?;
    let mut whole = fixed.to_vec();
    whole.extend_from_slice(&names);
    let hello = match Hello::decode(&whole) {
        Ok(h) => h,
        Err(e) => {
            refuse(&mut io, Refusal::Malformed, newest).await;
            return Err(e.into());
        }
    };
    if !(oldest..=newest).contains(&version) {
        // Answered with the newest version this node speaks: a newer
        // caller steps down to it, an older one learns why.
        refuse(&mut io, Refusal::Version, newest).await;
        return Err(RpcError::Protocol(format!(
            "node {} speaks protocol version {version}, this node {oldest} to {newest}",
            hello.node_id
        )));
    }
    if hello.cluster != me.cluster {
        refuse(&mut io, Refusal::Cluster, newest).await;
        return Err(RpcError::Auth {
            peer: hello.node_id,
            reason: format!("belongs to cluster {:?}", hello.cluster),
        });
    }
    let server_nonce = wire::nonce();
    let t = Transcript {
        cluster: &me.cluster,
        client_id: &hello.node_id,
        server_id: &me.node_id,
        client_nonce: &hello.nonce,
        server_nonce: &server_nonce,
    };
    let challenge = Challenge {
        version,
        status: Refusal::Accepted,
        node_id: me.node_id.clone(),
        nonce: server_nonce,
    };
    io.write_all(&challenge.encode()).await?;
    io.flush().await?;
    let mut proof = [0u8; wire::PROOF_BYTES];
    io.read_exact(&mut proof).await.map_err(eof_is_closed)?;
    let ok = wire::verify(Side::Client, &me.secret, &t, &proof);
    let welcome = if ok {
        Welcome {
            status: Refusal::Accepted,
            proof: wire::proof(Side::Server, &me.secret, &t),
        }
    } else {
        Welcome {
            status: Refusal::Proof,
            proof: [0; wire::PROOF_BYTES],
        }
    };
    io.write_all(&welcome.encode()).await?;
    io.flush().await?;
    if !ok {
        return Err(RpcError::Auth {
            peer: hello.node_id,
            reason: "it does not know the cluster secret".into(),
        });
    }
    Ok(Conn::new(io, hello.node_id, hello.channel, version))
}
