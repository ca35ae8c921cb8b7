//! The KV wire protocol, version 2: frame header, requests and responses, byte
//! by byte as `docs/kv-protocol.md` describes them. Client and server both use
//! this module; nothing else encodes or decodes KV frames.
//!
//! Every integer is little-endian. Decoding never panics on any input: a frame
//! that does not parse is an [`ProtoError`], which the server answers with an
//! error frame.

use std::fmt;

pub use crate::auth::{Nonce, Proof, NONCE_BYTES, PROOF_BYTES};
use crate::auth::{ACCESS_KEY_MAX_BYTES, GRANTS_MAX, TENANT_NAME_MAX_BYTES};

/// First two bytes of every frame ("TK" read as a little-endian u16).
pub const FRAME_MAGIC: u16 = 0x4b54;
/// Frame header length in bytes.
pub const FRAME_HEADER_BYTES: usize = 24;
/// Protocol versions this build speaks.
/// Version 2 added authentication (AUTH) and replaced RESERVE/COMMIT, which
/// let a client write into the shared arena, with PUT_SHM; a version-1 client
/// has no way to authenticate, so it is refused.
pub const VERSION_MIN: u16 = 2;
pub const VERSION_MAX: u16 = 2;
/// Length of a block digest (vLLM block hash, SGLang page hash, ...).
pub const DIGEST_BYTES: usize = 32;
/// Longest namespace accepted (model, dtype, layout, block size, tenant).
pub const NAMESPACE_MAX_BYTES: usize = 512;
/// Most keys in one batch. Engines batch a prefix's blocks (128 and more).
pub const BATCH_MAX_KEYS: usize = 1024;
/// Largest control part of any frame (everything but PUT's bulk data): the
/// biggest is a full batch of PUT_SHM entries plus the namespace.
pub const CONTROL_MAX_BYTES: usize = BATCH_HEADER_BYTES
    + NAMESPACE_MAX_BYTES
    + ROUTE_BYTES
    + BATCH_MAX_KEYS * (PUT_SHM_ENTRY_BYTES + PART_BYTES);
/// Fixed part of a batch: ns_len u16, flags u16, count u32, arg u32.
pub const BATCH_HEADER_BYTES: usize = 12;
pub const GET_ENTRY_BYTES: usize = DIGEST_BYTES + 16;
pub const PUT_ENTRY_BYTES: usize = DIGEST_BYTES + 16;
pub const PUT_SHM_ENTRY_BYTES: usize = DIGEST_BYTES + 24;
pub const GET_TCP_RESULT_BYTES: usize = 24;
pub const GET_SHM_RESULT_BYTES: usize = 40;
/// Length value meaning "to the end of the value" in a GET entry.
pub const LENGTH_TO_END: u64 = u64::MAX;
/// HELLO flag: the client is on a Unix socket and wants the arena.
pub const HELLO_WANT_SHM: u32 = 1;
/// HELLO response flag: the server offers shared memory (its socket name follows).
pub const HELLO_SHM_OFFERED: u32 = 1;
/// HELLO flag on the Unix socket: the client wants a request mailbox
/// (`mailbox.rs`); requests then travel through it instead of the socket.
pub const HELLO_WANT_MAILBOX: u32 = 2;
/// AUTH flag (Unix socket): a put window descriptor is attached (SCM_RIGHTS).
pub const AUTH_WINDOW: u16 = 1;
/// AUTH response flags: the arena descriptor is attached; a mailbox
/// descriptor follows it; the client's put window was accepted.
pub const AUTH_SHM: u16 = 1;
pub const AUTH_MAILBOX: u16 = 2;
pub const AUTH_WINDOW_ACCEPTED: u16 = 4;
/// Batch head flag: a [`Route`] (16 bytes) follows the namespace; the node
/// refuses the batch with `NotOwner` when it routes by a newer, different
/// view of the cluster's KV members.
pub const BATCH_ROUTED: u16 = 1;
/// Batch head flag: the keys' first-ranked node missed them and the client
/// asks the next one (counted per namespace as fallback gets and hits).
pub const BATCH_FALLBACK: u16 = 2;
/// Batch head flag: a put copying blocks found elsewhere (a fallback hit
/// written back to its owner, or a hot block's second copy).
pub const BATCH_COPY: u16 = 4;
/// Batch head flag on PUT and PUT_SHM: every entry is followed by a
/// [`Part`] (16 bytes); the entry's length and CRC are the part's, and the
/// value becomes visible once every byte of it was put (by any writers).
pub const BATCH_PARTS: u16 = 8;
/// Bytes of a [`Part`] after a PUT or PUT_SHM entry.
pub const PART_BYTES: usize = 16;
const BATCH_FLAGS_KNOWN: u16 = BATCH_ROUTED | BATCH_FALLBACK | BATCH_COPY | BATCH_PARTS;
/// Bytes of a [`Route`] in a batch head.
pub const ROUTE_BYTES: usize = 16;
/// Get result flag (byte 1 of a GET or GET_SHM result): the block is read
/// often; a client routing over a cluster may keep a second copy of it on
/// the next-ranked node and spread its reads over both.
pub const RESULT_HOT: u8 = 1;

const _: () = assert!(CONTROL_MAX_BYTES < 1 << 20);
const _: () = assert!(BATCH_MAX_KEYS >= 128);
const _: () = assert!(PUT_SHM_ENTRY_BYTES >= GET_ENTRY_BYTES);

