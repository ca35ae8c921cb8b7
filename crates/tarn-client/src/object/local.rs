//! Short-circuit reads (`docs/local-reads.md`): when the node a client talks
//! to is on the same host, it names its local-read socket in the
//! `x-tarn-local-read` header of object responses. The client connects,
//! proves its credentials, and for each ranged read asks for the version's
//! layout: the stripe geometry and read-only descriptors of the node's data
//! shard files. It reads the blocks itself (O_DIRECT straight into the
//! destination where the block and the destination are aligned, a buffered
//! read otherwise), checks every block against its file's checksum table,
//! and copies out the bytes asked for.
//!
//! Anything it cannot read that way goes over HTTP instead, for that range
//! only: a shard on another node's drive, a file that is missing, short or
//! corrupt, an inline or encrypted version, a refused request, a socket
//! that went away. A grant is used only within its lease (less a margin),
//! and only for reads that name the version's ETag; a read without one
//! asks anew, so a read that starts after a write completed sees it.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tarn_wire::auth::{self, Side};
use tarn_wire::local::{self as wire, Grant, LayoutRequest, Msg};
use tarn_wire::proto::crc32c;
use tarn_wire::shard::{ShardLayout, StripeGeometry, FOOTER_BYTES, SHARD_MAGIC};

use super::config::S3Credentials;
use super::engine::Chunk;
use super::hostmem::{self, Mapped};

/// After a socket that would not connect or a handshake refused, local
/// reads are not tried again for this long.
const RETRY_AFTER: Duration = Duration::from_secs(30);
/// A grant is used until this long before its lease lapses (at most a
/// quarter of the lease).
const LEASE_MARGIN: Duration = Duration::from_secs(5);
/// Grants kept for reads that name an ETag.
const GRANTS_KEPT_MAX: usize = 256;
/// Reads of the server's answers wait at most this long.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
const DIRECT_ALIGN: usize = 4096;

/// What local reads did, for `Stats`.
#[derive(Default)]
pub(crate) struct LocalCounters {
    pub bytes: AtomicU64,
    pub fallback_bytes: AtomicU64,
    /// Of `bytes`, those mapped from the files rather than copied.
    pub mapped_bytes: AtomicU64,
    pub grants: AtomicU64,
}

pub(crate) struct Local {
    creds: S3Credentials,
    io_timeout: Duration,
    state: Mutex<State>,
    pub counters: LocalCounters,
}

#[derive(Default)]
struct State {
    /// The socket the server named last.
    name: Option<String>,
    conn: Option<UnixStream>,
    /// Bumped when the connection is replaced: grants of an older one
    /// lapsed with it.
    generation: u64,
    retry_at: Option<Instant>,
    next_id: u32,
    /// Grants for reads naming an ETag: (bucket, key, etag) → grants.
    kept: HashMap<VersionName, Vec<Arc<Held>>>,
}

/// Bucket, key, ETag.
type VersionName = (Arc<str>, Arc<str>, Arc<str>);

/// A grant and its descriptors.
pub(crate) struct Held {
    grant: Grant,
    usable_until: Instant,
    generation: u64,
    parts: Vec<PartFiles>,
}

struct PartFiles {
    offset: u64,
    size: u64,
    shards: Vec<Option<ShardFile>>,
}

struct ShardFile {
    fd: OwnedFd,
    /// A second open file description with O_DIRECT (through
    /// /proc/self/fd), when the filesystem allows it.
    direct: OnceLock<Option<OwnedFd>>,
    /// The checksum table, once the file's length and footer checked out.
    table: OnceLock<Result<Table, String>>,
}

struct Table {
    layout: ShardLayout,
    crcs: Vec<u32>,
}

