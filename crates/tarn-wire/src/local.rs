//! Short-circuit reads: what a reader on a node's host and the node's
//! local-read socket say to each other (`docs/local-reads.md`).
//!
//! A node that serves local reads names its socket in the
//! `x-tarn-local-read` header of its object responses to clients on its
//! host. The reader connects, proves its S3 credentials (HELLO, AUTH: the
//! KV store's challenge-response under labels of its own, both ways), then
//! asks for the layout of byte ranges of object versions. The node checks
//! the caller may read the version (s3:GetObject, as a GET would be
//! judged), pins it, and answers with the stripe geometry and read-only
//! descriptors of its own drives' data shard files, attached to the reply
//! (SCM_RIGHTS), one per shard the reply marks present, in order.
//!
//! Every message is a frame: u32 LE length of what follows, u8 type, then
//! the type's fields. Integers are little-endian; a string is a u16 LE
//! length and UTF-8 bytes.

use crate::auth::{Nonce, Proof, NONCE_BYTES, PROOF_BYTES};

/// The HTTP response header that names a node's local-read socket (an
/// abstract Unix socket name, without the leading NUL).
pub const HEADER: &str = "x-tarn-local-read";
pub const MAGIC: [u8; 4] = *b"TRNL";
pub const VERSION: u16 = 1;
/// The labels of the handshake's two proofs (`auth::proof_for`).
pub const LABELS: [&[u8]; 2] = [b"tarn-local-read-v1 client", b"tarn-local-read-v1 server"];
/// Largest frame either side sends or accepts (type byte included).
pub const FRAME_MAX_BYTES: usize = 64 << 10;
/// Most descriptors one reply carries.
pub const FDS_MAX: usize = 64;
pub const BUCKET_MAX_BYTES: usize = 255;
pub const KEY_MAX_BYTES: usize = 1024;
pub const VERSION_ID_MAX_BYTES: usize = 64;
pub const ETAG_MAX_BYTES: usize = 128;
pub const ACCESS_KEY_MAX_BYTES: usize = crate::auth::ACCESS_KEY_MAX_BYTES;
pub const MESSAGE_MAX_BYTES: usize = 1024;
/// Longest stripe a layout may name (the engine's limit).
pub const STRIPE_MAX_BYTES: u32 = 64 << 20;

const T_HELLO: u8 = 1;
const T_HELLO_REPLY: u8 = 2;
const T_AUTH: u8 = 3;
const T_AUTH_REPLY: u8 = 4;
const T_LAYOUT: u8 = 5;
const T_GRANTED: u8 = 6;
const T_ELSEWHERE: u8 = 7;
const T_REFUSED: u8 = 8;
const T_RELEASE: u8 = 9;
const T_ERROR: u8 = 10;

/// Why a layout was refused (or, in `Msg::Error`, why the connection ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such bucket, key or version (or a delete marker).
    NotFound = 1,
    /// The credentials may not read it (or, in the handshake: unknown key,
    /// wrong proof).
    Denied = 2,
    /// The version is not the one `if_match` named.
    Changed = 3,
    /// A request that makes no sense (bad range, bad names, bad frame).
    Invalid = 4,
    /// Too many pins or connections: try again later (or over HTTP).
    Busy = 5,
    /// The node cannot answer now (drives, quorum); HTTP may.
    Unavailable = 6,
}

impl Refusal {
    fn from_u8(v: u8) -> Option<Refusal> {
        Some(match v {
            1 => Refusal::NotFound,
            2 => Refusal::Denied,
            3 => Refusal::Changed,
            4 => Refusal::Invalid,
            5 => Refusal::Busy,
            6 => Refusal::Unavailable,
            _ => return None,
        })
    }
}

/// A request for the layout of bytes `[start, end)` of a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutRequest {
    /// Chosen by the client; the reply carries it back.
    pub id: u32,
    pub bucket: String,
    pub key: String,
    /// Empty: the latest version.
    pub version: String,
    /// Non-empty: refused with `Changed` unless the version's ETag is this.
    pub if_match: String,
    pub start: u64,
    pub end: u64,
}

