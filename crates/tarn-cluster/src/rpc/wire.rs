//! The node-to-node RPC wire format, in one place: the handshake messages,
//! the frame header, error codes, operation numbers and the field encoding
//! of message payloads. Byte layouts and their history are in docs/rpc.md;
//! everything here is pure (no I/O), so every decoder is fuzzed directly.
//!
//! Every decoder takes bytes from the network: it validates and returns an
//! error, never panics, and never allocates more than the header it has
//! already validated announces.

use hmac::{KeyInit, Mac};
use sha2::Sha256;

/// The first bytes of every handshake message.
pub const MAGIC: [u8; 4] = *b"TRPC";
/// The newest protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 3;
/// The oldest protocol version this build still speaks, so that a cluster
/// can be upgraded one node at a time: a connection between a newer and an
/// older node uses the older node's version (docs/rpc.md, "Versions").
/// A change to the protocol raises `PROTOCOL_VERSION` and keeps this at the
/// previous release's version for at least one release.
pub const PROTOCOL_MIN: u16 = 3;
/// Each side's handshake nonce.
pub const NONCE_BYTES: usize = 32;
/// HMAC-SHA256 output.
pub const PROOF_BYTES: usize = 32;
/// Cluster names and node ids on the wire (the same limit as etcd keys use).
pub const NAME_MAX_BYTES: usize = 63;
/// Fixed part of HELLO, before the cluster name and node id.
pub const HELLO_FIXED_BYTES: usize = 41;
/// Fixed part of CHALLENGE, before the server's node id.
pub const CHALLENGE_FIXED_BYTES: usize = 40;
/// WELCOME: magic, a status byte and the server's proof.
pub const WELCOME_BYTES: usize = 5 + PROOF_BYTES;

/// Every frame starts with this header.
pub const HEADER_BYTES: usize = 32;
/// Largest payload of a request, response, end or error frame: control
/// documents (records, listing pages), never object data.
pub const MESSAGE_MAX_BYTES: u32 = 16 << 20;
/// Largest payload of a data frame: one shard block, which is at most one
/// stripe (a replicated layout's block is the whole stripe).
pub const DATA_MAX_BYTES: u32 = 64 << 20;
const _: () = assert!(DATA_MAX_BYTES >= tarn_store::format::STRIPE_SIZE_MAX_BYTES);

pub type Nonce = [u8; NONCE_BYTES];
pub type Proof = [u8; PROOF_BYTES];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic")]
    Magic,
    #[error("protocol version {0} is not supported (this node speaks {PROTOCOL_VERSION})")]
    Version(u16),
    #[error("truncated {0}")]
    Truncated(&'static str),
    #[error("{0}")]
    Invalid(&'static str),
    #[error("frame checksum mismatch")]
    Checksum,
    #[error("{what} payload of {len} bytes is over the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: u32,
        max: u32,
    },
}

/// Which pool a connection serves: small control messages never queue
/// behind bulk shard streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    Control = 0,
    Bulk = 1,
}

impl Channel {
    pub fn from_u8(v: u8) -> Option<Channel> {
        match v {
            0 => Some(Channel::Control),
            1 => Some(Channel::Bulk),
            _ => None,
        }
    }
}

fn check_name(name: &[u8]) -> Result<(), WireError> {
    if name.is_empty() || name.len() > NAME_MAX_BYTES {
        return Err(WireError::Invalid("name length"));
    }
    if !name
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
    {
        return Err(WireError::Invalid("name characters"));
    }
    Ok(())
}

/// The client's opening message.
///
/// ```text
/// 0   4  magic "TRPC"
/// 4   2  protocol version, u16 LE
/// 6   1  channel: 0 control, 1 bulk
/// 7   1  cluster name length c (1..=63)
/// 8   1  client node id length n (1..=63)
/// 9   32 client nonce
/// 41  c  cluster name
/// 41+c n client node id
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub channel: Channel,
    pub cluster: String,
    pub node_id: String,
    pub nonce: Nonce,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(HELLO_FIXED_BYTES + self.cluster.len() + self.node_id.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.push(self.channel as u8);
        out.push(self.cluster.len() as u8);
        out.push(self.node_id.len() as u8);
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(self.cluster.as_bytes());
        out.extend_from_slice(self.node_id.as_bytes());
        out
    }

    /// Decodes the fixed part: returns the lengths of the names that follow.
    pub fn decode_fixed(b: &[u8]) -> Result<(u16, Channel, usize, usize, Nonce), WireError> {
        if b.len() < HELLO_FIXED_BYTES {
            return Err(WireError::Truncated("hello"));
        }
        if b[0..4] != MAGIC {
            return Err(WireError::Magic);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        let channel = Channel::from_u8(b[6]).ok_or(WireError::Invalid("channel"))?;
        let (c, n) = (b[7] as usize, b[8] as usize);
        if c == 0 || c > NAME_MAX_BYTES || n == 0 || n > NAME_MAX_BYTES {
            return Err(WireError::Invalid("name length"));
        }
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&b[9..41]);
        Ok((version, channel, c, n, nonce))
    }

    /// Decodes a whole HELLO.
    pub fn decode(b: &[u8]) -> Result<Hello, WireError> {
        let (version, channel, c, n, nonce) = Hello::decode_fixed(b)?;
        let rest = &b[HELLO_FIXED_BYTES..];
        if rest.len() != c + n {
            return Err(WireError::Truncated("hello names"));
        }
        let (cluster, node_id) = rest.split_at(c);
        check_name(cluster)?;
        check_name(node_id)?;
        Ok(Hello {
            version,
            channel,
            cluster: String::from_utf8_lossy(cluster).into_owned(),
            node_id: String::from_utf8_lossy(node_id).into_owned(),
            nonce,
        })
    }
}

