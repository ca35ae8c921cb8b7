//! The KV client: connect (shared memory when the server is on this host, TCP
//! otherwise), authenticate, batched async calls, and blocking wrappers.
//!
//! Every connection proves its credentials (AUTH; `tarn_wire::auth`) and checks
//! the server's proof in return. Over shared memory a get is one copy from the
//! tenant's arena, mapped read-only, into the caller's buffer, checksummed as
//! it is copied against the CRC the daemon sends from its own memory; a put
//! copies the value into this connection's put window (a memfd of its own)
//! and the daemon copies it into the arena. Over TCP the bytes travel in the
//! frames and land directly in the caller's buffers. Either way every
//! whole-value read is checked against the value's CRC32C, and a block that
//! fails is a miss.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tarn_io::tls::MaybeTls;
use tarn_wire::arena::Arena;
use tarn_wire::auth::{self, Credentials, Side};
use tarn_wire::fdpass;
use tarn_wire::mailbox::{self, Area, Mailbox};
use tarn_wire::park;
use tarn_wire::proto::*;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UnixStream};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("KV connection: {0}")]
    Io(#[from] io::Error),
    #[error("KV server refused the request: {0}")]
    Server(ProtoError),
    #[error("KV server sent a malformed response: {0}")]
    Protocol(String),
    #[error("{0}")]
    Usage(String),
    #[error("KV connection is closed after an earlier error; reconnect")]
    Broken,
}

pub type Result<T> = std::result::Result<T, Error>;

/// Which transport to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory when the server is on this host, else TCP.
    #[default]
    Auto,
    Tcp,
    /// Shared memory or fail.
    Shm,
}

/// The transport a client ended up with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    Tcp,
    Shm,
}

#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub transport: TransportChoice,
    /// Namespace of every call (model, dtype, layout, block size, tenant).
    pub namespace: Vec<u8>,
    pub connect_timeout: Duration,
    /// Over shared memory, send requests through a mailbox in shared memory
    /// (no system call per request while the daemon is awake) instead of the
    /// Unix socket.
    pub shm_mailbox: bool,
    /// How long a call spins waiting for its response before parking the
    /// thread: a parked thread costs a wakeup (tens of microseconds on a VM)
    /// per round trip, a spinning one costs a core while it waits.
    pub response_spin: Duration,
    /// Longest a call may wait for the server (None: no limit). A call that
    /// runs out fails with a `TimedOut` I/O error and its connection is
    /// closed (it may be mid-frame); a server that stopped answering never
    /// hangs the caller past this.
    pub call_timeout: Option<Duration>,
    /// Who connects. None: `TARN_ACCESS_KEY` and `TARN_SECRET_KEY` when set,
    /// else the built-in credentials a daemon accepts on loopback.
    pub credentials: Option<Credentials>,
    /// Over shared memory: bytes of this connection's put window, the memory
    /// values are written into for the daemon to copy (grown to the server's
    /// largest value when smaller). A batch whose values do not fit goes in
    /// several requests. Pages are allocated as they are first written.
    pub put_window_bytes: usize,
    /// Over shared memory: this memfd (sealed against shrinking) of that
    /// many bytes is the put window instead of one of the connection's own
    /// (a [`RegisteredBuffer`]'s: its puts are one copy, the daemon's).
    pub put_window_fd: Option<(Arc<OwnedFd>, usize)>,
    /// TLS to a server whose KV listener serves it (None: plain TCP, or
    /// for a `tls://` endpoint the system's trusted roots). Every member
    /// of a cluster is reached the same way.
    pub tls: Option<Arc<tarn_io::tls::rustls::ClientConfig>>,
}

/// Put window of a shared-memory connection unless told otherwise: a batch
/// of 32 × 2 MiB blocks in one request.
pub const PUT_WINDOW_DEFAULT_BYTES: usize = 64 << 20;

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            transport: TransportChoice::Auto,
            namespace: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            shm_mailbox: true,
            response_spin: RESPONSE_SPIN_DEFAULT,
            call_timeout: None,
            credentials: None,
            put_window_bytes: PUT_WINDOW_DEFAULT_BYTES,
            put_window_fd: None,
            tls: None,
        }
    }
}

/// What every batch of a call carries besides its keys: the namespace, and
/// for a client routing over a cluster the view it routed by and the
/// batch's flags (`BATCH_FALLBACK`, `BATCH_COPY`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    pub namespace: Vec<u8>,
    pub flags: u16,
    pub route: Option<Route>,
}

impl Scope {
    pub fn new(namespace: Vec<u8>) -> Scope {
        Scope {
            namespace,
            ..Scope::default()
        }
    }

    fn head(&self, out: &mut Vec<u8>, count: usize, arg: u32) {
        put_batch_head_with(out, &self.namespace, count, arg, self.flags, self.route);
    }

    /// A put's head: with `parts`, every entry is followed by its [`Part`].
    fn head_parts(&self, out: &mut Vec<u8>, count: usize, parts: bool) {
        let flags = self.flags | if parts { BATCH_PARTS } else { 0 };
        put_batch_head_with(out, &self.namespace, count, 0, flags, self.route);
    }
}

/// One GET: `len` bytes from `offset` of the value (None: to its end) into
/// the front of `buf`.
pub struct GetInto<'a> {
    pub digest: Digest,
    pub offset: u64,
    pub len: Option<u64>,
    pub buf: &'a mut [u8],
}

impl<'a> GetInto<'a> {
    /// The request's GET entry on the wire.
    fn entry(&self) -> GetEntry {
        GetEntry {
            digest: self.digest,
            offset: self.offset,
            length: self.len.unwrap_or(LENGTH_TO_END),
        }
    }

    /// The whole value into `buf`.
    pub fn whole(digest: Digest, buf: &'a mut [u8]) -> Self {
        GetInto {
            digest,
            offset: 0,
            len: None,
            buf,
        }
    }
}

/// Outcome of one GET: `len` bytes are in the buffer when `status` is Ok
/// (with `BufferTooSmall`, `len` is what the buffer would have had to hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetOutcome {
    pub status: Status,
    pub len: u64,
    /// Length of the whole stored value (0 on a miss).
    pub value_len: u64,
    /// The server counts the block as read often (`RESULT_HOT`).
    pub hot: bool,
}

impl GetOutcome {
    fn miss(status: Status) -> Self {
        GetOutcome {
            status,
            len: 0,
            value_len: 0,
            hot: false,
        }
    }

    /// The caller's buffer cannot hold the `len` bytes asked for.
    fn too_small(len: u64, value_len: u64) -> Self {
        GetOutcome {
            status: Status::BufferTooSmall,
            len,
            value_len,
            hot: false,
        }
    }
}

/// One PUT: a value under a digest.
#[derive(Debug, Clone, Copy)]
pub struct PutFrom<'a> {
    pub digest: Digest,
    pub data: &'a [u8],
}

/// Memory registered with the client: page-aligned, faulted in and locked in
/// RAM (best effort) when registered, so batched I/O into it never waits on a
/// page fault or an allocation. I/O names regions of it by offset (the style
/// of 3FS USRBIO): many `(key, value range, buffer offset)` reads or writes
/// in one call.
pub struct RegisteredBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    locked: bool,
    /// The memfd behind it, sealed against shrinking: on the same host a
    /// connection takes it as its put window, so a put is one copy (the
    /// daemon's, from here into its arena).
    fd: Arc<OwnedFd>,
    /// Dropped with the buffer: a client's connection attached to it goes
    /// with it.
    alive: Arc<()>,
}

// SAFETY: plain owned memory.
unsafe impl Send for RegisteredBuffer {}
unsafe impl Sync for RegisteredBuffer {}

impl RegisteredBuffer {
    pub fn new(len: usize) -> Result<RegisteredBuffer> {
        if len == 0 {
            return Err(Error::Usage("a registered buffer needs a length".into()));
        }
        let map_len = len.next_multiple_of(4096);
        let fd = sealed_memfd(c"tarn-kv-registered", map_len)?;
        // SAFETY: a shared mapping of our own sealed memfd, faulted in now.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Io(io::Error::last_os_error()));
        }
        // SAFETY: locking our own mapping; failure (RLIMIT_MEMLOCK) is fine.
        let locked = unsafe { libc::mlock(p, map_len) } == 0;
        Ok(RegisteredBuffer {
            ptr: std::ptr::NonNull::new(p.cast()).expect("mmap never returns null"),
            len,
            locked,
            fd: Arc::new(fd),
            alive: Arc::new(()),
        })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether the pages are locked in RAM (mlock can fail under RLIMIT_MEMLOCK).
    pub fn is_locked(&self) -> bool {
        self.locked
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: our mapping of len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: our mapping, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len.next_multiple_of(4096)) };
    }
}

/// One read into a registered buffer: `len` bytes (None: to the end) from
/// `value_offset` of the value, into `buf_len` bytes at `buf_offset`.
#[derive(Debug, Clone, Copy)]
pub struct ReadIo {
    pub digest: Digest,
    pub value_offset: u64,
    pub len: Option<u64>,
    pub buf_offset: usize,
    pub buf_len: usize,
}

