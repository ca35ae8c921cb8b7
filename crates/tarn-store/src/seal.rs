//! Encryption at rest: an object's bytes sealed block by block.
//!
//! A sealed part is its plaintext cut into blocks of `SEAL_BLOCK` bytes, each
//! stored as AES-256-GCM ciphertext followed by its 16-byte tag. The key of a
//! part is derived from the object's data key, the part's random salt and its
//! part number (HMAC-SHA256), so no two writes ever share a key, even a part
//! uploaded twice under one upload's data key; the nonce is the block's index
//! and whether it is the part's last block, so blocks cannot be reordered,
//! moved between parts or objects, or cut off at a block boundary without the
//! read failing. Every part has at least one block (an empty part is one tag).
//!
//! The engine knows only the data key a request hands it: where that key comes
//! from (a master key, a named KMS key, the customer's) is the S3 layer's.
//! Reads decrypt only the blocks a range touches. Erasure coding, healing,
//! draining and scrubbing work on the sealed bytes and never need a key.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures::Stream;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use ring::hmac;

use crate::error::StoreError;

/// Plaintext bytes per sealed block.
pub const SEAL_BLOCK: u64 = 64 << 10;
/// The GCM tag after each block.
pub const SEAL_TAG: u64 = 16;
/// A full block as stored.
pub const SEALED_BLOCK: u64 = SEAL_BLOCK + SEAL_TAG;
/// The cipher id recorded with a sealed version (format 4): AES-256-GCM over
/// 64 KiB blocks, part keys by HMAC-SHA256.
pub const CIPHER_AES256_GCM_64K: u8 = 1;

/// 32 bytes of key material, wiped when dropped.
#[derive(Clone)]
pub struct DataKey([u8; 32]);