/// Why a server refuses a HELLO or a proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Accepted = 0,
    Version = 1,
    Cluster = 2,
    Proof = 3,
    Malformed = 4,
}

impl Refusal {
    pub fn from_u8(v: u8) -> Refusal {
        match v {
            0 => Refusal::Accepted,
            1 => Refusal::Version,
            2 => Refusal::Cluster,
            3 => Refusal::Proof,
            _ => Refusal::Malformed,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Refusal::Accepted => "accepted",
            Refusal::Version => "protocol version not supported",
            Refusal::Cluster => "another cluster",
            Refusal::Proof => "cluster secret proof refused",
            Refusal::Malformed => "malformed handshake",
        }
    }
}

/// The server's answer to HELLO. It carries no proof: the caller proves
/// the secret first (in its PROOF), so anyone who can reach the port learns
/// nothing to guess the secret from offline.
///
/// ```text
/// 0   4  magic "TRPC"
/// 4   2  protocol version, u16 LE
/// 6   1  status (Refusal; 0 accepted, anything else ends the connection)
/// 7   1  server node id length n (0..=63; 0 when refused)
/// 8   32 server nonce
/// 40  n  server node id
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub version: u16,
    pub status: Refusal,
    pub node_id: String,
    pub nonce: Nonce,
}

impl Challenge {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CHALLENGE_FIXED_BYTES + self.node_id.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.push(self.status as u8);
        out.push(self.node_id.len() as u8);
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(self.node_id.as_bytes());
        out
    }

    /// Decodes the fixed part; returns it with the node id left empty and
    /// the length of the node id that follows.
    pub fn decode_fixed(b: &[u8]) -> Result<(Challenge, usize), WireError> {
        if b.len() < CHALLENGE_FIXED_BYTES {
            return Err(WireError::Truncated("challenge"));
        }
        if b[0..4] != MAGIC {
            return Err(WireError::Magic);
        }
        let n = b[7] as usize;
        if n > NAME_MAX_BYTES {
            return Err(WireError::Invalid("name length"));
        }
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&b[8..40]);
        Ok((
            Challenge {
                version: u16::from_le_bytes([b[4], b[5]]),
                status: Refusal::from_u8(b[6]),
                node_id: String::new(),
                nonce,
            },
            n,
        ))
    }

    pub fn decode(b: &[u8]) -> Result<Challenge, WireError> {
        let (mut c, n) = Challenge::decode_fixed(b)?;
        let rest = &b[CHALLENGE_FIXED_BYTES..];
        if rest.len() != n {
            return Err(WireError::Truncated("challenge node id"));
        }
        if c.status == Refusal::Accepted {
            check_name(rest)?;
        }
        c.node_id = String::from_utf8_lossy(rest).into_owned();
        Ok(c)
    }
}

/// The server's answer to the caller's PROOF: the status and, only when
/// the caller's proof was accepted, the server's own proof.
///
/// ```text
/// 0   4  magic "TRPC"
/// 4   1  status (Refusal; 0 accepted)
/// 5   32 server proof (zero unless accepted)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub status: Refusal,
    pub proof: Proof,
}

impl Welcome {
    pub fn encode(&self) -> [u8; WELCOME_BYTES] {
        let mut out = [0u8; WELCOME_BYTES];
        out[..4].copy_from_slice(&MAGIC);
        out[4] = self.status as u8;
        out[5..].copy_from_slice(&self.proof);
        out
    }

    pub fn decode(b: &[u8]) -> Result<Welcome, WireError> {
        if b.len() != WELCOME_BYTES {
            return Err(WireError::Truncated("welcome"));
        }
        if b[0..4] != MAGIC {
            return Err(WireError::Magic);
        }
        let mut proof = [0u8; PROOF_BYTES];
        proof.copy_from_slice(&b[5..]);
        Ok(Welcome {
            status: Refusal::from_u8(b[4]),
            proof,
        })
    }
}

/// Which side a proof speaks for: the two proofs of one handshake differ, so
/// neither can be reflected back as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// What both proofs of one connection cover: both names, both nonces.
pub struct Transcript<'a> {
    pub cluster: &'a str,
    pub client_id: &'a str,
    pub server_id: &'a str,
    pub client_nonce: &'a Nonce,
    pub server_nonce: &'a Nonce,
}

fn transcript_mac(side: Side, secret: &[u8], t: &Transcript<'_>) -> hmac::Hmac<Sha256> {
    let mut m = hmac::Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(match side {
        Side::Client => b"tarn-rpc-v1 client\0",
        Side::Server => b"tarn-rpc-v1 server\0",
    });
    // Names are length-limited and NUL-free, so NUL separators are unambiguous.
    for part in [t.cluster, t.client_id, t.server_id] {
        m.update(part.as_bytes());
        m.update(&[0]);
    }
    m.update(t.client_nonce);
    m.update(t.server_nonce);
    m
}