/// One write from a registered buffer: the `len` bytes at `buf_offset`.
#[derive(Debug, Clone, Copy)]
pub struct WriteIo {
    pub digest: Digest,
    pub buf_offset: usize,
    pub len: usize,
}

/// A request/response channel over a byte stream (TCP or the Unix socket).
struct Channel<S> {
    io: BufReader<S>,
    /// The socket, for polling without parking the thread.
    fd: i32,
    out: Vec<u8>,
    inp: Vec<u8>,
    next_id: u64,
    /// Set while a request is unanswered, and kept after an I/O or protocol
    /// error: a call whose future was dropped mid-flight (a cancelled await)
    /// leaves its response unread, so the connection must not be reused. On
    /// a mailbox that matters doubly: a new request would overwrite one the
    /// daemon may still be reading.
    broken: bool,
    response_spin: Duration,
    /// Shared-memory connections that negotiated one: requests and responses
    /// travel through it, and the socket only carries doorbells.
    mailbox: Option<Mailbox>,
    /// Sequence number of the last request posted to the mailbox.
    mailbox_seq: u64,
}

/// KV calls usually answer within this; see [`ConnectOptions::response_spin`].
const RESPONSE_SPIN_DEFAULT: Duration = Duration::from_micros(100);

impl<S: AsyncRead + AsyncWrite + Unpin + AsRawFd> Channel<S> {
    fn new(s: S) -> Self {
        Channel {
            fd: s.as_raw_fd(),
            io: BufReader::with_capacity(64 << 10, s),
            out: Vec::with_capacity(64 << 10),
            inp: Vec::new(),
            next_id: 1,
            broken: false,
            response_spin: RESPONSE_SPIN_DEFAULT,
            mailbox: None,
            mailbox_seq: 0,
        }
    }

    fn begin(&mut self, op: Op) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        begin_frame(&mut self.out, op as u16, id);
        id
    }

    /// Sends the frame in `out` followed by `bulk` slices.
    async fn send(&mut self, bulk: &[&[u8]]) -> Result<()> {
        self.broken = true;
        let total: u64 = bulk.iter().map(|b| b.len() as u64).sum();
        finish_frame(&mut self.out, total);
        if let Some(mb) = &self.mailbox {
            // Callers on a mailbox send control frames only (GET_SHM,
            // RESERVE/COMMIT): bulk data goes through the arena.
            assert!(bulk.is_empty(), "bulk data on a mailbox connection");
            mb.write(Area::Request, &self.out)?;
            self.mailbox_seq += 1;
            if park::publish(mb.request_seq(), self.mailbox_seq, mb.server_parked()) {
                mailbox::ring(self.fd);
            }
            return Ok(());
        }
        let w = self.io.get_mut();
        w.write_all(&self.out).await?;
        for b in bulk {
            w.write_all(b).await?;
        }
        Ok(())
    }

    /// Reads a response header for request `id` and op `op`; an error frame
    /// becomes [`Error::Server`] (its payload read).
    async fn recv_head(&mut self, id: u64, op: Op) -> Result<FrameHeader> {
        let mut head = [0u8; FRAME_HEADER_BYTES];
        if self.mailbox.is_some() {
            self.await_mailbox().await?;
            let mb = self.mailbox.as_ref().expect("mailbox");
            mb.read(Area::Response, 0, &mut head);
        } else {
            if self.io.buffer().is_empty() {
                mailbox::spin_until_readable(self.fd, self.response_spin);
            }
            self.io.read_exact(&mut head).await?;
        }
        let h = FrameHeader::decode(&head).map_err(|e| Error::Protocol(e.to_string()))?;
        if h.op == Op::Error as u16 | RESPONSE_BIT {
            if h.len > 4096 {
                return Err(Error::Protocol("oversized error frame".into()));
            }
            self.read_payload(h.len).await?;
            self.broken = false;
            return Err(Error::Server(decode_error(&self.inp)));
        }
        if h.op != op as u16 | RESPONSE_BIT || h.request_id != id {
            return Err(Error::Protocol(format!(
                "response op {:#x} id {} for request op {:?} id {id}",
                h.op, h.request_id, op
            )));
        }
        Ok(h)
    }

    async fn read_payload(&mut self, len: u64) -> Result<()> {
        if len > CONTROL_MAX_BYTES as u64 {
            return Err(Error::Protocol(format!("response of {len} bytes")));
        }
        self.inp.resize(len as usize, 0);
        if let Some(mb) = &self.mailbox {
            if !mb.read(Area::Response, FRAME_HEADER_BYTES, &mut self.inp) {
                return Err(Error::Protocol("response overruns the mailbox".into()));
            }
            return Ok(());
        }
        self.io.read_exact(&mut self.inp).await?;
        Ok(())
    }

    /// The mailbox's words, for errors.
    fn mailbox_state(&self) -> String {
        match &self.mailbox {
            None => "no mailbox".into(),
            Some(mb) => format!(
                "mailbox: posted {} of {}, answered {}, daemon parked {}, client parked {}",
                mb.request_seq().load(Ordering::Acquire),
                self.mailbox_seq,
                mb.response_seq().load(Ordering::Acquire),
                mb.server_parked().load(Ordering::Acquire),
                mb.client_parked().load(Ordering::Acquire),
            ),
        }
    }

    /// Waits until the daemon has answered the last mailbox request: spins,
    /// then parks on the socket until a doorbell (see `tarn_wire::mailbox`).
    async fn await_mailbox(&mut self) -> Result<()> {
        let Channel {
            mailbox,
            io,
            response_spin,
            mailbox_seq,
            ..
        } = self;
        let mb = mailbox.as_ref().expect("mailbox");
        let answered = || mb.response_seq().load(Ordering::Acquire) == *mailbox_seq;
        if mailbox::spin_until(*response_spin, answered) {
            return Ok(());
        }
        loop {
            if !park::prepare_park(mb.client_parked(), answered) {
                return Ok(());
            }
            // Doorbell bytes carry no data: drain whatever is there.
            let n = io.fill_buf().await?.len();
            io.consume(n);
            park::unpark(mb.client_parked());
            if n == 0 {
                return Err(Error::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the KV server closed the connection",
                )));
            }
            if answered() {
                return Ok(());
            }
        }
    }

    /// A response whose payload the caller already has (streamed through
    /// the mailbox): checks its header and length, reads nothing more.
    async fn recv_known(&mut self, id: u64, op: Op, len: u64) -> Result<()> {
        let h = self.recv_head(id, op).await?;
        if h.len != len {
            return Err(Error::Protocol(format!("{op:?} response length mismatch")));
        }
        self.broken = false;
        Ok(())
    }

    /// A whole control response (no bulk data).
    async fn recv(&mut self, id: u64, op: Op) -> Result<()> {
        let h = self.recv_head(id, op).await?;
        self.read_payload(h.len).await?;
        self.broken = false;
        Ok(())
    }

    async fn hello(&mut self, flags: u32) -> Result<HelloReply> {
        let id = self.begin(Op::Hello);
        Hello {
            version_min: VERSION_MIN,
            version_max: VERSION_MAX,
            flags,
        }
        .encode(&mut self.out);
        self.send(&[]).await?;
        self.recv(id, Op::Hello).await?;
        HelloReply::decode(&self.inp).map_err(|e| Error::Protocol(e.to_string()))
    }

    /// AUTH on a stream without descriptors (TCP): proves `creds` for the
    /// nonce of this connection's HELLO and checks the server's proof.
    async fn auth(&mut self, creds: &Credentials, server_nonce: &auth::Nonce) -> Result<AuthReply> {
        let id = self.begin(Op::Auth);
        let client_nonce = auth::nonce();
        auth_request(creds, server_nonce, &client_nonce, 0).encode(&mut self.out);
        self.send(&[]).await?;
        self.recv(id, Op::Auth).await?;
        let reply = AuthReply::decode(&self.inp).map_err(proto)?;
        check_server_proof(creds, server_nonce, &client_nonce, &reply)?;
        Ok(reply)
    }

    async fn exists(&mut self, ns: &Scope, digests: &[Digest]) -> Result<ExistsReply> {
        let id = self.begin(Op::Exists);
        ns.head(&mut self.out, digests.len(), 0);
        for d in digests {
            self.out.extend_from_slice(d);
        }
        self.send(&[]).await?;
        self.recv(id, Op::Exists).await?;
        ExistsReply::decode(&self.inp, digests.len()).map_err(|e| Error::Protocol(e.to_string()))
    }

    async fn keys_op(
        &mut self,
        op: Op,
        ns: &Scope,
        digests: &[Digest],
        arg: u32,
    ) -> Result<Vec<Status>> {
        let id = self.begin(op);
        ns.head(&mut self.out, digests.len(), arg);
        for d in digests {
            self.out.extend_from_slice(d);
        }
        self.send(&[]).await?;
        self.recv(id, op).await?;
        decode_statuses(&self.inp, digests.len()).map_err(|e| Error::Protocol(e.to_string()))
    }

    async fn cluster(&mut self) -> Result<ClusterView> {
        let id = self.begin(Op::Cluster);
        self.send(&[]).await?;
        self.recv(id, Op::Cluster).await?;
        ClusterView::decode(&self.inp).map_err(proto)
    }

    async fn stats(&mut self, ns: &Scope) -> Result<Vec<(String, u64)>> {
        let id = self.begin(Op::Stats);
        ns.head(&mut self.out, 0, 0);
        self.send(&[]).await?;
        self.recv(id, Op::Stats).await?;
        decode_stats(&self.inp).map_err(|e| Error::Protocol(e.to_string()))
    }

    fn encode_gets(&mut self, ns: &Scope, entries: impl ExactSizeIterator<Item = GetEntry>) {
        ns.head(&mut self.out, entries.len(), 0);
        for e in entries {
            e.encode(&mut self.out);
        }
    }

    /// GET with the data in the response, read straight into the caller's buffers.
    async fn get_tcp(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        let id = self.begin(Op::Get);
        self.encode_gets(ns, reqs.iter().map(GetInto::entry));
        self.send(&[]).await?;
        let h = self.recv_head(id, Op::Get).await?;
        let table = 4 + reqs.len() * GET_TCP_RESULT_BYTES;
        if h.len < table as u64 {
            return Err(Error::Protocol(
                "GET response shorter than its table".into(),
            ));
        }
        self.read_payload(table as u64).await?;
        let mut r = Reader::new(&self.inp);
        let n = r.u32().map_err(proto)? as usize;
        if n != reqs.len() {
            return Err(Error::Protocol("GET response count mismatch".into()));
        }
        let mut results = Vec::with_capacity(n);
        for _ in 0..n {
            results.push(GetResult::decode(&mut r).map_err(proto)?);
        }
        let bulk: u64 = results.iter().map(|g| g.data_len).sum();
        if h.len != table as u64 + bulk {
            return Err(Error::Protocol("GET response length mismatch".into()));
        }
        let mut out = Vec::with_capacity(n);
        for (req, g) in reqs.iter_mut().zip(&results) {
            if g.status != Status::Ok {
                out.push(GetOutcome::miss(g.status));
                continue;
            }
            if g.data_len > req.buf.len() as u64 {
                discard(&mut self.io, g.data_len).await?;
                out.push(GetOutcome::too_small(g.data_len, g.value_len));
                continue;
            }
            let dst = &mut req.buf[..g.data_len as usize];
            self.io.read_exact(dst).await?;
            let whole = req.offset == 0 && g.data_len == g.value_len;
            if whole && crc32c(dst) != g.crc {
                out.push(GetOutcome::miss(Status::Corrupt));
                continue;
            }
            out.push(GetOutcome {
                status: Status::Ok,
                len: g.data_len,
                value_len: g.value_len,
                hot: g.hot,
            });
        }
        self.broken = false;
        Ok(out)
    }

    /// PUT with the values in the frame.
    async fn put_tcp(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        let id = self.begin(Op::Put);
        ns.head_parts(&mut self.out, items.len(), parts.is_some());
        for (i, it) in items.iter().enumerate() {
            PutEntry {
                digest: it.digest,
                len: it.data.len() as u64,
                crc: crc32c(it.data),
            }
            .encode(&mut self.out);
            if let Some(p) = parts {
                p[i].encode(&mut self.out);
            }
        }
        let bulk: Vec<&[u8]> = items.iter().map(|i| i.data).collect();
        self.send(&bulk).await?;
        self.recv(id, Op::Put).await?;
        decode_statuses(&self.inp, items.len()).map_err(|e| Error::Protocol(e.to_string()))
    }
}