/// Operation codes. A response carries the request's op with [`RESPONSE_BIT`]
/// set; an error response is [`Op::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum Op {
    Hello = 1,
    Exists = 2,
    Get = 3,
    GetShm = 4,
    Put = 5,
    // 6 and 7 were RESERVE and COMMIT (version 1): retired.
    Touch = 8,
    Pin = 9,
    Unpin = 10,
    Delete = 11,
    Stats = 12,
    Auth = 13,
    PutShm = 14,
    Cluster = 15,
    Error = 0x7fff,
}

pub const RESPONSE_BIT: u16 = 0x8000;

impl Op {
    pub fn from_u16(v: u16) -> Option<Op> {
        Some(match v {
            1 => Op::Hello,
            2 => Op::Exists,
            3 => Op::Get,
            4 => Op::GetShm,
            5 => Op::Put,
            8 => Op::Touch,
            9 => Op::Pin,
            10 => Op::Unpin,
            11 => Op::Delete,
            12 => Op::Stats,
            13 => Op::Auth,
            14 => Op::PutShm,
            15 => Op::Cluster,
            0x7fff => Op::Error,
            _ => return None,
        })
    }
}

/// Per-key outcome, one byte on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Done (get: bytes delivered; put: stored).
    Ok = 0,
    /// No such block: never stored, evicted or deleted. A normal miss.
    NotFound = 1,
    /// Put of a key already stored: an idempotent success, nothing written.
    AlreadyExists = 2,
    /// Value larger than the server's maximum.
    TooLarge = 3,
    /// No room: every candidate slot is pinned or reserved.
    NoSpace = 4,
    /// Stored bytes failed their checksum; the block was dropped. A miss.
    Corrupt = 5,
    /// The byte range lies outside the value.
    BadRange = 6,
    /// Put data did not match the checksum the client sent; nothing stored.
    ChecksumMismatch = 7,
    /// A PUT_SHM entry names bytes outside the connection's put window (or
    /// the connection has none); nothing stored. (Version 1: BadToken.)
    BadWindow = 8,
    /// The caller's buffer is smaller than the bytes asked for (client-side).
    BufferTooSmall = 9,
}

impl Status {
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NotFound,
            2 => Status::AlreadyExists,
            3 => Status::TooLarge,
            4 => Status::NoSpace,
            5 => Status::Corrupt,
            6 => Status::BadRange,
            7 => Status::ChecksumMismatch,
            8 => Status::BadWindow,
            9 => Status::BufferTooSmall,
            _ => return None,
        })
    }

    /// True when the key's data is (now) stored: stored by this call or before.
    pub fn is_stored(self) -> bool {
        matches!(self, Status::Ok | Status::AlreadyExists)
    }

    /// True for outcomes that mean "not available, recompute": a normal miss.
    pub fn is_miss(self) -> bool {
        matches!(self, Status::NotFound | Status::Corrupt)
    }
}

/// Frame-level error codes (payload of an [`Op::Error`] frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// The payload does not parse (counts, lengths, namespace).
    BadFrame = 1,
    UnknownOp = 2,
    /// No protocol version in common.
    Version = 3,
    /// A limit was exceeded (batch size, frame length, namespaces).
    Limit = 4,
    /// A shared-memory operation on a TCP connection.
    NotShm = 5,
    /// The connection has not done HELLO and AUTH yet: closed after this.
    HandshakeRequired = 6,
    Internal = 7,
    /// The frame header itself is bad: the connection is closed after this.
    BadHeader = 8,
    /// AUTH failed (unknown access key, wrong proof): closed after this. On
    /// a batch, the namespace is not granted to the connection's tenant.
    Denied = 9,
    /// The batch was routed by a view of the cluster's KV members older than
    /// the node's and different from it: ask CLUSTER again and re-route.
    NotOwner = 10,
}

impl ErrorCode {
    pub fn from_u16(v: u16) -> ErrorCode {
        match v {
            1 => ErrorCode::BadFrame,
            2 => ErrorCode::UnknownOp,
            3 => ErrorCode::Version,
            4 => ErrorCode::Limit,
            5 => ErrorCode::NotShm,
            6 => ErrorCode::HandshakeRequired,
            8 => ErrorCode::BadHeader,
            9 => ErrorCode::Denied,
            10 => ErrorCode::NotOwner,
            _ => ErrorCode::Internal,
        }
    }
}

/// A payload that does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtoError {
    pub code: ErrorCode,
    pub message: String,
}

impl ProtoError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ProtoError {
            code,
            message: message.into(),
        }
    }
    fn bad(message: impl Into<String>) -> Self {
        ProtoError::new(ErrorCode::BadFrame, message)
    }
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}: {}", self.code, self.message)
    }
}

impl std::error::Error for ProtoError {}

pub type Digest = [u8; DIGEST_BYTES];