/// `HMAC-SHA256(secret, "tarn-rpc-v1 <side>\0" ‖ cluster\0 ‖ client id\0 ‖
/// server id\0 ‖ client nonce ‖ server nonce)`.
pub fn proof(side: Side, secret: &[u8], t: &Transcript<'_>) -> Proof {
    transcript_mac(side, secret, t)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a proof in constant time.
pub fn verify(side: Side, secret: &[u8], t: &Transcript<'_>, proof: &Proof) -> bool {
    transcript_mac(side, secret, t).verify_slice(proof).is_ok()
}

/// A fresh random nonce.
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_BYTES];
    // The OS random source failing is not something to limp on with.
    getrandom::fill(&mut n).expect("the OS random number source");
    n
}

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Opens a call: the operation, the sender's map epoch and deadline.
    Request = 1,
    /// The call's result (its body, if flagged, follows as data frames).
    Response = 2,
    /// A piece of a request or response body.
    Data = 3,
    /// Ends a body.
    End = 4,
    /// The call failed: an error code and a UTF-8 message.
    Error = 5,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Request),
            2 => Some(Kind::Response),
            3 => Some(Kind::Data),
            4 => Some(Kind::End),
            5 => Some(Kind::Error),
            _ => None,
        }
    }
}

/// Request/response flag: a body of data frames and an end frame follows.
pub const FLAG_BODY: u8 = 1;
const FLAGS_KNOWN: u8 = FLAG_BODY;

/// A frame header.
///
/// ```text
/// 0   1  kind (Kind)
/// 1   1  flags (bit 0: a body follows; other bits 0)
/// 2   2  operation, u16 LE (requests; the other kinds echo it)
/// 4   4  payload length, u32 LE
/// 8   8  call id, u64 LE (responses echo the request's)
/// 16  8  map epoch, u64 LE (requests: the sender's; errors: the receiver's)
/// 24  4  requests: deadline in ms, u32 LE; errors: error code; else 0
/// 28  4  CRC32C of bytes [0, 28) followed by the payload
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u8,
    pub op: u16,
    pub len: u32,
    pub call: u64,
    pub epoch: u64,
    /// Deadline (ms) of a request, code of an error.
    pub aux: u32,
    pub crc: u32,
}

impl Header {
    pub fn new(kind: Kind, op: u16, call: u64, epoch: u64, aux: u32) -> Header {
        Header {
            kind,
            flags: 0,
            op,
            len: 0,
            call,
            epoch,
            aux,
            crc: 0,
        }
    }

    pub fn with_body(mut self, body: bool) -> Header {
        if body {
            self.flags |= FLAG_BODY;
        }
        self
    }

    pub fn has_body(&self) -> bool {
        self.flags & FLAG_BODY != 0
    }

    /// Encodes with the length and CRC of `payload`.
    pub fn encode(&self, payload: &[u8]) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0] = self.kind as u8;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.op.to_le_bytes());
        b[4..8].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.call.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..28].copy_from_slice(&self.aux.to_le_bytes());
        let crc = frame_crc(&b[..28], payload);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and validates a header (the payload's CRC is checked once it
    /// has arrived, with `check_payload`).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, WireError> {
        let kind = Kind::from_u8(b[0]).ok_or(WireError::Invalid("frame kind"))?;
        let flags = b[1];
        if flags & !FLAGS_KNOWN != 0 {
            return Err(WireError::Invalid("frame flags"));
        }
        if flags & FLAG_BODY != 0 && !matches!(kind, Kind::Request | Kind::Response) {
            return Err(WireError::Invalid(
                "body flag on a frame that cannot open a body",
            ));
        }
        let len = u32::from_le_bytes(b[4..8].try_into().expect("4"));
        let max = match kind {
            Kind::Data => DATA_MAX_BYTES,
            _ => MESSAGE_MAX_BYTES,
        };
        if len > max {
            return Err(WireError::TooLarge {
                what: "frame",
                len,
                max,
            });
        }
        Ok(Header {
            kind,
            flags,
            op: u16::from_le_bytes([b[2], b[3]]),
            len,
            call: u64::from_le_bytes(b[8..16].try_into().expect("8")),
            epoch: u64::from_le_bytes(b[16..24].try_into().expect("8")),
            aux: u32::from_le_bytes(b[24..28].try_into().expect("4")),
            crc: u32::from_le_bytes(b[28..32].try_into().expect("4")),
        })
    }

    /// Checks the CRC over the header's first 28 bytes and the payload.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), WireError> {
        if payload.len() != self.len as usize {
            return Err(WireError::Truncated("payload"));
        }
        // Decoding is lossless for a valid header: re-encoding gives the
        // bytes that came, so this is the CRC of what was sent.
        let b = self.encode(payload);
        if u32::from_le_bytes(b[28..32].try_into().expect("4")) != self.crc {
            return Err(WireError::Checksum);
        }
        Ok(())
    }
}

fn frame_crc(head: &[u8], payload: &[u8]) -> u32 {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    d.update(head);
    d.update(payload);
    d.finalize() as u32
}