impl DataKey {
    pub fn random() -> DataKey {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).expect("the system's random source");
        DataKey(k)
    }

    pub fn from_bytes(b: [u8; 32]) -> DataKey {
        DataKey(b)
    }

    pub fn from_slice(b: &[u8]) -> Option<DataKey> {
        Some(DataKey(b.try_into().ok()?))
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl Drop for DataKey {
    fn drop(&mut self) {
        // Volatile writes: the compiler may not drop the wipe of a value
        // that is never read again.
        for b in self.0.iter_mut() {
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(…)")
    }
}

/// How a write is sealed: its data key, and whether the ETag may be the
/// plaintext's digest (SSE-S3, as AWS) or must reveal nothing of it
/// (SSE-KMS, SSE-C: a keyed digest instead).
#[derive(Clone, Debug)]
pub struct SealSpec {
    pub key: DataKey,
    pub keyed_etag: bool,
}

impl SealSpec {
    /// The ETag of a sealed body from the plaintext's ETag.
    pub(crate) fn etag(&self, plain: String) -> String {
        if !self.keyed_etag {
            return plain;
        }
        let k = hmac::Key::new(hmac::HMAC_SHA256, self.key.bytes());
        let tag = hmac::sign(&k, format!("tarn-seal-etag\0{plain}").as_bytes());
        crate::store::put::hex(&tag.as_ref()[..16])
    }
}

/// Stored length of a part of `plain` bytes.
pub fn sealed_len(plain: u64) -> u64 {
    plain + SEAL_TAG * plain.div_ceil(SEAL_BLOCK).max(1)
}

/// Plaintext length of a part stored as `sealed` bytes; None for a length no
/// sealed part has.
pub fn plain_len(sealed: u64) -> Option<u64> {
    let blocks = sealed.div_ceil(SEALED_BLOCK).max(1);
    let plain = sealed.checked_sub(SEAL_TAG * blocks)?;
    (sealed_len(plain) == sealed).then_some(plain)
}

/// A fresh random salt for a part.
pub fn new_salt() -> [u8; 16] {
    let mut s = [0u8; 16];
    getrandom::fill(&mut s).expect("the system's random source");
    s
}

fn part_key(key: &DataKey, salt: &[u8; 16], part: u32) -> LessSafeKey {
    let k = hmac::Key::new(hmac::HMAC_SHA256, key.bytes());
    let mut msg = Vec::with_capacity(40);
    msg.extend_from_slice(b"tarn-seal-part\0");
    msg.extend_from_slice(salt);
    msg.extend_from_slice(&part.to_be_bytes());
    let tag = hmac::sign(&k, &msg);
    let unbound = UnboundKey::new(&AES_256_GCM, tag.as_ref()).expect("a 32-byte key");
    LessSafeKey::new(unbound)
}

fn nonce(block: u64, last: bool) -> Nonce {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&block.to_be_bytes());
    n[11] = last as u8;
    Nonce::assume_unique_for_key(n)
}

/// Seals a part's plaintext as it streams: full blocks go out as soon as a
/// byte after them arrives (only then is a block known not to be the last).
pub struct Sealer {
    key: LessSafeKey,
    block: u64,
    buf: BytesMut,
    finished: bool,
}

impl Sealer {
    pub fn new(key: &DataKey, salt: &[u8; 16], part: u32) -> Sealer {
        Sealer {
            key: part_key(key, salt, part),
            block: 0,
            buf: BytesMut::new(),
            finished: false,
        }
    }

    /// Seals the whole buffer (one block) and hands it out. The tag goes
    /// into the room reserved after the block: no block is copied again.
    fn seal_buffered(&mut self, last: bool) -> Bytes {
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(self.block, last), Aad::empty(), &mut self.buf)
            .expect("sealing a block within GCM's limits");
        self.buf.extend_from_slice(tag.as_ref());
        self.block += 1;
        self.buf.split().freeze()
    }

    /// Takes plaintext; appends the blocks it completes to `out`.
    pub fn push(&mut self, mut data: &[u8], out: &mut VecDeque<Bytes>) {
        const B: usize = SEAL_BLOCK as usize;
        while !data.is_empty() {
            if self.buf.len() == B {
                // A byte follows this block: it is not the last.
                out.push_back(self.seal_buffered(false));
            }
            if self.buf.is_empty() {
                self.buf.reserve(B + SEAL_TAG as usize);
            }
            let take = (B - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
    }

    /// Whether the last block went out.
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The last block (possibly of no plaintext); once.
    pub fn finish(&mut self) -> Option<Bytes> {
        if self.finished {
            return None;
        }
        self.finished = true;
        self.buf.reserve(SEAL_TAG as usize);
        Some(self.seal_buffered(true))
    }
}

/// One part's share of a sealed read: its key and the blocks read of it.
pub(crate) struct Segment {
    key: LessSafeKey,
    /// Stored length of the whole part (the last block's length follows).
    part_sealed: u64,
    /// Blocks [next, end) still to open.
    next: u64,
    end: u64,
}

/// Where a plaintext range [start, end) lies in a version's sealed parts:
/// the stored range to read and what to open of it.
pub(crate) struct SealedRange {
    pub stored: (u64, u64),
    segments: VecDeque<Segment>,
    skip: u64,
    remaining: u64,
}

/// Maps plaintext [start, end) of a version with these stored part lengths,
/// part numbers and salts. `start < end`.
pub(crate) fn map_range(
    key: &DataKey,
    parts: &[(u32, u64, [u8; 16])],
    start: u64,
    end: u64,
) -> Result<SealedRange, StoreError> {
    let mut segments = VecDeque::new();
    let (mut plain_at, mut stored_at) = (0u64, 0u64);
    let mut stored = None::<(u64, u64)>;
    let mut skip = 0;
    for &(number, sealed, salt) in parts {
        let plain = plain_len(sealed).ok_or_else(|| {
            StoreError::from(std::io::Error::other(
                "a sealed part of an impossible length",
            ))
        })?;
        let (p0, p1) = (plain_at, plain_at + plain);
        // An empty part between touched ones is read too (its one block
        // opens to nothing), so that the stored range stays contiguous.
        let touched = (p1 > start && p0 < end) || (plain == 0 && stored.is_some() && p0 < end);
        if touched {
            let a = start.max(p0) - p0;
            let b = end.min(p1) - p0;
            let (first, last) = (a / SEAL_BLOCK, b.saturating_sub(1) / SEAL_BLOCK);
            if stored.is_none() {
                skip = a - first * SEAL_BLOCK;
            }
            let s0 = stored_at + first * SEALED_BLOCK;
            let s1 = stored_at + ((last + 1) * SEALED_BLOCK).min(sealed);
            stored = Some(match stored {
                None => (s0, s1),
                Some((x, _)) => (x, s1),
            });
            segments.push_back(Segment {
                key: part_key(key, &salt, number),
                part_sealed: sealed,
                next: first,
                end: last + 1,
            });
        }
        plain_at = p1;
        stored_at += sealed;
    }
    let stored = stored.ok_or_else(|| StoreError::InvalidArgument("empty sealed range".into()))?;
    Ok(SealedRange {
        stored,
        segments,
        skip,
        remaining: end - start,
    })
}

/// Decrypts a stream of a sealed range's stored bytes into the plaintext
/// asked for. A block that does not open (wrong key, bytes or metadata
/// changed behind the engine's back) ends the stream with an error.
///
/// The stored bytes arrive in the read path's pieces (shared, immutable,
/// not aligned to blocks): they are queued as they are, and the whole blocks
/// queued (up to `OPEN_BATCH` of them, one part's) are copied once, from the
/// pieces they span, into one buffer, opened there and packed to the front
/// (each block's plaintext moved over the tags before it), so a GET sends
/// chunks as large as the plain read path's, not one per block.
pub(crate) struct Opener<S> {
    inner: S,
    range: SealedRange,
    /// Stored bytes received and not yet opened, in order.
    queued: VecDeque<Bytes>,
    queued_len: usize,
    failed: bool,
}

/// Blocks opened into one output chunk at most (256 KiB of plaintext, the
/// read path's piece size).
const OPEN_BATCH: u64 = 4;

impl<S> Opener<S> {
    pub(crate) fn new(inner: S, range: SealedRange) -> Self {
        Opener {
            inner,
            range,
            queued: VecDeque::new(),
            queued_len: 0,
            failed: false,
        }
    }

    /// The next `len` queued bytes, copied into one buffer.
    fn take(&mut self, len: usize) -> BytesMut {
        let mut out = BytesMut::with_capacity(len);
        while out.len() < len {
            let front = self.queued.front_mut().expect("queued bytes");
            let n = (len - out.len()).min(front.len());
            out.extend_from_slice(&front[..n]);
            if n == front.len() {
                self.queued.pop_front();
            } else {
                bytes::Buf::advance(front, n);
            }
        }
        self.queued_len -= len;
        out
    }

    /// How many of the current part's next blocks (at most `OPEN_BATCH`)
    /// are queued whole.
    fn next_run(&self) -> Option<u64> {
        let seg = self.range.segments.front()?;
        let (mut len, mut n) = (0u64, 0u64);
        while n < OPEN_BATCH && seg.next + n < seg.end {
            let at = (seg.next + n) * SEALED_BLOCK;
            len += SEALED_BLOCK.min(seg.part_sealed - at);
            if len > self.queued_len as u64 {
                break;
            }
            n += 1;
        }
        Some(n)
    }

    /// Whether the current part's next `n` blocks are the last it has in
    /// the range.
    fn run_ends_segment(&self, n: u64) -> bool {
        self.range
            .segments
            .front()
            .is_some_and(|seg| seg.next + n == seg.end)
    }

    /// Opens the current part's next `n` blocks (queued whole).
    fn open_run(&mut self, n: u64) -> Result<Option<Bytes>, StoreError> {
        let seg = self.range.segments.front().expect("a segment");
        let stored_end = ((seg.next + n) * SEALED_BLOCK).min(seg.part_sealed);
        let len = (stored_end - seg.next * SEALED_BLOCK) as usize;
        let mut buf = self.take(len);
        let seg = self.range.segments.front_mut().expect("a segment");
        let mut plain = 0usize;
        for i in 0..n {
            let at = (i * SEALED_BLOCK) as usize;
            let block_end = (at + SEALED_BLOCK as usize).min(len);
            let index = seg.next + i;
            let last = (index + 1) * SEALED_BLOCK >= seg.part_sealed;
            // Ciphertext and tag at [at, block_end), plaintext to [plain, ..).
            let opened = seg
                .key
                .open_within(
                    nonce(index, last),
                    Aad::empty(),
                    &mut buf[plain..block_end],
                    at - plain..,
                )
                .map(|p| p.len())
                .map_err(|_| {
                    StoreError::from(std::io::Error::other(
                        "an encrypted block does not open with the object's key (its bytes or metadata were changed)",
                    ))
                })?;
            plain += opened;
        }
        seg.next += n;
        if seg.next == seg.end {
            self.range.segments.pop_front();
        }
        buf.truncate(plain);
        let mut plain = buf.freeze();
        let skip = (self.range.skip as usize).min(plain.len());
        self.range.skip -= skip as u64;
        plain = plain.slice(skip..);
        let take = (self.range.remaining as usize).min(plain.len());
        self.range.remaining -= take as u64;
        plain.truncate(take);
        Ok((!plain.is_empty()).then_some(plain))
    }
}

impl<S> Stream for Opener<S>
where
    S: Stream<Item = Result<Bytes, StoreError>> + Unpin,
{
    type Item = Result<Bytes, StoreError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.failed || this.range.remaining == 0 {
                return Poll::Ready(None);
            }
            let Some(run) = this.next_run() else {
                return Poll::Ready(None);
            };
            // A whole batch, or the part's last blocks of the range.
            if run == OPEN_BATCH || (run > 0 && this.run_ends_segment(run)) {
                match this.open_run(run) {
                    Ok(Some(b)) => return Poll::Ready(Some(Ok(b))),
                    Ok(None) => continue,
                    Err(e) => {
                        this.failed = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(chunk))) => {
                    this.queued_len += chunk.len();
                    this.queued.push_back(chunk);
                }
                Poll::Ready(Some(Err(e))) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.failed = true;
                    return Poll::Ready(Some(Err(StoreError::from(std::io::Error::other(
                        "an encrypted object's stored bytes ended early",
                    )))));
                }
            }
        }
    }
}