/// The 24-byte frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Raw op code (with [`RESPONSE_BIT`] on responses).
    pub op: u16,
    /// Reserved, zero in version 1.
    pub flags: u16,
    /// Bytes after the header, bulk data included.
    pub len: u64,
    /// Chosen by the client, echoed by the server.
    pub request_id: u64,
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; FRAME_HEADER_BYTES] {
        let mut b = [0u8; FRAME_HEADER_BYTES];
        b[0..2].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[2..4].copy_from_slice(&self.op.to_le_bytes());
        b[4..6].copy_from_slice(&self.flags.to_le_bytes());
        // 6..8 reserved
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.request_id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; FRAME_HEADER_BYTES]) -> Result<FrameHeader, ProtoError> {
        let magic = u16::from_le_bytes([b[0], b[1]]);
        if magic != FRAME_MAGIC {
            return Err(ProtoError::new(
                ErrorCode::BadHeader,
                format!("bad frame magic {magic:#06x}"),
            ));
        }
        Ok(FrameHeader {
            op: u16::from_le_bytes([b[2], b[3]]),
            flags: u16::from_le_bytes([b[4], b[5]]),
            len: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            request_id: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        })
    }
}

/// Bounds-checked little-endian reader over a payload.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.remaining() < n {
            return Err(ProtoError::bad(format!(
                "payload ends early: needed {n} bytes at {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, ProtoError> {
        Ok(self.bytes(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }
    pub fn digest(&mut self) -> Result<Digest, ProtoError> {
        Ok(self.bytes(DIGEST_BYTES)?.try_into().expect("32"))
    }
    pub fn finish(&self) -> Result<(), ProtoError> {
        if self.remaining() != 0 {
            return Err(ProtoError::bad(format!(
                "{} trailing bytes in payload",
                self.remaining()
            )));
        }
        Ok(())
    }
}

/// Little-endian appends onto a reusable buffer.
pub trait Put {
    fn put_u8(&mut self, v: u8);
    fn put_u16(&mut self, v: u16);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
}

impl Put for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v)
    }
    fn put_u16(&mut self, v: u16) {
        self.extend_from_slice(&v.to_le_bytes())
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes())
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes())
    }
}

/// Starts a frame in `out` (cleared first): header with a length to be patched
/// by [`finish_frame`].
pub fn begin_frame(out: &mut Vec<u8>, op: u16, request_id: u64) {
    out.clear();
    out.extend_from_slice(
        &FrameHeader {
            op,
            flags: 0,
            len: 0,
            request_id,
        }
        .encode(),
    );
}

/// Patches the frame length: the bytes in `out` after the header plus `bulk`
/// bytes sent after it (PUT data, GET data).
pub fn finish_frame(out: &mut [u8], bulk: u64) {
    let len = (out.len() - FRAME_HEADER_BYTES) as u64 + bulk;
    out[8..16].copy_from_slice(&len.to_le_bytes());
}

/// The fixed head of every batch request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHead<'a> {
    pub namespace: &'a [u8],
    pub flags: u16,
    pub count: u32,
    /// Operation-specific: the lease in milliseconds for PIN, else 0.
    pub arg: u32,
    /// With [`BATCH_ROUTED`]: the view the client routed by.
    pub route: Option<Route>,
}

/// The view of the cluster's KV members a client routed a batch by: the
/// epoch it was published at (an etcd revision; larger is newer) and a hash
/// of its contents (two nodes may publish the same members at different
/// epochs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Route {
    pub epoch: u64,
    pub view: u64,
}

pub fn put_batch_head(out: &mut Vec<u8>, namespace: &[u8], count: usize, arg: u32) {
    put_batch_head_with(out, namespace, count, arg, 0, None);
}

/// A batch head with flags, and the route when `route` is given (which sets
/// [`BATCH_ROUTED`]).
pub fn put_batch_head_with(
    out: &mut Vec<u8>,
    namespace: &[u8],
    count: usize,
    arg: u32,
    flags: u16,
    route: Option<Route>,
) {
    let flags = (flags & !BATCH_ROUTED) | if route.is_some() { BATCH_ROUTED } else { 0 };
    out.put_u16(namespace.len() as u16);
    out.put_u16(flags);
    out.put_u32(count as u32);
    out.put_u32(arg);
    out.extend_from_slice(namespace);
    if let Some(r) = route {
        out.put_u64(r.epoch);
        out.put_u64(r.view);
    }
}

/// Parses a batch head; checks the namespace length and the key count against
/// the protocol limits and against the bytes that follow (`entry_bytes` each).
pub fn read_batch_head<'a>(
    r: &mut Reader<'a>,
    entry_bytes: usize,
) -> Result<BatchHead<'a>, ProtoError> {
    let ns_len = r.u16()? as usize;
    let flags = r.u16()?;
    let count = r.u32()?;
    let arg = r.u32()?;
    if ns_len > NAMESPACE_MAX_BYTES {
        return Err(ProtoError::new(
            ErrorCode::Limit,
            format!("namespace of {ns_len} bytes exceeds {NAMESPACE_MAX_BYTES}"),
        ));
    }
    if count as usize > BATCH_MAX_KEYS {
        return Err(ProtoError::new(
            ErrorCode::Limit,
            format!("batch of {count} keys exceeds {BATCH_MAX_KEYS}"),
        ));
    }
    if flags & !BATCH_FLAGS_KNOWN != 0 {
        return Err(ProtoError::bad(format!(
            "unknown batch flags {:#06x}",
            flags & !BATCH_FLAGS_KNOWN
        )));
    }
    let namespace = r.bytes(ns_len)?;
    let route = if flags & BATCH_ROUTED != 0 {
        Some(Route {
            epoch: r.u64()?,
            view: r.u64()?,
        })
    } else {
        None
    };
    if r.remaining() < count as usize * entry_bytes {
        return Err(ProtoError::bad(format!(
            "batch says {count} entries but carries {} bytes",
            r.remaining()
        )));
    }
    Ok(BatchHead {
        namespace,
        flags,
        count,
        arg,
        route,
    })
}