fn proto(e: ProtoError) -> Error {
    Error::Protocol(e.to_string())
}

fn auth_request(
    creds: &Credentials,
    server_nonce: &auth::Nonce,
    client_nonce: &auth::Nonce,
    flags: u16,
) -> Auth {
    let key = creds.access_key.as_bytes();
    Auth {
        flags,
        client_nonce: *client_nonce,
        proof: auth::proof(
            Side::Client,
            &creds.secret_key,
            server_nonce,
            client_nonce,
            key,
        ),
        access_key: key.to_vec(),
    }
}

/// A server that cannot prove it knows the secret is not the daemon the
/// client meant (a process squatting on the port or socket): refuse it.
fn check_server_proof(
    creds: &Credentials,
    server_nonce: &auth::Nonce,
    client_nonce: &auth::Nonce,
    reply: &AuthReply,
) -> Result<()> {
    let key = creds.access_key.as_bytes();
    if auth::verify(
        Side::Server,
        &creds.secret_key,
        server_nonce,
        client_nonce,
        key,
        &reply.server_proof,
    ) {
        Ok(())
    } else {
        Err(Error::Protocol(
            "the KV server could not prove it holds the secret key; not talking to it".into(),
        ))
    }
}

async fn discard<R: AsyncRead + Unpin>(r: &mut R, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 8192];
    while n > 0 {
        let k = (n as usize).min(scratch.len());
        r.read_exact(&mut scratch[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

/// The client's half of a GET over shared memory.
trait CopyOut {
    fn copy_out(&self, g: &ShmGetResult, req: &mut GetInto<'_>) -> Result<GetOutcome>;
}

impl CopyOut for Arena {
    /// Copies one block the daemon located out of the arena into the caller's
    /// buffer, checking the checksum (whole values) as it copies and the
    /// slot's generation after: a block evicted while we copied is a miss.
    fn copy_out(&self, g: &ShmGetResult, req: &mut GetInto<'_>) -> Result<GetOutcome> {
        if g.status != Status::Ok {
            return Ok(GetOutcome::miss(g.status));
        }
        if !self.check_range(g.arena_offset, g.data_len) {
            return Err(Error::Protocol("arena offset out of range".into()));
        }
        if g.data_len > req.buf.len() as u64 {
            return Ok(GetOutcome::too_small(g.data_len, g.value_len));
        }
        let Some(generation) = self.generation(g.slot as usize) else {
            return Err(Error::Protocol("slot out of range".into()));
        };
        let dst = &mut req.buf[..g.data_len as usize];
        // SAFETY: range checked above. The daemon may reuse the slot while
        // we copy; the generation check below (and the checksum) catch it.
        let src = unsafe { self.slice(g.arena_offset, g.data_len as usize) };
        let whole = req.offset == 0 && g.data_len == g.value_len;
        let crc_ok = if whole {
            copy_with_crc(dst, src) == g.crc
        } else {
            dst.copy_from_slice(src);
            true
        };
        fence(Ordering::Acquire);
        if generation.load(Ordering::Acquire) != g.generation {
            // Evicted while we copied: a miss, not wrong bytes.
            return Ok(GetOutcome::miss(Status::NotFound));
        }
        if !crc_ok {
            return Ok(GetOutcome::miss(Status::Corrupt));
        }
        Ok(GetOutcome {
            status: Status::Ok,
            len: g.data_len,
            value_len: g.value_len,
            hot: g.hot,
        })
    }
}

/// This connection's put window: a memfd the client maps writable and passes
/// to the daemon with AUTH. Values are written here and the daemon copies
/// them into its arena; the client never maps memory that holds blocks
/// writable.
struct PutWindow {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: plain memory this connection owns; the daemon only reads it while
// a PUT_SHM request (which this connection waits on) is outstanding.
unsafe impl Send for PutWindow {}
unsafe impl Sync for PutWindow {}

impl PutWindow {
    /// A window of `len` bytes whose first `populate` bytes of each half
    /// (where `put` places its requests) are allocated and mapped now, so
    /// that puts of values up to that size never page-fault: the connect
    /// pays for it once instead of the first puts one fault per 4 KiB.
    fn create(len: usize, populate: usize) -> io::Result<PutWindow> {
        let len = len.next_multiple_of(4096);
        let window = PutWindow::map(sealed_memfd(c"tarn-kv-put-window", len)?, len)?;
        let half = window.half();
        for start in [0, half] {
            let n = populate.min(half).next_multiple_of(4096).min(len - start);
            // SAFETY: advice on a range of our own mapping. An old kernel
            // without MADV_POPULATE_WRITE faults the pages in on first use.
            unsafe { libc::madvise(window.base.add(start).cast(), n, libc::MADV_POPULATE_WRITE) };
        }
        Ok(window)
    }

    /// Maps `fd` (a sealed memfd of `len` bytes) as a window.
    fn map(fd: OwnedFd, len: usize) -> io::Result<PutWindow> {
        // SAFETY: a shared mapping of a memfd sealed against shrinking, so
        // it cannot fault; unmapped in Drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(PutWindow {
            fd,
            base: p.cast(),
            len,
        })
    }

    /// Where the second half of the window starts (see `ShmTransport::put`).
    fn half(&self) -> usize {
        (self.len / 2) / WINDOW_ALIGN * WINDOW_ALIGN
    }

    /// # Safety
    /// `offset + len <= self.len`, and no other borrow of the range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.base.add(offset), len) }
    }
}

impl Drop for PutWindow {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Values in a put window start on cache-line boundaries.
const WINDOW_ALIGN: usize = 64;

/// Shared memory: the control channel on the Unix socket, the tenant's arena
/// mapped read-only, and the put window.
pub struct ShmTransport {
    ch: Channel<UnixStream>,
    arena: Arena,
    window: PutWindow,
}

/// A block the daemon located in its arena, for a caller that copies it
/// itself (a DMA engine into GPU memory): where its bytes are in this
/// connection's mapping of the arena, and what to check once they are
/// copied ([`KvClient::verify_located`]).
#[derive(Debug, Clone, Copy)]
pub struct Located {
    pub status: Status,
    /// Address of the first byte in this process (0 on a miss).
    pub address: usize,
    pub len: u64,
    pub value_len: u64,
    crc: u32,
    slot: u32,
    generation: u32,
}

impl ShmTransport {
    /// GET_SHM without copying: where each entry's bytes are.
    async fn locate(&mut self, ns: &Scope, entries: &[GetEntry]) -> Result<Vec<Located>> {
        let id = self.ch.begin(Op::GetShm);
        self.ch.encode_gets(ns, entries.iter().copied());
        self.ch.send(&[]).await?;
        self.ch.recv(id, Op::GetShm).await?;
        let mut r = Reader::new(&self.ch.inp);
        if r.u32().map_err(proto)? as usize != entries.len() {
            return Err(Error::Protocol("GET_SHM response count mismatch".into()));
        }
        let mut out = Vec::with_capacity(entries.len());
        for _ in entries {
            let g = ShmGetResult::decode(&mut r).map_err(proto)?;
            if g.status != Status::Ok {
                out.push(Located {
                    status: g.status,
                    address: 0,
                    len: 0,
                    value_len: 0,
                    crc: 0,
                    slot: 0,
                    generation: 0,
                });
                continue;
            }
            if !self.arena.check_range(g.arena_offset, g.data_len)
                || self.arena.generation(g.slot as usize).is_none()
            {
                return Err(Error::Protocol("arena offset or slot out of range".into()));
            }
            // SAFETY: in range (checked above); only the address is taken.
            let address = unsafe { self.arena.slice(g.arena_offset, 0) }.as_ptr() as usize;
            out.push(Located {
                status: Status::Ok,
                address,
                len: g.data_len,
                value_len: g.value_len,
                crc: g.crc,
                slot: g.slot,
                generation: g.generation,
            });
        }
        Ok(out)
    }

    /// Per located block: its slot was not reused since it was located, and
    /// (`check_crc`, whole values) its bytes in the arena match their CRC.
    fn verify(&self, locs: &[Located], check_crc: bool) -> Vec<bool> {
        // Whole values are checked against their CRC (a range cannot be),
        // on several threads: this runs while a device's copy engine reads
        // the same bytes, and one core would take several times as long.
        let checked: Vec<usize> = (0..locs.len())
            .filter(|&i| {
                check_crc && locs[i].status == Status::Ok && locs[i].len == locs[i].value_len
            })
            .collect();
        let values: Vec<&[u8]> = checked
            .iter()
            .map(|&i| {
                // SAFETY: located in this mapping; the daemon may reuse
                // the slot meanwhile, which the generation check catches.
                unsafe {
                    std::slice::from_raw_parts(locs[i].address as *const u8, locs[i].len as usize)
                }
            })
            .collect();
        let crcs = tarn_wire::checksum::crc32c_many(&values, verify_threads());
        let mut crc_ok = vec![true; locs.len()];
        for (&i, crc) in checked.iter().zip(crcs) {
            crc_ok[i] = crc == locs[i].crc;
        }
        fence(Ordering::Acquire);
        locs.iter()
            .zip(crc_ok)
            .map(|(l, crc_ok)| {
                let current = l.status == Status::Ok
                    && self
                        .arena
                        .generation(l.slot as usize)
                        .is_some_and(|g| g.load(Ordering::Acquire) == l.generation);
                crc_ok && current
            })
            .collect()
    }

    async fn get(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        let id = self.ch.begin(Op::GetShm);
        self.ch.encode_gets(ns, reqs.iter().map(GetInto::entry));
        self.ch.send(&[]).await?;
        let mut out = Vec::with_capacity(reqs.len());
        // Through a mailbox the daemon publishes results as it finds them:
        // copy each block as soon as its result is there.
        if let Some(mb) = &self.ch.mailbox {
            let seq = self.ch.mailbox_seq;
            for (i, req) in reqs.iter_mut().enumerate() {
                let published =
                    || mb.progress(seq) > i || mb.response_seq().load(Ordering::Acquire) == seq;
                if !mailbox::spin_until(self.ch.response_spin, published) || mb.progress(seq) <= i {
                    // Parked daemon, or a response without streamed results
                    // (an error): the whole response decides the rest.
                    break;
                }
                let mut entry = [0u8; GET_SHM_RESULT_BYTES];
                let at = FRAME_HEADER_BYTES + 4 + i * GET_SHM_RESULT_BYTES;
                mb.read(Area::Response, at, &mut entry);
                let g = ShmGetResult::decode(&mut Reader::new(&entry)).map_err(proto)?;
                out.push(self.arena.copy_out(&g, req)?);
            }
        }
        if self.ch.mailbox.is_some() && out.len() == reqs.len() {
            // Every result came streamed: only the frame's header is left
            // to check, not its payload to copy out again.
            let len = 4 + reqs.len() * GET_SHM_RESULT_BYTES;
            self.ch.recv_known(id, Op::GetShm, len as u64).await?;
            return Ok(out);
        }
        self.ch.recv(id, Op::GetShm).await?;
        let mut r = Reader::new(&self.ch.inp);
        let n = r.u32().map_err(proto)? as usize;
        if n != reqs.len() {
            return Err(Error::Protocol("GET_SHM response count mismatch".into()));
        }
        for (i, req) in reqs.iter_mut().enumerate() {
            let g = ShmGetResult::decode(&mut r).map_err(proto)?;
            if i >= out.len() {
                out.push(self.arena.copy_out(&g, req)?);
            }
        }
        Ok(out)
    }

    /// Stores values. They go in requests of up to `PUT_PIPELINE_BYTES`,
    /// alternating between the two halves of the put window: the client
    /// copies the next request's values into one half while the daemon
    /// copies the last request's out of the other, so the two copies of a
    /// put overlap instead of adding up. A value larger than half the
    /// window goes alone, through the whole window.
    async fn put(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        let mut out = Vec::with_capacity(items.len());
        let half = self.window.half();
        let chunk = half.min(PUT_PIPELINE_BYTES);
        let mut pending: Option<(u64, usize)> = None;
        let mut region = 0;
        let mut start = 0;
        while start < items.len() {
            let first = items[start].data.len();
            if first > self.window.len {
                return Err(Error::Usage(format!(
                    "a value of {first} bytes does not fit the {}-byte put window",
                    self.window.len
                )));
            }
            let alone = first > half;
            if alone {
                // The whole window: the daemon must be done with both halves.
                if let Some((id, n)) = pending.take() {
                    out.extend(self.finish_put(id, n).await?);
                }
            }
            let (base, limit) = if alone {
                (0, self.window.len)
            } else {
                (region * half, chunk.max(first))
            };
            let mut used = 0usize;
            let mut end = start;
            while end < items.len() {
                let at = used.next_multiple_of(WINDOW_ALIGN);
                if at + items[end].data.len() > limit {
                    break;
                }
                used = at + items[end].data.len();
                end += 1;
            }
            let id = self.encode_put(ns, &items[start..end], parts.map(|p| &p[start..end]), base);
            if let Some((pid, n)) = pending.take() {
                out.extend(self.finish_put(pid, n).await?);
            }
            self.ch.send(&[]).await?;
            if alone {
                out.extend(self.finish_put(id, end - start).await?);
            } else {
                pending = Some((id, end - start));
                region ^= 1;
            }
            start = end;
        }
        if let Some((id, n)) = pending {
            out.extend(self.finish_put(id, n).await?);
        }
        Ok(out)
    }

    /// Copies values into the window from `base` on (checksumming as they
    /// are copied) and builds their PUT_SHM in the channel's buffer; returns
    /// its request id. The caller makes sure the daemon is not reading that
    /// part of the window.
    fn encode_put(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
        base: usize,
    ) -> u64 {
        let id = self.ch.begin(Op::PutShm);
        ns.head_parts(&mut self.ch.out, items.len(), parts.is_some());
        let mut at = base;
        for (i, it) in items.iter().enumerate() {
            at = at.next_multiple_of(WINDOW_ALIGN);
            let len = it.data.len();
            // SAFETY: the ranges fit the window (checked by `put`), do not
            // overlap, and the daemon reads them only once the request is sent.
            let dst = unsafe { self.window.slice_mut(at, len) };
            let crc = copy_with_crc(dst, it.data);
            PutShmEntry {
                digest: it.digest,
                len: len as u64,
                window_offset: at as u64,
                crc,
            }
            .encode(&mut self.ch.out);
            if let Some(p) = parts {
                p[i].encode(&mut self.ch.out);
            }
            at += len;
        }
        id
    }

    /// PUT_SHM of values already in the window (a registered buffer's:
    /// `items[i]` is `ios[i]`'s bytes of it), in requests of about
    /// [`REGISTERED_PIPELINE_BYTES`]: the checksums of the next request's values
    /// are computed while the daemon copies the previous one's.
    async fn put_in_window(
        &mut self,
        ns: &Scope,
        ios: &[WriteIo],
        items: &[PutFrom<'_>],
        batch: usize,
    ) -> Result<Vec<Status>> {
        let mut out = Vec::with_capacity(ios.len());
        let mut pending: Option<(u64, usize)> = None;
        let mut start = 0;
        while start < ios.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < ios.len()
                && end - start < batch
                && (end == start || bytes + ios[end].len <= REGISTERED_PIPELINE_BYTES)
            {
                bytes += ios[end].len;
                end += 1;
            }
            let id = self.ch.begin(Op::PutShm);
            ns.head(&mut self.ch.out, end - start, 0);
            for (io, it) in ios[start..end].iter().zip(&items[start..end]) {
                PutShmEntry {
                    digest: io.digest,
                    len: io.len as u64,
                    window_offset: io.buf_offset as u64,
                    crc: crc32c(it.data),
                }
                .encode(&mut self.ch.out);
            }
            if let Some((pid, n)) = pending.take() {
                out.extend(self.finish_put(pid, n).await?);
            }
            self.ch.send(&[]).await?;
            pending = Some((id, end - start));
            start = end;
        }
        if let Some((id, n)) = pending {
            out.extend(self.finish_put(id, n).await?);
        }
        Ok(out)
    }

    async fn finish_put(&mut self, id: u64, count: usize) -> Result<Vec<Status>> {
        self.ch.recv(id, Op::PutShm).await?;
        decode_statuses(&self.ch.inp, count).map_err(proto)
    }
}

/// A memfd of `len` bytes sealed against shrinking and growing: a daemon
/// that maps it can never fault on it.
fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls; the descriptor is owned at once.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscalls on our descriptor.
    let ok = unsafe {
        libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) == 0
            && libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
            ) == 0
    };
    if !ok {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Most bytes of one PUT_SHM request of a registered buffer's values: the
/// client checksums the next request's while the daemon copies.
const REGISTERED_PIPELINE_BYTES: usize = 4 << 20;

/// Most bytes of one PUT_SHM request when a put is split to overlap the
/// client's and the daemon's copies.
const PUT_PIPELINE_BYTES: usize = 1 << 20;
/// Most bytes of each half of the put window populated at connect (values
/// up to this size never fault; larger ones fault once, on first use).
const PUT_POPULATE_MAX_BYTES: usize = 4 << 20;

/// A way to reach the KV server. Every transport speaks the same protocol
/// (`tarn_wire::proto`); they differ in how values move: inside the frames
/// (TCP) or through the daemon's arena (shared memory).
#[allow(async_fn_in_trait)]
pub trait Transport {
    fn kind(&self) -> TransportKind;
    /// True after an I/O or protocol error: the stream may be mid-frame.
    fn broken(&mut self) -> &mut bool;
    async fn exists(&mut self, ns: &Scope, digests: &[Digest]) -> Result<ExistsReply>;
    async fn get_into(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>>;
    async fn put_from(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>>;
    async fn keys_op(
        &mut self,
        op: Op,
        ns: &Scope,
        digests: &[Digest],
        arg: u32,
    ) -> Result<Vec<Status>>;
    async fn stats(&mut self, ns: &Scope) -> Result<Vec<(String, u64)>>;
    async fn cluster(&mut self) -> Result<ClusterView>;
}

/// TCP: values inside the frames, read straight into the caller's buffers.
pub struct TcpTransport {
    ch: Channel<MaybeTls<TcpStream>>,
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn broken(&mut self) -> &mut bool {
        &mut self.ch.broken
    }
    async fn exists(&mut self, ns: &Scope, digests: &[Digest]) -> Result<ExistsReply> {
        self.ch.exists(ns, digests).await
    }
    async fn get_into(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        self.ch.get_tcp(ns, reqs).await
    }
    async fn put_from(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        self.ch.put_tcp(ns, items, parts).await
    }
    async fn keys_op(
        &mut self,
        op: Op,
        ns: &Scope,
        digests: &[Digest],
        arg: u32,
    ) -> Result<Vec<Status>> {
        self.ch.keys_op(op, ns, digests, arg).await
    }
    async fn stats(&mut self, ns: &Scope) -> Result<Vec<(String, u64)>> {
        self.ch.stats(ns).await
    }
    async fn cluster(&mut self) -> Result<ClusterView> {
        self.ch.cluster().await
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }
    fn broken(&mut self) -> &mut bool {
        &mut self.ch.broken
    }
    async fn exists(&mut self, ns: &Scope, digests: &[Digest]) -> Result<ExistsReply> {
        self.ch.exists(ns, digests).await
    }
    async fn get_into(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        self.get(ns, reqs).await
    }
    async fn put_from(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        self.put(ns, items, parts).await
    }
    async fn keys_op(
        &mut self,
        op: Op,
        ns: &Scope,
        digests: &[Digest],
        arg: u32,
    ) -> Result<Vec<Status>> {
        self.ch.keys_op(op, ns, digests, arg).await
    }
    async fn stats(&mut self, ns: &Scope) -> Result<Vec<(String, u64)>> {
        self.ch.stats(ns).await
    }
    async fn cluster(&mut self) -> Result<ClusterView> {
        self.ch.cluster().await
    }
}

/// The transport a client chose at connect.
pub enum AnyTransport {
    Tcp(TcpTransport),
    Shm(Box<ShmTransport>),
}

macro_rules! each {
    ($self:ident, $t:ident => $e:expr) => {
        match $self {
            AnyTransport::Tcp($t) => $e,
            AnyTransport::Shm($t) => $e,
        }
    };
}

impl Transport for AnyTransport {
    fn kind(&self) -> TransportKind {
        each!(self, t => t.kind())
    }
    fn broken(&mut self) -> &mut bool {
        each!(self, t => t.broken())
    }
    async fn exists(&mut self, ns: &Scope, digests: &[Digest]) -> Result<ExistsReply> {
        each!(self, t => t.exists(ns, digests).await)
    }
    async fn get_into(&mut self, ns: &Scope, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        each!(self, t => t.get_into(ns, reqs).await)
    }
    async fn put_from(
        &mut self,
        ns: &Scope,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        each!(self, t => t.put_from(ns, items, parts).await)
    }
    async fn keys_op(
        &mut self,
        op: Op,
        ns: &Scope,
        digests: &[Digest],
        arg: u32,
    ) -> Result<Vec<Status>> {
        each!(self, t => t.keys_op(op, ns, digests, arg).await)
    }
    async fn stats(&mut self, ns: &Scope) -> Result<Vec<(String, u64)>> {
        each!(self, t => t.stats(ns).await)
    }
    async fn cluster(&mut self) -> Result<ClusterView> {
        each!(self, t => t.cluster().await)
    }
}

/// The async KV client. Batches longer than the server's limit are split.
pub struct KvClient {
    t: AnyTransport,
    call_timeout: Option<Duration>,
    scope: Scope,
    server: HelloReply,
    auth: AuthReply,
    /// Where and how it connected (credentials resolved): for the
    /// connections attached to registered buffers.
    endpoint: String,
    opts: ConnectOptions,
    /// Connections whose put window is a registered buffer, by buffer.
    attached: Vec<(Weak<()>, KvClient)>,
}

/// True for the server's refusal of the credentials.
pub fn denied(e: &Error) -> bool {
    matches!(e, Error::Server(p) if p.code == ErrorCode::Denied)
}

/// True when a node refused a batch routed by an older view of the
/// cluster: ask it for CLUSTER and route again.
pub fn not_owner(e: &Error) -> bool {
    matches!(e, Error::Server(p) if p.code == ErrorCode::NotOwner)
}

/// `host:port` of an endpoint (`host:port`, `tcp://host:port`,
/// `tarn://host:port`, or `tls://host:port`), and whether it names TLS.
fn parse_endpoint(endpoint: &str) -> Result<(String, bool)> {
    let (e, tls) = match endpoint.strip_prefix("tls://") {
        Some(e) => (e, true),
        None => (
            endpoint
                .strip_prefix("tcp://")
                .or_else(|| endpoint.strip_prefix("tarn://"))
                .unwrap_or(endpoint),
            false,
        ),
    };
    if e.is_empty() || !e.contains(':') {
        return Err(Error::Usage(format!(
            "KV endpoint {endpoint:?} is not host:port"
        )));
    }
    Ok((e.trim_end_matches('/').to_string(), tls))
}

impl KvClient {
    /// Connects to `endpoint` (`host:port`, optionally `tcp://host:port`).
    pub async fn connect(endpoint: &str, opts: ConnectOptions) -> Result<KvClient> {
        if opts.namespace.len() > NAMESPACE_MAX_BYTES {
            return Err(Error::Usage(format!(
                "namespace of {} bytes exceeds {NAMESPACE_MAX_BYTES}",
                opts.namespace.len()
            )));
        }
        let creds = match &opts.credentials {
            Some(c) => c.clone(),
            None => Credentials::from_env_or_default().map_err(Error::Usage)?,
        };
        let (addr, tls_named) = parse_endpoint(endpoint)?;
        let tls = match (&opts.tls, tls_named) {
            (Some(c), _) => Some(c.clone()),
            (None, true) => Some(tarn_io::tls::client_config(None).map_err(Error::Usage)?),
            (None, false) => None,
        };
        let limit = Some(opts.connect_timeout);
        let connecting = async { Ok(TcpStream::connect(&addr).await?) };
        let tcp = bounded(limit, &format!("{addr} (connecting)"), connecting).await?;
        tcp.set_nodelay(true)?;
        let local = same_host(&tcp);
        let handshake = async { Ok(MaybeTls::connect(tcp, tls.as_ref(), &addr).await?) };
        let stream = bounded(limit, &format!("{addr} (TLS)"), handshake).await?;
        let mut ch = Channel::new(stream);
        ch.response_spin = opts.response_spin;
        // A server that accepts but never answers must not hang the caller.
        let hello = bounded(limit, &format!("{addr} (HELLO)"), ch.hello(0)).await?;
        let offered = hello.flags & HELLO_SHM_OFFERED != 0 && !hello.shm_socket.is_empty();
        // A socket file (a directory the server shares with this host's
        // pods) is tried from anywhere: it exists here only on the server's
        // host, and the instance id proves it is this server's.
        let file = hello.shm_socket.first() == Some(&b'/');
        let want_shm = opts.transport != TransportChoice::Tcp && offered && (local || file);
        if opts.transport == TransportChoice::Shm && !want_shm {
            return Err(Error::Usage(
                "shared memory needs a server on this host that offers it".into(),
            ));
        }
        if want_shm {
            let handshake = connect_shm(&hello, &opts, &creds);
            let shm = bounded(limit, "the shared-memory handshake", handshake).await;
            match shm {
                Ok((shm, auth)) => {
                    let t = AnyTransport::Shm(Box::new(shm));
                    return Ok(KvClient::made(t, endpoint, opts, creds, hello, auth));
                }
                // Refused credentials are refused over TCP too.
                Err(e) if opts.transport == TransportChoice::Shm || denied(&e) => return Err(e),
                Err(_) => {}
            }
        }
        let auth = bounded(
            limit,
            &format!("{addr} (AUTH)"),
            ch.auth(&creds, &hello.nonce),
        )
        .await?;
        let t = AnyTransport::Tcp(TcpTransport { ch });
        Ok(KvClient::made(t, endpoint, opts, creds, hello, auth))
    }

    /// A connected client; `opts` are kept (with the credentials used) for
    /// the connections of registered buffers.
    fn made(
        t: AnyTransport,
        endpoint: &str,
        opts: ConnectOptions,
        creds: Credentials,
        server: HelloReply,
        auth: AuthReply,
    ) -> KvClient {
        KvClient {
            t,
            call_timeout: opts.call_timeout,
            scope: Scope::new(opts.namespace.clone()),
            server,
            auth,
            endpoint: endpoint.to_string(),
            opts: ConnectOptions {
                credentials: Some(creds),
                ..opts
            },
            attached: Vec::new(),
        }
    }

    pub fn transport(&self) -> TransportKind {
        self.t.kind()
    }

    /// The tenant the credentials belong to.
    pub fn tenant(&self) -> &str {
        &self.auth.tenant
    }

    /// Namespace prefixes the tenant may use (an empty one: any).
    pub fn grants(&self) -> &[Vec<u8>] {
        &self.auth.grants
    }

    pub fn namespace(&self) -> &[u8] {
        &self.scope.namespace
    }

    pub fn set_namespace(&mut self, namespace: &[u8]) -> Result<()> {
        if namespace.len() > NAMESPACE_MAX_BYTES {
            return Err(Error::Usage("namespace too long".into()));
        }
        self.scope.namespace = namespace.to_vec();
        Ok(())
    }

    /// The cluster's KV members as this server routes by them (CLUSTER). A
    /// server outside a cluster, or one too old to know CLUSTER, answers
    /// an empty view (epoch 0, no members).
    pub async fn cluster_view(&mut self) -> Result<ClusterView> {
        self.check()?;
        let limit = self.call_timeout;
        let r = bounded(limit, SERVER, self.t.cluster()).await;
        match self.settle(r) {
            Err(Error::Server(e)) if e.code == ErrorCode::UnknownOp => Ok(ClusterView::default()),
            r => r,
        }
    }

    /// Routes the following calls' batches by `route` (None: unrouted).
    /// A node whose view is newer and different refuses them with
    /// `NotOwner` ([`not_owner`]).
    pub fn set_route(&mut self, route: Option<Route>) {
        self.scope.route = route;
    }

    /// Flags of the following calls' batches (`BATCH_FALLBACK`,
    /// `BATCH_COPY`; `BATCH_ROUTED` follows [`KvClient::set_route`]).
    pub fn set_batch_flags(&mut self, flags: u16) {
        self.scope.flags = flags & !BATCH_ROUTED;
    }

    /// Over shared memory: this connection's mapping of the arena (address,
    /// bytes), read-only. It stays mapped as long as the client lives.
    pub fn arena_mapping(&self) -> Option<(usize, usize)> {
        match &self.t {
            AnyTransport::Shm(t) => {
                // SAFETY: offset 0, length 0: only the base address is taken.
                let base = unsafe { t.arena.slice(0, 0) }.as_ptr() as usize;
                Some((base, t.arena.len()))
            }
            AnyTransport::Tcp(_) => None,
        }
    }

    /// Over shared memory: where each value (whole, or `len` bytes from
    /// `offset`) is in [`KvClient::arena_mapping`], for a caller that copies
    /// the bytes itself (into GPU memory by DMA) and then calls
    /// [`KvClient::verify_located`]. Nothing is copied here.
    pub async fn locate(&mut self, reqs: &[(Digest, u64, Option<u64>)]) -> Result<Vec<Located>> {
        self.check()?;
        let mut out = Vec::with_capacity(reqs.len());
        for chunk in reqs.chunks(self.batch()) {
            let entries: Vec<GetEntry> = chunk
                .iter()
                .map(|&(digest, offset, len)| GetEntry {
                    digest,
                    offset,
                    length: len.unwrap_or(LENGTH_TO_END),
                })
                .collect();
            let ns = self.scope.clone();
            let limit = self.call_timeout;
            let AnyTransport::Shm(t) = &mut self.t else {
                return Err(Error::Usage("locating blocks needs shared memory".into()));
            };
            let r = bounded(limit, SERVER, t.locate(&ns, &entries)).await;
            out.extend(self.settle(r)?);
        }
        Ok(out)
    }

    /// After copying located blocks: per block, whether the copy holds the
    /// block (its slot was not reused meanwhile, and with `check_crc` its
    /// bytes in the arena match the value's CRC: call it while a DMA runs
    /// to check without a copy of its own, and `check_crc = false` once it
    /// finished, for reuse only). False means a miss.
    pub fn verify_located(&self, locs: &[Located], check_crc: bool) -> Vec<bool> {
        match &self.t {
            AnyTransport::Shm(t) => t.verify(locs, check_crc),
            AnyTransport::Tcp(_) => vec![false; locs.len()],
        }
    }

    /// Largest value the server accepts.
    pub fn value_max_bytes(&self) -> u64 {
        self.server.value_max_bytes
    }

    fn batch(&self) -> usize {
        (self.server.batch_max_keys as usize).clamp(1, BATCH_MAX_KEYS)
    }

    fn check(&mut self) -> Result<()> {
        if *self.t.broken() {
            return Err(Error::Broken);
        }
        Ok(())
    }

    /// Marks the connection unusable after an I/O or protocol error: the
    /// stream may be mid-frame. A server refusal leaves it usable.
    fn settle<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if !matches!(e, Error::Server(_) | Error::Usage(_)) {
                *self.t.broken() = true;
            }
        }
        // A call that got no answer says where the mailbox stood: which
        // request is posted, which answered, and who is parked.
        match (r, &self.t) {
            (Err(Error::Io(e)), AnyTransport::Shm(t)) if e.kind() == io::ErrorKind::TimedOut => {
                Err(Error::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{e} ({})", t.ch.mailbox_state()),
                )))
            }
            (r, _) => r,
        }
    }

    /// Which keys are stored, and how many leading ones are all present.
    pub async fn exists(&mut self, digests: &[Digest]) -> Result<ExistsReply> {
        self.check()?;
        let mut all = ExistsReply {
            leading_hits: 0,
            present: Vec::with_capacity(digests.len()),
        };
        for chunk in digests.chunks(self.batch()) {
            let ns = self.scope.clone();
            let limit = self.call_timeout;
            let r = bounded(limit, SERVER, self.t.exists(&ns, chunk)).await;
            let r = self.settle(r)?;
            all.present.extend(r.present);
        }
        all.leading_hits = all.present.iter().take_while(|p| **p).count() as u32;
        Ok(all)
    }

    /// Reads values (or ranges) into the caller's buffers.
    pub async fn get_into(&mut self, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        self.check()?;
        let mut out = Vec::with_capacity(reqs.len());
        let batch = self.batch();
        for chunk in reqs.chunks_mut(batch) {
            let ns = self.scope.clone();
            let limit = self.call_timeout;
            let r = bounded(limit, SERVER, self.t.get_into(&ns, chunk)).await;
            out.extend(self.settle(r)?);
        }
        Ok(out)
    }

    /// Stores values. A key already stored answers `AlreadyExists` (success).
    pub async fn put_from(&mut self, items: &[PutFrom<'_>]) -> Result<Vec<Status>> {
        self.put_any(items, None).await
    }

    /// Stores parts of values: `items[i].data` is bytes `[parts[i].offset,
    /// parts[i].offset + len)` of a value of `parts[i].value_len` bytes. A
    /// value becomes visible once every byte of it was put, by this client
    /// or others (each tensor-parallel rank puts the heads it holds); until
    /// then it is a miss, and one missing parts 60 s after its first is
    /// dropped. `Ok` per part: it is in.
    pub async fn put_parts(
        &mut self,
        items: &[PutFrom<'_>],
        parts: &[Part],
    ) -> Result<Vec<Status>> {
        if parts.len() != items.len() {
            return Err(Error::Usage(format!(
                "{} parts for {} values",
                parts.len(),
                items.len()
            )));
        }
        self.fits(parts.iter().map(|p| p.value_len))?;
        self.put_any(items, Some(parts)).await
    }

    /// Refuses values (their lengths) the server would not take.
    fn fits(&self, mut lens: impl Iterator<Item = u64>) -> Result<()> {
        let max = self.server.value_max_bytes;
        match lens.find(|l| *l > max) {
            Some(big) => Err(Error::Usage(format!(
                "value of {big} bytes exceeds the server's maximum of {max}"
            ))),
            None => Ok(()),
        }
    }

    async fn put_any(
        &mut self,
        items: &[PutFrom<'_>],
        parts: Option<&[Part]>,
    ) -> Result<Vec<Status>> {
        self.check()?;
        self.fits(items.iter().map(|i| i.data.len() as u64))?;
        let mut out = Vec::with_capacity(items.len());
        let batch = self.batch();
        for (n, chunk) in items.chunks(batch).enumerate() {
            let ns = self.scope.clone();
            let limit = self.call_timeout;
            let p = parts.map(|p| &p[n * batch..n * batch + chunk.len()]);
            let r = bounded(limit, SERVER, self.t.put_from(&ns, chunk, p)).await;
            out.extend(self.settle(r)?);
        }
        Ok(out)
    }

    /// Reads into regions of a registered buffer. Regions must lie inside it
    /// and must not overlap.
    pub async fn get_registered(
        &mut self,
        buf: &mut RegisteredBuffer,
        ios: &[ReadIo],
    ) -> Result<Vec<GetOutcome>> {
        let mut order: Vec<usize> = (0..ios.len()).collect();
        order.sort_by_key(|i| ios[*i].buf_offset);
        let mut end = 0usize;
        for i in &order {
            let io = &ios[*i];
            let stop = io
                .buf_offset
                .checked_add(io.buf_len)
                .filter(|e| *e <= buf.len())
                .ok_or_else(|| {
                    Error::Usage(format!("read {i}: region outside the registered buffer"))
                })?;
            if io.buf_offset < end {
                return Err(Error::Usage(format!("read {i}: region overlaps another")));
            }
            end = stop;
        }
        let base = buf.as_mut_slice().as_mut_ptr();
        let mut reqs: Vec<GetInto<'_>> = ios
            .iter()
            .map(|io| GetInto {
                digest: io.digest,
                offset: io.value_offset,
                len: io.len,
                // SAFETY: inside the buffer (checked) and disjoint from every
                // other region (checked), all under our &mut borrow of buf.
                buf: unsafe { std::slice::from_raw_parts_mut(base.add(io.buf_offset), io.buf_len) },
            })
            .collect();
        self.get_into(&mut reqs).await
    }

    /// Stores regions of a registered buffer (regions may overlap). Over
    /// shared memory the
    /// buffer is the put window of a connection of its own (opened on the
    /// first put from it, closed after the buffer is dropped): the daemon
    /// copies each value straight from it, one copy in all. Over TCP the
    /// values travel in the frames as for `put_from`.
    pub async fn put_registered(
        &mut self,
        buf: &RegisteredBuffer,
        ios: &[WriteIo],
    ) -> Result<Vec<Status>> {
        let data = buf.as_slice();
        let mut items = Vec::with_capacity(ios.len());
        for (i, io) in ios.iter().enumerate() {
            let slice = io
                .buf_offset
                .checked_add(io.len)
                .and_then(|e| data.get(io.buf_offset..e))
                .ok_or_else(|| {
                    Error::Usage(format!("write {i}: region outside the registered buffer"))
                })?;
            items.push(PutFrom {
                digest: io.digest,
                data: slice,
            });
        }
        if self.transport() != TransportKind::Shm {
            return self.put_from(&items).await;
        }
        self.check()?;
        self.fits(items.iter().map(|i| i.data.len() as u64))?;
        let scope = self.scope.clone();
        let side = self.attached_to(buf).await?;
        side.scope = scope;
        let ns = side.scope.clone();
        let (limit, batch) = (side.call_timeout, side.batch());
        let AnyTransport::Shm(t) = &mut side.t else {
            unreachable!("attached connections are over shared memory")
        };
        let r = bounded(limit, SERVER, t.put_in_window(&ns, ios, &items, batch)).await;
        side.settle(r)
    }

    /// The connection whose put window is `buf`, opened the first time;
    /// those of buffers dropped since are closed.
    async fn attached_to(&mut self, buf: &RegisteredBuffer) -> Result<&mut KvClient> {
        self.attached
            .retain_mut(|(alive, c)| alive.strong_count() > 0 && !*c.t.broken());
        let at = self
            .attached
            .iter()
            .position(|(alive, _)| std::ptr::eq(alive.as_ptr(), Arc::as_ptr(&buf.alive)));
        let at = match at {
            Some(i) => i,
            None => {
                let opts = ConnectOptions {
                    transport: TransportChoice::Shm,
                    put_window_fd: Some((buf.fd.clone(), buf.len.next_multiple_of(4096))),
                    ..self.opts.clone()
                };
                let c = Box::pin(KvClient::connect(&self.endpoint, opts)).await?;
                self.attached.push((Arc::downgrade(&buf.alive), c));
                self.attached.len() - 1
            }
        };
        Ok(&mut self.attached[at].1)
    }

    async fn keys_op(&mut self, op: Op, digests: &[Digest], arg: u32) -> Result<Vec<Status>> {
        self.check()?;
        let mut out = Vec::with_capacity(digests.len());
        for chunk in digests.chunks(self.batch()) {
            let ns = self.scope.clone();
            let limit = self.call_timeout;
            let r = bounded(limit, SERVER, self.t.keys_op(op, &ns, chunk, arg)).await;
            out.extend(self.settle(r)?);
        }
        Ok(out)
    }

    /// Marks blocks recently used.
    pub async fn touch(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.keys_op(Op::Touch, digests, 0).await
    }

    /// Protects blocks from eviction for `lease` (capped by the server) or
    /// until unpinned or this connection closes.
    pub async fn pin(&mut self, digests: &[Digest], lease: Duration) -> Result<Vec<Status>> {
        let ms = lease.as_millis().min(u32::MAX as u128) as u32;
        self.keys_op(Op::Pin, digests, ms.max(1)).await
    }

    pub async fn unpin(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.keys_op(Op::Unpin, digests, 0).await
    }

    pub async fn delete(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.keys_op(Op::Delete, digests, 0).await
    }

    /// Server counters, with this client's namespace's (prefixed `namespace.`).
    pub async fn stats(&mut self) -> Result<Vec<(String, u64)>> {
        self.check()?;
        let ns = self.scope.clone();
        let limit = self.call_timeout;
        let r = bounded(limit, SERVER, self.t.stats(&ns)).await;
        self.settle(r)
    }
}

/// Who a call waits for, in timeout errors.
const SERVER: &str = "the KV server";

/// `f`, failing with `TimedOut` ("no answer from `what` within …") if it
/// takes longer than `limit`.
async fn bounded<T>(
    limit: Option<Duration>,
    what: &str,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let Some(limit) = limit else {
        return f.await;
    };
    tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
        Err(Error::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer from {what} within {limit:?}"),
        )))
    })
}