/// Wraps a small secret (a data key) under a key-encryption key:
/// nonce (12) ‖ ciphertext ‖ tag (16). `context` is bound as associated data.
pub fn wrap(kek: &[u8; 32], context: &[u8], secret: &[u8]) -> Vec<u8> {
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, kek).expect("a 32-byte key"));
    let mut n = [0u8; 12];
    getrandom::fill(&mut n).expect("the system's random source");
    let mut out = secret.to_vec();
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(n),
        Aad::from(context),
        &mut out,
    )
    .expect("sealing a key");
    let mut wrapped = n.to_vec();
    wrapped.extend_from_slice(&out);
    wrapped
}

/// Opens what `wrap` made; None when the key or context is not the one it
/// was wrapped with, or the bytes were changed.
pub fn unwrap(kek: &[u8; 32], context: &[u8], wrapped: &[u8]) -> Option<Vec<u8>> {
    if wrapped.len() < 12 + 16 {
        return None;
    }
    let key = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, kek).expect("a 32-byte key"));
    let n: [u8; 12] = wrapped[..12].try_into().ok()?;
    let mut body = wrapped[12..].to_vec();
    let plain = key
        .open_in_place(
            Nonce::assume_unique_for_key(n),
            Aad::from(context),
            &mut body,
        )
        .ok()?;
    Some(plain.to_vec())
}