/// HELLO request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version_min: u16,
    pub version_max: u16,
    pub flags: u32,
}

impl Hello {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u16(self.version_min);
        out.put_u16(self.version_max);
        out.put_u32(self.flags);
    }
    pub fn decode(payload: &[u8]) -> Result<Hello, ProtoError> {
        let mut r = Reader::new(payload);
        let h = Hello {
            version_min: r.u16()?,
            version_max: r.u16()?,
            flags: r.u32()?,
        };
        r.finish()?;
        Ok(h)
    }
}

/// HELLO response: the chosen version, the server's limits and the nonce
/// the client's AUTH proof must cover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    pub version: u16,
    pub flags: u32,
    pub value_max_bytes: u64,
    pub batch_max_keys: u32,
    pub namespace_max_bytes: u16,
    /// Random per server process: a client on the Unix socket checks it matches
    /// the server it reached over TCP.
    pub instance_id: [u8; 16],
    /// Random per connection: the challenge of this connection's AUTH.
    pub nonce: Nonce,
    /// The Unix socket for shared memory (empty when not offered): an
    /// abstract name, or a file's path when it starts with `/`.
    pub shm_socket: Vec<u8>,
}

/// Longest abstract socket name a HELLO reply may carry.
pub const SHM_SOCKET_NAME_MAX_BYTES: usize = 256;

impl HelloReply {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u16(self.version);
        out.put_u16(self.namespace_max_bytes);
        out.put_u32(self.flags);
        out.put_u64(self.value_max_bytes);
        out.put_u32(self.batch_max_keys);
        out.put_u32(self.shm_socket.len() as u32);
        out.extend_from_slice(&self.instance_id);
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&self.shm_socket);
    }
    pub fn decode(payload: &[u8]) -> Result<HelloReply, ProtoError> {
        let mut r = Reader::new(payload);
        let version = r.u16()?;
        let namespace_max_bytes = r.u16()?;
        let flags = r.u32()?;
        let value_max_bytes = r.u64()?;
        let batch_max_keys = r.u32()?;
        let name_len = r.u32()? as usize;
        if name_len > SHM_SOCKET_NAME_MAX_BYTES {
            return Err(ProtoError::bad("shm socket name too long"));
        }
        let instance_id = r.bytes(16)?.try_into().expect("16");
        let nonce = r.bytes(NONCE_BYTES)?.try_into().expect("32");
        let shm_socket = r.bytes(name_len)?.to_vec();
        r.finish()?;
        Ok(HelloReply {
            version,
            flags,
            value_max_bytes,
            batch_max_keys,
            namespace_max_bytes,
            instance_id,
            nonce,
            shm_socket,
        })
    }
}

/// AUTH request: an access key and the proof that the client knows its
/// secret (`auth.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    pub flags: u16,
    pub client_nonce: Nonce,
    pub proof: Proof,
    pub access_key: Vec<u8>,
}

/// Fixed part of an AUTH request.
pub const AUTH_FIXED_BYTES: usize = 8 + NONCE_BYTES + PROOF_BYTES;
/// Largest AUTH request payload.
pub const AUTH_MAX_BYTES: usize = AUTH_FIXED_BYTES + ACCESS_KEY_MAX_BYTES;

impl Auth {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u16(self.access_key.len() as u16);
        out.put_u16(self.flags);
        out.put_u32(0);
        out.extend_from_slice(&self.client_nonce);
        out.extend_from_slice(&self.proof);
        out.extend_from_slice(&self.access_key);
    }
    pub fn decode(payload: &[u8]) -> Result<Auth, ProtoError> {
        let mut r = Reader::new(payload);
        let key_len = r.u16()? as usize;
        let flags = r.u16()?;
        r.u32()?;
        if key_len == 0 || key_len > ACCESS_KEY_MAX_BYTES {
            return Err(ProtoError::bad(format!(
                "access key of {key_len} bytes (1 to {ACCESS_KEY_MAX_BYTES})"
            )));
        }
        let a = Auth {
            flags,
            client_nonce: r.bytes(NONCE_BYTES)?.try_into().expect("32"),
            proof: r.bytes(PROOF_BYTES)?.try_into().expect("32"),
            access_key: r.bytes(key_len)?.to_vec(),
        };
        r.finish()?;
        Ok(a)
    }
}

/// AUTH response: the server's proof, the tenant and what it may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthReply {
    pub flags: u16,
    pub server_proof: Proof,
    /// Length of the arena whose descriptor is attached (0 without `AUTH_SHM`).
    pub arena_bytes: u64,
    pub tenant: String,
    /// Namespace prefixes the tenant may use (an empty one: any).
    pub grants: Vec<Vec<u8>>,
}