impl Local {
    pub(crate) fn new(creds: S3Credentials, io_timeout: Duration) -> Local {
        Local {
            creds,
            io_timeout,
            state: Mutex::new(State::default()),
            counters: LocalCounters::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A server named its local-read socket (a response's header).
    pub(crate) fn announced(&self, name: &str) {
        let mut st = self.lock();
        if st.name.as_deref() != Some(name) {
            st.name = Some(name.to_string());
            st.conn = None;
            st.retry_at = None;
            st.generation += 1;
        }
    }

    /// Whether a socket is known (reads try it).
    pub(crate) fn known(&self) -> bool {
        self.lock().name.is_some()
    }

    /// Reads what it can of `c` from the shard files and returns the object
    /// ranges left for HTTP (in order; all of the chunk when nothing could
    /// be read locally), and the ETag of the version read locally: the
    /// ranges left must be read from that version too (`If-Match`), so
    /// that one request never mixes two versions.
    pub(crate) fn read_chunk(&self, c: &Chunk) -> (Vec<(u64, u64)>, Option<Arc<str>>) {
        let mut left: Vec<(u64, u64)> = Vec::new();
        let mut etag: Option<Arc<str>> = c.etag.clone();
        let mut grants: Vec<Arc<Held>> = Vec::new();
        let mut asked_from: Option<u64> = None;
        let mut refused = false;
        let mut scratch = Scratch::default();
        for (off, len, read) in &c.pieces {
            let end = off + len;
            let mut x = *off;
            while x < end {
                let held = match grants.iter().find(|g| g.covers(x)) {
                    Some(g) => Some(g.clone()),
                    None if !refused && asked_from.is_none_or(|a| a < x) => {
                        asked_from = Some(x);
                        let g = self.grant(c, etag.as_deref(), x);
                        match &g {
                            Some(g) => {
                                etag.get_or_insert_with(|| g.grant.etag.as_str().into());
                                grants.push(g.clone());
                            }
                            // Nothing local for this version: the rest of
                            // the chunk goes over HTTP without asking again.
                            None => refused = true,
                        }
                        g.filter(|g| g.covers(x))
                    }
                    None => None,
                };
                let Some(held) = held else {
                    // Nothing local for the rest of this piece.
                    push_range(&mut left, x, end);
                    break;
                };
                let seg = held.segment(x, end);
                // SAFETY: the destination lies inside the read's buffer
                // (checked at submit), kept mapped by the read state; no other
                // request writes these bytes (the planner gives each byte to
                // one request), and this chunk's hedges are off.
                let dst = unsafe { std::slice::from_raw_parts_mut(read.dst_at(x), seg.len) };
                match held.read_segment(&seg, dst, &mut scratch) {
                    Ok(mapped) => {
                        self.counters
                            .bytes
                            .fetch_add(seg.len as u64, Ordering::Relaxed);
                        if mapped {
                            self.counters
                                .mapped_bytes
                                .fetch_add(seg.len as u64, Ordering::Relaxed);
                        }
                    }
                    Err(_) => {
                        self.counters
                            .fallback_bytes
                            .fetch_add(seg.len as u64, Ordering::Relaxed);
                        push_range(&mut left, x, x + seg.len as u64);
                    }
                }
                x += seg.len as u64;
            }
        }
        // Grants of reads without an ETag are not kept: let them go now.
        if c.etag.is_none() {
            let mut st = self.lock();
            for g in grants {
                release(&mut st, &g);
            }
        }
        (left, etag)
    }

    /// A grant covering object byte `from` of `c`'s object (of the version
    /// `etag` when given): one kept for the read's ETag, or a new one. None
    /// when none can be had (the reason does not matter: HTTP gives the
    /// authoritative answer).
    fn grant(&self, c: &Chunk, etag: Option<&str>, from: u64) -> Option<Arc<Held>> {
        let mut st = self.lock();
        let now = Instant::now();
        if let Some(etag) = &c.etag {
            let key = (c.bucket.clone(), c.key.clone(), etag.clone());
            let generation = st.generation;
            if let Some(list) = st.kept.get_mut(&key) {
                list.retain(|g| g.usable_until > now && g.generation == generation);
                let found = list.iter().find(|g| g.covers(from)).cloned();
                if list.is_empty() {
                    st.kept.remove(&key);
                }
                if found.is_some() {
                    return found;
                }
            }
        }
        if st.retry_at.is_some_and(|t| now < t) {
            return None;
        }
        if st.conn.is_none() {
            let name = st.name.clone()?;
            match self.connect(&name) {
                Ok(s) => {
                    st.conn = Some(s);
                    st.generation += 1;
                }
                Err(_) => {
                    st.retry_at = Some(now + RETRY_AFTER);
                    return None;
                }
            }
        }
        st.next_id = st.next_id.wrapping_add(1);
        let req = LayoutRequest {
            id: st.next_id,
            bucket: c.bucket.to_string(),
            key: c.key.to_string(),
            version: String::new(),
            if_match: etag.unwrap_or("").to_string(),
            start: from,
            end: c.end.max(from),
        };
        let sock = st.conn.as_mut().expect("connected above");
        let answer = ask(sock, &req);
        let (grant, fds) = match answer {
            Ok(Some(g)) => g,
            Ok(None) => return None,
            Err(_) => {
                // The connection is unusable; its pins lapse with it.
                st.conn = None;
                st.generation += 1;
                return None;
            }
        };
        self.counters.grants.fetch_add(1, Ordering::Relaxed);
        let lease = Duration::from_millis(grant.lease_ms as u64);
        let mut fds = fds.into_iter();
        let parts = grant
            .parts
            .iter()
            .map(|p| PartFiles {
                offset: p.offset,
                size: p.size,
                shards: p
                    .shards
                    .iter()
                    .map(|&present| {
                        present.then(|| ShardFile {
                            fd: fds.next().expect("as many descriptors as flags (checked)"),
                            direct: OnceLock::new(),
                            table: OnceLock::new(),
                        })
                    })
                    .collect(),
            })
            .collect();
        let held = Arc::new(Held {
            usable_until: now + lease.saturating_sub(LEASE_MARGIN.min(lease / 4)),
            generation: st.generation,
            grant,
            parts,
        });
        if let Some(etag) = &c.etag {
            if st.kept.values().map(Vec::len).sum::<usize>() >= GRANTS_KEPT_MAX {
                let all: Vec<_> = st.kept.drain().flat_map(|(_, v)| v).collect();
                for g in all {
                    release(&mut st, &g);
                }
            }
            st.kept
                .entry((c.bucket.clone(), c.key.clone(), etag.clone()))
                .or_default()
                .push(held.clone());
        }
        Some(held)
    }

    /// Connects and proves the credentials both ways.
    fn connect(&self, name: &str) -> std::io::Result<UnixStream> {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let mut s = UnixStream::connect_addr(&addr)?;
        let timeout = Some(self.io_timeout.min(ANSWER_TIMEOUT));
        s.set_read_timeout(timeout)?;
        s.set_write_timeout(timeout)?;
        s.write_all(
            &Msg::Hello {
                min: wire::VERSION,
                max: wire::VERSION,
            }
            .encode(),
        )?;
        let Msg::HelloReply {
            nonce: server_nonce,
            ..
        } = recv(&mut s)?.0
        else {
            return Err(refused("the server did not answer HELLO"));
        };
        let nonce = auth::nonce();
        let ak = self.creds.access_key.as_bytes();
        let secret = &self.creds.secret_key;
        let proof = auth::proof_for(
            wire::LABELS,
            Side::Client,
            secret,
            &server_nonce,
            &nonce,
            ak,
        );
        s.write_all(
            &Msg::Auth {
                access_key: self.creds.access_key.clone(),
                nonce,
                proof,
            }
            .encode(),
        )?;
        let Msg::AuthReply { proof } = recv(&mut s)?.0 else {
            return Err(refused("the credentials were not accepted"));
        };
        // A process on the socket that does not know the secret cannot
        // pass as the server.
        if !auth::verify_for(
            wire::LABELS,
            Side::Server,
            secret,
            &server_nonce,
            &nonce,
            ak,
            &proof,
        ) {
            return Err(refused("the server did not prove the credentials"));
        }
        Ok(s)
    }
}

/// Lets a grant's pin go (best effort: it lapses anyway).
fn release(st: &mut State, g: &Held) {
    if g.generation != st.generation {
        return;
    }
    if let Some(s) = st.conn.as_mut() {
        let m = Msg::Release { pin: g.grant.pin }.encode();
        if s.write_all(&m).is_err() {
            st.conn = None;
            st.generation += 1;
        }
    }
}

fn push_range(left: &mut Vec<(u64, u64)>, a: u64, b: u64) {
    match left.last_mut() {
        Some(last) if last.1 == a => last.1 = b,
        _ => left.push((a, b)),
    }
}

fn refused(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, what.to_string())
}

fn bad(what: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.into())
}

/// Sends a layout request and reads its answer: the grant and its
/// descriptors, or None for an answer that sends the read to HTTP. An
/// error leaves the connection unusable.
fn ask(s: &mut UnixStream, req: &LayoutRequest) -> std::io::Result<Option<(Grant, Vec<OwnedFd>)>> {
    s.write_all(&Msg::Layout(req.clone()).encode())?;
    let (msg, fds) = recv(s)?;
    match msg {
        Msg::Granted(g) if g.id == req.id => {
            if fds.len() != g.fd_count() {
                return Err(bad("a grant's descriptors do not match its flags"));
            }
            if g.parts
                .iter()
                .any(|p| p.shards.len() != g.data_shards as usize)
            {
                return Err(bad("a grant's shard flags do not match its shards"));
            }
            if !req.if_match.is_empty()
                && req.if_match.trim_matches('"') != g.etag.trim_matches('"')
            {
                return Ok(None);
            }
            Ok(Some((g, fds)))
        }
        Msg::Elsewhere { id, .. } | Msg::Refused { id, .. } if id == req.id => Ok(None),
        Msg::Error { message, .. } => Err(bad(message)),
        _ => Err(bad("an answer to another request")),
    }
}

/// One frame and the descriptors that came with it.
fn recv(s: &mut UnixStream) -> std::io::Result<(Msg, Vec<OwnedFd>)> {
    let mut head = [0u8; 4];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < 4 {
        let (n, more) = tarn_wire::fdpass::recv(s.as_raw_fd(), &mut head[got..])?;
        fds.extend(more);
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    let n = Msg::frame_len(head).map_err(|e| bad(e.to_string()))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    let msg = Msg::decode(&body).map_err(|e| bad(e.to_string()))?;
    Ok((msg, fds))
}

/// A block read whole and checked, for segments that take part of it:
/// which block it is (grant, part, shard, stripe), while it holds one.
#[derive(Default)]
pub(crate) struct Scratch {
    bytes: Vec<u8>,
    holds: Option<(usize, usize, usize, u64)>,
}

/// Object bytes `[x, x + len)`, all in block `stripe` of data shard `shard`
/// of part `part`, starting `in_block` bytes into the block.
struct Segment {
    part: usize,
    stripe: u64,
    shard: usize,
    in_block: u64,
    len: usize,
}

impl Held {
    fn covers(&self, x: u64) -> bool {
        self.parts
            .iter()
            .any(|p| p.offset <= x && x < p.offset + p.size)
    }

    fn geometry(&self, p: &PartFiles) -> StripeGeometry {
        StripeGeometry::new(p.size, self.grant.stripe_size, self.grant.data_shards)
    }

    /// The segment of `[x, end)` that starts at `x` (x is covered).
    fn segment(&self, x: u64, end: u64) -> Segment {
        let part = self
            .parts
            .iter()
            .position(|p| p.offset <= x && x < p.offset + p.size)
            .expect("covered");
        let p = &self.parts[part];
        let g = self.geometry(p);
        let at = x - p.offset;
        let stripe = at / g.stripe_size;
        let in_stripe = at - stripe * g.stripe_size;
        let block = g.shard_len(stripe);
        let shard = (in_stripe / block) as usize;
        let in_block = in_stripe - shard as u64 * block;
        // The block holds object bytes up to the end of its stripe's data.
        let block_end = ((shard as u64 + 1) * block).min(g.stripe_data_len(stripe));
        let len = (block_end - in_stripe).min(end - x) as usize;
        Segment {
            part,
            stripe,
            shard,
            in_block,
            len,
        }
    }

    /// Reads a segment into `dst`: into [`HostMemory`](super::HostMemory)
    /// as a locked mapping of the file's pages where it can (true), else
    /// the whole block, checked, straight into `dst` when the segment is all
    /// of it, else through `scratch` (which keeps the last block so checked,
    /// for the next piece that starts in it).
    fn read_segment(
        &self,
        seg: &Segment,
        dst: &mut [u8],
        scratch: &mut Scratch,
    ) -> Result<bool, String> {
        let p = &self.parts[seg.part];
        let file = p.shards[seg.shard]
            .as_ref()
            .ok_or("the shard is on another node's drive")?;
        let g = self.geometry(p);
        let table = file
            .table
            .get_or_init(|| load_table(&file.fd, g, seg.shard))
            .as_ref()
            .map_err(|e| e.clone())?;
        let want = *table
            .crcs
            .get(seg.stripe as usize)
            .ok_or("a block past the table")?;
        let block = g.shard_len(seg.stripe) as usize;
        let offset = table.layout.block_offset(seg.stripe);
        if seg.len >= hostmem::MAP_MIN_BYTES {
            let b = hostmem::Block {
                fd: &file.fd,
                offset,
                len: block,
                crc: want,
            };
            match hostmem::map_block_run(dst, &b, seg.in_block as usize, &mut scratch.bytes) {
                Mapped::Done => {
                    scratch.holds = None;
                    return Ok(true);
                }
                Mapped::Failed(e) => {
                    scratch.holds = None;
                    return Err(e);
                }
                Mapped::No => {}
            }
        }
        if seg.in_block == 0 && seg.len == block {
            let direct = (dst.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN)
                && block.is_multiple_of(DIRECT_ALIGN)
                && offset.is_multiple_of(DIRECT_ALIGN as u64);
            let fd = if direct {
                file.direct
                    .get_or_init(|| reopen_direct(&file.fd))
                    .as_ref()
                    .unwrap_or(&file.fd)
            } else {
                &file.fd
            };
            let read = pread_exact(fd, dst, offset).or_else(|_| pread_exact(&file.fd, dst, offset));
            read.map_err(|e| e.to_string())?;
            return check(dst, want, seg.stripe).map(|()| false);
        }
        let which = (
            self as *const Held as usize,
            seg.part,
            seg.shard,
            seg.stripe,
        );
        if scratch.holds != Some(which) {
            scratch.holds = None;
            scratch.bytes.resize(block, 0);
            pread_exact(&file.fd, &mut scratch.bytes, offset).map_err(|e| e.to_string())?;
            check(&scratch.bytes, want, seg.stripe)?;
            scratch.holds = Some(which);
        }
        let from = seg.in_block as usize;
        dst.copy_from_slice(&scratch.bytes[from..from + seg.len]);
        Ok(false)
    }
}

fn check(block: &[u8], want: u32, j: u64) -> Result<(), String> {
    if crc32c(block) == want {
        Ok(())
    } else {
        Err(format!("shard block {j} failed its checksum"))
    }
}

/// The file's length against the geometry, its footer, and its checksum
/// table (checked against the footer).
fn load_table(fd: &OwnedFd, g: StripeGeometry, shard: usize) -> Result<Table, String> {
    // SAFETY: fstat into a zeroed struct on a descriptor we own.
    let len = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        st.st_size as u64
    };
    let layout = ShardLayout::for_file_len(g, len)
        .ok_or_else(|| format!("the shard file is {len} bytes, not what its part implies"))?;
    let n = g.stripe_count();
    let mut tail = vec![0u8; (4 * n + FOOTER_BYTES) as usize];
    pread_exact(fd, &mut tail, layout.blocks_len()).map_err(|e| e.to_string())?;
    let (table, footer) = tail.split_at(4 * n as usize);
    let u32_at = |i: usize| u32::from_le_bytes(footer[i..i + 4].try_into().expect("4"));
    if footer[0..4] != SHARD_MAGIC
        || u32_at(28) != crc32c(&footer[..28])
        || footer[6] as usize != shard
        || u64::from_le_bytes(footer[8..16].try_into().expect("8")) != n
        || u32_at(24) != crc32c(table)
    {
        return Err("the shard file's footer does not match its part".into());
    }
    Ok(Table {
        layout,
        crcs: table
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
            .collect(),
    })
}

/// A second description of the same file with O_DIRECT, opened read-only
/// through /proc (the permission check is the file's own: read-only for
/// anyone but the server's user).
fn reopen_direct(fd: &OwnedFd) -> Option<OwnedFd> {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    // SAFETY: open with a NUL-terminated path; the result is owned at once.
    let raw = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECT | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a descriptor open() just returned.
    (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw) })
}

pub(crate) fn pread_exact(fd: &OwnedFd, buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: pread into the unfilled rest of `buf`.
        let n = unsafe {
            libc::pread(
                fd.as_raw_fd(),
                buf[done..].as_mut_ptr().cast(),
                buf.len() - done,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        done += n as usize;
        offset += n as u64;
    }
    Ok(())
}