/// Why a call failed, as carried by an error frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// The frame or its payload did not decode; the connection is closed.
    Protocol = 1,
    /// The request's epoch is older than the receiver's map: refresh the map.
    StaleEpoch = 2,
    /// The request's epoch is newer than the receiver's map: it reloads; retry.
    EpochAhead = 3,
    /// The deadline passed before the receiver finished.
    Deadline = 4,
    /// The receiver does not know the operation.
    UnknownOp = 5,
    /// The receiver is shutting down or not ready.
    Unavailable = 6,
    /// The operation failed; its payload says why (operation-specific).
    Failed = 7,
}

impl ErrorCode {
    pub fn from_u32(v: u32) -> Option<ErrorCode> {
        Some(match v {
            1 => ErrorCode::Protocol,
            2 => ErrorCode::StaleEpoch,
            3 => ErrorCode::EpochAhead,
            4 => ErrorCode::Deadline,
            5 => ErrorCode::UnknownOp,
            6 => ErrorCode::Unavailable,
            7 => ErrorCode::Failed,
            _ => return None,
        })
    }
}

/// Operation numbers. New operations get new numbers; a number is never
/// reused for another meaning.
pub mod op {
    /// Echoes its payload: liveness and round-trip checks.
    pub const PING: u16 = 1;

    // Calls on one drive of the receiving node (`drive`): every request
    // starts with the drive's 16-byte id. Lists come back as a response
    // body of data frames, each a run of encoded items.
    pub const DRIVE_BUCKETS: u16 = 10;
    pub const DRIVE_PUT_BUCKET: u16 = 11;
    pub const DRIVE_DELETE_BUCKET: u16 = 12;
    pub const DRIVE_BUCKET_HAS_ENTRIES: u16 = 13;
    /// Whether the drive is in service on its node, and its index complete.
    pub const DRIVE_STATE: u16 = 14;
    /// A call on a drive's lease table: locks and pins across nodes.
    pub const DRIVE_LEASE: u16 = 15;
    pub const DRIVE_OBJECT: u16 = 20;
    pub const DRIVE_WRITE_OBJECT: u16 = 21;
    pub const DRIVE_WRITE_OBJECTS_BULK: u16 = 22;
    pub const DRIVE_INLINE_DATA: u16 = 23;
    pub const DRIVE_LIST_PAGE: u16 = 24;
    pub const DRIVE_ALL_OBJECT_KEYS: u16 = 25;
    pub const DRIVE_PUT_UPLOAD: u16 = 30;
    pub const DRIVE_UPLOAD: u16 = 31;
    pub const DRIVE_DELETE_UPLOAD: u16 = 32;
    pub const DRIVE_SCAN_UPLOADS: u16 = 33;
    pub const DRIVE_PUT_PART: u16 = 34;
    pub const DRIVE_PARTS: u16 = 35;
    pub const DRIVE_REFERENCED_DATA_IDS: u16 = 36;
    /// The missed-write log (protocol 2).
    pub const DRIVE_LOG_MISSED: u16 = 37;
    pub const DRIVE_MISSED: u16 = 38;
    pub const DRIVE_CLEAR_MISSED: u16 = 39;
    /// A shard file: the request body is its blocks, one per data frame.
    pub const SHARD_WRITE: u16 = 40;
    pub const SHARD_COMMIT: u16 = 41;
    /// Opens a shard file and checks its length.
    pub const SHARD_OPEN: u16 = 42;
    /// Verified blocks `first..=last` as a response body, one per data frame.
    pub const SHARD_READ: u16 = 43;
    pub const SHARD_VERIFY: u16 = 44;
    pub const SHARD_REMOVE: u16 = 45;
    /// Node calls (no drive id). Reads every user, key and bucket setting
    /// again from etcd and answers once they apply (1) or could not be
    /// read (0): an admin change returns only when every reachable node
    /// has applied it (protocol 3).
    pub const NODE_RELOAD_DOCS: u16 = 50;
}

/// Messages of the drive operations.
pub mod drive {
    use super::{Dec, Enc, WireError};
    use tarn_store::drive::{BulkItem, ObjectWrite};
    use tarn_store::format::ObjectRecord;
    use tarn_store::lock::{LeaseCall, LockMode, LEASE_ITEMS_MAX, LEASE_PINS_MAX};
    use tarn_store::shard::ShardError;
    use tarn_store::StoreError;

    /// Largest data frame of a list response body: items are packed into
    /// runs up to this size (an item larger than it gets a frame alone).
    pub const LIST_FRAME_BYTES: usize = 1 << 20;

    pub fn object_write(e: &mut Enc, w: &ObjectWrite) {
        match &w.record {
            Some(r) => e.u8(1).bytes(&r.encode()),
            None => e.u8(0),
        };
        e.u32(w.inline_put.len() as u32);
        for (vid, mt, data) in &w.inline_put {
            e.fixed(vid).u64(*mt).bytes(data);
        }
        e.u32(w.inline_delete.len() as u32);
        for (vid, mt) in &w.inline_delete {
            e.fixed(vid).u64(*mt);
        }
        match &w.upload_delete {
            Some((id, parts)) => {
                e.u8(1).fixed(id).u32(parts.len() as u32);
                for n in parts {
                    e.u32(*n);
                }
            }
            None => {
                e.u8(0);
            }
        }
        e.bytes(&w.missed);
    }