impl AuthReply {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u16(self.flags);
        out.put_u16(self.tenant.len() as u16);
        out.put_u16(self.grants.len() as u16);
        out.put_u16(0);
        out.extend_from_slice(&self.server_proof);
        out.put_u64(self.arena_bytes);
        out.extend_from_slice(self.tenant.as_bytes());
        for g in &self.grants {
            out.put_u16(g.len() as u16);
            out.extend_from_slice(g);
        }
    }
    pub fn decode(payload: &[u8]) -> Result<AuthReply, ProtoError> {
        let mut r = Reader::new(payload);
        let flags = r.u16()?;
        let tenant_len = r.u16()? as usize;
        let grant_count = r.u16()? as usize;
        r.u16()?;
        if tenant_len > TENANT_NAME_MAX_BYTES || grant_count > GRANTS_MAX {
            return Err(ProtoError::bad("AUTH reply over its limits"));
        }
        let server_proof = r.bytes(PROOF_BYTES)?.try_into().expect("32");
        let arena_bytes = r.u64()?;
        let tenant = String::from_utf8_lossy(r.bytes(tenant_len)?).into_owned();
        let mut grants = Vec::with_capacity(grant_count);
        for _ in 0..grant_count {
            let n = r.u16()? as usize;
            if n > NAMESPACE_MAX_BYTES {
                return Err(ProtoError::bad("namespace grant longer than a namespace"));
            }
            grants.push(r.bytes(n)?.to_vec());
        }
        r.finish()?;
        Ok(AuthReply {
            flags,
            server_proof,
            arena_bytes,
            tenant,
            grants,
        })
    }
}

/// One GET entry: a whole value (`offset` 0, `length` [`LENGTH_TO_END`]) or a
/// byte range of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetEntry {
    pub digest: Digest,
    pub offset: u64,
    pub length: u64,
}

impl GetEntry {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.digest);
        out.put_u64(self.offset);
        out.put_u64(self.length);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<GetEntry, ProtoError> {
        Ok(GetEntry {
            digest: r.digest()?,
            offset: r.u64()?,
            length: r.u64()?,
        })
    }

    /// The bytes this entry asks for out of a value of `value_len` bytes.
    pub fn range(&self, value_len: u64) -> Option<(u64, u64)> {
        if self.offset > value_len {
            return None;
        }
        let avail = value_len - self.offset;
        let len = if self.length == LENGTH_TO_END {
            avail
        } else if self.length <= avail {
            self.length
        } else {
            return None;
        };
        Some((self.offset, len))
    }
}

/// Result of one GET entry over TCP; `data_len` bytes follow the result table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetResult {
    pub status: Status,
    /// The block is read often ([`RESULT_HOT`]).
    pub hot: bool,
    /// CRC32C of the whole value.
    pub crc: u32,
    pub value_len: u64,
    pub data_len: u64,
}

impl GetResult {
    pub fn miss(status: Status) -> Self {
        GetResult {
            status,
            hot: false,
            crc: 0,
            value_len: 0,
            data_len: 0,
        }
    }
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u8(self.status as u8);
        out.put_u8(if self.hot { RESULT_HOT } else { 0 });
        out.extend_from_slice(&[0; 2]);
        out.put_u32(self.crc);
        out.put_u64(self.value_len);
        out.put_u64(self.data_len);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<GetResult, ProtoError> {
        let status = status(r.u8()?)?;
        let flags = r.u8()?;
        r.bytes(2)?;
        let g = GetResult {
            status,
            hot: flags & RESULT_HOT != 0,
            crc: r.u32()?,
            value_len: r.u64()?,
            data_len: r.u64()?,
        };
        if g.status != Status::Ok && g.data_len != 0 {
            return Err(ProtoError::bad("data on a failed get"));
        }
        Ok(g)
    }
}

/// Result of one GET entry over shared memory: where the bytes are in the
/// arena and the slot generation to check after copying them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmGetResult {
    pub status: Status,
    /// The block is read often ([`RESULT_HOT`]).
    pub hot: bool,
    pub crc: u32,
    pub value_len: u64,
    pub data_len: u64,
    /// Arena offset of the first byte asked for.
    pub arena_offset: u64,
    /// Index into the arena's generation table.
    pub slot: u32,
    /// The slot's generation when answered; changed means the slot was reused.
    pub generation: u32,
}

impl ShmGetResult {
    pub fn miss(status: Status) -> Self {
        ShmGetResult {
            status,
            hot: false,
            crc: 0,
            value_len: 0,
            data_len: 0,
            arena_offset: 0,
            slot: 0,
            generation: 0,
        }
    }
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u8(self.status as u8);
        out.put_u8(if self.hot { RESULT_HOT } else { 0 });
        out.extend_from_slice(&[0; 2]);
        out.put_u32(self.crc);
        out.put_u64(self.value_len);
        out.put_u64(self.data_len);
        out.put_u64(self.arena_offset);
        out.put_u32(self.slot);
        out.put_u32(self.generation);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<ShmGetResult, ProtoError> {
        let status = status(r.u8()?)?;
        let flags = r.u8()?;
        r.bytes(2)?;
        Ok(ShmGetResult {
            status,
            hot: flags & RESULT_HOT != 0,
            crc: r.u32()?,
            value_len: r.u64()?,
            data_len: r.u64()?,
            arena_offset: r.u64()?,
            slot: r.u32()?,
            generation: r.u32()?,
        })
    }
}

/// One PUT entry over TCP; the `len` data bytes follow the entry table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutEntry {
    pub digest: Digest,
    pub len: u64,
    /// CRC32C of the value, checked before the block becomes visible.
    pub crc: u32,
}

impl PutEntry {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.digest);
        out.put_u64(self.len);
        out.put_u32(self.crc);
        out.put_u32(0);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<PutEntry, ProtoError> {
        let e = PutEntry {
            digest: r.digest()?,
            len: r.u64()?,
            crc: r.u32()?,
        };
        r.u32()?;
        Ok(e)
    }
}