/// HMAC-SHA256 of `msg` under `key`: key derivation for the S3 layer (bucket
/// keys, fingerprints).
pub fn derive(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let k = hmac::Key::new(hmac::HMAC_SHA256, key);
    hmac::sign(&k, msg).as_ref().try_into().expect("32 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    fn seal_all(key: &DataKey, salt: &[u8; 16], part: u32, data: &[u8], chunk: usize) -> Vec<u8> {
        let mut s = Sealer::new(key, salt, part);
        let mut out = VecDeque::new();
        for c in data.chunks(chunk.max(1)) {
            s.push(c, &mut out);
        }
        out.extend(s.finish());
        out.iter().flat_map(|b| b.iter().copied()).collect()
    }

    fn open_range(
        key: &DataKey,
        parts: &[(u32, [u8; 16], Vec<u8>)],
        start: u64,
        end: u64,
    ) -> Result<Vec<u8>, StoreError> {
        open_range_in(key, parts, start, end, 70_001)
    }

    fn open_range_in(
        key: &DataKey,
        parts: &[(u32, [u8; 16], Vec<u8>)],
        start: u64,
        end: u64,
        piece: usize,
    ) -> Result<Vec<u8>, StoreError> {
        let desc: Vec<(u32, u64, [u8; 16])> = parts
            .iter()
            .map(|(n, s, b)| (*n, b.len() as u64, *s))
            .collect();
        let all: Vec<u8> = parts.iter().flat_map(|p| p.2.iter().copied()).collect();
        let r = map_range(key, &desc, start, end)?;
        let stored = all[r.stored.0 as usize..r.stored.1 as usize].to_vec();
        // Fed in pieces of any size, as the read path's pieces are.
        let chunks: Vec<Result<Bytes, StoreError>> = stored
            .chunks(piece)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let opener = Opener::new(futures::stream::iter(chunks), r);
        futures::executor::block_on(async move {
            let mut out = Vec::new();
            let mut o = Box::pin(opener);
            while let Some(b) = o.next().await {
                out.extend_from_slice(&b?);
            }
            Ok(out)
        })
    }

    #[test]
    fn lengths_round_trip() {
        for p in [0, 1, 65535, 65536, 65537, 3 << 20, (3 << 20) + 5] {
            assert_eq!(plain_len(sealed_len(p)), Some(p), "{p}");
        }
        assert_eq!(sealed_len(0), 16);
        assert_eq!(plain_len(5), None);
        assert_eq!(plain_len(SEALED_BLOCK + 3), None);
    }

    #[test]
    fn ranges_decrypt_only_what_they_touch_and_agree_with_the_plaintext() {
        let key = DataKey::random();
        let p1: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let p2: Vec<u8> = (0..65_536u32).map(|i| (i % 13) as u8).collect();
        let p3: Vec<u8> = vec![7; 10];
        let empty: Vec<u8> = Vec::new();
        let parts: Vec<(u32, [u8; 16], Vec<u8>)> = [(1, &p1), (2, &p2), (3, &empty), (4, &p3)]
            .iter()
            .map(|(n, p)| {
                let salt = new_salt();
                (*n, salt, seal_all(&key, &salt, *n, p, 4097))
            })
            .collect();
        let plain: Vec<u8> = [p1, p2, empty, p3].concat();
        let n = plain.len() as u64;
        for (a, b) in [
            (0, n),
            (0, 1),
            (65535, 65537),
            (199_999, 200_001),
            (n - 3, n),
            (70_000, n - 1),
        ] {
            for piece in [997, 70_001, 256 << 10, 1 << 20] {
                assert_eq!(
                    open_range_in(&key, &parts, a, b, piece).unwrap(),
                    plain[a as usize..b as usize],
                    "{a}-{b} in pieces of {piece}"
                );
            }
        }
        // Parts of many blocks: batches of whole blocks, a short last one.
        let big: Vec<u8> = (0..(9 * SEAL_BLOCK as u32 + 77))
            .map(|i| (i % 241) as u8)
            .collect();
        let salt = new_salt();
        let sealed = seal_all(&key, &salt, 1, &big, 100_000);
        let parts = [(1, salt, sealed)];
        let n = big.len() as u64;
        for (a, b) in [
            (0, n),
            (1, n - 1),
            (SEAL_BLOCK, 5 * SEAL_BLOCK + 1),
            (n - 100, n),
        ] {
            for piece in [4096, 65_552, 256 << 10, 4 << 20] {
                assert_eq!(
                    open_range_in(&key, &parts, a, b, piece).unwrap(),
                    big[a as usize..b as usize],
                    "{a}-{b} in pieces of {piece}"
                );
            }
        }
        // Only the blocks touched are read.
        let desc: Vec<(u32, u64, [u8; 16])> = parts
            .iter()
            .map(|(n, s, b)| (*n, b.len() as u64, *s))
            .collect();
        let r = map_range(&key, &desc, 65_536, 65_537).unwrap();
        assert_eq!(r.stored, (SEALED_BLOCK, 2 * SEALED_BLOCK));
    }

    #[test]
    fn a_wrong_key_a_swapped_part_or_a_cut_block_fails() {
        let key = DataKey::random();
        let data = vec![1u8; 150_000];
        let salt = new_salt();
        let sealed = seal_all(&key, &salt, 1, &data, 65536);
        let n = data.len() as u64;
        assert!(open_range(&DataKey::random(), &[(1, salt, sealed.clone())], 0, n).is_err());
        assert!(open_range(&key, &[(2, salt, sealed.clone())], 0, n).is_err());
        assert!(open_range(&key, &[(1, new_salt(), sealed.clone())], 0, n).is_err());
        // Dropping the last block leaves a length that looks whole: the new
        // last block was sealed as not last.
        let cut = sealed[..2 * SEALED_BLOCK as usize].to_vec();
        assert!(open_range(&key, &[(1, salt, cut)], 0, 2 * SEAL_BLOCK).is_err());
        let mut flipped = sealed.clone();
        flipped[70_000] ^= 1;
        assert!(open_range(&key, &[(1, salt, flipped)], 0, n).is_err());
        // An empty part is one tag and opens to nothing.
        let empty = seal_all(&key, &salt, 1, &[], 1);
        assert_eq!(empty.len(), 16);
    }

    #[test]
    fn wrapped_keys_open_only_with_their_key_and_context() {
        let kek = [9u8; 32];
        let w = wrap(&kek, b"ctx", b"secret key");
        assert_eq!(
            unwrap(&kek, b"ctx", &w).as_deref(),
            Some(&b"secret key"[..])
        );
        assert!(unwrap(&[8u8; 32], b"ctx", &w).is_none());
        assert!(unwrap(&kek, b"other", &w).is_none());
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use futures::StreamExt;

    /// Seal and open rates of this machine (not an assertion):
    /// `cargo test --release -p tarn-store --lib seal::speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn seal_and_open_rates() {
        let key = DataKey::random();
        let salt = new_salt();
        let data = vec![7u8; 64 << 20];
        // Sealed as a PUT streams: each block handed on and dropped.
        let t = std::time::Instant::now();
        let mut s = Sealer::new(&key, &salt, 1);
        let mut out = VecDeque::new();
        for c in data.chunks(1 << 20) {
            s.push(c, &mut out);
            out.clear();
        }
        out.extend(s.finish());
        let seal = t.elapsed();
        // Again, kept, to open below.
        let mut s = Sealer::new(&key, &salt, 1);
        let mut out = VecDeque::new();
        for c in data.chunks(1 << 20) {
            s.push(c, &mut out);
        }
        out.extend(s.finish());
        let sealed: Vec<Bytes> = out.into_iter().collect();
        let stored: u64 = sealed.iter().map(|b| b.len() as u64).sum();
        // Re-chunked as the read path's 256 KiB pieces.
        let all: Vec<u8> = sealed.iter().flat_map(|b| b.iter().copied()).collect();
        let pieces: Vec<Result<Bytes, StoreError>> = all
            .chunks(256 << 10)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let r = map_range(&key, &[(1, stored, salt)], 0, data.len() as u64).unwrap();
        let t = std::time::Instant::now();
        let n = futures::executor::block_on(async move {
            let mut o = Box::pin(Opener::new(futures::stream::iter(pieces), r));
            let mut n = 0;
            while let Some(b) = o.next().await {
                n += b.unwrap().len();
            }
            n
        });
        let open = t.elapsed();
        assert_eq!(n, data.len());
        let gbs = |d: std::time::Duration| data.len() as f64 / d.as_secs_f64() / 1e9;
        println!(
            "seal {:.2} GB/s, open {:.2} GB/s (one core)",
            gbs(seal),
            gbs(open)
        );
    }
}