    /// A count read from the wire, bounded by what the message can hold
    /// (each item takes at least `min_item_bytes`), so a forged count
    /// allocates nothing.
    /// A call on a drive's lease table (after the drive id): its kind (1
    /// acquire, 2 refresh, 3 pin, 4 release, 5 release an earlier
    /// incarnation's holdings: the owner field is the holder), the owner, then per kind the
    /// time to live and the lock items (resource u64, mode 0 read / 1
    /// write) or the pinned data ids.
    pub fn lease_call(e: &mut Enc, call: &LeaseCall) {
        match call {
            LeaseCall::Acquire {
                owner,
                items,
                ttl_ms,
            } => {
                e.u8(1).fixed(owner).u32(*ttl_ms).u32(items.len() as u32);
                for (r, m) in items {
                    e.u64(*r).u8(match m {
                        LockMode::Read => 0,
                        LockMode::Write => 1,
                    });
                }
            }
            LeaseCall::Refresh { owner, ttl_ms } => {
                e.u8(2).fixed(owner).u32(*ttl_ms);
            }
            LeaseCall::Pin {
                owner,
                data_ids,
                ttl_ms,
            } => {
                e.u8(3).fixed(owner).u32(*ttl_ms).u32(data_ids.len() as u32);
                for id in data_ids {
                    e.fixed(id);
                }
            }
            LeaseCall::Release { owner } => {
                e.u8(4).fixed(owner);
            }
            LeaseCall::ReleaseEarlier { holder } => {
                e.u8(5).fixed(holder);
            }
        }
    }

    pub fn decode_lease_call(d: &mut Dec<'_>) -> Result<LeaseCall, WireError> {
        let kind = d.u8()?;
        let owner = d.fixed::<16>()?;
        let call = match kind {
            1 => {
                let ttl_ms = d.u32()?;
                let n = count(d, 9)?;
                if n > LEASE_ITEMS_MAX {
                    return Err(WireError::Invalid("too many lock items"));
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    let r = d.u64()?;
                    let m = match d.u8()? {
                        0 => LockMode::Read,
                        1 => LockMode::Write,
                        _ => return Err(WireError::Invalid("lock mode")),
                    };
                    items.push((r, m));
                }
                LeaseCall::Acquire {
                    owner,
                    items,
                    ttl_ms,
                }
            }
            2 => LeaseCall::Refresh {
                owner,
                ttl_ms: d.u32()?,
            },
            3 => {
                let ttl_ms = d.u32()?;
                let n = count(d, 16)?;
                if n > LEASE_PINS_MAX {
                    return Err(WireError::Invalid("too many pinned data ids"));
                }
                let mut data_ids = Vec::with_capacity(n);
                for _ in 0..n {
                    data_ids.push(d.fixed::<16>()?);
                }
                LeaseCall::Pin {
                    owner,
                    data_ids,
                    ttl_ms,
                }
            }
            4 => LeaseCall::Release { owner },
            5 => LeaseCall::ReleaseEarlier { holder: owner },
            _ => return Err(WireError::Invalid("lease call kind")),
        };
        d.end()?;
        Ok(call)
    }

    pub fn count(d: &mut Dec<'_>, min_item_bytes: usize) -> Result<usize, WireError> {
        let n = d.u32()? as usize;
        if n.saturating_mul(min_item_bytes.max(1)) > d.remaining() {
            return Err(WireError::Invalid("item count beyond the message"));
        }
        Ok(n)
    }

    pub fn decode_object_write(d: &mut Dec<'_>) -> Result<ObjectWrite, WireError> {
        let record = match d.u8()? {
            0 => None,
            1 => Some(
                ObjectRecord::decode(d.bytes()?)
                    .map_err(|_| WireError::Invalid("object record"))?,
            ),
            _ => return Err(WireError::Invalid("record flag")),
        };
        let mut w = ObjectWrite {
            record,
            ..Default::default()
        };
        for _ in 0..count(d, 28)? {
            w.inline_put
                .push((d.fixed::<16>()?, d.u64()?, d.bytes()?.to_vec()));
        }
        for _ in 0..count(d, 24)? {
            w.inline_delete.push((d.fixed::<16>()?, d.u64()?));
        }
        w.upload_delete = match d.u8()? {
            0 => None,
            1 => {
                let id = d.fixed::<16>()?;
                let mut parts = Vec::new();
                for _ in 0..count(d, 4)? {
                    parts.push(d.u32()?);
                }
                Some((id, parts))
            }
            _ => return Err(WireError::Invalid("upload flag")),
        };
        w.missed = d.bytes()?.to_vec();
        Ok(w)
    }

    pub fn bulk_item(e: &mut Enc, (key, record, inline): &BulkItem) {
        e.str(key).bytes(record);
        match inline {
            Some((vid, mt, data)) => e.u8(1).fixed(vid).u64(*mt).bytes(data),
            None => e.u8(0),
        };
    }

    pub fn decode_bulk_item(d: &mut Dec<'_>) -> Result<BulkItem, WireError> {
        let key = d.str()?.to_string();
        let record = d.bytes()?.to_vec();
        let inline = match d.u8()? {
            0 => None,
            1 => Some((d.fixed::<16>()?, d.u64()?, d.bytes()?.to_vec())),
            _ => return Err(WireError::Invalid("inline flag")),
        };
        Ok((key, record, inline))
    }