/// True when the peer is this host (loopback, or our own address).
fn same_host(s: &TcpStream) -> bool {
    match (s.peer_addr(), s.local_addr()) {
        (Ok(p), Ok(l)) => p.ip().is_loopback() || p.ip() == l.ip(),
        _ => false,
    }
}

async fn connect_shm(
    tcp_hello: &HelloReply,
    opts: &ConnectOptions,
    creds: &Credentials,
) -> Result<(ShmTransport, AuthReply)> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    let std_stream = if tcp_hello.shm_socket.first() == Some(&b'/') {
        let path = std::ffi::OsStr::from_bytes(&tcp_hello.shm_socket);
        std::os::unix::net::UnixStream::connect(path)?
    } else {
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(&tcp_hello.shm_socket)?;
        std::os::unix::net::UnixStream::connect_addr(&addr)?
    };
    std_stream.set_nonblocking(true)?;
    let s = UnixStream::from_std(std_stream)?;
    let mut out = Vec::new();
    begin_frame(&mut out, Op::Hello as u16, 1);
    Hello {
        version_min: VERSION_MIN,
        version_max: VERSION_MAX,
        flags: HELLO_WANT_SHM
            | if opts.shm_mailbox {
                HELLO_WANT_MAILBOX
            } else {
                0
            },
    }
    .encode(&mut out);
    finish_frame(&mut out, 0);
    send_uds(&s, &out, &[]).await?;
    let (h, payload, _) = recv_frame_uds(&s).await?;
    if h.op != Op::Hello as u16 | RESPONSE_BIT {
        return Err(Error::Protocol(
            "no HELLO reply on the shared-memory socket".into(),
        ));
    }
    let hello = HelloReply::decode(&payload).map_err(proto)?;
    if hello.instance_id != tcp_hello.instance_id {
        return Err(Error::Protocol(
            "the shared-memory socket belongs to another server".into(),
        ));
    }
    // The put window goes to the daemon with AUTH; the arena (and the
    // mailbox) come back with the reply.
    let value_max = usize::try_from(tcp_hello.value_max_bytes).unwrap_or(usize::MAX);
    let window = match &opts.put_window_fd {
        Some((fd, len)) => PutWindow::map(fd.try_clone()?, *len)?,
        None => PutWindow::create(
            opts.put_window_bytes.max(value_max),
            value_max.clamp(PUT_PIPELINE_BYTES, PUT_POPULATE_MAX_BYTES),
        )?,
    };
    let client_nonce = auth::nonce();
    begin_frame(&mut out, Op::Auth as u16, 2);
    auth_request(creds, &hello.nonce, &client_nonce, AUTH_WINDOW).encode(&mut out);
    finish_frame(&mut out, 0);
    send_uds(&s, &out, &[window.fd.as_raw_fd()]).await?;
    let (h, payload, fds) = recv_frame_uds(&s).await?;
    if h.op != Op::Auth as u16 | RESPONSE_BIT {
        return Err(Error::Protocol(
            "no AUTH reply on the shared-memory socket".into(),
        ));
    }
    let reply = AuthReply::decode(&payload).map_err(proto)?;
    check_server_proof(creds, &hello.nonce, &client_nonce, &reply)?;
    if reply.flags & AUTH_SHM == 0 || reply.flags & AUTH_WINDOW_ACCEPTED == 0 {
        return Err(Error::Protocol(
            "the server did not set up shared memory for this connection".into(),
        ));
    }
    let mut fds = fds.into_iter();
    let fd = fds
        .next()
        .ok_or_else(|| Error::Protocol("no arena descriptor in the AUTH reply".into()))?;
    let arena = Arena::open(fd)?;
    let mailbox = if reply.flags & AUTH_MAILBOX != 0 {
        let fd = fds
            .next()
            .ok_or_else(|| Error::Protocol("no mailbox descriptor in the AUTH reply".into()))?;
        Some(Mailbox::open(fd)?)
    } else {
        None
    };
    if arena.len() as u64 != reply.arena_bytes {
        return Err(Error::Protocol(
            "arena size differs from the AUTH reply".into(),
        ));
    }
    let mut ch = Channel::new(s);
    ch.next_id = 3;
    ch.response_spin = opts.response_spin;
    ch.mailbox = mailbox;
    Ok((ShmTransport { ch, arena, window }, reply))
}