/// One PUT_SHM entry: a value the client wrote into its put window; the
/// daemon copies it into the arena and checks it against `crc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutShmEntry {
    pub digest: Digest,
    pub len: u64,
    /// Offset of the value in the connection's put window.
    pub window_offset: u64,
    /// CRC32C of the value as the client wrote it.
    pub crc: u32,
}

impl PutShmEntry {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.digest);
        out.put_u64(self.len);
        out.put_u64(self.window_offset);
        out.put_u32(self.crc);
        out.put_u32(0);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<PutShmEntry, ProtoError> {
        let e = PutShmEntry {
            digest: r.digest()?,
            len: r.u64()?,
            window_offset: r.u64()?,
            crc: r.u32()?,
        };
        r.u32()?;
        Ok(e)
    }
}

/// Where a put entry's bytes go in its value, with [`BATCH_PARTS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    /// Length of the whole value.
    pub value_len: u64,
    /// Offset of this part's first byte in the value.
    pub offset: u64,
}

impl Part {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u64(self.value_len);
        out.put_u64(self.offset);
    }
    pub fn decode(r: &mut Reader<'_>) -> Result<Part, ProtoError> {
        Ok(Part {
            value_len: r.u64()?,
            offset: r.u64()?,
        })
    }
}

fn status(v: u8) -> Result<Status, ProtoError> {
    Status::from_u8(v).ok_or_else(|| ProtoError::bad(format!("unknown status {v}")))
}

/// A response that is a table of one status byte per key (PUT, PUT_SHM,
/// TOUCH, PIN, UNPIN, DELETE): count u32 then the statuses.
pub fn encode_statuses(out: &mut Vec<u8>, statuses: &[Status]) {
    out.put_u32(statuses.len() as u32);
    out.extend(statuses.iter().map(|s| *s as u8));
}

pub fn decode_statuses(payload: &[u8], expect: usize) -> Result<Vec<Status>, ProtoError> {
    let mut r = Reader::new(payload);
    let n = r.u32()? as usize;
    if n != expect {
        return Err(ProtoError::bad(format!("{n} statuses for {expect} keys")));
    }
    let s = r
        .bytes(n)?
        .iter()
        .map(|b| status(*b))
        .collect::<Result<Vec<_>, _>>()?;
    r.finish()?;
    Ok(s)
}

/// Most KV members a CLUSTER answer lists.
pub const VIEW_MEMBERS_MAX: usize = 1024;
/// Longest member id and endpoint in a CLUSTER answer.
pub const VIEW_ID_MAX_BYTES: usize = 64;
pub const VIEW_ENDPOINT_MAX_BYTES: usize = 256;
/// A member's weight at full share; a node that starts empty ramps up to it.
pub const WEIGHT_FULL: u32 = 1000;

/// One KV member of a cluster: its node id, its KV endpoint and its weight
/// in rendezvous hashing (per mille of a full share).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewMember {
    pub id: String,
    pub endpoint: String,
    pub weight: u32,
}

/// CLUSTER (15) response: the KV members this node routes by. A node outside
/// a cluster answers epoch 0 and no members.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterView {
    pub epoch: u64,
    /// Hash of the members ([`view_digest`]).
    pub view: u64,
    /// Index of the answering node in `members`.
    pub this: Option<u32>,
    /// Sorted by id.
    pub members: Vec<ViewMember>,
}

/// FNV-1a, 64 bits: stable across builds and platforms, for view digests
/// and rendezvous ids.
pub fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in (p.len() as u64).to_le_bytes().iter().chain(p.iter()) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The hash of a member list that names a view: equal lists, equal digests.
pub fn view_digest(members: &[ViewMember]) -> u64 {
    let mut h = fnv1a64(&[b"tarn-kv-view"]);
    for m in members {
        h ^= fnv1a64(&[
            m.id.as_bytes(),
            m.endpoint.as_bytes(),
            &m.weight.to_le_bytes(),
        ]);
        h = h.rotate_left(17).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h
}

impl ClusterView {
    /// A view of `members` (sorted here) published at `epoch`, answered by
    /// node `this_id`. Members whose id or endpoint a client could not
    /// decode (empty, or over the limits) are left out.
    pub fn new(epoch: u64, mut members: Vec<ViewMember>, this_id: &str) -> ClusterView {
        members.retain(|m| {
            (1..=VIEW_ID_MAX_BYTES).contains(&m.id.len())
                && m.endpoint.len() <= VIEW_ENDPOINT_MAX_BYTES
        });
        members.sort_by(|a, b| a.id.cmp(&b.id));
        members.dedup_by(|a, b| a.id == b.id);
        members.truncate(VIEW_MEMBERS_MAX);
        ClusterView {
            epoch,
            view: view_digest(&members),
            this: members
                .iter()
                .position(|m| m.id == this_id)
                .map(|i| i as u32),
            members,
        }
    }

    pub fn route(&self) -> Route {
        Route {
            epoch: self.epoch,
            view: self.view,
        }
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u64(self.epoch);
        out.put_u64(self.view);
        out.put_u32(self.members.len() as u32);
        out.put_u32(self.this.unwrap_or(u32::MAX));
        for m in &self.members {
            out.put_u16(m.id.len() as u16);
            out.put_u16(m.endpoint.len() as u16);
            out.put_u32(m.weight);
            out.extend_from_slice(m.id.as_bytes());
            out.extend_from_slice(m.endpoint.as_bytes());
        }
    }

    pub fn decode(payload: &[u8]) -> Result<ClusterView, ProtoError> {
        let mut r = Reader::new(payload);
        let epoch = r.u64()?;
        let view = r.u64()?;
        let count = r.u32()? as usize;
        let this = r.u32()?;
        if count > VIEW_MEMBERS_MAX {
            return Err(ProtoError::bad(format!("{count} members in a view")));
        }
        let mut members = Vec::with_capacity(count);
        for _ in 0..count {
            let id_len = r.u16()? as usize;
            let ep_len = r.u16()? as usize;
            let weight = r.u32()?;
            if id_len == 0 || id_len > VIEW_ID_MAX_BYTES || ep_len > VIEW_ENDPOINT_MAX_BYTES {
                return Err(ProtoError::bad("member id or endpoint length out of range"));
            }
            let text = |b: &[u8]| {
                std::str::from_utf8(b)
                    .map(str::to_string)
                    .map_err(|_| ProtoError::bad("member id or endpoint is not UTF-8"))
            };
            let id = text(r.bytes(id_len)?)?;
            let endpoint = text(r.bytes(ep_len)?)?;
            members.push(ViewMember {
                id,
                endpoint,
                weight,
            });
        }
        r.finish()?;
        let this = match this {
            u32::MAX => None,
            i if (i as usize) < count => Some(i),
            i => return Err(ProtoError::bad(format!("member index {i} of {count}"))),
        };
        Ok(ClusterView {
            epoch,
            view,
            this,
            members,
        })
    }
}

/// EXISTS response: how many keys from the first are all present (the prefix
/// an engine can load), plus one bit per key (bit i of byte i/8, LSB first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExistsReply {
    pub leading_hits: u32,
    pub present: Vec<bool>,
}