    /// Why a drive operation failed, carried as the message of an error
    /// frame (code 7): `tarn-drive-error/1|<tag>|<a>|<b>|<text>`, so that
    /// the caller decides as it would on a local drive (no space left,
    /// a damaged index, a missing or corrupt shard).
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Failure {
        /// The drive is not in service on its node (or not readable yet).
        Offline(String),
        IndexCorrupt(String),
        CorruptMetadata(String),
        /// An I/O error and its OS error code (0: none).
        Io(i32, String),
        ShardMissing,
        ShardLength(u64, u64),
        ShardCorrupt(u64),
        ShardFooter(String),
        /// The drive holds a newer record of the key (held, offered stamps).
        Superseded(u64, u64, String),
        /// No answer within the deadline from a node not (yet) suspect:
        /// made on the caller's side, never sent.
        Late(String),
        /// The drive's node refused the connection or closed it (stopped,
        /// restarting for an upgrade, crashed): made on the caller's side,
        /// never sent. The drive is out of use until its node answers; it
        /// is not a drive fault.
        Away(String),
        Other(String),
    }

    const PREFIX: &str = "tarn-drive-error/1|";

    impl Failure {
        pub fn to_message(&self) -> String {
            let (tag, a, b, text): (&str, u64, u64, &str) = match self {
                Failure::Offline(t) => ("offline", 0, 0, t),
                Failure::IndexCorrupt(t) => ("index-corrupt", 0, 0, t),
                Failure::CorruptMetadata(t) => ("corrupt-metadata", 0, 0, t),
                Failure::Io(errno, t) => ("io", *errno as u32 as u64, 0, t),
                Failure::ShardMissing => ("shard-missing", 0, 0, ""),
                Failure::ShardLength(x, y) => ("shard-length", *x, *y, ""),
                Failure::ShardCorrupt(j) => ("shard-corrupt", *j, 0, ""),
                Failure::ShardFooter(t) => ("shard-footer", 0, 0, t),
                Failure::Superseded(held, offered, t) => ("superseded", *held, *offered, t),
                Failure::Late(t) => ("late", 0, 0, t),
                Failure::Away(t) => ("away", 0, 0, t),
                Failure::Other(t) => ("other", 0, 0, t),
            };
            format!("{PREFIX}{tag}|{a}|{b}|{text}")
        }

        /// Reads a failure message; any other text is `Other`.
        pub fn from_message(m: &str) -> Failure {
            let parsed = (|| {
                let rest = m.strip_prefix(PREFIX)?;
                let mut it = rest.splitn(4, '|');
                let (tag, a, b, text) = (it.next()?, it.next()?, it.next()?, it.next()?);
                let (a, b): (u64, u64) = (a.parse().ok()?, b.parse().ok()?);
                let t = text.to_string();
                Some(match tag {
                    "offline" => Failure::Offline(t),
                    "index-corrupt" => Failure::IndexCorrupt(t),
                    "corrupt-metadata" => Failure::CorruptMetadata(t),
                    "io" => Failure::Io(a as u32 as i32, t),
                    "shard-missing" => Failure::ShardMissing,
                    "shard-length" => Failure::ShardLength(a, b),
                    "shard-corrupt" => Failure::ShardCorrupt(a),
                    "shard-footer" => Failure::ShardFooter(t),
                    "superseded" => Failure::Superseded(a, b, t),
                    "late" => Failure::Late(t),
                    "away" => Failure::Away(t),
                    _ => Failure::Other(t),
                })
            })();
            parsed.unwrap_or_else(|| Failure::Other(m.to_string()))
        }

        pub fn of_store(e: &StoreError) -> Failure {
            match e {
                StoreError::IndexCorrupt { reason, .. } => Failure::IndexCorrupt(reason.clone()),
                StoreError::CorruptMetadata { what, .. } => Failure::CorruptMetadata(what.clone()),
                StoreError::Io(io) => Failure::of_io(io),
                StoreError::Superseded {
                    what,
                    held,
                    offered,
                    ..
                } => Failure::Superseded(*held, *offered, what.clone()),
                other => {
                    // ENOSPC inside a text-only error stays recognisable.
                    let t = other.to_string();
                    if t.contains("os error 28") {
                        Failure::Io(28, t)
                    } else {
                        Failure::Other(t)
                    }
                }
            }
        }

        pub fn of_io(e: &std::io::Error) -> Failure {
            Failure::Io(e.raw_os_error().unwrap_or(0), e.to_string())
        }

        pub fn of_shard(e: &ShardError) -> Failure {
            match e {
                ShardError::Missing => Failure::ShardMissing,
                ShardError::WrongLength { expected, actual } => {
                    Failure::ShardLength(*expected, *actual)
                }
                ShardError::Corrupt { block } => Failure::ShardCorrupt(*block),
                ShardError::BadFooter(t) => Failure::ShardFooter(t.to_string()),
                ShardError::Io(io) => Failure::of_io(io),
            }
        }