/// One part of a granted version: which of its data shards have a
/// descriptor attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantPart {
    /// Object offset of the part's first byte.
    pub offset: u64,
    pub size: u64,
    /// Data shard `i` has a descriptor (in the order of the reply).
    pub shards: Vec<bool>,
}

/// A layout granted: the version, its geometry, the parts the range
/// touches (up to the descriptors one reply carries), and the pin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub id: u32,
    /// Names the pin (RELEASE ends it early).
    pub pin: u64,
    /// The pin lapses this long after the reply was sent: the reader stops
    /// using the descriptors before then and asks again.
    pub lease_ms: u32,
    pub version: String,
    pub etag: String,
    pub size: u64,
    pub data_shards: u8,
    pub parity_shards: u8,
    pub stripe_size: u32,
    pub part_count: u32,
    /// Index of `parts[0]` among the version's parts.
    pub first_part: u32,
    pub parts: Vec<GrantPart>,
}

impl Grant {
    /// Descriptors the reply carries.
    pub fn fd_count(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.shards.iter().filter(|s| **s).count())
            .sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Hello {
        min: u16,
        max: u16,
    },
    HelloReply {
        version: u16,
        nonce: Nonce,
    },
    Auth {
        access_key: String,
        nonce: Nonce,
        proof: Proof,
    },
    AuthReply {
        proof: Proof,
    },
    Layout(LayoutRequest),
    Granted(Grant),
    /// The version has nothing to read locally (inline, encrypted, on
    /// other nodes' drives): read it over HTTP.
    Elsewhere {
        id: u32,
        reason: String,
        version: String,
        etag: String,
        size: u64,
    },
    Refused {
        id: u32,
        code: Refusal,
        message: String,
    },
    Release {
        pin: u64,
    },
    /// The connection ends (a handshake refused, a bad frame).
    Error {
        code: Refusal,
        message: String,
    },
}

/// A frame that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadFrame(pub &'static str);

impl std::fmt::Display for BadFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed local-read frame: {}", self.0)
    }
}

impl std::error::Error for BadFrame {}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    /// Strings longer than a u16 can say are cut (no field allows that much).
    fn str(&mut self, s: &str) {
        let mut n = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        self.u16(n as u16);
        self.bytes(&s.as_bytes()[..n]);
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BadFrame> {
        if self.0.len() < n {
            return Err(BadFrame("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, BadFrame> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, BadFrame> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, BadFrame> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, BadFrame> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], BadFrame> {
        Ok(self.take(N)?.try_into().expect("N"))
    }
    fn str(&mut self, max: usize, what: &'static str) -> Result<String, BadFrame> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(BadFrame(what));
        }
        std::str::from_utf8(self.take(n)?)
            .map(str::to_string)
            .map_err(|_| BadFrame("a string is not UTF-8"))
    }
    fn end(&self) -> Result<(), BadFrame> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(BadFrame("trailing bytes"))
        }
    }
}