impl ExistsReply {
    pub fn encode_from(out: &mut Vec<u8>, present: &[bool]) {
        let leading = present.iter().take_while(|p| **p).count();
        out.put_u32(present.len() as u32);
        out.put_u32(leading as u32);
        for chunk in present.chunks(8) {
            let mut b = 0u8;
            for (i, p) in chunk.iter().enumerate() {
                if *p {
                    b |= 1 << i;
                }
            }
            out.push(b);
        }
    }
    pub fn decode(payload: &[u8], expect: usize) -> Result<ExistsReply, ProtoError> {
        let mut r = Reader::new(payload);
        let n = r.u32()? as usize;
        let leading_hits = r.u32()?;
        if n != expect || leading_hits as usize > n {
            return Err(ProtoError::bad("exists reply does not match the request"));
        }
        let bits = r.bytes(n.div_ceil(8))?;
        r.finish()?;
        let present: Vec<bool> = (0..n).map(|i| bits[i / 8] & (1 << (i % 8)) != 0).collect();
        if present.iter().take_while(|p| **p).count() != leading_hits as usize {
            return Err(ProtoError::bad(
                "exists leading run disagrees with the bitmap",
            ));
        }
        Ok(ExistsReply {
            leading_hits,
            present,
        })
    }
}

/// STATS response: named counters, u32 count then (u16 name length, name, u64).
pub fn encode_stats(out: &mut Vec<u8>, stats: &[(String, u64)]) {
    out.put_u32(stats.len() as u32);
    for (name, v) in stats {
        out.put_u16(name.len() as u16);
        out.extend_from_slice(name.as_bytes());
        out.put_u64(*v);
    }
}