        pub fn into_store(self, drive: &str) -> StoreError {
            let drive = drive.to_string();
            match self {
                Failure::IndexCorrupt(reason) => StoreError::IndexCorrupt { drive, reason },
                Failure::CorruptMetadata(what) => StoreError::CorruptMetadata { drive, what },
                Failure::Io(..) => StoreError::from(self.into_io()),
                Failure::Offline(reason) => StoreError::Drive { drive, reason },
                Failure::Late(reason) => StoreError::Late { drive, reason },
                Failure::Away(reason) => StoreError::from(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    format!("drive {drive}: {reason}"),
                )),
                Failure::Superseded(held, offered, what) => StoreError::Superseded {
                    drive,
                    what,
                    held,
                    offered,
                },
                other => StoreError::Drive {
                    drive,
                    reason: format!("{other:?}"),
                },
            }
        }

        pub fn into_io(self) -> std::io::Error {
            match self {
                Failure::Io(errno, _) if errno != 0 => std::io::Error::from_raw_os_error(errno),
                Failure::Late(t) => std::io::Error::new(std::io::ErrorKind::TimedOut, t),
                Failure::Away(t) => std::io::Error::new(std::io::ErrorKind::NotConnected, t),
                Failure::Io(_, t) | Failure::Other(t) | Failure::Offline(t) => {
                    std::io::Error::other(t)
                }
                other => std::io::Error::other(format!("{other:?}")),
            }
        }

        pub fn into_shard(self) -> ShardError {
            match self {
                Failure::ShardMissing | Failure::Offline(_) | Failure::Away(_) => {
                    ShardError::Missing
                }
                Failure::ShardLength(expected, actual) => {
                    ShardError::WrongLength { expected, actual }
                }
                Failure::ShardCorrupt(block) => ShardError::Corrupt { block },
                // The footer reason is a fixed text on the sending side.
                Failure::ShardFooter(_) => ShardError::BadFooter("reported by the drive's node"),
                other => ShardError::Io(other.into_io()),
            }
        }
    }
}

/// Field encoding of message payloads: little-endian integers, byte strings
/// and UTF-8 strings prefixed by their u32 length.
#[derive(Default)]
pub struct Enc {
    pub buf: Vec<u8>,
}