impl Msg {
    /// The frame: length, type, fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(vec![0; 4]);
        match self {
            Msg::Hello { min, max } => {
                w.u8(T_HELLO);
                w.bytes(&MAGIC);
                w.u16(*min);
                w.u16(*max);
            }
            Msg::HelloReply { version, nonce } => {
                w.u8(T_HELLO_REPLY);
                w.u16(*version);
                w.bytes(nonce);
            }
            Msg::Auth {
                access_key,
                nonce,
                proof,
            } => {
                w.u8(T_AUTH);
                w.str(access_key);
                w.bytes(nonce);
                w.bytes(proof);
            }
            Msg::AuthReply { proof } => {
                w.u8(T_AUTH_REPLY);
                w.bytes(proof);
            }
            Msg::Layout(r) => {
                w.u8(T_LAYOUT);
                w.u32(r.id);
                w.str(&r.bucket);
                w.str(&r.key);
                w.str(&r.version);
                w.str(&r.if_match);
                w.u64(r.start);
                w.u64(r.end);
            }
            Msg::Granted(g) => {
                w.u8(T_GRANTED);
                w.u32(g.id);
                w.u64(g.pin);
                w.u32(g.lease_ms);
                w.str(&g.version);
                w.str(&g.etag);
                w.u64(g.size);
                w.u8(g.data_shards);
                w.u8(g.parity_shards);
                w.u32(g.stripe_size);
                w.u32(g.part_count);
                w.u32(g.first_part);
                w.u32(g.parts.len() as u32);
                for p in &g.parts {
                    w.u64(p.offset);
                    w.u64(p.size);
                    for &s in &p.shards {
                        w.u8(s as u8);
                    }
                }
            }
            Msg::Elsewhere {
                id,
                reason,
                version,
                etag,
                size,
            } => {
                w.u8(T_ELSEWHERE);
                w.u32(*id);
                w.str(reason);
                w.str(version);
                w.str(etag);
                w.u64(*size);
            }
            Msg::Refused { id, code, message } => {
                w.u8(T_REFUSED);
                w.u32(*id);
                w.u8(*code as u8);
                w.str(message);
            }
            Msg::Release { pin } => {
                w.u8(T_RELEASE);
                w.u64(*pin);
            }
            Msg::Error { code, message } => {
                w.u8(T_ERROR);
                w.u8(*code as u8);
                w.str(message);
            }
        }
        let n = (w.0.len() - 4) as u32;
        w.0[..4].copy_from_slice(&n.to_le_bytes());
        w.0
    }

    /// The length a frame's first four bytes announce, checked against the
    /// limit.
    pub fn frame_len(head: [u8; 4]) -> Result<usize, BadFrame> {
        let n = u32::from_le_bytes(head) as usize;
        if n == 0 {
            return Err(BadFrame("empty frame"));
        }
        if n > FRAME_MAX_BYTES {
            return Err(BadFrame("frame too long"));
        }
        Ok(n)
    }

    /// Decodes a frame's body (what follows the length). Every field is
    /// checked against its limit; a frame with anything left over is bad.
    pub fn decode(body: &[u8]) -> Result<Msg, BadFrame> {
        if body.len() > FRAME_MAX_BYTES {
            return Err(BadFrame("frame too long"));
        }
        let mut r = R(body);
        let msg = match r.u8()? {
            T_HELLO => {
                if r.array::<4>()? != MAGIC {
                    return Err(BadFrame("not a local-read HELLO"));
                }
                let (min, max) = (r.u16()?, r.u16()?);
                Msg::Hello { min, max }
            }
            T_HELLO_REPLY => Msg::HelloReply {
                version: r.u16()?,
                nonce: r.array::<NONCE_BYTES>()?,
            },
            T_AUTH => Msg::Auth {
                access_key: r.str(ACCESS_KEY_MAX_BYTES, "access key too long")?,
                nonce: r.array::<NONCE_BYTES>()?,
                proof: r.array::<PROOF_BYTES>()?,
            },
            T_AUTH_REPLY => Msg::AuthReply {
                proof: r.array::<PROOF_BYTES>()?,
            },
            T_LAYOUT => {
                let req = LayoutRequest {
                    id: r.u32()?,
                    bucket: r.str(BUCKET_MAX_BYTES, "bucket name too long")?,
                    key: r.str(KEY_MAX_BYTES, "key too long")?,
                    version: r.str(VERSION_ID_MAX_BYTES, "version id too long")?,
                    if_match: r.str(ETAG_MAX_BYTES, "ETag too long")?,
                    start: r.u64()?,
                    end: r.u64()?,
                };
                if req.start > req.end {
                    return Err(BadFrame("range ends before it starts"));
                }
                if req.bucket.is_empty() || req.key.is_empty() {
                    return Err(BadFrame("no bucket or key"));
                }
                Msg::Layout(req)
            }
            T_GRANTED => {
                let mut g = Grant {
                    id: r.u32()?,
                    pin: r.u64()?,
                    lease_ms: r.u32()?,
                    version: r.str(VERSION_ID_MAX_BYTES, "version id too long")?,
                    etag: r.str(ETAG_MAX_BYTES, "ETag too long")?,
                    size: r.u64()?,
                    data_shards: r.u8()?,
                    parity_shards: r.u8()?,
                    stripe_size: r.u32()?,
                    part_count: r.u32()?,
                    first_part: r.u32()?,
                    parts: Vec::new(),
                };
                if g.data_shards == 0 {
                    return Err(BadFrame("no data shards"));
                }
                if g.stripe_size == 0
                    || !g.stripe_size.is_multiple_of(2)
                    || g.stripe_size > STRIPE_MAX_BYTES
                {
                    return Err(BadFrame("stripe size"));
                }
                let n = r.u32()? as usize;
                if n == 0 || n > FDS_MAX {
                    return Err(BadFrame("part count"));
                }
                let listed_end = (g.first_part as u64).checked_add(n as u64);
                if listed_end.is_none_or(|e| e > g.part_count as u64) {
                    return Err(BadFrame("parts beyond the version's"));
                }
                let mut at: Option<u64> = None;
                for _ in 0..n {
                    let offset = r.u64()?;
                    let size = r.u64()?;
                    let end = offset.checked_add(size).ok_or(BadFrame("part size"))?;
                    if end > g.size || at.is_some_and(|a| a != offset) {
                        return Err(BadFrame("parts not contiguous within the object"));
                    }
                    at = Some(end);
                    let mut shards = Vec::with_capacity(g.data_shards as usize);
                    for _ in 0..g.data_shards {
                        shards.push(match r.u8()? {
                            0 => false,
                            1 => true,
                            _ => return Err(BadFrame("shard flag")),
                        });
                    }
                    g.parts.push(GrantPart {
                        offset,
                        size,
                        shards,
                    });
                }
                if g.fd_count() > FDS_MAX {
                    return Err(BadFrame("too many descriptors"));
                }
                Msg::Granted(g)
            }
            T_ELSEWHERE => Msg::Elsewhere {
                id: r.u32()?,
                reason: r.str(MESSAGE_MAX_BYTES, "message too long")?,
                version: r.str(VERSION_ID_MAX_BYTES, "version id too long")?,
                etag: r.str(ETAG_MAX_BYTES, "ETag too long")?,
                size: r.u64()?,
            },
            T_REFUSED => Msg::Refused {
                id: r.u32()?,
                code: Refusal::from_u8(r.u8()?).ok_or(BadFrame("refusal code"))?,
                message: r.str(MESSAGE_MAX_BYTES, "message too long")?,
            },
            T_RELEASE => Msg::Release { pin: r.u64()? },
            T_ERROR => Msg::Error {
                code: Refusal::from_u8(r.u8()?).ok_or(BadFrame("error code"))?,
                message: r.str(MESSAGE_MAX_BYTES, "message too long")?,
            },
            _ => return Err(BadFrame("unknown type")),
        };
        r.end()?;
        Ok(msg)
    }
}