async fn send_uds(s: &UnixStream, data: &[u8], fds: &[i32]) -> Result<()> {
    let mut written = 0;
    let mut fds = fds;
    while written < data.len() {
        s.writable().await?;
        match s.try_io(tokio::io::Interest::WRITABLE, || {
            fdpass::send(s.as_raw_fd(), &data[written..], fds)
        }) {
            Ok(n) => {
                written += n;
                fds = &[];
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// One whole handshake reply (with any descriptors), never reading past it:
/// an error frame becomes [`Error::Server`].
async fn recv_frame_uds(s: &UnixStream) -> Result<(FrameHeader, Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut head = [0u8; FRAME_HEADER_BYTES];
    recv_exact_uds(s, &mut head, &mut fds).await?;
    let h = FrameHeader::decode(&head).map_err(proto)?;
    if h.len > 4096 {
        return Err(Error::Protocol("oversized handshake reply".into()));
    }
    let mut payload = vec![0u8; h.len as usize];
    recv_exact_uds(s, &mut payload, &mut fds).await?;
    if h.op == Op::Error as u16 | RESPONSE_BIT {
        return Err(Error::Server(decode_error(&payload)));
    }
    Ok((h, payload, fds))
}

async fn recv_exact_uds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        s.readable().await?;
        match s.try_io(tokio::io::Interest::READABLE, || {
            fdpass::recv(s.as_raw_fd(), &mut buf[got..])
        }) {
            Ok((0, _)) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
            Ok((n, f)) => {
                got += n;
                fds.extend(f);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Blocking wrapper: the same calls on a private current-thread runtime.
pub struct BlockingKvClient {
    rt: tokio::runtime::Runtime,
    inner: KvClient,
}

impl BlockingKvClient {
    pub fn connect(endpoint: &str, opts: ConnectOptions) -> Result<BlockingKvClient> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let inner = rt.block_on(KvClient::connect(endpoint, opts))?;
        Ok(BlockingKvClient { rt, inner })
    }
    pub fn transport(&self) -> TransportKind {
        self.inner.transport()
    }
    pub fn client(&mut self) -> &mut KvClient {
        &mut self.inner
    }
    pub fn exists(&mut self, digests: &[Digest]) -> Result<ExistsReply> {
        self.rt.block_on(self.inner.exists(digests))
    }
    pub fn get_into(&mut self, reqs: &mut [GetInto<'_>]) -> Result<Vec<GetOutcome>> {
        self.rt.block_on(self.inner.get_into(reqs))
    }
    pub fn put_from(&mut self, items: &[PutFrom<'_>]) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.put_from(items))
    }
    pub fn put_parts(&mut self, items: &[PutFrom<'_>], parts: &[Part]) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.put_parts(items, parts))
    }
    pub fn touch(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.touch(digests))
    }
    pub fn get_registered(
        &mut self,
        buf: &mut RegisteredBuffer,
        ios: &[ReadIo],
    ) -> Result<Vec<GetOutcome>> {
        self.rt.block_on(self.inner.get_registered(buf, ios))
    }
    pub fn put_registered(
        &mut self,
        buf: &RegisteredBuffer,
        ios: &[WriteIo],
    ) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.put_registered(buf, ios))
    }
    pub fn pin(&mut self, digests: &[Digest], lease: Duration) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.pin(digests, lease))
    }
    pub fn unpin(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.unpin(digests))
    }
    pub fn delete(&mut self, digests: &[Digest]) -> Result<Vec<Status>> {
        self.rt.block_on(self.inner.delete(digests))
    }
    pub fn cluster_view(&mut self) -> Result<ClusterView> {
        self.rt.block_on(self.inner.cluster_view())
    }
    pub fn locate(&mut self, reqs: &[(Digest, u64, Option<u64>)]) -> Result<Vec<Located>> {
        self.rt.block_on(self.inner.locate(reqs))
    }
    pub fn verify_located(&self, locs: &[Located], check_crc: bool) -> Vec<bool> {
        self.inner.verify_located(locs, check_crc)
    }
    pub fn stats(&mut self) -> Result<Vec<(String, u64)>> {
        self.rt.block_on(self.inner.stats())
    }
}

#[allow(dead_code)]
fn _assert_send() {
    fn is_send<T: Send>() {}
    is_send::<KvClient>();
    let _: Option<SocketAddr> = None;
}

/// Threads a located batch's checksums are computed on: the cores this
/// process may run on (read once).
fn verify_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}