impl Enc {
    pub fn new() -> Enc {
        Enc::default()
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    pub fn fixed(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads what `Enc` wrote; every read checks the bytes are there.
pub struct Dec<'a> {
    b: &'a [u8],
}

impl<'a> Dec<'a> {
    pub fn new(b: &'a [u8]) -> Dec<'a> {
        Dec { b }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated("message field"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes()?).map_err(|_| WireError::Invalid("UTF-8 field"))
    }
    pub fn fixed<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.take(N)?.try_into().expect("N"))
    }
    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.b.len()
    }
    /// The message must end here: trailing bytes are an error.
    pub fn end(&self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::Invalid("trailing bytes in message"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::Request),
            Just(Kind::Response),
            Just(Kind::Data),
            Just(Kind::End),
            Just(Kind::Error)
        ]
    }

    proptest! {
        #[test]
        fn header_round_trips(kind in kind(), body in any::<bool>(), op in any::<u16>(),
                              call in any::<u64>(), epoch in any::<u64>(), aux in any::<u32>(),
                              payload in proptest::collection::vec(any::<u8>(), 0..300)) {
            let body = body && matches!(kind, Kind::Request | Kind::Response);
            let h = Header::new(kind, op, call, epoch, aux).with_body(body);
            let b = h.encode(&payload);
            let d = Header::decode(&b).unwrap();
            prop_assert_eq!(d.kind, kind);
            prop_assert_eq!(d.has_body(), body);
            prop_assert_eq!((d.op, d.call, d.epoch, d.aux), (op, call, epoch, aux));
            prop_assert_eq!(d.len as usize, payload.len());
            prop_assert!(d.check_payload(&payload).is_ok());
        }

        /// Any single bit flipped in header or payload is caught: by the
        /// header's validation or by the CRC.
        #[test]
        fn a_flipped_bit_is_caught(payload in proptest::collection::vec(any::<u8>(), 1..200),
                                   bit in 0usize..(32 + 200) * 8) {
            let h = Header::new(Kind::Request, op::PING, 7, 3, 1000);
            let mut frame = h.encode(&payload).to_vec();
            frame.extend_from_slice(&payload);
            let bit = bit % (frame.len() * 8);
            frame[bit / 8] ^= 1 << (bit % 8);
            let head: [u8; HEADER_BYTES] = frame[..HEADER_BYTES].try_into().unwrap();
            match Header::decode(&head) {
                Err(_) => {}
                Ok(d) => prop_assert!(d.check_payload(&frame[HEADER_BYTES..]).is_err()),
            }
        }

        #[test]
        fn header_decode_never_panics(b in proptest::array::uniform32(any::<u8>())) {
            if let Ok(h) = Header::decode(&b) {
                let max = if h.kind == Kind::Data { DATA_MAX_BYTES } else { MESSAGE_MAX_BYTES };
                prop_assert!(h.len <= max);
            }
        }

        #[test]
        fn hello_round_trips(cluster in "[a-z0-9-]{1,63}", node in "[a-zA-Z0-9_.-]{1,63}",
                             bulk in any::<bool>(), nonce in proptest::array::uniform32(any::<u8>())) {
            let h = Hello {
                version: PROTOCOL_VERSION,
                channel: if bulk { Channel::Bulk } else { Channel::Control },
                cluster, node_id: node, nonce,
            };
            prop_assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn lease_calls_round_trip(kind in 0u8..4, owner in proptest::array::uniform16(any::<u8>()),
                                  ttl_ms in any::<u32>(),
                                  items in proptest::collection::vec((any::<u64>(), any::<bool>()), 1..16),
                                  pins in proptest::collection::vec(proptest::array::uniform16(any::<u8>()), 0..40)) {
            use tarn_store::lock::{LeaseCall, LockMode};
            let call = match kind {
                0 => LeaseCall::Acquire {
                    owner,
                    items: items.iter().map(|&(r, w)| (r, if w { LockMode::Write } else { LockMode::Read })).collect(),
                    ttl_ms,
                },
                1 => LeaseCall::Refresh { owner, ttl_ms },
                2 => LeaseCall::Pin { owner, data_ids: pins, ttl_ms },
                _ => LeaseCall::Release { owner },
            };
            let mut e = Enc::new();
            drive::lease_call(&mut e, &call);
            let buf = e.finish();
            prop_assert_eq!(drive::decode_lease_call(&mut Dec::new(&buf)).unwrap(), call);
            // Every shorter message is refused, not misread.
            for cut in 0..buf.len() {
                prop_assert!(drive::decode_lease_call(&mut Dec::new(&buf[..cut])).is_err());
            }
        }

        #[test]
        fn lease_call_decoder_never_panics(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = drive::decode_lease_call(&mut Dec::new(&b));
        }

        #[test]
        fn handshake_decoders_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Hello::decode(&b);
            let _ = Challenge::decode(&b);
            let _ = Welcome::decode(&b);
        }

        #[test]
        fn fields_round_trip(a in any::<u8>(), b in any::<u16>(), c in any::<u32>(), d in any::<u64>(),
                             s in ".{0,40}", v in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut e = Enc::new();
            e.u8(a).u16(b).u32(c).u64(d).str(&s).bytes(&v).fixed(&[9; 4]);
            let buf = e.finish();
            let mut r = Dec::new(&buf);
            prop_assert_eq!(r.u8().unwrap(), a);
            prop_assert_eq!(r.u16().unwrap(), b);
            prop_assert_eq!(r.u32().unwrap(), c);
            prop_assert_eq!(r.u64().unwrap(), d);
            prop_assert_eq!(r.str().unwrap(), s.as_str());
            prop_assert_eq!(r.bytes().unwrap(), &v[..]);
            prop_assert_eq!(r.fixed::<4>().unwrap(), [9; 4]);
            prop_assert!(r.end().is_ok());
            // Every truncation fails cleanly.
            for cut in 0..buf.len() {
                let mut r = Dec::new(&buf[..cut]);
                let all = (|| -> Result<(), WireError> {
                    r.u8()?; r.u16()?; r.u32()?; r.u64()?; r.str()?; r.bytes()?; r.fixed::<4>()?; Ok(())
                })();
                prop_assert!(all.is_err());
            }
        }
    }

    #[test]
    fn challenge_round_trips() {
        let c = Challenge {
            version: PROTOCOL_VERSION,
            status: Refusal::Accepted,
            node_id: "n2".into(),
            nonce: [4; 32],
        };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        let w = Welcome {
            status: Refusal::Accepted,
            proof: [5; 32],
        };
        assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
        assert!(Welcome::decode(&w.encode()[..WELCOME_BYTES - 1]).is_err());
    }

    #[test]
    fn oversized_frames_are_refused_before_any_allocation() {
        let mut b = Header::new(Kind::Response, op::PING, 1, 1, 0).encode(&[]);
        b[4..8].copy_from_slice(&(MESSAGE_MAX_BYTES + 1).to_le_bytes());
        assert!(matches!(
            Header::decode(&b),
            Err(WireError::TooLarge { .. })
        ));
        let mut b = Header::new(Kind::Data, op::PING, 1, 1, 0).encode(&[]);
        b[4..8].copy_from_slice(&(DATA_MAX_BYTES + 1).to_le_bytes());
        assert!(matches!(
            Header::decode(&b),
            Err(WireError::TooLarge { .. })
        ));
        b[4..8].copy_from_slice(&DATA_MAX_BYTES.to_le_bytes());
        assert!(Header::decode(&b).is_ok());
    }

    #[test]
    fn proofs_bind_side_names_and_nonces() {
        let (cn, sn) = ([1u8; 32], [2u8; 32]);
        let t = Transcript {
            cluster: "c",
            client_id: "a",
            server_id: "b",
            client_nonce: &cn,
            server_nonce: &sn,
        };
        let p = proof(Side::Client, b"secret", &t);
        assert!(verify(Side::Client, b"secret", &t, &p));
        assert!(!verify(Side::Server, b"secret", &t, &p), "reflected");
        assert!(!verify(Side::Client, b"secreT", &t, &p), "other secret");
        let swapped = Transcript {
            client_id: "b",
            server_id: "a",
            ..t
        };
        assert!(!verify(Side::Client, b"secret", &swapped, &p));
        let other_nonce = Transcript {
            server_nonce: &cn,
            ..t
        };
        assert!(!verify(Side::Client, b"secret", &other_nonce, &p));
    }
}