/// Picks the version both sides speak, if any.
pub fn negotiate(min: u16, max: u16) -> Option<u16> {
    (min <= VERSION && VERSION <= max).then_some(VERSION)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn grant() -> Grant {
        Grant {
            id: 7,
            pin: 99,
            lease_ms: 30_000,
            version: "0123456789abcdef0123456789abcdef".into(),
            etag: "\"abc-2\"".into(),
            size: 10 << 20,
            data_shards: 2,
            parity_shards: 2,
            stripe_size: 1 << 20,
            part_count: 2,
            first_part: 0,
            parts: vec![
                GrantPart {
                    offset: 0,
                    size: 5 << 20,
                    shards: vec![true, false],
                },
                GrantPart {
                    offset: 5 << 20,
                    size: 5 << 20,
                    shards: vec![true, true],
                },
            ],
        }
    }

    fn all() -> Vec<Msg> {
        vec![
            Msg::Hello { min: 1, max: 1 },
            Msg::HelloReply {
                version: 1,
                nonce: [3; 32],
            },
            Msg::Auth {
                access_key: "tarnadmin".into(),
                nonce: [4; 32],
                proof: [5; 32],
            },
            Msg::AuthReply { proof: [6; 32] },
            Msg::Layout(LayoutRequest {
                id: 1,
                bucket: "b".into(),
                key: "k/é".into(),
                version: String::new(),
                if_match: "\"e\"".into(),
                start: 3,
                end: 9,
            }),
            Msg::Granted(grant()),
            Msg::Elsewhere {
                id: 2,
                reason: "inline".into(),
                version: "null".into(),
                etag: "\"e\"".into(),
                size: 5,
            },
            Msg::Refused {
                id: 3,
                code: Refusal::Denied,
                message: "Access Denied".into(),
            },
            Msg::Release { pin: 4 },
            Msg::Error {
                code: Refusal::Invalid,
                message: "bad".into(),
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in all() {
            let f = m.encode();
            let n = Msg::frame_len(f[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, f.len() - 4);
            assert_eq!(Msg::decode(&f[4..]).unwrap(), m);
        }
        assert_eq!(grant().fd_count(), 3);
    }

    #[test]
    fn inconsistent_grants_are_refused() {
        let bad = |f: fn(&mut Grant)| {
            let mut g = grant();
            f(&mut g);
            Msg::decode(&Msg::Granted(g).encode()[4..])
        };
        assert!(bad(|g| g.data_shards = 0).is_err());
        assert!(bad(|g| g.stripe_size = 3).is_err());
        assert!(bad(|g| g.stripe_size = 0).is_err());
        assert!(bad(|g| g.part_count = 1).is_err());
        assert!(bad(|g| g.size = 9 << 20).is_err());
        assert!(bad(|g| g.parts[1].offset += 1).is_err());
        assert!(bad(|g| g.parts.clear()).is_err());
        assert!(bad(|g| g.first_part = u32::MAX).is_err());
        // The shard flags follow the data shard count.
        assert!(bad(|g| g.data_shards = 3).is_err());
        let mut frame = Msg::Release { pin: 1 }.encode();
        frame.push(0);
        assert!(Msg::decode(&frame[4..]).is_err());
        assert!(Msg::frame_len([0; 4]).is_err());
        assert!(Msg::frame_len(((FRAME_MAX_BYTES + 1) as u32).to_le_bytes()).is_err());
        let mut layout = Msg::Layout(LayoutRequest {
            id: 1,
            bucket: "b".into(),
            key: "k".into(),
            version: String::new(),
            if_match: String::new(),
            start: 9,
            end: 3,
        });
        assert!(Msg::decode(&layout.encode()[4..]).is_err());
        if let Msg::Layout(r) = &mut layout {
            (r.start, r.end, r.key) = (0, 1, String::new());
        }
        assert!(Msg::decode(&layout.encode()[4..]).is_err());
    }

    proptest! {
        /// Any bytes: a message or an error, never a panic; a message
        /// decoded re-encodes to the same bytes.
        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(m) = Msg::decode(&body) {
                prop_assert_eq!(&m.encode()[4..], &body[..]);
            }
        }

        /// Valid frames with bytes flipped: same rule.
        #[test]
        fn mutated_frames_never_panic(which in 0usize..10, at in any::<usize>(), bit in 0u8..8) {
            let mut f = all()[which].encode();
            let i = 4 + at % (f.len() - 4);
            f[i] ^= 1 << bit;
            if let Ok(m) = Msg::decode(&f[4..]) {
                prop_assert_eq!(m.encode(), f);
            }
        }
    }
}