pub fn decode_stats(payload: &[u8]) -> Result<Vec<(String, u64)>, ProtoError> {
    let mut r = Reader::new(payload);
    let n = r.u32()? as usize;
    if n > 4096 {
        return Err(ProtoError::bad("too many stats"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let len = r.u16()? as usize;
        let name = String::from_utf8_lossy(r.bytes(len)?).into_owned();
        out.push((name, r.u64()?));
    }
    r.finish()?;
    Ok(out)
}

/// Error frame payload: code u16, message length u16, UTF-8 message.
pub fn encode_error(out: &mut Vec<u8>, code: ErrorCode, message: &str) {
    let msg = &message.as_bytes()[..message.len().min(1024)];
    out.put_u16(code as u16);
    out.put_u16(msg.len() as u16);
    out.extend_from_slice(msg);
}

pub fn decode_error(payload: &[u8]) -> ProtoError {
    let mut r = Reader::new(payload);
    let parsed = (|| {
        let code = ErrorCode::from_u16(r.u16()?);
        let len = r.u16()? as usize;
        let msg = String::from_utf8_lossy(r.bytes(len)?).into_owned();
        Ok::<_, ProtoError>(ProtoError::new(code, msg))
    })();
    parsed.unwrap_or_else(|_| ProtoError::new(ErrorCode::Internal, "unreadable error frame"))
}

/// CRC32C, the checksum of every value.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// Incremental CRC32C, for checksumming while copying.
pub struct Crc32c(crc_fast::Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Crc32c(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data)
    }
    pub fn finish(&self) -> u32 {
        self.0.finalize() as u32
    }
}

/// Bytes copied between checksum updates: small enough that the copied chunk
/// is still in L1 (48 KiB per core here) when it is checksummed.
pub const COPY_CHUNK_BYTES: usize = 16 << 10;

/// Copies `src` into `dst` (same length) and returns the CRC32C of the bytes
/// as they landed in `dst`: one pass, so a get costs one copy. With AVX-512
/// the checksum is folded from the registers the copy goes through
/// (`crc_copy.rs`); elsewhere each 16 KiB chunk is checksummed from L1 right
/// after it is copied.
pub fn copy_with_crc(dst: &mut [u8], src: &[u8]) -> u32 {
    if let Some(crc) = crate::crc_copy::copy_with_crc(dst, src) {
        return crc;
    }
    copy_with_crc_chunked(dst, src)
}

/// [`copy_with_crc`] with non-temporal stores for a copy of
/// [`STREAM_MIN_BYTES`] or more (`crc_copy::copy_with_crc_streaming`): the
/// daemon filling an arena slot, which no one reads right after.
pub fn copy_with_crc_into_arena(dst: &mut [u8], src: &[u8]) -> u32 {
    if dst.len() >= STREAM_MIN_BYTES {
        if let Some(crc) = crate::crc_copy::copy_with_crc_streaming(dst, src) {
            return crc;
        }
    }
    copy_with_crc(dst, src)
}

/// Copies from this size on stream past the caches into the arena.
pub const STREAM_MIN_BYTES: usize = 256 << 10;

fn copy_with_crc_chunked(dst: &mut [u8], src: &[u8]) -> u32 {
    let mut crc = Crc32c::default();
    for (d, s) in dst
        .chunks_mut(COPY_CHUNK_BYTES)
        .zip(src.chunks(COPY_CHUNK_BYTES))
    {
        d.copy_from_slice(s);
        crc.update(d);
    }
    crc.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/kv-protocol.md states the limits a client must respect; they
    /// are checked against the constants here so the two cannot drift
    /// (they had: the document said 49,676 after parts made it larger).
    #[test]
    fn the_documented_limits_are_the_real_ones() {
        let doc = include_str!("../../../docs/kv-protocol.md");
        let thousands = |n: usize| {
            let s = n.to_string();
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if i > 0 && (s.len() - i).is_multiple_of(3) {
                    out.push(',');
                }
                out.push(c);
            }
            out
        };
        for needle in [
            format!("`CONTROL_MAX_BYTES` = {}", thousands(CONTROL_MAX_BYTES)),
            format!("a batch has at most {} keys", thousands(BATCH_MAX_KEYS)),
            format!("a namespace at most {NAMESPACE_MAX_BYTES} bytes"),
            format!("before AUTH a frame's body may be at most {AUTH_MAX_BYTES} bytes"),
        ] {
            assert!(
                doc.contains(&needle),
                "docs/kv-protocol.md lacks {needle:?}"
            );
        }
    }

    #[test]
    fn header_roundtrip_and_bad_magic() {
        let h = FrameHeader {
            op: Op::Get as u16,
            flags: 0,
            len: 1 << 40,
            request_id: 7,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] ^= 1;
        assert_eq!(
            FrameHeader::decode(&b).unwrap_err().code,
            ErrorCode::BadHeader
        );
    }

    #[test]
    fn exists_bitmap_roundtrip() {
        for n in [0usize, 1, 7, 8, 9, 128, 1000] {
            let present: Vec<bool> = (0..n).map(|i| i < n / 2 || i % 3 == 0).collect();
            let mut out = Vec::new();
            ExistsReply::encode_from(&mut out, &present);
            let r = ExistsReply::decode(&out, n).unwrap();
            assert_eq!(r.present, present);
            assert_eq!(
                r.leading_hits as usize,
                present.iter().take_while(|p| **p).count()
            );
        }
    }

    #[test]
    fn get_range_rules() {
        let e = |offset, length| GetEntry {
            digest: [0; 32],
            offset,
            length,
        };
        assert_eq!(e(0, LENGTH_TO_END).range(10), Some((0, 10)));
        assert_eq!(e(10, LENGTH_TO_END).range(10), Some((10, 0)));
        assert_eq!(e(4, 6).range(10), Some((4, 6)));
        assert_eq!(e(4, 7).range(10), None);
        assert_eq!(e(11, 0).range(10), None);
        assert_eq!(e(u64::MAX, 1).range(10), None);
    }

    #[test]
    fn batch_head_limits() {
        let mut out = Vec::new();
        put_batch_head(&mut out, b"ns", 2, 0);
        out.extend_from_slice(&[0u8; 64]);
        let mut r = Reader::new(&out);
        let h = read_batch_head(&mut r, 32).unwrap();
        assert_eq!((h.namespace, h.count), (&b"ns"[..], 2));
        // Claims more entries than the bytes carry.
        let mut out = Vec::new();
        put_batch_head(&mut out, b"ns", 3, 0);
        out.extend_from_slice(&[0u8; 64]);
        assert!(read_batch_head(&mut Reader::new(&out), 32).is_err());
        // Too many keys.
        let mut out = Vec::new();
        put_batch_head(&mut out, b"", BATCH_MAX_KEYS + 1, 0);
        assert_eq!(
            read_batch_head(&mut Reader::new(&out), 0).unwrap_err().code,
            ErrorCode::Limit
        );
    }

    #[test]
    fn copy_with_crc_matches_crc() {
        let src: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        assert_eq!(copy_with_crc(&mut dst, &src), crc32c(&src));
        assert_eq!(dst, src);
    }
}
